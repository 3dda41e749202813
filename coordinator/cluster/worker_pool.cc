#include "coordinator/cluster/worker_pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "coordinator/planner/format.h"
#include "coordinator/planner/memory.h"
#include "coordinator/telemetry/log.h"
#include "model/shard_identity.h"
#include "kernels/sampling.h"

namespace shardserve {
namespace {

// When a step breaks, how long to wait for the other workers' news before answering: a killed
// worker's peers report their own failure (a lost connection) at about the time its stream ends,
// and the message should name the worker that vanished, not only the peers that noticed.
constexpr absl::Duration kLossSettle = absl::Seconds(1);
// Why a worker whose stream is gone is lost, whether the reader or a writer noticed first.
constexpr char kStreamEnded[] =
    "its control stream ended (the process exited or was killed, or the connection dropped)";
// Memory assumed per worker when planning only to check the layout (Create): enough for any model.
constexpr uint64_t kProvisionalMemory = uint64_t{1} << 40;
// The group first forms under epoch 1; each re-forming (a heal) takes the next.
constexpr uint64_t kFirstEpoch = 1;
// Re-formings without a step completing in between before the group is given up: a worker that
// fails every step on its own (not because a peer died) would otherwise heal forever.
constexpr int kMaxHealsWithoutProgress = 3;
// Held epochs (Register.held) from this one on are ignored when choosing the first epoch (one more
// must not overflow).
constexpr uint64_t kMaxHeldEpoch = uint64_t{1} << 62;

// Memory bandwidth assumed where a worker reports none (a CPU worker without
// --memory-bandwidth-gbps): a server's DRAM. Register refuses a figure the planner does not take.
constexpr double kAssumedMemoryBytesPerS = 20e9;

// The planner's cluster for the workers. The figures for the links and the memory bandwidth only
// feed the planner's decode estimate, which chooses nothing here (the layout is fixed by the
// flags): the workers' memory bandwidth, and loopback or Ethernet between processes.
ClusterSpec ClusterFor(int nodes, int gpus_per_node, const std::string& device, uint64_t memory_bytes,
                       double memory_bytes_per_s) {
  ClusterSpec c;
  c.gpu = GpuSpec{device, memory_bytes, memory_bytes_per_s};
  c.gpus_per_node.assign(nodes, gpus_per_node);
  c.intra_node_bytes_per_s = 10e9;
  c.intra_node_latency_s = 20e-6;
  c.inter_node_bytes_per_s = 1.25e9;
  c.inter_node_latency_s = 50e-6;
  return c;
}

PlanOptions PlanOptionsFor(const PoolOptions& o, bool cpu_only) {
  PlanOptions p;
  p.tp = o.gpus_per_node;
  p.pp = o.nodes;
  p.limits = o.limits;  // the plan decides num_kv_blocks (and max_model_len when 0)
  p.weight_quant = o.weight_quant;
  p.expert_parallel = o.expert_parallel;
  if (cpu_only) {
    p.dtype = DType::kF32;        // the CPU backend computes and stores in float32
    p.runtime_reserve_bytes = 0;  // no CUDA context or library workspaces
  }
  return p;
}


}  // namespace

absl::StatusOr<std::unique_ptr<WorkerPool>> WorkerPool::Create(const ServedModel* model, const PoolOptions& options) {
  if (options.nodes < 1 || options.gpus_per_node < 1 || options.nodes > 4096 || options.gpus_per_node > 4096 ||
      options.nodes * options.gpus_per_node > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("--nodes ", options.nodes, " x --gpus-per-node ",
                                                   options.gpus_per_node, ": need 1 to 4096 workers"));
  }
  SHARDSERVE_RETURN_IF_ERROR(options.limits.Validate());
  absl::StatusOr<Plan> plan =
      MakePlan(model->config, model->checkpoint.get(),
               ClusterFor(options.nodes, options.gpus_per_node, "worker", kProvisionalMemory, kAssumedMemoryBytesPerS),
               PlanOptionsFor(options, /*cpu_only=*/false));
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot serve ", model->name, " as TP=", options.gpus_per_node,
                                                   " (workers per node) x PP=", options.nodes, " (nodes): ",
                                                   plan.status().message()));
  }
  absl::StatusOr<std::vector<std::string>> manifest = ModelManifest(model->dir);
  absl::StatusOr<std::string> fingerprint = ModelFingerprint(model->dir);
  if (!manifest.ok() || !fingerprint.ok()) {
    CoordinatorLog("group", absl::StrCat("no fingerprint of the model (workers of an earlier coordinator will reload "
                                         "their shards; the workers' copies of it are not checked): ",
                                         (manifest.ok() ? fingerprint.status() : manifest.status()).message()));
  }
  return std::unique_ptr<WorkerPool>(new WorkerPool(model, options, *plan, fingerprint.ok() ? *fingerprint : "",
                                                    manifest.ok() ? *manifest : std::vector<std::string>{}));
}

WorkerPool::WorkerPool(const ServedModel* model, const PoolOptions& options, const Plan& provisional,
                       std::string model_fingerprint, std::vector<std::string> model_manifest)
    : model_(model),
      options_(options),
      target_max_model_len_(provisional.max_model_len),
      model_fingerprint_(std::move(model_fingerprint)),
      model_manifest_(std::move(model_manifest)) {
  monitor_ = std::thread([this] { MonitorLoop(); });
}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_monitor_ = true;
  }
  monitor_.join();
}

void WorkerPool::SetServingListener(std::function<void(bool)> listener) {
  absl::MutexLock lock(&mu_);
  listener_ = std::move(listener);
  listener_(phase_ == Phase::kServing);
}

// ---- Registration and the group ---------------------------------------------------------------

absl::StatusOr<int> WorkerPool::Register(const v1::Register& hello, WorkerLink* link) {
  SHARDSERVE_RETURN_IF_ERROR(CheckRegister(hello));

  std::vector<std::pair<int, v1::CoordinatorMessage>> to_send;
  int index = 0;
  {
    absl::MutexLock lock(&mu_);
    const int expected = options_.nodes * options_.gpus_per_node;
    const bool healing = phase_ == Phase::kHealing;
    switch (phase_) {
      case Phase::kShuttingDown: return absl::UnavailableError("the coordinator is shutting down");
      case Phase::kFailed: return absl::FailedPreconditionError(failed_reason_);
      case Phase::kWaiting: {  // one more worker for the group, or a spare
        std::map<std::string, int> per_node;
        for (int i : pending_) ++per_node[workers_[i]->hello.node()];
        if (!per_node.count(hello.node()) && static_cast<int>(per_node.size()) == options_.nodes) {
          std::vector<std::string> names;
          for (const auto& [name, count] : per_node) names.push_back(name);
          return absl::FailedPreconditionError(absl::StrCat("the group already has its ", options_.nodes, " nodes (",
                                                            absl::StrJoin(names, ", "), "): node ", hello.node(),
                                                            " is one too many (--nodes)"));
        }
        if (hello.spare() || per_node[hello.node()] >= options_.gpus_per_node) {
          // A spare, or its node has its workers already (most often one of them, started again by
          // a supervisor, or one too many started for it): it waits as a spare of its node, as it
          // would once the group serves.
          return RegisterSpareWhileWaitingLocked(hello, link);
        }
        index = AddWorkerLocked(hello, link);
        pending_.push_back(index);
        CoordinatorLog(workers_[index]->id,
                       absl::StrCat("registered from node ", hello.node(), " (", hello.device(), ", ", hello.address(),
                                    hello.metrics_address().empty() ? "" : ", metrics ", hello.metrics_address(),
                                    hello.has_held() ? absl::StrCat(", holding stage ", hello.held().assignment().stage(),
                                                                    " tp rank ", hello.held().assignment().tp_rank(),
                                                                    " of epoch ", hello.held().assignment().epoch(),
                                                                    " from an earlier coordinator")
                                                     : "",
                                    "): ", pending_.size(), " of ", expected, " workers"),
                       LogIds{"", workers_[index]->id, hello.node()});
        if (static_cast<int>(pending_.size()) == expected) to_send = FormGroupLocked();
        break;
      }
      case Phase::kHealing:
      case Phase::kLoading:
      case Phase::kServing: {
        // A worker (not Register.spare) takes an open slot of its node (healing). Otherwise (most
        // often the worker of a slot a spare or a replacement has taken, started again by a
        // supervisor, or a lost worker that registers again), and always for Register.spare, it
        // becomes a spare of its node, if it is of one of the group's nodes and fits its slots; a
        // spare takes an open slot of its node at once.
        const bool open = healing && !hello.spare() && HasOpenSlotLocked(hello.node());
        absl::StatusOr<int> joined = open ? RegisterReplacementLocked(hello, link) : RegisterAsSpareLocked(hello, link);
        if (!joined.ok()) {
          CoordinatorLog("group", absl::StrCat("refused a ", hello.spare() ? "spare" : "worker", " from node ",
                                               hello.node(), ": ", joined.status().message()),
                         LogIds{"", "", hello.node(), -1, -1, "warn"});
          return joined.status();
        }
        index = *joined;
        if (healing) {
          UseSparesLocked();
          to_send = TryRegroupLocked();
        }
        break;
      }
    }
  }
  SendAll(to_send);
  return index;
}

