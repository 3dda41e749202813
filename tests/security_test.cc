// security/ in one process: API keys (parsing, the Bearer scheme, hashing, rotation and a bad
// rewrite), the certificate checks at start (expired, not yet valid, key mismatch, unreadable,
// no PEM) on certificates made with OpenSSL here, and which addresses count as loopback (and what
// may listen beyond it in plaintext). The
// processes that use them are tested in tests/tls_test.cc.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "security/api_keys.h"
#include "security/certificates.h"
#include "security/tls.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/security_test.XXXXXX";
    dir_ = mkdtemp(pattern);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    EXPECT_TRUE(WriteFileAtomically(path, text, 0600).ok());
    return path;
  }
  fs::path dir_;
};

TEST_F(SecurityTest, ApiKeysAcceptOnlyTheKeysOfTheFileAsBearerTokens) {
  const std::string path = Write("keys", "# comment\n  key-one  \n\nkey-two\n");
  absl::StatusOr<std::unique_ptr<ApiKeys>> keys = ApiKeys::Load(path);
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ((*keys)->size(), 2u);
  using V = ApiKeys::Verdict;
  EXPECT_EQ((*keys)->Check("Bearer key-one"), V::kOk);
  EXPECT_EQ((*keys)->Check("bearer key-two"), V::kOk);
  EXPECT_EQ((*keys)->Check(std::nullopt), V::kMissing);
  EXPECT_EQ((*keys)->Check(""), V::kMissing);
  EXPECT_EQ((*keys)->Check("Bearer "), V::kMissing);
  EXPECT_EQ((*keys)->Check("key-one"), V::kMissing);  // no scheme
  EXPECT_EQ((*keys)->Check("Basic key-one"), V::kMissing);
  EXPECT_EQ((*keys)->Check("Bearer key-on"), V::kInvalid);  // a prefix is not the key
  EXPECT_EQ((*keys)->Check("Bearer key-one2"), V::kInvalid);
  EXPECT_EQ((*keys)->Check("Bearer # comment"), V::kInvalid);
  EXPECT_EQ((*keys)->Check("Bearer " + std::string(10000, 'k')), V::kInvalid);
  EXPECT_EQ(ApiKeys::ToStatus(V::kMissing).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(ApiKeys::ToStatus(V::kInvalid).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(ApiKeys::ToStatus(V::kOk).ok());
}

TEST_F(SecurityTest, ApiKeysFileIsReReadAndABadRewriteKeepsTheKeys) {
  const std::string path = Write("keys", "old\n");
  std::vector<std::string> kept;  // what the server would log: once per refused version of the file
  absl::StatusOr<std::unique_ptr<ApiKeys>> keys =
      ApiKeys::Load(path, [&](absl::string_view message) { kept.emplace_back(message); });
  ASSERT_TRUE(keys.ok());
  Write("keys", "new\n");
  ASSERT_TRUE((*keys)->Reload().ok());
  EXPECT_EQ((*keys)->Check("Bearer new"), ApiKeys::Verdict::kOk);
  EXPECT_EQ((*keys)->Check("Bearer old"), ApiKeys::Verdict::kInvalid);
  Write("keys", "# no key left\n");
  const absl::Status bad = (*keys)->Reload();
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("no key"), std::string::npos) << bad;
  EXPECT_EQ((*keys)->Check("Bearer new"), ApiKeys::Verdict::kOk);
  EXPECT_EQ((*keys)->Reload(), bad);  // the same version: the same error, not reported again
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0], "--api-keys-file " + path + ": no key in the file; keeping the 1 key(s) read before");
  fs::remove(path);
  EXPECT_FALSE((*keys)->Reload().ok());
  EXPECT_FALSE((*keys)->Reload().ok());
  EXPECT_EQ((*keys)->Check("Bearer new"), ApiKeys::Verdict::kOk);
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_NE(kept[1].find("cannot read the file; keeping the 1 key(s)"), std::string::npos) << kept[1];
  // A good version again is taken, and a later bad one is reported again.
  Write("keys", "newer\n");
  ASSERT_TRUE((*keys)->Reload().ok());
  Write("keys", "\n");
  EXPECT_FALSE((*keys)->Reload().ok());
  EXPECT_EQ(kept.size(), 3u);
}

