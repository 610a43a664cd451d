// Gated DeltaNet gates on the device (HF Qwen3NextGatedDeltaNet): shared by the prefill's WY
// kernel, the decode step and gdn_gates, so that fused and separate gates give the same bits; and the conv's SiLU,
// shared by conv1d.cu and the conv fused into the WY kernel (gdn_wy.cuh) for the same reason.
#pragma once
#include <cuda_bf16.h>

#include <cstddef>

namespace hypic::kernels::cuda::detail {

/// Raw gate inputs: a, b [tokens][H_v] bf16 (in_proj_a / in_proj_b outputs), A_log, dt_bias [H_v].
/// a == nullptr means "not fused" (the caller passes g and beta instead).
struct GateInputs {
  const __nv_bfloat16* a;
  const __nv_bfloat16* b;
  const float* A_log;
  const float* dt_bias;
};

/// g = -exp(A_log[h]) softplus(a[i] + dt_bias[h]) in fp32, softplus threshold 20 (torch default).
__device__ __forceinline__ float gate_log_decay(const GateInputs& gi, size_t i, int h) {
  const float x = __bfloat162float(gi.a[i]) + gi.dt_bias[h];
  return -expf(gi.A_log[h]) * (x > 20.f ? x : log1pf(expf(x)));
}

/// beta = sigmoid(b[i]) in fp32.
__device__ __forceinline__ float gate_beta(const GateInputs& gi, size_t i) {
  return 1.f / (1.f + expf(-__bfloat162float(gi.b[i])));
}

/// The conv's SiLU, x sigmoid(x) = x / (1 + e^-x) with the fast exponential (conv1d_silu_prefill / _decode).
__device__ __forceinline__ float conv_silu(float x) { return x / (1.f + __expf(-x)); }
/// The same with the approximate division (__fdividef: 2 ulp; 0 where 1 + e^-x overflows, SiLU's limit): the
/// 4-channel prefill conv's (HYPIC_CONV_NARROW).
__device__ __forceinline__ float conv_silu_fast(float x) { return __fdividef(x, 1.f + __expf(-x)); }

}  // namespace hypic::kernels::cuda::detail
