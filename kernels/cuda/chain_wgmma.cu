// affine_chain's 3xTF32 products on Hopper's warpgroup tensor-core instructions (sm_90a: wgmma.mma_async with
// tf32 operands from shared memory). Same arithmetic as affine_chain_tc_kernel (ops.cu): each fp32 operand split
// into a TF32 high part and a residual (detail::split_tf32), T R = T_hi R_hi + T_hi R_lo + T_lo R_hi, each product in
// its own fp32 accumulator, summed in the same order; only the order of the fp32 additions inside each tensor-core
// product differs. One block per (chain, head, 32-column block) as the mma.sync kernel; the two warpgroups own rows
// 0..63 and 64..127 of T, all 32 columns, and the accumulator layout per warp (rows 16 w + g, + 8; columns 8 n + 2 t,
// + 1) is that of the mma.sync tiles, so the running block R stays in registers exactly as there. T (hi and lo,
// [row][k]) and R^T (hi and lo, [column][k]) sit in shared memory in the 128-byte-swizzled K-major layout the wgmma
// descriptors name (PTX ISA, "Shared Memory Matrix Layout": 32 tf32 of k per 128-byte row, 8-row atoms of 1024
// bytes, K in chunks of 32); a step issues 16 k steps x 3 products (m64n32k8) per warpgroup and waits once, the
// next step's T having been fetched into registers meanwhile.
//
// Built for sm_90a only (kernels/cuda/CMakeLists.txt); ops.cu calls it on compute capability 9.0 devices.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/chain_wgmma.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace hypic::kernels::cuda::detail {
namespace {

using namespace sm90;

constexpr int D = 128;   // state rows (d_k) = T's size
constexpr int BN = 32;   // columns of R per block
constexpr int kTBytes = D * D * 4;    // one split copy of T, swizzled
constexpr int kRBytes = BN * D * 4;   // one split copy of R^T, swizzled
constexpr int kSmem = 2 * kTBytes + 2 * kRBytes + 1024;  // + slack for the 1024-byte alignment
constexpr int kTVec = D * D / 4 / 256;  // float4 of T per thread

// Byte offset of the 16-byte unit `unit` (k = 4 unit .. 4 unit + 3) of row `row` in a [ROWS][128] tf32 tile stored as
// four K chunks of [ROWS][128 bytes], the unit's place in its 128-byte row XOR-ed with row % 8.
template <int ROWS>
__device__ __forceinline__ uint32_t sw128(int row, int unit) {
  return static_cast<uint32_t>((unit >> 3) * (ROWS * 128) + row * 128 + (((unit & 7) ^ (row & 7)) << 4));
}

// d (64 x 32 fp32, accumulator layout) += A (64 x 8 tf32, K-major in shared memory, descriptor da) * B (8 x 32,
// K-major in shared memory, descriptor db): wgmma.mma_async m64n32k8, tf32 in, fp32 accumulate. Issued, not waited.
__device__ __forceinline__ void wgmma_m64n32k8_tf32(float (&d)[4][4], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db));
}

