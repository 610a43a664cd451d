// Segment entry serialisation (DESIGN.md 3.2): round trips whole and in chunks, corruption and truncation
// are detected, digests and compatibility checks.
#include <catch2/catch.hpp>

#include <random>

#include "engine/segment.h"

using namespace hypic::engine;

namespace {

SegmentEntry random_entry(int n, int w, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  SegmentEntry e;
  e.model_fingerprint = "0123456789abcdef0123456789abcdef";
  e.numerics = "cpu-fp32";
  e.seam_width = w;
  for (int i = 0; i < n; ++i) e.token_ids.push_back(static_cast<int32_t>(rng() % 1000));
  e.geometry = EntryGeometry{4, 3, 5, 22, 3, 2, 6, 3, 1};
  const EntryGeometry& g = e.geometry;
  auto fill = [&](std::vector<float>& v, size_t count) {
    v.resize(count);
    for (auto& x : v) x = nd(rng);
  };
  for (int l = 0; l < g.num_linear; ++l) {
    LinearLayerEntry le;
    le.seam_transition = TransitionOperator::identity(TransitionKind::Dense, g.linear_heads, g.d_k);
    fill(le.seam_transition.data, le.seam_transition.data.size());
    le.interior_transition = TransitionOperator::identity(l == 1 ? TransitionKind::Scalar : TransitionKind::Dense,
                                                          g.linear_heads, g.d_k);
    fill(le.interior_transition.data, le.interior_transition.data.size());
    fill(le.seam_state, size_t(g.linear_heads) * g.d_k * g.d_v);
    fill(le.interior_state, size_t(g.linear_heads) * g.d_k * g.d_v);
    fill(le.conv_tail, size_t(g.conv_rows) * g.conv_dim);
    e.linear.push_back(std::move(le));
  }
  for (int a = 0; a < g.num_attention; ++a) {
    AttentionLayerEntry ae;
    fill(ae.k, size_t(n) * g.kv_heads * g.head_dim);
    fill(ae.v, size_t(n) * g.kv_heads * g.head_dim);
    e.attention.push_back(std::move(ae));
  }
  return e;
}

void require_equal(const SegmentEntry& a, const SegmentEntry& b) {
  REQUIRE(a.model_fingerprint == b.model_fingerprint);
  REQUIRE(a.numerics == b.numerics);
  REQUIRE(a.format_version == b.format_version);
  REQUIRE(a.seam_width == b.seam_width);
  REQUIRE(a.token_ids == b.token_ids);
  REQUIRE(a.geometry == b.geometry);
  REQUIRE(a.linear.size() == b.linear.size());
  for (size_t l = 0; l < a.linear.size(); ++l) {
    CHECK(a.linear[l].seam_transition.kind == b.linear[l].seam_transition.kind);
    CHECK(a.linear[l].interior_transition.kind == b.linear[l].interior_transition.kind);
    CHECK(a.linear[l].seam_transition.data == b.linear[l].seam_transition.data);
    CHECK(a.linear[l].interior_transition.data == b.linear[l].interior_transition.data);
    CHECK(a.linear[l].seam_state == b.linear[l].seam_state);
    CHECK(a.linear[l].interior_state == b.linear[l].interior_state);
    CHECK(a.linear[l].conv_tail == b.linear[l].conv_tail);
  }
  for (size_t i = 0; i < a.attention.size(); ++i) {
    CHECK(a.attention[i].k == b.attention[i].k);
    CHECK(a.attention[i].v == b.attention[i].v);
  }
}

}  // namespace

TEST_CASE("segment entry round-trips whole and in chunks of any size", "[segment]") {
  const SegmentEntry e = random_entry(37, 8, 1);
  const std::string bytes = serialize_entry(e);
  CHECK(bytes.size() == e.byte_size());
  require_equal(deserialize_entry(bytes), e);

  for (size_t chunk : {size_t(1), size_t(7), size_t(8), size_t(4096), size_t(1) << 20}) {
    DYNAMIC_SECTION("chunk " << chunk) {
      EntryWriter w(e, chunk);
      EntryReader r;
      std::string concat;
      for (std::string_view c = w.next(); !c.empty(); c = w.next()) {
        REQUIRE(c.size() <= chunk);
        concat += c;
        r.feed(c);
      }
      CHECK(concat == bytes);
      CHECK(r.bytes_received() == bytes.size());
      require_equal(r.finish(), e);
    }
  }
}

