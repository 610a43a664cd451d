// Lightning attention on the GPU: chunked prefill with T_C, decode step, scalar composition, key-axis rotation.
// Contracts: lightning.h; math and the test oracle: kernels/cpu/lightning.h.
#include "kernels/cuda/lightning.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/state_tile.cuh"

namespace hypic::kernels::cuda {
namespace {

using namespace detail;

constexpr int C = kLightningChunk;  // tokens per chunk
constexpr int BV = 64;              // value (state) columns per block
constexpr int kThreads = 128;       // four warps
constexpr int LDV = BV + 8;         // padded row of the V, decay-scaled V and state tiles (bf16 elements)

// e^x with results below the smallest normal float flushed to 0 (kernels/cpu scan_util exp_normal).
__device__ __forceinline__ float exp_normal(float x) {
  const float e = expf(x);
  return e < FLT_MIN ? 0.0f : e;
}
__device__ __forceinline__ float flush(float x) { return fabsf(x) < FLT_MIN ? 0.0f : x; }

// Shared-memory layout of the chunk kernel for head size D: two stages of the chunk's Q, K and V tiles (the next
// chunk loads while this one computes), the running state's columns in bf16, then the decay table.
template <int D>
struct Layout {
  static constexpr int LDK = D + 8;                  // padded row of the Q and K tiles
  static constexpr int kStage = 2 * C * LDK + C * LDV;  // one stage: Q [C][LDK], K [C][LDK], V [C][LDV]
  static constexpr int kQ = 0, kK = C * LDK, kV = 2 * C * LDK;  // offsets within a stage
  static constexpr int kS = 2 * kStage;              // [D][LDV] the running state's columns, bf16
  static constexpr int kElems = kS + D * LDV;
  static constexpr size_t kDecBytes = (C + 1 + 3) / 4 * 16;  // dec[m] = e^{-s m}, m = 0..C
  static constexpr size_t kBytes = size_t(kElems) * 2 + kDecBytes;
  static constexpr int MT = D / 64;                  // 16-row tiles of the state per warp (a warp owns D / 4 rows)
};

// x (two bf16) scaled by (f0, f1), rounded to bf16.
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t x, float f0, float f1) {
  const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&x);
  return pack_bf16(__low2float(v) * f0, __high2float(v) * f1);
}

struct ChunkParams {
  const int* cu;
  int H;
  int parts;  // P: blockIdx.x = seq * P + part
  int cpp;    // chunks per part
  const bf16 *q, *k, *v;
  const float* slope;
  const float* init;   // [seqs][H][D][D] or nullptr (unsplit full pass)
  float* final_state;  // [seqs][H][D][D] or nullptr
  float* transition;   // [seqs][H] or nullptr
  bf16* out;           // [T][H][D] or nullptr
  float* parts_buf;    // [seqs][P][H][D][D]: slot p = initial state of part p (split scans)
};

// Chunk range of block (seq, part); returns false when the block has nothing to do.
struct PartRange {
  int start, len, nch, np, c_begin, c_end;
};
__device__ __forceinline__ PartRange part_range(const ChunkParams& p, int seq, int part) {
  PartRange r;
  r.start = p.cu[seq];
  r.len = p.cu[seq + 1] - r.start;
  r.nch = static_cast<int>((long(r.len) + C - 1) / C);
  r.np = min(p.parts, max(1, (r.nch + p.cpp - 1) / p.cpp));
  r.c_begin = part * p.cpp;
  // The last part takes every remaining chunk, so that a sequence longer than max_seqlen promised is still scanned
  // whole (only slower).
  r.c_end = part == r.np - 1 ? r.nch : min(r.nch, r.c_begin + p.cpp);
  return r;
}

