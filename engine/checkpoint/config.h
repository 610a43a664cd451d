// Model configuration of the hybrid linear/full-attention models hypic runs, by family (ModelFamily):
//  - Qwen3-Next (`qwen3_next`, flat config.json) and Qwen3.5 / Qwen3.5-MoE (`qwen3_5`, `qwen3_5_moe` with a
//    nested `text_config`; `qwen3_5_text`, `qwen3_5_moe_text` when a text-only model was saved flat);
//  - Kimi-Linear (`kimi_linear`: KDA + MLA, DeepSeek-V3 MoE), MiniMax-Text-01 (`minimax`: lightning attention,
//    post-norm alpha/beta residuals, Mixtral MoE) and Ring-linear-2.0 (`bailing_moe_linear`: lightning attention
//    with qk-norm and RoPE, sigmoid grouped MoE; not in transformers).
// Field names and defaults follow transformers 5.17 (Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig,
// KimiLinearConfig, MiniMaxConfig) and the hub config.json of Ring-linear-2.0; see docs/research/hybrid_models.md
// sections 1.2, 2.2, 3.2 and 4. Every family maps its linear layers onto the linear_* fields and its attention
// layers onto num_attention_heads / num_key_value_heads / head_dim (documented per field), so the state geometry
// (engine/cpu/model.h) is computed one way for all of them.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace hypic::engine {

/// Token mixer of one decoder layer. HF spells them "linear_attention" (Gated DeltaNet, KDA or lightning
/// attention, by family) and "full_attention" (softmax attention: gated, MLA or plain GQA, by family).
enum class LayerType { Linear, FullAttention };

/// Architecture family: decides which linear mixer, attention, norm flavour, MoE router and residual form the
/// decoder layers run (engine/cpu/model.cpp, engine/families/).
enum class ModelFamily {
  Qwen,        ///< qwen3_next, qwen3_5*: Gated DeltaNet + gated attention, zero-centred (1 + w) RMSNorms
  KimiLinear,  ///< kimi_linear: KDA (KimiLinearDeltaAttention) + MLA without RoPE (KimiLinearAttention), KimiLinearMoE
  MiniMax,     ///< minimax: MiniMaxLightningAttention + MiniMaxAttention, alpha/beta residuals, Mixtral-style MoE
  RingLinear,  ///< bailing_moe_linear: lightning (simple GLA) with qk-norm + RoPE, GQA softmax layers, grouped MoE
};

/// "qwen" | "kimi_linear" | "minimax" | "bailing_moe_linear".
const char* model_family_name(ModelFamily f);

/// MoE router score function (the router logits are computed in fp32 for every family).
enum class RouterScore {
  Softmax,  ///< softmax over all experts, then top-k (Qwen, MiniMax)
  Sigmoid,  ///< sigmoid per expert; selection by sigmoid + bias, group-limited (Kimi-Linear, Ring: DeepSeek-V3 style)
};

/// "linear_attention" / "full_attention" (the HF `layer_types` spelling).
std::string_view layer_type_name(LayerType t);
/// Inverse of layer_type_name; throws std::invalid_argument naming the unknown string.
LayerType parse_layer_type(std::string_view name);

/// Architecture of one model. All sizes are element counts (not bytes) unless named *_bytes.
struct ModelConfig {
  std::string model_type;  ///< "qwen3_next" | "qwen3_5" | "qwen3_5_text" | "qwen3_5_moe" | "qwen3_5_moe_text" |
                           ///< "kimi_linear" | "minimax" | "bailing_moe_linear"
  ModelFamily family = ModelFamily::Qwen;  ///< follows from model_type
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;  ///< H
  int num_hidden_layers = 0;
  std::vector<LayerType> layer_types;   ///< one per layer (explicit, or derived from full_attention_interval)
  double rms_norm_eps = 1e-6;           ///< every RMSNorm, including the gated norm of the linear layers (MiniMax's
                                        ///< lightning norm excepted: linear_norm_eps)
  int64_t max_position_embeddings = 0;  ///< the trained context (RoPE is computed for any position); the router's
                                       ///< default --max-model-len