void WorkerPool::SendAll(const std::vector<std::pair<int, v1::CoordinatorMessage>>& messages) {
  for (const auto& [i, message] : messages) {
    if (!SendTo(i, message)) {
      absl::MutexLock lock(&mu_);
      MarkLostLocked(i, LossCause::kStreamEnded, kStreamEnded);
    }
  }
}

std::vector<std::pair<int, v1::CoordinatorMessage>> WorkerPool::FormGroupLocked() {
  const int tp = options_.gpus_per_node, pp = options_.nodes;
  // Slots, ranks and group names (coordinator/cluster/group.h): the nodes in natural order are
  // the stages, a node's workers in registration order its TP ranks.
  uint64_t memory = UINT64_MAX;
  double bandwidth = std::numeric_limits<double>::infinity();  // the slowest worker's; 0 if one is unknown
  bool cpu_only = true;
  // The first epoch: after every epoch a worker held under an earlier coordinator, so that epochs
  // only grow across coordinator restarts (and an adopted worker's Regroup is to a later one).
  uint64_t first_epoch = kFirstEpoch;
  for (int i : pending_) {
    const v1::Register& h = workers_[i]->hello;
    memory = std::min(memory, static_cast<uint64_t>(h.memory_bytes()));
    bandwidth = std::min(bandwidth, h.memory_bytes_per_s());  // 0 or in range (Register checked)
    cpu_only = cpu_only && h.device() == "cpu";
    if (h.has_held() && h.held().assignment().epoch() < kMaxHeldEpoch) {
      first_epoch = std::max(first_epoch, h.held().assignment().epoch() + 1);
    }
  }
  // A node's workers in registration order are its TP ranks, except that a worker holding a shard
  // of this layout (an earlier coordinator's) takes its rank when it is free, so that it can be
  // adopted.
  std::map<std::string, std::vector<int>> by_rank;  // node -> worker index per TP rank, -1: free
  std::vector<std::string> node_order;
  std::vector<int> unplaced;
  for (int i : pending_) {
    const v1::Register& h = workers_[i]->hello;
    std::vector<int>& ranks = by_rank[h.node()];
    if (ranks.empty()) {
      ranks.assign(tp, -1);
      node_order.push_back(h.node());
    }
    const int held = h.has_held() && h.held().assignment().tp_size() == tp ? h.held().assignment().tp_rank() : -1;
    if (held >= 0 && held < tp && ranks[held] < 0) {
      ranks[held] = i;
    } else {
      unplaced.push_back(i);
    }
  }
  for (int i : unplaced) {  // Register keeps a node at most tp workers: a free rank is left
    std::vector<int>& ranks = by_rank[workers_[i]->hello.node()];
    *std::find(ranks.begin(), ranks.end(), -1) = i;
  }
  std::vector<Member> members;
  for (const std::string& node : node_order) {
    for (int i : by_rank[node]) members.push_back(Member{i, node});
  }
  absl::StatusOr<Group> group = FormGroup(GroupShape{tp, pp}, members, first_epoch);
  const std::string device = workers_[pending_.front()]->hello.device();

  // The plan: the layers of each stage and the memory of each worker.
  const ClusterSpec cluster = ClusterFor(pp, tp, device, memory, bandwidth > 0 ? bandwidth : kAssumedMemoryBytesPerS);
  absl::StatusOr<Plan> plan =
      MakePlan(model_->config, model_->checkpoint.get(), cluster, PlanOptionsFor(options_, cpu_only));
  std::string error;
  if (!group.ok()) {
    error = std::string(group.status().message());
  } else if (!plan.ok()) {
    error = std::string(plan.status().message());
  } else if (!plan->fits) {
    error = plan->reason;
  } else if (static_cast<int>(plan->stages.size()) != pp) {
    error = absl::StrCat("the planner made ", plan->stages.size(), " stages, not ", pp);
  } else {
    for (const GpuPlan& g : plan->per_gpu) {
      if (g.node < 0 || g.node >= pp || g.gpu < 0 || g.gpu >= tp || g.stage != g.node || g.tp_rank != g.gpu) {
        error = absl::StrCat("the planner placed stage ", g.stage, " rank ", g.tp_rank, " on node ", g.node, " GPU ",
                             g.gpu, "; this coordinator needs one stage per node");
        break;
      }
    }
  }
  std::vector<std::pair<int, v1::CoordinatorMessage>> out;
  if (!error.empty()) {
    failed_reason_ = absl::StrCat("cannot plan ", model_->name, " on the registered workers: ", error);
    CoordinatorLog("group", failed_reason_);
    SetPhaseLocked(Phase::kFailed);
    for (const std::vector<int>* workers : {&pending_, &spares_}) {
      for (int i : *workers) {
        v1::CoordinatorMessage m;
        m.mutable_shutdown()->set_reason(failed_reason_);
        out.emplace_back(i, std::move(m));
      }
    }
    return out;
  }

  plan_ = std::move(*plan);
  // The KV cache: the plan's blocks (what the smallest worker holds beside its weights), capped on
  // CPU workers, or what --num-kv-blocks says. A sequence must fit in the cache, so the served
  // length is at most what the cache holds.
  int64_t kv_blocks = plan_->limits.num_kv_blocks;
  const int64_t block_size = options_.limits.block_size;
  std::string kv_from = "the workers' memory";
  if (options_.limits.num_kv_blocks > 0) {
    kv_blocks = options_.limits.num_kv_blocks;
    kv_from = "--num-kv-blocks";
  } else if (cpu_only) {
    // The full pool's blocks whose cache, with the sliding layers' pool beside it, fits every worker.
    int64_t cap = kv_blocks;
    for (const GpuPlan& g : plan_->per_gpu) {
      cap = std::min(cap, MostKvBlocks(model_->config, g, options_.limits, plan_->max_model_len,
                                       static_cast<int64_t>(kMaxCpuKvCacheBytes), kv_blocks));
    }
    if (cap < kv_blocks) {
      kv_blocks = cap;
      kv_from = "256 MiB per CPU worker";
    }
  }
  if (kv_blocks * block_size < plan_->max_model_len) {
    CoordinatorLog("group", absl::StrCat("max_model_len lowered from ", plan_->max_model_len, " to ",
                                         kv_blocks * block_size, ": the KV cache holds ", kv_blocks,
                                         " blocks of ", block_size, " tokens (", kv_from, ")"));
    plan_->max_model_len = kv_blocks * block_size;
  }
  limits_ = options_.limits;
  limits_.num_kv_blocks = kv_blocks;
  limits_.max_model_len = plan_->max_model_len;
  // The sliding layers' pool, for the full pool and the length served (model/kv_blocks.h).
  limits_.num_sliding_kv_blocks = PlannedSlidingBlocks(model_->config, limits_, kv_blocks, limits_.max_model_len);
  // The plan shown by `shardserve status` carries the cache the scheduler really uses.
  if (kv_blocks != plan_->limits.num_kv_blocks) {
    absl::StrAppend(&plan_->reason, " The KV cache used is ", planner_format::Count(limits_.kv_cache_tokens()),
                    " tokens (", planner_format::Count(kv_blocks), " blocks of ", block_size, ": ", kv_from,
                    "), not all that memory holds.");
  }
  plan_->limits = limits_;
  plan_->kv_cache_tokens = limits_.kv_cache_tokens();
  FillMemoryItems(model_->config, &*plan_);  // for the limits the workers get
  group_ = std::move(*group);
  std::vector<std::string> stages;
  for (const Slot& slot : group_->slots) {
    const StagePlan& st = plan_->stages[slot.stage];
    v1::CoordinatorMessage m = AssignmentLocked(slot);
    out.emplace_back(slot.worker, std::move(m));
    if (slot.tp_rank == 0) {
      stages.push_back(absl::StrCat("stage ", slot.stage, " = node ", slot.node, " (layers ", st.first_layer, "-",
                                    st.last_layer, ")"));
    }
  }
  pending_.clear();
  // Spares that registered while the group formed can be checked against their node's slots now.
  for (auto& message : LetGoUnfitSparesLocked()) out.push_back(std::move(message));
  SetPhaseLocked(Phase::kLoading);
  CoordinatorLog("group", absl::StrCat("complete (epoch ", group_->epoch, "); planned TP=", tp, " x PP=", pp,
                                       ", max_model_len ", plan_->max_model_len, ", KV cache ", kv_blocks,
                                       " blocks of ", block_size, " tokens (", kv_from,
                                       "): ", absl::StrJoin(stages, ", "), "; loading"));
  return out;
}

