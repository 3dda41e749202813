// The OpenSSL pieces security/'s files share (tls.cc, certificates.cc, https.cc): owning pointers
// for OpenSSL's objects, the last queued error as text, and reading a PEM certificate chain and its
// private key with the checks every port makes (valid now, key matching). Internal to security/.
//
// Thread-safety: reentrant (OpenSSL 3's error queue is per thread).
#ifndef SHARDSERVE_SECURITY_OPENSSL_H_
#define SHARDSERVE_SECURITY_OPENSSL_H_

#include <memory>
#include <string>
#include <vector>

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/x509.h>

#include "absl/status/statusor.h"

namespace shardserve::openssl {

template <typename T, void (*F)(T*)>
struct Deleter {
  void operator()(T* p) const { F(p); }
};
using PKey = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using Cert = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using Bio = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;

// The last OpenSSL error queued ("error:1E08010C:DECODER routines::unsupported"), or `if_none`;
// clears the queue.
std::string LastError(const char* if_none);

// The file's bytes; InvalidArgument "--FLAG PATH: cannot read the file".
absl::StatusOr<std::string> ReadFile(const std::string& path, const char* flag);

// Every certificate in a PEM file, each valid now: InvalidArgument naming --FLAG, the file and
// what is wrong (no certificate, expired with its notAfter, not valid yet).
absl::StatusOr<std::vector<Cert>> ReadCertificates(const std::string& path, const char* flag);

// A certificate chain (leaf first) and its private key, as --tls-cert and --tls-key give them.
struct Identity {
  std::vector<Cert> chain;
  PKey key;
};
// Reads both files; the key must be the leaf's. InvalidArgument naming the flag and file otherwise.
absl::StatusOr<Identity> ReadIdentity(const std::string& cert_path, const std::string& key_path);

}  // namespace shardserve::openssl

#endif  // SHARDSERVE_SECURITY_OPENSSL_H_
