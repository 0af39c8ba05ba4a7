// Iteration-time statistics, with the conventions of nccl-tests
// (NVIDIA/nccl-tests src/util.cu computeIterStats; src/common.cu
// ReduceProcessMaxIterTimes):
//   * percentiles are nearest-rank on the sorted samples;
//   * with several ranks, one iteration's time is the MAX over ranks (the job
//     moves at the pace of its slowest rank);
//   * CV is the population standard deviation over the mean.
// Skew per iteration is max - min over ranks; a rank's straggler wait is its
// time minus the fastest rank's (DeepSpeed comms_logging's definition).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace pgd::core {

struct Summary {
  size_t count = 0;
  double mean = 0, stdev = 0, cv = 0;
  double min = 0, max = 0;
  double p50 = 0, p95 = 0, p99 = 0;

  std::string describe(const std::string& unit = "ms") const;
};

// Nearest-rank percentile (q in [0, 100]) of unsorted samples. Throws
// std::invalid_argument on an empty sample or q outside [0, 100].
double percentile(std::vector<double> samples, double q);

// Summary of one series. An empty series gives count == 0 and zeros.
Summary summarize(const std::vector<double>& samples);

struct CrossRankSummary {
  size_t ranks = 0;
  size_t iterations = 0;
  std::vector<double> iteration_max;  // per iteration, max over ranks
  std::vector<double> iteration_skew; // per iteration, max - min over ranks
  Summary max_over_ranks;             // summary of iteration_max
  Summary skew;                       // summary of iteration_skew
  std::vector<double> straggler_wait_mean;  // per rank: mean(t_rank - t_min)
};

// `per_rank[r][i]` is rank r's time for iteration i. All ranks must have the
// same number of iterations (std::invalid_argument otherwise).
CrossRankSummary summarize_across_ranks(
    const std::vector<std::vector<double>>& per_rank);

}  // namespace pgd::core