// One block per (sequence part, head, 64 state columns); kFull: outputs, final state and T_C from the part's true
// initial state; otherwise (first pass of a split scan) the zero-start state of each part that has a successor,
// written to parts_buf slot part + 1.
// Per chunk of n tokens (rows i, j < n; dec[m] = e^{-s m}):
//   o_i = dec[i + 1] q_i^T S + sum_{j <= i} dec[i - j] (q_i . k_j) v_j
//   S  <- dec[n] S + (diag(dec[n - 1 - j]) K)^T V
// Warp w computes output rows 16w .. 16w + 15 and owns state rows w D/4 .. (w + 1) D/4 - 1 (fp32 accumulators).
template <int D, bool kFull>
__global__ void __launch_bounds__(kThreads) lightning_chunk_kernel(ChunkParams p) {
  using L = Layout<D>;
  constexpr int LDK = L::LDK, MT = L::MT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sm = reinterpret_cast<bf16*>(smem_raw);
  bf16* ss = sm + L::kS;
  float* dec = reinterpret_cast<float*>(smem_raw + size_t(L::kElems) * 2);

  const int seq = blockIdx.x / p.parts, part = blockIdx.x % p.parts, h = blockIdx.y, v0 = blockIdx.z * BV;
  const PartRange r = part_range(p, seq, part);
  if (part >= r.np) return;
  if (!kFull && part >= r.np - 1) return;
  const int H = p.H, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, cq = (lane & 3) * 2;
  const float s = p.slope[h];
  if (tid <= C) dec[tid] = exp_normal(-s * static_cast<float>(tid));

  const size_t ld_tok = size_t(H) * D;  // elements between tokens of q, k, v, out
  // Stages chunk c into stage buffer st: rows >= n are zero (they add nothing to the state; their outputs are not
  // stored).
  auto stage_chunk = [&](int c, int st) {
    bf16* sq = sm + st * L::kStage + L::kQ;
    bf16* sk = sm + st * L::kStage + L::kK;
    bf16* sv = sm + st * L::kStage + L::kV;
    const int t0 = r.start + c * C, n = min(C, r.len - c * C);
    constexpr int kPieces = D / 8;
    for (int idx = tid; idx < C * kPieces; idx += kThreads) {
      const int row = idx / kPieces, pc = (idx % kPieces) * 8;
      const size_t src = (size_t(t0) + row) * ld_tok + size_t(h) * D + pc;
      if (row < n) {
        if (kFull) cp_async16(sq + row * LDK + pc, p.q + src);
        cp_async16(sk + row * LDK + pc, p.k + src);
      } else {
        if (kFull) *reinterpret_cast<uint4*>(sq + row * LDK + pc) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(sk + row * LDK + pc) = make_uint4(0, 0, 0, 0);
      }
    }
    for (int idx = tid; idx < C * (BV / 8); idx += kThreads) {
      const int row = idx / (BV / 8), pc = (idx % (BV / 8)) * 8;
      if (row < n)
        cp_async16(sv + row * LDV + pc, p.v + (size_t(t0) + row) * ld_tok + size_t(h) * D + v0 + pc);
      else
        *reinterpret_cast<uint4*>(sv + row * LDV + pc) = make_uint4(0, 0, 0, 0);
    }
    cp_async_commit();
  };
  if (r.c_begin < r.c_end) stage_chunk(r.c_begin, 0);

  const size_t hd = size_t(D) * D;
  const float* init = nullptr;
  if (kFull) {
    if (p.parts > 1)
      init = p.parts_buf + ((size_t(seq) * p.parts + part) * H + h) * hd;
    else if (p.init)
      init = p.init + (size_t(seq) * H + h) * hd;
  }
  const int rb = warp * (D / 4);
  float sacc[MT][8][4];
  state_tile_load<MT>(sacc, init, D, rb, v0, lane);
  if (kFull) state_tile_to_smem<MT>(sacc, ss, LDV, rb, lane);

  for (int c = r.c_begin; c < r.c_end; ++c) {
    const int st = (c - r.c_begin) & 1;
    const int t0 = r.start + c * C, n = min(C, r.len - c * C);
    if (c + 1 < r.c_end) {
      stage_chunk(c + 1, st ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // chunk c staged (and, on the first pass, dec and the bf16 state written)
    const bf16* sq = sm + st * L::kStage + L::kQ;
    const bf16* sk = sm + st * L::kStage + L::kK;
    const bf16* sv = sm + st * L::kStage + L::kV;

    if (kFull) {
      const int r0 = 16 * warp + g, r1 = r0 + 8;
      // Inter-chunk term Q S (scaled per row by dec[i + 1] below) and the scores Q K^T (only key tiles at or left
      // of the diagonal), sharing the Q fragments.
      float o[8][4], sc[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nt][e] = sc[nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[4];
        load_a(a, sq, LDK, 16 * warp, 16 * ks, lane);
#pragma unroll
        for (int nt2 = 0; nt2 < 4; ++nt2) {
          uint32_t b[4];
          load_b_kn(b, ss, LDV, 16 * ks, 16 * nt2, lane);
          mma_bf16(o[2 * nt2], a, b[0], b[1]);
          mma_bf16(o[2 * nt2 + 1], a, b[2], b[3]);
          if (nt2 > warp) continue;
          load_b_nk(b, sk, LDK, 16 * ks, 16 * nt2, lane);
          mma_bf16(sc[2 * nt2], a, b[0], b[1]);
          mma_bf16(sc[2 * nt2 + 1], a, b[2], b[3]);
        }
      }
      const float f0 = dec[r0 + 1], f1 = dec[r1 + 1];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) o[nt][0] *= f0, o[nt][1] *= f0, o[nt][2] *= f1, o[nt][3] *= f1;
      // Decay and causal mask of the scores.
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int j = 8 * nt + cq;
        sc[nt][0] = j <= r0 ? sc[nt][0] * dec[r0 - j] : 0.f;
        sc[nt][1] = j + 1 <= r0 ? sc[nt][1] * dec[r0 - j - 1] : 0.f;
        sc[nt][2] = j <= r1 ? sc[nt][2] * dec[r1 - j] : 0.f;
        sc[nt][3] = j + 1 <= r1 ? sc[nt][3] * dec[r1 - j - 1] : 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if (kk > warp) continue;
        uint32_t a[4];
        a[0] = pack_bf16(sc[2 * kk][0], sc[2 * kk][1]);
        a[1] = pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
        a[2] = pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        a[3] = pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
        for (int nt2 = 0; nt2 < 4; ++nt2) {
          uint32_t b[4];
          load_b_kn(b, sv, LDV, 16 * kk, 16 * nt2, lane);
          mma_bf16(o[2 * nt2], a, b[0], b[1]);
          mma_bf16(o[2 * nt2 + 1], a, b[2], b[3]);
        }
      }
      if (p.out) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const size_t col = size_t(h) * D + v0 + 8 * nt + cq;
          if (r0 < n)
            *reinterpret_cast<uint32_t*>(p.out + (size_t(t0) + r0) * ld_tok + col) = pack_bf16(o[nt][0], o[nt][1]);
          if (r1 < n)
            *reinterpret_cast<uint32_t*>(p.out + (size_t(t0) + r1) * ld_tok + col) = pack_bf16(o[nt][2], o[nt][3]);
        }
      }
    }

    // State update: S <- dec[n] S + (diag(dec[n - 1 - j]) K)^T V, the decay applied to the K^T fragments.
    const float bd = dec[n];
    state_tile_scale_rows<MT>(sacc, rb, lane, [bd](int) { return bd; });
    state_tile_rank_update<MT>(sacc, sk, LDK, sv, LDV, rb, lane, [&](int j0, int j1, uint32_t(&a)[4]) {
      // a holds keys j0, j0 + 1 and j1, j1 + 1 (mma.cuh A layout).
      const float d0 = j0 < n ? dec[n - 1 - j0] : 0.f, d1 = j0 + 1 < n ? dec[n - 2 - j0] : 0.f;
      const float d2 = j1 < n ? dec[n - 1 - j1] : 0.f, d3 = j1 + 1 < n ? dec[n - 2 - j1] : 0.f;
      a[0] = scale_bf16x2(a[0], d0, d1);
      a[1] = scale_bf16x2(a[1], d0, d1);
      a[2] = scale_bf16x2(a[2], d2, d3);
      a[3] = scale_bf16x2(a[3], d2, d3);
    });
    state_tile_flush<MT>(sacc);
    __syncthreads();  // every warp is done with this chunk's stage and the bf16 state
    if (kFull && c + 1 < r.c_end) state_tile_to_smem<MT>(sacc, ss, LDV, rb, lane);
  }
  cp_async_wait<0>();

  float* dst = nullptr;
  if (!kFull)
    dst = p.parts_buf + ((size_t(seq) * p.parts + part + 1) * H + h) * hd;
  else if (part == r.np - 1 && p.final_state)
    dst = p.final_state + (size_t(seq) * H + h) * hd;
  if (dst) state_tile_store<MT>(sacc, dst, D, rb, v0, lane);
  if (kFull && p.transition && part == r.np - 1 && blockIdx.z == 0 && tid == 0) {
    float t = 1.0f;
    for (int c = 0; c < r.nch; ++c) t = flush(t * exp_normal(-s * static_cast<float>(min(C, r.len - c * C))));
    p.transition[size_t(seq) * H + h] = t;
  }
}

