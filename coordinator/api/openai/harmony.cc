#include "coordinator/api/openai/harmony.h"

#include <algorithm>
#include <initializer_list>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grammar/grammar.h"
#include "grammar/json_schema.h"

namespace shardserve::openai {
namespace {

constexpr absl::string_view kStart = "<|start|>";
constexpr absl::string_view kChannel = "<|channel|>";
constexpr absl::string_view kConstrain = "<|constrain|>";
constexpr absl::string_view kMessage = "<|message|>";
constexpr absl::string_view kEnd = "<|end|>";
constexpr absl::string_view kCall = "<|call|>";
constexpr absl::string_view kReturn = "<|return|>";
constexpr absl::string_view kRecipient = "to=";
constexpr absl::string_view kFunctions = "functions.";
constexpr absl::string_view kMarkerOpen = "<|";
constexpr char kWhitespace[] = " \t\r\n";

bool IsSpace(char c) { return absl::string_view(kWhitespace).find(c) != absl::string_view::npos; }

// The earliest of `markers` in `s` from `from` on (npos when none), and which one.
size_t FindFirst(absl::string_view s, std::initializer_list<absl::string_view> markers, absl::string_view* which) {
  size_t first = absl::string_view::npos;
  for (absl::string_view m : markers) {
    const size_t p = s.find(m);
    if (p < first) {
      first = p;
      *which = m;
    }
  }
  return first;
}

// The length of the longest end of `s` that is a proper start of one of `markers`.
size_t PartialMarkers(absl::string_view s, std::initializer_list<absl::string_view> markers) {
  size_t longest = 0;
  for (absl::string_view m : markers) {
    for (size_t n = std::min(s.size(), m.size() - 1); n > longest; --n) {
      if (absl::StartsWith(m, s.substr(s.size() - n))) {
        longest = n;
        break;
      }
    }
  }
  return longest;
}

// A header read: its channel and recipient, or where its text stops being markup.
struct HeaderScan {
  enum class Result { kValid, kMore, kBad } result = Result::kValid;
  size_t bad = 0;  // kBad: where the text that is not markup begins (the whitespace before it)
  std::string channel;
  std::string recipient;
};

// Reads header `h` (without <|message|>); `complete`: nothing follows in it.
HeaderScan ScanHeader(absl::string_view h, bool complete) {
  HeaderScan scan;
  enum class Expect { kAny, kRole, kChannel, kType } expect = Expect::kAny;
  bool saw_channel = false;
  size_t markup_end = 0;  // the end of the last markup read
  size_t i = 0;
  while (i < h.size()) {
    if (IsSpace(h[i])) {
      ++i;
      continue;
    }
    const absl::string_view rest = h.substr(i);
    if (!complete && rest.size() < kMessage.size() &&
        (absl::StartsWith(kMessage, rest) || absl::StartsWith(kEnd, rest) || absl::StartsWith(kCall, rest) ||
         absl::StartsWith(kReturn, rest))) {
      scan.result = HeaderScan::Result::kMore;  // may still become the marker that ends the header
      return scan;
    }
    bool marker = false;
    for (auto [m, next] : {std::pair{kStart, Expect::kRole}, std::pair{kChannel, Expect::kChannel},
                           std::pair{kConstrain, Expect::kType}}) {
      if (absl::StartsWith(rest, m)) {
        i += m.size();
        expect = next;
        marker = true;
        break;
      }
      if (!complete && absl::StartsWith(m, rest)) {  // may still become the marker
        scan.result = HeaderScan::Result::kMore;
        return scan;
      }
    }
    if (marker) {
      markup_end = i;
      continue;
    }
    // A word: to whitespace or a marker's start (a word that begins with "<|" holds them at least).
    size_t end = i + (absl::StartsWith(rest, kMarkerOpen) ? kMarkerOpen.size() : 1);
    while (end < h.size() && !IsSpace(h[end]) && !absl::StartsWith(h.substr(end), kMarkerOpen)) ++end;
    const absl::string_view word = h.substr(i, end - i);
    const bool last = end == h.size() && !complete;  // it may grow
    if (absl::StartsWith(word, kRecipient)) {
      scan.recipient = std::string(word.substr(kRecipient.size()));
    } else if (expect == Expect::kChannel) {
      scan.channel = std::string(word);
      saw_channel = true;
    } else if (expect == Expect::kAny && !saw_channel) {
      if (last && absl::StartsWith(kRecipient, word)) {
        scan.result = HeaderScan::Result::kMore;
        return scan;
      }
      scan.result = HeaderScan::Result::kBad;
      scan.bad = markup_end;
      return scan;
    }
    // Else a role, or a content type (after <|constrain|> or the channel).
    expect = Expect::kAny;
    i = end;
    markup_end = i;
  }
  return scan;
}

// Ends the arguments `stream` wrote of a call's whole `body`: the rest of the body as written,
// unless the object was complete and only whitespace follows it.
void EndArguments(ArgumentsStream* stream, absl::string_view body, std::string* out) {
  const ArgumentsStream::State state = stream->Advance(body, out);
  const absl::string_view rest = body.substr(std::min(stream->consumed(), body.size()));
  if (state != ArgumentsStream::State::kDone || rest.find_first_not_of(kWhitespace) != absl::string_view::npos) {
    out->append(rest.data(), rest.size());
  }
}

}  // namespace

std::optional<HarmonyMarkers> HarmonyMarkersOf(const Tokenizer& tokenizer) {
  HarmonyMarkers m;
  for (auto [text, id] : {std::pair{kChannel, &m.channel}, {kConstrain, &m.constrain}, {kMessage, &m.message}}) {
    const std::optional<int32_t> found = tokenizer.SpecialTokenId(std::string_view(text.data(), text.size()));
    if (!found.has_value()) return std::nullopt;
    *id = *found;
  }
  return m;
}

absl::StatusOr<std::string> HarmonyCallGrammar(const std::vector<std::pair<std::string, std::string>>& tools,
                                               const HarmonyMarkers& markers) {
  if (tools.empty()) return absl::InvalidArgumentError("a forced call needs at least one tool");
  std::string calls, rules;
  for (size_t i = 0; i < tools.size(); ++i) {
    const auto& [name, schema] = tools[i];
    const std::string args = absl::StrCat("args", i);
    absl::StatusOr<std::string> r = grammar::JsonSchemaToGbnfRules(schema, args, absl::StrCat("t", i, "-"));
    if (!r.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("the parameters of tool \"", name, "\": ", r.status().message()));
    }
    absl::StrAppend(&rules, *r);
    // commentary to=functions.NAME <|constrain|>json<|message|>ARGS
    absl::StrAppend(&calls, i == 0 ? "" : " | ", grammar::GbnfLiteral(absl::StrCat("commentary to=functions.", name, " ")),
                    " <[", markers.constrain, "]> \"json\" <[", markers.message, "]> ", args);
  }
  return absl::StrCat("root ::= <[", markers.channel, "]> (", calls, ")\n", rules, grammar::JsonSharedGbnf());
}

