#include "combine_worker/fetch_policy.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace hypic::combine {

CacheFetchPolicy parse_cache_fetch_policy(const std::string& s) {
  if (s == "auto") return CacheFetchPolicy::Auto;
  if (s == "always") return CacheFetchPolicy::Always;
  throw std::invalid_argument("--cache-fetch-policy: '" + s + "' is not one of auto, always");
}

FetchCostModel::FetchCostModel(double alpha, double margin) : alpha_(alpha), margin_(margin) {
  if (!(alpha > 0 && alpha <= 1)) throw std::invalid_argument("FetchCostModel: alpha must be in (0, 1]");
  if (!(margin >= 1)) throw std::invalid_argument("FetchCostModel: margin must be at least 1");
}

void FetchCostModel::set_priors(double fetch_mb_per_s, double build_tokens_per_s) {
  if (!std::isfinite(fetch_mb_per_s) || fetch_mb_per_s < 0 || !std::isfinite(build_tokens_per_s) ||
      build_tokens_per_s < 0)
    throw std::invalid_argument("FetchCostModel: prior rates must be finite and non-negative");
  std::lock_guard<std::mutex> lock(mu_);
  fetch_ms_per_byte_ = build_ms_per_token_ = std::nullopt;
  if (fetch_mb_per_s > 0) fetch_ms_per_byte_ = 1e-3 / fetch_mb_per_s;  // 1 MB/s = 10^6 bytes per 1000 ms
  if (build_tokens_per_s > 0) build_ms_per_token_ = 1e3 / build_tokens_per_s;
}

namespace {
void ewma(std::optional<double>& mean, double x, double alpha) {
  mean = mean ? (1 - alpha) * *mean + alpha * x : x;
}
}  // namespace

void FetchCostModel::observe_fetch(uint64_t bytes, double ms) {
  if (bytes == 0 || !(ms > 0)) return;
  std::lock_guard<std::mutex> lock(mu_);
  ewma(fetch_ms_per_byte_, ms / double(bytes), alpha_);
}

void FetchCostModel::observe_build(int64_t tokens, double ms) {
  if (tokens <= 0 || !(ms > 0)) return;
  std::lock_guard<std::mutex> lock(mu_);
  ewma(build_ms_per_token_, ms / double(tokens), alpha_);
}

std::optional<double> FetchCostModel::fetch_ms_per_byte() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fetch_ms_per_byte_;
}

std::optional<double> FetchCostModel::build_ms_per_token() const {
  std::lock_guard<std::mutex> lock(mu_);
  return build_ms_per_token_;
}

FetchPlan FetchCostModel::plan(std::vector<FetchCandidate> candidates, int64_t local_tokens, int parallelism) const {
  FetchPlan out;
  const auto f = fetch_ms_per_byte();
  const auto b = build_ms_per_token();
  if (candidates.empty() || !f || !b || parallelism < 1) return out;
  // Shortest first: the first m are rebuilt, the rest fetched.
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const FetchCandidate& x, const FetchCandidate& y) { return x.tokens < y.tokens; });
  const size_t n = candidates.size();
  std::vector<double> suffix_bytes(n + 1, 0.0);  // bytes of candidates m .. n - 1
  for (size_t i = n; i-- > 0;) suffix_bytes[i] = suffix_bytes[i + 1] + double(candidates[i].wire_bytes);
  auto estimate = [&](size_t m, double rebuilt_tokens) {
    const size_t fetched = n - m;
    const double fetch_ms =
        fetched == 0 ? 0.0
                     : double((fetched + size_t(parallelism) - 1) / size_t(parallelism)) *
                           (suffix_bytes[m] / double(fetched)) * *f;
    const double build_tokens = double(std::max<int64_t>(local_tokens, 0)) + rebuilt_tokens;
    return std::max(fetch_ms, build_tokens * *b);
  };
  out.fetch_all_ms = estimate(0, 0.0);
  size_t best_m = 0;
  double best = out.fetch_all_ms, rebuilt = 0;
  for (size_t m = 1; m <= n; ++m) {
    rebuilt += double(candidates[m - 1].tokens);
    const double e = estimate(m, rebuilt);
    if (e < best) best = e, best_m = m;
  }
  if (best_m > 0 && best * margin_ > out.fetch_all_ms) best_m = 0, best = out.fetch_all_ms;  // not worth the switch
  out.chosen_ms = best;
  for (size_t i = 0; i < best_m; ++i) out.rebuild.push_back(candidates[i].slot);
  std::sort(out.rebuild.begin(), out.rebuild.end());
  return out;
}

}  // namespace hypic::combine
