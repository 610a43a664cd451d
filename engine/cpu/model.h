// The CPU fp32 forward pass of the hybrid families (ModelFamily) with an incremental API that is explicit about
// state, so segment entries and splicing (engine/segment.h, engine/cpu/splice.h) can be built on it. The math
// reproduces Hugging Face transformers 5.17 run in fp32 with its pure-torch fallbacks: Qwen3NextForCausalLM /
// Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (docs/research/hybrid_models.md 1.4-1.7), KimiLinearForCausalLM (2),
// MiniMaxForCausalLM (4); Ring-linear-2.0 (3) follows tools/ring_linear_reference.py. The Kimi / MiniMax / Ring
// mixers live in engine/families/.
//
// State conventions (shared with kernels/cpu/gated_delta.h, kda.h, lightning.h):
//  - a linear layer's recurrent state is [H_v][d_k][d_v] fp32, S_t = T_t S_{t-1} + u_t, T_t left-multiplying:
//    Gated DeltaNet T_t = e^{g_t}(I - b_t k_t k_t^T), KDA T_t = (I - b_t k_t k_t^T) diag(e^{g_t}) (span transition
//    T_C dense [H_v][d_k][d_k]); lightning T_t = e^{-s_h} I (T_C one scalar per head, [H]);
//  - its conv state holds the last K-1 pre-convolution inputs (the conv tail), [K-1][conv_dim], oldest first,
//    zeros at a sequence start (KDA: its q, k and v convs' channels concatenated, [K-1][3 H d]); lightning layers
//    have no short conv and an empty conv state (ModelConfig::conv_rows() == 0);
//  - a full-attention layer's KV cache holds K and V of every token seen, K [n][kv_cache_heads()][kv_cache_k_dim()]
//    and V [n][kv_cache_heads()][kv_cache_v_dim()] (ModelConfig), with K already RoPE-rotated at the position that
//    token had when it was computed (where the family has RoPE): K [n][H_kv][head_dim], V [n][H_kv][head_dim]. MLA
//    (Kimi-Linear) stores its compressed latent instead: K [n][1][kv_lora_rank + qk_rope] = [RMSNorm(c_kv) *
//    kv_a_layernorm.weight | k_rot] per token, V empty; each call expands every cached row through kv_b_proj into
//    per-head K [nh][qk_nope | k_rot] and V [nh][v_head_dim]; nothing is rotated (NoPE).
//  - Ring-linear rotates q and k inside its linear layers, so a linear state made at positions a.. holds keys
//    rotated for those positions (re-rotation by the key axis moves it, DESIGN.md 3.3).
// Linear layers and attention layers are indexed among their own type (ModelConfig::linear_index /
// attention_index).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <functional>
#include <filesystem>
#include <span>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/model_state.h"
#include "engine/transition.h"

namespace hypic::engine {

/// Options of one prefill call.
struct PrefillOptions {
  bool all_logits = false;           ///< logits for every position of the span, else only the last
  bool capture_transitions = false;  ///< return each linear layer's span transition T_span
  bool skip_logits = false;          ///< no final norm / LM head: logits stays empty (seams, entry builds)
  /// If set: resized to the KV cache length after the call (tokens) and filled with, per cached token, the
  /// attention probability the LAST TOKEN of the last span pays it, summed over every full-attention layer and head
  /// (fp32, host; a total of heads * attention layers). The last token is the one whose logits pick the next token:
  /// what it reads is what the answer comes from. What SpliceRequest::refresh_segments ranks segments by. All zeros
  /// for a model without full-attention layers.
  std::vector<float>* attention_mass = nullptr;
  /// If set, asked before each decoder layer; when it answers true the prefill stops there and throws
  /// PrefillCancelled (the state is then half-advanced: discard it). What lets a cancelled entry build stop within
  /// one layer's time.
  std::function<bool()> cancelled;
};

/// Thrown by a prefill whose PrefillOptions::cancelled answered true.
class PrefillCancelled : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Result of one prefill call.
struct PrefillResult {
  std::vector<float> logits;                     ///< [T][V] (all_logits) or [1][V], fp32; empty if skip_logits
  std::vector<std::vector<float>> transitions;   ///< per linear layer T_span if captured, else empty; layout by
                                                 ///< transition_kind: Dense [H_v][d_k][d_k], Scalar [H_v]
  TransitionKind transition_kind = TransitionKind::Dense;  ///< Dense (Gated DeltaNet, KDA) or Scalar (lightning)
};

/// The compact form of a linear layer's span transition T_C for this config's family (DESIGN.md 3.1): Dense
/// [H_v][d_k][d_k] for Gated DeltaNet (Qwen) and KDA (Kimi-Linear), Scalar [H_v] for lightning attention (MiniMax,
/// Ring-linear). What PrefillResult::transition_kind reports.
TransitionKind linear_transition_kind(const ModelConfig& cfg);

/// One span of a multi-span prefill: token ids and the RoPE position of its first token.
struct SpanSpec {
  std::span<const int32_t> ids;
  int64_t start_position = 0;
};

/// Called by Model::prefill_spans after span `span`'s token mixer at decoder layer `layer` (0-based over all
/// layers): it may edit that layer's state (ModelState::linear[linear_index] or attention[attention_index]) before
/// the next span's mixer runs at the same layer.
using SpanLayerHook = std::function<void(size_t span, int layer, ModelState& state)>;

/// A loaded model: configuration plus fp32 weights. Immutable after construction; all methods are const
/// and safe to call from several threads at once on different states.
class Model {
 public:
  /// Loads config.json and the safetensors weights of `dir` (load_config + load_weights).
  /// Throws whatever those throw (std::runtime_error / std::invalid_argument naming the file or tensor).
  static Model load(const std::filesystem::path& dir);

