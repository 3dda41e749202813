// What the client subcommands (generate, status, launch) share: the default address and the
// channel to the coordinator.
#ifndef SHARDSERVE_TOOLS_CLI_CLIENT_H_
#define SHARDSERVE_TOOLS_CLI_CLIENT_H_

#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"

namespace shardserve::cli {

// Every client command connects here unless --address says otherwise; `launch` serves here.
inline constexpr char kDefaultAddress[] = "localhost:50051";

inline std::shared_ptr<grpc::Channel> ConnectToCoordinator(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

}  // namespace shardserve::cli

#endif  // SHARDSERVE_TOOLS_CLI_CLIENT_H_
