// combine_worker/fetch_policy.h: the fetch-or-rebuild choice for segments only the segment cache holds. Expected
// plans are worked out by hand from the model's formula: time to the last entry = max(ceil(fetched / P) x mean
// fetched bytes x ms/byte, (local + rebuilt tokens) x ms/token), rebuilt shortest first, a rebuild only when it beats
// fetching everything by the margin.
#include <catch2/catch.hpp>

#include <limits>
#include <stdexcept>

#include "combine_worker/fetch_policy.h"

using hypic::combine::CacheFetchPolicy;
using hypic::combine::FetchCandidate;
using hypic::combine::FetchCostModel;
using hypic::combine::parse_cache_fetch_policy;

namespace {
constexpr uint64_t MB = 1'000'000;
}

TEST_CASE("parse_cache_fetch_policy: auto, always, and a clear error otherwise", "[fetch_policy]") {
  CHECK(parse_cache_fetch_policy("auto") == CacheFetchPolicy::Auto);
  CHECK(parse_cache_fetch_policy("always") == CacheFetchPolicy::Always);
  CHECK_THROWS_WITH(parse_cache_fetch_policy("never"), Catch::Contains("'never'") && Catch::Contains("auto, always"));
}

TEST_CASE("FetchCostModel: no rates, no rebuild", "[fetch_policy]") {
  FetchCostModel m;
  const std::vector<FetchCandidate> c = {{0, 2048, 232 * MB}, {1, 2048, 232 * MB}};
  CHECK(m.plan(c, 0, 8).rebuild.empty());
  m.observe_fetch(232 * MB, 1000.0);  // a fetch seen, no build yet
  CHECK(m.plan(c, 0, 8).rebuild.empty());
  FetchCostModel b;
  b.observe_build(2048, 50.0);  // a build seen, no fetch yet
  CHECK(b.plan(c, 0, 8).rebuild.empty());
}

TEST_CASE("FetchCostModel: real-size entries over a slow fetch are rebuilt (the H200 cluster's rates)",
          "[fetch_policy]") {
  // bench/results/serving_h200.md: a 232 MB entry in about 1200 ms under 8 fetches at once (0.19 GB/s per entry),
  // 8 x 2048 tokens built in one pass in about 400 ms (about 0.0244 ms per token).
  FetchCostModel m;
  m.observe_fetch(232 * MB, 1200.0);
  m.observe_build(2048, 50.0);
  REQUIRE(*m.fetch_ms_per_byte() == Approx(1200.0 / (232.0 * MB)));
  REQUIRE(*m.build_ms_per_token() == Approx(50.0 / 2048.0));
  std::vector<FetchCandidate> c;
  for (size_t i = 0; i < 8; ++i) c.push_back({i, 2048, 232 * MB});
  const auto plan = m.plan(c, 0, 8);
  // Fetching all 8 at once: ceil(8 / 8) x 1200 = 1200 ms. Rebuilding all: 8 x 2048 x 50 / 2048 = 400 ms; rebuilding
  // m < 8 leaves at least one fetch of 1200 ms. Best: all 8.
  CHECK(plan.fetch_all_ms == Approx(1200.0));
  CHECK(plan.chosen_ms == Approx(400.0));
  CHECK(plan.rebuild == std::vector<size_t>{0, 1, 2, 3, 4, 5, 6, 7});
}

TEST_CASE("FetchCostModel: small entries over a fast fetch stay fetched", "[fetch_policy]") {
  // A CPU-backend-like worker: a 5 MB entry in 10 ms, 64 tokens built in 40 ms.
  FetchCostModel m;
  m.observe_fetch(5 * MB, 10.0);
  m.observe_build(64, 40.0);
  std::vector<FetchCandidate> c;
  for (size_t i = 0; i < 4; ++i) c.push_back({i, 64, 5 * MB});
  const auto plan = m.plan(c, 0, 8);
  CHECK(plan.rebuild.empty());
  CHECK(plan.fetch_all_ms == Approx(10.0));
  CHECK(plan.chosen_ms == Approx(10.0));
}

