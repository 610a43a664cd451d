// Segment entries and splicing (DESIGN.md 3.2-3.4) on the HF fixture models (tests/fixtures).
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <memory>
#include <random>

#include "engine/cpu/splice.h"
#include "tests/unit/splice_checks.h"

using namespace hypic::engine;
using hypic::testing::make_request;
using hypic::testing::rel_l2;

namespace {

const Model& fixture_model(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Model>> cache;
  auto& m = cache[name];
  if (!m) m = std::make_unique<Model>(Model::load(std::string(HYPIC_SOURCE_DIR) + "/tests/fixtures/" + name));
  return *m;
}

// The fixture with every linear layer's decay slowed (A_log = log 0.02, so e^g ~ 0.97 per token): the HF
// fixtures' random A_log forget within a token or two, which would hide composition errors behind decay.
const Model& slow_decay_model(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Model>> cache;
  auto& m = cache[name];
  if (!m) {
    const std::string dir = std::string(HYPIC_SOURCE_DIR) + "/tests/fixtures/" + name;
    ModelConfig cfg = load_config(dir);
    ModelWeights w = load_weights(cfg, dir);
    for (auto& layer : w.layers)
      if (layer.type == LayerType::Linear)
        for (auto& a : layer.linear.A_log.data) a = std::log(0.02f);
    m = std::make_unique<Model>(std::move(cfg), std::move(w));
  }
  return *m;
}

std::vector<int32_t> random_ids(int n, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& x : ids) x = static_cast<int32_t>(rng() % vocab);
  return ids;
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

// max |a - b| / max |b|
double scaled_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::fabs(a[i] - b[i])));
  return m / std::max(max_abs(b), 1e-30);
}



// The DESIGN.md 3.3 steps done one segment at a time with the public API, up to the query: the first entry whole,
// then per later segment its seam prefilled in context, its interior folded into every linear layer and its K/V
// (K re-rotated to real positions) appended. `pos` becomes the query's first position.
ModelState hypic_context_by_hand(const Model& m, const SpliceRequest& req, int w, int64_t& pos) {
  ModelState st = m.initial_state();
  const SegmentEntry& e0 = *req.segments[0].entry;
  for (int l = 0; l < e0.geometry.num_linear; ++l) {
    st.linear[l].ssm = e0.whole_state(l);
    st.linear[l].conv = e0.linear[l].conv_tail;
  }
  for (int a = 0; a < e0.geometry.num_attention; ++a) {
    st.attention[a].k = e0.attention[a].k;
    st.attention[a].v = e0.attention[a].v;
    st.attention[a].n_tokens = e0.num_tokens();
  }
  pos = e0.num_tokens();
  PrefillOptions skip;
  skip.skip_logits = true;
  for (size_t i = 1; i < req.segments.size(); ++i) {
    const SegmentEntry& e = *req.segments[i].entry;
    const int n = e.num_tokens(), s = std::min(w, n);
    m.prefill(st, std::span<const int32_t>(e.token_ids).subspan(0, s), pos, skip);
    if (n > s) {
      for (int l = 0; l < e.geometry.num_linear; ++l) {
        compose_state(st.linear[l].ssm, e.linear[l].interior_transition, e.linear[l].interior_state,
                      e.geometry.d_v);
        st.linear[l].conv = e.linear[l].conv_tail;
      }
      const size_t row = size_t(e.geometry.kv_heads) * e.geometry.head_dim;
      for (int a = 0; a < e.geometry.num_attention; ++a) {
        std::vector<float> k(e.attention[a].k.begin() + s * row, e.attention[a].k.end());
        m.rope_rotate(k.data(), n - s, e.geometry.kv_heads, pos);
        st.attention[a].k.insert(st.attention[a].k.end(), k.begin(), k.end());
        st.attention[a].v.insert(st.attention[a].v.end(), e.attention[a].v.begin() + s * row,
                                 e.attention[a].v.end());
        st.attention[a].n_tokens += n - s;
      }
    }
    pos += n;
  }
  return st;
}

// The attention mass of the query's last token per KV row over the plain hypic context built by hand (public API):
// what the refresh's probe measures.
std::vector<float> query_mass_by_hand(const Model& m, const SpliceRequest& req, int w, int64_t& pos) {
  ModelState st = hypic_context_by_hand(m, req, w, pos);
  std::vector<float> mass;
  PrefillOptions probe;
  probe.attention_mass = &mass;
  m.prefill(st, req.query, pos, probe);
  return mass;
}

const char* kModels[] = {"qwen3_next_moe", "qwen3_5_dense", "qwen3_5_moe"};

}  // namespace

TEST_CASE("one segment plus a query: hypic, transition, naive and prefix equal full", "[splice]") {
  for (const char* name : kModels) {
    DYNAMIC_SECTION(name) {
      const Model& m = fixture_model(name);
      const int V = static_cast<int>(m.config().vocab_size);
      const auto seg = random_ids(83, 1, V), query = random_ids(9, 2, V);
      const SpliceResult full = splice(m, make_request(m, {seg}, query, SpliceMode::Full, 8));
      REQUIRE(full.logits.size() == query.size() * size_t(V));
      for (SpliceMode mode : {SpliceMode::Hypic, SpliceMode::Transition, SpliceMode::Naive, SpliceMode::Prefix}) {
        const SpliceResult r = splice(m, make_request(m, {seg}, query, mode, 8));
        INFO(splice_mode_name(mode));
        CHECK(r.num_tokens == 92);
        // fp32: the only difference is where the chunked scan's chunk boundaries fall.
        CHECK(scaled_diff(r.logits, full.logits) < 1e-5);
        for (size_t l = 0; l < r.state.linear.size(); ++l) CHECK(rel_l2(r.state.linear[l].ssm, full.state.linear[l].ssm) < 1e-5);
      }
    }
  }
}

