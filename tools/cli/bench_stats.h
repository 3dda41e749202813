// The statistics of `shardserve bench`: percentiles as numpy computes them by default (linear
// interpolation between closest ranks), summaries of latency samples, and inter-token latencies
// from the arrival times of a stream's messages. Header-only, no gRPC, so that tests/bench_stats_test.cc
// checks it against hand-computed values. Pure functions; thread-safe.
#ifndef SHARDSERVE_TOOLS_CLI_BENCH_STATS_H_
#define SHARDSERVE_TOOLS_CLI_BENCH_STATS_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace shardserve::cli {

// The p-th percentile (p in [0, 100]) of `sorted` (ascending), as numpy.percentile(x, p) with its
// default method "linear": the value at fractional rank r = p/100 * (n - 1), interpolated between
// sorted[floor(r)] and sorted[ceil(r)]. NaN for an empty input or a p outside [0, 100].
// Example: {1, 2, 3, 4}, p = 90: r = 2.7, 3 + 0.7 * (4 - 3) = 3.7.
inline double PercentileOfSorted(const std::vector<double>& sorted, double p) {
  if (sorted.empty() || !(p >= 0 && p <= 100)) return std::numeric_limits<double>::quiet_NaN();
  const double rank = p / 100.0 * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  const double frac = rank - static_cast<double>(lo);
  return sorted[lo] + frac * (sorted[hi] - sorted[lo]);
}

// Same, for samples in any order.
inline double Percentile(std::vector<double> samples, double p) {
  std::sort(samples.begin(), samples.end());
  return PercentileOfSorted(samples, p);
}

// What the report says about one kind of latency. Every field but `count` is NaN when there are
// no samples (printed as "-" in tables and null in JSON).
struct LatencySummary {
  size_t count = 0;
  double mean = std::numeric_limits<double>::quiet_NaN();
  double p50 = std::numeric_limits<double>::quiet_NaN();
  double p90 = std::numeric_limits<double>::quiet_NaN();
  double p99 = std::numeric_limits<double>::quiet_NaN();
  double max = std::numeric_limits<double>::quiet_NaN();
};

inline LatencySummary Summarize(std::vector<double> samples) {
  LatencySummary s;
  s.count = samples.size();
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  double sum = 0;
  for (double x : samples) sum += x;
  s.mean = sum / static_cast<double>(samples.size());
  s.p50 = PercentileOfSorted(samples, 50);
  s.p90 = PercentileOfSorted(samples, 90);
  s.p99 = PercentileOfSorted(samples, 99);
  s.max = samples.back();
  return s;
}

// Inter-token latencies of one stream. `arrival_s[i]` is when the i-th response message that carried
// tokens arrived and `tokens[i]` how many it carried (> 0). The first message's tokens have no
// inter-token latency (they are the time to first token); every later message contributes one
// sample per token, each (its arrival - the previous message's arrival) / its token count, so a
// message with 3 tokens 30 ms after the previous one gives three samples of 10 ms. Appends to
// `out`.
inline void AppendInterTokenLatencies(const std::vector<double>& arrival_s, const std::vector<int>& tokens,
                                      std::vector<double>* out) {
  const size_t n = std::min(arrival_s.size(), tokens.size());
  for (size_t i = 1; i < n; ++i) {
    if (tokens[i] <= 0) continue;
    const double each = (arrival_s[i] - arrival_s[i - 1]) / tokens[i];
    out->insert(out->end(), static_cast<size_t>(tokens[i]), each);
  }
}

}  // namespace shardserve::cli

#endif  // SHARDSERVE_TOOLS_CLI_BENCH_STATS_H_
