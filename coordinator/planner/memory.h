// A device's memory, item by item, as the plan expects it: the worker's own buffers (weights, KV
// cache, step buffers) and what the runtime beside them takes (cuBLAS workspace, the quantized
// products' dequantize scratch, CUDA graph pools, NCCL buffers, the CUDA context), what the plan
// leaves free and what gpu_memory_utilization holds back. The items of one device add up to its
// memory exactly.
//
// `shardserve plan` prints them per GPU; the coordinator sends each worker its own
// (Assignment.planned_memory) and the worker logs every item beside what it allocated or measured
// (worker/step_executor.h), so a GPU run compares them line by line (docs/gpu.md).
//
// Where each runtime figure comes from is said at its constant in memory.cc. Pure functions;
// thread-compatible.
#ifndef SHARDSERVE_COORDINATOR_PLANNER_MEMORY_H_
#define SHARDSERVE_COORDINATOR_PLANNER_MEMORY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/planner/cluster.h"
#include "kernels/tensor.h"
#include "model/config.h"
#include "model/families/declaration.h"
#include "model/sharding.h"
#include "model/step_limits.h"

namespace shardserve {

struct Plan;
struct GpuPlan;
struct PlanOptions;

// The item names, in the order they are listed.
inline constexpr const char* kMemWeights = "weights";
inline constexpr const char* kMemKvCache = "kv_cache";
inline constexpr const char* kMemStepBuffers = "step_buffers";
// Listed only in a plan with a draft model (PlanOptions::draft): its weights, KV cache and step
// buffers, on the last stage's TP rank 0 (0 on every other device).
inline constexpr const char* kMemDraftModel = "draft_model";
// Listed only in a plan with the model's multi-token-prediction layer (PlanOptions::mtp): its
// weights, KV cache, step buffers and hidden rows, on the last stage's TP rank 0 (0 elsewhere).
inline constexpr const char* kMemMtpLayer = "mtp_layer";
// Listed only in a plan with an EAGLE-3 head (PlanOptions::eagle3): the same, for the head.
inline constexpr const char* kMemEagle3Head = "eagle3_head";
inline constexpr const char* kMemCublasWorkspace = "cublas_workspace";
// Listed only where it is not 0: quantized weights on CUDA (GpuPlan::dequant_scratch_bytes).
inline constexpr const char* kMemDequantScratch = "dequant_scratch";
inline constexpr const char* kMemCudaGraphPools = "cuda_graph_pools";
inline constexpr const char* kMemNcclBuffers = "nccl_buffers";
inline constexpr const char* kMemCudaContext = "cuda_context";
// Listed only where it is not 0: what the reserve holds beyond a measured CUDA context.
inline constexpr const char* kMemRuntimeSlack = "runtime_slack";
// CPU workers' instead of the CUDA items: the worker process's own memory beside its buffers (the
// libraries' data, threads, gRPC, oneDNN's scratch: PlanOptions::runtime_reserve_bytes, which the
// coordinator sets to CpuWorkerProcessBytes) and the largest weight it reads whole in float32 while
// loading (GpuPlan::load_staging_bytes).
inline constexpr const char* kMemProcess = "process";
inline constexpr const char* kMemFree = "free";
inline constexpr const char* kMemHeldBack = "held_back";

struct MemoryItem {
  std::string name;  // one of the kMem* names
  int64_t bytes = 0;  // >= 0, except "free" on a device the plan overfills
};

// The runtime's share of PlanOptions::runtime_reserve_bytes on one device, by item. Where the
// context is measured (CudaContextBytes) it is that figure and runtime_slack the rest of the reserve
// (the kernel modules CUDA loads at their first launch, ours and cuBLAS's, and the allocator's
// slack: not measured item by item); elsewhere the context is what the named items leave. On a CPU
// worker all of it is the process's own (kMemProcess).
struct RuntimeMemory {
  uint64_t cublas_workspace = 0;
  uint64_t dequant_scratch = 0;
  uint64_t cuda_graph_pools = 0;
  uint64_t nccl_buffers = 0;
  uint64_t cuda_context = 0;
  uint64_t runtime_slack = 0;
  uint64_t process = 0;
  uint64_t total() const {
    return cublas_workspace + dequant_scratch + cuda_graph_pools + nccl_buffers + cuda_context + runtime_slack +
           process;
  }
};

// A CPU worker process's own anonymous memory beside its weights, KV cache and step buffers, as
// measured (memory.cc says where): the reserve the coordinator plans CPU workers with.
uint64_t CpuWorkerProcessBytes();

// The CUDA context of a worker on `gpu` as measured (memory.cc says where), or 0 where none is.
uint64_t CudaContextBytes(const GpuSpec& gpu);

// cuBLAS's default workspace for `gpu` (memory.cc says which figure for which GPU); 0 for CPU workers.
uint64_t CublasWorkspaceBytes(const GpuSpec& gpu);

// NCCL communicators a worker of stage `stage` (of `pp`) in a TP group of `tp` creates on CUDA:
// its TP group when tp > 1, and one pair with each neighbouring stage (worker/step_executor.cc).
int NcclCommunicators(int tp, int pp, int stage);

// The runtime items of one device of `gpu`, splitting `reserve_bytes`; `dequant_scratch_bytes`
// (GpuPlan's) is the backend's own figure, taken as it is. On a CPU worker the reserve (with its
// load staging, GpuPlan::reserve_bytes) is the process's.
RuntimeMemory SplitRuntimeReserve(const GpuSpec& gpu, int tp, int pp, int stage, uint64_t reserve_bytes,
                                  uint64_t dequant_scratch_bytes = 0);

// The bytes of `buffers` as the worker allocates them (registry.h's declarations).
uint64_t DeclaredBytes(const std::vector<StepBufferDecl>& buffers);

// The model's layers whose input hidden states every worker keeps for an EAGLE-3 head
// (PlanOptions::eagle3, ModelConfig::Eagle3::num_aux); 0 without one.
int64_t AuxLayers(const PlanOptions& options);

// The bytes of the buffers one step works in, which the worker allocates at load for `limits`: the
// family's declared step buffers (model/families/registry.h StepBuffers), and where it keeps the
// model's hidden states at `aux_layers` layers for an EAGLE-3 head, those (AuxHiddenBuffers).
uint64_t StepBufferBytes(const ModelConfig& config, const TpShard& shard, DType act, const StepLimits& limits,
                         bool last_stage, int64_t aux_layers = 0);

// The KV cache one sequence of `context` tokens holds in layers [first_layer, end_layer) of
// `config`, with `kv_heads` KV heads each (the TP shard's) in `dtype`, in blocks of `block_size`,
// fed in steps of at most `chunk` tokens (max_tokens_per_step).
struct SequenceKv {
  // Full-attention layers: the blocks of the whole context.
  uint64_t full_layers_bytes = 0;
  // Sliding-window layers (ModelConfig::LayerWindow), keeping only the blocks their window and a
  // step need (model/kv_blocks.h KvBlocksHeld), as the coordinator's scheduler lets the rest go.
  uint64_t sliding_layers_bytes = 0;
  // The same sliding layers counted at the whole context, as they would hold without a pool of
  // their own.
  uint64_t sliding_layers_full_context_bytes = 0;
  uint64_t bytes() const { return full_layers_bytes + sliding_layers_bytes; }
  uint64_t full_context_bytes() const { return full_layers_bytes + sliding_layers_full_context_bytes; }
};
SequenceKv SequenceKvBytes(const ModelConfig& config, int64_t first_layer, int64_t end_layer, int64_t kv_heads,
                           DType dtype, int64_t context, int64_t block_size, int64_t chunk);

// The sliding layers' pool the plan gives a model whose sliding layers sit beside full-attention
// ones (model/kv_blocks.h SlidingPoolBlocks) beside a full pool of `num_kv_blocks`, for sequences of
// up to min(target_len, num_kv_blocks x block_size) tokens fed limits.max_tokens_per_step at a time,
// limits.max_seqs_per_step at once; 0 for other models.
int64_t PlannedSlidingBlocks(const ModelConfig& config, const StepLimits& limits, int64_t num_kv_blocks,
                             int64_t target_len);

// The KV cache device `g` allocates: its full-attention pool of `num_kv_blocks` blocks of
// `block_size` (g.kv_bytes_per_token a token) and its sliding layers' pool of `num_sliding_kv_blocks`
// (g.sliding_kv_bytes_per_token a token).
uint64_t GpuKvBytes(const GpuPlan& g, int64_t num_kv_blocks, int64_t num_sliding_kv_blocks, int64_t block_size);

// The KV cache of a draft model on `g` (0 without one) beside a model's cache of `num_kv_blocks`
// blocks within `limits`: DraftStepLimits' blocks at g.draft_kv_bytes_per_token a token.
uint64_t DraftKvBytes(const GpuPlan& g, const StepLimits& limits, int64_t num_kv_blocks);

// A head over the model's hidden states on `g` (0 where g.head_weight_bytes is 0: not the worker
// that runs it) for a model served within `limits`, in `act`, as worker/head_runner.h allocates it:
// `head` is the config of the layer that runs, the model's for its multi-token-prediction layer or an
// EAGLE-3 head's own. g.head_weight_bytes, a KV cache of one layer in HeadStepLimits' pool (latent
// attention's latent rows, whole; the pool follows the model's blocks, limits.num_kv_blocks, as a
// draft model's), its shard's step buffers (StepBuffers, HeadStepBuffers and an EAGLE-3 head's
// Eagle3StepBuffers, whole, for HeadStepLimits) and the runner's (HeadRunnerBuffers).
struct HeadMemory {
  uint64_t weights = 0;
  uint64_t kv_cache = 0;
  uint64_t buffers = 0;  // the shard's step buffers and the runner's
  uint64_t total() const { return weights + kv_cache + buffers; }
};
HeadMemory HeadBytes(const ModelConfig& head, const GpuPlan& g, DType act, const StepLimits& limits);

// The most full-pool blocks, at most `cap`, whose KV cache on `g` with its planned sliding pool
// (PlannedSlidingBlocks) and a draft model's blocks beside them (DraftKvBytes) fits in `bytes`.
int64_t MostKvBlocks(const ModelConfig& config, const GpuPlan& g, const StepLimits& limits, int64_t target_len,
                     int64_t bytes, int64_t cap);

// One device's items in the plan: g.weight_bytes, the KV cache the workers allocate
// (plan.limits.num_kv_blocks blocks and num_sliding_kv_blocks for the sliding layers, the same on
// every device: GpuKvBytes), the step buffers for plan.limits, a draft model, the
// multi-token-prediction layer or an EAGLE-3 head where the plan has one (HeadBytes at plan.limits), the runtime
// items (the dequantize scratch only where g has one; on CPU workers the process alone), what is left
// free of the usable memory and what gpu_memory_utilization holds back. They sum to
// plan.cluster.gpu.memory_bytes.
std::vector<MemoryItem> GpuMemoryItems(const ModelConfig& config, const Plan& plan, const GpuPlan& g);

// Sets every GpuPlan::memory of `plan` from its current limits (MakePlan does; the coordinator
// again after it changes the KV cache or max_model_len).
void FillMemoryItems(const ModelConfig& config, Plan* plan);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_PLANNER_MEMORY_H_
