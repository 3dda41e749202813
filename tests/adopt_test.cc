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
// - TP2 and TP2 x PP2 on the demo model, SIGKILLed while two gRPC streams and one HTTP (SSE) stream
//   are in flight: each gRPC stream ends with UNAVAILABLE and the SSE stream ends without its
//   `data: [DONE]`, within seconds of the kill (their own deadlines are minutes away); the workers,
//   caught mid-step, are adopted by the restarted coordinator without a reload; new gRPC and HTTP
//   requests get the undisturbed run's greedy tokens and text.
//
// Every process runs in its own process group and dies with the test; every wait is bounded;
// teardown kills and reaps every child.
#include <signal.h>

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
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

std::string LayoutName(const ::testing::TestParamInfo<Layout>& info) {
  return info.param.nodes == 1 ? "Tp2" : "Tp2Pp2";
}

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
                         LayoutName);

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

// ---- A coordinator SIGKILLed with streams in flight -------------------------------------------

// One streamed /v1/completions request (greedy, ignore_eos) on the coordinator's HTTP API, read as
// it arrives; `chunks` counts the events with text so far (another thread waits on it).
struct SseRun {
  int status = 0;          // the HTTP status, 0 when no response came
  std::string text;        // the concatenated text of the chunks
  bool done = false;       // "data: [DONE]" came
  std::string error;       // the transport error (httplib's), empty when none
  Clock::time_point ended;
};

SseRun StreamCompletion(int port, const std::string& prompt, int max_tokens, std::atomic<int>* chunks,
                        std::chrono::seconds timeout) {
  httplib::Client client("127.0.0.1", port);
  const auto deadline = Scaled(timeout);
  client.set_read_timeout(std::chrono::duration_cast<std::chrono::seconds>(deadline));
  SseRun out;
  std::string pending;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = nlohmann::json{{"model", "demo"}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0},
                            {"ignore_eos", true}, {"stream", true}}
                 .dump();
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& res) {
    out.status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    pending.append(data, n);
    // Events end at a blank line: "data: {json}" or "data: [DONE]".
    for (size_t end; (end = pending.find("\n\n")) != std::string::npos; pending.erase(0, end + 2)) {
      const std::string event = pending.substr(0, end);
      if (event.rfind("data: ", 0) != 0) continue;
      if (event == "data: [DONE]") {
        out.done = true;
        continue;
      }
      const nlohmann::json j = nlohmann::json::parse(event.substr(6), nullptr, false);
      if (!j.is_object() || !j.contains("choices") || j["choices"].empty()) continue;
      const nlohmann::json& text = j["choices"][0]["text"];
      if (text.is_string() && !text.get<std::string>().empty()) {
        out.text += text.get<std::string>();
        if (chunks != nullptr) ++*chunks;
      }
    }
    return true;
  };
  const httplib::Result res = client.send(req);
  if (!res) out.error = httplib::to_string(res.error());
  out.ended = Clock::now();
  return out;
}

// A greedy gRPC stream whose token count another thread watches.
struct WatchedStream {
  std::atomic<int> tokens{0};
  grpc::Status status;
  Clock::time_point ended;
};

void StreamGrpc(Cluster& cluster, const v1::GenerateRequest& request, WatchedStream* out) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + Scaled(std::chrono::seconds(240)));
  auto reader = cluster.client()->Generate(&context, request);
  v1::GenerateResponse message;
  while (reader->Read(&message)) out->tokens += message.token_ids_size();
  out->status = reader->Finish();
  out->ended = Clock::now();
}

class AdoptInFlightTest : public ::testing::TestWithParam<Layout> {};

