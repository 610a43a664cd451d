// Kimi-Linear, MiniMax and Ring-linear mixers and routing on the CPU, fp32. Contracts: family_layers.h; the HF
// transformers 5.17 classes named there (and docs/research/hybrid_models.md 2-4) are the formulas' source.
#include "engine/families/family_layers.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "engine/checkpoint/weights_internal.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gated_delta.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/lightning.h"
#include "kernels/cpu/ops.h"

namespace hypic::engine::families {

namespace cpu = hypic::kernels::cpu;

namespace {

// Softplus as KimiLinearForgetGate writes it: where(g > 20, g, log(1 + exp(g))).
inline float softplus_kimi(float g) { return g > 20.0f ? g : std::log(1.0f + std::exp(g)); }

}  // namespace

void expect_shape(const Tensor& t, const std::vector<int64_t>& shape, const std::string& name) {
  using weights_detail::shape_text;
  if (t.shape != shape || int64_t(t.data.size()) != weights_detail::product(shape))
    throw std::invalid_argument("Model: tensor " + name + " has shape " + shape_text(t.shape) + " (" +
                                std::to_string(t.data.size()) + " values), expected " + shape_text(shape));
}

void kda_layer(const ModelConfig& c, const KdaWeights& w, LinearLayerState& st, const float* x, int64_t T,
               bool recurrent, std::vector<float>* transition, float* out) {
  const int64_t H = c.hidden_size;
  const int nh = c.linear_num_value_heads, d = c.linear_value_head_dim;
  const int64_t hd = int64_t(nh) * d, C = 3 * hd;
  std::vector<float> pre(size_t(T) * C), conv(pre.size()), q(size_t(T) * hd), k(q.size()), v(q.size());
  std::vector<float> low(size_t(T) * d), g(q.size()), gate(q.size()), beta(size_t(T) * nh), o(q.size());

  // Projections into the conv input [T][q | k | v].
  std::vector<float> proj(size_t(T) * hd);
  for (int part = 0; part < 3; ++part) {
    const Tensor& W = part == 0 ? w.q_proj : part == 1 ? w.k_proj : w.v_proj;
    cpu::linear(T, H, hd, x, W.ptr(), proj.data());
    for (int64_t t = 0; t < T; ++t)
      std::copy(proj.begin() + t * hd, proj.begin() + (t + 1) * hd, pre.begin() + t * C + part * hd);
  }
  cpu::causal_conv1d_silu(static_cast<int>(T), static_cast<int>(C), c.linear_conv_kernel_dim, pre.data(),
                          w.conv1d.ptr(), st.conv.data(), conv.data());
  for (int64_t t = 0; t < T; ++t) {
    const float* row = conv.data() + t * C;
    std::copy(row, row + hd, q.begin() + t * hd);
    std::copy(row + hd, row + 2 * hd, k.begin() + t * hd);
    std::copy(row + 2 * hd, row + 3 * hd, v.begin() + t * hd);
  }
  cpu::l2_normalize_rows(T * nh, d, q.data(), 1e-6f);
  cpu::l2_normalize_rows(T * nh, d, k.data(), 1e-6f);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  for (auto& e : q) e *= scale;

  // Forget gate (KimiLinearForgetGate): g = -exp(A_log_h) * softplus(f_b(f_a x) + dt_bias), fp32.
  cpu::linear(T, H, d, x, w.f_a_proj.ptr(), low.data());
  cpu::linear(T, d, hd, low.data(), w.f_b_proj.ptr(), g.data());
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < nh; ++h) {
      const float a = std::exp(w.A_log.data[size_t(h)]);
      for (int e = 0; e < d; ++e) {
        const size_t i = size_t(t * hd + int64_t(h) * d + e);
        g[i] = -a * softplus_kimi(g[i] + w.dt_bias.data[size_t(h) * d + e]);
      }
    }
  cpu::linear(T, H, nh, x, w.b_proj.ptr(), beta.data());
  for (auto& b : beta) b = cpu::sigmoid(b);

  const cpu::KdaShape shape{static_cast<int>(T), nh, d, d};
  const cpu::KdaInputs in{q.data(), k.data(), v.data(), g.data(), beta.data()};
  float* tr = nullptr;
  if (transition) {
    transition->resize(size_t(nh) * d * d);
    tr = transition->data();
  }
  if (recurrent)
    cpu::kda_recurrent(shape, in, st.ssm.data(), o.data(), tr);
  else
    cpu::kda_chunked(shape, in, st.ssm.data(), o.data(), tr, 64);

