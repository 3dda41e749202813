// What the files of `shardserve bench` share: cmd_bench.cc (flags, Run), bench_load.cc (the load
// generator), bench_report.cc (tables and JSON), bench_compare.cc (--compare: one local cluster per
// layout). Internal to those files; bench_stats.h holds the statistics.
#ifndef SHARDSERVE_TOOLS_CLI_BENCH_H_
#define SHARDSERVE_TOOLS_CLI_BENCH_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/cli/client.h"
#include "nlohmann/json.hpp"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tools/cli/bench_stats.h"
#include "tools/cli/local_cluster.h"

namespace shardserve::cli::bench {

using Clock = std::chrono::steady_clock;
// Keys in the order written, so that the JSON reads like the table.
using json = nlohmann::ordered_json;

// Set by SIGINT/SIGTERM (cmd_bench.cc); read by every thread (lock-free, so the handler may store to it).
extern std::atomic<bool> g_stop;

// ---- The load (bench_load.cc) -------------------------------------------------------------------

struct LoadConfig {
  std::string address;  // client.address, for the report
  ClientOptions client;
  bool open_loop = false;
  int64_t concurrency = 1;  // closed loop
  double request_rate = 0;  // open loop: requests/s; +inf: all at once
  int64_t num_requests = 64;
  int64_t input_len = 128;
  int64_t output_len = 128;
  double range_ratio = 0;
  uint64_t seed = 0;
  double temperature = 0;
  int64_t warmup = 2;
  double timeout_s = 600;
  // Multi-turn chat (closed loop only): > 0: the requests are conversations of chat_turns turns,
  // each stream running one conversation at a time. A conversation's first prompt is a system
  // prompt of system_prompt_len tokens (the same for every conversation) and a message of
  // input_len tokens; each next turn's prompt is the last prompt, its answer and a new message.
  int64_t chat_turns = 0;
  int64_t system_prompt_len = 0;
};

struct LoadResult {
  bool interrupted = false;
  double duration_s = 0;
  int64_t completed = 0;
  int64_t failed = 0;
  int64_t total_input_tokens = 0;   // of completed requests
  int64_t total_output_tokens = 0;  // of completed requests
  int64_t total_cached_tokens = 0;  // of completed requests: prompt tokens from the prefix cache
  LatencySummary ttft, itl, e2e;
  std::vector<std::pair<std::string, int64_t>> errors;  // distinct messages, first seen first, with counts
};

// What the server says about itself, for prompts and the length check.
struct ServedModel {
  std::string name;
  int64_t vocab_size = 0;
  int64_t max_model_len = 0;
  std::set<int32_t> eos;
};

// One benchmark against `c.address`: model info, prompts, warm-up, load.
struct BenchRun {
  ServedModel model;
  LoadResult load;
};

absl::StatusOr<BenchRun> Benchmark(const LoadConfig& c);

// ---- --compare (bench_compare.cc) ---------------------------------------------------------------

struct Layout {
  std::string name;  // as given: "tp2xpp2/serial"
  int64_t tp = 1;
  int64_t pp = 1;
  bool serial = false;
  bool prefix_caching = true;  // false: /no-prefix-caching (the coordinator's --no-prefix-caching)
};

// tpN, ppM, tpNxppM, each optionally followed by /serial and /no-prefix-caching (in any order).
absl::StatusOr<Layout> ParseLayout(const std::string& text);

struct CompareRun {
  Layout layout;
  std::string error;  // empty: the load ran
  BenchRun run;
  std::vector<std::string> worker_names;
  std::vector<int64_t> worker_peak_rss_bytes;  // start order: node0/0, node0/1, node1/0, ...
  std::vector<int64_t> worker_weight_bytes;    // by stage, then TP rank
  std::optional<v1::SchedulerStatus> scheduler;  // after the load
  double start_s = 0;                          // start until serving
  std::string address;                         // where the cluster served
};

struct CompareOptions {
  ClusterFlags cluster;  // worker_threads unset: DefaultWorkerThreads on cpu; --micro-batches: non-serial layouts only
  std::string log_dir;
};

// Starts a local cluster for `layout`, runs `load` against it, reads its workers' facts and stops it.
CompareRun RunLayout(const Layout& layout, const CompareOptions& o, LoadConfig load);

// ---- Reporting (bench_report.cc) ----------------------------------------------------------------

double PerSecond(double n, double s);
// The keys every run has (single run, and each of --compare's runs).
json ResultJson(const LoadConfig& c, const LoadResult& r);
std::string LoadLine(const LoadConfig& c);
void PrintTable(const LoadConfig& c, const BenchRun& run);
void PrintCompareTable(const LoadConfig& c, const std::vector<CompareRun>& runs);
json CompareJson(const LoadConfig& c, const std::vector<CompareRun>& runs);
// Writes `j` to `path` (nothing when it is empty); false, with a message, when it cannot.
bool WriteJsonOut(const std::string& path, const json& j);

}  // namespace shardserve::cli::bench

#endif  // SHARDSERVE_TOOLS_CLI_BENCH_H_
