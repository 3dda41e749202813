// tools/cli/bench_openai.cc (shardserve bench --backend openai): one keep-alive connection per stream
// against a server that closes keep-alive connections between requests.
//
// An HTTP/1.1 server may close an idle keep-alive connection at any time (RFC 9112 9.3): cpp-httplib
// servers do after 5 idle seconds, and llama-server (cpp-httplib 0.58) after every streamed response,
// with no "Connection: close" header. A client that sends its next request as that close arrives
// reads nothing back. The fake server below makes that race deterministic: it answers
// `answered_per_connection` requests on a connection, then waits until the next request has arrived
// and closes the connection without reading or answering it (the kernel resets it), which is
// exactly what the client sees when the server's close crosses its request. The bench must then
// send that request again, once, on a fresh connection; it must not when the request failed on a
// fresh connection, or after the response had begun.
//
// Bounded in time: every wait of the fake server and the client is 30 s at most (LoadConfig.timeout_s).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tools/cli/bench.h"

namespace shardserve::cli::bench {

std::atomic<bool> g_stop{false};  // cmd_bench.cc's, which this test does not link

namespace {

constexpr int kWaitMs = 30000;  // any single wait; the machine may be loaded

struct FakeServerPolicy {
  // Requests answered in full on a connection before it is closed under the next one.
  int answered_per_connection = 1;
  // The request after those gets a status line, headers and one event, then the close (instead of
  // the close alone): a failure after the response began.
  bool cut_after_headers = false;
  // A request with response_format gets text that is the start of a JSON array of strings
  // (`["aaa...`) instead of `aaa...` (a server applying the constraint).
  bool json_answers = false;
};

// What the fake server saw.
struct FakeServerLog {
  int connections = 0;
  int answered = 0;            // requests answered in full
  int closed_unanswered = 0;   // connections closed under a request that had arrived (not read)
  int cut = 0;                 // responses cut after their headers
  std::string last_body;       // the body of the last request read
};

// A streaming /v1/completions server on 127.0.0.1, one connection at a time, by hand on POSIX
// sockets: the test needs to choose the exact moment of each close, which an HTTP library hides.
// Threading: Log() from any thread; the serving thread is joined by the destructor.
class FakeServer {
 public:
  explicit FakeServer(FakeServerPolicy policy) : policy_(policy) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listen_fd_, 16) != 0 || ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      ADD_FAILURE() << "cannot listen on 127.0.0.1";
      return;
    }
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    if (listen_fd_ >= 0) ::close(listen_fd_);
  }
  int port() const { return port_; }
  FakeServerLog Log() {
    absl::MutexLock l(&mu_);
    return log_;
  }

 private:
  // Waits for `fd` to be readable: false on stop or after kWaitMs.
  bool WaitReadable(int fd) {
    for (int waited = 0; waited < kWaitMs && !stop_; waited += 50) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) > 0) return true;
    }
    return false;
  }

  // One request (headers and a Content-Length body) into *body; false when the client closed.
  bool ReadRequest(int fd, std::string* buffer, std::string* body) {
    size_t end;
    while ((end = buffer->find("\r\n\r\n")) == std::string::npos) {
      if (!ReadMore(fd, buffer)) return false;
    }
    const std::string head = absl::AsciiStrToLower(buffer->substr(0, end));
    size_t length = 0;
    const size_t at = head.find("content-length:");
    if (at != std::string::npos) {
      const size_t eol = head.find("\r\n", at);
      const std::string value(absl::StripAsciiWhitespace(head.substr(at + 15, eol - at - 15)));
      if (!absl::SimpleAtoi(value, &length)) return false;
    }
    while (buffer->size() < end + 4 + length) {
      if (!ReadMore(fd, buffer)) return false;
    }
    *body = buffer->substr(end + 4, length);
    buffer->erase(0, end + 4 + length);
    return true;
  }
  bool ReadMore(int fd, std::string* buffer) {
    if (!WaitReadable(fd)) return false;
    char chunk[4096];
    const ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
    if (n <= 0) return false;
    buffer->append(chunk, static_cast<size_t>(n));
    return true;
  }
  static bool WriteAll(int fd, const std::string& s) {
    for (size_t sent = 0; sent < s.size();) {
      const ssize_t n = ::send(fd, s.data() + sent, s.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }
  static std::string Chunk(const std::string& data) {
    char size[32];
    std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
    return absl::StrCat(size, data, "\r\n");
  }
  static std::string Event(const nlohmann::json& j) { return Chunk(absl::StrCat("data: ", j.dump(), "\n\n")); }
  static constexpr char kHeaders[] =
      "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";

  // The answer to a completion request: max_tokens events of one token, the usage, [DONE].
  std::string Answer(const std::string& body) const {
    const nlohmann::json req = nlohmann::json::parse(body, nullptr, false);
    const int64_t tokens = req.is_object() && req.contains("max_tokens") && req["max_tokens"].is_number_integer()
                               ? req["max_tokens"].get<int64_t>()
                               : 1;
    const int64_t prompt = req.is_object() && req.contains("prompt") && req["prompt"].is_array()
                               ? static_cast<int64_t>(req["prompt"].size())
                               : 0;
    const bool json = policy_.json_answers && req.is_object() && req.contains("response_format");
    std::string out = kHeaders;
    for (int64_t i = 0; i < tokens; ++i) {
      const char* text = json && i == 0 ? "[\"" : "a";
      out += Event({{"choices", {{{"index", 0}, {"text", text}, {"finish_reason", i + 1 == tokens ? nlohmann::json("length") : nlohmann::json(nullptr)}}}}});
    }
    out += Event({{"choices", nlohmann::json::array()},
                  {"usage", {{"prompt_tokens", prompt}, {"completion_tokens", tokens}}}});
    out += Chunk("data: [DONE]\n\n");
    out += "0\r\n\r\n";
    return out;
  }

  void Serve() {
    while (!stop_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) continue;
      {
        absl::MutexLock l(&mu_);
        ++log_.connections;
      }
      ServeConnection(fd);
      ::close(fd);
    }
  }

  void ServeConnection(int fd) {
    std::string buffer, body;
    for (int k = 0; k < policy_.answered_per_connection; ++k) {
      if (!ReadRequest(fd, &buffer, &body)) return;
      {
        absl::MutexLock l(&mu_);
        ++log_.answered;  // counted before the client can read the answer (and look at the log)
        log_.last_body = body;
      }
      if (!WriteAll(fd, Answer(body))) return;
    }
    // The next request: wait until it has arrived (or the client closed), then end the connection.
    if (!WaitReadable(fd)) return;
    if (policy_.cut_after_headers) {
      if (!ReadRequest(fd, &buffer, &body)) return;
      {
        absl::MutexLock l(&mu_);
        ++log_.cut;
      }
      WriteAll(fd, absl::StrCat(kHeaders, Event({{"choices", {{{"index", 0}, {"text", "a"}}}}})));
      return;
    }
    char peek;
    if (::recv(fd, &peek, 1, MSG_PEEK) <= 0) return;  // the client closed: nothing to count
    absl::MutexLock l(&mu_);
    ++log_.closed_unanswered;  // closed with the request unread: the client gets a reset
  }

  const FakeServerPolicy policy_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  absl::Mutex mu_;
  FakeServerLog log_ ABSL_GUARDED_BY(mu_);
};

