// The mixture-of-experts decoders: Llama-shaped attention (model/families/llama.cc), and in the
// sparse layers (ModelConfig::LayerIsSparse) an MLP that routes each token to k of E SwiGLU experts:
//   logits = gate(h); ids, weights = top-k of softmax(logits) (renormalised when norm_topk_prob)
//   x += sum over the token's k experts e of weights[e] * down_e(silu(gate_e(h)) * up_e(h))
// (worker/shard/decoder.cc MoeMlp). Dense layers among them have Llama's MLP.
// - Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2's attention (q/k/v biases unless qkv_bias is false),
//   Qwen3-MoE's experts and dense layers, and in each sparse layer a shared expert every token takes:
//     x += routed + sigmoid(shared_expert_gate(h)) * shared_expert(h)
//   (mlp.shared_expert.{gate,up,down}_proj, mlp.shared_expert_gate [1, H]).
// - Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k norms), mlp.gate and
//   mlp.experts.<e>.{gate,up,down}_proj as the published checkpoints and transformers 5's
//   save_pretrained both write them (transformers 5 holds the experts fused in memory,
//   experts.gate_up_proj [E, 2 I, H], and splits them again on save); dense layers by
//   mlp_only_layers and decoder_sparse_step.
// - Mixtral (MixtralForCausalLM): Mistral's attention, block_sparse_moe.gate and
//   block_sparse_moe.experts.<e>.w1 (gate), w3 (up), w2 (down) in every layer.
#include "model/families/families.h"

