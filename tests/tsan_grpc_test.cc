// The check of tools/ci/tsan.supp's gRPC and protobuf entries (TSan builds only, tests/CMakeLists.txt):
// a test gRPC service on 127.0.0.1 in this process, whose handler two client calls run at once on
// two of gRPC's server threads. Each handler writes a variable of ours, then waits until both
// handlers have written (so the two writes are unordered: neither handler returns, so gRPC can
// order nothing between them). `tsan_grpc_test` writes it under an absl::Mutex and must draw no
// report ("both calls: ok"); `tsan_grpc_test race` writes it unguarded and must end in
// "WARNING: ThreadSanitizer: data race": the suppressions, which silence what TSan wrongly reports
// inside the uninstrumented gRPC and protobuf, do not hide a race of ours in a handler that gRPC
// calls. Both run with TSAN_OPTIONS naming tools/ci/tsan.supp.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

class TwoHandlersService final : public Health::Service {
 public:
  explicit TwoHandlersService(bool race) : race_(race) {}

  grpc::Status Check(grpc::ServerContext*, const HealthCheckRequest* request, HealthCheckResponse* response) override {
    if (race_) {
      writes_ += 1;  // the race: two handler threads, nothing of ours between them
    } else {
      absl::MutexLock lock(&mu_);
      guarded_writes_ += 1;
    }
    // Both handlers in flight before either returns (bounded: a server that ran the calls one
    // after the other would fail the check below instead of hanging).
    arrived_.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (arrived_.load() < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (arrived_.load() < 2) return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "the other handler never ran");
    response->set_status(request->service().empty() ? HealthCheckResponse::SERVING : HealthCheckResponse::UNKNOWN);
    return grpc::Status::OK;
  }

  int writes() {
    absl::MutexLock lock(&mu_);
    return race_ ? writes_ : guarded_writes_;
  }

 private:
  const bool race_;
  // Alone in its cache line: TSan keeps four accesses per 8 bytes, and accesses to a neighbour
  // (race_, read by both handlers) could push the first write out before the second is checked.
  alignas(64) int writes_ = 0;  // written unguarded by the handlers when race_
  absl::Mutex mu_;
  int guarded_writes_ = 0;  // guarded by mu_
  std::atomic<int> arrived_{0};
};

}  // namespace

int main(int argc, char** argv) {
  const bool race = argc > 1 && std::strcmp(argv[1], "race") == 0;
  TwoHandlersService service(race);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "tsan_grpc_test: the test server did not start on 127.0.0.1\n");
    return 1;
  }
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  std::unique_ptr<Health::Stub> stub = Health::NewStub(channel);
  grpc::Status statuses[2];
  HealthCheckResponse responses[2];
  std::thread calls[2];
  for (int i = 0; i < 2; ++i) {
    calls[i] = std::thread([&, i] {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      statuses[i] = stub->Check(&context, HealthCheckRequest(), &responses[i]);
    });
  }
  for (std::thread& t : calls) t.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
  for (int i = 0; i < 2; ++i) {
    if (!statuses[i].ok() || responses[i].status() != HealthCheckResponse::SERVING) {
      std::fprintf(stderr, "tsan_grpc_test: call %d failed: %s\n", i, statuses[i].error_message().c_str());
      return 1;
    }
  }
  const int writes = service.writes();
  std::printf("%d writes, both calls%s\n", writes, writes == 2 ? ": ok" : " but not 2 writes");
  return writes == 2 ? 0 : 1;
}
