// shardserve bench: a load generator against a running coordinator, in the manner of vLLM's
// benchmark_serving. Random prompts of token ids (from the model's vocabulary, never an EOS id,
// the same for the same --seed), every request with ignore_eos (with --json-schema, a JSON Schema
// constraint instead) and max_tokens = its output length, so that each produces exactly that many
// tokens. Closed loop (--concurrency N streams, each sending its next request when the previous
// ends) or open loop (--request-rate R: Poisson arrivals).
// Measures time to first token, inter-token latency, end-to-end latency and throughput.
//
// --compare LAYOUTS runs the same load against one local cluster per layout (tools/cli/local_cluster.h,
// the machinery of `shardserve launch`), records each worker's peak RSS and weight bytes, and prints
// the layouts side by side.
//
// Threads: gRPC's sync API, one thread per closed-loop stream or per open-loop request; the main
// thread dispatches, watches for Ctrl-C (then cancels every request in flight) and joins them.
//
// This file: the usage text, the flags and Run. The load generator is in bench_load.cc, the tables
// and JSON in bench_report.cc, --compare's clusters in bench_compare.cc (shared types: bench.h).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "tools/cli/bench.h"
#include "tools/cli/client.h"
#include "tools/cli/command.h"
#include "base/flags.h"
#include "tools/cli/local_cluster.h"

