// Chunked gated delta rule prefill with the segment transition T_C (see gated_delta.h).
//
// Three launches, chunk C = 64, head size 128, per (chunk, value head) unless stated:
//  1. gdn_wy_kernel: l2-normalise k (fp32, rounded to bf16 once), G = in-chunk cumsum of g,
//     A_ij = b_i e^{G_i - G_j} k_i.k_j (j < i), X = (I + A)^{-1} by column-parallel forward
//     substitution in fp32, then on tensor cores W = X diag(b e^G) K, U = X diag(b) V;
//     also K~_j = e^{G_C - G_j} k_j. Stored bf16 in the workspace.
//  2. gdn_scan_kernel, per (sequence, value head, 64-column block of [S | T]): the sequential
//     chunk scan. The running block h stays fp32 in tensor-core accumulators; per chunk
//       v_new = U - W h          (for T columns U = 0, h starts at I)
//       h     = gamma h + K~^T v_new,   gamma = e^{G_C}
//     which is S_C = T_chunk S_0 + K~^T U with T_chunk = gamma I - K~^T W (hybrid_models.md 5.4),
//     so the T columns accumulate T_C = T_n ... T_1 in the same pass, on blocks that run beside
//     the S blocks. S blocks also store the chunk-entry state (bf16) and v_new for step 3.
//  3. gdn_output_kernel: o_i = e^{G_i} q_i^T h_c + sum_{j<=i} e^{G_i - G_j} (q_i.k_j) v_new_j.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/mma.cuh"

namespace hypic::kernels::cuda {
namespace {

using namespace detail;

constexpr int D = kGdnHeadDim;  // 128
constexpr int C = kGdnChunk;    // 64
constexpr int LD = D + 8;       // padded row of a [*][128] bf16 tile
constexpr int BV = 64;          // columns of [S | T] per scan block
constexpr int LDV = BV + 8;     // padded row of a [*][64] bf16 tile
constexpr int kThreads = 128;

// Workspace layout per (chunk, value head), in elements.
constexpr size_t kWElems = size_t(C) * D;  // W, U (later v_new), K~: [64][128] bf16 each
constexpr size_t kHElems = size_t(D) * D;  // chunk-entry state, [128][128] bf16
constexpr size_t kPerChunkHeadBytes = 3 * kWElems * 2 + kHElems * 2 + C * sizeof(float);

struct ChunkInfo {
  int seq, t0, len, pad;
};

struct WsView {
  bf16* W;
  bf16* U;
  bf16* Kt;
  bf16* H;
  float* G;
  const ChunkInfo* chunks;
  const int* seq_chunk_start;
};

// Loads 64 rows of 128 bf16 (row r at src + r * row_stride, rows >= len zero) into a [64][LD]
// tile; optionally l2-normalises each row in fp32 (x * rsqrt(sum x^2 + 1e-6)) and multiplies by
// `mul` before the single rounding to bf16. 128 threads, two per row.
__device__ __forceinline__ void load_rows(bf16* s, const bf16* src, size_t row_stride, int len, bool norm, float mul,
                                          int tid) {
  const int r = tid >> 1, half = tid & 1;
  uint4 raw[8];
  if (r < len) {
    const uint4* p = reinterpret_cast<const uint4*>(src + size_t(r) * row_stride + half * 64);
#pragma unroll
    for (int i = 0; i < 8; ++i) raw[i] = p[i];
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) raw[i] = make_uint4(0, 0, 0, 0);
  }
  float f = mul;
  if (norm) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw[i]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 x = __bfloat1622float2(h2[e]);
        ss += x.x * x.x + x.y * x.y;
      }
    }
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    f = mul * rsqrtf(ss + 1e-6f);
  }
  uint4* d = reinterpret_cast<uint4*>(s + r * LD + half * 64);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint4 o = raw[i];
    if (norm || mul != 1.f) {
      __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 x = __bfloat1622float2(h2[e]);
        h2[e] = __floats2bfloat162_rn(x.x * f, x.y * f);
      }
    }
    d[i] = o;
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

