// The WY kernel of the gated delta rule prefill (gated_delta_prefill.cu, which describes the whole pipeline; section
// 1 there): per (chunk, value head), the l2-normalised q / k, the cumulative gates, P, the inverse X = (I + A)^-1 and
// the WY factors W, U^T and the token factors, into the workspace the scan (gdn_scan.cuh) reads. A kernel template
// shared by two translation units: gated_delta_prefill.cu instantiates the mma.sync products (kWgmma = false),
// gdn_wgmma.cu (sm_90a only) the products on warpgroup MMAs (kWgmma = true, the switch HYPIC_GDN_WY_WGMMA, default on).
// Internal to kernels/cuda.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gates.cuh"
#include "kernels/cuda/gdn_scan.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace hypic::kernels::cuda::detail::gdn {

constexpr int kWyThreads = 128;  // one warpgroup

// 64 rows of 128 bf16 (row r at src + r * row_stride, rows >= len zero) by 128 threads: thread t
// holds the 16-byte piece t % 16 of rows t / 16 + 8 i (i < 8), so each load instruction of a warp
// reads two whole 256-byte rows. load_raw fetches the pieces into registers (so that several
// tiles' loads are in flight together); finish_rows optionally l2-normalises each row in fp32
// (x * rsqrt(sum x^2 + 1e-6), the sum over the 16 lanes of a row), multiplies by `mul`, rounds to
// bf16 once, writes the [64][LD] tile (kSw: the swizzled [64][128] tile of sw_off) and the rows' factors
// (mul * rsqrt(...), or mul) to f[64].
__device__ __forceinline__ void load_raw(uint4 (&raw)[8], const bf16* src, size_t row_stride, int len, int tid) {
  const int r0 = tid >> 4, piece = tid & 15;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = r0 + 8 * i;
    raw[i] = r < len ? *reinterpret_cast<const uint4*>(src + size_t(r) * row_stride + piece * 8)
                     : make_uint4(0, 0, 0, 0);
  }
}

// One row of finish_rows: thread piece `piece` (8 elements, raw) of row r.
template <bool kSw>
__device__ __forceinline__ void finish_row(bf16* s, uint4 raw, bool norm, float mul, int r, int piece, float* f_out) {
  float f = mul;
  if (norm) {
    const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
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
  uint4 o = raw;
  if (norm || mul != 1.f) {
    __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 x = __bfloat1622float2(h2[e]);
      h2[e] = __floats2bfloat162_rn(x.x * f, x.y * f);
    }
  }
  if constexpr (kSw)
    *reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(s) + sw_off(r, piece)) = o;
  else
    *reinterpret_cast<uint4*>(s + r * LD + piece * 8) = o;
  if (piece == 0) f_out[r] = f;
}

template <bool kSw = false>
__device__ __forceinline__ void finish_rows(bf16* s, const uint4 (&raw)[8], bool norm, float mul, int tid,
                                            float* f_out) {
  const int r0 = tid >> 4, piece = tid & 15;
#pragma unroll
  for (int i = 0; i < 8; ++i) finish_row<kSw>(s, raw[i], norm, mul, r0 + 8 * i, piece, f_out);
}

// ---------------------------------------------------------------------------------------------
// 0. The conv fused in (GdnPrefillArgs::conv, gated_delta.h GdnConvIn): conv1d_silu_prefill's arithmetic (conv1d.cu)
// on the raw in_proj rows, so the WY kernel reads them instead of the conv's q, k, v.
constexpr int kConvK = 4;  // taps (gdn_conv_fused_supported)

// What the fused conv reads and writes; x == nullptr: the kernel reads q, k, v as given.
struct ConvView {
  const bf16* x;      // [T][channels] raw rows: channels [0, H_k 128) q, [H_k 128, 2 H_k 128) k, then v
  const bf16* w;      // [channels][kConvK]
  const bf16* state;  // [num_seqs][kConvK - 1][channels]: the inputs before each sequence's start, or nullptr (zeros)
  const int* start;   // [num_seqs]: the first token of each sequence's conv input
  bf16* q_out;        // [T][H_k][128]: the conv's q (by the blocks of each key head's first value head), or null
  bf16* k_out;        // [T][H_k][128]: the conv's k (by the same blocks)
  int channels;
  bool fast;          // SiLU by conv_silu_fast, as conv1d_silu_prefill's 4-channel kernel (HYPIC_CONV_NARROW)
};

