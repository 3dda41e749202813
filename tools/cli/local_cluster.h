// A local cluster: one shardserve-coordinator and nodes x gpus-per-node shardserve-worker processes
// on this machine, each worker reporting a simulated node name ("node0", "node1", ...) so that the
// coordinator groups them exactly as it would real nodes. Used by `shardserve launch` (which serves
// until Ctrl-C) and `shardserve bench --compare` (one cluster per layout).
//
// Processes: every child gets SIGTERM if this process dies (PR_SET_PDEATHSIG), stays in this
// process's group (so a terminal's Ctrl-C reaches it too, and it stops itself), and logs stdout and
// stderr to a file in the log directory. The command lines are written to <log_dir>/commands.sh, one
// per process, shell-quoted. Stop() (and the destructor) sends SIGTERM, then SIGKILL after a grace
// period, and reaps every child; no child outlives a LocalCluster.
//
// Thread-safety: none; one thread owns a LocalCluster. Start() forks; the child runs only
// async-signal-safe calls before exec, so calling it from a process with other threads (gRPC) is
// safe.
#ifndef SHARDSERVE_TOOLS_CLI_LOCAL_CLUSTER_H_
#define SHARDSERVE_TOOLS_CLI_LOCAL_CLUSTER_H_

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/flags.h"
#include "base/resource_limits.h"
#include "security/tls.h"
#include "kernels/cuda/cuda_switches.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace shardserve::cli {

struct LocalClusterOptions {
  // Directory holding shardserve-coordinator and shardserve-worker.
  std::string bin_dir;
  // Hugging Face checkpoint directory (coordinator --model; the workers read the same path).
  std::string model;
  int64_t nodes = 1;          // pipeline stages
  int64_t gpus_per_node = 1;  // tensor-parallel ranks per stage
  // "cpu": every worker --device cpu; "cuda": worker g of each node --device cuda:g.
  std::string device = "cpu";
  // Where the coordinator serves clients and workers. Port 0: the coordinator picks a free port
  // (--port-file), and the workers are started once it is known; address() then has it.
  std::string address;
  // Log files (coordinator.log, worker-node<N>-<G>.log) and commands.sh; created if missing.
  std::string log_dir;
  // Prometheus /metrics: the coordinator on 127.0.0.1:base, worker k on base + 1 + k; 0: every
  // process picks a free port.
  int64_t metrics_port_base = 0;
  // The coordinator serves the OpenAI HTTP API on a free port of --http-host (--http-port-file in
  // the log directory); http_port() then has it, and a restarted coordinator keeps it. Otherwise
  // coordinator_flags say whether and where it serves HTTP.
  bool http_free_port = false;
  std::string log_format = "text";
  // Appended to the coordinator's and to every worker's command line as given ("--flag", "value").
  std::vector<std::string> coordinator_flags;
  std::vector<std::string> worker_flags;
  // How this process's health checks reach the coordinator: plaintext when empty; the CA (and a
  // client certificate) when the coordinator serves TLS (then its --tls-* are in coordinator_flags).
  TlsFiles client_tls;
  // Spare workers (worker --spare), spread over the nodes (spare k on node k % nodes, device
  // cuda:(gpus_per_node + k / nodes) on cuda); metrics after the workers'. Each takes a lost slot
  // of its node at once (docs/healing.md).
  int64_t spare_workers = 0;
  // How long the coordinator may take to write its port files (an address with port 0,
  // http_free_port).
  std::chrono::seconds listen_timeout{30};
};

// A child that exited on its own, reaped.
struct ExitedProcess {
  std::string name;      // "coordinator", "worker node1/0"
  std::string how;       // "exited with code 2", "killed by signal 9 (Killed)"
  std::string log;       // its log file
  std::string log_tail;  // the last 2000 bytes of it
  pid_t pid = -1;        // its process id, which launch logs with its end
};

