// TLS, mutual TLS and API keys on real processes on 127.0.0.1 (security/, docs/security.md):
// - a mutual-TLS cluster streams the golden tokens; a worker with a certificate from another CA
//   is refused at the handshake, a peer without a certificate is refused before registering
//   (Connect and rendezvous), and neither takes a slot: the group waits for the right worker; a
//   worker's own port takes only peers with a certificate from the CA, and its --health-listen
//   port answers health in plaintext (Kubernetes' gRPC probes);
// - a plaintext client against the TLS port fails (UNAVAILABLE), not hangs;
// - API keys: missing or wrong key is UNAUTHENTICATED and counted, the right key streams, health
//   stays open, the key file is re-read when it changes (a file with no key keeps the keys, logged
//   once), keys never reach the log;
// - certificates from the CA that have expired or are not valid yet are refused at the handshake
//   on the coordinator's port (no registration) and on a worker's, and both servers log it;
// - certificate files are re-read: a coordinator whose certificate is replaced by one from another
//   CA is then verified with the new CA only; its --tls-ca replaced by a bundle of the old and a new
//   CA takes the new CA's peers, and by the new CA alone refuses the old CA's;
// - a TLS mismatch (plaintext worker, TLS coordinator, or the reverse) is named by the worker at
//   once, and logged by a TLS coordinator;
// - an expired certificate, a key that is not the certificate's, and plaintext beyond loopback
//   are clear errors at start;
// - `shardserve launch` is TLS by default and the client commands find it without flags.
// Test certificates are made here with OpenSSL's library (security/certificates.h); none is
// committed. Every wait is bounded; tests/cluster_harness.h kills and reaps every process.
#include <sys/stat.h>

#include <cstdlib>
#include <regex>

#include <grpcpp/create_channel.h>

#include "gtest/gtest.h"
#include "security/certificates.h"
#include "security/tls.h"
#include "shardserve/v1/worker.grpc.pb.h"
#include "tests/cluster_harness.h"
#include "tests/test_certificates.h"

namespace shardserve {
namespace {

constexpr char kFixture[] = "llama_gqa";

void WriteText(const fs::path& path, const std::string& text) {
  ASSERT_TRUE(WriteFileAtomically(path.string(), text, 0600).ok()) << path;
}

std::string ReadText(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// How many times `part` occurs in `text`.
int Count(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + part.size())) ++n;
  return n;
}

// Runs `command` through the shell; its exit code and its stdout + stderr.
std::pair<int, std::string> Shell(const std::string& command) {
  std::string out;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

// The value of `series` (e.g. `shardserve_auth_failures_total{model="llama_gqa",reason="invalid_key"}`)
// in a /metrics text, -1 when absent. Label order as prometheus-cpp writes them (alphabetical).
double MetricValue(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return -1;
}

// GET `url` (http:// or https://, then verified with the CA file `ca`); its exit code (0: got a
// 200) and the body, or the error.
std::pair<int, std::string> Fetch(const std::string& url, const std::string& ca = "") {
  return Shell("python3 -c \"import ssl,sys,urllib.request; ctx = ssl.create_default_context(cafile=sys.argv[2]) if "
               "sys.argv[2] else None; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10, "
               "context=ctx).read().decode())\" '" +
               url + "' '" + ca + "'");
}

std::string Scrape(const std::string& url, const std::string& ca = "") { return Fetch(url, ca).second; }

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/tls_test.XXXXXX";
    dir_ = mkdtemp(pattern);
    ca_ = Make("test CA", nullptr, true);
    other_ca_ = Make("another CA", nullptr, true);
    Save("ca.pem", ca_.cert);
    Save("other-ca.pem", other_ca_.cert);
    SaveKeyPair("server", Make("coordinator", &ca_));
    SaveKeyPair("worker", Make("worker", &ca_));
    SaveKeyPair("client", Make("client", &ca_));
    SaveKeyPair("other", Make("worker of another cluster", &other_ca_));
    // From the right CA, but expired an hour ago, or valid only from an hour on.
    SaveKeyPair("expired", Make("expired", &ca_, false, absl::Hours(-2), absl::Hours(-1)));
    SaveKeyPair("not-yet-valid", Make("not yet valid", &ca_, false, absl::Hours(1), absl::Hours(2)));
  }
  void TearDown() override {
    for (auto& p : processes_) p->Kill();
    if (HasFailure()) {
      std::printf("[ logs     ] kept in %s\n", dir_.c_str());
      for (auto& p : processes_) std::printf("---- %s ----\n%s\n", p->log().c_str(), Tail(p->log()).c_str());
    } else {
      std::error_code ec;
      fs::remove_all(dir_, ec);
    }
  }

