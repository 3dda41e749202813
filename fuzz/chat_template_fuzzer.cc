// Chat templates (coordinator/chat): the input is a template's source, parsed and rendered as
// ChatTemplate::FromString + Render do in production, over a fixed conversation with a tool call
// and tools. A template comes from a model directory, so it is less trusted than it looks: every
// failure must be an INVALID_ARGUMENT Status (never a crash, a hang or unbounded memory: the engine
// bounds nesting, loop iterations, macro calls and string sizes).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "coordinator/chat/chat_template.h"
#include "nlohmann/json.hpp"

namespace {

const nlohmann::ordered_json& Messages() {
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

const nlohmann::ordered_json& Tools() {
  static const auto* t = new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
      "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City"},
        "days": {"type": ["integer", "null"], "description": "Days"}}, "required": ["city"]}}}])"));
  return *t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  const nlohmann::ordered_json special = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  absl::StatusOr<shardserve::chat::ChatTemplate> tmpl = shardserve::chat::ChatTemplate::FromString(source, special);
  if (!tmpl.ok()) {
    if (tmpl.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  for (bool with_tools : {false, true}) {
    absl::StatusOr<std::string> out =
        tmpl->Render(Messages(), /*add_generation_prompt=*/with_tools, with_tools ? Tools() : nullptr,
                     {{"date_string", "01 Jan 2025"}});
    // A template error, or a budget exceeded (runtime/budget.h); nothing else.
    if (!out.ok() && out.status().code() != absl::StatusCode::kInvalidArgument &&
        out.status().code() != absl::StatusCode::kResourceExhausted &&
        out.status().code() != absl::StatusCode::kDeadlineExceeded) {
      std::abort();
    }
  }
  return 0;
}
