// Device core of the weight-streaming GEMMs of decode (decode_linear.cu: dense projections; moe_decode.cu: the
// routed and shared experts): y^T = W x^T for a few tokens, bound by reading W once at memory bandwidth.
//
// The problem is transposed: the weight rows are the mma M dimension (16 per m16n8k16 A fragment), the tokens the
// N dimension (groups of 8). A warp owns 16 weight rows (A rows 0..7 at `wlo`, 8..15 at `whi`) over a contiguous
// slice of K in chunks of 32. Its weights and x stream through a per-warp ring in shared memory of S stages (one
// chunk each), filled by cp.async (16 bytes per lane per row half: lane (g = lane / 4, q = lane % 4) copies W[row
// g][k0 + 8q .. + 7] and W[row g + 8][same], and with two or more token groups for each group t the same k of x
// row 8t + g) and read back by the same lane, so the loads in flight cost no registers and there are no bank
// conflicts (stream_stage_uint4 says when x is staged). The mma only needs A and B to use one permutation of k inside each k16 step: step s (0, 1)
// of a chunk puts k0 + 8q + 4s + {0, 1} at fragment k-positions 2q, 2q+1 and k0 + 8q + 4s + {2, 3} at 2q+8, 2q+9
// (a bijection of the chunk's 32 k onto the two steps' positions), i.e. a = {wlo.w[2s], whi.w[2s], wlo.w[2s+1],
// whi.w[2s+1]}, b = {x.w[2s], x.w[2s+1]} in 32-bit words. Accumulators: acc[t][h] = (A row g, token 8t + 2q + h),
// acc[t][2 + h] = (A row g + 8, same token), fp32, summed over the warp's chunks in ascending k.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/pdl.cuh"

