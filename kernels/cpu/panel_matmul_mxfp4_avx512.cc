// The MXFP4 panels' product (panel_matmul.h PanelMatMulMxfp4) on 16-float tiles, for CPUs with
// AVX-512F: one zmm per panel per row, as the one-byte panels' (panel_matmul_bytes_avx512.cc). A
// panel step's 16 bytes are widened once to 32-bit lanes (VPMOVZXBD) and give two inputs' 16 values:
// VPERMPS of the 16-entry table on the lanes (it reads their low 4 bits: the low nibble), then on
// the lanes shifted right by 4 (the high one). Each value times its block's scale (the 16 E8M0
// bytes of the panel's block made float32 once a block: the byte shifted to float32's exponent
// field, 2^-127 for byte 0), exact, then one fused multiply-add per input.
//
// This file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mfma (kernels/CMakeLists.txt);
// PanelMatMulMxfp4 calls it only on CPUs that have them.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include <vector>

#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/panel_matmul_avx512.h"
#include "kernels/cpu/tile_rows.h"
#include "kernels/cpu/tile_store_avx512.h"
#include "kernels/quant.h"

namespace shardserve::cpu {
namespace {

// Rows per tile at most, and panels per tile: 8 rows x 2 panels (16 sums, with the 2 tables' worth
// of decoded values, 2 scales and the table in 32 registers), 1-3 rows x 4 panels for decode steps
// (4 to 12 chains: one panel's 1 would wait on the FMA latency).
constexpr int kRows = 8;
constexpr int PanelsPerTile(int64_t rows) { return rows <= 3 ? 4 : 2; }

// From this many rows a product dequantizes each group of panels once and runs the float32 panels'
// tiles (below): bench_matmul (one thread, a shared VM) had the decoding tiles faster at 4 rows (1.14
// against 1.30 ms at 2880 x 2880; the bench stage's products 1.6 against 2.1) and slower at 16 (3.9
// against 3.4).
constexpr int64_t kDequantizeRows = 8;

// 16 E8M0 bytes as 2^(e - 127) in float32, exactly.
[[gnu::always_inline]] inline __m512 Scales(const uint8_t* e) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e)));
  const __m512i bits = _mm512_slli_epi32(b, 23);
  const __mmask16 zero = _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512());
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(bits, zero, _mm512_set1_epi32(0x00400000)));  // 2^-127
}

template <int R, int P>
[[gnu::always_inline]] inline void Tile(float* y, int64_t ldy, const float* x, int64_t k, const uint8_t* codes,
                                        const uint8_t* scales, int64_t cols, const float* bias) {
  const __m512 table = _mm512_loadu_ps(kMxfp4Values);
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_ps();
  }
  const int64_t code_stride = k / 2 * kPanelCols, scale_stride = k / kMxfp4BlockSize * kPanelCols;
  for (int64_t g = 0; g < k / kMxfp4BlockSize; ++g) {
    __m512 s[P];
    for (int q = 0; q < P; ++q) s[q] = Scales(scales + q * scale_stride + g * kPanelCols);
    for (int64_t j = g * (kMxfp4BlockSize / 2); j < (g + 1) * (kMxfp4BlockSize / 2); ++j) {
      __m512i b[P];
      for (int q = 0; q < P; ++q) {
        const uint8_t* at = codes + q * code_stride + j * kPanelCols;
        if ((j & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(at) + 1024, _MM_HINT_T0);
        b[q] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
      }
      for (int half = 0; half < 2; ++half) {
        __m512 w[P];
        for (int q = 0; q < P; ++q) {
          w[q] = _mm512_mul_ps(_mm512_permutexvar_ps(half == 0 ? b[q] : _mm512_srli_epi32(b[q], 4), table), s[q]);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 xr = _mm512_set1_ps(x[r * k + 2 * j + half]);
          for (int q = 0; q < P; ++q) acc[r][q] = _mm512_fmadd_ps(w[q], xr, acc[r][q]);
        }
      }
    }
  }
  StoreTileSums<R, P>(y, ldy, cols, bias, [&](int r, int q) { return acc[r][q]; });
}

