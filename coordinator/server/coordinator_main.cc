// shardserve-coordinator: serves a model split across shardserve-worker processes. It waits for
// --nodes x --gpus-per-node workers, plans the layout (TP = workers per node, PP = nodes), has the
// workers load their shards, then serves InferenceService (the client API) and WorkerControl (the
// workers' API) on one port, with grpc.health.v1 (SERVING only while the whole group is loaded
// and healthy) and server reflection. Stops on SIGTERM or SIGINT.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "coordinator/server/inference_service.h"
#include "coordinator/server/log.h"
#include "coordinator/server/metrics.h"
#include "coordinator/server/served_model.h"
#include "coordinator/server/worker_control_service.h"
#include "coordinator/server/worker_pool.h"
#include "kernels/backend.h"

namespace shardserve {
namespace {

constexpr char kUsage[] =
    "usage: shardserve-coordinator --model DIR [--listen HOST:PORT] [--nodes N] [--gpus-per-node G]\n"
    "                              [--max-model-len L] [--collective-timeout-seconds S]\n"
    "                              [--step-timeout-seconds S] [--port-file FILE]\n"
    "                              [--metrics-listen HOST:PORT] [--log-format text|json]\n"
    "                              [--max-num-seqs N] [--max-waiting-requests N] [--max-tokens-per-step T]\n"
    "                              [--num-kv-blocks N] [--block-size B] [--micro-batches K]\n"
    "  --model                       Hugging Face checkpoint directory (the workers must see the\n"
    "                                same path)\n"
    "  --listen                      address for clients and workers; port 0 picks a free port\n"
    "                                (default 127.0.0.1:50051)\n"
    "  --nodes, --gpus-per-node      the group to wait for: N nodes (pipeline stages) of G workers\n"
    "                                (tensor-parallel ranks) each (default 1 and 1)\n"
    "  --max-model-len               longest prompt + completion (default: the model's\n"
    "                                max_position_embeddings)\n"
    "  --collective-timeout-seconds  how long a worker's collective may wait for its peers\n"
    "                                (default 5)\n"
    "  --step-timeout-seconds        how long a step may take before its silent workers are lost\n"
    "                                (default 10)\n"
    "  --port-file                   once listening, write the port to FILE (for scripts and tests)\n"
    "  --metrics-listen              Prometheus /metrics HTTP address; port 0 picks a free port\n"
    "                                (default 127.0.0.1:9400; docs/metrics.md lists the metrics)\n"
    "  --log-format                  text (default) or json: one JSON object per line\n"
    "  --max-num-seqs                sequences in the running batch at most (default 64)\n"
    "  --max-waiting-requests        requests waiting to join it at most; more are refused with\n"
    "                                RESOURCE_EXHAUSTED (default 256)\n"
    "  --max-tokens-per-step         tokens one step carries at most: decodes first, then prefill\n"
    "                                chunks (default 512; at least --max-num-seqs)\n"
    "  --num-kv-blocks               KV-cache blocks per worker (default 0: what the smallest\n"
    "                                worker's memory holds beside its weights, at most 256 MiB of\n"
    "                                cache on CPU workers); the served length is capped to what it holds\n"
    "  --block-size                  tokens per KV-cache block (default 16)\n"
    "  --micro-batches               steps in flight at once (default 0: the number of pipeline\n"
    "                                stages, so that no stage idles; 1: one step at a time)\n";

constexpr char kInferenceServiceName[] = "shardserve.v1.InferenceService";

int Usage(const std::string& error) {
  std::fprintf(stderr, "shardserve-coordinator: %s\n%s", error.c_str(), kUsage);
  return 2;
}

int Fail(const std::string& error) {
  std::fprintf(stderr, "shardserve-coordinator: %s\n", error.c_str());
  return 1;
}

int Main(int argc, char** argv) {
  // `--name value` or `--name=value`; every flag takes a value. Defaults:
  std::map<std::string, std::string> v = {
      {"model", ""},
      {"listen", "127.0.0.1:50051"},
      {"nodes", "1"},
      {"gpus-per-node", "1"},
      {"max-model-len", "0"},
      {"collective-timeout-seconds", "5"},
      {"step-timeout-seconds", "10"},
      {"port-file", ""},
      {"metrics-listen", "127.0.0.1:9400"},
      {"log-format", "text"},
      {"max-num-seqs", "64"},
      {"max-waiting-requests", "256"},
      {"max-tokens-per-step", "512"},
      {"num-kv-blocks", "0"},
      {"block-size", "16"},
      {"micro-batches", "0"},
  };
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (arg.rfind("--", 0) != 0) return Usage(absl::StrCat("unexpected argument '", arg, "'"));
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return Usage(absl::StrCat("flag --", name, " needs a value"));
    }
    if (!v.count(name)) return Usage(absl::StrCat("unknown flag --", name));
    v[name] = value;
  }
  if (v["model"].empty()) return Usage("--model is required");
  LogFormat log_format;
  if (!ParseLogFormat(v["log-format"], &log_format)) return Usage("--log-format must be text or json");
  SetLogFormat(log_format);
  PoolOptions pool_options;
  double collective_timeout = 0, step_timeout = 0;
  if (!absl::SimpleAtoi(v["nodes"], &pool_options.nodes) || pool_options.nodes < 1) {
    return Usage("--nodes must be an integer >= 1");
  }
  if (!absl::SimpleAtoi(v["gpus-per-node"], &pool_options.gpus_per_node) || pool_options.gpus_per_node < 1) {
    return Usage("--gpus-per-node must be an integer >= 1");
  }
  if (!absl::SimpleAtoi(v["max-model-len"], &pool_options.max_model_len) || pool_options.max_model_len < 0) {
    return Usage("--max-model-len must be an integer >= 0 (0: the model's max_position_embeddings)");
  }
  if (!absl::SimpleAtod(v["collective-timeout-seconds"], &collective_timeout) ||
      !(collective_timeout >= 0.001 && collective_timeout <= 3600)) {
    return Usage("--collective-timeout-seconds must be in [0.001, 3600]");
  }
  if (!absl::SimpleAtod(v["step-timeout-seconds"], &step_timeout) || !(step_timeout >= 0.001 && step_timeout <= 3600)) {
    return Usage("--step-timeout-seconds must be in [0.001, 3600]");
  }
  pool_options.collective_timeout = absl::Seconds(collective_timeout);
  EngineOptions engine_options;
  engine_options.step_timeout = absl::Seconds(step_timeout);
  if (!absl::SimpleAtoi(v["max-num-seqs"], &pool_options.max_num_seqs) || pool_options.max_num_seqs < 1 ||
      pool_options.max_num_seqs > 4096) {
    return Usage("--max-num-seqs must be an integer in [1, 4096]");
  }
  if (!absl::SimpleAtoi(v["max-waiting-requests"], &engine_options.max_waiting) || engine_options.max_waiting < 0 ||
      engine_options.max_waiting > 1000000) {
    return Usage("--max-waiting-requests must be an integer in [0, 1000000]");
  }
  if (!absl::SimpleAtoi(v["max-tokens-per-step"], &pool_options.max_tokens_per_step) ||
      pool_options.max_tokens_per_step < pool_options.max_num_seqs || pool_options.max_tokens_per_step > 65536) {
    return Usage(absl::StrCat("--max-tokens-per-step must be an integer in [--max-num-seqs (",
                              pool_options.max_num_seqs, "), 65536], so that every running sequence's decode fits "
                              "in one step"));
  }
  if (!absl::SimpleAtoi(v["num-kv-blocks"], &pool_options.num_kv_blocks) || pool_options.num_kv_blocks < 0 ||
      pool_options.num_kv_blocks > (int64_t{1} << 24)) {
    return Usage("--num-kv-blocks must be an integer in [0, 16777216] (0: from the workers' memory)");
  }
  if (!absl::SimpleAtoi(v["block-size"], &pool_options.block_size) || pool_options.block_size < 1 ||
      pool_options.block_size > 1024) {
    return Usage("--block-size must be an integer in [1, 1024]");
  }
  if (pool_options.num_kv_blocks * pool_options.block_size > kMaxKvCacheTokens) {
    return Usage(absl::StrCat("--num-kv-blocks x --block-size must be at most ", kMaxKvCacheTokens,
                              " tokens (KV cache slots are 32-bit)"));
  }
  if (!absl::SimpleAtoi(v["micro-batches"], &engine_options.micro_batches) || engine_options.micro_batches < 0 ||
      engine_options.micro_batches > 64) {
    return Usage("--micro-batches must be an integer in [0, 64] (0: one per pipeline stage)");
  }