// Split scans: slot 0 <- the sequence's initial state; slot p + 1 (holding part p's zero-start state) <-
// e^{-s 64 cpp} slot p + slot p + 1, for the parts that have a successor. Grid (seqs, H, D D / 1024), 256 threads,
// four values each.
template <int D>
__global__ void __launch_bounds__(256) lightning_part_fold_kernel(ChunkParams p) {
  const int seq = blockIdx.x, h = blockIdx.y;
  const PartRange r = part_range(p, seq, 0);
  const float s = p.slope[h];
  const float e64 = exp_normal(-s * static_cast<float>(C));
  float dp = 1.0f;
  for (int i = 0; i < p.cpp; ++i) dp = flush(dp * e64);
  const size_t hd = size_t(D) * D, i4 = (size_t(blockIdx.z) * 256 + threadIdx.x) * 4;
  auto slot = [&](int q) { return reinterpret_cast<float4*>(p.parts_buf + ((size_t(seq) * p.parts + q) * p.H + h) * hd + i4); };
  float4 run = make_float4(0.f, 0.f, 0.f, 0.f);
  if (p.init) run = *reinterpret_cast<const float4*>(p.init + (size_t(seq) * p.H + h) * hd + i4);
  *slot(0) = run;
  for (int q = 0; q + 1 < r.np; ++q) {
    const float4 z = *slot(q + 1);
    run.x = flush(fmaf(dp, run.x, z.x));
    run.y = flush(fmaf(dp, run.y, z.y));
    run.z = flush(fmaf(dp, run.z, z.z));
    run.w = flush(fmaf(dp, run.w, z.w));
    *slot(q + 1) = run;
  }
}

