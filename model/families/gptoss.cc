// gpt-oss (GptOssForCausalLM: openai/gpt-oss-20b and -120b), as transformers' modeling_gpt_oss.py
// computes it:
// - Attention: q/k/v/o with biases (attention_bias, on by default), GQA, RoPE in the rotate_half
//   layout (its _apply_rotary_emb rotates the halves of each head) with the yarn scaling of
//   rope_parameters, and a learned sink logit per head (self_attn.sinks [heads]) that joins each
//   query's softmax and is dropped (kernels/backend.h AttentionOptions::sinks). layer_types
//   alternates sliding_attention (sliding_window, 128 published) and full_attention.
// - Every layer a mixture of experts (GptOssMLP): router logits = mlp.router(h) with its bias; the
//   top k logits softmaxed (MoeRouter::kTopKSoftmax); each expert
//     gate_up = h @ gate_up_proj[e] + gate_up_proj_bias[e]   ([E, hidden, 2 I], gate and up interleaved)
//     gate, up = gate_up[..., ::2], gate_up[..., 1::2]
//     out = ((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)) @ down_proj[e] + down_proj_bias[e],
//       g = min(gate, limit)
//   (Backend::ClampedSwiGlu), weighted and summed as Mixtral's. transformers 5 saves the experts
//   stacked as it holds them; the published checkpoints store gate_up_proj and down_proj in MXFP4
//   (<name>_blocks, <name>_scales: ModelConfig::mxfp4_experts), dequantized at load. The declaration
//   names each expert's gate, up and down (and their biases) as parts of the stacked tensors
//   (WeightDecl::stack), so TP cuts an expert as a dense MLP over intermediate_size, the down bias on
//   one rank (TpSplit::kExpertFirstRank), and expert parallelism moves an expert with its biases.
// - Pre-norm RMSNorm layers, a final RMSNorm, an untied LM head; no shared experts.
#include "model/families/families.h"

namespace shardserve {
namespace {

void GptOssLayer(const ModelConfig& c, LayerTensors& t) {
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  using R = WeightRole;
  using S = TpSplit;
  t.Add("input_layernorm.weight", {H}, S::kReplicated, R::kInputNorm);
  SelfAttentionTensors(c, t);
  t.Add("self_attn.sinks", {c.num_attention_heads}, S::kQHeads, R::kSinks);
  t.Add("post_attention_layernorm.weight", {H}, S::kReplicated, R::kPreMlpNorm);
  t.Add("mlp.router.weight", {E, H}, S::kReplicated, R::kRouter);
  t.Add("mlp.router.bias", {E}, S::kReplicated, R::kRouterLogitBias);
  // The experts as transformers 5 saves them: gate_up_proj [E, H, 2 I] (x @ W, gate and up
  // interleaved in the last dimension), down_proj [E, I, H]; their biases [E, 2 I] and [E, H].
  const std::vector<int64_t> gate_up = {E, H, 2 * I}, down = {E, I, H}, gate_up_bias = {E, 2 * I}, down_bias = {E, H};
  for (int64_t e = 0; e < E; ++e) {
    t.AddExpertPart("mlp.experts.gate_up_proj", e, {I, H}, gate_up, S::kExpertRows, R::kExpertGateProj, {2, 0, true});
    t.AddExpertPart("mlp.experts.gate_up_proj", e, {I, H}, gate_up, S::kExpertRows, R::kExpertUpProj, {2, 1, true});
    t.AddExpertPart("mlp.experts.down_proj", e, {H, I}, down, S::kExpertCols, R::kExpertDownProj, {1, 0, true});
    t.AddExpertPart("mlp.experts.gate_up_proj_bias", e, {I}, gate_up_bias, S::kExpertRows, R::kExpertGateBias,
                    {2, 0, false});
    t.AddExpertPart("mlp.experts.gate_up_proj_bias", e, {I}, gate_up_bias, S::kExpertRows, R::kExpertUpBias,
                    {2, 1, false});
    t.AddExpertPart("mlp.experts.down_proj_bias", e, {H}, down_bias, S::kExpertFirstRank, R::kExpertDownBias,
                    {1, 0, false});
  }
}

std::vector<WeightDecl> GptOssWeights(const ModelConfig& c) { return DecoderWeights(c, GptOssLayer); }

// GptOssConfig's RoPE when config.json has none: yarn, factor 32 over 4096 positions, not truncated.
constexpr char kGptOssRope[] =
    R"({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false,)"
    R"( "original_max_position_embeddings": 4096})";

}  // namespace

const FamilyDeclaration kGptOssFamily = {.architecture = "GptOssForCausalLM",
                                         .attention_bias = FamilyDeclaration::AttentionBias::kConfiguredOn,
                                         .sliding_window = FamilyDeclaration::SlidingWindow::kLayerTypes,
                                         .sliding_window_pattern = 2,
                                         .default_sliding_window = 128,
                                         .attention_sinks = true,
                                         .default_rope_theta = 150000.0,
                                         .default_rope_scaling = kGptOssRope,
                                         .experts = FamilyDeclaration::Experts::kGptOss,
                                         .router_weights_in_act = true,
                                         .weights = GptOssWeights,
                                         .layer_buffers = MoeBuffers};

}  // namespace shardserve