v1::CoordinatorMessage WorkerPool::AssignmentLocked(const Slot& slot) {
  const int tp = options_.gpus_per_node, pp = options_.nodes;
  Worker& w = *workers_[slot.worker];
  const StagePlan& st = plan_->stages[slot.stage];
  w.stage = slot.stage;
  w.tp_rank = slot.tp_rank;
  w.first_layer = st.first_layer;
  w.end_layer = st.last_layer + 1;
  w.state = v1::WORKER_STATE_LOADING;
  w.epoch = group_->epoch;
  w.failed = false;
  w.load_pending = true;
  if (metrics_ != nullptr) metrics_->SetWorkerUp(w.id, w.hello.node(), w.stage, w.tp_rank, true);

  v1::CoordinatorMessage m;
  v1::Assignment* a = m.mutable_assignment();
  a->set_worker_id(w.id);
  a->set_model_path(model_->dir);
  a->set_stage(slot.stage);
  a->set_num_stages(pp);
  a->set_tp_rank(slot.tp_rank);
  a->set_tp_size(tp);
  a->set_first_layer(static_cast<int32_t>(w.first_layer));
  a->set_end_layer(static_cast<int32_t>(w.end_layer));
  a->set_tp_group(slot.tp_group);
  a->set_send_group(slot.send_group);
  a->set_recv_group(slot.recv_group);
  ToProto(limits_, a->mutable_limits());
  a->set_collective_timeout_seconds(absl::ToDoubleSeconds(options_.collective_timeout));
  a->set_weight_quantization(options_.weight_quant == WeightQuant::kInt8   ? v1::WEIGHT_QUANTIZATION_INT8
                             : options_.weight_quant == WeightQuant::kInt4 ? v1::WEIGHT_QUANTIZATION_INT4
                             : options_.weight_quant == WeightQuant::kFp8  ? v1::WEIGHT_QUANTIZATION_FP8
                                                                           : v1::WEIGHT_QUANTIZATION_UNSPECIFIED);
  a->set_expert_parallel(options_.expert_parallel);
  if (options_.load_format == LoadFormat::kDummy) {
    a->set_load_format(v1::LOAD_FORMAT_DUMMY);
    a->set_dummy_seed(options_.dummy_seed);
  }
  a->set_epoch(group_->epoch);
  a->set_rendezvous_token(rendezvous_grants_.Grant(slot.worker, w.id, group_->epoch, RendezvousGroupsOf(slot)));
  a->mutable_model_manifest()->Add(model_manifest_.begin(), model_manifest_.end());
  w.adopting = false;
  if (w.hello.has_held() && !w.loaded) {
    // It outlived an earlier coordinator holding a shard: adopt it when that shard is this slot's.
    const v1::HeldShard& held = w.hello.held();
    const std::string where = absl::StrCat("slot (node ", slot.node, ", stage ", slot.stage, ", tp rank ",
                                           slot.tp_rank, ")");
    absl::Status same =
        model_fingerprint_.empty() ? absl::FailedPreconditionError("this coordinator has no fingerprint of its model")
        : held.model_fingerprint() != model_fingerprint_
            ? absl::FailedPreconditionError(absl::StrCat("it holds another model than ", model_->dir,
                                                         " (another config.json or checkpoint files)"))
            : SameShard(held.assignment(), *a);
    if (same.ok() && held.assignment().epoch() >= group_->epoch) {
      same = absl::FailedPreconditionError(absl::StrCat("its epoch ", held.assignment().epoch(),
                                                        " is not before the group's ", group_->epoch));
    }
    if (same.ok()) {
      a->set_adopt(true);
      w.adopting = true;
      CoordinatorLog(NameLocked(slot.worker),
                     absl::StrCat("adopting into ", where, " under epoch ", group_->epoch,
                                  ": it holds that shard (loaded as ", held.assignment().worker_id().substr(0, 64),
                                  " of epoch ", held.assignment().epoch(), " for an earlier coordinator); it keeps "
                                  "its weights and joins the new groups"),
                     LogIds{"", w.id, w.hello.node(), slot.stage, slot.tp_rank});
    } else {
      CoordinatorLog(NameLocked(slot.worker),
                     absl::StrCat("holds another shard than ", where, " needs (", same.message(),
                                  "): it drops it and loads the slot's"),
                     LogIds{"", w.id, w.hello.node(), slot.stage, slot.tp_rank, "warn"});
    }
  }
  for (const MemoryItem& item : plan_->per_gpu[slot.stage * tp + slot.tp_rank].memory) {
    v1::MemoryItem* planned = a->add_planned_memory();
    planned->set_name(item.name);
    planned->set_bytes(item.bytes);
  }
  return m;
}

