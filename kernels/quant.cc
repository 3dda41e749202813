#include "kernels/quant.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace shardserve {

const char* WeightQuantName(WeightQuant q) {
  switch (q) {
    case WeightQuant::kNone: return "none";
    case WeightQuant::kInt8: return "int8";
  }
  return "?";
}

absl::StatusOr<WeightQuant> ParseWeightQuant(absl::string_view name) {
  for (WeightQuant q : {WeightQuant::kNone, WeightQuant::kInt8}) {
    if (name == WeightQuantName(q)) return q;
  }
  return absl::InvalidArgumentError(absl::StrCat("quantization must be none or int8, got '", name, "'"));
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

}  // namespace shardserve
