// The AVX-512 instance of the exact int4 products (int4_matmul.h), 16 lanes wide. Each group's 16
// possible weight values, (j - zero) x scale for j in [0, 15] (DequantizeInt4Groups's, bit for
// bit: one multiply of a row of kZeroTable), sit in one register, and each nibble becomes its
// float by a lookup in it (VPERMPS reads only an index's low 4 bits, so the low nibbles need no
// mask; the high ones a shift): per 32 weights one zero-extending load, two lookups and one shift,
// where the 8-lane instances spend a load, a mask, a shift and two conversions per 16. Every
// output is then sum_j x_j w_j over the dequantized weights, in 16 lanes (lane l sums the inputs
// j = l mod 16, group by group, one FMA each, AddGroup's order), the lanes added at the end: the
// dequantize-then-multiply reference in another order of additions (no per-group x q and x sums,
// so no cancellation between them), whatever the path:
//   - fewer than kPlaneMinRows input rows (decode, small batches): the weights looked up in
//     registers, for up to three input rows at a time;
//   - more: each group's R x 128 weights looked up once into a plane of floats, then two input
//     rows at a time multiply it from L1.
// Both paths run the same FMAs on the same values in the same order, so a row's result does not
// depend on the other rows of its batch (QuantMatMulRowsTest).
// This file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mfma (kernels/CMakeLists.txt);
// Int4MatMul calls it only on CPUs that have them (quant_isa.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/column_tiles.h"
#include "kernels/cpu/int4_matmul_tiles.h"
#include "kernels/cpu/tile_rows.h"

namespace shardserve::cpu {
namespace {

constexpr int64_t kHalf = kInt4GroupSize / 2;  // 64: the low nibbles' values, then the high ones'
constexpr int kChunks = kHalf / 16;            // 4 zmm of values per half group
// From this many input rows on, Int4ColumnsAvx512 looks each group up once into a plane
// (PlaneTile); below, up to three input rows share each lookup in registers (Tile). Measured on
// one layer of the bench stage (AMD EPYC, AVX-512, one thread): 8 rows 0.57 ms as Tile
// (3 + 3 + 2) against 0.66 as PlaneTile, 12 about even, PlaneTile ahead from 16.
constexpr int64_t kPlaneMinRows = 9;
// Input rows per PlaneTile pass, their sums waiting on the stack while the groups go by (32 KB of
// them): each group's lookup is shared by four times the 8-lane instances' kInt4PlaneRows (32 rows:
// 2.01 ms against 2.16 with 16, one layer of the bench stage, AMD EPYC; 64 rows: 1.5-2.5% less
// time than 32 from 64 to 512 rows on the Intel Xeon, `bench_matmul --threads 2 --max-rows 512`).
constexpr int64_t kPlaneRows = 64;

// (j - z) for j in [0, 15], one row per zero point z a block can hold (a uint8: the quantizer
// writes 0-15, a GPTQ v1 checkpoint up to 16, model/quantized_checkpoint.cc), exact small integers:
// so a group's values cost one multiply, and any zero byte reads inside the table. 16 KB, of which
// a model touches the rows of the zeros it has (64 bytes each).
struct ZeroTable {
  alignas(64) float v[256][16];
  constexpr ZeroTable() : v() {
    for (int z = 0; z < 256; ++z) {
      for (int j = 0; j < 16; ++j) v[z][j] = static_cast<float>(j - z);
    }
  }
};
constexpr ZeroTable kZeroTable;

// The group's 16 weight values: (j - zero) x scale, as DequantizeInt4Groups computes them.
[[gnu::always_inline]] inline __m512 GroupValues(const Int4Group128& block) {
  return _mm512_mul_ps(_mm512_load_ps(kZeroTable.v[block.zero]), _mm512_set1_ps(block.scale));
}

// Bytes [16 c, 16 c + 16) of the block as the weights 16 c + l (low nibbles) and 64 + 16 c + l
// (high ones).
[[gnu::always_inline]] inline void Lookup(const Int4Group128& block, int c, __m512 values, __m512* lo, __m512* hi) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block.q + 16 * c)));
  *lo = _mm512_permutexvar_ps(bytes, values);
  *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
}

