// affine_chain's 3xTF32 products on Hopper's warpgroup tensor-core instructions (sm_90a: wgmma.mma_async, tf32).
// Same split as affine_chain_tc_kernel (ops.cu): each fp32 operand x = hi + lo (detail::split_tf32), T R = T_lo R_hi +
// T_hi R_lo + T_hi R_hi, the main product and the two small ones in two fp32 accumulators (the mma.sync kernel keeps
// three: the same sums in another order). One block per (chain, head, 32-column block) as the
// mma.sync kernel; the two warpgroups own rows 0..63 and 64..127 of T and all 32 columns; the accumulator layout per
// warp (rows 16 w + g, + 8; columns 8 n + 2 t, + 1) is that of the mma.sync tiles, so the running block R stays in
// registers as there. T is the wgmma A operand in registers (each thread its fragments of the warpgroup's 64 rows,
// split into hi and lo: 128 registers), R^T (hi and lo, [column][k]) the B operand in shared memory in the
// 128-byte-swizzled K-major layout the descriptors name (PTX ISA, "Shared Memory Matrix Layout": 32 tf32 of k per
// 128-byte row, 8-row atoms of 1024 bytes, K in chunks of 32). The next step's T comes into a padded staging buffer
// by cp.async while the step multiplies, then each thread reads its fragments from there. Why A in registers: with
// T split into shared memory and re-read by every 32-column wgmma, a step moved ~450 KB through shared memory (the
// Nsight Compute profile of that version: L1/shared pipe 74% busy, 4.2 us per step); this way ~260 KB.
//
// Built for sm_90a only (kernels/cuda/CMakeLists.txt); ops.cu calls it on compute capability 9.0 devices.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/chain_tile.cuh"
#include "kernels/cuda/chain_wgmma.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/switches.h"
#include "kernels/cuda/wgmma.cuh"

