// The router's registry of builds in flight (router/inflight_builds.h): a digest in flight is joined, not assigned
// again; load is counted once per build; after a worker failure the first re-planner starts the one rebuild and the
// others join it.
#include <catch2/catch.hpp>

#include "router/inflight_builds.h"

using namespace hypic::router;

namespace {
hypic::rpc::Digest digest_of(uint8_t n) {
  hypic::rpc::Digest d{};
  d.fill(n);
  return d;
}
std::vector<PlannedBuild> plan(InflightBuilds& b, std::vector<BuildJob> jobs, const std::vector<bool>& exclude = {}) {
  return b.plan(jobs, exclude);
}
}  // namespace

TEST_CASE("inflight builds: a digest in flight is joined on its worker, with no new load", "[inflight_builds]") {
  ScatterScheduler s(2, SchedulePolicy::Lpt);
  InflightBuilds b(s);
  const auto a = digest_of(1), c = digest_of(2);
  const auto first = plan(b, {{{0, 100}, a}, {{1, 50}, c}});
  REQUIRE(first.size() == 2);
  CHECK((first[0].segment == 0 && first[0].worker == 0 && !first[0].joined));
  CHECK((first[1].segment == 1 && first[1].worker == 1 && !first[1].joined));
  CHECK(s.queued_tokens(0) == 100);
  CHECK(s.queued_tokens(1) == 50);

  // Another request with the same digest (at another index) joins it on worker 0, although worker 1 is less loaded.
  const auto second = plan(b, {{{3, 100}, a}});
  REQUIRE(second.size() == 1);
  CHECK((second[0].segment == 3 && second[0].worker == 0 && second[0].joined));
  CHECK(s.queued_tokens(0) == 100);
  CHECK(b.builds() == 2);
  CHECK(b.holds() == 3);

  // Computed once: the load goes, once.
  b.computed(a, 0);
  b.computed(a, 0);
  CHECK(s.queued_tokens(0) == 0);
  // Still joinable while held (the worker keeps it until its cache put ends).
  b.release(a, 0);
  const auto third = plan(b, {{{0, 100}, a}});
  REQUIRE(third.size() == 1);
  CHECK(third[0].joined);
  CHECK(s.queued_tokens(0) == 0);
  b.release(a, 0);
  b.release(a, 0);
  CHECK(b.builds() == 1);
  // The last release of a build never computed removes its load.
  b.release(c, 1);
  CHECK(s.queued_tokens(1) == 0);
  CHECK(b.builds() == 0);
  CHECK(b.holds() == 0);
  b.release(c, 1);  // unknown: ignored
  CHECK(s.queued_tokens(1) == 0);
}

TEST_CASE("inflight builds: after a worker fails, one rebuild, which the other waiters join", "[inflight_builds]") {
  ScatterScheduler s(3, SchedulePolicy::Lpt);
  InflightBuilds b(s);
  const auto a = digest_of(7);
  // Three requests wait for one build on worker 0.
  for (int r = 0; r < 3; ++r) {
    const auto p = plan(b, {{{0, 40}, a}});
    REQUIRE(p.size() == 1);
    CHECK(p[0].worker == 0);
    CHECK(p[0].joined == (r > 0));
  }
  CHECK(s.queued_tokens(0) == 40);
  // Worker 0 dies: each request gives its hold back and plans the segment again without it.
  s.set_available(0, false);
  std::vector<bool> failed = {true, false, false};
  std::vector<PlannedBuild> again;
  for (int r = 0; r < 3; ++r) {
    b.release(a, 0);
    const auto p = plan(b, {{{0, 40}, a}}, failed);
    REQUIRE(p.size() == 1);
    again.push_back(p[0]);
  }
  CHECK(!again[0].joined);
  CHECK(again[0].worker == 1);
  CHECK((again[1].joined && again[1].worker == 1));
  CHECK((again[2].joined && again[2].worker == 1));
  CHECK(b.builds() == 1);
  CHECK(s.queued_tokens(0) == 0);
  CHECK(s.queued_tokens(1) == 40);
  CHECK(s.queued_tokens(2) == 0);
}

TEST_CASE("inflight builds: a request does not join a build on a worker it excludes, others do", "[inflight_builds]") {
  ScatterScheduler s(2, SchedulePolicy::Lpt);
  InflightBuilds b(s);
  const auto a = digest_of(3);
  REQUIRE(plan(b, {{{0, 10}, a}}).at(0).worker == 0);
  // The first request's delivery from worker 0 failed (worker 0 stays available for others): it re-plans elsewhere.
  b.release(a, 0);
  const auto p = plan(b, {{{0, 10}, a}}, {true, false});
  REQUIRE(p.size() == 1);
  CHECK((p[0].worker == 1 && !p[0].joined));
  // A new request joins the build on worker 1 (the only one tracked now).
  const auto q = plan(b, {{{2, 10}, a}});
  REQUIRE(q.size() == 1);
  CHECK((q[0].worker == 1 && q[0].joined));
}

TEST_CASE("inflight builds: one digest twice in a plan is one build, no worker leaves jobs out", "[inflight_builds]") {
  ScatterScheduler s(2, SchedulePolicy::RoundRobin);
  InflightBuilds b(s);
  const auto a = digest_of(4), c = digest_of(5);
  const auto p = plan(b, {{{0, 10}, a}, {{1, 20}, c}, {{2, 10}, a}});
  REQUIRE(p.size() == 3);
  CHECK((p[0].segment == 0 && !p[0].joined));
  CHECK((p[2].segment == 2 && p[2].joined && p[2].worker == p[0].worker));
  CHECK(s.queued_tokens(0) + s.queued_tokens(1) == 30);
  CHECK(b.holds() == 3);

  s.set_available(0, false);
  s.set_available(1, false);
  CHECK(plan(b, {{{0, 5}, digest_of(9)}}).empty());
  CHECK(plan(b, {{{0, 10}, a}}).empty());  // in flight, but on no available worker
  CHECK_THROWS_AS(plan(b, {{{0, 0}, a}}), std::invalid_argument);
}
