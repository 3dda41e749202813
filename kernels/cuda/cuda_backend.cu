// The CUDA backend (kernels/backend.h): cuBLAS for MatMul, the kernels below for everything else.
//
// Activations are float, __half or __nv_bfloat16 (the backend's act dtype); every kernel converts
// to float on load, accumulates in float (double for the sampling masses) and rounds once on
// store. Logits, softmax output and sampling inputs are float32.
//
// Ownership and lifetime: a CudaBackend owns one cudaStream_t, one cublasHandle_t and a few small
// scratch buffers, all created in MakeCudaBackend and destroyed in the destructor. Buffers it
// hands out (Allocate) must be freed before it is destroyed. Not thread-safe: one thread at a
// time, as backend.h says.
//
// Ordering: every op and CopyOnDevice/Fill0 are enqueued on the stream and return before the GPU
// is done. CopyToDevice returns once the host source may be reused, CopyToHost once the host
// destination holds the data (both synchronize the stream). Argmax and Sample with a host output
// tensor also synchronize.
//
// Bad metadata: block-table entries, sequence ids, positions and cache slots live on the device,
// so the host cannot check them without a synchronization. The kernels check them instead, skip
// what is out of range (never reading or writing outside a tensor) and set a bit in a device
// error word; the next Synchronize() or CopyToHost() (or Argmax/Sample to host) returns an
// InvalidArgument naming the op and clears the word.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/tensor.h"

