// The dense GEMV: MatMul by a weight in the act dtype for n <= kGemvMaxRows rows of x (decode),
// in place of cuBLAS, behind CudaBackendOptions::dense_gemv (on in the worker since it passed on an
// H200, 2026-11-28; --no-cuda-dense-gemv: docs/gpu.md).
//
// Why: on the H200 cuBLAS multiplies one row by Llama-3-8B's 4096-wide weights with split-K kernels
// and a reduction kernel after each: q at 56% of the memory roofline, k and v at 24%, o at ~56%,
// down at ~70% (+ its reduction), gate and up at 81%; 77% of a decode step's GPU time
// (Nsight Compute on an H200). One row reads each weight once; the time is the weight's bytes
// if enough of them are in flight.
//
// How: gemv.cuh's block (four warps on kGemvRows output rows, the input split among all 128
// threads), each thread loading kDenseSteps runs of 8 weights of each row (16 bytes of bf16 / f16,
// 32 of f32; kDenseLongSteps for longer rows) before using the first, held as stored until used:
// 128 bytes in flight a thread in 16-bit, a 4096-wide row in one round. Sums in float32 (each
// thread's runs in order, then the warps' in a fixed order: a row's result does not depend on what
// else is in the batch), bias added, rounded once to out's dtype.
//
// Several products of one x (Backend::MatMuls: a layer's q, k and v; gate and up) are one launch,
// the blocks split among them: on the H200 k and v alone (1,024 x 4,096) took 6.4 us each for 8.4
// MB, 29% of the roofline, most of it the launch and the ramp of a kernel whose whole weight is in
// flight at once (Nsight Compute). Each output row is computed by the same code
// whether its product is launched alone or with others: the same bits.
//
// With CudaBackendOptions::fused_kernels (passed on an H200, 2026-11-28), Backend::GateUpSilu's
// gate and up are one launch whose blocks each compute a row of both and write silu x up from
// there, rounded as MatMuls then SiluMul round (DenseGemvKernel's kSilu): no SiLU kernel, no pass
// over gate and up.
#include <cstdint>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "kernels/cuda/cuda_backend.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemv.cuh"

