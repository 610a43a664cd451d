// Chunked gated delta rule prefill with the segment transition T_C (see gated_delta.h).
//
// Chunk C = 64, head size 128; the WY launch, then one or two scan launches:
//  1. gdn_wy_kernel, per (chunk, value head), all chunks in parallel: l2-normalise q and k (fp32,
//     rounded to bf16 once), G = in-chunk cumsum of g, A_ij = b_i e^{G_i - G_j} k_i.k_j (j < i),
//     X = (I + A)^{-1} blockwise in fp32 (16 x 16 diagonal blocks by forward substitution, then
//     block rows I = 1..3 as X_IJ = -X_II sum_K A_IK X_KJ), then on tensor cores
//       W = X diag(b e^G) K,  U = X diag(b) V  (stored transposed, U^T),
//       P_ij = e^{G_i - G_j} q_i.k_j for j <= i (the causal intra-chunk part of the outputs),
//     and the per-token factors kf_t = |k_t|^-1 e^{G_C - G_t}, qf_t = scale |q_t|^-1 e^{G_t}.
//  2. gdn_scan_kernel, the sequential chunk scan with the outputs fused in (no per-chunk states go
//     through device memory). Each recurrence warp owns 16 columns of [S | T] (S: the state, T: the
//     transition, started from I) and keeps the transposed block h^T (16 x 128, fp32) in its
//     tensor-core accumulators for the whole sequence, so the recurrence needs no exchange between
//     warps. Per chunk, with raw bf16 q, k from the inputs:
//       v_new^T = U^T - h^T W^T                      (T columns: U = 0)
//       h^T     = gamma h^T + v_new^T diag(kf) K,     gamma = e^{G_C}
//       o^T     = (h^T Q^T) diag(qf) + v_new^T P^T   (S columns only, by an output warp one chunk
//                                                     behind, from bf16 fragments of h^T, v_new^T)
//     which is S_C = T_chunk S_0 + K~^T U with T_chunk = gamma I - K~^T W (hybrid_models.md 5.4),
//     so T columns accumulate T_C = T_n ... T_1 in the same pass. The warps of a block share the
//     chunk's tiles, staged in shared memory through cp.async (layouts: see section 2 below).
//  3. Sequence-parallel scan (host side, gdn_prefill): a sequence is a chain of 2 blocks per value
//     head, so a few long sequences leave most SMs idle. Such a sequence is cut at chunk boundaries
//     into P parts; scan launch 1 runs part 0 from the initial state (with outputs) and parts
//     1 .. P-2 from zero with their T; compose_fold gives every part's true initial state
//     I_{p+1} = T_p I_p + S(p|0) (DESIGN.md 3.1); scan launch 2 reruns parts 1 .. P-1 from I_p for
//     their outputs (without outputs all parts run in launch 1 and the chain gives the final
//     state). About 2n/P chunk steps instead of n: P = 3 for 32 value heads on 132 SMs.
// The scan kernel (a template: the recurrence on mma.sync here, on warpgroup MMAs in gdn_scan_wgmma.cu under the
// candidate switch HYPIC_GDN_SCAN_WGMMA) and the workspace layout it shares with the WY kernel are in gdn_scan.cuh.
// The host side that needs none of the kernels' internals (gates kernel, workspace streams, argument checks, the
// split) is in gated_delta_host.cu.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/gated_delta_internal.h"
#include "kernels/cuda/gates.cuh"
#include "kernels/cuda/gdn_scan.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/switches.h"

namespace hypic::kernels::cuda {
namespace {

using namespace detail;
using namespace detail::gdn;

constexpr int kThreads = 128;

// 64 rows of 128 bf16 (row r at src + r * row_stride, rows >= len zero) by 128 threads: thread t
// holds the 16-byte piece t % 16 of rows t / 16 + 8 i (i < 8), so each load instruction of a warp
// reads two whole 256-byte rows. load_raw fetches the pieces into registers (so that several
// tiles' loads are in flight together); finish_rows optionally l2-normalises each row in fp32
// (x * rsqrt(sum x^2 + 1e-6), the sum over the 16 lanes of a row), multiplies by `mul`, rounds to
// bf16 once, writes the [64][LD] tile and the rows' factors (mul * rsqrt(...), or mul) to f[64].
__device__ __forceinline__ void load_raw(uint4 (&raw)[8], const bf16* src, size_t row_stride, int len, int tid) {
  const int r0 = tid >> 4, piece = tid & 15;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = r0 + 8 * i;
    raw[i] = r < len ? *reinterpret_cast<const uint4*>(src + size_t(r) * row_stride + piece * 8)
                     : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void finish_rows(bf16* s, const uint4 (&raw)[8], bool norm, float mul, int tid,
                                            float* f_out) {
  const int r0 = tid >> 4, piece = tid & 15;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float f = mul;
    if (norm) {
      const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw[i]);
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 x = __bfloat1622float2(h2[e]);
        ss += x.x * x.x + x.y * x.y;
      }
#pragma unroll
      for (int o = 1; o < 16; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      f = mul * rsqrtf(ss + 1e-6f);
    }
    uint4 o = raw[i];
    if (norm || mul != 1.f) {
      __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 x = __bfloat1622float2(h2[e]);
        h2[e] = __floats2bfloat162_rn(x.x * f, x.y * f);
      }
    }
    const int r = r0 + 8 * i;
    *reinterpret_cast<uint4*>(s + r * LD + piece * 8) = o;
    if (piece == 0) f_out[r] = f;
  }
}