namespace shardserve {
namespace {

using cuda::GridFor;

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define SHARDSERVE_RETURN_IF_NOT_OK(expr)                      \
  do {                                                         \
    absl::Status shardserve_status_ = (expr);                  \
    if (!shardserve_status_.ok()) return shardserve_status_;   \
  } while (0)

// ---- Launch configuration (why these numbers) -------------------------------------------------
// Elementwise ops: 256 threads per block is the usual sweet spot for memory-bound kernels on
// A100/H100 (8 blocks per SM at full occupancy); grid-stride loops cap the grid (GridFor).
constexpr int kElementwiseThreads = 256;
// RmsNorm: one block per row; hidden sizes are 2k-16k, so 256 threads do 8-64 elements each and
// several rows stay resident per SM.
constexpr int kRmsNormThreads = 256;
// Softmax, Argmax, Sample: one block per row over a vocabulary of 32k-152k; rows are few (the
// batch), so a wide block keeps more loads in flight per row. 512 leaves room for the double
// accumulators of Sample without spilling.
constexpr int kRowThreads = 512;
// Attention: one block per (token, query head); each thread scores one key of a 128-key chunk,
// then owns head_dim / 128 output dimensions. Head dims up to 512 are supported (Llama-family
// models use 64-256). (Lanes splitting head_dim per key, one key per warp at a time, left every
// key's loads waiting on the previous key's: 72 us for 140 keys of a 64-dim head on an H100.)
constexpr int kAttnThreads = 128;
constexpr int kAttnChunk = kAttnThreads;
constexpr int kAttnMaxHeadDim = 512;
constexpr int kAttnDimsPerThread = kAttnMaxHeadDim / kAttnThreads;

// Bits of the device error word.
enum : unsigned {
  kErrAttentionSeq = 1u << 0,    // token_seq[t] outside [0, seqs)
  kErrAttentionPos = 1u << 1,    // positions[t] < 0 or beyond the block table
  kErrAttentionBlock = 1u << 2,  // block table entry outside [0, num_blocks)
  kErrCacheSlot = 1u << 3,       // slots[t] outside [0, num_blocks * block_size)
};

// ---- Type helpers -----------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float ToFloat(T x);
template <>
__device__ __forceinline__ float ToFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float ToFloat<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// Round-to-nearest-even, like F32ToBf16 / F32ToF16 on the host.
template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>{}) with T the device type of a float dtype.
template <typename F>
absl::Status DispatchFloat(DType t, F&& f) {
  switch (t) {
    case DType::kF32:
      return f(Tag<float>{});
    case DType::kF16:
      return f(Tag<__half>{});
    case DType::kBF16:
      return f(Tag<__nv_bfloat16>{});
    default:
      return absl::InternalError(absl::StrCat("CUDA backend: no kernels for dtype ", DTypeName(t)));
  }
}

cudaDataType_t CudaDataType(DType t) {
  switch (t) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

// ---- Reductions -------------------------------------------------------------------------------
struct SumOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const {
    return a + b;
  }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ __forceinline__ long long operator()(long long a, long long b) const { return a > b ? a : b; }
};
struct MinOp {
  __device__ __forceinline__ long long operator()(long long a, long long b) const { return a < b ? a : b; }
};

template <typename V, typename Op>
__device__ __forceinline__ V WarpAllReduce(V v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Reduces v over the block; every thread gets the same result (the warp partials are combined in
// the same order by every thread). blockDim.x must be a multiple of 32; every thread must call.
// `scratch` holds 32 values and may be reused by the next call.
template <typename V, typename Op>
__device__ V BlockAllReduce(V v, Op op, V* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = WarpAllReduce(v, op);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  V r = scratch[0];
  for (int w = 1; w < warps; ++w) r = op(r, scratch[w]);
  return r;
}

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

// ---- Elementwise kernels ----------------------------------------------------------------------
#define GRID_STRIDE_LOOP(i, n)                                                      \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

template <typename T>
__global__ void EmbeddingKernel(T* out /*[n, d]*/, const T* table /*[rows, d]*/, const int32_t* ids /*[n]*/, int64_t n,
                                int64_t d, int64_t rows, int64_t row_offset) {
  GRID_STRIDE_LOOP(i, n * d) {
    const int64_t t = i / d;
    const int64_t j = i - t * d;
    const int64_t r = static_cast<int64_t>(ids[t]) - row_offset;
    out[i] = (r >= 0 && r < rows) ? table[r * d + j] : FromFloat<T>(0.0f);
  }
}

template <typename T>
__global__ void SiluMulKernel(T* out /*[n]*/, const T* gate /*[n]*/, const T* up /*[n]*/, int64_t n) {
  GRID_STRIDE_LOOP(i, n) {
    const float g = ToFloat(gate[i]);
    out[i] = FromFloat<T>(g / (1.0f + expf(-g)) * ToFloat(up[i]));
  }
}

template <typename T>
__global__ void AddKernel(T* out /*[n]*/, const T* a /*[n]*/, const T* b /*[n]*/, int64_t n) {
  GRID_STRIDE_LOOP(i, n) out[i] = FromFloat<T>(ToFloat(a[i]) + ToFloat(b[i]));
}

// out[r, c] = bias[c] for every row: the C operand of the bias GEMM (beta = 1).
template <typename TO, typename TB>
__global__ void BroadcastRowsKernel(TO* out /*[n, m]*/, const TB* bias /*[m]*/, int64_t n, int64_t m) {
  GRID_STRIDE_LOOP(i, n * m) out[i] = FromFloat<TO>(ToFloat(bias[i % m]));
}

// One thread per rotated pair. Pairs are numbered token-major, then q heads, then k heads, then
// i in [0, hd/2).
template <typename T>
__global__ void RopeKernel(T* q /*[n, q_heads * hd]*/, T* k /*[n, kv_heads * hd]*/, const int32_t* positions /*[n]*/,
                           const float* inv_freq /*[hd / 2]*/, int64_t n, int q_heads, int kv_heads, int head_dim) {
  const int half = head_dim / 2;
  const int64_t per_token = static_cast<int64_t>(q_heads + kv_heads) * half;
  GRID_STRIDE_LOOP(idx, n * per_token) {
    const int64_t t = idx / per_token;
    const int64_t r = idx - t * per_token;
    const int head = static_cast<int>(r / half);
    const int i = static_cast<int>(r - static_cast<int64_t>(head) * half);
    T* x = head < q_heads ? q + (t * q_heads + head) * head_dim : k + (t * kv_heads + (head - q_heads)) * head_dim;
    // The angle is formed in float exactly as Hugging Face does (float(pos) * inv_freq). sincosf
    // is the full-range libdevice function, not the __sinf/__cosf intrinsics: those skip proper
    // range reduction and lose accuracy fast as |angle| grows, and angles here reach
    // pos * inv_freq[0] = pos radians (tens of thousands for long contexts).
    const float angle = static_cast<float>(positions[t]) * inv_freq[i];
    float s, c;
    sincosf(angle, &s, &c);
    const float x1 = ToFloat(x[i]);
    const float x2 = ToFloat(x[i + half]);
    x[i] = FromFloat<T>(x1 * c - x2 * s);
    x[i + half] = FromFloat<T>(x2 * c + x1 * s);
  }
}

// One thread per element of k/v; `row` = kv_heads * head_dim elements per slot.
template <typename T>
__global__ void CacheWriteKernel(T* k_cache /*[num_slots, row]*/, T* v_cache /*[num_slots, row]*/,
                                 const T* k /*[n, row]*/, const T* v /*[n, row]*/, const int32_t* slots /*[n]*/,
                                 int64_t n, int64_t row, int64_t num_slots, unsigned* errors) {
  GRID_STRIDE_LOOP(i, n * row) {
    const int64_t t = i / row;
    const int64_t j = i - t * row;
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) {
      if (j == 0) atomicOr(errors, kErrCacheSlot);
      continue;
    }
    k_cache[slot * row + j] = k[i];
    v_cache[slot * row + j] = v[i];
  }
}

// ---- Row kernels ------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kRmsNormThreads)
    RmsNormKernel(T* out /*[rows, d]*/, const T* x /*[rows, d]*/, const T* w /*[d]*/, int64_t d, float eps) {
  __shared__ float scratch[32];
  const T* xr = x + static_cast<int64_t>(blockIdx.x) * d;
  T* outr = out + static_cast<int64_t>(blockIdx.x) * d;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = ToFloat(xr[i]);
    ss += v * v;
  }
  ss = BlockAllReduce(ss, SumOp{}, scratch);
  // IEEE sqrt and division (no fast-math), as the CPU reference.
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
  // Each thread rewrites only the elements it read, so out may alias x.
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) outr[i] = FromFloat<T>(ToFloat(xr[i]) * inv * ToFloat(w[i]));
}

