// shardserve-coordinator: serves a model split across shardserve-worker processes. It waits for
// --nodes x --gpus-per-node workers, plans the layout (TP = workers per node, PP = nodes), has the
// workers load their shards, then serves InferenceService (the client API) and WorkerControl (the
// workers' API) on one port, with grpc.health.v1 (SERVING only while the whole group is loaded
// and healthy) and server reflection. Stops on SIGTERM or SIGINT.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/flags.h"
#include "coordinator/api/openai/http_server.h"
#include "coordinator/api/inference_service.h"
#include "coordinator/telemetry/log.h"
#include "coordinator/telemetry/metrics.h"
#include "coordinator/model/served_model.h"
#include "coordinator/cluster/worker_control_service.h"
#include "coordinator/cluster/worker_pool.h"
#include "model/config.h"
#include "model/families/registry.h"
#include "model/weight_source.h"
#include "security/api_keys.h"
#include "security/tls.h"

namespace shardserve {
namespace {

constexpr char kUsage[] =
    "usage: shardserve-coordinator --model DIR [--listen HOST:PORT] [--nodes N] [--gpus-per-node G]\n"
    "                              [--max-model-len L] [--collective-timeout-seconds S]\n"
    "                              [--step-timeout-seconds S] [--heal-timeout-seconds S]\n"
    "                              [--port-file FILE]\n"
    "                              [--metrics-listen HOST:PORT] [--log-format text|json]\n"
    "                              [--max-num-seqs N] [--max-waiting-requests N] [--max-tokens-per-step T]\n"
    "                              [--num-kv-blocks N] [--block-size B] [--micro-batches K]\n"
    "                              [--quantization none|int8|int4|fp8] [--load-format auto|dummy] [--dummy-seed N]\n"
    "                              [--tls-cert FILE --tls-key FILE [--tls-ca FILE]] [--api-keys-file FILE]\n"
    "                              [--insecure]\n"
    "                              [--http-port P] [--http-port-file FILE] [--http-host HOST]\n"
    "                              [--http-max-body-bytes N] [--http-responses-store-bytes N]\n"
    "                              [--http-plaintext] [--metrics-plaintext]\n"
    "                              [--tool-call-parser NAME] [--reasoning-parser NAME]\n"
    "                              [--no-prefix-caching] [--no-async-scheduling] [--expert-parallel]\n"
    "                              [--speculative ngram|draft|mtp|eagle3 --num-speculative-tokens K]\n"
    "                              [--draft-model DIR]\n"
    "                              [--speculative-max-running N] [--adaptive-speculative-tokens]\n"
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
    "                                (default 60: a loaded CPU worker can take 10 s on one step;\n"
    "                                a dead or frozen worker is found sooner, by its stream or\n"
    "                                its heartbeats)\n"
    "  --heal-timeout-seconds        how long requests wait for a group that heals around a lost\n"
    "                                worker (a replacement registers from its node) before they fail\n"
    "                                with UNAVAILABLE naming the slot (default 60; docs/healing.md)\n"
    "  --port-file                   once listening, write the port to FILE (for scripts and tests)\n"
    "  --metrics-listen              Prometheus /metrics HTTP address; port 0 picks a free port\n"
    "                                (default 127.0.0.1:9400; docs/metrics.md lists the metrics);\n"
    "                                HTTPS with --tls-cert/--tls-key (re-read when they change)\n"
    "  --metrics-plaintext           serve /metrics in plain HTTP even with --tls-cert (what launch does\n"
    "                                with its throw-away certificates; loopback only unless --insecure)\n"
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
    "                                stages, so that no stage idles; 1: one step at a time)\n"
    "  --quantization                how the workers store the linear layers' weights: none (default,\n"
    "                                the checkpoint's precision), int8 (per output channel), int4\n"
    "                                (groups of 128 inputs, scale + zero point) or fp8 (e4m3, per\n"
    "                                output channel), quantized at load,\n"
    "                                each worker its own slice; CPU workers only for now\n"
    "  --load-format                 auto (default): the checkpoint's safetensors; dummy: weights made\n"
    "                                from config.json alone and a seed, each worker its own slice (as\n"
    "                                vLLM's; --model may hold only config.json: token-id prompts)\n"
    "  --dummy-seed                  the dummy weights' seed (default 0; --load-format dummy only)\n"
    "  --tls-cert, --tls-key         serve TLS with this certificate and key (PEM), re-read when the\n"
    "                                files change (docs/security.md)\n"
    "  --tls-ca                      mutual TLS: workers (Connect, rendezvous) must present a\n"
    "                                certificate from this CA; clients of the client API need none\n"
    "  --api-keys-file               clients must send one of these keys (one per line) as\n"
    "                                'authorization: Bearer <key>'; re-read when the file changes\n"
    "  --insecure                    allow plaintext on a --listen or --metrics-listen address beyond\n"
    "                                loopback, and the HTTP API beyond loopback without HTTPS and API keys\n"
    "  --http-port                   serve the OpenAI-compatible HTTP API (/v1/chat/completions,\n"
    "                                /v1/completions, /v1/models, /health) on this port (default 0: off);\n"
    "                                HTTPS with --tls-cert/--tls-key (no client certificate asked), and\n"
    "                                'Authorization: Bearer <key>' required with --api-keys-file\n"
    "                                (/health stays open)\n"
    "  --http-port-file              serve the HTTP API and, once it listens, write its port to FILE;\n"
    "                                without --http-port on a free port (for scripts and tests)\n"
    "  --http-host                   the HTTP API's address (default 127.0.0.1; 0.0.0.0: every interface,\n"
    "                                which needs HTTPS and --api-keys-file, or --insecure)\n"
    "  --http-plaintext              serve the HTTP API in plain HTTP even with --tls-cert (what launch\n"
    "                                does with its throw-away certificates; loopback only unless --insecure)\n"
    "  --http-max-body-bytes         larger request bodies are refused with 413 (default 8388608: 8 MiB)\n"
    "                                (the HTTP API serves --max-num-seqs + --max-waiting-requests + 32\n"
    "                                connections at once, at most 4096; one more is answered 503 at once)\n"
    "  --http-responses-store-bytes  /v1/responses' stored responses (what previous_response_id continues)\n"
    "                                kept within N bytes, the least recently used dropped first (default\n"
    "                                134217728: 128 MiB; 0: none stored)\n"
    "  --tool-call-parser            how chat outputs' tool calls are read: hermes (Hermes, Qwen2.5, Qwen3),\n"
    "                                llama3_json (Llama 3.x), mistral, deepseek_v3 (DeepSeek-V3, R1, V3.1),\n"
    "                                kimi_k2 (Kimi K2), qwen3_coder (Qwen3-Coder), glm45 (GLM-4.5 to\n"
    "                                4.7), openai (gpt-oss's harmony), or none (no parsing); default:\n"
    "                                the format the chat template writes (docs/api.md)\n"
    "  --reasoning-parser            reasoning returned as reasoning_content: qwen3, deepseek_r1, glm45\n"
    "                                (<think>), openai_gptoss (gpt-oss's harmony), or none; default: on\n"
    "                                when the chat template writes <think> or <|channel|>\n"
    "  --http-max-connections-per-peer\n"
    "                                HTTP connections open at once from one client address; the next is\n"
    "                                answered 503 (default: all of the above but 16, kept for other\n"
    "                                clients and probes; behind a proxy all clients share its address)\n"
    "  --no-prefix-caching           turn automatic prefix caching off: by default, full KV blocks are\n"
    "                                kept after their request (evicted least recently used) and a\n"
    "                                request whose first tokens match reuses them instead of computing\n"
    "                                them again (docs/prefix-caching.md)\n"
    "  --no-async-scheduling         send each step only once the one before is back: by default, a group\n"
    "                                of one stage (TP 1 or more) gets its next step while it runs one,\n"
    "                                feeding the tokens that one samples (without speculative decoding)\n"
    "  --expert-parallel             mixture-of-experts models: each TP rank holds whole experts (a block\n"
    "                                of them) and tokens travel to their experts' ranks by all-to-all,\n"
    "                                instead of every expert split over the ranks (docs/moe.md); refused\n"
    "                                for a model without experts\n"
    "  --speculative ngram           speculative decoding with the n-gram (prompt lookup) proposer:\n"
    "                                guesses from the sequence's own earlier text, verified in one\n"
    "                                step; outputs unchanged (docs/speculative-decoding.md)\n"
    "  --speculative draft           ... with a draft model (--draft-model), run by the worker that\n"
    "                                samples right after sampling, in the same step\n"
    "  --speculative mtp             ... with the model's own multi-token-prediction layer\n"
    "                                (DeepSeek-V3's num_nextn_predict_layers), run by that worker over\n"
    "                                every step's hidden states\n"
    "  --speculative eagle3          ... with an EAGLE-3 head (--draft-model: its directory), run by\n"
    "                                that worker over the hidden states of three of the model's layers\n"
    "  --draft-model DIR             the draft's checkpoint (same tokenizer and vocabulary as --model),\n"
    "                                or the EAGLE-3 head's, as the workers see it\n"
    "  --num-speculative-tokens K    guesses per sequence per step, 1 to 16 (with --speculative)\n"
    "  --speculative-max-running N   no guesses in a step while N or more sequences run (default 8;\n"
    "                                0: no limit): a large batch is compute-bound already\n"
    "  --adaptive-speculative-tokens each sequence's guesses adapt to what it accepts: 2 more after a\n"
    "                                step that accepted all (up to K), 1 fewer after one that did not\n";

constexpr char kInferenceServiceName[] = "shardserve.v1.InferenceService";

int Usage(const std::string& error) {
  std::fprintf(stderr, "shardserve-coordinator: %s\n%s", error.c_str(), kUsage);
  return 2;
}

int Fail(const std::string& error) {
  std::fprintf(stderr, "shardserve-coordinator: %s\n", error.c_str());
  return 1;
}

// A warning about the server's own set-up (a key file kept, a refused TLS peer): one log line.
void ServerWarning(absl::string_view message) {
  LogIds ids;
  ids.level = "warn";
  CoordinatorLog("server", message, ids);
}

// Writes `port` and a newline to `path` whole (through a rename), so that a reader never sees a
// part of it. False when it cannot.
bool WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << port << "\n";
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> flags =
      Flags::Parse(argc, argv,
                   {"model", "listen", "nodes", "gpus-per-node", "max-model-len", "collective-timeout-seconds",
                    "step-timeout-seconds", "heal-timeout-seconds", "port-file", "metrics-listen", "log-format", "max-num-seqs",
                    "max-waiting-requests", "max-tokens-per-step", "num-kv-blocks", "block-size", "micro-batches",
                    "quantization", "load-format", "dummy-seed", "tls-cert", "tls-key", "tls-ca", "api-keys-file",
                    "http-port", "http-port-file", "http-host", "http-max-body-bytes", "http-max-connections-per-peer",
                    "http-responses-store-bytes",
                    "tool-call-parser", "reasoning-parser", "speculative", "num-speculative-tokens", "speculative-max-running",
                    "draft-model"},
                   {"help", "insecure", "no-prefix-caching", "no-async-scheduling", "http-plaintext", "metrics-plaintext",
                    "expert-parallel",
                    "adaptive-speculative-tokens"});
  if (!flags.ok()) return Usage(std::string(flags.status().message()));
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  const std::string model_dir = flags->Get("model");
  const std::string listen = flags->Get("listen", "127.0.0.1:50051");
  const std::string port_file = flags->Get("port-file");
  const std::string http_port_file = flags->Get("http-port-file");
  if (model_dir.empty()) return Usage("--model is required");
  std::string log_format_name = "text";
  LogFormat log_format;
  PoolOptions pool_options;
  EngineOptions engine_options;
  double collective_timeout = 5, step_timeout = 60, heal_timeout = 60;
  openai::HttpServerOptions http_options;
  int64_t http_port = 0;
  int64_t http_per_peer = 0;
  http_options.host = flags->Get("http-host", "127.0.0.1");
  http_options.tool_call_parser = flags->Get("tool-call-parser");
  http_options.reasoning_parser = flags->Get("reasoning-parser");
  if (flags->Has("tool-call-parser")) {
    if (absl::Status s = openai::ToolCallFormatFromName(http_options.tool_call_parser).status(); !s.ok()) {
      return Usage(absl::StrCat("flag --tool-call-parser: ", s.message()));
    }
  }
  if (flags->Has("reasoning-parser")) {
    if (absl::Status s = openai::ReasoningFormatFromName(http_options.reasoning_parser).status(); !s.ok()) {
      return Usage(absl::StrCat("flag --reasoning-parser: ", s.message()));
    }
  }
  for (const absl::Status& s : {
           flags->OneOf("log-format", {"text", "json"}, &log_format_name),
           flags->Int("nodes", 1, 4096, &pool_options.nodes),
           flags->Int("gpus-per-node", 1, 4096, &pool_options.gpus_per_node),
           flags->Int("max-model-len", 0, int64_t{1} << 31, &pool_options.limits.max_model_len),
           flags->Double("collective-timeout-seconds", 0.001, 3600, &collective_timeout),
           flags->Double("step-timeout-seconds", 0.001, 3600, &step_timeout),
           flags->Double("heal-timeout-seconds", 0, 86400, &heal_timeout),
           flags->Int("max-num-seqs", 1, 4096, &pool_options.limits.max_seqs_per_step),
           flags->Int("max-waiting-requests", 0, 1000000, &engine_options.max_waiting),
           flags->Int("max-tokens-per-step", 1, 65536, &pool_options.limits.max_tokens_per_step),
           flags->Int("num-kv-blocks", 0, int64_t{1} << 24, &pool_options.limits.num_kv_blocks),
           flags->Int("block-size", 1, 1024, &pool_options.limits.block_size),
           flags->Int("micro-batches", 0, 64, &engine_options.micro_batches),
           flags->Int("http-port", 0, 65535, &http_port),
           flags->Int("http-max-body-bytes", 1024, int64_t{1} << 32, &http_options.max_body_bytes),
           flags->Int("http-max-connections-per-peer", 1, openai::kMaxHttpThreads, &http_per_peer),
           flags->Int("http-responses-store-bytes", 0, int64_t{1} << 40, &http_options.responses_store_bytes),
           flags->OneOf("speculative", {"ngram", "draft", "mtp", "eagle3"}, &engine_options.speculative),
           flags->Int("num-speculative-tokens", 1, kMaxSpeculativeTokens, &engine_options.num_speculative_tokens),
           flags->Int("speculative-max-running", 0, 4096, &engine_options.speculative_max_running),
       }) {
    if (!s.ok()) return Usage(std::string(s.message()));
  }
  const absl::StatusOr<WeightQuant> quant = ParseWeightQuant(flags->Get("quantization", "none"));
  if (!quant.ok()) return Usage(absl::StrCat("flag --", quant.status().message()));
  pool_options.weight_quant = *quant;
  pool_options.expert_parallel = flags->Has("expert-parallel");
  std::string load_format = "auto";
  if (absl::Status s = flags->OneOf("load-format", {"auto", "dummy"}, &load_format); !s.ok()) {
    return Usage(std::string(s.message()));
  }
  pool_options.load_format = *ParseLoadFormat(load_format);
  if (flags->Has("dummy-seed") && pool_options.load_format != LoadFormat::kDummy) {
    return Usage("flag --dummy-seed needs --load-format dummy");
  }
  if (absl::Status s = flags->Int("dummy-seed", 0, INT64_MAX, &pool_options.dummy_seed); !s.ok()) {
    return Usage(std::string(s.message()));
  }
  ParseLogFormat(log_format_name, &log_format);
  SetLogFormat(log_format);
  pool_options.collective_timeout = absl::Seconds(collective_timeout);
  engine_options.step_timeout = absl::Seconds(step_timeout);
  engine_options.heal_timeout = absl::Seconds(heal_timeout);
  engine_options.prefix_caching = !flags->Has("no-prefix-caching");
  engine_options.async_scheduling = !flags->Has("no-async-scheduling");
  engine_options.draft_model = flags->Get("draft-model");
  engine_options.adaptive_speculative_tokens = flags->Has("adaptive-speculative-tokens");
  if (absl::Status s = CheckSpeculativeOptions(engine_options); !s.ok()) return Usage(std::string(s.message()));
  if (absl::Status s = pool_options.limits.Validate(); !s.ok()) return Usage(std::string(s.message()));
  const absl::StatusOr<TlsFiles> tls = TlsFilesFromFlags(*flags);
  if (!tls.ok()) return Usage(std::string(tls.status().message()));
  if (absl::Status s = CheckPlaintextListen(listen, tls->has_identity(), flags->Has("insecure")); !s.ok()) {
    return Usage(std::string(s.message()));
  }
  // /metrics: HTTPS with the gRPC port's certificate (unless --metrics-plaintext).
  const std::string metrics_listen = flags->Get("metrics-listen", "127.0.0.1:9400");
  const TlsFiles metrics_tls = flags->Has("metrics-plaintext") ? TlsFiles{} : TlsFiles{tls->cert, tls->key, ""};
  if (absl::Status s = CheckMetricsListen(metrics_listen, metrics_tls.has_identity(), flags->Has("insecure")); !s.ok()) {
    return Usage(std::string(s.message()));
  }
  std::unique_ptr<ApiKeys> api_keys;
  if (flags->Has("api-keys-file")) {
    absl::StatusOr<std::unique_ptr<ApiKeys>> keys = ApiKeys::Load(flags->Get("api-keys-file"), ServerWarning);
    if (!keys.ok()) return Fail(std::string(keys.status().message()));
    api_keys = *std::move(keys);
  }
  // The HTTP API: HTTPS with the gRPC port's certificate (unless --http-plaintext), and the same keys.
  const bool http_tls = tls->has_identity() && !flags->Has("http-plaintext");
  const bool serve_http = http_port > 0 || !http_port_file.empty();
  if (serve_http) {
    if (absl::Status s = CheckHttpListen(http_options.host, http_tls, api_keys != nullptr, flags->Has("insecure"));
        !s.ok()) {
      return Usage(std::string(s.message()));
    }
    if (http_tls) {
      http_options.tls_cert = tls->cert;
      http_options.tls_key = tls->key;
    }
    http_options.api_keys = api_keys.get();
  }

