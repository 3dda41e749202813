#include "coordinator/api/openai/protocol.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "base/field_error.h"
#include "base/json.h"
#include "coordinator/api/request_validation.h"
#include "grammar/json_schema.h"

namespace shardserve::openai {
namespace {

using Json = nlohmann::ordered_json;

// JSON type names as the errors say them.
const char* TypeName(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "an integer";
    case Json::value_t::number_float: return "a number";
    case Json::value_t::string: return "a string";
    case Json::value_t::array: return "an array";
    case Json::value_t::object: return "an object";
    default: return "a value of another type";
  }
}

absl::Status WrongType(absl::string_view field, absl::string_view want, const Json& got) {
  return InvalidField(field, absl::StrCat("must be ", want, ", got ", TypeName(got)));
}

// A number kept as a float, as the gRPC API does; its range is PrepareGeneration's to check.
absl::Status Float32(absl::string_view field, const Json& v, float* out) {
  if (!v.is_number()) return WrongType(field, "a number", v);
  const double d = v.get<double>();
  // Sampling parameters are float32 on the wire to the workers: 1e308 would become inf there.
  if (!std::isfinite(d) || std::fabs(d) > 1e30) {
    return InvalidField(field, absl::StrCat("must be a number of magnitude at most 1e30 (a float32), got ", d));
  }
  *out = static_cast<float>(d);
  return absl::OkStatus();
}

// The body's fields, each read at most once; absent and null are the same.
class Fields {
 public:
  explicit Fields(const Json& body) : body_(body) {}

  const Json* Get(const char* name) const {
    auto it = body_.find(name);
    return it == body_.end() || it->is_null() ? nullptr : &*it;
  }
  absl::Status String(const char* name, std::string* out) const {
    const Json* v = Get(name);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_string()) return WrongType(name, "a string", *v);
    *out = v->get<std::string>();
    return absl::OkStatus();
  }
  absl::Status Bool(const char* name, bool* out) const {
    const Json* v = Get(name);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_boolean()) return WrongType(name, "a boolean", *v);
    *out = v->get<bool>();
    return absl::OkStatus();
  }
  // A number (Float32).
  absl::Status Float(const char* name, float* out) const {
    const Json* v = Get(name);
    if (v == nullptr) return absl::OkStatus();
    return Float32(name, *v, out);
  }
  // An integer in [lo, hi] (the wire's bounds; the meaningful range is checked later).
  absl::Status Int(const char* name, int64_t lo, int64_t hi, std::optional<int64_t>* out) const {
    const Json* v = Get(name);
    if (v == nullptr) return absl::OkStatus();
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi)) {
      return InvalidField(name, absl::StrCat("must be in [", lo, ", ", hi, "], got ", v->get<uint64_t>()));
    }
    if (!v->is_number_integer()) return WrongType(name, "an integer", *v);
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) return InvalidField(name, absl::StrCat("must be in [", lo, ", ", hi, "], got ", x));
    *out = x;
    return absl::OkStatus();
  }

 private:
  const Json& body_;
};

#define SHARDSERVE_OPENAI_CHECK(expr)            \
  do {                                           \
    if (absl::Status s_ = (expr); !s_.ok()) return s_; \
  } while (0)

// One message's content as a string: a string as it is, a list of text parts joined by "\n" (as
// vLLM does for text-only models); null stays null (an assistant turn with tool calls).
absl::Status NormalizeContent(const std::string& field, Json* content) {
  if (content->is_null() || content->is_string()) return absl::OkStatus();
  if (!content->is_array()) return WrongType(field, "a string, an array of content parts or null", *content);
  std::vector<std::string> texts;
  for (size_t i = 0; i < content->size(); ++i) {
    const std::string part_field = absl::StrCat(field, "[", i, "]");
    const Json& part = (*content)[i];
    if (!part.is_object()) return WrongType(part_field, "an object", part);
    auto type = part.find("type");
    if (type == part.end() || !type->is_string()) return InvalidField(absl::StrCat(part_field, ".type"), "must be a string");
    if (*type != "text") {
      return InvalidField(absl::StrCat(part_field, ".type"),
                          absl::StrCat("'", type->get<std::string>(), "' parts are not supported: this model takes text only"));
    }
    auto text = part.find("text");
    if (text == part.end() || !text->is_string()) return InvalidField(absl::StrCat(part_field, ".text"), "must be a string");
    texts.push_back(text->get<std::string>());
  }
  *content = absl::StrJoin(texts, "\n");
  return absl::OkStatus();
}

// `holder` (field) has a "function" object whose "name" is a tool name as OpenAI takes it: 1 to
// kMaxToolNameLength letters, digits, '_' or '-'.
absl::Status CheckFunction(const std::string& field, const Json& holder) {
  auto function = holder.find("function");
  if (function == holder.end() || !function->is_object()) {
    return InvalidField(absl::StrCat(field, ".function"), "must be an object");
  }
  auto name = function->find("name");
  const std::string name_field = absl::StrCat(field, ".function.name");
  if (name == function->end() || !name->is_string()) return InvalidField(name_field, "must be a string");
  const std::string& n = name->get_ref<const std::string&>();
  if (n.empty() || n.size() > static_cast<size_t>(kMaxToolNameLength)) {
    return InvalidField(name_field, absl::StrCat("must be 1 to ", kMaxToolNameLength, " characters, got ", n.size()));
  }
  for (char c : n) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') {
      return InvalidField(name_field, absl::StrCat("'", n, "' may hold only letters, digits, '_' and '-'"));
    }
  }
  return absl::OkStatus();
}

// An assistant message's tool_calls: [{id, type: "function", function: {name, arguments}}], the
// arguments (a JSON object's text, as OpenAI sends them) parsed into the object that templates
// render (as transformers expects them, and vLLM does).
absl::Status NormalizeToolCalls(const std::string& message_field, Json* message) {
  auto calls = message->find("tool_calls");
  if (calls == message->end() || calls->is_null()) return absl::OkStatus();
  const std::string field = absl::StrCat(message_field, ".tool_calls");
  if (!calls->is_array()) return WrongType(field, "an array", *calls);
  if (calls->size() > static_cast<size_t>(kMaxToolCallsPerMessage)) {
    return InvalidField(field, absl::StrCat("at most ", kMaxToolCallsPerMessage, " calls, got ", calls->size()));
  }
  for (size_t j = 0; j < calls->size(); ++j) {
    const std::string call_field = absl::StrCat(field, "[", j, "]");
    Json& call = (*calls)[j];
    if (!call.is_object()) return WrongType(call_field, "an object", call);
    if (auto id = call.find("id"); id != call.end() && !id->is_null() && !id->is_string()) {
      return WrongType(absl::StrCat(call_field, ".id"), "a string", *id);
    }
    SHARDSERVE_OPENAI_CHECK(CheckFunction(call_field, call));
    Json* function = &call["function"];
    auto arguments = function->find("arguments");
    if (arguments == function->end() || arguments->is_null()) {
      (*function)["arguments"] = Json::object();
    } else if (arguments->is_string()) {
      Json parsed = Json::parse(arguments->get<std::string>(), nullptr, /*allow_exceptions=*/false);
      if (parsed.is_discarded() || !parsed.is_object()) {
        return InvalidField(absl::StrCat(call_field, ".function.arguments"), "must be the text of a JSON object");
      }
      *arguments = std::move(parsed);
    } else if (!arguments->is_object()) {
      return WrongType(absl::StrCat(call_field, ".function.arguments"), "a string (a JSON object's text)", *arguments);
    }
  }
  return absl::OkStatus();
}

