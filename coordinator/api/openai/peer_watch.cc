#include "coordinator/api/openai/peer_watch.h"

#include <dirent.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstdlib>

namespace shardserve::openai {
namespace {

// The numeric address and port of `addr` (as httplib's getnameinfo with NI_NUMERICHOST writes them).
bool AddressOf(const sockaddr_storage& addr, socklen_t len, std::string* ip, int* port) {
  char host[NI_MAXHOST];
  char serv[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host, sizeof(host), serv, sizeof(serv),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return false;
  }
  *ip = host;
  *port = std::atoi(serv);
  return true;
}

bool Matches(int fd, const std::string& local_addr, int local_port, const std::string& remote_addr, int remote_port) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  std::string ip;
  int port = -1;
  // The peer first: most of this process's sockets (gRPC's, the listeners) fail the port test.
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 || !AddressOf(addr, len, &ip, &port) ||
      port != remote_port || ip != remote_addr) {
    return false;
  }
  len = sizeof(addr);
  return getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0 && AddressOf(addr, len, &ip, &port) &&
         port == local_port && ip == local_addr;
}

}  // namespace

std::optional<PeerWatch> PeerWatch::Find(const std::string& local_addr, int local_port, const std::string& remote_addr,
                                         int remote_port) {
  if (local_port <= 0 || remote_port <= 0) return std::nullopt;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return std::nullopt;
  std::optional<PeerWatch> found;
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd < 0 || fd == dirfd(dir)) continue;
    if (Matches(static_cast<int>(fd), local_addr, local_port, remote_addr, remote_port)) {
      found = PeerWatch(static_cast<int>(fd));
      break;
    }
  }
  closedir(dir);
  return found;
}

bool PeerWatch::Closed() const {
  pollfd p{fd_, POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace shardserve::openai