namespace hypic::kernels::cuda::detail {

constexpr int kStreamThreads = 256;                         // threads of every weight-streaming block
constexpr int kStreamWarps = kStreamThreads / 32;
constexpr int kStreamChunk = 32;                            // k per chunk
constexpr int kStreamStages = 8;                            // the ring depth stream_k_slices plans for

/// 16-byte words of one ring stage with NT token groups: W rows lo and hi, then (NT >= 2) x of each group (32 lanes
/// each). With one token group x stays out of the ring (read through L1 in the loop): a stage of W alone keeps 3
/// blocks per SM and more weight bytes in flight, which measured faster at batch 1 (a GDN layer's 50 MB in_proj
/// 20 us against 34 us with x in the ring), while from 9 tokens on the staged x won (batch 16: MoE gate_up 124 us
/// against 137).
/// Layout of a warp's ring of S stages: the weight region first (stage s: W rows lo at 64 s, hi at 64 s + 32), then
/// (NT >= 2) the x region (stage s, group t at 64 S + 32 (s NT + t)), so a ring's first stages hold the same weight
/// words whatever NT: a caller that learns after stream_prologue<NT, S> that only one token group has rows may turn
/// the whole ring into W-only stages (stream_prologue_extend, then stream_consume<1, ..>).
__host__ __device__ constexpr int stream_stage_uint4(int nt) { return (nt == 1 ? 2 : 2 + nt) * 32; }
constexpr int kStreamWStage = 64;  // 16-byte words of a stage's weights (rows lo, hi)
/// Dynamic shared memory of a block whose warps have rings of `stages` stages with NT token groups.
__host__ __device__ constexpr int stream_smem_bytes(int stages, int nt) {
  return kStreamWarps * stages * stream_stage_uint4(nt) * 16;
}
/// Blocks per SM that such a block's shared memory allows on sm_90 (227 KiB per SM), at most 3: its
/// __launch_bounds__ minimum.
__host__ __device__ constexpr int stream_blocks_per_sm(int stages, int nt) {
  return 227 * 1024 / stream_smem_bytes(stages, nt) >= 3 ? 3 : 227 * 1024 / stream_smem_bytes(stages, nt) >= 2 ? 2 : 1;
}

/// K slices per row group for a K of `kt` chunks: the largest of 8, 4, 2, 1 that leaves each warp at least
/// kStreamStages chunks (1 when K is shorter than that). Host and device.
__host__ __device__ constexpr int stream_k_slices(int kt) {
  return kt >= 8 * kStreamStages ? 8 : kt >= 4 * kStreamStages ? 4 : kt >= 2 * kStreamStages ? 2 : 1;
}

/// K slices for a launch of `row_groups` row groups (16 weight rows each) over `kt` chunks, when `slots` blocks fit
/// the device at once (SMs x blocks per SM): the most slices up to stream_k_slices(kt) whose grid (row_groups /
/// (8 / slices) blocks) still fits one wave, since a block's fixed costs (its launch, tile lookups, first copies,
/// the slices' reduction) are paid once per wave; when no choice fits one wave, stream_k_slices(kt) (many waves
/// either way). The slices fix each output's fp32 summation order: callers pass arguments that do not depend on the
/// batch (the batch-1 grid), so that a token's result does not either. Host only.
inline int stream_k_slices_for(int kt, long row_groups, long slots) {
  for (int ks = stream_k_slices(kt); ks >= 1; ks /= 2) {
    const long blocks = (row_groups + kStreamWarps / ks - 1) / (kStreamWarps / ks);
    if (blocks <= slots) return ks;
  }
  return stream_k_slices(kt);
}

__device__ __forceinline__ void cp_async16_stream(uint4* smem, const __nv_bfloat16* gmem) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit_stream() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_stream() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/// Issues the weight copies of the first S chunks of [kb, ke) into a warp's ring of S stages of NT token groups
/// (one commit group per stage, empty or not). wlo / whi: the lane's weight rows (A rows g and g + 8) with + 8q
/// applied. Weights are never written during a step, so this may run before griddep_wait() (pdl.cuh).
template <int NT, int S>
__device__ __forceinline__ void stream_prologue(const __nv_bfloat16* wlo, const __nv_bfloat16* whi, int kb, int ke,
                                                uint4* ring, int lane) {
  const int n = ke - kb;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (s < n) {
      cp_async16_stream(ring + s * kStreamWStage + lane, wlo + (kb + s) * kStreamChunk);
      cp_async16_stream(ring + s * kStreamWStage + 32 + lane, whi + (kb + s) * kStreamChunk);
    }
    cp_async_commit_stream();  // the waits below count groups
  }
}

/// After stream_prologue<NT, S>: the weight copies of chunks S .. S1 - 1 into W-only stages S .. S1 - 1 (one commit
/// group each), which makes it stream_prologue<1, S1> on the same arguments; the ring must hold S1 W-only stages
/// (S1 * kStreamWStage words: S stages of NT >= 2 groups hold S * stream_stage_uint4(NT) / kStreamWStage).
template <int S, int S1>
__device__ __forceinline__ void stream_prologue_extend(const __nv_bfloat16* wlo, const __nv_bfloat16* whi, int kb,
                                                       int ke, uint4* ring, int lane) {
  const int n = ke - kb;
#pragma unroll
  for (int s = S; s < S1; ++s) {
    if (s < n) {
      cp_async16_stream(ring + s * kStreamWStage + lane, wlo + (kb + s) * kStreamChunk);
      cp_async16_stream(ring + s * kStreamWStage + 32 + lane, whi + (kb + s) * kStreamChunk);
    }
    cp_async_commit_stream();
  }
}

