#include "worker/step_executor.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/resource_limits.h"
#include "base/status_macros.h"
#include "model/weight_source.h"
#include "model/config.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/host_cpus.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/comm/shared_memory_communicator.h"
#include "worker/comm/staged_communicator.h"
#include "worker/step_checks.h"
#include "worker/step_state.h"
#if SHARDSERVE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace shardserve {
namespace {

// For the worker's log ("" for a group of one).
const char* CollectiveTransportName(CollectiveTransport t) {
  switch (t) {
    case CollectiveTransport::kNone: return "";
    case CollectiveTransport::kGlooTcp: return "Gloo TCP";
    case CollectiveTransport::kGlooTcpNoSharedMemory: return "Gloo TCP (the ranks share no memory)";
    case CollectiveTransport::kSharedMemory: return "shared memory";
    case CollectiveTransport::kGlooStaged: return "Gloo TCP staged through host memory";
    case CollectiveTransport::kNccl: return "NCCL";
  }
  return "";
}

// Joins rank `rank` of the `size`-rank group `group`: a LocalCommunicator for a group of one,
// Gloo on the CPU (kAuto: with shared memory where the ranks share a host), NCCL on a GPU, or Gloo
// staged through host memory on a GPU (kGloo); `transport` says which. NCCL runs on the legacy
// default stream, not the backend's (Backend does not expose its stream); TimedCommunicator
// synchronizes the backend before each collective, which orders the two.
absl::StatusOr<std::unique_ptr<Communicator>> MakeCommunicator(RendezvousStore* store, const std::string& group,
                                                              int rank, int size, Backend* backend, int cuda_ordinal,
                                                              Collectives collectives,
                                                              const std::string& collective_host,
                                                              absl::Duration timeout, CollectiveTransport* transport) {
  *transport = CollectiveTransport::kNone;
  if (size == 1) return std::make_unique<LocalCommunicator>(backend);
  if (cuda_ordinal < 0) {
    absl::StatusOr<std::unique_ptr<Communicator>> gloo =
        MakeGlooCommunicator(store, group, rank, size, collective_host, timeout);
    *transport = CollectiveTransport::kGlooTcp;
    if (!gloo.ok() || collectives == Collectives::kGloo) return gloo;
    const Communicator* tcp = gloo->get();
    absl::StatusOr<std::unique_ptr<Communicator>> shared = WithSharedMemory(std::move(*gloo), group, timeout);
    if (shared.ok()) {
      *transport =
          shared->get() == tcp ? CollectiveTransport::kGlooTcpNoSharedMemory : CollectiveTransport::kSharedMemory;
    }
    return shared;
  }
  if (collectives == Collectives::kGloo) {
    absl::StatusOr<std::unique_ptr<Communicator>> gloo =
        MakeGlooCommunicator(store, group, rank, size, collective_host, timeout);
    if (!gloo.ok()) return gloo.status();
    *transport = CollectiveTransport::kGlooStaged;
    return std::make_unique<StagedCommunicator>(std::move(*gloo), std::make_unique<BackendCopier>(backend));
  }
  *transport = CollectiveTransport::kNccl;
  return MakeNcclCommunicator(store, group, rank, size, cuda_ordinal, /*stream=*/nullptr, timeout);
}

// cudaMemGetInfo of cuda:K: {total, free}; {-1, -1} on cpu, in a build without CUDA or on an error
// (the figures only feed the memory report).
std::pair<int64_t, int64_t> DeviceMemoryInfo(int cuda_ordinal) {
#if SHARDSERVE_HAVE_CUDA
  if (cuda_ordinal >= 0) {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(cuda_ordinal) == cudaSuccess && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      return {static_cast<int64_t>(total_bytes), static_cast<int64_t>(free_bytes)};
    }
    (void)cudaGetLastError();
  }
#else
  (void)cuda_ordinal;
#endif
  return {-1, -1};
}