LoadConfig ConfigFor(const FakeServer& server) {
  LoadConfig c;
  c.backend = Backend::kOpenAI;
  c.base_url = absl::StrCat("http://127.0.0.1:", server.port(), "/v1");
  c.timeout_s = kWaitMs / 1000.0;
  return c;
}

RequestSpec Spec(int i, int32_t output_len) {
  RequestSpec s;
  s.id = absl::StrCat("r", i);
  s.prompt = {1, 2, 3, i};
  s.output_len = output_len;
  return s;
}

// A server that closes each keep-alive connection under the request after its N-th (N = 1 is
// llama-server's case: it closes the connection after every streamed response, with no
// "Connection: close"). Every request must complete; each one the close met is resent once.
class BenchOpenAIServerCloses : public testing::TestWithParam<int> {};

TEST_P(BenchOpenAIServerCloses, EveryRequestSucceeds) {
  const int n = GetParam();
  FakeServer server({.answered_per_connection = n});
  const LoadConfig c = ConfigFor(server);
  OpenAIConnection conn(c);
  constexpr int kRequests = 7;
  for (int i = 0; i < kRequests; ++i) {
    const RequestResult r = conn.Send(Spec(i, 4));
    EXPECT_TRUE(r.ok) << "request " << i << ": " << r.error;
    EXPECT_EQ(r.output_tokens, 4) << "request " << i;
    EXPECT_EQ(r.itl_s.size(), 3u) << "request " << i;  // 4 events with text: 3 gaps
    EXPECT_EQ(r.resent, i > 0 && i % n == 0) << "request " << i;  // the first on each closed connection
  }
  const FakeServerLog log = server.Log();
  EXPECT_EQ(log.answered, kRequests);
  EXPECT_EQ(log.closed_unanswered, (kRequests - 1) / n);
  EXPECT_EQ(log.connections, (kRequests + n - 1) / n);
}