void WorkerPool::OnMessage(int index, const v1::WorkerMessage& message) {
  std::vector<std::pair<int, v1::CoordinatorMessage>> to_send;
  {
    absl::MutexLock lock(&mu_);
    Worker& w = *workers_[index];
    w.last_heard = absl::Now();
    if (w.state == v1::WORKER_STATE_LOST) return;  // too late: nothing it says matters now
    switch (message.msg_case()) {
      case v1::WorkerMessage::kHeartbeat:
        if (phase_ == Phase::kHealing) to_send = TryRegroupLocked();  // kLossSettle may have passed
        break;
      case v1::WorkerMessage::kLoaded: {
        const v1::Loaded& l = message.loaded();
        if (w.load_pending && l.epoch() < w.epoch) break;  // the answer to an older Regroup: stale
        if (w.state != v1::WORKER_STATE_LOADING || !w.load_pending || l.epoch() != w.epoch) {
          MarkLostLocked(index, LossCause::kMalformed,
                         absl::StrCat("sent Loaded for epoch ", l.epoch(), " without an assignment to load"));
          break;
        }
        w.state = v1::WORKER_STATE_READY;
        w.load_pending = false;
        const bool regrouped = w.loaded;
        w.loaded = true;
        w.weight_bytes = l.weight_bytes();
        w.detail.clear();
        if (w.adopting && metrics_ != nullptr) metrics_->workers_adopted.Increment();
        CoordinatorLog(NameLocked(index),
                       absl::StrCat(w.adopting ? "adopted (kept its weights, joined the groups)"
                                    : regrouped ? "regrouped"
                                                : "loaded",
                                    " in ", l.load_seconds(), " s (epoch ", w.epoch, ")"),
                       LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank});
        w.adopting = false;
        const bool all_ready = std::all_of(group_->slots.begin(), group_->slots.end(), [&](const Slot& s) {
          const Worker& h = *workers_[s.worker];
          return h.state == v1::WORKER_STATE_READY && h.epoch == group_->epoch;
        });
        if (phase_ == Phase::kLoading && all_ready) {
          SetPhaseLocked(Phase::kServing);
          CoordinatorLog("group", "every worker is loaded: SERVING");
        } else if (phase_ == Phase::kHealing && all_ready && !needs_new_epoch_) {
          const double seconds = absl::ToDoubleSeconds(absl::Now() - heal_started_);
          SetPhaseLocked(Phase::kServing);
          if (metrics_ != nullptr) {
            metrics_->heals.Increment();
            metrics_->heal_duration.Observe(seconds);
          }
          CoordinatorLog("group", absl::StrFormat("healed in %.2f s: every worker is ready under epoch %d: SERVING",
                                                  seconds, group_->epoch));
        } else if (phase_ == Phase::kHealing) {
          to_send = TryRegroupLocked();  // a survivor of the first load may have been the last to settle
        }
        break;
      }
      case v1::WorkerMessage::kStepResult: {
        const v1::StepResult& r = message.step_result();
        w.last_step_answered = std::max(w.last_step_answered, r.step_id());
        if (phase_ == Phase::kHealing) to_send = TryRegroupLocked();  // a survivor may be settled now
        auto it = steps_.find(r.step_id());
        if (it == steps_.end() || w.stage < 0 || r.epoch() != group_->epoch) break;  // stale
        const int pos = RankOf(group_->shape, w.stage, w.tp_rank);
        if (group_->slots[pos].worker != index || it->second.answered[pos]) break;
        if (absl::Status s = CheckResultLocked(index, it->second, r); !s.ok()) {
          MarkLostLocked(index, LossCause::kMalformed, absl::StrCat("sent a malformed result: ", s.message()));
          break;
        }
        it->second.results[pos] = r;
        it->second.answered[pos] = true;
        changed_.SignalAll();
        break;
      }
      case v1::WorkerMessage::kFailure: {
        const v1::Failure& f = message.failure();
        const std::string why = absl::StrCat("reported a failure: ", f.message().substr(0, kMaxFailureLength));
        w.last_step_answered = std::max(w.last_step_answered, f.step_id());
        if (f.epoch() < w.epoch) {
          // A failure of an older epoch's step (it was in a collective with the lost peer): the
          // group re-forms anyway. It settles the worker, though.
          if (phase_ == Phase::kHealing) to_send = TryRegroupLocked();
          break;
        }
        if (!w.loaded && w.replacement) {
          // A replacement's load failed: it cannot hold its slot, which opens again. It is let go
          // (told why: its process exits 1; a supervisor may start another).
          MarkLostLocked(index, LossCause::kFailure, why);
          v1::CoordinatorMessage bye;
          bye.mutable_shutdown()->set_reason(absl::StrCat("this worker could not load its slot's shard and is let go (",
                                                          f.message().substr(0, kMaxFailureLength), ")"));
          bye.mutable_shutdown()->set_let_go(true);
          to_send.emplace_back(index, std::move(bye));
          break;
        }
        // A worker of the group's first load (or of an adoption) whose load failed keeps its slot,
        // as a survivor whose step failed does: most often a peer died under it (a rendezvous or a
        // connection that never came); it is sent its Assignment again when the group re-forms. One
        // that fails on its own gives up the group after kMaxHealsWithoutProgress re-formings.
        if (f.step_id() == 0) w.load_pending = false;  // its load or Regroup failed
        if (w.adopting) w.hello.clear_held();  // its shard is gone: the next Assignment loads one
        w.adopting = false;
        w.failed = true;
        w.detail = why;
        CoordinatorLog(NameLocked(index), absl::StrCat("FAILED under epoch ", w.epoch, ": ", f.message()),
                       LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank, "error"});
        if (phase_ == Phase::kServing || phase_ == Phase::kLoading) {
          StartHealLocked(absl::StrCat(NameLocked(index), " ", why));
        } else if (phase_ == Phase::kHealing) {
          needs_new_epoch_ = true;
          to_send = TryRegroupLocked();
        }
        changed_.SignalAll();
        break;
      }
      case v1::WorkerMessage::kRegister:
        MarkLostLocked(index, LossCause::kMalformed, "sent a second Register");
        break;
      case v1::WorkerMessage::MSG_NOT_SET:
        break;  // a message of a newer protocol: nothing to do with it
    }
  }
  SendAll(to_send);
}

void WorkerPool::Disconnect(int index) {
  absl::MutexLock lock(&mu_);
  Worker& w = *workers_[index];
  w.link = nullptr;
  mu_.Await(absl::Condition(+[](int* sends) { return *sends == 0; }, &w.sends_in_flight));
  if (phase_ != Phase::kShuttingDown) {
    MarkLostLocked(index, LossCause::kStreamEnded, kStreamEnded);
  }
}

bool WorkerPool::SendTo(int index, const v1::CoordinatorMessage& message) {
  Worker* w;
  WorkerLink* link;
  {
    absl::MutexLock lock(&mu_);
    w = workers_[index].get();
    link = w->link;
    if (link == nullptr) return false;
    ++w->sends_in_flight;
  }
  const bool ok = link->Send(message);
  absl::MutexLock lock(&mu_);
  --w->sends_in_flight;
  return ok;
}

