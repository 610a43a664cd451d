// config.json of Qwen3-Next / Qwen3.5 / Qwen3.5-MoE: parsing and serialisation. Contracts and field names:
// qwen/config.h.
#include "engine/families/qwen/config.h"

#include <string>
#include <vector>

#include "engine/checkpoint/config_internal.h"
#include "engine/families/shared/config.h"

namespace hypic::engine::families::qwen {

using namespace config_detail;

bool is_qwen35_dense(std::string_view t) { return t == "qwen3_5" || t == "qwen3_5_text"; }
bool is_nested(std::string_view t) { return t == "qwen3_5" || t == "qwen3_5_moe"; }

void parse_config(const json& root, std::string_view origin, ModelConfig& c) {
  // Nested Qwen3.5 configs keep the language model's fields in text_config.
  const json* t = &root;
  std::string text_origin(origin);
  if (is_nested(c.model_type)) {
    auto it = root.find("text_config");
    if (it == root.end() || !it->is_object())
      throw field_error(origin, "text_config",
                        "is missing or not an object (required for model_type " + c.model_type + ")");
    t = &*it;
    text_origin += " text_config";
    const std::string want = c.model_type + "_text";
    const std::string inner = get_or<std::string>(*t, text_origin, "model_type", want);
    if (inner != want) throw field_error(text_origin, "model_type", "is '" + inner + "', expected '" + want + "'");
  }
  const std::string_view o = text_origin;

  c.vocab_size = get_required<int64_t>(*t, o, "vocab_size");
  c.hidden_size = get_required<int64_t>(*t, o, "hidden_size");
  c.num_hidden_layers = get_required<int>(*t, o, "num_hidden_layers");
  // Before layer_types is derived from it (a loop of num_hidden_layers steps).
  require_positive(o, "num_hidden_layers", c.num_hidden_layers);
  require_at_most(o, "num_hidden_layers", c.num_hidden_layers, kMaxLayers);
  c.rms_norm_eps = get_or<double>(*t, o, "rms_norm_eps", 1e-6);
  c.max_position_embeddings = get_or<int64_t>(*t, o, "max_position_embeddings", 0);

  shared::require_silu_no_bias(*t, o);

  c.num_attention_heads = get_required<int>(*t, o, "num_attention_heads");
  c.num_key_value_heads = get_or<int>(*t, o, "num_key_value_heads", c.num_attention_heads);
  // Qwen3NextConfig / Qwen3_5TextConfig declare head_dim with default 256 (not hidden / heads).
  c.head_dim = get_or<int>(*t, o, "head_dim", 256);
  // Qwen3NextAttention always gates its output; Qwen3.5 reads attn_output_gate (default true).
  c.attn_output_gate = c.model_type == "qwen3_next" || get_or<bool>(*t, o, "attn_output_gate", true);
  parse_rope(*t, o, c);

  c.linear_num_key_heads = get_required<int>(*t, o, "linear_num_key_heads");
  c.linear_num_value_heads = get_required<int>(*t, o, "linear_num_value_heads");
  c.linear_key_head_dim = get_required<int>(*t, o, "linear_key_head_dim");
  c.linear_value_head_dim = get_required<int>(*t, o, "linear_value_head_dim");
  c.linear_conv_kernel_dim = get_or<int>(*t, o, "linear_conv_kernel_dim", 4);

  c.intermediate_size = get_or<int64_t>(*t, o, "intermediate_size", 0);
  if (is_qwen35_dense(c.model_type)) {
    if (get_or<int>(*t, o, "num_experts", 0) != 0)
      throw field_error(o, "num_experts", "is set but model_type " + c.model_type + " is the dense Qwen3.5");
  } else {
    c.num_experts = get_required<int>(*t, o, "num_experts");
    c.num_experts_per_tok = get_required<int>(*t, o, "num_experts_per_tok");
    c.moe_intermediate_size = get_required<int64_t>(*t, o, "moe_intermediate_size");
    c.shared_expert_intermediate_size = get_or<int64_t>(*t, o, "shared_expert_intermediate_size", 0);
    if (c.model_type == "qwen3_next") {
      c.norm_topk_prob = get_or<bool>(*t, o, "norm_topk_prob", true);
      c.decoder_sparse_step = get_or<int>(*t, o, "decoder_sparse_step", 1);
      c.mlp_only_layers = get_or<std::vector<int>>(*t, o, "mlp_only_layers", {});
    } else {
      // Qwen3.5-MoE: every layer is sparse and the router always renormalises (Qwen3VLMoeTextTopKRouter).
      c.norm_topk_prob = true;
      c.decoder_sparse_step = 1;
    }
  }

  // tie_word_embeddings: nested configs carry it at the top level (Qwen3_5Config); fall back to text_config.
  c.tie_word_embeddings = get_or<bool>(*t, o, "tie_word_embeddings", false);
  if (is_nested(c.model_type))
    c.tie_word_embeddings = get_or<bool>(root, origin, "tie_word_embeddings", c.tie_word_embeddings);

  if (!parse_layer_types_list(*t, o, c)) {
    const int interval = get_or<int>(*t, o, "full_attention_interval", 4);
    if (interval <= 0) throw field_error(o, "full_attention_interval", "must be > 0, got " + std::to_string(interval));
    for (int i = 0; i < c.num_hidden_layers; ++i)
      c.layer_types.push_back((i + 1) % interval == 0 ? LayerType::FullAttention : LayerType::Linear);
  }
}

std::string config_to_json(const ModelConfig& c) {
  json t = common_config_json(c);
  t["attention_bias"] = false;
  t["head_dim"] = c.head_dim;
  t["rope_parameters"] = {
      {"rope_type", "default"}, {"rope_theta", c.rope_theta}, {"partial_rotary_factor", c.partial_rotary_factor}};
  if (c.model_type != "qwen3_next") t["attn_output_gate"] = c.attn_output_gate;
  t["linear_num_key_heads"] = c.linear_num_key_heads;
  t["linear_num_value_heads"] = c.linear_num_value_heads;
  t["linear_key_head_dim"] = c.linear_key_head_dim;
  t["linear_value_head_dim"] = c.linear_value_head_dim;
  t["linear_conv_kernel_dim"] = c.linear_conv_kernel_dim;
  if (c.intermediate_size > 0) t["intermediate_size"] = c.intermediate_size;
  // Every type but the dense Qwen3.5 requires the MoE fields, even with num_experts = 0 (a dense qwen3_next): leaving
  // them out made such a config unreadable by parse_config.
  if (c.num_experts > 0 || !is_qwen35_dense(c.model_type)) {
    t["num_experts"] = c.num_experts;
    t["num_experts_per_tok"] = c.num_experts_per_tok;
    t["moe_intermediate_size"] = c.moe_intermediate_size;
    t["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
    if (c.model_type == "qwen3_next") {
      t["norm_topk_prob"] = c.norm_topk_prob;
      t["decoder_sparse_step"] = c.decoder_sparse_step;
      t["mlp_only_layers"] = c.mlp_only_layers;
    }
  }
  t["tie_word_embeddings"] = c.tie_word_embeddings;

  json root;
  if (is_nested(c.model_type)) {
    t["model_type"] = c.model_type + "_text";
    root["model_type"] = c.model_type;
    root["architectures"] = {c.model_type == "qwen3_5" ? "Qwen3_5ForConditionalGeneration"
                                                       : "Qwen3_5MoeForConditionalGeneration"};
    root["tie_word_embeddings"] = c.tie_word_embeddings;
    root["text_config"] = t;
  } else {
    root = t;
    root["model_type"] = c.model_type;
    const char* arch = c.model_type == "qwen3_next"     ? "Qwen3NextForCausalLM"
                       : c.model_type == "qwen3_5_text" ? "Qwen3_5ForCausalLM"
                                                        : "Qwen3_5MoeForCausalLM";
    root["architectures"] = {arch};
  }
  return root.dump(2) + "\n";
}

}  // namespace hypic::engine::families::qwen
