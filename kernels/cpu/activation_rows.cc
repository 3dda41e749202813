// QuantizeActivationRows (activation_rows.h): the rows' bookkeeping once, the per-row vector work in
// each instruction set's file (activation_rows_avx512.cc, activation_rows_avx2.cc). Baseline x86-64.
#include "kernels/cpu/activation_rows.h"

#include <cmath>
#include <limits>

namespace shardserve::cpu {

void QuantizeActivationRows(ActivationRows* out, const float* x, int64_t n, int64_t k, int64_t block, QuantIsa isa) {
  const bool avx512 = isa == QuantIsa::kAvx512Vnni;
  out->block = block;
  out->blocks = (k + block - 1) / block;
  const int64_t width = out->blocks * block;
  out->values.assign(static_cast<size_t>(n * width), 0);
  out->block_sum.assign(static_cast<size_t>(n * out->blocks), 0);
  out->sum.assign(static_cast<size_t>(n), 0);
  out->scale.assign(static_cast<size_t>(n), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * k;
    const float amax = avx512 ? RowAbsMaxAvx512(row, k) : RowAbsMaxAvx2(row, k);
    if (std::isnan(amax)) {  // a NaN or an Inf in the row
      out->scale[i] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (amax == 0) continue;
    const float s = amax / 127.0f;
    out->scale[i] = s;
    int32_t* bsum = out->block_sum.data() + i * out->blocks;
    (avx512 ? RowValuesAvx512 : RowValuesAvx2)(row, k, s, block, out->values.data() + i * width, bsum);
    int32_t total = 0;
    for (int64_t b = 0; b < out->blocks; ++b) total += bsum[b];
    out->sum[i] = total;
  }
}

}  // namespace shardserve::cpu
