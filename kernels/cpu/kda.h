// CPU reference kernels for Kimi Delta Attention (KDA, Kimi-Linear): the delta rule with a channel-wise
// (per key dim) decay. fp32 throughout.
//
// State convention (as everywhere in hypic, kernels/cpu/gated_delta.h): one head's state S is d_k x d_v row-major
// and the recurrence left-multiplies:
//     S_t = (I - b_t k_t k_t^T) diag(e^{g_t}) S_{t-1} + b_t k_t v_t^T,     o_t = S_t^T q_t
// i.e. S <- diag(e^{g_t}) S; S <- S + b_t k_t (v_t - S^T k_t)^T (transformers 5.17 recurrent_kimi_delta_attention /
// chunk_kimi_delta_attention, fla naive_recurrent_kda). Per layer the state is [H][d_k][d_v], a span transition
// T_C = T_{t_n} ... T_{t_1} is [H][d_k][d_k] (dense).
#pragma once

namespace hypic::kernels::cpu {

/// Shapes of one KDA call (q/k and v have the same number of heads).
struct KdaShape {
  int num_tokens = 0;  ///< T
  int num_heads = 0;   ///< H
  int d_k = 0;
  int d_v = 0;
};

/// Inputs of one span, all fp32, token-major:
///   q, k: [T][H][d_k], ALREADY l2-normalised; q ALREADY scaled by d_k^-1/2
///   v:    [T][H][d_v]
///   g:    [T][H][d_k] per-channel log decay (<= 0)
///   beta: [T][H] write strength (post-sigmoid)
struct KdaInputs {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* g = nullptr;
  const float* beta = nullptr;
};

/// Chunked KDA (prefill), `chunk` tokens per chunk (64 as transformers' chunk_kimi_delta_attention): within a chunk
/// with G_i the inclusive cumulative log decay (a d_k vector), A_ij = b_i sum_d k_i[d] k_j[d] e^{G_i[d] - G_j[d]}
/// (j < i), (I + A) [U | W] = [diag(b) V | diag(b) (K o e^G)], Vnew = U - W S,
/// o_i = (q_i o e^{G_i})^T S + sum_{j <= i} (sum_d q_i[d] k_j[d] e^{G_i[d] - G_j[d]}) Vnew_j,
/// S' = diag(e^{G_L}) S + K~^T Vnew with K~_j = k_j o e^{G_L - G_j}; the chunk's transition is diag(e^{G_L}) - K~^T W.
///   state:      [H][d_k][d_v] in/out
///   out:        [T][H][d_v] outputs (may be nullptr)
///   transition: [H][d_k][d_k] out, optional: the span's T_C from the same pass
/// T = 0 is allowed (state unchanged, transition = I). Throws std::invalid_argument on bad shapes / null inputs.
void kda_chunked(const KdaShape& shape, const KdaInputs& in, float* state, float* out, float* transition,
                 int chunk = 64);

/// Token-by-token KDA (decode, and the test oracle): same contract as kda_chunked.
void kda_recurrent(const KdaShape& shape, const KdaInputs& in, float* state, float* out, float* transition);

}  // namespace hypic::kernels::cpu
