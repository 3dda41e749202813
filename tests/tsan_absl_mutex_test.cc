// The check of tools/ci/tsan_absl_mutex.cc (TSan builds only, tests/CMakeLists.txt): variables guarded
// by absl::Mutex through every wrapped entry point (Lock, TryLock, ReaderLock, LockWhen, Await,
// CondVar waits) and written by several threads draw no report (without the annotations TSan
// reports each of them as a race: Debian's Abseil is not instrumented), while a real race still
// is reported: `tsan_absl_mutex_test race` must end in "WARNING: ThreadSanitizer: data race".
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace {

absl::Mutex mu;
absl::CondVar changed;
int counter = 0;  // guarded by mu
int turns = 0;    // guarded by mu
int racy = 0;     // not guarded: the race that must be reported

void Work(int id) {
  for (int i = 0; i < 200; ++i) {
    switch (i % 4) {
      case 0: {
        absl::MutexLock lock(&mu);
        ++counter;
        break;
      }
      case 1:
        while (!mu.TryLock()) {
        }
        ++counter;
        mu.Unlock();
        break;
      case 2: {
        absl::ReaderMutexLock lock(&mu);
        if (counter < 0) std::printf("impossible\n");
        break;
      }
      default:
        mu.LockWhen(absl::Condition(+[](int* c) { return *c >= 0; }, &counter));
        ++counter;
        mu.Unlock();
    }
  }
  // Take turns through a CondVar (Wait and WaitWithTimeout) and Await.
  absl::MutexLock lock(&mu);
  while (turns % 2 != id) {
    if (id == 0) {
      changed.Wait(&mu);
    } else {
      changed.WaitWithTimeout(&mu, absl::Milliseconds(10));
    }
  }
  ++turns;
  changed.SignalAll();
  mu.AwaitWithTimeout(absl::Condition(+[](int* t) { return *t >= 2; }, &turns), absl::Seconds(60));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "race") == 0) {
    std::thread t([] { ++racy; });
    ++racy;
    t.join();
    std::printf("racy %d\n", racy);
    return 0;
  }
  std::vector<std::thread> threads;
  for (int id = 0; id < 2; ++id) threads.emplace_back(Work, id);
  for (std::thread& t : threads) t.join();
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(+[](int* t) { return *t == 2; }, &turns));
  std::printf("counter %d turns %d: ok\n", counter, turns);
  return counter == 300 && turns == 2 ? 0 : 1;
}
