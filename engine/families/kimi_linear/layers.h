// Kimi-Linear's token mixers on the CPU, fp32, as the Model (engine/cpu/model.cpp) calls them layer by layer: KDA
// (KimiLinearDeltaAttention) for linear layers, MLA without RoPE (KimiLinearAttention) for full-attention layers.
// Its MoE routes with shared::route_sigmoid (KimiLinearTopkRouter). Part of hypic_engine_core. Shapes and state
// layouts follow engine/cpu/model.h (LinearLayerState::ssm [H][d_k][d_v], conv tail [K-1][conv_dim];
// AttentionLayerState K [n][kv_cache_heads()][kv_cache_k_dim()], V [n][kv_cache_heads()][kv_cache_v_dim()]: for MLA
// the latent K [n][1][kv_lora_rank + qk_rope] and no V). x is the mixer input [T][hidden]
// (already normed), out [T][hidden] the mixer output (before the residual).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/cpu/model.h"

namespace hypic::engine::families::kimi_linear {

/// KDA layer (KimiLinearDeltaAttention.forward, transformers 5.17): q/k/v projections, three depthwise causal
/// convs + SiLU (one conv over [q | k | v] channels, conv tail [K-1][3*H*d] in st.conv), per-head l2norm of q and k
/// (eps 1e-6), q *= d^-1/2, g = -exp(A_log) * softplus(f_b(f_a x) + dt_bias) (fp32, threshold 20),
/// beta = sigmoid(b_proj x), the KDA recurrence (chunked, chunk 64, or token by token when `recurrent`), the gated
/// output norm RMSNorm(o) * w * sigmoid(g_b(g_a x)) per head (eps rms_norm_eps), o_proj.
/// transition: when not null, receives T_C [H][d][d] (dense).
void kda_layer(const ModelConfig& c, const KdaWeights& w, LinearLayerState& st, const float* x, int64_t T,
               bool recurrent, std::vector<float>* transition, float* out);

/// MLA layer without RoPE (KimiLinearAttention.forward, transformers 5.17, eager): q = q_proj x (or
/// q_b(RMSNorm(q_a x))), [c_kv | k_rot] = kv_a_proj_with_mqa x, c_kv <- RMSNorm(c_kv) (kv_a_layernorm, eps 1e-6 as
/// KimiLinearRMSNorm's default), [k_nope | v] per head = kv_b_proj c_kv, K = [k_nope | k_rot] (k_rot shared by every
/// head), causal softmax attention with scale (qk_nope + qk_rope)^-1/2, o_proj. Appends the span's latent rows
/// [T][1][kv_lora_rank + qk_rope] = [RMSNorm(c_kv) * kv_a_layernorm.weight | k_rot] to st.k (st.v stays empty; no
/// rotation: the layer has no positions), then expands every cached row through kv_b_proj into per-head K
/// [n][nh][qk_nope + qk_rope] and V [n][nh][v_head_dim] for the attention. Throws std::invalid_argument when st does
/// not hold that layout.
/// key_mass: as cpu::attention_causal's for the span's last token (optional, [n_tokens after the call], accumulated).
void mla_layer(const ModelConfig& c, const MlaWeights& w, AttentionLayerState& st, const float* x, int64_t T,
               float* out, float* key_mass = nullptr);

/// Checks the shapes of layer lw's mixer tensors (KdaWeights or MlaWeights, under `<p>self_attn.`, p e.g.
/// "layers.3.") against the config; throws std::invalid_argument naming the tensor and both shapes.
void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p);

}  // namespace hypic::engine::families::kimi_linear
