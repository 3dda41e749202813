// What the files of `shardserve bench` share: cmd_bench.cc (flags, Run), bench_load.cc (the load
// generator), bench_report.cc (tables and JSON), bench_compare.cc (--compare: one local cluster per
// layout), bench_structured.cc (--json-schema). Internal to those files; bench_stats.h holds the
// statistics.
#ifndef SHARDSERVE_TOOLS_CLI_BENCH_H_
#define SHARDSERVE_TOOLS_CLI_BENCH_H_

#include <atomic>
#include <chrono>
#include <memory>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tools/cli/client.h"
#include "nlohmann/json.hpp"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tools/cli/bench_stats.h"
#include "tools/cli/local_cluster.h"

namespace shardserve::cli::bench {

using Clock = std::chrono::steady_clock;
// Keys in the order written, so that the JSON reads like the table.
using json = nlohmann::ordered_json;

// Set by SIGINT/SIGTERM (cmd_bench.cc); read by every thread (lock-free, so the handler may store to it).
extern std::atomic<bool> g_stop;

// ---- The load (bench_load.cc) -------------------------------------------------------------------

// Which API the load drives: the coordinator's gRPC API, or any OpenAI-compatible HTTP server
// (bench_openai.cc: streamed /v1/completions with token-id prompts; with chat_turns, streamed
// /v1/chat/completions with text messages).
enum class Backend { kGrpc, kOpenAI };

struct LoadConfig {
  Backend backend = Backend::kGrpc;
  // kOpenAI: "http://HOST:PORT[/PREFIX]" up to and including /v1 (no trailing slash); requests go to
  // base_url + "/completions". model_name: each request's "model" (empty: the first of GET /models);
  // vocab_size: prompt ids are drawn from [0, vocab_size) (0: from the server, which only
  // --compare's /http layouts know over gRPC). The API key is client.api_key (a Bearer token).
  std::string base_url;
  std::string model_name;
  int64_t vocab_size = 0;
  std::string address;  // client.address, for the report
  ClientOptions client;
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
  // Multi-turn chat (closed loop only): > 0: the requests are conversations of chat_turns turns,
  // each stream running one conversation at a time. A conversation's first prompt is a system
  // prompt of system_prompt_len tokens (the same for every conversation) and a message of
  // input_len tokens; each next turn's prompt is the last prompt, its answer and a new message.
  // Over HTTP the conversation is text (POST /chat/completions: system, user, assistant, user, ...
  // messages, rendered by the server's chat template): each message and the system prompt are that
  // many words from a fixed list of common English words (one token each in most tokenizers; the
  // input tokens reported are the server's usage.prompt_tokens), and each answer is the text the
  // server streamed.
  int64_t chat_turns = 0;
  int64_t system_prompt_len = 0;
  // Non-empty: every request's output is constrained to this JSON Schema (its compact text; gRPC
  // sampling.structured_output.json_schema, HTTP response_format json_schema), and json_schema_file
  // says where it came from. The engine refuses ignore_eos with a constraint (the grammar decides
  // where the output ends), so these requests go without it and still count as completed only with
  // exactly their output length: the schema's shortest instance must be longer than that many
  // tokens (tools/bench/bench_schema.json's is). Each output must also be the start of a JSON text
  // (JsonPrefixError), which a server that ignored the constraint would not give.
  std::string json_schema;
  std::string json_schema_file;
};

struct LoadResult {
  bool interrupted = false;
  double duration_s = 0;
  int64_t completed = 0;
  int64_t failed = 0;
  int64_t resent = 0;  // requests (completed or not) resent on a new connection (RequestResult.resent)
  int64_t total_input_tokens = 0;   // of completed requests
  int64_t total_output_tokens = 0;  // of completed requests
  int64_t total_cached_tokens = 0;  // of completed requests: prompt tokens from the prefix cache
  LatencySummary ttft, itl, e2e;
  std::vector<std::pair<std::string, int64_t>> errors;  // distinct messages, first seen first, with counts
};

// A chat message over HTTP: role "system", "user" or "assistant", and its text.
struct ChatMessage {
  std::string role;
  std::string content;
};

// One request of the load, and what came of it (bench_load.cc makes and runs them; bench_openai.cc
// runs them over HTTP).
struct RequestSpec {
  std::string id;
  std::vector<int32_t> prompt;  // chat: the turn's new message only (the history comes before it)
  // Chat over HTTP: the turn's new message as text (made by MakeRequests; prompt is then empty) and,
  // once its conversation gets there, the messages sent: the history ending with that message.
  // Non-empty messages: Send posts /chat/completions instead of /completions.
  std::string message;
  std::vector<ChatMessage> messages;
  int32_t output_len = 0;
  std::optional<uint64_t> sampling_seed;
};

struct RequestResult {
  bool done = false;  // ran (false: never started, e.g. interrupted)
  bool ok = false;    // completed with exactly output_len tokens
  std::string error;
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  int64_t cached_tokens = 0;  // usage's cached prompt tokens
  std::vector<int32_t> output_ids;  // gRPC only (an OpenAI server returns text)
  // The answer's text: chat over HTTP (the next turn's history), and with a JSON Schema (checked).
  std::string output_text;
  // Over HTTP: sent a second time, on a new connection, because the server had closed the
  // keep-alive connection it first went on (bench_openai.cc); its times count from the first send.
  bool resent = false;
  double ttft_s = 0;
  double e2e_s = 0;
  std::vector<double> itl_s;
};

// What the server says about itself, for prompts and the length check.
struct ServedModel {
  std::string name;
  int64_t vocab_size = 0;
  int64_t max_model_len = 0;
  std::set<int32_t> eos;
};

// One benchmark against `c.address`: model info, prompts, warm-up, load.
struct BenchRun {
  ServedModel model;
  LoadResult load;
};

absl::StatusOr<BenchRun> Benchmark(const LoadConfig& c);

// ---- The OpenAI backend (bench_openai.cc) -------------------------------------------------------

// Checks c.base_url ("http://HOST:PORT[/PATH]"); InvalidArgument naming what is wrong.
absl::Status CheckBaseUrl(const std::string& base_url);

// One keep-alive HTTP connection to c.base_url's server: one per stream. Not thread-safe: one
// thread uses it at a time, but Stop. Send never blocks past c.timeout_s without data, and stops (the request
// counts as failed) once g_stop is set.
class OpenAIConnection {
 public:
  explicit OpenAIConnection(const LoadConfig& c);
  ~OpenAIConnection();
  OpenAIConnection(const OpenAIConnection&) = delete;
  OpenAIConnection& operator=(const OpenAIConnection&) = delete;

