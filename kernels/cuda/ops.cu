// Elementwise building blocks of the CUDA forward pass (contracts in ops.h).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kernels/cuda/chain_tile.cuh"
#include "kernels/cuda/chain_wgmma.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/fold.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/row_norm.cuh"
#include "kernels/cuda/switches.h"

namespace hypic::kernels::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int D = 128;  // state head size of the affine chain

int blocks_for(long work, int threads) {
  return static_cast<int>(std::min<long>((work + threads - 1) / threads, 1L << 20));
}

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

__global__ void embed_gather_kernel(int T, int H, const int32_t* __restrict__ ids, const bf16* __restrict__ embed,
                                    float* __restrict__ x) {
  const long total = long(T) * (H / 2);
  for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < total; i += long(gridDim.x) * blockDim.x) {
    const long t = i / (H / 2), c = (i % (H / 2)) * 2;
    const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(embed + long(ids[t]) * H + c);
    *reinterpret_cast<float2*>(x + t * H + c) = __bfloat1622float2(v);
  }
}

// One block per row: a decode step normalises one row per request, so the row's loads are spread over the block's
// threads (one round trip, not a warp's 16 chunks). The order of the sums and the arithmetic: row_norm.cuh (shared
// with the MoE combine's fused next-layer norm, so both give the same bits).
using detail::kNormThreads;
// kPost: x is also written (post-norm residual), so its loads may not take the read-only path.
template <bool kZeroCentred, bool kPost>
__global__ void __launch_bounds__(kNormThreads) rms_norm_residual_kernel(int rows, int dim, float* x,
                                                                         long ldx, const int* __restrict__ rows_index,
                                                                         const bf16* __restrict__ w, float eps,
                                                                         bf16* __restrict__ y, float post_alpha) {
  auto load4 = [](const float* p) {
    // (ld.global.ca, not the read-only path: under HYPIC_DECODE_PDL_MIXERS the kernel is resident while its
    // predecessor writes x; the second pass still finds the row in L1, as stream_gemm.cuh reads x)
    return kPost ? *reinterpret_cast<const float4*>(p) : __ldca(reinterpret_cast<const float4*>(p));
  };
  // The next kernel of a decode step (a weight-streaming projection launched with PDL) may start its weight loads
  // now; it reads y only after its griddep_wait (kernels/cuda/pdl.cuh). Under HYPIC_DECODE_PDL_MIXERS this kernel is
  // a PDL launch itself: x comes from the kernel before.
  detail::griddep_launch_dependents();
  detail::griddep_wait();
  __shared__ float part[kNormThreads / 32];
  const int r = blockIdx.x, tid = threadIdx.x;
  float* xr = x + long(rows_index ? rows_index[r] : r) * ldx;
  float ss = 0.f;
  for (int c = tid * 4; c < dim; c += kNormThreads * 4) ss = detail::norm_add_sq4(ss, load4(xr + c));
  const float inv = detail::norm_block_inv(ss, part, dim, eps);
  bf16* yr = y + long(r) * dim;
  for (int c = tid * 4; c < dim; c += kNormThreads * 4) {
    const float4 n = detail::norm_apply4<kZeroCentred>(load4(xr + c), inv, w, yr, c);
    if (kPost)  // post-norm residual: x <- alpha * norm(x), in fp32 (this thread's own elements)
      *reinterpret_cast<float4*>(xr + c) = make_float4(post_alpha * n.x, post_alpha * n.y, post_alpha * n.z, post_alpha * n.w);
  }
}

// Argmax of one row (ops.h argmax_rows): each thread scans its elements in ascending index (strict > keeps the lowest
// index of equal values; the first element a thread sees seeds it, so an all -inf row gives its lowest index), then
// (value, index) pairs combine by the larger value, ties to the lower index, and the first NaN's index by min.
struct ArgmaxPick {
  float v;
  int i, nan;  // best index (INT_MAX: none seen), lowest NaN index (INT_MAX: none)
};
__device__ __forceinline__ void argmax_see(ArgmaxPick& p, float v, int i) {
  if (isnan(v) && p.nan == INT_MAX) p.nan = i;
  if (v > p.v || p.i == INT_MAX) p.v = v, p.i = i;
}
__device__ __forceinline__ void argmax_merge(ArgmaxPick& p, const ArgmaxPick& o) {
  if (o.v > p.v || (o.v == p.v && o.i < p.i)) p.v = o.v, p.i = o.i;
  p.nan = min(p.nan, o.nan);
}
// The block's pick into `*out` (thread 0's copy; every thread of the block calls this).
template <int kThreads>
__device__ __forceinline__ void argmax_block(ArgmaxPick p, ArgmaxPick* warp_picks, ArgmaxPick* out) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const ArgmaxPick o{__shfl_down_sync(0xffffffffu, p.v, off), __shfl_down_sync(0xffffffffu, p.i, off),
                       __shfl_down_sync(0xffffffffu, p.nan, off)};
    argmax_merge(p, o);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warp_picks[warp] = p;
  __syncthreads();
  if (threadIdx.x == 0) {
    ArgmaxPick b = warp_picks[0];
    for (int w = 1; w < kThreads / 32; ++w) argmax_merge(b, warp_picks[w]);  // warps in index order
    *out = b;
  }
}

// One block per row (HYPIC_ARGMAX_CLUSTER=0): thread t takes elements t, t + 1024, ...
constexpr int kArgmaxThreads = 1024;
__global__ void __launch_bounds__(kArgmaxThreads) argmax_rows_kernel(int V, const float* __restrict__ x, long ldx,
                                                                     int32_t* __restrict__ out) {
  __shared__ ArgmaxPick warp_picks[kArgmaxThreads / 32];
  __shared__ ArgmaxPick pick;
  const float* xr = x + long(blockIdx.x) * ldx;
  ArgmaxPick p{-INFINITY, INT_MAX, INT_MAX};
  for (int i = threadIdx.x; i < V; i += kArgmaxThreads) argmax_see(p, xr[i], i);
  argmax_block<kArgmaxThreads>(p, warp_picks, &pick);
  if (threadIdx.x == 0) out[blockIdx.x] = pick.nan != INT_MAX ? -1 - pick.nan : pick.i;
}

