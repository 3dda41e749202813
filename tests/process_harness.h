// Child processes for tests (tests/cluster_harness.h builds its clusters of coordinator and worker
// processes on it; tests/harness_test.cc tests it): a Process in a process group of its own, with
// its stdout and stderr in a log file, that dies with the test and is always reaped; the deadlines
// a test waits for a process, scaled by SHARDSERVE_TEST_TIME_SCALE.
//
// Sanitizer builds (tools/ci/sanitize.sh, whose header says where every report goes):
// - SHARDSERVE_TEST_TIME_SCALE, a decimal number from 1 to 1000 (default 1; tests/cli_check.py
//   reads it by the same rule, with the same error), multiplies every deadline a test waits for a
//   process (Process::Wait, the cluster's start, a stream's deadline, ...; a test's own wait loops
//   use ScaledSeconds or Scaled), for binaries that run slower under instrumentation (ASan about 3x,
//   ThreadSanitizer 5-15x).
// - A child reports on its stderr, which is its log: Process appends log_path=stderr to each
//   *SAN_OPTIONS variable it passes on (tools/ci/sanitize.sh asan-all points log_path at a directory
//   for the processes that nobody else watches). ~Process scans the log (SanitizerReport) and fails
//   the running test on a report, whether the child exited on it (halt_on_error), was killed later,
//   or ran on.
// - A child that dies of SIGABRT (a failed CHECK, std::terminate: tools/ci/sanitize.sh does not set
//   abort_on_error, so no sanitizer report ends that way), SIGSEGV, SIGBUS, SIGFPE or SIGILL (a
//   crash) fails the running test too.
//
// Single-threaded use.
#ifndef SHARDSERVE_TESTS_PROCESS_HARNESS_H_
#define SHARDSERVE_TESTS_PROCESS_HARNESS_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace shardserve {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

inline double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// SHARDSERVE_TEST_TIME_SCALE's value `text`: a decimal number (digits, optionally a point and
// digits) from 1 to 1000; 1 when `text` is empty. nullopt for anything else: a scale below 1 would
// shorten every deadline, one above 1000 would make a hang wait for CTest's limit; a typo must not
// do either silently. tests/cli_check.py's parse_time_scale() is the same rule.
inline std::optional<double> ParseTimeScale(std::string_view text) {
  if (text.empty()) return 1.0;
  const size_t point = text.find('.');
  const std::string_view whole = text.substr(0, point);
  const std::string_view fraction = point == std::string_view::npos ? "" : text.substr(point + 1);
  const auto digits = [](std::string_view s) {
    return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
  };
  if (!digits(whole) || (point != std::string_view::npos && !digits(fraction))) return std::nullopt;
  const double value = std::strtod(std::string(text).c_str(), nullptr);
  if (value < 1 || value > 1000) return std::nullopt;
  return value;
}

// The error for a refused SHARDSERVE_TEST_TIME_SCALE, word for word tests/cli_check.py's.
inline std::string TimeScaleError(std::string_view text) {
  return "SHARDSERVE_TEST_TIME_SCALE='" + std::string(text) + "': expected a number from 1 to 1000 (1 = unscaled)";
}

// SHARDSERVE_TEST_TIME_SCALE from the environment, read now; a refused value ends the test
// program (exit status 2) with TimeScaleError: a deadline silently left unscaled would fail as a
// hang instead.
inline double TimeScaleFromEnvironment() {
  const char* text = std::getenv("SHARDSERVE_TEST_TIME_SCALE");
  const std::optional<double> scale = ParseTimeScale(text == nullptr ? "" : text);
  if (!scale.has_value()) {
    std::fprintf(stderr, "%s\n", TimeScaleError(text).c_str());
    std::exit(2);
  }
  return *scale;
}

// SHARDSERVE_TEST_TIME_SCALE, read once.
inline double TimeScale() {
  static const double scale = TimeScaleFromEnvironment();
  return scale;
}
// A deadline the test waits for a process, times SHARDSERVE_TEST_TIME_SCALE.
inline double ScaledSeconds(double seconds) { return seconds * TimeScale(); }
template <typename Rep, typename Period>
std::chrono::milliseconds Scaled(std::chrono::duration<Rep, Period> timeout) {
  return std::chrono::milliseconds(static_cast<int64_t>(
      std::chrono::duration<double, std::milli>(timeout).count() * TimeScale()));
}

// The first line of `log` where a sanitizer report begins (ThreadSanitizer's, AddressSanitizer's,
// LeakSanitizer's or UndefinedBehaviorSanitizer's), or empty when there is none.
inline std::string SanitizerReport(const fs::path& log) {
  static const char* const kMarkers[] = {"WARNING: ThreadSanitizer:", "ERROR: AddressSanitizer:",
                                         "ERROR: LeakSanitizer:", ": runtime error: "};
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    for (const char* marker : kMarkers) {
      if (line.find(marker) != std::string::npos) return line;
    }
  }
  return "";
}