// tool_choice and parallel_tool_calls.
absl::Status ParseToolChoice(const Fields& f, Request* r) {
  SHARDSERVE_OPENAI_CHECK(f.Bool("parallel_tool_calls", &r->parallel_tool_calls));
  const Json* choice = f.Get("tool_choice");
  if (choice == nullptr) return absl::OkStatus();
  const bool have_tools = r->tools.is_array() && !r->tools.empty();
  if (choice->is_string()) {
    const std::string c = choice->get<std::string>();
    if (c == "auto") return absl::OkStatus();
    if (c == "none") {
      r->tool_choice = ToolChoice::kNone;
      return absl::OkStatus();
    }
    if (c == "required") {
      if (!have_tools) return InvalidField("tool_choice", "\"required\" needs tools");
      r->tool_choice = ToolChoice::kRequired;
      return absl::OkStatus();
    }
    return InvalidField("tool_choice", absl::StrCat("'", c.substr(0, 64), "' is not one of \"none\", \"auto\", \"required\""));
  }
  if (!choice->is_object()) return WrongType("tool_choice", "a string or an object", *choice);
  auto type = choice->find("type");
  if (type == choice->end() || *type != "function") return InvalidField("tool_choice.type", "must be \"function\"");
  SHARDSERVE_OPENAI_CHECK(CheckFunction("tool_choice", *choice));
  const std::string& name = choice->at("function").at("name").get_ref<const std::string&>();
  bool found = false;
  if (have_tools) {
    for (const Json& tool : r->tools) found = found || tool.at("function").at("name") == name;
  }
  if (!found) return InvalidField("tool_choice.function.name", absl::StrCat("'", name, "' is not one of the tools"));
  r->tool_choice = ToolChoice::kNamed;
  r->named_tool = name;
  return absl::OkStatus();
}

absl::Status ParseMessages(const Fields& f, Request* r) {
  const Json* messages = f.Get("messages");
  if (messages == nullptr) return InvalidField("messages", "is required");
  if (!messages->is_array()) return WrongType("messages", "an array", *messages);
  if (messages->empty()) return InvalidField("messages", "must have at least one message");
  r->messages = *messages;
  for (size_t i = 0; i < r->messages.size(); ++i) {
    const std::string field = absl::StrCat("messages[", i, "]");
    Json& m = r->messages[i];
    if (!m.is_object()) return WrongType(field, "an object", m);
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) return InvalidField(absl::StrCat(field, ".role"), "must be a string");
    auto content = m.find("content");
    if (content != m.end()) SHARDSERVE_OPENAI_CHECK(NormalizeContent(absl::StrCat(field, ".content"), &*content));
  }
  const Json before = r->messages;
  for (size_t i = 0; i < r->messages.size(); ++i) {
    SHARDSERVE_OPENAI_CHECK(NormalizeToolCalls(absl::StrCat("messages[", i, "]"), &r->messages[i]));
  }
  if (r->messages != before) r->messages_with_argument_text = before;
  if (const Json* tools = f.Get("tools")) {
    if (!tools->is_array()) return WrongType("tools", "an array", *tools);
    if (tools->size() > static_cast<size_t>(kMaxTools)) {
      return InvalidField("tools", absl::StrCat("at most ", kMaxTools, " tools, got ", tools->size()));
    }
    std::set<std::string> names;
    for (size_t i = 0; i < tools->size(); ++i) {
      const std::string field = absl::StrCat("tools[", i, "]");
      const Json& tool = (*tools)[i];
      if (!tool.is_object()) return WrongType(field, "an object", tool);
      auto type = tool.find("type");
      if (type == tool.end() || *type != "function") {
        return InvalidField(absl::StrCat(field, ".type"), "must be \"function\" (the only kind of tool supported)");
      }
      SHARDSERVE_OPENAI_CHECK(CheckFunction(field, tool));
      const Json* function = &tool.at("function");
      const std::string& name = function->at("name").get_ref<const std::string&>();
      if (!names.insert(name).second) {
        return InvalidField(absl::StrCat(field, ".function.name"), absl::StrCat("'", name, "' names another tool too"));
      }
      if (auto d = function->find("description"); d != function->end() && !d->is_null() && !d->is_string()) {
        return WrongType(absl::StrCat(field, ".function.description"), "a string", *d);
      }
      if (auto p = function->find("parameters"); p != function->end() && !p->is_null() && !p->is_object()) {
        return WrongType(absl::StrCat(field, ".function.parameters"), "a JSON Schema object", *p);
      }
    }
    r->tools = *tools;
  }
  SHARDSERVE_OPENAI_CHECK(ParseToolChoice(f, r));
  if (const Json* kwargs = f.Get("chat_template_kwargs")) {
    if (!kwargs->is_object()) return WrongType("chat_template_kwargs", "an object", *kwargs);
    r->chat_template_kwargs = *kwargs;
  }
  // documents (vLLM's, for retrieval templates such as Command R's): the template variable of that
  // name, as transformers' apply_chat_template(documents=...) passes it.
  if (const Json* documents = f.Get("documents")) {
    if (!documents->is_array()) return WrongType("documents", "an array of objects", *documents);
    for (size_t i = 0; i < documents->size(); ++i) {
      if (!(*documents)[i].is_object()) return WrongType(absl::StrCat("documents[", i, "]"), "an object", (*documents)[i]);
    }
    if (!r->chat_template_kwargs.is_object()) r->chat_template_kwargs = Json::object();
    if (r->chat_template_kwargs.contains("documents")) {
      return InvalidField("documents", "given beside chat_template_kwargs.documents: send one");
    }
    r->chat_template_kwargs["documents"] = *documents;
  }
  // reasoning_effort (OpenAI's field for reasoning models): the template variable of that name, which
  // gpt-oss's template writes into its system message ("Reasoning: high"; medium when unset);
  // templates that do not read it ignore it, as vLLM's do.
  std::string effort;
  SHARDSERVE_OPENAI_CHECK(f.String("reasoning_effort", &effort));
  if (f.Get("reasoning_effort") != nullptr) {
    if (effort != "low" && effort != "medium" && effort != "high") {
      return InvalidField("reasoning_effort", absl::StrCat("must be \"low\", \"medium\" or \"high\", got \"", effort, "\""));
    }
    if (!r->chat_template_kwargs.is_object()) r->chat_template_kwargs = Json::object();
    if (auto it = r->chat_template_kwargs.find("reasoning_effort");
        it != r->chat_template_kwargs.end() && *it != Json(effort)) {
      return InvalidField("reasoning_effort", absl::StrCat("\"", effort, "\" where chat_template_kwargs.reasoning_effort is ",
                                                           it->dump(), ": send one"));
    }
    r->chat_template_kwargs["reasoning_effort"] = effort;
  }
  SHARDSERVE_OPENAI_CHECK(f.Bool("add_generation_prompt", &r->add_generation_prompt));
  SHARDSERVE_OPENAI_CHECK(f.Bool("continue_final_message", &r->continue_final_message));
  if (r->continue_final_message) {
    // The prompt ends inside the final message: no new turn opened after it (unset means false here).
    if (f.Get("add_generation_prompt") != nullptr && r->add_generation_prompt) {
      return InvalidField("continue_final_message",
                          "cannot be used with add_generation_prompt true: the prompt either opens a new assistant "
                          "message or continues the final one (send add_generation_prompt false)");
    }
    r->add_generation_prompt = false;
  }
  return absl::OkStatus();
}

// One prompt: a string, or token ids; `field` names it ("prompt", or "prompt[2]" in a batch).
absl::StatusOr<Request::Prompt> ParseOnePrompt(const Json& p, const std::string& field) {
  Request::Prompt prompt;
  if (p.is_string()) {
    prompt.text = p.get<std::string>();
    return prompt;
  }
  if (!p.is_array()) return WrongType(field, "a string or an array of token ids", p);
  prompt.ids.reserve(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    const Json& id = p[i];
    if (!id.is_number_integer()) return WrongType(absl::StrCat(field, "[", i, "]"), "an integer token id", id);
    const int64_t x = id.get<int64_t>();
    if (x < 0 || x > std::numeric_limits<int32_t>::max()) {
      return InvalidField(absl::StrCat(field, "[", i, "]"), absl::StrCat(x, " is not a token id"));
    }
    prompt.ids.push_back(static_cast<int32_t>(x));
  }
  prompt.is_ids = true;
  return prompt;
}