// Decode: grid (batch, H, D / 64), block (64 columns, 4 row groups); thread (x, y) updates column x of rows
// y D/4 .. (y + 1) D/4 - 1 and the four row groups' partial o are added in a fixed order.
template <int D>
__global__ void __launch_bounds__(256) lightning_decode_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                               const bf16* __restrict__ v,
                                                               const float* __restrict__ slope, int H,
                                                               float* __restrict__ state, bf16* __restrict__ out,
                                                               const int* __restrict__ slots) {
  __shared__ float sq[D], sk[D], part[4][64];
  const int b = blockIdx.x, h = blockIdx.y, x = threadIdx.x, y = threadIdx.y, tid = y * 64 + x;
  const int e = blockIdx.z * 64 + x;
  const size_t bh = size_t(b) * H + h;
  if (tid < D) {
    sq[tid] = __bfloat162float(q[bh * D + tid]);
    sk[tid] = __bfloat162float(k[bh * D + tid]);
  }
  const float ve = __bfloat162float(v[bh * D + e]);
  const float a = exp_normal(-slope[h]);
  float* S = state + (slots ? size_t(slots[b]) * H + h : bh) * size_t(D) * D + e;
  __syncthreads();
  constexpr int R = D / 4;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int row = y * R + i;
    const float s = flush(a * S[size_t(row) * D] + sk[row] * ve);
    S[size_t(row) * D] = s;
    acc = fmaf(s, sq[row], acc);
  }
  part[y][x] = acc;
  __syncthreads();
  if (y == 0 && out) out[bh * D + e] = __float2bfloat16(((part[0][x] + part[1][x]) + part[2][x]) + part[3][x]);
}

