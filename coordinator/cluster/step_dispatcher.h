// The step dispatcher: fans each step out to the group's workers (the full plan to the last
// stage, which samples; the plan without token masks and cached token ids to the others) and gathers their results.
// Several steps may be in flight (pipelined micro-batches): each worker runs them in the order
// they were sent, and they are finished in the order they were started.
//
// It runs on the group Membership (membership.h) holds, under Membership's mutex: a worker lost or
// a heal started there fails the steps in flight at once, and a step's deadline missed here marks
// the worker lost there.
//
// Ownership: borrows the Membership, which must outlive it. Threading: every method is
// thread-safe; one thread (the engine's) starts and finishes steps, the Connect handlers hand in
// results.
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_STEP_DISPATCHER_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_STEP_DISPATCHER_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "coordinator/cluster/membership.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {

// What a step came back with.
struct StepOutcome {
  std::vector<int32_t> sampled_ids;          // one per logit row
  std::vector<v1::RowLogprobs> logprobs;     // one per logit row when the step asked for any
  std::vector<int32_t> non_finite_rows;      // logit rows whose logits were not finite, ascending
  std::vector<int32_t> draft_ids;            // a draft model's guesses (StepResult.draft_ids)
  double forward_seconds = 0;                // the slowest worker's
  double collective_seconds = 0;             // the slowest worker's
};

class StepDispatcher {
 public:
  explicit StepDispatcher(Membership* membership);
  StepDispatcher(const StepDispatcher&) = delete;
  StepDispatcher& operator=(const StepDispatcher&) = delete;

  // worker_pool.h StartStep, FinishStep and DropSteps say what these do.
  absl::Status StartStep(const v1::StepPlan& step, int logit_rows, bool wants_logprobs, int draft_ids)
      ABSL_LOCKS_EXCLUDED(membership_->mu());
  absl::Status FinishStep(uint64_t step_id, absl::Duration timeout, StepOutcome* outcome)
      ABSL_LOCKS_EXCLUDED(membership_->mu());
  void DropSteps() ABSL_LOCKS_EXCLUDED(membership_->mu());

  // A StepResult from worker `worker` (WorkerPool::OnMessage hands them here): taken when it is of
  // a step in flight, of the group's epoch, from the worker that holds its slot, and the first
  // for it; a malformed one (worker_messages.h CheckStepResult) marks the worker lost. Results are
  // taken while a step is in flight, also after the group broke during it (they tell who
  // answered).
  void OnResult(int worker, const v1::StepResult& result) ABSL_LOCKS_EXCLUDED(membership_->mu());

 private:
  // A step sent and not finished.
  struct InFlightStep {
    int rows = 0;                         // logit rows: ids the sampler must return
    bool wants_logprobs = false;          // some row asked for logprobs
    int draft_ids = 0;                    // ids of a draft model's guesses the sampler must return
    std::vector<bool> answered;           // by rank in the group
    std::vector<v1::StepResult> results;  // by rank in the group
  };

  // Every worker of the group answered `step` or is lost.
  bool StepSettledLocked(const InFlightStep& step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(membership_->mu());
  // Checks a result worker `worker` sent for `step`; an error says what is wrong.
  absl::Status CheckResultLocked(int worker, const InFlightStep& step, const v1::StepResult& result) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(membership_->mu());

  // ---- Constant after construction ----
  Membership* const membership_;
  const int num_stages_;
  const int64_t vocab_size_;

  // Guarded by the membership's mutex (membership_->mu()).
  // Steps started and not finished, by id.
  std::map<uint64_t, InFlightStep> steps_ ABSL_GUARDED_BY(membership_->mu());
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_STEP_DISPATCHER_H_
