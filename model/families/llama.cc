// The Llama-shaped decoders: Llama (2, 3.x), Mistral, Qwen2 and Qwen3. Each layer is
//   x += o_proj(attention(rope(q), rope(k), v)), q, k, v = q/k/v_proj(RMSNorm(x))
//   x += down_proj(silu(gate_proj(h)) * up_proj(h)),  h = RMSNorm(x)
// with biases on q/k/v (Qwen2) or on q/k/v and o (Llama and Qwen3 with attention_bias) and a
// per-head RMSNorm of q and k before RoPE (Qwen3) as the families differ; the forward pass is
// worker/llama.cc.
#include "model/families/families.h"

#include "absl/strings/str_cat.h"

namespace shardserve {
namespace {

std::vector<WeightDecl> LlamaShapedWeights(const ModelConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  using R = WeightRole;
  using S = TpSplit;
  std::vector<WeightDecl> w;
  w.push_back({"model.embed_tokens.weight", {V, H}, WeightPart::kEmbedding, -1, S::kVocabRows, R::kEmbedTokens});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    auto layer = [&](const char* name, std::vector<int64_t> shape, TpSplit split, WeightRole role) {
      w.push_back({p + name, std::move(shape), WeightPart::kLayer, i, split, role});
    };
    layer("input_layernorm.weight", {H}, S::kReplicated, R::kInputNorm);
    layer("self_attn.q_proj.weight", {Q, H}, S::kQRows, R::kQProj);
    layer("self_attn.k_proj.weight", {KV, H}, S::kKvRows, R::kKProj);
    layer("self_attn.v_proj.weight", {KV, H}, S::kKvRows, R::kVProj);
    if (c.qkv_bias) {
      layer("self_attn.q_proj.bias", {Q}, S::kQRows, R::kQBias);
      layer("self_attn.k_proj.bias", {KV}, S::kKvRows, R::kKBias);
      layer("self_attn.v_proj.bias", {KV}, S::kKvRows, R::kVBias);
    }
    if (c.qk_norm) {
      layer("self_attn.q_norm.weight", {c.head_dim}, S::kReplicated, R::kQNorm);
      layer("self_attn.k_norm.weight", {c.head_dim}, S::kReplicated, R::kKNorm);
    }
    layer("self_attn.o_proj.weight", {H, Q}, S::kQCols, R::kOProj);
    if (c.o_bias) layer("self_attn.o_proj.bias", {H}, S::kFirstRank, R::kOBias);
    layer("post_attention_layernorm.weight", {H}, S::kReplicated, R::kPostAttentionNorm);
    layer("mlp.gate_proj.weight", {I, H}, S::kMlpRows, R::kGateProj);
    layer("mlp.up_proj.weight", {I, H}, S::kMlpRows, R::kUpProj);
    layer("mlp.down_proj.weight", {H, I}, S::kMlpCols, R::kDownProj);
  }
  w.push_back({"model.norm.weight", {H}, WeightPart::kFinalNorm, -1, S::kReplicated, R::kFinalNorm});
  if (!c.tie_word_embeddings) w.push_back({"lm_head.weight", {V, H}, WeightPart::kLmHead, -1, S::kVocabRows, R::kLmHead});
  return w;
}

// The layers' buffers for n tokens: this rank's q, k and v heads, the attention output, the
// products' partial sums before their all-reduce, the MLP's gate and up; RoPE's inverse
// frequencies.
std::vector<StepBufferDecl> LlamaShapedBuffers(const ModelConfig& c, const TpShard& s, DType act, int64_t n) {
  const int64_t H = c.hidden_size, q = s.q_rows.size(), kv = s.kv_rows.size(), f = s.mlp_rows.size();
  return {{"q", act, {n, q}},     {"k", act, {n, kv}},   {"v", act, {n, kv}}, {"attn", act, {n, q}},
          {"proj", act, {n, H}},  {"gate", act, {n, f}}, {"up", act, {n, f}},
          {"inv_freq", DType::kF32, {c.head_dim / 2}}};
}

}  // namespace

const FamilyDeclaration kLlamaFamily = {.architecture = "LlamaForCausalLM",
                                        .attention_bias = FamilyDeclaration::AttentionBias::kConfigured,
                                        .weights = LlamaShapedWeights,
                                        .layer_buffers = LlamaShapedBuffers};

const FamilyDeclaration kMistralFamily = {.architecture = "MistralForCausalLM",
                                          .sliding_window = FamilyDeclaration::SlidingWindow::kCapsContext,
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
