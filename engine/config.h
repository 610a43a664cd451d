// Model configuration of the hybrid linear/full-attention models hypic runs: Qwen3-Next
// (`qwen3_next`, flat config.json) and Qwen3.5 / Qwen3.5-MoE (`qwen3_5`, `qwen3_5_moe` with a nested
// `text_config`; `qwen3_5_text`, `qwen3_5_moe_text` when a text-only model was saved flat).
// Field names and defaults follow transformers 5.17 (Qwen3NextConfig, Qwen3_5TextConfig,
// Qwen3_5MoeTextConfig); see research/hybrid_models.md section 1.2.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace hypic::engine {

/// Token mixer of one decoder layer. HF spells them "linear_attention" (Gated DeltaNet) and
/// "full_attention" (gated softmax attention).
enum class LayerType { Linear, FullAttention };

/// "linear_attention" / "full_attention" (the HF `layer_types` spelling).
std::string_view layer_type_name(LayerType t);
/// Inverse of layer_type_name; throws std::invalid_argument naming the unknown string.
LayerType parse_layer_type(std::string_view name);

/// Architecture of one model. All sizes are element counts (not bytes) unless named *_bytes.
struct ModelConfig {
  std::string model_type;  ///< "qwen3_next" | "qwen3_5" | "qwen3_5_text" | "qwen3_5_moe" | "qwen3_5_moe_text"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;  ///< H
  int num_hidden_layers = 0;
  std::vector<LayerType> layer_types;   ///< one per layer (explicit, or derived from full_attention_interval)
  double rms_norm_eps = 1e-6;           ///< every RMSNorm, including the gated norm of the linear layers
  int64_t max_position_embeddings = 0;  ///< informational (RoPE is computed for any position)

  // Gated full attention (Qwen3NextAttention / Qwen3_5Attention).
  int num_attention_heads = 0;          ///< nh, query heads
  int num_key_value_heads = 0;          ///< nkv (GQA: query head i reads KV head i / (nh / nkv))
  int head_dim = 0;                     ///< hd
  double rope_theta = 10000.0;          ///< RoPE base
  double partial_rotary_factor = 0.25;  ///< rotary_dim() = int(head_dim * factor), NeoX halves
  bool attn_output_gate = true;         ///< q_proj emits query and gate per head; output *= sigmoid(gate)

  // Gated DeltaNet (Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet).
  int linear_num_key_heads = 0;    ///< nk (q and k heads)
  int linear_num_value_heads = 0;  ///< nv (a multiple of nk; value head j reads key head j / (nv/nk))
  int linear_key_head_dim = 0;     ///< dk
  int linear_value_head_dim = 0;   ///< dv
  int linear_conv_kernel_dim = 4;  ///< K of the depthwise causal conv1d

  // MLP / MoE (Qwen3NextSparseMoeBlock, Qwen3NextMLP).
  int64_t intermediate_size = 0;                ///< dense MLP width (Qwen3.5 dense; Qwen3-Next mlp_only_layers)
  int num_experts = 0;                          ///< E; 0 = dense model
  int num_experts_per_tok = 0;                  ///< top-k
  int64_t moe_intermediate_size = 0;            ///< I of each routed expert
  int64_t shared_expert_intermediate_size = 0;  ///< width of the shared expert (0 = none)
  bool norm_topk_prob = true;                   ///< renormalise the top-k probabilities (Qwen3.5-MoE: always true)
  int decoder_sparse_step = 1;                  ///< Qwen3-Next: layer i is MoE iff (i+1) % step == 0 (and below)
  std::vector<int> mlp_only_layers;             ///< Qwen3-Next: layers forced to the dense MLP

  bool tie_word_embeddings = false;  ///< lm_head shares embed_tokens

  /// Hex digest identifying the weights (see weights_identity() in engine/safetensors.h); set by
  /// load_config() when it is given a checkpoint directory holding safetensors files, else empty.
  std::string weights_digest;

  // ---- derived quantities ----
  bool is_moe() const { return num_experts > 0; }
  /// True when layer i uses the sparse MoE block, false for the dense MLP (HF rule: num_experts > 0,
  /// i not in mlp_only_layers, (i+1) % decoder_sparse_step == 0). Throws std::out_of_range for bad i.
  bool is_moe_layer(int i) const;
  /// Channels of the depthwise conv: 2*nk*dk + nv*dv ([Q | K | V]).
  int64_t conv_dim() const;
  int64_t linear_q_dim() const { return int64_t(linear_num_key_heads) * linear_key_head_dim; }      ///< nk*dk
  int64_t linear_v_dim() const { return int64_t(linear_num_value_heads) * linear_value_head_dim; }  ///< nv*dv
  int rotary_dim() const;  ///< int(head_dim * partial_rotary_factor)
  int num_linear_layers() const;
  int num_attention_layers() const;
  /// Position of `layer` among the layers of its own type (e.g. 2nd linear layer -> 1).
  /// Throws std::invalid_argument if the layer is not of that type, std::out_of_range for a bad index.
  int linear_index(int layer) const;
  int attention_index(int layer) const;

  /// Recurrent-state bytes of one linear layer in fp32: nv*dk*dv*4 (S) + (K-1)*conv_dim*4 (conv tail).
  int64_t linear_state_bytes() const;
  /// KV-cache bytes per token over all attention layers in fp32: n_attn * 2 * nkv * hd * 4.
  int64_t kv_bytes_per_token() const;

  /// Checks internal consistency (positive sizes, divisibility nv % nk, nh % nkv, layer_types length,
  /// top-k <= experts, ...) and bounds (at most 4096 layers, heads and head dims, hidden 2^20, intermediate
  /// sizes 2^24, 65536 experts, vocabulary 2^31 - 1; finite eps and RoPE theta), which keep derived sizes
  /// from overflowing; throws std::invalid_argument naming the field and the values.
  void validate() const;

  /// Stable 32-hex-digit digest (XXH3-128) of the architecture fields above plus weights_digest:
  /// two configs differing in any field that changes the math, or with different weights, differ.
  std::string fingerprint() const;
};

/// Parses a model configuration. `path` is either a config.json file or a checkpoint directory
/// holding config.json; for a directory that also holds safetensors files, weights_digest is set
/// from weights_identity(dir). Accepts flat configs (qwen3_next, qwen3_5_text, qwen3_5_moe_text) and
/// nested ones (qwen3_5, qwen3_5_moe: fields read from `text_config`). RoPE fields are read from
/// `rope_parameters` (transformers 5.x) or from top-level `rope_theta` / `partial_rotary_factor`
/// (older files); a rope_type other than "default" is rejected. If `layer_types` is absent it is
/// derived: layer i is full attention iff (i+1) % full_attention_interval == 0.
/// Throws std::runtime_error (file unreadable / not JSON) or std::invalid_argument (unknown
/// model_type, missing or inconsistent field, a fraction or out-of-range number in an integer field),
/// naming the file and the field.
ModelConfig load_config(const std::filesystem::path& path);

/// Parses a configuration from JSON text; `origin` names the source in error messages.
ModelConfig parse_config(std::string_view json_text, std::string_view origin = "config.json");

/// Serialises to config.json in the field layout transformers 5.17 writes (model_type kept as is;
/// for the nested types qwen3_5 / qwen3_5_moe the fields go inside `text_config`), with explicit
/// `layer_types` and `rope_parameters`. load_config(config_to_json(c)) == c (weights_digest aside).
std::string config_to_json(const ModelConfig& cfg);

}  // namespace hypic::engine
