#include "model/sharding.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardserve {

absl::Status CheckTpDivides(const ModelConfig& c, int t, bool expert_parallel) {
  if (t < 1) return absl::InvalidArgumentError(absl::StrCat("tensor parallel size must be >= 1, got ", t));
  if (expert_parallel && c.num_experts == 0) {
    return absl::InvalidArgumentError(absl::StrCat("expert parallelism: ", c.architecture_name,
                                                   " has no experts (a dense model); serve it without --expert-parallel"));
  }
  if (expert_parallel && c.num_experts < t) {
    return absl::InvalidArgumentError(absl::StrCat("expert parallelism: the ", c.num_experts,
                                                   " experts cannot give each of the tensor parallel size ", t,
                                                   " ranks one; use a smaller TP or no --expert-parallel"));
  }
  if (c.num_attention_heads % t != 0)
    return absl::InvalidArgumentError(absl::StrCat("tensor parallel size ", t, " does not divide the ",
                                                   c.num_attention_heads, " attention heads"));
  const int64_t kv = c.num_key_value_heads;
  if (!(kv % t == 0 || t % kv == 0))
    return absl::InvalidArgumentError(absl::StrCat("tensor parallel size ", t, " and the ", kv,
                                                   " key/value heads: one must divide the other"));
  if (c.intermediate_size % t != 0)
    return absl::InvalidArgumentError(absl::StrCat("tensor parallel size ", t, " does not divide intermediate_size ",
                                                   c.intermediate_size));
  if (!expert_parallel && c.num_experts > 0 && c.moe_intermediate_size % t != 0)
    return absl::InvalidArgumentError(absl::StrCat("tensor parallel size ", t,
                                                   " does not divide the experts' intermediate size ",
                                                   c.moe_intermediate_size));
  if (!expert_parallel && c.shared_expert_intermediate_size % t != 0)
    return absl::InvalidArgumentError(absl::StrCat("tensor parallel size ", t,
                                                   " does not divide the shared expert's intermediate size ",
                                                   c.shared_expert_intermediate_size));
  return absl::OkStatus();
}

Range ExpertRange(int64_t experts, int r, int t) { return {r * experts / t, (r + 1) * experts / t}; }

absl::StatusOr<TpShard> ComputeTpShard(const ModelConfig& c, int r, int t, bool expert_parallel) {
  SHARDSERVE_RETURN_IF_ERROR(CheckTpDivides(c, t, expert_parallel));
  if (r < 0 || r >= t) return absl::InvalidArgumentError(absl::StrCat("tensor parallel rank ", r, " outside [0, ", t, ")"));
  TpShard s;
  s.tp_rank = r;
  s.tp_size = t;
  s.q_heads = c.num_attention_heads / t;
  s.q_rows = {r * s.q_heads * c.head_dim, (r + 1) * s.q_heads * c.head_dim};
  const int64_t kv = c.num_key_value_heads;
  if (t <= kv) {
    s.kv_heads = kv / t;
    s.kv_rows = {r * s.kv_heads * c.head_dim, (r + 1) * s.kv_heads * c.head_dim};
  } else {
    s.kv_heads = 1;
    const int64_t head = r / (t / kv);
    s.kv_rows = {head * c.head_dim, (head + 1) * c.head_dim};
  }
  const int64_t inter = c.intermediate_size / t;
  s.mlp_rows = {r * inter, (r + 1) * inter};
  // The experts: all of them, each cut like the MLP; or (expert parallelism) this rank's block of
  // them whole, and the shared expert whole.
  s.expert_parallel = expert_parallel;
  const int et = expert_parallel ? 1 : t, er = expert_parallel ? 0 : r;
  s.experts = expert_parallel ? ExpertRange(c.num_experts, r, t) : Range{0, c.num_experts};
  const int64_t expert_inter = c.moe_intermediate_size / et;
  s.expert_rows = {er * expert_inter, (er + 1) * expert_inter};
  const int64_t shared_inter = c.shared_expert_intermediate_size / et;
  s.shared_expert_rows = {er * shared_inter, (er + 1) * shared_inter};
  const int64_t h = s.q_heads;
  s.mla_q_nope_rows = {r * h * c.qk_nope_head_dim, (r + 1) * h * c.qk_nope_head_dim};
  s.mla_q_pe_rows = {r * h * c.qk_rope_head_dim, (r + 1) * h * c.qk_rope_head_dim};
  s.mla_kv_b_rows = {r * h * (c.qk_nope_head_dim + c.v_head_dim), (r + 1) * h * (c.qk_nope_head_dim + c.v_head_dim)};
  s.mla_o_cols = {r * h * c.v_head_dim, (r + 1) * h * c.v_head_dim};
  s.vocab_rows_per_rank = (c.vocab_size + t - 1) / t;
  s.vocab_rows = {std::min(c.vocab_size, r * s.vocab_rows_per_rank),
                  std::min(c.vocab_size, (r + 1) * s.vocab_rows_per_rank)};
  return s;
}

