// Segment entries and splicing of the Kimi-Linear, MiniMax and Ring-linear families (issue 14, stage 2; DESIGN.md
// 3.1-3.4): T_C in the family's compact form (dense for KDA, one scalar per head for lightning), KDA's conv tails,
// MLA's latent (one K head of kv_lora_rank + qk_rope, no V), format versions (Qwen entries stay version 4 byte for
// byte, the other families are version 6),
// the composition law at every linear layer, position independence at layer 0 after any prefix, Ring-linear's state
// re-rotation (a segment cached at position a and used at b), and every splice mode. Models: the small random-weight
// models of tests/unit/family_models.h and the HF / Ring reference fixtures (tests/fixtures).
#include <catch2/catch.hpp>

#include <xxhash.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu/splice.h"
#include "engine/segment.h"
#include "kernels/cpu/ops.h"
#include "tests/unit/family_models.h"
#include "tests/unit/splice_checks.h"
#include "tests/unit/state_checks.h"

using namespace hypic::engine;
using namespace hypic::testing;

namespace {

// fp32 evaluation-order differences (chunked vs one pass, rotation R(a) R(d) vs R(a + d)) stay below a few 1e-6 of
// max |value| on these models.
constexpr double kTol = 2e-5;

// The models every test runs: random-weight models (layer 0 linear in each) and the reference fixtures.
const char* kModels[] = {"random:kimi_linear", "random:minimax", "random:ring_linear", "kimi_linear_grouped",
                         "kimi_linear_qlora",  "minimax_blocks", "ring_linear_grouped", "ring_linear_tail"};

const Model& family_model(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Model>> cache;
  auto& m = cache[name];
  if (m) return *m;
  if (name == "random:kimi_linear") {
    // KDA's decay slowed (A_log = log 0.02, e^g ~ 0.99 per token and channel): with the random A_log the state
    // forgets within a few tokens, which would hide composition errors behind decay (as test_splice.cpp does).
    const Model r = random_model(parse_config(kKimiReleased), "splice_kimi");
    ModelWeights w = r.weights();
    for (auto& layer : w.layers)
      if (layer.type == LayerType::Linear)
        for (auto& a : layer.kda.A_log.data) a = std::log(0.02f);
    m = std::make_unique<Model>(r.config(), std::move(w));
  } else if (name == "random:minimax") {  // layers L F L L F L (layer 0 linear)
    const std::string cfg = with(kMiniMax, R"(["full_attention", "linear_attention", "linear_attention",)",
                                 R"(["linear_attention", "full_attention", "linear_attention",)");
    m = std::make_unique<Model>(random_model(parse_config(cfg), "splice_minimax"));
  } else if (name == "random:ring_linear") {
    m = std::make_unique<Model>(random_model(parse_config(kRing), "splice_ring"));
  } else {
    m = std::make_unique<Model>(Model::load(std::string(HYPIC_SOURCE_DIR) + "/tests/fixtures/" + name));
  }
  return *m;
}




// Rewrites the u32 format version of serialised entry bytes and both checksums, so only the version is wrong.
std::string with_version(std::string bytes, uint32_t version) {
  uint32_t len;
  std::memcpy(&len, bytes.data() + 8, 4);
  std::memcpy(bytes.data() + 12, &version, 4);
  const uint64_t hh = XXH3_64bits(bytes.data() + 12, len);
  std::memcpy(bytes.data() + 12 + len, &hh, 8);
  const uint64_t all = XXH3_64bits(bytes.data(), bytes.size() - 8);
  std::memcpy(bytes.data() + bytes.size() - 8, &all, 8);
  return bytes;
}

// An fp32 entry's bytes written from the documented layout (engine/segment.h), independently of the serialiser:
// "HYPICSEG", u32 header length, the header (version, fingerprint, numerics, w, n, ids, 9 geometry values, the family
// fields from version 6 on, a kind per linear layer, K/V type 1), its XXH3-64, the tensors in wire order, the XXH3-64
// of everything before.
std::string spec_bytes(const SegmentEntry& e) {
  auto put32 = [](std::string& o, uint32_t v) { o.append(reinterpret_cast<const char*>(&v), 4); };
  auto put64 = [](std::string& o, uint64_t v) { o.append(reinterpret_cast<const char*>(&v), 8); };
  auto floats = [](std::string& o, const std::vector<float>& v) {
    o.append(reinterpret_cast<const char*>(v.data()), v.size() * 4);
  };
  const EntryGeometry& g = e.geometry;
  std::string h;
  put32(h, e.format_version);
  put32(h, uint32_t(e.model_fingerprint.size()));
  h += e.model_fingerprint;
  put32(h, uint32_t(e.numerics.size()));
  h += e.numerics;
  put32(h, uint32_t(e.seam_width));
  put32(h, uint32_t(e.token_ids.size()));
  for (int32_t id : e.token_ids) put32(h, uint32_t(id));
  for (int v : {g.linear_heads, g.d_k, g.d_v, g.conv_dim, g.conv_rows, g.kv_heads, g.head_dim, g.num_linear,
                g.num_attention})
    put32(h, uint32_t(v));
  if (e.format_version == 6)
    for (int v : {g.family, g.kv_latent_rank, g.linear_rotary_dim}) put32(h, uint32_t(v));
  for (const auto& l : e.linear) h += char(uint8_t(l.interior_transition.kind));
  h += char(1);  // fp32 K, V and conv tails
  std::string out = "HYPICSEG";
  put32(out, uint32_t(h.size()));
  out += h;
  put64(out, XXH3_64bits(h.data(), h.size()));
  for (const auto& l : e.linear) {
    floats(out, l.seam_state);
    floats(out, l.interior_transition.data);
    floats(out, l.interior_state);
    floats(out, l.conv_tail);
  }
  for (const auto& a : e.attention) {
    floats(out, a.k);
    floats(out, a.v);
  }
  put64(out, XXH3_64bits(out.data(), out.size()));
  return out;
}

}  // namespace