__global__ void __launch_bounds__(kRowThreads)
    SoftmaxKernel(float* out /*[rows, v]*/, const float* x /*[rows, v]*/, int64_t v, float temperature) {
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

__global__ void __launch_bounds__(kRowThreads)
    ArgmaxKernel(int32_t* out /*[rows]*/, const float* logits /*[rows, v]*/, int64_t v) {
  __shared__ float s_val[32];
  __shared__ long long s_idx[32];
  const float* xr = logits + static_cast<int64_t>(blockIdx.x) * v;
  float bv = -INFINITY;
  long long bi = LLONG_MAX;  // "nothing yet": loses to every element, -inf included
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    if (ArgmaxBetter(xr[i], i, bv, bi)) {
      bv = xr[i];
      bi = i;
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

// ---- Attention --------------------------------------------------------------------------------
// q . k of one key, q in shared memory as float. Rows of 16 bytes' worth of T are read with one
// 16-byte load each where head_dim allows it and the row is 16-byte aligned (`vec`).
template <typename T>
__device__ __forceinline__ float DotQK(const float* q_s, const T* k, int head_dim, bool vec) {
  float dot = 0.0f;
  if (vec) {
    constexpr int kE = 16 / sizeof(T);
    const uint4* k4 = reinterpret_cast<const uint4*>(k);
    for (int i = 0; i < head_dim / kE; ++i) {
      const uint4 raw = k4[i];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < kE; ++j) dot += q_s[i * kE + j] * ToFloat(e[j]);
    }
  } else {
    for (int d = 0; d < head_dim; ++d) dot += q_s[d] * ToFloat(k[d]);
  }
  return dot;
}

// One block per (token t, query head h); blockIdx.x = t * q_heads + h. The context (positions
// 0..p of the token's sequence) is walked in chunks of kAttnChunk keys with an online softmax:
// a running max m, running denominator l and running numerator acc[] (per output dim), rescaled
// by exp(m_old - m_new) whenever the max grows. In a chunk every thread scores one key (its whole
// q . k, so a chunk's key loads are all in flight at once), then every thread owns head_dim / 128
// output dimensions and sums the chunk's weighted values, loads independent of each other. Every
// index taken from device metadata is checked; an out-of-range one sets an error bit and its key
// gets weight 0 (the output row is zero when nothing valid is left).
template <typename T>
__global__ void __launch_bounds__(kAttnThreads)
    AttentionKernel(T* out /*[n, q_heads * hd]*/, const T* q /*[n, q_heads * hd]*/,
                    const T* k_cache /*[num_blocks, block_size, kv_heads, hd]*/,
                    const T* v_cache /*[num_blocks, block_size, kv_heads, hd]*/, const int32_t* positions /*[n]*/,
                    const int32_t* token_seq /*[n]*/, const int32_t* block_tables /*[num_seqs, max_blocks]*/,
                    int q_heads, int kv_heads, int head_dim, int block_size, int64_t num_blocks, int64_t num_seqs,
                    int64_t max_blocks, float scale, unsigned* errors) {
  __shared__ float q_s[kAttnMaxHeadDim];
  __shared__ float w_s[kAttnChunk];       // softmax weights of the chunk's keys (0: skipped)
  __shared__ int64_t base_s[kAttnChunk];  // element offset of each key's head in the cache
  __shared__ float scratch_s[32];

  const int64_t t = blockIdx.x / q_heads;
  const int h = static_cast<int>(blockIdx.x - t * q_heads);
  const int kv_head = h / (q_heads / kv_heads);
  const T* qh = q + (t * q_heads + h) * head_dim;
  T* oh = out + (t * q_heads + h) * head_dim;

  const int64_t seq = token_seq[t];
  const int64_t pos = positions[t];
  const bool bad_seq = seq < 0 || seq >= num_seqs;
  const bool bad_pos = pos < 0 || pos / block_size >= max_blocks;
  if (bad_seq || bad_pos) {  // the same for every thread of the block
    if (threadIdx.x == 0) atomicOr(errors, bad_seq ? kErrAttentionSeq : kErrAttentionPos);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) oh[d] = FromFloat<T>(0.0f);
    return;
  }
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = ToFloat(qh[d]);
  __syncthreads();

  const int32_t* table = block_tables + seq * max_blocks;
  const int64_t context = pos + 1;
  const int64_t slot_elems = static_cast<int64_t>(kv_heads) * head_dim;
  const bool vec = head_dim % (16 / static_cast<int>(sizeof(T))) == 0 &&
                   reinterpret_cast<uintptr_t>(k_cache) % 16 == 0;  // then every head's row is aligned too
  float m = -INFINITY;
  float l = 0.0f;
  float acc[kAttnDimsPerThread];
#pragma unroll
  for (int r = 0; r < kAttnDimsPerThread; ++r) acc[r] = 0.0f;

  for (int64_t start = 0; start < context; start += kAttnChunk) {
    const int keys = static_cast<int>(context - start < kAttnChunk ? context - start : kAttnChunk);
    // This thread's key: its score, and where its head's row starts (0, with no weight, if none).
    float score = -INFINITY;
    int64_t base = 0;
    if (threadIdx.x < keys) {
      const int64_t j = start + threadIdx.x;
      const int64_t block = table[j / block_size];  // j / block_size <= pos / block_size < max_blocks
      if (block >= 0 && block < num_blocks) {
        base = (block * block_size + j % block_size) * slot_elems + static_cast<int64_t>(kv_head) * head_dim;
        score = DotQK(q_s, k_cache + base, head_dim, vec) * scale;
      } else {
        atomicOr(errors, kErrAttentionBlock);
      }
    }
    const float m_new = fmaxf(m, BlockAllReduce(score, MaxOp{}, scratch_s));
    if (m_new == -INFINITY) continue;  // no valid key so far (bad blocks); uniform over the block
    const float w = score == -INFINITY ? 0.0f : expf(score - m_new);
    w_s[threadIdx.x] = w;  // kAttnChunk == kAttnThreads
    base_s[threadIdx.x] = base;
    const float chunk_sum = BlockAllReduce(w, SumOp{}, scratch_s);  // its barriers also publish w_s, base_s
    const float alpha = expf(m - m_new);  // 0 on the first valid chunk (m = -inf)
    l = l * alpha + chunk_sum;
#pragma unroll
    for (int r = 0; r < kAttnDimsPerThread; ++r) {
      const int d = threadIdx.x + r * kAttnThreads;
      if (d < head_dim) {
        float a = acc[r] * alpha;
#pragma unroll 8
        for (int c = 0; c < keys; ++c) {
          // A skipped key's row is read but not used: a select, so that garbage there (NaN) never
          // reaches the sum, and the loads stay unconditional, independent of each other.
          const float wc = w_s[c];
          const float vc = ToFloat(v_cache[base_s[c] + d]);
          a += wc != 0.0f ? wc * vc : 0.0f;
        }
        acc[r] = a;
      }
    }
    m = m_new;
    __syncthreads();  // weights and offsets read before the next chunk overwrites them
  }
#pragma unroll
  for (int r = 0; r < kAttnDimsPerThread; ++r) {
    const int d = threadIdx.x + r * kAttnThreads;
    if (d < head_dim) oh[d] = FromFloat<T>(l > 0.0f ? acc[r] / l : 0.0f);
  }
}

#undef GRID_STRIDE_LOOP

// ---- Host-side checks -------------------------------------------------------------------------
std::string TensorDesc(const Tensor& t) { return absl::StrCat(t.ShapeString(), " ", DTypeName(t.dtype)); }

// InvalidArgument "<op>: <why> (name [shape] dtype, ...)".
absl::Status Invalid(const char* op, absl::string_view why,
                     std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  std::string msg = absl::StrCat(op, ": ", why, " (");
  bool first = true;
  for (const auto& [name, t] : tensors) {
    absl::StrAppend(&msg, first ? "" : ", ", name, " ", t == nullptr ? std::string("null") : TensorDesc(*t));
    first = false;
  }
  return absl::InvalidArgumentError(absl::StrCat(msg, ")"));
}

bool Is(const Tensor& t, int ndim, DType dtype) {
  if (t.ndim != ndim || t.dtype != dtype) return false;
  for (int i = 0; i < ndim; ++i) {
    if (t.shape[i] < 0) return false;
  }
  return t.numel() == 0 || t.data != nullptr;
}

bool SameShape(const Tensor& a, const Tensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.shape[i] != b.shape[i]) return false;
  }
  return true;
}

