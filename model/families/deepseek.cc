// DeepSeek-V3 (DeepseekV3ForCausalLM), as transformers' modeling_deepseek_v3.py computes it:
// - Multi-head latent attention (worker/shard/decoder.cc LatentAttention): q from q_b_proj(
//   q_a_layernorm(q_a_proj(h))), or q_proj(h) without q_lora_rank (DeepSeek-V2-Lite), each head's q
//   a part without RoPE (qk_nope_head_dim) and one with it (qk_rope_head_dim); kv_a_proj_with_mqa(h)
//   a latent of kv_lora_rank, normed by kv_a_layernorm, and one RoPE key every head shares;
//   kv_b_proj turns the latent into each head's key part and value. The KV cache holds the latent
//   and the RoPE key, not K and V. TP cuts the heads (q's parts and kv_b_proj by rows, o_proj by
//   columns); q_a_proj and kv_a_proj_with_mqa are replicated, so every rank has the whole latent.
// - From first_k_dense_replace on, a mixture of experts (DeepseekV3MoE): sigmoid scores, the
//   selection bias mlp.gate.e_score_correction_bias, group-limited top-k, routed_scaling_factor
//   (kernels/backend.h MoeRouter::kSigmoidGroupTopK), the experts as Qwen-MoE's, plus the shared
//   experts mlp.shared_experts.{gate,up,down}_proj, one ungated SwiGLU every token takes. The first
//   layers have Llama's MLP.
// - The multi-token-prediction layers (num_nextn_predict_layers, model.layers.{num_hidden_layers}
//   on; transformers skips them on load, and the model's forward pass never reads them):
//   enorm, hnorm, eh_proj [hidden, 2 hidden], a decoder layer of its index's kind, shared_head.norm
//   and shared_head.head (the model's lm_head where a checkpoint leaves it out: the loader's
//   fallback), over the model's embed_tokens. Declared apart (mtp_weights): --speculative mtp alone
//   loads them, whole on the worker that samples (worker/head_runner.h).
#include "model/families/families.h"

