// config.json of Ring-linear-2.0: parsing, validation, serialisation. Contracts and field names:
// ring_linear/config.h.
#include "engine/families/ring_linear/config.h"

#include <string>

#include "engine/checkpoint/config_internal.h"
#include "engine/families/shared/config.h"

namespace hypic::engine::families::ring_linear {

using namespace config_detail;
using shared::get_alias;

void parse_config(const json& t, std::string_view o, ModelConfig& c) {
  shared::parse_common_fields(t, o, ModelFamily::RingLinear, c);
  if (get_or<bool>(t, o, "use_qkv_bias", false))
    throw field_error(o, "use_qkv_bias", "is true; attention projections with bias are not supported");
  if (get_or<bool>(t, o, "use_bias", false))
    throw field_error(o, "use_bias", "is true; projections with bias are not supported");
  c.rms_norm_eps = get_or<double>(t, o, "rms_norm_eps", 1e-6);
  c.linear_norm_eps = c.rms_norm_eps;
  c.max_position_embeddings = get_or<int64_t>(t, o, "max_position_embeddings", 0);
  c.tie_word_embeddings = get_or<bool>(t, o, "tie_word_embeddings", false);

  shared::parse_gqa_heads(t, o, 4, c);
  if (!get_or<bool>(t, o, "use_rmsnorm", true))
    throw field_error(o, "use_rmsnorm", "is false; only RMSNorm is supported");
  if (get_or<bool>(t, o, "norm_head", false))
    throw field_error(o, "norm_head", "is true; a normalised LM head is not supported");
  const std::string router_dtype = get_or<std::string>(t, o, "router_dtype", "fp32");
  if (router_dtype != "fp32" && router_dtype != "float32")
    throw field_error(o, "router_dtype", "is '" + router_dtype + "'; the CPU path routes in fp32");
  c.attn_output_gate = false;
  c.use_qk_norm = get_or<bool>(t, o, "use_qk_norm", true);
  c.partial_rotary_factor = 0.5;
  c.rope_theta = 600000.0;
  parse_rope(t, o, c);

  c.linear_num_key_heads = c.linear_num_value_heads = c.num_attention_heads;
  c.linear_key_head_dim = c.linear_value_head_dim = c.head_dim;
  c.linear_conv_kernel_dim = 0;
  c.linear_rope = get_or<bool>(t, o, "linear_rope", true);
  c.linear_qkv_silu = get_alias<bool>(t, o, {"linear_silu", "use_linear_silu"}, false);
  c.group_norm_size = get_or<int>(t, o, "group_norm_size", 4);
  c.lightning_block_size = 64;

  if (!parse_layer_types_list(t, o, c)) {
    const int g = get_or<int>(t, o, "layer_group_size", 5);
    if (g <= 0) throw field_error(o, "layer_group_size", "must be > 0, got " + std::to_string(g));
    const int full_groups_end = (c.num_hidden_layers / g) * g;
    for (int i = 0; i < c.num_hidden_layers; ++i)
      c.layer_types.push_back((i + 1) % g == 0 || i >= full_groups_end ? LayerType::FullAttention
                                                                        : LayerType::Linear);
  }

  // BailingMoeV2 MoE: sigmoid scores + expert bias for the choice, group-limited top-k, shared experts.
  c.intermediate_size = get_or<int64_t>(t, o, "intermediate_size", 5120);
  c.num_experts = get_or<int>(t, o, "num_experts", 256);
  c.num_experts_per_tok = get_or<int>(t, o, "num_experts_per_tok", 8);
  c.moe_intermediate_size = get_or<int64_t>(t, o, "moe_intermediate_size", 512);
  const int shared = get_or<int>(t, o, "num_shared_experts", 1);
  if (shared < 0) throw field_error(o, "num_shared_experts", "must be >= 0, got " + std::to_string(shared));
  c.shared_expert_intermediate_size =
      get_or<int64_t>(t, o, "moe_shared_expert_intermediate_size", c.moe_intermediate_size) * shared;
  c.shared_expert_gated = false;
  c.norm_topk_prob = get_or<bool>(t, o, "norm_topk_prob", true);
  c.n_group = get_or<int>(t, o, "n_group", 1);
  c.topk_group = get_or<int>(t, o, "topk_group", 1);
  c.routed_scaling_factor = get_or<double>(t, o, "routed_scaling_factor", 1.0);
  const std::string score = get_or<std::string>(t, o, "score_function", "sigmoid");
  if (score != "sigmoid") throw field_error(o, "score_function", "is '" + score + "'; only sigmoid is supported");
  c.router_score = RouterScore::Sigmoid;
  c.router_bias = get_or<bool>(t, o, "moe_router_enable_expert_bias", true);
  c.decoder_sparse_step = 1;
  // Dense SwiGLU for i < first_k_dense_replace, and everywhere with num_experts <= 1 (the reference's rule).
  const int first_dense = get_or<int>(t, o, "first_k_dense_replace", 1);
  if (first_dense < 0) throw field_error(o, "first_k_dense_replace", "must be >= 0");
  for (int i = 0; i < c.num_hidden_layers; ++i)
    if (i < first_dense || c.num_experts <= 1) c.mlp_only_layers.push_back(i);
}

void validate_config(const ModelConfig& c, const std::string& o) {
  // The router takes the top-1 of a group of one: one expert a group suffices.
  shared::validate_common_fields(c, o, 1);
  shared::check_lightning(c, o);
}

std::string config_to_json(const ModelConfig& c) {
  json t = shared::config_json_base(c);
  t["architectures"] = {"BailingMoeLinearV2ForCausalLM"};
  t["head_dim"] = c.head_dim;
  t["rope_theta"] = c.rope_theta;
  t["partial_rotary_factor"] = c.partial_rotary_factor;
  t["use_qk_norm"] = c.use_qk_norm;
  t["linear_rope"] = c.linear_rope;
  t["linear_silu"] = c.linear_qkv_silu;
  t["group_norm_size"] = c.group_norm_size;
  t["num_experts"] = c.num_experts;
  t["num_experts_per_tok"] = c.num_experts_per_tok;
  t["moe_intermediate_size"] = c.moe_intermediate_size;
  const bool shared = c.shared_expert_intermediate_size > 0;
  t["num_shared_experts"] = shared ? 1 : 0;
  t["moe_shared_expert_intermediate_size"] = shared ? c.shared_expert_intermediate_size : c.moe_intermediate_size;
  t["norm_topk_prob"] = c.norm_topk_prob;
  t["n_group"] = c.n_group;
  t["topk_group"] = c.topk_group;
  t["routed_scaling_factor"] = c.routed_scaling_factor;
  t["score_function"] = "sigmoid";
  t["moe_router_enable_expert_bias"] = c.router_bias;
  int first_dense = 0;
  while (first_dense < c.num_hidden_layers && !c.is_moe_layer(first_dense)) ++first_dense;
  t["first_k_dense_replace"] = c.num_experts > 0 ? first_dense : 0;
  return t.dump(2) + "\n";
}

}  // namespace hypic::engine::families::ring_linear
