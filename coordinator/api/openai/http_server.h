// The OpenAI-compatible HTTP API of the coordinator, served by cpp-httplib beside the gRPC API and
// driving the same Engine (no second path to the workers):
//
//   POST /v1/chat/completions  messages rendered by the model's chat template (coordinator/chat)
//   POST /v1/completions       a prompt as text or token ids
//   GET  /v1/models            the served model (and /v1/models/{model})
//   POST /v1/responses         OpenAI's Responses API, served as a chat completion (responses.h);
//                              GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items
//                              read the stored ones (responses_store.h)
//   POST /tokenize             a prompt, or a chat's messages as rendered, as token ids (vLLM's)
//   POST /detokenize           token ids as text (vLLM's)
//   GET  /health               200 while the group serves, 503 (saying why) otherwise
//
// Both completions answer at once or stream server-sent events (`data: {chunk}\n\n` ... `data: [DONE]`).
// A request body is parsed and checked by protocol.h, then by PrepareGeneration (the gRPC API's
// checks), and submitted to the engine once per choice (n). Errors are OpenAI's JSON shape with
// the status HTTP means: 400 (a bad field, named), 404 (unknown model or path), 413 (a body over
// max_body_bytes), 429 (the engine's queue is full), 503 (the group is not serving).
//
// A client that goes away has its requests cancelled in the engine (their KV blocks freed at the
// next step) and is counted with status 499: streaming, noticed at the next chunk written;
// non-streaming, noticed while the handler waits (peer_watch.h polls the connection's socket every
// 50 ms or so).
//
// TLS and API keys (docs/security.md): with options.tls_cert/tls_key it serves HTTPS
// (security/https.h: httplib::SSLServer, OpenSSL) with that certificate, re-read when its files
// change (new handshakes get the new one); clients are not asked for one (they authenticate by
// key). With options.api_keys, every route but GET /health must carry
// `Authorization: Bearer <key>` (what the openai client sends as api_key); without one, or with an
// unknown one, it is answered 401 in OpenAI's shape (code invalid_api_key) and counted in
// shardserve_auth_failures_total{reason="missing_key"|"invalid_key"}. Keys are never logged.
//
// Ownership: borrows the model, the pool, the engine, the metrics (may be null) and the API keys
// (may be null: no keys asked), which must outlive it. Owns the listening thread and httplib's
// worker threads, joined by Stop() or the destructor; shut the engine down first (Engine::Shutdown
// ends the streams that handlers wait on, so that Stop() returns at once).
// Threading: handlers run on httplib's threads, concurrently; Stop() from any one thread.
#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_HTTP_SERVER_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_HTTP_SERVER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/api/openai/harmony.h"
#include "coordinator/api/openai/protocol.h"
#include "coordinator/api/openai/responses.h"
#include "coordinator/api/openai/responses_store.h"
#include "coordinator/api/openai/reasoning.h"
#include "coordinator/api/openai/tool_calls.h"
#include "coordinator/engine/engine.h"
#include "coordinator/telemetry/metrics.h"
#include "coordinator/model/served_model.h"
#include "coordinator/cluster/worker_pool.h"
#include "security/api_keys.h"

namespace httplib {
class Server;
class Request;
class Response;
}  // namespace httplib

namespace shardserve::openai {

class ConnectionPool;

// The connection threads the coordinator gives its HTTP API beyond one per request the engine takes
// (--max-num-seqs + --max-waiting-requests): probes, /v1/models, idle keep-alive connections. And
// at most this many in all.
inline constexpr int kSpareHttpThreads = 32;
inline constexpr int kMaxHttpThreads = 4096;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                         // 0: a free port (port() says which)
  int64_t max_body_bytes = int64_t{8} << 20;  // larger bodies: 413
  // Connections served at once; each streaming or waiting request holds one, and an idle
  // keep-alive connection holds one for up to 5 s. A connection beyond them is answered 503
  // (code server_busy, Retry-After: 1, Connection: close) at once (connection_pool.h).
  int threads = 128;
  // Connections open at once from one address (0: any number); the next is answered 503 (code
  // too_many_connections) without being read. Keeps one client from holding every thread.
  int max_connections_per_peer = 0;
  // HTTPS with this certificate (PEM, a chain, leaf first) and key; both empty: plain HTTP. The
  // caller checks the files first (CheckTlsFiles).
  std::string tls_cert;
  std::string tls_key;
  // Borrowed; null: no key asked.
  ApiKeys* api_keys = nullptr;
  // How chat outputs are parsed: tool calls (tool_calls.h: "hermes", "llama3_json", "mistral",
  // "none") and reasoning (reasoning.h: "deepseek_r1", "qwen3", "none"). Empty: recognised in the
  // model's chat template. An unknown name fails Start.
  std::string tool_call_parser;
  std::string reasoning_parser;
  // The stored responses of /v1/responses (responses_store.h) within this many bytes, the least
  // recently used dropped first; 0: none stored (previous_response_id is refused).
  int64_t responses_store_bytes = int64_t{128} << 20;
};

