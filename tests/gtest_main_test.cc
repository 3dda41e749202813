// Cases for tests/gtest_main.cc (tests/gtest_main_test.sh, the gtest_main_outcomes test of
// tests/CMakeLists.txt, runs each suite on its own): Passes passes, Skips is skipped, Fails and
// SetUpTestSuiteFails fail (GoogleTest skips the cases of a suite whose SetUpTestSuite failed), and
// so do the cases that fail after a skip: SkipsThenTearDownFails (its suite's tear-down) and
// SkipsThenAbortsAtExit (a static destructor, as a sanitizer's report at exit would).
#include <cstdlib>

#include "gtest/gtest.h"

namespace {

// Aborts the process at exit once armed (after main returned).
struct AbortAtExit {
  bool armed = false;
  ~AbortAtExit() {
    if (armed) std::abort();
  }
} abort_at_exit;

TEST(Passes, Case) { SUCCEED(); }

TEST(Skips, Case) { GTEST_SKIP() << "skipped on purpose"; }

class SetUpTestSuiteFails : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ADD_FAILURE() << "the suite's set-up failed (on purpose)"; }
};
TEST_F(SetUpTestSuiteFails, Case) { SUCCEED(); }
TEST_F(SetUpTestSuiteFails, Other) { SUCCEED(); }

TEST(Fails, Case) { ADD_FAILURE() << "failed on purpose"; }

class SkipsThenTearDownFails : public ::testing::Test {
 protected:
  static void TearDownTestSuite() { ADD_FAILURE() << "the suite's tear-down failed (on purpose)"; }
};
TEST_F(SkipsThenTearDownFails, Case) { GTEST_SKIP() << "skipped on purpose"; }

TEST(SkipsThenAbortsAtExit, Case) {
  abort_at_exit.armed = true;
  GTEST_SKIP() << "skipped on purpose; the process aborts at exit";
}

}  // namespace
