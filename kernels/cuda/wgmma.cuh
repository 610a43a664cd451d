// Hopper warpgroup MMA (wgmma, sm_90a) helpers shared by the kernels built for sm_90a (attention_wgmma.cu,
// moe_wgmma.cu, gdn_wgmma.cu): the shared-memory matrix descriptor of a 128-byte-swizzled operand, the
// wgmma shapes several of them use, the wgmma fences, commit and wait, the generic-to-async proxy fence, the
// register pin that keeps accumulators in place across an asynchronous wgmma, and the synchronisation of
// warp-specialised kernels (mbarriers, cp.async completion arrivals, named barriers, warpgroup register
// reallocation), and the tensor-memory-accelerator (TMA) tile load that completes on an mbarrier. Device code only;
// its functions are emitted only where sm_90a code calls them. Source: PTX ISA, "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate Instructions" (matrix descriptor format, wgmma.fence / commit_group / wait_group),
// "fence.proxy.async", "mbarrier" (incl. expect-tx), "cp.async.mbarrier.arrive", "cp.async.bulk.tensor",
// "bar.sync / bar.arrive" and "setmaxnreg".
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

/// pin for register fragments (wgmma A operands): keeps them live, unchanged, up to this point.
template <int N>
__device__ __forceinline__ void pin_u(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

// d (64 x 128 fp32, accumulator layout) += A (64 x 16 bf16 in registers, the mma.m16n8k16 A-fragment layout per
// warp) * B (16 x 128, MN-major in shared memory, descriptor db): wgmma.mma_async m64n128k16 with trans-b. Issued,
// not waited for.
__device__ __forceinline__ void wgmma_m64n128k16_rs_tb(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// d (64 x 64 fp32, accumulator layout) += A (64 x 16 bf16 in registers, the mma.m16n8k16 A-fragment layout per
// warp: warp w of the warpgroup rows 16 w ..) * B (16 x 64, K-major in shared memory, descriptor db):
// wgmma.mma_async m64n64k16, bf16 in, fp32 accumulate. Issued, not waited for.
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// d (64 x 64 fp32, accumulator layout) = (scale_d ? d : 0) + A (64 x 16, K-major in shared memory, descriptor da)
// * B (16 x 64, K-major in shared memory, descriptor db): wgmma.mma_async m64n64k16, bf16 in, fp32 accumulate.
// Issued, not waited for.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(da), "l"(db), "r"(scale_d));
}

// d (64 x 128 fp32, accumulator layout) = (scale_d ? d : 0) + A (64 x 16, K-major in shared memory, descriptor da)
// * B (16 x 128, MN-major in shared memory, descriptor db): wgmma.mma_async m64n128k16 with trans-b, bf16 in, fp32
// accumulate. Issued, not waited for.
__device__ __forceinline__ void wgmma_m64n128k16_ss_tb(float (&d)[16][4], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(da), "l"(db), "r"(scale_d));
}

/// One synchronous batch of wgmmas into the accumulator d: fence, issue() (the wgmma calls), commit, wait for them;
/// d pinned on both sides. For products whose operands all come from shared memory (register A operands need their
/// own pins until the wait).
template <int N, class Issue>
__device__ __forceinline__ void wgmma_batch(float (&d)[N][4], Issue&& issue) {
  pin(d);
  wgmma_fence();
  issue();
  wgmma_commit();
  wgmma_wait<0>();
  pin(d);
}

/// wgmma_batch for products with register A operands `a` (N2 k-steps of fragments): they are pinned too, before the
/// fence and until the wait (the wgmmas read them asynchronously).
template <int N, int N2, class Issue>
__device__ __forceinline__ void wgmma_batch_rs(float (&d)[N][4], uint32_t (&a)[N2][4], Issue&& issue) {
  pin(d);
  pin_u(a);
  wgmma_fence();
  issue();
  wgmma_commit();
  wgmma_wait<0>();
  pin(d);
  pin_u(a);
}

/// Shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// An mbarrier (8 bytes of shared memory) expecting `count` arrivals per phase; one thread initialises, then the
/// block synchronises before anyone uses it.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
/// One arrival (release semantics: this thread's earlier memory accesses happen before the phase completes).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_u32(bar)) : "memory");
}
/// Waits until the phase of parity `parity` (0 for the first phase, then alternating) has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n" ::"r"(
          smem_u32(bar)),
      "r"(parity)
      : "memory");
}
/// An arrival on `bar` made when every cp.async this thread issued so far has completed (counted among the
/// barrier's expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
/// 16 bytes global -> shared through the L2 only; src_bytes 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16_zfill(uint32_t saddr, const void* gmem, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gmem), "r"(src_bytes) : "memory");
}
/// One arrival on `bar` that also raises the bytes its current phase waits for by `bytes` (the TMA loads that will
/// complete on it: mbarrier.arrive.expect_tx).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
/// TMA load of the box at coordinates (c0 innermost, c1, c2) of the 3-D tensor map `map` (a __grid_constant__
/// kernel parameter, created by cuTensorMapEncodeTiled) into shared memory at `saddr` (aligned as the map's swizzle
/// needs: 1024 bytes for 128-byte swizzling); the bytes complete on `bar` (complete_tx). Elements outside the tensor
/// are written as zeros.
__device__ __forceinline__ void tma_load_3d(uint32_t saddr, const void* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(saddr),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}
/// Bulk copy (TMA, no tensor map) of `bytes` contiguous bytes of global memory at `gmem` into shared memory at
/// `saddr`; both 16-byte aligned, bytes a multiple of 16; the bytes complete on `bar` (PTX ISA, cp.async.bulk,
/// .mbarrier::complete_tx::bytes).
__device__ __forceinline__ void bulk_load(uint32_t saddr, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(saddr),
               "l"(gmem), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
/// tma_load_3d for a 5-D tensor map: the box at coordinates (c0 innermost .. c4).
__device__ __forceinline__ void tma_load_5d(uint32_t saddr, const void* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, "
      "%6}], [%7];\n" ::"r"(saddr),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(smem_u32(bar))
      : "memory");
}
/// tma_load_3d multicast to the CTAs of the cluster named by the bits of `cta_mask`: the box lands at `saddr` in each
/// of them and its bytes complete on the mbarrier at `bar`'s offset in each (PTX ISA, cp.async.bulk.tensor,
/// .multicast::cluster). Launch with a cluster dimension; every destination expects the bytes (expect_tx).
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t saddr, const void* map, uint64_t* bar, int c0, int c1,
                                                      int c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(saddr),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar)), "h"(cta_mask)
      : "memory");
}
/// This CTA's rank in its cluster (%cluster_ctarank: 0 without a cluster launch).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
/// The shared::cluster address of `p` (an address in this CTA's shared memory) in CTA `cta` of the cluster (mapa).
__device__ __forceinline__ uint32_t cluster_addr(const void* p, uint32_t cta) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_u32(p)), "r"(cta));
  return r;
}
/// One arrival on the mbarrier at `bar`'s offset in CTA `cta` of the cluster (this CTA's own rank arrives locally),
/// with the default semantics (release at CTA scope, as CUTLASS's ClusterBarrier::arrive): enough to hand a slot
/// whose reads were the async proxy's (wgmma) back to a peer's TMA; `cluster_release` orders this thread's earlier
/// writes at cluster scope (for data the peer reads after its wait: mbar_wait_cluster), which costs a fence that waits
/// for the thread's outstanding stores.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta, bool cluster_release = false) {
  if (cluster_release)
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr(bar, cta))
                 : "memory");
  else
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr(bar, cta)) : "memory");
}
/// mbar_wait with acquire semantics at cluster scope (the phase's arrivals came from other CTAs of the cluster).
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAITC:\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n@!p bra "
      "WAITC;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
/// 16 bytes (an int4) into the shared memory of CTA `cta` of the cluster, at `p`'s offset.
__device__ __forceinline__ void st_cluster_v4(const void* p, uint32_t cta, int4 v) {
  asm volatile("st.shared::cluster.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(cluster_addr(p, cta)), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}
/// Every thread of every CTA of the cluster arrives and waits (barrier.cluster, release / acquire): for the start
/// (mbarriers initialised before a peer uses them) and the end (no CTA exits while a peer may still reach its shared
/// memory).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
/// Named barrier `id` (1..15; 0 is __syncthreads) over `count` threads (a multiple of 32): sync waits, arrive
/// does not.
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
/// Warpgroup register reallocation (all 128 threads of the warpgroup execute it): lower / raise this warpgroup's
/// per-thread register budget to N (a multiple of 8 in [24, 256]).
template <int N>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace hypic::kernels::cuda::sm90
