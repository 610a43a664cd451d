// Qwen3-Next / Qwen3.5's checkpoint names, layout and parameter counts. Contracts and accepted names:
// qwen/weights.h.
#include "engine/families/qwen/weights.h"

#include <cstring>
#include <string>
#include <vector>

#include "engine/families/qwen/config.h"
#include "engine/families/shared/weights.h"

namespace hypic::engine::families::qwen {

using shared::load_mlp;
using weights_detail::LayoutSink;
using weights_detail::Reader;

namespace {

/// Qwen3-Next's grouped projections -> the flat internal layout. Per key head h the qkvz rows are
/// [q_h (dk) | k_h (dk) | v of value heads h*r..h*r+r-1 (r*dv) | z of those heads (r*dv)] and the ba rows
/// [b of those heads (r) | a of those heads (r)] (Qwen3NextGatedDeltaNet.fix_query_key_value_ordering).
void regroup_qwen3_next(const ModelConfig& c, const Tensor& qkvz, const Tensor& ba, LinearAttnWeights& w) {
  const int64_t H = c.hidden_size, nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, r = nv / nk;
  const int64_t group = 2 * dk + 2 * r * dv;
  w.in_proj_qkv.shape = {c.conv_dim(), H};
  w.in_proj_qkv.data.resize(size_t(c.conv_dim() * H));
  w.in_proj_z.shape = {nv * dv, H};
  w.in_proj_z.data.resize(size_t(nv * dv * H));
  w.in_proj_b.shape = w.in_proj_a.shape = {nv, H};
  w.in_proj_b.data.resize(size_t(nv * H));
  w.in_proj_a.data.resize(size_t(nv * H));
  auto copy_rows = [H](const Tensor& src, int64_t src_row, Tensor& dst, int64_t dst_row, int64_t rows) {
    std::memcpy(dst.data.data() + dst_row * H, src.data.data() + src_row * H, size_t(rows * H) * sizeof(float));
  };
  for (int64_t h = 0; h < nk; ++h) {
    const int64_t base = h * group;
    copy_rows(qkvz, base, w.in_proj_qkv, h * dk, dk);                                 // q
    copy_rows(qkvz, base + dk, w.in_proj_qkv, nk * dk + h * dk, dk);                  // k
    copy_rows(qkvz, base + 2 * dk, w.in_proj_qkv, 2 * nk * dk + h * r * dv, r * dv);  // v
    copy_rows(qkvz, base + 2 * dk + r * dv, w.in_proj_z, h * r * dv, r * dv);         // z
    copy_rows(ba, h * 2 * r, w.in_proj_b, h * r, r);                                  // b
    copy_rows(ba, h * 2 * r + r, w.in_proj_a, h * r, r);                              // a
  }
}

void load_linear(const ModelConfig& c, Reader& rd, const std::string& p, LinearAttnWeights& w) {
  const int64_t H = c.hidden_size, nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, K = c.linear_conv_kernel_dim;
  const int64_t C = c.conv_dim();
  if (rd.has(p + "in_proj_qkvz.weight")) {
    const Tensor qkvz = rd.take(p + "in_proj_qkvz.weight", {2 * nk * dk + 2 * nv * dv, H});
    const Tensor ba = rd.take(p + "in_proj_ba.weight", {2 * nv, H});
    regroup_qwen3_next(c, qkvz, ba, w);
  } else {
    w.in_proj_qkv = rd.take(p + "in_proj_qkv.weight", {C, H});
    w.in_proj_z = rd.take(p + "in_proj_z.weight", {nv * dv, H});
    w.in_proj_b = rd.take(p + "in_proj_b.weight", {nv, H});
    w.in_proj_a = rd.take(p + "in_proj_a.weight", {nv, H});
  }
  w.conv1d = rd.take_any(p + "conv1d.weight", {{C, 1, K}, {C, K}}, {C, K});
  w.A_log = rd.take(p + "A_log", {nv});
  w.dt_bias = rd.take(p + "dt_bias", {nv});
  w.norm = rd.take(p + "norm.weight", {dv});
  w.out_proj = rd.take(p + "out_proj.weight", {H, nv * dv});
}

void load_attention(const ModelConfig& c, Reader& rd, const std::string& p, AttentionWeights& w) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  w.q_proj = rd.take(p + "q_proj.weight", {(c.attn_output_gate ? 2 : 1) * nh * hd, H});
  w.k_proj = rd.take(p + "k_proj.weight", {nkv * hd, H});
  w.v_proj = rd.take(p + "v_proj.weight", {nkv * hd, H});
  w.o_proj = rd.take(p + "o_proj.weight", {H, nh * hd});
  w.q_norm = rd.take(p + "q_norm.weight", {hd});
  w.k_norm = rd.take(p + "k_norm.weight", {hd});
}

/// `name` or `name.weight`, whichever the checkpoint holds (fused experts come both ways).
std::string with_optional_weight(const Reader& rd, const std::string& name) {
  return rd.has(name) ? name : rd.has(name + ".weight") ? name + ".weight" : name;
}

void load_moe(const ModelConfig& c, Reader& rd, const std::string& p, MoeWeights& w) {
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  w.router = rd.take(p + "gate.weight", {E, H});
  const std::string fused = with_optional_weight(rd, p + "experts.gate_up_proj");
  if (rd.has(fused)) {
    w.experts_gate_up = rd.take(fused, {E, 2 * I, H});
    w.experts_down = rd.take(with_optional_weight(rd, p + "experts.down_proj"), {E, H, I});
  } else {
    // Per-expert tensors (released Qwen3-Next, transformers 5.17 save_pretrained): fuse, gate rows first.
    w.experts_gate_up.shape = {E, 2 * I, H};
    w.experts_gate_up.data.resize(size_t(E * 2 * I * H));
    w.experts_down.shape = {E, H, I};
    w.experts_down.data.resize(size_t(E * H * I));
    for (int64_t e = 0; e < E; ++e) {
      const std::string q = p + "experts." + std::to_string(e) + ".";
      float* gu = w.experts_gate_up.data.data() + e * 2 * I * H;
      rd.take_into(q + "gate_proj.weight", {I, H}, gu);
      rd.take_into(q + "up_proj.weight", {I, H}, gu + I * H);
      rd.take_into(q + "down_proj.weight", {H, I}, w.experts_down.data.data() + e * H * I);
    }
  }
  if (c.shared_expert_intermediate_size > 0) {
    load_mlp(rd, p + "shared_expert.", H, c.shared_expert_intermediate_size, w.shared_expert);
    w.shared_expert_gate = rd.take(p + "shared_expert_gate.weight", {1, H});
  }
}

}  // namespace