// cp.async of a dense [ROWS][128] bf16 global block into a [ROWS][LD] shared tile by NT threads.
template <int ROWS, int NT>
__device__ __forceinline__ void cp_async_tile(bf16* s, const bf16* g, int tid) {
#pragma unroll
  for (int i = 0; i < ROWS * 16 / NT; ++i) {
    const int p = tid + i * NT, row = p >> 4, col = (p & 15) * 8;
    cp_async16(s + row * LD + col, g + row * D + col);
  }
}

// Writes a warp's 16 x 128 accumulator block (rows m0..m0+15) into a [*][LD] bf16 tile.
__device__ __forceinline__ void acc_to_tile(bf16* s, const float (&acc)[16][4], int m0, int lane) {
  const int g = lane >> 2, c = (lane & 3) * 2;
#pragma unroll
  for (int n = 0; n < 16; ++n) {
    *reinterpret_cast<uint32_t*>(s + (m0 + g) * LD + n * 8 + c) = pack_bf16(acc[n][0], acc[n][1]);
    *reinterpret_cast<uint32_t*>(s + (m0 + g + 8) * LD + n * 8 + c) = pack_bf16(acc[n][2], acc[n][3]);
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

// ---------------------------------------------------------------------------------------------
// 1. WY factors per (chunk, value head).
constexpr int kWySmem = 3 * C * LD * 2 + 2 * C * (C + 8) * 2 + 2 * C * 4;

__global__ void __launch_bounds__(kThreads) gdn_wy_kernel(const bf16* __restrict__ k, const bf16* __restrict__ v,
                                                          const float* __restrict__ g,
                                                          const float* __restrict__ beta, int Hk, int Hv,
                                                          bool l2norm, WsView ws) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + C * LD;
  float* sA = reinterpret_cast<float*>(sV + C * LD);  // [64][68] fp32, later a [64][LD] bf16 stage
  bf16* sStage = reinterpret_cast<bf16*>(sA);
  bf16* sXb = reinterpret_cast<bf16*>(sA + C * 68);  // [64][72]
  bf16* sXbg = sXb + C * (C + 8);
  float* sG = reinterpret_cast<float*>(sXbg + C * (C + 8));
  float* sB = sG + C;

  const int chunk = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const ChunkInfo ci = ws.chunks[chunk];
  const int kh = h / (Hv / Hk);
  const size_t slot = size_t(chunk) * Hv + h;

  load_rows(sK, k + (size_t(ci.t0) * Hk + kh) * D, size_t(Hk) * D, ci.len, l2norm, 1.f, tid);
  load_rows(sV, v + (size_t(ci.t0) * Hv + h) * D, size_t(Hv) * D, ci.len, false, 1.f, tid);
  if (warp == 0) {  // inclusive cumsum of g over the chunk, two tokens per lane
    const int r0 = 2 * lane;
    float g0 = 0.f, g1 = 0.f;
    if (r0 < ci.len) g0 = g[size_t(ci.t0 + r0) * Hv + h];
    if (r0 + 1 < ci.len) g1 = g[size_t(ci.t0 + r0 + 1) * Hv + h];
    float s = g0 + g1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float t = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += t;
    }
    sG[r0] = s - g1;
    sG[r0 + 1] = s;
  } else if (warp == 1) {
    for (int r = lane; r < C; r += 32) sB[r] = r < ci.len ? beta[size_t(ci.t0 + r) * Hv + h] : 0.f;
  }
  __syncthreads();

  // A = K K^T (strictly lower part), scaled by b_i e^{G_i - G_j}.
  {
    float acc[8][4] = {};
    causal_xyt(acc, sK, sK, warp, lane);
    const int gi = lane >> 2, cc = (lane & 3) * 2;
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

  if (tid < C) {
    // Column tid of X = (I + A)^{-1}: x_i = [i == c] - sum_{j<i} A_ij x_j (A is zero on and above
    // the diagonal, so the unrolled sums may run over whole float4 groups).
    const int c = tid;
    float x[C];
#pragma unroll
    for (int i = 0; i < C; ++i) x[i] = 0.f;
#pragma unroll
    for (int i = 0; i < C; ++i) {
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
      for (int j4 = 0; j4 < (i + 3) / 4; ++j4) {
        const float4 a = *reinterpret_cast<const float4*>(sA + i * 68 + 4 * j4);
        s0 = fmaf(a.x, x[4 * j4], s0);
        s1 = fmaf(a.y, x[4 * j4 + 1], s1);
        s2 = fmaf(a.z, x[4 * j4 + 2], s2);
        s3 = fmaf(a.w, x[4 * j4 + 3], s3);
      }
      x[i] = (i == c ? 1.f : 0.f) - ((s0 + s1) + (s2 + s3));
    }
    const float bc = sB[c], bgc = sB[c] * __expf(sG[c]);
#pragma unroll
    for (int i = 0; i < C; ++i) {
      sXb[i * (C + 8) + c] = __float2bfloat16_rn(x[i] * bc);
      sXbg[i * (C + 8) + c] = __float2bfloat16_rn(x[i] * bgc);
    }
  } else {
    // K~_j = e^{G_C - G_j} k_j and the cumulative gates, straight to the workspace.
    const int j = tid - C;
    const float f = __expf(sG[C - 1] - sG[j]);
    bf16* dst = ws.Kt + slot * kWElems + j * D;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      uint4 o = *reinterpret_cast<const uint4*>(sK + j * LD + 8 * i);
      __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 xv = __bfloat1622float2(h2[e]);
        h2[e] = __floats2bfloat162_rn(xv.x * f, xv.y * f);
      }
      *reinterpret_cast<uint4*>(dst + 8 * i) = o;
    }
    ws.G[slot * C + j] = sG[j];
  }
  __syncthreads();

  // W = Xbg K and U = Xb V (X is lower triangular: k-steps past the warp's rows are zero).
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const bf16* sX = pass == 0 ? sXbg : sXb;
    const bf16* sR = pass == 0 ? sK : sV;
    float acc[16][4] = {};
    mma_rows16<C / 16, 8>(acc, sX, C + 8, 16 * warp, sR, LD, 0, lane, warp + 1);
    acc_to_tile(sStage, acc, 16 * warp, lane);
    __syncthreads();
    store_tile((pass == 0 ? ws.W : ws.U) + slot * kWElems, sStage, tid);
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// 2. Sequential scan over chunks, per (sequence, value head, 64-column block of [S | T]).
// 8 warps: warp w works on row group wr = w % 4 and column half wc = w / 4 of the block, so each
// chunk's W and K~ are loaded once for 64 columns (the scan is bound by latency and L2 traffic).
// W, K~ and G are double-buffered in shared memory through cp.async; each thread reads its own
// U fragment straight from global memory into registers, one chunk ahead. At under 113 KB of
// shared memory and 128 registers, two blocks fit on one SM.
constexpr int kScanThreads = 256;
constexpr int kScanStage = 2 * C * LD * 2 + C * 4;  // W, K~, G
constexpr int kScanSmem = 2 * kScanStage + D * LDV * 2 + C * LDV * 2;

