// The CUDA backend's ops that touch each element (or each row) once: Embedding, RmsNorm, Rope,
// SiluMul, GeluTanhMul, Scale, Softcap, Add, AddRmsNorm and RopeCacheWrite (the last two fused
// behind CudaBackendOptions::fused_kernels), their kernels and launches.
#include <cmath>
#include <cstdint>
#include <utility>

#include "kernels/cuda/cuda_backend.cuh"
#include "kernels/cuda/device_util.cuh"

namespace shardserve::cuda {
namespace {

template <typename T>
__global__ void EmbeddingKernel(T* out /*[n, d]*/, const T* table /*[rows, d]*/, const int32_t* ids /*[n]*/, int64_t n,
                                int64_t d, int64_t rows, int64_t row_offset) {
  WaitForPriorKernels();  // CudaBackend::Launch
  GRID_STRIDE_LOOP(i, n * d) {
    const int64_t t = i / d;
    const int64_t j = i - t * d;
    const int64_t r = static_cast<int64_t>(ids[t]) - row_offset;
    out[i] = (r >= 0 && r < rows) ? table[r * d + j] : FromFloat<T>(0.0f);
  }
}

// out = act(gate) * up in float32, rounded once: act is silu (SiluMul; SiluTimes) or, kGeluTanh,
// the tanh GELU (GeluTanhMul) in the CPU backend's (PyTorch's) order: inner = kBeta * (x + kKappa *
// x^3) with the sum a fused multiply-add, 0.5 * x * (1 + tanh(inner)), times up. tanhf is CUDA's
// (within 2 ulp), so where 1 + tanh cancels (gate below about -2) the outputs differ from the CPU's
// by a few ulps of tanh, relative to |gate * up|.
template <typename T, bool kGeluTanh>
__global__ void GatedMulKernel(T* out /*[n]*/, const T* gate /*[n]*/, const T* up /*[n]*/, int64_t n) {
  WaitForPriorKernels();  // CudaBackend::Launch
  constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
  constexpr float kKappa = 0.044715f;
  GRID_STRIDE_LOOP(i, n) {
    const float x = ToFloat(gate[i]);
    if constexpr (kGeluTanh) {
      const float inner = kBeta * fmaf(kKappa, x * x * x, x);
      out[i] = FromFloat<T>(0.5f * x * (1.0f + tanhf(inner)) * ToFloat(up[i]));
    } else {
      out[i] = FromFloat<T>(SiluTimes(x, ToFloat(up[i])));
    }
  }
}

// gpt-oss's clamped SwiGLU (Backend::ClampedSwiGlu), in the CPU backend's order and with its
// clamps' NaN behaviour (std::min / std::clamp keep a NaN input): g = min(gate, limit),
// u = clamp(up, -limit, limit), out = (u + 1) * (g * sigmoid(g * alpha)), rounded to T once.
template <typename T>
__global__ void ClampedSwiGluKernel(T* out /*[n]*/, const T* gate /*[n]*/, const T* up /*[n]*/, float alpha, float limit,
                                    int64_t n) {
  WaitForPriorKernels();  // CudaBackend::Launch
  GRID_STRIDE_LOOP(i, n) {
    const float g0 = ToFloat(gate[i]), u0 = ToFloat(up[i]);
    const float g = limit < g0 ? limit : g0;
    const float u = u0 < -limit ? -limit : (limit < u0 ? limit : u0);
    const float glu = g * (1.0f / (1.0f + expf(-(g * alpha))));
    out[i] = FromFloat<T>((u + 1.0f) * glu);
  }
}

template <typename T>
__global__ void ScaleKernel(T* out /*[n]*/, const T* x /*[n]*/, float factor, int64_t n) {
  WaitForPriorKernels();  // CudaBackend::Launch
  GRID_STRIDE_LOOP(i, n) out[i] = FromFloat<T>(ToFloat(x[i]) * factor);
}

// x = cap * tanh(x / cap), in transformers' order: divide (IEEE-rounded: no fast math), tanh, multiply.
__global__ void SoftcapKernel(float* x /*[n]*/, float cap, int64_t n) {
  WaitForPriorKernels();  // CudaBackend::Launch
  GRID_STRIDE_LOOP(i, n) x[i] = tanhf(x[i] / cap) * cap;
}

template <typename T>
__global__ void AddKernel(T* out /*[n]*/, const T* a /*[n]*/, const T* b /*[n]*/, int64_t n) {
  WaitForPriorKernels();  // CudaBackend::Launch
  GRID_STRIDE_LOOP(i, n) out[i] = FromFloat<T>(ToFloat(a[i]) + ToFloat(b[i]));
}

// What RopeKernel takes of RopeOptions, by value.
struct RopeParams {
  int rotary_half;           // pairs rotated per head: rotary_dim / 2
  float attention_factor;    // cos and sin times this
  const float* long_inv_freq;  // LongRoPE: [rotary_half] for positions >= long_from; null for none
  int64_t long_from;
};

// One thread per pair of dimensions of a head, numbered token-major, then q heads, then k heads,
// then i in [0, hd/2): i < rotary_half is the rotated pair (x[i], x[i + rotary_half]); i >=
// rotary_half (rotary_dim < hd) the passed-through dimensions 2i and 2i + 1, which cover [rotary_dim,
// hd) once and are left as they are. kCache (RopeCacheWrite): a k pair's thread also writes its two
// dimensions, and v's same two, into the token's cache slot, as CacheWriteKernel writes them (a
// slot outside [0, num_slots) sets kErrCacheSlot and writes nothing).
template <typename T, bool kCache>
__global__ void RopeKernel(T* q /*[n, q_heads * hd]*/, T* k /*[n, kv_heads * hd]*/, const int32_t* positions /*[n]*/,
                           const float* inv_freq /*[rotary_half]*/, int64_t n, int q_heads, int kv_heads, int head_dim,
                           RopeParams rope, const T* v = nullptr /*[n, kv_heads * hd]*/,
                           T* k_cache = nullptr /*[num_slots, row]*/, T* v_cache = nullptr /*[num_slots, row]*/,
                           const int32_t* slots = nullptr /*[n]*/, int64_t num_slots = 0, unsigned* errors = nullptr) {
  WaitForPriorKernels();  // CudaBackend::Launch
  const int half = head_dim / 2;
  const int64_t per_token = static_cast<int64_t>(q_heads + kv_heads) * half;
  GRID_STRIDE_LOOP(idx, n * per_token) {
    const int64_t t = idx / per_token;
    const int64_t r = idx - t * per_token;
    const int head = static_cast<int>(r / half);
    const int i = static_cast<int>(r - static_cast<int64_t>(head) * half);
    T* x = head < q_heads ? q + (t * q_heads + head) * head_dim : k + (t * kv_heads + (head - q_heads)) * head_dim;
    // The two dimensions this thread owns: a rotated pair, or two passed-through dimensions.
    const bool rotated = i < rope.rotary_half;
    const int d1 = rotated ? i : 2 * i;
    const int d2 = rotated ? i + rope.rotary_half : 2 * i + 1;
    T y1 = x[d1], y2 = x[d2];
    if (rotated) {
      // The angle is formed in float exactly as Hugging Face does (float(pos) * inv_freq). sincosf
      // is the full-range libdevice function, not the __sinf/__cosf intrinsics: those skip proper
      // range reduction and lose accuracy fast as |angle| grows, and angles here reach
      // pos * inv_freq[0] = pos radians (tens of thousands for long contexts).
      const int32_t position = positions[t];
      const float* freq =
          rope.long_inv_freq != nullptr && position >= rope.long_from ? rope.long_inv_freq : inv_freq;
      const float angle = static_cast<float>(position) * freq[i];
      float s, c;
      sincosf(angle, &s, &c);
      c *= rope.attention_factor;
      s *= rope.attention_factor;
      const float x1 = ToFloat(y1);
      const float x2 = ToFloat(y2);
      y1 = FromFloat<T>(x1 * c - x2 * s);
      y2 = FromFloat<T>(x2 * c + x1 * s);
      x[d1] = y1;
      x[d2] = y2;
    }
    if constexpr (kCache) {
      if (head >= q_heads) {
        const int64_t row = static_cast<int64_t>(kv_heads) * head_dim;
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) {
          if (head == q_heads && i == 0) atomicOr(errors, kErrCacheSlot);
        } else {
          const int64_t in_row = static_cast<int64_t>(head - q_heads) * head_dim;
          const T* vr = v + t * row + in_row;
          T* kc = k_cache + slot * row + in_row;
          T* vc = v_cache + slot * row + in_row;
          kc[d1] = y1;
          kc[d2] = y2;
          vc[d1] = vr[d1];
          vc[d2] = vr[d2];
        }
      }
    }
  }
}

// Loads a row kernel's thread issues before using the first: a row of up to 8192 is one round of
// kRmsNormThreads, where a loop that used each load before the next waited a memory latency per
// element (H200, 2026-11-28, Nsight Compute: 16 us for one 4096-wide RmsNorm, 65 a Llama-3-8B
// step, 13% of its GPU time; 7.4 us with two rounds of 256 threads and the second pass reading x
// and w again). Each thread sums its elements in index order.
constexpr int kRowLoads = 8;

// out[i] = x[i] * inv * w[i] for this thread's elements (threadIdx.x + j blockDim.x), rounded to
// T: the second pass of the RMSNorm kernels, its loads in flight kRowLoads at a time.
template <typename T>
__device__ __forceinline__ void NormRow(T* out, const T* x, const T* w, int64_t d, float inv) {
  for (int64_t i0 = threadIdx.x; i0 < d; i0 += kRowLoads * blockDim.x) {
    float xv[kRowLoads], wv[kRowLoads];
#pragma unroll
    for (int u = 0; u < kRowLoads; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x);
      xv[u] = i < d ? ToFloat(x[i]) : 0.0f;
      wv[u] = i < d ? ToFloat(w[i]) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kRowLoads; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x);
      if (i < d) out[i] = FromFloat<T>(xv[u] * inv * wv[u]);
    }
  }
}

