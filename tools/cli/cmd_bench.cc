// shardserve bench: a load generator against a running coordinator, in the manner of vLLM's
// benchmark_serving. Random prompts of token ids (from the model's vocabulary, never an EOS id,
// the same for the same --seed), every request with ignore_eos and max_tokens = its output length,
// so that each produces exactly that many tokens. Closed loop (--concurrency N streams, each sending
// its next request when the previous ends) or open loop (--request-rate R: Poisson arrivals).
// Measures time to first token, inter-token latency, end-to-end latency and throughput.
//
// --compare LAYOUTS runs the same load against one local cluster per layout (tools/cli/local_cluster.h,
// the machinery of `shardserve launch`), records each worker's peak RSS and weight bytes, and prints
// the layouts side by side.
//
// Threads: gRPC's sync API, one thread per closed-loop stream or per open-loop request; the main
// thread dispatches, watches for Ctrl-C (then cancels every request in flight) and joins them.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "nlohmann/json.hpp"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tools/cli/bench_stats.h"
#include "tools/cli/client.h"
#include "tools/cli/command.h"
#include "base/flags.h"
#include "tools/cli/local_cluster.h"

namespace shardserve::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
// Keys in the order written, so that the JSON reads like the table.
using json = nlohmann::ordered_json;

constexpr char kUsage[] =
    "usage: shardserve bench [--address HOST:PORT] [--concurrency N | --request-rate R] [--num-requests M]\n"
    "                        [--input-len I] [--output-len O] [--range-ratio X] [--seed S] [--temperature T]\n"
    "                        [--warmup K] [--timeout-seconds S] [--json] [--json-out FILE]\n"
    "       shardserve bench --compare LAYOUTS [--model DIR] [--device cpu|cuda] [--worker-threads N]\n"
    "                        [--worker-matmul-dtype auto|f32|bf16] [--log-dir DIR] [--ready-timeout-seconds S]\n"
    "                        [--max-model-len L]\n"
    "                        [--max-num-seqs N] [--max-waiting-requests N] [--max-tokens-per-step T]\n"
    "                        [--num-kv-blocks N] [--micro-batches K] [--block-size B]  [load flags as above]\n"
    "  Sends M requests of random prompt token ids to the coordinator and reports throughput and\n"
    "  latency. Every request has ignore_eos and max_tokens = its output length; one that fails or\n"
    "  returns fewer tokens counts as failed (each distinct error is shown once, with its count).\n"
    "  --address          coordinator (default localhost:50051)\n"
    "  --concurrency      closed loop: N streams, each sends its next request when the previous ends\n"
    "                     (default 1)\n"
    "  --request-rate     open loop instead: Poisson arrivals at R requests/s; inf or 0: all at once\n"
    "  --num-requests     measured requests (default 64)\n"
    "  --input-len        prompt tokens (default 128)\n"
    "  --output-len       generated tokens (default 128)\n"
    "  --range-ratio      0 (default): fixed lengths; X in (0, 1): each request's input and output\n"
    "                     lengths uniform in [L*(1-X), L*(1+X)]\n"
    "  --seed             prompts and lengths are a function of it (default 0)\n"
    "  --temperature      sampling temperature (default 0: greedy); sampling seed = seed + request index\n"
    "  --warmup           requests sent one by one before measuring, not counted (default 2)\n"
    "  --timeout-seconds  deadline of each request (default 600)\n"
    "  --json             one JSON object instead of the table\n"
    "  --json-out         also write that JSON object to FILE\n"
    "  --compare          comma-separated layouts tpN, ppM or tpNxppM, each optionally with /serial\n"
    "                     (one micro-batch in flight: coordinator --micro-batches 1), e.g.\n"
    "                     tp1,tp2,pp2,pp2/serial,tp2xpp2. For each, starts a local cluster of --model\n"
    "                     (default: the embedded demo model) on a free port, waits until it serves,\n"
    "                     runs the load, reads each worker's peak RSS (VmHWM) and weight bytes, and\n"
    "                     stops it; then prints the layouts side by side (--json: {\"runs\": [...]}).\n"
    "                     Logs in --log-dir/<layout> (default /tmp/shardserve-bench-<pid>).\n"
    "  --worker-threads   CPU threads per worker (worker --threads); default on cpu: cores / workers\n"
    "                     of the layout, at least 1; 0: the worker's default\n"
    "  --worker-matmul-dtype  cpu workers' products: auto (default), f32 or bf16 (worker --matmul-dtype)\n"
    "  --max-num-seqs ... --block-size  the coordinator's scheduler flags, passed through when given\n"
    "  Progress goes to stderr. Exit code 0 when every request completed, 1 when any failed or a\n"
    "  cluster could not be started, 2 for a usage error, 130 when interrupted.\n";

// Set by SIGINT/SIGTERM; read by every thread (lock-free, so the handler may store to it).
std::atomic<bool> g_stop{false};
static_assert(std::atomic<bool>::is_always_lock_free);
void OnSignal(int) { g_stop.store(true); }

// ---- Load description ---------------------------------------------------------------------------

