// The splice planner (engine/splice_schedule.h) against schedules written out by hand from DESIGN.md 3.3-3.4. That
// every backend executes the schedules it announces is the conformance suite's (tests/conformance/).
#include <catch2/catch.hpp>

#include <random>

#include "engine/backend.h"
#include "engine/splice_schedule.h"

using hypic::engine::ScheduledFold;
using hypic::engine::ScheduledStep;
using hypic::engine::SpliceMode;
using hypic::engine::SpliceSchedule;
using hypic::engine::SpliceShape;
using Kind = ScheduledFold::Kind;

namespace {

SpliceShape shape_of(SpliceMode mode, int w, std::vector<int64_t> lengths, int64_t query) {
  SpliceShape s;
  s.mode = mode;
  s.seam_width = w;
  s.segment_tokens = std::move(lengths);
  s.has_entry.assign(s.segment_tokens.size(), 1);
  s.query_tokens = query;
  return s;
}

ScheduledStep step(std::vector<ScheduledFold> folds, int64_t position, int64_t tokens, int checkpoint = -1) {
  ScheduledStep s;
  s.folds = std::move(folds);
  s.position = position;
  s.tokens = tokens;
  s.checkpoint_segment = checkpoint;
  return s;
}

}  // namespace

TEST_CASE("splice schedule: full, prefix, naive and transition steps", "[splice_schedule]") {
  // Segments of 5, 3 and 12 tokens (prompt positions 0, 5, 8; 20 in all), a query of 2.
  const std::vector<int64_t> n{5, 3, 12};
  {
    const SpliceSchedule s = schedule_splice(shape_of(SpliceMode::Full, 4, n, 2));
    CHECK(s.steps == std::vector<ScheduledStep>{step({}, 0, 20), step({}, 20, 2)});
    CHECK(s.computed_tokens == 22);
    CHECK(s.num_tokens == 22);
    CHECK(s.prefix_reused == 0);
  }
  {
    const SpliceSchedule cold = schedule_splice(shape_of(SpliceMode::Prefix, 4, n, 2), 0);
    CHECK(cold.steps ==
          std::vector<ScheduledStep>{step({}, 0, 5, 0), step({}, 5, 3, 1), step({}, 8, 12, 2), step({}, 20, 2)});
    CHECK(cold.computed_tokens == 22);
    const SpliceSchedule warm = schedule_splice(shape_of(SpliceMode::Prefix, 4, n, 2), 1);
    CHECK(warm.steps == std::vector<ScheduledStep>{step({}, 5, 3, 1), step({}, 8, 12, 2), step({}, 20, 2)});
    CHECK(warm.prefix_reused == 1);
    CHECK(warm.computed_tokens == 17);
    const SpliceSchedule all = schedule_splice(shape_of(SpliceMode::Prefix, 4, n, 2), 3);
    CHECK(all.steps == std::vector<ScheduledStep>{step({}, 20, 2)});
    CHECK(all.computed_tokens == 2);
    CHECK_THROWS_WITH(schedule_splice(shape_of(SpliceMode::Prefix, 4, n, 2), 4), Catch::Contains("prefix_reused 4"));
  }
  {
    const SpliceSchedule s = schedule_splice(shape_of(SpliceMode::Naive, 4, n, 2));
    CHECK(s.steps == std::vector<ScheduledStep>{step(
                         {{Kind::Install, 0, 0, 0}, {Kind::Naive, 1, 0, 5}, {Kind::Naive, 2, 0, 8}}, 20, 2)});
    CHECK(s.computed_tokens == 2);
    CHECK(s.num_tokens == 22);
    SpliceShape local = shape_of(SpliceMode::Transition, 0, n, 2);
    local.local_positions = true;  // every segment placed at 0; the query stays at its real position
    CHECK(schedule_splice(local).steps ==
          std::vector<ScheduledStep>{
              step({{Kind::Install, 0, 0, 0}, {Kind::Transition, 1, 0, 0}, {Kind::Transition, 2, 0, 0}}, 20, 2)});
  }
}

