// The continuous-batching scheduler (coordinator/scheduler) and its KV block manager.
//
// The core test (SchedulerClusterTest) drives the Scheduler the way the engine does, against a
// simulated cluster: a fake KV cache holds, per slot, the context (every token up to and including
// its position) whose KV was written there, which is what a real KV entry depends on, and the
// "model" samples each token as a hash of the context it READS back through the sequence's block
// table. A wrong slot, a block written while another sequence holds it, a prefix-cache hit on
// other tokens, a lost or duplicated token, or a recompute that starts at the wrong place changes
// (or fails the read of) the context, so every sequence's output is compared with the same hash
// run on that sequence alone.
#include "coordinator/scheduler/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/scheduler/block_manager.h"
#include "shardserve/v1/worker.pb.h"
#include "worker/persistent_batch.h"

namespace shardserve {
namespace {

// ---- BlockManager ------------------------------------------------------------------------------

TEST(BlockManagerTest, GrowAndFreeCount) {
  BlockManager bm(8, 4);
  EXPECT_EQ(bm.num_blocks(), 8);
  EXPECT_EQ(bm.block_size(), 4);
  EXPECT_EQ(bm.num_free(), 8);
  EXPECT_EQ(bm.BlocksFor(0), 0);
  EXPECT_EQ(bm.BlocksFor(1), 1);
  EXPECT_EQ(bm.BlocksFor(4), 1);
  EXPECT_EQ(bm.BlocksFor(5), 2);

  std::vector<int32_t> t;
  ASSERT_TRUE(bm.Grow(&t, 0));
  EXPECT_TRUE(t.empty());
  ASSERT_TRUE(bm.Grow(&t, 5));
  EXPECT_EQ(t.size(), 2u);
  EXPECT_EQ(bm.num_free(), 6);
  ASSERT_TRUE(bm.Grow(&t, 8));  // still two blocks
  EXPECT_EQ(t.size(), 2u);
  ASSERT_TRUE(bm.Grow(&t, 3));  // never shrinks
  EXPECT_EQ(t.size(), 2u);
  ASSERT_TRUE(bm.Grow(&t, 9));
  EXPECT_EQ(t.size(), 3u);
  EXPECT_EQ(bm.num_free(), 5);
  bm.Free(&t);
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(bm.num_free(), 8);
}

TEST(BlockManagerTest, GrowFailsWithoutChangingTheTable) {
  BlockManager bm(4, 4);
  std::vector<int32_t> a, b;
  ASSERT_TRUE(bm.Grow(&a, 8));  // 2 blocks
  ASSERT_TRUE(bm.Grow(&b, 1));  // 1 block
  const std::vector<int32_t> before = b;
  EXPECT_FALSE(bm.Grow(&b, 9));  // needs 2 more, 1 free
  EXPECT_EQ(b, before);
  EXPECT_EQ(bm.num_free(), 1);
  EXPECT_TRUE(bm.Grow(&b, 8));  // exactly the last block
  EXPECT_EQ(bm.num_free(), 0);
  std::vector<int32_t> c;
  EXPECT_FALSE(bm.Grow(&c, 1));
  EXPECT_TRUE(c.empty());
  bm.Free(&a);
  bm.Free(&b);
  EXPECT_EQ(bm.num_free(), 4);
}

// Random grows and frees: every block is in exactly one table or free, ids in range.
TEST(BlockManagerTest, NoBlockHandedOutTwice) {
  constexpr int64_t kBlocks = 37;
  BlockManager bm(kBlocks, 3);
  std::vector<std::vector<int32_t>> tables(6);
  std::vector<int64_t> tokens(tables.size(), 0);
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 5000; ++iter) {
    const size_t i = rng() % tables.size();
    if (rng() % 5 == 0) {
      bm.Free(&tables[i]);
      tokens[i] = 0;
      EXPECT_TRUE(tables[i].empty());
    } else {
      const int64_t want = tokens[i] + static_cast<int64_t>(rng() % 10);
      const std::vector<int32_t> before = tables[i];
      const int64_t free_before = bm.num_free();
      if (bm.Grow(&tables[i], want)) {
        tokens[i] = std::max(tokens[i], want);
        ASSERT_EQ(static_cast<int64_t>(tables[i].size()), bm.BlocksFor(tokens[i]));
        // Growing keeps the blocks already held, in order.
        ASSERT_TRUE(std::equal(before.begin(), before.end(), tables[i].begin()));
      } else {
        ASSERT_EQ(tables[i], before);
        ASSERT_EQ(bm.num_free(), free_before);
        ASSERT_GT(bm.BlocksFor(want) - static_cast<int64_t>(before.size()), free_before);
      }
    }
    std::set<int32_t> used;
    int64_t held = 0;
    for (const auto& t : tables) {
      for (int32_t b : t) {
        ASSERT_GE(b, 0);
        ASSERT_LT(b, kBlocks);
        ASSERT_TRUE(used.insert(b).second) << "block " << b << " in two tables";
      }
      held += static_cast<int64_t>(t.size());
    }
    ASSERT_EQ(held + bm.num_free(), kBlocks);
  }
  for (auto& t : tables) bm.Free(&t);
  EXPECT_EQ(bm.num_free(), kBlocks);
}

// ---- BlockManager: the prefix cache ------------------------------------------------------------

// A prefix-cache key function under which every block collides.
absl::uint128 CollidingKey(absl::uint128, const int32_t*, int64_t) { return 42; }

std::vector<int32_t> Tokens(int n, int32_t first) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = first + i;
  return t;
}

void ExpectAccounted(const BlockManager& bm) {
  EXPECT_EQ(bm.num_free() + bm.num_cached() + bm.num_used(), bm.num_blocks());
  EXPECT_EQ(bm.num_available(), bm.num_free() + bm.num_cached());
}

// A sequence's full blocks, registered, are found by another with the same first tokens and shared
// by reference count; its partial last block is not; when both let go, the full ones stay cached.
TEST(BlockManagerTest, SharedPrefixHitsAndRefcounts) {
  BlockManager bm(16, 4);
  const std::vector<int32_t> a_tokens = Tokens(10, 100);  // 2 full blocks and 2 tokens
  std::vector<int32_t> a;
  ASSERT_TRUE(bm.Grow(&a, 10));
  BlockManager::Chain a_chain;
  bm.Register(a, a_tokens, 10, &a_chain);
  EXPECT_EQ(a_chain.blocks, 2);
  EXPECT_EQ(a_chain.block, a[1]);

  std::vector<int32_t> b_tokens(a_tokens.begin(), a_tokens.begin() + 9);  // the partial block differs
  b_tokens.push_back(7);
  b_tokens.push_back(8);
  BlockManager::Chain b_chain;
  const std::vector<int32_t> hit = bm.FindCached(b_tokens, 100, &b_chain);
  EXPECT_EQ(hit, (std::vector<int32_t>{a[0], a[1]}));
  EXPECT_EQ(b_chain.blocks, 2);
  EXPECT_EQ(bm.CountCached(hit), 0) << "a holds them";
  EXPECT_EQ(bm.FindCached(b_tokens, 1, &b_chain).size(), 1u) << "max_blocks caps the hit";
  b_chain = BlockManager::Chain{};
  ASSERT_EQ(bm.FindCached(b_tokens, 100, &b_chain).size(), 2u);

  std::vector<int32_t> b;
  bm.Share(hit, &b);
  ASSERT_TRUE(bm.Grow(&b, 11));
  ASSERT_EQ(b.size(), 3u);
  EXPECT_NE(b[2], a[2]) << "a partial block is never shared";
  EXPECT_EQ(bm.refcount(a[0]), 2);
  EXPECT_EQ(bm.refcount(a[1]), 2);
  EXPECT_EQ(bm.refcount(a[2]), 1);
  EXPECT_EQ(bm.num_used(), 4);
  ExpectAccounted(bm);
  bm.Register(b, b_tokens, 11, &b_chain);  // nothing new full: b's third block has 3 tokens

  bm.Free(&a);
  EXPECT_EQ(bm.refcount(a_chain.block), 1);
  EXPECT_EQ(bm.num_used(), 3);
  EXPECT_EQ(bm.num_cached(), 0);
  bm.Free(&b);
  EXPECT_EQ(bm.num_used(), 0);
  EXPECT_EQ(bm.num_cached(), 2) << "the two full blocks stay cached";
  EXPECT_EQ(bm.num_free(), 14);
  ExpectAccounted(bm);

  // Found again, now cached (refcount 0): sharing takes them out of what Grow may evict.
  BlockManager::Chain c_chain;
  const std::vector<int32_t> again = bm.FindCached(a_tokens, 100, &c_chain);
  ASSERT_EQ(again.size(), 2u);
  EXPECT_EQ(bm.CountCached(again), 2);
  std::vector<int32_t> c;
  bm.Share(again, &c);
  EXPECT_EQ(bm.num_cached(), 0);
  EXPECT_EQ(bm.num_used(), 2);
  bm.Free(&c);

  // Other first tokens: no hit, even with the same later ones.
  std::vector<int32_t> d_tokens = a_tokens;
  d_tokens[0] = 99;
  EXPECT_TRUE(bm.FindCached(d_tokens, 100, &c_chain).empty());
  // A block's key depends on the blocks before it: a's second block's tokens at the start miss.
  EXPECT_TRUE(bm.FindCached(std::vector<int32_t>(a_tokens.begin() + 4, a_tokens.end()), 100, &c_chain).empty());
}

// With no block free, Grow evicts cached blocks least recently used first, a table's last block
// before its first; an evicted block is no longer found, nor are the blocks registered after it.
TEST(BlockManagerTest, EvictsLeastRecentlyUsedFirst) {
  BlockManager bm(6, 2);
  const std::vector<int32_t> x_tokens = Tokens(4, 10), y_tokens = Tokens(4, 50);
  std::vector<int32_t> x, y;
  BlockManager::Chain xc, yc;
  ASSERT_TRUE(bm.Grow(&x, 4));
  ASSERT_TRUE(bm.Grow(&y, 4));
  bm.Register(x, x_tokens, 4, &xc);
  bm.Register(y, y_tokens, 4, &yc);
  const std::vector<int32_t> x_blocks = x, y_blocks = y;
  bm.Free(&x);  // x first: least recently used
  bm.Free(&y);
  EXPECT_EQ(bm.num_cached(), 4);
  EXPECT_EQ(bm.num_free(), 2);

  std::vector<int32_t> z;
  ASSERT_TRUE(bm.Grow(&z, 4));  // the 2 free blocks
  EXPECT_EQ(bm.num_cached(), 4);
  ASSERT_TRUE(bm.Grow(&z, 6));  // evicts x's last block
  EXPECT_EQ(z.back(), x_blocks[1]);
  BlockManager::Chain c;
  EXPECT_EQ(bm.FindCached(x_tokens, 100, &c), (std::vector<int32_t>{x_blocks[0]}));
  EXPECT_EQ(bm.FindCached(y_tokens, 100, &c), y_blocks);
  ASSERT_TRUE(bm.Grow(&z, 8));  // then x's first
  EXPECT_EQ(z.back(), x_blocks[0]);
  EXPECT_TRUE(bm.FindCached(x_tokens, 100, &c).empty());
  EXPECT_EQ(bm.FindCached(y_tokens, 100, &c), y_blocks);

  // Touching y's blocks (shared and let go again) makes them the most recently used, but with
  // nothing else cached they go next, the last first.
  std::vector<int32_t> w;
  bm.Share(bm.FindCached(y_tokens, 100, &c), &w);
  EXPECT_FALSE(bm.Grow(&z, 10)) << "y's blocks are held: nothing to evict";
  bm.Free(&w);
  ASSERT_TRUE(bm.Grow(&z, 10));
  EXPECT_EQ(z.back(), y_blocks[1]);
  EXPECT_EQ(bm.FindCached(y_tokens, 100, &c), (std::vector<int32_t>{y_blocks[0]}));
  ExpectAccounted(bm);

  // A table's last block goes before its first, so its prefix stays found longest.
  bm.Free(&z);
  BlockManager bm2(3, 2);
  std::vector<int32_t> p, q;
  BlockManager::Chain pc, qc;
  ASSERT_TRUE(bm2.Grow(&p, 4));
  bm2.Register(p, x_tokens, 4, &pc);
  const std::vector<int32_t> p_blocks = p;
  bm2.Free(&p);  // LRU: p[1], p[0]
  std::vector<int32_t> r = {};
  ASSERT_TRUE(bm2.Grow(&r, 2));  // the free block
  ASSERT_TRUE(bm2.Grow(&r, 4));  // evicts p[1] first
  EXPECT_EQ(r.back(), p_blocks[1]);
  EXPECT_EQ(bm2.FindCached(x_tokens, 100, &qc), (std::vector<int32_t>{p_blocks[0]}));
}

// Keys that all collide: a lookup compares the tokens and the parent, so it never hands out a block
// with other tokens; only the first block registered under the key is found.
TEST(BlockManagerTest, KeyCollisionsNeverGiveOtherTokens) {
  BlockManager bm(16, 2, true, &CollidingKey);
  const std::vector<int32_t> a_tokens = Tokens(6, 1), b_tokens = Tokens(6, 20);
  std::vector<int32_t> a, b;
  BlockManager::Chain ac, bc, c;
  ASSERT_TRUE(bm.Grow(&a, 6));
  bm.Register(a, a_tokens, 6, &ac);
  EXPECT_EQ(ac.blocks, 3);
  EXPECT_EQ(ac.block, -1) << "a's second block collides with its first: the chain stops there";
  ASSERT_TRUE(bm.Grow(&b, 6));
  bm.Register(b, b_tokens, 6, &bc);
  EXPECT_TRUE(bm.FindCached(b_tokens, 100, &c).empty()) << "b's first block collides with a's";
  EXPECT_EQ(bm.FindCached(a_tokens, 100, &c), (std::vector<int32_t>{a[0]}));
  std::vector<int32_t> mixed = a_tokens;
  mixed[1] = 77;  // the first block differs in its second token
  EXPECT_TRUE(bm.FindCached(mixed, 100, &c).empty());
  bm.Free(&a);
  bm.Free(&b);
  EXPECT_EQ(bm.num_cached(), 1);
  ExpectAccounted(bm);

  // The real keys do not collide on these.
  BlockManager real(16, 2);
  ac = BlockManager::Chain{};
  ASSERT_TRUE(real.Grow(&a, 6));
  real.Register(a, a_tokens, 6, &ac);
  EXPECT_EQ(real.FindCached(a_tokens, 100, &c).size(), 3u);
  EXPECT_NE(BlockManager::Sha256Key(BlockManager::kRootKey, a_tokens.data(), 2),
            BlockManager::Sha256Key(BlockManager::kRootKey, b_tokens.data(), 2));
}

// Two sequences computing the same blocks at once: the second's stay unregistered, its chain goes
// on from the first's, and the blocks it registers later are found after the first's.
TEST(BlockManagerTest, TheSameBlocksComputedTwice) {
  BlockManager bm(16, 2);
  const std::vector<int32_t> tokens = Tokens(8, 5);
  std::vector<int32_t> a, b;
  BlockManager::Chain ac, bc, c;
  ASSERT_TRUE(bm.Grow(&a, 4));
  ASSERT_TRUE(bm.Grow(&b, 8));
  bm.Register(a, tokens, 4, &ac);
  bm.Register(b, tokens, 8, &bc);  // its first two are a's; its last two are new
  EXPECT_EQ(bc.blocks, 4);
  EXPECT_EQ(bc.block, b[3]);
  EXPECT_EQ(bm.FindCached(tokens, 100, &c), (std::vector<int32_t>{a[0], a[1], b[2], b[3]}));
  bm.Free(&b);
  EXPECT_EQ(bm.num_cached(), 2);
  EXPECT_EQ(bm.num_free(), 12) << "b's duplicates are free";
  bm.Free(&a);
  ExpectAccounted(bm);
}

