// Sparse MoE block and dense SwiGLU MLP on the GPU (see moe.h for the contract and pipeline).
//
// Routing is a stable counting sort on the device: the route kernel writes, per chunk of 32
// tokens, how many of its (token, slot) pairs go to each expert (chunk_counts[e][chunk]);
// chunk_scan turns that into per-expert exclusive prefixes over the chunks and the expert
// counts; offsets_kernel prefix-sums the counts over experts and writes the m-tile schedule of the
// grouped GEMM; scatter gives each pair its position offsets[e] + (earlier chunks) + (earlier
// tokens of the chunk routed to e, by popcount of a per-expert token bitmask). Positions are thus
// in ascending token order within each expert, deterministic and independent of thread timing.
//
// Grouped GEMM (GroupedGemm::Own): one launch per GEMM over all experts; block x = global m-tile
// (an upper bound of the tile count is launched, blocks past the device's num_tiles exit), block
// y = n-tile. mma.sync m16n8k16 bf16 with fp32 accumulators, ldmatrix from padded smem, cp.async
// multi-stage pipeline. Rows past an expert's count and weight rows past N are loaded from a
// clamped (valid) address and never stored, so no zero fill is needed (GEMM rows/columns are
// independent). gate_up tiles interleave gate and up rows so that every warp holds the gate and
// up accumulators of the same intermediate columns: B tile row r, with w = r % WN and
// grp = r / WN, is the gate row j (w < WN/2) or the up row I + j (w >= WN/2) of column
// j = n0 + grp * WN/2 + w % (WN/2); the warp's n8-fragments ni < NI/2 are then gate columns and
// ni + NI/2 the matching up columns, and SwiGLU runs in the epilogue.
//
// On Hopper (compute capability 9.0, sm_90a build: HYPIC_MOE_WGMMA_BUILT) the prefill tiles (Own at
// T * topk > 16 E, OwnWgmma) run the wgmma kernels of moe_wgmma.cu instead, on the same schedule
// (128-row m-tiles; OwnWgmma with few rows per expert: 64-row, wgmma_bm), buffers, roundings and masking;
// HYPIC_MOE_WGMMA=0 keeps the mma.sync kernel.
//
// Decode path (GroupedGemm::OwnDecode; Own for T <= kSmallT = 64): router logits, routing, two
// grouped GEMMs covering routed AND shared experts, combine = 5 launches chained by PDL (no
// GemmRunner / cuBLASLt call for T <= 16, where the router is a decode_linear). The GEMMs stream the weights through per-warp cp.async rings into mma
// fragments (moe_decode.cu, the router GEMM a decode_linear); for T <= 64 the routing (softmax / top-k / shared gate / counting
// sort / tile schedule) is one kernel (route_small_kernel over up to 8 blocks, the last sorting: HYPIC_ROUTE_SPREAD, on
// by default; one block with it off; at T = 1 with HYPIC_ROUTE_ONE_TOKEN, default on, two warps of route_one_kernel).
#include "kernels/cuda/moe.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_linear.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/row_norm.cuh"
#include "kernels/cuda/switches.h"

namespace hypic::kernels::cuda {

namespace {

using namespace moe_detail;
using detail::cp_async16;
using detail::cp_async_commit;
using detail::cp_async_wait;
using detail::load_a;
using detail::load_b_nk;
using detail::mma_bf16;
using detail::pack_bf16;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kChunk = 32;       // tokens per routing chunk (one bit each in the scatter bitmask)
constexpr int kMaxE = 512;
constexpr int kMaxTopk = 16;
constexpr int kRouteThreads = 256;  // 8 warps, one token each: kChunk / 8 blocks per chunk (184 splice tokens: 24)
constexpr int kRouteBlocksPerChunk = kChunk / (kRouteThreads / 32);
static_assert(kChunk % (kRouteThreads / 32) == 0, "route_kernel: a chunk's tokens split evenly over its blocks");

// ---------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------

// How route_token scores and picks (MoeWeightsView's routing fields).
struct RouteCfg {
  int E, k;
  bool renorm;
  bool sigmoid;
  const float* bias;
  int n_group, topk_group;
  float scale;
};

RouteCfg route_cfg(const MoeWeightsView& w) {
  return {w.E, w.topk, w.renormalize, w.scoring == MoeScoring::Sigmoid, w.expert_bias, w.n_group, w.topk_group,
          w.routed_scaling};
}

// The scores of one token's E logits lg[0..E) and its top-k, by one warp (expert e sits in lane e % 32, register
// e / 32). Softmax: choice = probability; Sigmoid: choice = sigmoid + bias within the kept groups (-inf outside).
// Lane r < k returns the r-th pick: its expert, its weight (renormalised over the k picks, summed in selection
// order as the CPU reference, when renorm) and its rank among the k picks in ascending expert order.
// Ties: lower expert (group) first.
// kSigmoid == rc.sigmoid: a template parameter, so that the softmax routers' kernels carry none of the sigmoid
// path's code or registers (the decode step's single-block routing is latency-bound). kNR: registers per lane, at
// least ceil(E / 32) (route_regs: 8 up to 256 experts, else 16); the registers past E hold -inf scores and 0
// probabilities, so the picks, weights and sums are the same bits at either size.
template <bool kSigmoid, int kNR>
__device__ __forceinline__ void route_token(const float* lg, const RouteCfg& rc, int lane, int& out_e, float& out_w,
                                            int& out_rank) {
  const int E = rc.E, k = rc.k;
  float v[kNR];
  if constexpr (!kSigmoid) {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kNR; ++i) {
      const int e = i * 32 + lane;
      v[i] = e < E ? lg[e] : -INFINITY;
      m = fmaxf(m, v[i]);
    }
#pragma unroll
    for (int off = 16; off; off >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, off));
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kNR; ++i) {
      const int e = i * 32 + lane;
      v[i] = e < E ? expf(v[i] - m) : 0.f;
      s += v[i];
    }
#pragma unroll
    for (int off = 16; off; off >>= 1) s += __shfl_xor_sync(kFull, s, off);
#pragma unroll
    for (int i = 0; i < kNR; ++i) {
      v[i] = v[i] / s;
      if (isnan(v[i])) v[i] = -INFINITY;  // NaN logits: every pick still a valid expert (the weights carry the NaN)
    }
  } else {
#pragma unroll
    for (int i = 0; i < kNR; ++i) {
      const int e = i * 32 + lane;
      v[i] = e < E ? 1.0f / (1.0f + expf(-lg[e])) + (rc.bias ? rc.bias[e] : 0.0f) : -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < kNR; ++i)
      if (isnan(v[i])) v[i] = -INFINITY;  // a NaN logit is never preferred (and never breaks the picks below)
    if (rc.n_group > 1) {
      // Group g's score (the sum of its two best choices) ends in lane g; then the topk_group best groups.
      const int per = E / rc.n_group;
      float gscore = -INFINITY;
      for (int g = 0; g < rc.n_group; ++g) {
        float a = -INFINITY, b = -INFINITY;  // this lane's best two in group g
#pragma unroll
        for (int i = 0; i < kNR; ++i) {
          const int e = i * 32 + lane;
          if (e < E && e / per == g) {
            if (v[i] > a) b = a, a = v[i];
            else if (v[i] > b) b = v[i];
          }
        }
#pragma unroll
        for (int off = 16; off; off >>= 1) {
          const float oa = __shfl_xor_sync(kFull, a, off), ob = __shfl_xor_sync(kFull, b, off);
          // Merge two top-2 lists.
          const float hi = fmaxf(a, oa);
          const float lo = fmaxf(fminf(a, oa), fmaxf(b, ob));
          a = hi, b = lo;
        }
        if (lane == g) gscore = per >= 2 ? a + b : a;
      }
      unsigned keep = 0u;
      for (int r = 0; r < rc.topk_group; ++r) {
        float bv = lane < rc.n_group && !(keep >> lane & 1u) ? gscore : -INFINITY;
        int bi = lane < rc.n_group && !(keep >> lane & 1u) ? lane : INT_MAX;
#pragma unroll
        for (int off = 16; off; off >>= 1) {
          const float ov = __shfl_xor_sync(kFull, bv, off);
          const int oi = __shfl_xor_sync(kFull, bi, off);
          if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
        }
        keep |= 1u << bi;
      }
#pragma unroll
      for (int i = 0; i < kNR; ++i) {
        const int e = i * 32 + lane;
        if (e < E && !(keep >> (e / per) & 1u)) v[i] = -INFINITY;
      }
    }
  }

  // k rounds of a warp argmax over the untaken experts (bit i of `taken`: register i's expert). The first untaken
  // expert of a lane always qualifies, so every round picks a valid expert < E (k <= E), whatever the values.
  int my_e = 0;
  float my_p = 0.f;
  unsigned taken = 0u;
  for (int r = 0; r < k; ++r) {
    float bv = -INFINITY;
    int bi = INT_MAX;
#pragma unroll
    for (int i = 0; i < kNR; ++i) {
      const int e = i * 32 + lane;
      if (e < E && !(taken >> i & 1u) && (bi == INT_MAX || v[i] > bv)) bv = v[i], bi = e;  // ascending e: lower first
    }
#pragma unroll
    for (int off = 16; off; off >>= 1) {
      const float ov = __shfl_xor_sync(kFull, bv, off);
      const int oi = __shfl_xor_sync(kFull, bi, off);
      if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    bi = min(bi, E - 1);  // (cannot trigger: some lane always holds an untaken expert)
    if (lane == r) my_e = bi, my_p = kSigmoid ? 1.0f / (1.0f + expf(-lg[bi])) : bv;
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
  }
  float sum = 0.f;
  for (int r = 0; r < k; ++r) sum += __shfl_sync(kFull, my_p, r);
  if constexpr (kSigmoid)
    out_w = (rc.renorm ? my_p / (sum + 1e-20f) : my_p) * rc.scale;
  else
    out_w = rc.renorm ? my_p / sum : my_p;
  int rank = 0;
  for (int r = 0; r < k; ++r) rank += (__shfl_sync(kFull, my_e, r) < my_e) ? 1 : 0;
  out_e = my_e;
  out_rank = rank;
}

