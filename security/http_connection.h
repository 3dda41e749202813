// How the HTTP ports (the OpenAI API, /metrics) serve one connection, in place of cpp-httplib
// 0.11's own loop (Debian bookworm's), whose defects let one client starve the server or lose
// requests:
// - A request's head had no deadline (httplib's timeout is per read), so a client sending a header
//   byte a second held a thread for as long as it liked. Here the request line and headers must
//   arrive within head_deadline of the request's first byte, and the body within body_deadline
//   of the head's end; past it the request is answered 408 and the connection closed.
// - Each request read through a new stream, which dropped the bytes it had read ahead: of several
//   requests sent in one write (HTTP/1.1 pipelining) only the first was answered. Here one buffer
//   lives as long as the connection, and requests are answered in order.
// - Any number of connections from one address. Here at most max_per_peer at once; the next is
//   answered 503 (code too_many_connections) without reading it, and closed.
// - An idle keep-alive connection held its thread for the whole keep-alive time while new
//   connections waited. Here it is closed as soon as crowded() says connections want a thread.
// A connection for which hurried() is true (the OpenAI API's ConnectionPool: it found every
// serving thread taken) gets hurried_head_deadline and one request, then is closed: it can answer
// /health, or say 503, without being held by a slow client.
//
// The loop runs on the task queue's thread that httplib gave the accepted socket; it owns the
// socket (and, with TLS, the SSL object) and closes both. It calls httplib's own request parser and
// router (Server::process_request) on a ConnectionStream.
//
// Threading: PeerCounts is thread-safe; a ConnectionStream is used by one thread.
#ifndef SHARDSERVE_SECURITY_HTTP_CONNECTION_H_
#define SHARDSERVE_SECURITY_HTTP_CONNECTION_H_

#include <httplib.h>
#include <openssl/ssl.h>

#include <atomic>
#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardserve {

struct ConnectionPolicy {
  // A request's line and headers, from its first byte; its body, from the end of its head. A
  // request of the API's largest body (8 MiB) needs 1.1 Mbit/s to arrive within 60 s.
  absl::Duration head_deadline = absl::Seconds(10);
  absl::Duration body_deadline = absl::Seconds(60);
  // Waiting for the next request on a kept-alive connection (and for the first one).
  absl::Duration idle_timeout = absl::Seconds(5);
  // Requests on one connection before it is closed ("Connection: close" on the last).
  int max_requests = 100;
  // Time a read or write may wait for the socket before the connection is given up.
  absl::Duration io_timeout = absl::Seconds(5);
  // Connections open at once from one address (0: any number).
  int max_per_peer = 0;
  // Hurried connections: the head within this, one request, then closed.
  absl::Duration hurried_head_deadline = absl::Seconds(1);
  // Called on the connection's thread; null: never hurried.
  std::function<bool()> hurried;
  // True while connections wait for a thread; null: never. Idle connections then close.
  std::function<bool()> crowded;
};

// Connections open at once per peer address.
class PeerCounts {
 public:
  // Counts a connection from `peer`: false (not counted) when `max` are open already (max 0: no cap).
  bool Take(const std::string& peer, int max);
  void Release(const std::string& peer);

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, int> open_ ABSL_GUARDED_BY(mu_);
};

// httplib's Stream over a socket (and an SSL object with TLS), with one read-ahead buffer for the
// connection's life and the request deadlines above.
class ConnectionStream : public httplib::Stream {
 public:
  // Borrows fd and ssl (null: plain), which must outlive the stream.
  ConnectionStream(int fd, SSL* ssl, absl::Duration io_timeout);

  // A new request whose first byte is here: its head must be read by now + head, its body within
  // `body` after that.
  void StartRequest(absl::Duration head, absl::Duration body);
  // Waits until the next request's first byte is here (true), or the peer closed, `until` passed
  // or give_up() said so (checked every 100 ms) (false).
  bool WaitForRequest(absl::Time until, const std::function<bool()>& give_up);
  // A read failed because the request's deadline passed, or it stalled; and what it is told.
  bool timed_out() const { return timed_out_; }
  const std::string& timeout_message() const { return timeout_message_; }
  // The request's response says "Connection: close".
  bool response_closes() const { return response_closes_; }
  // Bytes of a response written for the request.
  bool responded() const { return !response_head_.empty() || response_head_done_; }
  // Writes all of `data` (false when the peer is gone or does not read).
  bool WriteAll(const std::string& data);

  // ---- httplib::Stream ----
  bool is_readable() const override;
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  socket_t socket() const override { return fd_; }

 private:
  // Reads more into the buffer, waiting at most until the deadline. False: closed, error, or late.
  bool Fill();
  // Waits for the socket (POLLIN or POLLOUT) until `until`.
  bool Wait(short events, absl::Time until) const;
  bool Buffered() const { return begin_ < end_ || (ssl_ != nullptr && SSL_pending(ssl_) > 0); }
  // Watches the bytes handed to httplib for the head's end, and a response's head for "Connection: close".
  void SawRequestBytes(const char* p, size_t n);
  void SawResponseBytes(const char* p, size_t n);

  // Constant after construction.
  const int fd_;
  SSL* const ssl_;
  const absl::Duration io_timeout_;

  char buf_[16384];
  size_t begin_ = 0, end_ = 0;  // unread bytes: buf_[begin_, end_)
  bool in_head_ = true;         // the request's head is still being read
  absl::Duration head_deadline_ = absl::ZeroDuration();
  absl::Duration body_deadline_ = absl::ZeroDuration();
  absl::Time deadline_ = absl::InfiniteFuture();
  std::string timeout_message_;  // what a request past its deadline is told, once it is
  bool timed_out_ = false;
  uint32_t last4_ = 0;  // the last four bytes of the request (the head ends at "\r\n\r\n")
  std::string response_head_;  // the response's head while it is written
  bool response_head_done_ = false;
  bool response_closes_ = false;
};

// Serves the accepted socket `fd` until the connection ends, then closes it: a TLS handshake first
// when ctx is not null; `process` is httplib's Server::process_request on the stream;
// `stopping` true once the server stops. Returns whether the last request was served.
using ProcessRequest = std::function<bool(httplib::Stream& stream, bool close_connection, bool& connection_closed)>;
bool ServeConnection(int fd, SSL_CTX* ctx, const ConnectionPolicy& policy, PeerCounts& peers,
                     const std::function<bool()>& stopping, const ProcessRequest& process);

// On a connection's thread: the request being answered is one whose head or body did not arrive
// by its deadline (httplib then answers 400: its error handler should say 408 and why). Empty otherwise.
std::string RequestTimeoutOnThisThread();

}  // namespace shardserve

#endif  // SHARDSERVE_SECURITY_HTTP_CONNECTION_H_
