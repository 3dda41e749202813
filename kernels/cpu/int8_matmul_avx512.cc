// The AVX-512 instances of the one-byte-weight products' tiles (int8_matmul_tiles.h): int8 and fp8
// e4m3, 16 lanes (the same conversions as int8_matmul_avx2.cc's, twice as wide). This file alone
// is compiled with -mavx512f -mavx512bw -mavx512vl -mfma (kernels/CMakeLists.txt), and
// int8_matmul.cc calls it only on CPUs that have them (quant_isa.h).
#include <immintrin.h>

#include "kernels/cpu/int8_matmul_tiles.h"

namespace shardserve::cpu {
namespace {

using Vec16 = float __attribute__((vector_size(64)));

struct WidenInt8Avx512 {
  using V = Vec16;
  [[gnu::always_inline]] static inline V Load(const uint8_t* p) {
    return reinterpret_cast<V>(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
  }
};

// As int8_matmul_avx2.cc's WidenFp8Avx2 (the bits of e4m3 shifted into float32's, x 2^120).
struct WidenFp8Avx512 {
  using V = Vec16;
  [[gnu::always_inline]] static inline V Load(const uint8_t* p) {
    const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(s, 20), _mm512_set1_epi32(static_cast<int>(0x87F00000u)));
    return reinterpret_cast<V>(_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f)));
  }
};

}  // namespace

void Int8ColumnsAvx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q,
                       const float* scale, const float* bias, int64_t r0, int64_t r1) {
  Columns<WidenInt8Avx512, true>(y, x, n, m, k, q, scale, bias, r0, r1);
}

void Fp8ColumnsAvx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q,
                      const float* scale, const float* bias, int64_t r0, int64_t r1) {
  Columns<WidenFp8Avx512, true>(y, x, n, m, k, q, scale, bias, r0, r1);
}

void Fp8GroupColumnsAvx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q,
                           const float* scale, int64_t group, const float* bias, int64_t r0, int64_t r1) {
  Columns<WidenFp8Avx512, true, true>(y, x, n, m, k, q, scale, bias, r0, r1, group);
}

}  // namespace shardserve::cpu
