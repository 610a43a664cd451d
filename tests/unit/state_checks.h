// Comparison helpers the model tests share (tests/unit/test_model.cpp, test_families.cpp, test_family_splice.cpp):
// relative errors of fp32 vectors, seeded token ids, the layer-by-layer comparison of two model states, and a model's
// prefill of a fixture's reference input.
#pragma once
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <vector>

#include "engine/checkpoint/safetensors.h"
#include "engine/cpu/model.h"

namespace hypic::testing {

/// max |a_i|, in double.
inline double max_abs(const std::vector<float>& a) {
  double m = 0;
  for (float x : a) m = std::max(m, double(std::abs(x)));
  return m;
}

/// max |a - b| / max |b| (REQUIREs equal sizes).
inline double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::abs(a[i] - b[i])));
  return m / std::max(max_abs(b), 1e-30);
}

/// n token ids uniform in [0, vocab), from `seed` (mt19937).
inline std::vector<int32_t> random_ids(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> ids(n);
  for (auto& x : ids) x = d(rng);
  return ids;
}

/// CHECKs two model states layer by layer: token counts, every linear state and conv tail (sizes equal, values
/// within rel_err `tol`), every attention layer's n_tokens, K and V.
inline void check_states_close(const engine::ModelState& a, const engine::ModelState& b, double tol) {
  REQUIRE(a.linear.size() == b.linear.size());
  REQUIRE(a.attention.size() == b.attention.size());
  CHECK(a.num_tokens == b.num_tokens);
  for (size_t i = 0; i < a.linear.size(); ++i) {
    INFO("linear layer state " << i);
    CHECK(rel_err(a.linear[i].ssm, b.linear[i].ssm) < tol);
    CHECK(a.linear[i].conv.size() == b.linear[i].conv.size());
    if (!b.linear[i].conv.empty()) CHECK(rel_err(a.linear[i].conv, b.linear[i].conv) < tol);
  }
  for (size_t i = 0; i < a.attention.size(); ++i) {
    INFO("attention layer state " << i);
    CHECK(a.attention[i].n_tokens == b.attention[i].n_tokens);
    CHECK(rel_err(a.attention[i].k, b.attention[i].k) < tol);
    CHECK(rel_err(a.attention[i].v, b.attention[i].v) < tol);
  }
}

/// A model's prefill of a fixture's reference input (tests/fixtures/<dir>/reference.safetensors: input_ids, HF's
/// logits [T][V] and per-layer states), from position 0 with every position's logits.
struct ReferenceRun {
  engine::SafetensorsFile ref;
  std::vector<int32_t> ids;
  int64_t T = 0, V = 0;
  engine::ModelState state;
  engine::PrefillResult result;
  double logits_rel = 0;  ///< rel_err of our logits against HF's (CHECKed <= tol)
};

/// Runs `m` on the reference input of `reference` and CHECKs its logits against HF's within `tol`.
inline ReferenceRun run_reference(const engine::Model& m, const std::filesystem::path& reference, double tol) {
  ReferenceRun r{engine::SafetensorsFile::open(reference), {}, 0, m.config().vocab_size, m.initial_state(), {}, 0};
  const auto ids64 = r.ref.read_i64(r.ref.at("input_ids"));
  r.ids.assign(ids64.begin(), ids64.end());
  r.T = int64_t(r.ids.size());
  r.result = m.prefill(r.state, r.ids, 0, {.all_logits = true});
  const auto hf_logits = r.ref.read_f32(r.ref.at("logits"));
  REQUIRE(r.result.logits.size() == hf_logits.size());
  r.logits_rel = rel_err(r.result.logits, hf_logits);
  CHECK(r.logits_rel <= tol);
  return r;
}

}  // namespace hypic::testing
