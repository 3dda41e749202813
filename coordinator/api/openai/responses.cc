#include "coordinator/api/openai/responses.h"

#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/api/openai/protocol.h"

namespace shardserve::openai {
namespace {

using Json = nlohmann::ordered_json;

// The request's `key`, or `fallback` where it is absent or null.
Json Given(const Json& request, const char* key, Json fallback) {
  return request.contains(key) && !request[key].is_null() ? request[key] : std::move(fallback);
}

std::string TypeOf(const Json& item) {
  return item.contains("type") && item["type"].is_string() ? item["type"].get<std::string>() : "";
}

// The chat answer's token log-probabilities (choices[0].logprobs.content), or null without them.
Json ChatLogprobs(const Json& choice) {
  if (!choice.contains("logprobs") || !choice["logprobs"].is_object()) return nullptr;
  const Json& logprobs = choice["logprobs"];
  return logprobs.contains("content") && logprobs["content"].is_array() ? logprobs["content"] : Json(nullptr);
}

// A message's output_text part; with `logprobs` (an array), its tokens' log-probabilities.
Json OutputText(const Json& text, const Json& logprobs) {
  Json part = {{"type", "output_text"}, {"text", text}, {"annotations", Json::array()}};
  if (logprobs.is_array()) part["logprobs"] = logprobs;
  return part;
}

// A message item's content as chat text: a string, or the text of its input_text / output_text
// parts, joined.
absl::StatusOr<std::string> ContentText(const Json& content, const std::string& field) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) return InvalidField(field, "must be a string or an array of content parts");
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const Json& part = content[i];
    const std::string type = part.is_object() ? TypeOf(part) : "";
    const std::string where = absl::StrCat(field, "[", i, "]");
    if (type != "input_text" && type != "output_text") {
      return InvalidField(absl::StrCat(where, ".type"),
                          absl::StrCat("'", type.substr(0, 64), "' is not served: input_text or output_text only"));
    }
    if (!part.contains("text") || !part["text"].is_string())
      return InvalidField(absl::StrCat(where, ".text"), "must be a string");
    text += part["text"].get<std::string>();
  }
  return text;
}