__global__ void scalar_compose_kernel(int batch, int dim4, int segs, float4* __restrict__ running,
                                      const float* __restrict__ T, const float4* __restrict__ S) {
  const size_t n = size_t(batch) * dim4;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const int b = static_cast<int>(i / dim4);
    float4 r = running[i];
    for (int sgi = 0; sgi < segs; ++sgi) {
      const float t = T[size_t(sgi) * batch + b];
      const float4 s = S ? S[size_t(sgi) * n + i] : make_float4(0.f, 0.f, 0.f, 0.f);
      r.x = fmaf(t, r.x, s.x), r.y = fmaf(t, r.y, s.y), r.z = fmaf(t, r.z, s.z), r.w = fmaf(t, r.w, s.w);
    }
    running[i] = r;
  }
}

__global__ void rope_key_axis_kernel(int d_k, int d_v, int half, const float* __restrict__ inv_freq, float position,
                                     float* __restrict__ state) {
  const int hh = blockIdx.x, i = blockIdx.y;
  const float f = position * inv_freq[i];
  const float cs = cosf(f), sn = sinf(f);
  float* ra = state + (size_t(hh) * d_k + i) * d_v;
  float* rb = ra + size_t(half) * d_v;
  for (int j = threadIdx.x; j < d_v; j += blockDim.x) {
    const float a = ra[j], b = rb[j];
    ra[j] = a * cs - b * sn;
    rb[j] = b * cs + a * sn;
  }
}

// lightning_qkv_prepare: block of 8 warps per token; warp w takes rows (part, head) = w, w + 8, ... of the 3 H rows.
// Lane l holds dims l E .. l E + E - 1 (E = d / 32); RoPE partners are exchanged through the warp's row in shared
// memory.
template <int D>
__global__ void __launch_bounds__(256) lightning_qkv_kernel(LightningQkvArgs a) {
  constexpr int E = D / 32;
  __shared__ float row_buf[8][D];
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, H = a.num_heads;
  float* buf = row_buf[warp];
  const float pos = a.inv_freq ? static_cast<float>(a.positions[t]) : 0.f;
  for (int r = warp; r < 3 * H; r += 8) {
    const int part = r / H, h = r % H;
    const bf16* src = a.qkv + (size_t(t) * 3 * H + r) * D + lane * E;
    float x[E];
#pragma unroll
    for (int e = 0; e < E; e += 2) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + e));
      x[e] = f.x, x[e + 1] = f.y;
    }
    if (a.silu)
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = x[e] / (1.f + expf(-x[e]));
    const bf16* nw = part == 0 ? a.q_norm : part == 1 ? a.k_norm : nullptr;
    if (nw) {
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) ss += x[e] * x[e];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      const float inv = 1.0f / sqrtf(ss / D + a.eps);
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = __bfloat162float(nw[lane * E + e]) * (x[e] * inv);
    }
    if (a.inv_freq && part < 2) {
      const int half = a.rope_half;
#pragma unroll
      for (int e = 0; e < E; ++e) buf[lane * E + e] = x[e];
      __syncwarp();
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int i = lane * E + e;
        if (i >= 2 * half) continue;
        const int j = i < half ? i : i - half;
        const float f = pos * a.inv_freq[j];
        const float cs = cosf(f), sn = sinf(f);
        x[e] = i < half ? x[e] * cs - buf[i + half] * sn : x[e] * cs + buf[i - half] * sn;
      }
      __syncwarp();
    }
    if (part == 0)
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] *= a.scale;
    bf16* dst = (part == 0 ? a.q : part == 1 ? a.k : a.v) + (size_t(t) * H + h) * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; e += 2)
      *reinterpret_cast<__nv_bfloat162*>(dst + e) = __floats2bfloat162_rn(x[e], x[e + 1]);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Shape checks (all the queries need).
