// The HTTP ports' server (security/https.h) and /metrics on it (telemetry/metrics_http.h), in one
// process: HTTPS with a certificate made here, verified by httplib's client with the CA; the
// certificate re-read when its files are replaced (new handshakes get the new one; a half-done
// rotation keeps the old pair and says why); plain HTTP without a certificate; /metrics serving
// the registry over both, scrapes not blocked by idle connections.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <httplib.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include "absl/strings/str_cat.h"
#include "base/version.h"
#include "gtest/gtest.h"
#include "security/certificates.h"
#include "security/https.h"
#include "telemetry/metrics_http.h"
#include "tests/test_certificates.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

class HttpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/https_test.XXXXXX";
    dir_ = mkdtemp(pattern);
    ca_ = Make("test CA", nullptr, true);
    other_ca_ = Make("another CA", nullptr, true);
    Write("ca.pem", ca_.cert);
    Write("other-ca.pem", other_ca_.cert);
    const PemKeyPair server = Make("server one", &ca_);
    Write("live.pem", server.cert);
    Write("live.key", server.key);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  PemKeyPair Make(const std::string& name, const PemKeyPair* issuer, bool is_ca = false) {
    return MakeTestCertificate(name, issuer, is_ca);
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = F(name);
    EXPECT_TRUE(WriteFileAtomically(path, text, 0600).ok()) << path;
    return path;
  }
  std::string F(const std::string& name) const { return (dir_ / name).string(); }
  TlsFiles Live() const { return TlsFiles{F("live.pem"), F("live.key"), ""}; }

  fs::path dir_;
  PemKeyPair ca_, other_ca_;
};

// A server with GET /hello, listening on 127.0.0.1 (a free port) until destroyed.
class Running {
 public:
  explicit Running(std::unique_ptr<httplib::Server> server) : server_(std::move(server)) {
    server_->Get("/hello", [](const httplib::Request&, httplib::Response& res) { res.set_content("hi", "text/plain"); });
    port_ = server_->bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_->listen_after_bind(); });
  }
  ~Running() {
    server_->stop();
    thread_.join();
  }
  int port() const { return port_; }

 private:
  std::unique_ptr<httplib::Server> server_;
  int port_ = 0;
  std::thread thread_;
};

// GET https://127.0.0.1:port/path verifying the server with the CA file `ca`: the body, or "" when
// the handshake or the request failed (then *error says how).
std::string GetHttps(int port, const std::string& path, const std::string& ca, std::string* error = nullptr) {
  httplib::SSLClient client("127.0.0.1", port);
  client.set_ca_cert_path(ca.c_str());
  client.enable_server_certificate_verification(true);
  client.set_connection_timeout(20);
  client.set_read_timeout(20);
  httplib::Result r = client.Get(path.c_str());
  if (!r || r->status != 200) {
    if (error != nullptr) *error = r ? "HTTP " + std::to_string(r->status) : httplib::to_string(r.error());
    return "";
  }
  return r->body;
}

std::string GetHttp(int port, const std::string& path, int* status = nullptr) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(20);
  client.set_read_timeout(20);
  httplib::Result r = client.Get(path.c_str());
  if (status != nullptr) *status = r ? r->status : -1;
  return r && r->status == 200 ? r->body : "";
}

bool WaitFor(const std::function<bool()>& done, int seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return done();
}

// The common name of the certificate the reloader puts on a connection.
std::string AppliedCommonName(CertificateReloader& reloader) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  SSL* ssl = SSL_new(ctx);
  std::string cn = "(not applied)";
  if (reloader.Apply(ssl) && SSL_get_certificate(ssl) != nullptr) {
    char buf[256] = {};
    X509_NAME_get_text_by_NID(X509_get_subject_name(SSL_get_certificate(ssl)), NID_commonName, buf, sizeof(buf));
    cn = buf;
  }
  SSL_free(ssl);
  SSL_CTX_free(ctx);
  return cn;
}

