// Kimi-Linear's checkpoint names and layout. Contracts and accepted names: kimi_linear/weights.h.
#include "engine/families/kimi_linear/weights.h"

#include <cstring>
#include <string>
#include <vector>

#include "engine/families/shared/weights.h"

namespace hypic::engine::families::kimi_linear {

using shared::first_present;
using weights_detail::LayoutSink;
using weights_detail::Reader;

namespace {

void load_kda(const ModelConfig& c, Reader& rd, const std::string& p, KdaWeights& w) {
  const int64_t H = c.hidden_size, nh = c.linear_num_value_heads, d = c.linear_value_head_dim;
  const int64_t K = c.linear_conv_kernel_dim, hd = nh * d;
  w.q_proj = rd.take(p + "q_proj.weight", {hd, H});
  w.k_proj = rd.take(p + "k_proj.weight", {hd, H});
  w.v_proj = rd.take(p + "v_proj.weight", {hd, H});
  if (rd.has(p + "q_conv1d.weight")) {
    w.conv1d.shape = {3 * hd, K};
    w.conv1d.data.resize(size_t(3 * hd * K));
    int part = 0;
    for (const char* name : {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"}) {
      const Tensor t = rd.take_any(p + name, {{hd, 1, K}, {hd, K}}, {hd, K});
      std::memcpy(w.conv1d.data.data() + part++ * hd * K, t.data.data(), size_t(hd * K) * sizeof(float));
    }
  } else {
    w.conv1d = rd.take_any(p + "conv1d.weight", {{3 * hd, 1, K}, {3 * hd, K}}, {3 * hd, K});
  }
  auto gate_name = [&](const std::string& n) { return first_present(rd, {p + n, p + "forget_gate." + n}); };
  w.f_a_proj = rd.take(gate_name("f_a_proj.weight"), {d, H});
  w.f_b_proj = rd.take(gate_name("f_b_proj.weight"), {hd, d});
  w.A_log = rd.take_any(gate_name("A_log"), {{1, 1, nh, 1}, {nh, 1}, {nh}}, {nh});
  w.dt_bias = rd.take_any(gate_name("dt_bias"), {{hd}, {nh, d}}, {hd});
  w.b_proj = rd.take(p + "b_proj.weight", {nh, H});
  w.g_a_proj = rd.take(p + "g_a_proj.weight", {d, H});
  w.g_b_proj = rd.take(p + "g_b_proj.weight", {hd, d});
  w.o_norm = rd.take(p + "o_norm.weight", {d});
  w.o_proj = rd.take(p + "o_proj.weight", {H, hd});
}

void load_mla(const ModelConfig& c, Reader& rd, const std::string& p, MlaWeights& w) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, qk = c.head_dim;
  const int64_t R = c.kv_lora_rank, rope = c.qk_rope_head_dim, nope = c.qk_nope_head_dim, vd = c.v_head_dim;
  if (c.q_lora_rank > 0) {
    const int64_t Q = c.q_lora_rank;
    w.q_a_proj = rd.take(p + "q_a_proj.weight", {Q, H});
    w.q_a_layernorm = rd.take(p + "q_a_layernorm.weight", {Q});
    w.q_b_proj = rd.take(p + "q_b_proj.weight", {nh * qk, Q});
  } else {
    w.q_proj = rd.take(p + "q_proj.weight", {nh * qk, H});
  }
  w.kv_a_proj = rd.take(p + "kv_a_proj_with_mqa.weight", {R + rope, H});
  w.kv_a_layernorm = rd.take(p + "kv_a_layernorm.weight", {R});
  w.kv_b_proj = rd.take(p + "kv_b_proj.weight", {nh * (nope + vd), R});
  w.o_proj = rd.take(p + "o_proj.weight", {H, nh * vd});
}

}  // namespace

void load_layer(const ModelConfig& c, Reader& rd, const std::string& p, int /*i*/, LayerWeights& l) {
  if (l.type == LayerType::Linear)
    load_kda(c, rd, p + "self_attn.", l.kda);
  else
    load_mla(c, rd, p + "self_attn.", l.mla);
  shared::load_ffn(c, rd, p, l);
}

std::vector<CheckpointTensorSpec> checkpoint_layout(const ModelConfig& c) {
  const int64_t H = c.hidden_size;
  const int64_t nh = c.num_attention_heads, hd = c.head_dim;
  const TensorRole norm = TensorRole::GatedNorm;  // applied as w
  return shared::checkpoint_layout(c, "model.embed_tokens.weight", [&](int i, const std::string& p, LayoutSink& add) {
    const bool linear = c.layer_types[size_t(i)] == LayerType::Linear;
    const std::string q = p + "self_attn.";
    if (linear) {
      const int64_t n = c.linear_num_value_heads, d = c.linear_value_head_dim, K = c.linear_conv_kernel_dim;
      for (const char* proj : {"q_proj", "k_proj", "v_proj"}) add(q + proj + ".weight", {n * d, H});
      for (const char* conv : {"q_conv1d", "k_conv1d", "v_conv1d"})
        add(q + conv + ".weight", {n * d, 1, K}, TensorRole::Conv);
      add(q + "A_log", {1, 1, n, 1}, TensorRole::ALog);
      add(q + "dt_bias", {n * d}, TensorRole::DtBias);
      add(q + "f_a_proj.weight", {d, H});
      add(q + "f_b_proj.weight", {n * d, d});
      add(q + "b_proj.weight", {n, H});
      add(q + "g_a_proj.weight", {d, H});
      add(q + "g_b_proj.weight", {n * d, d});
      add(q + "o_norm.weight", {d}, norm);
      add(q + "o_proj.weight", {H, n * d});
    } else {
      if (c.q_lora_rank > 0) {
        add(q + "q_a_proj.weight", {c.q_lora_rank, H});
        add(q + "q_a_layernorm.weight", {c.q_lora_rank}, norm);
        add(q + "q_b_proj.weight", {nh * hd, c.q_lora_rank});
      } else {
        add(q + "q_proj.weight", {nh * hd, H});
      }
      add(q + "kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, H});
      add(q + "kv_a_layernorm.weight", {c.kv_lora_rank}, norm);
      add(q + "kv_b_proj.weight", {nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
      add(q + "o_proj.weight", {H, nh * c.v_head_dim});
    }
    shared::add_ffn_layout(c, add, p, i, {"block_sparse_moe.", "gate.e_score_correction_bias", true});
  });
}

}  // namespace hypic::engine::families::kimi_linear
