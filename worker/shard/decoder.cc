#include "worker/shard/decoder.h"

#include <cmath>
#include <cstdint>

#include "base/status_macros.h"
#include "model/families/declaration.h"

namespace shardserve {

DecoderBlocks::DecoderBlocks(Backend* backend, const TpPlan* tp, const ModelConfig& config,
                             const std::vector<DeviceRope>* rope)
    : be_(*backend),
      tp_(*tp),
      config_(config),
      rope_(*rope),
      eps_(static_cast<float>(config.rms_norm_eps)),
      attention_scale_(config.attention_scale > 0 ? static_cast<float>(config.attention_scale)
                                                  : 1.0f / std::sqrt(static_cast<float>(config.head_dim))) {
  if (config.embedding_scale != 0) {
    // The factor in the act dtype, as transformers casts it before the product.
    const float f32 = static_cast<float>(config.embedding_scale);
    uint16_t narrow = 0;
    embedding_scale_ = f32;
    if (be_.act_dtype() != DType::kF32 && ConvertOnHost(&narrow, be_.act_dtype(), &f32, DType::kF32, 1)) {
      ConvertOnHost(&embedding_scale_, DType::kF32, &narrow, be_.act_dtype(), 1);
    }
  }
}

absl::Status DecoderBlocks::Embed(Tensor* x, const Tensor& table, const Tensor& ids) const {
  // this rank's vocabulary rows looked up, then summed with the other ranks' (vocab-parallel)
  SHARDSERVE_RETURN_IF_ERROR(be_.Embedding(x, table, ids, tp_.shard.vocab_rows.begin));
  SHARDSERVE_RETURN_IF_ERROR(tp_.SumPartials(x));
  // times sqrt(hidden_size), in the act dtype (Gemma's normalizer)
  if (embedding_scale_ != 0) SHARDSERVE_RETURN_IF_ERROR(be_.Scale(x, *x, embedding_scale_));
  return absl::OkStatus();
}

absl::Status DecoderBlocks::SelfAttention(int64_t layer, const LayerWeights& w, KvCache& cache, const StepMeta& meta,
                                          LayerScratch& s) const {
  const int64_t n = s.normed.dim(0), D = config_.head_dim;
  // q, k, v = q_proj(h), k_proj(h), v_proj(h), with their biases where the family has them (one
  // call: a backend may fuse them)
  const MatMulProduct qkv[] = {{&s.q, &w.q_proj, w.q_bias.data ? &w.q_bias : nullptr},
                               {&s.k, &w.k_proj, w.k_bias.data ? &w.k_bias : nullptr},
                               {&s.v, &w.v_proj, w.v_bias.data ? &w.v_bias : nullptr}};
  SHARDSERVE_RETURN_IF_ERROR(be_.MatMuls(s.normed, qkv));
  // q, k = q_norm(q), k_norm(k) per head, over head_dim, in place (Qwen3, Gemma 3)
  if (w.q_norm.data != nullptr) {
    Tensor q_heads(s.q.data, s.q.dtype, {n * tp_.shard.q_heads, D}), k_heads(s.k.data, s.k.dtype, {n * tp_.shard.kv_heads, D});
    SHARDSERVE_RETURN_IF_ERROR(be_.RmsNorm(&q_heads, q_heads, w.q_norm, eps_));
    SHARDSERVE_RETURN_IF_ERROR(be_.RmsNorm(&k_heads, k_heads, w.k_norm, eps_));
  }
  // q, k = apply_rotary_pos_emb(q, k, cos, sin) with the layer kind's RoPE; k and v into the paged
  // cache (one pass where the backend fuses them)
  const DeviceRope& rope = rope_[config_.LayerRopeTable(layer)];
  SHARDSERVE_RETURN_IF_ERROR(be_.RopeCacheWrite(&s.q, &s.k, s.v, meta.positions, rope.inv_freq, static_cast<int>(D),
                                                rope.options, &cache.k, &cache.v, meta.slots));
  // softmax(q k^T * scale (soft-capped), causal, within the layer's window) v, over the cache
  AttentionOptions attention;
  attention.window = config_.LayerWindow(layer);
  attention.softcap = static_cast<float>(config_.attn_logit_softcap);
  SHARDSERVE_RETURN_IF_ERROR(be_.Attention(&s.attn, s.q, cache.k, cache.v, meta.positions, meta.token_seq,
                                           meta.block_tables, attention_scale_, attention));
  // o_proj (row-parallel: this rank's heads' columns; its bias, if any, on one rank), summed
  SHARDSERVE_RETURN_IF_ERROR(be_.MatMul(&s.proj, s.attn, w.o_proj, w.o_bias.data ? &w.o_bias : nullptr));
  return tp_.SumPartials(&s.proj);
}

absl::Status DecoderBlocks::GatedMlp(const LayerWeights& w, LayerScratch& s) const {
  // act(gate_proj(h)) * up_proj(h) into gate (column-parallel: this rank's rows): SwiGLU in one
  // pass where the backend fuses it; GeGLU with the tanh approximation
  if (config_.activation == ModelConfig::Activation::kGeluTanh) {
    const MatMulProduct gate_up[] = {{&s.gate, &w.gate_proj, nullptr}, {&s.up, &w.up_proj, nullptr}};
    SHARDSERVE_RETURN_IF_ERROR(be_.MatMuls(s.normed, gate_up));
    SHARDSERVE_RETURN_IF_ERROR(be_.GeluTanhMul(&s.gate, s.gate, s.up));
  } else {
    SHARDSERVE_RETURN_IF_ERROR(be_.GateUpSilu(&s.gate, &s.up, s.normed, w.gate_proj, w.up_proj));
  }
  // down_proj (row-parallel), summed
  SHARDSERVE_RETURN_IF_ERROR(be_.MatMul(&s.proj, s.gate, w.down_proj, nullptr));
  return tp_.SumPartials(&s.proj);
}

absl::Status DecoderBlocks::AddThenNorm(Tensor* x, const Tensor& residual, LayerScratch& s,
                                        const Tensor* next_norm) const {
  if (next_norm == nullptr) return be_.Add(x, *x, residual);
  return be_.AddRmsNorm(x, residual, &s.normed, *next_norm, eps_);
}

absl::Status DecoderBlocks::Layer(int64_t layer, const LayerWeights& w, KvCache& cache, const StepMeta& meta,
                                  LayerScratch& s, Tensor* x, const Tensor* next_input_norm) const {
  switch (config_.family->norm_placement) {
    case FamilyDeclaration::NormPlacement::kPreNorm:
      // Llama, Qwen, Mistral, Phi-3:
      //   h = x + self_attn(input_layernorm(x))
      //   out = h + mlp(post_attention_layernorm(h))
      SHARDSERVE_RETURN_IF_ERROR(SelfAttention(layer, w, cache, meta, s));
      SHARDSERVE_RETURN_IF_ERROR(AddThenNorm(x, s.proj, s, &w.pre_mlp_norm));
      SHARDSERVE_RETURN_IF_ERROR(GatedMlp(w, s));
      return AddThenNorm(x, s.proj, s, next_input_norm);
    case FamilyDeclaration::NormPlacement::kSandwich:
      // Gemma:
      //   h = x + post_attention_layernorm(self_attn(input_layernorm(x)))
      //   out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
      SHARDSERVE_RETURN_IF_ERROR(SelfAttention(layer, w, cache, meta, s));
      SHARDSERVE_RETURN_IF_ERROR(be_.RmsNorm(&s.proj, s.proj, w.attn_out_norm, eps_));
      SHARDSERVE_RETURN_IF_ERROR(AddThenNorm(x, s.proj, s, &w.pre_mlp_norm));
      SHARDSERVE_RETURN_IF_ERROR(GatedMlp(w, s));
      SHARDSERVE_RETURN_IF_ERROR(be_.RmsNorm(&s.proj, s.proj, w.mlp_out_norm, eps_));
      return AddThenNorm(x, s.proj, s, next_input_norm);
  }
  return absl::InternalError("unknown norm placement");
}

absl::Status DecoderBlocks::LocalLogits(Tensor* logits, const Tensor& rows, Tensor* normed, const Tensor& final_norm,
                                        const Tensor& lm_head) const {
  // norm(hidden) of the rows whose logits are wanted
  SHARDSERVE_RETURN_IF_ERROR(be_.RmsNorm(normed, rows, final_norm, eps_));
  // lm_head (vocab-parallel: this rank's rows of the vocabulary)
  SHARDSERVE_RETURN_IF_ERROR(be_.MatMul(logits, *normed, lm_head, nullptr));
  // cap * tanh(logits / cap), each rank on its slice (Gemma 2's final_logit_softcapping)
  if (config_.final_logit_softcap > 0) {
    SHARDSERVE_RETURN_IF_ERROR(be_.Softcap(logits, static_cast<float>(config_.final_logit_softcap)));
  }
  return absl::OkStatus();
}

}  // namespace shardserve