TEST_CASE("prefix mode equals full, cold and with a warm prefix cache", "[splice]") {
  const Model& m = fixture_model("qwen3_5_moe");
  const int V = static_cast<int>(m.config().vocab_size);
  const std::vector<std::vector<int32_t>> segs = {random_ids(40, 3, V), random_ids(70, 4, V), random_ids(5, 5, V)};
  const auto query = random_ids(6, 6, V);
  const SpliceResult full = splice(m, make_request(m, segs, query, SpliceMode::Full, 8));
  PrefixStateCache cache(size_t(1) << 30);
  SpliceRequest req = make_request(m, segs, query, SpliceMode::Prefix, 8);
  req.prefix_cache = &cache;
  const SpliceResult cold = splice(m, req);
  CHECK(cold.prefix_segments_reused == 0);
  // Tolerances below: fp32, chunk boundaries of the gated-delta scan differ between one span and several.
  CHECK(cache.entries() == 3);
  const SpliceResult warm = splice(m, req);
  CHECK(warm.prefix_segments_reused == 3);
  CHECK(warm.computed_tokens == 6);
  CHECK(scaled_diff(cold.logits, full.logits) < 5e-5);
  CHECK(scaled_diff(warm.logits, full.logits) < 5e-5);
  // Each checkpoint is the state of one prefill over segments 0..i (full mode's state at that point): linear states
  // and conv tails (inputs of later layers) within the chunked scan's fp32 rounding.
  SegmentDigest chain{};
  std::vector<int32_t> upto;
  for (size_t i = 0; i < segs.size(); ++i) {
    chain = chain_digest(chain, segs[i]);
    upto.insert(upto.end(), segs[i].begin(), segs[i].end());
    ModelState ref = m.initial_state();
    PrefillOptions no_logits;
    no_logits.skip_logits = true;
    m.prefill(ref, upto, 0, no_logits);
    const auto cp = cache.get(chain);
    REQUIRE(cp);
    CHECK(cp->num_tokens == ref.num_tokens);
    for (size_t l = 0; l < ref.linear.size(); ++l) {
      CHECK(rel_l2(cp->linear[l].ssm, ref.linear[l].ssm) < 1e-5);
      CHECK(rel_l2(cp->linear[l].conv, ref.linear[l].conv) < 1e-5);
    }
    for (size_t a = 0; a < ref.attention.size(); ++a) {
      CHECK(rel_l2(cp->attention[a].k, ref.attention[a].k) < 1e-5);
      CHECK(rel_l2(cp->attention[a].v, ref.attention[a].v) < 1e-5);
    }
  }
  // A different last segment reuses the first two only.
  SpliceRequest other = req;
  other.segments[2].ids = random_ids(7, 9, V);
  CHECK(splice(m, other).prefix_segments_reused == 2);
}

TEST_CASE("chunked prefill: every mode in passes of max_pass_tokens equals one pass within rounding, pausing between "
          "two, and stops between passes when cancelled", "[splice]") {
  const Model& m = fixture_model("qwen3_5_moe");
  const int V = static_cast<int>(m.config().vocab_size);
  const std::vector<std::vector<int32_t>> segs = {random_ids(30, 41, V), random_ids(50, 42, V), random_ids(37, 43, V)};
  const auto query = random_ids(23, 44, V);
  struct Case {
    SpliceMode mode;
    int refresh_tail, refresh_segments;
    bool keep_context;
  };
  for (const Case& c : {Case{SpliceMode::Full, 0, 0, false}, Case{SpliceMode::Prefix, 0, 0, false},
                        Case{SpliceMode::Naive, 0, 0, false}, Case{SpliceMode::Hypic, 0, 0, true},
                        Case{SpliceMode::Hypic, 1, 0, false}, Case{SpliceMode::Hypic, 1, 1, false}}) {
    INFO(splice_mode_name(c.mode) << " refresh_tail " << c.refresh_tail << " refresh_segments " << c.refresh_segments);
    SpliceRequest req = make_request(m, segs, query, c.mode, 8);
    req.refresh_tail = c.refresh_tail;
    req.refresh_segments = c.refresh_segments;
    req.keep_context_state = c.keep_context;
    req.all_query_logits = c.keep_context;  // every query row's logits: the query stays in one pass
    const SpliceResult one = splice(m, req);
    int paused = 0;
    req.max_pass_tokens = 7;
    req.between_passes = [&] { ++paused; };
    const SpliceResult chunked = splice(m, req);
    // Passes of at most 7 tokens over what runs in context (the query whole when all its logits are wanted).
    const int64_t cut = chunked.computed_tokens - (req.all_query_logits ? int64_t(query.size()) : 0);
    CHECK(paused >= int(cut / 7) - 1);
    CHECK(chunked.computed_tokens == one.computed_tokens);
    CHECK(chunked.recomputed_segments == one.recomputed_segments);
    CHECK(scaled_diff(chunked.logits, one.logits) < 5e-5);
    for (size_t l = 0; l < one.state.linear.size(); ++l)
      CHECK(rel_l2(chunked.state.linear[l].ssm, one.state.linear[l].ssm) < 1e-5);
    for (size_t l = 0; l < one.context_states.size(); ++l)
      CHECK(rel_l2(chunked.context_states[l], one.context_states[l]) < 1e-5);
    // Cancelled at the second pause: no third pass runs.
    auto flag = std::make_shared<std::atomic<bool>>(false);
    req.cancel = flag;
    paused = 0;
    req.between_passes = [&] {
      if (++paused == 2) flag->store(true);
    };
    CHECK_THROWS_AS(splice(m, req), SpliceCancelled);
    CHECK(paused == 2);
  }
}

TEST_CASE("a cancelled request stops after the refresh's probe, before its second pass", "[splice]") {
  const Model& m = fixture_model("qwen3_5_moe");
  const int V = static_cast<int>(m.config().vocab_size);
  const std::vector<std::vector<int32_t>> segs = {random_ids(30, 21, V), random_ids(40, 22, V), random_ids(35, 23, V)};
  SpliceRequest req = make_request(m, segs, random_ids(5, 24, V), SpliceMode::Hypic, 8);
  req.refresh_segments = 1;
  auto flag = std::make_shared<std::atomic<bool>>(false);
  req.cancel = flag;
  const SpliceResult done = splice(m, req);  // not cancelled: probe + splice
  CHECK(done.recomputed_segments.size() == 1);
  flag->store(true);
  CHECK_THROWS_AS(splice(m, req), SpliceCancelled);
  // Without a probe (no refresh) there is no second pass to stop: the flag is the caller's to check before.
  req.refresh_segments = 0;
  CHECK_NOTHROW(splice(m, req));
}

