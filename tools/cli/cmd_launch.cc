// shardserve launch: a local cluster. Starts one coordinator and nodes x gpus-per-node workers on
// this machine as separate processes (each worker reports a simulated node name, so the
// coordinator groups them exactly as it would real nodes), waits until the coordinator serves,
// prints where to connect, and stops every process on Ctrl-C or SIGTERM.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tools/cli/client.h"
#include "tools/cli/command.h"
#include "base/flags.h"
#include "tools/cli/local_cluster.h"

namespace shardserve::cli {
namespace {

namespace fs = std::filesystem;

constexpr char kUsage[] =
    "usage: shardserve launch [--model DIR] [--nodes N] [--gpus-per-node G] [--device cpu|cuda]\n"
    "                         [--address HOST:PORT] [--max-model-len L] [--log-dir DIR] [--ready-timeout-seconds S]\n"
    "                         [--metrics-port-base P] [--log-format text|json] [--worker-threads N]\n"
    "                         [--max-num-seqs N] [--max-waiting-requests N] [--max-tokens-per-step T]\n"
    "                         [--num-kv-blocks N] [--micro-batches K] [--block-size B]\n"
    "                         [--worker-matmul-dtype auto|f32|bf16] [--quantization none|int8]\n"
    "                         [--load-format auto|dummy] [--dummy-seed N] [--no-prefix-caching]\n"
    "  Starts a coordinator and N x G workers on this machine (default 2 x 2 on cpu, serving the embedded\n"
    "  demo model) and serves on --address (default localhost:50051; port 0: a free port, printed) until\n"
    "  Ctrl-C or SIGTERM, which stop every process it started. Each process logs to a file in --log-dir\n"
    "  (--log-format: text or json); commands.sh there holds their command lines.\n"
    "  Prometheus /metrics on 127.0.0.1: the coordinator on port P (default 9400), the workers on\n"
    "  P+1, P+2, ... (docs/metrics.md); P = 0: each process picks a free port (see its log and\n"
    "  shardserve status).\n"
    "  --worker-threads      CPU threads of each worker (worker --threads); default on cpu: the cores\n"
    "                        divided by the number of workers, at least 1; 0: the worker's default\n"
    "  --worker-matmul-dtype  cpu: the products' precision (worker --matmul-dtype): auto (default:\n"
    "                        bf16 for a bf16 checkpoint on a CPU with bf16 instructions, else f32),\n"
    "                        f32, or bf16 (faster, half the weight memory, logits ~1e-2 from f32's)\n"
    "  --max-num-seqs, --max-waiting-requests, --max-tokens-per-step, --num-kv-blocks, --micro-batches,\n"
    "  --block-size, --no-prefix-caching  the coordinator's scheduler flags, passed through when given\n"
    "                        (shardserve-coordinator --help)\n"
    "  --quantization        the coordinator's: int8 stores the workers' linear-layer weights in int8\n"
    "                        (one scale per output channel, quantized at load; cpu only for now)\n"
    "  --load-format, --dummy-seed  the coordinator's: dummy makes the weights from config.json and the\n"
    "                        seed (default 0), each worker its own slice; --model may hold only\n"
    "                        config.json (then prompts are token ids)\n";

volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

int Run(const std::vector<std::string>& args) {
  std::set<std::string> with_value = ClusterFlags::Names();
  with_value.insert({"nodes", "gpus-per-node", "address", "log-dir", "metrics-port-base", "log-format"});
  std::set<std::string> switches = ClusterFlags::Switches();
  switches.insert("help");
  absl::StatusOr<Flags> flags = Flags::Parse(args, with_value, switches);
  if (!flags.ok()) {
    std::fprintf(stderr, "shardserve launch: %s\n%s", std::string(flags.status().message()).c_str(), kUsage);
    return 2;
  }
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  absl::StatusOr<int64_t> nodes = flags->GetInt("nodes", 2), gpus = flags->GetInt("gpus-per-node", 2);
  if (!nodes.ok() || !gpus.ok() || *nodes < 1 || *gpus < 1 || *nodes * *gpus > 64) {
    std::fprintf(stderr, "shardserve launch: --nodes and --gpus-per-node must be positive (at most 64 workers)\n");
    return 2;
  }
  const absl::StatusOr<int64_t> metrics_base = flags->GetInt("metrics-port-base", 9400);
  if (!metrics_base.ok() || *metrics_base < 0 || *metrics_base + *nodes * *gpus > 65535) {
    std::fprintf(stderr, "shardserve launch: --metrics-port-base must be 0 or a port with room for every worker after it\n");
    return 2;
  }
  const std::string log_format = flags->Get("log-format", "text");
  if (log_format != "text" && log_format != "json") {
    std::fprintf(stderr, "shardserve launch: --log-format must be text or json, got '%s'\n", log_format.c_str());
    return 2;
  }
  const absl::StatusOr<ClusterFlags> cluster_flags = ClusterFlags::Parse(*flags);
  if (!cluster_flags.ok()) {
    std::fprintf(stderr, "shardserve launch: %s\n", std::string(cluster_flags.status().message()).c_str());
    return 2;
  }
  const std::string& device = cluster_flags->device;
  const int64_t ready_timeout = cluster_flags->ready_timeout_s;
  LocalClusterOptions options;
  options.bin_dir = fs::read_symlink("/proc/self/exe").parent_path().string();
  options.model = cluster_flags->model;
  options.nodes = *nodes;
  options.gpus_per_node = *gpus;
  options.device = device;
  options.address = flags->Get("address", kDefaultAddress);
  options.log_dir = flags->Get("log-dir", absl::StrCat(fs::temp_directory_path().string(), "/shardserve-", getpid()));
  options.metrics_port_base = *metrics_base;
  options.log_format = log_format;
  options.coordinator_flags = cluster_flags->CoordinatorArgs();
  // --threads for every worker: given, or on cpu the cores shared out among the workers; 0 leaves
  // it to the worker.
  const int64_t worker_threads =
      cluster_flags->worker_threads.value_or(device == "cpu" ? DefaultWorkerThreads(*nodes * *gpus) : 0);
  if (worker_threads > 0) options.worker_flags = {"--threads", std::to_string(worker_threads)};
  options.worker_flags.insert(options.worker_flags.end(), cluster_flags->worker_flags.begin(),
                              cluster_flags->worker_flags.end());

  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
  if (!cluster.ok()) {
    // Start has stopped and reaped whatever it had started.
    std::fprintf(stderr, "shardserve launch: %s\n", std::string(cluster.status().message()).c_str());
    return 1;
  }
  const std::string& address = (*cluster)->address();
  std::printf("shardserve launch: coordinator + %lld workers (%lld node(s) x %lld), model %s, logs in %s\n",
              static_cast<long long>(*nodes * *gpus), static_cast<long long>(*nodes), static_cast<long long>(*gpus),
              options.model.c_str(), options.log_dir.c_str());
  if (*metrics_base == 0) {
    std::printf("shardserve launch: Prometheus metrics on free ports (each process logs its own)\n");
  } else {
    std::printf("shardserve launch: Prometheus metrics:\n");
    for (const std::string& line : (*cluster)->metrics_lines()) std::printf("%s\n", line.c_str());
  }
  std::fflush(stdout);

  const auto ready_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(ready_timeout);
  bool ready = false;
  int exit_code = 0;
  while (!g_stop) {
    if (std::optional<ExitedProcess> dead = (*cluster)->ReapExited()) {
      std::fprintf(stderr, "shardserve launch: %s %s; last lines of %s:\n%s\n", dead->name.c_str(), dead->how.c_str(),
                   dead->log.c_str(), dead->log_tail.c_str());
      if (!ready || dead->name == "coordinator") {
        exit_code = 1;
        break;  // a cluster that cannot start, or lost its coordinator, is torn down
      }
      std::fprintf(stderr, "shardserve launch: the coordinator refuses requests until the group is whole again\n");
    }
    if (!ready) {
      if ((*cluster)->Serving()) {
        ready = true;
        std::printf("shardserve launch: ready. Connect to %s (shardserve generate --prompt \"...\"; shardserve status).\n"
                    "Ctrl-C stops the cluster.\n",
                    address.c_str());
        std::fflush(stdout);
      } else if (std::chrono::steady_clock::now() > ready_deadline) {
        std::fprintf(stderr, "shardserve launch: not ready after %lld s; see the logs in %s\n",
                     static_cast<long long>(ready_timeout), options.log_dir.c_str());
        exit_code = 1;
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::printf("shardserve launch: stopping %zu processes\n", (*cluster)->size());
  (*cluster)->Stop(std::chrono::seconds(10));
  return exit_code;
}

const CommandRegistration kRegistration({"launch", "start a local cluster (coordinator + workers)", Run});

}  // namespace
}  // namespace shardserve::cli