// Chunk c of a group's input row (its 128 values from `row`): chunks 0-3 the low half, 4-7 the
// high one. kFull: 128 inputs; else `size` of them, the rest read as zeros (the block's unused
// nibbles are 0, whose value -zero x scale is finite, so they add nothing).
template <bool kFull>
[[gnu::always_inline]] inline __m512 InputChunk(const float* row, int c, int64_t size) {
  const int64_t first = (c < kChunks ? 0 : kHalf) + 16 * (c % kChunks);
  if constexpr (kFull) return _mm512_loadu_ps(row + first);
  const int64_t left = std::clamp<int64_t>(size - first, 0, 16);
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1), row + first);
}

template <bool kFull>
[[gnu::always_inline]] inline void LoadGroupInput(__m512 (&v)[2 * kChunks], const float* row, int64_t size) {
  for (int c = 0; c < 2 * kChunks; ++c) v[c] = InputChunk<kFull>(row, c, size);
}

// Every output's sequence: per group, chunk c of the low half then of the high one, c = 0 .. 3.
[[gnu::always_inline]] inline __m512 AddGroup(__m512 acc, const __m512 (&x)[2 * kChunks], const __m512 (&w)[2 * kChunks]) {
  for (int c = 0; c < kChunks; ++c) {
    acc = _mm512_fmadd_ps(x[c], w[c], acc);
    acc = _mm512_fmadd_ps(x[kChunks + c], w[kChunks + c], acc);
  }
  return acc;
}

[[gnu::always_inline]] inline void Store(float* y, const float* bias, int64_t m, int64_t i, int64_t r, __m512 acc) {
  const float v = _mm512_reduce_add_ps(acc);
  y[i * m + r] = bias != nullptr ? v + bias[r] : v;
}

// One group g of Tile: I input rows x R weight rows, the weights looked up in registers, the
// inputs read from L1 as the FMAs need them (AddGroup's order, interleaved across the outputs).
template <int R, int I, bool kFull>
[[gnu::always_inline]] inline void Group(__m512 (&acc)[I][R], const float* x, int64_t i, int64_t m, int64_t k,
                                         const Int4Group128* blocks, int64_t groups, int64_t r, int64_t g) {
  const int64_t size = std::min(kInt4GroupSize, k - g * kInt4GroupSize);
  const float* row = x + i * k + g * kInt4GroupSize;
  for (int b = 0; b < R; ++b) {
    // The same group kPrefetchRows rows on (column_tiles.h).
    PrefetchInt4Group(blocks + PrefetchRow(r + b, m) * groups + g);
    const Int4Group128& block = blocks[(r + b) * groups + g];
    const __m512 values = GroupValues(block);
    for (int c = 0; c < kChunks; ++c) {
      __m512 lo, hi;
      Lookup(block, c, values, &lo, &hi);
      for (int a = 0; a < I; ++a) {
        acc[a][b] = _mm512_fmadd_ps(InputChunk<kFull>(row + a * k, c, size), lo, acc[a][b]);
        acc[a][b] = _mm512_fmadd_ps(InputChunk<kFull>(row + a * k, kChunks + c, size), hi, acc[a][b]);
      }
    }
  }
}

// y[i .. i+I) x columns [r, r+R), for few input rows.
template <int R, int I>
[[gnu::always_inline]] inline void Tile(float* y, const float* x, int64_t i, int64_t m, int64_t k,
                                        const Int4Group128* blocks, const float* bias, int64_t r) {
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  const int64_t whole = k / kInt4GroupSize;
  __m512 acc[I][R];
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) acc[a][b] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < whole; ++g) Group<R, I, true>(acc, x, i, m, k, blocks, groups, r, g);
  if (whole < groups) Group<R, I, false>(acc, x, i, m, k, blocks, groups, r, whole);
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) Store(y, bias, m, i + a, r + b, acc[a][b]);
  }
}

