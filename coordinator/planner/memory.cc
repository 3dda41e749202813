#include "coordinator/planner/memory.h"

#include <algorithm>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "coordinator/planner/planner.h"
#include "model/families/registry.h"
#include "model/kv_blocks.h"

namespace shardserve {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// cuBLAS's workspace. kernels/cuda/cuda_backend.cu makes one cublasHandle_t per worker and sets no
// workspace (no cublasSetWorkspace), so cuBLAS allocates its default pool on the first GEMM: the
// cuBLAS documentation (cublasSetWorkspace) gives 32 MiB on Hopper (sm_90) and 4 MiB on the
// architectures before it. Names we cannot place (a worker's "cuda:0") get the larger figure.
constexpr uint64_t kCublasWorkspaceHopper = 32 * kMiB;
constexpr uint64_t kCublasWorkspaceOlder = 4 * kMiB;
// The names of the GPUs before Hopper (presets and nvidia-smi's), by prefix after any "NVIDIA ".
constexpr const char* kBeforeHopper[] = {"A100", "A10", "A30", "A40", "L40", "L4", "V100", "T4"};

// The CUDA context: a worker's device memory in use once its backend exists (cudaMemGetInfo's
// total less free, the worker's `memory cuda_context` line), before any kernel has run: 623,706,112 B
// (594.8 MiB) on an H200 in every run measured (driver 580.159.04, CUDA 13; the 8B in bf16 and int4,
// the whole 72B in int4; 2026-11-27 and 2026-11-28). Taken for Hopper and for the names we cannot
// place (a served cluster's workers register as "cuda:K"), as cuBLAS's workspace is; not yet
// measured on an H100. Before Hopper: unmeasured, the context stays what the reserve's named items
// leave.
constexpr uint64_t kCudaContextHopper = 623'706'112;

// The quantized products' dequantize scratch (kernels/cuda/quant_matmul.cu) is the backend's own
// figure: CudaDequantScratchBytes (kernels/backend.h) of the worker's largest quantized weight, which
// the backend allocates as it stores the weights (GpuPlan::dequant_scratch_bytes, from weights.cc).
// It is counted whenever a CUDA plan holds quantized weights: without the kernels
// (--no-cuda-quantized-kernels) such a worker refuses to load, so no running plan goes without it.

// CUDA graph pools: 0. The step graphs (on by default in the worker since they passed on an H200,
// 2026-11-28; --no-cuda-graphs) record ops on buffers the shard allocated at load and allocate none
// during a recording (cudaMalloc is refused there); what the driver keeps per instantiated graph
// (its nodes, and any workspace cuBLAS takes with cudaMallocAsync while recorded) is unmeasured:
// the worker's memory lines are taken at load, before the first graph is recorded.
constexpr uint64_t kCudaGraphPoolBytes = 0;

// NCCL's buffers per communicator, an estimate until a GPU run measures it (the worker logs the
// cudaMemGetInfo delta of its group joins beside it): NCCL_BUFFSIZE's default 4 MiB (the SIMPLE
// protocol's buffer per peer and channel, NCCL's environment documentation) x 2 ring peers x 16
// channels, which NCCL opens between NVLink-connected GPUs. worker/comm/nccl_communicator.cc sets
// no buffer size (NCCL_CONFIG_INITIALIZER) and allocates 4 bytes of its own.
constexpr uint64_t kNcclBufferBytes = 4 * kMiB;
constexpr uint64_t kNcclPeers = 2;
constexpr uint64_t kNcclChannels = 16;
constexpr uint64_t kNcclBytesPerCommunicator = kNcclBufferBytes * kNcclPeers * kNcclChannels;

// A CPU worker process's own anonymous memory beside its buffers: /proc/PID/status RssAnon less the
// worker's weights, KV cache and step buffers (all resident from the load on), at its peak while
// serving 64 requests of 512 + 32 tokens, 32 at a time (AMD EPYC Zen 4 VM, 2 CPUs, 2026-12-06;
// oneDNN's scratch and primitives, gRPC, threads), two rounds each: 10-22 MiB on the Llama, Qwen3
// and Gemma 3 bench models with bf16 products, 21-37 MiB with float32 ones, 38 MiB on the Qwen3-MoE
// one (bf16, 128 experts; tools/fixtures/make_bench_model.py). The worker has the allocator return
// what it frees at once (base/resource_limits.h ReturnFreedMemoryPromptly): with glibc's defaults
// the same runs kept 11-62 MiB and 91-101 MiB. cuBLAS, which CUDA builds open only for a CUDA
// backend (kernels/cuda/cublas_api.h), is not in it. The figure leaves half again above the largest;
// the worker logs its own beside it (`memory process`).
constexpr uint64_t kCpuWorkerProcessBytes = 64 * kMiB;

bool BeforeHopper(const GpuSpec& gpu) {
  std::string name = absl::AsciiStrToUpper(gpu.name);
  if (absl::StartsWith(name, "NVIDIA ")) name = name.substr(7);
  for (const char* older : kBeforeHopper) {
    if (absl::StartsWith(name, older)) return true;
  }
  return false;
}

}  // namespace

