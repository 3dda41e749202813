// Membership: the coordinator's table of its workers and the life of their group: registration,
// spares and replacements, heartbeats, losses and failures, healing and re-forming under a new
// epoch, the phase, and the status.
//
// Life of the group:
//   1. Waiting: workers register (worker.proto Register) until nodes x gpus_per_node have come.
//      A worker that would add a node too many is refused. One for a node that has its workers
//      already waits as a spare of that node (as a spare worker, Register.spare, may): when the
//      group forms, a spare that is not of one of its nodes or could never hold its node's shard
//      is refused then (told why in a Shutdown). A worker that leaves now just leaves; a spare of
//      its node takes its place, or another worker may.
//   2. Loading: the group is formed (coordinator/cluster/group.h: each node is one pipeline
//      stage, in the natural order of the node names, its workers that stage's TP ranks in
//      registration order; ranks, TP and PP group names under epoch 1), and the planner
//      (coordinator/planner) lays the model out as TP = gpus_per_node x PP = nodes: the layers of
//      each stage and the KV cache. Every worker gets its Assignment and loads; each answers Loaded.
//   3. Serving: every worker is READY; the step dispatcher (step_dispatcher.h) broadcasts a StepPlan
//      (StartStep) and gathers every worker's StepResult (FinishStep). Several steps may be in
//      flight (pipelined micro-batches): each worker runs them in the order they were sent.
//   4. Healing (docs/healing.md): while serving or loading, a worker is LOST (its control stream
//      ended, it sent nothing for heartbeat_timeout, it missed a step deadline, or it sent a
//      malformed message) or a worker reports a Failure (a step or a collective failed, most often because a
//      peer died). The steps in flight fail at once with UNAVAILABLE naming the worker; the plan
//      stays, no new step starts, and the engine holds its requests (it recomputes them when the
//      group is whole again, or fails them after --heal-timeout-seconds). A worker that registers
//      from the lost slot's node, whose device and memory fit the slot's shard, takes the slot
//      (else it is refused, saying why, and the slot stays open); so does, at once, a spare of
//      that node (Register.spare: registered in any phase, idle until then; once the group has
//      formed, one from a node outside the group or that cannot hold its node's shard is refused). Once every slot has a live
//      worker and every survivor has answered every step it was sent (a survivor stuck in a
//      collective with the dead peer errors out within the collective timeout), the group
//      re-forms under a new epoch (group.h Replace, NextEpoch): the replacement gets
//      its slot's Assignment, every survivor a Regroup (new group names; it keeps its weights and
//      drops its running batch). When every worker answers Loaded under the new epoch, the group
//      serves again. A failure during the heal (another loss, a failed regroup) starts the
//      re-forming over under the next epoch. Messages of an older epoch (results, failures,
//      Loaded) are ignored; every StepPlan carries the epoch and the workers refuse another.
//      A worker that registers once the group has formed, from one of its nodes, when no slot of
//      that node is open (the worker of a slot a spare took, started again; a lost worker that
//      registers again) becomes a spare of its node (it fits the node's shard, or it is refused).
//   5. Failed: the group re-formed kMaxHealsWithoutProgress times without completing a step in
//      between (a worker that fails on its own, not because of a peer). Steps and requests fail
//      with UNAVAILABLE saying why; a coordinator restart forms a new group.
// Failed (also when the plan cannot be made, e.g. the model does not fit) and ShuttingDown are final.
//
// A restarted coordinator (docs/healing.md "The coordinator restarts"): workers outlive their
// coordinator and register again presenting the shard they hold (Register.held). The group forms
// as in 2., except that a worker takes the TP rank of the shard it holds when that rank of its node
// is free, and the first epoch is one more than the highest held. A worker whose held shard is
// exactly its slot's (the same model fingerprint and SameShard, model/shard_identity.h) gets an
// Assignment with adopt: it keeps its weights and only joins the new groups. Any other held shard
// is dropped and the slot's loaded (logged, saying what differs). The same holds for a replacement
// that registers while healing with a held shard.
//
// It owns the worker table and the group; GroupFormation (group_formation.h) computes the group,
// the plan and the assignments it sends. StepDispatcher (step_dispatcher.h) runs steps on the
// group under this class's mutex: the "for the step dispatcher" methods below.
//
// Files: membership.cc registration, loading and healing; heartbeat_monitor.cc the monitor thread
// that marks silent workers lost; cluster_status.cc the status (FillStatus).
//
// Ownership: borrows the ServedModel (through its GroupFormation), which must outlive it; a
// WorkerLink is borrowed from Register() until Disconnect() returns. Owns a monitor thread
// (heartbeats), joined in the destructor.
// Threading: every public method without "Locked" in its name is thread-safe and takes mu_
// (Send and SendAll take it around each send, not during it); the "Locked" ones need mu_ held.
// Connect handlers (one thread per worker) call Register / OnMessage / Disconnect; status calls
// come from anywhere. The serving listener is called with mu_ held, so it must not call back into
// the membership.
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_MEMBERSHIP_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_MEMBERSHIP_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/cluster/group.h"
#include "coordinator/cluster/group_formation.h"
#include "coordinator/cluster/pool_options.h"
#include "coordinator/cluster/rendezvous_grants.h"
#include "coordinator/planner/planner.h"
#include "coordinator/telemetry/metrics.h"
#include "model/step_limits.h"
#include "shardserve/v1/inference.pb.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {

