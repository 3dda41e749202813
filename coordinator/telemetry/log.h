// The coordinator's console log (telemetry/log.h): one line per event on stderr, with a timestamp
// and its subject (a request id, a worker, or the group), e.g.
//   2025-01-31 12:00:00.123 coordinator req-000007: finished (length): 12 + 32 tokens, 41.3 tok/s
// or one JSON object per line with --log-format=json. Only what a person needs: workers joining
// and lost, the plan, requests starting, finishing and failing; never one line per token.
//
// Thread-safe: each line is written with one call, so lines from different threads do not mix.
#ifndef SHARDSERVE_COORDINATOR_TELEMETRY_LOG_H_
#define SHARDSERVE_COORDINATOR_TELEMETRY_LOG_H_

#include <string>

#include "absl/strings/string_view.h"
#include "telemetry/log.h"

namespace shardserve {

inline void CoordinatorLog(absl::string_view subject, absl::string_view message, const LogIds& ids = {}) {
  LogEvent("coordinator", "coordinator ", subject, message, ids);
}

// A request's event: its subject and request_id are `request_id`.
inline void CoordinatorRequestLog(const std::string& request_id, absl::string_view message,
                                  const char* level = "info") {
  LogIds ids;
  ids.request_id = request_id;
  ids.level = level;
  CoordinatorLog(request_id, message, ids);
}

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_TELEMETRY_LOG_H_