TEST_CASE("family entries: compact T_C, conv tails, MLA latent, version 6, round trip through bytes",
          "[families][segment]") {
  for (const char* name : kModels) {
    DYNAMIC_SECTION(name) {
      const Model& m = family_model(name);
      const ModelConfig& c = m.config();
      const auto ids = random_ids(45, int(c.vocab_size), 21);
      const SegmentEntry e = build_segment_entry(m, ids, 8);
      const EntryGeometry& g = e.geometry;
      CHECK(g == EntryGeometry::of(c));
      CHECK(e.format_version == kSegmentFormatVersionFamilies);
      CHECK(entry_format_version(c) == kSegmentFormatVersionFamilies);
      CHECK(g.family == int(c.family));
      const TransitionKind kind = linear_transition_kind(c);
      const bool lightning = kind == TransitionKind::Scalar;
      CHECK(lightning == (c.family != ModelFamily::KimiLinear));
      for (const auto& l : e.linear) {
        CHECK(l.seam_state.size() == size_t(g.linear_heads) * g.d_k * g.d_v);  // w = 8: S_seam, no T_seam
        CHECK(l.interior_transition.kind == kind);
        CHECK(l.interior_transition.data.size() == (lightning ? size_t(g.linear_heads)
                                                              : size_t(g.linear_heads) * g.d_k * g.d_k));
        // KDA: the three convs' tails [K-1][3 H d]; lightning: none.
        CHECK(l.conv_tail.size() == (lightning ? 0 : size_t(c.linear_conv_kernel_dim - 1) * 3 * c.linear_v_dim()));
      }
      // T_C is stored for entries made with w = 0 (transition mode's), and not for w > 0 (no T_seam).
      CHECK_THROWS_WITH(e.whole_transition(0), Catch::Contains("seam width 8") && Catch::Contains("seam width 0"));
      if (lightning) {  // e^{-s n}: T_C is the whole segment's decay, one number per head
        const TransitionOperator whole = build_segment_entry(m, ids, 0).whole_transition(0);
        REQUIRE(whole.kind == TransitionKind::Scalar);
        for (float t : whole.data) CHECK((t > 0.0f && t <= 1.0f));
      }
      if (c.family == ModelFamily::KimiLinear) {  // MLA: the latent K [n][1][R + rope], no V
        CHECK(g.kv_latent_rank == c.kv_lora_rank);
        CHECK(g.kv_heads == 1);
        CHECK(g.head_dim == c.kv_lora_rank + c.qk_rope_head_dim);
        CHECK(g.v_dim() == 0);
        for (const auto& a : e.attention) {
          CHECK(a.k.size() == ids.size() * size_t(c.kv_lora_rank + c.qk_rope_head_dim));
          CHECK(a.v.empty());
        }
        // The entry's rows are the standalone prefill's latent cache.
        ModelState st = m.initial_state();
        m.prefill(st, ids, 0);
        for (size_t a = 0; a < e.attention.size(); ++a) CHECK(rel_err(e.attention[a].k, st.attention[a].k) < kTol);
        // Serialised size: the header (version 6: 9 geometry values + 3 family fields) and per attention layer
        // n * (R + rope) fp32 values of K and none of V.
        size_t tensors = 0;
        for (const auto& l : e.linear)
          tensors += (l.seam_state.size() + l.interior_transition.data.size() + l.interior_state.size() +
                      l.conv_tail.size()) * 4;
        tensors += e.attention.size() * ids.size() * size_t(c.kv_lora_rank + c.qk_rope_head_dim) * 4;
        const size_t header = 4 + 4 + e.model_fingerprint.size() + 4 + e.numerics.size() + 4 + 4 + 4 * ids.size() +
                              12 * 4 + e.linear.size() + 1;
        CHECK(e.byte_size() == 8 + 4 + header + 8 + tensors + 8);
        CHECK(serialize_entry(e) == spec_bytes(e));
      } else {
        CHECK(g.kv_latent_rank == 0);
        CHECK(g.kv_heads == c.num_key_value_heads);
        CHECK(g.head_dim == c.head_dim);
        CHECK(g.v_dim() == c.head_dim);
      }
      CHECK(g.linear_rotary_dim == (c.family == ModelFamily::RingLinear ? c.rotary_dim() : 0));

      const std::string bytes = serialize_entry(e);
      CHECK(bytes.size() == e.byte_size());
      const SegmentEntry back = deserialize_entry(bytes);
      require_entries_equal(back, e);
      CHECK(serialize_entry(back) == bytes);
      CHECK_NOTHROW(back.check_compatible(e.model_fingerprint, EntryGeometry::of(c), 8, "cpu-fp32"));
      // Streaming in small chunks gives the same bytes.
      EntryWriter w(e, 333);
      std::string streamed;
      for (std::string_view chunk = w.next(); !chunk.empty(); chunk = w.next()) streamed += chunk;
      CHECK(streamed == bytes);

      // Version errors are clear: an unknown version, and an entry whose version does not fit its geometry.
      CHECK_THROWS_WITH(deserialize_entry(with_version(bytes, 7)),
                        Catch::Contains("format version 7") && Catch::Contains("reads 4 and 6"));
      CHECK_THROWS_WITH(deserialize_entry(with_version(bytes, 3)),  // the earlier format (with T_seam)
                        Catch::Contains("format version 3") && Catch::Contains("reads 4 and 6"));
      CHECK_THROWS_WITH(deserialize_entry(with_version(bytes, 5)),  // MLA expanded per head
                        Catch::Contains("format version 5") && Catch::Contains("reads 4 and 6"));
      SegmentEntry v4 = e;
      v4.format_version = kSegmentFormatVersion;
      CHECK_THROWS_WITH(serialize_entry(v4), Catch::Contains("format version 4"));
      CHECK_THROWS_WITH(v4.check_compatible(e.model_fingerprint, g, 8), Catch::Contains("format version 4"));
      // Another family's geometry is refused even under the same fingerprint.
      EntryGeometry other = g;
      other.family = (g.family + 1) % 4;
      CHECK_THROWS_WITH(e.check_compatible(e.model_fingerprint, other, 8), Catch::Contains("geometry"));
    }
  }
}

