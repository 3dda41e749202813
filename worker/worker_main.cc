// shardserve-worker: one worker process (one GPU, or one CPU shard). It dials the coordinator,
// registers, loads the shard it is assigned and executes steps until the coordinator stops it or
// SIGTERM/SIGINT arrives (worker/worker_service.h). It also serves grpc.health.v1 and server
// reflection on --listen.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#if SHARDSERVE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/flags.h"
#include "base/resource_limits.h"
#include "security/tls.h"
#include "telemetry/log.h"
#include "telemetry/metrics_http.h"
#include "worker/comm/interface_address.h"
#include "kernels/cuda/cuda_switches.h"
#include "worker/step_executor.h"
#include "worker/worker_log.h"
#include "worker/worker_service.h"

namespace shardserve {
namespace {

constexpr char kUsage[] =
    "usage: shardserve-worker [--coordinator HOST:PORT] [--node NAME] [--device cpu|cuda:K]\n"
    "                         [--listen HOST:PORT] [--memory-gb G] [--collective-host HOST | --collective-interface IFACE]\n"
    "                         [--connect-timeout-seconds S] [--coordinator-grace-seconds S]\n"
    "                         [--debug-step-delay-ms MS] [--debug-load-delay-ms MS]\n"
    "                         [--metrics-listen HOST:PORT] [--log-format text|json] [--threads N]\n"
    "                         [--matmul-dtype auto|f32|bf16] [--memory-bandwidth-gbps B]\n"
    "                         [--tls-cert FILE --tls-key FILE [--tls-ca FILE]] [--insecure] [--spare]\n"
    "                         [--metrics-plaintext] [--health-listen HOST:PORT]\n"
    "                         [--collectives auto|gloo|nccl] [--dummy-weights host|device]\n"
    "                         [--activation-quantization auto|none|int8|int16] [--no-cuda-quantized-kernels]\n"
    "                         [--no-cuda-graphs] [--no-cuda-split-attention] [--no-cuda-fused-kernels]\n"
    "                         [--no-cuda-dense-gemv] [--cuda-int4-mma] [--cuda-pdl] [--cuda-fp8-gemm]\n"
    "                         [--cuda-int4-folded] [--cuda-moe-grouped]\n"
    "  --coordinator            the coordinator's address (default localhost:50051)\n"
    "  --node                   node name; the workers of one node form a tensor-parallel group\n"
    "                           (default: this host's name)\n"
    "  --device                 cpu (default) or cuda:K\n"
    "  --listen                 this worker's gRPC server (health, reflection); port 0 picks a free\n"
    "                           port (default 127.0.0.1:0)\n"
    "  --memory-gb              memory for weights and KV cache, GiB (default: on cpu the host's\n"
    "                           memory, or its container's memory limit where lower; the GPU's on\n"
    "                           cuda)\n"
    "  --memory-bandwidth-gbps  that memory's peak bandwidth, GB/s, for the decode estimate of the\n"
    "                           plan (`shardserve status`); it places nothing (default 0: on cuda the\n"
    "                           GPU's, from CUDA; on cpu none, and the coordinator assumes 20)\n"
    "  --collective-host        address the collectives (Gloo) listen on; peers must reach it\n"
    "                           (default: the host of --listen)\n"
    "  --collective-interface   bind the collectives to this network interface's address instead\n"
    "                           (e.g. the cluster network's eth1; also NCCL_SOCKET_IFNAME unless set;\n"
    "                           docs/security.md: the collective ports are not authenticated)\n"
    "  --connect-timeout-seconds  how long to wait for the coordinator (default 60)\n"
    "  --coordinator-grace-seconds  how long to outlive a coordinator that went away (its process\n"
    "                           died): the worker keeps its shard and registers again, so that a\n"
    "                           restarted coordinator adopts it without a reload; then it exits\n"
    "                           (default 60; 0: exit with the coordinator; docs/healing.md)\n"
    "  --debug-step-delay-ms    TEST-ONLY: sleep this long before every step (default 0)\n"
    "  --debug-load-delay-ms    TEST-ONLY: after loading the assigned shard, sleep this long before\n"
    "                           saying it is loaded (default 0)\n"
    "  --spare                  register as a spare: no shard until a worker of this node is lost,\n"
    "                           then take its slot at once (docs/healing.md)\n"
    "  --metrics-listen         Prometheus /metrics HTTP address; port 0 picks a free port, logged\n"
    "                           and reported to the coordinator (default 127.0.0.1:0;\n"
    "                           docs/metrics.md lists the metrics); HTTPS with --tls-cert/--tls-key\n"
    "  --metrics-plaintext      serve /metrics in plain HTTP even with --tls-cert (loopback only\n"
    "                           unless --insecure)\n"
    "  --log-format             text (default) or json: one JSON object per line\n"
    "  --threads                --device cpu: threads for the CPU backend's matrix products and\n"
    "                           attention (oneDNN, OpenMP; its other ops run on the step thread); 0\n"
    "                           (default): OMP_NUM_THREADS where set, else the CPUs the worker may\n"
    "                           use: those it may run on (its affinity), fewer under its container's\n"
    "                           CPU limit (cgroup cpu.max or cfs quota, rounded up). Give each\n"
    "                           worker its share of the cores. Ignored on cuda\n"
    "  --matmul-dtype           --device cpu: the matrix products' precision. bf16: weights kept in\n"
    "                           bfloat16 (half the memory), inputs rounded to bfloat16, sums in\n"
    "                           float32 (oneDNN's AMX / AVX-512 kernels; needs AVX-512): faster, logits\n"
    "                           ~1e-2 from float32's. f32: float32 throughout (Hugging Face's float32\n"
    "                           reference within 1e-4). auto (default): bf16 for a bf16 checkpoint\n"
    "                           (config.json torch_dtype) on a CPU with bf16 instructions (AVX512-BF16\n"
    "                           or AMX), else f32. Ignored on cuda (products use the checkpoint's dtype)\n"
    "  --activation-quantization  --device cpu: int8 rounds each input row of the products by int8\n"
    "                           and int4 weights (coordinator --quantization) to int8, one scale a\n"
    "                           row, and multiplies in integers (AVX-512 VNNI, else AVX2), as\n"
    "                           llama.cpp's Q8_0 / Q4_0 do: faster, logits further from the\n"
    "                           checkpoint's (docs/quantization.md). Refused on a CPU with neither.\n"
    "                           int16: int4 weights' products only, each input row rounded to int16\n"
    "                           per group of 128 and multiplied in integers (AVX-512 VNNI; refused\n"
    "                           without it): faster than none where measured (Xeon with AMX, Zen 4),\n"
    "                           258x finer than int8. none: the exact products. auto (default):\n"
    "                           int16 on a CPU with AVX-512 VNNI, else none. Ignored on cuda\n"
    "  --collectives            the collective groups' library: auto (default: Gloo on cpu, with the\n"
    "                           collectives and hand-offs of ranks on one host through shared\n"
    "                           memory; NCCL on cuda), gloo (Gloo's TCP alone; on cuda each\n"
    "                           device tensor copied to host memory, Gloo, copied back, for TP/PP\n"
    "                           ranks sharing one GPU, which NCCL refuses) or nccl (cuda only).\n"
    "                           Every worker of a cluster must use the same\n"
    "  --dummy-weights          --load-format dummy on cuda: device (default: made by a CUDA kernel in\n"
    "                           GPU memory, no host copy) or host (made on the host and copied; the\n"
    "                           same values)\n"
    "  --tls-cert, --tls-key    this worker's certificate and key (PEM): it presents them to the\n"
    "                           coordinator and serves --listen with TLS (re-read when they change)\n"
    "  --tls-ca                 the CA of the coordinator's certificate; --listen then accepts only\n"
    "                           peers with a certificate from it (mutual TLS; docs/security.md)\n"
    "  --insecure               allow plaintext on a --listen or --metrics-listen address beyond\n"
    "                           loopback\n"
    "  --health-listen          also serve grpc.health.v1 (and reflection) in plaintext on this\n"
    "                           address, for probes that speak no TLS (Kubernetes' gRPC probes);\n"
    "                           it tells only SERVING or NOT_SERVING (default: none)\n";

// Far above any host's core count.
constexpr int kMaxThreads = 4096;

int Usage(const std::string& error) {
  std::fprintf(stderr, "shardserve-worker: %s\n%s%s", error.c_str(), kUsage, kCudaSwitchesUsage);
  return 2;
}

// "127.0.0.1:0" -> "127.0.0.1"; "[::1]:0" -> "[::1]".
std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

bool IsWildcard(const std::string& host) { return host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::"; }

// What the device holds: for cpu the host's physical memory, or the memory limit of this
// process's control group where that is lower (base/resource_limits.h); the GPU's for cuda:K.
absl::StatusOr<int64_t> DeviceMemoryBytes(int cuda_ordinal) {
  if (cuda_ordinal < 0) return UsableMemoryBytes();
#if SHARDSERVE_HAVE_CUDA
  size_t free_bytes = 0, total_bytes = 0;
  cudaError_t err = cudaSetDevice(cuda_ordinal);
  if (err == cudaSuccess) err = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (err != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cannot read the memory of cuda:", cuda_ordinal, " (",
                                               cudaGetErrorName(err), ": ", cudaGetErrorString(err),
                                               "); set --memory-gb to give it"));
  }
  return static_cast<int64_t>(total_bytes);
#else
  return absl::UnavailableError("this build has no CUDA");
#endif
}

// The peak bandwidth of cuda:K's memory, bytes/s: its memory clock (kHz) x bus width (bits) / 8 x 2
// (double data rate); 0 for cpu, in a build without CUDA, or when the device does not say.
double DeviceMemoryBandwidth(int cuda_ordinal) {
  if (cuda_ordinal < 0) return 0;
#if SHARDSERVE_HAVE_CUDA
  int clock_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, cuda_ordinal) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, cuda_ordinal) != cudaSuccess) {
    cudaGetLastError();  // clear it: the bandwidth only feeds an estimate
    return 0;
  }
  return 2.0 * clock_khz * 1e3 * bus_bits / 8;
