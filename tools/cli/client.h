// What the client subcommands (generate, status, bench, launch's own health checks) share: how to
// reach the coordinator. Every client command takes
//   --address HOST:PORT   the coordinator (default localhost:50051)
//   --tls-ca FILE         speak TLS and verify the coordinator's certificate with this CA
//   --tls-cert, --tls-key present this client certificate (PEM)
//   --api-key KEY         sent as 'authorization: Bearer KEY' (default: $SHARDSERVE_API_KEY)
//   --insecure            plaintext, whatever the local cluster file says
// With no --tls-* and no --insecure, a command reads the local cluster file that `shardserve
// launch` writes (LocalClusterFilePath: the address and the cluster's CA and client certificate),
// as kubectl reads its kubeconfig, and uses its TLS files when --address is absent or names the
// same address; so the commands in README.md need no flags against a (secure) local cluster.
#ifndef SHARDSERVE_TOOLS_CLI_CLIENT_H_
#define SHARDSERVE_TOOLS_CLI_CLIENT_H_

#include <memory>
#include <optional>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/flags.h"
#include "grpcpp/grpcpp.h"
#include "security/tls.h"

namespace shardserve::cli {

// Every client command connects here unless --address says otherwise; `launch` serves here.
inline constexpr char kDefaultAddress[] = "localhost:50051";

// Where a coordinator is and how to talk to it.
struct ClientOptions {
  std::string address = kDefaultAddress;
  TlsFiles tls;         // empty: plaintext
  std::string api_key;  // empty: none sent
};

// The flags ClientOptionsFromFlags reads that take a value, and its switch ("insecure").
std::set<std::string> ClientFlagNames();
inline constexpr char kInsecureFlag[] = "insecure";
// The usage lines of those flags, for a command's --help.
extern const char kClientFlagsUsage[];

// --address, --tls-*, --api-key, --insecure, $SHARDSERVE_API_KEY and the local cluster file.
// InvalidArgument for --tls-cert without --tls-key (and the reverse), or --insecure with --tls-*.
absl::StatusOr<ClientOptions> ClientOptionsFromFlags(const Flags& flags);

// A channel to the coordinator: TLS as `options` say (the files checked first: an unreadable or
// expired certificate is an error here, not a failed handshake later), with the API key added to
// every call.
absl::StatusOr<std::shared_ptr<grpc::Channel>> ConnectToCoordinator(const ClientOptions& options);

// ---- The local cluster file (written by `shardserve launch`) ----
// $SHARDSERVE_STATE_DIR, else $XDG_RUNTIME_DIR/shardserve, else ~/.shardserve/local: the
// directory of the local cluster file and of launch's certificates.
std::string StateDir();
// <StateDir()>/cluster.json: {"address", "ca", "cert", "key", "pid"}.
std::string LocalClusterFilePath();
struct LocalClusterFile {
  std::string address;
  TlsFiles tls;  // the CA and the client certificate
  int64_t pid = 0;  // the launch process
};
// Written atomically (0600).
absl::Status WriteLocalClusterFile(const LocalClusterFile& file);
// nullopt when there is no file, when the launch that wrote it is gone (killed before it could
// remove it), or when it cannot be parsed (then with a warning on stderr).
std::optional<LocalClusterFile> ReadLocalClusterFile();
// Removes the file if it still names this process (another launch may have replaced it).
void RemoveLocalClusterFile(int64_t pid);

}  // namespace shardserve::cli

#endif  // SHARDSERVE_TOOLS_CLI_CLIENT_H_
