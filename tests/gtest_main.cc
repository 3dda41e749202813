// The main() of every test program of tests/CMakeLists.txt (shardserve_test), in place of
// GoogleTest's gtest_main: GoogleTest's output, but for the cases of a suite whose SetUpTestSuite
// failed. GoogleTest 1.12 then skips them and prints each as "[  SKIPPED ]" (the program exits 1);
// CTest reads that line, gtest_discover_tests's SKIP_REGULAR_EXPRESSION, as a skip whatever the
// exit status, so a cluster that did not start under a test suite's set-up was reported as skipped
// cases. Here they are printed "[  FAILED  ]" instead, so that CTest reports the failure; a case
// skipped with GTEST_SKIP() is still printed (and reported) as skipped, never as passed.
//
// Skipped is told by the exit status, kSkipExitCode (CTest's SKIP_RETURN_CODE), not by the output:
// a run whose cases passed or were skipped, at least one skipped, exits 77. Anything that fails
// after a skip (a suite's tear-down, an abort in a static destructor, a LeakSanitizer report) then
// sets another status, and CTest reports the failure; reading "[  SKIPPED ]" in the output, as
// before, reported it as a skip. tests/gtest_main_test.sh is the check.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace {

using ::testing::TestEventListener;
using ::testing::TestInfo;
using ::testing::TestPartResult;
using ::testing::TestSuite;
using ::testing::UnitTest;

bool SetUpFailed(const TestSuite& suite) { return suite.ad_hoc_test_result().Failed(); }

// GoogleTest's own printer, but for the cases (and the summary) of a suite whose set-up failed.
class Printer : public TestEventListener {
 public:
  explicit Printer(TestEventListener* printer) : printer_(printer) {}

  void OnTestProgramStart(const UnitTest& u) override { printer_->OnTestProgramStart(u); }
  void OnTestIterationStart(const UnitTest& u, int i) override { printer_->OnTestIterationStart(u, i); }
  void OnEnvironmentsSetUpStart(const UnitTest& u) override { printer_->OnEnvironmentsSetUpStart(u); }
  void OnEnvironmentsSetUpEnd(const UnitTest& u) override { printer_->OnEnvironmentsSetUpEnd(u); }
  void OnTestSuiteStart(const TestSuite& s) override { printer_->OnTestSuiteStart(s); }
#ifndef GTEST_REMOVE_LEGACY_TEST_CASEAPI_
  void OnTestCaseStart(const ::testing::TestCase& s) override { printer_->OnTestCaseStart(s); }
  void OnTestCaseEnd(const ::testing::TestCase& s) override { printer_->OnTestCaseEnd(s); }
#endif
  void OnTestStart(const TestInfo& t) override { printer_->OnTestStart(t); }
  void OnTestPartResult(const TestPartResult& r) override { printer_->OnTestPartResult(r); }
  void OnTestEnd(const TestInfo& t) override {
    const TestSuite* suite = UnitTest::GetInstance()->current_test_suite();
    if (suite != nullptr && SetUpFailed(*suite) && t.result()->Skipped()) {
      std::printf("[  FAILED  ] %s.%s: not run, the SetUpTestSuite of %s failed (above)\n", t.test_suite_name(),
                  t.name(), t.test_suite_name());
      std::fflush(stdout);
      return;
    }
    printer_->OnTestEnd(t);
  }
  void OnTestSuiteEnd(const TestSuite& s) override { printer_->OnTestSuiteEnd(s); }
  void OnEnvironmentsTearDownStart(const UnitTest& u) override { printer_->OnEnvironmentsTearDownStart(u); }
  void OnEnvironmentsTearDownEnd(const UnitTest& u) override { printer_->OnEnvironmentsTearDownEnd(u); }
  void OnTestIterationEnd(const UnitTest& u, int i) override {
    std::vector<std::string> failed_setups;
    for (int s = 0; s < u.total_test_suite_count(); ++s) {
      const TestSuite& suite = *u.GetTestSuite(s);
      if (suite.should_run() && SetUpFailed(suite)) {
        failed_setups.push_back(std::string(suite.name()) + " (" + std::to_string(suite.test_to_run_count()) +
                                " cases not run)");
      }
    }
    if (failed_setups.empty()) {
      printer_->OnTestIterationEnd(u, i);
      return;
    }
    // GoogleTest's summary would list the cases not run as skipped.
    std::printf("[==========] %d tests from %d test suites ran.\n", u.test_to_run_count(), u.test_suite_to_run_count());
    for (const std::string& s : failed_setups) std::printf("[  FAILED  ] SetUpTestSuite of %s\n", s.c_str());
    std::printf("[  PASSED  ] %d tests.\n[  FAILED  ] %d other tests.\n", u.successful_test_count(), u.failed_test_count());
    std::fflush(stdout);
  }
  void OnTestProgramEnd(const UnitTest& u) override { printer_->OnTestProgramEnd(u); }

 private:
  const std::unique_ptr<TestEventListener> printer_;
};

}  // namespace

// The exit status of a run with skipped cases and no failure (tests/CMakeLists.txt's SKIP_RETURN_CODE).
constexpr int kSkipExitCode = 77;

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::TestEventListeners& listeners = UnitTest::GetInstance()->listeners();
  if (TestEventListener* printer = listeners.default_result_printer()) {
    listeners.Release(printer);
    listeners.Append(new Printer(printer));
  }
  const int status = RUN_ALL_TESTS();
  if (status == 0 && UnitTest::GetInstance()->skipped_test_count() > 0) return kSkipExitCode;
  return status;
}
