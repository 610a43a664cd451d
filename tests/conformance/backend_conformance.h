// The backend conformance suite (issue 28): identities every engine::Backend must satisfy, written once against the
// interface (engine/backend.h) and run on every backend: the CPU backend on every family's fixture in CI
// (tests/unit/test_backend_conformance.cpp), the CUDA backend on the GPU (tests/gpu/test_gpu_conformance.cpp). Each
// identity compares the backend with itself, so one tolerance per backend states its numerics:
//  - prefix mode, cold and warm, equals full recomputation (checkpoints restore exactly what full mode computed);
//  - hypic with every later segment recomputed whole equals full recomputation (segment 0 is exact at position 0);
//  - a prompt of one segment spliced in naive, transition and hypic mode equals full recomputation;
//  - a decode step equals the last position of the full prefill of the prompt plus that token;
//  - decode_step (greedy rows' argmax, the others' logits) equals decode(), bit for bit;
//  - hit == miss: splicing entries built once or built again, and decoding after them, gives bit-identical logits and
//    tokens, and so does the same request run twice;
//  - every splice executes the one planner's schedule (engine/splice_schedule.h), and the counts it reports are the
//    schedule's;
//  - bad plans are refused with the planner's messages.
// Header-only: the two test executables include it (Catch2 assertions inside).
#pragma once
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/sampling.h"
#include "engine/splice_schedule.h"

namespace hypic::testing {

/// What the suite is told about a backend.
struct ConformanceOptions {
  /// Relative L2 allowed between logits that are equal in exact arithmetic but come from passes of other shapes
  /// (prefix vs full, recompute-all vs full, one segment vs full, decode vs prefill): fp32 rounding on the CPU; bf16
  /// GEMMs and scans cut elsewhere on CUDA.
  double tol = 1e-4;
  uint32_t seed = 1;  ///< the random token ids' seed (use another per call on one backend: prefix checkpoints persist)
  /// Compare the logits of every query position (else the last one, the next token's, as serving uses them): on
  /// bf16 backends with random-weight MoE models a near-tied expert choice at some earlier position can flip between
  /// passes of other shapes, which the last position's logits see far less.
  bool all_rows = true;
  int seam_width = 8;
};

inline double conformance_rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    n += double(b[i]) * b[i];
  }
  return std::sqrt(d / std::max(n, 1e-300));
}

/// The last row ([V]) of logits holding rows of V values.
inline std::vector<float> conformance_last_row(const std::vector<float>& logits, int64_t V) {
  REQUIRE(logits.size() >= size_t(V));
  return std::vector<float>(logits.end() - V, logits.end());
}

inline int32_t conformance_argmax(const std::vector<float>& row) {
  return int32_t(std::max_element(row.begin(), row.end()) - row.begin());
}

/// The error of `got` against `ref` (rows of V logits) as the suite compares them (ConformanceOptions::all_rows),
/// printed as "[conformance] what: err (tol)" so that the margins show in passing runs too.
inline double conformance_err(const std::vector<float>& got, const std::vector<float>& ref, int64_t V,
                              const ConformanceOptions& o, const char* what) {
  const double e = o.all_rows ? conformance_rel_l2(got, ref)
                              : conformance_rel_l2(conformance_last_row(got, V), conformance_last_row(ref, V));
  std::printf("[conformance] %s: %.3e (tol %.1e%s)\n", what, e, o.tol, o.all_rows ? ", every query row" : ", last row");
  return e;
}