TEST_F(HttpsTest, ServesHttpsVerifiedByTheCaAndPlainHttpWithoutACertificate) {
  absl::StatusOr<std::unique_ptr<httplib::Server>> https = MakeHttpServer(Live());
  ASSERT_TRUE(https.ok()) << https.status();
  Running tls(*std::move(https));
  ASSERT_GT(tls.port(), 0);
  EXPECT_EQ(GetHttps(tls.port(), "/hello", F("ca.pem")), "hi");
  std::string error;
  EXPECT_EQ(GetHttps(tls.port(), "/hello", F("other-ca.pem"), &error), "");
  EXPECT_NE(error, "");
  int status = 0;
  EXPECT_EQ(GetHttp(tls.port(), "/hello", &status), "");  // plain HTTP to an HTTPS port: no answer
  EXPECT_NE(status, 200);

  absl::StatusOr<std::unique_ptr<httplib::Server>> plain = MakeHttpServer(TlsFiles{});
  ASSERT_TRUE(plain.ok()) << plain.status();
  Running http(*std::move(plain));
  EXPECT_EQ(GetHttp(http.port(), "/hello"), "hi");
}

// A second server on a port already served is refused at bind (httplib's own SO_REUSEPORT would let
// it bind and take a share of the first one's connections), and the port is free again once the
// first server has stopped, though a connection to it was just closed (SO_REUSEADDR).
TEST_F(HttpsTest, APortInUseIsRefusedAndFreeAgainAfterwards) {
  int port = 0;
  {
    absl::StatusOr<std::unique_ptr<httplib::Server>> first = MakeHttpServer(TlsFiles{});
    ASSERT_TRUE(first.ok()) << first.status();
    Running serving(*std::move(first));
    port = serving.port();
    ASSERT_GT(port, 0);
    EXPECT_EQ(GetHttp(port, "/hello"), "hi");
    absl::StatusOr<std::unique_ptr<httplib::Server>> second = MakeHttpServer(TlsFiles{});
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_FALSE((*second)->bind_to_port("127.0.0.1", port)) << "a second server bound port " << port;
  }
  absl::StatusOr<std::unique_ptr<httplib::Server>> again = MakeHttpServer(TlsFiles{});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE((*again)->bind_to_port("127.0.0.1", port)) << "port " << port << " after its server stopped";
}

TEST_F(HttpsTest, RefusesUnusableCertificatesNamingTheFile) {
  Write("other.key", Make("someone else", &ca_).key);
  absl::StatusOr<std::unique_ptr<httplib::Server>> mismatch = MakeHttpServer({F("live.pem"), F("other.key"), ""});
  ASSERT_FALSE(mismatch.ok());
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.status().message().find("is not the key of the certificate"), std::string::npos)
      << mismatch.status();
  absl::StatusOr<std::unique_ptr<httplib::Server>> missing = MakeHttpServer({F("missing.pem"), F("live.key"), ""});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("missing.pem: cannot read the file"), std::string::npos)
      << missing.status();
}

TEST_F(HttpsTest, ReplacedCertificateFilesReachNewHandshakes) {
  absl::StatusOr<std::unique_ptr<httplib::Server>> https = MakeHttpServer(Live());
  ASSERT_TRUE(https.ok()) << https.status();
  Running server(*std::move(https));
  ASSERT_EQ(GetHttps(server.port(), "/hello", F("ca.pem")), "hi");
  // Replace the key, then the certificate, by another CA's (each by a rename, as docs/security.md says).
  const PemKeyPair next = Make("server two", &other_ca_);
  Write("live.key", next.key);
  Write("live.pem", next.cert);
  // Re-read within kCertificateRefreshSeconds of the change (generous deadline: a loaded machine).
  EXPECT_TRUE(WaitFor([&] { return GetHttps(server.port(), "/hello", F("other-ca.pem")) == "hi"; }, 30))
      << "the new certificate was not picked up";
  std::string error;
  EXPECT_EQ(GetHttps(server.port(), "/hello", F("ca.pem"), &error), "");
}

