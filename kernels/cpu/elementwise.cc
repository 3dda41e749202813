// The CPU backend's ops that touch each element (or each row) once: Embedding, RmsNorm, Rope,
// SiluMul, GeluTanhMul, Scale, Softcap and Add.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/tanh_avx2.h"

namespace shardserve::cpu {
namespace {

// y[i] = silu(g[i]) * u[i] for i in [begin, end): see CpuBackend::SiluMul.
SHARDSERVE_VECTOR_CLONES void SiluMulRange(float* y, const float* g, const float* u, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += kVecLanes) {
    const int64_t lanes = std::min(kVecLanes, end - i);
    const Vec8 gi = LoadVec(g + i, lanes);
    StoreVec(y + i, gi / (1.0f + ExpVec(-gi)) * LoadVec(u + i, lanes), lanes);
  }
}

// tanh(x) in float32 near PyTorch's CPU kernels on float32 tensors of 16 or more elements
// (Vectorized<float>::tanh, Sleef's tanhf_u10: what transformers' tanh GELU and Gemma 2's logit
// capping run into), for CPUs without AVX2 + FMA, where GELU and Softcap do not call Sleef
// themselves (tanh_avx2.h): tanh in double, rounded once, which Sleef's double-float evaluation equals but
// for an ulp on about 1 input in 10^4 (measured over 2 million points of [-12, 12]); and +-1 where
// |x| > 8.664339742, where Sleef stops evaluating (1 - tanh falls below an ulp of 1 there; rounded,
// tanh would still be 1 - 2^-24 up to |x| ~ 9.01, which GELU's 1 + tanh would turn into a
// non-zero output). NaN stays NaN.
inline float TanhAsPyTorch(float x) {
  if (std::fabs(x) > 8.664339742f) return std::copysign(1.0f, x);
  return static_cast<float>(std::tanh(static_cast<double>(x)));
}

// y[i] = gelu_tanh(g[i]) * u[i] for i in [begin, end): see CpuBackend::GeluTanhMul.
SHARDSERVE_VECTOR_CLONES void GeluTanhMulRange(float* y, const float* g, const float* u, int64_t begin, int64_t end) {
  // PyTorch's GeluKernelImpl (aten/src/ATen/native/cpu/Activation.cpp, tanh branch, float32):
  // x_cube = x * x * x; inner = kBeta * (x + kKappa * x_cube); 0.5 * x * (1 + tanh(inner)), with
  // kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 rounded to float. Its release builds contract
  // x + kKappa * x_cube into one fused multiply-add (4380 of 2 million outputs differ without it,
  // none with it, tanh aside), so the same here, explicitly.
  constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
  constexpr float kKappa = 0.044715f;
  for (int64_t i = begin; i < end; ++i) {
    const float x = g[i];
    const float x_cube = x * x * x;
    const float inner = kBeta * std::fma(kKappa, x_cube, x);
    const float gelu = 0.5f * x * (1.0f + TanhAsPyTorch(inner));
    y[i] = gelu * u[i];  // transformers: act_fn(gate_proj(x)) * up_proj(x)
  }
}

}  // namespace

