#include "worker/worker_log.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardserve {

void WorkerLog(absl::string_view who, absl::string_view message) {
  const std::string line = absl::StrCat(absl::FormatTime("%Y-%m-%d %H:%M:%E3S", absl::Now(), absl::LocalTimeZone()),
                                        " ", who, ": ", message, "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace shardserve