TEST_F(SecurityTest, ApiKeysLoadRefusesAnEmptyOrMissingFile) {
  EXPECT_FALSE(ApiKeys::Load(Write("empty", "\n# only a comment\n")).ok());
  const absl::StatusOr<std::unique_ptr<ApiKeys>> missing = ApiKeys::Load((dir_ / "missing").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("cannot read"), std::string::npos);
}

TEST_F(SecurityTest, CheckTlsFilesNamesWhatIsWrong) {
  CertificateSpec ca_spec;
  ca_spec.common_name = "ca";
  ca_spec.is_ca = true;
  const absl::StatusOr<PemKeyPair> ca = MakeCertificate(ca_spec, nullptr);
  ASSERT_TRUE(ca.ok()) << ca.status();
  CertificateSpec leaf;
  leaf.common_name = "leaf";
  leaf.ip_addresses = {"127.0.0.1"};
  const absl::StatusOr<PemKeyPair> good = MakeCertificate(leaf, &*ca), other = MakeCertificate(leaf, &*ca);
  leaf.not_before = absl::Hours(-3);
  leaf.valid_for = absl::Hours(1);
  const absl::StatusOr<PemKeyPair> expired = MakeCertificate(leaf, &*ca);
  leaf.not_before = absl::Hours(2);
  const absl::StatusOr<PemKeyPair> future = MakeCertificate(leaf, &*ca);
  ASSERT_TRUE(good.ok() && other.ok() && expired.ok() && future.ok());

  const std::string ca_pem = Write("ca.pem", ca->cert);
  TlsFiles files{Write("good.pem", good->cert), Write("good.key", good->key), ca_pem};
  EXPECT_TRUE(CheckTlsFiles(files).ok()) << CheckTlsFiles(files);

  auto error = [&](TlsFiles f) { return std::string(CheckTlsFiles(f).message()); };
  EXPECT_NE(error({Write("expired.pem", expired->cert), Write("expired.key", expired->key), ca_pem}).find("has expired"),
            std::string::npos);
  EXPECT_NE(error({Write("future.pem", future->cert), Write("future.key", future->key), ca_pem}).find("not valid yet"),
            std::string::npos);
  EXPECT_NE(error({files.cert, Write("other.key", other->key), ca_pem}).find("is not the key of the certificate"),
            std::string::npos);
  EXPECT_NE(error({Write("junk.pem", "not a certificate\n"), files.key, ca_pem}).find("no PEM certificate"),
            std::string::npos);
  EXPECT_NE(error({files.cert, Write("junk.key", "not a key\n"), ca_pem}).find("not a PEM private key"),
            std::string::npos);
  EXPECT_NE(error({files.cert, files.key, (dir_ / "nope.pem").string()}).find("--tls-ca"), std::string::npos);

  // Server credentials: a CA alone verifies nothing on a server.
  EXPECT_FALSE(MakeServerCredentials({"", "", ca_pem}, PeerCertificates::kRequired).ok());
  EXPECT_TRUE(MakeServerCredentials(files, PeerCertificates::kVerifyIfGiven).ok());
  EXPECT_TRUE(MakeChannelCredentials({"", "", ca_pem}).ok());
}

