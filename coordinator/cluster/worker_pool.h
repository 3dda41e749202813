// The coordinator's view of its workers: their connections, who registered, the plan that places
// them, their state, and the steps they run together.
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
//   3. Serving: every worker is READY; StartStep() broadcasts a StepPlan and FinishStep() gathers
//      every worker's StepResult. Several steps may be in flight (pipelined micro-batches): each
//      worker runs them in the order they were sent.
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
// Files: worker_pool.cc registration, the group and steps; cluster_status.cc the status
// (FillStatus); heartbeat_monitor.cc the monitor thread that marks silent workers lost.
//
// Ownership: borrows the ServedModel, which must outlive the pool; a WorkerLink is borrowed from
// Register() until Disconnect() returns. Owns a monitor thread (heartbeats), joined in the
// destructor.
// Threading: every method is thread-safe. Connect handlers (one thread per worker) call
// Register / OnMessage / Disconnect; one thread (the engine's) starts and finishes steps; status
// calls come from anywhere. The serving listener is called with mu_ held, so it
// must not call back into the pool.
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_WORKER_POOL_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_WORKER_POOL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/cluster/group.h"
#include "coordinator/planner/planner.h"
#include "coordinator/telemetry/metrics.h"
#include "coordinator/cluster/rendezvous_grants.h"
#include "coordinator/model/served_model.h"
#include "coordinator/cluster/worker_messages.h"  // kWorkerProtocolVersion, CheckRegister
#include "model/step_limits.h"
#include "shardserve/v1/inference.pb.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {

struct PoolOptions {
  int nodes = 1;          // pipeline stages
  int gpus_per_node = 1;  // TP ranks per stage
  // As the flags give them. Undecided (0) until the group forms: limits.max_model_len, the
  // planner's choice (the model's max_position_embeddings, lowered to what the KV cache holds),
  // and limits.num_kv_blocks, as many as the smallest worker's memory holds beside its weights
  // (the plan's), at most kMaxCpuKvCacheBytes per worker on CPU workers.
  StepLimits limits;
  // How the workers store the linear layers' weights (--quantization; kernels/quant.h).
  WeightQuant weight_quant = WeightQuant::kNone;
  // Whether the TP ranks hold whole experts (--expert-parallel; model/sharding.h).
  bool expert_parallel = false;
  // Where the workers' weights come from (--load-format, --dummy-seed; model/weight_source.h).
  LoadFormat load_format = LoadFormat::kAuto;
  uint64_t dummy_seed = 0;
  absl::Duration collective_timeout = absl::Seconds(5);
  absl::Duration heartbeat_timeout = absl::Seconds(3);
};

// KV cache a CPU worker allocates at most when --num-kv-blocks does not say: the host's memory
// is shared with everything else on it, and a local cluster runs several workers on one host
// (vLLM's CPU backend takes 4 GiB by default; 256 MiB holds thousands of tokens of small models).
constexpr uint64_t kMaxCpuKvCacheBytes = uint64_t{256} << 20;

// What a step came back with.
struct StepOutcome {
  std::vector<int32_t> sampled_ids;          // one per logit row
  std::vector<v1::RowLogprobs> logprobs;     // one per logit row when the step asked for any
  std::vector<int32_t> non_finite_rows;      // logit rows whose logits were not finite, ascending
  double forward_seconds = 0;                // the slowest worker's
  double collective_seconds = 0;             // the slowest worker's
};

// Where the pool's messages to one worker go: the gRPC service implements it over the worker's
// Connect stream.
class WorkerLink {
 public:
  virtual ~WorkerLink() = default;
  // Sends one message; false once the stream is broken. Thread-safe (writes are serialized).
  virtual bool Send(const v1::CoordinatorMessage& message) = 0;
  // Ends the stream from the coordinator's side, so that a Send in progress and the reader
  // return. Thread-safe; does not block.
  virtual void Cancel() = 0;
};

