#include "worker/shard/decoder.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
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
  routing_.router = MoeRouter::kSoftmaxTopK;
  routing_.k = static_cast<int>(config.num_experts_per_tok);
  routing_.norm_topk_prob = config.norm_topk_prob;
  if (config.family != nullptr && config.family->experts == FamilyDeclaration::Experts::kDeepseek) {
    routing_.router = MoeRouter::kSigmoidGroupTopK;
    routing_.n_group = static_cast<int>(config.n_group);
    routing_.topk_group = static_cast<int>(config.topk_group);
    routing_.routed_scaling_factor = static_cast<float>(config.routed_scaling_factor);
  }
  if (config.family != nullptr && config.family->experts == FamilyDeclaration::Experts::kGptOss) {
    routing_.router = MoeRouter::kTopKSoftmax;  // GptOssTopKRouter: softmax over the top k logits
    routing_.norm_topk_prob = false;
  }
  routing_.weights_in_act = config.family != nullptr && config.family->router_weights_in_act;
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
  // softmax(q k^T * scale (soft-capped), causal, within the layer's window, with the head's sink) v,
  // over the cache
  AttentionOptions attention;
  attention.window = config_.LayerWindow(layer);
  attention.softcap = static_cast<float>(config_.attn_logit_softcap);
  // gpt-oss: each head's sink logit joins the softmax and is dropped
  if (w.sinks.data != nullptr) attention.sinks = &w.sinks;
  SHARDSERVE_RETURN_IF_ERROR(be_.Attention(&s.attn, s.q, cache.k, cache.v, meta.positions, meta.token_seq,
                                           meta.block_tables, attention_scale_, attention));
  // o_proj (row-parallel: this rank's heads' columns; its bias, if any, on one rank), summed
  SHARDSERVE_RETURN_IF_ERROR(be_.MatMul(&s.proj, s.attn, w.o_proj, w.o_bias.data ? &w.o_bias : nullptr));
  return tp_.SumPartials(&s.proj);
}

absl::Status DecoderBlocks::LatentAttention(int64_t layer, const LayerWeights& w, KvCache& cache,
                                            const StepMeta& meta, LayerScratch& s) const {
  const int64_t n = s.normed.dim(0);
  // q_a_layernorm and kv_a_layernorm: DeepseekV3RMSNorm at its default eps, not rms_norm_eps
  constexpr float kLatentNormEps = 1e-6f;
  Tensor q_nope = s.mla.q_nope.Rows(0, n), q_pe = s.mla.q_pe.Rows(0, n), kv_c = s.mla.kv_c.Rows(0, n),
         k_pe = s.mla.k_pe.Rows(0, n);
  // q = q_b_proj(q_a_layernorm(q_a_proj(h))), or q_proj(h) without q_lora_rank: each head's part
  // without RoPE and its part with it (two products, picked from the checkpoint's rows at load)
  Tensor q_a = s.mla.q_a.Rows(0, n);
  const Tensor* q_in = &s.normed;
  if (w.q_a_proj.data != nullptr) {
    SHARDSERVE_RETURN_IF_ERROR(be_.MatMul(&q_a, s.normed, w.q_a_proj, nullptr));
    SHARDSERVE_RETURN_IF_ERROR(be_.RmsNorm(&q_a, q_a, w.q_a_layernorm, kLatentNormEps));
    q_in = &q_a;
  }
  const MatMulProduct q_parts[] = {{&q_nope, &w.q_nope_proj, nullptr}, {&q_pe, &w.q_pe_proj, nullptr}};
  SHARDSERVE_RETURN_IF_ERROR(be_.MatMuls(*q_in, q_parts));
  // kv_nope, k_rot = kv_a_proj_with_mqa(h): the latent (then kv_a_layernorm) and the RoPE key
  const MatMulProduct kv_parts[] = {{&kv_c, &w.kv_a_proj, nullptr}, {&k_pe, &w.k_pe_proj, nullptr}};
  SHARDSERVE_RETURN_IF_ERROR(be_.MatMuls(s.normed, kv_parts));
  SHARDSERVE_RETURN_IF_ERROR(be_.RmsNorm(&kv_c, kv_c, w.kv_a_layernorm, kLatentNormEps));
  // q_rot, k_rot = RoPE of each head's RoPE part and of the shared key (rotate_half on the rows
  // de-interleaved at load: transformers' apply_rotary_pos_emb_interleave)
  const DeviceRope& rope = rope_[config_.LayerRopeTable(layer)];
  SHARDSERVE_RETURN_IF_ERROR(be_.Rope(&q_pe, &k_pe, meta.positions, rope.inv_freq,
                                      static_cast<int>(config_.qk_rope_head_dim), rope.options));
  // the latent and the RoPE key into the cache, then softmax(q k^T * scale) v with kv_b_proj
  // absorbed (the scale qk_head_dim^-0.5 with YaRN's mscale_all_dim: ModelConfig::attention_scale)
  const MlaShape shape{.heads = tp_.shard.q_heads, .nope = config_.qk_nope_head_dim,
                       .rope = config_.qk_rope_head_dim, .v = config_.v_head_dim, .latent = config_.kv_lora_rank};
  SHARDSERVE_RETURN_IF_ERROR(be_.MlaAttention(&s.attn, q_nope, q_pe, kv_c, k_pe, w.kv_b_proj, &cache.k, meta.slots,
                                              meta.positions, meta.token_seq, meta.block_tables, attention_scale_,
                                              shape));
  // o_proj (row-parallel: this rank's heads' columns), summed
  SHARDSERVE_RETURN_IF_ERROR(be_.MatMul(&s.proj, s.attn, w.o_proj, nullptr));
  return tp_.SumPartials(&s.proj);
}