/// The start of stream_consume's loop over the K slice [kb, kb + n): with NT >= 2 the x copies of the first S chunks
/// into the x region (stage s, group t at 32 (s NT + t)), then one commit group (empty with one token group) and the
/// wait before chunk 0. Commit order: W of stages 0..S-1, this x group, then one group per chunk (the refill of chunk
/// i + S). Chunk 0 needs W of stage 0 and, with x in the ring, the x group (the last): wait_group S (one token group:
/// at most S of the S + 1 pending, so the oldest is done) or 0. Chunk i >= 1 needs W of stage i (i < S) or refill
/// group i - S, which wait_group S - 1 guarantees (at most S - 1 of the S + 1 + i groups pending: the oldest i + 2 are
/// done).
template <int NT, int S>
__device__ __forceinline__ void stream_x_first(const __nv_bfloat16* const (&xp)[NT], int ntl, int kb, int n,
                                               uint4* xring, int lane) {
  if constexpr (NT >= 2) {
#pragma unroll
    for (int s = 0; s < S; ++s)
      if (s < n) {
        const int k = (kb + s) * kStreamChunk;
#pragma unroll
        for (int t = 0; t < NT; ++t)
          if (t < ntl) cp_async16_stream(xring + (s * NT + t) * 32 + lane, xp[t] + k);
      }
  }
  cp_async_commit_stream();
  if constexpr (NT >= 2)
    cp_async_wait_stream<0>();
  else
    cp_async_wait_stream<S>();
}

/// After stream_prologue<NT, S> on the same arguments (and, with PDL, griddep_wait: x may come from the previous
/// kernel): copies x of the first S chunks (one more commit group; NT >= 2), then acc += W[rows][k] x[tokens][k] over
/// chunks
/// [kb, ke) (k = 32 c ..) for token groups t < ntl (xp[t]: the lane's x row 8t + g, + 8q applied, 16-byte aligned;
/// rows past the count may point at any valid row, their results are not stored; with NT = 1 read in the loop
/// through L1, so x must not change while the kernel runs), refilling each stage with the weights (and x)
/// of chunk + S once consumed. Returns with no copy in flight (the ring is free).
/// XD (NT = 1 only; HYPIC_STREAM_X_AHEAD): x of chunk i is loaded XD chunks ahead into a queue of XD registers
/// (16 bytes each), so that its L2 round trip overlaps the waits and products of the chunks before it instead of
/// following each stage's wait (a load issued after the wait stays after it: both are ordered asm); the same
/// products in the same order: the same bits as XD = 0.
/// The x register queue's depth of the one-token-group weight streams (HYPIC_STREAM_X_AHEAD: decode_linear and the
/// MoE decode GEMMs).
constexpr int kStreamXAhead = 4;