// A draft model for speculative decoding (worker/draft_runner.h): a whole checkpoint as one
// ModelShard (every layer, TP rank 0 of 1, no communicator but a LocalCommunicator), argmax on the
// device.
class ShardDraftModel final : public DraftModel {
 public:
  static absl::StatusOr<std::unique_ptr<ShardDraftModel>> Load(const std::string& path, const ModelConfig& target,
                                                                const StepLimits& limits, Backend* backend) {
    absl::StatusOr<ModelConfig> config = LoadModelConfig(path);
    if (!config.ok()) {
      return absl::Status(config.status().code(), absl::StrCat("draft model: ", config.status().message()));
    }
    if (config->vocab_size != target.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("the draft model at ", path, " has a vocabulary of ",
                                                     config->vocab_size, " ids but the model has ", target.vocab_size,
                                                     "; a draft must share the model's tokenizer and vocabulary"));
    }
    std::unique_ptr<ShardDraftModel> d(new ShardDraftModel());
    absl::StatusOr<std::unique_ptr<WeightSource>> weights = OpenWeightSource(path, *config, LoadFormat::kAuto, 0, true);
    if (!weights.ok()) return weights.status();
    d->tp_ = std::make_unique<LocalCommunicator>(backend);
    absl::StatusOr<std::unique_ptr<ModelShard>> shard =
        ModelShard::Load(**weights, *config, ShardSpec{}, limits, backend, d->tp_.get());
    if (!shard.ok()) {
      return absl::Status(shard.status().code(), absl::StrCat("draft model at ", path, ": ", shard.status().message()));
    }
    d->shard_ = std::move(*shard);
    absl::StatusOr<Buffer> ids = backend->Allocate(static_cast<size_t>(limits.max_seqs_per_step) * sizeof(int32_t));
    if (!ids.ok()) return ids.status();
    d->ids_ = std::move(*ids);
    return d;
  }

  absl::Status Forward(const StepBatch& batch, std::vector<int32_t>* next) override {
    SHARDSERVE_RETURN_IF_ERROR(shard_->Forward(batch));
    const int64_t m = static_cast<int64_t>(batch.logit_rows.size());
    next->resize(static_cast<size_t>(m));  // within the capacity DraftRunner reserved
    if (m == 0) return absl::OkStatus();
    Tensor out(ids_.data(), DType::kI32, {m});
    SHARDSERVE_RETURN_IF_ERROR(shard_->backend()->Argmax(&out, shard_->logits(m)));
    return shard_->backend()->CopyToHost(next->data(), out.data, static_cast<size_t>(m) * sizeof(int32_t));
  }

  const ModelConfig& config() const { return shard_->config(); }
  uint64_t weight_bytes() const { return shard_->weight_bytes(); }
  uint64_t kv_cache_bytes() const { return shard_->kv_cache_bytes(); }
  uint64_t step_buffer_bytes() const { return shard_->step_buffer_bytes(); }

 private:
  ShardDraftModel() = default;
  std::unique_ptr<Communicator> tp_;
  std::unique_ptr<ModelShard> shard_;
  Buffer ids_;
};

std::string Bytes(int64_t bytes) {
  return absl::StrFormat("%d B (%.2f MiB)", bytes, static_cast<double>(bytes) / (1 << 20));
}

}  // namespace

absl::StatusOr<int> ParseDevice(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  int ordinal = -1;
  if (absl::StartsWith(device, "cuda:") && absl::SimpleAtoi(device.substr(5), &ordinal) && ordinal >= 0) {
    return ordinal;
  }
  return absl::InvalidArgumentError(absl::StrCat("device '", device, "' is not cpu, cuda or cuda:K"));
}

absl::StatusOr<Collectives> ParseCollectives(const std::string& name) {
  if (name == "auto") return Collectives::kAuto;
  if (name == "gloo") return Collectives::kGloo;
  if (name == "nccl") return Collectives::kNccl;
  return absl::InvalidArgumentError(absl::StrCat("collectives '", name, "' is not auto, gloo or nccl"));
}

CpuMatMul StepExecutor::ChooseCpuMatMul(DType checkpoint_dtype) {
  return checkpoint_dtype == DType::kBF16 && CpuHasNativeBf16MatMul() ? CpuMatMul::kBF16 : CpuMatMul::kF32;
}

v1::CpuMatMulDtype StepExecutor::RegisteredCpuMatMul(std::optional<CpuMatMul> flag) {
  if (flag.has_value()) return *flag == CpuMatMul::kBF16 ? v1::CPU_MATMUL_BF16 : v1::CPU_MATMUL_F32;
  return CpuHasNativeBf16MatMul() ? v1::CPU_MATMUL_BF16_IF_BF16 : v1::CPU_MATMUL_F32;
}

