// Every family's declaration (model/families/declaration.h), one .cc each; the registry
// (registry.h) lists them.
#ifndef SHARDSERVE_MODEL_FAMILIES_FAMILIES_H_
#define SHARDSERVE_MODEL_FAMILIES_FAMILIES_H_

#include <functional>
#include <string>
#include <vector>

#include "model/families/declaration.h"

namespace shardserve {

// The tensors of one decoder layer, "<decoder prefix>layers.<i>.<name>" ("model.layers.3.<name>"), as
// a family's weights function adds them (DecoderWeights).
class LayerTensors {
 public:
  LayerTensors(const std::string& decoder_prefix, int64_t layer, std::vector<WeightDecl>* out);
  void Add(const char* name, std::vector<int64_t> shape, TpSplit split, WeightRole role,
           std::vector<int64_t> fused_shape = {}, int64_t fused_offset = 0);
  // Expert `expert`'s tensor "<experts>.<expert>.<name>" (mlp.experts.3.gate_proj.weight).
  void AddExpert(const char* experts, int64_t expert, const char* name, std::vector<int64_t> shape, TpSplit split,
                 WeightRole role);
  // Expert `expert`'s part of the stacked tensor `name` of `fused_shape` (WeightDecl::stack).
  void AddExpertPart(const char* name, int64_t expert, std::vector<int64_t> shape, std::vector<int64_t> fused_shape,
                     TpSplit split, WeightRole role, WeightDecl::ExpertStack stack);
  // A tensor of rows picked from the checkpoint tensor `name` of `fused_shape` (WeightDecl::pick).
  void AddPicked(const char* name, std::vector<int64_t> shape, std::vector<int64_t> fused_shape, TpSplit split,
                 WeightRole role, WeightDecl::RowPick pick);
  int64_t layer() const { return layer_; }

 private:
  const int64_t layer_;
  const std::string prefix_;
  std::vector<WeightDecl>* const out_;
};

// A decoder's tensors in load order: model.embed_tokens, each layer's (`layer` adds them), model.norm
// and lm_head (none when tie_word_embeddings), under the config's checkpoint layout (weight_prefix,
// lm_head_weight).
std::vector<WeightDecl> DecoderWeights(const ModelConfig& config,
                                       const std::function<void(const ModelConfig&, LayerTensors&)>& layer);

// llama.cc: the Llama-shaped decoders, and the self-attention's tensors they and Gemma share:
// q/k/v_proj with their biases (config.qkv_bias), q_norm / k_norm (config.qk_norm), o_proj with its
// bias (config.o_bias).
void SelfAttentionTensors(const ModelConfig& config, LayerTensors& tensors);
// The gated MLP's mlp.gate_proj, mlp.up_proj and mlp.down_proj over intermediate_size.
void GatedMlpTensors(const ModelConfig& config, LayerTensors& tensors);
extern const FamilyDeclaration kLlamaFamily;
extern const FamilyDeclaration kMistralFamily;
extern const FamilyDeclaration kQwen2Family;
extern const FamilyDeclaration kQwen3Family;
// The layer buffers of every Llama-shaped decoder for n tokens a step: this rank's q, k and v
// heads, the attention output, the products' partial sums before their all-reduce, the MLP's gate
// and up; RoPE's inverse frequencies.
std::vector<StepBufferDecl> LlamaShapedBuffers(const ModelConfig& config, const TpShard& shard, DType act, int64_t n);

// moe.cc: the mixture-of-experts decoders, Llama-shaped attention with a sparse MLP in some or all
// layers: Qwen2-MoE (Qwen2MoeForCausalLM), Qwen3-MoE (Qwen3MoeForCausalLM) and Mixtral
// (MixtralForCausalLM).
extern const FamilyDeclaration kQwen2MoeFamily;
extern const FamilyDeclaration kQwen3MoeFamily;
extern const FamilyDeclaration kMixtralFamily;
// The buffers of a model's sparse layers for n tokens a step: the router's, the (token, expert)
// rows', the experts' products, and the shared expert's (its gate's where the family gates it).
std::vector<StepBufferDecl> ExpertBuffers(const ModelConfig& config, const TpShard& shard, DType act, int64_t n);
// A Llama-shaped attention's buffers (LlamaShapedBuffers) and the sparse layers' (ExpertBuffers):
// the layer_buffers of Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss and GLM-4.5.
std::vector<StepBufferDecl> MoeBuffers(const ModelConfig& config, const TpShard& shard, DType act, int64_t n);

// deepseek.cc: DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention and a sigmoid,
// group-limited mixture of experts with shared experts.
extern const FamilyDeclaration kDeepseekV3Family;
// The MLP of a DeepSeek-V3 layer, which GLM-4.5 shares: Llama's dense MLP before
// first_k_dense_replace, then the router mlp.gate with its selection bias, the experts and the
// shared experts mlp.shared_experts.{gate,up,down}_proj.
void DeepseekMlpTensors(const ModelConfig& config, LayerTensors& tensors);
// The multi-token-prediction layers of DeepSeek-V3 and GLM-4.5 (DeepSeekMultiTokenPredictorLayer,
// vLLM's deepseek_mtp.py and glm4_moe_mtp.py, the checkpoints' names): for each, the embedding it
// reads, enorm, hnorm and eh_proj, a decoder layer of the family (`layer`), shared_head.norm and
// shared_head.head.
std::vector<WeightDecl> MtpLayerWeights(const ModelConfig& config, void (*layer)(const ModelConfig&, LayerTensors&));

// glm.cc: GLM-4.5 (Glm4MoeForCausalLM): Llama-shaped attention (q/k/v biases, optional q/k norms,
// partial rotary) with DeepSeek-V3's mixture of experts.
extern const FamilyDeclaration kGlm4MoeFamily;

// gptoss.cc: gpt-oss (GptOssForCausalLM): attention with sinks and biases, sliding and full layers,
// experts with biases and the clamped SwiGLU, stacked in the checkpoint (MXFP4 as published).
extern const FamilyDeclaration kGptOssFamily;

// eagle3.cc: EAGLE-3 heads over Llama-shaped models (LlamaForCausalLMEagle3), speculative decoding's
// proposer, loaded beside the served model (FamilyDeclaration::eagle3).
extern const FamilyDeclaration kEagle3LlamaFamily;

// phi3.cc: Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM).
extern const FamilyDeclaration kPhi3Family;

// gemma.cc: Gemma 2 (Gemma2ForCausalLM), Gemma 3 text (Gemma3ForCausalLM) and the text part of
// Gemma 3 with its vision tower (Gemma3ForConditionalGeneration).
extern const FamilyDeclaration kGemma2Family;
extern const FamilyDeclaration kGemma3Family;
extern const FamilyDeclaration kGemma3ConditionalFamily;

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_FAMILIES_FAMILIES_H_