template <int NT, int S, int XD = 0>
__device__ __forceinline__ void stream_consume(const __nv_bfloat16* wlo, const __nv_bfloat16* whi, int kb, int ke,
                                               const __nv_bfloat16* const (&xp)[NT], int ntl, uint4* ring, int lane,
                                               float (&acc)[NT][4]) {
  constexpr bool kXInRing = NT >= 2;
  static_assert(XD == 0 || NT == 1, "x ahead in registers is the one-token-group path");
  if constexpr (XD > 0) {
    const int n = ke - kb;
    uint4 xq[XD];
#pragma unroll
    for (int d = 0; d < XD; ++d)
      xq[d] = d < n ? __ldca(reinterpret_cast<const uint4*>(xp[0] + (kb + d) * kStreamChunk)) : make_uint4(0, 0, 0, 0);
    stream_x_first<NT, S>(xp, ntl, kb, n, ring + S * kStreamWStage, lane);  // (the empty x group)
    for (int i0 = 0; i0 < n; i0 += XD) {
#pragma unroll
      for (int d = 0; d < XD; ++d) {
        const int i = i0 + d;
        if (i < n) {
          if (i > 0) cp_async_wait_stream<S - 1>();
          uint4* st = ring + (i % S) * kStreamWStage;
          const uint4 wl = st[lane], wh = st[32 + lane];
          const uint32_t a0[4] = {wl.x, wh.x, wl.y, wh.y};
          const uint32_t a1[4] = {wl.z, wh.z, wl.w, wh.w};
          mma_bf16(acc[0], a0, xq[d].x, xq[d].y);
          mma_bf16(acc[0], a1, xq[d].z, xq[d].w);
          if (i + XD < n) xq[d] = __ldca(reinterpret_cast<const uint4*>(xp[0] + (kb + i + XD) * kStreamChunk));
          if (i + S < n) {
            const int k1 = (kb + i + S) * kStreamChunk;
            cp_async16_stream(st + lane, wlo + k1);
            cp_async16_stream(st + 32 + lane, whi + k1);
          }
          cp_async_commit_stream();
        }
      }
    }
    cp_async_wait_stream<0>();
    return;
  }
  uint4* const xring = ring + S * kStreamWStage;  // the x region (NT >= 2): stage s, group t at 32 (s NT + t)
  const int n = ke - kb;
  stream_x_first<NT, S>(xp, ntl, kb, n, xring, lane);
  for (int i = 0; i < n; ++i) {
    if (i > 0) cp_async_wait_stream<S - 1>();
    uint4* st = ring + (i % S) * kStreamWStage;
    uint4* sx = xring + (i % S) * NT * 32;
    const uint4 wl = st[lane], wh = st[32 + lane];
    const uint32_t a0[4] = {wl.x, wh.x, wl.y, wh.y};
    const uint32_t a1[4] = {wl.z, wh.z, wl.w, wh.w};
    const int k0 = (kb + i) * kStreamChunk;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < ntl) {
        uint4 xv;
        if constexpr (kXInRing)
          xv = sx[t * 32 + lane];
        else  // a coherent load: x may be the previous kernel's output (read after griddep_wait)
          xv = __ldca(reinterpret_cast<const uint4*>(xp[t] + k0));
        mma_bf16(acc[t], a0, xv.x, xv.y);
        mma_bf16(acc[t], a1, xv.z, xv.w);
      }
    }
    // The stage's words were consumed by the mma above (in registers) before this lane refills them.
    if (i + S < n) {
      const int k1 = k0 + S * kStreamChunk;
      cp_async16_stream(st + lane, wlo + k1);
      cp_async16_stream(st + 32 + lane, whi + k1);
      if constexpr (kXInRing) {
#pragma unroll
        for (int t = 0; t < NT; ++t)
          if (t < ntl) cp_async16_stream(sx + t * 32 + lane, xp[t] + k1);
      }
    }
    cp_async_commit_stream();
  }
  cp_async_wait_stream<0>();
}

/// Adds the K-slice partial sums of a block's warps (warp w = row group w / ks_count, slice w % ks_count) into the
/// slice-0 warp of each row group, in ascending slice order (fixed: bit-identical from run to run). Every thread of
/// the block calls it; ring_all: the block's rings of `ring_uint4` words per warp (each warp's partials go to its
/// own, free after stream_consume; at least NT * 32 words).
/// Returns true for the lanes that hold the row group's sums (slice 0).
template <int NT, int kRingUint4>
__device__ __forceinline__ bool stream_reduce(float (&acc)[NT][4], int ntl, int ks_count, uint4* ring_all) {
  static_assert(NT * 4 * 32 <= kRingUint4 * 4, "partials fit a warp's ring");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, ks = warp % ks_count;
  if (ks_count == 1) return true;
  float* red = reinterpret_cast<float*>(ring_all);
  constexpr int kWarpFloats = kRingUint4 * 4;
  __syncwarp();  // every lane's last read of its ring words is done before any lane writes partials over them
  if (ks != 0) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < ntl)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp * kWarpFloats + (t * 4 + i) * 32 + lane] = acc[t][i];
  }
  __syncthreads();
  if (ks != 0) return false;
  for (int s = 1; s < ks_count; ++s)
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < ntl)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] += red[(warp + s) * kWarpFloats + (t * 4 + i) * 32 + lane];
  return true;
}

}  // namespace hypic::kernels::cuda::detail
