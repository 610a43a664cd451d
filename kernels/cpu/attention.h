// Causal grouped-query attention of a span of queries over a KV cache, CPU fp32.
// Math of HF eager_attention_forward (transformers 5.x): scores = (q k^T) * scale, causal mask,
// fp32 softmax, then P v; query head h reads KV head h / (num_heads / num_kv_heads) (repeat_kv).
#pragma once
#include <cstdint>

namespace hypic::kernels::cpu {

/// Shapes of one attention call.
struct AttentionShape {
  int64_t num_queries = 0;  ///< T, the span (its K/V are the LAST T rows of the cache)
  int64_t num_keys = 0;     ///< n_total >= T: cached tokens before the span plus the span itself
  int num_heads = 0;        ///< query heads, a multiple of num_kv_heads
  int num_kv_heads = 0;
  int head_dim = 0;         ///< q / k head dim
  int v_head_dim = 0;       ///< v / out head dim; 0 = head_dim (MLA: v_head_dim != qk head dim)
};

/// Query i of the span sits at cache index num_keys - T + i and attends to cache rows 0 ..= that index.
///   q:   [T][num_heads][head_dim]        (already normed and rotated)
///   k:   [num_keys][num_kv_heads][head_dim]
///   v:   [num_keys][num_kv_heads][v_head_dim]
///   out: [T][num_heads][v_head_dim]
///   scale: multiplies q.k (head_dim^-1/2 for Qwen3-Next / Qwen3.5).
/// Queries are processed in blocks so the score buffer stays O(block x num_keys).
/// key_mass (optional, [num_keys] fp32, host): each key row's attention probability summed over all heads and over
/// the LAST key_mass_queries queries of the span (all of them by default) is ADDED to it (the attention a query pays
/// to each cached token: how a splice finds the segments a query reads, engine/cpu/splice.h
/// SpliceRequest::refresh_segments).
/// Throws std::invalid_argument on inconsistent shapes (num_keys < T, heads not divisible).
void attention_causal(const AttentionShape& shape, const float* q, const float* k, const float* v, float scale,
                      float* out, float* key_mass = nullptr, int64_t key_mass_queries = INT64_MAX);

}  // namespace hypic::kernels::cpu
