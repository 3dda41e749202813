#include "worker/comm/rendezvous.h"

#include "absl/strings/str_cat.h"

namespace shardserve {

absl::Status InMemoryRendezvousStore::Set(const std::string& key, const std::string& value) {
  absl::MutexLock lock(&mu_);
  if (auto it = values_.find(key); it != values_.end()) {
    if (it->second == value) return absl::OkStatus();
    return absl::AlreadyExistsError(absl::StrCat("rendezvous key '", key, "' is already set to another value"));
  }
  values_[key] = value;
  key_added_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryRendezvousStore::Get(const std::string& key, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  auto it = values_.find(key);
  while (it == values_.end()) {
    const bool timed_out = key_added_.WaitWithDeadline(&mu_, deadline);
    it = values_.find(key);
    if (timed_out && it == values_.end()) {
      return absl::DeadlineExceededError(
          absl::StrCat("rendezvous key '", key, "' was not set within ", absl::FormatDuration(timeout)));
    }
  }
  return it->second;
}

}  // namespace shardserve
