#include "coordinator/scheduler/block_manager.h"

#include <openssl/sha.h>

#include <algorithm>
#include <cstring>

#include "absl/container/inlined_vector.h"
#include "model/kv_blocks.h"

namespace shardserve {

absl::uint128 BlockManager::Sha256Key(absl::uint128 parent, const int32_t* tokens, int64_t n) {
  absl::InlinedVector<uint8_t, 16 + 4 * 64> bytes(16 + 4 * n);
  const uint64_t halves[2] = {absl::Uint128Low64(parent), absl::Uint128High64(parent)};
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 8; ++i) bytes[8 * h + i] = static_cast<uint8_t>(halves[h] >> (8 * i));
  }
  for (int64_t t = 0; t < n; ++t) {
    const uint32_t v = static_cast<uint32_t>(tokens[t]);
    for (int i = 0; i < 4; ++i) bytes[16 + 4 * t + i] = static_cast<uint8_t>(v >> (8 * i));
  }
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(bytes.data(), bytes.size(), digest);
  uint64_t lo = 0, hi = 0;
  for (int i = 7; i >= 0; --i) {
    lo = (lo << 8) | digest[i];
    hi = (hi << 8) | digest[8 + i];
  }
  return absl::MakeUint128(hi, lo);
}

BlockManager::BlockManager(int64_t num_blocks, int64_t block_size, bool prefix_caching, KeyFn key_fn)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      prefix_caching_(prefix_caching),
      key_fn_(key_fn != nullptr ? key_fn : &Sha256Key),
      blocks_(num_blocks) {
  free_.reserve(num_blocks);
  // Block 0 on top, so a fresh cache hands out 0, 1, 2, ...
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

int32_t BlockManager::Take() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    b = lru_.front();
    lru_.pop_front();
    Unregister(b);  // evicted
  }
  blocks_[b].refcount = 1;
  return b;
}

bool BlockManager::Grow(std::vector<int32_t>* table, int64_t tokens) {
  const int64_t want = BlocksFor(tokens) - static_cast<int64_t>(table->size());
  if (want <= 0) return true;
  if (want > num_available()) return false;
  for (int64_t i = 0; i < want; ++i) table->push_back(Take());
  return true;
}

void BlockManager::Free(std::vector<int32_t>* table) {
  // Last block first: into the free stack, so that a table freed and grown again gets its blocks
  // back in order; into the LRU list, so that a cached prefix is evicted after its tail.
  for (auto it = table->rbegin(); it != table->rend(); ++it) {
    if (*it == kReleased) continue;
    Block& b = blocks_[*it];
    if (--b.refcount > 0) continue;
    if (b.registered) {
      b.lru = lru_.insert(lru_.end(), *it);
    } else {
      free_.push_back(*it);
    }
  }
  table->clear();
}

int64_t BlockManager::Truncate(std::vector<int32_t>* table, int64_t keep) {
  if (keep >= static_cast<int64_t>(table->size())) return 0;
  std::vector<int32_t> gone(table->begin() + std::max<int64_t>(keep, 0), table->end());
  table->resize(static_cast<size_t>(std::max<int64_t>(keep, 0)));
  const int64_t n = static_cast<int64_t>(gone.size());
  Free(&gone);
  return n;
}

int64_t BlockManager::Release(std::vector<int32_t>* table, int64_t first_kept) {
  const int64_t before = std::min<int64_t>(std::max<int64_t>(first_kept, 0) / block_size_,
                                           static_cast<int64_t>(table->size()));
  std::vector<int32_t> gone;
  for (int64_t i = 0; i < before; ++i) {
    if ((*table)[i] == kReleased) continue;
    gone.push_back((*table)[i]);
    (*table)[i] = kReleased;
  }
  const int64_t n = static_cast<int64_t>(gone.size());
  Free(&gone);
  return n;
}

int64_t BlockManager::Held(const std::vector<int32_t>& table) {
  return std::count_if(table.begin(), table.end(), [](int32_t b) { return b != kReleased; });
}

int64_t BlockManager::WindowBlocks(int64_t window, int64_t chunk, int64_t tokens) const {
  return KvBlocksHeld(window, chunk, tokens, block_size_);
}

