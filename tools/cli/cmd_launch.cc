// shardserve launch: a local cluster. Starts one coordinator and nodes x gpus-per-node workers on
// this machine as separate processes (each worker reports a simulated node name, so the
// coordinator groups them exactly as it would real nodes), waits until the coordinator serves,
// prints where to connect, and stops every process on Ctrl-C or SIGTERM.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tools/cli/client.h"
#include "tools/cli/command.h"
#include "tools/cli/flags.h"

namespace shardserve::cli {
namespace {

namespace fs = std::filesystem;

constexpr char kUsage[] =
    "usage: shardserve launch [--model DIR] [--nodes N] [--gpus-per-node G] [--device cpu|cuda]\n"
    "                         [--address HOST:PORT] [--max-model-len L] [--log-dir DIR] [--ready-timeout-seconds S]\n"
    "                         [--metrics-port-base P] [--log-format text|json]\n"
    "  Starts a coordinator and N x G workers on this machine (default 2 x 2 on cpu, serving the embedded\n"
    "  demo model) and serves on --address (default localhost:50051) until Ctrl-C or SIGTERM, which stop\n"
    "  every process it started. Each process logs to a file in --log-dir (--log-format: text or json).\n"
    "  Prometheus /metrics on 127.0.0.1: the coordinator on port P (default 9400), the workers on\n"
    "  P+1, P+2, ... (docs/metrics.md); P = 0: each process picks a free port (see its log and\n"
    "  shardserve status).\n";

volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

struct Child {
  std::string name;  // "coordinator", "worker node1/0"
  pid_t pid = -1;
  std::string log;
};

// Starts `argv` with stdout and stderr to `log`. The child gets SIGTERM if this process dies, so
// no process outlives the launcher even if it is killed.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& log) {
  int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot open log ", log, ": ", std::strerror(errno)));
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);  // the launcher died before prctl took effect
    dup2(fd, 1);
    dup2(fd, 2);
    execv(cargv[0], cargv.data());
    std::fprintf(stderr, "exec %s: %s\n", cargv[0], std::strerror(errno));
    _exit(127);
  }
  ::close(fd);
  return pid;
}