  // SIGTERM and SIGINT are taken by sigwait below only: block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A write to a client that went away is an error to handle, not a reason to die.
  signal(SIGPIPE, SIG_IGN);

  // A plaintext worker dialling the TLS port, or one whose certificate does not verify, is a log
  // line of ours, not only gRPC's (the coordinator dials nobody over gRPC, so every failed
  // handshake is a peer's). Before gRPC's threads start.
  if (tls->has_identity()) {
    ReportTlsRefusals(ServerWarning);
  }
  // Checked (files readable, valid now, key matching) before anything starts. After the signal
  // mask: making credentials starts gRPC's threads, which must not take SIGTERM.
  const absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(*tls, PeerCertificates::kVerifyIfGiven);
  if (!credentials.ok()) return Fail(std::string(credentials.status().message()));

  absl::StatusOr<std::unique_ptr<ServedModel>> model = ServedModel::Open(model_dir, pool_options.load_format);
  if (!model.ok()) return Fail(std::string(model.status().message()));
  if (!engine_options.draft_model.empty()) {
    // A draft model must speak the model's vocabulary (the worker that loads it checks again). An
    // EAGLE-3 head reads the model's hidden states at a few layers, which every stage keeps and passes
    // on; the worker that samples loads it and checks its tensors.
    std::error_code ec;
    const std::filesystem::path draft = std::filesystem::absolute(engine_options.draft_model, ec);
    absl::StatusOr<ModelConfig> draft_config = LoadModelConfig(draft);
    if (!draft_config.ok()) return Fail(absl::StrCat("--draft-model: ", draft_config.status().message()));
    const bool head = draft_config->eagle3.has_value();
    if (head != (engine_options.speculative == "eagle3")) {
      return Fail(head ? absl::StrCat("--draft-model ", engine_options.draft_model,
                                      " is an EAGLE-3 head, which --speculative eagle3 runs")
                       : absl::StrCat("--draft-model ", engine_options.draft_model, " is a model (",
                                      draft_config->architecture_name,
                                      "), not an EAGLE-3 head (LlamaForCausalLMEagle3); --speculative draft runs it"));
    }
    if (head) {
      absl::StatusOr<std::vector<int64_t>> aux = Eagle3AuxLayers(*draft_config, (*model)->config);
      if (!aux.ok()) {
        return Fail(absl::StrCat("--draft-model ", engine_options.draft_model, ": ", aux.status().message()));
      }
      // (whether it has an embedding of its own, which the plan counts where it cannot share the model's)
      absl::StatusOr<std::unique_ptr<WeightSource>> tensors =
          OpenWeightSource(draft, *draft_config, pool_options.load_format, 0);
      if (!tensors.ok()) {
        return Fail(absl::StrCat("--draft-model ", engine_options.draft_model, ": ", tensors.status().message()));
      }
      NoteEagle3Embedding(**tensors, &*draft_config);
      pool_options.speculative_eagle3 = true;
      pool_options.aux_hidden_layers = *aux;
      CoordinatorLog("model", absl::StrCat("speculative decoding with the EAGLE-3 head ", draft.string(),
                                           " over the hidden states of layers ", absl::StrJoin(*aux, ", "),
                                           ", run by the worker that samples"));
    } else {
      if (draft_config->vocab_size != (*model)->config.vocab_size) {
        return Fail(absl::StrCat("--draft-model ", engine_options.draft_model, " has a vocabulary of ",
                                 draft_config->vocab_size, " ids but --model ", model_dir, " has ",
                                 (*model)->config.vocab_size,
                                 "; a draft must share the model's tokenizer and vocabulary"));
      }
      CoordinatorLog("model", absl::StrCat("speculative decoding with the draft model ", draft.string(), " (",
                                           draft_config->architecture_name, ", ", draft_config->num_hidden_layers,
                                           " layers), run by the worker that samples"));
    }
    pool_options.draft_model_path = draft.string();
    pool_options.draft_config = *draft_config;
  }
  if (engine_options.speculative == "mtp") {
    // The model's own multi-token-prediction layer; the worker that loads it checks its tensors.
    const ModelConfig& c = (*model)->config;
    if (c.num_nextn_predict_layers <= 0) {
      return Fail(absl::StrCat("--speculative mtp needs a model with a multi-token-prediction layer, but ", model_dir,
                               "'s config.json (", c.architecture_name, ") has no num_nextn_predict_layers",
                               c.family != nullptr && c.family->mtp_weights != nullptr ? " above 0" : " this server reads",
                               "; use --speculative draft or ngram"));
    }
    if (pool_options.load_format != LoadFormat::kDummy) {
      for (const WeightDecl& w : MtpWeights(c)) {
        if (w.layer != c.num_hidden_layers || w.role == WeightRole::kLmHead) continue;  // the head may be the model's
        if ((*model)->checkpoint != nullptr && !IsCheckpointQuantized(c, w) && !(*model)->checkpoint->Find(w.name).ok()) {
          return Fail(absl::StrCat("--speculative mtp: the checkpoint ", model_dir, " has no tensor \"", w.name,
                                   "\" of the multi-token-prediction layer that config.json's num_nextn_predict_layers (",
                                   c.num_nextn_predict_layers, ") announces; it leaves the layer's weights out"));
        }
      }
    }
    pool_options.speculative_mtp = true;
    CoordinatorLog("model", absl::StrCat("speculative decoding with the model's multi-token-prediction layer ",
                                         c.num_hidden_layers, ", run by the worker that samples"));
  }
  absl::StatusOr<std::unique_ptr<WorkerPool>> pool = WorkerPool::Create(model->get(), pool_options);
  if (!pool.ok()) return Fail(std::string(pool.status().message()));
  CoordinatorLog("model", absl::StrCat((*model)->name, " (", (*model)->config.architecture_name, ", ",
                                       (*model)->config.num_hidden_layers, " layers, max_model_len ",
                                       (*pool)->max_model_len(), ")",
                                       (*model)->tokenizer
                                           ? std::string()
                                           : absl::StrCat("; no tokenizer (", kTokenizerFiles,
                                                          "): token-id prompts only"),
                                       pool_options.load_format == LoadFormat::kDummy
                                           ? absl::StrCat("; dummy weights, seed ", pool_options.dummy_seed)
                                           : ""));

