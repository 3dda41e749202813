// A cluster that heals itself (docs/healing.md): real shardserve-coordinator and shardserve-worker
// processes on 127.0.0.1 (tests/cluster_harness.h).
//
// - A worker SIGKILLed in the middle of a greedy stream, at each position of a TP=2 x PP=2 group
//   (a TP rank of the first stage, the last stage's rank 0 that samples, the first stage's rank
//   0), with a replacement process started for its node about 1 s later: the stream finishes with
//   exactly the tokens of an undisturbed run, and the group serves under the next epoch.
// - The same with seeded sampling (temperature, top-p, a repetition penalty): the same tokens.
// - The same with speculative decoding (n-gram guesses, PP=2, the last stage killed): the same
//   tokens, Hugging Face's.
// - A SIGSTOPped worker: lost after its heartbeats stop. Let go on (SIGCONT) before a replacement
//   came, it registers again and takes its slot back without reloading. Stopped again and
//   replaced, its peer, stuck in a collective with it, fails that step, is not lost for it, and
//   regroups with the replacement: the same tokens; let go on then, it becomes a spare.
// - A worker lost during the group's first load: a replacement heals the group, which serves.
// - A replacement killed while it loads its shard (worker --debug-load-delay-ms holds it there):
//   its slot opens again, a second replacement heals the group, the stream finishes unchanged.
// - A spare registered beforehand (worker --spare) takes the slot of a killed worker at once; the
//   killed worker, started again, becomes the next spare and heals a second kill.
// - A worker started for a node that has its workers while the group still forms waits as that
//   node's spare and takes the slot of the node's killed worker: the same tokens, no new process.
// - No replacement: the stream fails after --heal-timeout-seconds with UNAVAILABLE naming the lost
//   worker and its slot; new requests are refused with it. Replacements that cannot take the slot
//   (too little memory, another node, another copy of the model) are refused saying why and the
//   slot stays open; a fitting one heals the group, which then serves again.
// - Every heal is also read off the coordinator's /metrics, by value: one more heals_total and
//   heal_duration_seconds observation, one more heal_requests_resumed_total (the stream held through
//   it), no more heal_requests_failed_total, cluster_state serving; after the heal timeout one
//   failed request and cluster_state healing.
//
// Every process runs in its own process group and dies with the test; every wait is bounded;
// teardown kills and reaps every child.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tests/cluster_harness.h"

namespace shardserve {
namespace {

// The harness index of the live worker process that holds slot (stage, tp_rank), found through
// the address it registered; -1 when none does.
int WorkerAt(Cluster& cluster, int stage, int tp_rank) {
  const v1::ClusterStatus status = cluster.Status();
  for (const v1::WorkerStatus& w : status.workers()) {
    if (w.stage() != stage || w.tp_rank() != tp_rank || w.state() == v1::WORKER_STATE_LOST) continue;
    for (int i = 0; i < cluster.num_workers(); ++i) {
      if (cluster.worker(i).running() && cluster.worker_address(i) == w.address()) return i;
    }
  }
  return -1;
}

struct StreamRun {
  grpc::Status status;
  std::vector<int32_t> tokens;
};

// Streams `request`; once `after` tokens have come, runs `act` (once), then reads to the end.
StreamRun StreamWith(Cluster& cluster, const v1::GenerateRequest& request, int after, const std::function<void()>& act,
               std::chrono::seconds timeout = std::chrono::seconds(240)) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + Scaled(timeout));
  auto reader = cluster.client()->Generate(&context, request);
  StreamRun out;
  bool acted = false;
  v1::GenerateResponse message;
  while (reader->Read(&message)) {
    out.tokens.insert(out.tokens.end(), message.token_ids().begin(), message.token_ids().end());
    if (!acted && static_cast<int>(out.tokens.size()) >= after) {
      acted = true;
      act();
    }
  }
  out.status = reader->Finish();
  return out;
}

// Whether the coordinator's status shows the worker registered from `address` as lost.
bool CoordinatorSeesLost(Cluster& cluster, const std::string& address) {
  const v1::ClusterStatus status = cluster.Status();
  for (const v1::WorkerStatus& w : status.workers()) {
    if (w.address() == address && w.state() == v1::WORKER_STATE_LOST) return true;
  }
  return false;
}

