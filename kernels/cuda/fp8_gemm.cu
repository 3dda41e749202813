// MatMul by fp8 weights for more than kGemvMaxRows rows of x (prefill) through cuBLASLt's fp8 GEMM,
// behind CudaBackendOptions::fp8_gemm (worker --cuda-fp8-gemm; compute capability 8.9 and up:
// Ada, Hopper). Written without a GPU: off until it passes its tests on one (docs/gpu.md).
//
// cuBLASLt's fp8 GEMMs multiply two fp8 matrices: the weight's e4m3 codes as stored (kernels/quant.h
// Fp8RowsLayout, one float32 scale per output row) and x's rows rounded to e4m3 here, each with one
// float32 scale, max |x| / 448, as QuantizeFp8Rows scales the weights' rows (Fp8RowsKernel below:
// x / scale rounded to nearest even, saturating, by cuda_fp8.h's conversion). The products of two
// e4m3 values are exact in float32 and summed there on the tensor cores; each output is then scaled
// by its weight row's and its x row's scale (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F on A and B:
// cuBLAS 12.9 and up) and rounded once to out's dtype. So this is W8A8, as vLLM's fp8 on Hopper:
// unlike the default path (the weight dequantized to the act dtype, then cuBLAS), x loses precision
// too, each input moving by up to 2^-4 of itself (e4m3's 3 mantissa bits) where bf16 moves it by
// 2^-9. Hence opt-in, as --activation-quantization int8 is on the CPU. A row with a NaN or infinite
// input gives NaN outputs (its scale is NaN); the other rows are unaffected.
//
// Memory: no allocation of its own. x's codes, their scales and cuBLASLt's workspace go in the
// dequantize scratch the weight was stored with (CudaDequantScratchBytes, which the planner counts):
// a quarter of it (at most 32 MiB) is the workspace, the rest holds as many rows of x as fit, a
// block of rows at a time. Where cuBLASLt offers no algorithm for a shape, or the shape is not one
// its fp8 GEMM takes (m and k multiples of 16, 16-byte aligned codes), the default path runs.
#include <cublasLt.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "base/status_macros.h"
#include "kernels/cuda/cuda_backend.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemv.cuh"
#include "kernels/quant.h"

namespace shardserve::cuda {
namespace {

constexpr int kFp8RowThreads = 256;
constexpr size_t kFp8WorkspaceMax = size_t{32} << 20;

// q [rows, k] e4m3 and scale [rows] = x's rows rounded: scale = max |x| / 448 (1 for a row of
// zeros, NaN for a row with a NaN or infinite value), q = x / scale rounded to nearest even,
// saturating at +-448. One block a row.
template <typename T>
__global__ void __launch_bounds__(kFp8RowThreads)
    Fp8RowsKernel(uint8_t* __restrict__ q, float* __restrict__ scale, const T* __restrict__ x, int k) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * k;
  float amax = 0.0f, bad = 0.0f;
  for (int c = static_cast<int>(threadIdx.x); c < k; c += kFp8RowThreads) {
    const float v = ToFloat(xr[c]);
    if (isfinite(v)) {
      amax = fmaxf(amax, fabsf(v));
    } else {
      bad = 1.0f;
    }
  }
  amax = BlockAllReduce(amax, MaxOp{}, scratch);
  bad = BlockAllReduce(bad, MaxOp{}, scratch);
  const float s = bad != 0.0f ? __int_as_float(0x7fc00000) : amax > 0.0f ? amax / kFp8E4m3Max : 1.0f;
  if (threadIdx.x == 0) scale[row] = s;
  uint8_t* qr = q + row * k;
  for (int c = static_cast<int>(threadIdx.x); c < k; c += kFp8RowThreads) {
    qr[c] = bad != 0.0f ? 0 : __nv_cvt_float_to_fp8(ToFloat(xr[c]) / s, __NV_SATFINITE, __NV_E4M3);
  }
}

// cuBLASLt, opened by the backend's Init before any of these run (Fp8Gemm needs its lt_).
const CublasApi& Lt() { return *LoadedCublas(); }

// cuBLASLt's descriptors, destroyed with the call.
struct LtDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { (void)Lt().lt_matmul_desc_destroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const { (void)Lt().lt_matrix_layout_destroy(l); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { (void)Lt().lt_matmul_preference_destroy(p); }
};
using LtDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, LtDeleter>;
using LtLayout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LtDeleter>;
using LtPreference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, LtDeleter>;

absl::StatusOr<LtLayout> Layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(Lt().lt_matrix_layout_create(&l, type, rows, cols, ld));
  return LtLayout(l);
}

template <typename V>
absl::Status SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V& value) {
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(Lt().lt_matmul_desc_set_attribute(desc, attr, &value, sizeof(value)));
  return absl::OkStatus();
}

}  // namespace