// `prompt`: a string, token ids, or a batch: a list of strings and token id lists.
absl::Status ParsePrompt(const Fields& f, Request* r) {
  const Json* prompt = f.Get("prompt");
  if (prompt == nullptr) return InvalidField("prompt", "is required");
  const bool batch = prompt->is_array() && !prompt->empty() && ((*prompt)[0].is_string() || (*prompt)[0].is_array());
  if (!batch) {
    absl::StatusOr<Request::Prompt> one = ParseOnePrompt(*prompt, "prompt");
    if (!one.ok()) return one.status();
    r->prompts.push_back(*std::move(one));
    return absl::OkStatus();
  }
  if (prompt->size() > static_cast<size_t>(kMaxPrompts)) {
    return InvalidField("prompt", absl::StrCat("a batch of ", prompt->size(), " prompts; at most ", kMaxPrompts));
  }
  for (size_t i = 0; i < prompt->size(); ++i) {
    absl::StatusOr<Request::Prompt> one = ParseOnePrompt((*prompt)[i], absl::StrCat("prompt[", i, "]"));
    if (!one.ok()) return one.status();
    r->prompts.push_back(*std::move(one));
  }
  return absl::OkStatus();
}

// A string or an array of strings (stop, bad_words), into `out`.
absl::Status ParseStrings(const Fields& f, const char* name, google::protobuf::RepeatedPtrField<std::string>* out) {
  const Json* v = f.Get(name);
  if (v == nullptr) return absl::OkStatus();
  if (v->is_string()) {
    out->Add(v->get<std::string>());
    return absl::OkStatus();
  }
  if (!v->is_array()) return WrongType(name, "a string or an array of strings", *v);
  for (size_t i = 0; i < v->size(); ++i) {
    if (!(*v)[i].is_string()) return WrongType(absl::StrCat(name, "[", i, "]"), "a string", (*v)[i]);
    out->Add((*v)[i].get<std::string>());
  }
  return absl::OkStatus();
}

// An array of token ids (stop_token_ids, allowed_token_ids), into `out`; the vocabulary is
// PrepareGeneration's to check.
absl::Status ParseTokenIds(const Fields& f, const char* name, google::protobuf::RepeatedField<int32_t>* out) {
  const Json* ids = f.Get(name);
  if (ids == nullptr) return absl::OkStatus();
  if (!ids->is_array()) return WrongType(name, "an array of token ids", *ids);
  for (size_t i = 0; i < ids->size(); ++i) {
    const Json& id = (*ids)[i];
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return InvalidField(absl::StrCat(name, "[", i, "]"), "must be a token id");
    }
    out->Add(id.get<int32_t>());
  }
  return absl::OkStatus();
}

// logit_bias: {"token id": bias}, as OpenAI sends it (ids as decimal strings). Only its shape is
// checked here (an object, each key a token id, each bias a float32); the number of ids, the ids
// against the vocabulary and the biases' range are PrepareGeneration's to check, for both APIs.
absl::Status ParseLogitBias(const Fields& f, v1::SamplingParams* s) {
  const Json* bias = f.Get("logit_bias");
  if (bias == nullptr) return absl::OkStatus();
  if (!bias->is_object()) return WrongType("logit_bias", "an object of token id to bias", *bias);
  for (auto it = bias->begin(); it != bias->end(); ++it) {
    const std::string& key = it.key();
    int64_t id = -1;
    const bool digits = !key.empty() && key.size() <= 10 &&
                        std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits) id = std::stoll(key);
    if (!digits || id > std::numeric_limits<int32_t>::max()) {
      return InvalidField("logit_bias", absl::StrCat("key '", key.substr(0, 32), "' is not a token id"));
    }
    float b = 0;
    SHARDSERVE_OPENAI_CHECK(Float32(absl::StrCat("logit_bias[", key, "]"), *it, &b));
    (*s->mutable_logit_bias())[static_cast<int32_t>(id)] = b;
  }
  return absl::OkStatus();
}

// Fields this server does not implement: refused when they would change the answer, so that a
// client never gets a silently different one.
absl::Status RefuseUnsupported(const Fields& f) {
  if (const Json* suffix = f.Get("suffix"); suffix != nullptr && !(suffix->is_string() && suffix->empty())) {
    return InvalidField("suffix", "is not supported");
  }
  if (const Json* best_of = f.Get("best_of"); best_of != nullptr && !(best_of->is_number_integer() && *best_of == 1)) {
    return InvalidField("best_of", "only 1 is supported; use n for several choices");
  }
  return absl::OkStatus();
}

// ---- Structured outputs: one constraint per request, from whichever field names it ----

// Text of a constraint: a string of at most kMaxStructuredTextBytes bytes.
absl::Status ConstraintText(const std::string& field, const Json& v, std::string* out) {
  if (!v.is_string()) return WrongType(field, "a string", v);
  const std::string& t = v.get_ref<const std::string&>();
  if (t.empty() || t.size() > static_cast<size_t>(kMaxStructuredTextBytes)) {
    return InvalidField(field, absl::StrCat("must be 1 to ", kMaxStructuredTextBytes, " bytes, got ", t.size()));
  }
  *out = t;
  return absl::OkStatus();
}

// A JSON Schema given as an object (or, for guided_json, its text), as its compact JSON text.
absl::Status ConstraintSchema(const std::string& field, const Json& v, bool text_allowed, std::string* out) {
  if (v.is_string() && text_allowed) return ConstraintText(field, v, out);
  if (!v.is_object() && !v.is_boolean()) {
    return WrongType(field, text_allowed ? "a JSON Schema (an object, or its text)" : "a JSON Schema object", v);
  }
  *out = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (out->size() > static_cast<size_t>(kMaxStructuredTextBytes)) {
    return InvalidField(field, absl::StrCat("must be at most ", kMaxStructuredTextBytes, " bytes of JSON, got ", out->size()));
  }
  return absl::OkStatus();
}

absl::Status ConstraintChoices(const std::string& field, const Json& v, v1::StructuredOutput* out) {
  if (!v.is_array()) return WrongType(field, "an array of strings", v);
  if (v.empty() || v.size() > static_cast<size_t>(kMaxStructuredChoices)) {
    return InvalidField(field, absl::StrCat("must hold 1 to ", kMaxStructuredChoices, " strings, got ", v.size()));
  }
  v1::StructuredChoices* choices = out->mutable_choices();
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string f = absl::StrCat(field, "[", i, "]");
    if (!v[i].is_string()) return WrongType(f, "a string", v[i]);
    const std::string& c = v[i].get_ref<const std::string&>();
    if (c.empty() || c.size() > static_cast<size_t>(kMaxStructuredChoiceBytes)) {
      return InvalidField(f, absl::StrCat("must be 1 to ", kMaxStructuredChoiceBytes, " bytes, got ", c.size()));
    }
    choices->add_choices(c);
  }
  return absl::OkStatus();
}

// response_format: text (none), json_object, or json_schema {name, schema, strict}.
absl::Status ParseResponseFormat(const Json& format, v1::StructuredOutput* out, std::string* field) {
  if (!format.is_object()) return WrongType("response_format", "an object", format);
  auto type = format.find("type");
  if (type == format.end() || !type->is_string()) return InvalidField("response_format.type", "must be a string");
  const std::string t = type->get<std::string>();
  if (t == "text") return absl::OkStatus();
  if (t == "json_object") {
    out->set_json_object(true);
    *field = "response_format";
    return absl::OkStatus();
  }
  if (t != "json_schema") {
    return InvalidField("response_format.type", absl::StrCat("'", t.substr(0, 64), "' is not one of \"text\", \"json_object\", \"json_schema\""));
  }
  auto js = format.find("json_schema");
  if (js == format.end() || !js->is_object()) return InvalidField("response_format.json_schema", "must be an object");
  if (auto name = js->find("name"); name != js->end() && !name->is_null() && !name->is_string()) {
    return WrongType("response_format.json_schema.name", "a string", *name);
  }
  if (auto strict = js->find("strict"); strict != js->end() && !strict->is_null() && !strict->is_boolean()) {
    return WrongType("response_format.json_schema.strict", "a boolean", *strict);
  }
  auto schema = js->find("schema");
  if (schema == js->end() || schema->is_null()) return InvalidField("response_format.json_schema.schema", "is required");
  *field = "response_format.json_schema.schema";
  return ConstraintSchema(*field, *schema, /*text_allowed=*/false, out->mutable_json_schema());
}