__global__ void __launch_bounds__(256, 1) affine_chain_wgmma_kernel(int steps_per_chain,
                                                                    const AffineStep* __restrict__ steps,
                                                                    const float* const* __restrict__ init,
                                                                    float* const* __restrict__ final_states) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int NT = BN / 8;  // accumulator tiles (8 columns) per warp
  extern __shared__ __align__(16) unsigned char chain_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(chain_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* sTh = base;                  // T hi, lo: [128 rows][128 k], swizzled
  unsigned char* sTl = sTh + kTBytes;
  unsigned char* sRh = sTl + kTBytes;         // R^T hi, lo: [32 columns][128 k], swizzled
  unsigned char* sRl = sRh + kRBytes;
  const uint32_t aTh = smem_u32(sTh), aTl = smem_u32(sTl), aRh = smem_u32(sRh), aRl = smem_u32(sRl);
  // Chain, head and column block from blockIdx.x (column blocks of one (chain, head) adjacent: they read the same T
  // at about the same time, from L2), heads from blockIdx.y.
  const int c = blockIdx.x / (D / BN), c0 = (blockIdx.x % (D / BN)) * BN, h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3, m0 = warp * 16;
  const int wg = warp >> 2;  // warpgroup: T rows 64 wg .. 64 wg + 63
  const size_t head_off = size_t(h) * D * D + c0;
  const AffineStep* chain = steps + size_t(c) * steps_per_chain;
  float4 tv[kTVec];
  auto fetch_T = [&](const float* T) {  // T's head h into registers (thread: row i >> 5, 4 columns, i = tid + 256 j)
    if (!T) return;
    T += size_t(h) * D * D;
#pragma unroll
    for (int j = 0; j < kTVec; ++j) tv[j] = __ldg(reinterpret_cast<const float4*>(T) + tid + 256 * j);
  };
  auto store_T = [&] {  // the fetched T, split, swizzled
#pragma unroll
    for (int j = 0; j < kTVec; ++j) {
      const int i = tid + 256 * j;
      const uint32_t o = sw128<D>(i >> 5, i & 31);
      const float x[4] = {tv[j].x, tv[j].y, tv[j].z, tv[j].w};
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) split_tf32(x[e], hi[e], lo[e]);
      *reinterpret_cast<uint4*>(sTh + o) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      *reinterpret_cast<uint4*>(sTl + o) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
  };
  // Element (row, col) of this lane's accumulator slot (n, i): row m0 + g + 8 (i >> 1), col 8 n + 2 t + (i & 1).
  auto off = [&](int n, int half) { return size_t(m0 + g + 8 * half) * D + 8 * n + 2 * t; };
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
  const float* R0 = init ? init[c] : nullptr;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float2 v = R0 ? *reinterpret_cast<const float2*>(R0 + head_off + off(n, half)) : make_float2(0.f, 0.f);
      cur[n][2 * half] = v.x, cur[n][2 * half + 1] = v.y;
    }
  // Every global read a step depends on is issued a step ahead: the step descriptors two ahead (the next T's address
  // is then in hand when its fetch starts), the next step's T (into registers) and S (its 32 columns).
  AffineStep st = steps_per_chain > 0 ? chain[0] : AffineStep{};
  AffineStep nxt = steps_per_chain > 1 ? chain[1] : AffineStep{};
  float2 sv[NT][2], sv_next[NT][2];
  auto load_S = [&](const float* S, float2 (&v)[NT][2]) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        v[n][half] = S ? __ldg(reinterpret_cast<const float2*>(S + head_off + off(n, half))) : make_float2(0.f, 0.f);
  };
  load_S(st.S, sv);
  if (st.T) {
    fetch_T(st.T);
    store_T();
  }
  store_R(cur);
  fence_proxy_async();  // the generic-proxy stores above are read by wgmma (async proxy)
  __syncthreads();
  for (int s = 0; s < steps_per_chain; ++s) {
    const AffineStep after = s + 2 < steps_per_chain ? chain[s + 2] : AffineStep{};
    const float* next_T = nxt.T;
    fetch_T(next_T);  // lands while this step multiplies
    load_S(nxt.S, sv_next);
    float acc[NT][4];
    if (st.T) {
      float cor[NT][4], cor2[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = cor[n][i] = cor2[n][i] = 0.f;
      pin<NT>(acc);
      pin<NT>(cor);
      pin<NT>(cor2);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 8; ++kk) {
        // k step kk: K chunk kk / 4 (32 k per 128-byte row), 32 bytes into it per k step of 8.
        const uint32_t ka = (kk >> 2) * (D * 128) + wg * 64 * 128 + (kk & 3) * 32;
        const uint32_t kb = (kk >> 2) * (BN * 128) + (kk & 3) * 32;
        const uint64_t dTh = sw128_desc(aTh + ka, 16, 1024), dTl = sw128_desc(aTl + ka, 16, 1024);
        const uint64_t dRh = sw128_desc(aRh + kb, 16, 1024), dRl = sw128_desc(aRl + kb, 16, 1024);
        wgmma_m64n32k8_tf32(cor, dTl, dRh);
        wgmma_m64n32k8_tf32(cor2, dTh, dRl);
        wgmma_m64n32k8_tf32(acc, dTh, dRh);
      }
      wgmma_commit();
      wgmma_wait<0>();
      pin<NT>(acc);
      pin<NT>(cor);
      pin<NT>(cor2);
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
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        cur[n][2 * half] = fmaf(st.alpha, acc[n][2 * half], sv[n][half].x);
        cur[n][2 * half + 1] = fmaf(st.alpha, acc[n][2 * half + 1], sv[n][half].y);
        if (st.out)
          *reinterpret_cast<float2*>(st.out + head_off + off(n, half)) =
              make_float2(cur[n][2 * half], cur[n][2 * half + 1]);
      }
    if (st.out && nxt.S == st.out)  // the next step adds what this one wrote: read a step early, it was stale
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int half = 0; half < 2; ++half) sv_next[n][half] = make_float2(cur[n][2 * half], cur[n][2 * half + 1]);
    if (s + 1 < steps_per_chain) {
      __syncthreads();  // both warpgroups' wgmmas have read this step's T and R copies
      if (next_T) store_T();
      store_R(cur);
      fence_proxy_async();
      __syncthreads();
    }
    st = nxt;
    nxt = after;
#pragma unroll
    for (int n = 0; n < NT; ++n) sv[n][0] = sv_next[n][0], sv[n][1] = sv_next[n][1];
  }
  float* F = final_states ? final_states[c] : nullptr;
  if (F) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<float2*>(F + head_off + off(n, half)) = make_float2(cur[n][2 * half], cur[n][2 * half + 1]);
  }
#else
  __trap();  // built for sm_90a only; affine_chain checks the device
#endif
}

}  // namespace

bool chain_wgmma_available() { return current_device_is_sm90(); }

void launch_affine_chain_wgmma(int num_chains, int heads, int steps_per_chain, const AffineStep* steps,
                               const float* const* init, float* const* final_states, cudaStream_t stream) {
  static DeviceOnce once;
  once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(affine_chain_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
               "affine_chain (wgmma) smem opt-in");
    return 0;
  });
  const dim3 grid(static_cast<unsigned>(num_chains) * (D / BN), heads);
  affine_chain_wgmma_kernel<<<grid, 256, kSmem, stream>>>(steps_per_chain, steps, init, final_states);
  check_cuda(cudaGetLastError(), "affine_chain (wgmma) launch");
}

}  // namespace hypic::kernels::cuda::detail
