#include "worker/comm/host_cpus.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardserve {

std::string OversubscriptionNote(absl::Span<const RankCpus> ranks) {
  if (ranks.empty()) return "";
  cpu_set_t all;
  CPU_ZERO(&all);
  int64_t threads = 0;
  for (const RankCpus& r : ranks) {
    CPU_OR(&all, &all, &r.cpus);
    threads += r.threads;
  }
  const int cpus = CPU_COUNT(&all);
  if (threads <= cpus) return "";
  const int n = static_cast<int>(ranks.size());
  const int share = std::max(1, cpus / n);
  return absl::StrCat("the TP group's ", n, " ranks on this host run ", threads, " compute threads on its ", cpus,
                      " CPU", cpus == 1 ? "" : "s",
                      ": each collective waits on peers whose threads are descheduled behind spinning idle ones, "
                      "so every step takes many times its time; give each worker --threads ",
                      share, " (the CPUs over the ranks)");
}

absl::StatusOr<std::string> HostCpuShare(Communicator& group, int threads) {
  // Each rank's RankCpus as bytes (the ranks run one build on one host), as WithSharedMemory
  // gathers its offer.
  RankCpus mine{};
  mine.threads = threads;
  if (sched_getaffinity(0, sizeof(mine.cpus), &mine.cpus) != 0) CPU_ZERO(&mine.cpus);
  std::vector<RankCpus> ranks(group.size());
  const int64_t bytes = sizeof(RankCpus);
  Tensor out(ranks.data(), DType::kI8, {group.size(), bytes});
  SHARDSERVE_RETURN_IF_ERROR(group.AllGather(&out, Tensor(&mine, DType::kI8, {bytes})));
  return OversubscriptionNote(ranks);
}

}  // namespace shardserve
