// CUDA kernels of Kimi Delta Attention (KDA, Kimi-Linear's linear layers): the chunked prefill with the segment
// transition T_C from the same pass, the recurrent decode step, and the forget gate.
//
// Conventions are those of kernels/cpu/kda.h, the reference these kernels are tested against: one head's state S is
// d_k x d_v fp32 row-major ([d_k][d_v]), left-multiplied,
//     S_t = (I - b_t k_t k_t^T) diag(e^{g_t}) S_{t-1} + b_t k_t v_t^T,     o_t = S_t^T q_t,
// with a per-channel log decay g_t (a d_k vector, <= 0); a span transition T_C = T_{t_n} ... T_{t_1} is d_k x d_k
// fp32 row-major (dense, as for Gated DeltaNet: composed by compose_fold of kernels/cuda/gated_delta.h).
// Head size d_k = d_v = 128 (Kimi-Linear's); q, k and v have the same number of heads.
//
// All pointers are device pointers unless named *_host; every call is asynchronous on `stream` and throws
// std::invalid_argument for bad shapes, null or misaligned pointers and std::runtime_error for CUDA errors.
// Source of the chunked form: the WY representation of the delta rule with per-channel decay (transformers 5.17
// chunk_kimi_delta_attention, flash-linear-attention chunk_kda; DESIGN.md 3.1 for T_C): per chunk of L tokens with
// G_i the inclusive cumulative log decay, A_ij = b_i sum_d k_i[d] k_j[d] e^{G_i[d] - G_j[d]} (j < i),
// (I + A) [U | W] = [diag(b) V | diag(b) (K o e^G)], Vnew = U - W S, o = (Q o e^G) S + P Vnew with
// P_ij = sum_d q_i[d] k_j[d] e^{G_i[d] - G_j[d]} (j <= i), S' = diag(e^{G_L}) S + K~^T Vnew with
// K~_j = k_j o e^{G_L - G_j}, and the chunk's transition diag(e^{G_L}) - K~^T W.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace hypic::kernels::cuda {

using bf16 = __nv_bfloat16;

/// Head size of the KDA kernels (d_k = d_v).
inline constexpr int kKdaHeadDim = 128;
/// Chunk length of the chunked prefill (tokens).
inline constexpr int kKdaChunk = 64;

/// One chunked KDA prefill over `num_seqs` independent sequences (segments) packed back to back along the token axis.
struct KdaPrefillArgs {
  int num_seqs = 0;
  const int* cu_seqlens = nullptr;  ///< DEVICE int32 [num_seqs + 1], 0 first, non-decreasing (lengths may be 0)
  int total_tokens = 0;             ///< HOST: T = cu_seqlens[num_seqs] (sizes the launch and the workspace)
  int num_heads = 0;                ///< H (q, k, v heads)
  const bf16* q = nullptr;          ///< [T][H][128] raw (l2-normalised and scaled in-kernel when l2norm_qk)
  const bf16* k = nullptr;          ///< [T][H][128]
  const bf16* v = nullptr;          ///< [T][H][128]
  const float* g = nullptr;         ///< [T][H][128] per-channel log decay (<= 0; kda_gate)
  const float* beta = nullptr;      ///< [T][H] write strength, post sigmoid
  bool l2norm_qk = true;            ///< q, k <- x * rsqrt(sum x^2 + 1e-6) in fp32 (HF use_qk_l2norm_in_kernel)
  float scale = 0.08838834764831845f;    ///< q multiplier after the l2 norm (d_k^-1/2)
  const float* initial_state = nullptr;  ///< [num_seqs][H][128][128] fp32, or nullptr (zero state)
  float* final_state = nullptr;     ///< [num_seqs][H][128][128] fp32 or nullptr; may alias initial_state
  float* transition = nullptr;      ///< [num_seqs][H][128][128] fp32 T_C, or nullptr (not computed)
  bf16* out = nullptr;              ///< [T][H][128] o_t, bf16, or nullptr
  void* workspace = nullptr;        ///< DEVICE scratch of kda_prefill_workspace_bytes(args) bytes
  size_t workspace_bytes = 0;
};

