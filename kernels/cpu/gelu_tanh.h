// GELU (tanh form) times up, the gated activation of GeGLU models (Gemma), as PyTorch computes it on
// float32 CPU tensors: its vectorized loop, whose tanh is Sleef's tanhf_u10 (the Sleef library,
// Debian's libsleef-dev, the same function PyTorch's Vectorized<float>::tanh calls).
//
// Thread-safety: pure functions of their arguments.
#ifndef SHARDSERVE_KERNELS_CPU_GELU_TANH_H_
#define SHARDSERVE_KERNELS_CPU_GELU_TANH_H_

#include <cstdint>

namespace shardserve::cpu {

// Whether the CPU has AVX2 and FMA, which GeluTanhMulAvx2 needs.
bool GeluTanhHasAvx2();

// y[i] = gelu_tanh(g[i]) * u[i] for i in [begin, end), 8 at a time (the tail padded to 8, so that
// every element takes the vectorized path, as transformers' [n, f] gate tensors do). Needs AVX2 + FMA.
void GeluTanhMulAvx2(float* y, const float* g, const float* u, int64_t begin, int64_t end);

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_GELU_TANH_H_
