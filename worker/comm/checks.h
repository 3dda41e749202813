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

// "F32 [4, 8]": a tensor's dtype and shape for messages about a peer's tensor. `dtype` is the
// number as it came from the peer: one this build does not name is "an unknown dtype".
std::string DescribeTensor(int64_t dtype, const Tensor& shape);
inline std::string DescribeTensor(const Tensor& t) { return DescribeTensor(static_cast<int64_t>(t.dtype), t); }

// What the transports say, in the same words, when the two ranks of a pair disagree (descriptions
// from DescribeTensor): a Recv's peer sent another tensor than this rank expected; an AllToAllV's
// peer sends other rows than this rank expects from it, or expects another count than this rank
// sends it.
absl::Status SentOtherThanExpected(int peer, const std::string& sent, const std::string& expected);
absl::Status SendsOtherRowsThanExpected(int peer, const std::string& sends, const std::string& expected);
absl::Status ExpectsOtherRowCount(int peer, int64_t expects, int64_t sends);

}  // namespace shardserve::comm

#endif  // SHARDSERVE_WORKER_COMM_CHECKS_H_
