// The OpenAI API's wire format, apart from HTTP and the engine: a request body parsed and checked
// field by field (each field once, here, with its name in the error), turned into the gRPC API's
// GenerateRequest so that PrepareGeneration (coordinator/api/request_validation.h) applies the same
// checks and defaults to both front doors; and the JSON of responses, stream chunks and errors.
//
// What is checked where: this file checks the JSON shape (types, which fields go together, what
// this server does not support); PrepareGeneration checks the values against the model (ranges,
// vocabulary, context length), and its errors, which carry the gRPC API's field
// (base/field_error.h), are given the OpenAI field names by a table (RenameGenerationError).
// Unknown fields are ignored, as OpenAI-compatible servers do.
//
// Errors: absl::Status whose message starts with the field ("temperature: must be >= 0"); the
// field also travels in the status (base/field_error.h FieldError; ParamOf) for the error body's
// "param".
//
// Threading: plain functions and values.
#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_PROTOCOL_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_PROTOCOL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/api/openai/harmony.h"
#include "coordinator/api/openai/reasoning.h"
#include "coordinator/api/openai/tool_calls.h"
#include "coordinator/model/structured_output.h"  // the constraints' bounds (kMaxStructured*)
#include "coordinator/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "shardserve/v1/inference.pb.h"

namespace shardserve::openai {

enum class Endpoint { kChatCompletions, kCompletions };

// Choices one request may ask for (n), and a completion's prompts in one request (a batch), and
// the choices of all of them together (prompts x n).
inline constexpr int kMaxChoices = 16;
inline constexpr int kMaxPrompts = 256;
inline constexpr int kMaxBatchChoices = 256;
// Tools one request may declare, and the longest tool name (OpenAI's limits); a name is letters,
// digits, '_' and '-'.
inline constexpr int kMaxTools = 128;
inline constexpr int kMaxToolNameLength = 64;
// Tool calls one assistant message may carry.
inline constexpr int kMaxToolCallsPerMessage = 128;

// tool_choice: "auto" (the model decides; its calls are parsed from its output), "none" (no
// calls: the output is content, the tools still rendered into the prompt), "required" (a grammar
// makes the output a JSON array of one or more {"name": <a tool>, "parameters": <its schema>},
// returned as tool_calls) or a named function (a grammar makes the output that function's
// `parameters`, returned as one call), as vLLM does them.
enum class ToolChoice { kAuto, kNone, kRequired, kNamed };

// A request body, checked.
struct Request {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;
  // /v1/chat/completions: the messages (each content made a string: text parts joined by "\n";
  // an assistant message's tool_calls with their arguments parsed into objects, as templates take
  // them), tools (null or an array of checked function tools), chat_template_kwargs (null or an
  // object; reasoning_effort and documents join it as the template variables they are),
  // add_generation_prompt, continue_final_message.
  nlohmann::ordered_json messages;
  // The messages with tool-call arguments as the client's JSON text, when some were parsed: for
  // templates that write the text itself (DeepSeek-R1's concatenates it), tried when `messages`
  // do not render. Null otherwise.
  nlohmann::ordered_json messages_with_argument_text;
  nlohmann::ordered_json tools;
  nlohmann::ordered_json chat_template_kwargs;
  bool add_generation_prompt = true;
  // The prompt ends inside the final message, which the model continues (an answer begun by the
  // client: chat::ChatTemplate::RenderContinuing); add_generation_prompt is then false.
  bool continue_final_message = false;
  ToolChoice tool_choice = ToolChoice::kAuto;
  bool parallel_tool_calls = true;  // false: at most one call returned
  std::string named_tool;  // ToolChoice::kNamed: the function's name
  // /v1/completions: one prompt or a batch of them (`prompt` a list of strings or of token id
  // lists), each a string or token ids. Prompt p's choice i is the answer's choice p * n + i, as
  // OpenAI numbers them.
  struct Prompt {
    std::string text;
    std::vector<int32_t> ids;
    bool is_ids = false;
  };
  std::vector<Prompt> prompts;

