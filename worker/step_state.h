// What a worker holds of its shard besides the weights and the groups, and the checks it runs on
// the coordinator's messages before any kernel or collective: the group's epoch, the running batch
// (worker/persistent_batch.h) and the step buffers the plans expand into. StepExecutor owns one
// and runs every plan, regroup and adoption through it; fuzz/coordinator_message_fuzzer.cc runs
// the same object without a backend.
//
// Ownership: owns the persistent batch and the step buffers (reserved for the largest step at
// construction: nothing is allocated per step). Threading: not thread-safe; one thread.
#ifndef SHARDSERVE_WORKER_STEP_STATE_H_
#define SHARDSERVE_WORKER_STEP_STATE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "model/config.h"
#include "model/step_limits.h"
#include "shardserve/v1/worker.pb.h"
#include "worker/persistent_batch.h"

namespace shardserve {

// The checks StepExecutor::Create runs on an Assignment against the model's config.json before
// and after loading the shard, without loading it: CheckAssignment, the shard's sizes and limits
// (CheckShard, what ModelShard::Load checks first) and its layers (CheckStageLayers).
absl::Status CheckLoadable(const v1::Assignment& assignment, const ModelConfig& config);

class StepState {
 public:
  // For the shard of `assignment` (its limits and epoch; CheckLoadable passed) of a model whose
  // vocabulary has `vocab_size` ids. The last stage's TP rank 0 samples, and keeps the fed tokens
  // of sequences with a penalty; the workers of a group of one stage feed rows the samples they
  // were given (RecordSamples; StepPlan.row_feeds_sample).
  StepState(const v1::Assignment& assignment, int64_t vocab_size);

  // The group's epoch: the assignment's, then the last Regroup's or adoption's.
  uint64_t epoch() const { return epoch_; }

  // The checks of a step before any collective: the plan's epoch must be this one
  // (FailedPrecondition), then the plan is applied to the running batch (PersistentBatch::Apply)
  // and the sampling rows are checked (CheckRowSampling), on every worker alike, so a bad plan
  // fails on all of them before any waits for another. On success batch() and sampling() hold
  // the step; ModelShard::Forward checks the batch against the shard (CheckStepBatch) first.
  // After an error the running batch is undefined: take no step before a Regroup.
  absl::Status Prepare(const v1::StepPlan& plan);
  const StepBatch& batch() const { return batch_; }
  const google::protobuf::RepeatedPtrField<v1::RowSampling>& sampling() const { return sampling_; }
  // The ids the group's sampler drew for the prepared step (PersistentBatch::RecordSamples): its
  // own where the worker is its group's only one, rank 0's shared ones in a TP group.
  void RecordSamples(const google::protobuf::RepeatedField<int32_t>& sampled) { state_.RecordSamples(sampled); }

  // A Regroup of the group that holds `held` (CheckRegroup against this epoch); on success the
  // running batch is dropped and the epoch is the regroup's.
  absl::Status Regroup(const v1::Assignment& held, const v1::Regroup& regroup);

  // An adoption by a new coordinator (CheckAdopt: the same shard as `held`, a later epoch); on
  // success as Regroup(RegroupOf(wanted)).
  absl::Status Adopt(const v1::Assignment& held, const v1::Assignment& wanted);

  // Drops the running batch (the coordinator went away).
  void Clear() { state_.Clear(); }

 private:
  const int64_t vocab_size_;
  uint64_t epoch_ = 0;
  const bool one_stage_;  // StepPlan.share_samples is taken
  PersistentBatch state_;
  StepBatch batch_;
  google::protobuf::RepeatedPtrField<v1::RowSampling> sampling_;  // one per logit row; elements reused
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_STEP_STATE_H_