// The conv's input at token t for channels c .. c + 7 of sequence seq (whose input begins at token start >= t - 3):
// x's row from start on, the sequence's history before it (zeros without a state).
__device__ __forceinline__ uint4 conv_input(const ConvView& cv, int seq, int start, int t, int c) {
  if (t >= start) return __ldg(reinterpret_cast<const uint4*>(cv.x + size_t(t) * cv.channels + c));
  if (cv.state)
    return __ldg(reinterpret_cast<const uint4*>(
        cv.state + (size_t(seq) * (kConvK - 1) + (kConvK - 1 + t - start)) * cv.channels + c));
  return make_uint4(0, 0, 0, 0);
}

// The conv's output for the 64 rows of a chunk (tokens t0 .. t0 + len - 1 of sequence seq; rows >= len zero) and the
// 128 channels c0 .. c0 + 127, by 128 threads: thread t the 16-byte piece t % 16 of the 8 consecutive rows
// 8 (t / 16) .. + 7, all 11 input rows loaded before the first product; emit(r, piece, row) takes each output row as it
// is done (every lane of the warp calls it for the same i: emit may shuffle within the 16 lanes of a row). Each element
// as conv_prefill_kernel computes it: a = 0, a = fma(w_j, in_j, a) over the taps in order (the last on the token's own
// input), then SiLU (conv_silu_fast where cv.fast, else conv_silu) and one rounding to bf16: the same bits.
template <class Emit>
__device__ __forceinline__ void conv_rows(const ConvView& cv, int c0, int seq, int start, int t0, int len, int tid,
                                          Emit&& emit) {
  constexpr int kIn = 8 + kConvK - 1;
  const int r0 = (tid >> 4) * 8, piece = tid & 15, c = c0 + piece * 8;
  uint4 in[kIn];
#pragma unroll
  for (int i = 0; i < kIn; ++i) {
    const int j = r0 - (kConvK - 1) + i;  // the input row, chunk-relative (negative: before the chunk)
    in[i] = j < len ? conv_input(cv, seq, start, t0 + j, c) : make_uint4(0, 0, 0, 0);
  }
  uint4 wraw[kConvK];  // the 8 channels' taps, [channel][tap] bf16: kConvK 16-byte pieces
#pragma unroll
  for (int i = 0; i < kConvK; ++i) wraw[i] = __ldg(reinterpret_cast<const uint4*>(cv.w + size_t(c) * kConvK) + i);
  const bf16* wv = reinterpret_cast<const bf16*>(wraw);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint4 o = make_uint4(0, 0, 0, 0);
    if (r0 + i < len) {
      __nv_bfloat162* op = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int e2 = 0; e2 < 4; ++e2) {
        float y[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int e = 2 * e2 + h;
          float a = 0.f;
#pragma unroll
          for (int j = 0; j < kConvK; ++j)
            a = fmaf(__bfloat162float(wv[e * kConvK + j]),
                     __bfloat162float(reinterpret_cast<const bf16*>(&in[i + j])[e]), a);
          y[h] = cv.fast ? conv_silu_fast(a) : conv_silu(a);
        }
        op[e2] = __floats2bfloat162_rn(y[0], y[1]);
      }
    }
    emit(r0 + i, piece, o);
  }
}

// Copies a [64][LD] bf16 tile (kSw: the swizzled [64][128] tile of sw_off) to a dense [64][128] global block
// (16-byte stores).
template <bool kSw = false>
__device__ __forceinline__ void store_tile(bf16* dst, const bf16* s, int tid) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int p = tid + i * kWyThreads, row = p >> 4, col = (p & 15) * 8;
    const unsigned char* src = kSw ? reinterpret_cast<const unsigned char*>(s) + sw_off(row, col / 8)
                                   : reinterpret_cast<const unsigned char*>(s + row * LD + col);
    *reinterpret_cast<uint4*>(dst + row * D + col) = *reinterpret_cast<const uint4*>(src);
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
// kWgmma: the four products on warpgroup MMAs (the block's four warps are one warpgroup; all k-steps and column tiles
// computed, the causal masks applied in the epilogues as before and X's zeros above the diagonal exact, so finite
// inputs give the sums of the mma.sync path in another order; a non-finite k or v row j also reaches the W / U rows
// before j in the chunk through 0 x Inf, where the mma.sync path skips those k-steps: the chunk's state is NaN either
// way), with K, Q,
// V, Xb and Xbg in the 128-byte-swizzled layout of sw_off: sK (16 KiB) at 0, region R at 16 KiB (sQ, then A / X
// fp32 [64][68], then V, then the U^T stage [128][68]), sXb and sXbg [64][64] (8 KiB each), the fp32 vectors;
// + 1024 bytes to align the base.
constexpr int kWySmemWg = kSwTile + kRegion + 2 * kSwTileP + 4 * C * 4 + 1024;
static_assert(kWySmemWg <= 56 * 1024 && (kSwTile + kRegion) % 1024 == 0, "wgmma WY shared memory");