  int n = 1;
  bool stream = false;
  // vLLM's echo: each choice's text begins with its prompt (completions: the text as sent, token
  // ids decoded; not with logprobs) or with the final message's content (chat: when that message
  // is the assistant's, or any message continued without a generation prompt).
  bool echo = false;
  bool include_usage = false;  // stream_options.include_usage
  // stream_options.continuous_usage_stats (vLLM's): with include_usage, every chunk carries its
  // choice's usage so far (else only the last, usage-only chunk has usage).
  bool continuous_usage_stats = false;
  // vLLM's return_tokens_as_token_ids: the logprobs name each token "token_id:ID" (its bytes stay
  // its text's), for clients that need the exact ids.
  bool return_tokens_as_token_ids = false;
  // Unset: 16 for completions, what the context leaves for chat (as OpenAI and vLLM).
  std::optional<int64_t> max_tokens;
  // Everything but max_tokens, as the gRPC API takes it (seed included when given).
  v1::SamplingParams sampling;
  // The field that set sampling.structured_output ("response_format.json_schema.schema",
  // "guided_regex", ...): errors about the constraint name it. Empty: no constraint.
  std::string constraint_field;
  std::string user;  // accepted, unused
  // vLLM's request_id: the id the answer and the log give the request (after "chatcmpl-" or
  // "cmpl-"), unless an X-Request-Id header names one. Empty: a random one.
  std::string request_id;
};

// Parses and checks `body` for `endpoint`. InvalidArgument naming the field (ParamOf) otherwise.
absl::StatusOr<Request> ParseRequest(Endpoint endpoint, absl::string_view body);

// POST /tokenize (vLLM's): a prompt's text, or a chat's messages as the chat template renders them
// (the chat fields of Request: messages, tools, chat_template_kwargs, add_generation_prompt,
// continue_final_message), as token ids. A model, when named, must be the served one.
struct TokenizeRequest {
  std::string model;  // empty: the served model
  bool chat = false;  // messages were sent (else a prompt)
  std::string prompt;
  Request messages;  // chat: its chat fields
  // BOS and the like added by the tokenizer: by default for a prompt, not for messages (their
  // template writes them).
  bool add_special_tokens = true;
  bool return_token_strs = false;  // also the tokens' vocabulary strings
};
absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body);

// POST /detokenize (vLLM's): token ids back to text, special tokens kept.
struct DetokenizeRequest {
  std::string model;  // empty: the served model
  std::vector<int32_t> tokens;
};
absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(absl::string_view body);

// The GenerateRequest of choice `index` (of n) of a prompt: `prompt_ids` where given (a chat's, or
// a completion's ids), else the completion's prompt `prompt` as text; `max_tokens`; and the seed
// of the choice: seed + index when the request gave one (each choice its own draws, the first the
// seed itself; every prompt of a batch the same seeds, as when each is sent alone), else none
// (PrepareGeneration draws one).
v1::GenerateRequest ToGenerateRequest(const Request& request, int prompt, int index, int32_t max_tokens,
                                      const std::vector<int32_t>* prompt_ids);

// An error of PrepareGeneration as the OpenAI request's field names it: the gRPC API's field it
// carries (base/field_error.h) mapped by table ("sampling.top_p" becomes "top_p",
// "prompt.token_ids.ids[3]" "prompt[3]", a chat prompt's "prompt" "messages"), the message after
// the field kept, and the param set. An error about sampling.structured_output names
// `constraint_field` (Request::constraint_field). Other errors (another code, no field) pass as
// they are. `batch_prompt` >= 0: the error is about that prompt of a batch, and a field of the
// prompt is named with its index ("prompt[2]", "prompt[2][5]").
absl::Status RenameGenerationError(const absl::Status& status, Endpoint endpoint,
                                   absl::string_view constraint_field = "", int batch_prompt = -1);

// tool_choice "required" or named when the model writes gpt-oss's harmony format (`markers` its
// special tokens): the request's constraint, the JSON array of calls every other format gets,
// becomes the grammar of one call as harmony writes it (HarmonyCallGrammar: the named tool, or
// one of the request's tools), so the output is parsed as harmony. An error names tool_choice.
absl::Status HarmonyForcedToolConstraint(Request* r, const HarmonyMarkers& markers);

