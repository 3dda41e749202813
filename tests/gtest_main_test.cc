// Cases for tests/gtest_main.cc (tests/gtest_main_test.sh, the gtest_main_outcomes test of
// tests/CMakeLists.txt, runs each suite on its own): Passes passes, Skips is skipped, Fails and
// SetUpTestSuiteFails fail (GoogleTest skips the cases of a suite whose SetUpTestSuite failed).
#include "gtest/gtest.h"

namespace {

TEST(Passes, Case) { SUCCEED(); }

TEST(Skips, Case) { GTEST_SKIP() << "skipped on purpose"; }

class SetUpTestSuiteFails : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ADD_FAILURE() << "the suite's set-up failed (on purpose)"; }
};
TEST_F(SetUpTestSuiteFails, Case) { SUCCEED(); }
TEST_F(SetUpTestSuiteFails, Other) { SUCCEED(); }

TEST(Fails, Case) { ADD_FAILURE() << "failed on purpose"; }

}  // namespace
