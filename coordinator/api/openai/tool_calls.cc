#include "coordinator/api/openai/tool_calls.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "coordinator/api/openai/harmony.h"
#include "coordinator/api/openai/python_literal.h"
#include "nlohmann/json.hpp"

namespace shardserve::openai {
namespace {

using Json = nlohmann::ordered_json;

constexpr absl::string_view kHermesStart = "<tool_call>";
constexpr absl::string_view kHermesEnd = "</tool_call>";
constexpr absl::string_view kPythonTag = "<|python_tag|>";
constexpr absl::string_view kMistralStart = "[TOOL_CALLS]";
constexpr absl::string_view kMistralArgs = "[ARGS]";
constexpr absl::string_view kDeepSeekCallsBegin = "<｜tool▁calls▁begin｜>";
constexpr absl::string_view kDeepSeekCallsEnd = "<｜tool▁calls▁end｜>";
constexpr absl::string_view kDeepSeekCallBegin = "<｜tool▁call▁begin｜>";
constexpr absl::string_view kDeepSeekCallEnd = "<｜tool▁call▁end｜>";
constexpr absl::string_view kDeepSeekSep = "<｜tool▁sep｜>";
constexpr absl::string_view kKimiCallsBegin = "<|tool_calls_section_begin|>";
constexpr absl::string_view kKimiCallsEnd = "<|tool_calls_section_end|>";
constexpr absl::string_view kKimiCallBegin = "<|tool_call_begin|>";
constexpr absl::string_view kKimiArguments = "<|tool_call_argument_begin|>";
constexpr absl::string_view kKimiCallEnd = "<|tool_call_end|>";
// DeepSeek's and Kimi K2's layout: the calls' section between its markers, each call between its own.
struct Section {
  absl::string_view begin, end, call_begin, call_end;
};
constexpr Section kDeepSeekSection{kDeepSeekCallsBegin, kDeepSeekCallsEnd, kDeepSeekCallBegin, kDeepSeekCallEnd};
constexpr Section kKimiSection{kKimiCallsBegin, kKimiCallsEnd, kKimiCallBegin, kKimiCallEnd};
const Section& SectionOf(ToolCallFormat format) {
  return format == ToolCallFormat::kKimiK2 ? kKimiSection : kDeepSeekSection;
}
constexpr absl::string_view kQwenFunction = "<function=";
constexpr absl::string_view kQwenFunctionEnd = "</function>";
constexpr absl::string_view kQwenParameter = "<parameter=";
constexpr absl::string_view kQwenParameterEnd = "</parameter>";
constexpr absl::string_view kGlmKey = "<arg_key>";
constexpr absl::string_view kGlmKeyEnd = "</arg_key>";
constexpr absl::string_view kGlmValue = "<arg_value>";
constexpr absl::string_view kGlmValueEnd = "</arg_value>";
constexpr char kWhitespace[] = " \t\r\n";
constexpr char kWhitespaceOrSemicolon[] = " \t\r\n;";

struct Named {
  const char* name;
  ToolCallFormat format;
};
constexpr Named kFormats[] = {{"none", ToolCallFormat::kNone},
                              {"hermes", ToolCallFormat::kHermes},
                              {"llama3_json", ToolCallFormat::kLlama3Json},
                              {"mistral", ToolCallFormat::kMistral},
                              {"deepseek_v3", ToolCallFormat::kDeepSeekV3},
                              {"kimi_k2", ToolCallFormat::kKimiK2},
                              {"qwen3_coder", ToolCallFormat::kQwen3Coder},
                              {"glm45", ToolCallFormat::kGlm45},
                              {"openai", ToolCallFormat::kHarmony}};

size_t SkipWhitespace(absl::string_view s, size_t i) {
  while (i < s.size() && absl::string_view(kWhitespace).find(s[i]) != absl::string_view::npos) ++i;
  return i;
}

// The end of the JSON object or array that begins at s[i] ('{' or '['), or npos while it is not
// closed. Brackets inside strings (with their escapes) do not count.
size_t JsonValueEnd(absl::string_view s, size_t i) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return absl::string_view::npos;
}

// The length of the longest end of `s` that is a proper start of `marker`.
size_t PartialMarker(absl::string_view s, absl::string_view marker) {
  for (size_t n = std::min(s.size(), marker.size() - 1); n > 0; --n) {
    if (absl::StartsWith(marker, s.substr(s.size() - n))) return n;
  }
  return 0;
}

bool ParseJson(absl::string_view text, Json* out) {
  *out = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  return !out->is_discarded();
}

// A call's JSON, or a list of calls': as ParseJson, but where a call's object writes "name", or its
// arguments ("arguments" or "parameters"), twice, the first is kept, as the streamed call sent it
// (a key written twice inside the arguments is kept last, as JSON reads it, streamed or not).
bool ParseCallJson(absl::string_view text, Json* out) {
  bool list = false;
  bool has_name = false, has_arguments = false;
  const Json::parser_callback_t keep_first = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::array_start && depth == 0) list = true;
    if (event == Json::parse_event_t::object_start && depth == (list ? 1 : 0)) has_name = has_arguments = false;
    if (event != Json::parse_event_t::key || depth != (list ? 2 : 1) || !parsed.is_string()) return true;
    const std::string& key = parsed.get_ref<const std::string&>();
    bool* seen = key == "name" ? &has_name : (key == "arguments" || key == "parameters") ? &has_arguments : nullptr;
    if (seen == nullptr) return true;
    if (*seen) return false;
    *seen = true;
    return true;
  };
  *out = Json::parse(text.begin(), text.end(), keep_first, /*allow_exceptions=*/false);
  return !out->is_discarded();
}

// A call from {"name": string, "arguments" or "parameters": object (or its JSON text)}; absent
// arguments are {}.
bool CallOf(const Json& v, ToolCall* call) {
  if (!v.is_object()) return false;
  auto name = v.find("name");
  if (name == v.end() || !name->is_string() || name->get<std::string>().empty()) return false;
  auto args = v.find("arguments");
  if (args == v.end()) args = v.find("parameters");
  Json arguments = Json::object();
  if (args != v.end()) {
    arguments = *args;
    if (arguments.is_string() && !ParseJson(arguments.get<std::string>(), &arguments)) return false;
    if (!arguments.is_object()) return false;
  }
  call->name = name->get<std::string>();
  call->arguments = arguments.dump(-1, ' ', false, Json::error_handler_t::replace);
  return true;
}