TEST_F(HttpsTest, AHalfDoneRotationKeepsTheOldPairUntilBothFilesMatch) {
  absl::StatusOr<std::unique_ptr<CertificateReloader>> reloader =
      CertificateReloader::Create(F("live.pem"), F("live.key"), /*interval=*/absl::ZeroDuration());
  ASSERT_TRUE(reloader.ok()) << reloader.status();
  EXPECT_EQ(AppliedCommonName(**reloader), "server one");
  const PemKeyPair next = Make("server two", &other_ca_);
  Write("live.key", next.key);  // the key alone: it does not match the certificate yet
  EXPECT_EQ(AppliedCommonName(**reloader), "server one");
  EXPECT_NE((*reloader)->last_error().message().find("is not the key of the certificate"), std::string::npos)
      << (*reloader)->last_error();
  Write("live.pem", next.cert);
  EXPECT_EQ(AppliedCommonName(**reloader), "server two");
  EXPECT_TRUE((*reloader)->last_error().ok()) << (*reloader)->last_error();
  fs::remove(F("live.pem"));  // a file gone: the current pair stays
  EXPECT_EQ(AppliedCommonName(**reloader), "server two");
  EXPECT_FALSE((*reloader)->last_error().ok());
}

std::shared_ptr<prometheus::Registry> RegistryWithACounter() {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter().Name("https_test_scrapes_total").Help("a counter").Register(*registry).Add({}).Increment(3);
  return registry;
}

TEST_F(HttpsTest, MetricsAreServedOverHttpsWithTheCertificate) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> metrics = ServeMetrics("127.0.0.1:0", Live(), RegistryWithACounter());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_TRUE((*metrics)->https());
  const std::string address = (*metrics)->address();
  ASSERT_EQ(address.rfind("127.0.0.1:", 0), 0u) << address;
  EXPECT_EQ((*metrics)->url(), "https://" + address + "/metrics");
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  const std::string body = GetHttps(port, "/metrics", F("ca.pem"));
  EXPECT_NE(body.find("https_test_scrapes_total 3"), std::string::npos) << body;
  std::string error;
  EXPECT_EQ(GetHttps(port, "/other", F("ca.pem"), &error), "");
  EXPECT_EQ(error, "HTTP 404");
  EXPECT_EQ(GetHttps(port, "/metrics", F("other-ca.pem")), "");
}

TEST_F(HttpsTest, MetricsInPlainHttpAreNotHeldUpByIdleConnections) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> metrics =
      ServeMetrics("127.0.0.1:0", TlsFiles{}, RegistryWithACounter());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_FALSE((*metrics)->https());
  EXPECT_EQ((*metrics)->url().rfind("http://127.0.0.1:", 0), 0u) << (*metrics)->url();
  const int port = std::stoi((*metrics)->address().substr((*metrics)->address().rfind(':') + 1));
  // Twice as many silent connections as /metrics has threads: each is dropped after its read
  // timeout, so the scrape behind them is answered (the old one-at-a-time server made it wait
  // 2 s per idle connection; the client's 20 s timeout is far above what this can take).
  std::vector<int> idle;
  for (int i = 0; i < 2 * kMetricsThreads; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    idle.push_back(fd);
  }
  const std::string body = GetHttp(port, "/metrics");
  EXPECT_NE(body.find("https_test_scrapes_total 3"), std::string::npos) << body;
  EXPECT_NE(body.find(absl::StrCat("shardserve_build_info{version=\"", kVersion, "\"} 1")), std::string::npos) << body;
  for (int fd : idle) close(fd);
  absl::StatusOr<std::unique_ptr<MetricsServer>> bad = ServeMetrics("127.0.0.1", TlsFiles{}, RegistryWithACounter());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'127.0.0.1' is not HOST:PORT"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace shardserve
