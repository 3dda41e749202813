#include "worker/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "kernels/sampling.h"
#include "model/sampling_bounds.h"
#include "worker/step_checks.h"

namespace shardserve {
namespace {

using RowList = google::protobuf::RepeatedPtrField<v1::RowSampling>;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Below this temperature a row is greedy, as in vLLM (_SAMPLING_EPS): the result is the argmax
// anyway (but for exact ties), and logits / T could overflow to +inf, which Backend::Sample
// rejects, failing the worker for a request's parameter.
constexpr float kGreedyBelow = 1e-5f;
// Penalized logits are kept within +-1e30, so that a tiny repetition_penalty cannot overflow them
// either (1e30 / kGreedyBelow is still finite).
constexpr float kMaxPenalizedLogit = 1e30f;

bool IsGreedy(const v1::RowSampling& r) { return r.temperature() < kGreedyBelow; }

bool RepetitionOn(const v1::RowSampling& r) { return r.repetition_penalty() != 0 && r.repetition_penalty() != 1; }

// Whether a penalty changes any logit of the row (a penalty with no ids to act on is a no-op, so
// such a row can stay on the device).
bool PenaltyActive(const v1::RowSampling& r) {
  const bool repetition = RepetitionOn(r) && (r.penalty_prompt_ids_size() > 0 || r.penalty_output_ids_size() > 0);
  const bool presence_frequency =
      (r.presence_penalty() != 0 || r.frequency_penalty() != 0) && r.penalty_output_ids_size() > 0;
  return repetition || presence_frequency;
}

// Whether the row's EOS and stop ids are still banned (fewer than min_tokens tokens so far).
bool MinTokensActive(const v1::RowSampling& r) {
  return r.min_tokens_banned_ids_size() > 0 && r.draw_index() < static_cast<uint64_t>(std::max(0, r.min_tokens()));
}

// The draw of a sampled row, as Backend::Sample takes it (top_p 0 means no limit, as 1 does).
SampleParams ParamsOf(const v1::RowSampling& r) {
  return SampleParams{r.temperature(), r.top_k(), r.top_p() == 0 ? 1.0f : r.top_p(),
                      SampleUniform(r.seed(), r.draw_index())};
}

// `s` with the step and the rows [begin, end) it concerns in front.
absl::Status ForRows(uint64_t step_id, int begin, int end, const absl::Status& s) {
  const std::string rows = end == begin + 1 ? absl::StrCat("row ", begin) : absl::StrCat("rows ", begin, "-", end - 1);
  return absl::Status(s.code(), absl::StrCat("step ", step_id, " ", rows, ": ", s.message()));
}

// Constrained decoding: every id of `row` ([v]) whose bit in `mask` is clear becomes -inf.
void ApplyTokenMask(const uint32_t* mask, int64_t v, float* row) {
  for (int64_t i = 0; i < v; ++i) {
    if (((mask[i >> 5] >> (i & 31)) & 1u) == 0) row[i] = -kInf;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Sampler>> Sampler::Create(Backend* device, int64_t max_rows, int64_t vocab_size) {
  if (device == nullptr || max_rows < 1 || vocab_size < 1 || vocab_size > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("Sampler: want a backend, max_rows >= 1 and a vocabulary of 1 to ",
                                                   std::numeric_limits<int32_t>::max(), " ids; got max_rows ",
                                                   max_rows, ", vocab_size ", vocab_size));
  }
  std::unique_ptr<Sampler> s(new Sampler());
  s->device_ = device;
  s->max_rows_ = max_rows;
  s->vocab_size_ = vocab_size;
  if (device->device_kind() == DeviceKind::kCpu) {
    s->host_ = device;  // its memory is host memory: host rows are read in place
  } else {
    s->owned_host_ = MakeCpuBackend();
    s->host_ = s->owned_host_.get();
    s->raw_.resize(vocab_size);
  }
  absl::StatusOr<Buffer> ids = device->Allocate(max_rows * sizeof(int32_t));
  if (!ids.ok()) return ids.status();
  s->ids_dev_ = std::move(*ids);
  s->ids_host_.resize(max_rows);
  s->host_ids_.resize(max_rows);
  s->paths_.resize(max_rows);
  s->finite_.resize(max_rows);
  s->run_params_.reserve(max_rows);
  s->one_params_.resize(1);
  s->work_.assign(vocab_size, 0.0f);
  s->output_counts_.assign(vocab_size, 0);
  s->penalized_.assign(vocab_size, 0);
  s->banned_.reserve(kMaxBadWordSequences);
  // The CPU backend's Sample sizes its own scratch to the vocabulary on first use: do that now,
  // so that the first step does not allocate.
  Tensor out(s->host_ids_.data(), DType::kI32, {1});
  const Tensor row(s->work_.data(), DType::kF32, {1, vocab_size});
  SHARDSERVE_RETURN_IF_ERROR(s->host_->Sample(&out, row, s->one_params_));
  return s;
}

absl::Status Sampler::Sample(uint64_t step_id, const Tensor& logits, const RowList& rows, v1::StepResult* result,
                             const std::vector<const uint32_t*>& masks) {
  const int m = rows.size();
  if (logits.dtype != DType::kF32 || logits.ndim != 2 || logits.dim(0) != m || logits.dim(1) != vocab_size_ ||
      m > max_rows_) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": sampling ", m, " rows (at most ", max_rows_,
                                                   ") needs F32 logits [", m, ", ", vocab_size_, "]; got ",
                                                   DTypeName(logits.dtype), " ", logits.ShapeString()));
  }
  SHARDSERVE_RETURN_IF_ERROR(CheckRowSampling(step_id, rows, vocab_size_));
  if (!masks.empty() && static_cast<int>(masks.size()) != m) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": ", masks.size(), " token masks for ", m, " rows"));
  }
  const auto mask_of = [&masks](int i) -> const uint32_t* { return masks.empty() ? nullptr : masks[i]; };

  // Rows whose logits are not all finite (the model overflowed for that sequence) are reported, not
  // sampled: one pass over the logits on the device, m flags back.
  Tensor finite(finite_.data(), DType::kI32, {m});
  if (absl::Status s = device_->FiniteRows(&finite, logits); !s.ok()) return ForRows(step_id, 0, m, s);

  bool any_logprobs = false;
  for (int i = 0; i < m; ++i) {
    const v1::RowSampling& r = rows[i];
    const bool greedy = IsGreedy(r);
    // A non-finite row is only reported. min_p cannot change an argmax, so greedy rows ignore it.
    if (finite_[i] == 0) {
      paths_[i] = Path::kNonFinite;
    } else if (r.logprobs() || PenaltyActive(r) || (!greedy && r.min_p() > 0) || r.logit_bias_ids_size() > 0 ||
               MinTokensActive(r) || mask_of(i) != nullptr || r.has_scored_id() || r.allowed_ids_size() > 0 ||
               r.bad_word_lengths_size() > 0) {
      paths_[i] = Path::kHost;
    } else {
      paths_[i] = greedy ? Path::kArgmax : Path::kSample;
    }
    any_logprobs |= r.logprobs();
  }

  // Device rows first, one call per run of consecutive rows of one path (on CUDA they are queued
  // on the stream; the first host row's copy waits for them).
  bool any_device = false;
  for (int begin = 0; begin < m;) {
    int end = begin + 1;
    while (end < m && paths_[end] == paths_[begin]) ++end;
    if (paths_[begin] == Path::kArgmax || paths_[begin] == Path::kSample) {
      if (absl::Status s = RunOnDevice(paths_[begin], logits, rows, begin, end); !s.ok()) return ForRows(step_id, begin, end, s);
      any_device = true;
    }
    begin = end;
  }

  // Host rows.
  result->clear_logprobs();
  if (any_logprobs) {
    for (int i = 0; i < m; ++i) result->add_logprobs();  // reuses cleared entries
  }
  const float* first = static_cast<const float*>(logits.data);
  for (int i = 0; i < m; ++i) {
    if (paths_[i] != Path::kHost) continue;
    v1::RowLogprobs* lp = rows[i].logprobs() ? result->mutable_logprobs(i) : nullptr;
    if (absl::Status s = SampleOnHost(step_id, i, first + static_cast<int64_t>(i) * vocab_size_, rows[i],
                                      mask_of(i), &host_ids_[i], lp);
        !s.ok()) {
      return s;
    }
  }

  if (any_device) {
    if (absl::Status s = device_->CopyToHost(ids_host_.data(), ids_dev_.data(), m * sizeof(int32_t)); !s.ok()) {
      return s;
    }
  }
  result->clear_sampled_ids();
  result->mutable_sampled_ids()->Reserve(m);
  result->clear_non_finite_rows();
  for (int i = 0; i < m; ++i) {
    switch (paths_[i]) {
      case Path::kArgmax:
      case Path::kSample: result->add_sampled_ids(ids_host_[i]); break;
      case Path::kHost: result->add_sampled_ids(host_ids_[i]); break;
      case Path::kNonFinite:
        result->add_sampled_ids(0);
        result->add_non_finite_rows(i);
        break;
    }
  }
  return absl::OkStatus();
}

