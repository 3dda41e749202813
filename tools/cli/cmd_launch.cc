// shardserve launch: a local cluster. Starts one coordinator and nodes x gpus-per-node workers on
// this machine as separate processes (each worker reports a simulated node name, so the
// coordinator groups them exactly as it would real nodes), waits until the coordinator serves,
// prints where to connect, and stops every process on Ctrl-C or SIGTERM.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
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
#include "security/certificates.h"
#include "security/tls.h"

namespace shardserve::cli {
namespace {

namespace fs = std::filesystem;

constexpr char kUsage[] =
    "usage: shardserve launch [--model DIR] [--nodes N] [--gpus-per-node G] [--device cpu|cuda]\n"
    "                         [--address HOST:PORT] [--max-model-len L] [--log-dir DIR] [--ready-timeout-seconds S]\n"
    "                         [--metrics-port-base P] [--log-format text|json] [--worker-threads N]\n"
    "                         [--worker-memory-gb G]\n"
    "                         [--max-num-seqs N] [--max-waiting-requests N] [--max-tokens-per-step T]\n"
    "                         [--num-kv-blocks N] [--micro-batches K] [--block-size B]\n"
    "                         [--worker-matmul-dtype auto|f32|bf16] [--quantization none|int8|int4|fp8]\n"
    "                         [--activation-quantization auto|none|int8|int16]\n"
    "                         [--worker-collectives auto|gloo|nccl] [--worker-dummy-weights host|device]\n"
    "                         [--worker-no-cuda-quantized-kernels] [--worker-no-cuda-graphs]\n"
    "                         [--worker-no-cuda-split-attention] [--worker-no-cuda-fused-kernels]\n"
    "                         [--worker-no-cuda-dense-gemv]\n"
    "                         [--worker-cuda-int4-mma] [--worker-cuda-pdl] [--worker-cuda-fp8-gemm]\n"
    "                         [--worker-cuda-int4-folded] [--worker-cuda-moe-grouped]\n"
    "                         [--load-format auto|dummy] [--dummy-seed N] [--api-keys-file FILE]\n"
    "                         [--http-port P] [--heal-timeout-seconds S]\n"
    "                         [--tool-call-parser NAME] [--reasoning-parser NAME]\n"
    "                         [--max-worker-restarts N] [--spare-workers N] [--no-prefix-caching]\n"
    "                         [--no-async-scheduling] [--expert-parallel]\n"
    "                         [--speculative ngram|draft|mtp|eagle3 --num-speculative-tokens K]\n"
    "                         [--speculative-max-running N]\n"
    "                         [--draft-model DIR] [--adaptive-speculative-tokens]\n"
    "                         [--max-coordinator-restarts N] [--coordinator-grace-seconds S]\n"
    "                         [--tls-cert FILE --tls-key FILE --tls-ca FILE | --insecure]\n"
    "  Starts a coordinator and N x G workers on this machine (default 2 x 2 on cpu, serving the embedded\n"
    "  demo model) and serves on --address (default localhost:50051; port 0: a free port, printed) until\n"
    "  Ctrl-C or SIGTERM, which stop every process it started. Each process logs to a file in --log-dir\n"
    "  (--log-format: text or json); commands.sh there holds their command lines.\n"
    "  Prometheus /metrics on 127.0.0.1: the coordinator on port P (default 9400), the workers on\n"
    "  P+1, P+2, ... (docs/metrics.md); P = 0: each process picks a free port (see its log and\n"
    "  shardserve status).\n"
    "  --worker-threads      CPU threads of each worker (worker --threads); default on cpu: the CPUs\n"
    "                        launch may use divided by the number of workers, at least 1; 0: the\n"
    "                        worker's default (every CPU); more threads than CPUs in all: a warning\n"
    "  --worker-memory-gb    GiB for each worker's weights and KV cache (worker --memory-gb); default\n"
    "                        on cpu: the memory launch may use divided by the number of workers; 0:\n"
    "                        the worker's default\n"
    "  --worker-matmul-dtype  cpu: the products' precision (worker --matmul-dtype): auto (default:\n"
    "                        bf16 for a bf16 checkpoint on a CPU with bf16 instructions, else f32),\n"
    "                        f32, or bf16 (faster, half the weight memory, logits ~1e-2 from f32's)\n"
    "  --worker-collectives  the workers' --collectives: auto (default: Gloo on cpu, with the\n"
    "                        collectives of ranks on one host through shared memory; NCCL on cuda),\n"
    "                        gloo (Gloo's TCP alone; on cuda staged through host memory, so that\n"
    "                        TP/PP ranks can share one GPU; --gpus-per-node 2 on a one-GPU machine\n"
    "                        needs CUDA_VISIBLE_DEVICES or the same ordinal: see docs/gpu.md) or nccl\n"
    "  --worker-dummy-weights  --load-format dummy on cuda: device (default: the weights made in GPU\n"
    "                        memory) or host (made on the host and copied; worker --dummy-weights)\n"
    "  --worker-no-cuda-quantized-kernels, --worker-no-cuda-graphs, --worker-no-cuda-split-attention,\n"
    "  --worker-no-cuda-fused-kernels, --worker-no-cuda-dense-gemv  the workers' --no-cuda-...\n"
    "                        (shardserve-worker --help): a CUDA path off (each on by default since it passed\n"
    "                        on a GPU: docs/gpu.md)\n"
    "  --worker-cuda-int4-mma  the workers' --cuda-int4-mma: int4 decode products on the tensor cores\n"
    "                        (slower than the default GEMV on an H200, off by default: docs/gpu.md)\n"
    "  --worker-cuda-pdl     the workers' --cuda-pdl: programmatic dependent launch on Hopper (not\n"
    "                        yet run on a GPU, off by default: docs/gpu.md)\n"
    "  --worker-cuda-fp8-gemm  the workers' --cuda-fp8-gemm: fp8 weights' prefill products by cuBLASLt's\n"
    "                        fp8 GEMM, x rounded to e4m3 (inexact; not yet run on a GPU: docs/gpu.md)\n"
    "  --worker-cuda-int4-folded  the workers' --cuda-int4-folded: int4 decode products with the zero\n"
    "                        point folded out of the GEMV's loop (not yet run on a GPU: docs/gpu.md)\n"
    "  --worker-cuda-moe-grouped  the workers' --cuda-moe-grouped: MoE experts as one grouped GEMV, so\n"
    "                        MoE decode steps record as graphs (not yet run on a GPU: docs/gpu.md)\n"
    "  --max-num-seqs, --max-waiting-requests, --max-tokens-per-step, --num-kv-blocks, --micro-batches,\n"
    "  --block-size, --no-prefix-caching, --no-async-scheduling  the coordinator's scheduler flags,\n"
    "                        passed through when given\n"
    "  --speculative ngram|draft|mtp|eagle3, --num-speculative-tokens K, --speculative-max-running N, --draft-model DIR,\n"
    "  --adaptive-speculative-tokens\n"
    "                         the coordinator's speculative decoding (docs/speculative-decoding.md), passed through\n"
    "                        (shardserve-coordinator --help)\n"
    "  --expert-parallel     the coordinator's: each TP rank holds whole experts of a mixture-of-experts\n"
    "                        model, tokens routed to them by all-to-all (docs/moe.md)\n"
    "  --quantization        the coordinator's: int8 stores the workers' linear-layer weights in int8\n"
    "                        (one scale per output channel), int4 in 4 bits (scale + zero point per\n"
    "                        group of 128 inputs), fp8 in e4m3 (one scale per output channel),\n"
    "                        quantized at load\n"
    "  --activation-quantization  the workers': int8 rounds the inputs of the int8/int4 products to\n"
    "                        int8 and multiplies in integers (AVX-512 VNNI or AVX2, as llama.cpp's\n"
    "                        Q8_0/Q4_0): faster, less exact; refused on a CPU with neither.\n"
    "                        int16: the int4 products' inputs to int16 per group of 128 (AVX-512\n"
    "                        VNNI): faster than exact, 258x finer than int8. none: exact. auto\n"
    "                        (default): int16 on a CPU with AVX-512 VNNI, else none\n"
    "  --heal-timeout-seconds  the coordinator's: how long requests wait for the group to heal around\n"
    "                        a lost worker (a new worker process for its node) before they fail\n"
    "                        (default 60; docs/healing.md)\n"
    "  --max-worker-restarts  a worker that dies once the cluster serves is started again (backoff\n"
    "                        1 s, doubling up to 30 s while it dies again within 10 s of its\n"
    "                        restart, else 1 s again) and takes its lost slot back, at most N times\n"
    "                        in all (default 5; 0: never)\n"
    "  --max-coordinator-restarts  a coordinator that dies once the cluster serves is started again\n"
    "                        (backoff 1 s, doubling up to 30 s) on the same address, at most N times\n"
    "                        (default 5; 0: a dead coordinator stops the cluster); the workers keep\n"
    "                        their shards and the new coordinator adopts them without a reload;\n"
    "                        requests in flight on the dead one fail with UNAVAILABLE\n"
    "  --coordinator-grace-seconds  the workers': how long they outlive a dead coordinator, waiting\n"
    "                        for a new one (default 60; docs/healing.md)\n"
    "  --spare-workers       N more workers started as spares (worker --spare), spread over the\n"
    "                        nodes: registered and ready but holding no shard; one takes a lost\n"
    "                        slot of its node at once, so a heal costs a shard load, not a process\n"
    "                        start (default 0)\n"
    "  --load-format, --dummy-seed  the coordinator's: dummy makes the weights from config.json and the\n"
    "                        seed (default 0), each worker its own slice; --model may hold only\n"
    "                        config.json (then prompts are token ids)\n"
    "  Secure by default: launch makes a throw-away CA and certificates for 127.0.0.1/localhost (EC\n"
    "  P-256, valid 7 days; keys 0600) in the state directory ($SHARDSERVE_STATE_DIR, else\n"
    "  $XDG_RUNTIME_DIR/shardserve, else ~/.shardserve/local), so that the coordinator and the workers\n"
    "  authenticate each other (mutual TLS), and writes cluster.json there: the client commands\n"
    "  (generate, status, bench) read it and connect with TLS without flags. Both are removed on exit.\n"
    "  --tls-cert, --tls-key, --tls-ca  your own certificate (for the coordinator and the workers) and CA\n"
    "  --insecure            plaintext everywhere (no certificates)\n"
    "  --api-keys-file       the coordinator's: clients must send one of these keys (gRPC and HTTP)\n\n"
    "  --http-port           the coordinator's OpenAI-compatible HTTP API on 127.0.0.1:P (default 8000;\n"
    "                        0: off): plain HTTP, or HTTPS with your own --tls-cert; docs/api.md\n"
    "  --tool-call-parser, --reasoning-parser  the coordinator's: how chat outputs' tool calls and\n"
    "                        reasoning are read (default: from the chat template; docs/api.md)\n";

volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

int Run(const std::vector<std::string>& args) {
  std::set<std::string> with_value = ClusterFlags::Names();
  with_value.insert({"nodes", "gpus-per-node", "address", "log-dir", "metrics-port-base", "log-format", "api-keys-file",
                     "http-port", "tool-call-parser", "reasoning-parser",
                     "max-worker-restarts", "spare-workers", "max-coordinator-restarts",
                     "coordinator-grace-seconds"});
  with_value.insert(TlsFlagNames().begin(), TlsFlagNames().end());
  std::set<std::string> switches = ClusterFlags::Switches();
  switches.insert({"help", "insecure"});
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
  const absl::StatusOr<int64_t> spares = flags->GetInt("spare-workers", 0);
  if (!spares.ok() || *spares < 0 || *spares > 64) {
    std::fprintf(stderr, "shardserve launch: --spare-workers must be 0 to 64\n");
    return 2;
  }
  const absl::StatusOr<int64_t> max_restarts = flags->GetInt("max-worker-restarts", 5);
  if (!max_restarts.ok() || *max_restarts < 0 || *max_restarts > 1000) {
    std::fprintf(stderr, "shardserve launch: --max-worker-restarts must be 0 to 1000\n");
    return 2;
  }
  const absl::StatusOr<int64_t> max_coordinator_restarts = flags->GetInt("max-coordinator-restarts", 5);
  if (!max_coordinator_restarts.ok() || *max_coordinator_restarts < 0 || *max_coordinator_restarts > 1000) {
    std::fprintf(stderr, "shardserve launch: --max-coordinator-restarts must be 0 to 1000\n");
    return 2;
  }
  const absl::StatusOr<int64_t> coordinator_grace = flags->GetInt("coordinator-grace-seconds", 60);
  if (!coordinator_grace.ok() || *coordinator_grace < 0 || *coordinator_grace > 86400) {
    std::fprintf(stderr, "shardserve launch: --coordinator-grace-seconds must be 0 to 86400\n");
    return 2;
  }
  const absl::StatusOr<int64_t> http_port = flags->GetInt("http-port", 8000);
  if (!http_port.ok() || *http_port < 0 || *http_port > 65535) {
    std::fprintf(stderr, "shardserve launch: --http-port must be a port, or 0 for no HTTP API\n");
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
  const absl::StatusOr<TlsFiles> given_tls = TlsFilesFromFlags(*flags);
  if (!given_tls.ok()) {
    std::fprintf(stderr, "shardserve launch: %s\n", std::string(given_tls.status().message()).c_str());
    return 2;
  }
  const bool insecure = flags->Has("insecure");
  if (insecure && given_tls->any()) {
    std::fprintf(stderr, "shardserve launch: --insecure excludes --tls-cert, --tls-key and --tls-ca\n");
    return 2;
  }
  if (given_tls->any() && (!given_tls->has_identity() || given_tls->ca.empty())) {
    std::fprintf(stderr, "shardserve launch: give --tls-cert, --tls-key and --tls-ca together (the workers and the "
                         "coordinator authenticate each other with them)\n");
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
  if (flags->Has("api-keys-file")) {
    options.coordinator_flags.insert(options.coordinator_flags.end(), {"--api-keys-file", flags->Get("api-keys-file")});
  }
  options.spare_workers = *spares;
  if (*http_port > 0) options.coordinator_flags.insert(options.coordinator_flags.end(), {"--http-port", absl::StrCat(*http_port)});
  for (const char* name : {"tool-call-parser", "reasoning-parser"}) {
    if (flags->Has(name)) {
      options.coordinator_flags.insert(options.coordinator_flags.end(), {absl::StrCat("--", name), flags->Get(name)});
    }
  }
  // --threads and --memory-gb for every worker: given, or on cpu the CPUs and the memory shared out
  // among the workers; 0 leaves them to the worker. Threads past the CPUs are said once, here
  // (spares compute nothing and hold no shard until they take a slot, and are not counted).
  options.worker_flags = cluster_flags->WorkerArgs(*nodes * *gpus);
  if (const std::string note = cluster_flags->WorkerThreadsNote(*nodes * *gpus); !note.empty()) {
    std::fprintf(stderr, "shardserve launch: warning: %s\n", note.c_str());
  }
  options.worker_flags.insert(options.worker_flags.end(), cluster_flags->worker_flags.begin(),
                              cluster_flags->worker_flags.end());
  options.worker_flags.insert(options.worker_flags.end(),
                              {"--coordinator-grace-seconds", absl::StrCat(*coordinator_grace)});

  // TLS: the given files, or a throw-away CA and certificates made now (unless --insecure).
  TlsFiles server_tls = *given_tls;
  LocalClusterFile local_file;
  local_file.pid = getpid();
  std::string cert_dir;
  if (!insecure && !given_tls->any()) {
    cert_dir = absl::StrCat(StateDir(), "/launch-", getpid());
    std::error_code ec;
    fs::create_directories(StateDir(), ec);
    fs::permissions(StateDir(), fs::perms::owner_all, ec);
    absl::StatusOr<ClusterCertificateFiles> certs = WriteLocalClusterCertificates(cert_dir, absl::Hours(24 * 7));
    if (!certs.ok()) {
      std::fprintf(stderr, "shardserve launch: making the local cluster's certificates in %s: %s\n", cert_dir.c_str(),
                   std::string(certs.status().message()).c_str());
      return 1;
    }
    server_tls = {certs->server_cert, certs->server_key, certs->ca};
    local_file.tls = {certs->client_cert, certs->client_key, certs->ca};
  } else if (!insecure) {
    local_file.tls.ca = given_tls->ca;  // clients verify the coordinator; the client API needs no certificate
  }
  if (insecure) options.coordinator_flags.push_back("--insecure");  // also beyond loopback, as asked
  if (server_tls.any()) {
    const std::vector<std::string> tls_flags = {"--tls-cert", server_tls.cert, "--tls-key", server_tls.key,
                                                "--tls-ca",   server_tls.ca};
    options.coordinator_flags.insert(options.coordinator_flags.end(), tls_flags.begin(), tls_flags.end());
    options.worker_flags.insert(options.worker_flags.end(), tls_flags.begin(), tls_flags.end());
    options.client_tls = local_file.tls;
  }
  // The HTTP API on 127.0.0.1: HTTPS with your own certificate; plain HTTP beside the throw-away
  // ones (curl and the openai client work without a CA to trust).
  const bool http_tls = given_tls->has_identity();
  if (*http_port > 0 && !cert_dir.empty()) options.coordinator_flags.push_back("--http-plaintext");
  // /metrics on 127.0.0.1 likewise: plain HTTP beside the throw-away certificates, so that
  // deploy/prometheus/prometheus-local.yml scrapes them as it is; HTTPS with your own.
  if (!cert_dir.empty()) {
    options.coordinator_flags.push_back("--metrics-plaintext");
    options.worker_flags.push_back("--metrics-plaintext");
  }
  // Whatever happens below, the certificates and the cluster file go with this process.
  struct Cleanup {
    std::string cert_dir;
    int64_t pid;
    ~Cleanup() {
      RemoveLocalClusterFile(pid);
      std::error_code ec;
      if (!cert_dir.empty()) fs::remove_all(cert_dir, ec);
    }
  } cleanup{cert_dir, local_file.pid};

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
  local_file.address = address;
  if (absl::Status s = WriteLocalClusterFile(local_file); !s.ok()) {
    std::fprintf(stderr, "shardserve launch: cannot write %s (client commands will need --tls-* flags): %s\n",
                 LocalClusterFilePath().c_str(), std::string(s.message()).c_str());
  }
  std::printf("shardserve launch: coordinator + %lld workers (%lld node(s) x %lld), model %s, logs in %s\n",
              static_cast<long long>(*nodes * *gpus), static_cast<long long>(*nodes), static_cast<long long>(*gpus),
              options.model.c_str(), options.log_dir.c_str());
  if (insecure) {
    std::printf("shardserve launch: plaintext (--insecure)\n");
  } else {
    std::printf("shardserve launch: mutual TLS (CA %s); client settings in %s\n", server_tls.ca.c_str(),
                LocalClusterFilePath().c_str());
  }
  if (*http_port > 0) {
    std::printf("shardserve launch: OpenAI API on %s://127.0.0.1:%lld/v1%s\n", http_tls ? "https" : "http",
                static_cast<long long>(*http_port), flags->Has("api-keys-file") ? " (API keys required)" : "");
  }
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
  // Supervision: a worker that dies once the cluster is ready is started again after a backoff
  // (1 s, doubling up to 30 s while it keeps dying within kStableRun of its restart), at most
  // --max-worker-restarts times in all; the coordinator gives
  // the new process its lost slot and the group heals (docs/healing.md).
  std::map<std::string, int64_t> restarts;  // by worker name
  std::map<std::string, std::chrono::steady_clock::time_point> restart_at;
  // When each worker was last restarted. One that then ran kStableRun or longer before dying again
  // was not crash-looping (it was killed, or its machine failed): its backoff starts over at 1 s,
  // so that a worker lost now and then is not brought back ever more slowly (tools/bench/chaos_bench.py
  // found heals growing 1, 2, 4, 8, 16 s with each kill of the same worker).
  constexpr auto kStableRun = std::chrono::seconds(10);
  std::map<std::string, std::chrono::steady_clock::time_point> restarted_at;
  int64_t total_restarts = 0;
  // The coordinator too: started again on the same address (same backoff), at most
  // --max-coordinator-restarts times; the workers outlive it and the new one adopts them.
  int64_t coordinator_restarts = 0;
  bool coordinator_restart_due = false;  // at coordinator_restart_at
  std::chrono::steady_clock::time_point coordinator_restart_at{};
  bool coordinator_restarted = false;  // since the last time it was seen serving
  while (!g_stop) {
    if (std::optional<ExitedProcess> dead = (*cluster)->ReapExited()) {
      std::fprintf(stderr, "shardserve launch: %s (pid %lld) %s; last lines of %s:\n%s\n", dead->name.c_str(),
                   static_cast<long long>(dead->pid), dead->how.c_str(), dead->log.c_str(), dead->log_tail.c_str());
      if (!ready) {
        exit_code = 1;
        break;  // a cluster that cannot start is torn down
      }
      if (dead->name == "coordinator") {
        if (coordinator_restarts >= *max_coordinator_restarts) {
          std::fprintf(stderr,
                       "shardserve launch: not restarting the coordinator: %lld restarts already "
                       "(--max-coordinator-restarts); stopping the cluster\n",
                       static_cast<long long>(coordinator_restarts));
          exit_code = 1;
          break;
        }
        const auto backoff =
            std::chrono::seconds(std::min<int64_t>(30, int64_t{1} << std::min<int64_t>(coordinator_restarts, 5)));
        ++coordinator_restarts;
        coordinator_restart_at = std::chrono::steady_clock::now() + backoff;
        coordinator_restart_due = true;
        std::fprintf(stderr,
                     "shardserve launch: restarting the coordinator in %lld s (restart %lld of at most %lld); the "
                     "workers keep their shards and wait for it (--coordinator-grace-seconds %lld); requests in "
                     "flight on it failed with UNAVAILABLE\n",
                     static_cast<long long>(backoff.count()), static_cast<long long>(coordinator_restarts),
                     static_cast<long long>(*max_coordinator_restarts), static_cast<long long>(*coordinator_grace));
        std::fflush(stderr);
        continue;
      }
      if (total_restarts < *max_restarts) {
        if (auto r = restarted_at.find(dead->name);
            r != restarted_at.end() && std::chrono::steady_clock::now() - r->second >= kStableRun) {
          restarts[dead->name] = 0;
        }
        const int64_t n = restarts[dead->name]++;
        const auto backoff = std::chrono::seconds(std::min<int64_t>(30, int64_t{1} << std::min<int64_t>(n, 5)));
        restart_at[dead->name] = std::chrono::steady_clock::now() + backoff;
        ++total_restarts;
        std::fprintf(stderr,
                     "shardserve launch: restarting %s in %lld s (restart %lld of at most %lld); the group heals when "
                     "it registers, requests wait up to the coordinator's --heal-timeout-seconds\n",
                     dead->name.c_str(), static_cast<long long>(backoff.count()),
                     static_cast<long long>(total_restarts), static_cast<long long>(*max_restarts));
      } else {
        std::fprintf(stderr,
                     "shardserve launch: not restarting %s: %lld restarts already (--max-worker-restarts); the group "
                     "heals when a worker for the lost slot registers (its line of %s/commands.sh)\n",
                     dead->name.c_str(), static_cast<long long>(total_restarts), options.log_dir.c_str());
      }
      std::fflush(stderr);
    }
    if (coordinator_restart_due && std::chrono::steady_clock::now() >= coordinator_restart_at) {
      coordinator_restart_due = false;
      if (absl::Status s = (*cluster)->RestartCoordinator(); !s.ok()) {
        std::fprintf(stderr, "shardserve launch: cannot restart the coordinator: %s; stopping the cluster\n",
                     std::string(s.message()).c_str());
        exit_code = 1;
        break;
      }
      coordinator_restarted = true;
      std::fprintf(stderr, "shardserve launch: restarted the coordinator on %s (restart %lld)\n", address.c_str(),
                   static_cast<long long>(coordinator_restarts));
      std::fflush(stderr);
    }
    if (coordinator_restarted && (*cluster)->Serving()) {
      coordinator_restarted = false;
      std::printf("shardserve launch: the restarted coordinator serves again\n");
      std::fflush(stdout);
    }
    for (auto it = restart_at.begin(); it != restart_at.end();) {
      if (std::chrono::steady_clock::now() < it->second) {
        ++it;
        continue;
      }
      if (absl::Status s = (*cluster)->RestartWorker(it->first); !s.ok()) {
        std::fprintf(stderr, "shardserve launch: cannot restart %s: %s\n", it->first.c_str(),
                     std::string(s.message()).c_str());
      } else {
        restarted_at[it->first] = std::chrono::steady_clock::now();
        std::fprintf(stderr, "shardserve launch: restarted %s\n", it->first.c_str());
      }
      std::fflush(stderr);
      it = restart_at.erase(it);
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
