// The AVX2 instance of the int8 products on int8-rounded activations (int8_matmul_tiles.h's
// Int8MatMulAct8Avx2, QuantIsa::kAvx2Int8): activations quantized to int8 per row
// (activation_rows.h), integer dot products against the int8 weights 32 bytes at a time, as
// llama.cpp's AVX2 Q8_0 product: VPMADDUBSW multiplies unsigned by signed bytes, so each weight goes
// in as |q| (VPABSB; -128 becomes 128, still a byte) and its activation as xq with q's sign
// (VPSIGNB: negated where q < 0, 0 where q = 0); a pair's sum |q| |xq| + ... <= 2 x 128 x 127 fits the
// int16 lanes unsaturated, and VPMADDWD by ones widens pairs of them to int32. The int32 sum is
// sum q xq exactly (|sum| <= 128 x 127 x k < 2^31 for k < 130,000), then scaled as the VNNI
// instance scales it (int8_matmul_vnni.cc): the same float32 result bit for bit.
// One weight row at a time (act8_tiles.h's ForEachAct8Row), up to 4 input rows a pass.
// This file alone is compiled with -mavx2 -mfma (kernels/CMakeLists.txt); Int8MatMul calls it only
// when asked for QuantIsa::kAvx2Int8 on a CPU that has AVX2.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/act8_tiles.h"
#include "kernels/cpu/activation_rows.h"
#include "kernels/cpu/int8_matmul_tiles.h"

namespace shardserve::cpu {
namespace {

constexpr int64_t kChunk = 32;  // int8 values per ymm register
constexpr int64_t kBlock = 64;  // the activations' block (as the VNNI instance's: the same rows)
constexpr int kMaxInputs = 4;

inline int32_t SumLanes(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

// y[i .. i+I) x column r. Whole 32-byte chunks straight from the weight row; a last partial one
// (k % 32 bytes) copied into a zeroed chunk first (its activations are zero-padded anyway, but a load
// past the row's end could leave the buffer).
template <int I>
inline void Row(float* y, const ActivationRows& xq, int64_t i, int64_t m, int64_t k, const int8_t* q,
                const float* scale, const float* bias, int64_t r) {
  __m256i acc[I];
  for (int a = 0; a < I; ++a) acc[a] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t width = xq.blocks * kBlock;
  const int8_t* row = q + r * k;
  const auto chunk = [&](int64_t c, const int8_t* weights) __attribute__((always_inline)) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights));
    const __m256i aw = _mm256_abs_epi8(w);
    for (int a = 0; a < I; ++a) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.values.data() + (i + a) * width + c));
      acc[a] = _mm256_add_epi32(acc[a], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones));
    }
  };
  const int64_t whole = k / kChunk;
  for (int64_t c = 0; c < whole; ++c) {
    // A hint (changes no result): the bytes kPrefetchBytes on, in address order (act8_tiles.h).
    if (c % 2 == 0) __builtin_prefetch(row + c * kChunk + kPrefetchBytes, 0, 3);
    chunk(c * kChunk, row + c * kChunk);
  }
  if (whole * kChunk < k) {
    alignas(32) int8_t tail[kChunk] = {};
    std::memcpy(tail, row + whole * kChunk, static_cast<size_t>(k - whole * kChunk));
    chunk(whole * kChunk, tail);
  }
  for (int a = 0; a < I; ++a) {
    const int32_t dot = SumLanes(acc[a]);
    y[(i + a) * m + r] = Act8Output(static_cast<float>(dot), xq.scale[i + a] * scale[r], bias, r);
  }
}

}  // namespace

void Int8MatMulAct8Avx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                        const float* bias, int threads) {
  thread_local ActivationRows xq;  // the calling thread's scratch, reused (no allocation per step once grown)
  QuantizeActivationRows(&xq, x, n, k, kBlock, QuantIsa::kAvx2Int8);
  const ActivationRows& rows_q = xq;
  ForEachAct8Row<kMaxInputs>(n, m, threads, [&](auto I, int64_t i, int64_t r) __attribute__((always_inline)) {
    Row<I()>(y, rows_q, i, m, k, q, scale, bias, r);
  });
}

}  // namespace shardserve::cpu
