// CUDA and cuBLAS error checks that become absl::Status, plus small launch helpers.
//
// Every CUDA runtime or cuBLAS call in kernels/cuda/ goes through one of the macros below (built
// on base/status_macros.h), so an error reaches the worker as a Status that names the call, the
// error and the file:line, never as an exception or an abort. The macros `return` from the enclosing function, which must
// return absl::Status (or absl::StatusOr<T>, which converts from a non-OK Status).
//
//   SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, n, kind, stream));
//   SHARDSERVE_CUBLAS_RETURN_IF_ERROR(blas_->gemm_ex(...));   // cuBLAS through cublas_api.h
//   MyKernel<<<grid, block, 0, stream>>>(...);
//   SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("MyKernel");
//
// Include only from CUDA translation units (.cu); nothing here is needed by CPU-only builds.
#ifndef SHARDSERVE_KERNELS_CUDA_CUDA_CHECK_H_
#define SHARDSERVE_KERNELS_CUDA_CUDA_CHECK_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cuda/cublas_api.h"

namespace shardserve::cuda {

// The file name without its directories, so messages stay short.
inline const char* BaseName(const char* path) {
  const char* base = path;
  for (const char* p = path; *p != '\0'; ++p) {
    if (*p == '/') base = p + 1;
  }
  return base;
}

// A Status for a failed CUDA runtime call `expr` at file:line (OK for cudaSuccess). The code says
// what a caller can do about it: no device or driver -> Unavailable, out of memory ->
// ResourceExhausted, a bad device ordinal -> InvalidArgument, anything else -> Internal (a bug or
// a dead device; after a sticky error such as an illegal address the context is unusable).
inline absl::Status CudaErrorToStatus(cudaError_t e, const char* expr, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat("CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") in ", expr,
                                 " at ", BaseName(file), ":", line);
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorDevicesUnavailable:
      return absl::UnavailableError(msg);
    case cudaErrorInvalidDevice:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// The same for a cuBLAS call.
inline absl::Status CublasErrorToStatus(cublasStatus_t s, const char* expr, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  // A status comes from a call through the loaded table, so LoadedCublas() names it.
  const CublasApi* api = LoadedCublas();
  std::string msg = api != nullptr ? absl::StrCat("cuBLAS error ", api->status_name(s), " (", api->status_string(s), ")")
                                   : absl::StrCat("cuBLAS error ", static_cast<int>(s));
  absl::StrAppend(&msg, " in ", expr, " at ", BaseName(file), ":", line);
  switch (s) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(msg);
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::FailedPreconditionError(msg);
    case CUBLAS_STATUS_INVALID_VALUE:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// Kernels launched by this process (Backend::kernel_launches): every launch checked with
// SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR adds one, and so does each cuBLAS call that runs a
// product (CountLaunch before it). Relaxed atomic: a count, read between steps.
inline std::atomic<uint64_t>& KernelLaunches() {
  static std::atomic<uint64_t> launches{0};
  return launches;
}
inline void CountLaunch() { KernelLaunches().fetch_add(1, std::memory_order_relaxed); }

// Ceil(a / b) for a >= 0, b > 0.
constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid size for a grid-stride loop over `n` elements with `threads` per block: enough blocks to
// cover n, at most `max_blocks` (each thread then loops), at least 1 so that a launch for n == 0
// is still a valid configuration (callers normally skip those). 4096 blocks of 256 threads keep
// every SM of an H100 (132 SMs x 2048 threads) busy several times over.
constexpr unsigned int GridFor(int64_t n, int threads, int64_t max_blocks = 4096) {
  const int64_t blocks = CeilDiv(n, threads);
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > max_blocks ? max_blocks : blocks));
}

}  // namespace shardserve::cuda

// Returns a Status from the enclosing function when the CUDA runtime call `expr` fails.
#define SHARDSERVE_CUDA_RETURN_IF_ERROR(expr) \
  SHARDSERVE_RETURN_IF_ERROR(::shardserve::cuda::CudaErrorToStatus((expr), #expr, __FILE__, __LINE__))

// Returns a Status from the enclosing function when the cuBLAS call `expr` fails.
#define SHARDSERVE_CUBLAS_RETURN_IF_ERROR(expr) \
  SHARDSERVE_RETURN_IF_ERROR(::shardserve::cuda::CublasErrorToStatus((expr), #expr, __FILE__, __LINE__))

// After a <<<...>>> launch: returns a Status when the launch itself failed (bad configuration,
// no kernel image for this GPU, a sticky error from earlier work). `what` names the kernel.
// Errors while the kernel runs surface at the next synchronizing call.
// Counts the launch (KernelLaunches).
#define SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR(what)                                                        \
  do {                                                                                                      \
    ::shardserve::cuda::CountLaunch();                                                                      \
    SHARDSERVE_RETURN_IF_ERROR(                                                                             \
        ::shardserve::cuda::CudaErrorToStatus(cudaGetLastError(), "launch of " what, __FILE__, __LINE__)); \
  } while (0)

#endif  // SHARDSERVE_KERNELS_CUDA_CUDA_CHECK_H_
