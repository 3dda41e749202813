// The coordinator's console log: one line per event on stderr, with a timestamp and its subject
// (a request id, a worker, or the group), e.g.
//   2025-01-31 12:00:00.123 coordinator req-000007: finished (length): 12 + 32 tokens, 41.3 tok/s
// Only what a person needs: workers joining and lost, the plan, requests starting, finishing and
// failing; never one line per token.
//
// Thread-safe: each line is written with one call, so lines from different threads do not mix.
#ifndef SHARDSERVE_COORDINATOR_SERVER_LOG_H_
#define SHARDSERVE_COORDINATOR_SERVER_LOG_H_

#include "absl/strings/string_view.h"

namespace shardserve {

void CoordinatorLog(absl::string_view subject, absl::string_view message);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_SERVER_LOG_H_