struct LoadConfig {
  std::string address;
  bool open_loop = false;
  int64_t concurrency = 1;  // closed loop
  double request_rate = 0;  // open loop: requests/s; +inf: all at once
  int64_t num_requests = 64;
  int64_t input_len = 128;
  int64_t output_len = 128;
  double range_ratio = 0;
  uint64_t seed = 0;
  double temperature = 0;
  int64_t warmup = 2;
  double timeout_s = 600;
};

struct RequestSpec {
  std::string id;
  std::vector<int32_t> prompt;
  int32_t output_len = 0;
  std::optional<uint64_t> sampling_seed;
};

// Deterministic draws from std::mt19937_64, whose output sequence the C++ standard fixes (the
// standard distributions are implementation-defined, so they are not used).
class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  // Uniform in [0, n), n > 0, by rejection (no modulo bias).
  uint64_t Below(uint64_t n) {
    const uint64_t limit = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % n;
    uint64_t x;
    do {
      x = gen_();
    } while (x >= limit);
    return x % n;
  }
  // Uniform in [lo, hi].
  int64_t Between(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(Below(static_cast<uint64_t>(hi - lo) + 1));
  }
  // Uniform in [0, 1).
  double Unit() { return static_cast<double>(gen_() >> 11) * 0x1.0p-53; }

 private:
  std::mt19937_64 gen_;
};

// [L*(1-X), L*(1+X)] as integers (vLLM's random dataset: int(L*(1-X)) .. int(L*(1+X))), at least 1.
std::pair<int64_t, int64_t> LengthRange(int64_t len, double ratio) {
  const int64_t lo = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(len) * (1 - ratio)));
  const int64_t hi = std::max<int64_t>(lo, static_cast<int64_t>(static_cast<double>(len) * (1 + ratio)));
  return {lo, hi};
}

std::vector<int32_t> RandomPrompt(Rng& rng, int64_t len, int64_t vocab, const std::set<int32_t>& eos) {
  std::vector<int32_t> ids;
  ids.reserve(static_cast<size_t>(len));
  while (static_cast<int64_t>(ids.size()) < len) {
    const auto id = static_cast<int32_t>(rng.Below(static_cast<uint64_t>(vocab)));
    if (!eos.count(id)) ids.push_back(id);
  }
  return ids;
}

// The measured requests (a function of the seed and the load flags only) and the warm-up ones
// (fixed lengths, from a separate stream so that --warmup does not change the measured ones).
std::vector<RequestSpec> MakeRequests(const LoadConfig& c, int64_t vocab, const std::set<int32_t>& eos,
                                      std::vector<RequestSpec>* warmup) {
  Rng rng(c.seed);
  const auto [in_lo, in_hi] = LengthRange(c.input_len, c.range_ratio);
  const auto [out_lo, out_hi] = LengthRange(c.output_len, c.range_ratio);
  std::vector<RequestSpec> specs(static_cast<size_t>(c.num_requests));
  for (int64_t i = 0; i < c.num_requests; ++i) {
    RequestSpec& s = specs[static_cast<size_t>(i)];
    s.id = absl::StrCat("bench-", i);
    const int64_t in = rng.Between(in_lo, in_hi);
    s.output_len = static_cast<int32_t>(rng.Between(out_lo, out_hi));
    s.prompt = RandomPrompt(rng, in, vocab, eos);
    if (c.temperature > 0) s.sampling_seed = c.seed + static_cast<uint64_t>(i);
  }
  Rng wrng(c.seed ^ 0x9e3779b97f4a7c15ULL);
  for (int64_t k = 0; k < c.warmup; ++k) {
    RequestSpec s;
    s.id = absl::StrCat("bench-warmup-", k);
    s.output_len = static_cast<int32_t>(c.output_len);
    s.prompt = RandomPrompt(wrng, c.input_len, vocab, eos);
    if (c.temperature > 0) s.sampling_seed = c.seed + 1000000007ULL + static_cast<uint64_t>(k);
    warmup->push_back(std::move(s));
  }
  return specs;
}

// ---- Running requests ---------------------------------------------------------------------------

// The ClientContexts of the requests in flight, so that Ctrl-C can cancel them. Thread-safe.
class InFlight {
 public:
  void Add(grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu_);
    contexts_.insert(ctx);
    if (cancelled_) ctx->TryCancel();
  }
  // After Remove returns, CancelAll no longer touches `ctx`, so its owner may destroy it.
  void Remove(grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu_);
    contexts_.erase(ctx);
  }
  void CancelAll() {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    for (grpc::ClientContext* ctx : contexts_) ctx->TryCancel();
  }

 private:
  absl::Mutex mu_;
  std::set<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

struct RequestResult {
  bool done = false;  // ran (false: never started, e.g. interrupted)
  bool ok = false;    // completed with exactly output_len tokens
  std::string error;
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  double ttft_s = 0;
  double e2e_s = 0;
  std::vector<double> itl_s;
};

// "UNAVAILABLE", ...: gRPC's codes are Abseil's, number for number.
std::string CodeName(grpc::StatusCode code) {
  std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? "UNKNOWN_CODE" : name;
}