  // SIGTERM and SIGINT are taken by sigwait below only: block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<ServedModel>> model = ServedModel::Open(v["model"]);
  if (!model.ok()) return Fail(std::string(model.status().message()));
  absl::StatusOr<std::unique_ptr<WorkerPool>> pool = WorkerPool::Create(model->get(), pool_options);
  if (!pool.ok()) return Fail(std::string(pool.status().message()));
  CoordinatorLog("model", absl::StrCat((*model)->name, " (", (*model)->config.architecture_name, ", ",
                                       (*model)->config.num_hidden_layers, " layers, max_model_len ",
                                       (*pool)->max_model_len(), ")",
                                       (*model)->tokenizer ? "" : "; no tokenizer.json: token-id prompts only"));

  CoordinatorMetrics metrics((*model)->name);
  (*pool)->SetMetrics(&metrics);
  absl::Cleanup unset_metrics = [&] { (*pool)->SetMetrics(nullptr); };  // metrics die before the pool
  std::string metrics_address;
  absl::StatusOr<std::unique_ptr<MetricsServer>> exposer =
      ServeMetrics(v["metrics-listen"], metrics.registry(), &metrics_address);
  if (!exposer.ok()) return Fail(std::string(exposer.status().message()));
  CoordinatorLog("server", absl::StrCat("metrics on http://", metrics_address, "/metrics"));

  Engine engine(model->get(), pool->get(), engine_options, &metrics);
  InferenceService inference(model->get(), pool->get(), &engine, &metrics);
  WorkerControlService control(pool->get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(v["listen"], grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&inference);
  builder.RegisterService(&control);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return Fail(absl::StrCat("cannot listen on ", v["listen"]));
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  (*pool)->SetServingListener([health](bool serving) {
    health->SetServingStatus(kInferenceServiceName, serving);
    health->SetServingStatus(serving);
  });
  if (!v["port-file"].empty()) {
    const std::string tmp = v["port-file"] + ".tmp";
    std::ofstream(tmp) << port << "\n";
    if (std::rename(tmp.c_str(), v["port-file"].c_str()) != 0) {
      return Fail(absl::StrCat("cannot write --port-file ", v["port-file"]));
    }
  }
  const std::string listen = v["listen"];
  CoordinatorLog("server", absl::StrCat("listening on ", listen.substr(0, listen.rfind(':')), ":", port,
                                        "; waiting for ", pool_options.nodes, " nodes x ", pool_options.gpus_per_node,
                                        " workers"));

  int sig = 0;
  sigwait(&signals, &sig);
  CoordinatorLog("server", absl::StrCat("got signal ", sig, ", shutting down"));
  engine.Shutdown();
  control.Shutdown();
  (*pool)->Shutdown("the coordinator is shutting down");
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  server.reset();
  exposer->reset();
  return 0;
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) { return shardserve::Main(argc, argv); }
