// config.json of Kimi-Linear: parsing, validation, serialisation. Contracts and field names: kimi_linear/config.h.
#include "engine/families/kimi_linear/config.h"

#include <string>
#include <utility>
#include <vector>

#include "engine/checkpoint/config_internal.h"
#include "engine/families/shared/config.h"

namespace hypic::engine::families::kimi_linear {

using namespace config_detail;
using shared::get_alias;

void parse_config(const json& t, std::string_view o, ModelConfig& c) {
  shared::parse_common_fields(t, o, ModelFamily::KimiLinear, c);
  c.rms_norm_eps = get_or<double>(t, o, "rms_norm_eps", 1e-5);
  c.linear_norm_eps = c.rms_norm_eps;
  c.max_position_embeddings = get_alias<int64_t>(t, o, {"model_max_length", "max_position_embeddings"}, 0);
  // KimiLinearForCausalLM declares _tied_weights_keys = {}: transformers 5.17 never ties its lm_head, whatever
  // tie_word_embeddings says (the checkpoint holds lm_head.weight).
  c.tie_word_embeddings = false;

  // MLA (KimiLinearAttention). transformers 5.17 applies no rotary embedding in it; the released checkpoints say
  // so with mla_use_nope = true. A config asking for RoPE in MLA describes a model transformers 5.17 cannot run.
  c.num_attention_heads = get_required<int>(t, o, "num_attention_heads");
  c.num_key_value_heads = get_or<int>(t, o, "num_key_value_heads", c.num_attention_heads);
  if (c.num_key_value_heads != c.num_attention_heads)
    throw field_error(o, "num_key_value_heads",
                      std::to_string(c.num_key_value_heads) + " differs from num_attention_heads " +
                          std::to_string(c.num_attention_heads) +
                          " (MLA expands K/V to every query head: KimiLinearAttention needs them equal)");
  if (!get_or<bool>(t, o, "mla_use_nope", true))
    throw field_error(o, "mla_use_nope",
                      "is false: RoPE in MLA is not supported (transformers 5.17 KimiLinearAttention is NoPE)");
  c.q_lora_rank = get_or<int>(t, o, "q_lora_rank", 0);
  c.kv_lora_rank = get_or<int>(t, o, "kv_lora_rank", 512);
  c.qk_nope_head_dim = get_or<int>(t, o, "qk_nope_head_dim", 128);
  c.qk_rope_head_dim = get_or<int>(t, o, "qk_rope_head_dim", 64);
  c.v_head_dim = get_or<int>(t, o, "v_head_dim", 128);
  if (c.qk_nope_head_dim < 0) throw field_error(o, "qk_nope_head_dim", "must be >= 0");
  if (c.qk_rope_head_dim < 0) throw field_error(o, "qk_rope_head_dim", "must be >= 0");
  if (c.q_lora_rank < 0) throw field_error(o, "q_lora_rank", "must be >= 0 (or null)");
  c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
  c.attn_output_gate = false;
  c.use_qk_norm = false;
  c.partial_rotary_factor = 0.0;

  // KDA (KimiLinearDeltaAttention): nk = nv = linear_num_heads, dk = dv = linear_head_dim.
  static const json kEmpty = json::object();
  const json* lac = &kEmpty;
  if (auto it = t.find("linear_attn_config"); it != t.end() && !it->is_null()) {
    if (!it->is_object()) throw field_error(o, "linear_attn_config", "must be an object, got " + it->dump());
    lac = &*it;
  }
  const std::string lo = std::string(o) + " linear_attn_config";
  const int heads = get_or<int>(*lac, lo, "num_heads", get_or<int>(t, o, "linear_num_heads", 32));
  const int hd = get_or<int>(*lac, lo, "head_dim", get_or<int>(t, o, "linear_head_dim", 128));
  c.linear_conv_kernel_dim =
      get_or<int>(*lac, lo, "short_conv_kernel_size", get_or<int>(t, o, "linear_conv_kernel_dim", 4));
  c.linear_num_key_heads = c.linear_num_value_heads = heads;
  c.linear_key_head_dim = c.linear_value_head_dim = hd;

  if (!parse_layer_types_list(t, o, c)) {
    const bool listed = lac->contains("full_attn_layers") && lac->contains("kda_layers");
    if (lac->contains("full_attn_layers") != lac->contains("kda_layers"))
      throw field_error(lo, lac->contains("kda_layers") ? "kda_layers" : "full_attn_layers",
                        std::string("is given without ") +
                            (lac->contains("kda_layers") ? "full_attn_layers" : "kda_layers") +
                            ": give both lists (1-based) or neither");
    if (listed) {
      std::vector<int> assigned(size_t(c.num_hidden_layers), -1);
      for (const auto& [key, type] : {std::pair<const char*, LayerType>{"full_attn_layers", LayerType::FullAttention},
                                      {"kda_layers", LayerType::Linear}}) {
        for (int l : get_or<std::vector<int>>(*lac, lo, key, {})) {
          if (l < 1 || l > c.num_hidden_layers)
            throw field_error(lo, key, "contains layer " + std::to_string(l) + " outside [1, " +
                                           std::to_string(c.num_hidden_layers) + "] (the lists are 1-based)");
          if (assigned[size_t(l - 1)] >= 0)
            throw field_error(lo, key, "lists layer " + std::to_string(l) + " twice");
          assigned[size_t(l - 1)] = static_cast<int>(type);
        }
      }
      for (int i = 0; i < c.num_hidden_layers; ++i) {
        if (assigned[size_t(i)] < 0)
          throw field_error(lo, "kda_layers",
                            "and full_attn_layers leave layer " + std::to_string(i + 1) + " (1-based) unassigned");
        c.layer_types.push_back(static_cast<LayerType>(assigned[size_t(i)]));
      }
    } else {
      for (int i = 0; i < c.num_hidden_layers; ++i)
        c.layer_types.push_back(i != 0 && i % 4 == 0 ? LayerType::FullAttention : LayerType::Linear);
    }
  }

  // MoE (KimiLinearMoE: KimiLinearTopkRouter + experts + ungated shared experts).
  const std::string act = get_or<std::string>(t, o, "moe_router_activation_func", "sigmoid");
  if (act != "sigmoid")
    throw field_error(o, "moe_router_activation_func", "is '" + act + "'; KimiLinearTopkRouter uses sigmoid");
  c.intermediate_size = get_or<int64_t>(t, o, "intermediate_size", 9216);
  c.num_experts = get_alias<int>(t, o, {"num_experts", "num_local_experts"}, 256);
  c.num_experts_per_tok = get_alias<int>(t, o, {"num_experts_per_token", "num_experts_per_tok"}, 8);
  c.moe_intermediate_size = get_or<int64_t>(t, o, "moe_intermediate_size", 1024);
  const int shared = get_alias<int>(t, o, {"num_shared_experts", "n_shared_experts"}, 1);
  if (shared < 0) throw field_error(o, "num_shared_experts", "must be >= 0, got " + std::to_string(shared));
  c.shared_expert_intermediate_size = c.moe_intermediate_size * shared;
  c.shared_expert_gated = false;
  c.norm_topk_prob = get_alias<bool>(t, o, {"moe_renormalize", "norm_topk_prob"}, true);
  c.n_group = get_alias<int>(t, o, {"num_expert_group", "n_group"}, 1);
  c.topk_group = get_or<int>(t, o, "topk_group", 1);
  c.routed_scaling_factor = get_or<double>(t, o, "routed_scaling_factor", 2.446);
  c.router_score = RouterScore::Sigmoid;
  c.router_bias = true;
  c.decoder_sparse_step = 1;
  if (auto it = t.find("mlp_layer_types"); it != t.end() && !it->is_null()) {
    if (!it->is_array() || int(it->size()) != c.num_hidden_layers)
      throw field_error(o, "mlp_layer_types",
                        "must be a list of num_hidden_layers (" + std::to_string(c.num_hidden_layers) +
                            ") strings, got " + it->dump());
    for (int i = 0; i < c.num_hidden_layers; ++i) {
      const json& e = (*it)[size_t(i)];
      const std::string s = e.is_string() ? e.get<std::string>() : e.dump();
      if (s == "dense")
        c.mlp_only_layers.push_back(i);
      else if (s != "sparse")
        throw field_error(o, "mlp_layer_types", "has entry '" + s + "' (expected dense or sparse)");
    }
  } else {
    const int first_dense = get_or<int>(t, o, "first_k_dense_replace", 1);
    const int freq = get_or<int>(t, o, "moe_layer_freq", 1);
    if (first_dense < 0) throw field_error(o, "first_k_dense_replace", "must be >= 0");
    if (freq <= 0) throw field_error(o, "moe_layer_freq", "must be > 0, got " + std::to_string(freq));
    for (int i = 0; i < c.num_hidden_layers; ++i)
      if (i < first_dense || i % freq != 0) c.mlp_only_layers.push_back(i);
  }
  if (c.num_experts <= 0 && int(c.mlp_only_layers.size()) != c.num_hidden_layers)
    throw field_error(o, "num_experts", "must be > 0 when a layer is sparse (mlp_layer_types / first_k_dense_replace)");
}

void validate_config(const ModelConfig& c, const std::string& o) {
  // KimiLinearTopkRouter takes the top-2 of every group (topk(2) fails on groups of one).
  shared::validate_common_fields(c, o, 2);
  if (c.num_attention_layers() > 0) {
    require_positive(o, "kv_lora_rank", c.kv_lora_rank);
    require_positive(o, "v_head_dim", c.v_head_dim);
    if (c.head_dim != c.qk_nope_head_dim + c.qk_rope_head_dim)
      throw field_error(o, "head_dim", "must equal qk_nope_head_dim + qk_rope_head_dim for MLA");
    if (c.num_key_value_heads != c.num_attention_heads)
      throw field_error(o, "num_key_value_heads", "must equal num_attention_heads for MLA");
  }
  if (c.num_linear_layers() > 0 &&
      (c.linear_num_key_heads != c.linear_num_value_heads || c.linear_key_head_dim != c.linear_value_head_dim))
    throw field_error(o, "linear_num_heads", "KDA layers have equal key and value heads and dims");
  if (c.router_score != RouterScore::Sigmoid || c.shared_expert_gated)
    throw field_error(o, "moe_router_activation_func", "Kimi-Linear routes with sigmoid, ungated shared experts");
}

std::string config_to_json(const ModelConfig& c) {
  json t = shared::config_json_base(c);
  t["architectures"] = {"KimiLinearForCausalLM"};
  t["q_lora_rank"] = c.q_lora_rank > 0 ? json(c.q_lora_rank) : json(nullptr);
  t["kv_lora_rank"] = c.kv_lora_rank;
  t["qk_nope_head_dim"] = c.qk_nope_head_dim;
  t["qk_rope_head_dim"] = c.qk_rope_head_dim;
  t["v_head_dim"] = c.v_head_dim;
  t["linear_num_heads"] = c.linear_num_value_heads;
  t["linear_head_dim"] = c.linear_value_head_dim;
  t["linear_conv_kernel_dim"] = c.linear_conv_kernel_dim;
  t["num_experts"] = c.num_experts;
  t["num_experts_per_token"] = c.num_experts_per_tok;
  t["moe_intermediate_size"] = c.moe_intermediate_size;
  t["num_shared_experts"] =
      c.moe_intermediate_size > 0 ? json(c.shared_expert_intermediate_size / c.moe_intermediate_size) : json(0);
  t["moe_renormalize"] = c.norm_topk_prob;
  t["num_expert_group"] = c.n_group;
  t["topk_group"] = c.topk_group;
  t["routed_scaling_factor"] = c.routed_scaling_factor;
  json dense = json::array();
  for (int i = 0; i < c.num_hidden_layers; ++i) dense.push_back(c.is_moe_layer(i) ? "sparse" : "dense");
  t["mlp_layer_types"] = dense;
  return t.dump(2) + "\n";
}

}  // namespace hypic::engine::families::kimi_linear