RequestResult RunRequest(v1::InferenceService::Stub* stub, const RequestSpec& spec, const LoadConfig& c,
                         InFlight* inflight) {
  RequestResult r;
  r.done = true;
  r.input_tokens = static_cast<int64_t>(spec.prompt.size());
  v1::GenerateRequest req;
  req.set_request_id(spec.id);
  for (int32_t id : spec.prompt) req.mutable_token_ids()->add_ids(id);
  v1::SamplingParams* s = req.mutable_sampling();
  s->set_max_tokens(spec.output_len);
  s->set_temperature(static_cast<float>(c.temperature));
  s->set_ignore_eos(true);
  if (spec.sampling_seed) s->set_seed(*spec.sampling_seed);

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::microseconds(static_cast<int64_t>(c.timeout_s * 1e6)));
  inflight->Add(&ctx);
  std::vector<double> arrivals;
  std::vector<int> counts;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  int64_t usage_tokens = -1;
  const Clock::time_point t0 = Clock::now();
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub->Generate(&ctx, req);
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    if (resp.token_ids_size() > 0) {
      arrivals.push_back(t);
      counts.push_back(resp.token_ids_size());
      r.output_tokens += resp.token_ids_size();
    }
    if (resp.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      finish = resp.finish_reason();
      usage_tokens = resp.usage().completion_tokens();
    }
  }
  const grpc::Status status = reader->Finish();
  r.e2e_s = std::chrono::duration<double>(Clock::now() - t0).count();
  inflight->Remove(&ctx);

  if (!status.ok()) {
    r.error = absl::StrCat(CodeName(status.error_code()), ": ", status.error_message());
  } else if (r.output_tokens != spec.output_len) {
    r.error = absl::StrCat("a request for ", spec.output_len, " tokens (ignore_eos) returned ", r.output_tokens,
                           " (finish reason ", v1::FinishReason_Name(finish), ")");
  } else if (usage_tokens != r.output_tokens) {
    r.error = absl::StrCat("usage.completion_tokens ", usage_tokens, " differs from the ", r.output_tokens,
                           " tokens streamed");
  } else {
    r.ok = true;
    r.ttft_s = arrivals.front();
    AppendInterTokenLatencies(arrivals, counts, &r.itl_s);
  }
  return r;
}

struct LoadResult {
  bool interrupted = false;
  double duration_s = 0;
  int64_t completed = 0;
  int64_t failed = 0;
  int64_t total_input_tokens = 0;   // of completed requests
  int64_t total_output_tokens = 0;  // of completed requests
  LatencySummary ttft, itl, e2e;
  std::vector<std::pair<std::string, int64_t>> errors;  // distinct messages, first seen first, with counts
};

// Sends the measured requests; the warm-up ones first, one by one. Err only for a failed warm-up.
absl::StatusOr<LoadResult> RunLoad(v1::InferenceService::Stub* stub, const LoadConfig& c,
                                   const std::vector<RequestSpec>& specs, const std::vector<RequestSpec>& warmup) {
  InFlight inflight;
  LoadResult out;
  std::atomic<int64_t> finished_threads{0};
  // Until `thread_count` threads have ended: on Ctrl-C, cancel what is in flight (the threads start
  // nothing new once g_stop is set).
  auto watch = [&](int64_t thread_count) {
    while (finished_threads.load() < thread_count) {
      if (g_stop) inflight.CancelAll();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  };
  std::string warmup_error;
  std::thread warm([&] {
    for (size_t k = 0; k < warmup.size() && !g_stop; ++k) {
      RequestResult r = RunRequest(stub, warmup[k], c, &inflight);
      if (!r.ok && !g_stop) {
        warmup_error = r.error;
        break;
      }
    }
    ++finished_threads;
  });
  watch(1);
  warm.join();
  if (!warmup_error.empty()) return absl::UnavailableError(absl::StrCat("warm-up request failed: ", warmup_error));
  finished_threads = 0;

  std::vector<RequestResult> results(specs.size());
  std::vector<std::thread> threads;
  const Clock::time_point start = Clock::now();
  if (!g_stop && !c.open_loop) {
    std::atomic<int64_t> next{0};
    const int64_t n = std::min<int64_t>(c.concurrency, static_cast<int64_t>(specs.size()));
    for (int64_t t = 0; t < n; ++t) {
      threads.emplace_back([&] {
        for (int64_t i = next++; i < static_cast<int64_t>(specs.size()) && !g_stop; i = next++) {
          results[static_cast<size_t>(i)] = RunRequest(stub, specs[static_cast<size_t>(i)], c, &inflight);
        }
        ++finished_threads;
      });
    }
    watch(n);
  } else if (!g_stop) {
    // Poisson arrivals: exponential gaps with mean 1/R, from their own seeded stream.
    Rng rng(c.seed * 0x2545f4914f6cdd1dULL + 1);
    double at = 0;
    for (size_t i = 0; i < specs.size() && !g_stop; ++i) {
      if (std::isfinite(c.request_rate)) {
        at += -std::log(1 - rng.Unit()) / c.request_rate;
        const Clock::time_point when =
            start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at));
        while (!g_stop && Clock::now() < when) {
          std::this_thread::sleep_until(std::min(when, Clock::now() + std::chrono::milliseconds(50)));
        }
        if (g_stop) break;
      }
      threads.emplace_back([&, i] {
        results[i] = RunRequest(stub, specs[i], c, &inflight);
        ++finished_threads;
      });
    }
    watch(static_cast<int64_t>(threads.size()));
  }
  for (std::thread& t : threads) t.join();
  out.duration_s = std::chrono::duration<double>(Clock::now() - start).count();
  out.interrupted = g_stop.load();

  std::vector<double> ttft, itl, e2e;
  for (const RequestResult& r : results) {
    if (!r.done) continue;
    if (!r.ok) {
      ++out.failed;
      auto it = std::find_if(out.errors.begin(), out.errors.end(), [&](const auto& e) { return e.first == r.error; });
      if (it == out.errors.end()) {
        out.errors.emplace_back(r.error, 1);
      } else {
        ++it->second;
      }
      continue;
    }
    ++out.completed;
    out.total_input_tokens += r.input_tokens;
    out.total_output_tokens += r.output_tokens;
    ttft.push_back(r.ttft_s);
    e2e.push_back(r.e2e_s);
    itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
  }
  out.ttft = Summarize(std::move(ttft));
  out.itl = Summarize(std::move(itl));
  out.e2e = Summarize(std::move(e2e));
  return out;
}

