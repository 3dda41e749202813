// The CUDA backend's ops on logits: Softmax, Argmax and Sample (temperature, top-k, top-p), their
// kernels, and the scratch they use (sampling parameters, ids bound for host memory).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_backend.cuh"
#include "kernels/cuda/device_util.cuh"

namespace shardserve::cuda {
namespace {

// Inclusive prefix sum over the block in thread order; *total gets the block's sum. Same
// requirements as BlockAllReduce.
__device__ double BlockInclusiveScan(double v, double* scratch, double* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  double before = 0.0, all = 0.0;
  for (int w = 0; w < warps; ++w) {
    if (w < warp) before += scratch[w];
    all += scratch[w];
  }
  *total = all;
  return before + v;
}

__global__ void __launch_bounds__(kRowThreads)
    SoftmaxKernel(float* out /*[rows, v]*/, const float* x /*[rows, v]*/, int64_t v, float temperature) {
  WaitForPriorKernels();  // CudaBackend::Launch
  __shared__ float scratch[32];
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * v;
  float* outr = out + static_cast<int64_t>(blockIdx.x) * v;
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) mx = fmaxf(mx, xr[i] / temperature);
  mx = BlockAllReduce(mx, MaxOp{}, scratch);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) sum += expf(xr[i] / temperature - mx);
  sum = BlockAllReduce(sum, SumOp{}, scratch);
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) outr[i] = expf(xr[i] / temperature - mx) / sum;
}

// Whether (a, ai) wins over (b, bi) for argmax: larger value, NaN above everything (torch.argmax
// returns a NaN's index), the smaller index on ties. A strict total order, so the reduction result
// does not depend on the reduction tree.
__device__ __forceinline__ bool ArgmaxBetter(float a, long long ai, float b, long long bi) {
  const bool a_nan = isnan(a), b_nan = isnan(b);
  if (a_nan || b_nan) return a_nan && b_nan ? ai < bi : a_nan;
  if (a != b) return a > b;
  return ai < bi;
}

constexpr int kArgmaxLoads = 16;

__global__ void __launch_bounds__(kRowThreads)
    ArgmaxKernel(int32_t* out /*[rows]*/, const float* logits /*[rows, v]*/, int64_t v) {
  WaitForPriorKernels();  // CudaBackend::Launch
  __shared__ float s_val[32];
  __shared__ long long s_idx[32];
  const float* xr = logits + static_cast<int64_t>(blockIdx.x) * v;
  float bv = -INFINITY;
  long long bi = LLONG_MAX;  // "nothing yet": loses to every element, -inf included
  // kArgmaxLoads loads in flight a thread before comparing: one at a time, a 128K vocabulary's
  // row took 123 us (250 rounds of a memory latency; H200, 2026-11-28, Nsight Compute). The order
  // of comparisons does not matter: ArgmaxBetter is a strict total order.
  for (int64_t i0 = threadIdx.x; i0 < v; i0 += kArgmaxLoads * blockDim.x) {
    float x[kArgmaxLoads];
#pragma unroll
    for (int u = 0; u < kArgmaxLoads; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x);
      x[u] = i < v ? xr[i] : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < kArgmaxLoads; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x);
      if (i < v && ArgmaxBetter(x[u], i, bv, bi)) {
        bv = x[u];
        bi = i;
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const long long oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ArgmaxBetter(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  if ((threadIdx.x & 31) == 0) {
    s_val[threadIdx.x >> 5] = bv;
    s_idx[threadIdx.x >> 5] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) {
      if (ArgmaxBetter(s_val[w], s_idx[w], bv, bi)) {
        bv = s_val[w];
        bi = s_idx[w];
      }
    }
    out[blockIdx.x] = bi == LLONG_MAX ? 0 : static_cast<int32_t>(bi);
  }
}

// One block per row: out[row] = 1 when every logit is finite, else 0 (Backend::FiniteRows).
__global__ void __launch_bounds__(kRowThreads)
    FiniteRowsKernel(int32_t* out /*[rows]*/, const float* logits /*[rows, v]*/, int64_t v) {
  WaitForPriorKernels();  // CudaBackend::Launch
  const float* xr = logits + static_cast<int64_t>(blockIdx.x) * v;
  int finite = 1;
  // On the exponent bits (all ones: NaN or an infinity), which no fast-math option rewrites.
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    finite &= (__float_as_uint(xr[i]) & 0x7f800000u) != 0x7f800000u ? 1 : 0;
  }
  finite = __syncthreads_and(finite);
  if (threadIdx.x == 0) out[blockIdx.x] = finite;
}