// sigmoid(x_t . w) of one token by one warp (all lanes return it); 1 when w is null. kL2: x read through L2 (ld.cg:
// read before griddep_wait, route_one_kernel).
template <bool kL2 = false>
__device__ __forceinline__ float shared_gate_token(const bf16* xr, const bf16* w, int H, int lane) {
  if (!w) return 1.0f;
  float d = 0.f;
#pragma unroll 4
  for (int h = lane * 8; h < H; h += 256) {
    const uint4 xv = kL2 ? __ldcg(reinterpret_cast<const uint4*>(xr + h)) : *reinterpret_cast<const uint4*>(xr + h);
    const uint4 wv = *reinterpret_cast<const uint4*>(w + h);
    const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
    const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 a = __bfloat1622float2(xp[j]), b = __bfloat1622float2(wp[j]);
      d = fmaf(a.x, b.x, d);
      d = fmaf(a.y, b.y, d);
    }
  }
#pragma unroll
  for (int off = 16; off; off >>= 1) d += __shfl_xor_sync(kFull, d, off);
  return 1.0f / (1.0f + expf(-d));
}

// kRouteBlocksPerChunk blocks per chunk of 32 tokens (blockIdx.y: which 8), one warp per token; each block adds its
// expert histogram into the chunk's counts (zeroed before the launch; integer sums, so the same whatever the order).
// Spread over that many SMs because a token's softmax, top-k and shared gate are a few thousand instructions of one
// warp: 32 of them on one SM took 33 us, 24 blocks of 8 take a fraction.
template <bool kSigmoid, int kNR>
__global__ void __launch_bounds__(kRouteThreads) route_kernel(int T, RouteCfg rc, const float* logits,
                                                              const bf16* x, int H, const bf16* sgate_w,
                                                              float* sgate_out, int* topk_e, float* topk_w,
                                                              int* chunk_counts, int nch) {
  const int E = rc.E, k = rc.k;
  __shared__ int hist[kMaxE];
  for (int i = threadIdx.x; i < E; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * kChunk + blockIdx.y * (kRouteThreads / 32) + warp;
  if (t < T) {  // warp-uniform
    int my_e, rank;
    float wgt;
    route_token<kSigmoid, kNR>(logits + size_t(t) * E, rc, lane, my_e, wgt, rank);
    if (lane < k) {
      topk_e[size_t(t) * k + rank] = my_e;
      topk_w[size_t(t) * k + rank] = wgt;
      atomicAdd(&hist[my_e], 1);
    }
    if (sgate_out) {
      const float sg = shared_gate_token(x + size_t(t) * H, sgate_w, H, lane);
      if (lane == 0) sgate_out[t] = sg;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (hist[e]) atomicAdd(&chunk_counts[size_t(e) * nch + blockIdx.x], hist[e]);
}

// Decode routing (T <= kSmallT) by nb <= kSmallBlocksMax blocks of kMaxE threads: softmax / top-k / shared gate per
// token, one warp each (warp tasks 0 .. T-1 route token t, T .. 2T-1 the shared gate of token t - T, dealt over the
// blocks' warps block-major, so with nb = 1 one block runs them all); the last block to finish (a ticket in
// MoeWorkspace::route_ticket, which wraps back to 0 for the next launch; nb = 1: the only block, which records each
// pick in shared memory as it goes) then does the whole counting sort of route_kernel + chunk_scan_kernel +
// offsets_kernel + scatter_kernel in shared memory from the picks (nb > 1: re-read from topk_e): per-expert token
// bitmasks, offsets[E + 1], the tile schedule of the decode GEMMs (tiles of kDecBM rows; then, when shared_rows > 0,
// the shared expert's tiles (E, m0) over rows 0..shared_rows), num_tiles, sorted_tok and pos_of. Positions are in
// ascending token order within each expert, as on the multi-kernel path; the outputs do not depend on nb (integer
// bitmasks and sums). A token's routing is a few thousand dependent instructions of one warp: 128 tasks (T = 64 with
// a shared expert) on one block's 16 warps took 48 us on an H200 (2026-12-06). No co-scheduling is assumed (the
// blocks may run one after another, e.g. in a small SM partition).
constexpr int kSmallW = kSmallT / 32;
constexpr int kSmallBlocksMax = 8;

template <bool kSigmoid, int kNR>
__global__ void __launch_bounds__(kMaxE) route_small_kernel(int T, RouteCfg rc, const float* logits,
                                                            const bf16* x, int H, const bf16* sgate_w,
                                                            float* sgate_out, int* topk_e, float* topk_w,
                                                            int* offsets, int2* tiles, int* num_tiles,
                                                            int* sorted_tok, int* pos_of, int shared_rows,
                                                            int* route_ticket, int4* tile_info) {
  __shared__ unsigned mask[kMaxE][kSmallW];
  __shared__ int s_e[kSmallT * kMaxTopk];
  __shared__ int sc[kMaxE], st[kMaxE], so[kMaxE];
  __shared__ int last_block;
  const int E = rc.E, k = rc.k, nb = int(gridDim.x);
  griddep_wait();
  griddep_launch_dependents();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tasks = sgate_out ? 2 * T : T;
  if (nb == 1) {  // one block: each pick goes straight into its expert's bitmask
#pragma unroll
    for (int w = 0; w < kSmallW; ++w) mask[tid][w] = 0u;  // blockDim.x == kMaxE
    __syncthreads();
  }
  for (int task = int(blockIdx.x) * (kMaxE / 32) + warp; task < tasks; task += nb * (kMaxE / 32)) {
    if (task < T) {
      const int t = task;
      int my_e, rank;
      float wgt;
      route_token<kSigmoid, kNR>(logits + size_t(t) * E, rc, lane, my_e, wgt, rank);
      if (lane < k) {
        topk_e[t * k + rank] = my_e;
        topk_w[t * k + rank] = wgt;
        if (nb == 1) {
          s_e[t * k + rank] = my_e;
          atomicOr(&mask[my_e][t >> 5], 1u << (t & 31));
        }
      }
    } else {
      const int t = task - T;
      const float sg = shared_gate_token(x + size_t(t) * H, sgate_w, H, lane);
      if (lane == 0) sgate_out[t] = sg;
    }
  }
  if (nb > 1) {
    __threadfence();  // this thread's picks visible device-wide ...
    __syncthreads();  // ... for every thread of the block, before its ticket
    if (tid == 0) {
      __threadfence();
      // Wraps to 0 at the last ticket, ready for the next launch.
      const unsigned ticket = atomicInc(reinterpret_cast<unsigned*>(route_ticket), unsigned(nb - 1));
      last_block = ticket == unsigned(nb - 1);
    }
    __syncthreads();
    if (!last_block) return;
    __threadfence();  // the other blocks' picks (read through L2 below)
#pragma unroll
    for (int w = 0; w < kSmallW; ++w) mask[tid][w] = 0u;
    __syncthreads();
    for (int i = tid; i < T * k; i += blockDim.x) {
      // (always in [0, E): the clamp only keeps a misused workspace, e.g. two streams at once, inside shared memory)
      const int ee = min(max(__ldcg(topk_e + i), 0), E - 1), t = i / k;
      s_e[i] = ee;
      atomicOr(&mask[ee][t >> 5], 1u << (t & 31));
    }
  }
  __syncthreads();
  const int e = tid;
  int c = 0;
#pragma unroll
  for (int w = 0; w < kSmallW; ++w) c += __popc(mask[e][w]);  // 0 for e >= E
  const int nt = (c + kDecBM - 1) / kDecBM;
  // Inclusive prefix sums of (count, tiles) over the experts: within each warp by shuffles, then the warps' totals
  // (integer sums: the same values as any other order).
  __shared__ int wsc[kMaxE / 32], wst[kMaxE / 32];
  int ic = c, it = nt;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int a = __shfl_up_sync(kFull, ic, off), b = __shfl_up_sync(kFull, it, off);
    if (lane >= off) ic += a, it += b;
  }
  if (lane == 31) wsc[warp] = ic, wst[warp] = it;
  __syncthreads();
  for (int w = 0; w < warp; ++w) ic += wsc[w], it += wst[w];
  sc[e] = ic;
  st[e] = it;
  __syncthreads();
  so[e] = sc[e] - c;
  if (e < E) {
    offsets[e] = sc[e] - c;
    const int tb = st[e] - nt;
    for (int i = 0; i < nt; ++i) {
      tiles[tb + i] = make_int2(e, i * kDecBM);
      if (tile_info) tile_info[tb + i] = make_int4(e, i * kDecBM, sc[e] - c, c);
    }
  }
  const int routed_tiles = st[kMaxE - 1];
  const int nsh = (shared_rows + kDecBM - 1) / kDecBM;
  for (int i = tid; i < nsh; i += blockDim.x) {
    tiles[routed_tiles + i] = make_int2(E, i * kDecBM);
    if (tile_info) tile_info[routed_tiles + i] = make_int4(E, i * kDecBM, 0, shared_rows);
  }
  if (tid == 0) {
    offsets[E] = sc[kMaxE - 1];
    *num_tiles = routed_tiles + nsh;
  }
  __syncthreads();  // so[] complete
  for (int i = tid; i < T * k; i += blockDim.x) {
    const int ee = s_e[i], t = i / k;
    int rank = __popc(mask[ee][t >> 5] & ((1u << (t & 31)) - 1u));
    for (int w = 0; w < (t >> 5); ++w) rank += __popc(mask[ee][w]);
    const int pos = so[ee] + rank;
    sorted_tok[pos] = t;
    pos_of[i] = pos;
  }
}

// route_small_kernel's outputs for one token (T = 1, a batch-1 decode step; HYPIC_ROUTE_ONE_TOKEN, default on) by
// two warps and no block barrier: warp 0 routes the token (route_token, the same picks and weights) and writes what
// the counting sort gives for a single token: the k picks in ascending expert order are positions 0 .. k-1, so
// topk_e / topk_w[rank], sorted_tok[rank] = 0, pos_of[rank] = rank, tiles[rank] = (expert, 0), offsets[e] = the
// number of picks below e (offsets[E] = k), then the shared expert's tiles (E, m0) over shared_rows and num_tiles[0];
// warp 1 computes the shared gate. The same values as route_small_kernel at T = 1 (tests/gpu/test_gpu_moe.cpp).
template <bool kSigmoid, int kNR>
__global__ void __launch_bounds__(64) route_one_kernel(RouteCfg rc, const float* logits, const bf16* x, int H,
                                                       const bf16* sgate_w, float* sgate_out, int* topk_e,
                                                       float* topk_w, int* offsets, int2* tiles, int* num_tiles,
                                                       int* sorted_tok, int* pos_of, int shared_rows,
                                                       int4* tile_info, int sgate_early) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp == 1) {
    // sgate_early (HYPIC_ROUTE_SGATE_EARLY): the shared gate before the wait. x, the MoE input, is not the previous
    // kernel's output but the router GEMM's input: the router (decode_linear, or a cuBLASLt GEMM launched without
    // PDL) waits for x's writer before it lets this kernel start. Stored after the wait, as every output here.
    float sg = 0.f;
    if (sgate_out && sgate_early) sg = shared_gate_token<true>(x, sgate_w, H, lane);
    griddep_wait();
    griddep_launch_dependents();
    if (sgate_out) {
      if (!sgate_early) sg = shared_gate_token(x, sgate_w, H, lane);
      if (lane == 0) sgate_out[0] = sg;
    }
    return;
  }
  griddep_wait();
  griddep_launch_dependents();
  const int E = rc.E, k = rc.k;
  int my_e, rank;
  float wgt;
  route_token<kSigmoid, kNR>(logits, rc, lane, my_e, wgt, rank);
  if (lane < k) {
    topk_e[rank] = my_e;
    topk_w[rank] = wgt;
    sorted_tok[rank] = 0;
    pos_of[rank] = rank;
    tiles[rank] = make_int2(my_e, 0);
    if (tile_info) tile_info[rank] = make_int4(my_e, 0, rank, 1);  // (the picks below my_e come first)
  }
  // The k picks' experts in every lane (INT_MAX past k), gathered by the whole warp before the lane-dependent loop.
  int pk[kMaxTopk];
#pragma unroll
  for (int r = 0; r < kMaxTopk; ++r) {
    const int pe = __shfl_sync(kFull, my_e, r);
    pk[r] = r < k ? pe : INT_MAX;
  }
  for (int e = lane; e < E; e += 32) {
    int below = 0;
#pragma unroll
    for (int r = 0; r < kMaxTopk; ++r) below += pk[r] < e ? 1 : 0;
    offsets[e] = below;
  }
  const int nsh = (shared_rows + kDecBM - 1) / kDecBM;
  for (int i = lane; i < nsh; i += 32) {
    tiles[k + i] = make_int2(E, i * kDecBM);
    if (tile_info) tile_info[k + i] = make_int4(E, i * kDecBM, 0, shared_rows);
  }
  if (lane == 0) {
    offsets[E] = k;
    *num_tiles = k + nsh;
  }
}

