// Continuous batching (coordinator/engine/engine.h, coordinator/scheduler/scheduler.h) on real
// shardserve-coordinator and shardserve-worker processes on 127.0.0.1, with the demo model
// (models/demo: it has a tokenizer, so every stream's text is checked too).
//
// - Concurrent greedy streams equal lone runs: 64 (TP=2 x PP=2: 32) concurrent requests of
//   varied lengths, some longer than a step's token budget (chunked prefill), on TP1_PP1
//   (asynchronous scheduling: two steps in flight, the second fed the first's samples by the
//   worker), TP1_PP1_Sync (--no-async-scheduling), TP2_PP1 (asynchronous, TP rank 0 sharing its
//   samples with rank 1), TP1_PP2 (micro-batches in flight) and TP2_PP2.
//   Exact equality, no tolerance: a sequence's row goes through the same per-row arithmetic whatever else is in the batch (the CPU backend's GEMM
//   blocks the reduction dimension the same way for any number of rows: kernels_cpu_test's
//   PackedMatMulRowsDoNotDependOnTheBatch), so its logits are bitwise those of a lone run.
// - Seeded sampling reproduces: the draws depend on (seed, draw index) only, so a seeded request
//   gives the same tokens alone and in batches of different mixes and orders; other seeds differ.
// - Preemption: a KV cache just above one longest request; every request still gives its lone
//   tokens (recompute loses nothing), preemptions are counted, and every block comes back.
// - Cancellation: a cancelled stream and one past its deadline leave the running batch and free
//   their blocks.
// - Limits: --max-num-seqs and --max-waiting-requests; past them RESOURCE_EXHAUSTED.
// - The new sampling fields' bounds are INVALID_ARGUMENT naming the field.
//
// Every wait is bounded; tests/cluster_harness.h kills and reaps every process.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <latch>
#include <map>
#include <tuple>
#include <regex>
#include <memory>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/client_context.h>

#include "coordinator/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tests/cluster_harness.h"

namespace shardserve {
namespace {

const std::string kDemo = (fs::path(SHARDSERVE_SOURCE_DIR) / "models/demo").string();
constexpr int32_t kBos = 0;  // models/demo/config.json

// Genesis 1:1-19 (King James Version): the prompts are windows of it, so that the model sees the
// kind of text it was trained on.
constexpr char kCorpus[] =
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the "
    "waters. And God said, Let there be light: and there was light. And God saw the light, that it "
    "was good: and God divided the light from the darkness. And God called the light Day, and the "
    "darkness he called Night. And the evening and the morning were the first day. And God said, Let "
    "there be a firmament in the midst of the waters, and let it divide the waters from the waters. "
    "And God made the firmament, and divided the waters which were under the firmament from the "
    "waters which were above the firmament: and it was so. And God called the firmament Heaven. And "
    "the evening and the morning were the second day. And God said, Let the waters under the heaven "
    "be gathered together unto one place, and let the dry land appear: and it was so. And God called "
    "the dry land Earth; and the gathering together of the waters called he Seas: and God saw that it "
    "was good. And God said, Let the earth bring forth grass, the herb yielding seed, and the fruit "
    "tree yielding fruit after his kind, whose seed is in itself, upon the earth: and it was so. And "
    "the earth brought forth grass, and herb yielding seed after his kind, and the tree yielding "
    "fruit, whose seed was in itself, after his kind: and God saw that it was good. And the evening "
    "and the morning were the third day. And God said, Let there be lights in the firmament of the "
    "heaven to divide the day from the night; and let them be for signs, and for seasons, and for "
    "days, and years: And let them be for lights in the firmament of the heaven to give light upon "
    "the earth: and it was so. And God made two great lights; the greater light to rule the day, and "
    "the lesser light to rule the night: he made the stars also. And God set them in the firmament "
    "of the heaven to give light upon the earth, And to rule over the day and over the night, and to "
    "divide the light from the darkness: and God saw that it was good. And the evening and the "
    "morning were the fourth day.";

const Tokenizer& DemoTokenizer() {
  static const Tokenizer* tokenizer = [] {
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromDirectory(kDemo);
    if (!t.ok()) {
      ADD_FAILURE() << t.status();
      std::abort();
    }
    return t->release();
  }();
  return *tokenizer;
}

const std::vector<int32_t>& CorpusIds() {
  static const std::vector<int32_t> ids = [] {
    absl::StatusOr<std::vector<int32_t>> e = DemoTokenizer().Encode(kCorpus, /*add_special_tokens=*/false);
    if (!e.ok()) {
      ADD_FAILURE() << e.status();
      std::abort();
    }
    return *e;
  }();
  return ids;
}

// A prompt of `length` tokens: a window of the corpus starting at `offset` (wrapped), after BOS
// when `bos`.
std::vector<int32_t> Prompt(int length, int offset, bool bos) {
  const std::vector<int32_t>& corpus = CorpusIds();
  std::vector<int32_t> out;
  if (bos) out.push_back(kBos);
  for (int i = 0; static_cast<int>(out.size()) < length; ++i) out.push_back(corpus[(offset + i) % corpus.size()]);
  return out;
}

v1::GenerateRequest Request(std::vector<int32_t> prompt, int max_tokens, bool ignore_eos, const std::string& id) {
  v1::GenerateRequest r = TokenRequest(prompt, max_tokens);
  r.mutable_sampling()->set_ignore_eos(ignore_eos);
  r.set_request_id(id);
  return r;
}

std::string Ids(const std::vector<int32_t>& ids) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < ids.size(); ++i) s << (i ? " " : "") << ids[i];
  s << "]";
  return s.str();
}

// Empty when `got` equals `want`; else where they part and both sequences.
std::string Diff(const std::vector<int32_t>& want, const std::vector<int32_t>& got) {
  if (want == got) return "";
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  std::ostringstream s;
  s << "first difference at token " << i << " (of " << want.size() << " expected, " << got.size()
    << " got)\n      expected " << Ids(want) << "\n      got      " << Ids(got);
  return s.str();
}