absl::Status DecoderBlocks::GatedMlp(const LayerWeights& w, LayerScratch& s) const {
  // act(gate_proj(h)) * up_proj(h) into gate (column-parallel: this rank's rows): SwiGLU in one
  // pass where the backend fuses it; GeGLU with the tanh approximation
  if (config_.activation == ModelConfig::Activation::kGeluTanh) {
    const MatMulProduct gate_up[] = {{&s.gate, &w.gate_proj, nullptr}, {&s.up, &w.up_proj, nullptr}};
    SHARDSERVE_RETURN_IF_ERROR(be_.MatMuls(s.normed, gate_up));
    SHARDSERVE_RETURN_IF_ERROR(be_.GeluTanhMul(&s.gate, s.gate, s.up));
    // down_proj (row-parallel), summed
    SHARDSERVE_RETURN_IF_ERROR(be_.MatMul(&s.proj, s.gate, w.down_proj, nullptr));
  } else {
    SHARDSERVE_RETURN_IF_ERROR(SwiGlu(&s.proj, &s.gate, &s.up, s.normed, w.gate_proj, w.up_proj, w.down_proj));
  }
  return tp_.SumPartials(&s.proj);
}

absl::Status DecoderBlocks::SwiGlu(Tensor* out, Tensor* gate, Tensor* up, const Tensor& x, const Tensor& gate_proj,
                                   const Tensor& up_proj, const Tensor& down_proj) const {
  // silu(gate_proj(x)) * up_proj(x) into gate (column-parallel: this rank's rows), in one pass where
  // the backend fuses it; then down_proj (row-parallel)
  SHARDSERVE_RETURN_IF_ERROR(be_.GateUpSilu(gate, up, x, gate_proj, up_proj));
  return be_.MatMul(out, *gate, down_proj, nullptr);
}

