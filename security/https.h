// The HTTP ports' server (the OpenAI HTTP API, /metrics): cpp-httplib, plain HTTP or HTTPS.
//
// With a certificate (--tls-cert/--tls-key) it is an httplib::SSLServer whose SSL_CTX takes its
// certificate from a CertificateReloader at every handshake (SSL_CTX_set_cert_cb): the files are
// re-read when they change, as the gRPC ports' FileWatcher provider does, so replacing them
// rotates the certificate without a restart; new handshakes get the new one. Clients are not asked
// for a certificate (the OpenAI API authenticates by key; /metrics holds counters only).
//
// Thread-safety: MakeHttpServer is reentrant; CertificateReloader's methods are thread-safe.
#ifndef SHARDSERVE_SECURITY_HTTPS_H_
#define SHARDSERVE_SECURITY_HTTPS_H_

#include <memory>
#include <string>

#include <openssl/ssl.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "security/http_connection.h"
#include "security/tls.h"

namespace shardserve {

// A certificate chain and key read from two files and re-read when either file changes (inode,
// size or modification time, looked at most once per `interval`). A re-read that fails (a file
// half-written, a key that is not the certificate's yet because only one file was replaced, an
// expired certificate) keeps the previous pair and is retried at the next look; last_error() says
// why.
class CertificateReloader {
 public:
  // Reads the files now: InvalidArgument naming the file (as CheckTlsFiles) when they are unusable.
  static absl::StatusOr<std::unique_ptr<CertificateReloader>> Create(
      const std::string& cert_path, const std::string& key_path,
      absl::Duration interval = absl::Seconds(kCertificateRefreshSeconds));
  ~CertificateReloader();

  // Sets the current certificate, chain and key on a connection (re-reading first when due).
  // False (OpenSSL refused them) fails that handshake.
  bool Apply(SSL* ssl);
  // The error of the last failed re-read (OK when the last one succeeded).
  absl::Status last_error() const;

 private:
  struct Pair;
  struct FileIds;
  CertificateReloader(std::string cert_path, std::string key_path, absl::Duration interval);
  static absl::StatusOr<std::shared_ptr<const Pair>> ReadPair(const std::string& cert_path,
                                                              const std::string& key_path);
  // Re-reads when a file changed; under mu_.
  void MaybeReload() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const std::string cert_path_;
  const std::string key_path_;
  const absl::Duration interval_;

  mutable absl::Mutex mu_;
  std::shared_ptr<const Pair> current_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<FileIds> files_ ABSL_GUARDED_BY(mu_);
  absl::Time last_look_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);
};

// An httplib server: HTTPS from files.cert/files.key, re-read as above (files.ca is not used:
// clients are not asked for certificates), or plain HTTP when files has no certificate.
// InvalidArgument naming the file when the certificate or key cannot be used. TCP_NODELAY is set
// (small SSE chunks and scrapes would otherwise wait for delayed ACKs), and ListenSocketOptions.
// Its connections are served as `policy` says (http_connection.h: request deadlines, pipelining, a
// cap per address), which replaces httplib's own keep-alive, read and write timeouts: their setters
// have no effect on this server. The caller adds routes, binds and listens.
absl::StatusOr<std::unique_ptr<httplib::Server>> MakeHttpServer(const TlsFiles& files,
                                                               const ConnectionPolicy& policy = {});

// The HTTP ports' socket options: SO_REUSEADDR (a restarted server binds while its predecessor's
// connections linger in TIME_WAIT) and not httplib's default SO_REUSEPORT, under which a second
// server (another coordinator, or this one's gRPC port, which gRPC's own default would share too)
// binds the same port and silently takes a share of its connections: that bind must fail instead,
// saying the port is in use. The gRPC servers turn SO_REUSEPORT off likewise (GRPC_ARG_ALLOW_REUSEPORT).
void ListenSocketOptions(int sock);

}  // namespace shardserve

#endif  // SHARDSERVE_SECURITY_HTTPS_H_
