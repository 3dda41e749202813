// The coordinator's OpenAI HTTP API beyond the body: the request line, headers, Authorization,
// routing, pipelining, chunked bodies. The input is the bytes a client sends on one connection. A
// real HttpServer (coordinator/api/openai/http_server.h, started once on 127.0.0.1 with a free port,
// API keys on) serves the demo model (models/demo) with a WorkerPool that has no workers (so no
// completion is ever generated: a request that passes every check is answered 503); each input is
// written on a new TCP connection, whose sending side is then shut, and the answer is read to the
// end. Every byte thus goes through the same path as a client's: the connection loop
// (security/http_connection.h), cpp-httplib's parser, the pre-routing check, the key check, the
// routes and the error handler.
//
// Invariants: the server answers with HTTP/1.1 status lines only, each with a status in
// [100, 600), and closes the connection within 20 s (no hang; below libFuzzer's -timeout=25); an
// input that does not carry the key never gets an answer but /health's (the model list, the model,
// /tokenize's ids or /detokenize's text answered 200);
// every 4xx/5xx body the server wrote is OpenAI's error JSON. The server itself must not crash (the sanitizers watch its threads).
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>

#include "coordinator/api/openai/http_server.h"
#include "coordinator/engine/engine.h"
#include "coordinator/telemetry/metrics.h"
#include "coordinator/model/served_model.h"
#include "coordinator/cluster/worker_pool.h"
#include "fuzz/check.h"
#include "fuzz/scratch_dir.h"
#include "nlohmann/json.hpp"
#include "security/api_keys.h"

