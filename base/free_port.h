// A loopback port for a server that must be told its port (the coordinator's --http-port, where 0
// means off), for `shardserve bench --compare` and the tests.
//
// A port found by binding port 0 and releasing it comes from the kernel's ephemeral range
// (net.ipv4.ip_local_port_range), the range every later bind to port 0 and every outgoing
// connection takes its port from: a server told to listen on it may find it taken (seen in CI: a
// coordinator's /metrics, bound to port 0, got the port just picked for its HTTP API). So the port
// comes from outside that range, drawn at random and checked by binding, and is claimed with a file
// in $TMPDIR/shardserve-ports (an exclusive create) so that two processes picking at once never
// pick the same one; a claim older than ten minutes is stale. tools/ci/ports.py is the Python twin,
// with the same range, directory and claims.
#ifndef SHARDSERVE_BASE_FREE_PORT_H_
#define SHARDSERVE_BASE_FREE_PORT_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utime.h>

#include <cerrno>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace shardserve {
namespace free_port_internal {

inline constexpr int kLowest = 10000;  // below: well-known services and our defaults (8000, 9400...)
inline constexpr time_t kClaimSeconds = 600;

inline std::pair<int, int> EphemeralRange() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  if (in >> low >> high && low > 0 && high >= low) return {low, high};
  return {32768, 60999};  // Linux's default
}

inline bool Bindable(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// Whether this process now holds the claim on `port`: a fresh file, or a stale one renewed (true
// also where the directory cannot be written: the bind check alone).
inline bool Claim(int port) {
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/shardserve-ports");
  if (mkdir(dir.c_str(), 01777) != 0 && errno != EEXIST) return true;
  const std::string path = absl::StrCat(dir, "/", port);
  const int fd = open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
  if (fd >= 0) {
    close(fd);
    return true;
  }
  if (errno != EEXIST) return true;
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || std::time(nullptr) - st.st_mtime < kClaimSeconds) return false;
  return utime(path.c_str(), nullptr) == 0;  // stale: taken again
}

}  // namespace free_port_internal

// A TCP port of 127.0.0.1 outside the kernel's ephemeral range, bindable now and claimed by this
// process (see the header comment).
inline absl::StatusOr<int> FreeLoopbackPort() {
  using namespace free_port_internal;
  const auto [low, high] = EphemeralRange();
  std::vector<std::pair<int, int>> ranges;
  for (const auto& r : {std::pair(kLowest, low - 1), std::pair(high + 1, 65535)}) {
    if (r.second - r.first >= 1000) ranges.push_back(r);
  }
  if (ranges.empty()) ranges.push_back({kLowest, 65535});  // the bind check alone
  std::random_device seed;
  std::mt19937 rng(seed());
  std::vector<double> sizes;
  for (const auto& [first, last] : ranges) sizes.push_back(last - first + 1);
  std::discrete_distribution<size_t> pick_range(sizes.begin(), sizes.end());
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const auto& [first, last] = ranges[pick_range(rng)];
    const int port = std::uniform_int_distribution<int>(first, last)(rng);
    if (Bindable(port) && Claim(port)) return port;
  }
  return absl::UnavailableError(
      absl::StrCat("no free port on 127.0.0.1 outside the ephemeral range ", low, "-", high));
}

}  // namespace shardserve

#endif  // SHARDSERVE_BASE_FREE_PORT_H_