bool FitsInt(int64_t v) { return v >= 0 && v <= INT_MAX; }

// ---- The backend ------------------------------------------------------------------------------
class CudaBackend final : public Backend {
 public:
  CudaBackend(int ordinal, DType act) : ordinal_(ordinal), act_(act) {}
  ~CudaBackend() override;

  // Creates the stream, the cuBLAS handle and the fixed scratch. Called once by MakeCudaBackend;
  // on failure the destructor releases what was created.
  absl::Status Init();

  DeviceKind device_kind() const override { return DeviceKind::kCuda; }
  DType act_dtype() const override { return act_; }
  std::string Describe() const override {
    return absl::StrCat("cuda:", ordinal_, " (", device_name_, ", ", absl::AsciiStrToLower(DTypeName(act_)), ")");
  }

  absl::StatusOr<Buffer> Allocate(size_t bytes) override;
  void Free(void* data) override;
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override;
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override;
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override;
  absl::Status Fill0(void* dst, size_t bytes) override;
  absl::Status Synchronize() override;

  absl::Status Embedding(Tensor* out, const Tensor& table, const Tensor& ids, int64_t row_offset) override;
  absl::Status RmsNorm(Tensor* out, const Tensor& x, const Tensor& w, float eps) override;
  absl::Status MatMul(Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias) override;
  absl::Status Rope(Tensor* q, Tensor* k, const Tensor& positions, const Tensor& inv_freq, int head_dim) override;
  absl::Status CacheWrite(Tensor* k_cache, Tensor* v_cache, const Tensor& k, const Tensor& v,
                          const Tensor& slots) override;
  absl::Status Attention(Tensor* out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                         const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables,
                         float scale) override;
  absl::Status SiluMul(Tensor* out, const Tensor& gate, const Tensor& up) override;
  absl::Status Add(Tensor* out, const Tensor& a, const Tensor& b) override;
  absl::Status Softmax(Tensor* out, const Tensor& x, float temperature) override;
  absl::Status Argmax(Tensor* out, const Tensor& logits) override;
  absl::Status Sample(Tensor* out, const Tensor& logits, const std::vector<SampleParams>& params) override;

 private:
  absl::Status Activate() const;
  // Waits for the stream, then turns a set device error word into a Status (and clears it).
  absl::Status SyncAndCheck();
  // Where an op writes n i32 ids for `out`: `out` itself when it is this device's memory, else
  // (host memory) the ids scratch, copied back by FinishIds.
  absl::StatusOr<int32_t*> IdsTarget(const char* op, const Tensor& out, bool* to_host);
  absl::Status FinishIds(const Tensor& out, bool to_host);
  absl::Status UploadSampleParams(const std::vector<SampleParams>& params);
  template <typename T>
  absl::Status GrowDevice(T** ptr, size_t* capacity, size_t needed);