__device__ __forceinline__ void scan_issue(unsigned char* stage, const WsView& ws, size_t slot, int tid) {
  bf16* sW = reinterpret_cast<bf16*>(stage);
  bf16* sKt = sW + C * LD;
  float* sG = reinterpret_cast<float*>(sKt + C * LD);
  cp_async_tile<C, kScanThreads>(sW, ws.W + slot * kWElems, tid);
  cp_async_tile<C, kScanThreads>(sKt, ws.Kt + slot * kWElems, tid);
  if (tid < C / 4) cp_async16(sG + 4 * tid, ws.G + slot * C + 4 * tid);
}

__global__ void __launch_bounds__(kScanThreads, 2) gdn_scan_kernel(int Hv, const float* initial_state, float* final_state,
                                                                float* transition, bool store_for_out, WsView ws) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sH = reinterpret_cast<bf16*>(smem + 2 * kScanStage);  // [128][LDV] bf16 h (entry state)
  bf16* sVn = sH + D * LDV;                                     // [64][LDV] bf16 v_new

  const int blk = blockIdx.x, h = blockIdx.y, seq = blockIdx.z;
  const bool is_s = blk < D / BV;
  const int cb = is_s ? blk : blk - D / BV;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wr = warp & 3, wc = warp >> 2;
  const int gi = lane >> 2, cc = (lane & 3) * 2;
  const int c_begin = ws.seq_chunk_start[seq], nc = ws.seq_chunk_start[seq + 1] - c_begin;
  const size_t head = size_t(seq) * Hv + h;

  // Running block: rows 32 wr + 16 mt + (gi, gi + 8), columns 32 wc + 8 nt + cc (+1) of the block.
  float acc[2][4][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 32 * wr + 16 * mt + gi + (e >= 2 ? 8 : 0), col = cb * BV + 32 * wc + 8 * nt + cc + (e & 1);
        float val;
        if (is_s)
          val = initial_state ? initial_state[head * D * D + size_t(row) * D + col] : 0.f;
        else
          val = row == col ? 1.f : 0.f;
        acc[mt][nt][e] = val;
      }

  // U fragment of S blocks: rows 16 wr + gi (+8), columns 32 wc + 8 nt + cc, read from global.
  auto load_u = [&](__nv_bfloat162 (&dst)[4][2], size_t slot) {
    const bf16* U = ws.U + slot * kWElems + cb * BV + 32 * wc + cc;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      dst[nt][0] = *reinterpret_cast<const __nv_bfloat162*>(U + (16 * wr + gi) * D + 8 * nt);
      dst[nt][1] = *reinterpret_cast<const __nv_bfloat162*>(U + (16 * wr + gi + 8) * D + 8 * nt);
    }
  };
  __nv_bfloat162 u_next[4][2] = {};
  if (is_s && nc > 0) load_u(u_next, size_t(c_begin) * Hv + h);
  if (nc > 0) scan_issue(smem, ws, size_t(c_begin) * Hv + h, tid);
  cp_async_commit();
  if (nc > 1) scan_issue(smem + kScanStage, ws, size_t(c_begin + 1) * Hv + h, tid);
  cp_async_commit();

  for (int c = 0; c < nc; ++c) {
    const size_t slot = size_t(c_begin + c) * Hv + h;
    unsigned char* st = smem + (c & 1) * kScanStage;
    const bf16* sW = reinterpret_cast<const bf16*>(st);
    const bf16* sKt = sW + C * LD;
    const float* sG = reinterpret_cast<const float*>(sKt + C * LD);
    // This thread's U fragment of chunk c was loaded during step c - 1; start chunk c + 1's now,
    // so its memory latency hides behind this step.
    __nv_bfloat162 u[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) u[nt][0] = u_next[nt][0], u[nt][1] = u_next[nt][1];
    if (is_s && c + 1 < nc) load_u(u_next, slot + Hv);
    cp_async_wait<1>();
    __syncthreads();

    // h (bf16) for the tensor cores and, for S blocks, the chunk-entry state of the output pass.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int row = 32 * wr + 16 * mt + gi, col = 32 * wc + 8 * nt + cc;
        *reinterpret_cast<uint32_t*>(sH + row * LDV + col) = pack_bf16(acc[mt][nt][0], acc[mt][nt][1]);
        *reinterpret_cast<uint32_t*>(sH + (row + 8) * LDV + col) = pack_bf16(acc[mt][nt][2], acc[mt][nt][3]);
      }
    __syncthreads();
    if (is_s && store_for_out) {
      bf16* dst = ws.H + slot * kHElems + cb * BV;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int p = tid + i * kScanThreads, row = p >> 3, col = (p & 7) * 8;
        *reinterpret_cast<uint4*>(dst + row * D + col) = *reinterpret_cast<const uint4*>(sH + row * LDV + col);
      }
    }

    // v_new = U - W h for chunk rows 16 wr .. + 15, columns 32 wc .. + 31 (as -(W h - U)).
    float vn[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      if (is_s) {
        const float2 u0 = __bfloat1622float2(u[nt][0]);
        const float2 u1 = __bfloat1622float2(u[nt][1]);
        vn[nt][0] = -u0.x;
        vn[nt][1] = -u0.y;
        vn[nt][2] = -u1.x;
        vn[nt][3] = -u1.y;
      } else {
        vn[nt][0] = vn[nt][1] = vn[nt][2] = vn[nt][3] = 0.f;
      }
    }
    mma_rows16<D / 16, 2>(vn, sW, LD, 16 * wr, sH, LDV, 32 * wc, lane);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int row = 16 * wr + gi, col = 32 * wc + 8 * nt + cc;
      *reinterpret_cast<uint32_t*>(sVn + row * LDV + col) = pack_bf16(-vn[nt][0], -vn[nt][1]);
      *reinterpret_cast<uint32_t*>(sVn + (row + 8) * LDV + col) = pack_bf16(-vn[nt][2], -vn[nt][3]);
    }
    __syncthreads();
    if (is_s && store_for_out) {
      bf16* dst = ws.U + slot * kWElems + cb * BV;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int p = tid + i * kScanThreads, row = p >> 3, col = (p & 7) * 8;
        *reinterpret_cast<uint4*>(dst + row * D + col) = *reinterpret_cast<const uint4*>(sVn + row * LDV + col);
      }
    }

    // h = gamma h + K~^T v_new.
    const float gamma = __expf(sG[C - 1]);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][nt][e] *= gamma;
