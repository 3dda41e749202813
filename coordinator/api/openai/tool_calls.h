// Tool calls in a model's output: the text a model writes when it calls a tool, in its family's
// format, turned into calls (a function name and its arguments as a JSON string), whole or as the
// text streams in. The formats (as vLLM's tool parsers read them):
//   hermes       Hermes, Qwen2.5, Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
//                one per call, anywhere in the text (a last one may lack its closing tag);
//   llama3_json  Llama 3.1 / 3.2 / 3.3: the output itself is {"name": ..., "parameters": {...}},
//                optionally after <|python_tag|>, several separated by ';';
//   mistral      Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or (newer
//                tokenizers) [TOOL_CALLS]name[ARGS]{...}, once per call;
//   deepseek_v3  DeepSeek-V3 and R1: <｜tool▁calls▁begin｜>, then per call
//                <｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{...}\n```<｜tool▁call▁end｜>,
//                then <｜tool▁calls▁end｜>; V3.1's calls are <｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}
//                <｜tool▁call▁end｜>, read by the same parser (the JSON right after the separator);
//   kimi_k2      Kimi K2: <|tool_calls_section_begin|>, then per call <|tool_call_begin|>ID
//                <|tool_call_argument_begin|>{...}<|tool_call_end|>, then <|tool_calls_section_end|>;
//                ID is functions.NAME:INDEX, the call's name its part after the last '.' and before
//                the ':', and the call keeps ID as its id (Kimi's template writes a tool result
//                under the id it came with), as vLLM's kimi_k2 parser reads it;
//   qwen3_coder  Qwen3-Coder: <tool_call>\n<function=name>\n<parameter=p>\nvalue\n</parameter>\n...
//                </function>\n</tool_call> (or a bare <function=...>...</function>); each value is
//                text, converted by the type its tool's `parameters` schema gives the parameter
//                (integer, number, boolean, object, array; "null" is null; unknown parameters and
//                strings stay text), as vLLM's qwen3_coder parser converts it;
//   glm45        GLM-4.5, 4.6 and 4.7: <tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n...
//                </tool_call> per call (4.7 writes no newlines); each value is text where the tool's
//                schema types the parameter "string", else its JSON (or Python's True, False, None),
//                else text, as vLLM's glm45 parser reads it. Its markers are special tokens.
// What is not a well-formed call (malformed JSON, no name, arguments that are not an object) stays
// content: the answer is never lost and never an error. Whitespace (and llama3_json's ';') next to
// a call is dropped (deepseek_v3's <｜tool▁calls▁end｜> and kimi_k2's <|tool_calls_section_end|> after
// a call too); an output without calls
// comes back as content unchanged.
//
// Streamed arguments (a parser made with `stream_arguments`, for streamed responses): as vLLM's
// streaming tool parsers do, a call is begun (a piece with its index and name, no arguments) as
// soon as its name is complete and its arguments have begun as a JSON object (qwen3_coder: once
// <function=NAME> is complete; glm45: once the name's line or its first <arg_key> ends it), and its arguments then come in pieces while the model writes
// them, each the compact JSON (as the whole call's `arguments` is written) of the text that came:
// a string's characters as they come, a number or literal once it ends, qwen3_coder's parameter
// (glm45's argument) once it is closed. Joined, a call's pieces are exactly the `arguments` the whole output gives.
// A call the parser cannot stream this way ("arguments" before "name", or as a JSON string; a
// qwen3_coder name with '<' in it) is handed out as one piece once it is complete, as without
// streaming. The rules once a call has begun (its name was sent, so it stays a call):
//   - it turns out malformed (bad JSON, a missing fence or tag, the output ends inside it): the
//     rest of its block's text, from where the pieces sent stop, as the model wrote it, is the end
//     of the open call's arguments (which are then not valid JSON), or content when no call of
//     the block is open; nothing is dropped. Without streaming such a block is content.
//   - a key (qwen3_coder: a parameter) written twice is sent twice, as written; the whole output's
//     arguments keep it once with its last value, which is what JSON readers make of both.
//   - a call's object that writes "name" or its arguments twice: the first, which is what was
//     streamed, in the whole output too.
//   - calls over `max_calls` are never begun.
//
// Threading: plain values; a ToolCallParser is used by one thread at a time.
#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_TOOL_CALLS_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_TOOL_CALLS_H_