class HttpServer {
 public:
  // Binds host:port and starts serving. FailedPrecondition naming the address when it cannot bind,
  // InvalidArgument naming the files when OpenSSL cannot use the certificate or key.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const ServedModel* model, WorkerPool* pool, Engine* engine,
                                                           CoordinatorMetrics* metrics,
                                                           const HttpServerOptions& options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }
  bool https() const { return !options_.tls_cert.empty(); }
  // Stops accepting, waits for the handlers running, joins the threads. Idempotent.
  void Stop();

 private:
  HttpServer(const ServedModel* model, WorkerPool* pool, Engine* engine, CoordinatorMetrics* metrics,
             const HttpServerOptions& options);
  void Routes();
  // OK, or UNAUTHENTICATED saying what to send (counted in the metrics).
  absl::Status Authorize(const httplib::Request& req);
  // The POST routes, each given the request's body: a chat or text completion, and vLLM's
  // /tokenize and /detokenize.
  // With `view` (/v1/responses), the answer is written as a Response, a stream's chunks as its events.
  void Generate(bool chat, const httplib::Request& req, const std::string& body, httplib::Response& res,
                std::shared_ptr<ResponsesView> view);
  // The Responses API: its body made a chat completion's (responses.h), served by Generate through a
  // ResponsesView, and an error's param named as this API names it.
  // With the store on, a previous_response_id's conversation is read from it, and the Response is
  // stored once whole (unless the request says store: false).
  void Respond(const httplib::Request& req, const std::string& body, httplib::Response& res);
  // GET /v1/responses/{id}/input_items: a stored response's input items, as OpenAI lists them
  // (limit 1-100, default 20; order desc (the default) or asc; after an item id).
  void ListInputItems(const httplib::Request& req, httplib::Response& res);
  // Who a request is, to the store: its API key's fingerprint, or empty without keys.
  std::string Owner(const httplib::Request& req) const;
  // The store's size in the metrics (after a Put or a Delete).
  void StoreMetrics();
  void Tokenize(const httplib::Request& req, const std::string& body, httplib::Response& res);
  void Detokenize(const httplib::Request& req, const std::string& body, httplib::Response& res);
  // The prompt of a chat request as the model's chat template renders it (continuing the final
  // message when asked), the client's connection watched meanwhile; nullopt once `res` has the
  // answer: 400 (no template or tokenizer, the template raised), 500 (it ran past its budget), or
  // 499 counted (the client went away). `id` names the request in the log.
  std::optional<std::string> RenderChat(const std::string& id, const Request& request, const httplib::Request& req,
                                        httplib::Response& res);
  // OK for the served model's name or none; NOT_FOUND naming both otherwise.
  absl::Status CheckModelName(const std::string& model) const;
  // The answer to a completion on an overflow thread: 503 server_busy, "Connection: close".
  void Busy(httplib::Response& res);

  // ---- Constant after construction ----
  const ServedModel* const model_;
  WorkerPool* const pool_;
  Engine* const engine_;
  CoordinatorMetrics* const metrics_;
  const HttpServerOptions options_;
  const int64_t created_;  // unix seconds: /v1/models' "created"
  ToolCallFormat tool_format_ = ToolCallFormat::kNone;      // set by Start
  // Harmony's markers in the model's tokenizer (set by Start with the format harmony): forced calls
  // are then written as harmony writes calls; without them, as JSON.
  std::optional<HarmonyMarkers> harmony_markers_;
  ReasoningFormat reasoning_format_ = ReasoningFormat::kNone;  // set by Start
  // The formats' text markers (<think>, hermes' <tool_call>) that the model's tokenizer makes special
  // tokens (set by Start): the output keeps them when special tokens are skipped, for the parsers.
  std::vector<int32_t> reasoning_marker_ids_, tool_marker_ids_;
  const std::unique_ptr<ResponsesStore> responses_;  // null: nothing stored
  std::unique_ptr<httplib::Server> http_;
  // The connection pool httplib made (new_task_queue), for ConnectionPolicy::crowded.
  const std::shared_ptr<std::atomic<ConnectionPool*>> connections_ = std::make_shared<std::atomic<ConnectionPool*>>(nullptr);
  int port_ = 0;

  std::thread listener_;
};

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_HTTP_SERVER_H_