// Off: nothing registered, nothing found, every freed block free.
TEST(BlockManagerTest, PrefixCachingOff) {
  BlockManager bm(8, 2, /*prefix_caching=*/false);
  std::vector<int32_t> a;
  BlockManager::Chain ac;
  ASSERT_TRUE(bm.Grow(&a, 6));
  bm.Register(a, Tokens(6, 1), 6, &ac);
  EXPECT_TRUE(bm.FindCached(Tokens(6, 1), 100, &ac).empty());
  bm.Free(&a);
  EXPECT_EQ(bm.num_cached(), 0);
  EXPECT_EQ(bm.num_free(), 8);
}

// DropCache: cached blocks become free and nothing is found any more.
TEST(BlockManagerTest, DropCacheForgetsEveryBlock) {
  BlockManager bm(8, 2);
  std::vector<int32_t> a, b;
  BlockManager::Chain ac, bc;
  ASSERT_TRUE(bm.Grow(&a, 6));
  ASSERT_TRUE(bm.Grow(&b, 2));
  bm.Register(a, Tokens(6, 1), 6, &ac);
  bm.Register(b, Tokens(2, 50), 2, &bc);
  bm.Free(&a);
  EXPECT_EQ(bm.num_cached(), 3);
  bm.DropCache();
  EXPECT_EQ(bm.num_cached(), 0);
  EXPECT_EQ(bm.num_free(), 7);
  EXPECT_EQ(bm.num_used(), 1) << "b keeps its block";
  EXPECT_TRUE(bm.FindCached(Tokens(6, 1), 100, &ac).empty());
  EXPECT_TRUE(bm.FindCached(Tokens(2, 50), 100, &bc).empty());
  bm.Free(&b);
  EXPECT_EQ(bm.num_free(), 8);
}

// ---- BlockManager: sliding-window tables ---------------------------------------------------------

constexpr int32_t kReleased = BlockManager::kReleased;