// The input items as chat messages, appended to `messages`: function calls join the assistant
// message before them (the text the model wrote with them, or the calls before them), as one chat
// answer writes them. Errors name `name`[i].
absl::Status InputMessages(const Json& input, const std::string& name, Json* messages) {
  if (input.is_string()) {
    messages->push_back({{"role", "user"}, {"content", input}});
    return absl::OkStatus();
  }
  if (!input.is_array()) return InvalidField(name, "must be a string or an array of items");
  for (size_t i = 0; i < input.size(); ++i) {
    const Json& item = input[i];
    const std::string field = absl::StrCat(name, "[", i, "]");
    if (!item.is_object()) return InvalidField(field, "must be an object");
    const std::string type = TypeOf(item);
    if (type == "message" || (type.empty() && item.contains("role"))) {
      if (!item.contains("role") || !item["role"].is_string())
        return InvalidField(absl::StrCat(field, ".role"), "must be a string");
      std::string role = item["role"].get<std::string>();
      if (role == "developer") role = "system";
      if (role != "system" && role != "user" && role != "assistant") {
        return InvalidField(absl::StrCat(field, ".role"), "must be user, assistant, system or developer");
      }
      if (!item.contains("content")) return InvalidField(absl::StrCat(field, ".content"), "is required");
      absl::StatusOr<std::string> text = ContentText(item["content"], absl::StrCat(field, ".content"));
      if (!text.ok()) return text.status();
      messages->push_back({{"role", role}, {"content", *std::move(text)}});
    } else if (type == "function_call") {
      for (const char* key : {"call_id", "name", "arguments"}) {
        if (!item.contains(key) || !item[key].is_string())
          return InvalidField(absl::StrCat(field, ".", key), "must be a string");
      }
      Json call = {{"id", item["call_id"]},
                   {"type", "function"},
                   {"function", {{"name", item["name"]}, {"arguments", item["arguments"]}}}};
      Json* last = messages->empty() ? nullptr : &messages->back();
      if (last != nullptr && (*last)["role"] == "assistant") {
        (*last)["tool_calls"].push_back(std::move(call));  // made an array when absent
      } else {
        messages->push_back(
            {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", Json::array({std::move(call)})}});
      }
    } else if (type == "function_call_output") {
      if (!item.contains("call_id") || !item["call_id"].is_string()) {
        return InvalidField(absl::StrCat(field, ".call_id"), "must be a string");
      }
      if (!item.contains("output")) return InvalidField(absl::StrCat(field, ".output"), "is required");
      absl::StatusOr<std::string> text = ContentText(item["output"], absl::StrCat(field, ".output"));
      if (!text.ok()) return text.status();
      messages->push_back({{"role", "tool"}, {"tool_call_id", item["call_id"]}, {"content", *std::move(text)}});
    } else if (type == "reasoning") {
      continue;  // the model's own earlier reasoning: chat templates drop it from past turns
    } else {
      return InvalidField(absl::StrCat(field, ".type"),
                          absl::StrCat("'", type.substr(0, 64),
                                       "' is not served: message, function_call, function_call_output or reasoning"));
    }
  }
  return absl::OkStatus();
}

// Responses' function tools ({type, name, description, parameters, strict}) as chat tools.
absl::StatusOr<Json> Tools(const Json& tools) {
  if (!tools.is_array()) return InvalidField("tools", "must be an array");
  Json out = Json::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const Json& tool = tools[i];
    const std::string field = absl::StrCat("tools[", i, "]");
    if (!tool.is_object() || TypeOf(tool) != "function") {
      return InvalidField(absl::StrCat(field, ".type"), "only function tools are served (no built-in tools)");
    }
    Json function = Json::object();
    for (const char* key : {"name", "description", "parameters", "strict"}) {
      if (tool.contains(key) && !tool[key].is_null()) function[key] = tool[key];
    }
    out.push_back({{"type", "function"}, {"function", std::move(function)}});
  }
  return out;
}

}  // namespace

bool AsksLogprobs(const Json& body) {
  bool asks = false;
  if (body.contains("include") && body["include"].is_array()) {
    for (const Json& what : body["include"]) asks |= what == "message.output_text.logprobs";
  }
  return asks || (body.contains("top_logprobs") && body["top_logprobs"].is_number_integer() &&
                  body["top_logprobs"].get<int64_t>() > 0);
}