// acc (64 x 64, accumulator layout: warp w rows 16 w ..) = X Y^T over the 128 columns of two swizzled [64][128] bf16
// tiles (eight m64n64k16, both operands K-major from shared memory). Waits for the products.
__device__ __forceinline__ void gram_wgmma(float (&acc)[8][4], const bf16* sX, const bf16* sY) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint32_t xa = smem_addr(sX), ya = smem_addr(sY);
  sm90::wgmma_batch(acc, [&] {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk >> 2) * (C * 128) + (kk & 3) * 32;
      sm90::wgmma_m64n64k16_ss(acc, sm90::sw128_desc(xa + off, 16, 1024), sm90::sw128_desc(ya + off, 16, 1024), 1);
    }
  });
#else
  __trap();  // built for sm_90a only (gdn_wgmma.cu)
#endif
}

// acc (64 x 128) = X B for a swizzled [64][64] bf16 X (K-major) and a swizzled [64 k][128] bf16 B read MN-major (four
// m64n128k16 with trans-b). Waits for the products.
__device__ __forceinline__ void xb_wgmma(float (&acc)[16][4], const bf16* sX, const bf16* sB) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint32_t xa = smem_addr(sX), ba = smem_addr(sB);
  sm90::wgmma_batch(acc, [&] {
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk)
      sm90::wgmma_m64n128k16_ss_tb(acc, sm90::sw128_desc(xa + kk * 32, 16, 1024),
                                   sm90::sw128_desc(ba + kk * 16 * 128, C * 128, 1024), 1);
  });
#else
  __trap();  // built for sm_90a only (gdn_wgmma.cu)
#endif
}

// Element (row, col) of a [64][LDP] bf16 tile, or (kSw) of a swizzled [64][64] one.
template <bool kSw>
__device__ __forceinline__ bf16* tile64_at(bf16* s, int row, int col) {
  if constexpr (kSw)
    return reinterpret_cast<bf16*>(reinterpret_cast<unsigned char*>(s) + sw_off(row, col >> 3) + (col & 7) * 2);
  else
    return s + row * LDP + col;
}

// Blocks per SM the WY kernel is compiled for (__launch_bounds__' second argument): without the conv none (0: the
// compiler's own choice, 120 registers on wgmma, 96 on mma.sync, four blocks per SM by shared memory); with it four
// on wgmma (127 registers, no spills; unbounded it took 130, three blocks) and three on mma.sync (four spilled).
template <bool kWgmma, bool kConv>
constexpr int wy_min_blocks() {
  return kConv ? (kWgmma ? 4 : 3) : 0;
}