class LocalCluster {
 public:
  // Starts the coordinator and the workers and returns without waiting for them to serve. On an
  // error every process already started is stopped and reaped before it returns.
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const LocalClusterOptions& options);

  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;
  ~LocalCluster() { Stop(std::chrono::seconds(10)); }

  // The address clients connect to (with the chosen port when the options had port 0).
  const std::string& address() const { return address_; }
  // The HTTP API's port with options.http_free_port; 0 otherwise.
  int http_port() const { return http_port_; }
  const LocalClusterOptions& options() const { return options_; }
  // "  coordinator      http://127.0.0.1:9400/metrics", one line per process, as launch prints them.
  const std::vector<std::string>& metrics_lines() const { return metrics_lines_; }
  // Processes started (coordinator + workers), running or not.
  size_t size() const { return children_.size(); }
  // The workers' pids in start order (node0/0, node0/1, node1/0, ...); -1 for a reaped one.
  std::vector<pid_t> WorkerPids() const;
  // Worker names in the same order ("node0/0", ...).
  std::vector<std::string> WorkerNames() const;

  // One health check (1 s deadline): is the coordinator SERVING?
  bool Serving();
  // Reaps a child that has exited, if any, and describes it.
  std::optional<ExitedProcess> ReapExited();
  // Starts the reaped worker `name` ("worker node1/0") again with its command line, its log
  // appended to. The coordinator gives it the lost slot of its node, or makes it a spare of its
  // node when a spare took the slot already (docs/healing.md).
  // FailedPrecondition when no reaped worker has that name.
  absl::Status RestartWorker(const std::string& name);
  // Starts the reaped coordinator again with its command line (on the port it had, also when the
  // options asked for port 0), its log appended to. The workers, which outlive it for their
  // --coordinator-grace-seconds, register again and are adopted (docs/healing.md).
  // FailedPrecondition when the coordinator has not exited and been reaped.
  absl::Status RestartCoordinator();
  // Polls until the coordinator serves. Fails if a process exits first (naming it, with the end of
  // its log), after `timeout`, or when *stop becomes true (Ctrl-C).
  absl::Status WaitUntilServing(std::chrono::seconds timeout, const std::atomic<bool>* stop);
  // SIGTERM to every running child, SIGKILL to those still running after `grace`; reaps all.
  // Idempotent.
  void Stop(std::chrono::seconds grace);

 private:
  struct Child {
    std::string name;  // "coordinator", "worker node1/0"
    pid_t pid = -1;    // -1 once reaped
    std::string log;
    bool worker = false;
    std::vector<std::string> argv;  // to restart it
  };

  explicit LocalCluster(LocalClusterOptions options) : options_(std::move(options)) {}
  absl::Status Spawn(const std::string& name, const std::vector<std::string>& argv, const std::string& log_name,
                     bool worker);
  // Starts worker `name` ("worker node0/1", "spare node1/3") for `node` on GPU `gpu` (device
  // cuda:gpu; cpu on CPU clusters), its metrics on 127.0.0.1:metrics_port, with --spare when
  // `spare`, then the options' worker flags; logs to <name with '-' for ' ' and '/'>.log.
  absl::Status SpawnWorker(const std::string& name, const std::string& node, int64_t gpu, int64_t metrics_port,
                           bool spare);
  // Starts the reaped child `name` (a worker when `worker`) again; see RestartWorker.
  absl::Status Restart(const std::string& name, bool worker);
  // Forks and execs `argv` with stdout and stderr to `log` (truncated, or appended to).
  static absl::StatusOr<pid_t> ForkExec(const std::vector<std::string>& argv, const std::string& log, bool append);

  const LocalClusterOptions options_;
  std::string address_;
  int http_port_ = 0;
  std::vector<std::string> metrics_lines_;
  std::vector<Child> children_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

// The scheduler flags of the coordinator (and --heal-timeout-seconds) that `launch` and `bench
// --compare` take and pass through unchanged, each only when given (so that the coordinator's
// defaults apply otherwise).
inline constexpr const char* kCoordinatorPassThroughFlags[] = {
    "max-num-seqs", "max-waiting-requests", "max-tokens-per-step", "num-kv-blocks", "micro-batches", "block-size",
    "heal-timeout-seconds", "num-speculative-tokens", "speculative-max-running"};

// CPU threads per CPU worker when --worker-threads is not given: the CPUs this process may use
// (base/resource_limits.h: its affinity, fewer under a CPU limit) shared out among the workers, at
// least one each, so that workers do not oversubscribe the machine. (The test harness,
// tests/cluster_harness.h, gives its workers the same.)
inline int64_t DefaultWorkerThreads(int64_t workers, int64_t cpus = UsableCpus()) {
  return std::max<int64_t>(1, cpus / std::max<int64_t>(1, workers));
}

// "" unless `workers` CPU workers on this machine of `threads` compute threads each (0: the
// worker's default, every CPU) run more threads than its `cpus` where fewer would fit
// (DefaultWorkerThreads); else a sentence for stderr naming the threads, the CPUs and the share.
// Past the CPUs, a worker's OpenMP threads that wait spin before they sleep, and the collectives
// of the other workers wait behind them (docs/performance.md, "TP and PP on one host").
inline std::string WorkerThreadsNote(int64_t workers, int64_t threads, int64_t cpus) {
  const int64_t each = threads > 0 ? threads : cpus;
  const int64_t share = DefaultWorkerThreads(workers, cpus);
  if (workers * each <= cpus || each <= share) return "";
  return absl::StrCat(workers, " worker", workers == 1 ? "" : "s", " of ", each, " compute thread",
                      each == 1 ? "" : "s", threads > 0 ? "" : " (--worker-threads 0: every CPU)", " run ",
                      workers * each, " threads on the ", cpus, " CPU", cpus == 1 ? "" : "s", " available here",
                      ": every step will take many times its time; --worker-threads ", share,
                      " (the CPUs shared out, the default) fits them");
}

