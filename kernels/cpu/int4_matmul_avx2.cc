// The AVX2 + FMA instance of the int4 products' tiles (int4_matmul_tiles.h); this file alone is
// compiled with -mavx2 -mfma (kernels/CMakeLists.txt), and Int4MatMul calls it only on CPUs that
// have both.
#include "kernels/cpu/int4_matmul_tiles.h"

namespace shardserve::cpu {

void Int4ColumnsAvx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                     const float* bias, int64_t r0, int64_t r1) {
  Columns<UnpackAvx2>(y, x, n, m, k, blocks, bias, r0, r1);
}

}  // namespace shardserve::cpu