bool IsHarmonyTemplate(absl::string_view template_source) { return absl::StrContains(template_source, kChannel); }

std::string HarmonyArguments(absl::string_view body) {
  ArgumentsStream stream(0);
  std::string out;
  EndArguments(&stream, body, &out);
  return out;
}

HarmonyParser::HarmonyParser(int max_calls, bool stream_arguments)
    : max_calls_(max_calls), stream_arguments_(stream_arguments) {}

HarmonyDelta HarmonyParser::Add(absl::string_view text) {
  HarmonyDelta out;
  buf_.append(text.data(), text.size());
  Process(/*final=*/false, &out);
  return out;
}

HarmonyDelta HarmonyParser::Finish() {
  HarmonyDelta out;
  Process(/*final=*/true, &out);
  return out;
}

void HarmonyParser::Process(bool final, HarmonyDelta* out) {
  while (true) {
    if (!in_body_) {
      if (!Header(final, out)) return;
      continue;
    }
    // A body: to an end marker (taken) or the next message's start (left for its header).
    absl::string_view marker;
    const size_t end = FindFirst(buf_, {kEnd, kCall, kReturn, kStart, kChannel}, &marker);
    if (end == std::string::npos) {
      const size_t hold = final ? 0 : PartialMarkers(buf_, {kEnd, kCall, kReturn, kStart, kChannel});
      Body(absl::string_view(buf_).substr(0, buf_.size() - hold), out);
      buf_.erase(0, buf_.size() - hold);
      if (final) EndBody(out);
      return;
    }
    Body(absl::string_view(buf_).substr(0, end), out);
    EndBody(out);
    const bool taken = marker == kEnd || marker == kCall || marker == kReturn;
    buf_.erase(0, end + (taken ? marker.size() : 0));
  }
}