// The flags `launch` and `bench --compare` share for the clusters they start, checked once here.
struct ClusterFlags {
  std::string model;                      // --model: a directory with config.json (default: the demo model)
  std::string device = "cpu";             // --device cpu|cuda
  int64_t ready_timeout_s = 300;          // --ready-timeout-seconds
  std::optional<int64_t> worker_threads;  // --worker-threads as given (0: the worker's default)
  std::optional<double> worker_memory_gb;  // --worker-memory-gb as given (0: the worker's default)
  // --worker-X V (matmul-dtype, collectives, dummy-weights) as the workers' --X V, and
  // --activation-quantization V as theirs under the same name, and the switches
  // --worker-no-cuda-... (kernels/cuda/cuda_switches.h) as their --no-cuda-... switches.
  std::vector<std::string> worker_flags;
  // --max-model-len, kCoordinatorPassThroughFlags, --quantization, --load-format, --dummy-seed and
  // --speculative as given, in that order:
  // {"max-num-seqs", "8"}.
  std::vector<std::pair<std::string, std::string>> coordinator_flags;
  bool prefix_caching = true;  // off: --no-prefix-caching, passed to the coordinator
  bool async_scheduling = true;  // off: --no-async-scheduling, passed to the coordinator
  bool expert_parallel = false;  // --expert-parallel, passed to the coordinator
  bool adaptive_speculative_tokens = false;  // --adaptive-speculative-tokens, passed to the coordinator
  // --draft-model, absolute: passed to the coordinator with --speculative draft (and by bench
  // --compare's /draft layouts).
  std::string draft_model;

  // Each worker's --threads for `workers` workers on this machine: --worker-threads as given, else
  // on cpu DefaultWorkerThreads, on cuda 0 (the worker's default).
  int64_t WorkerThreads(int64_t workers) const {
    return worker_threads.value_or(device == "cpu" ? DefaultWorkerThreads(workers) : 0);
  }
  // Each worker's --memory-gb for `workers` workers on this machine: --worker-memory-gb as given,
  // else on cpu this process's UsableMemoryBytes() shared out among them (each holds its own shard
  // and KV cache), on cuda 0 (the worker's default: its GPU's).
  double WorkerMemoryGb(int64_t workers) const {
    return worker_memory_gb.value_or(
        device == "cpu" ? static_cast<double>(UsableMemoryBytes()) /
                              static_cast<double>(std::max<int64_t>(1, workers)) / 1073741824.0
                        : 0);
  }
  // The workers' --threads and --memory-gb (WorkerThreads, WorkerMemoryGb), each where not 0.
  std::vector<std::string> WorkerArgs(int64_t workers) const {
    std::vector<std::string> args;
    if (const int64_t threads = WorkerThreads(workers); threads > 0) args = {"--threads", std::to_string(threads)};
    if (const double gb = WorkerMemoryGb(workers); gb > 0) {
      args.insert(args.end(), {"--memory-gb", absl::StrFormat("%.3f", gb)});
    }
    return args;
  }
  // WorkerThreadsNote of WorkerThreads(workers) on cpu, on this machine's UsableCpus(); "" on cuda.
  std::string WorkerThreadsNote(int64_t workers) const {
    return device == "cpu" ? cli::WorkerThreadsNote(workers, WorkerThreads(workers), UsableCpus()) : "";
  }

  // The flags read, for Flags::Parse: with a value, and switches.
  static std::set<std::string> Names();
  static std::set<std::string> Switches() {
    return WithCudaSwitches(
        {"no-prefix-caching", "no-async-scheduling", "expert-parallel", "adaptive-speculative-tokens"}, "worker-");
  }
  // The coordinator's command-line arguments for them: coordinator_flags as --name value, then
  // --no-prefix-caching and --no-async-scheduling when off, --expert-parallel and
  // --adaptive-speculative-tokens when on. `skip`: a flag name left out (its value set elsewhere).
  std::vector<std::string> CoordinatorArgs(const std::string& skip = "") const;
  // InvalidArgument naming the flag for a bad value.
  static absl::StatusOr<ClusterFlags> Parse(const Flags& f);
};

// Peak resident set size of a live process: VmHWM in /proc/PID/status, in bytes.
absl::StatusOr<int64_t> PeakRssBytes(pid_t pid);

}  // namespace shardserve::cli

#endif  // SHARDSERVE_TOOLS_CLI_LOCAL_CLUSTER_H_