bool CudaBackend::Fp8GemmTakes(int64_t m, int64_t k, const void* codes, const void* out) const {
  return lt_ != nullptr && m % 16 == 0 && k % 16 == 0 && Aligned(codes, 16) && Aligned(out, 16);
}

absl::StatusOr<bool> CudaBackend::Fp8Gemm(void* out, DType out_dtype, const void* x, int64_t n, int64_t m, int64_t k,
                                          const uint8_t* codes, const float* w_scale, float beta) {
  // The scratch: [workspace | x's codes, rows x k | their scales, rows floats].
  const size_t workspace = std::min(kFp8WorkspaceMax, dequant_capacity_ / 4 / 256 * 256);
  const size_t row_bytes = static_cast<size_t>(k) + sizeof(float);
  int64_t rows = static_cast<int64_t>((dequant_capacity_ - workspace - 16) / row_bytes);
  if (rows >= 16) rows = rows / 16 * 16;  // each block's out rows stay 16-byte aligned
  rows = std::min(rows, n);
  if (rows < 1) return false;
  uint8_t* x_codes = dequant_dev_ + workspace;
  auto* x_scale = reinterpret_cast<float*>(x_codes + (static_cast<size_t>(rows) * k + 15) / 16 * 16);

  cublasLtMatmulDesc_t raw_desc = nullptr;
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(blas_->lt_matmul_desc_create(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const LtDesc desc(raw_desc);
  // As Gemm (matmul.cu): column-major out^T [m, n] = w [m, k] (A: [k, m], transposed) x x^T [k, n]:
  // the "TN" layout fp8 GEMMs require.
  SHARDSERVE_RETURN_IF_ERROR(SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T));
  SHARDSERVE_RETURN_IF_ERROR(SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N));
  const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  SHARDSERVE_RETURN_IF_ERROR(SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, outer));
  SHARDSERVE_RETURN_IF_ERROR(SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, outer));
  SHARDSERVE_RETURN_IF_ERROR(
      SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(w_scale)));
  SHARDSERVE_RETURN_IF_ERROR(
      SetDesc(raw_desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(x_scale)));
  cublasLtMatmulPreference_t raw_pref = nullptr;
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(blas_->lt_matmul_preference_create(&raw_pref));
  const LtPreference pref(raw_pref);
  const uint64_t max_workspace = workspace;
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(blas_->lt_matmul_preference_set_attribute(
      raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof(max_workspace)));

  const size_t out_elem = DTypeSize(out_dtype);
  const size_t x_elem = DTypeSize(act_);
  for (int64_t i0 = 0; i0 < n; i0 += rows) {
    const int64_t nb = std::min(rows, n - i0);
    SHARDSERVE_ASSIGN_OR_RETURN(LtLayout a, Layout(CUDA_R_8F_E4M3, k, m, k));
    SHARDSERVE_ASSIGN_OR_RETURN(LtLayout b, Layout(CUDA_R_8F_E4M3, k, nb, k));
    SHARDSERVE_ASSIGN_OR_RETURN(LtLayout c, Layout(CudaDataType(out_dtype), m, nb, m));
    cublasLtMatmulHeuristicResult_t found{};
    int count = 0;
    const cublasStatus_t h =
        blas_->lt_matmul_algo_get_heuristic(lt_, raw_desc, a.get(), b.get(), c.get(), c.get(), raw_pref, 1, &found, &count);
    if (h != CUBLAS_STATUS_SUCCESS || count == 0) {
      if (i0 == 0) return false;  // nothing written yet: the caller's default path runs instead
      SHARDSERVE_CUBLAS_RETURN_IF_ERROR(h == CUBLAS_STATUS_SUCCESS ? CUBLAS_STATUS_NOT_SUPPORTED : h);
    }
    SHARDSERVE_RETURN_IF_ERROR(DispatchFloat(act_, [&](auto tag) -> absl::Status {
      using T = typename decltype(tag)::type;
      Fp8RowsKernel<T><<<static_cast<unsigned>(nb), kFp8RowThreads, 0, stream_>>>(
          x_codes, x_scale, reinterpret_cast<const T*>(static_cast<const char*>(x) + i0 * k * x_elem),
          static_cast<int>(k));
      SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("Fp8RowsKernel");
      return absl::OkStatus();
    }));
    const float alpha = 1.0f;
    void* d = static_cast<char*>(out) + static_cast<size_t>(i0) * m * out_elem;
    CountLaunch();
    SHARDSERVE_CUBLAS_RETURN_IF_ERROR(blas_->lt_matmul(lt_, raw_desc, &alpha, codes, a.get(), x_codes, b.get(), &beta,
                                                       d, c.get(), d, c.get(), &found.algo, dequant_dev_, workspace,
                                                       stream_));
  }
  return true;
}

}  // namespace shardserve::cuda