// Checks one finished stream of `request` as the API promises it; empty when it is whole, else
// what is wrong. No token lost or duplicated: the messages' ids add up to usage.completion_tokens,
// their text deltas concatenate to the decoded ids, one final message (the last) carries the
// finish reason and the usage.
std::string CheckStream(const v1::GenerateRequest& request, const Streamed& r) {
  std::ostringstream e;
  if (!r.status.ok()) {
    e << "status " << r.status.error_code() << ": " << r.status.error_message();
    return e.str();
  }
  if (r.messages.empty()) return "no messages";
  int finals = 0;
  std::string text;
  for (size_t i = 0; i < r.messages.size(); ++i) {
    const v1::GenerateResponse& m = r.messages[i];
    const bool last = i + 1 == r.messages.size();
    if (m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) ++finals;
    if (m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED && !last) e << "message " << i << " has a finish reason; ";
    if (m.has_usage() != last) e << "message " << i << (last ? " lacks" : " has") << " usage; ";
    if (m.request_id() != request.request_id()) e << "message " << i << " has request id " << m.request_id() << "; ";
    text += m.text();
  }
  if (finals != 1) e << finals << " messages with a finish reason; ";
  const v1::GenerateResponse& last = r.messages.back();
  const int prompt_len = request.token_ids().ids_size();
  if (last.usage().prompt_tokens() != prompt_len) {
    e << "usage.prompt_tokens " << last.usage().prompt_tokens() << " != " << prompt_len << "; ";
  }
  if (last.usage().completion_tokens() != static_cast<int>(r.tokens.size())) {
    e << "usage.completion_tokens " << last.usage().completion_tokens() << " but " << r.tokens.size()
      << " ids streamed; ";
  }
  const int max_tokens = request.sampling().max_tokens();
  if (last.finish_reason() == v1::FINISH_REASON_LENGTH && static_cast<int>(r.tokens.size()) != max_tokens) {
    e << "finish reason length after " << r.tokens.size() << " of " << max_tokens << " tokens; ";
  }
  if (last.finish_reason() == v1::FINISH_REASON_STOP_TOKEN && request.sampling().ignore_eos()) {
    e << "stopped on a token with ignore_eos and no stop ids; ";
  }
  const std::string decoded = DemoTokenizer().Decode(r.tokens, /*skip_special_tokens=*/true);
  if (text != decoded) e << "text deltas '" << text << "' != decoded ids '" << decoded << "'; ";
  return e.str();
}