// SIGKILLs the worker in slot (stage, tp_rank) and starts a replacement for its node 1 s later.
void KillAndReplace(Cluster& cluster, int stage, int tp_rank) {
  const int victim = WorkerAt(cluster, stage, tp_rank);
  ASSERT_GE(victim, 0) << "no live worker holds stage " << stage << " tp rank " << tp_rank << "\n" << cluster.Logs();
  const std::string address = cluster.worker_address(victim);
  cluster.worker(victim).Signal(SIGKILL);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  // A worker that registers before the coordinator has seen the loss finds the group complete and
  // is refused (on a loaded machine the loss can take longer than the 1 s): wait for it, bounded.
  const auto start = Clock::now();
  while (!CoordinatorSeesLost(cluster, address) && SecondsSince(start) < ScaledSeconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  cluster.AddWorker("n" + std::to_string(stage));
}

// The coordinator's --heal-timeout-seconds for the tests that expect a heal: far above what a heal
// takes (seconds), so that a loaded machine, which can make a process start or a load slow, does not
// turn a heal into a timeout. The timeout itself is tested with 3 s below.
const std::vector<std::string> kPatientHeal = {"--heal-timeout-seconds", "600"};

// Waits until the coordinator's log has `text`, at most `seconds` (scaled).
bool WaitForLog(Cluster& cluster, const std::string& text, double seconds = 120) {
  const auto start = Clock::now();
  while (SecondsSince(start) < ScaledSeconds(seconds)) {
    if (Tail(cluster.coordinator().log(), 1 << 20).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// Waits up to 120 s (scaled) for the coordinator's status to say `state`.
bool WaitForState(Cluster& cluster, const std::string& state) {
  const auto start = Clock::now();
  while (SecondsSince(start) < ScaledSeconds(120)) {
    if (cluster.Status().state() == state) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// Whether the coordinator's status shows the worker registered from `address` as an idle spare (no
// slot: stage -1).
bool IsSpare(Cluster& cluster, const std::string& address) {
  const v1::ClusterStatus status = cluster.Status();
  for (const v1::WorkerStatus& w : status.workers()) {
    if (w.address() == address && w.stage() < 0 && w.state() != v1::WORKER_STATE_LOST) return true;
  }
  return false;
}

// How many times `text` occurs in `log`.
int CountOf(const std::string& log, const std::string& text) {
  int n = 0;
  for (size_t at = log.find(text); at != std::string::npos; at = log.find(text, at + text.size())) ++n;
  return n;
}

constexpr int kTokens = 96;

// The coordinator's heal metrics (docs/metrics.md), scraped from its /metrics.
struct HealMetrics {
  double heals = 0;           // shardserve_heals_total
  double resumed = 0;         // shardserve_heal_requests_resumed_total
  double failed = 0;          // shardserve_heal_requests_failed_total
  double duration_count = 0;  // shardserve_heal_duration_seconds_count
  double duration_sum = 0;    // shardserve_heal_duration_seconds_sum
  // The shardserve_cluster_state whose value is 1, when it is the only one and every other state is
  // 0; else a description of what is wrong.
  std::string state;
};

HealMetrics ScrapeHealMetrics(Cluster& cluster) {
  const std::map<std::string, double> m = cluster.Metrics();
  HealMetrics h;
  h.heals = Sum(m, "shardserve_heals_total");
  h.resumed = Sum(m, "shardserve_heal_requests_resumed_total");
  h.failed = Sum(m, "shardserve_heal_requests_failed_total");
  h.duration_count = Sum(m, "shardserve_heal_duration_seconds_count");
  h.duration_sum = Sum(m, "shardserve_heal_duration_seconds_sum");
  std::string ones;
  int states = 0;
  for (const char* s : {"starting", "serving", "healing", "degraded"}) {
    const std::string label = "state=\"" + std::string(s) + "\"";
    const double v = Sum(m, "shardserve_cluster_state", {label});
    states += std::any_of(m.begin(), m.end(), [&](const auto& sample) {
      return sample.first.rfind("shardserve_cluster_state{", 0) == 0 && sample.first.find(label) != std::string::npos;
    });
    if (v == 1) ones += ones.empty() ? s : std::string(" and ") + s;
    else if (v != 0) ones += std::string(" (") + s + " is " + std::to_string(v) + ")";
  }
  h.state = states != 4 ? "not every state exposed" : ones.empty() ? "no state is 1" : ones;
  return h;
}

// Between `before` and `after`: exactly one heal, that took some time, and `resumed` requests held
// through it and resumed, none failed; the cluster serves.
void ExpectOneHeal(const HealMetrics& before, const HealMetrics& after, int resumed) {
  EXPECT_EQ(after.heals - before.heals, 1);
  EXPECT_EQ(after.duration_count - before.duration_count, 1);
  EXPECT_GT(after.duration_sum - before.duration_sum, 0);
  EXPECT_EQ(after.resumed - before.resumed, resumed) << "requests resumed by this heal";
  EXPECT_EQ(after.failed - before.failed, 0);
  EXPECT_EQ(after.state, "serving");
}

// SIGKILLs the worker that holds slot (stage, tp_rank) once a stream of `request` has 10 tokens,
// and expects the stream to finish with `reference`'s tokens and the group to serve again under a
// later epoch. Returns the killed worker's harness index, -1 when no live worker held the slot.
int KillMidStreamExpectingTheSameTokens(Cluster& cluster, const v1::GenerateRequest& request,
                                        const Streamed& reference, int stage, int tp_rank) {
  const int victim = WorkerAt(cluster, stage, tp_rank);
  EXPECT_GE(victim, 0) << "no live worker holds stage " << stage << " tp rank " << tp_rank;
  if (victim < 0) return -1;
  const uint64_t epoch = cluster.Status().epoch();
  const HealMetrics before = ScrapeHealMetrics(cluster);
  const StreamRun run =
      StreamWith(cluster, request, /*after=*/10, [&] { cluster.worker(victim).Signal(SIGKILL); });
  EXPECT_TRUE(run.status.ok()) << run.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(run.tokens, reference.tokens);
  const v1::ClusterStatus status = cluster.Status();
  EXPECT_EQ(status.state(), "serving");
  EXPECT_GT(status.epoch(), epoch);
  // The stream was held through the heal and resumed.
  ExpectOneHeal(before, ScrapeHealMetrics(cluster), /*resumed=*/1);
  return victim;
}

// The cases that kill or stop a worker of a TP=2 group in the middle of a stream start alike
// (StartTp2); the others start clusters of their own.
class HealTest : public ::testing::Test {
 protected:
  // Starts a TP=2 group of llama3_rope on one node (n0), 20 ms a step (so that a stream of kTokens
  // lasts long enough to act in) and a patient heal; with `spare`, a spare worker of n0 (worker
  // --spare) registers before the reference is taken. Then streams `request` undisturbed into
  // reference_: the tokens a disturbed stream must still give. Reports through gtest: call it in
  // ASSERT_NO_FATAL_FAILURE.
  void StartTp2(const v1::GenerateRequest& request, bool spare = false) {
    cluster_.emplace(ClusterSpecForTest{"llama3_rope", 1, 2, {"--debug-step-delay-ms", "20"}}, kPatientHeal);
    Cluster& cluster = *cluster_;
    ASSERT_TRUE(cluster.Start());
    if (spare) {
      cluster.AddWorker("n0", {"--spare"});
      const auto start = Clock::now();
      while (cluster.Status().workers_size() < 3 && SecondsSince(start) < 60) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      ASSERT_EQ(cluster.Status().workers_size(), 3) << "the spare did not register\n" << cluster.Logs();
      EXPECT_EQ(cluster.Status().state(), "serving");
    }
    reference_ = Generate(cluster.client(), request, std::chrono::seconds(120));
    ASSERT_TRUE(reference_.status.ok()) << reference_.status.error_message();
  }

  std::optional<Cluster> cluster_;  // StartTp2's
  Streamed reference_;              // StartTp2's undisturbed stream
};

TEST_F(HealTest, Tp2Pp2KilledWorkerAtEachPositionIsReplacedAndTheStreamGoesOnUnchanged) {
  Cluster cluster({"llama3_rope", 2, 2, {"--debug-step-delay-ms", "20"}}, kPatientHeal);
  ASSERT_TRUE(cluster.Start());
  EXPECT_EQ(cluster.Status().state(), "serving");
  EXPECT_EQ(cluster.Status().epoch(), 1u);
  const Golden golden = LoadGolden("llama3_rope");
  const v1::GenerateRequest request = TokenRequest(golden.prompt, kTokens);
  const Streamed reference = Generate(cluster.client(), request, std::chrono::seconds(120));
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  ASSERT_EQ(reference.tokens.size(), static_cast<size_t>(kTokens));

  struct Position {
    const char* what;
    int stage, tp_rank;
  };
  uint64_t epoch = 1;
  for (const Position& p : {Position{"a TP rank of the first stage", 0, 1},
                            Position{"the last stage's sampling rank", 1, 0},
                            Position{"the first stage's rank 0", 0, 0}}) {
    SCOPED_TRACE(p.what);
    const auto start = Clock::now();
    const HealMetrics before = ScrapeHealMetrics(cluster);
    const int resumed_lines = CountOf(Tail(cluster.coordinator().log(), 1 << 20), "resumed by recompute");
    const StreamRun run = StreamWith(cluster, request, /*after=*/10, [&] { KillAndReplace(cluster, p.stage, p.tp_rank); });
    std::printf("[ heal     ] %s: killed, replaced, stream done in %.1f s\n", p.what, SecondsSince(start));
    ASSERT_TRUE(run.status.ok()) << run.status.error_message() << "\n" << cluster.Logs();
    EXPECT_EQ(run.tokens, reference.tokens) << cluster.Logs();
    const v1::ClusterStatus status = cluster.Status();
    EXPECT_EQ(status.state(), "serving");
    EXPECT_GT(status.epoch(), epoch);
    epoch = status.epoch();
    // This kill's heal held the stream and resumed it: one heal, one resumed request, logged once.
    ExpectOneHeal(before, ScrapeHealMetrics(cluster), /*resumed=*/1);
    EXPECT_EQ(CountOf(Tail(cluster.coordinator().log(), 1 << 20), "resumed by recompute") - resumed_lines, 1);
  }
  const HealMetrics total = ScrapeHealMetrics(cluster);
  EXPECT_EQ(total.heals, 3);
  EXPECT_EQ(total.resumed, 3);
  EXPECT_EQ(total.failed, 0);
  // Each heal replaced one worker: the epoch moved on by (at least) one each time.
  EXPECT_GE(epoch, 4u);
  // The coordinator's log has one line per event with the slot and the epoch.
  const std::string log = Tail(cluster.coordinator().log(), 1 << 20);
  EXPECT_NE(log.find("HEALING (epoch 1)"), std::string::npos);
  EXPECT_NE(log.find("as the replacement for slot (node n0, stage 0, tp rank 1)"), std::string::npos);
  EXPECT_NE(log.find("re-forming: epoch 1 -> 2"), std::string::npos);
  EXPECT_NE(log.find("healed in"), std::string::npos);
  EXPECT_NE(log.find("resumed by recompute"), std::string::npos);
  // A survivor whose step fails closes its collective groups at once (StepExecutor::LeaveGroups),
  // so a peer blocked on it (a stage waiting for a hidden state from a stage that failed) fails
  // too, at once: no survivor waits out the collective timeout.
  EXPECT_EQ(log.find("timed out: no progress"), std::string::npos) << log;
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());
}

// Expert parallelism: the replacement for a killed TP rank gets the same assignment, the flag
// included, and loads that rank's block of whole experts (5 experts over TP=2: 2 and 3); the
// stream goes on with the tokens it had before, which are Hugging Face's.
TEST_F(HealTest, ExpertParallelRankKilledIsReplacedWithItsExperts) {
  std::vector<std::string> flags = kPatientHeal;
  flags.push_back("--expert-parallel");
  Cluster cluster({"qwen3_moe_tf5", 1, 2, {"--debug-step-delay-ms", "20", "--matmul-dtype", "f32"}}, flags);
  ASSERT_TRUE(cluster.Start());
  const Golden golden = LoadGolden("qwen3_moe_tf5");
  const v1::GenerateRequest request = TokenRequest(golden.prompt, 32);
  const Streamed reference = Generate(cluster.client(), request, std::chrono::seconds(120));
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  EXPECT_EQ(reference.tokens, golden.greedy);
  const StreamRun run = StreamWith(cluster, request, /*after=*/10, [&] { KillAndReplace(cluster, 0, 1); });
  ASSERT_TRUE(run.status.ok()) << run.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(run.tokens, reference.tokens) << cluster.Logs();
  EXPECT_EQ(cluster.Status().state(), "serving");
  EXPECT_GE(cluster.Status().epoch(), 2u);
}

// Speculative decoding across a heal (PP=2, n-gram guesses, docs/speculative-decoding.md): the last
// stage, which samples and keeps each sequence's fed tokens for the rollbacks of rejected guesses,
// is killed mid-stream and replaced; the stream resumes by recompute and finishes with the tokens of
// an undisturbed run, which are Hugging Face's greedy ones, and guesses were made before and after.
TEST_F(HealTest, SpeculatingGroupKeepsItsTokensAcrossAHeal) {
  std::vector<std::string> flags = kPatientHeal;
  flags.insert(flags.end(), {"--speculative", "ngram", "--num-speculative-tokens", "4"});
  Cluster cluster({"llama3_rope", 2, 1, {"--debug-step-delay-ms", "20"}}, flags);
  ASSERT_TRUE(cluster.Start());
  const Golden golden = LoadGolden("llama3_rope");
  const v1::GenerateRequest request = TokenRequest(golden.prompt, kTokens);
  const Streamed reference = Generate(cluster.client(), request, std::chrono::seconds(120));
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  const size_t common = std::min(reference.tokens.size(), golden.greedy.size());
  ASSERT_GT(common, 0u);
  EXPECT_EQ(std::vector<int32_t>(reference.tokens.begin(), reference.tokens.begin() + common),
            std::vector<int32_t>(golden.greedy.begin(), golden.greedy.begin() + common));
  const double proposed = Sum(cluster.Metrics(), "shardserve_spec_proposed_tokens_total");
  EXPECT_GT(proposed, 0) << "the undisturbed run made no guesses: the test would not speculate";
  const HealMetrics before = ScrapeHealMetrics(cluster);
  const StreamRun run = StreamWith(cluster, request, /*after=*/10, [&] { KillAndReplace(cluster, 1, 0); });
  ASSERT_TRUE(run.status.ok()) << run.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(run.tokens, reference.tokens);
  EXPECT_EQ(cluster.Status().state(), "serving");
  ExpectOneHeal(before, ScrapeHealMetrics(cluster), /*resumed=*/1);
  EXPECT_GT(Sum(cluster.Metrics(), "shardserve_spec_proposed_tokens_total"), proposed);
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());
}

TEST_F(HealTest, SeededSamplingGivesTheSameTokensAcrossAHeal) {
  v1::GenerateRequest request = TokenRequest(LoadGolden("llama3_rope").prompt, kTokens);
  request.mutable_sampling()->set_temperature(0.9f);
  request.mutable_sampling()->set_top_p(0.95f);
  request.mutable_sampling()->set_repetition_penalty(1.1f);
  request.mutable_sampling()->set_seed(1234);
  ASSERT_NO_FATAL_FAILURE(StartTp2(request));
  Cluster& cluster = *cluster_;
  const Streamed& reference = reference_;
  // The sampler's rank (TP rank 0 of the last stage) is the one killed: its replacement continues
  // the draws from the sequence's token count alone.
  const HealMetrics before = ScrapeHealMetrics(cluster);
  EXPECT_EQ(before.heals, 0);
  EXPECT_EQ(before.state, "serving");
  const StreamRun run = StreamWith(cluster, request, /*after=*/12, [&] { KillAndReplace(cluster, 0, 0); });
  ASSERT_TRUE(run.status.ok()) << run.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(run.tokens, reference.tokens);
  EXPECT_GE(cluster.Status().epoch(), 2u);
  ExpectOneHeal(before, ScrapeHealMetrics(cluster), /*resumed=*/1);
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());
}

// A hung (SIGSTOPped) worker, twice (docs/healing.md, "A worker marked lost while its process goes
// on"):
// 1. Let go on (SIGCONT) once the coordinator has lost it, before any replacement came: the
//    coordinator had ended its stream, so it registers again holding its shard, takes its own slot
//    back (adopted: no reload, no new process) and the stream finishes unchanged.
// 2. Stopped again, and a replacement takes its slot: its TP peer, stuck in an all-reduce with it
//    until the collective timeout, fails that step and is not lost for it, and regroups with the
//    replacement; the stream finishes unchanged. Let go on then, the stopped worker registers
//    again, finds its slot taken and becomes a spare of its node (it does not exit); the healed
//    group serves the same tokens again.
TEST_F(HealTest, StoppedWorkerTakesItsSlotBackWhenThawedOrOnceReplacedBecomesASpare) {
  const v1::GenerateRequest request = TokenRequest(LoadGolden("llama3_rope").prompt, kTokens);
  ASSERT_NO_FATAL_FAILURE(StartTp2(request));
  Cluster& cluster = *cluster_;
  const Streamed& reference = reference_;
  const int victim = WorkerAt(cluster, 0, 1);
  ASSERT_GE(victim, 0);
  const std::string victim_address = cluster.worker_address(victim);

  // 1. Thawed before a replacement came: it takes its slot back without reloading.
  const HealMetrics before = ScrapeHealMetrics(cluster);
  const StreamRun back = StreamWith(cluster, request, /*after=*/10, [&] {
    cluster.worker(victim).Signal(SIGSTOP);
    WaitForLog(cluster, "tp rank 1): LOST (epoch 1)");  // 3 s without heartbeats
    cluster.worker(victim).Signal(SIGCONT);
  });
  ASSERT_TRUE(back.status.ok()) << back.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(back.tokens, reference.tokens);
  EXPECT_EQ(cluster.Status().state(), "serving");
  EXPECT_GE(cluster.Status().epoch(), 2u);
  EXPECT_EQ(cluster.num_workers(), 2) << "no process was started for the heal";
  EXPECT_EQ(WorkerAt(cluster, 0, 1), victim) << cluster.Logs();
  EXPECT_NE(Tail(cluster.coordinator().log(), 1 << 20).find("adopting into slot (node n0, stage 0, tp rank 1)"),
            std::string::npos)
      << cluster.Logs();
  std::string victim_log = Tail(cluster.worker(victim).log(), 1 << 20);
  EXPECT_NE(victim_log.find("ended this worker's control stream without a shutdown"), std::string::npos) << victim_log;
  EXPECT_NE(victim_log.find("adopted by the coordinator"), std::string::npos) << victim_log;
  EXPECT_EQ(CountOf(victim_log, "loaded in"), 1) << "it kept its weights\n" << victim_log;
  const HealMetrics taken_back = ScrapeHealMetrics(cluster);
  ExpectOneHeal(before, taken_back, /*resumed=*/1);

  // 2. Stopped again and replaced: the survivor stuck in a collective with it regroups.
  const StreamRun run = StreamWith(cluster, request, /*after=*/10, [&] {
    cluster.worker(victim).Signal(SIGSTOP);
    // A replacement registers once the coordinator has lost the stopped worker (3 s without
    // heartbeats); before that the slot is not open.
    const auto start = Clock::now();
    while (WorkerAt(cluster, 0, 1) == victim && SecondsSince(start) < 60) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    cluster.AddWorker("n0");
  });
  ASSERT_TRUE(run.status.ok()) << run.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(run.tokens, reference.tokens);
  const v1::ClusterStatus status = cluster.Status();
  EXPECT_EQ(status.state(), "serving");
  EXPECT_GE(status.epoch(), 3u);
  // The survivor (tp rank 0) kept its slot: it was not lost, only regrouped.
  const std::string log = Tail(cluster.coordinator().log(), 1 << 20);
  EXPECT_NE(log.find("(node n0, stage 0, tp rank 0): regrouped"), std::string::npos) << log;
  EXPECT_EQ(log.find("tp rank 0): LOST"), std::string::npos) << log;
  ExpectOneHeal(taken_back, ScrapeHealMetrics(cluster), /*resumed=*/1);
  cluster.worker(victim).Signal(SIGCONT);
  ASSERT_TRUE(WaitForLog(cluster, "as a spare: every slot of node n0 has a worker")) << cluster.Logs();
  EXPECT_TRUE(cluster.worker(victim).running()) << Tail(cluster.worker(victim).log());
  EXPECT_TRUE(IsSpare(cluster, victim_address)) << cluster.Logs();
  const Streamed again = Generate(cluster.client(), request, std::chrono::seconds(120));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(again.tokens, reference.tokens);
  EXPECT_EQ(cluster.Status().state(), "serving");
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());
}

// A replacement that dies while it loads its shard (SIGKILLed while --debug-load-delay-ms holds it
// after the load, before it says Loaded): the coordinator loses it, its slot opens again under the
// next epoch, and a second replacement heals the group; the stream finishes unchanged.
TEST_F(HealTest, ReplacementKilledWhileLoadingReopensTheSlotAndASecondReplacementHeals) {
  const v1::GenerateRequest request = TokenRequest(LoadGolden("llama3_rope").prompt, kTokens);
  ASSERT_NO_FATAL_FAILURE(StartTp2(request));
  Cluster& cluster = *cluster_;
  const Streamed& reference = reference_;
  const int victim = WorkerAt(cluster, 0, 1);
  ASSERT_GE(victim, 0);
  const HealMetrics before = ScrapeHealMetrics(cluster);
  int doomed = -1;
  bool held = false;
  const StreamRun run = StreamWith(cluster, request, /*after=*/10, [&] {
    cluster.worker(victim).Signal(SIGKILL);
    // A worker that registers before the coordinator has seen the loss finds the group complete
    // and is refused: start the replacement once the slot is open.
    if (!WaitForLog(cluster, "tp rank 1): LOST (epoch 1)")) return;
    doomed = cluster.AddWorker("n0", {"--debug-load-delay-ms", "600000"});
    // The replacement is held after its load until it is killed (bounded: 10 minutes at most).
    const auto start = Clock::now();
    while (!held && SecondsSince(start) < 180 && cluster.worker(doomed).running()) {
      held = Tail(cluster.worker(doomed).log()).find("TEST-ONLY: holding the load") != std::string::npos;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    cluster.worker(doomed).Signal(SIGKILL);
    // Lost under epoch 2, the one it was loading for; then its slot is open again.
    if (WaitForLog(cluster, "tp rank 1): LOST (epoch 2)")) cluster.AddWorker("n0");
  });
  ASSERT_TRUE(held) << "the first replacement never got to hold its load\n" << cluster.Logs();
  ASSERT_TRUE(run.status.ok()) << run.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(run.tokens, reference.tokens);
  const v1::ClusterStatus status = cluster.Status();
  EXPECT_EQ(status.state(), "serving");
  EXPECT_GE(status.epoch(), 3u) << "one epoch for the first replacement, one for the second";
  EXPECT_EQ(cluster.num_workers(), 4);
  const std::string log = Tail(cluster.coordinator().log(), 1 << 20);
  EXPECT_NE(log.find("tp rank 1): LOST (epoch 2)"), std::string::npos) << log;
  EXPECT_NE(log.find("re-forming: epoch 2 -> 3"), std::string::npos) << log;
  EXPECT_NE(log.find("healed in"), std::string::npos) << log;
  // The replacement's death came during the heal: one heal, that resumed the stream.
  ExpectOneHeal(before, ScrapeHealMetrics(cluster), /*resumed=*/1);
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());
}

// A spare (worker --spare) registered beforehand takes the killed worker's slot at once: no new
// process, and the stream finishes unchanged. The killed worker, started again with its --node (as
// launch or Kubernetes would), finds its slot taken and registers as a spare of its node: the
// cluster has a spare again, which takes the slot of a second killed worker.
TEST_F(HealTest, ASpareTakesTheSlotOfAKilledWorkerWhichComesBackAsTheNextSpare) {
  const v1::GenerateRequest request = TokenRequest(LoadGolden("llama3_rope").prompt, kTokens);
  ASSERT_NO_FATAL_FAILURE(StartTp2(request, /*spare=*/true));
  Cluster& cluster = *cluster_;
  const Streamed& reference = reference_;
  ASSERT_GE(KillMidStreamExpectingTheSameTokens(cluster, request, reference, 0, 1), 0);
  ASSERT_FALSE(HasFailure()) << cluster.Logs();
  EXPECT_EQ(cluster.num_workers(), 3) << "no process was started for the heal";
  const std::string log = Tail(cluster.coordinator().log(), 1 << 20);
  EXPECT_NE(log.find("spare takes slot (node n0, stage 0, tp rank 1)"), std::string::npos) << log;

  // The killed worker comes back (same --node, plain worker): a spare now, visible in the status.
  const int back = cluster.AddWorker("n0");
  ASSERT_TRUE(WaitForLog(cluster, "as a spare: every slot of node n0 has a worker")) << cluster.Logs();
  std::string back_address;
  const auto registered = Clock::now();
  while ((back_address = cluster.worker_address(back)).empty() && SecondsSince(registered) < 60) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(IsSpare(cluster, back_address)) << cluster.Logs();
  EXPECT_TRUE(cluster.worker(back).running());
  EXPECT_EQ(cluster.Status().state(), "serving");

  // A second kill: the returned worker, now the spare, takes the slot; the stream is unchanged.
  ASSERT_GE(KillMidStreamExpectingTheSameTokens(cluster, request, reference, 0, 0), 0);
  EXPECT_EQ(WorkerAt(cluster, 0, 0), back) << cluster.Logs();
  EXPECT_EQ(cluster.num_workers(), 4);
  EXPECT_EQ(CountOf(Tail(cluster.coordinator().log(), 1 << 20), "spare takes slot"), 2) << cluster.Logs();
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());
}

// A second worker for node n0 of a TP=1 x PP=2 group, registering before n1's worker completes the
// group, finds n0's one slot taken: it waits as n0's spare (it was refused before), and when n0's
// worker is SIGKILLed mid-stream it takes the slot at once; the stream goes on unchanged.
TEST_F(HealTest, AWorkerForAFullNodeBeforeTheGroupFormsWaitsAsItsSpareAndHealsAKill) {
  Cluster cluster({"llama3_rope", 2, 1, {"--debug-step-delay-ms", "20"}}, kPatientHeal);
  ASSERT_TRUE(cluster.StartCoordinator());
  cluster.AddWorker("n0");
  cluster.AddWorker("n0");
  const auto start = Clock::now();
  while (cluster.Status().workers_size() < 2 && SecondsSince(start) < 60) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_EQ(cluster.Status().workers_size(), 2) << "n0's second worker was not kept\n" << cluster.Logs();
  ASSERT_TRUE(WaitForLog(cluster, "already has its 1 workers (--gpus-per-node), the group is not complete yet"))
      << cluster.Logs();
  cluster.AddWorker("n1");
  ASSERT_TRUE(WaitForState(cluster, "serving")) << cluster.Logs();
  const Golden golden = LoadGolden("llama3_rope");
  const v1::GenerateRequest request = TokenRequest(golden.prompt, kTokens);
  const Streamed reference = Generate(cluster.client(), request, std::chrono::seconds(120));
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  const int victim = KillMidStreamExpectingTheSameTokens(cluster, request, reference, 0, 0);
  ASSERT_GE(victim, 0);
  EXPECT_EQ(cluster.num_workers(), 3) << "no process was started for the heal";
  EXPECT_NE(Tail(cluster.coordinator().log(), 1 << 20).find("spare takes slot (node n0, stage 0, tp rank 0)"),
            std::string::npos)
      << cluster.Logs();
  const int holder = WorkerAt(cluster, 0, 0);
  EXPECT_TRUE(holder >= 0 && holder != victim) << cluster.Logs();
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());
}

