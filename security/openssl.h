// The OpenSSL handles security/ holds, as owning smart pointers, and OpenSSL's error queue as a
// message. Internal to security/ (the rest of the project sees only its own types); no state.
#pragma once

#include <memory>
#include <string>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/x509.h>

namespace shardserve::openssl {

template <typename T, void (*F)(T*)>
struct Deleter {
  void operator()(T* p) const { F(p); }
};
using PKey = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using Cert = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using Bio = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;

// The last error OpenSSL queued, for messages ("error:1E08010C:DECODER routines::unsupported"),
// or `if_none` when the queue is empty; clears the queue.
inline std::string LastError(const char* if_none) {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return if_none;
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

}  // namespace shardserve::openssl
