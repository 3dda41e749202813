// The planner: how a model is split over a cluster. It chooses the tensor-parallel degree (TP,
// inside one node, dividing the attention heads) and the pipeline-parallel degree (PP, stages of
// consecutive layers, across nodes), gives each stage its layers, and says per GPU how many bytes
// of weights it holds and how many tokens of KV cache fit beside them. A roofline estimate of one
// decode step (weights read from HBM, all-reduces, stage-to-stage hops) ranks the layouts that fit.
// docs/planner.md explains the memory math and the cost model with worked numbers.
//
// Used by the coordinator (with the registered workers grouped by node) and by `shardserve plan`.
// Everything here is a pure function of its inputs; thread-compatible.
#ifndef SHARDSERVE_COORDINATOR_PLANNER_PLANNER_H_
#define SHARDSERVE_COORDINATOR_PLANNER_PLANNER_H_

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/planner/cluster.h"
#include "coordinator/planner/memory.h"
#include "kernels/quant.h"
#include "kernels/tensor.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/step_limits.h"

namespace shardserve {

// The step limits a plan is made for when none are given (`shardserve plan` without
// --max-tokens-per-step / --max-seqs-per-step): steps of 2048 tokens and 256 sequences, four times
// the server's defaults (StepLimits' 512 and 64, the coordinator's flags), so that a layout that
// fits holds the step buffers of any server up to those limits. The coordinator plans with its own.
inline constexpr StepLimits kPlanningStepLimits{.max_tokens_per_step = 2048, .max_seqs_per_step = 256};

struct PlanOptions {
  // Fraction of each GPU's memory the worker may use, in (0, 1]; the rest is left to others.
  double gpu_memory_utilization = 0.9;
  // Force a layout (0: the planner chooses).
  int tp = 0;
  int pp = 0;
  // Dtype of weights, activations and KV cache on the GPU. Unset: config.json's torch_dtype.
  std::optional<DType> dtype;
  // How the linear layers' weights are stored (kernels/quant.h): quantized weights need fewer bytes.
  WeightQuant weight_quant = WeightQuant::kNone;
  // CPU workers that store the model's products' weights in another dtype than `dtype` (bf16: worker
  // --matmul-dtype, Register.cpu_matmul): those weights counted in it, except the quantized ones and a
  // tied embedding and LM head's table (the CPU keeps it in float32 panels); a draft model's and a
  // head's (MTP layer, EAGLE-3) likewise, which the workers pack through the same backend. Unset: `dtype`.
  std::optional<DType> products_dtype;
  // Expert parallelism (model/sharding.h): each TP rank holds whole experts, a block of them, which
  // changes every rank's weight bytes and step buffers. Refused for a model without experts.
  bool expert_parallel = false;
  // Sequences in the decode step the layouts are ranked by (1 to 4096): a mixture of experts reads
  // the experts its tokens choose, more of them the larger the batch (DecodeEstimate).
  int decode_batch = 1;
  // The step limits the workers are sized for (model/step_limits.h): max_tokens_per_step and
  // max_seqs_per_step size their step buffers (worker/shard/model_shard.h), block_size cuts the KV
  // cache. max_model_len is the longest sequence (prompt + output) to serve, and the KV cache must
  // hold one; 0: the model's max_position_embeddings, lowered to what the KV cache holds when no
  // layout holds that many (but not below 2048 tokens, or the model's maximum when that is
  // smaller). num_kv_blocks is the plan's to decide: ignored here. Plan::limits is these with the
  // last two decided.
  StepLimits limits = kPlanningStepLimits;
  // Memory a GPU process uses beyond the worker's own buffers: CUDA context, cuBLAS workspace,
  // NCCL buffers, allocator slack.
  uint64_t runtime_reserve_bytes = uint64_t{1} << 30;
  // Speculative decoding's draft model (--draft-model; worker/draft_runner.h): a whole model beside
  // the last stage's TP rank 0, in `dtype`, with its step buffers and a KV cache of as many blocks
  // as the model's and room for every sequence's guesses (model/step_limits.h DraftStepLimits).
  // Its vocabulary must be the model's. Unset: none.
  std::optional<ModelConfig> draft;
  // Speculative decoding with the model's own multi-token-prediction layer (--speculative mtp;
  // worker/head_runner.h): the layer whole beside the last stage's TP rank 0, its weights as that
  // worker loads them (`weight_quant`, or the checkpoint's format), its step buffers and hidden rows,
  // and a KV cache of one layer beside the model's, as a draft model's (memory.h HeadBytes).
  // Refused for a model without the layer, and beside a draft model.
  bool mtp = false;
  // Speculative decoding with an EAGLE-3 head (--speculative eagle3 --draft-model HEAD; its
  // config.json, ModelConfig::eagle3 set): the head whole beside the last stage's TP rank 0, as
  // worker/head_runner.h LoadEagle3 loads it (its weights as `weight_quant`, the model's embedding
  // where it has none, its step buffers and hidden rows, a KV cache of one layer as the MTP layer's:
  // memory.h HeadBytes), and on every worker the model's hidden states at the head's layers
  // (registry.h AuxHiddenBuffers, in the step buffers). Refused where it does not fit the model
  // (Eagle3AuxLayers, hidden size), and beside a draft model or the MTP layer. Unset: none.
  std::optional<ModelConfig> eagle3;
};

// One pipeline stage: consecutive layers on one TP group inside one node.
struct StagePlan {
  int64_t first_layer = 0;  // inclusive
  int64_t last_layer = 0;   // inclusive
  int node = 0;
  int first_gpu = 0;       // GPU index inside the node of TP rank 0; rank r uses first_gpu + r
  bool embedding = false;  // holds embed_tokens (the first stage)
  bool lm_head = false;    // holds the final norm and the LM head (the last stage)
  int64_t num_layers() const { return last_layer - first_layer + 1; }
};

// One GPU's share. Memory: weight + activation + reserve + kv_bytes_per_token x KV tokens (+
// sliding_kv_bytes_per_token x the sliding pool's tokens) <= the usable memory
// (gpu_memory_utilization x total).
struct GpuPlan {
  int stage = 0;
  int tp_rank = 0;
  int node = 0;
  int gpu = 0;                      // index inside the node
  uint64_t weight_bytes = 0;        // this rank's slice of the stage's weights
  uint64_t expert_weight_bytes = 0; // of which routed experts' products (0 for a dense model)
  uint64_t activation_bytes = 0;    // the worker's step buffers (hidden states, q/k/v, MLP, logits)
  // PlanOptions::runtime_reserve_bytes, and on a CPU worker its load_staging_bytes beside it
  uint64_t reserve_bytes = 0;
  // Of the reserve, on a CPU worker: the host memory in flight beyond its weights while it loads
  // (RankWeights::LoadStaging); 0 on CUDA, whose host memory the plan does not count.
  uint64_t load_staging_bytes = 0;
  // Of the reserve, on CUDA with quantized weights: the backend's dequantize scratch for its
  // products above 8 rows (the largest of its weights' CudaDequantScratchBytes, kernels/backend.h);
  // 0 on the CPU and for plain weights.
  uint64_t dequant_scratch_bytes = 0;
  uint64_t kv_bytes_per_token = 0;  // 2 (K, V) x stage layers x local KV heads x head_dim x dtype
  // Where the sliding layers have a pool of their own (model/kv_blocks.h InSlidingPool), the same
  // for those layers, which kv_bytes_per_token then leaves out; 0 otherwise.
  uint64_t sliding_kv_bytes_per_token = 0;
  // Tokens of the full pool the memory left after the above holds, beside its sliding pool
  // (memory.h MostKvBlocks).
  int64_t kv_cache_tokens = 0;
  // Speculative decoding's draft model (or a head: head_weight_bytes), on the last stage's TP
  // rank 0 (0 elsewhere): its weights and step buffers; then its KV cache's bytes per token, of a
  // pool sized from the model's (memory.h DraftKvBytes).
  uint64_t draft_bytes = 0;
  uint64_t draft_kv_bytes_per_token = 0;
  // A head over the model's hidden states, the multi-token-prediction layer (PlanOptions::mtp) or an
  // EAGLE-3 head (PlanOptions::eagle3), on the last stage's TP rank 0 (0 elsewhere): its weights. It
  // is planned as a draft model (draft_bytes its weights and buffers, draft_kv_bytes_per_token its
  // cache's; memory.h HeadBytes).
  uint64_t head_weight_bytes = 0;
  int64_t shortfall_bytes = 0;      // > 0: bytes missing for weights, buffers, reserve and one sequence
  // The device's memory item by item for the plan's limits (coordinator/planner/memory.h): they
  // add up to the GPU's memory.
  std::vector<MemoryItem> memory;
};

// Roofline of one decode step of `batch` sequences through every stage in turn (seconds): the
// weights read and the traffic between GPUs; the KV cache's reads are not counted.
//
// A mixture of experts reads, in each sparse layer, only the experts its tokens choose: with k of E
// experts a token and routing taken as uniform, an expert is chosen by none of B tokens with
// probability (1 - k/E)^B, so a step reads E x (1 - (1 - k/E)^B) distinct experts a layer on
// average (k at batch 1; nearly all of them at large batches), on every rank alike whether the
// experts are cut over TP or held whole (expert parallelism).
struct DecodeEstimate {
  int batch = 1;
  int64_t experts = 0;       // a sparse layer's experts (0: a dense model)
  double experts_read = 0;   // of which a step reads, on average
  double weights_s = 0;      // each stage's largest bytes read / HBM bandwidth, summed over stages
  // TP all-reduces (2 per layer, 1 for the embedding) and the logits all-gather; with expert
  // parallelism a sparse layer's MLP all-reduce is its exchange instead: the tokens' hidden states
  // to their experts' ranks and back (two all-to-alls) and one all-gather.
  double collectives_s = 0;
  double transfers_s = 0;    // the hidden states from each stage to the next
  double total_s() const { return weights_s + collectives_s + transfers_s; }
};

// One (TP, PP) layout the planner weighed.
struct LayoutOption {
  int tp = 0;
  int pp = 0;
  bool fits = false;
  int64_t max_model_len = 0;      // what it serves when it fits
  int64_t kv_cache_tokens = 0;    // the smallest GPU capacity, whole blocks
  uint64_t max_weight_bytes = 0;  // the largest GPU's weights
  int64_t shortfall_bytes = 0;    // the largest GPU's, when it does not fit
  double decode_step_s = 0;
  std::string note;  // why it fits or not, in a few words
};

struct Plan {
  // ---- The model and the inputs ----
  std::string architecture;  // "Qwen2ForCausalLM"
  std::string weights_from;  // "config.json" or "checkpoint <dir>"
  int64_t num_layers = 0;
  int64_t parameters = 0;
  int64_t active_parameters = 0;  // what one token reads: == parameters but for a mixture of experts
  uint64_t model_weight_bytes = 0;  // the whole model, unsharded, in `dtype`
  // Bytes of the checkpoint's tensors that are not served (a multimodal model's vision tower and
  // projector: only its text model runs); 0 without a checkpoint.
  uint64_t unserved_checkpoint_bytes = 0;
  // Bytes of its layers after the model's (a multi-token-prediction layer) when the plan does not
  // load them (no --speculative mtp); 0 without a checkpoint.
  uint64_t unserved_layer_bytes = 0;
  DType dtype = DType::kBF16;             // what the workers hold weights, activations and KV cache in
  DType checkpoint_dtype = DType::kBF16;  // config.json's torch_dtype
  // A published quantized checkpoint's linear layers as counted (model/quantized_checkpoint.h), e.g.
  // "GPTQ 4-bit as int4 groups of 128", "FP8 e4m3 dequantized to float32"; empty for plain checkpoints.
  std::string checkpoint_quant;
  // How the routed experts' products are counted where they differ from the linear layers: "mxfp4"
  // for gpt-oss's MXFP4 experts kept as published (ModelConfig::mxfp4_experts, without
  // --quantization); empty otherwise.
  std::string experts_format;
  ClusterSpec cluster;
  PlanOptions options;
  uint64_t usable_bytes_per_gpu = 0;  // gpu_memory_utilization x memory