// structured_outputs (vLLM >= 0.10): {json | regex | choice | grammar | json_object}, one of them.
absl::Status ParseStructuredOutputs(const Json& so, v1::StructuredOutput* out, std::string* field) {
  if (!so.is_object()) return WrongType("structured_outputs", "an object", so);
  std::vector<std::string> set;
  for (const char* key : {"json", "regex", "choice", "grammar", "json_object"}) {
    if (auto it = so.find(key); it != so.end() && !it->is_null()) set.push_back(key);
  }
  if (set.size() > 1) {
    return InvalidField(absl::StrCat("structured_outputs.", set[1]),
                        absl::StrCat("cannot be combined with structured_outputs.", set[0], ": one constraint per request"));
  }
  if (set.empty()) return absl::OkStatus();
  *field = absl::StrCat("structured_outputs.", set[0]);
  const Json& v = so.at(set[0]);
  if (set[0] == "json") return ConstraintSchema(*field, v, /*text_allowed=*/true, out->mutable_json_schema());
  if (set[0] == "regex") return ConstraintText(*field, v, out->mutable_regex());
  if (set[0] == "choice") return ConstraintChoices(*field, v, out);
  if (set[0] == "grammar") return ConstraintText(*field, v, out->mutable_grammar());
  if (!v.is_boolean()) return WrongType(*field, "a boolean", v);
  if (v.get<bool>()) {
    out->set_json_object(true);
  } else {
    field->clear();
  }
  return absl::OkStatus();
}

// The request's constraint (docs/structured-outputs.md): response_format, the guided_* fields or
// structured_outputs; at most one of them.
absl::Status ParseConstraint(const Fields& f, Request* r) {
  std::string first;  // the field of the constraint found first
  auto take = [&](const char* name, auto parse) -> absl::Status {
    const Json* v = f.Get(name);
    if (v == nullptr) return absl::OkStatus();
    v1::StructuredOutput so;
    std::string field;
    SHARDSERVE_OPENAI_CHECK(parse(*v, &so, &field));
    if (field.empty()) return absl::OkStatus();  // response_format text: no constraint
    if (!first.empty()) {
      return InvalidField(name, absl::StrCat("cannot be combined with ", first, ": one constraint per request"));
    }
    first = name;
    r->constraint_field = field;
    *r->sampling.mutable_structured_output() = std::move(so);
    return absl::OkStatus();
  };
  SHARDSERVE_OPENAI_CHECK(take("response_format", ParseResponseFormat));
  SHARDSERVE_OPENAI_CHECK(take("guided_json", [](const Json& v, v1::StructuredOutput* so, std::string* field) {
    *field = "guided_json";
    return ConstraintSchema(*field, v, /*text_allowed=*/true, so->mutable_json_schema());
  }));
  SHARDSERVE_OPENAI_CHECK(take("guided_regex", [](const Json& v, v1::StructuredOutput* so, std::string* field) {
    *field = "guided_regex";
    return ConstraintText(*field, v, so->mutable_regex());
  }));
  SHARDSERVE_OPENAI_CHECK(take("guided_choice", [](const Json& v, v1::StructuredOutput* so, std::string* field) {
    *field = "guided_choice";
    return ConstraintChoices(*field, v, so);
  }));
  SHARDSERVE_OPENAI_CHECK(take("guided_grammar", [](const Json& v, v1::StructuredOutput* so, std::string* field) {
    *field = "guided_grammar";
    return ConstraintText(*field, v, so->mutable_grammar());
  }));
  SHARDSERVE_OPENAI_CHECK(take("structured_outputs", ParseStructuredOutputs));
  return absl::OkStatus();
}

// A tool's `parameters` schema ({"type": "object"} when it has none).
Json ToolParameters(const Json& tool) {
  const Json& function = tool.at("function");
  auto p = function.find("parameters");
  return p == function.end() || p->is_null() ? Json{{"type", "object"}} : *p;
}

// Rewrites the references of a schema nested in the calls' schema (HoistDefinitions): "#" becomes
// `self` (*self_referred set), "#/$defs/NAME" "#/$defs/<tool>.$defs.NAME" and "#/definitions/NAME"
// "#/$defs/<tool>.definitions.NAME".
// Values (const, enum, default, examples) are not schemas and stay as they are.
void RewriteRefs(const std::string& tool, const std::string& self, Json* s, bool* self_referred) {
  if (s->is_array()) {
    for (Json& item : *s) RewriteRefs(tool, self, &item, self_referred);
    return;
  }
  if (!s->is_object()) return;
  for (auto& [key, value] : s->items()) {
    if (key == "const" || key == "enum" || key == "default" || key == "examples") continue;
    if (key == "$ref" && value.is_string()) {
      const std::string ref = value.get<std::string>();
      if (ref == "#") {
        value = self;
        *self_referred = true;
      }
      for (const absl::string_view key : {"$defs", "definitions"}) {
        const std::string prefix = absl::StrCat("#/", key, "/");
        if (absl::StartsWith(ref, prefix)) value = absl::StrCat("#/$defs/", tool, ".", key, ".", ref.substr(prefix.size()));
      }
      continue;
    }
    RewriteRefs(tool, self, &value, self_referred);
  }
}

// Tool `tool`'s parameters schema as a part of the "required" calls' schema, where its $ref "#",
// "#/$defs/..." and "#/definitions/..." no longer name its own root: its definitions move to the
// calls' `defs` as "<tool>.$defs.NAME" and "<tool>.definitions.NAME" (tool names hold no '.', so
// no two tools' meet), and a schema that refers to its own root moves there whole, as "<tool>",
// referred to in its place.
Json HoistDefinitions(const std::string& tool, Json params, Json* defs) {
  if (!params.is_object()) return params;
  const std::string self = absl::StrCat("#/$defs/", tool);
  bool self_referred = false;
  for (const char* key : {"$defs", "definitions"}) {
    auto it = params.find(key);
    if (it == params.end() || !it->is_object()) continue;
    for (auto& [name, def] : it->items()) {
      RewriteRefs(tool, self, &def, &self_referred);
      (*defs)[absl::StrCat(tool, ".", key, ".", name)] = std::move(def);
    }
    params.erase(it);
  }
  RewriteRefs(tool, self, &params, &self_referred);
  if (self_referred) {
    (*defs)[tool] = std::move(params);
    return Json{{"$ref", self}};
  }
  return params;
}

// The parameters schema of each tool a forced call may name, converted alone, so that a schema the
// grammar cannot take is refused naming its own field (tools[i].function.parameters and the path
// inside it), not a path inside the calls' combined constraint.
absl::Status CheckForcedToolParameters(const Request& r) {
  for (size_t i = 0; i < r.tools.size(); ++i) {
    const Json& tool = r.tools[i];
    if (r.tool_choice == ToolChoice::kNamed && tool.at("function").at("name") != r.named_tool) continue;
    const absl::StatusOr<std::string> gbnf =
        grammar::JsonSchemaToGbnf(ToolParameters(tool).dump(-1, ' ', false, Json::error_handler_t::replace));
    if (!gbnf.ok()) return InvalidField(absl::StrCat("tools[", i, "].function.parameters"), gbnf.status().message());
  }
  return absl::OkStatus();
}

// tool_choice "required" or named: the grammar of the calls (vLLM's), as the request's constraint.
absl::Status ForcedToolConstraint(Request* r) {
  if (r->tool_choice != ToolChoice::kRequired && r->tool_choice != ToolChoice::kNamed) return absl::OkStatus();
  SHARDSERVE_OPENAI_CHECK(CheckForcedToolParameters(*r));
  if (r->sampling.has_structured_output()) {
    return InvalidField("tool_choice", absl::StrCat("\"required\" or a named function cannot be combined with ",
                                                    r->constraint_field, ": one constraint per request"));
  }
  Json schema;
  if (r->tool_choice == ToolChoice::kNamed) {
    for (const Json& tool : r->tools) {
      if (tool.at("function").at("name") == r->named_tool) schema = ToolParameters(tool);
    }
  } else {
    Json any = Json::array();
    Json defs = Json::object();
    for (const Json& tool : r->tools) {
      const std::string name = tool.at("function").at("name").get<std::string>();
      any.push_back({{"type", "object"},
                     {"properties", {{"name", {{"const", name}}}, {"parameters", HoistDefinitions(name, ToolParameters(tool), &defs)}}},
                     {"required", {"name", "parameters"}}});
    }
    schema = {{"type", "array"}, {"minItems", 1}, {"items", {{"anyOf", std::move(any)}}}};
    if (!r->parallel_tool_calls) schema["maxItems"] = 1;
    if (!defs.empty()) schema["$defs"] = std::move(defs);
  }
  r->constraint_field = "tool_choice";
  return ConstraintSchema("tool_choice", schema, /*text_allowed=*/false,
                          r->sampling.mutable_structured_output()->mutable_json_schema());
}

}  // namespace