absl::StatusOr<std::unique_ptr<StepExecutor>> StepExecutor::Create(const v1::Assignment& a, const std::string& device,
                                                                   RendezvousStore* store,
                                                                   const std::string& collective_host,
                                                                   const StepExecutorOptions& worker_options) {
  SHARDSERVE_RETURN_IF_ERROR(CheckAssignment(a));  // before reading anything the assignment names
  absl::StatusOr<int> cuda_ordinal = ParseDevice(device);
  if (!cuda_ordinal.ok()) return cuda_ordinal.status();
  if (*cuda_ordinal < 0 && worker_options.collectives == Collectives::kNccl) {
    return absl::InvalidArgumentError("collectives nccl needs a CUDA device; a cpu worker's groups are Gloo");
  }
  absl::StatusOr<ModelConfig> config = LoadModelConfig(a.model_path());
  if (!config.ok()) return config.status();

  std::unique_ptr<StepExecutor> e(new StepExecutor());
  e->assignment_ = a;
  e->cuda_ordinal_ = *cuda_ordinal;
  e->collectives_ = worker_options.collectives;
  e->collective_host_ = collective_host;
  std::tie(e->device_memory_.total, e->device_memory_.free_start) = DeviceMemoryInfo(*cuda_ordinal);
  if (*cuda_ordinal < 0) {
    absl::StatusOr<std::unique_ptr<Backend>> cpu =
        MakeCpuBackend(worker_options.cpu_threads, worker_options.cpu_matmul.value_or(ChooseCpuMatMul(config->dtype)),
                       worker_options.cpu_activation_quant);
    if (!cpu.ok()) return cpu.status();
    e->backend_ = std::move(*cpu);
  } else {
    // On a GPU the activations keep the checkpoint's dtype.
    absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeCudaBackend(*cuda_ordinal, config->dtype, worker_options.cuda);
    if (!cuda.ok()) return cuda.status();
    e->backend_ = std::move(*cuda);
  }
  Backend* backend = e->backend_.get();
  e->device_memory_.free_backend = DeviceMemoryInfo(*cuda_ordinal).second;

  // The groups (JoinGroups: the assignment's, as a regroup to them would name them).
  const bool first = a.stage() == 0, last = a.stage() + 1 == a.num_stages();
  e->tp_ = std::make_unique<TimedCommunicator>(nullptr, backend);
  if (!first) e->recv_ = std::make_unique<TimedCommunicator>(nullptr, backend);
  if (!last) e->send_ = std::make_unique<TimedCommunicator>(nullptr, backend);
  SHARDSERVE_RETURN_IF_ERROR(e->JoinGroups(RegroupOf(a), store));

  e->device_memory_.free_groups = DeviceMemoryInfo(*cuda_ordinal).second;

  // The shard. The checkpoint (or the dummy weights' generator) is only read during Load: the
  // weights are copied into the shard.
  const LoadFormat format = a.load_format() == v1::LOAD_FORMAT_DUMMY ? LoadFormat::kDummy : LoadFormat::kAuto;
  absl::StatusOr<std::unique_ptr<WeightSource>> weights =
      OpenWeightSource(a.model_path(), *config, format, a.dummy_seed(), worker_options.dummy_weights_on_device);
  if (!weights.ok()) return weights.status();
  const ShardSpec spec = ShardSpecOf(a);
  const StepLimits options = FromProto(a.limits());
  absl::StatusOr<std::unique_ptr<ModelShard>> shard =
      ModelShard::Load(**weights, *config, spec, options, backend, e->tp_.get());
  if (!shard.ok()) return shard.status();
  e->shard_ = std::move(*shard);
  // What a worker checks of an assignment (CheckShard ran first, in Load): the stage's layers.
  SHARDSERVE_RETURN_IF_ERROR(CheckLoadable(a, *config));

  // The running batch and the step buffers, for the largest step.
  const int64_t m = options.max_seqs_per_step;
  e->steps_ = std::make_unique<StepState>(a, config->vocab_size);
  // A TP group of one stage shares rank 0's samples through this (StepPlan.share_samples).
  if (a.num_stages() == 1 && a.tp_size() > 1) {
    absl::StatusOr<Buffer> ids = backend->Allocate(static_cast<size_t>(m) * sizeof(int32_t));
    if (!ids.ok()) return ids.status();
    e->shared_ids_ = std::move(*ids);
  }
  if (last && a.tp_rank() == 0) {
    absl::StatusOr<std::unique_ptr<Sampler>> sampler = Sampler::Create(backend, m, config->vocab_size);
    if (!sampler.ok()) return sampler.status();
    e->sampler_ = std::move(*sampler);
    // Speculative decoding's draft model, beside the shard, on the worker that samples.
    if (!a.draft_model_path().empty() && !a.speculative_eagle3()) {
      const StepLimits draft_limits = DraftStepLimits(options);
      absl::StatusOr<std::unique_ptr<ShardDraftModel>> draft =
          ShardDraftModel::Load(a.draft_model_path(), *config, draft_limits, backend);
      if (!draft.ok()) return draft.status();
      e->draft_summary_ = absl::StrFormat(
          "draft model %s: %.1f MiB of weights, %.1f MiB of KV cache (%d blocks of %d tokens), run after sampling",
          a.draft_model_path(), static_cast<double>((*draft)->weight_bytes()) / (1 << 20),
          static_cast<double>((*draft)->kv_cache_bytes()) / (1 << 20), draft_limits.num_kv_blocks,
          draft_limits.block_size);
      e->draft_bytes_ =
          static_cast<int64_t>((*draft)->weight_bytes() + (*draft)->kv_cache_bytes() + (*draft)->step_buffer_bytes());
      const int64_t context = (*draft)->config().max_position_embeddings;
      const int64_t positions = context > 0 ? std::min(context, draft_limits.max_model_len) : draft_limits.max_model_len;
      e->draft_ = std::make_unique<DraftRunner>(std::move(*draft), options, config->vocab_size, positions);
    }
    // ... or the model's own multi-token-prediction layer, from the same checkpoint.
    if (a.speculative_mtp()) {
      absl::StatusOr<std::unique_ptr<HeadRunner>> mtp =
          HeadRunner::Load(**weights, *config, spec.weight_quant, options, e->shard_.get());
      if (!mtp.ok()) return mtp.status();
      const StepLimits mtp_limits = HeadRunner::HeadLimits(options);
      e->draft_summary_ = absl::StrFormat(
          "multi-token-prediction layer %d: %.1f MiB of weights, %.1f MiB of KV cache (%d blocks of %d tokens), "
          "run after sampling",
          config->num_hidden_layers, static_cast<double>((*mtp)->weight_bytes()) / (1 << 20),
          static_cast<double>((*mtp)->kv_cache_bytes()) / (1 << 20), mtp_limits.num_kv_blocks,
          mtp_limits.block_size);
      e->head_ = std::move(*mtp);
    }
    // ... or an EAGLE-3 head, from its own directory, over the hidden states the stages keep.
    if (a.speculative_eagle3()) {
      absl::StatusOr<std::unique_ptr<HeadRunner>> head =
          HeadRunner::LoadEagle3(a.draft_model_path(), format, a.dummy_seed(), **weights, *config, spec.weight_quant,
                                options, e->shard_.get());
      if (!head.ok()) return head.status();
      const StepLimits head_limits = HeadRunner::HeadLimits(options);
      e->draft_summary_ = absl::StrFormat(
          "EAGLE-3 head %s over the hidden states of layers %s: %.1f MiB of weights%s, %.1f MiB of KV cache "
          "(%d blocks of %d tokens), run after sampling",
          a.draft_model_path(), absl::StrJoin(a.aux_hidden_layers(), ", "),
          static_cast<double>((*head)->weight_bytes()) / (1 << 20),
          (*head)->shares_embedding() ? " (the model's embedding shared)" : "",
          static_cast<double>((*head)->kv_cache_bytes()) / (1 << 20), head_limits.num_kv_blocks,
          head_limits.block_size);
      e->head_ = std::move(*head);
    }
  }
  if (*cuda_ordinal >= 0) SHARDSERVE_RETURN_IF_ERROR(backend->Synchronize());  // the loads have landed
  e->device_memory_.free_loaded = DeviceMemoryInfo(*cuda_ordinal).second;
  return e;
}