  /// Takes ownership of a configuration and matching weights. Validates the config and the shape of every
  /// tensor the forward pass reads; throws std::invalid_argument naming the tensor and both shapes.
  Model(ModelConfig config, ModelWeights weights);

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }

  /// Zero linear and conv states, empty KV caches, num_tokens = 0.
  ModelState initial_state() const;

  /// Runs a span of tokens from `state` with RoPE positions start_position .. start_position + T - 1.
  /// Linear layers continue from their recurrent and conv states with the family's chunked scan (gated delta rule
  /// and KDA: chunk 64; lightning: lightning_block_size); attention layers append the span's K/V to their caches and attend to every cached token
  /// plus causally within the span. `state` is updated in place (num_tokens and every n_tokens grow by T).
  /// start_position is free (a splice places spans at arbitrary positions; it need not equal
  /// state.num_tokens) but must be >= 0.
  /// Throws std::invalid_argument for an empty span, a token id outside [0, vocab_size), a negative
  /// start_position, or a state whose shapes do not match the model; the state is left untouched then.
  PrefillResult prefill(ModelState& state, std::span<const int32_t> ids, int64_t start_position,
                        const PrefillOptions& options = {}) const;

  /// Several spans as one pass, layer by layer (how a splice runs all its seam windows and the query at once):
  /// at each decoder layer the spans' token mixers run in order on the running state, with `after_mixer` called
  /// after each span's mixer; the token-wise parts (norms, MLP / MoE) run over all spans' tokens together, so
  /// the weights are read once per layer instead of once per span. Equals prefilling the spans one after another
  /// with the hook's edits applied between them, provided the hook at layer l only edits layer l's state.
  /// Logits, options and errors as prefill(), for the LAST span's tokens. state.num_tokens grows by the spans'
  /// tokens (edits by the hook are the caller's to count).
  PrefillResult prefill_spans(ModelState& state, std::span<const SpanSpec> spans, const SpanLayerHook& after_mixer,
                              const PrefillOptions& options = {}) const;

  /// One decode step at `position` with the literal (token-by-token) recurrence in the linear layers.
  /// Returns the next-token logits [V]. Same validation and state update as prefill with T = 1.
  std::vector<float> decode(ModelState& state, int32_t id, int64_t position) const;

  /// Rotates already-rotated keys k [n_tokens][heads][head_dim] by position_delta more positions in place
  /// (partial NeoX RoPE on the first rotary_dim dims; R(p + d) = R(d) R(p)), e.g. to move cached K from
  /// local to real positions. position_delta may be negative. Throws std::invalid_argument for a model without
  /// RoPE (Kimi-Linear).
  void rope_rotate(float* k, int64_t n_tokens, int heads, int64_t position_delta) const;

  /// Whether the linear layers rotate q and k by RoPE (Ring-linear: linear_rope), so that a linear state holds keys
  /// rotated at the positions its tokens had and must be re-rotated to be used elsewhere (rotate_linear_state).
  bool linear_states_rotate() const { return config_.linear_rope && config_.num_linear_layers() > 0; }

  /// Re-rotates one linear layer's state ssm [H_v][d_k][d_v] (fp32, in place) on the key axis by position_delta
  /// positions: S(C|a + d) = R(d) S(C|a) (DESIGN.md 3.3), with R(d) the partial NeoX RoPE rotation of the linear
  /// layers' keys (rotary_dim() dims, pairs (i, i + rotary_dim/2)) at angle d * inv_freq. Exact for S(C|a) since
  /// S = sum_t w_t R(p_t) k_t v_t^T with scalar weights w_t (the decay per head commutes with R), up to the fp32
  /// rounding of the angles (R(a) R(d) vs R(a + d)). Throws std::invalid_argument when !linear_states_rotate() or
  /// ssm.size() != H_v * d_k * d_v.
  void rotate_linear_state(std::span<float> ssm, int64_t position_delta) const;

  /// Checks that `state` has the layer counts and tensor sizes of this model; throws std::invalid_argument
  /// naming the layer and the sizes otherwise.
  void validate_state(const ModelState& state) const;

 private:
  enum class LinearMode { Chunked, Recurrent };
  struct Scratch;
  PrefillResult forward(ModelState& state, std::span<const SpanSpec> spans, const SpanLayerHook* after_mixer,
                        const PrefillOptions& options, LinearMode mode) const;
  void attention_layer(const LayerWeights& lw, AttentionLayerState& st, const float* x, int64_t T,
                       int64_t start_position, Scratch& s, float* out, float* key_mass) const;
  void moe_block(const MoeWeights& w, const float* x, int64_t T, Scratch& s, float* out) const;
  void mlp_block(const MlpWeights& w, int64_t width, const float* x, int64_t T, Scratch& s, float* out) const;

  ModelConfig config_;
  ModelWeights weights_;
  std::vector<float> inv_freq_;  ///< RoPE inverse frequencies over rotary_dim
  bool renormalize_topk_ = true;
};

}  // namespace hypic::engine
