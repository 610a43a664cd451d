// Warp-level tensor-core helpers (sm_80+ mma.sync m16n8k16, bf16 in, fp32 accumulate) and
// cp.async wrappers shared by the CUDA kernels of kernels/cuda.
//
// Fragment conventions (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type"):
//   lane l, g = l / 4, c = (l % 4) * 2
//   accumulator d[4]: (row g, cols c, c+1) and (row g + 8, cols c, c+1)
//   A (16 x 16, row-major) a[4]: (g, c..c+1), (g+8, c..c+1), (g, c+8..c+9), (g+8, c+8..c+9)
//   B (16 x 8, "col")      b[2]: (k c..c+1, col g), (k c+8..c+9, col g)
// Shared-memory tiles are bf16, row-major with a padded leading dimension `ld` (elements) that
// keeps every row 16-byte aligned, so ldmatrix reads 8 rows of 16 bytes without bank conflicts.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

namespace hypic::kernels::cuda::detail {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

/// d += a * b (m16n8k16, bf16 operands, fp32 accumulators).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// The 3xTF32 split of an fp32 x (as CUTLASS's "big + small" fast-accurate TF32): hi = x rounded to TF32's 10
/// mantissa bits (half away from zero, by integer add and mask: two instructions, where cvt.rna.tf32.f32 is a
/// dozen on sm_90), lo = x - hi exactly in fp32 (at most 12 significant bits), handed to mma as it is: the tensor
/// cores read a .tf32 operand's top 19 bits (undocumented in PTX but relied on by CUTLASS's fast 3xTF32 too), so lo
/// loses at most its last bit there: hi + lo(mma) is within 1 ulp (2^-23 relative) of x. Finite inputs only: an inf,
/// a NaN or |x| >= 3.4025e38 (hi rounds to inf) makes lo inf or NaN, so products with it are NaN (the fp32 kernel
/// would give inf for an inf). Both as 32-bit patterns for mma_tf32.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}

/// d += a b (m16n8k8, tf32 operands, fp32 accumulators; fragments as above with k halved: a (g, t), (g + 8, t),
/// (g, t + 4), (g + 8, t + 4); b (k t, col g), (k t + 4, col g)).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// A fragment (rows m0..m0+15, k0..k0+15) of a matrix stored row-major as [m][k].
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const __nv_bfloat16* s, int ld, int m0, int k0, int lane) {
  ldsm_x4(a, s + (m0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}

/// A fragment of A = S^T where S is stored row-major as [k][m] (so A(m, k) = S[k][m]).
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const __nv_bfloat16* s, int ld, int m0, int k0,
                                             int lane) {
  const int mi = lane >> 3;
  ldsm_x4_t(a, s + (k0 + (mi >> 1) * 8 + (lane & 7)) * ld + m0 + (mi & 1) * 8);
}

/// B fragments for two n-tiles (n0..n0+7 -> b[0..1], n0+8..n0+15 -> b[2..3]) over k0..k0+15,
/// where B(k, n) = S[n][k] (S stored row-major as [n][k], e.g. B = K^T from K[j][d]).
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const __nv_bfloat16* s, int ld, int k0, int n0,
                                          int lane) {
  const int mi = lane >> 3;
  ldsm_x4(b, s + (n0 + (mi >> 1) * 8 + (lane & 7)) * ld + k0 + (mi & 1) * 8);
}

/// B fragments for two n-tiles of a B stored row-major as [k][n].
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const __nv_bfloat16* s, int ld, int k0, int n0,
                                          int lane) {
  const int mi = lane >> 3;
  ldsm_x4_t(b, s + (k0 + (mi & 1) * 8 + (lane & 7)) * ld + n0 + (mi >> 1) * 8);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// cp.async.wait_group with a run-time count n in [0, MAX] (the instruction takes an immediate): at most n of the
// thread's most recent commit groups still pending; n above MAX waits as for MAX.
template <int MAX>
__device__ __forceinline__ void cp_async_wait_upto(int n) {
  if constexpr (MAX > 0) {
    if (n >= MAX) {
      cp_async_wait<MAX>();
      return;
    }
    cp_async_wait_upto<MAX - 1>(n);
  } else {
    cp_async_wait<0>();
  }
}

}  // namespace hypic::kernels::cuda::detail
