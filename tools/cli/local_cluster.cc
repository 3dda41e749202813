#include "tools/cli/local_cluster.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "kernels/backend.h"
#include "kernels/quant.h"
#include "tools/cli/client.h"

namespace shardserve::cli {

std::set<std::string> ClusterFlags::Names() {
  std::set<std::string> names = {"model", "device", "ready-timeout-seconds", "worker-threads", "worker-memory-gb",
                                 "worker-matmul-dtype",
                                 "worker-collectives", "worker-dummy-weights", "max-model-len", "quantization",
                                 "load-format", "dummy-seed", "activation-quantization", "speculative",
                                 "draft-model"};
  names.insert(std::begin(kCoordinatorPassThroughFlags), std::end(kCoordinatorPassThroughFlags));
  return names;
}

absl::StatusOr<ClusterFlags> ClusterFlags::Parse(const Flags& f) {
  ClusterFlags c;
  c.model = f.Get("model", SHARDSERVE_DEMO_MODEL_DIR);
  if (!std::filesystem::exists(std::filesystem::path(c.model) / "config.json")) {
    return absl::InvalidArgumentError(
        absl::StrCat(c.model, " has no config.json (give a Hugging Face checkpoint directory, or one holding only "
                     "config.json with --load-format dummy)"));
  }
  SHARDSERVE_RETURN_IF_ERROR(f.OneOf("device", {"cpu", "cuda"}, &c.device));
  SHARDSERVE_RETURN_IF_ERROR(f.Int("ready-timeout-seconds", 1, 86400, &c.ready_timeout_s));
  if (f.Has("worker-threads")) {
    int64_t threads = 0;
    SHARDSERVE_RETURN_IF_ERROR(f.Int("worker-threads", 0, 4096, &threads));
    c.worker_threads = threads;
  }
  if (f.Has("worker-memory-gb")) {
    double gb = 0;
    SHARDSERVE_RETURN_IF_ERROR(f.Double("worker-memory-gb", 0, 1 << 24, &gb));  // the worker's --memory-gb range
    c.worker_memory_gb = gb;
  }
  if (f.Has("worker-matmul-dtype")) {
    std::string dtype;
    SHARDSERVE_RETURN_IF_ERROR(f.OneOf("worker-matmul-dtype", {"auto", "f32", "bf16"}, &dtype));
    c.worker_flags = {"--matmul-dtype", dtype};
  }
  // The workers' --collectives and --dummy-weights (worker/worker_main.cc says what they do).
  if (f.Has("worker-collectives")) {
    std::string value;
    SHARDSERVE_RETURN_IF_ERROR(f.OneOf("worker-collectives", {"auto", "gloo", "nccl"}, &value));
    c.worker_flags.insert(c.worker_flags.end(), {"--collectives", value});
  }
  if (f.Has("worker-dummy-weights")) {
    std::string value;
    SHARDSERVE_RETURN_IF_ERROR(f.OneOf("worker-dummy-weights", {"host", "device"}, &value));
    c.worker_flags.insert(c.worker_flags.end(), {"--dummy-weights", value});
  }
  // --worker-no-cuda-X / --worker-cuda-X: the workers' --no-cuda-X / --cuda-X (kernels/cuda/cuda_switches.h).
  for (const std::string& name : WithCudaSwitches({})) {
    if (f.Has("worker-" + name)) c.worker_flags.push_back("--" + name);
  }
  // Beside --quantization, but the workers' (their CPU products' kernels): --activation-quantization.
  if (f.Has("activation-quantization")) {
    const absl::StatusOr<CpuActivationQuant> act = ParseCpuActivationQuant(f.Get("activation-quantization"));
    if (!act.ok()) return absl::InvalidArgumentError(absl::StrCat("flag --", act.status().message()));
    c.worker_flags.insert(c.worker_flags.end(), {"--activation-quantization", CpuActivationQuantName(*act)});
  }
  // Range-checked by the coordinator; here only whole numbers >= 0 pass.
  std::vector<std::string> coordinator_names = {"max-model-len"};
  coordinator_names.insert(coordinator_names.end(), std::begin(kCoordinatorPassThroughFlags),
                           std::end(kCoordinatorPassThroughFlags));
  for (const std::string& name : coordinator_names) {
    if (!f.Has(name)) continue;
    int64_t v = 0;
    SHARDSERVE_RETURN_IF_ERROR(f.Int(name, 0, int64_t{1} << 31, &v));
    c.coordinator_flags.emplace_back(name, f.Get(name));
  }
  if (f.Has("quantization")) {
    const absl::StatusOr<WeightQuant> quant = ParseWeightQuant(f.Get("quantization"));
    if (!quant.ok()) return absl::InvalidArgumentError(absl::StrCat("flag --", quant.status().message()));
    c.coordinator_flags.emplace_back("quantization", WeightQuantName(*quant));
  }
  if (f.Has("load-format")) {
    std::string load_format;
    SHARDSERVE_RETURN_IF_ERROR(f.OneOf("load-format", {"auto", "dummy"}, &load_format));
    c.coordinator_flags.emplace_back("load-format", load_format);
  }
  if (f.Has("dummy-seed")) {
    if (f.Get("load-format") != "dummy") return absl::InvalidArgumentError("flag --dummy-seed needs --load-format dummy");
    int64_t seed = 0;
    SHARDSERVE_RETURN_IF_ERROR(f.Int("dummy-seed", 0, INT64_MAX, &seed));
    c.coordinator_flags.emplace_back("dummy-seed", f.Get("dummy-seed"));
  }
  if (f.Has("speculative")) {
    std::string value;
    SHARDSERVE_RETURN_IF_ERROR(f.OneOf("speculative", {"ngram", "draft", "mtp", "eagle3"}, &value));
    c.coordinator_flags.emplace_back("speculative", value);
  }
  if (f.Has("draft-model")) {
    std::error_code ec;
    c.draft_model = std::filesystem::absolute(f.Get("draft-model"), ec).string();
    if (!std::filesystem::exists(std::filesystem::path(c.draft_model) / "config.json")) {
      return absl::InvalidArgumentError(absl::StrCat("--draft-model ", f.Get("draft-model"),
                                                     " has no config.json (give the draft's checkpoint directory)"));
    }
  }
  if ((f.Get("speculative") == "draft" || f.Get("speculative") == "eagle3") && c.draft_model.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--speculative ", f.Get("speculative"), " needs --draft-model DIR"));
  }
  c.prefix_caching = !f.Has("no-prefix-caching");
  c.async_scheduling = !f.Has("no-async-scheduling");
  c.expert_parallel = f.Has("expert-parallel");
  c.adaptive_speculative_tokens = f.Has("adaptive-speculative-tokens");
  return c;
}

std::vector<std::string> ClusterFlags::CoordinatorArgs(const std::string& skip) const {
  std::vector<std::string> args;
  for (const auto& [name, value] : coordinator_flags) {
    if (name != skip) args.insert(args.end(), {absl::StrCat("--", name), value});
  }
  // The draft model (or EAGLE-3 head) goes with --speculative draft (eagle3) only (bench --compare's
  // /draft layouts add both).
  const bool draft =
      std::find(args.begin(), args.end(), "draft") != args.end() || std::find(args.begin(), args.end(), "eagle3") != args.end();
  if (draft && !draft_model.empty()) args.insert(args.end(), {"--draft-model", draft_model});
  if (!prefix_caching) args.push_back("--no-prefix-caching");
  if (!async_scheduling) args.push_back("--no-async-scheduling");
  if (expert_parallel) args.push_back("--expert-parallel");
  if (adaptive_speculative_tokens) args.push_back("--adaptive-speculative-tokens");
  return args;
}

namespace {

namespace fs = std::filesystem;

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return absl::StrCat("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  return "stopped";
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

// 'it'\''s' quoting, only where needed, so that commands.sh can be pasted into a shell.
std::string ShellQuote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./:=,@+") ==
                        std::string::npos) {
    return s;
  }
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// "host:port" -> port, or -1 when it has none.
int64_t PortOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  int64_t port;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) return -1;
  return port;
}

}  // namespace

