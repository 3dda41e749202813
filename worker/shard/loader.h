// The loader: a family's declaration (model/families/) and a checkpoint or dummy weights
// (model/weight_source.h) in, this rank's slice of one pipeline stage's tensors out, on the
// backend's device in its layouts: products packed for MatMul (quantized by --quantization, or in a
// published quantized checkpoint's own format), norms (Gemma's with their 1 added), embeddings and
// the LM head in the activation dtype. Every tensor's shape is checked against the checkpoint
// before anything is allocated.
//
// Threading: not thread-safe; one load at a time.
#ifndef SHARDSERVE_WORKER_SHARD_LOADER_H_
#define SHARDSERVE_WORKER_SHARD_LOADER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/quant.h"
#include "model/config.h"
#include "model/sharding.h"
#include "model/weight_source.h"
#include "worker/shard/arena.h"
#include "worker/shard_inputs.h"  // ShardSpec

namespace shardserve {

// One decoder layer's weights on this rank, by their role in the forward pass
// (model/families/declaration.h WeightRole). Shapes are this rank's: q = local q heads * head_dim,
// kv = local KV heads * head_dim, f = local intermediate size, fe = an expert's local intermediate
// size. A weight the family does not have has data == nullptr; a sparse layer (a mixture of
// experts) has a router and experts instead of gate_proj, up_proj and down_proj.
struct LayerWeights {
  Tensor input_layernorm;         // [hidden]
  Tensor q_proj, k_proj, v_proj;  // [q, hidden], [kv, hidden], [kv, hidden]
  Tensor q_bias, k_bias, v_bias;  // [q], [kv], [kv] (Qwen2; Llama, Qwen3 with attention_bias)
  Tensor q_norm, k_norm;          // [head_dim] each (Qwen3)
  Tensor o_proj;                  // [hidden, q]
  Tensor o_bias;                  // [hidden] on TP rank 0 (Llama, Qwen3 with attention_bias)
  Tensor attn_out_norm;           // [hidden] of the attention's output (Gemma)
  Tensor pre_mlp_norm;            // [hidden]
  Tensor mlp_out_norm;            // [hidden] of the MLP's output (Gemma)
  Tensor gate_proj, up_proj;      // [f, hidden]
  Tensor down_proj;               // [hidden, f]
  Tensor router;                  // [experts, hidden] (a sparse layer's)
  std::vector<Tensor> expert_gate_proj, expert_up_proj;  // per expert [fe, hidden]
  std::vector<Tensor> expert_down_proj;                  // per expert [hidden, fe]
  Tensor shared_gate_proj, shared_up_proj;  // [fs, hidden] Qwen2-MoE's shared expert (fs: this rank's)
  Tensor shared_down_proj;                  // [hidden, fs]
  Tensor shared_expert_gate;                // [1, hidden]
  Tensor router_bias;                       // [experts] F32: DeepSeek-V3's e_score_correction_bias
  // gpt-oss: the attention's sink logits, the router's bias, the experts' biases
  Tensor sinks;                             // [q heads of this rank] F32
  Tensor router_logit_bias;                 // [experts] added to the router's logits
  std::vector<Tensor> expert_gate_bias, expert_up_bias;  // per expert [fe]
  std::vector<Tensor> expert_down_bias;     // per expert [hidden]: on one rank (TpSplit::kExpertFirstRank)
  // Multi-head latent attention (DeepSeek-V3; h: this rank's heads, ModelConfig's MLA sizes):
  Tensor q_a_proj;                // [q_lora_rank, hidden] (none without q_lora_rank)
  Tensor q_a_layernorm;           // [q_lora_rank]
  Tensor q_nope_proj, q_pe_proj;  // [h * nope, q_lora_rank or hidden], [h * rope, ...] (RoPE rows de-interleaved)
  Tensor kv_a_proj, k_pe_proj;    // [kv_lora_rank, hidden], [rope, hidden] (RoPE rows de-interleaved)
  Tensor kv_a_layernorm;          // [kv_lora_rank]
  Tensor kv_b_proj;               // [h * (nope + v), kv_lora_rank] plain (MlaAttention reads its rows)
  // A multi-token-prediction layer's own (DeepSeek-V3's model.layers.{num_hidden_layers}):
  Tensor enorm, hnorm;            // [hidden] of the next token's embedding, of the model's hidden state
  Tensor eh_proj;                 // [hidden, 2 hidden] of their concatenation
};

// This rank's slice of a pipeline stage's weights.
struct ShardWeights {
  Tensor embed_tokens;  // [vocab rows of this rank, hidden] (first stage; packed when it is also lm_head)
  std::vector<LayerWeights> layers;  // the stage's layers, first to last
  Tensor norm;                       // [hidden] (last stage)
  Tensor lm_head;                    // [vocab rows of this rank, hidden] (last stage)
  Tensor eagle3_fc;                  // [hidden, aux layers x the model's hidden] (an EAGLE-3 head's)
};

// What a load counted, for the memory report and the worker's log.
struct LoadReport {
  uint64_t weight_bytes = 0;  // logical bytes, as the planner counts them
  // A published quantized checkpoint's linear weights by the layout that holds them (kNone:
  // dequantized to float32), indexed by WeightQuant, and at kFp8BlocksPath an FP8 checkpoint's held
  // by the fp8 kernel with its block scales; and why the first dequantized one is.
  static constexpr int kFp8BlocksPath = static_cast<int>(WeightQuant::kMxfp4) + 1;  // past every WeightQuant
  int quant_paths[kFp8BlocksPath + 1] = {};
  std::string quant_why_dense;
  // MXFP4 experts' products (ModelConfig::mxfp4_experts): kept as the checkpoint's codes and scales
  // (kernels/quant.h Mxfp4RowsLayout, the backend's mxfp4 kernels), on the fp8 kernels with a scale
  // per 32 inputs where the backend has no mxfp4 kernels (model/mxfp4.h Mxfp4AsFp8Groups), and
  // dequantized at load (--quantization given, a rank's inputs that cut a block, a scale byte of
  // 255); and why the first product not kept as mxfp4 was not.
  int mxfp4_kept = 0;
  int mxfp4_as_fp8 = 0;
  int mxfp4_dequantized = 0;
  std::string mxfp4_why_not;
};

// Loads this rank (`shard`) of the stage `spec` names: its layers' tensors, the embedding on the
// first stage and the final norm and LM head on the last, as config.family declares them, into
// buffers of `arena`. A tied LM head on a stage that also embeds is the embedding's buffer.
// With spec.mtp, the multi-token-prediction layer first_layer's tensors (MtpWeights) instead: its
// decoder layer and own tensors in layers[0], the embedding, and its shared_head's norm and head as
// norm and lm_head (the model's LM head where the checkpoint has no shared_head.head); a checkpoint
// without them is FailedPrecondition naming the missing tensor and num_nextn_predict_layers.
absl::StatusOr<ShardWeights> LoadShardWeights(const WeightSource& weights, const ModelConfig& config,
                                              const ShardSpec& spec, const TpShard& shard, Backend* backend,
                                              DeviceArena* arena, LoadReport* report);

// How the linear weights are held, for the worker log: the --quantization name, or for a published
// quantized checkpoint its format and how many weights took each path.
std::string QuantizationSummary(const ModelConfig& config, const ShardSpec& spec, const LoadReport& report);

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_SHARD_LOADER_H_