  // ---- The chosen layout (the closest one when nothing fits) ----
  int tp = 1;
  int pp = 1;
  std::vector<StagePlan> stages;
  std::vector<GpuPlan> per_gpu;  // stage-major: per_gpu[stage * tp + tp_rank]
  int64_t max_model_len = 0;     // served; below the target when lowered to fit
  int64_t target_max_model_len = 0;
  int64_t kv_cache_tokens = 0;  // limits.kv_cache_tokens(): what the scheduler may use
  // What every worker is sized for: the options' step limits, the KV blocks the smallest GPU
  // holds (the same on every worker: block tables are shared by all stages), max_model_len.
  StepLimits limits;
  DecodeEstimate decode;

  // Every layout weighed: the chosen one first, then the others that fit (fastest first), then
  // those that do not.
  std::vector<LayoutOption> layouts;

  bool fits = false;
  std::string reason;  // why this layout, or why nothing fits and what would help

  // With options.weight_quant other than kNone: the same request planned without quantization (in
  // `dtype`), so that the plan can say what quantizing changes (fewer GPUs, or more KV cache).
  struct Unquantized {
    bool fits = false;
    int tp = 1, pp = 1;            // the layout it would choose (the closest one when nothing fits)
    int64_t kv_cache_tokens = 0;
    uint64_t model_weight_bytes = 0;
  };
  std::optional<Unquantized> unquantized;
};

// Plans `config` (with the tensors of `checkpoint` when not null, else as config.json implies)
// onto `cluster`.
//
// Errors (InvalidArgument, with the numbers) for requests no cluster could satisfy: a forced TP
// that does not divide the heads or exceeds a node, more stages than layers, a forced layout
// larger than the cluster, options out of range. FailedPrecondition when the checkpoint does not
// match config.json. A model that is merely too big is not an error: the Plan says fits = false
// and by how much it falls short.
absl::StatusOr<Plan> MakePlan(const ModelConfig& config, const Checkpoint* checkpoint, const ClusterSpec& cluster,
                              const PlanOptions& options);

// A model to plan, as `shardserve plan` reads it: `path` is a checkpoint directory (config.json
// plus safetensors, which are opened to check their tensors without reading data; a directory with
// only config.json is planned from it) or a config.json file. Errors name the file; an
// architecture the workers cannot run is Unimplemented naming it.
struct PlannerModel {
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;  // null: no safetensors at `path`
};
absl::StatusOr<PlannerModel> OpenPlannerModel(const std::filesystem::path& path);

// "bf16", "bfloat16", "fp16", "f16", "float16", "fp32", "f32", "float32" (any case).
absl::StatusOr<DType> ParsePlanDType(const std::string& name);
// "bf16", "fp16", "fp32".
const char* PlanDTypeName(DType dtype);
// What a plan's weights are held in: PlanDTypeName(dtype), with the products' dtype where
// `options` gives another one ("fp32 with the products in bf16": CPU workers' bf16 products).
std::string WeightsDTypeName(DType dtype, const PlanOptions& options);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_PLANNER_PLANNER_H_
