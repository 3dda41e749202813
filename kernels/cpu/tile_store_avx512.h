// How the AVX-512 tiles of the panel products (float32, int8 / fp8, int4 on float32 and on int16
// activations, mxfp4) store their finished sums: a masked store of each row's 16 columns a panel,
// the bias added only where there is one. Included only by files compiled with AVX-512F
// (kernels/CMakeLists.txt); internal to them, as tile_rows.h.
//
// Thread-safety: none needed (stores on the calling thread).
#ifndef SHARDSERVE_KERNELS_CPU_TILE_STORE_AVX512_H_
#define SHARDSERVE_KERNELS_CPU_TILE_STORE_AVX512_H_

#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/panel_matmul.h"

namespace shardserve::cpu {
namespace {

static_assert(kPanelCols == 16, "one panel row is one zmm");

// The first n of 16 float lanes (all 16 from n = 16 on; none for n <= 0).
[[gnu::always_inline]] inline __mmask16 FirstLanes(int64_t n) {
  return n >= 16 ? __mmask16{0xffff} : n <= 0 ? __mmask16{0} : static_cast<__mmask16>((1u << n) - 1);
}

// y [R, cols] (row stride ldy) = sum(r, q) (+ bias [cols]), sum(r, q) the __m512 of row r at panel
// q's 16 columns [16 q, 16 q + 16), of which the first cols are kept (cols <= 16 P); the panels
// past cols are neither read nor stored. With no bias each sum is stored as it is (adding +0.0 would
// turn a -0.0 sum into +0.0).
template <int R, int P, class Sum>
[[gnu::always_inline]] inline void StoreTileSums(float* y, int64_t ldy, int64_t cols, const float* bias,
                                                 const Sum& sum) {
  for (int q = 0; q < P; ++q) {
    const int64_t c0 = q * kPanelCols;
    if (c0 >= cols) break;
    const __mmask16 mask = FirstLanes(cols - c0);
    const __m512 add = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 total = sum(r, q);
      _mm512_mask_storeu_ps(y + r * ldy + c0, mask, bias != nullptr ? _mm512_add_ps(total, add) : total);
    }
  }
}

}  // namespace
}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_TILE_STORE_AVX512_H_
