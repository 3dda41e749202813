// shardserve bench's load generator: random prompts from the seed, warm-up, then the measured
// requests in a closed loop (--concurrency streams) or an open one (Poisson arrivals), each request
// timed from its stream of responses. With --chat-turns, the closed loop runs conversations: each
// turn's prompt is the one before, its answer and a new message, after a shared system prompt (over
// gRPC as token ids; over HTTP as chat messages of text).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
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
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tools/cli/bench.h"
#include "tools/cli/bench_stats.h"
#include "tools/cli/client.h"

namespace shardserve::cli::bench {
namespace {

// ---- Load description ---------------------------------------------------------------------------

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

// Common English words that most tokenizers (Llama's, Qwen's, GPT's, the demo model's) make one
// token each, with the space before them: the chat load's text over HTTP, where prompts cannot be
// token ids.
constexpr char kWordList[] =
    "the and that shall for his him they them with not all you was which there said their will "
    "have man from son king are out were upon day when say this but hear again her people house "
    "came had child hand into your come one children before ever land she men also against "
    "father went made saying even over who word our every after great things let may make down "
    "know did pass earth because these name heart see then put give year any right away among "
    "should way brought days city call good eat where two might take bring what took like work "
    "set place more now sent under heard about called through time than own first law turn mount "
    "seven saw done yet water light";

// `n` words drawn from kWordList, separated by spaces.
std::string RandomWords(Rng& rng, int64_t n) {
  static const std::vector<std::string>* const words =
      new std::vector<std::string>(absl::StrSplit(kWordList, ' ', absl::SkipEmpty()));
  std::string text;
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) text += ' ';
    text += (*words)[rng.Below(words->size())];
  }
  return text;
}

// Whether the load is the chat load over HTTP (text messages, POST /chat/completions).
bool ChatOverHttp(const LoadConfig& c) { return c.chat_turns > 0 && c.backend == Backend::kOpenAI; }

// The measured requests (a function of the seed and the load flags only) and the warm-up ones
// (fixed lengths, from a separate stream so that --warmup does not change the measured ones).
// Chat over HTTP: each request's message is text, and a warm-up request is a one-message chat.
std::vector<RequestSpec> MakeRequests(const LoadConfig& c, int64_t vocab, const std::set<int32_t>& eos,
                                      std::vector<RequestSpec>* warmup) {
  Rng rng(c.seed);
  const auto [in_lo, in_hi] = LengthRange(c.input_len, c.range_ratio);
  const auto [out_lo, out_hi] = LengthRange(c.output_len, c.range_ratio);
  std::vector<RequestSpec> specs(static_cast<size_t>(c.num_requests));
  for (int64_t i = 0; i < c.num_requests; ++i) {
    RequestSpec& s = specs[static_cast<size_t>(i)];
    s.id = c.chat_turns > 0 ? absl::StrCat("bench-chat-", i / c.chat_turns, "-turn-", i % c.chat_turns)
                            : absl::StrCat("bench-", i);
    const int64_t in = rng.Between(in_lo, in_hi);
    s.output_len = static_cast<int32_t>(rng.Between(out_lo, out_hi));
    if (ChatOverHttp(c)) {
      s.message = RandomWords(rng, in);
    } else {
      s.prompt = RandomPrompt(rng, in, vocab, eos);
    }
    if (c.temperature > 0) s.sampling_seed = c.seed + static_cast<uint64_t>(i);
  }
  Rng wrng(c.seed ^ 0x9e3779b97f4a7c15ULL);
  for (int64_t k = 0; k < c.warmup; ++k) {
    RequestSpec s;
    s.id = absl::StrCat("bench-warmup-", k);
    s.output_len = static_cast<int32_t>(c.output_len);
    if (ChatOverHttp(c)) {
      s.messages = {{"user", RandomWords(wrng, c.input_len)}};
    } else {
      s.prompt = RandomPrompt(wrng, c.input_len, vocab, eos);
    }
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
    for (OpenAIConnection* conn : connections_) conn->Stop();
  }
  // The same for an HTTP stream's connection (its requests also end at g_stop between reads; Stop
  // ends one that waits for its first byte).
  void Add(OpenAIConnection* conn) {
    absl::MutexLock lock(&mu_);
    connections_.insert(conn);
    if (cancelled_) conn->Stop();
  }
  void Remove(OpenAIConnection* conn) {
    absl::MutexLock lock(&mu_);
    connections_.erase(conn);
  }

 private:
  absl::Mutex mu_;
  std::set<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
  std::set<OpenAIConnection*> connections_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
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
  if (c.json_schema.empty()) {
    s->set_ignore_eos(true);
  } else {
    s->mutable_structured_output()->set_json_schema(c.json_schema);  // the engine refuses ignore_eos with it
  }
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
      r.output_ids.insert(r.output_ids.end(), resp.token_ids().begin(), resp.token_ids().end());
    }
    if (!c.json_schema.empty()) r.output_text += resp.text();
    if (resp.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      finish = resp.finish_reason();
      usage_tokens = resp.usage().completion_tokens();
      r.cached_tokens = resp.usage().cached_prompt_tokens();
    }
  }
  const grpc::Status status = reader->Finish();
  r.e2e_s = std::chrono::duration<double>(Clock::now() - t0).count();
  inflight->Remove(&ctx);

  if (!status.ok()) {
    r.error = absl::StrCat(CodeName(status.error_code()), ": ", status.error_message());
  } else if (r.output_tokens != spec.output_len) {
    r.error = ShortOutputError(c, spec.output_len, r.output_tokens, v1::FinishReason_Name(finish));
  } else if (usage_tokens != r.output_tokens) {
    r.error = absl::StrCat("usage.completion_tokens ", usage_tokens, " differs from the ", r.output_tokens,
                           " tokens streamed");
  } else if (std::string why = c.json_schema.empty() ? "" : JsonPrefixError(r.output_text); !why.empty()) {
    r.error = NotJsonError(why);
  } else {
    r.ok = true;
    r.ttft_s = arrivals.front();
    AppendInterTokenLatencies(arrivals, counts, &r.itl_s);
  }
  return r;
}

