// Loading the decoder layers of the Kimi-Linear, MiniMax and Ring-linear families into the internal layout
// (engine/checkpoint/weights.h), their checkpoint layouts for write_random_checkpoint, and the lightning decay rates.
// Accepted names (both those transformers 5.17 save_pretrained writes and those of the released checkpoints,
// docs/research/hybrid_models.md 2.3, 3.4, 4.2, and transformers' conversion_mapping for kimi_linear / mixtral):
//  - MLP / MoE under `mlp.` or `block_sparse_moe.`; experts fused (`experts.gate_up_proj` [E,2I,H] and
//    `experts.down_proj` [E,H,I], with or without `.weight`), or per expert as `experts.{e}.w1/w3/w2.weight`
//    (gate / up / down) or `experts.{e}.{gate,up,down}_proj.weight`; shared experts `shared_experts.*` (Kimi, Ring).
//  - Kimi KDA: `{q,k,v}_conv1d.weight` [nh*d,1,K] or one packed `conv1d.weight` [3*nh*d,1,K]; the forget-gate tensors
//    `f_a_proj`, `f_b_proj`, `dt_bias`, `A_log` directly under `self_attn.` or under `self_attn.forget_gate.`;
//    A_log as [1,1,nh,1], [nh,1] or [nh]; dt_bias as [nh*d] or [nh, d].
//  - MiniMax lightning: `qkv_proj` (rows per head [q | k | v]), `output_gate`, `norm`, `out_proj`, and the buffers
//    `slope_rate` [nh,1,1] (used when present, as HF does) and `query_decay` / `key_decay` / `diagonal_decay`
//    (derived from slope_rate; ignored).
//  - Ring: `model.word_embeddings.weight`, `attention.query_key_value` ([Q | K | V] rows), `attention.dense`,
//    `attention.g_proj`, `attention.g_norm`, `attention.{query,key}_layernorm`, `mlp.gate.expert_bias`.
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/checkpoint/weights.h"
#include "engine/checkpoint/weights_internal.h"