TEST_CASE("Qwen entries are format version 4 and its header layout byte for byte", "[families][segment]") {
  const Model m = Model::load(std::string(HYPIC_SOURCE_DIR) + "/tests/fixtures/qwen3_5_dense");
  const EntryGeometry g = EntryGeometry::of(m.config());
  CHECK(g.family == 0);
  CHECK(g.kv_latent_rank == 0);
  CHECK(g.linear_rotary_dim == 0);
  CHECK(g.kv_heads == m.config().num_key_value_heads);
  CHECK(g.head_dim == m.config().head_dim);
  CHECK(g.v_dim() == m.config().head_dim);
  CHECK(entry_format_version(g) == kSegmentFormatVersion);
  const auto ids = random_ids(20, int(m.config().vocab_size), 3);
  const SegmentEntry e = build_segment_entry(m, ids, 8);
  CHECK(e.format_version == 4);
  const std::string bytes = serialize_entry(e);
  // Version 4 header: version, fingerprint, numerics, w, n, ids, the 9 geometry values, 1 kind per linear layer (the
  // interior's: T_seam is not stored), the K/V type.
  uint32_t len, version;
  std::memcpy(&len, bytes.data() + 8, 4);
  std::memcpy(&version, bytes.data() + 12, 4);
  CHECK(version == 4);
  const size_t want = 4 + 4 + e.model_fingerprint.size() + 4 + e.numerics.size() + 4 + 4 + 4 * ids.size() + 9 * 4 +
                      e.linear.size() + 1;
  CHECK(len == want);
  CHECK(bytes == spec_bytes(e));  // the version-4 layout, byte for byte (no family fields)
  CHECK(e.digest() == segment_digest(e.model_fingerprint, 4, 8, ids));
  require_entries_equal(deserialize_entry(bytes), e);
  // Promoted to version 6 (checksums fixed), a Qwen entry is refused: its geometry is written as version 4.
  CHECK_THROWS_AS(deserialize_entry(with_version(bytes, 6)), EntryError);
}

