#include "coordinator/cluster/worker_control_service.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "coordinator/api/grpc_status.h"
#include "coordinator/telemetry/log.h"
#include "security/tls.h"

namespace shardserve {
namespace {

// The longest a RendezvousGet waits, whatever deadline its caller set (or none).
constexpr absl::Duration kMaxRendezvousWait = absl::Minutes(10);

// A worker's Connect stream as the pool sees it. Lives on the Connect handler's stack.
class StreamLink final : public WorkerLink {
 public:
  StreamLink(grpc::ServerContext* context, grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream)
      : context_(context), stream_(stream) {}

  bool Send(const v1::CoordinatorMessage& message) override {
    absl::MutexLock lock(&mu_);
    return stream_->Write(message);
  }
  void Cancel() override { context_->TryCancel(); }

 private:
  grpc::ServerContext* const context_;
  grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* const stream_;
  absl::Mutex mu_;  // gRPC allows one writer at a time
};

}  // namespace

grpc::Status WorkerControlService::Authenticate(grpc::ServerContext* context, const char* call) {
  if (!require_client_certificate_ || PeerHasVerifiedCertificate(*context)) return grpc::Status::OK;
  CoordinatorLog(absl::StrCat("worker at ", context->peer()),
                 absl::StrCat("refused ", call, ": no client certificate from the cluster's CA (--tls-ca)"));
  if (metrics_ != nullptr) metrics_->AuthFailure("no_client_certificate");
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      absl::StrCat(call, " needs a client certificate from the coordinator's CA (mutual TLS): start "
                                         "the worker with --tls-cert and --tls-key from that CA"));
}

grpc::Status WorkerControlService::Authorize(grpc::ServerContext* context, const absl::Status& check) {
  if (check.ok()) return grpc::Status::OK;
  CoordinatorLog(absl::StrCat("worker at ", context->peer()), std::string(check.message()));
  if (metrics_ != nullptr) metrics_->AuthFailure("rendezvous_denied");
  return ToGrpcStatus(check);
}

int WorkerControlService::unregistered_connects() {
  absl::MutexLock lock(&mu_);
  return unregistered_;
}

grpc::Status WorkerControlService::Connect(
    grpc::ServerContext* context, grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) {
  if (grpc::Status auth = Authenticate(context, "Connect"); !auth.ok()) return auth;
  const std::string peer = context->peer();  // "unknown" once the call is cancelled
  {
    absl::MutexLock lock(&mu_);
    if (unregistered_ >= connect_limits_.max_unregistered) {
      const std::string why =
          absl::StrCat("refused a Connect stream: ", unregistered_,
                       " streams are already waiting for their first message (at most ", connect_limits_.max_unregistered, ")");
      CoordinatorLog(absl::StrCat("worker at ", peer), why);
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, why);
    }
    ++unregistered_;
  }
  // The first message within register_timeout, or the stream is cancelled (its Read then ends).
  v1::WorkerMessage message;
  absl::Notification first;
  std::atomic<bool> timed_out{false};
  std::thread watchdog([&] {
    if (!first.WaitForNotificationWithTimeout(connect_limits_.register_timeout)) {
      timed_out = true;
      context->TryCancel();
    }
  });
  const bool spoke = stream->Read(&message);
  first.Notify();
  watchdog.join();
  {
    absl::MutexLock lock(&mu_);
    --unregistered_;
  }
  if (!spoke) {
    if (!timed_out) return grpc::Status::OK;  // gone before it said anything
    CoordinatorLog(absl::StrCat("worker at ", peer),
                   absl::StrCat("closed a Connect stream that sent nothing for ",
                                absl::FormatDuration(connect_limits_.register_timeout)));
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "no register message in time");
  }
  StreamLink link(context, stream);
  absl::StatusOr<int> index =
      message.msg_case() == v1::WorkerMessage::kRegister
          ? pool_->Register(message.register_(), &link)
          : absl::InvalidArgumentError("the first message of a Connect stream must be register");
  if (!index.ok()) {
    CoordinatorLog(absl::StrCat("worker at ", context->peer()), absl::StrCat("refused: ", index.status().message()));
    v1::CoordinatorMessage bye;
    bye.mutable_shutdown()->set_reason(std::string(index.status().message()));
    link.Send(bye);
    return ToGrpcStatus(index.status());
  }
  while (stream->Read(&message)) pool_->OnMessage(*index, message);
  pool_->Disconnect(*index);
  if (grants_ != nullptr) grants_->Revoke(*index);  // its rendezvous token dies with its stream
  return grpc::Status::OK;
}

grpc::Status WorkerControlService::RendezvousSet(grpc::ServerContext* context, const v1::RendezvousSetRequest* request,
                                                 v1::RendezvousSetResponse*) {
  if (grpc::Status auth = Authenticate(context, "RendezvousSet"); !auth.ok()) return auth;
  if (grpc::Status allowed = Authorize(
          context, grants_ != nullptr ? grants_->CheckSet(request->token(), request->key())
                                      : absl::PermissionDeniedError("this coordinator grants no rendezvous"));
      !allowed.ok()) {
    return allowed;
  }
  const absl::Status s = table_.Set(request->key(), request->value());
  if (absl::IsAlreadyExists(s)) {
    // Another peer's address already stands under this key: a second writer is a confused or
    // hostile peer trying to take a rank's place in a collective group.
    CoordinatorLog(absl::StrCat("worker at ", context->peer()), absl::StrCat("refused RendezvousSet: ", s.message()));
  }
  return ToGrpcStatus(s);
}

grpc::Status WorkerControlService::RendezvousGet(grpc::ServerContext* context, const v1::RendezvousGetRequest* request,
                                                 v1::RendezvousGetResponse* response) {
  if (grpc::Status auth = Authenticate(context, "RendezvousGet"); !auth.ok()) return auth;
  if (grpc::Status allowed = Authorize(
          context, grants_ != nullptr ? grants_->CheckGet(request->token(), request->key())
                                      : absl::PermissionDeniedError("this coordinator grants no rendezvous"));
      !allowed.ok()) {
    return allowed;
  }
  const absl::Time deadline = std::min(absl::FromChrono(context->deadline()), absl::Now() + kMaxRendezvousWait);
  absl::StatusOr<std::string> value = table_.Get(request->key(), deadline, [&] {
    absl::MutexLock lock(&mu_);
    return shutting_down_ || context->IsCancelled();
  });
  if (!value.ok()) {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down");
    return ToGrpcStatus(value.status());
  }
  response->set_value(std::move(*value));
  return grpc::Status::OK;
}

void WorkerControlService::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
}

}  // namespace shardserve