  // Full attention (Qwen3NextAttention / Qwen3_5Attention gated; MiniMaxAttention and Ring's softmax layers plain
  // GQA; KimiLinearAttention MLA, whose attention math runs per head with num_key_value_heads = nh,
  // head_dim = qk_nope_head_dim + qk_rope_head_dim (K), v_head_dim (V), but whose KV cache keeps the compressed
  // latent: one row [kv_lora_rank normed c_kv | qk_rope_head_dim k_rot] per token, no V; see kv_cache_heads() etc.).
  int num_attention_heads = 0;          ///< nh, query heads
  int num_key_value_heads = 0;          ///< nkv (GQA: query head i reads KV head i / (nh / nkv)); MLA: nh (of the
                                        ///< expanded K/V; its cache has kv_cache_heads() = 1)
  int head_dim = 0;                     ///< hd, the K (and, but for MLA, V) head dim; MLA: qk_nope + qk_rope
  double rope_theta = 10000.0;          ///< RoPE base
  double partial_rotary_factor = 0.25;  ///< rotary_dim() = int(head_dim * factor), NeoX halves (MiniMax: 1)
  bool attn_output_gate = true;         ///< q_proj emits query and gate per head; output *= sigmoid(gate) (Qwen only)
  bool use_qk_norm = true;              ///< per-head RMSNorm of q and k (Qwen: always, 1 + w; Ring: use_qk_norm, w,
                                        ///< in both layer kinds; Kimi, MiniMax: none)

  // Multi-head latent attention (Kimi-Linear: KimiLinearAttention, DeepSeek-V3 MLA without RoPE); 0 elsewhere.
  int q_lora_rank = 0;       ///< 0: q_proj [nh*(nope+rope), H]; else q_a_proj -> RMSNorm(q_a_layernorm) -> q_b_proj
  int kv_lora_rank = 0;      ///< width of the compressed KV (kv_a_proj_with_mqa emits kv_lora_rank + qk_rope_head_dim)
  int qk_nope_head_dim = 0;  ///< per-head K/Q dims from kv_b_proj / q_proj that carry no position
  int qk_rope_head_dim = 0;  ///< shared single-head K slice (k_rot), appended to every head's K; never rotated
  int v_head_dim = 0;        ///< per-head V dim (MLA); attn_v_head_dim() is head_dim for the other families

  // Linear layers: Gated DeltaNet (Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet); KDA (Kimi: nk = nv =
  // linear_num_heads, dk = dv = linear_head_dim, three short convs over [q | k | v]); lightning attention (MiniMax,
  // Ring: nk = nv = num_attention_heads, dk = dv = head_dim, no short conv: linear_conv_kernel_dim = 0).
  int linear_num_key_heads = 0;    ///< nk (q and k heads)
  int linear_num_value_heads = 0;  ///< nv (a multiple of nk; value head j reads key head j / (nv/nk))
  int linear_key_head_dim = 0;     ///< dk
  int linear_value_head_dim = 0;   ///< dv
  int linear_conv_kernel_dim = 4;  ///< K of the depthwise causal conv1d; 0 = no short conv (lightning families)
  double linear_norm_eps = 1e-6;   ///< eps of the linear layers' output norm (= rms_norm_eps but for MiniMax, whose
                                   ///< MiniMaxRMSNorm(H*D) in MiniMaxLightningAttention keeps the default 1e-6)
  int lightning_block_size = 0;    ///< MiniMax block_size of the block-wise prefill (also the chunk of Ring's
                                   ///< chunked scan); the math is the per-token recurrence; 0 elsewhere
  int group_norm_size = 1;         ///< lightning output RMSNorm over H*D split into this many groups (Ring
                                   ///< group_norm_size; MiniMax 1)
  bool linear_rope = false;        ///< Ring: partial NeoX RoPE on q/k inside the linear layers (rotary_dim() dims)
  bool linear_qkv_silu = false;    ///< silu on the lightning q/k/v projection output before the split (MiniMax:
                                   ///< always; Ring: linear_silu / use_linear_silu, as sglang and vLLM apply it)

