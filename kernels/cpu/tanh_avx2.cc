// The Sleef tanh loops of tanh_avx2.h: compiled with -mavx2 -mfma, so that sleef.h declares its
// 8-lane functions.
#include <immintrin.h>
#include <sleef.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/tanh_avx2.h"

namespace shardserve::cpu {

bool TanhHasAvx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

void GeluTanhMulAvx2(float* y, const float* g, const float* u, int64_t begin, int64_t end) {
  // PyTorch's GeluKernelImpl (aten/src/ATen/native/cpu/Activation.cpp, tanh branch, float32,
  // vectorized): x_cube = x * x * x; inner = kBeta * (x + kKappa * x_cube), x + kKappa * x_cube one
  // fused multiply-add as its release builds contract it; 0.5 * x * (1 + tanh(inner)).
  const __m256 beta = _mm256_set1_ps(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5));
  const __m256 kappa = _mm256_set1_ps(0.044715f);
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = begin; i < end; i += 8) {
    const int64_t lanes = std::min<int64_t>(8, end - i);
    alignas(32) float gx[8] = {}, ux[8] = {}, out[8];
    const float* gp = g + i;
    const float* up = u + i;
    if (lanes < 8) {
      std::memcpy(gx, g + i, static_cast<size_t>(lanes) * sizeof(float));
      std::memcpy(ux, u + i, static_cast<size_t>(lanes) * sizeof(float));
      gp = gx;
      up = ux;
    }
    const __m256 x = _mm256_loadu_ps(gp);
    const __m256 x_cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 inner = _mm256_mul_ps(beta, _mm256_fmadd_ps(kappa, x_cube, x));
    const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, Sleef_tanhf8_u10(inner)));
    const __m256 r = _mm256_mul_ps(gelu, _mm256_loadu_ps(up));  // transformers: act_fn(gate_proj(x)) * up_proj(x)
    if (lanes == 8) {
      _mm256_storeu_ps(y + i, r);
    } else {
      _mm256_store_ps(out, r);
      std::memcpy(y + i, out, static_cast<size_t>(lanes) * sizeof(float));
    }
  }
}

void SoftcapAvx2(float* x, int64_t n, float cap) {
  // Gemma2ForCausalLM and its eager attention: x = x / cap; x = torch.tanh(x); x = x * cap.
  const __m256 c = _mm256_set1_ps(cap);
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t lanes = std::min<int64_t>(8, n - i);
    alignas(32) float tail[8] = {};
    float* p = x + i;
    if (lanes < 8) {
      std::memcpy(tail, p, static_cast<size_t>(lanes) * sizeof(float));
      p = tail;
    }
    _mm256_storeu_ps(p, _mm256_mul_ps(Sleef_tanhf8_u10(_mm256_div_ps(_mm256_loadu_ps(p), c)), c));
    if (lanes < 8) std::memcpy(x + i, tail, static_cast<size_t>(lanes) * sizeof(float));
  }
}

}  // namespace shardserve::cpu
