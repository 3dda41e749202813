// How many KV-cache blocks a layer holds for one sequence: the one formula the coordinator's
// block manager (coordinator/scheduler/block_manager.h) and the planner's memory count
// (coordinator/planner/memory.h) share; and the sliding layers' pool of a model whose
// full-attention layers sit beside sliding ones (Gemma 2 and 3): which layers it holds and how many
// blocks it has, as the planner, the coordinator and the workers all read it.
#ifndef SHARDSERVE_MODEL_KV_BLOCKS_H_
#define SHARDSERVE_MODEL_KV_BLOCKS_H_

#include <algorithm>
#include <cstdint>

#include "model/config.h"

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

// The sliding layers' pool: where some layers slide (ModelConfig::LayerWindow > 0) and others attend
// to the whole context, the sliding ones keep their K and V in a pool of their own
// (StepLimits::num_sliding_kv_blocks, worker.proto NewSeq.sliding_block_ids), from which the
// coordinator lets go of the blocks behind a sequence's window. Its window is the largest of those
// layers' (Gemma's are all alike); 0 where no layer slides or every layer does (Mistral, Phi-3: the
// one pool is theirs).
inline int64_t SlidingPoolWindow(const ModelConfig& config) {
  int64_t window = 0;
  bool full = false;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    window = std::max(window, config.LayerWindow(i));
    full = full || config.LayerWindow(i) == 0;
  }
  return full ? window : 0;
}

// Whether layer `i` keeps its K and V in the sliding layers' pool when there is one.
inline bool InSlidingPool(const ModelConfig& config, int64_t i) {
  return config.LayerWindow(i) > 0 && SlidingPoolWindow(config) > 0;
}

// The sliding layers' pool beside a full-attention pool of `num_kv_blocks` blocks, for sequences of
// up to `max_model_len` tokens fed `chunk` tokens a step, at most `max_seqs` at once: enough for
// every sequence the limits run at once to decode (its window and a token, KvBlocksHeld) beside one
// step's chunk, and for as many max_model_len sequences as the full pool holds (each with its window
// and a step), and for one such sequence; never more than the full pool (where memory cannot give
// the sliding layers that much, the two pools are alike and hold what one pool held for every
// layer). 0 where the model has no such pool or the full pool is empty. Monotone in num_kv_blocks
// (the planner searches on it).
inline int64_t SlidingPoolBlocks(const ModelConfig& config, int64_t num_kv_blocks, int64_t max_model_len, int64_t chunk,
                                 int64_t block_size, int64_t max_seqs) {
  const int64_t window = SlidingPoolWindow(config);
  if (window == 0 || num_kv_blocks <= 0 || max_model_len <= 0 || block_size <= 0) return 0;
  const int64_t full = KvBlocksFor(max_model_len, block_size);
  const int64_t held = KvBlocksHeld(window, chunk, max_model_len, block_size);
  // num_kv_blocks * held / full, rounded up, without overflowing (held <= full).
  const int64_t share = num_kv_blocks / full * held + (num_kv_blocks % full * held + full - 1) / full;
  const int64_t decoding =
      std::max<int64_t>(max_seqs, 1) * KvBlocksHeld(window, 1, max_model_len, block_size) + KvBlocksFor(chunk, block_size);
  return std::min(num_kv_blocks, std::max({share, held, decoding}));
}

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_KV_BLOCKS_H_