  // GET /models: the model's name (c.model_name, which must be listed, or the first) and its
  // max_model_len when the server says it (shardserve and vLLM do); vocab_size from c.vocab_size.
  absl::StatusOr<ServedModel> GetModel();
  // POST /completions (spec.prompt as token ids) or, when spec.messages is set, POST
  // /chat/completions, streamed with include_usage: TTFT and ITL per SSE chunk carrying text
  // (chat: delta.content), tokens counted from usage.completion_tokens; for chat, the input tokens
  // from usage.prompt_tokens and the answer's text in output_text.
  RequestResult Send(const RequestSpec& spec);
  // Shuts the connection (a Send in flight ends, failed); callable from any thread (Ctrl-C).
  void Stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  const LoadConfig& c_;
};

// ---- Structured outputs (bench_structured.cc) ---------------------------------------------------

// The JSON Schema in `path`, written compactly: InvalidArgument naming --json-schema and the file
// when it cannot be read, is not JSON, is not an object, or is over the server's 64 KiB bound.
absl::StatusOr<std::string> ReadJsonSchema(const std::string& path);
// Empty when `text` is the start of some JSON text (all of one, or one cut short); otherwise the
// JSON parser's message about the first byte that no JSON text has there.
std::string JsonPrefixError(absl::string_view text);
// A completed request's error when it returned `got` tokens instead of `wanted` (finish reason
// `finish`), and when its output is not the start of a JSON text (`why`: JsonPrefixError's).
std::string ShortOutputError(const LoadConfig& c, int64_t wanted, int64_t got, absl::string_view finish);
std::string NotJsonError(absl::string_view why);

// ---- --compare (bench_compare.cc) ---------------------------------------------------------------

struct Layout {
  std::string name;  // as given: "tp2xpp2/serial"
  int64_t tp = 1;
  int64_t pp = 1;
  bool serial = false;
  bool prefix_caching = true;  // false: /no-prefix-caching (the coordinator's --no-prefix-caching)
  bool sync = false;           // /sync: the coordinator's --no-async-scheduling
  bool ngram = false;          // /ngram: the coordinator's --speculative ngram
  bool draft = false;          // /draft: the coordinator's --speculative draft with bench's --draft-model
  bool mtp = false;            // /mtp: the coordinator's --speculative mtp (the model's own MTP layer)
  bool eagle3 = false;         // /eagle3: the coordinator's --speculative eagle3 with bench's --draft-model as the head
  bool adaptive = false;       // /adaptive (with /ngram or /draft): the coordinator's --adaptive-speculative-tokens
  bool http = false;           // /http: the load goes to the coordinator's OpenAI API (--http-port)
  bool expert_parallel = false;  // /ep: the coordinator's --expert-parallel
  bool gloo = false;             // /gloo: the workers' --collectives gloo (Gloo's TCP alone)
  bool json = false;             // /json: every request with CompareOptions' JSON Schema
};

// tpN, ppM, tpNxppM, each optionally followed by /serial, /sync, /no-prefix-caching, /ngram, /draft,
// /mtp or /eagle3, /adaptive, /http, /ep, /gloo and /json (in any order).
absl::StatusOr<Layout> ParseLayout(const std::string& text);

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
  std::string json_schema_file;                // /json: the schema's file; empty otherwise
};