/// Device scratch of kda_prefill for `a`, bytes: the per-chunk factors (W, U, K~, Q o e^G and P in bf16, e^{G_L} in
/// fp32: 72.5 KB per chunk and head) for at most num_seqs + ceil(T / 64) chunks, and the chunk table. Throws std::invalid_argument on the shape errors kda_prefill rejects.
size_t kda_prefill_workspace_bytes(const KdaPrefillArgs& a);

/// Chunked KDA prefill (chunk 64): per sequence and head the outputs, the final state and optionally T_C, all from
/// one pass. Launches: the chunk table (one block), the per-chunk factors (one block per chunk and head: cumulative
/// decays, the pairwise-decayed A and P in fp32, the unit lower-triangular solve for U and W in fp32 registers), then
/// the sequential scan (one block per sequence, head and 64 columns of S, plus, with T_C, 64 columns of T: the
/// columns stay in fp32 registers across the chunks; the tensor cores get bf16 operands, as in
/// flash-linear-attention). No host synchronisation or copies: capturable in a CUDA graph. A sequence of length 0
/// yields final = initial, T_C = I. q, k, v, out and the states must be 16-byte aligned.
/// Throws std::invalid_argument on null required or misaligned pointers, num_seqs outside [0, 65535], H outside
/// [1, 65535], total_tokens < 0, or a workspace smaller than kda_prefill_workspace_bytes; std::runtime_error on CUDA
/// errors. cu_seqlens is read on the device only: when it does not start at 0, end at total_tokens and never
/// decrease, nothing is read or written by its rows and the final states (and T_C) are set to NaN (the kernels
/// cannot throw).
void kda_prefill(const KdaPrefillArgs& args, cudaStream_t stream = nullptr);

/// One recurrent decode step for `batch` requests (one token each), in place on fp32 states, fp32 throughout:
///   S <- diag(e^{g}) S; d = b (v - S^T k); S <- S + k d^T; o = S^T q   (HF recurrent_kimi_delta_attention)
///   q, k, v: [batch][H][128] bf16 (q, k raw: l2-normalised and q scaled in-kernel when l2norm_qk);
///   g: [batch][H][128] fp32; beta: [batch][H] fp32; state: [batch][H][128][128] fp32; out: [batch][H][128] bf16
///   (nullable); state_slots: nullptr, or DEVICE int32 [batch]: request b's state is state[state_slots[b]] of a slot
///   pool (distinct slots). One block per (request, head, 32 state columns).
/// Throws std::invalid_argument on batch < 0, H outside [1, 65535] or null inputs.
void kda_decode(int batch, int num_heads, const bf16* q, const bf16* k, const bf16* v, const float* g,
                const float* beta, bool l2norm_qk, float scale, float* state, bf16* out, cudaStream_t stream = nullptr,
                const int* state_slots = nullptr);

/// KDA's forget gate (HF KimiLinearForgetGate / fused_kda_gate): g[t][h][d] = -exp(A_log[h]) softplus(x[t][h][d] +
/// dt_bias[h][d]), softplus(y) = y for y > 20 else log(1 + e^y), fp32. x: [tokens][H][128] bf16 (f_b_proj output);
/// A_log: [H] fp32; dt_bias: [H][128] fp32; g: [tokens][H][128] fp32 out. With b (bf16 [tokens][H], row stride ldb:
/// the b_proj output) also beta[t][h] = sigmoid(b[t][h]) fp32 [tokens][H]. Throws std::invalid_argument on negative
/// tokens, H <= 0, null pointers, or b without beta or with ldb < H.
void kda_gate(int tokens, int num_heads, const bf16* x, const float* A_log, const float* dt_bias, float* g,
              cudaStream_t stream = nullptr, const bf16* b = nullptr, long ldb = 0, float* beta = nullptr);

}  // namespace hypic::kernels::cuda
