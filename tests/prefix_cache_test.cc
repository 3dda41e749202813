// Automatic prefix caching (coordinator/scheduler/block_manager.h, scheduler.h) on real
// shardserve-coordinator and shardserve-worker processes on 127.0.0.1, with the demo model, in
// every layout TP1, TP2, PP2 and TP2xPP2: the same requests with caching on (the default) and
// with --no-prefix-caching give the same greedy token ids, exactly. No tolerance: a row's
// arithmetic does not depend on what else is in its step (batching_test.cc says why), and a row
// that reads cached KV reads the bits an earlier step wrote for the same tokens at the same
// positions.
//
// The requests, one after another (so that each finds the blocks of those before it), then some
// at once:
// - requests that share a long system prompt (five blocks and a bit) and end in their own question;
// - a conversation of three turns: each prompt is the previous prompt, its answer and a new
//   message, so it finds blocks filled while the answer was generated (decode);
// - a prompt sent twice: the second finds all of it but its last block;
// - a request with a repetition penalty: it takes no cached blocks (0 cached tokens).
// With caching on, Usage.cached_prompt_tokens is > 0 where a prefix was cached (a multiple of the
// block size, below the prompt length), and the coordinator's status counts the hits; with it off,
// every request reports 0.
//
// Every wait is bounded; tests/cluster_harness.h kills and reaps every process.
#include <cstdio>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tests/cluster_harness.h"