absl::StatusOr<Json> ResponsesToChat(const Json& body, const Json* earlier) {
  for (const char* refused : {"background", "conversation"}) {
    if (body.contains(refused) && !body[refused].is_null() && body[refused] != false) {
      return InvalidField(refused, "is not served: send the conversation as input, or continue a stored response "
                                   "with previous_response_id");
    }
  }
  const bool continues = body.contains("previous_response_id") && !body["previous_response_id"].is_null();
  if (continues && earlier == nullptr) {
    return InvalidField("previous_response_id",
                        "is not served: this server stores no responses (--http-responses-store-bytes 0); send the "
                        "whole conversation as input");
  }
  Json chat = Json::object();
  // Fields chat completions take as they are (vLLM's extras included).
  for (const auto& [key, value] : body.items()) {
    if (key == "input" || key == "instructions" || key == "max_output_tokens" || key == "tools" || key == "text" ||
        key == "tool_choice" || key == "reasoning" || key == "store" || key == "metadata" || key == "stream" ||
        key == "include" || key == "truncation" || key == "previous_response_id" || key == "background" ||
        key == "top_logprobs") {
      continue;
    }
    chat[key] = value;
  }
  if (!body.contains("model")) return InvalidField("model", "is required");
  Json messages = Json::array();
  if (body.contains("instructions") && !body["instructions"].is_null()) {
    if (!body["instructions"].is_string()) return InvalidField("instructions", "must be a string");
    messages.push_back({{"role", "system"}, {"content", body["instructions"]}});
  }
  if (continues) {
    if (absl::Status s = InputMessages(*earlier, "previous_response_id", &messages); !s.ok()) return s;
  }
  if (!body.contains("input")) return InvalidField("input", "is required");
  if (absl::Status s = InputMessages(body["input"], "input", &messages); !s.ok()) return s;
  if (messages.empty()) return InvalidField("input", "has no message");
  chat["messages"] = std::move(messages);
  if (body.contains("stream") && body["stream"] == true) {
    chat["stream"] = true;
    chat["stream_options"] = {{"include_usage", true}};
  }
  if (body.contains("max_output_tokens") && !body["max_output_tokens"].is_null()) {
    chat["max_tokens"] = body["max_output_tokens"];
  }
  if (body.contains("tools") && !body["tools"].is_null()) {
    absl::StatusOr<Json> tools = Tools(body["tools"]);
    if (!tools.ok()) return tools.status();
    chat["tools"] = *std::move(tools);
  }
  // Log-probabilities (the chat API's logprobs): include's "message.output_text.logprobs", or
  // top_logprobs > 0 (its alternatives).
  if (body.contains("include") && !body["include"].is_null() && !body["include"].is_array()) {
    return InvalidField("include", "must be an array of strings");
  }
  if (AsksLogprobs(body)) {
    chat["logprobs"] = true;
    if (body.contains("top_logprobs") && !body["top_logprobs"].is_null()) chat["top_logprobs"] = body["top_logprobs"];
  } else if (body.contains("top_logprobs") && !body["top_logprobs"].is_null() && body["top_logprobs"] != 0) {
    return InvalidField("top_logprobs", "must be an integer from 0 to 20");
  }
  if (body.contains("truncation") && !body["truncation"].is_null() && body["truncation"] != "auto" &&
      body["truncation"] != "disabled") {
    return InvalidField("truncation", "must be \"auto\" or \"disabled\"");
  }
  if (body.contains("reasoning") && !body["reasoning"].is_null()) {
    // reasoning.effort is the chat API's reasoning_effort (the chat template's variable); its summary
    // is not made.
    const Json& reasoning = body["reasoning"];
    if (!reasoning.is_object()) return InvalidField("reasoning", "must be an object");
    if (reasoning.contains("effort") && !reasoning["effort"].is_null()) chat["reasoning_effort"] = reasoning["effort"];
  }
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const Json& choice = body["tool_choice"];
    if (choice.is_object() && TypeOf(choice) == "function" && choice.contains("name")) {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", choice["name"]}}}};
    } else {
      chat["tool_choice"] = choice;
    }
  }
  if (body.contains("text") && body["text"].is_object() && body["text"].contains("format")) {
    const Json& format = body["text"]["format"];
    const std::string type = format.is_object() ? TypeOf(format) : "";
    if (type == "json_schema") {
      Json schema = {{"name", Given(format, "name", "output")}};
      if (format.contains("schema")) schema["schema"] = format["schema"];
      if (format.contains("strict")) schema["strict"] = format["strict"];
      chat["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(schema)}};
    } else if (type == "json_object") {
      chat["response_format"] = {{"type", "json_object"}};
    } else if (type != "text") {
      return InvalidField("text.format.type", "must be text, json_schema or json_object");
    }
  }
  return chat;
}

std::string ResponsesParam(const std::string& chat_param) {
  if (chat_param == "max_tokens") return "max_output_tokens";
  if (chat_param == "reasoning_effort") return "reasoning.effort";
  if (absl::StartsWith(chat_param, "messages")) return "input";
  if (absl::StartsWith(chat_param, "response_format")) return "text.format";
  if (absl::StartsWith(chat_param, "tools[")) {
    const size_t end = chat_param.find(']');
    return end == std::string::npos ? chat_param : chat_param.substr(0, end + 1);
  }
  return chat_param;
}

