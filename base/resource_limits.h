// What this process may use of its host: the CPUs it may run on (its affinity: taskset, a cpuset,
// a Kubernetes pod under the static CPU manager) and, beneath them and the host's memory, the
// limits of its control groups (a container's `resources.limits`): cgroup v2's cpu.max and
// memory.max, v1's cpu.cfs_quota_us over cpu.cfs_period_us and memory.limit_in_bytes, the least
// along the group's ancestors.
//
// A CPU limit is enforced by throttling, not by the affinity: a process that starts a math thread
// per CPU it sees (OpenMP's default) spends its quota of each period (100 ms) in a burst on every
// CPU, then waits, all its threads stopped, for the next one, so a step that falls on the wait
// takes tens of milliseconds more. A memory limit is enforced by the OOM killer: a worker that
// sized its KV cache by the host's memory is killed when it fills it. The CPU worker takes
// UsableCpus() threads and UsableMemoryBytes() of memory by default, and `shardserve launch` shares
// the CPUs out among its workers. Also what a process uses: the memory figures of /proc/PID/status
// (a CPU worker's own memory beside its buffers; the peak RSS `shardserve bench --compare` reports),
// and the allocator's settings that keep it close to what the process holds.
#ifndef SHARDSERVE_BASE_RESOURCE_LIMITS_H_
#define SHARDSERVE_BASE_RESOURCE_LIMITS_H_

#include <malloc.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace shardserve {

// The CPUs this process may run on (sched_getaffinity), at least 1.
inline int AffinityCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

namespace resource_limits_internal {

inline std::optional<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A whole file's decimal integer (surrounding white space allowed), or nullopt.
inline std::optional<int64_t> ReadInteger(const std::string& path) {
  const std::optional<std::string> text = ReadSmallFile(path);
  int64_t v = 0;
  if (!text || !absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &v)) return std::nullopt;
  return v;
}

// One directory's CPU limit in CPUs: v2's cpu.max ("QUOTA PERIOD" or "max PERIOD") or v1's
// cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us. nullopt: none, or not readable as such.
inline std::optional<double> CpuLimitIn(const std::string& dir, bool v2) {
  std::optional<int64_t> quota, period;
  if (v2) {
    const std::optional<std::string> max = ReadSmallFile(dir + "/cpu.max");
    if (!max) return std::nullopt;
    const std::vector<absl::string_view> parts =
        absl::StrSplit(absl::StripAsciiWhitespace(*max), ' ', absl::SkipEmpty());
    int64_t q = 0, p = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &q) || !absl::SimpleAtoi(parts[1], &p)) return std::nullopt;
    quota = q;
    period = p;
  } else {
    quota = ReadInteger(dir + "/cpu.cfs_quota_us");
    period = ReadInteger(dir + "/cpu.cfs_period_us");
  }
  if (!quota || !period || *quota <= 0 || *period <= 0) return std::nullopt;
  return static_cast<double>(*quota) / static_cast<double>(*period);
}

// One directory's memory limit in bytes: v2's memory.max ("max": none) or v1's
// memory.limit_in_bytes (its "none" is the largest page count, about 2^63). nullopt: none, or not
// readable as such.
inline std::optional<double> MemoryLimitIn(const std::string& dir, bool v2) {
  const std::optional<int64_t> bytes = ReadInteger(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"));
  if (!bytes || *bytes <= 0 || *bytes >= (int64_t{1} << 62)) return std::nullopt;
  return static_cast<double>(*bytes);
}

// The least `limit_in(dir, v2)` over the process's group of `controller` and that group's
// ancestors up to the hierarchy's mount (see CgroupCpuLimit).
template <typename LimitIn>
std::optional<double> LeastAlongGroup(absl::string_view controller, absl::string_view proc_self_cgroup,
                                      absl::string_view mountinfo, const std::string& root, LimitIn limit_in) {
  // The controller's group path and hierarchy kind.
  std::optional<std::string> v1_path, v2_path;
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    const std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) {
      v2_path = std::string(f[2]);
    } else {
      for (absl::string_view c : absl::StrSplit(f[1], ',')) {
        if (c == controller) v1_path = std::string(f[2]);
      }
    }
  }
  const bool v2 = !v1_path.has_value();  // a v1 controller takes it from the unified hierarchy
  const std::optional<std::string>& path = v2 ? v2_path : v1_path;
  if (!path) return std::nullopt;
  // A mount of the hierarchy: its root within the hierarchy, and where it is mounted.
  std::optional<std::pair<std::string, std::string>> mount;
  for (absl::string_view line : absl::StrSplit(mountinfo, '\n', absl::SkipEmpty())) {
    // ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS
    const std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    const auto dash = std::find(f.begin(), f.end(), "-");
    if (f.size() < 6 || dash == f.end() || f.end() - dash < 4) continue;
    const absl::string_view fstype = dash[1], super = dash[3];
    bool match = v2 && fstype == "cgroup2";
    if (!v2 && fstype == "cgroup") {
      for (absl::string_view o : absl::StrSplit(super, ',')) match = match || o == controller;
    }
    if (match) {
      mount.emplace(std::string(f[3]), std::string(f[4]));
      break;
    }
  }
  if (!mount) return std::nullopt;
  const auto& [mount_root, mount_point] = *mount;
  // The group's path below the mount's root: "/kubepods/pod1/c1" under root "/" is "kubepods/pod1/c1".
  absl::string_view rel = *path;
  if (mount_root != "/") {
    if (!absl::ConsumePrefix(&rel, mount_root) || (!rel.empty() && rel.front() != '/')) return std::nullopt;
  }
  std::optional<double> least;
  auto consider = [&](const std::string& dir) {
    const std::optional<double> limit = limit_in(dir, v2);
    if (limit && (!least || *limit < *least)) least = limit;
  };
  std::string dir = root + mount_point;  // the mount point, then each group below it down to ours
  consider(dir);
  for (absl::string_view part : absl::StrSplit(rel, '/', absl::SkipEmpty())) {
    if (part == "..") return std::nullopt;  // a group outside this namespace's view ("/../x")
    dir += "/" + std::string(part);
    consider(dir);
  }
  return least;
}

}  // namespace resource_limits_internal