// One warp per expert: chunk_counts[e][*] -> exclusive prefix over the chunks (in place), counts[e].
__global__ void __launch_bounds__(256) chunk_scan_kernel(int E, int nch, int* chunk_counts, int* counts) {
  const int e = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (e >= E) return;
  int* row = chunk_counts + size_t(e) * nch;
  const int per = (nch + 31) / 32, c0 = min(lane * per, nch), c1 = min(c0 + per, nch);
  int s = 0;
  for (int c = c0; c < c1; ++c) s += row[c];
  int incl = s;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int o = __shfl_up_sync(kFull, incl, off);
    if (lane >= off) incl += o;
  }
  int base = incl - s;
  for (int c = c0; c < c1; ++c) {
    const int v = row[c];
    row[c] = base;
    base += v;
  }
  if (lane == 31) counts[e] = incl;
}

// One block of 512 threads: offsets[E + 1] (exclusive prefix of counts), the tile schedule
// tiles[i] = (expert, first row) for tiles of bm rows, each expert's tiles consecutive, the experts with an even tile
// count first (then those with an odd one, each group in expert order: so the m-tile pairs (2 j, 2 j + 1) that the
// cluster-pair wgmma kernels share weights over are one expert's wherever the counts allow), then (decode GEMMs with
// a shared expert, shared_rows > 0) the shared expert's tiles (E, m0) over rows 0..shared_rows, and num_tiles[0].
// tail_at >= 0 (the wgmma tail tiles, wgmma_tail64): an expert's last tile of 1 .. bm / 2 rows goes instead to the
// tail list tiles[tail_at + j] (in expert order), num_tiles[1] of them, for the 64-row kernels.
__global__ void __launch_bounds__(kMaxE) offsets_kernel(int E, int bm, const int* counts, int* offsets, int2* tiles,
                                                        int* num_tiles, int shared_rows, int tail_at) {
  __shared__ int sc[kMaxE], st[kMaxE], so[kMaxE], stl[kMaxE];
  const int e = threadIdx.x;
  const int c = e < E ? counts[e] : 0;
  const int rem = c % bm;
  const int tail = tail_at >= 0 && rem > 0 && rem <= bm / 2 ? 1 : 0;
  const int nt = (c + bm - 1) / bm - tail;
  const bool even = (nt & 1) == 0;
  sc[e] = c;
  st[e] = even ? nt : 0;  // tiles of the experts with an even count, and of those with an odd one
  so[e] = even ? 0 : nt;
  stl[e] = tail;
  __syncthreads();
  for (int off = 1; off < kMaxE; off <<= 1) {
    const int a = e >= off ? sc[e - off] : 0, b = e >= off ? st[e - off] : 0, d = e >= off ? stl[e - off] : 0;
    const int o = e >= off ? so[e - off] : 0;
    __syncthreads();
    sc[e] += a;
    st[e] += b;
    so[e] += o;
    stl[e] += d;
    __syncthreads();
  }
  const int even_tiles = st[kMaxE - 1];
  if (e < E) {
    offsets[e] = sc[e] - c;
    const int tb = even ? st[e] - nt : even_tiles + so[e] - nt;
    for (int i = 0; i < nt; ++i) tiles[tb + i] = make_int2(e, i * bm);
    if (tail) tiles[tail_at + stl[e] - 1] = make_int2(e, nt * bm);
  }
  const int routed_tiles = even_tiles + so[kMaxE - 1];
  const int nsh = (shared_rows + bm - 1) / bm;
  for (int i = e; i < nsh; i += blockDim.x) tiles[routed_tiles + i] = make_int2(E, i * bm);
  if (e == 0) {
    offsets[E] = sc[kMaxE - 1];
    num_tiles[0] = routed_tiles + nsh;
    num_tiles[1] = stl[kMaxE - 1];
  }
}

// One block per chunk: each (token, slot) pair's position in the expert-sorted order.
__global__ void __launch_bounds__(256) scatter_kernel(int T, int E, int k, int nch, const int* topk_e,
                                                      const int* chunk_base, const int* offsets, int* sorted_tok,
                                                      int* pos_of) {
  __shared__ unsigned mask[kMaxE];
  for (int i = threadIdx.x; i < E; i += blockDim.x) mask[i] = 0u;
  __syncthreads();
  const int t0 = blockIdx.x * kChunk;
  const int n = min(kChunk, T - t0) * k;
  const int* te = topk_e + size_t(t0) * k;
  for (int i = threadIdx.x; i < n; i += blockDim.x) atomicOr(&mask[te[i]], 1u << (i / k));
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int e = te[i], tl = i / k;
    const int rank = chunk_base[size_t(e) * nch + blockIdx.x] + __popc(mask[e] & ((1u << tl) - 1u));
    const int pos = offsets[e] + rank;
    sorted_tok[pos] = t0 + tl;
    pos_of[size_t(t0) * k + i] = pos;
  }
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMM (Own)
// ---------------------------------------------------------------------------------------------

template <int BM_, int BN_, int BK_, int WM_, int WN_, int STAGES_, int MINB_>
struct TileCfg {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, STAGES = STAGES_, MINB = MINB_;
  static constexpr int WARPS_M = BM / WM, WARPS_N = BN / WN, THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int MI = WM / 16, NI = WN / 8;
  static constexpr int LDS = BK + 8;  // padded row (elements): 16-byte rows, conflict-free ldmatrix
  static constexpr int A_ELEMS = BM * LDS, B_ELEMS = BN * LDS, STAGE = A_ELEMS + B_ELEMS;
  static constexpr int SMEM = STAGES * STAGE * 2;
  static constexpr int KCH = BK / 8;  // 16-byte chunks per row of a stage
  static constexpr int A_CH = BM * KCH, B_CH = BN * KCH;
  static constexpr int A_IT = (A_CH + THREADS - 1) / THREADS, B_IT = B_CH / THREADS;
  static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0, "tile shape");
  static_assert(B_CH % THREADS == 0, "B chunks per thread");
  static_assert((LDS * 2) % 16 == 0, "16-byte smem rows");
};
// Prefill tiles: 128 x 128 x 32, 8 warps of 64 x 32, 4 stages (80 KiB smem, 2 blocks per SM).
using BigCfg = TileCfg<128, 128, 32, 64, 32, 4, 2>;
// Decode tiles: 16 x 64 x 32, 4 warps of 16 x 16, 8 stages (50 KiB smem).
using SmallCfg = TileCfg<16, 64, 32, 16, 16, 8, 4>;
// Wide prefill tiles (GroupedGemm::OwnLargeN): 128 x 256 x 32, 8 warps of 64 x 64 (fewer
// ldmatrix per mma than 64 x 32), 4 stages (120 KiB smem, 1 block per SM).
using WideCfg = TileCfg<128, 256, 32, 64, 64, 4, 1>;

