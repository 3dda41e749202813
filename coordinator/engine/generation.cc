#include "coordinator/engine/generation.h"

#include <algorithm>

#include "absl/strings/match.h"

namespace shardserve {

v1::RowSampling SamplingTemplate(const GenerationParams& p) {
  v1::RowSampling r;
  r.set_temperature(p.temperature);
  r.set_top_k(p.top_k);
  r.set_top_p(p.top_p);
  r.set_seed(p.seed);
  r.set_min_p(p.min_p);
  r.set_repetition_penalty(p.repetition_penalty == 1 ? 0 : p.repetition_penalty);
  r.set_presence_penalty(p.presence_penalty);
  r.set_frequency_penalty(p.frequency_penalty);
  r.set_logprobs(p.logprobs);
  r.set_top_logprobs(p.top_logprobs);
  if (p.prompt_logprobs >= 0) r.set_prompt_logprobs(p.prompt_logprobs);
  r.mutable_allowed_ids()->Add(p.allowed_token_ids.begin(), p.allowed_token_ids.end());
  for (const std::vector<int32_t>& word : p.bad_word_ids) {
    r.mutable_bad_word_ids()->Add(word.begin(), word.end());
    r.add_bad_word_lengths(static_cast<int32_t>(word.size()));
  }
  for (const auto& [id, bias] : p.logit_bias) {
    r.add_logit_bias_ids(id);
    r.add_logit_bias_values(bias);
  }
  if (!p.min_tokens_banned_ids.empty()) {
    r.set_min_tokens(p.min_tokens);
    r.mutable_min_tokens_banned_ids()->Add(p.min_tokens_banned_ids.begin(), p.min_tokens_banned_ids.end());
  }
  return r;
}

// ---- StopStringFilter ---------------------------------------------------------------------------

StopStringFilter::StopStringFilter(std::vector<std::string> stops, bool keep) : stops_(std::move(stops)), keep_(keep) {
  for (const std::string& stop : stops_) longest_ = std::max(longest_, stop.size());
}

std::string StopStringFilter::Add(absl::string_view text, bool* stopped) {
  *stopped = false;
  held_.append(text.data(), text.size());
  size_t cut = std::string::npos, end = std::string::npos;
  for (const std::string& stop : stops_) {
    if (const size_t at = held_.find(stop); at < cut) {
      cut = at;
      end = at + stop.size();
    }
  }
  if (keep_) {
    // The stop string, were one found, ends past what was handed out (else it would have ended
    // the text then).
    std::string out = held_.substr(sent_, (cut != std::string::npos ? end : held_.size()) - sent_);
    if (cut != std::string::npos) {
      *stopped = true;
      held_.clear();
      sent_ = 0;
      return out;
    }
    // What a stop string completing later may begin in.
    const size_t tail = longest_ > 0 ? longest_ - 1 : 0;
    if (held_.size() > tail) held_.erase(0, held_.size() - tail);
    sent_ = held_.size();
    return out;
  }
  if (cut != std::string::npos) {
    *stopped = true;
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  // Hold the longest end of the text that begins some stop string.
  size_t hold = 0;
  for (const std::string& stop : stops_) {
    for (size_t n = std::min(stop.size() - 1, held_.size()); n > hold; --n) {
      if (absl::StartsWith(stop, absl::string_view(held_).substr(held_.size() - n))) {
        hold = n;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopStringFilter::Flush() {
  std::string out = keep_ ? std::string() : held_;  // with keep_, all of it was handed out
  held_.clear();
  sent_ = 0;
  return out;
}

// ---- Generation ---------------------------------------------------------------------------------

Generation::Generation(const GenerationParams& params, const std::vector<int32_t>& eos_ids,
                       const Tokenizer* tokenizer)
    : params_(params), eos_ids_(eos_ids), filter_(params.stop, params.include_stop_str_in_output) {
  if (tokenizer != nullptr) {
    detokenizer_ =
        std::make_unique<IncrementalDetokenizer>(*tokenizer, params.skip_special_tokens, params.kept_special_ids);
  }
}

bool Generation::Accept(int32_t id, v1::GenerateResponse* response) {
  response->Clear();
  ++generated_;
  const bool eos = !params_.ignore_eos && std::find(eos_ids_.begin(), eos_ids_.end(), id) != eos_ids_.end();
  const bool stop_id = std::find(params_.stop_token_ids.begin(), params_.stop_token_ids.end(), id) !=
                       params_.stop_token_ids.end();
  bool stopped = false;
  std::string text = filter_.Add(detokenizer_ && !(eos && !params_.skip_special_tokens) ? detokenizer_->Add(id) : std::string(),
                                &stopped);
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  if (stopped) {
    finish = v1::FINISH_REASON_STOP_STRING;
  } else if (eos || stop_id) {
    finish = v1::FINISH_REASON_STOP_TOKEN;
  } else if (generated_ >= params_.max_tokens) {
    finish = v1::FINISH_REASON_LENGTH;
  }
  if (finish != v1::FINISH_REASON_UNSPECIFIED && !stopped) {
    // The end: what the detokenizer held back may still complete a stop string; the rest of the
    // held text turned out not to be one.
    if (detokenizer_) text += filter_.Add(detokenizer_->Finish(), &stopped);
    if (stopped) {
      finish = v1::FINISH_REASON_STOP_STRING;
    } else {
      text += filter_.Flush();
    }
  }
  response->add_token_ids(id);
  response->set_text(std::move(text));
  if (finish != v1::FINISH_REASON_UNSPECIFIED) {
    response->set_finish_reason(finish);
    response->mutable_usage()->set_prompt_tokens(static_cast<int32_t>(params_.prompt.size()));
    response->mutable_usage()->set_completion_tokens(static_cast<int32_t>(generated_));
  }
  return finish != v1::FINISH_REASON_UNSPECIFIED;
}

}  // namespace shardserve
