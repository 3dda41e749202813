#include "kernels/cpu/int8_matmul.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/int8_matmul_tiles.h"

namespace shardserve::cpu {
namespace {

using Vec8i8 = int8_t __attribute__((vector_size(8)));

// How 8 int8 weights become 8 floats without AVX2. (GCC 12 makes this eight scalar conversions,
// about 5x slower than AVX2's two instructions in int8_matmul_avx2.cc; both give the exact value of
// each int8, so the choice changes speed, not results.)
struct WidenPortable {
  [[gnu::always_inline]] static inline Vec8 Load(const int8_t* p) {
    Vec8i8 v;
    std::memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, Vec8);
  }
};

}  // namespace

void Int8ColumnsPortable(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q,
                         const float* scale, const float* bias, int64_t r0, int64_t r1) {
  Columns<WidenPortable>(y, x, n, m, k, q, scale, bias, r0, r1);
}

void Int8MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                const float* bias, int threads) {
  // The instance for this CPU: fixed per machine, so a result is too.
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  // Columns in whole tiles per thread, so that every output is computed by the same tile code.
  const int64_t tiles = (m + kInt8TileRows - 1) / kInt8TileRows;
  const int nthreads = threads > 0 ? threads : omp_get_max_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(nthreads, tiles));
#pragma omp parallel for num_threads(static_cast<int>(parts)) schedule(static)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t r0 = tiles * p / parts * kInt8TileRows, r1 = std::min(m, tiles * (p + 1) / parts * kInt8TileRows);
    if (r0 < r1) (avx2 ? Int8ColumnsAvx2 : Int8ColumnsPortable)(y, x, n, m, k, q, scale, bias, r0, r1);
  }
}

}  // namespace shardserve::cpu
