#include "coordinator/cluster/group_formation.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/planner/format.h"
#include "coordinator/planner/memory.h"
#include "coordinator/telemetry/log.h"
#include "model/shard_identity.h"

namespace shardserve {
namespace {

// Memory assumed per worker when planning only to check the layout (Create): enough for any model.
constexpr uint64_t kProvisionalMemory = uint64_t{1} << 40;
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

// The dtype CPU workers that registered `cpu_matmul` store the products' weights of a checkpoint in
// `checkpoint_dtype` in (worker/step_executor.h ChooseCpuMatMul): bf16 where every one does, else
// float32, the CPU backend's own.
DType CpuProductsDtype(const std::vector<v1::CpuMatMulDtype>& cpu_matmul, DType checkpoint_dtype) {
  for (v1::CpuMatMulDtype m : cpu_matmul) {
    const bool bf16 =
        m == v1::CPU_MATMUL_BF16 || (m == v1::CPU_MATMUL_BF16_IF_BF16 && checkpoint_dtype == DType::kBF16);
    if (!bf16) return DType::kF32;
  }
  return cpu_matmul.empty() ? DType::kF32 : DType::kBF16;
}

PlanOptions PlanOptionsFor(const PoolOptions& o, bool cpu_only, DType cpu_products = DType::kF32) {
  PlanOptions p;
  p.tp = o.gpus_per_node;
  p.pp = o.nodes;
  p.limits = o.limits;  // the plan decides num_kv_blocks (and max_model_len when 0)
  p.weight_quant = o.weight_quant;
  p.expert_parallel = o.expert_parallel;
  (o.speculative_eagle3 ? p.eagle3 : p.draft) = o.draft_config;
  p.mtp = o.speculative_mtp;
  if (cpu_only) {
    p.dtype = DType::kF32;  // the CPU backend computes and stores in float32, its products perhaps in bf16
    if (cpu_products != DType::kF32) p.products_dtype = cpu_products;
    // No CUDA context or library workspaces: the worker process's own memory (planner/memory.h).
    p.runtime_reserve_bytes = CpuWorkerProcessBytes();
  }
  return p;
}

}  // namespace

absl::StatusOr<GroupFormation> GroupFormation::Create(const ServedModel* model, const PoolOptions& options) {
  if (options.nodes < 1 || options.gpus_per_node < 1 || options.nodes > 4096 || options.gpus_per_node > 4096 ||
      options.nodes * options.gpus_per_node > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("--nodes ", options.nodes, " x --gpus-per-node ",
                                                   options.gpus_per_node, ": need 1 to 4096 workers"));
  }
  if (absl::Status s = options.limits.Validate(); !s.ok()) return s;
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
  return GroupFormation(model, options, plan->max_model_len, fingerprint.ok() ? *fingerprint : "",
                        manifest.ok() ? *manifest : std::vector<std::string>{});
}

GroupFormation::GroupFormation(const ServedModel* model, const PoolOptions& options, int64_t target_max_model_len,
                               std::string model_fingerprint, std::vector<std::string> model_manifest)
    : model_(model),
      options_(options),
      target_max_model_len_(target_max_model_len),
      model_fingerprint_(std::move(model_fingerprint)),
      model_manifest_(std::move(model_manifest)) {}

