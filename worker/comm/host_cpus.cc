#include "worker/comm/host_cpus.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardserve {
namespace {

// A rank's record in the AllGather: its threads, then its CPU set as bits of int32 words.
constexpr int kMaskWords = CPU_SETSIZE / 32;
constexpr int kRecordWords = 1 + kMaskWords;

}  // namespace

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
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (sched_getaffinity(0, sizeof(mine), &mine) != 0) CPU_ZERO(&mine);
  std::vector<int32_t> record(kRecordWords, 0);
  record[0] = threads;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &mine)) record[1 + c / 32] |= static_cast<int32_t>(uint32_t{1} << (c % 32));
  }
  const int size = group.size();
  std::vector<int32_t> all(static_cast<size_t>(size) * kRecordWords);
  Tensor out(all.data(), DType::kI32, {size, kRecordWords});
  SHARDSERVE_RETURN_IF_ERROR(group.AllGather(&out, Tensor(record.data(), DType::kI32, {kRecordWords})));
  std::vector<RankCpus> ranks(size);
  for (int p = 0; p < size; ++p) {
    const int32_t* r = all.data() + static_cast<size_t>(p) * kRecordWords;
    ranks[p].threads = r[0];
    CPU_ZERO(&ranks[p].cpus);
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if ((static_cast<uint32_t>(r[1 + c / 32]) >> (c % 32)) & 1) CPU_SET(c, &ranks[p].cpus);
    }
  }
  return OversubscriptionNote(ranks);
}

}  // namespace shardserve