void load_layer(const ModelConfig& c, Reader& rd, const std::string& p, int /*i*/, LayerWeights& l) {
  if (l.type == LayerType::Linear)
    load_linear(c, rd, p + "linear_attn.", l.linear);
  else
    load_attention(c, rd, p + "self_attn.", l.attention);
  if (l.is_moe)
    load_moe(c, rd, p + "mlp.", l.moe);
  else
    load_mlp(rd, p + "mlp.", c.hidden_size, c.intermediate_size, l.mlp);
}

std::vector<CheckpointTensorSpec> checkpoint_layout(const ModelConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const int64_t nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const std::string prefix = is_nested(c.model_type) ? "model.language_model." : "model.";
  LayoutSink add{H, {}};
  add(prefix + "embed_tokens.weight", {V, H});
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = prefix + "layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {H}, TensorRole::ZeroCentredNorm);
    if (c.layer_types[size_t(i)] == LayerType::Linear) {
      const std::string q = p + "linear_attn.";
      if (c.model_type == "qwen3_next") {
        add(q + "in_proj_qkvz.weight", {2 * nk * dk + 2 * nv * dv, H});
        add(q + "in_proj_ba.weight", {2 * nv, H});
      } else {
        add(q + "in_proj_qkv.weight", {c.conv_dim(), H});
        add(q + "in_proj_z.weight", {nv * dv, H});
        add(q + "in_proj_b.weight", {nv, H});
        add(q + "in_proj_a.weight", {nv, H});
      }
      add(q + "conv1d.weight", {c.conv_dim(), 1, c.linear_conv_kernel_dim}, TensorRole::Conv);
      add(q + "A_log", {nv}, TensorRole::ALog);
      add(q + "dt_bias", {nv}, TensorRole::DtBias);
      add(q + "norm.weight", {dv}, TensorRole::GatedNorm);
      add(q + "out_proj.weight", {H, nv * dv});
    } else {
      const std::string q = p + "self_attn.";
      const int64_t hd = c.head_dim, qd = int64_t(c.num_attention_heads) * hd,
                    kvd = int64_t(c.num_key_value_heads) * hd;
      add(q + "q_proj.weight", {(c.attn_output_gate ? 2 : 1) * qd, H});
      add(q + "k_proj.weight", {kvd, H});
      add(q + "v_proj.weight", {kvd, H});
      add(q + "o_proj.weight", {H, qd});
      add(q + "q_norm.weight", {hd}, TensorRole::ZeroCentredNorm);
      add(q + "k_norm.weight", {hd}, TensorRole::ZeroCentredNorm);
    }
    if (c.is_moe_layer(i)) {
      add(p + "mlp.gate.weight", {c.num_experts, H});
      for (int e = 0; e < c.num_experts; ++e)
        add.mlp(p + "mlp.experts." + std::to_string(e) + ".", c.moe_intermediate_size);
      if (c.shared_expert_intermediate_size > 0) {
        add.mlp(p + "mlp.shared_expert.", c.shared_expert_intermediate_size);
        add(p + "mlp.shared_expert_gate.weight", {1, H});
      }
    } else {
      add.mlp(p + "mlp.", c.intermediate_size);
    }
    add(p + "post_attention_layernorm.weight", {H}, TensorRole::ZeroCentredNorm);
  }
  add(prefix + "norm.weight", {H}, TensorRole::ZeroCentredNorm);
  if (!c.tie_word_embeddings) add("lm_head.weight", {V, H});
  return std::move(add.specs);
}

