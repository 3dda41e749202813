// activation_rows.h's per-row work in AVX-512, 16 values a step. This file is compiled with the VNNI
// files' flags (kernels/CMakeLists.txt): only the AVX-512 VNNI instances' rows come here, on CPUs
// that have them. Each value is round(x / scale) to nearest even (the conversion's default
// rounding, as std::nearbyint's), so the values equal a scalar loop's.
#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "kernels/cpu/activation_rows.h"

namespace shardserve::cpu {

float RowAbsMaxAvx512(const float* row, int64_t k) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 amax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t c = 0; c < k; c += 16) {
    const __mmask16 live = k - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - c)) - 1);
    const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(live, row + c));
    bad |= _mm512_mask_cmp_ps_mask(live, a, inf, _CMP_NLT_UQ);  // |x| not < Inf: Inf or NaN
    amax = _mm512_max_ps(amax, a);
  }
  return bad != 0 ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(amax);
}

void RowValuesAvx512(const float* row, int64_t k, float s, int64_t block, int8_t* v, int32_t* bsum) {
  const __m512 sv = _mm512_set1_ps(s);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t b = 0; b * block < k; ++b) {
    __m512i part = _mm512_setzero_si512();
    for (int64_t c = b * block; c < std::min(k, (b + 1) * block); c += 16) {
      const __mmask16 live = k - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - c)) - 1);
      const __m512 q = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_div_ps(_mm512_maskz_loadu_ps(live, row + c), sv)));
      const __m512i qi = _mm512_cvtps_epi32(q);  // round to nearest even; the masked-off lanes are 0
      part = _mm512_add_epi32(part, qi);
      _mm_mask_storeu_epi8(v + c, live, _mm512_cvtepi32_epi8(qi));
    }
    bsum[b] = _mm512_reduce_add_epi32(part);
  }
}

}  // namespace shardserve::cpu
