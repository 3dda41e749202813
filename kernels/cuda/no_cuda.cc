// Built instead of the CUDA backend (cuda_backend.cu and the op files beside it) when
// SHARDSERVE_WITH_CUDA is OFF.
#include "kernels/cuda/cuda_backend.h"

namespace shardserve {

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int, DType, const CudaBackendOptions&) {
  return absl::UnimplementedError(
      "this shardserve was built without CUDA (SHARDSERVE_WITH_CUDA=OFF); use --device cpu or rebuild with CUDA");
}

int CudaDeviceCount() { return 0; }
int CudaComputeCapability(int) { return 0; }

}  // namespace shardserve
