// tests/process_harness.h, which every multi-process test builds on: a child's sanitizer report or
// abort fails the test that started it, its reports go to its log whatever log_path this process
// was given, and SHARDSERVE_TEST_TIME_SCALE is read by the same rule as tests/cli_check.py's.
// Children here are /bin/sh one-liners: nothing to build beyond this file.
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>

#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "tests/process_harness.h"

namespace shardserve {
namespace {

// A directory of this process's for the children's logs (EXPECT_NONFATAL_FAILURE's statement sees
// no locals, hence a static).
const fs::path& LogDir() {
  static const fs::path dir = [] {
    fs::path d = fs::path(::testing::TempDir()) / ("harness_test." + std::to_string(getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

// Removes LogDir() when the program's cases are done.
class RemoveLogDir : public ::testing::Environment {
 public:
  void TearDown() override { fs::remove_all(LogDir()); }
};
::testing::Environment* const kRemoveLogDir = ::testing::AddGlobalTestEnvironment(new RemoveLogDir);

// Sets (or, with nullopt, unsets) an environment variable for the life of this object.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value.has_value()) {
      setenv(name, value->c_str(), 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_.has_value()) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* const name_;
  std::optional<std::string> old_;
};

// Runs `script` under /bin/sh as a Process logging to LOG_DIR/log, until it exits (at most 60 s).
void RunToItsEnd(const std::string& script, const std::string& log) {
  Process p({"/bin/sh", "-c", script}, LogDir() / log);
  p.Wait(std::chrono::seconds(60));
}

// A child that dies of SIGABRT (a failed CHECK, an uncaught exception), SIGSEGV, SIGBUS, SIGFPE or
// SIGILL fails the test, though the test never asks for its exit status; one that exits, or is
// killed, does not.
TEST(HarnessTest, AChildThatAbortsOrCrashesFailsTheTest) {
  EXPECT_NONFATAL_FAILURE(RunToItsEnd("echo about to abort; kill -ABRT $$", "abort.log"),
                          "the process aborted (SIGABRT):\nabout to abort");
  // A crash by any of the signals a fault raises.
  EXPECT_NONFATAL_FAILURE(RunToItsEnd("echo about to fault; kill -SEGV $$", "segv.log"),
                          "the process crashed (SIGSEGV):\nabout to fault");
  EXPECT_NONFATAL_FAILURE(RunToItsEnd("kill -BUS $$", "bus.log"), "the process crashed (SIGBUS)");
  EXPECT_NONFATAL_FAILURE(RunToItsEnd("kill -FPE $$", "fpe.log"), "the process crashed (SIGFPE)");
  EXPECT_NONFATAL_FAILURE(RunToItsEnd("kill -ILL $$", "ill.log"), "the process crashed (SIGILL)");
  Process exits({"/bin/sh", "-c", "exit 3"}, LogDir() / "exit.log");
  EXPECT_EQ(exits.Wait(std::chrono::seconds(60)), 3);
  Process killed({"/bin/sleep", "600"}, LogDir() / "kill.log");
  killed.Kill();
  EXPECT_FALSE(killed.running());
}

// A sanitizer report on a child's stderr fails the test when the child is reaped, whether the child
// exited on it (with the status halt_on_error gives: 1, or 66 for TSan) or was still running; each
// sanitizer's first line is recognized. A child whose log has none fails nothing.
TEST(HarnessTest, ASanitizerReportInAChildsLogFailsTheTest) {
  EXPECT_NONFATAL_FAILURE(
      {
        Process p({"/bin/sh", "-c",
                   "echo serving; echo '==7==ERROR: AddressSanitizer: heap-use-after-free on address 0x6' >&2; exit 1"},
                  LogDir() / "asan.log");
        p.Wait(std::chrono::seconds(60));
      },
      "a sanitizer report in asan.log (exit status 1): ==7==ERROR: AddressSanitizer: heap-use-after-free");
  EXPECT_NONFATAL_FAILURE(
      {
        Process p({"/bin/sh", "-c", "echo 'WARNING: ThreadSanitizer: data race (pid=9)' >&2; exit 66"},
                  LogDir() / "tsan.log");
        p.Wait(std::chrono::seconds(60));
      },
      "a sanitizer report in tsan.log (exit status 66): WARNING: ThreadSanitizer: data race");
  EXPECT_NONFATAL_FAILURE(
      {
        Process p({"/bin/sh", "-c", "echo 'worker/llama.cc:12:5: runtime error: signed integer overflow' >&2; exit 1"},
                  LogDir() / "ubsan.log");
        p.Wait(std::chrono::seconds(60));
      },
      "a sanitizer report in ubsan.log (exit status 1): worker/llama.cc:12:5: runtime error: signed integer overflow");
  // Still running when the test ends: killed, then its log is read.
  EXPECT_NONFATAL_FAILURE(
      {
        Process p({"/bin/sh", "-c", "echo '==8==ERROR: LeakSanitizer: detected memory leaks' >&2; exec sleep 600"},
                  LogDir() / "lsan.log");
        const auto start = Clock::now();
        while (SanitizerReport(p.log()).empty() && SecondsSince(start) < 60) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      },
      "a sanitizer report in lsan.log (exit status 137): ==8==ERROR: LeakSanitizer: detected memory leaks");
  Process clean({"/bin/sh", "-c", "echo 'ERROR: the model path is missing' >&2; exit 1"}, LogDir() / "clean.log");
  EXPECT_EQ(clean.Wait(std::chrono::seconds(60)), 1);
}

// A child's sanitizer reports go to its stderr (its log, which ~Process scans) whatever log_path
// this process was given (tools/ci/sanitize.sh asan-all points ASAN_OPTIONS's at a directory): the
// harness appends log_path=stderr to each *SAN_OPTIONS variable that is set, and sets none that
// is not.
TEST(HarnessTest, AChildsSanitizerReportsGoToItsLog) {
  ScopedEnv asan("ASAN_OPTIONS", "halt_on_error=1:log_path=/tmp/reports/report:log_exe_name=1");
  ScopedEnv lsan("LSAN_OPTIONS", std::nullopt);
  ScopedEnv ubsan("UBSAN_OPTIONS", "");
  ScopedEnv tsan("TSAN_OPTIONS", "halt_on_error=1");
  Process p({"/bin/sh", "-c",
             "echo \"asan[$ASAN_OPTIONS] lsan[${LSAN_OPTIONS-unset}] ubsan[$UBSAN_OPTIONS] tsan[$TSAN_OPTIONS]\""},
            LogDir() / "options.log");
  ASSERT_EQ(p.Wait(std::chrono::seconds(60)), 0);
  EXPECT_EQ(Tail(p.log()),
            "asan[halt_on_error=1:log_path=/tmp/reports/report:log_exe_name=1:log_path=stderr] lsan[unset] "
            "ubsan[log_path=stderr] tsan[halt_on_error=1:log_path=stderr]\n");
}

// SHARDSERVE_TEST_TIME_SCALE: a decimal number from 1 to 1000, 1 when empty; nothing else, so that
// no typo shortens or drops a deadline. tests/cli_check_test.py checks the Python side against the
// same values and the same message.
TEST(HarnessTest, TimeScaleIsADecimalFrom1To1000) {
  EXPECT_EQ(ParseTimeScale(""), 1.0);
  EXPECT_EQ(ParseTimeScale("1"), 1.0);
  EXPECT_EQ(ParseTimeScale("3"), 3.0);
  EXPECT_EQ(ParseTimeScale("2.5"), 2.5);
  EXPECT_EQ(ParseTimeScale("1000"), 1000.0);
  for (const char* refused : {"0", "0.5", "0.99", "1000.5", "1001", "-3", "abc", "3x", " 3", "3 ", "1e2", "inf",
                              "nan", "1.", ".5", "1_000", "0x10", "+3"}) {
    EXPECT_EQ(ParseTimeScale(refused), std::nullopt) << refused;
  }
  EXPECT_EQ(TimeScaleError("0.5"), "SHARDSERVE_TEST_TIME_SCALE='0.5': expected a number from 1 to 1000 (1 = unscaled)");
}

TEST(HarnessTest, ARefusedTimeScaleEndsTheTestProgram) {
  EXPECT_EXIT(
      {
        setenv("SHARDSERVE_TEST_TIME_SCALE", "0.5", 1);
        TimeScaleFromEnvironment();
      },
      ::testing::ExitedWithCode(2), "SHARDSERVE_TEST_TIME_SCALE='0.5': expected a number from 1 to 1000 \\(1 = unscaled\\)");
  ScopedEnv scale("SHARDSERVE_TEST_TIME_SCALE", "4");
  EXPECT_EQ(TimeScaleFromEnvironment(), 4.0);
}

}  // namespace
}  // namespace shardserve
