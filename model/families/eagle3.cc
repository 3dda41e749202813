// EAGLE-3 heads over Llama-shaped models (LlamaForCausalLMEagle3, as the EAGLE authors publish them
// and vLLM's llama_eagle3.py and SGLang's load them): not a model to serve but speculative
// decoding's proposer (docs/speculative-decoding.md, --speculative eagle3). Its one decoder layer
// ("midlayer.") reads, for the token at position i + 1 and the served model's state at position i,
//   x = fc(cat(the model's hidden states at its aux layers))      (later guesses: the head's own x)
//   h = x + o_proj(attention(q/k/v_proj(cat(input_layernorm(embed(token)), hidden_norm(x)))))
//   out = h + mlp(post_attention_layernorm(h))
// (with norm_before_residual the residual is hidden_norm(x)), and guesses argmax(lm_head(norm(out)))
// over its own vocabulary, which d2t maps to the served model's ids (worker/head_runner.h runs it).
// q/k/v_proj thus read 2 x hidden inputs. The head runs whole on one worker (TP 1); its embedding is
// the served model's where the checkpoint leaves embed_tokens out (the published heads do).
#include "model/families/families.h"

namespace shardserve {
namespace {

std::vector<WeightDecl> Eagle3Weights(const ModelConfig& c) {
  const int64_t H = c.hidden_size, Q = c.q_dim(), KV = c.kv_dim(), I = c.intermediate_size;
  const int64_t aux = c.eagle3.has_value() ? c.eagle3->num_aux() : 3;
  const int64_t target_hidden = c.eagle3.has_value() ? c.eagle3->target_hidden_size : H;
  const int64_t embedding_vocab = c.eagle3.has_value() ? c.eagle3->embedding_vocab_size : c.vocab_size;
  using R = WeightRole;
  using S = TpSplit;
  using P = WeightPart;
  std::vector<WeightDecl> w;
  auto layer = [&w](const char* name, std::vector<int64_t> shape, R role) {
    w.push_back({std::string("midlayer.") + name, std::move(shape), P::kLayer, 0, S::kReplicated, role});
  };
  w.push_back({"embed_tokens.weight", {embedding_vocab, H}, P::kEmbedding, -1, S::kReplicated, R::kEmbedTokens});
  layer("input_layernorm.weight", {H}, R::kInputNorm);  // of the token's embedding
  layer("hidden_norm.weight", {H}, R::kMtpHNorm);       // of the hidden state
  layer("self_attn.q_proj.weight", {Q, 2 * H}, R::kQProj);
  layer("self_attn.k_proj.weight", {KV, 2 * H}, R::kKProj);
  layer("self_attn.v_proj.weight", {KV, 2 * H}, R::kVProj);
  if (c.qkv_bias) {
    layer("self_attn.q_proj.bias", {Q}, R::kQBias);
    layer("self_attn.k_proj.bias", {KV}, R::kKBias);
    layer("self_attn.v_proj.bias", {KV}, R::kVBias);
  }
  layer("self_attn.o_proj.weight", {H, Q}, R::kOProj);
  if (c.o_bias) layer("self_attn.o_proj.bias", {H}, R::kOBias);
  layer("post_attention_layernorm.weight", {H}, R::kPreMlpNorm);
  layer("mlp.gate_proj.weight", {I, H}, R::kGateProj);
  layer("mlp.up_proj.weight", {I, H}, R::kUpProj);
  layer("mlp.down_proj.weight", {H, I}, R::kDownProj);
  w.push_back({"fc.weight", {H, aux * target_hidden}, P::kLayer, 0, S::kReplicated, R::kEagle3Fc});
  w.push_back({"norm.weight", {H}, P::kFinalNorm, -1, S::kReplicated, R::kFinalNorm});
  w.push_back({"lm_head.weight", {c.vocab_size, H}, P::kLmHead, -1, S::kVocabRows, R::kLmHead});
  return w;
}

}  // namespace

const FamilyDeclaration kEagle3LlamaFamily = {.architecture = "LlamaForCausalLMEagle3",
                                              .layouts = {CheckpointLayout{.decoder = "", .lm_head = "lm_head.weight"}},
                                              .attention_bias = FamilyDeclaration::AttentionBias::kConfigured,
                                              .weights = Eagle3Weights,
                                              .eagle3 = true,
                                              .layer_buffers = LlamaShapedBuffers};

}  // namespace shardserve
