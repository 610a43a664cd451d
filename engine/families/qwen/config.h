// config.json of the Qwen hybrid families: Qwen3-Next (model_type `qwen3_next`, transformers 5.17
// Qwen3NextConfig, flat) and Qwen3.5 / Qwen3.5-MoE (`qwen3_5`, `qwen3_5_moe`: Qwen3_5Config / Qwen3_5MoeConfig with
// the language model's fields in `text_config`; `qwen3_5_text`, `qwen3_5_moe_text`: Qwen3_5TextConfig /
// Qwen3_5MoeTextConfig saved flat). Part of hypic_engine_base; the entry points are parse_config /
// ModelConfig::validate / config_to_json (engine/checkpoint/config.h), which dispatch here by family. Gated DeltaNet
// fields are read as named (linear_num_{key,value}_heads, linear_{key,value}_head_dim, linear_conv_kernel_dim 4);
// attention: head_dim (256, not hidden / heads), attn_output_gate (always on for qwen3_next, default true for
// Qwen3.5); layer kinds from `layer_types`, else layer i full iff (i + 1) % full_attention_interval (4) == 0; MoE
// fields required except for the dense Qwen3.5 (num_experts must then be absent or 0); Qwen3.5-MoE always
// renormalises and has every layer sparse (Qwen3VLMoeTextTopKRouter), Qwen3-Next reads norm_topk_prob,
// decoder_sparse_step and mlp_only_layers. Qwen adds no checks to ModelConfig::validate's common ones.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "engine/checkpoint/config.h"

namespace hypic::engine::families::qwen {

/// Whether model_type keeps its fields in `text_config` (qwen3_5, qwen3_5_moe), and so its checkpoint its language
/// model under `model.language_model.`.
bool is_nested(std::string_view model_type);
/// The dense Qwen3.5 (qwen3_5, qwen3_5_text): no MoE fields.
bool is_qwen35_dense(std::string_view model_type);

/// Parses the config.json `root` of a Qwen model (c.model_type already set to one of the five types) into c, the
/// fields read from `text_config` for the nested types (whose inner model_type must be `<type>_text` when given;
/// tie_word_embeddings from the top level, else text_config). ModelConfig::validate is run by the caller. Throws
/// std::invalid_argument naming `origin` (plus " text_config" inside it) and the field.
void parse_config(const nlohmann::json& root, std::string_view origin, ModelConfig& c);

/// config.json in the layout transformers 5.17 writes (nested types: fields inside `text_config` with model_type
/// `<type>_text`, architectures Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration; flat types:
/// Qwen3NextForCausalLM / Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM), explicit layer_types and rope_parameters.
std::string config_to_json(const ModelConfig& c);

}  // namespace hypic::engine::families::qwen
