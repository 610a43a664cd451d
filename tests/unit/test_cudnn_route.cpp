// The host-side plan of attention_prefill's cuDNN route (kernels/cuda/cudnn_route.h): the length buckets of
// HYPIC_ATTN_CUDNN_BUCKETS and the batching of query groups into cuDNN calls. Host only: runs in the CPU build.
// References: bucket values worked out by hand from the definition (the smallest multiple of 2^(floor(log2 len) - 4)
// at or above len), the bucket count per octave, and, for the runs, a brute-force check of every group against the
// properties the GPU path relies on.
#include <catch2/catch.hpp>

#include <climits>
#include <cmath>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "kernels/cuda/cudnn_route.h"

namespace kd = hypic::kernels::cuda::detail;

TEST_CASE("cudnn_length_bucket: hand-worked values", "[cudnn_route]") {
  const std::pair<int, int> cases[] = {
      {-3, -3},     {0, 0},       {1, 1},       {15, 15},     {16, 16},     {31, 31},       {32, 32},
      {33, 34},     {513, 544},   {777, 800},   {1000, 1024}, {1024, 1024}, {1025, 1088},   {2944, 2944},
      {2945, 3072}, {3001, 3072}, {4096, 4096}, {4097, 4352}, {8000, 8192}, {16385, 17408}, {32767, 32768},
      {131072, 131072}};
  for (const auto& [len, want] : cases) {
    INFO("len " << len);
    CHECK(kd::cudnn_length_bucket(len) == want);
  }
}

TEST_CASE("cudnn_length_bucket: at most 1/16 padding, idempotent, monotone, 16 buckets per octave", "[cudnn_route]") {
  int prev = 0;
  std::set<int> octave;  // distinct buckets of the lengths in [2^k, 2^(k+1))
  for (int len = 1; len <= (1 << 18); ++len) {
    const int b = kd::cudnn_length_bucket(len);
    INFO("len " << len << " -> " << b);
    REQUIRE(b >= len);
    REQUIRE(16L * (b - len) < std::max(16L, static_cast<long>(len)));  // pad < len / 16 (none below 16)
    REQUIRE(kd::cudnn_length_bucket(b) == b);
    REQUIRE(b >= prev);
    prev = b;
    if ((len & (len - 1)) == 0 && len >= 64) {  // a new octave starts: the previous one [len / 2, len) is complete
      // 16 buckets in [len / 2, len), and len itself for the lengths of the last sixteenth (from 32 on: below, the
      // step is 1).
      CHECK(octave.size() == 17);
      CHECK(*octave.rbegin() == len);
      octave.clear();
    }
    if (len >= 32) octave.insert(b);
  }
}

namespace {

struct Group {
  int len, slot0;
};

// The rule by length alone: groups of at least min_q queries (and more than 512).
kd::CudnnRule length_rule(int min_q) {
  kd::CudnnRule r;
  r.min_len = 513;
  r.min_q = min_q;
  return r;
}

std::vector<kd::CudnnRunPlan> plan(const std::vector<Group>& gs, const kd::CudnnRule& rule, bool buckets, bool& ok,
                                   bool& others) {
  std::vector<int> q_start{0}, slot0;
  for (const Group& g : gs) q_start.push_back(q_start.back() + g.len), slot0.push_back(g.slot0);
  std::vector<kd::CudnnRunPlan> runs;
  ok = kd::plan_cudnn_runs(int(gs.size()), q_start.data(), slot0.data(), rule, buckets, runs, others);
  return runs;
}
std::vector<kd::CudnnRunPlan> plan(const std::vector<Group>& gs, int min_q, bool buckets, bool& ok, bool& others) {
  return plan(gs, length_rule(min_q), buckets, ok, others);
}

}  // namespace

