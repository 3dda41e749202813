// How the CPU's AVX-512 VNNI products (int8_matmul_vnni.cc, int4_matmul_vnni.cc) walk their
// outputs: column ranges per OpenMP thread as column_tiles.h's (whole 8-row tiles, so that every
// output is computed by the same code whatever the thread count), and within a range, tiles of
// up to 4 weight rows x 4 input rows (16 sums; each weight row's bytes loaded and prepared once per
// 4 input rows), or of 8 weight rows x 1 input row when the product has a single input row (a
// decode step: 8 independent sums). A tile's shape is a template argument of the kernel:
// ForEachVnniTile hands it as std::integral_constant values (tile_rows.h's WithTileRows).
//
// Thread-safety: ForEachVnniTile runs `tile` on up to `threads` OpenMP threads at once, on disjoint
// outputs.
#ifndef SHARDSERVE_KERNELS_CPU_VNNI_TILES_H_
#define SHARDSERVE_KERNELS_CPU_VNNI_TILES_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu/column_tiles.h"
#include "kernels/cpu/tile_rows.h"

namespace shardserve::cpu {
namespace {  // internal linkage, as column_tiles.h

inline constexpr int kVnniMaxInputs = 4;      // input rows per tile
inline constexpr int kVnniRowsWithInputs = 4;  // weight rows per tile of 2 or more input rows
inline constexpr int kVnniRowsAlone = 8;       // weight rows per tile of one input row
inline constexpr int kVnniRangeRows = 8;       // column ranges per thread in whole multiples of this

// tile(R, I, i, r) for every tile of the product y [n, m]: input rows [i, i + I), weight rows
// [r, r + R), R and I std::integral_constant values.
template <class Tile>
inline void ForEachVnniTile(int64_t n, int64_t m, int threads, const Tile& tile) {
  ForEachColumnRange(m, kVnniRangeRows, threads, [&](int64_t r0, int64_t r1) {
    const int64_t tile_rows = n == 1 ? kVnniRowsAlone : kVnniRowsWithInputs;
    for (int64_t r = r0; r < r1; r += tile_rows) {
      const int64_t rows = std::min(tile_rows, r1 - r);
      if (n == 1) {
        WithTileRows<kVnniRowsAlone>(rows, [&](auto R) __attribute__((always_inline)) {
          tile(R, std::integral_constant<int, 1>{}, int64_t{0}, r);
        });
        continue;
      }
      for (int64_t i = 0; i < n; i += kVnniMaxInputs) {
        WithTileRows<kVnniRowsWithInputs>(rows, [&](auto R) __attribute__((always_inline)) {
          WithTileRows<kVnniMaxInputs>(std::min<int64_t>(kVnniMaxInputs, n - i), [&](auto I)
                                           __attribute__((always_inline)) { tile(R, I, i, r); });
        });
      }
    }
  });
}

}  // namespace
}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_VNNI_TILES_H_