namespace shardserve::cli::bench {

std::atomic<bool> g_stop{false};
static_assert(std::atomic<bool>::is_always_lock_free);

namespace {

namespace fs = std::filesystem;

constexpr char kUsage[] =
    "usage: shardserve bench [--address HOST:PORT] [--concurrency N | --request-rate R] [--num-requests M]\n"
    "                        [--input-len I] [--output-len O] [--range-ratio X] [--seed S] [--temperature T]\n"
    "                        [--warmup K] [--timeout-seconds S] [--json] [--json-out FILE]\n"
    "                        [--chat-turns T [--system-prompt-len S]] [--json-schema FILE]\n"
    "       shardserve bench --backend openai --base-url URL --vocab-size V [--model NAME] [--api-key KEY]\n"
    "                        [load flags as above]\n"
    "       shardserve bench --compare LAYOUTS [--model DIR] [--device cpu|cuda] [--worker-threads N]\n"
    "                        [--worker-memory-gb G]\n"
    "                        [--worker-matmul-dtype auto|f32|bf16] [--log-dir DIR] [--ready-timeout-seconds S]\n"
    "                        [--max-model-len L] [--quantization none|int8|int4|fp8] [--load-format auto|dummy]\n"
    "                        [--activation-quantization auto|none|int8|int16]\n"
    "                        [--dummy-seed N] [--worker-collectives auto|gloo|nccl] [--worker-dummy-weights host|device]\n"
    "                        [--max-num-seqs N] [--max-waiting-requests N] [--max-tokens-per-step T]\n"
    "                        [--num-kv-blocks N] [--micro-batches K] [--block-size B] [--no-prefix-caching]\n"
    "                        [--no-async-scheduling] [--expert-parallel] [--heal-timeout-seconds S]\n"
    "                        [--speculative ngram|draft|mtp|eagle3] [--num-speculative-tokens K] [--speculative-max-running N]\n"
    "                        [--adaptive-speculative-tokens]\n"
    "                        [--draft-model DIR]\n"
    "                        [--worker-no-cuda-quantized-kernels] [--worker-no-cuda-graphs]\n"
    "                        [--worker-no-cuda-split-attention] [--worker-no-cuda-fused-kernels]\n"
    "                        [--worker-no-cuda-dense-gemv]\n"
    "                        [--worker-cuda-int4-mma] [--worker-cuda-pdl] [--worker-cuda-fp8-gemm]\n"
    "                        [--worker-cuda-int4-folded] [--worker-cuda-moe-grouped]\n"
    "                        [load flags as above]\n"
    "  Sends M requests of random prompt token ids to the coordinator and reports throughput and\n"
    "  latency. Every request has max_tokens = its output length and ignore_eos (with --json-schema, a\n"
    "  JSON Schema instead); one that fails or returns fewer tokens counts as failed (each distinct\n"
    "  error is shown once, with its count).\n"
    "  --address, --tls-ca, --tls-cert, --tls-key, --api-key, --insecure  the coordinator and how to\n"
    "                     reach it, as for `shardserve generate --help`\n"
    "  --backend          grpc (default): the coordinator's gRPC API at --address; openai: any\n"
    "                     OpenAI-compatible HTTP server at --base-url (http://HOST:PORT/v1): each request\n"
    "                     is POST /completions with the prompt as token ids (shardserve, vLLM and\n"
    "                     llama.cpp's server take them; a server that takes only text cannot be driven),\n"
    "                     max_tokens, ignore_eos, stream with stream_options.include_usage, one keep-alive\n"
    "                     connection per stream. TTFT is the first SSE chunk with text; ITL is one gap per\n"
    "                     chunk with text (a chunk may carry several tokens, counted as one gap); tokens\n"
    "                     are counted from usage.completion_tokens. A refused connection, a non-200, a\n"
    "                     malformed stream or a read stalled past --timeout-seconds fails the request.\n"
    "                     With --chat-turns: POST /chat/completions with the conversation as text\n"
    "                     messages (system, user, assistant, ...), each message --input-len words (and the\n"
    "                     system prompt --system-prompt-len words) from a list of common English words,\n"
    "                     about one token each; input tokens are the server's usage.prompt_tokens;\n"
    "                     --vocab-size is then not needed\n"
    "  --base-url         --backend openai: the server, up to /v1 (e.g. http://127.0.0.1:8000/v1)\n"
    "  --vocab-size       --backend openai: prompt ids are drawn from [0, V) (config.json vocab_size)\n"
    "  --model            --backend openai: each request's model (default: the first of GET /models)\n"
    "  --api-key          --backend openai: sent as Authorization: Bearer KEY\n"
    "  --concurrency      closed loop: N streams, each sends its next request when the previous ends\n"
    "                     (default 1)\n"
    "  --request-rate     open loop instead: Poisson arrivals at R requests/s; inf or 0: all at once\n"
    "  --num-requests     measured requests (default 64)\n"
    "  --input-len        prompt tokens (default 128)\n"
    "  --output-len       generated tokens (default 128)\n"
    "  --range-ratio      0 (default): fixed lengths; X in (0, 1): each request's input and output\n"
    "                     lengths uniform in [L*(1-X), L*(1+X)]\n"
    "  --chat-turns       multi-turn chat (closed loop): the requests are conversations of T turns,\n"
    "                     each stream running one at a time; a turn's prompt is the turn before's\n"
    "                     prompt and answer and a new message of --input-len tokens, after a system\n"
    "                     prompt shared by every conversation (--num-requests: a multiple of T); over\n"
    "                     HTTP (--backend openai, /http) the turns are chat messages of text, see --backend\n"
    "  --system-prompt-len  the chat's shared system prompt, in tokens (default 0)\n"
    "  --seed             prompts and lengths are a function of it (default 0)\n"
    "  --temperature      sampling temperature (default 0: greedy); sampling seed = seed + request index\n"
    "  --warmup           requests sent one by one before measuring, not counted (default 2)\n"
    "  --timeout-seconds  deadline of each request (default 600)\n"
    "  --json             one JSON object instead of the table\n"
    "  --json-out         also write that JSON object to FILE\n"
    "  --json-schema      every request's output constrained to the JSON Schema in FILE (gRPC\n"
    "                     sampling.structured_output.json_schema; HTTP response_format json_schema), without\n"
    "                     ignore_eos, which a constraint excludes: a request still completes only with\n"
    "                     exactly --output-len tokens, so the schema's shortest instance must be longer\n"
    "                     than that (tools/bench/bench_schema.json's is), and only when its output is the\n"
    "                     start of a JSON text. With --compare: the schema of the /json layouts\n"
    "                     (default tools/bench/bench_schema.json)\n"
    "  --compare          comma-separated layouts tpN, ppM or tpNxppM, each optionally with /serial\n"
    "                     (one micro-batch in flight: coordinator --micro-batches 1), /sync (coordinator\n"
    "                     --no-async-scheduling: each step sent once the one before is back) and\n"
    "                     /no-prefix-caching (coordinator --no-prefix-caching), /ngram (coordinator\n"
    "                     --speculative ngram), /draft (coordinator --speculative draft with --draft-model),\n"
    "                     /mtp (coordinator --speculative mtp: the model's multi-token-prediction layer),\n"
    "                     /eagle3 (coordinator --speculative eagle3 with --draft-model as the head),\n"
    "                     /adaptive beside any of them (coordinator --adaptive-speculative-tokens), e.g.\n"
    "                     tp1,tp2,pp2,pp2/serial,tp2xpp2,tp1/no-prefix-caching, and /http: the same\n"
    "                     load over the coordinator's OpenAI API (as --backend openai) instead of gRPC,\n"
    "                     e.g. tp1,tp1/http,tp1,tp1/http, and /ep: coordinator --expert-parallel, e.g.\n"
    "                     tp2,tp2/ep on a mixture-of-experts model, /gloo: the workers' collectives\n"
    "                     over Gloo's TCP alone (worker --collectives gloo; on CPUs the default puts\n"
    "                     one host's ranks in shared memory), e.g. tp2,tp2/gloo, and /json: every request with\n"
    "                     --json-schema's constraint, e.g. tp1,tp1/json. For each, starts a local cluster of --model\n"
    "                     (default: the embedded demo model) on a free port, waits until it serves,\n"
    "                     runs the load, reads each worker's peak RSS (VmHWM) and weight bytes, and\n"
    "                     stops it; then prints the layouts side by side (--json: {\"runs\": [...]}).\n"
    "                     Logs in --log-dir/<layout> (default /tmp/shardserve-bench-<pid>).\n"
    "  --worker-threads   CPU threads per worker (worker --threads); default on cpu: the CPUs this\n"
    "                     process may use / workers of the layout, at least 1; 0: the worker's default\n"
    "  --worker-memory-gb GiB per worker (worker --memory-gb); default on cpu: the memory this process\n"
    "                     may use / workers of the layout; 0: the worker's default\n"
    "  --worker-matmul-dtype  cpu workers' products: auto (default), f32 or bf16 (worker --matmul-dtype)\n"
    "  --activation-quantization  the workers' (int8: the int8/int4 products on int8-rounded inputs,\n"
    "                     AVX-512 VNNI or AVX2; int16: the int4 products on int16-rounded inputs,\n"
    "                     AVX-512 VNNI, the workers' default there; none: exact; docs/quantization.md)\n"
    "  --worker-collectives, --worker-dummy-weights  the workers' --collectives (gloo: Gloo's TCP alone,\n"
    "                     without shared memory on one host; TP/PP ranks sharing one GPU) and\n"
    "                     --dummy-weights (host: made on the host and copied)\n"
    "  --worker-no-cuda-quantized-kernels, --worker-no-cuda-graphs, --worker-no-cuda-split-attention,\n"
    "  --worker-no-cuda-fused-kernels, --worker-no-cuda-dense-gemv  the workers' --no-cuda-...\n"
    "                     (shardserve-worker --help): a CUDA path off (each on by default since it passed\n"
    "                     on a GPU: docs/gpu.md)\n"
    "  --worker-cuda-int4-mma  the workers' --cuda-int4-mma: int4 decode products on the tensor cores\n"
    "                     (slower than the default GEMV on an H200, off by default: docs/gpu.md)\n"
    "  --worker-cuda-pdl  the workers' --cuda-pdl: programmatic dependent launch on Hopper (not yet\n"
    "                     run on a GPU, off by default: docs/gpu.md)\n"
    "  --worker-cuda-fp8-gemm  the workers' --cuda-fp8-gemm: fp8 weights' prefill products by cuBLASLt's\n"
    "                     fp8 GEMM, x rounded to e4m3 (inexact; not yet run on a GPU: docs/gpu.md)\n"
    "  --worker-cuda-int4-folded  the workers' --cuda-int4-folded: int4 decode products with the zero\n"
    "                     point folded out of the GEMV's loop (not yet run on a GPU: docs/gpu.md)\n"
    "  --worker-cuda-moe-grouped  the workers' --cuda-moe-grouped: MoE experts as one grouped GEMV, so\n"
    "                     MoE decode steps record as graphs (not yet run on a GPU: docs/gpu.md)\n"
    "  --max-num-seqs ... --block-size, --no-prefix-caching, --no-async-scheduling  the coordinator's\n"
    "                     scheduler flags, passed through when given\n"
    "  --heal-timeout-seconds  the coordinator's: how long requests wait for the group to heal around a\n"
    "                     lost worker (docs/healing.md), passed through when given\n"
    "  --expert-parallel  the coordinator's: whole experts per TP rank (docs/moe.md), every layout\n"
    "  --speculative ngram|draft|mtp|eagle3, --num-speculative-tokens K, --speculative-max-running N,\n"
    "  --adaptive-speculative-tokens  the coordinator's speculative decoding (docs/speculative-decoding.md),\n"
    "                     for every layout; or per layout: /ngram, /draft, /mtp or /eagle3 (K 4 unless given), with\n"
    "                     /adaptive, e.g. --compare tp1,tp1/ngram,tp1/ngram/adaptive\n"
    "  --draft-model DIR  the draft model of --speculative draft and of the /draft layouts (same tokenizer\n"
    "                     and vocabulary as --model), e.g. --compare tp1,tp1/draft --draft-model models/demo-draft;\n"
    "                     or the EAGLE-3 head of --speculative eagle3 and of the /eagle3 layouts\n"
    "  --quantization, --load-format, --dummy-seed  the coordinator's, passed through when given:\n"
    "                     --load-format dummy runs weights made from config.json alone (a --model\n"
    "                     directory may then hold only config.json; bench sends token ids)\n"
    "  Progress goes to stderr. Exit code 0 when every request completed, 1 when any failed or a\n"
    "  cluster could not be started, 2 for a usage error, 130 when interrupted.\n";

void OnSignal(int) { g_stop.store(true); }

// ---- Flags ----------------------------------------------------------------------------------------

int Usage(const std::string& error) {
  std::fprintf(stderr, "shardserve bench: %s\n(shardserve bench --help lists the flags)\n", error.c_str());
  return 2;
}

int Run(const std::vector<std::string>& args) {
  // clang-format off
  std::set<std::string> with_value = {
      "concurrency", "request-rate", "num-requests", "input-len", "output-len", "range-ratio", "seed",
      "temperature", "warmup", "timeout-seconds", "json-out", "chat-turns", "system-prompt-len", "json-schema",
      "backend", "base-url", "vocab-size",
      // --compare (and ClusterFlags::Names())
      "compare", "log-dir"};
  // clang-format on
  with_value.merge(ClusterFlags::Names());
  with_value.merge(ClientFlagNames());
  std::set<std::string> switches = ClusterFlags::Switches();
  switches.insert({"json", "help", kInsecureFlag});
  absl::StatusOr<Flags> flags = Flags::Parse(args, with_value, switches);
  if (!flags.ok()) return Usage(std::string(flags.status().message()));
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!flags->positional().empty()) return Usage(absl::StrCat("unexpected argument '", flags->positional()[0], "'"));