absl::Status DecoderBlocks::MoeMlp(const LayerWeights& w, LayerScratch& s) const {
  MoeScratch& m = s.moe;
  const ExpertPlan& plan = tp_.experts;
  const int64_t k = config_.num_experts_per_tok;
  // the tokens this rank routes (all of them when the experts are cut; its slice of them with
  // expert parallelism), and their rows of the output
  const Range tokens = plan.TokenRows(s.normed.dim(0));
  const int64_t n = tokens.size(), nk = n * k;
  const Tensor h = s.normed.Rows(tokens.begin, tokens.end);
  Tensor proj = s.proj.Rows(0, n);
  // router_logits = gate(h) (gpt-oss's router with its bias), the product in the act dtype
  // (replicated: every rank routes alike)
  Tensor logits = m.router_logits.Rows(0, n);
  SHARDSERVE_RETURN_IF_ERROR(
      be_.MatMul(&logits, h, w.router, w.router_logit_bias.data != nullptr ? &w.router_logit_bias : nullptr));
  // ids, weights = topk(softmax(router_logits, dtype=float), k), divided by their sum when
  // norm_topk_prob (always for Mixtral), rounded to the act dtype where the family does (Qwen-MoE)
  // (DeepSeek-V3: sigmoid scores, the layer's e_score_correction_bias for the choice, groups;
  // gpt-oss: softmax(topk(router_logits, k)))
  Tensor ids = m.ids.Rows(0, n), weights = m.weights.Rows(0, n);
  MoeRouting routing = routing_;
  if (w.router_bias.data != nullptr) routing.selection_bias = &w.router_bias;
  SHARDSERVE_RETURN_IF_ERROR(be_.MoeRoute(&ids, &weights, logits, routing));
  // the (token, expert) pairs grouped by expert: transformers' loop over the experts that got
  // tokens, each grouped row's token beside it
  Tensor order = m.order.Rows(0, nk), rows = m.rows.Rows(0, n), token_ids = m.tokens.Rows(0, nk);
  SHARDSERVE_RETURN_IF_ERROR(be_.MoeGroupByExpert(&order, &rows, &m.offsets, &token_ids, ids));
  // current_state = hidden_states[token_idx] for every expert at once (a row gather)
  Tensor in = m.in.Rows(0, nk);
  SHARDSERVE_RETURN_IF_ERROR(be_.Embedding(&in, h, token_ids, 0));
  // ... to the ranks of their experts (they stay here when the experts are cut)
  ExpertRows local;
  SHARDSERVE_RETURN_IF_ERROR(plan.Dispatch(be_, m, *s.moe_host, nk, &local));
  SHARDSERVE_RETURN_IF_ERROR(be_.MoeCountRows(&m.row_counts, local.offsets, plan.experts.begin, plan.experts.end));
  // each expert of this rank that got rows: down_proj(silu(gate_proj(x)) * up_proj(x)) on its rows
  // (this rank's slice of its intermediate size, or all of it); gpt-oss's with biases and the
  // clamped SwiGLU (GptOssExperts: gate_up_proj de-interleaved at load into two products, and
  // down_proj's bias on one rank)
  const int64_t local_rows = local.in.dim(0);
  const MoeExpertWeights experts{.gate_proj = w.expert_gate_proj,
                                 .up_proj = w.expert_up_proj,
                                 .down_proj = w.expert_down_proj,
                                 .gate_bias = w.expert_gate_bias,
                                 .up_bias = w.expert_up_bias,
                                 .down_bias = w.expert_down_bias,
                                 .swiglu_alpha = static_cast<float>(config_.swiglu_alpha),
                                 .swiglu_limit = static_cast<float>(config_.swiglu_limit),
                                 .begin = plan.experts.begin,
                                 .end = plan.experts.end};
  Tensor gate = m.gate.Rows(0, local_rows), up = m.up.Rows(0, local_rows);
  SHARDSERVE_RETURN_IF_ERROR(be_.MoeExperts(&local.out, &gate, &up, local.in, local.offsets, experts));
  // ... and their outputs back to the tokens' rank
  Tensor expert_out;
  SHARDSERVE_RETURN_IF_ERROR(plan.Return(be_, m, *s.moe_host, local, nk, &expert_out));
  // final_hidden_states.index_add_(token_idx, expert output * its weight), expert by expert
  SHARDSERVE_RETURN_IF_ERROR(be_.MoeCombine(&proj, expert_out, rows, weights));
  if (w.shared_gate_proj.data != nullptr) {
    // Qwen2-MoE: shared_expert(h) = down_proj(silu(gate_proj(h)) * up_proj(h)); DeepSeek-V3's
    // shared_experts(h) alike (this rank's slice; whole with expert parallelism, on this rank's
    // tokens)
    Tensor gate = m.shared_gate.Rows(0, n), up = m.shared_up.Rows(0, n), out = m.shared_out.Rows(0, n);
    SHARDSERVE_RETURN_IF_ERROR(SwiGlu(&out, &gate, &up, h, w.shared_gate_proj, w.shared_up_proj, w.shared_down_proj));
    if (w.shared_expert_gate.data != nullptr) {
      // Qwen2-MoE: sigmoid(shared_expert_gate(h)) * shared_expert_output, in the act dtype
      Tensor gate_logit = m.shared_gate_logit.Rows(0, n);
      SHARDSERVE_RETURN_IF_ERROR(be_.MatMul(&gate_logit, h, w.shared_expert_gate, nullptr));
      SHARDSERVE_RETURN_IF_ERROR(be_.SigmoidGateMul(&out, out, gate_logit));
    }
    // expert_output + shared (DeepSeek-V3's ungated)
    SHARDSERVE_RETURN_IF_ERROR(be_.Add(&proj, proj, out));
  }
  // every token's output on every rank: the partial sums summed once, or the ranks' rows gathered
  return plan.Join(be_, m, &s.proj);
}

