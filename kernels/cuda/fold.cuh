// The inner product of the composition kernels (compose_fold in gated_delta_decode.cu, affine_chain in ops.cu):
// one 256-thread block holds a 128 x BN column block R of a running state and a 128 x 128 transition T in shared
// memory and computes T R, fp32 FMA in a fixed k order (DESIGN.md 3.1 composition S <- T S + S_seg).
#pragma once

namespace hypic::kernels::cuda::detail {

/// acc[r][j] += sum_{k < 128} T[rg + RG r][k] R[k][4 cg + j] for r < RPT, j < 4, with T in shared memory at sT
/// (row stride ldt floats) and R at sR (row stride ldr floats), both 16-byte aligned rows. Thread (rg, cg) owns
/// columns 4 cg .. 4 cg + 3 and rows rg + RG r. Reads shared memory only; the caller synchronises.
template <int RPT, int RG>
__device__ __forceinline__ void fold_rows(const float* sT, int ldt, const float* sR, int ldr, int rg, int cg,
                                          float (&acc)[RPT][4]) {
#pragma unroll 2
  for (int kk = 0; kk < 128; kk += 4) {
    float4 rr[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) rr[m] = *reinterpret_cast<const float4*>(sR + (kk + m) * ldr + 4 * cg);
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const float4 t = *reinterpret_cast<const float4*>(sT + (rg + RG * r) * ldt + kk);
      const float tv[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        acc[r][0] = fmaf(tv[m], rr[m].x, acc[r][0]);
        acc[r][1] = fmaf(tv[m], rr[m].y, acc[r][1]);
        acc[r][2] = fmaf(tv[m], rr[m].z, acc[r][2]);
        acc[r][3] = fmaf(tv[m], rr[m].w, acc[r][3]);
      }
    }
  }
}

}  // namespace hypic::kernels::cuda::detail
