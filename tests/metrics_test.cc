// The Prometheus metrics of a real cluster (docs/metrics.md): a coordinator and TP=2 x PP=2
// workers on 127.0.0.1 generate tokens; the test then scrapes every process's /metrics over HTTP
// and checks that
// - every metric docs/metrics.md names is exposed by the service whose table names it (the names
//   are read from the doc, so the doc cannot drift from the code), and
// - the counters moved with the work: generated tokens == tokens streamed, prompt tokens == the
//   prompts' tokens, TTFT count == requests, one finished{reason="length"} and one
//   requests_total{code="OK"} per request, every worker up, and every worker counted the steps
//   the requests needed and the collectives its place in the layout implies.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tests/cluster_harness.h"

namespace shardserve {
namespace {

bool Exposes(const std::map<std::string, double>& samples, const std::string& name) {
  for (const auto& [key, value] : samples) {
    const std::string base = key.substr(0, key.find('{'));
    if (base == name || base == name + "_count") return true;
  }
  return false;
}

// The metric names of docs/metrics.md: the first backquoted word of each table row, by section
// ("Coordinator" or "Worker", from the "## " heading above the table).
std::map<std::string, std::vector<std::string>> DocumentedMetrics() {
  std::ifstream in(fs::path(SHARDSERVE_SOURCE_DIR) / "docs/metrics.md");
  std::map<std::string, std::vector<std::string>> out;
  std::string section;
  const std::regex row(R"(^\|\s*`(shardserve_[a-z0-9_]+)`)");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("## ", 0) == 0) section = line.substr(3, line.find(' ', 3) - 3);
    std::smatch m;
    if (std::regex_search(line, m, row)) out[section].push_back(m[1]);
  }
  return out;
}

TEST(MetricsTest, DocListsBothServices) {
  std::map<std::string, std::vector<std::string>> doc = DocumentedMetrics();
  EXPECT_GE(doc["Coordinator"].size(), 13u);
  EXPECT_GE(doc["Worker"].size(), 5u);
}