// Copies a [64][LD] bf16 tile to a dense [64][128] global block (16-byte stores).
__device__ __forceinline__ void store_tile(bf16* dst, const bf16* s, int tid) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int p = tid + i * kThreads, row = p >> 4, col = (p & 15) * 8;
    *reinterpret_cast<uint4*>(dst + row * D + col) = *reinterpret_cast<const uint4*>(s + row * LD + col);
  }
}

// acc[n] (n < 2 NP: columns n0 + 8n ..) += A B for the 16 rows m0.. of A ([*][lda] bf16, row-major
// [m][k]) and B ([k][n] row-major, [*][ldb] bf16), over k-steps ks < min(KS, ks_end) of 16.
template <int KS, int NP>
__device__ __forceinline__ void mma_rows16(float (&acc)[2 * NP][4], const bf16* sA, int lda, int m0, const bf16* sB,
                                           int ldb, int n0, int lane, int ks_end = KS) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    if (ks < ks_end) {
      uint32_t a[4];
      load_a(a, sA, lda, m0, 16 * ks, lane);
#pragma unroll
      for (int np = 0; np < NP; ++np) {
        uint32_t b[4];
        load_b_kn(b, sB, ldb, 16 * ks, n0 + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }
}

// acc[t] (t < 8: columns 8t..8t+7) += X Y^T for the warp's rows 16 warp .. + 15, where X and Y are
// [64][LD] bf16 tiles; only column tiles t <= 2 warp + 1 (the causal part) are computed.
__device__ __forceinline__ void causal_xyt(float (&acc)[8][4], const bf16* sX, const bf16* sY, int warp, int lane) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[4];
    load_a(a, sX, LD, 16 * warp, 16 * ks, lane);
#pragma unroll
    for (int tp = 0; tp < 4; ++tp) {
      if (tp <= warp) {
        uint32_t b[4];
        load_b_nk(b, sY, LD, 16 * ks, 16 * tp, lane);
        mma_bf16(acc[2 * tp], a, b[0], b[1]);
        mma_bf16(acc[2 * tp + 1], a, b[2], b[3]);
      }
    }
  }
}

// acc[c] += a * row[c] for c < 8 (row: 8 consecutive fp32 in shared memory, 16-byte aligned).
__device__ __forceinline__ void fma8(float (&acc)[8], float a, const float* row) {
  const float4 r0 = *reinterpret_cast<const float4*>(row);
  const float4 r1 = *reinterpret_cast<const float4*>(row + 4);
  acc[0] = fmaf(a, r0.x, acc[0]);
  acc[1] = fmaf(a, r0.y, acc[1]);
  acc[2] = fmaf(a, r0.z, acc[2]);
  acc[3] = fmaf(a, r0.w, acc[3]);
  acc[4] = fmaf(a, r1.x, acc[4]);
  acc[5] = fmaf(a, r1.y, acc[5]);
  acc[6] = fmaf(a, r1.z, acc[6]);
  acc[7] = fmaf(a, r1.w, acc[7]);
}

// ---------------------------------------------------------------------------------------------
// 1. WY factors, P and the token factors per (chunk, value head).
// Shared memory (54 KB: four blocks per SM): sK [64][LD] bf16, later the W and U^T stages; a 17 KB
// region R used in turn as sQ ([64][LD] bf16), the fp32 matrix A / X ([64][68]), then V ([64][LD]
// bf16, loaded by cp.async while W is computed); sXb, sXbg [64][72] bf16 (sXb first holds the
// inverse's M blocks); G, b, |k|^-1, scale |q|^-1 [64] fp32 each.
constexpr int kRegion = C * 68 * 4;
constexpr int kWySmem = C * LD * 2 + kRegion + 2 * C * LDP * 2 + 4 * C * 4;
static_assert(C * LD * 2 <= kRegion && D * 68 * 2 <= C * LD * 2, "region R or the U^T stage too small");
static_assert(kWySmem <= 56 * 1024, "the WY kernel should fit four blocks per SM");

