// The rendezvous store the workers' collectives form their groups through, on the coordinator
// (RendezvousTable, served by WorkerControlService's RendezvousSet/Get) and as the workers reach it
// (GrpcRendezvousStore), over a real gRPC server on 127.0.0.1 in this process: keys are written
// once per epoch (the first writer wins; a second writer with another value is refused with
// ALREADY_EXISTS and logged with its address; the same value again is a retry and passes), and
// the bounds on keys and values.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "coordinator/server/worker_control_service.h"
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

// WorkerControlService on 127.0.0.1 (plaintext: this test is about the store, tls_test about who
// may reach it); its Connect is not used, so it has no pool.
class RendezvousServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    // Two peers, each with its own channel.
    for (int i = 0; i < 2; ++i) {
      channels_[i] = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
      stubs_[i] = v1::WorkerControl::NewStub(channels_[i]);
      stores_[i] = std::make_unique<GrpcRendezvousStore>(stubs_[i].get(), absl::Seconds(30));
    }
  }
  void TearDown() override {
    service_.Shutdown();
    server_->Shutdown();
  }

  WorkerControlService service_{/*pool=*/nullptr};
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channels_[2];
  std::unique_ptr<v1::WorkerControl::Stub> stubs_[2];
  std::unique_ptr<GrpcRendezvousStore> stores_[2];
};

TEST_F(RendezvousServiceTest, ASecondPeerCannotOverwriteAKeyOfTheEpoch) {
  const std::string key = "e3/tp/stage1/gloo/1";
  ASSERT_TRUE(stores_[0]->Set(key, "the rank's address").ok());
  ::testing::internal::CaptureStderr();
  const absl::Status hijack = stores_[1]->Set(key, "another peer's address");
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(hijack.code(), absl::StatusCode::kAlreadyExists) << hijack;
  EXPECT_THAT(hijack.message(), HasSubstr("'" + key + "' is already set"));
  // Logged with the peer's address and the key.
  EXPECT_THAT(log, HasSubstr("worker at ipv4:127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("refused RendezvousSet: rendezvous key '" + key + "' is already set"));
  // Every peer still reads the first writer's value; a retry with that value passes.
  for (auto& store : stores_) {
    absl::StatusOr<std::string> value = store->Get(key, absl::Seconds(30));
    ASSERT_TRUE(value.ok()) << value.status();
    EXPECT_EQ(*value, "the rank's address");
  }
  EXPECT_TRUE(stores_[0]->Set(key, "the rank's address").ok());
}

}  // namespace
}  // namespace shardserve