absl::Status InvalidField(absl::string_view field, absl::string_view what) { return FieldErrorStatus(field, what); }

absl::Status HarmonyForcedToolConstraint(Request* r, const HarmonyMarkers& markers) {
  if (r->tool_choice != ToolChoice::kRequired && r->tool_choice != ToolChoice::kNamed) return absl::OkStatus();
  std::vector<std::pair<std::string, std::string>> tools;
  for (const Json& tool : r->tools) {
    const std::string name = tool.at("function").at("name").get<std::string>();
    if (r->tool_choice == ToolChoice::kNamed && name != r->named_tool) continue;
    tools.emplace_back(name, ToolParameters(tool).dump(-1, ' ', false, Json::error_handler_t::replace));
  }
  absl::StatusOr<std::string> gbnf = HarmonyCallGrammar(tools, markers);
  if (!gbnf.ok()) return InvalidField("tool_choice", gbnf.status().message());
  r->constraint_field = "tool_choice";
  r->sampling.mutable_structured_output()->set_grammar(*std::move(gbnf));
  return absl::OkStatus();
}

std::string ParamOf(const absl::Status& status) {
  const std::optional<FieldError> error = FieldErrorOf(status);
  return error.has_value() ? error->field : std::string();
}

// A request body: a JSON object.
absl::StatusOr<Json> ParseBody(absl::string_view body) {
  absl::StatusOr<Json> parsed = ParseJson<Json>(body, "the body");
  if (!parsed.ok()) return parsed.status();
  if (!parsed->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("the body must be a JSON object, got ", TypeName(*parsed)));
  }
  return parsed;
}

