// The worker process's console log (telemetry/log.h): one line per event on stderr, with a
// timestamp and who speaks, e.g.
//   2025-01-31 12:00:00.123 worker w3 (node n1, stage 1, tp rank 0): loaded in 0.41 s: 1.2 MiB ...
// or one JSON object per line with --log-format=json (service "worker", and the worker, node,
// stage and rank as fields once known). Only what a person needs: connection, assignment, load,
// failures, shutdown; never per step.
//
// Thread-safe: each line is written with one call, so lines from different threads do not mix.
#ifndef SHARDSERVE_WORKER_WORKER_LOG_H_
#define SHARDSERVE_WORKER_WORKER_LOG_H_

#include "absl/strings/string_view.h"
#include "telemetry/log.h"

namespace shardserve {

inline void WorkerLog(absl::string_view who, absl::string_view message, const LogIds& ids = {}) {
  LogEvent("worker", "", who, message, ids);
}

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_WORKER_LOG_H_
