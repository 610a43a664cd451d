// Router scheduling: LPT (with queued work from concurrent requests) and round-robin.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <random>

#include "router/scheduler.h"

using hypic::router::Assignment;
using hypic::router::ScatterJob;
using hypic::router::ScatterScheduler;
using hypic::router::SchedulePolicy;

namespace {
std::vector<ScatterJob> jobs_of(const std::vector<int64_t>& tokens) {
  std::vector<ScatterJob> out;
  for (size_t i = 0; i < tokens.size(); ++i) out.push_back({uint32_t(i), tokens[i]});
  return out;
}
int64_t makespan(const std::vector<Assignment>& a, size_t m) {
  std::vector<int64_t> load(m, 0);
  for (const auto& x : a) load[x.worker] += x.tokens;
  return *std::max_element(load.begin(), load.end());
}
// Optimal makespan by exhaustive search over all m^n assignments (small n only).
int64_t optimal_makespan(const std::vector<int64_t>& t, size_t m) {
  const size_t n = t.size();
  size_t combos = 1;
  for (size_t i = 0; i < n; ++i) combos *= m;
  int64_t best = INT64_MAX;
  for (size_t c = 0; c < combos; ++c) {
    std::vector<int64_t> load(m, 0);
    size_t x = c;
    for (size_t i = 0; i < n; ++i, x /= m) load[x % m] += t[i];
    best = std::min(best, *std::max_element(load.begin(), load.end()));
  }
  return best;
}
}  // namespace

TEST_CASE("LPT: longest first, each to the least-loaded worker", "[scheduler]") {
  ScatterScheduler s(2, SchedulePolicy::Lpt);
  const auto a = s.assign(jobs_of({3, 7, 2, 5, 4, 3}));
  // Sorted: 7(s1) 5(s3) 4(s4) 3(s0) 3(s5) 2(s2). Loads: w0 7, w1 5 -> 4 to w1 (9) -> 3 to w0 (10)
  // -> 3 to w1 (12) -> 2 to w0 (12).
  const std::vector<std::pair<uint32_t, size_t>> expected = {{1, 0}, {3, 1}, {4, 1}, {0, 0}, {5, 1}, {2, 0}};
  REQUIRE(a.size() == expected.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].segment == expected[i].first);
    CHECK(a[i].worker == expected[i].second);
  }
  CHECK(s.queued_tokens(0) == 12);
  CHECK(s.queued_tokens(1) == 12);
  s.complete(0, 7);
  CHECK(s.queued_tokens(0) == 5);
}

TEST_CASE("LPT counts work queued by concurrent requests", "[scheduler]") {
  ScatterScheduler s(2, SchedulePolicy::Lpt);
  const auto first = s.assign(jobs_of({10}));
  REQUIRE(first[0].worker == 0);
  // A second request while the first is still queued: both its jobs avoid worker 0.
  const auto second = s.assign(jobs_of({4, 4}));
  CHECK(second[0].worker == 1);
  CHECK(second[1].worker == 1);
  // Once the first completes, worker 0 is the least loaded again.
  s.complete(0, 10);
  CHECK(s.assign(jobs_of({1}))[0].worker == 0);
}

TEST_CASE("LPT stays within Graham's 4/3 bound of the optimum", "[scheduler]") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t m = 2 + rng() % 2;
    const size_t n = 1 + rng() % 8;
    std::vector<int64_t> t(n);
    for (auto& x : t) x = 1 + rng() % 100;
    ScatterScheduler s(m, SchedulePolicy::Lpt);
    const auto a = s.assign(jobs_of(t));
    REQUIRE(a.size() == n);
    const double bound = (4.0 / 3.0 - 1.0 / (3.0 * double(m))) * double(optimal_makespan(t, m));
    CHECK(double(makespan(a, m)) <= bound + 1e-9);
  }
}

TEST_CASE("round-robin takes turns across requests and ignores sizes", "[scheduler]") {
  ScatterScheduler s(2, SchedulePolicy::RoundRobin);
  auto a = s.assign(jobs_of({100, 1, 1}));
  CHECK(a[0].worker == 0);
  CHECK(a[1].worker == 1);
  CHECK(a[2].worker == 0);
  a = s.assign(jobs_of({5}));
  CHECK(a[0].worker == 1);  // the turn carries over
  // On skewed sizes LPT does better: {100,1,1,1} -> LPT makespan 100, round-robin 101.
  ScatterScheduler rr(2, SchedulePolicy::RoundRobin), lpt(2, SchedulePolicy::Lpt);
  CHECK(makespan(rr.assign(jobs_of({100, 1, 1, 1})), 2) == 101);
  CHECK(makespan(lpt.assign(jobs_of({100, 1, 1, 1})), 2) == 100);
}

TEST_CASE("unavailable and excluded workers get nothing", "[scheduler]") {
  for (auto policy : {SchedulePolicy::Lpt, SchedulePolicy::RoundRobin}) {
    ScatterScheduler s(3, policy);
    s.set_available(1, false);
    CHECK(s.num_available() == 2);
    for (const auto& a : s.assign(jobs_of({5, 4, 3, 2, 1}), {true})) CHECK(a.worker == 2);
    s.set_available(2, false);
    CHECK(s.assign(jobs_of({5}), {true}).empty());  // nobody left: nothing assigned, no load added
    CHECK(s.queued_tokens(0) == 0);
    s.set_available(1, true);
    CHECK(s.assign(jobs_of({5}), {true})[0].worker == 1);
  }
}

TEST_CASE("scheduler input errors", "[scheduler]") {
  CHECK_THROWS_AS(ScatterScheduler(0, SchedulePolicy::Lpt), std::invalid_argument);
  ScatterScheduler s(1, SchedulePolicy::Lpt);
  CHECK_THROWS_WITH(s.assign(jobs_of({3, 0})), Catch::Contains("segment 1"));
  CHECK_THROWS_AS(s.complete(4, 1), std::out_of_range);
  CHECK(hypic::router::parse_schedule_policy("round-robin") == SchedulePolicy::RoundRobin);
  CHECK_THROWS_WITH(hypic::router::parse_schedule_policy("fifo"), Catch::Contains("lpt, round-robin"));
}
