#include "engine/checkpoint/config.h"
#include "engine/io_error.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <type_traits>

#include "engine/checkpoint/config_internal.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/families/kimi_linear/config.h"
#include "engine/families/minimax/config.h"
#include "engine/families/qwen/config.h"
#include "engine/families/ring_linear/config.h"
#include "engine/families/shared/config.h"

namespace hypic::engine {

using namespace config_detail;

namespace {

using nlohmann::json;


constexpr std::string_view kSupportedTypes =
    "qwen3_next, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, kimi_linear, minimax, bailing_moe_linear";

/// The family of a model_type, or nullopt for an unknown one.
std::optional<ModelFamily> family_of_model_type(std::string_view t) {
  if (t == "qwen3_next" || t == "qwen3_5" || t == "qwen3_5_text" || t == "qwen3_5_moe" || t == "qwen3_5_moe_text")
    return ModelFamily::Qwen;
  if (t == "kimi_linear") return ModelFamily::KimiLinear;
  if (t == "minimax") return ModelFamily::MiniMax;
  if (t == "bailing_moe_linear") return ModelFamily::RingLinear;
  return std::nullopt;
}

std::string read_file_text(const std::filesystem::path& p) {
  errno = 0;
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open config file " + p.string() + ": " + io_error_reason(p, errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad() || std::filesystem::is_directory(p)) {
    throw std::runtime_error("cannot read config file " + p.string() + ": " + io_error_reason(p, errno));
  }
  return ss.str();
}

}  // namespace

namespace config_detail {
/// Reads RoPE settings: transformers 5.x `rope_parameters`, else legacy top-level fields.
void parse_rope(const json& t, std::string_view origin, ModelConfig& c) {
  // Defaults: the values already in c (the struct's 10000 / 0.25 for Qwen; a family's own before calling).
  c.rope_theta = get_or<double>(t, origin, "rope_theta", c.rope_theta);
  c.partial_rotary_factor = get_or<double>(t, origin, "partial_rotary_factor", c.partial_rotary_factor);
  auto check_type = [&](const json& obj, const char* field) {
    std::string type =
        get_or<std::string>(obj, origin, "rope_type", get_or<std::string>(obj, origin, "type", "default"));
    if (type != "default")
      throw field_error(origin, field, "has rope_type '" + type + "'; only the default (unscaled) RoPE is supported");
  };
  if (auto it = t.find("rope_parameters"); it != t.end() && !it->is_null()) {
    if (!it->is_object()) throw field_error(origin, "rope_parameters", "must be an object, got " + it->dump());
    check_type(*it, "rope_parameters");
    c.rope_theta = get_or<double>(*it, origin, "rope_theta", c.rope_theta);
    c.partial_rotary_factor = get_or<double>(*it, origin, "partial_rotary_factor", c.partial_rotary_factor);
  }
  if (auto it = t.find("rope_scaling"); it != t.end() && !it->is_null()) {
    if (!it->is_object()) throw field_error(origin, "rope_scaling", "must be an object, got " + it->dump());
    check_type(*it, "rope_scaling");
  }
}

// layer_types as a list of strings (HF spelling), or false when absent (config_internal.h).
bool parse_layer_types_list(const json& t, std::string_view o, ModelConfig& c) {
  auto it = t.find("layer_types");
  if (it == t.end() || it->is_null()) return false;
  if (!it->is_array()) throw field_error(o, "layer_types", "must be a list of strings, got " + it->dump());
  for (const auto& e : *it) {
    if (!e.is_string()) throw field_error(o, "layer_types", "contains a non-string entry " + e.dump());
    try {
      c.layer_types.push_back(parse_layer_type(e.get<std::string>()));
    } catch (const std::invalid_argument& err) {
      throw field_error(o, "layer_types", err.what());
    }
  }
  return true;
}

}  // namespace config_detail

const char* model_family_name(ModelFamily f) {
  switch (f) {
    case ModelFamily::Qwen: return "qwen";
    case ModelFamily::KimiLinear: return "kimi_linear";
    case ModelFamily::MiniMax: return "minimax";
    case ModelFamily::RingLinear: return "bailing_moe_linear";
  }
  return "unknown";
}

std::string_view layer_type_name(LayerType t) { return t == LayerType::Linear ? "linear_attention" : "full_attention"; }

LayerType parse_layer_type(std::string_view name) {
  // "mamba" / "attention" are the legacy names transformers remaps (remap_legacy_layer_types).
  if (name == "linear_attention" || name == "mamba") return LayerType::Linear;
  if (name == "full_attention" || name == "attention") return LayerType::FullAttention;
  throw std::invalid_argument("unknown layer type '" + std::string(name) +
                              "' (expected linear_attention or full_attention)");
}

