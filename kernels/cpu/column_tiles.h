// How the CPU's quantized products (int8_matmul.h, int4_matmul.h and their VNNI instances) split
// their work: output columns in whole tiles per OpenMP thread (so that every output is computed by
// the same tile code, whatever the thread count), and within a tile of up to 8 weight rows, input
// rows in pairs over 4 weight rows at a time (8 sums) and a last single input row over all of them
// (a decode step's case: 8 independent sums too). (The AVX-512 int8 / fp8 tiles take 4 input rows x 4
// weight rows from 4 input rows on: int8_matmul_tiles.h's QuadColumns.)
//
// Thread-safety: ForEachColumnRange runs `columns` on up to `threads` OpenMP threads at once, on
// disjoint ranges.
#ifndef SHARDSERVE_KERNELS_CPU_COLUMN_TILES_H_
#define SHARDSERVE_KERNELS_CPU_COLUMN_TILES_H_

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace shardserve::cpu {
// Internal linkage: each instruction set's file gets its own copy (as int8_matmul_tiles.h).
namespace {

// How far ahead, in weight rows, the quantized tiles ask for the weights they will read next
// (__builtin_prefetch of the same bytes kPrefetchRows rows on: a hint, which changes no result). A
// decode step's weight rows are short (the bench model's 768 inputs: 432 bytes in int4, 768 in
// int8), so a tile's 8 rows are 8 streams of a few cache lines each, too short for the hardware
// prefetcher to follow: at one input row the int4 VNNI product took 0.65 ms for the bench model's
// stage from L3 and 0.34 ms with its weights in L1. 32 rows (4 tiles of 8) ahead measured best of
// 8, 16, 32 and 64 (bench_matmul).
inline constexpr int64_t kPrefetchRows = 32;

// The row whose weights a tile at weight row `row` of [0, m) asks for: kPrefetchRows on, the last
// row near the end.
[[gnu::always_inline]] inline int64_t PrefetchRow(int64_t row, int64_t m) {
  return row + kPrefetchRows < m ? row + kPrefetchRows : m - 1;
}

// The 8-lane instances (AVX2 and baseline x86-64) ask for the bytes kPrefetchRows rows on in
// address order instead: a tile of R weight rows reads R rows (R streams, k apart) at once, and
// asking for the same R streams ahead left one thread of the AVX2 EPYC at 6 GB/s of int8 weights
// at one input row, while the same requests in address order, one cache line at a time as the tile
// advances (what a tile R rows further on reads, as one stream), gave 9-10 GB/s
// (bench_matmul on a Zen 3 EPYC, AVX2 only). The AVX-512 instances keep the
// per-row requests measured on their CPUs.
// Asks for the cache lines that start in [from, from + count) bytes past `ahead`: a tile calls it
// with the share of its region kPrefetchRows rows on that matches how far it has come.
[[gnu::always_inline]] inline void PrefetchInOrder(const uint8_t* ahead, int64_t from, int64_t count) {
  for (int64_t at = (from + 63) & ~int64_t{63}; at < from + count; at += 64) __builtin_prefetch(ahead + at, 0, 3);
}

// columns(r0, r1) for contiguous ranges covering [0, m), each a whole number of `tile_rows`-row
// tiles but the last, one range per thread (threads <= 0: OpenMP's default).
template <class Columns>
inline void ForEachColumnRange(int64_t m, int64_t tile_rows, int threads, const Columns& columns) {
  const int64_t tiles = (m + tile_rows - 1) / tile_rows;
  const int nthreads = threads > 0 ? threads : omp_get_max_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(nthreads, tiles));
#pragma omp parallel for num_threads(static_cast<int>(parts)) schedule(static)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t r0 = tiles * p / parts * tile_rows, r1 = std::min(m, tiles * (p + 1) / parts * tile_rows);
    if (r0 < r1) columns(r0, r1);
  }
}

// One tile of `rows` (<= 8) weight rows from r, over input rows [0, n): pair(count, i, r') for
// input rows i, i + 1 and `count` weight rows from r', single(count, i, r') for a last odd one.
template <class Pair, class Single>
[[gnu::always_inline]] inline void ForEachRowTile(int64_t n, int64_t rows, int64_t r, const Pair& pair,
                                                  const Single& single) {
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    pair(std::min<int64_t>(rows, 4), i, r);
    if (rows > 4) pair(rows - 4, i, r + 4);
  }
  if (i < n) single(rows, i, r);
}

// Both: every tile of [0, m) x [0, n), the column ranges on `threads` threads.
template <class Pair, class Single>
inline void ForEachTile(int64_t n, int64_t m, int64_t tile_rows, int threads, const Pair& pair, const Single& single) {
  ForEachColumnRange(m, tile_rows, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r += tile_rows) ForEachRowTile(n, std::min(tile_rows, r1 - r), r, pair, single);
  });
}

}  // namespace
}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_COLUMN_TILES_H_