// Runs every request on its own thread, all released at once (with `stagger` between starts in
// index order, when nonzero).
std::vector<Streamed> RunConcurrently(Cluster& cluster, const std::vector<v1::GenerateRequest>& requests,
                                      std::chrono::milliseconds stagger = std::chrono::milliseconds(0)) {
  std::vector<Streamed> out(requests.size());
  std::latch go(static_cast<std::ptrdiff_t>(requests.size()));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] {
      go.arrive_and_wait();
      if (stagger.count() > 0) std::this_thread::sleep_for(stagger * i);
      out[i] = Generate(cluster.client(), requests[i], std::chrono::seconds(120));
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

std::vector<Streamed> RunOneByOne(Cluster& cluster, const std::vector<v1::GenerateRequest>& requests) {
  std::vector<Streamed> out;
  for (const v1::GenerateRequest& r : requests) out.push_back(Generate(cluster.client(), r, std::chrono::seconds(60)));
  return out;
}

std::string Describe(const v1::SchedulerStatus& s) {
  std::ostringstream o;
  o << "running " << s.running() << ", waiting " << s.waiting() << ", KV blocks free " << s.kv_blocks_free() << " of "
    << s.kv_blocks_total() << ", preemptions " << s.preemptions();
  return o.str();
}

// The bound on a wait for something that must happen: generous, because CI machines are small and
// shared. Every such wait returns as soon as it holds, so only a hang takes this long, and what a
// test checks about order comes from the events themselves (stream statuses, scheduler counts,
// steps that take at least --debug-step-delay-ms each), never from how fast they came.
constexpr std::chrono::seconds kNotHung(60);
// The deadline of a stream that a test ends itself (a cancel) or that must finish: never reached.
constexpr std::chrono::seconds kNoDeadline(300);

// Polls the scheduler's status every 20 ms until `done` holds, for at most `timeout` (scaled).
// Returns whether it held; *last is the last status seen.
bool WaitForScheduler(Cluster& cluster, const std::function<bool(const v1::SchedulerStatus&)>& done,
                      std::chrono::milliseconds timeout, v1::SchedulerStatus* last) {
  const auto deadline = Clock::now() + Scaled(timeout);
  for (;;) {
    *last = cluster.Status().scheduler();
    if (done(*last)) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Every sequence gone and every block back (bounded: the engine publishes its status after the
// step that ended the last stream).
void ExpectIdle(Cluster& cluster, const std::string& when) {
  v1::SchedulerStatus s;
  const bool idle = WaitForScheduler(
      cluster,
      [](const v1::SchedulerStatus& x) {
        return x.running() == 0 && x.waiting() == 0 && x.kv_blocks_free() == x.kv_blocks_total();
      },
      kNotHung, &s);
  EXPECT_TRUE(idle) << when << ": not idle after " << kNotHung.count() << " s: " << Describe(s);
  EXPECT_GT(s.kv_blocks_total(), 0) << when;
}

std::unique_ptr<Cluster> StartDemo(int tp, int pp, std::vector<std::string> coordinator_flags,
                                   std::vector<std::string> worker_flags = {}) {
  ClusterSpecForTest spec;
  spec.fixture = kDemo;  // an absolute path replaces the fixtures folder
  spec.nodes = pp;
  spec.gpus_per_node = tp;
  spec.worker_flags = std::move(worker_flags);
  auto cluster = std::make_unique<Cluster>(std::move(spec), std::move(coordinator_flags));
  if (!cluster->Start()) return nullptr;
  return cluster;
}

// ---- Greedy and seeded streams in batches, per layout -----------------------------------------------

struct Layout {
  int tp;
  int pp;
  int streams;        // concurrent greedy requests
  bool sync = false;  // the coordinator's --no-async-scheduling
};

void PrintTo(const Layout& l, std::ostream* os) { *os << "TP" << l.tp << "_PP" << l.pp << (l.sync ? "_Sync" : ""); }

std::string LayoutName(const ::testing::TestParamInfo<Layout>& info) {
  return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp) + (info.param.sync ? "_Sync" : "");
}

// One cluster per layout, shared by the suite's tests and stopped with the suite: 64 sequences
// and 64 tokens per step, so that a batch of 64 decodes fills a step and every prompt beside them
// is prefilled in chunks.
class BatchingTest : public ::testing::TestWithParam<Layout> {
 protected:
  static void TearDownTestSuite() { clusters_.clear(); }

  Cluster* GetCluster() {
    const Layout& l = GetParam();
    std::unique_ptr<Cluster>& c = clusters_[{l.tp, l.pp, l.sync}];
    if (c == nullptr) {
      std::vector<std::string> flags = {"--max-num-seqs", "64", "--max-tokens-per-step", "64"};
      if (l.sync) flags.push_back("--no-async-scheduling");
      c = StartDemo(l.tp, l.pp, flags);
      if (c != nullptr) std::printf("[ cluster  ] TP%d_PP%d up in %.2f s\n", l.tp, l.pp, c->start_seconds());
    }
    return c.get();
  }

  static std::map<std::tuple<int, int, bool>, std::unique_ptr<Cluster>> clusters_;
};
std::map<std::tuple<int, int, bool>, std::unique_ptr<Cluster>> BatchingTest::clusters_;

TEST_P(BatchingTest, ConcurrentGreedyStreamsEqualLoneRuns) {
  const Layout& l = GetParam();
  Cluster* cluster = GetCluster();
  ASSERT_NE(cluster, nullptr);

  // Prompts of 1 to 60 tokens, every 8th of 70 to 105 (longer than a step: chunked even alone);
  // 16 to 32 new tokens; every third request may stop at EOS.
  std::vector<v1::GenerateRequest> requests;
  std::set<std::vector<int32_t>> distinct;
  int longer_than_a_step = 0;
  for (int i = 0; i < l.streams; ++i) {
    const int length = i % 8 == 7 ? 70 + 5 * (i / 8) : 1 + (i * 23) % 60;
    longer_than_a_step += length > 64;
    // Even requests start with BOS (one of length 1 is BOS alone), odd ones in mid-text.
    std::vector<int32_t> prompt = Prompt(length, 11 * i, /*bos=*/i % 2 == 0 && (length > 1 || i == 0));
    distinct.insert(prompt);
    requests.push_back(Request(std::move(prompt), 16 + (i * 7) % 17, /*ignore_eos=*/i % 3 != 0,
                               "greedy-" + std::to_string(i)));
  }
  ASSERT_EQ(distinct.size(), requests.size()) << "the prompts must differ";
  ASSERT_GE(longer_than_a_step, 4);

  const auto t0 = Clock::now();
  const std::vector<Streamed> alone = RunOneByOne(*cluster, requests);
  const double alone_seconds = SecondsSince(t0);
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::string bad = CheckStream(requests[i], alone[i]);
    ASSERT_EQ(bad, "") << "request " << i << " alone: " << bad << "\n" << cluster->Logs();
  }

  const auto t1 = Clock::now();
  const std::vector<Streamed> together = RunConcurrently(*cluster, requests);
  const double together_seconds = SecondsSince(t1);
  int tokens = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::string bad = CheckStream(requests[i], together[i]);
    EXPECT_EQ(bad, "") << "request " << i << " in the batch: " << bad;
    EXPECT_EQ(Diff(alone[i].tokens, together[i].tokens), "")
        << "request " << i << " (" << requests[i].token_ids().ids_size() << " prompt tokens, max_tokens "
        << requests[i].sampling().max_tokens() << ") in a batch of " << requests.size() << " vs alone";
    tokens += static_cast<int>(together[i].tokens.size());
  }
  ExpectIdle(*cluster, "after the batch");
  // A group of one stage schedules asynchronously unless told not to (the scheduler's log line).
  const std::string log = Tail(cluster->coordinator().log(), std::string::npos);
  EXPECT_EQ(log.find(", asynchronous scheduling") != std::string::npos, l.pp == 1 && !l.sync);
  // The workers run on this host, so every group of two or more ranks goes through shared memory
  // (the workers' log line); a layout of one worker has no such group and no line.
  for (int w = 0; w < cluster->num_workers(); ++w) {
    const std::string worker_log = Tail(cluster->worker(w).log(), std::string::npos);
    if (l.tp * l.pp == 1) {
      EXPECT_EQ(worker_log.find("collectives:"), std::string::npos) << "worker " << w;
      continue;
    }
    if (l.tp > 1) {
      EXPECT_NE(worker_log.find("TP group: shared memory"), std::string::npos) << "worker " << w;
    }
    if (l.pp > 1) {
      EXPECT_NE(worker_log.find(" stage: shared memory"), std::string::npos) << "worker " << w;
    }
    EXPECT_EQ(worker_log.find("Gloo TCP"), std::string::npos) << "worker " << w;
  }
  std::printf("[ timing   ] TP%d_PP%d: %zu requests one by one in %.2f s, together in %.2f s "
              "(%d tokens, %.0f tokens/s)\n",
              l.tp, l.pp, requests.size(), alone_seconds, together_seconds, tokens, tokens / together_seconds);
  if (HasFailure()) std::printf("%s", cluster->Logs().c_str());
}

TEST_P(BatchingTest, SeededSamplingIsReproducibleInAnyBatch) {
  const Layout& l = GetParam();
  Cluster* cluster = GetCluster();
  ASSERT_NE(cluster, nullptr);

  constexpr int kMaxTokens = 24;
  auto seeded = [](int i, uint64_t seed) {
    v1::GenerateRequest r = Request(Prompt(5 + (i * 17) % 50, 29 * i, /*bos=*/true), kMaxTokens,
                                    /*ignore_eos=*/true, "seeded-" + std::to_string(i) + "-" + std::to_string(seed));
    r.mutable_sampling()->set_temperature(0.8f);
    r.mutable_sampling()->set_top_k(50);
    r.mutable_sampling()->set_top_p(0.9f);
    r.mutable_sampling()->set_seed(seed);
    return r;
  };
  // 24 requests, each with its own seed; the first 16 run alone, then together.
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < 24; ++i) requests.push_back(seeded(i, 1000 + i));

  const auto t0 = Clock::now();
  std::vector<Streamed> alone = RunOneByOne(*cluster, requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::string bad = CheckStream(requests[i], alone[i]);
    ASSERT_EQ(bad, "") << "seeded request " << i << " alone: " << bad << "\n" << cluster->Logs();
  }

  // (b) The first 16 together.
  const std::vector<v1::GenerateRequest> first(requests.begin(), requests.begin() + 16);
  const std::vector<Streamed> batch_a = RunConcurrently(*cluster, first);
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(CheckStream(first[i], batch_a[i]), "") << "seeded request " << i << " in batch A";
    EXPECT_EQ(Diff(alone[i].tokens, batch_a[i].tokens), "") << "seeded request " << i << " in batch A vs alone";
  }

  // (c) Another mix, started in another order (10 ms apart, so that the queue order differs):
  // requests 23 down to 8, request 0 twice with its seed and twice with other seeds.
  std::vector<v1::GenerateRequest> mix;
  std::vector<int> index;  // into requests; -1: request 0 with another seed
  for (int i = 23; i >= 8; --i) {
    mix.push_back(requests[i]);
    index.push_back(i);
  }
  for (uint64_t seed : {uint64_t{1000}, uint64_t{5001}, uint64_t{1000}, uint64_t{5002}}) {
    mix.insert(mix.begin() + static_cast<long>(mix.size() / 2), seeded(0, seed));
    index.insert(index.begin() + static_cast<long>(index.size() / 2), seed == 1000 ? 0 : -1);
  }
  const std::vector<Streamed> batch_b = RunConcurrently(*cluster, mix, std::chrono::milliseconds(10));
  int other_seeds_differ = 0;
  for (size_t j = 0; j < mix.size(); ++j) {
    EXPECT_EQ(CheckStream(mix[j], batch_b[j]), "") << mix[j].request_id() << " in batch B";
    if (index[j] >= 0) {
      EXPECT_EQ(Diff(alone[index[j]].tokens, batch_b[j].tokens), "")
          << "seeded request " << index[j] << " in batch B (position " << j << ") vs alone";
    } else {
      other_seeds_differ += batch_b[j].tokens != alone[0].tokens;
    }
  }
  EXPECT_GE(other_seeds_differ, 1) << "request 0 with seeds 5001 and 5002 gave exactly the tokens of seed 1000: "
                                   << Ids(alone[0].tokens);
  // Sampling did sample: the seeded tokens are not all the greedy ones.
  const std::vector<int32_t> prompt0(requests[0].token_ids().ids().begin(), requests[0].token_ids().ids().end());
  const Streamed greedy = Generate(cluster->client(), Request(prompt0, kMaxTokens, true, "seeded-greedy"));
  ASSERT_TRUE(greedy.status.ok()) << greedy.status.error_message();
  int differ_from_greedy = 0;
  for (int i = 0; i < 16; ++i) differ_from_greedy += alone[i].tokens != greedy.tokens;
  EXPECT_GE(differ_from_greedy, 1);
  ExpectIdle(*cluster, "after the seeded batches");
  std::printf("[ timing   ] TP%d_PP%d: 24 seeded requests alone, 16 together, 20 together in %.2f s\n", l.tp, l.pp,
              SecondsSince(t0));
  if (HasFailure()) std::printf("%s", cluster->Logs().c_str());
}