void WorkerPool::MarkLostLocked(int index, LossCause cause, const std::string& detail) {
  Worker& w = *workers_[index];
  if (w.state == v1::WORKER_STATE_LOST) return;
  w.state = v1::WORKER_STATE_LOST;
  w.cause = cause;
  w.detail = detail;
  w.lost_at = absl::Now();
  // Lost is lost: a frozen worker whose stream is still open must not write or read rendezvous
  // keys any more (its slot's next holder gets a grant of its own).
  rendezvous_grants_.Revoke(index);
  // A failed worker keeps its stream (it stays up, NOT_SERVING, for a person to inspect); any
  // other lost worker's stream is ended, which also unblocks a send stuck on it.
  if (cause != LossCause::kFailure && w.link != nullptr) w.link->Cancel();
  changed_.SignalAll();
  if (auto spare = std::find(spares_.begin(), spares_.end(), index); spare != spares_.end()) {
    spares_.erase(spare);
    CoordinatorLog(w.id, absl::StrCat("spare left: ", detail), LogIds{"", w.id, w.hello.node(), -1, -1, "warn"});
    return;
  }
  for (auto it = replacements_.begin(); it != replacements_.end(); ++it) {
    if (it->second != index) continue;
    // A replacement that leaves before the group re-forms: its slot is open again.
    replacements_.erase(it);
    CoordinatorLog(NameLocked(index), absl::StrCat("replacement left before the group re-formed: ", detail),
                   LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank, "warn"});
    return;
  }
  if (w.stage < 0) {
    // Not in a group yet: it just leaves, and another worker may take its place.
    pending_.erase(std::remove(pending_.begin(), pending_.end(), index), pending_.end());
    CoordinatorLog(w.id, absl::StrCat("left before the group was complete: ", detail),
                   LogIds{"", w.id, w.hello.node(), -1, -1, "warn"});
    // A spare of its node takes its place (the group had fewer than all its workers, so it still
    // has fewer: this never completes it).
    auto spare = std::find_if(spares_.begin(), spares_.end(),
                              [&](int i) { return workers_[i]->hello.node() == w.hello.node(); });
    if (phase_ == Phase::kWaiting && spare != spares_.end()) {
      pending_.push_back(*spare);
      CoordinatorLog(workers_[*spare]->id,
                     absl::StrCat("spare joins the forming group in place of ", w.id, " (node ", w.hello.node(),
                                  "): ", pending_.size(), " of ", options_.nodes * options_.gpus_per_node, " workers"),
                     LogIds{"", workers_[*spare]->id, w.hello.node()});
      spares_.erase(spare);
    }
    return;
  }
  if (!group_ || group_->slots[RankOf(group_->shape, w.stage, w.tp_rank)].worker != index) {
    // It held a slot once and was replaced already: nothing depends on it.
    CoordinatorLog(NameLocked(index), absl::StrCat("gone (replaced earlier): ", detail),
                   LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank});
    return;
  }
  if (metrics_ != nullptr) metrics_->SetWorkerUp(w.id, w.hello.node(), w.stage, w.tp_rank, false);
  CoordinatorLog(NameLocked(index), absl::StrCat("LOST (epoch ", group_->epoch, "): ", detail),
                 LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank, "error"});
  if (phase_ == Phase::kServing || phase_ == Phase::kLoading) {
    // Lost while the group serves, or while it first loads (or a new coordinator adopts it): the
    // same heal; survivors still loading finish their load first (TryRegroupLocked waits for them).
    StartHealLocked(absl::StrCat(NameLocked(index), " is lost: ", detail));
    UseSparesLocked();
  } else if (phase_ == Phase::kHealing) {
    needs_new_epoch_ = true;  // whoever joined the next epoch's groups must form them again
    CoordinatorLog("group", absl::StrCat("healing: slot (node ", w.hello.node(), ", stage ", w.stage, ", tp rank ",
                                         w.tp_rank, ") is open again; waiting for a worker from node ",
                                         w.hello.node()));
    UseSparesLocked();
  }
}

void WorkerPool::StartHealLocked(const std::string& why) {
  if (heals_without_progress_ >= kMaxHealsWithoutProgress) {
    failed_reason_ = absl::StrCat("the worker group re-formed ", heals_without_progress_,
                                  " times without completing a step; giving up (restart the coordinator and the "
                                  "workers): ", why);
    SetPhaseLocked(Phase::kFailed);
    CoordinatorLog("group", failed_reason_, LogIds{"", "", "", -1, -1, "error"});
    return;
  }
  heal_started_ = absl::Now();
  needs_new_epoch_ = true;
  SetPhaseLocked(Phase::kHealing);
  std::vector<std::string> open;
  for (const Slot& s : group_->slots) {
    if (workers_[s.worker]->state == v1::WORKER_STATE_LOST) {
      open.push_back(absl::StrCat("node ", s.node, ", stage ", s.stage, ", tp rank ", s.tp_rank));
    }
  }
  CoordinatorLog("group", absl::StrCat("HEALING (epoch ", group_->epoch, "): ", why, "; requests are held",
                                       open.empty() ? "; the same workers re-form the group"
                                                    : absl::StrCat("; waiting for a worker for slot(s) ",
                                                                   absl::StrJoin(open, "; "))),
                 LogIds{"", "", "", -1, -1, "warn"});
}

absl::Status WorkerPool::CheckFitsSlotLocked(const v1::Register& hello, const Slot& slot) const {
  const Worker& lost = *workers_[slot.worker];
  const std::string where = absl::StrCat("slot (node ", slot.node, ", stage ", slot.stage, ", tp rank ",
                                         slot.tp_rank, ")");
  if ((hello.device() == "cpu") != (lost.hello.device() == "cpu")) {
    return absl::FailedPreconditionError(absl::StrCat("device ", hello.device(), " cannot take ", where,
                                                      ": the group runs on ", lost.hello.device()));
  }
  // What the slot's shard needs: its weights, step buffers and reserve, and the KV cache every
  // worker of the group holds (the plan's figures), at the planner's memory utilization.
  const GpuPlan& g = plan_->per_gpu[slot.rank];
  const double kv =
      static_cast<double>(GpuKvBytes(g, limits_.num_kv_blocks, limits_.num_sliding_kv_blocks, limits_.block_size));
  const double need = (static_cast<double>(g.weight_bytes + g.activation_bytes + g.reserve_bytes) + kv) /
                      plan_->options.gpu_memory_utilization;
  if (static_cast<double>(hello.memory_bytes()) < need) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "a worker with %.1f MiB of memory cannot take %s: its shard needs %.1f MiB (weights %.1f MiB, KV cache %.1f "
        "MiB for %d blocks, buffers and reserve %.1f MiB, at memory utilization %.2f); give it more (--memory-gb)",
        hello.memory_bytes() / 1048576.0, where, need / 1048576.0, g.weight_bytes / 1048576.0, kv / 1048576.0,
        limits_.num_kv_blocks, (g.activation_bytes + g.reserve_bytes) / 1048576.0,
        plan_->options.gpu_memory_utilization));
  }
  return absl::OkStatus();
}

void WorkerPool::UseSparesLocked() {
  if (phase_ != Phase::kHealing) return;
  for (const Slot& s : group_->slots) {
    if (workers_[s.worker]->state != v1::WORKER_STATE_LOST || replacements_.count(s.rank)) continue;
    for (auto it = spares_.begin(); it != spares_.end(); ++it) {
      Worker& spare = *workers_[*it];
      if (spare.hello.node() != s.node) continue;
      if (absl::Status fits = CheckFitsSlotLocked(spare.hello, s); !fits.ok()) {
        CoordinatorLog(NameLocked(*it), absl::StrCat("spare cannot take the slot: ", fits.message()),
                       LogIds{"", spare.id, spare.hello.node(), -1, -1, "warn"});
        continue;
      }
      spare.stage = s.stage;
      spare.tp_rank = s.tp_rank;
      spare.replacement = true;
      replacements_[s.rank] = *it;
      if (metrics_ != nullptr) metrics_->worker_restarts.Increment();
      CoordinatorLog(spare.id,
                     absl::StrCat("spare takes slot (node ", s.node, ", stage ", s.stage, ", tp rank ", s.tp_rank,
                                  ") of lost ", NameLocked(s.worker), " (epoch ", group_->epoch, ")"),
                     LogIds{"", spare.id, spare.hello.node(), s.stage, s.tp_rank});
      spares_.erase(it);
      break;
    }
  }
}

