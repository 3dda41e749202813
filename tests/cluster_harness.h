// Real shardserve-coordinator and shardserve-worker processes on 127.0.0.1 for tests
// (cluster_test, metrics_test): a Process in a process group of its own that dies with the test,
// a Cluster of one coordinator (which RestartCoordinator can replace) and nodes x gpus_per_node
// workers on free ports, and Generate()
// through the client API. Every wait is bounded; destructors kill and reap every child.
//
// Sanitizer builds (tools/sanitize.sh): SHARDSERVE_TEST_TIME_SCALE (a float, default 1) multiplies
// every deadline the harness waits for a process (Process::Wait, the cluster's start, a stream's
// deadline, ...; a test's own wait loops use ScaledSeconds), for binaries that run slower under
// instrumentation (ThreadSanitizer 5-15x). A sanitizer report in a child's log (its stderr) fails
// the test when the child is reaped (~Process), whether the child exited on it (halt_on_error),
// was killed later, or ran on.
//
// The including target defines SHARDSERVE_SOURCE_DIR, SHARDSERVE_COORDINATOR_BIN and
// SHARDSERVE_WORKER_BIN. Single-threaded use, except that client() (a gRPC stub) and Generate() may
// serve several threads at once.
#ifndef SHARDSERVE_TESTS_CLUSTER_HARNESS_H_
#define SHARDSERVE_TESTS_CLUSTER_HARNESS_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
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
#include "tools/cli/local_cluster.h"

namespace shardserve {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

inline const fs::path kFixtures = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models";

inline double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// SHARDSERVE_TEST_TIME_SCALE, read once: 1 when unset; a value that is not a finite number > 0 ends
// the test program naming it (a deadline silently left unscaled would fail as a hang instead).
inline double TimeScale() {
  static const double scale = [] {
    const char* text = std::getenv("SHARDSERVE_TEST_TIME_SCALE");
    if (text == nullptr || *text == '\0') return 1.0;
    char* end = nullptr;
    const double value = std::strtod(text, &end);
    if (*end != '\0' || !std::isfinite(value) || value <= 0) {
      std::fprintf(stderr, "SHARDSERVE_TEST_TIME_SCALE='%s': expected a number > 0 (1 = unscaled)\n", text);
      std::exit(2);
    }
    return value;
  }();
  return scale;
}
// A deadline the test waits for a process, times SHARDSERVE_TEST_TIME_SCALE.
inline double ScaledSeconds(double seconds) { return seconds * TimeScale(); }
template <typename Rep, typename Period>
std::chrono::milliseconds Scaled(std::chrono::duration<Rep, Period> timeout) {
  return std::chrono::milliseconds(static_cast<int64_t>(
      std::chrono::duration<double, std::milli>(timeout).count() * TimeScale()));
}

// The first line of `log` where a sanitizer report begins (ThreadSanitizer's, AddressSanitizer's,
// LeakSanitizer's or UndefinedBehaviorSanitizer's), or empty when there is none.
inline std::string SanitizerReport(const fs::path& log) {
  static const char* const kMarkers[] = {"WARNING: ThreadSanitizer:", "ERROR: AddressSanitizer:",
                                         "ERROR: LeakSanitizer:", ": runtime error: "};
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    for (const char* marker : kMarkers) {
      if (line.find(marker) != std::string::npos) return line;
    }
  }
  return "";
}

// The HOST:PORT that follows `key` on the first line of `log` that has it, up to `end`; empty when
// no line has it yet. The services bind port 0 and log the port they got: a port picked here and
// released could be taken by another process's port 0 before the service binds it (seen in CI: a
// worker's gRPC port had become another worker's /metrics port).
inline std::string LoggedAddress(const fs::path& log, const std::string& key, char end) {
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find(key);
    if (at == std::string::npos) continue;
    const size_t begin = at + key.size();
    return line.substr(begin, line.find(end, begin) - begin);
  }
  return "";
}

inline std::string Tail(const fs::path& file, size_t bytes = 3000) {
  std::ifstream in(file);
  std::stringstream s;
  s << in.rdbuf();
  const std::string text = s.str();
  return text.size() > bytes ? "..." + text.substr(text.size() - bytes) : text;
}

