// Membership::MonitorLoop: health watching. A worker that sends nothing, not even a heartbeat
// (worker.proto Heartbeat), for heartbeat_timeout is lost, which breaks the group.
#include "coordinator/cluster/membership.h"

#include <cstddef>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace shardserve {
namespace {

// How often the monitor looks for silent workers.
constexpr absl::Duration kMonitorPeriod = absl::Milliseconds(200);

}  // namespace

void Membership::MonitorLoop() {
  absl::MutexLock lock(&mu_);
  while (!stop_monitor_) {
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_monitor_), kMonitorPeriod)) break;
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < workers_.size(); ++i) {
      const Worker& w = *workers_[i];
      if (w.link == nullptr || w.state == v1::WORKER_STATE_LOST) continue;
      const absl::Duration silent = now - w.last_heard;
      if (silent > options_.heartbeat_timeout) {
        MarkLostLocked(static_cast<int>(i), LossCause::kHeartbeat,
                       absl::StrCat("sent nothing, not even a heartbeat, for ", absl::FormatDuration(silent),
                                    " (it is hung, stopped, or unreachable)"));
      }
    }
  }
}

}  // namespace shardserve
