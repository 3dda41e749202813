// The address of a network interface, found by its name: `shardserve-worker --collective-interface
// eth1` binds the collectives to that interface's address (docs/security.md: the collective ports
// carry no authentication, so they belong on the cluster's own network).
//
// Thread-safety: reentrant.
#ifndef SHARDSERVE_WORKER_COMM_INTERFACE_ADDRESS_H_
#define SHARDSERVE_WORKER_COMM_INTERFACE_ADDRESS_H_

#include <string>

#include "absl/status/statusor.h"

namespace shardserve {

// The address of the network interface `name` ("lo", "eth1"): its first IPv4 address, else its
// first global IPv6 one ("fd00::5"), as --collective-host takes a host. NotFound naming the
// interfaces this machine has when there is none of that name or it has no address.
absl::StatusOr<std::string> InterfaceAddress(const std::string& name);

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_COMM_INTERFACE_ADDRESS_H_