std::vector<std::string> StepExecutor::MemoryReport() const {
  const DeviceMemory& d = device_memory_;
  const bool cuda = d.total >= 0 && d.free_start >= 0 && d.free_backend >= 0 && d.free_groups >= 0 &&
                    d.free_loaded >= 0;
  const int64_t scratch = static_cast<int64_t>(backend_->dequant_scratch_bytes());
  const int64_t own = OwnBufferBytes();
  std::vector<std::string> lines;
  for (const v1::MemoryItem& item : assignment_.planned_memory()) {
    const std::string& name = item.name();
    std::string measured;
    if (name == "weights") {
      measured = Bytes(static_cast<int64_t>(shard_->weight_bytes())) + ", the shard's own count";
    } else if (name == "kv_cache") {
      measured = Bytes(static_cast<int64_t>(shard_->kv_cache_bytes())) + ", the shard's own count";
    } else if (name == "step_buffers") {
      measured = Bytes(static_cast<int64_t>(shard_->step_buffer_bytes())) + ", the shard's own count";
    } else if (name == "draft_model") {
      measured = Bytes(draft_bytes_) + ", the draft's own count (weights, KV cache, step buffers)";
    } else if (name == "mtp_layer" || name == "eagle3_head") {
      const char* what = name == "mtp_layer" ? "multi-token-prediction layer" : "EAGLE-3 head";
      measured = head_ == nullptr ? absl::StrCat(Bytes(0), ", this worker runs no ", what)
                                 : Bytes(static_cast<int64_t>(head_->total_bytes())) +
                                       ", the head's own count (weights, KV cache, step buffers, hidden rows)";
    } else if (name == "dequant_scratch") {
      measured = Bytes(scratch) + ", the backend's own count (grown as the quantized weights were stored)";
    } else if (name == "cuda_graph_pools") {
      measured = backend_->records_graphs()
                     ? "not measured: the step graphs are recorded at decode steps, after loading"
                     : Bytes(0) + ", no CUDA graphs are recorded";
    } else if (name == "process") {  // (a CPU worker's item)
      const std::optional<int64_t> process = ProcessMemoryBytes();
      measured = process ? absl::StrCat(Bytes(*process), ", /proc/self/status RssAnon ", Bytes(*process + own),
                                        " less the worker's own weights, KV cache and step buffers (", Bytes(own),
                                        ")")
                         : "not measured: no RssAnon in /proc/self/status";
    } else if (!cuda) {
      measured = "not measured on this device";
    } else if (name == "nccl_buffers") {
      measured = Bytes(d.free_backend - d.free_groups) + ", cudaMemGetInfo across joining the groups";
    } else if (name == "cuda_context") {
      measured = Bytes(d.total - d.free_backend) +
                 ", cudaMemGetInfo: used once the backend was made (other processes on the GPU included)";
    } else if (name == "free") {
      measured = Bytes(d.free_loaded) + ", cudaMemGetInfo after loading (cuBLAS's workspace still to come)";
    } else if (name == "cublas_workspace") {
      measured = "not measured: cuBLAS allocates it at the first product";
    } else if (name == "runtime_slack") {
      measured = "not measured: kernel modules load at their first launch, after loading";
    } else {
      measured = "not measured";
    }
    lines.push_back(absl::StrCat(name, ": planned ", Bytes(item.bytes()), ", measured ", measured));
  }
  if (cuda) {
    // What loading took from the device beyond the shard's and the backend's own counts: allocator
    // rounding, the sampler's and the backend's small scratch.
    const int64_t loaded = d.free_groups - d.free_loaded;
    lines.push_back(absl::StrCat("loading took ", Bytes(loaded), " of the device for ", Bytes(own),
                                 " of weights, KV cache, step buffers and dequantize scratch (", Bytes(loaded - own),
                                 " beyond them)"));
  }
  return lines;
}

