// The AVX-512 VNNI instance of the int8 products (int8_matmul.h's Int8MatMulVnni): activations
// quantized to int8 per row, integer dot products (VPDPBUSD) against the int8 weights. This file
// alone is compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni (kernels/CMakeLists.txt);
// Int8MatMul calls it only when asked for QuantIsa::kAvx512Vnni on a CPU that has it. Tiles as
// act8_tiles.h's: up to 4 weight x 4 input rows (each weight chunk loaded and offset once per 4
// input rows), 8 x 1 for a lone input row.
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/activation_rows.h"
#include "kernels/cpu/int8_matmul.h"
#include "kernels/cpu/act8_tiles.h"

namespace shardserve::cpu {
namespace {

// Tiles of up to 4 weight x 4 input rows (act8_tiles.h): 16 sums of AVX-512's 32 registers.
constexpr int kMaxInputs = 4, kRowsWithInputs = 4;
constexpr int64_t kChunk = 64;  // int8 values per zmm register

// The weights go in as q + 128 (q XOR 0x80) against the activations' signed bytes
// (activation_rows.h): every int8 weight, -128 included (a published checkpoint's codes,
// kernels/quant.h), then has an unsigned byte, and sum (q + 128) xq - 128 sum xq = sum q xq exactly.
// (int32 holds sum (q + 128) xq <= 255 x 127 x k for k < 66,000 inputs; the largest models' are < 30,000.)

// y[i .. i+I) x columns [r, r+R) as exact int32 dot products, then scaled. Whole 64-byte chunks
// with plain loads, a last partial one with masked loads (the weights' tail bytes read as 0, which
// become 128 against x's zero padding).
template <int R, int I>
inline void Tile(float* y, const ActivationRows& xq, int64_t i, int64_t m, int64_t k, const int8_t* q,
                 const float* scale, const float* bias, int64_t r) {
  __m512i acc[I][R];
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) acc[a][b] = _mm512_setzero_si512();
  }
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  const auto chunk = [&](int64_t c, __mmask64 load) {
    __m512i xv[I];
    for (int a = 0; a < I; ++a) xv[a] = _mm512_loadu_si512(xq.values.data() + ((i + a) * xq.blocks + c) * kChunk);
    for (int b = 0; b < R; ++b) {
      // q + 128 as unsigned bytes.
      const int8_t* row = q + (r + b) * k + c * kChunk;
      // The same chunk kPrefetchRows rows on (column_tiles.h; the last row's near the end).
      __builtin_prefetch(q + PrefetchRow(r + b, m) * k + c * kChunk, 0, 3);
      const __m512i w = _mm512_xor_si512(
          load == ~__mmask64{0} ? _mm512_loadu_si512(row) : _mm512_maskz_loadu_epi8(load, row), offset);
      for (int a = 0; a < I; ++a) acc[a][b] = _mm512_dpbusd_epi32(acc[a][b], w, xv[a]);
    }
  };
  const int64_t whole = k / kChunk;
  for (int64_t c = 0; c < whole; ++c) chunk(c, ~__mmask64{0});
  if (whole < xq.blocks) chunk(whole, (__mmask64{1} << (k - whole * kChunk)) - 1);
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) {
      const int32_t dot = _mm512_reduce_add_epi32(acc[a][b]) - 128 * xq.sum[i + a];
      y[(i + a) * m + r + b] = Act8Output(static_cast<float>(dot), xq.scale[i + a] * scale[r + b], bias, r + b);
    }
  }
}

}  // namespace

void Int8MatMulVnni(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                    const float* bias, int threads) {
  thread_local ActivationRows xq;  // the calling thread's scratch, reused (no allocation per step once grown)
  QuantizeActivationRows(&xq, x, n, k, kChunk, QuantIsa::kAvx512Vnni);
  const ActivationRows& rows_q = xq;
  ForEachAct8Tile<kMaxInputs, kRowsWithInputs>(n, m, threads, [&](auto R, auto I, int64_t i, int64_t r) __attribute__((always_inline)) {
    Tile<R(), I()>(y, rows_q, i, m, k, q, scale, bias, r);
  });
}

}  // namespace shardserve::cpu
