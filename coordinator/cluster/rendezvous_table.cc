#include "coordinator/cluster/rendezvous_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace shardserve {
namespace {

// Rendezvous bounds: Gloo's keys are short and its values are a few hundred bytes of addresses
// per rank; NCCL's unique id is 128 bytes.
constexpr size_t kMaxKeyBytes = 1024;
constexpr size_t kMaxValueBytes = 64 * 1024;
constexpr size_t kMaxTableBytes = 64 * 1024 * 1024;
constexpr absl::Duration kCancelPoll = absl::Milliseconds(100);

}  // namespace

absl::Status RendezvousTable::Set(const std::string& key, const std::string& value) {
  if (key.empty() || key.size() > kMaxKeyBytes || value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous keys are 1 to ", kMaxKeyBytes,
                                                   " bytes and values at most ", kMaxValueBytes, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  if (auto it = values_.find(key); it != values_.end()) {
    // Written once: the first writer wins. The same value again is a retried Set (its reply lost).
    if (it->second == value) return absl::OkStatus();
    return absl::AlreadyExistsError(absl::StrCat("rendezvous key '", key,
                                                 "' is already set to another value; keys are written once per "
                                                 "epoch (the first writer wins)"));
  }
  if (bytes_ + key.size() + value.size() > kMaxTableBytes) {
    return absl::ResourceExhaustedError(absl::StrCat("the rendezvous table is full (", kMaxTableBytes, " bytes)"));
  }
  bytes_ += key.size() + value.size();
  values_[key] = value;
  set_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousTable::Get(const std::string& key, absl::Time deadline,
                                                 const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  for (;;) {
    if (auto it = values_.find(key); it != values_.end()) return it->second;
    if (cancelled()) return absl::CancelledError(absl::StrCat("rendezvous wait for key '", key, "' was cancelled"));
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("rendezvous key '", key, "' was not set in time"));
    }
    set_.WaitWithDeadline(&mu_, std::min(deadline, now + kCancelPoll));
  }
}

}  // namespace shardserve
