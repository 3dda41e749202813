// activation_rows.h's per-row work in AVX2, 8 values a step (16 a store), for the AVX2 integer
// products (QuantIsa::kAvx2Int8): the AVX-512 file's operations value by value (max |x|, x / scale
// clamped to [-127, 127], converted to nearest even), so the same values. This file alone is
// compiled with -mavx2 -mfma (kernels/CMakeLists.txt).
#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "kernels/cpu/activation_rows.h"

namespace shardserve::cpu {
namespace {

// The first `live` floats at p (all 8 when live >= 8), the rest 0.
__m256 LoadLive(const float* p, int64_t live) {
  if (live >= 8) return _mm256_loadu_ps(p);
  const __m256i mask =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(live)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(p, mask);
}

}  // namespace

float RowAbsMaxAvx2(const float* row, int64_t k) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 amax = _mm256_setzero_ps();
  int bad = 0;
  for (int64_t c = 0; c < k; c += 8) {
    const __m256 a = _mm256_and_ps(LoadLive(row + c, k - c), abs_mask);
    bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // |x| not < Inf: Inf or NaN
    amax = _mm256_max_ps(amax, a);
  }
  if (bad != 0) return std::numeric_limits<float>::quiet_NaN();
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  return *std::max_element(lanes, lanes + 8);
}

void RowValuesAvx2(const float* row, int64_t k, float s, int64_t block, int8_t* v, int32_t* bsum) {
  const __m256 sv = _mm256_set1_ps(s);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int64_t b = 0; b * block < k; ++b) {
    __m256i part = _mm256_setzero_si256();
    // 16 values a step (two conversions packed to 16 bytes). A block is a multiple of 16 values and
    // the row is padded to whole blocks, so a step past k writes only padding, with zeros.
    for (int64_t c = b * block; c < std::min(k, (b + 1) * block); c += 16) {
      const __m256 x0 = LoadLive(row + c, k - c);
      const __m256 x1 = k - c > 8 ? LoadLive(row + c + 8, k - c - 8) : _mm256_setzero_ps();
      // Round to nearest even; the masked-off lanes are 0.
      const __m256i q0 = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_div_ps(x0, sv))));
      const __m256i q1 = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_div_ps(x1, sv))));
      part = _mm256_add_epi32(part, _mm256_add_epi32(q0, q1));
      // int32 -> int16 -> int8 (exact: every value is in [-127, 127]); packs works per 128-bit half,
      // the permute puts q0's halves before q1's.
      const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(v + c),
                       _mm_packs_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1)));
    }
    alignas(32) int32_t sums[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), part);
    bsum[b] = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
  }
}

}  // namespace shardserve::cpu
