// PanelGroupAvx512 (panel_matmul_avx512.h): this file alone is compiled with -mavx512f -mfma
// (kernels/CMakeLists.txt); panel_matmul.cc calls it only where PanelTilesSupported(PanelTiles::kAvx512).
#include "kernels/cpu/panel_matmul_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/tile_rows.h"
#include "kernels/cpu/tile_store_avx512.h"

namespace shardserve::cpu {
namespace {

// y [R, cols] (row stride ldy) = x [R, k] (row stride k) @ P adjacent panels [k, 16] (+ bias
// [cols]): R x P accumulators, each one chain over k in order, as panel_matmul.cc's tiles' (the
// FMA's product b * x rounded once with the sum: theirs, contracted by GCC, is the same
// instruction). With kPrefetch, every `every` k steps the tile asks the cache for one line (16
// floats) of each of the `ahead_panels` panels at `ahead` (stride k x 16), then the next ones.
template <int R, int P, bool kPrefetch>
[[gnu::always_inline]] inline void WideTile(float* y, int64_t ldy, const float* x, int64_t k, const float* panel,
                                            int64_t cols, const float* bias, const float* ahead, int64_t ahead_panels,
                                            int64_t every) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_ps();
  }
  const int64_t stride = k * kPanelCols;
  int64_t countdown = every;
  for (int64_t kk = 0; kk < k; ++kk) {
    if constexpr (kPrefetch) {
      if (--countdown == 0) {
        countdown = every;
        for (int64_t q = 0; q < ahead_panels; ++q) _mm_prefetch(reinterpret_cast<const char*>(ahead + q * stride), _MM_HINT_T0);
        ahead += kPanelCols;
      }
    }
    __m512 b[P];
    for (int q = 0; q < P; ++q) b[q] = _mm512_loadu_ps(panel + q * stride + kk * kPanelCols);
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * k + kk]);
      for (int q = 0; q < P; ++q) acc[r][q] = _mm512_fmadd_ps(b[q], xr, acc[r][q]);
    }
  }
  StoreTileSums<R, P>(y, ldy, cols, bias, [&](int r, int q) { return acc[r][q]; });
}

// PanelGroupAvx512 with P, the panels per group, known at compile time.
template <int P>
void Group(float* y, int64_t ldy, const float* x, int64_t n, int64_t k, const float* panel, int64_t have,
           int64_t cols, const float* bias, const float* next, int64_t next_have) {
  const int64_t tiles = BalancedTiles(n, kWideTileRows);
  const int64_t share = k / tiles * kPanelCols;  // each tile asks for k / tiles lines of each next panel
  const float* ahead = next;                     // the tile's share of them
  WithBalancedTiles<kWideTileRows>(n, [&](int64_t r, auto R) __attribute__((always_inline)) {
    if constexpr (R() * P <= 2 * kWideTileRows) {
      WithTileRows<P>(have, [&](auto Q) __attribute__((always_inline)) {
        if (next != nullptr) {
          WideTile<R(), Q(), true>(y + r * ldy, ldy, x + r * k, k, panel, cols, bias, ahead, next_have, tiles);
        } else {
          WideTile<R(), Q(), false>(y + r * ldy, ldy, x + r * k, k, panel, cols, bias, nullptr, 0, 1);
        }
      });
    }
    if (next != nullptr) ahead += share;
  });
}

// Floats ahead of each row's block that the plain tiles ask the cache for.
constexpr int64_t kPlainAhead = 128;