  if ((*model)->chat_template == nullptr && !absl::IsNotFound((*model)->chat_template_status)) {
    CoordinatorLog("model", absl::StrCat("its chat template cannot be used, chat requests will be refused: ",
                                         (*model)->chat_template_status.message()));
  }
  CoordinatorMetrics metrics((*model)->name);
  (*pool)->SetMetrics(&metrics);
  absl::Cleanup unset_metrics = [&] { (*pool)->SetMetrics(nullptr); };  // metrics die before the pool
  absl::StatusOr<std::unique_ptr<MetricsServer>> exposer = ServeMetrics(metrics_listen, metrics_tls, metrics.registry());
  if (!exposer.ok()) return Fail(std::string(exposer.status().message()));
  CoordinatorLog("server", absl::StrCat("metrics on ", (*exposer)->url()));

  Engine engine(model->get(), pool->get(), engine_options, &metrics);
  InferenceService inference(model->get(), pool->get(), &engine, &metrics, api_keys.get());
  WorkerControlService control(pool->get(), /*require_client_certificate=*/!tls->ca.empty(), &metrics);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // Not SO_REUSEPORT (gRPC's default): a second server on this port must fail to bind, not share its
  // connections (security/https.h ListenSocketOptions says the same of the HTTP ports).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int port = 0;
  builder.AddListeningPort(listen, *credentials, &port);
  builder.RegisterService(&inference);
  builder.RegisterService(&control);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return Fail(absl::StrCat("cannot listen on ", listen));
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  (*pool)->SetServingListener([health](bool serving) {
    health->SetServingStatus(kInferenceServiceName, serving);
    health->SetServingStatus(serving);
  });
  std::unique_ptr<openai::HttpServer> http;
  if (serve_http) {
    http_options.port = static_cast<int>(http_port);  // 0: a free port (--http-port-file alone)
    // A thread per connection: one for every request the engine takes at once (running and
    // waiting; more are refused with 429), and some for probes and idle keep-alive connections.
    http_options.threads = static_cast<int>(std::min<int64_t>(
        openai::kMaxHttpThreads,
        pool_options.limits.max_seqs_per_step + engine_options.max_waiting + openai::kSpareHttpThreads));
    http_options.max_connections_per_peer =
        http_per_peer > 0 ? static_cast<int>(http_per_peer)
                          : std::max(1, http_options.threads - openai::kSpareHttpThreads / 2);
    absl::StatusOr<std::unique_ptr<openai::HttpServer>> started =
        openai::HttpServer::Start(model->get(), pool->get(), &engine, &metrics, http_options);
    if (!started.ok()) return Fail(std::string(started.status().message()));
    http = *std::move(started);
    const bool v6 = http_options.host.find(':') != std::string::npos && http_options.host.front() != '[';
    CoordinatorLog("server", absl::StrCat("OpenAI API on ", http->https() ? "https://" : "http://",
                                          v6 ? absl::StrCat("[", http_options.host, "]") : http_options.host, ":",
                                          http->port(), "/v1", api_keys != nullptr ? " (API keys required)" : "",
                                          (*model)->chat_template ? "" : "; the model has no chat template"));
    if (!http_port_file.empty() && !WritePortFile(http_port_file, http->port())) {
      return Fail(absl::StrCat("cannot write --http-port-file ", http_port_file));
    }
  }
  // Last: a script that waits for this file finds every server listening.
  if (!port_file.empty() && !WritePortFile(port_file, port)) {
    return Fail(absl::StrCat("cannot write --port-file ", port_file));
  }
  CoordinatorLog("server", absl::StrCat("listening on ", listen.substr(0, listen.rfind(':')), ":", port,
                                        !tls->has_identity() ? " (plaintext)"
                                        : tls->ca.empty()    ? " (TLS)"
                                                             : " (TLS; workers need a certificate from --tls-ca)",
                                        api_keys != nullptr ? absl::StrCat(", ", api_keys->size(), " API key(s)") : "",
                                        "; waiting for ", pool_options.nodes, " nodes x ", pool_options.gpus_per_node,
                                        " workers"));

  int sig = 0;
  sigwait(&signals, &sig);
  CoordinatorLog("server", absl::StrCat("got signal ", sig, ", shutting down"));
  engine.Shutdown();  // ends every stream, so that HTTP handlers return
  if (http) http->Stop();
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
