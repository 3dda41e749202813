// The CPU backend's products by one-byte weights with one float32 scale per output channel:
// int8 and fp8 e4m3 (kernels/quant.h Int8RowsLayout, Fp8RowsLayout). The weight is read once per
// step as bytes (a quarter of float32's traffic), each value widened to float32 in registers
// (exactly: int8 by conversion, e4m3 by moving its bits into float32's), summed in float32 and
// scaled once per output. Instances for baseline x86-64, AVX2 + FMA (8 lanes) and AVX-512 (16
// lanes), picked by quant_isa.h's ActiveQuantIsa unless the caller names one; for int8 also
// AVX-512 VNNI (activations quantized to int8, integer dot products: inexact, only when named).
// On AVX2 and AVX-512 CPUs the backend stores int8 as panels instead, and fp8 on AVX-512 ones
// (panel_matmul.h PanelMatMulInt8 / PanelMatMulFp8 / PanelMatMulFp8Groups, quant_isa.h IntOnPanels,
// Fp8OnPanels); there
// int8's rows run only under --activation-quantization int8 (its integer instances), and every
// instance in bench_matmul.
//
// Each output y[i][r] is one fixed sequence of operations over k (the lanes, then the lanes summed
// in a fixed order), whatever the other rows of x, so a sequence's results do not depend on what
// else shares its step (as panel_matmul.h's products); they do depend on the instance.
//
// Thread-safety: pure functions of their arguments; each runs `threads` OpenMP threads of its own.
#ifndef SHARDSERVE_KERNELS_CPU_INT8_MATMUL_H_
#define SHARDSERVE_KERNELS_CPU_INT8_MATMUL_H_

#include <cstdint>

#include "kernels/cpu/quant_isa.h"

namespace shardserve::cpu {

// y [n, m] = x [n, k] @ (q [m, k] x scale [m] per row)^T (+ bias [m], may be null), on `threads`
// OpenMP threads (<= 0: OpenMP's default), with `isa`'s instance (which the CPU must support).
void Int8MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                const float* bias, int threads, QuantIsa isa = ActiveQuantIsa());
// The same with q [m, k] e4m3 bytes (kernels/quant.h Fp8E4m3ToFloat; NaN codes, which the
// quantizer never makes, read as +-480).
void Fp8MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q, const float* scale,
               const float* bias, int threads, QuantIsa isa = ActiveQuantIsa());
// The same with input-group scales (kernels/quant.h Fp8RowsLayout with `group` > 0, an FP8
// checkpoint's block scales): scale [m, G], G = ceil(k / group), w[r][c] = e4m3(q[r][c]) x
// scale[r][c / group]. Each widened weight vector is multiplied by its inputs' scales before it is
// summed, which gives the sums DequantizeFp8Groups' weights bit for bit (the rows' chains of
// Fp8MatMul otherwise); any group >= 1 is correct, multiples of the instance's lanes (8, or 16 on
// AVX-512) take one broadcast scale a vector, others a lane-by-lane one where a vector spans two
// groups (loaders map multiples of kFp8GroupMultiple = 8 only).
void Fp8GroupMatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q, const float* scale,
                    int64_t group, const float* bias, int threads, QuantIsa isa = ActiveQuantIsa());

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_INT8_MATMUL_H_
