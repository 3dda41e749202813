// Greedy decoding of one sequence with the whole model in this process: the reference loop the
// parity tests and `shardserve generate-ids` run against transformers' greedy tokens.
#ifndef SHARDSERVE_WORKER_SHARD_GREEDY_H_
#define SHARDSERVE_WORKER_SHARD_GREEDY_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/shard/model_shard.h"

namespace shardserve {

// Prefill in chunks of at most max_tokens_per_step, then one token per step. Returns the new ids;
// when `step_logits` is not null it receives the F32 logits that chose each new token,
// [steps][vocab], on the host. Logits holding a NaN or an infinity are an Internal error saying so,
// not a token. Where the shard's sliding layers have a pool of their own (num_sliding_kv_blocks > 0),
// the sequence's blocks go round it as a ring (greedy.cc).
absl::StatusOr<std::vector<int32_t>> GreedyGenerate(ModelShard* model, const std::vector<int32_t>& prompt,
                                                    int64_t max_new_tokens,
                                                    std::vector<std::vector<float>>* step_logits = nullptr);

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_SHARD_GREEDY_H_