  LoadConfig c;
  absl::StatusOr<ClientOptions> client = ClientOptionsFromFlags(*flags);
  if (!client.ok()) return Usage(std::string(client.status().message()));
  c.client = *client;
  c.address = c.client.address;
  absl::StatusOr<int64_t> concurrency = flags->GetInt("concurrency", 1), num = flags->GetInt("num-requests", 64),
                          in = flags->GetInt("input-len", 128), out = flags->GetInt("output-len", 128),
                          seed = flags->GetInt("seed", 0), warmup = flags->GetInt("warmup", 2);
  absl::StatusOr<double> ratio = flags->GetDouble("range-ratio", 0), temperature = flags->GetDouble("temperature", 0),
                         timeout = flags->GetDouble("timeout-seconds", 600);
  for (const absl::Status& s : {concurrency.status(), num.status(), in.status(), out.status(), seed.status(),
                                warmup.status(), ratio.status(), temperature.status(), timeout.status()}) {
    if (!s.ok()) return Usage(std::string(s.message()));
  }
  if (*concurrency < 1 || *concurrency > 4096) return Usage("--concurrency must be in [1, 4096]");
  if (*num < 1 || *num > 1000000) return Usage("--num-requests must be in [1, 1000000]");
  if (*in < 1 || *in > (1 << 24) || *out < 1 || *out > (1 << 24))
    return Usage("--input-len and --output-len must be positive");
  if (!(*ratio >= 0 && *ratio < 1)) return Usage("--range-ratio must be in [0, 1)");
  if (*seed < 0) return Usage("--seed must be non-negative");
  if (*warmup < 0 || *warmup > 1000) return Usage("--warmup must be in [0, 1000]");
  if (!(*temperature >= 0 && *temperature <= 100)) return Usage("--temperature must be in [0, 100]");
  if (!(*timeout > 0 && *timeout <= 86400)) return Usage("--timeout-seconds must be in (0, 86400]");
  c.concurrency = *concurrency;
  c.num_requests = *num;
  c.input_len = *in;
  c.output_len = *out;
  c.range_ratio = *ratio;
  c.seed = static_cast<uint64_t>(*seed);
  c.warmup = *warmup;
  c.temperature = *temperature;
  c.timeout_s = *timeout;
  if (flags->Has("request-rate")) {
    if (*concurrency > 1) {
      return Usage(
          "--request-rate (open loop: Poisson arrivals) and --concurrency > 1 (closed loop) exclude each other");
    }
    const std::string r = absl::AsciiStrToLower(flags->Get("request-rate"));
    double rate;
    if (r == "inf" || r == "infinity") {
      rate = std::numeric_limits<double>::infinity();
    } else if (!absl::SimpleAtod(r, &rate) || !(rate >= 0) || !std::isfinite(rate)) {
      return Usage(absl::StrCat("--request-rate must be a number of requests/s >= 0 or inf, got '", r, "'"));
    }
    c.open_loop = true;
    c.request_rate = rate == 0 ? std::numeric_limits<double>::infinity() : rate;
  }
  if (flags->Has("chat-turns")) {
    absl::StatusOr<int64_t> turns = flags->GetInt("chat-turns", 1), system = flags->GetInt("system-prompt-len", 0);
    if (!turns.ok()) return Usage(std::string(turns.status().message()));
    if (!system.ok()) return Usage(std::string(system.status().message()));
    if (*turns < 1 || *turns > 1000) return Usage("--chat-turns must be in [1, 1000]");
    if (*system < 0 || *system > (1 << 24)) return Usage("--system-prompt-len must be in [0, 16777216]");
    if (c.open_loop) return Usage("--chat-turns runs a closed loop (--concurrency); it excludes --request-rate");
    if (c.num_requests % *turns != 0) {
      return Usage(absl::StrCat("--num-requests (", c.num_requests, ") must be a multiple of --chat-turns (", *turns,
                                "): whole conversations"));
    }
    c.chat_turns = *turns;
    c.system_prompt_len = *system;
  } else if (flags->Has("system-prompt-len")) {
    return Usage("--system-prompt-len needs --chat-turns");
  }
  const std::string backend = flags->Get("backend", "grpc");
  if (backend == "openai") {
    c.backend = Backend::kOpenAI;
    if (!flags->Has("base-url")) return Usage("--backend openai needs --base-url, e.g. http://127.0.0.1:8000/v1");
    c.base_url = flags->Get("base-url");
    while (!c.base_url.empty() && c.base_url.back() == '/') c.base_url.pop_back();
    if (absl::Status s = CheckBaseUrl(c.base_url); !s.ok()) return Usage(std::string(s.message()));
    if (flags->Has("compare")) {
      return Usage("--backend openai and --compare exclude each other (--compare's /http layouts drive the OpenAI API)");
    }
    for (const char* f : {"address", "tls-ca", "tls-cert", "tls-key", kInsecureFlag}) {
      if (flags->Has(f)) return Usage(absl::StrCat("--", f, " is for the gRPC backend; --backend openai uses --base-url"));
    }
    // The chat load's prompts are text (/chat/completions): no vocabulary needed.
    if (!flags->Has("vocab-size") && c.chat_turns == 0) {
      return Usage("--backend openai needs --vocab-size (the model's config.json vocab_size): prompts are random token ids");
    }
    if (flags->Has("vocab-size")) {
      absl::StatusOr<int64_t> vocab = flags->GetInt("vocab-size", 0);
      if (!vocab.ok()) return Usage(std::string(vocab.status().message()));
      if (*vocab < 2 || *vocab > (int64_t{1} << 31)) return Usage("--vocab-size must be in [2, 2147483648]");
      c.vocab_size = *vocab;
    }
    c.model_name = flags->Get("model");
    c.address = c.base_url;
  } else if (backend != "grpc") {
    return Usage(absl::StrCat("--backend must be grpc or openai, got '", backend, "'"));
  } else {
    for (const char* f : {"base-url", "vocab-size"}) {
      if (flags->Has(f)) return Usage(absl::StrCat("--", f, " applies to --backend openai only"));
    }
  }
  const bool as_json = flags->Has("json");
  const std::string json_out = flags->Get("json-out");

  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  if (!flags->Has("compare")) {
    if (c.backend == Backend::kGrpc && flags->Has("model")) return Usage("--model applies to --compare (or --backend openai) only");
    for (const char* f : {"device", "worker-threads", "worker-matmul-dtype", "worker-collectives", "worker-dummy-weights", "log-dir",
                          "ready-timeout-seconds", "max-model-len", "quantization", "load-format", "dummy-seed",
                          "activation-quantization", "speculative", "draft-model"}) {
      if (flags->Has(f)) return Usage(absl::StrCat("--", f, " applies to --compare only"));
    }
    for (const char* f : kCoordinatorPassThroughFlags) {
      if (flags->Has(f)) return Usage(absl::StrCat("--", f, " applies to --compare only (it is a coordinator flag)"));
    }
    for (const std::string& f : ClusterFlags::Switches()) {
      if (flags->Has(f)) return Usage(absl::StrCat("--", f, " applies to --compare only (it sets up the cluster it starts)"));
    }
    if (flags->Has("json-schema")) {
      absl::StatusOr<std::string> schema = ReadJsonSchema(flags->Get("json-schema"));
      if (!schema.ok()) return Usage(std::string(schema.status().message()));
      c.json_schema = *std::move(schema);
      c.json_schema_file = flags->Get("json-schema");
    }
    std::fprintf(stderr, "bench: %s: %s\n", c.address.c_str(), LoadLine(c).c_str());
    absl::StatusOr<BenchRun> run = Benchmark(c);
    if (!run.ok()) {
      if (g_stop) return 130;
      std::fprintf(stderr, "shardserve bench: %s\n", std::string(run.status().message()).c_str());
      return absl::IsInvalidArgument(run.status()) ? 2 : 1;
    }
    json j = {{c.backend == Backend::kOpenAI ? "base_url" : "address", c.address}, {"model", run->model.name}};
    j.update(ResultJson(c, run->load));
    if (!WriteJsonOut(json_out, j)) return 1;
    if (as_json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      PrintTable(c, *run);
    }
    if (run->load.interrupted) return 130;
    return run->load.failed > 0 ? 1 : 0;
  }