TEST_CASE("lightning entries are far smaller than dense ones in the linear part", "[families][segment]") {
  const Model& m = family_model("minimax_blocks");
  const ModelConfig& c = m.config();
  const SegmentEntry e = build_segment_entry(m, random_ids(30, int(c.vocab_size), 4), 8);
  const size_t H = size_t(c.linear_num_value_heads), dk = size_t(c.linear_key_head_dim);
  size_t t_floats = 0;
  for (const auto& l : e.linear) t_floats += l.interior_transition.data.size();
  CHECK(t_floats == H * e.linear.size());  // dense would be H dk^2 per layer
  CHECK(t_floats * dk * dk == H * dk * dk * e.linear.size());
}

TEST_CASE("composition law at every linear layer: T_C P + S(C|0) equals the in-context state", "[families][splice]") {
  // At linear layer l, with the layers below run in context (so layer l sees its in-context inputs), the state after
  // prefix P and segment C must be T_C S_P + S(C|0): S(C|0) from a run whose layer-l state is zeroed after the prefix
  // (hook), T_C captured in context. Checked at every linear layer (so below the first attention layer too).
  for (const char* name : kModels) {
    DYNAMIC_SECTION(name) {
      const Model& m = family_model(name);
      const ModelConfig& c = m.config();
      const int V = int(c.vocab_size);
      const auto P = random_ids(37, V, 31), C = random_ids(70, V, 32);
      std::vector<int32_t> PC = P;
      PC.insert(PC.end(), C.begin(), C.end());
      ModelState full = m.initial_state();
      m.prefill(full, PC, 0);
      ModelState ctx = m.initial_state();
      m.prefill(ctx, P, 0);
      const PrefillResult seg = m.prefill(ctx, C, int64_t(P.size()), {.capture_transitions = true, .skip_logits = true});
      const int dv = c.linear_value_head_dim;
      double naive_worst = 0;
      for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
        if (c.layer_types[size_t(layer)] != LayerType::Linear) continue;
        const int li = c.linear_index(layer);
        INFO("layer " << layer << " (linear " << li << ")");
        std::vector<float> prefix_state;
        ModelState st = m.initial_state();
        const SpanSpec spans[2] = {{P, 0}, {C, int64_t(P.size())}};
        m.prefill_spans(st, spans, [&](size_t span, int at, ModelState& s) {
          if (span == 0 && at == layer) {
            prefix_state = s.linear[size_t(li)].ssm;
            std::fill(s.linear[size_t(li)].ssm.begin(), s.linear[size_t(li)].ssm.end(), 0.0f);
          }
        }, {.skip_logits = true});
        const TransitionOperator T =
            TransitionOperator::wrap(seg.transition_kind, c.linear_num_value_heads, c.linear_key_head_dim,
                                     seg.transitions[size_t(li)]);
        std::vector<float> composed = prefix_state;
        compose_state(composed, T, st.linear[size_t(li)].ssm, dv);
        CHECK(rel_err(composed, full.linear[size_t(li)].ssm) < kTol);
        // Naive addition (no T_C) is wrong wherever the layer forgets (MiniMax's top layers barely do: slopes
        // shrink with depth).
        std::vector<float> naive = prefix_state;
        for (size_t i = 0; i < naive.size(); ++i) naive[i] += st.linear[size_t(li)].ssm[i];
        naive_worst = std::max(naive_worst, rel_err(naive, full.linear[size_t(li)].ssm));
      }
      CHECK(naive_worst > 1e-2);
    }
  }
}