// InvalidArgument "field: what" with field as its param.
absl::Status InvalidField(absl::string_view field, absl::string_view what);
// A request body parsed: a JSON object (nested at most 128 levels), else InvalidArgument saying
// what is wrong.
absl::StatusOr<nlohmann::ordered_json> ParseBody(absl::string_view body);
// The field an error names, or empty.
std::string ParamOf(const absl::Status& status);

// An error as the API answers it.
struct ApiError {
  int http_status = 500;
  std::string type;     // "invalid_request_error", "rate_limit_error", ...
  std::string message;
  std::string param;    // empty: null
  std::string code;     // empty: null
};
// INVALID_ARGUMENT 400, NOT_FOUND 404 (code model_not_found), RESOURCE_EXHAUSTED 429,
// UNAVAILABLE 503, anything else 500.
ApiError ErrorFromStatus(const absl::Status& status);
// {"error": {"message", "type", "param", "code"}}.
std::string ErrorBody(const ApiError& error);

// ---- Responses ----

// OpenAI's finish_reason of a GenerateResponse's: "stop" (EOS, a stop id or string) or "length".
const char* FinishReasonName(v1::FinishReason reason);

// The usage object: prompt, completion and total tokens, prompt_tokens_details.cached_tokens.
nlohmann::ordered_json UsageJson(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);

// Log-probabilities of `entries` (one per generated token) in the chat shape's "content" list
// ([{token, logprob, bytes, top_logprobs: [...]}]); tokens as the tokenizer decodes each alone
// (empty without one), or with `token_ids` named "token_id:ID" (bytes still the decoded text's).
nlohmann::ordered_json ChatLogprobsContent(const std::vector<v1::TokenLogprobs>& entries, const Tokenizer* tokenizer,
                                           bool token_ids = false);
// The completions shape: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset},
// offsets counted from `text_offset` in UTF-8 bytes of the completion; tokens named as above. With
// `unscored_first` (an echoed prompt's first token, which nothing predicts) that token comes first,
// its logprob and top_logprobs null.
nlohmann::ordered_json CompletionLogprobs(const std::vector<v1::TokenLogprobs>& entries, const Tokenizer* tokenizer,
                                          int64_t text_offset, bool token_ids = false,
                                          std::optional<int32_t> unscored_first = std::nullopt);
// vLLM's prompt_logprobs: null for the prompt's first token, then per token an object keyed by token
// id (decimal) holding {logprob, rank, decoded_token} of the prompt's token and of each alternative
// (rank 1 + its place among them); decoded_token named as above.
nlohmann::ordered_json PromptLogprobs(const std::vector<v1::TokenLogprobs>& entries, const Tokenizer* tokenizer,
                                      bool token_ids = false);

// ---- Tool calls and reasoning in chat responses ----

// A chat choice's output, or a streamed piece of it, split into reasoning, content and calls:
// whole calls (in a whole answer) or, streamed, pieces of calls.
struct OutputSplit {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> calls;
  std::vector<ToolCallPiece> pieces;
};

// The calls of tool_choice "required" or named as their grammar generates them, in pieces: for
// a named function the whole output is its arguments; for "required" the output is a JSON array
// of {"name", "parameters"} objects, each call begun once its name is complete, its arguments the
// "parameters" value's text as it comes (the grammar makes that value well-formed, so it can be
// streamed before it is complete). Used by one thread at a time.
class ForcedCallStream {
 public:
  ForcedCallStream(ToolChoice forced, std::string name);
  // The pieces `text` completes.
  std::vector<ToolCallPiece> Add(absl::string_view text);
  // Calls begun so far.
  int calls() const { return calls_; }

 private:
  // Scans text_ from pos_ on, handing out the pieces of each item as it ends.
  void Scan(std::vector<ToolCallPiece>* out);
  // The pieces of the current item not yet handed out, once its name is known.
  void Emit(std::vector<ToolCallPiece>* out);

