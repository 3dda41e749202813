// How the CPU's products on int8-rounded activations (QuantIsa::kAvx512Vnni: int8_matmul_vnni.cc,
// int4_matmul_vnni.cc; QuantIsa::kAvx2Int8: int8_matmul_act8_avx2.cc, int4_matmul_act8_avx2.cc) walk
// their outputs: column ranges per OpenMP thread as column_tiles.h's (whole 8-row tiles, so that
// every output is computed by the same code whatever the thread count), and within a range, tiles
// of up to kRowsWithInputs weight rows x kMaxInputs input rows (each weight row's bytes loaded and
// prepared once per kMaxInputs input rows; the VNNI files' 4 x 4 sums fit AVX-512's 32 registers),
// or of 8 weight rows x 1 input row when the product has a single input row (a decode step: 8
// independent sums). A tile's shape is a template argument of the kernel: ForEachAct8Tile hands
// it as std::integral_constant values (tile_rows.h's WithTileRows).
//
// The AVX2 instances walk one weight row at a time instead (ForEachAct8Row): a row's blocks are read
// front to back, one stream in address order, which the hardware prefetcher follows (8 rows at once
// are 8 streams of a few lines each: the tiles above left one thread of the AVX2 EPYC at 7.9 GB/s
// of int4 weights at one input row, bench_matmul), while the row (a few hundred bytes to a
// few KB) stays in L1 for the input rows' passes.
//
// Thread-safety: ForEachAct8Tile and ForEachAct8Row run `tile` / `row` on up to `threads` OpenMP
// threads at once, on disjoint outputs.
#ifndef SHARDSERVE_KERNELS_CPU_ACT8_TILES_H_
#define SHARDSERVE_KERNELS_CPU_ACT8_TILES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu/column_tiles.h"
#include "kernels/cpu/tile_rows.h"

namespace shardserve::cpu {
namespace {  // internal linkage, as column_tiles.h

// One output of such a product: its sum (an exact int32 dot product as a float, or int4's float sum)
// times its scale (the input row's, times the weight row's for int8), plus the bias, as one fused
// multiply-add (one rounding wherever it is compiled). Written as `v * s + b`, GCC contracts it into
// an FMA in the VNNI files (their -mavx512f brings FMA, and GCC contracts across statements) but
// left it as two roundings in the AVX2 ones: the int8 outputs of the two instances differed in
// the last bit (ActivationRowsTest.Avx2Int8ProductIsTheVnniOneBitForBit on an AVX-512 EPYC).
inline float Act8Output(float sum, float scale, const float* bias, int64_t r) {
  return bias != nullptr ? std::fma(sum, scale, bias[r]) : sum * scale;
}

inline constexpr int kAct8RowsAlone = 8;  // weight rows per tile of one input row
inline constexpr int kAct8RangeRows = 8;  // column ranges per thread in whole multiples of this
// How far ahead of its reads ForEachAct8Row's products ask for weight bytes (__builtin_prefetch, in
// address order; a hint). With none, one thread of the AVX2 EPYC read int4 weights at 8 GB/s at one
// input row; 1, 2, 4 and 8 KiB ahead gave 7.7, 9.1, 9.7 and 9.9 (bench_matmul --threads 1).
inline constexpr int64_t kPrefetchBytes = 8192;

// tile(R, I, i, r) for every tile of the product y [n, m]: input rows [i, i + I), weight rows
// [r, r + R), R and I std::integral_constant values.
template <int kMaxInputs, int kRowsWithInputs, class Tile>
inline void ForEachAct8Tile(int64_t n, int64_t m, int threads, const Tile& tile) {
  static_assert(kAct8RangeRows % kRowsWithInputs == 0, "a thread's range is whole tiles");
  ForEachColumnRange(m, kAct8RangeRows, threads, [&](int64_t r0, int64_t r1) {
    const int64_t tile_rows = n == 1 ? kAct8RowsAlone : kRowsWithInputs;
    for (int64_t r = r0; r < r1; r += tile_rows) {
      const int64_t rows = std::min(tile_rows, r1 - r);
      if (n == 1) {
        WithTileRows<kAct8RowsAlone>(rows, [&](auto R) __attribute__((always_inline)) {
          tile(R, std::integral_constant<int, 1>{}, int64_t{0}, r);
        });
        continue;
      }
      for (int64_t i = 0; i < n; i += kMaxInputs) {
        WithTileRows<kRowsWithInputs>(rows, [&](auto R) __attribute__((always_inline)) {
          WithTileRows<kMaxInputs>(std::min<int64_t>(kMaxInputs, n - i), [&](auto I)
                                       __attribute__((always_inline)) { tile(R, I, i, r); });
        });
      }
    }
  });
}

// row(I, i, r) for weight row r of [0, m) and input rows [i, i + I) of [0, n), I an
// std::integral_constant of at most kMaxInputs: each row's passes over all input rows, then the next.
template <int kMaxInputs, class Row>
inline void ForEachAct8Row(int64_t n, int64_t m, int threads, const Row& row) {
  ForEachColumnRange(m, kAct8RangeRows, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < n; i += kMaxInputs) {
        WithTileRows<kMaxInputs>(std::min<int64_t>(kMaxInputs, n - i),
                                 [&](auto I) __attribute__((always_inline)) { row(I, i, r); });
      }
    }
  });
}

}  // namespace
}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_ACT8_TILES_H_
