// A tile's row count, known at run time, turned into the compile-time one the CPU kernels' tiles
// take (so that their R x I sums stay in registers): one switch for the int8 / fp8 tiles
// (int8_matmul_tiles.h), the int4 ones (int4_matmul_tiles.h), the integer ones on int8 activations
// (act8_tiles.h) and the float32 panels (panel_matmul.cc, panel_matmul_avx512.cc). The tiles
// themselves differ.
//
// Thread-safety: none needed (calls `tile` on the calling thread).
#ifndef SHARDSERVE_KERNELS_CPU_TILE_ROWS_H_
#define SHARDSERVE_KERNELS_CPU_TILE_ROWS_H_

#include <cstdint>
#include <type_traits>

namespace shardserve::cpu {
// Internal linkage: each instruction set's file gets its own copy (as int8_matmul_tiles.h).
namespace {

// tile(std::integral_constant<int, rows>{}) for rows in [1, kMaxRows]; nothing for any other
// value. The callers pass a lambda marked `__attribute__((always_inline))` after its parameters
// (the GNU spelling: [[gnu::always_inline]] there would name the lambda's type and be ignored), so
// that each case compiles to the tile itself, as a hand-written switch over Tile<8> ... Tile<1>
// does, with no call in between.
template <int kMaxRows, class Tile>
[[gnu::always_inline]] inline void WithTileRows(int64_t rows, const Tile& tile) {
  static_assert(1 <= kMaxRows && kMaxRows <= 16, "tiles of 1 to 16 rows");
  switch (rows) {
    case 16: if constexpr (kMaxRows >= 16) tile(std::integral_constant<int, 16>{}); break;
    case 15: if constexpr (kMaxRows >= 15) tile(std::integral_constant<int, 15>{}); break;
    case 14: if constexpr (kMaxRows >= 14) tile(std::integral_constant<int, 14>{}); break;
    case 13: if constexpr (kMaxRows >= 13) tile(std::integral_constant<int, 13>{}); break;
    case 12: if constexpr (kMaxRows >= 12) tile(std::integral_constant<int, 12>{}); break;
    case 11: if constexpr (kMaxRows >= 11) tile(std::integral_constant<int, 11>{}); break;
    case 10: if constexpr (kMaxRows >= 10) tile(std::integral_constant<int, 10>{}); break;
    case 9: if constexpr (kMaxRows >= 9) tile(std::integral_constant<int, 9>{}); break;
    case 8: if constexpr (kMaxRows >= 8) tile(std::integral_constant<int, 8>{}); break;
    case 7: if constexpr (kMaxRows >= 7) tile(std::integral_constant<int, 7>{}); break;
    case 6: if constexpr (kMaxRows >= 6) tile(std::integral_constant<int, 6>{}); break;
    case 5: if constexpr (kMaxRows >= 5) tile(std::integral_constant<int, 5>{}); break;
    case 4: if constexpr (kMaxRows >= 4) tile(std::integral_constant<int, 4>{}); break;
    case 3: if constexpr (kMaxRows >= 3) tile(std::integral_constant<int, 3>{}); break;
    case 2: if constexpr (kMaxRows >= 2) tile(std::integral_constant<int, 2>{}); break;
    case 1: tile(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// The tiles WithBalancedTiles makes of n rows (n >= 1): the fewest of at most max_rows rows.
constexpr int64_t BalancedTiles(int64_t n, int64_t max_rows) { return (n + max_rows - 1) / max_rows; }

// Rows [0, n) in BalancedTiles(n, kMaxRows) tiles, their sizes differing by one at most (15 rows of
// at most 12: 8 + 7, not 12 + 3, so that every tile keeps many sums going), in order: tile(r, R)
// for each, r its first row, R its row count as WithTileRows passes it. (Every panel product's
// tiles: the float32 panels', panel_tiles.h and panel_matmul_avx512.cc, the one-byte panels',
// panel_matmul_bytes_avx512.cc, the int4 panels', panel_matmul_int4_avx512.cc and _avx2.cc.)
template <int kMaxRows, class Tile>
[[gnu::always_inline]] inline void WithBalancedTiles(int64_t n, const Tile& tile) {
  const int64_t tiles = BalancedTiles(n, kMaxRows), base = n / tiles, longer = n % tiles;
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = base + (t < longer ? 1 : 0);
    WithTileRows<kMaxRows>(rows, [&](auto R) __attribute__((always_inline)) { tile(r, R); });
    r += rows;
  }
}

// The rows of WithBalancedTiles' longest tile for n rows (n >= 1).
constexpr int64_t LongestBalancedTile(int64_t n, int64_t max_rows) {
  const int64_t tiles = BalancedTiles(n, max_rows);
  return (n + tiles - 1) / tiles;
}

}  // namespace
}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_TILE_ROWS_H_