Slice ShardSlice(TpSplit split, const TpShard& s) {
  switch (split) {
    case TpSplit::kReplicated: return Slice{0, 0, -1};
    case TpSplit::kVocabRows: return Slice{0, s.vocab_rows.begin, s.vocab_rows.end};
    case TpSplit::kQRows: return Slice{0, s.q_rows.begin, s.q_rows.end};
    case TpSplit::kKvRows: return Slice{0, s.kv_rows.begin, s.kv_rows.end};
    case TpSplit::kMlpRows: return Slice{0, s.mlp_rows.begin, s.mlp_rows.end};
    case TpSplit::kQCols: return Slice{1, s.q_rows.begin, s.q_rows.end};
    case TpSplit::kMlpCols: return Slice{1, s.mlp_rows.begin, s.mlp_rows.end};
    case TpSplit::kExpertRows: return Slice{0, s.expert_rows.begin, s.expert_rows.end};
    case TpSplit::kExpertCols: return Slice{1, s.expert_rows.begin, s.expert_rows.end};
    case TpSplit::kSharedExpertRows: return Slice{0, s.shared_expert_rows.begin, s.shared_expert_rows.end};
    case TpSplit::kSharedExpertCols: return Slice{1, s.shared_expert_rows.begin, s.shared_expert_rows.end};
    case TpSplit::kMlaQNopeRows: return Slice{0, s.mla_q_nope_rows.begin, s.mla_q_nope_rows.end};
    case TpSplit::kMlaQPeRows: return Slice{0, s.mla_q_pe_rows.begin, s.mla_q_pe_rows.end};
    case TpSplit::kMlaKvBRows: return Slice{0, s.mla_kv_b_rows.begin, s.mla_kv_b_rows.end};
    case TpSplit::kMlaOCols: return Slice{1, s.mla_o_cols.begin, s.mla_o_cols.end};
    case TpSplit::kFirstRank: return Slice{0, 0, -1};
    case TpSplit::kQHeads: return Slice{0, s.tp_rank * s.q_heads, (s.tp_rank + 1) * s.q_heads};
    case TpSplit::kExpertFirstRank: return Slice{0, 0, -1};
  }
  return Slice{0, 0, -1};
}

bool HoldsAny(TpSplit split, const TpShard& s, int64_t expert) {
  if (expert >= 0 && (expert < s.experts.begin || expert >= s.experts.end)) return false;  // another rank's expert
  if (split == TpSplit::kExpertFirstRank) return s.expert_parallel || s.tp_rank == 0;
  return split != TpSplit::kFirstRank || s.tp_rank == 0;
}

