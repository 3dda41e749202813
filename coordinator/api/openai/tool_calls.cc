#include "coordinator/api/openai/tool_calls.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace shardserve::openai {
namespace {

using Json = nlohmann::ordered_json;

constexpr absl::string_view kHermesStart = "<tool_call>";
constexpr absl::string_view kHermesEnd = "</tool_call>";
constexpr absl::string_view kPythonTag = "<|python_tag|>";
constexpr absl::string_view kMistralStart = "[TOOL_CALLS]";
constexpr absl::string_view kMistralArgs = "[ARGS]";
constexpr char kWhitespace[] = " \t\r\n";
constexpr char kWhitespaceOrSemicolon[] = " \t\r\n;";

struct Named {
  const char* name;
  ToolCallFormat format;
};
constexpr Named kFormats[] = {{"none", ToolCallFormat::kNone},
                              {"hermes", ToolCallFormat::kHermes},
                              {"llama3_json", ToolCallFormat::kLlama3Json},
                              {"mistral", ToolCallFormat::kMistral}};

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
  if (absl::StrContains(source, kHermesStart)) return ToolCallFormat::kHermes;
  if (absl::StrContains(source, kMistralStart)) return ToolCallFormat::kMistral;
  if (absl::StrContains(source, kPythonTag)) return ToolCallFormat::kLlama3Json;
  return ToolCallFormat::kNone;
}

bool KeepsSpecialTokens(ToolCallFormat format) {
  return format == ToolCallFormat::kMistral || format == ToolCallFormat::kLlama3Json;
}

ToolCallParser::ToolCallParser(ToolCallFormat format, int max_calls)
    : format_(format), max_calls_(max_calls),
      separators_(format == ToolCallFormat::kLlama3Json ? kWhitespaceOrSemicolon : kWhitespace) {}

ToolCallDelta ToolCallParser::Add(absl::string_view text) {
  ToolCallDelta out;
  if (format_ == ToolCallFormat::kNone) {
    out.content = std::string(text);
    return out;
  }
  buf_.append(text.data(), text.size());
  Process(/*final=*/false, &out);
  return out;
}

ToolCallDelta ToolCallParser::Finish() {
  ToolCallDelta out;
  if (format_ == ToolCallFormat::kNone) return out;
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
  const absl::string_view marker = format_ == ToolCallFormat::kHermes ? kHermesStart : kMistralStart;
  const size_t p = buf.find(marker);
  if (p == absl::string_view::npos) *hold = buf.size() - PartialMarker(buf, marker);
  return p;
}

size_t ToolCallParser::FindEnd() const {
  const absl::string_view buf = buf_;
  constexpr size_t npos = absl::string_view::npos;
  switch (format_) {
    case ToolCallFormat::kHermes: {
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
    case ToolCallFormat::kNone:
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
      if (!ParseJson(body, &v) || !CallOf(v, &call)) return false;
      calls->push_back(std::move(call));
      return true;
    }
    case ToolCallFormat::kLlama3Json: {
      absl::string_view body = block;
      absl::ConsumePrefix(&body, kPythonTag);
      if (!ParseJson(body, &v) || !CallOf(v, &call)) return false;
      // A JSON answer is not a call: a call names its arguments.
      if (!v.contains("parameters") && !v.contains("arguments")) return false;
      calls->push_back(std::move(call));
      return true;
    }
    case ToolCallFormat::kMistral: {
      absl::string_view body = absl::StripLeadingAsciiWhitespace(block.substr(kMistralStart.size()));
      if (!body.empty() && (body[0] == '[' || body[0] == '{')) {
        if (!ParseJson(body, &v)) return false;
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
      calls->push_back(ToolCall{std::string(name), v.dump(-1, ' ', false, Json::error_handler_t::replace)});
      return true;
    }
    case ToolCallFormat::kNone:
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
    if (end == std::string::npos) {
      if (!final) return;
      end = buf_.size();  // the output ended inside it: a call if what came is complete
    }
    std::vector<ToolCall> calls;
    const absl::string_view block = absl::string_view(buf_).substr(0, end);
    in_call_ = false;
    if (ParseBlock(block, &calls)) {
      pending_.clear();
      pending_after_call_ = true;
      for (ToolCall& c : calls) {
        ++calls_found_;
        if (calls_out_ < max_calls_) {
          ++calls_out_;
          out->calls.push_back(std::move(c));
        }
      }
    } else {
      // Not a call: its text is content, and is not looked at again for a start marker.
      EmitText(block, out);
      calls_only_ = false;
    }
    buf_.erase(0, end);
    if (buf_.empty() && !final) return;
    if (buf_.empty()) return;
  }
}

ToolCallDelta ParseToolCalls(ToolCallFormat format, absl::string_view text, int max_calls) {
  ToolCallParser parser(format, max_calls);
  ToolCallDelta out = parser.Add(text);
  ToolCallDelta end = parser.Finish();
  out.content += end.content;
  for (ToolCall& c : end.calls) out.calls.push_back(std::move(c));
  return out;
}

}  // namespace shardserve::openai
