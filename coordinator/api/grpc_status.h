// absl::Status -> grpc::Status, at the service edge only. The canonical codes are the same
// numbers in both libraries; the message passes unchanged.
#ifndef SHARDSERVE_COORDINATOR_API_GRPC_STATUS_H_
#define SHARDSERVE_COORDINATOR_API_GRPC_STATUS_H_

#include <string>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace shardserve {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_API_GRPC_STATUS_H_