std::string DumpArguments(const Json& arguments) {
  return arguments.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// A function name as a call's marker holds it: not empty, no whitespace.
bool IsCallName(absl::string_view name) {
  return !name.empty() && name.find_first_of(kWhitespace) == absl::string_view::npos;
}

// One DeepSeek call, from after <｜tool▁call▁begin｜> to before <｜tool▁call▁end｜>: V3's
// "TYPE<｜tool▁sep｜>NAME\n```json\nARGS\n```", or V3.1's "NAME<｜tool▁sep｜>ARGS".
bool DeepSeekCall(absl::string_view body, ToolCall* call) {
  const size_t sep = body.find(kDeepSeekSep);
  if (sep == absl::string_view::npos) return false;
  absl::string_view name = absl::StripAsciiWhitespace(body.substr(0, sep));
  absl::string_view args = absl::StripAsciiWhitespace(body.substr(sep + kDeepSeekSep.size()));
  if (!absl::StartsWith(args, "{")) {
    // V3: the name on the separator's line, then the arguments in a ```json fence.
    if (name.empty()) return false;  // the call's type ("function")
    const size_t line = args.find('\n');
    if (line == absl::string_view::npos) return false;
    name = absl::StripAsciiWhitespace(args.substr(0, line));
    args = absl::StripAsciiWhitespace(args.substr(line + 1));
    if (!absl::ConsumePrefix(&args, "```json") || !absl::ConsumeSuffix(&args, "```")) return false;
  }
  Json v;
  if (!IsCallName(name) || !ParseJson(args, &v) || !v.is_object()) return false;
  call->name = std::string(name);
  call->arguments = DumpArguments(v);
  return true;
}

// A Kimi K2 call's id, functions.NAME:INDEX (vLLM's kimi_k2 parser: the name is the part after the last
// '.' and before the ':'): its name, or empty when `id` is not one.
absl::string_view KimiName(absl::string_view id) {
  const size_t colon = id.rfind(':');
  if (colon == absl::string_view::npos || colon + 1 == id.size() ||
      id.find_first_not_of("0123456789", colon + 1) != absl::string_view::npos) {
    return "";
  }
  absl::string_view name = id.substr(0, colon);
  if (const size_t dot = name.rfind('.'); dot != absl::string_view::npos) name = name.substr(dot + 1);
  return IsCallName(name) && IsCallName(id) ? name : "";
}

// One Kimi K2 call, from after <|tool_call_begin|> to before <|tool_call_end|>:
// "ID<|tool_call_argument_begin|>ARGS".
bool KimiCall(absl::string_view body, ToolCall* call) {
  const size_t at = body.find(kKimiArguments);
  if (at == absl::string_view::npos) return false;
  const absl::string_view id = absl::StripAsciiWhitespace(body.substr(0, at));
  const absl::string_view name = KimiName(id);
  Json v;
  if (name.empty() || !ParseJson(absl::StripAsciiWhitespace(body.substr(at + kKimiArguments.size())), &v) ||
      !v.is_object()) {
    return false;
  }
  call->name = std::string(name);
  call->arguments = DumpArguments(v);
  call->id = std::string(id);
  return true;
}

// The properties a tool's `parameters` schema declares (vLLM: the schema's "properties", else the
// schema itself), or null when `tools` has no function `name`.
const Json* ParameterTypes(const Json& tools, absl::string_view name) {
  if (!tools.is_array()) return nullptr;
  for (const Json& tool : tools) {
    if (!tool.is_object() || !tool.contains("function")) continue;
    const Json& function = tool["function"];
    if (!function.is_object() || !function.contains("name") || !function["name"].is_string() ||
        function["name"].get<std::string>() != name) {
      continue;
    }
    auto parameters = function.find("parameters");
    if (parameters == function.end() || !parameters->is_object()) return nullptr;
    auto properties = parameters->find("properties");
    return properties != parameters->end() && properties->is_object() ? &*properties : &*parameters;
  }
  return nullptr;
}

// Text Python's int() reads: optional sign, decimal digits, whitespace around.
bool ParseInteger(absl::string_view text, Json* out) {
  text = absl::StripAsciiWhitespace(text);
  const bool negative = absl::ConsumePrefix(&text, "-");
  if (!negative) absl::ConsumePrefix(&text, "+");
  if (text.empty() || text.size() > 18 || text.find_first_not_of("0123456789") != absl::string_view::npos) return false;
  int64_t v = 0;
  for (char c : text) v = v * 10 + (c - '0');
  *out = negative ? -v : v;
  return true;
}

// Text Python's float() reads; an integral value becomes an integer (vLLM's conversion), a
// value that is not finite stays text.
bool ParseNumber(absl::string_view text, Json* out) {
  const std::string t(absl::StripAsciiWhitespace(text));
  if (t.empty() || t.find_first_not_of("0123456789+-.eE") != std::string::npos) return false;
  char* end = nullptr;
  const double d = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size() || !std::isfinite(d)) return false;
  if (d == std::trunc(d) && std::fabs(d) < 9.2e18) {
    *out = static_cast<int64_t>(d);
  } else {
    *out = d;
  }
  return true;
}

