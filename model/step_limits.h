// What one step may carry and how the KV cache is cut into blocks: the limits the coordinator's
// scheduler plans every step within and every worker sizes its buffers for, once, at load.
//
// Declared here once. The coordinator takes them from its flags (coordinator_main.cc), decides the
// two that depend on the workers (the plan: KV blocks from the smallest worker's memory, the served
// length from what that cache holds; worker_pool.cc), checks them, hands them by value to the
// scheduler and sends them to every worker in its Assignment (worker.proto StepLimits), where the
// worker checks them again: they came over the network.
#ifndef SHARDSERVE_MODEL_STEP_LIMITS_H_
#define SHARDSERVE_MODEL_STEP_LIMITS_H_

#include <cstdint>

#include "absl/status/status.h"

namespace shardserve {

namespace v1 {
class StepLimits;
}

struct StepLimits {
  int64_t max_tokens_per_step = 512;  // prompt-chunk and decode tokens in one step
  int64_t max_seqs_per_step = 64;     // sequences in one step: the running batch's size
  int64_t block_size = 16;            // tokens per KV-cache block
  int64_t num_kv_blocks = 0;          // KV-cache blocks per worker; 0: not decided yet (the plan's)
  int64_t max_model_len = 0;          // longest sequence, prompt + completion; 0: not decided yet
  // KV-cache blocks per worker for the sliding-window layers of a model that also has
  // full-attention layers (their own pool and block tables; coordinator/scheduler/scheduler.h);
  // 0: no such pool (no sliding layers, or every layer slides and num_kv_blocks is theirs).
  int64_t num_sliding_kv_blocks = 0;

  // Width of a block table: the blocks one sequence may hold (max_model_len / block_size, rounded
  // up). Derived, never stored.
  int64_t max_blocks_per_seq() const { return block_size < 1 ? 0 : (max_model_len + block_size - 1) / block_size; }
  // Tokens the KV cache holds (the sliding layers' own pool aside).
  int64_t kv_cache_tokens() const { return num_kv_blocks * block_size; }

  // Each field in range, with an error that names it and the numbers: every count >= 1 (the two
  // undecided ones may be 0), a step holds each of its sequences' decode (max_tokens_per_step >=
  // max_seqs_per_step), cache slots are 32-bit (kernels/backend.h kMaxKvCacheTokens), and a step's
  // block tables stay small enough to allocate.
  absl::Status Validate() const;
  // Validate(), and num_kv_blocks and max_model_len decided: what a worker allocates for.
  absl::Status ValidateDecided() const;

  bool operator==(const StepLimits&) const = default;
};

// Speculative decoding (docs/speculative-decoding.md): the most guesses a step may feed a sequence
// (--num-speculative-tokens) and a plan may ask a draft model for (StepPlan.num_draft_tokens).
inline constexpr int kMaxSpeculativeTokens = 16;

// The limits a draft model beside a model served within `model` runs within (worker/draft_runner.h):
// its steps as the model's (tokens, sequences, block size); sequences kMaxSpeculativeTokens longer
// (the guesses are fed past a sequence's last token); a KV pool of as many blocks as the model's
// cache, which holds every running sequence's tokens, and room for each sequence's guesses past
// them, never more than every sequence at its longest. The planner counts its cache from these.
StepLimits DraftStepLimits(const StepLimits& model);

// The wire form (worker.proto), and back. FromProto does not check: call ValidateDecided().
void ToProto(const StepLimits& limits, v1::StepLimits* out);
StepLimits FromProto(const v1::StepLimits& in);

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_STEP_LIMITS_H_
