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
// Shared memory of the kernel without / with low-rank steps (+ slack for the 1024-byte alignment).
// The step descriptors two ahead, fetched a step earlier still by cp.async into a ring of 4 (kDescBytes).
// (B: the last 8 bytes hold the mbarrier the staged T's bulk copies complete on.)
constexpr int kDescBytes = 256;
static_assert(4 * sizeof(AffineStep) + 8 <= kDescBytes, "the descriptor ring and the T mbarrier fit their bytes");
constexpr int kSmem = 2 * kRBytes + kStageBytes + kDescBytes + 1024, kSmemLowRank = kSmem + kLowRankBytes;
static_assert(sizeof(AffineStep) % 8 == 0 && alignof(AffineStep) == 8, "descriptors copied 8 bytes at a time");

// The step descriptor d (global memory, 8-byte aligned) into shared memory by 8-byte cp.async (one thread; the caller
// commits).
__device__ __forceinline__ void copy_desc_async(AffineStep* dst, const AffineStep* d) {
#pragma unroll
  for (int i = 0; i < int(sizeof(AffineStep)) / 8; ++i)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(reinterpret_cast<char*>(dst) + 8 * i)),
                 "l"(reinterpret_cast<const char*>(d) + 8 * i));
}
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

// LR: the chain has low-rank steps (their shared memory and code; without, a step with lr_len > 0 traps). V2
// (HYPIC_CHAIN_SMEM_DESC, a measured default): shared memory addressed as such (LDS / STS instead of generic loads
// and stores) and the step descriptors fetched into shared memory a step earlier; the same arithmetic, the same bits.
// B (HYPIC_CHAIN_T_BULK, a candidate; with V2 only): the next T staged by one bulk copy per thread (cp.async.bulk of
// half a 512-byte row, completing on an mbarrier of 256 arrivals) instead of 16 cp.async per thread (Nsight Compute
// found the step's cp.async issue waiting on the LSU queue): the same bytes in the same place, the same bits. (One
// warp issuing all 128 rows measured no better in registers: the divergent issue spilled 48-216 bytes.)
template <bool LR, bool V2, bool B = false>
__global__ void __launch_bounds__(256, 1) affine_chain_wgmma_kernel(int steps_per_chain,
                                                                    const AffineStep* __restrict__ steps,
                                                                    const float* const* __restrict__ init,
                                                                    float* const* __restrict__ final_states,
                                                                    ChainLowRankFactors lr, int lr_prefetch) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int NT = BN / 8;  // accumulator tiles (8 columns) per warp
  extern __shared__ __align__(16) unsigned char chain_raw[];
  // (offset from the __shared__ array itself, not through an integer: the compiler then knows every pointer below is
  // shared memory and emits LDS / STS; through uintptr_t they were generic loads and stores, each a long-scoreboard
  // wait in Nsight Compute's samples of this kernel)
  unsigned char* base =
      V2 ? chain_raw + ((1024u - (smem_u32(chain_raw) & 1023u)) & 1023u)
         : reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(chain_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* sRh = base;  // R^T hi, lo: [32 columns][128 k], swizzled
  unsigned char* sRl = sRh + kRBytes;
  float* sStage = reinterpret_cast<float*>(sRl + kRBytes);  // the next step's T, fp32 [128][kLdT]
  AffineStep* sDesc = reinterpret_cast<AffineStep*>(sStage + D * kLdT);  // step s + 2's descriptor at (s + 2) % 4
  float* sRf = sStage + D * kLdT + kDescBytes / 4;  // (LR) low-rank steps: R in fp32, then their staging
  float* sLr = sRf + D * kLdRf;
  unsigned char* sRaw = reinterpret_cast<unsigned char*>(sLr + kChainLowRankSmemFloats);  // a prefetched step's factors
  // (B) the mbarrier of the T staging (recomputed from sDesc where used: no register kept for it), and the parity of
  // the staging the next load_frags consumes
  auto tbar = [&] { return reinterpret_cast<uint64_t*>(reinterpret_cast<unsigned char*>(sDesc) + kDescBytes - 8); };
  uint32_t tphase = 0;
  const uint32_t aRh = smem_u32(sRh), aRl = smem_u32(sRl);
  // Chain and column block from blockIdx.x (the column blocks of one (chain, head) adjacent: they read the same T at
  // about the same time, from L2), head from blockIdx.y.
  const int c = blockIdx.x / (D / BN), c0 = (blockIdx.x % (D / BN)) * BN, h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3, m0 = warp * 16;
  const ChainTile<NT> tile(h, c0, warp, lane);
  const AffineStep* chain = steps + size_t(c) * steps_per_chain;
  auto stage_T = [&](const float* T) {  // T's head h into the staging buffer (cp.async: the caller commits; B: bulk)
    T += size_t(h) * D * D;
    if constexpr (B) {
      // Every thread half a row (256 bytes): its bytes announced on the mbarrier (one of its 256 arrivals), then copied.
      const int row = tid >> 1, col = (tid & 1) * (D / 2);
      mbar_arrive_expect_tx(tbar(), D / 2 * 4);
      bulk_load(smem_u32(sStage + row * kLdT + col), T + row * D + col, D / 2 * 4, tbar());
    } else {
#pragma unroll
      for (int j = 0; j < D * D / 4 / 256; ++j) {
        const int i = tid + 256 * j, row = i >> 5, col = (i & 31) * 4;
        cp_async16(sStage + row * kLdT + col, T + row * D + col);
      }
    }
  };
  uint32_t th[KS][4], tl[KS][4];  // this thread's A fragments of T, hi and lo
  auto wait_T = [&] {  // (B, before the barrier ahead of load_frags) the bulk copies of the staged T landed
    if constexpr (B) {
      mbar_wait(tbar(), tphase);
      tphase ^= 1;
    }
  };
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
  if constexpr (B) {
    if (tid == 0) {
      mbar_init(tbar(), 256);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  float cur[NT][4];
  tile.load(cur, init ? init[c] : nullptr);
  // Every global read a step depends on is issued a step ahead: the step descriptors two ahead (the next T's address
  // is then in hand when its copy starts; fetched into shared memory a step before that, so that reading one is no
  // L2 round trip at the top of a step: Nsight Compute found the step's first instructions waiting on that load), the
  // next step's T (into the staging buffer) and S (its 32 columns).
  AffineStep st = steps_per_chain > 0 ? chain[0] : AffineStep{};
  AffineStep nxt = steps_per_chain > 1 ? chain[1] : AffineStep{};
  if (V2 && tid == 0 && steps_per_chain > 2) copy_desc_async(sDesc + 2, chain + 2);
  float2 sv[NT][2], sv_next[NT][2];
  tile.load_S(sv, st.S);
  if (st.T) {
    stage_T(st.T);
    cp_async_commit();
    cp_async_wait<0>();
    wait_T();
    __syncthreads();
    load_frags();
  }
  store_R(cur);
  if constexpr (V2) {
    cp_async_commit();
    cp_async_wait<0>();  // (step 2's descriptor)
  }
  fence_proxy_async();  // the generic-proxy stores above are read by wgmma (async proxy)
  __syncthreads();      // (also: every thread has read its fragments before the staging buffer is refilled)
  // The step whose T sits (or lands) in the staging buffer, not yet in fragments (-1: the buffer is free). When the
  // next step has no T (a low-rank or identity step), the T of the step after it is staged a step early, so that a
  // short low-rank step does not wait for the 64 KB of T behind it. (Issuing that copy after this step's math instead,
  // when the descriptor read at the top is surely in, measured slower: 151.6 against 137.0 us per splice chain, H100.)
  int staged = -1;
  int prefetched = -1;  // (LR) the low-rank step whose first factors sRaw holds (fetched during the step before it)
  for (int s = 0; s < steps_per_chain; ++s) {
    const AffineStep after = s + 2 >= steps_per_chain ? AffineStep{} : V2 ? sDesc[(s + 2) & 3] : chain[s + 2];
    // (V2: lands by the end of this step's copies, which the step waits for before the next one reads it)
    if (V2 && tid == 0 && s + 3 < steps_per_chain) copy_desc_async(sDesc + ((s + 3) & 3), chain + s + 3);
    if constexpr (!LR) {
      if (st.lr_len > 0) __trap();  // (a low-rank step in a chain given no factors: affine_chain documents the trap)
    }
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
    }
    cp_async_commit();
    tile.load_S(sv_next, nxt.S);
    float acc[NT][4];
    if (LR && st.lr_len > 0) {  // a low-rank step on an fp32 copy of the block (the previous step's barrier is behind)
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
    if (!(LR && st.lr_len > 0)) tile.step(cur, acc, sv, st.alpha, st.out);
    if (st.out && nxt.S == st.out)  // the next step adds what this one wrote: read a step early, it was stale
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int half = 0; half < 2; ++half) sv_next[n][half] = make_float2(cur[n][2 * half], cur[n][2 * half + 1]);
    if (s + 1 < steps_per_chain) {
      cp_async_wait<0>();
      if (staged == s + 1) wait_T();
      __syncthreads();  // the next T staged by every thread; both warpgroups' wgmmas have read this step's R copy
      if (staged == s + 1) {
        load_frags();
        staged = -1;
      }
      store_R(cur);
      fence_proxy_async();
      __syncthreads();  // the new R copy visible; every thread has read its fragments (the staging buffer is free)
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
    auto allow = [](const void* kernel, int bytes) {
      check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                 "affine_chain (wgmma) smem opt-in");
    };
    allow(reinterpret_cast<const void*>(affine_chain_wgmma_kernel<false, false>), kSmem);
    allow(reinterpret_cast<const void*>(affine_chain_wgmma_kernel<false, true>), kSmem);
    allow(reinterpret_cast<const void*>(affine_chain_wgmma_kernel<true, false>), kSmemLowRank);
    allow(reinterpret_cast<const void*>(affine_chain_wgmma_kernel<true, true>), kSmemLowRank);
    allow(reinterpret_cast<const void*>(affine_chain_wgmma_kernel<false, true, true>), kSmem);
    allow(reinterpret_cast<const void*>(affine_chain_wgmma_kernel<true, true, true>), kSmemLowRank);
    return 0;
  });
  const dim3 grid(static_cast<unsigned>(num_chains) * (D / BN), heads);
  static CandidateSwitch lr_prefetch("HYPIC_CHAIN_LR_PREFETCH");
  static CandidateSwitch smem_desc("HYPIC_CHAIN_SMEM_DESC");
  static CandidateSwitch t_bulk("HYPIC_CHAIN_T_BULK");
  const bool v2 = smem_desc.on(), bulk = v2 && t_bulk.on();
  const int prefetch = lr.W && lr_prefetch.on() ? 1 : 0;
  auto kernel = lr.W ? (bulk ? affine_chain_wgmma_kernel<true, true, true>
                        : v2 ? affine_chain_wgmma_kernel<true, true>
                             : affine_chain_wgmma_kernel<true, false>)
                     : (bulk ? affine_chain_wgmma_kernel<false, true, true>
                        : v2 ? affine_chain_wgmma_kernel<false, true>
                             : affine_chain_wgmma_kernel<false, false>);
  kernel<<<grid, 256, lr.W ? kSmemLowRank : kSmem, stream>>>(steps_per_chain, steps, init, final_states, lr, prefetch);
  check_cuda(cudaGetLastError(), "affine_chain (wgmma) launch");
}

}  // namespace hypic::kernels::cuda::detail
