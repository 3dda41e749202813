#include "model/step_limits.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {
namespace {

// Far above any real step, and low enough that no product of two of them overflows: a corrupt
// Assignment cannot ask a worker for absurd allocations.
constexpr int64_t kMaxStepItems = int64_t{1} << 20;

absl::Status Bad(const std::string& what) { return absl::InvalidArgumentError(absl::StrCat("step limits: ", what)); }

// Validate() with lo = 0, ValidateDecided() with lo = 1: the lowest num_kv_blocks and max_model_len.
absl::Status Check(const StepLimits& l, int64_t lo) {
  const auto [max_tokens_per_step, max_seqs_per_step, block_size, num_kv_blocks, max_model_len,
              num_sliding_kv_blocks] = l;
  for (auto [name, v] : {std::pair{"max_tokens_per_step", max_tokens_per_step},
                         {"max_seqs_per_step", max_seqs_per_step},
                         {"block_size", block_size}}) {
    if (v < 1 || v > kMaxStepItems) return Bad(absl::StrCat(name, " ", v, " outside [1, ", kMaxStepItems, "]"));
  }
  if (max_tokens_per_step < max_seqs_per_step) {
    return Bad(absl::StrCat("max_tokens_per_step ", max_tokens_per_step, " is below max_seqs_per_step ",
                            max_seqs_per_step, ": every running sequence's decode must fit in one step"));
  }
  // Blocks of block_size tokens addressed by 32-bit slots.
  const int64_t max_blocks = kMaxKvCacheTokens / block_size;
  if (num_kv_blocks < lo || num_kv_blocks > max_blocks) {
    return Bad(absl::StrCat("num_kv_blocks ", num_kv_blocks, " outside [", lo, ", ", max_blocks, "]: a KV cache holds at most ",
                            kMaxKvCacheTokens, " tokens (", max_blocks, " blocks of ", block_size, ")"));
  }
  if (num_sliding_kv_blocks < 0 || num_sliding_kv_blocks > max_blocks) {
    return Bad(absl::StrCat("num_sliding_kv_blocks ", num_sliding_kv_blocks, " outside [0, ", max_blocks,
                            "]: a KV cache holds at most ", kMaxKvCacheTokens, " tokens (", max_blocks, " blocks of ",
                            block_size, ")"));
  }
  if (max_model_len < lo || max_model_len > kMaxKvCacheTokens) {
    return Bad(absl::StrCat("max_model_len ", max_model_len, " outside [", lo, ", ", kMaxKvCacheTokens, "]"));
  }
  if (max_seqs_per_step * l.max_blocks_per_seq() > kMaxStepItems) {
    return Bad(absl::StrCat("block tables of ", max_seqs_per_step, " sequences x ", l.max_blocks_per_seq(),
                            " blocks (max_model_len ", max_model_len, " / block_size ", block_size,
                            ") exceed ", kMaxStepItems, " entries: lower max_seqs_per_step or max_model_len"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status StepLimits::Validate() const { return Check(*this, 0); }
absl::Status StepLimits::ValidateDecided() const { return Check(*this, 1); }

void ToProto(const StepLimits& limits, v1::StepLimits* out) {
  out->set_max_tokens_per_step(limits.max_tokens_per_step);
  out->set_max_seqs_per_step(limits.max_seqs_per_step);
  out->set_block_size(limits.block_size);
  out->set_num_kv_blocks(limits.num_kv_blocks);
  out->set_max_model_len(limits.max_model_len);
  out->set_num_sliding_kv_blocks(limits.num_sliding_kv_blocks);
}

StepLimits DraftStepLimits(const StepLimits& model) {
  StepLimits d;
  d.max_tokens_per_step = model.max_tokens_per_step;
  d.max_seqs_per_step = model.max_seqs_per_step;
  d.block_size = model.block_size;
  d.max_model_len = model.max_model_len + kMaxSpeculativeTokens;
  const int64_t guesses = (kMaxSpeculativeTokens + d.block_size - 1) / d.block_size + 1;
  d.num_kv_blocks = std::min(d.max_seqs_per_step * d.max_blocks_per_seq(),
                             model.num_kv_blocks + d.max_seqs_per_step * guesses);
  d.num_sliding_kv_blocks = 0;  // sliding layers, if any, read their window through the one table
  return d;
}

StepLimits FromProto(const v1::StepLimits& in) {
  return StepLimits{in.max_tokens_per_step(), in.max_seqs_per_step(), in.block_size(), in.num_kv_blocks(),
                    in.max_model_len(), in.num_sliding_kv_blocks()};
}

}  // namespace shardserve
