// Argument checks and message pieces shared by the Communicator implementations in worker/comm/.
// Internal to worker/comm/: callers outside it use the Make*Communicator functions.
#ifndef SHARDSERVE_WORKER_COMM_CHECKS_H_
#define SHARDSERVE_WORKER_COMM_CHECKS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/tensor.h"
#include "worker/comm/rendezvous.h"

namespace shardserve::comm {

// The arguments every Make*Communicator takes: a store, a non-empty group name, 0 <= rank < size,
// and a finite timeout of at least a millisecond (the libraries count in milliseconds, and zero
// means "no timeout" to Gloo). `impl` ("Gloo", "NCCL") starts the message.
absl::Status CheckGroupArgs(const char* impl, const RendezvousStore* store, const std::string& group_name, int rank,
                            int size, absl::Duration timeout);

// "group 'tp0' (rank 1 of 2)": where an error happened.
std::string GroupWhere(const std::string& group_name, int rank, int size);

// "ranks 0, 2": the ranks a collective of `rank` waits on.
std::string OtherRanks(int rank, int size);

// A Send/Recv peer is another rank of the group.
absl::Status CheckPeer(int peer, int rank, int size);

// AllGather's out is [size, ...in's shape] in in's dtype.
absl::Status CheckAllGatherShapes(const Tensor& out, const Tensor& in, int size);

}  // namespace shardserve::comm

#endif  // SHARDSERVE_WORKER_COMM_CHECKS_H_