TEST_CASE("splice schedule: hypic seams, interiors, whole segments", "[splice_schedule]") {
  const std::vector<int64_t> n{5, 3, 12};
  {  // w = 4: segment 1 (3 tokens) is all seam, segment 2's seam is [8, 12), its interior (from 4) folds before the query
    const SpliceSchedule s = schedule_splice(shape_of(SpliceMode::Hypic, 4, n, 2));
    CHECK(s.steps == std::vector<ScheduledStep>{step({{Kind::Install, 0, 0, 0}}, 5, 3), step({}, 8, 4),
                                                step({{Kind::Interior, 2, 4, 8}}, 20, 2)});
    CHECK(s.computed_tokens == 3 + 4 + 2);
    CHECK(s.recomputed_segments.empty());
    CHECK(s.num_tokens == 22);
  }
  {  // w = 0: no seam anywhere: every fold before the query, which is the only span
    const SpliceSchedule s = schedule_splice(shape_of(SpliceMode::Hypic, 0, n, 2));
    CHECK(s.steps == std::vector<ScheduledStep>{step(
                         {{Kind::Install, 0, 0, 0}, {Kind::Interior, 1, 0, 5}, {Kind::Interior, 2, 0, 8}}, 20, 2)});
    CHECK(s.computed_tokens == 2);
  }
  {  // segment 2 recomputed whole: its 12 tokens run in context, nothing of it folds
    SpliceShape sh = shape_of(SpliceMode::Hypic, 4, n, 2);
    sh.recompute_segments = {2};
    const SpliceSchedule s = schedule_splice(sh);
    CHECK(s.steps == std::vector<ScheduledStep>{step({{Kind::Install, 0, 0, 0}}, 5, 3), step({}, 8, 12),
                                                step({}, 20, 2)});
    CHECK(s.recomputed_segments == std::vector<int>{2});
    CHECK(s.computed_tokens == 17);
  }
}

TEST_CASE("splice schedule: the refresh's probe, then the answer it chooses", "[splice_schedule]") {
  // Segments of 5, 10, 10, 10 at 0, 5, 15, 25; w = 2; query of 3 at 35; refresh 1 with a tail of 1 (segment 3).
  SpliceShape sh = shape_of(SpliceMode::Hypic, 2, {5, 10, 10, 10}, 3);
  sh.refresh_segments = 1;
  sh.refresh_tail = 1;
  const SpliceSchedule probe = schedule_refresh_probe(sh);
  // The probe leaves the tail cached: every later segment is seam + interior.
  CHECK(probe.probe);
  CHECK(probe.steps == std::vector<ScheduledStep>{step({{Kind::Install, 0, 0, 0}}, 5, 2),
                                                  step({{Kind::Interior, 1, 2, 5}}, 15, 2),
                                                  step({{Kind::Interior, 2, 2, 15}}, 25, 2),
                                                  step({{Kind::Interior, 3, 2, 25}}, 35, 3)});
  CHECK(probe.computed_tokens == 2 + 2 + 2 + 3);
  // The query attends to segment 2's interior (rows 17..24) most: segment 2 joins the tail, recomputed whole.
  std::vector<float> mass(38, 0.01f);
  mass[20] = 0.5f;
  mass[26] = 0.9f;  // segment 3 (the tail, already whole) does not count
  const SpliceSchedule answer = schedule_splice(sh, 0, probe, mass);
  CHECK(!answer.probe);
  CHECK(answer.steps == std::vector<ScheduledStep>{step({{Kind::Install, 0, 0, 0}}, 5, 2),
                                                   step({{Kind::Interior, 1, 2, 5}}, 15, 10), step({}, 25, 10),
                                                   step({}, 35, 3)});
  CHECK(answer.recomputed_segments == std::vector<int>{2, 3});
  CHECK(answer.computed_tokens == (2 + 10 + 10 + 3) + probe.computed_tokens);
  // No probe when nothing could be refreshed (segment 1 and 2 whole by the tail, none left), nor without refresh.
  SpliceShape none = sh;
  none.refresh_tail = 3;
  CHECK(schedule_refresh_probe(none).steps.empty());
  none.refresh_segments = 0;
  none.refresh_tail = 0;
  CHECK(schedule_refresh_probe(none).steps.empty());
  // A tail segment that came without an entry is whole in the probe too.
  SpliceShape bare = sh;
  bare.has_entry[3] = 0;
  CHECK(schedule_refresh_probe(bare).steps.back() == step({}, 35, 3));
}