ParameterCounts count_parameters(const ModelConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  ParameterCounts n;
  n.total = V * H + H + (c.tie_word_embeddings ? 0 : V * H);
  int64_t inactive = 0;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    int64_t layer = 2 * H;
    if (c.layer_types[size_t(i)] == LayerType::Linear) {
      const int64_t nv = c.linear_num_value_heads, vd = c.linear_v_dim();
      layer += c.conv_dim() * H + vd * H + 2 * nv * H + c.conv_dim() * c.linear_conv_kernel_dim + 2 * nv +
               c.linear_value_head_dim + H * vd;
    } else {
      const int64_t qd = int64_t(c.num_attention_heads) * c.head_dim, kvd = int64_t(c.num_key_value_heads) * c.head_dim;
      layer += (c.attn_output_gate ? 2 : 1) * qd * H + 2 * kvd * H + H * qd + 2 * c.head_dim;
    }
    if (c.is_moe_layer(i)) {
      const int64_t expert = 3 * c.moe_intermediate_size * H;
      layer += int64_t(c.num_experts) * H + c.num_experts * expert;
      if (c.shared_expert_intermediate_size > 0) layer += 3 * c.shared_expert_intermediate_size * H + H;
      inactive += int64_t(c.num_experts - c.num_experts_per_tok) * expert;
    } else {
      layer += 3 * c.intermediate_size * H;
    }
    n.total += layer;
  }
  n.active_per_token = n.total - inactive;
  return n;
}

}  // namespace hypic::engine::families::qwen
