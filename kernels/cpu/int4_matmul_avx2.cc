// The AVX2 + FMA instance of the int4 products' tiles (int4_matmul_tiles.h); this file alone is
// compiled with -mavx2 -mfma (kernels/CMakeLists.txt), and Int4MatMul calls it only on CPUs that
// have both.
#include <immintrin.h>

#include "kernels/cpu/int4_matmul_tiles.h"

namespace shardserve::cpu {
namespace {

// 8 packed bytes as 16 floats: zero-extend each byte to int32, then its low nibble and its high
// nibble (a shift: the byte is below 256), each converted exactly.
struct UnpackAvx2 {
  [[gnu::always_inline]] static inline void Load(const uint8_t* p, Vec8* lo, Vec8* hi) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    *lo = reinterpret_cast<Vec8>(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))));
    *hi = reinterpret_cast<Vec8>(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)));
  }
};

}  // namespace

void Int4ColumnsAvx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                     const float* bias, int64_t r0, int64_t r1) {
  Columns<UnpackAvx2>(y, x, n, m, k, blocks, bias, r0, r1);
}

}  // namespace shardserve::cpu
