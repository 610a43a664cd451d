// Qwen3-Next / Qwen3.5's Gated DeltaNet mixer on the CPU, fp32, as the Model (engine/cpu/model.cpp) calls it for
// linear layers, and the shape checks of Qwen's mixer tensors. Its gated softmax attention (Qwen3NextAttention /
// Qwen3_5Attention: q_proj split into query | gate per head, zero-centred q/k norms, partial RoPE) and its
// softmax-routed MoE with a sigmoid-gated shared expert run in the Model's attention and MoE code, which MiniMax and
// Ring share. Part of hypic_engine_core. Shapes and state layouts follow engine/cpu/model.h (LinearLayerState::ssm
// [nv][dk][dv], conv tail [K-1][conv_dim]); x is the mixer input [T][hidden] (already normed), out [T][hidden] the
// mixer output (before the residual).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/cpu/model.h"

namespace hypic::engine::families::qwen {

/// Work buffers gated_deltanet_layer reuses from call to call (the Model's scratch; resized to fit, contents not
/// kept).
struct GatedDeltaNetBuffers {
  std::vector<float>& qkv;    ///< [T][conv_dim] before the conv
  std::vector<float>& conv;   ///< [T][conv_dim] after the conv
  std::vector<float>& z;      ///< [T][nv*dv]
  std::vector<float>& gates;  ///< [T][nv] beta, then [T][nv] g
  std::vector<float>& qk;     ///< [T][nk*dk] q, then [T][nk*dk] k
  std::vector<float>& v;      ///< [T][nv*dv]
  std::vector<float>& o;      ///< [T][nv*dv]
};

/// Gated DeltaNet (Qwen3_5GatedDeltaNet.forward; Qwen3NextGatedDeltaNet once its projections are regrouped at
/// load): in_proj_qkv / z / b / a, causal conv1d + SiLU over [Q | K | V] (conv tail in st.conv), beta = sigmoid(b),
/// g = -exp(A_log) * softplus(a + dt_bias) (fp32, threshold 20), per-head l2norm of q and k (eps 1e-6),
/// q *= dk^-1/2, the gated delta rule (chunked, chunk 64, or token by token when `recurrent`), the gated RMSNorm per
/// value head (weight w, eps rms_norm_eps) times silu(z), out_proj. transition: when not null, receives T_C
/// [nv][dk][dk] (dense).
void gated_deltanet_layer(const ModelConfig& c, const LinearAttnWeights& w, LinearLayerState& st, const float* x,
                          int64_t T, bool recurrent, std::vector<float>* transition, const GatedDeltaNetBuffers& s,
                          float* out);

/// Checks the shapes of layer lw's mixer tensors (LinearAttnWeights under `<p>linear_attn.` or the gated
/// AttentionWeights under `<p>self_attn.`, p e.g. "layers.3.") against the config; throws std::invalid_argument
/// naming the tensor and both shapes.
void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p);

}  // namespace hypic::engine::families::qwen
