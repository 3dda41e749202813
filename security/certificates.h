// X.509 certificates made with OpenSSL's library (no shell-out): the throw-away CA and the
// certificates `shardserve launch` gives its local cluster, and the test certificates (another
// CA, an expired one) of tests/tls_test.cc. EC P-256 keys, SHA-256 signatures.
//
// Thread-safety: the functions are reentrant; OpenSSL 3 needs no global set-up.
#ifndef SHARDSERVE_SECURITY_CERTIFICATES_H_
#define SHARDSERVE_SECURITY_CERTIFICATES_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardserve {

// A certificate and its private key, both PEM.
struct PemKeyPair {
  std::string cert;
  std::string key;
};

struct CertificateSpec {
  std::string common_name;
  std::vector<std::string> dns_names;    // subjectAltName DNS entries ("localhost")
  std::vector<std::string> ip_addresses;  // subjectAltName IP entries ("127.0.0.1", "::1")
  bool is_ca = false;                     // basicConstraints CA:TRUE, keyCertSign
  // Valid from now + not_before (negative: in the past) for valid_for. An expired certificate for
  // tests: not_before = -2h, valid_for = 1h.
  absl::Duration not_before = absl::Minutes(-5);  // tolerate small clock skew
  absl::Duration valid_for = absl::Hours(24);
};

// A new EC P-256 key and a certificate for it, signed by `issuer` (its key), or self-signed when
// `issuer` is null. Leaf certificates carry extendedKeyUsage serverAuth and clientAuth, so that
// one certificate serves a process's port and its outgoing connections.
absl::StatusOr<PemKeyPair> MakeCertificate(const CertificateSpec& spec, const PemKeyPair* issuer);

// The files of a local cluster's certificates (LocalClusterCertificates).
struct ClusterCertificateFiles {
  std::string ca;           // ca.pem: the throw-away CA's certificate (its key is not kept)
  std::string server_cert;  // server.pem / server.key: coordinator and workers (127.0.0.1, ::1, localhost)
  std::string server_key;
  std::string client_cert;  // client.pem / client.key: the client commands
  std::string client_key;
};

// Makes a throw-away CA, a server and a client certificate valid for `valid_for`, and writes them
// into `dir` (created 0700 if missing; keys 0600). The CA's key is discarded: nothing else can be
// signed by that CA afterwards.
absl::StatusOr<ClusterCertificateFiles> WriteLocalClusterCertificates(const std::string& dir,
                                                                      absl::Duration valid_for);

// Writes `contents` to `path` through a temporary file and a rename, with permissions `mode`.
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents, unsigned mode);

}  // namespace shardserve

#endif  // SHARDSERVE_SECURITY_CERTIFICATES_H_
