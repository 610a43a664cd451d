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

FetchCostModel::FetchCostModel(double alpha, double margin, int probe_every)
    : alpha_(alpha), margin_(margin), probe_every_(probe_every) {
  if (!(alpha > 0 && alpha <= 1)) throw std::invalid_argument("FetchCostModel: alpha must be in (0, 1]");
  if (!(margin >= 1)) throw std::invalid_argument("FetchCostModel: margin must be at least 1");
  if (probe_every < 1) throw std::invalid_argument("FetchCostModel: probe_every must be at least 1");
}

void FetchCostModel::set_priors(double fetch_mb_per_s, double build_tokens_per_s, double staged_gb_per_s) {
  for (double r : {fetch_mb_per_s, build_tokens_per_s, staged_gb_per_s})
    if (!std::isfinite(r) || r < 0) throw std::invalid_argument("FetchCostModel: prior rates must be finite and non-negative");
  const double f = fetch_mb_per_s > 0 ? 1e-3 / fetch_mb_per_s : 0;  // 1 MB/s = 10^6 bytes per 1000 ms
  const double b = build_tokens_per_s > 0 ? 1e3 / build_tokens_per_s : 0;
  const double g = staged_gb_per_s > 0 ? 1e-6 / staged_gb_per_s : 0;  // 1 GB/s = 10^9 bytes per 1000 ms
  if (!std::isfinite(f) || !std::isfinite(b) || !std::isfinite(g))
    throw std::invalid_argument("FetchCostModel: prior rate too small");
  std::lock_guard<std::mutex> lock(mu_);
  fetch_ms_per_byte_ = build_ms_per_token_ = staged_ms_per_byte_ = std::nullopt;
  if (fetch_mb_per_s > 0) fetch_ms_per_byte_ = f;
  if (build_tokens_per_s > 0) build_ms_per_token_ = b;
  if (staged_gb_per_s > 0) staged_ms_per_byte_ = g;
  plans_without_fetch_ = 0;
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
  plans_without_fetch_ = 0;
}

void FetchCostModel::observe_build(int64_t tokens, double ms) {
  if (tokens <= 0 || !(ms > 0)) return;
  std::lock_guard<std::mutex> lock(mu_);
  ewma(build_ms_per_token_, ms / double(tokens), alpha_);
}

void FetchCostModel::observe_staged_splice(uint64_t bytes, double ms) {
  if (bytes == 0 || !(ms > 0)) return;
  std::lock_guard<std::mutex> lock(mu_);
  ewma(staged_ms_per_byte_, ms / double(bytes), alpha_);
}

void FetchCostModel::observe_prefill(double flops, double ms) {
  if (!(flops > 0) || !(ms > 0) || !std::isfinite(flops) || !std::isfinite(ms)) return;
  std::lock_guard<std::mutex> lock(mu_);
  ewma(prefill_ms_per_flop_, ms / flops, alpha_);
}

std::optional<double> FetchCostModel::prefill_ms_per_flop() const {
  std::lock_guard<std::mutex> lock(mu_);
  return prefill_ms_per_flop_;
}

StagedColdPlan FetchCostModel::plan_staged_cold(const StagedColdCase& c) const {
  StagedColdPlan out;
  const auto b = build_ms_per_token();
  const auto s = staged_ms_per_byte();
  if (!b || c.local_tokens <= 0 || !(c.local_flops > 0)) return out;
  out.staged_ms = double(c.local_tokens) * *b + (s ? double(c.staged_bytes) * *s : 0.0);
  const auto pf = prefill_ms_per_flop();
  out.full_ms = c.full_flops * (pf ? *pf : *b * double(c.local_tokens) / c.local_flops);
  out.full = out.full_ms < out.staged_ms;
  return out;
}

std::optional<double> FetchCostModel::staged_ms_per_byte() const {
  std::lock_guard<std::mutex> lock(mu_);
  return staged_ms_per_byte_;
}

std::optional<double> FetchCostModel::fetch_ms_per_byte() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fetch_ms_per_byte_;
}

std::optional<double> FetchCostModel::build_ms_per_token() const {
  std::lock_guard<std::mutex> lock(mu_);
  return build_ms_per_token_;
}

FetchPlan FetchCostModel::plan(std::vector<FetchCandidate> candidates, int64_t local_tokens, int parallelism) {
  FetchPlan out;
  const auto f = fetch_ms_per_byte();
  const auto b = build_ms_per_token();
  if (candidates.empty() || !f || !b || parallelism < 1) return out;
  const size_t n = candidates.size();
  const double local = double(std::max<int64_t>(local_tokens, 0));
  // The time to the last entry when the first m of `order` are rebuilt and the rest fetched.
  auto estimate = [&](const std::vector<FetchCandidate>& order, size_t m) {
    double bytes = 0, largest = 0, tokens = local;
    for (size_t i = 0; i < n; ++i) {
      if (i < m) {
        tokens += double(order[i].tokens);
      } else {
        bytes += double(order[i].wire_bytes);
        largest = std::max(largest, double(order[i].wire_bytes));
      }
    }
    return std::max(std::max(largest, bytes / double(parallelism)) * *f, tokens * *b);
  };
  std::vector<FetchCandidate> shortest = candidates, longest = candidates;
  std::stable_sort(shortest.begin(), shortest.end(),
                   [](const FetchCandidate& x, const FetchCandidate& y) { return x.tokens < y.tokens; });
  std::stable_sort(longest.begin(), longest.end(),
                   [](const FetchCandidate& x, const FetchCandidate& y) { return x.tokens > y.tokens; });
  out.fetch_all_ms = estimate(shortest, 0);
  const std::vector<FetchCandidate>* best_order = &shortest;
  size_t best_m = 0;
  double best = out.fetch_all_ms;
  for (const auto* order : {&shortest, &longest})
    for (size_t m = 1; m <= n; ++m)
      if (const double e = estimate(*order, m); e < best) best = e, best_m = m, best_order = order;
  if (best_m > 0 && best * margin_ > out.fetch_all_ms) best_m = 0, best = out.fetch_all_ms;  // not worth the switch
  if (best_m == n) {  // nothing fetched: a probe now and then keeps the smallest entry fetched
    std::lock_guard<std::mutex> lock(mu_);
    if (++plans_without_fetch_ >= probe_every_) {
      plans_without_fetch_ = 0;
      std::vector<FetchCandidate> order = *best_order;
      const auto smallest = std::min_element(order.begin(), order.end(), [](const auto& x, const auto& y) {
        return x.wire_bytes < y.wire_bytes;
      });
      std::rotate(smallest, smallest + 1, order.end());  // the smallest last: the one fetched
      shortest = std::move(order);
      best_order = &shortest;
      best = estimate(shortest, n - 1);
      best_m = n - 1;
      out.probe = true;
    }
  }
  out.chosen_ms = best;
  for (size_t i = 0; i < best_m; ++i) out.rebuild.push_back((*best_order)[i].slot);
  std::sort(out.rebuild.begin(), out.rebuild.end());
  return out;
}

}  // namespace hypic::combine