// What the server says about itself, for prompts and the length check.
struct ServedModel {
  std::string name;
  int64_t vocab_size = 0;
  int64_t max_model_len = 0;
  std::set<int32_t> eos;
};

absl::StatusOr<ServedModel> GetServedModel(v1::InferenceService::Stub* stub, const std::string& address) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ModelInfo info;
  const grpc::Status s = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", address, ": ",
                                               CodeName(s.error_code()), ": ", s.error_message()));
  }
  ServedModel m;
  m.name = info.name();
  m.vocab_size = info.vocab_size();
  m.max_model_len = info.max_model_len();
  m.eos.insert(info.eos_token_ids().begin(), info.eos_token_ids().end());
  if (m.vocab_size <= static_cast<int64_t>(m.eos.size()) || m.vocab_size > (int64_t{1} << 31)) {
    return absl::FailedPreconditionError(absl::StrCat("the coordinator reports vocab_size ", m.vocab_size, " with ",
                                                      m.eos.size(), " EOS ids: no prompt ids to draw"));
  }
  return m;
}

// One benchmark against `c.address`: model info, prompts, warm-up, load.
struct BenchRun {
  ServedModel model;
  LoadResult load;
};

absl::StatusOr<BenchRun> Benchmark(const LoadConfig& c) {
  auto stub = v1::InferenceService::NewStub(ConnectToCoordinator(c.address));
  BenchRun run;
  absl::StatusOr<ServedModel> model = GetServedModel(stub.get(), c.address);
  if (!model.ok()) return model.status();
  run.model = *model;
  const int64_t longest =
      LengthRange(c.input_len, c.range_ratio).second + LengthRange(c.output_len, c.range_ratio).second;
  if (model->max_model_len > 0 && longest > model->max_model_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the longest request (", longest, " tokens: input + output at most) exceeds the model's max_model_len (",
        model->max_model_len, "); lower --input-len/--output-len"));
  }
  std::vector<RequestSpec> warmup;
  const std::vector<RequestSpec> specs = MakeRequests(c, model->vocab_size, model->eos, &warmup);
  absl::StatusOr<LoadResult> load = RunLoad(stub.get(), c, specs, warmup);
  if (!load.ok()) return load.status();
  run.load = *load;
  return run;
}

// ---- Reporting ------------------------------------------------------------------------------------

double PerSecond(double n, double s) { return s > 0 ? n / s : 0; }

json RateJson(const LoadConfig& c) {
  if (!c.open_loop) return nullptr;
  if (!std::isfinite(c.request_rate)) return "inf";
  return c.request_rate;
}

// The keys every run has (single run, and each of --compare's runs).
json ResultJson(const LoadConfig& c, const LoadResult& r) {
  json j;
  j["mode"] = c.open_loop ? "open" : "closed";
  j["concurrency"] = c.open_loop ? json(nullptr) : json(c.concurrency);
  j["request_rate"] = RateJson(c);
  j["num_requests"] = c.num_requests;
  j["input_len"] = c.input_len;
  j["output_len"] = c.output_len;
  j["range_ratio"] = c.range_ratio;
  j["seed"] = c.seed;
  j["temperature"] = c.temperature;
  j["warmup"] = c.warmup;
  j["interrupted"] = r.interrupted;
  j["duration_s"] = r.duration_s;
  j["completed"] = r.completed;
  j["failed"] = r.failed;
  j["total_input_tokens"] = r.total_input_tokens;
  j["total_output_tokens"] = r.total_output_tokens;
  j["requests_per_s"] = PerSecond(static_cast<double>(r.completed), r.duration_s);
  j["output_tokens_per_s"] = PerSecond(static_cast<double>(r.total_output_tokens), r.duration_s);
  j["total_tokens_per_s"] = PerSecond(static_cast<double>(r.total_input_tokens + r.total_output_tokens), r.duration_s);
  for (const auto& [name, s] :
       {std::pair<const char*, const LatencySummary&>{"ttft", r.ttft}, {"itl", r.itl}, {"e2e", r.e2e}}) {
    j[absl::StrCat(name, "_mean_s")] = s.mean;  // NaN (no samples) is written as null
    j[absl::StrCat(name, "_p50_s")] = s.p50;
    j[absl::StrCat(name, "_p90_s")] = s.p90;
    j[absl::StrCat(name, "_p99_s")] = s.p99;
  }
  json errors = json::array();
  for (const auto& [message, count] : r.errors) errors.push_back({{"message", message}, {"count", count}});
  j["errors"] = errors;
  return j;
}

