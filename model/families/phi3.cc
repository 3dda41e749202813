// Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM): a Llama-shaped decoder (model/families/llama.cc)
// whose checkpoint fuses q, k and v into one qkv_proj ([q; k; v] rows, as transformers' Phi3Attention
// slices them) and gate and up into one gate_up_proj ([gate; up] rows, Phi3MLP's chunk(2)). The
// loader splits them (each part cut for TP as its own tensor would be), so the forward pass is the
// Llama one. A sliding window applies to every layer, as Mistral's does. RoPE is default or LongRoPE
// (Phi-3 128k, Phi-3.5, Phi-4-mini), on the first head_dim * partial_rotary_factor dimensions of each
// head (Phi-4-mini: 0.75); model/config.cc reads both as Phi3Config does.
#include "model/families/families.h"

namespace shardserve {
namespace {

void Phi3Layer(const ModelConfig& c, LayerTensors& t) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  using R = WeightRole;
  using S = TpSplit;
  const std::vector<int64_t> qkv = {Q + 2 * KV, H}, gate_up = {2 * I, H};
  t.Add("input_layernorm.weight", {H}, S::kReplicated, R::kInputNorm);
  t.Add("self_attn.qkv_proj.weight", {Q, H}, S::kQRows, R::kQProj, qkv, 0);
  t.Add("self_attn.qkv_proj.weight", {KV, H}, S::kKvRows, R::kKProj, qkv, Q);
  t.Add("self_attn.qkv_proj.weight", {KV, H}, S::kKvRows, R::kVProj, qkv, Q + KV);
  t.Add("self_attn.o_proj.weight", {H, Q}, S::kQCols, R::kOProj);
  t.Add("post_attention_layernorm.weight", {H}, S::kReplicated, R::kPreMlpNorm);
  t.Add("mlp.gate_up_proj.weight", {I, H}, S::kMlpRows, R::kGateProj, gate_up, 0);
  t.Add("mlp.gate_up_proj.weight", {I, H}, S::kMlpRows, R::kUpProj, gate_up, I);
  t.Add("mlp.down_proj.weight", {H, I}, S::kMlpCols, R::kDownProj);
}

std::vector<WeightDecl> Phi3Weights(const ModelConfig& c) { return DecoderWeights(c, Phi3Layer); }

}  // namespace

const FamilyDeclaration kPhi3Family = {.architecture = "Phi3ForCausalLM",
                                       .sliding_window = FamilyDeclaration::SlidingWindow::kEveryLayer,
                                       .partial_rotary = true,
                                       .phi3_rope = true,
                                       .weights = Phi3Weights,
                                       .layer_buffers = LlamaShapedBuffers};

}  // namespace shardserve
