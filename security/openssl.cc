#include "security/openssl.h"

#include <fstream>
#include <sstream>

#include <openssl/err.h>
#include <openssl/pem.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardserve::openssl {

std::string LastError(const char* if_none) {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return if_none;
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, ": cannot read the file"));
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

namespace {

std::string NotAfter(X509* c) {
  Bio out(BIO_new(BIO_s_mem()));
  ASN1_TIME_print(out.get(), X509_get0_notAfter(c));
  char* data = nullptr;
  const long n = BIO_get_mem_data(out.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

}  // namespace

absl::StatusOr<std::vector<Cert>> ReadCertificates(const std::string& path, const char* flag) {
  SHARDSERVE_ASSIGN_OR_RETURN(const std::string pem, ReadFile(path, flag));
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  std::vector<Cert> certs;
  while (X509* c = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) certs.emplace_back(c);
  ERR_clear_error();  // the end of the file reads as an error
  if (certs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, ": no PEM certificate in the file"));
  }
  for (const Cert& c : certs) {
    char subject[256];
    X509_NAME_oneline(X509_get_subject_name(c.get()), subject, sizeof(subject));
    if (X509_cmp_current_time(X509_get0_notAfter(c.get())) <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, ": the certificate ", subject,
                                                     " has expired (notAfter ", NotAfter(c.get()), ")"));
    }
    if (X509_cmp_current_time(X509_get0_notBefore(c.get())) >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " ", path, ": the certificate ", subject, " is not valid yet"));
    }
  }
  return certs;
}

absl::StatusOr<Identity> ReadIdentity(const std::string& cert_path, const std::string& key_path) {
  Identity id;
  SHARDSERVE_ASSIGN_OR_RETURN(id.chain, ReadCertificates(cert_path, "tls-cert"));
  SHARDSERVE_ASSIGN_OR_RETURN(const std::string key_pem, ReadFile(key_path, "tls-key"));
  Bio bio(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())));
  id.key.reset(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (id.key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--tls-key ", key_path,
                                                   ": not a PEM private key (or one with a passphrase): ",
                                                   LastError("no PEM data")));
  }
  if (X509_check_private_key(id.chain.front().get(), id.key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key ", key_path, " is not the key of the certificate in --tls-cert ", cert_path));
  }
  return id;
}

}  // namespace shardserve::openssl