bool ModelConfig::is_moe_layer(int i) const {
  if (i < 0 || i >= num_hidden_layers)
    throw std::out_of_range("layer index " + std::to_string(i) + " out of range [0, " +
                            std::to_string(num_hidden_layers) + ")");
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) != mlp_only_layers.end()) return false;
  return (i + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::conv_dim() const { return 2 * linear_q_dim() + linear_v_dim(); }

int ModelConfig::rotary_dim() const {
  if (!attention_has_rope() && !linear_rope) return 0;
  return static_cast<int>(head_dim * partial_rotary_factor);
}

int ModelConfig::num_linear_layers() const {
  return static_cast<int>(std::count(layer_types.begin(), layer_types.end(), LayerType::Linear));
}

int ModelConfig::num_attention_layers() const {
  return static_cast<int>(std::count(layer_types.begin(), layer_types.end(), LayerType::FullAttention));
}

namespace {
int index_among(const std::vector<LayerType>& types, int layer, LayerType want) {
  if (layer < 0 || layer >= static_cast<int>(types.size()))
    throw std::out_of_range("layer index " + std::to_string(layer) + " out of range [0, " +
                            std::to_string(types.size()) + ")");
  if (types[layer] != want)
    throw std::invalid_argument("layer " + std::to_string(layer) + " is " + std::string(layer_type_name(types[layer])) +
                                ", not " + std::string(layer_type_name(want)));
  return static_cast<int>(std::count(types.begin(), types.begin() + layer, want));
}
}  // namespace

int ModelConfig::linear_index(int layer) const { return index_among(layer_types, layer, LayerType::Linear); }
int ModelConfig::attention_index(int layer) const { return index_among(layer_types, layer, LayerType::FullAttention); }

int64_t ModelConfig::linear_state_bytes() const {
  const int64_t ssm = int64_t(linear_num_value_heads) * linear_key_head_dim * linear_value_head_dim;
  const int64_t conv = int64_t(conv_rows()) * conv_dim();
  return (ssm + conv) * int64_t(sizeof(float));
}

int64_t ModelConfig::kv_bytes_per_token() const {
  return int64_t(num_attention_layers()) * kv_cache_heads() * (int64_t(kv_cache_k_dim()) + kv_cache_v_dim()) *
         int64_t(sizeof(float));
}

void ModelConfig::validate() const {
  const std::string origin = "config (" + model_type + ")";
  require_positive(origin, "vocab_size", vocab_size);
  require_positive(origin, "hidden_size", hidden_size);
  require_positive(origin, "num_hidden_layers", num_hidden_layers);
  for (const auto& [field, v, max] : {std::tuple<const char*, int64_t, int64_t>{"vocab_size", vocab_size, kMaxVocab},
                                      {"hidden_size", hidden_size, kMaxHidden},
                                      {"num_hidden_layers", num_hidden_layers, kMaxLayers},
                                      {"num_attention_heads", num_attention_heads, kMaxHeads},
                                      {"num_key_value_heads", num_key_value_heads, kMaxHeads},
                                      {"head_dim", head_dim, kMaxHeadDim},
                                      {"linear_num_key_heads", linear_num_key_heads, kMaxHeads},
                                      {"linear_num_value_heads", linear_num_value_heads, kMaxHeads},
                                      {"linear_key_head_dim", linear_key_head_dim, kMaxHeadDim},
                                      {"linear_value_head_dim", linear_value_head_dim, kMaxHeadDim},
                                      {"linear_conv_kernel_dim", linear_conv_kernel_dim, kMaxConvKernel},
                                      {"intermediate_size", intermediate_size, kMaxIntermediate},
                                      {"num_experts", num_experts, kMaxExperts},
                                      {"moe_intermediate_size", moe_intermediate_size, kMaxIntermediate},
                                      {"shared_expert_intermediate_size", shared_expert_intermediate_size,
                                       kMaxIntermediate},
                                      {"q_lora_rank", q_lora_rank, kMaxIntermediate},
                                      {"kv_lora_rank", kv_lora_rank, kMaxIntermediate},
                                      {"qk_nope_head_dim", qk_nope_head_dim, kMaxHeadDim},
                                      {"qk_rope_head_dim", qk_rope_head_dim, kMaxHeadDim},
                                      {"v_head_dim", v_head_dim, kMaxHeadDim},
                                      {"block_size", lightning_block_size, kMaxIntermediate},
                                      {"group_norm_size", group_norm_size, kMaxHeadDim * kMaxHeads},
                                      {"n_group", n_group, kMaxExperts},
                                      {"topk_group", topk_group, kMaxExperts}})
    require_at_most(origin, field, v, max);
  if (!std::isfinite(rms_norm_eps)) throw field_error(origin, "rms_norm_eps", "must be finite");
  if (!std::isfinite(rope_theta)) throw field_error(origin, "rope_theta", "must be finite");
  if (static_cast<int>(layer_types.size()) != num_hidden_layers)
    throw field_error(origin, "layer_types",
                      "has " + std::to_string(layer_types.size()) + " entries but num_hidden_layers is " +
                          std::to_string(num_hidden_layers));
  if (!(rms_norm_eps > 0)) throw field_error(origin, "rms_norm_eps", "must be > 0");
  const bool needs_rope = (num_attention_layers() > 0 && attention_has_rope()) ||
                          (num_linear_layers() > 0 && linear_rope);
  if (num_attention_layers() > 0) {
    require_positive(origin, "num_attention_heads", num_attention_heads);
    require_positive(origin, "num_key_value_heads", num_key_value_heads);
    require_positive(origin, "head_dim", head_dim);
    require_multiple(origin, "num_attention_heads", num_attention_heads, "num_key_value_heads", num_key_value_heads);
  }
  if (needs_rope) {
    if (!(rope_theta > 0)) throw field_error(origin, "rope_theta", "must be > 0");
    if (!(partial_rotary_factor > 0 && partial_rotary_factor <= 1))
      throw field_error(origin, "partial_rotary_factor", "must be in (0, 1]");
    if (rotary_dim() % 2 != 0 || rotary_dim() == 0)
      throw field_error(origin, partial_rotary_factor < 1 ? "partial_rotary_factor" : "head_dim",
                        "gives rotary_dim " + std::to_string(rotary_dim()) + ", which must be even and > 0");
  }
  if (num_linear_layers() > 0) {
    require_positive(origin, "linear_num_key_heads", linear_num_key_heads);
    require_positive(origin, "linear_num_value_heads", linear_num_value_heads);
    require_positive(origin, "linear_key_head_dim", linear_key_head_dim);
    require_positive(origin, "linear_value_head_dim", linear_value_head_dim);
    if (family == ModelFamily::Qwen || family == ModelFamily::KimiLinear)
      require_positive(origin, "linear_conv_kernel_dim", linear_conv_kernel_dim);
    else if (linear_conv_kernel_dim != 0)
      throw field_error(origin, "linear_conv_kernel_dim",
                        "must be 0 for " + std::string(model_family_name(family)) + " (no short conv), got " +
                            std::to_string(linear_conv_kernel_dim));
    if (!std::isfinite(linear_norm_eps) || !(linear_norm_eps > 0))
      throw field_error(origin, "linear_norm_eps", "must be finite and > 0");
    require_multiple(origin, "linear_num_value_heads", linear_num_value_heads, "linear_num_key_heads",
                     linear_num_key_heads);
  }
  if (decoder_sparse_step <= 0)
    throw field_error(origin, "decoder_sparse_step", "must be > 0, got " + std::to_string(decoder_sparse_step));
  for (int l : mlp_only_layers)
    if (l < 0 || l >= num_hidden_layers)
      throw field_error(
          origin, "mlp_only_layers",
          "contains layer " + std::to_string(l) + " outside [0, " + std::to_string(num_hidden_layers) + ")");
  bool any_moe = false, any_dense = false;
  for (int i = 0; i < num_hidden_layers; ++i) (is_moe_layer(i) ? any_moe : any_dense) = true;
  if (any_moe) {
    require_positive(origin, "num_experts_per_tok", num_experts_per_tok);
    require_positive(origin, "moe_intermediate_size", moe_intermediate_size);
    if (num_experts_per_tok > num_experts)
      throw field_error(origin, "num_experts_per_tok",
                        std::to_string(num_experts_per_tok) + " exceeds num_experts " + std::to_string(num_experts));
    if (shared_expert_intermediate_size < 0)
      throw field_error(origin, "shared_expert_intermediate_size", "must be >= 0");
  }
  if (any_dense) require_positive(origin, "intermediate_size", intermediate_size);
  switch (family) {  // the family's own checks (Qwen has none beyond the ones above)
    case ModelFamily::Qwen: break;
    case ModelFamily::KimiLinear: families::kimi_linear::validate_config(*this, origin); break;
    case ModelFamily::MiniMax: families::minimax::validate_config(*this, origin); break;
    case ModelFamily::RingLinear: families::ring_linear::validate_config(*this, origin); break;
  }
}

ModelConfig parse_config(std::string_view json_text, std::string_view origin) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number too large for a double
    throw std::runtime_error(std::string(origin) + ": not valid JSON: " + e.what());
  }
  if (!root.is_object()) throw std::runtime_error(std::string(origin) + ": top level is not a JSON object");

  ModelConfig c;
  c.model_type = get_required<std::string>(root, origin, "model_type");
  const std::optional<ModelFamily> family = family_of_model_type(c.model_type);
  if (!family)
    throw std::invalid_argument(std::string(origin) + ": unknown model_type '" + c.model_type +
                                "' (supported: " + std::string(kSupportedTypes) + ")");
  switch (*family) {
    case ModelFamily::Qwen: families::qwen::parse_config(root, origin, c); break;
    case ModelFamily::KimiLinear: families::kimi_linear::parse_config(root, origin, c); break;
    case ModelFamily::MiniMax: families::minimax::parse_config(root, origin, c); break;
    case ModelFamily::RingLinear: families::ring_linear::parse_config(root, origin, c); break;
  }
  c.validate();
  return c;
}