// When a step breaks, how long to wait for the other workers' news before answering: a killed
// worker's peers report their own failure (a lost connection) at about the time its stream ends,
// and the message should name the worker that vanished, not only the peers that noticed.
constexpr absl::Duration kLossSettle = absl::Seconds(1);

// Where the coordinator's messages to one worker go: the gRPC service implements it over the
// worker's Connect stream.
class WorkerLink {
 public:
  virtual ~WorkerLink() = default;
  // Sends one message; false once the stream is broken. Thread-safe (writes are serialized).
  virtual bool Send(const v1::CoordinatorMessage& message) = 0;
  // Ends the stream from the coordinator's side, so that a Send in progress and the reader
  // return. Thread-safe; does not block.
  virtual void Cancel() = 0;
};

// Messages to send (outside the mutex), each to a worker by index.
using Outgoing = std::vector<std::pair<int, v1::CoordinatorMessage>>;

class Membership {
 public:
  enum class Phase { kWaiting, kLoading, kServing, kHealing, kFailed, kShuttingDown };

  // Why a worker was lost, in the order a message lists them: a worker that vanished or hung is
  // more likely the cause than one that failed because a peer vanished.
  enum class LossCause { kStreamEnded = 0, kHeartbeat = 1, kStepDeadline = 2, kMalformed = 3, kFailure = 4 };

  // Starts the monitor thread.
  explicit Membership(GroupFormation formation);
  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  const GroupFormation& formation() const { return formation_; }

  // Called with true when the group starts serving and false when it stops (and at once with the
  // current state). Replaces the previous listener. Called with mu_ held: it must not call back.
  void SetServingListener(std::function<void(bool serving)> listener) ABSL_LOCKS_EXCLUDED(mu_);
  // Where shardserve_worker_up and the heal metrics go (borrowed; must outlive this; null:
  // nowhere). Call before the first worker registers.
  void SetMetrics(CoordinatorMetrics* metrics) ABSL_LOCKS_EXCLUDED(mu_);
  // Who may write and read which rendezvous keys (worker_pool.h rendezvous_grants()).
  RendezvousGrants* rendezvous_grants() { return &rendezvous_grants_; }

  // ---- A worker's Connect stream, in this order (worker_pool.h) ----
  absl::StatusOr<int> Register(const v1::Register& hello, WorkerLink* link) ABSL_LOCKS_EXCLUDED(mu_);
  // A message other than a StepResult (those are StepDispatcher::OnResult's).
  void OnMessage(int worker, const v1::WorkerMessage& message) ABSL_LOCKS_EXCLUDED(mu_);
  void Disconnect(int worker) ABSL_LOCKS_EXCLUDED(mu_);

  // ---- State (worker_pool.h says what each returns) ----
  absl::Status CheckServing() ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<absl::Time> HealingSince() ABSL_LOCKS_EXCLUDED(mu_);
  std::string StateName() ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t epoch() ABSL_LOCKS_EXCLUDED(mu_);
  int64_t max_model_len() ABSL_LOCKS_EXCLUDED(mu_);
  StepLimits limits() ABSL_LOCKS_EXCLUDED(mu_);
  // Defined in cluster_status.cc.
  void FillStatus(v1::ClusterStatus* status) ABSL_LOCKS_EXCLUDED(mu_);
  void Shutdown(const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);