  // Constant after Init().
  const int ordinal_;
  const DType act_;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  unsigned* errors_dev_ = nullptr;   // device error word (kErr* bits)
  unsigned* errors_host_ = nullptr;  // pinned mirror, read after a stream sync
  cudaEvent_t params_copied_ = nullptr;

  // Scratch grown on demand (never shrunk), used only from the owning thread.
  SampleParams* params_dev_ = nullptr;   // [params_capacity_]
  SampleParams* params_host_ = nullptr;  // pinned staging for the upload, [params_capacity_]
  size_t params_capacity_ = 0;
  int32_t* ids_dev_ = nullptr;  // [ids_capacity_], Argmax/Sample results bound for host memory
  size_t ids_capacity_ = 0;
  // What the last Attention / CacheWrite launch allowed, for error messages.
  std::string attention_limits_;
  std::string cache_limits_;
};

CudaBackend::~CudaBackend() {
  // Errors are ignored: nothing can be done about them here, and the process may be exiting.
  (void)cudaSetDevice(ordinal_);
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  if (cublas_ != nullptr) (void)cublasDestroy(cublas_);
  if (params_dev_ != nullptr) (void)cudaFree(params_dev_);
  if (params_host_ != nullptr) (void)cudaFreeHost(params_host_);
  if (ids_dev_ != nullptr) (void)cudaFree(ids_dev_);
  if (errors_dev_ != nullptr) (void)cudaFree(errors_dev_);
  if (errors_host_ != nullptr) (void)cudaFreeHost(errors_host_);
  if (params_copied_ != nullptr) (void)cudaEventDestroy(params_copied_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

absl::Status CudaBackend::Init() {
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  cudaDeviceProp prop;
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, ordinal_));
  device_name_ = prop.name;
  // Built for sm_80 and sm_90 (with sm_80 PTX for newer GPUs); bf16 needs sm_80 anyway.
  if (prop.major < 8) {
    return absl::FailedPreconditionError(absl::StrCat("MakeCudaBackend: cuda:", ordinal_, " (", device_name_,
                                                      ") has compute capability ", prop.major, ".", prop.minor,
                                                      "; shardserve's CUDA kernels need 8.0 or newer"));
  }
  // Non-blocking: the legacy default stream, used by other libraries, never stalls ours.
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(cublasCreate(&cublas_));
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas_, stream_));
  // Default math: CUBLAS_COMPUTE_32F stays true float32 for F32 inputs (no TF32).
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&errors_dev_, sizeof(unsigned)));
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMallocHost(&errors_host_, sizeof(unsigned)));
  *errors_host_ = 0;
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(errors_dev_, 0, sizeof(unsigned), stream_));
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&params_copied_, cudaEventDisableTiming));
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

// Makes this backend's device current for the calling thread (streams and handles belong to it).
absl::Status CudaBackend::Activate() const {
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
  return absl::OkStatus();
}

absl::Status CudaBackend::SyncAndCheck() {
  SHARDSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(errors_host_, errors_dev_, sizeof(unsigned), cudaMemcpyDeviceToHost, stream_));
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  const unsigned bits = *errors_host_;
  if (bits == 0) return absl::OkStatus();
  *errors_host_ = 0;
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(errors_dev_, 0, sizeof(unsigned), stream_));
  std::string msg = "bad step metadata found on the device since the last check:";
  if (bits & kErrAttentionSeq) absl::StrAppend(&msg, " Attention: a token_seq entry outside [0, seqs);");
  if (bits & kErrAttentionPos) {
    absl::StrAppend(&msg, " Attention: a position < 0 or beyond its block table (max_blocks * block_size);");
  }
  if (bits & kErrAttentionBlock) absl::StrAppend(&msg, " Attention: a block table entry outside [0, num_blocks);");
  if (bits & (kErrAttentionSeq | kErrAttentionPos | kErrAttentionBlock)) {
    absl::StrAppend(&msg, " (last Attention had ", attention_limits_, "; those keys were skipped, rows zeroed)");
  }
  if (bits & kErrCacheSlot) {
    absl::StrAppend(&msg, " CacheWrite: a slot outside [0, num_blocks * block_size) (last CacheWrite had ",
                    cache_limits_, "; those tokens were not written);");
  }
  return absl::InvalidArgumentError(msg);
}

template <typename T>
absl::Status CudaBackend::GrowDevice(T** ptr, size_t* capacity, size_t needed) {
  if (needed <= *capacity) return absl::OkStatus();
  // Rare (the batch grew): wait for work that may still use the old buffer, then reallocate with
  // headroom so that the next few growths are free. The capacity reads 0 until the new buffer
  // exists, so a failure here leaves no stale capacity behind.
  const size_t cap = std::max<size_t>({needed, 64, 2 * *capacity});
  *capacity = 0;
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (*ptr != nullptr) SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaFree(*ptr));
  *ptr = nullptr;
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(ptr), cap * sizeof(T)));
  *capacity = cap;
  return absl::OkStatus();
}

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
  SHARDSERVE_RETURN_IF_NOT_OK(GrowDevice(&ids_dev_, &ids_capacity_, static_cast<size_t>(out.dim(0))));
  return ids_dev_;
}

absl::Status CudaBackend::FinishIds(const Tensor& out, bool to_host) {
  if (!to_host) return absl::OkStatus();
  SHARDSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(out.data, ids_dev_, out.bytes(), cudaMemcpyDeviceToHost, stream_));
  return SyncAndCheck();
}

