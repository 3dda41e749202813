// The rendezvous store on the coordinator (worker.proto RendezvousSet/Get): what
// WorkerControlService keeps once RendezvousGrants has let a call through.
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_RENDEZVOUS_TABLE_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_RENDEZVOUS_TABLE_H_

#include <cstddef>
#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardserve {

// Keys and values published by the workers' collectives while they form their groups
// (worker/comm/rendezvous.h explains the keys). Bounded in the number and size of entries, so a
// confused or hostile client cannot exhaust the coordinator's memory. Each key is written once: the
// group names in the keys carry the epoch ("e2/tp/stage0/..."), so a key stands for one rank of one
// epoch's group, and a second writer cannot replace the address the first one published (the
// service logs the refusal with the peer's address). Thread-safe.
class RendezvousTable {
 public:
  // InvalidArgument for an empty or oversized key or value; AlreadyExists when the key holds
  // another value (the same value again is OK: a retried Set); ResourceExhausted when full.
  absl::Status Set(const std::string& key, const std::string& value);
  // Waits until `key` is set (its value), `deadline` passes (DeadlineExceeded naming the key), or
  // `cancelled` turns true (Cancelled). `cancelled` is polled every 100 ms.
  absl::StatusOr<std::string> Get(const std::string& key, absl::Time deadline,
                                  const std::function<bool()>& cancelled);

 private:
  absl::Mutex mu_;
  absl::CondVar set_;  // signalled on every Set
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_RENDEZVOUS_TABLE_H_
