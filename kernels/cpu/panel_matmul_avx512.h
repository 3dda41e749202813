// The float32 panels' AVX-512 tiles (panel_matmul.h's product from kWideMinRows rows on CPUs with
// AVX-512F): one 16-float zmm per panel per row, up to 14 rows x 2 panels (28 accumulators of 32
// zmm registers) at a time, where the 8-float tiles (panel_matmul.cc, cloned per instruction set)
// keep 6 rows x 2 half-panels. Each output is the same chain as theirs, one fused multiply-add per
// k in order from zero, the bias added to the finished sum: bitwise their results
// (tests/kernels_cpu_test.cc compares the two families).
//
// panel_matmul_avx512.cc alone is compiled with AVX-512 flags (kernels/CMakeLists.txt);
// panel_matmul.cc calls it only where PanelTilesSupported(PanelTiles::kAvx512).
//
// Thread-safety: PanelGroupAvx512 is reentrant and runs on the calling thread.
#ifndef SHARDSERVE_KERNELS_CPU_PANEL_MATMUL_AVX512_H_
#define SHARDSERVE_KERNELS_CPU_PANEL_MATMUL_AVX512_H_

#include <cstdint>

#include "kernels/cpu/tile_rows.h"

namespace shardserve::cpu {

// Rows per AVX-512 tile, at most: 14 rows x 2 panels = 28 accumulators, with the 2 panel vectors
// 30 of the 32 zmm registers (x is broadcast from memory by the FMA itself).
inline constexpr int64_t kWideTileRows = 14;

// Panels a tile takes at once for a product of n rows: as many as its rows' accumulators fit in
// 28 registers with the panels' own (6 rows x 4, 9 x 3, 14 x 2), so that short tiles still keep
// 16 or more chains going (Zen 5 issues two 16-lane FMAs a cycle, each 4 cycles long).
constexpr int64_t WidePanelsPerGroup(int64_t n) {
  const int64_t rows = LongestBalancedTile(n, kWideTileRows);
  return rows <= 6 ? 4 : rows <= 9 ? 3 : 2;
}

// y [n, cols] (row stride ldy) = x [n, k] (row stride k) @ `have` (1 <= have <=
// WidePanelsPerGroup(n)) adjacent panels [k, 16] (panel_matmul.h's layout, the first at `panel`;
// cols <= 16 have of their columns kept) (+ bias [cols]), in tile_rows.h's balanced tiles of at most
// kWideTileRows rows (15 rows are 8 + 7, not 14 + 1: every tile keeps many chains). With `next`
// (not null), the tiles also ask the cache for the `next_have` panels at `next`, shared out between
// them (the next group's, while this one computes). n, k >= 1.
void PanelGroupAvx512(float* y, int64_t ldy, const float* x, int64_t n, int64_t k, const float* panel, int64_t have,
                      int64_t cols, const float* bias, const float* next, int64_t next_have);

// Up to this many rows, a plain w's products (panel_matmul.h) run
// PlainPanelsAvx512, reading w itself, kPlainPanels panels' rows at a time: one panel's 16 rows
// (each asked for 128 floats ahead), as bench_matmul measured ("f32 plain w", AMD EPYC, shared
// machine, minima): 1 and 2 rows on one thread 2.04-2.14 ms against 2.59-3.17 for the 8-float
// tiles on a per-thread packed copy; 2 panels' 32 rows at a time, no prefetch, 2.85-3.39, slower;
// 16 rows with no prefetch 2.27-2.56 (bench_matmul).
inline constexpr int64_t kPlainTileRows = 3;
inline constexpr int64_t kPlainPanels = 1;

// y [n, cols] (row stride ldy) = x [n, k] (row stride k) @ w [cols, k]^T (+ bias [cols]): cols <=
// 16 kPlainPanels rows of a plain, row-major w (row stride k), multiplied as PackPanels would pack
// them (the same chains, bitwise), with no copy: 16 x 16 blocks transposed in registers. n <=
// kPlainTileRows; n, k >= 1.
void PlainPanelsAvx512(float* y, int64_t ldy, const float* x, int64_t n, int64_t k, const float* w, int64_t cols,
                       const float* bias);

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_PANEL_MATMUL_AVX512_H_