TEST_CASE("plan_cudnn_runs: the GPU test's groups, with and without buckets", "[cudnn_route]") {
  // tests/gpu/test_gpu_attention.cpp "length buckets: padded plans match the reference".
  const std::vector<Group> gs = {{1000, 0}, {1000, 0}, {1000, 24}, {3, 7},   {1024, 100},
                                 {777, 1234}, {64, 0}, {2048, 0},  {3001, 0}, {513, 5}};
  bool ok = false, others = false;
  const auto runs = plan(gs, 513, true, ok, others);
  REQUIRE(ok);
  CHECK(others);  // (3 queries, 64 queries: the split path)
  struct Want {
    int group0, q0, b, q_len, kv_len, s_q, s_kv;
  };
  // (s_kv = s_q + slot0: the KV padded by the queries' padding, the plan's diagonal offset the real slot0.)
  const Want want[] = {{0, 0, 2, 1000, 1000, 1024, 1024},    {2, 2000, 1, 1000, 1024, 1024, 1048},
                       {4, 3003, 1, 1024, 1124, 1024, 1124}, {5, 4027, 1, 777, 2011, 800, 2034},
                       {7, 4868, 1, 2048, 2048, 2048, 2048}, {8, 6916, 1, 3001, 3001, 3072, 3072},
                       {9, 9917, 1, 513, 518, 544, 549}};
  REQUIRE(runs.size() == std::size(want));
  for (size_t i = 0; i < runs.size(); ++i) {
    INFO("run " << i);
    const kd::CudnnRunPlan& r = runs[i];
    const Want& w = want[i];
    CHECK(r.group0 == w.group0);
    CHECK(r.q0 == w.q0);
    CHECK(r.b == w.b);
    CHECK(r.q_len == w.q_len);
    CHECK(r.kv_len == w.kv_len);
    CHECK(r.s_q == w.s_q);
    CHECK(r.s_kv == w.s_kv);
  }
  // Without buckets, under the rule of 27064 queries (16 x 256 heads): none of them.
  CHECK(plan(gs, 27064, false, ok, others).empty());
  CHECK(ok);
  CHECK(others);
  // Without buckets, every group over 512 (HYPIC_ATTN_CUDNN=all): the same runs, unpadded.
  const auto exact = plan(gs, 513, false, ok, others);
  REQUIRE(exact.size() == runs.size());
  for (size_t i = 0; i < exact.size(); ++i) {
    CHECK(exact[i].s_q == exact[i].q_len);
    CHECK(exact[i].s_kv == exact[i].kv_len);
    CHECK(exact[i].b == runs[i].b);
  }
}

TEST_CASE("plan_cudnn_runs: groups past 2^17 KV slots, real or padded, leave the whole call to our kernels",
          "[cudnn_route]") {
  bool ok = true, others = false;
  plan({{1000, 0}, {1024, kd::kCudnnMaxRunRows - 1023}}, 513, false, ok, others);  // 131073 slots
  CHECK_FALSE(ok);
  plan({{1000, 0}, {1024, kd::kCudnnMaxRunRows - 1024}}, 513, false, ok, others);  // exactly 2^17
  CHECK(ok);
  plan({{1025, 130047}}, 513, true, ok, others);  // 131072 real slots, padded to 1088 + 130047 = 131135
  CHECK_FALSE(ok);
  plan({{1025, 130047}}, 513, false, ok, others);
  CHECK(ok);
  // Equal groups batch while b x s_kv <= 2^17: 40 groups of 4000 queries (bucket 4096) make runs of 32 and 8.
  const auto runs = plan(std::vector<Group>(40, Group{4000, 0}), 513, true, ok, others);
  REQUIRE(ok);
  REQUIRE(runs.size() == 2);
  CHECK(runs[0].b == 32);
  CHECK(runs[1].b == 8);
  CHECK(runs[1].group0 == 32);
  CHECK(runs[1].q0 == 32 * 4000);
  CHECK_FALSE(others);
}