  // Output gate g_b(g_a x), gated RMSNorm per head (sigmoid), o_proj.
  cpu::linear(T, H, d, x, w.g_a_proj.ptr(), low.data());
  cpu::linear(T, d, hd, low.data(), w.g_b_proj.ptr(), gate.data());
  cpu::rms_norm_gated_sigmoid(T * nh, d, o.data(), gate.data(), w.o_norm.ptr(), static_cast<float>(c.rms_norm_eps),
                              o.data());
  cpu::linear(T, hd, H, o.data(), w.o_proj.ptr(), out);
}

void mla_layer(const ModelConfig& c, const MlaWeights& w, AttentionLayerState& st, const float* x, int64_t T,
               float* out, float* key_mass) {
  const int64_t H = c.hidden_size;
  const int nh = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, vd = c.v_head_dim;
  const int qk = nope + rope;
  const int64_t R = c.kv_lora_rank;
  constexpr float kLatentEps = 1e-6f;  // KimiLinearRMSNorm(kv_lora_rank) / (q_lora_rank): the default eps
  std::vector<float> q(size_t(T) * nh * qk), ckv(size_t(T) * (R + rope)), latent(size_t(T) * R);
  std::vector<float> kvb(size_t(T) * nh * (nope + vd)), k(size_t(T) * nh * qk), v(size_t(T) * nh * vd);
  std::vector<float> attn(size_t(T) * nh * vd);
  if (c.q_lora_rank > 0) {
    const int64_t Q = c.q_lora_rank;
    std::vector<float> qa(size_t(T) * Q);
    cpu::linear(T, H, Q, x, w.q_a_proj.ptr(), qa.data());
    cpu::rms_norm(T, Q, qa.data(), w.q_a_layernorm.ptr(), kLatentEps, qa.data());
    cpu::linear(T, Q, int64_t(nh) * qk, qa.data(), w.q_b_proj.ptr(), q.data());
  } else {
    cpu::linear(T, H, int64_t(nh) * qk, x, w.q_proj.ptr(), q.data());
  }
  cpu::linear(T, H, R + rope, x, w.kv_a_proj.ptr(), ckv.data());
  for (int64_t t = 0; t < T; ++t)
    std::copy(ckv.begin() + t * (R + rope), ckv.begin() + t * (R + rope) + R, latent.begin() + t * R);
  cpu::rms_norm(T, R, latent.data(), w.kv_a_layernorm.ptr(), kLatentEps, latent.data());
  cpu::linear(T, R, int64_t(nh) * (nope + vd), latent.data(), w.kv_b_proj.ptr(), kvb.data());
  for (int64_t t = 0; t < T; ++t) {
    const float* krot = ckv.data() + t * (R + rope) + R;
    for (int h = 0; h < nh; ++h) {
      const float* src = kvb.data() + (t * nh + h) * (nope + vd);
      float* kd = k.data() + (t * nh + h) * qk;
      std::copy(src, src + nope, kd);
      std::copy(krot, krot + rope, kd + nope);
      std::copy(src + nope, src + nope + vd, v.data() + (t * nh + h) * vd);
    }
  }
  st.k.insert(st.k.end(), k.begin(), k.end());
  st.v.insert(st.v.end(), v.begin(), v.end());
  st.n_tokens += T;
  cpu::AttentionShape shape{T, st.n_tokens, nh, nh, qk};
  shape.v_head_dim = vd;
  cpu::attention_causal(shape, q.data(), st.k.data(), st.v.data(),
                        static_cast<float>(1.0 / std::sqrt(static_cast<double>(qk))), attn.data(), key_mass, 1);
  cpu::linear(T, int64_t(nh) * vd, H, attn.data(), w.o_proj.ptr(), out);
}

void lightning_layer(const ModelConfig& c, const LightningWeights& w, LinearLayerState& st, const float* x,
                     int64_t T, int64_t start_position, const std::vector<float>& inv_freq, bool recurrent,
                     std::vector<float>* transition, float* out) {
  const int64_t H = c.hidden_size;
  const int nh = c.num_attention_heads, d = c.head_dim;
  const int64_t hd = int64_t(nh) * d;
  const bool ring = c.family == ModelFamily::RingLinear;
  std::vector<float> qkv(size_t(T) * 3 * hd), q(size_t(T) * hd), k(q.size()), v(q.size()), o(q.size()),
      gate(q.size());
  cpu::linear(T, H, 3 * hd, x, w.qkv_proj.ptr(), qkv.data());
  if (c.linear_qkv_silu)
    for (auto& e : qkv) e = cpu::silu(e);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = qkv.data() + t * 3 * hd;
    std::copy(row, row + hd, q.begin() + t * hd);
    std::copy(row + hd, row + 2 * hd, k.begin() + t * hd);
    std::copy(row + 2 * hd, row + 3 * hd, v.begin() + t * hd);
  }
  if (ring) {
    const float eps = static_cast<float>(c.rms_norm_eps);
    if (c.use_qk_norm) {
      cpu::rms_norm(T * nh, d, q.data(), w.q_norm.ptr(), eps, q.data());
      cpu::rms_norm(T * nh, d, k.data(), w.k_norm.ptr(), eps, k.data());
    }
    if (c.linear_rope) {
      cpu::apply_rope(q.data(), T, nh, d, inv_freq, start_position);
      cpu::apply_rope(k.data(), T, nh, d, inv_freq, start_position);
    }
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    for (auto& e : q) e *= scale;
  }
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

