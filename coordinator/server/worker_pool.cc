#include "coordinator/server/worker_pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "coordinator/planner/format.h"
#include "coordinator/server/log.h"
#include "kernels/sampling.h"

namespace shardserve {
namespace {

// When a step breaks, how long to wait for the other workers' news before answering: a killed
// worker's peers report their own failure (a lost connection) at about the time its stream ends,
// and the message should name the worker that vanished, not only the peers that noticed.
constexpr absl::Duration kLossSettle = absl::Seconds(1);
// Lengths of the strings a worker sends that are kept and shown.
constexpr size_t kMaxNameLength = 256;
constexpr size_t kMaxFailureLength = 4096;
// Why a worker whose stream is gone is lost, whether the reader or a writer noticed first.
constexpr char kStreamEnded[] =
    "its control stream ended (the process exited or was killed, or the connection dropped)";
// Memory assumed per worker when planning only to check the layout (Create): enough for any model.
constexpr uint64_t kProvisionalMemory = uint64_t{1} << 40;
// This coordinator forms one group in its life, under the first epoch.
constexpr uint64_t kFirstEpoch = 1;

// Memory bandwidth assumed where a worker reports none (a CPU worker without
// --memory-bandwidth-gbps): a server's DRAM. Register refuses a figure the planner does not take.
constexpr double kAssumedMemoryBytesPerS = 20e9;
// The most memory a worker may report: the planner's bound on one device's (cluster.cc).
constexpr int64_t kMaxWorkerMemory = int64_t{1} << 50;
// The highest K of a "cuda:K" device a worker may report: far above the GPUs of any host.
constexpr int kMaxDeviceOrdinal = 4095;

// "cpu", "cuda" or "cuda:K", K a decimal number in [0, kMaxDeviceOrdinal] (the worker's
// --device, as worker/step_executor.h ParseDevice takes it, without a sign or spaces).
bool ValidDevice(const std::string& device) {
  if (device == "cpu" || device == "cuda") return true;
  if (device.rfind("cuda:", 0) != 0) return false;
  const std::string k = device.substr(5);
  if (k.empty() || k.size() > 4 || !std::all_of(k.begin(), k.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  return std::stoi(k) <= kMaxDeviceOrdinal;
}

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
  p.max_model_len = o.limits.max_model_len;
  p.max_tokens_per_step = o.limits.max_tokens_per_step;
  p.max_seqs_per_step = o.limits.max_seqs_per_step;
  p.block_size = o.limits.block_size;
  p.weight_quant = o.weight_quant;
  if (cpu_only) {
    p.dtype = DType::kF32;        // the CPU backend computes and stores in float32
    p.runtime_reserve_bytes = 0;  // no CUDA context or library workspaces
  }
  return p;
}


bool Printable(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c > ' ' && c < 127; });
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
  return std::unique_ptr<WorkerPool>(new WorkerPool(model, options, *plan));
}

WorkerPool::WorkerPool(const ServedModel* model, const PoolOptions& options, const Plan& provisional)
    : model_(model), options_(options), target_max_model_len_(provisional.max_model_len) {
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
  if (hello.protocol_version() != kWorkerProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat("the worker speaks protocol version ", hello.protocol_version(),
                                                      "; this coordinator speaks ", kWorkerProtocolVersion));
  }
  for (auto [field, value] : {std::pair{"node", &hello.node()}, {"device", &hello.device()},
                              {"address", &hello.address()}, {"collective_host", &hello.collective_host()}}) {
    if (value->empty() || value->size() > kMaxNameLength || !Printable(*value)) {
      return absl::InvalidArgumentError(absl::StrCat("register.", field, " must be 1 to ", kMaxNameLength,
                                                     " printable characters without spaces"));
    }
  }
  if (hello.metrics_address().size() > kMaxNameLength || !Printable(hello.metrics_address())) {
    return absl::InvalidArgumentError(absl::StrCat("register.metrics_address must be at most ", kMaxNameLength,
                                                   " printable characters without spaces"));
  }
  if (!ValidDevice(hello.device())) {
    return absl::InvalidArgumentError(absl::StrCat("register.device must be cpu, cuda or cuda:K with K in [0, ",
                                                   kMaxDeviceOrdinal, "], got \"", hello.device(), "\""));
  }
  if (hello.memory_bytes() <= 0 || hello.memory_bytes() > kMaxWorkerMemory) {
    return absl::InvalidArgumentError(absl::StrCat("register.memory_bytes must be in [1, 2^50], got ",
                                                   hello.memory_bytes()));
  }
  // 0: not reported (the planner assumes kAssumedMemoryBytesPerS); anything else is a figure the
  // planner takes, or the worker is refused. NaN fails both comparisons.
  const double bandwidth = hello.memory_bytes_per_s();
  if (!(bandwidth == 0 || (bandwidth >= kMinBandwidthBytesPerS && bandwidth <= kMaxBandwidthBytesPerS))) {
    return absl::InvalidArgumentError(absl::StrCat("register.memory_bytes_per_s must be 0 (not reported) or in [",
                                                   kMinBandwidthBytesPerS, ", ", kMaxBandwidthBytesPerS,
                                                   "] bytes/s, got ", bandwidth));
  }

  std::vector<std::pair<int, v1::CoordinatorMessage>> to_send;
  int index = 0;
  {
    absl::MutexLock lock(&mu_);
    const int expected = options_.nodes * options_.gpus_per_node;
    switch (phase_) {
      case Phase::kWaiting: break;
      case Phase::kShuttingDown: return absl::UnavailableError("the coordinator is shutting down");
      case Phase::kFailed: return absl::FailedPreconditionError(failed_reason_);
      default:
        return absl::FailedPreconditionError(
            absl::StrCat("the worker group is already complete (", options_.nodes, " nodes x ", options_.gpus_per_node,
                         " workers); this coordinator does not replace workers: restart it to form a new group"));
    }
    std::map<std::string, int> per_node;
    for (int i : pending_) ++per_node[workers_[i]->hello.node()];
    if (!per_node.count(hello.node()) && static_cast<int>(per_node.size()) == options_.nodes) {
      std::vector<std::string> names;
      for (const auto& [name, count] : per_node) names.push_back(name);
      return absl::FailedPreconditionError(absl::StrCat("the group already has its ", options_.nodes, " nodes (",
                                                        absl::StrJoin(names, ", "), "): node ", hello.node(),
                                                        " is one too many (--nodes)"));
    }
    if (per_node[hello.node()] >= options_.gpus_per_node) {
      return absl::FailedPreconditionError(absl::StrCat("node ", hello.node(), " already has its ",
                                                        options_.gpus_per_node, " workers (--gpus-per-node)"));
    }
    index = static_cast<int>(workers_.size());
    auto w = std::make_unique<Worker>();
    w->id = absl::StrCat("w", index);
    w->hello = hello;
    w->last_heard = absl::Now();
    w->link = link;
    workers_.push_back(std::move(w));
    pending_.push_back(index);
    CoordinatorLog(workers_[index]->id,
                   absl::StrCat("registered from node ", hello.node(), " (", hello.device(), ", ", hello.address(),
                                hello.metrics_address().empty() ? "" : ", metrics ", hello.metrics_address(), "): ",
                                pending_.size(), " of ", expected, " workers"),
                   LogIds{"", workers_[index]->id, hello.node()});
    if (static_cast<int>(pending_.size()) == expected) to_send = FormGroupLocked();
  }
  for (const auto& [i, message] : to_send) {
    if (!SendTo(i, message)) {
      absl::MutexLock lock(&mu_);
      MarkLostLocked(i, LossCause::kStreamEnded, kStreamEnded);
    }
  }
  return index;
}

