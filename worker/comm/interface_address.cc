#include "worker/comm/interface_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardserve {

absl::StatusOr<std::string> InterfaceAddress(const std::string& name) {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return absl::UnavailableError("cannot list this machine's network interfaces");
  std::string v4, v6;
  std::set<std::string> names;
  for (const ifaddrs* a = all; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    names.insert(a->ifa_name);
    if (name != a->ifa_name) continue;
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ifa_addr->sa_family == AF_INET && v4.empty()) {
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
      v4 = text;
    } else if (a->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&in6->sin6_addr)) continue;  // needs a scope id peers do not know
      inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
      v6 = text;
    }
  }
  freeifaddrs(all);
  if (!v4.empty()) return v4;
  if (!v6.empty()) return v6;
  return absl::NotFoundError(absl::StrCat("network interface '", name, "' ",
                                          names.count(name) ? "has no IPv4 or global IPv6 address"
                                                            : "does not exist",
                                          " (this machine has: ", absl::StrJoin(names, ", "), ")"));
}

}  // namespace shardserve