absl::Status DecoderBlocks::Mlp(const LayerWeights& w, LayerScratch& s) const {
  return w.router.data != nullptr ? MoeMlp(w, s) : GatedMlp(w, s);
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
      // (DeepSeek-V3's self_attn: latent attention)
      SHARDSERVE_RETURN_IF_ERROR(config_.mla() ? LatentAttention(layer, w, cache, meta, s)
                                               : SelfAttention(layer, w, cache, meta, s));
      SHARDSERVE_RETURN_IF_ERROR(AddThenNorm(x, s.proj, s, &w.pre_mlp_norm));
      SHARDSERVE_RETURN_IF_ERROR(Mlp(w, s));
      return AddThenNorm(x, s.proj, s, next_input_norm);
    case FamilyDeclaration::NormPlacement::kSandwich:
      // Gemma:
      //   h = x + post_attention_layernorm(self_attn(input_layernorm(x)))
      //   out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
      SHARDSERVE_RETURN_IF_ERROR(SelfAttention(layer, w, cache, meta, s));
      SHARDSERVE_RETURN_IF_ERROR(be_.RmsNorm(&s.proj, s.proj, w.attn_out_norm, eps_));
      SHARDSERVE_RETURN_IF_ERROR(AddThenNorm(x, s.proj, s, &w.pre_mlp_norm));
      SHARDSERVE_RETURN_IF_ERROR(Mlp(w, s));
      SHARDSERVE_RETURN_IF_ERROR(be_.RmsNorm(&s.proj, s.proj, w.mlp_out_norm, eps_));
      return AddThenNorm(x, s.proj, s, next_input_norm);
  }
  return absl::InternalError("unknown norm placement");
}

absl::Status DecoderBlocks::Eagle3Layer(int64_t layer, const LayerWeights& w, KvCache& cache, const StepMeta& meta,
                                        LayerScratch& s, const Tensor& cat, Tensor* x) const {
  // h = x + self_attn(cat(input_layernorm(embeds), hidden_norm(x)))
  LayerScratch attention = s;
  attention.normed = cat;
  SHARDSERVE_RETURN_IF_ERROR(SelfAttention(layer, w, cache, meta, attention));
  SHARDSERVE_RETURN_IF_ERROR(AddThenNorm(x, s.proj, s, &w.pre_mlp_norm));
  // out = h + mlp(post_attention_layernorm(h))
  SHARDSERVE_RETURN_IF_ERROR(Mlp(w, s));
  return AddThenNorm(x, s.proj, s, nullptr);
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
