#include "iteration_stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace pgd::core {

double percentile(std::vector<double> samples, double q) {
  if (samples.empty()) {
    throw std::invalid_argument("percentile of an empty sample");
  }
  if (!(q >= 0.0 && q <= 100.0)) {
    throw std::invalid_argument("percentile q must be in [0, 100]");
  }
  std::sort(samples.begin(), samples.end());
  // Nearest rank: the smallest value with at least q% of samples <= it.
  const double n = static_cast<double>(samples.size());
  size_t rank = static_cast<size_t>(std::ceil(q / 100.0 * n));
  if (rank < 1) {
    rank = 1;
  }
  return samples[std::min(rank, samples.size()) - 1];
}

Summary summarize(const std::vector<double>& samples) {
  Summary s;
  s.count = samples.size();
  if (samples.empty()) {
    return s;
  }
  double sum = 0;
  for (double v : samples) {
    sum += v;
  }
  s.mean = sum / static_cast<double>(samples.size());
  double sq = 0;
  for (double v : samples) {
    sq += (v - s.mean) * (v - s.mean);
  }
  s.stdev = std::sqrt(sq / static_cast<double>(samples.size()));
  s.cv = s.mean != 0 ? s.stdev / s.mean : 0;
  auto [mn, mx] = std::minmax_element(samples.begin(), samples.end());
  s.min = *mn;
  s.max = *mx;
  s.p50 = percentile(samples, 50);
  s.p95 = percentile(samples, 95);
  s.p99 = percentile(samples, 99);
  return s;
}

std::string Summary::describe(const std::string& unit) const {
  // No iostreams in the core: see capture_fingerprint.cpp.
  const char* u = unit.c_str();
  char buf[256];
  std::snprintf(buf, sizeof(buf), "n=%zu p50=%.3f%s p95=%.3f%s p99=%.3f%s mean=%.3f%s cv=%.1f%%",
                count, p50, u, p95, u, p99, u, mean, u, cv * 100);
  return buf;
}

CrossRankSummary summarize_across_ranks(
    const std::vector<std::vector<double>>& per_rank) {
  CrossRankSummary out;
  out.ranks = per_rank.size();
  if (per_rank.empty()) {
    return out;
  }
  const size_t iters = per_rank[0].size();
  for (size_t r = 1; r < per_rank.size(); ++r) {
    if (per_rank[r].size() != iters) {
      throw std::invalid_argument(
          "rank " + std::to_string(r) + " has " +
          std::to_string(per_rank[r].size()) + " iterations, rank 0 has " +
          std::to_string(iters));
    }
  }
  out.iterations = iters;
  out.iteration_max.resize(iters);
  out.iteration_skew.resize(iters);
  out.straggler_wait_mean.assign(per_rank.size(), 0.0);
  for (size_t i = 0; i < iters; ++i) {
    double mx = per_rank[0][i];
    double mn = per_rank[0][i];
    for (const auto& rank : per_rank) {
      mx = std::max(mx, rank[i]);
      mn = std::min(mn, rank[i]);
    }
    out.iteration_max[i] = mx;
    out.iteration_skew[i] = mx - mn;
    for (size_t r = 0; r < per_rank.size(); ++r) {
      out.straggler_wait_mean[r] += per_rank[r][i] - mn;
    }
  }
  if (iters > 0) {
    for (double& w : out.straggler_wait_mean) {
      w /= static_cast<double>(iters);
    }
  }
  out.max_over_ranks = summarize(out.iteration_max);
  out.skew = summarize(out.iteration_skew);
  return out;
}

}  // namespace pgd::core