void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p) {
  const int64_t H = c.hidden_size;
  if (lw.type == LayerType::Linear) {
    if (c.family == ModelFamily::KimiLinear) {
      const KdaWeights& w = lw.kda;
      const int64_t nh = c.linear_num_value_heads, d = c.linear_value_head_dim, hd = nh * d;
      const std::string q = p + "self_attn.";
      expect_shape(w.q_proj, {hd, H}, q + "q_proj");
      expect_shape(w.k_proj, {hd, H}, q + "k_proj");
      expect_shape(w.v_proj, {hd, H}, q + "v_proj");
      expect_shape(w.conv1d, {3 * hd, c.linear_conv_kernel_dim}, q + "conv1d");
      expect_shape(w.f_a_proj, {d, H}, q + "f_a_proj");
      expect_shape(w.f_b_proj, {hd, d}, q + "f_b_proj");
      expect_shape(w.A_log, {nh}, q + "A_log");
      expect_shape(w.dt_bias, {hd}, q + "dt_bias");
      expect_shape(w.b_proj, {nh, H}, q + "b_proj");
      expect_shape(w.g_a_proj, {d, H}, q + "g_a_proj");
      expect_shape(w.g_b_proj, {hd, d}, q + "g_b_proj");
      expect_shape(w.o_norm, {d}, q + "o_norm");
      expect_shape(w.o_proj, {H, hd}, q + "o_proj");
    } else {
      const LightningWeights& w = lw.lightning;
      const int64_t nh = c.num_attention_heads, d = c.head_dim, hd = nh * d;
      const std::string q = p + (c.family == ModelFamily::RingLinear ? "attention." : "self_attn.");
      expect_shape(w.qkv_proj, {3 * hd, H}, q + "qkv_proj");
      expect_shape(w.gate, {hd, H}, q + "gate");
      expect_shape(w.norm, {hd}, q + "norm");
      expect_shape(w.out_proj, {H, hd}, q + "out_proj");
      expect_shape(w.slope, {nh}, q + "slope_rate");
      if (c.family == ModelFamily::RingLinear && c.use_qk_norm) {
        expect_shape(w.q_norm, {d}, q + "query_layernorm");
        expect_shape(w.k_norm, {d}, q + "key_layernorm");
      }
    }
  } else if (c.family == ModelFamily::KimiLinear) {
    const MlaWeights& w = lw.mla;
    const int64_t nh = c.num_attention_heads, qk = c.head_dim, R = c.kv_lora_rank;
    const std::string q = p + "self_attn.";
    if (c.q_lora_rank > 0) {
      expect_shape(w.q_a_proj, {c.q_lora_rank, H}, q + "q_a_proj");
      expect_shape(w.q_a_layernorm, {c.q_lora_rank}, q + "q_a_layernorm");
      expect_shape(w.q_b_proj, {nh * qk, c.q_lora_rank}, q + "q_b_proj");
    } else {
      expect_shape(w.q_proj, {nh * qk, H}, q + "q_proj");
    }
    expect_shape(w.kv_a_proj, {R + c.qk_rope_head_dim, H}, q + "kv_a_proj_with_mqa");
    expect_shape(w.kv_a_layernorm, {R}, q + "kv_a_layernorm");
    expect_shape(w.kv_b_proj, {nh * (c.qk_nope_head_dim + c.v_head_dim), R}, q + "kv_b_proj");
    expect_shape(w.o_proj, {H, nh * c.v_head_dim}, q + "o_proj");
  } else {
    const AttentionWeights& a = lw.attention;
    const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
    const std::string q = p + (c.family == ModelFamily::RingLinear ? "attention." : "self_attn.");
    expect_shape(a.q_proj, {nh * hd, H}, q + "q_proj");
    expect_shape(a.k_proj, {nkv * hd, H}, q + "k_proj");
    expect_shape(a.v_proj, {nkv * hd, H}, q + "v_proj");
    expect_shape(a.o_proj, {H, nh * hd}, q + "o_proj");
    if (c.use_qk_norm) {
      expect_shape(a.q_norm, {hd}, q + "q_norm");
      expect_shape(a.k_norm, {hd}, q + "k_norm");
    }
  }
  if (lw.is_moe && c.router_bias) expect_shape(lw.moe.router_bias, {c.num_experts}, p + "mlp.gate.e_score_correction_bias");
}

}  // namespace hypic::engine::families
