// The lightning-attention layer (the linear mixer of MiniMax-Text-01 and Ring-linear-2.0) on the GPU: its
// projections through cuBLASLt (kernels/cuda/gemm.h) around the lightning kernels (kernels/cuda/lightning.h),
//   q, k, v = prepare(qkv_proj x)            (MiniMax: silu; Ring: RMSNorm of q and k, partial RoPE, q * d^-1/2)
//   o       = lightning(q, k, v)             (state carried per sequence, T_C optional)
//   y      += out_proj(sigmoid(gate x) * grouped RMSNorm(o) * norm)
// as HF MiniMaxLightningAttention / BailingMoeV2's linear attention compute it; the CPU forms are
// engine/families/minimax lightning_layer and engine/families/ring_linear lightning_layer (the test oracles).
// All pointers are DEVICE pointers; every call is asynchronous on `stream`.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>

#include "engine/checkpoint/config.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lightning.h"

namespace hypic::engine::cuda {

/// One lightning layer's weights on the device, bf16 row-major (engine/checkpoint/weights.h LightningWeights).
struct DevLightning {
  const __nv_bfloat16* qkv_proj = nullptr;  ///< [3 H d][hidden]: q heads, then k heads, then v heads
  const __nv_bfloat16* gate = nullptr;      ///< [H d][hidden] output gate
  const __nv_bfloat16* norm = nullptr;      ///< [H d] output RMSNorm weight (applied as w)
  const __nv_bfloat16* out_proj = nullptr;  ///< [hidden][H d]
  const __nv_bfloat16* q_norm = nullptr;    ///< [d] (Ring with use_qk_norm), else nullptr
  const __nv_bfloat16* k_norm = nullptr;    ///< [d]
  const float* slope = nullptr;             ///< [H] fp32 decay rates
};

/// What the model config says about its lightning layers.
struct LightningLayerConfig {
  int hidden = 0, heads = 0, head_dim = 0, groups = 1;
  bool qkv_silu = false;
  bool qk_norm = false;
  float qk_norm_eps = 1e-6f;  ///< rms_norm_eps
  float norm_eps = 1e-6f;     ///< linear_norm_eps (the output norm)
  int rope_half = 0;          ///< rotary_dim / 2 when the layer applies RoPE (Ring's linear_rope), else 0
  float scale = 1.0f;         ///< q multiplier (Ring: d^-1/2; MiniMax: 1)
  float out_scale = 1.0f;     ///< out_proj's output is added times this (MiniMax's linear_attn_beta; 1 elsewhere)
  /// From the config of a lightning family (MiniMax, Ring-linear). Throws std::invalid_argument when the head size
  /// is one the kernels do not support (kernels/cuda lightning_head_dim_supported) or the family is not one of them.
  static LightningLayerConfig of(const ModelConfig& c);
};

/// Scratch of one mixer call of T tokens, bf16 [T][..]: qkv 3 H d wide, q, k, v, o and gate H d wide each; plus the
/// lightning prefill's workspace (kernels/cuda lightning_prefill_workspace_bytes).
struct LightningScratch {
  __nv_bfloat16 *qkv = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *gate = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

/// Prefill of a varlen batch: xn [T][hidden] bf16 (the layer's normed input), positions [T] int32 (RoPE; may be null
/// without it), `seqs` gives the sequences and states (num_seqs, cu_seqlens, max_seqlen, initial_state, final_state,
/// transition, seq_parts; its q, k, v, slope, out and workspace are filled here); y [T][hidden] fp32 += the layer's
/// output. Throws std::invalid_argument for T > 0 without sequences, and what the kernels and GemmRunner throw
/// (std::invalid_argument naming the bad value; RoPE configured without inv_freq or positions included).
void lightning_mixer_prefill(kernels::cuda::GemmRunner& gemm, const DevLightning& w, const LightningLayerConfig& c,
                             int T, const __nv_bfloat16* xn, const int* positions, const float* inv_freq,
                             kernels::cuda::LightningPrefillArgs seqs, const LightningScratch& s, float* y,
                             cudaStream_t stream);

/// The layer's first half over T tokens: q, k, v into s.q, s.k, s.v ([T][H][d] bf16, as lightning_prefill takes
/// them) from xn [T][hidden] (positions [T] / inv_freq for Ring's RoPE, else may be null).
void lightning_mixer_project(kernels::cuda::GemmRunner& gemm, const DevLightning& w, const LightningLayerConfig& c,
                             int T, const __nv_bfloat16* xn, const int* positions, const float* inv_freq,
                             const LightningScratch& s, cudaStream_t stream);

/// The layer's second half: y [T][hidden] fp32 += out_scale out_proj(sigmoid(gate xn) * grouped RMSNorm(s.o) * norm)
/// (s.o [T][H][d], the recurrence's output; overwritten).
void lightning_mixer_finish(kernels::cuda::GemmRunner& gemm, const DevLightning& w, const LightningLayerConfig& c,
                            int T, const __nv_bfloat16* xn, const LightningScratch& s, float* y, cudaStream_t stream);

/// One decode step of `batch` sequences (one token each): xn [batch][hidden] bf16, positions [batch], states in a slot
/// pool [slots][H][d][d] fp32 (state_slots [batch] DEVICE int32, or nullptr: state[b]); y [batch][hidden] fp32 +=.
void lightning_mixer_decode(kernels::cuda::GemmRunner& gemm, const DevLightning& w, const LightningLayerConfig& c,
                            int batch, const __nv_bfloat16* xn, const int* positions, const float* inv_freq,
                            float* state, const int* state_slots, const LightningScratch& s, float* y,
                            cudaStream_t stream);

}  // namespace hypic::engine::cuda