absl::StatusOr<Buffer> CudaBackend::Allocate(size_t bytes) {
  if (bytes == 0) return Buffer(this, nullptr, 0);
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    (void)cudaMemGetInfo(&free_bytes, &total_bytes);
    return absl::ResourceExhaustedError(absl::StrCat("Allocate: cudaMalloc of ", bytes, " bytes on cuda:", ordinal_,
                                                     " failed (", cudaGetErrorName(e), "); ", free_bytes, " of ",
                                                     total_bytes, " bytes free"));
  }
  return Buffer(this, p, bytes);
}

void CudaBackend::Free(void* data) {
  if (data == nullptr) return;
  (void)cudaSetDevice(ordinal_);
  (void)cudaFree(data);  // waits for work still using it
}

absl::Status CudaBackend::CopyToDevice(void* dst, const void* host_src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || host_src == nullptr) return absl::InvalidArgumentError("CopyToDevice: null pointer");
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
  // For pinned host memory the copy is asynchronous; the caller may reuse host_src on return.
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToHost(void* host_dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (host_dst == nullptr || src == nullptr) return absl::InvalidArgumentError("CopyToHost: null pointer");
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  return SyncAndCheck();
}

absl::Status CudaBackend::CopyOnDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("CopyOnDevice: null pointer");
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::Fill0(void* dst, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("Fill0: null pointer");
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, 0, bytes, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::Synchronize() {
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  return SyncAndCheck();
}

// ---- Ops --------------------------------------------------------------------------------------

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
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    EmbeddingKernel<T><<<GridFor(n * d, kElementwiseThreads), kElementwiseThreads, 0, stream_>>>(
        out->as<T>(), table.as<const T>(), ids.as<const int32_t>(), n, d, table.dim(0), row_offset);
    SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("EmbeddingKernel");
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
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    RmsNormKernel<T><<<static_cast<unsigned>(n), kRmsNormThreads, 0, stream_>>>(out->as<T>(), x.as<const T>(),
                                                                                 w.as<const T>(), d, eps);
    SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("RmsNormKernel");
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::MatMul(Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias) {
  constexpr const char* kOp = "MatMul";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"x", &x}, {"w", &w}, {"bias", bias}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"x", &x}, {"w", &w}, {"bias", bias}};
  const bool out_ok = Is(*out, 2, DType::kF32) || Is(*out, 2, act_);
  if (!out_ok || !Is(x, 2, act_) || !Is(w, 2, act_) || (bias != nullptr && !Is(*bias, 1, act_))) {
    return Invalid(kOp,
                   absl::StrCat("expected out [n, m] F32 or ", DTypeName(act_), ", x [n, k], w [m, k], bias [m] or null, ",
                                "all ", DTypeName(act_)),
                   all);
  }
  const int64_t n = x.dim(0), k = x.dim(1), m = w.dim(0);
  if (w.dim(1) != k || out->dim(0) != n || out->dim(1) != m || (bias != nullptr && bias->dim(0) != m)) {
    return Invalid(kOp, "shapes do not match", all);
  }
  if (!FitsInt(n) || !FitsInt(m) || !FitsInt(k)) return Invalid(kOp, "a dimension exceeds cuBLAS's int range", all);
  if (n == 0 || m == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());

  // With a bias, out starts as the bias broadcast over rows and the GEMM accumulates onto it
  // (beta = 1), so x @ w^T + bias is rounded once, in float32 inside cuBLAS.
  float beta = 0.0f;
  if (bias != nullptr) {
    SHARDSERVE_RETURN_IF_NOT_OK(DispatchFloat(act_, [&](auto tag) -> absl::Status {
      using T = typename decltype(tag)::type;
      const unsigned grid = GridFor(n * m, kElementwiseThreads);
      if (out->dtype == DType::kF32) {
        BroadcastRowsKernel<float, T>
            <<<grid, kElementwiseThreads, 0, stream_>>>(out->as<float>(), bias->as<const T>(), n, m);
      } else {
        BroadcastRowsKernel<T, T><<<grid, kElementwiseThreads, 0, stream_>>>(out->as<T>(), bias->as<const T>(), n, m);
      }
      SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("BroadcastRowsKernel");
      return absl::OkStatus();
    }));
    beta = 1.0f;
  }
  if (k == 0) return bias != nullptr ? absl::OkStatus() : Fill0(out->data, out->bytes());

  // Row-major out[n, m] = x[n, k] @ w[m, k]^T. cuBLAS is column-major, and a row-major [r, c]
  // matrix is the column-major [c, r] matrix (its transpose) with leading dimension c. So in
  // cuBLAS terms we compute the column-major out^T[m, n] = w[m, k] * x^T[k, n]:
  //   A = w: column-major [k, m] with ld k (that is w^T), op(A) = T  -> [m, k]
  //   B = x: column-major [k, n] with ld k (that is x^T), op(B) = N  -> [k, n]
  //   C = out: column-major [m, n] with ld m (that is out^T)
  // GEMM sizes (m, n, k) = (m, n, k). Compute in float32 (CUBLAS_COMPUTE_32F; alpha and beta are
  // float); for F16/BF16 inputs cuBLAS uses tensor cores with float32 accumulation.
  const float alpha = 1.0f;
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
      cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha,
      w.data, CudaDataType(act_), static_cast<int>(k), x.data, CudaDataType(act_), static_cast<int>(k), &beta,
      out->data, CudaDataType(out->dtype), static_cast<int>(m), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

