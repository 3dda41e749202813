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
#include "kernels/host_vec.h"

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
// fp8 e4m3 with input-group scales (kernels/quant.h Fp8RowsLayout with `group` > 0): scale [m, G],
// G = ceil(k / group).
#define SHARDSERVE_FP8_GROUP_COLUMNS(name)                                                                   \
  void name(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q, const float* scale, \
            int64_t group, const float* bias, int64_t r0, int64_t r1)
SHARDSERVE_FP8_GROUP_COLUMNS(Fp8GroupColumnsPortable);
SHARDSERVE_FP8_GROUP_COLUMNS(Fp8GroupColumnsAvx2);
SHARDSERVE_FP8_GROUP_COLUMNS(Fp8GroupColumnsAvx512);
#undef SHARDSERVE_FP8_GROUP_COLUMNS
// int8_matmul_vnni.cc: the whole int8 product with activations quantized (QuantIsa::kAvx512Vnni).
void Int8MatMulVnni(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                    const float* bias, int threads);
// int8_matmul_act8_avx2.cc: the same on AVX2 (QuantIsa::kAvx2Int8).
void Int8MatMulAct8Avx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
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

// Float vectors of 16, 8, 4 and 2 lanes, each the half of the one before (SumLanes). (Spelled out:
// GCC drops a vector_size attribute whose size depends on a template parameter.)
using Lanes16 = float __attribute__((vector_size(64)));
using Lanes8 = float __attribute__((vector_size(32)));
using Lanes4 = float __attribute__((vector_size(16)));
using Lanes2 = float __attribute__((vector_size(8)));
template <class V>
struct HalfOf;
template <>
struct HalfOf<Lanes16> {
  using type = Lanes8;
};
template <>
struct HalfOf<Lanes8> {
  using type = Lanes4;
};
template <>
struct HalfOf<Lanes4> {
  using type = Lanes2;
};

// The sum of v's lanes, in one fixed order: halves added until one lane is left (lane j of each
// step is lane j plus lane j + half of the step before), the halves added as vectors.
template <class V>
[[gnu::always_inline]] inline float SumLanes(const V& v) {
  if constexpr (kLanesOf<V> == 2) {
    return v[0] + v[1];
  } else {
    using Half = typename HalfOf<V>::type;
    Half lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    return SumLanes(lo + hi);
  }
}

// The first `count` (< lanes) weights at p widened, the other lanes 0 (a zero byte is 0.0 in int8
// and in e4m3).
template <class Widen>
[[gnu::always_inline]] inline typename Widen::V LoadTail(const uint8_t* p, int64_t count) {
  uint8_t padded[kLanesOf<typename Widen::V>] = {};
  std::memcpy(padded, p, static_cast<size_t>(count));
  return Widen::Load(padded);
}

// Input-group scales: lanes j of the scales of inputs c + j of a row (`srow` its G = ceil(k /
// group) scales): one broadcast where the vector lies in one group (always, for a group that is a
// multiple of the lanes), else lane by lane, the group advanced as its inputs run out (a 16-lane
// vector across two groups of 8 x j inputs), lanes past k taking the row's last scale (their
// inputs are 0).
template <class V>
[[gnu::always_inline]] inline V ScaleLanes(const float* srow, int64_t c, int64_t group, int64_t groups) {
  constexpr int64_t L = kLanesOf<V>;
  int64_t g = c / group;
  int64_t left = (g + 1) * group - c;  // inputs of group g from c on
  V s;
  if (left >= L) {
    for (int64_t j = 0; j < L; ++j) s[j] = srow[g];
  } else {
    for (int64_t j = 0; j < L; ++j) {
      s[j] = srow[std::min<int64_t>(g, groups - 1)];
      if (--left == 0) {
        ++g;
        left = group;
      }
    }
  }
  return s;
}

// y[i .. i+I) x columns [r, r+R): R x I sums, each over k in the same order whatever R and I
// (the tile's size only decides which sums share a weight load), so that tails and full tiles
// give every output the same bits. Bounds are compile-time so the sums stay in registers. Weight
// row r's bytes at w (the next rows k bytes further each).
// kGroups (fp8 with input-group scales, `group` inputs a scale): each widened weight vector is
// multiplied by its inputs' scales before the sums (scale [m, G] here), so that the sums take the
// reference's dequantized weights (DequantizeFp8Groups: code x scale, rounded once) bit for bit,
// and the finished sums are not scaled again.
template <class Widen, int R, int I, bool kGroups = false>
[[gnu::always_inline]] inline void Tile(float* y, const float* x, int64_t i, int64_t m, int64_t k, const uint8_t* w,
                                        const float* scale, const float* bias, int64_t r, int64_t group = 0) {
  using V = typename Widen::V;
  constexpr int64_t L = kLanesOf<V>;
  const int64_t groups = kGroups ? (k + group - 1) / group : 1;
  V acc[I][R] = {};
  // Whole vectors with fixed-size loads (a variable-size copy would be a library call per step),
  // then the tail, zero-padded: the same sequence of operations for every output.
  // The 8-lane instances' requests in address order (column_tiles.h): rows [r, r + R) are R x k
  // bytes at w, and the tile kPrefetchRows rows on reads as many from `ahead`.
  const uint8_t* ahead = L == 8 && r + kPrefetchRows + R <= m ? w + kPrefetchRows * k : nullptr;
  int64_t c = 0;
  for (; c + L <= k; c += L) {
    V xv[I];
    for (int a = 0; a < I; ++a) xv[a] = LoadLanes<V>(x + (i + a) * k + c);
    if (ahead != nullptr) PrefetchInOrder(ahead, c * R, L * R);
    for (int b = 0; b < R; ++b) {
      // Each cache line of the row kPrefetchRows on, once (column_tiles.h), in the 16-lane instances.
      if (L != 8 && (c & 63) == 0) __builtin_prefetch(w + (PrefetchRow(r + b, m) - r) * k + c, 0, 3);
      V wv = Widen::Load(w + b * k + c);
      if constexpr (kGroups) wv *= ScaleLanes<V>(scale + (r + b) * groups, c, group, groups);
      for (int a = 0; a < I; ++a) acc[a][b] += xv[a] * wv;
    }
  }
  if (c < k) {
    const int64_t count = k - c;
    V xv[I];
    for (int a = 0; a < I; ++a) xv[a] = LoadLanes<V>(x + (i + a) * k + c, count);
    for (int b = 0; b < R; ++b) {
      V wv = LoadTail<Widen>(w + b * k + c, count);
      if constexpr (kGroups) wv *= ScaleLanes<V>(scale + (r + b) * groups, c, group, groups);
      for (int a = 0; a < I; ++a) acc[a][b] += xv[a] * wv;
    }
  }
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) {
      const float v = kGroups ? SumLanes(acc[a][b]) : SumLanes(acc[a][b]) * scale[r + b];
      y[(i + a) * m + r + b] = bias != nullptr ? v + bias[r + b] : v;
    }
  }
}