template <class C, bool GATE_UP>
__global__ void __launch_bounds__(C::THREADS, C::MINB) grouped_gemm_kernel(GroupedArgs a) {
  if (int(blockIdx.x) >= *a.num_tiles) return;
  const int2 tile = a.tiles[blockIdx.x];
  const int e = tile.x, m0 = tile.y;
  const int seg = a.offsets[e], cnt = a.offsets[e + 1] - seg;
  const int K = a.K, N = a.N;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / C::WARPS_N, wn = warp % C::WARPS_N;
  const bf16* Bexp = a.B + size_t(e) * a.b_expert_stride;
  constexpr int COLS = GATE_UP ? C::BN / 2 : C::BN;  // output columns per block
  constexpr int HALF = C::WN / 2;
  const int n0 = blockIdx.y * COLS;

  // Per-thread source addresses (fixed over k) of the 16-byte chunks it copies.
  const bf16* a_src[C::A_IT];
  int a_dst[C::A_IT];
  bool a_on[C::A_IT];
#pragma unroll
  for (int i = 0; i < C::A_IT; ++i) {
    const int c = tid + i * C::THREADS;
    a_on[i] = (C::A_CH % C::THREADS == 0) || c < C::A_CH;
    a_src[i] = a.A;
    a_dst[i] = 0;
    if (a_on[i]) {
      const int r = c / C::KCH, kc = (c % C::KCH) * 8;
      const int m = m0 + r;
      const int row = seg + (m < cnt ? m : m0);  // rows past the count: a valid row, never stored
      const int src_row = GATE_UP ? a.a_rows[row] : row;
      a_src[i] = a.A + size_t(src_row) * K + kc;
      a_dst[i] = r * C::LDS + kc;
    }
  }
  const bf16* b_src[C::B_IT];
  int b_dst[C::B_IT];
#pragma unroll
  for (int i = 0; i < C::B_IT; ++i) {
    const int c = tid + i * C::THREADS;
    const int r = c / C::KCH, kc = (c % C::KCH) * 8;
    int wrow;
    if (GATE_UP) {
      const int grp = r / C::WN, w = r % C::WN;
      const int j = n0 + grp * HALF + (w % HALF);
      wrow = j < N ? (w < HALF ? j : N + j) : 0;
    } else {
      const int n = n0 + r;
      wrow = n < N ? n : 0;
    }
    b_src[i] = Bexp + size_t(wrow) * K + kc;
    b_dst[i] = C::A_ELEMS + r * C::LDS + kc;
  }
  auto load_stage = [&](int stage, int kt) {
    bf16* st = smem + stage * C::STAGE;
    const int ko = kt * C::BK;
#pragma unroll
    for (int i = 0; i < C::A_IT; ++i)
      if (a_on[i]) cp_async16(st + a_dst[i], a_src[i] + ko);
#pragma unroll
    for (int i = 0; i < C::B_IT; ++i) cp_async16(st + b_dst[i], b_src[i] + ko);
  };

  float acc[C::MI][C::NI][4];
#pragma unroll
  for (int mi = 0; mi < C::MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < C::NI; ++ni)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.f;

  const int KT = K / C::BK;
#pragma unroll
  for (int s = 0; s < C::STAGES - 1; ++s) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<C::STAGES - 2>();  // stage kt has landed (this thread's copies) ...
    __syncthreads();                 // ... everyone's, and stage kt-1 is free for reuse
    const int nk = kt + C::STAGES - 1;
    if (nk < KT) load_stage(nk % C::STAGES, nk);
    cp_async_commit();
    const bf16* sA = smem + (kt % C::STAGES) * C::STAGE;
    const bf16* sB = sA + C::A_ELEMS;
#pragma unroll
    for (int kk = 0; kk < C::BK; kk += 16) {
      uint32_t af[C::MI][4];
#pragma unroll
      for (int mi = 0; mi < C::MI; ++mi) load_a(af[mi], sA, C::LDS, wm * C::WM + mi * 16, kk, lane);
#pragma unroll
      for (int nj = 0; nj < C::NI / 2; ++nj) {
        uint32_t bfr[4];
        load_b_nk(bfr, sB, C::LDS, kk, wn * C::WN + nj * 16, lane);
#pragma unroll
        for (int mi = 0; mi < C::MI; ++mi) {
          mma_bf16(acc[mi][2 * nj], af[mi], bfr[0], bfr[1]);
          mma_bf16(acc[mi][2 * nj + 1], af[mi], bfr[2], bfr[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: accumulator (row g [+8], cols c, c+1) of each m16n8 fragment.
  const int g = lane >> 2, c2 = (lane & 3) * 2;
#pragma unroll
  for (int mi = 0; mi < C::MI; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + wm * C::WM + mi * 16 + g + h * 8;
      if (m >= cnt) continue;
      bf16* orow = a.out + size_t(seg + m) * N;
      if (GATE_UP) {
#pragma unroll
        for (int ni = 0; ni < C::NI / 2; ++ni) {
          const int j = n0 + wn * HALF + ni * 8 + c2;
          if (j >= N) continue;
          const float g0 = round_bf16(acc[mi][ni][2 * h]), g1 = round_bf16(acc[mi][ni][2 * h + 1]);
          const float u0 = round_bf16(acc[mi][ni + C::NI / 2][2 * h]);
          const float u1 = round_bf16(acc[mi][ni + C::NI / 2][2 * h + 1]);
          *reinterpret_cast<uint32_t*>(orow + j) = pack_bf16(silu_f(g0) * u0, silu_f(g1) * u1);
        }
      } else {
#pragma unroll
        for (int ni = 0; ni < C::NI; ++ni) {
          const int n = n0 + wn * C::WN + ni * 8 + c2;
          if (n >= N) continue;
          *reinterpret_cast<uint32_t*>(orow + n) = pack_bf16(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Elementwise: SwiGLU, gather, combine
// ---------------------------------------------------------------------------------------------

// 8 columns per thread: act[t][j..j+7] from gu[t][j..] (gate) and gu[t][I + j..] (up).
__global__ void silu_mul_kernel(int T, int I, const bf16* gu, bf16* act) {
  const int per_row = I / 8;
  const size_t total = size_t(T) * per_row;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const size_t t = idx / per_row;
    const int j = int(idx % per_row) * 8;
    const uint4 gv = *reinterpret_cast<const uint4*>(gu + t * 2 * I + j);
    const uint4 uv = *reinterpret_cast<const uint4*>(gu + t * 2 * I + I + j);
    const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&gv);
    const __nv_bfloat162* up = reinterpret_cast<const __nv_bfloat162*>(&uv);
    uint4 ov;
    uint32_t* op = reinterpret_cast<uint32_t*>(&ov);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 gf = __bfloat1622float2(gp[q]), uf = __bfloat1622float2(up[q]);
      op[q] = pack_bf16(silu_f(gf.x) * uf.x, silu_f(gf.y) * uf.y);
    }
    *reinterpret_cast<uint4*>(act + t * I + j) = ov;
  }
}

// xs[p][:] = x[sorted_tok[p]][:] (Cublas path), 8 bf16 per thread.
__global__ void gather_rows_kernel(int P, int H, const int* sorted_tok, const bf16* x, bf16* xs) {
  const int p = blockIdx.x;
  const bf16* src = x + size_t(sorted_tok[p]) * H;
  bf16* dst = xs + size_t(p) * H;
  for (int j = threadIdx.x * 8; j < H; j += blockDim.x * 8)
    *reinterpret_cast<uint4*>(dst + j) = *reinterpret_cast<const uint4*>(src + j);
}

// The MoE sum of token t's 4-column group j: sum_s w[s] y[pos[s]][j ..] (slots in ascending expert order, loads in
// flight together) + sg shared_row[j ..], times scale (1: no rounding at all). sp / sw: the token's k slots.
__device__ __forceinline__ float4 combine4(int H, int k, const int* sp, const float* sw, const bf16* y, float sg,
                                          const float* shared_row, int j, float scale) {
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
  for (int s = 0; s < kMaxTopk; ++s) {  // unrolled: the k rows' loads in flight together, summed in order
    if (s >= k) break;
    const uint2 raw = *reinterpret_cast<const uint2*>(y + size_t(sp[s]) * H + j);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    const float w = sw[s];
    a0 += w * lo.x;
    a1 += w * lo.y;
    a2 += w * hi.x;
    a3 += w * hi.y;
  }
  if (shared_row) {
    const float4 sh = *reinterpret_cast<const float4*>(shared_row + j);
    a0 += sg * sh.x;
    a1 += sg * sh.y;
    a2 += sg * sh.z;
    a3 += sg * sh.w;
  }
  if (scale != 1.0f) a0 *= scale, a1 *= scale, a2 *= scale, a3 *= scale;
  return make_float4(a0, a1, a2, a3);
}

// out[t][j] += sum_s w[t][s] y[pos[t][s]][j] (slots in ascending expert order) + sg[t] shared[t][j]. Grid (T, column
// blocks of 512): each element's sum has the same order whatever the grid.
// early (HYPIC_COMBINE_EARLY, decode steps: the predecessor is the decode down GEMM, which waits before it lets this
// launch start): the routing's pos_of / topk_w / sgate and the thread's first 4 columns of the residual row are read,
// through L2, before the wait (pdl.cuh: their writers, the routing and the out_proj / o_proj GEMM, completed before
// the down GEMM's wait returned); y and the shared expert's output after it. The same values either way.
template <bool kEarly>
__global__ void __launch_bounds__(128) combine_kernel(int H, int k, const int* pos_of, const float* topk_w,
                                                      const bf16* y, const float* sgate, const float* shared,
                                                      float* out, float scale) {
  __shared__ int sp[kMaxTopk];
  __shared__ float sw[kMaxTopk];
  const int t = blockIdx.x;
  const int j0 = (blockIdx.y * blockDim.x + threadIdx.x) * 4;
  float sg_early = 0.f;
  float4 ov0 = make_float4(0.f, 0.f, 0.f, 0.f);
  if constexpr (kEarly) {
    if (threadIdx.x < k) {
      sp[threadIdx.x] = __ldcg(pos_of + size_t(t) * k + threadIdx.x);
      sw[threadIdx.x] = __ldcg(topk_w + size_t(t) * k + threadIdx.x);
    }
    if (shared) sg_early = __ldcg(sgate + t);
    if (j0 < H) ov0 = __ldcg(reinterpret_cast<const float4*>(out + size_t(t) * H + j0));
  }
  griddep_wait();
  griddep_launch_dependents();
  if constexpr (!kEarly) {
    if (threadIdx.x < k) {
      sp[threadIdx.x] = pos_of[size_t(t) * k + threadIdx.x];
      sw[threadIdx.x] = topk_w[size_t(t) * k + threadIdx.x];
    }
  }
  __syncthreads();
  const float sg = kEarly ? sg_early : shared ? sgate[t] : 0.f;
  const float* shared_row = shared ? shared + size_t(t) * H : nullptr;
  for (int j = j0; j < H; j += gridDim.y * blockDim.x * 4) {
    const float4 a = combine4(H, k, sp, sw, y, sg, shared_row, j, scale);
    float4* o = reinterpret_cast<float4*>(out + size_t(t) * H + j);
    float4 ov = kEarly && j == j0 ? ov0 : *o;
    ov.x += a.x;
    ov.y += a.y;
    ov.z += a.z;
    ov.w += a.w;
    *o = ov;
  }
}

// Rows of at most this many columns take combine_norm_kernel (its 4-column groups held in registers: 8 per thread).
constexpr int kCombineNormVec = 8;
constexpr int kCombineNormMaxH = 4 * detail::kNormThreads * kCombineNormVec;

// combine_kernel's sum and the next layer's input RMSNorm of the updated row in one pass (MoeNextNorm): one block of
// kNormThreads per token, thread tid owning the 4-column groups 4 tid + 4 kNormThreads i as rms_norm_residual_kernel
// (row_norm.cuh), so out gets combine_kernel's bits and ny rms_norm_residual's. ny may alias the MoE input x (every
// earlier reader of x finished before griddep_wait returns: the launches before this one are in order on the stream).
template <bool kZeroCentred>
__global__ void __launch_bounds__(detail::kNormThreads) combine_norm_kernel(
    int H, int k, const int* pos_of, const float* topk_w, const bf16* y, const float* sgate, const float* shared,
    float* out, float scale, const bf16* __restrict__ nw, float eps, bf16* ny) {
  __shared__ int sp[kMaxTopk];
  __shared__ float sw[kMaxTopk];
  __shared__ float part[detail::kNormThreads / 32];
  griddep_wait();
  griddep_launch_dependents();
  const int t = blockIdx.x, tid = threadIdx.x;
  if (tid < k) {
    sp[tid] = pos_of[size_t(t) * k + tid];
    sw[tid] = topk_w[size_t(t) * k + tid];
  }
  __syncthreads();
  const float sg = shared ? sgate[t] : 0.f;
  const float* shared_row = shared ? shared + size_t(t) * H : nullptr;
  float* orow = out + size_t(t) * H;
  float4 v[kCombineNormVec];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kCombineNormVec; ++i) {
    const int j = tid * 4 + i * detail::kNormThreads * 4;
    if (j < H) {
      const float4 a = combine4(H, k, sp, sw, y, sg, shared_row, j, scale);
      float4* o = reinterpret_cast<float4*>(orow + j);
      float4 ov = *o;
      ov.x += a.x;
      ov.y += a.y;
      ov.z += a.z;
      ov.w += a.w;
      *o = ov;
      v[i] = ov;
      ss = detail::norm_add_sq4(ss, ov);
    }
  }
  const float inv = detail::norm_block_inv(ss, part, H, eps);
  bf16* nrow = ny + size_t(t) * H;
#pragma unroll
  for (int i = 0; i < kCombineNormVec; ++i) {
    const int j = tid * 4 + i * detail::kNormThreads * 4;
    if (j < H) detail::norm_apply4<kZeroCentred>(v[i], inv, nw, nrow, j);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

[[noreturn]] void bad_arg(const char* fn, const std::string& what) {
  throw std::invalid_argument(std::string(fn) + ": " + what);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

void validate_view(const char* fn, const MoeWeightsView& w) {
  if (w.E < 1 || w.E > kMaxE) bad_arg(fn, "E = " + std::to_string(w.E) + " outside [1, 512]");
  if (w.topk < 1 || w.topk > kMaxTopk || w.topk > w.E)
    bad_arg(fn, "topk = " + std::to_string(w.topk) + " outside [1, min(16, E = " + std::to_string(w.E) + ")]");
  if (w.H <= 0 || w.H % 64) bad_arg(fn, "H = " + std::to_string(w.H) + " is not a positive multiple of 64");
  if (w.I <= 0 || w.I % 32) bad_arg(fn, "I = " + std::to_string(w.I) + " is not a positive multiple of 32");
  if (w.Is < 0 || w.Is % 32) bad_arg(fn, "Is = " + std::to_string(w.Is) + " is not a non-negative multiple of 32");
  if (!w.router || !w.experts_gate_up || !w.experts_down) bad_arg(fn, "null router or expert weights");
  if (w.Is > 0 && (!w.shared_gate_up || !w.shared_down)) bad_arg(fn, "Is > 0 but null shared expert weights");
  if (!std::isfinite(w.output_scale)) bad_arg(fn, "output_scale is not finite");
  if (w.scoring == MoeScoring::Sigmoid) {
    if (w.n_group < 1 || w.n_group > 32 || w.E % w.n_group != 0)
      bad_arg(fn, "n_group = " + std::to_string(w.n_group) + " must be in [1, 32] and divide E = " + std::to_string(w.E));
    if (w.topk_group < 1 || w.topk_group > w.n_group || w.topk > w.topk_group * (w.E / w.n_group))
      bad_arg(fn, "topk_group = " + std::to_string(w.topk_group) + " must be in [1, n_group = " +
                      std::to_string(w.n_group) + "] and keep at least topk = " + std::to_string(w.topk) + " experts");
    if (!std::isfinite(w.routed_scaling)) bad_arg(fn, "routed_scaling is not finite");
  }
  if (!aligned16(w.router) || !aligned16(w.experts_gate_up) || !aligned16(w.experts_down) ||
      !aligned16(w.shared_gate_up) || !aligned16(w.shared_down) || !aligned16(w.shared_gate))
    bad_arg(fn, "weights must be 16-byte aligned");
}

int setup_device(int dev) {
  (void)dev;
  check_cuda(cudaFuncSetAttribute(grouped_gemm_kernel<BigCfg, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  BigCfg::SMEM),
             "cudaFuncSetAttribute(grouped_gemm big)");
  check_cuda(cudaFuncSetAttribute(grouped_gemm_kernel<BigCfg, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  BigCfg::SMEM),
             "cudaFuncSetAttribute(grouped_gemm big)");
  check_cuda(cudaFuncSetAttribute(grouped_gemm_kernel<SmallCfg, true>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, SmallCfg::SMEM),
             "cudaFuncSetAttribute(grouped_gemm small)");
  check_cuda(cudaFuncSetAttribute(grouped_gemm_kernel<SmallCfg, false>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, SmallCfg::SMEM),
             "cudaFuncSetAttribute(grouped_gemm small)");
  check_cuda(cudaFuncSetAttribute(grouped_gemm_kernel<WideCfg, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  WideCfg::SMEM),
             "cudaFuncSetAttribute(grouped_gemm wide)");
  check_cuda(cudaFuncSetAttribute(grouped_gemm_kernel<WideCfg, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  WideCfg::SMEM),
             "cudaFuncSetAttribute(grouped_gemm wide)");
  return 0;
}
DeviceOnce g_setup;

static_assert(BigCfg::BM == kWgmmaBM, "Own's prefill schedule serves both the mma.sync and the wgmma tiles");

// Whether the prefill GEMMs of impl run on the wgmma kernels (moe_wgmma.cu): built for sm_90a, a compute capability
// 9.0 device, and impl OwnWgmma, or Own (its prefill tiles) with HYPIC_MOE_WGMMA != 0, at sizes wgmma_supported takes
// (every size below 2^31 blocks). try_launch_wgmma launches them then (tail64: the schedule has the tail list,
// wgmma_tail64) and returns true; else it launches nothing and returns false: the caller runs the mma.sync kernel.
bool wgmma_runs(GroupedGemm impl, const MoeWeightsView& w, size_t P) {
#if HYPIC_MOE_WGMMA_BUILT
  const int mode = wgmma_env_mode();
  const bool on = impl == GroupedGemm::OwnWgmma || (impl == GroupedGemm::Own && mode != 0);
  return on && wgmma_device() && wgmma_supported(w, P);
#else
  (void)impl, (void)w, (void)P;
  return false;
#endif
}

// The wgmma variant of a call with P routed rows: HYPIC_MOE_WGMMA's (wgmma_env_mode; 0 runs variant 1 for OwnWgmma);
// variant 1 at 128-row tiles becomes 6 (the warp-specialised blocks) below kWgmmaWsMaxRowsPerExpert rows per expert
// under the measured default HYPIC_MOE_WARP_SPECIALIZED, else 3 (the persistent blocks) under the candidate
// HYPIC_MOE_PERSISTENT_LONG from kWgmmaPersistentRowsPerExpert rows per expert; at every size under the candidate
// HYPIC_MOE_CLUSTER_PAIRS, 7 (the warp-specialised blocks in clusters of two, which takes precedence); from
// kWgmmaWsMaxRowsPerExpert rows per expert under the measured default HYPIC_MOE_WS_GATE_UP_LONG, 8 (gate_up on the
// warp-specialised blocks, down one block per tile; before HYPIC_MOE_PERSISTENT_LONG). Variant 1's 64-row tiles
// become 9 (on the warp-specialised blocks) under the measured default HYPIC_MOE_WS_SMALL; HYPIC_MOE_WGMMA=9 is
// variant 1 with 9 for its 64-row tiles. Same tiles, same bits.
int wgmma_variant(const MoeWeightsView& w, size_t P, int bm) {
  static CandidateSwitch persistent_long("HYPIC_MOE_PERSISTENT_LONG");
  static CandidateSwitch warp_specialized("HYPIC_MOE_WARP_SPECIALIZED");
  static CandidateSwitch cluster_pairs("HYPIC_MOE_CLUSTER_PAIRS");
  static CandidateSwitch ws_gate_up_long("HYPIC_MOE_WS_GATE_UP_LONG");
  static CandidateSwitch ws_small("HYPIC_MOE_WS_SMALL");
  const int env = wgmma_env_mode();
  const int mode = env == 0 || env == 9 ? 1 : env;
  if (bm != kWgmmaBM) return mode == 1 && (env == 9 || ws_small.on()) ? 9 : mode;
  if (mode != 1) return mode;
  if (cluster_pairs.on()) return 7;
  const bool long_call = P >= size_t(kWgmmaWsMaxRowsPerExpert) * size_t(w.E);
  if (!long_call && warp_specialized.on()) return 6;
  if (long_call && ws_gate_up_long.on()) return 8;
  if (P >= size_t(kWgmmaPersistentRowsPerExpert) * size_t(w.E) && persistent_long.on()) return 3;
  return mode;
}

bool try_launch_wgmma(GroupedGemm impl, const MoeWeightsView& w, size_t P, const bf16* x, MoeWorkspace& ws, int bm,
                      bool tail64, bool swap, cudaStream_t stream) {
#if HYPIC_MOE_WGMMA_BUILT
  if (!wgmma_runs(impl, w, P)) return false;
  launch_wgmma(w, P, x, ws, wgmma_variant(w, P, bm), bm, tail64, swap, stream);
  return true;
#else
  (void)impl, (void)w, (void)P, (void)x, (void)ws, (void)bm, (void)tail64, (void)swap, (void)stream;
  return false;
#endif
}

// Whether the prefill schedule of this call puts experts' short last tiles on the 64-row wgmma kernels (offsets_kernel
// tail_at; HYPIC_MOE_TAIL64, a candidate: switches.h): the wgmma kernels run 128-row tiles.
bool wgmma_tail64(GroupedGemm impl, const MoeWeightsView& w, size_t P, int bm) {
  static CandidateSwitch on("HYPIC_MOE_TAIL64");
  return bm == kWgmmaBM && wgmma_env_mode() != 5 && wgmma_runs(impl, w, P) && on.on();
}

// Whether an OwnWgmma prefill call with P routed rows runs the swap-AB kernels (on a kSwapBM-row schedule): the
// candidate HYPIC_MOE_SWAP_AB on, variant 1 (HYPIC_MOE_WGMMA unset, 0 or 1), below kSwapMaxRowsPerExpert routed rows
// per expert on average, the wgmma kernels runnable and swap_ab_supported (the weights' tensor maps made, the
// kernels' registers enough for their setmaxnreg split).
bool own_wgmma_swap(const MoeWeightsView& w, size_t P) {
#if HYPIC_MOE_WGMMA_BUILT
  static CandidateSwitch swap_ab("HYPIC_MOE_SWAP_AB");
  if (!swap_ab.on() || !wgmma_device() || !wgmma_supported(w, P)) return false;
  const int env = wgmma_env_mode();
  return (env == 0 || env == 1) && P < size_t(kSwapMaxRowsPerExpert) * size_t(w.E) && swap_ab_supported(w);
#else
  (void)w, (void)P;
  return false;
#endif
}

// The schedule's m-tile rows for OwnWgmma: its kernels' wgmma_bm where they run, else the mma.sync tiles'.
int own_wgmma_bm(const MoeWeightsView& w, size_t P) {
#if HYPIC_MOE_WGMMA_BUILT
  if (wgmma_device() && wgmma_supported(w, P)) return wgmma_bm(P, w.E, wgmma_env_mode() == 0 ? 1 : wgmma_env_mode());
#else
  (void)w, (void)P;
#endif
  return kWgmmaBM;
}

template <class C>
void launch_grouped(const MoeWeightsView& w, size_t P, const bf16* x, MoeWorkspace& ws, cudaStream_t stream) {
  const unsigned grid_m = unsigned(max_tiles(P, w.E, C::BM));
  const GroupedArgs g1 = gate_up_args(w, x, ws);
  const dim3 grid1(grid_m, unsigned((w.I + C::BN / 2 - 1) / (C::BN / 2)));
  grouped_gemm_kernel<C, true><<<grid1, C::THREADS, C::SMEM, stream>>>(g1);
  check_cuda(cudaGetLastError(), "moe_forward: grouped gate_up GEMM launch");
  const GroupedArgs g2 = down_args(w, ws);
  const dim3 grid2(grid_m, unsigned((w.H + C::BN - 1) / C::BN));
  grouped_gemm_kernel<C, false><<<grid2, C::THREADS, C::SMEM, stream>>>(g2);
  check_cuda(cudaGetLastError(), "moe_forward: grouped down GEMM launch");
}

void check_cublas(cublasStatus_t s, const std::string& what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(what + ": " + cublasGetStatusName(s));
}

void launch_cublas_grouped(const MoeWeightsView& w, int T, size_t P, const bf16* x, MoeWorkspace& ws,
                           cudaStream_t stream) {
  const int E = w.E, H = w.H, I = w.I;
  ws.grow(ws.xs, P * H * sizeof(bf16), "xs");
  ws.grow(ws.gu, P * 2 * I * sizeof(bf16), "gu");
  ws.grow(ws.ptrs, size_t(6) * E * sizeof(void*), "ptrs");
  const size_t host_bytes = size_t(E) * sizeof(int) + size_t(6) * E * sizeof(void*);
  if (ws.host_pinned_bytes < host_bytes) {
    if (ws.host_pinned) cudaFreeHost(ws.host_pinned);
    ws.host_pinned = nullptr;
    ws.host_pinned_bytes = 0;
    check_cuda(cudaMallocHost(&ws.host_pinned, host_bytes), "moe_forward: cudaMallocHost");
    ws.host_pinned_bytes = host_bytes;
  }
  if (!ws.cublas) {
    cublasHandle_t h = nullptr;
    check_cublas(cublasCreate(&h), "moe_forward: cublasCreate");
    ws.cublas = h;
  }
  cublasHandle_t h = static_cast<cublasHandle_t>(ws.cublas);
  check_cublas(cublasSetStream(h, stream), "moe_forward: cublasSetStream");
  check_cublas(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "moe_forward: cublasSetMathMode");

  int* counts_h = static_cast<int*>(ws.host_pinned);
  const void** ptr_h = reinterpret_cast<const void**>(static_cast<char*>(ws.host_pinned) + size_t(E) * sizeof(int));
  check_cuda(cudaMemcpyAsync(counts_h, ws.counts.p, size_t(E) * sizeof(int), cudaMemcpyDeviceToHost, stream),
             "moe_forward: counts to host");
  check_cuda(cudaStreamSynchronize(stream), "moe_forward: stream sync for the counts");

  gather_rows_kernel<<<unsigned(P), 128, 0, stream>>>(int(P), H, static_cast<const int*>(ws.sorted_tok.p), x,
                                                       static_cast<bf16*>(ws.xs.p));
  check_cuda(cudaGetLastError(), "moe_forward: gather launch");

  // Groups = non-empty experts, one problem each. Column-major view (see gemm.cu):
  //   gate_up: gu_e^T (2I x c) = W_e (2I x H) xs_e^T (H x c): A = W_e^T stored (H x 2I, ld H), op T;
  //            B = xs_e^T (H x c, ld H), op N; C = gu_e^T (2I x c, ld 2I).
  //   down:    y_e^T (H x c) = D_e (H x I) act_e^T (I x c): A = D_e^T stored (I x H, ld I), op T;
  //            B = act_e^T (I x c, ld I), op N; C = y_e^T (H x c, ld H).
  std::vector<int> m1, n1, k1, lda1, ldb1, ldc1, m2, k2, lda2, ldb2, ldc2, gsize;
  std::vector<float> alpha, beta;
  std::vector<cublasOperation_t> ta, tb;
  const bf16* xs = static_cast<const bf16*>(ws.xs.p);
  bf16* gu = static_cast<bf16*>(ws.gu.p);
  bf16* act = static_cast<bf16*>(ws.act.p);
  bf16* y = static_cast<bf16*>(ws.y.p);
  int G = 0;
  size_t off = 0;
  std::vector<const void*> A1, B1, A2, B2;
  std::vector<void*> C1, C2;
  for (int e = 0; e < E; ++e) {
    const int c = counts_h[e];
    if (c > 0) {
      m1.push_back(2 * I), n1.push_back(c), k1.push_back(H), lda1.push_back(H), ldb1.push_back(H),
          ldc1.push_back(2 * I);
      m2.push_back(H), k2.push_back(I), lda2.push_back(I), ldb2.push_back(I), ldc2.push_back(H);
      A1.push_back(w.experts_gate_up + size_t(e) * 2 * I * H);
      B1.push_back(xs + off * H);
      C1.push_back(gu + off * 2 * I);
      A2.push_back(w.experts_down + size_t(e) * H * I);
      B2.push_back(act + off * I);
      C2.push_back(y + off * H);
      ++G;
    }
    off += size_t(c);
  }
  if (off != P) throw std::runtime_error("moe_forward (Cublas): expert counts sum to " + std::to_string(off));
  if (G == 0) return;
  gsize.assign(G, 1);
  alpha.assign(G, 1.0f);
  beta.assign(G, 0.0f);
  ta.assign(G, CUBLAS_OP_T);
  tb.assign(G, CUBLAS_OP_N);
  for (int i = 0; i < G; ++i) {
    ptr_h[0 * G + i] = A1[i];
    ptr_h[1 * G + i] = B1[i];
    ptr_h[2 * G + i] = C1[i];
    ptr_h[3 * G + i] = A2[i];
    ptr_h[4 * G + i] = B2[i];
    ptr_h[5 * G + i] = C2[i];
  }
  void** ptr_d = static_cast<void**>(ws.ptrs.p);
  check_cuda(cudaMemcpyAsync(ptr_d, ptr_h, size_t(6) * G * sizeof(void*), cudaMemcpyHostToDevice, stream),
             "moe_forward: pointer arrays to the device");
  check_cublas(cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), m1.data(), n1.data(), k1.data(), alpha.data(),
                                          const_cast<const void* const*>(ptr_d + 0 * G), CUDA_R_16BF, lda1.data(),
                                          const_cast<const void* const*>(ptr_d + 1 * G), CUDA_R_16BF, ldb1.data(),
                                          beta.data(), ptr_d + 2 * G, CUDA_R_16BF, ldc1.data(), G, gsize.data(),
                                          CUBLAS_COMPUTE_32F),
               "moe_forward: cublasGemmGroupedBatchedEx (gate_up)");
  silu_mul(int(P), I, gu, act, stream);
  check_cublas(cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), m2.data(), n1.data(), k2.data(), alpha.data(),
                                          const_cast<const void* const*>(ptr_d + 3 * G), CUDA_R_16BF, lda2.data(),
                                          const_cast<const void* const*>(ptr_d + 4 * G), CUDA_R_16BF, ldb2.data(),
                                          beta.data(), ptr_d + 5 * G, CUDA_R_16BF, ldc2.data(), G, gsize.data(),
                                          CUBLAS_COMPUTE_32F),
               "moe_forward: cublasGemmGroupedBatchedEx (down)");
  // The pinned staging is rewritten by the next call only after its own stream sync, which
  // follows this call's pointer upload on the same stream.
  (void)T;
}

struct CaptureFlag {
  MoeWorkspace& ws;
  CaptureFlag(MoeWorkspace& w, cudaStream_t s) : ws(w) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &st) != cudaSuccess) {
      (void)cudaGetLastError();
      st = cudaStreamCaptureStatusActive;  // unknown: behave as if capturing (no allocation)
    }
    ws.capturing = st != cudaStreamCaptureStatusNone;
  }
  ~CaptureFlag() { ws.capturing = false; }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// MoeWorkspace
// ---------------------------------------------------------------------------------------------

MoeWorkspace::~MoeWorkspace() {
  for (Buf* b : {&logits, &topk_e, &topk_w, &sgate, &chunk_counts, &counts, &offsets, &tiles, &num_tiles,
                 &sorted_tok, &pos_of, &act, &y, &s_gu, &s_act, &s_out, &mlp_gu, &mlp_act, &xs, &gu, &ptrs,
                 &route_ticket, &dec_tiles})
    if (b->p) cudaFree(b->p);
  if (host_pinned) cudaFreeHost(host_pinned);
  if (cublas) cublasDestroy(static_cast<cublasHandle_t>(cublas));
}

size_t MoeWorkspace::bytes() const {
  size_t s = 0;
  for (const Buf* b : {&logits, &topk_e, &topk_w, &sgate, &chunk_counts, &counts, &offsets, &tiles, &num_tiles,
                       &sorted_tok, &pos_of, &act, &y, &s_gu, &s_act, &s_out, &mlp_gu, &mlp_act, &xs, &gu, &ptrs,
                       &route_ticket, &dec_tiles})
    s += b->bytes;
  return s;
}

bool MoeWorkspace::grow(Buf& b, size_t bytes, const char* name) {
  if (bytes <= b.bytes) return false;
  if (capturing)
    throw std::invalid_argument(std::string("MoeWorkspace: buffer '") + name + "' must grow to " +
                                std::to_string(bytes) +
                                " bytes during CUDA graph capture; run the shape once uncaptured (or reserve) first");
  if (b.p) cudaFree(b.p);
  b.p = nullptr;
  b.bytes = 0;
  check_cuda(cudaMalloc(&b.p, bytes), std::string("MoeWorkspace: cudaMalloc(") + name + ", " +
                                          std::to_string(bytes) + " bytes)");
  b.bytes = bytes;
  return true;
}

void MoeWorkspace::reserve(int max_tokens, const MoeWeightsView& w) {
  validate_view("MoeWorkspace::reserve", w);
  if (max_tokens < 0) bad_arg("MoeWorkspace::reserve", "max_tokens = " + std::to_string(max_tokens));
  const size_t T = size_t(std::max(max_tokens, 1)), E = size_t(w.E), k = size_t(w.topk), P = T * k;
  const size_t nch = (T + kChunk - 1) / kChunk;
  grow(logits, T * E * sizeof(float), "logits");
  grow(topk_e, P * sizeof(int), "topk_e");
  grow(topk_w, P * sizeof(float), "topk_w");
  grow(sgate, T * sizeof(float), "sgate");
  grow(chunk_counts, E * nch * sizeof(int), "chunk_counts");
  grow(counts, E * sizeof(int), "counts");
  grow(offsets, (E + 1) * sizeof(int), "offsets");
  // SmallCfg's BM (the smallest) bounds the Big / Wide schedules; the decode schedule adds the shared tiles; the
  // wgmma tail list (wgmma_tail64) follows the 128-row tiles' bound.
  grow(tiles,
       std::max({max_tiles(P, w.E, SmallCfg::BM), decode_grid_tiles(P, w.E, int(T), w.Is > 0),
                 tail_tiles_at(P, w.E) + std::min(P, size_t(w.E))}) *
           sizeof(int2),
       "tiles");
  grow(num_tiles, 4 * sizeof(int), "num_tiles");  // + the warp-specialised GEMMs' tile counters (moe_wgmma.cu)
  // Buffers zeroed when (re)allocated, before any stream of the caller can use them (the legacy stream is not
  // ordered with those).
  auto grow_zeroed = [&](Buf& b, size_t bytes, const char* name) {
    if (!grow(b, bytes, name)) return;
    check_cuda(cudaMemsetAsync(b.p, 0, b.bytes, cudaStreamLegacy), std::string("MoeWorkspace: zero ") + name);
    check_cuda(cudaStreamSynchronize(cudaStreamLegacy), std::string("MoeWorkspace: zero ") + name);
  };
  grow_zeroed(route_ticket, sizeof(int), "route_ticket");  // zero at launch, and each launch leaves it zero
  {
    // The single-kernel decode routings' tiles, every T <= kSmallT up to max_tokens (zeroed: the decode GEMMs' blocks
    // past the tile count read their entry before they exit); grown whatever HYPIC_MOE_DECODE_TILE_INFO says (a few
    // KB), so that the switch may change between reserve and moe_forward.
    const size_t Td = std::min(T, size_t(kSmallT));
    grow_zeroed(dec_tiles, decode_grid_tiles(Td * k, w.E, int(Td), w.Is > 0) * sizeof(int4), "dec_tiles");
  }
  grow(sorted_tok, P * sizeof(int), "sorted_tok");
  grow(pos_of, P * sizeof(int), "pos_of");
  grow(act, P * size_t(w.I) * sizeof(bf16), "act");
  grow(y, P * size_t(w.H) * sizeof(bf16), "y");
  if (w.Is > 0) {
    grow(s_gu, T * 2 * size_t(w.Is) * sizeof(bf16), "s_gu");
    grow(s_act, T * size_t(w.Is) * sizeof(bf16), "s_act");
    grow(s_out, T * size_t(w.H) * sizeof(float), "s_out");
  }
}

void MoeWorkspace::reserve_mlp(int max_tokens, int H, int I) {
  if (max_tokens < 0) bad_arg("MoeWorkspace::reserve_mlp", "max_tokens = " + std::to_string(max_tokens));
  if (H <= 0 || H % 64) bad_arg("MoeWorkspace::reserve_mlp", "H = " + std::to_string(H) + " is not a positive multiple of 64");
  if (I <= 0 || I % 32) bad_arg("MoeWorkspace::reserve_mlp", "I = " + std::to_string(I) + " is not a positive multiple of 32");
  const size_t T = size_t(std::max(max_tokens, 1));
  grow(mlp_gu, T * 2 * size_t(I) * sizeof(bf16), "mlp_gu");
  grow(mlp_act, T * size_t(I) * sizeof(bf16), "mlp_act");
}

// ---------------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------------

bool moe_wgmma_available() {
#if HYPIC_MOE_WGMMA_BUILT
  return wgmma_env_mode() != 0 && wgmma_device();
#else
  return false;
#endif
}

uint64_t moe_persistent_launches() {
#if HYPIC_MOE_WGMMA_BUILT
  return moe_detail::persistent_launches();
#else
  return 0;
#endif
}

uint64_t moe_warp_specialized_launches() {
#if HYPIC_MOE_WGMMA_BUILT
  return moe_detail::ws_launches();
#else
  return 0;
#endif
}

uint64_t moe_cluster_pair_launches() {
#if HYPIC_MOE_WGMMA_BUILT
  return moe_detail::pair_launches();
#else
  return 0;
#endif
}

uint64_t moe_swap_ab_launches() {
#if HYPIC_MOE_WGMMA_BUILT
  return moe_detail::swap_launches();
#else
  return 0;
#endif
}

uint64_t moe_swap_ab_5d_launches() {
#if HYPIC_MOE_WGMMA_BUILT
  return moe_detail::swap_5d_launches();
#else
  return 0;
#endif
}

void silu_mul(int T, int I, const bf16* gu, bf16* act, cudaStream_t stream) {
  if (T < 0) bad_arg("silu_mul", "T = " + std::to_string(T));
  if (I <= 0 || I % 8) bad_arg("silu_mul", "I = " + std::to_string(I) + " is not a positive multiple of 8");
  if (T == 0) return;
  if (!gu || !act) bad_arg("silu_mul", "null pointer");
  if (!aligned16(gu) || !aligned16(act)) bad_arg("silu_mul", "pointers must be 16-byte aligned");
  const size_t total = size_t(T) * (I / 8);
  const unsigned blocks = unsigned(std::min<size_t>((total + 255) / 256, 65535 * 4));
  silu_mul_kernel<<<blocks, 256, 0, stream>>>(T, I, gu, act);
  check_cuda(cudaGetLastError(), "silu_mul launch");
}

void moe_forward(int T, const bf16* x, const MoeWeightsView& w, float* out, MoeWorkspace& ws, GemmRunner& gemm,
                 GroupedGemm impl, cudaStream_t stream, const MoeNextNorm* next) {
  constexpr const char* fn = "moe_forward";
  if (T < 0) bad_arg(fn, "T = " + std::to_string(T));
  validate_view(fn, w);
  if (next && (!next->w || !next->y)) bad_arg(fn, "next norm: null weight or output");
  if (next && (reinterpret_cast<uintptr_t>(next->w) % 4 || reinterpret_cast<uintptr_t>(next->y) % 4))
    bad_arg(fn, "next norm: weight and output must be 4-byte aligned");
  if (T == 0) return;
  if (!x || !out) bad_arg(fn, "null x or out");
  if (!aligned16(x) || !aligned16(out)) bad_arg(fn, "x and out must be 16-byte aligned");
  if (size_t(T) * w.topk > size_t(INT_MAX) / 2) bad_arg(fn, "T * topk too large");
  const int E = w.E, H = w.H, k = w.topk;
  const size_t P = size_t(T) * k;
  const int nch = (T + kChunk - 1) / kChunk;

  g_setup.run(current_device(), setup_device);
  {
    CaptureFlag cap(ws, stream);
    ws.reserve(T, w);
  }
  // Decode path: weight-streaming GEMMs with the shared expert as one more tile expert, PDL launches,
  // and for T <= kSmallT the whole routing in one block.
  const bool decode = impl == GroupedGemm::OwnDecode || (impl == GroupedGemm::Own && T <= kSmallT);
  const bool swap = impl == GroupedGemm::OwnWgmma && own_wgmma_swap(w, P);  // (the swap-AB kernels, kSwapBM rows)
  int bm;
  switch (impl) {
    case GroupedGemm::OwnSmallM: bm = SmallCfg::BM; break;
    case GroupedGemm::OwnLargeM: bm = BigCfg::BM; break;
    case GroupedGemm::OwnWgmma: bm = swap ? kSwapBM : own_wgmma_bm(w, P); break;
    case GroupedGemm::OwnLargeN: bm = WideCfg::BM; break;
    case GroupedGemm::OwnDecode: bm = kDecBM; break;
    case GroupedGemm::Own:
      bm = decode ? kDecBM
                  : (P <= size_t(16) * std::min<size_t>(size_t(E), P)) ? SmallCfg::BM : BigCfg::BM;
      break;
    case GroupedGemm::Cublas: bm = BigCfg::BM; break;
    default: bad_arg(fn, "unknown GroupedGemm value");
  }
  const int shared_rows = (decode && w.Is > 0) ? T : 0;
  const bool tail64 = !decode && !swap && wgmma_tail64(impl, w, P, bm);  // (wgmma_runs: OwnWgmma or Own only)

  float* logits = static_cast<float*>(ws.logits.p);
  int* topk_e = static_cast<int*>(ws.topk_e.p);
  float* topk_w = static_cast<float*>(ws.topk_w.p);
  float* sgate = static_cast<float*>(ws.sgate.p);
  int* chunk_counts = static_cast<int*>(ws.chunk_counts.p);
  int* counts = static_cast<int*>(ws.counts.p);
  int* offsets = static_cast<int*>(ws.offsets.p);
  int* sorted_tok = static_cast<int*>(ws.sorted_tok.p);
  int* pos_of = static_cast<int*>(ws.pos_of.p);
  int2* tiles = static_cast<int2*>(ws.tiles.p);
  int* num_tiles = static_cast<int*>(ws.num_tiles.p);

  // 1. router logits (fp32 output).
  const DecodeLinearOutput router{w.router, E, logits, E};
  if (decode && decode_linear_supported(T, H, x, H, &router, 1)) {
    decode_linear(T, H, x, H, &router, 1, DecodeLinearEpilogue::StoreF32, stream);
  } else {
    gemm.linear(T, E, H, x, H, w.router, logits, CUDA_R_32F, E, 0.0f, stream);
  }
  static CandidateSwitch one_token_switch("HYPIC_ROUTE_ONE_TOKEN");
  static CandidateSwitch spread_switch("HYPIC_ROUTE_SPREAD");
  static CandidateSwitch sgate_early_switch("HYPIC_ROUTE_SGATE_EARLY");
  const RouteCfg rc = route_cfg(w);
  // The decode GEMMs' per-tile (expert, first row, expert offset, expert rows) from the single-kernel routings below
  // (HYPIC_MOE_DECODE_TILE_INFO; reserve grew dec_tiles for every T <= kSmallT it was asked for).
  static CandidateSwitch tile_info_switch("HYPIC_MOE_DECODE_TILE_INFO");
  int4* tile_info = decode && T <= kSmallT && tile_info_switch.on() ? static_cast<int4*>(ws.dec_tiles.p) : nullptr;
  const bool wide = E > 256;  // registers per lane of route_token: 16 above 256 experts, else 8
  if (decode && T == 1 && one_token_switch.on()) {
    // 2-3. the same for one token by two warps (route_one_kernel).
    auto* kern = rc.sigmoid ? (wide ? route_one_kernel<true, 16> : route_one_kernel<true, 8>)
                            : (wide ? route_one_kernel<false, 16> : route_one_kernel<false, 8>);
    launch_pdl(kern, dim3(1), dim3(64), 0, stream, "moe_forward: route_one launch", rc, logits, x, H, w.shared_gate,
               w.Is > 0 ? sgate : nullptr, topk_e, topk_w, offsets, tiles, num_tiles, sorted_tok, pos_of,
               shared_rows, tile_info, sgate_early_switch.on() ? 1 : 0);
  } else if (decode && T <= kSmallT) {
    // 2-3. softmax, top-k, shared gate, counting sort and tile schedule: one block, or (HYPIC_ROUTE_SPREAD) one warp
    // task per warp over up to kSmallBlocksMax blocks, the last of which sorts.
    const int tasks = w.Is > 0 ? 2 * T : T;
    const int nb = spread_switch.on() ? std::clamp((tasks + kMaxE / 32 - 1) / (kMaxE / 32), 1, kSmallBlocksMax) : 1;
    auto* kern = rc.sigmoid ? (wide ? route_small_kernel<true, 16> : route_small_kernel<true, 8>)
                            : (wide ? route_small_kernel<false, 16> : route_small_kernel<false, 8>);
    launch_pdl(kern, dim3(nb), dim3(kMaxE), 0, stream, "moe_forward: route_small launch", T, rc, logits, x, H,
               w.shared_gate, w.Is > 0 ? sgate : nullptr, topk_e, topk_w, offsets, tiles, num_tiles, sorted_tok, pos_of,
               shared_rows, static_cast<int*>(ws.route_ticket.p), tile_info);
  } else {
    // 2. softmax, top-k, shared gate, chunk histograms.
    check_cuda(cudaMemsetAsync(chunk_counts, 0, size_t(E) * nch * sizeof(int), stream), "moe_forward: chunk counts");
    auto* kern = rc.sigmoid ? (wide ? route_kernel<true, 16> : route_kernel<true, 8>)
                            : (wide ? route_kernel<false, 16> : route_kernel<false, 8>);
    kern<<<dim3(nch, kRouteBlocksPerChunk), kRouteThreads, 0, stream>>>(
        T, rc, logits, x, H, w.shared_gate, w.Is > 0 ? sgate : nullptr, topk_e, topk_w, chunk_counts, nch);
    check_cuda(cudaGetLastError(), "moe_forward: route launch");
    // 3. counting sort by expert and the tile schedule.
    chunk_scan_kernel<<<(E + 7) / 8, 256, 0, stream>>>(E, nch, chunk_counts, counts);
    check_cuda(cudaGetLastError(), "moe_forward: chunk_scan launch");
    offsets_kernel<<<1, kMaxE, 0, stream>>>(E, bm, counts, offsets, tiles, num_tiles, shared_rows,
                                            tail64 ? int(tail_tiles_at(P, E)) : -1);
    check_cuda(cudaGetLastError(), "moe_forward: offsets launch");
    scatter_kernel<<<nch, 256, 0, stream>>>(T, E, k, nch, topk_e, chunk_counts, offsets, sorted_tok, pos_of);
    check_cuda(cudaGetLastError(), "moe_forward: scatter launch");
  }
  // 4-5. routed experts (and, on the decode path, the shared expert).
  if (impl == GroupedGemm::Cublas) {
    launch_cublas_grouped(w, T, P, x, ws, stream);
  } else if (decode) {
    launch_decode(w, T, P, x, ws, tile_info, stream);
  } else if (bm == SmallCfg::BM) {
    launch_grouped<SmallCfg>(w, P, x, ws, stream);
  } else if (impl == GroupedGemm::OwnLargeN) {
    launch_grouped<WideCfg>(w, P, x, ws, stream);
  } else if (impl == GroupedGemm::OwnLargeM || !try_launch_wgmma(impl, w, P, x, ws, bm, tail64, swap, stream)) {
    if (bm != BigCfg::BM || tail64)  // own_wgmma_bm / wgmma_tail64 and try_launch_wgmma disagree
      throw std::logic_error("moe_forward: a " + std::to_string(bm) + "-row schedule" +
                             (tail64 ? " with tail tiles" : "") + " for the mma.sync tiles");
    launch_grouped<BigCfg>(w, P, x, ws, stream);  // (else: Own's prefill tiles / OwnWgmma ran on wgmma)
  }
  // 6. shared expert (cuBLASLt) unless the decode GEMMs ran it.
  const float* shared = nullptr;
  if (w.Is > 0) {
    const int Is = w.Is;
    float* s_out = static_cast<float*>(ws.s_out.p);
    if (!decode) {
      bf16* s_gu = static_cast<bf16*>(ws.s_gu.p);
      bf16* s_act = static_cast<bf16*>(ws.s_act.p);
      gemm.linear(T, 2 * Is, H, x, H, w.shared_gate_up, s_gu, CUDA_R_16BF, 2 * Is, 0.0f, stream);
      silu_mul(T, Is, s_gu, s_act, stream);
      gemm.linear(T, H, Is, s_act, Is, w.shared_down, s_out, CUDA_R_32F, H, 0.0f, stream);
    }
    shared = s_out;
  }
  // 7. deterministic combine into out (and the next layer's input norm: fused where enabled and the row fits).
  const bf16* y = static_cast<const bf16*>(ws.y.p);
  static CandidateSwitch fuse_next_norm("HYPIC_FUSE_NEXT_NORM");
  if (next && H <= kCombineNormMaxH && fuse_next_norm.on()) {
    auto kernel = next->zero_centred ? combine_norm_kernel<true> : combine_norm_kernel<false>;
    const int* po = pos_of;
    const float* tw = topk_w;
    const float* sg = sgate;
    if (decode) {
      launch_pdl(kernel, dim3(T), dim3(detail::kNormThreads), 0, stream, "moe_forward: combine + next norm launch", H,
                 k, po, tw, y, sg, shared, out, w.output_scale, next->w, next->eps, next->y);
    } else {
      kernel<<<T, detail::kNormThreads, 0, stream>>>(H, k, po, tw, y, sg, shared, out, w.output_scale, next->w,
                                                      next->eps, next->y);
      check_cuda(cudaGetLastError(), "moe_forward: combine + next norm launch");
    }
    return;
  }
  if (decode) {
    static CandidateSwitch combine_early("HYPIC_COMBINE_EARLY");  // (the decode GEMMs ran: launch_decode)
    launch_pdl(combine_early.on() ? combine_kernel<true> : combine_kernel<false>, dim3(T, (H + 511) / 512), dim3(128),
               0, stream, "moe_forward: combine launch", H, k, static_cast<const int*>(pos_of),
               static_cast<const float*>(topk_w), y, static_cast<const float*>(sgate), shared, out, w.output_scale);
  } else {
    combine_kernel<false><<<dim3(T, (H + 511) / 512), 128, 0, stream>>>(H, k, pos_of, topk_w, y, sgate, shared, out,
                                                                      w.output_scale);
    check_cuda(cudaGetLastError(), "moe_forward: combine launch");
  }
  if (next) rms_norm_residual(T, H, out, H, nullptr, next->w, next->eps, next->y, stream, next->zero_centred);
}

void mlp_forward(int T, const bf16* x, int H, int I, const bf16* gate_up, const bf16* down, float* out,
                 MoeWorkspace& ws, GemmRunner& gemm, cudaStream_t stream) {
  constexpr const char* fn = "mlp_forward";
  if (T < 0) bad_arg(fn, "T = " + std::to_string(T));
  if (H <= 0 || H % 64) bad_arg(fn, "H = " + std::to_string(H) + " is not a positive multiple of 64");
  if (I <= 0 || I % 32) bad_arg(fn, "I = " + std::to_string(I) + " is not a positive multiple of 32");
  if (T == 0) return;
  if (!x || !gate_up || !down || !out) bad_arg(fn, "null pointer");
  {
    CaptureFlag cap(ws, stream);
    ws.reserve_mlp(T, H, I);
  }
  bf16* gu = static_cast<bf16*>(ws.mlp_gu.p);
  bf16* act = static_cast<bf16*>(ws.mlp_act.p);
  gemm.linear(T, 2 * I, H, x, H, gate_up, gu, CUDA_R_16BF, 2 * I, 0.0f, stream);
  silu_mul(T, I, gu, act, stream);
  gemm.linear(T, H, I, act, I, down, out, CUDA_R_32F, H, 1.0f, stream);
}

}  // namespace hypic::kernels::cuda