TEST_CASE("entries store what the modes need: S_seam only with a seam, never T_seam, one (T, S) pair at w = 0",
          "[splice][segment]") {
  const Model& m = fixture_model("qwen3_5_moe");
  const int V = static_cast<int>(m.config().vocab_size);
  const auto seg = random_ids(83, 31, V), first = random_ids(20, 32, V), query = random_ids(5, 33, V);
  const SegmentEntry e8 = build_segment_entry(m, seg, 8), e0 = build_segment_entry(m, seg, 0);
  const EntryGeometry& g = e8.geometry;
  const size_t state = size_t(g.linear_heads) * g.d_k * g.d_v;
  REQUIRE(g.num_linear > 0);
  for (int l = 0; l < g.num_linear; ++l) {
    INFO("linear layer " << l);
    CHECK(e8.linear[l].seam_state.size() == state);
    CHECK(e0.linear[l].seam_state.empty());
    // w = 0: the interior is the whole segment, (T_int, S_int) = (T_C, S(C|0)).
    CHECK(e0.whole_transition(l).data == e0.linear[l].interior_transition.data);
    CHECK(e0.whole_state(l) == e0.linear[l].interior_state);
    // w = 8: S(C|0) = T_int S_seam + S_int is the one-span S(C|0) up to the scan's chunk boundaries (fp32).
    CHECK(rel_l2(e8.whole_state(l), e0.whole_state(l)) < 1e-5);
  }
  // Exactly one state per linear layer fewer at w = 0, none of them a T_seam at w = 8 (version 2 held four).
  CHECK(e8.byte_size() - e0.byte_size() == size_t(g.num_linear) * state * sizeof(float));
  // The w = 0 entry's bytes from the format (engine/segment.h): magic, header length, header (version, fingerprint,
  // numerics, w, n, ids, 9 geometry values, one kind per linear layer, the K/V type), header checksum, per linear layer
  // T_int (dense here) + S_int + conv tail, K and V (fp32: a CPU entry's values are not bf16 values), checksum.
  const size_t n = seg.size(), L = size_t(g.num_linear);
  const size_t header = 4 + 4 + e0.model_fingerprint.size() + 4 + e0.numerics.size() + 4 + 4 + 4 * n + 9 * 4 + L + 1;
  const size_t tensors = L * (size_t(g.linear_heads) * g.d_k * g.d_k + state + size_t(g.conv_rows) * g.conv_dim) +
                         size_t(g.num_attention) * n * g.kv_heads * (g.head_dim + g.v_dim());
  CHECK(e0.byte_size() == 8 + 4 + header + 8 + tensors * sizeof(float) + 8);
  CHECK(serialize_entry(e0).size() == e0.byte_size());
  CHECK_THROWS_WITH(e8.whole_transition(0), Catch::Contains("seam width 8") && Catch::Contains("seam width 0"));
  // Transition mode refuses w = 8 entries, naming the width it needs; naive takes them (it needs S(C|0) only).
  SpliceRequest tr = make_request(m, {first, seg}, query, SpliceMode::Transition, 8);
  tr.segments[1].entry = std::make_shared<const SegmentEntry>(e8);
  CHECK_THROWS_WITH(splice(m, tr), Catch::Contains("seam width 8") && Catch::Contains("transition mode"));
  SpliceRequest nv = make_request(m, {first, seg}, query, SpliceMode::Naive, 0);
  const SpliceResult naive0 = splice(m, nv);
  nv.segments[1].entry = std::make_shared<const SegmentEntry>(e8);
  CHECK(scaled_diff(splice(m, nv).logits, naive0.logits) < 1e-5);
}

TEST_CASE("an entry loaded from bytes splices exactly like a freshly computed one (hit == miss)", "[splice]") {
  const Model& m = fixture_model("qwen3_next_moe");
  const int V = static_cast<int>(m.config().vocab_size);
  const std::vector<std::vector<int32_t>> segs = {random_ids(30, 7, V), random_ids(75, 8, V), random_ids(20, 9, V)};
  const auto query = random_ids(5, 10, V);
  SpliceRequest fresh = make_request(m, segs, query, SpliceMode::Hypic, 8);
  SpliceRequest loaded = fresh;
  for (auto& s : loaded.segments)
    s.entry = std::make_shared<const SegmentEntry>(deserialize_entry(serialize_entry(*s.entry)));
  const SpliceResult a = splice(m, fresh), b = splice(m, loaded);
  CHECK(a.logits == b.logits);  // bitwise
  for (size_t l = 0; l < a.state.linear.size(); ++l) CHECK(a.state.linear[l].ssm == b.state.linear[l].ssm);
  // And a rebuilt entry is bitwise identical to the first build (deterministic standalone prefill).
  CHECK(serialize_entry(build_segment_entry(m, segs[1], 8)) == serialize_entry(*fresh.segments[1].entry));
}

TEST_CASE("entries reused at other positions and in another order: layer 0 composes exactly", "[splice]") {
  // Layer 0 is a linear layer whose inputs (embeddings) do not depend on context, so with a seam window covering
  // the conv kernel (w >= K-1) the hypic state at layer 0 must equal full recomputation for any order and position
  // (HYPIC paper section 3.1: the tuple is exact at layer 0). Naive addition must be far off.
  for (const char* name : kModels) {
    DYNAMIC_SECTION(name) {
      const Model& m = slow_decay_model(name);
      REQUIRE(m.config().layer_types[0] == LayerType::Linear);
      const int V = static_cast<int>(m.config().vocab_size);
      const auto A = random_ids(50, 11, V), B = random_ids(90, 12, V), C = random_ids(3, 13, V);
      const auto query = random_ids(4, 14, V);
      for (const auto& order : {std::vector<std::vector<int32_t>>{A, B, C}, std::vector<std::vector<int32_t>>{C, B, A},
                                std::vector<std::vector<int32_t>>{B, A}}) {
        const SpliceResult full = splice(m, make_request(m, order, query, SpliceMode::Full, 8));
        const SpliceResult hyp = splice(m, make_request(m, order, query, SpliceMode::Hypic, 8));
        const SpliceResult naive = splice(m, make_request(m, order, query, SpliceMode::Naive, 8));
        const double e_h = rel_l2(hyp.state.linear[0].ssm, full.state.linear[0].ssm);
        const double e_n = rel_l2(naive.state.linear[0].ssm, full.state.linear[0].ssm);
        CHECK(e_h < 1e-5);
        CHECK(e_n > 1e-1);
        CHECK(hyp.num_tokens == full.num_tokens);
      }
    }
  }
}

