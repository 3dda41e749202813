// Gemma 2 (Gemma2ForCausalLM), as transformers' modeling_gemma2.py computes it. Each layer is
//   x += RMSNorm'(o_proj(attention(rope(q), rope(k), v))),  q, k, v = q/k/v_proj(RMSNorm'(x))
//   x += RMSNorm'(down_proj(gelu_tanh(gate_proj(h)) * up_proj(h))),  h = RMSNorm'(x)
// with RMSNorm' scaling by 1 + w (the loader adds the 1), four norms a layer (input, the
// attention's output, pre- and post-feedforward), the embeddings times sqrt(hidden_size), attention
// scaled by query_pre_attn_scalar^-0.5 and its scores soft-capped (attn_logit_softcapping), the
// layers layer_types calls sliding (by default the even ones) within sliding_window, and the logits
// soft-capped (final_logit_softcapping). The forward pass is worker/shard/decoder.cc's
// sandwich-norm layer with those options.
//
// Gemma 3 text (Gemma3ForCausalLM, modeling_gemma3.py) is the same layer with q and k RMS-normed
// per head (1 + w) before RoPE, no soft-capping unless config.json sets it, five sliding layers to
// one global by default (sliding_window_pattern 6, or layer_types), and a RoPE per layer type: the
// global layers rope_theta with rope_scaling (linear 8 on the 27B), the sliding ones
// rope_local_base_freq (model/config.cc; the worker holds a table per type).
//
// Gemma 3 as google/gemma-3-4b-it, -12b-it and -27b-it publish it (Gemma3ForConditionalGeneration)
// is that text model under config.json's "text_config" beside a SigLIP vision tower and its
// projector. Its text part is served: the tensors under "language_model.model." (as transformers
// 4.50-4.51 and 5.x save them) or "model.language_model." (4.52-4.57), the LM head tied to the
// embedding as published; the vision tower and the projector are not loaded, so images are not
// served.
#include "model/families/families.h"

namespace shardserve {
namespace {

void Gemma2Layer(const ModelConfig& c, LayerTensors& t) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  using R = WeightRole;
  using S = TpSplit;
  t.Add("input_layernorm.weight", {H}, S::kReplicated, R::kInputNorm);
  SelfAttentionTensors(c, t);
  t.Add("post_attention_layernorm.weight", {H}, S::kReplicated, R::kAttnOutNorm);
  t.Add("pre_feedforward_layernorm.weight", {H}, S::kReplicated, R::kPreMlpNorm);
  t.Add("mlp.gate_proj.weight", {I, H}, S::kMlpRows, R::kGateProj);
  t.Add("mlp.up_proj.weight", {I, H}, S::kMlpRows, R::kUpProj);
  t.Add("mlp.down_proj.weight", {H, I}, S::kMlpCols, R::kDownProj);
  t.Add("post_feedforward_layernorm.weight", {H}, S::kReplicated, R::kMlpOutNorm);
}

std::vector<WeightDecl> Gemma2Weights(const ModelConfig& c) { return DecoderWeights(c, Gemma2Layer); }

}  // namespace

const FamilyDeclaration kGemma2Family = {.architecture = "Gemma2ForCausalLM",
                                         .attention_bias = FamilyDeclaration::AttentionBias::kConfigured,
                                         .sliding_window = FamilyDeclaration::SlidingWindow::kLayerTypes,
                                         .activation = "gelu_pytorch_tanh",
                                         .norm_plus_one = true,
                                         .scale_embeddings = true,
                                         .softcapping = true,
                                         .query_pre_attn_scalar = true,
                                         .norm_placement = FamilyDeclaration::NormPlacement::kSandwich,
                                         .weights = Gemma2Weights,
                                         .layer_buffers = LlamaShapedBuffers};

const FamilyDeclaration kGemma3Family = {.architecture = "Gemma3ForCausalLM",
                                         .attention_bias = FamilyDeclaration::AttentionBias::kConfigured,
                                         .qk_norm = true,
                                         .sliding_window = FamilyDeclaration::SlidingWindow::kLayerTypes,
                                         .sliding_window_pattern = 6,
                                         .activation = "gelu_pytorch_tanh",
                                         .norm_plus_one = true,
                                         .scale_embeddings = true,
                                         .softcapping = true,
                                         .query_pre_attn_scalar = true,
                                         .norm_placement = FamilyDeclaration::NormPlacement::kSandwich,
                                         .rope_per_layer_type = true,
                                         .weights = Gemma2Weights,
                                         .layer_buffers = LlamaShapedBuffers};

// Gemma3TextConfig's defaults for the fields a published text_config leaves out (the 27B's gives no
// vocab_size, max_position_embeddings or tie_word_embeddings); the RoPE, window and attention
// scalar defaults are model/config.cc's, shared with Gemma3ForCausalLM.
const FamilyDeclaration kGemma3ConditionalFamily = {
    .architecture = "Gemma3ForConditionalGeneration",
    .text_config_defaults = R"({"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                                "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                                "head_dim": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                                "tie_word_embeddings": true, "bos_token_id": 2, "eos_token_id": 1})",
    .layouts = {{.decoder = "language_model.model.", .lm_head = "language_model.lm_head.weight"},
                {.decoder = "model.language_model.", .lm_head = "lm_head.weight"}},
    .attention_bias = kGemma3Family.attention_bias,
    .qk_norm = kGemma3Family.qk_norm,
    .sliding_window = kGemma3Family.sliding_window,
    .sliding_window_pattern = kGemma3Family.sliding_window_pattern,
    .activation = kGemma3Family.activation,
    .norm_plus_one = kGemma3Family.norm_plus_one,
    .scale_embeddings = kGemma3Family.scale_embeddings,
    .softcapping = kGemma3Family.softcapping,
    .query_pre_attn_scalar = kGemma3Family.query_pre_attn_scalar,
    .norm_placement = kGemma3Family.norm_placement,
    .rope_per_layer_type = kGemma3Family.rope_per_layer_type,
    .weights = Gemma2Weights,
    .layer_buffers = LlamaShapedBuffers};

}  // namespace shardserve