class WorkerPool {
 public:
  // Checks that TP = gpus_per_node x PP = nodes can hold `model` (TP divides the heads, PP at most
  // the layers, ...): InvalidArgument naming the numbers otherwise.
  static absl::StatusOr<std::unique_ptr<WorkerPool>> Create(const ServedModel* model, const PoolOptions& options);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Called with true when the group starts serving and false when it stops (and at once with the
  // current state). Replaces the previous listener. Called with mu_ held: it must not call the pool.
  void SetServingListener(std::function<void(bool serving)> listener);

  // Where the pool reports shardserve_worker_up (borrowed; must outlive the pool; null: nowhere).
  // Call before the first worker registers.
  void SetMetrics(CoordinatorMetrics* metrics);

  // Who may write and read which rendezvous keys: every Assignment and Regroup the pool sends
  // grants its worker that epoch's groups (rendezvous_grants.h). WorkerControlService checks each
  // RendezvousSet/Get against it. A worker's grant is revoked when the pool marks it LOST (also
  // while its stream is still open: frozen, a step deadline missed, a malformed message) and
  // when its stream ends (WorkerControlService).
  RendezvousGrants* rendezvous_grants() { return &rendezvous_grants_; }

  // ---- A worker's Connect stream, in this order ----
  // Admits a worker from its first message; `link` must stay valid until Disconnect(index)
  // returns. Returns the worker's index, or why it is refused (the caller tells the worker with a
  // Shutdown and ends the stream). May send the Assignments (when this worker completes the group).
  absl::StatusOr<int> Register(const v1::Register& hello, WorkerLink* link);
  // Every later message from the worker.
  void OnMessage(int worker, const v1::WorkerMessage& message);
  // The stream ended. The pool no longer uses the link once this returns.
  void Disconnect(int worker);

  // ---- Serving ----
  // OK while serving; otherwise Unavailable saying why (waiting for workers, loading, which
  // worker is lost and why, which slot a heal waits for, ...).
  absl::Status CheckServing();
  // Since when the group has been healing (a worker lost or failed while serving, and the group
  // not yet re-formed); none when it is not healing. Requests wait while it heals.
  std::optional<absl::Time> HealingSince();
  // "serving", "healing", "degraded" (broken, failed or shutting down) or "starting" (waiting for
  // workers, loading), and the group's epoch (0 before it forms): for status and metrics.
  std::string StateName();
  // The group's epoch: 1 once formed, one more at each re-forming; 0 before it forms.
  uint64_t epoch();
  // Sends `step` (a new, increasing step_id) to every worker; its result carries `logit_rows`
  // sampled ids (the rows that sample), and logprobs when `wants_logprobs`. Unavailable when the
  // group is not serving. Steps are finished in the order they were started. Plans are stateful:
  // after a failure here the group's workers must not get later plans (the engine clears its
  // scheduler; a new group starts empty).
  absl::Status StartStep(const v1::StepPlan& step, int logit_rows, bool wants_logprobs);
  // Waits for every worker's StepResult of the oldest step in flight, `step_id`, at most `timeout`.
  // Unavailable, naming the lost workers, when the group is not serving or breaks during the step
  // (a worker that misses the deadline is marked LOST). When a worker is lost during the step,
  // waits up to 1 s more for the others' news, so that the message names every worker involved,
  // the ones that vanished or hung first and those that failed because of them after.
  absl::Status FinishStep(uint64_t step_id, absl::Duration timeout, StepOutcome* outcome);
  // Forgets every step in flight (after a failure).
  void DropSteps();

  // The longest sequence served (the plan's once planned, the target before).
  int64_t max_model_len();
  // The step limits every worker got (decided: see PoolOptions), once the group has formed.
  StepLimits limits();
  // Pipeline stages (--nodes).
  int num_stages() const { return options_.nodes; }
  // Fills tp, pp, plan_text, workers and serving (defined in cluster_status.cc).
  void FillStatus(v1::ClusterStatus* status) ABSL_LOCKS_EXCLUDED(mu_);

  // Tells every connected worker to stop, ends their streams and refuses everything afterwards.
  void Shutdown(const std::string& reason);

 private:
  enum class Phase { kWaiting, kLoading, kServing, kHealing, kFailed, kShuttingDown };

  // Why a worker was lost, in the order a message lists them: a worker that vanished or hung is
  // more likely the cause than one that failed because a peer vanished.
  enum class LossCause { kStreamEnded = 0, kHeartbeat = 1, kStepDeadline = 2, kMalformed = 3, kFailure = 4 };

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

  // A step sent and not finished.
  struct InFlightStep {
    int rows = 0;                         // logit rows: ids the sampler must return
    bool wants_logprobs = false;          // some row asked for logprobs
    std::vector<bool> answered;           // by rank in group_
    std::vector<v1::StepResult> results;  // by rank in group_
  };

  WorkerPool(const ServedModel* model, const PoolOptions& options, const Plan& provisional,
             std::string model_fingerprint, std::vector<std::string> model_manifest);

  // Sends `message` to worker `index` outside mu_ (the link stays valid: Disconnect waits for
  // sends in flight). False when the worker is gone or the stream is broken.
  bool SendTo(int index, const v1::CoordinatorMessage& message) ABSL_LOCKS_EXCLUDED(mu_);
  // Plans the group once every worker has registered and returns the messages to send: the
  // Assignments, or Shutdowns when no plan can be made.
  std::vector<std::pair<int, v1::CoordinatorMessage>> FormGroupLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkLostLocked(int index, LossCause cause, const std::string& detail) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetPhaseLocked(Phase phase) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unavailable explaining why steps cannot run now.
  absl::Status NotServingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "worker w3 (node n1, stage 1, tp rank 0)".
  std::string NameLocked(int index) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every worker of the group answered `step` or is lost.
  bool StepSettledLocked(const InFlightStep& step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks a result worker `index` sent for `step`; an error says what is wrong.
  absl::Status CheckResultLocked(int index, const InFlightStep& step, const v1::StepResult& result) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A heal starts (from Serving) or goes on: no step starts until the group re-forms.
  void StartHealLocked(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string StateNameLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // While healing: when every slot has a live worker and every survivor has answered every step
  // it was sent, re-forms the group under a new epoch and returns the Assignments (replacements)
  // and Regroups (survivors) to send; otherwise nothing.
  std::vector<std::pair<int, v1::CoordinatorMessage>> TryRegroupLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // has its workers already). FailedPrecondition when its kind of device is not the group's; whether it fits its
  // node's slots is checked when the group forms (LetGoUnfitSparesLocked).
  absl::StatusOr<int> RegisterSpareWhileWaitingLocked(const v1::Register& hello, WorkerLink* link)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Once the group is formed: removes every spare that is not of one of the group's nodes or could
  // never hold its node's shard (CheckFitsSlotLocked), marks it lost and returns the Shutdown (its
  // refusal, saying why) to send it.
  std::vector<std::pair<int, v1::CoordinatorMessage>> LetGoUnfitSparesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when the worker `hello` describes can hold `slot`'s shard (the group's kind of device,
  // memory for the shard and the KV cache), else FailedPrecondition saying why.
  absl::Status CheckFitsSlotLocked(const v1::Register& hello, const Slot& slot) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // While healing: gives each open slot a spare of its node that fits, as its replacement.
  void UseSparesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The Assignment of slot `slot` for its holder, under the group's epoch.
  v1::CoordinatorMessage AssignmentLocked(const Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends each message outside mu_; a worker whose stream is broken is lost.
  void SendAll(const std::vector<std::pair<int, v1::CoordinatorMessage>>& messages) ABSL_LOCKS_EXCLUDED(mu_);
  // Marks workers silent for heartbeat_timeout lost, until the pool is destroyed (defined in
  // heartbeat_monitor.cc).
  void MonitorLoop() ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Constant after construction ----
  const ServedModel* const model_;
  const PoolOptions options_;
  const int64_t target_max_model_len_;  // from the plan made at Create
  // model/shard_identity.h ModelFingerprint of the served model ("" when it cannot be made: then no
  // worker is adopted).
  const std::string model_fingerprint_;
  // Its ModelManifest, sent in every Assignment: a worker whose copy differs does not load it
  // (empty when it cannot be made: then not checked).
  const std::vector<std::string> model_manifest_;

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
  // Steps started and not finished, by id. Results are taken while a step is in flight, also
  // after the group broke during it (they tell who answered).
  std::map<uint64_t, InFlightStep> steps_ ABSL_GUARDED_BY(mu_);
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

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_WORKER_POOL_H_