TEST_CASE("a seam window covering every segment recomputes the whole prompt: hypic equals full", "[splice]") {
  const Model& m = fixture_model("qwen3_5_dense");
  const int V = static_cast<int>(m.config().vocab_size);
  const std::vector<std::vector<int32_t>> segs = {random_ids(20, 15, V), random_ids(30, 16, V)};
  const auto query = random_ids(3, 17, V);
  const SpliceResult full = splice(m, make_request(m, segs, query, SpliceMode::Full, 8));
  const SpliceResult hyp = splice(m, make_request(m, segs, query, SpliceMode::Hypic, 64));
  CHECK(hyp.computed_tokens == 30 + 3);
  CHECK(scaled_diff(hyp.logits, full.logits) < 1e-5);
}

TEST_CASE("rope_rotate re-rotates K: R(d) R(p) = R(p + d), matching the RoPE formula", "[splice]") {
  const Model& m = fixture_model("qwen3_5_moe");
  const ModelConfig& c = m.config();
  const int heads = c.num_key_value_heads, hd = c.head_dim, rot = c.rotary_dim();
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(heads) * hd);
  for (auto& v : x) v = nd(rng);
  for (int64_t p : {int64_t(0), int64_t(1), int64_t(37), int64_t(1000)}) {
    std::vector<float> want = x;  // NeoX rotate-half on the first rot dims, inv_freq_i = theta^(-2i/rot)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < rot / 2; ++i) {
        const double ang = double(p) * std::pow(c.rope_theta, -2.0 * i / rot);
        const double a = x[h * hd + i], b = x[h * hd + i + rot / 2];
        want[h * hd + i] = static_cast<float>(a * std::cos(ang) - b * std::sin(ang));
        want[h * hd + i + rot / 2] = static_cast<float>(b * std::cos(ang) + a * std::sin(ang));
      }
    std::vector<float> once = x, twice = x;
    m.rope_rotate(once.data(), 1, heads, p);
    m.rope_rotate(twice.data(), 1, heads, p / 2);
    m.rope_rotate(twice.data(), 1, heads, p - p / 2);
    for (size_t i = 0; i < x.size(); ++i) {
      CHECK(once[i] == Approx(want[i]).margin(1e-4));
      CHECK(twice[i] == Approx(want[i]).margin(1e-4));
    }
  }
}

TEST_CASE("bad splice input is a clear error", "[splice]") {
  const Model& m = fixture_model("qwen3_5_dense");
  const Model& other = fixture_model("qwen3_5_moe");
  const int V = static_cast<int>(m.config().vocab_size);
  const auto seg = random_ids(20, 18, V), query = random_ids(3, 19, V);
  SpliceRequest ok = make_request(m, {seg, seg}, query, SpliceMode::Hypic, 8);

  SpliceRequest empty = ok;
  empty.segments.clear();
  CHECK_THROWS_WITH(splice(m, empty), Catch::Contains("segment list is empty"));
  SpliceRequest noquery = ok;
  noquery.query.clear();
  CHECK_THROWS_WITH(splice(m, noquery), Catch::Contains("query has no tokens"));
  SpliceRequest wrong_w = ok;
  wrong_w.seam_width = 4;
  CHECK_THROWS_WITH(splice(m, wrong_w), Catch::Contains("seam width 8"));
  SpliceRequest foreign = ok;
  foreign.segments[1].entry = std::make_shared<const SegmentEntry>(build_segment_entry(other, seg, 8));
  CHECK_THROWS_AS(splice(m, foreign), EntryError);
  SpliceRequest missing = ok;
  missing.segments[1].entry.reset();
  CHECK_THROWS_WITH(splice(m, missing), Catch::Contains("has no entry"));
  SpliceRequest mismatch = ok;
  mismatch.segments[1].ids = random_ids(20, 99, V);
  CHECK_THROWS_WITH(splice(m, mismatch), Catch::Contains("differ from its entry"));
  CHECK_THROWS_WITH(parse_splice_mode("fast"), Catch::Contains("unknown splice mode 'fast'"));
  CHECK_THROWS_AS(build_segment_entry(m, std::vector<int32_t>{}, 8), std::invalid_argument);
  const std::string bytes = serialize_entry(*ok.segments[0].entry);
  CHECK_THROWS_AS(deserialize_entry(std::string_view(bytes).substr(0, bytes.size() - 3)), EntryError);
  // Nothing was lost: the good request still works after the failures.
  CHECK_NOTHROW(splice(m, ok));
}

TEST_CASE("prefill with skip_logits moves the state exactly like a prefill with logits", "[splice]") {
  const Model& m = fixture_model("qwen3_next_moe");
  const auto ids = random_ids(70, 21, static_cast<int>(m.config().vocab_size));
  ModelState a = m.initial_state(), b = m.initial_state();
  PrefillOptions skip;
  skip.skip_logits = true;
  const PrefillResult ra = m.prefill(a, ids, 0, {});
  const PrefillResult rb = m.prefill(b, ids, 0, skip);
  CHECK(ra.logits.size() == size_t(m.config().vocab_size));
  CHECK(rb.logits.empty());
  for (size_t l = 0; l < a.linear.size(); ++l) {
    CHECK(a.linear[l].ssm == b.linear[l].ssm);
    CHECK(a.linear[l].conv == b.linear[l].conv);
  }
  for (size_t i = 0; i < a.attention.size(); ++i) CHECK(a.attention[i].k == b.attention[i].k);
  CHECK(a.num_tokens == b.num_tokens);
}

TEST_CASE("hypic splice (one layer-by-layer pass over all seams) equals seams prefilled one after another", "[splice]") {
  // Reference: the DESIGN.md 3.3 steps done one segment at a time with the public API (prefill each seam, then
  // fold the interior into every layer and append its re-rotated K/V), then the query.
  for (const char* name : {"qwen3_next_moe", "qwen3_5_dense"}) {
    DYNAMIC_SECTION(name) {
      const Model& m = slow_decay_model(name);
      const ModelConfig& c = m.config();
      const int V = static_cast<int>(c.vocab_size), w = 8;
      const std::vector<std::vector<int32_t>> segs = {random_ids(40, 31, V), random_ids(70, 32, V),
                                                      random_ids(5, 33, V), random_ids(30, 34, V)};
      const auto query = random_ids(6, 35, V);
      SpliceRequest req = make_request(m, segs, query, SpliceMode::Hypic, w);
      const SpliceResult got = splice(m, req);

      int64_t pos = 0;
      ModelState st = hypic_context_by_hand(m, req, w, pos);
      PrefillOptions all;
      all.all_logits = true;
      const PrefillResult want = m.prefill(st, query, pos, all);
      CHECK(got.num_tokens == pos + static_cast<int64_t>(query.size()));
      CHECK(scaled_diff(got.logits, want.logits) < 1e-5);  // the MLP/MoE GEMMs see other batch sizes
      for (size_t l = 0; l < st.linear.size(); ++l) CHECK(rel_l2(got.state.linear[l].ssm, st.linear[l].ssm) < 1e-5);
      for (size_t a = 0; a < st.attention.size(); ++a) {
        CHECK(got.state.attention[a].n_tokens == st.attention[a].n_tokens);
        CHECK(rel_l2(got.state.attention[a].k, st.attention[a].k) < 1e-5);
      }
    }
  }
}

