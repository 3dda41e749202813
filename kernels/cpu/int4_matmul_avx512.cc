// The AVX-512 instance of the exact int4 products (int4_matmul.h), 16 lanes wide. Each group's 16
// possible weight values, (j - zero) x scale for j in [0, 15] (DequantizeInt4Groups's, bit for
// bit: one multiply of a row of kZeroTable), sit in one register, and each nibble becomes its
// float by a lookup in it (VPERMPS reads only an index's low 4 bits, so the low nibbles need no
// mask; the high ones a shift): per 32 weights one zero-extending load, two lookups and one shift,
// where the 8-lane instances spend a load, a mask, a shift and two conversions per 16. Every
// output is then sum_j x_j w_j over the dequantized weights, in 16 lanes (lane l sums the inputs
// j = l mod 16, group by group, one FMA each: chunk c of the group's low half, then chunk c of
// its high half, c = 0 .. 3, "the group order"), the lanes added at the end: the
// dequantize-then-multiply reference in another order of additions (no per-group x q and x sums,
// so no cancellation between them), whatever the path:
//   - fewer than kPlaneMinRows input rows (decode, small batches): the weights looked up in
//     registers, for up to three input rows at a time;
//   - more: 4 weight rows looked up once, across the whole of k, into a plane of floats, then
//     multiplied by 6 input rows at a time, the 24 sums in registers from the first group to the last.
// Both paths run the same FMAs on the same values in the same order, so a row's result does not
// depend on the other rows of its batch (QuantMatMulRowsTest).
// This file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mfma (kernels/CMakeLists.txt);
// Int4MatMul calls it only on CPUs that have them (quant_isa.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/column_tiles.h"
#include "kernels/cpu/int4_matmul_tiles.h"
#include "kernels/cpu/tile_rows.h"

