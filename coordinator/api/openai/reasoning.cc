#include "coordinator/api/openai/reasoning.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/api/openai/harmony.h"

namespace shardserve::openai {
namespace {

constexpr absl::string_view kOpen = "<think>";
constexpr absl::string_view kClose = "</think>";
constexpr char kWhitespace[] = " \t\r\n";

}  // namespace

absl::StatusOr<ReasoningFormat> ReasoningFormatFromName(absl::string_view name) {
  if (name == "none") return ReasoningFormat::kNone;
  if (name == "deepseek_r1" || name == "qwen3" || name == "glm45") return ReasoningFormat::kThink;
  if (name == "openai_gptoss") return ReasoningFormat::kHarmony;
  return absl::InvalidArgumentError(absl::StrCat("reasoning parser '", name,
                                                 "' is not known; the known ones are none, deepseek_r1, qwen3, glm45, "
                                                 "openai_gptoss"));
}

ReasoningFormat ReasoningFormatOfTemplate(absl::string_view source) {
  if (IsHarmonyTemplate(source)) return ReasoningFormat::kHarmony;
  return absl::StrContains(source, kOpen) ? ReasoningFormat::kThink : ReasoningFormat::kNone;
}

std::vector<absl::string_view> ReasoningMarkers(ReasoningFormat format) {
  if (format == ReasoningFormat::kThink) return {kOpen, kClose};
  return {};
}

bool PromptOpensReasoning(absl::string_view prompt) {
  const size_t open = prompt.rfind(kOpen);
  return open != absl::string_view::npos &&
         prompt.find_first_not_of(kWhitespace, open + kOpen.size()) == absl::string_view::npos;
}

ReasoningParser::ReasoningParser(bool inside) : state_(inside ? State::kReasoning : State::kStart) {}

ReasoningDelta ReasoningParser::Add(absl::string_view text) {
  ReasoningDelta out;
  buf_.append(text.data(), text.size());
  Process(/*final=*/false, &out);
  return out;
}

ReasoningDelta ReasoningParser::Finish() {
  ReasoningDelta out;
  Process(/*final=*/true, &out);
  return out;
}

void ReasoningParser::Process(bool final, ReasoningDelta* out) {
  while (true) {
    switch (state_) {
      case State::kStart: {
        const size_t p = std::min(buf_.find_first_not_of(kWhitespace), buf_.size());
        const absl::string_view rest = absl::string_view(buf_).substr(p);
        if (absl::StartsWith(rest, kOpen)) {
          buf_.erase(0, p + kOpen.size());
          state_ = State::kReasoning;
          break;
        }
        if (!final && absl::StartsWith(kOpen, rest)) return;  // may still become <think>
        state_ = State::kContent;
        break;
      }
      case State::kReasoning: {
        const size_t close = absl::string_view(buf_).find(kClose);
        if (close != absl::string_view::npos) {
          out->reasoning.append(buf_, 0, close);
          buf_.erase(0, close + kClose.size());
          state_ = State::kAfter;
          break;
        }
        // Hold the longest end that may begin </think>.
        size_t hold = 0;
        if (!final) {
          for (size_t n = std::min(buf_.size(), kClose.size() - 1); n > 0; --n) {
            if (absl::StartsWith(kClose, absl::string_view(buf_).substr(buf_.size() - n))) {
              hold = n;
              break;
            }
          }
        }
        out->reasoning.append(buf_, 0, buf_.size() - hold);
        buf_.erase(0, buf_.size() - hold);
        return;
      }
      case State::kAfter: {
        const size_t p = buf_.find_first_not_of(kWhitespace);
        if (p == std::string::npos) {
          buf_.clear();
          return;
        }
        buf_.erase(0, p);
        state_ = State::kContent;
        break;
      }
      case State::kContent:
        out->content += buf_;
        buf_.clear();
        return;
    }
  }
}

}  // namespace shardserve::openai