TEST_CASE("hypic with seam width 0 equals transition mode", "[splice]") {
  const Model& m = slow_decay_model("qwen3_5_moe");
  const int V = static_cast<int>(m.config().vocab_size);
  const std::vector<std::vector<int32_t>> segs = {random_ids(20, 41, V), random_ids(33, 42, V), random_ids(9, 43, V)};
  const auto query = random_ids(4, 44, V);
  SpliceRequest hyp = make_request(m, segs, query, SpliceMode::Hypic, 0);
  hyp.keep_context_state = true;
  SpliceRequest tr = hyp;
  tr.mode = SpliceMode::Transition;
  const SpliceResult a = splice(m, hyp), b = splice(m, tr);
  CHECK(a.computed_tokens == 4);
  CHECK(scaled_diff(a.logits, b.logits) < 1e-5);
  REQUIRE(a.context_states.size() == b.context_states.size());
  for (size_t l = 0; l < a.context_states.size(); ++l) CHECK(rel_l2(a.context_states[l], b.context_states[l]) < 1e-5);
}

TEST_CASE("build_segment_entries: one prefill for several widths equals build_segment_entry per width", "[splice]") {
  const std::vector<int> widths = {0, 2, 8, 64, 200, 8};  // 200 > n; a duplicate width gets its own entry
  for (const char* name : {"qwen3_next_moe", "qwen3_5_dense"}) {
    DYNAMIC_SECTION(name) {
      const Model& m = fixture_model(name);
      const int V = static_cast<int>(m.config().vocab_size);
      const std::vector<std::vector<int32_t>> segs = {random_ids(150, 51, V), random_ids(150, 52, V)};
      const auto query = random_ids(5, 53, V);
      std::vector<std::vector<SegmentEntry>> many;  // [segment][width]
      for (const auto& ids : segs) many.push_back(build_segment_entries(m, ids, widths));
      for (size_t i = 0; i < widths.size(); ++i) {
        const int w = widths[i];
        INFO("w = " << w);
        std::vector<SegmentEntry> one;
        for (const auto& ids : segs) one.push_back(build_segment_entry(m, ids, w));
        for (size_t s = 0; s < segs.size(); ++s) {
          const SegmentEntry& a = many[s][i];
          const SegmentEntry& b = one[s];
          REQUIRE(a.seam_width == w);
          CHECK(a.token_ids == b.token_ids);
          CHECK(a.model_fingerprint == b.model_fingerprint);
          CHECK(a.numerics == b.numerics);
          REQUIRE(a.linear.size() == b.linear.size());
          for (size_t l = 0; l < a.linear.size(); ++l) {
            INFO("linear layer " << l);
            CHECK(scaled_diff(a.linear[l].seam_state, b.linear[l].seam_state) < 1e-4);
            CHECK(scaled_diff(a.linear[l].interior_transition.data, b.linear[l].interior_transition.data) < 1e-4);
            CHECK(scaled_diff(a.linear[l].interior_state, b.linear[l].interior_state) < 1e-4);
            CHECK(scaled_diff(a.linear[l].conv_tail, b.linear[l].conv_tail) < 1e-4);
          }
          REQUIRE(a.attention.size() == b.attention.size());
          for (size_t l = 0; l < a.attention.size(); ++l) {
            CHECK(scaled_diff(a.attention[l].k, b.attention[l].k) < 1e-4);
            CHECK(scaled_diff(a.attention[l].v, b.attention[l].v) < 1e-4);
          }
        }
        SpliceRequest req_many, req_one;
        for (size_t s = 0; s < segs.size(); ++s) {
          req_many.segments.push_back({segs[s], std::make_shared<const SegmentEntry>(many[s][i])});
          req_one.segments.push_back({segs[s], std::make_shared<const SegmentEntry>(one[s])});
        }
        for (SpliceRequest* r : {&req_many, &req_one}) {
          r->query = query;
          r->mode = SpliceMode::Hypic;
          r->seam_width = w;
          r->all_query_logits = true;
        }
        CHECK(scaled_diff(splice(m, req_many).logits, splice(m, req_one).logits) < 1e-4);
      }
    }
  }
  const Model& m = fixture_model("qwen3_5_dense");
  CHECK_THROWS_WITH(build_segment_entries(m, std::vector<int32_t>{}, widths), Catch::Contains("no tokens"));
  CHECK_THROWS_WITH(build_segment_entries(m, random_ids(10, 54, 256), std::vector<int>{4, -1}),
                    Catch::Contains("got -1"));
  CHECK(build_segment_entries(m, random_ids(10, 54, 256), std::vector<int>{}).empty());
}

