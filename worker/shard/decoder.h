// The decoder's blocks, shared by every family: self-attention (GQA with optional q/k/v biases,
// per-head q/k norms, RoPE, a sliding window, soft-capped scores), the gated MLP (SwiGLU or GeGLU),
// the mixture-of-experts MLP (a router and SwiGLU experts), and the decoder layer that joins them with their norms as the family places them. Each reads
// like transformers' modeling code, one comment a step; tensor parallelism is the plan they run
// under (TpPlan: which slice each product holds, where partial sums meet), never a branch inside.
//
// Threading: not thread-safe; one step at a time (the shard's).
#ifndef SHARDSERVE_WORKER_SHARD_DECODER_H_
#define SHARDSERVE_WORKER_SHARD_DECODER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/sharding.h"
#include "worker/communicator.h"
#include "worker/shard/expert_plan.h"
#include "worker/shard/loader.h"

namespace shardserve {

// The tensor-parallel plan: this rank's slice of every product (TpShard: its heads, its MLP rows,
// its vocabulary rows), and the group where row-parallel products' partial sums meet. With one
// rank the plan is the whole model and the sums are the identity.
struct TpPlan {
  Communicator* group = nullptr;
  TpShard shard;
  // The full result of a row-parallel product (o_proj, down_proj, the embedding lookup) on every
  // rank, from this rank's partial sum.
  absl::Status SumPartials(Tensor* partial) const { return group->AllReduceSum(partial); }
  // How the sparse layers' experts are split over the group (worker/shard/expert_plan.h).
  ExpertPlan experts;
};

// One layer's paged KV cache: [blocks, block_size, local KV heads, head_dim] each; with latent
// attention (ModelConfig::mla) k alone, [blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]
// (each token's normed latent and roped RoPE key, whole on every TP rank), and v empty.
struct KvCache {
  Tensor k, v;
};

// A step's metadata on the device, for its n tokens of `seqs` sequences (worker/shard_inputs.h
// StepBatch): each token's position, sequence and cache slot; each sequence's block table.
struct StepMeta {
  Tensor positions, token_seq, slots;  // [n] I32
  Tensor block_tables;                 // [seqs, max_blocks_per_seq] I32
};

// What a latent-attention layer (DecoderBlocks::LatentAttention) works in for n tokens.
struct MlaScratch {
  Tensor q_a;     // [n, q_lora_rank] q_a_proj's output (with q_lora_rank)
  Tensor q_nope;  // [n, heads * qk_nope_head_dim] q's part without RoPE (this rank's heads)
  Tensor q_pe;    // [n, heads * qk_rope_head_dim] q's part with RoPE
  Tensor kv_c;    // [n, kv_lora_rank] the latent, normed
  Tensor k_pe;    // [n, qk_rope_head_dim] the RoPE key every head shares
};

// The activations a layer works in, n rows each.
struct LayerScratch {
  Tensor normed;       // [n, hidden] the block's normed input
  Tensor q, k, v;      // [n, q], [n, kv], [n, kv] this rank's heads
  Tensor attn;         // [n, q] attention output
  Tensor proj;         // [n, hidden] o_proj / down_proj output (partial sums until summed)
  Tensor gate, up;     // [n, f] the MLP's products
  MoeScratch moe;      // a sparse layer's (models with experts only)
  MoeHostScratch* moe_host = nullptr;
  MlaScratch mla;      // a latent-attention layer's (DeepSeek-V3 only)
};

// One kind of layer's rotary embedding (ModelConfig::LayerRopeTable: Gemma 3's global and sliding
// layers have their own): its frequencies on the device and the kernel's options.
struct DeviceRope {
  Tensor inv_freq;       // [rotary_dim / 2] F32
  Tensor long_inv_freq;  // [rotary_dim / 2] F32 (LongRoPE's, read only then)
  RopeOptions options;   // its long_inv_freq points at the field above
};

// What every layer of a model computes with, from its config.json.
class DecoderBlocks {
 public:
  // `rope`: one entry per RoPE table of the model (ModelConfig::LayerRopeTable indexes it); it must
  // outlive the blocks and not move.
  DecoderBlocks(Backend* backend, const TpPlan* tp, const ModelConfig& config, const std::vector<DeviceRope>* rope);