// A uint32 whose unsigned order is the float order (-inf < ... < -0 = +0 < ... < +inf); -0 and +0
// share one key so that they tie, as equal floats should.
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  const uint32_t u = f == 0.0f ? 0u : __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One block per row. The definition (backend.h) on s = logits / temperature, e = exp(s - max s):
//   1. top_k (0 < k < v): keep tokens with s >= the k-th largest s (ties included). Comparing s
//      rather than probabilities avoids depending on how exp rounds; exp is monotonic, so the
//      kept set is the same up to exp rounding two different logits to one probability.
//   2. top_p (< 1): among those, keep the smallest set of most likely tokens whose mass reaches
//      top_p of the top-k mass, plus ties at the boundary = tokens with s >= tau, where tau is the
//      largest threshold whose kept mass is still >= top_p * top-k mass.
//   3. In vocabulary order, return the first kept token whose inclusive cumulative mass exceeds
//      uniform * (kept mass).
// Thresholds are found by a bitwise binary search on OrderedKey (32 passes over the row, each a
// block reduction): bit by bit from the top, keep the bit if the count (top_k) or mass (top_p) of
// tokens at or above the candidate key still meets the target. The predicate only falls as the
// key grows, so this yields the largest qualifying key, which is a key present in the row.
// Masses are summed in double so the result hardly depends on summation order (the CPU sums in
// another order).
__global__ void __launch_bounds__(kRowThreads)
    SampleKernel(int32_t* out /*[rows]*/, const float* logits /*[rows, v]*/, const SampleParams* params /*[rows]*/,
                 int64_t v) {
  WaitForPriorKernels();  // CudaBackend::Launch
  __shared__ float s_f[32];
  __shared__ double s_d[32];
  __shared__ unsigned s_u[32];
  __shared__ long long s_ll[32];
  const float* xr = logits + static_cast<int64_t>(blockIdx.x) * v;
  const SampleParams p = params[blockIdx.x];
  const float temperature = p.temperature;

  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) mx = fmaxf(mx, xr[i] / temperature);
  mx = BlockAllReduce(mx, MaxOp{}, s_f);
  // Recomputed in every pass from the same inputs, so every pass sees the same values.
  auto key = [&](int64_t i) { return OrderedKey(xr[i] / temperature); };
  auto weight = [&](int64_t i) { return expf(xr[i] / temperature - mx); };

  // 1. top_k threshold: the largest key with at least k tokens at or above it.
  uint32_t threshold = 0;  // keeps everything
  if (p.top_k > 0 && p.top_k < v) {
    uint32_t prefix = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = prefix | (1u << bit);
      unsigned count = 0;
      for (int64_t i = threadIdx.x; i < v; i += blockDim.x) count += key(i) >= cand ? 1u : 0u;
      count = BlockAllReduce(count, SumOp{}, s_u);
      if (count >= static_cast<unsigned>(p.top_k)) prefix = cand;
    }
    threshold = prefix;
  }

  // 2. top_p threshold: the largest key with mass at or above it >= top_p * (top-k mass).
  if (p.top_p < 1.0f) {
    double mass_k = 0.0;
    for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
      if (key(i) >= threshold) mass_k += weight(i);
    }
    mass_k = BlockAllReduce(mass_k, SumOp{}, s_d);
    const double target = static_cast<double>(p.top_p) * mass_k;
    uint32_t prefix = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = prefix | (1u << bit);
      const uint32_t at_least = cand > threshold ? cand : threshold;
      double mass = 0.0;
      for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
        if (key(i) >= at_least) mass += weight(i);
      }
      mass = BlockAllReduce(mass, SumOp{}, s_d);
      if (mass >= target) prefix = cand;
    }
    // prefix >= threshold: at `threshold` the mass is all of mass_k >= target.
    threshold = prefix > threshold ? prefix : threshold;
  }

  // 3. Kept mass, and the last kept token with positive mass (the answer when rounding puts
  // uniform * mass at or above the total).
  double kept = 0.0;
  long long last = -1;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    if (key(i) >= threshold) {
      const float w = weight(i);
      kept += w;
      if (w > 0.0f) last = i;
    }
  }
  kept = BlockAllReduce(kept, SumOp{}, s_d);
  last = BlockAllReduce(last, MaxOp{}, s_ll);
  const double target = static_cast<double>(p.uniform) * kept;

  // 4. Scan in vocabulary order, one tile of blockDim tokens at a time, until the inclusive
  // cumulative mass exceeds the target.
  long long pick = -1;
  double carry = 0.0;
  for (int64_t base = 0; base < v; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const double w = (i < v && key(i) >= threshold) ? static_cast<double>(weight(i)) : 0.0;
    double tile_total;
    const double cum = carry + BlockInclusiveScan(w, s_d, &tile_total);
    const long long hit = (w > 0.0 && cum > target) ? i : LLONG_MAX;
    const long long first = BlockAllReduce(hit, MinOp{}, s_ll);
    if (first != LLONG_MAX) {  // same value in every thread: the whole block leaves together
      pick = first;
      break;
    }
    carry += tile_total;
  }
  if (pick < 0) pick = last >= 0 ? last : 0;  // stays inside [0, v) even for NaN logits
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(pick);
}

}  // namespace