absl::Status Sampler::RunOnDevice(Path path, const Tensor& logits, const RowList& rows, int begin, int end) {
  Tensor out(static_cast<int32_t*>(ids_dev_.data()) + begin, DType::kI32, {end - begin});
  const Tensor in = logits.Rows(begin, end);
  if (path == Path::kArgmax) return device_->Argmax(&out, in);
  run_params_.clear();  // within the capacity reserved at Create
  for (int i = begin; i < end; ++i) run_params_.push_back(ParamsOf(rows[i]));
  return device_->Sample(&out, in, run_params_);
}

absl::Status Sampler::SampleOnHost(uint64_t step_id, int row_index, const float* device_row, const v1::RowSampling& r,
                                   const uint32_t* mask, int32_t* id, v1::RowLogprobs* lp) {
  const int64_t v = vocab_size_;
  const bool greedy = IsGreedy(r);
  const bool penalize = PenaltyActive(r);
  const bool min_p = !greedy && r.min_p() > 0;
  const bool biased = r.logit_bias_ids_size() > 0;
  const bool min_tokens = MinTokensActive(r);
  const bool restricted = r.allowed_ids_size() > 0 || r.bad_word_lengths_size() > 0;

  // The raw row on the host.
  const float* raw = device_row;
  if (host_ != device_) {
    SHARDSERVE_RETURN_IF_ERROR(device_->CopyToHost(raw_.data(), device_row, v * sizeof(float)));
    raw = raw_.data();
  }

  // (a) Logprobs of the raw logits: log p_i = x_i - (max + log sum_j exp(x_j - max)), the sum in
  // double. The top ones are kept in a short sorted list while scanning in id order: a later id
  // enters only when strictly more likely, so ties keep the lower id first.
  double log_normalizer = 0;
  if (lp != nullptr) {
    float max = -kInf;
    bool finite = true;
    for (int64_t i = 0; i < v && finite; ++i) {
      finite = !std::isnan(raw[i]) && raw[i] != kInf;
      max = std::max(max, raw[i]);
    }
    if (!finite || max == -kInf) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step_id, " row ", row_index,
                                                     ": logits hold a NaN or +inf, or are all -inf; no logprobs"));
    }
    double sum = 0;
    for (int64_t i = 0; i < v; ++i) sum += std::exp(static_cast<double>(raw[i]) - max);
    log_normalizer = max + std::log(sum);

    const int n = std::min<int64_t>(r.top_logprobs(), v);
    int32_t top[kMaxTopLogprobs];
    int count = 0;
    for (int64_t i = 0; i < v && n > 0; ++i) {
      if (count == n && !(raw[i] > raw[top[count - 1]])) continue;
      int pos = count == n ? n - 1 : count++;
      for (; pos > 0 && raw[i] > raw[top[pos - 1]]; --pos) top[pos] = top[pos - 1];
      top[pos] = static_cast<int32_t>(i);
    }
    for (int k = 0; k < count; ++k) {
      lp->add_top_ids(top[k]);
      lp->add_top_logprobs(static_cast<float>(raw[top[k]] - log_normalizer));
    }
  }

  // A scored prompt position draws nothing: its token is the prompt's next one.
  if (r.has_scored_id()) {
    *id = r.scored_id();
    SetChosen(raw, *id, log_normalizer, lp);
    return absl::OkStatus();
  }

  // The row the choice is made on: the raw one, or a copy to penalize and mask.
  const float* row = raw;
  if (penalize || min_p || biased || min_tokens || mask != nullptr || restricted) {
    std::memcpy(work_.data(), raw, v * sizeof(float));
    row = work_.data();
  }
  if (mask != nullptr) ApplyTokenMask(mask, v, work_.data());
  if (restricted) ApplyAllowedAndBadWords(r, work_.data());

  // (b) logit_bias, added to the raw logits (kept finite: a logit of -inf stays -inf); then the ids
  // banned before min_tokens.
  if (biased) {
    float* w = work_.data();
    for (int j = 0; j < r.logit_bias_ids_size(); ++j) {
      const int32_t t = r.logit_bias_ids(j);
      if (w[t] != -kInf) w[t] = std::clamp(w[t] + r.logit_bias_values(j), -kMaxPenalizedLogit, kMaxPenalizedLogit);
    }
  }
  if (min_tokens) {
    for (int32_t t : r.min_tokens_banned_ids()) work_[t] = -kInf;
  }

  // (c) Penalties, in vLLM's order and float32 arithmetic: repetition (once per distinct id of the
  // prompt and the output), then frequency (per occurrence in the output), then presence.
  if (penalize) {
    float* w = work_.data();
    const auto& prompt = r.penalty_prompt_ids();
    const auto& output = r.penalty_output_ids();
    if (RepetitionOn(r)) {
      const float rp = r.repetition_penalty();
      for (const auto* ids : {&prompt, &output}) {
        for (int32_t t : *ids) {
          if (penalized_[t]) continue;
          penalized_[t] = 1;
          w[t] = std::clamp(w[t] > 0 ? w[t] / rp : w[t] * rp, -kMaxPenalizedLogit, kMaxPenalizedLogit);
        }
      }
      for (const auto* ids : {&prompt, &output}) {
        for (int32_t t : *ids) penalized_[t] = 0;
      }
    }
    const float frequency = r.frequency_penalty(), presence = r.presence_penalty();
    if (frequency != 0 || presence != 0) {
      for (int32_t t : output) ++output_counts_[t];
      for (int32_t t : output) {
        if (output_counts_[t] == 0) continue;  // done at its first occurrence
        w[t] -= frequency * static_cast<float>(output_counts_[t]);
        w[t] -= presence;
        output_counts_[t] = 0;
      }
    }
  }

  // (d) min_p (vLLM v1: after temperature, before top-k/top-p): p_i < min_p * p_max, i.e.
  // (x_i - max) / T < log(min_p), in double so that a small T cannot overflow.
  if (min_p) {
    float* w = work_.data();
    float max = -kInf;
    for (int64_t i = 0; i < v; ++i) max = std::max(max, w[i]);
    const double t = r.temperature(), log_min_p = std::log(static_cast<double>(r.min_p()));
    for (int64_t i = 0; i < v; ++i) {
      if ((static_cast<double>(w[i]) - max) / t < log_min_p) w[i] = -kInf;
    }
  }

  // The choice, by the CPU backend's own Argmax / Sample (the device path's rule).
  Tensor out(id, DType::kI32, {1});
  const Tensor in(const_cast<float*>(row), DType::kF32, {1, v});  // read only
  absl::Status s;
  if (greedy) {
    s = host_->Argmax(&out, in);
  } else {
    one_params_[0] = ParamsOf(r);
    s = host_->Sample(&out, in, one_params_);
  }
  if (!s.ok()) return ForRows(step_id, row_index, row_index + 1, s);

  // (e) The chosen token's logprob and rank.
  if (lp != nullptr) SetChosen(raw, *id, log_normalizer, lp);
  return absl::OkStatus();
}

