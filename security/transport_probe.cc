#include "security/transport_probe.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <array>
#include <memory>

#include <openssl/err.h>
#include <openssl/ssl.h>

#include "absl/strings/match.h"

namespace shardserve {
namespace {

// A connected TCP socket to `host_port` whose sends, receives (and connect) give up after
// `timeout`; -1 when none.
int Dial(const std::string& host_port, absl::Duration timeout) {
  if (absl::StrContains(host_port, "://")) return -1;
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) return -1;
  std::string host = host_port.substr(0, colon);
  const std::string port = host_port.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0) return -1;
  const timeval tv = absl::ToTimeval(timeout);
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0 || connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  return fd;
}

struct Closer {
  void operator()(const int* fd) const { close(*fd); }
};

bool SpeaksTls(const std::string& host_port, absl::Duration timeout) {
  int fd = Dial(host_port, timeout);
  if (fd < 0) return false;
  const std::unique_ptr<int, Closer> closer(&fd);
  const std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()), SSL_CTX_free);
  if (ctx == nullptr) return false;
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_NONE, nullptr);  // only whether it speaks TLS
  const std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), SSL_free);
  if (ssl == nullptr || SSL_set_fd(ssl.get(), fd) != 1) return false;
  SSL_set_alpn_protos(ssl.get(), reinterpret_cast<const unsigned char*>("\x02h2"), 3);  // as gRPC offers
  const int r = SSL_connect(ssl.get());
  // A server that wants a client certificate may end the handshake; its own certificate came first.
  const bool tls = r == 1 || SSL_get0_peer_certificate(ssl.get()) != nullptr;
  if (r == 1) SSL_shutdown(ssl.get());
  ERR_clear_error();
  return tls;
}

bool SpeaksPlaintextHttp2(const std::string& host_port, absl::Duration timeout) {
  int fd = Dial(host_port, timeout);
  if (fd < 0) return false;
  const std::unique_ptr<int, Closer> closer(&fd);
  // The client connection preface, then an empty SETTINGS frame (length 0, type 4, no flags, stream 0).
  static constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
  if (send(fd, kPreface, sizeof kPreface - 1, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof kPreface - 1)) return false;
  // The server's first frame must be SETTINGS on stream 0: a 9-byte header, type at byte 3.
  std::array<unsigned char, 9> header{};
  for (size_t got = 0; got < header.size();) {
    const ssize_t n = recv(fd, header.data() + got, header.size() - got, 0);
    if (n <= 0) return false;
    got += static_cast<size_t>(n);
  }
  return header[3] == 0x04 && (header[5] & 0x7f) == 0 && header[6] == 0 && header[7] == 0 && header[8] == 0;
}

}  // namespace

PortSpeaks ProbePort(const std::string& host_port, absl::Duration timeout) {
  if (SpeaksTls(host_port, timeout)) return PortSpeaks::kTls;
  if (SpeaksPlaintextHttp2(host_port, timeout)) return PortSpeaks::kPlaintext;
  return PortSpeaks::kUnknown;
}

}  // namespace shardserve
