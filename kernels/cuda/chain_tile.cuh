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

#include "kernels/cuda/mma.cuh"  // cp_async16
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

/// The longest run a low-rank step takes (one chunk), and the tokens of it staged in shared memory at a time.
inline constexpr int kChainLowRankMaxLen = 64, kChainLowRankTile = 16;
/// Floats of shared memory chain_low_rank_step needs: W and K~ rows of a tile [16][128], U [16][32], Y [64][32].
inline constexpr int kChainLowRankSmemFloats = 2 * kChainLowRankTile * 128 + kChainLowRankTile * 32 +
                                               kChainLowRankMaxLen * 32;

/// A low-rank step's first 16 tokens of factors as they are in memory (chain_low_rank_prefetch): W rows bf16 [16][128]
/// at byte 0, raw k rows bf16 [16][128] at 4096, U^T bf16 [32 columns][16 tokens] at 8192, kf fp32 [16] at 9216 and
/// the 16 bytes holding G_C at 9280.
inline constexpr int kChainLowRankRawBytes = 9296;

/// Issues cp.async copies of low-rank step st's first 16 tokens of factors (the block's 32 columns c0 .., head h) into
/// `raw` (kChainLowRankRawBytes of shared memory, 16-byte aligned), so that a chain can fetch them during the step
/// before; the caller commits, waits and syncs before chain_low_rank_step reads them. 256 threads.
__device__ __forceinline__ void chain_low_rank_prefetch(unsigned char* raw, const ChainLowRankFactors& f,
                                                        const AffineStep& st, int c0, int h, int tid) {
  constexpr int D = 128, TT = kChainLowRankTile;
  const int tn = st.lr_len < TT ? st.lr_len : TT, nq = (tn + 7) / 8;
  const long slot = long(st.lr_chunk) * f.heads + h;
  const bf16* W = f.W + slot * f.w_stride;
  const bf16* UT = f.UT + slot * f.w_stride;
  const float* sc = f.scal + slot * f.scal_stride;
  const int kh = h / (f.heads / f.num_k_heads);
  for (int i = tid; i < tn * (D / 8); i += 256) {  // W and k rows: 16 chunks of 8 bf16 per row
    const int t = i / (D / 8), e = (i % (D / 8)) * 8;
    cp_async16(raw + (t * D + e) * 2, W + size_t(t) * D + e);
    cp_async16(raw + 4096 + (t * D + e) * 2, f.k + (size_t(st.lr_t0 + t) * f.num_k_heads + kh) * D + e);
  }
  for (int i = tid; i < 32 * nq; i += 256) {  // U^T: per column, the tokens' 8-entry chunks (the row holds 64)
    const int j = i / nq, q = i % nq;
    cp_async16(raw + 8192 + (j * TT + 8 * q) * 2, UT + size_t(c0 + j) * f.ut_ld + 8 * q);
  }
  if (tid < (tn + 3) / 4) cp_async16(raw + 9216 + tid * 16, sc + 4 * tid);
  if (tid == 255) cp_async16(raw + 9280, sc + (f.gamma_at & ~3));
}