#pragma unroll
    for (int ks = 0; ks < C / 16; ++ks) {
      uint32_t b[2][4];
#pragma unroll
      for (int np = 0; np < 2; ++np) load_b_kn(b[np], sVn, LDV, 16 * ks, 32 * wc + 16 * np, lane);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        uint32_t a[4];
        load_a_trans(a, sKt, LD, 32 * wr + 16 * mt, 16 * ks, lane);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          mma_bf16(acc[mt][2 * np], a, b[np][0], b[np][1]);
          mma_bf16(acc[mt][2 * np + 1], a, b[np][2], b[np][3]);
        }
      }
    }
    __syncthreads();
    if (c + 2 < nc) scan_issue(st, ws, slot + 2 * size_t(Hv), tid);
    cp_async_commit();
  }
  cp_async_wait<0>();

  float* dst = is_s ? final_state : transition;
  if (dst) {
    dst += head * D * D + cb * BV;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int row = 32 * wr + 16 * mt + gi, col = 32 * wc + 8 * nt + cc;
        *reinterpret_cast<float2*>(dst + size_t(row) * D + col) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
        *reinterpret_cast<float2*>(dst + size_t(row + 8) * D + col) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
      }
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Outputs per (chunk, value head).
constexpr int kOutSmem = 3 * C * LD * 2 + D * LD * 2 + C * 4;

