// The dense GEMV: MatMul by a weight in the act dtype for n <= kGemvMaxRows rows of x (decode),
// in place of cuBLAS, behind CudaBackendOptions::dense_gemv (worker --cuda-dense-gemv; written
// without a GPU, off by default until it passes on one: docs/gpu.md).
//
// Why: on the H200 cuBLAS multiplies one row by Llama-3-8B's 4096-wide weights with split-K kernels
// and a reduction kernel after each: q at 56% of the memory roofline, k and v at 24%, o at ~56%,
// down at ~70% (+ its reduction), gate and up at 81%; 77% of a decode step's GPU time
// (docs/benchmarks.md, 2026-11-28). One row reads each weight once; the time is the weight's bytes
// if enough of them are in flight.
//
// How: gemv.cuh's block (four warps on kGemvRows output rows, the input split among all 128
// threads), each thread loading kDenseSteps runs of 8 weights of each row (16 bytes of bf16 / f16,
// 32 of f32) before using the first: 128 bytes in flight a thread in 16-bit, a 4096-wide row in one
// round. Sums in float32 (each thread's runs in order, then the warps' in a fixed order: a row's
// result does not depend on what else is in the batch), bias added, rounded once to out's dtype.
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_backend.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemv.cuh"

namespace shardserve::cuda {
namespace {

// Runs of 8 weights a thread loads from each row before the first is used.
constexpr int kDenseSteps = 4;

// out [n, m] = x [n, k] @ w [m, k]^T + bias: block b computes output rows kGemvRows b + [0,
// kGemvRows), for N input rows (those past n skipped). x's and w's rows are 16-byte aligned and k
// % 8 == 0 (the host checks), so each run of 8 is wholly inside a row or wholly past its end (0).
template <typename T, typename TO, int N>
__global__ void __launch_bounds__(kGemvThreads)
    DenseGemvKernel(TO* __restrict__ out /*[n, m]*/, const T* __restrict__ x /*[n, k]*/,
                    const T* __restrict__ w /*[m, k]*/, const T* __restrict__ bias /*[m] or null*/, int n, int m,
                    int k) {
  constexpr int R = kGemvRows;
  constexpr int kStride = kGemvThreads * 8;
  const int r0 = static_cast<int>(blockIdx.x) * R;
  const T* wr[R];
#pragma unroll
  for (int rr = 0; rr < R; ++rr) wr[rr] = w + static_cast<int64_t>(min(r0 + rr, m - 1)) * k;  // past m: not written
  float acc[R][N];
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[rr][i] = 0.0f;
  }
  for (int base = static_cast<int>(threadIdx.x) * 8; base < k; base += kStride * kDenseSteps) {
    float wv[kDenseSteps][R][8];
#pragma unroll
    for (int l = 0; l < kDenseSteps; ++l) {
#pragma unroll
      for (int rr = 0; rr < R; ++rr) LoadX8<T, true>(wr[rr], base + kStride * l, k, wv[l][rr]);
    }
#pragma unroll
    for (int l = 0; l < kDenseSteps; ++l) {
      const int c = base + kStride * l;
      if (c >= k) break;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if (i < n) {  // the same for the whole block
          float xv[8];
          LoadX8<T, true>(x + static_cast<int64_t>(i) * k, c, k, xv);
#pragma unroll
          for (int rr = 0; rr < R; ++rr) {
            float d = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) d = fmaf(wv[l][rr][j], xv[j], d);
            acc[rr][i] += d;
          }
        }
      }
    }
  }
  FinishRows<T, TO, N>(out, acc, nullptr, bias, n, m, r0);
}

}  // namespace

bool CudaBackend::TakesDenseGemv(const Tensor& x, const Tensor& w) const {
  const int64_t n = x.dim(0), k = x.dim(1);
  return options_.dense_gemv && n >= 1 && n <= kGemvMaxRows && k > 0 && k <= kGemvMaxK && k % 8 == 0 &&
         Aligned(x.data, 16) && Aligned(w.data, 16);  // (MatMul has checked that m fits an int)
}

absl::Status CudaBackend::DenseGemv(Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias) {
  const int rows = static_cast<int>(x.dim(0)), k = static_cast<int>(x.dim(1)), m = static_cast<int>(w.dim(0));
  const auto grid = static_cast<unsigned>(CeilDiv(m, kGemvRows));
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    const T* xs = x.as<const T>();
    const T* ws = w.as<const T>();
    const T* b = bias != nullptr ? bias->as<const T>() : nullptr;
    auto launch = [&](auto* y) -> absl::Status {
      using TO = std::remove_pointer_t<decltype(y)>;
      return ForGemvInstance(rows, true, [&](auto kn, auto) -> absl::Status {
        DenseGemvKernel<T, TO, kn()><<<grid, kGemvThreads, 0, stream_>>>(y, xs, ws, b, rows, m, k);
        SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("DenseGemvKernel");
        return absl::OkStatus();
      });
    };
    return out->dtype == DType::kF32 ? launch(out->as<float>()) : launch(out->as<T>());
  });
}

}  // namespace shardserve::cuda