namespace shardserve {
namespace {

const std::string kDemo = (fs::path(SHARDSERVE_SOURCE_DIR) / "models/demo").string();
constexpr int32_t kBos = 0;         // models/demo/config.json
constexpr int kBlockSize = 16;      // the coordinator's default --block-size
constexpr int kVocabStart = 3;      // token ids from here on are ordinary (demo vocabulary)

// Deterministic token ids in the demo vocabulary.
std::vector<int32_t> Tokens(int n, int seed) {
  std::vector<int32_t> out;
  uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(seed + 1);
  for (int i = 0; i < n; ++i) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    out.push_back(kVocabStart + static_cast<int32_t>((x * 0x2545F4914F6CDD1Dull) % 200));
  }
  return out;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Outcome {
  std::vector<int32_t> tokens;
  int32_t prompt_tokens = 0;
  int32_t cached_prompt_tokens = -1;  // -1: no usage came
};

Outcome Run(Cluster* cluster, const std::vector<int32_t>& prompt, int max_tokens, float repetition_penalty = 0) {
  v1::GenerateRequest r = TokenRequest(prompt, max_tokens);
  if (repetition_penalty != 0) r.mutable_sampling()->set_repetition_penalty(repetition_penalty);
  const Streamed s = Generate(cluster->client(), r, std::chrono::seconds(120));
  EXPECT_TRUE(s.status.ok()) << s.status.error_message();
  Outcome o;
  o.tokens = s.tokens;
  for (const v1::GenerateResponse& m : s.messages) {
    if (m.has_usage()) {
      o.prompt_tokens = m.usage().prompt_tokens();
      o.cached_prompt_tokens = m.usage().cached_prompt_tokens();
    }
  }
  EXPECT_EQ(static_cast<int>(o.tokens.size()), max_tokens);
  EXPECT_EQ(o.prompt_tokens, static_cast<int32_t>(prompt.size()));
  return o;
}

// What one cluster gives for the whole workload, in order.
struct Results {
  std::vector<std::string> names;
  std::vector<Outcome> outcomes;
  std::vector<bool> may_hit;  // a prefix of this prompt ran before (caching on: cached > 0)
};

Results RunWorkload(Cluster* cluster) {
  Results res;
  auto add = [&](const std::string& name, const Outcome& o, bool may_hit) {
    res.names.push_back(name);
    res.outcomes.push_back(o);
    res.may_hit.push_back(may_hit);
  };
  const std::vector<int32_t> system = Concat({kBos}, Tokens(5 * kBlockSize + 7, 1));  // 88 tokens

  // Shared system prompt, one request after another.
  for (int q = 0; q < 3; ++q) {
    add("system+question" + std::to_string(q), Run(cluster, Concat(system, Tokens(5 + 7 * q, 10 + q)), 12), q > 0);
  }
  // A conversation: each turn's prompt continues the last one with its answer.
  std::vector<int32_t> chat = Concat(system, Tokens(9, 20));
  for (int turn = 0; turn < 3; ++turn) {
    const Outcome o = Run(cluster, chat, 24);
    add("chat turn " + std::to_string(turn), o, true);
    chat = Concat(Concat(chat, o.tokens), Tokens(6 + turn, 30 + turn));
  }
  // The same prompt twice, a whole number of blocks: the second computes its last block again.
  const std::vector<int32_t> twice = Concat({kBos}, Tokens(4 * kBlockSize - 1, 40));
  add("first of two", Run(cluster, twice, 8), false);
  add("second of two", Run(cluster, twice, 8), true);
  // A penalty: no cached blocks.
  add("repetition penalty", Run(cluster, Concat(system, Tokens(4, 50)), 8, 1.3f), false);

  // Four at once, sharing the system prompt (cached by now) and each other's.
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(Concat(system, Tokens(3 + 11 * i, 60 + i)));
  std::vector<Outcome> together(prompts.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i) {
    threads.emplace_back([&, i] { together[i] = Run(cluster, prompts[i], 16); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) add("concurrent " + std::to_string(i), together[i], true);
  return res;
}

struct Layout {
  int tp;
  int pp;
};

void PrintTo(const Layout& l, std::ostream* os) { *os << "TP" << l.tp << "_PP" << l.pp; }

class PrefixCacheTest : public ::testing::TestWithParam<Layout> {};

TEST_P(PrefixCacheTest, SameTokensWithCachingOnAndOff) {
  const Layout& l = GetParam();
  Results on, off;
  v1::SchedulerStatus status_on;
  for (const bool caching : {true, false}) {
    ClusterSpecForTest spec;
    spec.fixture = kDemo;
    spec.nodes = l.pp;
    spec.gpus_per_node = l.tp;
    std::vector<std::string> flags = {"--max-num-seqs", "8", "--max-tokens-per-step", "64"};
    if (!caching) flags.push_back("--no-prefix-caching");
    Cluster cluster(spec, flags);
    ASSERT_TRUE(cluster.Start());
    (caching ? on : off) = RunWorkload(&cluster);
    ASSERT_FALSE(HasFatalFailure());
    const v1::SchedulerStatus status = cluster.Status().scheduler();
    EXPECT_EQ(status.running(), 0);
    EXPECT_EQ(status.kv_blocks_free(), status.kv_blocks_total()) << "cached blocks count as free";
    EXPECT_EQ(status.prefix_caching(), caching);
    if (caching) {
      status_on = status;
    } else {
      EXPECT_EQ(status.kv_blocks_cached(), 0);
      EXPECT_EQ(status.prefix_cache_query_tokens(), 0);
      EXPECT_EQ(status.prefix_cache_hit_tokens(), 0);
    }
  }
  ASSERT_EQ(on.outcomes.size(), off.outcomes.size());
  int hits = 0;
  for (size_t i = 0; i < on.outcomes.size(); ++i) {
    const Outcome &a = on.outcomes[i], &b = off.outcomes[i];
    EXPECT_EQ(a.tokens, b.tokens) << on.names[i] << ": caching on and off give different tokens";
    EXPECT_EQ(b.cached_prompt_tokens, 0) << on.names[i] << " with --no-prefix-caching";
    EXPECT_GE(a.cached_prompt_tokens, 0) << on.names[i];
    EXPECT_EQ(a.cached_prompt_tokens % kBlockSize, 0) << on.names[i];
    EXPECT_LT(a.cached_prompt_tokens, a.prompt_tokens) << on.names[i] << ": the last prompt token is always computed";
    if (on.may_hit[i]) {
      EXPECT_GT(a.cached_prompt_tokens, 0) << on.names[i] << ": its prefix ran before";
    } else {
      EXPECT_EQ(a.cached_prompt_tokens, 0) << on.names[i];
    }
    hits += a.cached_prompt_tokens;
  }
  // The conversation's third turn finds the second turn's answer (filled during decode): more than
  // the system prompt's blocks.
  for (size_t i = 0; i < on.names.size(); ++i) {
    if (on.names[i] == "chat turn 2") {
      EXPECT_GT(on.outcomes[i].cached_prompt_tokens, on.outcomes[i - 1].prompt_tokens)
          << "turn 2 did not find the blocks of turn 1's answer";
    }
    if (on.names[i] == "second of two") {
      EXPECT_EQ(on.outcomes[i].cached_prompt_tokens, 3 * kBlockSize) << "all but the last block of the same prompt";
    }
  }
  // The coordinator's counters (also its metrics shardserve_prefix_cache_*; metrics_test checks
  // that they are exposed).
  EXPECT_EQ(status_on.prefix_cache_hit_tokens(), hits);
  EXPECT_GT(status_on.prefix_cache_query_tokens(), hits);
  EXPECT_GT(status_on.kv_blocks_cached(), 0);
}

INSTANTIATE_TEST_SUITE_P(Layouts, PrefixCacheTest,
                         ::testing::Values(Layout{1, 1}, Layout{2, 1}, Layout{1, 2}, Layout{2, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp);
                         });

// Gemma 3 (gemma3_tf5: five layers sliding over 32 tokens to one full-attention layer), whose
// sliding layers keep their KV in a pool of their own (blocks of 4, 74 of them beside 120 for the
// full layer; cluster_test.cc ClusterSlidingPoolTest). A prompt of 48 tokens runs, then the same
// 40-token prefix with another end: it finds the prefix in both pools. Four requests of other
// tokens then cycle through the sliding pool (80 blocks taken, each let go behind its window), so
// the first prompt's sliding blocks are evicted while the full layer's are still cached, and the
// second prompt sent again finds less, or nothing: a hit ends where the sliding pool lost a block,
// and the rest is computed again. Every request gets the same tokens with caching on and off.
TEST(PrefixCacheSlidingPoolTest, SameTokensWhenSlidingBlocksWereEvicted) {
  const Golden golden = LoadGolden("gemma3_tf5");
  ASSERT_EQ(golden.prompt.size(), 48u);
  const int vocab = 480;  // gemma3_tf5/config.json
  std::vector<int32_t> shared(golden.prompt.begin(), golden.prompt.begin() + 40);
  std::vector<int32_t> second = shared;
  for (int i = 0; i < 8; ++i) second.push_back((golden.prompt[40 + i] + 11) % vocab);
  std::map<bool, std::vector<Outcome>> runs;
  for (const bool caching : {true, false}) {
    ClusterSpecForTest spec;
    spec.fixture = "gemma3_tf5";
    spec.worker_flags = {"--matmul-dtype", "f32"};
    std::vector<std::string> flags = {"--num-kv-blocks", "120",   "--block-size",    "4", "--max-model-len", "80",
                                      "--max-tokens-per-step", "8", "--max-num-seqs", "8"};
    if (!caching) flags.push_back("--no-prefix-caching");
    Cluster cluster(spec, flags);
    ASSERT_TRUE(cluster.Start());
    std::vector<Outcome>& out = runs[caching];
    out.push_back(shardserve::Run(&cluster, golden.prompt, 32));
    out.push_back(shardserve::Run(&cluster, second, 16));
    for (int i = 0; i < 4; ++i) {
      std::vector<int32_t> other = golden.prompt;
      for (int32_t& t : other) t = (t + 97 * (i + 1)) % vocab;
      shardserve::Run(&cluster, other, 32);
    }
    out.push_back(shardserve::Run(&cluster, second, 16));
    ASSERT_FALSE(HasFatalFailure()) << cluster.Logs();
  }
  const std::vector<Outcome>& on = runs[true];
  const std::vector<Outcome>& off = runs[false];
  EXPECT_EQ(on[0].tokens, golden.greedy);
  for (size_t i = 0; i < on.size(); ++i) {
    EXPECT_EQ(on[i].tokens, off[i].tokens) << "request " << i << ": caching on and off give different tokens";
    EXPECT_EQ(off[i].cached_prompt_tokens, 0) << "request " << i;
  }
  EXPECT_EQ(on[1].cached_prompt_tokens, 40) << "the shared prefix, in both pools";
  EXPECT_LT(on[2].cached_prompt_tokens, on[1].cached_prompt_tokens) << "the sliding blocks were not evicted";
  EXPECT_EQ(on[2].tokens, on[1].tokens);
  std::printf("[ prefix   ] gemma3_tf5, sliding layers' own pool: the same 48-token prompt found %d cached tokens, "
              "then %d once its sliding blocks were evicted\n",
              on[1].cached_prompt_tokens, on[2].cached_prompt_tokens);
}

}  // namespace
}  // namespace shardserve
