// Device pieces shared by the attention kernels of attention.cu (sm_90, mma.sync) and attention_wgmma.cu
// (sm_90a, wgmma): the launch parameters, the online-softmax step and the gated output rows. Internal to
// kernels/cuda; the public interface is attention.h.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma.cuh"

namespace hypic::kernels::cuda::detail {

// Largest g in [0, n) with off[g] <= x, for a non-decreasing off with off[0] <= x < off[n].
__device__ __forceinline__ int find_group(const int* off, int n, int x) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (off[mid] <= x)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kBN = kKvPageTokens;  // KV tile = one page: one block-table lookup per tile
static_assert(kBN == 64, "the kernels assume 64-slot KV tiles");

struct AttnParams {
  const int* q_start;
  const int* slot0;
  const int* block_table;
  int max_pages;
  int num_heads;
  int num_kv_heads;
  int ratio;  // num_heads / num_kv_heads
  const bf16* q;
  const bf16* k_pool;
  const bf16* v_pool;
  float scale_log2;
  const bf16* gate;
  long gate_ts;
  int gate_hs;
  bf16* out;
  // decode only
  int chunk_len;
  int head_blocks;
  float* ws_acc;  // [batch][num_heads][nsplit][HD]
  float* ws_ml;   // [batch][num_heads][nsplit][2] (m in the log2 domain, l)
};

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x; -inf -> +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + __expf(-x)); }