TEST_CASE("FetchCostModel: a partial rebuild overlaps the builds with the rest of the fetches", "[fetch_policy]") {
  // 1 ms per MB fetched, 1 ms per token built; parallelism 1. Candidates of 100 tokens (entries of 300 MB).
  FetchCostModel m;
  m.observe_fetch(300 * MB, 300.0);
  m.observe_build(100, 100.0);
  std::vector<FetchCandidate> c;
  for (size_t i = 0; i < 4; ++i) c.push_back({10 + i, 100, 300 * MB});
  // m rebuilt: max((4 - m) x 300, m x 100): m = 0: 1200, 1: 900, 2: 600, 3: max(300, 300) = 300, 4: 400. Best m = 3.
  const auto plan = m.plan(c, 0, 1);
  CHECK(plan.fetch_all_ms == Approx(1200.0));
  CHECK(plan.chosen_ms == Approx(300.0));
  CHECK(plan.rebuild == std::vector<size_t>{10, 11, 12});
  SECTION("LOCAL builds already planned count against rebuilding") {
    // 1000 local tokens: m rebuilt: max((4 - m) x 300, 1000 + 100 m): 0: 1200, 1: 1100, 2: 1200, 3: 1300, 4: 1400.
    // Best m = 1 at 1100, but 1100 x 1.25 > 1200: not worth switching.
    const auto p2 = m.plan(c, 1000, 1);
    CHECK(p2.rebuild.empty());
    CHECK(p2.chosen_ms == Approx(1200.0));
  }
}

TEST_CASE("FetchCostModel: shortest candidates are rebuilt first", "[fetch_policy]") {
  FetchCostModel m;
  m.observe_fetch(100 * MB, 100.0);  // 1 ms per MB
  m.observe_build(10, 10.0);         // 1 ms per token
  // Slots 5 (400 tokens, 100 MB), 6 (50 tokens, 100 MB), 7 (200 tokens, 100 MB); parallelism 1.
  // Sorted by tokens: 6, 7, 5. m = 0: 3 x 100 = 300; m = 1 (slot 6): max(2 x 100, 50) = 200; m = 2: max(100, 250) =
  // 250; m = 3: 650. Best m = 1 at 200 (200 x 1.25 = 250 <= 300).
  const auto plan = m.plan({{5, 400, 100 * MB}, {6, 50, 100 * MB}, {7, 200, 100 * MB}}, 0, 1);
  CHECK(plan.rebuild == std::vector<size_t>{6});
  CHECK(plan.chosen_ms == Approx(200.0));
}

TEST_CASE("FetchCostModel: rates are exponentially weighted means, bad observations are ignored", "[fetch_policy]") {
  FetchCostModel m(0.5, 1.0);
  m.observe_fetch(1000, 10.0);  // 0.01 ms per byte
  m.observe_fetch(1000, 30.0);  // 0.03: mean 0.5 x 0.01 + 0.5 x 0.03 = 0.02
  CHECK(*m.fetch_ms_per_byte() == Approx(0.02));
  m.observe_fetch(0, 5.0);
  m.observe_fetch(1000, 0.0);
  m.observe_fetch(1000, -1.0);
  CHECK(*m.fetch_ms_per_byte() == Approx(0.02));
  m.observe_build(0, 5.0);
  m.observe_build(-3, 5.0);
  m.observe_build(10, 0.0);
  CHECK_FALSE(m.build_ms_per_token().has_value());
  CHECK(m.plan({{0, 10, 1000}}, 0, 0).rebuild.empty());  // parallelism < 1: fetch
  CHECK_THROWS_AS(FetchCostModel(0.0, 1.25), std::invalid_argument);
  CHECK_THROWS_AS(FetchCostModel(0.3, 0.5), std::invalid_argument);
}

TEST_CASE("FetchCostModel::set_priors: starting rates that observations then move", "[fetch_policy]") {
  FetchCostModel m(0.5, 1.25);
  m.set_priors(100.0, 2000.0);  // 100 MB/s: 1e-5 ms per byte; 2000 tokens/s: 0.5 ms per token
  REQUIRE(m.fetch_ms_per_byte().has_value());
  CHECK(*m.fetch_ms_per_byte() == Approx(1e-5));
  CHECK(*m.build_ms_per_token() == Approx(0.5));
  m.observe_build(100, 150.0);  // 1.5 ms per token: 0.5 x 0.5 + 0.5 x 1.5 = 1.0
  CHECK(*m.build_ms_per_token() == Approx(1.0));
  // 4 entries of 100 MB (1000 ms each at 100 MB/s), parallelism 4, 100 tokens each (100 ms each at 1 ms per token):
  // fetch all = 1000 ms; rebuild all = 400 ms; rebuild 3 = max(1000, 300). Best: all 4.
  const auto plan = m.plan({{0, 100, 100 * MB}, {1, 100, 100 * MB}, {2, 100, 100 * MB}, {3, 100, 100 * MB}}, 0, 4);
  CHECK(plan.rebuild.size() == 4);
  CHECK(plan.chosen_ms == Approx(400.0));
  m.set_priors(0.0, 0.0);  // both unknown again
  CHECK_FALSE(m.fetch_ms_per_byte().has_value());
  CHECK_FALSE(m.build_ms_per_token().has_value());
  CHECK_THROWS_AS(m.set_priors(-1.0, 0.0), std::invalid_argument);
  CHECK_THROWS_AS(m.set_priors(0.0, std::numeric_limits<double>::infinity()), std::invalid_argument);
}