__global__ void __launch_bounds__(kThreads) gdn_wy_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                          const bf16* __restrict__ v, const float* __restrict__ g,
                                                          const float* __restrict__ beta, GateInputs gates, int Hk,
                                                          int Hv, bool l2norm, float scale, WsView ws) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  unsigned char* region = reinterpret_cast<unsigned char*>(sK + C * LD);
  bf16* sQ = reinterpret_cast<bf16*>(region);
  float* sA = reinterpret_cast<float*>(region);
  bf16* sV = reinterpret_cast<bf16*>(region);
  bf16* sStage = sK;  // W and U^T stages, once K is no longer read
  bf16* sXb = reinterpret_cast<bf16*>(region + kRegion);  // [64][72]
  bf16* sXbg = sXb + C * LDP;
  float* sG = reinterpret_cast<float*>(sXbg + C * LDP);
  float* sB = sG + C;
  float* sFk = sB + C;
  float* sFq = sFk + C;

  // Value heads vary fastest, so the heads that share a key head (GVA) read its q, k rows from L2.
  const int h = blockIdx.x % Hv, chunk = blockIdx.x / Hv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gi = lane >> 2, cc = (lane & 3) * 2;
  const ChunkInfo ci = ws.chunks[chunk];
  const int kh = h / (Hv / Hk);
  const size_t slot = size_t(chunk) * Hv + h;

  {
    uint4 rk[8], rq[8];  // both tiles in flight before the first use
    load_raw(rk, k + (size_t(ci.t0) * Hk + kh) * D, size_t(Hk) * D, ci.len, tid);
    load_raw(rq, q ? q + (size_t(ci.t0) * Hk + kh) * D : k, size_t(Hk) * D, q ? ci.len : 0, tid);
    finish_rows(sK, rk, l2norm, 1.f, tid, sFk);
    if (q) finish_rows(sQ, rq, l2norm, scale, tid, sFq);
    else if (tid < C) sFq[tid] = 0.f;
  }
  if (warp == 0) {  // inclusive cumsum of g over the chunk, two tokens per lane
    const int r0 = 2 * lane;
    float g0 = 0.f, g1 = 0.f;
    const size_t i0 = size_t(ci.t0 + r0) * Hv + h;
    if (r0 < ci.len) g0 = gates.a ? gate_log_decay(gates, i0, h) : g[i0];
    if (r0 + 1 < ci.len) g1 = gates.a ? gate_log_decay(gates, i0 + Hv, h) : g[i0 + Hv];
    float s = g0 + g1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float t = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += t;
    }
    sG[r0] = s - g1;
    sG[r0 + 1] = s;
  } else if (warp == 1) {
    for (int r = lane; r < C; r += 32) {
      const size_t i = size_t(ci.t0 + r) * Hv + h;
      sB[r] = r < ci.len ? (gates.a ? gate_beta(gates, i) : beta[i]) : 0.f;
    }
  }
  __syncthreads();

  // P = (Q K^T) masked causally (j <= i) and decayed by e^{G_i - G_j}, straight to the workspace
  // (zeros above the diagonal: the scan reads whole 16 x 16 diagonal blocks). Skipped without q
  // (no outputs requested).
  if (q) {
    float acc[8][4] = {};
    causal_xyt(acc, sQ, sK, warp, lane);
    bf16* sP = sXbg;  // P staged as [64][LDP] bf16 (sXbg is written later), stored coalesced below
    const int i0 = 16 * warp + gi, i1 = i0 + 8;
    const float G0 = sG[i0], G1 = sG[i1];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int j = 8 * t + cc;
      const float Gj0 = sG[j], Gj1 = sG[j + 1];
      const float p00 = j <= i0 ? acc[t][0] * __expf(G0 - Gj0) : 0.f;
      const float p01 = j + 1 <= i0 ? acc[t][1] * __expf(G0 - Gj1) : 0.f;
      const float p10 = j <= i1 ? acc[t][2] * __expf(G1 - Gj0) : 0.f;
      const float p11 = j + 1 <= i1 ? acc[t][3] * __expf(G1 - Gj1) : 0.f;
      *reinterpret_cast<uint32_t*>(sP + i0 * LDP + j) = pack_bf16(p00, p01);
      *reinterpret_cast<uint32_t*>(sP + i1 * LDP + j) = pack_bf16(p10, p11);
    }
  }
  __syncthreads();  // region R (sQ) is reused for A below
  if (q) {
    bf16* P = ws.P + slot * kPElems;
#pragma unroll
    for (int i = 0; i < C * C / 8 / kThreads; ++i) {
      const int p = tid + i * kThreads, row = p >> 3, col = (p & 7) * 8;
      *reinterpret_cast<uint4*>(P + row * C + col) = *reinterpret_cast<const uint4*>(sXbg + row * LDP + col);
    }
  }

  // A = K K^T (strictly lower part), scaled by b_i e^{G_i - G_j}.
  {
    float acc[8][4] = {};
    causal_xyt(acc, sK, sK, warp, lane);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + gi + (e >= 2 ? 8 : 0), j = 8 * t + cc + (e & 1);
        float val = 0.f;
        if (j < i) val = acc[t][e] * sB[i] * __expf(sG[i] - sG[j]);
        sA[i * 68 + j] = val;
      }
    }
  }
  __syncthreads();

  // X = (I + A)^{-1} in 16 x 16 blocks (A is strictly lower triangular, so X is unit lower
  // triangular): the diagonal blocks X_II = (I + A_II)^{-1} by forward substitution (one column per
  // thread, depth 16), then block rows I = 1, 2, 3 in turn,
  //   X_IJ = -X_II M_IJ,  M_IJ = sum_{K=J}^{I-1} A_IK X_KJ  (J < I),
  // all in fp32. X overwrites A block by block (row I of A is read only while row I is computed).
  // Meanwhile threads 64.. write the token factors for the scan: kf_t = |k_t|^-1 e^{G_C - G_t} and
  // qf_t = scale |q_t|^-1 e^{G_t} (both zero past the chunk's end, where the raw rows the scan reads
  // are zero-filled anyway), and G_t (past the end it stays G_{len-1}, as the cumsum of g = 0: the
  // scan's chunk decay e^{G_63} needs exactly that).
  {
    float x[16];
    const int blk = (tid >> 4) & 3, c = tid & 15;
    if (tid < C) {
      const float* Ab = sA + (16 * blk) * 68 + 16 * blk;
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        float s0 = r == c ? 1.f : 0.f, s1 = 0.f;
#pragma unroll
        for (int jj = 0; jj + 1 < r; jj += 2) {
          s0 = fmaf(-Ab[r * 68 + jj], x[jj], s0);
          s1 = fmaf(-Ab[r * 68 + jj + 1], x[jj + 1], s1);
        }
        if (r & 1) s0 = fmaf(-Ab[r * 68 + r - 1], x[r - 1], s0);
        x[r] = s0 + s1;
      }
    } else {
      const int t = tid - C;
      const bool in = t < ci.len;
      float* sc = ws.scal + slot * kScal;
      sc[t] = in ? sFk[t] * __expf(sG[C - 1] - sG[t]) : 0.f;
      sc[C + t] = in ? sFq[t] * __expf(sG[t]) : 0.f;
      sc[2 * C + t] = sG[t];
    }
    __syncthreads();
    if (tid < C) {
      float* Xb = sA + (16 * blk) * 68 + 16 * blk + c;
#pragma unroll
      for (int r = 0; r < 16; ++r) Xb[r * 68] = x[r];
    }
    __syncthreads();
  }
  {
    // Warp J computes block column J (J < I) of block row I; lane: row r = lane / 2, columns
    // c8 .. c8 + 7 with c8 = 8 (lane % 2), so each shared-memory load feeds 8 FMAs. A_IJ is still
    // read by warps J' < J (term K = J of their M), so X_IJ is written after a block barrier.
    float* sM = reinterpret_cast<float*>(sXb);  // M_IJ scratch [3][16][20] fp32 (sXb is written later)
    const int J = warp, r = lane >> 1, c8 = (lane & 1) * 8;
#pragma unroll
    for (int I = 1; I < 4; ++I) {
      float x[8] = {};
      if (J < I) {
        float m[8] = {};
        const float* arow = sA + (16 * I + r) * 68;
#pragma unroll
        for (int K = 0; K < 3; ++K) {
          if (K < J || K >= I) continue;
#pragma unroll
          for (int m4 = 0; m4 < 4; ++m4) {
            const float4 av = *reinterpret_cast<const float4*>(arow + 16 * K + 4 * m4);
            const float aa[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              fma8(m, aa[e], sA + (16 * K + 4 * m4 + e) * 68 + 16 * J + c8);
            }
          }
        }
        float* mrow = sM + (J * 16 + r) * 20 + c8;
        *reinterpret_cast<float4*>(mrow) = make_float4(m[0], m[1], m[2], m[3]);
        *reinterpret_cast<float4*>(mrow + 4) = make_float4(m[4], m[5], m[6], m[7]);
        __syncwarp();  // M_IJ is read by warp J alone
        const float* xrow = sA + (16 * I + r) * 68 + 16 * I;  // X_II row r (unit lower triangular)
#pragma unroll
        for (int m4 = 0; m4 < 4; ++m4) {
          const float4 xv = *reinterpret_cast<const float4*>(xrow + 4 * m4);
          const float xx[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            fma8(x, xx[e], sM + (J * 16 + 4 * m4 + e) * 20 + c8);
          }
        }
      }
      __syncthreads();  // every warp is done reading row I of A
      if (J < I) {
        float* dst = sA + (16 * I + r) * 68 + 16 * J + c8;
        *reinterpret_cast<float4*>(dst) = make_float4(-x[0], -x[1], -x[2], -x[3]);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(-x[4], -x[5], -x[6], -x[7]);
      }
      __syncthreads();  // X_IJ visible to the next block row
    }
  }
  // X diag(b) and X diag(b e^G) as bf16 tiles for the tensor cores (X is zero above the diagonal).
  {
    const int cidx = tid & (C - 1);
    const float bc = sB[cidx], bgc = sB[cidx] * __expf(sG[cidx]);
#pragma unroll 8
    for (int i = tid >> 6; i < C; i += 2) {
      const float xv = sA[i * 68 + cidx];
      sXb[i * LDP + cidx] = __float2bfloat16_rn(xv * bc);
      sXbg[i * LDP + cidx] = __float2bfloat16_rn(xv * bgc);
    }
  }
  __syncthreads();

  // V into region R (X is in sXb / sXbg now), in flight while W = Xbg K is computed and stored.
  cp_async_rows(sV, v + (size_t(ci.t0) * Hv + h) * D, size_t(Hv) * D, ci.len, tid, kThreads);
  cp_async_commit();
  // W = Xbg K and U = Xb V (X is lower triangular: k-steps past the warp's rows are zero).
  {
    float acc[16][4] = {};
    mma_rows16<C / 16, 8>(acc, sXbg, LDP, 16 * warp, sK, LD, 0, lane, warp + 1);
    __syncthreads();  // every warp is done with K: its tile becomes the W stage
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      *reinterpret_cast<uint32_t*>(sStage + (16 * warp + gi) * LD + n * 8 + cc) = pack_bf16(acc[n][0], acc[n][1]);
      *reinterpret_cast<uint32_t*>(sStage + (16 * warp + gi + 8) * LD + n * 8 + cc) = pack_bf16(acc[n][2], acc[n][3]);
    }
    cp_async_wait<0>();
    __syncthreads();  // W staged, V landed
    store_tile(ws.W + slot * kWElems, sStage, tid);
  }
  {
    float acc[16][4] = {};
    mma_rows16<C / 16, 8>(acc, sXb, LDP, 16 * warp, sV, LD, 0, lane, warp + 1);
    __syncthreads();  // the W stage is stored: it becomes the U^T stage
    bf16* sUT = sStage;  // [128][68]: U^T, row = value column
    const int t0 = 16 * warp + gi;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const int col = 8 * n + cc;
      sUT[col * 68 + t0] = __float2bfloat16_rn(acc[n][0]);
      sUT[(col + 1) * 68 + t0] = __float2bfloat16_rn(acc[n][1]);
      sUT[col * 68 + t0 + 8] = __float2bfloat16_rn(acc[n][2]);
      sUT[(col + 1) * 68 + t0 + 8] = __float2bfloat16_rn(acc[n][3]);
    }
    __syncthreads();
    bf16* UT = ws.UT + slot * kWElems;