absl::Status LocalCluster::Spawn(const std::string& name, const std::vector<std::string>& argv,
                                 const std::string& log_name, bool worker) {
  const std::string log = (fs::path(options_.log_dir) / log_name).string();
  {
    std::vector<std::string> quoted;
    for (const std::string& a : argv) quoted.push_back(ShellQuote(a));
    std::ofstream(fs::path(options_.log_dir) / "commands.sh", std::ios::app) << absl::StrJoin(quoted, " ") << "\n";
  }
  absl::StatusOr<pid_t> pid = ForkExec(argv, log, /*append=*/false);
  if (!pid.ok()) return pid.status();
  children_.push_back({name, *pid, log, worker, argv});
  return absl::OkStatus();
}

absl::Status LocalCluster::SpawnWorker(const std::string& name, const std::string& node, int64_t gpu,
                                       int64_t metrics_port, bool spare) {
  std::vector<std::string> argv = {(fs::path(options_.bin_dir) / "shardserve-worker").string(),
                                   "--coordinator",
                                   address_,
                                   "--node",
                                   node,
                                   "--device",
                                   options_.device == "cpu" ? "cpu" : absl::StrCat("cuda:", gpu),
                                   "--metrics-listen",
                                   absl::StrCat("127.0.0.1:", metrics_port),
                                   "--log-format",
                                   options_.log_format};
  if (spare) argv.push_back("--spare");
  argv.insert(argv.end(), options_.worker_flags.begin(), options_.worker_flags.end());
  // "worker node1/0" -> worker-node1-0.log, "spare node0/2" -> spare-node0-2.log.
  std::string log_name = absl::StrCat(name, ".log");
  std::replace(log_name.begin(), log_name.end(), ' ', '-');
  std::replace(log_name.begin(), log_name.end(), '/', '-');
  if (absl::Status s = Spawn(name, argv, log_name, /*worker=*/true); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("starting ", name, ": ", s.message()));
  }
  metrics_lines_.push_back(absl::StrCat("  ", name, "  http://127.0.0.1:", metrics_port, "/metrics"));
  return absl::OkStatus();
}

