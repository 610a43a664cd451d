// config.json helpers several model families share (engine/families/<family>/config.cpp): aliased field names, the
// fields and checks every non-Qwen family (Kimi-Linear, MiniMax, Ring-linear) has, the lightning-layer and
// sigmoid-router consistency checks, and the fingerprint text of the fields only those families use. Part of
// hypic_engine_base (no model math). Not a public API: the entry points are parse_config / ModelConfig::validate /
// config_to_json / ModelConfig::fingerprint (engine/checkpoint/config.h), which dispatch to the families.
#pragma once
#include <initializer_list>
#include <string>
#include <string_view>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/config_internal.h"

namespace hypic::engine::families::shared {

using nlohmann::json;

/// The first of `keys` present (not null) in obj, or nullptr.
inline const char* first_key(const json& obj, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (auto it = obj.find(k); it != obj.end() && !it->is_null()) return k;
  return nullptr;
}

/// config_detail::get_or over aliases (transformers' attribute_map, or a released config's own spelling): the
/// first key present wins; none present -> `fallback`.
template <typename T>
T get_alias(const json& obj, std::string_view origin, std::initializer_list<const char*> keys, T fallback) {
  const char* k = first_key(obj, keys);
  return k ? config_detail::get_or<T>(obj, origin, k, fallback) : fallback;
}

/// Sets c.family and reads the fields every non-Qwen family requires at the top level of config object t:
/// vocab_size, hidden_size, num_hidden_layers (each > 0; layers and hidden within the supported maxima, before any
/// per-layer list is derived from them); then require_silu_no_bias. Throws std::invalid_argument naming origin `o`
/// and the field.
void parse_common_fields(const json& t, std::string_view o, ModelFamily family, ModelConfig& c);

/// Refuses hidden_act other than "silu" and attention_bias = true (absent: silu, no bias).
void require_silu_no_bias(const json& t, std::string_view o);

/// The softmax layers' heads of MiniMax and Ring (plain GQA, whose lightning layers use the same heads):
/// num_attention_heads (required, > 0, within the maximum), num_key_value_heads (default `default_kv_heads`),
/// head_dim (default hidden_size / num_attention_heads, which must then divide).
void parse_gqa_heads(const json& t, std::string_view o, int default_kv_heads, ModelConfig& c);

/// The checks every non-Qwen family's validation starts with: the six MiniMax residual factors finite,
/// attn_output_gate false (a Qwen-only feature), and, with a sigmoid router, check_sigmoid_router.
/// `min_experts_per_group`: what the family's router needs in each of the n_group groups (Kimi-Linear 2, else 1).
void validate_common_fields(const ModelConfig& c, const std::string& o, int min_experts_per_group);

/// Group-limited sigmoid routing (KimiLinearTopkRouter; Ring's BailingMoeV2 router), when some layer is MoE:
/// n_group > 0 divides num_experts with at least `min_experts_per_group` experts a group, topk_group in
/// [1, n_group], num_experts_per_tok within the experts of topk_group groups, routed_scaling_factor finite and > 0.
void check_sigmoid_router(const ModelConfig& c, const std::string& o, int min_experts_per_group);

/// Lightning layers (MiniMax, Ring), when there are linear layers: num_attention_heads heads of head_dim for both
/// keys and values, head_dim > 0, block size > 0, group_norm_size > 0 dividing num_attention_heads * head_dim.
void check_lightning(const ModelConfig& c, const std::string& o);

/// The start of a non-Qwen family's config.json (config_to_json): common_config_json plus model_type,
/// tie_word_embeddings and intermediate_size; the family adds its own fields.
json config_json_base(const ModelConfig& c);

/// The fingerprint text of the fields only the non-Qwen families use ("|name=value" items, fixed order, doubles as
/// %.17g), appended by ModelConfig::fingerprint for those families.
std::string fingerprint_fields(const ModelConfig& c);

}  // namespace hypic::engine::families::shared
