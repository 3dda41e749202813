// The key-value store through which the ranks of a communicator find each other before they can
// talk directly: Gloo publishes each rank's TCP addresses in it, NCCL rank 0 its unique id. The
// coordinator serves it to the workers (over gRPC, later), so no shared filesystem is needed.
//
// Keys: each communicator writes only under "<group name>/": "<group>/gloo/<Gloo's key>" and
// "<group>/nccl/unique_id". Keys are never deleted, so a group name is used for one communicator
// per store: a group rebuilt after a failure gets a new name (the coordinator's names start with
// the group's epoch, "e2/tp/stage0"). Several groups (TP groups, PP pairs) share one store. Keys
// are write-once, so a peer cannot replace the address a rank published for its epoch.
#ifndef SHARDSERVE_WORKER_COMM_RENDEZVOUS_H_
#define SHARDSERVE_WORKER_COMM_RENDEZVOUS_H_

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardserve {

// Implementations are thread-safe: the ranks of a group, or several groups, may rendezvous from
// different threads at once.
class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  // Stores `value` (any bytes) under `key`. A key is written once (the first writer wins: an
  // epoch's group name is in every key): AlreadyExists, naming the key, when it holds another
  // value; the same value again is OK (a retried Set).
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` exists and returns its value. DeadlineExceeded, naming the key, when it
  // does not exist within `timeout`.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
};

// A store in this process's memory, for tests and single-process groups (threads as ranks).
class InMemoryRendezvousStore final : public RendezvousStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

 private:
  absl::Mutex mu_;
  absl::CondVar key_added_;  // signalled on every Set
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_COMM_RENDEZVOUS_H_
