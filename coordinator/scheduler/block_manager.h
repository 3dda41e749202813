// The KV-cache block manager: the coordinator's book of the cache blocks. Every worker holds the
// same number of blocks per layer (the plan sizes them from the smallest worker's memory), and a
// sequence's block table (its block ids in position order) travels in the step plans, so the
// workers keep no allocation state of their own.
//
// Automatic prefix caching (as vLLM's): a full block whose KV has been written (or is written by
// a step already sent: every worker runs steps in the order sent) can be registered under a key
// chained over the tokens before and in it; a later sequence whose tokens start the same way
// takes the registered blocks into its table instead of computing them again. Blocks are shared
// by reference count; a sequence only appends after its shared blocks, and only full blocks are
// shared, so a shared block is never written again (no copy-on-write). A registered block whose
// last sequence lets it go stays cached (refcount 0) and is evicted, least recently used first,
// only when a block is needed and no empty one is left.
//
// What determines a block's KV: the token ids at and before it (and their positions, which the
// chain fixes). Nothing else varies within one scheduler today (one model, one dtype, no
// adapters, no multimodal inputs); anything that comes to vary must go into the root of the chain
// (kRootKey) or into each block's key.
//
// Keys are the first 128 bits of SHA-256 over (parent key, the block's token ids). A lookup that
// finds a key also compares the block's tokens and its parent block (id and registration), so a
// hash collision can only cost a hit, never give a sequence the wrong KV.
//
// Sliding-window attention (the scheduler keeps a second BlockManager for the sliding layers): a
// table may let go of its blocks that lie wholly before the first position its sequence's next
// token attends to (Release); their entries become kReleased, so a table stays indexed by
// position / block_size. A released block is free, or cached when registered, as after Free. A
// prefix hit is taken only over blocks that are all still registered, released or not (the chain
// checks every block's parent): a hit never reads freed KV, and an evicted early block ends the
// hit there (the sequence computes the rest again).
//
// Every block is in exactly one state: free (empty), cached (registered, refcount 0, evictable)
// or used (refcount > 0, registered or not); num_free() + num_cached() + num_used() ==
// num_blocks().
//
// Threading: not thread-safe (the scheduler's thread owns it).
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_BLOCK_MANAGER_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_BLOCK_MANAGER_H_

#include <cstdint>
#include <list>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/numeric/int128.h"

namespace shardserve {

class BlockManager {
 public:
  // A block's key from its parent's key (kRootKey for a sequence's first block) and its tokens.
  using KeyFn = absl::uint128 (*)(absl::uint128 parent, const int32_t* tokens, int64_t n);
  // SHA-256 (truncated to 128 bits) over the parent key and the tokens, little-endian.
  static absl::uint128 Sha256Key(absl::uint128 parent, const int32_t* tokens, int64_t n);
  static constexpr absl::uint128 kRootKey = 0;
  // A table entry whose block Release let go.
  static constexpr int32_t kReleased = -1;

  // Where a sequence's chain of registered blocks stands: the key and the registered block (id
  // and registration number) that hold its tokens up to the last block registered or found; a
  // new sequence starts with Chain{}. The scheduler keeps one per sequence.
  struct Chain {
    int64_t blocks = 0;  // full blocks of the sequence walked so far
    absl::uint128 key = kRootKey;
    int32_t block = -1;  // the registered block holding the last of them; -1: none (or unverifiable)
    uint64_t generation = 0;
  };

