// config.json parsing, validation, serialisation and fingerprint fields of the Kimi-Linear, MiniMax and
// Ring-linear-2.0 families (the Qwen families are in config.cpp). Field names and defaults:
//  - kimi_linear: transformers 5.17 KimiLinearConfig. Its attribute_map aliases are accepted both ways (the name
//    transformers writes first, then the alias): num_experts | num_local_experts, num_experts_per_token |
//    num_experts_per_tok, num_shared_experts | n_shared_experts, moe_renormalize | norm_topk_prob,
//    num_expert_group | n_group, model_max_length | max_position_embeddings. The released config.json keeps the
//    linear-attention fields in `linear_attn_config` {num_heads, head_dim, short_conv_kernel_size, kda_layers,
//    full_attn_layers (1-based)}; its dense layers are first_k_dense_replace (and moe_layer_freq) when
//    `mlp_layer_types` is absent (KimiLinearConfig.__post_init__).
//  - minimax: transformers 5.17 MiniMaxConfig (default_theta 1e6; layer_types default: layer i is full attention
//    iff i is even), plus the original MiniMax-Text-01 names `attn_type_list` (0 lightning, 1 softmax) and
//    `layernorm_{full_attention,linear_attention,mlp}_{alpha,beta}`.
//  - bailing_moe_linear: the hub config.json of Ring-mini-linear-2.0 (docs/research/hybrid_models.md 3.2, 3.4).
#include <cmath>
#include <cstdio>
#include <string>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/config_internal.h"