TEST_F(SecurityTest, LocalClusterCertificatesAreWrittenWithPrivateKeys) {
  const absl::StatusOr<ClusterCertificateFiles> f =
      WriteLocalClusterCertificates((dir_ / "certs").string(), absl::Hours(24));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(fs::status(f->server_key).permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(fs::status(f->client_key).permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(fs::status(dir_ / "certs").permissions() & fs::perms::all, fs::perms::owner_all);
  EXPECT_TRUE(CheckTlsFiles({f->server_cert, f->server_key, f->ca}).ok());
  EXPECT_TRUE(CheckTlsFiles({f->client_cert, f->client_key, f->ca}).ok());
}

TEST(TlsAddressTest, LoopbackAddresses) {
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1:50051"));
  EXPECT_TRUE(IsLoopbackAddress("127.1.2.3:0"));
  EXPECT_TRUE(IsLoopbackAddress("localhost:8080"));
  EXPECT_TRUE(IsLoopbackAddress("[::1]:50051"));
  EXPECT_FALSE(IsLoopbackAddress("0.0.0.0:50051"));
  EXPECT_FALSE(IsLoopbackAddress("[::]:50051"));
  EXPECT_FALSE(IsLoopbackAddress("10.0.0.5:50051"));
  EXPECT_FALSE(IsLoopbackAddress("coordinator.svc:50051"));
  EXPECT_TRUE(CheckPlaintextListen("0.0.0.0:1", /*tls=*/true, false).ok());
  EXPECT_TRUE(CheckPlaintextListen("0.0.0.0:1", false, /*insecure=*/true).ok());
  EXPECT_EQ(CheckPlaintextListen("0.0.0.0:1", false, false).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(TlsAddressTest, LoopbackHosts) {
  for (const char* host : {"127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"}) {
    EXPECT_TRUE(IsLoopbackHost(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "::", "[::]", "", "10.0.0.5", "coordinator.svc", "128.0.0.1"}) {
    EXPECT_FALSE(IsLoopbackHost(host)) << host;
  }
}

TEST(TlsAddressTest, PlainMetricsBeyondLoopbackNeedInsecure) {
  EXPECT_TRUE(CheckMetricsListen("127.0.0.1:9400", /*https=*/false, false).ok());
  EXPECT_TRUE(CheckMetricsListen("[::1]:0", false, false).ok());
  EXPECT_TRUE(CheckMetricsListen("0.0.0.0:9400", /*https=*/true, false).ok());
  EXPECT_TRUE(CheckMetricsListen("0.0.0.0:9400", false, /*insecure=*/true).ok());
  const absl::Status plain = CheckMetricsListen("10.0.0.5:9400", false, false);
  EXPECT_EQ(plain.code(), absl::StatusCode::kFailedPrecondition);
  for (const char* flag : {"--metrics-listen 10.0.0.5:9400", "--tls-cert", "--metrics-plaintext", "--insecure"}) {
    EXPECT_NE(std::string(plain.message()).find(flag), std::string::npos) << plain.message();
  }
}

TEST(TlsAddressTest, HttpBeyondLoopbackNeedsTlsAndKeysOrInsecure) {
  // Loopback: plain HTTP without keys is fine.
  EXPECT_TRUE(CheckHttpListen("127.0.0.1", false, false, false).ok());
  EXPECT_TRUE(CheckHttpListen("::1", false, false, false).ok());
  // Beyond: both, or --insecure.
  EXPECT_TRUE(CheckHttpListen("0.0.0.0", /*tls=*/true, /*api_keys=*/true, false).ok());
  EXPECT_TRUE(CheckHttpListen("0.0.0.0", false, false, /*insecure=*/true).ok());
  const absl::Status neither = CheckHttpListen("0.0.0.0", false, false, false);
  EXPECT_EQ(neither.code(), absl::StatusCode::kFailedPrecondition);
  for (const char* flag : {"--http-host 0.0.0.0", "--tls-cert", "--api-keys-file", "--insecure"}) {
    EXPECT_NE(std::string(neither.message()).find(flag), std::string::npos) << neither.message();
  }
  const absl::Status no_keys = CheckHttpListen("10.0.0.5", /*tls=*/true, false, false);
  EXPECT_EQ(no_keys.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(no_keys.message()).find("--api-keys-file"), std::string::npos) << no_keys.message();
  EXPECT_EQ(std::string(no_keys.message()).find("--tls-cert"), std::string::npos);
  const absl::Status no_tls = CheckHttpListen("10.0.0.5", false, /*api_keys=*/true, false);
  EXPECT_EQ(no_tls.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(no_tls.message()).find("--tls-cert"), std::string::npos) << no_tls.message();
  EXPECT_EQ(std::string(no_tls.message()).find("--api-keys-file"), std::string::npos);
}

}  // namespace
}  // namespace shardserve
