// Qwen's Gated DeltaNet on the CPU, fp32, and the shape checks of Qwen's mixers. Contracts: qwen/layers.h; the HF
// transformers 5.17 classes named there are the formulas' source.
#include "engine/families/qwen/layers.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "engine/families/shared/layers.h"
#include "kernels/cpu/gated_delta.h"
#include "kernels/cpu/ops.h"

namespace hypic::engine::families::qwen {

namespace cpu = hypic::kernels::cpu;

void gated_deltanet_layer(const ModelConfig& c, const LinearAttnWeights& w, LinearLayerState& st, const float* x,
                          int64_t T, bool recurrent, std::vector<float>* transition, const GatedDeltaNetBuffers& s,
                          float* out) {
  const int64_t H = c.hidden_size, C = c.conv_dim();
  const int nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const int dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t qd = int64_t(nk) * dk, vd = int64_t(nv) * dv;

  std::vector<float>& qkv = s.qkv;
  std::vector<float>& conv = s.conv;
  std::vector<float>& z = s.z;
  std::vector<float>& gates = s.gates;
  std::vector<float>& qk = s.qk;
  std::vector<float>& v = s.v;
  std::vector<float>& o = s.o;
  qkv.resize(static_cast<size_t>(T) * C);
  conv.resize(qkv.size());
  z.resize(static_cast<size_t>(T) * vd);
  gates.resize(static_cast<size_t>(T) * nv * 2);
  qk.resize(static_cast<size_t>(T) * qd * 2);
  v.resize(static_cast<size_t>(T) * vd);
  o.resize(static_cast<size_t>(T) * vd);
  float* beta = gates.data();
  float* g = gates.data() + static_cast<size_t>(T) * nv;

  cpu::linear(T, H, C, x, w.in_proj_qkv.ptr(), qkv.data());
  cpu::linear(T, H, vd, x, w.in_proj_z.ptr(), z.data());
  cpu::linear(T, H, nv, x, w.in_proj_b.ptr(), beta);
  cpu::linear(T, H, nv, x, w.in_proj_a.ptr(), g);
  cpu::causal_conv1d_silu(static_cast<int>(T), static_cast<int>(C), c.linear_conv_kernel_dim, qkv.data(),
                          w.conv1d.ptr(), st.conv.data(), conv.data());

  // beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) (fp32, softplus threshold 20).
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < nv; ++h) {
      const size_t i = static_cast<size_t>(t) * nv + h;
      beta[i] = cpu::sigmoid(beta[i]);
      g[i] = -std::exp(w.A_log.data[h]) * cpu::softplus(g[i] + w.dt_bias.data[h]);
    }
  }
  // Split [Q | K | V] channels; l2-normalise q and k per head (eps 1e-6 inside the rsqrt of the sum), q *= dk^-1/2.
  float* q = qk.data();
  float* k = qk.data() + static_cast<size_t>(T) * qd;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = conv.data() + static_cast<size_t>(t) * C;
    std::copy(row, row + qd, q + static_cast<size_t>(t) * qd);
    std::copy(row + qd, row + 2 * qd, k + static_cast<size_t>(t) * qd);
    std::copy(row + 2 * qd, row + 2 * qd + vd, v.data() + static_cast<size_t>(t) * vd);
  }
  cpu::l2_normalize_rows(T * nk, dk, q, 1e-6f);
  cpu::l2_normalize_rows(T * nk, dk, k, 1e-6f);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));
  for (size_t i = 0; i < static_cast<size_t>(T) * qd; ++i) q[i] *= scale;

  const cpu::GatedDeltaShape shape{static_cast<int>(T), nk, nv, dk, dv};
  const cpu::GatedDeltaInputs in{q, k, v.data(), g, beta};
  float* tr = nullptr;
  if (transition) {
    transition->resize(static_cast<size_t>(nv) * dk * dk);
    tr = transition->data();
  }
  if (!recurrent) {
    cpu::gated_delta_chunked(shape, in, st.ssm.data(), o.data(), tr, 64);
  } else {
    cpu::gated_delta_recurrent(shape, in, st.ssm.data(), o.data(), tr);
  }
  // Gated RMSNorm per value head over dv (weight w, not 1 + w), times silu(z); then out_proj.
  cpu::rms_norm_gated(T * nv, dv, o.data(), z.data(), w.norm.ptr(), static_cast<float>(c.rms_norm_eps), o.data());
  cpu::linear(T, vd, H, o.data(), w.out_proj.ptr(), out);
}

void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p) {
  const int64_t H = c.hidden_size;
  if (lw.type == LayerType::Linear) {
    const int64_t nv = c.linear_num_value_heads, dv = c.linear_value_head_dim, K = c.linear_conv_kernel_dim;
    const LinearAttnWeights& l = lw.linear;
    expect_shape(l.in_proj_qkv, {c.conv_dim(), H}, p + "linear_attn.in_proj_qkv");
    expect_shape(l.in_proj_z, {nv * dv, H}, p + "linear_attn.in_proj_z");
    expect_shape(l.in_proj_b, {nv, H}, p + "linear_attn.in_proj_b");
    expect_shape(l.in_proj_a, {nv, H}, p + "linear_attn.in_proj_a");
    expect_shape(l.conv1d, {c.conv_dim(), K}, p + "linear_attn.conv1d");
    expect_shape(l.A_log, {nv}, p + "linear_attn.A_log");
    expect_shape(l.dt_bias, {nv}, p + "linear_attn.dt_bias");
    expect_shape(l.norm, {dv}, p + "linear_attn.norm");
    expect_shape(l.out_proj, {H, nv * dv}, p + "linear_attn.out_proj");
  } else {
    const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
    const AttentionWeights& a = lw.attention;
    expect_shape(a.q_proj, {(c.attn_output_gate ? 2 : 1) * nh * hd, H}, p + "self_attn.q_proj");
    expect_shape(a.k_proj, {nkv * hd, H}, p + "self_attn.k_proj");
    expect_shape(a.v_proj, {nkv * hd, H}, p + "self_attn.v_proj");
    expect_shape(a.o_proj, {H, nh * hd}, p + "self_attn.o_proj");
    expect_shape(a.q_norm, {hd}, p + "self_attn.q_norm");
    expect_shape(a.k_norm, {hd}, p + "self_attn.k_norm");
  }
}

}  // namespace hypic::engine::families::qwen