absl::StatusOr<Request> ParseRequest(Endpoint endpoint, absl::string_view body) {
  absl::StatusOr<Json> parsed = ParseBody(body);
  if (!parsed.ok()) return parsed.status();
  const Json json = *std::move(parsed);

  const Fields f(json);
  Request r;
  r.endpoint = endpoint;
  const bool chat = endpoint == Endpoint::kChatCompletions;
  SHARDSERVE_OPENAI_CHECK(f.String("model", &r.model));
  if (f.Get("model") == nullptr) return InvalidField("model", "is required");
  SHARDSERVE_OPENAI_CHECK(chat ? ParseMessages(f, &r) : ParsePrompt(f, &r));
  SHARDSERVE_OPENAI_CHECK(RefuseUnsupported(f));

  std::optional<int64_t> n, max_tokens, max_completion_tokens, top_k, seed, top_logprobs;
  SHARDSERVE_OPENAI_CHECK(f.Int("n", 1, kMaxChoices, &n));
  r.n = static_cast<int>(n.value_or(1));
  if (const int64_t choices = static_cast<int64_t>(r.prompts.size()) * r.n; choices > kMaxBatchChoices) {
    return InvalidField("n", absl::StrCat(r.prompts.size(), " prompts of ", r.n, " choices each are ", choices,
                                          " choices; at most ", kMaxBatchChoices, " a request"));
  }
  SHARDSERVE_OPENAI_CHECK(f.Bool("stream", &r.stream));
  if (const Json* options = f.Get("stream_options")) {
    if (!options->is_object()) return WrongType("stream_options", "an object", *options);
    if (!r.stream) return InvalidField("stream_options", "is only allowed with stream: true");
    for (auto [key, out] : {std::pair{"include_usage", &r.include_usage},
                            std::pair{"continuous_usage_stats", &r.continuous_usage_stats}}) {
      if (auto it = options->find(key); it != options->end() && !it->is_null()) {
        if (!it->is_boolean()) return WrongType(absl::StrCat("stream_options.", key), "a boolean", *it);
        *out = it->get<bool>();
      }
    }
  }
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  SHARDSERVE_OPENAI_CHECK(f.Int("max_tokens", 1, kInt32Max, &max_tokens));
  if (chat) SHARDSERVE_OPENAI_CHECK(f.Int("max_completion_tokens", 1, kInt32Max, &max_completion_tokens));
  if (max_tokens.has_value() && max_completion_tokens.has_value() && *max_tokens != *max_completion_tokens) {
    return InvalidField("max_completion_tokens", "differs from max_tokens: send one of them");
  }
  r.max_tokens = max_completion_tokens.has_value() ? max_completion_tokens : max_tokens;

  v1::SamplingParams& s = r.sampling;
  // OpenAI's default temperature is 1 (sampling), unlike the gRPC API's 0 (greedy).
  float temperature = 1, top_p = 1, min_p = 0, presence = 0, frequency = 0, repetition = 0;
  SHARDSERVE_OPENAI_CHECK(f.Float("temperature", &temperature));
  SHARDSERVE_OPENAI_CHECK(f.Float("top_p", &top_p));
  SHARDSERVE_OPENAI_CHECK(f.Float("min_p", &min_p));
  SHARDSERVE_OPENAI_CHECK(f.Float("presence_penalty", &presence));
  SHARDSERVE_OPENAI_CHECK(f.Float("frequency_penalty", &frequency));
  SHARDSERVE_OPENAI_CHECK(f.Float("repetition_penalty", &repetition));
  // top_k: -1 is vLLM's "no limit", as 0 is the gRPC API's.
  SHARDSERVE_OPENAI_CHECK(f.Int("top_k", -1, kInt32Max, &top_k));
  SHARDSERVE_OPENAI_CHECK(f.Int("seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), &seed));
  s.set_temperature(temperature);
  // top_p 0 would mean "no limit" to the gRPC API; to OpenAI it is the narrowest nucleus.
  if (f.Get("top_p") != nullptr && !(top_p > 0 && top_p <= 1)) {
    return InvalidField("top_p", absl::StrCat("must be in (0, 1], got ", top_p));
  }
  s.set_top_p(top_p);
  s.set_min_p(min_p);
  s.set_presence_penalty(presence);
  s.set_frequency_penalty(frequency);
  s.set_repetition_penalty(repetition);
  s.set_top_k(static_cast<int32_t>(std::max<int64_t>(0, top_k.value_or(0))));
  if (seed.has_value()) s.set_seed(static_cast<uint64_t>(*seed));
  SHARDSERVE_OPENAI_CHECK(ParseStrings(f, "stop", s.mutable_stop()));
  SHARDSERVE_OPENAI_CHECK(ParseTokenIds(f, "stop_token_ids", s.mutable_stop_token_ids()));
  // vLLM's allowed_token_ids and bad_words.
  SHARDSERVE_OPENAI_CHECK(ParseTokenIds(f, "allowed_token_ids", s.mutable_allowed_token_ids()));
  SHARDSERVE_OPENAI_CHECK(ParseStrings(f, "bad_words", s.mutable_bad_words()));
  bool ignore_eos = false;
  SHARDSERVE_OPENAI_CHECK(f.Bool("ignore_eos", &ignore_eos));
  s.set_ignore_eos(ignore_eos);
  SHARDSERVE_OPENAI_CHECK(ParseLogitBias(f, &s));
  std::optional<int64_t> min_tokens;
  SHARDSERVE_OPENAI_CHECK(f.Int("min_tokens", 0, kInt32Max, &min_tokens));
  s.set_min_tokens(static_cast<int32_t>(min_tokens.value_or(0)));
  // vLLM's output controls.
  if (f.Get("skip_special_tokens") != nullptr) {
    bool skip = true;
    SHARDSERVE_OPENAI_CHECK(f.Bool("skip_special_tokens", &skip));
    s.set_skip_special_tokens(skip);
  }
  bool include_stop = false;
  SHARDSERVE_OPENAI_CHECK(f.Bool("include_stop_str_in_output", &include_stop));
  s.set_include_stop_str_in_output(include_stop);
  std::optional<int64_t> truncate;
  SHARDSERVE_OPENAI_CHECK(f.Int("truncate_prompt_tokens", 1, kInt32Max, &truncate));
  s.set_truncate_prompt_tokens(static_cast<int32_t>(truncate.value_or(0)));

  // logprobs: chat takes a boolean and top_logprobs; completions an integer, the alternatives.
  if (chat) {
    bool logprobs = false;
    SHARDSERVE_OPENAI_CHECK(f.Bool("logprobs", &logprobs));
    SHARDSERVE_OPENAI_CHECK(f.Int("top_logprobs", 0, kInt32Max, &top_logprobs));
    if (top_logprobs.value_or(0) > 0 && !logprobs) return InvalidField("top_logprobs", "needs logprobs: true");
    s.set_logprobs(logprobs);
    s.set_top_logprobs(static_cast<int32_t>(top_logprobs.value_or(0)));
  } else {
    std::optional<int64_t> logprobs;
    if (const Json* v = f.Get("logprobs"); v != nullptr && v->is_boolean()) {
      return WrongType("logprobs", "an integer (the number of alternatives, 0 to 20)", *v);
    }
    SHARDSERVE_OPENAI_CHECK(f.Int("logprobs", 0, kInt32Max, &logprobs));
    s.set_logprobs(logprobs.has_value());
    s.set_top_logprobs(static_cast<int32_t>(logprobs.value_or(0)));
  }
  SHARDSERVE_OPENAI_CHECK(f.Bool("echo", &r.echo));
  SHARDSERVE_OPENAI_CHECK(f.Bool("return_tokens_as_token_ids", &r.return_tokens_as_token_ids));
  // vLLM's prompt_logprobs; a completion's echo with logprobs (lm-evaluation-harness's
  // loglikelihood) asks for them too, as many alternatives as its logprobs.
  std::optional<int64_t> prompt_logprobs;
  SHARDSERVE_OPENAI_CHECK(f.Int("prompt_logprobs", 0, kInt32Max, &prompt_logprobs));
  if (r.echo && !chat && s.logprobs() && !prompt_logprobs.has_value()) prompt_logprobs = s.top_logprobs();
  if (prompt_logprobs.has_value()) {
    if (r.stream) {
      return InvalidField(f.Get("prompt_logprobs") != nullptr ? "prompt_logprobs" : "echo",
                          "the prompt's log-probabilities come in a whole answer only: send stream: false");
    }
    s.set_prompt_logprobs(static_cast<int32_t>(*prompt_logprobs));
  }
  SHARDSERVE_OPENAI_CHECK(f.String("user", &r.user));
  SHARDSERVE_OPENAI_CHECK(f.String("request_id", &r.request_id));
  SHARDSERVE_OPENAI_CHECK(CheckRequestId("request_id", r.request_id));
  SHARDSERVE_OPENAI_CHECK(ParseConstraint(f, &r));
  SHARDSERVE_OPENAI_CHECK(ForcedToolConstraint(&r));
  return r;
}

absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body) {
  absl::StatusOr<Json> parsed = ParseBody(body);
  if (!parsed.ok()) return parsed.status();
  const Json json = *std::move(parsed);
  const Fields f(json);
  TokenizeRequest r;
  SHARDSERVE_OPENAI_CHECK(f.String("model", &r.model));
  r.chat = f.Get("messages") != nullptr;
  if (r.chat == (f.Get("prompt") != nullptr)) {
    return InvalidField(r.chat ? "prompt" : "messages",
                        r.chat ? "send a prompt or messages, not both" : "is required (or a prompt)");
  }
  if (r.chat) {
    r.messages.endpoint = Endpoint::kChatCompletions;
    SHARDSERVE_OPENAI_CHECK(ParseMessages(f, &r.messages));
    r.add_special_tokens = false;  // the chat template writes them
  } else {
    SHARDSERVE_OPENAI_CHECK(f.String("prompt", &r.prompt));
  }
  SHARDSERVE_OPENAI_CHECK(f.Bool("add_special_tokens", &r.add_special_tokens));
  SHARDSERVE_OPENAI_CHECK(f.Bool("return_token_strs", &r.return_token_strs));
  return r;
}

absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(absl::string_view body) {
  absl::StatusOr<Json> parsed = ParseBody(body);
  if (!parsed.ok()) return parsed.status();
  const Json json = *std::move(parsed);
  const Fields f(json);
  DetokenizeRequest r;
  SHARDSERVE_OPENAI_CHECK(f.String("model", &r.model));
  const Json* tokens = f.Get("tokens");
  if (tokens == nullptr) return InvalidField("tokens", "is required");
  if (!tokens->is_array()) return WrongType("tokens", "an array of token ids", *tokens);
  absl::StatusOr<Request::Prompt> ids = ParseOnePrompt(*tokens, "tokens");
  if (!ids.ok()) return ids.status();
  r.tokens = std::move(ids->ids);
  return r;
}

v1::GenerateRequest ToGenerateRequest(const Request& request, int prompt, int index, int32_t max_tokens,
                                      const std::vector<int32_t>* prompt_ids) {
  v1::GenerateRequest g;
  if (prompt_ids != nullptr) {
    g.mutable_token_ids()->mutable_ids()->Add(prompt_ids->begin(), prompt_ids->end());
  } else if (prompt >= 0 && static_cast<size_t>(prompt) < request.prompts.size()) {
    g.set_text(request.prompts[prompt].text);
  }  // (else no prompt: PrepareGeneration says so)
  *g.mutable_sampling() = request.sampling;
  g.mutable_sampling()->set_max_tokens(max_tokens);
  if (request.sampling.has_seed()) g.mutable_sampling()->set_seed(request.sampling.seed() + static_cast<uint64_t>(index));
  return g;
}

namespace {

// A field as the OpenAI request names it; `indexed`: an index in the gRPC path ("[3]") follows it.
struct OpenAIName {
  absl::string_view name;
  bool indexed = false;
};

// The fields PrepareGeneration names (their gRPC paths, an index aside) and the OpenAI request's
// name for each, by endpoint. The prompt as sent is a chat's messages; a completion's token ids
// keep their index.
struct GenerationField {
  absl::string_view grpc;
  OpenAIName completions;
  OpenAIName chat;
};
constexpr GenerationField kGenerationFields[] = {
    {"request_id", {"request_id"}, {"request_id"}},
    {"prompt", {"prompt"}, {"messages"}},
    {"prompt.text", {"prompt"}, {"messages"}},
    {"prompt.token_ids.ids", {"prompt", true}, {"messages"}},
    {"sampling.max_tokens", {"max_tokens"}, {"max_tokens"}},
    {"sampling.temperature", {"temperature"}, {"temperature"}},
    {"sampling.top_k", {"top_k"}, {"top_k"}},
    {"sampling.top_p", {"top_p"}, {"top_p"}},
    {"sampling.min_p", {"min_p"}, {"min_p"}},
    {"sampling.repetition_penalty", {"repetition_penalty"}, {"repetition_penalty"}},
    {"sampling.presence_penalty", {"presence_penalty"}, {"presence_penalty"}},
    {"sampling.frequency_penalty", {"frequency_penalty"}, {"frequency_penalty"}},
    {"sampling.logprobs", {"logprobs"}, {"logprobs"}},
    // A completion's logprobs is the number of alternatives (chat's top_logprobs).
    {"sampling.top_logprobs", {"logprobs"}, {"top_logprobs"}},
    {"sampling.stop", {"stop", true}, {"stop", true}},
    {"sampling.stop_token_ids", {"stop_token_ids", true}, {"stop_token_ids", true}},
    {"sampling.allowed_token_ids", {"allowed_token_ids", true}, {"allowed_token_ids", true}},
    {"sampling.bad_words", {"bad_words", true}, {"bad_words", true}},
    {"sampling.ignore_eos", {"ignore_eos"}, {"ignore_eos"}},
    {"sampling.logit_bias", {"logit_bias"}, {"logit_bias"}},
    {"sampling.min_tokens", {"min_tokens"}, {"min_tokens"}},
    {"sampling.truncate_prompt_tokens", {"truncate_prompt_tokens"}, {"truncate_prompt_tokens"}},
    {"sampling.prompt_logprobs", {"prompt_logprobs"}, {"prompt_logprobs"}},
};

constexpr absl::string_view kSamplingPrefix = "sampling.";
constexpr absl::string_view kStructuredOutputField = "sampling.structured_output";

}  // namespace

absl::Status RenameGenerationError(const absl::Status& status, Endpoint endpoint, absl::string_view constraint_field,
                                   int batch_prompt) {
  if (status.code() != absl::StatusCode::kInvalidArgument) return status;
  const std::optional<FieldError> error = FieldErrorOf(status);
  if (!error.has_value()) return status;
  const absl::string_view path = error->field;
  const size_t bracket = path.find('[');
  const absl::string_view base = path.substr(0, bracket);
  const absl::string_view index = bracket == absl::string_view::npos ? absl::string_view() : path.substr(bracket);
  std::string renamed;
  if (absl::StartsWith(path, kStructuredOutputField)) {
    // The constraint as the client sent it (response_format, tool_choice, ...; Request::constraint_field).
    renamed = constraint_field.empty() ? std::string(absl::StripPrefix(path, kSamplingPrefix))
                                       : std::string(constraint_field);
  } else {
    const auto field = std::find_if(std::begin(kGenerationFields), std::end(kGenerationFields),
                                    [&](const GenerationField& f) { return f.grpc == base; });
    if (field == std::end(kGenerationFields)) {
      renamed = std::string(absl::StripPrefix(path, kSamplingPrefix));  // named as in the gRPC API's sampling
    } else {
      const OpenAIName& name = endpoint == Endpoint::kChatCompletions ? field->chat : field->completions;
      renamed = absl::StrCat(name.name, batch_prompt >= 0 && name.name == "prompt" ? absl::StrCat("[", batch_prompt, "]") : "",
                             name.indexed ? index : "");
    }
  }
  return InvalidField(renamed, error->message);
}

ApiError ErrorFromStatus(const absl::Status& status) {
  ApiError e;
  e.message = std::string(status.message());
  e.param = ParamOf(status);
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      e.http_status = 400;
      e.type = "invalid_request_error";
      break;
    case absl::StatusCode::kNotFound:
      e.http_status = 404;
      e.type = "invalid_request_error";
      e.code = "model_not_found";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.http_status = 429;
      e.type = "rate_limit_error";
      e.code = "queue_full";
      break;
    case absl::StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "service_unavailable_error";
      e.code = "not_serving";
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      break;
  }
  return e;
}

