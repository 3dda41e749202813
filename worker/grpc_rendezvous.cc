#include "worker/grpc_rendezvous.h"

#include <grpcpp/client_context.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace shardserve {
namespace {

absl::Status RpcError(const char* rpc, const std::string& key, const grpc::Status& s) {
  return absl::UnavailableError(absl::StrCat(rpc, " of rendezvous key '", key, "' at the coordinator failed (gRPC code ",
                                             static_cast<int>(s.error_code()), "): ", s.error_message()));
}

}  // namespace

absl::Status GrpcRendezvousStore::Set(const std::string& key, const std::string& value) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + set_timeout_));
  v1::RendezvousSetRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_token(token_);
  v1::RendezvousSetResponse response;
  const grpc::Status s = stub_->RendezvousSet(&context, request, &response);
  if (s.error_code() == grpc::StatusCode::ALREADY_EXISTS) return absl::AlreadyExistsError(s.error_message());
  if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED) return absl::PermissionDeniedError(s.error_message());
  return s.ok() ? absl::OkStatus() : RpcError("RendezvousSet", key, s);
}

absl::StatusOr<std::string> GrpcRendezvousStore::Get(const std::string& key, absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::RendezvousGetRequest request;
  request.set_key(key);
  request.set_token(token_);
  v1::RendezvousGetResponse response;
  const grpc::Status s = stub_->RendezvousGet(&context, request, &response);
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::DeadlineExceededError(
        absl::StrCat("rendezvous key '", key, "' was not set within ", absl::FormatDuration(timeout)));
  }
  if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED) return absl::PermissionDeniedError(s.error_message());
  if (!s.ok()) return RpcError("RendezvousGet", key, s);
  return std::move(*response.mutable_value());
}

}  // namespace shardserve