std::string LoadLine(const LoadConfig& c) {
  std::string load = c.open_loop
                         ? (std::isfinite(c.request_rate)
                                ? absl::StrFormat("open loop, Poisson arrivals at %g requests/s", c.request_rate)
                                : std::string("open loop, all requests at once"))
                         : absl::StrCat("closed loop, concurrency ", c.concurrency);
  return absl::StrFormat(
      "%s; %d requests (+%d warm-up), input %d, output %d tokens (range ratio %g), temperature %g, seed %d", load,
      c.num_requests, c.warmup, c.input_len, c.output_len, c.range_ratio, c.temperature, c.seed);
}

std::string Ms(double s) { return std::isnan(s) ? "-" : absl::StrFormat("%.2f", s * 1e3); }

void PrintErrors(const LoadResult& r) {
  if (r.errors.empty()) return;
  std::printf("errors (each distinct message once):\n");
  for (const auto& [message, count] : r.errors)
    std::printf("  %lld x %s\n", static_cast<long long>(count), message.c_str());
}

void PrintTable(const LoadConfig& c, const BenchRun& run) {
  const LoadResult& r = run.load;
  std::printf("shardserve bench: %s, model %s (vocab %lld)\n", c.address.c_str(), run.model.name.c_str(),
              static_cast<long long>(run.model.vocab_size));
  std::printf("load: %s%s\n\n", LoadLine(c).c_str(), r.interrupted ? " (INTERRUPTED)" : "");
  std::printf("%-22s %12lld\n", "completed", static_cast<long long>(r.completed));
  std::printf("%-22s %12lld\n", "failed", static_cast<long long>(r.failed));
  std::printf("%-22s %12.2f s\n", "duration", r.duration_s);
  std::printf("%-22s %12.3f\n", "requests/s", PerSecond(static_cast<double>(r.completed), r.duration_s));
  std::printf("%-22s %12.1f\n", "output tokens/s", PerSecond(static_cast<double>(r.total_output_tokens), r.duration_s));
  std::printf("%-22s %12.1f\n", "total tokens/s",
              PerSecond(static_cast<double>(r.total_input_tokens + r.total_output_tokens), r.duration_s));
  std::printf("\n%-22s %10s %10s %10s %10s\n", "latency (ms)", "mean", "p50", "p90", "p99");
  for (const auto& [name, s] : {std::pair<const char*, const LatencySummary&>{"time to first token", r.ttft},
                                {"inter-token", r.itl},
                                {"end-to-end", r.e2e}}) {
    std::printf("%-22s %10s %10s %10s %10s\n", name, Ms(s.mean).c_str(), Ms(s.p50).c_str(), Ms(s.p90).c_str(),
                Ms(s.p99).c_str());
  }
  PrintErrors(r);
}

// ---- --compare ------------------------------------------------------------------------------------

struct Layout {
  std::string name;  // as given: "tp2xpp2/serial"
  int64_t tp = 1;
  int64_t pp = 1;
  bool serial = false;
};

// tpN, ppM, tpNxppM, each optionally followed by /serial.
absl::StatusOr<Layout> ParseLayout(const std::string& text) {
  Layout l;
  l.name = text;
  std::string body = absl::AsciiStrToLower(text);
  if (absl::EndsWith(body, "/serial")) {
    l.serial = true;
    body = body.substr(0, body.size() - 7);
  }
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("layout '", text, "' is not tpN, ppM or tpNxppM (optionally /serial), e.g. tp2xpp2/serial"));
  };
  const std::vector<std::string> parts = absl::StrSplit(body, 'x');
  if (parts.empty() || parts.size() > 2) return bad();
  bool seen_tp = false, seen_pp = false;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    int64_t n;
    if (p.size() < 3 || !absl::SimpleAtoi(p.substr(2), &n) || n < 1 || n > 64) return bad();
    if (p.rfind("tp", 0) == 0 && !seen_tp && i == 0) {
      l.tp = n;
      seen_tp = true;
    } else if (p.rfind("pp", 0) == 0 && !seen_pp) {
      l.pp = n;
      seen_pp = true;
    } else {
      return bad();
    }
  }
  if (l.tp * l.pp > 64) return absl::InvalidArgumentError(absl::StrCat("layout '", text, "': at most 64 workers"));
  return l;
}

struct CompareRun {
  Layout layout;
  std::string error;  // empty: the load ran
  BenchRun run;
  std::vector<std::string> worker_names;
  std::vector<int64_t> worker_peak_rss_bytes;  // start order: node0/0, node0/1, node1/0, ...
  std::vector<int64_t> worker_weight_bytes;    // by stage, then TP rank
  std::optional<v1::SchedulerStatus> scheduler;  // after the load
  double start_s = 0;                          // start until serving
  std::string address;                         // where the cluster served
};

