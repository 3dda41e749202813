// The rendezvous store the workers' collectives form their groups through, on the coordinator
// (RendezvousTable, served by WorkerControlService's RendezvousSet/Get) and as the workers reach it
// (GrpcRendezvousStore), over a real gRPC server on 127.0.0.1 in this process: keys are written
// once per epoch (the first writer wins; a second write with another value is refused with
// ALREADY_EXISTS and logged with its address; the same value again is a retry and passes), the
// bounds on keys and values, and who may write and read which key (RendezvousGrants: a key only
// from the rank it names, only to its group's members, PERMISSION_DENIED naming the key otherwise).
#include <grpcpp/create_channel.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <array>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "coordinator/cluster/rendezvous_grants.h"
#include "coordinator/cluster/worker_control_service.h"
#include "worker/grpc_rendezvous.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;

const absl::Time kSoon = absl::InfinitePast();  // Get deadlines that are already over
auto never = [] { return false; };

TEST(RendezvousTableTest, AKeyIsWrittenOnceAndTheFirstWriterWins) {
  RendezvousTable table;
  ASSERT_TRUE(table.Set("e1/tp/stage0/gloo/0", "rank 0 at 10.0.0.5:4000").ok());
  const absl::Status second = table.Set("e1/tp/stage0/gloo/0", "rank 0 at 10.6.6.6:4000");
  EXPECT_EQ(second.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(second.message(), HasSubstr("'e1/tp/stage0/gloo/0' is already set"));
  // The same value again: a retried Set whose reply was lost.
  EXPECT_TRUE(table.Set("e1/tp/stage0/gloo/0", "rank 0 at 10.0.0.5:4000").ok());
  absl::StatusOr<std::string> value = table.Get("e1/tp/stage0/gloo/0", kSoon, never);
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "rank 0 at 10.0.0.5:4000");
  // The next epoch's group has its own keys.
  EXPECT_TRUE(table.Set("e2/tp/stage0/gloo/0", "rank 0 at 10.0.0.7:4000").ok());
  EXPECT_EQ(*table.Get("e2/tp/stage0/gloo/0", kSoon, never), "rank 0 at 10.0.0.7:4000");
  EXPECT_EQ(*table.Get("e1/tp/stage0/gloo/0", kSoon, never), "rank 0 at 10.0.0.5:4000");
}