// The CPU limit, in CPUs, that a process's control groups set: the least quota / period of its
// cpu hierarchy's group and that group's ancestors up to the hierarchy's mount, where
// `proc_self_cgroup` and `mountinfo` are the texts of /proc/self/cgroup and /proc/self/mountinfo
// and `root` is put before every mount point ("" on a live system; tests give a directory). v2's
// unified hierarchy ("0::PATH", a cgroup2 mount) is read where it is the controller's, else v1's
// ("N:cpu,cpuacct:PATH", a cgroup mount with the controller's option). A group outside the mount's
// root, or outside this cgroup namespace ("/../x"), cannot be seen: nullopt, as for no limit.
inline std::optional<double> CgroupCpuLimit(absl::string_view proc_self_cgroup, absl::string_view mountinfo,
                                            const std::string& root) {
  return resource_limits_internal::LeastAlongGroup("cpu", proc_self_cgroup, mountinfo, root,
                                                   resource_limits_internal::CpuLimitIn);
}

// The memory limit, in bytes, that a process's control groups set (memory.max, v1's
// memory.limit_in_bytes), as CgroupCpuLimit finds the groups.
inline std::optional<double> CgroupMemoryLimit(absl::string_view proc_self_cgroup, absl::string_view mountinfo,
                                               const std::string& root) {
  return resource_limits_internal::LeastAlongGroup("memory", proc_self_cgroup, mountinfo, root,
                                                   resource_limits_internal::MemoryLimitIn);
}

namespace resource_limits_internal {
// This process's /proc/self/cgroup and /proc/self/mountinfo, or nullopt where they cannot be read.
inline std::optional<std::pair<std::string, std::string>> ThisProcessGroups() {
  std::optional<std::string> cgroup = ReadSmallFile("/proc/self/cgroup");
  std::optional<std::string> mountinfo = ReadSmallFile("/proc/self/mountinfo");
  if (!cgroup || !mountinfo) return std::nullopt;
  return std::make_pair(*std::move(cgroup), *std::move(mountinfo));
}
}  // namespace resource_limits_internal

// CgroupCpuLimit and CgroupMemoryLimit of this process (nullopt where /proc cannot be read).
inline std::optional<double> CgroupCpuLimit() {
  const auto groups = resource_limits_internal::ThisProcessGroups();
  return groups ? CgroupCpuLimit(groups->first, groups->second, "") : std::nullopt;
}
inline std::optional<double> CgroupMemoryLimit() {
  const auto groups = resource_limits_internal::ThisProcessGroups();
  return groups ? CgroupMemoryLimit(groups->first, groups->second, "") : std::nullopt;
}

// The math threads a process on `affinity` CPUs under a CPU limit of `limit` CPUs should run: the
// CPUs, or fewer where the limit is lower, rounded up (as Go and Java take a limit), at least 1.
// The kernel throttles the whole group once it has used its quota of a period, so the threads stop
// together and a fraction is still time used: under a limit of 1.5 CPUs on 2, two threads served
// 1.22x the tokens of one (docs/operations.md). Under a limit of 1, the second thread lost 25%.
inline int UsableCpus(int affinity, std::optional<double> limit) {
  int cpus = std::max(1, affinity);
  if (limit && *limit < cpus) cpus = std::max(1, static_cast<int>(std::ceil(*limit - 1e-9)));
  return cpus;
}