TEST_CASE("FetchCostModel: a long entry is the fetches' straggler and is rebuilt first", "[fetch_policy]") {
  FetchCostModel m;
  m.set_priors(190.0, 10000.0);  // 1 / 190000 ms per byte, 0.1 ms per token
  // One 8192-token segment (928 MB) and seven of 16 tokens (1.8 MB each), 8 fetches at once.
  std::vector<FetchCandidate> c = {{0, 16, 1'800'000}, {1, 8192, 928'000'000}};
  for (size_t i = 2; i < 8; ++i) c.push_back({i, 16, 1'800'000});
  // Fetch all: max(928 MB, 940.6 MB / 8) / 190000 = 4884.2 ms (the long one's stream, not the mean entry's).
  // Rebuild all: 8304 tokens x 0.1 = 830.4 ms. Shortest first never drops the long fetch below 4884 ms until all are
  // rebuilt; longest first, m = 1: max(max(1.8 MB, 12.6 MB / 8) / 190000 = 9.5 ms, 8192 x 0.1 = 819.2 ms) = 819.2.
  const auto plan = m.plan(c, 0, 8);
  CHECK(plan.fetch_all_ms == Approx(928'000'000.0 / 190'000.0));
  CHECK(plan.chosen_ms == Approx(819.2));
  CHECK(plan.rebuild == std::vector<size_t>{1});
  CHECK_FALSE(plan.probe);
}

TEST_CASE("FetchCostModel: every probe_every-th plan that fetches nothing keeps the smallest entry fetched",
          "[fetch_policy]") {
  FetchCostModel m(0.3, 1.25, 3);
  m.observe_fetch(232 * MB, 1200.0);
  m.observe_build(2048, 50.0);
  // Slot 2 has the smallest entry. Rebuilding all 3 (150 ms) beats fetching them (1200 ms).
  const std::vector<FetchCandidate> c = {{0, 2048, 232 * MB}, {1, 2048, 232 * MB}, {2, 2000, 230 * MB}};
  auto all = [&] { return m.plan(c, 0, 8); };
  CHECK(all().rebuild.size() == 3);
  CHECK(all().rebuild.size() == 3);
  const auto probe = all();  // the third plan in a row with nothing fetched: a probe
  CHECK(probe.probe);
  CHECK(probe.rebuild == std::vector<size_t>{0, 1});
  // The probe's estimate: fetch slot 2 (230 MB at 1200 / 232 ms per MB) beside 4096 tokens built.
  CHECK(probe.chosen_ms == Approx(std::max(230.0 * 1200.0 / 232.0, 4096.0 * 50.0 / 2048.0)));
  CHECK(all().rebuild.size() == 3);  // counting starts again
  CHECK(all().rebuild.size() == 3);
  m.observe_fetch(230 * MB, 1190.0);  // a fetch timed: counting starts again too
  CHECK_FALSE(all().probe);
  CHECK_FALSE(all().probe);
  CHECK(all().probe);
  CHECK_THROWS_AS(FetchCostModel(0.3, 1.25, 0), std::invalid_argument);
}

TEST_CASE("FetchCostModel::set_priors: a rate whose inverse overflows is refused", "[fetch_policy]") {
  FetchCostModel m;
  CHECK_THROWS_AS(m.set_priors(1e-320, 0.0), std::invalid_argument);
  CHECK_THROWS_AS(m.set_priors(0.0, 1e-320), std::invalid_argument);
  CHECK_THROWS_AS(m.set_priors(std::numeric_limits<double>::quiet_NaN(), 0.0), std::invalid_argument);
}

TEST_CASE("FetchCostModel::plan_staged_cold: a full prefill where it beats building and staging, worked by hand",
          "[fetch_policy]") {
  using hypic::combine::StagedColdCase;
  FetchCostModel m;
  // 8 cold segments of 2048 tokens, 232 MB entries: builds 16384 tokens, stages 1856 MB.
  StagedColdCase c;
  c.local_tokens = 8 * 2048;
  c.local_flops = 8 * 1.0e13;
  c.full_flops = 8.8e13;  // the whole prompt in one pass: 10% more (its longer attention)
  c.staged_bytes = 8 * 232 * MB;
  // No rates yet: staged (its builds and splice measure them).
  CHECK_FALSE(m.plan_staged_cold(c).full);
  m.observe_build(2048, 30.0);  // 30 ms per 2048 tokens
  // The builds alone (240 ms) as the staged splice's lower bound, against 8.8e13 FLOPs at the builds' rate (264 ms):
  // staged.
  CHECK_FALSE(m.staged_ms_per_byte());
  auto lower = m.plan_staged_cold(c);
  CHECK_FALSE(lower.full);
  CHECK(lower.staged_ms == Approx(240.0));
  CHECK(lower.full_ms == Approx(264.0));
  m.observe_staged_splice(8 * 232 * MB, 92.8);  // 20 GB/s: 0.05 ms per MB
  REQUIRE(m.staged_ms_per_byte());
  CHECK(*m.staged_ms_per_byte() == Approx(92.8 / (8.0 * 232 * MB)));
  // Staged: 16384 x 30 / 2048 = 240 ms of builds + 92.8 ms staged = 332.8 ms. Full: 8.8e13 FLOPs at the builds'
  // 240 ms per 8e13 = 264 ms. Full is sooner.
  auto p = m.plan_staged_cold(c);
  CHECK(p.full);
  CHECK(p.staged_ms == Approx(332.8));
  CHECK(p.full_ms == Approx(264.0));
  // One cold segment among eight: 30 ms of builds + 92.8 staged = 122.8 against the prompt's 8.8e13 FLOPs at 30 ms
  // per 1e13 = 264 ms: staged.
  c.local_tokens = 2048;
  c.local_flops = 1.0e13;
  p = m.plan_staged_cold(c);
  CHECK_FALSE(p.full);
  CHECK(p.staged_ms == Approx(122.8));
  CHECK(p.full_ms == Approx(264.0));
  // A long prompt whose full pass costs far more FLOPs than its segments' builds (quadratic attention): 64 segments
  // built in 1920 ms (64e13 FLOPs) and staged in 742.4 ms against 128e13 FLOPs for the full pass (3840 ms): staged.
  c.local_tokens = 64 * 2048;
  c.local_flops = 64 * 1.0e13;
  c.full_flops = 128 * 1.0e13;
  c.staged_bytes = 64 * 232 * MB;
  p = m.plan_staged_cold(c);
  CHECK_FALSE(p.full);
  CHECK(p.staged_ms == Approx(1920.0 + 742.4));
  CHECK(p.full_ms == Approx(3840.0));
  // A full prefill timed: its rate per FLOP replaces the builds'. 8.8e13 FLOPs in 220 ms: 2.5e-12 ms per FLOP.
  CHECK_FALSE(m.prefill_ms_per_flop());
  m.observe_prefill(8.8e13, 220.0);
  m.observe_prefill(0, 5.0);  // ignored
  m.observe_prefill(1e13, 0.0);
  REQUIRE(m.prefill_ms_per_flop());
  CHECK(*m.prefill_ms_per_flop() == Approx(2.5e-12));
  // The long prompt again: 128e13 FLOPs x 2.5e-12 = 3200 ms against 2662.4: still staged. With 1.0e15 FLOPs for
  // the full pass: 2500 ms, a full prefill.
  p = m.plan_staged_cold(c);
  CHECK(p.full_ms == Approx(3200.0));
  CHECK_FALSE(p.full);
  c.full_flops = 1.0e15;
  p = m.plan_staged_cold(c);
  CHECK(p.full_ms == Approx(2500.0));
  CHECK(p.full);
  // Nothing to build here: staged.
  c.local_tokens = 0;
  c.local_flops = 0;
  CHECK_FALSE(m.plan_staged_cold(c).full);
  // Ignored observations.
  m.observe_staged_splice(0, 5.0);
  m.observe_staged_splice(5, 0.0);
  CHECK(*m.staged_ms_per_byte() == Approx(92.8 / (8.0 * 232 * MB)));
}

TEST_CASE("FetchCostModel::set_priors: a staged splice's rate in GB/s", "[fetch_policy]") {
  FetchCostModel m;
  m.set_priors(0.0, 0.0, 20.0);
  REQUIRE(m.staged_ms_per_byte());
  CHECK(*m.staged_ms_per_byte() == Approx(1e3 / 20e9));
  m.set_priors(0.0, 0.0);
  CHECK_FALSE(m.staged_ms_per_byte());
  CHECK_THROWS_AS(m.set_priors(0.0, 0.0, -1.0), std::invalid_argument);
  CHECK_THROWS_AS(m.set_priors(0.0, 0.0, 1e-320), std::invalid_argument);
}

TEST_CASE("FetchCostModel::plan_staged_cold: before a staged splice was timed, a full prefill that beats the builds "
          "alone", "[fetch_policy]") {
  FetchCostModel m;
  hypic::combine::StagedColdCase c;
  c.local_tokens = 8 * 2048;
  c.local_flops = 8e13;
  c.full_flops = 8.8e13;
  c.staged_bytes = 8 * 232 * MB;
  m.observe_build(2048, 30.0);     // the builds: 240 ms
  m.observe_prefill(8.8e13, 220);  // a full prefill timed: 220 ms for this prompt's FLOPs
  const auto p = m.plan_staged_cold(c);
  CHECK(p.full);
  CHECK(p.staged_ms == Approx(240.0));
  CHECK(p.full_ms == Approx(220.0));
}