ModelConfig load_config(const std::filesystem::path& path) {
  std::filesystem::path file = path;
  const bool is_dir = std::filesystem::is_directory(path);
  if (is_dir) file = path / "config.json";
  if (!std::filesystem::exists(file)) throw std::runtime_error("config file not found: " + file.string());
  ModelConfig c = parse_config(read_file_text(file), file.string());
  if (is_dir && has_safetensors(path)) c.weights_digest = weights_identity(path);
  return c;
}

json config_detail::common_config_json(const ModelConfig& c) {
  json t;
  t["vocab_size"] = c.vocab_size;
  t["hidden_size"] = c.hidden_size;
  t["num_hidden_layers"] = c.num_hidden_layers;
  json lt = json::array();
  for (auto x : c.layer_types) lt.push_back(std::string(layer_type_name(x)));
  t["layer_types"] = lt;
  t["rms_norm_eps"] = c.rms_norm_eps;
  if (c.max_position_embeddings > 0) t["max_position_embeddings"] = c.max_position_embeddings;
  t["hidden_act"] = "silu";
  t["num_attention_heads"] = c.num_attention_heads;
  t["num_key_value_heads"] = c.num_key_value_heads;
  return t;
}

std::string config_to_json(const ModelConfig& c) {
  switch (c.family) {
    case ModelFamily::Qwen: return families::qwen::config_to_json(c);
    case ModelFamily::KimiLinear: return families::kimi_linear::config_to_json(c);
    case ModelFamily::MiniMax: return families::minimax::config_to_json(c);
    case ModelFamily::RingLinear: return families::ring_linear::config_to_json(c);
  }
  throw std::logic_error("config_to_json: unknown family " + std::to_string(static_cast<int>(c.family)));
}

