// The OpenAI HTTP server's connection plumbing (coordinator/api/openai/connection_pool.h, peer_watch.h),
// with a real cpp-httplib server and real sockets on 127.0.0.1:
// - ConnectionPool: with its serving threads all held by requests, the next connection is served
//   on an overflow thread (OnOverflowThread() true in its handler, where HttpServer answers 503)
//   instead of waiting in a queue; once the held connections close, a new one is served normally.
// - PeerWatch: finds a handler's own connection from the request's addresses, and says whether the
//   client is still there: open (also with unread bytes), closed, or half-closed.
// Every wait is bounded (kDeadline), so a broken pool fails instead of hanging.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "coordinator/api/openai/connection_pool.h"
#include "coordinator/api/openai/peer_watch.h"
#include "gtest/gtest.h"

namespace shardserve::openai {
namespace {

// Generous: the machine running the tests may be loaded.
constexpr auto kDeadline = std::chrono::seconds(60);

template <typename Pred>
bool WaitFor(Pred pred) {
  const auto until = std::chrono::steady_clock::now() + kDeadline;
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

// An httplib server on a free loopback port with a ConnectionPool of `threads` serving threads and
// one overflow thread. GET /hold blocks until Release(); GET /where answers "overflow" or "serving",
// and whether PeerWatch found the request's own connection ("+watch").
class Server {
 public:
  explicit Server(int threads) {
    http_.new_task_queue = [threads] { return new ConnectionPool(threads, 1); };
    http_.Get("/hold", [this](const httplib::Request&, httplib::Response& res) {
      ++held_;
      release_.WaitForNotificationWithTimeout(absl::Seconds(120));
      res.set_content("released", "text/plain");
    });
    http_.Get("/where", [](const httplib::Request& req, httplib::Response& res) {
      std::string where = ConnectionPool::OnOverflowThread() ? "overflow" : "serving";
      if (PeerWatch::Find(req.local_addr, req.local_port, req.remote_addr, req.remote_port).has_value()) {
        where += "+watch";
      }
      res.set_content(where, "text/plain");
    });
    port_ = http_.bind_to_any_port("127.0.0.1");
    listener_ = std::thread([this] { http_.listen_after_bind(); });
  }
  ~Server() {
    Release();
    http_.stop();
    listener_.join();
  }
  int port() const { return port_; }
  int held() const { return held_.load(); }
  void Release() {
    if (!release_.HasBeenNotified()) release_.Notify();
  }
  // GET /where on a connection of its own (closed after).
  std::string Where() {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(std::chrono::seconds(60));
    httplib::Result r = c.Get("/where");
    return r ? r->body : std::string("error: ") + httplib::to_string(r.error());
  }

 private:
  httplib::Server http_;
  int port_ = 0;
  std::thread listener_;
  std::atomic<int> held_{0};
  absl::Notification release_;
};

TEST(ConnectionPoolTest, ServesOnServingThreadsWhileAnyIsFree) {
  Server server(2);
  ASSERT_GT(server.port(), 0);
  EXPECT_EQ(server.Where(), "serving+watch");
  EXPECT_EQ(server.Where(), "serving+watch");  // the first connection's thread was given back
}

TEST(ConnectionPoolTest, FullPoolSendsTheNextConnectionToAnOverflowThread) {
  Server server(2);
  ASSERT_GT(server.port(), 0);
  // Two connections hold both serving threads.
  std::vector<std::thread> holders;
  std::atomic<int> released{0};
  for (int i = 0; i < 2; ++i) {
    holders.emplace_back([&] {
      httplib::Client c("127.0.0.1", server.port());
      c.set_read_timeout(std::chrono::seconds(120));
      httplib::Result r = c.Get("/hold");
      if (r && r->body == "released") ++released;
    });  // the client, and its connection, end with the thread
  }
  ASSERT_TRUE(WaitFor([&] { return server.held() == 2; })) << "the two holding requests never started";
  // A third connection: answered at once, on the overflow thread.
  EXPECT_EQ(server.Where(), "overflow+watch");
  EXPECT_EQ(server.Where(), "overflow+watch");
  server.Release();
  for (std::thread& t : holders) t.join();
  EXPECT_EQ(released.load(), 2);
  // The holders' connections are closed: their threads serve again.
  EXPECT_TRUE(WaitFor([&] { return server.Where() == "serving+watch"; }));
}

// A connected pair on loopback: the client's socket and the server's accepted one.
struct Pair {
  int listener = -1, client = -1, server = -1;
  int server_port = 0, client_port = 0;
  ~Pair() {
    for (int fd : {listener, client, server}) {
      if (fd >= 0) close(fd);
    }
  }
};

std::unique_ptr<Pair> Connect() {
  auto p = std::make_unique<Pair>();
  p->listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(p->listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(p->listener, 4) != 0 ||
      getsockname(p->listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return nullptr;
  }
  p->server_port = ntohs(addr.sin_port);
  p->client = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(p->client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return nullptr;
  p->server = accept(p->listener, nullptr, nullptr);
  sockaddr_in mine{};
  len = sizeof(mine);
  if (p->server < 0 || getsockname(p->client, reinterpret_cast<sockaddr*>(&mine), &len) != 0) return nullptr;
  p->client_port = ntohs(mine.sin_port);
  return p;
}

TEST(PeerWatchTest, FindsTheConnectionAndSeesTheClientClose) {
  std::unique_ptr<Pair> p = Connect();
  ASSERT_NE(p, nullptr) << "cannot connect on loopback";
  std::optional<PeerWatch> watch = PeerWatch::Find("127.0.0.1", p->server_port, "127.0.0.1", p->client_port);
  ASSERT_TRUE(watch.has_value());
  EXPECT_EQ(watch->fd(), p->server);
  EXPECT_FALSE(watch->Closed());
  // Bytes the server has not read yet (a pipelined request) are not a close.
  ASSERT_EQ(write(p->client, "GET", 3), 3);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(watch->Closed());
  close(p->client);
  p->client = -1;
  EXPECT_TRUE(WaitFor([&] { return watch->Closed(); })) << "the client's close was not seen";
}

TEST(PeerWatchTest, AHalfCloseCountsAsGone) {
  std::unique_ptr<Pair> p = Connect();
  ASSERT_NE(p, nullptr);
  std::optional<PeerWatch> watch = PeerWatch::Find("127.0.0.1", p->server_port, "127.0.0.1", p->client_port);
  ASSERT_TRUE(watch.has_value());
  shutdown(p->client, SHUT_WR);
  EXPECT_TRUE(WaitFor([&] { return watch->Closed(); }));
}

TEST(PeerWatchTest, MatchesAllFourAddresses) {
  std::unique_ptr<Pair> p = Connect();
  ASSERT_NE(p, nullptr);
  // The other end of the pair is this process's too: the addresses the other way round find it.
  std::optional<PeerWatch> client = PeerWatch::Find("127.0.0.1", p->client_port, "127.0.0.1", p->server_port);
  ASSERT_TRUE(client.has_value());
  EXPECT_EQ(client->fd(), p->client);
  // Another peer port, another local address, no port: none.
  const int other_port = p->client_port == 65535 ? 1 : p->client_port + 1;
  EXPECT_FALSE(PeerWatch::Find("127.0.0.1", p->server_port, "127.0.0.1", other_port).has_value());
  EXPECT_FALSE(PeerWatch::Find("127.0.0.2", p->server_port, "127.0.0.1", p->client_port).has_value());
  EXPECT_FALSE(PeerWatch::Find("127.0.0.1", -1, "127.0.0.1", p->client_port).has_value());
}

}  // namespace
}  // namespace shardserve::openai