namespace hypic::engine {
namespace weights_detail {
namespace {

/// `name` or `name.weight`, whichever the checkpoint holds.
std::string either_weight(const Reader& rd, const std::string& name) {
  return rd.has(name) ? name : name + ".weight";
}

/// The first of the candidate names the checkpoint holds, else the first (so the error names it).
std::string first_present(const Reader& rd, std::initializer_list<std::string> names) {
  for (const auto& n : names)
    if (rd.has(n)) return n;
  return *names.begin();
}

void load_mlp_at(Reader& rd, const std::string& p, int64_t H, int64_t I, MlpWeights& w) {
  w.gate_proj = rd.take(p + "gate_proj.weight", {I, H});
  w.up_proj = rd.take(p + "up_proj.weight", {I, H});
  w.down_proj = rd.take(p + "down_proj.weight", {H, I});
}

/// `layer.mlp.` or `layer.block_sparse_moe.`: the one holding `probe`.
std::string ffn_prefix(const Reader& rd, const std::string& layer, const std::string& probe) {
  return rd.has(layer + "block_sparse_moe." + probe) && !rd.has(layer + "mlp." + probe) ? layer + "block_sparse_moe."
                                                                                        : layer + "mlp.";
}

void load_experts(const ModelConfig& c, Reader& rd, const std::string& p, MoeWeights& w) {
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  const std::string fused = either_weight(rd, p + "experts.gate_up_proj");
  if (rd.has(fused)) {
    w.experts_gate_up = rd.take(fused, {E, 2 * I, H});
    w.experts_down = rd.take(either_weight(rd, p + "experts.down_proj"), {E, H, I});
    return;
  }
  w.experts_gate_up.shape = {E, 2 * I, H};
  w.experts_gate_up.data.resize(size_t(E * 2 * I * H));
  w.experts_down.shape = {E, H, I};
  w.experts_down.data.resize(size_t(E * H * I));
  const bool mixtral_names = rd.has(p + "experts.0.w1.weight");
  for (int64_t e = 0; e < E; ++e) {
    const std::string q = p + "experts." + std::to_string(e) + ".";
    float* gu = w.experts_gate_up.data.data() + e * 2 * I * H;
    rd.take_into(q + (mixtral_names ? "w1.weight" : "gate_proj.weight"), {I, H}, gu);
    rd.take_into(q + (mixtral_names ? "w3.weight" : "up_proj.weight"), {I, H}, gu + I * H);
    rd.take_into(q + (mixtral_names ? "w2.weight" : "down_proj.weight"), {H, I}, w.experts_down.data.data() + e * H * I);
  }
}

/// The MLP of layer i: dense (mlp_only) or MoE with the family's router and shared experts.
void load_ffn(const ModelConfig& c, Reader& rd, const std::string& layer, LayerWeights& l) {
  const int64_t H = c.hidden_size;
  if (!l.is_moe) {
    load_mlp_at(rd, ffn_prefix(rd, layer, "gate_proj.weight"), H, c.intermediate_size, l.mlp);
    return;
  }
  const std::string p = ffn_prefix(rd, layer, "gate.weight");
  MoeWeights& w = l.moe;
  w.router = rd.take(p + "gate.weight", {c.num_experts, H});
  if (c.router_bias)
    w.router_bias = rd.take(first_present(rd, {p + "gate.e_score_correction_bias", p + "gate.expert_bias"}),
                            {c.num_experts});
  load_experts(c, rd, p, w);
  if (c.shared_expert_intermediate_size > 0)
    load_mlp_at(rd, p + "shared_experts.", H, c.shared_expert_intermediate_size, w.shared_expert);
}

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

void load_minimax_lightning(const ModelConfig& c, Reader& rd, const std::string& p, int layer, LightningWeights& w) {
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

void load_ring_lightning(const ModelConfig& c, Reader& rd, const std::string& p, int layer, LightningWeights& w) {
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

void load_plain_attention(const ModelConfig& c, Reader& rd, const std::string& p, AttentionWeights& w) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  if (c.family == ModelFamily::RingLinear) {
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
    return;
  }
  w.q_proj = rd.take(p + "q_proj.weight", {nh * hd, H});
  w.k_proj = rd.take(p + "k_proj.weight", {nkv * hd, H});
  w.v_proj = rd.take(p + "v_proj.weight", {nkv * hd, H});
  w.o_proj = rd.take(p + "o_proj.weight", {H, nh * hd});
}

}  // namespace

void load_family_layer(const ModelConfig& c, Reader& rd, const std::string& p, int i, LayerWeights& l) {
  const bool linear = l.type == LayerType::Linear;
  switch (c.family) {
    case ModelFamily::KimiLinear:
      if (linear)
        load_kda(c, rd, p + "self_attn.", l.kda);
      else
        load_mla(c, rd, p + "self_attn.", l.mla);
      break;
    case ModelFamily::MiniMax:
    case ModelFamily::RingLinear: {  // lightning layers and plain GQA softmax layers, under each family's name
      const bool ring = c.family == ModelFamily::RingLinear;
      const std::string q = p + (ring ? "attention." : "self_attn.");
      if (linear)
        (ring ? load_ring_lightning : load_minimax_lightning)(c, rd, q, i, l.lightning);
      else
        load_plain_attention(c, rd, q, l.attention);
      break;
    }
    case ModelFamily::Qwen: throw std::logic_error("load_family_layer: Qwen layers are loaded by weights.cpp");
  }
  load_ffn(c, rd, p, l);
}

std::vector<CheckpointTensorSpec> family_checkpoint_layout(const ModelConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  LayoutSink add{H, {}};
  const TensorRole norm = TensorRole::GatedNorm;  // applied as w
  const bool ring = c.family == ModelFamily::RingLinear;
  add(ring ? "model.word_embeddings.weight" : "model.embed_tokens.weight", {V, H});
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {H}, norm);
    const bool linear = c.layer_types[size_t(i)] == LayerType::Linear;
    if (c.family == ModelFamily::KimiLinear) {
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
    } else if (c.family == ModelFamily::MiniMax) {
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
    } else {
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
    }
    if (c.is_moe_layer(i)) {
      const std::string m = p + (c.family == ModelFamily::RingLinear ? "mlp." : "block_sparse_moe.");
      add(m + "gate.weight", {c.num_experts, H});
      if (c.router_bias)
        add(m + (c.family == ModelFamily::RingLinear ? "gate.expert_bias" : "gate.e_score_correction_bias"),
            {c.num_experts});
      const bool mixtral = c.family != ModelFamily::RingLinear;
      const int64_t I = c.moe_intermediate_size;
      for (int e = 0; e < c.num_experts; ++e) {
        const std::string x = m + "experts." + std::to_string(e) + ".";
        add(x + (mixtral ? "w1.weight" : "gate_proj.weight"), {I, H});
        add(x + (mixtral ? "w2.weight" : "down_proj.weight"), {H, I});
        add(x + (mixtral ? "w3.weight" : "up_proj.weight"), {I, H});
      }
      if (c.shared_expert_intermediate_size > 0) add.mlp(m + "shared_experts.", c.shared_expert_intermediate_size);
    } else {
      add.mlp(p + "mlp.", c.intermediate_size);
    }
    add(p + "post_attention_layernorm.weight", {H}, norm);
  }
  add("model.norm.weight", {H}, norm);
  if (!c.tie_word_embeddings) add("lm_head.weight", {V, H});
  return std::move(add.specs);
}

}  // namespace weights_detail

std::vector<float> lightning_slope_rates(const ModelConfig& c, int layer) {
  if (c.family != ModelFamily::MiniMax && c.family != ModelFamily::RingLinear)
    throw std::invalid_argument(std::string("lightning_slope_rates: family ") + model_family_name(c.family) +
                                " has no lightning layers");
  if (layer < 0 || layer >= c.num_hidden_layers)
    throw std::invalid_argument("lightning_slope_rates: layer " + std::to_string(layer) + " out of range");
  const int nh = c.num_attention_heads, L = c.num_hidden_layers;
  std::vector<float> s(static_cast<size_t>(nh));
  if (c.family == ModelFamily::MiniMax) {
    // get_slope_rate: base ** (arange(nh) + 1) in fp32 (a Python float to the power of an int tensor), times the
    // layer factor (a Python float) in fp32.
    const float base = static_cast<float>(1.0 / std::pow(2.0, 8.0 / nh));
    const float factor = static_cast<float>(1.0 - double(layer) / (double(L) - 1.0 + 1e-5) + 1e-5);
    for (int h = 0; h < nh; ++h) s[size_t(h)] = std::pow(base, static_cast<float>(h + 1)) * factor;
    return s;
  }
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

}  // namespace hypic::engine