// One stream's way to the server, used by one thread at a time: over gRPC the stub of the shared
// channel; over HTTP a keep-alive connection of its own, opened at its first request.
class Stream {
 public:
  Stream(v1::InferenceService::Stub* stub, const LoadConfig& c, InFlight* inflight)
      : stub_(stub), c_(c), inflight_(inflight) {}
  ~Stream() {
    if (http_ != nullptr) inflight_->Remove(http_.get());
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  RequestResult Run(const RequestSpec& spec) {
    if (c_.backend == Backend::kGrpc) return RunRequest(stub_, spec, c_, inflight_);
    if (http_ == nullptr) {
      http_ = std::make_unique<OpenAIConnection>(c_);
      inflight_->Add(http_.get());
    }
    return http_->Send(spec);
  }

 private:
  v1::InferenceService::Stub* stub_;  // null over HTTP
  const LoadConfig& c_;
  InFlight* inflight_;
  std::unique_ptr<OpenAIConnection> http_;
};

// The chat's shared system prompt: token ids over gRPC, text over HTTP (then `ids` is empty).
struct SystemPrompt {
  std::vector<int32_t> ids;
  std::string text;
};

// Runs conversation `conv` (specs[conv * turns, (conv + 1) * turns)) turn after turn into `results`:
// each turn's prompt is the history (the system prompt, then every message and answer so far) and
// its message; over HTTP the same as chat messages (system, then user and assistant in turn). After
// a failed turn the rest of the conversation is not sent and counts as failed.
void RunConversation(Stream* stream, const LoadConfig& c, const std::vector<RequestSpec>& specs,
                     const SystemPrompt& system_prompt, int64_t conv, std::vector<RequestResult>* results) {
  std::vector<int32_t> history = system_prompt.ids;
  std::vector<ChatMessage> messages;
  if (!system_prompt.text.empty()) messages.push_back({"system", system_prompt.text});
  for (int64_t turn = 0; turn < c.chat_turns && !g_stop; ++turn) {
    const size_t i = static_cast<size_t>(conv * c.chat_turns + turn);
    RequestSpec spec = specs[i];
    if (ChatOverHttp(c)) {
      messages.push_back({"user", spec.message});
      spec.messages = messages;
    } else {
      history.insert(history.end(), spec.prompt.begin(), spec.prompt.end());
      spec.prompt = history;
    }
    RequestResult& r = (*results)[i] = stream->Run(spec);
    if (!r.ok) {
      for (int64_t rest = turn + 1; rest < c.chat_turns; ++rest) {
        RequestResult& skipped = (*results)[static_cast<size_t>(conv * c.chat_turns + rest)];
        skipped.done = true;
        skipped.error = "not sent: an earlier turn of its conversation failed";
      }
      return;
    }
    history.insert(history.end(), r.output_ids.begin(), r.output_ids.end());
    messages.push_back({"assistant", r.output_text});
  }
}

// Sends the measured requests; the warm-up ones first, one by one. Err only for a failed warm-up.
absl::StatusOr<LoadResult> RunLoad(v1::InferenceService::Stub* stub, const LoadConfig& c,
                                   const std::vector<RequestSpec>& specs, const std::vector<RequestSpec>& warmup,
                                   const SystemPrompt& system_prompt) {
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
    Stream stream(stub, c, &inflight);
    for (size_t k = 0; k < warmup.size() && !g_stop; ++k) {
      RequestResult r = stream.Run(warmup[k]);
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
  if (!g_stop && c.chat_turns > 0) {
    std::atomic<int64_t> next{0};
    const int64_t conversations = static_cast<int64_t>(specs.size()) / c.chat_turns;
    const int64_t n = std::min<int64_t>(c.concurrency, conversations);
    for (int64_t t = 0; t < n; ++t) {
      threads.emplace_back([&] {
        Stream stream(stub, c, &inflight);
        for (int64_t conv = next++; conv < conversations && !g_stop; conv = next++) {
          RunConversation(&stream, c, specs, system_prompt, conv, &results);
        }
        ++finished_threads;
      });
    }
    watch(n);
  } else if (!g_stop && !c.open_loop) {
    std::atomic<int64_t> next{0};
    const int64_t n = std::min<int64_t>(c.concurrency, static_cast<int64_t>(specs.size()));
    for (int64_t t = 0; t < n; ++t) {
      threads.emplace_back([&] {
        Stream stream(stub, c, &inflight);
        for (int64_t i = next++; i < static_cast<int64_t>(specs.size()) && !g_stop; i = next++) {
          results[static_cast<size_t>(i)] = stream.Run(specs[static_cast<size_t>(i)]);
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
        results[i] = Stream(stub, c, &inflight).Run(specs[i]);
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
    if (r.resent) ++out.resent;
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
    out.total_cached_tokens += r.cached_tokens;
    ttft.push_back(r.ttft_s);
    e2e.push_back(r.e2e_s);
    itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
  }
  out.ttft = Summarize(std::move(ttft));
  out.itl = Summarize(std::move(itl));
  out.e2e = Summarize(std::move(e2e));
  return out;
}

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

}  // namespace

absl::StatusOr<BenchRun> Benchmark(const LoadConfig& c) {
  // gRPC: the load's channel, and the model's facts (--compare's /http layouts too: their clusters
  // serve both APIs, and the same vocabulary and EOS ids give the same prompts as over gRPC).
  std::unique_ptr<v1::InferenceService::Stub> stub;
  BenchRun run;
  // Chat over HTTP needs no vocabulary: its prompts are text.
  if (c.backend == Backend::kGrpc || (c.vocab_size == 0 && !ChatOverHttp(c))) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = ConnectToCoordinator(c.client);
    if (!channel.ok()) return channel.status();
    stub = v1::InferenceService::NewStub(*channel);
    absl::StatusOr<ServedModel> model = GetServedModel(stub.get(), c.address);
    if (!model.ok()) return model.status();
    run.model = *model;
  }
  if (c.backend == Backend::kOpenAI) {
    OpenAIConnection conn(c);
    absl::StatusOr<ServedModel> model = conn.GetModel();
    if (!model.ok()) return model.status();
    if (c.vocab_size > 0) {
      run.model = *model;
    } else {
      run.model.name = model->name;
      if (model->max_model_len > 0) run.model.max_model_len = model->max_model_len;
    }
  }
  const ServedModel* model = &run.model;
  const int64_t turn_len =
      LengthRange(c.input_len, c.range_ratio).second + LengthRange(c.output_len, c.range_ratio).second;
  const int64_t longest = c.chat_turns > 0 ? c.system_prompt_len + c.chat_turns * turn_len : turn_len;
  if (model->max_model_len > 0 && longest > model->max_model_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the longest request (", longest,
        ChatOverHttp(c) ? " words and tokens, at least as many tokens: the system prompt and every turn's input + "
                          "output at most"
        : c.chat_turns > 0 ? " tokens: the system prompt and every turn's input + output at most"
                         : " tokens: input + output at most",
        ") exceeds the model's max_model_len (", model->max_model_len,
        "); lower --input-len/--output-len", c.chat_turns > 0 ? "/--chat-turns/--system-prompt-len" : ""));
  }
  std::vector<RequestSpec> warmup;
  const std::vector<RequestSpec> specs = MakeRequests(c, model->vocab_size, model->eos, &warmup);
  // The chat's system prompt, from a stream of its own (the same for every conversation).
  Rng system_rng(c.seed ^ 0x5bd1e9955bd1e995ULL);
  SystemPrompt system_prompt;
  if (ChatOverHttp(c)) {
    system_prompt.text = RandomWords(system_rng, c.system_prompt_len);
  } else {
    system_prompt.ids = RandomPrompt(system_rng, c.system_prompt_len, model->vocab_size, model->eos);
  }
  // Over HTTP every request names the model (OpenAI's "model" is required): the one GET /models gave.
  LoadConfig with_model = c;
  if (c.backend == Backend::kOpenAI) with_model.model_name = run.model.name;
  absl::StatusOr<LoadResult> load = RunLoad(stub.get(), with_model, specs, warmup, system_prompt);
  if (!load.ok()) return load.status();
  run.load = *load;
  return run;
}

}  // namespace shardserve::cli::bench