struct CompareOptions {
  std::string model;
  std::string device;
  std::string log_dir;
  int64_t ready_timeout_s = 300;
  std::optional<int64_t> worker_threads;       // unset: DefaultWorkerThreads on cpu
  std::vector<std::string> worker_flags;       // more worker flags (--matmul-dtype)
  std::vector<std::string> coordinator_flags;  // pass-through (--max-model-len, scheduler flags)
  std::string micro_batches;                   // --micro-batches as given, for non-serial layouts
};

// The coordinator's view of a cluster, read after the load: weights per worker (by stage, then TP
// rank) and its scheduler (micro-batches in flight, KV blocks, preemptions). Empty on an error.
struct ClusterFacts {
  std::vector<int64_t> weight_bytes;
  std::optional<v1::SchedulerStatus> scheduler;
};

ClusterFacts GetClusterFacts(const std::string& address) {
  auto stub = v1::InferenceService::NewStub(ConnectToCoordinator(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ClusterStatus cs;
  ClusterFacts facts;
  if (!stub->GetClusterStatus(&ctx, v1::GetClusterStatusRequest(), &cs).ok()) return facts;
  std::vector<v1::WorkerStatus> workers(cs.workers().begin(), cs.workers().end());
  std::sort(workers.begin(), workers.end(), [](const v1::WorkerStatus& a, const v1::WorkerStatus& b) {
    return std::pair(a.stage(), a.tp_rank()) < std::pair(b.stage(), b.tp_rank());
  });
  for (const v1::WorkerStatus& w : workers) facts.weight_bytes.push_back(w.weight_bytes());
  if (cs.has_scheduler()) facts.scheduler = cs.scheduler();
  return facts;
}

CompareRun RunLayout(const Layout& layout, const CompareOptions& o, LoadConfig load) {
  CompareRun out;
  out.layout = layout;
  const int64_t workers = layout.tp * layout.pp;
  LocalClusterOptions co;
  co.bin_dir = fs::read_symlink("/proc/self/exe").parent_path().string();
  co.model = o.model;
  co.nodes = layout.pp;
  co.gpus_per_node = layout.tp;
  co.device = o.device;
  co.address = "127.0.0.1:0";  // the coordinator picks a free port: no clash with a cluster on 50051
  std::string dir_name = layout.name;
  std::replace(dir_name.begin(), dir_name.end(), '/', '_');
  co.log_dir = (fs::path(o.log_dir) / dir_name).string();
  co.metrics_port_base = 0;
  co.coordinator_flags = o.coordinator_flags;
  if (layout.serial) {
    co.coordinator_flags.insert(co.coordinator_flags.end(), {"--micro-batches", "1"});
  } else if (!o.micro_batches.empty()) {
    co.coordinator_flags.insert(co.coordinator_flags.end(), {"--micro-batches", o.micro_batches});
  }
  const int64_t threads = o.worker_threads.value_or(o.device == "cpu" ? DefaultWorkerThreads(workers) : 0);
  if (threads > 0) co.worker_flags = {"--threads", std::to_string(threads)};
  co.worker_flags.insert(co.worker_flags.end(), o.worker_flags.begin(), o.worker_flags.end());

  std::fprintf(stderr, "bench: %s: starting a coordinator and %lld worker(s) (TP=%lld x PP=%lld%s), logs in %s\n",
               layout.name.c_str(), static_cast<long long>(workers), static_cast<long long>(layout.tp),
               static_cast<long long>(layout.pp), layout.serial ? ", one micro-batch" : "", co.log_dir.c_str());
  const Clock::time_point t0 = Clock::now();
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(co);
  if (!cluster.ok()) {
    out.error = std::string(cluster.status().message());
    return out;
  }
  if (absl::Status s = (*cluster)->WaitUntilServing(std::chrono::seconds(o.ready_timeout_s), &g_stop); !s.ok()) {
    out.error = std::string(s.message());
    return out;  // the destructor stops and reaps every process
  }
  out.start_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::fprintf(stderr, "bench: %s: serving on %s after %.1f s; %s\n", layout.name.c_str(),
               (*cluster)->address().c_str(), out.start_s, LoadLine(load).c_str());
  out.address = (*cluster)->address();
  load.address = (*cluster)->address();
  absl::StatusOr<BenchRun> run = Benchmark(load);
  ClusterFacts facts = GetClusterFacts(out.address);
  out.worker_weight_bytes = facts.weight_bytes;
  out.scheduler = facts.scheduler;
  // Peak RSS of each worker, read while it still runs.
  out.worker_names = (*cluster)->WorkerNames();
  for (pid_t pid : (*cluster)->WorkerPids()) {
    absl::StatusOr<int64_t> rss = pid > 0 ? PeakRssBytes(pid) : absl::NotFoundError("exited");
    out.worker_peak_rss_bytes.push_back(rss.ok() ? *rss : -1);
  }
  if (std::optional<ExitedProcess> dead = (*cluster)->ReapExited()) {
    out.error =
        absl::StrCat(dead->name, " ", dead->how, " during the run; last lines of ", dead->log, ":\n", dead->log_tail);
  }
  (*cluster)->Stop(std::chrono::seconds(10));
  if (!run.ok()) {
    if (out.error.empty()) out.error = std::string(run.status().message());
    return out;
  }
  out.run = *run;
  const LoadResult& r = run->load;
  std::fprintf(stderr, "bench: %s: %lld completed, %lld failed in %.1f s, %.1f output tokens/s; stopped\n",
               layout.name.c_str(), static_cast<long long>(r.completed), static_cast<long long>(r.failed), r.duration_s,
               PerSecond(static_cast<double>(r.total_output_tokens), r.duration_s));
  return out;
}

std::string MiB(int64_t bytes) {
  return bytes < 0 ? "-" : absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20));
}