namespace shardserve {
namespace {

// Names of one family's MoE tensors under a layer.
struct MoeNames {
  const char* router;   // [E, H]
  const char* experts;  // the experts' prefix
  const char* gate;     // [Ie, H]
  const char* up;       // [Ie, H]
  const char* down;     // [H, Ie]
};

void MoeTensors(const ModelConfig& c, LayerTensors& t, const MoeNames& names) {
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size, E = c.num_experts;
  using R = WeightRole;
  using S = TpSplit;
  t.Add(names.router, {E, H}, S::kReplicated, R::kRouter);
  for (int64_t e = 0; e < E; ++e) {
    t.AddExpert(names.experts, e, names.gate, {I, H}, S::kExpertRows, R::kExpertGateProj);
    t.AddExpert(names.experts, e, names.up, {I, H}, S::kExpertRows, R::kExpertUpProj);
    t.AddExpert(names.experts, e, names.down, {H, I}, S::kExpertCols, R::kExpertDownProj);
  }
}

void MoeLayer(const ModelConfig& c, LayerTensors& t, const MoeNames& names) {
  const int64_t H = c.hidden_size;
  using R = WeightRole;
  using S = TpSplit;
  t.Add("input_layernorm.weight", {H}, S::kReplicated, R::kInputNorm);
  SelfAttentionTensors(c, t);
  t.Add("post_attention_layernorm.weight", {H}, S::kReplicated, R::kPreMlpNorm);
  if (c.LayerIsSparse(t.layer())) {
    MoeTensors(c, t, names);
    if (c.shared_expert_intermediate_size > 0) {
      const int64_t Is = c.shared_expert_intermediate_size;
      t.Add("mlp.shared_expert.gate_proj.weight", {Is, H}, S::kSharedExpertRows, R::kSharedGateProj);
      t.Add("mlp.shared_expert.up_proj.weight", {Is, H}, S::kSharedExpertRows, R::kSharedUpProj);
      t.Add("mlp.shared_expert.down_proj.weight", {H, Is}, S::kSharedExpertCols, R::kSharedDownProj);
      t.Add("mlp.shared_expert_gate.weight", {1, H}, S::kReplicated, R::kSharedExpertGate);
    }
  } else {
    GatedMlpTensors(c, t);
  }
}

constexpr MoeNames kQwenMoeNames = {"mlp.gate.weight", "mlp.experts", "gate_proj.weight", "up_proj.weight",
                                    "down_proj.weight"};
constexpr MoeNames kMixtralNames = {"block_sparse_moe.gate.weight", "block_sparse_moe.experts", "w1.weight",
                                    "w3.weight", "w2.weight"};

std::vector<WeightDecl> QwenMoeWeights(const ModelConfig& c) {
  return DecoderWeights(c, [](const ModelConfig& c, LayerTensors& t) { MoeLayer(c, t, kQwenMoeNames); });
}
std::vector<WeightDecl> MixtralWeights(const ModelConfig& c) {
  return DecoderWeights(c, [](const ModelConfig& c, LayerTensors& t) { MoeLayer(c, t, kMixtralNames); });
}

}  // namespace

// LlamaShapedBuffers, and for the sparse layers with n tokens a step and k experts a token, the
// worst case of n * k (token, expert) rows: the router's logits (in the act dtype as the product
// makes them, and in float32 for the routing), each token's experts and weights, the rows grouped
// by expert (order, each pair's row, per-expert offsets, each row's token), the grouped rows'
// inputs, their gate and up (this rank's slice of each expert, or whole ones with expert
// parallelism), and their outputs; expert parallelism's exchange buffers; Qwen2-MoE's shared expert's.
std::vector<StepBufferDecl> MoeBuffers(const ModelConfig& c, const TpShard& s, DType act, int64_t n) {
  std::vector<StepBufferDecl> b = LlamaShapedBuffers(c, s, act, n);
  const std::vector<StepBufferDecl> experts = ExpertBuffers(c, s, act, n);
  b.insert(b.end(), experts.begin(), experts.end());
  return b;
}

std::vector<StepBufferDecl> ExpertBuffers(const ModelConfig& c, const TpShard& s, DType act, int64_t n) {
  std::vector<StepBufferDecl> b;
  if (c.num_experts == 0) return b;
  const int64_t E = c.num_experts, k = c.num_experts_per_tok, H = c.hidden_size, f = s.expert_rows.size();
  const std::vector<StepBufferDecl> moe = {{"router_logits", act, {n, E}},
                                          {"expert_ids", DType::kI32, {n, k}},
                                          {"expert_weights", DType::kF32, {n, k}},
                                          {"expert_order", DType::kI32, {n * k}},
                                          {"expert_rows", DType::kI32, {n, k}},
                                          {"expert_offsets", DType::kI32, {E + 1}},
                                          {"expert_row_counts", DType::kI32, {E}},
                                          {"expert_tokens", DType::kI32, {n * k}},
                                          {"expert_in", act, {n * k, H}},
                                          {"expert_gate", act, {n * k, f}},
                                          {"expert_up", act, {n * k, f}},
                                          {"expert_out", act, {n * k, H}}};
  b.insert(b.end(), moe.begin(), moe.end());
  if (s.expert_parallel) {
    // Expert parallelism (worker/shard/expert_plan.h): every rank's per-expert row counts, the rows
    // exchanged with the other ranks (at most all n * k of the step's), where each of them goes to
    // be regrouped by expert and back, and every rank's ceil(n / t) combined rows gathered.
    const int64_t t = s.tp_size, c = (n + t - 1) / t;
    const std::vector<StepBufferDecl> ep = {{"expert_all_offsets", DType::kI32, {t, E + 1}},
                                            {"expert_exchanged", act, {n * k, H}},
                                            {"expert_regroup", DType::kI32, {n * k}},
                                            {"expert_ungroup", DType::kI32, {n * k}},
                                            {"expert_gathered", act, {t * c, H}}};
    b.insert(b.end(), ep.begin(), ep.end());
  }
  if (c.shared_expert_intermediate_size > 0) {
    // The shared expert's gate and up (this rank's slice) and its output; where the family gates
    // it (Qwen2-MoE), its gate's logit.
    const int64_t fs = s.shared_expert_rows.size();
    const std::vector<StepBufferDecl> shared = {
        {"shared_gate", act, {n, fs}}, {"shared_up", act, {n, fs}}, {"shared_out", act, {n, H}}};
    b.insert(b.end(), shared.begin(), shared.end());
    if (c.family->shared_expert) b.push_back({"shared_gate_logit", act, {n, 1}});
  }
  return b;
}

const FamilyDeclaration kQwen2MoeFamily = {.architecture = "Qwen2MoeForCausalLM",
                                           .attention_bias = FamilyDeclaration::AttentionBias::kQkvConfigured,
                                           .sliding_window = FamilyDeclaration::SlidingWindow::kOffUnlessUsed,
                                           .experts = FamilyDeclaration::Experts::kQwen,
                                           .shared_expert = true,
                                           .router_weights_in_act = true,
                                           .weights = QwenMoeWeights,
                                           .layer_buffers = MoeBuffers};

const FamilyDeclaration kQwen3MoeFamily = {.architecture = "Qwen3MoeForCausalLM",
                                           .attention_bias = FamilyDeclaration::AttentionBias::kConfigured,
                                           .qk_norm = true,
                                           .sliding_window = FamilyDeclaration::SlidingWindow::kOffUnlessUsed,
                                           .experts = FamilyDeclaration::Experts::kQwen,
                                           .router_weights_in_act = true,
                                           .weights = QwenMoeWeights,
                                           .layer_buffers = MoeBuffers};

const FamilyDeclaration kMixtralFamily = {.architecture = "MixtralForCausalLM",
                                          .sliding_window = FamilyDeclaration::SlidingWindow::kEveryLayer,
                                          .experts = FamilyDeclaration::Experts::kMixtral,
                                          .weights = MixtralWeights,
                                          .layer_buffers = MoeBuffers};

}  // namespace shardserve