TEST_CASE("plan_cudnn_runs: random group lists keep the properties the GPU path relies on", "[cudnn_route]") {
  std::mt19937 rng(20261205);
  for (int trial = 0; trial < 2000; ++trial) {
    const bool buckets = trial % 2 == 0;
    const int min_q = buckets ? 513 : 513 + int(rng() % 4000);
    // Every third trial counts the cached slots too (a threshold that 600..9000-query groups reach at some of the
    // slot0 below); with buckets that is the default rule (cudnn_rule in attention.cu: every group at slot0 0 past
    // 512 queries, min_q0), the other bucket trials take every group past 512 queries (HYPIC_ATTN_CUDNN=all).
    kd::CudnnRule rule = trial % 3 == 0 ? kd::cudnn_flop_rule(1e9 * (1 + rng() % 64), 16, 256, 513, true)
                                        : length_rule(min_q);
    if (buckets && trial % 3 == 0) rule.min_q0 = 513;
    std::vector<Group> gs;
    const int n = 1 + int(rng() % 12);
    for (int i = 0; i < n; ++i) {
      const int len = rng() % 4 == 0 ? int(rng() % 600) : int(rng() % 9000);
      const int s0 = rng() % 3 == 0 ? 0 : int(rng() % 40000);
      gs.push_back({len, s0});
      if (rng() % 3 == 0) gs.push_back(gs.back());  // an equal neighbour: batched
    }
    bool ok = false, others = false;
    const auto runs = plan(gs, rule, buckets, ok, others);
    REQUIRE(ok);  // (every KV length here is below 2^17)
    std::vector<int> q_start{0};
    for (const Group& g : gs) q_start.push_back(q_start.back() + g.len);
    std::vector<int> run_of(gs.size(), -1);
    for (size_t r = 0; r < runs.size(); ++r)
      for (int j = 0; j < runs[r].b; ++j) {
        REQUIRE(runs[r].group0 + j < int(gs.size()));
        REQUIRE(run_of[size_t(runs[r].group0 + j)] == -1);  // one run per group
        run_of[size_t(runs[r].group0 + j)] = int(r);
      }
    bool want_others = false;
    for (size_t i = 0; i < gs.size(); ++i) {
      const Group& g = gs[i];
      INFO("trial " << trial << " group " << i << " (" << g.len << " @ " << g.slot0 << ")");
      const bool cudnn = g.len > 0 && g.len > 512 &&
                         ((g.slot0 == 0 && g.len >= rule.min_q0) || g.len >= rule.min_q ||
                          (long long)g.len * (2LL * g.slot0 + g.len) >= rule.min_work);
      want_others |= g.len > 0 && !cudnn;
      REQUIRE((run_of[i] >= 0) == cudnn);
      if (!cudnn) continue;
      const kd::CudnnRunPlan& r = runs[size_t(run_of[i])];
      CHECK(r.q_len == g.len);
      CHECK(r.kv_len == g.slot0 + g.len);
      CHECK(r.q0 + (int(i) - r.group0) * r.q_len == q_start[i]);  // the run's rows are its groups' rows
      CHECK(r.s_q >= r.q_len);
      CHECK(r.s_kv >= r.kv_len);
      CHECK(r.s_kv - r.s_q == r.kv_len - r.q_len);  // the plan's diagonal offset is the real one
      CHECK(long(r.b) * r.s_kv <= kd::kCudnnMaxRunRows);
      if (buckets) {
        CHECK(16L * (r.s_q - r.q_len) < std::max(16L, long(r.q_len)));
      } else {
        CHECK(r.s_q == r.q_len);
        CHECK(r.s_kv == r.kv_len);
      }
    }
    CHECK(others == want_others);
  }
}

TEST_CASE("cudnn_flop_rule: the thresholds worked by hand, and the integer test against the FLOP count",
          "[cudnn_route]") {
  // 6e12 / (2 x 16 x 256) = 732421875 exactly; 27063^2 = 732405969 < it <= 27064^2 = 732460096.
  const kd::CudnnRule len_rule = kd::cudnn_flop_rule(6e12, 16, 256, 513, false);
  CHECK(len_rule.min_len == 513);
  CHECK(len_rule.min_q == 27064);
  CHECK(len_rule.min_work == LLONG_MAX);
  const kd::CudnnRule pre = kd::cudnn_flop_rule(6e12, 16, 256, 513, true);
  CHECK(pre.min_q == 27064);
  CHECK(pre.min_work == 732421875LL);
  // 4 / 1 heads at 256 (the GPU test's shape): 6e12 / 2048 = 2929687500; sqrt = 54126.6 -> 54127.
  const kd::CudnnRule small = kd::cudnn_flop_rule(6e12, 4, 256, 513, true);
  CHECK(small.min_q == 54127);
  CHECK(small.min_work == 2929687500LL);
  // Small thresholds: min_q never below min_len; ceil of a fraction.
  CHECK(kd::cudnn_flop_rule(1e3, 16, 256, 513, true).min_q == 513);
  CHECK(kd::cudnn_flop_rule(1e3, 16, 256, 513, true).min_work == 1);
  CHECK(kd::cudnn_flop_rule(8193, 1, 1, 1, true).min_work == 4097);  // ceil(8193 / 2)
  CHECK(kd::cudnn_flop_rule(8193, 1, 1, 1, true).min_q == 65);       // 64^2 = 4096 < 4097 <= 65^2
  // Beyond any int length: takes nothing.
  const kd::CudnnRule none = kd::cudnn_flop_rule(1e30, 1, 1, 513, true);
  CHECK_FALSE(none.takes(INT_MAX - 1, INT_MAX / 4));
  CHECK_FALSE(kd::CudnnRule{}.takes(100000, 100000));

  // The workers' 16384-token passes of a 32k prompt at 16 x 256: the second chunk only, with the prefix counted.
  CHECK_FALSE(len_rule.takes(16384, 0));
  CHECK_FALSE(len_rule.takes(16384, 16384));
  CHECK_FALSE(pre.takes(16384, 0));            // 16384^2 = 2.7e8
  CHECK(pre.takes(16384, 16384));              // 16384 x 49152 = 8.1e8
  CHECK_FALSE(pre.takes(13616, 16384));        // a 30000-token prompt's second chunk: 6.3e8
  CHECK_FALSE(pre.takes(7232, 32768));         // a 40000-token prompt's third: 5.3e8
  CHECK(pre.takes(27064, 0));
  CHECK_FALSE(pre.takes(27063, 0));
  CHECK_FALSE(pre.takes(512, 1 << 30));        // the split path's groups never
  // At the boundary: 20000 x (2 x 63243 + 20000) = 2929720000 >= 2929687500 > 20000 x (2 x 63242 + 20000).
  CHECK(small.takes(20000, 63243));
  CHECK_FALSE(small.takes(20000, 63242));

  // Against the counted FLOP in long double, away from rounding: the rule takes exactly the groups that reach 6e12.
  std::mt19937 rng(20261206);
  const int shapes[][2] = {{16, 256}, {8, 128}, {4, 256}, {32, 64}};
  for (const auto& sh : shapes) {
    const kd::CudnnRule r = kd::cudnn_flop_rule(6e12, sh[0], sh[1], 513, true);
    for (int i = 0; i < 20000; ++i) {
      const int len = 1 + int(rng() % 70000), s0 = int(rng() % 140000);
      const long double flop = 4.0L * len * (s0 + len / 2.0L) * sh[0] * sh[1];
      if (std::fabs(static_cast<double>(flop - 6e12L)) < 1e7 * sh[0] * sh[1]) continue;  // (the ceil's slack)
      INFO(sh[0] << " x " << sh[1] << ": " << len << " @ " << s0);
      REQUIRE(r.takes(len, s0) == (len > 512 && flop >= 6e12L));
    }
  }
}