uint64_t CpuWorkerProcessBytes() { return kCpuWorkerProcessBytes; }

uint64_t CublasWorkspaceBytes(const GpuSpec& gpu) {
  if (gpu.is_cpu()) return 0;
  // Hopper (H100, H200, GH200) and the names we cannot place get the larger figure.
  return BeforeHopper(gpu) ? kCublasWorkspaceOlder : kCublasWorkspaceHopper;
}

uint64_t CudaContextBytes(const GpuSpec& gpu) {
  if (gpu.is_cpu() || BeforeHopper(gpu)) return 0;
  return kCudaContextHopper;
}

int NcclCommunicators(int tp, int pp, int stage) {
  return (tp > 1 ? 1 : 0) + (stage > 0 ? 1 : 0) + (stage + 1 < pp ? 1 : 0);
}

RuntimeMemory SplitRuntimeReserve(const GpuSpec& gpu, int tp, int pp, int stage, uint64_t reserve_bytes,
                                  uint64_t dequant_scratch_bytes) {
  RuntimeMemory r;
  if (gpu.is_cpu()) {  // no CUDA: the reserve is the process's own
    r.process = reserve_bytes;
    return r;
  }
  r.cublas_workspace = CublasWorkspaceBytes(gpu);
  r.dequant_scratch = dequant_scratch_bytes;
  r.cuda_graph_pools = kCudaGraphPoolBytes;
  r.nccl_buffers = static_cast<uint64_t>(NcclCommunicators(tp, pp, stage)) * kNcclBytesPerCommunicator;
  // The context and the slack take the rest: the measured context first (CudaContextBytes), else all
  // of it. When the named items exceed the reserve, both are 0 and "free" shows the overdraft.
  const uint64_t named = r.cublas_workspace + r.dequant_scratch + r.cuda_graph_pools + r.nccl_buffers;
  const uint64_t rest = reserve_bytes > named ? reserve_bytes - named : 0;
  const uint64_t context = CudaContextBytes(gpu);
  r.cuda_context = context > 0 ? std::min(context, rest) : rest;
  r.runtime_slack = rest - r.cuda_context;
  return r;
}

uint64_t DeclaredBytes(const std::vector<StepBufferDecl>& buffers) {
  uint64_t bytes = 0;
  for (const StepBufferDecl& b : buffers) {
    uint64_t elements = 1;
    for (int64_t d : b.dims) elements *= static_cast<uint64_t>(d);
    bytes += elements * DTypeSize(b.dtype);
  }
  return bytes;
}

int64_t AuxLayers(const PlanOptions& options) {
  return options.eagle3.has_value() && options.eagle3->eagle3.has_value() ? options.eagle3->eagle3->num_aux() : 0;
}

uint64_t StepBufferBytes(const ModelConfig& c, const TpShard& s, DType act_dtype, const StepLimits& limits,
                         bool last_stage, int64_t aux_layers) {
  return DeclaredBytes(StepBuffers(c, s, act_dtype, limits, last_stage)) +
         DeclaredBytes(AuxHiddenBuffers(c, aux_layers, act_dtype, limits));
}

