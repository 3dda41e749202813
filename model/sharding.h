// How one tensor-parallel rank's slice of the model is cut. The planner (to count bytes) and the
// worker (to load weights and size its KV cache) both use this, so they cannot disagree.
//
// Per layer, with TP = t and rank r (Megatron-style, as vLLM and gpt-fast do):
//   q_proj, k_proj, v_proj   column-parallel: rank r holds its heads' rows of each (q, k and v are
//                            split separately, because with GQA they have different head counts)
//   o_proj                   row-parallel: rank r holds the columns matching its q heads;
//                            partial sums meet in an all-reduce after o_proj
//   gate_proj, up_proj       column-parallel: rows [r * I/t, (r+1) * I/t)
//   down_proj                row-parallel: the matching columns; all-reduce after down_proj
//   experts' gate/up/down    each expert as a dense MLP over its own intermediate size Ie
//                            (moe_intermediate_size): rows [r * Ie/t, (r+1) * Ie/t) of gate and
//                            up, those columns of down; the router replicated; one all-reduce
//                            after the experts' outputs are combined (Qwen2-MoE's shared
//                            expert likewise over its own size, its gate replicated)
//   norms                    replicated
//   embed_tokens, lm_head    vocab-parallel: rows [r * ceil(V/t), ...) (the last rank may hold
//                            fewer); embedding partials are all-reduced, logits all-gathered
// KV heads: when t <= kv_heads, kv_heads must divide by t and each rank holds kv_heads / t of
// them. When t > kv_heads, t must divide by kv_heads and each KV head is replicated on
// t / kv_heads ranks: rank r holds KV head r / (t / kv_heads).
//
// Worked example: 8 q heads, 2 KV heads, TP = 4 -> each rank holds 2 q heads and 1 KV head;
// ranks 0,1 hold KV head 0 and ranks 2,3 hold KV head 1.
//
// Expert parallelism (--expert-parallel; docs/moe.md) cuts the experts the other way: rank r of
// the TP group holds experts [r * E / t, (r+1) * E / t) whole (floor division, so with an uneven
// split the ranks' counts differ by one: E = 8, t = 3 -> ranks hold experts 0-1, 2-4, 5-7), and
// Qwen2-MoE's shared expert is replicated whole on every rank (each rank computes it on its own
// slice of the tokens, so no partial sums remain and one all-gather joins the slices). The router
// stays replicated; attention, the dense layers, the embedding and the LM head are cut as above.
#ifndef SHARDSERVE_MODEL_SHARDING_H_
#define SHARDSERVE_MODEL_SHARDING_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/quant.h"
#include "model/config.h"
#include "model/weight_source.h"

