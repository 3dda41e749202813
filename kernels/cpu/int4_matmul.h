// The CPU backend's products by int4 weights (kernels/quant.h's Int4Group128 blocks, groups of 128
// along the input): the packed bytes are read once per step (4.5 bits a weight: about a seventh of
// float32's traffic), each pair of nibbles unpacked to two 8-float vectors in registers and
// multiplied against the float32 input. Per group, the kernel sums x x q and x alone, then adds
// scale x (sum(x q) - zero x sum(x)) to the output's accumulator: the zero point costs one multiply
// per group, not one per weight.
//
// So do both exact instances, in 8 lanes: baseline x86-64 and AVX2. On CPUs with AVX2 (and
// AVX-512) the CPU backend does not multiply the blocks: it repacks them at load as panels of 16
// outputs and multiplies those (panel_matmul.h PanelMatMulInt4, quant_isa.h IntOnPanels), which
// serve many input rows per widened weight; the blocks' AVX2 instance stays for bench_matmul's
// side-by-side runs and CPUs' tests, and Int4MatMul runs it for kAvx512 too.
//
// Each output y[i][r] is one fixed sequence of operations over k whatever the other rows of x, so a
// sequence's results do not depend on what else shares its step (as int8_matmul.h's products).
//
// Thread-safety: a pure function of its arguments; it runs `threads` OpenMP threads of its own.
#ifndef SHARDSERVE_KERNELS_CPU_INT4_MATMUL_H_
#define SHARDSERVE_KERNELS_CPU_INT4_MATMUL_H_

#include <cstdint>

#include "kernels/cpu/quant_isa.h"
#include "kernels/quant.h"

namespace shardserve::cpu {

// y [n, m] = x [n, k] @ w^T (+ bias [m], may be null), w [m, k] stored as `blocks`
// [m, ceil(k / 128)] (Int4GroupsLayout), on `threads` OpenMP threads (<= 0: OpenMP's default),
// with `isa`'s instance (which the CPU must support; kAvx512 runs kAvx2's; kAvx512Vnni's multiplies
// int8-rounded activations in integers, inexact, int4_matmul_vnni.cc).
void Int4MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                const float* bias, int threads, QuantIsa isa = ActiveQuantIsa());

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_INT4_MATMUL_H_