TEST_CASE("splice schedule: bad shapes are refused, naming what is wrong", "[splice_schedule]") {
  using hypic::engine::check_splice_shape;
  using hypic::engine::needs_entry;
  CHECK_THROWS_WITH(check_splice_shape(shape_of(SpliceMode::Hypic, 8, {}, 2)), Catch::Contains("segment list is empty"));
  CHECK_THROWS_WITH(check_splice_shape(shape_of(SpliceMode::Hypic, 8, {4}, 0)), Catch::Contains("query has no tokens"));
  CHECK_THROWS_WITH(check_splice_shape(shape_of(SpliceMode::Hypic, -1, {4}, 2)),
                    Catch::Contains("seam width must be >= 0, got -1"));
  CHECK_THROWS_WITH(check_splice_shape(shape_of(SpliceMode::Full, 8, {4, 0}, 2)),
                    Catch::Contains("segment 1 has no tokens"));
  SpliceShape local = shape_of(SpliceMode::Hypic, 8, {4}, 2);
  local.local_positions = true;
  CHECK_THROWS_WITH(check_splice_shape(local), Catch::Contains("local_positions applies to modes naive and transition"));
  SpliceShape bad_index = shape_of(SpliceMode::Hypic, 8, {4, 4}, 2);
  bad_index.recompute_segments = {0};
  CHECK_THROWS_WITH(check_splice_shape(bad_index), Catch::Contains("index 0 is outside [1, 2)"));
  // Entries: every segment of a cached mode, except (hypic) a segment recomputed whole in the answer; none in full.
  SpliceShape bare = shape_of(SpliceMode::Naive, 8, {4, 4, 4}, 2);
  bare.has_entry[2] = 0;
  CHECK_THROWS_WITH(check_splice_shape(bare), Catch::Contains("segment 2 has no entry (required by mode naive)"));
  bare.mode = SpliceMode::Hypic;
  CHECK_THROWS_WITH(check_splice_shape(bare), Catch::Contains("segment 2 has no entry (required by mode hypic)"));
  bare.refresh_tail = 1;
  CHECK_NOTHROW(check_splice_shape(bare));
  CHECK(!needs_entry(bare, 2));
  CHECK(needs_entry(bare, 1));
  bare.mode = SpliceMode::Full;
  bare.refresh_tail = 0;
  bare.has_entry.assign(3, 0);
  CHECK_NOTHROW(check_splice_shape(bare));
}

