// tools/cli/bench_stats.h: percentiles as numpy.percentile computes them by default (method
// "linear"), latency summaries, and inter-token latencies from message arrival times. Expected
// values are worked out by hand in the comments (rank r = p/100 * (n - 1), interpolated between
// the neighbours); the tolerance 1e-12 only absorbs double rounding.
#include "tools/cli/bench_stats.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace shardserve::cli {
namespace {

constexpr double kTol = 1e-12;

TEST(BenchStats, PercentileInterpolatesLinearlyBetweenRanks) {
  const std::vector<double> x = {1, 2, 3, 4};
  EXPECT_NEAR(Percentile(x, 0), 1.0, kTol);
  EXPECT_NEAR(Percentile(x, 50), 2.5, kTol);   // r = 1.5: 2 + 0.5 * (3 - 2)
  EXPECT_NEAR(Percentile(x, 90), 3.7, kTol);   // r = 2.7: 3 + 0.7 * (4 - 3)
  EXPECT_NEAR(Percentile(x, 99), 3.97, kTol);  // r = 2.97
  EXPECT_NEAR(Percentile(x, 100), 4.0, kTol);
}

TEST(BenchStats, PercentileMatchesNumpyOnUnevenGaps) {
  // numpy.percentile([15, 20, 35, 40, 50], [40, 90, 99]) == [29.0, 46.0, 49.6]
  const std::vector<double> x = {40, 15, 50, 35, 20};  // any order
  EXPECT_NEAR(Percentile(x, 40), 29.0, kTol);          // r = 1.6: 20 + 0.6 * (35 - 20)
  EXPECT_NEAR(Percentile(x, 90), 46.0, kTol);          // r = 3.6: 40 + 0.6 * (50 - 40)
  EXPECT_NEAR(Percentile(x, 99), 49.6, kTol);          // r = 3.96: 40 + 0.96 * 10
  EXPECT_NEAR(Percentile({3, 1, 2}, 25), 1.5, kTol);   // r = 0.5
}

TEST(BenchStats, PercentileOfOneSampleIsThatSample) {
  for (double p : {0.0, 50.0, 99.0, 100.0}) EXPECT_EQ(Percentile({0.25}, p), 0.25);
}

TEST(BenchStats, PercentileOfNothingOrOutOfRangeIsNaN) {
  EXPECT_TRUE(std::isnan(Percentile({}, 50)));
  EXPECT_TRUE(std::isnan(PercentileOfSorted({}, 0)));
  EXPECT_TRUE(std::isnan(Percentile({1, 2}, -1)));
  EXPECT_TRUE(std::isnan(Percentile({1, 2}, 100.5)));
  EXPECT_TRUE(std::isnan(Percentile({1, 2}, std::nan(""))));
}

TEST(BenchStats, SummarizeOneToHundred) {
  std::vector<double> x;
  for (int i = 100; i >= 1; --i) x.push_back(i);
  const LatencySummary s = Summarize(x);
  EXPECT_EQ(s.count, 100u);
  EXPECT_NEAR(s.mean, 50.5, kTol);
  EXPECT_NEAR(s.p50, 50.5, kTol);   // r = 49.5
  EXPECT_NEAR(s.p90, 90.1, kTol);   // r = 89.1: 90 + 0.1
  EXPECT_NEAR(s.p99, 99.01, kTol);  // r = 98.01: 99 + 0.01
  EXPECT_EQ(s.max, 100.0);
}

TEST(BenchStats, SummarizeNothingIsAllNaN) {
  const LatencySummary s = Summarize({});
  EXPECT_EQ(s.count, 0u);
  EXPECT_TRUE(std::isnan(s.mean));
  EXPECT_TRUE(std::isnan(s.p50));
  EXPECT_TRUE(std::isnan(s.p90));
  EXPECT_TRUE(std::isnan(s.p99));
  EXPECT_TRUE(std::isnan(s.max));
}

TEST(BenchStats, InterTokenLatencySplitsAMessageOverItsTokens) {
  // Messages at 0.10 s (2 tokens: the first token's time, no ITL), 0.13 s (1 token), 0.19 s (3
  // tokens): 0.03, then 0.06 / 3 = 0.02 three times.
  std::vector<double> itl = {7.0};  // appended to, not replaced
  AppendInterTokenLatencies({0.10, 0.13, 0.19}, {2, 1, 3}, &itl);
  ASSERT_EQ(itl.size(), 5u);
  EXPECT_EQ(itl[0], 7.0);
  EXPECT_NEAR(itl[1], 0.03, kTol);
  for (int i = 2; i < 5; ++i) EXPECT_NEAR(itl[i], 0.02, kTol);
}

TEST(BenchStats, InterTokenLatencyOfOneOrNoMessageIsEmpty) {
  std::vector<double> itl;
  AppendInterTokenLatencies({}, {}, &itl);
  AppendInterTokenLatencies({0.5}, {4}, &itl);
  EXPECT_TRUE(itl.empty());
}

}  // namespace
}  // namespace shardserve::cli