int64_t StepExecutor::OwnBufferBytes() const {
  // (with a draft model's or a head's own count, where this worker runs one)
  return static_cast<int64_t>(shard_->weight_bytes() + shard_->kv_cache_bytes() + shard_->step_buffer_bytes() +
                              (head_ != nullptr ? head_->total_bytes() : 0) + backend_->dequant_scratch_bytes()) +
         draft_bytes_;
}

// Its anonymous memory resident now (RssAnon, which a memory limit cannot reclaim) less its own
// buffers, which are resident: the weights written at load, the KV cache and the step buffers
// zero-filled there (ModelShard::Load).
std::optional<int64_t> StepExecutor::ProcessMemoryBytes() const {
  if (cuda_ordinal_ >= 0) return std::nullopt;
  const std::optional<int64_t> anon = ProcStatusBytes("self", "RssAnon");
  if (!anon) return std::nullopt;
  return *anon - OwnBufferBytes();
}

std::string StepExecutor::MemoryAfterSteps() const {
  const DeviceMemory& d = device_memory_;
  if (d.free_loaded < 0) return "";
  const int64_t free_now = DeviceMemoryInfo(cuda_ordinal_).second;
  if (free_now < 0) return "";
  int64_t planned = 0;
  for (const v1::MemoryItem& item : assignment_.planned_memory()) {
    if (item.name() == "cublas_workspace" || item.name() == "cuda_graph_pools" || item.name() == "runtime_slack") {
      planned += item.bytes();
    }
  }
  return absl::StrCat("after_steps: planned ", Bytes(planned), ", measured ", Bytes(d.free_loaded - free_now),
                      ", cudaMemGetInfo: taken since loading (cuBLAS's workspace, kernel modules loaded at their "
                      "first launch, step graphs) against cublas_workspace + cuda_graph_pools + runtime_slack");
}