// One group g of PlaneTile: the R rows' weights into `plane`, then each input row's sums, two rows
// at a time (each plane vector loaded once for both).
template <int R, bool kFull>
[[gnu::always_inline]] inline void PlaneGroup(__m512 (&acc)[kPlaneRows][R], __m512 (&plane)[R][2 * kChunks],
                                              const float* x, int64_t i, int64_t count, int64_t m, int64_t k,
                                              const Int4Group128* blocks, int64_t groups, int64_t r, int64_t g) {
  const int64_t size = std::min(kInt4GroupSize, k - g * kInt4GroupSize);
  for (int b = 0; b < R; ++b) {
    PrefetchInt4Group(blocks + PrefetchRow(r + b, m) * groups + g);
    const Int4Group128& block = blocks[(r + b) * groups + g];
    const __m512 values = GroupValues(block);
    for (int c = 0; c < kChunks; ++c) Lookup(block, c, values, &plane[b][c], &plane[b][kChunks + c]);
  }
  int64_t a = 0;
  for (; a + 2 <= count; a += 2) {
    __m512 x0[2 * kChunks], x1[2 * kChunks];
    LoadGroupInput<kFull>(x0, x + (i + a) * k + g * kInt4GroupSize, size);
    LoadGroupInput<kFull>(x1, x + (i + a + 1) * k + g * kInt4GroupSize, size);
    for (int b = 0; b < R; ++b) {
      __m512 acc0 = acc[a][b], acc1 = acc[a + 1][b];
      for (int c = 0; c < kChunks; ++c) {
        acc0 = _mm512_fmadd_ps(x0[c], plane[b][c], acc0);
        acc1 = _mm512_fmadd_ps(x1[c], plane[b][c], acc1);
        acc0 = _mm512_fmadd_ps(x0[kChunks + c], plane[b][kChunks + c], acc0);
        acc1 = _mm512_fmadd_ps(x1[kChunks + c], plane[b][kChunks + c], acc1);
      }
      acc[a][b] = acc0;
      acc[a + 1][b] = acc1;
    }
  }
  if (a < count) {
    __m512 x0[2 * kChunks];
    LoadGroupInput<kFull>(x0, x + (i + a) * k + g * kInt4GroupSize, size);
    for (int b = 0; b < R; ++b) acc[a][b] = AddGroup(acc[a][b], x0, plane[b]);
  }
}

// Input rows [i, i + count) (count <= kPlaneRows) x columns [r, r + R): Tile's sums, operation for
// operation, each group's weights looked up once for all the input rows.
template <int R>
[[gnu::always_inline]] inline void PlaneTile(float* y, const float* x, int64_t i, int64_t count, int64_t m, int64_t k,
                                             const Int4Group128* blocks, const float* bias, int64_t r) {
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  const int64_t whole = k / kInt4GroupSize;
  __m512 plane[R][2 * kChunks];
  __m512 acc[kPlaneRows][R];
  for (int64_t a = 0; a < count; ++a) {
    for (int b = 0; b < R; ++b) acc[a][b] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < whole; ++g) PlaneGroup<R, true>(acc, plane, x, i, count, m, k, blocks, groups, r, g);
  if (whole < groups) PlaneGroup<R, false>(acc, plane, x, i, count, m, k, blocks, groups, r, whole);
  for (int64_t a = 0; a < count; ++a) {
    for (int b = 0; b < R; ++b) Store(y, bias, m, i + a, r + b, acc[a][b]);
  }
}

}  // namespace

void Int4ColumnsAvx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                       const float* bias, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; r += kInt4TileRows) {
    const int64_t rows = std::min<int64_t>(kInt4TileRows, r1 - r);
    if (n >= kPlaneMinRows) {
      for (int64_t i = 0; i < n; i += kPlaneRows) {
        const int64_t count = std::min(kPlaneRows, n - i);
        WithTileRows<kInt4TileRows>(rows, [&](auto R) __attribute__((always_inline)) {
          PlaneTile<R>(y, x, i, count, m, k, blocks, bias, r);
        });
      }
      continue;
    }
    // Three input rows at a time (24 sums: AVX-512's 32 registers), then two, then one.
    int64_t i = 0;
    for (; i + 3 <= n; i += 3) {
      WithTileRows<kInt4TileRows>(rows, [&](auto R) __attribute__((always_inline)) {
        Tile<R, 3>(y, x, i, m, k, blocks, bias, r);
      });
    }
    if (i + 2 <= n) {
      WithTileRows<kInt4TileRows>(rows, [&](auto R) __attribute__((always_inline)) {
        Tile<R, 2>(y, x, i, m, k, blocks, bias, r);
      });
      i += 2;
    }
    if (i < n) {
      WithTileRows<kInt4TileRows>(rows, [&](auto R) __attribute__((always_inline)) {
        Tile<R, 1>(y, x, i, m, k, blocks, bias, r);
      });
    }
  }
}

}  // namespace shardserve::cpu