// HYPIC_ARGMAX_CLUSTER: a cluster of kArgmaxCluster blocks per row (blockIdx.x / kArgmaxCluster), block rank r taking
// the contiguous slice [r per, (r + 1) per) of the row (per a multiple of 4: 16-byte loads where the row is 16-byte
// aligned), so that a 248k-entry row is read by 8 SMs instead of one; rank 0 merges the blocks' picks from their
// shared memory (distributed shared memory, in rank order: lower ranks hold lower indices).
constexpr int kArgmaxCluster = 8;
constexpr int kArgmaxClusterThreads = 512;
__global__ void __cluster_dims__(kArgmaxCluster, 1, 1) __launch_bounds__(kArgmaxClusterThreads)
    argmax_rows_cluster_kernel(int V, const float* __restrict__ x, long ldx, int32_t* __restrict__ out) {
  __shared__ ArgmaxPick warp_picks[kArgmaxClusterThreads / 32];
  __shared__ ArgmaxPick pick;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const long row = long(blockIdx.x) / kArgmaxCluster;
  const float* xr = x + row * ldx;
  const int per = ((V + kArgmaxCluster - 1) / kArgmaxCluster + 3) & ~3;
  const int lo = min(V, rank * per), hi = min(V, lo + per);
  ArgmaxPick p{-INFINITY, INT_MAX, INT_MAX};
  int i = lo + int(threadIdx.x);
  if ((reinterpret_cast<uintptr_t>(xr) & 15) == 0) {  // lo is a multiple of 4: 16-byte aligned too
    const int n4 = (hi - lo) >> 2;
    const float4* x4 = reinterpret_cast<const float4*>(xr + lo);
#pragma unroll 4
    for (int j = threadIdx.x; j < n4; j += kArgmaxClusterThreads) {
      const float4 f = x4[j];
      const int e = lo + 4 * j;
      argmax_see(p, f.x, e), argmax_see(p, f.y, e + 1), argmax_see(p, f.z, e + 2), argmax_see(p, f.w, e + 3);
    }
    i = lo + 4 * n4 + int(threadIdx.x);  // the slice's last 0..3 elements (the row's end)
  }
  for (; i < hi; i += kArgmaxClusterThreads) argmax_see(p, xr[i], i);
  argmax_block<kArgmaxClusterThreads>(p, warp_picks, &pick);
  cluster.sync();  // every block's pick written and visible to the cluster
  if (rank == 0 && threadIdx.x == 0) {
    ArgmaxPick b = pick;
    for (int r = 1; r < kArgmaxCluster; ++r) argmax_merge(b, *cluster.map_shared_rank(&pick, r));
    out[row] = b.nan != INT_MAX ? -1 - b.nan : b.i;
  }
  cluster.sync();  // the other blocks' shared memory stays until rank 0 has read it
}

template <NormGate kGate>
__global__ void rms_norm_gated_kernel(int rows, int dim, const bf16* x, const bf16* z,
                                      const bf16* __restrict__ w, int w_rows, float eps, bf16* y) {
  detail::griddep_launch_dependents();  // as rms_norm_residual_kernel
  detail::griddep_wait();
  const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (r >= rows) return;
  detail::gated_norm_row_warp<kGate == NormGate::Silu>(
      x + long(r) * dim, z + long(r) * dim, w + long(r % w_rows) * dim, dim, eps, y + long(r) * dim, lane,
      [](const bf16* p) { return *reinterpret_cast<const __nv_bfloat162*>(p); });
}

// Affine chain: one block per (chain, head, BN-column block); the 128 x BN running block stays in shared memory
// across the chain's steps. Thread (rg, cg) owns columns 4 cg .. 4 cg + 3 of rows rg + RG r. Each step's T streams by
// cp.async into one of two shared buffers while the previous step computes, and the step's S rows are loaded before
// its product (measured side by side on the H200, 2026-12-04: a warm 16 x 2k Qwen3.5 splice's device time 40.0 ms
// against 40.9 ms with T loaded at the start of each step; the steps are bound by the fp32 product itself).
constexpr int kBN = 32, kLdT = D + 4, kLdR = kBN + 4;
constexpr int kLowRank = detail::kChainLowRankSmemFloats;  // floats of a low-rank step's staging (chain_low_rank_step)
constexpr int kChainSmem = (2 * D * kLdT + D * kLdR) * 4, kChainSmemLowRank = kChainSmem + kLowRank * 4;

// Step T's head h (fp32 [heads][128][128], nullptr: nothing to load) into shared memory at dst (row stride kLdT) by
// cp.async, 256 threads; the caller commits and waits.
__device__ __forceinline__ void chain_load_T(const float* T, int h, int tid, float* dst) {
  if (!T) return;
  T += size_t(h) * D * D;
  for (int i = tid; i < D * D / 4; i += 256) {
    const int row = i >> 5, col = (i & 31) * 4;
    detail::cp_async16(dst + row * kLdT + col, T + row * D + col);
  }
}