#else
  return 0;
#endif
}

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> flags =
      Flags::Parse(argc, argv,
                   {"coordinator", "node", "device", "listen", "memory-gb", "collective-host", "collective-interface",
                    "connect-timeout-seconds", "coordinator-grace-seconds", "debug-step-delay-ms", "debug-load-delay-ms", "metrics-listen", "log-format", "threads",
                    "matmul-dtype", "memory-bandwidth-gbps", "tls-cert", "tls-key", "tls-ca", "health-listen",
                    "collectives", "dummy-weights", "activation-quantization"},
                   WithCudaSwitches({"help", "insecure", "spare", "metrics-plaintext"}));
  if (!flags.ok()) return Usage(std::string(flags.status().message()));
  if (flags->Has("help")) {
    std::printf("%s%s", kUsage, kCudaSwitchesUsage);
    return 0;
  }
  const std::string listen = flags->Get("listen", "127.0.0.1:0");
  std::string log_format_name = "text", matmul_dtype = "auto", collectives = "auto", dummy_weights = "device",
              activation_quant = "auto";
  double memory_gb = 0, connect_timeout = 60, bandwidth_gbps = 0, coordinator_grace = 60;
  int64_t delay_ms = 0, load_delay_ms = 0;
  WorkerOptions options;
  std::vector<std::string> limit_notes;  // for the log, where a cgroup limit lowered a default
  std::vector<std::string> limit_warnings;  // for the log, where a setting by hand exceeds a limit
  for (const absl::Status& s : {
           flags->OneOf("log-format", {"text", "json"}, &log_format_name),
           flags->Double("memory-gb", 0, 1 << 24, &memory_gb),
           flags->Double("connect-timeout-seconds", 0.001, 86400, &connect_timeout),
           flags->Double("coordinator-grace-seconds", 0, 86400, &coordinator_grace),
           flags->Int("debug-step-delay-ms", 0, 3600000, &delay_ms),
           flags->Int("debug-load-delay-ms", 0, 3600000, &load_delay_ms),
           flags->Int("threads", 0, kMaxThreads, &options.cpu_threads),
           flags->OneOf("matmul-dtype", {"auto", "f32", "bf16"}, &matmul_dtype),
           flags->OneOf("collectives", {"auto", "gloo", "nccl"}, &collectives),
           flags->OneOf("dummy-weights", {"host", "device"}, &dummy_weights),
           flags->OneOf("activation-quantization", {"auto", "none", "int8", "int16"}, &activation_quant),
       }) {
    if (!s.ok()) return Usage(std::string(s.message()));
  }
  if (!flags->Double("memory-bandwidth-gbps", 0, 1e6, &bandwidth_gbps).ok() ||
      !(bandwidth_gbps == 0 || bandwidth_gbps >= 1e-3)) {
    return Usage("--memory-bandwidth-gbps must be 0 or a number of GB/s in [0.001, 1e6]");
  }
  LogFormat log_format;
  ParseLogFormat(log_format_name, &log_format);
  SetLogFormat(log_format);
  if (matmul_dtype == "bf16") options.cpu_matmul = CpuMatMul::kBF16;
  if (matmul_dtype == "f32") options.cpu_matmul = CpuMatMul::kF32;

  options.coordinator = flags->Get("coordinator", "localhost:50051");
  options.device = flags->Get("device", "cpu");
  options.collectives = *ParseCollectives(collectives);  // one of OneOf's three
  options.dummy_weights_on_device = dummy_weights == "device";
  options.cpu_activation_quant = *ParseCpuActivationQuant(activation_quant);  // one of OneOf's four
  options.node = flags->Get("node");
  if (options.node.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    options.node = host;
  }
  absl::StatusOr<int> cuda_ordinal = ParseDevice(options.device);
  if (!cuda_ordinal.ok()) return Usage(std::string(cuda_ordinal.status().message()));
  if (*cuda_ordinal < 0 && options.collectives == Collectives::kNccl) return Usage("--collectives nccl needs --device cuda:K");
  if (*cuda_ordinal < 0) {
    // Refused here, before registering: --activation-quantization int8 on a CPU without AVX-512 VNNI or
    // AVX2 (int16: without AVX-512 VNNI), or an ONEDNN_MAX_CPU_ISA that oneDNN would ignore (each
    // message names what is wrong).
    if (absl::StatusOr<std::unique_ptr<Backend>> probe = MakeCpuBackend(1, CpuMatMul::kF32, options.cpu_activation_quant);
        !probe.ok()) {
      std::fprintf(stderr, "shardserve-worker: %s\n", std::string(probe.status().message()).c_str());
      return 1;
    }
    // What a step frees goes back to the host at once, not kept in the heap for the next: the
    // plan's process item (coordinator/planner/memory.cc) is measured so.
    if (!ReturnFreedMemoryPromptly()) {
      limit_warnings.push_back("the C library refused the allocator's thresholds (mallopt): freed memory may "
                               "stay resident beyond the plan's process item");
    }
    // --threads 0: OMP_NUM_THREADS where set (OpenMP's own default), else the CPUs this process may
    // use, fewer than those it may run on under a container's CPU limit (base/resource_limits.h).
    const int affinity = AffinityCpus();
    const std::optional<double> limit = CgroupCpuLimit();
    const char* omp_threads = std::getenv("OMP_NUM_THREADS");
    if (options.cpu_threads == 0 && omp_threads == nullptr) {
      options.cpu_threads = UsableCpus(affinity, limit);
      if (options.cpu_threads < affinity) {
        limit_notes.push_back(absl::StrCat(options.cpu_threads,
                                           options.cpu_threads == 1 ? " compute thread" : " compute threads",
                                           ": the CPU limit of its control group is ", *limit, " of the ", affinity,
                                           " CPUs it may run on (--threads sets another)"));
      }
    } else {
      // Set by hand: said (as a warning) where they outnumber the CPUs this process may use. (An
      // OMP_NUM_THREADS list, "4,2", sets the first level's.)
      int threads = options.cpu_threads;
      std::string source = absl::StrCat("--threads ", threads);
      if (threads == 0) {
        const absl::string_view omp(omp_threads);
        if (!absl::SimpleAtoi(omp.substr(0, omp.find(',')), &threads)) threads = 0;
        source = absl::StrCat("OMP_NUM_THREADS=", omp);
      }
      if (std::string note = ThreadsBeyondCpusNote(source, threads, affinity, limit); !note.empty()) {
        limit_warnings.push_back(std::move(note));
      }
    }
  }
  if (memory_gb == 0) {
    absl::StatusOr<int64_t> memory = DeviceMemoryBytes(*cuda_ordinal);
    if (!memory.ok()) {  // the device, not the command line: no usage text, exit 1
      std::fprintf(stderr, "shardserve-worker: %s\n", std::string(memory.status().message()).c_str());
      return 1;
    }
    options.memory_bytes = *memory;
    if (*cuda_ordinal < 0 && *memory < HostMemoryBytes()) {
      limit_notes.push_back(absl::StrFormat(
          "%.2f GiB for weights and KV cache: the memory limit of its control group, of the host's %.2f GiB "
          "(--memory-gb sets another)",
          *memory / 1073741824.0, HostMemoryBytes() / 1073741824.0));
    }
  } else {
    options.memory_bytes = static_cast<int64_t>(memory_gb * (1ull << 30));
  }
  options.memory_bytes_per_s = bandwidth_gbps > 0 ? bandwidth_gbps * 1e9 : DeviceMemoryBandwidth(*cuda_ordinal);
  options.connect_timeout = absl::Seconds(connect_timeout);
  options.coordinator_grace = absl::Seconds(coordinator_grace);
  options.debug_step_delay = absl::Milliseconds(delay_ms);
  options.debug_load_delay = absl::Milliseconds(load_delay_ms);
  options.spare = flags->Has("spare");
  options.cuda = CudaOptionsFromSwitches(*flags);
  options.collective_host = flags->Get("collective-host");
  if (flags->Has("collective-interface")) {
    if (!options.collective_host.empty()) return Usage("--collective-interface and --collective-host exclude each other");
    const std::string iface = flags->Get("collective-interface");
    absl::StatusOr<std::string> address = InterfaceAddress(iface);
    if (!address.ok()) return Usage(absl::StrCat("--collective-interface: ", address.status().message()));
    options.collective_host = *address;
    setenv("NCCL_SOCKET_IFNAME", iface.c_str(), /*overwrite=*/0);  // NCCL picks its own sockets' interface
  }
  if (options.collective_host.empty()) options.collective_host = HostOf(listen);
  if (IsWildcard(options.collective_host)) {
    return Usage("--listen binds every address: set --collective-host to the address the peers reach");
  }

  const absl::StatusOr<TlsFiles> tls = TlsFilesFromFlags(*flags);
  if (!tls.ok()) return Usage(std::string(tls.status().message()));
  if (absl::Status s = CheckPlaintextListen(listen, tls->has_identity(), flags->Has("insecure")); !s.ok()) {
    return Usage(std::string(s.message()));
  }
  // /metrics: HTTPS with the worker's certificate (unless --metrics-plaintext).
  const std::string metrics_listen = flags->Get("metrics-listen", "127.0.0.1:0");
  const TlsFiles metrics_tls = flags->Has("metrics-plaintext") ? TlsFiles{} : TlsFiles{tls->cert, tls->key, ""};
  if (absl::Status s = CheckMetricsListen(metrics_listen, metrics_tls.has_identity(), flags->Has("insecure")); !s.ok()) {
    return Usage(std::string(s.message()));
  }
  // SIGTERM and SIGINT go to the watcher thread below only: block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // Checked (files readable, valid now, key matching) before anything starts; after the signal
  // mask, since making credentials starts gRPC's threads. The worker's own port takes only peers
  // with a certificate from --tls-ca.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials =
      MakeServerCredentials(*tls, PeerCertificates::kRequired);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> channel_credentials = MakeChannelCredentials(*tls);
  for (const absl::Status& s : {server_credentials.status(), channel_credentials.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "shardserve-worker: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  if (tls->any()) options.channel_credentials = *channel_credentials;

  // The metrics are created once the worker is assigned (they carry its stage and rank), in this
  // registry, which the exposer serves from now on.
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> exposer = ServeMetrics(metrics_listen, metrics_tls, registry);
  if (!exposer.ok()) {
    std::fprintf(stderr, "shardserve-worker: %s\n", std::string(exposer.status().message()).c_str());
    return 1;
  }
  options.metrics_address = (*exposer)->address();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // Not SO_REUSEPORT (gRPC's default): a second server on this port must fail to bind, not share its
  // connections (security/https.h ListenSocketOptions says the same of the HTTP ports).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int port = 0;
  builder.AddListeningPort(listen, *server_credentials, &port);
  // The same server (so the same health status) on a second, plaintext port: the kubelet's gRPC
  // probes cannot present a certificate, and this server holds nothing but health and reflection.
  const std::string health_listen = flags->Get("health-listen");
  int health_port = 0;
  if (!health_listen.empty()) builder.AddListeningPort(health_listen, grpc::InsecureServerCredentials(), &health_port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0 || (!health_listen.empty() && health_port == 0)) {
    std::fprintf(stderr, "shardserve-worker: cannot listen on %s\n",
                 (port == 0 || health_listen.empty() ? listen : health_listen).c_str());
    return 1;
  }
  options.address = absl::StrCat(HostOf(listen), ":", port);
  options.metrics_registry = registry.get();
  LogIds ids;
  ids.node = options.node;
  WorkerLog(absl::StrCat("worker (node ", options.node, ")"),
            absl::StrCat("metrics on ", (*exposer)->url()), ids);
  for (const std::string& note : limit_notes) WorkerLog(absl::StrCat("worker (node ", options.node, ")"), note, ids);
  LogIds warn = ids;
  warn.level = "warn";
  for (const std::string& w : limit_warnings) WorkerLog(absl::StrCat("worker (node ", options.node, ")"), w, warn);
  if (!health_listen.empty()) {
    WorkerLog(absl::StrCat("worker (node ", options.node, ")"),
              absl::StrCat("plaintext health on ", HostOf(health_listen), ":", health_port, " (grpc.health.v1)"), ids);
  }

  WorkerService service(options, server->GetHealthCheckService());
  std::atomic<bool> done{false};
  std::thread watcher([&] {
    const timespec poll = {0, 200 * 1000 * 1000};
    while (!done.load()) {
      const int sig = sigtimedwait(&signals, nullptr, &poll);
      if (sig > 0) {
        WorkerLog(absl::StrCat("worker (node ", options.node, ")"), absl::StrCat("got signal ", sig, ", stopping"), ids);
        service.Stop();
      }
    }
  });
  const absl::Status status = service.Run();
  done.store(true);
  watcher.join();
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  exposer->reset();
  if (!status.ok()) {
    std::fprintf(stderr, "shardserve-worker: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) { return shardserve::Main(argc, argv); }
