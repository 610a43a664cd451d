// Decode path of moe_forward (GroupedGemm::OwnDecode; Own for T <= 64; see moe.h): the router GEMM and the two
// grouped expert GEMMs (routed and shared experts in the same launches) as weight-streaming mma.sync kernels,
// launched with programmatic dependent launch. Routing (route_small_kernel) and combine stay in moe.cu.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_internal.cuh"

namespace hypic::kernels::cuda::moe_detail {

namespace {

using detail::mma_bf16;

// ---------------------------------------------------------------------------------------------
// Decode grouped GEMM (weight streaming)
// ---------------------------------------------------------------------------------------------
//
// For a few rows per expert the GEMMs are weight-bandwidth bound, so the problem is transposed:
// out^T = W X^T with the weight rows as the mma M dimension (16 per m16n8k16 A fragment) and the
// expert's rows (tokens, <= kDecBM = 32 per tile, 4 n8-fragments) as N. A and B fragments are
// loaded straight from global memory with 16-byte loads, no shared memory staging: lane
// (g = lane / 4, q = lane % 4) loads W[row g][k0 + 8q .. +7] and W[row g + 8][same] and
// X[token g][same] for each 32-wide k chunk k0. The mma only needs A and B to use the same
// permutation of k inside each k16 step: step s (0, 1) of the chunk puts k0 + 8q + 4s + {0, 1}
// at fragment k-positions 2q, 2q+1 and k0 + 8q + 4s + {2, 3} at 2q+8, 2q+9 (a bijection of the
// chunk's 32 k onto the two steps' positions), i.e. a = {wlo.w[2s], whi.w[2s], wlo.w[2s+1],
// whi.w[2s+1]}, b = {x.w[2s], x.w[2s+1]} in 32-bit words.
//
// Block = 8 warps = RG row groups x KS k-slices: the KS warps of a row group split K into
// contiguous slices; each warp keeps up to U chunks (U x 2 x 16 bytes per lane) of weight loads
// in flight, and the partial sums are added in shared memory in ascending slice order (fixed, so
// results are bit-identical from run to run; no atomics). A row group is 16 weight rows: for
// gate_up the 8 gate rows j0..j0+7 (A rows 0..7) and the 8 up rows I + j0.. (A rows 8..15), so
// the accumulator of lane (g, q) holds gate and up of column j0 + g for tokens 2q, 2q + 1 and
// SwiGLU runs in the epilogue; for down 16 output columns n0..n0+15.
//
// Grid: x = tile (an upper bound is launched; blocks past num_tiles exit), y = column block.
// Tile expert index E is the shared expert (rows = tokens 0..T-1, its own weights, sizes and
// outputs: gate_up -> s_act [T][Is] bf16, down -> s_out [T][H] fp32 unrounded, as the
// cuBLASLt shared path), so one launch covers routed and shared experts.
constexpr int kDecThreads = 256;
constexpr int kDecWarps = kDecThreads / 32;

struct DecodeArgs {
  const bf16* A;           // gate_up: x [T][K] gathered through a_rows; down: act [P][K]
  const int* a_rows;       // gate_up: sorted_tok [P]; down: nullptr (identity)
  const bf16* B;           // gate_up: [E][2N][K]; down: [E][N][K]
  size_t b_expert_stride;  // elements per expert of B
  bf16* out;               // gate_up: act [P][N]; down: y [P][N]
  int K, N;
  const bf16* sA;  // shared expert: gate_up: x [T][sK]; down: s_act [T][sK]
  const bf16* sB;  // gate_up: [2 sN][sK]; down: [sN][sK]
  void* sout;      // gate_up: s_act [T][sN] bf16; down: s_out [T][sN] fp32; router: logits [T][N] fp32
  int sK, sN;
  int E, T;
  const int2* tiles;
  const int* num_tiles;
  const int* offsets;  // [E + 1]
};

// 16-byte streaming load of weights (read once): no L1 allocation, 256-byte L2 prefetch.
__device__ __forceinline__ uint4 ld_weights16(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

enum DecodeMode { kDecDown = 0, kDecGateUp = 1, kDecRouter = 2 };

// kDecRouter: the router logits [T][E] fp32 = x W_router^T with the same machinery and no tile
// schedule (block x = a 32-token tile, A = x, B = router [N = E][K = H], output in sout; E need
// not be a multiple of 16: rows past E are clamped and not stored). Deterministic and, like the
// expert GEMMs, each token's result is independent of the other tokens of the batch.
template <int MODE, int KS, int U>
__global__ void __launch_bounds__(kDecThreads, 2) decode_gemm_kernel(DecodeArgs a) {
  constexpr bool GATE_UP = MODE == kDecGateUp, ROUTER = MODE == kDecRouter;
  constexpr int RG = kDecWarps / KS;
  constexpr int COLS = GATE_UP ? 8 : 16;  // output columns per row group
  constexpr int NT = kDecBM / 8;          // n8 fragments (token groups) per tile
  static_assert(kDecWarps % KS == 0, "k slices");
  __shared__ float red[kDecWarps][NT * 4][32];
  griddep_wait();
  griddep_launch_dependents();
  int e, m0;
  if (ROUTER) {
    e = 0, m0 = blockIdx.x * kDecBM;
  } else {
    if (int(blockIdx.x) >= __ldcg(a.num_tiles)) return;
    const int2 tile = __ldcg(a.tiles + blockIdx.x);
    e = tile.x, m0 = tile.y;
  }
  const bool sh = !ROUTER && e >= a.E;
  int seg, cnt, K, N;
  const bf16 *W, *A;
  if (ROUTER) {
    seg = 0, cnt = a.T, K = a.K, N = a.N, W = a.B, A = a.A;
  } else if (sh) {
    seg = 0, cnt = a.T, K = a.sK, N = a.sN, W = a.sB, A = a.sA;
  } else {
    seg = __ldcg(a.offsets + e);
    cnt = __ldcg(a.offsets + e + 1) - seg;
    K = a.K, N = a.N, W = a.B + size_t(e) * a.b_expert_stride, A = a.A;
  }
  const int col_block = blockIdx.y * (RG * COLS);
  if (col_block >= N) return;  // block-uniform (the grid covers the larger of routed / shared N)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int rg = warp / KS, ks = warp % KS;
  const int c0 = col_block + rg * COLS;
  // Expert GEMMs: N is a multiple of 32 >= COLS, so a row group is all in or all out; the router's
  // last row group may be partial (rows clamped to N - 1, not stored).
  const bool active = c0 < N;
  const int nrows = min(kDecBM, cnt - m0);  // >= 1
  const int ntl = (nrows + 7) >> 3;         // token groups with at least one row, 1..NT

  const int r_lo = !active ? 0 : ROUTER ? min(c0 + g, N - 1) : c0 + g;
  const int r_hi = !active ? 0 : ROUTER ? min(c0 + 8 + g, N - 1) : GATE_UP ? N + c0 + g : c0 + 8 + g;
  const bf16* wlo = W + size_t(r_lo) * K + q * 8;
  const bf16* whi = W + size_t(r_hi) * K + q * 8;
  const bf16* xp[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = m0 + t * 8 + g;
    const int mm = m < cnt ? m : m0;  // rows past the count: a valid row, never stored
    const int src = (sh || ROUTER) ? mm : (GATE_UP ? __ldcg(a.a_rows + seg + mm) : seg + mm);
    xp[t] = A + size_t(src) * K + q * 8;
  }

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;

  const int KT = K >> 5;  // 32-wide chunks
  const int kb = (ks * KT) / KS, ke = ((ks + 1) * KT) / KS;
  if (active) {
    for (int c = kb; c < ke; c += U) {
      uint4 wl[U], wh[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (c + u < ke) {
          wl[u] = ld_weights16(wlo + (c + u) * 32);
          wh[u] = ld_weights16(whi + (c + u) * 32);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (c + u < ke) {
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            if (t < ntl) {
              const uint4* src = reinterpret_cast<const uint4*>(xp[t] + (c + u) * 32);
              const uint4 xv = GATE_UP ? __ldg(src) : __ldcg(src);  // x reused across blocks via L1
              const uint32_t a0[4] = {wl[u].x, wh[u].x, wl[u].y, wh[u].y};
              const uint32_t a1[4] = {wl[u].z, wh[u].z, wl[u].w, wh[u].w};
              mma_bf16(acc[t], a0, xv.x, xv.y);
              mma_bf16(acc[t], a1, xv.z, xv.w);
            }
          }
        }
      }
    }
  }
  if (KS > 1) {
    if (ks != 0) {
#pragma unroll
      for (int t = 0; t < NT; ++t)
        if (t < ntl)
#pragma unroll
          for (int i = 0; i < 4; ++i) red[warp][t * 4 + i][lane] = acc[t][i];
    }
    __syncthreads();
    if (ks != 0) return;
#pragma unroll
    for (int s = 1; s < KS; ++s)
#pragma unroll
      for (int t = 0; t < NT; ++t)
        if (t < ntl)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[t][i] += red[warp + s][t * 4 + i][lane];
  }
  if (!active) return;

  // Epilogue: acc[t][h] = (A row g, token t*8 + 2q + h), acc[t][2 + h] = (A row g + 8, same token).
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= ntl) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + t * 8 + 2 * q + h;
      if (m >= cnt) continue;
      const size_t orow = size_t(sh ? m : seg + m) * N;
      if (GATE_UP) {
        const float gv = round_bf16(acc[t][h]), uv = round_bf16(acc[t][2 + h]);
        bf16* o = sh ? static_cast<bf16*>(a.sout) : a.out;
        o[orow + c0 + g] = __float2bfloat16(silu_f(gv) * uv);
      } else if (ROUTER) {
        float* o = static_cast<float*>(a.sout);
        if (c0 + g < N) o[orow + c0 + g] = acc[t][h];
        if (c0 + 8 + g < N) o[orow + c0 + 8 + g] = acc[t][2 + h];
      } else if (sh) {
        float* o = static_cast<float*>(a.sout);
        o[orow + c0 + g] = acc[t][h];
        o[orow + c0 + 8 + g] = acc[t][2 + h];
      } else {
        a.out[orow + c0 + g] = __float2bfloat16(acc[t][h]);
        a.out[orow + c0 + 8 + g] = __float2bfloat16(acc[t][2 + h]);
      }
    }
  }
}
// gate_up / router: K = H (2048 at Qwen3.5 sizes) in 8 slices of 8 chunks (two batches of 4 loads
// in flight), one row group per block; down: K = I (512) in 4 slices of 4 chunks, two row groups
// per block.
constexpr int kGuKS = 8, kGuU = 4, kDnKS = 4, kDnU = 4;

}  // namespace