INSTANTIATE_TEST_SUITE_P(Layouts, BatchingTest,
                         ::testing::Values(Layout{1, 1, 64}, Layout{1, 1, 64, /*sync=*/true}, Layout{2, 1, 32},
                                           Layout{1, 2, 64}, Layout{2, 2, 32}),
                         LayoutName);

// ---- Preemption ------------------------------------------------------------------------------------------

// 8 KV blocks of 16 tokens with a served length of 128: one request of up to 92 tokens (6 blocks)
// fits, a few together do not, so running sequences are preempted and recomputed. Every fourth
// request samples with a seed.
class PreemptionTest : public ::testing::TestWithParam<Layout> {};

TEST_P(PreemptionTest, TinyKvCachePreemptsAndEveryRequestGetsItsLoneTokens) {
  const Layout& l = GetParam();
  constexpr int kBlocks = 8, kBlockSize = 16, kMaxModelLen = 128, kMaxTokens = 32;
  std::unique_ptr<Cluster> cluster =
      StartDemo(l.tp, l.pp,
                {"--max-model-len", std::to_string(kMaxModelLen), "--num-kv-blocks", std::to_string(kBlocks),
                 "--block-size", std::to_string(kBlockSize)});
  ASSERT_NE(cluster, nullptr);
  {
    grpc::ClientContext context;
    v1::ModelInfo info;
    ASSERT_TRUE(cluster->client()->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
    ASSERT_EQ(info.max_model_len(), kMaxModelLen);
  }
  std::vector<v1::GenerateRequest> requests;
  int longest = 0;
  for (int i = 0; i < l.streams; ++i) {
    const int length = 20 + (i * 13) % 41;  // 20 to 60
    longest = std::max(longest, length + kMaxTokens);
    v1::GenerateRequest r =
        Request(Prompt(length, 7 * i, /*bos=*/true), kMaxTokens, /*ignore_eos=*/true, "preempt-" + std::to_string(i));
    if (i % 4 == 1) r.mutable_sampling()->set_prompt_logprobs(1);  // scored again when preempted before its first token
    if (i % 4 == 3) {  // a recomputed sequence must draw its next tokens as it would have
      r.mutable_sampling()->set_temperature(0.8f);
      r.mutable_sampling()->set_top_k(50);
      r.mutable_sampling()->set_top_p(0.9f);
      r.mutable_sampling()->set_seed(77 + i);
    }
    requests.push_back(std::move(r));
  }
  const int longest_blocks = (longest + kBlockSize - 1) / kBlockSize;
  ASSERT_LE(longest, kMaxModelLen);
  ASSERT_GE(kBlocks, longest_blocks);
  ASSERT_LE(kBlocks, longest_blocks + 2) << "the cache should hold little more than the longest request";

  const std::vector<Streamed> alone = RunOneByOne(*cluster, requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::string bad = CheckStream(requests[i], alone[i]);
    ASSERT_EQ(bad, "") << "request " << i << " alone: " << bad << "\n" << cluster->Logs();
  }
  v1::SchedulerStatus s = cluster->Status().scheduler();
  ASSERT_EQ(s.kv_blocks_total(), kBlocks) << Describe(s);
  ASSERT_EQ(s.block_size(), kBlockSize);
  EXPECT_EQ(s.preemptions(), 0) << "one request at a time fits the cache";

  const auto t0 = Clock::now();
  const std::vector<Streamed> together = RunConcurrently(*cluster, requests);
  const double seconds = SecondsSince(t0);
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::string bad = CheckStream(requests[i], together[i]);
    EXPECT_EQ(bad, "") << "request " << i << " in the batch: " << bad;
    EXPECT_EQ(Diff(alone[i].tokens, together[i].tokens), "")
        << "request " << i << " (" << requests[i].token_ids().ids_size() << " prompt tokens) with preemption vs alone";
    // Prompt logprobs: one per prompt token after the first, in the first message only, the same
    // (bitwise: a row's arithmetic does not depend on the batch) alone and with preemption.
    if (!requests[i].sampling().has_prompt_logprobs() || together[i].messages.empty() || alone[i].messages.empty()) {
      continue;
    }
    const auto& got = together[i].messages.front().prompt_logprobs();
    const auto& want = alone[i].messages.front().prompt_logprobs();
    ASSERT_EQ(want.size(), requests[i].token_ids().ids_size() - 1) << "request " << i;
    ASSERT_EQ(got.size(), want.size()) << "request " << i;
    for (int k = 0; k < got.size(); ++k) {
      EXPECT_EQ(got[k].token_id(), requests[i].token_ids().ids(k + 1)) << "request " << i << " position " << k;
      EXPECT_EQ(got[k].logprob(), want[k].logprob()) << "request " << i << " position " << k;
      EXPECT_EQ(got[k].rank(), want[k].rank()) << "request " << i << " position " << k;
    }
    for (size_t m = 1; m < together[i].messages.size(); ++m) {
      EXPECT_EQ(together[i].messages[m].prompt_logprobs_size(), 0) << "request " << i << " message " << m;
    }
  }
  s = cluster->Status().scheduler();
  EXPECT_GT(s.preemptions(), 0) << Describe(s);
  ExpectIdle(*cluster, "after the preempting batch");
  std::printf("[ timing   ] TP%d_PP%d: %zu requests in %d KV blocks in %.2f s, %lld preemptions\n", l.tp, l.pp,
              requests.size(), kBlocks, seconds, static_cast<long long>(s.preemptions()));
  if (HasFailure()) std::printf("%s", cluster->Logs().c_str());
}