TEST_CASE("local_positions keeps later segments' K at local positions: re-rotated by their starts they are the real "
          "placement's K, the states and V unchanged", "[splice]") {
  // The reference's `addition` / `transition` baselines (SpliceRequest::local_positions): the same composition,
  // only the RoPE fix left out. Checked against the real-position splice through R(p + d) = R(d) R(p).
  for (const char* name : kModels) {
    DYNAMIC_SECTION(name) {
      const Model& m = slow_decay_model(name);
      REQUIRE(m.config().attention_has_rope());
      REQUIRE_FALSE(m.linear_states_rotate());
      const int V = static_cast<int>(m.config().vocab_size);
      const std::vector<std::vector<int32_t>> segs = {random_ids(21, 31, V), random_ids(34, 32, V),
                                                      random_ids(13, 33, V)};
      const auto query = random_ids(5, 34, V);
      for (SpliceMode mode : {SpliceMode::Naive, SpliceMode::Transition}) {
        INFO(splice_mode_name(mode));
        const SpliceResult real = splice(m, make_request(m, segs, query, mode, 0));
        SpliceRequest req = make_request(m, segs, query, mode, 0);
        req.local_positions = true;
        const SpliceResult local = splice(m, req);
        CHECK(local.num_tokens == real.num_tokens);
        CHECK(local.computed_tokens == real.computed_tokens);
        REQUIRE(local.state.attention.size() == real.state.attention.size());
        const int kvh = m.config().num_key_value_heads, hd = m.config().head_dim;
        const size_t row = size_t(kvh) * hd;
        for (size_t a = 0; a < real.state.attention.size(); ++a) {
          const AttentionLayerState& L = local.state.attention[a];
          const AttentionLayerState& R = real.state.attention[a];
          REQUIRE(L.n_tokens == R.n_tokens);
          std::vector<float> k = L.k;
          int64_t start = 0;
          for (const auto& s : segs) {  // the first segment sits at 0 in both; later ones move by their start
            if (start > 0) m.rope_rotate(k.data() + start * row, static_cast<int>(s.size()), kvh, start);
            start += static_cast<int64_t>(s.size());
          }
          // the query's own rows were computed in context at real positions in both
          const std::vector<float> seg_k(k.begin(), k.begin() + start * row);
          const std::vector<float> real_k(R.k.begin(), R.k.begin() + start * row);
          CHECK(scaled_diff(seg_k, real_k) < 1e-5);
          const size_t seg_v = L.v.size() / L.n_tokens * start;  // V is position-free: the cached rows as they are
          CHECK(std::vector<float>(L.v.begin(), L.v.begin() + seg_v) ==
                std::vector<float>(R.v.begin(), R.v.begin() + seg_v));
          const std::vector<float> local_unrotated(L.k.begin() + segs[0].size() * row, L.k.begin() + start * row);
          const std::vector<float> real_rows(R.k.begin() + segs[0].size() * row, R.k.begin() + start * row);
          CHECK(scaled_diff(local_unrotated, real_rows) > 1e-3);  // the fix does move them
        }
        CHECK(rel_l2(local.state.linear[0].ssm, real.state.linear[0].ssm) < 1e-6);  // layer 0 sees no attention
        CHECK(scaled_diff(local.logits, real.logits) > 1e-6);
      }
      for (SpliceMode mode : {SpliceMode::Full, SpliceMode::Prefix, SpliceMode::Hypic}) {
        SpliceRequest bad = make_request(m, segs, query, mode, 8);
        bad.local_positions = true;
        const std::string want = "local_positions applies to modes naive and transition, not ";
        CHECK_THROWS_WITH(splice(m, bad), Catch::Contains(want + splice_mode_name(mode)));
      }
    }
  }
}

TEST_CASE("recompute_segments: every later segment recomputed whole in context is full recomputation", "[splice]") {
  for (const char* name : kModels) {
    DYNAMIC_SECTION(name) {
      const Model& m = slow_decay_model(name);
      const int V = static_cast<int>(m.config().vocab_size), w = 8;
      const std::vector<std::vector<int32_t>> segs = {random_ids(30, 51, V), random_ids(45, 52, V),
                                                      random_ids(20, 53, V)};
      const auto query = random_ids(5, 54, V);
      SpliceRequest full = make_request(m, segs, query, SpliceMode::Full, w);
      full.keep_context_state = true;
      SpliceRequest hyp = full;
      hyp.mode = SpliceMode::Hypic;
      hyp.recompute_segments = {2, 1};  // any order
      const SpliceResult want = splice(m, full), got = splice(m, hyp);
      CHECK(got.recomputed_segments == std::vector<int>{1, 2});
      CHECK(got.computed_tokens == 45 + 20 + 5);
      CHECK(scaled_diff(got.logits, want.logits) < 1e-4);
      REQUIRE(got.context_states.size() == want.context_states.size());
      for (size_t l = 0; l < got.context_states.size(); ++l)
        CHECK(rel_l2(got.context_states[l], want.context_states[l]) < 1e-4);
    }
  }
}

TEST_CASE("recompute_segments: a recomputed segment gets full's KV -- a later one keeps its cached interior", "[splice]") {
  const Model& m = slow_decay_model("qwen3_next_moe");
  const int V = static_cast<int>(m.config().vocab_size), w = 8;
  const std::vector<std::vector<int32_t>> segs = {random_ids(30, 61, V), random_ids(45, 62, V), random_ids(20, 63, V)};
  const auto query = random_ids(4, 64, V);
  const SpliceResult full = splice(m, make_request(m, segs, query, SpliceMode::Full, w));
  SpliceRequest plain = make_request(m, segs, query, SpliceMode::Hypic, w);
  SpliceRequest one = plain;
  one.recompute_segments = {1};
  const SpliceResult a = splice(m, plain), b = splice(m, one);
  CHECK(b.computed_tokens == 45 + 8 + 4);
  const size_t row = size_t(m.config().num_key_value_heads) * m.config().head_dim;
  for (size_t l = 0; l < full.state.attention.size(); ++l) {
    const auto& kf = full.state.attention[l].k;
    const auto& kb = b.state.attention[l].k;
    const auto& ka = a.state.attention[l].k;
    REQUIRE(kb.size() == kf.size());
    // Rows 0..74 (segment 0 exact, segment 1 in context after it) are full's.
    const std::vector<float> head_full(kf.begin(), kf.begin() + 75 * row), head_b(kb.begin(), kb.begin() + 75 * row);
    CHECK(rel_l2(head_b, head_full) < 1e-4);
    // Segment 2's interior rows (83..94) come from its entry, as in plain hypic.
    const std::vector<float> int_a(ka.begin() + 83 * row, ka.begin() + 95 * row),
        int_b(kb.begin() + 83 * row, kb.begin() + 95 * row);
    CHECK(int_b == int_a);
  }
  // Plain hypic's segment-1 rows are not full's (else the test would show nothing).
  const auto& kf = full.state.attention[0].k;
  const auto& ka = a.state.attention[0].k;
  CHECK(rel_l2(std::vector<float>(ka.begin() + 38 * row, ka.begin() + 75 * row),
               std::vector<float>(kf.begin() + 38 * row, kf.begin() + 75 * row)) > 1e-3);
}

