// Real shardserve-coordinator and shardserve-worker processes on 127.0.0.1 for tests
// (cluster_test, metrics_test): a Cluster of one coordinator (which RestartCoordinator can replace)
// and nodes x gpus_per_node workers on free ports, each a Process of tests/process_harness.h (which
// says how deadlines are scaled and how a sanitizer report in a child fails the test),
// Generate() through the client API, and the samples of a /metrics page (HttpGetMetrics,
// ParseSamples, Sum; Cluster::Metrics for the coordinator's). Every wait is bounded; destructors
// kill and reap every child.
//
// The including target defines SHARDSERVE_SOURCE_DIR, SHARDSERVE_COORDINATOR_BIN and
// SHARDSERVE_WORKER_BIN. Single-threaded use, except that client() (a gRPC stub) and Generate() may
// serve several threads at once.
#ifndef SHARDSERVE_TESTS_CLUSTER_HARNESS_H_
#define SHARDSERVE_TESTS_CLUSTER_HARNESS_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tests/golden.h"
#include "tests/process_harness.h"
#include "tools/cli/local_cluster.h"

namespace shardserve {

inline const fs::path kFixtures = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models";

struct ClusterSpecForTest {
  std::string fixture;  // a directory of tests/fixtures/models, or an absolute path to a model
  int nodes = 1;          // PP
  int gpus_per_node = 1;  // TP
  std::vector<std::string> worker_flags;
  bool http = false;  // the coordinator serves the OpenAI HTTP API too (--http-port), on http_port()
};

// GET http://<host:port>/metrics with a bare socket (HTTP/1.0: the server closes when done). The
// body, or "" on any error.
inline std::string HttpGetMetrics(const std::string& address) {
  const size_t colon = address.rfind(':');
  const std::string host = address.substr(0, colon);
  const int port = std::atoi(address.substr(colon + 1).c_str());
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1 ||
      connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return "";
  }
  std::string response;
  char buf[65536];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) response.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || response.find(" 200 ") == std::string::npos || body == std::string::npos) {
    return "";
  }
  return response.substr(body + 4);
}

// Every sample of an exposition: "name{labels}" (labels as the server prints them) -> value.
inline std::map<std::string, double> ParseSamples(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    out[line.substr(0, space)] = std::strtod(line.c_str() + space + 1, nullptr);
  }
  return out;
}

// The sum of the samples of `name` (exactly; for a histogram pass name_count) whose labels
// contain every `needle` ("reason=\"length\"").
inline double Sum(const std::map<std::string, double>& samples, const std::string& name,
                  const std::vector<std::string>& needles = {}) {
  double sum = 0;
  for (const auto& [key, value] : samples) {
    const std::string base = key.substr(0, key.find('{'));
    if (base != name) continue;
    bool all = true;
    for (const std::string& n : needles) all = all && key.find(n) != std::string::npos;
    if (all) sum += value;
  }
  return sum;
}

// A coordinator and nodes x gpus_per_node workers ("n0", "n1", ...: node i is stage i).
class Cluster {
 public:
  explicit Cluster(ClusterSpecForTest spec) : Cluster(std::move(spec), {}) {}
  // `coordinator_flags` are appended to the coordinator's command line (--max-num-seqs 2 ...).
  Cluster(ClusterSpecForTest spec, std::vector<std::string> coordinator_flags)
      : spec_(std::move(spec)), coordinator_flags_(std::move(coordinator_flags)) {
    char pattern[] = "/tmp/cluster_test.XXXXXX";
    dir_ = mkdtemp(pattern);
  }
  ~Cluster() {
    // Each ~Process kills and reaps its process and fails the test on a sanitizer report in its
    // log: before the logs may be removed below.
    workers_.clear();
    coordinator_.reset();
    old_coordinators_.clear();
    if (::testing::Test::HasFailure()) {
      std::printf("[ logs     ] kept in %s\n", dir_.c_str());
    } else {
      std::error_code ec;
      fs::remove_all(dir_, ec);
    }
  }

