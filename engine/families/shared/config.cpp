// Config helpers the Kimi-Linear, MiniMax and Ring-linear parsers share. Contracts: shared/config.h.
#include "engine/families/shared/config.h"

#include <cmath>
#include <cstdio>
#include <string>

namespace hypic::engine::families::shared {

using namespace config_detail;

void parse_common_fields(const json& t, std::string_view o, ModelFamily family, ModelConfig& c) {
  c.family = family;
  c.vocab_size = get_required<int64_t>(t, o, "vocab_size");
  c.hidden_size = get_required<int64_t>(t, o, "hidden_size");
  c.num_hidden_layers = get_required<int>(t, o, "num_hidden_layers");
  require_positive(o, "vocab_size", c.vocab_size);
  require_positive(o, "hidden_size", c.hidden_size);
  require_positive(o, "num_hidden_layers", c.num_hidden_layers);
  require_at_most(o, "num_hidden_layers", c.num_hidden_layers, kMaxLayers);
  require_at_most(o, "hidden_size", c.hidden_size, kMaxHidden);
  require_silu_no_bias(t, o);
}

void require_silu_no_bias(const json& t, std::string_view o) {
  const std::string act = get_or<std::string>(t, o, "hidden_act", "silu");
  if (act != "silu") throw field_error(o, "hidden_act", "is '" + act + "'; only silu is supported");
  if (get_or<bool>(t, o, "attention_bias", false))
    throw field_error(o, "attention_bias", "is true; attention projections with bias are not supported");
}

void parse_gqa_heads(const json& t, std::string_view o, int default_kv_heads, ModelConfig& c) {
  c.num_attention_heads = get_required<int>(t, o, "num_attention_heads");
  require_positive(o, "num_attention_heads", c.num_attention_heads);
  require_at_most(o, "num_attention_heads", c.num_attention_heads, kMaxHeads);
  c.num_key_value_heads = get_or<int>(t, o, "num_key_value_heads", default_kv_heads);
  if (t.contains("head_dim") && !t["head_dim"].is_null()) {
    c.head_dim = get_required<int>(t, o, "head_dim");
  } else {
    require_multiple(o, "hidden_size", c.hidden_size, "num_attention_heads", c.num_attention_heads);
    c.head_dim = static_cast<int>(c.hidden_size / c.num_attention_heads);
  }
}

void validate_common_fields(const ModelConfig& c, const std::string& o, int min_experts_per_group) {
  for (const auto& [field, v] : {std::pair<const char*, double>{"full_attn_alpha_factor", c.full_attn_alpha},
                                 {"full_attn_beta_factor", c.full_attn_beta},
                                 {"linear_attn_alpha_factor", c.linear_attn_alpha},
                                 {"linear_attn_beta_factor", c.linear_attn_beta},
                                 {"mlp_alpha_factor", c.mlp_alpha},
                                 {"mlp_beta_factor", c.mlp_beta}})
    if (!std::isfinite(v)) throw field_error(o, field, "must be finite");
  if (c.attn_output_gate) throw field_error(o, "attn_output_gate", "is only supported by the Qwen families");
  if (c.router_score == RouterScore::Sigmoid) check_sigmoid_router(c, o, min_experts_per_group);
}

void check_sigmoid_router(const ModelConfig& c, const std::string& o, int min_experts_per_group) {
  bool any_moe = false;
  for (int i = 0; i < c.num_hidden_layers; ++i) any_moe |= c.is_moe_layer(i);
  if (!any_moe) return;
  if (c.n_group <= 0) throw field_error(o, "n_group", "must be > 0, got " + std::to_string(c.n_group));
  require_multiple(o, "num_experts", c.num_experts, "n_group", c.n_group);
  if (c.num_experts / c.n_group < min_experts_per_group)
    throw field_error(o, "n_group",
                      std::to_string(c.n_group) + " leaves fewer than " + std::to_string(min_experts_per_group) +
                          " experts per group (the group score is the sum of its top-2 scores)");
  if (c.topk_group <= 0 || c.topk_group > c.n_group)
    throw field_error(o, "topk_group", std::to_string(c.topk_group) + " must be in [1, n_group " +
                                           std::to_string(c.n_group) + "]");
  if (int64_t(c.num_experts_per_tok) > int64_t(c.topk_group) * (c.num_experts / c.n_group))
    throw field_error(o, "num_experts_per_tok",
                      std::to_string(c.num_experts_per_tok) + " exceeds the experts of topk_group groups (" +
                          std::to_string(int64_t(c.topk_group) * (c.num_experts / c.n_group)) + ")");
  if (!std::isfinite(c.routed_scaling_factor) || !(c.routed_scaling_factor > 0))
    throw field_error(o, "routed_scaling_factor", "must be finite and > 0");
}

void check_lightning(const ModelConfig& c, const std::string& o) {
  if (c.num_linear_layers() == 0) return;
  if (c.linear_num_key_heads != c.num_attention_heads || c.linear_num_value_heads != c.num_attention_heads ||
      c.linear_key_head_dim != c.head_dim || c.linear_value_head_dim != c.head_dim)
    throw field_error(o, "linear_num_key_heads",
                      "lightning layers have num_attention_heads heads of head_dim (got nk " +
                          std::to_string(c.linear_num_key_heads) + ", nv " + std::to_string(c.linear_num_value_heads) +
                          ", dk " + std::to_string(c.linear_key_head_dim) + ", dv " +
                          std::to_string(c.linear_value_head_dim) + ")");
  require_positive(o, "head_dim", c.head_dim);
  if (c.lightning_block_size <= 0)
    throw field_error(o, "block_size", "must be > 0, got " + std::to_string(c.lightning_block_size));
  if (c.group_norm_size <= 0)
    throw field_error(o, "group_norm_size", "must be > 0, got " + std::to_string(c.group_norm_size));
  if (int64_t(c.num_attention_heads) * c.head_dim % c.group_norm_size != 0)
    throw field_error(o, "group_norm_size",
                      std::to_string(c.group_norm_size) + " must divide num_attention_heads * head_dim = " +
                          std::to_string(int64_t(c.num_attention_heads) * c.head_dim) + " (it is the number of groups)");
}

json config_json_base(const ModelConfig& c) {
  json t = common_config_json(c);
  t["model_type"] = c.model_type;
  t["tie_word_embeddings"] = c.tie_word_embeddings;
  t["intermediate_size"] = c.intermediate_size;
  return t;
}

namespace {
std::string dbl(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
}  // namespace

std::string fingerprint_fields(const ModelConfig& c) {
  std::string s = "|family=" + std::string(model_family_name(c.family));
  auto add_i = [&](const char* k, int64_t v) { s += "|" + std::string(k) + "=" + std::to_string(v); };
  auto add_d = [&](const char* k, double v) { s += "|" + std::string(k) + "=" + dbl(v); };
  add_i("qknorm", c.use_qk_norm);
  add_i("qlora", c.q_lora_rank);
  add_i("kvlora", c.kv_lora_rank);
  add_i("nope", c.qk_nope_head_dim);
  add_i("rope", c.qk_rope_head_dim);
  add_i("vhd", c.v_head_dim);
  add_d("leps", c.linear_norm_eps);
  add_i("block", c.lightning_block_size);
  add_i("gns", c.group_norm_size);
  add_i("lrope", c.linear_rope);
  add_i("lsilu", c.linear_qkv_silu);
  add_i("router", static_cast<int>(c.router_score));
  add_i("rbias", c.router_bias);
  add_i("ngroup", c.n_group);
  add_i("topkgroup", c.topk_group);
  add_d("rscale", c.routed_scaling_factor);
  add_i("sgate", c.shared_expert_gated);
  add_d("fa_a", c.full_attn_alpha);
  add_d("fa_b", c.full_attn_beta);
  add_d("la_a", c.linear_attn_alpha);
  add_d("la_b", c.linear_attn_beta);
  add_d("mlp_a", c.mlp_alpha);
  add_d("mlp_b", c.mlp_beta);
  return s;
}

}  // namespace hypic::engine::families::shared
