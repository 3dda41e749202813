#include "security/tls.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include <grpc/support/log.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "security/openssl.h"

namespace shardserve {
namespace {

using openssl::ReadCertificates;
using openssl::ReadFile;

std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> Provider(const TlsFiles& files) {
  if (files.ca.empty()) {
    return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(files.key, files.cert,
                                                                                kCertificateRefreshSeconds);
  }
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(files.key, files.cert, files.ca,
                                                                              kCertificateRefreshSeconds);
}

// ReportTlsRefusals's `log`: set once, before gRPC logs.
std::function<void(absl::string_view)>* refusal_log = nullptr;

// gRPC's own line, in the shape of its default: "E1202 00:22:40.412349355   2785 file.cc:1501] message".
void WriteGrpcLine(const gpr_log_func_args& args) {
  const char* file = args.file != nullptr ? args.file : "?";
  if (const char* slash = std::strrchr(file, '/')) file = slash + 1;
  const char severity = args.severity == GPR_LOG_SEVERITY_ERROR ? 'E' : args.severity == GPR_LOG_SEVERITY_INFO ? 'I' : 'D';
  const std::string line =
      absl::StrCat(std::string(1, severity), absl::FormatTime("%m%d %H:%M:%E9S", absl::Now(), absl::LocalTimeZone()),
                   " ", syscall(SYS_gettid), " ", file, ":", args.line, "] ", args.message, "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

void TranslateGrpcLog(gpr_log_func_args* args) {
  const absl::string_view message = args->message != nullptr ? args->message : "";
  if (!absl::StrContains(message, "Handshake failed")) return WriteGrpcLine(*args);
  const std::string grpc = absl::StrCat(" (gRPC: ", absl::StripSuffix(message, "."), ")");
  if (absl::StrContains(message, "wrong version number") || absl::StrContains(message, "http request")) {
    (*refusal_log)(absl::StrCat("TLS mismatch: a peer spoke plaintext to this TLS port", grpc,
                                "; a worker needs --tls-cert, --tls-key and --tls-ca, a client --tls-ca"));
  } else if (absl::StrContains(message, "certificate verify failed")) {
    (*refusal_log)(absl::StrCat("refused a peer's certificate: it does not verify against --tls-ca (from "
                                "another CA, expired, or not valid yet)",
                                grpc));
  } else {
    WriteGrpcLine(*args);
  }
}

}  // namespace

void ReportTlsRefusals(std::function<void(absl::string_view message)> log) {
  refusal_log = new std::function<void(absl::string_view)>(std::move(log));  // lives as long as gRPC
  gpr_set_log_function(TranslateGrpcLog);
}

absl::StatusOr<TlsFiles> TlsFilesFromFlags(const Flags& flags) {
  TlsFiles f;
  f.cert = flags.Get("tls-cert");
  f.key = flags.Get("tls-key");
  f.ca = flags.Get("tls-ca");
  if (f.cert.empty() != f.key.empty()) {
    return absl::InvalidArgumentError(f.cert.empty() ? "flag --tls-key needs --tls-cert" : "flag --tls-cert needs --tls-key");
  }
  return f;
}

absl::Status CheckTlsFiles(const TlsFiles& files) {
  if (!files.ca.empty()) SHARDSERVE_RETURN_IF_ERROR(ReadCertificates(files.ca, "tls-ca").status());
  if (files.cert.empty()) return absl::OkStatus();
  return openssl::ReadIdentity(files.cert, files.key).status();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsFiles& files,
                                                                               PeerCertificates peers) {
  if (!files.has_identity()) {
    if (!files.ca.empty()) return absl::InvalidArgumentError("flag --tls-ca on a server needs --tls-cert and --tls-key");
    return grpc::InsecureServerCredentials();
  }
  SHARDSERVE_RETURN_IF_ERROR(CheckTlsFiles(files));
  grpc::experimental::TlsServerCredentialsOptions options(Provider(files));
  options.watch_identity_key_cert_pairs();
  if (!files.ca.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(peers == PeerCertificates::kRequired
                                      ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                  : peers == PeerCertificates::kVerifyIfGiven
                                      ? GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY
                                      : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::experimental::TlsServerCredentials(options);
  if (creds == nullptr) return absl::InternalError("gRPC could not make TLS server credentials");
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsFiles& files) {
  if (!files.any()) return grpc::InsecureChannelCredentials();
  SHARDSERVE_RETURN_IF_ERROR(CheckTlsFiles(files));
  grpc::SslCredentialsOptions options;
  if (!files.ca.empty()) {
    SHARDSERVE_ASSIGN_OR_RETURN(options.pem_root_certs, ReadFile(files.ca, "tls-ca"));
  }
  if (files.has_identity()) {
    SHARDSERVE_ASSIGN_OR_RETURN(options.pem_cert_chain, ReadFile(files.cert, "tls-cert"));
    SHARDSERVE_ASSIGN_OR_RETURN(options.pem_private_key, ReadFile(files.key, "tls-key"));
  }
  return grpc::SslCredentials(options);
}

bool PeerHasVerifiedCertificate(const grpc::ServerContext& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr) return false;
  const std::vector<grpc::string_ref> type = auth->FindPropertyValues("transport_security_type");
  // "tls" from TlsServerCredentials, "ssl" from SslServerCredentials.
  if (type.empty() || (type.front() != "tls" && type.front() != "ssl")) return false;
  // With GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY a certificate the peer presents has been
  // verified against the CA during the handshake, or there is no connection; present means verified.
  return !auth->FindPropertyValues("x509_pem_cert").empty() && auth->IsPeerAuthenticated();
}

bool IsLoopbackHost(const std::string& host) {
  std::string h = host;
  if (absl::StartsWith(h, "[") && absl::EndsWith(h, "]")) h = h.substr(1, h.size() - 2);
  return h == "localhost" || h == "::1" || absl::StartsWith(h, "127.");
}

bool IsLoopbackAddress(const std::string& host_port) {
  return IsLoopbackHost(host_port.substr(0, host_port.rfind(':')));
}

absl::Status CheckPlaintextListen(const std::string& listen, bool tls, bool insecure) {
  if (tls || insecure || IsLoopbackAddress(listen)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("--listen ", listen, " is reachable beyond this machine: give --tls-cert and --tls-key (and "
                   "--tls-ca for mutual TLS), or --insecure to serve it in plaintext"));
}

absl::Status CheckMetricsListen(const std::string& listen, bool https, bool insecure) {
  if (https || insecure || IsLoopbackAddress(listen)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("--metrics-listen ", listen, " is reachable beyond this machine: serve /metrics over HTTPS (--tls-cert "
                   "and --tls-key, without --metrics-plaintext), or give --insecure to serve it in plain HTTP"));
}

absl::Status CheckHttpListen(const std::string& host, bool tls, bool api_keys, bool insecure) {
  if (insecure || IsLoopbackHost(host) || (tls && api_keys)) return absl::OkStatus();
  std::vector<std::string> missing;
  if (!tls) missing.push_back("--tls-cert and --tls-key (HTTPS)");
  if (!api_keys) missing.push_back("--api-keys-file");
  return absl::FailedPreconditionError(
      absl::StrCat("--http-host ", host.empty() ? "(every interface)" : host,
                   " is reachable beyond this machine: the OpenAI HTTP API there needs ", absl::StrJoin(missing, " and "),
                   ", or --insecure to serve it as it is (--http-host 127.0.0.1 keeps it on this machine)"));
}

}  // namespace shardserve