// The 16 x 16 block w[j0 + j][kk + i] (i, j < 16; rows j >= `rows` read as zeros), transposed:
// col[i] = w[j0 .. j0 + 15][kk + i]. Four rounds of 16 shuffles: pairs of rows interleaved, then
// pairs of pairs (column c's four rows of each quad in lane c / 4, element c % 4), then the 128-bit
// lanes gathered twice.
[[gnu::always_inline]] inline void Transpose16x16(__m512 col[16], const float* w, int64_t k, int64_t kk, int rows) {
  __m512 a[16], b[16];
  for (int j = 0; j < 16; ++j) {
    if (j < rows) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + kk + kPlainAhead), _MM_HINT_T0);
    a[j] = j < rows ? _mm512_loadu_ps(w + j * k + kk) : _mm512_setzero_ps();
  }
  for (int j = 0; j < 16; j += 2) {
    b[j] = _mm512_unpacklo_ps(a[j], a[j + 1]);
    b[j + 1] = _mm512_unpackhi_ps(a[j], a[j + 1]);
  }
  // quad q (rows 4q .. 4q + 3), element e of each lane: a[4q + e]
  for (int q = 0; q < 4; ++q) {
    const __m512d lo0 = _mm512_castps_pd(b[4 * q]), hi0 = _mm512_castps_pd(b[4 * q + 1]);
    const __m512d lo1 = _mm512_castps_pd(b[4 * q + 2]), hi1 = _mm512_castps_pd(b[4 * q + 3]);
    a[4 * q + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo0, lo1));
    a[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo0, lo1));
    a[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi0, hi1));
    a[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi0, hi1));
  }
  for (int e = 0; e < 4; ++e) {
    // rows 0-7: lanes 0, 2 (columns e, 8 + e) and 1, 3 (4 + e, 12 + e); then rows 8-15
    const __m512 even_lo = _mm512_shuffle_f32x4(a[e], a[4 + e], 0x88), odd_lo = _mm512_shuffle_f32x4(a[e], a[4 + e], 0xdd);
    const __m512 even_hi = _mm512_shuffle_f32x4(a[8 + e], a[12 + e], 0x88);
    const __m512 odd_hi = _mm512_shuffle_f32x4(a[8 + e], a[12 + e], 0xdd);
    col[e] = _mm512_shuffle_f32x4(even_lo, even_hi, 0x88);
    col[8 + e] = _mm512_shuffle_f32x4(even_lo, even_hi, 0xdd);
    col[4 + e] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88);
    col[12 + e] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xdd);
  }
}

// y [R, cols] (row stride ldy) = x [R, k] (row stride k) @ w [cols, k]^T (+ bias), cols <= 16 P
// rows of a plain (row-major) w at `w`, P panels' worth read straight from it: blocks of 16 x 16
// transposed in registers, then the same FMA chains as a packed panel's tiles (k in order); the
// last k % 16 inputs column by column (a gather each).
template <int R, int P>
[[gnu::always_inline]] inline void PlainTile(float* y, int64_t ldy, const float* x, int64_t k, const float* w,
                                             int64_t cols, const float* bias) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_ps();
  }
  int rows[P];
  for (int q = 0; q < P; ++q) rows[q] = static_cast<int>(std::clamp<int64_t>(cols - q * kPanelCols, 0, kPanelCols));
  int64_t kk = 0;
  for (; kk + kPanelCols <= k; kk += kPanelCols) {
    for (int q = 0; q < P; ++q) {
      __m512 col[16];
      Transpose16x16(col, w + q * kPanelCols * k, k, kk, rows[q]);
      for (int i = 0; i < 16; ++i) {
        for (int r = 0; r < R; ++r) acc[r][q] = _mm512_fmadd_ps(col[i], _mm512_set1_ps(x[r * k + kk + i]), acc[r][q]);
      }
    }
  }
  if (kk < k) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i at = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(k)));
    for (; kk < k; ++kk) {
      for (int q = 0; q < P; ++q) {
        const __mmask16 mask = FirstLanes(rows[q]);
        const __m512 c = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, at, w + q * kPanelCols * k + kk, 4);
        for (int r = 0; r < R; ++r) acc[r][q] = _mm512_fmadd_ps(c, _mm512_set1_ps(x[r * k + kk]), acc[r][q]);
      }
    }
  }
  StoreTileSums<R, P>(y, ldy, cols, bias, [&](int r, int q) { return acc[r][q]; });
}

}  // namespace

void PlainPanelsAvx512(float* y, int64_t ldy, const float* x, int64_t n, int64_t k, const float* w, int64_t cols,
                       const float* bias) {
  const int64_t have = (cols + kPanelCols - 1) / kPanelCols;
  WithTileRows<kPlainTileRows>(n, [&](auto R) __attribute__((always_inline)) {
    WithTileRows<kPlainPanels>(have, [&](auto Q) __attribute__((always_inline)) {
      PlainTile<R(), Q()>(y, ldy, x, k, w, cols, bias);
    });
  });
}

void PanelGroupAvx512(float* y, int64_t ldy, const float* x, int64_t n, int64_t k, const float* panel, int64_t have,
                      int64_t cols, const float* bias, const float* next, int64_t next_have) {
  switch (WidePanelsPerGroup(n)) {
    case 4: Group<4>(y, ldy, x, n, k, panel, have, cols, bias, next, next_have); break;
    case 3: Group<3>(y, ldy, x, n, k, panel, have, cols, bias, next, next_have); break;
    default: Group<2>(y, ldy, x, n, k, panel, have, cols, bias, next, next_have); break;
  }
}

}  // namespace shardserve::cpu
