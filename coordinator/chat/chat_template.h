// ChatTemplate: a model's chat template, loaded from its directory and rendered as transformers'
// tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=..., tokenize=False,
// **extra) renders it (transformers 4.49, jinja2 3.1: trim_blocks, lstrip_blocks, HF's tojson,
// raise_exception, strftime_now). transformers 5 renders the same but drops the message keys whose
// value is null (an assistant's "content": null beside its tool calls), which DeepSeek's templates
// then fail on; here such a key stays, None, as 4.49 gives it.
//
// Loading (FromDirectory): chat_template.jinja when the directory has one, else tokenizer_config.json's
// "chat_template": a string, or a list of {"name", "template"} (transformers picks "tool_use" when
// tools are given and the model has one, else "default"). The special tokens (bos_token, eos_token,
// unk_token, pad_token, ...) come from tokenizer_config.json, as strings or {"content": ...}.
//
// Immutable after loading; Render may be called from several threads at once.
#ifndef SHARDSERVE_COORDINATOR_CHAT_CHAT_TEMPLATE_H_
#define SHARDSERVE_COORDINATOR_CHAT_CHAT_TEMPLATE_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/chat/budget.h"
#include "nlohmann/json.hpp"

namespace shardserve::chat {

struct Template;

class ChatTemplate {
 public:
  // Reads DIR/chat_template.jinja or DIR/tokenizer_config.json (which must exist for the special
  // tokens unless chat_template.jinja does). NOT_FOUND when the model has no chat template.
  static absl::StatusOr<ChatTemplate> FromDirectory(const std::string& dir);
  // From the text of a tokenizer_config.json; `jinja_override`, when not empty, replaces its
  // chat_template (a chat_template.jinja file).
  static absl::StatusOr<ChatTemplate> FromTokenizerConfig(const std::string& config_json,
                                                          const std::string& jinja_override = "");
  // One template and the special tokens to expose ({"bos_token": "<s>", ...}).
  static absl::StatusOr<ChatTemplate> FromString(const std::string& source,
                                                 const nlohmann::ordered_json& special_tokens = nlohmann::ordered_json::object());

  // messages: a JSON array of message objects; tools: an array or null; extra: an object of further
  // template variables (date_string, enable_thinking ...) or null; they override the special tokens.
  // INVALID_ARGUMENT for inputs of the wrong shape, for a template's raise_exception (the message
  // first) and for errors while rendering (with the template line and column). The template runs
  // within `budget` (budget.h: a deadline, caps on elements, iterations, bytes and nesting,
  // and a cancellation check); exceeding it is RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED or CANCELLED
  // with a message naming the budget and its limit.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                     const nlohmann::ordered_json& tools = nullptr,
                                     const nlohmann::ordered_json& extra = nullptr,
                                     const RenderBudget& budget = {}) const;

  // The prompt for the model to continue the final message (an assistant's answer begun by the
  // client, a "prefill"), as transformers 5's apply_chat_template(..., continue_final_message=True)
  // renders it (add_generation_prompt false): the final message's text (its content, or the last
  // text part of a list) is marked at its end before rendering, and the prompt cut where the mark
  // lands (and, when the template trimmed the message, after its last non-space). INVALID_ARGUMENT
  // with transformers' message when there is no final message, no text in it, a template that never
  // reads "content", or a template that drops or rewrites the text; otherwise as Render.
  absl::StatusOr<std::string> RenderContinuing(const nlohmann::ordered_json& messages,
                                               const nlohmann::ordered_json& tools = nullptr,
                                               const nlohmann::ordered_json& extra = nullptr,
                                               const RenderBudget& budget = {}) const;

  // The names of the templates ("default" for a single one).
  std::vector<std::string> names() const;
  // The templates' text, all of them concatenated: what recognises a model family's formats
  // (tool calls, reasoning).
  const std::string& source() const { return source_; }

 private:
  // The mark RenderContinuing puts after the final message's text (transformers' tag).
  static constexpr char kContinueMark[] = "CONTINUE_FINAL_MESSAGE_TAG ";
  // One template: parsed, and its text.
  struct Named {
    std::shared_ptr<const Template> parsed;
    std::string source;
  };
  // The template transformers picks for `tools`, once the arguments' shapes are checked.
  absl::StatusOr<const Named*> Pick(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                    const nlohmann::ordered_json& extra) const;
  absl::StatusOr<std::string> RenderWith(const Named& tmpl, const nlohmann::ordered_json& messages,
                                         bool add_generation_prompt, const nlohmann::ordered_json& tools,
                                         const nlohmann::ordered_json& extra, const RenderBudget& budget) const;

  std::map<std::string, Named> templates_;  // constant after loading
  nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();
  std::string source_;  // constant after loading
};

}  // namespace shardserve::chat

#endif  // SHARDSERVE_COORDINATOR_CHAT_CHAT_TEMPLATE_H_
