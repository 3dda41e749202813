// The AVX2 + FMA instance of the int8 products' tiles (int8_matmul_tiles.h); this file alone is
// compiled with -mavx2 -mfma (kernels/CMakeLists.txt), and Int8MatMul calls it only on CPUs that
// have both.
#include <immintrin.h>

#include "kernels/cpu/int8_matmul_tiles.h"

namespace shardserve::cpu {
namespace {

// 8 int8 weights as floats: sign-extend to int32, convert (exact for every int8).
struct WidenAvx2 {
  [[gnu::always_inline]] static inline Vec8 Load(const int8_t* p) {
    return reinterpret_cast<Vec8>(
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
  }
};

}  // namespace

void Int8ColumnsAvx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                     const float* bias, int64_t r0, int64_t r1) {
  Columns<WidenAvx2>(y, x, n, m, k, q, scale, bias, r0, r1);
}

}  // namespace shardserve::cpu
