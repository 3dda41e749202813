// The CPU backend's ops on logits: Softmax, Argmax and Sample (temperature, top-k, top-p), and
// SoftmaxRow, which Attention uses too.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"

namespace shardserve::cpu {

// Declared, with what it computes, in cpu_backend.h.
SHARDSERVE_VECTOR_CLONES double SoftmaxRow(float* out, const float* x, int64_t v, float temperature) {
  // The max, lane by lane (NaN entries never win, as with std::max), then across lanes.
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  Vec8 lane_max = Vec8{} + kNegInf;
  for (int64_t i = 0; i < v; i += kVecLanes) {
    const int64_t lanes = std::min(kVecLanes, v - i);
    const Vec8 xi = LoadVec(x + i, lanes) / temperature;
    StoreVec(out + i, xi, lanes);
    const Vec8 counted = KeepLanes(xi, lanes, kNegInf);
    lane_max = lane_max < counted ? counted : lane_max;
  }
  float max = kNegInf;
  for (int64_t j = 0; j < kVecLanes; ++j) max = std::max(max, lane_max[j]);
  // The normalizer in double: 16 partial sums (element i goes to partial i mod 16), as four
  // vectors of 4 doubles, added in order at the end.
  using Vec4d = double __attribute__((vector_size(32)));
  Vec4d sum0 = {}, sum1 = {}, sum2 = {}, sum3 = {};
  for (int64_t i = 0; i < v; i += 2 * kVecLanes) {
    const int64_t lanes = v - i;  // of the 16 from i, those in the row (the first `lanes`)
    const Vec8 lo = ExpVec(LoadVec(out + i, lanes) - max);
    const Vec8 hi = ExpVec(LoadVec(out + i + kVecLanes, lanes - kVecLanes) - max);
    StoreVec(out + i, lo, lanes);
    StoreVec(out + i + kVecLanes, hi, lanes - kVecLanes);
    const Vec8 lo_counted = KeepLanes(lo, lanes, 0.0f), hi_counted = KeepLanes(hi, lanes - kVecLanes, 0.0f);
    sum0 += __builtin_convertvector(__builtin_shufflevector(lo_counted, lo_counted, 0, 1, 2, 3), Vec4d);
    sum1 += __builtin_convertvector(__builtin_shufflevector(lo_counted, lo_counted, 4, 5, 6, 7), Vec4d);
    sum2 += __builtin_convertvector(__builtin_shufflevector(hi_counted, hi_counted, 0, 1, 2, 3), Vec4d);
    sum3 += __builtin_convertvector(__builtin_shufflevector(hi_counted, hi_counted, 4, 5, 6, 7), Vec4d);
  }
  double sum = 0.0;
  for (const Vec4d& part : {sum0, sum1, sum2, sum3}) {
    for (int j = 0; j < 4; ++j) sum += part[j];
  }
  const float inv_sum = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < v; ++i) out[i] *= inv_sum;
  return sum;
}

