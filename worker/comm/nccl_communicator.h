// The Communicator for GPU tensors: NCCL.
#ifndef SHARDSERVE_WORKER_COMM_NCCL_COMMUNICATOR_H_
#define SHARDSERVE_WORKER_COMM_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/rendezvous.h"
#include "worker/communicator.h"

// cudaStream_t is CUstream_st*. Declared here so that this header needs no CUDA headers.
struct CUstream_st;

namespace shardserve {

// Joins rank `rank` of the `size`-rank NCCL group `group_name` on CUDA device `cuda_device` and
// returns its communicator once NCCL has connected every rank. Rank 0 creates the NCCL unique id
// and publishes it in `store` under "<group_name>/nccl/unique_id"; the other ranks wait for it
// there. NCCL then connects the ranks itself. `store` is used only during this call.
//
// Collectives run on `stream` (not owned, must outlive the communicator; nullptr is the legacy
// default stream). Pass the stream the CUDA backend enqueues its kernels on, so that a collective
// follows the kernels that produce its input. Each call then waits on the host until its work has
// finished, polling NCCL's error state. When `timeout` (finite, >= 1ms) passes first, the call
// aborts the NCCL communicator (which stops its kernels) and returns DeadlineExceeded. That is
// what turns a hung peer into an error here, not into a hang in the next stream synchronize. The
// cost is one host synchronization per collective: the next kernels are not launched while it
// runs. The communicator is created the same way, so a rank that never joins is DeadlineExceeded
// within `timeout` too.
//
// Tensors live on `cuda_device`, in F32, F16, BF16 or I32 (NCCL sums F16 and BF16 in their own
// precision). NCCL does not check that a Recv matches its Send: a size mismatch is undefined, and
// at best a timeout. The step plan tells both stages the shape. The same holds for AllToAllV's row
// counts between two ranks (each rank's own arguments are checked): exchange them first.
//
// The communicator owns its NCCL communicator, a 4-byte device buffer (for Barrier) and a CUDA
// event. Every call, the destructor included, makes `cuda_device` current on the calling thread.
// Unimplemented in a build without CUDA.
absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(RendezvousStore* store,
                                                                   const std::string& group_name, int rank, int size,
                                                                   int cuda_device, CUstream_st* stream,
                                                                   absl::Duration timeout);

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_COMM_NCCL_COMMUNICATOR_H_