namespace shardserve {
namespace {

void LatentAttentionTensors(const ModelConfig& c, LayerTensors& t) {
  const int64_t H = c.hidden_size, heads = c.num_attention_heads, nope = c.qk_nope_head_dim,
                rope = c.qk_rope_head_dim, qk = nope + rope, lora = c.kv_lora_rank, v = c.v_head_dim;
  using R = WeightRole;
  using S = TpSplit;
  const char* q_name = "self_attn.q_proj.weight";
  int64_t q_in = H;
  if (c.q_lora_rank > 0) {
    t.Add("self_attn.q_a_proj.weight", {c.q_lora_rank, H}, S::kReplicated, R::kQAProj);
    t.Add("self_attn.q_a_layernorm.weight", {c.q_lora_rank}, S::kReplicated, R::kQANorm);
    q_name = "self_attn.q_b_proj.weight";
    q_in = c.q_lora_rank;
  }
  // each head's rows [nope | rope] of q_b_proj (q_proj), picked into two products
  t.AddPicked(q_name, {heads * nope, q_in}, {heads * qk, q_in}, S::kMlaQNopeRows, R::kQNopeProj, {qk, 0, nope});
  t.AddPicked(q_name, {heads * rope, q_in}, {heads * qk, q_in}, S::kMlaQPeRows, R::kQPeProj,
              {qk, nope, rope, c.rope_interleave});
  // kv_a_proj_with_mqa's rows [latent | rope key], likewise
  const char* kv_a = "self_attn.kv_a_proj_with_mqa.weight";
  t.AddPicked(kv_a, {lora, H}, {lora + rope, H}, S::kReplicated, R::kKvAProj, {lora + rope, 0, lora});
  t.AddPicked(kv_a, {rope, H}, {lora + rope, H}, S::kReplicated, R::kKPeProj, {lora + rope, lora, rope, c.rope_interleave});
  t.Add("self_attn.kv_a_layernorm.weight", {lora}, S::kReplicated, R::kKvANorm);
  t.Add("self_attn.kv_b_proj.weight", {heads * (nope + v), lora}, S::kMlaKvBRows, R::kKvBProj);
  t.Add("self_attn.o_proj.weight", {H, heads * v}, S::kMlaOCols, R::kOProj);
}

void DeepseekLayer(const ModelConfig& c, LayerTensors& t) {
  const int64_t H = c.hidden_size;
  t.Add("input_layernorm.weight", {H}, TpSplit::kReplicated, WeightRole::kInputNorm);
  LatentAttentionTensors(c, t);
  t.Add("post_attention_layernorm.weight", {H}, TpSplit::kReplicated, WeightRole::kPreMlpNorm);
  DeepseekMlpTensors(c, t);
}

std::vector<WeightDecl> DeepseekWeights(const ModelConfig& c) { return DecoderWeights(c, DeepseekLayer); }

std::vector<WeightDecl> DeepseekMtpWeights(const ModelConfig& c) { return MtpLayerWeights(c, DeepseekLayer); }

// For n tokens a step on this rank's heads: q_a_proj's output (with q_lora_rank), q's parts
// without and with RoPE, the latent and the RoPE key, the attention output (v_head_dim a head),
// the products' partial sums, the dense layers' gate and up, RoPE's frequencies; the sparse layers'
// (ExpertBuffers).
std::vector<StepBufferDecl> DeepseekBuffers(const ModelConfig& c, const TpShard& s, DType act, int64_t n) {
  const int64_t h = s.q_heads, f = s.mlp_rows.size();
  std::vector<StepBufferDecl> b = {{"mla_q_nope", act, {n, h * c.qk_nope_head_dim}},
                                   {"mla_q_pe", act, {n, h * c.qk_rope_head_dim}},
                                   {"mla_kv_c", act, {n, c.kv_lora_rank}},
                                   {"mla_k_pe", act, {n, c.qk_rope_head_dim}},
                                   {"attn", act, {n, h * c.v_head_dim}},
                                   {"proj", act, {n, c.hidden_size}},
                                   {"gate", act, {n, f}},
                                   {"up", act, {n, f}},
                                   {"inv_freq", DType::kF32, {kRopeTableRows, c.RotaryDim() / 2}}};
  if (c.q_lora_rank > 0) b.push_back({"mla_q_a", act, {n, c.q_lora_rank}});
  const std::vector<StepBufferDecl> experts = ExpertBuffers(c, s, act, n);
  b.insert(b.end(), experts.begin(), experts.end());
  return b;
}

}  // namespace

std::vector<WeightDecl> MtpLayerWeights(const ModelConfig& c, void (*layer)(const ModelConfig&, LayerTensors&)) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  using R = WeightRole;
  using S = TpSplit;
  std::vector<WeightDecl> w;
  for (int64_t i = c.num_hidden_layers; i < c.num_hidden_layers + c.num_nextn_predict_layers; ++i) {
    w.push_back({c.weight_prefix + "embed_tokens.weight", {V, H}, WeightPart::kMtp, i, S::kVocabRows, R::kEmbedTokens});
    LayerTensors t(c.weight_prefix, i, &w);
    t.Add("enorm.weight", {H}, S::kReplicated, R::kMtpENorm);
    t.Add("hnorm.weight", {H}, S::kReplicated, R::kMtpHNorm);
    t.Add("eh_proj.weight", {H, 2 * H}, S::kReplicated, R::kMtpEhProj);
    layer(c, t);
    t.Add("shared_head.norm.weight", {H}, S::kReplicated, R::kFinalNorm);
    t.Add("shared_head.head.weight", {V, H}, S::kVocabRows, R::kLmHead);
  }
  for (WeightDecl& d : w) d.part = WeightPart::kMtp;
  return w;
}

void DeepseekMlpTensors(const ModelConfig& c, LayerTensors& t) {
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  using R = WeightRole;
  using S = TpSplit;
  if (!c.LayerIsSparse(t.layer())) {
    GatedMlpTensors(c, t);
    return;
  }
  t.Add("mlp.gate.weight", {E, H}, S::kReplicated, R::kRouter);
  t.Add("mlp.gate.e_score_correction_bias", {E}, S::kReplicated, R::kRouterBias);
  for (int64_t e = 0; e < E; ++e) {
    t.AddExpert("mlp.experts", e, "gate_proj.weight", {I, H}, S::kExpertRows, R::kExpertGateProj);
    t.AddExpert("mlp.experts", e, "up_proj.weight", {I, H}, S::kExpertRows, R::kExpertUpProj);
    t.AddExpert("mlp.experts", e, "down_proj.weight", {H, I}, S::kExpertCols, R::kExpertDownProj);
  }
  if (c.shared_expert_intermediate_size > 0) {
    const int64_t Is = c.shared_expert_intermediate_size;
    t.Add("mlp.shared_experts.gate_proj.weight", {Is, H}, S::kSharedExpertRows, R::kSharedGateProj);
    t.Add("mlp.shared_experts.up_proj.weight", {Is, H}, S::kSharedExpertRows, R::kSharedUpProj);
    t.Add("mlp.shared_experts.down_proj.weight", {H, Is}, S::kSharedExpertCols, R::kSharedDownProj);
  }
}

const FamilyDeclaration kDeepseekV3Family = {.architecture = "DeepseekV3ForCausalLM",
                                             .mla = true,
                                             .experts = FamilyDeclaration::Experts::kDeepseek,
                                             .weights = DeepseekWeights,
                                             .mtp_weights = DeepseekMtpWeights,
                                             .layer_buffers = DeepseekBuffers};

}  // namespace shardserve