#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/api/openai/arguments_stream.h"
#include "nlohmann/json.hpp"

namespace shardserve::openai {

enum class ToolCallFormat { kNone, kHermes, kLlama3Json, kMistral, kDeepSeekV3, kKimiK2, kQwen3Coder, kGlm45, kHarmony };

// The names --tool-call-parser takes ("none", "hermes", "llama3_json", "mistral", "deepseek_v3",
// "kimi_k2", "qwen3_coder", "glm45", "openai"); an unknown one is InvalidArgument listing the known ones. "openai" is
// gpt-oss's harmony format (kHarmony), which harmony.h parses whole, reasoning and content too: a
// ToolCallParser of it passes the text through as content, as kNone's does.
absl::StatusOr<ToolCallFormat> ToolCallFormatFromName(absl::string_view name);
const char* ToolCallFormatName(ToolCallFormat format);
// The format a chat template writes tool calls in, recognised by the markers its text holds:
// <|channel|> openai (harmony); <｜tool▁calls▁begin｜> deepseek_v3; <|tool_calls_section_begin|> kimi_k2;
// <function= with <parameter= qwen3_coder and <arg_key> glm45 (before hermes, whose
// <tool_call> they hold too); <tool_call> hermes; [TOOL_CALLS] mistral; <|python_tag|> llama3_json;
// kNone when it names none of them.
ToolCallFormat ToolCallFormatOfTemplate(absl::string_view template_source);
// Whether the format's markers are special tokens, which the detokenizer must then keep
// (mistral's [TOOL_CALLS], llama3_json's <|python_tag|>, deepseek_v3's, kimi_k2's and glm45's tool
// tokens, harmony's).
bool KeepsSpecialTokens(ToolCallFormat format);
// The markers of a format that KeepsSpecialTokens leaves to the text: hermes' and qwen3_coder's
// <tool_call> and </tool_call>, which a checkpoint may nonetheless make special tokens.
std::vector<absl::string_view> TextMarkers(ToolCallFormat format);

struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object's text
  std::string id{};       // the id the model wrote for the call (kimi_k2), else empty
  bool operator==(const ToolCall& o) const { return name == o.name && arguments == o.arguments && id == o.id; }
};

// A piece of a call streamed while it is generated: with a name it begins call `index` (the
// calls' count so far), whose arguments' text then grows by each piece's `arguments`.
struct ToolCallPiece {
  int index = 0;
  std::string name;       // the first piece of a call only
  std::string arguments;  // more of the arguments' text (may be empty)
  std::string id{};       // the first piece of a call only: ToolCall::id
  bool operator==(const ToolCallPiece& o) const {
    return index == o.index && name == o.name && arguments == o.arguments && id == o.id;
  }
};

// What a piece of text adds: content to show, then the calls it completed (in order; their
// indices continue from the calls before), or with streamed arguments the pieces of calls.
struct ToolCallDelta {
  std::string content;
  std::vector<ToolCall> calls;        // without streamed arguments
  std::vector<ToolCallPiece> pieces;  // with streamed arguments
};

// Splits a streamed output into content and calls. Text is held back only while it may still be
// (the start of) a call: a partial marker, a call not yet complete, whitespace that may border one.
// A call is handed out once its text is complete and well-formed, so that a malformed one can
// still turn into content; with `stream_arguments`, in pieces as it is written (see above).
class ToolCallParser {
 public:
  // At most `max_calls` calls are handed out (parallel_tool_calls false: 1); later ones are dropped.
  // `tools`: the request's tools (an array as protocol.h checks them, or null): qwen3_coder and glm45
  // read their parameters' types there.
  ToolCallParser(ToolCallFormat format, int max_calls, nlohmann::ordered_json tools = nullptr,
                 bool stream_arguments = false);