TEST(MetricsTest, EveryDocumentedMetricIsExposedAndCountersMove) {
  const std::string fixture = "llama3_rope";
  Cluster cluster({fixture, /*nodes=*/2, /*gpus_per_node=*/2, {}});
  ASSERT_TRUE(cluster.Start());

  // Two requests, each to max_tokens (ignore_eos): finish reason length.
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
  const int kRequests = 2, kMaxTokens = 6;
  size_t streamed = 0;
  for (int i = 0; i < kRequests; ++i) {
    Streamed s = Generate(cluster.client(), TokenRequest(prompt, kMaxTokens));
    ASSERT_TRUE(s.status.ok()) << s.status.error_message() << "\n" << cluster.Logs();
    streamed += s.tokens.size();
  }
  ASSERT_EQ(streamed, static_cast<size_t>(kRequests * kMaxTokens));

  const std::map<std::string, std::vector<std::string>> doc = DocumentedMetrics();
  const std::string model = "model=\"" + fixture + "\"";

  // ---- The coordinator ----
  const std::string coordinator_text = HttpGetMetrics(cluster.metrics_address());
  ASSERT_FALSE(coordinator_text.empty()) << "no /metrics at " << cluster.metrics_address() << "\n" << cluster.Logs();
  const std::map<std::string, double> c = ParseSamples(coordinator_text);
  for (const std::string& name : doc.at("Coordinator")) {
    // (a series per position once a guess was accepted there, with --speculative only:
    // tests/cluster_test.cc ClusterSpeculationTest scrapes it)
    if (name == "shardserve_spec_accepted_by_position_total") continue;
    EXPECT_TRUE(Exposes(c, name)) << name << " is in docs/metrics.md but not exposed by the coordinator";
  }
  EXPECT_EQ(Sum(c, "shardserve_generated_tokens_total", {model}), static_cast<double>(streamed));
  EXPECT_EQ(Sum(c, "shardserve_prompt_tokens_total", {model}), static_cast<double>(kRequests * prompt.size()));
  EXPECT_EQ(Sum(c, "shardserve_time_to_first_token_seconds_count", {model}), kRequests);
  EXPECT_EQ(Sum(c, "shardserve_inter_token_latency_seconds_count"), kRequests * (kMaxTokens - 1));
  EXPECT_EQ(Sum(c, "shardserve_request_duration_seconds_count"), kRequests);
  EXPECT_EQ(Sum(c, "shardserve_request_queue_seconds_count"), kRequests);
  EXPECT_EQ(Sum(c, "shardserve_requests_finished_total", {"reason=\"length\""}), kRequests);
  EXPECT_EQ(Sum(c, "shardserve_requests_total", {"code=\"OK\""}), kRequests);
  EXPECT_EQ(Sum(c, "shardserve_requests_running"), 0);
  EXPECT_EQ(Sum(c, "shardserve_requests_waiting"), 0);
  EXPECT_GT(Sum(c, "shardserve_kv_blocks_total"), 0);
  EXPECT_EQ(Sum(c, "shardserve_worker_up"), cluster.num_workers());

  // A bad request is counted by its code.
  v1::GenerateRequest bad = TokenRequest(prompt, kMaxTokens);
  bad.mutable_sampling()->set_temperature(-1);
  EXPECT_EQ(Generate(cluster.client(), bad).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Sum(ParseSamples(HttpGetMetrics(cluster.metrics_address())), "shardserve_requests_total",
                {"code=\"INVALID_ARGUMENT\""}),
            1);

  // ---- Every worker, at the address it registered ----
  const v1::ClusterStatus status = cluster.Status();
  ASSERT_EQ(status.workers_size(), cluster.num_workers());
  for (const v1::WorkerStatus& w : status.workers()) {
    SCOPED_TRACE("worker " + w.worker_id() + " stage " + std::to_string(w.stage()) + " rank " +
                 std::to_string(w.tp_rank()));
    ASSERT_FALSE(w.metrics_address().empty());
    const std::map<std::string, double> m = ParseSamples(HttpGetMetrics(w.metrics_address()));
    ASSERT_FALSE(m.empty()) << "no /metrics at " << w.metrics_address();
    for (const std::string& name : doc.at("Worker")) {
      // (a mixture-of-experts model's only: tests/cluster_test.cc ClusterExpertParallelTest scrapes it)
      if (name == "shardserve_worker_expert_rows_total") continue;
      EXPECT_TRUE(Exposes(m, name)) << name << " is in docs/metrics.md but not exposed by the worker";
    }
    const std::vector<std::string> ids = {model, "node=\"" + w.node() + "\"",
                                          "stage=\"" + std::to_string(w.stage()) + "\"",
                                          "rank=\"" + std::to_string(w.tp_rank()) + "\""};
    // One prefill step (the prompt fits one step) and max_tokens - 1 decode steps per request.
    EXPECT_EQ(Sum(m, "shardserve_worker_steps_total", ids), kRequests * kMaxTokens);
    EXPECT_EQ(Sum(m, "shardserve_worker_step_seconds_count", {"phase=\"prefill\""}), kRequests);
    EXPECT_EQ(Sum(m, "shardserve_worker_step_seconds_count", {"phase=\"decode\""}), kRequests * (kMaxTokens - 1));
    EXPECT_GT(Sum(m, "shardserve_worker_weight_bytes", ids), 0);
    // The plan's memory by item: the weights as planned, byte for byte; the CPU worker's own memory
    // beside its buffers within the plan's process item.
    std::vector<std::string> weights_item = ids;
    weights_item.push_back("item=\"weights\"");
    EXPECT_EQ(Sum(m, "shardserve_worker_memory_planned_bytes", weights_item),
              Sum(m, "shardserve_worker_weight_bytes", ids));
    std::vector<std::string> process_item = ids;
    process_item.push_back("item=\"process\"");
    const double process = Sum(m, "shardserve_worker_process_memory_bytes", ids);
    EXPECT_GT(process, 0);
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
    EXPECT_LE(process, Sum(m, "shardserve_worker_memory_planned_bytes", process_item));
#endif
    // TP = 2: every step all-reduces; PP = 2: stage 0 sends, stage 1 receives.
    EXPECT_GT(Sum(m, "shardserve_worker_collective_seconds_count", {"op=\"all_reduce\""}), 0);
    EXPECT_GT(Sum(m, "shardserve_worker_collective_bytes_total", {"op=\"all_reduce\""}), 0);
    const char* hop = w.stage() == 0 ? "op=\"send\"" : "op=\"recv\"";
    EXPECT_EQ(Sum(m, "shardserve_worker_collective_seconds_count", {hop}), kRequests * kMaxTokens);
    EXPECT_GT(Sum(m, "shardserve_worker_collective_bytes_total", {hop}), 0);
  }
}

}  // namespace
}  // namespace shardserve