bool HarmonyParser::Header(bool final, HarmonyDelta* out) {
  absl::string_view marker;
  const size_t end = FindFirst(buf_, {kMessage, kEnd, kCall, kReturn}, &marker);
  const bool complete = end != std::string::npos || final;
  const HeaderScan scan = ScanHeader(absl::string_view(buf_).substr(0, std::min(end, buf_.size())), complete);
  if (scan.result == HeaderScan::Result::kBad) {
    // Not a header: content from the text that is not markup on, until a message's start.
    buf_.erase(0, scan.bad);
    BeginBody(Kind::kContent, "", out);
    return true;
  }
  if (scan.result == HeaderScan::Result::kMore || !complete) return false;
  if (end == std::string::npos) {  // the output's end cut it
    buf_.clear();
    return false;
  }
  buf_.erase(0, end + marker.size());
  if (marker != kMessage) return true;  // an end marker closed it: dropped with it
  const absl::string_view recipient = scan.recipient;
  if (absl::StartsWith(recipient, kFunctions) && recipient.size() > kFunctions.size() && max_calls_ > 0) {
    ++calls_found_;
    if (calls_out_ >= max_calls_) {
      BeginBody(Kind::kDropped, "", out);
    } else {
      BeginBody(Kind::kCall, std::string(recipient.substr(kFunctions.size())), out);
    }
  } else {
    BeginBody(scan.channel == "analysis" ? Kind::kReasoning : Kind::kContent, "", out);
  }
  return true;
}

void HarmonyParser::BeginBody(Kind kind, std::string name, HarmonyDelta* out) {
  in_body_ = true;
  kind_ = kind;
  if (kind != Kind::kCall) return;
  name_ = std::move(name);
  body_.clear();
  if (stream_arguments_) {
    args_.emplace(0);
    out->pieces.push_back(ToolCallPiece{calls_out_, name_, ""});
  }
}

void HarmonyParser::Body(absl::string_view text, HarmonyDelta* out) {
  switch (kind_) {
    case Kind::kReasoning:
      out->reasoning.append(text.data(), text.size());
      return;
    case Kind::kContent:
      out->content.append(text.data(), text.size());
      return;
    case Kind::kDropped:
      return;
    case Kind::kCall:
      break;
  }
  body_.append(text.data(), text.size());
  if (!args_.has_value()) return;
  std::string arguments;
  args_->Advance(body_, &arguments);
  if (!arguments.empty()) out->pieces.push_back(ToolCallPiece{calls_out_, "", std::move(arguments)});
}

void HarmonyParser::EndBody(HarmonyDelta* out) {
  in_body_ = false;
  if (kind_ != Kind::kCall) return;
  if (args_.has_value()) {
    std::string rest;
    EndArguments(&*args_, body_, &rest);
    if (!rest.empty()) out->pieces.push_back(ToolCallPiece{calls_out_, "", std::move(rest)});
    args_.reset();
  } else {
    out->calls.push_back(ToolCall{std::move(name_), HarmonyArguments(body_)});
  }
  ++calls_out_;
  body_.clear();
  name_.clear();
}

}  // namespace shardserve::openai