__global__ void __launch_bounds__(kThreads) gdn_output_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                              int Hk, int Hv, bool l2norm, float scale,
                                                              bf16* __restrict__ out, WsView ws) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + C * LD;
  bf16* sVn = sK + C * LD;
  bf16* sH = sVn + C * LD;  // [128][LD]
  float* sG = reinterpret_cast<float*>(sH + D * LD);

  const int chunk = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gi = lane >> 2, cc = (lane & 3) * 2;
  const ChunkInfo ci = ws.chunks[chunk];
  const int kh = h / (Hv / Hk);
  const size_t slot = size_t(chunk) * Hv + h;

  {
    cp_async_tile<D, kThreads>(sH, ws.H + slot * kHElems, tid);
    cp_async_tile<C, kThreads>(sVn, ws.U + slot * kWElems, tid);
    if (tid < C / 4) cp_async16(sG + 4 * tid, ws.G + slot * C + 4 * tid);
    cp_async_commit();
  }
  load_rows(sQ, q + (size_t(ci.t0) * Hk + kh) * D, size_t(Hk) * D, ci.len, l2norm, scale, tid);
  load_rows(sK, k + (size_t(ci.t0) * Hk + kh) * D, size_t(Hk) * D, ci.len, l2norm, 1.f, tid);
  cp_async_wait<0>();
  __syncthreads();

  // P = (Q K^T) masked causally (j <= i) and decayed by e^{G_i - G_j}, as bf16 A fragments.
  uint32_t pa[4][4];
  {
    float s[8][4] = {};
    causal_xyt(s, sQ, sK, warp, lane);
    const int i0 = 16 * warp + gi, i1 = i0 + 8;
    const float G0 = sG[i0], G1 = sG[i1];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int j = 8 * t + cc;
      const float Gj0 = sG[j], Gj1 = sG[j + 1];
      s[t][0] = j <= i0 ? s[t][0] * __expf(G0 - Gj0) : 0.f;
      s[t][1] = j + 1 <= i0 ? s[t][1] * __expf(G0 - Gj1) : 0.f;
      s[t][2] = j <= i1 ? s[t][2] * __expf(G1 - Gj0) : 0.f;
      s[t][3] = j + 1 <= i1 ? s[t][3] * __expf(G1 - Gj1) : 0.f;
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      pa[ks][0] = pack_bf16(s[2 * ks][0], s[2 * ks][1]);
      pa[ks][1] = pack_bf16(s[2 * ks][2], s[2 * ks][3]);
      pa[ks][2] = pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      pa[ks][3] = pack_bf16(s[2 * ks + 1][2], s[2 * ks + 1][3]);
    }
  }

  // O = diag(e^G) Q h_c + P V_new.
  float o[16][4] = {};
  mma_rows16<D / 16, 8>(o, sQ, LD, 16 * warp, sH, LD, 0, lane);
  {
    const float e0 = __expf(sG[16 * warp + gi]), e1 = __expf(sG[16 * warp + gi + 8]);
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      o[n][0] *= e0;
      o[n][1] *= e0;
      o[n][2] *= e1;
      o[n][3] *= e1;
    }
  }
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    if (ks <= warp) {
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t b[4];
        load_b_kn(b, sVn, LD, 16 * ks, 16 * np, lane);
        mma_bf16(o[2 * np], pa[ks], b[0], b[1]);
        mma_bf16(o[2 * np + 1], pa[ks], b[2], b[3]);
      }
    }
  }
  __syncwarp();
  acc_to_tile(sQ, o, 16 * warp, lane);  // the warp's own rows of sQ, read only by this warp
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int p = lane + 32 * i, row = 16 * warp + (p >> 4), col = (p & 15) * 8;
    if (row < ci.len)
      *reinterpret_cast<uint4*>(out + (size_t(ci.t0 + row) * Hv + h) * D + col) =
          *reinterpret_cast<const uint4*>(sQ + row * LD + col);
  }
}

