// The AVX-512 VNNI instance of the int4 products (int4_matmul_tiles.h's Int4MatMulVnni): the input
// rows quantized to int8 (activation_rows.h), each group's 4-bit values multiplied against them as
// integers, 64 at a time (VPDPBUSD: the unsigned nibbles times the signed activations, summed in
// int32, exact), then scaled per group in float32:
//   y[i][r] = sx[i] x sum_g s[r][g] x (sum_j q_j xq_j - z[r][g] x sum_j xq_j).
// Inexact as the int8 VNNI product (the activations' rounding), so only when asked for
// (QuantIsa::kAvx512Vnni). Its gain is in decode: a group's 128 weights take one 64-byte load, a
// shift, two masks and two VPDPBUSD, against the float instances' 16 conversions and 16 FMAs.
// This file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni
// (kernels/CMakeLists.txt); Int4MatMul calls it only on CPUs that have them.
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

#include "kernels/cpu/activation_rows.h"
#include "kernels/cpu/column_tiles.h"
#include "kernels/cpu/int4_matmul_tiles.h"
#include "kernels/cpu/tile_rows.h"

namespace shardserve::cpu {
namespace {

constexpr int64_t kHalf = kInt4GroupSize / 2;  // 64: one zmm of bytes, the low (or high) nibbles of a block

// y[i .. i+I) x columns [r, r+R): per group, the int32 dot products in 16 lanes, converted and
// scaled by the group's scale into float32 lanes; the zero points' part (z x s x sum xq) summed
// apart; one lane sum at the end.
template <int R, int I>
inline void Tile(float* y, const ActivationRows& xq, int64_t i, int64_t m, int64_t k, const Int4Group128* blocks,
                 const float* bias, int64_t r) {
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  __m512 acc[I][R];
  float zero_part[I][R] = {};
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) acc[a][b] = _mm512_setzero_ps();
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i xlo[I], xhi[I];
    for (int a = 0; a < I; ++a) {
      const int8_t* row = xq.values.data() + ((i + a) * xq.blocks + g) * kInt4GroupSize;
      xlo[a] = _mm512_loadu_si512(row);
      xhi[a] = _mm512_loadu_si512(row + kHalf);
    }
    for (int b = 0; b < R; ++b) {
      const Int4Group128& block = blocks[(r + b) * groups + g];
      // Byte j: value j in its low nibble, value j + 64 in its high one (kernels/quant.h). A short
      // last group's unused nibbles are 0 and meet the activations' zero padding.
      const __m512i bytes = _mm512_loadu_si512(block.q);
      const __m512i qlo = _mm512_and_si512(bytes, low);
      const __m512i qhi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      const __m512 s = _mm512_set1_ps(block.scale);
      for (int a = 0; a < I; ++a) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qlo, xlo[a]), qhi, xhi[a]);
        acc[a][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[a][b]);
        zero_part[a][b] += block.scale * static_cast<float>(block.zero * xq.block_sum[(i + a) * xq.blocks + g]);
      }
    }
  }
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) {
      const float v = (_mm512_reduce_add_ps(acc[a][b]) - zero_part[a][b]) * xq.scale[i + a];
      y[(i + a) * m + r + b] = bias != nullptr ? v + bias[r + b] : v;
    }
  }
}

template <int I>
inline void TileOf(int64_t rows, float* y, const ActivationRows& xq, int64_t i, int64_t m, int64_t k,
                   const Int4Group128* blocks, const float* bias, int64_t r) {
  WithTileRows<kInt4TileRows>(
      rows, [&](auto R) __attribute__((always_inline)) { Tile<R, I>(y, xq, i, m, k, blocks, bias, r); });
}

}  // namespace

void Int4MatMulVnni(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                    const float* bias, int threads) {
  thread_local ActivationRows xq;  // the calling thread's scratch, reused (no allocation per step once grown)
  QuantizeActivationRows(&xq, x, n, k, kInt4GroupSize);
  const ActivationRows& rows_q = xq;
  ForEachTile(
      n, m, kInt4TileRows, threads,
      [&](int64_t rows, int64_t i, int64_t r) { TileOf<2>(rows, y, rows_q, i, m, k, blocks, bias, r); },
      [&](int64_t rows, int64_t i, int64_t r) { TileOf<1>(rows, y, rows_q, i, m, k, blocks, bias, r); });
}

}  // namespace shardserve::cpu