void check_shape(const LightningPrefillArgs& a) {
  const std::string f = "lightning_prefill: ";
  if (!lightning_head_dim_supported(a.head_dim))
    throw std::invalid_argument(f + "head_dim " + std::to_string(a.head_dim) + " is not supported (64 or 128)");
  if (a.num_seqs < 0) throw std::invalid_argument(f + "num_seqs " + std::to_string(a.num_seqs) + " < 0");
  if (a.num_heads <= 0 || a.num_heads > 65535)
    throw std::invalid_argument(f + "num_heads " + std::to_string(a.num_heads) + " outside [1, 65535]");
  if (a.max_seqlen < 0) throw std::invalid_argument(f + "max_seqlen " + std::to_string(a.max_seqlen) + " < 0");
  if (a.seq_parts < 0) throw std::invalid_argument(f + "seq_parts " + std::to_string(a.seq_parts) + " < 0");
}

// Pointer checks of a launch.
void check_pointers(const LightningPrefillArgs& a) {
  const std::string f = "lightning_prefill: ";
  if (a.num_seqs > 0 && (!a.cu_seqlens || !a.slope))
    throw std::invalid_argument(f + "cu_seqlens or slope is null");
  if (a.num_seqs > 0 && (!a.q || !a.k || !a.v)) throw std::invalid_argument(f + "q, k or v is null");
  for (const void* ptr : {static_cast<const void*>(a.q), static_cast<const void*>(a.k),
                          static_cast<const void*>(a.v), static_cast<const void*>(a.out),
                          static_cast<const void*>(a.initial_state), static_cast<const void*>(a.final_state)})
    if (!aligned16(ptr)) throw std::invalid_argument(f + "q, k, v, out and the states must be 16-byte aligned");
}

template <int D>
int chunk_blocks_per_sm() {
  static DeviceOnce once;
  return once.run(current_device(), [](int) {
    auto kernel = lightning_chunk_kernel<D, true>;
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Layout<D>::kBytes)),
               "lightning_prefill: shared memory attribute");
    check_cuda(cudaFuncSetAttribute(lightning_chunk_kernel<D, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(Layout<D>::kBytes)),
               "lightning_prefill: shared memory attribute");
    int blocks = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, Layout<D>::kBytes),
               "lightning_prefill: occupancy");
    return std::max(blocks, 1);
  });
}

// (parts, chunks per part) of a call.
std::pair<int, int> scan_split(const LightningPrefillArgs& a) {
  check_shape(a);
  const int max_chunks = (a.max_seqlen + C - 1) / C;
  constexpr int kWhole = 1 << 30;  // chunks per part of an unsplit scan
  if (a.seq_parts == 1 || a.num_seqs == 0 || max_chunks < 2) return {1, kWhole};
  int parts = a.seq_parts;
  if (parts == 0) {
    const int per_sm = a.head_dim == 64 ? chunk_blocks_per_sm<64>() : chunk_blocks_per_sm<128>();
    const long jobs = long(a.num_seqs) * a.num_heads * (a.head_dim / BV);
    const long wave = long(sm_count()) * per_sm;
    if (jobs * 2 > wave || max_chunks < 16) return {1, kWhole};
    parts = static_cast<int>(std::min<long>(wave / jobs, max_chunks / 8));
    if (parts < 2) return {1, kWhole};
  }
  parts = std::min(parts, max_chunks);
  const int cpp = (max_chunks + parts - 1) / parts;
  return {(max_chunks + cpp - 1) / cpp, cpp};
}