absl::Status StepExecutor::Regroup(const v1::Regroup& r, RendezvousStore* store) {
  // Whatever happens after the check, the old groups are gone and the running batch with them.
  SHARDSERVE_RETURN_IF_ERROR(steps_->Regroup(assignment_, r));
  if (draft_ != nullptr) draft_->Clear();
  if (head_ != nullptr) head_->Clear();
  return JoinGroups(r, store);
}

std::string StepExecutor::collectives_summary() const {
  std::vector<std::string> parts;
  const char* const kGroups[] = {"TP group", "from the previous stage", "to the next stage"};
  for (int i = 0; i < 3; ++i) {
    if (transports_[i] != CollectiveTransport::kNone) {
      parts.push_back(absl::StrCat(kGroups[i], ": ", CollectiveTransportName(transports_[i])));
    }
  }
  return parts.empty() ? "" : absl::StrCat("collectives: ", absl::StrJoin(parts, "; "));
}

absl::Status StepExecutor::JoinGroups(const v1::Regroup& r, RendezvousStore* store) {
  const v1::Assignment& a = assignment_;
  const bool first = a.stage() == 0, last = a.stage() + 1 == a.num_stages();
  for (TimedCommunicator* c : {tp_.get(), recv_.get(), send_.get()}) {
    if (c != nullptr) c->Replace(nullptr);
  }
  // In an order that cannot deadlock: every rank joins its TP group first; then stage s joins the
  // pair (s-1, s) before the pair (s, s+1), so the pairs form from the first stage on.
  const absl::Duration timeout = absl::Seconds(a.collective_timeout_seconds());
  Backend* backend = backend_.get();
  auto join = [&](TimedCommunicator* c, const std::string& group, int rank, int size,
                  CollectiveTransport* transport) -> absl::Status {
    absl::StatusOr<std::unique_ptr<Communicator>> comm = MakeCommunicator(
        store, group, rank, size, backend, cuda_ordinal_, collectives_, collective_host_, timeout, transport);
    if (!comm.ok()) return comm.status();
    c->Replace(std::move(*comm));
    return absl::OkStatus();
  };
  SHARDSERVE_RETURN_IF_ERROR(join(tp_.get(), r.tp_group(), a.tp_rank(), a.tp_size(), &transports_[0]));
  // A TP group in one host's shared memory shares its CPUs too: are there enough for its threads?
  host_cpus_warning_.clear();
  if (transports_[0] == CollectiveTransport::kSharedMemory && backend->compute_threads() > 0) {
    SHARDSERVE_ASSIGN_OR_RETURN(host_cpus_warning_, HostCpuShare(*tp_, backend->compute_threads()));
  }
  if (!first) SHARDSERVE_RETURN_IF_ERROR(join(recv_.get(), r.recv_group(), 1, 2, &transports_[1]));
  if (!last) SHARDSERVE_RETURN_IF_ERROR(join(send_.get(), r.send_group(), 0, 2, &transports_[2]));
  return absl::OkStatus();
}

void StepExecutor::LeaveCoordinator() {
  steps_->Clear();
  if (draft_ != nullptr) draft_->Clear();
  if (head_ != nullptr) head_->Clear();
  LeaveGroups();
}

