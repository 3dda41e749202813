#include "coordinator/server/log.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardserve {

void CoordinatorLog(absl::string_view subject, absl::string_view message) {
  const std::string line = absl::StrCat(absl::FormatTime("%Y-%m-%d %H:%M:%E3S", absl::Now(), absl::LocalTimeZone()),
                                        " coordinator ", subject, ": ", message, "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace shardserve