// kConv: q, k, v from the conv fused in (cv; section 0) instead of the q, k, v pointers (q then only says whether
// outputs are requested: P and the q factors are computed where it is non-null).
template <bool kWgmma, bool kConv = false>
__global__ void __launch_bounds__(kWyThreads, (wy_min_blocks<kWgmma, kConv>()))
    gdn_wy_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                  const float* __restrict__ g, const float* __restrict__ beta, GateInputs gates, int Hk, int Hv,
                  bool l2norm, float scale, WsView ws, ConvView cv) {
  extern __shared__ __align__(16) unsigned char smem_raw[];  // (kWgmma aligns its base to 1024 below)
  unsigned char* smem = smem_raw;
  if constexpr (kWgmma) smem += (1024u - (smem_addr(smem_raw) & 1023u)) & 1023u;
  bf16* sK = reinterpret_cast<bf16*>(smem);
  unsigned char* region = kWgmma ? smem + kSwTile : reinterpret_cast<unsigned char*>(sK + C * LD);
  bf16* sQ = reinterpret_cast<bf16*>(region);
  float* sA = reinterpret_cast<float*>(region);
  bf16* sV = reinterpret_cast<bf16*>(region);
  bf16* sStage = sK;  // W and U^T stages, once K is no longer read (kWgmma: the U^T stage in region R)
  bf16* sXb = reinterpret_cast<bf16*>(region + kRegion);  // [64][72] (kWgmma: swizzled [64][64])
  bf16* sXbg = kWgmma ? reinterpret_cast<bf16*>(region + kRegion + kSwTileP) : sXb + C * LDP;
  float* sG = kWgmma ? reinterpret_cast<float*>(region + kRegion + 2 * kSwTileP)
                     : reinterpret_cast<float*>(sXbg + C * LDP);
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

  if constexpr (kConv) {
    // The conv's k (and q) rows; the blocks of each key head's first value head store them for the scan.
    const int start = cv.start[ci.seq];
    const bool writer = h % (Hv / Hk) == 0;
    const size_t row0 = (size_t(ci.t0) * Hk + kh) * D, stride = size_t(Hk) * D;
    conv_rows(cv, Hk * D + kh * D, ci.seq, start, ci.t0, ci.len, tid, [&](int r, int piece, uint4 o) {
      if (writer && r < ci.len) *reinterpret_cast<uint4*>(cv.k_out + row0 + r * stride + piece * 8) = o;
      finish_row<kWgmma>(sK, o, l2norm, 1.f, r, piece, sFk);
    });
    if (q) {
      conv_rows(cv, kh * D, ci.seq, start, ci.t0, ci.len, tid, [&](int r, int piece, uint4 o) {
        if (writer && r < ci.len) *reinterpret_cast<uint4*>(cv.q_out + row0 + r * stride + piece * 8) = o;
        finish_row<kWgmma>(sQ, o, l2norm, scale, r, piece, sFq);
      });
    } else if (tid < C) {
      sFq[tid] = 0.f;
    }
  } else {
    uint4 rk[8], rq[8];  // both tiles in flight before the first use
    load_raw(rk, k + (size_t(ci.t0) * Hk + kh) * D, size_t(Hk) * D, ci.len, tid);
    load_raw(rq, q ? q + (size_t(ci.t0) * Hk + kh) * D : k, size_t(Hk) * D, q ? ci.len : 0, tid);
    finish_rows<kWgmma>(sK, rk, l2norm, 1.f, tid, sFk);
    if (q) finish_rows<kWgmma>(sQ, rq, l2norm, scale, tid, sFq);
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
  if constexpr (kWgmma) sm90::fence_proxy_async();  // sK, sQ written by the generic proxy, read next by wgmma
  __syncthreads();

  // P = (Q K^T) masked causally (j <= i) and decayed by e^{G_i - G_j}, straight to the workspace
  // (zeros above the diagonal: the scan reads whole 16 x 16 diagonal blocks). Skipped without q
  // (no outputs requested).
  if (q) {
    float acc[8][4] = {};
    if constexpr (kWgmma)
      gram_wgmma(acc, sQ, sK);
    else
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
      *reinterpret_cast<uint32_t*>(tile64_at<kWgmma>(sP, i0, j)) = pack_bf16(p00, p01);
      *reinterpret_cast<uint32_t*>(tile64_at<kWgmma>(sP, i1, j)) = pack_bf16(p10, p11);
    }
  }
  __syncthreads();  // region R (sQ) is reused for A below
  if (q) {
    bf16* P = ws.P + slot * kPElems;
#pragma unroll
    for (int i = 0; i < C * C / 8 / kWyThreads; ++i) {
      const int p = tid + i * kWyThreads, row = p >> 3, col = (p & 7) * 8;
      *reinterpret_cast<uint4*>(P + row * C + col) = *reinterpret_cast<const uint4*>(tile64_at<kWgmma>(sXbg, row, col));
    }
  }

  // A = K K^T (strictly lower part), scaled by b_i e^{G_i - G_j}.
  {
    float acc[8][4] = {};
    if constexpr (kWgmma)
      gram_wgmma(acc, sK, sK);
    else
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
      *tile64_at<kWgmma>(sXb, i, cidx) = __float2bfloat16_rn(xv * bc);
      *tile64_at<kWgmma>(sXbg, i, cidx) = __float2bfloat16_rn(xv * bgc);
    }
  }
  if constexpr (kWgmma) sm90::fence_proxy_async();  // sXb, sXbg read next by wgmma
  __syncthreads();

  // V into region R (X is in sXb / sXbg now), in flight while W = Xbg K is computed and stored (kConv: the conv's v
  // rows computed and stored here, before W).
  if constexpr (kConv) {
    conv_rows(cv, 2 * Hk * D + h * D, ci.seq, cv.start[ci.seq], ci.t0, ci.len, tid, [&](int r, int piece, uint4 o) {
      if constexpr (kWgmma)
        *reinterpret_cast<uint4*>(region + sw_off(r, piece)) = o;
      else
        *reinterpret_cast<uint4*>(sV + r * LD + piece * 8) = o;
    });
  } else {
    if constexpr (kWgmma)
      cp_async_rows_sw<D / 8>(region, v + (size_t(ci.t0) * Hv + h) * D, size_t(Hv) * D, ci.len, tid, kWyThreads);
    else
      cp_async_rows(sV, v + (size_t(ci.t0) * Hv + h) * D, size_t(Hv) * D, ci.len, tid, kWyThreads);
    cp_async_commit();
  }
  // W = Xbg K and U = Xb V (X is lower triangular: k-steps past the warp's rows are zero).
  {
    float acc[16][4] = {};
    if constexpr (kWgmma)
      xb_wgmma(acc, sXbg, sK);
    else
      mma_rows16<C / 16, 8>(acc, sXbg, LDP, 16 * warp, sK, LD, 0, lane, warp + 1);
    __syncthreads();  // every warp is done with K: its tile becomes the W stage
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      if constexpr (kWgmma) {
        unsigned char* st = reinterpret_cast<unsigned char*>(sStage);
        *reinterpret_cast<uint32_t*>(st + sw_off(16 * warp + gi, n) + cc * 2) = pack_bf16(acc[n][0], acc[n][1]);
        *reinterpret_cast<uint32_t*>(st + sw_off(16 * warp + gi + 8, n) + cc * 2) = pack_bf16(acc[n][2], acc[n][3]);
      } else {
        *reinterpret_cast<uint32_t*>(sStage + (16 * warp + gi) * LD + n * 8 + cc) = pack_bf16(acc[n][0], acc[n][1]);
        *reinterpret_cast<uint32_t*>(sStage + (16 * warp + gi + 8) * LD + n * 8 + cc) =
            pack_bf16(acc[n][2], acc[n][3]);
      }
    }
    if constexpr (!kConv) cp_async_wait<0>();
    if constexpr (kWgmma) sm90::fence_proxy_async();  // V (cp.async, or the conv's stores) read next by wgmma
    __syncthreads();  // W staged, V landed
    store_tile<kWgmma>(ws.W + slot * kWElems, sStage, tid);
  }
  {
    float acc[16][4] = {};
    if constexpr (kWgmma)
      xb_wgmma(acc, sXb, sV);
    else
      mma_rows16<C / 16, 8>(acc, sXb, LDP, 16 * warp, sV, LD, 0, lane, warp + 1);
    __syncthreads();  // the W stage is stored: it becomes the U^T stage (kWgmma: V is read: region R does)
    bf16* sUT = kWgmma ? sV : sStage;  // [128][68]: U^T, row = value column
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
    for (int i = 0; i < D * C / 4 / kWyThreads; ++i) {  // 8-byte pieces
      const int p = tid + i * kWyThreads, row = p >> 4, c4 = (p & 15) * 4;
      *reinterpret_cast<uint2*>(UT + row * C + c4) = *reinterpret_cast<const uint2*>(sUT + row * 68 + c4);
    }
  }
}

/// Launches gdn_wy_kernel<true> (the products on wgmma; with the conv fused in where cv.x is set) on `blocks` blocks
/// (chunks x value heads) of kWyThreads with kWySmemWg bytes of dynamic shared memory, the attribute set once per
/// device; the arguments as gdn_wy_kernel's.
/// Defined in gdn_wgmma.cu, built for sm_90a only (HYPIC_GDN_WGMMA_BUILT): call it on compute capability 9.0 devices
/// only. Throws std::runtime_error on a CUDA error.
void launch_wy_wgmma(unsigned blocks, const bf16* q, const bf16* k, const bf16* v, const float* g, const float* beta,
                     const GateInputs& gates, int Hk, int Hv, bool l2norm, float scale, const WsView& ws,
                     const ConvView& cv, cudaStream_t stream);

}  // namespace hypic::kernels::cuda::detail::gdn
