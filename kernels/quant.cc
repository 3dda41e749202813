#include "kernels/quant.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace shardserve {

const char* WeightQuantName(WeightQuant q) {
  switch (q) {
    case WeightQuant::kNone: return "none";
    case WeightQuant::kInt8: return "int8";
    case WeightQuant::kInt4: return "int4";
  }
  return "?";
}

absl::StatusOr<WeightQuant> ParseWeightQuant(absl::string_view name) {
  for (WeightQuant q : {WeightQuant::kNone, WeightQuant::kInt8, WeightQuant::kInt4}) {
    if (name == WeightQuantName(q)) return q;
  }
  return absl::InvalidArgumentError(absl::StrCat("quantization must be none, int8 or int4, got '", name, "'"));
}

absl::Status QuantizeInt8Rows(float* scale, int8_t* q, const float* w, int64_t m, int64_t k) {
  for (int64_t i = 0; i < m * k; ++i) {
    if (!std::isfinite(w[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("int8 quantization: weight [", i / k, ", ", i % k, "] is ", w[i], ", not a finite number"));
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    const float* row = w + r * k;
    float max_abs = 0;
    for (int64_t c = 0; c < k; ++c) max_abs = std::fmax(max_abs, std::fabs(row[c]));
    scale[r] = max_abs / 127.0f;
    int8_t* out = q + r * k;
    for (int64_t c = 0; c < k; ++c) {
      // |row[c] / scale| <= 127 up to rounding of the division: clamp it there.
      const float v = scale[r] == 0 ? 0.0f : std::round(row[c] / scale[r]);
      out[c] = static_cast<int8_t>(std::fmax(-127.0f, std::fmin(127.0f, v)));
    }
  }
  return absl::OkStatus();
}

void DequantizeInt8Rows(float* w, const float* scale, const int8_t* q, int64_t m, int64_t k) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < k; ++c) w[r * k + c] = static_cast<float>(q[r * k + c]) * scale[r];
  }
}

absl::Status QuantizeInt4Groups(Int4Group128* blocks, const float* w, int64_t m, int64_t k) {
  for (int64_t i = 0; i < m * k; ++i) {
    if (!std::isfinite(w[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("int4 quantization: weight [", i / k, ", ", i % k, "] is ", w[i], ", not a finite number"));
    }
  }
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  constexpr int64_t kHalf = kInt4GroupSize / 2;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = w + r * k + g * kInt4GroupSize;
      const int64_t size = std::min(kInt4GroupSize, k - g * kInt4GroupSize);  // the last group may be short
      Int4Group128& b = blocks[r * groups + g];
      b = Int4Group128{};
      float lo = 0, hi = 0;  // the range, widened to hold 0
      for (int64_t j = 0; j < size; ++j) {
        lo = std::fmin(lo, v[j]);
        hi = std::fmax(hi, v[j]);
      }
      // hi - lo may overflow to inf for weights near float's limits: divide each first.
      const float scale = hi / 15.0f - lo / 15.0f;
      if (!(scale > 0)) continue;  // an all-zero group (or one too small to scale): q = 0, s = 0
      b.scale = scale;
      b.zero = static_cast<uint8_t>(std::fmin(15.0f, std::fmax(0.0f, std::round(-lo / scale))));
      for (int64_t j = 0; j < size; ++j) {
        const float q = std::fmin(15.0f, std::fmax(0.0f, std::round(v[j] / scale) + b.zero));
        const auto nibble = static_cast<uint8_t>(q);
        b.q[j % kHalf] |= static_cast<uint8_t>(j < kHalf ? nibble : nibble << 4);
      }
    }
  }
  return absl::OkStatus();
}

void DequantizeInt4Groups(float* w, const Int4Group128* blocks, int64_t m, int64_t k) {
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  constexpr int64_t kHalf = kInt4GroupSize / 2;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const Int4Group128& b = blocks[r * groups + g];
      const int64_t size = std::min(kInt4GroupSize, k - g * kInt4GroupSize);
      for (int64_t j = 0; j < size; ++j) {
        const int q = j < kHalf ? (b.q[j] & 15) : (b.q[j - kHalf] >> 4);
        w[r * k + g * kInt4GroupSize + j] = static_cast<float>(q - b.zero) * b.scale;
      }
    }
  }
}

}  // namespace shardserve
