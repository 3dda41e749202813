// OpenAI's harmony response format, which gpt-oss writes: its output split into reasoning, content
// and tool calls, whole or as the text streams in (as vLLM's "openai" tool parser and
// "openai_gptoss" reasoning parser read it).
//
// The output is a sequence of messages. Each has a header, from its start to <|message|>:
// <|start|>ROLE (absent in the first message: the generation prompt ends with <|start|>assistant),
// <|channel|>CHANNEL, a recipient "to=RECIPIENT" (before or after the channel), and a content type
// ("json" after the channel, or <|constrain|>json). Its body follows <|message|> and ends at <|end|>,
// <|call|> or <|return|> (the last two end the generation; as eos tokens they usually do not reach
// the text, and the output's end ends the message). The body goes to:
//   - a tool call, with a recipient functions.NAME (whatever the channel) while calls are on
//     (max_calls > 0): NAME is the call's name, the body its arguments, see below;
//   - reasoning, in the channel analysis;
//   - content, in the channels final and commentary (preambles), in an unknown channel or none,
//     and with a recipient that is not such a call (a built-in tool such as browser.search is
//     read by its channel; functions.NAME while calls are off is content, so no text is lost).
// Calls over max_calls are counted and dropped, as tool_calls.h drops them.
//
// A call's arguments are the body's JSON object written compact (as tool_calls.h writes them),
// key by key as written (a key written twice stays twice), then the rest of the body as written
// when it holds more than whitespace; a body that is not a JSON object, or is cut short, is its
// compact part as far as it was a well-formed object's start, then the rest as written (the rule
// tool_calls.h states for a streamed call that turns malformed). Streamed (`stream_arguments`): the
// call is begun (index and name, arguments "") once its header is complete, and the arguments come
// in pieces as the body is written; joined they are exactly the arguments of the whole output.
//
// Bad output never crashes and never loses text:
//   - a header is markup, never shown. Its words are markup when they are to=..., the word right
//     after <|start|> (the role), <|channel|> or <|constrain|>, or any word after the channel's;
//     another word (text where a header is expected, as in an output that is not harmony) gives
//     the header up: from that word (and the whitespace before it) on the text is content, until
//     the next <|start|> or <|channel|>;
//   - a header that an end marker closes before <|message|>, or that the output's end cuts, is
//     dropped with that marker (it holds only markup);
//   - in a body, <|start|> or <|channel|> ends the message (a missing <|end|>) and begins the next
//     header; <|message|> and <|constrain|> there are text of the body;
//   - the output's end ends the open message (max_tokens cut it): what came of its body is
//     reasoning, content or the call's arguments as above.
// Text is held back only while it may be the start of a marker, or while a header is incomplete.
//
// Threading: plain values; a HarmonyParser is used by one thread at a time.
#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_HARMONY_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_HARMONY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "coordinator/api/openai/arguments_stream.h"
#include "coordinator/api/openai/tool_calls.h"

namespace shardserve::openai {

// Whether a chat template writes harmony (its text holds <|channel|>).
bool IsHarmonyTemplate(absl::string_view template_source);

// What a piece of text adds.
struct HarmonyDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> calls;        // without streamed arguments
  std::vector<ToolCallPiece> pieces;  // with streamed arguments
};

class HarmonyParser {
 public:
  // At most `max_calls` calls are handed out; 0: calls are off. `stream_arguments`: calls come as
  // pieces while they are written.
  HarmonyParser(int max_calls, bool stream_arguments);

  // The next piece of the output.
  HarmonyDelta Add(absl::string_view text);
  // The end of the output: what was held is decided, the open message ends.
  HarmonyDelta Finish();

  // Calls found so far, handed out or dropped (over max_calls).
  int calls_found() const { return calls_found_; }

 private:
  enum class Kind { kReasoning, kContent, kCall, kDropped };
  void Process(bool final, HarmonyDelta* out);
  // Reads the header buf_ begins with: false when it needs more text.
  bool Header(bool final, HarmonyDelta* out);
  void BeginBody(Kind kind, std::string name, HarmonyDelta* out);
  void Body(absl::string_view text, HarmonyDelta* out);
  void EndBody(HarmonyDelta* out);

  const int max_calls_;
  const bool stream_arguments_;
  std::string buf_;         // text not yet decided
  bool in_body_ = false;    // else buf_ begins with a header
  Kind kind_ = Kind::kContent;
  int calls_found_ = 0;
  int calls_out_ = 0;
  // The open call: its name, its body so far, and (streamed) its arguments' stream.
  std::string name_;
  std::string body_;
  std::optional<ArgumentsStream> args_;
};

// The arguments of a call whose whole body is `body`, as the header above states.
std::string HarmonyArguments(absl::string_view body);

// The special tokens a forced call's grammar names (HarmonyCallGrammar): their ids in the model's
// tokenizer.
struct HarmonyMarkers {
  int32_t channel = -1;    // <|channel|>
  int32_t constrain = -1;  // <|constrain|>
  int32_t message = -1;    // <|message|>
};
// From the model's tokenizer; nullopt unless each is one of its special tokens.
std::optional<HarmonyMarkers> HarmonyMarkersOf(const Tokenizer& tokenizer);

// tool_choice "required" or named under harmony: GBNF (grammar/grammar.h, the markers as <[id]>)
// of one call as gpt-oss writes it, <|channel|>commentary to=functions.NAME <|constrain|>json
// <|message|> and the arguments: NAME one of `tools` (name, its parameters schema as JSON text),
// the arguments that schema's compact JSON. The analysis channel is left out: the call begins at
// the first token, as a forced call does in the other formats, and generation ends where the
// arguments may (gpt-oss's <|call|> is an end token). InvalidArgument when a schema is refused
// (grammar/json_schema.h's message, naming the tool).
absl::StatusOr<std::string> HarmonyCallGrammar(const std::vector<std::pair<std::string, std::string>>& tools,
                                               const HarmonyMarkers& markers);

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_HARMONY_H_