  // --compare
  if (flags->Has("address"))
    return Usage("--address and --compare exclude each other (--compare starts its own clusters)");
  std::vector<Layout> layouts;
  for (absl::string_view piece : absl::StrSplit(flags->Get("compare"), ',', absl::SkipWhitespace())) {
    absl::StatusOr<Layout> l = ParseLayout(std::string(absl::StripAsciiWhitespace(piece)));
    if (!l.ok()) return Usage(std::string(l.status().message()));
    layouts.push_back(*l);
  }
  if (layouts.empty()) return Usage("--compare needs at least one layout, e.g. tp1,tp2,pp2");
  CompareOptions o;
  // The /json layouts' schema: --json-schema's, else the committed one.
  if (std::any_of(layouts.begin(), layouts.end(), [](const Layout& l) { return l.json; })) {
    o.json_schema_file = flags->Get("json-schema", SHARDSERVE_BENCH_JSON_SCHEMA);
    absl::StatusOr<std::string> schema = ReadJsonSchema(o.json_schema_file);
    if (!schema.ok()) return Usage(std::string(schema.status().message()));
    o.json_schema = *std::move(schema);
  } else if (flags->Has("json-schema")) {
    return Usage("--json-schema with --compare is the schema of its /json layouts, and none is given (e.g. --compare "
                 "tp1,tp1/json)");
  }
  absl::StatusOr<ClusterFlags> cluster = ClusterFlags::Parse(*flags);
  if (!cluster.ok()) return Usage(std::string(cluster.status().message()));
  o.cluster = *std::move(cluster);
  o.log_dir = flags->Get("log-dir", absl::StrCat(fs::temp_directory_path().string(), "/shardserve-bench-", getpid()));

  std::vector<CompareRun> runs;
  bool all_ok = true;
  std::map<std::string, int> rounds;  // of each layout so far
  for (const Layout& layout : layouts) {
    if (g_stop) break;
    runs.push_back(RunLayout(layout, ++rounds[layout.name], o, c));
    const CompareRun& r = runs.back();
    if (g_stop) break;
    if (!r.error.empty()) {
      // The whole message (with the end of the process's log) once: here with --json, else in the table.
      std::fprintf(stderr, "bench: %s: FAILED: %s\n", layout.name.c_str(),
                   as_json ? r.error.c_str() : r.error.substr(0, r.error.find('\n')).c_str());
    }
    all_ok = all_ok && r.error.empty() && r.run.load.failed == 0;
  }
  if (g_stop) {
    std::fprintf(stderr, "shardserve bench: interrupted; every process it started has been stopped\n");
    return 130;
  }
  const json j = CompareJson(c, runs);
  if (!WriteJsonOut(json_out, j)) return 1;
  if (as_json) {
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    PrintCompareTable(c, runs);
  }
  return all_ok ? 0 : 1;
}

const CommandRegistration kRegistration({"bench", "load generator: throughput and latency of a coordinator", Run});

}  // namespace
}  // namespace shardserve::cli::bench