INSTANTIATE_TEST_SUITE_P(Layouts, PreemptionTest,
                         ::testing::Values(Layout{1, 1, 24}, Layout{2, 1, 12}, Layout{1, 2, 20}, Layout{2, 2, 12}),
                         LayoutName);

// ---- Cancellation and limits -----------------------------------------------------------------------------

// A stream read on its own thread until it ends; Cancel() cancels it from any thread.
class BackgroundStream {
 public:
  BackgroundStream(Cluster& cluster, v1::GenerateRequest request, std::chrono::milliseconds deadline)
      : request_(std::move(request)) {
    context_.set_deadline(std::chrono::system_clock::now() + deadline);
    thread_ = std::thread([this, &cluster] {
      std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
          cluster.client()->Generate(&context_, request_);
      v1::GenerateResponse message;
      while (reader->Read(&message)) {
        tokens_ += message.token_ids_size();
        if (message.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) finished_ = true;
      }
      status_ = reader->Finish();
      done_ = true;
    });
  }
  ~BackgroundStream() {
    context_.TryCancel();
    if (thread_.joinable()) thread_.join();
  }

  // Waits up to `timeout` (scaled) for `n` tokens.
  bool WaitForTokens(int n, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + Scaled(timeout);
    while (tokens_ < n && !done_ && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return tokens_ >= n;
  }
  void Cancel() { context_.TryCancel(); }
  // Waits for the stream to end (bounded by its deadline) and returns its status.
  const grpc::Status& Join() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }
  int tokens() const { return tokens_; }
  bool finished() const { return finished_; }
  bool done() const { return done_; }

 private:
  const v1::GenerateRequest request_;
  grpc::ClientContext context_;
  std::atomic<int> tokens_{0};
  std::atomic<bool> finished_{false};
  std::atomic<bool> done_{false};
  grpc::Status status_;
  std::thread thread_;
};

// The workers sleep 100 ms per step, so that a 450-token stream lasts at least 45 s: it is still
// running when a limits test, which cancels it, has seen what it checks, however loaded the machine
// (short of a hang).
const std::vector<std::string> kSlowWorkers = {"--debug-step-delay-ms", "100"};
constexpr int kDemoBlockSize = 16;  // the coordinator's default --block-size

// On PP = 2 a sequence may be cancelled while its step is in flight: its blocks are freed when
// the step comes back.
class BatchingCancelTest : public ::testing::TestWithParam<Layout> {};