int WorkerPool::AddWorkerLocked(const v1::Register& hello, WorkerLink* link) {
  const int index = static_cast<int>(workers_.size());
  auto w = std::make_unique<Worker>();
  w->id = absl::StrCat("w", index);
  w->hello = hello;
  w->last_heard = absl::Now();
  w->link = link;
  workers_.push_back(std::move(w));
  return index;
}

bool WorkerPool::HasOpenSlotLocked(const std::string& node) const {
  return std::any_of(group_->slots.begin(), group_->slots.end(), [&](const Slot& s) {
    return s.node == node && workers_[s.worker]->state == v1::WORKER_STATE_LOST && !replacements_.count(s.rank);
  });
}

absl::StatusOr<int> WorkerPool::RegisterAsSpareLocked(const v1::Register& hello, WorkerLink* link) {
  const Slot* slot = nullptr;  // the first slot of its node: any of them is the one it would take
  std::vector<std::string> nodes;
  for (const Slot& s : group_->slots) {
    if (slot == nullptr && s.node == hello.node()) slot = &s;
    if (s.tp_rank == 0) nodes.push_back(s.node);
  }
  if (slot == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        phase_ == Phase::kHealing ? "the worker group is healing (" : "the worker group is already complete (",
        options_.nodes, " nodes x ", options_.gpus_per_node, " workers) and node ", hello.node(),
        " is not one of its nodes (", absl::StrJoin(nodes, ", "),
        "): a worker takes a slot of its own node (--node) when that slot's worker is lost, or waits as its spare"));
  }
  // A spare that could never take a slot of its node is of no use: refused, saying why.
  SHARDSERVE_RETURN_IF_ERROR(CheckFitsSlotLocked(hello, *slot));
  const int index = AddWorkerLocked(hello, link);
  spares_.push_back(index);
  CoordinatorLog(workers_[index]->id,
                 absl::StrCat("registered from node ", hello.node(), " (", hello.device(), ", ", hello.address(),
                              hello.has_held() ? absl::StrCat(", holding stage ", hello.held().assignment().stage(),
                                                              " tp rank ", hello.held().assignment().tp_rank(),
                                                              " of epoch ", hello.held().assignment().epoch())
                                               : "",
                              ") as a spare: ",
                              hello.spare() ? "a spare worker (--spare)"
                                            : absl::StrCat("every slot of node ", hello.node(),
                                                           " has a worker (a lost worker's slot is taken by a spare "
                                                           "or a replacement)"),
                              "; ", spares_.size(), " spare(s) idle"),
                 LogIds{"", workers_[index]->id, hello.node()});
  return index;
}

absl::StatusOr<int> WorkerPool::RegisterSpareWhileWaitingLocked(const v1::Register& hello, WorkerLink* link) {
  // Whether it fits its node's slots is known only once the group is planned (the KV cache follows
  // the smallest worker's memory): FormGroupLocked checks it then. The kind of device is known now.
  for (int i : pending_) {
    const v1::Register& member = workers_[i]->hello;
    if ((member.device() == "cpu") != (hello.device() == "cpu")) {
      return absl::FailedPreconditionError(absl::StrCat("device ", hello.device(), " cannot be a spare of node ",
                                                        hello.node(), ": the group's workers run on ",
                                                        member.device()));
    }
  }
  const int index = AddWorkerLocked(hello, link);
  spares_.push_back(index);
  CoordinatorLog(workers_[index]->id,
                 absl::StrCat("registered from node ", hello.node(), " (", hello.device(), ", ", hello.address(),
                              ") as a spare: ",
                              hello.spare() ? "a spare worker (--spare)"
                                            : absl::StrCat("node ", hello.node(), " already has its ",
                                                           options_.gpus_per_node, " workers (--gpus-per-node)"),
                              ", the group is not complete yet; ", spares_.size(), " spare(s) idle"),
                 LogIds{"", workers_[index]->id, hello.node()});
  return index;
}

std::vector<std::pair<int, v1::CoordinatorMessage>> WorkerPool::LetGoUnfitSparesLocked() {
  std::vector<std::pair<int, v1::CoordinatorMessage>> out;
  std::vector<std::string> nodes;
  for (const Slot& s : group_->slots) {
    if (s.tp_rank == 0) nodes.push_back(s.node);
  }
  for (auto it = spares_.begin(); it != spares_.end();) {
    Worker& w = *workers_[*it];
    const auto slot = std::find_if(group_->slots.begin(), group_->slots.end(),
                                   [&](const Slot& s) { return s.node == w.hello.node(); });
    absl::Status fits =
        slot == group_->slots.end()
            ? absl::FailedPreconditionError(absl::StrCat("node ", w.hello.node(), " is not one of the group's nodes (",
                                                         absl::StrJoin(nodes, ", "),
                                                         "): a spare takes a slot of its own node (--node)"))
            : CheckFitsSlotLocked(w.hello, *slot);
    if (fits.ok()) {
      ++it;
      continue;
    }
    // Refused now that the group is planned: told why (its process exits 1), then forgotten. It
    // is marked lost here, so that its stream ending says nothing more.
    w.state = v1::WORKER_STATE_LOST;
    w.detail = absl::StrCat("spare refused when the group formed: ", fits.message());
    w.lost_at = absl::Now();
    CoordinatorLog(w.id, w.detail, LogIds{"", w.id, w.hello.node(), -1, -1, "warn"});
    v1::CoordinatorMessage bye;
    bye.mutable_shutdown()->set_reason(std::string(fits.message()));
    out.emplace_back(*it, std::move(bye));
    it = spares_.erase(it);
  }
  return out;
}

absl::StatusOr<int> WorkerPool::RegisterReplacementLocked(const v1::Register& hello, WorkerLink* link) {
  std::vector<std::string> open;
  const Slot* slot = nullptr;
  for (const Slot& s : group_->slots) {
    if (workers_[s.worker]->state != v1::WORKER_STATE_LOST || replacements_.count(s.rank)) continue;
    open.push_back(absl::StrCat("node ", s.node, " stage ", s.stage, " tp rank ", s.tp_rank));
    if (slot == nullptr && s.node == hello.node()) slot = &s;
  }
  if (slot == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the worker group is healing and has no open slot on node ", hello.node(),
        open.empty() ? std::string("; every slot has a worker")
                     : absl::StrCat("; open slots: ", absl::StrJoin(open, ", "), " (a replacement uses its --node)")));
  }
  SHARDSERVE_RETURN_IF_ERROR(CheckFitsSlotLocked(hello, *slot));
  const std::string where = absl::StrCat("slot (node ", slot->node, ", stage ", slot->stage, ", tp rank ",
                                         slot->tp_rank, ")");
  const int index = AddWorkerLocked(hello, link);
  workers_[index]->stage = slot->stage;
  workers_[index]->tp_rank = slot->tp_rank;
  workers_[index]->replacement = true;
  replacements_[slot->rank] = index;
  if (metrics_ != nullptr) metrics_->worker_restarts.Increment();
  CoordinatorLog(workers_[index]->id,
                 absl::StrCat("registered from node ", hello.node(), " (", hello.device(), ", ", hello.address(),
                              ") as the replacement for ", where, " of lost ", NameLocked(slot->worker), " (epoch ",
                              group_->epoch, ")"),
                 LogIds{"", workers_[index]->id, hello.node(), slot->stage, slot->tp_rank});
  return index;
}