TEST_CASE("corrupt, truncated or foreign entry bytes are clear errors", "[segment]") {
  const SegmentEntry e = random_entry(20, 4, 2);
  const std::string bytes = serialize_entry(e);

  std::string body = bytes;
  body[body.size() / 2] ^= 0x40;  // a tensor byte
  CHECK_THROWS_WITH(deserialize_entry(body), Catch::Contains("checksum mismatch"));

  std::string header = bytes;
  header[20] ^= 0x01;  // inside the header
  CHECK_THROWS_WITH(deserialize_entry(header), Catch::Contains("header checksum"));

  std::string magic = bytes;
  magic[0] = 'X';
  CHECK_THROWS_WITH(deserialize_entry(magic), Catch::Contains("bad magic"));

  for (size_t cut : {size_t(0), size_t(5), size_t(30), bytes.size() / 2, bytes.size() - 1})
    CHECK_THROWS_WITH(deserialize_entry(std::string_view(bytes).substr(0, cut)), Catch::Contains("truncated"));

  CHECK_THROWS_WITH(deserialize_entry(bytes + "xyz"), Catch::Contains("past its end"));
  CHECK_THROWS_AS(deserialize_entry(std::string(100, '\0')), EntryError);

  const SegmentEntry ok = deserialize_entry(bytes);
  CHECK_NOTHROW(ok.check_compatible(e.model_fingerprint, e.geometry, 4));
  CHECK_THROWS_WITH(ok.check_compatible("ffff", e.geometry, 4), Catch::Contains("made for model"));
  CHECK_THROWS_WITH(ok.check_compatible(e.model_fingerprint, e.geometry, 8), Catch::Contains("seam width 4"));
  CHECK_NOTHROW(ok.check_compatible(e.model_fingerprint, e.geometry, 4, "cpu-fp32"));
  CHECK_THROWS_WITH(ok.check_compatible(e.model_fingerprint, e.geometry, 4, "cuda-bf16"),
                    Catch::Contains("made by numerics cpu-fp32") && Catch::Contains("computes cuda-bf16"));
  CHECK_THROWS_WITH(ok.check_compatible("ffff", e.geometry, 4, "cpu-fp32"), Catch::Contains("numerics cpu-fp32"));
  SegmentEntry v1 = ok;
  v1.format_version = 1;
  CHECK_THROWS_WITH(v1.check_compatible(e.model_fingerprint, e.geometry, 4), Catch::Contains("format version 1"));
  EntryGeometry other = e.geometry;
  other.d_v = 7;
  CHECK_THROWS_WITH(ok.check_compatible(e.model_fingerprint, other, 4), Catch::Contains("geometry"));
}

TEST_CASE("segment digests depend on model, version, seam width and every token", "[segment]") {
  const std::vector<int32_t> ids = {1, 2, 3, 4};
  const SegmentDigest d = segment_digest("m", kSegmentFormatVersion, 8, ids);
  CHECK(d == segment_digest("m", kSegmentFormatVersion, 8, ids));
  CHECK(d != segment_digest("n", kSegmentFormatVersion, 8, ids));
  CHECK(d != segment_digest("m", kSegmentFormatVersion + 1, 8, ids));
  CHECK(d != segment_digest("m", kSegmentFormatVersion, 4, ids));
  CHECK(d != segment_digest("m", kSegmentFormatVersion, 8, std::vector<int32_t>{1, 2, 4, 3}));
  CHECK(d != segment_digest("m", kSegmentFormatVersion, 8, std::vector<int32_t>{1, 2, 3}));
  CHECK(digest_from_hex(to_hex(d)) == d);
  CHECK(to_hex(d).size() == 32);
  CHECK_THROWS_AS(digest_from_hex("xyz"), std::invalid_argument);
}

TEST_CASE("whole-segment (T, S) is the composition of seam and interior", "[segment]") {
  const SegmentEntry e = random_entry(12, 4, 3);
  for (int l = 0; l < e.geometry.num_linear; ++l) {
    std::vector<float> s = e.linear[l].seam_state;  // S(C|0) = T_int S_seam + S_int, by hand
    std::vector<float> want(s.size(), 0.0f);
    const std::vector<float> Ti = e.linear[l].interior_transition.to_dense();
    const int H = e.geometry.linear_heads, dk = e.geometry.d_k, dv = e.geometry.d_v;
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < dk; ++i)
        for (int j = 0; j < dv; ++j) {
          double acc = e.linear[l].interior_state[(h * dk + i) * dv + j];
          for (int m = 0; m < dk; ++m) acc += double(Ti[(h * dk + i) * dk + m]) * s[(h * dk + m) * dv + j];
          want[(h * dk + i) * dv + j] = static_cast<float>(acc);
        }
    const std::vector<float> got = e.whole_state(l);
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-5));
  }
}
