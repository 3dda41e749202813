// GLM-4.5, GLM-4.5-Air and GLM-4.6 (Glm4MoeForCausalLM), as transformers' modeling_glm4_moe.py
// computes it: a Llama-shaped decoder (model/families/llama.cc) whose attention has biases on q, k and v when
// attention_bias is true (never on o), q and k RMS-normed per head before RoPE when use_qk_norm is
// true, and RoPE on the first head_dim * partial_rotary_factor dimensions of each head (0.5 when
// config.json gives none, Glm4MoeConfig's default), rotate_half as Llama's; and DeepSeek-V3's
// mixture of experts (model/families/deepseek.cc DeepseekMlpTensors): from first_k_dense_replace on,
// sigmoid scores with the selection bias mlp.gate.e_score_correction_bias, group-limited top k,
// routed_scaling_factor, and n_shared_experts ungated shared experts; the first layers dense.
// The multi-token-prediction layers after the last (num_nextn_predict_layers: 1 in the published
// files; transformers skips them on load and never runs them) are DeepSeek-V3's with this family's
// decoder layer (MtpLayerWeights), loaded only for --speculative mtp.
#include "model/families/families.h"

namespace shardserve {
namespace {

void Glm4MoeLayer(const ModelConfig& c, LayerTensors& t) {
  const int64_t H = c.hidden_size;
  t.Add("input_layernorm.weight", {H}, TpSplit::kReplicated, WeightRole::kInputNorm);
  SelfAttentionTensors(c, t);
  t.Add("post_attention_layernorm.weight", {H}, TpSplit::kReplicated, WeightRole::kPreMlpNorm);
  DeepseekMlpTensors(c, t);
}

std::vector<WeightDecl> Glm4MoeWeights(const ModelConfig& c) { return DecoderWeights(c, Glm4MoeLayer); }
std::vector<WeightDecl> Glm4MoeMtpWeights(const ModelConfig& c) { return MtpLayerWeights(c, Glm4MoeLayer); }

}  // namespace

const FamilyDeclaration kGlm4MoeFamily = {
    .architecture = "Glm4MoeForCausalLM",
    .attention_bias = FamilyDeclaration::AttentionBias::kQkvByAttentionBias,
    .qk_norm_flag = "use_qk_norm",
    .partial_rotary = true,
    .default_partial_rotary_factor = 0.5,
    .experts = FamilyDeclaration::Experts::kDeepseek,
    .group_router = {.n_group = 1, .topk_group = 1, .first_k_dense_replace = 1, .routed_scaling_factor = 1.0},
    .weights = Glm4MoeWeights,
    .mtp_weights = Glm4MoeMtpWeights,
    .layer_buffers = MoeBuffers};

}  // namespace shardserve
