// base/resource_limits.h: the CPU and memory limits read from control-group trees laid out in a
// scratch directory as the kernel shows them (cgroup v2's cpu.max and memory.max, v1's cfs quota
// and period and memory.limit_in_bytes; /proc/self/cgroup and /proc/self/mountinfo as their
// texts), and the threads and memory a process takes under them.
#include "base/resource_limits.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

class CgroupTree : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) / ("resource_limits_test." + std::to_string(getpid()) + "." +
                                              ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(root_);
  }
  // Writes `text` to `rel` under the scratch root, making its directories.
  void Write(const std::string& rel, const std::string& text) {
    const fs::path p = root_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::optional<double> Limit(const std::string& cgroup, const std::string& mountinfo) {
    return CgroupCpuLimit(cgroup, mountinfo, root_.string());
  }
  fs::path root_;
};

// A pure cgroup v2 host, as a Kubernetes node with cgroupns shows it from a container: the unified
// hierarchy mounted at /sys/fs/cgroup with root "/".
constexpr char kV2Mountinfo[] =
    "24 30 0:22 / /proc rw,nosuid - proc proc rw\n"
    "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n";

TEST_F(CgroupTree, V2TheGroupsQuota) {
  Write("sys/fs/cgroup/kubepods/pod1/c1/cpu.max", "250000 100000\n");
  EXPECT_EQ(Limit("0::/kubepods/pod1/c1\n", kV2Mountinfo), 2.5);
}

TEST_F(CgroupTree, V2TheLeastAlongTheAncestors) {
  Write("sys/fs/cgroup/kubepods/cpu.max", "max 100000\n");
  Write("sys/fs/cgroup/kubepods/pod1/cpu.max", "150000 100000\n");  // the pod's limit
  Write("sys/fs/cgroup/kubepods/pod1/c1/cpu.max", "400000 100000\n");
  EXPECT_EQ(Limit("0::/kubepods/pod1/c1\n", kV2Mountinfo), 1.5);
}

TEST_F(CgroupTree, V2NoLimit) {
  Write("sys/fs/cgroup/user.slice/cpu.max", "max 100000\n");
  EXPECT_EQ(Limit("0::/user.slice\n", kV2Mountinfo), std::nullopt);
  EXPECT_EQ(Limit("0::/\n", kV2Mountinfo), std::nullopt);  // the root has no cpu.max
  EXPECT_EQ(Limit("0::/not/made\n", kV2Mountinfo), std::nullopt);
}

TEST_F(CgroupTree, V2UnreadableValuesAreNoLimit) {
  for (const char* text : {"", "100000", "abc 100000", "100000 0", "-5 100000", "100000 100000 7", "1e5 1e5"}) {
    Write("sys/fs/cgroup/g/cpu.max", text);
    EXPECT_EQ(Limit("0::/g\n", kV2Mountinfo), std::nullopt) << text;
  }
}