Json ChatToResponse(const Json& chat, const Json& request) {
  std::string id = chat.value("id", "");
  if (absl::StartsWith(id, "chatcmpl-")) id = id.substr(9);
  const Json& choice = chat["choices"][0];
  const Json& message = choice["message"];
  Json output = Json::array();
  if (message.contains("reasoning_content") && message["reasoning_content"].is_string()) {
    output.push_back(
        {{"type", "reasoning"},
         {"id", absl::StrCat("rs_", id)},
         {"summary", Json::array()},
         {"content", Json::array({{{"type", "reasoning_text"}, {"text", message["reasoning_content"]}}})}});
  }
  if (message.contains("content") && message["content"].is_string() && !message["content"].get<std::string>().empty()) {
    output.push_back(
        {{"type", "message"},
         {"id", absl::StrCat("msg_", id)},
         {"status", "completed"},
         {"role", "assistant"},
         {"content", Json::array({OutputText(message["content"], ChatLogprobs(choice))})}});
  }
  if (message.contains("tool_calls") && message["tool_calls"].is_array()) {
    for (size_t i = 0; i < message["tool_calls"].size(); ++i) {
      const Json& call = message["tool_calls"][i];
      output.push_back({{"type", "function_call"},
                        {"id", absl::StrCat("fc_", id, "_", i)},
                        {"call_id", call["id"]},
                        {"name", call["function"]["name"]},
                        {"arguments", call["function"]["arguments"]},
                        {"status", "completed"}});
    }
  }
  const bool cut = choice.value("finish_reason", "") == "length";
  const Json& usage = chat["usage"];
  const int64_t cached = usage.contains("prompt_tokens_details") && usage["prompt_tokens_details"].is_object()
                             ? usage["prompt_tokens_details"].value("cached_tokens", int64_t{0})
                             : 0;
  Json response = {{"id", absl::StrCat("resp_", id)},
                   {"object", "response"},
                   {"created_at", chat.value("created", int64_t{0})},
                   {"status", cut ? "incomplete" : "completed"},
                   {"error", nullptr},
                   {"incomplete_details", cut ? Json{{"reason", "max_output_tokens"}} : Json(nullptr)},
                   {"instructions", Given(request, "instructions", nullptr)},
                   {"max_output_tokens", Given(request, "max_output_tokens", nullptr)},
                   {"model", chat.value("model", "")},
                   {"output", std::move(output)},
                   {"parallel_tool_calls", Given(request, "parallel_tool_calls", true)},
                   {"previous_response_id", Given(request, "previous_response_id", nullptr)},
                   {"reasoning", {{"effort", request.contains("reasoning") && request["reasoning"].is_object()
                                                 ? Given(request["reasoning"], "effort", nullptr)
                                                 : Json(nullptr)},
                                  {"summary", nullptr}}},
                   {"store", Given(request, "store", false)},
                   {"temperature", Given(request, "temperature", 1.0)},
                   {"text", Given(request, "text", Json{{"format", {{"type", "text"}}}})},
                   {"tool_choice", Given(request, "tool_choice", "auto")},
                   {"tools", Given(request, "tools", Json::array())},
                   {"truncation", Given(request, "truncation", "disabled")},
                   {"top_logprobs", Given(request, "top_logprobs", 0)},
                   {"top_p", Given(request, "top_p", 1.0)},
                   {"usage",
                    {{"input_tokens", usage.value("prompt_tokens", int64_t{0})},
                     {"input_tokens_details", {{"cached_tokens", cached}}},
                     {"output_tokens", usage.value("completion_tokens", int64_t{0})},
                     {"output_tokens_details", {{"reasoning_tokens", 0}}},
                     {"total_tokens", usage.value("total_tokens", int64_t{0})}}},
                   {"metadata", Given(request, "metadata", Json::object())}};
  return response;
}