std::vector<std::pair<int, v1::CoordinatorMessage>> WorkerPool::TryRegroupLocked() {
  std::vector<std::pair<int, v1::CoordinatorMessage>> out;
  if (phase_ != Phase::kHealing || !needs_new_epoch_) return out;
  // With no one to replace (a step failed, no worker lost yet), wait a moment: the failure was
  // most likely caused by a peer whose loss the coordinator has not seen yet (a killed worker's
  // peers report the broken connection at about the time its stream ends).
  if (replacements_.empty() && absl::Now() - heal_started_ < kLossSettle) return out;
  for (const Slot& s : group_->slots) {
    auto r = replacements_.find(s.rank);
    const Worker& h = *workers_[r != replacements_.end() ? r->second : s.worker];
    if (h.state == v1::WORKER_STATE_LOST || h.link == nullptr) return out;  // the slot is open
    // A survivor still in a step of the old epoch (bounded by the collective timeout), or in a
    // load or regroup not answered: the new groups would wait for it.
    if (r == replacements_.end() && (h.last_step_answered < h.last_step_sent || h.load_pending)) return out;
  }
  if (heals_without_progress_ >= kMaxHealsWithoutProgress) {
    failed_reason_ = absl::StrCat("the worker group re-formed ", heals_without_progress_,
                                  " times without completing a step; giving up (restart the coordinator and the "
                                  "workers)");
    SetPhaseLocked(Phase::kFailed);
    CoordinatorLog("group", failed_reason_, LogIds{"", "", "", -1, -1, "error"});
    return out;
  }
  Group next = *group_;
  std::vector<std::string> replaced;
  for (const auto& [rank, index] : replacements_) {
    const Slot& s = next.slots[rank];
    absl::StatusOr<Group> g = Replace(next, s.stage, s.tp_rank, Member{index, workers_[index]->hello.node()});
    if (!g.ok()) {
      // Register checked the node: this is a bug, not the replacement's fault.
      CoordinatorLog("group", absl::StrCat("cannot place ", workers_[index]->id, ": ", g.status().message()),
                     LogIds{"", "", "", -1, -1, "error"});
      return out;
    }
    replaced.push_back(absl::StrCat(workers_[index]->id, " for ", workers_[s.worker]->id));
    next = std::move(*g);
  }
  if (replacements_.empty()) next = NextEpoch(next);
  const uint64_t old_epoch = group_->epoch;
  group_ = std::move(next);
  replacements_.clear();
  needs_new_epoch_ = false;
  ++heals_without_progress_;
  for (const Slot& s : group_->slots) {
    Worker& w = *workers_[s.worker];
    if (!w.loaded) {
      out.emplace_back(s.worker, AssignmentLocked(s));
    } else {
      w.state = v1::WORKER_STATE_LOADING;
      w.epoch = group_->epoch;
      w.failed = false;
      v1::CoordinatorMessage m;
      v1::Regroup* r = m.mutable_regroup();
      r->set_epoch(group_->epoch);
      r->set_tp_group(s.tp_group);
      r->set_send_group(s.send_group);
      r->set_recv_group(s.recv_group);
      r->set_rendezvous_token(rendezvous_grants_.Grant(s.worker, w.id, group_->epoch, RendezvousGroupsOf(s)));
      out.emplace_back(s.worker, std::move(m));
    }
    workers_[s.worker]->load_pending = true;
  }
  CoordinatorLog("group", absl::StrCat("re-forming: epoch ", old_epoch, " -> ", group_->epoch, "; ",
                                       replaced.empty() ? "the same workers" : absl::StrJoin(replaced, ", "),
                                       "; survivors keep their weights and join the new groups"));
  return out;
}

std::optional<absl::Time> WorkerPool::HealingSince() {
  absl::MutexLock lock(&mu_);
  if (phase_ != Phase::kHealing) return std::nullopt;
  return heal_started_;
}

std::string WorkerPool::StateName() {
  absl::MutexLock lock(&mu_);
  return StateNameLocked();
}

std::string WorkerPool::StateNameLocked() const {
  switch (phase_) {
    case Phase::kServing: return "serving";
    case Phase::kHealing: return "healing";
    case Phase::kWaiting:
    case Phase::kLoading: return "starting";
    default: return "degraded";
  }
}

uint64_t WorkerPool::epoch() {
  absl::MutexLock lock(&mu_);
  return group_ ? group_->epoch : 0;
}

void WorkerPool::SetPhaseLocked(Phase phase) {
  const bool was_serving = phase_ == Phase::kServing;
  phase_ = phase;
  changed_.SignalAll();
  if (metrics_ != nullptr) metrics_->SetClusterState(StateNameLocked());
  if (was_serving != (phase == Phase::kServing) && listener_) listener_(phase == Phase::kServing);
}

std::string WorkerPool::NameLocked(int index) const {
  const Worker& w = *workers_[index];
  if (w.stage < 0) return absl::StrCat("worker ", w.id, " (node ", w.hello.node(), ")");
  return absl::StrCat("worker ", w.id, " (node ", w.hello.node(), ", stage ", w.stage, ", tp rank ", w.tp_rank, ")");
}

absl::Status WorkerPool::NotServingLocked() const {
  const int expected = options_.nodes * options_.gpus_per_node;
  switch (phase_) {
    case Phase::kServing:
      return absl::OkStatus();
    case Phase::kWaiting:
      return absl::UnavailableError(absl::StrCat("the worker group is not complete: ", pending_.size(), " of ",
                                                 expected, " workers have registered (", options_.nodes,
                                                 " nodes x ", options_.gpus_per_node, " workers)"));
    case Phase::kLoading: {
      const auto ready = std::count_if(group_->slots.begin(), group_->slots.end(), [&](const Slot& s) {
        return workers_[s.worker]->state == v1::WORKER_STATE_READY;
      });
      return absl::UnavailableError(
          absl::StrCat("the workers are loading the model: ", ready, " of ", expected, " loaded"));
    }
    case Phase::kHealing: {
      // The lost workers first (the likely cause, in the order of LossCause), then the failed ones.
      std::vector<int> lost, failed;
      for (const Slot& s : group_->slots) {
        const Worker& w = *workers_[s.worker];
        if (w.state == v1::WORKER_STATE_LOST) {
          lost.push_back(s.worker);
        } else if (w.failed) {
          failed.push_back(s.worker);
        }
      }
      std::sort(lost.begin(), lost.end(), [&](int a, int b) {
        return std::tuple(workers_[a]->cause, workers_[a]->lost_at) < std::tuple(workers_[b]->cause, workers_[b]->lost_at);
      });
      std::string message = absl::StrFormat("the worker group is healing (for %.1f s, epoch %d): ",
                                            absl::ToDoubleSeconds(absl::Now() - heal_started_), group_->epoch);
      for (size_t k = 0; k < lost.size(); ++k) {
        const Worker& w = *workers_[lost[k]];
        const int rank = RankOf(group_->shape, w.stage, w.tp_rank);
        absl::StrAppend(&message, k == 0 ? "" : "; ", NameLocked(lost[k]), " is lost: ", w.detail,
                        replacements_.count(rank) ? absl::StrCat("; its replacement ", workers_[replacements_.at(rank)]->id,
                                                                 " has registered")
                                                  : absl::StrCat("; its slot (node ", w.hello.node(), ", stage ",
                                                                 w.stage, ", tp rank ", w.tp_rank,
                                                                 ") waits for a worker from node ", w.hello.node()));
      }
      for (size_t k = 0; k < failed.size(); ++k) {
        absl::StrAppend(&message, lost.empty() && k == 0 ? "" : "; ", NameLocked(failed[k]), " ",
                        workers_[failed[k]]->detail);
      }
      if (lost.empty() && failed.empty()) {
        const auto ready = std::count_if(group_->slots.begin(), group_->slots.end(), [&](const Slot& s) {
          return workers_[s.worker]->state == v1::WORKER_STATE_READY;
        });
        absl::StrAppend(&message, "re-forming under epoch ", group_->epoch, ": ", ready, " of ", expected,
                        " workers ready");
      }
      return absl::UnavailableError(message);
    }
    case Phase::kFailed:
    case Phase::kShuttingDown:
      return absl::UnavailableError(failed_reason_);
  }
  return absl::InternalError("unknown phase");
}

