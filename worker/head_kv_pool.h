// The paged KV pool of a speculative proposer that runs beside the model on the worker that samples
// (a draft model, worker/draft_runner.h; the MTP layer or an EAGLE-3 head, worker/head_runner.h): its
// free blocks, from which each sequence's block table grows and to which it gives blocks back. The
// pool's size is model/step_limits.h DraftStepLimits' num_kv_blocks.
//
// Memory: the free list, reserved at construction. Threading: not thread-safe; the step's thread.
#ifndef SHARDSERVE_WORKER_HEAD_KV_POOL_H_
#define SHARDSERVE_WORKER_HEAD_KV_POOL_H_

#include <cstdint>
#include <vector>

#include "model/kv_blocks.h"

namespace shardserve {

class HeadKvPool {
 public:
  // A pool of `num_blocks` blocks of `block_size` positions, every one free.
  void Init(int64_t num_blocks, int64_t block_size) {
    num_blocks_ = num_blocks;
    block_size_ = block_size;
    free_.reserve(static_cast<size_t>(num_blocks));
    Reset();
  }
  // Every block free (the caller forgets its tables).
  void Reset() {
    free_.clear();
    for (int64_t b = num_blocks_ - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
  }
  // Grows `table` to hold `tokens` positions; false, with none taken, when too few blocks are free.
  bool Cover(std::vector<int32_t>* table, int64_t tokens) {
    const int64_t want = KvBlocksFor(tokens, block_size_) - static_cast<int64_t>(table->size());
    if (want > static_cast<int64_t>(free_.size())) return false;
    for (int64_t i = 0; i < want; ++i) {
      table->push_back(free_.back());
      free_.pop_back();
    }
    return true;
  }
  // Cuts `table` to the blocks of `tokens` positions, giving back those past them.
  void Cut(std::vector<int32_t>* table, int64_t tokens) {
    const size_t keep = static_cast<size_t>(KvBlocksFor(tokens, block_size_));
    while (table->size() > keep) {
      free_.push_back(table->back());
      table->pop_back();
    }
  }
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }

 private:
  int64_t num_blocks_ = 0, block_size_ = 1;
  std::vector<int32_t> free_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_HEAD_KV_POOL_H_