namespace {

using shardserve_fuzz::Check;

namespace fs = std::filesystem;

constexpr char kKey[] = "sk-fuzz-0123456789";

// The server and what it borrows, started once and never stopped (the process exits).
struct Server {
  std::unique_ptr<shardserve::ServedModel> model;
  std::unique_ptr<shardserve::WorkerPool> pool;
  std::unique_ptr<shardserve::CoordinatorMetrics> metrics;
  std::unique_ptr<shardserve::Engine> engine;
  std::unique_ptr<shardserve::ApiKeys> keys;
  std::unique_ptr<shardserve::openai::HttpServer> http;
};

const Server& TheServer() {
  static const Server* server = [] {
    auto* s = new Server();
    absl::StatusOr<std::unique_ptr<shardserve::ServedModel>> model =
        shardserve::ServedModel::Open(std::string(SHARDSERVE_SOURCE_DIR) + "/models/demo");
    Check(model.ok(), "cannot open models/demo");
    s->model = *std::move(model);
    absl::StatusOr<std::unique_ptr<shardserve::WorkerPool>> pool = shardserve::WorkerPool::Create(s->model.get(), {});
    Check(pool.ok(), "cannot make the worker pool");
    s->pool = *std::move(pool);
    s->metrics = std::make_unique<shardserve::CoordinatorMetrics>(s->model->name);
    s->engine = std::make_unique<shardserve::Engine>(s->model.get(), s->pool.get(), shardserve::EngineOptions{},
                                                     s->metrics.get());
    const std::string key_file = (shardserve_fuzz::MakeScratchDir() / "keys").string();
    std::ofstream(key_file) << "# the fuzz target's key\n" << kKey << "\n";
    absl::StatusOr<std::unique_ptr<shardserve::ApiKeys>> keys = shardserve::ApiKeys::Load(key_file);
    Check(keys.ok(), "cannot load the key file");
    s->keys = *std::move(keys);
    shardserve::openai::HttpServerOptions options;
    options.port = 0;
    options.threads = 4;
    options.max_body_bytes = 1 << 16;
    options.api_keys = s->keys.get();
    absl::StatusOr<std::unique_ptr<shardserve::openai::HttpServer>> http =
        shardserve::openai::HttpServer::Start(s->model.get(), s->pool.get(), s->engine.get(), s->metrics.get(), options);
    Check(http.ok(), "cannot start the HTTP server");
    s->http = *std::move(http);
    return s;
  }();
  return *server;
}

// Sends `request` on a new connection to the server, shuts the sending side, and returns all the
// server wrote until it closed the connection (aborts after 20 s: a hang).
std::string Exchange(std::string_view request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  Check(fd >= 0, "socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(TheServer().http->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // A connect interrupted by the -timeout alarm (EINTR: a loaded machine's loopback backlog can keep
  // it waiting) goes on in the background: wait for it and read its outcome.
  int connected = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 ? 0 : errno;
  if (connected == EINTR) {
    pollfd p{fd, POLLOUT, 0};
    int ready;
    do {
      ready = ::poll(&p, 1, 20000);
    } while (ready < 0 && errno == EINTR);
    socklen_t len = sizeof(connected);
    connected = ready > 0 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &connected, &len) == 0 ? connected : ETIMEDOUT;
  }
  if (connected != 0) std::fprintf(stderr, "http_request_fuzzer: connect: %s\n", std::strerror(connected));
  Check(connected == 0, "connect failed");
  size_t sent = 0;
  std::string answer;
  char buf[16384];
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  bool shut = false;
  for (;;) {
    if (sent == request.size() && !shut) {
      ::shutdown(fd, SHUT_WR);
      shut = true;
    }
    pollfd p{fd, static_cast<short>(POLLIN | (shut ? 0 : POLLOUT)), 0};
    const int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    Check(left > 0, "the server did not close the connection within 20 s");
    // libFuzzer's -timeout alarm (SIGALRM, every timeout / 2 s) interrupts the calls: EINTR, again.
    const int ready = ::poll(&p, 1, left);
    if (ready < 0 && errno == EINTR) continue;
    Check(ready > 0, "the server did not close the connection within 20 s");
    if (p.revents & POLLOUT) {
      const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        sent = request.size();  // the server closed its side: it reads no more
      } else {
        sent += static_cast<size_t>(n);
      }
    }
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      answer.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  return answer;
}

// Each response of `answer` (status line, headers, a body framed by Content-Length or chunks),
// checked: the status, and an error body that is OpenAI's JSON. The answer to a HEAD request has a
// head only (its Content-Length says what a GET would get): one whose body would run past the
// answer or start with the next status line is taken as that, allowed when `head_asked`. Returns
// whether one of them was a 200 with a body other than /health's (an answer that needs the key).
bool CheckResponses(std::string_view answer, bool head_asked) {
  bool keyed_answer = false;
  while (!answer.empty()) {
    Check(answer.substr(0, 9) == "HTTP/1.1 " && answer.size() >= 12, "a response without an HTTP/1.1 status line");
    const int status = std::atoi(std::string(answer.substr(9, 3)).c_str());
    Check(status >= 100 && status < 600, "a status outside [100, 600)");
    const size_t head_end = answer.find("\r\n\r\n");
    Check(head_end != std::string_view::npos, "a response head without its end");
    const std::string head(answer.substr(0, head_end));
    answer.remove_prefix(head_end + 4);
    std::string body;
    if (const size_t cl = head.find("\r\nContent-Length: "); cl != std::string::npos) {
      const size_t n = std::strtoull(head.c_str() + cl + 18, nullptr, 10);
      if (n > 0 && (n > answer.size() || answer.substr(0, 9) == "HTTP/1.1 ")) {
        Check(head_asked, "a body shorter than its Content-Length");
        continue;  // a HEAD request's answer
      }
      body = answer.substr(0, n);
      answer.remove_prefix(n);
    } else if (head.find("\r\nTransfer-Encoding: chunked") != std::string::npos) {
      for (;;) {  // a server-sent event stream: chunks until the empty one
        const size_t line = answer.find("\r\n");
        Check(line != std::string_view::npos, "a chunk without its size line");
        const size_t n = std::strtoull(std::string(answer.substr(0, line)).c_str(), nullptr, 16);
        Check(answer.size() >= line + 2 + n + 2, "a chunk cut short");
        body += answer.substr(line + 2, n);
        answer.remove_prefix(line + 2 + n + 2);
        if (n == 0) break;
      }
    }
    if (status >= 400) {
      const nlohmann::json e = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
      Check(e.is_object() && e.contains("error") && e["error"].is_object() && e["error"].contains("message") &&
                e["error"]["message"].is_string() && e["error"].contains("type"),
            "an error body that is not OpenAI's error JSON");
    }
    // Every route but /health needs the key (HEAD's answers have no body).
    if (status == 200 && !body.empty() && body != R"({"status":"ok"})") keyed_answer = true;
  }
  return keyed_answer;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  TheServer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view request(reinterpret_cast<const char*>(data), size);
  const std::string answer = Exchange(request);
  const bool keyed_answer = CheckResponses(answer, request.find("HEAD") != std::string_view::npos);
  Check(!keyed_answer || request.find(kKey) != std::string_view::npos, "an answer other than /health's without the key");
  return 0;
}
