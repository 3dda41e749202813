// A model's tokenizer_config.json as the chat template reads it (coordinator/chat/chat_template.h):
// the input is the file's text, loaded by ChatTemplate::FromTokenizerConfig as FromDirectory loads
// it (chat_template a string or a list of {"name", "template"}, the special tokens as strings or
// {"content": ...}), then rendered over the fixed conversation of fuzz/chat_conversation.h, with
// and without tools (a list's "tool_use" template is taken with tools).
//
// Invariants: loading fails only with InvalidArgument (not JSON, not an object, a malformed
// chat_template, a template that does not parse) or NotFound (no chat_template, an empty list); a
// loaded template has at least one name; a render fails only as chat_template_fuzzer's do (a
// template error, or a budget exceeded).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "coordinator/chat/chat_template.h"
#include "fuzz/chat_conversation.h"
#include "fuzz/check.h"
#include "nlohmann/json.hpp"

using shardserve_fuzz::Check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<shardserve::chat::ChatTemplate> tmpl = shardserve::chat::ChatTemplate::FromTokenizerConfig(text);
  if (!tmpl.ok()) {
    Check(absl::IsInvalidArgument(tmpl.status()) || absl::IsNotFound(tmpl.status()),
          "a refusal that is not InvalidArgument or NotFound");
    return 0;
  }
  Check(!tmpl->names().empty(), "a loaded chat template without a template");
  for (bool with_tools : {false, true}) {
    absl::StatusOr<std::string> out =
        tmpl->Render(shardserve_fuzz::ChatMessages(), /*add_generation_prompt=*/true,
                     with_tools ? shardserve_fuzz::ChatTools() : nullptr, {{"date_string", "01 Jan 2025"}});
    Check(out.ok() || shardserve_fuzz::AcceptableRenderError(out.status()), "a render error of another kind");
  }
  return 0;
}
