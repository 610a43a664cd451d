// config.json of Ring-linear-2.0 (model_type `bailing_moe_linear`, inclusionAI/Ring-mini-linear-2.0 and
// Ring-flash-linear-2.0: the hub config.json, BailingMoeLinearV2ForCausalLM; not in transformers). Part of
// hypic_engine_base; the entry points are parse_config / ModelConfig::validate / config_to_json
// (engine/checkpoint/config.h), which dispatch here by family. How the fields map onto ModelConfig:
//  - lightning layers (simple GLA): num_attention_heads heads of head_dim (default hidden_size / num_attention_heads)
//    for q, k and v, silu on qkv when linear_silu | use_linear_silu, RoPE when linear_rope (true), group RMSNorm of
//    group_norm_size (4) groups, block 64, no short conv;
//  - softmax layers: GQA with num_key_value_heads (4), qk-norm when use_qk_norm (true), partial RoPE
//    (partial_rotary_factor 0.5, rope_theta 600000);
//  - layer kinds from `layer_types`, else every layer_group_size-th (5) layer full, and every layer after the last
//    whole group;
//  - BailingMoeV2 MoE: sigmoid scores, expert bias (moe_router_enable_expert_bias), group-limited top-k,
//    routed_scaling_factor, num_shared_experts ungated shared experts of moe_shared_expert_intermediate_size; dense
//    SwiGLU below first_k_dense_replace, and everywhere when num_experts <= 1.
// Refused: use_qkv_bias, use_bias, use_rmsnorm false, norm_head, a router_dtype other than fp32, a score_function
// other than sigmoid, hidden_act other than silu, attention_bias.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "engine/checkpoint/config.h"

namespace hypic::engine::families::ring_linear {

/// Parses config object `t` (the config.json root; model_type already in c) into c as above. ModelConfig::validate
/// is run by the caller. Throws std::invalid_argument naming `origin` and the field.
void parse_config(const nlohmann::json& t, std::string_view origin, ModelConfig& c);

/// Ring's part of ModelConfig::validate: the shared non-Qwen checks (one expert a group suffices: the router takes
/// the top-1 of a group of one) and the lightning-layer geometry (shared::check_lightning).
void validate_config(const ModelConfig& c, const std::string& origin);

/// config.json in the hub config.json's field layout, architectures BailingMoeLinearV2ForCausalLM.
std::string config_to_json(const ModelConfig& c);

}  // namespace hypic::engine::families::ring_linear