namespace hypic::kernels::cuda::detail {
namespace {

using namespace sm90;

constexpr int D = 128;   // state rows (d_k) = T's size
constexpr int BN = 32;   // columns of R per block
constexpr int kRBytes = BN * D * 4;   // one split copy of R^T, swizzled
constexpr int kLdT = D + 4;           // staging row stride (floats): the fragment reads are bank-conflict free
constexpr int kStageBytes = D * kLdT * 4;
constexpr int kLdRf = BN + 8;  // low-rank steps: R in fp32 [128][kLdRf] (the tile's float2 stores conflict-free)
constexpr int kLowRankBytes = (D * kLdRf + kChainLowRankSmemFloats) * 4 + kChainLowRankRawBytes;
// (LR, HYPIC_CHAIN_LR_FUSE) a low-rank step of at most kFuseMaxLen tokens deferred into the full step after it: W rows
// as the A operand of Y = W R ([64][128] tf32, 128-byte swizzled, rows >= the step's length unused), K~ hi and lo as
// the B operand of P = T K~^T ([16][128] each, swizzled as [8][128] when the step has at most 8 tokens), P fp32
// [128][kLdP], Y - U fp32 [16][32] and the step's gamma (+ padding) for the full step's epilogue.
constexpr int kFuseMaxLen = 16, kLdP = kFuseMaxLen + 4;
constexpr int kFuseWBytes = 64 * D * 4, kFuseKBytes = kFuseMaxLen * D * 4;
constexpr int kFuseBytes = kFuseWBytes + 2 * kFuseKBytes + (D * kLdP + kFuseMaxLen * BN + 4) * 4;
// Shared memory of the kernel without / with low-rank steps (+ slack for the 1024-byte alignment).
constexpr int kSmem = 2 * kRBytes + kStageBytes + 1024, kSmemLowRank = kSmem + kFuseBytes + kLowRankBytes;
static_assert(kSmemLowRank <= 227 * 1024, "affine_chain_wgmma_kernel<true>: shared memory over the SM's 227 KB");
static_assert((2 * kRBytes + kStageBytes) % 1024 == 0, "the fused step's operands start 1024-byte aligned");
constexpr int KS = D / 8;  // k steps of 8

// Byte offset of the 16-byte unit `unit` (k = 4 unit .. 4 unit + 3) of row `row` in a [ROWS][128] tf32 tile stored as
// four K chunks of [ROWS][128 bytes], the unit's place in its 128-byte row XOR-ed with row % 8.
template <int ROWS>
__device__ __forceinline__ uint32_t sw128(int row, int unit) {
  return static_cast<uint32_t>((unit >> 3) * (ROWS * 128) + row * 128 + (((unit & 7) ^ (row & 7)) << 4));
}

// d (64 x 32 fp32, accumulator layout) += A (64 x 8 tf32 in registers: per warp w rows 16 w + (g, g + 8), k (t, t + 4),
// the mma.m16n8k8 A-fragment layout) * B (8 x 32, K-major in shared memory, descriptor db): wgmma.mma_async m64n32k8,
// tf32 in, fp32 accumulate. Issued, not waited for.
__device__ __forceinline__ void wgmma_m64n32k8_tf32_rs(float (&d)[4][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// d (64 x 32 fp32) += A (64 x 8 tf32, K-major in shared memory, descriptor da) * B (8 x 32, descriptor db):
// wgmma.mma_async m64n32k8, both operands from shared memory. Issued, not waited for.
__device__ __forceinline__ void wgmma_m64n32k8_tf32_ss(float (&d)[4][4], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db));
}

// d (64 x 8 NB fp32, NB = 1 or 2) += A (64 x 8 tf32 in registers, as wgmma_m64n32k8_tf32_rs) * B (8 x 8 NB, K-major in
// shared memory, descriptor db): wgmma.mma_async m64n8k8 / m64n16k8. Issued, not waited for.
template <int NB>
__device__ __forceinline__ void wgmma_m64nk8_tf32_rs(float (&d)[2][4], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (NB == 1) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k8.f32.tf32.tf32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1;"
        "\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  }
}

// LR: the chain has low-rank steps (their shared memory and code; without, a step with lr_len > 0 traps).
template <bool LR>
__global__ void __launch_bounds__(256, 1) affine_chain_wgmma_kernel(int steps_per_chain,
                                                                    const AffineStep* __restrict__ steps,
                                                                    const float* const* __restrict__ init,
                                                                    float* const* __restrict__ final_states,
                                                                    ChainLowRankFactors lr, int lr_prefetch,
                                                                    int lr_fuse) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int NT = BN / 8;  // accumulator tiles (8 columns) per warp
  extern __shared__ __align__(16) unsigned char chain_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(chain_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* sRh = base;  // R^T hi, lo: [32 columns][128 k], swizzled
  unsigned char* sRl = sRh + kRBytes;
  float* sStage = reinterpret_cast<float*>(sRl + kRBytes);  // the next step's T, fp32 [128][kLdT]
  unsigned char* sWt = reinterpret_cast<unsigned char*>(sStage + D * kLdT);  // (LR) a deferred step's operands
  unsigned char* sKh = sWt + kFuseWBytes;
  unsigned char* sKl = sKh + kFuseKBytes;
  float* sP = reinterpret_cast<float*>(sKl + kFuseKBytes);
  float* sY = sP + D * kLdP;
  float* sRf = sY + kFuseMaxLen * BN + 4;  // (LR) low-rank steps: R in fp32, then their staging
  float* sLr = sRf + D * kLdRf;
  unsigned char* sRaw = reinterpret_cast<unsigned char*>(sLr + kChainLowRankSmemFloats);  // a prefetched step's factors
  const uint32_t aRh = smem_u32(sRh), aRl = smem_u32(sRl);
  // Chain and column block from blockIdx.x (the column blocks of one (chain, head) adjacent: they read the same T at
  // about the same time, from L2), head from blockIdx.y.
  const int c = blockIdx.x / (D / BN), c0 = (blockIdx.x % (D / BN)) * BN, h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3, m0 = warp * 16;
  const ChainTile<NT> tile(h, c0, warp, lane);
  const AffineStep* chain = steps + size_t(c) * steps_per_chain;
  auto stage_T = [&](const float* T) {  // T's head h into the staging buffer (cp.async; the caller commits)
    T += size_t(h) * D * D;
#pragma unroll
    for (int j = 0; j < D * D / 4 / 256; ++j) {
      const int i = tid + 256 * j, row = i >> 5, col = (i & 31) * 4;
      cp_async16(sStage + row * kLdT + col, T + row * D + col);
    }
  };
  uint32_t th[KS][4], tl[KS][4];  // this thread's A fragments of T, hi and lo
  auto load_frags = [&] {         // from the staging buffer: rows m0 + g (+ 8), k 8 kk + t (+ 4)
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = m0 + g + 8 * (i & 1), k = 8 * kk + t + 4 * (i >> 1);
        split_tf32(sStage[row * kLdT + k], th[kk][i], tl[kk][i]);
      }
  };
  auto store_R = [&](const float (&r)[NT][4]) {  // R -> its transposed tf32 hi / lo copy (each lane its elements)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = 8 * n + 2 * t + (i & 1), k = m0 + g + 8 * (i >> 1);
        const uint32_t o = sw128<BN>(col, k >> 2) + (k & 3) * 4;
        uint32_t hi, lo;
        split_tf32(r[n][i], hi, lo);
        *reinterpret_cast<uint32_t*>(sRh + o) = hi;
        *reinterpret_cast<uint32_t*>(sRl + o) = lo;
      }
  };
  float cur[NT][4];
  tile.load(cur, init ? init[c] : nullptr);
  // Every global read a step depends on is issued a step ahead: the step descriptors two ahead (the next T's address
  // is then in hand when its copy starts), the next step's T (into the staging buffer) and S (its 32 columns).
  AffineStep st = steps_per_chain > 0 ? chain[0] : AffineStep{};
  AffineStep nxt = steps_per_chain > 1 ? chain[1] : AffineStep{};
  float2 sv[NT][2], sv_next[NT][2];
  tile.load_S(sv, st.S);
  if (st.T) {
    stage_T(st.T);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    load_frags();
  }
  store_R(cur);
  fence_proxy_async();  // the generic-proxy stores above are read by wgmma (async proxy)
  __syncthreads();      // (also: every thread has read its fragments before the staging buffer is refilled)
  // The step whose T sits (or lands) in the staging buffer, not yet in fragments (-1: the buffer is free). When the
  // next step has no T (a low-rank or identity step), the T of the step after it is staged a step early, so that a
  // short low-rank step does not wait for the 64 KB of T behind it. (Issuing that copy after this step's math instead,
  // when the descriptor read at the top is surely in, measured slower: 151.6 against 137.0 us per splice chain, H100.)
  int staged = -1;
  int prefetched = -1;  // (LR) the low-rank step whose first factors sRaw holds (fetched during the step before it)
  // (LR, lr_fuse) A low-rank step deferred into the full step after it (HYPIC_CHAIN_LR_FUSE): R <- alpha T (gamma R -
  // K~^T Y) + S = alpha (gamma (T R) - P Y) + S with Y = W R - U and P = T K~^T, both computed in the low-rank step
  // (on the tensor cores: Y from the R copy the previous step left, P from the next T, staged and landed by then) and
  // kept in shared memory; the full step then multiplies T R as any other and subtracts P Y in its epilogue.
  // Deferred: a step of 1 .. kFuseMaxLen tokens with its factors prefetched, no out, followed by a full step with a T.
  // Chosen when its factors' prefetch is issued (the step before it), where the descriptors are in hand.
  int defer_at = -2;  // the step to defer (-2: never a step s or s - 1 unless chosen)
  for (int s = 0; s < steps_per_chain; ++s) {
    const AffineStep after = s + 2 < steps_per_chain ? chain[s + 2] : AffineStep{};
    if constexpr (!LR) {
      if (st.lr_len > 0) __trap();  // (a low-rank step in a chain given no factors: affine_chain documents the trap)
    }
    const bool defer = LR && defer_at == s, fused = LR && defer_at == s - 1;  // (fused: the step after a deferred one)
    if (staged < 0) {  // lands while this step multiplies
      if (nxt.T) {
        stage_T(nxt.T);
        staged = s + 1;
      } else if (after.T) {
        stage_T(after.T);
        staged = s + 2;
      }
    }
    // (HYPIC_CHAIN_LR_PREFETCH, a measured default) the next low-rank step's factors land while this step multiplies.
    if (LR && lr_prefetch && st.lr_len <= 0 && nxt.lr_len > 0) {
      chain_low_rank_prefetch(sRaw, lr, nxt, c0, h, tid);
      prefetched = s + 1;
      if (lr_fuse && nxt.lr_len <= kFuseMaxLen && !nxt.out && after.T && after.lr_len <= 0 && staged == s + 2)
        defer_at = s + 1;
    }
    cp_async_commit();
    tile.load_S(sv_next, nxt.S);
    float acc[NT][4];
    if (defer) {
      // Operands from the prefetched factors (landed: the previous step waited for every copy): W rows as tf32 (bf16,
      // exact), K~ = kf k split; the next T's fragments from the staging buffer (landed the same way).
      const int len = st.lr_len;
      const bf16* rw = reinterpret_cast<const bf16*>(sRaw);
      const bf16* rk = reinterpret_cast<const bf16*>(sRaw + 4096);
      const float* rkf = reinterpret_cast<const float*>(sRaw + 9216);
      for (int i = tid; i < len * D; i += 256) {
        const int tt = i >> 7, k = i & (D - 1);
        *reinterpret_cast<float*>(sWt + sw128<64>(tt, k >> 2) + (k & 3) * 4) = __bfloat162float(rw[i]);
        uint32_t hi, lo;
        split_tf32(rkf[tt] * __bfloat162float(rk[i]), hi, lo);
        const uint32_t o = (len <= 8 ? sw128<8>(tt, k >> 2) : sw128<16>(tt, k >> 2)) + (k & 3) * 4;
        *reinterpret_cast<uint32_t*>(sKh + o) = hi;
        *reinterpret_cast<uint32_t*>(sKl + o) = lo;
      }
      if (tid == 0) sY[kFuseMaxLen * BN] = __expf(reinterpret_cast<const float*>(sRaw + 9280)[lr.gamma_at & 3]);
      if (tid == 0) reinterpret_cast<int*>(sY)[kFuseMaxLen * BN + 1] = len;
      fence_proxy_async();
      __syncthreads();  // the operands visible to wgmma
      const uint32_t aKh = smem_u32(sKh), aKl = smem_u32(sKl), aW = smem_u32(sWt);
      if (warp < 4) {  // Y = W R_hi + W R_lo (W exact in tf32): warpgroup 0, rows t of its 64 (those < len used)
        float y[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) y[n][i] = 0.f;
        pin<NT>(y);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
          const uint32_t kb = (kk >> 2) * (BN * 128) + (kk & 3) * 32;
          const uint64_t dW = sw128_desc(aW + (kk >> 2) * (64 * 128) + (kk & 3) * 32, 16, 1024);
          wgmma_m64n32k8_tf32_ss(y, dW, sw128_desc(aRh + kb, 16, 1024));
          wgmma_m64n32k8_tf32_ss(y, dW, sw128_desc(aRl + kb, 16, 1024));
        }
        wgmma_commit();
        load_frags();  // (while Y multiplies)
        wgmma_wait<0>();
        pin<NT>(y);
        if (warp == 0) {  // Y - U, rows t < len (U^T bf16 [32 columns][16 tokens] in the prefetched factors)
          const bf16* ru = reinterpret_cast<const bf16*>(sRaw + 8192);
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int tt = g + 8 * (i >> 1), col = 8 * n + 2 * t + (i & 1);
              if (tt < len) sY[tt * BN + col] = y[n][i] - __bfloat162float(ru[col * kChainLowRankTile + tt]);
            }
        }
      } else {
        load_frags();
      }
      staged = -1;  // (refilled at the next step's top, behind this step's barrier)
      float p[2][4], pc[2][4];  // P (this warpgroup's 64 rows) = T K~^T in 3xTF32, as the main product
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) p[j][i] = pc[j][i] = 0.f;
      pin<2>(p);
      pin<2>(pc);
      pin_u<KS>(th);
      pin_u<KS>(tl);
      wgmma_fence();
      auto issue_P = [&](auto nb) {
        constexpr int NB = decltype(nb)::value;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
          const uint32_t kb = (kk >> 2) * (8 * NB * 128) + (kk & 3) * 32;
          const uint64_t dKh = sw128_desc(aKh + kb, 16, 1024), dKl = sw128_desc(aKl + kb, 16, 1024);
          wgmma_m64nk8_tf32_rs<NB>(pc, tl[kk], dKh);
          wgmma_m64nk8_tf32_rs<NB>(pc, th[kk], dKl);
          wgmma_m64nk8_tf32_rs<NB>(p, th[kk], dKh);
        }
      };
      if (len <= 8)
        issue_P(std::integral_constant<int, 1>{});
      else
        issue_P(std::integral_constant<int, 2>{});
      wgmma_commit();
      wgmma_wait<0>();
      pin<2>(p);
      pin<2>(pc);
      pin_u<KS>(th);
      pin_u<KS>(tl);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (8 * j < len) sP[(m0 + g + 8 * (i >> 1)) * kLdP + 8 * j + 2 * t + (i & 1)] = p[j][i] + pc[j][i];
      // (R is unchanged: cur and its split copy stay as the previous step left them)
    } else if (LR && st.lr_len > 0) {  // a low-rank step on an fp32 copy of the block (behind the last barrier)
      tile.to_smem(cur, sRf, kLdRf);
      chain_low_rank_step(sRf, kLdRf, sLr, c0, h, lr, st, tid, prefetched == s ? sRaw : nullptr);
      tile.from_smem(cur, sRf, kLdRf);
      tile.store(cur, st.out);
    } else if (st.T) {
      float cor[NT][4];  // the two small products apart from the main one (added inside the tensor cores to the main
                         // sum, their low bits would be cut: relative errors 2-3x larger against double)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = cor[n][i] = 0.f;
      pin<NT>(acc);
      pin<NT>(cor);
      pin_u<KS>(th);
      pin_u<KS>(tl);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        // k step kk of R^T: K chunk kk / 4 (32 k per 128-byte row), 32 bytes into it per k step of 8.
        const uint32_t kb = (kk >> 2) * (BN * 128) + (kk & 3) * 32;
        const uint64_t dRh = sw128_desc(aRh + kb, 16, 1024), dRl = sw128_desc(aRl + kb, 16, 1024);
        wgmma_m64n32k8_tf32_rs(cor, tl[kk], dRh);
        wgmma_m64n32k8_tf32_rs(cor, th[kk], dRl);
        wgmma_m64n32k8_tf32_rs(acc, th[kk], dRh);
      }
      wgmma_commit();
      wgmma_wait<0>();
      pin<NT>(acc);
      pin<NT>(cor);
      pin_u<KS>(th);
      pin_u<KS>(tl);
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] += cor[n][i];
    } else {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = cur[n][i];
    }
    if (fused) {  // the full step after a deferred one: acc <- gamma acc - P Y (t ascending)
      const float* p0 = sP + (m0 + g) * kLdP;
      const float* p1 = p0 + 8 * kLdP;
      const float gamma = sY[kFuseMaxLen * BN];
      const int flen = reinterpret_cast<const int*>(sY)[kFuseMaxLen * BN + 1];
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] *= gamma;
      for (int tt = 0; tt < flen; ++tt) {
        const float a0 = p0[tt], a1 = p1[tt];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const float2 yv = *reinterpret_cast<const float2*>(sY + tt * BN + 8 * n + 2 * t);
          acc[n][0] = fmaf(-a0, yv.x, acc[n][0]), acc[n][1] = fmaf(-a0, yv.y, acc[n][1]);
          acc[n][2] = fmaf(-a1, yv.x, acc[n][2]), acc[n][3] = fmaf(-a1, yv.y, acc[n][3]);
        }
      }
    }
    if (!(LR && st.lr_len > 0)) tile.step(cur, acc, sv, st.alpha, st.out);
    if (st.out && nxt.S == st.out)  // the next step adds what this one wrote: read a step early, it was stale
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int half = 0; half < 2; ++half) sv_next[n][half] = make_float2(cur[n][2 * half], cur[n][2 * half + 1]);
    if (s + 1 < steps_per_chain) {
      cp_async_wait<0>();
      __syncthreads();  // the next T staged by every thread; both warpgroups' wgmmas have read this step's R copy
      if (staged == s + 1) {
        load_frags();
        staged = -1;
      }
      if (!defer) {  // (a deferred step changed no R and read its fragments before its own barrier)
        store_R(cur);
        fence_proxy_async();
        __syncthreads();  // the new R copy visible; every thread has read its fragments (the staging buffer is free)
      }
    }
    st = nxt;
    nxt = after;