// SIGTERM to all, then SIGKILL to whoever is still there after `grace`; reaps everyone.
void StopAll(std::vector<Child>& children, std::chrono::seconds grace) {
  for (Child& c : children) {
    if (c.pid > 0) kill(c.pid, SIGTERM);
  }
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (Child& c : children) {
    while (c.pid > 0) {
      int status;
      pid_t r = waitpid(c.pid, &status, WNOHANG);
      if (r == c.pid || (r < 0 && errno == ECHILD)) {
        c.pid = -1;
      } else if (std::chrono::steady_clock::now() > deadline) {
        kill(c.pid, SIGKILL);
        waitpid(c.pid, &status, 0);
        c.pid = -1;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  }
}

// Reaps any child that exited; returns the first one found, or nullptr.
Child* ReapExited(std::vector<Child>& children, int* status) {
  for (Child& c : children) {
    if (c.pid > 0 && waitpid(c.pid, status, WNOHANG) == c.pid) {
      c.pid = -1;
      return &c;
    }
  }
  return nullptr;
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  return "stopped";
}

bool CoordinatorServing(grpc::health::v1::Health::Stub* health) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  grpc::health::v1::HealthCheckResponse resp;
  return health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok() &&
         resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

std::string TailOf(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return "";
  std::fseek(f, 0, SEEK_END);
  long size = std::ftell(f);
  std::fseek(f, size > 2000 ? size - 2000 : 0, SEEK_SET);
  std::string s(2000, '\0');
  s.resize(std::fread(s.data(), 1, s.size(), f));
  std::fclose(f);
  return s;
}

int Run(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(
      args, {"model", "nodes", "gpus-per-node", "device", "address", "max-model-len", "log-dir", "ready-timeout-seconds",
             "metrics-port-base", "log-format"},
      {"help"});
  if (!flags.ok()) {
    std::fprintf(stderr, "shardserve launch: %s\n%s", std::string(flags.status().message()).c_str(), kUsage);
    return 2;
  }
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  absl::StatusOr<int64_t> nodes = flags->GetInt("nodes", 2), gpus = flags->GetInt("gpus-per-node", 2),
                          ready_timeout = flags->GetInt("ready-timeout-seconds", 300);
  if (!nodes.ok() || !gpus.ok() || !ready_timeout.ok() || *nodes < 1 || *gpus < 1 || *nodes * *gpus > 64) {
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
  const std::string device = flags->Get("device", "cpu");
  if (device != "cpu" && device != "cuda") {
    std::fprintf(stderr, "shardserve launch: --device must be cpu or cuda, got '%s'\n", device.c_str());
    return 2;
  }
  const std::string model = flags->Get("model", SHARDSERVE_DEMO_MODEL_DIR);
  if (!fs::exists(fs::path(model) / "config.json")) {
    std::fprintf(stderr, "shardserve launch: %s has no config.json (give a Hugging Face checkpoint directory)\n",
                 model.c_str());
    return 2;
  }
  const std::string address = flags->Get("address", kDefaultAddress);
  const std::string log_dir = flags->Get("log-dir", absl::StrCat(fs::temp_directory_path().string(), "/shardserve-", getpid()));
  std::error_code ec;
  fs::create_directories(log_dir, ec);
  if (ec) {
    std::fprintf(stderr, "shardserve launch: cannot create log dir %s: %s\n", log_dir.c_str(), ec.message().c_str());
    return 1;
  }
  const fs::path bin = fs::read_symlink("/proc/self/exe").parent_path();

  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  std::vector<Child> children;
  auto start = [&](const std::string& name, const std::vector<std::string>& argv, const std::string& log_name) {
    const std::string log = (fs::path(log_dir) / log_name).string();
    absl::StatusOr<pid_t> pid = Spawn(argv, log);
    if (!pid.ok()) {
      std::fprintf(stderr, "shardserve launch: starting %s: %s\n", name.c_str(), std::string(pid.status().message()).c_str());
      return false;
    }
    children.push_back({name, *pid, log});
    return true;
  };

  std::vector<std::string> coord = {(bin / "shardserve-coordinator").string(), "--model", model, "--listen", address,
                                    "--nodes", std::to_string(*nodes), "--gpus-per-node", std::to_string(*gpus),
                                    "--metrics-listen", absl::StrCat("127.0.0.1:", *metrics_base),
                                    "--log-format", log_format};
  // Port `base + k`, or 0 (a free one) for every process when the base is 0.
  auto metrics_port = [&](int64_t k) { return *metrics_base == 0 ? 0 : *metrics_base + k; };
  std::vector<std::string> metrics_lines = {absl::StrCat("  coordinator      http://127.0.0.1:", metrics_port(0), "/metrics")};
  if (flags->Has("max-model-len")) {
    coord.push_back("--max-model-len");
    coord.push_back(flags->Get("max-model-len"));
  }
  bool ok = start("coordinator", coord, "coordinator.log");
  for (int64_t n = 0; ok && n < *nodes; ++n) {
    for (int64_t g = 0; ok && g < *gpus; ++g) {
      const std::string node = absl::StrCat("node", n);
      const std::string dev = device == "cpu" ? "cpu" : absl::StrCat("cuda:", g);
      const int64_t port = metrics_port(1 + n * *gpus + g);  // consecutive after the coordinator's
      ok = start(absl::StrCat("worker ", node, "/", g),
                 {(bin / "shardserve-worker").string(), "--coordinator", address, "--node", node, "--device", dev,
                  "--metrics-listen", absl::StrCat("127.0.0.1:", port), "--log-format", log_format},
                 absl::StrCat("worker-", node, "-", g, ".log"));
      metrics_lines.push_back(absl::StrCat("  worker ", node, "/", g, "  http://127.0.0.1:", port, "/metrics"));
    }
  }
  std::printf("shardserve launch: coordinator + %lld workers (%lld node(s) x %lld), model %s, logs in %s\n",
              static_cast<long long>(*nodes * *gpus), static_cast<long long>(*nodes), static_cast<long long>(*gpus),
              model.c_str(), log_dir.c_str());
  if (*metrics_base == 0) {
    std::printf("shardserve launch: Prometheus metrics on free ports (each process logs its own)\n");
  } else {
    std::printf("shardserve launch: Prometheus metrics:\n");
    for (const std::string& line : metrics_lines) std::printf("%s\n", line.c_str());
  }
  std::fflush(stdout);

  auto health = grpc::health::v1::Health::NewStub(ConnectToCoordinator(address));
  const auto ready_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(*ready_timeout);
  bool ready = false;
  int exit_code = 0;
  while (ok && !g_stop) {
    int status;
    if (Child* dead = ReapExited(children, &status)) {
      std::fprintf(stderr, "shardserve launch: %s %s; last lines of %s:\n%s\n", dead->name.c_str(),
                   DescribeExit(status).c_str(), dead->log.c_str(), TailOf(dead->log).c_str());
      if (!ready || dead->name == "coordinator") {
        exit_code = 1;
        break;  // a cluster that cannot start, or lost its coordinator, is torn down
      }
      std::fprintf(stderr, "shardserve launch: the coordinator refuses requests until the group is whole again\n");
    }
    if (!ready) {
      if (CoordinatorServing(health.get())) {
        ready = true;
        std::printf("shardserve launch: ready. Connect to %s (shardserve generate --prompt \"...\"; shardserve status).\n"
                    "Ctrl-C stops the cluster.\n",
                    address.c_str());
        std::fflush(stdout);
      } else if (std::chrono::steady_clock::now() > ready_deadline) {
        std::fprintf(stderr, "shardserve launch: not ready after %lld s; see the logs in %s\n",
                     static_cast<long long>(*ready_timeout), log_dir.c_str());
        exit_code = 1;
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (!ok) exit_code = 1;
  std::printf("shardserve launch: stopping %zu processes\n", children.size());
  StopAll(children, std::chrono::seconds(10));
  return exit_code;
}

const CommandRegistration kRegistration({"launch", "start a local cluster (coordinator + workers)", Run});

}  // namespace
}  // namespace shardserve::cli