absl::StatusOr<FormedGroup> GroupFormation::Form(const std::vector<Registered>& registered) const {
  const int tp = options_.gpus_per_node, pp = options_.nodes;
  if (registered.empty()) return absl::FailedPreconditionError("no worker has registered");
  // Slots, ranks and group names (coordinator/cluster/group.h): the nodes in natural order are
  // the stages, a node's workers in registration order its TP ranks.
  uint64_t memory = UINT64_MAX;
  double bandwidth = std::numeric_limits<double>::infinity();  // the slowest worker's; 0 if one is unknown
  bool cpu_only = true;
  std::vector<v1::CpuMatMulDtype> cpu_matmul;
  // The first epoch: after every epoch a worker held under an earlier coordinator, so that epochs
  // only grow across coordinator restarts (and an adopted worker's Regroup is to a later one).
  uint64_t first_epoch = kFirstEpoch;
  for (const Registered& r : registered) {
    const v1::Register& h = *r.hello;
    memory = std::min(memory, static_cast<uint64_t>(h.memory_bytes()));
    bandwidth = std::min(bandwidth, h.memory_bytes_per_s());  // 0 or in range (Register checked)
    cpu_only = cpu_only && h.device() == "cpu";
    cpu_matmul.push_back(h.cpu_matmul());
    if (h.has_held() && h.held().assignment().epoch() < kMaxHeldEpoch) {
      first_epoch = std::max(first_epoch, h.held().assignment().epoch() + 1);
    }
  }
  // A node's workers in registration order are its TP ranks, except that a worker holding a shard
  // of this layout (an earlier coordinator's) takes its rank when it is free, so that it can be
  // adopted.
  std::map<std::string, std::vector<int>> by_rank;  // node -> worker index per TP rank, -1: free
  std::map<int, const v1::Register*> hello_of;
  std::vector<std::string> node_order;
  std::vector<int> unplaced;
  for (const Registered& r : registered) {
    const v1::Register& h = *r.hello;
    hello_of[r.index] = r.hello;
    std::vector<int>& ranks = by_rank[h.node()];
    if (ranks.empty()) {
      ranks.assign(tp, -1);
      node_order.push_back(h.node());
    }
    const int held = h.has_held() && h.held().assignment().tp_size() == tp ? h.held().assignment().tp_rank() : -1;
    if (held >= 0 && held < tp && ranks[held] < 0) {
      ranks[held] = r.index;
    } else {
      unplaced.push_back(r.index);
    }
  }
  for (int i : unplaced) {  // Register keeps a node at most tp workers: a free rank is left
    std::vector<int>& ranks = by_rank[hello_of[i]->node()];
    const auto free = std::find(ranks.begin(), ranks.end(), -1);
    if (free == ranks.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("node ", hello_of[i]->node(), " has more than ", tp, " workers (--gpus-per-node)"));
    }
    *free = i;
  }
  std::vector<Member> members;
  for (const std::string& node : node_order) {
    for (int i : by_rank[node]) members.push_back(Member{i, node});
  }
  absl::StatusOr<Group> group = FormGroup(GroupShape{tp, pp}, members, first_epoch);
  const std::string device = registered.front().hello->device();

  // The plan: the layers of each stage and the memory of each worker.
  const ClusterSpec cluster = ClusterFor(pp, tp, device, memory, bandwidth > 0 ? bandwidth : kAssumedMemoryBytesPerS);
  absl::StatusOr<Plan> plan =
      MakePlan(model_->config, model_->checkpoint.get(), cluster,
               PlanOptionsFor(options_, cpu_only, CpuProductsDtype(cpu_matmul, model_->config.dtype)));
  if (!group.ok()) return absl::FailedPreconditionError(group.status().message());
  if (!plan.ok()) return absl::FailedPreconditionError(plan.status().message());
  if (!plan->fits) return absl::FailedPreconditionError(plan->reason);
  if (static_cast<int>(plan->stages.size()) != pp) {
    return absl::FailedPreconditionError(absl::StrCat("the planner made ", plan->stages.size(), " stages, not ", pp));
  }
  for (const GpuPlan& g : plan->per_gpu) {
    if (g.node < 0 || g.node >= pp || g.gpu < 0 || g.gpu >= tp || g.stage != g.node || g.tp_rank != g.gpu) {
      return absl::FailedPreconditionError(absl::StrCat("the planner placed stage ", g.stage, " rank ", g.tp_rank,
                                                        " on node ", g.node, " GPU ", g.gpu,
                                                        "; this coordinator needs one stage per node"));
    }
  }

  FormedGroup formed{std::move(*group), std::move(*plan), {}, "the workers' memory"};
  Plan& p = formed.plan;
  StepLimits& limits = formed.limits;
  // The KV cache: the plan's blocks (what the smallest worker holds beside its weights), capped on
  // CPU workers, or what --num-kv-blocks says. A sequence must fit in the cache, so the served
  // length is at most what the cache holds.
  int64_t kv_blocks = p.limits.num_kv_blocks;
  const int64_t block_size = options_.limits.block_size;
  if (options_.limits.num_kv_blocks > 0) {
    kv_blocks = options_.limits.num_kv_blocks;
    formed.kv_from = "--num-kv-blocks";
  } else if (cpu_only) {
    // The full pool's blocks whose cache, with the sliding layers' pool beside it, fits every worker.
    int64_t cap = kv_blocks;
    for (const GpuPlan& g : p.per_gpu) {
      cap = std::min(cap, MostKvBlocks(model_->config, g, options_.limits, p.max_model_len,
                                       static_cast<int64_t>(kMaxCpuKvCacheBytes), kv_blocks));
    }
    if (cap < kv_blocks) {
      kv_blocks = cap;
      formed.kv_from = "256 MiB per CPU worker";
    }
  }
  if (kv_blocks * block_size < p.max_model_len) {
    CoordinatorLog("group", absl::StrCat("max_model_len lowered from ", p.max_model_len, " to ",
                                         kv_blocks * block_size, ": the KV cache holds ", kv_blocks,
                                         " blocks of ", block_size, " tokens (", formed.kv_from, ")"));
    p.max_model_len = kv_blocks * block_size;
  }
  limits = options_.limits;
  limits.num_kv_blocks = kv_blocks;
  limits.max_model_len = p.max_model_len;
  // The sliding layers' pool, for the full pool and the length served (model/kv_blocks.h).
  limits.num_sliding_kv_blocks = PlannedSlidingBlocks(model_->config, limits, kv_blocks, limits.max_model_len);
  // The plan shown by `shardserve status` carries the cache the scheduler really uses.
  if (kv_blocks != p.limits.num_kv_blocks) {
    absl::StrAppend(&p.reason, " The KV cache used is ", planner_format::Count(limits.kv_cache_tokens()),
                    " tokens (", planner_format::Count(kv_blocks), " blocks of ", block_size, ": ", formed.kv_from,
                    "), not all that memory holds.");
  }
  p.limits = limits;
  p.kv_cache_tokens = limits.kv_cache_tokens();
  FillMemoryItems(model_->config, &p);  // for the limits the workers get
  return formed;
}

