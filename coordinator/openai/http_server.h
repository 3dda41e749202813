// The OpenAI-compatible HTTP API of the coordinator, served by cpp-httplib beside the gRPC API and
// driving the same Engine (no second path to the workers):
//
//   POST /v1/chat/completions  messages rendered by the model's chat template (coordinator/chat)
//   POST /v1/completions       a prompt as text or token ids
//   GET  /v1/models            the served model
//   GET  /health               200 while the group serves, 503 (saying why) otherwise
//
// Both POSTs answer at once or stream server-sent events (`data: {chunk}\n\n` ... `data: [DONE]`).
// A request body is parsed and checked by protocol.h, then by PrepareGeneration (the gRPC API's
// checks), and submitted to the engine once per choice (n). Errors are OpenAI's JSON shape with
// the status HTTP means: 400 (a bad field, named), 404 (unknown model or path), 413 (a body over
// max_body_bytes), 429 (the engine's queue is full), 503 (the group is not serving).
//
// A streaming client that goes away is noticed at the next chunk written; its requests are
// cancelled in the engine (their KV blocks freed at the next step). A non-streaming request runs
// to its end.
//
// TLS and API keys: every connection goes through MakeServer (where an httplib::SSLServer would be
// made instead) and every request through Authorize (where a key would be checked); both are the
// only places to change.
//
// Ownership: borrows the model, the pool, the engine and the metrics (may be null), which must
// outlive it. Owns the listening thread and httplib's worker threads, joined by Stop() or the
// destructor; shut the engine down first (Engine::Shutdown ends the streams that handlers wait on,
// so that Stop() returns at once).
// Threading: handlers run on httplib's threads, concurrently; Stop() from any one thread.
#ifndef SHARDSERVE_COORDINATOR_OPENAI_HTTP_SERVER_H_
#define SHARDSERVE_COORDINATOR_OPENAI_HTTP_SERVER_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "coordinator/server/engine.h"
#include "coordinator/server/metrics.h"
#include "coordinator/server/served_model.h"
#include "coordinator/server/worker_pool.h"

namespace httplib {
class Server;
class Request;
class Response;
}  // namespace httplib

namespace shardserve::openai {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                         // 0: a free port (port() says which)
  int64_t max_body_bytes = int64_t{8} << 20;  // larger bodies: 413
  // Connections served at once; each streaming or waiting request holds one.
  int threads = 128;
};

class HttpServer {
 public:
  // Binds host:port and starts serving. FailedPrecondition naming the address when it cannot bind.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const ServedModel* model, WorkerPool* pool, Engine* engine,
                                                           CoordinatorMetrics* metrics,
                                                           const HttpServerOptions& options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }
  // Stops accepting, waits for the handlers running, joins the threads. Idempotent.
  void Stop();

 private:
  HttpServer(const ServedModel* model, WorkerPool* pool, Engine* engine, CoordinatorMetrics* metrics,
             const HttpServerOptions& options);
  void Routes();
  void Generate(bool chat, const httplib::Request& req, httplib::Response& res);

  // ---- Constant after construction ----
  const ServedModel* const model_;
  WorkerPool* const pool_;
  Engine* const engine_;
  CoordinatorMetrics* const metrics_;
  const HttpServerOptions options_;
  const int64_t created_;  // unix seconds: /v1/models' "created"
  std::unique_ptr<httplib::Server> http_;
  int port_ = 0;

  std::thread listener_;
};

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_OPENAI_HTTP_SERVER_H_