absl::Status WorkerPool::CheckServing() {
  absl::MutexLock lock(&mu_);
  return NotServingLocked();
}

// ---- Steps --------------------------------------------------------------------------------------

bool WorkerPool::StepSettledLocked(const InFlightStep& step) const {
  for (const Slot& s : group_->slots) {
    if (!step.answered[s.rank] && workers_[s.worker]->state != v1::WORKER_STATE_LOST) return false;
  }
  return true;
}

absl::Status WorkerPool::CheckResultLocked(int index, const InFlightStep& step, const v1::StepResult& r) const {
  const Worker& w = *workers_[index];
  const bool sampler = w.stage == options_.nodes - 1 && w.tp_rank == 0;
  const int want = sampler ? step.rows : 0;
  return CheckStepResult(r, want, sampler && step.wants_logprobs ? step.rows : 0, model_->config.vocab_size);
}

absl::Status WorkerPool::StartStep(const v1::StepPlan& step, int logit_rows, bool wants_logprobs) {
  std::vector<int> group;
  std::vector<bool> samples;  // group[i] is a last-stage worker
  uint64_t epoch = 0;
  {
    absl::MutexLock lock(&mu_);
    if (phase_ != Phase::kServing) return NotServingLocked();
    epoch = group_->epoch;
    InFlightStep& f = steps_[step.step_id()];
    f.rows = logit_rows;
    f.wants_logprobs = wants_logprobs;
    f.answered.assign(group_->slots.size(), false);
    f.results.assign(group_->slots.size(), v1::StepResult());
    for (const Slot& s : group_->slots) {
      group.push_back(s.worker);
      samples.push_back(s.stage == num_stages() - 1);
      workers_[s.worker]->last_step_sent = step.step_id();
    }
  }
  v1::CoordinatorMessage message;
  *message.mutable_step() = step;
  message.mutable_step()->set_epoch(epoch);
  // Token masks are for the last stage's sampler only: the other stages get the plan without them.
  v1::CoordinatorMessage unmasked;
  if (step.mask_logit_rows_size() > 0) {
    unmasked = message;
    unmasked.mutable_step()->clear_mask_logit_rows();
    unmasked.mutable_step()->clear_mask_words();
  }
  for (size_t k = 0; k < group.size(); ++k) {
    const int i = group[k];
    if (!SendTo(i, samples[k] || step.mask_logit_rows_size() == 0 ? message : unmasked)) {
      absl::MutexLock lock(&mu_);
      MarkLostLocked(i, LossCause::kStreamEnded, kStreamEnded);
    }
  }
  return absl::OkStatus();
}

void WorkerPool::DropSteps() {
  absl::MutexLock lock(&mu_);
  steps_.clear();
}

absl::Status WorkerPool::FinishStep(uint64_t step_id, absl::Duration timeout, StepOutcome* outcome) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  auto it = steps_.find(step_id);
  if (it == steps_.end()) return absl::InternalError(absl::StrCat("step ", step_id, " is not in flight"));
  absl::Cleanup done = [this, step_id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { steps_.erase(step_id); };
  const InFlightStep& step = it->second;
  while (phase_ == Phase::kServing && !StepSettledLocked(step)) {
    if (changed_.WaitWithDeadline(&mu_, deadline)) break;
  }
  if (phase_ == Phase::kServing && !StepSettledLocked(step)) {
    for (const Slot& s : group_->slots) {
      if (!step.answered[s.rank]) {
        MarkLostLocked(s.worker, LossCause::kStepDeadline,
                       absl::StrCat("did not answer step ", step_id, " within ", absl::FormatDuration(timeout),
                                    " (--step-timeout-seconds)"));
      }
    }
  }
  if (phase_ != Phase::kServing) {
    // Give the other workers a moment to report, so that the message names every worker involved
    // (not while healing: the requests wait, and the heal should not).
    const absl::Time settle = absl::Now() + kLossSettle;
    while (!StepSettledLocked(step) && phase_ != Phase::kShuttingDown && phase_ != Phase::kHealing) {
      if (changed_.WaitWithDeadline(&mu_, settle)) break;
    }
    return NotServingLocked();
  }
  heals_without_progress_ = 0;
  outcome->sampled_ids.clear();
  outcome->logprobs.clear();
  outcome->non_finite_rows.clear();
  outcome->forward_seconds = outcome->collective_seconds = 0;
  for (const v1::StepResult& r : step.results) {
    if (r.sampled_ids_size() > 0) outcome->sampled_ids.assign(r.sampled_ids().begin(), r.sampled_ids().end());
    if (r.logprobs_size() > 0) outcome->logprobs.assign(r.logprobs().begin(), r.logprobs().end());
    if (r.non_finite_rows_size() > 0) {
      outcome->non_finite_rows.assign(r.non_finite_rows().begin(), r.non_finite_rows().end());
    }
    outcome->forward_seconds = std::max(outcome->forward_seconds, r.forward_seconds());
    outcome->collective_seconds = std::max(outcome->collective_seconds, r.collective_seconds());
  }
  return absl::OkStatus();
}

// ---- Sizes, metrics, shutdown (status: cluster_status.cc; heartbeats: heartbeat_monitor.cc) ------

int64_t WorkerPool::max_model_len() {
  absl::MutexLock lock(&mu_);
  return plan_ ? plan_->max_model_len : target_max_model_len_;
}

StepLimits WorkerPool::limits() {
  absl::MutexLock lock(&mu_);
  return limits_;
}

void WorkerPool::SetMetrics(CoordinatorMetrics* metrics) {
  absl::MutexLock lock(&mu_);
  metrics_ = metrics;
  if (metrics_ != nullptr) metrics_->SetClusterState(StateNameLocked());
}

void WorkerPool::Shutdown(const std::string& reason) {
  std::vector<int> connected;
  {
    absl::MutexLock lock(&mu_);
    if (phase_ == Phase::kShuttingDown) return;
    failed_reason_ = reason;
    SetPhaseLocked(Phase::kShuttingDown);
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (workers_[i]->link != nullptr) connected.push_back(static_cast<int>(i));
    }
  }
  v1::CoordinatorMessage message;
  message.mutable_shutdown()->set_reason(reason);
  for (int i : connected) SendTo(i, message);
  absl::MutexLock lock(&mu_);
  for (int i : connected) {
    if (workers_[i]->link != nullptr) workers_[i]->link->Cancel();
  }
  CoordinatorLog("group", absl::StrCat("shut down (", connected.size(), " workers told to stop): ", reason));
}

}  // namespace shardserve
