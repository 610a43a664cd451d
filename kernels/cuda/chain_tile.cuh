// The running state block of one affine-chain block (affine_chain's tensor-core kernels: affine_chain_tc_kernel in
// ops.cu, affine_chain_wgmma_kernel in chain_wgmma.cu): 128 rows x 32 columns of a [heads][128][128] fp32 state, held
// in registers in the m16n8 accumulator layout (warp w: rows 16 w + g and + 8; slot n: columns 8 n + 2 t and + 1;
// g = lane / 4, t = lane % 4), and the per-step epilogue R <- alpha (T R) + S shared by both kernels; and the low-rank
// step (a Gated DeltaNet seam run from its chunk factors) that all three chain kernels (with affine_chain_kernel's fp32
// one) run on an fp32 copy of the block in shared memory. Device code only.
#pragma once
#include <cuda_bf16.h>
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
  /// This lane's elements of cur into a [128][ld] fp32 block of shared memory (columns 0 .. NC - 1: the tile's).
  __device__ __forceinline__ void to_smem(const float (&cur)[NT][4], float* sR, int ld) const {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<float2*>(sR + (m0 + g + 8 * half) * ld + 8 * n + 2 * t) =
            make_float2(cur[n][2 * half], cur[n][2 * half + 1]);
  }
  /// cur <- this lane's elements of the shared block that to_smem wrote.
  __device__ __forceinline__ void from_smem(float (&cur)[NT][4], const float* sR, int ld) const {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float2 v = *reinterpret_cast<const float2*>(sR + (m0 + g + 8 * half) * ld + 8 * n + 2 * t);
        cur[n][2 * half] = v.x, cur[n][2 * half + 1] = v.y;
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

/// Rows of the low-rank step's Y = W R - U kept in shared memory (the longest run it takes: one chunk).
inline constexpr int kChainLowRankMaxLen = 64;

/// A low-rank step (AffineStep::lr_len > 0, ops.h) on a block's 32 columns c0 .. c0 + 31 of head h, held fp32 in shared
/// memory sR [128][ldR]: Y = W R - U[:, c0 ..] (sY [lr_len][32]), then R <- gamma R - K~^T Y, K~[t][r] = kf_t k[t][r].
/// Fixed summation orders (r ascending, then t ascending): the same bits in every chain kernel. 256 threads, all of
/// which call it; it begins after the caller's barrier over sR's writes and ends with a barrier. Traps when the
/// chain was given no factors (f.W null).
__device__ __forceinline__ void chain_low_rank_step(float* sR, int ldR, float* sY, int c0, int h,
                                                    const ChainLowRankFactors& f, const AffineStep& st, int tid) {
  if (!f.W) __trap();  // (affine_chain documents that a chain with low-rank steps needs its factors)
  constexpr int D = 128, BN = 32;
  const int len = st.lr_len;
  const long slot = long(st.lr_chunk) * f.heads + h;
  const bf16* W = f.W + slot * f.w_stride;
  const bf16* UT = f.UT + slot * f.w_stride;
  const float* sc = f.scal + slot * f.scal_stride;
  const float gamma = __expf(sc[f.gamma_at]);
  const int kh = h / (f.heads / f.num_k_heads);
  for (int i = tid; i < len * BN; i += 256) {  // Y[t][j]: a warp on one t, lanes on the columns
    const int t = i / BN, j = i % BN;
    const bf16* w = W + size_t(t) * D;
    float y = 0.f;
#pragma unroll 8
    for (int r = 0; r < D; ++r) y = fmaf(__bfloat162float(w[r]), sR[r * ldR + j], y);
    sY[t * BN + j] = y - __bfloat162float(UT[size_t(c0 + j) * f.ut_ld + t]);
  }
  __syncthreads();
  for (int i = tid; i < D * BN; i += 256) {  // R[r][j]: a warp on one row r, lanes on the columns
    const int r = i / BN, j = i % BN;
    float acc = 0.f;
    for (int t = 0; t < len; ++t)
      acc = fmaf(sc[t] * __bfloat162float(f.k[(size_t(st.lr_t0 + t) * f.num_k_heads + kh) * D + r]), sY[t * BN + j],
                 acc);
    sR[r * ldR + j] = fmaf(gamma, sR[r * ldR + j], -acc);
  }
  __syncthreads();
}

}  // namespace hypic::kernels::cuda::detail
