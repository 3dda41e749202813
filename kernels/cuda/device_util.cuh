// Device-side helpers the CUDA kernels share: conversions between the activation types and float,
// warp and block reductions, and the grid-stride loop. Internal to kernels/cuda/.
#ifndef SHARDSERVE_KERNELS_CUDA_DEVICE_UTIL_CUH_
#define SHARDSERVE_KERNELS_CUDA_DEVICE_UTIL_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace shardserve::cuda {

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

// SwiGLU's silu(g) x u, in float32: one home for SiluMul's kernel and the dense GEMV's fused SiLU,
// so that the two give the same bits.
__device__ __forceinline__ float SiluTimes(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// ---- Programmatic dependent launch (CudaBackend::Launch, CudaBackendOptions::pdl) -------------
// Every kernel CudaBackend::Launch starts calls this before it reads or writes a buffer that an
// earlier kernel of the stream may touch: it waits until the kernels ahead have finished and their
// writes are visible, then lets the next kernel's blocks be scheduled as this kernel's blocks
// start. Below sm_90, nothing; for a launch without the attribute both instructions return at
// once (the PTX ISA: no prerequisite grid is in flight, no dependent waits).
__device__ __forceinline__ void WaitForPriorKernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Asks L2 for the line holding p (weights, which no kernel writes: before WaitForPriorKernels). The
// GEMVs do it only when launched with PDL (their `prefetch` argument).
__device__ __forceinline__ void PrefetchL2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

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

// ---- Grid-stride loop -------------------------------------------------------------------------
#define GRID_STRIDE_LOOP(i, n)                                                      \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

}  // namespace shardserve::cuda

#endif  // SHARDSERVE_KERNELS_CUDA_DEVICE_UTIL_CUH_