TEST_CASE("staging layout: one group when all fit, two halves of the largest, else one area -- greedy and in order",
          "[splice_schedule]") {
  using hypic::engine::layout_staging;
  using hypic::engine::StagingLayout;
  const std::vector<size_t> six(6, 1024);
  {  // every cost fits: one group, the entries back to back
    const StagingLayout l = layout_staging(six, six, 6144);
    CHECK(l.groups == 1);
    CHECK(l.halves == 1);
    CHECK(l.half_bytes == 6144);
    CHECK(l.offset == std::vector<size_t>{0, 1024, 2048, 3072, 4096, 5120});
  }
  {  // room for two halves of two entries
    const StagingLayout l = layout_staging(six, six, 4096);
    CHECK(l.halves == 2);
    CHECK(l.groups == 3);
    CHECK(l.group == std::vector<int>{0, 0, 1, 1, 2, 2});
    CHECK(l.offset == std::vector<size_t>{0, 1024, 0, 1024, 0, 1024});
    CHECK(l.half_bytes == 2048);
  }
  {  // half the room (1500) rounds down to 1280: one entry a half
    const StagingLayout l = layout_staging(six, six, 3000);
    CHECK(l.halves == 2);
    CHECK(l.groups == 6);
    CHECK(l.half_bytes == 1024);
  }
  {  // below two of the largest: one area, one entry at a time
    const StagingLayout l = layout_staging(six, six, 2047);
    CHECK(l.halves == 1);
    CHECK(l.groups == 6);
  }
  {  // pass scratch counts in a group's cost, not in the area
    const std::vector<size_t> bytes(4, 1024), cost(4, 1536);
    const StagingLayout l = layout_staging(bytes, cost, 3072);
    CHECK(l.halves == 2);
    CHECK(l.groups == 4);
    CHECK(l.half_bytes == 1024);
    CHECK(layout_staging(bytes, cost, 6144).groups == 1);
  }
  CHECK_THROWS_WITH(layout_staging(six, six, 1023), Catch::Contains("below the largest cost"));
  CHECK_THROWS_WITH(layout_staging(std::vector<size_t>{1000}, std::vector<size_t>{1000}, 4096),
                    Catch::Contains("multiples of 256"));
  CHECK_THROWS_WITH(layout_staging(std::vector<size_t>{1024}, std::vector<size_t>{512}, 4096),
                    Catch::Contains("costs at least their entry"));
  CHECK_THROWS_AS(layout_staging(six, std::vector<size_t>(5, 1024), 8192), std::invalid_argument);
  // Random sizes and rooms: groups consecutive from 0; each group's cost within its cap and greedy (the next fold
  // would not have fit); every entry inside its half; the area (halves x half) within the room.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 500; ++trial) {
    const size_t n = 1 + rng() % 12;
    std::vector<size_t> bytes(n), cost(n);
    size_t largest = 0, total = 0;
    for (size_t i = 0; i < n; ++i) {
      bytes[i] = 256 * (1 + rng() % 40);
      cost[i] = bytes[i] + 256 * (rng() % 8);
      largest = std::max(largest, cost[i]);
      total += cost[i];
    }
    const size_t room = largest + rng() % (total + 1);
    const StagingLayout l = layout_staging(bytes, cost, room);
    INFO("trial " << trial << ", room " << room << ", total " << total << ", largest " << largest);
    const size_t cap = room >= total ? total : l.halves == 2 ? std::max(largest, room / 2 / 256 * 256) : room;
    CHECK(l.halves == (room < total && room >= 2 * largest ? 2 : 1));
    REQUIRE(l.group.size() == n);
    CHECK(l.group.front() == 0);
    CHECK(l.group.back() == l.groups - 1);
    CHECK(size_t(l.halves) * l.half_bytes <= room);
    std::vector<size_t> group_cost(size_t(l.groups), 0);
    for (size_t i = 0; i < n; ++i) {
      if (i > 0) CHECK((l.group[i] == l.group[i - 1] || l.group[i] == l.group[i - 1] + 1));
      CHECK(l.offset[i] % 256 == 0);
      CHECK(l.offset[i] + bytes[i] <= l.half_bytes);
      if (i > 0 && l.group[i] == l.group[i - 1]) CHECK(l.offset[i] == l.offset[i - 1] + bytes[i - 1]);
      if (i == 0 || l.group[i] != l.group[i - 1]) CHECK(l.offset[i] == 0);
      group_cost[size_t(l.group[i])] += cost[i];
    }
    for (size_t i = 0; i + 1 < n; ++i)
      if (l.group[i + 1] != l.group[i]) CHECK(group_cost[size_t(l.group[i])] + cost[i + 1] > cap);
    for (const size_t c : group_cost) CHECK(c <= cap);
  }
}