#pragma unroll
    for (int i = 0; i < D * C / 4 / kThreads; ++i) {  // 8-byte pieces
      const int p = tid + i * kThreads, row = p >> 4, c4 = (p & 15) * 4;
      *reinterpret_cast<uint2*>(UT + row * C + c4) = *reinterpret_cast<const uint2*>(sUT + row * 68 + c4);
    }
  }
}


// Once per device (the shared-memory opt-in is a per-device function attribute): returns the
// current device's SM count.
int configure() {
  const int dev = current_device();
  static DeviceOnce once;
  return once.run(dev, [](int d) {
    check_cuda(cudaFuncSetAttribute(gdn_wy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kWySmem),
               "cudaFuncSetAttribute(gdn_wy_kernel)");
    check_cuda(cudaFuncSetAttribute(gdn_scan_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kScanSmem),
               "cudaFuncSetAttribute(gdn_scan_kernel)");
    int sms = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d), "cudaDeviceGetAttribute(SMs)");
    return sms;
  });
}

}  // namespace

GdnWorkspace::GdnWorkspace() = default;

GdnWorkspace::~GdnWorkspace() {
  if (side_) cudaStreamDestroy(side_);
  if (fork_) cudaEventDestroy(fork_);
  if (join_) cudaEventDestroy(join_);
  if (mem_) cudaFree(mem_);
  if (split_mem_) cudaFree(split_mem_);
  if (job_mem_) cudaFree(job_mem_);
}

