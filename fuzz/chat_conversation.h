// The fixed conversation the chat template targets render (chat_template, tokenizer_config): a
// system prompt, a tool call and its result, a reply with a thinking block, and a tool's schema.
// Header-only; the values are built once and never freed.
#ifndef SHARDSERVE_FUZZ_CHAT_CONVERSATION_H_
#define SHARDSERVE_FUZZ_CHAT_CONVERSATION_H_

#include "absl/status/status.h"
#include "nlohmann/json.hpp"

namespace shardserve_fuzz {

inline const nlohmann::ordered_json& ChatMessages() {
  static const auto* m = new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"([
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich? {{ braces }}"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call0a1b2c3d4", "type": "function",
      "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}}]},
    {"role": "tool", "tool_call_id": "call0a1b2c3d4", "content": "{\"temperature\": 21.5}"},
    {"role": "assistant", "content": "<think>\nhm\n</think>\n\nIt is 21.5 °C."},
    {"role": "user", "content": "  Thanks  \n"}])"));
  return *m;
}

inline const nlohmann::ordered_json& ChatTools() {
  static const auto* t = new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
      "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City"},
        "days": {"type": ["integer", "null"], "description": "Days"}}, "required": ["city"]}}}])"));
  return *t;
}

// What a render may fail with: a template error, or a budget exceeded (budget.h).
inline bool AcceptableRenderError(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsResourceExhausted(s) || absl::IsDeadlineExceeded(s);
}

}  // namespace shardserve_fuzz

#endif  // SHARDSERVE_FUZZ_CHAT_CONVERSATION_H_