TEST_CASE("plan_cudnn_runs under the prefix rule: the chunks of long prompts", "[cudnn_route]") {
  const kd::CudnnRule pre = kd::cudnn_flop_rule(6e12, 16, 256, 513, true);
  bool ok = false, others = false;
  // A 32k prompt's second chunk, batched with a 40k prompt's (the same (len, slot0)); their first chunks and a 40k
  // prompt's third stay on our kernels.
  const auto runs = plan({{16384, 0}, {16384, 16384}, {16384, 16384}, {7232, 32768}}, pre, false, ok, others);
  REQUIRE(ok);
  CHECK(others);
  REQUIRE(runs.size() == 1);
  CHECK(runs[0].group0 == 1);
  CHECK(runs[0].b == 2);
  CHECK(runs[0].q0 == 16384);
  CHECK(runs[0].q_len == 16384);
  CHECK(runs[0].kv_len == 32768);
  CHECK(runs[0].s_q == 16384);
  CHECK(runs[0].s_kv == 32768);
  // Without the prefix: nothing.
  CHECK(plan({{16384, 0}, {16384, 16384}}, kd::cudnn_flop_rule(6e12, 16, 256, 513, false), false, ok, others).empty());
}

TEST_CASE("the default rule with buckets: every group at slot0 0 past 512 queries, one with cached slots only when its "
          "work pays for a plan of its own",
          "[cudnn_route]") {
  // cudnn_rule (attention.cu) at 16 x 256 heads with HYPIC_ATTN_CUDNN_BUCKETS and HYPIC_ATTN_CUDNN_PREFIX (defaults).
  kd::CudnnRule r = kd::cudnn_flop_rule(6e12, 16, 256, 513, true);
  r.min_q0 = 513;
  CHECK(r.takes(513, 0));
  CHECK(r.takes(600, 0));
  CHECK_FALSE(r.takes(512, 0));
  // A 1000-query hypic query after 20000 cached slots: 1000 x 41000 = 4.1e7 < 732421875 (a plan per slot0 would be
  // compiled within that request's TTFT): our kernel.
  CHECK_FALSE(r.takes(1000, 20000));
  CHECK_FALSE(r.takes(513, 1));
  // The second 16384-query chunk of a 32k prompt: 16384 x 49152 = 8.05e8 >= 732421875.
  CHECK(r.takes(16384, 16384));
  CHECK_FALSE(r.takes(16384 / 2, 16384));  // 8192 x 40960 = 3.4e8
  CHECK(r.takes(27064, 1));                 // min_q
  bool ok = false, others = false;
  const auto runs = plan({{600, 0}, {1000, 20000}, {3000, 0}, {16384, 16384}}, r, true, ok, others);
  REQUIRE(ok);
  CHECK(others);
  REQUIRE(runs.size() == 3);
  CHECK((runs[0].group0 == 0 && runs[0].s_q == 608 && runs[0].s_kv == 608));
  CHECK((runs[1].group0 == 2 && runs[1].s_q == 3072 && runs[1].s_kv == 3072));
  CHECK((runs[2].group0 == 3 && runs[2].s_q == 16384 && runs[2].s_kv == 32768));
}