INSTANTIATE_TEST_SUITE_P(AfterNResponses, BenchOpenAIServerCloses, testing::Values(1, 2, 3),
                         [](const testing::TestParamInfo<int>& p) { return absl::StrCat("ClosesAfter", p.param); });

// A request that fails on a connection the client has just opened is the server's failure: reported,
// not sent again.
TEST(BenchOpenAI, AFailureOnAFreshConnectionIsNotRetried) {
  FakeServer server({.answered_per_connection = 0});
  const LoadConfig c = ConfigFor(server);
  OpenAIConnection conn(c);
  const RequestResult r = conn.Send(Spec(0, 2));
  EXPECT_FALSE(r.ok);
  EXPECT_FALSE(r.resent);
  // The reset meets the client's read, or its write when the body goes out after the headers.
  EXPECT_TRUE(r.error.find("the connection failed or timed out while reading the response") != std::string::npos ||
              r.error.find("the connection failed while sending the request") != std::string::npos)
      << r.error;
  const FakeServerLog log = server.Log();
  EXPECT_EQ(log.closed_unanswered, 1);
  EXPECT_EQ(log.connections, 1);
  EXPECT_EQ(log.answered, 0);
}

// Once the server has begun to answer, the request reached it: a cut response is a failure, never
// sent again (it would run twice).
TEST(BenchOpenAI, AFailureAfterTheResponseBeganIsNotRetried) {
  FakeServer server({.answered_per_connection = 1, .cut_after_headers = true});
  const LoadConfig c = ConfigFor(server);
  OpenAIConnection conn(c);
  const RequestResult first = conn.Send(Spec(0, 2));
  EXPECT_TRUE(first.ok) << first.error;
  const RequestResult second = conn.Send(Spec(1, 2));  // on the reused connection, cut after its headers
  EXPECT_FALSE(second.ok);
  EXPECT_FALSE(second.resent);
  EXPECT_FALSE(second.error.empty());
  const FakeServerLog log = server.Log();
  EXPECT_EQ(log.answered, 1);
  EXPECT_EQ(log.cut, 1);
  EXPECT_EQ(log.connections, 1);
}

