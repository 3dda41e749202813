// The RendezvousStore a worker uses: the coordinator's RendezvousSet / RendezvousGet RPCs
// (worker.proto), so that the ranks of a collective group find each other through the coordinator
// they all dial, with no shared filesystem. Every call carries the token of the worker's Assignment
// or Regroup (coordinator/cluster/rendezvous_grants.h): the coordinator takes a key only from the
// rank it names and gives it only to the members of its group.
//
// Ownership: borrows the stub, which must outlive the store. Thread-safe (gRPC stubs are), as
// RendezvousStore requires.
#ifndef SHARDSERVE_WORKER_GRPC_RENDEZVOUS_H_
#define SHARDSERVE_WORKER_GRPC_RENDEZVOUS_H_

#include <string>
#include <utility>

#include "absl/time/time.h"
#include "shardserve/v1/worker.grpc.pb.h"
#include "worker/comm/rendezvous.h"

namespace shardserve {

class GrpcRendezvousStore final : public RendezvousStore {
 public:
  // `token`: the Assignment's or Regroup's rendezvous_token, sent with every call. Each Set RPC may
  // take up to `set_timeout`; a Get waits as long as its caller allows.
  GrpcRendezvousStore(v1::WorkerControl::StubInterface* stub, std::string token,
                      absl::Duration set_timeout = absl::Seconds(10))
      : stub_(stub), token_(std::move(token)), set_timeout_(set_timeout) {}

  // AlreadyExists (the coordinator's message) when another peer set `key` first; PermissionDenied
  // (the coordinator's message) when the token does not grant writing `key`; Unavailable (with
  // gRPC's code and message) when the coordinator cannot be reached.
  absl::Status Set(const std::string& key, const std::string& value) override;
  // DeadlineExceeded naming the key when it is not set within `timeout`; PermissionDenied when the
  // token does not grant reading `key`; Unavailable when the coordinator cannot be reached.
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

 private:
  v1::WorkerControl::StubInterface* const stub_;
  const std::string token_;
  const absl::Duration set_timeout_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_GRPC_RENDEZVOUS_H_
