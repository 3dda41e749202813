// The AVX2 + FMA instances of the one-byte-weight products' tiles (int8_matmul_tiles.h): int8 and
// fp8 e4m3. This file alone is compiled with -mavx2 -mfma (kernels/CMakeLists.txt), and
// int8_matmul.cc calls it only on CPUs that have both.
#include <immintrin.h>

#include "kernels/cpu/int8_matmul_tiles.h"

namespace shardserve::cpu {
namespace {

// 8 int8 weights as floats: sign-extend to int32, convert (exact for every int8).
struct WidenInt8Avx2 {
  using V = Vec8;
  [[gnu::always_inline]] static inline V Load(const uint8_t* p) {
    return reinterpret_cast<V>(
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
  }
};

// 8 e4m3 bytes as floats, in registers: sign-extend each byte to int32 and shift it left by 20, so
// that the sign lands in bit 31 (with copies in 30..27, masked off) and the 7 bits of exponent and
// mantissa in bits 26..20: a float32 whose exponent field is e4m3's and whose mantissa starts with
// e4m3's 3 bits. That float is the e4m3 value x 2^-120 (exponent bias 127 against 7), subnormals
// included (e4m3's exponent 0 lands in float32's subnormals, which scale the same way: this
// assumes MXCSR's denormals-are-zero is off, the default, which nothing in shardserve changes);
// one multiply by 2^120 gives the exact value. NaN codes (0x7F, 0xFF) read as +-480.
struct WidenFp8Avx2 {
  using V = Vec8;
  [[gnu::always_inline]] static inline V Load(const uint8_t* p) {
    const __m256i s = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(s, 20), _mm256_set1_epi32(static_cast<int>(0x87F00000u)));
    return reinterpret_cast<V>(_mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f)));
  }
};

}  // namespace

void Int8ColumnsAvx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q, const float* scale,
                     const float* bias, int64_t r0, int64_t r1) {
  Columns<WidenInt8Avx2>(y, x, n, m, k, q, scale, bias, r0, r1);
}

void Fp8ColumnsAvx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q, const float* scale,
                    const float* bias, int64_t r0, int64_t r1) {
  Columns<WidenFp8Avx2>(y, x, n, m, k, q, scale, bias, r0, r1);
}

void Fp8GroupColumnsAvx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q,
                         const float* scale, int64_t group, const float* bias, int64_t r0, int64_t r1) {
  Columns<WidenFp8Avx2, false, true>(y, x, n, m, k, q, scale, bias, r0, r1, group);
}

}  // namespace shardserve::cpu