// LR: the chain has low-rank steps (their shared memory and code; without, a step with lr_len > 0 traps).
template <bool LR>
__global__ void __launch_bounds__(256) affine_chain_kernel(int heads, int steps_per_chain,
                                                           const AffineStep* __restrict__ steps,
                                                           const float* const* __restrict__ init,
                                                           float* const* __restrict__ final_states,
                                                           ChainLowRankFactors lr) {
  constexpr int CG = kBN / 4, RG = 256 / CG, RPT = D / RG;
  extern __shared__ __align__(16) float chain_smem[];
  float* sTbuf[2] = {chain_smem, chain_smem + D * kLdT};
  float* sR = chain_smem + 2 * D * kLdT;
  float* sLr = sR + D * kLdR;
  const int c = blockIdx.x / (D / kBN), h = blockIdx.y, c0 = (blockIdx.x % (D / kBN)) * kBN, tid = threadIdx.x;
  const int rg = tid / CG, cg = tid % CG;
  const size_t head_off = size_t(h) * D * D + c0;
  const AffineStep* chain = steps + size_t(c) * steps_per_chain;
  auto load_T = [&](int s, float* dst) { chain_load_T(chain[s].T, h, tid, dst); };
  if (steps_per_chain > 0) load_T(0, sTbuf[0]);
  detail::cp_async_commit();
  const float* R0 = init ? init[c] : nullptr;
  for (int i = tid; i < D * CG; i += 256) {
    const int row = i / CG, col = (i % CG) * 4;
    const float4 v = R0 ? *reinterpret_cast<const float4*>(R0 + head_off + size_t(row) * D + col)
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    *reinterpret_cast<float4*>(sR + row * kLdR + col) = v;
  }
  for (int s = 0; s < steps_per_chain; ++s) {
    const AffineStep st = chain[s];
    const float* sT = sTbuf[s & 1];
    if (s + 1 < steps_per_chain) load_T(s + 1, sTbuf[(s + 1) & 1]);  // read by step s - 1: past its last barrier
    detail::cp_async_commit();
    float4 sv[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r)
      sv[r] = st.S ? __ldcg(reinterpret_cast<const float4*>(st.S + head_off + size_t(rg + RG * r) * D + 4 * cg))
                   : make_float4(0.f, 0.f, 0.f, 0.f);
    float acc[RPT][4];
#pragma unroll
    for (int r = 0; r < RPT; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;
    detail::cp_async_wait<1>();  // this step's T
    __syncthreads();             // ... and sR of the previous step, visible to every thread
    if (!LR && st.lr_len > 0) __trap();  // (a low-rank step in a chain given no factors: affine_chain documents it)
    if (LR && st.lr_len > 0) {           // a low-rank step, on sR in place (ends with a barrier)
      detail::chain_low_rank_step(sR, kLdR, sLr, c0, h, lr, st, tid);
      if (st.out)
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
          const int row = rg + RG * r;
          *reinterpret_cast<float4*>(st.out + head_off + size_t(row) * D + 4 * cg) =
              *reinterpret_cast<const float4*>(sR + row * kLdR + 4 * cg);
        }
      continue;
    }
    if (st.T) {
      detail::fold_rows<RPT, RG>(sT, kLdT, sR, kLdR, rg, cg, acc);
    } else {
#pragma unroll
      for (int r = 0; r < RPT; ++r) {
        const float4 v = *reinterpret_cast<const float4*>(sR + (rg + RG * r) * kLdR + 4 * cg);
        acc[r][0] = v.x, acc[r][1] = v.y, acc[r][2] = v.z, acc[r][3] = v.w;
      }
    }
    __syncthreads();  // every thread has read sR (and sT) before it is overwritten
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const int row = rg + RG * r;
      const float4 o = make_float4(fmaf(st.alpha, acc[r][0], sv[r].x), fmaf(st.alpha, acc[r][1], sv[r].y),
                                   fmaf(st.alpha, acc[r][2], sv[r].z), fmaf(st.alpha, acc[r][3], sv[r].w));
      *reinterpret_cast<float4*>(sR + row * kLdR + 4 * cg) = o;
      if (st.out) *reinterpret_cast<float4*>(st.out + head_off + size_t(row) * D + 4 * cg) = o;
    }
  }
  detail::cp_async_wait<0>();
  __syncthreads();
  float* F = final_states ? final_states[c] : nullptr;
  if (F) {
    for (int i = tid; i < D * CG; i += 256) {
      const int row = i / CG, col = (i % CG) * 4;
      *reinterpret_cast<float4*>(F + head_off + size_t(row) * D + col) =
          *reinterpret_cast<const float4*>(sR + row * kLdR + col);
    }
  }
}

// Affine chain on the tensor cores, 3xTF32 (the fp32-accurate split of CUTLASS's "fast accurate" TF32 GEMMs): each
// fp32 operand x = hi + lo (detail::split_tf32); T R = T_hi R_hi + (T_lo R_hi + T_hi R_lo) (the dropped T_lo R_lo
// and the truncation of lo are ~2^-22 relative, the size of fp32's own 128-term rounding), fp32
// accumulation in mma.sync m16n8k8, the main product and each correction in its own accumulator (12 independent
// mma per k step and warp). One block per (chain, head, 32-column block) as affine_chain_kernel; warp w owns rows
// 16 w .. 16 w + 15 and all 32 columns (four 16 x 8 accumulator tiles). The running block R stays in the warps'
// registers (fp32, accumulator layout); its tf32 hi / lo copy, transposed ([column][k]), and the step's T split into
// hi / lo ([row][k]) sit in shared memory (row stride 132 words: every 8-row ldmatrix phase conflict-free), and
// every fragment comes by ldmatrix.x4 (on 32-bit words: lane l gets word l % 4 of row l / 4 of each 8 x 4 block,
// the tf32 A / B fragment layout). The next step's T is read into registers while this step multiplies, then split
// into the (single) T buffers between the step's two barriers.
constexpr int kLdS = D + 4;                         // row stride (words) of the split T and R^T copies
// T hi, T lo [128][132]; R^T hi, lo [32][132]; with low-rank steps also an fp32 copy of R [128][kLdR] and their
// staging.
constexpr int kChainTcSmem = (2 * D + 2 * kBN) * kLdS * 4;
constexpr int kLdRf = kBN + 8;  // low-rank steps: R in fp32 [128][kLdRf] (the tile's float2 stores conflict-free)
constexpr int kChainTcSmemLowRank = kChainTcSmem + (D * kLdRf + kLowRank) * 4;
constexpr int kTVec = D * D / 4 / 256;               // float4 of T per thread