// The order of the events is fixed by the streams' lengths, not by how fast the machine runs: every
// step takes at least kCancelStepDelayMs, so a stream of n tokens lasts at least n times that.
// `expires` (deadline kExpiresDeadline) cannot finish before its deadline (450 tokens: >= 36 s);
// `finishes` cannot end before that deadline plus 6 s (330 tokens: >= 26 s), nor `cancelled_last`
// before `finishes` plus 9 s (450 tokens). The only things assumed fast are hang-level: the
// streams' first tokens and the client cancel within the 20 s deadline, each observation within
// those 6 and 9 s.
TEST_P(BatchingCancelTest, CancelledAndExpiredStreamsLeaveAndFreeTheirBlocks) {
  constexpr int kCancelStepDelayMs = 80;
  constexpr std::chrono::seconds kExpiresDeadline(20);
  constexpr int kFinishesTokens = 330;
  const Layout& l = GetParam();
  std::unique_ptr<Cluster> cluster =
      StartDemo(l.tp, l.pp, {}, {"--debug-step-delay-ms", std::to_string(kCancelStepDelayMs)});
  ASSERT_NE(cluster, nullptr);
  auto request = [](int i, int max_tokens) {
    return Request(Prompt(20 + 10 * i, 31 * i, /*bos=*/true), max_tokens, /*ignore_eos=*/true,
                   "cancel-" + std::to_string(i));
  };
  static_assert(450 * kCancelStepDelayMs > 1000 * kExpiresDeadline.count() + 10'000, "expires could finish");
  static_assert(kFinishesTokens * kCancelStepDelayMs >= 1000 * kExpiresDeadline.count() + 6'000);
  static_assert((450 - kFinishesTokens) * kCancelStepDelayMs >= 9'000);
  BackgroundStream cancelled(*cluster, request(0, 450), kNoDeadline);
  BackgroundStream expires(*cluster, request(1, 450), kExpiresDeadline);
  BackgroundStream finishes(*cluster, request(2, kFinishesTokens), kNoDeadline);
  BackgroundStream cancelled_last(*cluster, request(3, 450), kNoDeadline);
  for (BackgroundStream* b : {&cancelled, &expires, &finishes, &cancelled_last}) {
    ASSERT_TRUE(b->WaitForTokens(3, kNotHung)) << "a stream ended or had no 3 tokens in " << kNotHung.count()
                                               << " s\n" << cluster->Logs();
  }
  v1::SchedulerStatus s = cluster->Status().scheduler();
  EXPECT_EQ(s.running(), 4) << Describe(s);
  // Client cancel: the sequence leaves at the next step.
  cancelled.Cancel();
  EXPECT_EQ(cancelled.Join().error_code(), grpc::StatusCode::CANCELLED) << cancelled.Join().error_message();
  EXPECT_TRUE(WaitForScheduler(*cluster, [](const v1::SchedulerStatus& x) { return x.running() <= 3; }, kNotHung, &s))
      << "after a client cancel: " << Describe(s);
  EXPECT_FALSE(expires.done()) << "the " << kExpiresDeadline.count()
                               << " s deadline passed before the cancel was seen: a hang-level stall";
  EXPECT_EQ(s.running(), 3) << Describe(s);

  // Deadline.
  EXPECT_EQ(expires.Join().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << expires.Join().error_message();
  EXPECT_TRUE(WaitForScheduler(*cluster, [](const v1::SchedulerStatus& x) { return x.running() <= 2; }, kNotHung, &s))
      << "after a deadline: " << Describe(s);
  EXPECT_FALSE(finishes.done()) << "the " << kFinishesTokens << "-token stream ended before the deadline was seen";
  EXPECT_EQ(s.running(), 2) << Describe(s);
  // The two left hold no blocks: the used ones are at most what the two running need (prompt,
  // tokens the client has read, a few more streamed or in the step since, and one block each
  // allocated ahead).
  int64_t bound = 0;
  for (const auto& [b, prompt] : {std::pair{&finishes, 40}, std::pair{&cancelled_last, 50}}) {
    bound += (prompt + b->tokens() + 4 + kDemoBlockSize - 1) / kDemoBlockSize + 1;
  }
  EXPECT_LE(s.kv_blocks_total() - s.kv_blocks_free(), bound)
      << "blocks still in use after 2 of 4 sequences left: " << Describe(s);

  // One finishes on its own, the last is cancelled.
  EXPECT_TRUE(finishes.Join().ok()) << finishes.Join().error_message();
  EXPECT_TRUE(finishes.finished());
  EXPECT_EQ(finishes.tokens(), kFinishesTokens);
  EXPECT_FALSE(cancelled_last.done());
  cancelled_last.Cancel();
  EXPECT_EQ(cancelled_last.Join().error_code(), grpc::StatusCode::CANCELLED);
  ExpectIdle(*cluster, "after every stream ended");

  // The coordinator saw each for what it was. The client's RST_STREAM at its deadline can reach
  // the coordinator a little before the coordinator's own copy of the deadline (the arrival time
  // plus grpc-timeout) passes; the coordinator must still call it a deadline, not a cancel.
  const std::string log = Tail(cluster->coordinator().log(), 1 << 20);
  EXPECT_NE(log.find("the client cancelled the request after"), std::string::npos) << log;
  EXPECT_NE(log.find("the request's deadline passed after"), std::string::npos) << log;
  if (HasFailure()) std::printf("%s", cluster->Logs().c_str());
}

INSTANTIATE_TEST_SUITE_P(Layouts, BatchingCancelTest, ::testing::Values(Layout{1, 1, 4}, Layout{1, 2, 4}),
                         LayoutName);

TEST(BatchingLimitsTest, TP1_PP1_PastMaxNumSeqsAndMaxWaitingRequestsIsResourceExhausted) {
  std::unique_ptr<Cluster> cluster =
      StartDemo(1, 1, {"--max-num-seqs", "2", "--max-waiting-requests", "2"}, kSlowWorkers);
  ASSERT_NE(cluster, nullptr);
  // Twice: cancelled waiting requests must leave the queue, so the second round fills it the same.
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    // One at a time, each once the previous is seen running (the first two) or waiting (a burst
    // is the next test).
    std::vector<std::unique_ptr<BackgroundStream>> streams;
    v1::SchedulerStatus s;
    for (int i = 0; i < 4; ++i) {
      streams.push_back(std::make_unique<BackgroundStream>(
          *cluster,
          Request(Prompt(10 + i, 5 * i, /*bos=*/true), 450, /*ignore_eos=*/true,
                  "limit-" + std::to_string(round) + "-" + std::to_string(i)),
          kNoDeadline));
      ASSERT_TRUE(WaitForScheduler(
          *cluster,
          [i](const v1::SchedulerStatus& x) {
            return x.running() == std::min(i + 1, 2) && x.waiting() == std::max(0, i - 1);
          },
          kNotHung, &s))
          << "stream " << i << " started: " << Describe(s) << "\n" << cluster->Logs();
    }
    EXPECT_EQ(s.max_running(), 2);
    EXPECT_EQ(s.max_waiting(), 2);

    const Streamed refused =
        Generate(cluster->client(), Request(Prompt(8, 3, true), 4, true, "limit-refused"), kNotHung);
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.status.error_message();
    EXPECT_NE(refused.status.error_message().find("--max-waiting-requests"), std::string::npos)
        << refused.status.error_message();
    EXPECT_TRUE(refused.messages.empty());
    // Polled: the status may lag the engine by a step.
    EXPECT_TRUE(WaitForScheduler(
        *cluster, [](const v1::SchedulerStatus& x) { return x.running() == 2 && x.waiting() == 2; }, kNotHung, &s))
        << "after the refusal: " << Describe(s);

    for (auto& b : streams) b->Cancel();
    for (auto& b : streams) {
      EXPECT_EQ(b->Join().error_code(), grpc::StatusCode::CANCELLED) << b->Join().error_message();
    }
    ExpectIdle(*cluster, "after cancelling every stream");
  }

  const v1::GenerateRequest again = Request(Prompt(8, 3, true), 4, true, "limit-again");
  const Streamed r = Generate(cluster->client(), again, kNotHung);
  EXPECT_EQ(CheckStream(again, r), "");
  EXPECT_EQ(r.tokens.size(), 4u);
  if (HasFailure()) std::printf("%s", cluster->Logs().c_str());
}

// max_running + max_waiting requests at once to an idle server are all taken: two run, two wait.
TEST(BatchingLimitsTest, TP1_PP1_ABurstWithinMaxNumSeqsPlusMaxWaitingRequestsIsAccepted) {
  std::unique_ptr<Cluster> cluster =
      StartDemo(1, 1, {"--max-num-seqs", "2", "--max-waiting-requests", "2"}, kSlowWorkers);
  ASSERT_NE(cluster, nullptr);
  std::vector<std::unique_ptr<BackgroundStream>> streams;
  for (int i = 0; i < 4; ++i) {
    streams.push_back(std::make_unique<BackgroundStream>(
        *cluster,
        Request(Prompt(10 + i, 5 * i, /*bos=*/true), 450, /*ignore_eos=*/true, "burst-" + std::to_string(i)),
        kNoDeadline));
  }
  v1::SchedulerStatus s;
  EXPECT_TRUE(WaitForScheduler(
      *cluster, [](const v1::SchedulerStatus& x) { return x.running() == 2 && x.waiting() == 2; }, kNotHung, &s))
      << "4 streams at once, 2 may run and 2 wait: " << Describe(s);
  for (size_t i = 0; i < streams.size(); ++i) {
    if (streams[i]->done()) {
      ADD_FAILURE() << "burst stream " << i << " ended: " << streams[i]->Join().error_code() << " "
                    << streams[i]->Join().error_message();
    }
  }
  for (auto& b : streams) b->Cancel();
  for (auto& b : streams) b->Join();
  ExpectIdle(*cluster, "after cancelling every stream");
  if (HasFailure()) std::printf("%s", cluster->Logs().c_str());
}

// GetClusterStatus reports the scheduler's sizes and limits as soon as the cluster serves, before
// any request.
TEST(BatchingStatusTest, TP1_PP2_SchedulerStatusIsReportedAsSoonAsTheClusterServes) {
  std::unique_ptr<Cluster> cluster =
      StartDemo(1, 2,
                {"--max-num-seqs", "8", "--max-waiting-requests", "5", "--max-tokens-per-step", "96",
                 "--num-kv-blocks", "100", "--block-size", "8"});
  ASSERT_NE(cluster, nullptr);
  const v1::SchedulerStatus s = cluster->Status().scheduler();
  EXPECT_EQ(s.kv_blocks_total(), 100) << s.ShortDebugString();
  EXPECT_EQ(s.kv_blocks_free(), 100) << s.ShortDebugString();
  EXPECT_EQ(s.block_size(), 8) << s.ShortDebugString();
  EXPECT_EQ(s.max_running(), 8) << s.ShortDebugString();
  EXPECT_EQ(s.max_waiting(), 5) << s.ShortDebugString();
  EXPECT_EQ(s.micro_batches(), 2) << "one per stage: " << s.ShortDebugString();
  EXPECT_EQ(s.max_tokens_per_step(), 96) << s.ShortDebugString();
  EXPECT_EQ(s.running(), 0);
  EXPECT_EQ(s.waiting(), 0);
  EXPECT_EQ(s.preemptions(), 0);
}

// ---- The new sampling fields' bounds ----------------------------------------------------------------------

TEST(BatchingValidationTest, TP1_PP1_BadNewSamplingParametersAreInvalidArgumentNamingTheField) {
  std::unique_ptr<Cluster> cluster = StartDemo(1, 1, {});
  ASSERT_NE(cluster, nullptr);
  struct Case {
    std::string name;
    std::function<void(v1::SamplingParams*)> set;
    std::string field;
  };
  const std::vector<Case> cases = {
      {"min_p 1.5", [](v1::SamplingParams* s) { s->set_min_p(1.5f); }, "sampling.min_p"},
      {"repetition_penalty -1", [](v1::SamplingParams* s) { s->set_repetition_penalty(-1); },
       "sampling.repetition_penalty"},
      {"presence_penalty 3", [](v1::SamplingParams* s) { s->set_presence_penalty(3); }, "sampling.presence_penalty"},
      {"frequency_penalty -3", [](v1::SamplingParams* s) { s->set_frequency_penalty(-3); },
       "sampling.frequency_penalty"},
      {"top_logprobs 21", [](v1::SamplingParams* s) {
         s->set_logprobs(true);
         s->set_top_logprobs(21);
       },
       "sampling.top_logprobs"},
      {"top_logprobs without logprobs", [](v1::SamplingParams* s) { s->set_top_logprobs(3); },
       "sampling.top_logprobs"},
      {"prompt_logprobs 21", [](v1::SamplingParams* s) { s->set_prompt_logprobs(21); }, "sampling.prompt_logprobs"},
      {"allowed_token_ids outside the vocabulary",
       [](v1::SamplingParams* s) { s->add_allowed_token_ids(5), s->add_allowed_token_ids(1 << 30); },
       "sampling.allowed_token_ids[1]"},
      {"allowed_token_ids that min_tokens all bans (the demo's EOS, 1)",
       [](v1::SamplingParams* s) { s->set_ignore_eos(false), s->set_min_tokens(1), s->add_allowed_token_ids(1); },
       "sampling.allowed_token_ids"},
      {"an empty bad word", [](v1::SamplingParams* s) { s->add_bad_words("light"), s->add_bad_words(""); },
       "sampling.bad_words[1]"},
      {"a bad word of invalid UTF-8", [](v1::SamplingParams* s) { s->add_bad_words("\xff"); }, "sampling.bad_words[0]"},
      {"65 bad words",
       [](v1::SamplingParams* s) {
         for (int i = 0; i < 65; ++i) s->add_bad_words("w");
       },
       "sampling.bad_words"},
      {"prompt_logprobs -1", [](v1::SamplingParams* s) { s->set_prompt_logprobs(-1); }, "sampling.prompt_logprobs"},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest r = Request(Prompt(8, 0, true), 4, true, "invalid");
    c.set(r.mutable_sampling());
    const Streamed s = Generate(cluster->client(), r, kNotHung);
    EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name << ": " << s.status.error_message();
    EXPECT_NE(s.status.error_message().find(c.field), std::string::npos)
        << c.name << ": '" << s.status.error_message() << "' does not name " << c.field;
    EXPECT_TRUE(s.messages.empty()) << c.name;
  }
  const v1::SchedulerStatus s = cluster->Status().scheduler();
  EXPECT_EQ(s.running(), 0) << Describe(s);
  EXPECT_EQ(s.waiting(), 0) << Describe(s);
}

// ---- Structured outputs: grammar masks where the last stage samples -------------------------------

// The constraints of the structured tests, each bounded so that every output ends within
// kStructuredMaxTokens tokens with the EOS the grammar allows (the demo model's weights are not
// trained: the masks alone make the outputs valid).
constexpr int kStructuredMaxTokens = 88;
const char kNameRegex[] = "[a-z]{3,8}( [a-z]{2,6}){1,3}\\.";
const char kSumGrammar[] = "root ::= \"(\" num (\"+\" num){0,3} \")\"\nnum ::= [0-9]{1,3}";
const char kSumRegex[] = "\\([0-9]{1,3}(\\+[0-9]{1,3}){0,3}\\)";
const char kPersonSchema[] =
    R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},)"
    R"( "age": {"type": "integer", "minimum": 0, "maximum": 120}, "ok": {"type": "boolean"},)"
    R"( "pet": {"enum": ["cat", "dog", null]}}, "required": ["name", "age", "ok"]})";
const char kScoresSchema[] = R"({"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "maxItems": 4})";
const std::vector<std::string> kChoices = {"yes", "no", "maybe later"};

