#include "router/scheduler.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace hypic::router {

SchedulePolicy parse_schedule_policy(std::string_view name) {
  if (name == "lpt") return SchedulePolicy::Lpt;
  if (name == "round-robin") return SchedulePolicy::RoundRobin;
  throw std::invalid_argument("schedule policy: unknown \"" + std::string(name) + "\" (valid: lpt, round-robin)");
}

const char* schedule_policy_name(SchedulePolicy policy) {
  return policy == SchedulePolicy::Lpt ? "lpt" : "round-robin";
}

ScatterScheduler::ScatterScheduler(size_t num_workers, SchedulePolicy policy)
    : policy_(policy), queued_(num_workers, 0), available_(num_workers, true) {
  if (num_workers == 0) throw std::invalid_argument("scatter workers: at least one is needed");
}

void ScatterScheduler::check_worker(size_t worker) const {
  if (worker >= queued_.size()) {
    throw std::out_of_range("scatter worker " + std::to_string(worker) + ": only " + std::to_string(queued_.size()) +
                            " configured");
  }
}

std::vector<Assignment> ScatterScheduler::assign(std::span<const ScatterJob> jobs, const std::vector<bool>& exclude) {
  for (const auto& j : jobs) {
    if (j.tokens < 1) {
      throw std::invalid_argument("scatter job for segment " + std::to_string(j.segment) +
                                  ": tokens must be >= 1, got " + std::to_string(j.tokens));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  const size_t m = queued_.size();
  auto eligible = [&](size_t w) { return available_[w] && !(w < exclude.size() && exclude[w]); };
  std::vector<Assignment> out;
  if (jobs.empty()) return out;
  bool any = false;
  for (size_t w = 0; w < m; ++w) any = any || eligible(w);
  if (!any) return out;

  if (policy_ == SchedulePolicy::Lpt) {
    std::vector<ScatterJob> order(jobs.begin(), jobs.end());
    std::stable_sort(order.begin(), order.end(), [](const ScatterJob& a, const ScatterJob& b) {
      return a.tokens > b.tokens || (a.tokens == b.tokens && a.segment < b.segment);
    });
    for (const auto& j : order) {
      size_t best = m;
      for (size_t w = 0; w < m; ++w) {
        if (eligible(w) && (best == m || queued_[w] < queued_[best])) best = w;
      }
      queued_[best] += j.tokens;
      out.push_back({j.segment, best, j.tokens});
    }
  } else {
    for (const auto& j : jobs) {
      while (!eligible(cursor_ % m)) ++cursor_;
      const size_t w = cursor_++ % m;
      queued_[w] += j.tokens;
      out.push_back({j.segment, w, j.tokens});
    }
    cursor_ %= m;
  }
  return out;
}

void ScatterScheduler::complete(size_t worker, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  check_worker(worker);
  queued_[worker] = std::max<int64_t>(0, queued_[worker] - tokens);
}

void ScatterScheduler::set_available(size_t worker, bool available) {
  std::lock_guard<std::mutex> lock(mu_);
  check_worker(worker);
  available_[worker] = available;
}

bool ScatterScheduler::available(size_t worker) const {
  std::lock_guard<std::mutex> lock(mu_);
  check_worker(worker);
  return available_[worker];
}

size_t ScatterScheduler::num_available() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<size_t>(std::count(available_.begin(), available_.end(), true));
}

int64_t ScatterScheduler::queued_tokens(size_t worker) const {
  std::lock_guard<std::mutex> lock(mu_);
  check_worker(worker);
  return queued_[worker];
}

}  // namespace hypic::router