  // Starts everything and waits until the coordinator's health is SERVING. Failures (with the
  // processes' logs) are reported through gtest; returns whether it got there.
  bool Start() {
    const auto start = Clock::now();
    if (!StartCoordinator()) return false;
    for (int i = 0; i < spec_.nodes * spec_.gpus_per_node; ++i) {
      AddWorker("n" + std::to_string(i / spec_.gpus_per_node));
    }
    while (HealthStatus() != grpc::health::v1::HealthCheckResponse::SERVING) {
      const bool worker_exited = std::any_of(workers_.begin(), workers_.end(), [](auto& w) { return !w->running(); });
      if (!coordinator_->running() || worker_exited || SecondsSince(start) > ScaledSeconds(90)) {
        ADD_FAILURE() << "the cluster did not reach SERVING" << (worker_exited ? " (a worker exited)" : "") << ":\n"
                      << Logs();
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    start_seconds_ = SecondsSince(start);
    return true;
  }

  // Starts only the coordinator and waits until it listens (the test then starts the workers with
  // AddWorker). Failures are reported through gtest; returns whether it got there.
  bool StartCoordinator() {
    const auto start = Clock::now();
    const fs::path port_file = dir_ / "port", http_port_file = dir_ / "http_port";
    // Every server on a free port the coordinator binds and names (the HTTP port's file is written
    // before the gRPC one's).
    coordinator_argv_ = {SHARDSERVE_COORDINATOR_BIN, "--model", (kFixtures / spec_.fixture).string(), "--listen",
                         "127.0.0.1:0", "--nodes", std::to_string(spec_.nodes), "--gpus-per-node",
                         std::to_string(spec_.gpus_per_node), "--port-file", port_file.string(), "--metrics-listen",
                         "127.0.0.1:0"};
    if (spec_.http) coordinator_argv_.insert(coordinator_argv_.end(), {"--http-port-file", http_port_file.string()});
    coordinator_argv_.insert(coordinator_argv_.end(), coordinator_flags_.begin(), coordinator_flags_.end());
    // 4,096 KV blocks a worker unless the test sets its own: 65,536 tokens, more than the streams
    // of any case hold at once. The default (up to 256 MiB of cache on a CPU worker, 32,768 blocks
    // of the llama fixtures) is zeroed at load: half a second of the kernel clearing pages at each
    // worker's start, most of the suite's system time (docs/testing.md).
    if (std::find(coordinator_argv_.begin(), coordinator_argv_.end(), "--num-kv-blocks") == coordinator_argv_.end()) {
      coordinator_argv_.insert(coordinator_argv_.end(), {"--num-kv-blocks", "4096"});
    }
    coordinator_ = std::make_unique<Process>(coordinator_argv_, dir_ / "coordinator.log");
    while (!fs::exists(port_file) && coordinator_->running() && SecondsSince(start) < ScaledSeconds(30)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!fs::exists(port_file)) {
      ADD_FAILURE() << "the coordinator did not start listening:\n" << Logs();
      return false;
    }
    std::ifstream(port_file) >> port_;
    if (spec_.http && !(std::ifstream(http_port_file) >> http_port_)) {
      ADD_FAILURE() << "the coordinator did not write its HTTP port:\n" << Logs();
      return false;
    }
    metrics_address_ = LoggedAddress(coordinator_->log(), "metrics on http://", '/');  // logged before the port file
    address_ = "127.0.0.1:" + std::to_string(port_);
    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    client_ = v1::InferenceService::NewStub(channel_);
    health_ = grpc::health::v1::Health::NewStub(channel_);
    return true;
  }

  // Starts one more worker process for `node` (Start() starts the group's; later ones are
  // replacements for lost slots, docs/healing.md), with the spec's worker flags, then `extra` (a
  // flag given twice: the last wins). Returns its index for worker(i).
  int AddWorker(const std::string& node, const std::vector<std::string>& extra = {}) {
    const int i = static_cast<int>(workers_.size());
    std::vector<std::string> argv = {SHARDSERVE_WORKER_BIN, "--coordinator", address_, "--node", node,
                                     "--listen", "127.0.0.1:0", "--memory-gb", "4"};
    argv.insert(argv.end(), spec_.worker_flags.begin(), spec_.worker_flags.end());
    argv.insert(argv.end(), extra.begin(), extra.end());
    if (std::find(argv.begin(), argv.end(), "--threads") == argv.end()) {
      // Each worker its share of the cores, as `shardserve launch` gives them: more compute
      // threads than cores, across processes, spin against each other.
      const int64_t threads = cli::DefaultWorkerThreads(spec_.nodes * spec_.gpus_per_node);
      argv.insert(argv.end(), {"--threads", std::to_string(threads)});
    }
    workers_.push_back(
        std::make_unique<Process>(std::move(argv), dir_ / ("worker" + std::to_string(i) + "-" + node + ".log")));
    return i;
  }

  // SIGKILLs the coordinator (the workers outlive it for their --coordinator-grace-seconds;
  // docs/healing.md) and starts a new one on the same port with the same flags, then `extra` (a
  // flag given twice: the last wins), logging to coordinator-<k>.log. Returns once it listens (it
  // serves once it has adopted the workers); false, reported through gtest, when it does not
  // within 60 s (scaled).
  bool RestartCoordinator(const std::vector<std::string>& extra = {}) {
    coordinator_->Signal(SIGKILL);
    coordinator_->Wait(std::chrono::seconds(10));
    std::vector<std::string> argv = coordinator_argv_;
    for (size_t k = 0; k + 1 < argv.size(); ++k) {
      if (argv[k] == "--listen") argv[k + 1] = address_;
    }
    const std::string n = std::to_string(old_coordinators_.size() + 1);
    const fs::path port_file = dir_ / ("port" + n);
    for (size_t k = 0; k + 1 < argv.size(); ++k) {
      if (argv[k] == "--port-file") argv[k + 1] = port_file.string();
      if (argv[k] == "--http-port-file") argv[k + 1] = (dir_ / ("http_port" + n)).string();
    }
    if (spec_.http) argv.insert(argv.end(), {"--http-port", std::to_string(http_port_)});  // the same HTTP port
    argv.insert(argv.end(), extra.begin(), extra.end());
    old_coordinators_.push_back(std::move(coordinator_));
    const fs::path log = dir_ / ("coordinator-" + std::to_string(old_coordinators_.size() + 1) + ".log");
    const auto start = Clock::now();
    // The port was the old process's: binding it again may fail for a moment (then try again).
    while (true) {
      coordinator_ = std::make_unique<Process>(argv, log);
      while (!fs::exists(port_file) && coordinator_->running() && SecondsSince(start) < ScaledSeconds(60)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (fs::exists(port_file)) break;
      if (SecondsSince(start) >= ScaledSeconds(60)) {
        ADD_FAILURE() << "the restarted coordinator did not listen on " << address_ << ":\n" << Logs();
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
    metrics_address_ = LoggedAddress(coordinator_->log(), "metrics on http://", '/');
    return true;
  }

  // Every sample of the coordinator's /metrics now (ParseSamples); empty when it does not answer.
  std::map<std::string, double> Metrics() { return ParseSamples(HttpGetMetrics(metrics_address_)); }

  // Waits up to `seconds` (scaled) for the coordinator's health to be SERVING.
  bool WaitForServing(double seconds) {
    const auto start = Clock::now();
    while (HealthStatus() != grpc::health::v1::HealthCheckResponse::SERVING) {
      if (!coordinator_->running() || SecondsSince(start) > ScaledSeconds(seconds)) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return true;
  }

  // The coordinator's overall grpc.health.v1 status (UNKNOWN when the call fails).
  grpc::health::v1::HealthCheckResponse::ServingStatus HealthStatus() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + Scaled(std::chrono::seconds(2)));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    if (!health_->Check(&context, request, &response).ok()) return grpc::health::v1::HealthCheckResponse::UNKNOWN;
    return response.status();
  }

  v1::ClusterStatus Status() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + Scaled(std::chrono::seconds(5)));
    v1::ClusterStatus status;
    EXPECT_TRUE(client_->GetClusterStatus(&context, v1::GetClusterStatusRequest(), &status).ok());
    return status;
  }

  // Every process's log, for failure messages.
  std::string Logs() {
    std::string out;
    for (auto& c : old_coordinators_) out += "---- " + c->log().filename().string() + " ----\n" + Tail(c->log()) + "\n";
    out += "---- coordinator ----\n" + Tail(coordinator_->log()) + "\n";
    for (auto& w : workers_) out += "---- " + w->log().filename().string() + " ----\n" + Tail(w->log()) + "\n";
    return out;
  }

  v1::InferenceService::Stub* client() { return client_.get(); }
  const std::string& address() const { return address_; }
  // The OpenAI HTTP API's port on 127.0.0.1 (spec.http; the same after RestartCoordinator); 0 without.
  int http_port() const { return http_port_; }
  // The coordinator's Prometheus /metrics host:port (the workers report theirs in Status()).
  const std::string& metrics_address() const { return metrics_address_; }
  const fs::path& dir() const { return dir_; }
  Process& coordinator() { return *coordinator_; }
  Process& worker(int i) { return *workers_[i]; }
  int num_workers() const { return static_cast<int>(workers_.size()); }
  // Worker i's gRPC address, from its log once it has registered ("registered (cpu, listening on
  // HOST:PORT, ..."); empty before that.
  std::string worker_address(int i) const { return LoggedAddress(workers_[i]->log(), ", listening on ", ','); }
  double start_seconds() const { return start_seconds_; }

 private:
  const ClusterSpecForTest spec_;
  const std::vector<std::string> coordinator_flags_;
  fs::path dir_;
  int port_ = 0;
  int http_port_ = 0;
  std::string address_;
  std::string metrics_address_;
  std::unique_ptr<Process> coordinator_;
  std::vector<std::string> coordinator_argv_;
  std::vector<std::unique_ptr<Process>> old_coordinators_;  // killed by RestartCoordinator
  std::vector<std::unique_ptr<Process>> workers_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::InferenceService::Stub> client_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  double start_seconds_ = 0;
};

// Fixture `fixture`'s golden.json (tests/golden.h), under tests/fixtures/models.
inline Golden LoadGolden(const std::string& fixture) { return ReadGolden(kFixtures / fixture); }

inline v1::GenerateRequest TokenRequest(const std::vector<int32_t>& prompt, int max_tokens) {
  v1::GenerateRequest r;
  r.mutable_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
  r.mutable_sampling()->set_max_tokens(max_tokens);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

struct Streamed {
  grpc::Status status;
  std::vector<v1::GenerateResponse> messages;
  std::vector<int32_t> tokens;
  double seconds = 0;
};

// One streamed Generate call; `timeout` (scaled) is its deadline.
inline Streamed Generate(v1::InferenceService::Stub* client, const v1::GenerateRequest& request,
                  std::chrono::seconds timeout = std::chrono::seconds(60)) {
  const auto start = Clock::now();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + Scaled(timeout));
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = client->Generate(&context, request);
  Streamed out;
  v1::GenerateResponse message;
  while (reader->Read(&message)) {
    out.tokens.insert(out.tokens.end(), message.token_ids().begin(), message.token_ids().end());
    out.messages.push_back(message);
  }
  out.status = reader->Finish();
  out.seconds = SecondsSince(start);
  return out;
}

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_CLUSTER_HARNESS_H_