// A worker lost during the group's FIRST load (SIGKILLed while --debug-load-delay-ms holds it after
// its load, before it says Loaded) heals like a later loss: the slot opens, a replacement for its
// node loads it, the survivor keeps its weights and regroups, and the group serves Hugging Face's
// greedy tokens.
TEST_F(HealTest, WorkerLostDuringTheFirstLoadIsReplacedAndTheGroupServes) {
  Cluster cluster({"llama3_rope", 1, 2, {}}, kPatientHeal);
  ASSERT_TRUE(cluster.StartCoordinator());
  const int survivor = cluster.AddWorker("n0");
  const int doomed = cluster.AddWorker("n0", {"--debug-load-delay-ms", "600000"});
  bool held = false;
  const auto start = Clock::now();
  while (!held && SecondsSince(start) < 180 && cluster.worker(doomed).running()) {
    held = Tail(cluster.worker(doomed).log()).find("TEST-ONLY: holding the load") != std::string::npos;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(held) << "the worker never got to hold its load\n" << cluster.Logs();
  EXPECT_EQ(cluster.Status().state(), "starting");
  cluster.worker(doomed).Signal(SIGKILL);
  ASSERT_TRUE(WaitForLog(cluster, "LOST (epoch 1)")) << cluster.Logs();
  EXPECT_EQ(cluster.Status().state(), "healing");
  cluster.AddWorker("n0");
  ASSERT_TRUE(cluster.WaitForServing(180)) << cluster.Logs();
  EXPECT_GE(cluster.Status().epoch(), 2u);
  EXPECT_TRUE(cluster.worker(survivor).running());
  const Golden golden = LoadGolden("llama3_rope");
  const Streamed out = Generate(cluster.client(), TokenRequest(golden.prompt, static_cast<int>(golden.greedy.size())),
                                std::chrono::seconds(120));
  ASSERT_TRUE(out.status.ok()) << out.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(out.tokens, golden.greedy);
  const std::string log = Tail(cluster.coordinator().log(), 1 << 20);
  EXPECT_NE(log.find("HEALING (epoch 1)"), std::string::npos) << log;
  EXPECT_NE(log.find("as the replacement for slot (node n0, stage 0"), std::string::npos) << log;
  EXPECT_NE(log.find("healed in"), std::string::npos) << log;
  // The survivor loaded once and joined the new groups keeping its weights.
  const std::string survivor_log = Tail(cluster.worker(survivor).log(), 1 << 20);
  EXPECT_EQ(CountOf(survivor_log, "loaded in"), 1) << survivor_log;
  EXPECT_NE(survivor_log.find("regrouped under epoch"), std::string::npos) << survivor_log;
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());
}