// cgroup v1 (or hybrid, as Debian 12 hosts with systemd in legacy mode): the cpu controller's
// line and mount decide; the unified hierarchy beside it is not read.
TEST_F(CgroupTree, V1TheCpuControllersQuota) {
  const std::string mountinfo =
      "40 35 0:34 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
      "41 35 0:35 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
      "42 35 0:36 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n";
  Write("sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "300000\n");
  Write("sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
  Write("sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_quota_us", "-1\n");
  Write("sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_period_us", "100000\n");
  Write("sys/fs/cgroup/unified/docker/abc/cpu.max", "50000 100000\n");  // not the cpu controller's
  const std::string cgroup = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/docker/abc\n";
  EXPECT_EQ(Limit(cgroup, mountinfo), 3.0);
  Write("sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n");
  EXPECT_EQ(Limit(cgroup, mountinfo), std::nullopt);
}

// A container without a cgroup namespace on v1: the group's directory is bind-mounted as the
// hierarchy's mount, whose root is the group's path.
TEST_F(CgroupTree, V1AMountWhoseRootIsTheGroup) {
  const std::string mountinfo = "50 40 0:34 /docker/abc /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n";
  Write("sys/fs/cgroup/cpu/cpu.cfs_quota_us", "50000\n");
  Write("sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(Limit("2:cpu:/docker/abc\n", mountinfo), 0.5);
  // Outside the mount's root, or outside the namespace: not visible, no limit read.
  EXPECT_EQ(Limit("2:cpu:/other\n", mountinfo), std::nullopt);
  EXPECT_EQ(Limit("2:cpu:/docker/abcd\n", mountinfo), std::nullopt);
  Write("sys/fs/x/cpu.max", "100000 100000\n");  // where "/../x" would lead from the mount
  EXPECT_EQ(Limit("0::/../x\n", kV2Mountinfo), std::nullopt);
}

TEST_F(CgroupTree, MalformedTextsAreNoLimit) {
  for (const char* cgroup : {"", "garbage", "0:/x", "::::", "0::"}) {
    for (const char* mountinfo : {"", "garbage\n", "1 2 3\n", "35 24 0:30 / /sys/fs/cgroup - cgroup2\n", kV2Mountinfo}) {
      EXPECT_EQ(Limit(cgroup, mountinfo), std::nullopt) << cgroup << " | " << mountinfo;
    }
  }
  EXPECT_EQ(Limit("0::/g\n", "35 24 0:30 / /sys/fs/cgroup rw - ext4 /dev/sda rw\n"), std::nullopt);
}

TEST_F(CgroupTree, V2MemoryTheLeastAlongTheAncestors) {
  Write("sys/fs/cgroup/kubepods/memory.max", "max\n");
  Write("sys/fs/cgroup/kubepods/pod1/memory.max", "2147483648\n");  // the pod's 2Gi
  Write("sys/fs/cgroup/kubepods/pod1/c1/memory.max", "4294967296\n");
  Write("sys/fs/cgroup/kubepods/pod1/c1/cpu.max", "max 100000\n");
  EXPECT_EQ(Limit("0::/kubepods/pod1/c1\n", kV2Mountinfo), std::nullopt);  // the cpu limit: none
  EXPECT_EQ(CgroupMemoryLimit("0::/kubepods/pod1/c1\n", kV2Mountinfo, root_.string()), 2147483648.0);
  for (const char* text : {"max", "", "2G", "-1", "0"}) {
    Write("sys/fs/cgroup/kubepods/pod1/memory.max", text);
    EXPECT_EQ(CgroupMemoryLimit("0::/kubepods/pod1/c1\n", kV2Mountinfo, root_.string()), 4294967296.0) << text;
  }
}

TEST_F(CgroupTree, V1MemoryTheMemoryControllersLimit) {
  const std::string mountinfo =
      "40 35 0:34 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
      "41 35 0:35 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n";
  const std::string cgroup = "4:memory:/process_api/abc\n3:cpu,cpuacct:/\n";
  Write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "none"
  EXPECT_EQ(CgroupMemoryLimit(cgroup, mountinfo, root_.string()), std::nullopt);
  Write("sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes", "1073741824\n");
  EXPECT_EQ(CgroupMemoryLimit(cgroup, mountinfo, root_.string()), 1073741824.0);
  EXPECT_EQ(Limit(cgroup, mountinfo), std::nullopt);  // the cpu hierarchy's root holds no quota
}

TEST(UsableMemoryBytes, TheLimitWhereLower) {
  EXPECT_EQ(UsableMemoryBytes(int64_t{64} << 30, std::nullopt), int64_t{64} << 30);
  EXPECT_EQ(UsableMemoryBytes(int64_t{64} << 30, 2147483648.0), int64_t{2} << 30);
  EXPECT_EQ(UsableMemoryBytes(int64_t{1} << 30, 2147483648.0), int64_t{1} << 30);
  EXPECT_GT(HostMemoryBytes(), 0);
}

TEST(UsableCpus, TheLimitRoundedUpUnderTheAffinity) {
  EXPECT_EQ(UsableCpus(8, std::nullopt), 8);
  EXPECT_EQ(UsableCpus(8, 2.5), 3);
  EXPECT_EQ(UsableCpus(8, 4.0), 4);
  EXPECT_EQ(UsableCpus(8, 150000.0 / 100000.0), 2);
  EXPECT_EQ(UsableCpus(8, 300000.0 / 100000.0), 3);
  EXPECT_EQ(UsableCpus(2, 4.0), 2);  // a limit above the CPUs changes nothing
  EXPECT_EQ(UsableCpus(8, 0.5), 1);  // at least one
  EXPECT_EQ(UsableCpus(0, std::nullopt), 1);
}

// Threads set by hand past the CPUs a worker may use are said, with what limits them and the
// --threads that fits; those within them are not.
TEST(UsableCpus, ThreadsSetByHandPastTheCpusAreSaid) {
  EXPECT_EQ(ThreadsBeyondCpusNote("--threads 2", 2, 2, std::nullopt), "");
  EXPECT_EQ(ThreadsBeyondCpusNote("--threads 3", 3, 8, 2.5), "");  // the limit rounded up
  EXPECT_EQ(ThreadsBeyondCpusNote("--threads 4", 4, 16, 2.0),
            "--threads 4 runs 4 compute threads on the 2 CPUs this process may use (its control group's CPU "
            "limit is 2 of the 16 CPUs it may run on): the threads past them are descheduled or throttled in the "
            "middle of a product and every step waits for them; --threads 2 fits");
  EXPECT_EQ(ThreadsBeyondCpusNote("OMP_NUM_THREADS=3,1", 3, 1, std::nullopt),
            "OMP_NUM_THREADS=3,1 runs 3 compute threads on the 1 CPU this process may use (its affinity holds 1 "
            "CPU): the threads past them are descheduled or throttled in the middle of a product and every step "
            "waits for them; --threads 1 fits");
  EXPECT_NE(ThreadsBeyondCpusNote("--threads 3", 3, 2, 4.0).find("its affinity holds 2 CPUs"), std::string::npos);
}

TEST(UsableCpus, ThisProcessHasAtLeastOneAndNoMoreThanItsAffinity) {
  EXPECT_GE(UsableCpus(), 1);
  EXPECT_LE(UsableCpus(), AffinityCpus());
}

// /proc/PID/status's memory fields: "<N> kB" in bytes; a missing or malformed one is nullopt, and a
// field's name is matched whole ("Rss" is not "RssAnon").
TEST(ProcStatus, MemoryFieldsInBytes) {
  const std::string status = "Name:\tshardserve-work\nVmHWM:\t  864616 kB\nVmRSS:\t  674228 kB\n"
                             "RssAnon:\t  589040 kB\nRssFile:\t85188 kB\nThreads:\t23\nBad:\t12 MB\n";
  EXPECT_EQ(StatusFieldBytes(status, "VmHWM"), int64_t{864616} * 1024);
  EXPECT_EQ(StatusFieldBytes(status, "RssAnon"), int64_t{589040} * 1024);
  EXPECT_EQ(StatusFieldBytes(status, "RssFile"), int64_t{85188} * 1024);
  EXPECT_EQ(StatusFieldBytes(status, "Rss"), std::nullopt);
  EXPECT_EQ(StatusFieldBytes(status, "Threads"), std::nullopt);  // no unit
  EXPECT_EQ(StatusFieldBytes(status, "Bad"), std::nullopt);
  EXPECT_EQ(StatusFieldBytes("RssAnon:\t-4 kB\n", "RssAnon"), std::nullopt);
  EXPECT_EQ(StatusFieldBytes("", "RssAnon"), std::nullopt);
}

TEST(ProcStatus, ThisProcessHasAnonymousMemoryAndAGoneOneNone) {
  std::optional<int64_t> anon = ProcStatusBytes("self", "RssAnon");
  ASSERT_TRUE(anon.has_value());
  EXPECT_GT(*anon, 0);
  EXPECT_EQ(ProcStatusBytes("0", "RssAnon"), std::nullopt);  // no such process
}

// Frees blocks as a worker's steps do (one of 16 MiB, then 24 of 1 MiB) and returns the anonymous
// memory still resident after, above what was before: what the allocator kept of them.
int64_t AnonymousMemoryKeptAfterFreeing() {
  const int64_t before = ProcStatusBytes("self", "RssAnon").value_or(-1);
  auto touch_and_free = [](std::vector<char*> blocks, size_t size) {
    for (char* b : blocks) {
      std::memset(b, 1, size);
      asm volatile("" : : "r"(b) : "memory");  // the writes are kept
    }
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) std::free(*it);
  };
  touch_and_free({static_cast<char*>(std::malloc(16 << 20))}, 16 << 20);
  std::vector<char*> small;
  for (int i = 0; i < 24; ++i) small.push_back(static_cast<char*>(std::malloc(1 << 20)));
  touch_and_free(small, 1 << 20);
  const int64_t after = ProcStatusBytes("self", "RssAnon").value_or(-1);
  return before < 0 || after < 0 ? -1 : after - before;
}

// Each in a fresh process (a re-run of this program, gtest's "threadsafe" death-test style), whose
// allocator has freed nothing large yet. glibc's defaults keep the 24 MiB freed (its thresholds rose
// to the 16 MiB block, the trim threshold to 32 MiB); with ReturnFreedMemoryPromptly they go back to
// the host. Not under a sanitizer, whose allocator stands in for glibc's.
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
TEST(ReturnFreedMemoryPromptly, FreedBlocksLeaveTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (!ReturnFreedMemoryPromptly()) std::_Exit(2);
        const int64_t kept = AnonymousMemoryKeptAfterFreeing();
        std::fprintf(stderr, "kept %lld bytes\n", static_cast<long long>(kept));
        std::_Exit(kept >= 0 && kept < (8 << 20) ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(ReturnFreedMemoryPromptly, TheDefaultsKeepThem) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const int64_t kept = AnonymousMemoryKeptAfterFreeing();
        std::fprintf(stderr, "kept %lld bytes\n", static_cast<long long>(kept));
        std::_Exit(kept >= (16 << 20) ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}
#endif

}  // namespace
}  // namespace shardserve
