// The running state block of one affine-chain block (affine_chain's tensor-core kernels: affine_chain_tc_kernel in
// ops.cu, affine_chain_wgmma_kernel in chain_wgmma.cu): 128 rows x 32 columns of a [heads][128][128] fp32 state, held
// in registers in the m16n8 accumulator layout (warp w: rows 16 w + g and + 8; slot n: columns 8 n + 2 t and + 1;
// g = lane / 4, t = lane % 4), and the per-step epilogue R <- alpha (T R) + S shared by both kernels. Device code only.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/ops.h"

namespace hypic::kernels::cuda::detail {

/// One lane's part of a 128 x NC block (NC = 8 NT columns) of head h's 128 x 128 state, columns c0 .. c0 + NC - 1.
template <int NT>
struct ChainTile {
  static constexpr int D = 128;
  size_t head_off;  // h * D * D + c0 (floats)
  int m0, g, t;     // warp's first row, lane / 4, lane % 4

  __device__ __forceinline__ ChainTile(int h, int c0, int warp, int lane)
      : head_off(size_t(h) * D * D + c0), m0(warp * 16), g(lane >> 2), t(lane & 3) {}
  /// Float offset of this lane's elements (row m0 + g + 8 half, columns 8 n + 2 t, + 1) from a state's start.
  __device__ __forceinline__ size_t off(int n, int half) const {
    return head_off + size_t(m0 + g + 8 * half) * D + 8 * n + 2 * t;
  }
  /// cur <- this lane's elements of R (nullptr: zero).
  __device__ __forceinline__ void load(float (&cur)[NT][4], const float* R) const {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float2 v = R ? *reinterpret_cast<const float2*>(R + off(n, half)) : make_float2(0.f, 0.f);
        cur[n][2 * half] = v.x, cur[n][2 * half + 1] = v.y;
      }
  }
  /// v <- this lane's elements of a step's S (nullptr: zero), through L2 only (an S may be what an earlier step of the
  /// same chain wrote as its out).
  __device__ __forceinline__ void load_S(float2 (&v)[NT][2], const float* S) const {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        v[n][half] = S ? __ldcg(reinterpret_cast<const float2*>(S + off(n, half))) : make_float2(0.f, 0.f);
  }
  /// The step's epilogue: cur <- alpha acc + S (fmaf), written to out when set.
  __device__ __forceinline__ void step(float (&cur)[NT][4], const float (&acc)[NT][4], const float2 (&sv)[NT][2],
                                       float alpha, float* out) const {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        cur[n][2 * half] = fmaf(alpha, acc[n][2 * half], sv[n][half].x);
        cur[n][2 * half + 1] = fmaf(alpha, acc[n][2 * half + 1], sv[n][half].y);
        if (out) *reinterpret_cast<float2*>(out + off(n, half)) = make_float2(cur[n][2 * half], cur[n][2 * half + 1]);
      }
  }
  /// F's elements <- cur (F nullptr: nothing).
  __device__ __forceinline__ void store(const float (&cur)[NT][4], float* F) const {
    if (!F) return;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<float2*>(F + off(n, half)) = make_float2(cur[n][2 * half], cur[n][2 * half + 1]);
  }
};

}  // namespace hypic::kernels::cuda::detail