// Release lets go of the blocks wholly before the first token kept, marks their entries, keeps the
// table's size (positions still index it), and hands the blocks to the next table that grows.
TEST(BlockManagerTest, ReleaseFreesTheBlocksBeforeTheWindowForReuse) {
  BlockManager bm(8, 4, /*prefix_caching=*/false);
  std::vector<int32_t> a;
  ASSERT_TRUE(bm.Grow(&a, 14));  // blocks 0..3, tokens 0..13
  EXPECT_EQ(bm.Release(&a, 7), 1) << "block 1 holds token 7: only block 0 lies wholly before it";
  EXPECT_EQ(a, (std::vector<int32_t>{kReleased, 1, 2, 3}));
  EXPECT_EQ(bm.Release(&a, 8), 1);
  EXPECT_EQ(a, (std::vector<int32_t>{kReleased, kReleased, 2, 3}));
  EXPECT_EQ(bm.Release(&a, 8), 0) << "nothing more to let go";
  EXPECT_EQ(bm.Release(&a, -5), 0);
  EXPECT_EQ(BlockManager::Held(a), 2);
  EXPECT_EQ(bm.num_used(), 2);
  EXPECT_EQ(bm.num_free(), 6);
  ExpectAccounted(bm);

  // Growing goes on after the released entries, with the block released last; another table
  // takes the other.
  ASSERT_TRUE(bm.Grow(&a, 17));
  EXPECT_EQ(a, (std::vector<int32_t>{kReleased, kReleased, 2, 3, 1}));
  std::vector<int32_t> b;
  ASSERT_TRUE(bm.Grow(&b, 8));
  EXPECT_EQ(b, (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(bm.Release(&a, 1000), 3) << "past the table's end: every block it still holds";
  EXPECT_EQ(a.size(), 5u);
  bm.Free(&a);  // skips the released entries
  bm.Free(&b);
  EXPECT_EQ(bm.num_free(), 8);
  ExpectAccounted(bm);
}

// A shared block released by one table stays with the other; a registered block released by its
// last table stays cached and is found again, with the blocks after it, as long as none of the
// chain is evicted. Once an early block is evicted, the hit ends before it: the sequence computes
// the rest again instead of reading KV that is gone.
TEST(BlockManagerTest, PrefixHitsAcrossReleasedBlocksEndAtAnEvictedOne) {
  BlockManager bm(6, 2);
  const std::vector<int32_t> tokens = Tokens(7, 10);  // 3 full blocks and one token
  std::vector<int32_t> a;
  BlockManager::Chain ac;
  ASSERT_TRUE(bm.Grow(&a, 7));
  bm.Register(a, tokens, 7, &ac);
  ASSERT_EQ(ac.blocks, 3);
  const std::vector<int32_t> a_blocks = a;

  // b shares a's first two blocks; a releases them: b still holds them.
  BlockManager::Chain bc;
  std::vector<int32_t> b;
  bm.Share(bm.FindCached(tokens, 2, &bc), &b);
  EXPECT_EQ(bm.Release(&a, 4), 2);
  EXPECT_EQ(bm.refcount(a_blocks[0]), 1);
  EXPECT_EQ(bm.num_cached(), 0);
  bm.Free(&b);
  EXPECT_EQ(bm.num_cached(), 2) << "released and let go by b: cached, not free";
  ExpectAccounted(bm);

  // Found again whole: the released blocks and the one a still holds.
  BlockManager::Chain c;
  EXPECT_EQ(bm.FindCached(tokens, 100, &c), (std::vector<int32_t>{a_blocks[0], a_blocks[1], a_blocks[2]}));

  // Every empty block taken, then one cached block evicted: the later of the two released goes
  // first (a prefix outlives its tail), and the hit ends before it although a still holds the
  // block after it.
  std::vector<int32_t> d;
  ASSERT_TRUE(bm.Grow(&d, 2 * bm.num_free() + 2));
  EXPECT_EQ(bm.num_cached(), 1);
  EXPECT_EQ(bm.FindCached(tokens, 100, &c), (std::vector<int32_t>{a_blocks[0]}));
  EXPECT_EQ(c.blocks, 1);
  ASSERT_TRUE(bm.Grow(&d, static_cast<int64_t>(d.size()) * 2 + 2));
  EXPECT_TRUE(bm.FindCached(tokens, 100, &c).empty());
  EXPECT_EQ(bm.num_free() + bm.num_cached(), 0);
  ExpectAccounted(bm);
}

// A released entry ends the chain Register walks: nothing after it is registered.
TEST(BlockManagerTest, RegisterStopsAtAReleasedBlock) {
  BlockManager bm(8, 2);
  const std::vector<int32_t> tokens = Tokens(8, 1);
  std::vector<int32_t> a;
  BlockManager::Chain ac;
  ASSERT_TRUE(bm.Grow(&a, 8));
  bm.Register(a, tokens, 2, &ac);
  bm.Release(&a, 4);  // the second block, unregistered, goes back empty
  EXPECT_EQ(bm.num_cached(), 1);
  EXPECT_EQ(bm.num_free(), 5);
  bm.Register(a, tokens, 8, &ac);
  EXPECT_EQ(ac.blocks, 4);
  EXPECT_EQ(bm.FindCached(tokens, 100, &ac).size(), 1u);
}

// WindowBlocks is the most blocks a table holds when every step releases what its next token no
// longer sees: reached when decoding (the window's first token meets every offset in a block),
// never passed when prompts are fed in chunks.
TEST(BlockManagerTest, WindowBlocksBoundsWhatATableHolds) {
  for (const int64_t block_size : {1, 4, 16}) {
    for (const int64_t window : {1, 3, 16, 37}) {
      for (const int64_t chunk : {1, 5, 16}) {
        SCOPED_TRACE(absl::StrCat("block_size ", block_size, " window ", window, " chunk ", chunk));
        BlockManager bm(1000, block_size, /*prefix_caching=*/false);
        std::vector<int32_t> t;
        int64_t fed = 0, most = 0;
        for (int step = 0; step < 40; ++step) {
          ASSERT_TRUE(bm.Grow(&t, fed + chunk));
          most = std::max(most, BlockManager::Held(t));  // what the step reads and writes
          fed += chunk;
          bm.Release(&t, fed - window + 1);  // the next token attends to [fed - window + 1, fed]
        }
        EXPECT_LE(most, bm.WindowBlocks(window, chunk, fed));
        if (chunk == 1) {
          EXPECT_EQ(most, bm.WindowBlocks(window, chunk, fed));
        }
        EXPECT_EQ(bm.WindowBlocks(0, chunk, fed), bm.BlocksFor(fed));
        EXPECT_EQ(bm.WindowBlocks(window, chunk, 3), std::min<int64_t>(bm.BlocksFor(3), bm.WindowBlocks(window, chunk, fed)));
        bm.Free(&t);
        EXPECT_EQ(bm.num_free(), 1000);
      }
    }
  }
}

// ---- The simulated cluster ---------------------------------------------------------------------

constexpr int32_t kVocab = 1000;

// The "model": the next token of a context, given the request's seed.
int32_t NextToken(const std::vector<int32_t>& context, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ (seed * 0x9E3779B97F4A7C15ull);
  for (int32_t t : context) {
    h ^= static_cast<uint32_t>(t);
    h *= 1099511628211ull;
  }
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return static_cast<int32_t>(h % kVocab);
}

// The tokens a sequence generates when it runs alone (no scheduler, no cache).
std::vector<int32_t> Reference(std::vector<int32_t> context, int64_t max_tokens, uint64_t seed) {
  std::vector<int32_t> out;
  for (int64_t i = 0; i < max_tokens; ++i) {
    out.push_back(NextToken(context, seed));
    context.push_back(out.back());
  }
  return out;
}

bool PenaltyOn(const v1::RowSampling& s) {
  return (s.repetition_penalty() != 0 && s.repetition_penalty() != 1) || s.presence_penalty() != 0 ||
         s.frequency_penalty() != 0;
}

// Drives a Scheduler like the engine (schedule every lane until it is busy, complete the oldest
// step in flight, remove sequences that reached max_tokens) and runs each step on a fake KV cache,
// checking the plan's invariants with gtest assertions (fatal: callers check HasFatalFailure()).
// Plans are stateful: each is decoded, in the order sent, by the worker's own PersistentBatch
// (worker/persistent_batch.h), which must accept it, and the checks read the StepBatch and
// sampling rows it derives, as the model and the sampler would.
//
// With asynchronous scheduling (SchedulerOptions::feed_samples) a row may feed the sample of a
// step still in flight, which the worker puts in: the model is a function of the context, so the
// simulation draws each step's samples when the worker takes the plan (RecordSamples, as the real
// worker does once its step has run, before the next plan), keeps them ahead of the tokens the
// scheduler knows, and checks at completion that the scheduler got the same.
//
// With sliding-window layers (SchedulerOptions::sliding_window), a row reads only the window before
// each of its tokens: through its one table when every layer slides, else the full-attention
// layers read the whole context through the first table and the sliding layers the window through
// the second (a cache of their own). Released blocks go to other sequences while a step that read
// them may still be in flight (the workers run steps in order), so the checks that a block is in
// one table only and that steps in flight write apart apply to full-attention tables only; every
// read still checks that the KV is this sequence's.
class SimCluster {
 public:
  explicit SimCluster(const SchedulerOptions& o)
      : o_(o),
        sched_(o),
        worker_(o.limits, kVocab, /*keep_history=*/true, /*feeds_samples=*/o.feed_samples),
        window_(o.sliding_window),
        one_pool_slides_(o.sliding_window > 0 && !o.full_layers),
        two_pools_(o.sliding_window > 0 && o.full_layers),
        cache_(static_cast<size_t>(o.limits.num_kv_blocks * o.limits.block_size)),
        sliding_cache_(static_cast<size_t>(two_pools_ ? o.limits.num_sliding_kv_blocks * o.limits.block_size : 0)) {}

  Scheduler& sched() { return sched_; }

  void Add(uint64_t id, std::vector<int32_t> prompt, int64_t max_tokens, const v1::RowSampling& sampling,
           SeqOptions options = {}) {
    Seq& s = seqs_[id];
    s.tokens = prompt;
    s.prompt_len = static_cast<int64_t>(prompt.size());
    s.max_tokens = max_tokens;
    s.sampling = sampling;
    s.max_len = options.max_len;
    sched_.Add(id, std::move(prompt), sampling, options);
  }

  // Schedules every lane until it is busy; returns how many steps it scheduled.
  int ScheduleFreeLanes() {
    int n = 0;
    for (int lane = 0; lane < sched_.lanes(); ++lane) {
     while (!sched_.LaneBusy(lane)) {
      Flight f;
      f.lane = lane;
      const MicroBatch* batch = sched_.Schedule(lane, next_step_id_, &f.plan);
      if (batch == nullptr) {
        EXPECT_FALSE(sched_.LaneBusy(lane));
        break;
      }
      ++next_step_id_;
      plan_bytes_ += static_cast<int64_t>(f.plan.ByteSizeLong());
      // What a worker does with it, in the order sent.
      const absl::Status applied = worker_.Apply(f.plan, &f.batch, &f.sampling);
      if (!applied.ok()) {
        ADD_FAILURE() << "the worker refuses step " << f.plan.step_id() << ": " << applied;
        return n;
      }
      // The sliding layers' tables, as the workers hold them.
      for (uint64_t id : f.plan.freed_seq_ids()) sliding_tables_.erase(id);
      for (const v1::NewSeq& ns : f.plan.new_seqs()) {
        sliding_tables_[ns.seq_id()].assign(ns.sliding_block_ids().begin(), ns.sliding_block_ids().end());
      }
      for (const v1::SeqBlocks& a : f.plan.appended_blocks()) {
        sliding_tables_[a.seq_id()].insert(sliding_tables_[a.seq_id()].end(), a.sliding_block_ids().begin(),
                                           a.sliding_block_ids().end());
      }
      for (const auto& [id, table] : sliding_tables_) {
        if (!two_pools_) {
          EXPECT_TRUE(table.empty()) << "step " << f.plan.step_id() << ": a sliding table without a sliding pool";
        } else if (worker_.Holds(id)) {
          EXPECT_EQ(table, worker_.sliding_blocks(id)) << "step " << f.plan.step_id() << ": seq " << id;
          EXPECT_EQ(table.size(), worker_.blocks(id).size()) << "step " << f.plan.step_id() << ": seq " << id;
        }
      }
      // The worker holds only sequences the scheduler runs (freed ids come first in a plan).
      for (const auto& [id, s] : seqs_) {
        if (worker_.Holds(id) && !sched_.Contains(id)) {
          ADD_FAILURE() << "step " << f.plan.step_id() << ": the worker still holds seq " << id << ", which ended";
          return n;
        }
      }
      EXPECT_LE(worker_.size(), sched_.num_running());
      CheckStep(*batch, &f);
      if (::testing::Test::HasFatalFailure()) return n;
      DrawSamples(&f);
      in_flight_.push_back(std::move(f));
      ++n;
     }
    }
    return n;
  }

  bool idle() const { return in_flight_.empty(); }
  int64_t steps() const { return static_cast<int64_t>(next_step_id_); }
  int64_t restarts() const { return restarts_; }
  // Tokens that new sequences (first admissions and recomputes) took from the prefix cache.
  int64_t cached_tokens() const { return cached_tokens_; }
  int64_t max_in_flight_seen() const { return max_in_flight_seen_; }
  // Rows scheduled while a step feeding the same sequence (an earlier prompt chunk) was in flight.
  int64_t chunks_behind_chunks() const { return chunks_behind_chunks_; }
  // Rows that fed the sample of a step in flight (asynchronous scheduling).
  int64_t continuations() const { return continuations_; }
  // Serialized bytes of every plan sent.
  int64_t plan_bytes() const { return plan_bytes_; }
  const PersistentBatch& worker() const { return worker_; }

  // Runs the oldest step in flight on the fake cache, completes it, and removes the sequences
  // that reached max_tokens.
  void CompleteOldest() {
    ASSERT_FALSE(in_flight_.empty());
    Flight f = std::move(in_flight_.front());
    in_flight_.pop_front();
    const v1::StepPlan& p = f.plan;
    const StepBatch& sb = f.batch;
    const int64_t bs = o_.limits.block_size;
    const int64_t mbps = o_.limits.max_blocks_per_seq();

    // Workers run the steps in the order they were sent: every row's earlier positions (what its
    // attention reads) were written by this sequence in earlier steps, the steps in flight
    // before this one included (prompt chunks may follow each other without a round trip).
    for (size_t row = 0; row < f.rows.size(); ++row) {
      const uint64_t id = f.rows[row];
      const Seq& s = seqs_.at(id);
      ASSERT_NO_FATAL_FAILURE(CheckSlidingReads(f, row, f.firsts[row], f.firsts[row]));
      for (int64_t pos = FirstRead(f.firsts[row]); pos < f.firsts[row]; ++pos) {
        const int32_t block = sb.block_tables[row * mbps + pos / bs];
        const Cell& c = cache_[block * bs + pos % bs];
        ASSERT_EQ(c.pos, pos) << "step " << p.step_id() << " seq " << id << " reads pos " << pos
                              << " before a step wrote it";
        ASSERT_TRUE(std::equal(c.context.begin(), c.context.end(), s.tokens.begin(), s.tokens.begin() + pos + 1))
            << "step " << p.step_id() << " seq " << id << " reads pos " << pos << " written for other tokens";
      }
    }
    // Write every token's KV.
    for (int i = 0; i < p.token_ids_size(); ++i) {
      Cell& c = cache_[sb.slots[i]];
      const Seq& s = seqs_.at(f.rows[sb.token_seq[i]]);
      c.pos = sb.positions[i];
      ASSERT_EQ(sb.token_ids[i], s.tokens[c.pos]);
      c.context.assign(s.tokens.begin(), s.tokens.begin() + c.pos + 1);
      if (two_pools_) {
        const std::vector<int32_t>& table = f.sliding_tables[sb.token_seq[i]];
        ASSERT_LT(c.pos / bs, static_cast<int64_t>(table.size()));
        // The slot the worker's sliding layers write (PersistentBatch's sliding_slots).
        ASSERT_EQ(sb.sliding_slots[i], table[c.pos / bs] * bs + c.pos % bs) << "step " << p.step_id();
        sliding_cache_[sb.sliding_slots[i]] = c;
      }
    }
    // Each sampled row reads its whole context back through its block table.
    std::vector<int32_t> sampled;
    std::vector<SampledToken> expected;
    for (int k = 0; k < static_cast<int>(sb.logit_rows.size()); ++k) {
      const int t = sb.logit_rows[k];
      const int row = sb.token_seq[t];
      const uint64_t id = f.rows[row];
      const Seq& s = seqs_.at(id);
      const int32_t last = sb.positions[t];
      ASSERT_NO_FATAL_FAILURE(CheckSlidingReads(f, row, last, last + 1));
      for (int64_t pos = FirstRead(last); pos <= last; ++pos) {
        const int32_t block = sb.block_tables[row * mbps + pos / bs];
        const Cell& c = cache_[block * bs + pos % bs];
        ASSERT_EQ(c.pos, pos) << "step " << p.step_id() << " seq " << id;
        ASSERT_EQ(static_cast<int64_t>(c.context.size()), pos + 1) << "step " << p.step_id() << " seq " << id;
        ASSERT_TRUE(std::equal(c.context.begin(), c.context.end(), s.tokens.begin()))
            << "step " << p.step_id() << " seq " << id << " pos " << pos << " holds the KV of other tokens";
      }
      const std::vector<int32_t> context(s.tokens.begin(), s.tokens.begin() + last + 1);
      sampled.push_back(NextToken(context, f.sampling[k].seed()));
      ASSERT_EQ(sampled.back(), f.drawn[k]) << "step " << p.step_id() << " seq " << id << ": the worker fed another sample";
      if (!s.removed) expected.push_back(SampledToken{id, sampled.back(), k});
    }

    const std::vector<SampledToken> got = sched_.Complete(f.lane, sampled);
    ASSERT_FALSE(sched_.LaneBusy(f.lane));
    for (int k = 0; k < static_cast<int>(sb.logit_rows.size()); ++k) {  // their samples are known now
      Seq& s = seqs_.at(f.rows[sb.token_seq[sb.logit_rows[k]]]);
      ASSERT_GT(s.sampling_in_flight, 0);
      --s.sampling_in_flight;
      ASSERT_FALSE(s.ahead.empty());
      ASSERT_EQ(s.ahead.front(), sampled[k]);
      s.ahead.erase(s.ahead.begin());
    }
    ASSERT_EQ(got.size(), expected.size()) << "step " << p.step_id();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i].seq, expected[i].seq);
      ASSERT_EQ(got[i].token, expected[i].token);
      ASSERT_EQ(got[i].logit_row, expected[i].logit_row);
    }
    for (size_t row = 0; row < f.rows.size(); ++row) {
      Seq& s = seqs_.at(f.rows[row]);
      --s.in_flight;
      s.cached = f.ends[row];
    }
    for (const SampledToken& t : got) {
      Seq& s = seqs_.at(t.seq);
      s.tokens.push_back(t.token);
      const int64_t generated = static_cast<int64_t>(s.tokens.size()) - s.prompt_len;
      ASSERT_EQ(sched_.generated(t.seq), generated);
      ASSERT_LE(generated, s.max_tokens) << "seq " << t.seq << " sampled past max_tokens";
      if (generated == s.max_tokens) {  // the engine's role: the request is finished
        sched_.Remove(t.seq);
        // Gone now, or when the continuation in flight that feeds it comes back.
        ASSERT_EQ(sched_.Contains(t.seq), s.in_flight > 0);
        s.done = true;
        s.removed = true;
      }
    }
    for (int32_t slot : f.slots) busy_slots_.erase(slot);
  }


  // Removes a sequence now (cancellation), whether or not it is in a step in flight.
  void Cancel(uint64_t id) {
    seqs_.at(id).removed = true;
    sched_.Remove(id);
  }

  std::vector<int32_t> Generated(uint64_t id) const {
    const Seq& s = seqs_.at(id);
    return std::vector<int32_t>(s.tokens.begin() + s.prompt_len, s.tokens.end());
  }
  bool Done(uint64_t id) const { return seqs_.at(id).done; }

 private:
  struct Seq {
    std::vector<int32_t> tokens;  // prompt + every token sampled so far
    int64_t prompt_len = 0;
    int64_t max_tokens = 0;
    int64_t max_len = 0;           // the scheduler's SeqOptions::max_len (0: none)
    int64_t cached = 0;            // positions whose KV the completed steps wrote
    int64_t fed = 0;               // positions fed to the steps sent so far
    int in_flight = 0;             // steps in flight that feed it
    int sampling_in_flight = 0;    // of them, those that sample its next tokens
    std::vector<int32_t> ahead;    // their samples, drawn when the worker took them
    // Its tokens and those samples: what the workers have fed or will feed.
    std::vector<int32_t> Known() const {
      std::vector<int32_t> all = tokens;
      all.insert(all.end(), ahead.begin(), ahead.end());
      return all;
    }
    std::vector<int32_t> table;    // blocks seen in its last step (prefix in use)
    v1::RowSampling sampling;
    bool started = false, done = false, removed = false;
  };
  struct Cell {
    int32_t pos = -1;
    std::vector<int32_t> context;  // the tokens at positions 0 .. pos whose KV this is
  };
  struct Flight {
    int lane = 0;
    v1::StepPlan plan;
    StepBatch batch;                                        // the plan as the worker expands it
    google::protobuf::RepeatedPtrField<v1::RowSampling> sampling;  // one per logit row, likewise
    std::vector<uint64_t> rows;   // sequence of each block-table row
    std::vector<int64_t> firsts;  // each row's first position
    std::vector<int64_t> ends;    // position after each row's last token
    std::vector<int32_t> slots;   // written by this step
    std::vector<std::vector<int32_t>> sliding_tables;  // each row's sliding table when sent
    std::vector<int32_t> drawn;   // the samples the worker drew, one per logit row
  };

  // The worker ran `f`'s step: it draws each logit row's sample from the row's context and keeps
  // it for a row that feeds it (PersistentBatch::RecordSamples).
  void DrawSamples(Flight* f) {
    const StepBatch& sb = f->batch;
    for (int k = 0; k < static_cast<int>(sb.logit_rows.size()); ++k) {
      const int t = sb.logit_rows[k];
      Seq& s = seqs_.at(f->rows[sb.token_seq[t]]);
      const std::vector<int32_t> known = s.Known();
      ASSERT_EQ(static_cast<int64_t>(known.size()), sb.positions[t] + 1) << "a sample before the row's last token";
      f->drawn.push_back(NextToken(known, f->sampling[k].seed()));
      s.ahead.push_back(f->drawn.back());
    }
    google::protobuf::RepeatedField<int32_t> drawn;
    drawn.Add(f->drawn.begin(), f->drawn.end());
    worker_.RecordSamples(drawn);
  }

  // The first position a token at position `q` reads through the first table: 0, or its window's
  // first when every layer slides.
  int64_t FirstRead(int64_t q) const { return one_pool_slides_ ? std::max<int64_t>(0, q - window_ + 1) : 0; }

  // With a sliding layers' pool: the positions of the window of a token at position `q`, before
  // `end`, read through row `row`'s sliding table, hold this sequence's KV.
  void CheckSlidingReads(const Flight& f, size_t row, int64_t q, int64_t end) const {
    if (!two_pools_) return;
    const int64_t bs = o_.limits.block_size;
    const uint64_t id = f.rows[row];
    const Seq& s = seqs_.at(id);
    const std::vector<int32_t>& table = f.sliding_tables[row];
    for (int64_t pos = std::max<int64_t>(0, q - window_ + 1); pos < end; ++pos) {
      ASSERT_LT(pos / bs, static_cast<int64_t>(table.size())) << "step " << f.plan.step_id() << " seq " << id;
      const Cell& c = sliding_cache_[table[pos / bs] * bs + pos % bs];
      ASSERT_EQ(c.pos, pos) << "step " << f.plan.step_id() << " seq " << id << " reads sliding pos " << pos
                            << " not written for it";
      ASSERT_TRUE(std::equal(c.context.begin(), c.context.end(), s.tokens.begin(), s.tokens.begin() + pos + 1))
          << "step " << f.plan.step_id() << " seq " << id << " reads sliding pos " << pos << " written for other tokens";
    }
  }

  void CheckStep(const MicroBatch& batch, Flight* f) {
    const v1::StepPlan& p = f->plan;
    const StepBatch& sb = f->batch;
    const int64_t bs = o_.limits.block_size;
    const int64_t mbps = o_.limits.max_blocks_per_seq();
    const int n = sb.num_seqs;
    const int num_tokens = p.token_ids_size();
    const std::string at = "step " + std::to_string(p.step_id()) + " lane " + std::to_string(f->lane);

    ASSERT_EQ(batch.lane, f->lane) << at;
    ASSERT_EQ(batch.step_id, p.step_id()) << at;
    ASSERT_EQ(static_cast<size_t>(n), batch.entries.size()) << at;
    ASSERT_GE(n, 1) << at;
    ASSERT_LE(n, o_.limits.max_seqs_per_step) << at;
    ASSERT_LE(sched_.num_running(), o_.limits.max_seqs_per_step) << at;
    ASSERT_GE(num_tokens, 1) << at;
    ASSERT_LE(num_tokens, o_.limits.max_tokens_per_step) << at;
    ASSERT_EQ(static_cast<int>(sb.positions.size()), num_tokens) << at;
    ASSERT_EQ(static_cast<int>(sb.token_seq.size()), num_tokens) << at;
    ASSERT_EQ(static_cast<int>(sb.slots.size()), num_tokens) << at;
    ASSERT_EQ(static_cast<int64_t>(sb.block_tables.size()), n * mbps) << at;
    ASSERT_EQ(f->sampling.size(), static_cast<int>(sb.logit_rows.size())) << at;

    // Rows: distinct sequences, known, live, not waiting for a token a step in flight samples.
    std::set<uint64_t> in_step;
    for (int row = 0; row < n; ++row) {
      const uint64_t id = batch.entries[row].seq;
      ASSERT_TRUE(seqs_.count(id)) << at << ": unknown seq " << id;
      const Seq& s = seqs_.at(id);
      ASSERT_FALSE(s.removed) << at << ": removed seq " << id << " scheduled";
      if (batch.entries[row].feeds_sample) {
        ASSERT_TRUE(o_.feed_samples) << at;
        ASSERT_EQ(s.sampling_in_flight, 1) << at << ": seq " << id << " feeds a sample, with "
                                           << s.sampling_in_flight << " in flight";
        ASSERT_EQ(s.in_flight, 1) << at << ": seq " << id;
        ASSERT_EQ(p.row_feeds_sample(row), true) << at;
        ++continuations_;
      } else {
        ASSERT_EQ(s.sampling_in_flight, 0) << at << ": seq " << id << " scheduled before the token it samples is back";
        if (p.row_feeds_sample_size() > 0) { ASSERT_FALSE(p.row_feeds_sample(row)) << at; }
        if (s.in_flight > 0) ++chunks_behind_chunks_;
      }
      ASSERT_TRUE(in_step.insert(id).second) << at << ": seq " << id << " in two rows";
      f->rows.push_back(id);
      if (two_pools_) f->sliding_tables.push_back(sliding_tables_.at(id));
    }

    // Tokens: rows in range, positions contiguous from what the steps sent so far fed (or from 0
    // for a recompute, which no step in flight feeds), the sequence's own tokens, slots through the
    // block table, no slot written twice by steps in flight together.
    std::map<uint64_t, int64_t> new_seqs;  // id: num_cached_tokens
    for (const v1::NewSeq& ns : p.new_seqs()) new_seqs[ns.seq_id()] = ns.num_cached_tokens();
    std::vector<int64_t> next(n, -1), first(n, -1), count(n, 0);
    std::set<int32_t> step_slots;
    std::map<uint64_t, std::vector<int32_t>> known;  // Seq::Known() of each row's sequence
    for (int row = 0; row < n; ++row) known[f->rows[row]] = seqs_.at(f->rows[row]).Known();
    for (int i = 0; i < num_tokens; ++i) {
      const int row = sb.token_seq[i];
      ASSERT_GE(row, 0) << at;
      ASSERT_LT(row, n) << at;
      const Seq& s = seqs_.at(f->rows[row]);
      const std::vector<int32_t>& tokens = known.at(f->rows[row]);
      const int64_t pos = sb.positions[i];
      if (next[row] < 0) {
        first[row] = pos;
        // Where the workers hold it, from what was fed; new (or back after a preemption), from
        // the tokens its cached blocks hold (0 with no prefix cache hit), on the block grid.
        const auto ns = new_seqs.find(f->rows[row]);
        if (ns == new_seqs.end()) {
          ASSERT_EQ(pos, s.fed) << at << ": seq " << f->rows[row] << " starts at " << pos << ", had " << s.fed << " fed";
        } else {
          ASSERT_EQ(pos, ns->second) << at << ": new seq " << f->rows[row] << " num_cached_tokens";
          ASSERT_EQ(pos % bs, 0) << at;
          if (!o_.prefix_caching || PenaltyOn(s.sampling)) { ASSERT_EQ(pos, 0) << at << ": seq " << f->rows[row]; }
          if (s.fed > 0) { ASSERT_EQ(s.in_flight, 0) << at << ": seq " << f->rows[row] << " recomputed in flight"; }
          cached_tokens_ += pos;
        }
      } else {
        ASSERT_EQ(pos, next[row]) << at << ": seq " << f->rows[row] << " positions not contiguous";
      }
      next[row] = pos + 1;
      ++count[row];
      ASSERT_LT(pos, static_cast<int64_t>(tokens.size())) << at << ": seq " << f->rows[row] << " fed past its end";
      ASSERT_EQ(sb.token_ids[i], tokens[pos]) << at << ": seq " << f->rows[row] << " pos " << pos;
      if (batch.entries[row].feeds_sample) {
        ASSERT_EQ(p.token_ids(i), 0) << at << ": a fed sample's placeholder";
      } else {
        ASSERT_EQ(p.token_ids(i), tokens[pos]) << at;
      }
      ASSERT_LT(pos / bs, mbps) << at;
      const int32_t block = sb.block_tables[row * mbps + pos / bs];
      ASSERT_GE(block, 0) << at;
      ASSERT_LT(block, o_.limits.num_kv_blocks) << at;
      ASSERT_EQ(sb.slots[i], block * bs + pos % bs) << at << ": seq " << f->rows[row] << " pos " << pos;
      ASSERT_TRUE(step_slots.insert(sb.slots[i]).second) << at << ": slot " << sb.slots[i] << " written twice";
      if (!one_pool_slides_) {
        ASSERT_FALSE(busy_slots_.count(sb.slots[i])) << at << ": slot " << sb.slots[i] << " also in a step in flight";
      }
      f->slots.push_back(sb.slots[i]);
    }

    // Every block accounted for: the workers' tables hold exactly the blocks in use, each as many
    // times as its reference count; the others are free or cached.
    const BlockManager& bm = sched_.block_manager();
    std::map<int32_t, int> holders;  // block: tables of held sequences with it
    for (const auto& [id, s] : seqs_) {
      if (!worker_.Holds(id)) continue;
      for (int32_t b : worker_.blocks(id)) ++holders[b];
    }
    if (!one_pool_slides_) {  // else the workers' tables still name the blocks let go
      ASSERT_EQ(static_cast<int64_t>(holders.size()), bm.num_used()) << at;
      for (const auto& [b, k] : holders) ASSERT_EQ(bm.refcount(b), k) << at << ": block " << b;
    }
    ASSERT_EQ(bm.num_free() + bm.num_cached() + bm.num_used(), bm.num_blocks()) << at;
    if (!o_.prefix_caching) { ASSERT_EQ(bm.num_cached(), 0) << at; }

    // Per row: token count, logit rows, block tables.
    int logit_rows = 0;
    int64_t prefill = 0, decode = 0;
    std::set<uint64_t> started;
    for (int row = 0; row < n; ++row) {
      const MicroBatch::Entry& e = batch.entries[row];
      Seq& s = seqs_.at(e.seq);
      const std::vector<int32_t>& tokens = known.at(e.seq);
      ASSERT_GE(count[row], 1) << at << ": row " << row << " feeds no token";
      ASSERT_EQ(count[row], e.tokens) << at;
      (e.tokens > 1 ? prefill : decode) += e.tokens;
      if (new_seqs.count(e.seq)) {  // the table starts over; recompute after a preemption
        if (s.fed > 0) ++restarts_;
        s.table.clear();
      }
      const int64_t end = next[row];
      f->firsts.push_back(first[row]);
      f->ends.push_back(end);
      if (end == static_cast<int64_t>(tokens.size())) {
        ASSERT_EQ(e.logit_row, logit_rows) << at << ": seq " << e.seq << " reaches its end";
        if (s.max_len > 0) { ASSERT_LT(end, s.max_len) << at << ": seq " << e.seq << " samples past its max_len"; }
        ASSERT_LT(logit_rows, static_cast<int>(sb.logit_rows.size())) << at;
        const int t = sb.logit_rows[logit_rows];
        ASSERT_EQ(sb.token_seq[t], row) << at;
        ASSERT_EQ(sb.positions[t], end - 1) << at << ": logit row is not the last token of seq " << e.seq;
        const v1::RowSampling& r = f->sampling[logit_rows];
        const int64_t generated = static_cast<int64_t>(tokens.size()) - s.prompt_len;
        ASSERT_EQ(r.draw_index(), static_cast<uint64_t>(generated)) << at << ": seq " << e.seq;
        ASSERT_EQ(r.seed(), s.sampling.seed());
        ASSERT_EQ(r.temperature(), s.sampling.temperature());
        const std::vector<int32_t> prompt(tokens.begin(), tokens.begin() + s.prompt_len);
        const std::vector<int32_t> output(tokens.begin() + s.prompt_len, tokens.end());
        const bool repetition = s.sampling.repetition_penalty() != 0 && s.sampling.repetition_penalty() != 1;
        ASSERT_EQ(std::vector<int32_t>(r.penalty_prompt_ids().begin(), r.penalty_prompt_ids().end()),
                  repetition ? prompt : std::vector<int32_t>{})
            << at << ": seq " << e.seq;
        ASSERT_EQ(std::vector<int32_t>(r.penalty_output_ids().begin(), r.penalty_output_ids().end()),
                  PenaltyOn(s.sampling) ? output : std::vector<int32_t>{})
            << at << ": seq " << e.seq;
        ++logit_rows;
      } else {
        ASSERT_EQ(e.logit_row, -1) << at << ": seq " << e.seq << " samples before its end";
      }
      // The blocks the sequence uses: in range, its earlier blocks kept, none twice in its table.
      std::vector<int32_t> table;
      std::set<int32_t> own;
      for (int64_t b = 0; b < (end + bs - 1) / bs; ++b) {
        const int32_t block = sb.block_tables[row * mbps + b];
        ASSERT_GE(block, 0) << at;
        ASSERT_LT(block, o_.limits.num_kv_blocks) << at;
        if (!one_pool_slides_) {
          ASSERT_TRUE(own.insert(block).second) << at << ": block " << block << " twice in seq " << e.seq << "'s table";
        }
        table.push_back(block);
      }
      // The blocks it writes: no other sequence the workers hold (live, or removed with a step in
      // flight) has them in its table, so a shared (cached) block is only ever read.
      for (int64_t b = first[row] / bs; !one_pool_slides_ && b < (end + bs - 1) / bs; ++b) {
        ASSERT_EQ(holders[table[b]], 1) << at << ": seq " << e.seq << " writes block " << table[b]
                                       << ", which " << holders[table[b]] - 1 << " other sequence(s) hold";
      }
      ASSERT_GE(table.size(), s.table.size()) << at;
      ASSERT_TRUE(std::equal(s.table.begin(), s.table.end(), table.begin()))
          << at << ": seq " << e.seq << " block table changed without a recompute";
      s.table = table;
      if (!s.started) started.insert(e.seq);
      s.started = true;
      ++s.in_flight;
      if (e.logit_row >= 0) ++s.sampling_in_flight;
      s.fed = end;
    }
    ASSERT_EQ(logit_rows, static_cast<int>(sb.logit_rows.size())) << at;
    ASSERT_EQ(batch.prefill_tokens, prefill) << at;
    ASSERT_EQ(batch.decode_tokens, decode) << at;
    ASSERT_EQ(std::set<uint64_t>(batch.started.begin(), batch.started.end()), started) << at;
    ASSERT_EQ(batch.started.size(), started.size()) << at;

    busy_slots_.insert(step_slots.begin(), step_slots.end());
    max_in_flight_seen_ = std::max<int64_t>(max_in_flight_seen_, static_cast<int64_t>(in_flight_.size()) + 1);
  }

  const SchedulerOptions o_;
  Scheduler sched_;
  PersistentBatch worker_;   // what every worker holds
  int64_t plan_bytes_ = 0;
  const int64_t window_;          // sliding_window
  const bool one_pool_slides_;    // every layer slides: the one table lets go of blocks
  const bool two_pools_;          // full-attention layers and a sliding layers' pool
  std::vector<Cell> cache_;  // [num_kv_blocks * block_size]
  std::vector<Cell> sliding_cache_;  // [num_sliding_kv_blocks * block_size]
  std::map<uint64_t, std::vector<int32_t>> sliding_tables_;  // as the workers hold them
  std::map<uint64_t, Seq> seqs_;
  std::deque<Flight> in_flight_;  // oldest first
  std::set<int32_t> busy_slots_;
  uint64_t next_step_id_ = 0;
  int64_t restarts_ = 0;
  int64_t cached_tokens_ = 0;
  int64_t max_in_flight_seen_ = 0;
  int64_t chunks_behind_chunks_ = 0;
  int64_t continuations_ = 0;
};

