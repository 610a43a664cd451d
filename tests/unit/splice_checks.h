// Helpers the entry and splice tests share (tests/unit/test_segment.cpp, test_splice.cpp, test_family_splice.cpp):
// field-by-field entry equality, the relative L2 error of a state, and a splice request with fresh entries.
#pragma once
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "engine/cpu/splice.h"
#include "engine/segment.h"

namespace hypic::testing {

/// REQUIREs / CHECKs that two entries are equal in every field and tensor (bit for bit).
inline void require_entries_equal(const engine::SegmentEntry& a, const engine::SegmentEntry& b) {
  REQUIRE(a.model_fingerprint == b.model_fingerprint);
  REQUIRE(a.numerics == b.numerics);
  REQUIRE(a.format_version == b.format_version);
  REQUIRE(a.seam_width == b.seam_width);
  REQUIRE(a.token_ids == b.token_ids);
  REQUIRE(a.geometry == b.geometry);
  REQUIRE(a.linear.size() == b.linear.size());
  for (size_t l = 0; l < a.linear.size(); ++l) {
    CHECK(a.linear[l].interior_transition.kind == b.linear[l].interior_transition.kind);
    CHECK(a.linear[l].interior_transition.data == b.linear[l].interior_transition.data);
    CHECK(a.linear[l].seam_state == b.linear[l].seam_state);
    CHECK(a.linear[l].interior_state == b.linear[l].interior_state);
    CHECK(a.linear[l].conv_tail == b.linear[l].conv_tail);
  }
  REQUIRE(a.attention.size() == b.attention.size());
  for (size_t i = 0; i < a.attention.size(); ++i) {
    CHECK(a.attention[i].k == b.attention[i].k);
    CHECK(a.attention[i].v == b.attention[i].v);
  }
}

/// ||a - b||_2 / ||b||_2, in double.
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * double(a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

/// A splice request of `segs` (each with a fresh build_segment_entry(m, ids, w)) and `query` in `mode` with seam
/// width w, logits for every query position.
inline engine::SpliceRequest make_request(const engine::Model& m, const std::vector<std::vector<int32_t>>& segs,
                                          const std::vector<int32_t>& query, engine::SpliceMode mode, int w) {
  engine::SpliceRequest req;
  // Entries made with the w the mode splices (transition: 0, engine::entry_seam_width; naive: any, here w).
  const int ew = engine::entry_seam_width(mode, w) >= 0 ? engine::entry_seam_width(mode, w) : w;
  for (const auto& ids : segs)
    req.segments.push_back({ids, std::make_shared<const engine::SegmentEntry>(engine::build_segment_entry(m, ids, ew))});
  req.query = query;
  req.mode = mode;
  req.seam_width = w;
  req.all_query_logits = true;
  return req;
}

}  // namespace hypic::testing
