#include "telemetry/log.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardserve {
namespace {

std::atomic<LogFormat> g_format{LogFormat::kText};

}  // namespace

bool ParseLogFormat(absl::string_view name, LogFormat* format) {
  if (name == "text") {
    *format = LogFormat::kText;
  } else if (name == "json") {
    *format = LogFormat::kJson;
  } else {
    return false;
  }
  return true;
}

void SetLogFormat(LogFormat format) { g_format.store(format); }

std::string JsonQuote(absl::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out += c;  // UTF-8 passes through
        }
    }
  }
  out += "\"";
  return out;
}

void LogEvent(absl::string_view service, absl::string_view text_prefix, absl::string_view subject,
              absl::string_view message, const LogIds& ids) {
  const absl::Time now = absl::Now();
  std::string line;
  if (g_format.load() == LogFormat::kJson) {
    line = absl::StrCat("{\"ts\":", JsonQuote(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", now, absl::UTCTimeZone())),
                        ",\"level\":", JsonQuote(ids.level), ",\"service\":", JsonQuote(service),
                        ",\"subject\":", JsonQuote(subject));
    if (!ids.request_id.empty()) absl::StrAppend(&line, ",\"request_id\":", JsonQuote(ids.request_id));
    if (!ids.worker.empty()) absl::StrAppend(&line, ",\"worker\":", JsonQuote(ids.worker));
    if (!ids.node.empty()) absl::StrAppend(&line, ",\"node\":", JsonQuote(ids.node));
    if (ids.stage >= 0) absl::StrAppend(&line, ",\"stage\":", ids.stage);
    if (ids.rank >= 0) absl::StrAppend(&line, ",\"rank\":", ids.rank);
    absl::StrAppend(&line, ",\"message\":", JsonQuote(message), "}\n");
  } else {
    line = absl::StrCat(absl::FormatTime("%Y-%m-%d %H:%M:%E3S", now, absl::LocalTimeZone()), " ", text_prefix, subject,
                        ": ", message, "\n");
  }
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace shardserve