// The sanitizer options variables whose log_path Process points at the child's stderr.
inline constexpr std::string_view kSanitizerOptions[] = {"ASAN_OPTIONS=", "LSAN_OPTIONS=", "UBSAN_OPTIONS=",
                                                         "TSAN_OPTIONS="};

// The HOST:PORT that follows `key` on the first line of `log` that has it, up to `end`; empty when
// no line has it yet. The services bind port 0 and log the port they got: a port picked here and
// released could be taken by another process's port 0 before the service binds it (seen in CI: a
// worker's gRPC port had become another worker's /metrics port).
inline std::string LoggedAddress(const fs::path& log, const std::string& key, char end) {
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find(key);
    if (at == std::string::npos) continue;
    const size_t begin = at + key.size();
    return line.substr(begin, line.find(end, begin) - begin);
  }
  return "";
}

inline std::string Tail(const fs::path& file, size_t bytes = 3000) {
  std::ifstream in(file);
  std::stringstream s;
  s << in.rdbuf();
  const std::string text = s.str();
  return text.size() > bytes ? "..." + text.substr(text.size() - bytes) : text;
}

// A child process in a process group of its own, with stdout and stderr in a log file, and the
// environment of this process but for OPENBLAS_NUM_THREADS=1 and log_path=stderr in each of
// kSanitizerOptions that is set. It gets SIGKILL if this test process dies; the destructor kills
// and reaps it, and fails the test when the log has a sanitizer report (SanitizerReport). Reaping
// a child that crashed (CrashSignal) fails the test.
// The name of a signal that means the process crashed, or null.
inline const char* CrashSignal(int sig) {
  switch (sig) {
    case SIGABRT: return "SIGABRT";
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    default: return nullptr;
  }
}

class Process {
 public:
  Process(std::vector<std::string> argv, fs::path log) : log_(std::move(log)) {
    // Everything the child needs is built before fork: after it, only async-signal-safe calls.
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    std::vector<std::string> env_strings = {"OPENBLAS_NUM_THREADS=1"};
    for (char** e = environ; *e != nullptr; ++e) {
      std::string entry = *e;
      if (entry.rfind("OPENBLAS_NUM_THREADS=", 0) == 0) continue;
      for (std::string_view options : kSanitizerOptions) {
        // The last log_path wins: the report goes to the log this test scans.
        if (entry.rfind(options, 0) == 0) entry += entry.size() > options.size() ? ":log_path=stderr" : "log_path=stderr";
      }
      env_strings.push_back(std::move(entry));
    }
    std::vector<char*> env;
    for (std::string& e : env_strings) env.push_back(e.data());
    env.push_back(nullptr);
    const std::string log_path = log_.string();
    const pid_t parent = getpid();

    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the parent died before prctl
      const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
      }
      execve(args[0], args.data(), env.data());
      _exit(127);
    }
    if (pid_ > 0) setpgid(pid_, pid_);  // also here, so that a signal right after fork finds the group
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() {
    Kill();
    const std::string report = SanitizerReport(log_);
    if (!report.empty()) {
      ADD_FAILURE() << "a sanitizer report in " << log_.filename().string() << " (exit status " << exit_code_
                    << "): " << report << "\n" << Tail(log_, 12000);
    }
  }

  pid_t pid() const { return pid_; }
  const fs::path& log() const { return log_; }
  // Sends `sig` to the process's group.
  void Signal(int sig) {
    if (running()) kill(-pid_, sig);
  }
  bool running() {
    Reap(WNOHANG);
    return pid_ > 0 && !exited_;
  }
  // Waits up to `timeout` (times SHARDSERVE_TEST_TIME_SCALE) for the process to exit; its exit
  // status (WEXITSTATUS, or 128 + signal), or -1 when it is still running.
  int Wait(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + Scaled(timeout);
    while (running() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return exited_ ? exit_code_ : -1;
  }
  void Kill() {
    if (!running()) return;
    kill(-pid_, SIGKILL);
    Reap(0);
  }

 private:
  void Reap(int flags) {
    if (pid_ <= 0 || exited_) return;
    int status = 0;
    if (waitpid(pid_, &status, flags) == pid_) {
      exited_ = true;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      // No test crashes a process of ours: SIGABRT is a failed CHECK or an uncaught exception,
      // SIGSEGV, SIGBUS, SIGFPE and SIGILL a crash; each fails the test even where it does not look
      // at this process's exit. (A sanitizer report is caught by ~Process's scan of the log,
      // however the process ended.) Tests stop processes with SIGTERM or SIGKILL.
      if (WIFSIGNALED(status)) {
        if (const char* crash = CrashSignal(WTERMSIG(status))) {
          ADD_FAILURE() << log_.filename() << ": the process " << (WTERMSIG(status) == SIGABRT ? "aborted" : "crashed")
                        << " (" << crash << "):\n" << Tail(log_);
        }
      }
    }
  }

  const fs::path log_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int exit_code_ = -1;
};

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_PROCESS_HARNESS_H_