// `have` adjacent panels' weights as the float32 panels PackPanels makes of the dequantized weights
// (panel q's [k][16] floats at out + q k 16): each code's value times its block's scale, exact.
void DequantizePanels(float* out, const uint8_t* codes, const uint8_t* scales, int64_t k, int64_t have) {
  const __m512 table = _mm512_loadu_ps(kMxfp4Values);
  const int64_t code_stride = k / 2 * kPanelCols, scale_stride = k / kMxfp4BlockSize * kPanelCols;
  for (int64_t q = 0; q < have; ++q) {
    float* to = out + q * k * kPanelCols;
    for (int64_t g = 0; g < k / kMxfp4BlockSize; ++g) {
      const __m512 s = Scales(scales + q * scale_stride + g * kPanelCols);
      for (int64_t j = g * (kMxfp4BlockSize / 2); j < (g + 1) * (kMxfp4BlockSize / 2); ++j) {
        const __m512i b = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + q * code_stride + j * kPanelCols)));
        _mm512_storeu_ps(to + 2 * j * kPanelCols, _mm512_mul_ps(_mm512_permutexvar_ps(b, table), s));
        _mm512_storeu_ps(to + (2 * j + 1) * kPanelCols,
                         _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), s));
      }
    }
  }
}

}  // namespace

void PanelMatMulMxfp4Avx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w,
                            const float* bias, int threads) {
  const int64_t panels = (m + kPanelCols - 1) / kPanelCols;
  const int64_t code_stride = k / 2 * kPanelCols, scale_stride = k / kMxfp4BlockSize * kPanelCols;
  const uint8_t* scale_base = w + panels * code_stride;
  // Threads take groups of panels as they come free, never k: the thread count cannot change a sum.
  if (n >= kDequantizeRows) {
    // A prefill: each group of panels dequantized once into the thread's float32 panels and
    // multiplied by the float32 panels' AVX-512 tiles (panel_matmul_avx512.h: the same chains), so
    // that each weight is decoded once, not once per tile of rows.
    const int64_t wide = WidePanelsPerGroup(n), wide_groups = (panels + wide - 1) / wide;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t grp = 0; grp < wide_groups; ++grp) {
      thread_local std::vector<float> panel;  // each thread's, grown once to the widest group
      if (panel.size() < static_cast<size_t>(wide * k * kPanelCols)) panel.resize(static_cast<size_t>(wide * k * kPanelCols));
      const int64_t p = grp * wide, have = std::min(wide, panels - p), c0 = p * kPanelCols;
      DequantizePanels(panel.data(), w + p * code_stride, scale_base + p * scale_stride, k, have);
      PanelGroupAvx512(y + c0, m, x, n, k, panel.data(), have, std::min(have * kPanelCols, m - c0),
                       bias != nullptr ? bias + c0 : nullptr, nullptr, 0);
    }
    return;
  }
  const int64_t per = PanelsPerTile(n), groups = (panels + per - 1) / per;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t grp = 0; grp < groups; ++grp) {
    const int64_t p = grp * per, have = std::min(per, panels - p), c0 = p * kPanelCols;
    const int64_t cols = std::min(have * kPanelCols, m - c0);
    const uint8_t* codes = w + p * code_stride;
    const uint8_t* scales = scale_base + p * scale_stride;
    const float* b = bias != nullptr ? bias + c0 : nullptr;
    WithBalancedTiles<kRows>(n, [&](int64_t r, auto R) __attribute__((always_inline)) {
      WithTileRows<4>(have, [&](auto Q) __attribute__((always_inline)) {
        if constexpr (Q() <= PanelsPerTile(R())) {
          Tile<R(), Q()>(y + r * m + c0, m, x + r * k, k, codes, scales, cols, b);
        }
      });
    });
  }
}

}  // namespace shardserve::cpu
