#include "kernels/cpu/activation_rows.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace shardserve::cpu {

void QuantizeActivationRows(ActivationRows* out, const float* x, int64_t n, int64_t k, int64_t block) {
  out->block = block;
  out->blocks = (k + block - 1) / block;
  const int64_t width = out->blocks * block;
  out->values.assign(static_cast<size_t>(n * width), 0);
  out->block_sum.assign(static_cast<size_t>(n * out->blocks), 0);
  out->sum.assign(static_cast<size_t>(n), 0);
  out->scale.assign(static_cast<size_t>(n), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * k;
    float amax = 0;
    bool finite = true;
    for (int64_t c = 0; c < k; ++c) {
      finite = finite && std::isfinite(row[c]);
      amax = std::max(amax, std::fabs(row[c]));
    }
    if (!finite) {
      out->scale[i] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (amax == 0) continue;
    const float s = amax / 127.0f;
    out->scale[i] = s;
    int8_t* v = out->values.data() + i * width;
    int32_t* bsum = out->block_sum.data() + i * out->blocks;
    for (int64_t c = 0; c < k; ++c) {
      v[c] = static_cast<int8_t>(std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(row[c] / s))));
      bsum[c / block] += v[c];
    }
    for (int64_t b = 0; b < out->blocks; ++b) out->sum[i] += bsum[b];
  }
}

}  // namespace shardserve::cpu
