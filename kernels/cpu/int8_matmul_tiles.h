// The tiles of the CPU's products by one-byte weights with one float32 scale per output channel
// (int8_matmul.h: int8 and fp8 e4m3), as templates over how a vector's worth of weight bytes
// becomes floats (`Widen::V`, a GCC vector of floats, and `Widen::Load(const uint8_t*) -> V`, exact
// for every byte), instantiated once per format and instruction set: int8_matmul.cc (baseline
// x86-64), int8_matmul_avx2.cc (AVX2 + FMA, 8 lanes) and int8_matmul_avx512.cc (AVX-512, 16
// lanes). Internal to those files; everything here has internal linkage, so instances cannot mix.
#ifndef SHARDSERVE_KERNELS_CPU_INT8_MATMUL_TILES_H_
#define SHARDSERVE_KERNELS_CPU_INT8_MATMUL_TILES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/column_tiles.h"
#include "kernels/cpu/tile_rows.h"
#include "kernels/cpu/vec.h"

namespace shardserve::cpu {

// The instances of the columns [r0, r1) of y = x @ (widen(q) x scale)^T + bias, q [m, k] bytes.
#define SHARDSERVE_BYTE_COLUMNS(name)                                                                         \
  void name(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q, const float* scale, \
            const float* bias, int64_t r0, int64_t r1)
SHARDSERVE_BYTE_COLUMNS(Int8ColumnsPortable);
SHARDSERVE_BYTE_COLUMNS(Int8ColumnsAvx2);
SHARDSERVE_BYTE_COLUMNS(Int8ColumnsAvx512);
SHARDSERVE_BYTE_COLUMNS(Fp8ColumnsPortable);
SHARDSERVE_BYTE_COLUMNS(Fp8ColumnsAvx2);
SHARDSERVE_BYTE_COLUMNS(Fp8ColumnsAvx512);
#undef SHARDSERVE_BYTE_COLUMNS
// int8_matmul_vnni.cc: the whole int8 product with activations quantized (QuantIsa::kAvx512Vnni).
void Int8MatMulVnni(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                    const float* bias, int threads);

// Weight rows per tile of columns: 8 independent sums for a single input row (the chains two 4-deep
// FMA units need), or 4 x 2 for a pair of input rows, each weight vector loaded once for both.
inline constexpr int kInt8TileRows = 8;

namespace {

template <class V>
inline constexpr int64_t kLanesOf = static_cast<int64_t>(sizeof(V) / sizeof(float));

// The first `count` floats at p (all the vector's lanes when count >= its lanes), the rest 0.
template <class V>
[[gnu::always_inline]] inline V LoadLanes(const float* p, int64_t count = kLanesOf<V>) {
  V v = {};
  if (count >= kLanesOf<V>) {
    std::memcpy(&v, p, sizeof v);
  } else if (count > 0) {
    std::memcpy(&v, p, static_cast<size_t>(count) * sizeof(float));
  }
  return v;
}

// The sum of v's lanes, in one fixed order (halves added until one lane is left).
template <class V>
[[gnu::always_inline]] inline float SumLanes(const V& v) {
  float t[kLanesOf<V>];
  std::memcpy(t, &v, sizeof v);
  for (int64_t w = kLanesOf<V> / 2; w >= 1; w /= 2) {
    for (int64_t j = 0; j < w; ++j) t[j] += t[j + w];
  }
  return t[0];
}

// The first `count` (< lanes) weights at p widened, the other lanes 0 (a zero byte is 0.0 in int8
// and in e4m3).
template <class Widen>
[[gnu::always_inline]] inline typename Widen::V LoadTail(const uint8_t* p, int64_t count) {
  uint8_t padded[kLanesOf<typename Widen::V>] = {};
  std::memcpy(padded, p, static_cast<size_t>(count));
  return Widen::Load(padded);
}

// y[i .. i+I) x columns [r, r+R): R x I sums, each over k in the same order whatever R and I
// (the tile's size only decides which sums share a weight load), so that tails and full tiles
// give every output the same bits. Bounds are compile-time so the sums stay in registers.
template <class Widen, int R, int I>
[[gnu::always_inline]] inline void Tile(float* y, const float* x, int64_t i, int64_t m, int64_t k, const uint8_t* q,
                                        const float* scale, const float* bias, int64_t r) {
  using V = typename Widen::V;
  constexpr int64_t L = kLanesOf<V>;
  V acc[I][R] = {};
  // Whole vectors with fixed-size loads (a variable-size copy would be a library call per step),
  // then the tail, zero-padded: the same sequence of operations for every output.
  int64_t c = 0;
  for (; c + L <= k; c += L) {
    V xv[I];
    for (int a = 0; a < I; ++a) xv[a] = LoadLanes<V>(x + (i + a) * k + c);
    for (int b = 0; b < R; ++b) {
      // Each cache line of the row kPrefetchRows on, once (column_tiles.h).
      if ((c & 63) == 0) __builtin_prefetch(q + PrefetchRow(r + b, m) * k + c, 0, 3);
      const V wv = Widen::Load(q + (r + b) * k + c);
      for (int a = 0; a < I; ++a) acc[a][b] += xv[a] * wv;
    }
  }
  if (c < k) {
    const int64_t count = k - c;
    V xv[I];
    for (int a = 0; a < I; ++a) xv[a] = LoadLanes<V>(x + (i + a) * k + c, count);
    for (int b = 0; b < R; ++b) {
      const V wv = LoadTail<Widen>(q + (r + b) * k + c, count);
      for (int a = 0; a < I; ++a) acc[a][b] += xv[a] * wv;
    }
  }
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) {
      const float v = SumLanes(acc[a][b]) * scale[r + b];
      y[(i + a) * m + r + b] = bias != nullptr ? v + bias[r + b] : v;
    }
  }
}

// Tile<R, I> for R known only at run time (1 to 8).
template <class Widen, int I>
[[gnu::always_inline]] inline void TileOf(int64_t rows, float* y, const float* x, int64_t i, int64_t m, int64_t k,
                                          const uint8_t* q, const float* scale, const float* bias, int64_t r) {
  WithTileRows<kInt8TileRows>(
      rows, [&](auto R) __attribute__((always_inline)) { Tile<Widen, R, I>(y, x, i, m, k, q, scale, bias, r); });
}

// Output columns [r0, r1) of every row of y, kInt8TileRows weight rows at a time (which stay in L1
// while the input rows stream past): input rows in pairs (4 weight rows x 2 inputs = 8 sums), and
// a last single input row (a decode step's usual case) 8 weight rows at a time, so that it too
// keeps 8 independent sums in flight.
template <class Widen>
[[gnu::always_inline]] inline void Columns(float* y, const float* x, int64_t n, int64_t m, int64_t k,
                                           const uint8_t* q, const float* scale, const float* bias, int64_t r0,
                                           int64_t r1) {
  for (int64_t r = r0; r < r1; r += kInt8TileRows) {
    ForEachRowTile(
        n, std::min<int64_t>(kInt8TileRows, r1 - r), r,
        [&](int64_t rows, int64_t i, int64_t rr) { TileOf<Widen, 2>(rows, y, x, i, m, k, q, scale, bias, rr); },
        [&](int64_t rows, int64_t i, int64_t rr) { TileOf<Widen, 1>(rows, y, x, i, m, k, q, scale, bias, rr); });
  }
}

}  // namespace
}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_INT8_MATMUL_TILES_H_
