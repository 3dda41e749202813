// The console log both services write: one line per event on stderr, with a timestamp, who speaks
// and its subject (a request id, a worker, the group), e.g.
//   2025-01-31 12:00:00.123 coordinator req-000007: finished (length): 12 + 32 tokens, 41.3 tok/s
//   2025-01-31 12:00:00.123 worker w3 (node n1, stage 1, tp rank 0): loaded in 0.41 s: ...
// or, after SetLogFormat(LogFormat::kJson) (--log-format=json), one JSON object per line:
//   {"ts":"2025-01-31T12:00:00.123Z","level":"info","service":"coordinator","subject":"req-000007",
//    "request_id":"req-000007","message":"finished (length): ..."}
// with the ids of LogIds that are set as fields (request_id, worker, node, stage, rank).
// Only what a person needs; never one line per token or per step.
//
// Thread-safe: each line is written with one call, so lines from different threads do not mix.
// Set the format once at start, before other threads log.
#ifndef SHARDSERVE_TELEMETRY_LOG_H_
#define SHARDSERVE_TELEMETRY_LOG_H_

#include <string>

#include "absl/strings/string_view.h"

namespace shardserve {

enum class LogFormat { kText, kJson };

// "text" or "json"; false for anything else.
bool ParseLogFormat(absl::string_view name, LogFormat* format);
void SetLogFormat(LogFormat format);

// The ids an event concerns; empty or negative ones are left out of a JSON line.
struct LogIds {
  std::string request_id;
  std::string worker;
  std::string node;
  int stage = -1;
  int rank = -1;
  const char* level = "info";  // "info", "warn" or "error"
};

// Writes one event. `service` is "coordinator" or "worker". In text, the line reads
// "<time> <text_prefix><subject>: <message>".
void LogEvent(absl::string_view service, absl::string_view text_prefix, absl::string_view subject,
              absl::string_view message, const LogIds& ids);

// `text` as a JSON string literal, quotes included.
std::string JsonQuote(absl::string_view text);

}  // namespace shardserve

#endif  // SHARDSERVE_TELEMETRY_LOG_H_
