// How many CPUs this process may use: the CPUs it may run on (its affinity: taskset, a cpuset, a
// Kubernetes pod under the static CPU manager) and, beneath that, the CPU limit of its control group
// (a container's `resources.limits.cpu`: cgroup v2's cpu.max, v1's cpu.cfs_quota_us over
// cpu.cfs_period_us, the least along the group's ancestors). A limit is enforced by throttling,
// not by the affinity: a process that starts a math thread per CPU it sees (OpenMP's default)
// spends its quota of each period (100 ms) in a burst on every CPU, then waits, all its threads
// stopped, for the next one, so a step that falls on the wait takes tens of milliseconds more.
// The CPU worker takes UsableCpus() threads by default, and `shardserve launch` shares them out
// among its workers.
#ifndef SHARDSERVE_BASE_CPUS_H_
#define SHARDSERVE_BASE_CPUS_H_

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

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

namespace cpus_internal {

inline std::optional<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// One directory's limit in CPUs: cgroup v2's cpu.max ("QUOTA PERIOD" or "max PERIOD") or v1's
// cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us. nullopt: none, or not readable as such.
inline std::optional<double> DirectoryLimit(const std::string& dir, bool v2) {
  auto number = [](absl::string_view text) -> std::optional<double> {
    int64_t v = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &v)) return std::nullopt;
    return static_cast<double>(v);
  };
  std::optional<double> quota, period;
  if (v2) {
    const std::optional<std::string> max = ReadSmallFile(dir + "/cpu.max");
    if (!max) return std::nullopt;
    const std::vector<absl::string_view> parts =
        absl::StrSplit(absl::StripAsciiWhitespace(*max), ' ', absl::SkipEmpty());
    if (parts.size() != 2 || parts[0] == "max") return std::nullopt;
    quota = number(parts[0]);
    period = number(parts[1]);
  } else {
    const std::optional<std::string> q = ReadSmallFile(dir + "/cpu.cfs_quota_us");
    const std::optional<std::string> p = ReadSmallFile(dir + "/cpu.cfs_period_us");
    if (!q || !p) return std::nullopt;
    quota = number(*q);
    period = number(*p);
  }
  if (!quota || !period || *quota <= 0 || *period <= 0) return std::nullopt;
  return *quota / *period;
}

}  // namespace cpus_internal

// The CPU limit, in CPUs, that a process's control groups set: the least quota / period of its
// cpu hierarchy's group and that group's ancestors up to the hierarchy's mount, where
// `proc_self_cgroup` and `mountinfo` are the texts of /proc/self/cgroup and /proc/self/mountinfo
// and `root` is put before every mount point ("" on a live system; tests give a directory). v2's
// unified hierarchy ("0::PATH", a cgroup2 mount) is read where it is the cpu controller's, else
// v1's cpu controller ("N:cpu,cpuacct:PATH", a cgroup mount with the cpu option). A group outside
// the mount's root, or outside this cgroup namespace ("/../x"), cannot be seen: nullopt, as for no
// limit.
inline std::optional<double> CgroupCpuLimit(absl::string_view proc_self_cgroup, absl::string_view mountinfo,
                                            const std::string& root) {
  // The cpu controller's group path and hierarchy kind.
  std::optional<std::string> v1_path, v2_path;
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    const std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) {
      v2_path = std::string(f[2]);
    } else {
      for (absl::string_view c : absl::StrSplit(f[1], ',')) {
        if (c == "cpu") v1_path = std::string(f[2]);
      }
    }
  }
  // A mount of the hierarchy: (its root within the hierarchy, where it is mounted).
  auto find_mount = [&](bool v2) -> std::optional<std::pair<std::string, std::string>> {
    for (absl::string_view line : absl::StrSplit(mountinfo, '\n', absl::SkipEmpty())) {
      // ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS
      const std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      const auto dash = std::find(f.begin(), f.end(), "-");
      if (f.size() < 6 || dash == f.end() || f.end() - dash < 4) continue;
      const absl::string_view fstype = dash[1], super = dash[3];
      bool match = v2 && fstype == "cgroup2";
      if (!v2 && fstype == "cgroup") {
        for (absl::string_view o : absl::StrSplit(super, ',')) match = match || o == "cpu";
      }
      if (match) return std::make_pair(std::string(f[3]), std::string(f[4]));
    }
    return std::nullopt;
  };
  const bool v2 = !v1_path.has_value();  // a v1 cpu controller takes it from the unified hierarchy
  const std::optional<std::string>& path = v2 ? v2_path : v1_path;
  if (!path) return std::nullopt;
  const auto mount = find_mount(v2);
  if (!mount) return std::nullopt;
  const auto& [mount_root, mount_point] = *mount;
  // The group's path below the mount's root: "/kubepods/pod1/c1" under root "/" is "kubepods/pod1/c1".
  absl::string_view rel = *path;
  if (mount_root != "/") {
    if (!absl::ConsumePrefix(&rel, mount_root) || (!rel.empty() && rel.front() != '/')) return std::nullopt;
  }
  rel = absl::StripPrefix(rel, "/");
  std::optional<double> least;
  auto consider = [&](const std::string& dir) {
    const std::optional<double> limit = cpus_internal::DirectoryLimit(dir, v2);
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

// CgroupCpuLimit of this process (nullopt where /proc cannot be read).
inline std::optional<double> CgroupCpuLimit() {
  const std::optional<std::string> cgroup = cpus_internal::ReadSmallFile("/proc/self/cgroup");
  const std::optional<std::string> mountinfo = cpus_internal::ReadSmallFile("/proc/self/mountinfo");
  if (!cgroup || !mountinfo) return std::nullopt;
  return CgroupCpuLimit(*cgroup, *mountinfo, "");
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

}  // namespace shardserve

#endif  // SHARDSERVE_BASE_CPUS_H_