// A Qwen3-Coder parameter's value (its text) as the JSON value the tool's schema types it as;
// `types` the tool's properties (ParameterTypes), or null.
Json ConvertParameter(const std::string& value, const std::string& name, const Json* types) {
  if (absl::AsciiStrToLower(value) == "null") return nullptr;
  if (types == nullptr || !types->contains(name)) return value;
  const Json& schema = (*types)[name];
  std::string type = "string";
  if (schema.is_object() && schema.contains("type")) {
    type = schema["type"].is_string() ? absl::AsciiStrToLower(absl::StripAsciiWhitespace(schema["type"].get<std::string>()))
                                      : "";  // a list of types: converted as an unknown type
  }
  Json v;
  if (type == "string" || type == "str" || type == "text" || type == "varchar" || type == "char" || type == "enum") {
    return value;
  }
  if (absl::StartsWith(type, "int") || absl::StartsWith(type, "uint") || absl::StartsWith(type, "long") ||
      absl::StartsWith(type, "short") || absl::StartsWith(type, "unsigned")) {
    return ParseInteger(value, &v) ? v : Json(value);
  }
  if (absl::StartsWith(type, "num") || absl::StartsWith(type, "float")) {
    return ParseNumber(value, &v) ? v : Json(value);
  }
  if (type == "boolean" || type == "bool" || type == "binary") return absl::AsciiStrToLower(value) == "true";
  // Objects and arrays: the value as JSON. Then (other types too) a number, else the value as a
  // Python literal (python_literal.h: ast.literal_eval's reading), else the text.
  if (type == "object" || type == "array" || type == "arr" || absl::StartsWith(type, "dict") ||
      absl::StartsWith(type, "list")) {
    if (ParseJson(value, &v)) return v;
  }
  const absl::string_view t = absl::StripAsciiWhitespace(value);
  if (ParseInteger(t, &v) || ParseNumber(t, &v)) return v;
  if (std::optional<Json> literal = ReadPythonLiteral(t)) return *std::move(literal);
  return value;
}

std::string Dump(const Json& v) { return v.dump(-1, ' ', false, Json::error_handler_t::replace); }

// A GLM-4.5 argument's value (its text, stripped) as vLLM's glm45 parser reads it: text where the
// tool's schema types the parameter "string"; else the value as JSON, else as a Python literal
// (python_literal.h), else the text.
Json GlmValue(absl::string_view value, const std::string& name, const Json* types) {
  const std::string text(absl::StripAsciiWhitespace(value));
  if (types != nullptr && types->contains(name)) {
    const Json& schema = (*types)[name];
    if (schema.is_object() && schema.contains("type") && schema["type"] == "string") return text;
  }
  Json v;
  if (ParseJson(text, &v)) return v;
  if (std::optional<Json> literal = ReadPythonLiteral(text)) return *std::move(literal);
  return text;
}

// A Qwen3-Coder parameter's name as the key of its call's arguments: stripped, and its bytes that
// are no UTF-8 replaced as Dump writes them, so that two names written alike are one key in the
// whole answer as in the streamed one (where a key written twice is sent twice).
std::string ParameterKey(absl::string_view name) {
  return Json::parse(Dump(Json(std::string(absl::StripAsciiWhitespace(name))))).get<std::string>();
}

// The end of the first of `ends` in `s` from `from` on (its position), or s.size().
size_t FirstOf(absl::string_view s, size_t from, std::initializer_list<absl::string_view> ends) {
  size_t best = s.size();
  for (absl::string_view e : ends) best = std::min(best, s.find(e, from));
  return best;
}

// The calls of Qwen3-Coder's XML: each <function=NAME> up to </function> (or the next function,
// or the end), its <parameter=P> values up to </parameter> (or the next parameter, or the
// function's end) with one newline on each side dropped. False when there is no function, or a
// name or parameter without its '>'.
bool QwenCalls(absl::string_view body, const Json& tools, std::vector<ToolCall>* calls) {
  constexpr size_t npos = absl::string_view::npos;
  size_t at = body.find(kQwenFunction);
  if (at == npos) return false;
  while (at != npos) {
    const size_t name_start = at + kQwenFunction.size();
    const size_t end = body.find(kQwenFunctionEnd, name_start);
    const absl::string_view function = body.substr(name_start, (end == npos ? body.size() : end) - name_start);
    at = end == npos ? npos : body.find(kQwenFunction, end + kQwenFunctionEnd.size());
    const size_t gt = function.find('>');
    if (gt == npos) return false;
    const absl::string_view name = absl::StripAsciiWhitespace(function.substr(0, gt));
    if (!IsCallName(name)) return false;
    const Json* types = ParameterTypes(tools, name);
    Json arguments = Json::object();
    const absl::string_view params = function.substr(gt + 1);
    for (size_t p = params.find(kQwenParameter); p != npos;) {
      const size_t pname_start = p + kQwenParameter.size();
      const size_t pend = FirstOf(params, pname_start, {kQwenParameterEnd, kQwenParameter});
      const absl::string_view param = params.substr(pname_start, pend - pname_start);
      const size_t pgt = param.find('>');
      if (pgt == npos) return false;
      const std::string pname = ParameterKey(param.substr(0, pgt));
      absl::string_view value = param.substr(pgt + 1);
      absl::ConsumePrefix(&value, "\n");
      absl::ConsumeSuffix(&value, "\n");
      arguments[pname] = ConvertParameter(std::string(value), pname, types);
      p = params.find(kQwenParameter, pend);
    }
    calls->push_back(ToolCall{std::string(name), DumpArguments(arguments)});
  }
  return true;
}

// The name of a GLM-4.5 call, from the start of its body (after <tool_call>) to a newline, the
// first <arg_key> or the body's end, stripped; *end where it stops.
absl::string_view GlmName(absl::string_view body, size_t* end) {
  *end = FirstOf(body, 0, {"\n", kGlmKey});
  return absl::StripAsciiWhitespace(body.substr(0, *end));
}

