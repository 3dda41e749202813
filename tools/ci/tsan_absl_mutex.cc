// ThreadSanitizer annotations for Debian's absl::Mutex and absl::CondVar (tools/ci/sanitize.sh tsan
// links this file into every test program of a -DSHARDSERVE_SANITIZE=thread build).
//
// Why: the build uses Debian's abseil shared libraries, compiled without -fsanitize=thread, so
// their Mutex carries no TSan annotations (Abseil adds them only when it is itself built with
// TSan) and locks by atomics and futexes that TSan does not see. Every variable our code guards
// with an absl::Mutex would then be reported as a data race. This file interposes the exported
// Mutex and CondVar entry points (the executable's definitions come before libabsl's in symbol
// lookup, for our code and for gRPC's, which locks through the same functions), calls the real
// ones (dlsym RTLD_NEXT) and tells TSan what they did with its mutex annotation API: a lock is
// an acquire, an unlock a release, a CondVar wait an unlock and a lock. Await and LockWhen
// evaluate their Condition inside the library while really holding the lock, but before TSan is
// told so: those evaluations are ignored (TSan's AnnotateIgnoreReads/WritesBegin), and the lock is annotated
// once they return, which gives the acquire from every earlier unlock.
//
// Not built into anything but TSan builds. Threading: the wrappers are as thread-safe as the
// functions they wrap; the real function pointers are resolved once (function-local statics).
#if !defined(__SANITIZE_THREAD__)
#error "tools/ci/tsan_absl_mutex.cc is for -fsanitize=thread builds only"
#endif

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#define SHARDSERVE_STR2(x) #x
#define SHARDSERVE_STR(x) SHARDSERVE_STR2(x)

// TSan's dynamic annotations (libtsan exports them; no header declares them).
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);

namespace {

// Our code's reads and writes on this thread are not checked between the two (the Condition
// evaluated inside Await and LockWhen, under the real lock).
void IgnoreBegin() {
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
}
void IgnoreEnd() {
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
}

// "_ZN4absl<len><inline namespace>" + rest: the mangled name of an absl symbol.
std::string Mangled(const char* rest) {
  const std::string ns = SHARDSERVE_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  return "_ZN4absl" + std::to_string(ns.size()) + ns + rest;
}

template <typename Fn>
Fn Real(const char* rest) {
  const std::string name = Mangled(rest);
  void* f = dlsym(RTLD_NEXT, name.c_str());
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_mutex: %s not found in libabsl (another Abseil version?)\n", name.c_str());
    std::abort();
  }
  return reinterpret_cast<Fn>(f);
}

// Some entry points call others through the PLT (AwaitWithTimeout calls AwaitWithDeadline,
// CondVar::WaitWithTimeout WaitWithDeadline, ...), which would land in these wrappers again: only
// the outermost wrapper on a thread annotates.
thread_local int depth = 0;
struct Outer {
  Outer() : outermost(depth++ == 0) {}
  ~Outer() { --depth; }
  const bool outermost;
};

void Acquired(void* mu, unsigned flags = 0) {
  __tsan_mutex_pre_lock(mu, flags);
  __tsan_mutex_post_lock(mu, flags, 0);
}

void Released(void* mu, unsigned flags = 0) {
  __tsan_mutex_pre_unlock(mu, flags);
  __tsan_mutex_post_unlock(mu, flags);
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

Mutex::~Mutex() {
  static auto real = Real<void (*)(Mutex*)>("5MutexD2Ev");
  Outer outer;
  if (!outer.outermost) {
    real(this);
    return;
  }
  __tsan_mutex_destroy(this, 0);
  real(this);
}

void Mutex::Lock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  Outer outer;
  if (!outer.outermost) {
    real(this);
    return;
  }
  __tsan_mutex_pre_lock(this, 0);
  real(this);
  __tsan_mutex_post_lock(this, 0, 0);
}

void Mutex::Unlock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  Outer outer;
  if (!outer.outermost) {
    real(this);
    return;
  }
  __tsan_mutex_pre_unlock(this, 0);
  real(this);
  __tsan_mutex_post_unlock(this, 0);
}

