// Helpers of the whole-backend GPU tests (test_gpu_backend, test_gpu_families_backend): random prompts, greedy picks
// and the full-recomputation plan.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "engine/backend.h"

namespace hypic::gputest {

/// n token ids uniform in [0, vocab).
inline std::vector<int32_t> random_ids(std::mt19937& rng, size_t n, int64_t vocab) {
  std::uniform_int_distribution<int32_t> d(0, int32_t(vocab - 1));
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

/// Index of the largest of p[0, n) (the first on ties).
inline int argmax(const float* p, size_t n) { return int(std::max_element(p, p + n) - p); }

/// Top-1 / top-2 gap relative to the logit spread (max - min) of p[0, n).
inline double margin(const float* p, size_t n) {
  float a = -INFINITY, b = -INFINITY, lo = INFINITY;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] > a) b = a, a = p[i];
    else if (p[i] > b) b = p[i];
    lo = std::min(lo, p[i]);
  }
  return (a - b) / std::max(1e-6f, a - lo);
}

/// Full recomputation of ids: ids[0, first) as one segment, the rest as the query (all its logits when all_logits).
inline engine::SplicePlan full_plan(const std::vector<int32_t>& ids, size_t first, bool all_logits) {
  engine::SplicePlan p;
  p.mode = engine::SpliceMode::Full;
  p.segments.push_back({std::vector<int32_t>(ids.begin(), ids.begin() + first), nullptr});
  p.query.assign(ids.begin() + first, ids.end());
  p.all_query_logits = all_logits;
  return p;
}

}  // namespace hypic::gputest