SequenceKv SequenceKvBytes(const ModelConfig& config, int64_t first_layer, int64_t end_layer, int64_t kv_heads,
                           DType dtype, int64_t context, int64_t block_size, int64_t chunk) {
  // One token's entry in one layer: K and V of the rank's KV heads, or latent attention's latent
  // and RoPE key, whole on every rank (ModelConfig::KvValuesPerToken).
  const uint64_t per_token = static_cast<uint64_t>(config.KvValuesPerToken(kv_heads)) * DTypeSize(dtype);
  const uint64_t per_block = per_token * static_cast<uint64_t>(block_size);
  const uint64_t all = static_cast<uint64_t>(KvBlocksFor(context, block_size)) * per_block;
  SequenceKv kv;
  for (int64_t i = first_layer; i < end_layer; ++i) {
    const int64_t window = config.LayerWindow(i);
    if (window == 0) {
      kv.full_layers_bytes += all;
    } else {
      kv.sliding_layers_bytes += static_cast<uint64_t>(KvBlocksHeld(window, chunk, context, block_size)) * per_block;
      kv.sliding_layers_full_context_bytes += all;
    }
  }
  return kv;
}

int64_t PlannedSlidingBlocks(const ModelConfig& config, const StepLimits& limits, int64_t num_kv_blocks,
                             int64_t target_len) {
  const int64_t len = std::min(target_len, num_kv_blocks * limits.block_size);
  return SlidingPoolBlocks(config, num_kv_blocks, len, limits.max_tokens_per_step, limits.block_size,
                           limits.max_seqs_per_step);
}

uint64_t GpuKvBytes(const GpuPlan& g, int64_t num_kv_blocks, int64_t num_sliding_kv_blocks, int64_t block_size) {
  return (g.kv_bytes_per_token * static_cast<uint64_t>(num_kv_blocks) +
          g.sliding_kv_bytes_per_token * static_cast<uint64_t>(num_sliding_kv_blocks)) *
         static_cast<uint64_t>(block_size);
}

uint64_t DraftKvBytes(const GpuPlan& g, const StepLimits& limits, int64_t num_kv_blocks) {
  if (g.draft_kv_bytes_per_token == 0) return 0;
  StepLimits model = limits;
  model.num_kv_blocks = num_kv_blocks;
  const StepLimits draft = DraftStepLimits(model);
  return g.draft_kv_bytes_per_token * static_cast<uint64_t>(draft.num_kv_blocks * draft.block_size);
}

HeadMemory HeadBytes(const ModelConfig& head, const GpuPlan& g, DType act, const StepLimits& limits) {
  HeadMemory m;
  absl::StatusOr<TpShard> whole = ComputeTpShard(head, 0, 1);
  // (MakePlan computed the whole shard already: a head it plans has one)
  if (g.head_weight_bytes == 0 || !whole.ok()) return m;
  const StepLimits mtp = HeadStepLimits(limits);
  m.weights = g.head_weight_bytes;
  // One layer's cache, in one pool (HeadStepLimits has no sliding pool).
  m.kv_cache = static_cast<uint64_t>(head.KvValuesPerToken(whole->kv_heads)) * DTypeSize(act) *
               static_cast<uint64_t>(mtp.num_kv_blocks * mtp.block_size);
  // Its shard ends in logits, as a last stage's does (ModelShard::is_last_stage).
  m.buffers = StepBufferBytes(head, *whole, act, mtp, /*last_stage=*/true) +
              DeclaredBytes(HeadStepBuffers(head, act, mtp)) + DeclaredBytes(Eagle3StepBuffers(head, act, mtp)) +
              DeclaredBytes(HeadRunnerBuffers(head, act, limits));
  return m;
}