TEST_CASE("refresh_segments recomputes the segments the query attends to most", "[splice]") {
  for (const char* name : {"qwen3_next_moe", "qwen3_5_dense"}) {
    DYNAMIC_SECTION(name) {
      const Model& m = slow_decay_model(name);
      const ModelConfig& c = m.config();
      const int V = static_cast<int>(c.vocab_size), w = 8;
      const std::vector<std::vector<int32_t>> segs = {random_ids(30, 71, V), random_ids(40, 72, V),
                                                      random_ids(25, 73, V), random_ids(35, 74, V)};
      const auto query = random_ids(6, 75, V);
      SpliceRequest req = make_request(m, segs, query, SpliceMode::Hypic, w);

      // The query's last token's attention per KV row over the plain hypic context, built by hand (public API).
      int64_t pos = 0;
      const std::vector<float> mass = query_mass_by_hand(m, req, w, pos);
      REQUIRE(mass.size() == size_t(pos) + query.size());
      double total = 0;
      for (float x : mass) total += x;
      // The last query token's probabilities: 1 per head and attention layer.
      CHECK(total == Approx(double(c.num_attention_heads) * c.num_attention_layers()).epsilon(1e-4));
      // Interior mass per later segment; expected choice: the top two.
      std::vector<std::pair<double, int>> ranked;
      int64_t start = 30;
      for (int i = 1; i < 4; ++i) {
        const int64_t n = static_cast<int64_t>(segs[i].size());
        double sum = 0;
        for (int64_t r = start + w; r < start + n; ++r) sum += mass[r];
        ranked.emplace_back(sum, i);
        start += n;
      }
      std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      std::vector<int> want = {ranked[0].second, ranked[1].second};
      std::sort(want.begin(), want.end());

      SpliceRequest refresh = req;
      refresh.refresh_segments = 2;
      const SpliceResult got = splice(m, refresh);
      CHECK(got.recomputed_segments == want);
      SpliceRequest explicit_req = req;
      explicit_req.recompute_segments = want;
      const SpliceResult same = splice(m, explicit_req);
      CHECK(scaled_diff(got.logits, same.logits) < 1e-6);
      // Both passes are counted: the probe (seams and query), then the seams left, the refreshed segments, the query.
      const int64_t probe_tokens = 3 * w + 6;
      CHECK(got.computed_tokens == probe_tokens + same.computed_tokens);

      // k at least the number of later segments: every one is recomputed, which is full recomputation.
      refresh.refresh_segments = 10;
      const SpliceResult all = splice(m, refresh);
      CHECK(all.recomputed_segments == std::vector<int>{1, 2, 3});
      const SpliceResult full = splice(m, make_request(m, segs, query, SpliceMode::Full, w));
      CHECK(scaled_diff(all.logits, full.logits) < 1e-4);
    }
  }
}

TEST_CASE("choose_refresh_segments: most mass first, ties and no attention in prompt order, no interior never",
          "[splice]") {
  const std::vector<int64_t> lengths = {10, 20, 5, 30, 12};  // w = 8: segment 2 has no interior
  const std::vector<char> none(5, 0);
  std::vector<float> mass(77, 0.0f);  // no measured attention (no attention layers, or fp32 underflow)
  CHECK(choose_refresh_segments(mass, lengths, 8, none, 2) == std::vector<int>{1, 3});
  CHECK(choose_refresh_segments(mass, lengths, 8, none, 10) == std::vector<int>{1, 3, 4});
  mass[10 + 20 + 5 + 8] = 0.5f;  // segment 3's first interior row
  mass[10 + 3] = 0.7f;           // segment 1's seam row: not counted
  mass[67 + 9] = 0.25f;          // segment 4's interior
  CHECK(choose_refresh_segments(mass, lengths, 8, none, 1) == std::vector<int>{3});
  CHECK(choose_refresh_segments(mass, lengths, 8, none, 2) == std::vector<int>{3, 4});
  std::vector<char> whole(5, 0);
  whole[3] = 1;  // already recomputed: not a candidate
  CHECK(choose_refresh_segments(mass, lengths, 8, whole, 1) == std::vector<int>{4});
  CHECK(choose_refresh_segments(mass, lengths, 8, none, 0).empty());
  CHECK(choose_refresh_segments({}, lengths, 8, none, 2) == std::vector<int>{1, 3});  // a short mass vector counts 0
}

TEST_CASE("refresh_tail recomputes the last segments whole, the refresh chooses among the others", "[splice]") {
  for (const char* name : {"qwen3_next_moe", "qwen3_5_dense"}) {
    DYNAMIC_SECTION(name) {
      const Model& m = slow_decay_model(name);
      const int V = static_cast<int>(m.config().vocab_size), w = 8;
      const std::vector<std::vector<int32_t>> segs = {random_ids(30, 91, V), random_ids(40, 92, V),
                                                      random_ids(25, 93, V), random_ids(35, 94, V),
                                                      random_ids(28, 95, V)};
      const auto query = random_ids(6, 96, V);
      const SpliceRequest req = make_request(m, segs, query, SpliceMode::Hypic, w);

      // t = 2 alone: segments 3 and 4 whole, no probe: the seams of 1 and 2, both tail segments, the query.
      SpliceRequest tail = req;
      tail.refresh_tail = 2;
      const SpliceResult t2 = splice(m, tail);
      CHECK(t2.recomputed_segments == std::vector<int>{3, 4});
      CHECK(t2.computed_tokens == 2 * w + 35 + 28 + 6);
      SpliceRequest explicit_req = req;
      explicit_req.recompute_segments = {3, 4};
      const SpliceResult same = splice(m, explicit_req);
      CHECK(t2.logits == same.logits);

      // With refresh_segments, the probe runs on the plain hypic context (the tail still cached, so it is computed
      // once) and the choice is among the segments not in the tail: here the one of segments 1 and 2 whose
      // interior the query's last token attends to most, measured by hand through the public API.
      int64_t pos = 0;
      const std::vector<float> mass = query_mass_by_hand(m, req, w, pos);
      auto interior = [&](int64_t start, int64_t n) {
        double sum = 0;
        for (int64_t r = start + w; r < start + n; ++r) sum += mass[size_t(r)];
        return sum;
      };
      const int chosen = interior(30, 40) >= interior(70, 25) ? 1 : 2;
      tail.refresh_segments = 1;
      const SpliceResult both = splice(m, tail);
      CHECK(both.recomputed_segments == std::vector<int>{chosen, 3, 4});
      explicit_req.recompute_segments = {chosen, 3, 4};
      CHECK(both.logits == splice(m, explicit_req).logits);
      // Both passes: the probe (every seam and the query), then the seam of the segment left cached, the chosen one
      // whole, the tail, the query.
      CHECK(both.computed_tokens == (4 * w + 6) + (w + (chosen == 1 ? 40 : 25) + 35 + 28 + 6));

      // A tail at least as long as the later segments is full recomputation.
      SpliceRequest all = req;
      all.refresh_tail = 4;
      all.keep_context_state = true;
      SpliceRequest full = make_request(m, segs, query, SpliceMode::Full, w);
      full.keep_context_state = true;
      const SpliceResult got = splice(m, all), want = splice(m, full);
      CHECK(got.recomputed_segments == std::vector<int>{1, 2, 3, 4});
      CHECK(scaled_diff(got.logits, want.logits) < 1e-4);
      for (size_t l = 0; l < got.context_states.size(); ++l)
        CHECK(rel_l2(got.context_states[l], want.context_states[l]) < 1e-4);
      all.refresh_tail = 100;  // more than there are: the same
      CHECK(splice(m, all).recomputed_segments == std::vector<int>{1, 2, 3, 4});
      // A tail that leaves segment 3 cached is not full: the splice differs (else the test shows nothing).
      SpliceRequest one = req;
      one.refresh_tail = 1;
      CHECK(scaled_diff(splice(m, one).logits, want.logits) > 1e-4);
    }
  }
}