absl::Status CudaBackend::Rope(Tensor* q, Tensor* k, const Tensor& positions, const Tensor& inv_freq, int head_dim) {
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
                                ", positions [n] I32, inv_freq [hd / 2] F32"),
                   all);
  }
  if (head_dim <= 0 || head_dim % 2 != 0) {
    return Invalid(kOp, absl::StrCat("head_dim must be positive and even, got ", head_dim), all);
  }
  const int64_t n = q->dim(0);
  if (k->dim(0) != n || positions.dim(0) != n || q->dim(1) % head_dim != 0 || k->dim(1) % head_dim != 0 ||
      inv_freq.dim(0) != head_dim / 2) {
    return Invalid(kOp, absl::StrCat("shapes do not match head_dim ", head_dim), all);
  }
  const int64_t q_heads = q->dim(1) / head_dim, kv_heads = k->dim(1) / head_dim;
  if (!FitsInt(q_heads + kv_heads)) return Invalid(kOp, "too many heads", all);
  const int64_t pairs = n * (q_heads + kv_heads) * (head_dim / 2);
  if (pairs == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    RopeKernel<T><<<GridFor(pairs, kElementwiseThreads), kElementwiseThreads, 0, stream_>>>(
        q->as<T>(), k->as<T>(), positions.as<const int32_t>(), inv_freq.as<const float>(), n,
        static_cast<int>(q_heads), static_cast<int>(kv_heads), head_dim);
    SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("RopeKernel");
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::CacheWrite(Tensor* k_cache, Tensor* v_cache, const Tensor& k, const Tensor& v,
                                     const Tensor& slots) {
  constexpr const char* kOp = "CacheWrite";
  if (k_cache == nullptr || v_cache == nullptr) {
    return Invalid(kOp, "k_cache and v_cache must not be null", {{"k_cache", k_cache}, {"v_cache", v_cache}});
  }
  const auto all = {std::pair<const char*, const Tensor*>{"k_cache", k_cache},
                    {"v_cache", v_cache},
                    {"k", &k},
                    {"v", &v},
                    {"slots", &slots}};
  if (!Is(*k_cache, 4, act_) || !Is(*v_cache, 4, act_) || !Is(k, 2, act_) || !Is(v, 2, act_) ||
      !Is(slots, 1, DType::kI32)) {
    return Invalid(kOp,
                   absl::StrCat("expected caches [blocks, bs, kv_heads, hd] and k, v [n, kv_heads * hd] ",
                                DTypeName(act_), ", slots [n] I32"),
                   all);
  }
  const int64_t n = k.dim(0), row = k_cache->dim(2) * k_cache->dim(3);
  if (!SameShape(*k_cache, *v_cache) || !SameShape(k, v) || k.dim(1) != row || slots.dim(0) != n) {
    return Invalid(kOp, "shapes do not match", all);
  }
  if (n * row == 0) return absl::OkStatus();
  const int64_t num_slots = k_cache->dim(0) * k_cache->dim(1);
  cache_limits_ = absl::StrCat("num_blocks ", k_cache->dim(0), ", block_size ", k_cache->dim(1));
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    CacheWriteKernel<T><<<GridFor(n * row, kElementwiseThreads), kElementwiseThreads, 0, stream_>>>(
        k_cache->as<T>(), v_cache->as<T>(), k.as<const T>(), v.as<const T>(), slots.as<const int32_t>(), n, row,
        num_slots, errors_dev_);
    SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("CacheWriteKernel");
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::Attention(Tensor* out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                    const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables,
                                    float scale) {
  constexpr const char* kOp = "Attention";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"q", &q}, {"k_cache", &k_cache}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out},
                    {"q", &q},
                    {"k_cache", &k_cache},
                    {"v_cache", &v_cache},
                    {"positions", &positions},
                    {"token_seq", &token_seq},
                    {"block_tables", &block_tables}};
  if (!Is(*out, 2, act_) || !Is(q, 2, act_) || !Is(k_cache, 4, act_) || !Is(v_cache, 4, act_) ||
      !Is(positions, 1, DType::kI32) || !Is(token_seq, 1, DType::kI32) || !Is(block_tables, 2, DType::kI32)) {
    return Invalid(kOp,
                   absl::StrCat("expected out, q [n, q_heads * hd] and caches [blocks, bs, kv_heads, hd] ",
                                DTypeName(act_), ", positions and token_seq [n] I32, block_tables [seqs, max_blocks] I32"),
                   all);
  }
  const int64_t n = q.dim(0), num_blocks = k_cache.dim(0), block_size = k_cache.dim(1), kv_heads = k_cache.dim(2),
                head_dim = k_cache.dim(3);
  if (!SameShape(*out, q) || !SameShape(k_cache, v_cache) || positions.dim(0) != n || token_seq.dim(0) != n) {
    return Invalid(kOp, "shapes do not match", all);
  }
  if (head_dim <= 0 || head_dim > kAttnMaxHeadDim || block_size <= 0 || kv_heads <= 0) {
    return Invalid(kOp,
                   absl::StrCat("need 0 < head_dim <= ", kAttnMaxHeadDim, ", block_size > 0 and kv_heads > 0"), all);
  }
  if (q.dim(1) % head_dim != 0 || (q.dim(1) / head_dim) % kv_heads != 0) {
    return Invalid(kOp,
                   absl::StrCat("q's width ", q.dim(1), " is not q_heads * head_dim with q_heads a multiple of kv_heads ",
                                kv_heads, " (head_dim ", head_dim, ")"),
                   all);
  }
  const int64_t q_heads = q.dim(1) / head_dim;
  if (n == 0 || q_heads == 0) return absl::OkStatus();
  if (!FitsInt(n * q_heads) || !FitsInt(block_size)) return Invalid(kOp, "too many (token, head) pairs", all);
  attention_limits_ = absl::StrCat("seqs ", block_tables.dim(0), ", max_blocks ", block_tables.dim(1), ", num_blocks ",
                                   num_blocks, ", block_size ", block_size);
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    AttentionKernel<T><<<static_cast<unsigned>(n * q_heads), kAttnThreads, 0, stream_>>>(
        out->as<T>(), q.as<const T>(), k_cache.as<const T>(), v_cache.as<const T>(), positions.as<const int32_t>(),
        token_seq.as<const int32_t>(), block_tables.as<const int32_t>(), static_cast<int>(q_heads),
        static_cast<int>(kv_heads), static_cast<int>(head_dim), static_cast<int>(block_size), num_blocks,
        block_tables.dim(0), block_tables.dim(1), scale, errors_dev_);
    SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("AttentionKernel");
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::SiluMul(Tensor* out, const Tensor& gate, const Tensor& up) {
  constexpr const char* kOp = "SiluMul";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"gate", &gate}, {"up", &up}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"gate", &gate}, {"up", &up}};
  if (!Is(*out, 2, act_) || !Is(gate, 2, act_) || !Is(up, 2, act_)) {
    return Invalid(kOp, absl::StrCat("expected out, gate, up [n, f] ", DTypeName(act_)), all);
  }
  if (!SameShape(*out, gate) || !SameShape(*out, up)) return Invalid(kOp, "shapes do not match", all);
  const int64_t count = out->numel();
  if (count == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    SiluMulKernel<T><<<GridFor(count, kElementwiseThreads), kElementwiseThreads, 0, stream_>>>(
        out->as<T>(), gate.as<const T>(), up.as<const T>(), count);
    SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("SiluMulKernel");
    return absl::OkStatus();
  });
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
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    AddKernel<T><<<GridFor(count, kElementwiseThreads), kElementwiseThreads, 0, stream_>>>(
        out->as<T>(), a.as<const T>(), b.as<const T>(), count);
    SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("AddKernel");
    return absl::OkStatus();
  });
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
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  SoftmaxKernel<<<static_cast<unsigned>(n), kRowThreads, 0, stream_>>>(out->as<float>(), x.as<const float>(), v,
                                                                        temperature);
  SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("SoftmaxKernel");
  return absl::OkStatus();
}

