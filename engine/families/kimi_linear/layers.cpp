// Kimi-Linear's KDA and MLA layers on the CPU, fp32. Contracts: kimi_linear/layers.h; the HF transformers 5.17
// classes named there are the formulas' source.
#include "engine/families/kimi_linear/layers.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/families/shared/layers.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gated_delta.h"  // causal_conv1d_silu
#include "kernels/cpu/kda.h"
#include "kernels/cpu/ops.h"

namespace hypic::engine::families::kimi_linear {

namespace cpu = hypic::kernels::cpu;

namespace {

// Softplus as KimiLinearForgetGate writes it: where(g > 20, g, log(1 + exp(g))).
inline float softplus_kimi(float g) { return g > 20.0f ? g : std::log(1.0f + std::exp(g)); }

}  // namespace

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
  const int64_t R = c.kv_lora_rank, row = R + rope;  // one cached latent row: [normed c_kv | k_rot]
  constexpr float kLatentEps = 1e-6f;  // KimiLinearRMSNorm(kv_lora_rank) / (q_lora_rank): the default eps
  if (st.n_tokens < 0 || st.k.size() != size_t(st.n_tokens) * size_t(row) || !st.v.empty())
    throw std::invalid_argument("mla_layer: the latent cache holds " + std::to_string(st.k.size()) + " / " +
                                std::to_string(st.v.size()) + " K / V values for " + std::to_string(st.n_tokens) +
                                " tokens (expected " + std::to_string(row) + " K values per token and no V)");
  std::vector<float> q(size_t(T) * nh * qk), ckv(size_t(T) * row), attn(size_t(T) * nh * vd);
  if (c.q_lora_rank > 0) {
    const int64_t Q = c.q_lora_rank;
    std::vector<float> qa(size_t(T) * Q);
    cpu::linear(T, H, Q, x, w.q_a_proj.ptr(), qa.data());
    cpu::rms_norm(T, Q, qa.data(), w.q_a_layernorm.ptr(), kLatentEps, qa.data());
    cpu::linear(T, Q, int64_t(nh) * qk, qa.data(), w.q_b_proj.ptr(), q.data());
  } else {
    cpu::linear(T, H, int64_t(nh) * qk, x, w.q_proj.ptr(), q.data());
  }
  // The span's latent rows: kv_a_proj_with_mqa x = [c_kv | k_rot], c_kv normed in place (kv_a_layernorm), k_rot raw.
  cpu::linear(T, H, row, x, w.kv_a_proj.ptr(), ckv.data());
  for (int64_t t = 0; t < T; ++t)
    cpu::rms_norm(1, R, ckv.data() + t * row, w.kv_a_layernorm.ptr(), kLatentEps, ckv.data() + t * row);
  st.k.insert(st.k.end(), ckv.begin(), ckv.end());
  st.n_tokens += T;
  const int64_t n = st.n_tokens;
  // Expand every cached row: [k_nope | v] per head = kv_b_proj(normed c_kv), K = [k_nope | k_rot] (k_rot shared).
  std::vector<float> latent(size_t(n) * R), kvb(size_t(n) * nh * (nope + vd));
  std::vector<float> k(size_t(n) * nh * qk), v(size_t(n) * nh * vd);
  for (int64_t t = 0; t < n; ++t)
    std::copy(st.k.begin() + t * row, st.k.begin() + t * row + R, latent.begin() + t * R);
  cpu::linear(n, R, int64_t(nh) * (nope + vd), latent.data(), w.kv_b_proj.ptr(), kvb.data());
  for (int64_t t = 0; t < n; ++t) {
    const float* krot = st.k.data() + t * row + R;
    for (int h = 0; h < nh; ++h) {
      const float* src = kvb.data() + (t * nh + h) * (nope + vd);
      float* kd = k.data() + (t * nh + h) * qk;
      std::copy(src, src + nope, kd);
      std::copy(krot, krot + rope, kd + nope);
      std::copy(src + nope, src + nope + vd, v.data() + (t * nh + h) * vd);
    }
  }
  cpu::AttentionShape shape{T, n, nh, nh, qk};
  shape.v_head_dim = vd;
  cpu::attention_causal(shape, q.data(), k.data(), v.data(),
                        static_cast<float>(1.0 / std::sqrt(static_cast<double>(qk))), attn.data(), key_mass, 1);
  cpu::linear(T, int64_t(nh) * vd, H, attn.data(), w.o_proj.ptr(), out);
}

void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p) {
  const int64_t H = c.hidden_size;
  const std::string q = p + "self_attn.";
  if (lw.type == LayerType::Linear) {
    const KdaWeights& w = lw.kda;
    const int64_t nh = c.linear_num_value_heads, d = c.linear_value_head_dim, hd = nh * d;
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
    const MlaWeights& w = lw.mla;
    const int64_t nh = c.num_attention_heads, qk = c.head_dim, R = c.kv_lora_rank;
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
  }
}

}  // namespace hypic::engine::families::kimi_linear