std::vector<int32_t> BlockManager::FindCached(const std::vector<int32_t>& tokens, int64_t max_blocks,
                                              Chain* chain) const {
  std::vector<int32_t> found;
  *chain = Chain{};
  if (!prefix_caching_) return found;
  const int64_t n = std::min<int64_t>(max_blocks, static_cast<int64_t>(tokens.size()) / block_size_);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t* first = tokens.data() + i * block_size_;
    const absl::uint128 key = key_fn_(chain->key, first, block_size_);
    auto it = by_key_.find(key);
    if (it == by_key_.end()) break;
    const Block& b = blocks_[it->second];
    // The key may collide: the block must hold these tokens after the very block found before.
    if (b.parent != chain->block || (b.parent >= 0 && b.parent_generation != chain->generation) ||
        !std::equal(first, first + block_size_, b.tokens.begin(), b.tokens.end())) {
      break;
    }
    found.push_back(it->second);
    *chain = Chain{i + 1, key, it->second, b.generation};
  }
  return found;
}

int64_t BlockManager::CountCached(const std::vector<int32_t>& blocks) const {
  return std::count_if(blocks.begin(), blocks.end(), [&](int32_t b) { return blocks_[b].refcount == 0; });
}

void BlockManager::Share(const std::vector<int32_t>& blocks, std::vector<int32_t>* table) {
  for (int32_t id : blocks) {
    Block& b = blocks_[id];
    if (b.refcount++ == 0) lru_.erase(b.lru);
    table->push_back(id);
  }
}

void BlockManager::Register(const std::vector<int32_t>& table, const std::vector<int32_t>& tokens,
                            int64_t num_tokens, Chain* chain) {
  if (!prefix_caching_) return;
  const int64_t full = std::min<int64_t>(num_tokens / block_size_, static_cast<int64_t>(table.size()));
  for (int64_t i = chain->blocks; i < full; ++i) {
    const int32_t* first = tokens.data() + i * block_size_;
    const absl::uint128 key = key_fn_(chain->key, first, block_size_);
    if ((i > 0 && chain->block < 0) || table[i] == kReleased) {
      // The parent could not be registered (a key collision), or the block is gone: no block
      // after it can be verified.
      *chain = Chain{i + 1, key, -1, 0};
      continue;
    }
    Block& b = blocks_[table[i]];
    if (b.registered) {  // shared from the cache: registered under this key
      *chain = Chain{i + 1, key, table[i], b.generation};
      continue;
    }
    auto it = by_key_.find(key);
    if (it != by_key_.end()) {
      const Block& e = blocks_[it->second];
      const bool same = e.parent == chain->block && (e.parent < 0 || e.parent_generation == chain->generation) &&
                        std::equal(first, first + block_size_, e.tokens.begin(), e.tokens.end());
      // Same tokens: computed twice (two sequences at once); the chain goes on from the one
      // registered. A collision: nothing after this block can be registered.
      *chain = same ? Chain{i + 1, key, it->second, e.generation} : Chain{i + 1, key, -1, 0};
      continue;
    }
    b.registered = true;
    ++b.generation;
    b.key = key;
    b.parent = chain->block;
    b.parent_generation = chain->generation;
    b.tokens.assign(first, first + block_size_);
    by_key_.emplace(key, table[i]);
    *chain = Chain{i + 1, key, table[i], b.generation};
  }
}

void BlockManager::Unregister(int32_t id) {
  Block& b = blocks_[id];
  if (!b.registered) return;
  auto it = by_key_.find(b.key);
  if (it != by_key_.end() && it->second == id) by_key_.erase(it);
  b.registered = false;
  ++b.generation;  // the blocks registered after it no longer verify
  b.tokens.clear();
}

void BlockManager::DropCache() {
  for (int32_t id : lru_) {
    Unregister(id);
    free_.push_back(id);
  }
  lru_.clear();
  for (int32_t id = 0; id < static_cast<int32_t>(num_blocks_); ++id) Unregister(id);
  by_key_.clear();
}

}  // namespace shardserve