  // MLP / MoE (Qwen3NextSparseMoeBlock, Qwen3NextMLP).
  int64_t intermediate_size = 0;                ///< dense MLP width (Qwen3.5 dense; Qwen3-Next mlp_only_layers)
  int num_experts = 0;                          ///< E; 0 = dense model
  int num_experts_per_tok = 0;                  ///< top-k
  int64_t moe_intermediate_size = 0;            ///< I of each routed expert
  int64_t shared_expert_intermediate_size = 0;  ///< width of the shared expert (0 = none)
  bool norm_topk_prob = true;                   ///< renormalise the top-k probabilities (Qwen3.5-MoE: always true)
  int decoder_sparse_step = 1;                  ///< Qwen3-Next: layer i is MoE iff (i+1) % step == 0 (and below)
  std::vector<int> mlp_only_layers;             ///< layers with the dense MLP: Qwen3-Next mlp_only_layers; Kimi,
                                                ///< Ring: the first_k_dense_replace layers (Kimi: or mlp_layer_types)
  RouterScore router_score = RouterScore::Softmax;  ///< router score function
  bool router_bias = false;             ///< Sigmoid routers: a per-expert bias (e_score_correction_bias / expert_bias)
                                        ///< is added to the scores for the top-k choice only
  int n_group = 1;                      ///< Sigmoid routers: expert groups (group score = sum of its top-2 scores)
  int topk_group = 1;                   ///< Sigmoid routers: groups kept before the top-k
  double routed_scaling_factor = 1.0;   ///< Sigmoid routers: routed weights *= this (after renormalisation)
  bool shared_expert_gated = true;      ///< Qwen: shared expert scaled by sigmoid(shared_expert_gate x); else ungated

  // Residual scales of MiniMaxDecoderLayer (post-norm: x = alpha * norm(x) + beta * f(norm(x))); 1 elsewhere.
  double full_attn_alpha = 1.0, full_attn_beta = 1.0;      ///< after a softmax attention layer
  double linear_attn_alpha = 1.0, linear_attn_beta = 1.0;  ///< after a lightning layer
  double mlp_alpha = 1.0, mlp_beta = 1.0;                  ///< after the MoE block

  bool tie_word_embeddings = false;  ///< lm_head shares embed_tokens

  /// Hex digest identifying the weights (see weights_identity() in engine/checkpoint/safetensors.h); set by
  /// load_config() when it is given a checkpoint directory holding safetensors files, else empty.
  std::string weights_digest;

