// config.json of MiniMax-Text-01 (model_type `minimax`, transformers 5.17 MiniMaxConfig; also the original
// MiniMax-Text-01 names). Part of hypic_engine_base; the entry points are parse_config / ModelConfig::validate /
// config_to_json (engine/checkpoint/config.h), which dispatch here by family. How the fields map onto ModelConfig:
//  - lightning layers (MiniMaxLightningAttention): num_attention_heads heads of head_dim (default hidden_size /
//    num_attention_heads) for q, k and v (linear_* fields set to match), silu on qkv, block_size (256), the output
//    RMSNorm's eps 1e-6 (linear_norm_eps), no short conv;
//  - softmax layers (MiniMaxAttention): GQA with num_key_value_heads (8), RoPE over the whole head (rope_theta 1e6);
//  - layer kinds from `layer_types`, else `attn_type_list` (0 lightning, 1 softmax), else layer i full iff i even;
//  - post-norm residuals x = alpha * norm(x) + beta * f(norm(x)) with {full_attn,linear_attn,mlp}_{alpha,beta}_factor
//    (or layernorm_{full_attention,linear_attention,mlp}_{alpha,beta});
//  - MiniMaxSparseMoeBlock on every layer: softmax router, num_local_experts | num_experts experts of width
//    intermediate_size, top-k always renormalised, no shared expert.
// Refused: sliding_window, postnorm false, hidden_act other than silu, attention_bias.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "engine/checkpoint/config.h"

namespace hypic::engine::families::minimax {

/// Parses config object `t` (the config.json root; model_type already in c) into c as above. ModelConfig::validate
/// is run by the caller. Throws std::invalid_argument naming `origin` and the field.
void parse_config(const nlohmann::json& t, std::string_view origin, ModelConfig& c);

/// MiniMax's part of ModelConfig::validate: the shared non-Qwen checks, the lightning-layer geometry
/// (shared::check_lightning), no shared expert.
void validate_config(const ModelConfig& c, const std::string& origin);

/// config.json as transformers 5.17 writes MiniMaxConfig (rope_parameters, block_size, num_local_experts, the six
/// *_factor residual weights), architectures MiniMaxForCausalLM.
std::string config_to_json(const ModelConfig& c);

}  // namespace hypic::engine::families::minimax