/// A low-rank step (AffineStep::lr_len > 0, ops.h) on a block's 32 columns c0 .. c0 + 31 of head h, held fp32 in shared
/// memory sR [128][ldR] (ldR a multiple of 4): Y = W R - U[:, c0 ..] (lr_len x 32), then R <- gamma R - K~^T Y with
/// K~[t][r] = kf_t k[t][r]; the factors staged as fp32 in sLr (kChainLowRankSmemFloats) 16 tokens at a time.
/// Phase 1: a lane sums 4 columns of Y over 32 of the rows (r = 4 i + rq), the 4 row groups then by xor-shuffles;
/// phase 2: a thread updates 4 columns of 4 rows over t ascending. Fixed orders: the same bits in every chain kernel
/// (raw: the first 16 tokens' factors prefetched by chain_low_rank_prefetch, already visible; nullptr: read here).
/// 256 threads, all of which call it after writing sR (its first barrier makes those writes visible); it ends with a
/// barrier. Traps when the chain was given no factors (f.W null) or a step longer than kChainLowRankMaxLen.
__device__ __forceinline__ void chain_low_rank_step(float* sR, int ldR, float* sLr, int c0, int h,
                                                    const ChainLowRankFactors& f, const AffineStep& st, int tid,
                                                    const unsigned char* raw = nullptr) {
  // (affine_chain documents that a chain with low-rank steps needs its factors, and runs of at most one chunk)
  if (!f.W || st.lr_len > kChainLowRankMaxLen) __trap();
  constexpr int D = 128, BN = 32, TT = kChainLowRankTile;
  float* sW = sLr;           // [TT][128]: W rows of the tile's tokens
  float* sK = sW + TT * D;   // [TT][128]: K~ rows
  float* sU = sK + TT * D;   // [TT][32]: U[t][c0 + j]
  float* sY = sU + TT * BN;  // [64][32]: Y
  const int len = st.lr_len;
  const long slot = long(st.lr_chunk) * f.heads + h;
  const bf16* W = f.W + slot * f.w_stride;
  const bf16* UT = f.UT + slot * f.w_stride;
  const float* sc = f.scal + slot * f.scal_stride;
  const int kh = h / (f.heads / f.num_k_heads);
  const float gamma = __expf(raw ? reinterpret_cast<const float*>(raw + 9280)[f.gamma_at & 3] : sc[f.gamma_at]);
  auto stage_rows = [&](float* dst, int tb, int tn, bool k_rows) {  // W or K~ rows tb .. tb + tn - 1, fp32
    for (int i = tid; i < tn * (D / 8); i += 256) {
      const int t = i / (D / 8), e = (i % (D / 8)) * 8;
      const bf16* src = k_rows ? f.k + (size_t(st.lr_t0 + tb + t) * f.num_k_heads + kh) * D + e
                               : W + size_t(tb + t) * D + e;
      const uint4 v8 = *reinterpret_cast<const uint4*>(src);
      const bf16* v = reinterpret_cast<const bf16*>(&v8);
      const float mul = k_rows ? sc[tb + t] : 1.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[t * D + e + j] = mul * __bfloat162float(v[j]);
    }
  };
  const int lane = tid & 31, warp = tid >> 5, jq = lane & 7, rq = lane >> 3;
  for (int tb = 0; tb < len; tb += TT) {  // phase 1
    const int tn = len - tb < TT ? len - tb : TT;
    if (tb == 0 && raw) {  // the first tile from the prefetched copy (chain_low_rank_prefetch's layout)
      const bf16* rw = reinterpret_cast<const bf16*>(raw);
      const bf16* rk = reinterpret_cast<const bf16*>(raw + 4096);
      const bf16* ru = reinterpret_cast<const bf16*>(raw + 8192);
      const float* rkf = reinterpret_cast<const float*>(raw + 9216);
      for (int i = tid; i < tn * D; i += 256) {
        sW[i] = __bfloat162float(rw[i]);
        sK[i] = rkf[i / D] * __bfloat162float(rk[i]);
      }
      for (int i = tid; i < tn * BN; i += 256) {
        const int j = i / tn, t = i % tn;
        sU[t * BN + j] = __bfloat162float(ru[j * TT + t]);
      }
    } else {
      stage_rows(sW, tb, tn, false);
      if (tb == 0) stage_rows(sK, 0, tn, true);  // (phase 2's first tile, staged with the first W rows)
      for (int i = tid; i < tn * BN; i += 256) {
        const int j = i / tn, t = i % tn;
        sU[t * BN + j] = __bfloat162float(UT[size_t(c0 + j) * f.ut_ld + tb + t]);
      }
    }
    __syncthreads();  // the tile staged (and, the first time, the caller's sR)
    for (int t = warp; t < tn; t += 8) {
      float a[4] = {0.f, 0.f, 0.f, 0.f};
      const float* wr = sW + t * D + rq;
      const float* rr = sR + rq * ldR + 4 * jq;
#pragma unroll 8
      for (int i = 0; i < D / 4; ++i) {
        const float w = wr[4 * i];
        const float4 rv = *reinterpret_cast<const float4*>(rr + 4 * i * ldR);
        a[0] = fmaf(w, rv.x, a[0]), a[1] = fmaf(w, rv.y, a[1]), a[2] = fmaf(w, rv.z, a[2]), a[3] = fmaf(w, rv.w, a[3]);
      }
#pragma unroll
      for (int m = 8; m <= 16; m <<= 1)
#pragma unroll
        for (int q = 0; q < 4; ++q) a[q] += __shfl_xor_sync(0xffffffffu, a[q], m);
      if (rq == 0)
#pragma unroll
        for (int q = 0; q < 4; ++q) sY[(tb + t) * BN + 4 * jq + q] = a[q] - sU[t * BN + 4 * jq + q];
    }
    __syncthreads();  // the tile's W and U read (and Y complete after the last tile)
  }
  const int jq2 = tid & 7, r0 = tid >> 3;  // phase 2: rows r0 + 32 k, columns 4 jq2 .. + 3
  float acc[4][4];
#pragma unroll
  for (int k = 0; k < 4; ++k) acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = 0.f;
  for (int tb = 0; tb < len; tb += TT) {
    const int tn = len - tb < TT ? len - tb : TT;
    if (tb > 0) {
      stage_rows(sK, tb, tn, true);
      __syncthreads();
    }
    for (int t = 0; t < tn; ++t) {
      const float4 y = *reinterpret_cast<const float4*>(sY + (tb + t) * BN + 4 * jq2);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float kk = sK[t * D + r0 + 32 * k];
        acc[k][0] = fmaf(kk, y.x, acc[k][0]), acc[k][1] = fmaf(kk, y.y, acc[k][1]);
        acc[k][2] = fmaf(kk, y.z, acc[k][2]), acc[k][3] = fmaf(kk, y.w, acc[k][3]);
      }
    }
    if (tb + TT < len) __syncthreads();  // this tile's K~ read before the next is staged
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float4* rp = reinterpret_cast<float4*>(sR + (r0 + 32 * k) * ldR + 4 * jq2);
    float4 v = *rp;
    v.x = fmaf(gamma, v.x, -acc[k][0]), v.y = fmaf(gamma, v.y, -acc[k][1]);
    v.z = fmaf(gamma, v.z, -acc[k][2]), v.w = fmaf(gamma, v.w, -acc[k][3]);
    *rp = v;
  }
  __syncthreads();
}

}  // namespace hypic::kernels::cuda::detail
