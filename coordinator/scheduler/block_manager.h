// The KV-cache block manager: the coordinator's book of which cache blocks are free. Every worker
// holds the same number of blocks per layer (the plan sizes them from the smallest worker's
// memory), and a sequence's block table (its block ids in position order) travels in each step
// plan, so the workers keep no allocation state of their own.
//
// Threading: not thread-safe (the scheduler's thread owns it).
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_BLOCK_MANAGER_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_BLOCK_MANAGER_H_

#include <cstdint>
#include <vector>

namespace shardserve {

class BlockManager {
 public:
  // `num_blocks` blocks of `block_size` tokens, all free.
  BlockManager(int64_t num_blocks, int64_t block_size);

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  // Blocks that hold `tokens` tokens.
  int64_t BlocksFor(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  // Grows `table` until it holds `tokens` tokens. False, with `table` unchanged, when too few
  // blocks are free.
  bool Grow(std::vector<int32_t>* table, int64_t tokens);
  // Returns every block of `table` and empties it.
  void Free(std::vector<int32_t>* table);

 private:
  const int64_t num_blocks_;
  const int64_t block_size_;
  std::vector<int32_t> free_;  // a stack: the most recently freed block is reused first
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_BLOCK_MANAGER_H_
