// The pieces of the residual stream's RMSNorm (HF Qwen3_5RMSNorm / Qwen3NextRMSNorm zero-centred, or the plain
// RMSNorm of the other families) shared by ops.cu's rms_norm_residual_kernel and moe.cu's combine_norm_kernel (the
// MoE combine with the next layer's input norm fused, MoeNextNorm), so both give the same bits: one block of
// kNormThreads threads per row of `dim` fp32 values, thread tid owning the 4-column groups c = 4 tid + 4 kNormThreads i
// in ascending i; the sum of squares is each thread's (in that order), then each warp's (xor shuffles), then the
// warps' in ascending order; y = bf16(x * rsqrt(ss / dim + eps) * (w0 + w)), w0 = 1 zero-centred, else 0.
#pragma once
#include <cuda_bf16.h>

namespace hypic::kernels::cuda::detail {

constexpr int kNormThreads = 256;  // threads per row of the residual-stream norms

__device__ __forceinline__ float norm_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The sum of squares of one 4-column group, added to a thread's running sum: ss + (((x^2 + y^2) + z^2) + w^2).
__device__ __forceinline__ float norm_add_sq4(float ss, float4 v) {
  return ss + (v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w);
}

// rsqrt(mean + eps) from each thread's sum of squares: every thread of the block returns the same value. part:
// kNormThreads / 32 floats of shared memory (written, read after a barrier; the caller does not reuse it before the
// block's next barrier).
__device__ __forceinline__ float norm_block_inv(float ss, float* part, int dim, float eps) {
  const int tid = threadIdx.x;
  ss = norm_warp_sum(ss);
  if ((tid & 31) == 0) part[tid >> 5] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kNormThreads / 32; ++i) total += part[i];
  return rsqrtf(total / dim + eps);
}

// One 4-column group's normalised values (unrounded, fp32; w at column c) and their bf16 store into yr + c.
template <bool kZeroCentred>
__device__ __forceinline__ float4 norm_apply4(float4 v, float inv, const __nv_bfloat16* __restrict__ w,
                                              __nv_bfloat16* yr, int c) {
  const __nv_bfloat162 w01 = *reinterpret_cast<const __nv_bfloat162*>(w + c);
  const __nv_bfloat162 w23 = *reinterpret_cast<const __nv_bfloat162*>(w + c + 2);
  const float2 a = __bfloat1622float2(w01), b = __bfloat1622float2(w23);
  const float w0 = kZeroCentred ? 1.f : 0.f;
  const float n0 = v.x * inv * (w0 + a.x), n1 = v.y * inv * (w0 + a.y), n2 = v.z * inv * (w0 + b.x),
              n3 = v.w * inv * (w0 + b.y);
  *reinterpret_cast<__nv_bfloat162*>(yr + c) = __floats2bfloat162_rn(n0, n1);
  *reinterpret_cast<__nv_bfloat162*>(yr + c + 2) = __floats2bfloat162_rn(n2, n3);
  return make_float4(n0, n1, n2, n3);
}

// The gated RMSNorm of one row of `dim` bf16 values (ops.h rms_norm_gated: HF Qwen3NextRMSNormGated / KDA's sigmoid-
// gated norm) by one warp: lane owns the pairs c = 2 lane + 64 i; the sum of squares is each lane's (ascending),
// then the warp's (xor shuffles); y = bf16(x * inv * w * gate(z)) with gate(z) = z / (1 + e^-z) (silu) or
// 1 / (1 + e^-z) (sigmoid). load2(p) reads a bf16 pair (callers pick the cache path); y may alias x (each lane reads
// its pairs before writing them).
template <bool kSilu, class Load2>
__device__ __forceinline__ void gated_norm_row_warp(const __nv_bfloat16* xr, const __nv_bfloat16* zr,
                                                    const __nv_bfloat16* wr, int dim, float eps, __nv_bfloat16* yr,
                                                    int lane, Load2 load2) {
  float ss = 0.f;
  for (int c = lane * 2; c < dim; c += 64) {
    const float2 v = __bfloat1622float2(load2(xr + c));
    ss += v.x * v.x + v.y * v.y;
  }
  const float inv = rsqrtf(norm_warp_sum(ss) / dim + eps);
  auto gate = [](float g) { return kSilu ? g / (1.f + expf(-g)) : 1.f / (1.f + expf(-g)); };
  for (int c = lane * 2; c < dim; c += 64) {
    const float2 v = __bfloat1622float2(load2(xr + c));
    const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(zr + c));
    const float2 ww = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(wr + c));
    *reinterpret_cast<__nv_bfloat162*>(yr + c) =
        __floats2bfloat162_rn(v.x * inv * ww.x * gate(g.x), v.y * inv * ww.y * gate(g.y));
  }
}

// One lane's part of the 16-byte gated norm (ops.cu rms_norm_gated_vec_kernel): its 8 consecutive elements xv, gates
// zv and weights wv (bf16 x 8 each) of a row of dim = 8 L elements held by an aligned group of L lanes (L in 4 .. 32);
// the sum of squares is the lane's (ascending), then the group's (xor shuffles); returns the lane's 8 outputs,
// bf16(x * inv * w * gate(z)), packed. Every lane of the warp calls it (full-mask shuffles).
template <bool kSilu, int L>
__device__ __forceinline__ uint4 gated_norm_lanes8(uint4 xv, uint4 zv, uint4 wv, int dim, float eps) {
  const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
  const __nv_bfloat162* zp = reinterpret_cast<const __nv_bfloat162*>(&zv);
  const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv);
  float2 v[4];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = __bfloat1622float2(xp[i]);
    ss += v[i].x * v[i].x + v[i].y * v[i].y;
  }
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float inv = rsqrtf(ss / dim + eps);
  auto gate = [](float g) { return kSilu ? g / (1.f + expf(-g)) : 1.f / (1.f + expf(-g)); };
  uint4 out;
  __nv_bfloat162* op = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 g = __bfloat1622float2(zp[i]), ww = __bfloat1622float2(wp[i]);
    op[i] = __floats2bfloat162_rn(v[i].x * inv * ww.x * gate(g.x), v[i].y * inv * ww.y * gate(g.y));
  }
  return out;
}

}  // namespace hypic::kernels::cuda::detail