v1::Assignment GroupFormation::AssignmentFor(const Slot& slot, const std::string& worker_id, uint64_t epoch,
                                             const Plan& plan, const StepLimits& limits) const {
  const int tp = options_.gpus_per_node, pp = options_.nodes;
  const StagePlan& st = plan.stages[slot.stage];
  v1::Assignment a;
  a.set_worker_id(worker_id);
  a.set_model_path(model_->dir);
  a.set_stage(slot.stage);
  a.set_num_stages(pp);
  a.set_tp_rank(slot.tp_rank);
  a.set_tp_size(tp);
  a.set_first_layer(static_cast<int32_t>(st.first_layer));
  a.set_end_layer(static_cast<int32_t>(st.last_layer + 1));
  a.set_tp_group(slot.tp_group);
  a.set_send_group(slot.send_group);
  a.set_recv_group(slot.recv_group);
  ToProto(limits, a.mutable_limits());
  a.set_collective_timeout_seconds(absl::ToDoubleSeconds(options_.collective_timeout));
  a.set_weight_quantization(options_.weight_quant == WeightQuant::kInt8   ? v1::WEIGHT_QUANTIZATION_INT8
                            : options_.weight_quant == WeightQuant::kInt4 ? v1::WEIGHT_QUANTIZATION_INT4
                            : options_.weight_quant == WeightQuant::kFp8  ? v1::WEIGHT_QUANTIZATION_FP8
                                                                          : v1::WEIGHT_QUANTIZATION_UNSPECIFIED);
  a.set_expert_parallel(options_.expert_parallel);
  a.set_draft_model_path(options_.draft_model_path);  // loaded by the worker that samples only
  a.set_speculative_mtp(options_.speculative_mtp);     // likewise
  a.set_speculative_eagle3(options_.speculative_eagle3);  // likewise
  for (int64_t layer : options_.aux_hidden_layers) a.add_aux_hidden_layers(layer);  // every worker keeps these
  if (options_.load_format == LoadFormat::kDummy) {
    a.set_load_format(v1::LOAD_FORMAT_DUMMY);
    a.set_dummy_seed(options_.dummy_seed);
  }
  a.set_epoch(epoch);
  a.mutable_model_manifest()->Add(model_manifest_.begin(), model_manifest_.end());
  for (const MemoryItem& item : plan.per_gpu[slot.stage * tp + slot.tp_rank].memory) {
    v1::MemoryItem* planned = a.add_planned_memory();
    planned->set_name(item.name);
    planned->set_bytes(item.bytes);
  }
  return a;
}