#pragma unroll
    for (int n = 0; n < NT; ++n) sv[n][0] = sv_next[n][0], sv[n][1] = sv_next[n][1];
  }
  cp_async_wait<0>();
  tile.store(cur, final_states ? final_states[c] : nullptr);
#else
  __trap();  // built for sm_90a only; affine_chain checks the device
#endif
}

}  // namespace

bool chain_wgmma_available() { return current_device_is_sm90(); }

void launch_affine_chain_wgmma(int num_chains, int heads, int steps_per_chain, const AffineStep* steps,
                               const float* const* init, float* const* final_states, const ChainLowRankFactors& lr,
                               cudaStream_t stream) {
  static DeviceOnce once;
  once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(affine_chain_wgmma_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kSmem),
               "affine_chain (wgmma) smem opt-in");
    check_cuda(cudaFuncSetAttribute(affine_chain_wgmma_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kSmemLowRank),
               "affine_chain (wgmma, low-rank steps) smem opt-in");
    return 0;
  });
  const dim3 grid(static_cast<unsigned>(num_chains) * (D / BN), heads);
  static CandidateSwitch lr_prefetch("HYPIC_CHAIN_LR_PREFETCH"), lr_fuse("HYPIC_CHAIN_LR_FUSE");
  if (lr.W) {
    const bool prefetch = lr_prefetch.on();
    affine_chain_wgmma_kernel<true><<<grid, 256, kSmemLowRank, stream>>>(steps_per_chain, steps, init, final_states, lr,
                                                                         prefetch ? 1 : 0, prefetch && lr_fuse.on());
  } else {
    affine_chain_wgmma_kernel<false><<<grid, 256, kSmem, stream>>>(steps_per_chain, steps, init, final_states, lr,
                                                                   0, 0);
  }
  check_cuda(cudaGetLastError(), "affine_chain (wgmma) launch");
}

}  // namespace hypic::kernels::cuda::detail