std::vector<std::pair<int, v1::CoordinatorMessage>> WorkerPool::FormGroupLocked() {
  const int tp = options_.gpus_per_node, pp = options_.nodes;
  // Slots, ranks and group names (coordinator/membership/group.h): the nodes in natural order are
  // the stages, a node's workers in registration order its TP ranks.
  std::vector<Member> members;
  uint64_t memory = UINT64_MAX;
  double bandwidth = std::numeric_limits<double>::infinity();  // the slowest worker's; 0 if one is unknown
  bool cpu_only = true;
  for (int i : pending_) {
    const v1::Register& h = workers_[i]->hello;
    members.push_back(Member{i, h.node()});
    memory = std::min(memory, static_cast<uint64_t>(h.memory_bytes()));
    bandwidth = std::min(bandwidth, h.memory_bytes_per_s());  // 0 or in range (Register checked)
    cpu_only = cpu_only && h.device() == "cpu";
  }
  absl::StatusOr<Group> group = FormGroup(GroupShape{tp, pp}, members, kFirstEpoch);
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
    for (int i : pending_) {
      v1::CoordinatorMessage m;
      m.mutable_shutdown()->set_reason(failed_reason_);
      out.emplace_back(i, std::move(m));
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
    uint64_t per_block = 0;
    for (const GpuPlan& g : plan_->per_gpu) per_block = std::max(per_block, g.kv_bytes_per_token * block_size);
    const int64_t cap = per_block == 0 ? kv_blocks : static_cast<int64_t>(kMaxCpuKvCacheBytes / per_block);
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
  // The plan shown by `shardserve status` carries the cache the scheduler really uses.
  if (kv_blocks != plan_->limits.num_kv_blocks) {
    absl::StrAppend(&plan_->reason, " The KV cache used is ", planner_format::Count(limits_.kv_cache_tokens()),
                    " tokens (", planner_format::Count(kv_blocks), " blocks of ", block_size, ": ", kv_from,
                    "), not all that memory holds.");
  }
  plan_->limits = limits_;
  plan_->kv_cache_tokens = limits_.kv_cache_tokens();
  group_ = std::move(*group);
  std::vector<std::string> stages;
  for (const Slot& slot : group_->slots) {
    Worker& w = *workers_[slot.worker];
    const StagePlan& st = plan_->stages[slot.stage];
    w.stage = slot.stage;
    w.tp_rank = slot.tp_rank;
    w.first_layer = st.first_layer;
    w.end_layer = st.last_layer + 1;
    w.state = v1::WORKER_STATE_LOADING;
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
                                                                             : v1::WEIGHT_QUANTIZATION_UNSPECIFIED);
    if (options_.load_format == LoadFormat::kDummy) {
      a->set_load_format(v1::LOAD_FORMAT_DUMMY);
      a->set_dummy_seed(options_.dummy_seed);
    }
    out.emplace_back(slot.worker, std::move(m));
    if (slot.tp_rank == 0) {
      stages.push_back(absl::StrCat("stage ", slot.stage, " = node ", slot.node, " (layers ", st.first_layer, "-",
                                    st.last_layer, ")"));
    }
  }
  pending_.clear();
  SetPhaseLocked(Phase::kLoading);
  CoordinatorLog("group", absl::StrCat("complete (epoch ", group_->epoch, "); planned TP=", tp, " x PP=", pp,
                                       ", max_model_len ", plan_->max_model_len, ", KV cache ", kv_blocks,
                                       " blocks of ", block_size, " tokens (", kv_from,
                                       "): ", absl::StrJoin(stages, ", "), "; loading"));
  return out;
}

void WorkerPool::OnMessage(int index, const v1::WorkerMessage& message) {
  absl::MutexLock lock(&mu_);
  Worker& w = *workers_[index];
  w.last_heard = absl::Now();
  if (w.state == v1::WORKER_STATE_LOST) return;  // too late: nothing it says matters now
  switch (message.msg_case()) {
    case v1::WorkerMessage::kHeartbeat:
      break;
    case v1::WorkerMessage::kLoaded: {
      if (w.state != v1::WORKER_STATE_LOADING) {
        MarkLostLocked(index, LossCause::kMalformed, "sent Loaded without an assignment to load");
        break;
      }
      w.state = v1::WORKER_STATE_READY;
      w.weight_bytes = message.loaded().weight_bytes();
      CoordinatorLog(NameLocked(index), absl::StrCat("loaded in ", message.loaded().load_seconds(), " s"),
                     LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank});
      const bool all_ready = std::all_of(group_->slots.begin(), group_->slots.end(), [&](const Slot& s) {
        return workers_[s.worker]->state == v1::WORKER_STATE_READY;
      });
      if (phase_ == Phase::kLoading && all_ready) {
        SetPhaseLocked(Phase::kServing);
        CoordinatorLog("group", "every worker is loaded: SERVING");
      }
      break;
    }
    case v1::WorkerMessage::kStepResult: {
      const v1::StepResult& r = message.step_result();
      auto it = steps_.find(r.step_id());
      if (it == steps_.end() || w.stage < 0) break;  // stale
      const int pos = RankOf(group_->shape, w.stage, w.tp_rank);
      if (it->second.answered[pos]) break;
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
      std::string why = message.failure().message().substr(0, kMaxFailureLength);
      MarkLostLocked(index, LossCause::kFailure, absl::StrCat("reported a failure: ", why));
      break;
    }
    case v1::WorkerMessage::kRegister:
      MarkLostLocked(index, LossCause::kMalformed, "sent a second Register");
      break;
    case v1::WorkerMessage::MSG_NOT_SET:
      break;  // a message of a newer protocol: nothing to do with it
  }
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
  // A failed worker keeps its stream (it stays up, NOT_SERVING, for a person to inspect); any
  // other lost worker's stream is ended, which also unblocks a send stuck on it.
  if (cause != LossCause::kFailure && w.link != nullptr) w.link->Cancel();
  changed_.SignalAll();
  if (w.stage < 0) {
    // Not in a group yet: it just leaves, and another worker may take its place.
    pending_.erase(std::remove(pending_.begin(), pending_.end(), index), pending_.end());
    CoordinatorLog(w.id, absl::StrCat("left before the group was complete: ", detail),
                   LogIds{"", w.id, w.hello.node(), -1, -1, "warn"});
    return;
  }
  if (metrics_ != nullptr) metrics_->SetWorkerUp(w.id, w.hello.node(), w.stage, w.tp_rank, false);
  CoordinatorLog(NameLocked(index), absl::StrCat("LOST: ", detail),
                 LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank, "error"});
  if (phase_ == Phase::kLoading || phase_ == Phase::kServing) {
    SetPhaseLocked(Phase::kBroken);
    CoordinatorLog("group", "broken: NOT_SERVING; requests are refused until the coordinator is restarted");
  }
}