// Request i of the structured tests: one of five constraints, greedy or seeded sampling.
v1::GenerateRequest StructuredRequest(int i) {
  v1::GenerateRequest r = Request(Prompt(72 + (i * 7) % 29, 11 * i, /*bos=*/true), kStructuredMaxTokens,
                                  /*ignore_eos=*/false, "structured-" + std::to_string(i));
  v1::StructuredOutput* so = r.mutable_sampling()->mutable_structured_output();
  switch (i % 5) {
    case 0: so->set_regex(kNameRegex); break;
    case 1: so->set_grammar(kSumGrammar); break;
    case 2: so->set_json_schema(kPersonSchema); break;
    case 3:
      for (const std::string& c : kChoices) so->mutable_choices()->add_choices(c);
      break;
    case 4: so->set_json_schema(kScoresSchema); break;
  }
  if (i % 2 == 1) {
    r.mutable_sampling()->set_temperature(1.0f);
    r.mutable_sampling()->set_seed(100 + i);
  }
  return r;
}

// Empty when request i's output is a whole sentence of its constraint that ended on the EOS.
std::string CheckStructured(int i, const Streamed& r) {
  std::string text;
  for (const v1::GenerateResponse& m : r.messages) text += m.text();
  if (r.messages.empty() || r.messages.back().finish_reason() != v1::FINISH_REASON_STOP_TOKEN) {
    return "did not end on the EOS: '" + text + "'";
  }
  switch (i % 5) {
    case 0:
      return std::regex_match(text, std::regex(kNameRegex)) ? "" : "'" + text + "' does not match " + kNameRegex;
    case 1:
      return std::regex_match(text, std::regex(kSumRegex)) ? "" : "'" + text + "' is not of the sum grammar";
    case 2: {
      const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
      if (j.is_discarded() || !j.is_object()) return "'" + text + "' is not a JSON object";
      for (const auto& [key, value] : j.items()) {
        if (key != "name" && key != "age" && key != "ok" && key != "pet") return "'" + text + "' has key " + key;
      }
      if (!j.contains("name") || !j["name"].is_string()) return "'" + text + "': name";
      if (!j.contains("age") || !j["age"].is_number_integer() || j["age"].get<int64_t>() < 0 || j["age"].get<int64_t>() > 120) {
        return "'" + text + "': age";
      }
      if (!j.contains("ok") || !j["ok"].is_boolean()) return "'" + text + "': ok";
      if (j.contains("pet") && !(j["pet"].is_null() || j["pet"] == "cat" || j["pet"] == "dog")) return "'" + text + "': pet";
      return "";
    }
    case 3:
      return std::find(kChoices.begin(), kChoices.end(), text) != kChoices.end() ? "" : "'" + text + "' is no choice";
    default: {
      const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
      if (j.is_discarded() || !j.is_array() || j.size() > 4) return "'" + text + "' is not an array of at most 4";
      for (const nlohmann::json& x : j) {
        if (!x.is_number_integer() || x.get<int64_t>() < -50 || x.get<int64_t>() > 50) return "'" + text + "': item";
      }
      return "";
    }
  }
}