TEST_CASE("family splices: after any prefix, layer 0 equals the in-context state (hypic -- transition without conv)",
          "[families][splice]") {
  // Layer 0 is linear and its inputs (embeddings) do not depend on context, so the spliced state at layer 0 must equal
  // full recomputation for any order and position: with a seam covering the conv kernel (KDA, w = 8 >= K-1), and with
  // no seam at all for the lightning families (no short conv). Ring-linear needs the re-rotation of each segment's
  // cached state to its real position for this.
  for (const char* name : kModels) {
    DYNAMIC_SECTION(name) {
      const Model& m = family_model(name);
      const ModelConfig& c = m.config();
      REQUIRE(c.layer_types[0] == LayerType::Linear);
      const int V = int(c.vocab_size);
      const auto A = random_ids(50, V, 11), B = random_ids(90, V, 12), C = random_ids(3, V, 13);
      const auto query = random_ids(4, V, 14);
      const bool lightning = c.conv_rows() == 0;
      for (const auto& order : {std::vector<std::vector<int32_t>>{A, B, C}, std::vector<std::vector<int32_t>>{C, B, A},
                                std::vector<std::vector<int32_t>>{B, A}}) {
        const SpliceResult full = splice(m, make_request(m, order, query, SpliceMode::Full, 8));
        const SpliceResult hyp = splice(m, make_request(m, order, query, SpliceMode::Hypic, 8));
        CHECK(rel_l2(hyp.state.linear[0].ssm, full.state.linear[0].ssm) < 1e-5);
        CHECK(hyp.num_tokens == full.num_tokens);
        if (lightning) {
          const SpliceResult tr = splice(m, make_request(m, order, query, SpliceMode::Transition, 0));
          CHECK(rel_l2(tr.state.linear[0].ssm, full.state.linear[0].ssm) < 1e-5);
        }
        const SpliceResult naive = splice(m, make_request(m, order, query, SpliceMode::Naive, 8));
        CHECK(rel_l2(naive.state.linear[0].ssm, full.state.linear[0].ssm) > 1e-3);
      }
    }
  }
}

TEST_CASE("Ring-linear state re-rotation: a segment cached at position a and used at b", "[families][splice][ring]") {
  for (const char* name : {"random:ring_linear", "ring_linear_grouped", "ring_linear_tail"}) {
    DYNAMIC_SECTION(name) {
      const Model& m = family_model(name);
      const ModelConfig& c = m.config();
      REQUIRE(m.linear_states_rotate());
      const auto ids = random_ids(60, int(c.vocab_size), 41);
      // The standalone forward is shift-equivariant (attention and the linear readout q^T S depend on relative
      // positions), so every linear layer's state at b is R(b - a) of the state at a, not only layer 0's.
      // Positions stay in the hundreds: R(d) R(a) and R(a + d) differ by the fp32 rounding of the angles p * inv_freq
      // (half an ulp of p radians: 1e-5 at p = 200, 2.4e-4 at p = 4096), as HF's own rotary embedding rounds.
      for (const auto& [a, b] : {std::pair<int64_t, int64_t>{0, 77}, {13, 200}, {150, 5}}) {
        INFO("a " << a << ", b " << b);
        ModelState sa = m.initial_state(), sb = m.initial_state();
        m.prefill(sa, ids, a, {.skip_logits = true});
        m.prefill(sb, ids, b, {.skip_logits = true});
        for (size_t l = 0; l < sa.linear.size(); ++l) {
          INFO("linear layer " << l);
          std::vector<float> moved = sa.linear[l].ssm;
          m.rotate_linear_state(moved, b - a);
          CHECK(rel_err(moved, sb.linear[l].ssm) < 5e-5);
          if (a != b) CHECK(rel_err(sa.linear[l].ssm, sb.linear[l].ssm) > 1e-3);  // without it: wrong
        }
      }
      // Transition mode puts each cached segment at its real position through the re-rotation: layer 0 exact
      // after a prefix (checked above); here the same segment at two offsets, spliced after different prefixes.
      const auto seg = random_ids(40, int(c.vocab_size), 42), query = random_ids(3, int(c.vocab_size), 43);
      for (int prefix_len : {1, 29, 130}) {
        INFO("prefix " << prefix_len);
        const auto prefix = random_ids(prefix_len, int(c.vocab_size), 44);
        const SpliceResult full = splice(m, make_request(m, {prefix, seg}, query, SpliceMode::Full, 0));
        const SpliceResult tr = splice(m, make_request(m, {prefix, seg}, query, SpliceMode::Transition, 0));
        CHECK(rel_l2(tr.state.linear[0].ssm, full.state.linear[0].ssm) < 1e-5);
        // Without the re-rotation (S(C|0) used as it was cached) layer 0 is off.
        const SegmentEntry e0 = build_segment_entry(m, prefix, 0), e1 = build_segment_entry(m, seg, 0);
        std::vector<float> unrotated = e0.whole_state(0);
        compose_state(unrotated, e1.whole_transition(0), e1.whole_state(0), c.linear_value_head_dim);
        CHECK(rel_l2(unrotated, full.state.linear[0].ssm) > 1e-3);
      }
    }
  }
}