std::string ModelConfig::fingerprint() const {
  // Canonical text of every field that changes the math, then the weights identity. %.17g keeps
  // doubles exact; the order is fixed, so the digest is stable across runs and machines.
  std::string s = "hypic-config-v1|" + model_type;
  char buf[64];
  auto add_i = [&](const char* k, int64_t v) { s += "|" + std::string(k) + "=" + std::to_string(v); };
  auto add_d = [&](const char* k, double v) {
    std::snprintf(buf, sizeof buf, "%.17g", v);
    s += "|" + std::string(k) + "=" + buf;
  };
  add_i("vocab", vocab_size);
  add_i("hidden", hidden_size);
  add_i("layers", num_hidden_layers);
  s += "|types=";
  for (auto t : layer_types) s += t == LayerType::Linear ? 'L' : 'F';
  add_d("eps", rms_norm_eps);
  add_i("nh", num_attention_heads);
  add_i("nkv", num_key_value_heads);
  add_i("hd", head_dim);
  add_d("theta", rope_theta);
  add_d("prf", partial_rotary_factor);
  add_i("gate", attn_output_gate);
  add_i("lnk", linear_num_key_heads);
  add_i("lnv", linear_num_value_heads);
  add_i("ldk", linear_key_head_dim);
  add_i("ldv", linear_value_head_dim);
  add_i("lK", linear_conv_kernel_dim);
  add_i("inter", intermediate_size);
  add_i("E", num_experts);
  add_i("topk", num_experts_per_tok);
  add_i("moeI", moe_intermediate_size);
  add_i("sharedI", shared_expert_intermediate_size);
  add_i("normtopk", norm_topk_prob);
  add_i("step", decoder_sparse_step);
  s += "|mlp_only=";
  for (int l : mlp_only_layers) s += std::to_string(l) + ",";
  add_i("tie", tie_word_embeddings);
  if (family != ModelFamily::Qwen) s += families::shared::fingerprint_fields(*this);
  s += "|weights=" + weights_digest;
  const XXH128_hash_t h = XXH3_128bits(s.data(), s.size());
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return buf;
}

}  // namespace hypic::engine