absl::Status LocalCluster::RestartWorker(const std::string& name) { return Restart(name, /*worker=*/true); }

absl::Status LocalCluster::RestartCoordinator() { return Restart("coordinator", /*worker=*/false); }

absl::Status LocalCluster::Restart(const std::string& name, bool worker) {
  for (Child& c : children_) {
    if (c.worker != worker || c.name != name || c.pid > 0) continue;
    // Its command line as it was: the coordinator gives a returning worker its node's open slot,
    // or makes it a spare of its node when a spare took the slot already (docs/healing.md).
    absl::StatusOr<pid_t> pid = ForkExec(c.argv, c.log, /*append=*/true);
    if (!pid.ok()) return pid.status();
    c.pid = *pid;
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat("no exited ", worker ? "worker" : "process", " named ", name));
}

absl::StatusOr<pid_t> LocalCluster::ForkExec(const std::vector<std::string>& argv, const std::string& log,
                                             bool append) {
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC) | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot open log ", log, ": ", std::strerror(errno)));
  // Everything the child needs is built before fork: after it, only async-signal-safe calls.
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  const std::string exec_failed = absl::StrCat("exec ", argv[0], " failed\n");
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(err)));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);  // the parent died before prctl took effect
    dup2(fd, 1);
    dup2(fd, 2);
    execv(cargv[0], cargv.data());
    ssize_t ignored = ::write(2, exec_failed.data(), exec_failed.size());
    (void)ignored;
    _exit(127);
  }
  ::close(fd);
  return pid;
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(const LocalClusterOptions& options) {
  std::unique_ptr<LocalCluster> c(new LocalCluster(options));
  const LocalClusterOptions& o = c->options_;
  std::error_code ec;
  fs::create_directories(o.log_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create log dir ", o.log_dir, ": ", ec.message()));
  fs::remove(fs::path(o.log_dir) / "commands.sh", ec);
  const int64_t port = PortOf(o.address);
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("address '", o.address, "' is not HOST:PORT"));
  }
  const fs::path bin(o.bin_dir);

  // Port `base + k`, or 0 (a free one) for every process when the base is 0.
  auto metrics_port = [&](int64_t k) { return o.metrics_port_base == 0 ? 0 : o.metrics_port_base + k; };
  std::vector<std::string> coord = {(bin / "shardserve-coordinator").string(),
                                    "--model",
                                    o.model,
                                    "--listen",
                                    o.address,
                                    "--nodes",
                                    std::to_string(o.nodes),
                                    "--gpus-per-node",
                                    std::to_string(o.gpus_per_node),
                                    "--metrics-listen",
                                    absl::StrCat("127.0.0.1:", metrics_port(0)),
                                    "--log-format",
                                    o.log_format};
  const fs::path port_file = fs::path(o.log_dir) / "coordinator.port";
  const fs::path http_port_file = fs::path(o.log_dir) / "coordinator.http_port";
  if (port == 0) {
    fs::remove(port_file, ec);
    coord.insert(coord.end(), {"--port-file", port_file.string()});
  }
  if (o.http_free_port) {
    fs::remove(http_port_file, ec);
    coord.insert(coord.end(), {"--http-port-file", http_port_file.string()});
  }
  coord.insert(coord.end(), o.coordinator_flags.begin(), o.coordinator_flags.end());
  c->metrics_lines_.push_back(absl::StrCat("  coordinator      http://127.0.0.1:", metrics_port(0), "/metrics"));
  if (absl::Status s = c->Spawn("coordinator", coord, "coordinator.log", false); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("starting the coordinator: ", s.message()));
  }

  // The ports the coordinator chose: it writes each file (atomically, by rename) once that server
  // listens. A restarted coordinator listens where the workers and clients know it is.
  const auto deadline = std::chrono::steady_clock::now() + o.listen_timeout;
  auto chosen_port = [&](const fs::path& file, const char* flag, const char* fixed_flag) -> absl::StatusOr<int64_t> {
    int64_t chosen = 0;
    while (true) {
      std::ifstream in(file);
      if (in >> chosen && chosen > 0 && chosen <= 65535) break;
      if (std::optional<ExitedProcess> dead = c->ReapExited()) {
        return absl::UnavailableError(absl::StrCat("the coordinator ", dead->how, " before listening; last lines of ",
                                                   dead->log, ":\n", dead->log_tail));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("the coordinator did not write its port to ", file.string(),
                                                        " within ", o.listen_timeout.count(), " s; see ",
                                                        c->children_[0].log));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::vector<std::string>& argv = c->children_[0].argv;
    const auto at = std::find(argv.begin(), argv.end(), flag);
    if (at != argv.end()) argv.erase(at, at + 2);
    if (fixed_flag != nullptr) argv.insert(argv.end(), {fixed_flag, std::to_string(chosen)});
    return chosen;
  };
  c->address_ = o.address;
  if (port == 0) {
    // The workers need the real port.
    SHARDSERVE_ASSIGN_OR_RETURN(const int64_t chosen, chosen_port(port_file, "--port-file", nullptr));
    c->address_ = absl::StrCat(o.address.substr(0, o.address.rfind(':')), ":", chosen);
    std::vector<std::string>& argv = c->children_[0].argv;
    for (size_t k = 0; k + 1 < argv.size(); ++k) {
      if (argv[k] == "--listen") argv[k + 1] = c->address_;
    }
  }
  if (o.http_free_port) {
    SHARDSERVE_ASSIGN_OR_RETURN(const int64_t chosen, chosen_port(http_port_file, "--http-port-file", "--http-port"));
    c->http_port_ = static_cast<int>(chosen);
  }

  // Worker g of a node takes cuda:g. With the workers' collectives over Gloo (--worker-collectives
  // gloo) on a machine with fewer GPUs than workers per node, the workers share them: cuda:(g mod
  // GPUs), e.g. TP=2 on one GPU (NCCL refuses two ranks on one GPU; staged Gloo does not).
  const bool gloo_on_cuda = [&] {
    for (size_t k = 0; k + 1 < o.worker_flags.size(); ++k) {
      if (o.worker_flags[k] == "--collectives" && o.worker_flags[k + 1] == "gloo") return true;
    }
    return false;
  }();
  const int64_t gpus = o.device == "cpu" || !gloo_on_cuda ? 0 : CudaDeviceCount();
  auto gpu_of = [gpus](int64_t g) { return gpus > 0 ? g % gpus : g; };
  // Worker k (slots first, node by node, then the spares) gets the k-th metrics port after the
  // coordinator's.
  for (int64_t n = 0; n < o.nodes; ++n) {
    for (int64_t g = 0; g < o.gpus_per_node; ++g) {
      const std::string node = absl::StrCat("node", n);
      SHARDSERVE_RETURN_IF_ERROR(c->SpawnWorker(absl::StrCat("worker ", node, "/", g), node,
                                                gpu_of(g),
                                                metrics_port(1 + n * o.gpus_per_node + g), /*spare=*/false));
    }
  }
  for (int64_t k = 0; k < o.spare_workers; ++k) {
    const std::string node = absl::StrCat("node", k % o.nodes);
    SHARDSERVE_RETURN_IF_ERROR(c->SpawnWorker(absl::StrCat("spare ", node, "/", k), node,
                                              gpu_of(o.gpus_per_node + k / o.nodes),
                                              metrics_port(1 + o.nodes * o.gpus_per_node + k), /*spare=*/true));
  }
  ClientOptions client;
  client.address = c->address_;
  client.tls = o.client_tls;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = ConnectToCoordinator(client);
  if (!channel.ok()) return channel.status();
  c->health_ = grpc::health::v1::Health::NewStub(*channel);
  return c;
}

