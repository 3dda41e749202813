// PanelGroupAvx512 (panel_matmul_avx512.h): this file alone is compiled with -mavx512f -mfma
// (kernels/CMakeLists.txt); panel_matmul.cc calls it only where PanelTilesAvx512Supported().
#include "kernels/cpu/panel_matmul_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/tile_rows.h"

namespace shardserve::cpu {
namespace {

static_assert(kPanelCols == 16, "one panel row is one zmm");

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
  for (int q = 0; q < P; ++q) {
    const int64_t c0 = q * kPanelCols, n = std::min(kPanelCols, cols - c0);
    const __mmask16 mask = n >= kPanelCols ? __mmask16{0xffff} : static_cast<__mmask16>((1u << n) - 1);
    const __m512 add = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      // With no bias the sum is stored as it is (adding +0.0 would turn a -0.0 sum into +0.0).
      const __m512 v = bias != nullptr ? _mm512_add_ps(acc[r][q], add) : acc[r][q];
      _mm512_mask_storeu_ps(y + r * ldy + c0, mask, v);
    }
  }
}

// PanelGroupAvx512 with P, the panels per group, known at compile time.
template <int P>
void Group(float* y, int64_t ldy, const float* x, int64_t n, int64_t k, const float* panel, int64_t have,
           int64_t cols, const float* bias, const float* next, int64_t next_have) {
  const int64_t tiles = WideRowTiles(n), base = n / tiles, longer = n % tiles;  // the first `longer` take base + 1
  const int64_t share = k / tiles * kPanelCols;  // each tile asks for k / tiles lines of each next panel
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = base + (t < longer ? 1 : 0);
    float* yt = y + r * ldy;
    const float* xt = x + r * k;
    const float* ahead = next != nullptr ? next + t * share : nullptr;
    WithTileRows<kWideTileRows>(rows, [&](auto R) __attribute__((always_inline)) {
      if constexpr (R() * P <= 2 * kWideTileRows) {
        WithTileRows<P>(have, [&](auto Q) __attribute__((always_inline)) {
          if (next != nullptr) {
            WideTile<R(), Q(), true>(yt, ldy, xt, k, panel, cols, bias, ahead, next_have, tiles);
          } else {
            WideTile<R(), Q(), false>(yt, ldy, xt, k, panel, cols, bias, nullptr, 0, 1);
          }
        });
      }
    });
    r += rows;
  }
}

}  // namespace

void PanelGroupAvx512(float* y, int64_t ldy, const float* x, int64_t n, int64_t k, const float* panel, int64_t have,
                      int64_t cols, const float* bias, const float* next, int64_t next_have) {
  switch (WidePanelsPerGroup(n)) {
    case 4: Group<4>(y, ldy, x, n, k, panel, have, cols, bias, next, next_have); break;
    case 3: Group<3>(y, ldy, x, n, k, panel, have, cols, bias, next, next_have); break;
    default: Group<2>(y, ldy, x, n, k, panel, have, cols, bias, next, next_have); break;
  }
}

}  // namespace shardserve::cpu
