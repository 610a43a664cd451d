// Token mixers and MoE routing of the Kimi-Linear, MiniMax and Ring-linear families on the CPU, fp32, as the
// Model (engine/cpu/model.cpp) calls them layer by layer. Internal to the engine; shapes and state layouts follow
// engine/cpu/model.h (LinearLayerState::ssm [H][d_k][d_v], conv tail [K-1][conv_dim]; AttentionLayerState K
// [n][H_kv][head_dim], V [n][H_kv][attn_v_head_dim()]). x is the mixer input [T][hidden] (already normed), out
// [T][hidden] the mixer output (before the residual).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/cpu/model.h"

namespace hypic::engine::families {

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
/// head), causal softmax attention with scale (qk_nope + qk_rope)^-1/2, o_proj. Appends the span's expanded K
/// [T][nh][qk_nope + qk_rope] and V [T][nh][v_head_dim] to `st` (no rotation: the layer has no positions).
/// key_mass: as cpu::attention_causal's for the span's last token (optional, [n_tokens after the call], accumulated).
void mla_layer(const ModelConfig& c, const MlaWeights& w, AttentionLayerState& st, const float* x, int64_t T,
               float* out, float* key_mass = nullptr);

/// Lightning layer. MiniMax (MiniMaxLightningAttention.forward): [q | k | v] = silu(qkv_proj x) per head, the
/// scalar-decay recurrence (block-wise over lightning_block_size tokens, or token by token when `recurrent`),
/// RMSNorm over H*d (eps linear_norm_eps), * sigmoid(output_gate x), out_proj. Ring (BailingMoeV2 linear attention,
/// docs/research/hybrid_models.md 3.3, tools/ring_linear_reference.py): [q | k | v] = query_key_value x (silu'd when
/// linear_qkv_silu), per-head RMSNorm of q and k (use_qk_norm), partial NeoX RoPE at positions start_position..
/// (linear_rope; `inv_freq` over rotary_dim()), q *= d^-1/2, the same recurrence, group RMSNorm (group_norm_size
/// contiguous groups of H*d / group_norm_size channels), * sigmoid(g_proj x), dense.
/// transition: when not null, receives T_C as one scalar per head [H].
void lightning_layer(const ModelConfig& c, const LightningWeights& w, LinearLayerState& st, const float* x,
                     int64_t T, int64_t start_position, const std::vector<float>& inv_freq, bool recurrent,
                     std::vector<float>* transition, float* out);

/// Sigmoid, group-limited top-k routing (KimiLinearTopkRouter, DeepSeek-V3 style; Ring's router): fp32 logits
/// x W^T, scores s = sigmoid(logits), choice by s + bias (when router_bias): the n_group groups scored by the sum of
/// their top-2, the topk_group best kept, then the top-k experts among them; weights = the unbiased s of the chosen
/// experts, divided by (their sum + 1e-20) when norm_topk_prob, times routed_scaling_factor.
/// routed[e] receives (token, weight) for every token routed to expert e, in token order.
void route_sigmoid(const ModelConfig& c, const MoeWeights& w, const float* x, int64_t T,
                   std::vector<std::vector<std::pair<int64_t, float>>>& routed);

/// Throws std::invalid_argument ("Model: tensor <name> has shape [..] (<n> values), expected [..]") unless `t` has
/// exactly `shape` and as many values; what the Model constructor checks every tensor with (all families).
void expect_shape(const Tensor& t, const std::vector<int64_t>& shape, const std::string& name);

/// Checks the shapes of layer `i`'s family tensors (mixer and MoE router bias) against the config; throws
/// std::invalid_argument naming the tensor (prefix `p`, e.g. "layers.3.") and both shapes.
void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p);

}  // namespace hypic::engine::families