int64_t MaxOf(const std::vector<int64_t>& v) { return v.empty() ? -1 : *std::max_element(v.begin(), v.end()); }

void PrintCompareTable(const LoadConfig& c, const std::vector<CompareRun>& runs) {
  std::printf("shardserve bench --compare: %s\n\n", LoadLine(c).c_str());
  std::vector<std::pair<std::string, std::vector<std::string>>> rows;
  auto row = [&](const std::string& label, auto cell) {
    std::vector<std::string> cells;
    for (const CompareRun& r : runs)
      cells.push_back(r.error.empty() || label == "layout" || label == "workers" ? cell(r) : "-");
    rows.emplace_back(label, cells);
  };
  auto rate = [](double n, double s) { return absl::StrFormat("%.1f", PerSecond(n, s)); };
  row("layout", [](const CompareRun& r) { return r.layout.name; });
  row("workers", [](const CompareRun& r) { return absl::StrCat(r.layout.tp * r.layout.pp); });
  row("micro-batches", [](const CompareRun& r) {
    return r.scheduler ? absl::StrCat(r.scheduler->micro_batches()) : std::string("-");
  });
  row("preemptions", [](const CompareRun& r) {
    return r.scheduler ? absl::StrCat(r.scheduler->preemptions()) : std::string("-");
  });
  row("completed / failed",
      [](const CompareRun& r) { return absl::StrCat(r.run.load.completed, " / ", r.run.load.failed); });
  row("output tok/s", [&](const CompareRun& r) {
    return rate(static_cast<double>(r.run.load.total_output_tokens), r.run.load.duration_s);
  });
  row("req/s", [](const CompareRun& r) {
    return absl::StrFormat("%.3f", PerSecond(static_cast<double>(r.run.load.completed), r.run.load.duration_s));
  });
  row("TTFT p50 (ms)", [](const CompareRun& r) { return Ms(r.run.load.ttft.p50); });
  row("TTFT p99 (ms)", [](const CompareRun& r) { return Ms(r.run.load.ttft.p99); });
  row("ITL p50 (ms)", [](const CompareRun& r) { return Ms(r.run.load.itl.p50); });
  row("ITL p99 (ms)", [](const CompareRun& r) { return Ms(r.run.load.itl.p99); });
  row("peak RSS/worker (max)", [](const CompareRun& r) { return MiB(MaxOf(r.worker_peak_rss_bytes)); });
  row("weights/worker (max)", [](const CompareRun& r) { return MiB(MaxOf(r.worker_weight_bytes)); });
  size_t width = 10;
  for (const auto& [label, cells] : rows) {
    for (const std::string& cell : cells) width = std::max(width, cell.size());
  }
  for (const auto& [label, cells] : rows) {
    std::printf("%-22s", label.c_str());
    for (const std::string& cell : cells) std::printf("  %*s", static_cast<int>(width), cell.c_str());
    std::printf("\n");
  }
  for (const CompareRun& r : runs) {
    if (!r.error.empty()) {
      std::printf("\n%s: FAILED: %s\n", r.layout.name.c_str(), r.error.c_str());
    } else if (!r.run.load.errors.empty()) {
      std::printf("\n%s: ", r.layout.name.c_str());
      PrintErrors(r.run.load);
    }
  }
}

json CompareJson(const LoadConfig& c, const std::vector<CompareRun>& runs) {
  json out = {{"runs", json::array()}};
  for (const CompareRun& r : runs) {
    json j;
    j["layout"] = r.layout.name;
    j["tp"] = r.layout.tp;
    j["pp"] = r.layout.pp;
    j["serial"] = r.layout.serial;
    j["workers"] = r.layout.tp * r.layout.pp;
    j["error"] = r.error.empty() ? json(nullptr) : json(r.error);
    j["model"] = r.run.model.name;
    j["address"] = r.address;
    j["cluster_start_s"] = r.start_s;
    j.update(ResultJson(c, r.run.load));
    j["worker_names"] = r.worker_names;
    j["worker_peak_rss_bytes"] = r.worker_peak_rss_bytes;
    j["worker_weight_bytes"] = r.worker_weight_bytes;
    if (r.scheduler) {
      j["micro_batches"] = r.scheduler->micro_batches();
      j["max_num_seqs"] = r.scheduler->max_running();
      j["kv_blocks_total"] = r.scheduler->kv_blocks_total();
      j["block_size"] = r.scheduler->block_size();
      j["preemptions"] = r.scheduler->preemptions();
    } else {
      for (const char* k : {"micro_batches", "max_num_seqs", "kv_blocks_total", "block_size", "preemptions"}) {
        j[k] = nullptr;
      }
    }
    out["runs"].push_back(j);
  }
  return out;
}