TEST_CASE("key-axis rotation: R(d1) R(d2) = R(d1 + d2), R(-d) R(d) = I, and it rotates each key column",
          "[families][splice][ring]") {
  const std::vector<float> inv = hypic::kernels::cpu::rope_inv_freq(10000.0, 8);
  const int H = 2, dk = 12, dv = 5;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> s(size_t(H) * dk * dv);
  for (auto& x : s) x = nd(rng);
  namespace cpu = hypic::kernels::cpu;
  std::vector<float> a = s, b = s;
  cpu::apply_rope_key_axis(a.data(), H, dk, dv, inv, 40);
  cpu::apply_rope_key_axis(a.data(), H, dk, dv, inv, 60);
  cpu::apply_rope_key_axis(b.data(), H, dk, dv, inv, 100);
  CHECK(rel_err(a, b) < 1e-5);
  cpu::apply_rope_key_axis(b.data(), H, dk, dv, inv, -100);
  CHECK(rel_err(b, s) < 1e-5);
  // Column j of head h is a key vector [dk]: rotating the state rotates it as apply_rope_uniform rotates keys.
  std::vector<float> rotated = s;
  cpu::apply_rope_key_axis(rotated.data(), H, dk, dv, inv, 7);
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < dv; ++j) {
      std::vector<float> key(dk);
      for (int i = 0; i < dk; ++i) key[size_t(i)] = s[(size_t(h) * dk + i) * dv + j];
      cpu::apply_rope_uniform(key.data(), 1, 1, dk, inv, 7);
      for (int i = 0; i < dk; ++i) CHECK(rotated[(size_t(h) * dk + i) * dv + j] == key[size_t(i)]);
    }
  CHECK_THROWS_AS(cpu::apply_rope_key_axis(s.data(), H, 6, dv, inv, 1), std::invalid_argument);
  // Families without RoPE in their linear layers refuse it.
  const Model& kimi = family_model("kimi_linear_grouped");
  std::vector<float> st = kimi.initial_state().linear[0].ssm;
  CHECK_FALSE(kimi.linear_states_rotate());
  CHECK_THROWS_WITH(kimi.rotate_linear_state(st, 3), Catch::Contains("no RoPE"));
  CHECK_FALSE(family_model("minimax_blocks").linear_states_rotate());
}