  PemKeyPair Make(const std::string& name, const PemKeyPair* issuer, bool is_ca = false,
                  absl::Duration not_before = absl::Minutes(-5), absl::Duration not_after = absl::Hours(24)) {
    return MakeTestCertificate(name, issuer, is_ca, not_before, not_after);
  }
  void Save(const std::string& name, const std::string& text) { WriteText(dir_ / name, text); }
  void SaveKeyPair(const std::string& name, const PemKeyPair& pair) {
    Save(name + ".key", pair.key);
    Save(name + ".pem", pair.cert);
  }
  std::string F(const std::string& name) const { return (dir_ / name).string(); }
  TlsFiles Files(const std::string& identity, const std::string& ca = "ca.pem") const {
    TlsFiles t;
    if (!identity.empty()) {
      t.cert = F(identity + ".pem");
      t.key = F(identity + ".key");
    }
    if (!ca.empty()) t.ca = F(ca);
    return t;
  }

  // Starts a coordinator for 1 node x `workers` of the fixture with `flags`; its address, or empty
  // (with a failure) when it did not start listening.
  std::string StartCoordinator(int workers, const std::vector<std::string>& flags) {
    const fs::path port_file = dir_ / "port";
    std::vector<std::string> argv = {SHARDSERVE_COORDINATOR_BIN, "--model", (kFixtures / kFixture).string(),
                                     "--listen", "127.0.0.1:0", "--nodes", "1", "--gpus-per-node",
                                     std::to_string(workers), "--port-file", port_file.string(), "--metrics-listen",
                                     "127.0.0.1:0"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    coordinator_ = Spawn(argv, "coordinator.log");
    const auto start = Clock::now();
    while (!fs::exists(port_file)) {
      if (!coordinator_->running() || SecondsSince(start) > 30) {
        ADD_FAILURE() << "the coordinator did not start listening";
        return "";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    int port = 0;
    std::ifstream(port_file) >> port;
    metrics_url_ = LoggedAddress(coordinator_->log(), "metrics on ", ' ');
    return "127.0.0.1:" + std::to_string(port);
  }

  Process* Spawn(const std::vector<std::string>& argv, const std::string& log) {
    processes_.push_back(std::make_unique<Process>(argv, dir_ / log));
    return processes_.back().get();
  }

  Process* StartWorker(const std::string& address, const std::string& name, const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {SHARDSERVE_WORKER_BIN, "--coordinator", address, "--node", "n0", "--listen",
                                     "127.0.0.1:0", "--memory-gb", "4", "--threads", "1", "--matmul-dtype", "f32"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    return Spawn(argv, name + ".log");
  }

  std::vector<std::string> TlsFlags(const std::string& identity, const std::string& ca = "ca.pem") const {
    return {"--tls-cert", F(identity + ".pem"), "--tls-key", F(identity + ".key"), "--tls-ca", F(ca)};
  }

  static std::shared_ptr<grpc::Channel> Channel(const std::string& address, const TlsFiles& tls) {
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = MakeChannelCredentials(tls);
    EXPECT_TRUE(creds.ok()) << creds.status();
    return grpc::CreateChannel(address, creds.ok() ? *creds : grpc::InsecureChannelCredentials());
  }

  // A channel that presents `identity`'s certificate as it is and trusts ca.pem. Unlike Channel
  // (MakeChannelCredentials, which refuses an expired certificate before dialling), nothing is
  // checked here: how a peer with a stale certificate looks to a server.
  std::shared_ptr<grpc::Channel> UncheckedChannel(const std::string& address, const std::string& identity) const {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = ReadText(dir_ / "ca.pem");
    options.pem_cert_chain = ReadText(dir_ / (identity + ".pem"));
    options.pem_private_key = ReadText(dir_ / (identity + ".key"));
    return grpc::CreateChannel(address, grpc::SslCredentials(options));
  }

  // A worker's Register on the control stream of `channel`: the status the stream ends with, and
  // whether the coordinator answered at all.
  static grpc::Status Register(const std::shared_ptr<grpc::Channel>& channel, bool* answered) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto stream = v1::WorkerControl::NewStub(channel)->Connect(&context);
    v1::WorkerMessage hello;
    hello.mutable_register_()->set_protocol_version(v1::PROTOCOL_VERSION_CURRENT);
    hello.mutable_register_()->set_node("n0");
    hello.mutable_register_()->set_device("cpu");
    hello.mutable_register_()->set_memory_bytes(int64_t{4} << 30);
    stream->Write(hello);
    stream->WritesDone();
    v1::CoordinatorMessage reply;
    *answered = stream->Read(&reply);
    return stream->Finish();
  }

  static grpc::health::v1::HealthCheckResponse::ServingStatus Health(const std::shared_ptr<grpc::Channel>& channel,
                                                                     grpc::Status* status = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status s =
        grpc::health::v1::Health::NewStub(channel)->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
    if (status != nullptr) *status = s;
    return s.ok() ? response.status() : grpc::health::v1::HealthCheckResponse::UNKNOWN;
  }

  // Polls until `pred` holds, at most `seconds`.
  template <typename Pred>
  static bool WaitFor(Pred pred, double seconds) {
    const auto start = Clock::now();
    while (!pred()) {
      if (SecondsSince(start) > seconds) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return true;
  }

  fs::path dir_;
  PemKeyPair ca_, other_ca_;
  std::vector<std::unique_ptr<Process>> processes_;
  Process* coordinator_ = nullptr;
  std::string metrics_url_;  // http://host:port/metrics, or https://
};

TEST_F(TlsTest, MutualTlsClusterStreamsAndRefusesWorkersWithoutTheCaCertificate) {
  const std::string address = StartCoordinator(2, TlsFlags("server"));
  ASSERT_FALSE(address.empty());
  auto client = Channel(address, Files("client"));
  StartWorker(address, "worker0", TlsFlags("worker"));

  // A worker with a certificate from another CA: the coordinator refuses it at the handshake, and
  // the worker gives up with an error that names TLS.
  Process* other2 = StartWorker(address, "worker-other-ca-2",
                                {"--tls-cert", F("other.pem"), "--tls-key", F("other.key"), "--tls-ca", F("ca.pem"),
                                 "--connect-timeout-seconds", "3"});
  EXPECT_EQ(other2->Wait(std::chrono::seconds(60)), 1);
  EXPECT_NE(ReadText(other2->log()).find("TLS handshake"), std::string::npos) << ReadText(other2->log());

  // A peer that trusts the CA but presents no certificate: TLS connects (the client API takes
  // such clients), Connect and the rendezvous refuse it before anything is read.
  auto anonymous = Channel(address, Files("", "ca.pem"));
  auto control = v1::WorkerControl::NewStub(anonymous);
  {
    bool answered = false;
    const grpc::Status s = Register(anonymous, &answered);
    EXPECT_FALSE(answered) << "the coordinator answered a worker without a certificate";
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  }
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::RendezvousSetRequest request;
    request.set_key("g0/rank0");
    request.set_value("x");
    v1::RendezvousSetResponse response;
    EXPECT_EQ(control->RendezvousSet(&context, request, &response).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_NE(ReadText(coordinator_->log()).find("refused Connect: no client certificate"), std::string::npos);

  // None of them took the second slot: the group still waits, with one worker.
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ClusterStatus status;
    ASSERT_TRUE(v1::InferenceService::NewStub(client)->GetClusterStatus(&context, {}, &status).ok());
    EXPECT_LE(status.workers_size(), 1) << status.DebugString();
    EXPECT_NE(Health(client), grpc::health::v1::HealthCheckResponse::SERVING);
  }

  // The right second worker completes the group, which serves over TLS. It also serves its health
  // in plaintext on --health-listen (for Kubernetes' gRPC probes, which speak no TLS).
  std::vector<std::string> worker1_flags = TlsFlags("worker");
  worker1_flags.insert(worker1_flags.end(), {"--health-listen", "127.0.0.1:0"});
  Process* worker1 = StartWorker(address, "worker1", worker1_flags);
  ASSERT_TRUE(WaitFor([&] { return Health(client) == grpc::health::v1::HealthCheckResponse::SERVING; }, 120));
  const Golden golden = LoadGolden(kFixture);
  auto stub = v1::InferenceService::NewStub(client);
  const Streamed r = Generate(stub.get(), TokenRequest(golden.prompt, static_cast<int>(golden.greedy.size())));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, golden.greedy);

  // The workers' own ports are mutual TLS only: no certificate from the CA, no connection.
  const std::string worker_port = LoggedAddress(processes_[1]->log(), ", listening on ", ',');
  ASSERT_FALSE(worker_port.empty());
  EXPECT_EQ(Health(Channel(worker_port, Files("client"))), grpc::health::v1::HealthCheckResponse::SERVING);
  grpc::Status refused;
  Health(Channel(worker_port, Files("", "ca.pem")), &refused);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  Health(Channel(worker_port, Files("other", "ca.pem")), &refused);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  // ... except its --health-listen port, which answers the same status to anyone in plaintext.
  const std::string health_port = LoggedAddress(worker1->log(), "plaintext health on ", ' ');
  ASSERT_FALSE(health_port.empty()) << ReadText(worker1->log());
  EXPECT_NE(health_port, LoggedAddress(worker1->log(), ", listening on ", ','));
  EXPECT_EQ(Health(grpc::CreateChannel(health_port, grpc::InsecureChannelCredentials())),
            grpc::health::v1::HealthCheckResponse::SERVING);

  // A stranger holding a certificate of the cluster's CA (here the client's) but no rendezvous
  // token of an Assignment: mutual TLS lets it in, the rendezvous does not. It can neither publish
  // a key nobody has published yet (a rank's address in the next epoch's group) nor read the
  // group's addresses; a forged token fares the same. Refusals are logged with the peer and counted.
  {
    auto stranger = v1::WorkerControl::NewStub(Channel(address, Files("client")));
    for (const std::string& token : {std::string(), "0." + std::string(64, '0')}) {
      grpc::ClientContext set_context;
      set_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      v1::RendezvousSetRequest set;
      set.set_key("e2/tp/stage0/gloo/1");
      set.set_value("the stranger's address");
      set.set_token(token);
      v1::RendezvousSetResponse set_response;
      const grpc::Status set_status = stranger->RendezvousSet(&set_context, set, &set_response);
      EXPECT_EQ(set_status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << set_status.error_message();
      EXPECT_NE(set_status.error_message().find("rendezvous key 'e2/tp/stage0/gloo/1' refused"), std::string::npos)
          << set_status.error_message();
      grpc::ClientContext get_context;
      get_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      v1::RendezvousGetRequest get;
      get.set_key("e1/tp/stage0/gloo/0");
      get.set_token(token);
      v1::RendezvousGetResponse get_response;
      const grpc::Status get_status = stranger->RendezvousGet(&get_context, get, &get_response);
      EXPECT_EQ(get_status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << get_status.error_message();
      EXPECT_TRUE(get_response.value().empty());
    }
    const std::string log = ReadText(coordinator_->log());
    EXPECT_NE(log.find("RendezvousSet of rendezvous key 'e2/tp/stage0/gloo/1' refused: the call carries no "
                       "rendezvous token"),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("refused: the rendezvous token is unknown"), std::string::npos) << log;
  }

  // A plaintext client against the TLS port: a clear UNAVAILABLE within its deadline, not a hang.
  grpc::Status plain;
  const auto start = Clock::now();
  EXPECT_EQ(Health(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()), &plain),
            grpc::health::v1::HealthCheckResponse::UNKNOWN);
  EXPECT_EQ(plain.error_code(), grpc::StatusCode::UNAVAILABLE) << plain.error_message();
  EXPECT_LT(SecondsSince(start), 30);

  // /metrics is HTTPS with the coordinator's certificate: scraped with the CA, refused without it.
  ASSERT_EQ(metrics_url_.rfind("https://127.0.0.1:", 0), 0u) << metrics_url_;
  const auto [untrusted_rc, untrusted] = Fetch(metrics_url_, F("other-ca.pem"));
  EXPECT_NE(untrusted_rc, 0) << untrusted;
  EXPECT_NE(untrusted.find("CERTIFICATE_VERIFY_FAILED"), std::string::npos) << untrusted;
  const auto [plain_rc, plain_answer] = Fetch("http://" + metrics_url_.substr(8));
  EXPECT_NE(plain_rc, 0) << "plain HTTP against the HTTPS /metrics port got an answer: " << plain_answer;
  const std::string metrics = Scrape(metrics_url_, F("ca.pem"));
  EXPECT_GE(MetricValue(metrics, "shardserve_auth_failures_total{model=\"llama_gqa\",reason=\"no_client_certificate\"}"),
            2)
      << metrics;
  // The four calls of the stranger above, and none from the workers forming their groups.
  EXPECT_EQ(MetricValue(metrics, "shardserve_auth_failures_total{model=\"llama_gqa\",reason=\"rendezvous_denied\"}"),
            4)
      << metrics;
}

TEST_F(TlsTest, ExpiredAndNotYetValidCertificatesFromTheCaAreRefusedOnBothPorts) {
  const std::string address = StartCoordinator(2, TlsFlags("server"));
  ASSERT_FALSE(address.empty());
  Process* worker = StartWorker(address, "worker0", TlsFlags("worker"));
  std::string worker_port;
  ASSERT_TRUE(WaitFor(
      [&] { return !(worker_port = LoggedAddress(worker->log(), ", listening on ", ',')).empty(); }, 30));
  auto client = Channel(address, Files("client"));
  ASSERT_TRUE(WaitFor([&] { return Health(client) != grpc::health::v1::HealthCheckResponse::UNKNOWN; }, 30));
  // The worker's port takes the CA's valid certificates (the control for the refusals below).
  grpc::Status taken;
  Health(UncheckedChannel(worker_port, "client"), &taken);
  EXPECT_TRUE(taken.ok()) << taken.error_message();

  for (const std::string identity : {"expired", "not-yet-valid"}) {
    SCOPED_TRACE(identity);
    // As a worker on the coordinator's port: refused at the handshake, before Register is read.
    bool answered = false;
    const grpc::Status registered = Register(UncheckedChannel(address, identity), &answered);
    EXPECT_FALSE(answered);
    EXPECT_EQ(registered.error_code(), grpc::StatusCode::UNAVAILABLE) << registered.error_message();
    // As a client (a peer worker, the coordinator) of the worker's own port: no connection either.
    grpc::Status refused;
    EXPECT_EQ(Health(UncheckedChannel(worker_port, identity), &refused), grpc::health::v1::HealthCheckResponse::UNKNOWN);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  }
  // Neither took the second slot: the group still has the one worker.
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ClusterStatus status;
  ASSERT_TRUE(v1::InferenceService::NewStub(client)->GetClusterStatus(&context, {}, &status).ok());
  EXPECT_EQ(status.workers_size(), 1) << status.DebugString();
  // Both servers log each refusal: the coordinator in its own words (security/tls.h
  // ReportTlsRefusals), the worker as gRPC words it. OpenSSL's server side does not say which of
  // the two it was (the refused client sees only "Socket closed").
  EXPECT_TRUE(WaitFor(
      [&] {
        return Count(ReadText(coordinator_->log()),
                     "server: refused a peer's certificate: it does not verify against --tls-ca (from another CA, "
                     "expired, or not valid yet)") == 2;
      },
      5))
      << ReadText(coordinator_->log());
  EXPECT_TRUE(WaitFor([&] { return Count(ReadText(worker->log()), "certificate verify failed") == 2; }, 5))
      << ReadText(worker->log());
}

TEST_F(TlsTest, TheCaFileIsReReadWhenItChanges) {
  // The usual rotation: the old CA, then a bundle of the old and the new, then the new alone.
  fs::copy_file(dir_ / "ca.pem", dir_ / "live-ca.pem");
  const std::string address = StartCoordinator(1, TlsFlags("server", "live-ca.pem"));
  ASSERT_FALSE(address.empty());
  // The coordinator's port asks for a certificate and verifies one given against --tls-ca; the
  // server's own certificate stays from ca.pem throughout.
  auto reaches = [&](const std::string& identity) {
    grpc::Status s;
    Health(UncheckedChannel(address, identity), &s);  // a new channel: a new handshake
    return s.ok();
  };
  ASSERT_TRUE(WaitFor([&] { return reaches("client"); }, 30));
  EXPECT_FALSE(reaches("other"));
  Save("live-ca.pem", ca_.cert + other_ca_.cert);
  EXPECT_TRUE(WaitFor([&] { return reaches("other"); }, 30)) << "the CA bundle was not picked up";
  EXPECT_TRUE(reaches("client"));
  Save("live-ca.pem", other_ca_.cert);
  EXPECT_TRUE(WaitFor([&] { return !reaches("client"); }, 30)) << "the old CA was still trusted";
  EXPECT_TRUE(reaches("other"));
}

TEST_F(TlsTest, ATlsMismatchIsNamedOnBothSides) {
  // A worker with `flags` against the coordinator at `address` stops within seconds (not after its
  // --connect-timeout-seconds 20) with a message that says `expected`.
  auto stops_saying = [&](const std::string& address, std::vector<std::string> flags, const std::string& name,
                          const std::string& expected) {
    flags.insert(flags.end(), {"--connect-timeout-seconds", "20"});
    const auto start = Clock::now();
    Process* worker = StartWorker(address, name, flags);
    EXPECT_EQ(worker->Wait(std::chrono::seconds(30)), 1);
    EXPECT_LT(SecondsSince(start), 10);
    EXPECT_NE(ReadText(worker->log()).find(expected), std::string::npos) << ReadText(worker->log());
  };
  // A plaintext worker dialling a TLS coordinator; the coordinator logs it too.
  std::string address = StartCoordinator(1, TlsFlags("server"));
  ASSERT_FALSE(address.empty());
  stops_saying(address, {}, "worker-plaintext",
               "TLS mismatch: the coordinator at " + address + " speaks TLS and this worker plaintext: give the "
               "worker --tls-ca");
  EXPECT_TRUE(WaitFor(
      [&] {
        return ReadText(coordinator_->log()).find("TLS mismatch: a peer spoke plaintext to this TLS port") !=
               std::string::npos;
      },
      10))
      << ReadText(coordinator_->log());

  // A TLS worker dialling a plaintext coordinator. (The plaintext coordinator cannot tell: gRPC
  // drops a connection whose first bytes are not HTTP/2 without a word.)
  coordinator_->Kill();
  fs::remove(dir_ / "port");
  address = StartCoordinator(1, {});
  ASSERT_FALSE(address.empty());
  stops_saying(address, TlsFlags("worker"), "worker-tls",
               "TLS mismatch: the coordinator at " + address + " speaks plaintext (no TLS) and this worker TLS");
}

TEST_F(TlsTest, ApiKeysGuardTheClientApiAndAreReReadWhenTheFileChanges) {
  const std::string key = "sk-test-0123456789abcdef", new_key = "sk-rotated-fedcba9876543210";
  Save("keys.txt", "# the test's keys\n" + key + "\n\n");
  const std::string address = StartCoordinator(1, {"--api-keys-file", F("keys.txt")});
  ASSERT_FALSE(address.empty());
  StartWorker(address, "worker0", {});
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  // Health checks need no key.
  ASSERT_TRUE(WaitFor([&] { return Health(channel) == grpc::health::v1::HealthCheckResponse::SERVING; }, 120));

  auto stub = v1::InferenceService::NewStub(channel);
  auto model_info = [&](const std::string& authorization) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!authorization.empty()) context.AddMetadata("authorization", authorization);
    v1::ModelInfo info;
    return stub->GetModelInfo(&context, {}, &info);
  };
  EXPECT_EQ(model_info("").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(model_info("Bearer wrong").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(model_info(key).error_code(), grpc::StatusCode::UNAUTHENTICATED);  // no scheme
  EXPECT_TRUE(model_info("Bearer " + key).ok());
  {
    // Generate: refused without a key, streams with it.
    grpc::ClientContext context;
    auto reader = stub->Generate(&context, TokenRequest({1, 2, 3}, 2));
    v1::GenerateResponse m;
    EXPECT_FALSE(reader->Read(&m));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer " + key);
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = stub->Generate(&context, TokenRequest({1, 2, 3}, 4));
    v1::GenerateResponse m;
    int tokens = 0;
    while (reader->Read(&m)) tokens += m.token_ids_size();
    EXPECT_TRUE(reader->Finish().ok());
    EXPECT_EQ(tokens, 4);
  }
  // The CLI sends --api-key, or SHARDSERVE_API_KEY.
  const std::string cli = std::string(SHARDSERVE_CLI_BIN) + " generate --insecure --address " + address +
                          " --prompt-ids 1,2,3 --max-tokens 2 --ignore-eos";
  EXPECT_EQ(Shell(cli + " --api-key " + key).first, 0);
  EXPECT_EQ(Shell("SHARDSERVE_API_KEY=" + key + " " + cli).first, 0);
  const auto [rc, out] = Shell(cli);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find("UNAUTHENTICATED"), std::string::npos) << out;

  ASSERT_EQ(metrics_url_.rfind("http://127.0.0.1:", 0), 0u) << metrics_url_;  // no certificate: plain HTTP
  const std::string metrics = Scrape(metrics_url_);
  EXPECT_GE(MetricValue(metrics, "shardserve_auth_failures_total{model=\"llama_gqa\",reason=\"missing_key\"}"), 3)
      << metrics;
  EXPECT_GE(MetricValue(metrics, "shardserve_auth_failures_total{model=\"llama_gqa\",reason=\"invalid_key\"}"), 1)
      << metrics;

  // Rotation: the file now holds only the new key; within a few seconds the old one is refused.
  Save("keys.txt", new_key + "\n");
  EXPECT_TRUE(WaitFor([&] { return model_info("Bearer " + new_key).ok(); }, 30));
  EXPECT_EQ(model_info("Bearer " + key).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // An emptied file keeps the keys it had (and is not a way to open the server), and the
  // coordinator says so, once. A request makes it look at the file (at most once a second).
  Save("keys.txt", "\n");
  const std::string kept =
      "--api-keys-file " + F("keys.txt") + ": no key in the file; keeping the 1 key(s) read before";
  EXPECT_TRUE(WaitFor(
      [&] {
        model_info("Bearer " + new_key);
        return ReadText(coordinator_->log()).find(kept) != std::string::npos;
      },
      30))
      << ReadText(coordinator_->log());
  EXPECT_TRUE(model_info("Bearer " + new_key).ok());
  EXPECT_EQ(model_info("").error_code(), grpc::StatusCode::UNAUTHENTICATED);

  const std::string log = ReadText(coordinator_->log());
  EXPECT_EQ(Count(log, kept), 1) << "the kept keys were reported more than once: " << log;
  EXPECT_EQ(log.find(key), std::string::npos) << "a key reached the log";
  EXPECT_EQ(log.find(new_key), std::string::npos) << "a key reached the log";
}

TEST_F(TlsTest, CertificateFilesAreReReadWhenTheyChange) {
  // Plain TLS (no --tls-ca) on the coordinator; clients verify it with the CA they are given.
  fs::copy_file(dir_ / "server.pem", dir_ / "live.pem");
  fs::copy_file(dir_ / "server.key", dir_ / "live.key");
  const std::string address = StartCoordinator(1, {"--tls-cert", F("live.pem"), "--tls-key", F("live.key")});
  ASSERT_FALSE(address.empty());
  auto reaches = [&](const std::string& ca) {
    grpc::Status s;
    Health(Channel(address, Files("", ca)), &s);  // a new channel: a new handshake
    return s.ok();
  };
  // /metrics serves the same certificate over HTTPS (httplib, security/https.h), also re-read.
  auto scrapes = [&](const std::string& ca) { return Fetch(metrics_url_, F(ca)).first == 0; };
  // (gRPC's file watcher hands the server its first certificate on its own thread: allow it a moment.)
  ASSERT_TRUE(WaitFor([&] { return reaches("ca.pem"); }, 30));
  EXPECT_FALSE(reaches("other-ca.pem"));
  EXPECT_TRUE(scrapes("ca.pem")) << Fetch(metrics_url_, F("ca.pem")).second;
  EXPECT_FALSE(scrapes("other-ca.pem"));
  // Replace the key, then the certificate, by another CA's (each by a rename, as docs/security.md says).
  PemKeyPair next = Make("rotated coordinator", &other_ca_);
  Save("live.key", next.key);
  Save("live.pem", next.cert);
  EXPECT_TRUE(WaitFor([&] { return reaches("other-ca.pem"); }, 30)) << "the new certificate was not picked up";
  EXPECT_FALSE(reaches("ca.pem"));
  EXPECT_TRUE(WaitFor([&] { return scrapes("other-ca.pem"); }, 30))
      << "/metrics did not pick up the new certificate: " << Fetch(metrics_url_, F("other-ca.pem")).second;
  EXPECT_FALSE(scrapes("ca.pem"));
}

TEST_F(TlsTest, BadCertificatesAndPlaintextBeyondLoopbackAreClearStartErrors) {
  const std::vector<std::string> base = {SHARDSERVE_COORDINATOR_BIN, "--model", (kFixtures / kFixture).string(),
                                         "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"};
  auto run = [&](std::vector<std::string> extra, const std::string& log) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), extra.begin(), extra.end());
    Process* p = Spawn(argv, log);
    const int rc = p->Wait(std::chrono::seconds(60));
    return std::make_pair(rc, ReadText(p->log()));
  };
  {
    const auto [rc, log] = run({"--tls-cert", F("expired.pem"), "--tls-key", F("expired.key")}, "expired.log");
    EXPECT_EQ(rc, 1);
    EXPECT_NE(log.find("--tls-cert " + F("expired.pem") + ": the certificate"), std::string::npos) << log;
    EXPECT_NE(log.find("has expired"), std::string::npos) << log;
  }
  {
    const auto [rc, log] = run({"--tls-cert", F("server.pem"), "--tls-key", F("worker.key")}, "mismatch.log");
    EXPECT_EQ(rc, 1);
    EXPECT_NE(log.find("is not the key of the certificate"), std::string::npos) << log;
  }
  {
    const auto [rc, log] = run({"--tls-cert", F("missing.pem"), "--tls-key", F("server.key")}, "missing.log");
    EXPECT_EQ(rc, 1);
    EXPECT_NE(log.find("missing.pem: cannot read the file"), std::string::npos) << log;
  }
  {
    const auto [rc, log] = run({"--tls-cert", F("server.pem")}, "half.log");
    EXPECT_EQ(rc, 2);
    EXPECT_NE(log.find("--tls-cert needs --tls-key"), std::string::npos) << log;
  }
  {
    const auto [rc, log] = run({"--listen", "0.0.0.0:0"}, "wildcard.log");
    EXPECT_EQ(rc, 2);
    EXPECT_NE(log.find("give --tls-cert and --tls-key"), std::string::npos) << log;
    EXPECT_NE(log.find("--insecure"), std::string::npos) << log;
  }
  // /metrics beyond loopback in plain HTTP: without a certificate, or with one and --metrics-plaintext.
  for (const bool with_cert : {false, true}) {
    std::vector<std::string> extra = {"--metrics-listen", "0.0.0.0:0"};
    if (with_cert) extra.insert(extra.end(), {"--tls-cert", F("server.pem"), "--tls-key", F("server.key"),
                                              "--metrics-plaintext"});
    const auto [rc, log] = run(extra, with_cert ? "metrics-plaintext.log" : "metrics-wildcard.log");
    EXPECT_EQ(rc, 2);
    EXPECT_NE(log.find("--metrics-listen 0.0.0.0:0 is reachable beyond this machine"), std::string::npos) << log;
    EXPECT_NE(log.find("--insecure"), std::string::npos) << log;
  }
  {
    // A worker with an expired certificate stops before dialling.
    Process* w = StartWorker("127.0.0.1:1", "worker-expired", TlsFlags("expired"));
    EXPECT_EQ(w->Wait(std::chrono::seconds(60)), 1);
    EXPECT_NE(ReadText(w->log()).find("has expired"), std::string::npos) << ReadText(w->log());
  }
}

TEST_F(TlsTest, LaunchIsMutualTlsByDefaultAndClientCommandsNeedNoFlags) {
  const fs::path state = dir_ / "state";
  setenv("SHARDSERVE_STATE_DIR", state.c_str(), 1);
  Process* launch = Spawn({SHARDSERVE_CLI_BIN, "launch", "--model", (kFixtures / kFixture).string(), "--nodes", "1",
                           "--gpus-per-node", "1", "--address", "127.0.0.1:0", "--metrics-port-base", "0",
                           "--worker-threads", "1", "--log-dir", (dir_ / "launch-logs").string()},
                          "launch.log");
  unsetenv("SHARDSERVE_STATE_DIR");
  const std::string env = "SHARDSERVE_STATE_DIR=" + state.string() + " ";
  const std::string cli = env + SHARDSERVE_CLI_BIN;
  ASSERT_TRUE(WaitFor([&] { return ReadText(launch->log()).find("ready.") != std::string::npos || !launch->running(); },
                      120));
  ASSERT_TRUE(launch->running());
  const nlohmann::json file = nlohmann::json::parse(ReadText(state / "cluster.json"));
  const std::string address = file["address"];
  struct stat st;
  ASSERT_EQ(stat(file["key"].get<std::string>().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_NE(ReadText(dir_ / "launch-logs" / "commands.sh").find("--tls-ca"), std::string::npos);

  // No flags: the address and the TLS files come from cluster.json.
  const auto [rc, out] = Shell(cli + " generate --prompt-ids 1,2,3 --max-tokens 3 --ignore-eos");
  EXPECT_EQ(rc, 0) << out;
  const auto [src, sout] = Shell(cli + " status");
  EXPECT_EQ(src, 0) << sout;
  EXPECT_NE(sout.find("SERVING"), std::string::npos) << sout;
  // --address naming the same cluster uses the file's TLS too; --insecure goes plaintext and fails.
  EXPECT_EQ(Shell(cli + " status --address " + address).first, 0);
  const auto [irc, iout] = Shell(cli + " status --insecure --address " + address);
  EXPECT_EQ(irc, 1) << iout;

  kill(launch->pid(), SIGTERM);  // launch alone: it stops its processes itself
  EXPECT_EQ(launch->Wait(std::chrono::seconds(60)), 0);
  EXPECT_FALSE(fs::exists(state / "cluster.json"));
  EXPECT_FALSE(fs::exists(fs::path(file["ca"].get<std::string>()).parent_path()));

  // A cluster.json left by a launch that was killed (its pid is gone) is ignored: the commands do
  // not try its (missing) certificate files.
  Process* gone = Spawn({"/bin/true"}, "true.log");
  ASSERT_EQ(gone->Wait(std::chrono::seconds(10)), 0);
  WriteText(state / "cluster.json", nlohmann::json({{"address", "127.0.0.1:1"},
                                                    {"ca", F("missing-ca.pem")},
                                                    {"cert", F("missing.pem")},
                                                    {"key", F("missing.key")},
                                                    {"pid", gone->pid()}})
                                        .dump());
  const auto [grc, gout] = Shell(cli + " status --address 127.0.0.1:1");  // the file's address
  EXPECT_EQ(grc, 1) << gout;
  EXPECT_EQ(gout.find("missing"), std::string::npos) << gout;
  EXPECT_NE(gout.find("cannot reach the coordinator at 127.0.0.1:1"), std::string::npos) << gout;
}

}  // namespace
}  // namespace shardserve