Json NormalizedInputItems(const Json& input, const std::string& id) {
  const std::string suffix = absl::StartsWith(id, "resp_") ? id.substr(5) : id;
  Json items = Json::array();
  if (input.is_string()) {
    items.push_back({{"id", absl::StrCat("msg_", suffix, "_in0")},
                     {"type", "message"},
                     {"role", "user"},
                     {"status", "completed"},
                     {"content", Json::array({{{"type", "input_text"}, {"text", input}}})}});
    return items;
  }
  if (!input.is_array()) return items;
  for (size_t i = 0; i < input.size(); ++i) {
    Json item = input[i];
    if (!item.is_object()) continue;
    std::string type = TypeOf(item);
    if (type.empty() && item.contains("role")) {
      type = "message";
      item["type"] = type;
    }
    if (type == "message" && item.contains("content") && item["content"].is_string()) {
      const bool assistant = item.contains("role") && item["role"] == "assistant";
      item["content"] = Json::array({{{"type", assistant ? "output_text" : "input_text"}, {"text", item["content"]}}});
    }
    if (!item.contains("id") || !item["id"].is_string()) {
      const char* prefix = type == "function_call"          ? "fc_"
                           : type == "function_call_output" ? "fco_"
                           : type == "reasoning"            ? "rs_"
                                                            : "msg_";
      Json named = {{"id", absl::StrCat(prefix, suffix, "_in", i)}};
      for (auto& [key, value] : item.items()) {
        if (key != "id") named[key] = std::move(value);
      }
      item = std::move(named);
    }
    items.push_back(std::move(item));
  }
  return items;
}

bool DropOldestTurn(Json* messages, Json* twin) {
  if (!messages->is_array()) return false;
  const size_t size = messages->size();
  auto role = [&](size_t i) { return (*messages)[i].is_object() ? (*messages)[i].value("role", Json("")) : Json(""); };
  size_t first = 0;
  while (first < size && role(first) == "system") ++first;
  size_t next = first + 1;
  while (next < size && role(next) != "user") ++next;
  if (next >= size) return false;  // one turn left, or none
  for (Json* list : {messages, twin}) {
    if (list == nullptr || !list->is_array() || list->size() != size) continue;
    list->erase(list->begin() + static_cast<std::ptrdiff_t>(first), list->begin() + static_cast<std::ptrdiff_t>(next));
  }
  return true;
}

// ---- ResponsesView -------------------------------------------------------------------------------

Json ResponsesView::Answer(const Json& chat) {
  Json response = ChatToResponse(chat, request_);
  if (finished_) finished_(response);
  return response;
}

std::string ResponsesView::Emit(const std::string& type, Json fields) {
  Json event = {{"type", type}, {"sequence_number", sequence_++}};
  for (auto& [key, value] : fields.items()) event[key] = std::move(value);
  return absl::StrCat("event: ", type, "\ndata: ", event.dump(-1, ' ', false, Json::error_handler_t::replace), "\n\n");
}

Json ResponsesView::Whole(const std::string& status) const {
  Json message = {{"role", "assistant"}, {"content", content_}};
  if (!reasoning_.empty()) message["reasoning_content"] = reasoning_;
  if (!calls_.empty()) message["tool_calls"] = calls_;
  Json chat = {{"id", absl::StrCat("chatcmpl-", id_)},
               {"created", chat_.value("created", int64_t{0})},
               {"model", chat_.value("model", "")},
               {"choices", Json::array({{{"index", 0},
                                         {"message", std::move(message)},
                                         {"logprobs", logprobs_ ? Json{{"content", tokens_}} : Json(nullptr)},
                                         {"finish_reason", finish_}}})},
               {"usage", chat_.contains("usage") ? chat_["usage"] : Json::object()}};
  Json response = ChatToResponse(chat, request_);
  response["status"] = status;
  if (status == "in_progress") {
    response["output"] = Json::array();
    response["usage"] = nullptr;
    response["incomplete_details"] = nullptr;
  }
  return response;
}

