// The router's per-segment plan (router/segment_plan.h) on hand-made lookups: each case's roles written out.
#include <catch2/catch.hpp>

#include "router/segment_plan.h"

using namespace hypic;
using router::SegmentRole;
using R = SegmentRole;

namespace {

rpc::Digest d(uint8_t k) {
  rpc::Digest x{};
  x[0] = k;
  return x;
}

router::SegmentPlan plan(std::vector<uint8_t> keys, std::vector<bool> hits, engine::SpliceMode mode, int tail = 0,
                         std::vector<bool> building = {}) {
  std::vector<rpc::Digest> ds;
  for (uint8_t k : keys) ds.push_back(d(k));
  return router::plan_segments(ds, hits, mode, tail, building);
}

}  // namespace

TEST_CASE("segment plan: hits are warm, cold first occurrences are built, repeats use their first", "[router][plan]") {
  // digests A B A C B, hits: B only
  const auto p = plan({1, 2, 1, 3, 2}, {false, true, false, false, true}, engine::SpliceMode::Hypic);
  CHECK(p.roles == std::vector<R>{R::Build, R::Warm, R::Repeat, R::Build, R::Repeat});
  CHECK(p.repeat_of[2] == 0u);
  CHECK(p.repeat_of[4] == 1u);
  CHECK_FALSE(p.repeat_of[0].has_value());
  CHECK(p.builds == std::vector<uint32_t>{0, 3});
}

TEST_CASE("segment plan: the refresh tail's cold segments are whole, never segment 0, only in hypic mode",
          "[router][plan]") {
  // 4 segments, tail 2: segments 2 and 3; 2 is cold, 3 is warm
  auto p = plan({1, 2, 3, 4}, {false, false, false, true}, engine::SpliceMode::Hypic, 2);
  CHECK(p.roles == std::vector<R>{R::Build, R::Build, R::Whole, R::Warm});
  CHECK(p.builds == std::vector<uint32_t>{0, 1});
  // a tail longer than the prompt still leaves segment 0 out
  p = plan({1, 2, 3}, {false, false, false}, engine::SpliceMode::Hypic, 9);
  CHECK(p.roles == std::vector<R>{R::Build, R::Whole, R::Whole});
  // a repeat of a whole segment is whole too; a repeat, in the tail, of a segment built before it stays a repeat
  p = plan({1, 2, 2, 1}, {false, false, false, false}, engine::SpliceMode::Hypic, 3);
  CHECK(p.roles == std::vector<R>{R::Build, R::Whole, R::Whole, R::Repeat});
  CHECK(p.repeat_of[3] == 0u);
  CHECK_FALSE(p.repeat_of[2].has_value());
  CHECK(p.builds == std::vector<uint32_t>{0});
  // other entry modes have no refresh: the tail is ignored
  p = plan({1, 2, 3}, {false, false, false}, engine::SpliceMode::Naive, 2);
  CHECK(p.roles == std::vector<R>{R::Build, R::Build, R::Build});
}

TEST_CASE("segment plan: a hit that is only a build in flight is cold in the refresh tail, warm before it",
          "[router][plan]") {
  // 4 segments, tail 2; segments 1 and 3 are hits only as builds in flight on the combine worker, 2 a real hit
  auto p = plan({1, 2, 3, 4}, {false, true, true, true}, engine::SpliceMode::Hypic, 2, {false, true, false, true});
  CHECK(p.roles == std::vector<R>{R::Build, R::Warm, R::Warm, R::Whole});
  CHECK(p.builds == std::vector<uint32_t>{0});
  // a repeat in the tail of a segment built in flight before the tail stays a repeat (of a warm segment)
  p = plan({1, 2, 2}, {false, true, true}, engine::SpliceMode::Hypic, 1, {false, true, true});
  CHECK(p.roles == std::vector<R>{R::Build, R::Warm, R::Repeat});
  // no tail: every such hit is warm (the request joins the build)
  p = plan({1, 2}, {true, true}, engine::SpliceMode::Hypic, 0, {true, true});
  CHECK(p.roles == std::vector<R>{R::Warm, R::Warm});
}

TEST_CASE("segment plan: full and prefix modes splice no entries", "[router][plan]") {
  for (auto mode : {engine::SpliceMode::Full, engine::SpliceMode::Prefix}) {
    const auto p = plan({1, 1, 2}, {false, true, false}, mode, 1);
    CHECK(p.roles == std::vector<R>{R::InContext, R::InContext, R::InContext});
    CHECK(p.builds.empty());
    CHECK_FALSE(p.repeat_of[1].has_value());
  }
}

TEST_CASE("segment plan: bad input is refused", "[router][plan]") {
  CHECK_THROWS_AS(plan({1, 2}, {false}, engine::SpliceMode::Hypic), std::invalid_argument);
  CHECK_THROWS_AS(plan({1}, {false}, engine::SpliceMode::Hypic, -1), std::invalid_argument);
  CHECK_THROWS_AS(plan({1, 2}, {false, true}, engine::SpliceMode::Hypic, 1, {true}), std::invalid_argument);
  CHECK(plan({}, {}, engine::SpliceMode::Hypic, 2).roles.empty());
}
