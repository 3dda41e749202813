// The AVX2 instance of the int4 products on int8-rounded activations (int4_matmul_tiles.h's
// Int4MatMulAct8Avx2, QuantIsa::kAvx2Int8), as llama.cpp's AVX2 Q4_0 x Q8_0 product: the input rows
// quantized to int8 in blocks of 128 (activation_rows.h), and per group of 128 weights
//   dot = sum_j (q_j - z) xq_j,   y[i][r] = sx[i] x sum_g s[r][g] x dot[r][g]
// with dot an exact integer, as the VNNI instance's (int4_matmul_vnni.cc). The 4-bit values go into
// VPMADDUBSW as they are (unsigned, <= 15) against the signed activations: each int16 lane sums 2
// products, four such (the group's four 32-byte quarters) add to a lane of 8 products, and the zero
// point comes off per lane as z x (the lane's 8 activations' sum: XSums, made once per group and
// input row by VPMADDUBSW against ones). Every int16 lane then holds sum (q - z) xq over 8 values,
// |.| <= 8 x 16 x 127 < 2^15 (z <= 16: a GPTQ v1 checkpoint's, kernels/quant.h), and the intermediate
// int16 sums wrap harmlessly. VPMADDWD by ones widens to int32, which is converted and scaled by the
// group's scale into 8 float lanes; one lane sum at the end. The float32 additions are in another
// order than the VNNI instance's (8 lanes, not 16): the results differ by float32 rounding.
// One weight row at a time (act8_tiles.h's ForEachAct8Row), up to 4 input rows a pass.
// This file alone is compiled with -mavx2 -mfma (kernels/CMakeLists.txt); Int4MatMul calls it only
// when asked for QuantIsa::kAvx2Int8 on a CPU that has AVX2.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/act8_tiles.h"
#include "kernels/cpu/activation_rows.h"
#include "kernels/cpu/int4_matmul_tiles.h"

namespace shardserve::cpu {
namespace {

constexpr int kMaxInputs = 4;

inline __m256i Load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline float SumLanes(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Per input row and group, int16 lane l = the sum of the group's four 32-value quarters' bytes 2l and
// 2l + 1: the activations each lane of the products below meets.
void XSums(std::vector<int16_t>* out, const ActivationRows& xq, int64_t n) {
  out->resize(static_cast<size_t>(n * xq.blocks * 16));
  const __m256i ones8 = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < n * xq.blocks; ++b) {
    const int8_t* v = xq.values.data() + b * kInt4GroupSize;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out->data() + b * 16), _mm256_add_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(ones8, Load(v)), _mm256_maddubs_epi16(ones8, Load(v + 32))),
        _mm256_add_epi16(_mm256_maddubs_epi16(ones8, Load(v + 64)), _mm256_maddubs_epi16(ones8, Load(v + 96)))));
  }
}

// y[i .. i+I) x column r.
template <int I>
inline void Row(float* y, const ActivationRows& xq, const int16_t* xs, int64_t i, int64_t m, int64_t k,
                const Int4Group128* blocks, const float* bias, int64_t r) {
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  const Int4Group128* row = blocks + r * groups;
  __m256 acc[I];
  for (int a = 0; a < I; ++a) acc[a] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const Int4Group128& block = row[g];
    // A hint (changes no result): the bytes kPrefetchBytes on, in address order (act8_tiles.h).
    PrefetchInt4Group(reinterpret_cast<const Int4Group128*>(reinterpret_cast<const char*>(&block) + kPrefetchBytes));
    // Byte j: value j in its low nibble, value j + 64 in its high one (kernels/quant.h). A short
    // last group's unused nibbles are 0, against activations padded with 0.
    const __m256i b0 = Load(block.q), b1 = Load(block.q + 32);
    const __m256i q0 = _mm256_and_si256(b0, low);                         // values [0, 32)
    const __m256i q1 = _mm256_and_si256(b1, low);                         // [32, 64)
    const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(b0, 4), low);  // [64, 96)
    const __m256i q3 = _mm256_and_si256(_mm256_srli_epi16(b1, 4), low);  // [96, 128)
    const __m256i z = _mm256_set1_epi16(block.zero);
    const __m256 s = _mm256_set1_ps(block.scale);
    for (int a = 0; a < I; ++a) {
      const int8_t* xv = xq.values.data() + ((i + a) * xq.blocks + g) * kInt4GroupSize;
      const __m256i qx = _mm256_add_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(q0, Load(xv)), _mm256_maddubs_epi16(q1, Load(xv + 32))),
          _mm256_add_epi16(_mm256_maddubs_epi16(q2, Load(xv + 64)), _mm256_maddubs_epi16(q3, Load(xv + 96))));
      const __m256i zx = _mm256_mullo_epi16(z, Load(xs + ((i + a) * xq.blocks + g) * 16));
      const __m256i dot = _mm256_madd_epi16(_mm256_sub_epi16(qx, zx), ones16);
      acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[a]);
    }
  }
  for (int a = 0; a < I; ++a) {
    y[(i + a) * m + r] = Act8Output(SumLanes(acc[a]), xq.scale[i + a], bias, r);
  }
}

}  // namespace

void Int4MatMulAct8Avx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                        const float* bias, int threads) {
  // The calling thread's scratch, reused (no allocation per step once grown).
  thread_local ActivationRows xq;
  thread_local std::vector<int16_t> xs;
  QuantizeActivationRows(&xq, x, n, k, kInt4GroupSize, QuantIsa::kAvx2Int8);
  XSums(&xs, xq, n);
  const ActivationRows& rows_q = xq;
  const int16_t* sums = xs.data();
  ForEachAct8Row<kMaxInputs>(n, m, threads, [&](auto I, int64_t i, int64_t r) __attribute__((always_inline)) {
    Row<I()>(y, rows_q, sums, i, m, k, blocks, bias, r);
  });
}

}  // namespace shardserve::cpu
