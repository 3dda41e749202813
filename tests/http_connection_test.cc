// How the HTTP ports serve a connection (security/http_connection.h), with a real httplib server made
// by MakeHttpServer and raw sockets on 127.0.0.1:
// - pipelined requests (several in one write) are all answered, in order, over HTTP and HTTPS;
// - a head that cannot be parsed is answered once and the connection closed;
// - a request line and headers sent a byte at a time are cut off at the head deadline with 408,
//   and a body that stops arriving at the body deadline;
// - connections past the cap per address are answered 503 too_many_connections at once, and the
//   cap frees as connections close;
// - an idle keep-alive connection is closed as soon as crowded() says so; a hurried connection
//   serves one request and has the short head deadline.
// Every wait is bounded; the deadlines here are short (a second) so that the cases are quick, and
// the assertions allow several times them.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "security/certificates.h"
#include "security/https.h"
#include "tests/test_certificates.h"

namespace shardserve {
namespace {

using Clock = std::chrono::steady_clock;

// A plain TCP client: what it sends goes out as written (one write, so pipelined requests share
// segments), what it reads is kept.
class RawClient {
 public:
  explicit RawClient(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~RawClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool connected() const { return connected_; }
  bool Send(const std::string& bytes) {
    return ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
  }
  // Reads until the peer closes or `seconds` pass; returns all read so far.
  std::string ReadUntilClosed(double seconds) {
    const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int>(seconds * 1000));
    while (!closed_ && Clock::now() < until) ReadSome(until);
    return got_;
  }
  // Reads until `marker` is in what was read (a response's head and body may come in two
  // segments: wait for the body's text), the peer closes or `seconds` pass.
  std::string ReadUntilContains(const std::string& marker, double seconds) {
    const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int>(seconds * 1000));
    while (!closed_ && Clock::now() < until && got_.find(marker) == std::string::npos) ReadSome(until);
    return got_;
  }
  bool closed() const { return closed_; }
  int Count(const std::string& what) const {
    int n = 0;
    for (size_t at = got_.find(what); at != std::string::npos; at = got_.find(what, at + 1)) ++n;
    return n;
  }

 private:
  void ReadSome(Clock::time_point until) {
    pollfd p{fd_, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left))) <= 0) return;
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n <= 0) {
      closed_ = true;
      return;
    }
    got_.append(buf, static_cast<size_t>(n));
  }

  int fd_ = -1;
  bool connected_ = false;
  bool closed_ = false;
  std::string got_;
};