void GdnWorkspace::reserve(size_t chunk_heads) {
  if (chunk_heads <= chunk_heads_cap_ && mem_) return;
  chunk_heads_cap_ = std::max(chunk_heads, chunk_heads_cap_);
  if (mem_) {
    check_cuda(cudaFree(mem_), "cudaFree(GdnWorkspace)");
    mem_ = nullptr;
    bytes_ = 0;
  }
  const size_t bytes = chunk_heads_cap_ * kPerChunkHeadBytes;
  check_cuda(cudaMalloc(&mem_, bytes), "cudaMalloc(GdnWorkspace, " + std::to_string(bytes) + " bytes)");
  bytes_ = bytes;
}

// The scan plan of one call shape (see GdnWorkspace): chunk table and scan jobs (on the device in
// ws.job_mem_), the launch layouts and the split sequences' state slots.
struct GdnPlan {
  std::vector<int> key;  // cu_seqlens, head counts, requested outputs, seq_parts
  bool t_in_launch1 = false;  // some job of launch 1 carries T columns
  int nchunks = 0, njobs1 = 0, njobs2 = 0, n_split = 0;
  size_t chunk_table_bytes = 0;
  struct Split {
    int seq, P;
    int F, Tp, I;  // first slots of F[p] (final state of part p from its start), Tp[p] (its T), I[p]
  };
  std::vector<Split> splits;
};