void WorkerPool::SetPhaseLocked(Phase phase) {
  const bool was_serving = phase_ == Phase::kServing;
  phase_ = phase;
  changed_.SignalAll();
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
    case Phase::kBroken: {
      std::vector<int> lost;
      for (const Slot& s : group_->slots) {
        if (workers_[s.worker]->state == v1::WORKER_STATE_LOST) lost.push_back(s.worker);
      }
      std::sort(lost.begin(), lost.end(), [&](int a, int b) {
        return std::tuple(workers_[a]->cause, workers_[a]->lost_at) < std::tuple(workers_[b]->cause, workers_[b]->lost_at);
      });
      std::string message = "the worker group is broken: ";
      for (size_t k = 0; k < lost.size(); ++k) {
        absl::StrAppend(&message, k == 0 ? "" : "; also lost: ", NameLocked(lost[k]), k == 0 ? " is lost: " : ": ",
                        workers_[lost[k]]->detail);
      }
      absl::StrAppend(&message, ". This coordinator does not re-form groups: restart it and the workers");
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
  const int vocab = static_cast<int>(model_->config.vocab_size);
  auto bad = [&](auto... parts) { return absl::InvalidArgumentError(absl::StrCat("step ", r.step_id(), " ", parts...)); };
  if (r.sampled_ids_size() != want) {
    return bad("came back with ", r.sampled_ids_size(), " sampled ids, expected ", want);
  }
  for (int32_t id : r.sampled_ids()) {
    if (id < 0 || id >= vocab) return bad("sampled id ", id, " outside the vocabulary [0, ", vocab, ")");
  }
  const int want_logprobs = sampler && step.wants_logprobs ? step.rows : 0;
  if (r.logprobs_size() != want_logprobs) {
    return bad("came back with ", r.logprobs_size(), " logprob rows, expected ", want_logprobs);
  }
  for (const v1::RowLogprobs& l : r.logprobs()) {
    if (l.top_ids_size() != l.top_logprobs_size() || l.top_ids_size() > kMaxTopLogprobs || std::isnan(l.logprob())) {
      return bad("has a malformed logprob row");
    }
    for (int32_t id : l.top_ids()) {
      if (id < 0 || id >= vocab) return bad("logprob id ", id, " outside the vocabulary [0, ", vocab, ")");
    }
  }
  if (!(std::isfinite(r.forward_seconds()) && r.forward_seconds() >= 0 && std::isfinite(r.collective_seconds()) &&
        r.collective_seconds() >= 0)) {
    return bad("timings are not finite and >= 0");
  }
  return absl::OkStatus();
}

absl::Status WorkerPool::StartStep(const v1::StepPlan& step, int logit_rows, bool wants_logprobs) {
  std::vector<int> group;
  {
    absl::MutexLock lock(&mu_);
    if (phase_ != Phase::kServing) return NotServingLocked();
    InFlightStep& f = steps_[step.step_id()];
    f.rows = logit_rows;
    f.wants_logprobs = wants_logprobs;
    f.answered.assign(group_->slots.size(), false);
    f.results.assign(group_->slots.size(), v1::StepResult());
    for (const Slot& s : group_->slots) group.push_back(s.worker);
  }
  v1::CoordinatorMessage message;
  *message.mutable_step() = step;
  for (int i : group) {
    if (!SendTo(i, message)) {
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
    // Give the other workers a moment to report, so that the message names every worker involved.
    const absl::Time settle = absl::Now() + kLossSettle;
    while (!StepSettledLocked(step) && phase_ != Phase::kShuttingDown) {
      if (changed_.WaitWithDeadline(&mu_, settle)) break;
    }
    return NotServingLocked();
  }
  outcome->sampled_ids.clear();
  outcome->logprobs.clear();
  outcome->forward_seconds = outcome->collective_seconds = 0;
  for (const v1::StepResult& r : step.results) {
    if (r.sampled_ids_size() > 0) outcome->sampled_ids.assign(r.sampled_ids().begin(), r.sampled_ids().end());
    if (r.logprobs_size() > 0) outcome->logprobs.assign(r.logprobs().begin(), r.logprobs().end());
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
