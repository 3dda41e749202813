#include "coordinator/cluster/rendezvous_grants.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>

#include <cstdlib>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace shardserve {
namespace {

constexpr int kSecretBytes = 32;

absl::Status Denied(absl::string_view key, const char* what, absl::string_view why) {
  return absl::PermissionDeniedError(absl::StrCat(what, " of rendezvous key '", key, "' refused: ", why));
}

// The rank that may write `rest` (a key with its group's "<group>/" removed), or -1.
int WriterOf(absl::string_view rest) {
  if (rest == "nccl/unique_id") return 0;
  if (!absl::ConsumePrefix(&rest, "gloo/")) return -1;
  absl::ConsumePrefix(&rest, "rank_");
  int rank = -1;
  if (rest.empty() || rest.find_first_not_of("0123456789") != absl::string_view::npos ||
      !absl::SimpleAtoi(rest, &rank)) {
    return -1;
  }
  return rank;
}

}  // namespace

std::vector<GroupRank> RendezvousGroupsOf(const Slot& slot) {
  std::vector<GroupRank> groups;
  if (!slot.tp_group.empty()) groups.emplace_back(slot.tp_group, slot.tp_rank);
  if (!slot.send_group.empty()) groups.emplace_back(slot.send_group, 0);
  if (!slot.recv_group.empty()) groups.emplace_back(slot.recv_group, 1);
  return groups;
}

std::string RendezvousGrants::Grant(int worker, const std::string& name, uint64_t epoch,
                                    std::vector<GroupRank> groups) {
  unsigned char bytes[kSecretBytes];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    // OpenSSL's generator seeds itself from the OS; failing here means no secure randomness at all.
    std::abort();
  }
  Entry e;
  e.secret = absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
  e.name = name;
  e.epoch = epoch;
  e.groups = std::move(groups);
  std::string token = absl::StrCat(worker, ".", e.secret);
  absl::MutexLock lock(&mu_);
  grants_[worker] = std::move(e);
  return token;
}

void RendezvousGrants::Revoke(int worker) {
  absl::MutexLock lock(&mu_);
  grants_.erase(worker);
}

absl::StatusOr<const RendezvousGrants::Entry*> RendezvousGrants::Find(absl::string_view token, absl::string_view key,
                                                                      const char* what) {
  if (token.empty()) {
    return Denied(key, what,
                  "the call carries no rendezvous token (a worker gets one in each Assignment and Regroup over its "
                  "Connect stream)");
  }
  const size_t dot = token.find('.');
  int worker = -1;
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(token.substr(0, dot), &worker)) {
    return Denied(key, what, "the rendezvous token is malformed");
  }
  const absl::string_view secret = token.substr(dot + 1);
  auto it = grants_.find(worker);
  if (it == grants_.end() || secret.size() != it->second.secret.size() ||
      CRYPTO_memcmp(secret.data(), it->second.secret.data(), secret.size()) != 0) {
    return Denied(key, what,
                  "the rendezvous token is unknown or no longer valid (the worker was regrouped, reassigned or "
                  "disconnected)");
  }
  return &it->second;
}

const GroupRank* RendezvousGrants::GroupOf(const Entry& e, absl::string_view key) {
  const GroupRank* best = nullptr;
  for (const GroupRank& g : e.groups) {
    if (key.size() > g.first.size() && absl::StartsWith(key, g.first) && key[g.first.size()] == '/' &&
        (best == nullptr || g.first.size() > best->first.size())) {
      best = &g;
    }
  }
  return best;
}

absl::Status RendezvousGrants::CheckSet(absl::string_view token, absl::string_view key) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<const Entry*> e = Find(token, key, "RendezvousSet");
  if (!e.ok()) return e.status();
  const GroupRank* g = GroupOf(**e, key);
  if (g == nullptr) {
    return Denied(key, "RendezvousSet",
                  absl::StrCat((*e)->name, " is not a member of the key's group under epoch ", (*e)->epoch));
  }
  const int writer = WriterOf(key.substr(g->first.size() + 1));
  if (writer < 0) {
    return Denied(key, "RendezvousSet",
                  absl::StrCat("the key names no rank of group '", g->first,
                               "' (expected <group>/gloo/<rank>, <group>/gloo/rank_<rank> or <group>/nccl/unique_id)"));
  }
  if (writer != g->second) {
    return Denied(key, "RendezvousSet",
                  absl::StrCat("the key belongs to rank ", writer, " of group '", g->first, "' and ", (*e)->name,
                               " holds rank ", g->second));
  }
  return absl::OkStatus();
}

absl::Status RendezvousGrants::CheckGet(absl::string_view token, absl::string_view key) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<const Entry*> e = Find(token, key, "RendezvousGet");
  if (!e.ok()) return e.status();
  if (GroupOf(**e, key) == nullptr) {
    return Denied(key, "RendezvousGet",
                  absl::StrCat((*e)->name, " is not a member of the key's group under epoch ", (*e)->epoch));
  }
  return absl::OkStatus();
}

}  // namespace shardserve