void Sampler::ApplyAllowedAndBadWords(const v1::RowSampling& r, float* w) {
  const int64_t v = vocab_size_;
  // allowed_ids: the others -inf (flags in output_counts_, zero between rows).
  if (r.allowed_ids_size() > 0) {
    for (int32_t t : r.allowed_ids()) output_counts_[t] = 1;
    for (int64_t i = 0; i < v; ++i) {
      if (output_counts_[i] == 0) w[i] = -kInf;
    }
    for (int32_t t : r.allowed_ids()) output_counts_[t] = 0;
  }
  // Bad words: the last id of each whose other ids end the output so far.
  const auto& output = r.penalty_output_ids();
  banned_.clear();
  for (int j = 0, at = 0; j < r.bad_word_lengths_size(); at += r.bad_word_lengths(j), ++j) {
    const int prefix = r.bad_word_lengths(j) - 1;
    if (prefix > output.size()) continue;
    if (std::equal(r.bad_word_ids().begin() + at, r.bad_word_ids().begin() + at + prefix, output.end() - prefix)) {
      banned_.push_back(r.bad_word_ids(at + prefix));
    }
  }
  if (banned_.empty()) return;
  // They yield where they would leave no token to choose.
  int64_t finite = 0;
  for (int64_t i = 0; i < v; ++i) finite += w[i] != -kInf ? 1 : 0;
  std::sort(banned_.begin(), banned_.end());
  banned_.erase(std::unique(banned_.begin(), banned_.end()), banned_.end());
  for (int32_t t : banned_) finite -= w[t] != -kInf ? 1 : 0;
  if (finite == 0) return;
  for (int32_t t : banned_) w[t] = -kInf;
}

void Sampler::SetChosen(const float* raw, int32_t id, double log_normalizer, v1::RowLogprobs* lp) const {
  int64_t above = 0;
  for (int64_t i = 0; i < vocab_size_; ++i) above += raw[i] > raw[id] ? 1 : 0;
  lp->set_logprob(static_cast<float>(raw[id] - log_normalizer));
  lp->set_rank(static_cast<int32_t>(above + 1));
}

}  // namespace shardserve
