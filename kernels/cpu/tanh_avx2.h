// The CPU loops that compute tanh as PyTorch computes it on float32 CPU tensors: its vectorized
// loop, whose tanh is Sleef's tanhf_u10 (the Sleef library, Debian's libsleef-dev, the same
// function PyTorch's Vectorized<float>::tanh calls). GELU (tanh form) times up, the gated
// activation of GeGLU models (Gemma), and logit soft-capping (Gemma 2's final logits and
// attention scores). Each needs AVX2 + FMA; elementwise.cc and attention.cc fall back to a scalar
// tanh elsewhere.
//
// Thread-safety: pure functions of their arguments.
#ifndef SHARDSERVE_KERNELS_CPU_TANH_AVX2_H_
#define SHARDSERVE_KERNELS_CPU_TANH_AVX2_H_

#include <cstdint>

namespace shardserve::cpu {

// Whether the CPU has AVX2 and FMA, which the loops below need.
bool TanhHasAvx2();

// y[i] = gelu_tanh(g[i]) * u[i] for i in [begin, end), 8 at a time (the tail padded to 8, so that
// every element takes the vectorized path, as transformers' [n, f] gate tensors do).
void GeluTanhMulAvx2(float* y, const float* g, const float* u, int64_t begin, int64_t end);

// x[i] = tanh(x[i] / cap) * cap for i in [0, n), as Gemma 2 computes it in three tensor ops
// (a division, tanh, a product), 8 at a time, the tail padded to 8.
void SoftcapAvx2(float* x, int64_t n, float cap);

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_TANH_AVX2_H_
