// config.json of MiniMax: parsing, validation, serialisation. Contracts and field names: minimax/config.h.
#include "engine/families/minimax/config.h"

#include <string>
#include <vector>

#include "engine/checkpoint/config_internal.h"
#include "engine/families/shared/config.h"

namespace hypic::engine::families::minimax {

using namespace config_detail;
using shared::get_alias;

void parse_config(const json& t, std::string_view o, ModelConfig& c) {
  shared::parse_common_fields(t, o, ModelFamily::MiniMax, c);
  c.rms_norm_eps = get_or<double>(t, o, "rms_norm_eps", 1e-5);
  c.linear_norm_eps = 1e-6;  // MiniMaxLightningAttention: MiniMaxRMSNorm(H * D) with its default eps
  c.max_position_embeddings = get_or<int64_t>(t, o, "max_position_embeddings", 0);
  c.tie_word_embeddings = get_or<bool>(t, o, "tie_word_embeddings", false);
  if (auto it = t.find("sliding_window"); it != t.end() && !it->is_null())
    throw field_error(o, "sliding_window", "is set (" + it->dump() + "); sliding-window attention is not supported");
  if (!get_or<bool>(t, o, "postnorm", true))
    throw field_error(o, "postnorm", "is false; MiniMaxDecoderLayer (transformers) is post-norm only");

  shared::parse_gqa_heads(t, o, 8, c);
  c.attn_output_gate = false;
  c.use_qk_norm = false;
  // MiniMaxRotaryEmbedding rotates the whole head (compute_default_rope_parameters uses dim = head_dim).
  c.rope_theta = 1000000.0;
  parse_rope(t, o, c);
  c.partial_rotary_factor = 1.0;

  c.linear_num_key_heads = c.linear_num_value_heads = c.num_attention_heads;
  c.linear_key_head_dim = c.linear_value_head_dim = c.head_dim;
  c.linear_conv_kernel_dim = 0;
  c.linear_qkv_silu = true;  // qkv_states = act_fn(qkv_proj(x))
  c.lightning_block_size = get_or<int>(t, o, "block_size", 256);

  c.full_attn_alpha = get_alias<double>(t, o, {"full_attn_alpha_factor", "layernorm_full_attention_alpha"}, 1.0);
  c.full_attn_beta = get_alias<double>(t, o, {"full_attn_beta_factor", "layernorm_full_attention_beta"}, 1.0);
  c.linear_attn_alpha =
      get_alias<double>(t, o, {"linear_attn_alpha_factor", "layernorm_linear_attention_alpha"}, 1.0);
  c.linear_attn_beta = get_alias<double>(t, o, {"linear_attn_beta_factor", "layernorm_linear_attention_beta"}, 1.0);
  c.mlp_alpha = get_alias<double>(t, o, {"mlp_alpha_factor", "layernorm_mlp_alpha"}, 1.0);
  c.mlp_beta = get_alias<double>(t, o, {"mlp_beta_factor", "layernorm_mlp_beta"}, 1.0);

  if (!parse_layer_types_list(t, o, c)) {
    if (auto it = t.find("attn_type_list"); it != t.end() && !it->is_null()) {
      const auto list = get_or<std::vector<int>>(t, o, "attn_type_list", {});
      if (int(list.size()) != c.num_hidden_layers)
        throw field_error(o, "attn_type_list",
                          "has " + std::to_string(list.size()) + " entries but num_hidden_layers is " +
                              std::to_string(c.num_hidden_layers));
      for (int a : list) {
        if (a != 0 && a != 1) throw field_error(o, "attn_type_list", "has entry " + std::to_string(a) + " (0 or 1)");
        c.layer_types.push_back(a == 1 ? LayerType::FullAttention : LayerType::Linear);
      }
    } else {
      for (int i = 0; i < c.num_hidden_layers; ++i)
        c.layer_types.push_back((i + 1) % 2 != 0 ? LayerType::FullAttention : LayerType::Linear);
    }
  }

  // MiniMaxSparseMoeBlock: softmax router, top-k always renormalised, experts of width intermediate_size.
  c.num_experts = get_alias<int>(t, o, {"num_local_experts", "num_experts"}, 8);
  c.num_experts_per_tok = get_or<int>(t, o, "num_experts_per_tok", 2);
  c.intermediate_size = get_or<int64_t>(t, o, "intermediate_size", 14336);
  c.moe_intermediate_size = c.intermediate_size;
  c.shared_expert_intermediate_size = 0;
  c.shared_expert_gated = false;
  c.norm_topk_prob = true;
  c.router_score = RouterScore::Softmax;
  if (c.num_experts <= 0) throw field_error(o, "num_local_experts", "must be > 0 (every MiniMax layer is MoE)");
}

void validate_config(const ModelConfig& c, const std::string& o) {
  shared::validate_common_fields(c, o, 1);
  shared::check_lightning(c, o);
  if (c.shared_expert_intermediate_size != 0)
    throw field_error(o, "shared_expert_intermediate_size", "must be 0: MiniMax has no shared expert");
}

std::string config_to_json(const ModelConfig& c) {
  json t = shared::config_json_base(c);
  t["architectures"] = {"MiniMaxForCausalLM"};
  t["head_dim"] = c.head_dim;
  t["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
  t["block_size"] = c.lightning_block_size;
  t["num_local_experts"] = c.num_experts;
  t["num_experts_per_tok"] = c.num_experts_per_tok;
  t["full_attn_alpha_factor"] = c.full_attn_alpha;
  t["full_attn_beta_factor"] = c.full_attn_beta;
  t["linear_attn_alpha_factor"] = c.linear_attn_alpha;
  t["linear_attn_beta_factor"] = c.linear_attn_beta;
  t["mlp_alpha_factor"] = c.mlp_alpha;
  t["mlp_beta_factor"] = c.mlp_beta;
  return t.dump(2) + "\n";
}

}  // namespace hypic::engine::families::minimax