namespace shardserve {

struct Range {
  int64_t begin = 0;
  int64_t end = 0;  // exclusive
  int64_t size() const { return end - begin; }
};

struct TpShard {
  int tp_rank = 0;
  int tp_size = 1;
  int64_t q_heads = 0;          // local query heads
  int64_t kv_heads = 0;         // local KV heads (replicated ones count once per rank)
  Range q_rows;                 // rows of q_proj (and columns of o_proj): q heads * head_dim
  Range kv_rows;                // rows of k_proj and v_proj
  Range mlp_rows;               // rows of gate_proj/up_proj (and columns of down_proj)
  Range expert_rows;            // rows of each expert's gate_proj/up_proj (and columns of its down_proj)
  Range shared_expert_rows;     // the same of Qwen2-MoE's shared expert
  // Multi-head latent attention's per-head cuts (ModelConfig::mla): rows of the picked q parts
  // without and with RoPE (q heads * qk_nope_head_dim, * qk_rope_head_dim), of kv_b_proj
  // (q heads * (qk_nope_head_dim + v_head_dim)), and columns of o_proj (q heads * v_head_dim).
  Range mla_q_nope_rows, mla_q_pe_rows, mla_kv_b_rows, mla_o_cols;
  Range vocab_rows;             // rows of embed_tokens and lm_head
  bool expert_parallel = false; // experts held whole, the block `experts` of them (else all, cut)
  Range experts;                // the experts this rank holds: ExpertRange, or all of them
  int64_t vocab_rows_per_rank;  // ceil(V / t): the padded width of every rank's logits slice
};

// How a tensor is cut across TP ranks (the ranges above).
enum class TpSplit {
  kReplicated,  // norms: every rank holds all of it
  kVocabRows,   // embed_tokens, lm_head: rows vocab_rows
  kQRows,       // q_proj weight and bias: rows q_rows
  kKvRows,      // k_proj, v_proj weights and biases: rows kv_rows (replicated heads when TP > KV heads)
  kMlpRows,     // gate_proj, up_proj: rows mlp_rows
  kQCols,       // o_proj: columns q_rows
  kMlpCols,     // down_proj: columns mlp_rows
  kExpertRows,  // an expert's gate_proj, up_proj: rows expert_rows
  kExpertCols,  // an expert's down_proj: columns expert_rows
  kSharedExpertRows,  // the shared expert's gate_proj, up_proj: rows shared_expert_rows
  kSharedExpertCols,  // the shared expert's down_proj: columns shared_expert_rows
  kMlaQNopeRows,  // MLA's q part without RoPE: rows mla_q_nope_rows
  kMlaQPeRows,    // MLA's q part with RoPE: rows mla_q_pe_rows
  kMlaKvBRows,    // MLA's kv_b_proj: rows mla_kv_b_rows
  kMlaOCols,      // MLA's o_proj: columns mla_o_cols
  kFirstRank,   // the bias of a row-parallel product (o_proj's): added once to the partial sums
                // that meet in the all-reduce, so rank 0 holds all of it and the others none
  kQHeads,      // one value per query head (gpt-oss's attention sinks): this rank's q_heads of them
  kExpertFirstRank,  // an expert's down_proj bias: whole on rank 0 when the experts are cut (added
                     // once to the partial sums), whole on the expert's rank with expert parallelism
};

// The part of a tensor cut by `split` that `shard` holds (all of it for kFirstRank: ask HoldsAny).
Slice ShardSlice(TpSplit split, const TpShard& shard);
// Whether `shard` holds any of a tensor cut by `split` (false for kFirstRank off rank 0, for
// kExpertFirstRank off rank 0 unless the experts are whole, and for a tensor of expert `expert`
// outside shard.experts; -1: not an expert's).
bool HoldsAny(TpSplit split, const TpShard& shard, int64_t expert = -1);

// The experts rank `tp_rank` of `tp_size` holds under expert parallelism:
// [rank * experts / size, (rank + 1) * experts / size).
Range ExpertRange(int64_t experts, int tp_rank, int tp_size);

// The slice rank `tp_rank` of `tp_size` holds, with the experts whole on their ranks when
// `expert_parallel`. InvalidArgument, naming the numbers, when the heads, KV heads, intermediate
// size or experts' intermediate size do not divide as required (CheckTpDivides).
absl::StatusOr<TpShard> ComputeTpShard(const ModelConfig& config, int tp_rank, int tp_size,
                                       bool expert_parallel = false);

// Checks only divisibility (for the planner's choice of TP before ranks exist). With
// `expert_parallel` the experts' sizes need not divide, but the model must have experts, and at
// least as many as ranks.
absl::Status CheckTpDivides(const ModelConfig& config, int tp_size, bool expert_parallel = false);

// Whether the linear layers can be stored as `quant` (kernels/quant.h) when split over tp_size
// ranks, each rank quantizing its own slice. int4 groups run along the input, so with TP > 1 a
// row-parallel weight's slice (o_proj: q heads x head_dim / t columns; down_proj:
// intermediate_size / t) must be a whole number of groups of 128, or a rank's groups would not be
// the whole weight's; InvalidArgument with the layer, its width, TP and the group size otherwise.
// (With TP = 1, or along an uncut input, a width that is not a multiple of 128 ends each row in a
// shorter group.) int8 and none: always OK. The planner and the worker's load both call this.
// A published quantized checkpoint (config.checkpoint_quant: GPTQ, AWQ, compressed-tensors, FP8)
// takes only `quant` none and its format's rules (model/quantized_checkpoint.h): each rank's
// outputs of q/k/v/gate/up and inputs of o/down a whole number of packed int32s
// (CheckpointQuant::output_multiple / input_multiple), and the inputs of o/down a whole number of
// groups when TP > 1 and groups are contiguous (not GPTQ desc_act).
// With `expert_parallel` the experts are whole (not cut), so their widths are not checked.
absl::Status CheckQuantizedShard(const ModelConfig& config, int tp_size, WeightQuant quant,
                                 bool expert_parallel = false);

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_SHARDING_H_