namespace {

std::vector<int> plan_key(const GdnPrefillArgs& a) {
  std::vector<int> key(a.cu_seqlens_host, a.cu_seqlens_host + a.num_seqs + 1);
  key.insert(key.end(), {a.num_seqs, a.num_k_heads, a.num_v_heads, a.out != nullptr, a.transition != nullptr,
                         a.seq_parts, a.num_checkpoints, a.final_state_last_only});
  key.insert(key.end(), a.checkpoint_tokens_host, a.checkpoint_tokens_host + a.num_checkpoints);
  return key;
}

// Builds the plan for `a`: the chunk table and scan jobs as one host table (copied to the device by
// the caller) and the bytes of split-state arena they need.
void build_plan(const GdnPrefillArgs& a, GdnPlan& plan, std::vector<unsigned char>& table,
                size_t& split_bytes) {
  std::vector<ChunkInfo> chunks;
  std::vector<int> seq_start(a.num_seqs + 1);
  int next_cp = 0;  // checkpoints are increasing: the chunking restarts after each
  for (int s = 0; s < a.num_seqs; ++s) {
    const int t0 = a.cu_seqlens_host[s], t1 = a.cu_seqlens_host[s + 1];
    seq_start[s] = static_cast<int>(chunks.size());
    for (int t = t0; t < t1;) {
      int end = std::min(t + C, t1), cp = 0;
      if (next_cp < a.num_checkpoints && a.checkpoint_tokens_host[next_cp] <= end) {
        end = a.checkpoint_tokens_host[next_cp];
        cp = ++next_cp;
      }
      chunks.push_back({s, t, end - t, cp});
      t = end;
    }
  }
  seq_start[a.num_seqs] = static_cast<int>(chunks.size());
  plan.nchunks = static_cast<int>(chunks.size());
  const bool with_t = a.transition != nullptr, with_out = a.out != nullptr;
  const std::vector<int> parts = gdn_scan_parts(a);
  int max_parts = 1;
  plan.n_split = 0;
  plan.splits.clear();
  for (int s = 0; s < a.num_seqs; ++s)
    if (parts[s] > 1) {
      max_parts = std::max(max_parts, parts[s]);
      ++plan.n_split;
    }
  for (int s = 0, k = 0; s < a.num_seqs; ++s) {
    if (parts[s] == 1) continue;
    const int b0 = 3 * max_parts * k++;
    plan.splits.push_back({s, parts[s], b0, b0 + max_parts, b0 + 2 * max_parts});
  }
  split_bytes = size_t(3) * max_parts * plan.n_split * size_t(a.num_v_heads) * D * D * sizeof(float);
  auto part_range = [&](int s, int P, int p, int& c0, int& n) {
    const int nc_s = seq_start[s + 1] - seq_start[s];
    const int lo = int(long(nc_s) * p / P), hi = int(long(nc_s) * (p + 1) / P);
    c0 = seq_start[s] + lo;
    n = hi - lo;
  };
  std::vector<ScanJob> jobs1, jobs2;
  // Where sequence s's final state goes (GdnPrefillArgs::final_state_last_only: the last one's only).
  auto final_ref = [&](int s) {
    if (!a.final_state_last_only) return kRefUser;
    return s == a.num_seqs - 1 ? kRefUserLast : kRefNone;
  };
  // Launch 1: parts of split sequences first (they carry the critical path), then whole sequences.
  for (const GdnPlan::Split& sp : plan.splits) {
    const int last1 = with_out ? sp.P - 2 : sp.P - 1;  // without outputs every part runs here
    for (int pp = 0; pp <= last1; ++pp) {
      ScanJob j{};
      part_range(sp.seq, sp.P, pp, j.c_begin, j.nc);
      j.seq = sp.seq;
      j.out = pp == 0 && with_out;
      j.init = pp == 0 ? kRefUser : kRefNone;
      j.init_t = kRefNone;
      j.final_state = sp.F + pp;
      j.transition = (pp > 0 || with_t) ? sp.Tp + pp : kRefNone;
      j.checkpoints = pp == 0;  // later parts start from zero here (and again from their true states in launch 2)
      plan.t_in_launch1 |= j.transition != kRefNone;
      jobs1.push_back(j);
    }
  }
  for (int s = 0; s < a.num_seqs; ++s) {
    if (parts[s] > 1) continue;
    jobs1.push_back({seq_start[s], seq_start[s + 1] - seq_start[s], with_out, s, kRefUser, kRefNone, final_ref(s),
                     kRefUser, 1});
  }
  // Launch 2 (with outputs): parts 1 .. P-1 from their composed initial states I[1] = F[0], I[p].
  if (with_out)
    for (const GdnPlan::Split& sp : plan.splits)
      for (int pp = 1; pp < sp.P; ++pp) {
        ScanJob j{};
        part_range(sp.seq, sp.P, pp, j.c_begin, j.nc);
        j.seq = sp.seq;
        j.out = 1;
        j.init = pp == 1 ? sp.F : sp.I + pp;
        j.final_state = pp == sp.P - 1 ? final_ref(sp.seq) : kRefNone;
        // T_C = T[P-1] (T[P-2] ... T[0]): the last part's T columns start from the prefix in I[0].
        const bool last_t = pp == sp.P - 1 && with_t;
        j.init_t = last_t ? (sp.P == 2 ? sp.Tp : sp.I) : kRefNone;
        j.transition = last_t ? kRefUser : kRefNone;
        j.checkpoints = 1;
        jobs2.push_back(j);
      }
  plan.njobs1 = static_cast<int>(jobs1.size());
  plan.njobs2 = static_cast<int>(jobs2.size());
  plan.chunk_table_bytes = (chunks.size() * sizeof(ChunkInfo) + 15) / 16 * 16;
  table.assign(plan.chunk_table_bytes + (jobs1.size() + jobs2.size()) * sizeof(ScanJob), 0);
  if (!chunks.empty()) std::memcpy(table.data(), chunks.data(), chunks.size() * sizeof(ChunkInfo));
  std::memcpy(table.data() + plan.chunk_table_bytes, jobs1.data(), jobs1.size() * sizeof(ScanJob));
  if (!jobs2.empty())
    std::memcpy(table.data() + plan.chunk_table_bytes + jobs1.size() * sizeof(ScanJob), jobs2.data(),
                jobs2.size() * sizeof(ScanJob));
  plan.key = plan_key(a);
}

}  // namespace

bool gdn_scan_wgmma_active() {
  // The candidate HYPIC_GDN_SCAN_WGMMA: the scan's products on warpgroup MMAs (gdn_scan_wgmma.cu).
  static CandidateSwitch scan_wgmma_switch("HYPIC_GDN_SCAN_WGMMA");
#if HYPIC_GDN_SCAN_WGMMA_BUILT
  return scan_wgmma_switch.on() && current_device_is_sm90();
#else
  (void)scan_wgmma_switch;  // (no sm_90a code in this build)
  return false;
#endif
}

