// Layer math several model families share, on the CPU, fp32 (engine/families/<family>/layers.cpp): lightning
// attention (MiniMax, Ring-linear: the same projection and recurrence, each family preparing q and k its own way in
// between), the sigmoid group-limited MoE router (Kimi-Linear, Ring-linear), and the shape checks of the internal
// layout (every family). Part of hypic_engine_core. Shapes and state layouts follow engine/cpu/model.h
// (LinearLayerState::ssm [H][d_k][d_v]); x is a mixer's input [T][hidden] (already normed).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/cpu/model.h"

namespace hypic::engine::families {

/// Throws std::invalid_argument ("Model: tensor <name> has shape [..] (<n> values), expected [..]") unless `t` has
/// exactly `shape` and as many values; what the Model constructor checks every tensor with (all families).
void expect_shape(const Tensor& t, const std::vector<int64_t>& shape, const std::string& name);

}  // namespace hypic::engine::families

namespace hypic::engine::families::shared {

/// The input half of a lightning layer (MiniMaxLightningAttention.forward; Ring's BailingMoeV2 linear attention):
/// [q | k | v] = qkv_proj x [T][3*nh*d], silu'd when linear_qkv_silu, split into q, k, v [T][nh*d] each (resized),
/// nh = num_attention_heads, d = head_dim.
void lightning_qkv(const ModelConfig& c, const LightningWeights& w, const float* x, int64_t T, std::vector<float>& q,
                   std::vector<float>& k, std::vector<float>& v);

/// The output half of a lightning layer, from q, k, v [T][nh*d] as the family prepared them: the scalar-decay
/// recurrence with per-head decay e^{-w.slope[h]} on st.ssm (block-wise over lightning_block_size tokens, or token
/// by token when `recurrent`), group RMSNorm of the output (group_norm_size contiguous groups of nh*d /
/// group_norm_size channels, weight w.norm, eps linear_norm_eps), * sigmoid(gate x), out_proj into out [T][hidden].
/// transition: when not null, receives T_C as one scalar per head [nh].
void lightning_output(const ModelConfig& c, const LightningWeights& w, LinearLayerState& st, const float* x,
                      int64_t T, const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                      bool recurrent, std::vector<float>* transition, float* out);

/// Sigmoid, group-limited top-k routing (KimiLinearTopkRouter, DeepSeek-V3 style; Ring's BailingMoeV2 router): fp32
/// logits x W^T, scores s = sigmoid(logits), choice by s + bias (when router_bias): the n_group groups scored by the
/// sum of their top-2, the topk_group best kept, then the top-k experts among them; weights = the unbiased s of the
/// chosen experts, divided by (their sum + 1e-20) when norm_topk_prob, times routed_scaling_factor.
/// routed[e] receives (token, weight) for every token routed to expert e, in token order.
void route_sigmoid(const ModelConfig& c, const MoeWeights& w, const float* x, int64_t T,
                   std::vector<std::vector<std::pair<int64_t, float>>>& routed);

/// Shapes of a lightning layer's tensors under prefix `q` (e.g. "layers.3.self_attn."): qkv_proj [3*nh*d, H],
/// gate [nh*d, H], norm [nh*d], out_proj [H, nh*d], slope_rate [nh]. Throws as expect_shape.
void check_lightning_shapes(const ModelConfig& c, const LightningWeights& w, const std::string& q);

/// Shapes of a plain GQA softmax layer (MiniMax, Ring) under prefix `q`: q_proj [nh*hd, H], k_proj / v_proj
/// [nkv*hd, H], o_proj [H, nh*hd], and q_norm / k_norm [hd] when use_qk_norm. Throws as expect_shape.
void check_attention_shapes(const ModelConfig& c, const AttentionWeights& a, const std::string& q);

}  // namespace hypic::engine::families::shared