namespace shardserve::cuda {
namespace {

// Runs of 8 weights a thread loads from each row before the first is used: 4 (a 4096-wide row in
// one round of 128 threads), or 8 for rows longer than that (Llama-3-8B's down: 14,336, two rounds
// in place of four; with 4, down read at 66% of the roofline on the H200).
constexpr int kDenseSteps = 4;
constexpr int kDenseLongSteps = 8;

// Eight weights of T as stored, held until used (not widened to float at the load: half the
// registers in 16-bit, so that more loads fit in flight): one 16-byte load in 16-bit, two in float32.
template <typename T>
struct Raw8 {
  uint4 u;
};
template <>
struct Raw8<float> {
  float4 a, b;
};

// row[c, c + 8) as stored; zeros at and past k (the host checks k % 8 == 0, so a run is wholly
// inside the row or wholly past it).
template <typename T>
__device__ __forceinline__ Raw8<T> LoadRaw8(const T* row, int c, int k) {
  Raw8<T> r;
  if constexpr (sizeof(T) == 4) {
    r.a = c < k ? __ldg(reinterpret_cast<const float4*>(row + c)) : make_float4(0, 0, 0, 0);
    r.b = c < k ? __ldg(reinterpret_cast<const float4*>(row + c + 4)) : make_float4(0, 0, 0, 0);
  } else {
    r.u = c < k ? __ldg(reinterpret_cast<const uint4*>(row + c)) : make_uint4(0, 0, 0, 0);
  }
  return r;
}

// The eight as float (exact), v[j] = element j.
template <typename T>
__device__ __forceinline__ void WidenRaw8(const Raw8<T>& r, float v[8]) {
  if constexpr (sizeof(T) == 4) {
    v[0] = r.a.x, v[1] = r.a.y, v[2] = r.a.z, v[3] = r.a.w, v[4] = r.b.x, v[5] = r.b.y, v[6] = r.b.z, v[7] = r.b.w;
  } else {
    const uint32_t words[4] = {r.u.x, r.u.y, r.u.z, r.u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[2 * j] = HalfBitsToFloat<T>(words[j] & 0xFFFFu);
      v[2 * j + 1] = HalfBitsToFloat<T>(words[j] >> 16);
    }
  }
}

// Each product of one launch: out [n, m] = x [n, k] @ w [m, k]^T + bias (null: none), computed by
// the launch's blocks from the previous product's `end` up to its own (ceil(m / kGemvRows) blocks).
template <typename T, typename TO>
struct DenseGemvProducts {
  TO* out[kDenseGemvMaxProducts];
  const T* w[kDenseGemvMaxProducts];
  const T* bias[kDenseGemvMaxProducts];
  int m[kDenseGemvMaxProducts];
  int end[kDenseGemvMaxProducts];
  int count;
  bool prefetch;  // the first round's weights asked of L2 before WaitForPriorKernels (launched with PDL)
};

// Block b computes output rows kGemvRows (b - start) + [0, kGemvRows) of the product whose blocks
// hold b, for N input rows (those past n skipped): a row's sums are the same whatever else the
// launch computes. x's and w's rows are 16-byte aligned and k % 8 == 0 (the host checks), so each
// run of 8 is wholly inside a row or wholly past its end (0).
//
// kSilu (Backend::GateUpSilu; TO = T): the products are gate (w[0]) and up (w[1]) of m rows each,
// the grid m blocks, block b computing row b of both (the same sums as above: the row's code does
// not depend on which block runs it) and writing silu x up to out[0]'s row b, each product rounded
// to T first as MatMuls would store it, then SiluMul's arithmetic (SiluTimes): the same bits.
template <typename T, typename TO, int N, int kSteps, bool kSilu = false>
__global__ void __launch_bounds__(kGemvThreads)
    DenseGemvKernel(const DenseGemvProducts<T, TO> g, const T* __restrict__ x /*[n, k]*/, int n, int k) {
  constexpr int R = kGemvRows;
  static_assert(!kSilu || R == 2, "a fused SiLU block computes one row of gate and one of up");
  constexpr int kStride = kGemvThreads * 8;
  const int b = static_cast<int>(blockIdx.x);
  // This block's product, its fields read at constant indexes (a kernel parameter indexed at run
  // time would be copied to local memory).
  TO* out = g.out[0];
  const T* w = g.w[0];
  const T* bias = g.bias[0];
  int m = g.m[0], start = 0;
  if constexpr (!kSilu) {
#pragma unroll
    for (int p = 1; p < kDenseGemvMaxProducts; ++p) {
      if (p < g.count && b >= g.end[p - 1]) out = g.out[p], w = g.w[p], bias = g.bias[p], m = g.m[p], start = g.end[p - 1];
    }
  }
  const int r0 = (b - start) * (kSilu ? 1 : R);
  const T* wr[R];
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    wr[rr] = kSilu ? g.w[rr] + static_cast<int64_t>(r0) * k
                   : w + static_cast<int64_t>(min(r0 + rr, m - 1)) * k;  // past m: not written
  }
  // Launched with PDL: the first round's weight lines into L2 while the kernel ahead drains (no
  // kernel writes weights), a thread a 128-byte line.
  if (g.prefetch) {
#pragma unroll
    for (int l = 0; l < kSteps; ++l) {
      const int c = static_cast<int>(threadIdx.x) * 8 + kStride * l;
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        if (c < k && ((c * sizeof(T)) & 127) == 0) PrefetchL2(wr[rr] + c);
      }
    }
  }
  WaitForPriorKernels();  // CudaBackend::Launch
  float acc[R][N] = {};
  for (int base = static_cast<int>(threadIdx.x) * 8; base < k; base += kStride * kSteps) {
    Raw8<T> raw[kSteps][R];
#pragma unroll
    for (int l = 0; l < kSteps; ++l) {
#pragma unroll
      for (int rr = 0; rr < R; ++rr) raw[l][rr] = LoadRaw8(wr[rr], base + kStride * l, k);
    }
#pragma unroll
    for (int l = 0; l < kSteps; ++l) {
      const int c = base + kStride * l;
      if (c >= k) break;
      float wv[R][8];
#pragma unroll
      for (int rr = 0; rr < R; ++rr) WidenRaw8(raw[l][rr], wv[rr]);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if (i < n) {  // the same for the whole block
          float xv[8];
          LoadX8<T, true>(x + static_cast<int64_t>(i) * k, c, k, xv);
#pragma unroll
          for (int rr = 0; rr < R; ++rr) {
            float d = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) d = fmaf(wv[rr][j], xv[j], d);
            acc[rr][i] += d;
          }
        }
      }
    }
  }
  if constexpr (kSilu) {
    __shared__ float part[kGemvWarps][kGemvRows][N];
    WarpSums(part, acc);
    const int i = static_cast<int>(threadIdx.x);
    if (i < N && i < n) {
      const float gate = ToFloat(FromFloat<TO>(BlockRowSum(part, 0, i, 1.0f, 0.0f)));
      const float up = ToFloat(FromFloat<TO>(BlockRowSum(part, 1, i, 1.0f, 0.0f)));
      out[static_cast<int64_t>(i) * m + r0] = FromFloat<TO>(SiluTimes(gate, up));
    }
  } else {
    FinishRows<T, TO, N>(out, acc, nullptr, bias, n, m, r0);
  }
}

}  // namespace