absl::Status CpuBackend::Softmax(Tensor* out, const Tensor& x, float temperature) {
  const ArgCheck check("Softmax", {{"out", out, kF32, 2}, {"x", &x, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  if (!SameShape(*out, x)) return check.Error("want out and x [n, v]");
  if (!(temperature > 0.0f) || !std::isfinite(temperature)) {
    return check.Error(absl::StrCat("temperature ", temperature, " must be finite and > 0"));
  }

  const int64_t n = x.dim(0), v = x.dim(1);
  for (int64_t r = 0; r < n; ++r) SoftmaxRow(out->as<float>() + r * v, x.as<float>() + r * v, v, temperature);
  return absl::OkStatus();
}

absl::Status CpuBackend::Argmax(Tensor* out, const Tensor& logits) {
  const ArgCheck check("Argmax", {{"out", out, kI32, 1}, {"logits", &logits, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t n = logits.dim(0), v = logits.dim(1);
  if (out->dim(0) != n || v == 0) return check.Error("want out [n], logits [n, v] with v > 0");
  if (v > std::numeric_limits<int32_t>::max()) return check.Error("v exceeds the int32 id range");

  for (int64_t r = 0; r < n; ++r) {
    const float* row = logits.as<float>() + r * v;
    // The first maximum, with NaN above everything, as torch.argmax.
    int64_t best = 0;
    for (int64_t i = 1; i < v; ++i) {
      if (row[i] > row[best] || (std::isnan(row[i]) && !std::isnan(row[best]))) best = i;
    }
    out->as<int32_t>()[r] = static_cast<int32_t>(best);
  }
  return absl::OkStatus();
}

namespace {

// Whether every one of the v floats at x is finite: exponent bits not all ones, tested on the bits
// so that no compiler option about NaN can fold it away; no early exit, so the loop vectorizes.
SHARDSERVE_VECTOR_CLONES bool RowFinite(const float* x, int64_t v) {
  uint32_t all_ones = 0;  // a lane's exponent bits, ORed into bit 0 when all ones
  for (int64_t i = 0; i < v; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    all_ones |= (bits & 0x7f800000u) == 0x7f800000u ? 1u : 0u;
  }
  return all_ones == 0;
}

}  // namespace

absl::Status CpuBackend::FiniteRows(Tensor* out, const Tensor& logits) {
  const ArgCheck check("FiniteRows", {{"out", out, kI32, 1}, {"logits", &logits, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t n = logits.dim(0), v = logits.dim(1);
  if (out->dim(0) != n || v == 0) return check.Error("want out [n], logits [n, v] with v > 0");
  for (int64_t r = 0; r < n; ++r) out->as<int32_t>()[r] = RowFinite(logits.as<float>() + r * v, v) ? 1 : 0;
  return absl::OkStatus();
}

absl::Status CpuBackend::Sample(Tensor* out, const Tensor& logits, const std::vector<SampleParams>& params) {
  const ArgCheck check("Sample", {{"out", out, kI32, 1}, {"logits", &logits, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t n = logits.dim(0), v = logits.dim(1);
  if (out->dim(0) != n || v == 0) return check.Error("want out [n], logits [n, v] with v > 0");
  if (v > std::numeric_limits<int32_t>::max()) return check.Error("v exceeds the int32 id range");
  if (params.size() != static_cast<size_t>(n)) {
    return check.Error(absl::StrCat(params.size(), " SampleParams for ", n, " rows"));
  }
  for (int64_t r = 0; r < n; ++r) {
    const SampleParams& p = params[r];
    if (!(p.temperature > 0.0f) || !std::isfinite(p.temperature) || p.top_k < 0 || !(p.top_p > 0.0f) ||
        !(p.top_p <= 1.0f) || !(p.uniform >= 0.0f) || !(p.uniform < 1.0f)) {
      return check.Error(absl::StrCat("row ", r, " has temperature ", p.temperature, ", top_k ", p.top_k, ", top_p ",
                                      p.top_p, ", uniform ", p.uniform, "; want temperature > 0, top_k >= 0, "
                                      "top_p in (0, 1], uniform in [0, 1)"));
    }
  }

  sample_probs_.resize(static_cast<size_t>(v));
  sample_sorted_.resize(static_cast<size_t>(v));
  float* probs = sample_probs_.data();
  float* sorted = sample_sorted_.data();
  for (int64_t r = 0; r < n; ++r) {
    const SampleParams& p = params[r];
    if (!std::isfinite(SoftmaxRow(probs, logits.as<float>() + r * v, v, p.temperature))) {
      return check.Error(absl::StrCat("row ", r, " of logits holds a NaN or +inf, or is all -inf"));
    }

    // Tokens with prob >= keep_from are kept. Start with all of them.
    float keep_from = 0.0f;
    // top_k: keep every token at least as likely as the k-th most likely, ties included.
    if (p.top_k > 0 && p.top_k < v) {
      std::copy(probs, probs + v, sorted);
      std::nth_element(sorted, sorted + (p.top_k - 1), sorted + v, std::greater<float>());
      keep_from = sorted[p.top_k - 1];
    }
    // top_p, over what top_k kept, renormalized (as transformers' TopPLogitsWarper after
    // TopKLogitsWarper, and vLLM): take tokens from the most likely down until their mass reaches
    // top_p; the last one taken sets the bar, so tokens tied with it stay too.
    if (p.top_p < 1.0f) {
      int64_t kept = 0;
      double kept_mass = 0.0;
      for (int64_t i = 0; i < v; ++i) {
        if (probs[i] >= keep_from) {
          sorted[kept++] = probs[i];
          kept_mass += probs[i];
        }
      }
      const double target = static_cast<double>(p.top_p) * kept_mass;
      // Only the most likely tokens matter, so sort just the top `count` (nth_element, then sort),
      // growing it 8x until it holds the target mass. LLM distributions are peaked, so this
      // usually ends in the first round rather than sorting the whole vocabulary.
      for (int64_t count = std::min<int64_t>(kept, 64);; count = std::min(kept, count * 8)) {
        std::nth_element(sorted, sorted + (count - 1), sorted + kept, std::greater<float>());
        std::sort(sorted, sorted + count, std::greater<float>());
        int64_t last = 0;  // index in `sorted` of the last token taken
        double mass = sorted[0];
        while (mass < target && last + 1 < count) mass += sorted[++last];
        if (mass >= target || count == kept) {  // when rounding leaves mass short: all are kept
          keep_from = sorted[last];
          break;
        }
      }
    }

    // Inverse CDF over the kept tokens in vocabulary order: the first whose cumulative mass
    // exceeds uniform * kept mass. Both sums add the same values in the same order, so the last
    // kept token's cumulative mass equals the kept mass, which exceeds uniform * kept mass for
    // uniform < 1; should rounding say otherwise, `chosen` is left at the last kept token.
    // Tokens of probability 0 are skipped (the most likely token always has prob > 0).
    double kept_mass = 0.0;
    for (int64_t i = 0; i < v; ++i) {
      if (probs[i] >= keep_from) kept_mass += probs[i];
    }
    const double target = static_cast<double>(p.uniform) * kept_mass;
    double mass = 0.0;
    int64_t chosen = -1;
    for (int64_t i = 0; i < v; ++i) {
      if (probs[i] < keep_from || probs[i] == 0.0f) continue;
      chosen = i;
      mass += probs[i];
      if (mass > target) break;
    }
    out->as<int32_t>()[r] = static_cast<int32_t>(chosen);
  }
  return absl::OkStatus();
}

}  // namespace shardserve::cpu