absl::Status CudaBackend::Argmax(Tensor* out, const Tensor& logits) {
  constexpr const char* kOp = "Argmax";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"logits", &logits}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"logits", &logits}};
  if (!Is(*out, 1, DType::kI32) || !Is(logits, 2, DType::kF32)) {
    return Invalid(kOp, "expected out [n] I32 and logits [n, v] F32", all);
  }
  const int64_t n = logits.dim(0), v = logits.dim(1);
  if (out->dim(0) != n) return Invalid(kOp, "shapes do not match", all);
  if (n == 0) return absl::OkStatus();
  if (v == 0) return Invalid(kOp, "empty vocabulary", all);
  if (!FitsInt(n) || !FitsInt(v)) return Invalid(kOp, "n and v must fit in int32", all);
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  bool to_host = false;
  absl::StatusOr<int32_t*> target = IdsTarget(kOp, *out, &to_host);
  if (!target.ok()) return target.status();
  ArgmaxKernel<<<static_cast<unsigned>(n), kRowThreads, 0, stream_>>>(*target, logits.as<const float>(), v);
  SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("ArgmaxKernel");
  return FinishIds(*out, to_host);
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
  SHARDSERVE_RETURN_IF_NOT_OK(Activate());
  SHARDSERVE_RETURN_IF_NOT_OK(UploadSampleParams(params));
  bool to_host = false;
  absl::StatusOr<int32_t*> target = IdsTarget(kOp, *out, &to_host);
  if (!target.ok()) return target.status();
  SampleKernel<<<static_cast<unsigned>(n), kRowThreads, 0, stream_>>>(*target, logits.as<const float>(), params_dev_,
                                                                       v);
  SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("SampleKernel");
  return FinishIds(*out, to_host);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int ordinal, DType act) {
  if (act != DType::kF32 && act != DType::kF16 && act != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("MakeCudaBackend: activation dtype ", DTypeName(act),
                                                   " is not supported; use F32, F16 or BF16"));
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("MakeCudaBackend(cuda:", ordinal, "): no usable CUDA device (",
                                               cudaGetErrorName(e), ": ", cudaGetErrorString(e), ")"));
  }
  if (count == 0) {
    return absl::UnavailableError(absl::StrCat("MakeCudaBackend(cuda:", ordinal, "): no CUDA device on this machine"));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrCat("MakeCudaBackend: device ordinal ", ordinal,
                                                   " is out of range; this machine has ", count,
                                                   " CUDA device(s), ordinals 0..", count - 1));
  }
  auto backend = std::make_unique<CudaBackend>(ordinal, act);
  SHARDSERVE_RETURN_IF_NOT_OK(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace shardserve
