// The AVX-512 instance of the int4 products' tiles (int4_matmul_tiles.h): the AVX2 instance's
// 8-lane code, compiled for AVX-512 (F, VL: 32 vector registers), which lets PlaneTile multiply two
// input rows per pass over each group's unpacked plane (kPairs), halving the plane's loads for
// prefills and batches. This file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mfma
// (kernels/CMakeLists.txt); Int4MatMul calls it only on CPUs that have them (quant_isa.h).
#include "kernels/cpu/int4_matmul_tiles.h"

namespace shardserve::cpu {

void Int4ColumnsAvx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                       const float* bias, int64_t r0, int64_t r1) {
  Columns<UnpackAvx2, /*kPairs=*/true>(y, x, n, m, k, blocks, bias, r0, r1);
}

}  // namespace shardserve::cpu