absl::Status GroupFormation::CheckAdopt(const v1::HeldShard& held, const v1::Assignment& assignment) const {
  absl::Status same =
      model_fingerprint_.empty() ? absl::FailedPreconditionError("this coordinator has no fingerprint of its model")
      : held.model_fingerprint() != model_fingerprint_
          ? absl::FailedPreconditionError(absl::StrCat("it holds another model than ", model_->dir,
                                                       " (another config.json or checkpoint files)"))
          : SameShard(held.assignment(), assignment);
  if (same.ok() && held.assignment().epoch() >= assignment.epoch()) {
    same = absl::FailedPreconditionError(absl::StrCat("its epoch ", held.assignment().epoch(),
                                                      " is not before the group's ", assignment.epoch()));
  }
  return same;
}

absl::Status GroupFormation::CheckFitsSlot(const v1::Register& hello, const std::string& group_device,
                                           const Slot& slot, const Plan& plan, const StepLimits& limits) const {
  const std::string where = absl::StrCat("slot (node ", slot.node, ", stage ", slot.stage, ", tp rank ",
                                         slot.tp_rank, ")");
  if ((hello.device() == "cpu") != (group_device == "cpu")) {
    return absl::FailedPreconditionError(absl::StrCat("device ", hello.device(), " cannot take ", where,
                                                      ": the group runs on ", group_device));
  }
  // What the slot's shard needs: its weights, step buffers and reserve, and the KV cache every
  // worker of the group holds (the plan's figures), at the planner's memory utilization.
  const GpuPlan& g = plan.per_gpu[slot.rank];
  const double kv =
      static_cast<double>(GpuKvBytes(g, limits.num_kv_blocks, limits.num_sliding_kv_blocks, limits.block_size));
  const double need = (static_cast<double>(g.weight_bytes + g.activation_bytes + g.reserve_bytes) + kv) /
                      plan.options.gpu_memory_utilization;
  if (static_cast<double>(hello.memory_bytes()) < need) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "a worker with %.1f MiB of memory cannot take %s: its shard needs %.1f MiB (weights %.1f MiB, KV cache %.1f "
        "MiB for %d blocks, buffers and reserve %.1f MiB, at memory utilization %.2f); give it more (--memory-gb)",
        hello.memory_bytes() / 1048576.0, where, need / 1048576.0, g.weight_bytes / 1048576.0, kv / 1048576.0,
        limits.num_kv_blocks, (g.activation_bytes + g.reserve_bytes) / 1048576.0,
        plan.options.gpu_memory_utilization));
  }
  return absl::OkStatus();
}

}  // namespace shardserve
