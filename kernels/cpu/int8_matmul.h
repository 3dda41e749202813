// The CPU backend's products by int8 weights (kernels/quant.h's per-channel layout): the weight is
// read once per step as bytes (a quarter of float32's traffic), each value widened to float32 in
// registers, summed in float32 and scaled once per output.
//
// Each output y[i][r] is one fixed sequence of operations over k (8 lanes, then the lanes summed
// in a fixed order), whatever the other rows of x, so a sequence's results do not depend on what
// else shares its step (as panel_matmul.h's products).
#ifndef SHARDSERVE_KERNELS_CPU_INT8_MATMUL_H_
#define SHARDSERVE_KERNELS_CPU_INT8_MATMUL_H_

#include <cstdint>

namespace shardserve::cpu {

// y [n, m] = x [n, k] @ (q [m, k] x scale [m] per row)^T (+ bias [m], may be null), on `threads`
// OpenMP threads (<= 0: OpenMP's default).
void Int8MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                const float* bias, int threads);

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_INT8_MATMUL_H_