// Copies the per-row sampling parameters to params_dev_ through a pinned staging buffer (so the
// copy is a real async DMA); both buffers are allocated once and grown only when the batch grows.
absl::Status CudaBackend::UploadSampleParams(const std::vector<SampleParams>& params) {
  static_assert(std::is_trivially_copyable_v<SampleParams>);
  const size_t n = params.size();
  if (n > params_capacity_) {
    const size_t cap = std::max<size_t>({n, 64, 2 * params_capacity_});
    params_capacity_ = 0;  // until both buffers exist again
    SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    if (params_dev_ != nullptr) SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaFree(params_dev_));
    params_dev_ = nullptr;
    if (params_host_ != nullptr) SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaFreeHost(params_host_));
    params_host_ = nullptr;
    SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&params_dev_, cap * sizeof(SampleParams)));
    SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMallocHost(&params_host_, cap * sizeof(SampleParams)));
    params_capacity_ = cap;
  } else {
    // The previous upload may still be reading the pinned staging buffer: wait for that copy.
    SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(params_copied_));
  }
  std::memcpy(params_host_, params.data(), n * sizeof(SampleParams));
  SHARDSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(params_dev_, params_host_, n * sizeof(SampleParams), cudaMemcpyHostToDevice, stream_));
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(params_copied_, stream_));
  return absl::OkStatus();
}

absl::StatusOr<int32_t*> CudaBackend::IdsTarget(const char* op, const Tensor& out, bool* to_host) {
  cudaPointerAttributes attr;
  const cudaError_t e = cudaPointerGetAttributes(&attr, out.data);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not a sticky error; older drivers say this for plain host memory
    attr.type = cudaMemoryTypeUnregistered;
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
    if (attr.type == cudaMemoryTypeDevice && attr.device != ordinal_) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": out is memory of cuda:", attr.device,
                                                     ", this backend runs on cuda:", ordinal_));
    }
    *to_host = false;
    return static_cast<int32_t*>(out.data);
  }
  *to_host = true;
  SHARDSERVE_RETURN_IF_ERROR(GrowDevice(&ids_dev_, &ids_capacity_, static_cast<size_t>(out.dim(0))));
  return ids_dev_;
}

absl::Status CudaBackend::FinishIds(const Tensor& out, bool to_host) {
  if (!to_host) return absl::OkStatus();
  SHARDSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(out.data, ids_dev_, out.bytes(), cudaMemcpyDeviceToHost, stream_));
  return SyncAndCheck();
}

absl::Status CudaBackend::Softmax(Tensor* out, const Tensor& x, float temperature) {
  constexpr const char* kOp = "Softmax";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"x", &x}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"x", &x}};
  if (!Is(*out, 2, DType::kF32) || !Is(x, 2, DType::kF32)) return Invalid(kOp, "expected out, x [n, v] F32", all);
  if (!SameShape(*out, x)) return Invalid(kOp, "shapes do not match", all);
  if (!(temperature > 0.0f) || std::isinf(temperature)) {
    return Invalid(kOp, absl::StrCat("temperature must be positive and finite, got ", temperature), all);
  }
  const int64_t n = x.dim(0), v = x.dim(1);
  if (n * v == 0) return absl::OkStatus();
  if (!FitsInt(n)) return Invalid(kOp, "more rows than one launch can take (2^31 - 1)", all);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  SHARDSERVE_RETURN_IF_ERROR(Launch("SoftmaxKernel", SoftmaxKernel, static_cast<unsigned>(n), kRowThreads,
                                    out->as<float>(), x.as<const float>(), v, temperature));
  return absl::OkStatus();
}