absl::Status CpuBackend::Embedding(Tensor* out, const Tensor& table, const Tensor& ids, int64_t row_offset) {
  const ArgCheck check("Embedding", {{"out", out, kF32, 2}, {"table", &table, kF32, 2}, {"ids", &ids, kI32, 1}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t n = out->dim(0), d = out->dim(1), rows = table.dim(0);
  if (table.dim(1) != d || ids.dim(0) != n) return check.Error("want out [n, d], table [rows, d], ids [n]");
  if (row_offset < 0) return check.Error(absl::StrCat("row_offset ", row_offset, " is negative"));

  absl::StatusOr<const PackedWeight*> packed = FindPacked(table);
  if (!packed.ok()) return check.Error(packed.status().message());
  if (*packed != nullptr && ((*packed)->quant != WeightQuant::kNone || (*packed)->bf16())) {  // int8 panels are kInt8
    return check.Error("the table is a quantized or bf16 packed weight, which Embedding cannot read");
  }
  const int32_t* id = ids.as<int32_t>();
  for (int64_t t = 0; t < n; ++t) {
    float* dst = out->as<float>() + t * d;
    const int64_t row = static_cast<int64_t>(id[t]) - row_offset;  // row in this shard's slice
    if (row >= 0 && row < rows && *packed != nullptr) {
      // Float32 panels (panel_matmul.h): row r is column r % 16 of panel r / 16, one value per input step.
      const float* column = table.as<float>() + (row / kPanelCols) * d * kPanelCols + row % kPanelCols;
      for (int64_t kk = 0; kk < d; ++kk) dst[kk] = column[kk * kPanelCols];
    } else if (row >= 0 && row < rows) {
      std::memcpy(dst, table.as<float>() + row * d, static_cast<size_t>(d) * sizeof(float));
    } else {
      std::fill(dst, dst + d, 0.0f);  // another shard's row; the all-reduce fills it in
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::RmsNorm(Tensor* out, const Tensor& x, const Tensor& w, float eps) {
  const ArgCheck check("RmsNorm", {{"out", out, kF32, 2}, {"x", &x, kF32, 2}, {"w", &w, kF32, 1}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  if (!SameShape(*out, x) || w.dim(0) != x.dim(1)) return check.Error("want out and x [n, d], w [d]");

  const int64_t n = x.dim(0), d = x.dim(1);
  const float* weight = w.as<float>();
  for (int64_t t = 0; t < n; ++t) {
    const float* xr = x.as<float>() + t * d;
    float* yr = out->as<float>() + t * d;
    // LlamaRMSNorm: variance = x.pow(2).mean(-1) in float32; x * rsqrt(variance + eps); w * that.
    double sum_squares = 0.0;
    for (int64_t i = 0; i < d; ++i) sum_squares += static_cast<double>(xr[i]) * xr[i];
    const float variance = static_cast<float>(sum_squares / static_cast<double>(d));
    const float inv_rms = 1.0f / std::sqrt(variance + eps);
    for (int64_t i = 0; i < d; ++i) yr[i] = weight[i] * (xr[i] * inv_rms);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Rope(Tensor* q, Tensor* k, const Tensor& positions, const Tensor& inv_freq, int head_dim,
                              const RopeOptions& options) {
  const ArgCheck check("Rope", {{"q", q, kF32, 2},
                                {"k", k, kF32, 2},
                                {"positions", &positions, kI32, 1},
                                {"inv_freq", &inv_freq, kF32, 1}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  if (head_dim <= 0 || head_dim % 2 != 0) return check.Error(absl::StrCat("head_dim ", head_dim, " must be even and > 0"));
  SHARDSERVE_RETURN_IF_ERROR(CheckRopeOptions("Rope", options, head_dim));
  const int64_t n = q->dim(0), half = (options.rotary_dim > 0 ? options.rotary_dim : head_dim) / 2;
  if (k->dim(0) != n || positions.dim(0) != n || q->dim(1) % head_dim != 0 || k->dim(1) % head_dim != 0 ||
      inv_freq.dim(0) != half) {
    return check.Error(absl::StrCat("want q [n, q_heads * ", head_dim, "], k [n, kv_heads * ", head_dim,
                                    "], positions [n], inv_freq [", half, "] (rotary_dim / 2)"));
  }

  rope_cos_.resize(static_cast<size_t>(half));
  rope_sin_.resize(static_cast<size_t>(half));
  // Rotates the first 2 * half dimensions of every head of one token's row: x[i], x[i + half] ->
  // x[i] cos - x[i + half] sin, x[i + half] cos + x[i] sin, which is transformers' q * cos +
  // rotate_half(q) * sin on q[..., :rotary_dim]; the rest of the head passes through.
  const auto rotate_row = [&](float* row, int64_t width) {
    for (float* head = row; head < row + width; head += head_dim) {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = head[i], x2 = head[i + half];
        head[i] = x1 * rope_cos_[i] - x2 * rope_sin_[i];
        head[i + half] = x2 * rope_cos_[i] + x1 * rope_sin_[i];
      }
    }
  };
  const float factor = options.attention_factor;
  for (int64_t t = 0; t < n; ++t) {
    // As transformers: freqs = inv_freq * position in float32, then cos and sin of that float,
    // each times the attention factor; LongRoPE's long frequencies from long_from on.
    const int32_t position = positions.as<int32_t>()[t];
    const float* freq = options.long_inv_freq != nullptr && position >= options.long_from
                            ? options.long_inv_freq->as<float>()
                            : inv_freq.as<float>();
    const float pos = static_cast<float>(position);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * freq[i];
      rope_cos_[i] = std::cos(angle) * factor;
      rope_sin_[i] = std::sin(angle) * factor;
    }
    rotate_row(q->as<float>() + t * q->dim(1), q->dim(1));
    rotate_row(k->as<float>() + t * k->dim(1), k->dim(1));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::GatedMul(const char* op, GatedRange range, Tensor* out, const Tensor& gate,
                                  const Tensor& up) {
  const ArgCheck check(op, {{"out", out, kF32, 2}, {"gate", &gate, kF32, 2}, {"up", &up, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  if (!SameShape(*out, gate) || !SameShape(gate, up)) return check.Error("want out, gate and up all [n, f]");

  const int64_t count = gate.numel();
  // Element by element (out may alias gate or up), in chunks over the backend's threads.
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  float* y = out->as<float>();
  const float* g = gate.as<float>();
  const float* u = up.as<float>();
#pragma omp parallel for num_threads(threads_) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) range(y, g, u, c * kChunk, std::min(count, (c + 1) * kChunk));
  return absl::OkStatus();
}

// silu(g) = g / (1 + exp(-g)), as PyTorch's CPU kernel; exp(-g) = inf for very negative g gives
// -0, the right limit.
absl::Status CpuBackend::SiluMul(Tensor* out, const Tensor& gate, const Tensor& up) {
  return GatedMul("SiluMul", SiluMulRange, out, gate, up);
}

absl::Status CpuBackend::GeluTanhMul(Tensor* out, const Tensor& gate, const Tensor& up) {
  // Sleef's tanhf, as PyTorch, where the CPU has AVX2 + FMA; tanh in double rounded once elsewhere.
  static const bool avx2 = TanhHasAvx2();
  return GatedMul("GeluTanhMul", avx2 ? GeluTanhMulAvx2 : GeluTanhMulRange, out, gate, up);
}

absl::Status CpuBackend::ClampedSwiGlu(Tensor* out, const Tensor& gate, const Tensor& up, float alpha, float limit) {
  const ArgCheck check("ClampedSwiGlu", {{"out", out, kF32, 2}, {"gate", &gate, kF32, 2}, {"up", &up, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  if (!SameShape(*out, gate) || !SameShape(gate, up)) return check.Error("want out, gate and up all [n, f]");
  if (!(alpha > 0) || !std::isfinite(alpha) || !(limit > 0) || !std::isfinite(limit)) {
    return check.Error(absl::StrCat("alpha (", alpha, ") and limit (", limit, ") must be finite and > 0"));
  }
  const int64_t count = gate.numel();
  float* y = out->as<float>();
  const float* g = gate.as<float>();
  const float* u = up.as<float>();
  // Element by element (out may alias gate or up), in GptOssExperts._apply_gate's order: the clamps,
  // glu = g * sigmoid(g * alpha), then (u + 1) * glu.
  for (int64_t i = 0; i < count; ++i) {
    const float gi = std::min(g[i], limit), ui = std::clamp(u[i], -limit, limit);
    const float glu = gi * (1.0f / (1.0f + std::exp(-(gi * alpha))));
    y[i] = (ui + 1.0f) * glu;
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Scale(Tensor* out, const Tensor& x, float factor) {
  const ArgCheck check("Scale", {{"out", out, kF32, 2}, {"x", &x, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  if (!SameShape(*out, x)) return check.Error("want out and x both [n, d]");

  const int64_t count = x.numel();
  const float* xs = x.as<float>();
  float* y = out->as<float>();
  for (int64_t i = 0; i < count; ++i) y[i] = xs[i] * factor;  // element-wise, so out may alias x
  return absl::OkStatus();
}

absl::Status CpuBackend::Softcap(Tensor* x, float cap) {
  const ArgCheck check("Softcap", {{"x", x, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  if (!(cap > 0.0f) || std::isinf(cap)) return check.Error(absl::StrCat("cap must be > 0 and finite, got ", cap));

  const int64_t count = x->numel();
  float* v = x->as<float>();
  // Gemma2ForCausalLM: logits = logits / cap; logits = torch.tanh(logits); logits = logits * cap.
  static const bool avx2 = TanhHasAvx2();
  if (avx2) {
    SoftcapAvx2(v, count, cap);
  } else {
    for (int64_t i = 0; i < count; ++i) v[i] = TanhAsPyTorch(v[i] / cap) * cap;
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Add(Tensor* out, const Tensor& a, const Tensor& b) {
  const ArgCheck check("Add", {{"out", out, kF32, 2}, {"a", &a, kF32, 2}, {"b", &b, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  if (!SameShape(*out, a) || !SameShape(a, b)) return check.Error("want out, a and b all [n, d]");

  const int64_t count = a.numel();
  const float* x = a.as<float>();
  const float* z = b.as<float>();
  float* y = out->as<float>();
  for (int64_t i = 0; i < count; ++i) y[i] = x[i] + z[i];  // element-wise, so out may alias a or b
  return absl::OkStatus();
}

}  // namespace shardserve::cpu