TEST(RendezvousTableTest, BoundsKeysAndValues) {
  RendezvousTable table;
  EXPECT_EQ(table.Set("", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Set(std::string(1025, 'k'), "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Set("k", std::string(64 * 1024 + 1, 'v')).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Get("missing", kSoon, never).status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(RendezvousGrantsTest, AKeyIsWrittenOnlyByTheRankItNamesAndReadOnlyByItsGroup) {
  RendezvousGrants grants;
  // TP2 x PP2, epoch 1: worker 0 is stage 0 rank 0 (TP group e1/tp/stage0, sends on the pair
  // e1/pp/tp0/stage0-1), worker 3 is stage 1 tp rank 1 (receives on e1/pp/tp1/stage0-1).
  Slot s0, s3;
  s0.tp_group = "e1/tp/stage0";
  s0.send_group = "e1/pp/tp0/stage0-1";
  s3.stage = 1;
  s3.tp_rank = 1;
  s3.tp_group = "e1/tp/stage1";
  s3.recv_group = "e1/pp/tp1/stage0-1";
  const std::string t0 = grants.Grant(0, "worker w0", 1, RendezvousGroupsOf(s0));
  const std::string t3 = grants.Grant(3, "worker w3", 1, RendezvousGroupsOf(s3));
  EXPECT_NE(t0, t3);
  EXPECT_TRUE(grants.CheckSet(t0, "e1/tp/stage0/gloo/0").ok());
  EXPECT_TRUE(grants.CheckSet(t0, "e1/tp/stage0/gloo/rank_0").ok());
  EXPECT_TRUE(grants.CheckSet(t0, "e1/tp/stage0/nccl/unique_id").ok());  // NCCL's id: rank 0's
  EXPECT_TRUE(grants.CheckSet(t0, "e1/pp/tp0/stage0-1/gloo/0").ok());    // the sender is rank 0 of its pair
  EXPECT_TRUE(grants.CheckSet(t3, "e1/tp/stage1/gloo/1").ok());
  EXPECT_TRUE(grants.CheckSet(t3, "e1/pp/tp1/stage0-1/gloo/rank_1").ok());  // the receiver is rank 1
  EXPECT_TRUE(grants.CheckGet(t0, "e1/tp/stage0/gloo/1").ok());
  EXPECT_TRUE(grants.CheckGet(t3, "e1/pp/tp1/stage0-1/gloo/0").ok());

  auto denied = [](const absl::Status& s, const std::string& why) {
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(s.message(), HasSubstr(why)) << s;
  };
  // Another rank's key of its own group.
  denied(grants.CheckSet(t0, "e1/tp/stage0/gloo/1"), "belongs to rank 1 of group 'e1/tp/stage0'");
  denied(grants.CheckSet(t0, "e1/tp/stage0/gloo/rank_1"), "and worker w0 holds rank 0");
  denied(grants.CheckSet(t3, "e1/tp/stage1/nccl/unique_id"), "belongs to rank 0");
  denied(grants.CheckSet(t3, "e1/pp/tp1/stage0-1/gloo/0"), "belongs to rank 0 of group 'e1/pp/tp1/stage0-1'");
  // Keys of other groups, of another epoch, or that name no rank.
  denied(grants.CheckSet(t0, "e1/tp/stage1/gloo/0"), "worker w0 is not a member of the key's group under epoch 1");
  denied(grants.CheckGet(t0, "e1/tp/stage1/gloo/1"), "'e1/tp/stage1/gloo/1' refused");
  denied(grants.CheckGet(t3, "e1/pp/tp0/stage0-1/gloo/0"), "not a member");
  denied(grants.CheckSet(t0, "e2/tp/stage0/gloo/0"), "not a member");
  denied(grants.CheckSet(t0, "e1/tp/stage0x/gloo/0"), "not a member");
  denied(grants.CheckGet(t0, "e1/tp/stage0"), "not a member");
  for (const char* key : {"e1/tp/stage0/other", "e1/tp/stage0/gloo/", "e1/tp/stage0/gloo/0x", "e1/tp/stage0/gloo/-0",
                          "e1/tp/stage0/gloo/rank_", "e1/tp/stage0/nccl/unique_id2"}) {
    denied(grants.CheckSet(t0, key), "names no rank of group 'e1/tp/stage0'");
  }
  // No token, a malformed one, another worker's index with this one's secret, a guessed secret.
  denied(grants.CheckSet("", "e1/tp/stage0/gloo/0"), "carries no rendezvous token");
  denied(grants.CheckGet("", "e1/tp/stage0/gloo/0"), "RendezvousGet of rendezvous key 'e1/tp/stage0/gloo/0'");
  denied(grants.CheckSet("nonsense", "e1/tp/stage0/gloo/0"), "malformed");
  const std::string secret0 = t0.substr(t0.find('.') + 1);
  denied(grants.CheckSet("3." + secret0, "e1/tp/stage1/gloo/1"), "unknown or no longer valid");
  denied(grants.CheckSet("0." + std::string(secret0.size(), '0'), "e1/tp/stage0/gloo/0"), "unknown");
  denied(grants.CheckSet("0." + secret0.substr(1), "e1/tp/stage0/gloo/0"), "unknown");
  EXPECT_THAT(t0, ::testing::MatchesRegex("0\\.[0-9a-f]{64}"));

  // A Regroup's grant replaces the previous one: the old epoch's keys are no longer its own.
  Slot next = s0;
  next.tp_group = "e2/tp/stage0";
  next.send_group = "e2/pp/tp0/stage0-1";
  const std::string t0b = grants.Grant(0, "worker w0", 2, RendezvousGroupsOf(next));
  EXPECT_TRUE(grants.CheckSet(t0b, "e2/tp/stage0/gloo/0").ok());
  denied(grants.CheckSet(t0, "e2/tp/stage0/gloo/0"), "no longer valid");
  denied(grants.CheckGet(t0b, "e1/tp/stage0/gloo/1"), "under epoch 2");
  // A revoked worker (its stream ended) has no grant.
  grants.Revoke(0);
  denied(grants.CheckGet(t0b, "e2/tp/stage0/gloo/0"), "no longer valid");
  EXPECT_TRUE(grants.CheckGet(t3, "e1/tp/stage1/gloo/0").ok());
}

// WorkerControlService on 127.0.0.1 (plaintext: this test is about the store and its grants,
// tls_test about who may reach it); its Connect is not used, so it has no pool: the test grants
// the tokens the pool's Assignments would carry. Peers 0 and 1 are ranks 0 and 1 of group A
// (e3/tp/stage1), peer 2 is rank 0 of group B (e3/tp/stage2), and peer 3 a stranger with no token.
class RendezvousServiceTest : public ::testing::Test {
 protected:
  static constexpr int kPeers = 4;
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    tokens_ = {
        grants_.Grant(0, "worker a0", 3, {{"e3/tp/stage1", 0}}),
        grants_.Grant(1, "worker a1", 3, {{"e3/tp/stage1", 1}}),
        grants_.Grant(2, "worker b0", 3, {{"e3/tp/stage2", 0}}),
        "",
    };
    // Each peer with its own channel.
    for (int i = 0; i < kPeers; ++i) {
      channels_[i] = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
      stubs_[i] = v1::WorkerControl::NewStub(channels_[i]);
      stores_[i] = std::make_unique<GrpcRendezvousStore>(stubs_[i].get(), tokens_[i], absl::Seconds(30));
    }
  }
  void TearDown() override {
    service_.Shutdown();
    server_->Shutdown();
  }

  RendezvousGrants grants_;
  std::array<std::string, kPeers> tokens_;
  WorkerControlService service_{/*pool=*/nullptr, /*require_client_certificate=*/false, /*metrics=*/nullptr, &grants_};
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channels_[kPeers];
  std::unique_ptr<v1::WorkerControl::Stub> stubs_[kPeers];
  std::unique_ptr<GrpcRendezvousStore> stores_[kPeers];
};

TEST_F(RendezvousServiceTest, AKeyOfTheEpochIsWrittenOnceByItsRank) {
  const std::string key = "e3/tp/stage1/gloo/1";
  ASSERT_TRUE(stores_[1]->Set(key, "the rank's address").ok());
  ::testing::internal::CaptureStderr();
  const absl::Status again = stores_[1]->Set(key, "another address");
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;
  EXPECT_THAT(again.message(), HasSubstr("'" + key + "' is already set"));
  // Logged with the peer's address and the key.
  EXPECT_THAT(log, HasSubstr("worker at ipv4:127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("refused RendezvousSet: rendezvous key '" + key + "' is already set"));
  // Both members read the first value; a retry with that value passes.
  for (int i : {0, 1}) {
    absl::StatusOr<std::string> value = stores_[i]->Get(key, absl::Seconds(30));
    ASSERT_TRUE(value.ok()) << value.status();
    EXPECT_EQ(*value, "the rank's address");
  }
  EXPECT_TRUE(stores_[1]->Set(key, "the rank's address").ok());
}

TEST_F(RendezvousServiceTest, AWorkerOfGroupACannotWriteOrReadGroupBsKeysNorAnotherRanks) {
  const std::string a0 = "e3/tp/stage1/gloo/0", a1 = "e3/tp/stage1/gloo/1", b0 = "e3/tp/stage2/gloo/0";
  ASSERT_TRUE(stores_[0]->Set(a0, "a0's address").ok());
  ASSERT_TRUE(stores_[2]->Set(b0, "b0's address").ok());
  auto denied = [](const absl::Status& s, const std::string& key, const std::string& why) {
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(s.message(), HasSubstr("rendezvous key '" + key + "' refused: " + why)) << s;
  };
  ::testing::internal::CaptureStderr();
  // Group A's rank 0 may not publish rank 1's address (nobody has yet: the hole mutual TLS left).
  denied(stores_[0]->Set(a1, "a0 posing as a1"), a1, "the key belongs to rank 1 of group 'e3/tp/stage1'");
  // Group B's worker may neither write into group A nor read its addresses.
  denied(stores_[2]->Set(a1, "b0 posing as a1"), a1, "worker b0 is not a member of the key's group");
  denied(stores_[2]->Get(a0, absl::Seconds(30)).status(), a0, "worker b0 is not a member");
  // ... nor group A's into group B.
  denied(stores_[0]->Get(b0, absl::Seconds(30)).status(), b0, "worker a0 is not a member");
  denied(stores_[1]->Set("e3/tp/stage2/gloo/rank_1", "x"), "e3/tp/stage2/gloo/rank_1", "worker a1 is not a member");
  // A stranger without a token: neither.
  denied(stores_[3]->Set(a1, "stranger"), a1, "the call carries no rendezvous token");
  denied(stores_[3]->Get(a0, absl::Seconds(30)).status(), a0, "the call carries no rendezvous token");
  // A revoked token (its worker's stream ended) is refused too.
  grants_.Revoke(1);
  denied(stores_[1]->Set(a1, "a1's address"), a1, "the rendezvous token is unknown or no longer valid");
  const std::string log = ::testing::internal::GetCapturedStderr();
  // Each refusal logged with the peer's address, naming the key (and never a token).
  EXPECT_THAT(log, HasSubstr("worker at ipv4:127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("RendezvousSet of rendezvous key '" + a1 + "' refused: the key belongs to rank 1"));
  EXPECT_THAT(log, HasSubstr("RendezvousGet of rendezvous key '" + a0 + "' refused: worker b0 is not a member"));
  for (int i : {0, 1, 2}) EXPECT_THAT(log, ::testing::Not(HasSubstr(tokens_[i].substr(2, 16))));
  // Nothing was written by the refused calls: a1's key is still free for its rank (re-granted).
  stores_[1] = std::make_unique<GrpcRendezvousStore>(stubs_[1].get(), grants_.Grant(1, "worker a1", 3, {{"e3/tp/stage1", 1}}),
                                                     absl::Seconds(30));
  ASSERT_TRUE(stores_[1]->Set(a1, "a1's address").ok());
  EXPECT_EQ(*stores_[0]->Get(a1, absl::Seconds(30)), "a1's address");
  EXPECT_EQ(*stores_[1]->Get(a0, absl::Seconds(30)), "a0's address");
}

// Connect streams that say nothing: at most max_unregistered wait at once (the next is refused at
// once), each at most register_timeout (then cancelled), so that they cannot hold the coordinator's
// threads; meanwhile the service answers its other calls, and a stream that speaks is served.
int ThreadCount() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

TEST(ConnectStreamsTest, SilentStreamsAreCappedAndTimedOut) {
  constexpr int kCap = 8;
  constexpr int kSilent = 200;
  RendezvousGrants grants;
  WorkerControlService service(/*pool=*/nullptr, /*require_client_certificate=*/false, /*metrics=*/nullptr, &grants,
                               ConnectLimits{.max_unregistered = kCap, .register_timeout = absl::Seconds(5)});
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  auto stub = v1::WorkerControl::NewStub(channel);
  const std::string token = grants.Grant(0, "worker a0", 1, {{"e1/tp/stage0", 0}});
  GrpcRendezvousStore store(stub.get(), token, absl::Seconds(30));
  ASSERT_TRUE(store.Set("e1/tp/stage0/gloo/0", "before").ok());
  const int threads_before = ThreadCount();

  // kSilent streams open and say nothing.
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>>> streams;
  for (int i = 0; i < kSilent; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    streams.push_back(stub->Connect(contexts.back().get()));
  }
  // While they wait: the cap holds, threads stay few (the waiting streams' and their watchdogs', and
  // gRPC's own, which it adds for a burst of calls: 24 to 32 seen, against over 200 with every
  // stream let wait), and the other calls are served.
  for (int i = 0; i < 100 && service.unregistered_connects() < kCap; ++i) absl::SleepFor(absl::Milliseconds(20));
  absl::SleepFor(absl::Seconds(1));  // the other streams' calls arrive (well within the 5 s timeout)
  EXPECT_EQ(service.unregistered_connects(), kCap);
  EXPECT_LE(ThreadCount() - threads_before, 8 * kCap) << "threads before: " << threads_before;
  EXPECT_TRUE(store.Set("e1/tp/stage0/gloo/rank_0", "during").ok());
  // The rest were refused at once, saying why; the waiting ones are ended by the timeout.
  int refused = 0, cancelled = 0;
  for (int i = 0; i < kSilent; ++i) {
    v1::CoordinatorMessage m;
    EXPECT_FALSE(streams[i]->Read(&m));
    const grpc::Status s = streams[i]->Finish();
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      EXPECT_THAT(s.error_message(), ::testing::HasSubstr("waiting for their first message (at most 8)"));
      ++refused;
    } else {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
      ++cancelled;
    }
  }
  EXPECT_EQ(refused, kSilent - kCap);
  EXPECT_EQ(cancelled, kCap);
  // (A client sees its stream cancelled a moment before the handler has counted it out.)
  for (int i = 0; i < 500 && service.unregistered_connects() > 0; ++i) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(service.unregistered_connects(), 0);
  // A stream that speaks is served (here: refused for its first message, which must be register).
  grpc::ClientContext speaks;
  auto stream = stub->Connect(&speaks);
  v1::WorkerMessage heartbeat;
  heartbeat.mutable_heartbeat();
  ASSERT_TRUE(stream->Write(heartbeat));
  v1::CoordinatorMessage bye;
  while (stream->Read(&bye)) {
  }
  const grpc::Status spoke = stream->Finish();
  EXPECT_EQ(spoke.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << spoke.error_message();
  EXPECT_THAT(spoke.error_message(), ::testing::HasSubstr("must be register"));
  service.Shutdown();
  server->Shutdown();
}

}  // namespace
}  // namespace shardserve
