// Helpers the kernel benchmarks (bench_matmul, bench_attention) share: their flags and medians.
#ifndef SHARDSERVE_TOOLS_BENCH_UTIL_H_
#define SHARDSERVE_TOOLS_BENCH_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace shardserve::bench {

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The number after `name` on the command line ("--repeat 7"), or `fallback`.
inline int64_t Flag(int argc, char** argv, const char* name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  }
  return fallback;
}

}  // namespace shardserve::bench

#endif  // SHARDSERVE_TOOLS_BENCH_UTIL_H_
