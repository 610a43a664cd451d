// Layer math several families share (lightning attention, sigmoid routing) and the shape checks. Contracts:
// shared/layers.h; the HF transformers 5.17 classes named there are the formulas' source.
#include "engine/families/shared/layers.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "engine/checkpoint/weights_internal.h"
#include "kernels/cpu/lightning.h"
#include "kernels/cpu/ops.h"

namespace hypic::engine::families {

namespace cpu = hypic::kernels::cpu;

void expect_shape(const Tensor& t, const std::vector<int64_t>& shape, const std::string& name) {
  using weights_detail::shape_text;
  if (t.shape != shape || int64_t(t.data.size()) != weights_detail::product(shape))
    throw std::invalid_argument("Model: tensor " + name + " has shape " + shape_text(t.shape) + " (" +
                                std::to_string(t.data.size()) + " values), expected " + shape_text(shape));
}

namespace shared {

void lightning_qkv(const ModelConfig& c, const LightningWeights& w, const float* x, int64_t T, std::vector<float>& q,
                   std::vector<float>& k, std::vector<float>& v) {
  const int64_t H = c.hidden_size;
  const int64_t hd = int64_t(c.num_attention_heads) * c.head_dim;
  std::vector<float> qkv(size_t(T) * 3 * hd);
  q.assign(size_t(T) * hd, 0.0f);
  k.assign(q.size(), 0.0f);
  v.assign(q.size(), 0.0f);
  cpu::linear(T, H, 3 * hd, x, w.qkv_proj.ptr(), qkv.data());
  if (c.linear_qkv_silu)
    for (auto& e : qkv) e = cpu::silu(e);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = qkv.data() + t * 3 * hd;
    std::copy(row, row + hd, q.begin() + t * hd);
    std::copy(row + hd, row + 2 * hd, k.begin() + t * hd);
    std::copy(row + 2 * hd, row + 3 * hd, v.begin() + t * hd);
  }
}

void lightning_output(const ModelConfig& c, const LightningWeights& w, LinearLayerState& st, const float* x,
                      int64_t T, const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                      bool recurrent, std::vector<float>* transition, float* out) {
  const int64_t H = c.hidden_size;
  const int nh = c.num_attention_heads, d = c.head_dim;
  const int64_t hd = int64_t(nh) * d;
  std::vector<float> o(q.size()), gate(q.size());
  const cpu::LightningShape shape{static_cast<int>(T), nh, d, d};
  float* tr = nullptr;
  if (transition) {
    transition->resize(size_t(nh));
    tr = transition->data();
  }
  if (recurrent)
    cpu::lightning_recurrent(shape, q.data(), k.data(), v.data(), w.slope.ptr(), st.ssm.data(), o.data(), tr);
  else
    cpu::lightning_chunked(shape, q.data(), k.data(), v.data(), w.slope.ptr(), st.ssm.data(), o.data(), tr,
                           c.lightning_block_size);
  cpu::rms_norm_grouped(T, hd, c.group_norm_size, o.data(), w.norm.ptr(), static_cast<float>(c.linear_norm_eps),
                        o.data());
  cpu::linear(T, H, hd, x, w.gate.ptr(), gate.data());
  for (size_t i = 0; i < o.size(); ++i) o[i] = cpu::sigmoid(gate[i]) * o[i];
  cpu::linear(T, hd, H, o.data(), w.out_proj.ptr(), out);
}

void route_sigmoid(const ModelConfig& c, const MoeWeights& w, const float* x, int64_t T,
                   std::vector<std::vector<std::pair<int64_t, float>>>& routed) {
  const int64_t H = c.hidden_size;
  const int E = c.num_experts, topk = c.num_experts_per_tok, G = c.n_group, per = E / c.n_group;
  std::vector<float> logits(size_t(T) * E);
  cpu::linear(T, H, E, x, w.router.ptr(), logits.data());
  std::vector<float> score(E), choice(E), group_score(G);
  std::vector<int> order(E), gorder(G);
  std::vector<char> keep(G);
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) {
      score[e] = cpu::sigmoid(logits[size_t(t) * E + e]);
      choice[e] = score[e] + (w.router_bias.empty() ? 0.0f : w.router_bias.data[size_t(e)]);
    }
    // Group scores: sum of each group's two best choice scores (the one score of a group of one); keep the
    // topk_group best groups.
    for (int g = 0; g < G; ++g) {
      float a = -INFINITY, b = -INFINITY;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        if (choice[e] > a) {
          b = a;
          a = choice[e];
        } else if (choice[e] > b) {
          b = choice[e];
        }
      }
      group_score[g] = per >= 2 ? a + b : a;
    }
    std::iota(gorder.begin(), gorder.end(), 0);
    std::partial_sort(gorder.begin(), gorder.begin() + c.topk_group, gorder.end(), [&](int a, int b) {
      return group_score[a] > group_score[b] || (group_score[a] == group_score[b] && a < b);
    });
    std::fill(keep.begin(), keep.end(), 0);
    for (int j = 0; j < c.topk_group; ++j) keep[gorder[j]] = 1;
    for (int e = 0; e < E; ++e)
      if (!keep[e / per]) choice[e] = -INFINITY;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + topk, order.end(), [&](int a, int b) {
      return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
    });
    float sum = 0.0f;
    for (int j = 0; j < topk; ++j) sum += score[order[j]];
    const float denom = sum + 1e-20f;
    const float scale = static_cast<float>(c.routed_scaling_factor);
    for (int j = 0; j < topk; ++j) {
      float wt = score[order[j]];
      if (c.norm_topk_prob) wt /= denom;
      routed[order[j]].emplace_back(t, wt * scale);
    }
  }
}

void check_lightning_shapes(const ModelConfig& c, const LightningWeights& w, const std::string& q) {
  const int64_t H = c.hidden_size;
  const int64_t nh = c.num_attention_heads, d = c.head_dim, hd = nh * d;
  expect_shape(w.qkv_proj, {3 * hd, H}, q + "qkv_proj");
  expect_shape(w.gate, {hd, H}, q + "gate");
  expect_shape(w.norm, {hd}, q + "norm");
  expect_shape(w.out_proj, {H, hd}, q + "out_proj");
  expect_shape(w.slope, {nh}, q + "slope_rate");
}

void check_attention_shapes(const ModelConfig& c, const AttentionWeights& a, const std::string& q) {
  const int64_t H = c.hidden_size;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  expect_shape(a.q_proj, {nh * hd, H}, q + "q_proj");
  expect_shape(a.k_proj, {nkv * hd, H}, q + "k_proj");
  expect_shape(a.v_proj, {nkv * hd, H}, q + "v_proj");
  expect_shape(a.o_proj, {H, nh * hd}, q + "o_proj");
  if (c.use_qk_norm) {
    expect_shape(a.q_norm, {hd}, q + "q_norm");
    expect_shape(a.k_norm, {hd}, q + "k_norm");
  }
}

}  // namespace shared
}  // namespace hypic::engine::families