namespace hypic::engine {
namespace config_detail {
namespace {

/// The first of `keys` present (not null) in obj, or nullptr.
const char* first_key(const json& obj, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (auto it = obj.find(k); it != obj.end() && !it->is_null()) return k;
  return nullptr;
}

/// get_or over aliases: the first key present wins.
template <typename T>
T get_alias(const json& obj, std::string_view origin, std::initializer_list<const char*> keys, T fallback) {
  const char* k = first_key(obj, keys);
  return k ? get_or<T>(obj, origin, k, fallback) : fallback;
}

void require_silu_no_bias(const json& t, std::string_view o) {
  const std::string act = get_or<std::string>(t, o, "hidden_act", "silu");
  if (act != "silu") throw field_error(o, "hidden_act", "is '" + act + "'; only silu is supported");
  if (get_or<bool>(t, o, "attention_bias", false))
    throw field_error(o, "attention_bias", "is true; attention projections with bias are not supported");
}


void parse_kimi(const json& t, std::string_view o, ModelConfig& c) {
  require_silu_no_bias(t, o);
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

void parse_minimax(const json& t, std::string_view o, ModelConfig& c) {
  require_silu_no_bias(t, o);
  c.rms_norm_eps = get_or<double>(t, o, "rms_norm_eps", 1e-5);
  c.linear_norm_eps = 1e-6;  // MiniMaxLightningAttention: MiniMaxRMSNorm(H * D) with its default eps
  c.max_position_embeddings = get_or<int64_t>(t, o, "max_position_embeddings", 0);
  c.tie_word_embeddings = get_or<bool>(t, o, "tie_word_embeddings", false);
  if (auto it = t.find("sliding_window"); it != t.end() && !it->is_null())
    throw field_error(o, "sliding_window", "is set (" + it->dump() + "); sliding-window attention is not supported");
  if (!get_or<bool>(t, o, "postnorm", true))
    throw field_error(o, "postnorm", "is false; MiniMaxDecoderLayer (transformers) is post-norm only");

  c.num_attention_heads = get_required<int>(t, o, "num_attention_heads");
  require_positive(o, "num_attention_heads", c.num_attention_heads);
  require_at_most(o, "num_attention_heads", c.num_attention_heads, kMaxHeads);
  c.num_key_value_heads = get_or<int>(t, o, "num_key_value_heads", 8);
  if (t.contains("head_dim") && !t["head_dim"].is_null()) {
    c.head_dim = get_required<int>(t, o, "head_dim");
  } else {
    require_multiple(o, "hidden_size", c.hidden_size, "num_attention_heads", c.num_attention_heads);
    c.head_dim = static_cast<int>(c.hidden_size / c.num_attention_heads);
  }
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

void parse_ring(const json& t, std::string_view o, ModelConfig& c) {
  require_silu_no_bias(t, o);
  if (get_or<bool>(t, o, "use_qkv_bias", false))
    throw field_error(o, "use_qkv_bias", "is true; attention projections with bias are not supported");
  if (get_or<bool>(t, o, "use_bias", false))
    throw field_error(o, "use_bias", "is true; projections with bias are not supported");
  c.rms_norm_eps = get_or<double>(t, o, "rms_norm_eps", 1e-6);
  c.linear_norm_eps = c.rms_norm_eps;
  c.max_position_embeddings = get_or<int64_t>(t, o, "max_position_embeddings", 0);
  c.tie_word_embeddings = get_or<bool>(t, o, "tie_word_embeddings", false);

  c.num_attention_heads = get_required<int>(t, o, "num_attention_heads");
  require_positive(o, "num_attention_heads", c.num_attention_heads);
  require_at_most(o, "num_attention_heads", c.num_attention_heads, kMaxHeads);
  c.num_key_value_heads = get_or<int>(t, o, "num_key_value_heads", 4);
  if (t.contains("head_dim") && !t["head_dim"].is_null()) {
    c.head_dim = get_required<int>(t, o, "head_dim");
  } else {
    require_multiple(o, "hidden_size", c.hidden_size, "num_attention_heads", c.num_attention_heads);
    c.head_dim = static_cast<int>(c.hidden_size / c.num_attention_heads);
  }
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

void check_sigmoid_router(const ModelConfig& c, const std::string& o) {
  bool any_moe = false;
  for (int i = 0; i < c.num_hidden_layers; ++i) any_moe |= c.is_moe_layer(i);
  if (!any_moe) return;
  if (c.n_group <= 0) throw field_error(o, "n_group", "must be > 0, got " + std::to_string(c.n_group));
  require_multiple(o, "num_experts", c.num_experts, "n_group", c.n_group);
  // KimiLinearTopkRouter takes the top-2 of every group (topk(2) fails on groups of one); Ring's router the top-1
  // of a group of one.
  const int min_per_group = c.family == ModelFamily::KimiLinear ? 2 : 1;
  if (c.num_experts / c.n_group < min_per_group)
    throw field_error(o, "n_group",
                      std::to_string(c.n_group) + " leaves fewer than " + std::to_string(min_per_group) +
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

std::string dbl(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace

std::optional<ModelFamily> family_of_model_type(std::string_view t) {
  if (t == "qwen3_next" || t == "qwen3_5" || t == "qwen3_5_text" || t == "qwen3_5_moe" || t == "qwen3_5_moe_text")
    return ModelFamily::Qwen;
  if (t == "kimi_linear") return ModelFamily::KimiLinear;
  if (t == "minimax") return ModelFamily::MiniMax;
  if (t == "bailing_moe_linear") return ModelFamily::RingLinear;
  return std::nullopt;
}

void parse_family_config(const json& t, std::string_view o, ModelFamily family, ModelConfig& c) {
  c.family = family;
  c.vocab_size = get_required<int64_t>(t, o, "vocab_size");
  c.hidden_size = get_required<int64_t>(t, o, "hidden_size");
  c.num_hidden_layers = get_required<int>(t, o, "num_hidden_layers");
  require_positive(o, "vocab_size", c.vocab_size);
  require_positive(o, "hidden_size", c.hidden_size);
  require_positive(o, "num_hidden_layers", c.num_hidden_layers);
  require_at_most(o, "num_hidden_layers", c.num_hidden_layers, kMaxLayers);
  require_at_most(o, "hidden_size", c.hidden_size, kMaxHidden);
  switch (family) {
    case ModelFamily::KimiLinear: parse_kimi(t, o, c); break;
    case ModelFamily::MiniMax: parse_minimax(t, o, c); break;
    case ModelFamily::RingLinear: parse_ring(t, o, c); break;
    case ModelFamily::Qwen: throw std::logic_error("parse_family_config: Qwen is parsed by parse_config");
  }
}

void validate_family_fields(const ModelConfig& c, const std::string& o) {
  for (const auto& [field, v] : {std::pair<const char*, double>{"full_attn_alpha_factor", c.full_attn_alpha},
                                 {"full_attn_beta_factor", c.full_attn_beta},
                                 {"linear_attn_alpha_factor", c.linear_attn_alpha},
                                 {"linear_attn_beta_factor", c.linear_attn_beta},
                                 {"mlp_alpha_factor", c.mlp_alpha},
                                 {"mlp_beta_factor", c.mlp_beta}})
    if (!std::isfinite(v)) throw field_error(o, field, "must be finite");
  if (c.attn_output_gate) throw field_error(o, "attn_output_gate", "is only supported by the Qwen families");
  if (c.router_score == RouterScore::Sigmoid) check_sigmoid_router(c, o);
  switch (c.family) {
    case ModelFamily::KimiLinear:
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
      break;
    case ModelFamily::MiniMax:
      check_lightning(c, o);
      if (c.shared_expert_intermediate_size != 0)
        throw field_error(o, "shared_expert_intermediate_size", "must be 0: MiniMax has no shared expert");
      break;
    case ModelFamily::RingLinear:
      check_lightning(c, o);
      break;
    case ModelFamily::Qwen: break;
  }
}

std::string family_fingerprint_fields(const ModelConfig& c) {
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

std::string family_config_to_json(const ModelConfig& c) {
  json t = common_config_json(c);
  t["model_type"] = c.model_type;
  t["tie_word_embeddings"] = c.tie_word_embeddings;
  t["intermediate_size"] = c.intermediate_size;
  auto dense_list = [&] {
    json m = json::array();
    for (int i = 0; i < c.num_hidden_layers; ++i) m.push_back(c.is_moe_layer(i) ? "sparse" : "dense");
    return m;
  };
  switch (c.family) {
    case ModelFamily::KimiLinear:
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
      t["mlp_layer_types"] = dense_list();
      break;
    case ModelFamily::MiniMax:
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
      break;
    case ModelFamily::RingLinear: {
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
      break;
    }
    case ModelFamily::Qwen: throw std::logic_error("family_config_to_json: Qwen is written by config_to_json");
  }
  return t.dump(2) + "\n";
}

}  // namespace config_detail
}  // namespace hypic::engine