  // ---- For the step dispatcher, which runs steps under mu_ ----
  absl::Mutex* mu() const ABSL_LOCK_RETURNED(mu_) { return &mu_; }
  Phase PhaseLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return phase_; }
  // Unavailable explaining why steps cannot run now (OK while serving).
  absl::Status NotServingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The group; only once formed (every phase but kWaiting, and kFailed before forming).
  const Group& GroupLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return *group_; }
  bool LostLocked(int worker) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The worker's (stage, tp rank); (-1, -1) before it has a slot.
  std::pair<int, int> PositionLocked(int worker) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkLostLocked(int worker, LossCause cause, const std::string& detail) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Notes that `worker` was heard from now; false when it is lost (nothing it says matters now).
  bool HeardLocked(int worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Step `step_id` was sent to `worker`.
  void StepSentLocked(int worker, uint64_t step_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `worker` answered step `step_id` (a result): while healing, a survivor may be settled now, so
  // it returns the messages of a re-forming, if one is due.
  Outgoing StepAnsweredLocked(int worker, uint64_t step_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A step completed on every worker: the count of re-formings without progress starts over.
  void StepCompletedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { heals_without_progress_ = 0; }
  // Waits until something changes (a result arrived, a worker was lost, the phase changed, ...) or
  // `deadline`; true when the deadline passed.
  bool WaitLocked(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return changed_.WaitWithDeadline(&mu_, deadline);
  }
  // Wakes every WaitLocked.
  void SignalLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { changed_.SignalAll(); }
  // Sends `message` to `worker` outside mu_ (the link stays valid: Disconnect waits for sends in
  // flight); a worker whose stream is broken is lost.
  void Send(int worker, const v1::CoordinatorMessage& message) ABSL_LOCKS_EXCLUDED(mu_);
  // Send for each message.
  void SendAll(const Outgoing& messages) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Worker {
    // ---- Set at Register ----
    std::string id;  // "w3"
    v1::Register hello;
    // ---- Set when the group is formed ----
    int stage = -1;
    int tp_rank = -1;
    int64_t first_layer = 0, end_layer = 0;
    // ---- State ----
    v1::WorkerState state = v1::WORKER_STATE_REGISTERED;
    LossCause cause = LossCause::kStreamEnded;
    std::string detail;  // why LOST
    absl::Time lost_at;
    int64_t weight_bytes = 0;
    absl::Time last_heard;
    WorkerLink* link = nullptr;  // null once disconnected
    int sends_in_flight = 0;     // Send calls running on `link` outside mu_
    // ---- Healing ----
    uint64_t epoch = 0;          // of the Assignment or Regroup it was last sent
    bool loaded = false;         // has loaded its shard once (a Regroup keeps it)
    bool failed = false;         // reported a Failure under `epoch`: the group must re-form
    bool load_pending = false;   // sent an Assignment or Regroup it has not answered yet
    bool adopting = false;       // its Assignment adopts the shard it held (Register.held)
    bool replacement = false;    // took a lost worker's slot (not in the group as first formed)
    uint64_t last_step_sent = 0;      // the last step it was sent
    uint64_t last_step_answered = 0;  // the last step it answered (a result or a Failure)
  };

  // Sends `message` to worker `index` outside mu_. False when the worker is gone or the stream is
  // broken.
  bool SendTo(int index, const v1::CoordinatorMessage& message) ABSL_LOCKS_EXCLUDED(mu_);
  // Forms and plans the group once every worker has registered (GroupFormation::Form) and returns
  // the messages to send: the Assignments, or Shutdowns when no plan can be made.
  Outgoing FormGroupLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetPhaseLocked(Phase phase) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "worker w3 (node n1, stage 1, tp rank 0)".
  std::string NameLocked(int index) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A heal starts (from Serving) or goes on: no step starts until the group re-forms.
  void StartHealLocked(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string StateNameLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // While healing: when every slot has a live worker and every survivor has answered every step
  // it was sent, re-forms the group under a new epoch and returns the Assignments (replacements)
  // and Regroups (survivors) to send; otherwise nothing.
  Outgoing TryRegroupLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends a worker for `hello` (id "w<index>", heard from now) and returns its index.
  int AddWorkerLocked(const v1::Register& hello, WorkerLink* link) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers `hello` as the replacement for a lost slot of its node while healing, or says why
  // not (no open slot on that node, another device kind, too little memory for the shard).
  absl::StatusOr<int> RegisterReplacementLocked(const v1::Register& hello, WorkerLink* link)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a slot of `node` is lost and has no replacement yet (a heal waits for it).
  bool HasOpenSlotLocked(const std::string& node) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers `hello` as a spare of its node once the group is formed: a spare worker
  // (Register.spare), or a worker that finds every slot of its node held (the worker of a slot
  // that a spare or a replacement took, coming back). FailedPrecondition naming its node and the
  // group's nodes when its node is not one of them, or saying why it cannot hold that node's shard.
  absl::StatusOr<int> RegisterAsSpareLocked(const v1::Register& hello, WorkerLink* link)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers `hello` as a spare of its node while the group forms (Register.spare, or its node
  // has its workers already). FailedPrecondition when its kind of device is not the group's;
  // whether it fits its node's slots is checked when the group forms (LetGoUnfitSparesLocked).
  absl::StatusOr<int> RegisterSpareWhileWaitingLocked(const v1::Register& hello, WorkerLink* link)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Once the group is formed: removes every spare that is not of one of the group's nodes or could
  // never hold its node's shard (CheckFitsSlotLocked), marks it lost and returns the Shutdown (its
  // refusal, saying why) to send it.
  Outgoing LetGoUnfitSparesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // GroupFormation::CheckFitsSlot against the slot's present worker's device and the group's plan.
  absl::Status CheckFitsSlotLocked(const v1::Register& hello, const Slot& slot) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // While healing: gives each open slot a spare of its node that fits, as its replacement.
  void UseSparesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The Assignment of slot `slot` for its holder, under the group's epoch (GroupFormation's, with
  // the holder's rendezvous grant and, for a worker that held this shard, adopt).
  v1::CoordinatorMessage AssignmentLocked(const Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks workers silent for heartbeat_timeout lost, until destroyed (heartbeat_monitor.cc).
  void MonitorLoop() ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Constant after construction ----
  const GroupFormation formation_;
  const PoolOptions& options_ = formation_.options();

  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // a result arrived, a worker was lost, a send finished, ...
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kWaiting;
  std::string failed_reason_ ABSL_GUARDED_BY(mu_);    // kFailed, kShuttingDown
  std::vector<std::unique_ptr<Worker>> workers_ ABSL_GUARDED_BY(mu_);  // by index, every one ever registered
  std::vector<int> pending_ ABSL_GUARDED_BY(mu_);     // kWaiting: the registered workers
  // Once formed: who holds each slot, by rank, and the group names (never reset).
  std::optional<Group> group_ ABSL_GUARDED_BY(mu_);
  std::optional<Plan> plan_ ABSL_GUARDED_BY(mu_);
  StepLimits limits_ ABSL_GUARDED_BY(mu_);
  std::function<void(bool)> listener_ ABSL_GUARDED_BY(mu_);
  CoordinatorMetrics* metrics_ ABSL_GUARDED_BY(mu_) = nullptr;
  RendezvousGrants rendezvous_grants_;  // thread-safe on its own; Grant is called under mu_
  bool stop_monitor_ ABSL_GUARDED_BY(mu_) = false;
  // ---- Healing ----
  absl::Time heal_started_ ABSL_GUARDED_BY(mu_);
  // A loss or failure since the last Regroup: the group must re-form under a new epoch.
  bool needs_new_epoch_ ABSL_GUARDED_BY(mu_) = false;
  // Replacements registered for lost slots, by rank; they join at the next re-forming.
  std::map<int, int> replacements_ ABSL_GUARDED_BY(mu_);
  // Spare workers (Register.spare), idle until a slot of their node is lost.
  std::vector<int> spares_ ABSL_GUARDED_BY(mu_);
  // Re-formings since the last step that completed: past kMaxHealsWithoutProgress, Failed.
  int heals_without_progress_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread monitor_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_MEMBERSHIP_H_