void gdn_prefill(const GdnPrefillArgs& a, GdnWorkspace& ws, cudaStream_t stream) {
  detail::validate_gdn_args(a, "gdn_prefill");
  const int total_tokens = a.cu_seqlens_host[a.num_seqs];
  const bool fused_gates = a.gate_a || a.gate_b || a.A_log || a.dt_bias;
  if (fused_gates && (a.g || a.beta))
    throw std::invalid_argument("gdn_prefill: give either g and beta or the fused gate inputs, not both");
  if (total_tokens > 0) {
    for (const auto& [ptr, name] : {std::pair<const void*, const char*>{a.k, "k"}, {a.v, "v"}})
      if (!ptr) throw std::invalid_argument(std::string("gdn_prefill: ") + name + " is null");
    if (fused_gates) {
      for (const auto& [ptr, name] : {std::pair<const void*, const char*>{a.gate_a, "gate_a"}, {a.gate_b, "gate_b"},
                                      {a.A_log, "A_log"}, {a.dt_bias, "dt_bias"}})
        if (!ptr) throw std::invalid_argument(std::string("gdn_prefill: ") + name + " is null (fused gates)");
    } else {
      for (const auto& [ptr, name] : {std::pair<const void*, const char*>{a.g, "g"}, {a.beta, "beta"}})
        if (!ptr) throw std::invalid_argument(std::string("gdn_prefill: ") + name + " is null");
    }
  }
  if (a.out && total_tokens > 0 && !a.q) throw std::invalid_argument("gdn_prefill: q is null but out is requested");
  // 16-byte vector accesses: q, k, v rows (uint4, cp.async), out rows, states (float4 in compose_fold).
  for (const auto& [ptr, name] :
       {std::pair<const void*, const char*>{a.q, "q"}, {a.k, "k"}, {a.v, "v"}, {a.out, "out"},
        {a.initial_state, "initial_state"}, {a.final_state, "final_state"}, {a.transition, "transition"}})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
      throw std::invalid_argument(std::string("gdn_prefill: ") + name + " must be 16-byte aligned");

  const int num_sms = configure();
  const bool with_t = a.transition != nullptr, with_out = a.out != nullptr;
  // The plan: reused while cu_seqlens, head counts and requested outputs stay the same.
  if (!ws.plan_ || ws.plan_->key != plan_key(a)) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
    if (capturing != cudaStreamCaptureStatusNone)
      throw std::invalid_argument(
          "gdn_prefill: a new call shape (cu_seqlens, heads, requested outputs, seq_parts) during CUDA graph "
          "capture: make one uncaptured call of this shape on this workspace first");
    auto plan = std::make_unique<GdnPlan>();
    std::vector<unsigned char> table;
    size_t split_bytes = 0;
    build_plan(a, *plan, table, split_bytes);
    ws.plan_.reset();  // a failed allocation or copy below must not leave a plan over freed buffers
    ws.reserve_split(split_bytes, table.size());
    check_cuda(cudaMemcpyAsync(ws.job_mem_, table.data(), table.size(), cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync(chunk table and scan jobs)");
    ws.plan_ = std::move(plan);
    ++ws.plans_built_;
  }
  const GdnPlan& plan = *ws.plan_;
  const int nchunks = plan.nchunks;
  ws.reserve(size_t(nchunks) * a.num_v_heads);
  auto* base = static_cast<unsigned char*>(ws.mem_);
  WsView v{};
  const size_t cap = ws.chunk_heads_cap_;
  v.W = reinterpret_cast<bf16*>(base);
  v.UT = v.W + cap * kWElems;
  v.P = v.UT + cap * kWElems;
  v.scal = reinterpret_cast<float*>(v.P + cap * kPElems);
  auto* table_dev = static_cast<unsigned char*>(ws.job_mem_);
  v.chunks = reinterpret_cast<const ChunkInfo*>(table_dev);
  const auto* jobs_dev = reinterpret_cast<const ScanJob*>(table_dev + plan.chunk_table_bytes);
  auto* split = static_cast<float*>(ws.split_mem_);
  if (nchunks > 0) {
    gdn_wy_kernel<<<unsigned(nchunks) * unsigned(a.num_v_heads), kThreads, kWySmem, stream>>>(
        a.out ? a.q : nullptr, a.k, a.v, a.g, a.beta, GateInputs{a.gate_a, a.gate_b, a.A_log, a.dt_bias},
        a.num_k_heads, a.num_v_heads, a.l2norm_qk, a.scale, v);
    check_cuda(cudaGetLastError(), "gdn_wy_kernel launch");
  }

  ScanParams sp{};
  sp.Hk = a.num_k_heads;
  sp.Hv = a.num_v_heads;
  sp.q = a.q;
  sp.k = a.k;
  sp.out = a.out;
  sp.user_init = a.initial_state;
  sp.user_final = a.final_state;
  sp.user_transition = a.transition;
  sp.split = split;
  sp.checkpoints = a.checkpoint_states;
  sp.ws = v;
  sp.s_blocks = 2;
  const bool scan_wgmma = gdn_scan_wgmma_active();
  (void)scan_wgmma;  // (unused in a build without sm_90a code)
  auto launch = [&](const ScanJob* jobs, int njobs, bool need_t, bool mixed_forced) {
    if (njobs == 0) return;
    // Layout: with few (job, head) pairs S and T columns go to separate blocks, so T blocks run on
    // otherwise idle SMs; with many, each block carries 64 columns of both S and T (mixed), sharing
    // the staged tiles.
    sp.with_out = with_out;
    sp.jobs = jobs;
    const long pairs = long(njobs) * a.num_v_heads;
    const int t_blocks = need_t ? (with_out ? 1 : 2) : 0;  // T blocks have as many warps as S blocks
    int layout = mixed_forced ? 2 : a.scan_layout;
    if (layout == 0) layout = pairs * (sp.s_blocks + t_blocks) <= num_sms ? 1 : 2;
    sp.mixed = layout == 2 && need_t;
    const int warps = 4 * (1 + (with_out ? 1 : 0) + (sp.mixed ? 1 : 0));
    const int blocks_per_head = sp.mixed ? 2 : sp.s_blocks + t_blocks;
    const dim3 grid(blocks_per_head, a.num_v_heads, njobs);
#if HYPIC_GDN_SCAN_WGMMA_BUILT
    if (scan_wgmma) {
      launch_scan_wgmma(grid, warps * 32, sp, stream);
      return;
    }
#endif
    gdn_scan_kernel<false><<<grid, warps * 32, kScanSmem, stream>>>(sp);
    check_cuda(cudaGetLastError(), "gdn_scan_kernel launch");
  };
  // Launch 1 needs T warps for the middle parts of split sequences (mixed blocks keep those at
  // two blocks per job and head).
  launch(jobs_dev, plan.njobs1, with_t || plan.t_in_launch1, plan.t_in_launch1);

  // Initial states of the parts: I[1] = F[0]; I[p+1] = T[p] I[p] + F[p] (composition law,
  // DESIGN.md 3.1). Without outputs the chain runs to the end: final = T[P-1] I[P-1] + F[P-1].
  // With outputs and T_C, I[0] receives the prefix transition T[P-2] ... T[0] that the last part's
  // T columns start from.
  const int Hv = a.num_v_heads;
  const size_t state_bytes = size_t(Hv) * D * D * sizeof(float);
  auto slot = [&](int i) { return state_ref(i, 0, nullptr, split, Hv); };
  // The transition folds (T prefix, or T_C without outputs) run on a side stream beside the state
  // folds: fork after launch 1, join before launch 2 (or the end). Capturable in a CUDA graph.
  const bool t_chain = with_t && !plan.splits.empty();
  cudaStream_t ts = stream;
  if (t_chain) {
    ws.ensure_side_stream();
    ts = ws.side_override_ ? ws.side_override_ : ws.side_;
    check_cuda(cudaEventRecord(ws.fork_, stream), "cudaEventRecord(fork)");
    check_cuda(cudaStreamWaitEvent(ts, ws.fork_, 0), "cudaStreamWaitEvent(fork)");
  }
  for (const GdnPlan::Split& q : plan.splits) {
    const float* prev = slot(q.F);  // I[1] = F[0]
    for (int pp = 2; pp < q.P; ++pp) {
      float* dst = slot(q.I + pp);
      check_cuda(cudaMemcpyAsync(dst, prev, state_bytes, cudaMemcpyDeviceToDevice, stream), "copy of a part state");
      compose_fold(Hv, 1, dst, slot(q.Tp + pp - 1), slot(q.F + pp - 1), stream);
      prev = dst;
    }
    if (with_out && with_t && q.P > 2) {
      check_cuda(cudaMemcpyAsync(slot(q.I), slot(q.Tp), state_bytes, cudaMemcpyDeviceToDevice, ts), "copy of T[0]");
      compose_fold(Hv, q.P - 2, slot(q.I), slot(q.Tp + 1), nullptr, ts);
    }
    if (!with_out) {
      const int fin_ref = !a.final_state_last_only ? kRefUser : q.seq == a.num_seqs - 1 ? kRefUserLast : kRefNone;
      float* fin = state_ref(fin_ref, q.seq, a.final_state, split, Hv);
      if (fin) {
        check_cuda(cudaMemcpyAsync(fin, prev, state_bytes, cudaMemcpyDeviceToDevice, stream),
                   "copy of the final state");
        compose_fold(Hv, 1, fin, slot(q.Tp + q.P - 1), slot(q.F + q.P - 1), stream);
      }
      float* tc = state_ref(kRefUser, q.seq, a.transition, split, Hv);
      if (tc) {  // T_C = T[P-1] ... T[1] T[0]
        check_cuda(cudaMemcpyAsync(tc, slot(q.Tp), state_bytes, cudaMemcpyDeviceToDevice, ts), "copy of T[0]");
        compose_fold(Hv, q.P - 1, tc, slot(q.Tp + 1), nullptr, ts);
      }
    }
  }
  if (t_chain) {
    check_cuda(cudaEventRecord(ws.join_, ts), "cudaEventRecord(join)");
    check_cuda(cudaStreamWaitEvent(stream, ws.join_, 0), "cudaStreamWaitEvent(join)");
  }
  launch(jobs_dev + plan.njobs1, plan.njobs2, with_t, with_t);
}

}  // namespace hypic::kernels::cuda
