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
#include "kernels/cuda/cudnn_route.h"
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
  CudnnRule long_rule;  // prefill: the groups it takes run elsewhere (cuDNN): skipped; default: none
  // decode only
  int chunk_len;
  int head_blocks;
  int l2_ahead;   // KV tiles past the shared-memory ring prefetched into L2 (HYPIC_ATTN_DECODE_L2_AHEAD; 0: none)
  int seq_chunks;  // 1: each request's chunks cut from its own KV length (HYPIC_ATTN_DECODE_SEQ_CHUNKS); 0: chunk_len
  float* ws_acc;  // [batch][num_heads][nsplit][HD]
  float* ws_ml;   // [batch][num_heads][nsplit][2] (m in the log2 domain, l)
};

// Rows per work item of the split path of attention_prefill (with a workspace): a tile of (query, head) rows of one KV
// head, row r = query r / ratio at head kv_head * ratio + r % ratio.
constexpr int kSplitBM = 64;

// The split path of attention_prefill (with a workspace); a separate kernel argument so that AttnParams,
// and with it the prefill kernel's register allocation, stays as it was.
struct SplitArgs {
  int split_max_q;  // groups of 1 ..= split_max_q queries take the split path
  int nsplit;       // chunks per group at most (the last one runs to the group's KV length)
  int chunk_len;    // slots per chunk (whole pages)
  int num_groups;
  int* item_off;    // [num_groups + 1]: first work item of group g (exclusive prefix; [num_groups] = item count)
  int* qoff;        // [num_groups + 1]: first split-path query of group g among all split-path queries
  int* order;       // [items]: the k-th item a persistent block takes (attn_split_plan_kernel: chunk-major)
  int chunk_major;  // 0: order[k] = items - 1 - k instead (HYPIC_ATTN_SPLIT_ORDER=group, for comparisons)
  int* counter;     // work-item counter of the persistent split kernel (reset by the plan kernel)
  // (HYPIC_ATTN_SPLIT_PAIR) [items][2]: entry k = two items of one KV head and chunk whose groups read the same pages
  // there, or an item and -1 (attn_split_plan_kernel); null: the items one by one. num_pairs: the entry count.
  int* pairs;
  int* num_pairs;
  int skip_rescale;  // (HYPIC_ATTN_SKIP_RESCALE) the wgmma split kernel skips O's rescale where no row's max moved
  float* ws_acc;    // [item][kSplitBM][HD] partial accumulators
  float* ws_ml;     // [item][kSplitBM][2] partial (m in the log2 domain, l)
};

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x; -inf -> +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + __expf(-x)); }

// One work item of the split path, decoded from its number (attn_split_plan_kernel's numbering: group g's items are
// item_off[g] + rt + n_rt (kv_head + num_kv_heads (n_c - 1 - c))): the group, its 64-row tile and KV head, and the
// chunk's slot range. The split kernels (attn_split_kernel, attn_split_wgmma_kernel) share it.
struct SplitItem {
  int qs, s0, n_c;         // the group's first q row, first query's slot, chunks
  int R0, nrows, h0, kvh;  // first group row of the tile, its valid rows, first query head, KV head
  int start, last_slot;    // the chunk's first slot, and the last slot the tile computes
  const int* bt;           // the group's block-table row
};
// False when every row of the tile ends before the chunk (nothing to do; block-uniform).
__device__ __forceinline__ bool split_item(const AttnParams& p, const SplitArgs& sa, int item, SplitItem& it) {
  const int grp = find_group(sa.item_off, sa.num_groups, item);
  it.qs = p.q_start[grp];
  const int len = p.q_start[grp + 1] - it.qs;
  it.s0 = p.slot0[grp];
  const int kv_len = it.s0 + len;
  const int rows_all = len * p.ratio;
  const int n_rt = (rows_all + kSplitBM - 1) / kSplitBM;
  it.n_c = min(sa.nsplit, (kv_len + sa.chunk_len - 1) / sa.chunk_len);
  int local = item - sa.item_off[grp];
  const int rt = local % n_rt;
  local /= n_rt;
  it.kvh = local % p.num_kv_heads;
  const int c = it.n_c - 1 - local / p.num_kv_heads;
  it.R0 = rt * kSplitBM;
  it.nrows = min(kSplitBM, rows_all - it.R0);
  const int tile_lim = it.s0 + (it.R0 + it.nrows - 1) / p.ratio;  // last slot any valid row sees
  it.start = c * sa.chunk_len;
  if (it.start > tile_lim) return false;
  const int end = (c == it.n_c - 1) ? kv_len : it.start + sa.chunk_len;  // non-last chunks are full (whole pages)
  it.last_slot = min(end - 1, tile_lim);
  it.h0 = it.kvh * p.ratio;
  it.bt = p.block_table + static_cast<size_t>(grp) * p.max_pages;
  return true;
}

