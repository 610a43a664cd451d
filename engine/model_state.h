// The state a model carries between spans of tokens, in the CPU engine's host layout (fp32): per linear-attention
// layer the recurrent state and the conv tail, per full-attention layer the KV cache. Used by the CPU engine
// (engine/cpu/model.h), by backends for host copies of a sequence (engine/backend.h Sequence::to_host) and by tests.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace hypic::engine {

/// Recurrent state of one Gated DeltaNet layer.
struct LinearLayerState {
  std::vector<float> ssm;   ///< [H_v][d_k][d_v] fp32
  std::vector<float> conv;  ///< [conv_rows][conv_dim] fp32, the last K-1 pre-conv inputs (oldest first); empty for
                            ///< lightning layers
};

/// KV cache of one full-attention layer.
struct AttentionLayerState {
  /// [n_tokens][kv_cache_heads()][kv_cache_k_dim()] (ModelConfig): [n][H_kv][head_dim], RoPE-rotated at each
  /// token's own position; MLA (Kimi-Linear): the latent [n][1][kv_lora_rank + qk_rope_head_dim], rows
  /// [RMSNorm(c_kv) * kv_a_layernorm.weight | k_rot], not rotated
  std::vector<float> k;
  /// [n_tokens][kv_cache_heads()][kv_cache_v_dim()]: [n][H_kv][head_dim]; MLA: empty (0 floats per token)
  std::vector<float> v;
  int64_t n_tokens = 0;
};

/// Everything the model carries between spans.
struct ModelState {
  std::vector<LinearLayerState> linear;        ///< one per linear layer, in layer order
  std::vector<AttentionLayerState> attention;  ///< one per full-attention layer, in layer order
  int64_t num_tokens = 0;                      ///< tokens consumed so far (prefill/decode add T)
  /// Bytes held by the tensors (ssm, conv, K, V).
  size_t byte_size() const;
};

}  // namespace hypic::engine