// ---- End to end: many sequences through the simulated cluster -----------------------------------

struct ClusterParam {
  int lanes;
  int64_t num_kv_blocks;
  int64_t budget;  // max_tokens_per_step
  bool prefix_caching;
  bool shared_prefixes;  // prompts share system prompts and continue earlier conversations
  bool colliding_keys = false;  // every block key the same: hits only where the tokens match
  int64_t window = 0;           // sliding_window
  int64_t sliding_blocks = 0;   // > 0: full-attention layers beside a sliding pool of these; 0: every layer slides
  bool feed_samples = false;    // asynchronous scheduling
};


constexpr int64_t kBlockSize = 4;
constexpr int64_t kMaxPrompt = 40;
constexpr int64_t kMaxTokens = 30;
// A sequence caches at most prompt + max_tokens - 1 tokens (the last sampled one is never fed).
constexpr int64_t kMaxBlocksPerSeq = (kMaxPrompt + kMaxTokens - 1 + kBlockSize - 1) / kBlockSize;  // 18
constexpr int64_t kTinyCache = kMaxBlocksPerSeq;  // just one longest sequence
constexpr int64_t kMediumCache = 3 * kMaxBlocksPerSeq;
constexpr int64_t kGenerousCache = 64 * kMaxBlocksPerSeq;  // every sequence at once

class SchedulerClusterTest : public ::testing::TestWithParam<ClusterParam> {};

TEST_P(SchedulerClusterTest, EverySequenceMatchesItsSoloRun) {
  const ClusterParam& param = GetParam();
  SchedulerOptions o;
  o.lanes = param.lanes;
  o.limits.num_kv_blocks = param.num_kv_blocks;
  o.limits.block_size = kBlockSize;
  o.limits.max_model_len = kMaxBlocksPerSeq * o.limits.block_size;
  o.limits.max_tokens_per_step = param.budget;
  o.limits.max_seqs_per_step = std::min<int64_t>(param.budget, 32);  // max_tokens_per_step >= max_running
  o.prefix_caching = param.prefix_caching;
  if (param.colliding_keys) o.prefix_key_fn = &CollidingKey;
  o.sliding_window = param.window;
  o.full_layers = param.window == 0 || param.sliding_blocks > 0;
  o.limits.num_sliding_kv_blocks = param.sliding_blocks;
  o.feed_samples = param.feed_samples;
  SimCluster sim(o);

  // 64 sequences, one of them as long as allowed (so the tiny cache holds exactly one of it).
  constexpr int kSeqs = 64;
  std::mt19937_64 rng(1234 + param.lanes * 100 + param.num_kv_blocks + param.budget);
  struct Spec {
    std::vector<int32_t> prompt;
    int64_t max_tokens;
    v1::RowSampling sampling;
  };
  std::vector<Spec> specs(kSeqs);
  for (int i = 0; i < kSeqs; ++i) {
    const int64_t len = i == 0 ? kMaxPrompt : 1 + static_cast<int64_t>(rng() % kMaxPrompt);
    for (int64_t j = 0; j < len; ++j) specs[i].prompt.push_back(static_cast<int32_t>(rng() % kVocab));
    specs[i].max_tokens = i == 0 ? kMaxTokens : 1 + static_cast<int64_t>(rng() % kMaxTokens);
    specs[i].sampling.set_seed(rng());
    specs[i].sampling.set_temperature(0.5f * static_cast<float>(i % 3));
    if (i % 4 == 1) specs[i].sampling.set_repetition_penalty(1.3f);
    if (i % 4 == 2) specs[i].sampling.set_presence_penalty(0.5f);
    if (i % 4 == 3) specs[i].sampling.set_repetition_penalty(1.0f);  // off
  }
  std::shuffle(specs.begin() + 1, specs.end(), rng);  // the longest one is not always first
  std::swap(specs[0], specs[kSeqs / 3]);
  if (param.shared_prefixes) {
    // Chats: one of two system prompts (13 and 18 tokens: 3 and 4 full blocks and a partial one)
    // then a question; the next sequence continues that conversation (its prompt, the answer it
    // gets, a new question), so it can find blocks filled during decode; every third is random.
    std::vector<int32_t> system[2];
    for (int k = 0; k < 2; ++k) {
      for (int j = 0; j < 13 + 5 * k; ++j) system[k].push_back(static_cast<int32_t>(rng() % kVocab));
    }
    for (int i = 0; i + 1 < kSeqs; i += 3) {
      if (i == kSeqs / 3) continue;  // the longest one stays
      Spec& first = specs[i];
      first.prompt = system[i % 2];
      for (int64_t j = 0, n = 1 + static_cast<int64_t>(rng() % 8); j < n; ++j) {
        first.prompt.push_back(static_cast<int32_t>(rng() % kVocab));
      }
      first.max_tokens = std::min<int64_t>(first.max_tokens, 8);
      if (i + 1 == kSeqs / 3) continue;
      Spec& next = specs[i + 1];
      next.prompt = first.prompt;
      for (int32_t t : Reference(first.prompt, first.max_tokens, first.sampling.seed())) next.prompt.push_back(t);
      for (int64_t j = 0, n = 1 + static_cast<int64_t>(rng() % 5); j < n; ++j) {
        next.prompt.push_back(static_cast<int32_t>(rng() % kVocab));
      }
      ASSERT_LE(static_cast<int64_t>(next.prompt.size()), kMaxPrompt);
    }
  }

  // Ids increase with arrival; 8 at first, then 0-2 between steps.
  int added = 0;
  auto add = [&](int n) {
    for (; n > 0 && added < kSeqs; --n, ++added) {
      // With asynchronous scheduling, every third sequence tells the scheduler its max_len (it then
      // never continues past it; the others are removed with a continuation in flight, as at a stop
      // token), and every fifth may not continue (as a constrained one).
      SeqOptions options;
      if (param.feed_samples && added % 3 == 0) {
        options.max_len = static_cast<int64_t>(specs[added].prompt.size()) + specs[added].max_tokens;
      }
      if (param.feed_samples && added % 5 == 0) options.feed_ahead = false;
      sim.Add(static_cast<uint64_t>(added + 1), specs[added].prompt, specs[added].max_tokens, specs[added].sampling,
              options);
    }
  };
  add(8);

  // No livelock: every iteration completes a step, and over 300 seeds of every case here the
  // steps never exceeded 0.72 x the tokens of all sequences (prompt + max_tokens), recomputes
  // included; 4x leaves room and still catches a schedule that spins.
  int64_t total = 0;
  for (const Spec& s : specs) total += static_cast<int64_t>(s.prompt.size()) + s.max_tokens;
  const int64_t max_iterations = 4 * total;
  int64_t iter = 0;
  for (; iter < max_iterations; ++iter) {
    sim.ScheduleFreeLanes();
    ASSERT_FALSE(HasFatalFailure());
    if (sim.idle()) {
      if (added == kSeqs) {
        bool all_done = true;
        for (int i = 1; i <= kSeqs; ++i) all_done = all_done && sim.Done(i);
        ASSERT_TRUE(all_done) << "stuck after " << sim.steps() << " steps: nothing scheduled with "
                              << sim.sched().num_running() << " running, " << sim.sched().num_waiting()
                              << " waiting, " << sim.sched().num_free_blocks() << " blocks free";
        break;
      }
      add(1);
      continue;
    }
    sim.CompleteOldest();
    ASSERT_FALSE(HasFatalFailure());
    add(static_cast<int>(rng() % 3));
  }
  ASSERT_LT(iter, max_iterations) << "no end after " << sim.steps() << " steps";

  for (int i = 0; i < kSeqs; ++i) {
    const uint64_t id = static_cast<uint64_t>(i + 1);
    EXPECT_EQ(sim.Generated(id), Reference(specs[i].prompt, specs[i].max_tokens, specs[i].sampling.seed()))
        << "seq " << id;
  }
  Scheduler& s = sim.sched();
  EXPECT_EQ(s.num_running(), 0);
  EXPECT_EQ(s.num_waiting(), 0);
  EXPECT_EQ(s.num_free_blocks(), s.num_blocks());
  EXPECT_EQ(sim.restarts(), s.preemptions()) << "every preempted sequence starts over as a new one";
  EXPECT_EQ(s.block_manager().num_used(), 0);
  if (s.sliding_block_manager() != nullptr) {
    EXPECT_EQ(s.sliding_block_manager()->num_used(), 0);
    EXPECT_EQ(s.sliding_block_manager()->num_available(), param.sliding_blocks);
  }
  if (!param.prefix_caching) {
    EXPECT_EQ(sim.cached_tokens(), 0);
    EXPECT_EQ(s.prefix_query_tokens(), 0);
  } else if (param.shared_prefixes && param.num_kv_blocks != kTinyCache && param.window == 0) {
    EXPECT_GT(sim.cached_tokens(), 0) << "no sequence found its system prompt or conversation cached";
  }
  EXPECT_LE(s.prefix_hit_tokens(), s.prefix_query_tokens());
  EXPECT_EQ(s.prefix_hit_tokens(), sim.cached_tokens());
  if (param.num_kv_blocks == kTinyCache) {
    EXPECT_GT(s.preemptions(), 0);
  }
  if (param.num_kv_blocks == kGenerousCache) {
    EXPECT_EQ(s.preemptions(), 0);
  }
  // With room for one sequence the lanes may never run at once (lane 0, scheduled first, takes
  // the free blocks); otherwise two steps must have been in flight together.
  if (param.lanes > 1 && param.num_kv_blocks != kTinyCache) {
    EXPECT_GT(sim.max_in_flight_seen(), 1) << "the lanes never overlapped";
  }
  // With 8-token steps, prompts of up to 40 tokens are chunked, and with several lanes a chunk
  // follows the one before it while that one is still in flight.
  if (param.lanes > 1 && param.budget == 8 && param.num_kv_blocks != kTinyCache) {
    EXPECT_GT(sim.chunks_behind_chunks(), 0) << "no prompt chunk followed one in flight";
  }
  if (param.lanes == 1 && !param.feed_samples) {
    EXPECT_EQ(sim.chunks_behind_chunks(), 0);
  }
  if (param.feed_samples) {
    EXPECT_GT(sim.continuations(), 0) << "no sequence continued before its sample was back";
  } else {
    EXPECT_EQ(sim.continuations(), 0);
  }
  RecordProperty("steps", static_cast<int>(sim.steps()));
  RecordProperty("preemptions", static_cast<int>(s.preemptions()));
}

