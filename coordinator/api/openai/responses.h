// The Responses API (POST /v1/responses: OpenAI's shape for agents, which the OpenAI Agents SDK
// and other clients send) as a view of chat completions: a request body becomes a chat completion
// body (instructions a system message, input items messages, function tools and calls the chat
// API's), the chat path serves it (its template, tool-call and reasoning parsers, structured
// outputs), and its answer becomes a Response object (output items: reasoning, the message, each
// function call).
//
// Served: input as text or items (messages with text content, function_call, function_call_output;
// reasoning items are dropped, as they are what the model wrote), instructions, max_output_tokens,
// temperature, top_p, reasoning.effort (the chat API's reasoning_effort), truncation (auto: the
// oldest turns dropped until the prompt fits; DropOldestTurn), tools of type function,
// tool_choice, parallel_tool_calls, text.format
// (json_schema, json_object, text), include's "message.output_text.logprobs" and top_logprobs
// (AsksLogprobs), user, metadata, store and previous_response_id (the HTTP
// server keeps stored responses: responses_store.h; this file is given the conversation), the
// fields chat completions take beside them (vLLM's), and stream (the chat stream's chunks made the
// Responses API's events by ResponsesView). Refused, naming the field: background and conversation,
// other tool and content types (built-in tools, images, files).
//
// Threading: plain functions; a ResponsesView is used by one thread at a time.
#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_RESPONSES_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_RESPONSES_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace shardserve::openai {

// The chat completion body for a Responses request body (a JSON object); InvalidArgument naming
// the Responses field (base/field_error.h) when it is malformed or asks for what is not served. A
// streamed one asks for the usage chunk (stream_options.include_usage), which the last event needs.
// `earlier`: the items of the stored conversation that previous_response_id names
// (ResponsesStore::Conversation), read after the instructions and before the input; without it, a
// previous_response_id is refused (nothing is stored).
absl::StatusOr<nlohmann::ordered_json> ResponsesToChat(const nlohmann::ordered_json& body,
                                                       const nlohmann::ordered_json* earlier = nullptr);

// A request's input (checked by ResponsesToChat) as the items a stored response keeps and
// GET /v1/responses/{id}/input_items lists: a string a user message, each message's content as
// input_text / output_text parts, and every item with an id (its own, else "msg_" / "fc_" /
// "fco_" / "rs_" + `id` without "resp_" + "_in" + its index).
nlohmann::ordered_json NormalizedInputItems(const nlohmann::ordered_json& input, const std::string& id);

// Whether a Responses request asks for the output's log-probabilities: include has
// "message.output_text.logprobs", or top_logprobs > 0. The chat body then asks for logprobs, and
// the message's output_text part has them ("logprobs": the chat answer's logprobs.content, every
// generated token's, its reasoning and calls included).
bool AsksLogprobs(const nlohmann::ordered_json& body);

// One /v1/responses request's answer made from the chat path's: a whole answer by ChatToResponse
// (Answer), a stream's chunks (their JSON, in order) as the Responses API's server-sent events
// ("event: TYPE\ndata: JSON\n\n", sequence_number from 0): response.created and response.in_progress
// first; per output item (reasoning, the message, each function call, in the
// order they begin) output_item.added, its deltas (reasoning_text.delta; content_part.added and
// output_text.delta; function_call_arguments.delta) and their .done events, output_item.done when
// the next begins or the output ends; then response.completed (response.incomplete at
// max_output_tokens) with the whole Response, as ChatToResponse makes it, item ids included.
class ResponsesView {
 public:
  explicit ResponsesView(nlohmann::ordered_json request)
      : request_(std::move(request)), logprobs_(AsksLogprobs(request_)) {}
  // Called with the Response once it is whole (Answer, or End without an error): what the server
  // stores.
  void OnFinished(std::function<void(const nlohmann::ordered_json&)> finished) { finished_ = std::move(finished); }
  // Whether the request asks for truncation "auto": the oldest turns dropped until the prompt
  // leaves room for the output (the server renders it again each time).
  bool truncates() const { return request_.contains("truncation") && request_["truncation"] == "auto"; }
  // The Response for a whole chat completion answer.
  nlohmann::ordered_json Answer(const nlohmann::ordered_json& chat);
  // The events of one chat chunk (the usage chunk included).
  std::string Chunk(const nlohmann::ordered_json& chunk);
  // The events that end the stream: the items still open closed and the Response; or, with an
  // error body (the API's error JSON), an "error" event.
  std::string End(const nlohmann::ordered_json* error = nullptr);

 private:
  enum class Kind { kNone, kReasoning, kMessage, kCall };
  std::string Emit(const std::string& type, nlohmann::ordered_json fields);
  // Closes the open item, if any, with its .done events.
  std::string Close();
  // Opens an item of `kind` (closing the one open); `call` the chat delta of a new call.
  std::string Open(Kind kind, const nlohmann::ordered_json* call = nullptr);
  // The Response so far, as ChatToResponse makes it from what was streamed.
  nlohmann::ordered_json Whole(const std::string& status) const;

  const nlohmann::ordered_json request_;
  const bool logprobs_;  // the message's output_text has its tokens' log-probabilities
  nlohmann::ordered_json tokens_ = nlohmann::ordered_json::array();  // every streamed token's (chat's content)
  std::function<void(const nlohmann::ordered_json&)> finished_;
  std::string id_;  // the chat stream's, without "chatcmpl-"
  nlohmann::ordered_json chat_ = nlohmann::ordered_json::object();  // the answer gathered as a chat completion
  std::string reasoning_, content_;
  nlohmann::ordered_json calls_ = nlohmann::ordered_json::array();  // chat tool_calls
  Kind open_ = Kind::kNone;
  int output_index_ = -1;  // the open item's
  int64_t sequence_ = 0;
  bool started_ = false;
  std::string finish_;
};

// The oldest turn of a chat conversation dropped (truncation "auto"): the messages after the
// leading system ones up to the next user message, from `messages` and from `twin` (another form
// of the same list; may be null). False, and nothing dropped, when one turn is left.
bool DropOldestTurn(nlohmann::ordered_json* messages, nlohmann::ordered_json* twin);

// The Response object for `chat`, a chat completion answer to ResponsesToChat(`request`):
// id "resp_" + what follows "chatcmpl-" in the chat answer's id; `store` as the request says
// (the server writes there whether it stores it), and its previous_response_id.
nlohmann::ordered_json ChatToResponse(const nlohmann::ordered_json& chat, const nlohmann::ordered_json& request);

// A chat completion error's param as the Responses request names it (max_tokens is
// max_output_tokens, reasoning_effort is reasoning.effort, messages[i] is input, tools[i].function is
// tools[i], response_format is text.format); others unchanged.
std::string ResponsesParam(const std::string& chat_param);

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_RESPONSES_H_