// Writes `j` to `path` (nothing when it is empty); false, with a message, when it cannot.
bool WriteJsonOut(const std::string& path, const json& j) {
  if (path.empty()) return true;
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  out.close();
  if (!out) {
    std::fprintf(stderr, "shardserve bench: cannot write --json-out %s\n", path.c_str());
    return false;
  }
  return true;
}

// ---- Flags ----------------------------------------------------------------------------------------

int Usage(const std::string& error) {
  std::fprintf(stderr, "shardserve bench: %s\n(shardserve bench --help lists the flags)\n", error.c_str());
  return 2;
}

int Run(const std::vector<std::string>& args) {
  // clang-format off
  std::set<std::string> with_value = {
      "address", "concurrency", "request-rate", "num-requests", "input-len", "output-len", "range-ratio", "seed",
      "temperature", "warmup", "timeout-seconds", "json-out",
      // --compare
      "compare", "model", "device", "worker-threads", "worker-matmul-dtype", "log-dir", "ready-timeout-seconds",
      "max-model-len"};
  // clang-format on
  for (const char* f : kCoordinatorPassThroughFlags) with_value.insert(f);
  absl::StatusOr<Flags> flags = Flags::Parse(args, with_value, {"json", "help"});
  if (!flags.ok()) return Usage(std::string(flags.status().message()));
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!flags->positional().empty()) return Usage(absl::StrCat("unexpected argument '", flags->positional()[0], "'"));

  LoadConfig c;
  c.address = flags->Get("address", kDefaultAddress);
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
  const bool as_json = flags->Has("json");
  const std::string json_out = flags->Get("json-out");

  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  if (!flags->Has("compare")) {
    for (const char* f : {"model", "device", "worker-threads", "worker-matmul-dtype", "log-dir",
                          "ready-timeout-seconds", "max-model-len"}) {
      if (flags->Has(f)) return Usage(absl::StrCat("--", f, " applies to --compare only"));
    }
    for (const char* f : kCoordinatorPassThroughFlags) {
      if (flags->Has(f)) return Usage(absl::StrCat("--", f, " applies to --compare only (it is a coordinator flag)"));
    }
    std::fprintf(stderr, "bench: %s: %s\n", c.address.c_str(), LoadLine(c).c_str());
    absl::StatusOr<BenchRun> run = Benchmark(c);
    if (!run.ok()) {
      if (g_stop) return 130;
      std::fprintf(stderr, "shardserve bench: %s\n", std::string(run.status().message()).c_str());
      return absl::IsInvalidArgument(run.status()) ? 2 : 1;
    }
    json j = {{"address", c.address}, {"model", run->model.name}};
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
  o.model = flags->Get("model", SHARDSERVE_DEMO_MODEL_DIR);
  if (!fs::exists(fs::path(o.model) / "config.json")) {
    return Usage(absl::StrCat(o.model, " has no config.json (give a Hugging Face checkpoint directory)"));
  }
  o.device = flags->Get("device", "cpu");
  if (o.device != "cpu" && o.device != "cuda")
    return Usage(absl::StrCat("--device must be cpu or cuda, got '", o.device, "'"));
  o.log_dir = flags->Get("log-dir", absl::StrCat(fs::temp_directory_path().string(), "/shardserve-bench-", getpid()));
  absl::StatusOr<int64_t> ready = flags->GetInt("ready-timeout-seconds", 300);
  if (!ready.ok() || *ready < 1) return Usage("--ready-timeout-seconds must be a positive integer");
  o.ready_timeout_s = *ready;
  if (flags->Has("worker-threads")) {
    absl::StatusOr<int64_t> t = flags->GetInt("worker-threads", 0);
    if (!t.ok() || *t < 0) return Usage("--worker-threads must be a non-negative integer");
    o.worker_threads = *t;
  }
  absl::StatusOr<std::vector<std::string>> matmul = WorkerMatMulFlags(flags->Get("worker-matmul-dtype", ""));
  if (!matmul.ok()) return Usage(std::string(matmul.status().message()));
  o.worker_flags = *std::move(matmul);
  if (flags->Has("max-model-len")) o.coordinator_flags = {"--max-model-len", flags->Get("max-model-len")};
  for (const char* f : kCoordinatorPassThroughFlags) {
    if (!flags->Has(f)) continue;
    absl::StatusOr<int64_t> v = flags->GetInt(f, 0);
    if (!v.ok() || *v < 0)
      return Usage(absl::StrCat("--", f, " must be a non-negative integer, got '", flags->Get(f), "'"));
    if (std::string(f) == "micro-batches") {
      o.micro_batches = flags->Get(f);  // /serial layouts override it with 1
    } else {
      o.coordinator_flags.insert(o.coordinator_flags.end(), {absl::StrCat("--", f), flags->Get(f)});
    }
  }

  std::vector<CompareRun> runs;
  bool all_ok = true;
  for (const Layout& layout : layouts) {
    if (g_stop) break;
    runs.push_back(RunLayout(layout, o, c));
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
}  // namespace shardserve::cli