  // ---- derived quantities ----
  bool is_moe() const { return num_experts > 0; }
  /// True when layer i uses the sparse MoE block, false for the dense MLP (HF rule: num_experts > 0,
  /// i not in mlp_only_layers, (i+1) % decoder_sparse_step == 0). Throws std::out_of_range for bad i.
  bool is_moe_layer(int i) const;
  /// Channels of the depthwise conv: 2*nk*dk + nv*dv ([Q | K | V]; KDA: its three convs' channels concatenated).
  int64_t conv_dim() const;
  /// Rows of the conv tail a linear layer keeps: linear_conv_kernel_dim - 1, or 0 without a short conv.
  int conv_rows() const { return linear_conv_kernel_dim > 0 ? linear_conv_kernel_dim - 1 : 0; }
  /// Per-head V dim of the attention layers: v_head_dim for MLA (Kimi-Linear), else head_dim.
  int attn_v_head_dim() const { return family == ModelFamily::KimiLinear ? v_head_dim : head_dim; }
  /// Whether the KV cache (and a segment entry's attention part) holds MLA's compressed latent instead of per-head
  /// K/V: true for Kimi-Linear. Its rows are [RMSNorm(c_kv) * kv_a_layernorm.weight (kv_lora_rank values) | k_rot
  /// (qk_rope_head_dim values, kv_a_proj_with_mqa's last columns, never rotated)]; K/V are expanded from them per call.
  bool attention_is_latent() const { return family == ModelFamily::KimiLinear; }
  /// KV heads of the cache rows (H_kv of K [n][H_kv][kv_cache_k_dim()]): 1 when latent, else num_key_value_heads.
  int kv_cache_heads() const { return attention_is_latent() ? 1 : num_key_value_heads; }
  /// Floats per KV-cache head of K: kv_lora_rank + qk_rope_head_dim when latent, else head_dim.
  int kv_cache_k_dim() const { return attention_is_latent() ? kv_lora_rank + qk_rope_head_dim : head_dim; }
  /// Floats per KV-cache head of V: 0 when latent (no V is cached), else attn_v_head_dim() (= head_dim).
  int kv_cache_v_dim() const { return attention_is_latent() ? 0 : attn_v_head_dim(); }
  /// Whether the attention layers rotate q/k (every family but Kimi-Linear, whose MLA is NoPE).
  bool attention_has_rope() const { return family != ModelFamily::KimiLinear; }
  /// Whether the RMSNorms apply (1 + w) (Qwen) rather than w (every other family).
  bool zero_centred_norms() const { return family == ModelFamily::Qwen; }
  int64_t linear_q_dim() const { return int64_t(linear_num_key_heads) * linear_key_head_dim; }      ///< nk*dk
  int64_t linear_v_dim() const { return int64_t(linear_num_value_heads) * linear_value_head_dim; }  ///< nv*dv
  int rotary_dim() const;  ///< int(head_dim * partial_rotary_factor); 0 without RoPE (Kimi-Linear)
  int num_linear_layers() const;
  int num_attention_layers() const;
  /// Position of `layer` among the layers of its own type (e.g. 2nd linear layer -> 1).
  /// Throws std::invalid_argument if the layer is not of that type, std::out_of_range for a bad index.
  int linear_index(int layer) const;
  int attention_index(int layer) const;

  /// Recurrent-state bytes of one linear layer in fp32: nv*dk*dv*4 (S) + conv_rows()*conv_dim*4 (conv tail).
  int64_t linear_state_bytes() const;
  /// KV-cache bytes per token over all attention layers in fp32:
  /// n_attn * kv_cache_heads() * (kv_cache_k_dim() + kv_cache_v_dim()) * 4 (MLA: n_attn * (R + rope) * 4).
  int64_t kv_bytes_per_token() const;

  /// Checks internal consistency (positive sizes, divisibility nv % nk, nh % nkv, layer_types length,
  /// top-k <= experts, ...) and bounds (at most 4096 layers, heads and head dims, hidden 2^20, intermediate
  /// sizes 2^24, 65536 experts, vocabulary 2^31 - 1; finite eps and RoPE theta), which keep derived sizes
  /// from overflowing; throws std::invalid_argument naming the field and the values.
  void validate() const;

  /// Stable 32-hex-digit digest (XXH3-128) of the architecture fields above plus weights_digest:
  /// two configs differing in any field that changes the math, or with different weights, differ. The fields
  /// added for the Kimi / MiniMax / Ring families enter only for those families, so a Qwen config's digest is the
  /// one earlier versions computed.
  std::string fingerprint() const;
};

/// Parses a model configuration. `path` is either a config.json file or a checkpoint directory
/// holding config.json; for a directory that also holds safetensors files, weights_digest is set
/// from weights_identity(dir). Accepts flat configs (qwen3_next, qwen3_5_text, qwen3_5_moe_text,
/// kimi_linear, minimax, bailing_moe_linear) and nested ones (qwen3_5, qwen3_5_moe: fields read from
/// `text_config`); the field spellings of each family are documented in engine/families/<family>/config.h. RoPE fields are read from
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
