// Group formation: from the registered workers to the group the coordinator serves with. Which
// worker holds which slot (the nodes in natural order are the stages, a node's workers in
// registration order its TP ranks, a worker holding a shard of this layout keeps its rank when it
// is free), the plan that places the model on them (coordinator/planner), the step limits every
// worker gets (the KV cache the smallest worker holds), each slot's Assignment, whether a worker
// fits a slot, and whether a worker that outlived an earlier coordinator keeps its shard.
//
// Ranks and group names are group.h's; the worker table, the phases and healing are Membership's
// (membership.h), which calls these under its mutex.
//
// Ownership: borrows the ServedModel, which must outlive it. Threading: constant after Create;
// every method is const and thread-safe.
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_GROUP_FORMATION_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_GROUP_FORMATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/cluster/group.h"
#include "coordinator/cluster/pool_options.h"
#include "coordinator/model/served_model.h"
#include "coordinator/planner/planner.h"
#include "model/step_limits.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {

// The group first forms under epoch 1 (or after the highest epoch a worker held: see Form); each
// re-forming (a heal) takes the next.
constexpr uint64_t kFirstEpoch = 1;

// A registered worker as formation sees it: the caller's index for it and its Register (borrowed).
struct Registered {
  int index = -1;
  const v1::Register* hello = nullptr;
};

// What the group is when it first forms.
struct FormedGroup {
  Group group;
  // The model's layout; its limits, kv_cache_tokens and memory items are the decided ones below.
  Plan plan;
  // The options' limits with num_kv_blocks, max_model_len and num_sliding_kv_blocks decided: what
  // every worker gets and the scheduler uses.
  StepLimits limits;
  // What decided the KV cache's size ("the workers' memory", "--num-kv-blocks", ...), for the log.
  std::string kv_from;
};

class GroupFormation {
 public:
  // Checks that TP = gpus_per_node x PP = nodes can hold `model` (TP divides the heads, PP at most
  // the layers, ...): InvalidArgument naming the numbers otherwise. Reads the model's fingerprint
  // and manifest (model/shard_identity.h); without them no worker is adopted and the workers'
  // copies are not checked (logged).
  static absl::StatusOr<GroupFormation> Create(const ServedModel* model, const PoolOptions& options);

  const ServedModel& model() const { return *model_; }
  const PoolOptions& options() const { return options_; }
  // Workers in the group: nodes x gpus_per_node.
  int group_size() const { return options_.nodes * options_.gpus_per_node; }
  // The longest sequence the layout serves before the workers' memory is known (the plan made at
  // Create).
  int64_t target_max_model_len() const { return target_max_model_len_; }

  // Forms the group of `registered` (every worker of it, in registration order, at most
  // gpus_per_node per node) and plans the model on it, under the first epoch: kFirstEpoch, or one
  // more than the highest epoch a worker held under an earlier coordinator (Register.held), so that
  // epochs only grow across coordinator restarts. FailedPrecondition saying why when no group or
  // plan can be made (the model does not fit, the planner placed a stage across nodes, ...).
  absl::StatusOr<FormedGroup> Form(const std::vector<Registered>& registered) const;

  // The Assignment of `slot` for worker `worker_id` under `epoch`, from the group's plan and limits:
  // everything but the rendezvous token and adopt (the caller's).
  v1::Assignment AssignmentFor(const Slot& slot, const std::string& worker_id, uint64_t epoch, const Plan& plan,
                               const StepLimits& limits) const;

  // OK when a worker that holds `held` (Register.held, loaded for an earlier coordinator) can keep
  // it as `assignment` (the same model fingerprint, SameShard, an earlier epoch); otherwise
  // FailedPrecondition saying what differs.
  absl::Status CheckAdopt(const v1::HeldShard& held, const v1::Assignment& assignment) const;

  // OK when the worker `hello` describes can hold `slot`'s shard: the group's kind of device (that
  // of `group_device`) and memory for the shard and the KV cache every worker holds (the plan's
  // figures, at its memory utilization); else FailedPrecondition saying why.
  absl::Status CheckFitsSlot(const v1::Register& hello, const std::string& group_device, const Slot& slot,
                             const Plan& plan, const StepLimits& limits) const;

 private:
  GroupFormation(const ServedModel* model, const PoolOptions& options, int64_t target_max_model_len,
                 std::string model_fingerprint, std::vector<std::string> model_manifest);

  const ServedModel* model_;
  PoolOptions options_;
  int64_t target_max_model_len_ = 0;
  // model/shard_identity.h ModelFingerprint of the served model ("" when it cannot be made: then no
  // worker is adopted).
  std::string model_fingerprint_;
  // Its ModelManifest, sent in every Assignment: a worker whose copy differs does not load it
  // (empty when it cannot be made: then not checked).
  std::vector<std::string> model_manifest_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_GROUP_FORMATION_H_
