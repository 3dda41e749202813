// The CUDA backend's MatMul and MatMuls: cuBLAS GEMM in float32 accumulation, with the bias
// broadcast into the output first; decode rows by the dense GEMV (gemv.cu). (By quantized weights:
// quant_matmul.cu, which uses BroadcastBias and Gemm.)
#include <cstdint>
#include <utility>

#include "absl/types/span.h"
#include "kernels/cuda/cuda_backend.cuh"
#include "kernels/cuda/device_util.cuh"

namespace shardserve::cuda {

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

namespace {

// out[r, c] = bias[c] for every row: the C operand of the bias GEMM (beta = 1).
template <typename TO, typename TB>
__global__ void BroadcastRowsKernel(TO* out /*[n, m]*/, const TB* bias /*[m]*/, int64_t n, int64_t m) {
  GRID_STRIDE_LOOP(i, n * m) out[i] = FromFloat<TO>(ToFloat(bias[i % m]));
}

}  // namespace

absl::Status CudaBackend::CheckPlainMatMul(const Tensor* out, const Tensor& x, const Tensor& w,
                                           const Tensor* bias) const {
  constexpr const char* kOp = "MatMul";
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"x", &x}, {"w", &w}, {"bias", bias}};
  if (out == nullptr) return Invalid(kOp, "out is null", all);
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
  return absl::OkStatus();
}

absl::Status CudaBackend::MatMul(Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias) {
  if (out == nullptr) return Invalid("MatMul", "out is null", {{"x", &x}, {"w", &w}, {"bias", bias}});
  // A weight stored quantized (PackMatMulWeight / PackQuantizedWeight): quant_matmul.cu.
  if (w.quant != WeightQuant::kNone || w.dtype == DType::kI8) return QuantizedMatMul(out, x, w, bias);
  SHARDSERVE_RETURN_IF_ERROR(CheckPlainMatMul(out, x, w, bias));
  const int64_t n = x.dim(0), k = x.dim(1), m = w.dim(0);
  if (n == 0 || m == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  if (TakesDenseGemv(x, w)) return DenseGemv(x, {MatMulProduct{out, &w, bias}});  // decode rows (gemv.cu)

  // With a bias, out starts as the bias broadcast over rows and the GEMM accumulates onto it
  // (beta = 1), so x @ w^T + bias is rounded once, in float32 inside cuBLAS.
  if (bias != nullptr) SHARDSERVE_RETURN_IF_ERROR(BroadcastBias(out, *bias));
  if (k == 0) return bias != nullptr ? absl::OkStatus() : Fill0(out->data, out->bytes());
  return Gemm(out->data, out->dtype, m, x.data, w.data, n, m, k, bias != nullptr ? 1.0f : 0.0f);
}

bool CudaBackend::TakesOneDenseGemv(const Tensor& x, absl::Span<const MatMulProduct> products) const {
  bool one_launch = products.size() >= 2 && products.size() <= kDenseGemvMaxProducts;
  for (const MatMulProduct& p : products) {
    if (!one_launch) break;
    one_launch = p.w != nullptr && p.w->quant == WeightQuant::kNone && p.w->dtype != DType::kI8 &&
                 CheckPlainMatMul(p.out, x, *p.w, p.bias).ok() && p.out->dtype == products[0].out->dtype &&
                 x.dim(0) > 0 && p.w->dim(0) > 0 && TakesDenseGemv(x, *p.w);
  }
  return one_launch;
}

absl::Status CudaBackend::MatMuls(const Tensor& x, absl::Span<const MatMulProduct> products) {
  // One dense GEMV launch when every product takes it, with one output dtype; else MatMul each.
  if (!TakesOneDenseGemv(x, products)) return Backend::MatMuls(x, products);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DenseGemv(x, products);
}

absl::Status CudaBackend::GateUpSilu(Tensor* gate, Tensor* up, const Tensor& x, const Tensor& gate_w,
                                     const Tensor& up_w) {
  const MatMulProduct products[] = {{gate, &gate_w, nullptr}, {up, &up_w, nullptr}};
  const bool fused = options_.fused_kernels && gate != nullptr && up != nullptr && TakesOneDenseGemv(x, products) &&
                     gate->dtype == act_ && SameShape(*gate, *up);
  if (!fused) return Backend::GateUpSilu(gate, up, x, gate_w, up_w);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DenseGemv(x, products, true);
}

absl::Status CudaBackend::BroadcastBias(Tensor* out, const Tensor& bias) {
  const int64_t n = out->dim(0), m = out->dim(1);
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    const unsigned grid = GridFor(n * m, kElementwiseThreads);
    if (out->dtype == DType::kF32) {
      BroadcastRowsKernel<float, T><<<grid, kElementwiseThreads, 0, stream_>>>(out->as<float>(), bias.as<const T>(), n, m);
    } else {
      BroadcastRowsKernel<T, T><<<grid, kElementwiseThreads, 0, stream_>>>(out->as<T>(), bias.as<const T>(), n, m);
    }
    SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("BroadcastRowsKernel");
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::Gemm(void* out, DType out_dtype, int64_t m, const void* x, const void* w, int64_t n,
                               int64_t rows, int64_t k, float beta) {
  // Row-major out[n, m] = x[n, k] @ w[m, k]^T. cuBLAS is column-major, and a row-major [r, c]
  // matrix is the column-major [c, r] matrix (its transpose) with leading dimension c. So in
  // cuBLAS terms we compute the column-major out^T[m, n] = w[m, k] * x^T[k, n]:
  //   A = w: column-major [k, m] with ld k (that is w^T), op(A) = T  -> [m, k]
  //   B = x: column-major [k, n] with ld k (that is x^T), op(B) = N  -> [k, n]
  //   C = out: column-major [m, n] with ld m (that is out^T)
  // GEMM sizes (m, n, k) = (m, n, k). Compute in float32 (CUBLAS_COMPUTE_32F; alpha and beta are
  // float); for F16/BF16 inputs cuBLAS uses tensor cores with float32 accumulation.
  // For `rows` < m (a block of w's rows, quant_matmul.cu) `out` points at column r0 of out's first
  // row, and C is the [rows, n] block of out^T, still with ld m.
  const float alpha = 1.0f;
  CountLaunch();
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(blas_->gemm_ex(
      cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows), static_cast<int>(n), static_cast<int>(k), &alpha,
      w, CudaDataType(act_), static_cast<int>(k), x, CudaDataType(act_), static_cast<int>(k), &beta, out,
      CudaDataType(out_dtype), static_cast<int>(m), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

}  // namespace shardserve::cuda
