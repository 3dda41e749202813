// The tiles of the CPU's int4 products (int4_matmul.h), as templates over how 8 packed bytes become
// two 8-float vectors (`Unpack::Load(const uint8_t*, Vec8* low, Vec8* high)`: the low nibbles, then
// the high ones), instantiated once per 8-lane instruction set: int4_matmul.cc (baseline x86-64)
// and int4_matmul_avx2.cc (AVX2 + FMA). (The CPU backend multiplies int4 weights as panels on
// CPUs with AVX2: panel_matmul.h PanelMatMulInt4.) Internal to those files; everything here has
// internal linkage, so the instances cannot mix.
#ifndef SHARDSERVE_KERNELS_CPU_INT4_MATMUL_TILES_H_
#define SHARDSERVE_KERNELS_CPU_INT4_MATMUL_TILES_H_

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels/cpu/column_tiles.h"
#include "kernels/cpu/tile_rows.h"
#include "kernels/host_vec.h"
#include "kernels/quant.h"

namespace shardserve::cpu {

// The baseline-x86-64 and AVX2 instances of the columns [r0, r1) of y = x @ w^T + bias.
void Int4ColumnsPortable(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                         const float* bias, int64_t r0, int64_t r1);
void Int4ColumnsAvx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                     const float* bias, int64_t r0, int64_t r1);
// int4_matmul_vnni.cc: the whole int4 product with activations quantized (QuantIsa::kAvx512Vnni).
void Int4MatMulVnni(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                    const float* bias, int threads);
// int4_matmul_act8_avx2.cc: the same on AVX2 (QuantIsa::kAvx2Int8).
void Int4MatMulAct8Avx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                        const float* bias, int threads);

// Weight rows per tile of columns, as int8_matmul_tiles.h: 8 sums for one input row, 4 x 2 for two.
inline constexpr int kInt4TileRows = 8;

namespace {

// Asks for both cache lines of a 72-byte block (a hint: changes no result). Its first byte alone
// would not do: block starts 72 bytes apart skip one line in nine.
[[gnu::always_inline]] inline void PrefetchInt4Group(const Int4Group128* block) {
  __builtin_prefetch(block, 0, 3);
  __builtin_prefetch(reinterpret_cast<const char*>(block) + 64, 0, 3);
}

#if defined(__AVX2__)
// 8 packed bytes as 16 floats: zero-extend each byte to int32, then its low nibble and its high
// nibble (a shift: the byte is below 256), each converted exactly. For the file compiled with AVX2.
struct UnpackAvx2 {
  [[gnu::always_inline]] static inline void Load(const uint8_t* p, Vec8* lo, Vec8* hi) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    *lo = reinterpret_cast<Vec8>(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))));
    *hi = reinterpret_cast<Vec8>(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)));
  }
};
#endif