// One KV tile of online softmax for one warp's 16 rows x 16 * NP slots (NP pairs of 8-column tiles).
// s: raw q.k accumulators in (overwritten); pa: P (unnormalised) out, rounded to bf16 as the A fragments of
// the P.V product (mma.cuh layout: S accumulator tiles 2kk, 2kk+1 are the k-halves of A tile kk). lim0 / lim1: last visible slot of rows g / g+8;
// slot_of(nt, e) = n0 + nt * 8 + c2 + (e & 1). m, l: running max (log2 domain) and thread-partial sums; alpha:
// out, the factor the output accumulators of rows g / g+8 must be multiplied by before P.V adds to them.
template <int NT8>
__device__ __forceinline__ void softmax_tile(float (&s)[NT8][4], uint32_t (&pa)[NT8 / 2][4], float (&m)[2],
                                             float (&l)[2], float (&alpha)[2], float scale_log2, bool need_mask,
                                             int n0, int c2, int lim0, int lim1) {
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = s[nt][e] * scale_log2;
      if (need_mask) {
        const int slot = n0 + nt * 8 + c2 + (e & 1);
        if (slot > ((e < 2) ? lim0 : lim1)) v = -INFINITY;
      }
      s[nt][e] = v;
    }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt) {
    mx[0] = fmaxf(mx[0], fmaxf(s[nt][0], s[nt][1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[nt][2], s[nt][3]));
  }
  float mu[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float mn = fmaxf(m[r], mx[r]);
    mu[r] = mn == -INFINITY ? 0.f : mn;  // a row with nothing visible yet: p = 0, alpha = 0, no NaN
    alpha[r] = fast_exp2(m[r] - mu[r]);
    m[r] = mn;
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt) {
    s[nt][0] = fast_exp2(s[nt][0] - mu[0]);
    s[nt][1] = fast_exp2(s[nt][1] - mu[0]);
    s[nt][2] = fast_exp2(s[nt][2] - mu[1]);
    s[nt][3] = fast_exp2(s[nt][3] - mu[1]);
    sum[0] += s[nt][0] + s[nt][1];
    sum[1] += s[nt][2] + s[nt][3];
  }
#pragma unroll
  for (int kk = 0; kk < NT8 / 2; ++kk) {  // P as bf16 A fragments (rows g / g+8, 16 slots per kk)
    pa[kk][0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
    pa[kk][1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
    pa[kk][2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[kk][3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
  l[0] = l[0] * alpha[0] + sum[0];
  l[1] = l[1] * alpha[1] + sum[1];
}

// o *= alpha per row (rows g / g+8): the rescale of the output accumulators when the running max moved.
template <int ND8>
__device__ __forceinline__ void rescale_rows(float (&o)[ND8][4], const float (&alpha)[2]) {
#pragma unroll
  for (int dt = 0; dt < ND8; ++dt) {
    o[dt][0] *= alpha[0];
    o[dt][1] *= alpha[0];
    o[dt][2] *= alpha[1];
    o[dt][3] *= alpha[1];
  }
}

// online_softmax = softmax_tile (P, m, l and the rescale factor alpha) then rescale_rows(o, alpha).
template <int NT8, int ND8>
__device__ __forceinline__ void online_softmax(float (&s)[NT8][4], uint32_t (&pa)[NT8 / 2][4], float (&o)[ND8][4],
                                               float (&m)[2], float (&l)[2], float scale_log2, bool need_mask, int n0,
                                               int c2, int lim0, int lim1) {
  float alpha[2];
  softmax_tile<NT8>(s, pa, m, l, alpha, scale_log2, need_mask, n0, c2, lim0, lim1);
  rescale_rows<ND8>(o, alpha);
}

// The query tile of one prefill block. Grid (num_heads, num_groups, query tiles); blockIdx.z counts query tiles
// from the LAST one, so the tiles with the most KV work are dispatched first. kSkipSplit: groups of len <=
// split_max_q are the split path's. False when the block has nothing to do.
struct PrefillTile {
  int h, grp, qs, len, m0, s0, rows, last_slot, n_tiles, kvh;
  const int* bt;  // the group's block-table row
};
template <int kBM, bool kSkipSplit>
__device__ __forceinline__ bool prefill_tile(const AttnParams& p, int split_max_q, PrefillTile& t) {
  t.h = blockIdx.x, t.grp = blockIdx.y;
  const int tile_q = static_cast<int>(gridDim.z - 1 - blockIdx.z);
  t.qs = p.q_start[t.grp];
  t.len = p.q_start[t.grp + 1] - t.qs;
  t.m0 = tile_q * kBM;
  if (t.m0 >= t.len) return false;
  if (kSkipSplit && t.len <= split_max_q) return false;
  t.s0 = p.slot0[t.grp];
  t.rows = min(kBM, t.len - t.m0);
  t.last_slot = t.s0 + t.m0 + t.rows - 1;  // last slot any row of this tile sees
  t.n_tiles = t.last_slot / kBN + 1;
  t.kvh = t.h / p.ratio;
  t.bt = p.block_table + static_cast<size_t>(t.grp) * p.max_pages;
  return true;
}

// The prefill epilogue of one warp's 16 rows (group-local queries wq0 .. wq0+15 of the group starting at q row qs,
// head h): o / l, times sigmoid(gate) when p.gate, rounded to bf16 once, rows past len skipped. o, l: the
// accumulators of online_softmax's layout (l still thread-partial).
template <int HD>
__device__ __forceinline__ void write_prefill_rows(const AttnParams& p, const float (&o)[HD / 8][4], float (&l)[2],
                                                   int qs, int wq0, int len, int h, int lane) {
  const int g = lane >> 2, c2 = (lane & 3) * 2;
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inv[r] = 1.f / l[r];
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int qi = wq0 + g + r * 8;
    if (qi >= len) continue;
    const size_t t = static_cast<size_t>(qs + qi);
    bf16* orow = p.out + (t * p.num_heads + h) * HD;
    const bf16* grow = p.gate ? p.gate + static_cast<long>(t) * p.gate_ts + static_cast<long>(h) * p.gate_hs : nullptr;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
      const int d = dt * 8 + c2;
      float v0 = o[dt][2 * r] * inv[r], v1 = o[dt][2 * r + 1] * inv[r];
      if (grow) {
        v0 *= sigmoidf_(__bfloat162float(grow[d]));
        v1 *= sigmoidf_(__bfloat162float(grow[d + 1]));
      }
      *reinterpret_cast<__nv_bfloat162*>(orow + d) = __floats2bfloat162_rn(v0, v1);
    }
  }
}

// Host-side argument checks and device facts shared by the attention sources (throw std::invalid_argument naming
// the function and the bad value).
[[noreturn]] inline void bad(const std::string& fn, const std::string& what) { throw std::invalid_argument(fn + ": " + what); }

inline void check_head_dim(const char* fn, int head_dim) {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256)
    bad(fn, "head_dim " + std::to_string(head_dim) + " is not supported (64, 128 or 256)");
}

inline void check_heads(const char* fn, int num_heads, int num_kv_heads) {
  if (num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0)
    bad(fn, "num_heads " + std::to_string(num_heads) + " must be a positive multiple of num_kv_heads " +
                std::to_string(num_kv_heads));
}

inline void check_ptr(const char* fn, const void* ptr, const char* name) {
  if (!ptr) bad(fn, std::string(name) + " is null");
}

inline void check_aligned16(const char* fn, const void* ptr, const char* name) {
  check_ptr(fn, ptr, name);
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) bad(fn, std::string(name) + " is not 16-byte aligned");
}

/// True when attention_prefill's long groups run on the wgmma kernel (attention_wgmma.cu): the current device is
/// compute capability 9.0 (the sm_90a build), head_dim is 128 or 256, and the environment variable
/// HYPIC_ATTN_WGMMA is not "0" (read once; comparisons). Host only; throws std::runtime_error on CUDA errors.
bool wgmma_prefill_available(int head_dim);

/// Launches the wgmma prefill kernel over the grid of the mma.sync one (query heads, groups, 128-row query tiles,
/// last tile first); split_max_q > 0 leaves groups of at most that many queries to the split path. Same arguments
/// and results (up to fp32 summation order) as attn_prefill_kernel. Host only; requires wgmma_prefill_available.
void launch_prefill_wgmma(const AttnParams& p, int head_dim, int num_groups, int max_q, int split_max_q,
                          cudaStream_t stream);

}  // namespace hypic::kernels::cuda::detail
