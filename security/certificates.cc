#include "security/certificates.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "security/openssl.h"

namespace shardserve {
namespace {

using openssl::Bio;
using openssl::Cert;
using openssl::PKey;

absl::Status Fail(const std::string& what) { return absl::InternalError(absl::StrCat(what, ": ", openssl::LastError("unknown OpenSSL error"))); }

absl::Status AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr) return Fail(absl::StrCat("certificate extension ", OBJ_nid2sn(nid), "=", value));
  const int ok = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  if (!ok) return Fail("X509_add_ext");
  return absl::OkStatus();
}

absl::StatusOr<std::string> ToPem(int (*write)(BIO*, void*), void* object) {
  Bio bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || !write(bio.get(), object)) return Fail("PEM encoding");
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

int WriteCert(BIO* bio, void* cert) { return PEM_write_bio_X509(bio, static_cast<X509*>(cert)); }
int WriteKey(BIO* bio, void* key) {
  return PEM_write_bio_PrivateKey(bio, static_cast<EVP_PKEY*>(key), nullptr, nullptr, 0, nullptr, nullptr);
}

}  // namespace

absl::StatusOr<PemKeyPair> MakeCertificate(const CertificateSpec& spec, const PemKeyPair* issuer) {
  PKey key(EVP_EC_gen("P-256"));
  if (key == nullptr) return Fail("EC P-256 key generation");
  Cert cert(X509_new());
  if (cert == nullptr) return Fail("X509_new");

  // The issuer's certificate and key, or this certificate and key (self-signed).
  Cert issuer_cert;
  PKey issuer_key;
  if (issuer != nullptr) {
    Bio cert_bio(BIO_new_mem_buf(issuer->cert.data(), static_cast<int>(issuer->cert.size())));
    issuer_cert.reset(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr));
    Bio key_bio(BIO_new_mem_buf(issuer->key.data(), static_cast<int>(issuer->key.size())));
    issuer_key.reset(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
    if (issuer_cert == nullptr || issuer_key == nullptr) return Fail("the issuer's certificate or key");
  }
  X509* signer_cert = issuer != nullptr ? issuer_cert.get() : cert.get();
  EVP_PKEY* signer_key = issuer != nullptr ? issuer_key.get() : key.get();

  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof(serial)) != 1) return Fail("RAND_bytes");
  serial[0] &= 0x7f;  // a positive serial number
  BIGNUM* bn = BN_bin2bn(serial, sizeof(serial), nullptr);
  const bool serial_ok = bn != nullptr && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get())) != nullptr;
  BN_free(bn);
  if (!serial_ok) return Fail("serial number");

  const long not_before = static_cast<long>(absl::ToInt64Seconds(spec.not_before));
  const long not_after = static_cast<long>(absl::ToInt64Seconds(spec.not_before + spec.valid_for));
  if (!X509_set_version(cert.get(), 2) || !X509_gmtime_adj(X509_getm_notBefore(cert.get()), not_before) ||
      !X509_gmtime_adj(X509_getm_notAfter(cert.get()), not_after) || !X509_set_pubkey(cert.get(), key.get())) {
    return Fail("certificate fields");
  }
  X509_NAME* name = X509_get_subject_name(cert.get());
  if (!X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("shardserve"), -1,
                                  -1, 0) ||
      !X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                                  reinterpret_cast<const unsigned char*>(spec.common_name.c_str()), -1, -1, 0) ||
      !X509_set_issuer_name(cert.get(), X509_get_subject_name(signer_cert))) {
    return Fail("certificate names");
  }
  SHARDSERVE_RETURN_IF_ERROR(AddExtension(cert.get(), signer_cert, NID_subject_key_identifier, "hash"));
  if (spec.is_ca) {
    SHARDSERVE_RETURN_IF_ERROR(AddExtension(cert.get(), signer_cert, NID_basic_constraints, "critical,CA:TRUE,pathlen:0"));
    SHARDSERVE_RETURN_IF_ERROR(AddExtension(cert.get(), signer_cert, NID_key_usage, "critical,keyCertSign,cRLSign"));
  } else {
    SHARDSERVE_RETURN_IF_ERROR(AddExtension(cert.get(), signer_cert, NID_basic_constraints, "critical,CA:FALSE"));
    SHARDSERVE_RETURN_IF_ERROR(
        AddExtension(cert.get(), signer_cert, NID_key_usage, "critical,digitalSignature,keyAgreement"));
    SHARDSERVE_RETURN_IF_ERROR(AddExtension(cert.get(), signer_cert, NID_ext_key_usage, "serverAuth,clientAuth"));
  }
  if (issuer != nullptr) {
    SHARDSERVE_RETURN_IF_ERROR(AddExtension(cert.get(), signer_cert, NID_authority_key_identifier, "keyid:always"));
  }
  std::vector<std::string> sans;
  for (const std::string& d : spec.dns_names) sans.push_back(absl::StrCat("DNS:", d));
  for (const std::string& ip : spec.ip_addresses) sans.push_back(absl::StrCat("IP:", ip));
  if (!sans.empty()) {
    SHARDSERVE_RETURN_IF_ERROR(AddExtension(cert.get(), signer_cert, NID_subject_alt_name, absl::StrJoin(sans, ",")));
  }
  if (X509_sign(cert.get(), signer_key, EVP_sha256()) == 0) return Fail("signing the certificate");

  PemKeyPair out;
  SHARDSERVE_ASSIGN_OR_RETURN(out.cert, ToPem(WriteCert, cert.get()));
  SHARDSERVE_ASSIGN_OR_RETURN(out.key, ToPem(WriteKey, key.get()));
  return out;
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents, unsigned mode) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return absl::PermissionDeniedError(absl::StrCat("cannot create ", tmp, ": ", std::strerror(errno)));
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      close(fd);
      unlink(tmp.c_str());
      return absl::InternalError(absl::StrCat("cannot write ", tmp, ": ", std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  fchmod(fd, mode);  // open's mode is filtered by the umask
  if (close(fd) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat("cannot write ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<ClusterCertificateFiles> WriteLocalClusterCertificates(const std::string& dir,
                                                                      absl::Duration valid_for) {
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", dir, ": ", std::strerror(errno)));
  }
  chmod(dir.c_str(), 0700);
  CertificateSpec ca_spec;
  ca_spec.common_name = "shardserve local cluster CA";
  ca_spec.is_ca = true;
  ca_spec.valid_for = valid_for;
  SHARDSERVE_ASSIGN_OR_RETURN(PemKeyPair ca, MakeCertificate(ca_spec, nullptr));
  CertificateSpec server_spec;
  server_spec.common_name = "shardserve local cluster";
  server_spec.dns_names = {"localhost"};
  server_spec.ip_addresses = {"127.0.0.1", "::1"};
  server_spec.valid_for = valid_for;
  SHARDSERVE_ASSIGN_OR_RETURN(PemKeyPair server, MakeCertificate(server_spec, &ca));
  CertificateSpec client_spec = server_spec;
  client_spec.common_name = "shardserve local client";
  SHARDSERVE_ASSIGN_OR_RETURN(PemKeyPair client, MakeCertificate(client_spec, &ca));

  ClusterCertificateFiles f;
  f.ca = absl::StrCat(dir, "/ca.pem");
  f.server_cert = absl::StrCat(dir, "/server.pem");
  f.server_key = absl::StrCat(dir, "/server.key");
  f.client_cert = absl::StrCat(dir, "/client.pem");
  f.client_key = absl::StrCat(dir, "/client.key");
  SHARDSERVE_RETURN_IF_ERROR(WriteFileAtomically(f.ca, ca.cert, 0644));
  SHARDSERVE_RETURN_IF_ERROR(WriteFileAtomically(f.server_key, server.key, 0600));
  SHARDSERVE_RETURN_IF_ERROR(WriteFileAtomically(f.server_cert, server.cert, 0644));
  SHARDSERVE_RETURN_IF_ERROR(WriteFileAtomically(f.client_key, client.key, 0600));
  SHARDSERVE_RETURN_IF_ERROR(WriteFileAtomically(f.client_cert, client.cert, 0644));
  return f;
}

}  // namespace shardserve
