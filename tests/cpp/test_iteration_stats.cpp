#include <gtest/gtest.h>

#include <stdexcept>

#include "iteration_stats.h"

using pgd::core::percentile;
using pgd::core::summarize;
using pgd::core::summarize_across_ranks;

TEST(IterationStats, NearestRankPercentiles) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) {
    v.push_back(i);  // unsorted on purpose
  }
  EXPECT_DOUBLE_EQ(percentile(v, 50), 50);
  EXPECT_DOUBLE_EQ(percentile(v, 95), 95);
  EXPECT_DOUBLE_EQ(percentile(v, 99), 99);
  EXPECT_DOUBLE_EQ(percentile(v, 100), 100);
  EXPECT_DOUBLE_EQ(percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(percentile({7.0}, 99), 7.0);
  // Nearest rank on 3 samples: p50 is the 2nd.
  EXPECT_DOUBLE_EQ(percentile({3.0, 1.0, 2.0}, 50), 2.0);
}

TEST(IterationStats, PercentileRejectsBadInput) {
  EXPECT_THROW(percentile({}, 50), std::invalid_argument);
  EXPECT_THROW(percentile({1.0}, 101), std::invalid_argument);
  EXPECT_THROW(percentile({1.0}, -1), std::invalid_argument);
}

TEST(IterationStats, Summary) {
  auto s = summarize({2, 4, 4, 4, 5, 5, 7, 9});
  EXPECT_EQ(s.count, 8u);
  EXPECT_DOUBLE_EQ(s.mean, 5);
  EXPECT_DOUBLE_EQ(s.stdev, 2);  // population stdev of the classic example
  EXPECT_DOUBLE_EQ(s.cv, 0.4);
  EXPECT_DOUBLE_EQ(s.min, 2);
  EXPECT_DOUBLE_EQ(s.max, 9);
  EXPECT_DOUBLE_EQ(s.p50, 4);
  auto empty = summarize({});
  EXPECT_EQ(empty.count, 0u);
  EXPECT_NE(s.describe().find("p99=9.000ms"), std::string::npos) << s.describe();
}

TEST(IterationStats, CrossRankUsesMaxAndSkew) {
  // Rank 1 has a 5 ms hiccup in iteration 2.
  std::vector<std::vector<double>> t = {{1, 1, 1, 1}, {1, 1, 6, 1}};
  auto x = summarize_across_ranks(t);
  EXPECT_EQ(x.ranks, 2u);
  EXPECT_EQ(x.iterations, 4u);
  EXPECT_EQ(x.iteration_max, (std::vector<double>{1, 1, 6, 1}));
  EXPECT_EQ(x.iteration_skew, (std::vector<double>{0, 0, 5, 0}));
  EXPECT_DOUBLE_EQ(x.max_over_ranks.max, 6);
  EXPECT_DOUBLE_EQ(x.skew.max, 5);
  EXPECT_DOUBLE_EQ(x.straggler_wait_mean[0], 0);
  EXPECT_DOUBLE_EQ(x.straggler_wait_mean[1], 1.25);
}

TEST(IterationStats, CrossRankRejectsRaggedInput) {
  EXPECT_THROW(summarize_across_ranks({{1, 2}, {1}}), std::invalid_argument);
  EXPECT_EQ(summarize_across_ranks({}).ranks, 0u);
}
