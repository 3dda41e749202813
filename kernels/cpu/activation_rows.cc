// QuantizeActivationRows (activation_rows.h) in AVX-512, 16 values a step. This file is compiled
// with the VNNI files' flags (kernels/CMakeLists.txt): only the AVX-512 VNNI instances call it, on
// CPUs that have them. Each value is round(x / scale) to nearest even (the conversion's default
// rounding, as std::nearbyint's), so the values equal a scalar loop's.
#include "kernels/cpu/activation_rows.h"

#include <immintrin.h>

#include <algorithm>
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
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * k;
    // max |x|, and whether any |x| is Inf or NaN (not < Inf).
    __m512 amax_v = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t c = 0; c < k; c += 16) {
      const __mmask16 live = k - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - c)) - 1);
      const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(live, row + c));
      bad |= _mm512_mask_cmp_ps_mask(live, a, inf, _CMP_NLT_UQ);
      amax_v = _mm512_max_ps(amax_v, a);
    }
    if (bad != 0) {
      out->scale[i] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float amax = _mm512_reduce_max_ps(amax_v);
    if (amax == 0) continue;
    const float s = amax / 127.0f;
    out->scale[i] = s;
    const __m512 sv = _mm512_set1_ps(s);
    int8_t* v = out->values.data() + i * width;
    int32_t* bsum = out->block_sum.data() + i * out->blocks;
    int32_t total = 0;
    for (int64_t b = 0; b < out->blocks; ++b) {
      __m512i part = _mm512_setzero_si512();
      for (int64_t c = b * block; c < std::min(k, (b + 1) * block); c += 16) {
        const __mmask16 live = k - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - c)) - 1);
        const __m512 q = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_div_ps(_mm512_maskz_loadu_ps(live, row + c), sv)));
        const __m512i qi = _mm512_cvtps_epi32(q);  // round to nearest even; the masked-off lanes are 0
        part = _mm512_add_epi32(part, qi);
        _mm_mask_storeu_epi8(v + c, live, _mm512_cvtepi32_epi8(qi));
      }
      bsum[b] = _mm512_reduce_add_epi32(part);
      total += bsum[b];
    }
    out->sum[i] = total;
  }
}

}  // namespace shardserve::cpu
