// Hopper warpgroup MMA (wgmma, sm_90a) helpers shared by the kernels built for sm_90a (attention_wgmma.cu,
// moe_wgmma.cu): the shared-memory matrix descriptor of a 128-byte-swizzled operand, the wgmma fences, commit and
// wait, the generic-to-async proxy fence, and the register pin that keeps accumulators in place across an
// asynchronous wgmma. Device code only; include from sm_90a translation units. Source: PTX ISA, "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate Instructions" (matrix descriptor format, wgmma.fence /
// commit_group / wait_group) and "fence.proxy.async".
#pragma once
#include <cstdint>

namespace hypic::kernels::cuda::sm90 {

/// A wgmma shared-memory matrix descriptor with 128-byte swizzling: start address >> 4 in bits 0-13, leading byte
/// offset >> 4 in 16-29 (K-major swizzled operands ignore it: pass 16), stride byte offset >> 4 in 32-45 (1024 for
/// the next 8-row group of a K-major tile), base offset 0 (tiles 1024-byte aligned), bits 62-63 = 1 (128-byte
/// swizzle). The 18-bit shared address keeps (address >> 4) inside its 14-bit field, so adding (offset >> 4) to a
/// descriptor moves its start address.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
/// Waits until at most N committed wgmma groups of this warpgroup are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/// Shared memory written through the generic proxy (cp.async, plain stores) is read next by wgmma (async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
/// Keeps the compiler from moving accumulator registers across an asynchronous wgmma's issue and wait.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

}  // namespace hypic::kernels::cuda::sm90
