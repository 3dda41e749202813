// The AVX-512 VNNI instance of the int4 products (int4_matmul_tiles.h's Int4MatMulVnni): the input
// rows quantized to int8 (activation_rows.h), each group's 4-bit values less its zero point
// multiplied against them as integers, 64 at a time (VPDPBUSD), then scaled per group in float32:
//   y[i][r] = sx[i] x sum_g s[r][g] x sum_j (q_j - z[r][g]) xq_j.
// VPDPBUSD multiplies unsigned by signed bytes: the activations go in as xq + 128 (unsigned) and the
// weights as q - z (signed, in [-15, 15]), and each group's sum starts from -128 x sum_j (q_j - z),
// so that the int32 sum is sum_j (q_j - z) xq_j exactly (|(q - z)(xq + 128)| x 128 < 2^19).
// Inexact as the int8 VNNI product (the activations' rounding), so only when asked for
// (QuantIsa::kAvx512Vnni). Tiles as act8_tiles.h's (up to 4 weight x 4 input rows: each weight
// group unpacked once per 4 input rows; 8 x 1 for a lone input row). Per group and pair of rows
// the work is two VPDPBUSD, one conversion and one FMA.
// This file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni
// (kernels/CMakeLists.txt); Int4MatMul calls it only on CPUs that have them.
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

#include "kernels/cpu/activation_rows.h"
#include "kernels/cpu/int4_matmul_tiles.h"
#include "kernels/cpu/act8_tiles.h"

namespace shardserve::cpu {
namespace {

// Tiles of up to 4 weight x 4 input rows (act8_tiles.h): 16 sums of AVX-512's 32 registers.
constexpr int kMaxInputs = 4, kRowsWithInputs = 4;
constexpr int64_t kHalf = kInt4GroupSize / 2;  // 64: one zmm of bytes, the low (or high) nibbles of a block

// y[i .. i+I) x columns [r, r+R): per group, the int32 dot products in 16 lanes, converted and
// scaled by the group's scale into float32 lanes; one lane sum at the end.
template <int R, int I>
inline void Tile(float* y, const ActivationRows& xq, int64_t i, int64_t m, int64_t k, const Int4Group128* blocks,
                 const float* bias, int64_t r) {
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  __m512 acc[I][R];
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) acc[a][b] = _mm512_setzero_ps();
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // xq + 128, and the 128 of the start
  for (int64_t g = 0; g < groups; ++g) {
    __m512i xlo[I], xhi[I];
    for (int a = 0; a < I; ++a) {
      const int8_t* row = xq.values.data() + ((i + a) * xq.blocks + g) * kInt4GroupSize;
      xlo[a] = _mm512_xor_si512(_mm512_loadu_si512(row), flip);
      xhi[a] = _mm512_xor_si512(_mm512_loadu_si512(row + kHalf), flip);
    }
    for (int b = 0; b < R; ++b) {
      const Int4Group128& block = blocks[(r + b) * groups + g];
      // Byte j: value j in its low nibble, value j + 64 in its high one (kernels/quant.h). A short
      // last group's unused nibbles are 0: as q - z = -z against xq + 128 = 128 (the activations'
      // zero padding) they add -128 z, which the start takes away again.
      // The same group kPrefetchRows rows on (column_tiles.h; the last row's near the end).
      PrefetchInt4Group(blocks + PrefetchRow(r + b, m) * groups + g);
      const __m512i bytes = _mm512_loadu_si512(block.q);
      const __m512i z = _mm512_set1_epi8(static_cast<char>(block.zero));
      const __m512i qlo = _mm512_sub_epi8(_mm512_and_si512(bytes, low), z);
      const __m512i qhi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low), z);
      const __m512i start =
          _mm512_sub_epi32(_mm512_setzero_si512(),
                           _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, qlo), flip, qhi));
      const __m512 s = _mm512_set1_ps(block.scale);
      for (int a = 0; a < I; ++a) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, xlo[a], qlo), xhi[a], qhi);
        acc[a][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[a][b]);
      }
    }
  }
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) {
      y[(i + a) * m + r + b] = Act8Output(_mm512_reduce_add_ps(acc[a][b]), xq.scale[i + a], bias, r + b);
    }
  }
}

}  // namespace

void Int4MatMulVnni(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                    const float* bias, int threads) {
  thread_local ActivationRows xq;  // the calling thread's scratch, reused (no allocation per step once grown)
  QuantizeActivationRows(&xq, x, n, k, kInt4GroupSize, QuantIsa::kAvx512Vnni);
  const ActivationRows& rows_q = xq;
  ForEachAct8Tile<kMaxInputs, kRowsWithInputs>(n, m, threads, [&](auto R, auto I, int64_t i, int64_t r) __attribute__((always_inline)) {
    Tile<R(), I()>(y, rows_q, i, m, k, blocks, bias, r);
  });
}

}  // namespace shardserve::cpu
