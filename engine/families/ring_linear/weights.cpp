// Ring-linear's checkpoint names, layout and lightning decay rates. Contracts and accepted names:
// ring_linear/weights.h.
#include "engine/families/ring_linear/weights.h"

#include <cmath>
#include <string>
#include <vector>

#include "engine/families/shared/weights.h"

namespace hypic::engine::families::ring_linear {

using weights_detail::LayoutSink;
using weights_detail::Reader;

namespace {

void load_lightning(const ModelConfig& c, Reader& rd, const std::string& p, int layer, LightningWeights& w) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, d = c.head_dim, hd = nh * d;
  w.qkv_proj = rd.take(p + "query_key_value.weight", {3 * hd, H});
  w.gate = rd.take(p + "g_proj.weight", {hd, H});
  w.norm = rd.take(p + "g_norm.weight", {hd});
  w.out_proj = rd.take(p + "dense.weight", {H, hd});
  if (c.use_qk_norm) {
    w.q_norm = rd.take(p + "query_layernorm.weight", {d});
    w.k_norm = rd.take(p + "key_layernorm.weight", {d});
  }
  const auto s = lightning_slope_rates(c, layer);
  w.slope.shape = {nh};
  w.slope.data = s;
}

void load_attention(const ModelConfig& c, Reader& rd, const std::string& p, AttentionWeights& w) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  // Fused query_key_value rows [Q (nh*hd) | K (nkv*hd) | V (nkv*hd)], split into the three projections.
  const Tensor qkv = rd.take(p + "query_key_value.weight", {(nh + 2 * nkv) * hd, H});
  auto rows = [&](int64_t from, int64_t count) {
    Tensor t;
    t.shape = {count, H};
    t.data.assign(qkv.data.begin() + from * H, qkv.data.begin() + (from + count) * H);
    return t;
  };
  w.q_proj = rows(0, nh * hd);
  w.k_proj = rows(nh * hd, nkv * hd);
  w.v_proj = rows((nh + nkv) * hd, nkv * hd);
  w.o_proj = rd.take(p + "dense.weight", {H, nh * hd});
  if (c.use_qk_norm) {
    w.q_norm = rd.take(p + "query_layernorm.weight", {hd});
    w.k_norm = rd.take(p + "key_layernorm.weight", {hd});
  }
}

}  // namespace

void load_layer(const ModelConfig& c, Reader& rd, const std::string& p, int i, LayerWeights& l) {
  const std::string q = p + "attention.";
  if (l.type == LayerType::Linear)
    load_lightning(c, rd, q, i, l.lightning);
  else
    load_attention(c, rd, q, l.attention);
  shared::load_ffn(c, rd, p, l);
}

std::vector<CheckpointTensorSpec> checkpoint_layout(const ModelConfig& c) {
  const int64_t H = c.hidden_size;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  const TensorRole norm = TensorRole::GatedNorm;  // applied as w
  return shared::checkpoint_layout(c, std::string("model.") + kEmbedName, [&](int i, const std::string& p,
                                                                              LayoutSink& add) {
    const bool linear = c.layer_types[size_t(i)] == LayerType::Linear;
    const std::string q = p + "attention.";
    if (linear) {
      add(q + "query_key_value.weight", {3 * nh * hd, H});
      add(q + "g_proj.weight", {nh * hd, H});
      add(q + "g_norm.weight", {nh * hd}, norm);
      add(q + "dense.weight", {H, nh * hd});
    } else {
      add(q + "query_key_value.weight", {(nh + 2 * nkv) * hd, H});
      add(q + "dense.weight", {H, nh * hd});
    }
    if (c.use_qk_norm) {
      add(q + "query_layernorm.weight", {hd}, norm);
      add(q + "key_layernorm.weight", {hd}, norm);
    }
    shared::add_ffn_layout(c, add, p, i, {"mlp.", "gate.expert_bias", false});
  });
}

std::vector<float> slope_rates(const ModelConfig& c, int layer) {
  const int nh = c.num_attention_heads, L = c.num_hidden_layers;
  std::vector<float> s(static_cast<size_t>(nh));
  // ALiBi slopes (the power-of-two construction), times the layer scale.
  auto pow2_slopes = [](int n) {
    const double start = std::pow(2.0, -std::pow(2.0, -(std::log2(double(n)) - 3.0)));
    std::vector<double> r(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) r[size_t(i)] = std::pow(start, i + 1);
    return r;
  };
  std::vector<double> slopes;
  const int p = 1 << static_cast<int>(std::floor(std::log2(double(nh))));
  if (p == nh) {
    slopes = pow2_slopes(nh);
  } else {
    slopes = pow2_slopes(p);
    const auto extra = pow2_slopes(2 * p);
    for (int i = 0; int(slopes.size()) < nh; i += 2) slopes.push_back(extra[size_t(i)]);
  }
  const double scale = L > 1 ? 1.0 - (double(layer) - 1.0) / (double(L) - 1.0) + 1e-5 : 1.0 + 1e-5;
  for (int h = 0; h < nh; ++h) s[size_t(h)] = static_cast<float>(float(slopes[size_t(h)]) * float(scale));
  return s;
}

}  // namespace hypic::engine::families::ring_linear