bool smem_configured = false;

void configure_smem() {
  if (smem_configured) return;
  check_cuda(cudaFuncSetAttribute(gdn_wy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kWySmem),
             "cudaFuncSetAttribute(gdn_wy_kernel)");
  check_cuda(cudaFuncSetAttribute(gdn_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kScanSmem),
             "cudaFuncSetAttribute(gdn_scan_kernel)");
  check_cuda(cudaFuncSetAttribute(gdn_output_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kOutSmem),
             "cudaFuncSetAttribute(gdn_output_kernel)");
  smem_configured = true;
}

}  // namespace

GdnWorkspace::~GdnWorkspace() {
  if (mem_) cudaFree(mem_);
}

void GdnWorkspace::reserve(size_t chunk_heads, int num_chunks, int num_seqs) {
  if (chunk_heads <= chunk_heads_cap_ && num_chunks <= chunks_cap_ && num_seqs <= seqs_cap_ && mem_) return;
  chunk_heads_cap_ = std::max(chunk_heads, chunk_heads_cap_);
  chunks_cap_ = std::max(num_chunks, chunks_cap_);
  seqs_cap_ = std::max(num_seqs, seqs_cap_);
  if (mem_) {
    check_cuda(cudaFree(mem_), "cudaFree(GdnWorkspace)");
    mem_ = nullptr;
  }
  bytes_ = chunk_heads_cap_ * kPerChunkHeadBytes + size_t(chunks_cap_) * sizeof(ChunkInfo) +
           size_t(seqs_cap_ + 1) * sizeof(int) + 1024;
  check_cuda(cudaMalloc(&mem_, bytes_), "cudaMalloc(GdnWorkspace, " + std::to_string(bytes_) + " bytes)");
}