// The second pass of a row the first pass read in one round (d <= kRowLoads * blockDim.x): its
// values x[i] and weights w[i] (i = threadIdx.x + u blockDim.x) kept in registers, not read
// again; the same products, rounded as NormRow rounds them.
template <typename T>
__device__ __forceinline__ void NormKept(T* out, const float (&x)[kRowLoads], const float (&w)[kRowLoads], int64_t d,
                                         float inv) {
#pragma unroll
  for (int u = 0; u < kRowLoads; ++u) {
    const int64_t i = threadIdx.x + u * static_cast<int64_t>(blockDim.x);
    if (i < d) out[i] = FromFloat<T>(x[u] * inv * w[u]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kRmsNormThreads)
    RmsNormKernel(T* out /*[rows, d]*/, const T* x /*[rows, d]*/, const T* w /*[d]*/, int64_t d, float eps) {
  WaitForPriorKernels();  // CudaBackend::Launch
  __shared__ float scratch[32];
  const T* xr = x + static_cast<int64_t>(blockIdx.x) * d;
  T* outr = out + static_cast<int64_t>(blockIdx.x) * d;
  const bool one_round = d <= kRowLoads * static_cast<int64_t>(blockDim.x);
  float ss = 0.0f, v[kRowLoads], wv[kRowLoads];
  for (int64_t i0 = threadIdx.x; i0 < d; i0 += kRowLoads * blockDim.x) {
#pragma unroll
    for (int u = 0; u < kRowLoads; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x);
      v[u] = i < d ? ToFloat(xr[i]) : 0.0f;  // 0 adds nothing to ss (>= 0): the same bits
      if (one_round) wv[u] = i < d ? ToFloat(w[i]) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kRowLoads; ++u) ss += v[u] * v[u];
  }
  ss = BlockAllReduce(ss, SumOp{}, scratch);
  // IEEE sqrt and division (no fast-math), as the CPU reference.
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
  // Each thread rewrites only the elements it read, so out may alias x.
  if (one_round) {
    NormKept(outr, v, wv, d, inv);
  } else {
    NormRow(outr, xr, w, d, inv);
  }
}

// RmsNormKernel after AddKernel, in one pass: each thread rounds its elements' sums to T as
// AddKernel does, stores them in x and sums their squares in RmsNormKernel's order (the same
// threads, the same stride), so normed gets RmsNormKernel's bits on AddKernel's x.
template <typename T>
__global__ void __launch_bounds__(kRmsNormThreads)
    AddRmsNormKernel(T* x /*[rows, d]*/, const T* y /*[rows, d]*/, T* normed /*[rows, d]*/, const T* w /*[d]*/,
                     int64_t d, float eps) {
  WaitForPriorKernels();  // CudaBackend::Launch
  __shared__ float scratch[32];
  T* xr = x + static_cast<int64_t>(blockIdx.x) * d;
  const T* yr = y + static_cast<int64_t>(blockIdx.x) * d;
  T* outr = normed + static_cast<int64_t>(blockIdx.x) * d;
  const bool one_round = d <= kRowLoads * static_cast<int64_t>(blockDim.x);
  float ss = 0.0f, sums[kRowLoads], wv[kRowLoads];
  for (int64_t i0 = threadIdx.x; i0 < d; i0 += kRowLoads * blockDim.x) {
    float a[kRowLoads], b[kRowLoads];
#pragma unroll
    for (int u = 0; u < kRowLoads; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x);
      a[u] = i < d ? ToFloat(xr[i]) : 0.0f;
      b[u] = i < d ? ToFloat(yr[i]) : 0.0f;
      if (one_round) wv[u] = i < d ? ToFloat(w[i]) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kRowLoads; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x);
      const T s = FromFloat<T>(a[u] + b[u]);
      if (i < d) xr[i] = s;
      sums[u] = ToFloat(s);  // 0 past d: adds nothing
      ss += sums[u] * sums[u];
    }
  }
  ss = BlockAllReduce(ss, SumOp{}, scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
  // Each thread writes normed only at the elements it wrote in x (normed may alias y: its element
  // was read above, by this thread); a longer row is read back from x.
  if (one_round) {
    NormKept(outr, sums, wv, d, inv);
  } else {
    NormRow(outr, xr, w, d, inv);
  }
}

}  // namespace

