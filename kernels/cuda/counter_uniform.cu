// CudaBackend::FillCounterUniform: the dummy weights made in device memory, each rank its own
// slice, with the bits of FillCounterUniformOnHost (kernels/counter_uniform.h: the same
// CounterUniformValue, and FromFloat rounds to nearest even as ConvertOnHost does). Off the default
// path until tests/kernels_cuda_test.cc's CounterUniform cases pass on a GPU (docs/gpu.md).
#include <cstdint>

#include "kernels/counter_uniform.h"
#include "kernels/cuda/cuda_backend.cuh"
#include "kernels/cuda/device_util.cuh"

namespace shardserve::cuda {
namespace {

// One thread per output element (grid-stride): output (r, c) of the [out_rows, out_cols] slice is
// element first_row_index(r) + c of the whole tensor's flat order.
template <typename T>
__global__ void CounterUniformKernel(T* out /*[out_rows, out_cols]*/, uint64_t key, float scale, int64_t cols,
                                     int dim, int64_t begin, int64_t out_cols, int64_t n) {
  GRID_STRIDE_LOOP(i, n) {
    const int64_t r = i / out_cols;
    const int64_t c = i - r * out_cols;
    const int64_t flat = dim == 0 ? (begin + r) * cols + c : r * cols + begin + c;
    out[i] = FromFloat<T>(CounterUniformValue(key, scale, static_cast<uint64_t>(flat)));
  }
}

}  // namespace

absl::Status CudaBackend::FillCounterUniform(Tensor* out, const CounterUniformSlice& s) {
  SHARDSERVE_RETURN_IF_ERROR(CheckCounterUniformSlice("FillCounterUniform", *out, s));
  const int64_t n = out->numel();
  if (n == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(out->dtype, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    CounterUniformKernel<T><<<GridFor(n, kElementwiseThreads), kElementwiseThreads, 0, stream_>>>(
        static_cast<T*>(out->data), s.key, s.scale, s.cols, s.dim, s.begin, s.out_cols(), n);
    SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("CounterUniformKernel");
    return absl::OkStatus();
  });
}

}  // namespace shardserve::cuda
