// The fuzz targets' invariant check: a broken invariant prints what broke, prefixed with the
// target's name, and aborts, which libFuzzer reports as a crash and saves the input of.
// Header-only.
#ifndef SHARDSERVE_FUZZ_CHECK_H_
#define SHARDSERVE_FUZZ_CHECK_H_

#include <errno.h>  // program_invocation_short_name (glibc)

#include <cstdio>
#include <cstdlib>

namespace shardserve_fuzz {

inline void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "%s: %s\n", program_invocation_short_name, what);
  std::abort();
}

}  // namespace shardserve_fuzz

#endif  // SHARDSERVE_FUZZ_CHECK_H_