// UsableCpus of this process.
inline int UsableCpus() { return UsableCpus(AffinityCpus(), CgroupCpuLimit()); }

// What a CPU worker whose math threads were set by hand (`source`: "--threads 4", "OMP_NUM_THREADS=4")
// says where `threads` outnumber the CPUs it may use (UsableCpus of `affinity` and `limit`); "" where
// they fit. A thread past those CPUs is descheduled or throttled in the middle of a product, and
// every product waits for its slowest thread.
inline std::string ThreadsBeyondCpusNote(const std::string& source, int threads, int affinity,
                                         std::optional<double> limit) {
  const int usable = UsableCpus(affinity, limit);
  if (threads <= usable) return "";
  std::ostringstream why;
  if (limit && *limit < affinity) {
    why << "its control group's CPU limit is " << *limit << " of the " << affinity << " CPUs it may run on";
  } else {
    why << "its affinity holds " << affinity << (affinity == 1 ? " CPU" : " CPUs");
  }
  std::ostringstream note;
  note << source << " runs " << threads << " compute threads on the " << usable << (usable == 1 ? " CPU" : " CPUs")
       << " this process may use (" << why.str() << "): the threads past them are descheduled or throttled in the "
       << "middle of a product and every step waits for them; --threads " << usable << " fits";
  return note.str();
}

// The host's memory (physical pages), in bytes.
inline int64_t HostMemoryBytes() { return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE); }

// The memory this process may use: the host's, or its control group's limit where that is lower.
inline int64_t UsableMemoryBytes(int64_t host, std::optional<double> limit) {
  return limit && *limit < static_cast<double>(host) ? static_cast<int64_t>(*limit) : host;
}

// UsableMemoryBytes of this process.
inline int64_t UsableMemoryBytes() { return UsableMemoryBytes(HostMemoryBytes(), CgroupMemoryLimit()); }

// A memory figure of a process's /proc/PID/status ("VmHWM": its peak resident set; "RssAnon": its
// anonymous memory resident now, which a memory limit cannot reclaim as it can the page cache), in
// bytes: `status` is the file's text. nullopt where the field is missing or not "<N> kB".
inline std::optional<int64_t> StatusFieldBytes(absl::string_view status, absl::string_view field) {
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, field) || !absl::ConsumePrefix(&line, ":")) continue;
    std::vector<absl::string_view> words = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    int64_t kib = 0;
    if (words.size() != 2 || words[1] != "kB" || !absl::SimpleAtoi(words[0], &kib) || kib < 0 ||
        kib > (int64_t{1} << 50)) {
      return std::nullopt;
    }
    return kib * 1024;
  }
  return std::nullopt;
}

// StatusFieldBytes of process `pid`'s /proc/PID/status ("self": this process's); nullopt also where
// the file cannot be read (the process has gone).
inline std::optional<int64_t> ProcStatusBytes(const std::string& pid, absl::string_view field) {
  std::optional<std::string> status = resource_limits_internal::ReadSmallFile("/proc/" + pid + "/status");
  return status ? StatusFieldBytes(*status, field) : std::nullopt;
}

// Has the C library's allocator give freed memory back to the host promptly, as a process under a
// memory limit needs: blocks of 4 MiB and more are mapped and unmapped on their own, and the heap
// is trimmed once 1 MiB is free at its top. glibc's defaults raise the first threshold with each
// large block freed, up to 32 MiB, and the second to twice it, so a process that once freed a
// 32 MiB block keeps up to 64 MiB of freed heap resident in each arena: a CPU worker serving the
// Qwen3-MoE bench model kept 91-101 MiB beside its buffers at its peak, 38 MiB with these settings,
// and the dense bench models 11-62 MiB, 9-37 MiB with them (coordinator/planner/memory.cc;
// docs/operations.md). An environment's GLIBC_TUNABLES for either threshold is kept. True where
// both were set here or by the environment; false where mallopt refused one.
inline bool ReturnFreedMemoryPromptly() {
  constexpr int kMmapThreshold = 4 << 20, kTrimThreshold = 1 << 20;
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  const absl::string_view set = tunables != nullptr ? tunables : "";
  bool ok = true;
  if (!absl::StrContains(set, "glibc.malloc.mmap_threshold")) ok &= mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1;
  if (!absl::StrContains(set, "glibc.malloc.trim_threshold")) ok &= mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
  return ok;
}

}  // namespace shardserve

#endif  // SHARDSERVE_BASE_RESOURCE_LIMITS_H_