// Row `row` (< the tile's valid rows) of a split item, from this lane's accumulators o[.][2 r], o[.][2 r + 1] (columns
// 8 dt + c2, + 1) with the row's max m (log2 domain) and full sum L: with one chunk (n_c == 1, chunk 0 holds slot 0, so
// L > 0) the final output o / L, times sigmoid(gate) when p.gate, rounded to bf16 once; else the chunk's partial
// (acc, m, L) into the workspace at the item's slot for the combine kernel (m and L written by the lane with c2 == 0).
template <int HD>
__device__ __forceinline__ void split_store_row(const AttnParams& p, const SplitArgs& sa, const float (&o)[HD / 8][4],
                                                int r, float m, float L, int row, int qs, int R0, int h0, int n_c,
                                                int item, int c2) {
  if (n_c == 1) {
    const int R = R0 + row, qi = R / p.ratio, h = h0 + (R - qi * p.ratio);
    const size_t t = static_cast<size_t>(qs + qi);
    const float inv = 1.f / L;
    bf16* orow = p.out + (t * p.num_heads + h) * HD;
    const bf16* grow = p.gate ? p.gate + static_cast<long>(t) * p.gate_ts + static_cast<long>(h) * p.gate_hs : nullptr;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
      const int d = dt * 8 + c2;
      float v0 = o[dt][2 * r] * inv, v1 = o[dt][2 * r + 1] * inv;
      if (grow) {
        v0 *= sigmoidf_(__bfloat162float(grow[d]));
        v1 *= sigmoidf_(__bfloat162float(grow[d + 1]));
      }
      *reinterpret_cast<__nv_bfloat162*>(orow + d) = __floats2bfloat162_rn(v0, v1);
    }
  } else {
    const size_t e = static_cast<size_t>(item) * kSplitBM + row;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt)
      *reinterpret_cast<float2*>(sa.ws_acc + e * HD + dt * 8 + c2) = make_float2(o[dt][2 * r], o[dt][2 * r + 1]);
    if (c2 == 0) {
      sa.ws_ml[2 * e] = m;
      sa.ws_ml[2 * e + 1] = L;
    }
  }
}


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

// rescale_rows unless every lane of the warp has alpha == 1 exactly for both its rows (no row's running max moved in
// this tile: o * 1 is o, bit for bit, so skipping changes nothing): once the maxima settle, most tiles of a long
// context skip the HD / 2 multiplies per thread (HYPIC_ATTN_SKIP_RESCALE). Warp-uniform (all 32 lanes call it).
template <int ND8>
__device__ __forceinline__ void rescale_rows_if_moved(float (&o)[ND8][4], const float (&alpha)[2]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) rescale_rows<ND8>(o, alpha);
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
  if (p.long_rule.takes(t.len, t.s0)) return false;
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

/// True when the split path of attention_prefill (with a workspace) runs on the wgmma kernel (attention_wgmma.cu): the
/// current device is compute capability 9.0 (the sm_90a build), head_dim is 128 or 256, and the environment variable
/// HYPIC_ATTN_SPLIT_WGMMA is not "0" (read once; comparisons). Host only; throws std::runtime_error on CUDA errors.
bool wgmma_split_available(int head_dim);

/// Launches the wgmma split kernel: min(max_items, resident blocks) persistent blocks of one warpgroup taking sa's
/// items in sa.order (after attn_split_plan_kernel), each item's 64-row tile over its KV chunk in 32-slot tiles;
/// writes the partials and outputs attn_split_kernel writes, up to rounding (fp32 sums in another order, and P rounded
/// to bf16 against one running max per row where the mma.sync kernel keeps one per 32-slot half).
/// Host only; requires wgmma_split_available(head_dim).
void launch_split_wgmma(const AttnParams& p, const SplitArgs& sa, int head_dim, long max_items, cudaStream_t stream);

/// Launches the paired split kernel (HYPIC_ATTN_SPLIT_PAIR, a candidate): min(max_items, resident blocks) persistent
/// blocks of two warpgroups taking sa.pairs' entries (after attn_split_plan_kernel), each warpgroup one item's 64-row
/// tile, both over the same 32-slot K / V tiles, loaded once per block (half the L2 -> shared-memory traffic of
/// launch_split_wgmma when the groups share pages: a splice's seam windows and query), with each tile's S product
/// issued beside the previous tile's P V (FlashAttention-3 section 3.2). Same items, partials and outputs as
/// launch_split_wgmma, bit for bit. Host only; requires wgmma_split_available(head_dim) and sa.pairs.
void launch_split_pair(const AttnParams& p, const SplitArgs& sa, int head_dim, long max_items, cudaStream_t stream);

/// Launches of attn_split_pair_kernel issued in this process (launch_split_pair). Host only.
uint64_t split_pair_launches();

/// Blocks of the wgmma split kernel resident per SM at this head_dim (cudaOccupancyMaxActiveBlocksPerMultiprocessor
/// after its shared-memory opt-in, asked once per device; at least 1): 2 at head_dim 256 on an H100 / H200 (97 KB of
/// shared memory each), where the mma.sync split kernel fits 1. Host only; requires wgmma_split_available(head_dim);
/// throws std::runtime_error on CUDA errors.
int split_wgmma_blocks_per_sm(int head_dim);

}  // namespace hypic::kernels::cuda::detail