std::vector<ClusterParam> ClusterParams() {
  std::vector<ClusterParam> out;
  for (int lanes : {1, 2, 3}) {
    for (int64_t blocks : {kTinyCache, kMediumCache, kGenerousCache}) {
      for (int64_t budget : {8, 256}) {
        for (const auto& [caching, shared] : {std::pair{true, true}, std::pair{false, true}, std::pair{true, false}}) {
          out.push_back({lanes, blocks, budget, caching, shared});
        }
      }
    }
    out.push_back({lanes, kMediumCache, 8, true, true, /*colliding_keys=*/true});
    // Sliding windows of 10 and 3 tokens (blocks of 4): every layer sliding, or beside full
    // layers with a sliding pool of 8 blocks (5 hold an 8-token step's window) or of one longest
    // sequence's 18 (256-token steps take whole prompts).
    for (const auto& [window, sliding_blocks, budget] : {std::tuple<int64_t, int64_t, int64_t>{10, 0, 8},
                                                         {3, 0, 256},
                                                         {10, 8, 8},
                                                         {3, kMaxBlocksPerSeq, 256}}) {
      for (const bool caching : {true, false}) {
        out.push_back({lanes, kMediumCache, budget, caching, true, false, window, sliding_blocks});
      }
    }
  }
  // Asynchronous scheduling (a group of one worker: one lane, or more with --micro-batches).
  for (int lanes : {1, 2}) {
    for (int64_t blocks : {kTinyCache, kMediumCache, kGenerousCache}) {
      for (int64_t budget : {8, 256}) {
        out.push_back({lanes, blocks, budget, true, true, false, 0, 0, /*feed_samples=*/true});
      }
    }
    out.push_back({lanes, kMediumCache, 8, false, false, false, 0, 0, true});
    out.push_back({lanes, kMediumCache, 8, true, true, false, 10, 0, true});
    out.push_back({lanes, kMediumCache, 256, true, true, false, 3, kMaxBlocksPerSeq, true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Sim, SchedulerClusterTest, ::testing::ValuesIn(ClusterParams()),
                         [](const ::testing::TestParamInfo<ClusterParam>& info) {
                           return "Lanes" + std::to_string(info.param.lanes) + "_Blocks" +
                                  std::to_string(info.param.num_kv_blocks) + "_Budget" +
                                  std::to_string(info.param.budget) +
                                  (info.param.prefix_caching ? "_Caching" : "_NoCaching") +
                                  (info.param.shared_prefixes ? "_SharedPrefixes" : "_RandomPrompts") +
                                  (info.param.colliding_keys ? "_CollidingKeys" : "") +
                                  (info.param.window > 0 ? "_Window" + std::to_string(info.param.window) : "") +
                                  (info.param.sliding_blocks > 0
                                       ? "_SlidingPool" + std::to_string(info.param.sliding_blocks)
                                       : "") +
                                  (info.param.feed_samples ? "_Async" : "");
                         });

// ---- Focused behaviours ------------------------------------------------------------------------

// Without the prefix cache: these tests pin schedules, and their prompts (Prompt()) share
// prefixes; the prefix cache has its own tests below.
SchedulerOptions SmallOptions() {
  SchedulerOptions o;
  o.prefix_caching = false;
  o.limits.max_seqs_per_step = 8;
  o.limits.max_tokens_per_step = 8;
  o.limits.num_kv_blocks = 256;
  o.limits.block_size = 4;
  o.limits.max_model_len = 64 * o.limits.block_size;
  o.lanes = 1;
  return o;
}

// Two lanes, 512 tokens per step, up to 64 sequences.
SchedulerOptions TwoLanes() {
  SchedulerOptions o = SmallOptions();
  o.limits.max_seqs_per_step = 64;
  o.limits.max_tokens_per_step = 512;
  o.lanes = 2;
  return o;
}

std::vector<int32_t> Prompt(int n, int32_t first = 1) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = first + i;
  return p;
}

// Rows of a plan that sample.
int LogitRows(const v1::StepPlan& p) {
  return static_cast<int>(std::count(p.row_samples().begin(), p.row_samples().end(), true));
}

// One id per logit row.
std::vector<int32_t> Sampled(const v1::StepPlan& p, int32_t token = 7) {
  return std::vector<int32_t>(LogitRows(p), token);
}

// A worker's view of one scheduler's plans: Apply them in the order built.
class Decoder {
 public:
  explicit Decoder(const StepLimits& limits) : worker_(limits, kVocab, /*keep_history=*/true) {}
  // The plan expanded; sampling() then holds its rows' settings.
  StepBatch Apply(const v1::StepPlan& p) {
    StepBatch b;
    const absl::Status s = worker_.Apply(p, &b, &sampling_);
    EXPECT_TRUE(s.ok()) << s;
    return b;
  }
  const google::protobuf::RepeatedPtrField<v1::RowSampling>& sampling() const { return sampling_; }

 private:
  PersistentBatch worker_;
  google::protobuf::RepeatedPtrField<v1::RowSampling> sampling_;
};

// A running decode is in every step while a 100-token prompt takes the 7 tokens it leaves.
TEST(SchedulerTest, DecodesFirstWhileALongPromptIsChunked) {
  Scheduler s(SmallOptions());
  v1::StepPlan p;
  s.Add(1, Prompt(3), {});
  ASSERT_NE(s.Schedule(0, 0, &p), nullptr);
  ASSERT_EQ(s.Complete(0, Sampled(p)).size(), 1u);  // seq 1 decodes from now on
  s.Add(2, Prompt(100), {});
  int64_t prefilled = 0;
  int steps = 0;
  while (prefilled < 100) {
    const MicroBatch* b = s.Schedule(0, static_cast<uint64_t>(++steps), &p);
    ASSERT_NE(b, nullptr);
    ASSERT_EQ(b->entries.size(), 2u) << "step " << steps;
    EXPECT_EQ(b->entries[0].seq, 1u);
    EXPECT_EQ(b->entries[0].tokens, 1);
    EXPECT_EQ(b->entries[0].logit_row, 0);
    EXPECT_EQ(b->entries[1].seq, 2u);
    EXPECT_EQ(b->entries[1].tokens, std::min<int64_t>(7, 100 - prefilled)) << "step " << steps;
    EXPECT_EQ(b->decode_tokens, 1);
    prefilled += b->entries[1].tokens;
    EXPECT_EQ(b->entries[1].logit_row, prefilled == 100 ? 1 : -1);
    s.Complete(0, Sampled(p));
    ASSERT_LE(steps, 20);
  }
  EXPECT_EQ(steps, 15);  // ceil(100 / 7)
  EXPECT_EQ(s.generated(1), 1 + steps);
  EXPECT_EQ(s.generated(2), 1);
}

// Never more than max_running sequences run; the others wait and are admitted, oldest first, as
// the running ones finish.
TEST(SchedulerTest, MaxRunningLimitsTheBatch) {
  SchedulerOptions o = SmallOptions();
  o.limits.max_seqs_per_step = 3;
  o.limits.max_tokens_per_step = 64;
  Scheduler s(o);
  constexpr int kSeqs = 10;
  std::map<uint64_t, int64_t> max_tokens;
  for (int i = 1; i <= kSeqs; ++i) {
    s.Add(i, Prompt(2 + i % 4), {});
    max_tokens[i] = 1 + (i * 7) % 5;
  }
  std::set<uint64_t> started;
  v1::StepPlan p;
  for (int step = 0; s.num_running() + s.num_waiting() > 0; ++step) {
    ASSERT_LT(step, 200);
    const MicroBatch* b = s.Schedule(0, step, &p);
    ASSERT_NE(b, nullptr) << "nothing scheduled with " << s.num_waiting() << " waiting";
    EXPECT_LE(b->entries.size(), 3u);
    EXPECT_LE(s.num_running(), 3);
    EXPECT_EQ(s.num_running(), std::min<int64_t>(3, s.num_running() + s.num_waiting()))
        << "a free place in the batch was left empty";
    for (uint64_t id : b->started) {
      EXPECT_EQ(id, started.size() + 1) << "admitted out of order";
      started.insert(id);
    }
    for (const SampledToken& t : s.Complete(0, Sampled(p))) {
      if (s.generated(t.seq) == max_tokens[t.seq]) s.Remove(t.seq);
    }
  }
  EXPECT_EQ(started.size(), static_cast<size_t>(kSeqs));
  EXPECT_EQ(s.num_free_blocks(), s.num_blocks());
}

// 16 sequences at once over 2 lanes: each lane's first step takes its share of 8, disjoint.
TEST(SchedulerTest, LanesShareTheSequences) {
  SchedulerOptions o = TwoLanes();
  Scheduler s(o);
  for (int i = 1; i <= 16; ++i) s.Add(i, Prompt(5), {});
  v1::StepPlan p0, p1;
  const MicroBatch* b0 = s.Schedule(0, 0, &p0);
  ASSERT_NE(b0, nullptr);
  EXPECT_EQ(s.Schedule(0, 1, &p0), nullptr) << "lane 0 has a step in flight";
  const MicroBatch* b1 = s.Schedule(1, 1, &p1);
  ASSERT_NE(b1, nullptr);
  ASSERT_EQ(b0->entries.size(), 8u);
  ASSERT_EQ(b1->entries.size(), 8u);
  std::set<uint64_t> ids;
  for (const auto& e : b0->entries) ids.insert(e.seq);
  for (const auto& e : b1->entries) ids.insert(e.seq);
  EXPECT_EQ(ids.size(), 16u);
  EXPECT_EQ(b0->entries.front().seq, 1u);  // oldest first
  EXPECT_EQ(b1->entries.front().seq, 9u);
  Decoder worker(o.limits);
  const StepBatch d0 = worker.Apply(p0), d1 = worker.Apply(p1);
  std::set<int32_t> slots0(d0.slots.begin(), d0.slots.end());
  for (int32_t slot : d1.slots) EXPECT_FALSE(slots0.count(slot)) << "slot " << slot << " in both lanes";
  EXPECT_EQ(s.num_running(), 16);
  EXPECT_EQ(s.num_waiting(), 0);
}

// With 2 lanes a 40-token prompt flows through the pipeline: each lane's step takes the next 8
// tokens while the chunk before is still in flight, and only the last chunk samples.
TEST(SchedulerTest, PromptChunksFlowThroughThePipeline) {
  SchedulerOptions o = SmallOptions();  // 8 tokens per step
  o.lanes = 2;
  Scheduler s(o);
  s.Add(1, Prompt(40), {});
  v1::StepPlan p[2];
  int64_t fed = 0;
  std::deque<int> in_flight;
  for (int step = 0; fed < 40; ++step) {
    ASSERT_LT(step, 10);
    const int lane = step % 2;
    const MicroBatch* b = s.Schedule(lane, step, &p[lane]);
    ASSERT_NE(b, nullptr) << "step " << step;
    ASSERT_EQ(b->entries.size(), 1u);
    EXPECT_EQ(b->entries[0].tokens, 8);
    EXPECT_EQ(p[lane].row_start_positions(0), fed) << "step " << step;
    fed += 8;
    EXPECT_EQ(b->entries[0].logit_row, fed == 40 ? 0 : -1);
    in_flight.push_back(lane);
    if (step == 1) {
      EXPECT_TRUE(s.LaneBusy(0) && s.LaneBusy(1)) << "the second chunk waited for the first";
    }
    if (in_flight.size() == 2) {  // the engine completes the oldest step before scheduling its lane again
      EXPECT_TRUE(s.Complete(in_flight.front(), Sampled(p[in_flight.front()])).empty());
      in_flight.pop_front();
    }
  }
  const std::vector<SampledToken> last = s.Complete(in_flight.front(), Sampled(p[in_flight.front()]));
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(s.generated(1), 1);
  s.Remove(1);
  EXPECT_EQ(s.num_free_blocks(), s.num_blocks());
}

// With 2 lanes a 400-token prompt is split evenly enough that both lanes' steps work: 256 tokens
// (budget / lanes, the least a split takes) in lane 0, the other 144 in lane 1, whose chunk samples,
// so the sequence decodes in lane 1 from then on.
TEST(SchedulerTest, APromptIsSplitAcrossTheLanes) {
  SchedulerOptions o = TwoLanes();
  Scheduler s(o);
  s.Add(1, Prompt(400), {});
  v1::StepPlan p0, p1;
  const MicroBatch* b0 = s.Schedule(0, 0, &p0);
  ASSERT_NE(b0, nullptr);
  EXPECT_EQ(b0->prefill_tokens, 256);
  const MicroBatch* b1 = s.Schedule(1, 1, &p1);
  ASSERT_NE(b1, nullptr);
  EXPECT_EQ(b1->prefill_tokens, 144);
  EXPECT_EQ(p1.row_start_positions(0), 256);
  EXPECT_EQ(b1->entries[0].logit_row, 0);
  EXPECT_TRUE(s.Complete(0, Sampled(p0)).empty());
  EXPECT_EQ(s.Complete(1, Sampled(p1)).size(), 1u);
  EXPECT_EQ(s.Schedule(0, 2, &p0), nullptr) << "the sequence moved to lane 1";
  const MicroBatch* d = s.Schedule(1, 2, &p1);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->decode_tokens, 1);

  // With one lane the same prompt is one chunk.
  o.lanes = 1;
  Scheduler one(o);
  one.Add(1, Prompt(400), {});
  const MicroBatch* whole = one.Schedule(0, 0, &p0);
  ASSERT_NE(whole, nullptr);
  EXPECT_EQ(whole->prefill_tokens, 400);
}

// A lane at its share of the sequences still takes prompt work while another lane's step is in
// flight: it carries a new sequence's first chunk, and the sequence samples and decodes in the
// other lane, which was below its share.
TEST(SchedulerTest, ALaneAtItsShareCarriesAPromptForABusyLane) {
  SchedulerOptions o = TwoLanes();
  Scheduler s(o);
  v1::StepPlan p0, p1;
  auto tokens_of = [](const MicroBatch* b, uint64_t seq) {
    for (const MicroBatch::Entry& e : b->entries) {
      if (e.seq == seq) return e;
    }
    return MicroBatch::Entry{};
  };
  s.Add(1, Prompt(5), {});
  s.Add(2, Prompt(5), {});
  ASSERT_NE(s.Schedule(0, 0, &p0), nullptr);  // seq 1 (lane 1 is free: it takes seq 2 itself)
  const MicroBatch* b1 = s.Schedule(1, 1, &p1);
  ASSERT_NE(b1, nullptr);
  EXPECT_EQ(tokens_of(b1, 2).tokens, 5);
  ASSERT_EQ(s.Complete(0, Sampled(p0)).size(), 1u);
  ASSERT_EQ(s.Complete(1, Sampled(p1)).size(), 1u);

  s.Add(3, Prompt(400), {});
  const MicroBatch* b0 = s.Schedule(0, 2, &p0);  // seq 1's decode, seq 3's first 256 tokens
  ASSERT_NE(b0, nullptr);
  EXPECT_EQ(tokens_of(b0, 3).tokens, 256);
  s.Add(4, Prompt(400), {});
  b1 = s.Schedule(1, 3, &p1);  // seq 2's decode, the rest of seq 3 (it moves here), seq 4's start
  ASSERT_NE(b1, nullptr);
  EXPECT_EQ(tokens_of(b1, 2).tokens, 1);
  EXPECT_EQ(tokens_of(b1, 3).tokens, 144);
  EXPECT_GE(tokens_of(b1, 3).logit_row, 0);
  EXPECT_EQ(tokens_of(b1, 4).tokens, 256) << "lane 1 holds its share, lane 0 is busy: seq 4 starts here";
  EXPECT_EQ(tokens_of(b1, 4).logit_row, -1);
  EXPECT_TRUE(s.Complete(0, Sampled(p0)).size() == 1u);
  b0 = s.Schedule(0, 4, &p0);  // seq 1's decode and the rest of seq 4, which samples here
  ASSERT_NE(b0, nullptr);
  EXPECT_EQ(tokens_of(b0, 4).tokens, 144);
  EXPECT_GE(tokens_of(b0, 4).logit_row, 0);
  const int last = p0.row_seq_ids_size() - 1;
  EXPECT_EQ(p0.row_seq_ids(last), 4u);
  EXPECT_EQ(p0.row_start_positions(last) + p0.row_num_tokens(last) - 1, 399);
}

// Remove: a sequence in a step in flight is freed when the step comes back and is not returned by
// Complete; a waiting one frees nothing and is never scheduled.
TEST(SchedulerTest, RemoveWhileInFlight) {
  SchedulerOptions o = SmallOptions();
  o.limits.max_seqs_per_step = 16;
  o.limits.max_tokens_per_step = 64;
  o.limits.num_kv_blocks = 64;
  o.lanes = 2;
  Scheduler s(o);
  for (int i = 1; i <= 4; ++i) s.Add(i, Prompt(6), {});  // 2 blocks each
  v1::StepPlan p0, p1;
  const MicroBatch* b0 = s.Schedule(0, 0, &p0);
  const MicroBatch* b1 = s.Schedule(1, 1, &p1);
  ASSERT_NE(b0, nullptr);
  ASSERT_NE(b1, nullptr);
  ASSERT_EQ(b0->entries.size(), 2u);
  ASSERT_EQ(b1->entries.size(), 2u);
  EXPECT_EQ(s.num_free_blocks(), 64 - 8);

  s.Add(5, Prompt(6), {});
  s.Add(6, Prompt(6), {});
  s.Remove(1);  // in lane 0's step in flight
  EXPECT_EQ(s.num_free_blocks(), 64 - 8) << "freed while its step is in flight";
  s.Remove(5);  // waiting
  EXPECT_EQ(s.num_free_blocks(), 64 - 8);
  EXPECT_FALSE(s.Contains(5));
  EXPECT_EQ(s.num_waiting(), 1);
  s.Remove(12345);  // unknown: ignored

  const std::vector<SampledToken> out0 = s.Complete(0, Sampled(p0));
  ASSERT_EQ(out0.size(), 1u);
  EXPECT_EQ(out0[0].seq, 2u);
  EXPECT_EQ(out0[0].logit_row, 1);
  EXPECT_FALSE(s.Contains(1));
  EXPECT_EQ(s.num_free_blocks(), 64 - 6);

  // Seq 2 decodes, seq 6 is admitted; seq 5 never runs.
  b0 = s.Schedule(0, 2, &p0);
  ASSERT_NE(b0, nullptr);
  std::set<uint64_t> ids;
  for (const auto& e : b0->entries) ids.insert(e.seq);
  EXPECT_EQ(ids, (std::set<uint64_t>{2, 6}));

  // Everything removed while both lanes are in flight: freed as the steps come back.
  for (uint64_t id : {2, 3, 4, 6}) s.Remove(id);
  EXPECT_LT(s.num_free_blocks(), s.num_blocks());
  EXPECT_TRUE(s.Complete(1, Sampled(p1)).empty());
  EXPECT_TRUE(s.Complete(0, Sampled(p0)).empty());
  EXPECT_EQ(s.num_free_blocks(), s.num_blocks());
  EXPECT_EQ(s.num_running(), 0);
  EXPECT_EQ(s.num_waiting(), 0);
  EXPECT_EQ(s.Schedule(0, 3, &p0), nullptr);
  EXPECT_EQ(s.Schedule(1, 3, &p1), nullptr);
}

// The group re-formed (docs/healing.md): with a step in flight and a sequence removed while in it,
// every sequence goes back to waiting with its tokens, all blocks are free, and the next plans
// bring every sequence to fresh workers as new, from position 0, with prompt + generated tokens;
// the row that samples draws the sequence's next index (its prompt length stays).
TEST(SchedulerTest, RequeueAllForRegroupRecomputesEverySequenceOnFreshWorkers) {
  SchedulerOptions o = TwoLanes();
  o.limits.max_tokens_per_step = 64;
  Scheduler s(o);
  Decoder old_workers(o.limits);
  std::map<uint64_t, std::vector<int32_t>> tokens = {{1, Prompt(5)}, {2, Prompt(3, 100)}, {3, Prompt(4, 200)}};
  for (const auto& [id, t] : tokens) s.Add(id, t, {});
  v1::StepPlan p;
  uint64_t step = 0;
  for (int round = 0; round < 4; ++round) {
    for (int lane = 0; lane < 2; ++lane) {
      if (s.Schedule(lane, ++step, &p) == nullptr) continue;
      old_workers.Apply(p);
      for (const SampledToken& t : s.Complete(lane, Sampled(p, static_cast<int32_t>(10 + step)))) {
        tokens[t.seq].push_back(t.token);
      }
    }
  }
  ASSERT_GT(s.generated(2), 1);
  // A step in flight when the group breaks; sequence 1 is removed while in it.
  const MicroBatch* b = s.Schedule(0, ++step, &p);
  ASSERT_NE(b, nullptr);
  s.Remove(b->entries[0].seq);
  const uint64_t removed = b->entries[0].seq;
  tokens.erase(removed);

  s.RequeueAllForRegroup();
  EXPECT_FALSE(s.Contains(removed));
  EXPECT_EQ(s.num_running(), 0);
  EXPECT_EQ(s.num_waiting(), 2);
  EXPECT_EQ(s.num_free_blocks(), s.num_blocks());
  EXPECT_EQ(s.preemptions(), 0);
  EXPECT_FALSE(s.LaneBusy(0));

  Decoder new_workers(o.limits);
  std::set<uint64_t> seen;
  for (int i = 0; i < 4 && seen.size() < tokens.size(); ++i) {
    for (int lane = 0; lane < 2; ++lane) {
      if (s.Schedule(lane, ++step, &p) == nullptr) continue;
      EXPECT_EQ(p.freed_seq_ids_size(), 0) << "the new workers hold nothing to free";
      new_workers.Apply(p);
      int offset = 0, row = 0;
      for (int r = 0; r < p.row_seq_ids_size(); ++r) {
        const uint64_t id = p.row_seq_ids(r);
        const std::vector<int32_t>& want = tokens.at(id);
        if (!seen.count(id)) {
          EXPECT_EQ(p.row_start_positions(r), 0) << "seq " << id;
          seen.insert(id);
        }
        const std::vector<int32_t> fed(p.token_ids().begin() + offset,
                                       p.token_ids().begin() + offset + p.row_num_tokens(r));
        EXPECT_TRUE(std::equal(fed.begin(), fed.end(), want.begin() + p.row_start_positions(r))) << "seq " << id;
        offset += p.row_num_tokens(r);
        if (p.row_samples(r)) {
          // The index of the token it samples next: what it had generated before the regroup.
          EXPECT_EQ(static_cast<int64_t>(new_workers.sampling()[row].draw_index()), s.generated(id)) << "seq " << id;
          ++row;
        }
      }
      s.Complete(lane, Sampled(p));
    }
  }
  EXPECT_EQ(seen.size(), tokens.size());
}

// The ids of sequences removed while in flight in the simulated cluster: cancellations at random
// points, including in the middle of a prefill and while steps of other lanes are in flight.
// With the prefix cache on, half the prompts start with the same 12 tokens (3 blocks), so cancelled
// sequences also let go of shared blocks that others still read.
TEST(SchedulerTest, CancellationsInTheSimulatedCluster) {
 for (const bool caching : {false, true}) {
  SCOPED_TRACE(caching ? "prefix caching on" : "prefix caching off");
  SchedulerOptions o = SmallOptions();
  o.prefix_caching = caching;
  o.lanes = 2;
  o.limits.num_kv_blocks = 24;
  o.limits.max_model_len = 16 * o.limits.block_size;
  SimCluster sim(o);
  std::mt19937_64 rng(99);
  constexpr int kSeqs = 40;
  std::vector<std::vector<int32_t>> prompts(kSeqs);
  std::vector<int64_t> max_tokens(kSeqs);
  const std::vector<int32_t> shared = Prompt(12, 500);
  for (int i = 0; i < kSeqs; ++i) {
    if (caching && i % 2 == 0) prompts[i] = shared;
    for (int j = 0, n = 1 + static_cast<int>(rng() % 30) - static_cast<int>(prompts[i].size()) / 2; j < n; ++j) {
      prompts[i].push_back(static_cast<int32_t>(rng() % kVocab));
    }
    max_tokens[i] = 1 + static_cast<int64_t>(rng() % 20);
    v1::RowSampling r;
    r.set_seed(i);
    sim.Add(i + 1, prompts[i], max_tokens[i], r);
  }
  std::set<uint64_t> cancelled;
  for (int iter = 0; iter < 5000; ++iter) {
    sim.ScheduleFreeLanes();
    ASSERT_FALSE(HasFatalFailure());
    if (sim.idle()) break;
    if (rng() % 4 == 0) {
      const uint64_t id = 1 + rng() % kSeqs;
      if (!sim.Done(id) && !cancelled.count(id)) {
        cancelled.insert(id);
        sim.Cancel(id);
      }
    }
    sim.CompleteOldest();
    ASSERT_FALSE(HasFatalFailure());
  }
  ASSERT_TRUE(sim.idle());
  EXPECT_GT(cancelled.size(), 0u);
  for (int i = 0; i < kSeqs; ++i) {
    const uint64_t id = i + 1;
    if (cancelled.count(id)) continue;
    EXPECT_TRUE(sim.Done(id)) << "seq " << id;
    EXPECT_EQ(sim.Generated(id), Reference(prompts[i], max_tokens[i], i)) << "seq " << id;
  }
  EXPECT_EQ(sim.sched().num_running(), 0);
  EXPECT_EQ(sim.sched().num_waiting(), 0);
  EXPECT_EQ(sim.sched().num_free_blocks(), sim.sched().num_blocks());
  EXPECT_EQ(sim.sched().block_manager().num_used(), 0);
  if (caching) { EXPECT_GT(sim.cached_tokens(), 0); }
 }
}

// An older running sequence waiting for a block (the newer sequence that holds the cache is in a
// step in flight) has the first claim on the blocks that sequence frees: when the newer one
// preempts itself, it is not admitted again in the same step. (Before the fix it was, every step,
// and with 2 lanes neither sequence ever advanced.)
TEST(SchedulerTest, AStalledRunningSequenceGoesBeforeAdmissions) {
  SchedulerOptions o = SmallOptions();
  o.limits.num_kv_blocks = 4;  // 16 tokens: two 8-token prompts fill it
  o.limits.max_model_len = 4 * o.limits.block_size;
  o.limits.max_tokens_per_step = 16;  // 8-token prompts are not split across the lanes
  o.lanes = 2;
  Scheduler s(o);
  v1::StepPlan p0, p1;
  s.Add(1, Prompt(2), {});
  ASSERT_NE(s.Schedule(0, 0, &p0), nullptr);  // lane 0: seq 1
  s.Add(2, Prompt(8), {});
  ASSERT_NE(s.Schedule(1, 1, &p1), nullptr);  // lane 1: seq 2 (older than seq 3 below)
  ASSERT_EQ(s.Complete(0, Sampled(p0)).size(), 1u);
  s.Remove(1);
  s.Add(3, Prompt(8), {});
  const MicroBatch* b0 = s.Schedule(0, 2, &p0);  // lane 0: seq 3
  ASSERT_NE(b0, nullptr);
  ASSERT_EQ(b0->entries.size(), 1u);
  ASSERT_EQ(b0->entries[0].seq, 3u);
  EXPECT_EQ(s.num_free_blocks(), 0);

  ASSERT_EQ(s.Complete(1, Sampled(p1)).size(), 1u);  // seq 2 needs a third block
  EXPECT_EQ(s.Schedule(1, 3, &p1), nullptr) << "seq 3, which holds the blocks, is in flight";
  ASSERT_EQ(s.Complete(0, Sampled(p0)).size(), 1u);  // seq 3 needs a third block too
  // Lane 0 first, as the engine does: seq 3, the newest, gives way and stays out.
  EXPECT_EQ(s.Schedule(0, 4, &p0), nullptr);
  EXPECT_EQ(s.preemptions(), 1);
  EXPECT_EQ(s.num_waiting(), 1);
  const MicroBatch* b1 = s.Schedule(1, 5, &p1);
  ASSERT_NE(b1, nullptr);
  ASSERT_EQ(b1->entries.size(), 1u);
  EXPECT_EQ(b1->entries[0].seq, 2u);
  EXPECT_EQ(b1->entries[0].tokens, 1);
}

// Plans are stateful: a decode step of N sequences costs a few bytes per sequence whatever their
// context, and only the steps that cross into a new block carry one more block id each. In the
// stateless plans of protocol version 1 each row carried its whole block table (max_blocks_per_seq
// ids) and, with a penalty on, the whole history. Every plan is decoded by a worker's
// PersistentBatch, which must accept it, and a finished sequence's state is dropped.
TEST(SchedulerTest, DecodePlansStaySmallAsTheContextGrows) {
  constexpr int kSeqs = 8;
  SchedulerOptions o = SmallOptions();  // blocks of 4 tokens
  o.limits.max_seqs_per_step = kSeqs;
  o.limits.max_tokens_per_step = 64;
  o.limits.max_model_len = 1024;
  o.limits.num_kv_blocks = kSeqs * o.limits.max_blocks_per_seq();
  Scheduler s(o);
  Decoder worker(o.limits);
  v1::RowSampling penalized;
  penalized.set_repetition_penalty(1.2f);
  penalized.set_frequency_penalty(0.5f);
  for (int i = 1; i <= kSeqs; ++i) s.Add(i, Prompt(4, 10 * i), penalized);
  v1::StepPlan p;
  size_t early = 0, late = 0;
  for (int step = 0; step < 1000; ++step) {
    const MicroBatch* b = s.Schedule(0, step, &p);
    ASSERT_NE(b, nullptr);
    worker.Apply(p);
    if (step > 0) {
      ASSERT_EQ(b->decode_tokens, kSeqs);
      ASSERT_EQ(p.new_seqs_size(), 0);
      // About 8 bytes a row; every 4th step each sequence crosses into a new block, which costs
      // its row a SeqBlocks of about 10 bytes more.
      EXPECT_LE(p.ByteSizeLong(), kSeqs * (8 + 12) + 16u) << "step " << step;
      if (p.appended_blocks_size() == 0) {
        size_t& most = step < 100 ? early : late;
        most = std::max(most, p.ByteSizeLong());
      }
    }
    // The worker's sampler still sees the whole history.
    ASSERT_EQ(worker.sampling().size(), kSeqs);
    EXPECT_EQ(worker.sampling()[0].penalty_output_ids_size(), step);
    EXPECT_EQ(worker.sampling()[0].penalty_prompt_ids_size(), 4);
    s.Complete(0, Sampled(p, 900 + step % 7));
  }
  // Positions past 127 and 16383 take a varint byte more each; nothing else grows.
  EXPECT_LE(late, early + 2 * kSeqs) << "decode plans grow with the context";
  // Finished sequences are freed in the next plan.
  for (int i = 1; i <= kSeqs; ++i) s.Remove(i);
  s.Add(kSeqs + 1, Prompt(4), {});
  ASSERT_NE(s.Schedule(0, 1000, &p), nullptr);
  EXPECT_EQ(p.freed_seq_ids_size(), kSeqs);
  worker.Apply(p);
}

// Sampling rows, as the worker derives them from the plans: the request's template, the draw
// index, and the penalty ids only when a penalty is on (what the stateless plans carried).
TEST(SchedulerTest, SamplingRows) {
  Scheduler s(SmallOptions());
  v1::RowSampling plain;
  plain.set_temperature(0.7f);
  plain.set_top_k(5);
  plain.set_top_p(0.9f);
  plain.set_seed(42);
  plain.set_min_p(0.1f);
  plain.set_logprobs(true);
  plain.set_top_logprobs(3);
  v1::RowSampling repetition = plain, repetition_one = plain, presence = plain, frequency = plain;
  repetition.set_repetition_penalty(1.2f);
  repetition_one.set_repetition_penalty(1.0f);
  presence.set_presence_penalty(0.5f);
  frequency.set_frequency_penalty(-0.3f);
  const std::vector<v1::RowSampling> templates = {plain, repetition, repetition_one, presence, frequency};
  std::map<uint64_t, std::vector<int32_t>> prompt, output;
  for (size_t i = 0; i < templates.size(); ++i) {
    const uint64_t id = i + 1;
    prompt[id] = Prompt(1 + static_cast<int>(i), 100 * static_cast<int32_t>(id));
    s.Add(id, prompt[id], templates[i]);
  }
  v1::StepPlan p;
  Decoder worker(SmallOptions().limits);
  int rows_checked = 0;
  for (int step = 0; step < 4; ++step) {
    const MicroBatch* b = s.Schedule(0, step, &p);
    ASSERT_NE(b, nullptr);
    worker.Apply(p);
    std::vector<int32_t> sampled;
    for (const MicroBatch::Entry& e : b->entries) {
      if (e.logit_row < 0) continue;
      const v1::RowSampling& r = worker.sampling()[e.logit_row];
      const v1::RowSampling& t = templates[e.seq - 1];
      EXPECT_EQ(r.draw_index(), output[e.seq].size()) << "seq " << e.seq;
      EXPECT_EQ(r.temperature(), t.temperature());
      EXPECT_EQ(r.top_k(), t.top_k());
      EXPECT_EQ(r.top_p(), t.top_p());
      EXPECT_EQ(r.seed(), t.seed());
      EXPECT_EQ(r.min_p(), t.min_p());
      EXPECT_EQ(r.logprobs(), t.logprobs());
      EXPECT_EQ(r.top_logprobs(), t.top_logprobs());
      EXPECT_EQ(r.repetition_penalty(), t.repetition_penalty());
      EXPECT_EQ(r.presence_penalty(), t.presence_penalty());
      EXPECT_EQ(r.frequency_penalty(), t.frequency_penalty());
      const std::vector<int32_t> got_prompt(r.penalty_prompt_ids().begin(), r.penalty_prompt_ids().end());
      const std::vector<int32_t> got_output(r.penalty_output_ids().begin(), r.penalty_output_ids().end());
      EXPECT_EQ(got_prompt, e.seq == 2 ? prompt[e.seq] : std::vector<int32_t>{}) << "seq " << e.seq;
      EXPECT_EQ(got_output, (e.seq == 2 || e.seq == 4 || e.seq == 5) ? output[e.seq] : std::vector<int32_t>{})
          << "seq " << e.seq;
      ++rows_checked;
    }
    const std::vector<int32_t> ids = {11 + step, 22 + step, 33 + step, 44 + step, 55 + step};
    for (int k = 0; k < LogitRows(p); ++k) sampled.push_back(ids[k]);
    for (const SampledToken& t : s.Complete(0, sampled)) output[t.seq].push_back(t.token);
  }
  EXPECT_GE(rows_checked, 15);
  for (uint64_t id = 1; id <= 5; ++id) EXPECT_EQ(s.generated(id), static_cast<int64_t>(output[id].size()));
}


// ---- The prefix cache in the scheduler ---------------------------------------------------------

SchedulerOptions CachingOptions() {
  SchedulerOptions o = SmallOptions();
  o.prefix_caching = true;
  o.limits.max_tokens_per_step = 64;
  return o;
}

// Runs `id` alone until it has generated `n` tokens (sampling `token` each time), then removes it;
// `worker`, when given, applies the plans.
void RunToEnd(Scheduler& s, uint64_t id, int n, int32_t token, uint64_t* step, Decoder* worker = nullptr) {
  v1::StepPlan p;
  while (s.generated(id) < n) {
    ASSERT_NE(s.Schedule(0, (*step)++, &p), nullptr);
    if (worker != nullptr) worker->Apply(p);
    s.Complete(0, Sampled(p, token));
  }
  s.Remove(id);
}

// Prompt log-probabilities: a sequence that asks for them takes no cached blocks, and each chunk of
// its prompt scores every position but the prompt's last (which samples), a logit row each, within
// what max_seqs_per_step leaves beside the other sequences (8 here, with a decode beside it: chunks
// of 7 at most); the worker's rows name the prompt's next tokens; Complete gives every position
// back once, in order; once the first token is sampled nothing more is scored.
TEST(SchedulerTest, PromptScoringTakesARowAPositionWithinTheStep) {
  SchedulerOptions o = CachingOptions();  // 8 logit rows, 64 tokens a step, blocks of 4
  Scheduler s(o);
  Decoder worker(o.limits);
  uint64_t step = 0;
  const std::vector<int32_t> prompt = Prompt(30, 10);
  s.Add(1, prompt, {});
  RunToEnd(s, 1, 2, 7, &step, &worker);  // its full blocks stay cached
  s.Add(2, Prompt(3, 500), {});          // a decode beside the scored prompt
  v1::RowSampling scores;
  scores.set_prompt_logprobs(2);
  s.Add(3, prompt, scores);
  std::vector<int64_t> positions;  // scored, in the order Complete gave them
  v1::StepPlan p;
  int steps = 0;
  while (s.generated(3) < 3) {
    ASSERT_LT(++steps, 40);
    const MicroBatch* b = s.Schedule(0, step++, &p);
    ASSERT_NE(b, nullptr);
    EXPECT_LE(b->logit_rows, o.limits.max_seqs_per_step);
    for (const v1::NewSeq& n : p.new_seqs()) {
      if (n.seq_id() == 3) EXPECT_EQ(n.num_cached_tokens(), 0) << "a scored prompt took cached blocks";
    }
    worker.Apply(p);
    std::vector<int32_t> sampled(static_cast<size_t>(b->logit_rows), 7);
    int scored_in_plan = 0;
    for (const MicroBatch::Entry& e : b->entries) {
      if (e.seq != 3) {
        EXPECT_EQ(e.scored, 0);
        continue;
      }
      scored_in_plan += e.scored;
      for (int j = 0; j < e.scored; ++j) {
        const v1::RowSampling& r = worker.sampling()[e.scored_row + j];
        EXPECT_EQ(r.scored_id(), prompt[static_cast<size_t>(e.start + j + 1)]);
        EXPECT_TRUE(r.logprobs());
        EXPECT_EQ(r.top_logprobs(), 2);
        sampled[static_cast<size_t>(e.scored_row + j)] = r.scored_id();
      }
      if (e.scored > 0 && e.logit_row >= 0) EXPECT_EQ(e.logit_row, e.scored_row + e.scored);
    }
    EXPECT_EQ(p.scored_ids_size(), scored_in_plan);
    std::vector<ScoredPositions> scored;
    s.Complete(0, sampled, &scored);
    for (const ScoredPositions& sp : scored) {
      EXPECT_EQ(sp.seq, 3u);
      for (int j = 0; j < sp.count; ++j) positions.push_back(sp.position + j);
    }
  }
  std::vector<int64_t> want(prompt.size() - 1);
  for (size_t i = 0; i < want.size(); ++i) want[i] = static_cast<int64_t>(i);
  EXPECT_EQ(positions, want);
  EXPECT_GE(steps, 5) << "29 positions in chunks of at most 7";
}

// A finished sequence's full blocks stay cached; a new one with the same first tokens starts after
// them (its NewSeq says so, its first row starts there), its last prompt token always computed.
TEST(SchedulerTest, PrefixCacheHitOnASharedPrompt) {
  Scheduler s(CachingOptions());  // blocks of 4 tokens
  Decoder worker(CachingOptions().limits);
  uint64_t step = 0;
  s.Add(1, Prompt(10), {});
  RunToEnd(s, 1, 1, 7, &step, &worker);  // 10 prompt tokens fed: 2 full blocks cached, the partial one free
  EXPECT_EQ(s.num_cached_blocks(), 2);
  EXPECT_EQ(s.num_free_blocks(), s.num_blocks());
  EXPECT_EQ(s.prefix_query_tokens(), 10);
  EXPECT_EQ(s.prefix_hit_tokens(), 0);

  std::vector<int32_t> prompt = Prompt(9);
  prompt.push_back(500);  // the third block differs
  prompt.push_back(501);
  s.Add(2, prompt, {});
  v1::StepPlan p;
  const MicroBatch* b = s.Schedule(0, step++, &p);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(p.new_seqs_size(), 1);
  EXPECT_EQ(p.new_seqs(0).num_cached_tokens(), 8);
  EXPECT_EQ(p.row_start_positions(0), 8);
  EXPECT_EQ(b->entries[0].tokens, 3);
  EXPECT_EQ(b->prefill_tokens, 3);
  EXPECT_EQ(s.cached_prompt_tokens(2), 8);
  EXPECT_EQ(s.prefix_query_tokens(), 21);
  EXPECT_EQ(s.prefix_hit_tokens(), 8);
  EXPECT_EQ(s.num_cached_blocks(), 0) << "seq 2 holds them";
  EXPECT_EQ(s.block_manager().num_used(), 3);
  const StepBatch d = worker.Apply(p);
  EXPECT_EQ(d.positions, (std::vector<int32_t>{8, 9, 10}));
  s.Complete(0, Sampled(p));
  s.Remove(2);
  EXPECT_EQ(s.num_cached_blocks(), 2) << "seq 2's third block is not full";

  // The whole prompt cached (2 full blocks): the last block is computed again, so that the step
  // samples; the hit is one block.
  s.Add(3, Prompt(8), {});
  b = s.Schedule(0, step++, &p);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(p.new_seqs(0).num_cached_tokens(), 4);
  EXPECT_EQ(b->entries[0].tokens, 4);
  EXPECT_EQ(b->entries[0].logit_row, 0);
  s.Complete(0, Sampled(p));
  s.Remove(3);

  // A penalty on: no hit (the workers need every token for it).
  v1::RowSampling penalty;
  penalty.set_presence_penalty(0.5f);
  s.Add(4, Prompt(10), penalty);
  b = s.Schedule(0, step++, &p);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(p.new_seqs(0).num_cached_tokens(), 0);
  EXPECT_EQ(b->entries[0].tokens, 10);
  EXPECT_EQ(s.cached_prompt_tokens(4), 0);
  s.Complete(0, Sampled(p));
  s.Remove(4);

  // Clear (the group broke): the cache is gone with the workers' KV.
  EXPECT_GT(s.num_cached_blocks(), 0);
  s.Clear();
  EXPECT_EQ(s.num_cached_blocks(), 0);
  EXPECT_EQ(s.block_manager().num_free(), s.num_blocks());
  s.Add(5, Prompt(10), {});
  b = s.Schedule(0, step++, &p);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(p.new_seqs(0).num_cached_tokens(), 0);
}

// Blocks filled during decode are registered too: the next turn of a conversation (prompt, answer,
// new message) finds all of them but the partial last one.
TEST(SchedulerTest, PrefixCacheHitOnTheNextTurn) {
  Scheduler s(CachingOptions());
  uint64_t step = 0;
  s.Add(1, Prompt(5), {});
  RunToEnd(s, 1, 8, 7, &step);  // 5 + 8 tokens, 12 fed (the last sampled one never is): 3 blocks
  EXPECT_EQ(s.num_cached_blocks(), 3);
  std::vector<int32_t> next = Prompt(5);
  for (int i = 0; i < 8; ++i) next.push_back(7);
  next.push_back(900);
  next.push_back(901);
  s.Add(2, next, {});
  v1::StepPlan p;
  const MicroBatch* b = s.Schedule(0, step++, &p);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(p.new_seqs(0).num_cached_tokens(), 12);
  EXPECT_EQ(b->entries[0].tokens, 3);
  EXPECT_EQ(s.cached_prompt_tokens(2), 12);

  // With prefix caching off the same turns compute everything.
  SchedulerOptions off = CachingOptions();
  off.prefix_caching = false;
  Scheduler t(off);
  step = 0;
  t.Add(1, Prompt(5), {});
  RunToEnd(t, 1, 8, 7, &step);
  EXPECT_EQ(t.num_cached_blocks(), 0);
  t.Add(2, next, {});
  b = t.Schedule(0, step++, &p);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(p.new_seqs(0).num_cached_tokens(), 0);
  EXPECT_EQ(b->entries[0].tokens, 15);
  EXPECT_EQ(t.cached_prompt_tokens(2), 0);
  EXPECT_EQ(t.prefix_query_tokens(), 0);
}

// A preempted sequence's full blocks stay cached, and it finds them when it comes back; a removed
// one in a step in flight keeps its blocks until the step is back.
TEST(SchedulerTest, PreemptedAndRemovedSequencesLeaveTheirBlocksCached) {
  SchedulerOptions o = CachingOptions();
  o.limits.num_kv_blocks = 6;  // 24 tokens
  o.limits.max_tokens_per_step = 16;
  Scheduler s(o);
  v1::StepPlan p;
  uint64_t step = 0;
  s.Add(1, Prompt(9, 1), {});    // 3 blocks
  s.Add(2, Prompt(9, 100), {});  // 3 blocks
  // Both decode until seq 1 needs a fourth block with none free: seq 2, the newer, is preempted
  // with 11 tokens fed: its 2 full blocks stay cached, its third is free (and seq 1's at once).
  for (int i = 0; i < 10 && s.preemptions() == 0; ++i) {
    ASSERT_NE(s.Schedule(0, step++, &p), nullptr);
    s.Complete(0, Sampled(p));
  }
  ASSERT_EQ(s.preemptions(), 1);
  EXPECT_EQ(s.num_cached_blocks(), 2);
  EXPECT_EQ(s.block_manager().num_used(), 4);
  // Seq 2 would need 1 more block beside its 2 cached: none is free, so it waits (it never takes
  // the blocks it would share as new ones). When seq 1 ends it comes back and finds them.
  EXPECT_EQ(s.num_waiting(), 1);
  s.Remove(1);
  const MicroBatch* b = s.Schedule(0, step++, &p);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(p.new_seqs_size(), 1);
  EXPECT_EQ(p.new_seqs(0).seq_id(), 2u);
  EXPECT_EQ(p.new_seqs(0).num_cached_tokens(), 8);
  EXPECT_EQ(b->entries[0].tokens, 12 - 8) << "9 prompt and 3 generated tokens, 8 of them cached";
  // Removed while in flight: its blocks are held until the step is back, then full ones cached.
  s.Remove(2);
  EXPECT_GT(s.block_manager().num_used(), 0);
  s.Complete(0, Sampled(p));
  EXPECT_EQ(s.block_manager().num_used(), 0);
  EXPECT_EQ(s.num_free_blocks(), 6);
  EXPECT_GT(s.num_cached_blocks(), 0);
}

// ---- Sliding-window layers ---------------------------------------------------------------------

// Options for a model whose layers slide over `window` tokens: every layer (full_layers false, one
// pool of num_kv_blocks) or beside full-attention layers (a pool of `sliding_blocks` of their own).
SchedulerOptions SlidingOptions(int64_t window, bool full_layers, int64_t sliding_blocks = 0) {
  SchedulerOptions o = SmallOptions();  // blocks of 4 tokens, 8-token steps
  o.sliding_window = window;
  o.full_layers = full_layers;
  o.limits.num_sliding_kv_blocks = sliding_blocks;
  return o;
}

// Runs `id` alone for `n` generated tokens; after each step, the blocks each pool holds are at most
// what its window needs (all of the sequence in a full-attention pool), the workers accept the plan,
// and the sliding table (where there is one) is as long as the other. Returns the most blocks the
// sliding layers held between steps (once a step is built, its blocks before the next token's
// window are let go), and every block id their table named.
struct SlidingRun {
  int64_t most_held = 0;
  std::set<int32_t> ids;
  int64_t table_entries = 0;
};
SlidingRun RunSliding(Scheduler& s, uint64_t id, int n) {
  const SchedulerOptions& o = s.options();
  const BlockManager& full = s.block_manager();
  const BlockManager* sliding = s.sliding_block_manager();
  const BlockManager& slides = sliding != nullptr ? *sliding : full;
  Decoder worker(o.limits);
  SlidingRun run;
  v1::StepPlan p;
  uint64_t step = 0;
  while (s.generated(id) < n) {
    const MicroBatch* b = s.Schedule(0, step++, &p);
    EXPECT_NE(b, nullptr);
    if (b == nullptr) return run;
    worker.Apply(p);
    for (const v1::NewSeq& ns : p.new_seqs()) {
      EXPECT_EQ(ns.sliding_block_ids_size(), sliding != nullptr ? ns.block_ids_size() : 0);
      run.ids.insert(ns.sliding_block_ids().begin(), ns.sliding_block_ids().end());
      if (sliding == nullptr) run.ids.insert(ns.block_ids().begin(), ns.block_ids().end());
    }
    for (const v1::SeqBlocks& a : p.appended_blocks()) {
      EXPECT_EQ(a.sliding_block_ids_size(), sliding != nullptr ? a.block_ids_size() : 0);
      run.ids.insert(a.sliding_block_ids().begin(), a.sliding_block_ids().end());
      if (sliding == nullptr) run.ids.insert(a.block_ids().begin(), a.block_ids().end());
    }
    const int64_t fed = p.row_start_positions(0) + p.row_num_tokens(0);
    run.most_held = std::max(run.most_held, slides.num_used());
    EXPECT_LE(slides.num_used(), slides.WindowBlocks(o.sliding_window, o.limits.max_tokens_per_step, fed))
        << "step " << p.step_id();
    if (sliding != nullptr) {
      EXPECT_EQ(full.num_used(), full.BlocksFor(fed)) << "step " << p.step_id();
    }
    s.Complete(0, Sampled(p));
    run.table_entries = full.BlocksFor(fed);
  }
  s.Remove(id);
  EXPECT_EQ(full.num_used(), 0);
  EXPECT_EQ(slides.num_used(), 0);
  return run;
}

// A 30-token prompt and 40 generated tokens (70: 18 blocks of 4) over a 10-token window: between
// steps the sliding layers hold the 9 tokens before the next one's position (3 blocks), and never
// more than 6 distinct blocks are used, whether every layer slides (one pool) or full-attention
// layers keep all 18 (two pools).
TEST(SchedulerTest, SlidingLayersHoldOnlyTheirWindow) {
  for (const bool full_layers : {false, true}) {
    SCOPED_TRACE(full_layers ? "full and sliding layers" : "every layer slides");
    Scheduler s(SlidingOptions(10, full_layers, full_layers ? 6 : 0));
    s.Add(1, Prompt(30), {});
    const SlidingRun run = RunSliding(s, 1, 40);
    EXPECT_EQ(run.table_entries, 18);
    EXPECT_EQ(run.most_held, 3);
    EXPECT_LE(static_cast<int64_t>(run.ids.size()), 6) << "released blocks are used again";
  }
  // Without a window, the same sequence holds all 18, and plans carry no sliding table.
  Scheduler s(SmallOptions());
  s.Add(1, Prompt(30), {});
  const SlidingRun run = RunSliding(s, 1, 40);
  EXPECT_EQ(s.sliding_block_manager(), nullptr);
  EXPECT_EQ(run.ids.size(), 18u);
}

// A model with no sliding layers: its plans are those of a scheduler that knows nothing of windows
// (the same bytes), and its limits encode as before (no num_sliding_kv_blocks on the wire).
TEST(SchedulerTest, NoSlidingLayersLeaveThePlansAsTheyWere) {
  SchedulerOptions with = SmallOptions();
  with.full_layers = false;  // no window: nothing slides whatever this says
  Scheduler a(SmallOptions()), b(with);
  for (Scheduler* s : {&a, &b}) {
    s->Add(1, Prompt(30), {});
    s->Add(2, Prompt(13, 50), {});
  }
  v1::StepPlan pa, pb;
  for (uint64_t step = 0; step < 12; ++step) {
    ASSERT_NE(a.Schedule(0, step, &pa), nullptr);
    ASSERT_NE(b.Schedule(0, step, &pb), nullptr);
    EXPECT_EQ(pa.SerializeAsString(), pb.SerializeAsString()) << "step " << step;
    for (const v1::NewSeq& ns : pa.new_seqs()) EXPECT_EQ(ns.sliding_block_ids_size(), 0);
    for (const v1::SeqBlocks& sb : pa.appended_blocks()) EXPECT_EQ(sb.sliding_block_ids_size(), 0);
    a.Complete(0, Sampled(pa));
    b.Complete(0, Sampled(pb));
  }
  EXPECT_EQ(a.block_manager().num_used(), b.block_manager().num_used());
  v1::StepLimits l;
  ToProto(SmallOptions().limits, &l);
  v1::StepLimits old = l;
  old.clear_num_sliding_kv_blocks();
  EXPECT_EQ(l.SerializeAsString(), old.SerializeAsString());
  EXPECT_EQ(l.ByteSizeLong(), old.ByteSizeLong());
}

// A prefix hit is taken only as far as the sliding layers' pool still holds every block of it: with
// their blocks cached it is the whole prompt, as the full-attention pool has it; once other
// sequences took (evicted) the sliding blocks a finished sequence let go, the hit ends before the
// first one gone and the sequence computes the rest again, never reading KV that was freed.
TEST(SchedulerTest, PrefixHitEndsWhereSlidingBlocksWereEvicted) {
  for (const bool evict : {false, true}) {
    SCOPED_TRACE(evict ? "sliding blocks evicted" : "sliding blocks cached");
    SchedulerOptions o = SlidingOptions(8, /*full_layers=*/true, /*sliding_blocks=*/12);
    o.prefix_caching = true;
    o.limits.max_tokens_per_step = 64;
    Scheduler s(o);
    Decoder worker(o.limits);
    uint64_t step = 0;
    s.Add(1, Prompt(40), {});
    RunToEnd(s, 1, 1, 7, &step, &worker);  // 10 full blocks registered in both pools
    const BlockManager& sliding = *s.sliding_block_manager();
    EXPECT_EQ(s.block_manager().num_cached(), 10);
    EXPECT_EQ(sliding.num_cached(), 10) << "released or let go at the end, registered: cached";
    if (evict) {
      s.Add(2, Prompt(40, 500), {});  // other tokens: takes 10 sliding blocks, 8 of them evicted
      RunToEnd(s, 2, 1, 7, &step, &worker);
    }
    std::vector<int32_t> prompt = Prompt(40);
    prompt.push_back(900);
    BlockManager::Chain c;
    EXPECT_EQ(s.block_manager().FindCached(prompt, 100, &c).size(), 10u) << "the full-attention layers' pool has it all";
    const int64_t sliding_hit = static_cast<int64_t>(sliding.FindCached(prompt, 100, &c).size());
    EXPECT_EQ(sliding_hit, evict ? 0 : 10);
    s.Add(3, prompt, {});
    v1::StepPlan p;
    ASSERT_NE(s.Schedule(0, step++, &p), nullptr);
    worker.Apply(p);
    ASSERT_EQ(p.new_seqs_size(), 1);
    EXPECT_EQ(p.new_seqs(0).num_cached_tokens(), 4 * sliding_hit);
    EXPECT_EQ(p.row_start_positions(0), 4 * sliding_hit);
    EXPECT_EQ(p.new_seqs(0).sliding_block_ids_size(), p.new_seqs(0).block_ids_size());
    s.Complete(0, Sampled(p));
  }
}

// Preempted for blocks of the sliding layers' pool (the full-attention one has room): the newest
// sequence gives way, lets go of both tables, and is computed again from token 0 once there is
// room; every sequence gets its tokens.
TEST(SchedulerTest, SlidingPoolPreemptsAndRecomputes) {
  SchedulerOptions o = SlidingOptions(8, /*full_layers=*/true, /*sliding_blocks=*/5);
  ASSERT_EQ(BlockManager(5, 4).WindowBlocks(8, 8, 32), 5) << "one sequence alone always fits";
  Scheduler s(o);
  Decoder worker(o.limits);
  s.Add(1, Prompt(20), {});
  s.Add(2, Prompt(20, 100), {});
  v1::StepPlan p;
  uint64_t step = 0;
  std::map<uint64_t, int> done;
  while ((s.num_running() > 0 || s.num_waiting() > 0) && step < 200) {
    ASSERT_NE(s.Schedule(0, step++, &p), nullptr);
    worker.Apply(p);
    for (const SampledToken& t : s.Complete(0, Sampled(p))) {
      if (s.generated(t.seq) == 12) {
        s.Remove(t.seq);
        ++done[t.seq];
      }
    }
    EXPECT_LE(s.sliding_block_manager()->num_used(), 5);
  }
  EXPECT_EQ(done, (std::map<uint64_t, int>{{1, 1}, {2, 1}}));
  EXPECT_GT(s.preemptions(), 0) << "two sequences' windows (up to 4 blocks each while decoding) exceed 5 blocks";
  EXPECT_EQ(s.block_manager().num_used(), 0);
  EXPECT_EQ(s.sliding_block_manager()->num_used(), 0);
}

// The point of it: with the KV memory of a Gemma-3-shaped model (5 sliding layers over 32 tokens to
// 1 full one) fixed, more sequences of 128 tokens run at once when the sliding layers keep only
// their window. The pools are sized from the same memory as the planner counts it: a sequence needs
// 32 blocks in the full layer and KvBlocksHeld (13 for 16-token steps) in each sliding layer. The
// figure: sequences decoding past 96 tokens in one step (each then holds at least 24 full-layer
// blocks), at most; and the preemptions and steps for 12 sequences.
TEST(SchedulerTest, WindowsFitMoreLongSequencesInTheSameMemory) {
  constexpr int64_t kFullLayers = 1, kSlidingLayers = 5, kWindow = 32, kLen = 128, kPrompt = 32, kLong = 96;
  constexpr int64_t kLayerBlocks = 6 * 128;  // the memory: 128 blocks of every layer
  struct Figures {
    int64_t long_at_once = 0, preemptions = 0, steps = 0;
  };
  auto run = [&](bool windows, Figures* f) {
    SchedulerOptions o = SmallOptions();
    o.limits.max_tokens_per_step = 16;
    o.limits.max_seqs_per_step = 16;
    o.limits.max_model_len = kLen;
    if (windows) {
      BlockManager sizing(1, o.limits.block_size);
      const int64_t full = sizing.BlocksFor(kLen);
      const int64_t slide = sizing.WindowBlocks(kWindow, o.limits.max_tokens_per_step, kLen);
      EXPECT_EQ(full, 32);
      EXPECT_EQ(slide, 13) << "a 16-token chunk and the window before it";
      const int64_t seqs = kLayerBlocks / (kFullLayers * full + kSlidingLayers * slide);
      o.limits.num_kv_blocks = seqs * full;
      o.limits.num_sliding_kv_blocks = seqs * slide;
      EXPECT_LE(kFullLayers * o.limits.num_kv_blocks + kSlidingLayers * o.limits.num_sliding_kv_blocks, kLayerBlocks);
      o.sliding_window = kWindow;
    } else {
      o.limits.num_kv_blocks = kLayerBlocks / (kFullLayers + kSlidingLayers);
    }
    Scheduler s(o);
    Decoder worker(o.limits);
    for (uint64_t id = 1; id <= 12; ++id) s.Add(id, Prompt(kPrompt, static_cast<int32_t>(id * 50)), {});
    v1::StepPlan p;
    for (f->steps = 0; (s.num_running() > 0 || s.num_waiting() > 0) && f->steps < 2000; ++f->steps) {
      ASSERT_NE(s.Schedule(0, static_cast<uint64_t>(f->steps), &p), nullptr);
      worker.Apply(p);
      const int64_t long_rows = std::count_if(p.row_start_positions().begin(), p.row_start_positions().end(),
                                              [&](int32_t pos) { return pos >= kLong; });
      f->long_at_once = std::max(f->long_at_once, long_rows);
      for (const SampledToken& t : s.Complete(0, Sampled(p))) {
        if (s.generated(t.seq) == kLen - kPrompt) s.Remove(t.seq);
      }
    }
    EXPECT_EQ(s.num_running() + s.num_waiting(), 0);
    f->preemptions = s.preemptions();
  };
  Figures without, with;
  run(false, &without);
  run(true, &with);
  EXPECT_LE(without.long_at_once, 128 / 24);
  EXPECT_GT(with.long_at_once, without.long_at_once);
  EXPECT_LT(with.preemptions, without.preemptions);
  EXPECT_LT(with.steps, without.steps);
  RecordProperty("long_at_once_without_windows", static_cast<int>(without.long_at_once));
  RecordProperty("long_at_once_with_windows", static_cast<int>(with.long_at_once));
  std::printf(
      "12 sequences of %lld tokens: at most %lld past %lld tokens at once, %lld preemptions, %lld steps without "
      "windows; %lld, %lld, %lld with\n",
      static_cast<long long>(kLen), static_cast<long long>(without.long_at_once), static_cast<long long>(kLong),
      static_cast<long long>(without.preemptions), static_cast<long long>(without.steps),
      static_cast<long long>(with.long_at_once), static_cast<long long>(with.preemptions),
      static_cast<long long>(with.steps));
}

}  // namespace
}  // namespace shardserve