  // Decoder layer `layer` (its index in the model) over the step's n tokens. On entry `x` [n, hidden]
  // is the residual stream and s.normed its input norm (the previous layer computed it, fused with
  // its residual add); on return `x` is the layer's output and, when `next_input_norm` is not
  // null, s.normed is that norm of it.
  absl::Status Layer(int64_t layer, const LayerWeights& w, KvCache& cache, const StepMeta& meta, LayerScratch& s,
                     Tensor* x, const Tensor* next_input_norm) const;
  // An EAGLE-3 head's layer (FamilyDeclaration::eagle3): as Layer's pre-norm one, but its attention
  // reads `cat` [n, 2 hidden] (the token's normed embedding and the normed hidden state side by
  // side) where Layer's reads s.normed; `x` the residual stream on entry, the layer's output (before
  // the final norm) on return.
  absl::Status Eagle3Layer(int64_t layer, const LayerWeights& w, KvCache& cache, const StepMeta& meta,
                           LayerScratch& s, const Tensor& cat, Tensor* x) const;
  // The token embedding (vocab-parallel: each rank looks up its rows, zeros elsewhere, and the sum
  // fills in the rest), times the family's scale.
  absl::Status Embed(Tensor* x, const Tensor& table, const Tensor& ids) const;
  // The last stage's head on the rows whose logits are wanted: final norm, then this rank's
  // vocabulary slice of the logits [m, local vocab rows] F32 (soft-capped where the family caps them).
  absl::Status LocalLogits(Tensor* logits, const Tensor& rows, Tensor* normed, const Tensor& final_norm,
                           const Tensor& lm_head) const;

 private:
  // normed -> s.proj: this rank's heads' attention output through o_proj, summed over the group.
  absl::Status SelfAttention(int64_t layer, const LayerWeights& w, KvCache& cache, const StepMeta& meta,
                             LayerScratch& s) const;
  // normed -> s.proj: DeepseekV3Attention, multi-head latent attention over the latent cache
  // (Backend::MlaAttention) on this rank's heads, through o_proj, summed over the group.
  absl::Status LatentAttention(int64_t layer, const LayerWeights& w, KvCache& cache, const StepMeta& meta,
                               LayerScratch& s) const;
  // normed -> s.proj: act(gate_proj(h)) * up_proj(h) through down_proj, summed over the group.
  absl::Status GatedMlp(const LayerWeights& w, LayerScratch& s) const;
  // out = down_proj(silu(gate_proj(x)) * up_proj(x)) on this rank's slice of the intermediate size,
  // in gate and up; out is this rank's partial sum (the caller sums it).
  absl::Status SwiGlu(Tensor* out, Tensor* gate, Tensor* up, const Tensor& x, const Tensor& gate_proj,
                      const Tensor& up_proj, const Tensor& down_proj) const;
  // normed -> s.proj: the mixture of experts, as transformers' Qwen3MoeSparseMoeBlock and
  // MixtralSparseMoeBlock compute it (router, top-k, each expert's SwiGLU on its tokens, the
  // weighted sum), plus Qwen2MoeSparseMoeBlock's gated shared expert where the layer has one
  // (DeepseekV3MoE: its router, and its shared experts ungated), under the plan's split of the
  // experts (tp_.experts: cut and summed once, or whole on their ranks with the tokens sent to them
  // and gathered back).
  absl::Status MoeMlp(const LayerWeights& w, LayerScratch& s) const;
  // The layer's MLP: MoeMlp where the layer has a router (a sparse layer), else GatedMlp.
  absl::Status Mlp(const LayerWeights& w, LayerScratch& s) const;
  // x += residual, then normed = next_norm(x) when there is a next norm (one pass where the backend
  // fuses them).
  absl::Status AddThenNorm(Tensor* x, const Tensor& residual, LayerScratch& s, const Tensor* next_norm) const;

  Backend& be_;
  const TpPlan& tp_;
  const ModelConfig& config_;
  const std::vector<DeviceRope>& rope_;
  const float eps_;
  const float attention_scale_;
  float embedding_scale_ = 0;  // in the act dtype's precision; 0 for none
  MoeRouting routing_;         // the sparse layers' router (models with experts only)
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_SHARD_DECODER_H_