namespace shardserve::cpu {
namespace {

constexpr int64_t kHalf = kInt4GroupSize / 2;  // 64: the low nibbles' values, then the high ones'
constexpr int kChunks = kHalf / 16;            // 4 zmm of values per half group
// From this many input rows on, Int4ColumnsAvx512 looks each weight row up once, across the whole
// of k, into a plane of floats (FillPlane, kPlaneWeightRows rows at a time: 4 x k floats, in L1 or
// L2), and multiplies it by kPlaneInputRows input rows at a time with every sum in a register
// (PlaneTile: 24 sums, 4 weight chunks and 1 input chunk of the 32 zmm); below, up to three input
// rows share each lookup in registers (Tile). bench_matmul --threads 2 --layers 12 (the bench
// model's 75.5M weights; AMD EPYC Zen 5, medians, ms; docs/benchmarks.md):
//   rows                        8      16      32      128
//   Tile (3 + 3 + 2)          4.36
//   this plane, 6 x 4         5.35    8.06   16.04    58.95
//   4 x 4 / 8 x 3 / 5 x 5             9.06 / 9.04 / 11.32 at 16; 17.19 / 18.16 / 21.21 at 32
//   the group-at-a-time plane (64 rows' sums on the stack, before)  10.54  17.66  64.33
constexpr int64_t kPlaneMinRows = 9;
constexpr int kPlaneWeightRows = 4, kPlaneInputRows = 6;

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

[[gnu::always_inline]] inline void Store(float* y, const float* bias, int64_t m, int64_t i, int64_t r, __m512 acc) {
  const float v = _mm512_reduce_add_ps(acc);
  y[i * m + r] = bias != nullptr ? v + bias[r] : v;
}

// One group g of Tile: I input rows x R weight rows, the weights looked up in registers, the
// inputs read from L1 as the FMAs need them (the group order, interleaved across the outputs).
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

// Weight rows [r, r + B) looked up, across the whole of k, into `plane` (row b at b x pitch, each
// group's 128 values in input order: the low nibbles' 64, then the high ones').
template <int B>
[[gnu::always_inline]] inline void FillPlane(float* plane, int64_t pitch, const Int4Group128* blocks, int64_t groups,
                                             int64_t m, int64_t r) {
  for (int b = 0; b < B; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      PrefetchInt4Group(blocks + PrefetchRow(r + b, m) * groups + g);
      const Int4Group128& block = blocks[(r + b) * groups + g];
      const __m512 values = GroupValues(block);
      float* out = plane + b * pitch + g * kInt4GroupSize;
      for (int c = 0; c < kChunks; ++c) {
        __m512 lo, hi;
        Lookup(block, c, values, &lo, &hi);
        _mm512_storeu_ps(out + 16 * c, lo);
        _mm512_storeu_ps(out + kHalf + 16 * c, hi);
      }
    }
  }
}

// One group g of PlaneTile: A input rows x B weight rows, chunk c of the low half then of the high
// one (the group order for every sum), each weight chunk loaded once for the A rows.
template <int B, int A, bool kFull>
[[gnu::always_inline]] inline void PlaneGroup(__m512 (&acc)[A][B], const float* x, int64_t i, int64_t k,
                                              const float* plane, int64_t pitch, int64_t g) {
  const int64_t size = std::min(kInt4GroupSize, k - g * kInt4GroupSize);
  const float* row = x + i * k + g * kInt4GroupSize;
  for (int c = 0; c < kChunks; ++c) {
    for (int half = 0; half < 2; ++half) {
      const int chunk = half * kChunks + c;
      __m512 w[B];
      for (int b = 0; b < B; ++b) w[b] = _mm512_loadu_ps(plane + b * pitch + g * kInt4GroupSize + 16 * chunk);
      for (int a = 0; a < A; ++a) {
        const __m512 xv = InputChunk<kFull>(row + a * k, chunk, size);
        for (int b = 0; b < B; ++b) acc[a][b] = _mm512_fmadd_ps(xv, w[b], acc[a][b]);
      }
    }
  }
}

// y[i .. i+A) x columns [r, r+B) from the looked-up plane: every sum in a register across the
// whole of k (A x B of them, B weight registers and one input register: 24 + 4 + 1 of the 32 at
// kPlaneInputRows x kPlaneWeightRows).
template <int B, int A>
[[gnu::always_inline]] inline void PlaneTile(float* y, const float* x, int64_t i, int64_t m, int64_t k,
                                             const float* plane, int64_t pitch, const float* bias, int64_t r) {
  const int64_t whole = k / kInt4GroupSize;
  __m512 acc[A][B];
  for (int a = 0; a < A; ++a) {
    for (int b = 0; b < B; ++b) acc[a][b] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < whole; ++g) PlaneGroup<B, A, true>(acc, x, i, k, plane, pitch, g);
  if (whole * kInt4GroupSize < k) PlaneGroup<B, A, false>(acc, x, i, k, plane, pitch, whole);
  for (int a = 0; a < A; ++a) {
    for (int b = 0; b < B; ++b) Store(y, bias, m, i + a, r + b, acc[a][b]);
  }
}

}  // namespace

void Int4ColumnsAvx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                       const float* bias, int64_t r0, int64_t r1) {
  if (n >= kPlaneMinRows) {
    const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
    const int64_t pitch = groups * kInt4GroupSize;
    thread_local std::vector<float> plane;  // the calling thread's, reused (grown once per shape)
    if (plane.size() < static_cast<size_t>(kPlaneWeightRows * pitch)) plane.resize(kPlaneWeightRows * pitch);
    for (int64_t r = r0; r < r1; r += kPlaneWeightRows) {
      const int64_t rows = std::min<int64_t>(kPlaneWeightRows, r1 - r);
      WithTileRows<kPlaneWeightRows>(rows, [&](auto B) __attribute__((always_inline)) {
        FillPlane<B()>(plane.data(), pitch, blocks, groups, m, r);
        int64_t i = 0;
        for (; i + kPlaneInputRows <= n; i += kPlaneInputRows) {
          PlaneTile<B(), kPlaneInputRows>(y, x, i, m, k, plane.data(), pitch, bias, r);
        }
        WithTileRows<kPlaneInputRows - 1>(n - i, [&](auto A) __attribute__((always_inline)) {
          PlaneTile<B(), A()>(y, x, i, m, k, plane.data(), pitch, bias, r);
        });
      });
    }
    return;
  }
  for (int64_t r = r0; r < r1; r += kInt4TileRows) {
    const int64_t rows = std::min<int64_t>(kInt4TileRows, r1 - r);
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
