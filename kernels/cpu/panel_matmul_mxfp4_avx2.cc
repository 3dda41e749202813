// The MXFP4 panels' 8-float tiles (panel_matmul_mxfp4_tiles.h) with AVX2 intrinsics: a step's 16
// bytes widened to 32-bit lanes (VPMOVZXBD), each nibble's 3 magnitude bits looked up in an 8-entry
// table (VPERMPS reads the low 3 bits of each lane) and its sign bit moved to float32's, exactly
// kMxfp4Values; one fused multiply-add per input. This file alone is compiled with -mavx2 -mfma
// (kernels/CMakeLists.txt); PanelMatMulMxfp4 runs it where the CPU's instance is AVX2's.
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/panel_matmul_mxfp4_tiles.h"

namespace shardserve::cpu {
namespace {

struct Mxfp4Avx2 {
  // The codes in lanes' low 4 bits (higher bits ignored) as their values.
  [[gnu::always_inline]] static inline __m256 Values(__m256i codes) {
    const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f), codes);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
  }
  [[gnu::always_inline]] static inline void Decode(const uint8_t* p, Vec8 even[2], Vec8 odd[2]) {
    for (int h = 0; h < 2; ++h) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + h * kVecLanes)));
      even[h] = reinterpret_cast<Vec8>(Values(b));
      odd[h] = reinterpret_cast<Vec8>(Values(_mm256_srli_epi32(b, 4)));
    }
  }
  [[gnu::always_inline]] static inline Vec8 Fma(const Vec8& w, float x, const Vec8& acc) {
    return reinterpret_cast<Vec8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(w), _mm256_set1_ps(x),
                                                  reinterpret_cast<__m256>(acc)));
  }
};

}  // namespace

void PanelMatMulMxfp4Avx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w,
                          const float* bias, int threads) {
  Mxfp4Product<Mxfp4Avx2>(y, x, n, m, k, w, bias, threads);
}

}  // namespace shardserve::cpu