std::string ErrorBody(const ApiError& error) {
  Json body = {{"error",
                {{"message", error.message},
                 {"type", error.type},
                 {"param", error.param.empty() ? Json(nullptr) : Json(error.param)},
                 {"code", error.code.empty() ? Json(nullptr) : Json(error.code)}}}};
  return body.dump(-1, ' ', false, Json::error_handler_t::replace);
}

const char* FinishReasonName(v1::FinishReason reason) {
  return reason == v1::FINISH_REASON_LENGTH ? "length" : "stop";
}

nlohmann::ordered_json UsageJson(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  return Json{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

namespace {

std::string TokenText(int32_t id, const Tokenizer* tokenizer) {
  return tokenizer == nullptr ? std::string() : tokenizer->Decode({id});
}

// A token as the logprobs name it: its text, or "token_id:ID" (vLLM's return_tokens_as_token_ids).
std::string TokenName(int32_t id, const Tokenizer* tokenizer, bool as_ids) {
  return as_ids ? absl::StrCat("token_id:", id) : TokenText(id, tokenizer);
}

Json Bytes(const std::string& s) {
  Json bytes = Json::array();
  for (unsigned char c : s) bytes.push_back(static_cast<int>(c));
  return bytes;
}

}  // namespace

nlohmann::ordered_json ChatLogprobsContent(const std::vector<v1::TokenLogprobs>& entries, const Tokenizer* tokenizer,
                                           bool token_ids) {
  Json content = Json::array();
  for (const v1::TokenLogprobs& e : entries) {
    Json top = Json::array();
    for (const v1::TopLogprob& t : e.top_logprobs()) {
      top.push_back({{"token", TokenName(t.token_id(), tokenizer, token_ids)},
                     {"logprob", t.logprob()},
                     {"bytes", Bytes(TokenText(t.token_id(), tokenizer))}});
    }
    content.push_back({{"token", TokenName(e.token_id(), tokenizer, token_ids)},
                       {"logprob", e.logprob()},
                       {"bytes", Bytes(TokenText(e.token_id(), tokenizer))},
                       {"top_logprobs", top}});
  }
  return content;
}

nlohmann::ordered_json CompletionLogprobs(const std::vector<v1::TokenLogprobs>& entries, const Tokenizer* tokenizer,
                                          int64_t text_offset, bool token_ids, std::optional<int32_t> unscored_first) {
  Json tokens = Json::array(), token_logprobs = Json::array(), top_logprobs = Json::array(), offsets = Json::array();
  if (unscored_first.has_value()) {
    tokens.push_back(TokenName(*unscored_first, tokenizer, token_ids));
    token_logprobs.push_back(nullptr);
    top_logprobs.push_back(nullptr);
    offsets.push_back(text_offset);
    text_offset += static_cast<int64_t>(TokenText(*unscored_first, tokenizer).size());
  }
  for (const v1::TokenLogprobs& e : entries) {
    tokens.push_back(TokenName(e.token_id(), tokenizer, token_ids));
    token_logprobs.push_back(e.logprob());
    offsets.push_back(text_offset);
    text_offset += static_cast<int64_t>(TokenText(e.token_id(), tokenizer).size());
    Json top = Json::object();
    for (const v1::TopLogprob& t : e.top_logprobs()) top[TokenName(t.token_id(), tokenizer, token_ids)] = t.logprob();
    top_logprobs.push_back(top);
  }
  return Json{{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top_logprobs},
              {"text_offset", offsets}};
}

nlohmann::ordered_json PromptLogprobs(const std::vector<v1::TokenLogprobs>& entries, const Tokenizer* tokenizer,
                                      bool token_ids) {
  Json out = Json::array({nullptr});
  for (const v1::TokenLogprobs& e : entries) {
    Json position = Json::object();
    position[std::to_string(e.token_id())] = {
        {"logprob", e.logprob()}, {"rank", e.rank()}, {"decoded_token", TokenName(e.token_id(), tokenizer, token_ids)}};
    for (int k = 0; k < e.top_logprobs_size(); ++k) {
      const v1::TopLogprob& t = e.top_logprobs(k);
      if (t.token_id() == e.token_id()) continue;
      position[std::to_string(t.token_id())] = {
          {"logprob", t.logprob()}, {"rank", k + 1}, {"decoded_token", TokenName(t.token_id(), tokenizer, token_ids)}};
    }
    out.push_back(std::move(position));
  }
  return out;
}

OutputSplitter::OutputSplitter(bool reasoning, bool reasoning_inside, ToolCallFormat tools, int max_calls,
                               nlohmann::ordered_json tool_list, bool incremental)
    : tools_(tools, max_calls, std::move(tool_list), incremental) {
  if (tools == ToolCallFormat::kHarmony) {
    harmony_.emplace(max_calls, incremental);
  } else if (reasoning) {
    reasoning_.emplace(reasoning_inside);
  }
}

OutputSplitter::OutputSplitter(ToolChoice forced, std::string name, bool incremental)
    : tools_(ToolCallFormat::kNone, 0), forced_(forced), forced_name_(std::move(name)) {
  if (incremental) stream_.emplace(forced_, forced_name_);
}

ForcedCallStream::ForcedCallStream(ToolChoice forced, std::string name) : forced_(forced), name_(std::move(name)) {}

std::vector<ToolCallPiece> ForcedCallStream::Add(absl::string_view text) {
  std::vector<ToolCallPiece> out;
  if (text.empty()) return out;
  if (forced_ == ToolChoice::kNamed) {
    // The output is the arguments.
    out.push_back(ToolCallPiece{0, calls_ == 0 ? name_ : "", std::string(text)});
    calls_ = 1;
    return out;
  }
  text_.append(text.data(), text.size());
  Scan(&out);
  Emit(&out);
  return out;
}

void ForcedCallStream::Emit(std::vector<ToolCallPiece>* out) {
  if (!have_name_) return;
  // The arguments so far: the "parameters" value from its start to its end, or to what was read.
  std::string arguments;
  if (params_start_ != std::string::npos) {
    const size_t from = params_sent_ == std::string::npos ? params_start_ : params_sent_;
    const size_t to = params_end_ != std::string::npos ? params_end_ : pos_;
    if (to > from) arguments = text_.substr(from, to - from);
    params_sent_ = std::max(from, to);
  }
  if (!begun_) {
    begun_ = true;
    out->push_back(ToolCallPiece{calls_++, item_name_, std::move(arguments)});
  } else if (!arguments.empty()) {
    out->push_back(ToolCallPiece{calls_ - 1, "", std::move(arguments)});
  }
}

void ForcedCallStream::Scan(std::vector<ToolCallPiece>* out) {
  constexpr size_t npos = std::string::npos;
  for (; pos_ < text_.size(); ++pos_) {
    const char c = text_[pos_];
    if (in_string_) {
      if (escaped_) {
        escaped_ = false;
      } else if (c == '\\') {
        escaped_ = true;
      } else if (c == '"') {
        in_string_ = false;
        if (depth_ == 2) {
          const Json s = Json::parse(text_.begin() + string_start_, text_.begin() + pos_ + 1, nullptr, false);
          const std::string value = s.is_string() ? s.get<std::string>() : std::string();
          if (string_is_key_) {
            key_ = value;
          } else if (value_key_ == "name") {
            item_name_ = value;
            have_name_ = true;
          } else if (value_key_ == "parameters") {
            params_end_ = pos_ + 1;
          }
        }
      }
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') continue;
    if (depth_ == 2 && awaiting_value_) {
      awaiting_value_ = false;
      if (value_key_ == "parameters") params_start_ = pos_;
    }
    switch (c) {
      case '"':
        in_string_ = true;
        string_start_ = pos_;
        string_is_key_ = depth_ == 2 && expect_key_;
        if (string_is_key_) expect_key_ = false;
        break;
      case '{':
      case '[':
        if (++depth_ == 2) {  // an item begins
          expect_key_ = true;
          key_.clear();
          value_key_.clear();
          item_name_.clear();
          have_name_ = begun_ = false;
          params_start_ = params_end_ = params_sent_ = npos;
        }
        break;
      case '}':
      case ']':
        if (depth_ == 3 && value_key_ == "parameters") params_end_ = pos_ + 1;
        if (depth_ == 2) {  // the item ends: a scalar "parameters" ends here at the latest
          if (params_start_ != npos && params_end_ == npos) params_end_ = pos_;
          Emit(out);
          have_name_ = false;
        }
        --depth_;
        break;
      case ':':
        if (depth_ == 2) {
          value_key_ = key_;
          awaiting_value_ = true;
        }
        break;
      case ',':
        if (depth_ == 2) {
          if (value_key_ == "parameters" && params_start_ != npos && params_end_ == npos) params_end_ = pos_;
          value_key_.clear();
          expect_key_ = true;
        }
        break;
      default:
        break;
    }
  }
}

std::optional<std::vector<ToolCall>> ForcedToolCalls(ToolChoice forced, const std::string& name,
                                                     absl::string_view output) {
  const Json j = Json::parse(output, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return std::nullopt;
  const auto text = [](const Json& v) { return v.dump(-1, ' ', false, Json::error_handler_t::replace); };
  if (forced == ToolChoice::kNamed) {
    if (!j.is_object()) return std::nullopt;
    return std::vector<ToolCall>{ToolCall{name, text(j)}};
  }
  if (!j.is_array() || j.empty()) return std::nullopt;
  std::vector<ToolCall> calls;
  for (const Json& call : j) {
    if (!call.is_object() || !call.contains("name") || !call["name"].is_string() || !call.contains("parameters")) {
      return std::nullopt;
    }
    calls.push_back(ToolCall{call["name"].get<std::string>(), text(call["parameters"])});
  }
  return calls;
}

OutputSplit OutputSplitter::Add(absl::string_view text, bool final) {
  OutputSplit out;
  if (stream_.has_value()) {
    // Streamed: the calls as they come; an output cut short before any call began is content.
    held_.append(text.data(), text.size());
    out.pieces = stream_->Add(text);
    if (final && stream_->calls() == 0) out.content = std::move(held_);
    if (final) held_.clear();
    return out;
  }
  if (forced_ != ToolChoice::kAuto) {
    // The calls are one JSON text: held whole, then handed out as calls (or, cut short, content).
    held_.append(text.data(), text.size());
    if (!final) return out;
    if (std::optional<std::vector<ToolCall>> calls = ForcedToolCalls(forced_, forced_name_, held_)) {
      out.calls = *std::move(calls);
    } else {
      out.content = std::move(held_);
    }
    held_.clear();
    return out;
  }
  if (harmony_.has_value()) {
    HarmonyDelta d = harmony_->Add(text);
    if (final) {
      HarmonyDelta end = harmony_->Finish();
      d.reasoning += end.reasoning;
      d.content += end.content;
      for (ToolCall& c : end.calls) d.calls.push_back(std::move(c));
      for (ToolCallPiece& p : end.pieces) d.pieces.push_back(std::move(p));
    }
    return OutputSplit{std::move(d.reasoning), std::move(d.content), std::move(d.calls), std::move(d.pieces)};
  }
  std::string content;
  if (reasoning_.has_value()) {
    ReasoningDelta d = reasoning_->Add(text);
    out.reasoning = std::move(d.reasoning);
    content = std::move(d.content);
    if (final) {
      ReasoningDelta end = reasoning_->Finish();
      out.reasoning += end.reasoning;
      content += end.content;
    }
  } else {
    content = std::string(text);
  }
  ToolCallDelta d = tools_.Add(content);
  if (final) {
    ToolCallDelta end = tools_.Finish();
    d.content += end.content;
    for (ToolCall& c : end.calls) d.calls.push_back(std::move(c));
    for (ToolCallPiece& p : end.pieces) d.pieces.push_back(std::move(p));
  }
  out.content = std::move(d.content);
  out.calls = std::move(d.calls);
  out.pieces = std::move(d.pieces);
  return out;
}

namespace {

Json FunctionCall(const std::string& id, const ToolCall& call) {
  return Json{{"id", id}, {"type", "function"}, {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
}

}  // namespace

nlohmann::ordered_json ChatMessage(const OutputSplit& whole, bool reasoning, const std::vector<std::string>& ids) {
  Json message = {{"role", "assistant"}};
  message["content"] = whole.content.empty() && !whole.calls.empty() ? Json(nullptr) : Json(whole.content);
  if (reasoning) message["reasoning_content"] = whole.reasoning.empty() ? Json(nullptr) : Json(whole.reasoning);
  if (!whole.calls.empty()) {
    Json calls = Json::array();
    for (size_t i = 0; i < whole.calls.size(); ++i) calls.push_back(FunctionCall(ids.at(i), whole.calls[i]));
    message["tool_calls"] = std::move(calls);
  }
  return message;
}

std::vector<nlohmann::ordered_json> ChatDeltas(const OutputSplit& piece, int first_call,
                                               const std::vector<std::string>& ids) {
  std::vector<Json> deltas;
  if (!piece.reasoning.empty()) deltas.push_back({{"reasoning_content", piece.reasoning}});
  if (!piece.content.empty()) deltas.push_back({{"content", piece.content}});
  for (size_t i = 0; i < piece.calls.size(); ++i) {
    const int index = first_call + static_cast<int>(i);
    const ToolCall& call = piece.calls[i];
    deltas.push_back({{"tool_calls", Json::array({{{"index", index},
                                                   {"id", ids.at(index)},
                                                   {"type", "function"},
                                                   {"function", {{"name", call.name}, {"arguments", ""}}}}})}});
    deltas.push_back(
        {{"tool_calls", Json::array({{{"index", index}, {"function", {{"arguments", call.arguments}}}}})}});
  }
  for (const ToolCallPiece& p : piece.pieces) {
    if (!p.name.empty()) {
      deltas.push_back({{"tool_calls", Json::array({{{"index", p.index},
                                                     {"id", ids.at(p.index)},
                                                     {"type", "function"},
                                                     {"function", {{"name", p.name}, {"arguments", ""}}}}})}});
    }
    if (!p.arguments.empty()) {
      deltas.push_back(
          {{"tool_calls", Json::array({{{"index", p.index}, {"function", {{"arguments", p.arguments}}}}})}});
    }
  }
  return deltas;
}

const char* ChatFinishReason(v1::FinishReason reason, bool made_calls) {
  return made_calls && reason != v1::FINISH_REASON_LENGTH ? "tool_calls" : FinishReasonName(reason);
}

}  // namespace shardserve::openai