// The next <arg_key>K</arg_key> <arg_value>V</arg_value> of a GLM-4.5 call at or after s[*i]
// (whitespace before and between): kFound with the key and the value's text, *i past it; kNone when
// s[*i] on (after whitespace) is something else or, with `complete`, a pair left open; kNeedMore
// when the text so far may still become one.
enum class GlmPair { kFound, kNone, kNeedMore };
GlmPair NextGlmPair(absl::string_view s, size_t* i, bool complete, absl::string_view* key, absl::string_view* value) {
  const GlmPair open = complete ? GlmPair::kNone : GlmPair::kNeedMore;
  size_t at = SkipWhitespace(s, *i);
  if (at == s.size()) return open;
  if (!absl::StartsWith(s.substr(at), kGlmKey)) return absl::StartsWith(kGlmKey, s.substr(at)) ? open : GlmPair::kNone;
  const size_t key_start = at + kGlmKey.size();
  const size_t key_end = s.find(kGlmKeyEnd, key_start);
  if (key_end == absl::string_view::npos) return open;
  at = SkipWhitespace(s, key_end + kGlmKeyEnd.size());
  if (at == s.size()) return open;
  if (!absl::StartsWith(s.substr(at), kGlmValue)) return absl::StartsWith(kGlmValue, s.substr(at)) ? open : GlmPair::kNone;
  const size_t value_start = at + kGlmValue.size();
  const size_t value_end = s.find(kGlmValueEnd, value_start);
  if (value_end == absl::string_view::npos) return open;
  *key = s.substr(key_start, key_end - key_start);
  *value = s.substr(value_start, value_end - value_start);
  *i = value_end + kGlmValueEnd.size();
  return GlmPair::kFound;
}

// A GLM-4.5 call, from after <tool_call> to before </tool_call>: its name, then its arguments as
// <arg_key>/<arg_value> pairs (whitespace around them; nothing else). False when the name is not
// one (empty, with whitespace or '<') or anything else follows it.
bool GlmCall(absl::string_view body, const Json& tools, ToolCall* call) {
  size_t i = 0;
  const absl::string_view name = GlmName(body, &i);
  if (!IsCallName(name) || name.find('<') != absl::string_view::npos) return false;
  const Json* types = ParameterTypes(tools, name);
  Json arguments = Json::object();
  absl::string_view key, value;
  GlmPair pair;
  while ((pair = NextGlmPair(body, &i, /*complete=*/true, &key, &value)) == GlmPair::kFound) {
    const std::string k = ParameterKey(key);
    arguments[k] = GlmValue(value, k, types);
  }
  if (SkipWhitespace(body, i) != body.size()) return false;
  call->name = std::string(name);
  call->arguments = DumpArguments(arguments);
  return true;
}

// The end of the JSON string whose opening quote is at s[i] (after its closing quote), or npos
// while it is not closed.
size_t JsonStringEnd(absl::string_view s, size_t i) {
  for (++i; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
    } else if (s[i] == '"') {
      return i + 1;
    }
  }
  return absl::string_view::npos;
}

}  // namespace

