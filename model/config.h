// A Hugging Face config.json of a family this server runs (model/families/registry.h), validated.
// Plain value type; thread-compatible.
#ifndef SHARDSERVE_MODEL_CONFIG_H_
#define SHARDSERVE_MODEL_CONFIG_H_

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"
#include "model/quantized_checkpoint.h"

namespace shardserve {

struct FamilyDeclaration;  // model/families/declaration.h

struct RopeScaling {
  // transformers' rope_type: default, linear, llama3, yarn or longrope (dynamic is refused: see
  // model/config.cc).
  enum class Type { kNone, kLinear, kLlama3, kYarn, kLongRope };
  Type type = Type::kNone;
  // The fields each type reads (modeling_rope_utils.py's _compute_*_parameters), resolved at parse
  // as transformers resolves them (defaults, Phi-3's top-level original_max_position_embeddings):
  double factor = 1.0;            // linear, llama3, yarn
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  int64_t original_max_position_embeddings = 0;  // llama3, yarn, longrope
  double beta_fast = 32.0;        // yarn
  double beta_slow = 1.0;         // yarn
  bool truncate = true;           // yarn: the correction range floored / ceiled
  // yarn and longrope: cos and sin are scaled by this (given, or from factor / mscale as
  // transformers infers it); 1 for the other types.
  double attention_factor = 1.0;
  std::vector<double> short_factor;  // longrope [rotary_dim / 2]: positions < original_max_position_embeddings
  std::vector<double> long_factor;   // longrope [rotary_dim / 2]: positions >= original_max_position_embeddings
  bool operator==(const RopeScaling&) const = default;
};

// The RoPE of one kind of layer: its base and scaling.
struct LayerRope {
  double theta = 10000.0;
  RopeScaling scaling;
  bool operator==(const LayerRope&) const = default;
};

// What the rotary-embedding kernel needs for one kind of layer (kernels/backend.h RopeOptions), in
// float32 as transformers computes it.
struct RopeTable {
  std::vector<float> inv_freq;       // [rotary_dim / 2]; longrope: the short factors'
  std::vector<float> long_inv_freq;  // longrope: [rotary_dim / 2], the long factors'; else empty
  int64_t long_from = 0;             // longrope: positions >= this use long_inv_freq
  float attention_factor = 1.0f;     // cos and sin scaled by this
};

struct ModelConfig {
  // The family's declaration (model/families/): its tensors, layers and buffers. Set by
  // ParseModelConfig from architecture_name; null only in a default-made config.
  const FamilyDeclaration* family = nullptr;
  std::string architecture_name;  // as written in config.json, e.g. "Qwen2ForCausalLM"
  // Where the checkpoint keeps the decoder's tensors: "model." (+ "layers.0. ...") and
  // "lm_head.weight" for a causal LM; for a multimodal checkpoint served as text, one of the
  // family's layouts (FamilyDeclaration::layouts), picked by LoadModelConfig from the checkpoint.
  std::string weight_prefix = "model.";
  std::string lm_head_weight = "lm_head.weight";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  // Multi-token-prediction layers after the decoder's (DeepSeek-V3's num_nextn_predict_layers: layer
  // num_hidden_layers on, FamilyDeclaration::mtp_weights): not part of the model's forward pass,
  // read only by speculative decoding with them (docs/speculative-decoding.md, --speculative mtp).
  // Their kinds of layer (LayerIsSparse) follow the decoder's rule past num_hidden_layers.
  int64_t num_nextn_predict_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // == num_attention_heads when config.json omits it
  int64_t head_dim = 0;             // hidden_size / num_attention_heads when config.json omits it
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  // Gemma 3: the RoPE of its sliding-window layers (rope_local_base_freq, or rope_parameters'
  // "sliding_attention"); rope_theta and rope_scaling are then its full-attention layers'. Unset:
  // every layer has rope_theta and rope_scaling.
  std::optional<LayerRope> sliding_rope;
  // Dimensions of each head RoPE rotates, from its start: head_dim * partial_rotary_factor (Phi-3
  // and Phi-4-mini); the rest pass through unrotated. 0: head_dim. Read through RotaryDim.
  int64_t rotary_dim = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;        // q/k/v biases (Qwen2; Llama and Qwen3 with attention_bias)
  bool o_bias = false;          // o_proj's bias (Llama and Qwen3 with attention_bias)
  bool qk_norm = false;         // per-head RMSNorm of q and k before RoPE (Qwen3)
  // Per layer: the sliding window its attention sees (kernels/backend.h AttentionOptions::window),
  // 0 for full attention. Mistral and Phi-3 slide in every layer when config.json's sliding_window
  // is set, Gemma 2 in the layers layer_types names. Read through LayerWindow.
  std::vector<int64_t> layer_window;
  // Per layer (kLayerTypes families): whether layer_types (or the sliding pattern) calls it a
  // sliding_attention layer, window or not; its RoPE is then sliding_rope's where that is set.
  std::vector<bool> sliding_layers;
  // The MLP's activation: silu (SwiGLU) or transformers' gelu_pytorch_tanh (GeGLU; Gemma).
  enum class Activation { kSilu, kGeluTanh };
  Activation activation = Activation::kSilu;
  bool norm_plus_one = false;      // RMSNorm scales by 1 + w (Gemma)
  double embedding_scale = 0;      // the embeddings' factor (Gemma: sqrt(hidden_size)); 0 for none
  double attention_scale = 0;      // scores = q.k * this: query_pre_attn_scalar^-0.5 (Gemma); 0: head_dim^-0.5
  double attn_logit_softcap = 0;   // Gemma 2's attn_logit_softcapping; 0 for none
  double final_logit_softcap = 0;  // Gemma 2's final_logit_softcapping; 0 for none
  bool mlp_bias = false;        // not supported; parsing rejects true
  // Mixture of experts (FamilyDeclaration::Experts says which fields config.json names them by):
  // num_experts 0 for a dense model. A sparse layer's MLP routes each token to num_experts_per_tok
  // of num_experts SwiGLU experts, each moe_intermediate_size wide, their outputs weighted by the
  // router's softmax over all experts (renormalised over the chosen k when norm_topk_prob).
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int64_t shared_expert_intermediate_size = 0;  // Qwen2-MoE's shared expert; 0: none
  std::vector<bool> sparse_layers;  // per layer: a mixture of experts (else a dense MLP)
  // DeepSeek-V3's router (FamilyDeclaration::Experts::kDeepseek, kernels/backend.h
  // MoeRouter::kSigmoidGroupTopK): the experts in n_group groups, the topk_group best kept, the
  // chosen weights times routed_scaling_factor. Its shared experts are one SwiGLU of
  // shared_expert_intermediate_size (moe_intermediate_size * n_shared_experts), ungated.
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  // Multi-head latent attention (FamilyDeclaration::mla; DeepSeek-V2/V3): kv_lora_rank 0 for none.
  // q = q_b_proj(q_a_layernorm(q_a_proj(h))), or q_proj(h) when q_lora_rank is 0 (config.json's
  // null); each head's q is qk_nope_head_dim dimensions without RoPE then qk_rope_head_dim with it.
  // kv_a_proj_with_mqa(h) is a latent of kv_lora_rank (normed by kv_a_layernorm) and one RoPE key
  // of qk_rope_head_dim shared by every head; kv_b_proj turns the latent into each head's
  // qk_nope_head_dim key part and v_head_dim value. head_dim is qk_rope_head_dim (what RoPE
  // rotates). rope_interleave: the RoPE dimensions are interleaved pairs (transformers'
  // apply_rotary_pos_emb_interleave), de-interleaved at load (WeightDecl::pick).
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool rope_interleave = false;
  // gpt-oss's experts (FamilyDeclaration::Experts::kGptOss): each has biases on its gate, up and
  // down products and the clamped SwiGLU out = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha *
  // g), g = min(gate, limit) (swiglu_limit, swiglu_alpha: GptOssExperts._apply_gate). 0: plain SwiGLU.
  double swiglu_limit = 0;
  double swiglu_alpha = 0;
  // Learned per-head attention sinks (gpt-oss; FamilyDeclaration::attention_sinks).
  bool attention_sinks = false;
  // The experts stored in MXFP4 (quantization_config quant_method "mxfp4", as gpt-oss is published):
  // each stacked expert tensor <name> as <name>_blocks [E, out, in / 32, 16] U8 (two 4-bit e2m1
  // codes a byte, the low nibble first) and <name>_scales [E, out, in / 32] U8 (E8M0: a power of two,
  // 2^(s - 127), per 32 inputs), dequantized at load (model/mxfp4.h). Only the experts; the rest is
  // plain. checkpoint_quant stays unset.
  bool mxfp4_experts = false;
  // An EAGLE-3 head's (FamilyDeclaration::eagle3; set for those only): vocab_size above is its LM
  // head's (draft_vocab_size, as published: a subset of the served model's vocabulary that d2t maps
  // back), embedding_vocab_size the served model's (config.json's vocab_size), which its embedding
  // has (the head's own embed_tokens, or the served model's where the head leaves it out);
  // target_hidden_size the served model's hidden size; aux_layers the served model's layers whose
  // input hidden state (the residual stream before the layer) its fc reads, side by side in
  // ascending order: eagle_config's eagle_aux_hidden_state_layer_ids, or when absent (2, L / 2,
  // L - 3) of the served model's L layers (Eagle3AuxLayers), as vLLM and SGLang take them;
  // norm_before_residual: the residual is the normed hidden state (as config.json says).
  struct Eagle3 {
    int64_t embedding_vocab_size = 0;
    int64_t target_hidden_size = 0;
    std::vector<int64_t> aux_layers;
    bool norm_before_residual = false;
    // Whether the head's checkpoint holds its own embed_tokens. config.json does not say:
    // NoteEagle3Embedding (model/weight_source.h) reads it from the checkpoint; until then it counts
    // as held, which plans the bytes of a copy.
    bool embedding_in_checkpoint = true;
    // The hidden states fc reads side by side: the listed layers', or the default three.
    int64_t num_aux() const { return aux_layers.empty() ? 3 : static_cast<int64_t>(aux_layers.size()); }
  };
  std::optional<Eagle3> eagle3;
  DType dtype = DType::kF32;    // dtype (transformers 5.x) or torch_dtype (4.x)
  std::vector<int64_t> eos_token_ids;  // from config.json's eos_token_id (int or list)
  int64_t bos_token_id = -1;           // -1: none
  // quantization_config of a published quantized checkpoint (GPTQ, AWQ, compressed-tensors, FP8):
  // the linear layers are stored in that format (model/quantized_checkpoint.h). Absent: plain
  // weights. Any other quant_method is refused at parse time.
  std::optional<CheckpointQuant> checkpoint_quant;

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  bool mla() const { return kv_lora_rank > 0; }
  // What one token's KV cache entry holds per layer and TP rank, in values: MLA's latent
  // (kv_lora_rank + qk_rope_head_dim, whole on every rank), else K and V of the rank's KV heads.
  int64_t KvValuesPerToken(int64_t local_kv_heads) const {
    return mla() ? kv_lora_rank + qk_rope_head_dim : 2 * local_kv_heads * head_dim;
  }
  int64_t RotaryDim() const { return rotary_dim > 0 ? rotary_dim : head_dim; }
  // Layer i's sliding window; 0 (full attention) for a layer layer_window does not list.
  int64_t LayerWindow(int64_t i) const {
    return i >= 0 && i < static_cast<int64_t>(layer_window.size()) ? layer_window[i] : 0;
  }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  // Whether layer i's MLP is a mixture of experts (false past sparse_layers' list).
  bool LayerIsSparse(int64_t i) const {
    return i >= 0 && i < static_cast<int64_t>(sparse_layers.size()) && sparse_layers[i];
  }
  // Layer i's RoPE table (RopeTables): 1 for a layer layer_types calls sliding when sliding_rope is
  // set (whether or not it has a window), else 0.
  int LayerRopeTable(int64_t i) const {
    return sliding_rope.has_value() && i >= 0 && i < static_cast<int64_t>(sliding_layers.size()) && sliding_layers[i]
               ? 1
               : 0;
  }
  // Parameters of the whole model (embedding and LM head counted once when tied): the elements of
  // the family's declared tensors.
  int64_t ParameterCount() const;
};

// The served model's layers whose input hidden states the EAGLE-3 head `head` reads (ascending):
// its own list, or (2, L / 2, L - 3) of the model's L = target.num_hidden_layers. InvalidArgument
// naming both when a layer is outside the model, the list repeats one, the head's fc does not
// read hidden states of the model's size (target_hidden_size), or its width (hidden_size) or
// vocabulary is not the model's.
absl::StatusOr<std::vector<int64_t>> Eagle3AuxLayers(const ModelConfig& head, const ModelConfig& target);

// Whether the worker that runs the EAGLE-3 head `head` looks its tokens up in the served model's own
// embedding table rather than in a copy loaded for it: the head has no embedding of its own (and no
// LM head tied to one), and that worker holds the model's table whole (`whole_table`: the first
// stage on one TP rank, so with one stage and TP 1, since the head runs on the last stage). Elsewhere
// the model's table is copied in for it.
bool Eagle3SharesEmbedding(const ModelConfig& head, bool whole_table);

// Parses and validates config.json text. `source` names the file in error messages.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, std::string source);

// Reads <dir>/config.json (or the file itself, when `path` is a file). For a family with several
// checkpoint layouts (FamilyDeclaration::layouts), a directory's safetensors say which one its
// tensors are in: the layout whose embedding they hold (the default without safetensors).
absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& path);

// Rows of the worker's RoPE buffer: [table 0's inv_freq, its long_inv_freq, table 1's, its long].
inline constexpr int64_t kRopeTableRows = 4;

// The RoPE tables of the config's kinds of layer: [0] the full-attention layers' (every layer's
// without sliding_rope), [1] the sliding-window layers' when sliding_rope is set. Computed as
// transformers' _compute_*_parameters do, in float32.
std::vector<RopeTable> RopeTables(const ModelConfig& config);

// RopeTables(config)[0].inv_freq: the inverse frequencies [rotary_dim / 2] of the full-attention
// layers (longrope: the short factors').
std::vector<float> RopeInvFreq(const ModelConfig& config);

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_CONFIG_H_