  // `num_blocks` blocks of `block_size` tokens, all free. With `prefix_caching` off, Register()
  // and FindCached() do nothing. `key_fn` null: Sha256Key (tests pass a colliding one).
  BlockManager(int64_t num_blocks, int64_t block_size, bool prefix_caching = true, KeyFn key_fn = nullptr);

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  bool prefix_caching() const { return prefix_caching_; }
  // Empty blocks.
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  // Registered blocks no sequence holds: evicted when needed.
  int64_t num_cached() const { return static_cast<int64_t>(lru_.size()); }
  // Blocks some sequence holds.
  int64_t num_used() const { return num_blocks_ - num_free() - num_cached(); }
  // Blocks Grow can hand out: free and cached.
  int64_t num_available() const { return num_free() + num_cached(); }
  // Tables holding `block` (0 for a free or cached one).
  int32_t refcount(int32_t block) const { return blocks_[block].refcount; }
  // Blocks that hold `tokens` tokens.
  int64_t BlocksFor(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  // Grows `table` until it holds `tokens` tokens, with empty blocks first, then cached ones
  // evicted least recently used first. False, with `table` unchanged, when too few are available.
  bool Grow(std::vector<int32_t>* table, int64_t tokens);
  // Lets go of every block of `table` and empties it: a block no other table holds becomes free,
  // or cached when registered (the table's last block the least recently used, so that a prefix
  // outlives its tails).
  void Free(std::vector<int32_t>* table);
  // Lets go (as Free does) of the entries of `table` from `keep` on and drops them: the table keeps
  // its first `keep` blocks (speculative decoding: blocks of rejected positions). Returns how many
  // it let go.
  int64_t Truncate(std::vector<int32_t>* table, int64_t keep);
  // Lets go (as Free does) of the blocks of `table` that lie wholly before token `first_kept`,
  // setting their entries to kReleased; the table keeps its size. Returns how many it let go.
  int64_t Release(std::vector<int32_t>* table, int64_t first_kept);
  // Entries of `table` that hold a block (not kReleased).
  static int64_t Held(const std::vector<int32_t>& table);
  // The most blocks a table of a sequence of `tokens` tokens holds at once, released as above, for
  // steps of at most `chunk` tokens (model/kv_blocks.h KvBlocksHeld); `window` 0: BlocksFor(`tokens`).
  int64_t WindowBlocks(int64_t window, int64_t chunk, int64_t tokens) const;

  // The registered blocks that hold a prefix of `tokens` (block after block from the first), at
  // most `max_blocks` of them, and the chain after them in *chain. No side effect.
  std::vector<int32_t> FindCached(const std::vector<int32_t>& tokens, int64_t max_blocks, Chain* chain) const;
  // Cached blocks of `blocks` (refcount 0): those that Share would take out of num_available().
  int64_t CountCached(const std::vector<int32_t>& blocks) const;
  // Appends `blocks` (from FindCached, nothing changed since) to the empty `table`, one more
  // reference each.
  void Share(const std::vector<int32_t>& blocks, std::vector<int32_t>* table);

  // Registers the full blocks of `table` holding `tokens[0, num_tokens)` from chain->blocks on
  // (their KV written, or written by a step already sent), advancing *chain. A block whose key is
  // already registered (another sequence computed the same tokens) is left unregistered, and the
  // chain goes on from the registered one. A kReleased entry ends the chain (nothing after it is
  // registered): call it before Release for the tokens a step feeds.
  void Register(const std::vector<int32_t>& table, const std::vector<int32_t>& tokens, int64_t num_tokens,
                Chain* chain);

  // Forgets every registered block (the workers' KV is gone): cached blocks become free, used
  // ones stay with their tables but are no longer found. Scheduler::Clear() calls it.
  void DropCache();

 private:
  struct Block {
    int32_t refcount = 0;
    bool registered = false;
    uint64_t generation = 0;  // bumped at every registration and unregistration
    absl::uint128 key = 0;
    int32_t parent = -1;  // registered parent block (-1: the sequence's first block)
    uint64_t parent_generation = 0;
    std::vector<int32_t> tokens;  // its tokens, while registered
    std::list<int32_t>::iterator lru;  // while cached
  };

  // Takes one block for a table: free first, else the least recently used cached one.
  int32_t Take();
  void Unregister(int32_t b);

  const int64_t num_blocks_;
  const int64_t block_size_;
  const bool prefix_caching_;
  const KeyFn key_fn_;
  std::vector<Block> blocks_;  // [num_blocks]
  std::vector<int32_t> free_;  // a stack: the most recently freed block is reused first
  std::list<int32_t> lru_;     // cached blocks, least recently used first
  absl::flat_hash_map<absl::uint128, int32_t> by_key_;  // registered blocks
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_BLOCK_MANAGER_H_