TEST_P(AdoptInFlightTest, KilledWithStreamsInFlightFailsThemAtOnceAndTheRestartedOneAdoptsAndServes) {
  const Layout layout = GetParam();
  const std::string demo = (fs::path(SHARDSERVE_SOURCE_DIR) / "models/demo").string();
  // 20 ms a step: a stream of kLong tokens lasts well past the kill, however fast the machine.
  Cluster cluster({demo, layout.nodes, layout.gpus_per_node, {"--debug-step-delay-ms", "20"}, /*http=*/true});
  ASSERT_TRUE(cluster.Start());
  const int workers = layout.nodes * layout.gpus_per_node;
  const v1::GenerateRequest request = TokenRequest({5, 17, 42, 99, 7}, kTokens);
  const Streamed reference = Generate(cluster.client(), request, std::chrono::seconds(120));
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  ASSERT_EQ(reference.tokens.size(), static_cast<size_t>(kTokens));
  const std::string prompt = "Once upon a time";
  const SseRun http_reference = StreamCompletion(cluster.http_port(), prompt, kTokens, nullptr, std::chrono::seconds(120));
  ASSERT_EQ(http_reference.status, 200) << http_reference.error << "\n" << cluster.Logs();
  ASSERT_TRUE(http_reference.done) << http_reference.error;
  ASSERT_FALSE(http_reference.text.empty());

  // Two gRPC streams and one SSE stream, each far from its end (and its deadline) at the kill.
  constexpr int kLong = 400;  // with the prompt, within the demo model's 512 positions
  constexpr int kStreaming = 5;  // tokens each has received before the kill
  WatchedStream grpc_streams[2];
  std::atomic<int> sse_chunks{0};
  SseRun sse;
  std::vector<std::thread> clients;
  for (WatchedStream& s : grpc_streams) {
    clients.emplace_back([&cluster, &s] { StreamGrpc(cluster, TokenRequest({5, 17, 42, 99, 7}, kLong), &s); });
  }
  clients.emplace_back([&] { sse = StreamCompletion(cluster.http_port(), prompt, kLong, &sse_chunks, std::chrono::seconds(240)); });
  const auto started = Clock::now();
  while ((grpc_streams[0].tokens < kStreaming || grpc_streams[1].tokens < kStreaming || sse_chunks < kStreaming) &&
         SecondsSince(started) < ScaledSeconds(120)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const bool all_streaming =
      grpc_streams[0].tokens >= kStreaming && grpc_streams[1].tokens >= kStreaming && sse_chunks >= kStreaming;
  const auto killed = Clock::now();
  cluster.coordinator().Signal(SIGKILL);
  for (std::thread& t : clients) t.join();
  ASSERT_TRUE(all_streaming) << "the streams did not all get going before the kill\n" << cluster.Logs();

  // Each client learns at once: its connection is gone. Seconds, not its 240 s deadline.
  for (const WatchedStream& s : grpc_streams) {
    EXPECT_EQ(s.status.error_code(), grpc::StatusCode::UNAVAILABLE) << s.status.error_message();
    EXPECT_LT(s.tokens, kLong);
    EXPECT_LT(std::chrono::duration<double>(s.ended - killed).count(), ScaledSeconds(10));
  }
  EXPECT_EQ(sse.status, 200);
  EXPECT_FALSE(sse.done) << "the SSE stream ended as if complete";
  EXPECT_LT(std::chrono::duration<double>(sse.ended - killed).count(), ScaledSeconds(10)) << sse.error;
  std::printf("[ killed   ] streams ended %.3f s and %.3f s (gRPC: %s), %.3f s (SSE: %s) after the kill\n",
              std::chrono::duration<double>(grpc_streams[0].ended - killed).count(),
              std::chrono::duration<double>(grpc_streams[1].ended - killed).count(),
              grpc_streams[0].status.error_message().c_str(),
              std::chrono::duration<double>(sse.ended - killed).count(), sse.error.c_str());

  // The restarted coordinator adopts every worker, caught mid-step, without a reload.
  ASSERT_TRUE(cluster.RestartCoordinator());
  ASSERT_TRUE(cluster.WaitForServing(120)) << "the new coordinator did not adopt the workers:\n" << cluster.Logs();
  EXPECT_EQ(cluster.Status().epoch(), 2u);
  EXPECT_EQ(CountLines(cluster.coordinator().log(), "adopting into slot"), workers) << cluster.Logs();
  EXPECT_EQ(Sum(cluster.Metrics(), "shardserve_workers_adopted_total"), workers);
  for (int i = 0; i < workers; ++i) {
    EXPECT_TRUE(cluster.worker(i).running()) << "worker " << i;
    EXPECT_EQ(CountLines(cluster.worker(i).log(), "loaded in"), 1) << Tail(cluster.worker(i).log());
    EXPECT_EQ(CountLines(cluster.worker(i).log(), "adopted by the coordinator"), 1) << Tail(cluster.worker(i).log());
  }

  // New requests, on both APIs, get the undisturbed run's tokens and text.
  const Streamed after = Generate(cluster.client(), request, std::chrono::seconds(120));
  ASSERT_TRUE(after.status.ok()) << after.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(after.tokens, reference.tokens) << cluster.Logs();
  const SseRun http_after = StreamCompletion(cluster.http_port(), prompt, kTokens, nullptr, std::chrono::seconds(120));
  EXPECT_EQ(http_after.status, 200) << http_after.error << "\n" << cluster.Logs();
  EXPECT_TRUE(http_after.done) << http_after.error;
  EXPECT_EQ(http_after.text, http_reference.text);
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());
}

INSTANTIATE_TEST_SUITE_P(Layouts, AdoptInFlightTest, ::testing::Values(Layout{1, 2}, Layout{2, 2}),
                         LayoutName);

}  // namespace
}  // namespace shardserve
