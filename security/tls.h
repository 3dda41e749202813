// TLS and mutual TLS for every gRPC port, from the flags every binary takes:
//   --tls-cert FILE  this process's certificate (PEM; a chain, leaf first)
//   --tls-key FILE   its private key (PEM)
//   --tls-ca FILE    the CA certificates (PEM) peers' certificates must chain to: on a server, the
//                    CA of the client certificates it verifies (mutual TLS); on a client, the CA of
//                    the server's certificate (default: the system's roots)
//
// Servers use gRPC's TlsServerCredentials with a FileWatcherCertificateProvider, which re-reads
// the three files every kCertificateRefreshSeconds: replacing them (write each to a temporary file
// and rename it over the old one, key first) rotates the certificate without a restart; new
// connections get the new one. The CA file too: a bundle of the old and a new CA takes peers of
// either, the new CA alone then refuses the old one's (docs/security.md). Clients read the files once, at start (a client command is short;
// a worker reads them again when it reconnects).
//
// Before either is built, CheckTlsFiles reads the files with OpenSSL and refuses an unreadable,
// expired or not-yet-valid certificate, a key that is not the certificate's, and a certificate
// that does not chain to --tls-ca, each with a message naming the file: gRPC itself would only
// fail the handshakes later, quietly.
//
// Thread-safety: free functions, reentrant.
#ifndef SHARDSERVE_SECURITY_TLS_H_
#define SHARDSERVE_SECURITY_TLS_H_

#include <functional>
#include <memory>
#include <set>
#include <string>

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/flags.h"

namespace shardserve {

// How often a server re-reads its certificate files.
inline constexpr unsigned kCertificateRefreshSeconds = 2;

struct TlsFiles {
  std::string cert;  // --tls-cert
  std::string key;   // --tls-key
  std::string ca;    // --tls-ca
  // A certificate of our own (then a key too): a server speaks TLS, a client presents it.
  bool has_identity() const { return !cert.empty(); }
  // Anything given: a client speaks TLS.
  bool any() const { return !cert.empty() || !ca.empty(); }
};

// The flags TlsFilesFromFlags reads, for Flags::Parse.
inline const std::set<std::string>& TlsFlagNames() {
  static const std::set<std::string> names = {"tls-cert", "tls-key", "tls-ca"};
  return names;
}
// --tls-cert and --tls-key go together (InvalidArgument naming the one missing).
absl::StatusOr<TlsFiles> TlsFilesFromFlags(const Flags& flags);

// Reads the files with OpenSSL: the certificate parses and is valid now, the key parses and is the
// certificate's, and (when both are given) the certificate chains to the CA; the CA file holds at
// least one certificate, valid now. InvalidArgument naming the file and what is wrong.
absl::Status CheckTlsFiles(const TlsFiles& files);

// Whom a server's port accepts.
enum class PeerCertificates {
  kNotAsked,  // plain TLS: clients are not asked for a certificate
  // Asked; a client may present none, but one it presents must chain to the CA (else the
  // handshake fails). The handlers of internal services then call PeerHasVerifiedCertificate.
  // The coordinator's port: its client API takes clients without certificates.
  kVerifyIfGiven,
  kRequired,  // mutual TLS: no certificate from the CA, no connection (the workers' ports)
};

// Insecure credentials when `files` has no certificate (and no CA: a CA alone is an error, it
// would verify nothing). With a CA, peers are asked as `peers` says; without one, kNotAsked.
// Runs CheckTlsFiles first.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsFiles& files,
                                                                               PeerCertificates peers);
// Insecure credentials when `files` is empty; else TLS verifying the server's certificate (and
// its name against the address dialled) with the CA (or the system's roots), presenting our
// certificate when given. Runs CheckTlsFiles first.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsFiles& files);

// True when the call came over TLS and the peer presented a certificate that was verified against
// the server's CA. Safe to call from any handler.
bool PeerHasVerifiedCertificate(const grpc::ServerContext& context);

// For a process whose gRPC TLS is server-side only (the coordinator: it dials nobody over gRPC).
// gRPC reports a failed handshake on its own log only, in OpenSSL's words; from this call on two
// such lines are handed to `log` as one message of ours instead:
//   "wrong version number", "http request": "TLS mismatch: a peer spoke plaintext to this TLS port
//   ..." (a worker without --tls-cert);
//   "certificate verify failed": "refused a peer's certificate: it does not verify against --tls-ca
//   ..." (another CA's, expired, or not valid yet: OpenSSL does not say which on this side).
// gRPC's other lines are written to stderr as before. gRPC does not say which peer it was. Call
// once, at start, before gRPC's threads log; `log` must be thread-safe.
void ReportTlsRefusals(std::function<void(absl::string_view message)> log);

// "127.0.0.1:50051", "localhost:0", "[::1]:8080": true; "0.0.0.0:50051", "10.0.0.5:1": false.
bool IsLoopbackAddress(const std::string& host_port);

// A server listening on `listen` without TLS needs --insecure unless the address is loopback:
// FailedPrecondition naming the flags otherwise.
absl::Status CheckPlaintextListen(const std::string& listen, bool tls, bool insecure);

// /metrics (--metrics-listen) in plain HTTP (`https` false: no certificate, or --metrics-plaintext)
// beyond loopback needs --insecure: FailedPrecondition naming the flags otherwise.
absl::Status CheckMetricsListen(const std::string& listen, bool https, bool insecure);

// A host alone (no port): "127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]": true; "0.0.0.0",
// "::", "10.0.0.5", "" (every interface), a name: false.
bool IsLoopbackHost(const std::string& host);

// The OpenAI HTTP API (--http-host) beyond loopback needs both TLS (`tls`: it serves HTTPS) and API
// keys (`api_keys`), or --insecure: FailedPrecondition naming the flags otherwise. Loopback is
// always allowed, in plain HTTP and without keys.
absl::Status CheckHttpListen(const std::string& host, bool tls, bool api_keys, bool insecure);

}  // namespace shardserve

#endif  // SHARDSERVE_SECURITY_TLS_H_