namespace {

// model/quantized_checkpoint.h's rules for a published quantized checkpoint split over t ranks:
// each column-parallel product's outputs per rank (q/k/v, the dense MLP's, the experts' and the
// shared experts' gate/up) whole packed int32s, each row-parallel one's inputs per rank (o, the
// down projections) whole packed int32s and whole groups. With expert parallelism the routed and
// shared experts are whole on their ranks. MLA's q_b_proj / kv_a_proj_with_mqa parts and kv_b_proj are read
// dequantized over whole packed int32s around each rank's rows (worker/shard/loader.cc), so only its
// o_proj (heads x v_head_dim inputs) is checked. A size of 0 (no such product) is skipped.
absl::Status CheckCheckpointQuantShard(const ModelConfig& c, int t, bool expert_parallel) {
  const CheckpointQuant& q = *c.checkpoint_quant;
  const int64_t out_multiple = q.output_multiple();
  const int64_t kv_rows = t <= c.num_key_value_heads ? c.kv_dim() / t : c.head_dim;
  const int64_t experts = expert_parallel ? 0 : c.moe_intermediate_size;
  const int64_t shared = expert_parallel ? 0 : c.shared_expert_intermediate_size;
  const std::pair<const char*, int64_t> column[] = {
      {"q_proj", c.mla() ? 0 : c.q_dim() / t},
      {"k_proj / v_proj", c.mla() ? 0 : kv_rows},
      {"gate_proj / up_proj", c.intermediate_size / t},
      {"the experts' gate_proj / up_proj", experts / t},
      {"the shared experts' gate_proj / up_proj", shared / t}};
  for (const auto& [name, rows] : column) {
    if (rows % out_multiple != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          q.Describe(), " checkpoint: ", name, "'s ", rows, " outputs per rank at tensor parallel size ", t,
          " are not a whole number of packed int32s of ", out_multiple, " zero points"));
    }
  }
  const int64_t packed = q.input_multiple(/*split=*/false), whole = q.input_multiple(/*split=*/t > 1);
  const std::pair<const char*, int64_t> row[] = {{"o_proj", c.mla() ? c.num_attention_heads * c.v_head_dim : c.q_dim()},
                                                 {"down_proj", c.intermediate_size},
                                                 {"the experts' down_proj", experts},
                                                 {"the shared experts' down_proj", shared}};
  for (const auto& [name, width] : row) {
    if (width == 0) continue;
    if (width % t != 0 || (width / t) % packed != 0) {
      return absl::InvalidArgumentError(absl::StrCat(q.Describe(), " checkpoint: ", name, "'s input of ", width,
                                                     " columns split over tensor parallel size ", t, " gives ",
                                                     width / t, " per rank, not a whole number of packed int32s of ",
                                                     packed, " values"));
    }
    if ((width / t) % whole != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          q.Describe(), " checkpoint: ", name, "'s input of ", width, " columns split over tensor parallel size ", t,
          " gives ", width / t, " per rank, not a whole number of groups of ", q.group_size,
          " (quantization_config group_size); use a smaller TP",
          absl::StrContains(name, "experts'") && !expert_parallel ? " or --expert-parallel" : ""));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckQuantizedShard(const ModelConfig& c, int t, WeightQuant quant, bool expert_parallel) {
  if (c.checkpoint_quant.has_value()) {
    if (quant != WeightQuant::kNone) {
      return absl::InvalidArgumentError(absl::StrCat("the checkpoint is already quantized (",
                                                     c.checkpoint_quant->Describe(),
                                                     "); load it with --quantization none, not ",
                                                     WeightQuantName(quant)));
    }
    return CheckCheckpointQuantShard(c, t, expert_parallel);
  }
  if (quant != WeightQuant::kInt4 || t <= 1) return absl::OkStatus();
  const std::pair<const char*, int64_t> cut[] = {{"o_proj", c.q_dim()},
                                                 {"down_proj", c.intermediate_size},
                                                 // whole on their ranks under expert parallelism
                                                 {"the experts' down_proj", expert_parallel ? 0 : c.moe_intermediate_size},
                                                 {"the shared expert's down_proj",
                                                  expert_parallel ? 0 : c.shared_expert_intermediate_size}};
  for (const auto& [name, width] : cut) {
    if (width == 0) continue;  // no experts
    if (width % t != 0 || (width / t) % kInt4GroupSize != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "int4 quantization: ", name, "'s input of ", width, " columns split over tensor parallel size ", t, " gives ",
          width / t, " per rank, not a whole number of groups of ", kInt4GroupSize,
          " (each rank quantizes its own slice); use a smaller TP, or int8"));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve
