#include "security/http_connection.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

// Set while a request's deadline has passed, for the error handler on the same thread.
thread_local std::string t_timeout_reason;

// How often a wait looks at give_up() (the server stopping, connections waiting for a thread).
constexpr absl::Duration kWaitSlice = absl::Milliseconds(100);
// How long a connection closed with its request perhaps unread drops what the client still sends.
constexpr absl::Duration kLinger = absl::Milliseconds(200);

int PollMillis(absl::Time until) {
  const absl::Duration left = until - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
}

bool IpAndPort(const sockaddr_storage& addr, socklen_t len, std::string& ip, int& port) {
  // As httplib writes them (numeric; PeerWatch matches on these strings).
  if (addr.ss_family == AF_INET) {
    port = ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    port = ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  } else {
    return false;
  }
  std::array<char, NI_MAXHOST> host{};
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host.data(), host.size(), nullptr, 0,
                  NI_NUMERICHOST) != 0) {
    return false;
  }
  ip = host.data();
  return true;
}

// The TLS handshake, bounded by `until` (a client that sends its hello a byte a second is cut off).
struct SslFree {
  void operator()(SSL* ssl) const { SSL_free(ssl); }
};
std::unique_ptr<SSL, SslFree> Handshake(int fd, SSL_CTX* ctx, absl::Time until) {
  std::unique_ptr<SSL, SslFree> ssl(SSL_new(ctx));
  if (ssl == nullptr || SSL_set_fd(ssl.get(), fd) != 1) return nullptr;
  const int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) return nullptr;
  bool done = false;
  for (;;) {
    ERR_clear_error();
    const int r = SSL_accept(ssl.get());
    if (r == 1) {
      done = true;
      break;
    }
    const int err = SSL_get_error(ssl.get(), r);
    if (err != SSL_ERROR_WANT_READ && err != SSL_ERROR_WANT_WRITE) break;
    pollfd p{fd, static_cast<short>(err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT), 0};
    const int waited = ::poll(&p, 1, PollMillis(until));
    if (waited <= 0) break;  // late, or poll failed
  }
  if (fcntl(fd, F_SETFL, flags) != 0 || !done) return nullptr;
  return ssl;
}

constexpr char kTooManyConnections[] =
    "HTTP/1.1 503 Service Unavailable\r\n"
    "Content-Type: application/json\r\n"
    "Retry-After: 1\r\n"
    "Connection: close\r\n";

std::string TimeoutMessage(absl::Duration head, absl::Duration body) {
  return absl::StrCat("the request did not arrive in time: its line and headers must arrive within ", absl::FormatDuration(head),
                      " of its first byte, its body within ", absl::FormatDuration(body), " of its headers");
}

// Closes a connection whose request may be unread: the answer first, then what the client still
// sends is read and dropped for up to `linger`, so that the kernel does not reset the connection
// (which can discard the answer before the client reads it) for bytes left unread.
void LingeringClose(int fd, absl::Duration linger) {
  ::shutdown(fd, SHUT_WR);
  const absl::Time until = absl::Now() + linger;
  char sink[4096];
  for (size_t dropped = 0; dropped < (size_t{1} << 16);) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, PollMillis(until)) <= 0) break;
    const ssize_t n = ::recv(fd, sink, sizeof sink, MSG_DONTWAIT);
    if (n <= 0) break;
    dropped += static_cast<size_t>(n);
  }
}

// OpenAI's error body.
std::string JsonError(const std::string& message, const char* type, const char* code) {
  return nlohmann::json{{"error", {{"message", message}, {"type", type}, {"param", nullptr}, {"code", code}}}}.dump();
}

std::string Response(const char* status_and_headers, const std::string& body) {
  return absl::StrCat(status_and_headers, "Content-Length: ", body.size(), "\r\n\r\n", body);
}

}  // namespace

bool PeerCounts::Take(const std::string& peer, int max) {
  absl::MutexLock lock(&mu_);
  int& open = open_[peer];
  if (max > 0 && open >= max) {
    if (open == 0) open_.erase(peer);
    return false;
  }
  ++open;
  return true;
}

void PeerCounts::Release(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(peer);
  if (it == open_.end()) return;
  if (--it->second <= 0) open_.erase(it);
}

ConnectionStream::ConnectionStream(int fd, SSL* ssl, absl::Duration io_timeout)
    : fd_(fd), ssl_(ssl), io_timeout_(io_timeout) {}

void ConnectionStream::StartRequest(absl::Duration head, absl::Duration body) {
  head_deadline_ = head;
  in_head_ = true;
  deadline_ = absl::Now() + head;
  body_deadline_ = body;
  timed_out_ = false;
  t_timeout_reason.clear();
  last4_ = 0;
  response_head_.clear();
  response_head_done_ = false;
  response_closes_ = false;
}

bool ConnectionStream::Wait(short events, absl::Time until) const {
  for (;;) {
    pollfd p{fd_, events, 0};
    const int r = ::poll(&p, 1, PollMillis(until));
    if (r > 0) return true;  // ready, or an error / hang-up the next read or write reports
    if (r == 0) return false;
    if (errno != EINTR) return false;
  }
}

bool ConnectionStream::WaitForRequest(absl::Time until, const std::function<bool()>& give_up) {
  // Between requests no deadline runs (the last request's may have passed while it was answered:
  // a long stream); `until` bounds the wait, StartRequest sets the next request's.
  deadline_ = absl::InfiniteFuture();
  timed_out_ = false;
  if (Buffered()) return true;  // pipelined: the next request was read with the last one
  for (;;) {
    const absl::Time slice = std::min(until, absl::Now() + kWaitSlice);
    if (Wait(POLLIN, slice)) {
      // Readable: a request's first byte, or the peer closed (the read then says so).
      return Fill();
    }
    if (absl::Now() >= until) return false;
    if (give_up && give_up()) return false;
  }
}

bool ConnectionStream::Fill() {
  begin_ = end_ = 0;
  for (;;) {
    const absl::Time now = absl::Now();
    const bool pending = ssl_ != nullptr && SSL_pending(ssl_) > 0;
    if (now >= deadline_ || (!pending && !Wait(POLLIN, std::min(deadline_, now + io_timeout_)))) {
      // Late: past the request's deadline, or no byte for io_timeout (a stalled client).
      timed_out_ = true;
      timeout_message_ = absl::Now() < deadline_ ? absl::StrCat("the request stalled: no byte of it arrived for ",
                                                                absl::FormatDuration(io_timeout_))
                                                 : TimeoutMessage(head_deadline_, body_deadline_);
      return false;
    }
    ssize_t n;
    if (ssl_ != nullptr) {
      ERR_clear_error();
      const int r = SSL_read(ssl_, buf_, static_cast<int>(sizeof buf_));
      if (r <= 0) {
        const int err = SSL_get_error(ssl_, r);
        if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) continue;  // a record not yet whole
        return false;
      }
      n = r;
    } else {
      n = ::recv(fd_, buf_, sizeof buf_, 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n <= 0) return false;
    }
    end_ = static_cast<size_t>(n);
    return true;
  }
}

bool ConnectionStream::is_readable() const {
  if (Buffered()) return true;
  return Wait(POLLIN, std::min(deadline_, absl::Now() + io_timeout_));
}

bool ConnectionStream::is_writable() const { return Wait(POLLOUT, absl::Now() + io_timeout_); }

ssize_t ConnectionStream::read(char* ptr, size_t size) {
  if (size == 0) return 0;
  if (begin_ == end_ && !Fill()) {
    if (timed_out_) t_timeout_reason = timeout_message_;
    return -1;
  }
  const size_t n = std::min(size, end_ - begin_);
  std::memcpy(ptr, buf_ + begin_, n);
  begin_ += n;
  SawRequestBytes(ptr, n);
  return static_cast<ssize_t>(n);
}

void ConnectionStream::SawRequestBytes(const char* p, size_t n) {
  if (!in_head_) return;
  for (size_t i = 0; i < n; ++i) {
    last4_ = (last4_ << 8) | static_cast<unsigned char>(p[i]);
    // httplib ends a head at an empty line: "\r\n\r\n", or "\n\n" from a client that sends bare LFs.
    if (last4_ == 0x0d0a0d0a || (last4_ & 0xffff) == 0x0a0a) {
      in_head_ = false;
      deadline_ = absl::Now() + body_deadline_;
      return;
    }
  }
}

ssize_t ConnectionStream::write(const char* ptr, size_t size) {
  if (!is_writable()) return -1;
  ssize_t n;
  if (ssl_ != nullptr) {
    ERR_clear_error();
    const int r = SSL_write(ssl_, ptr, static_cast<int>(std::min<size_t>(size, 1 << 30)));
    if (r <= 0) return -1;
    n = r;
  } else {
    do {
      n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return -1;
  }
  SawResponseBytes(ptr, static_cast<size_t>(n));
  return n;
}

void ConnectionStream::SawResponseBytes(const char* p, size_t n) {
  if (response_head_done_) return;
  response_head_.append(p, std::min<size_t>(n, 65536 - std::min<size_t>(response_head_.size(), 65536)));
  const size_t end = response_head_.find("\r\n\r\n");
  if (end == std::string::npos && response_head_.size() < 65536) return;
  response_head_done_ = true;
  const std::string head = absl::AsciiStrToLower(response_head_.substr(0, end));
  response_closes_ = absl::StrContains(head, "\r\nconnection: close\r\n") ||
                     absl::EndsWith(head, "\r\nconnection: close");
}

bool ConnectionStream::WriteAll(const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = write(data.data() + off, data.size() - off);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

void ConnectionStream::get_remote_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (getpeername(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) IpAndPort(addr, len, ip, port);
}

void ConnectionStream::get_local_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) IpAndPort(addr, len, ip, port);
}

std::string RequestTimeoutOnThisThread() { return t_timeout_reason; }

bool ServeConnection(int fd, SSL_CTX* ctx, const ConnectionPolicy& policy, PeerCounts& peers,
                     const std::function<bool()>& stopping, const ProcessRequest& process) {
  const bool hurried = policy.hurried && policy.hurried();
  const absl::Duration head = hurried ? std::min(policy.hurried_head_deadline, policy.head_deadline) : policy.head_deadline;
  bool served = false;
  std::unique_ptr<SSL, SslFree> ssl;
  if (ctx != nullptr) ssl = Handshake(fd, ctx, absl::Now() + head);
  if (ctx == nullptr || ssl != nullptr) {
    ConnectionStream stream(fd, ssl.get(), policy.io_timeout);
    std::string peer;
    int port = 0;
    stream.get_remote_ip_and_port(peer, port);
    const bool counted = peers.Take(peer, policy.max_per_peer);
    absl::Duration linger = absl::ZeroDuration();  // after an answer that may leave bytes unread
    if (!counted) {
      // Not read: answered at once, so that one address cannot hold the threads.
      stream.StartRequest(head, policy.body_deadline);
      stream.WriteAll(Response(
          kTooManyConnections,
          JsonError(absl::StrCat("this server serves at most ", policy.max_per_peer,
                                 " connections at once from one address (", peer,
                                 "; --http-max-connections-per-peer): close one, or retry shortly"),
                    "service_unavailable_error", "too_many_connections")));
      // What has arrived is dropped, no more awaited: a client past the cap holds no thread.
      linger = absl::Milliseconds(1);
    } else {
      const int max_requests = hurried ? 1 : std::max(1, policy.max_requests);
      for (int i = 0; i < max_requests && !stopping(); ++i) {
        // Idle between requests: given up when the server stops, and, after the first request, when
        // connections wait for this thread.
        const bool first = i == 0;
        auto give_up = [&] { return stopping() || (!first && policy.crowded && policy.crowded()); };
        if (!stream.WaitForRequest(absl::Now() + policy.idle_timeout, give_up)) break;
        stream.StartRequest(head, policy.body_deadline);
        bool closed = false;
        served = process(stream, /*close_connection=*/i + 1 == max_requests, closed);
        if (stream.timed_out()) {
          t_timeout_reason.clear();
          // httplib answers a head cut short 400 (its error handler says 408 and why); one cut off
          // before its first line ends, not at all: 408 here.
          if (!stream.responded()) {
            stream.WriteAll(Response("HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n",
                                     JsonError(stream.timeout_message(), "invalid_request_error", "request_timeout")));
          }
          linger = kLinger;
          break;
        }
        if (!served || closed || stream.response_closes()) {
          if (stream.response_closes()) linger = kLinger;  // perhaps answered before its body was read
          break;
        }
      }
    }
    if (counted) peers.Release(peer);
    if (ssl != nullptr) SSL_shutdown(ssl.get());  // close_notify, not waiting for the peer's
    if (linger > absl::ZeroDuration()) LingeringClose(fd, linger);
  }
  ::shutdown(fd, SHUT_RDWR);
  ::close(fd);
  return served;
}

}  // namespace shardserve
