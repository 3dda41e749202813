// The KV-cache pools of a shard: every layer's paged cache is in the full pool of
// StepLimits::num_kv_blocks blocks, indexed by the step's slots and block_tables, except, where the
// coordinator gives the sliding layers a pool of their own (num_sliding_kv_blocks > 0; Gemma 2 and
// 3, model/kv_blocks.h InSlidingPool), the sliding layers', in the sliding pool of
// num_sliding_kv_blocks blocks, indexed by sliding_slots and sliding_block_tables
// (worker/shard_inputs.h StepBatch).
#ifndef SHARDSERVE_WORKER_SHARD_KV_POOLS_H_
#define SHARDSERVE_WORKER_SHARD_KV_POOLS_H_

#include <cstdint>

#include "model/config.h"
#include "model/kv_blocks.h"
#include "model/step_limits.h"

namespace shardserve {

// Whether layer `layer` of `config` keeps its K and V in the sliding layers' pool under `limits`.
inline bool LayerInSlidingPool(const ModelConfig& config, const StepLimits& limits, int64_t layer) {
  return limits.num_sliding_kv_blocks > 0 && InSlidingPool(config, layer);
}

// The blocks of layer `layer`'s cache: its pool's.
inline int64_t LayerKvBlocks(const ModelConfig& config, const StepLimits& limits, int64_t layer) {
  return LayerInSlidingPool(config, limits, layer) ? limits.num_sliding_kv_blocks : limits.num_kv_blocks;
}

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_SHARD_KV_POOLS_H_
