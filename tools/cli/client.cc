#include "tools/cli/client.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <grpcpp/support/client_interceptor.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "security/api_keys.h"
#include "security/certificates.h"

namespace shardserve::cli {
namespace {

// Adds "authorization: Bearer <key>" to every call's initial metadata. (Call credentials would
// do it too, but gRPC sends none over plaintext channels; a key on loopback without TLS is allowed.)
class ApiKeyInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit ApiKeyInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({kAuthorizationMetadata, *header_});
    }
    methods->Proceed();
  }

 private:
  const std::string* const header_;
};

class ApiKeyInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit ApiKeyInterceptorFactory(const std::string& key) : header_(absl::StrCat("Bearer ", key)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new ApiKeyInterceptor(&header_);
  }

 private:
  const std::string header_;  // lives as long as the channel (which owns the factory)
};

}  // namespace

const char kClientFlagsUsage[] =
    "  --address HOST:PORT   the coordinator (default localhost:50051)\n"
    "  --tls-ca FILE         speak TLS, verifying the coordinator's certificate with this CA\n"
    "  --tls-cert, --tls-key present this client certificate and key (PEM)\n"
    "  --api-key KEY         the server's API key (default: $SHARDSERVE_API_KEY)\n"
    "  --insecure            plaintext even when the local cluster file says TLS\n"
    "  Without --tls-* or --insecure, the local cluster file of `shardserve launch` gives the CA and\n"
    "  client certificate (and the address, when --address is absent): see docs/security.md.\n";

std::set<std::string> ClientFlagNames() { return {"address", "tls-ca", "tls-cert", "tls-key", "api-key"}; }

absl::StatusOr<ClientOptions> ClientOptionsFromFlags(const Flags& flags) {
  ClientOptions o;
  absl::StatusOr<TlsFiles> tls = TlsFilesFromFlags(flags);
  if (!tls.ok()) return tls.status();
  const bool insecure = flags.Has(kInsecureFlag);
  if (insecure && tls->any()) return absl::InvalidArgumentError("flag --insecure excludes --tls-ca, --tls-cert and --tls-key");
  o.address = flags.Get("address", kDefaultAddress);
  o.tls = *tls;
  if (!insecure && !tls->any()) {
    if (std::optional<LocalClusterFile> local = ReadLocalClusterFile()) {
      if (!flags.Has("address") || flags.Get("address") == local->address) {
        o.address = local->address;
        o.tls = local->tls;
      }
    }
  }
  if (flags.Has("api-key")) {
    o.api_key = flags.Get("api-key");
  } else if (const char* env = std::getenv(kApiKeyEnv); env != nullptr) {
    o.api_key = env;
  }
  return o;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> ConnectToCoordinator(const ClientOptions& options) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = MakeChannelCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  // gRPC's default reconnect backoff grows to 120 s: a client that starts before its coordinator
  // listens (launch's health checks, a command run while the coordinator restarts) would then see
  // it serve only minutes later. A local control client retries at least once a second instead.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  if (options.api_key.empty()) return grpc::CreateCustomChannel(options.address, *credentials, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<ApiKeyInterceptorFactory>(options.api_key));
  return grpc::experimental::CreateCustomChannelWithInterceptors(options.address, *credentials, args,
                                                                 std::move(interceptors));
}

std::string StateDir() {
  if (const char* dir = std::getenv("SHARDSERVE_STATE_DIR"); dir != nullptr && *dir != '\0') return dir;
  if (const char* dir = std::getenv("XDG_RUNTIME_DIR"); dir != nullptr && *dir != '\0') {
    return absl::StrCat(dir, "/shardserve");
  }
  const char* home = std::getenv("HOME");
  return absl::StrCat(home != nullptr ? home : "/tmp", "/.shardserve/local");
}

std::string LocalClusterFilePath() { return absl::StrCat(StateDir(), "/cluster.json"); }

absl::Status WriteLocalClusterFile(const LocalClusterFile& file) {
  // The state directory may not exist yet (a new SHARDSERVE_STATE_DIR, or --insecure, which makes no
  // certificates there first): made as launch makes it for the certificates, for its owner only.
  std::error_code ec;
  if (std::filesystem::create_directories(StateDir(), ec)) {
    std::filesystem::permissions(StateDir(), std::filesystem::perms::owner_all, ec);
  }
  const nlohmann::json j = {{"address", file.address}, {"ca", file.tls.ca},   {"cert", file.tls.cert},
                            {"key", file.tls.key},     {"pid", file.pid}};
  return WriteFileAtomically(LocalClusterFilePath(), j.dump(2) + "\n", 0600);
}

std::optional<LocalClusterFile> ReadLocalClusterFile() {
  const std::string path = LocalClusterFilePath();
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  LocalClusterFile f;
  if (!j.is_object() || !j.value("address", nlohmann::json()).is_string()) {
    std::fprintf(stderr, "shardserve: ignoring %s: not a local cluster file\n", path.c_str());
    return std::nullopt;
  }
  const auto str = [&](const char* name) {
    const nlohmann::json& v = j.value(name, nlohmann::json());
    return v.is_string() ? v.get<std::string>() : std::string();
  };
  f.address = str("address");
  f.tls.ca = str("ca");
  f.tls.cert = str("cert");
  f.tls.key = str("key");
  const nlohmann::json& pid = j.value("pid", nlohmann::json());
  f.pid = pid.is_number_integer() ? pid.get<int64_t>() : 0;
  // Left behind by a launch that was killed (SIGKILL skips its clean-up): not a cluster any more.
  if (f.pid > 0 && kill(static_cast<pid_t>(f.pid), 0) != 0 && errno == ESRCH) return std::nullopt;
  return f;
}

void RemoveLocalClusterFile(int64_t pid) {
  std::optional<LocalClusterFile> f = ReadLocalClusterFile();
  if (f.has_value() && f->pid == pid) std::remove(LocalClusterFilePath().c_str());
}

}  // namespace shardserve::cli
