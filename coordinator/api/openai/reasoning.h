// Reasoning in a thinking model's output: <think>...</think> (DeepSeek-R1, Qwen3, QwQ) split from
// the answer, whole or as the text streams in, so that the API returns it as reasoning_content
// apart from content. The output is reasoning when it begins with <think> (after whitespace) or
// when the prompt left a <think> open (templates that open it after the generation prompt); it
// ends at </think>, and the whitespace after it is dropped. An output that never closes it is all
// reasoning (max_tokens ran out while thinking). Without <think> the output is all content.
//
// Threading: plain values; a ReasoningParser is used by one thread at a time.
#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_REASONING_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_REASONING_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve::openai {

// kHarmony: gpt-oss's harmony format, its channel analysis (harmony.h parses the whole output).
enum class ReasoningFormat { kNone, kThink, kHarmony };

// The names --reasoning-parser takes: "none", "deepseek_r1", "qwen3" and "glm45" (all <think>),
// "openai_gptoss" (harmony); an unknown one is InvalidArgument listing the known ones.
absl::StatusOr<ReasoningFormat> ReasoningFormatFromName(absl::string_view name);
// kHarmony when the chat template's text writes <|channel|>, else kThink when it writes <think>,
// else kNone.
ReasoningFormat ReasoningFormatOfTemplate(absl::string_view template_source);
// The markers a format finds in the output's text: kThink's <think> and </think> (harmony's are
// special tokens its format keeps whole: KeepsSpecialTokens).
std::vector<absl::string_view> ReasoningMarkers(ReasoningFormat format);
// Whether a rendered prompt ends with <think> (and whitespace): the template opened the reasoning
// after the generation prompt, so the output starts inside it.
bool PromptOpensReasoning(absl::string_view prompt);

struct ReasoningDelta {
  std::string reasoning;
  std::string content;
};

// Splits a streamed output into reasoning and content; holds back only what may be (the start of)
// <think> or </think>, and the whitespace after </think>.
class ReasoningParser {
 public:
  // `inside`: the prompt opened <think> (PromptOpensReasoning).
  explicit ReasoningParser(bool inside);

  ReasoningDelta Add(absl::string_view text);
  ReasoningDelta Finish();

 private:
  enum class State { kStart, kReasoning, kAfter, kContent };
  void Process(bool final, ReasoningDelta* out);

  State state_;
  std::string buf_;
};

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_REASONING_H_
