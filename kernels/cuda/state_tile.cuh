// Warp-level pieces of the chunked linear-attention scans (lightning.cu, kda.cu): a block of four warps carries 64
// columns of a d x d fp32 state (or transition) across the chunks in mma.sync accumulators, warp w owning rows
// w d/4 .. (w + 1) d/4 - 1 as MT = d / 64 tiles of 16 rows (rb = w d / 4); the tensor cores get the state back as bf16
// through shared memory. Accumulator layout: mma.cuh (lane l: row g = l / 4 and g + 8, columns 2 (l % 4) and + 1).
#pragma once
#include <cfloat>
#include <cstdint>

#include "kernels/cuda/mma.cuh"

namespace hypic::kernels::cuda::detail {

/// The tile's values of rows rb.. and columns v0 .. v0 + 63 of src ([rows][ld] fp32 row-major); src == nullptr gives
/// zero, or the identity's columns when `identity`.
template <int MT>
__device__ __forceinline__ void state_tile_load(float (&acc)[MT][8][4], const float* src, int ld, int rb, int v0,
                                                int lane, bool identity = false) {
  const int g = lane >> 2, cq = (lane & 3) * 2;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int row = rb + 16 * mt + g, col = v0 + 8 * nt + cq;
      float2 a = make_float2(0.f, 0.f), b = a;
      if (src) {
        a = *reinterpret_cast<const float2*>(src + size_t(row) * ld + col);
        b = *reinterpret_cast<const float2*>(src + size_t(row + 8) * ld + col);
      } else if (identity) {
        a = make_float2(row == col ? 1.f : 0.f, row == col + 1 ? 1.f : 0.f);
        b = make_float2(row + 8 == col ? 1.f : 0.f, row + 8 == col + 1 ? 1.f : 0.f);
      }
      acc[mt][nt][0] = a.x, acc[mt][nt][1] = a.y, acc[mt][nt][2] = b.x, acc[mt][nt][3] = b.y;
    }
}

/// Writes the tile to rows rb.. and columns v0 .. v0 + 63 of dst ([rows][ld] fp32 row-major).
template <int MT>
__device__ __forceinline__ void state_tile_store(const float (&acc)[MT][8][4], float* dst, int ld, int rb, int v0,
                                                 int lane) {
  const int g = lane >> 2, cq = (lane & 3) * 2;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int row = rb + 16 * mt + g, col = v0 + 8 * nt + cq;
      *reinterpret_cast<float2*>(dst + size_t(row) * ld + col) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
      *reinterpret_cast<float2*>(dst + size_t(row + 8) * ld + col) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
    }
}

/// The tile as bf16 into shared memory s ([rows][lds], columns 0 .. 63), for the next chunk's products.
template <int MT>
__device__ __forceinline__ void state_tile_to_smem(const float (&acc)[MT][8][4], __nv_bfloat16* s, int lds, int rb,
                                                   int lane) {
  const int g = lane >> 2, cq = (lane & 3) * 2;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int row = rb + 16 * mt + g, col = 8 * nt + cq;
      *reinterpret_cast<uint32_t*>(s + row * lds + col) = pack_bf16(acc[mt][nt][0], acc[mt][nt][1]);
      *reinterpret_cast<uint32_t*>(s + (row + 8) * lds + col) = pack_bf16(acc[mt][nt][2], acc[mt][nt][3]);
    }
}

/// Row r of the tile (rb <= r < rb + 16 MT) times f(r) (the chunk's decay of the state: one scalar, or per key dim).
template <int MT, class F>
__device__ __forceinline__ void state_tile_scale_rows(float (&acc)[MT][8][4], int rb, int lane, F&& f) {
  const int g = lane >> 2;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const float d0 = f(rb + 16 * mt + g), d1 = f(rb + 16 * mt + g + 8);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[mt][nt][0] *= d0, acc[mt][nt][1] *= d0, acc[mt][nt][2] *= d1, acc[mt][nt][3] *= d1;
  }
}

/// Values below the smallest normal float set to 0 (as the CPU references flush their states).
template <int MT>
__device__ __forceinline__ void state_tile_flush(float (&acc)[MT][8][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = fabsf(acc[mt][nt][e]) < FLT_MIN ? 0.0f : acc[mt][nt][e];
}

/// acc += K^T V over a chunk of 64 keys: K = sk [64][ldk] bf16 (key j's row; its columns are the state's rows),
/// V = sv [64][ldv] bf16 (the tile's 64 columns). scale(j0, j1, a) may rescale the K^T fragment a[4] in place, whose
/// registers hold keys j0, j0 + 1 (a[0], a[1]) and j1, j1 + 1 (a[2], a[3]) (lightning's per-key decay).
template <int MT, class Scale>
__device__ __forceinline__ void state_tile_rank_update(float (&acc)[MT][8][4], const __nv_bfloat16* sk, int ldk,
                                                       const __nv_bfloat16* sv, int ldv, int rb, int lane,
                                                       Scale&& scale) {
  const int cq = (lane & 3) * 2;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t b[4][4];
#pragma unroll
    for (int nt2 = 0; nt2 < 4; ++nt2) load_b_kn(b[nt2], sv, ldv, 16 * kk, 16 * nt2, lane);
    const int j0 = 16 * kk + cq, j1 = j0 + 8;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      uint32_t a[4];
      load_a_trans(a, sk, ldk, rb + 16 * mt, 16 * kk, lane);
      scale(j0, j1, a);
#pragma unroll
      for (int nt2 = 0; nt2 < 4; ++nt2) {
        mma_bf16(acc[mt][2 * nt2], a, b[nt2][0], b[nt2][1]);
        mma_bf16(acc[mt][2 * nt2 + 1], a, b[nt2][2], b[nt2][3]);
      }
    }
  }
}

}  // namespace hypic::kernels::cuda::detail