TEST_CASE("refresh_tail segments may come without entries: the same splice, bit for bit", "[splice]") {
  const Model& m = fixture_model("qwen3_5_moe");
  const int V = static_cast<int>(m.config().vocab_size);
  const std::vector<std::vector<int32_t>> segs = {random_ids(30, 31, V), random_ids(25, 32, V), random_ids(40, 33, V),
                                                  random_ids(20, 34, V)};
  SpliceRequest with = make_request(m, segs, random_ids(5, 35, V), SpliceMode::Hypic, 8);
  with.refresh_tail = 2;
  SpliceRequest without = with;
  without.segments[2].entry = nullptr;  // the tail (segments 2 and 3) as ids alone
  without.segments[3].entry = nullptr;
  const SpliceResult a = splice(m, with), b = splice(m, without);
  CHECK(a.logits == b.logits);  // bitwise: a whole segment never reads its entry
  CHECK(b.recomputed_segments == std::vector<int>{2, 3});
  CHECK(a.computed_tokens == b.computed_tokens);
  // With the refresh's probe: the entry-less tail is whole in the probe too; the refresh chooses among the others.
  without.refresh_segments = 1;
  const SpliceResult c = splice(m, without);
  CHECK(c.recomputed_segments.size() == 3);
  CHECK(std::find(c.recomputed_segments.begin(), c.recomputed_segments.end(), 1) != c.recomputed_segments.end());
  // Only recomputed segments may come without an entry; segment 0 never.
  SpliceRequest bad = without;
  bad.refresh_tail = 1;  // segment 2 is no longer whole, and has no entry
  bad.refresh_segments = 0;
  CHECK_THROWS_WITH(splice(m, bad), Catch::Contains("segment 2 has no entry"));
  bad = with;
  bad.segments[0].entry = nullptr;
  CHECK_THROWS_WITH(splice(m, bad), Catch::Contains("segment 0 has no entry"));
}

TEST_CASE("whole_segments_before_refresh: the listed segments and the tail, never segment 0", "[splice]") {
  CHECK(whole_segments_before_refresh(std::vector<int>{1}, 2, 5) == std::vector<char>{0, 1, 0, 1, 1});
  CHECK(whole_segments_before_refresh(std::vector<int>{}, 0, 3) == std::vector<char>{0, 0, 0});
  CHECK(whole_segments_before_refresh(std::vector<int>{}, 10, 3) == std::vector<char>{0, 1, 1});
  CHECK(whole_segments_before_refresh(std::vector<int>{}, 1, 1) == std::vector<char>{0});
  CHECK(whole_segments_before_refresh(std::vector<int>{2}, 1, 3) == std::vector<char>{0, 0, 1});
}

TEST_CASE("recompute_segments / refresh_segments: bad input is a clear error", "[splice]") {
  const Model& m = fixture_model("qwen3_5_dense");
  const int V = static_cast<int>(m.config().vocab_size);
  const std::vector<std::vector<int32_t>> segs = {random_ids(20, 81, V), random_ids(20, 82, V)};
  const auto query = random_ids(3, 83, V);
  SpliceRequest ok = make_request(m, segs, query, SpliceMode::Hypic, 8);
  SpliceRequest r = ok;
  r.recompute_segments = {0};
  CHECK_THROWS_WITH(splice(m, r), Catch::Contains("index 0 is outside [1, 2)"));
  r.recompute_segments = {2};
  CHECK_THROWS_WITH(splice(m, r), Catch::Contains("index 2 is outside [1, 2)"));
  r.recompute_segments = {1, 1};
  CHECK_THROWS_WITH(splice(m, r), Catch::Contains("segment 1 twice"));
  r = ok;
  r.refresh_segments = -1;
  CHECK_THROWS_WITH(splice(m, r), Catch::Contains("refresh_segments must be >= 0"));
  r = ok;
  r.refresh_tail = -1;
  CHECK_THROWS_WITH(splice(m, r), Catch::Contains("refresh_tail must be >= 0"));
  for (SpliceMode mode : {SpliceMode::Full, SpliceMode::Prefix, SpliceMode::Naive, SpliceMode::Transition}) {
    r = ok;
    r.mode = mode;
    r.refresh_segments = 1;
    CHECK_THROWS_WITH(splice(m, r), Catch::Contains("apply to mode hypic"));
    r.refresh_segments = 0;
    r.refresh_tail = 1;
    CHECK_THROWS_WITH(splice(m, r), Catch::Contains("apply to mode hypic"));
  }
  // One segment: nothing to refresh, the plain splice.
  SpliceRequest single = make_request(m, {segs[0]}, query, SpliceMode::Hypic, 8);
  const SpliceResult plain = splice(m, single);
  single.refresh_segments = 3;
  const SpliceResult same = splice(m, single);
  CHECK(same.recomputed_segments.empty());
  CHECK(same.computed_tokens == plain.computed_tokens);
  CHECK(same.logits == plain.logits);
  // Every later segment no longer than w (its seam recomputes it whole): nothing to refresh, no probe pass.
  SpliceRequest short_segs = make_request(m, segs, query, SpliceMode::Hypic, 32);
  const SpliceResult short_plain = splice(m, short_segs);
  short_segs.refresh_segments = 2;
  const SpliceResult short_refresh = splice(m, short_segs);
  CHECK(short_refresh.recomputed_segments.empty());
  CHECK(short_refresh.computed_tokens == short_plain.computed_tokens);
}