std::string ResponsesView::Open(Kind kind, const Json* call) {
  std::string out = Close();
  open_ = kind;
  ++output_index_;
  Json item;
  if (kind == Kind::kReasoning) {
    item = {{"type", "reasoning"},
            {"id", absl::StrCat("rs_", id_)},
            {"summary", Json::array()},
            {"content", Json::array()}};
  } else if (kind == Kind::kMessage) {
    item = {{"type", "message"},
            {"id", absl::StrCat("msg_", id_)},
            {"status", "in_progress"},
            {"role", "assistant"},
            {"content", Json::array()}};
  } else {
    const Json& function = call->contains("function") ? (*call)["function"] : Json::object();
    calls_.push_back({{"id", call->value("id", "")},
                      {"type", "function"},
                      {"function", {{"name", function.value("name", "")}, {"arguments", ""}}}});
    item = {{"type", "function_call"},
            {"id", absl::StrCat("fc_", id_, "_", calls_.size() - 1)},
            {"call_id", call->value("id", "")},
            {"name", function.value("name", "")},
            {"arguments", ""},
            {"status", "in_progress"}};
  }
  const std::string item_id = item["id"].get<std::string>();
  out += Emit("response.output_item.added", {{"output_index", output_index_}, {"item", std::move(item)}});
  if (kind == Kind::kMessage) {
    out += Emit("response.content_part.added",
                {{"item_id", item_id},
                 {"output_index", output_index_},
                 {"content_index", 0},
                 {"part", {{"type", "output_text"}, {"text", ""}, {"annotations", Json::array()}}}});
  }
  return out;
}

std::string ResponsesView::Close() {
  if (open_ == Kind::kNone) return "";
  std::string out;
  Json item;
  if (open_ == Kind::kReasoning) {
    const std::string item_id = absl::StrCat("rs_", id_);
    out += Emit("response.reasoning_text.done",
                {{"item_id", item_id}, {"output_index", output_index_}, {"content_index", 0}, {"text", reasoning_}});
    item = {{"type", "reasoning"},
            {"id", item_id},
            {"summary", Json::array()},
            {"content", Json::array({{{"type", "reasoning_text"}, {"text", reasoning_}}})}};
  } else if (open_ == Kind::kMessage) {
    const std::string item_id = absl::StrCat("msg_", id_);
    const Json logprobs = logprobs_ ? tokens_ : Json(nullptr);
    const Json part = OutputText(content_, logprobs);
    Json done = {{"item_id", item_id}, {"output_index", output_index_}, {"content_index", 0}, {"text", content_}};
    if (logprobs_) done["logprobs"] = tokens_;
    out += Emit("response.output_text.done", std::move(done));
    out += Emit("response.content_part.done",
                {{"item_id", item_id}, {"output_index", output_index_}, {"content_index", 0}, {"part", part}});
    item = {{"type", "message"},
            {"id", item_id},
            {"status", "completed"},
            {"role", "assistant"},
            {"content", Json::array({part})}};
  } else {
    const size_t i = calls_.size() - 1;
    const std::string item_id = absl::StrCat("fc_", id_, "_", i);
    const Json& call = calls_[i];
    out += Emit("response.function_call_arguments.done",
                {{"item_id", item_id}, {"output_index", output_index_}, {"arguments", call["function"]["arguments"]}});
    item = {{"type", "function_call"},
            {"id", item_id},
            {"call_id", call["id"]},
            {"name", call["function"]["name"]},
            {"arguments", call["function"]["arguments"]},
            {"status", "completed"}};
  }
  out += Emit("response.output_item.done", {{"output_index", output_index_}, {"item", std::move(item)}});
  open_ = Kind::kNone;
  return out;
}