void gdn_prefill(const GdnPrefillArgs& a, GdnWorkspace& ws, cudaStream_t stream) {
  if (a.num_seqs < 1 || a.num_seqs > 65535)
    throw std::invalid_argument("gdn_prefill: num_seqs must be in [1, 65535], got " + std::to_string(a.num_seqs));
  if (!a.cu_seqlens_host) throw std::invalid_argument("gdn_prefill: cu_seqlens_host is null");
  if (a.num_k_heads < 1 || a.num_v_heads < 1 || a.num_v_heads % a.num_k_heads != 0 || a.num_v_heads > 65535)
    throw std::invalid_argument("gdn_prefill: num_v_heads (" + std::to_string(a.num_v_heads) +
                                ") must be a positive multiple of num_k_heads (" + std::to_string(a.num_k_heads) +
                                ")");
  if (a.cu_seqlens_host[0] != 0) throw std::invalid_argument("gdn_prefill: cu_seqlens_host[0] must be 0");
  std::vector<ChunkInfo> chunks;
  std::vector<int> seq_start(a.num_seqs + 1);
  for (int s = 0; s < a.num_seqs; ++s) {
    const int t0 = a.cu_seqlens_host[s], t1 = a.cu_seqlens_host[s + 1];
    if (t1 < t0)
      throw std::invalid_argument("gdn_prefill: cu_seqlens_host decreases at sequence " + std::to_string(s) + " (" +
                                  std::to_string(t0) + " > " + std::to_string(t1) + ")");
    seq_start[s] = static_cast<int>(chunks.size());
    for (int t = t0; t < t1; t += C) chunks.push_back({s, t, std::min(C, t1 - t), 0});
  }
  seq_start[a.num_seqs] = static_cast<int>(chunks.size());
  const int total_tokens = a.cu_seqlens_host[a.num_seqs];
  const int nchunks = static_cast<int>(chunks.size());
  if (total_tokens > 0 && (!a.k || !a.v || !a.g || !a.beta))
    throw std::invalid_argument("gdn_prefill: k, v, g and beta must be non-null");
  if (a.out && total_tokens > 0 && !a.q) throw std::invalid_argument("gdn_prefill: q is null but out is requested");

  configure_smem();
  const size_t chunk_heads = size_t(nchunks) * a.num_v_heads;
  ws.reserve(chunk_heads, nchunks, a.num_seqs);
  auto* base = static_cast<unsigned char*>(ws.mem_);
  WsView v{};
  const size_t cap = ws.chunk_heads_cap_;
  v.W = reinterpret_cast<bf16*>(base);
  v.U = v.W + cap * kWElems;
  v.Kt = v.U + cap * kWElems;
  v.H = v.Kt + cap * kWElems;
  v.G = reinterpret_cast<float*>(v.H + cap * kHElems);
  auto* chunk_dev = reinterpret_cast<ChunkInfo*>(v.G + cap * C);
  auto* start_dev = reinterpret_cast<int*>(chunk_dev + ws.chunks_cap_);
  v.chunks = chunk_dev;
  v.seq_chunk_start = start_dev;
  // Pageable host memory: cudaMemcpyAsync stages the data before returning, so locals are safe.
  if (nchunks > 0)
    check_cuda(cudaMemcpyAsync(chunk_dev, chunks.data(), chunks.size() * sizeof(ChunkInfo), cudaMemcpyHostToDevice,
                               stream),
               "cudaMemcpyAsync(chunk table)");
  check_cuda(cudaMemcpyAsync(start_dev, seq_start.data(), seq_start.size() * sizeof(int), cudaMemcpyHostToDevice,
                             stream),
             "cudaMemcpyAsync(sequence chunk offsets)");

  if (nchunks > 0) {
    gdn_wy_kernel<<<dim3(nchunks, a.num_v_heads), kThreads, kWySmem, stream>>>(
        a.k, a.v, a.g, a.beta, a.num_k_heads, a.num_v_heads, a.l2norm_qk, v);
    check_cuda(cudaGetLastError(), "gdn_wy_kernel launch");
  }
  const int nblk = D / BV + (a.transition ? D / BV : 0);
  gdn_scan_kernel<<<dim3(nblk, a.num_v_heads, a.num_seqs), kScanThreads, kScanSmem, stream>>>(
      a.num_v_heads, a.initial_state, a.final_state, a.transition, a.out != nullptr, v);
  check_cuda(cudaGetLastError(), "gdn_scan_kernel launch");
  if (a.out && nchunks > 0) {
    gdn_output_kernel<<<dim3(nchunks, a.num_v_heads), kThreads, kOutSmem, stream>>>(
        a.q, a.k, a.num_k_heads, a.num_v_heads, a.l2norm_qk, a.scale, a.out, v);
    check_cuda(cudaGetLastError(), "gdn_output_kernel launch");
  }
}

}  // namespace hypic::kernels::cuda