TEST_CASE("family splice modes: full equals the reference forward, prefix equals full, seams covering everything "
          "equal full, w = 0 equals transition, a hit equals a miss bit for bit",
          "[families][splice]") {
  for (const char* name : kModels) {
    DYNAMIC_SECTION(name) {
      const Model& m = family_model(name);
      const ModelConfig& c = m.config();
      const int V = int(c.vocab_size);
      const std::vector<std::vector<int32_t>> segs = {random_ids(33, V, 51), random_ids(20, V, 52),
                                                      random_ids(5, V, 53)};
      const auto query = random_ids(6, V, 54);
      std::vector<int32_t> all;
      for (const auto& s : segs) all.insert(all.end(), s.begin(), s.end());
      const int64_t n_ctx = int64_t(all.size());
      all.insert(all.end(), query.begin(), query.end());
      ModelState ref = m.initial_state();
      const PrefillResult want = m.prefill(ref, std::span(all).first(size_t(n_ctx)), 0, {.skip_logits = true});
      (void)want;
      const PrefillResult q = m.prefill(ref, query, n_ctx, {.all_logits = true});

      const SpliceResult full = splice(m, make_request(m, segs, query, SpliceMode::Full, 8));
      CHECK(full.logits == q.logits);  // the same computation as prefill of context then query
      CHECK(full.num_tokens == int64_t(all.size()));
      check_states_close(full.state, ref, kTol);

      PrefixStateCache cache(size_t(1) << 30);
      for (int round = 0; round < 2; ++round) {
        SpliceRequest pr = make_request(m, segs, query, SpliceMode::Prefix, 8);
        pr.prefix_cache = &cache;
        const SpliceResult prefix = splice(m, pr);
        CHECK(prefix.prefix_segments_reused == (round == 0 ? 0 : 3));
        CHECK(rel_err(prefix.logits, full.logits) < kTol);
      }
      const SpliceResult wide = splice(m, make_request(m, segs, query, SpliceMode::Hypic, 64));
      CHECK(rel_err(wide.logits, full.logits) < kTol);
      const SpliceResult w0 = splice(m, make_request(m, segs, query, SpliceMode::Hypic, 0));
      const SpliceResult tr = splice(m, make_request(m, segs, query, SpliceMode::Transition, 0));
      CHECK(rel_err(w0.logits, tr.logits) < kTol);
      const SpliceResult naive = splice(m, make_request(m, segs, query, SpliceMode::Naive, 0));
      for (const SpliceResult* r : {&wide, &w0, &tr, &naive}) {
        CHECK(r->num_tokens == full.num_tokens);
        CHECK(r->logits.size() == full.logits.size());
        for (float x : r->logits) REQUIRE(std::isfinite(x));
      }
      // Hit == miss: entries that went through bytes splice to the same numbers, bit for bit, in every cached mode.
      for (const SpliceMode mode : {SpliceMode::Hypic, SpliceMode::Transition, SpliceMode::Naive}) {
        const int w = mode == SpliceMode::Hypic ? 8 : 0;
        SpliceRequest fresh = make_request(m, segs, query, mode, w);
        SpliceRequest loaded = fresh;
        for (auto& s : loaded.segments)
          s.entry = std::make_shared<const SegmentEntry>(deserialize_entry(serialize_entry(*s.entry)));
        const SpliceResult a = splice(m, fresh), b = splice(m, loaded);
        CHECK(a.logits == b.logits);
        // Decoding continues from the spliced state the same way.
        ModelState sa = a.state, sb = b.state;
        CHECK(m.decode(sa, 7, a.num_tokens) == m.decode(sb, 7, b.num_tokens));
      }
    }
  }
}

TEST_CASE("family splice: local_positions (the reference's addition / transition ladder) is a no-op where nothing "
          "carries RoPE (Kimi-Linear), leaves MiniMax's states alone and Ring-linear's states unrotated",
          "[families][splice]") {
  for (const char* name : kModels) {
    DYNAMIC_SECTION(name) {
      const Model& m = family_model(name);
      const int V = int(m.config().vocab_size);
      const std::vector<std::vector<int32_t>> segs = {random_ids(17, V, 61), random_ids(23, V, 62),
                                                      random_ids(9, V, 63)};
      const auto query = random_ids(4, V, 64);
      const bool any_rope = m.config().attention_has_rope() || m.linear_states_rotate();
      for (SpliceMode mode : {SpliceMode::Naive, SpliceMode::Transition}) {
        INFO(splice_mode_name(mode));
        SpliceRequest req = make_request(m, segs, query, mode, 0);
        req.keep_context_state = true;
        const SpliceResult real = splice(m, req);
        req.local_positions = true;
        const SpliceResult local = splice(m, req);
        REQUIRE(local.context_states.size() == real.context_states.size());
        if (!any_rope) {
          CHECK(local.logits == real.logits);
          CHECK(local.context_states == real.context_states);
          continue;
        }
        CHECK(local.logits != real.logits);
        for (size_t l = 0; l < real.context_states.size(); ++l) {
          // the states before the query differ only where they carry RoPE (Ring-linear: R(b) S(C|0) vs S(C|0))
          if (m.linear_states_rotate()) CHECK(rel_err(local.context_states[l], real.context_states[l]) > 1e-4);
          else CHECK(local.context_states[l] == real.context_states[l]);
        }
        // One segment sits at position 0 either way: nothing to leave unrotated.
        SpliceRequest one = make_request(m, {segs[0]}, query, mode, 0);
        const SpliceResult one_real = splice(m, one);
        one.local_positions = true;
        CHECK(splice(m, one).logits == one_real.logits);
      }
    }
  }
}