// A child process in a process group of its own, with stdout and stderr in a log file. It gets
// SIGKILL if this test process dies; the destructor kills and reaps it, and fails the test when
// the log has a sanitizer report (SanitizerReport).
class Process {
 public:
  Process(std::vector<std::string> argv, fs::path log) : log_(std::move(log)) {
    // Everything the child needs is built before fork: after it, only async-signal-safe calls.
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    std::vector<std::string> env_strings = {"OPENBLAS_NUM_THREADS=1"};
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::string(*e).rfind("OPENBLAS_NUM_THREADS=", 0) != 0) env_strings.push_back(*e);
    }
    std::vector<char*> env;
    for (std::string& e : env_strings) env.push_back(e.data());
    env.push_back(nullptr);
    const std::string log_path = log_.string();
    const pid_t parent = getpid();

    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the parent died before prctl
      const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
      }
      execve(args[0], args.data(), env.data());
      _exit(127);
    }
    if (pid_ > 0) setpgid(pid_, pid_);  // also here, so that a signal right after fork finds the group
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() {
    Kill();
    const std::string report = SanitizerReport(log_);
    if (!report.empty()) {
      ADD_FAILURE() << "a sanitizer report in " << log_.filename().string() << " (exit status " << exit_code_
                    << "): " << report << "\n" << Tail(log_, 12000);
    }
  }

  pid_t pid() const { return pid_; }
  const fs::path& log() const { return log_; }
  // Sends `sig` to the process's group.
  void Signal(int sig) {
    if (running()) kill(-pid_, sig);
  }
  bool running() {
    Reap(WNOHANG);
    return pid_ > 0 && !exited_;
  }
  // Waits up to `timeout` (times SHARDSERVE_TEST_TIME_SCALE) for the process to exit; its exit
  // status (WEXITSTATUS, or 128 + signal), or -1 when it is still running.
  int Wait(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + Scaled(timeout);
    while (running() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return exited_ ? exit_code_ : -1;
  }
  void Kill() {
    if (!running()) return;
    kill(-pid_, SIGKILL);
    Reap(0);
  }

 private:
  void Reap(int flags) {
    if (pid_ <= 0 || exited_) return;
    int status = 0;
    if (waitpid(pid_, &status, flags) == pid_) {
      exited_ = true;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      // No test aborts a process of ours: SIGABRT is a failed assertion, or a sanitizer report
      // (tools/sanitize.sh sets abort_on_error for ASan, LeakSanitizer and UBSan), which fails the
      // test even where it does not look at this process's exit.
      if (WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT) {
        ADD_FAILURE() << log_.filename() << ": the process aborted (SIGABRT):\n" << Tail(log_);
      }
    }
  }

  const fs::path log_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int exit_code_ = -1;
};

struct ClusterSpecForTest {
  std::string fixture;  // a directory of tests/fixtures/models, or an absolute path to a model
  int nodes = 1;          // PP
  int gpus_per_node = 1;  // TP
  std::vector<std::string> worker_flags;
};

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
    const fs::path port_file = dir_ / "port";
    std::vector<std::string> coordinator_argv = {
        SHARDSERVE_COORDINATOR_BIN, "--model", (kFixtures / spec_.fixture).string(), "--listen", "127.0.0.1:0",
        "--nodes", std::to_string(spec_.nodes), "--gpus-per-node", std::to_string(spec_.gpus_per_node),
        "--port-file", port_file.string(), "--metrics-listen", "127.0.0.1:0"};
    coordinator_argv.insert(coordinator_argv.end(), coordinator_flags_.begin(), coordinator_flags_.end());
    coordinator_argv_ = coordinator_argv;
    coordinator_ = std::make_unique<Process>(std::move(coordinator_argv), dir_ / "coordinator.log");
    while (!fs::exists(port_file)) {
      if (!coordinator_->running() || SecondsSince(start) > ScaledSeconds(30)) {
        ADD_FAILURE() << "the coordinator did not start listening:\n" << Logs();
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::ifstream(port_file) >> port_;
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
    const fs::path port_file = dir_ / ("port" + std::to_string(old_coordinators_.size() + 1));
    for (size_t k = 0; k + 1 < argv.size(); ++k) {
      if (argv[k] == "--port-file") argv[k + 1] = port_file.string();
    }
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
