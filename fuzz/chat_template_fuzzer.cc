// Chat templates (coordinator/chat): the input is a template's source, parsed and rendered as
// ChatTemplate::FromString + Render do in production, over a fixed conversation with a tool call
// and tools, and continuing its final message as RenderContinuing does (continue_final_message). A template comes from a model directory, so it is less trusted than it looks: every
// failure must be an INVALID_ARGUMENT Status (never a crash, a hang or unbounded memory: the engine
// bounds nesting, loop iterations, macro calls and string sizes).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "coordinator/chat/chat_template.h"
#include "fuzz/chat_conversation.h"
#include "nlohmann/json.hpp"

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
        tmpl->Render(shardserve_fuzz::ChatMessages(), /*add_generation_prompt=*/with_tools,
                     with_tools ? shardserve_fuzz::ChatTools() : nullptr, {{"date_string", "01 Jan 2025"}});
    if (!out.ok() && !shardserve_fuzz::AcceptableRenderError(out.status())) std::abort();
  }
  absl::StatusOr<std::string> continued = tmpl->RenderContinuing(shardserve_fuzz::ChatMessages(), nullptr,
                                                                 {{"date_string", "01 Jan 2025"}});
  if (!continued.ok() && !shardserve_fuzz::AcceptableRenderError(continued.status())) std::abort();
  return 0;
}