template <bool LR>  // as affine_chain_kernel's
__global__ void __launch_bounds__(256, 1) affine_chain_tc_kernel(int heads, int steps_per_chain,
                                                                 const AffineStep* __restrict__ steps,
                                                                 const float* const* __restrict__ init,
                                                                 float* const* __restrict__ final_states,
                                                                 ChainLowRankFactors lr) {
  constexpr int NT = kBN / 8;  // accumulator tiles per warp
  extern __shared__ __align__(16) uint32_t chain_words[];
  uint32_t* sTh = chain_words;
  uint32_t* sTl = sTh + D * kLdS;
  uint32_t* sRh = sTl + D * kLdS;  // R^T: [column][k]
  uint32_t* sRl = sRh + kBN * kLdS;
  float* sRf = reinterpret_cast<float*>(sRl + kBN * kLdS);  // low-rank steps: R in fp32 [128][kLdRf], the staging
  float* sLr = sRf + D * kLdRf;
  const int c = blockIdx.x / (D / kBN), h = blockIdx.y, c0 = (blockIdx.x % (D / kBN)) * kBN, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3, m0 = warp * 16;
  const int mi = lane >> 3, r8 = lane & 7;  // ldmatrix: this lane's row address is row r8 of 8 x 4 block mi
  const detail::ChainTile<NT> tile(h, c0, warp, lane);
  const AffineStep* chain = steps + size_t(c) * steps_per_chain;
  float4 tv[kTVec];
  auto fetch_T = [&](const float* T) {  // T's head h into registers (thread: rows i >> 5, 4 columns, i = tid + 256 j)
    if (!T) return;
    T += size_t(h) * D * D;
#pragma unroll
    for (int j = 0; j < kTVec; ++j) tv[j] = __ldg(reinterpret_cast<const float4*>(T) + tid + 256 * j);
  };
  auto store_T = [&] {  // the fetched T, split
#pragma unroll
    for (int j = 0; j < kTVec; ++j) {
      const int i = tid + 256 * j, o = (i >> 5) * kLdS + (i & 31) * 4;
      const float x[4] = {tv[j].x, tv[j].y, tv[j].z, tv[j].w};
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) detail::split_tf32(x[e], hi[e], lo[e]);
      *reinterpret_cast<uint4*>(sTh + o) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      *reinterpret_cast<uint4*>(sTl + o) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
  };
  auto store_R = [&](const float (&r)[NT][4]) {  // R -> its transposed tf32 hi / lo copy (each lane its elements)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int o = (8 * n + 2 * t + (i & 1)) * kLdS + m0 + g + 8 * (i >> 1);
        detail::split_tf32(r[n][i], sRh[o], sRl[o]);
      }
  };
  float cur[NT][4];
  tile.load(cur, init ? init[c] : nullptr);
  AffineStep st = steps_per_chain > 0 ? chain[0] : AffineStep{};
  if (st.T) {
    fetch_T(st.T);
    store_T();
  }
  store_R(cur);
  __syncthreads();
  for (int s = 0; s < steps_per_chain; ++s) {
    const AffineStep next = s + 1 < steps_per_chain ? chain[s + 1] : AffineStep{};  // (its pointers in hand early)
    const float* next_T = next.T;
    fetch_T(next_T);  // lands while this step multiplies
    float2 sv[NT][2];
    tile.load_S(sv, st.S);
    float acc[NT][4], cor[NT][4], cor2[NT][4];
    if (!LR && st.lr_len > 0) __trap();  // (a low-rank step in a chain given no factors: affine_chain documents it)
    if (LR && st.lr_len > 0) {  // a low-rank step on an fp32 copy of the block (the previous step's barrier is behind)
      tile.to_smem(cur, sRf, kLdRf);
      detail::chain_low_rank_step(sRf, kLdRf, sLr, c0, h, lr, st, tid);
      tile.from_smem(cur, sRf, kLdRf);
      tile.store(cur, st.out);
    } else if (st.T) {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = cor[n][i] = cor2[n][i] = 0.f;
      const uint32_t* aH = sTh + (m0 + r8 + 8 * (mi & 1)) * kLdS + 4 * (mi >> 1);
      const uint32_t* aL = aH + D * kLdS;
      const uint32_t* bH = sRh + (r8 + 8 * (mi >> 1)) * kLdS + 4 * (mi & 1);
      const uint32_t* bL = bH + kBN * kLdS;
      // Fragments of k step kk + 1 load while step kk multiplies (double-buffered registers).
      uint32_t ah[2][4], al[2][4], bh[2][NT / 2][4], bl[2][NT / 2][4];
      auto load_frags = [&](int buf, int k0) {
        detail::ldsm_x4(ah[buf], aH + k0);
        detail::ldsm_x4(al[buf], aL + k0);
#pragma unroll
        for (int p = 0; p < NT / 2; ++p) {
          detail::ldsm_x4(bh[buf][p], bH + 16 * p * kLdS + k0);
          detail::ldsm_x4(bl[buf][p], bL + 16 * p * kLdS + k0);
        }
      };
      load_frags(0, 0);
#pragma unroll
      for (int kk = 0; kk < D / 8; ++kk) {
        const int cb = kk & 1;
        if (kk + 1 < D / 8) load_frags(cb ^ 1, 8 * (kk + 1));
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const uint32_t* h2 = &bh[cb][n >> 1][2 * (n & 1)];
          const uint32_t* l2 = &bl[cb][n >> 1][2 * (n & 1)];
          detail::mma_tf32(cor[n], al[cb], h2[0], h2[1]);
          detail::mma_tf32(cor2[n], ah[cb], l2[0], l2[1]);
          detail::mma_tf32(acc[n], ah[cb], h2[0], h2[1]);
        }
      }
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] += cor[n][i] + cor2[n][i];
    } else {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = cur[n][i];
    }
    if (!(LR && st.lr_len > 0)) tile.step(cur, acc, sv, st.alpha, st.out);
    if (s + 1 < steps_per_chain) {
      __syncthreads();  // every warp has read this step's T and R copies
      if (next_T) store_T();
      store_R(cur);
      __syncthreads();
    }
    st = next;
  }
  tile.store(cur, final_states ? final_states[c] : nullptr);
}

