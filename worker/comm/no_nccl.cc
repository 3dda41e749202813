// MakeNcclCommunicator in a build without CUDA (SHARDSERVE_WITH_CUDA=OFF).
#include "worker/comm/nccl_communicator.h"

namespace shardserve {

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(RendezvousStore*, const std::string&, int, int, int,
                                                                   CUstream_st*, absl::Duration) {
  return absl::UnimplementedError(
      "NCCL communicators need a build with SHARDSERVE_WITH_CUDA=ON; this one has no CUDA "
      "(MakeGlooCommunicator serves CPU tensors)");
}

}  // namespace shardserve
