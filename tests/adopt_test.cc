// A restarted coordinator adopts the workers of the one that died (docs/healing.md "The coordinator
// restarts"): real shardserve-coordinator and shardserve-worker processes on 127.0.0.1
// (tests/cluster_harness.h).
//
// - TP2 and TP2 x PP2, idle: the coordinator is SIGKILLed and a new one started on its port; every
//   worker process lives on, registers again with the shard it holds and is adopted into its slot
//   without a reload (each worker logged one load and one adoption; the new coordinator one
//   "adopting into slot" line per worker; the group's epoch is the old one + 1); a greedy request
//   then gives exactly the tokens of the undisturbed run before the restart.
// - A new coordinator whose plan differs (another --max-num-seqs: other step limits, so other
//   buffers): the workers are told to drop their shard and load the slot's (logged, saying what
//   differs), and the group serves the same tokens.
// - A worker whose coordinator dies and none comes back exits once its
//   --coordinator-grace-seconds are over, saying so.
//
// Every process runs in its own process group and dies with the test; every wait is bounded;
// teardown kills and reaps every child.
#include <signal.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tests/cluster_harness.h"

namespace shardserve {
namespace {

// Lines of `log` that contain `text`.
int CountLines(const fs::path& log, const std::string& text) {
  std::ifstream in(log);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(text) != std::string::npos;
  return n;
}

constexpr int kTokens = 32;

struct Layout {
  int nodes, gpus_per_node;
};

class AdoptTest : public ::testing::TestWithParam<Layout> {};

TEST_P(AdoptTest, RestartedCoordinatorAdoptsEveryWorkerWithoutReloadAndServesTheSameTokens) {
  const Layout layout = GetParam();
  Cluster cluster({"llama3_rope", layout.nodes, layout.gpus_per_node, {}});
  ASSERT_TRUE(cluster.Start());
  const int workers = layout.nodes * layout.gpus_per_node;
  const Golden golden = LoadGolden("llama3_rope");
  const v1::GenerateRequest request = TokenRequest(golden.prompt, kTokens);
  const Streamed reference = Generate(cluster.client(), request, std::chrono::seconds(120));
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  ASSERT_EQ(reference.tokens.size(), static_cast<size_t>(kTokens));
  ASSERT_EQ(cluster.Status().epoch(), 1u);

  ASSERT_TRUE(cluster.RestartCoordinator());
  ASSERT_TRUE(cluster.WaitForServing(120)) << "the new coordinator did not adopt the workers:\n" << cluster.Logs();

  const v1::ClusterStatus status = cluster.Status();
  EXPECT_EQ(status.state(), "serving");
  EXPECT_EQ(status.epoch(), 2u) << "the first epoch of the new coordinator follows the workers' 1";
  EXPECT_EQ(CountLines(cluster.coordinator().log(), "adopting into slot"), workers) << cluster.Logs();
  EXPECT_EQ(CountLines(cluster.coordinator().log(), "adopted (kept its weights"), workers) << cluster.Logs();
  ASSERT_EQ(cluster.num_workers(), workers);
  for (int i = 0; i < workers; ++i) {
    EXPECT_TRUE(cluster.worker(i).running()) << "worker " << i;
    // No reload: the one load of the first coordinator, then the adoption.
    EXPECT_EQ(CountLines(cluster.worker(i).log(), "loaded in"), 1) << Tail(cluster.worker(i).log());
    EXPECT_EQ(CountLines(cluster.worker(i).log(), "adopted by the coordinator"), 1) << Tail(cluster.worker(i).log());
    EXPECT_EQ(CountLines(cluster.worker(i).log(), "is gone; keeping the shard"), 1) << Tail(cluster.worker(i).log());
  }

  const Streamed after = Generate(cluster.client(), request, std::chrono::seconds(120));
  ASSERT_TRUE(after.status.ok()) << after.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(after.tokens, reference.tokens) << cluster.Logs();
}

INSTANTIATE_TEST_SUITE_P(Layouts, AdoptTest, ::testing::Values(Layout{1, 2}, Layout{2, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return info.param.nodes == 1 ? std::string("Tp2") : std::string("Tp2Pp2");
                         });

TEST(AdoptOtherPlanTest, NewCoordinatorWithOtherLimitsMakesTheWorkersReload) {
  Cluster cluster({"llama3_rope", 1, 2, {}}, {"--max-num-seqs", "8"});
  ASSERT_TRUE(cluster.Start());
  const Golden golden = LoadGolden("llama3_rope");
  const v1::GenerateRequest request = TokenRequest(golden.prompt, kTokens);
  const Streamed reference = Generate(cluster.client(), request, std::chrono::seconds(120));
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();

  ASSERT_TRUE(cluster.RestartCoordinator({"--max-num-seqs", "4"}));
  ASSERT_TRUE(cluster.WaitForServing(120)) << cluster.Logs();
  EXPECT_EQ(CountLines(cluster.coordinator().log(), "adopting into slot"), 0) << cluster.Logs();
  EXPECT_EQ(CountLines(cluster.coordinator().log(), "max seqs per step 8 (held) vs 4 (wanted)): it drops it"), 2)
      << cluster.Logs();
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(cluster.worker(i).running());
    EXPECT_EQ(CountLines(cluster.worker(i).log(), "dropping the shard it holds"), 1) << Tail(cluster.worker(i).log());
    EXPECT_EQ(CountLines(cluster.worker(i).log(), "loaded in"), 2) << Tail(cluster.worker(i).log());
  }
  const Streamed after = Generate(cluster.client(), request, std::chrono::seconds(120));
  ASSERT_TRUE(after.status.ok()) << after.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(after.tokens, reference.tokens);
}

TEST(AdoptGraceTest, WorkerExitsWhenNoCoordinatorComesBackWithinItsGrace) {
  Cluster cluster({"llama3_rope", 1, 1, {"--coordinator-grace-seconds", "2"}});
  ASSERT_TRUE(cluster.Start());
  cluster.coordinator().Signal(SIGKILL);
  // 2 s of grace; generous for a loaded machine, and bounded.
  const int code = cluster.worker(0).Wait(std::chrono::seconds(90));
  EXPECT_EQ(code, 1) << Tail(cluster.worker(0).log());
  EXPECT_EQ(CountLines(cluster.worker(0).log(), "is gone; keeping the shard"), 1) << Tail(cluster.worker(0).log());
  EXPECT_GE(CountLines(cluster.worker(0).log(), "took this worker back within 2s (--coordinator-grace-seconds); exiting"), 1)
      << Tail(cluster.worker(0).log());
}

}  // namespace
}  // namespace shardserve