__global__ void fp32_to_bf16_kernel(long n, const float* __restrict__ x, bf16* __restrict__ y) {
  for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < n; i += long(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16_rn(x[i]);
}
__global__ void bf16_to_fp32_kernel(long n, const bf16* __restrict__ x, float* __restrict__ y) {
  for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < n; i += long(gridDim.x) * blockDim.x)
    y[i] = __bfloat162float(x[i]);
}

__global__ void gather_rows_kernel(int n, int row_elems, const bf16* __restrict__ src, const int* __restrict__ rows,
                                   bf16* __restrict__ dst) {
  if (row_elems % 8 == 0) {
    const int R8 = row_elems / 8;
    const long total = long(n) * R8;
    for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < total; i += long(gridDim.x) * blockDim.x) {
      const long r = i / R8, c = (i % R8) * 8;
      *reinterpret_cast<uint4*>(dst + r * row_elems + c) =
          *reinterpret_cast<const uint4*>(src + long(rows[r]) * row_elems + c);
    }
  } else {
    const int R2 = row_elems / 2;
    const long total = long(n) * R2;
    for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < total; i += long(gridDim.x) * blockDim.x) {
      const long r = i / R2, c = (i % R2) * 2;
      *reinterpret_cast<__nv_bfloat162*>(dst + r * row_elems + c) =
          *reinterpret_cast<const __nv_bfloat162*>(src + long(rows[r]) * row_elems + c);
    }
  }
}

// Blocks (d, y): descriptor d (grid-strided over descriptors when there are many), its y-th share of the bytes
// (gridDim.y blocks per descriptor, so that a few large copies, e.g. one request's recurrent states, use the GPU).
__global__ void batched_copy_kernel(int n, const CopyDesc* __restrict__ descs) {
  const long lane = long(blockIdx.y) * blockDim.x + threadIdx.x, step = long(gridDim.y) * blockDim.x;
  for (int d = blockIdx.x; d < n; d += gridDim.x) {
    const CopyDesc c = descs[d];
    const bool fast = ((reinterpret_cast<uintptr_t>(c.src) | reinterpret_cast<uintptr_t>(c.dst) | uintptr_t(c.bytes)) &
                       15) == 0;
    if (fast) {
      const uint4* s = static_cast<const uint4*>(c.src);
      uint4* t = static_cast<uint4*>(c.dst);
      for (long i = lane; i < c.bytes / 16; i += step) t[i] = s[i];
    } else {
      const uint32_t* s = static_cast<const uint32_t*>(c.src);
      uint32_t* t = static_cast<uint32_t*>(c.dst);
      for (long i = lane; i < c.bytes / 4; i += step) t[i] = s[i];
    }
  }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void fill_random_kernel(long n, RandomFill kind, float a, float b, uint64_t seed, uint64_t stream_id,
                                   bf16* __restrict__ yb, float* __restrict__ yf) {
  const uint64_t base = splitmix64(seed ^ splitmix64(stream_id + 0x632BE59BD9B4E019ull));
  for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < n; i += long(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(base + uint64_t(i));
    const float u1 = (float((r >> 40) & 0xFFFFFF) + 0.5f) * (1.f / 16777216.f);  // (0, 1)
    const float u2 = float((r >> 16) & 0xFFFFFF) * (1.f / 16777216.f);          // [0, 1)
    float v;
    switch (kind) {
      case RandomFill::Normal: v = a + b * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2); break;
      case RandomFill::Uniform: v = (a - b) + 2.f * b * u2; break;
      case RandomFill::LogUniform: v = logf(a + (b - a) * u2); break;
      default: v = a; break;
    }
    if (yb) yb[i] = __float2bfloat16_rn(v);
    else yf[i] = v;
  }
}

}  // namespace

void embed_gather(int T, int H, const int32_t* ids, const bf16* embed, float* x, cudaStream_t stream) {
  need(T >= 0 && H > 0 && H % 2 == 0, "embed_gather: T must be >= 0 and H a positive even number, got T=" +
                                          std::to_string(T) + " H=" + std::to_string(H));
  if (T == 0) return;
  need(ids && embed && x, "embed_gather: null pointer");
  embed_gather_kernel<<<blocks_for(long(T) * H / 2, 256), 256, 0, stream>>>(T, H, ids, embed, x);
  check_cuda(cudaGetLastError(), "embed_gather launch");
}

void argmax_rows(int rows, int V, const float* x, long ldx, int32_t* out, cudaStream_t stream) {
  need(rows >= 0 && V > 0 && ldx >= V, "argmax_rows: need rows >= 0, V > 0 and ldx >= V; got rows=" +
                                           std::to_string(rows) + " V=" + std::to_string(V) + " ldx=" +
                                           std::to_string(ldx));
  if (rows == 0) return;
  need(x && out, "argmax_rows: null pointer");
  static CandidateSwitch cluster("HYPIC_ARGMAX_CLUSTER");
  if (cluster.on() && long(rows) * kArgmaxCluster <= INT_MAX)
    argmax_rows_cluster_kernel<<<unsigned(rows) * kArgmaxCluster, kArgmaxClusterThreads, 0, stream>>>(V, x, ldx, out);
  else
    argmax_rows_kernel<<<rows, kArgmaxThreads, 0, stream>>>(V, x, ldx, out);
  check_cuda(cudaGetLastError(), "argmax_rows launch");
}