std::vector<pid_t> LocalCluster::WorkerPids() const {
  std::vector<pid_t> pids;
  for (const Child& c : children_) {
    if (c.worker) pids.push_back(c.pid);
  }
  return pids;
}

std::vector<std::string> LocalCluster::WorkerNames() const {
  std::vector<std::string> names;
  for (const Child& c : children_) {
    if (c.worker) names.push_back(c.name.substr(c.name.find(' ') + 1));
  }
  return names;
}

bool LocalCluster::Serving() {
  if (health_ == nullptr) return false;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  // Waits for the channel to connect (within the deadline) instead of failing at once while it
  // is between reconnect attempts.
  ctx.set_wait_for_ready(true);
  grpc::health::v1::HealthCheckResponse resp;
  return health_->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok() &&
         resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

std::optional<ExitedProcess> LocalCluster::ReapExited() {
  for (Child& c : children_) {
    int status;
    if (c.pid > 0 && waitpid(c.pid, &status, WNOHANG) == c.pid) {
      const pid_t pid = c.pid;
      c.pid = -1;
      return ExitedProcess{c.name, DescribeExit(status), c.log, TailOf(c.log), pid};
    }
  }
  return std::nullopt;
}

absl::Status LocalCluster::WaitUntilServing(std::chrono::seconds timeout, const std::atomic<bool>* stop) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (stop != nullptr && stop->load()) return absl::CancelledError("interrupted");
    if (std::optional<ExitedProcess> dead = ReapExited()) {
      return absl::UnavailableError(
          absl::StrCat(dead->name, " ", dead->how, "; last lines of ", dead->log, ":\n", dead->log_tail));
    }
    if (Serving()) return absl::OkStatus();
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("not serving after ", timeout.count(), " s; see the logs in ", options_.log_dir));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

void LocalCluster::Stop(std::chrono::seconds grace) {
  for (Child& c : children_) {
    if (c.pid > 0) kill(c.pid, SIGTERM);
  }
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (Child& c : children_) {
    while (c.pid > 0) {
      int status;
      const pid_t r = waitpid(c.pid, &status, WNOHANG);
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

absl::StatusOr<int64_t> PeakRssBytes(pid_t pid) {
  std::optional<int64_t> bytes = ProcStatusBytes(absl::StrCat(pid), "VmHWM");
  if (!bytes) return absl::NotFoundError(absl::StrCat("/proc/", pid, "/status: unreadable, or no VmHWM of '<N> kB'"));
  return *bytes;
}

}  // namespace shardserve::cli
