// The AVX-512 instance of the int4 products' tiles (int4_matmul_tiles.h): the AVX2 instance's
// 8-lane code, compiled for AVX-512 (F, VL: 32 vector registers), which lets PlaneTile multiply two
// input rows per pass over each group's unpacked plane (kPairs), halving the plane's loads for
// prefills and batches. This file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mfma
// (kernels/CMakeLists.txt); Int4MatMul calls it only on CPUs that have them (quant_isa.h).
#include <immintrin.h>

#include "kernels/cpu/int4_matmul_tiles.h"

namespace shardserve::cpu {
namespace {

// As int4_matmul_avx2.cc's UnpackAvx2.
struct UnpackAvx512 {
  [[gnu::always_inline]] static inline void Load(const uint8_t* p, Vec8* lo, Vec8* hi) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    *lo = reinterpret_cast<Vec8>(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))));
    *hi = reinterpret_cast<Vec8>(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)));
  }
};

}  // namespace

void Int4ColumnsAvx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                       const float* bias, int64_t r0, int64_t r1) {
  Columns<UnpackAvx512, /*kPairs=*/true>(y, x, n, m, k, blocks, bias, r0, r1);
}

}  // namespace shardserve::cpu