absl::Status StepExecutor::Adopt(const v1::Assignment& a, RendezvousStore* store) {
  // The worker that samples holds the draft model it loaded: a coordinator that wants another (or
  // none, or one where there was none) gets a fresh load instead.
  if (sampler_ != nullptr && a.draft_model_path() != assignment_.draft_model_path()) {
    return absl::FailedPreconditionError(absl::StrCat("the adopting coordinator's draft model '", a.draft_model_path(),
                                                      "' is not the one this worker loaded, '",
                                                      assignment_.draft_model_path(), "'"));
  }
  if (sampler_ != nullptr && a.speculative_eagle3() != assignment_.speculative_eagle3()) {
    return absl::FailedPreconditionError(absl::StrCat("the adopting coordinator ",
                                                      a.speculative_eagle3() ? "wants" : "does not want",
                                                      " an EAGLE-3 head, which this worker ",
                                                      assignment_.speculative_eagle3() ? "loaded" : "did not load"));
  }
  if (!std::equal(a.aux_hidden_layers().begin(), a.aux_hidden_layers().end(), assignment_.aux_hidden_layers().begin(),
                  assignment_.aux_hidden_layers().end())) {
    return absl::FailedPreconditionError(
        absl::StrCat("the adopting coordinator wants the hidden states of layers ", absl::StrJoin(a.aux_hidden_layers(), ", "),
                     " kept; this worker keeps ", absl::StrJoin(assignment_.aux_hidden_layers(), ", ")));
  }
  if (sampler_ != nullptr && a.speculative_mtp() != assignment_.speculative_mtp()) {
    return absl::FailedPreconditionError(absl::StrCat("the adopting coordinator ",
                                                      a.speculative_mtp() ? "wants" : "does not want",
                                                      " the multi-token-prediction layer, which this worker ",
                                                      assignment_.speculative_mtp() ? "loaded" : "did not load"));
  }
  SHARDSERVE_RETURN_IF_ERROR(steps_->Adopt(assignment_, a));
  if (draft_ != nullptr) draft_->Clear();
  if (head_ != nullptr) head_->Clear();
  assignment_ = a;  // the same shard: only the id, the group names and the collective timeout change
  return JoinGroups(RegroupOf(a), store);
}

