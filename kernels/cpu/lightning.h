// CPU reference kernels for lightning attention (MiniMax-Text-01, Ring-linear-2.0): linear attention with a constant
// scalar decay per head, no delta rule. fp32 throughout.
//
// State convention (kernels/cpu/gated_delta.h): one head's state S is d_k x d_v row-major, left-multiplied:
//     S_t = e^{-s_h} S_{t-1} + k_t v_t^T,     o_t = S_t^T q_t
// (MiniMaxLightningAttention.forward's decode loop: kv = ratio * kv + k^T v, o = q kv). A span transition is one
// scalar per head: T_C = e^{-s_h |C|} (stored as [H]).
#pragma once

namespace hypic::kernels::cpu {

/// Shapes of one lightning call.
struct LightningShape {
  int num_tokens = 0;  ///< T
  int num_heads = 0;   ///< H
  int d_k = 0;
  int d_v = 0;
};

/// Block-wise lightning attention (prefill), as MiniMaxLightningAttention.forward computes it without a cache, in
/// blocks of `block` tokens; per block of n tokens, with i, j in [0, n):
///   o_i = sum_{j <= i} e^{-s (i - j)} (q_i . k_j) v_j + e^{-s (i + 1)} q_i^T S
///   S  <- e^{-s n} S + sum_j e^{-s (n - 1 - j)} k_j v_j^T
///   q, k:  [T][H][d_k] (as the layer feeds them: MiniMax silu'd, Ring normed, rotated and scaled)
///   v:     [T][H][d_v]
///   slope: [H] decay rates s_h >= 0
///   state: [H][d_k][d_v] in/out
///   out:   [T][H][d_v] (may be nullptr)
///   transition: [H] out, optional: T_C = product of the blocks' e^{-s n}
/// Throws std::invalid_argument on bad shapes or null inputs.
void lightning_chunked(const LightningShape& shape, const float* q, const float* k, const float* v, const float* slope,
                       float* state, float* out, float* transition, int block);

/// Token-by-token lightning attention (decode, and the test oracle); same contract, transition = e^{-s T}
/// accumulated token by token.
void lightning_recurrent(const LightningShape& shape, const float* q, const float* k, const float* v,
                         const float* slope, float* state, float* out, float* transition);

}  // namespace hypic::kernels::cpu
