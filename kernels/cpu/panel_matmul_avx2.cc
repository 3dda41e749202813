// The int8 panels' product (panel_matmul.h's PanelMatMulInt8) on 8-float tiles: the float32
// panels' (panel_tiles.h) on int8 panels widened with AVX2 intrinsics. This file alone is compiled
// with -mavx2 -mfma (kernels/CMakeLists.txt); PanelMatMulInt8 runs it for PanelTiles::kVec8 (the
// CPU backend: where its int8 instance is AVX2's, quant_isa.h IntOnPanels). (fp8 keeps its rows on
// AVX2 CPUs: quant_isa.h Fp8OnPanels.)
#include <immintrin.h>

#include <cmath>

#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/panel_tiles.h"

namespace shardserve::cpu {
namespace {

// An int8 panel's 16 values at one input, in column order: sign-extended (VPMOVSXBD) and
// converted (VCVTDQ2PS), 8 at a time; exact for every int8.
struct Int8PanelsAvx2 {
  using T = uint8_t;
  [[gnu::always_inline]] static inline void Load(const uint8_t* p, Vec8* lo, Vec8* hi) {
    const __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    *lo = reinterpret_cast<Vec8>(_mm256_cvtepi32_ps(a));
    *hi = reinterpret_cast<Vec8>(_mm256_cvtepi32_ps(b));
  }
};

}  // namespace

void PanelMatMulInt8Avx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w,
                         const float* scale, const float* bias, int threads) {
  PackedPanelsProduct<Int8PanelsAvx2>(y, x, n, m, k, w, nullptr, threads);
  // Each finished sum times its column's scale, plus the bias in the same rounding (one fused
  // multiply-add, spelled out so that no compiler's contraction choice changes a result).
  for (int64_t i = 0; i < n; ++i) {
    float* row = y + i * m;
    for (int64_t c = 0; c < m; ++c) row[c] = bias != nullptr ? std::fma(row[c], scale[c], bias[c]) : row[c] * scale[c];
  }
}

}  // namespace shardserve::cpu