void rms_norm_residual(int rows, int dim, const float* x, long ldx, const int* rows_index, const bf16* w, float eps,
                       bf16* y, cudaStream_t stream, bool zero_centred, float post_alpha, float* x_out) {
  need(post_alpha == 0.f || (x_out == x && rows_index == nullptr),
       "rms_norm_residual: a post-norm residual (post_alpha != 0) writes x in place: x_out must be x, without rows_index");
  need(rows >= 0 && dim > 0 && dim % 4 == 0 && ldx >= dim && ldx % 4 == 0,
       "rms_norm_residual: need rows >= 0, dim a positive multiple of 4 and ldx >= dim (multiple of 4); got rows=" +
           std::to_string(rows) + " dim=" + std::to_string(dim) + " ldx=" + std::to_string(ldx));
  if (rows == 0) return;
  need(x && w && y, "rms_norm_residual: null pointer");
  float* xm = const_cast<float*>(x);  // written only when post_alpha != 0 (then x == x_out, checked above)
  const bool post = post_alpha != 0.f;
  auto kernel = zero_centred ? (post ? rms_norm_residual_kernel<true, true> : rms_norm_residual_kernel<true, false>)
                             : (post ? rms_norm_residual_kernel<false, true> : rms_norm_residual_kernel<false, false>);
  detail::launch_pdl_if(detail::mixer_pdl(), kernel, dim3(rows), dim3(kNormThreads), 0, stream,
                        "rms_norm_residual launch", rows, dim, xm, ldx, rows_index, w, eps, y, post_alpha);
}

// rms_norm_gated_kernel with 16-byte accesses: L = dim / 8 lanes per row (L in {4, 8, 16, 32}: dim 32 .. 256), lane
// holding 8 consecutive elements, x read once into registers; x and z loaded before any arithmetic, so a warp has
// 32 / L rows' 16-byte loads in flight (the 4-byte version ran at 2.1 TB/s). The sum of squares is each lane's
// (ascending), then the L lanes' (xor shuffles): another order than rms_norm_gated_kernel's, so the last bit of inv may
// differ; the per-element arithmetic is the same.
template <NormGate kGate, int L>
__global__ void __launch_bounds__(256) rms_norm_gated_vec_kernel(int rows, int dim, const bf16* x,
                                                                 const bf16* __restrict__ z,
                                                                 const bf16* __restrict__ w, int w_rows, float eps,
                                                                 bf16* y) {
  detail::griddep_launch_dependents();  // as rms_norm_residual_kernel
  detail::griddep_wait();
  const long r = (long(blockIdx.x) * blockDim.x + threadIdx.x) / L;
  const int sub = threadIdx.x % L;
  const bool on = r < rows;  // (the whole group of L lanes agrees; shuffles stay within it)
  const long rr = on ? r : 0;
  const int c = sub * 8;
  uint4 xv = make_uint4(0, 0, 0, 0), zv = xv;
  if (on) {
    xv = *reinterpret_cast<const uint4*>(x + rr * dim + c);
    zv = __ldca(reinterpret_cast<const uint4*>(z + rr * dim + c));  // (coherent: a PDL launch, as x)
  }
  const uint4 wv = __ldg(reinterpret_cast<const uint4*>(w + (rr % w_rows) * dim + c));
  const uint4 out = detail::gated_norm_lanes8<kGate == NormGate::Silu, L>(xv, zv, wv, dim, eps);
  if (on) *reinterpret_cast<uint4*>(y + rr * dim + c) = out;
}

// rms_norm_gated_vec_kernel's launch for dim / 8 = L lanes per row; false when rms_norm_gated_vectorized says no.
template <NormGate kGate>
bool launch_rms_norm_gated_vec(int rows, int dim, const bf16* x, const bf16* z, const bf16* w, int w_rows, float eps,
                               bf16* y, cudaStream_t stream) {
  if (!rms_norm_gated_vectorized(dim, x, z, w, y)) return false;
  const long threads = long(rows) * (dim / 8);
  const unsigned blocks = unsigned((threads + 255) / 256);
  auto launch = [&](auto kernel) {
    detail::launch_pdl_if(detail::mixer_pdl(), kernel, dim3(blocks), dim3(256), 0, stream, "rms_norm_gated launch",
                          rows, dim, x, z, w, w_rows, eps, y);
  };
  switch (dim / 8) {
    case 4: launch(rms_norm_gated_vec_kernel<kGate, 4>); break;
    case 8: launch(rms_norm_gated_vec_kernel<kGate, 8>); break;
    case 16: launch(rms_norm_gated_vec_kernel<kGate, 16>); break;
    case 32: launch(rms_norm_gated_vec_kernel<kGate, 32>); break;
    default: return false;
  }
  return true;
}

bool rms_norm_gated_vectorized(int dim, const bf16* x, const bf16* z, const bf16* w, const bf16* y) {
  static CandidateSwitch on("HYPIC_NORM_GATED_VEC");
  const uintptr_t any = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(z) |
                        reinterpret_cast<uintptr_t>(w) | reinterpret_cast<uintptr_t>(y);
  const int L = dim / 8;
  return dim % 8 == 0 && (L == 4 || L == 8 || L == 16 || L == 32) && !(any & 15u) && on.on();
}

void rms_norm_gated(int rows, int dim, const bf16* x, const bf16* z, const bf16* w, float eps, bf16* y,
                    cudaStream_t stream, NormGate gate, int w_rows) {
  need(rows >= 0 && dim > 0 && dim % 2 == 0 && w_rows > 0,
       "rms_norm_gated: need rows >= 0, dim a positive even number and w_rows > 0; got rows=" + std::to_string(rows) +
           " dim=" + std::to_string(dim) + " w_rows=" + std::to_string(w_rows));
  if (rows == 0) return;
  need(x && z && w && y, "rms_norm_gated: null pointer");
  need(((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(z) | reinterpret_cast<uintptr_t>(w) |
         reinterpret_cast<uintptr_t>(y)) & 3u) == 0,
       "rms_norm_gated: x, z, w and y must be 4-byte aligned (bf16 pairs)");
  const bool vec = gate == NormGate::Silu
                       ? launch_rms_norm_gated_vec<NormGate::Silu>(rows, dim, x, z, w, w_rows, eps, y, stream)
                       : launch_rms_norm_gated_vec<NormGate::Sigmoid>(rows, dim, x, z, w, w_rows, eps, y, stream);
  if (!vec)
    detail::launch_pdl_if(detail::mixer_pdl(),
                          gate == NormGate::Silu ? rms_norm_gated_kernel<NormGate::Silu>
                                                 : rms_norm_gated_kernel<NormGate::Sigmoid>,
                          dim3((rows + 3) / 4), dim3(128), 0, stream, "rms_norm_gated launch", rows, dim, x, z, w,
                          w_rows, eps, y);
}

