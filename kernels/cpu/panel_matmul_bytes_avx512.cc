// The one-byte panels' products (panel_matmul.h's PanelMatMulInt8 and PanelMatMulFp8) on CPUs with
// AVX-512F: the CPU backend's exact int8 and fp8 products there (quant_isa.h IntOnPanels,
// Fp8OnPanels). As the float32 panels' AVX-512 tiles (panel_matmul_avx512.cc), each zmm holds one
// panel's 16 outputs and each FMA broadcasts one input, so that a panel's 16 codes, widened once in
// registers (int8: VPMOVSXBD, VCVTDQ2PS; e4m3: its bits moved into float32's; exact), serve every
// row of a tile: a prefill's tile of 14 rows x 2 panels runs 28 FMAs per 2 widened vectors. (The
// rows' tiles they replaced, int8_matmul_avx512.cc, a dot product over k per output, needed a full
// input vector for every weight vector and reached 0.79x (int8) and 0.68x (fp8) the float32
// panels' rate at 128 rows on a Zen 5 EPYC: bench_matmul.)
// Each output is the chain the float32 panels (and for int8 the AVX2 instance,
// panel_matmul_avx2.cc) compute, one fused multiply-add per input in order from zero, then
// fma(chain, scale, bias) (or chain x scale): bitwise their results (tests/kernels_cpu_test.cc).
//
// This file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mfma (kernels/CMakeLists.txt);
// PanelMatMulInt8 / PanelMatMulFp8 call it only on CPUs that have them.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/panel_matmul_avx512.h"
#include "kernels/cpu/tile_rows.h"
#include "kernels/cpu/tile_store_avx512.h"

namespace shardserve::cpu {
namespace {

// The tiles' shapes are the float32 AVX-512 tiles' (panel_matmul_avx512.h): up to kWideTileRows
// rows (14 rows x 2 panels: 28 sums and the 2 widened vectors in 32 registers), WidePanelsPerGroup
// panels at once (4 at 1-6 rows: at one row 4, 6 and 8 panels measured alike on Zen 5, within the
// runs' noise, about 2.0-2.1 ms for the bench model's products on 2 threads).

// Each panel's stream is asked for the line this many bytes past the one a tile reads (an input
// step is 16 bytes of a panel: a new line every 4 steps). Zen 5, one row: none 2.2 ms, 512 B 2.1-2.4,
// 1 KiB 2.0-2.3, 1.5 KiB 1.9-2.2, 2-4 KiB 2.2-2.3 (noisy, 2 threads).
constexpr int64_t kPrefetchBytes = 1024;

// 16 bytes of a panel (one input step) as 16 floats, exactly: int8 codes, or e4m3 bytes (sign-
// extended, the sign to bit 31 and the other 7 bits to float32's exponent-and-mantissa bits 26-20,
// times 2^120 for e4m3's bias of 7; subnormals included).
template <bool kFp8>
[[gnu::always_inline]] inline __m512 Widen(const uint8_t* p) {
  const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (kFp8) {
    const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(s, 20), _mm512_set1_epi32(static_cast<int>(0x87F00000u)));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
  } else {
    return _mm512_cvtepi32_ps(s);
  }
}

// y [R, cols] (row stride ldy) = x [R, k] (row stride k) @ (P adjacent one-byte panels [k, 16], the
// first at `panel`, their values times scale [cols]) (+ bias [cols]); cols <= 16 P.
// With input-group scales (group > 0: fp8 only) `scale` is the first panel's [G, 16] scales
// (PackPanelScales), the next panels' G x 16 floats apart: each widened vector is multiplied by its
// group's 16 scales (read from L1 by the multiply itself, no register held) before its FMAs, so that
// the chains take DequantizeFp8Groups' weights bit for bit, and the finished sums are not scaled:
// y = chain (+ bias), PanelMatMul's result for those weights.
template <bool kFp8, int R, int P, bool kGroups = false>
[[gnu::always_inline]] inline void Tile(float* y, int64_t ldy, const float* x, int64_t k, const uint8_t* panel,
                                        int64_t cols, const float* scale, const float* bias, int64_t group = 0) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_ps();
  }
  const int64_t stride = k * kPanelCols;
  const int64_t scale_stride = kGroups ? (k + group - 1) / group * kPanelCols : 0;  // floats between panels' scales
  const float* group_scale = scale;  // the current group's 16 scales of the first panel
  int64_t left = group;              // inputs left in the current group
  for (int64_t kk = 0; kk < k; ++kk) {
    const uint8_t* at = panel + kk * kPanelCols;
    if ((kk & 3) == 0) {
      for (int q = 0; q < P; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(at + q * stride) + kPrefetchBytes, _MM_HINT_T0);
      }
    }
    if constexpr (kGroups) {
      if (left == 0) {
        group_scale += kPanelCols;
        left = group;
      }
      --left;
    }
    __m512 b[P];
    for (int q = 0; q < P; ++q) {
      b[q] = Widen<kFp8>(at + q * stride);
      if constexpr (kGroups) b[q] = _mm512_mul_ps(b[q], _mm512_loadu_ps(group_scale + q * scale_stride));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * k + kk]);
      for (int q = 0; q < P; ++q) acc[r][q] = _mm512_fmadd_ps(b[q], xr, acc[r][q]);
    }
  }
  if constexpr (kGroups) {
    StoreTileSums<R, P>(y, ldy, cols, bias, [&](int r, int q) { return acc[r][q]; });
  } else {
    for (int q = 0; q < P; ++q) {
      const int64_t c0 = q * kPanelCols;
      if (c0 >= cols) break;
      const __mmask16 mask = FirstLanes(cols - c0);
      const __m512 add = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
      const __m512 s = _mm512_maskz_loadu_ps(mask, scale + c0);
      for (int r = 0; r < R; ++r) {
        // One rounding with the bias, as std::fma (the AVX2 instance's); with none, the product alone.
        const __m512 v = bias != nullptr ? _mm512_fmadd_ps(acc[r][q], s, add) : _mm512_mul_ps(acc[r][q], s);
        _mm512_mask_storeu_ps(y + r * ldy + c0, mask, v);
      }
    }
  }
}