class StructuredOutputTest : public ::testing::TestWithParam<Layout> {};

// Every output is a sentence of its constraint, alone and in a batch whose tiny KV cache preempts
// sequences (a recomputed sequence's grammar state is that of its accepted tokens), and the batch
// gives each request its lone tokens. Prompts of 72 to 100 tokens (5 to 7 blocks of 16) in a cache
// of 12 blocks, so that sequences batched together outgrow it and are preempted.
TEST_P(StructuredOutputTest, EveryOutputFollowsItsConstraintThroughPreemption) {
  const Layout& l = GetParam();
  std::unique_ptr<Cluster> cluster =
      StartDemo(l.tp, l.pp, {"--max-model-len", "192", "--num-kv-blocks", "12", "--block-size", "16"});
  ASSERT_NE(cluster, nullptr);
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < l.streams; ++i) requests.push_back(StructuredRequest(i));
  const std::vector<Streamed> alone = RunOneByOne(*cluster, requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_EQ(CheckStream(requests[i], alone[i]), "") << "request " << i << "\n" << cluster->Logs();
    EXPECT_EQ(CheckStructured(static_cast<int>(i), alone[i]), "") << "request " << i << " alone";
  }
  // One lane batches every sequence at once, so its cache overflows once the requests arrive
  // together; on a loaded machine they may arrive spread out, so the batch is sent again (up to
  // three times) until a preemption was seen. With two lanes the short outputs may fit beside each
  // other (the count is printed).
  v1::SchedulerStatus s;
  for (int round = 0; round < 3; ++round) {
    const std::vector<Streamed> together = RunConcurrently(*cluster, requests);
    for (size_t i = 0; i < requests.size(); ++i) {
      ASSERT_EQ(CheckStream(requests[i], together[i]), "") << "request " << i;
      EXPECT_EQ(CheckStructured(static_cast<int>(i), together[i]), "") << "request " << i << " in the batch";
      EXPECT_EQ(Diff(alone[i].tokens, together[i].tokens), "") << "request " << i << " in the batch vs alone";
    }
    s = cluster->Status().scheduler();
    if (l.pp != 1 || s.preemptions() > 0) break;
  }
  if (l.pp == 1) {
    EXPECT_GT(s.preemptions(), 0) << Describe(s);
  }
  std::printf("[ preempt  ] TP%d_PP%d: %lld preemptions\n", l.tp, l.pp, static_cast<long long>(s.preemptions()));
  ExpectIdle(*cluster, "after the structured batch");
  if (HasFailure()) std::printf("%s", cluster->Logs().c_str());
}

INSTANTIATE_TEST_SUITE_P(Layouts, StructuredOutputTest, ::testing::Values(Layout{1, 1, 15}, Layout{2, 2, 10}),
                         LayoutName);

TEST(StructuredOutputValidationTest, TP1_PP1_BadConstraintsAreInvalidArgumentNamingTheField) {
  std::unique_ptr<Cluster> cluster = StartDemo(1, 1, {});
  ASSERT_NE(cluster, nullptr);
  struct Case {
    const char* name;
    std::function<void(v1::SamplingParams*)> set;
    std::vector<std::string> want;  // substrings of the message
  };
  const std::vector<Case> cases = {
      {"unsupported keyword", [](v1::SamplingParams* s) {
         s->mutable_structured_output()->set_json_schema(R"({"type": "object", "if": {}})");
       }, {"sampling.structured_output.json_schema", "if"}},
      {"not JSON", [](v1::SamplingParams* s) { s->mutable_structured_output()->set_json_schema("{"); },
       {"sampling.structured_output.json_schema"}},
      {"too deep", [](v1::SamplingParams* s) {
         s->mutable_structured_output()->set_json_schema(std::string(40, '[') + std::string(40, ']'));
       }, {"sampling.structured_output.json_schema", "deeper than 32"}},
      {"regex look-ahead", [](v1::SamplingParams* s) { s->mutable_structured_output()->set_regex("a(?=b)"); },
       {"sampling.structured_output.regex"}},
      {"grammar without root", [](v1::SamplingParams* s) { s->mutable_structured_output()->set_grammar("x ::= \"a\""); },
       {"sampling.structured_output.grammar"}},
      {"no choices", [](v1::SamplingParams* s) { s->mutable_structured_output()->mutable_choices(); },
       {"sampling.structured_output.choices", "1 to 256"}},
      {"invalid UTF-8", [](v1::SamplingParams* s) { s->mutable_structured_output()->set_regex("a\xff"); },
       {"sampling.structured_output.regex"}},
      {"too long", [](v1::SamplingParams* s) { s->mutable_structured_output()->set_regex(std::string(70000, 'a')); },
       {"sampling.structured_output.regex", "65536"}},
      {"json_object false", [](v1::SamplingParams* s) { s->mutable_structured_output()->set_json_object(false); },
       {"sampling.structured_output.json_object", "must be true"}},
      {"ignore_eos", [](v1::SamplingParams* s) {
         s->set_ignore_eos(true);
         s->mutable_structured_output()->set_regex("a+");
       }, {"sampling.ignore_eos", "structured output"}},
      {"min_tokens", [](v1::SamplingParams* s) {
         s->set_min_tokens(2);
         s->mutable_structured_output()->set_regex("a+");
       }, {"sampling.min_tokens", "structured output"}},
      {"allowed_token_ids", [](v1::SamplingParams* s) {
         s->add_allowed_token_ids(5);
         s->mutable_structured_output()->set_regex("a+");
       }, {"sampling.allowed_token_ids", "structured output"}},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest r = Request(Prompt(8, 0, true), 4, false, "invalid-constraint");
    c.set(r.mutable_sampling());
    const Streamed s = Generate(cluster->client(), r, kNotHung);
    EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name << ": " << s.status.error_message();
    for (const std::string& w : c.want) {
      EXPECT_NE(s.status.error_message().find(w), std::string::npos)
          << c.name << ": '" << s.status.error_message() << "' does not say " << w;
    }
  }
}

}  // namespace
}  // namespace shardserve
