// base/free_port.h: the ports it hands out are outside the kernel's ephemeral range (where a bind
// to port 0 could take them), bindable, distinct and claimed; a fresh claim keeps a port from
// every other picker, a stale one is taken again; and tools/ci/ports.py, its Python twin, honours
// the same claims both ways.
#include "base/free_port.h"

#include <sys/stat.h>
#include <utime.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

// Claims in a directory of this test's own ($TMPDIR), so that it neither sees nor leaves the
// claims of the tests running beside it.
class FreePortTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/free_port_test.XXXXXX";
    dir_ = mkdtemp(pattern);
    const char* old = std::getenv("TMPDIR");
    if (old != nullptr) old_tmpdir_ = old;
    had_tmpdir_ = old != nullptr;
    setenv("TMPDIR", dir_.c_str(), 1);
  }
  void TearDown() override {
    if (had_tmpdir_) {
      setenv("TMPDIR", old_tmpdir_.c_str(), 1);
    } else {
      unsetenv("TMPDIR");
    }
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  fs::path claim(int port) const { return dir_ / "shardserve-ports" / std::to_string(port); }

  // `python3 -c "<code>"` with tools/ci on its path and this test's TMPDIR; its exit status.
  int Python(const std::string& code) const {
    const std::string command = absl::StrCat("PYTHONPATH=", SHARDSERVE_SOURCE_DIR, "/tools/ci python3 -c \"", code, "\"");
    return std::system(command.c_str());
  }

  fs::path dir_;
  std::string old_tmpdir_;
  bool had_tmpdir_ = false;
};

TEST_F(FreePortTest, PortsAreOutsideTheEphemeralRangeBindableDistinctAndClaimed) {
  const auto [low, high] = free_port_internal::EphemeralRange();
  std::set<int> seen;
  for (int i = 0; i < 200; ++i) {
    const absl::StatusOr<int> port = FreeLoopbackPort();
    ASSERT_TRUE(port.ok()) << port.status();
    EXPECT_TRUE(*port < low || *port > high) << *port << " is in the ephemeral range " << low << "-" << high;
    EXPECT_GE(*port, free_port_internal::kLowest);
    EXPECT_LE(*port, 65535);
    EXPECT_TRUE(free_port_internal::Bindable(*port)) << *port;
    EXPECT_TRUE(fs::exists(claim(*port))) << claim(*port);
    EXPECT_TRUE(seen.insert(*port).second) << *port << " handed out twice";
  }
}

TEST_F(FreePortTest, AFreshClaimHoldsAndAStaleOneIsTakenAgain) {
  const absl::StatusOr<int> port = FreeLoopbackPort();
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_FALSE(free_port_internal::Claim(*port)) << "a fresh claim was taken again";
  const time_t old = std::time(nullptr) - free_port_internal::kClaimSeconds - 60;
  const utimbuf times{old, old};
  ASSERT_EQ(utime(claim(*port).c_str(), &times), 0);
  EXPECT_TRUE(free_port_internal::Claim(*port)) << "a stale claim was not taken";
  struct stat st;
  ASSERT_EQ(stat(claim(*port).c_str(), &st), 0);
  EXPECT_GT(st.st_mtime, old) << "the claim taken again was not renewed";
  EXPECT_FALSE(free_port_internal::Claim(*port));
}

TEST_F(FreePortTest, ThePythonTwinHonoursTheSameClaims) {
  // A claim made here holds against tools/ci/ports.py, and one made there against this.
  const absl::StatusOr<int> mine = FreeLoopbackPort();
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(Python(absl::StrCat("import ports, sys; sys.exit(0 if not ports._claim(", *mine, ") else 1)")), 0);
  const int theirs = *mine == 20000 ? 20001 : 20000;
  ASSERT_FALSE(fs::exists(claim(theirs)));
  EXPECT_EQ(Python(absl::StrCat("import ports, sys; sys.exit(0 if ports._claim(", theirs, ") else 1)")), 0);
  EXPECT_FALSE(free_port_internal::Claim(theirs)) << "the Python claim on " << theirs << " was taken";
  // And both draw from the same ranges.
  const auto [low, high] = free_port_internal::EphemeralRange();
  EXPECT_EQ(Python(absl::StrCat("import ports, sys; sys.exit(0 if ports._ephemeral_range() == (", low, ", ", high,
                                ") and ports.LOWEST == ", free_port_internal::kLowest,
                                " and ports.CLAIM_SECONDS == ", free_port_internal::kClaimSeconds, " else 1)")),
            0);
}

}  // namespace
}  // namespace shardserve