template <int D>
void launch_prefill(const LightningPrefillArgs& a, cudaStream_t stream) {
  const auto [parts, cpp] = scan_split(a);
  chunk_blocks_per_sm<D>();  // sets the shared-memory attributes
  ChunkParams p{a.cu_seqlens, a.num_heads, parts, cpp, a.q, a.k, a.v, a.slope, a.initial_state, a.final_state,
                a.transition, a.out, static_cast<float*>(a.workspace)};
  const dim3 grid(unsigned(a.num_seqs) * parts, unsigned(a.num_heads), D / BV);
  if (size_t(a.num_seqs) * parts > 0x7fffffffu) throw std::invalid_argument("lightning_prefill: too many sequences");
  if (parts > 1) {
    lightning_chunk_kernel<D, false><<<grid, kThreads, Layout<D>::kBytes, stream>>>(p);
    check_cuda(cudaGetLastError(), "lightning_prefill: state pass launch");
    lightning_part_fold_kernel<D><<<dim3(a.num_seqs, a.num_heads, D * D / 1024), 256, 0, stream>>>(p);
    check_cuda(cudaGetLastError(), "lightning_prefill: part fold launch");
  }
  lightning_chunk_kernel<D, true><<<grid, kThreads, Layout<D>::kBytes, stream>>>(p);
  check_cuda(cudaGetLastError(), "lightning_prefill: launch");
}

}  // namespace

bool lightning_head_dim_supported(int head_dim) { return head_dim == 64 || head_dim == 128; }

int lightning_scan_parts(const LightningPrefillArgs& a) { return scan_split(a).first; }

size_t lightning_prefill_workspace_bytes(const LightningPrefillArgs& a) {
  const int parts = scan_split(a).first;
  return parts > 1 ? size_t(a.num_seqs) * parts * a.num_heads * a.head_dim * a.head_dim * sizeof(float) : 0;
}

void lightning_prefill(const LightningPrefillArgs& a, cudaStream_t stream) {
  check_shape(a);
  check_pointers(a);
  const size_t need = lightning_prefill_workspace_bytes(a);
  if (need > 0 && (a.workspace == nullptr || a.workspace_bytes < need || !aligned16(a.workspace)))
    throw std::invalid_argument("lightning_prefill: workspace of " + std::to_string(a.workspace_bytes) +
                                " bytes given, " + std::to_string(need) + " needed (16-byte aligned)");
  if (a.num_seqs == 0) return;
  if (a.head_dim == 64)
    launch_prefill<64>(a, stream);
  else
    launch_prefill<128>(a, stream);
}

void lightning_decode(int batch, int num_heads, int head_dim, const bf16* q, const bf16* k, const bf16* v,
                      const float* slope, float* state, bf16* out, cudaStream_t stream, const int* state_slots) {
  const std::string f = "lightning_decode: ";
  if (!lightning_head_dim_supported(head_dim))
    throw std::invalid_argument(f + "head_dim " + std::to_string(head_dim) + " is not supported (64 or 128)");
  if (batch < 0 || num_heads <= 0 || num_heads > 65535)
    throw std::invalid_argument(f + "bad batch " + std::to_string(batch) + " or num_heads " +
                                std::to_string(num_heads));
  if (batch == 0) return;
  if (!q || !k || !v || !slope || !state) throw std::invalid_argument(f + "q, k, v, slope or state is null");
  const dim3 grid(unsigned(batch), unsigned(num_heads), head_dim / 64), block(64, 4);
  if (head_dim == 64)
    lightning_decode_kernel<64><<<grid, block, 0, stream>>>(q, k, v, slope, num_heads, state, out, state_slots);
  else
    lightning_decode_kernel<128><<<grid, block, 0, stream>>>(q, k, v, slope, num_heads, state, out, state_slots);
  check_cuda(cudaGetLastError(), "lightning_decode: launch");
}