// A copy of a fixture model in a directory of its own (a test may change its files), removed at the
// end.
struct ModelCopy {
  explicit ModelCopy(const std::string& fixture) {
    char pattern[] = "/tmp/heal_test_model.XXXXXX";
    dir = mkdtemp(pattern);
    fs::copy(kFixtures / fixture, dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  }
  ~ModelCopy() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  fs::path dir;
};

TEST_F(HealTest, HealTimeoutFailsTheStreamNamingTheSlotAndUnfitReplacementsAreRefused) {
  const ModelCopy model("llama3_rope");  // the harness takes an absolute path as the fixture
  Cluster cluster({model.dir.string(), 1, 2, {"--debug-step-delay-ms", "20"}}, {"--heal-timeout-seconds", "3"});
  ASSERT_TRUE(cluster.Start());
  const Golden golden = LoadGolden("llama3_rope");
  const int victim = WorkerAt(cluster, 0, 1);
  ASSERT_GE(victim, 0);
  std::string victim_id;
  const v1::ClusterStatus before = cluster.Status();
  for (const v1::WorkerStatus& w : before.workers()) {
    if (w.address() == cluster.worker_address(victim)) victim_id = w.worker_id();
  }
  const std::string name = "worker " + victim_id + " (node n0, stage 0, tp rank 1) is lost";
  const std::string slot = "slot (node n0, stage 0, tp rank 1)";

  // No replacement: after the heal timeout the stream ends, naming the worker and its slot.
  const auto start = Clock::now();
  const StreamRun run = StreamWith(cluster, TokenRequest(golden.prompt, 600), /*after=*/5,
                             [&] { cluster.worker(victim).Signal(SIGKILL); });
  const double seconds = SecondsSince(start);
  EXPECT_EQ(run.status.error_code(), grpc::StatusCode::UNAVAILABLE) << run.status.error_message();
  EXPECT_NE(run.status.error_message().find(name), std::string::npos) << run.status.error_message();
  EXPECT_NE(run.status.error_message().find(slot), std::string::npos) << run.status.error_message();
  EXPECT_NE(run.status.error_message().find("--heal-timeout-seconds"), std::string::npos)
      << run.status.error_message();
  // Well before the stream's own deadline (240 s): the heal timeout (3 s) ended it, not the client.
  EXPECT_LT(seconds, 200.0);
  EXPECT_LT(run.tokens.size(), 600u);
  EXPECT_EQ(cluster.Status().state(), "healing");
  EXPECT_EQ(cluster.HealthStatus(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // The one stream failed for the heal timeout; no heal has completed.
  const HealMetrics timed_out = ScrapeHealMetrics(cluster);
  EXPECT_EQ(timed_out.failed, 1);
  EXPECT_EQ(timed_out.resumed, 0);
  EXPECT_EQ(timed_out.heals, 0);
  EXPECT_EQ(timed_out.duration_count, 0);
  EXPECT_EQ(timed_out.state, "healing");
  // A new request is refused with the same news while the heal is past its timeout.
  const Streamed refused = Generate(cluster.client(), TokenRequest(golden.prompt, 4), std::chrono::seconds(30));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(refused.status.error_message().find(slot), std::string::npos) << refused.status.error_message();

  // Too little memory for the shard: refused, saying what it needs; the worker exits.
  const int small = cluster.AddWorker("n0", {"--memory-gb", "0.0001"});
  EXPECT_NE(cluster.worker(small).Wait(std::chrono::seconds(60)), 0);
  EXPECT_NE(Tail(cluster.worker(small).log()).find("cannot take " + slot + ": its shard needs"), std::string::npos)
      << Tail(cluster.worker(small).log());
  // Another node: not one of the group's (no slot there, and a spare there would never be used).
  const int stranger = cluster.AddWorker("n7");
  EXPECT_NE(cluster.worker(stranger).Wait(std::chrono::seconds(60)), 0);
  EXPECT_NE(Tail(cluster.worker(stranger).log()).find("node n7 is not one of its nodes (n0)"), std::string::npos)
      << Tail(cluster.worker(stranger).log());
  EXPECT_EQ(cluster.Status().state(), "healing");
  // Its own copy of the model differs from the coordinator's (here: config.json rewritten since the
  // coordinator started; elsewhere another machine's files): it does not load it, says what
  // differs, is let go (exit 1), and the slot stays open.
  const fs::path config = model.dir / "config.json";
  const std::string original = Tail(config, 1 << 20);
  std::ofstream(config, std::ios::app) << "\n";
  const int other_model = cluster.AddWorker("n0");
  EXPECT_EQ(cluster.worker(other_model).Wait(std::chrono::seconds(120)), 1) << Tail(cluster.worker(other_model).log());
  EXPECT_NE(Tail(cluster.worker(other_model).log(), 1 << 20)
                .find("this worker's copy is not the coordinator's model: config.json is "),
            std::string::npos)
      << Tail(cluster.worker(other_model).log());
  EXPECT_TRUE(WaitForLog(cluster, "is open again; waiting for a worker from node n0")) << cluster.Logs();
  EXPECT_EQ(cluster.Status().state(), "healing");
  std::ofstream(config, std::ios::trunc) << original;

  // A fitting replacement heals the group, which serves again.
  cluster.AddWorker("n0");
  ASSERT_TRUE(WaitForState(cluster, "serving")) << cluster.Logs();
  EXPECT_GE(cluster.Status().epoch(), 2u);
  // One heal, longer than the heal timeout it outlasted; nothing was held through it (the refused
  // request is not counted: it never waited for the heal).
  const HealMetrics healed = ScrapeHealMetrics(cluster);
  EXPECT_EQ(healed.heals, 1);
  EXPECT_EQ(healed.duration_count, 1);
  EXPECT_GT(healed.duration_sum, 3);
  EXPECT_EQ(healed.resumed, 0);
  EXPECT_EQ(healed.failed, 1);
  EXPECT_EQ(healed.state, "serving");
  const Streamed after = Generate(cluster.client(), TokenRequest(golden.prompt, 8), std::chrono::seconds(60));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.tokens, std::vector<int32_t>(golden.greedy.begin(), golden.greedy.begin() + 8));
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());
}

}  // namespace
}  // namespace shardserve
