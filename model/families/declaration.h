// How one model architecture is written down, once: the tensors of its checkpoint (name, shape
// from config.json, how tensor parallelism cuts it, what each is to the forward pass), what its
// config.json fields mean, and the buffers a step of it works in. Every reader of a model's layout
// reads its declaration: the worker's loader (worker/shard/loader.cc), the planner's bytes
// (coordinator/planner/weights.cc) and memory math (coordinator/planner/memory.cc), and the dummy
// weights (model/dummy_weights.cc). model/families/registry.h picks the declaration from
// config.json's "architectures".
//
// Plain constant data and pure functions; thread-safe.
#ifndef SHARDSERVE_MODEL_FAMILIES_DECLARATION_H_
#define SHARDSERVE_MODEL_FAMILIES_DECLARATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/tensor.h"
#include "model/config.h"
#include "model/sharding.h"
#include "model/step_limits.h"

namespace shardserve {

// Which stage loads a tensor.
enum class WeightPart {
  kEmbedding,  // the token embedding: the first stage
  kLayer,      // a decoder layer's: the stage owning that layer
  kFinalNorm,  // the last stage
  kLmHead,     // the last stage (the embedding again when tie_word_embeddings)
  kMtp,        // a multi-token-prediction layer's (FamilyDeclaration::mtp_weights): the worker that
               // samples, with --speculative mtp only
};

// What a tensor is to the forward pass: the slot the loader puts it in.
enum class WeightRole {
  kEmbedTokens,
  kInputNorm,          // before attention
  kQProj, kKProj, kVProj,
  kQBias, kKBias, kVBias,
  kQNorm, kKNorm,      // per-head RMSNorm of q and k before RoPE (Qwen3), [head_dim]
  kOProj, kOBias,
  kAttnOutNorm,        // of the attention's output, before the residual add (Gemma 2's post_attention_layernorm)
  kPreMlpNorm,         // before the MLP (Llama's post_attention_layernorm, Gemma 2's pre_feedforward_layernorm)
  kMlpOutNorm,         // of the MLP's output, before the residual add (Gemma 2's post_feedforward_layernorm)
  kGateProj, kUpProj, kDownProj,
  // A mixture-of-experts MLP (worker/shard/decoder.cc MoeMlp): the router's product [E, hidden]
  // (Qwen-MoE's mlp.gate, Mixtral's block_sparse_moe.gate) and each expert's SwiGLU products, cut
  // for TP as a dense MLP's are over the expert's own intermediate size (WeightDecl::expert).
  kRouter,
  kExpertGateProj, kExpertUpProj, kExpertDownProj,
  // Qwen2-MoE's shared expert: a SwiGLU MLP every token takes (cut for TP over
  // shared_expert_intermediate_size), its output scaled by sigmoid(shared_expert_gate(h)), the gate
  // [1, hidden] replicated.
  kSharedGateProj, kSharedUpProj, kSharedDownProj, kSharedExpertGate,
  // DeepSeek-V3's router's selection bias (mlp.gate.e_score_correction_bias [E], float32).
  kRouterBias,
  // gpt-oss: the router's bias, added to its logits (mlp.router.bias [E]); each expert's biases of
  // its gate, up and down products (cut from mlp.experts.gate_up_proj_bias [E, 2 I] and
  // down_proj_bias [E, H]); the attention's per-head sink logits (self_attn.sinks [heads], float32).
  kRouterLogitBias, kExpertGateBias, kExpertUpBias, kExpertDownBias, kSinks,
  // Multi-head latent attention (ModelConfig::mla): q_a_proj [q_lora_rank, hidden] and
  // q_a_layernorm; q's parts without and with RoPE, picked per head from q_b_proj (or q_proj)
  // [heads * nope, in] and [heads * rope, in]; kv_a_proj_with_mqa's latent rows [kv_lora_rank, hidden]
  // and RoPE key rows [rope, hidden]; kv_a_layernorm; kv_b_proj [heads * (nope + v), kv_lora_rank]
  // held plain (the attention reads its rows per head: Backend::MlaAttention).
  kQAProj, kQANorm, kQNopeProj, kQPeProj, kKvAProj, kKPeProj, kKvANorm, kKvBProj,
  kFinalNorm,
  kLmHead,
  // A multi-token-prediction layer (DeepSeek-V3's model.layers.{num_hidden_layers}): enorm and hnorm
  // [hidden], the norms of the next token's embedding and of the model's hidden state, and eh_proj
  // [hidden, 2 hidden], their concatenation's projection. Its shared_head.norm and shared_head.head
  // are kFinalNorm and kLmHead, the model's embed_tokens kEmbedTokens, under WeightPart::kMtp.
  kMtpENorm, kMtpHNorm, kMtpEhProj,
  // An EAGLE-3 head's fc [hidden, aux layers x the served model's hidden]: the projection of the
  // served model's hidden states at its aux layers, side by side, to the head's input
  // (FamilyDeclaration::eagle3; its hidden_norm is kMtpHNorm, the norm of a hidden state).
  kEagle3Fc,
};

// A linear layer's weight: read by MatMul, so the loader packs it for the backend's products and
// may quantize it (--quantization, or a published quantized checkpoint's format).
bool IsProductWeight(WeightRole role);
struct WeightDecl;
// Whether --quantization applies to w: the decoder layers' products, experts included; not the LM
// head, nor an MoE router or Qwen2-MoE's shared-expert gate (whose logits choose and weigh the
// experts; vLLM and llama.cpp keep them unquantized too). The loader and the planner's bytes both ask this.
bool TakesWeightQuant(const WeightDecl& w);
// Whether a published quantized checkpoint (config.checkpoint_quant) stores w in its format's
// tensors (model/quantized_checkpoint.h) rather than as a plain <prefix>.weight: the weights
// TakesWeightQuant names (attention and MLA projections, dense MLPs, routed and shared experts) and
// MLA's kv_b_proj, unless the format's ignore list keeps them plain. The router and Qwen2-MoE's
// shared-expert gate never are: GPTQ and AWQ tools leave them out, and compressed-tensors and FP8
// checkpoints list them as ignored (vLLM builds them unquantized too); a checkpoint that did
// quantize them lacks their plain .weight and is refused naming it. For a part of a fused tensor
// (MLA's q_b_proj, kv_a_proj_with_mqa) the fused tensor is the quantized one.
bool IsCheckpointQuantized(const ModelConfig& config, const WeightDecl& w);
// The prefix of a linear weight's name ("model.layers.0.mlp.up_proj" of "...up_proj.weight").
std::string LinearPrefix(const std::string& name);
// An RMSNorm's weight (Gemma's are stored as w for a scale of 1 + w).
bool IsNormWeight(WeightRole role);

struct WeightDecl {
  std::string name;            // as in the checkpoint: "model.layers.3.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // full (unsharded) shape, from config.json
  WeightPart part = WeightPart::kLayer;
  int64_t layer = -1;  // kLayer only
  TpSplit split = TpSplit::kReplicated;
  WeightRole role = WeightRole::kInputNorm;
  // A part of a fused checkpoint tensor, split at load (Phi-3's qkv_proj holds q, k and v one
  // after the other; its gate_up_proj gate and up): the checkpoint tensor's full shape, and the row
  // where this part starts in it. Empty and 0 for a tensor of its own.
  std::vector<int64_t> fused_shape = {};
  int64_t fused_offset = 0;
  int64_t expert = -1;  // the expert of a kExpert* role; -1 otherwise
  // Rows picked from the checkpoint tensor (fused_shape): of each block of `period` rows, rows
  // [from, from + count), in order, or with interleaved pairs (r0, r1), (r2, r3), ... reordered to
  // r0, r2, ..., r1, r3, ... (deinterleave): MLA's per-head parts of q_b_proj and kv_a_proj_with_mqa,
  // the RoPE ones de-interleaved so that the rotate_half RoPE gives transformers'
  // apply_rotary_pos_emb_interleave (the same rotation of each pair, the pairs' dot products
  // unchanged). shape is the picked tensor's; a TP slice of its rows is whole blocks'. period 0: none.
  struct RowPick {
    int64_t period = 0, from = 0, count = 0;
    bool deinterleave = false;
  };
  RowPick pick = {};
  // An expert's part of a tensor that stacks every expert (gpt-oss: mlp.experts.gate_up_proj
  // [E, hidden, 2 I] with gate and up interleaved in its last dimension, down_proj [E, I, hidden],
  // and their biases [E, 2 I], [E, hidden]): fused_shape is the stacked tensor's, `expert` picks its
  // slab, and of each `period` consecutive outputs of the slab the one at `from` is this tensor's
  // (gate: period 2 from 0; up: from 1). `transposed`: the slab is stored [in, out] (x @ W) and
  // this tensor is its transpose [out, in], as MatMul takes it. shape is the picked [out, in] (or
  // [out] for a bias); TP slices are of it. period 0: none.
  struct ExpertStack {
    int64_t period = 0, from = 0;
    bool transposed = false;
  };
  ExpertStack stack = {};
};

// The shape of w's tensor in the checkpoint (the fused tensor's for a part of one).
inline const std::vector<int64_t>& CheckpointShape(const WeightDecl& w) {
  return w.fused_shape.empty() ? w.shape : w.fused_shape;
}
// `slice` of w (TP's cut of the part) as rows or columns of the checkpoint tensor: a fused part's
// rows are offset to where the part starts.
inline Slice CheckpointSlice(const WeightDecl& w, Slice slice) {
  if (w.fused_shape.empty()) return slice;
  if (slice.end < 0) slice.end = w.shape[0];
  slice.begin += w.fused_offset;
  slice.end += w.fused_offset;
  return slice;
}

// One buffer a step works in, allocated once at load for the step limits.
struct StepBufferDecl {
  const char* name;  // the slot the loader fills: "hidden", "q", "logits", ...
  DType dtype;
  std::vector<int64_t> dims;
};

// Where a checkpoint keeps the decoder's tensors: `decoder` prefixes the embedding, the layers and
// the final norm ("model." + "embed_tokens.weight"), `lm_head` names the untied LM head.
struct CheckpointLayout {
  const char* decoder = "model.";
  const char* lm_head = "lm_head.weight";
};

struct FamilyDeclaration {
  const char* architecture;  // config.json's "architectures"[0], e.g. "Qwen3ForCausalLM"
  // A multimodal architecture whose text model is served alone (Gemma3ForConditionalGeneration):
  // the text model's config is config.json's "text_config" over these defaults (a JSON object, the
  // text config class's defaults for the fields published files leave out), the top level giving
  // dtype, eos_token_id and quantization_config. Null: the text model's fields are at the top.
  const char* text_config_defaults = nullptr;
  // The checkpoint layouts the family's tensors are found in, the first the default (what dummy
  // weights and a config file without a checkpoint use); LoadModelConfig picks the one whose
  // embedding a checkpoint directory holds. Tensors outside the decoder (a vision tower, its
  // projector) are neither loaded nor counted.
  std::vector<CheckpointLayout> layouts = {CheckpointLayout{}};
  // What config.json's fields mean for the family (model/config.cc reads them):
  // Biases of the attention's products: kQkv on q, k and v always and never on o (Qwen2);
  // kQkvConfigured on q, k and v unless config.json's qkv_bias is false (Qwen2-MoE);
  // kConfigured on q, k, v and o when config.json's attention_bias is true (Llama, Qwen3); kNone
  // never (Mistral, whose attention transformers builds without biases whatever the file says).
  // kConfiguredOn as kConfigured, but on unless attention_bias is false (GptOssConfig's default).
  // kQkvByAttentionBias on q, k and v when attention_bias is true, never on o (Glm4MoeConfig).
  enum class AttentionBias { kNone, kQkv, kQkvConfigured, kConfigured, kConfiguredOn, kQkvByAttentionBias };
  AttentionBias attention_bias = AttentionBias::kNone;
  bool qk_norm = false;          // q and k are RMS-normed per head before RoPE (Qwen3)
  // config.json's switch of those norms, off when absent (Glm4MoeConfig's use_qk_norm); null: qk_norm
  // alone decides.
  const char* qk_norm_flag = nullptr;
  bool mla = false;              // multi-head latent attention (DeepSeek-V3): ModelConfig::kv_lora_rank
  // "sliding_window": kEveryLayer is every layer's window when set (Mistral, Phi-3); kLayerTypes the
  // window of the layers "layer_types" calls "sliding_attention" (by default the even ones, as
  // transformers' Gemma2Config); kOffUnlessUsed only with use_sliding_window true, which is refused
  // (Qwen).
  enum class SlidingWindow { kNone, kEveryLayer, kLayerTypes, kOffUnlessUsed };
  SlidingWindow sliding_window = SlidingWindow::kNone;
  // kLayerTypes without "layer_types": layer i slides unless (i + 1) is a multiple of this (Gemma 2:
  // 2, the even layers; Gemma 3: 6, or config.json's "sliding_window_pattern", which only
  // rope_per_layer_type families read, as Gemma3TextConfig does).
  int sliding_window_pattern = 2;
  // kLayerTypes: the window when config.json has no "sliding_window" field (Gemma 2 and 3: 4096;
  // GptOssConfig: 128).
  int64_t default_sliding_window = 4096;
  // Learned attention sinks (gpt-oss): self_attn.sinks [heads], one logit per query head that joins
  // the softmax and is dropped (kernels/backend.h AttentionOptions::sinks).
  bool attention_sinks = false;
  // The MLP's activation as config.json names it ("hidden_act", or Gemma's "hidden_activation"):
  // "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU with the tanh approximation).
  const char* activation = "silu";
  bool norm_plus_one = false;     // RMSNorm scales by 1 + w (Gemma): the loader adds the 1
  bool scale_embeddings = false;  // the embeddings times sqrt(hidden_size) in the act dtype (Gemma)
  bool softcapping = false;       // attn_logit_softcapping and final_logit_softcapping (Gemma 2)
  bool query_pre_attn_scalar = false;  // attention scaled by query_pre_attn_scalar^-0.5, not head_dim^-0.5 (Gemma)
  // Where a decoder layer's norms sit (worker/shard/decoder.cc): kPreNorm before each block
  // (Llama: h = x + attn(norm(x)); out = h + mlp(norm(h))), kSandwich before and after each block
  // (Gemma: h = x + norm(attn(norm(x))); out = h + norm(mlp(norm(h)))).
  enum class NormPlacement { kPreNorm, kSandwich };
  NormPlacement norm_placement = NormPlacement::kPreNorm;
  // partial_rotary_factor < 1 rotates the first head_dim * it dimensions of each head and passes the
  // rest through (Phi-3, Phi-4-mini); elsewhere transformers rotates the whole head and only 1 is taken.
  bool partial_rotary = false;
  // partial_rotary_factor where config.json gives none (Glm4MoeConfig: 0.5; elsewhere 1).
  double default_partial_rotary_factor = 1.0;
  // RoPE as Phi3Config reads it: rope_type default or longrope ("su" and "yarn" read as longrope),
  // original_max_position_embeddings from the top level, 4096 when absent.
  bool phi3_rope = false;
  // A RoPE per layer type (Gemma 3): rope_theta and rope_scaling for the full-attention layers,
  // rope_local_base_freq for the sliding ones; 5.x's rope_parameters keyed by layer type.
  bool rope_per_layer_type = false;
  // The config class's RoPE where config.json leaves it out (GptOssConfig: rope_theta 150000 and
  // yarn): default_rope_theta when there is no rope_theta (0: 10000, PreTrainedConfig's), and
  // default_rope_scaling (a JSON RoPE object without rope_theta; null: none) when there is neither
  // rope_scaling nor rope_parameters.
  double default_rope_theta = 0;
  const char* default_rope_scaling = nullptr;
  // Mixture-of-experts MLPs, as config.json describes them (model/config.cc):
  // kNone: dense MLPs only.
  // kQwen (Qwen3MoeConfig): num_experts (transformers 5 writes it as num_local_experts),
  //   num_experts_per_tok, moe_intermediate_size (each expert's), norm_topk_prob; layer i is sparse
  //   unless mlp_only_layers lists it, and only when (i + 1) is a multiple of decoder_sparse_step;
  //   its dense layers' MLPs are intermediate_size wide.
  // kMixtral (MixtralConfig): num_local_experts, num_experts_per_tok, every layer sparse, each
  //   expert intermediate_size wide, the k weights always renormalised.
  // kDeepseek (DeepseekV3Config, Glm4MoeConfig): n_routed_experts, num_experts_per_tok,
  //   moe_intermediate_size, the sigmoid group-limited router and its shared experts
  //   (ParseDeepseekExperts in model/config.cc, with group_router's defaults); layers from
  //   first_k_dense_replace on sparse, the others intermediate_size wide.
  // kGptOss (GptOssConfig): num_local_experts, num_experts_per_tok, every layer sparse, each expert
  //   intermediate_size wide with biases and the clamped SwiGLU (swiglu_limit, swiglu_alpha), the
  //   router a product with a bias whose top k logits are softmaxed (MoeRouter::kTopKSoftmax).
  enum class Experts { kNone, kQwen, kMixtral, kDeepseek, kGptOss };
  Experts experts = Experts::kNone;
  // kDeepseek: the config class's defaults for the fields config.json leaves out (DeepseekV3Config's
  // here; Glm4MoeConfig's 1 group, 1 kept, 1 dense layer, a scaling of 1).
  struct GroupRouterDefaults {
    int64_t n_group = 8, topk_group = 4, first_k_dense_replace = 3;
    double routed_scaling_factor = 2.5;
  };
  GroupRouterDefaults group_router = {};
  // Sparse layers also have a shared expert of shared_expert_intermediate_size, gated per token by
  // sigmoid(shared_expert_gate(h)) and added to the routed experts' output (Qwen2-MoE).
  bool shared_expert = false;
  // The router's k weights rounded to the act dtype before they scale the experts' outputs
  // (Qwen-MoE's `.to(router_logits.dtype)`; Mixtral's stay float32): MoeRouting::weights_in_act.
  bool router_weights_in_act = false;
  // Every tensor of the checkpoint, in the order a stage loads them (embedding, layers in order,
  // final norm, LM head; no LM head when tie_word_embeddings).
  std::vector<WeightDecl> (*weights)(const ModelConfig& config);
  // The multi-token-prediction layers' tensors (ModelConfig::num_nextn_predict_layers of them, layer
  // num_hidden_layers on; WeightPart::kMtp), which only speculative decoding with them loads
  // (--speculative mtp): each a decoder layer of its index's kind, its own norms, projection and
  // head, and the embedding it reads. Null: the family has none.
  std::vector<WeightDecl> (*mtp_weights)(const ModelConfig& config) = nullptr;
  // An EAGLE-3 head (docs/speculative-decoding.md), not a model to serve: one decoder layer whose
  // attention reads the next token's normed embedding and the normed hidden state side by side, over
  // a projection of the served model's hidden states at a few of its layers (config.json's
  // draft_vocab_size, target_hidden_size, eagle_config; ModelConfig::eagle3).
  bool eagle3 = false;
  // The buffers of the family's decoder layers for `tokens` tokens a step on the rank `shard`.
  std::vector<StepBufferDecl> (*layer_buffers)(const ModelConfig& config, const TpShard& shard, DType act,
                                               int64_t tokens);
};

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_FAMILIES_DECLARATION_H_
