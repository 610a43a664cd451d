// config.json of Kimi-Linear (model_type `kimi_linear`, transformers 5.17 KimiLinearConfig; the released
// moonshotai/Kimi-Linear-48B-A3B-Instruct config.json). Part of hypic_engine_base; the entry points are
// parse_config / ModelConfig::validate / config_to_json (engine/checkpoint/config.h), which dispatch here by family.
// How the fields map onto ModelConfig:
//  - MLA (KimiLinearAttention, NoPE): num_attention_heads = num_key_value_heads heads, q_lora_rank (0 / null: a plain
//    q_proj), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim (head_dim = their sum), v_head_dim.
//  - KDA (KimiLinearDeltaAttention): linear_num_{key,value}_heads = linear_attn_config.num_heads, linear_{key,value}
//    _head_dim = linear_attn_config.head_dim, linear_conv_kernel_dim = short_conv_kernel_size; layer kinds from
//    `layer_types`, else the 1-based lists kda_layers / full_attn_layers, else every 4th layer (from 1) full.
//  - MoE (KimiLinearMoE): sigmoid router with e_score_correction_bias, group-limited top-k, ungated shared experts of
//    num_shared_experts * moe_intermediate_size; dense layers from mlp_layer_types, else first_k_dense_replace and
//    moe_layer_freq. lm_head is never tied (KimiLinearForCausalLM._tied_weights_keys is empty).
// attribute_map aliases are accepted both ways (the name transformers writes first): num_experts | num_local_experts,
// num_experts_per_token | num_experts_per_tok, num_shared_experts | n_shared_experts, moe_renormalize |
// norm_topk_prob, num_expert_group | n_group, model_max_length | max_position_embeddings.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "engine/checkpoint/config.h"

namespace hypic::engine::families::kimi_linear {

/// Parses config object `t` (the config.json root; model_type already in c) into c: family, sizes, layer kinds, MLA,
/// KDA and MoE fields as above. ModelConfig::validate is run by the caller. Throws std::invalid_argument naming
/// `origin` and the field (also for what transformers 5.17 cannot run: mla_use_nope false, a non-sigmoid router,
/// num_key_value_heads != num_attention_heads, hidden_act other than silu, attention_bias).
void parse_config(const nlohmann::json& t, std::string_view origin, ModelConfig& c);

/// Kimi-Linear's part of ModelConfig::validate: the shared non-Qwen checks (two experts a group at least:
/// KimiLinearTopkRouter takes each group's top-2), MLA sizes (kv_lora_rank, v_head_dim > 0, head_dim =
/// qk_nope + qk_rope, num_key_value_heads = num_attention_heads), KDA's equal key / value heads and dims, a sigmoid
/// router with ungated shared experts.
void validate_config(const ModelConfig& c, const std::string& origin);

/// config.json as transformers 5.17 writes KimiLinearConfig (flat linear_num_heads / linear_head_dim /
/// linear_conv_kernel_dim, explicit layer_types and mlp_layer_types), architectures KimiLinearForCausalLM.
std::string config_to_json(const ModelConfig& c);

}  // namespace hypic::engine::families::kimi_linear
