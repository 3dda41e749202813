// The Llama-shaped decoders: Llama (2, 3.x), Mistral, Qwen2 and Qwen3 (Phi-3's, the same math over
// fused tensors, is phi3.cc). Each layer is
//   x += o_proj(attention(rope(q), rope(k), v)), q, k, v = q/k/v_proj(RMSNorm(x))
//   x += down_proj(silu(gate_proj(h)) * up_proj(h)),  h = RMSNorm(x)
// with biases on q/k/v (Qwen2) or on q/k/v and o (Llama and Qwen3 with attention_bias) and a
// per-head RMSNorm of q and k before RoPE (Qwen3) as the families differ; the forward pass is
// worker/shard/decoder.cc's pre-norm layer.
#include "model/families/families.h"

namespace shardserve {
namespace {

void LlamaShapedLayer(const ModelConfig& c, LayerTensors& t) {
  const int64_t H = c.hidden_size;
  using R = WeightRole;
  using S = TpSplit;
  t.Add("input_layernorm.weight", {H}, S::kReplicated, R::kInputNorm);
  SelfAttentionTensors(c, t);
  t.Add("post_attention_layernorm.weight", {H}, S::kReplicated, R::kPreMlpNorm);
  GatedMlpTensors(c, t);
}

std::vector<WeightDecl> LlamaShapedWeights(const ModelConfig& c) { return DecoderWeights(c, LlamaShapedLayer); }

}  // namespace

void GatedMlpTensors(const ModelConfig& c, LayerTensors& t) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  t.Add("mlp.gate_proj.weight", {I, H}, TpSplit::kMlpRows, WeightRole::kGateProj);
  t.Add("mlp.up_proj.weight", {I, H}, TpSplit::kMlpRows, WeightRole::kUpProj);
  t.Add("mlp.down_proj.weight", {H, I}, TpSplit::kMlpCols, WeightRole::kDownProj);
}

void SelfAttentionTensors(const ModelConfig& c, LayerTensors& t) {
  const int64_t H = c.hidden_size, Q = c.q_dim(), KV = c.kv_dim();
  using R = WeightRole;
  using S = TpSplit;
  t.Add("self_attn.q_proj.weight", {Q, H}, S::kQRows, R::kQProj);
  t.Add("self_attn.k_proj.weight", {KV, H}, S::kKvRows, R::kKProj);
  t.Add("self_attn.v_proj.weight", {KV, H}, S::kKvRows, R::kVProj);
  if (c.qkv_bias) {
    t.Add("self_attn.q_proj.bias", {Q}, S::kQRows, R::kQBias);
    t.Add("self_attn.k_proj.bias", {KV}, S::kKvRows, R::kKBias);
    t.Add("self_attn.v_proj.bias", {KV}, S::kKvRows, R::kVBias);
  }
  if (c.qk_norm) {
    t.Add("self_attn.q_norm.weight", {c.head_dim}, S::kReplicated, R::kQNorm);
    t.Add("self_attn.k_norm.weight", {c.head_dim}, S::kReplicated, R::kKNorm);
  }
  t.Add("self_attn.o_proj.weight", {H, Q}, S::kQCols, R::kOProj);
  if (c.o_bias) t.Add("self_attn.o_proj.bias", {H}, S::kFirstRank, R::kOBias);
}

// "inv_freq": per kind of layer (RopeTables), its frequencies and LongRoPE's long ones.
std::vector<StepBufferDecl> LlamaShapedBuffers(const ModelConfig& c, const TpShard& s, DType act, int64_t n) {
  const int64_t H = c.hidden_size, q = s.q_rows.size(), kv = s.kv_rows.size(), f = s.mlp_rows.size();
  return {{"q", act, {n, q}},     {"k", act, {n, kv}},   {"v", act, {n, kv}}, {"attn", act, {n, q}},
          {"proj", act, {n, H}},  {"gate", act, {n, f}}, {"up", act, {n, f}},
          {"inv_freq", DType::kF32, {kRopeTableRows, c.RotaryDim() / 2}}};
}

const FamilyDeclaration kLlamaFamily = {.architecture = "LlamaForCausalLM",
                                        .attention_bias = FamilyDeclaration::AttentionBias::kConfigured,
                                        .weights = LlamaShapedWeights,
                                        .layer_buffers = LlamaShapedBuffers};

const FamilyDeclaration kMistralFamily = {.architecture = "MistralForCausalLM",
                                          .sliding_window = FamilyDeclaration::SlidingWindow::kEveryLayer,
                                          .weights = LlamaShapedWeights,
                                          .layer_buffers = LlamaShapedBuffers};

const FamilyDeclaration kQwen2Family = {.architecture = "Qwen2ForCausalLM",
                                        .attention_bias = FamilyDeclaration::AttentionBias::kQkv,
                                        .sliding_window = FamilyDeclaration::SlidingWindow::kOffUnlessUsed,
                                        .weights = LlamaShapedWeights,
                                        .layer_buffers = LlamaShapedBuffers};

const FamilyDeclaration kQwen3Family = {.architecture = "Qwen3ForCausalLM",
                                        .attention_bias = FamilyDeclaration::AttentionBias::kConfigured,
                                        .qk_norm = true,
                                        .sliding_window = FamilyDeclaration::SlidingWindow::kOffUnlessUsed,
                                        .weights = LlamaShapedWeights,
                                        .layer_buffers = LlamaShapedBuffers};

}  // namespace shardserve
