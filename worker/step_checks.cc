#include "worker/step_checks.h"

#include <algorithm>

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "model/kv_blocks.h"
#include "model/sampling_bounds.h"
#include "model/shard_identity.h"
#include "model/sharding.h"

namespace shardserve {
namespace {

// Bounds on what an assignment may ask for: far above any real deployment, low enough that no
// product of them overflows and a corrupt message cannot ask for absurd allocations.
constexpr int64_t kMaxRanks = 1024;
constexpr double kMaxCollectiveTimeoutSeconds = 24 * 3600;

// The end of `spec`'s layer range, -1 resolved.
int64_t EndLayer(const ShardSpec& spec, const ModelConfig& config) {
  return spec.end_layer < 0 ? config.num_hidden_layers : spec.end_layer;
}

}  // namespace

absl::Status CheckAssignment(const v1::Assignment& a) {
  auto bad = [](auto... parts) { return absl::InvalidArgumentError(absl::StrCat("assignment: ", parts...)); };
  if (a.model_path().empty()) return bad("model_path is empty");
  if (a.num_stages() < 1 || a.num_stages() > kMaxRanks) return bad("num_stages ", a.num_stages(), " outside [1, ", kMaxRanks, "]");
  if (a.stage() < 0 || a.stage() >= a.num_stages()) return bad("stage ", a.stage(), " outside [0, ", a.num_stages(), ")");
  if (a.tp_size() < 1 || a.tp_size() > kMaxRanks) return bad("tp_size ", a.tp_size(), " outside [1, ", kMaxRanks, "]");
  if (a.tp_rank() < 0 || a.tp_rank() >= a.tp_size()) return bad("tp_rank ", a.tp_rank(), " outside [0, ", a.tp_size(), ")");
  if (a.tp_size() > 1 && a.tp_group().empty()) return bad("tp_group is empty but tp_size is ", a.tp_size());
  if (a.stage() > 0 && a.recv_group().empty()) return bad("recv_group is empty on stage ", a.stage());
  if (a.stage() + 1 < a.num_stages() && a.send_group().empty()) return bad("send_group is empty on stage ", a.stage());
  if (!v1::WeightQuantization_IsValid(a.weight_quantization())) {
    return bad("weight_quantization ", static_cast<int>(a.weight_quantization()), " is not one this worker knows");
  }
  if (!a.draft_model_path().empty() && a.speculative_mtp()) {
    return bad("draft_model_path and speculative_mtp are both set; speculative decoding has one proposer");
  }
  if (a.speculative_eagle3() && (a.draft_model_path().empty() || a.speculative_mtp())) {
    return bad("speculative_eagle3 needs draft_model_path (the head's directory) and not speculative_mtp");
  }
  if (a.aux_hidden_layers_size() > 16) return bad(a.aux_hidden_layers_size(), " aux_hidden_layers; at most 16");
  if (!a.has_limits()) return bad("limits are missing");
  if (absl::Status s = FromProto(a.limits()).ValidateDecided(); !s.ok()) return bad(s.message());
  if (!(a.collective_timeout_seconds() > 0 && a.collective_timeout_seconds() <= kMaxCollectiveTimeoutSeconds)) {
    return bad("collective_timeout_seconds ", a.collective_timeout_seconds(), " outside (0, ",
               kMaxCollectiveTimeoutSeconds, "]");
  }
  return absl::OkStatus();
}

absl::Status CheckShard(const ModelConfig& config, const ShardSpec& spec, const StepLimits& limits) {
  // (a multi-token-prediction layer's shard: one of those layers, whole on one rank)
  const int64_t L = config.num_hidden_layers + (spec.mtp ? config.num_nextn_predict_layers : 0),
                end = EndLayer(spec, config);
  if (spec.mtp && (spec.first_layer < config.num_hidden_layers || end != spec.first_layer + 1 || spec.tp_size != 1)) {
    return absl::InvalidArgumentError(absl::StrCat("layer range [", spec.first_layer, ", ", end, ") on ", spec.tp_size,
                                                   " ranks is not one multi-token-prediction layer of the model's ",
                                                   config.num_nextn_predict_layers, " on one rank"));
  }
  if (spec.eagle3 && (!config.eagle3.has_value() || spec.tp_size != 1)) {
    return absl::InvalidArgumentError(absl::StrCat(config.architecture_name, " on ", spec.tp_size,
                                                   " ranks is not an EAGLE-3 head on one rank"));
  }
  for (size_t i = 0; i < spec.aux_hidden_layers.size(); ++i) {
    const int64_t a = spec.aux_hidden_layers[i];
    if (a < 0 || a >= config.num_hidden_layers || (i > 0 && a <= spec.aux_hidden_layers[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat("aux_hidden_layers: layer ", a, " at ", i,
                                                     " is not one of the model's ", config.num_hidden_layers,
                                                     " layers in ascending order"));
    }
  }
  if (spec.first_layer < 0 || spec.first_layer >= end || end > L) {
    return absl::InvalidArgumentError(absl::StrCat("layer range [", spec.first_layer, ", ", end,
                                                   ") is not a non-empty part of the model's ", L, " layers"));
  }
  SHARDSERVE_RETURN_IF_ERROR(limits.ValidateDecided());
  if (limits.num_sliding_kv_blocks != 0 && SlidingPoolWindow(config) == 0) {
    // Only a model whose sliding layers sit beside full-attention ones has a pool for them.
    return absl::InvalidArgumentError(absl::StrCat(
        "step limits: num_sliding_kv_blocks ", limits.num_sliding_kv_blocks, " for a model with ",
        config.num_hidden_layers, " layers of which none slides beside a full-attention one: it has no sliding "
        "layers' pool (0)"));
  }
  SHARDSERVE_RETURN_IF_ERROR(ComputeTpShard(config, spec.tp_rank, spec.tp_size, spec.expert_parallel).status());
  return CheckQuantizedShard(config, spec.tp_size, spec.weight_quant, spec.expert_parallel);
}

ShardSpec ShardSpecOf(const v1::Assignment& a) {
  const WeightQuant quant = a.weight_quantization() == v1::WEIGHT_QUANTIZATION_INT8   ? WeightQuant::kInt8
                            : a.weight_quantization() == v1::WEIGHT_QUANTIZATION_INT4 ? WeightQuant::kInt4
                            : a.weight_quantization() == v1::WEIGHT_QUANTIZATION_FP8  ? WeightQuant::kFp8
                                                                                      : WeightQuant::kNone;
  ShardSpec spec{a.first_layer(), a.end_layer(), a.tp_rank(), a.tp_size(), quant, a.expert_parallel()};
  spec.aux_hidden_layers.assign(a.aux_hidden_layers().begin(), a.aux_hidden_layers().end());
  return spec;
}

absl::Status CheckStageLayers(const v1::Assignment& a, const ModelConfig& config) {
  const ShardSpec spec = ShardSpecOf(a);
  const bool first = a.stage() == 0, last = a.stage() + 1 == a.num_stages();
  if ((spec.first_layer == 0) != first || (EndLayer(spec, config) == config.num_hidden_layers) != last) {
    return absl::InvalidArgumentError(absl::StrCat("assignment: stage ", a.stage(), " of ", a.num_stages(),
                                                   " does not match layers [", a.first_layer(), ", ", a.end_layer(),
                                                   ") of ", config.num_hidden_layers));
  }
  return absl::OkStatus();
}

absl::Status CheckRegroup(const v1::Assignment& a, uint64_t epoch, const v1::Regroup& r) {
  const bool first = a.stage() == 0, last = a.stage() + 1 == a.num_stages();
  if (r.epoch() <= epoch) {
    return absl::InvalidArgumentError(absl::StrCat("regroup: epoch ", r.epoch(), " is not after the current ", epoch));
  }
  if (a.tp_size() > 1 && r.tp_group().empty()) return absl::InvalidArgumentError("regroup: tp_group is empty");
  if (!first && r.recv_group().empty()) return absl::InvalidArgumentError("regroup: recv_group is empty");
  if (!last && r.send_group().empty()) return absl::InvalidArgumentError("regroup: send_group is empty");
  return absl::OkStatus();
}

v1::Regroup RegroupOf(const v1::Assignment& a) {
  v1::Regroup r;
  r.set_epoch(a.epoch());
  r.set_tp_group(a.tp_group());
  r.set_send_group(a.send_group());
  r.set_recv_group(a.recv_group());
  r.set_rendezvous_token(a.rendezvous_token());
  return r;
}

absl::Status CheckAdopt(const v1::Assignment& held, uint64_t epoch, const v1::Assignment& wanted) {
  SHARDSERVE_RETURN_IF_ERROR(SameShard(held, wanted));
  if (wanted.epoch() <= epoch) {
    return absl::InvalidArgumentError(absl::StrCat("adopt: epoch ", wanted.epoch(), " is not after the current ", epoch));
  }
  return CheckRegroup(wanted, epoch, RegroupOf(wanted));
}

absl::Status CheckTokenMasks(const v1::StepPlan& plan, int64_t logit_rows, int64_t vocab_size,
                             std::vector<const uint32_t*>* masks) {
  masks->assign(static_cast<size_t>(std::max<int64_t>(0, logit_rows)), nullptr);
  const int n = plan.mask_logit_rows_size();
  if (n == 0 && plan.mask_words_size() == 0) return absl::OkStatus();
  const int64_t words = (vocab_size + 31) / 32;
  const auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("step ", plan.step_id(), ": token masks: ", what));
  };
  if (static_cast<int64_t>(plan.mask_words_size()) != n * words) {
    return bad(absl::StrCat(plan.mask_words_size(), " mask_words for ", n, " masked rows; want ", words,
                            " per row (vocab_size ", vocab_size, ")"));
  }
  for (int i = 0; i < n; ++i) {
    const int32_t row = plan.mask_logit_rows(i);
    if (row < 0 || row >= logit_rows || (i > 0 && row <= plan.mask_logit_rows(i - 1))) {
      return bad(absl::StrCat("mask_logit_rows[", i, "] ", row, " is not increasing within the step's ", logit_rows,
                              " logit rows"));
    }
    const uint32_t* mask = plan.mask_words().data() + i * words;
    if (vocab_size % 32 != 0 && (mask[words - 1] >> (vocab_size % 32)) != 0) {
      return bad(absl::StrCat("the mask of logit row ", row, " allows ids at or past vocab_size ", vocab_size));
    }
    if (std::all_of(mask, mask + words, [](uint32_t w) { return w == 0; })) {
      return bad(absl::StrCat("the mask of logit row ", row, " allows no token"));
    }
    (*masks)[row] = mask;
  }
  return absl::OkStatus();
}