// One thread per 4 floats of one chain's head: R in registers across the steps.
__global__ void affine_chain_scalar_kernel(int heads, int head_floats, int steps_per_chain,
                                           const AffineStep* __restrict__ steps, const float* const* __restrict__ init,
                                           float* const* __restrict__ final_states) {
  const int c = blockIdx.x, h = blockIdx.y;
  const int j = (blockIdx.z * blockDim.x + threadIdx.x) * 4;
  if (j >= head_floats) return;
  const size_t off = size_t(h) * head_floats + j;
  const float* R0 = init ? init[c] : nullptr;
  float4 r = R0 ? *reinterpret_cast<const float4*>(R0 + off) : make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < steps_per_chain; ++s) {
    const AffineStep st = steps[size_t(c) * steps_per_chain + s];
    const float t = st.T ? st.T[h] * st.alpha : st.alpha;
    const float4 sv = st.S ? __ldcg(reinterpret_cast<const float4*>(st.S + off)) : make_float4(0.f, 0.f, 0.f, 0.f);
    r = make_float4(fmaf(t, r.x, sv.x), fmaf(t, r.y, sv.y), fmaf(t, r.z, sv.z), fmaf(t, r.w, sv.w));
    if (st.out) *reinterpret_cast<float4*>(st.out + off) = r;
  }
  float* F = final_states ? final_states[c] : nullptr;
  if (F) *reinterpret_cast<float4*>(F + off) = r;
}

void affine_chain_scalar(int num_chains, int heads, int head_floats, int steps_per_chain, const AffineStep* steps,
                         const float* const* init, float* const* final_states, cudaStream_t stream) {
  need(num_chains >= 0 && heads > 0 && heads <= 65535 && steps_per_chain >= 0 && num_chains <= (1 << 30) &&
           head_floats > 0 && head_floats % 4 == 0,
       "affine_chain_scalar: bad sizes num_chains=" + std::to_string(num_chains) + " heads=" + std::to_string(heads) +
           " head_floats=" + std::to_string(head_floats) + " steps=" + std::to_string(steps_per_chain));
  if (num_chains == 0) return;
  need(steps || steps_per_chain == 0, "affine_chain_scalar: steps is null");
  const int per_block = 256 * 4;
  dim3 grid(num_chains, heads, (head_floats + per_block - 1) / per_block);
  affine_chain_scalar_kernel<<<grid, 256, 0, stream>>>(heads, head_floats, steps_per_chain, steps, init, final_states);
  check_cuda(cudaGetLastError(), "affine_chain_scalar launch");
}

ChainMath affine_chain_math() {
  static const ChainMath m = [] {
    const char* e = std::getenv("HYPIC_CHAIN_MATH");
    if (!e || !*e || std::string(e) == "tf32x3") return ChainMath::Tf32x3;
    if (std::string(e) == "tf32x3-mma") return ChainMath::Tf32x3Mma;
    if (std::string(e) == "fp32") return ChainMath::Fp32Fma;
    throw std::invalid_argument(std::string("HYPIC_CHAIN_MATH must be tf32x3, tf32x3-mma or fp32, got '") + e + "'");
  }();
  return m;
}

namespace {
std::atomic<uint64_t> g_low_rank_launches{0};  // (affine_chain_low_rank_launches)
}  // namespace

uint64_t affine_chain_low_rank_launches() { return g_low_rank_launches.load(); }

void affine_chain(int num_chains, int heads, int steps_per_chain, const AffineStep* steps, const float* const* init,
                  float* const* final_states, cudaStream_t stream, const ChainLowRankFactors* low_rank) {
  affine_chain(num_chains, heads, steps_per_chain, steps, init, final_states, stream, affine_chain_math(), low_rank);
}

