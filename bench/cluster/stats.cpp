#include "bench/cluster/stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

namespace hypic::bench {

double percentile(std::vector<double> values, double p) {
  if (values.empty()) throw std::invalid_argument("percentile: empty sample");
  if (!(p >= 0.0 && p <= 100.0)) throw std::invalid_argument("percentile: p must be in [0, 100], got " + std::to_string(p));
  for (double v : values)
    if (std::isnan(v)) throw std::invalid_argument("percentile: the sample holds a NaN");
  std::sort(values.begin(), values.end());
  const double h = double(values.size() - 1) * p / 100.0;
  const size_t lo = size_t(std::floor(h));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (h - double(lo)) * (values[hi] - values[lo]);
}

Summary summarize(const std::vector<double>& values) {
  Summary s;
  if (values.empty()) return s;
  s.n = values.size();
  s.p50 = percentile(values, 50);
  s.p90 = percentile(values, 90);
  s.p99 = percentile(values, 99);
  s.min = *std::min_element(values.begin(), values.end());
  s.max = *std::max_element(values.begin(), values.end());
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / double(values.size());
  return s;
}

nlohmann::json to_json(const Summary& s) {
  return {{"n", s.n}, {"mean", s.mean}, {"min", s.min}, {"max", s.max}, {"p50", s.p50}, {"p90", s.p90}, {"p99", s.p99}};
}

}  // namespace hypic::bench