absl::Status CudaBackend::Embedding(Tensor* out, const Tensor& table, const Tensor& ids, int64_t row_offset) {
  constexpr const char* kOp = "Embedding";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"table", &table}, {"ids", &ids}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"table", &table}, {"ids", &ids}};
  if (!Is(*out, 2, act_) || !Is(table, 2, act_) || !Is(ids, 1, DType::kI32)) {
    return Invalid(kOp, absl::StrCat("expected out [n, d] ", DTypeName(act_), ", table [rows, d] ", DTypeName(act_),
                                     ", ids [n] I32"),
                   all);
  }
  if (out->dim(0) != ids.dim(0) || out->dim(1) != table.dim(1)) return Invalid(kOp, "shapes do not match", all);
  if (row_offset < 0) return Invalid(kOp, absl::StrCat("row_offset must be >= 0, got ", row_offset), all);
  const int64_t n = out->dim(0), d = out->dim(1);
  if (n * d == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    SHARDSERVE_RETURN_IF_ERROR(Launch("EmbeddingKernel", EmbeddingKernel<T>, GridFor(n * d, kElementwiseThreads),
                                      kElementwiseThreads, out->as<T>(), table.as<const T>(), ids.as<const int32_t>(),
                                      n, d, table.dim(0), row_offset));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::RmsNorm(Tensor* out, const Tensor& x, const Tensor& w, float eps) {
  constexpr const char* kOp = "RmsNorm";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"x", &x}, {"w", &w}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"x", &x}, {"w", &w}};
  if (!Is(*out, 2, act_) || !Is(x, 2, act_) || !Is(w, 1, act_)) {
    return Invalid(kOp, absl::StrCat("expected out, x [n, d] and w [d], all ", DTypeName(act_)), all);
  }
  if (!SameShape(*out, x) || w.dim(0) != x.dim(1)) return Invalid(kOp, "shapes do not match", all);
  if (!(eps >= 0.0f)) return Invalid(kOp, absl::StrCat("eps must be >= 0, got ", eps), all);
  const int64_t n = x.dim(0), d = x.dim(1);
  if (n * d == 0) return absl::OkStatus();
  if (!FitsInt(n)) return Invalid(kOp, "more rows than one launch can take (2^31 - 1)", all);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    SHARDSERVE_RETURN_IF_ERROR(Launch("RmsNormKernel", RmsNormKernel<T>, static_cast<unsigned>(n), kRmsNormThreads,
                                      out->as<T>(), x.as<const T>(), w.as<const T>(), d, eps));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::AddRmsNorm(Tensor* x, const Tensor& y, Tensor* normed, const Tensor& w, float eps) {
  if (!options_.fused_kernels) return Backend::AddRmsNorm(x, y, normed, w, eps);
  constexpr const char* kOp = "AddRmsNorm";
  if (x == nullptr || normed == nullptr) return Invalid(kOp, "x and normed must not be null", {{"y", &y}, {"w", &w}});
  const auto all = {std::pair<const char*, const Tensor*>{"x", x}, {"y", &y}, {"normed", normed}, {"w", &w}};
  if (!Is(*x, 2, act_) || !Is(y, 2, act_) || !Is(*normed, 2, act_) || !Is(w, 1, act_)) {
    return Invalid(kOp, absl::StrCat("expected x, y, normed [n, d] and w [d], all ", DTypeName(act_)), all);
  }
  if (!SameShape(*x, y) || !SameShape(*x, *normed) || w.dim(0) != x->dim(1)) {
    return Invalid(kOp, "shapes do not match", all);
  }
  if (!(eps >= 0.0f)) return Invalid(kOp, absl::StrCat("eps must be >= 0, got ", eps), all);
  const int64_t n = x->dim(0), d = x->dim(1);
  if (n * d == 0) return absl::OkStatus();
  if (!FitsInt(n)) return Invalid(kOp, "more rows than one launch can take (2^31 - 1)", all);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    SHARDSERVE_RETURN_IF_ERROR(Launch("AddRmsNormKernel", AddRmsNormKernel<T>, static_cast<unsigned>(n),
                                      kRmsNormThreads, x->as<T>(), y.as<const T>(), normed->as<T>(), w.as<const T>(), d,
                                      eps));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::CheckRope(const Tensor* q, const Tensor* k, const Tensor& positions, const Tensor& inv_freq,
                                    int head_dim, const RopeOptions& options) const {
  constexpr const char* kOp = "Rope";
  if (q == nullptr || k == nullptr) {
    return Invalid(kOp, "q and k must not be null", {{"q", q}, {"k", k}, {"positions", &positions}});
  }
  const auto all = {std::pair<const char*, const Tensor*>{"q", q},
                    {"k", k},
                    {"positions", &positions},
                    {"inv_freq", &inv_freq}};
  if (!Is(*q, 2, act_) || !Is(*k, 2, act_) || !Is(positions, 1, DType::kI32) || !Is(inv_freq, 1, DType::kF32)) {
    return Invalid(kOp,
                   absl::StrCat("expected q [n, q_heads * hd] and k [n, kv_heads * hd] ", DTypeName(act_),
                                ", positions [n] I32, inv_freq [rotary_dim / 2] F32"),
                   all);
  }
  if (head_dim <= 0 || head_dim % 2 != 0) {
    return Invalid(kOp, absl::StrCat("head_dim must be positive and even, got ", head_dim), all);
  }
  SHARDSERVE_RETURN_IF_ERROR(CheckRopeOptions(kOp, options, head_dim));
  const int64_t n = q->dim(0);
  const int64_t half = (options.rotary_dim > 0 ? options.rotary_dim : head_dim) / 2;
  if (k->dim(0) != n || positions.dim(0) != n || q->dim(1) % head_dim != 0 || k->dim(1) % head_dim != 0 ||
      inv_freq.dim(0) != half) {
    return Invalid(kOp, absl::StrCat("shapes do not match head_dim ", head_dim, " and rotary_dim / 2 = ", half), all);
  }
  if (!FitsInt(q->dim(1) / head_dim + k->dim(1) / head_dim)) return Invalid(kOp, "too many heads", all);
  return absl::OkStatus();
}

absl::Status CudaBackend::Rope(Tensor* q, Tensor* k, const Tensor& positions, const Tensor& inv_freq, int head_dim,
                               const RopeOptions& options) {
  return RopeAndMaybeCacheWrite(q, k, positions, inv_freq, head_dim, options, nullptr, nullptr, nullptr, nullptr);
}

absl::Status CudaBackend::RopeCacheWrite(Tensor* q, Tensor* k, const Tensor& v, const Tensor& positions,
                                         const Tensor& inv_freq, int head_dim, const RopeOptions& options,
                                         Tensor* k_cache, Tensor* v_cache, const Tensor& slots) {
  if (!options_.fused_kernels) {
    return Backend::RopeCacheWrite(q, k, v, positions, inv_freq, head_dim, options, k_cache, v_cache, slots);
  }
  return RopeAndMaybeCacheWrite(q, k, positions, inv_freq, head_dim, options, &v, k_cache, v_cache, &slots);
}

absl::Status CudaBackend::RopeAndMaybeCacheWrite(Tensor* q, Tensor* k, const Tensor& positions,
                                                 const Tensor& inv_freq, int head_dim, const RopeOptions& options,
                                                 const Tensor* v, Tensor* k_cache, Tensor* v_cache,
                                                 const Tensor* slots) {
  SHARDSERVE_RETURN_IF_ERROR(CheckRope(q, k, positions, inv_freq, head_dim, options));
  const bool cache = v != nullptr;
  if (cache) {
    SHARDSERVE_RETURN_IF_ERROR(CheckCacheWrite(k_cache, v_cache, *k, *v, *slots));
    if (k_cache->dim(3) != head_dim) {
      return Invalid("RopeCacheWrite", absl::StrCat("the caches' head dim is not head_dim ", head_dim),
                     {{"k", k}, {"k_cache", k_cache}});
    }
  }
  const int64_t n = q->dim(0), q_heads = q->dim(1) / head_dim, kv_heads = k->dim(1) / head_dim;
  const int64_t pairs = n * (q_heads + kv_heads) * (head_dim / 2);
  if (pairs == 0) return absl::OkStatus();
  const RopeParams rope{(options.rotary_dim > 0 ? options.rotary_dim : head_dim) / 2, options.attention_factor,
                        options.long_inv_freq != nullptr ? options.long_inv_freq->as<const float>() : nullptr,
                        options.long_from};
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    const unsigned grid = GridFor(pairs, kElementwiseThreads);
    if (!cache) {
      SHARDSERVE_RETURN_IF_ERROR(Launch("RopeKernel", RopeKernel<T, false>, grid, kElementwiseThreads, q->as<T>(),
                                        k->as<T>(), positions.as<const int32_t>(), inv_freq.as<const float>(), n,
                                        static_cast<int>(q_heads), static_cast<int>(kv_heads), head_dim, rope,
                                        nullptr, nullptr, nullptr, nullptr, int64_t{0}, nullptr));
      return absl::OkStatus();
    }
    SHARDSERVE_RETURN_IF_ERROR(Launch("RopeKernel<cache>", RopeKernel<T, true>, grid, kElementwiseThreads, q->as<T>(),
                                      k->as<T>(), positions.as<const int32_t>(), inv_freq.as<const float>(), n,
                                      static_cast<int>(q_heads), static_cast<int>(kv_heads), head_dim, rope,
                                      v->as<const T>(), k_cache->as<T>(), v_cache->as<T>(), slots->as<const int32_t>(),
                                      k_cache->dim(0) * k_cache->dim(1), errors_dev_));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::SiluMul(Tensor* out, const Tensor& gate, const Tensor& up) {
  return GatedMul("SiluMul", false, out, gate, up);
}

absl::Status CudaBackend::GeluTanhMul(Tensor* out, const Tensor& gate, const Tensor& up) {
  return GatedMul("GeluTanhMul", true, out, gate, up);
}

absl::Status CudaBackend::GatedMul(const char* op, bool gelu_tanh, Tensor* out, const Tensor& gate,
                                   const Tensor& up) {
  if (out == nullptr) return Invalid(op, "out is null", {{"gate", &gate}, {"up", &up}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"gate", &gate}, {"up", &up}};
  if (!Is(*out, 2, act_) || !Is(gate, 2, act_) || !Is(up, 2, act_)) {
    return Invalid(op, absl::StrCat("expected out, gate, up [n, f] ", DTypeName(act_)), all);
  }
  if (!SameShape(*out, gate) || !SameShape(*out, up)) return Invalid(op, "shapes do not match", all);
  const int64_t count = out->numel();
  if (count == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    const unsigned grid = GridFor(count, kElementwiseThreads);
    if (gelu_tanh) {
      return Launch("GeluTanhMulKernel", GatedMulKernel<T, true>, grid, kElementwiseThreads, out->as<T>(),
                    gate.as<const T>(), up.as<const T>(), count);
    }
    return Launch("SiluMulKernel", GatedMulKernel<T, false>, grid, kElementwiseThreads, out->as<T>(),
                  gate.as<const T>(), up.as<const T>(), count);
  });
}

absl::Status CudaBackend::ClampedSwiGlu(Tensor* out, const Tensor& gate, const Tensor& up, float alpha, float limit) {
  constexpr const char* kOp = "ClampedSwiGlu";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"gate", &gate}, {"up", &up}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"gate", &gate}, {"up", &up}};
  if (!Is(*out, 2, act_) || !Is(gate, 2, act_) || !Is(up, 2, act_)) {
    return Invalid(kOp, absl::StrCat("expected out, gate, up [n, f] ", DTypeName(act_)), all);
  }
  if (!SameShape(*out, gate) || !SameShape(*out, up)) return Invalid(kOp, "shapes do not match", all);
  if (!(alpha > 0.0f) || std::isinf(alpha) || !(limit > 0.0f) || std::isinf(limit)) {
    return Invalid(kOp, absl::StrCat("alpha (", alpha, ") and limit (", limit, ") must be finite and > 0"), all);
  }
  const int64_t count = out->numel();
  if (count == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    return Launch("ClampedSwiGluKernel", ClampedSwiGluKernel<T>, GridFor(count, kElementwiseThreads),
                  kElementwiseThreads, out->as<T>(), gate.as<const T>(), up.as<const T>(), alpha, limit, count);
  });
}

