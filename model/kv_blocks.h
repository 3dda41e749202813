// How many KV-cache blocks a layer holds for one sequence: the one formula the coordinator's
// block manager (coordinator/scheduler/block_manager.h) and the planner's memory count
// (coordinator/planner/memory.h) share.
#ifndef SHARDSERVE_MODEL_KV_BLOCKS_H_
#define SHARDSERVE_MODEL_KV_BLOCKS_H_

#include <algorithm>
#include <cstdint>

namespace shardserve {

// Blocks of `block_size` that hold `tokens` tokens.
inline int64_t KvBlocksFor(int64_t tokens, int64_t block_size) { return (tokens + block_size - 1) / block_size; }

// The most blocks a layer holds at once for a sequence of `tokens` tokens fed in steps of at most
// `chunk` tokens: all of them for full attention (`window` 0); for a sliding window, once the blocks
// wholly before the window of the next token are let go, the window before a step's first token
// (window - 1 tokens) and the step's tokens, starting at worst on a block's last slot.
inline int64_t KvBlocksHeld(int64_t window, int64_t chunk, int64_t tokens, int64_t block_size) {
  const int64_t all = KvBlocksFor(tokens, block_size);
  if (window <= 0) return all;
  return std::min(all, KvBlocksFor(window - 1 + chunk + block_size - 1, block_size));
}

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_KV_BLOCKS_H_