// Every row of y (row stride m) at panels [p, p + have) (have <= P), the rows in balanced tiles.
template <bool kFp8, int P, bool kGroups>
void Group(float* y, int64_t m, const float* x, int64_t n, int64_t k, const uint8_t* w, const float* scale,
           int64_t group, const float* bias, int64_t p, int64_t have) {
  const int64_t c0 = p * kPanelCols, cols = std::min(have * kPanelCols, m - c0);
  const uint8_t* panel = w + p * k * kPanelCols;
  const float* bc = bias != nullptr ? bias + c0 : nullptr;
  // Per row: the panels' columns; with groups: panel p's [G, 16] scales.
  const float* sc = kGroups ? scale + p * ((k + group - 1) / group) * kPanelCols : scale + c0;
  WithBalancedTiles<kWideTileRows>(n, [&](int64_t r, auto R) __attribute__((always_inline)) {
    // (Every tile of a product has at least the registers of its longest: the same P serves.)
    if constexpr (R() * P + P <= 30) {
      WithTileRows<P>(have, [&](auto Q) __attribute__((always_inline)) {
        Tile<kFp8, R(), Q(), kGroups>(y + r * m + c0, m, x + r * k, k, panel, cols, sc, bc, group);
      });
    }
  });
}

// Every group of `per` panels, threads taking them as they come free, never k: the thread count
// cannot change a sum.
template <bool kFp8, bool kGroups = false>
void Groups(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w, const float* scale,
            int64_t group, const float* bias, int threads) {
  const int64_t panels = (m + kPanelCols - 1) / kPanelCols;
  const int64_t per = WidePanelsPerGroup(n);
  const int64_t groups = (panels + per - 1) / per;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p = g * per, have = std::min(per, panels - p);
    switch (per) {
      case 4: Group<kFp8, 4, kGroups>(y, m, x, n, k, w, scale, group, bias, p, have); break;
      case 3: Group<kFp8, 3, kGroups>(y, m, x, n, k, w, scale, group, bias, p, have); break;
      default: Group<kFp8, 2, kGroups>(y, m, x, n, k, w, scale, group, bias, p, have); break;
    }
  }
}

}  // namespace

void PanelMatMulBytesAvx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w,
                            const float* scale, int64_t group, const float* bias, int threads, bool fp8) {
  if (fp8 && group > 0) {
    Groups<true, true>(y, x, n, m, k, w, scale, group, bias, threads);
  } else if (fp8) {
    Groups<true>(y, x, n, m, k, w, scale, 0, bias, threads);
  } else {
    Groups<false>(y, x, n, m, k, w, scale, 0, bias, threads);
  }
}

}  // namespace shardserve::cpu