absl::Status CudaBackend::Scale(Tensor* out, const Tensor& x, float factor) {
  constexpr const char* kOp = "Scale";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"x", &x}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"x", &x}};
  if (!Is(*out, 2, act_) || !Is(x, 2, act_)) {
    return Invalid(kOp, absl::StrCat("expected out, x [n, d] ", DTypeName(act_)), all);
  }
  if (!SameShape(*out, x)) return Invalid(kOp, "shapes do not match", all);
  const int64_t count = out->numel();
  if (count == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    return Launch("ScaleKernel", ScaleKernel<T>, GridFor(count, kElementwiseThreads), kElementwiseThreads,
                  out->as<T>(), x.as<const T>(), factor, count);
  });
}

absl::Status CudaBackend::Softcap(Tensor* x, float cap) {
  constexpr const char* kOp = "Softcap";
  if (x == nullptr) return Invalid(kOp, "x is null", {});
  const auto all = {std::pair<const char*, const Tensor*>{"x", x}};
  if (!Is(*x, 2, DType::kF32)) return Invalid(kOp, "expected x [n, v] F32", all);
  if (!(cap > 0.0f) || std::isinf(cap)) return Invalid(kOp, absl::StrCat("cap must be > 0 and finite, got ", cap), all);
  const int64_t count = x->numel();
  if (count == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return Launch("SoftcapKernel", SoftcapKernel, GridFor(count, kElementwiseThreads), kElementwiseThreads,
                x->as<float>(), cap, count);
}

absl::Status CudaBackend::Add(Tensor* out, const Tensor& a, const Tensor& b) {
  constexpr const char* kOp = "Add";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"a", &a}, {"b", &b}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"a", &a}, {"b", &b}};
  if (!Is(*out, 2, act_) || !Is(a, 2, act_) || !Is(b, 2, act_)) {
    return Invalid(kOp, absl::StrCat("expected out, a, b [n, d] ", DTypeName(act_)), all);
  }
  if (!SameShape(*out, a) || !SameShape(*out, b)) return Invalid(kOp, "shapes do not match", all);
  const int64_t count = out->numel();
  if (count == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    SHARDSERVE_RETURN_IF_ERROR(Launch("AddKernel", AddKernel<T>, GridFor(count, kElementwiseThreads),
                                      kElementwiseThreads, out->as<T>(), a.as<const T>(), b.as<const T>(), count));
    return absl::OkStatus();
  });
}

}  // namespace shardserve::cuda
