// A segment entry of any geometry filled with seeded random values: what the entry tests (tests/unit/test_segment.cpp)
// and the entry fuzz target's seeds (tests/fuzz/fuzz_entry.cpp) serialise.
#pragma once
#include <random>
#include <string>

#include "engine/segment.h"

namespace hypic::testing {

/// An entry of n tokens (random ids below 1000) for geometry `g` made with seam width w, every tensor N(0, 1) from
/// `seed`; `kind(l, seam)` is the transition kind of linear layer l's seam (seam = true) or interior operator.
template <class Kind>
engine::SegmentEntry random_entry(const engine::EntryGeometry& g, int n, int w, uint32_t seed, Kind&& kind) {
  using namespace hypic::engine;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  SegmentEntry e;
  e.model_fingerprint = "0123456789abcdef0123456789abcdef";
  e.numerics = "cpu-fp32";
  e.seam_width = w;
  for (int i = 0; i < n; ++i) e.token_ids.push_back(static_cast<int32_t>(rng() % 1000));
  e.geometry = g;
  e.format_version = entry_format_version(g);
  auto fill = [&](std::vector<float>& v, size_t count) {
    v.resize(count);
    for (auto& x : v) x = nd(rng);
  };
  for (int l = 0; l < g.num_linear; ++l) {
    LinearLayerEntry le;
    le.interior_transition = TransitionOperator::identity(kind(l, false), g.linear_heads, g.d_k);
    fill(le.interior_transition.data, le.interior_transition.data.size());
    if (e.seam_tokens() > 0) fill(le.seam_state, size_t(g.linear_heads) * g.d_k * g.d_v);  // none without a seam
    fill(le.interior_state, size_t(g.linear_heads) * g.d_k * g.d_v);
    fill(le.conv_tail, size_t(g.conv_rows) * g.conv_dim);
    e.linear.push_back(std::move(le));
  }
  for (int a = 0; a < g.num_attention; ++a) {
    AttentionLayerEntry ae;
    fill(ae.k, size_t(n) * g.kv_heads * g.head_dim);
    fill(ae.v, size_t(n) * g.kv_heads * g.v_dim());
    e.attention.push_back(std::move(ae));
  }
  return e;
}

}  // namespace hypic::testing