  // The next piece of the output.
  ToolCallDelta Add(absl::string_view text);
  // The end of the output: what was held is decided.
  ToolCallDelta Finish();

  // Calls found so far, handed out or dropped (over max_calls).
  int calls_found() const { return calls_found_; }

 private:
  void Process(bool final, ToolCallDelta* out);
  void EmitText(absl::string_view text, ToolCallDelta* out);
  // The position of a call's start marker in buf_, or npos; *hold: where text that may still
  // become a marker begins (buf_.size() when none).
  size_t FindStart(size_t* hold) const;
  // The earliest of `markers` in buf_ (npos when none), and *hold as FindStart's.
  size_t FindMarkers(std::initializer_list<absl::string_view> markers, size_t* hold) const;
  // The end of the call that buf_ begins with, or npos while incomplete.
  size_t FindEnd() const;
  // The calls of one complete block, or false when it is not well-formed.
  bool ParseBlock(absl::string_view block, std::vector<ToolCall>* calls) const;
  // Decides the block buf_[0, end) begins with: its calls, or content.
  void EndBlock(size_t end, ToolCallDelta* out);
  // A call found whole: counted, and handed out (as a call, or one piece) under max_calls.
  void Hand(ToolCall call, ToolCallDelta* out);

  // Streamed arguments: the pieces of the calls of `block` (the block buf_ begins with, as far as
  // it came; `complete`: all of it), from where the last look stopped.
  void Stream(absl::string_view block, bool complete, ToolCallDelta* out);
  void StreamQwen(absl::string_view block, bool complete, ToolCallDelta* out);
  void StreamGlm(absl::string_view block, bool complete, ToolCallDelta* out);
  enum class Header { kNeedMore, kFound, kNone };
  // The next call's name (and the id the model wrote, if its format has one) and where its
  // arguments' '{' is in `block`, from scan_ on.
  Header NextHeader(absl::string_view block, std::string* name, std::string* id, size_t* args);
  // Begins a call (false over max_calls); `arguments` its first text.
  bool Begin(std::string name, std::string arguments, std::string id, ToolCallDelta* out);
  void SendArguments(std::string text, ToolCallDelta* out);

  const ToolCallFormat format_;
  const int max_calls_;
  const nlohmann::ordered_json tools_;
  const char* separators_;
  std::string buf_;               // text not yet decided
  bool in_call_ = false;          // buf_ begins with a call's start marker
  std::string pending_;           // separators held: dropped when they border a call
  bool pending_after_call_ = false;
  bool calls_only_ = true;        // nothing but separators and calls so far
  int calls_found_ = 0;
  int calls_out_ = 0;

  // Streamed arguments (all reset at the end of each block).
  const bool stream_arguments_;
  size_t scan_ = 0;                          // buf_ read up to here for the block's calls
  bool stream_off_ = false;                  // the rest of the block is decided at its end
  std::vector<std::string> sent_;            // the arguments sent of each call begun in the block
  int first_index_ = 0;                      // the index of the block's first call begun
  std::shared_ptr<ArgumentsStream> args_;    // the open call's JSON arguments
  size_t wrapper_ = std::string::npos;       // mistral's list: the open item's '{'
  bool in_function_ = false;                 // qwen3_coder, glm45: inside a call begun
  const nlohmann::ordered_json* types_ = nullptr;  // qwen3_coder, glm45: its parameters' types
};

// The whole output at once: the parser's Add(text) and Finish() joined.
ToolCallDelta ParseToolCalls(ToolCallFormat format, absl::string_view text, int max_calls,
                             const nlohmann::ordered_json& tools = nullptr);

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_TOOL_CALLS_H_
