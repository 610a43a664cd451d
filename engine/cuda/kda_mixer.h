// The KDA layer (Kimi-Linear's linear mixer, HF KimiDeltaAttention) on the GPU: its projections through cuBLASLt
// (kernels/cuda/gemm.h) around the short convolutions (kernels/cuda/gated_delta.h conv1d_silu_*) and the KDA
// kernels (kernels/cuda/kda.h),
//   q, k, v = silu(causal conv(W_qkv x))                 (three depthwise convs, one launch over [q | k | v])
//   g       = -exp(A_log) softplus(f_b(f_a x) + dt_bias),  beta = sigmoid(b x)
//   o       = KDA(l2norm(q) d^-1/2, l2norm(k), v; g, beta)  (state carried per sequence, T_C optional)
//   y      += o_proj(RMSNorm_head(o) o_norm * sigmoid(g_b(g_a x)))
// The CPU form is engine/families/kimi_linear kda_layer (the test oracle). All pointers are DEVICE pointers; every
// call is asynchronous on `stream`.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>

#include "engine/checkpoint/config.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/kda.h"

namespace hypic::engine::cuda {

/// One KDA layer's weights on the device, bf16 row-major unless said (engine/checkpoint/weights.h KdaWeights, with
/// the projections that share an input stacked so that each is one GEMM).
struct DevKda {
  const __nv_bfloat16* qkv_proj = nullptr;  ///< [3 H d][hidden]: q_proj rows, k_proj rows, v_proj rows
  const __nv_bfloat16* conv1d = nullptr;    ///< [3 H d][K] depthwise conv weights, channels [q | k | v]
  const __nv_bfloat16* low_proj = nullptr;  ///< [2 d + H][hidden]: f_a_proj rows, g_a_proj rows, b_proj rows
  const __nv_bfloat16* f_b_proj = nullptr;  ///< [H d][d]
  const __nv_bfloat16* g_b_proj = nullptr;  ///< [H d][d]
  const float* A_log = nullptr;             ///< [H] fp32
  const float* dt_bias = nullptr;           ///< [H d] fp32
  const __nv_bfloat16* o_norm = nullptr;    ///< [d]
  const __nv_bfloat16* o_proj = nullptr;    ///< [hidden][H d]
};

/// What the model config says about its KDA layers.
struct KdaLayerConfig {
  int hidden = 0, heads = 0, head_dim = 0, conv_kernel = 0;
  float eps = 1e-6f;     ///< the output norm's (rms_norm_eps)
  float scale = 1.0f;    ///< d^-1/2
  float out_scale = 1.0f;  ///< o_proj's output is added times this (1 for Kimi-Linear)
  /// Row stride of the scratch `low` (2 d + H rounded up to a multiple of 8 elements: 16-byte rows for cuBLASLt).
  int low_width() const { return (2 * head_dim + heads + 7) / 8 * 8; }
  /// From a Kimi-Linear config. Throws std::invalid_argument when its KDA head size is not 128 (the kernels' size),
  /// key and value heads or sizes differ, the conv kernel is outside [2, 8], or the family has no KDA layers.
  static KdaLayerConfig of(const ModelConfig& c);
};

/// Scratch of one mixer call of T tokens: bf16 pre [T][3 H d], q, k, v, graw, o, gate [T][H d] each, low
/// [T][low_width()]; fp32 g [T][H d], beta [T][H]; the KDA prefill's workspace (kda_prefill_workspace_bytes).
struct KdaScratch {
  __nv_bfloat16 *pre = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *low = nullptr, *graw = nullptr,
                *o = nullptr, *gate = nullptr;
  float *g = nullptr, *beta = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

/// Prefill of a varlen batch: xn [T][hidden] bf16 (the layer's normed input); `seqs` gives the sequences and states
/// (num_seqs, cu_seqlens, total_tokens, initial_state, final_state, transition; the rest is filled here);
/// conv_state: [num_seqs][K-1][3 H d] bf16 in/out (the tails before and after each sequence), or nullptr (zero
/// history, tails not kept); y [T][hidden] fp32 += the layer's output. Throws std::invalid_argument for T > 0 without
/// sequences, and what the kernels and GemmRunner throw.
void kda_mixer_prefill(kernels::cuda::GemmRunner& gemm, const DevKda& w, const KdaLayerConfig& c, int T,
                       const __nv_bfloat16* xn, kernels::cuda::KdaPrefillArgs seqs, __nv_bfloat16* conv_state,
                       const KdaScratch& s, float* y, cudaStream_t stream);

/// The layer's first half over a varlen batch of T tokens (num_seqs sequences, cu_seqlens DEVICE int32
/// [num_seqs + 1]): the q/k/v projection and the three short convs (conv_state as in kda_mixer_prefill) into s.q,
/// s.k, s.v, the gates into s.g, s.beta, s.gate (the inputs of kda_prefill and kda_mixer_finish).
void kda_mixer_project(kernels::cuda::GemmRunner& gemm, const DevKda& w, const KdaLayerConfig& c, int T,
                       const __nv_bfloat16* xn, int num_seqs, const int* cu_seqlens, __nv_bfloat16* conv_state,
                       const KdaScratch& s, cudaStream_t stream);

/// The layer's second half: y [T][hidden] fp32 += out_scale o_proj(RMSNorm_head(s.o) o_norm * sigmoid(s.gate)).
void kda_mixer_finish(kernels::cuda::GemmRunner& gemm, const DevKda& w, const KdaLayerConfig& c, int T,
                      const KdaScratch& s, float* y, cudaStream_t stream);

/// One decode step of `batch` sequences: xn [batch][hidden]; states in slot pools (state [slots][H][128][128] fp32,
/// conv_state [slots][K-1][3 H d] bf16), request b in slot state_slots[b] (DEVICE int32, or nullptr: slot b);
/// y [batch][hidden] fp32 +=.
void kda_mixer_decode(kernels::cuda::GemmRunner& gemm, const DevKda& w, const KdaLayerConfig& c, int batch,
                      const __nv_bfloat16* xn, float* state, __nv_bfloat16* conv_state, const int* state_slots,
                      const KdaScratch& s, float* y, cudaStream_t stream);

}  // namespace hypic::engine::cuda
