// The decode GEMVs' shared parts (n <= kGemvMaxRows rows of x): the block shape, the loads of x,
// the reduction of a block's sums into its output rows, and the dispatch of an instance per
// input-row count. Used by the quantized-weight GEMVs (quant_matmul.cu) and the dense one
// (gemv.cu).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "kernels/cuda/device_util.cuh"

namespace shardserve::cuda {

// Rows of x (tokens) up to which MatMul takes a GEMV: decode batches. Above, the weight is read
// once for all rows by cuBLAS (a quantized one after dequantizing); at 8 rows the GEMV's x traffic (L2) is still far
// below its weight traffic.
inline constexpr int kGemvMaxRows = 8;
// The GEMVs index a row in int, a step or a group past the last input included; rows longer than
// this (none a model has) take the dequantize + cuBLAS path.
inline constexpr int64_t kGemvMaxK = int64_t{1} << 30;
// A GEMV block: 128 threads (four warps) compute kGemvRows output rows together, splitting the
// input dimension among all of them, so the grid is ceil(m / kGemvRows) blocks: 512 for the 8B's
// 1024-row products, enough blocks for every SM and enough loads in flight on each to cover the
// memory latency (an H100 needs ~15 KB per SM; here a 1024 x 4096 int4 weight is about 18 KB per
// SM of the H200, all asked for at once). Each input value a thread loads serves both rows.
//
// The instances are few and short, on purpose: the first of these GEMVs computed eight input rows
// in one fully unrolled body (120 KB of code, 128 registers per instance, sm_90), which each warp
// ran once for a 4096-input row: Nsight Compute found them latency-bound, neither DRAM nor the SMs
// busy (the code fetched from L2). Now the input-row count is a template argument N (1, 2, 4 or 8:
// n rounded up, the rows past n skipped) and the aligned, vectorized case is an instance of its
// own; `nvcc -Xptxas -v` and the cubin's section sizes give each instance's registers and bytes
// (docs/gpu.md, "Quantized weights on CUDA").
inline constexpr int kGemvWarps = 4;
inline constexpr int kGemvThreads = kGemvWarps * 32;
inline constexpr int kGemvRows = 2;

// A 16-bit act value's bits as float (exact).
template <typename T>
__device__ __forceinline__ float HalfBitsToFloat(uint32_t bits);
template <>
__device__ __forceinline__ float HalfBitsToFloat<__half>(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}
template <>
__device__ __forceinline__ float HalfBitsToFloat<__nv_bfloat16>(uint32_t bits) {
  return __uint_as_float(bits << 16);
}

// v[j] = row[c + j] for j < 8, 0 at and past k. kVec: the row is 16-byte aligned and k % 8 == 0
// (checked by the host), and c is a multiple of 8, so a run of 8 is wholly in the row or wholly
// past it, one or two 16-byte loads.
template <typename T, bool kVec>
__device__ __forceinline__ void LoadX8(const T* row, int c, int k, float v[8]) {
  if constexpr (kVec) {
    if (c >= k) {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = 0.0f;
    } else if constexpr (sizeof(T) == 4) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(row + c));
      const float4 b = __ldg(reinterpret_cast<const float4*>(row + c + 4));
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(row + c));
      const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[2 * j] = HalfBitsToFloat<T>(words[j] & 0xFFFFu);
        v[2 * j + 1] = HalfBitsToFloat<T>(words[j] >> 16);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = c + j < k ? ToFloat(row[c + j]) : 0.0f;
  }
}

// part[w][rr][i] = warp w's sum of acc[rr][i] (by shuffles), then a barrier. Every thread of the
// block calls. R: the block's output rows (kGemvRows, or the int4 folded GEMV's kFoldRows).
template <int R, int N>
__device__ __forceinline__ void WarpSums(float (&part)[kGemvWarps][R][N], const float (&acc)[R][N]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float v = WarpAllReduce(acc[rr][i], SumOp{});
      if (lane == 0) part[warp][rr][i] = v;
    }
  }
  __syncthreads();
}

// The block's sum of row rr, input row i: the warps' sums in a fixed order, times scale s, plus
// bias b: the same bits for an input row whatever else is in the batch.
template <int R, int N>
__device__ __forceinline__ float BlockRowSum(const float (&part)[kGemvWarps][R][N], int rr, int i, float s, float b) {
  float sum = part[0][rr][i];
#pragma unroll
  for (int w = 1; w < kGemvWarps; ++w) sum += part[w][rr][i];
  return sum * s + b;
}

// out[i][r0 + rr] = (the block's sum of acc[rr][i]) x scale[r0 + rr] (1 when null) + bias, for
// the rows below m and the input rows below n, rounded once. Every thread of the block calls.
template <typename T, typename TO, int N, int R>
__device__ __forceinline__ void FinishRows(TO* out, const float (&acc)[R][N], const float* scale, const T* bias, int n,
                                           int m, int r0) {
  static_assert(R * N <= kGemvThreads, "a thread an output");
  __shared__ float part[kGemvWarps][R][N];
  WarpSums(part, acc);
  if (threadIdx.x < R * N) {
    const int rr = threadIdx.x / N, i = threadIdx.x % N, r = r0 + rr;
    if (i < n && r < m) {
      const float s = scale != nullptr ? __ldg(scale + r) : 1.0f;
      const float b = bias != nullptr ? ToFloat(bias[r]) : 0.0f;
      out[static_cast<int64_t>(i) * m + r] = FromFloat<TO>(BlockRowSum(part, rr, i, s, b));
    }
  }
}

// Calls f(std::integral_constant<int, N>, std::bool_constant<kVec>) for the GEMV instance that
// covers n (1 <= n <= kGemvMaxRows) input rows: N = n rounded up to 1, 2, 4 or 8 on the vector path;
// 8 (the rows past n skipped) on the byte path, which only odd shapes take.
template <typename F>
absl::Status ForGemvInstance(int n, bool vec, F&& f) {
  if (!vec) return f(std::integral_constant<int, kGemvMaxRows>{}, std::false_type{});
  if (n == 1) return f(std::integral_constant<int, 1>{}, std::true_type{});
  if (n == 2) return f(std::integral_constant<int, 2>{}, std::true_type{});
  if (n <= 4) return f(std::integral_constant<int, 4>{}, std::true_type{});
  return f(std::integral_constant<int, kGemvMaxRows>{}, std::true_type{});
}

inline bool Aligned(const void* p, size_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

}  // namespace shardserve::cuda
