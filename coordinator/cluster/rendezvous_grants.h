// Who may write and read which rendezvous keys (worker.proto RendezvousSet/Get). Mutual TLS tells
// the coordinator that a caller holds a certificate of the cluster's CA; it does not tell which
// worker the caller is. So every Assignment and Regroup the pool sends carries a fresh secret token
// (Assignment/Regroup.rendezvous_token, over that worker's own mutual-TLS Connect stream) granting
// that worker its groups of that epoch and its rank in each, and the worker presents the token in
// every rendezvous call. With it:
//
//   - a key may be written only by the rank it names: "<group>/gloo/rank_<r>" and "<group>/gloo/<r>"
//     (Gloo's keys: rank r's host name and addresses) by the worker granted rank r of <group>,
//     "<group>/nccl/unique_id" by rank 0; any other key under a group is refused;
//   - a key may be read only by a member of its group (any rank granted <group>);
//   - a worker's grant is replaced by its next one (a Regroup's groups are the next epoch's, so the
//     old epoch's keys are no longer its to read or write) and revoked when the pool marks the
//     worker lost (membership.h: also a frozen worker whose stream is still open) or its stream
//     ends.
//
// Everything else (no token, an unknown or revoked one, another group's key) is PermissionDenied
// naming the key and why; WorkerControlService logs the refusal with the peer's address.
// Ranks inside a group follow the workers' convention (worker/step_executor.h): in a TP group a
// worker is its tp_rank; in a pipeline pair the earlier stage is rank 0, the later one rank 1.
//
// Tokens are "<worker index>.<64 hex digits>" (32 bytes from OpenSSL's RAND_bytes); the secret part
// is compared in constant time (CRYPTO_memcmp). They never appear in logs or messages.
//
// Thread-safety: every method is thread-safe. The pool calls Grant under its own lock; this class
// never calls out, so that lock order is safe.
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_RENDEZVOUS_GRANTS_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_RENDEZVOUS_GRANTS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/cluster/group.h"

namespace shardserve {

// A group name and the rank a worker holds in it.
using GroupRank = std::pair<std::string, int>;

// The groups the worker in `slot` joins and its rank in each: its stage's TP group (its tp_rank),
// the pair with the next stage (rank 0) and with the previous one (rank 1); empty names skipped.
std::vector<GroupRank> RendezvousGroupsOf(const Slot& slot);

class RendezvousGrants {
 public:
  // Grants worker `worker` (the pool's index, >= 0; `name` for the log of refusals) `groups` under
  // `epoch`, replacing its earlier grant. Returns the token it must present.
  std::string Grant(int worker, const std::string& name, uint64_t epoch, std::vector<GroupRank> groups);
  // Ends worker `worker`'s grant (it was lost, or its stream ended); a no-op when it has none.
  void Revoke(int worker);

  // OK when `token` grants writing `key`; PermissionDenied naming the key and why otherwise.
  absl::Status CheckSet(absl::string_view token, absl::string_view key);
  // OK when `token` grants reading `key`; PermissionDenied naming the key and why otherwise.
  absl::Status CheckGet(absl::string_view token, absl::string_view key);

 private:
  struct Entry {
    std::string secret;  // the hex part of the token
    std::string name;
    uint64_t epoch = 0;
    std::vector<GroupRank> groups;
  };
  // The grant `token` stands for, or PermissionDenied naming `key`.
  absl::StatusOr<const Entry*> Find(absl::string_view token, absl::string_view key, const char* what)
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The granted group `key` lies under (the longest match), or null.
  static const GroupRank* GroupOf(const Entry& e, absl::string_view key);

  absl::Mutex mu_;
  absl::flat_hash_map<int, Entry> grants_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_RENDEZVOUS_GRANTS_H_
