// Latency statistics of the cluster benchmark (bench/cluster).
#pragma once
#include <cstddef>
#include <vector>

#include <nlohmann/json.hpp>

namespace hypic::bench {

/// The p-th percentile (p in [0, 100]) of `values` by linear interpolation between the closest ranks
/// (Hyndman & Fan type 7, the default of numpy.percentile and R's quantile): with the values sorted
/// ascending as x_0..x_{n-1}, h = (n - 1) p / 100 and the result is x_floor(h) + (h - floor(h)) *
/// (x_floor(h)+1 - x_floor(h)). Units are those of the values. Throws std::invalid_argument when
/// `values` is empty, holds a NaN, or p is outside [0, 100].
double percentile(std::vector<double> values, double p);

/// Summary of a latency sample (milliseconds).
struct Summary {
  size_t n = 0;
  double mean = 0, min = 0, max = 0, p50 = 0, p90 = 0, p99 = 0;
};

/// Summary of `values`; all fields stay 0 for an empty sample. Throws std::invalid_argument on a NaN.
Summary summarize(const std::vector<double>& values);

/// {"n", "mean", "min", "max", "p50", "p90", "p99"}.
nlohmann::json to_json(const Summary& s);

}  // namespace hypic::bench