  const ToolChoice forced_;
  const std::string name_;
  std::string text_;  // the output so far
  size_t pos_ = 0;    // scanned up to here
  int calls_ = 0;
  // "required": the JSON scanner's state, and the current item's ({"name", "parameters"}).
  int depth_ = 0;
  bool in_string_ = false, escaped_ = false;
  bool expect_key_ = false;       // at depth 2: the next string is a key
  bool string_is_key_ = false;    // the open string is such a key
  size_t string_start_ = 0;       // the open string's quote
  std::string key_;               // the last key at depth 2
  std::string value_key_;         // the key of the value being read at depth 2 ("" when none)
  bool awaiting_value_ = false;   // after that key's ':'
  std::string item_name_;
  bool have_name_ = false, begun_ = false;
  size_t params_start_ = std::string::npos, params_end_ = std::string::npos;
  size_t params_sent_ = std::string::npos;  // the arguments sent up to here
};

// Splits one chat choice's output as it streams: the reasoning first (when on), then the tool
// calls in what is left (when the format is not kNone); with the format kHarmony all three by
// harmony.h (reasoning then always on). Used by one thread at a time.
class OutputSplitter {
 public:
  // `reasoning_inside`: the prompt opened <think>. `max_calls`: 1 with parallel_tool_calls false.
  // `tool_list`: the request's tools (ToolCallParser's `tools`). `incremental` (a streamed answer):
  // calls are handed out as pieces while they are written (ToolCallParser's `stream_arguments`).
  OutputSplitter(bool reasoning, bool reasoning_inside, ToolCallFormat tools, int max_calls,
                 nlohmann::ordered_json tool_list = nullptr, bool incremental = false);
  // tool_choice "required" or a named function (`forced`; `name` the named one): the output is the
  // calls' JSON its grammar made. Held until the final piece (ForcedToolCalls) unless `incremental`
  // (a streamed answer): then handed out as ForcedCallStream's pieces while it is generated.
  OutputSplitter(ToolChoice forced, std::string name, bool incremental = false);
  // The next piece of the output; `final`: the last one (what was held is decided).
  OutputSplit Add(absl::string_view text, bool final);
  bool reasoning() const { return reasoning_.has_value() || harmony_.has_value(); }

 private:
  std::optional<ReasoningParser> reasoning_;
  ToolCallParser tools_;
  std::optional<HarmonyParser> harmony_;
  ToolChoice forced_ = ToolChoice::kAuto;
  std::string forced_name_;
  std::string held_;  // forced calls: the output so far
  std::optional<ForcedCallStream> stream_;  // forced calls, incremental
};

// The calls of a whole output made under tool_choice `forced` (kRequired: a JSON array of
// {"name", "parameters"}; kNamed: the arguments of function `name`). nullopt when the output is
// not that (cut by max_tokens or a stop string): it is then content.
std::optional<std::vector<ToolCall>> ForcedToolCalls(ToolChoice forced, const std::string& name,
                                                     absl::string_view output);

// The message of a whole chat choice: role, content (null when there are calls and no text),
// reasoning_content (with `reasoning` on: the text, or null), tool_calls (when there are calls;
// ids[i] the id of call i: {id, type: "function", function: {name, arguments}}).
nlohmann::ordered_json ChatMessage(const OutputSplit& whole, bool reasoning, const std::vector<std::string>& ids);
// The stream deltas of a piece: {"reasoning_content"}, {"content"}, then for each call (indices
// from `first_call` on, ids[index] its id) one delta with its index, id, type and name (arguments
// ""), then one with its arguments; for each call piece, a piece with a name as a call's first
// delta and, when it has arguments, one with them. Empty when the piece adds nothing.
std::vector<nlohmann::ordered_json> ChatDeltas(const OutputSplit& piece, int first_call,
                                               const std::vector<std::string>& ids);
// finish_reason "tool_calls" when the choice made calls and stopped by itself; else `reason`.
const char* ChatFinishReason(v1::FinishReason reason, bool made_calls);

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_PROTOCOL_H_