absl::Status StepExecutor::Execute(const v1::StepPlan& plan, v1::StepResult* result) {
  const auto start = std::chrono::steady_clock::now();
  result->Clear();
  result->set_step_id(plan.step_id());
  result->set_epoch(steps_->epoch());
  for (TimedCommunicator* c : {tp_.get(), recv_.get(), send_.get()}) {
    if (c != nullptr) c->ResetSeconds();
  }
  if ((draft_ != nullptr || head_ != nullptr) && plan.row_feeds_sample_size() > 0) {
    return absl::InvalidArgumentError(absl::StrCat("step ", plan.step_id(),
                                                   " has rows that feed their last sample; this worker's ",
                                                   draft_ != nullptr ? "draft model" : "speculative head",
                                                   " reads the plan's token ids, so it needs every token in them"));
  }
  if ((draft_ != nullptr || head_ != nullptr) && plan.row_num_scored_size() > 0) {
    return absl::InvalidArgumentError(absl::StrCat("step ", plan.step_id(), " scores prompt positions; this worker's ",
                                                   draft_ != nullptr ? "draft model" : "speculative head",
                                                   " reads one logit row per sampled position"));
  }
  SHARDSERVE_RETURN_IF_ERROR(steps_->Prepare(plan));
  if (draft_ != nullptr) {
    SHARDSERVE_RETURN_IF_ERROR(draft_->Apply(plan));
  } else if (head_ != nullptr) {
    SHARDSERVE_RETURN_IF_ERROR(head_->Apply(plan));
  } else if (sampler_ != nullptr && plan.num_draft_tokens() > 0) {
    return absl::InvalidArgumentError(absl::StrCat("step ", plan.step_id(), " asks for ", plan.num_draft_tokens(),
                                                   " draft tokens a row; this worker has no draft model"));
  }
  const StepBatch& batch = steps_->batch();
  const int64_t n = static_cast<int64_t>(batch.positions.size());
  const uint64_t launches_before = backend_->kernel_launches();

  // The previous stage's output is this stage's input.
  // With an EAGLE-3 head, the hidden states kept at its layers travel with it (aux_hidden).
  Tensor hidden = shard_->hidden(n), aux = shard_->aux_hidden(n);
  if (recv_ != nullptr) {
    SHARDSERVE_RETURN_IF_ERROR(recv_->Recv(&hidden, 0));
    if (aux.data != nullptr) SHARDSERVE_RETURN_IF_ERROR(recv_->Recv(&aux, 0));
  }
  SHARDSERVE_RETURN_IF_ERROR(shard_->Forward(batch));
  if (send_ != nullptr) {
    SHARDSERVE_RETURN_IF_ERROR(send_->Send(hidden, 1));
    if (aux.data != nullptr) SHARDSERVE_RETURN_IF_ERROR(send_->Send(aux, 1));
  }
  if (sampler_ != nullptr && !batch.logit_rows.empty()) {
    const Tensor logits = shard_->logits(static_cast<int64_t>(batch.logit_rows.size()));
    SHARDSERVE_RETURN_IF_ERROR(CheckTokenMasks(plan, static_cast<int64_t>(batch.logit_rows.size()),
                                               sampler_->vocab_size(), &token_masks_));
    SHARDSERVE_RETURN_IF_ERROR(sampler_->Sample(plan.step_id(), logits, steps_->sampling(), result, token_masks_));
    // The samples later rows may feed (StepPlan.row_feeds_sample): a group's only worker keeps its
    // own; the ranks of a TP group keep those a share_samples step gives each of them (below).
    if (assignment_.tp_size() == 1) steps_->RecordSamples(result->sampled_ids());
    // The draft's guesses for these sequences' next step, in this step.
    if (draft_ != nullptr) {
      SHARDSERVE_RETURN_IF_ERROR(draft_->Propose(plan, result->sampled_ids(), result->mutable_draft_ids()));
    }
  }
  if (plan.share_samples() && !batch.logit_rows.empty()) {
    SHARDSERVE_RETURN_IF_ERROR(ShareSamples(plan.step_id(), static_cast<int64_t>(batch.logit_rows.size()), *result));
  }
  // The multi-token-prediction layer follows every step (its pairs need this step's hidden states),
  // and guesses for the sequences that sampled.
  if (head_ != nullptr && n > 0) {
    SHARDSERVE_RETURN_IF_ERROR(head_->Propose(plan, result->sampled_ids(), result->mutable_draft_ids()));
  }

  double collective = 0;
  for (TimedCommunicator* c : {tp_.get(), recv_.get(), send_.get()}) {
    if (c != nullptr) collective += c->seconds();
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  last_step_kernel_launches_ = backend_->kernel_launches() - launches_before;
  result->set_collective_seconds(collective);
  result->set_forward_seconds(std::max(0.0, total - collective));
  return absl::OkStatus();
}

absl::Status StepExecutor::ShareSamples(uint64_t step_id, int64_t rows, const v1::StepResult& result) {
  if (assignment_.tp_size() == 1) return absl::OkStatus();  // its only worker kept its own (Execute)
  if (shared_ids_.data() == nullptr || rows > static_cast<int64_t>(shared_ids_.bytes() / sizeof(int32_t))) {
    return absl::InternalError(absl::StrCat("step ", step_id, " shares ", rows, " samples; this worker has room for ",
                                            shared_ids_.bytes() / sizeof(int32_t)));
  }
  shared_.Resize(static_cast<int>(rows), 0);
  if (sampler_ != nullptr) {
    if (result.sampled_ids_size() != rows) {
      return absl::InternalError(absl::StrCat("step ", step_id, " sampled ", result.sampled_ids_size(), " ids for ",
                                              rows, " logit rows"));
    }
    std::copy(result.sampled_ids().begin(), result.sampled_ids().end(), shared_.begin());
  } else {
    std::fill(shared_.begin(), shared_.end(), 0);
  }
  // Rank 0's ids, the other ranks adding zeros: an all-reduce every communicator has, on the
  // device's memory as the forward pass's.
  Tensor ids = shared_ids_.View(DType::kI32, {rows});
  const size_t bytes = static_cast<size_t>(rows) * sizeof(int32_t);
  SHARDSERVE_RETURN_IF_ERROR(backend_->CopyToDevice(ids.data, shared_.data(), bytes));
  SHARDSERVE_RETURN_IF_ERROR(tp_->AllReduceSum(&ids));
  SHARDSERVE_RETURN_IF_ERROR(backend_->CopyToHost(shared_.mutable_data(), ids.data, bytes));
  steps_->RecordSamples(shared_);
  return absl::OkStatus();
}

}  // namespace shardserve
