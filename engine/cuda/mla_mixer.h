// Kimi-Linear's full-attention layer (multi-head latent attention, HF KimiLinearAttention in transformers 5.17: no
// rotary embedding) on the GPU, run expanded (kernels/cuda/mla.h): the projections through cuBLASLt around the
// latent norm, the expansion of every head's K = [k_nope | k_rot] and V into the paged KV pool at a padded head size,
// the attention kernels of kernels/cuda/attention.h, and o_proj into the residual. The CPU form is
// engine/families/kimi_linear mla_layer (the test oracle). All pointers are DEVICE pointers; every call is
// asynchronous on `stream`.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "engine/checkpoint/config.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/mla.h"

namespace hypic::engine::cuda {

/// One MLA layer's weights on the device, bf16 row-major (engine/checkpoint/weights.h MlaWeights, q LoRA excepted).
struct DevMla {
  const __nv_bfloat16* q_proj = nullptr;          ///< [nh (nope + rope)][hidden]
  const __nv_bfloat16* kv_a_proj = nullptr;       ///< [R + rope][hidden] (kv_a_proj_with_mqa)
  const __nv_bfloat16* kv_a_layernorm = nullptr;  ///< [R] (applied as w)
  const __nv_bfloat16* kv_b_proj = nullptr;       ///< [nh (nope + v)][R], per head k_nope rows then v rows
  const __nv_bfloat16* o_proj = nullptr;          ///< [hidden][nh v]
};

/// What the model config says about its MLA layers.
struct MlaLayerConfig {
  int hidden = 0;
  kernels::cuda::MlaDims dims;
  float latent_eps = 1e-6f;  ///< KimiLinearRMSNorm(kv_lora_rank)'s default eps
  float scale = 1.0f;        ///< (nope + rope)^-1/2
  float out_scale = 1.0f;    ///< o_proj's output is added times this (1 for Kimi-Linear)
  /// From a Kimi-Linear config. Throws std::invalid_argument naming what the GPU path does not take: q_lora_rank > 0
  /// (the q LoRA), nope + rope or v over 256, or a family without MLA.
  static MlaLayerConfig of(const ModelConfig& c);
};

/// Scratch of one call of T tokens, bf16: q [T][nh (nope + rope)], ckv [T][R + rope], latent [T][R], kvb
/// [T][nh (nope + v)], q_pad and attn [T][nh][P], packed [T][nh v] (P = dims.padded()).
struct MlaScratch {
  __nv_bfloat16 *q = nullptr, *ckv = nullptr, *latent = nullptr, *kvb = nullptr, *q_pad = nullptr, *attn = nullptr,
                *packed = nullptr;
};

/// The layer over T tokens: xn [T][hidden] bf16 (normed input); token t's K/V go to pool rows kv_rows[t] of
/// k_pool / v_pool ([rows][nh][P] bf16, kernels/cuda/attention.h layout); `groups` says which queries attend which
/// KV slots (prefill: varlen groups; decode: one query per group with `decode`); ws: the attention workspace
/// (required for decode; for prefill nullptr runs attention_prefill without the split-KV path); y [T][hidden] fp32
/// += the output. Throws what the kernels and GemmRunner throw.
void mla_mixer(kernels::cuda::GemmRunner& gemm, const DevMla& w, const MlaLayerConfig& c, int T,
               const __nv_bfloat16* xn, const int* kv_rows, const kernels::cuda::AttnGroups& groups,
               __nv_bfloat16* k_pool, __nv_bfloat16* v_pool, kernels::cuda::AttnDecodeWorkspace* ws, bool decode,
               const MlaScratch& s, float* y, cudaStream_t stream);

}  // namespace hypic::engine::cuda