[[gnu::always_inline]] inline float SumLanes4(const Vec8& v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// One group g (inputs [128 g, 128 g + size)) of the R x I sums of a tile: sum x q and sum x over the
// group, then acc += scale x (sum x q - zero x sum x). kFull: size == 128, fixed-size loads; else
// the input is read zero-padded (the block's unused nibbles are 0 and meet zeros).
template <class Unpack, int R, int I, bool kFull>
[[gnu::always_inline]] inline void Group(Vec8 (&acc)[I][R], const float* x, int64_t i, int64_t k,
                                         const Int4Group128* blocks, int64_t groups, int64_t r, int64_t g,
                                         int64_t size) {
  constexpr int64_t kHalf = kInt4GroupSize / 2;
  Vec8 part[I][R] = {};
  Vec8 xsum[I] = {};
  for (int64_t c = 0; c < kHalf; c += kVecLanes) {
    Vec8 xlo[I], xhi[I];
    for (int a = 0; a < I; ++a) {
      const float* row = x + (i + a) * k + g * kInt4GroupSize;
      xlo[a] = kFull ? LoadVec(row + c) : LoadVec(row + c, size - c);
      xhi[a] = kFull ? LoadVec(row + kHalf + c) : (size > kHalf + c ? LoadVec(row + kHalf + c, size - kHalf - c) : Vec8{});
      xsum[a] += xlo[a] + xhi[a];
    }
    for (int b = 0; b < R; ++b) {
      Vec8 lo, hi;
      Unpack::Load(blocks[(r + b) * groups + g].q + c, &lo, &hi);
      for (int a = 0; a < I; ++a) {
        part[a][b] += xlo[a] * lo;
        part[a][b] += xhi[a] * hi;
      }
    }
  }
  for (int b = 0; b < R; ++b) {
    const Int4Group128& block = blocks[(r + b) * groups + g];
    const float s = block.scale, sz = block.scale * static_cast<float>(block.zero);
    for (int a = 0; a < I; ++a) acc[a][b] += part[a][b] * s - xsum[a] * sz;
  }
}

// y[i .. i+I) x columns [r, r+R): every output the same sequence of operations whatever R and I.
template <class Unpack, int R, int I>
[[gnu::always_inline]] inline void Tile(float* y, const float* x, int64_t i, int64_t m, int64_t k,
                                        const Int4Group128* blocks, const float* bias, int64_t r) {
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  const int64_t whole = k / kInt4GroupSize;
  Vec8 acc[I][R] = {};
  for (int64_t g = 0; g < whole; ++g) {
    // The same group kPrefetchRows rows on (column_tiles.h).
    for (int b = 0; b < R; ++b) PrefetchInt4Group(blocks + PrefetchRow(r + b, m) * groups + g);
    Group<Unpack, R, I, true>(acc, x, i, k, blocks, groups, r, g, kInt4GroupSize);
  }
  if (whole < groups) Group<Unpack, R, I, false>(acc, x, i, k, blocks, groups, r, whole, k - whole * kInt4GroupSize);
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) {
      const float v = SumLanes4(acc[a][b]);
      y[(i + a) * m + r + b] = bias != nullptr ? v + bias[r + b] : v;
    }
  }
}

template <class Unpack, int I>
[[gnu::always_inline]] inline void TileOf(int64_t rows, float* y, const float* x, int64_t i, int64_t m, int64_t k,
                                          const Int4Group128* blocks, const float* bias, int64_t r) {
  WithTileRows<kInt4TileRows>(
      rows, [&](auto R) __attribute__((always_inline)) { Tile<Unpack, R, I>(y, x, i, m, k, blocks, bias, r); });
}

// Input rows per pass of PlaneTile: their sums wait on the stack while the groups go by.
inline constexpr int64_t kInt4PlaneRows = 16;
// From this many input rows on, Columns unpacks each group once into float planes (PlaneTile)
// instead of once per pair of input rows (Tile): unpacking is about half of Tile's work.
inline constexpr int64_t kInt4PlaneMinRows = 4;

// One group g of PlaneTile: unpack the R rows' values into `plane`, then every input row's sums.
// kFull: size == 128 (fixed-size loads), as Group.
template <class Unpack, int R, bool kFull>
[[gnu::always_inline]] inline void PlaneGroup(Vec8 (&acc)[kInt4PlaneRows][R], float (&plane)[R][kInt4GroupSize],
                                              const float* x, int64_t i, int64_t count, int64_t k,
                                              const Int4Group128* blocks, int64_t groups, int64_t r, int64_t g,
                                              int64_t size) {
  constexpr int64_t kHalf = kInt4GroupSize / 2;
  for (int b = 0; b < R; ++b) {
    for (int64_t c = 0; c < kHalf; c += kVecLanes) {
      Vec8 lo, hi;
      Unpack::Load(blocks[(r + b) * groups + g].q + c, &lo, &hi);
      StoreVec(plane[b] + c, lo);
      StoreVec(plane[b] + kHalf + c, hi);
    }
  }
  for (int64_t a = 0; a < count; ++a) {
    const float* row = x + (i + a) * k + g * kInt4GroupSize;
    Vec8 part[R] = {};
    Vec8 xsum = {};
    for (int64_t c = 0; c < kHalf; c += kVecLanes) {
      const Vec8 xlo = kFull ? LoadVec(row + c) : LoadVec(row + c, size - c);
      const Vec8 xhi = kFull ? LoadVec(row + kHalf + c)
                             : (size > kHalf + c ? LoadVec(row + kHalf + c, size - kHalf - c) : Vec8{});
      xsum += xlo + xhi;
      for (int b = 0; b < R; ++b) {
        part[b] += xlo * LoadVec(plane[b] + c);
        part[b] += xhi * LoadVec(plane[b] + kHalf + c);
      }
    }
    for (int b = 0; b < R; ++b) {
      const Int4Group128& block = blocks[(r + b) * groups + g];
      const float s = block.scale, sz = block.scale * static_cast<float>(block.zero);
      acc[a][b] += part[b] * s - xsum * sz;
    }
  }
}