absl::StatusOr<ToolCallFormat> ToolCallFormatFromName(absl::string_view name) {
  std::string known;
  for (const Named& f : kFormats) {
    if (name == f.name) return f.format;
    absl::StrAppend(&known, known.empty() ? "" : ", ", f.name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tool call parser '", name, "' is not known; the known ones are ", known));
}

const char* ToolCallFormatName(ToolCallFormat format) {
  for (const Named& f : kFormats) {
    if (f.format == format) return f.name;
  }
  return "none";
}

ToolCallFormat ToolCallFormatOfTemplate(absl::string_view source) {
  if (IsHarmonyTemplate(source)) return ToolCallFormat::kHarmony;
  if (absl::StrContains(source, kDeepSeekCallsBegin)) return ToolCallFormat::kDeepSeekV3;
  if (absl::StrContains(source, kKimiCallsBegin)) return ToolCallFormat::kKimiK2;
  if (absl::StrContains(source, kQwenFunction) && absl::StrContains(source, kQwenParameter)) {
    return ToolCallFormat::kQwen3Coder;
  }
  if (absl::StrContains(source, kGlmKey)) return ToolCallFormat::kGlm45;
  if (absl::StrContains(source, kHermesStart)) return ToolCallFormat::kHermes;
  if (absl::StrContains(source, kMistralStart)) return ToolCallFormat::kMistral;
  if (absl::StrContains(source, kPythonTag)) return ToolCallFormat::kLlama3Json;
  return ToolCallFormat::kNone;
}

std::vector<absl::string_view> TextMarkers(ToolCallFormat format) {
  if (format == ToolCallFormat::kHermes || format == ToolCallFormat::kQwen3Coder) return {kHermesStart, kHermesEnd};
  return {};
}

bool KeepsSpecialTokens(ToolCallFormat format) {
  return format == ToolCallFormat::kMistral || format == ToolCallFormat::kLlama3Json ||
         format == ToolCallFormat::kDeepSeekV3 || format == ToolCallFormat::kKimiK2 || format == ToolCallFormat::kHarmony ||
         format == ToolCallFormat::kGlm45;
}

ToolCallParser::ToolCallParser(ToolCallFormat format, int max_calls, nlohmann::ordered_json tools,
                               bool stream_arguments)
    : format_(format), max_calls_(max_calls), tools_(std::move(tools)),
      separators_(format == ToolCallFormat::kLlama3Json ? kWhitespaceOrSemicolon : kWhitespace),
      stream_arguments_(stream_arguments) {}

ToolCallDelta ToolCallParser::Add(absl::string_view text) {
  ToolCallDelta out;
  if (format_ == ToolCallFormat::kNone || format_ == ToolCallFormat::kHarmony) {
    out.content = std::string(text);
    return out;
  }
  buf_.append(text.data(), text.size());
  Process(/*final=*/false, &out);
  return out;
}

ToolCallDelta ToolCallParser::Finish() {
  ToolCallDelta out;
  if (format_ == ToolCallFormat::kNone || format_ == ToolCallFormat::kHarmony) return out;
  Process(/*final=*/true, &out);
  // Separators at the end: kept in an output without calls (unchanged), dropped after one.
  if (calls_found_ == 0) out.content += pending_;
  pending_.clear();
  return out;
}

void ToolCallParser::EmitText(absl::string_view text, ToolCallDelta* out) {
  std::string t = pending_;
  t.append(text.data(), text.size());
  pending_.clear();
  const size_t first = t.find_first_not_of(separators_);
  if (first == std::string::npos) {
    pending_ = std::move(t);
    return;
  }
  if (pending_after_call_) t.erase(0, first);
  const size_t last = t.find_last_not_of(separators_);
  out->content.append(t, 0, last + 1);
  pending_ = t.substr(last + 1);
  pending_after_call_ = false;
  calls_only_ = false;
}

size_t ToolCallParser::FindStart(size_t* hold) const {
  const absl::string_view buf = buf_;
  *hold = buf.size();
  if (format_ == ToolCallFormat::kLlama3Json) {
    // Calls are the output itself: a call starts only where nothing but calls came before.
    if (!calls_only_) return absl::string_view::npos;
    const size_t p = buf.find_first_not_of(separators_);
    if (p == absl::string_view::npos) return p;
    const absl::string_view rest = buf.substr(p);
    if (rest[0] == '{' || absl::StartsWith(rest, kPythonTag)) return p;
    if (absl::StartsWith(kPythonTag, rest)) *hold = p;
    return absl::string_view::npos;
  }
  switch (format_) {
    case ToolCallFormat::kHermes:
    case ToolCallFormat::kGlm45:
      return FindMarkers({kHermesStart}, hold);
    case ToolCallFormat::kMistral:
      return FindMarkers({kMistralStart}, hold);
    case ToolCallFormat::kDeepSeekV3:
    case ToolCallFormat::kKimiK2: {
      // A call's own marker starts one too (the calls after the first), and the end of the calls
      // is a block of its own, dropped after a call.
      const Section& section = SectionOf(format_);
      return FindMarkers({section.begin, section.call_begin, section.end}, hold);
    }
    case ToolCallFormat::kQwen3Coder:
      return FindMarkers({kHermesStart, kQwenFunction}, hold);
    default:
      return absl::string_view::npos;
  }
}

size_t ToolCallParser::FindMarkers(std::initializer_list<absl::string_view> markers, size_t* hold) const {
  const absl::string_view buf = buf_;
  size_t first = absl::string_view::npos;
  for (absl::string_view m : markers) first = std::min(first, buf.find(m));
  if (first == absl::string_view::npos) {
    for (absl::string_view m : markers) *hold = std::min(*hold, buf.size() - PartialMarker(buf, m));
  }
  return first;
}

size_t ToolCallParser::FindEnd() const {
  const absl::string_view buf = buf_;
  constexpr size_t npos = absl::string_view::npos;
  switch (format_) {
    case ToolCallFormat::kHermes:
    case ToolCallFormat::kGlm45: {
      const size_t e = buf.find(kHermesEnd);
      return e == npos ? npos : e + kHermesEnd.size();
    }
    case ToolCallFormat::kLlama3Json: {
      size_t i = absl::StartsWith(buf, kPythonTag) ? kPythonTag.size() : 0;
      i = SkipWhitespace(buf, i);
      if (i == buf.size()) return npos;
      return buf[i] == '{' ? JsonValueEnd(buf, i) : i;  // not an object: not a call
    }
    case ToolCallFormat::kMistral: {
      size_t i = SkipWhitespace(buf, kMistralStart.size());
      if (i == buf.size()) return npos;
      if (buf[i] != '[' && buf[i] != '{') {
        const size_t args = buf.find(kMistralArgs, i);
        if (args == npos) return npos;
        i = SkipWhitespace(buf, args + kMistralArgs.size());
        if (i == buf.size()) return npos;
        if (buf[i] != '{') return i;  // not an object: not a call
      }
      return JsonValueEnd(buf, i);
    }
    case ToolCallFormat::kDeepSeekV3:
    case ToolCallFormat::kKimiK2: {
      const Section& section = SectionOf(format_);
      if (absl::StartsWith(buf, section.end)) return section.end.size();
      size_t i = 0;
      if (absl::StartsWith(buf, section.begin)) {
        i = SkipWhitespace(buf, section.begin.size());
        if (absl::StartsWith(section.call_begin, buf.substr(i))) return npos;  // the call may follow
        if (!absl::StartsWith(buf.substr(i), section.call_begin)) return i;     // no call: not a call
      }
      const size_t e = buf.find(section.call_end, i);
      return e == npos ? npos : e + section.call_end.size();
    }
    case ToolCallFormat::kQwen3Coder: {
      const absl::string_view end = absl::StartsWith(buf, kHermesStart) ? kHermesEnd : kQwenFunctionEnd;
      const size_t e = buf.find(end);
      return e == npos ? npos : e + end.size();
    }
    case ToolCallFormat::kNone:
    case ToolCallFormat::kHarmony:
      break;
  }
  return npos;
}

bool ToolCallParser::ParseBlock(absl::string_view block, std::vector<ToolCall>* calls) const {
  Json v;
  ToolCall call;
  switch (format_) {
    case ToolCallFormat::kHermes: {
      absl::string_view body = block.substr(kHermesStart.size());
      absl::ConsumeSuffix(&body, kHermesEnd);
      if (!ParseCallJson(body, &v) || !CallOf(v, &call)) return false;
      calls->push_back(std::move(call));
      return true;
    }
    case ToolCallFormat::kLlama3Json: {
      absl::string_view body = block;
      absl::ConsumePrefix(&body, kPythonTag);
      if (!ParseCallJson(body, &v) || !CallOf(v, &call)) return false;
      // A JSON answer is not a call: a call names its arguments.
      if (!v.contains("parameters") && !v.contains("arguments")) return false;
      calls->push_back(std::move(call));
      return true;
    }
    case ToolCallFormat::kMistral: {
      absl::string_view body = absl::StripLeadingAsciiWhitespace(block.substr(kMistralStart.size()));
      if (!body.empty() && (body[0] == '[' || body[0] == '{')) {
        if (!ParseCallJson(body, &v)) return false;
        if (v.is_object()) v = Json::array({v});
        if (!v.is_array() || v.empty()) return false;
        for (const Json& item : v) {
          if (!CallOf(item, &call)) return false;
          calls->push_back(call);
        }
        return true;
      }
      const size_t args = body.find(kMistralArgs);
      if (args == absl::string_view::npos) return false;
      const absl::string_view name = absl::StripAsciiWhitespace(body.substr(0, args));
      if (name.empty() || name.find_first_of(kWhitespace) != absl::string_view::npos) return false;
      if (!ParseJson(body.substr(args + kMistralArgs.size()), &v) || !v.is_object()) return false;
      calls->push_back(ToolCall{std::string(name), DumpArguments(v)});
      return true;
    }
    case ToolCallFormat::kDeepSeekV3:
    case ToolCallFormat::kKimiK2: {
      const Section& section = SectionOf(format_);
      // The section's end closes the calls: dropped after one, content otherwise.
      if (block == section.end) return calls_found_ > 0;
      absl::string_view body = block;
      if (absl::ConsumePrefix(&body, section.begin)) body = absl::StripLeadingAsciiWhitespace(body);
      if (!absl::ConsumePrefix(&body, section.call_begin)) return false;
      absl::ConsumeSuffix(&body, section.call_end);
      if (!(format_ == ToolCallFormat::kKimiK2 ? KimiCall(body, &call) : DeepSeekCall(body, &call))) return false;
      calls->push_back(std::move(call));
      return true;
    }
    case ToolCallFormat::kQwen3Coder: {
      absl::string_view body = block;
      if (absl::ConsumePrefix(&body, kHermesStart)) absl::ConsumeSuffix(&body, kHermesEnd);
      return QwenCalls(body, tools_, calls);
    }
    case ToolCallFormat::kGlm45: {
      absl::string_view body = block.substr(kHermesStart.size());
      absl::ConsumeSuffix(&body, kHermesEnd);
      if (!GlmCall(body, tools_, &call)) return false;
      calls->push_back(std::move(call));
      return true;
    }
    case ToolCallFormat::kNone:
    case ToolCallFormat::kHarmony:
      break;
  }
  return false;
}

void ToolCallParser::Process(bool final, ToolCallDelta* out) {
  while (true) {
    if (!in_call_) {
      size_t hold = 0;
      const size_t start = FindStart(&hold);
      if (start == std::string::npos) {
        const size_t emit = final ? buf_.size() : hold;
        EmitText(absl::string_view(buf_).substr(0, emit), out);
        buf_.erase(0, emit);
        return;
      }
      EmitText(absl::string_view(buf_).substr(0, start), out);
      buf_.erase(0, start);
      in_call_ = true;
    }
    size_t end = FindEnd();
    // Its calls' pieces so far (to its end when complete, so that how the text was cut into
    // pieces changes nothing).
    if (stream_arguments_) {
      const bool complete = end != std::string::npos || final;
      Stream(absl::string_view(buf_).substr(0, complete && end != std::string::npos ? end : buf_.size()), complete, out);
    }
    if (end == std::string::npos) {
      if (!final) return;
      end = buf_.size();  // the output ended inside it: a call if what came is complete
    }
    EndBlock(end, out);
    buf_.erase(0, end);
    if (buf_.empty()) return;
  }
}

void ToolCallParser::Hand(ToolCall call, ToolCallDelta* out) {
  ++calls_found_;
  if (calls_out_ >= max_calls_) return;
  if (stream_arguments_) {
    out->pieces.push_back(ToolCallPiece{calls_out_, std::move(call.name), std::move(call.arguments), std::move(call.id)});
  } else {
    out->calls.push_back(std::move(call));
  }
  ++calls_out_;
}

void ToolCallParser::EndBlock(size_t end, ToolCallDelta* out) {
  std::vector<ToolCall> calls;
  const absl::string_view block = absl::string_view(buf_).substr(0, end);
  in_call_ = false;
  const bool ok = ParseBlock(block, &calls);
  const size_t begun = sent_.size();
  if (ok || begun > 0) {
    pending_.clear();
    pending_after_call_ = true;
  }
  if (ok) {
    for (size_t i = 0; i < calls.size(); ++i) {
      if (i >= begun) {
        Hand(std::move(calls[i]), out);
      } else if (absl::StartsWith(calls[i].arguments, sent_[i]) && calls[i].arguments.size() > sent_[i].size()) {
        // The arguments' end not yet sent (a value the end of the output closed).
        out->pieces.push_back(ToolCallPiece{first_index_ + static_cast<int>(i), "",
                                            calls[i].arguments.substr(sent_[i].size())});
      }
    }
  } else if (begun > 0) {
    // Begun, then malformed: the rest of the block as written, to the open call or to content.
    const bool open = args_ != nullptr || in_function_;
    const size_t from = std::min(block.size(), args_ != nullptr ? args_->consumed() : scan_);
    if (open) {
      SendArguments(std::string(block.substr(from)), out);
    } else {
      EmitText(block.substr(from), out);
    }
  } else {
    // Not a call: its text is content, and is not looked at again for a start marker.
    EmitText(block, out);
    calls_only_ = false;
  }
  scan_ = 0;
  stream_off_ = false;
  sent_.clear();
  args_.reset();
  wrapper_ = std::string::npos;
  in_function_ = false;
  types_ = nullptr;
}

bool ToolCallParser::Begin(std::string name, std::string arguments, std::string id, ToolCallDelta* out) {
  if (calls_out_ >= max_calls_) {
    stream_off_ = true;  // decided whole at the block's end, where it is counted and dropped
    return false;
  }
  ++calls_found_;
  if (sent_.empty()) first_index_ = calls_out_;
  sent_.push_back(arguments);
  out->pieces.push_back(ToolCallPiece{calls_out_++, std::move(name), std::move(arguments), std::move(id)});
  pending_.clear();
  pending_after_call_ = true;
  return true;
}

void ToolCallParser::SendArguments(std::string text, ToolCallDelta* out) {
  if (text.empty() || sent_.empty()) return;
  sent_.back() += text;
  out->pieces.push_back(ToolCallPiece{first_index_ + static_cast<int>(sent_.size()) - 1, "", std::move(text)});
}

namespace {

// A cursor over a call's text as far as it came: each step says whether it matched, did not, or
// needs more text.
struct Cursor {
  absl::string_view s;
  size_t i;
  bool more = false;  // ran out of text
  bool SkipSpace() {
    i = SkipWhitespace(s, i);
    more = i == s.size();
    return !more;
  }
  // The literal `m` next (after whitespace).
  bool Literal(absl::string_view m) {
    if (!SkipSpace()) return false;
    const absl::string_view rest = s.substr(i);
    if (absl::StartsWith(rest, m)) {
      i += m.size();
      return true;
    }
    more = absl::StartsWith(m, rest);
    return false;
  }
  // A JSON string next (after whitespace), decoded.
  bool String(std::string* out) {
    if (!SkipSpace()) return false;
    if (s[i] != '"') return false;
    const size_t end = JsonStringEnd(s, i);
    if (end == absl::string_view::npos) {
      more = true;
      return false;
    }
    Json v;
    if (!ParseJson(s.substr(i, end - i), &v) || !v.is_string()) return false;
    *out = v.get<std::string>();
    i = end;
    return true;
  }
  // {"name": NAME, "arguments" or "parameters": { — the '{' of the arguments at *args.
  bool Wrapper(std::string* name, size_t* args) {
    std::string key;
    if (!Literal("{") || !String(&key) || key != "name" || !Literal(":") || !String(name) || name->empty() ||
        !Literal(",") || !String(&key) || (key != "arguments" && key != "parameters") || !Literal(":") ||
        !Literal("{")) {
      return false;
    }
    *args = i - 1;
    return true;
  }
};

}  // namespace

ToolCallParser::Header ToolCallParser::NextHeader(absl::string_view buf, std::string* name, std::string* id,
                                                  size_t* args) {
  Cursor c{buf, scan_};
  const auto result = [&](bool found) { return found ? Header::kFound : c.more ? Header::kNeedMore : Header::kNone; };
  const bool first = sent_.empty();
  switch (format_) {
    case ToolCallFormat::kHermes:
      if (!first) return Header::kNone;
      c.i = kHermesStart.size();
      return result(c.Wrapper(name, args));
    case ToolCallFormat::kLlama3Json:
      if (!first) return Header::kNone;
      c.i = absl::StartsWith(buf, kPythonTag) ? kPythonTag.size() : 0;
      return result(c.Wrapper(name, args));
    case ToolCallFormat::kMistral: {
      if (!first) {
        // The list's next item, after the one before ends.
        if (wrapper_ == std::string::npos) return Header::kNone;
        const size_t end = JsonValueEnd(buf, wrapper_);
        if (end == absl::string_view::npos) return Header::kNeedMore;
        c.i = end;
        if (!c.Literal(",")) return result(false);
        if (!c.SkipSpace()) return Header::kNeedMore;
        const size_t item = c.i;
        const Header h = result(c.Wrapper(name, args));
        if (h == Header::kFound) wrapper_ = item;
        return h;
      }
      c.i = kMistralStart.size();
      if (!c.SkipSpace()) return Header::kNeedMore;
      if (buf[c.i] == '[' || buf[c.i] == '{') {
        if (buf[c.i] == '[') {
          ++c.i;
          if (!c.SkipSpace()) return Header::kNeedMore;
        }
        const size_t item = c.i;
        const Header h = result(c.Wrapper(name, args));
        if (h == Header::kFound) wrapper_ = item;
        return h;
      }
      const size_t at = buf.find(kMistralArgs, c.i);
      if (at == absl::string_view::npos) return Header::kNeedMore;
      const absl::string_view n = absl::StripAsciiWhitespace(buf.substr(c.i, at - c.i));
      if (!IsCallName(n)) return Header::kNone;
      c.i = at + kMistralArgs.size();
      if (!c.Literal("{")) return result(false);
      *name = std::string(n);
      *args = c.i - 1;
      return Header::kFound;
    }
    case ToolCallFormat::kDeepSeekV3:
    case ToolCallFormat::kKimiK2: {
      if (!first) return Header::kNone;
      const Section& section = SectionOf(format_);
      c.i = absl::StartsWith(buf, section.begin) ? section.begin.size() : 0;
      if (!c.Literal(section.call_begin)) return result(false);
      if (format_ == ToolCallFormat::kKimiK2) {  // the call's id, then its arguments
        const size_t at = buf.find(kKimiArguments, c.i);
        if (at == absl::string_view::npos) return Header::kNeedMore;
        const absl::string_view call_id = absl::StripAsciiWhitespace(buf.substr(c.i, at - c.i));
        const absl::string_view n = KimiName(call_id);
        if (n.empty()) return Header::kNone;
        c.i = at + kKimiArguments.size();
        if (!c.Literal("{")) return result(false);
        *name = std::string(n);
        *id = std::string(call_id);
        *args = c.i - 1;
        return Header::kFound;
      }
      const size_t sep = buf.find(kDeepSeekSep, c.i);
      if (sep == absl::string_view::npos) return Header::kNeedMore;
      const absl::string_view before = absl::StripAsciiWhitespace(buf.substr(c.i, sep - c.i));
      c.i = sep + kDeepSeekSep.size();
      if (!c.SkipSpace()) return Header::kNeedMore;
      if (buf[c.i] == '{') {  // V3.1: the name before the separator
        if (!IsCallName(before)) return Header::kNone;
        *name = std::string(before);
        *args = c.i;
        return Header::kFound;
      }
      // V3: the name on the separator's line, then the arguments in a ```json fence.
      const size_t line = buf.find('\n', c.i);
      if (line == absl::string_view::npos) return Header::kNeedMore;
      const absl::string_view n = absl::StripAsciiWhitespace(buf.substr(c.i, line - c.i));
      if (before.empty() || !IsCallName(n)) return Header::kNone;
      c.i = line + 1;
      if (!c.Literal("```json") || !c.Literal("{")) return result(false);
      *name = std::string(n);
      *args = c.i - 1;
      return Header::kFound;
    }
    default:
      return Header::kNone;
  }
}

void ToolCallParser::Stream(absl::string_view block, bool complete, ToolCallDelta* out) {
  if (format_ == ToolCallFormat::kQwen3Coder) {
    StreamQwen(block, complete, out);
    return;
  }
  if (format_ == ToolCallFormat::kGlm45) {
    StreamGlm(block, complete, out);
    return;
  }
  while (!stream_off_) {
    if (args_ != nullptr) {
      std::string text;
      const ArgumentsStream::State state = args_->Advance(block, &text);
      SendArguments(std::move(text), out);
      if (state == ArgumentsStream::State::kMore) return;
      if (state == ArgumentsStream::State::kBad) {
        stream_off_ = true;
        return;
      }
      scan_ = args_->consumed();
      args_.reset();
      continue;
    }
    std::string name, id;
    size_t args = 0;
    const Header h = NextHeader(block, &name, &id, &args);
    if (h == Header::kNeedMore) return;
    if (h == Header::kNone || !Begin(std::move(name), "", std::move(id), out)) {
      stream_off_ = true;
      return;
    }
    args_ = std::make_shared<ArgumentsStream>(args);
  }
}

void ToolCallParser::StreamQwen(absl::string_view buf, bool complete, ToolCallDelta* out) {
  constexpr size_t npos = std::string::npos;
  // A complete block's functions and parameters end at its end at the latest (before the
  // </tool_call> of a <tool_call> block), as QwenCalls reads them.
  size_t body_end = npos;
  if (complete) {
    body_end = buf.size();
    if (absl::StartsWith(buf, kHermesStart) && absl::EndsWith(buf.substr(kHermesStart.size()), kHermesEnd)) {
      body_end -= kHermesEnd.size();
    }
  }
  while (!stream_off_) {
    if (!in_function_) {
      const size_t f = buf.find(kQwenFunction, scan_);
      if (f == npos) return;
      const size_t gt = buf.find('>', f + kQwenFunction.size());
      if (gt == npos) return;
      const absl::string_view name = absl::StripAsciiWhitespace(buf.substr(f + kQwenFunction.size(), gt - f - kQwenFunction.size()));
      // A name the whole block may read otherwise (or not at all) is decided at the end.
      if (!IsCallName(name) || name.find('<') != npos || !Begin(std::string(name), "{", "", out)) {
        stream_off_ = true;
        return;
      }
      types_ = ParameterTypes(tools_, name);
      in_function_ = true;
      scan_ = gt + 1;
    }
    // Inside a function: its next parameter once closed, or its end.
    size_t end = buf.find(kQwenFunctionEnd, scan_);
    const bool at_body_end = end == npos || end > body_end;
    if (complete && at_body_end) end = body_end;
    const size_t p = buf.find(kQwenParameter, scan_);
    if (p != npos && (end == npos || p < end)) {
      const size_t name_start = p + kQwenParameter.size();
      const size_t close = std::min({buf.find(kQwenParameterEnd, name_start), buf.find(kQwenParameter, name_start), end});
      if (close == npos) return;
      const absl::string_view param = buf.substr(name_start, close - name_start);
      const size_t gt = param.find('>');
      if (gt == npos) {
        stream_off_ = true;
        return;
      }
      const std::string pname = ParameterKey(param.substr(0, gt));
      absl::string_view value = param.substr(gt + 1);
      absl::ConsumePrefix(&value, "\n");
      absl::ConsumeSuffix(&value, "\n");
      SendArguments(absl::StrCat(sent_.back() == "{" ? "" : ",", Dump(Json(pname)), ":",
                                 DumpArguments(ConvertParameter(std::string(value), pname, types_))),
                    out);
      scan_ = close;
      continue;
    }
    if (end == npos) return;
    SendArguments("}", out);
    in_function_ = false;
    scan_ = (complete && at_body_end) ? end : end + kQwenFunctionEnd.size();
  }
}

void ToolCallParser::StreamGlm(absl::string_view buf, bool complete, ToolCallDelta* out) {
  // The call's body: after <tool_call>, up to its </tool_call> once complete (as GlmCall reads it).
  absl::string_view body = buf.substr(kHermesStart.size());
  if (complete) absl::ConsumeSuffix(&body, kHermesEnd);
  if (stream_off_) return;
  if (!in_function_) {
    if (!sent_.empty()) return;  // one call a block, closed
    size_t name_end = 0;
    const absl::string_view name = GlmName(body, &name_end);
    if (name_end == body.size() && !complete) return;  // the name may go on
    // A name the whole block may read otherwise (or not at all) is decided at the end.
    if (!IsCallName(name) || name.find('<') != absl::string_view::npos || !Begin(std::string(name), "{", "", out)) {
      stream_off_ = true;
      return;
    }
    types_ = ParameterTypes(tools_, name);
    in_function_ = true;
    scan_ = kHermesStart.size() + name_end;
  }
  // Each pair once its </arg_value> came; the object closed at the block's end.
  size_t i = scan_ - kHermesStart.size();
  absl::string_view key, value;
  GlmPair pair;
  while ((pair = NextGlmPair(body, &i, complete, &key, &value)) == GlmPair::kFound) {
    const std::string k = ParameterKey(key);
    SendArguments(absl::StrCat(sent_.back() == "{" ? "" : ",", Dump(Json(k)), ":", Dump(GlmValue(value, k, types_))), out);
    scan_ = kHermesStart.size() + i;
  }
  if (pair == GlmPair::kNeedMore) return;
  const size_t rest = SkipWhitespace(body, i);
  if (!complete && absl::StartsWith(kHermesEnd, body.substr(rest))) return;  // the call's end may be coming
  if (complete && rest == body.size()) {
    SendArguments("}", out);
    in_function_ = false;
    scan_ = buf.size();
    return;
  }
  stream_off_ = true;  // something else: the block decides at its end (the rest of its text)
}

ToolCallDelta ParseToolCalls(ToolCallFormat format, absl::string_view text, int max_calls, const Json& tools) {
  ToolCallParser parser(format, max_calls, tools);
  ToolCallDelta out = parser.Add(text);
  ToolCallDelta end = parser.Finish();
  out.content += end.content;
  for (ToolCall& c : end.calls) out.calls.push_back(std::move(c));
  return out;
}

}  // namespace shardserve::openai
