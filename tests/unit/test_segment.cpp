// Segment entry serialisation (DESIGN.md 3.2): round trips whole and in chunks, corruption and truncation
// are detected, digests and compatibility checks.
#include <xxhash.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <random>

#include "engine/checkpoint/safetensors.h"
#include "engine/segment.h"
#include "tests/unit/random_entry.h"
#include "tests/unit/splice_checks.h"

using namespace hypic::engine;

namespace {

/// The entries of these tests: seam operators dense, interior operators dense except layer 1's (scalar).
SegmentEntry random_entry(int n, int w, uint32_t seed) {
  return hypic::testing::random_entry(EntryGeometry{4, 3, 5, 22, 3, 2, 6, 3, 1}, n, w, seed, [](int l, bool seam) {
    return !seam && l == 1 ? TransitionKind::Scalar : TransitionKind::Dense;
  });
}


}  // namespace

TEST_CASE("segment entry round-trips whole and in chunks of any size", "[segment]") {
  const SegmentEntry e = random_entry(37, 8, 1);
  const std::string bytes = serialize_entry(e);
  CHECK(bytes.size() == e.byte_size());
  hypic::testing::require_entries_equal(deserialize_entry(bytes), e);

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
      hypic::testing::require_entries_equal(r.finish(), e);
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
  // Fed without the stream's size, the same errors come from the bytes themselves.
  for (size_t cut : {size_t(30), bytes.size() / 2, bytes.size() - 1}) {
    EntryReader r;
    r.feed(std::string_view(bytes).substr(0, cut));
    CHECK_THROWS_WITH(r.finish(), Catch::Contains("truncated"));
  }
  EntryReader past;
  CHECK_THROWS_WITH(past.feed(bytes + "xyz"), Catch::Contains("past its end"));
  // A header that claims more than the stream carries is refused before any tensor is sized (the header is not
  // authenticated yet): K/V for 2^20 heads of 2^10 dims here, ~10^12 bytes against the stream's few KB.
  {
    SegmentEntry big = e;
    big.geometry.kv_heads = 1 << 20;
    big.geometry.head_dim = 1 << 10;
    big.attention.clear();
    big.geometry.num_attention = 0;
    std::string h = serialize_entry(big);  // a header with K/V of 0 layers ...
    uint32_t len;
    std::memcpy(&len, h.data() + 8, 4);
    // ... then one attention layer claimed, checksums recomputed: 4 bytes of num_attention in the geometry.
    const size_t at = 12 + 4 + 4 + e.model_fingerprint.size() + 4 + e.numerics.size() + 4 + 4 + 4 * e.token_ids.size() +
                      8 * 4;
    uint32_t one = 1;
    std::memcpy(h.data() + at, &one, 4);
    const uint64_t hsum = XXH3_64bits(h.data() + 12, len);
    std::memcpy(h.data() + 12 + len, &hsum, 8);
    bool asked = false;
    EntryReader r({.total_bytes = h.size(), .header = [&](const SegmentEntry&) { asked = true; }});
    CHECK_THROWS_WITH(r.feed(h), Catch::Contains("truncated: its header announces"));
    CHECK_FALSE(asked);  // refused before the caller's check, and before anything was allocated
  }
  // A header longer than the caller allows (or than the stream leaves) is refused at its length, before it is
  // buffered; strings quoted from a header are cut.
  {
    uint32_t len;
    std::memcpy(&len, bytes.data() + 8, 4);
    EntryReader tight({.total_bytes = bytes.size(), .max_header_bytes = len - 1});
    CHECK_THROWS_WITH(tight.feed(std::string_view(bytes).substr(0, 12)), Catch::Contains("above the"));
    EntryReader small_stream({.total_bytes = len + 27});
    CHECK_THROWS_WITH(small_stream.feed(std::string_view(bytes).substr(0, 12)), Catch::Contains("truncated"));
    SegmentEntry long_fp = e;
    long_fp.model_fingerprint = std::string(100000, 'f');
    try {
      long_fp.check_compatible(e.model_fingerprint, e.geometry, 4);
      FAIL("no error");
    } catch (const EntryError& err) {
      CHECK(std::string(err.what()).size() < 400);
      CHECK_THAT(err.what(), Catch::Contains("(100000 bytes)"));
    }
  }
  // The caller's header check runs before the tensors: an entry of other token ids is refused there.
  EntryReader other_ids({.total_bytes = bytes.size(), .header = [](const SegmentEntry& h) {
                           if (h.token_ids.size() != 999) throw EntryError("not the ids asked for");
                         }});
  CHECK_THROWS_WITH(other_ids.feed(std::string_view(bytes).substr(0, 200)), Catch::Contains("not the ids asked for"));
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

TEST_CASE("K, V and conv tails travel as bf16 exactly when every value is a bf16 value", "[segment]") {
  SegmentEntry e = random_entry(37, 8, 11);
  const size_t fp32_bytes = e.byte_size();
  size_t kv_values = 0;
  auto round = [&](std::vector<float>& v) {  // to bf16 values (round to nearest even), as the CUDA backend keeps them
    for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
    kv_values += v.size();
  };
  for (auto& l : e.linear) round(l.conv_tail);
  for (auto& a : e.attention) round(a.k), round(a.v);
  REQUIRE(kv_values > 0);
  // Half the bytes of K, V and the conv tails; the states and transitions (not rounded) stay fp32.
  CHECK(e.byte_size() == fp32_bytes - 2 * kv_values);
  const std::string bytes = serialize_entry(e);
  CHECK(bytes.size() == e.byte_size());
  const SegmentEntry back = deserialize_entry(bytes);
  hypic::testing::require_entries_equal(back, e);  // bit for bit
  CHECK(serialize_entry(back) == bytes);
  for (size_t chunk : {1, 7, 4096}) {
    EntryWriter w(e, chunk);
    EntryReader r;
    std::string streamed;
    for (std::string_view c = w.next(); !c.empty(); c = w.next()) streamed += c, r.feed(c);
    CHECK(streamed == bytes);
    hypic::testing::require_entries_equal(r.finish(), e);
  }
  // One value that is not a bf16 value: everything travels as fp32, still bit for bit.
  e.attention[0].v[5] = 1.0f + 1.0f / 1024 / 1024;
  CHECK(e.byte_size() == fp32_bytes);
  hypic::testing::require_entries_equal(deserialize_entry(serialize_entry(e)), e);
  // A corrupt type byte is refused by name (checksums recomputed).
  std::string bad = bytes;
  uint32_t len;
  std::memcpy(&len, bad.data() + 8, 4);
  REQUIRE(bad[12 + len - 1] == 2);  // the header's last byte: bf16
  bad[12 + len - 1] = 3;
  const uint64_t hsum = XXH3_64bits(bad.data() + 12, len);
  std::memcpy(bad.data() + 12 + len, &hsum, 8);
  CHECK_THROWS_WITH(deserialize_entry(bad), Catch::Contains("K/V tensor type 3"));
}

TEST_CASE("a destination takes the tensor bytes as they are, the entry keeps its header", "[segment]") {
  SegmentEntry e = random_entry(29, 8, 21);
  for (auto& l : e.linear)  // K, V and conv tails as bf16 values: they travel as bf16
    for (float& x : l.conv_tail) x = bf16_to_f32(f32_to_bf16(x));
  for (auto& a : e.attention)
    for (auto* v : {&a.k, &a.v})
      for (float& x : *v) x = bf16_to_f32(f32_to_bf16(x));
  const std::string bytes = serialize_entry(e);
  uint32_t len;
  std::memcpy(&len, bytes.data() + 8, 4);
  const size_t head = 12 + size_t(len) + 8;
  // The tensor blobs: everything between the header's checksum and the whole stream's.
  const std::string_view tensors(bytes.data() + head, bytes.size() - head - 8);
  for (size_t chunk : {size_t(1), size_t(13), size_t(4096), bytes.size()}) {
    DYNAMIC_SECTION("chunk " << chunk) {
      std::string into(tensors.size(), '\0');
      WireShape seen;
      bool header_checked = false;
      EntryReader r({.total_bytes = bytes.size(),
                     .header = [&](const SegmentEntry&) { header_checked = true; },
                     .destination = [&](const SegmentEntry& h, const WireShape& shape) {
                       CHECK(header_checked);
                       CHECK(h.token_ids == e.token_ids);
                       seen = shape;
                       // Uneven spans: 1 byte, 3 bytes, 1000 bytes, the rest.
                       std::vector<std::span<char>> spans;
                       size_t off = 0;
                       for (size_t n : {size_t(1), size_t(3), size_t(1000), into.size() - 1004}) {
                         spans.emplace_back(into.data() + off, n);
                         off += n;
                       }
                       return spans;
                     }});
      for (size_t off = 0; off < bytes.size(); off += chunk) r.feed(std::string_view(bytes).substr(off, chunk));
      CHECK(r.laid_out());
      const SegmentEntry h = r.finish();
      CHECK(into == tensors);
      CHECK(seen.kv_bf16);
      CHECK(seen.tensor_bytes == tensors.size());
      REQUIRE(seen.interior_kinds.size() == e.linear.size());
      for (size_t l = 0; l < e.linear.size(); ++l) CHECK(seen.interior_kinds[l] == e.linear[l].interior_transition.kind);
      CHECK(h.token_ids == e.token_ids);
      CHECK(h.geometry == e.geometry);
      CHECK(h.seam_width == e.seam_width);
      CHECK(h.model_fingerprint == e.model_fingerprint);
      CHECK(h.linear.empty());
      CHECK(h.attention.empty());
    }
  }
  // A corrupt tensor byte still fails the checksum; spans of another total size are refused at the header; an empty
  // answer parses the entry as usual.
  std::string body = bytes;
  body[head + tensors.size() / 2] ^= 0x10;
  std::string into(tensors.size(), '\0');
  auto all = [&](const SegmentEntry&, const WireShape&) { return std::vector<std::span<char>>{std::span<char>(into)}; };
  EntryReader corrupt({.destination = all});
  corrupt.feed(body);
  CHECK_THROWS_WITH(corrupt.finish(), Catch::Contains("checksum mismatch"));
  EntryReader truncated({.destination = all});
  truncated.feed(std::string_view(bytes).substr(0, bytes.size() - 9));
  CHECK_THROWS_WITH(truncated.finish(), Catch::Contains("truncated"));
  EntryReader short_spans({.destination = [&](const SegmentEntry&, const WireShape&) {
    return std::vector<std::span<char>>{std::span<char>(into).first(into.size() - 1)};
  }});
  CHECK_THROWS_WITH(short_spans.feed(bytes), Catch::Contains("destination of its tensors holds"));
  EntryReader declined({.destination = [](const SegmentEntry&, const WireShape&) {
    return std::vector<std::span<char>>{};
  }});
  declined.feed(bytes);
  CHECK_FALSE(declined.laid_out());
  hypic::testing::require_entries_equal(declined.finish(), e);
}

TEST_CASE("serialize_entry_parts writes serialize_entry's bytes from tensors given as views", "[segment]") {
  for (const bool bf16 : {false, true}) {
    for (const int w : {0, 8}) {
      INFO("bf16 " << bf16 << ", w " << w);
      SegmentEntry e = random_entry(21, w, 17);
      WireParts parts;
      parts.kv_bf16 = bf16;
      std::vector<std::vector<uint16_t>> half;  // the bf16 copies the views point into
      half.reserve(e.linear.size() + 2 * e.attention.size());
      auto f32 = [&](const std::vector<float>& v) {
        parts.bytes.emplace_back(reinterpret_cast<const char*>(v.data()), v.size() * 4);
      };
      auto kv = [&](std::vector<float>& v) {
        if (!bf16) return f32(v);
        std::vector<uint16_t> bits;
        for (float& x : v) x = bf16_to_f32(f32_to_bf16(x)), bits.push_back(f32_to_bf16(x));
        half.push_back(std::move(bits));
        parts.bytes.emplace_back(reinterpret_cast<const char*>(half.back().data()), half.back().size() * 2);
      };
      for (auto& l : e.linear) {
        parts.interior_kinds.push_back(l.interior_transition.kind);
        f32(l.seam_state);
        // T_int split in two views: the parts' boundaries need not be the tensors'.
        const std::string_view t(reinterpret_cast<const char*>(l.interior_transition.data.data()),
                                 l.interior_transition.data.size() * 4);
        parts.bytes.push_back(t.substr(0, t.size() / 2));
        parts.bytes.push_back(t.substr(t.size() / 2));
        f32(l.interior_state);
        kv(l.conv_tail);
      }
      for (auto& a : e.attention) kv(a.k), kv(a.v);
      const std::string bytes = serialize_entry_parts(e, parts);
      CHECK(bytes == serialize_entry(e));  // the same entry, bit for bit (serialize_entry finds the same K/V type)
      hypic::testing::require_entries_equal(deserialize_entry(bytes), e);
      // In pieces: the total first, then the pieces, whose concatenation is the same bytes.
      uint64_t announced = 0;
      std::string pieces;
      size_t calls = 0;
      write_entry_parts(
          e, parts,
          [&](uint64_t total) {
            CHECK(pieces.empty());
            announced = total;
          },
          [&](std::string_view p) {
            pieces += p;
            ++calls;
          });
      CHECK(announced == bytes.size());
      CHECK(pieces == bytes);
      // The header, each non-empty part as it is, the checksum: no whole-entry buffer in between.
      CHECK(calls == 2 + size_t(std::count_if(parts.bytes.begin(), parts.bytes.end(),
                                              [](std::string_view p) { return !p.empty(); })));
      WireParts short_parts = parts;
      short_parts.bytes.pop_back();
      CHECK_THROWS_WITH(serialize_entry_parts(e, short_parts), Catch::Contains("bytes of tensors"));
      WireParts few_kinds = parts;
      few_kinds.interior_kinds.pop_back();
      CHECK_THROWS_WITH(serialize_entry_parts(e, few_kinds), Catch::Contains("transition kinds"));
      bool called = false;
      CHECK_THROWS_WITH(write_entry_parts(
                            e, short_parts, [&](uint64_t) { called = true; }, [&](std::string_view) { called = true; }),
                        Catch::Contains("bytes of tensors"));
      CHECK_FALSE(called);
    }
  }
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

// Found by fuzzing (tests/fuzz/fuzz_entry.cpp).
TEST_CASE("fuzz regressions: header sizes that wrap, entries without tokens", "[segment][fuzz]") {
  // A header (with a valid checksum) whose tensor sizes multiply past 2^64: 2^20 attention layers x 2 x 16 tokens x
  // 2^20 KV heads x 2^20 head dim x 4 bytes = 2^67, which wrapped to 0 bytes, passed the size guard and then sized
  // the K tensors at 2^44 floats (std::length_error / bad_alloc instead of an EntryError).
  std::string h;
  auto put32 = [&](uint32_t v) { h.append(reinterpret_cast<const char*>(&v), 4); };
  put32(kSegmentFormatVersion);
  put32(0);  // fingerprint
  put32(0);  // numerics
  put32(0);  // seam width
  put32(16);
  h.append(16 * 4, '\0');
  for (uint32_t v : {1u, 1u, 1u, 1u, 0u, 1u << 20, 1u << 20, 0u, 1u << 20}) put32(v);  // geometry
  h.push_back('\x01');  // K/V fp32
  std::string bytes = "HYPICSEG";
  const uint32_t len = uint32_t(h.size());
  bytes.append(reinterpret_cast<const char*>(&len), 4);
  bytes += h;
  const uint64_t sum = XXH3_64bits(h.data(), h.size());
  bytes.append(reinterpret_cast<const char*>(&sum), 8);
  CHECK_THROWS_AS(deserialize_entry(bytes), EntryError);  // (its header is longer than the buffer leaves, first)
  EntryReader unsized;  // no stream size to compare with: the wrapped total is what refuses it
  CHECK_THROWS_WITH(unsized.feed(bytes), Catch::Contains("announces more than"));

  // No tokens: the token ids were copied from a null vector (memcpy(nullptr, ..., 0), undefined; UBSan flags it).
  const SegmentEntry empty = random_entry(0, 2, 5);
  hypic::testing::require_entries_equal(deserialize_entry(serialize_entry(empty)), empty);
}