std::string ResponsesView::Chunk(const Json& chunk) {
  std::string out;
  if (!started_) {
    started_ = true;
    id_ = chunk.value("id", "");
    if (absl::StartsWith(id_, "chatcmpl-")) id_ = id_.substr(9);
    chat_["created"] = chunk.value("created", int64_t{0});
    chat_["model"] = chunk.value("model", "");
    out += Emit("response.created", {{"response", Whole("in_progress")}});
    out += Emit("response.in_progress", {{"response", Whole("in_progress")}});
  }
  if (chunk.contains("usage") && chunk["usage"].is_object()) chat_["usage"] = chunk["usage"];
  if (!chunk.contains("choices") || !chunk["choices"].is_array() || chunk["choices"].empty()) return out;
  const Json& choice = chunk["choices"][0];
  if (choice.contains("finish_reason") && choice["finish_reason"].is_string()) finish_ = choice["finish_reason"];
  const Json piece_logprobs = ChatLogprobs(choice);  // this chunk's tokens'
  if (piece_logprobs.is_array()) {
    for (const Json& token : piece_logprobs) tokens_.push_back(token);
  }
  if (!choice.contains("delta") || !choice["delta"].is_object()) return out;
  const Json& delta = choice["delta"];
  if (delta.contains("reasoning_content") && delta["reasoning_content"].is_string() &&
      !delta["reasoning_content"].get<std::string>().empty()) {
    if (open_ != Kind::kReasoning) out += Open(Kind::kReasoning);
    const std::string piece = delta["reasoning_content"];
    reasoning_ += piece;
    out += Emit("response.reasoning_text.delta", {{"item_id", absl::StrCat("rs_", id_)},
                                                  {"output_index", output_index_},
                                                  {"content_index", 0},
                                                  {"delta", piece}});
  }
  if (delta.contains("content") && delta["content"].is_string() && !delta["content"].get<std::string>().empty()) {
    if (open_ != Kind::kMessage) out += Open(Kind::kMessage);
    const std::string piece = delta["content"];
    content_ += piece;
    const Json logprobs = piece_logprobs.is_array() ? piece_logprobs : Json::array();
    out += Emit("response.output_text.delta", {{"item_id", absl::StrCat("msg_", id_)},
                                               {"output_index", output_index_},
                                               {"content_index", 0},
                                               {"delta", piece},
                                               {"logprobs", logprobs}});
  }
  if (delta.contains("tool_calls") && delta["tool_calls"].is_array()) {
    for (const Json& call : delta["tool_calls"]) {
      if (!call.is_object()) continue;
      const size_t index = call.contains("index") && call["index"].is_number_unsigned() ? call["index"].get<size_t>()
                           : calls_.empty()                                             ? 0
                                                                                        : calls_.size() - 1;
      if (index >= calls_.size()) out += Open(Kind::kCall, &call);
      if (index >= calls_.size()) continue;  // an index past the next: not the chat stream's
      const Json* function = call.contains("function") ? &call["function"] : nullptr;
      if (function == nullptr || !function->contains("arguments") || !(*function)["arguments"].is_string()) continue;
      const std::string piece = (*function)["arguments"];
      if (piece.empty()) continue;
      calls_[index]["function"]["arguments"] = calls_[index]["function"]["arguments"].get<std::string>() + piece;
      out +=
          Emit("response.function_call_arguments.delta",
               {{"item_id", absl::StrCat("fc_", id_, "_", index)}, {"output_index", output_index_}, {"delta", piece}});
    }
  }
  return out;
}

std::string ResponsesView::End(const Json* error) {
  if (error != nullptr) {
    const Json& e = error->contains("error") ? (*error)["error"] : *error;
    return Emit("error", {{"code", e.value("code", Json(nullptr))},
                          {"message", e.value("message", "")},
                          {"param", e.value("param", Json(nullptr))}});
  }
  std::string out = Close();
  const bool cut = finish_ == "length";
  const Json response = Whole(cut ? "incomplete" : "completed");
  if (finished_) finished_(response);
  out += Emit(cut ? "response.incomplete" : "response.completed", {{"response", response}});
  return out;
}

}  // namespace shardserve::openai