// With a JSON Schema the request carries it as OpenAI's response_format and goes without ignore_eos
// (which a constraint excludes); the output must be the start of a JSON text.
TEST(BenchOpenAI, AJsonSchemaGoesAsResponseFormatWithoutIgnoreEos) {
  FakeServer server({.answered_per_connection = 2, .json_answers = true});
  LoadConfig c = ConfigFor(server);
  c.json_schema = R"({"type":"array","items":{"type":"string"}})";
  c.json_schema_file = "schema.json";
  OpenAIConnection conn(c);
  const RequestResult r = conn.Send(Spec(0, 5));
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.output_tokens, 5);
  EXPECT_EQ(r.output_text, "[\"aaaa");
  const nlohmann::json body = nlohmann::json::parse(server.Log().last_body, nullptr, false);
  ASSERT_TRUE(body.is_object()) << server.Log().last_body;
  EXPECT_FALSE(body.contains("ignore_eos")) << body.dump();
  EXPECT_EQ(body["response_format"]["type"], "json_schema");
  EXPECT_EQ(body["response_format"]["json_schema"]["name"], "bench");
  EXPECT_EQ(body["response_format"]["json_schema"]["schema"], nlohmann::json::parse(c.json_schema));
}

// A server that ignores the constraint answers text that is no JSON: every such request fails.
TEST(BenchOpenAI, AnOutputThatIsNoJsonFailsUnderAJsonSchema) {
  FakeServer server({.answered_per_connection = 2});
  LoadConfig c = ConfigFor(server);
  c.json_schema = R"({"type":"array"})";
  c.json_schema_file = "schema.json";
  OpenAIConnection conn(c);
  const RequestResult r = conn.Send(Spec(0, 3));
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("the output is not the start of a JSON text"), std::string::npos) << r.error;
}

// JsonPrefixError: a JSON text cut anywhere is accepted (in a string, a number, a literal, between
// tokens); a byte no JSON text has at its place is refused.
TEST(BenchStructured, JsonPrefix) {
  for (const char* ok : {"", "[", "[\"", "[\"ab\\", "[\"a\\u00", "{\"id\":12", "{\"id\":-", "[1,tr", "[1.", "[1e",
                         "[{\"a\":[]},", "[1]", "{}", "\"x\"", "12", "[-0.5e+3,true,null,false]", "{\"k\" : [ {} ] }",
                         "[\"\\u00e9\"]", " [ 1 , "}) {
    EXPECT_EQ(JsonPrefixError(ok), "") << ok;
  }
  for (const char* bad : {"a", "[1]x", "[,", "{\"a\" 1", "[1 2", "[\"\x01", "{1", "[tx", "[1]]", "[01", "{tr", "[1,]",
                          "{\"a\":1,}", "[1.5.", "\"\\q", "[1}", "{\"a\"]", "[-a", "[1e+]", "\"\\u12g"}) {
    EXPECT_NE(JsonPrefixError(bad), "") << bad;
  }
}

TEST(BenchStructured, ReadJsonSchema) {
  const std::string dir = testing::TempDir();
  auto write = [&](const std::string& name, const std::string& text) {
    const std::string path = dir + "/" + name;
    std::FILE* f = std::fopen(path.c_str(), "wb");
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
    return path;
  };
  const std::string good = write("good.json", "{\n  \"type\": \"array\",\n  \"minItems\": 3\n}\n");
  absl::StatusOr<std::string> schema = ReadJsonSchema(good);
  ASSERT_TRUE(schema.ok()) << schema.status();
  EXPECT_EQ(*schema, R"({"minItems":3,"type":"array"})");
  for (const auto& [path, want] : std::vector<std::pair<std::string, std::string>>{
           {dir + "/none.json", "cannot open the file"},
           {write("text.json", "{\"type\": "), "is not JSON"},
           {write("array.json", "[1, 2]"), "must be a JSON object"},
           {write("big.json", absl::StrCat("{\"x\":\"", std::string(70000, 'a'), "\"}")),
            "is 70008 bytes written compactly; servers take at most 65536"}}) {
    absl::StatusOr<std::string> s = ReadJsonSchema(path);
    ASSERT_FALSE(s.ok()) << path;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(absl::StrCat("--json-schema ", path, ": ", want)), std::string::npos)
        << s.status();
  }
}

}  // namespace
}  // namespace shardserve::cli::bench