/// Runs the suite on `b` (see the file comment). Builds entries of five ragged segments (40, 7 (<= w), 130, 65 and 1
/// tokens) at w and at 0, a 20-token query.
inline void check_backend_conformance(engine::Backend& b, const ConformanceOptions& o) {
  namespace eng = hypic::engine;
  const int64_t V = b.config().vocab_size;
  const int w = o.seam_width;
  std::mt19937 rng(o.seed);
  auto ids = [&](size_t n) {
    std::vector<int32_t> v(n);
    for (auto& x : v) x = int32_t(rng() % uint32_t(V));
    return v;
  };
  const std::vector<std::vector<int32_t>> segs = {ids(40), ids(7), ids(130), ids(65), ids(1)};
  const std::vector<int32_t> query = ids(20);
  int64_t total = 0;
  for (const auto& s : segs) total += int64_t(s.size());
  const auto entries = b.build_entries(segs, w);
  const auto entries0 = b.build_entries(segs, 0);
  REQUIRE(entries.size() == segs.size());
  REQUIRE(entries0.size() == segs.size());
  for (size_t i = 0; i < segs.size(); ++i) {
    REQUIRE(entries[i]);
    CHECK(entries[i]->header().token_ids == segs[i]);
    CHECK(entries[i]->header().seam_width == w);
    CHECK(entries0[i]->header().seam_width == 0);
  }
  auto plan_of = [&](eng::SpliceMode mode, size_t n_segs, const std::vector<int32_t>& q) {
    eng::SplicePlan p;
    p.mode = mode;
    p.seam_width = w;
    p.query = q;
    const bool w0 = mode == eng::SpliceMode::Transition;
    for (size_t i = 0; i < n_segs; ++i) p.segments.push_back({segs[i], (w0 ? entries0 : entries)[i]});
    return p;
  };
  // Every splice announces the planner's schedule (no refresh here: one schedule), and the state it leaves holds
  // every token of the prompt: each attention layer's KV rows, counted on a host copy of the sequence.
  auto run = [&](eng::SplicePlan p) {
    std::vector<eng::SpliceSchedule> seen;
    p.on_schedule = [&](const eng::SpliceSchedule& s) { seen.push_back(s); };
    eng::SpliceOutput out = b.splice(p);
    REQUIRE(seen.size() == 1);
    CHECK(seen[0] == eng::schedule_splice(eng::splice_shape(p), out.prefix_segments_reused));
    REQUIRE(out.sequence);
    int64_t prompt = int64_t(p.query.size());
    for (const auto& seg : p.segments) prompt += int64_t(seg.ids.size());
    CHECK(out.num_tokens == prompt);
    const eng::ModelState st = out.sequence->to_host();
    for (const auto& a : st.attention) CHECK(a.n_tokens == prompt);
    return out;
  };
  eng::SplicePlan full_plan = plan_of(eng::SpliceMode::Full, segs.size(), query);
  full_plan.all_query_logits = true;
  const eng::SpliceOutput full = run(full_plan);
  CHECK(full.num_tokens == total + int64_t(query.size()));
  CHECK(full.computed_tokens == full.num_tokens);
  REQUIRE(full.logits.size() == query.size() * size_t(V));

  {  // prefix mode, cold then warm, equals full recomputation
    eng::SplicePlan p = plan_of(eng::SpliceMode::Prefix, segs.size(), query);
    p.all_query_logits = true;
    const eng::SpliceOutput cold = run(p);
    const double e_cold = conformance_err(cold.logits, full.logits, V, o, "prefix cold vs full");
    const eng::SpliceOutput warm = run(p);
    const double e_warm = conformance_err(warm.logits, full.logits, V, o, "prefix warm vs full");
    INFO("prefix cold " << e_cold << ", warm " << e_warm << " (reused " << warm.prefix_segments_reused << ")");
    CHECK(e_cold <= o.tol);
    CHECK(e_warm <= o.tol);
    CHECK(cold.prefix_segments_reused == 0);
    CHECK(cold.computed_tokens == total + int64_t(query.size()));
    CHECK(warm.prefix_segments_reused == int(segs.size()));
    CHECK(warm.computed_tokens == int64_t(query.size()));
    // Another prompt sharing segments 0 and 1: their checkpoints restore, the rest runs (and is checkpointed).
    eng::SplicePlan other = p;
    other.segments[2] = {ids(90), nullptr};
    other.segments.resize(3);
    eng::SplicePlan other_full = other;
    other_full.mode = eng::SpliceMode::Full;
    const eng::SpliceOutput part = run(other);
    const eng::SpliceOutput part_ref = run(other_full);
    CHECK(part.prefix_segments_reused == 2);
    CHECK(part.computed_tokens == 90 + int64_t(query.size()));
    CHECK(conformance_err(part.logits, part_ref.logits, V, o, "prefix, 2 of 3 segments reused, vs full") <= o.tol);
  }
  {  // hypic with every later segment recomputed whole is full recomputation
    eng::SplicePlan p = plan_of(eng::SpliceMode::Hypic, segs.size(), query);
    p.all_query_logits = true;
    for (int i = 1; i < int(segs.size()); ++i) p.recompute_segments.push_back(i);
    const eng::SpliceOutput got = run(p);
    const double e = conformance_err(got.logits, full.logits, V, o, "hypic, every later segment recomputed, vs full");
    INFO("hypic, every later segment recomputed: " << e);
    CHECK(e <= o.tol);
    CHECK(got.recomputed_segments == p.recompute_segments);
    CHECK(got.computed_tokens == total - int64_t(segs[0].size()) + int64_t(query.size()));
  }
  {  // one segment: every cached mode installs it as computed at position 0, as full recomputation does
    eng::SplicePlan fp = plan_of(eng::SpliceMode::Full, 1, query);
    const eng::SpliceOutput one_full = run(fp);
    for (eng::SpliceMode mode : {eng::SpliceMode::Naive, eng::SpliceMode::Transition, eng::SpliceMode::Hypic}) {
      const eng::SpliceOutput got = run(plan_of(mode, 1, query));
      const std::string what = std::string("one segment, ") + eng::splice_mode_name(mode) + " vs full";
      const double e = conformance_err(got.logits, one_full.logits, V, o, what.c_str());
      INFO("one segment, mode " << eng::splice_mode_name(mode) << ": " << e);
      CHECK(e <= o.tol);
      CHECK(got.computed_tokens == int64_t(query.size()));
    }
  }
  {  // a decode step is the next position of a prefill
    eng::SpliceOutput a = run(plan_of(eng::SpliceMode::Full, segs.size(), query));
    const int32_t t = conformance_argmax(conformance_last_row(a.logits, V));
    std::vector<float> step;
    eng::Sequence* seqs[] = {a.sequence.get()};
    const int32_t toks[] = {t};
    b.decode(seqs, toks, step);
    REQUIRE(step.size() == size_t(V));
    CHECK(a.sequence->num_tokens() == full.num_tokens + 1);
    std::vector<int32_t> longer = query;
    longer.push_back(t);
    const eng::SpliceOutput ref = run(plan_of(eng::SpliceMode::Full, segs.size(), longer));
    const double e = conformance_err(step, conformance_last_row(ref.logits, V), V, o, "decode step vs prefill");
    INFO("decode step vs prefill of one more token: " << e);
    CHECK(e <= o.tol);
  }
  {  // decode_step is decode: greedy rows get the argmax of decode()'s logits, logits rows their logits bit for bit,
     // sampling rows Sampler::pick of decode()'s logits for their draw
    const eng::SplicePlan p = plan_of(eng::SpliceMode::Hypic, segs.size(), query);
    std::vector<eng::SpliceOutput> ref_runs, step_runs;
    for (int i = 0; i < 3; ++i) ref_runs.push_back(run(p));
    for (int i = 0; i < 3; ++i) step_runs.push_back(run(p));
    const int32_t t = conformance_argmax(conformance_last_row(ref_runs[0].logits, V));
    const std::vector<int32_t> toks(3, t);
    std::vector<eng::Sequence*> ref_seqs, step_seqs;
    for (auto& r : ref_runs) ref_seqs.push_back(r.sequence.get());
    for (auto& r : step_runs) step_seqs.push_back(r.sequence.get());
    std::vector<float> ref;
    b.decode(ref_seqs, toks, ref);
    REQUIRE(ref.size() == size_t(3 * V));
    const std::vector<uint8_t> want{0, 1, 0};
    eng::Backend::DecodeStepOutput out;
    const std::vector<uint8_t> short_want{0, 1};
    CHECK_THROWS_AS(b.decode_step(step_seqs, toks, short_want, out), std::invalid_argument);
    const std::vector<uint8_t> bad_mode{0, 3, 0}, sampling{2, 1, 2};
    CHECK_THROWS_WITH(b.decode_step(step_seqs, toks, bad_mode, out), Catch::Contains("row 1 has mode 3"));
    CHECK_THROWS_WITH(b.decode_step(step_seqs, toks, sampling, out), Catch::Contains("0 draws"));
    std::vector<eng::Backend::SampleDraw> bad_draws(3);
    bad_draws[2].u = 1.0;
    CHECK_THROWS_WITH(b.decode_step(step_seqs, toks, sampling, out, bad_draws), Catch::Contains("row 2: u must be"));
    bad_draws[2].u = 0.5, bad_draws[0].top_p = 0.0f;
    CHECK_THROWS_WITH(b.decode_step(step_seqs, toks, sampling, out, bad_draws), Catch::Contains("row 0: top_p"));
    CHECK(step_runs[0].sequence->num_tokens() == ref_runs[0].sequence->num_tokens() - 1);  // nothing advanced
    const std::vector<uint8_t> mixed{0, 1, 2};  // greedy, logits and sampling rows in one step
    std::vector<eng::Backend::SampleDraw> mixed_draws(3);
    mixed_draws[2] = {0.9f, 20, 0.8f, 0.6};
    b.decode_step(step_seqs, toks, mixed, out, mixed_draws);
    REQUIRE(out.argmax.size() == 3);
    REQUIRE(out.logits.size() == size_t(V));
    auto row = [&](int r) { return std::vector<float>(ref.begin() + r * V, ref.begin() + (r + 1) * V); };
    CHECK(out.argmax[0] == conformance_argmax(row(0)));
    CHECK(out.argmax[1] == -1);
    {
      eng::SamplingConfig sc;
      sc.temperature = 0.9f, sc.top_k = 20, sc.top_p = 0.8f;
      CHECK(out.argmax[2] == eng::Sampler::pick(row(2), sc, 0.6));
    }
    CHECK(out.logits == row(1));
    // Sampling rows, one more step of each sequence against decode() of the reference ones: top-k with top-p, plain
    // temperature (the walk in id order), top-p alone, at draws near both ends.
    const std::vector<int32_t> toks2(out.argmax.begin(), out.argmax.end());
    std::vector<int32_t> toks2_fixed = toks2;
    toks2_fixed[1] = t;  // (the logits row has no token: any valid one)
    std::vector<float> ref2;
    b.decode(ref_seqs, toks2_fixed, ref2);
    const std::vector<eng::Backend::SampleDraw> draws{{0.8f, 40, 0.9f, 0.37}, {1.0f, 0, 1.0f, 0.999}, {1.3f, 0, 0.5f, 0.01}};
    const std::vector<uint8_t> all_sampling{2, 2, 2};
    b.decode_step(step_seqs, toks2_fixed, all_sampling, out, draws);
    REQUIRE(out.argmax.size() == 3);
    CHECK(out.logits.empty());
    auto row2 = [&](int r) { return std::vector<float>(ref2.begin() + r * V, ref2.begin() + (r + 1) * V); };
    for (int r : {0, 1, 2}) {
      eng::SamplingConfig sc;
      sc.temperature = draws[r].temperature, sc.top_k = draws[r].top_k, sc.top_p = draws[r].top_p;
      INFO("sampling row " << r);
      CHECK(out.argmax[r] == eng::Sampler::pick(row2(r), sc, draws[r].u));
    }
    for (auto& r : step_runs) CHECK(r.sequence->num_tokens() == ref_runs[0].sequence->num_tokens());
  }
  {  // hit == miss, bit for bit: entries built again, and the same request again, splice and decode identically
    const auto again = b.build_entries(segs, w);
    auto greedy = [&](eng::SplicePlan p, std::vector<float>& first_logits) {
      eng::SpliceOutput out = run(std::move(p));
      first_logits = out.logits;
      std::vector<int32_t> toks{conformance_argmax(conformance_last_row(out.logits, V))};
      std::vector<float> step;
      for (int k = 0; k < 6; ++k) {
        eng::Sequence* seqs[] = {out.sequence.get()};
        const int32_t tok[] = {toks.back()};
        b.decode(seqs, tok, step);
        toks.push_back(conformance_argmax(step));
      }
      return toks;
    };
    eng::SplicePlan hit = plan_of(eng::SpliceMode::Hypic, segs.size(), query);
    eng::SplicePlan miss = hit;
    for (size_t i = 0; i < segs.size(); ++i) miss.segments[i].entry = again[i];
    std::vector<float> l_hit, l_miss, l_twice;
    const auto t_hit = greedy(hit, l_hit);
    const auto t_miss = greedy(miss, l_miss);
    const auto t_twice = greedy(hit, l_twice);
    CHECK(l_hit == l_miss);
    CHECK(l_hit == l_twice);
    CHECK(t_hit == t_miss);
    CHECK(t_hit == t_twice);
  }
  {  // the query-aware refresh: the probe's schedule, then the answer's with the chosen segments whole
    eng::SplicePlan p = plan_of(eng::SpliceMode::Hypic, segs.size(), query);
    p.refresh_segments = 1;
    std::vector<eng::SpliceSchedule> seen;
    p.on_schedule = [&](const eng::SpliceSchedule& s) { seen.push_back(s); };
    const eng::SpliceOutput got = b.splice(p);
    REQUIRE(seen.size() == 2);
    CHECK(seen[0].probe);
    CHECK(seen[0] == eng::schedule_refresh_probe(eng::splice_shape(p)));
    CHECK(!seen[1].probe);
    // Segments 2 and 3 have interiors (130 and 65 tokens > w); 1 (7) and 4 (1) are all seam.
    REQUIRE(got.recomputed_segments.size() == 1);
    CHECK((got.recomputed_segments[0] == 2 || got.recomputed_segments[0] == 3));
    // The answer is the explicit splice of the chosen segment (bit for bit) plus the probe's tokens.
    eng::SplicePlan x = plan_of(eng::SpliceMode::Hypic, segs.size(), query);
    x.recompute_segments = got.recomputed_segments;
    const eng::SpliceOutput same = run(x);
    CHECK(got.logits == same.logits);
    const int64_t probe_tokens = 7 + w + w + 1 + int64_t(query.size());  // seams of segments 1-4, then the query
    CHECK(got.computed_tokens == same.computed_tokens + probe_tokens);
  }
  {  // bad plans: the planner's messages
    eng::SplicePlan empty = plan_of(eng::SpliceMode::Hypic, 0, query);
    CHECK_THROWS_WITH(b.splice(empty), Catch::Contains("segment list is empty"));
    eng::SplicePlan no_query = plan_of(eng::SpliceMode::Hypic, 2, {});
    CHECK_THROWS_WITH(b.splice(no_query), Catch::Contains("query has no tokens"));
    eng::SplicePlan no_entry = plan_of(eng::SpliceMode::Hypic, 3, query);
    no_entry.segments[2].entry = nullptr;
    CHECK_THROWS_WITH(b.splice(no_entry), Catch::Contains("segment 2 has no entry (required by mode hypic)"));
    if (!b.device_entries()) {  // a host block (PlanSegment::block) where entries live in host memory
      struct HeaderBlock final : eng::HostBlock {
        eng::SegmentEntry h;
        const eng::SegmentEntry& header() const override { return h; }
        size_t bytes() const override { return 1; }
      };
      eng::SplicePlan blk = plan_of(eng::SpliceMode::Hypic, 3, query);
      auto hb = std::make_shared<HeaderBlock>();
      hb->h = blk.segments[1].entry->header();
      blk.segments[1].entry = nullptr;
      blk.segments[1].block = hb;
      CHECK_THROWS_AS(b.splice(blk), std::invalid_argument);
      CHECK_THROWS_WITH(b.splice(blk), Catch::Contains("segment 1 brings a host block"));
    }
    no_entry.recompute_segments = {2};  // recomputed whole: its ids suffice
    CHECK_NOTHROW(b.splice(no_entry));
    eng::SplicePlan wide = plan_of(eng::SpliceMode::Transition, 2, query);
    wide.segments[1].entry = entries[1];  // a w > 0 entry where transition mode needs w = 0
    CHECK_THROWS_WITH(b.splice(wide), Catch::Contains("seam width"));
    eng::SplicePlan bad_index = plan_of(eng::SpliceMode::Hypic, 2, query);
    bad_index.recompute_segments = {0};
    CHECK_THROWS_WITH(b.splice(bad_index), Catch::Contains("index 0 is outside [1, 2)"));
  }
}

}  // namespace hypic::testing
