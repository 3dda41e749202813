// The Responses API (POST /v1/responses: OpenAI's shape for agents, which the OpenAI Agents SDK
// and other clients send) as a view of chat completions: a request body becomes a chat completion
// body (instructions a system message, input items messages, function tools and calls the chat
// API's), the chat path serves it (its template, tool-call and reasoning parsers, structured
// outputs), and its answer becomes a Response object (output items: reasoning, the message, each
// function call).
//
// Served: input as text or items (messages with text content, function_call, function_call_output;
// reasoning items are dropped, as they are what the model wrote), instructions, max_output_tokens,
// temperature, top_p, tools of type function, tool_choice, parallel_tool_calls, text.format
// (json_schema, json_object, text), user, store and metadata (accepted: nothing is stored) and the
// fields chat completions take beside them (vLLM's). Refused, naming the field: stream (not yet
// served), previous_response_id and background (nothing is stored), other tool and content types
// (built-in tools, images, files).
//
// Threading: plain functions.
#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_RESPONSES_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_RESPONSES_H_

#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace shardserve::openai {

// The chat completion body for a Responses request body (a JSON object); InvalidArgument naming
// the Responses field (base/field_error.h) when it is malformed or asks for what is not served.
absl::StatusOr<nlohmann::ordered_json> ResponsesToChat(const nlohmann::ordered_json& body);

// The Response object for `chat`, a chat completion answer to ResponsesToChat(`request`):
// id "resp_" + what follows "chatcmpl-" in the chat answer's id.
nlohmann::ordered_json ChatToResponse(const nlohmann::ordered_json& chat, const nlohmann::ordered_json& request);

// A chat completion error's param as the Responses request names it (max_tokens is
// max_output_tokens, messages[i] is input, tools[i].function is tools[i], response_format is
// text.format); others unchanged.
std::string ResponsesParam(const std::string& chat_param);

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_RESPONSES_H_