void scalar_compose_fold(int batch, int dim, int num_segments, float* running, const float* transitions,
                         const float* states, cudaStream_t stream) {
  const std::string f = "scalar_compose_fold: ";
  if (batch < 0 || dim <= 0 || dim % 4 != 0 || num_segments < 0)
    throw std::invalid_argument(f + "bad batch " + std::to_string(batch) + ", dim " + std::to_string(dim) +
                                " (a positive multiple of 4) or num_segments " + std::to_string(num_segments));
  if (batch == 0 || num_segments == 0) return;
  if (!running || !transitions) throw std::invalid_argument(f + "running or transitions is null");
  if (!aligned16(running) || !aligned16(states)) throw std::invalid_argument(f + "arrays must be 16-byte aligned");
  const size_t n = size_t(batch) * (dim / 4);
  const int blocks = static_cast<int>(std::min<size_t>((n + 255) / 256, size_t(sm_count()) * 8));
  scalar_compose_kernel<<<blocks, 256, 0, stream>>>(batch, dim / 4, num_segments, reinterpret_cast<float4*>(running),
                                                    transitions, reinterpret_cast<const float4*>(states));
  check_cuda(cudaGetLastError(), "scalar_compose_fold: launch");
}

void lightning_qkv_prepare(const LightningQkvArgs& a, cudaStream_t stream) {
  const std::string f = "lightning_qkv_prepare: ";
  if (!lightning_head_dim_supported(a.head_dim))
    throw std::invalid_argument(f + "head_dim " + std::to_string(a.head_dim) + " is not supported (64 or 128)");
  if (a.tokens < 0 || a.num_heads <= 0)
    throw std::invalid_argument(f + "bad tokens " + std::to_string(a.tokens) + " or num_heads " +
                                std::to_string(a.num_heads));
  if ((a.inv_freq || a.rope_half != 0) &&
      (a.rope_half <= 0 || 2 * a.rope_half > a.head_dim || !a.positions || !a.inv_freq))
    throw std::invalid_argument(f + "RoPE needs inv_freq, positions and 0 < 2 rope_half <= head_dim (rope_half " +
                                std::to_string(a.rope_half) + ")");
  if (a.tokens == 0) return;
  if (!a.qkv || !a.q || !a.k || !a.v) throw std::invalid_argument(f + "qkv, q, k or v is null");
  for (const void* ptr : {static_cast<const void*>(a.qkv), static_cast<const void*>(a.q),
                          static_cast<const void*>(a.k), static_cast<const void*>(a.v),
                          static_cast<const void*>(a.q_norm), static_cast<const void*>(a.k_norm)})
    if (reinterpret_cast<uintptr_t>(ptr) & 3u)
      throw std::invalid_argument(f + "qkv, q, k, v and the norm weights must be 4-byte aligned");
  if (a.head_dim == 64)
    lightning_qkv_kernel<64><<<a.tokens, 256, 0, stream>>>(a);
  else
    lightning_qkv_kernel<128><<<a.tokens, 256, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "lightning_qkv_prepare: launch");
}

void rope_key_axis(int heads, int d_k, int d_v, int half, const float* inv_freq, int64_t position, float* state,
                   cudaStream_t stream) {
  const std::string f = "rope_key_axis: ";
  if (heads < 0 || d_k <= 0 || d_v <= 0 || half <= 0 || 2 * half > d_k || half > 65535)
    throw std::invalid_argument(f + "bad shape heads " + std::to_string(heads) + ", d_k " + std::to_string(d_k) +
                                ", d_v " + std::to_string(d_v) + ", half " + std::to_string(half) +
                                " (need 0 < 2 half <= d_k)");
  if (heads == 0) return;
  if (!inv_freq || !state) throw std::invalid_argument(f + "inv_freq or state is null");
  rope_key_axis_kernel<<<dim3(unsigned(heads), unsigned(half)), std::min(d_v, 256), 0, stream>>>(
      d_k, d_v, half, inv_freq, static_cast<float>(position), state);
  check_cuda(cudaGetLastError(), "rope_key_axis: launch");
}

}  // namespace hypic::kernels::cuda