absl::Status CheckRowSampling(uint64_t step_id, const google::protobuf::RepeatedPtrField<v1::RowSampling>& rows,
                              int64_t vocab_size) {
  for (int i = 0; i < rows.size(); ++i) {
    const v1::RowSampling& r = rows[i];
    const auto bad = [&](absl::string_view field, const auto& value, absl::string_view want) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step_id, " row ", i, ": ", field, " ", value, " ", want));
    };
    // Written so that NaN fails every check.
    if (!(std::isfinite(r.temperature()) && r.temperature() >= 0)) {
      return bad("temperature", r.temperature(), "must be finite and >= 0 (0: greedy)");
    }
    if (r.top_k() < 0) return bad("top_k", r.top_k(), "must be >= 0 (0: no limit)");
    if (!(r.top_p() >= 0 && r.top_p() <= 1)) return bad("top_p", r.top_p(), "is outside [0, 1] (0 or 1: no limit)");
    if (!(r.min_p() >= 0 && r.min_p() <= 1)) return bad("min_p", r.min_p(), "is outside [0, 1] (0: off)");
    if (!(r.repetition_penalty() >= 0 && r.repetition_penalty() <= kMaxRepetitionPenalty)) {
      return bad("repetition_penalty", r.repetition_penalty(),
                 absl::StrCat("must be 0 (off) or in (0, ", kMaxRepetitionPenalty, "]"));
    }
    for (auto [field, value] : {std::pair{"presence_penalty", r.presence_penalty()},
                                std::pair{"frequency_penalty", r.frequency_penalty()}}) {
      if (!(value >= -kMaxAbsPresenceFrequencyPenalty && value <= kMaxAbsPresenceFrequencyPenalty)) {
        return bad(field, value,
                   absl::StrCat("is outside [", -kMaxAbsPresenceFrequencyPenalty, ", ", kMaxAbsPresenceFrequencyPenalty, "]"));
      }
    }
    if (r.top_logprobs() < 0 || r.top_logprobs() > kMaxTopLogprobs) {
      return bad("top_logprobs", r.top_logprobs(), absl::StrCat("is outside [0, ", kMaxTopLogprobs, "]"));
    }
    if (r.top_logprobs() > 0 && !r.logprobs()) return bad("top_logprobs", r.top_logprobs(), "is set without logprobs");
    if (r.logit_bias_ids_size() != r.logit_bias_values_size() || r.logit_bias_ids_size() > kMaxLogitBiasEntries) {
      return bad("logit_bias_ids", r.logit_bias_ids_size(),
                 absl::StrCat("ids need as many logit_bias_values (", r.logit_bias_values_size(), "), at most ",
                              kMaxLogitBiasEntries));
    }
    for (int j = 0; j < r.logit_bias_values_size(); ++j) {
      const float b = r.logit_bias_values(j);
      if (!(b >= -kMaxAbsLogitBias && b <= kMaxAbsLogitBias)) {
        return bad(absl::StrCat("logit_bias_values[", j, "]"), b,
                   absl::StrCat("is outside [", -kMaxAbsLogitBias, ", ", kMaxAbsLogitBias, "]"));
      }
    }
    if (r.min_tokens() < 0) return bad("min_tokens", r.min_tokens(), "must be >= 0 (0: off)");
    if (r.has_prompt_logprobs() && (r.prompt_logprobs() < 0 || r.prompt_logprobs() > kMaxTopLogprobs)) {
      return bad("prompt_logprobs", r.prompt_logprobs(), absl::StrCat("is outside [0, ", kMaxTopLogprobs, "]"));
    }
    if (r.allowed_ids_size() > kMaxAllowedTokenIds) {
      return bad("allowed_ids", r.allowed_ids_size(), absl::StrCat("ids; at most ", kMaxAllowedTokenIds));
    }
    if (r.bad_word_lengths_size() > kMaxBadWordSequences) {
      return bad("bad_word_lengths", r.bad_word_lengths_size(), absl::StrCat("sequences; at most ", kMaxBadWordSequences));
    }
    int64_t bad_ids = 0;
    for (int j = 0; j < r.bad_word_lengths_size(); ++j) {
      const int32_t n = r.bad_word_lengths(j);
      if (n < 1 || n > kMaxBadWordTokens) {
        return bad(absl::StrCat("bad_word_lengths[", j, "]"), n, absl::StrCat("is outside [1, ", kMaxBadWordTokens, "]"));
      }
      bad_ids += n;
    }
    if (bad_ids != r.bad_word_ids_size()) {
      return bad("bad_word_ids", r.bad_word_ids_size(), absl::StrCat("ids; the lengths add up to ", bad_ids));
    }
    if (r.has_scored_id() && (r.scored_id() < 0 || r.scored_id() >= vocab_size || !r.logprobs())) {
      return bad("scored_id", r.scored_id(),
                 absl::StrCat("must be inside the vocabulary [0, ", vocab_size, ") and come with logprobs"));
    }
    for (auto [field, ids] : {std::pair{"penalty_prompt_ids", &r.penalty_prompt_ids()},
                              std::pair{"penalty_output_ids", &r.penalty_output_ids()},
                              std::pair{"logit_bias_ids", &r.logit_bias_ids()},
                              std::pair{"min_tokens_banned_ids", &r.min_tokens_banned_ids()},
                              std::pair{"allowed_ids", &r.allowed_ids()}, std::pair{"bad_word_ids", &r.bad_word_ids()}}) {
      for (int j = 0; j < ids->size(); ++j) {
        if ((*ids)[j] < 0 || (*ids)[j] >= vocab_size) {
          return bad(absl::StrCat(field, "[", j, "]"), (*ids)[j],
                     absl::StrCat("is outside the vocabulary [0, ", vocab_size, ")"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckStepBatch(const StepBatch& b, const StepLimits& limits, const ModelConfig& config, bool first_stage) {
  const size_t n = b.positions.size();
  auto bad = [](auto... parts) { return absl::InvalidArgumentError(absl::StrCat("step batch: ", parts...)); };
  if (n == 0 || static_cast<int64_t>(n) > limits.max_tokens_per_step) {
    return bad(n, " tokens; a step takes 1 to ", limits.max_tokens_per_step);
  }
  if (b.token_seq.size() != n || b.slots.size() != n || (first_stage && b.token_ids.size() != n)) {
    return bad("token_ids, positions, token_seq and slots must all have ", n, " entries");
  }
  if (b.num_seqs <= 0 || b.num_seqs > limits.max_seqs_per_step) {
    return bad(b.num_seqs, " sequences; a step takes 1 to ", limits.max_seqs_per_step);
  }
  if (static_cast<int64_t>(b.block_tables.size()) != b.num_seqs * limits.max_blocks_per_seq()) {
    return bad("block_tables has ", b.block_tables.size(), " entries, expected ", b.num_seqs, " x ",
               limits.max_blocks_per_seq());
  }
  if (static_cast<int64_t>(b.logit_rows.size()) > limits.max_seqs_per_step) {
    return bad(b.logit_rows.size(), " logit rows; at most ", limits.max_seqs_per_step);
  }
  // The sliding layers' slots and tables: shaped as the others where they have a pool, else none.
  const bool sliding = limits.num_sliding_kv_blocks > 0;
  if (b.sliding_slots.size() != (sliding ? n : 0) ||
      b.sliding_block_tables.size() != (sliding ? b.block_tables.size() : 0)) {
    return bad("sliding_slots has ", b.sliding_slots.size(), " and sliding_block_tables ",
               b.sliding_block_tables.size(), " entries, expected ", sliding ? n : 0, " and ",
               sliding ? b.block_tables.size() : 0, " (num_sliding_kv_blocks ", limits.num_sliding_kv_blocks, ")");
  }
  const int64_t slots = limits.num_kv_blocks * limits.block_size;
  const int64_t sliding_slots = limits.num_sliding_kv_blocks * limits.block_size;
  for (size_t t = 0; t < b.sliding_slots.size(); ++t) {
    if (b.sliding_slots[t] < 0 || b.sliding_slots[t] >= sliding_slots) {
      return bad("sliding cache slot ", b.sliding_slots[t], " outside [0, ", sliding_slots, ")");
    }
  }
  for (int32_t block : b.sliding_block_tables) {
    if (block < 0 || block >= limits.num_sliding_kv_blocks) {
      return bad("sliding block ", block, " outside [0, ", limits.num_sliding_kv_blocks, ")");
    }
  }
  // (an EAGLE-3 head embeds the model's ids: its embedding's vocabulary, not its LM head's)
  const int64_t vocab = config.eagle3.has_value() ? config.eagle3->embedding_vocab_size : config.vocab_size;
  for (size_t t = 0; t < n; ++t) {
    if (first_stage && (b.token_ids[t] < 0 || b.token_ids[t] >= vocab)) {
      return bad("token id ", b.token_ids[t], " outside the vocabulary [0, ", vocab, ")");
    }
    if (b.positions[t] < 0 || b.positions[t] >= limits.max_blocks_per_seq() * limits.block_size ||
        (config.max_position_embeddings > 0 && b.positions[t] >= config.max_position_embeddings)) {
      return bad("position ", b.positions[t], " outside the context this shard serves");
    }
    if (b.token_seq[t] < 0 || b.token_seq[t] >= b.num_seqs) return bad("token_seq ", b.token_seq[t], " out of range");
    if (b.slots[t] < 0 || b.slots[t] >= slots) return bad("cache slot ", b.slots[t], " outside [0, ", slots, ")");
  }
  for (int32_t block : b.block_tables) {
    if (block < 0 || block >= limits.num_kv_blocks) return bad("block ", block, " outside [0, ", limits.num_kv_blocks, ")");
  }
  for (int32_t r : b.logit_rows) {
    if (r < 0 || static_cast<size_t>(r) >= n) return bad("logit row ", r, " outside the step's ", n, " tokens");
  }
  return absl::OkStatus();
}

}  // namespace shardserve