bool CudaBackend::TakesDenseGemv(const Tensor& x, const Tensor& w) const {
  const int64_t n = x.dim(0), k = x.dim(1);
  return options_.dense_gemv && n >= 1 && n <= kGemvMaxRows && k > 0 && k <= kGemvMaxK && k % 8 == 0 &&
         Aligned(x.data, 16) && Aligned(w.data, 16);  // (MatMul has checked that m fits an int)
}

absl::Status CudaBackend::DenseGemv(const Tensor& x, absl::Span<const MatMulProduct> products, bool silu) {
  const int rows = static_cast<int>(x.dim(0)), k = static_cast<int>(x.dim(1));
  if (products.empty() || products.size() > static_cast<size_t>(kDenseGemvMaxProducts)) {
    return absl::InternalError(absl::StrCat("DenseGemv: ", products.size(), " products in one launch"));
  }
  if (silu && (products.size() != 2 || products[0].out->dtype != act_ || !SameShape(*products[0].w, *products[1].w))) {
    return absl::InternalError("DenseGemv: a fused SiLU takes gate and up of one shape, act-dtype outputs");
  }
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    auto launch = [&](auto* out_type) -> absl::Status {
      using TO = std::remove_pointer_t<decltype(out_type)>;
      DenseGemvProducts<T, TO> g{};
      int64_t blocks = 0;
      for (size_t p = 0; p < products.size(); ++p) {
        const MatMulProduct& pr = products[p];
        g.out[p] = pr.out->as<TO>();
        g.w[p] = pr.w->as<const T>();
        g.bias[p] = pr.bias != nullptr ? pr.bias->as<const T>() : nullptr;
        g.m[p] = static_cast<int>(pr.w->dim(0));
        blocks += CeilDiv(pr.w->dim(0), int64_t{kGemvRows});
        if (blocks > std::numeric_limits<int>::max()) return absl::InternalError("DenseGemv: too many blocks");
        g.end[p] = static_cast<int>(blocks);
      }
      g.count = static_cast<int>(products.size());
      g.prefetch = pdl_;
      const T* xs = x.as<const T>();
      const bool long_rows = k > kGemvThreads * 8 * kDenseSteps;
      // kSilu: a block a row of gate and of up (m blocks); else the products' blocks.
      auto run = [&](auto silu_tag) -> absl::Status {
        constexpr bool kSilu = decltype(silu_tag)::value;
        const auto grid = static_cast<unsigned>(kSilu ? g.m[0] : blocks);
        return ForGemvInstance(rows, true, [&](auto kn, auto) -> absl::Status {
          if (long_rows) {
            return Launch("DenseGemvKernel", DenseGemvKernel<T, TO, kn(), kDenseLongSteps, kSilu>, grid, kGemvThreads,
                          g, xs, rows, k);
          }
          return Launch("DenseGemvKernel", DenseGemvKernel<T, TO, kn(), kDenseSteps, kSilu>, grid, kGemvThreads, g, xs,
                        rows, k);
        });
      };
      if constexpr (std::is_same_v<TO, T>) {  // the fused SiLU's outputs are act (checked above)
        if (silu) return run(std::true_type{});
      }
      return run(std::false_type{});
    };
    return products[0].out->dtype == DType::kF32 ? launch(static_cast<float*>(nullptr))
                                                 : launch(static_cast<T*>(nullptr));
  });
}

}  // namespace shardserve::cuda