absl::Status CudaBackend::RowsToIds(const char* op, const char* kernel_name,
                                    void (*kernel)(int32_t*, const float*, int64_t), Tensor* out,
                                    const Tensor& logits) {
  if (out == nullptr) return Invalid(op, "out is null", {{"logits", &logits}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"logits", &logits}};
  if (!Is(*out, 1, DType::kI32) || !Is(logits, 2, DType::kF32)) {
    return Invalid(op, "expected out [n] I32 and logits [n, v] F32", all);
  }
  const int64_t n = logits.dim(0), v = logits.dim(1);
  if (out->dim(0) != n) return Invalid(op, "shapes do not match", all);
  if (n == 0) return absl::OkStatus();
  if (v == 0) return Invalid(op, "empty vocabulary", all);
  if (!FitsInt(n) || !FitsInt(v)) return Invalid(op, "n and v must fit in int32", all);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  bool to_host = false;
  absl::StatusOr<int32_t*> target = IdsTarget(op, *out, &to_host);
  if (!target.ok()) return target.status();
  SHARDSERVE_RETURN_IF_ERROR(Launch(kernel_name, kernel, static_cast<unsigned>(n), kRowThreads, *target,
                                    logits.as<const float>(), v));
  return FinishIds(*out, to_host);
}

absl::Status CudaBackend::Argmax(Tensor* out, const Tensor& logits) {
  return RowsToIds("Argmax", "ArgmaxKernel", ArgmaxKernel, out, logits);
}

absl::Status CudaBackend::FiniteRows(Tensor* out, const Tensor& logits) {
  return RowsToIds("FiniteRows", "FiniteRowsKernel", FiniteRowsKernel, out, logits);
}

absl::Status CudaBackend::Sample(Tensor* out, const Tensor& logits, const std::vector<SampleParams>& params) {
  constexpr const char* kOp = "Sample";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"logits", &logits}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"logits", &logits}};
  if (!Is(*out, 1, DType::kI32) || !Is(logits, 2, DType::kF32)) {
    return Invalid(kOp, "expected out [n] I32 and logits [n, v] F32", all);
  }
  const int64_t n = logits.dim(0), v = logits.dim(1);
  if (out->dim(0) != n || static_cast<int64_t>(params.size()) != n) {
    return Invalid(kOp, absl::StrCat("shapes do not match (", params.size(), " params)"), all);
  }
  if (n == 0) return absl::OkStatus();
  if (v == 0) return Invalid(kOp, "empty vocabulary", all);
  if (!FitsInt(n) || !FitsInt(v)) return Invalid(kOp, "n and v must fit in int32", all);
  for (size_t r = 0; r < params.size(); ++r) {
    const SampleParams& p = params[r];
    if (!(p.temperature > 0.0f) || std::isinf(p.temperature) || p.top_k < 0 || !(p.top_p > 0.0f && p.top_p <= 1.0f) ||
        !(p.uniform >= 0.0f && p.uniform < 1.0f)) {
      return Invalid(kOp,
                     absl::StrCat("row ", r, " has bad parameters: temperature ", p.temperature, " (need > 0), top_k ",
                                  p.top_k, " (need >= 0), top_p ", p.top_p, " (need (0, 1]), uniform ", p.uniform,
                                  " (need [0, 1))"),
                     all);
    }
  }
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  SHARDSERVE_RETURN_IF_ERROR(UploadSampleParams(params));
  bool to_host = false;
  absl::StatusOr<int32_t*> target = IdsTarget(kOp, *out, &to_host);
  if (!target.ok()) return target.status();
  SHARDSERVE_RETURN_IF_ERROR(Launch("SampleKernel", SampleKernel, static_cast<unsigned>(n), kRowThreads, *target,
                                    logits.as<const float>(), params_dev_, v));
  return FinishIds(*out, to_host);
}

}  // namespace shardserve::cuda
