// MiniMax's checkpoint names, layout and lightning decay rates. Contracts and accepted names: minimax/weights.h.
#include "engine/families/minimax/weights.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/families/shared/weights.h"

namespace hypic::engine::families::minimax {

using weights_detail::LayoutSink;
using weights_detail::Reader;

namespace {

/// MiniMax qkv_proj rows per head [q_h | k_h | v_h] -> [Q all heads | K all heads | V all heads].
Tensor regroup_per_head_qkv(const Tensor& t, int64_t nh, int64_t d, int64_t H) {
  Tensor out;
  out.shape = t.shape;
  out.data.resize(t.data.size());
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t part = 0; part < 3; ++part)
      std::memcpy(out.data.data() + (part * nh * d + h * d) * H, t.data.data() + (h * 3 * d + part * d) * H,
                  size_t(d * H) * sizeof(float));
  return out;
}

void load_lightning(const ModelConfig& c, Reader& rd, const std::string& p, int layer, LightningWeights& w) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, d = c.head_dim, hd = nh * d;
  w.qkv_proj = regroup_per_head_qkv(rd.take(p + "qkv_proj.weight", {3 * hd, H}), nh, d, H);
  w.gate = rd.take(p + "output_gate.weight", {hd, H});
  w.norm = rd.take(p + "norm.weight", {hd});
  w.out_proj = rd.take(p + "out_proj.weight", {H, hd});
  if (rd.has(p + "slope_rate")) {
    w.slope = rd.take_any(p + "slope_rate", {{nh, 1, 1}, {nh}}, {nh});
  } else {
    const auto s = lightning_slope_rates(c, layer);
    w.slope.shape = {nh};
    w.slope.data = s;
  }
  for (const char* buffer : {"query_decay", "key_decay", "diagonal_decay"}) rd.ignore(p + buffer);
}

void load_attention(const ModelConfig& c, Reader& rd, const std::string& p, AttentionWeights& w) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  w.q_proj = rd.take(p + "q_proj.weight", {nh * hd, H});
  w.k_proj = rd.take(p + "k_proj.weight", {nkv * hd, H});
  w.v_proj = rd.take(p + "v_proj.weight", {nkv * hd, H});
  w.o_proj = rd.take(p + "o_proj.weight", {H, nh * hd});
}

}  // namespace

void load_layer(const ModelConfig& c, Reader& rd, const std::string& p, int i, LayerWeights& l) {
  const std::string q = p + "self_attn.";
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
  return shared::checkpoint_layout(c, "model.embed_tokens.weight", [&](int i, const std::string& p, LayoutSink& add) {
    const bool linear = c.layer_types[size_t(i)] == LayerType::Linear;
    const std::string q = p + "self_attn.";
    if (linear) {
      add(q + "qkv_proj.weight", {3 * nh * hd, H});
      add(q + "output_gate.weight", {nh * hd, H});
      add(q + "norm.weight", {nh * hd}, norm);
      add(q + "out_proj.weight", {H, nh * hd});
    } else {
      add(q + "q_proj.weight", {nh * hd, H});
      add(q + "k_proj.weight", {nkv * hd, H});
      add(q + "v_proj.weight", {nkv * hd, H});
      add(q + "o_proj.weight", {H, nh * hd});
    }
    shared::add_ffn_layout(c, add, p, i, {"block_sparse_moe.", "gate.e_score_correction_bias", true});
  });
}

std::vector<float> slope_rates(const ModelConfig& c, int layer) {
  const int nh = c.num_attention_heads, L = c.num_hidden_layers;
  std::vector<float> s(static_cast<size_t>(nh));
  // get_slope_rate: base ** (arange(nh) + 1) in fp32 (a Python float to the power of an int tensor), times the
  // layer factor (a Python float) in fp32.
  const float base = static_cast<float>(1.0 / std::pow(2.0, 8.0 / nh));
  const float factor = static_cast<float>(1.0 - double(layer) / (double(L) - 1.0 + 1e-5) + 1e-5);
  for (int h = 0; h < nh; ++h) s[size_t(h)] = std::pow(base, static_cast<float>(h + 1)) * factor;
  return s;
}

}  // namespace hypic::engine::families::minimax