// A server on a free loopback port: GET /n answers its path's number, POST /echo its body.
class Server {
 public:
  explicit Server(const ConnectionPolicy& policy, const TlsFiles& tls = {}) {
    absl::StatusOr<std::unique_ptr<httplib::Server>> made = MakeHttpServer(tls, policy);
    EXPECT_TRUE(made.ok()) << made.status();
    if (!made.ok()) return;
    http_ = *std::move(made);
    http_->Get(R"(/(\d+))", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content(absl::StrCat("answer ", req.matches[1].str()), "text/plain");
    });
    http_->Post("/echo", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content(absl::StrCat("echo ", req.body), "text/plain");
    });
    http_->Get("/slow", [](const httplib::Request&, httplib::Response& res) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      res.set_content("slow answer", "text/plain");
    });
    http_->Get("/hold", [this](const httplib::Request&, httplib::Response& res) {
      ++held_;
      for (int i = 0; i < 600 && !release_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      res.set_content("released", "text/plain");
    });
    port_ = http_->bind_to_any_port("127.0.0.1");
    listener_ = std::thread([this] { http_->listen_after_bind(); });
    for (int i = 0; i < 1000 && !http_->is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ~Server() {
    release_ = true;
    if (http_) http_->stop();
    if (listener_.joinable()) listener_.join();
  }
  int port() const { return port_; }
  httplib::Server& http() { return *http_; }
  std::atomic<int> held_{0};
  std::atomic<bool> release_{false};

 private:
  std::unique_ptr<httplib::Server> http_;
  std::thread listener_;
  int port_ = 0;
};

ConnectionPolicy Quick() {
  ConnectionPolicy p;
  p.head_deadline = absl::Seconds(1);
  p.body_deadline = absl::Seconds(1);
  p.idle_timeout = absl::Seconds(5);
  p.hurried_head_deadline = absl::Milliseconds(500);
  return p;
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(HttpConnectionTest, PipelinedRequestsAreAllAnsweredInOrder) {
  Server server(Quick());
  RawClient c(server.port());
  ASSERT_TRUE(c.connected());
  // Three requests in one write: httplib's own loop answered the first and dropped the rest.
  ASSERT_TRUE(c.Send("GET /1 HTTP/1.1\r\nHost: x\r\n\r\n"
                     "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                     "GET /3 HTTP/1.1\r\nHost: x\r\n\r\n"));
  const std::string got = c.ReadUntilContains("answer 3", 10);
  ASSERT_EQ(c.Count("HTTP/1.1 200"), 3) << got;
  const size_t one = got.find("answer 1"), two = got.find("echo hello"), three = got.find("answer 3");
  ASSERT_NE(one, std::string::npos) << got;
  ASSERT_NE(two, std::string::npos) << got;
  ASSERT_NE(three, std::string::npos) << got;
  EXPECT_LT(one, two);
  EXPECT_LT(two, three);
  EXPECT_FALSE(c.closed());  // still kept alive
}

// A request answered after its own deadlines have passed (a long stream) leaves the connection
// good for the next one.
TEST(HttpConnectionTest, TheNextRequestAfterALongAnswerIsServed) {
  Server server(Quick());  // head and body deadlines 1 s; /slow answers after 2.5 s
  RawClient c(server.port());
  ASSERT_TRUE(c.Send("GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"));
  ASSERT_TRUE(absl::StrContains(c.ReadUntilContains("slow answer", 20), "slow answer"));
  ASSERT_TRUE(c.Send("GET /2 HTTP/1.1\r\nHost: x\r\n\r\n"));
  const std::string got = c.ReadUntilContains("answer 2", 10);
  EXPECT_TRUE(absl::StrContains(got, "answer 2")) << got;
  EXPECT_EQ(c.Count("HTTP/1.1 200"), 2) << got;
}

TEST(HttpConnectionTest, AHeadSentAByteAtATimeIsCutOffAtItsDeadline) {
  Server server(Quick());
  RawClient c(server.port());
  ASSERT_TRUE(c.connected());
  const std::string head = "GET /1 HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
  const auto start = Clock::now();
  // A byte every 100 ms: each read is quick, the head takes 7 s; the deadline is 1 s.
  std::string got;
  for (char ch : head) {
    if (!c.Send(std::string(1, ch))) break;
    got = c.ReadUntilClosed(0.1);
    if (c.closed()) break;
  }
  const double took = SecondsSince(start);
  EXPECT_TRUE(c.closed()) << got;
  EXPECT_TRUE(absl::StartsWith(got, "HTTP/1.1 408")) << got;
  EXPECT_TRUE(absl::StrContains(got, "within 1s of its first byte")) << got;
  EXPECT_LT(took, 5) << "the head's deadline is 1 s";
}

TEST(HttpConnectionTest, ARequestLineCutShortIsAnswered408) {
  Server server(Quick());
  RawClient c(server.port());
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send("GET /1 HT"));  // and nothing more
  const std::string got = c.ReadUntilClosed(10);
  EXPECT_TRUE(c.closed());
  EXPECT_TRUE(absl::StartsWith(got, "HTTP/1.1 408")) << got;
}

// A head httplib cannot parse leaves the connection at an unknown place in the client's bytes: one
// 400, then the connection closes; the lines after it are not read as requests of their own, nor
// is the well-formed request behind them.
TEST(HttpConnectionTest, AnUnreadableHeadIsAnsweredOnceAndTheConnectionClosed) {
  Server server(Quick());
  RawClient c(server.port());
  ASSERT_TRUE(c.connected());
  std::string junk = "NOT HTTP AT ALL\r\n";
  for (int i = 0; i < 50; ++i) junk += "x\r\n";
  ASSERT_TRUE(c.Send(junk + "\r\nGET /1 HTTP/1.1\r\nHost: x\r\n\r\n"));
  const auto start = Clock::now();
  const std::string got = c.ReadUntilClosed(10);
  EXPECT_TRUE(c.closed()) << got;
  EXPECT_LT(SecondsSince(start), 5) << "closed at once, not at the idle timeout";
  EXPECT_TRUE(absl::StartsWith(got, "HTTP/1.1 400")) << got;
  EXPECT_EQ(c.Count("HTTP/1.1 "), 1) << got;
  EXPECT_FALSE(absl::StrContains(got, "answer 1")) << got;
}

TEST(HttpConnectionTest, ABodyThatStopsArrivingIsCutOffAtItsDeadline) {
  Server server(Quick());
  RawClient c(server.port());
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly ten.."));
  const auto start = Clock::now();
  const std::string got = c.ReadUntilClosed(10);
  EXPECT_TRUE(c.closed()) << got;
  EXPECT_FALSE(absl::StrContains(got, "echo")) << got;
  EXPECT_LT(SecondsSince(start), 5);
}

TEST(HttpConnectionTest, ConnectionsPastTheCapPerAddressAreRefusedAtOnce) {
  ConnectionPolicy policy = Quick();
  policy.max_per_peer = 2;
  policy.head_deadline = absl::Seconds(30);  // the two held connections stay
  Server server(policy);
  // Two connections hold their threads, each with a request on the way.
  RawClient a(server.port()), b(server.port());
  ASSERT_TRUE(a.Send("GET /1 HTTP/1.1\r\n"));
  ASSERT_TRUE(b.Send("GET /2 HTTP/1.1\r\n"));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // both taken by the server
  RawClient c(server.port());
  ASSERT_TRUE(c.connected());
  c.Send("GET /3 HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string refused = c.ReadUntilClosed(10);
  EXPECT_TRUE(c.closed());
  EXPECT_TRUE(absl::StartsWith(refused, "HTTP/1.1 503")) << refused;
  EXPECT_TRUE(absl::StrContains(refused, "too_many_connections")) << refused;
  EXPECT_TRUE(absl::StrContains(refused, "at most 2 connections at once from one address (127.0.0.1")) << refused;
  // One of the two finishes its request and closes: a new connection is served.
  ASSERT_TRUE(a.Send("Host: x\r\nConnection: close\r\n\r\n"));
  EXPECT_TRUE(absl::StrContains(a.ReadUntilClosed(10), "answer 1"));
  bool served = false;
  for (int attempt = 0; attempt < 50 && !served; ++attempt) {  // the server may not have counted the close yet
    RawClient d(server.port());
    d.Send("GET /4 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    served = absl::StrContains(d.ReadUntilClosed(10), "answer 4");
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(served);
}

TEST(HttpConnectionTest, AnIdleConnectionClosesWhenConnectionsAreCrowded) {
  std::atomic<bool> crowded{false};
  ConnectionPolicy policy = Quick();
  policy.idle_timeout = absl::Seconds(60);
  policy.crowded = [&crowded] { return crowded.load(); };
  Server server(policy);
  RawClient c(server.port());
  ASSERT_TRUE(c.Send("GET /1 HTTP/1.1\r\nHost: x\r\n\r\n"));
  ASSERT_EQ(c.ReadUntilContains("answer 1", 10).find("HTTP/1.1 200"), 0u);
  c.ReadUntilClosed(6);  // past httplib's own 5 s keep-alive
  ASSERT_FALSE(c.closed()) << "kept alive while nobody waits (for the policy's 60 s)";
  crowded = true;
  const auto start = Clock::now();
  c.ReadUntilClosed(10);
  EXPECT_TRUE(c.closed());
  EXPECT_LT(SecondsSince(start), 5) << "the idle timeout is 60 s";
}

TEST(HttpConnectionTest, AHurriedConnectionServesOneRequestWithTheShortDeadline) {
  ConnectionPolicy policy = Quick();
  policy.head_deadline = absl::Seconds(30);
  policy.hurried = [] { return true; };
  Server server(policy);
  RawClient c(server.port());
  ASSERT_TRUE(c.Send("GET /1 HTTP/1.1\r\nHost: x\r\n\r\nGET /2 HTTP/1.1\r\nHost: x\r\n\r\n"));
  const std::string got = c.ReadUntilClosed(10);
  EXPECT_TRUE(c.closed());
  EXPECT_EQ(c.Count("HTTP/1.1 200"), 1) << got;
  EXPECT_TRUE(absl::StrContains(got, "Connection: close")) << got;

  RawClient slow(server.port());
  ASSERT_TRUE(slow.Send("GET /1 HTTP/1.1\r\n"));
  const auto start = Clock::now();
  const std::string cut = slow.ReadUntilClosed(20);
  // Its request line came whole, its headers not: httplib answers that 400 (the OpenAI API's error
  // handler makes it 408, RequestTimeoutOnThisThread), and the connection closes.
  EXPECT_TRUE(slow.closed());
  EXPECT_TRUE(absl::StartsWith(cut, "HTTP/1.1 400")) << cut;
  EXPECT_LT(SecondsSince(start), 10) << "hurried: 0.5 s, not the 30 s head deadline";
}

// Over HTTPS: the handshake and then the same loop (pipelined requests answered in order; httplib's
// own TLS loop kept them too, in the SSL object's buffer: this checks the loop's TLS path).
TEST(HttpConnectionTest, PipelinedRequestsOverHttps) {
  char pattern[] = "/tmp/http_connection_test.XXXXXX";
  const std::filesystem::path dir = mkdtemp(pattern);
  const PemKeyPair ca = MakeTestCertificate("test CA", nullptr, true);
  const PemKeyPair leaf = MakeTestCertificate("localhost", &ca, false);
  ASSERT_TRUE(WriteFileAtomically((dir / "c.pem").string(), leaf.cert, 0600).ok());
  ASSERT_TRUE(WriteFileAtomically((dir / "c.key").string(), leaf.key, 0600).ok());
  {
    Server server(Quick(), TlsFiles{(dir / "c.pem").string(), (dir / "c.key").string(), ""});
    SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
    SSL* ssl = SSL_new(ctx);
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server.port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    const timeval bound{10, 0};  // a server that keeps the connection open fails the test, not hangs it
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound);
    SSL_set_fd(ssl, fd);
    ASSERT_EQ(SSL_connect(ssl), 1);
    const std::string two = "GET /1 HTTP/1.1\r\nHost: x\r\n\r\nGET /2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    ASSERT_EQ(SSL_write(ssl, two.data(), static_cast<int>(two.size())), static_cast<int>(two.size()));
    std::string got;
    char buf[4096];
    for (int n; (n = SSL_read(ssl, buf, sizeof buf)) > 0;) got.append(buf, static_cast<size_t>(n));
    SSL_free(ssl);
    SSL_CTX_free(ctx);
    ::close(fd);
    const size_t one = got.find("answer 1"), second = got.find("answer 2");
    ASSERT_NE(one, std::string::npos) << got;
    ASSERT_NE(second, std::string::npos) << got;
    EXPECT_LT(one, second);
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace shardserve