// Tile<R, I> for R known only at run time (1 to kMaxRows).
template <class Widen, int I, int kMaxRows = kInt8TileRows, bool kGroups = false>
[[gnu::always_inline]] inline void TileOf(int64_t rows, float* y, const float* x, int64_t i, int64_t m, int64_t k,
                                          const uint8_t* w, const float* scale, const float* bias, int64_t r,
                                          int64_t group = 0) {
  WithTileRows<kMaxRows>(rows, [&](auto R) __attribute__((always_inline)) {
    Tile<Widen, R, I, kGroups>(y, x, i, m, k, w, scale, bias, r, group);
  });
}

// Input rows [0, n) x columns [r, r + rows) (rows <= kInt8TileRows), 4 input rows x 4 weight rows at
// a time: 16 sums, each weight vector widened once for 4 input rows (the pairs' tiles widen it for
// 2), which needs AVX-512's 32 registers (16 sums, 4 inputs, the weight). The rows past the last
// multiple of 4 in one tile of 3, 2 or 1 over the same 4 weight rows. Measured on an Intel Xeon
// with AVX-512 and AMX (bench_matmul): from 4 rows up the
// bench stage's products take 25-30% less time than with the pairs.
template <class Widen, bool kGroups = false>
[[gnu::always_inline]] inline void QuadColumns(float* y, const float* x, int64_t n, int64_t m, int64_t k,
                                               const uint8_t* q, const float* scale, const float* bias, int64_t r,
                                               int64_t rows, int64_t group = 0) {
  constexpr int kQuad = 4;
  for (int64_t b = 0; b < rows; b += kQuad) {
    const int64_t part = std::min<int64_t>(kQuad, rows - b);
    const uint8_t* w = q + (r + b) * k;
    int64_t i = 0;
    for (; i + kQuad <= n; i += kQuad) {
      TileOf<Widen, kQuad, kQuad, kGroups>(part, y, x, i, m, k, w, scale, bias, r + b, group);
    }
    switch (n - i) {
      case 3: TileOf<Widen, 3, kQuad, kGroups>(part, y, x, i, m, k, w, scale, bias, r + b, group); break;
      case 2: TileOf<Widen, 2, kQuad, kGroups>(part, y, x, i, m, k, w, scale, bias, r + b, group); break;
      case 1: TileOf<Widen, 1, kQuad, kGroups>(part, y, x, i, m, k, w, scale, bias, r + b, group); break;
      default: break;
    }
  }
}

// Output columns [r0, r1) of every row of y, kInt8TileRows weight rows at a time (which stay in L1
// while the input rows stream past): input rows in pairs (4 weight rows x 2 inputs = 8 sums), and
// a last single input row (a decode step's usual case) 8 weight rows at a time, so that it too
// keeps 8 independent sums in flight. With kQuads (AVX-512), from 4 input rows on, QuadColumns'
// tiles instead: the same sums, operation for operation (Tile's), so a row's result does not depend
// on which tiles its step took.
// kGroups: fp8 with input-group scales (Tile's), scale [m, G].
template <class Widen, bool kQuads = false, bool kGroups = false>
[[gnu::always_inline]] inline void Columns(float* y, const float* x, int64_t n, int64_t m, int64_t k,
                                           const uint8_t* q, const float* scale, const float* bias, int64_t r0,
                                           int64_t r1, int64_t group = 0) {
  for (int64_t r = r0; r < r1; r += kInt8TileRows) {
    if (kQuads && n >= 4) {
      QuadColumns<Widen, kGroups>(y, x, n, m, k, q, scale, bias, r, std::min<int64_t>(kInt8TileRows, r1 - r), group);
      continue;
    }
    ForEachRowTile(
        n, std::min<int64_t>(kInt8TileRows, r1 - r), r,
        [&](int64_t rows, int64_t i, int64_t rr) {
          TileOf<Widen, 2, kInt8TileRows, kGroups>(rows, y, x, i, m, k, q + rr * k, scale, bias, rr, group);
        },
        [&](int64_t rows, int64_t i, int64_t rr) {
          TileOf<Widen, 1, kInt8TileRows, kGroups>(rows, y, x, i, m, k, q + rr * k, scale, bias, rr, group);
        });
  }
}

}  // namespace
}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_INT8_MATMUL_TILES_H_