// Input rows [i, i + count) (count <= kInt4PlaneRows) x columns [r, r + R), the same sums as Tile,
// operation for operation (so a row's result does not depend on which path its batch took): each
// group's R x 128 values are unpacked once into a plane of floats, then every input row
// multiplies them from L1.
template <class Unpack, int R>
[[gnu::always_inline]] inline void PlaneTile(float* y, const float* x, int64_t i, int64_t count, int64_t m, int64_t k,
                                             const Int4Group128* blocks, const float* bias, int64_t r) {
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  const int64_t whole = k / kInt4GroupSize;
  alignas(32) float plane[R][kInt4GroupSize];
  Vec8 acc[kInt4PlaneRows][R] = {};
  for (int64_t g = 0; g < whole; ++g) {
    PlaneGroup<Unpack, R, true>(acc, plane, x, i, count, k, blocks, groups, r, g, kInt4GroupSize);
  }
  if (whole < groups) {
    PlaneGroup<Unpack, R, false>(acc, plane, x, i, count, k, blocks, groups, r, whole, k - whole * kInt4GroupSize);
  }
  for (int64_t a = 0; a < count; ++a) {
    for (int b = 0; b < R; ++b) {
      const float v = SumLanes4(acc[a][b]);
      y[(i + a) * m + r + b] = bias != nullptr ? v + bias[r + b] : v;
    }
  }
}

template <class Unpack>
[[gnu::always_inline]] inline void PlaneTileOf(int64_t rows, float* y, const float* x, int64_t i, int64_t count,
                                               int64_t m, int64_t k, const Int4Group128* blocks, const float* bias,
                                               int64_t r) {
  WithTileRows<kInt4TileRows>(rows, [&](auto R) __attribute__((always_inline)) {
    PlaneTile<Unpack, R>(y, x, i, count, m, k, blocks, bias, r);
  });
}

// Output columns [r0, r1) of every row of y, kInt4TileRows weight rows at a time (their blocks stay
// in L1 while the input rows stream past). Fewer than kInt4PlaneMinRows input rows (decode): input
// rows in pairs (4 weight rows x 2 inputs), a last single one 8 weight rows at a time, unpacking
// in registers; more: PlaneTile, kInt4PlaneRows input rows a pass.
template <class Unpack>
[[gnu::always_inline]] inline void Columns(float* y, const float* x, int64_t n, int64_t m, int64_t k,
                                           const Int4Group128* blocks, const float* bias, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; r += kInt4TileRows) {
    const int64_t rows = std::min<int64_t>(kInt4TileRows, r1 - r);
    if (n >= kInt4PlaneMinRows) {
      for (int64_t i = 0; i < n; i += kInt4PlaneRows) {
        PlaneTileOf<Unpack>(rows, y, x, i, std::min(kInt4PlaneRows, n - i), m, k, blocks, bias, r);
      }
      continue;
    }
    ForEachRowTile(
        n, rows, r, [&](int64_t count, int64_t i, int64_t rr) { TileOf<Unpack, 2>(count, y, x, i, m, k, blocks, bias, rr); },
        [&](int64_t count, int64_t i, int64_t rr) { TileOf<Unpack, 1>(count, y, x, i, m, k, blocks, bias, rr); });
  }
}

}  // namespace
}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_INT4_MATMUL_TILES_H_
