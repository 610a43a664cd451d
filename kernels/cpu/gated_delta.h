// CPU reference kernels for the gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5) and the
// depthwise causal conv1d in front of it. fp32 throughout. These are the reference that the CUDA
// kernels in kernels/cuda are tested against, and the kernels the CPU engine runs.
//
// State convention (used everywhere in hypic): one head's state S is d_k x d_v, row-major
// ([d_k][d_v]), and the recurrence left-multiplies:
//     S_t = T_t S_{t-1} + u_t,   T_t = e^{g_t} (I - b_t k_t k_t^T),   u_t = b_t k_t v_t^T,
//     o_t = S_t^T q_t                                   (output uses the updated state)
// A transition T is d_k x d_k, row-major. Per layer the state is [H_v][d_k][d_v].
// Source: DESIGN.md 3.1; HF transformers torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule
// (modeling_qwen3_5.py); docs/research/hybrid_models.md sections 1.5 and 5.4 (T = gamma I - K~^T W).
#pragma once
#include <cstddef>
#include <cstdint>

namespace hypic::kernels::cpu {

/// Shapes of one gated-delta call. Value head j reads key head j / (num_v_heads / num_k_heads) (GVA).
struct GatedDeltaShape {
  int num_tokens = 0;   ///< T, tokens in the span
  int num_k_heads = 0;  ///< H_k
  int num_v_heads = 0;  ///< H_v, a multiple of H_k
  int d_k = 0;          ///< key head dim
  int d_v = 0;          ///< value head dim
};

/// Inputs of one span, all fp32, token-major:
///   q, k: [T][H_k][d_k], ALREADY l2-normalised; q ALREADY scaled by d_k^-1/2
///   v:    [T][H_v][d_v]
///   g:    [T][H_v]  log decay (<= 0)
///   beta: [T][H_v]  write strength (post-sigmoid)
struct GatedDeltaInputs {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* g = nullptr;
  const float* beta = nullptr;
};

/// Chunked gated delta rule (prefill), chunk size `chunk` tokens (64 matches HF).
///   state:      [H_v][d_k][d_v] in/out: the initial state on entry, the final state on exit.
///   out:        [T][H_v][d_v] per-token outputs o_t = S_t^T q_t (may be nullptr when not needed).
///   transition: [H_v][d_k][d_k] out, optional (nullptr = skip): the span's cumulative transition
///               T_C = T_{t_n} ... T_{t_1}, produced in the same chunked pass (DESIGN.md 3.1).
/// T = 0 is allowed (state unchanged, transition = I).
void gated_delta_chunked(const GatedDeltaShape& shape, const GatedDeltaInputs& in, float* state, float* out,
                         float* transition, int chunk = 64);

/// Recurrent (token-by-token) gated delta rule: same contract as gated_delta_chunked, the literal
/// recurrence; used for decode (T = 1) and as the test oracle. transition may be nullptr.
void gated_delta_recurrent(const GatedDeltaShape& shape, const GatedDeltaInputs& in, float* state, float* out,
                           float* transition);

/// Depthwise causal conv1d + SiLU over channels (PyTorch cross-correlation convention).
///   x:          [T][C] pre-conv inputs (token-major)
///   weight:     [C][K] (HF conv1d.weight [C,1,K] squeezed); weight[c][K-1] multiplies the current token
///   conv_state: [K-1][C] in/out: the K-1 inputs preceding x (zeros at a sequence start); on exit the
///               last K-1 inputs of (conv_state ++ x), i.e. the conv tail.
///   y:          [T][C] out: silu(sum_j weight[c][j] * x[c, t-(K-1)+j])
void causal_conv1d_silu(int num_tokens, int channels, int kernel, const float* x, const float* weight,
                        float* conv_state, float* y);

}  // namespace hypic::kernels::cpu
