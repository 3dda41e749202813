// The coordinator's view of its workers: their connections, who registered, the plan that places
// them, their state, and the steps they run together.
//
// The life of the group (waiting, loading, serving, healing, failed) is told in membership.h.
//
// The parts, each with its header in coordinator/cluster/: Membership (membership.h) owns the
// worker table and the phases (registration, spares and replacements, heartbeats, losses,
// healing and re-forming); GroupFormation (group_formation.h) computes the group, the plan, the
// step limits and each slot's Assignment; StepDispatcher (step_dispatcher.h) fans steps out and
// gathers their results. WorkerPool owns the three and is what the engine, the services and the
// tests hold: every method forwards to one of them, except OnMessage, which hands a StepResult to
// the dispatcher and every other message to the membership.
//
// Ownership: borrows the ServedModel, which must outlive the pool; a WorkerLink is borrowed from
// Register() until Disconnect() returns. Owns the membership's monitor thread (heartbeats), joined
// in the destructor.
// Threading: every method is thread-safe. Connect handlers (one thread per worker) call
// Register / OnMessage / Disconnect; one thread (the engine's) starts and finishes steps; status
// calls come from anywhere. One mutex, the membership's, guards the worker table, the group and
// the steps in flight. The serving listener is called with it held, so it must not call back
// into the pool.
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_WORKER_POOL_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_WORKER_POOL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/cluster/group_formation.h"
#include "coordinator/cluster/membership.h"
#include "coordinator/cluster/pool_options.h"
#include "coordinator/cluster/rendezvous_grants.h"
#include "coordinator/cluster/step_dispatcher.h"
#include "coordinator/cluster/worker_messages.h"  // kWorkerProtocolVersion, CheckRegister
#include "coordinator/model/served_model.h"
#include "coordinator/telemetry/metrics.h"
#include "model/step_limits.h"
#include "shardserve/v1/inference.pb.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {

class WorkerPool {
 public:
  // Checks that TP = gpus_per_node x PP = nodes can hold `model` (TP divides the heads, PP at most
  // the layers, ...): InvalidArgument naming the numbers otherwise.
  static absl::StatusOr<std::unique_ptr<WorkerPool>> Create(const ServedModel* model, const PoolOptions& options);
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Called with true when the group starts serving and false when it stops (and at once with the
  // current state). Replaces the previous listener. Called with the mutex held: it must not call
  // the pool.
  void SetServingListener(std::function<void(bool serving)> listener) {
    membership_.SetServingListener(std::move(listener));
  }

  // Where the pool reports shardserve_worker_up (borrowed; must outlive the pool; null: nowhere).
  // Call before the first worker registers.
  void SetMetrics(CoordinatorMetrics* metrics) { membership_.SetMetrics(metrics); }

  // Who may write and read which rendezvous keys: every Assignment and Regroup the pool sends
  // grants its worker that epoch's groups (rendezvous_grants.h). WorkerControlService checks each
  // RendezvousSet/Get against it. A worker's grant is revoked when the pool marks it LOST (also
  // while its stream is still open: frozen, a step deadline missed, a malformed message) and
  // when its stream ends (WorkerControlService).
  RendezvousGrants* rendezvous_grants() { return membership_.rendezvous_grants(); }

  // ---- A worker's Connect stream, in this order ----
  // Admits a worker from its first message; `link` must stay valid until Disconnect(index)
  // returns. Returns the worker's index, or why it is refused (the caller tells the worker with a
  // Shutdown and ends the stream). May send the Assignments (when this worker completes the group).
  absl::StatusOr<int> Register(const v1::Register& hello, WorkerLink* link) {
    return membership_.Register(hello, link);
  }
  // Every later message from the worker: a StepResult to the step dispatcher, the rest to the
  // membership.
  void OnMessage(int worker, const v1::WorkerMessage& message);
  // The stream ended. The pool no longer uses the link once this returns.
  void Disconnect(int worker) { membership_.Disconnect(worker); }

  // ---- Serving ----
  // OK while serving; otherwise Unavailable saying why (waiting for workers, loading, which
  // worker is lost and why, which slot a heal waits for, ...).
  absl::Status CheckServing() { return membership_.CheckServing(); }
  // Since when the group has been healing (a worker lost or failed while serving, and the group
  // not yet re-formed); none when it is not healing. Requests wait while it heals.
  std::optional<absl::Time> HealingSince() { return membership_.HealingSince(); }
  // "serving", "healing", "degraded" (broken, failed or shutting down) or "starting" (waiting for
  // workers, loading): for status and metrics.
  std::string StateName() { return membership_.StateName(); }
  // The group's epoch: 1 once formed, one more at each re-forming; 0 before it forms.
  uint64_t epoch() { return membership_.epoch(); }
  // Sends `step` (a new, increasing step_id) to every worker; its result carries `logit_rows`
  // sampled ids (the rows that sample), logprobs when `wants_logprobs`, and `draft_ids` ids a draft
  // model proposed (StepResult.draft_ids; 0: none asked). Unavailable when the
  // group is not serving. Steps are finished in the order they were started. Plans are stateful:
  // after a failure here the group's workers must not get later plans (the engine clears its
  // scheduler; a new group starts empty).
  absl::Status StartStep(const v1::StepPlan& step, int logit_rows, bool wants_logprobs, int draft_ids = 0) {
    return steps_.StartStep(step, logit_rows, wants_logprobs, draft_ids);
  }
  // Waits for every worker's StepResult of the oldest step in flight, `step_id`, at most `timeout`.
  // Unavailable, naming the lost workers, when the group is not serving or breaks during the step
  // (a worker that misses the deadline is marked LOST). When a worker is lost during the step,
  // waits up to 1 s more (kLossSettle) for the others' news, so that the message names every
  // worker involved, the ones that vanished or hung first and those that failed because of them
  // after.
  absl::Status FinishStep(uint64_t step_id, absl::Duration timeout, StepOutcome* outcome) {
    return steps_.FinishStep(step_id, timeout, outcome);
  }
  // Forgets every step in flight (after a failure).
  void DropSteps() { steps_.DropSteps(); }

  // The longest sequence served (the plan's once planned, the target before).
  int64_t max_model_len() { return membership_.max_model_len(); }
  // The step limits every worker got (decided: see PoolOptions), once the group has formed.
  StepLimits limits() { return membership_.limits(); }
  // Pipeline stages (--nodes).
  int num_stages() const { return membership_.formation().options().nodes; }
  // Workers in the group (--nodes x --gpus-per-node).
  int group_size() const { return membership_.formation().group_size(); }
  // Fills tp, pp, plan_text, workers and serving.
  void FillStatus(v1::ClusterStatus* status) { membership_.FillStatus(status); }

  // Tells every connected worker to stop, ends their streams and refuses everything afterwards.
  void Shutdown(const std::string& reason) { membership_.Shutdown(reason); }

 private:
  explicit WorkerPool(GroupFormation formation);

  Membership membership_;
  StepDispatcher steps_;  // runs on membership_, declared after it
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_WORKER_POOL_H_