// logits [T][E] fp32 = x W_router^T (decode path).
void launch_router(const MoeWeightsView& w, int T, const bf16* x, float* logits, cudaStream_t stream) {
  DecodeArgs g{};
  g.A = x;
  g.B = w.router;
  g.K = w.H;
  g.N = w.E;
  g.sout = logits;
  g.E = w.E;
  g.T = T;
  const dim3 grid(unsigned((T + kDecBM - 1) / kDecBM), unsigned((w.E + 15) / 16));
  launch_pdl(decode_gemm_kernel<kDecRouter, kGuKS, kGuU>, grid, dim3(kDecThreads), 0, stream,
             "moe_forward: decode router GEMM launch", g);
}

// Routed + shared experts through the decode GEMMs (the schedule has kDecBM-row tiles and, with
// Is > 0, the shared expert's tiles).
void launch_decode(const MoeWeightsView& w, int T, size_t P, const bf16* x, MoeWorkspace& ws, cudaStream_t stream) {
  const bool shared = w.Is > 0;
  const unsigned grid_m = unsigned(decode_grid_tiles(P, w.E, T, shared));
  DecodeArgs g1{};
  g1.A = x;
  g1.a_rows = static_cast<const int*>(ws.sorted_tok.p);
  g1.B = w.experts_gate_up;
  g1.b_expert_stride = size_t(2) * w.I * w.H;
  g1.out = static_cast<bf16*>(ws.act.p);
  g1.K = w.H;
  g1.N = w.I;
  g1.sA = x;
  g1.sB = shared ? w.shared_gate_up : nullptr;
  g1.sout = shared ? ws.s_act.p : nullptr;
  g1.sK = w.H;
  g1.sN = shared ? w.Is : 0;
  g1.E = w.E;
  g1.T = T;
  g1.tiles = static_cast<const int2*>(ws.tiles.p);
  g1.num_tiles = static_cast<const int*>(ws.num_tiles.p);
  g1.offsets = static_cast<const int*>(ws.offsets.p);
  constexpr int rg1 = kDecWarps / kGuKS, rg2 = kDecWarps / kDnKS;
  const int n1 = std::max(w.I, shared ? w.Is : 0);
  const dim3 grid1(grid_m, unsigned((n1 + 8 * rg1 - 1) / (8 * rg1)));
  launch_pdl(decode_gemm_kernel<kDecGateUp, kGuKS, kGuU>, grid1, dim3(kDecThreads), 0, stream,
             "moe_forward: decode gate_up GEMM launch", g1);
  DecodeArgs g2 = g1;
  g2.A = static_cast<const bf16*>(ws.act.p);
  g2.a_rows = nullptr;
  g2.B = w.experts_down;
  g2.b_expert_stride = size_t(w.H) * w.I;
  g2.out = static_cast<bf16*>(ws.y.p);
  g2.K = w.I;
  g2.N = w.H;
  g2.sA = shared ? static_cast<const bf16*>(ws.s_act.p) : nullptr;
  g2.sB = shared ? w.shared_down : nullptr;
  g2.sout = shared ? ws.s_out.p : nullptr;
  g2.sK = shared ? w.Is : 0;
  g2.sN = w.H;
  const dim3 grid2(grid_m, unsigned((w.H + 16 * rg2 - 1) / (16 * rg2)));
  launch_pdl(decode_gemm_kernel<kDecDown, kDnKS, kDnU>, grid2, dim3(kDecThreads), 0, stream,
             "moe_forward: decode down GEMM launch", g2);
}

}  // namespace hypic::kernels::cuda::moe_detail