int64_t MostKvBlocks(const ModelConfig& config, const GpuPlan& g, const StepLimits& limits, int64_t target_len,
                     int64_t bytes, int64_t cap) {
  StepLimits served = limits;
  served.max_model_len = target_len;
  const auto fits = [&](int64_t blocks) {
    const int64_t sliding = PlannedSlidingBlocks(config, limits, blocks, target_len);
    return GpuKvBytes(g, blocks, sliding, limits.block_size) + DraftKvBytes(g, served, blocks) <=
           static_cast<uint64_t>(std::max<int64_t>(bytes, 0));
  };
  // The cache grows with the blocks (PlannedSlidingBlocks is monotone): the largest that fits.
  int64_t lo = 0, hi = std::max<int64_t>(cap, 0);
  if (fits(hi)) return hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

std::vector<MemoryItem> GpuMemoryItems(const ModelConfig& config, const Plan& plan, const GpuPlan& g) {
  const GpuSpec& gpu = plan.cluster.gpu;
  const StagePlan& stage = plan.stages[g.stage];
  absl::StatusOr<TpShard> shard = ComputeTpShard(config, g.tp_rank, plan.tp, plan.options.expert_parallel);
  const uint64_t step =
      shard.ok() ? StepBufferBytes(config, *shard, plan.dtype, plan.limits, stage.lm_head, AuxLayers(plan.options)) : 0;
  const uint64_t kv =
      GpuKvBytes(g, plan.limits.num_kv_blocks, plan.limits.num_sliding_kv_blocks, plan.limits.block_size);
  const RuntimeMemory r = SplitRuntimeReserve(gpu, plan.tp, plan.pp, g.stage, g.reserve_bytes, g.dequant_scratch_bytes);
  // A draft model or a head, on the worker that samples (a head's at the plan's limits exactly as its
  // runner allocates: HeadBytes).
  const ModelConfig& head = plan.options.eagle3.has_value() ? *plan.options.eagle3 : config;
  const uint64_t beside = plan.options.mtp || plan.options.eagle3.has_value()
                              ? HeadBytes(head, g, plan.dtype, plan.limits).total()
                              : g.draft_bytes + DraftKvBytes(g, plan.limits, plan.limits.num_kv_blocks);
  const int64_t used = static_cast<int64_t>(g.weight_bytes + kv + step + beside + r.total());
  const int64_t usable = static_cast<int64_t>(plan.usable_bytes_per_gpu);
  std::vector<MemoryItem> items = {
      {kMemWeights, static_cast<int64_t>(g.weight_bytes)},
      {kMemKvCache, static_cast<int64_t>(kv)},
      {kMemStepBuffers, static_cast<int64_t>(step)},
  };
  if (plan.options.draft.has_value()) items.push_back({kMemDraftModel, static_cast<int64_t>(beside)});
  if (plan.options.mtp) items.push_back({kMemMtpLayer, static_cast<int64_t>(beside)});
  if (plan.options.eagle3.has_value()) items.push_back({kMemEagle3Head, static_cast<int64_t>(beside)});
  if (gpu.is_cpu()) {
    items.push_back({kMemProcess, static_cast<int64_t>(r.process)});
  } else {
    items.push_back({kMemCublasWorkspace, static_cast<int64_t>(r.cublas_workspace)});
    if (r.dequant_scratch > 0) items.push_back({kMemDequantScratch, static_cast<int64_t>(r.dequant_scratch)});
    items.insert(items.end(), {
        {kMemCudaGraphPools, static_cast<int64_t>(r.cuda_graph_pools)},
        {kMemNcclBuffers, static_cast<int64_t>(r.nccl_buffers)},
        {kMemCudaContext, static_cast<int64_t>(r.cuda_context)},
    });
    if (r.runtime_slack > 0) items.push_back({kMemRuntimeSlack, static_cast<int64_t>(r.runtime_slack)});
  }
  items.insert(items.end(), {
      {kMemFree, usable - used},
      {kMemHeldBack, static_cast<int64_t>(gpu.memory_bytes) - usable},
  });
  return items;
}

void FillMemoryItems(const ModelConfig& config, Plan* plan) {
  for (GpuPlan& g : plan->per_gpu) g.memory = GpuMemoryItems(config, *plan, g);
}

}  // namespace shardserve
