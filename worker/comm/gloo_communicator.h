// The Communicator for CPU tensors: Gloo over TCP.
#ifndef SHARDSERVE_WORKER_COMM_GLOO_COMMUNICATOR_H_
#define SHARDSERVE_WORKER_COMM_GLOO_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/rendezvous.h"
#include "worker/communicator.h"

namespace shardserve {

// Joins rank `rank` of the `size`-rank group `group_name` and returns its communicator once TCP
// connections to every other rank are up. Every rank of the group calls this at about the same
// time with the same group name, size and store; each listens on `bind_address` (an address of
// this host that the peers can reach, e.g. "127.0.0.1" for a single-machine group) on ports the
// kernel picks, and publishes them through `store` under "<group_name>/gloo/".
//
// `store` is used only during this call. `timeout` (finite, >= 1ms) bounds the rendezvous and
// then every wait of every operation (see Communicator). Returns:
// - DeadlineExceeded naming the missing rank when a rank has not joined within `timeout`. (A rank
//   that joins and then dies before connecting is caught by Gloo's connect wait, which is 5x
//   `timeout`.)
// - InvalidArgument for bad arguments or an address Gloo cannot bind.
// - The store's own error when the store fails.
//
// The communicator owns its sockets and Gloo's event-loop thread; destroying it closes the
// connections, which the peers see as Unavailable on their next call. Tensors are host memory.
// AllReduceSum supports F32 and I32 (the CPU backend's activations are F32): up to 64 KiB (a decode
// step's activations) as one all-gather and a sum in rank order, above it Gloo's ring (a
// reduce-scatter, then an all-gather); both give every rank the same bits. AllGather, Send,
// Recv and AllToAllV move any dtype. Send/Recv exchange a small header first, so a Recv whose dtype
// or shape differs from the Send's is InvalidArgument naming both, not a corrupted tensor; so does
// AllToAllV with every peer (one more round trip), so a pair of ranks whose row counts disagree
// both return InvalidArgument before any row moves.
//
// Side effect: the first call makes the process ignore SIGPIPE if it still has the default action,
// which would end the process when Gloo writes to a connection a peer has closed; ignored, that
// write is an Unavailable error.
absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooCommunicator(RendezvousStore* store,
                                                                   const std::string& group_name, int rank, int size,
                                                                   const std::string& bind_address,
                                                                   absl::Duration timeout);

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_COMM_GLOO_COMMUNICATOR_H_