void affine_chain(int num_chains, int heads, int steps_per_chain, const AffineStep* steps, const float* const* init,
                  float* const* final_states, cudaStream_t stream, ChainMath math,
                  const ChainLowRankFactors* low_rank) {
  need(num_chains >= 0 && heads > 0 && heads <= 65535 && steps_per_chain >= 0 && num_chains < (1 << 29),
       "affine_chain: bad sizes num_chains=" + std::to_string(num_chains) + " heads=" + std::to_string(heads) +
           " steps=" + std::to_string(steps_per_chain));
  if (num_chains == 0) return;
  need(steps || steps_per_chain == 0, "affine_chain: steps is null");
  ChainLowRankFactors lrf{};
  if (low_rank) {
    const ChainLowRankFactors& f = *low_rank;
    auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    need(f.W && f.UT && f.scal && f.k, "affine_chain: low-rank factors with a null W, UT, scal or k");
    need(aligned16(f.W) && aligned16(f.UT) && aligned16(f.scal) && aligned16(f.k),
         "affine_chain: low-rank factors W, UT, scal and k must be 16-byte aligned");
    need(f.heads == heads && f.num_k_heads > 0 && heads % f.num_k_heads == 0,
         "affine_chain: low-rank factors of " + std::to_string(f.heads) + " value / " + std::to_string(f.num_k_heads) +
             " key heads for a chain of " + std::to_string(heads) + " heads");
    need(f.ut_ld >= detail::kChainLowRankMaxLen && f.ut_ld % 8 == 0,
         "affine_chain: low-rank ut_ld " + std::to_string(f.ut_ld) + " must be a multiple of 8 and at least 64");
    need(f.w_stride >= long(detail::kChainLowRankMaxLen) * D && f.w_stride % 8 == 0 &&
             f.w_stride >= long(D) * f.ut_ld,
         "affine_chain: low-rank w_stride " + std::to_string(f.w_stride) +
             " must be a multiple of 8 holding 64 W rows and 128 U^T rows");
    need(f.scal_stride >= detail::kChainLowRankMaxLen && f.scal_stride % 4 == 0 && f.gamma_at >= 0 &&
             f.gamma_at < f.scal_stride,
         "affine_chain: low-rank scal_stride " + std::to_string(f.scal_stride) + " (a multiple of 4, at least 64) or " +
             "gamma_at " + std::to_string(f.gamma_at) + " (within it) out of range");
    lrf = f;
    g_low_rank_launches.fetch_add(1);
  }
  static DeviceOnce fma_once, tc_once;  // (each kernel opts in on first use: their shared memory differs)
#if HYPIC_CHAIN_WGMMA_BUILT
  if (math == ChainMath::Tf32x3 && detail::chain_wgmma_available()) {
    detail::launch_affine_chain_wgmma(num_chains, heads, steps_per_chain, steps, init, final_states, lrf, stream);
    return;
  }
#endif
  // Column blocks of one (chain, head) adjacent in blockIdx.x: they read the same T at about the same time (L2).
  const dim3 grid(static_cast<unsigned>(num_chains) * (D / kBN), heads);
  if (math == ChainMath::Fp32Fma) {
    fma_once.run(current_device(), [](int) {
      check_cuda(cudaFuncSetAttribute(affine_chain_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kChainSmem),
                 "affine_chain smem opt-in");
      check_cuda(cudaFuncSetAttribute(affine_chain_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kChainSmemLowRank),
                 "affine_chain (low-rank steps) smem opt-in");
      return 0;
    });
    if (low_rank)
      affine_chain_kernel<true><<<grid, 256, kChainSmemLowRank, stream>>>(heads, steps_per_chain, steps, init,
                                                                         final_states, lrf);
    else
      affine_chain_kernel<false><<<grid, 256, kChainSmem, stream>>>(heads, steps_per_chain, steps, init, final_states,
                                                                   lrf);
  } else {
    tc_once.run(current_device(), [](int) {
      check_cuda(cudaFuncSetAttribute(affine_chain_tc_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kChainTcSmem),
                 "affine_chain (tensor cores) smem opt-in");
      check_cuda(cudaFuncSetAttribute(affine_chain_tc_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kChainTcSmemLowRank),
                 "affine_chain (tensor cores, low-rank steps) smem opt-in");
      return 0;
    });
    if (low_rank)
      affine_chain_tc_kernel<true><<<grid, 256, kChainTcSmemLowRank, stream>>>(heads, steps_per_chain, steps, init,
                                                                              final_states, lrf);
    else
      affine_chain_tc_kernel<false><<<grid, 256, kChainTcSmem, stream>>>(heads, steps_per_chain, steps, init,
                                                                        final_states, lrf);
  }
  check_cuda(cudaGetLastError(), "affine_chain launch");
}

void fp32_to_bf16(long n, const float* x, bf16* y, cudaStream_t stream) {
  need(n >= 0, "fp32_to_bf16: negative n");
  if (n == 0) return;
  need(x && y, "fp32_to_bf16: null pointer");
  fp32_to_bf16_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(n, x, y);
  check_cuda(cudaGetLastError(), "fp32_to_bf16 launch");
}

void bf16_to_fp32(long n, const bf16* x, float* y, cudaStream_t stream) {
  need(n >= 0, "bf16_to_fp32: negative n");
  if (n == 0) return;
  need(x && y, "bf16_to_fp32: null pointer");
  bf16_to_fp32_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(n, x, y);
  check_cuda(cudaGetLastError(), "bf16_to_fp32 launch");
}

void batched_copy(int n, const CopyDesc* descs, cudaStream_t stream) {
  need(n >= 0, "batched_copy: negative n");
  if (n == 0) return;
  need(descs != nullptr, "batched_copy: descs is null");
  // The sizes live on the device: spread few descriptors over about two blocks per SM of an H100 / H200.
  const int per_desc = std::max(1, std::min(128, 264 / n));
  batched_copy_kernel<<<dim3(std::min(n, 65535), per_desc), 256, 0, stream>>>(n, descs);
  check_cuda(cudaGetLastError(), "batched_copy launch");
}

void gather_rows(int n, int row_elems, const bf16* src, const int* src_rows, bf16* dst, cudaStream_t stream) {
  need(n >= 0 && row_elems > 0 && row_elems % 2 == 0,
       "gather_rows: row_elems must be a positive even number, got " + std::to_string(row_elems));
  if (n == 0) return;
  need(src && src_rows && dst, "gather_rows: null pointer");
  gather_rows_kernel<<<blocks_for(long(n) * row_elems / 2, 256), 256, 0, stream>>>(n, row_elems, src, src_rows, dst);
  check_cuda(cudaGetLastError(), "gather_rows launch");
}

void fill_random(long n, RandomFill kind, float a, float b, uint64_t seed, uint64_t stream_id, bf16* y_bf16,
                 float* y_fp32, cudaStream_t stream) {
  need(n >= 0, "fill_random: negative n");
  need((y_bf16 == nullptr) != (y_fp32 == nullptr), "fill_random: give exactly one of y_bf16 and y_fp32");
  if (n == 0) return;
  fill_random_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(n, kind, a, b, seed, stream_id, y_bf16, y_fp32);
  check_cuda(cudaGetLastError(), "fill_random launch");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void record_block_sms_kernel(int64_t spin_ns, int* sm_of_block) {
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < uint64_t(spin_ns)) {
  }
  if (threadIdx.x == 0) {
    unsigned sm = 0;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    sm_of_block[blockIdx.x] = int(sm);
  }
}

void record_block_sms(int blocks, int64_t spin_ns, int* sm_of_block, cudaStream_t stream) {
  need(blocks >= 0 && spin_ns >= 0, "record_block_sms: negative blocks or spin");
  if (blocks == 0) return;
  need(sm_of_block != nullptr, "record_block_sms: null output");
  record_block_sms_kernel<<<blocks, 32, 0, stream>>>(spin_ns, sm_of_block);
  check_cuda(cudaGetLastError(), "record_block_sms launch");
}

}  // namespace hypic::kernels::cuda
