#include "security/https.h"

#include <httplib.h>
#include <openssl/err.h>
#include <sys/socket.h>

#include <algorithm>
#include <type_traits>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "security/file_id.h"
#include "security/openssl.h"

namespace shardserve {

struct CertificateReloader::Pair {
  openssl::Identity identity;
  STACK_OF(X509) * extra = nullptr;  // the chain past the leaf, as SSL_use_cert_and_key takes it
  ~Pair() { sk_X509_free(extra); }
};

struct CertificateReloader::FileIds {
  FileId cert, key;
  bool operator==(const FileIds&) const = default;
  static FileIds Of(const std::string& cert_path, const std::string& key_path) {
    return FileIds{FileId::Of(cert_path), FileId::Of(key_path)};
  }
};

CertificateReloader::CertificateReloader(std::string cert_path, std::string key_path, absl::Duration interval)
    : cert_path_(std::move(cert_path)), key_path_(std::move(key_path)), interval_(interval) {}

CertificateReloader::~CertificateReloader() = default;

absl::StatusOr<std::unique_ptr<CertificateReloader>> CertificateReloader::Create(const std::string& cert_path,
                                                                                 const std::string& key_path,
                                                                                 absl::Duration interval) {
  std::unique_ptr<CertificateReloader> r(new CertificateReloader(cert_path, key_path, interval));
  // The ids first: a file replaced between the two is then seen as changed at the next look.
  FileIds ids = FileIds::Of(cert_path, key_path);
  absl::StatusOr<std::shared_ptr<const Pair>> pair = ReadPair(cert_path, key_path);
  if (!pair.ok()) return pair.status();
  absl::MutexLock lock(&r->mu_);
  r->current_ = *std::move(pair);
  r->files_ = std::make_unique<FileIds>(ids);
  r->last_look_ = absl::Now();
  return r;
}

void CertificateReloader::MaybeReload() {
  const absl::Time now = absl::Now();
  if (now - last_look_ < interval_) return;
  last_look_ = now;
  FileIds ids = FileIds::Of(cert_path_, key_path_);
  if (ids == *files_) return;
  absl::StatusOr<std::shared_ptr<const Pair>> pair = ReadPair(cert_path_, key_path_);
  if (!pair.ok()) {
    last_error_ = pair.status();  // keep the previous pair; the ids stay old, so the next look retries
    return;
  }
  current_ = *std::move(pair);
  *files_ = ids;
  last_error_ = absl::OkStatus();
}

bool CertificateReloader::Apply(SSL* ssl) {
  std::shared_ptr<const Pair> pair;
  {
    absl::MutexLock lock(&mu_);
    MaybeReload();
    pair = current_;
  }
  // override=1: replaces what the connection has (nothing, the SSL_CTX holds no certificate).
  // SSL_use_cert_and_key takes its own references.
  return SSL_use_cert_and_key(ssl, pair->identity.chain.front().get(), pair->identity.key.get(), pair->extra,
                              /*override=*/1) == 1;
}

absl::Status CertificateReloader::last_error() const {
  absl::MutexLock lock(&mu_);
  return last_error_;
}

absl::StatusOr<std::shared_ptr<const CertificateReloader::Pair>> CertificateReloader::ReadPair(
    const std::string& cert_path, const std::string& key_path) {
  absl::StatusOr<openssl::Identity> id = openssl::ReadIdentity(cert_path, key_path);
  if (!id.ok()) return id.status();
  auto pair = std::make_shared<CertificateReloader::Pair>();
  pair->identity = *std::move(id);
  pair->extra = sk_X509_new_null();
  if (pair->extra == nullptr) return absl::ResourceExhaustedError("OpenSSL could not allocate a certificate stack");
  for (size_t i = 1; i < pair->identity.chain.size(); ++i) {
    if (!sk_X509_push(pair->extra, pair->identity.chain[i].get())) {
      return absl::ResourceExhaustedError("OpenSSL could not allocate a certificate stack");
    }
  }
  return pair;
}

namespace {

// httplib's SSLServer with the reloader its SSL_CTX's certificate callback reads: the server owns
// the reloader, which outlives every handshake (they end with the server's threads).
class ReloadingSslServer : public httplib::SSLServer {
 public:
  explicit ReloadingSslServer(std::unique_ptr<CertificateReloader> reloader)
      : httplib::SSLServer([r = reloader.get()](SSL_CTX& ctx) {
          SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
          SSL_CTX_set_options(&ctx, SSL_OP_NO_COMPRESSION | SSL_OP_NO_SESSION_RESUMPTION_ON_RENEGOTIATION);
          SSL_CTX_set_cert_cb(
              &ctx, [](SSL* ssl, void* arg) { return static_cast<CertificateReloader*>(arg)->Apply(ssl) ? 1 : 0; },
              r);
          return true;
        }),
        reloader_(std::move(reloader)) {}

 private:
  const std::unique_ptr<CertificateReloader> reloader_;
};

// A server whose connections ServeConnection serves (http_connection.h), not httplib's own loop;
// requests still go through httplib's parser and routes (Server::process_request).
template <typename Base>
class PolicedServer final : public Base {
 public:
  template <typename... Args>
  explicit PolicedServer(ConnectionPolicy policy, Args&&... args)
      : Base(std::forward<Args>(args)...), policy_(std::move(policy)) {
    // What httplib writes in its Keep-Alive header: the policy's figures.
    this->set_keep_alive_max_count(static_cast<size_t>(std::max(1, policy_.max_requests)));
    this->set_keep_alive_timeout(std::max<int64_t>(1, absl::ToInt64Seconds(policy_.idle_timeout)));
  }

 private:
  bool process_and_close_socket(socket_t sock) override {
    SSL_CTX* ctx = nullptr;
    if constexpr (std::is_base_of_v<httplib::SSLServer, Base>) ctx = this->ssl_context();
    return ServeConnection(
        sock, ctx, policy_, peers_, [this] { return this->svr_sock_ == INVALID_SOCKET; },
        [this](httplib::Stream& stream, bool close_connection, bool& connection_closed) {
          // httplib calls setup_request once it has read a request's line and headers. A request
          // it answered without (a line or header it cannot parse: 400; a line too long: 414)
          // leaves the stream at an unknown place in the client's bytes: what follows is not known
          // to begin a request, so the connection is closed rather than read on (each further line
          // would be answered as a request of its own).
          bool head_read = false;
          const bool served = this->process_request(stream, close_connection, connection_closed,
                                                    [&head_read](httplib::Request&) { head_read = true; });
          if (!head_read) connection_closed = true;
          return served;
        });
  }

  const ConnectionPolicy policy_;
  PeerCounts peers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<httplib::Server>> MakeHttpServer(const TlsFiles& files, const ConnectionPolicy& policy) {
  std::unique_ptr<httplib::Server> server;
  if (files.has_identity()) {
    absl::StatusOr<std::unique_ptr<CertificateReloader>> reloader = CertificateReloader::Create(files.cert, files.key);
    if (!reloader.ok()) return reloader.status();
    server = std::make_unique<PolicedServer<ReloadingSslServer>>(policy, *std::move(reloader));
    if (!server->is_valid()) {
      return absl::InternalError(
          absl::StrCat("OpenSSL could not make an HTTPS context: ", openssl::LastError("no OpenSSL error queued")));
    }
  } else {
    server = std::make_unique<PolicedServer<httplib::Server>>(policy);
  }
  server->set_tcp_nodelay(true);
  server->set_socket_options(ListenSocketOptions);
  return server;
}

void ListenSocketOptions(int sock) {
  const int yes = 1;
  setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

}  // namespace shardserve