bool Mutex::TryLock() {
  static auto real = Real<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  Outer outer;
  if (!outer.outermost) return real(this);
  __tsan_mutex_pre_lock(this, __tsan_mutex_try_lock);
  const bool locked = real(this);
  __tsan_mutex_post_lock(this, locked ? __tsan_mutex_try_lock : __tsan_mutex_try_lock_failed, 0);
  return locked;
}

void Mutex::ReaderLock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  Outer outer;
  if (!outer.outermost) {
    real(this);
    return;
  }
  __tsan_mutex_pre_lock(this, __tsan_mutex_read_lock);
  real(this);
  __tsan_mutex_post_lock(this, __tsan_mutex_read_lock, 0);
}

void Mutex::ReaderUnlock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  Outer outer;
  if (!outer.outermost) {
    real(this);
    return;
  }
  __tsan_mutex_pre_unlock(this, __tsan_mutex_read_lock);
  real(this);
  __tsan_mutex_post_unlock(this, __tsan_mutex_read_lock);
}

bool Mutex::ReaderTryLock() {
  static auto real = Real<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  Outer outer;
  if (!outer.outermost) return real(this);
  __tsan_mutex_pre_lock(this, __tsan_mutex_read_lock | __tsan_mutex_try_lock);
  const bool locked = real(this);
  __tsan_mutex_post_lock(this,
                         __tsan_mutex_read_lock | (locked ? __tsan_mutex_try_lock : __tsan_mutex_try_lock_failed), 0);
  return locked;
}

void Mutex::LockWhen(const Condition& cond) {
  static auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex8LockWhenERKNS0_9ConditionE");
  Outer outer;
  if (!outer.outermost) {
    real(this, cond);
    return;
  }
  IgnoreBegin();
  real(this, cond);
  IgnoreEnd();
  Acquired(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  Outer outer;
  if (!outer.outermost) return real(this, cond, timeout);
  IgnoreBegin();
  const bool r = real(this, cond, timeout);
  IgnoreEnd();
  Acquired(this);
  return r;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  Outer outer;
  if (!outer.outermost) return real(this, cond, deadline);
  IgnoreBegin();
  const bool r = real(this, cond, deadline);
  IgnoreEnd();
  Acquired(this);
  return r;
}

void Mutex::Await(const Condition& cond) {
  static auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex5AwaitERKNS0_9ConditionE");
  Outer outer;
  if (!outer.outermost) {
    real(this, cond);
    return;
  }
  Released(this);
  IgnoreBegin();
  real(this, cond);
  IgnoreEnd();
  Acquired(this);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  Outer outer;
  if (!outer.outermost) return real(this, cond, timeout);
  Released(this);
  IgnoreBegin();
  const bool r = real(this, cond, timeout);
  IgnoreEnd();
  Acquired(this);
  return r;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  Outer outer;
  if (!outer.outermost) return real(this, cond, deadline);
  Released(this);
  IgnoreBegin();
  const bool r = real(this, cond, deadline);
  IgnoreEnd();
  Acquired(this);
  return r;
}

void CondVar::Wait(Mutex* mu) {
  static auto real = Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  Outer outer;
  if (!outer.outermost) {
    real(this, mu);
    return;
  }
  Released(mu);
  real(this, mu);
  Acquired(mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static auto real =
      Real<bool (*)(CondVar*, Mutex*, Duration)>("7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  Outer outer;
  if (!outer.outermost) return real(this, mu, timeout);
  Released(mu);
  const bool r = real(this, mu, timeout);
  Acquired(mu);
  return r;
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static auto real =
      Real<bool (*)(CondVar*, Mutex*, Time)>("7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  Outer outer;
  if (!outer.outermost) return real(this, mu, deadline);
  Released(mu);
  const bool r = real(this, mu, deadline);
  Acquired(mu);
  return r;
}

ABSL_NAMESPACE_END
}  // namespace absl