struct CompareOptions {
  ClusterFlags cluster;  // worker_threads unset: DefaultWorkerThreads on cpu; --micro-batches: non-serial layouts only
  std::string log_dir;
  // /json layouts' JSON Schema (LoadConfig::json_schema) and its file.
  std::string json_schema;
  std::string json_schema_file;
};

// Starts a local cluster for `layout`, runs `load` against it, reads its workers' facts and stops it.
// `round`: the how-manieth time the comparison runs this layout (1, 2, ...); its logs go to
// log_dir/<layout>, then <layout>_2, ..., so that no round's logs overwrite another's.
CompareRun RunLayout(const Layout& layout, int round, const CompareOptions& o, LoadConfig load);

// ---- Reporting (bench_report.cc) ----------------------------------------------------------------

double PerSecond(double n, double s);
// The keys every run has (single run, and each of --compare's runs).
json ResultJson(const LoadConfig& c, const LoadResult& r);
std::string LoadLine(const LoadConfig& c);
// Speculative decoding's counters in a coordinator's status: a table cell ("off", or the proposer,
// the share of proposed tokens accepted and the tokens per verification), and JSON (null when off).
std::string SpeculationSummary(const v1::SchedulerStatus& s);
json SpeculationJson(const v1::SchedulerStatus& s);
void PrintTable(const LoadConfig& c, const BenchRun& run);
void PrintCompareTable(const LoadConfig& c, const std::vector<CompareRun>& runs);
json CompareJson(const LoadConfig& c, const std::vector<CompareRun>& runs);
// Writes `j` to `path` (nothing when it is empty); false, with a message, when it cannot.
bool WriteJsonOut(const std::string& path, const json& j);

}  // namespace shardserve::cli::bench

#endif  // SHARDSERVE_TOOLS_CLI_BENCH_H_
