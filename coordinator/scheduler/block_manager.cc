#include "coordinator/scheduler/block_manager.h"

namespace shardserve {

BlockManager::BlockManager(int64_t num_blocks, int64_t block_size) : num_blocks_(num_blocks), block_size_(block_size) {
  free_.reserve(num_blocks);
  // Block 0 on top, so a fresh cache hands out 0, 1, 2, ...
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

bool BlockManager::Grow(std::vector<int32_t>* table, int64_t tokens) {
  const int64_t want = BlocksFor(tokens) - static_cast<int64_t>(table->size());
  if (want <= 0) return true;
  if (want > num_free()) return false;
  for (int64_t i = 0; i < want; ++i) {
    table->push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

void BlockManager::Free(std::vector<int32_t>* table) {
  // Last block first, so that a table freed and grown again gets its blocks back in order.
  for (auto it = table->rbegin(); it != table->rend(); ++it) free_.push_back(*it);
  table->clear();
}

}  // namespace shardserve
