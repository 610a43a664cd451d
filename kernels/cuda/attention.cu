// Gated full attention of Qwen3-Next / Qwen3.5 over a paged KV pool (see attention.h): the varlen causal
// prefill (FlashAttention-2 style, mma.sync m16n8k16 bf16 with fp32 accumulation; on compute capability 9.0 its
// long groups run attention_wgmma.cu's kernel instead), its split-KV path for short groups over long contexts, and
// the flash-decoding decode step (KV split over blocks, partials in a workspace, combine kernel). The prepare step
// and kv_import are in attention_prepare.cu.
//
// Fragment conventions: kernels/cuda/mma.cuh. Per warp, 16 query rows; lane l holds rows g = l / 4 and
// g + 8, columns c2 = (l % 4) * 2 and c2 + 1 of every 8-column accumulator tile. The softmax runs in the
// log2 domain: scores are multiplied by scale * log2(e) and exponentiated with ex2.approx (m and the
// workspace partials are in that domain too).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cudnn_route.h"
#include "kernels/cuda/switches.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/pdl.cuh"

namespace hypic::kernels::cuda {
namespace {

using namespace detail;

// Prefill: 8 warps x 16 query rows = 128-row query tile of one head per block; Q, then K and V double
// buffered, in shared memory (row stride HD + 8 elements: 16-byte aligned rows, conflict-free ldmatrix).
template <int HD>
struct PrefillCfg {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBM = 16 * kWarps;
  static constexpr int kLd = HD + 8;
  static constexpr int kMinBlocks = HD == 256 ? 1 : 2;
  static constexpr int kQkUnroll = HD == 128 ? 4 : HD / 16;  // hd 128: keeps 2 blocks/SM within 128 registers
  static constexpr int kSmem = (kBM + 4 * kBN) * kLd * 2;
};
static_assert(PrefillCfg<256>::kSmem <= 227 * 1024, "prefill smem");

// Decode: 4 warps; warp w takes slots 16w .. 16w+15 of each 64-slot tile; 16 tile rows = query heads.
// K/V tiles in a 3-stage cp.async ring (two tiles in flight while one is consumed: decode is bound by
// the HBM stream of K and V). DS = 2 (HYPIC_ATTN_DECODE_D_SPLIT): 8 warps, warps w and w + 4 both take slots
// 16w .. 16w+15 (the same Q K^T and softmax, computed twice) and each the P V product of one half of the head dim,
// so two warps per scheduler hide each other's latencies (one 211 KB block per SM at head dim 256 had one).
template <int HD, int DS = 1>
struct DecodeCfg {
  static constexpr int kSlotWarps = 4;                // warps over a tile's slots
  static constexpr int kWarps = kSlotWarps * DS;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kLd = HD + 8;
  static constexpr int kStages = 3;
  static constexpr int kSmem = (16 + 2 * kStages * kBN) * kLd * 2;
  // cross-warp combine staging (O [4][16][HD] fp32, m and l [4][16]) reuses the K/V buffers
  static_assert(kSlotWarps * 16 * HD * 4 + 2 * kSlotWarps * 16 * 4 <= 2 * kStages * kBN * kLd * 2, "decode staging");
};
static_assert(DecodeCfg<256>::kSmem <= 227 * 1024, "decode smem");
constexpr int kMinTilesPerChunk = 2;  // decode chunks of at least 128 slots
// HYPIC_ATTN_DECODE_L2_AHEAD: KV tiles the decode kernel asks L2 for past its ring (at hd 256 one 211 KB block per SM
// keeps 2 tiles, 128 KB, in flight: 3.3 TB/s at batch 64 on the H200; 2 more per SM are 17 MB of L2 over 132 SMs).
constexpr int kDecodeL2Ahead = 2;

// Split prefill (short groups over long contexts): 8 warps = 4 row warps (16 rows each: a 64-row tile of
// (query, head) rows of one KV head) x 2 KV halves (32 slots of each 64-slot tile); Q, then K and V double
// buffered. The two halves are merged through shared memory (the K buffers) at the end of an item.
constexpr int kSplitMaxQ = 512;    // groups of 1 ..= kSplitMaxQ queries take the split path
constexpr int kSplitWaves = 8;     // aim at about this many items per resident block
constexpr int kPlanThreads = 1024;
template <int HD>
struct SplitCfg {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBM = kSplitBM;
  static constexpr int kLd = HD + 8;
  static constexpr int kMinBlocks = HD == 256 ? 1 : 2;
  static constexpr int kSmem = (kBM + 4 * kBN) * kLd * 2;
  static_assert(kBM * HD * 4 + 2 * kBM * 4 <= 2 * kBN * kLd * 2, "split staging fits the K buffers");
};
static_assert(SplitCfg<256>::kSmem <= 227 * 1024, "split smem");

// K and V of KV tile `tile` (slots tile*64 .. +63) into shared memory; slots beyond last_slot are
// zero-filled (never attended, but P = 0 times uninitialised pool memory could be NaN).
// kCg: the block-table entry read through L2 (ld.cg: the decode kernel's reads before its PDL wait, pdl.cuh).
template <int HD, int NT, bool kCg = false>
__device__ __forceinline__ void load_kv_tile(bf16* sK, bf16* sV, const AttnParams& p, const int* bt, int tile,
                                             int last_slot, int kvh, int tid) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  constexpr int kLd = HD + 8;
  static_assert(NT % kChunks == 0 && (kBN * kChunks) % NT == 0, "tile chunks per thread");
  constexpr int kRowStep = NT / kChunks;  // rows covered by one pass of the block
  const int r0 = tid / kChunks, ch = tid % kChunks;
  const int slot_base = tile * kBN;
  const int page = kCg ? __ldcg(bt + tile) : bt[tile];
  const size_t off0 = ((static_cast<size_t>(page) * kBN + r0) * p.num_kv_heads + kvh) * HD + ch * 8;
  const size_t step = static_cast<size_t>(kRowStep) * p.num_kv_heads * HD;
  const bf16* gk = p.k_pool + off0;
  const bf16* gv = p.v_pool + off0;
  bf16* dk = sK + r0 * kLd + ch * 8;
  bf16* dv = sV + r0 * kLd + ch * 8;
#pragma unroll
  for (int i = 0; i < kBN / kRowStep; ++i) {
    if (slot_base + r0 + i * kRowStep <= last_slot) {
      cp_async16(dk + i * kRowStep * kLd, gk + i * step);
      cp_async16(dv + i * kRowStep * kLd, gv + i * step);
    } else {
      *reinterpret_cast<uint4*>(dk + i * kRowStep * kLd) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(dv + i * kRowStep * kLd) = make_uint4(0, 0, 0, 0);
    }
  }
}

// Asks L2 for tile `tile` of the KV pool (its K and V rows of KV head kvh, whole 128-byte lines; rows past the context
// lie in the same page) by prefetch.global.L2: a hint with no result, so the decode kernel keeps more bytes in flight
// than its shared-memory ring holds. Every thread of the block calls it.
template <int HD, int NT>
__device__ __forceinline__ void prefetch_kv_tile_l2(const AttnParams& p, const int* bt, int tile, int kvh, int tid) {
  constexpr int kLines = HD * 2 / 128;  // 128-byte lines per row (hd 64: 1, 128: 2, 256: 4)
  const size_t page = static_cast<size_t>(bt[tile]) * kBN;
  for (int i = tid; i < 2 * kBN * kLines; i += NT) {
    const int v = i / (kBN * kLines), r = (i / kLines) % kBN, line = i % kLines;
    const bf16* addr = (v ? p.v_pool : p.k_pool) + ((page + r) * p.num_kv_heads + kvh) * HD + line * 64;
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(addr));
  }
}

// o += P V for one warp: P = pa (16 rows x 16 * NK slots, bf16 A fragments), V rows v_row0 .. of the
// tile in shared memory (rows of HD + 8 elements), output columns d0 .. d0 + DC - 1 (all HD by default).
template <int NK, int HD, int DC = HD>
__device__ __forceinline__ void pv_product(const uint32_t (&pa)[NK][4], float (&o)[DC / 8][4], const bf16* sV,
                                           int v_row0, int lane, int d0 = 0) {
  constexpr int kLd = HD + 8;
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    const uint32_t(&a)[4] = pa[kk];
#pragma unroll
    for (int dp = 0; dp < DC / 16; ++dp) {
      uint32_t b[4];
      load_b_kn(b, sV, kLd, v_row0 + kk * 16, d0 + dp * 16, lane);
      mma_bf16(o[2 * dp], a, b[0], b[1]);
      mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Prefill. Grid (num_heads, num_groups, query tiles); blockIdx.z counts query tiles from the LAST one, so
// the tiles with the most KV work are dispatched first.
// kSkipSplit: groups of len <= split_max_q are the split path's (attention_prefill with a workspace).
template <int HD, bool kSkipSplit>
__global__ void __launch_bounds__(PrefillCfg<HD>::kThreads, PrefillCfg<HD>::kMinBlocks)
    attn_prefill_kernel(const AttnParams p, int split_max_q) {
  using C = PrefillCfg<HD>;
  constexpr int kLd = C::kLd, kBM = C::kBM, NT = C::kThreads;
  constexpr int kChunks = HD / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK0 = sQ + kBM * kLd;          // K buffers 0, 1
  bf16* sV0 = sK0 + 2 * kBN * kLd;     // V buffers 0, 1

  PrefillTile t;
  if (!prefill_tile<kBM, kSkipSplit>(p, split_max_q, t)) return;
  const int h = t.h, qs = t.qs, len = t.len, m0 = t.m0, s0 = t.s0, rows = t.rows, last_slot = t.last_slot;
  const int n_tiles = t.n_tiles, kvh = t.kvh;
  const int* bt = t.bt;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  // Q tile (rows past the group: zeros), then KV tile 0: one commit group.
  {
    constexpr int kRowStep = NT / kChunks;
    const int r0 = tid / kChunks, ch = tid % kChunks;
    const bf16* src = p.q + (static_cast<size_t>(qs + m0 + r0) * p.num_heads + h) * HD + ch * 8;
    const size_t step = static_cast<size_t>(kRowStep) * p.num_heads * HD;
#pragma unroll
    for (int i = 0; i < kBM / kRowStep; ++i) {
      bf16* dst = sQ + (r0 + i * kRowStep) * kLd + ch * 8;
      if (r0 + i * kRowStep < rows)
        cp_async16(dst, src + i * step);
      else
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
  load_kv_tile<HD, NT>(sK0, sV0, p, bt, 0, last_slot, kvh, tid);
  cp_async_commit();

  float o[HD / 8][4];
#pragma unroll
  for (int dt = 0; dt < HD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int g = lane >> 2, c2 = (lane & 3) * 2;
  const int wq0 = m0 + warp * 16;  // group-local query index of the warp's row 0
  const bool warp_active = wq0 < len;
  const int wlim_lo = s0 + wq0;    // last visible slot of the warp's row 0
  const int wlim_hi = wlim_lo + 15;
  const int lim0 = wlim_lo + g, lim1 = lim0 + 8;

  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < n_tiles)
      load_kv_tile<HD, NT>(sK0 + (buf ^ 1) * kBN * kLd, sV0 + (buf ^ 1) * kBN * kLd, p, bt, j + 1, last_slot, kvh,
                           tid);
    cp_async_commit();  // possibly empty group
    cp_async_wait<1>();  // tile j (and Q) landed
    __syncthreads();
    const int n0 = j * kBN;
    if (warp_active && n0 <= wlim_hi) {  // else every slot of the tile is above this warp's diagonal
      const bf16* sK = sK0 + buf * kBN * kLd;
      const bf16* sV = sV0 + buf * kBN * kLd;
      float s[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll(C::kQkUnroll)
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t a[4];
        load_a(a, sQ, kLd, warp * 16, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t b[4];
          load_b_nk(b, sK, kLd, kk * 16, np * 16, lane);
          mma_bf16(s[2 * np], a, b[0], b[1]);
          mma_bf16(s[2 * np + 1], a, b[2], b[3]);
        }
      }
      uint32_t pa[4][4];
      online_softmax<8, HD / 8>(s, pa, o, m, l, p.scale_log2, n0 + kBN - 1 > wlim_lo, n0, c2, lim0, lim1);
      pv_product<4, HD>(pa, o, sV, 0, lane);
    }
    __syncthreads();  // buffer `buf` is refilled by the next iteration's prefetch
  }
  cp_async_wait<0>();

  if (warp_active) write_prefill_rows<HD>(p, o, l, qs, wq0, len, h, lane);
}

// ---------------------------------------------------------------------------------------------------------
// Decode. Grid (nsplit, num_kv_heads * head_blocks, batch): one block per (request, KV head, block of up to
// 16 query heads of that KV head, KV chunk). Chunk c covers slots [c * chunk_len, (c+1) * chunk_len), the
// last chunk up to the request's KV length (whatever max_kv said). With p.seq_chunks the chunk length is the
// request's own (decode_chunk_len): its KV length in whole tiles over the nsplit chunks.

// Slots per KV chunk of a decode request with kv_len slots: p.chunk_len (planned from max_kv), or with p.seq_chunks
// ceil(ceil(kv_len / kBN) / nsplit) whole tiles, so that every chunk of every request has work however far below
// max_kv its length is (the CUDA backend's decode steps plan at the block table's power-of-two width: a 32784-slot
// context is planned as 65536, and only half of the planned chunks held any slot).
__device__ __forceinline__ int decode_chunk_len(const AttnParams& p, int kv_len, int nsplit) {
  if (!p.seq_chunks) return p.chunk_len;
  const int tiles = max((kv_len + kBN - 1) / kBN, 1);  // (>= 1 tile: the combines divide by it)
  return (tiles + nsplit - 1) / nsplit * kBN;
}
// (DS = 2 on sm_90: 126 / 116 / 63 registers at hd 256 / 128 / 64, so the shared memory sets the resident blocks per
// SM as for DS = 1 and the split plan is the same; test_gpu_attention checks the plans agree.)
//
// kv_early (1: the caller's promise kv_read_early and HYPIC_ATTN_DECODE_KV_EARLY; a separate argument, so that
// AttnParams and the prefill kernels' register allocation stay as they were): the prologue's KV tiles that hold
// none of the request's last slot (slot0[b], the row attention_prepare writes just before this kernel) are issued
// before the wait, through L2 (cp.async.cg; the block table and slot0 by ld.cg), by the rule at the top of pdl.cuh;
// Q and the tiles with the last slot follow the wait as one more commit group, so iteration j waits for
// min(j + 1, S - 1) pending groups instead of S - 1 (the same tiles in the same slots: the same bits).
template <int HD, int DS = 1>
__global__ void __launch_bounds__(DecodeCfg<HD, DS>::kThreads) attn_decode_kernel(const AttnParams p, int kv_early) {
  using C = DecodeCfg<HD, DS>;
  constexpr int S = C::kStages;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const bool early = kv_early != 0;
  // (early) prologue tiles issued before the wait: bit st for tile st < S - 1
  unsigned issued = 0;
  if (early) {
    const int b = blockIdx.z, nsplit = gridDim.x;
    const int kv_len = __ldcg(p.slot0 + b) + 1;
    const int chunk_len = decode_chunk_len(p, kv_len, nsplit);
    const int start = blockIdx.x * chunk_len;
    if (start >= kv_len) return;  // (touches nothing: as after the wait below)
    const int end = (blockIdx.x == nsplit - 1) ? kv_len : min(start + chunk_len, kv_len);
    const int j0 = start / kBN, n_tiles = (end - 1) / kBN - j0 + 1;
    const int* bt = p.block_table + static_cast<size_t>(b) * p.max_pages;
    bf16* sK0 = reinterpret_cast<bf16*>(smem_raw) + 16 * C::kLd;
    bf16* sV0 = sK0 + S * kBN * C::kLd;
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {
      // tile j0 + st holds slots up to min((j0 + st + 1) kBN, end) - 1: early when that is below the last slot
      if (st < n_tiles && min((j0 + st + 1) * kBN, end) < kv_len) {
        load_kv_tile<HD, C::kThreads, true>(sK0 + st * kBN * C::kLd, sV0 + st * kBN * C::kLd, p, bt, j0 + st, end - 1,
                                            blockIdx.y / p.head_blocks, threadIdx.x);
        issued |= 1u << st;
      }
      cp_async_commit();
    }
  }
  // (launched with PDL under HYPIC_DECODE_PDL_MIXERS: q and the new KV row come from attention_prepare; pdl.cuh)
  detail::griddep_wait();
  detail::griddep_launch_dependents();
  constexpr int DC = HD / DS;  // head-dim columns of a warp's P V
  constexpr int kLd = C::kLd, NT = C::kThreads;
  constexpr int kChunks = HD / 8;
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK0 = sQ + 16 * kLd;        // K stages 0 .. S-1
  bf16* sV0 = sK0 + S * kBN * kLd;  // V stages 0 .. S-1

  const int c = blockIdx.x, nsplit = gridDim.x;
  const int kvh = blockIdx.y / p.head_blocks, hb = blockIdx.y % p.head_blocks;
  const int b = blockIdx.z;
  const int t = p.q_start[b];
  const int kv_len = p.slot0[b] + 1;
  const int chunk_len = decode_chunk_len(p, kv_len, nsplit);
  const int start = c * chunk_len;
  if (start >= kv_len) return;
  const int end = (c == nsplit - 1) ? kv_len : min(start + chunk_len, kv_len);
  const int last_slot = end - 1;
  const int h0 = kvh * p.ratio + hb * 16;
  const int nrows = min(16, p.ratio - hb * 16);
  const int* bt = p.block_table + static_cast<size_t>(b) * p.max_pages;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int idx = tid; idx < 16 * kChunks; idx += NT) {
    const int r = idx / kChunks, ch = idx % kChunks;
    bf16* dst = sQ + r * kLd + ch * 8;
    if (r < nrows)
      cp_async16(dst, p.q + (static_cast<size_t>(t) * p.num_heads + h0 + r) * HD + ch * 8);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
  const int j0 = start / kBN;
  const int n_tiles = last_slot / kBN - j0 + 1;
  // Prologue: tiles 0 .. S-2 (with Q in the first group); one commit group per tile, empty ones included,
  // so that before iteration j's wait exactly j + S groups exist and wait<S-1> means tile j landed. (early: the
  // S - 1 groups before the wait, then Q and the tiles not issued there as one group: j + S + 1 groups.)
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < n_tiles && !(issued >> st & 1u))
      load_kv_tile<HD, NT>(sK0 + st * kBN * kLd, sV0 + st * kBN * kLd, p, bt, j0 + st, last_slot, kvh, tid);
    if (!early) cp_async_commit();
  }
  if (early) cp_async_commit();
  // (p.l2_ahead > 0) tiles S - 1 .. S - 2 + l2_ahead into L2; the loop keeps that distance past the ring.
  for (int d = 0; d < p.l2_ahead; ++d)
    if (S - 1 + d < n_tiles) prefetch_kv_tile_l2<HD, NT>(p, bt, j0 + S - 1 + d, kvh, tid);

  // The warp's slot quarter sw and head-dim part dh (DS = 2: warps sw and sw + 4 share a quarter).
  const int sw = warp % C::kSlotWarps, dh = warp / C::kSlotWarps;
  float o[DC / 8][4];
#pragma unroll
  for (int dt = 0; dt < DC / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int g = lane >> 2, c2 = (lane & 3) * 2;

  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j % S;
    if (j + S - 1 < n_tiles) {
      const int nb = (j + S - 1) % S;  // the stage consumed in iteration j - 1 (freed by its trailing barrier)
      load_kv_tile<HD, NT>(sK0 + nb * kBN * kLd, sV0 + nb * kBN * kLd, p, bt, j0 + j + S - 1, last_slot, kvh, tid);
      if (p.l2_ahead > 0 && j + S - 1 + p.l2_ahead < n_tiles)
        prefetch_kv_tile_l2<HD, NT>(p, bt, j0 + j + S - 1 + p.l2_ahead, kvh, tid);
    }
    cp_async_commit();
    if (early && j + 1 < S - 1)
      cp_async_wait_upto<S - 2>(j + 1);  // (early: Q's group follows the prologue's; see above)
    else
      cp_async_wait<S - 1>();
    __syncthreads();
    const int n0 = (j0 + j) * kBN + sw * 16;  // the warp's first slot
    if (n0 <= last_slot) {
      const bf16* sK = sK0 + buf * kBN * kLd;
      const bf16* sV = sV0 + buf * kBN * kLd;
      float s[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t a[4], bb[4];
        load_a(a, sQ, kLd, 0, kk * 16, lane);
        load_b_nk(bb, sK, kLd, kk * 16, sw * 16, lane);
        mma_bf16(s[0], a, bb[0], bb[1]);
        mma_bf16(s[1], a, bb[2], bb[3]);
      }
      uint32_t pa[1][4];
      online_softmax<2, DC / 8>(s, pa, o, m, l, p.scale_log2, n0 + 15 > last_slot, n0, c2, last_slot, last_slot);
      pv_product<1, HD, DC>(pa, o, sV, sw * 16, lane, dh * DC);
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  // Combine the 4 slot quarters (each saw a quarter of every tile) through shared memory (the K/V buffers): warp
  // (sw, dh) holds columns dh DC .. + DC of quarter sw; m and l are the same in both warps of a quarter.
  float* sO = reinterpret_cast<float*>(sK0);  // [4][16][HD]
  float* sM = sO + 4 * 16 * HD;               // [4][16]
  float* sL = sM + 4 * 16;                    // [4][16]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
#pragma unroll
  for (int dt = 0; dt < DC / 8; ++dt) {
    const int d = dh * DC + dt * 8 + c2;
    *reinterpret_cast<float2*>(sO + (sw * 16 + g) * HD + d) = make_float2(o[dt][0], o[dt][1]);
    *reinterpret_cast<float2*>(sO + (sw * 16 + g + 8) * HD + d) = make_float2(o[dt][2], o[dt][3]);
  }
  if (dh == 0 && (lane & 3) == 0) {
    sM[sw * 16 + g] = m[0];
    sM[sw * 16 + g + 8] = m[1];
    sL[sw * 16 + g] = l[0];
    sL[sw * 16 + g + 8] = l[1];
  }
  __syncthreads();
  for (int idx = tid; idx < nrows * HD; idx += NT) {
    const int r = idx / HD, d = idx % HD;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) M = fmaxf(M, sM[w * 16 + r]);  // finite: warp 0 sees slot `start`
    float L = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float wt = fast_exp2(sM[w * 16 + r] - M);
      L += wt * sL[w * 16 + r];
      acc += wt * sO[(w * 16 + r) * HD + d];
    }
    const int h = h0 + r;
    if (nsplit == 1) {
      float v = acc / L;
      if (p.gate) v *= sigmoidf_(__bfloat162float(p.gate[static_cast<long>(t) * p.gate_ts + static_cast<long>(h) * p.gate_hs + d]));
      p.out[(static_cast<size_t>(t) * p.num_heads + h) * HD + d] = __float2bfloat16_rn(v);
    } else {
      const size_t e = (static_cast<size_t>(b) * p.num_heads + h) * nsplit + c;
      p.ws_acc[e * HD + d] = acc;
      if (d == 0) {
        p.ws_ml[2 * e] = M;
        p.ws_ml[2 * e + 1] = L;
      }
    }
  }
}

// Grid (num_heads, batch), HD threads: out = sum_c 2^(m_c - M) acc_c / sum_c 2^(m_c - M) l_c over the
// request's non-empty chunks.
// The chunks' (m, l) go through shared memory once (loaded by one thread each, in parallel), so that each thread's
// loop over the chunks only waits for independent loads of acc (a batch-1 step at 32k has 128 chunks per head: a
// loop of dependent m loads per thread took 14 us). Same arithmetic and order as a sequential loop over c.
constexpr int kCombineMaxChunks = 1024;

// The combine's first step, by all NT threads of the block: the nvalid chunks' (m, l) of entry e0 into s_m / s_l, and
// their largest m (returned to every thread; s_red: NT / 32 floats of scratch).
template <int NT>
__device__ __forceinline__ float combine_stage_max(const AttnParams& p, size_t e0, int nvalid, float* s_m, float* s_l,
                                                   float* s_red) {
  const int tid = threadIdx.x;
  float M = -INFINITY;
  for (int c = tid; c < nvalid; c += NT) {
    s_m[c] = p.ws_ml[2 * (e0 + c)];
    s_l[c] = p.ws_ml[2 * (e0 + c) + 1];
    M = fmaxf(M, s_m[c]);
  }
#pragma unroll
  for (int off = 16; off; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
  if ((tid & 31) == 0) s_red[tid >> 5] = M;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < NT / 32; ++w) M = fmaxf(M, s_red[w]);
  return M;
}

template <int HD>
__global__ void __launch_bounds__(HD) attn_decode_combine_kernel(const AttnParams p, int nsplit) {
  detail::griddep_launch_dependents();  // o_proj (a PDL launch) may start streaming its weights; see pdl.cuh
  detail::griddep_wait();               // (the chunks' partials: launched with PDL under HYPIC_DECODE_PDL_MIXERS)
  __shared__ float s_m[kCombineMaxChunks], s_l[kCombineMaxChunks];
  __shared__ float s_red[HD / 32];
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int t = p.q_start[b];
  const int kv_len = p.slot0[b] + 1;
  const int chunk_len = decode_chunk_len(p, kv_len, nsplit);
  const int nvalid = min(nsplit, static_cast<int>((static_cast<long>(kv_len) + chunk_len - 1) / chunk_len));
  const size_t e0 = (static_cast<size_t>(b) * p.num_heads + h) * nsplit;
  const float M = combine_stage_max<HD>(p, e0, nvalid, s_m, s_l, s_red);
  float L = 0.f, acc = 0.f;
#pragma unroll 8
  for (int c = 0; c < nvalid; ++c) {
    const float wt = fast_exp2(s_m[c] - M);
    L += wt * s_l[c];
    acc += wt * p.ws_acc[(e0 + c) * HD + d];
  }
  float v = acc / L;
  if (p.gate) v *= sigmoidf_(__bfloat162float(p.gate[static_cast<long>(t) * p.gate_ts + static_cast<long>(h) * p.gate_hs + d]));
  p.out[(static_cast<size_t>(t) * p.num_heads + h) * HD + d] = __float2bfloat16_rn(v);
}

// attn_decode_combine_kernel with the chunk loop spread over kCombineGroups thread groups of HD threads
// (HYPIC_ATTN_COMBINE_GROUPS, a candidate: switches.h): group g sums the chunks [g n / 4, (g + 1) n / 4) of the n
// valid ones in ascending order, then group 0 adds the groups' partial sums in group order (another fp32 order than
// the one-group kernel's: a last-bit difference; fixed, so bit-identical from run to run and batch to batch). A
// batch-1 step at 32k has 128 chunks per head: one thread's dependent loop of 128 loads of acc took 10.9 us.
constexpr int kCombineGroups = 4;
template <int HD>
__global__ void __launch_bounds__(kCombineGroups * HD) attn_decode_combine_groups_kernel(const AttnParams p,
                                                                                          int nsplit) {
  detail::griddep_launch_dependents();  // as attn_decode_combine_kernel
  detail::griddep_wait();
  constexpr int kT = kCombineGroups * HD;
  __shared__ float s_m[kCombineMaxChunks], s_l[kCombineMaxChunks];
  __shared__ float s_red[kT / 32];
  __shared__ float s_acc[kCombineGroups - 1][HD], s_sum[kCombineGroups - 1];
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, d = tid % HD, grp = tid / HD;
  const int t = p.q_start[b];
  const int kv_len = p.slot0[b] + 1;
  const int chunk_len = decode_chunk_len(p, kv_len, nsplit);
  const int nvalid = min(nsplit, static_cast<int>((static_cast<long>(kv_len) + chunk_len - 1) / chunk_len));
  const size_t e0 = (static_cast<size_t>(b) * p.num_heads + h) * nsplit;
  const float M = combine_stage_max<kT>(p, e0, nvalid, s_m, s_l, s_red);
  const int c0 = grp * nvalid / kCombineGroups, c1 = (grp + 1) * nvalid / kCombineGroups;
  float L = 0.f, acc = 0.f;
#pragma unroll 8
  for (int c = c0; c < c1; ++c) {
    const float wt = fast_exp2(s_m[c] - M);
    L += wt * s_l[c];
    acc += wt * p.ws_acc[(e0 + c) * HD + d];
  }
  if (grp > 0) {
    s_acc[grp - 1][d] = acc;
    if (d == 0) s_sum[grp - 1] = L;
  }
  __syncthreads();
  if (grp > 0) return;
#pragma unroll
  for (int g = 0; g < kCombineGroups - 1; ++g) acc += s_acc[g][d], L += s_sum[g];
  float v = acc / L;
  if (p.gate) v *= sigmoidf_(__bfloat162float(p.gate[static_cast<long>(t) * p.gate_ts + static_cast<long>(h) * p.gate_hs + d]));
  p.out[(static_cast<size_t>(t) * p.num_heads + h) * HD + d] = __float2bfloat16_rn(v);
}

// ---------------------------------------------------------------------------------------------------------
// Split prefill (attention_prefill with a workspace). Groups of 1 ..= split_max_q queries are cut into
// work items (group, KV head, 64-row tile, KV chunk): tile row r of group g (r < len * ratio) is query
// r / ratio of the group at head kv_head * ratio + r % ratio; chunk c covers slots [c * chunk_len,
// (c+1) * chunk_len), the group's last chunk (n_c - 1, n_c = min(nsplit, ceil(kv_len / chunk_len)))
// up to its KV length kv_len = slot0 + len. Item numbering: group g's items are item_off[g] + local,
// local = rt + n_rt * (kv_head + num_kv_heads * (n_c - 1 - c)) (the workspace slot of its partial results); the
// persistent blocks take them in the plan kernel's chunk-major order (sa.order).

// Exclusive block-wide scan (kPlanThreads threads, all calling) of value(i) over i in [0, n), in order: emit(i, v,
// prefix) for every i, v = value(i); returns the total. s_w: 32 ints of shared scratch.
template <class Value, class Emit>
__device__ int plan_scan(int n, Value value, Emit emit, int* s_w) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int carry = 0;  // (every thread keeps the same running total)
  for (int base = 0; base < n; base += kPlanThreads) {
    const int i = base + tid;
    const int v = i < n ? value(i) : 0;
    int x = v;  // inclusive warp scan
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, off);
      if (lane >= off) x += y;
    }
    if (lane == 31) s_w[warp] = x;
    __syncthreads();
    if (warp == 0) {  // kPlanThreads / 32 == 32 warp sums
      int w = s_w[lane];
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, w, off);
        if (lane >= off) w += y;
      }
      s_w[lane] = w;
    }
    __syncthreads();
    if (i < n) emit(i, v, carry + (warp ? s_w[warp - 1] : 0) + x - v);
    carry += s_w[31];
    __syncthreads();  // s_w is rewritten by the next round
  }
  return carry;
}

// One block: per group its item count and split-path query count, exclusive prefix sums into item_off / qoff
// ([sa.num_groups] = totals); then the order in which the persistent blocks take the items, chunk-major: every
// group's items of chunk 0 (group by group, each group's n_rt x num_kv_heads items of that chunk in item order), then
// chunk 1, ... Chunk c covers the same slots in every group, and the groups of one launch are mostly windows of one
// sequence (a splice's seams and query): blocks running at the same time then read the same pages, from L2 (item by
// item, the group-major order streamed each group's whole KV range from memory again). Resets the work counter.
__global__ void __launch_bounds__(kPlanThreads) attn_split_plan_kernel(const AttnParams p, const SplitArgs sa) {
  __shared__ int s_w[32];
  const int G = sa.num_groups;
  auto split_len = [&](int g) {  // the group's query count if it takes the split path, else 0
    const int len = p.q_start[g + 1] - p.q_start[g];
    return len >= 1 && len <= sa.split_max_q ? len : 0;
  };
  auto n_rt = [&](int len) { return (len * p.ratio + kSplitBM - 1) / kSplitBM; };
  auto n_chunks = [&](int g, int len) { return min(sa.nsplit, (p.slot0[g] + len + sa.chunk_len - 1) / sa.chunk_len); };
  const int items = plan_scan(
      G,
      [&](int g) {
        const int len = split_len(g);
        return len ? n_rt(len) * n_chunks(g, len) * p.num_kv_heads : 0;
      },
      [&](int g, int, int prefix) { sa.item_off[g] = prefix; }, s_w);
  const int queries = plan_scan(G, split_len, [&](int g, int, int prefix) { sa.qoff[g] = prefix; }, s_w);
  __syncthreads();  // item_off of every group, for the order below
  if (!sa.chunk_major) {  // group by group from the last item down (the order before the chunk-major one)
    for (int k = threadIdx.x; k < items; k += kPlanThreads) sa.order[k] = items - 1 - k;
  } else {
    // Pair i = c * G + g: group g's items of chunk c (n_rt x num_kv_heads of them, consecutive item numbers from
    // item_off[g] + n_rt num_kv_heads (n_c - 1 - c)), if the group has a chunk c.
    plan_scan(
        sa.nsplit * G,
        [&](int i) {
          const int c = i / G, g = i - c * G, len = split_len(g);
          return len && c < n_chunks(g, len) ? n_rt(len) * p.num_kv_heads : 0;
        },
        [&](int i, int v, int prefix) {
          const int c = i / G, g = i - c * G;
          if (!v) return;
          const int first = sa.item_off[g] + v * (n_chunks(g, split_len(g)) - 1 - c);
          for (int j = 0; j < v; ++j) sa.order[prefix + j] = first + j;
        },
        s_w);
  }
  int pairs = 0;
  if (sa.pairs) {
    // The paired kernel's entries (attn_split_pair_kernel): per (chunk c, KV head) the items that have work in chunk
    // c (split_item true), group by group and row tile by row tile, each joined to the one before it when both
    // groups' block-table rows name the same pages from the chunk's first slot to the smaller of their last slots
    // (the tiles both read; the same group always), else entered alone. Chunk-major as `order`. One thread per
    // (chunk, KV head) walks its items twice: to count its entries, then to write them.
    auto walk = [&](int seg, int* out) {
      const int c = seg / p.num_kv_heads, kvh = seg - c * p.num_kv_heads, start = c * sa.chunk_len;
      int n = 0, pend = -1, pend_g = 0, pend_last = 0;
      auto emit = [&](int a, int b) {
        if (out) out[2 * n] = a, out[2 * n + 1] = b;
        ++n;
      };
      auto same_pages = [&](int ga, int gb, int last) {
        if (ga == gb) return true;
        const int* ra = p.block_table + static_cast<size_t>(ga) * p.max_pages;
        const int* rb = p.block_table + static_cast<size_t>(gb) * p.max_pages;
        for (int pg = start / kBN; pg <= last / kBN; ++pg)
          if (ra[pg] != rb[pg]) return false;
        return true;
      };
      for (int g = 0; g < G; ++g) {
        const int len = split_len(g);
        if (!len || c >= n_chunks(g, len)) continue;
        const int nc = n_chunks(g, len), nrt = n_rt(len), s0 = p.slot0[g], rows_all = len * p.ratio;
        const int end = c == nc - 1 ? s0 + len : start + sa.chunk_len;
        for (int rt = 0; rt < nrt; ++rt) {
          const int R0 = rt * kSplitBM, tile_lim = s0 + (R0 + min(kSplitBM, rows_all - R0) - 1) / p.ratio;
          if (start > tile_lim) continue;  // no work in this chunk (as split_item)
          const int item = sa.item_off[g] + rt + nrt * (kvh + p.num_kv_heads * (nc - 1 - c));
          const int last = min(end - 1, tile_lim);
          if (pend >= 0 && same_pages(pend_g, g, min(pend_last, last))) {
            emit(pend, item);
            pend = -1;
          } else {
            if (pend >= 0) emit(pend, -1);
            pend = item, pend_g = g, pend_last = last;
          }
        }
      }
      if (pend >= 0) emit(pend, -1);
      return n;
    };
    pairs = plan_scan(
        sa.nsplit * p.num_kv_heads, [&](int seg) { return walk(seg, nullptr); },
        [&](int seg, int, int prefix) { walk(seg, sa.pairs + 2 * prefix); }, s_w);
  }
  if (threadIdx.x == 0) {
    sa.item_off[G] = items;
    sa.qoff[G] = queries;
    if (sa.pairs) *sa.num_pairs = pairs;
    *sa.counter = 0;
  }
}

// Persistent: each block takes work items from the counter until none is left.
template <int HD>
__global__ void __launch_bounds__(SplitCfg<HD>::kThreads, SplitCfg<HD>::kMinBlocks)
    attn_split_kernel(const AttnParams p, const SplitArgs sa) {
  using C = SplitCfg<HD>;
  constexpr int kLd = C::kLd, kBM = C::kBM, NT = C::kThreads;
  constexpr int kChunks = HD / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK0 = sQ + kBM * kLd;       // K buffers 0, 1
  bf16* sV0 = sK0 + 2 * kBN * kLd;  // V buffers 0, 1
  float* sO = reinterpret_cast<float*>(sK0);  // end of an item: the second half's O [kBM][HD], m, l [kBM]
  float* sM = sO + kBM * HD;
  float* sL = sM + kBM;
  __shared__ int s_item;
  __shared__ int s_meta[6];  // qs, R0, nrows, h0, n_c, item: re-read after the KV loop (fewer live registers)

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp & 3, wn = warp >> 2;  // row warp, KV half
  const int gq = lane >> 2, c2 = (lane & 3) * 2;
  for (;;) {
    if (tid == 0) s_item = atomicAdd(sa.counter, 1);
    __syncthreads();
    const int k = s_item;
    __syncthreads();  // s_item is rewritten at the next item
    const int total = sa.item_off[sa.num_groups];  // (re-read per item: one register less in the KV loop)
    if (k >= total) break;
    const int item = sa.order[k];
    SplitItem wi;
    if (!split_item(p, sa, item, wi)) continue;
    const int qs = wi.qs, s0 = wi.s0, R0 = wi.R0, nrows = wi.nrows, h0 = wi.h0, kvh = wi.kvh, n_c = wi.n_c;
    const int last_slot = wi.last_slot;
    const int j0 = wi.start / kBN;
    const int n_tiles = last_slot / kBN - j0 + 1;
    const int* bt = wi.bt;
    if (tid == 0) {  // read after the loop's first barrier; rewritten only after this item's last barrier
      s_meta[0] = qs, s_meta[1] = R0, s_meta[2] = nrows;
      s_meta[3] = h0, s_meta[4] = n_c, s_meta[5] = item;
    }

    // Q rows (rows past the group: zeros), then KV tile j0: one commit group.
    for (int idx = tid; idx < kBM * kChunks; idx += NT) {
      const int r = idx / kChunks, ch = idx % kChunks;
      bf16* dst = sQ + r * kLd + ch * 8;
      if (r < nrows) {
        const int R = R0 + r, qi = R / p.ratio, hh = R - qi * p.ratio;
        cp_async16(dst, p.q + (static_cast<size_t>(qs + qi) * p.num_heads + h0 + hh) * HD + ch * 8);
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      }
    }
    load_kv_tile<HD, NT>(sK0, sV0, p, bt, j0, last_slot, kvh, tid);
    cp_async_commit();

    float o[HD / 8][4];
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const int Rw = R0 + wm * 16;  // group row of the warp's row 0
    const bool warp_active = wm * 16 < nrows;
    const int wlim_lo = s0 + Rw / p.ratio;                          // last visible slot of the warp's first row
    const int wlim_hi = s0 + min(Rw + 15, R0 + nrows - 1) / p.ratio;  // ... of its last valid row
    const int lim0 = s0 + (Rw + gq) / p.ratio, lim1 = s0 + (Rw + gq + 8) / p.ratio;

    for (int j = 0; j < n_tiles; ++j) {
      const int buf = j & 1;
      if (j + 1 < n_tiles)
        load_kv_tile<HD, NT>(sK0 + (buf ^ 1) * kBN * kLd, sV0 + (buf ^ 1) * kBN * kLd, p, bt, j0 + j + 1, last_slot,
                             kvh, tid);
      cp_async_commit();   // possibly empty group
      cp_async_wait<1>();  // tile j (and Q) landed
      __syncthreads();
      const int n0 = (j0 + j) * kBN + wn * 32;  // the warp's first slot
      if (warp_active && n0 <= wlim_hi) {
        const bf16* sK = sK0 + buf * kBN * kLd;
        const bf16* sV = sV0 + buf * kBN * kLd;
        float sc[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          uint32_t a[4];
          load_a(a, sQ, kLd, wm * 16, kk * 16, lane);
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            uint32_t b[4];
            load_b_nk(b, sK, kLd, kk * 16, wn * 32 + np * 16, lane);
            mma_bf16(sc[2 * np], a, b[0], b[1]);
            mma_bf16(sc[2 * np + 1], a, b[2], b[3]);
          }
        }
        uint32_t pa[2][4];
        // Slots past last_slot (zero-filled) lie past every valid row's limit: masked whenever present.
        online_softmax<4, HD / 8>(sc, pa, o, m, l, p.scale_log2, n0 + 31 > wlim_lo, n0, c2, lim0, lim1);
        pv_product<2, HD>(pa, o, sV, wn * 32, lane);
      }
      __syncthreads();  // buffer `buf` is refilled by the next iteration's prefetch
    }
    cp_async_wait<0>();

    // Merge the two KV halves (the K buffers are free after the loop's last barrier).
    const bool active = wm * 16 < s_meta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    if (wn == 1 && active) {
#pragma unroll
      for (int dt = 0; dt < HD / 8; ++dt) {
        const int d = dt * 8 + c2;
        *reinterpret_cast<float2*>(sO + (wm * 16 + gq) * HD + d) = make_float2(o[dt][0], o[dt][1]);
        *reinterpret_cast<float2*>(sO + (wm * 16 + gq + 8) * HD + d) = make_float2(o[dt][2], o[dt][3]);
      }
      if ((lane & 3) == 0) {
        sM[wm * 16 + gq] = m[0];
        sM[wm * 16 + gq + 8] = m[1];
        sL[wm * 16 + gq] = l[0];
        sL[wm * 16 + gq + 8] = l[1];
      }
    }
    __syncthreads();
    if (wn == 0 && active) {
      const int qs_ = s_meta[0], R0_ = s_meta[1], nrows_ = s_meta[2], h0_ = s_meta[3], n_c_ = s_meta[4];
      const int item_ = s_meta[5];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = wm * 16 + gq + r * 8;  // tile row
        const float m1 = sM[row], l1 = sL[row];
        const float M = fmaxf(m[r], m1);
        const float w0 = M == -INFINITY ? 0.f : fast_exp2(m[r] - M);  // a row that saw nothing: 0, not NaN
        const float w1 = M == -INFINITY ? 0.f : fast_exp2(m1 - M);
        const float L = w0 * l[r] + w1 * l1;
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt) {
          const float2 x = *reinterpret_cast<const float2*>(sO + row * HD + dt * 8 + c2);
          o[dt][2 * r] = w0 * o[dt][2 * r] + w1 * x.x;
          o[dt][2 * r + 1] = w0 * o[dt][2 * r + 1] + w1 * x.y;
        }
        if (row < nrows_) split_store_row<HD>(p, sa, o, r, M, L, row, qs_, R0_, h0_, n_c_, item_, c2);
      }
    }
    __syncthreads();  // sO / sQ are overwritten by the next item
  }
}

// Grid (split-path query bound, num_heads), HD threads: query j of the split path (qoff order), head h:
// out = sum_c 2^(m_c - M) acc_c / sum_c 2^(m_c - M) l_c over the chunks c <= lim / chunk_len that the
// query sees (each holds slot c * chunk_len <= lim, so its m is finite). Groups of one chunk: done.
template <int HD>
__global__ void __launch_bounds__(HD) attn_split_combine_kernel(const AttnParams p, const SplitArgs sa) {
  const int j = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  if (j >= sa.qoff[sa.num_groups]) return;
  const int grp = find_group(sa.qoff, sa.num_groups, j);
  const int qs = p.q_start[grp];
  const int len = p.q_start[grp + 1] - qs;
  const int s0 = p.slot0[grp];
  const int kv_len = s0 + len;
  const int n_c = min(sa.nsplit, (kv_len + sa.chunk_len - 1) / sa.chunk_len);
  if (n_c == 1) return;
  const int qi = j - sa.qoff[grp];
  const int nvis = min(n_c, (s0 + qi) / sa.chunk_len + 1);
  const int kvh = h / p.ratio, hh = h - kvh * p.ratio;
  const int R = qi * p.ratio + hh;
  const int n_rt = (len * p.ratio + kSplitBM - 1) / kSplitBM;
  const int base = sa.item_off[grp] + R / kSplitBM, row = R % kSplitBM;
  float M = -INFINITY;
  for (int c = 0; c < nvis; ++c) {
    const size_t e = static_cast<size_t>(base + (kvh + p.num_kv_heads * (n_c - 1 - c)) * n_rt) * kSplitBM + row;
    M = fmaxf(M, sa.ws_ml[2 * e]);
  }
  float L = 0.f, acc = 0.f;
  for (int c = 0; c < nvis; ++c) {
    const size_t e = static_cast<size_t>(base + (kvh + p.num_kv_heads * (n_c - 1 - c)) * n_rt) * kSplitBM + row;
    const float wt = fast_exp2(sa.ws_ml[2 * e] - M);
    L += wt * sa.ws_ml[2 * e + 1];
    acc += wt * sa.ws_acc[e * HD + d];
  }
  const size_t t = static_cast<size_t>(qs + qi);
  float v = acc / L;
  if (p.gate) v *= sigmoidf_(__bfloat162float(p.gate[static_cast<long>(t) * p.gate_ts + static_cast<long>(h) * p.gate_hs + d]));
  p.out[(t * p.num_heads + h) * HD + d] = __float2bfloat16_rn(v);
}

// ---------------------------------------------------------------------------------------------------------
// Host side.

template <int HD>
void prefill_setup() {
  static DeviceOnce once;
  once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(attn_prefill_kernel<HD, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    PrefillCfg<HD>::kSmem),
               "cudaFuncSetAttribute(attn_prefill_kernel<" + std::to_string(HD) + ">)");
    check_cuda(cudaFuncSetAttribute(attn_prefill_kernel<HD, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    PrefillCfg<HD>::kSmem),
               "cudaFuncSetAttribute(attn_prefill_kernel<" + std::to_string(HD) + ", skip>)");
    return 0;
  });
}

// Sets the split kernel's shared-memory limit; returns its resident blocks per SM.
template <int HD>
int split_setup() {
  static DeviceOnce once;
  return once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(attn_split_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    SplitCfg<HD>::kSmem),
               "cudaFuncSetAttribute(attn_split_kernel<" + std::to_string(HD) + ">)");
    int blocks = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, attn_split_kernel<HD>, SplitCfg<HD>::kThreads,
                                                             SplitCfg<HD>::kSmem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor(attn_split_kernel)");
    return std::max(blocks, 1);
  });
}

int split_blocks_per_sm(int head_dim) {
  switch (head_dim) {
    case 64: return split_setup<64>();
    case 128: return split_setup<128>();
    default: return split_setup<256>();
  }
}

// Resident blocks of the split kernel that will run (the split plans size their chunks for kSplitWaves items per
// resident block): the mma.sync kernel's, or under the candidate HYPIC_ATTN_SPLIT_WG_PLAN (switches.h) the wgmma
// kernel's where it runs (launch_split: on an H100 / H200 two blocks per SM at head_dim 256 against one, three at
// 128 against two, so the mma.sync kernel's count gave it fewer items per block than the plan aims at). Under the
// switch the chunks are shorter and the items (and the workspace's partials) about twice as many at head_dim 256.
long split_resident_blocks(int head_dim) {
  int per_sm = split_blocks_per_sm(head_dim);
#if HYPIC_ATTN_WGMMA_BUILT
  static CandidateSwitch wg_plan("HYPIC_ATTN_SPLIT_WG_PLAN");
  if (wg_plan.on() && wgmma_split_available(head_dim)) per_sm = split_wgmma_blocks_per_sm(head_dim);
#endif
  return static_cast<long>(sm_count()) * per_sm;
}

// Sets the decode kernel's shared-memory limit; returns its resident blocks per SM.
template <int HD, int DS>
int decode_setup() {
  static DeviceOnce once;
  return once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(attn_decode_kernel<HD, DS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    DecodeCfg<HD, DS>::kSmem),
               "cudaFuncSetAttribute(attn_decode_kernel<" + std::to_string(HD) + ", " + std::to_string(DS) + ">)");
    int blocks = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, attn_decode_kernel<HD, DS>,
                                                             DecodeCfg<HD, DS>::kThreads, DecodeCfg<HD, DS>::kSmem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor(attn_decode_kernel)");
    return std::max(blocks, 1);
  });
}

// HYPIC_ATTN_DECODE_D_SPLIT: the decode kernel's 8-warp form (DecodeCfg DS = 2), one object for the plan and the launch.
int decode_d_split() {
  static CandidateSwitch sw("HYPIC_ATTN_DECODE_D_SPLIT");
  return sw.on() ? 2 : 1;
}

// Resident blocks per SM of the decode kernel in its form `ds` (1 or 2 : decode_d_split()).
int decode_blocks_per_sm(int head_dim, int ds) {
  switch (head_dim) {
    case 64: return ds == 2 ? decode_setup<64, 2>() : decode_setup<64, 1>();
    case 128: return ds == 2 ? decode_setup<128, 2>() : decode_setup<128, 1>();
    default: return ds == 2 ? decode_setup<256, 2>() : decode_setup<256, 1>();
  }
}

int decode_blocks_per_sm(int head_dim) { return decode_blocks_per_sm(head_dim, decode_d_split()); }

struct DecodeSplit {
  int nsplit;
  int chunk_len;
};

long ceil_div(long a, long b) { return (a + b - 1) / b; }

// Splits aimed at two waves of resident blocks; chunks of whole pages, at least kMinTilesPerChunk pages.
long max_splits(int batch, long units_per_request, int max_kv, int sms, int blocks_per_sm) {
  const long tiles = ceil_div(std::max(max_kv, 1), kBN);
  const long units = static_cast<long>(batch) * units_per_request;
  const long want = ceil_div(2L * sms * blocks_per_sm, units);
  // (at most kCombineMaxChunks: the combine kernel stages every chunk's m and l in shared memory)
  return std::max(1L, std::min({want, ceil_div(tiles, kMinTilesPerChunk), long(kCombineMaxChunks)}));
}

// The decode split: max_splits' count, or (HYPIC_ATTN_DECODE_WAVES) the count n <= it that minimises the waves of
// resident blocks times the pages per chunk, ceil(units n / resident) ceil(tiles / n), the fewest splits among equals:
// at hd 256 one block fits an SM, and 16 requests x 2 KV heads over 32k slots at max_splits' 9 chunks made 288 blocks
// on 132 SMs, three waves of 57 pages where 4 chunks make one wave of 128 pages (171 against 128).
DecodeSplit plan_decode(int batch, long units_per_request, int max_kv, int sms, int blocks_per_sm) {
  const long tiles = ceil_div(std::max(max_kv, 1), kBN);
  const long ns0 = max_splits(batch, units_per_request, max_kv, sms, blocks_per_sm);
  long ns = ns0;
  static CandidateSwitch waves("HYPIC_ATTN_DECODE_WAVES");
  if (waves.on()) {
    const long units = static_cast<long>(batch) * units_per_request;
    const long resident = std::max(1L, static_cast<long>(sms) * blocks_per_sm);
    long best = LONG_MAX;
    for (long n = 1; n <= ns0; ++n) {
      const long cost = ceil_div(units * n, resident) * ceil_div(tiles, n);
      if (cost < best) best = cost, ns = n;
    }
  }
  const long tpc = ceil_div(tiles, ns);
  return {static_cast<int>(ceil_div(tiles, tpc)), static_cast<int>(tpc * kBN)};
}

// attention_decode's launch shape for `batch` one-query requests on the current device: blocks of up to 16 query
// heads per KV head, and the split. Throws std::invalid_argument (naming fn) when the grid's y passes 65535.
struct DecodeShape {
  int head_blocks;
  DecodeSplit split;
};
DecodeShape decode_shape(const char* fn, int batch, int num_heads, int num_kv_heads, int head_dim, int max_kv) {
  const int head_blocks = static_cast<int>(ceil_div(num_heads / num_kv_heads, 16));
  if (static_cast<long>(num_kv_heads) * head_blocks > 65535)
    bad(fn, "num_kv_heads " + std::to_string(num_kv_heads) + " too large");
  return {head_blocks, plan_decode(batch, static_cast<long>(num_kv_heads) * head_blocks, max_kv, sm_count(),
                                   decode_blocks_per_sm(head_dim))};
}

size_t decode_ws_bytes(long entries, int head_dim) {
  return static_cast<size_t>(entries) * (head_dim + 2) * sizeof(float);
}

// HYPIC_ATTN_SPLIT_ORDER (read once): unset or "chunk" takes the split path's items chunk-major (see
// attn_split_plan_kernel); "group" group by group, as before (comparisons); anything else throws.
bool split_chunk_major() {
  static const bool on = [] {
    const char* e = std::getenv("HYPIC_ATTN_SPLIT_ORDER");
    if (!e || !*e || std::string(e) == "chunk") return true;
    if (std::string(e) == "group") return false;
    throw std::invalid_argument(std::string("HYPIC_ATTN_SPLIT_ORDER must be chunk or group, got '") + e + "'");
  }();
  return on;
}

bool split_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("HYPIC_ATTN_PREFILL_SPLIT");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

// The split path of one attention_prefill launch, from its host fields only (the group lengths live on the
// device): every bound holds for any lengths consistent with num_groups, total_q, max_q.
struct SplitPlan {
  bool use = false;
  int nsplit = 1, chunk_len = 0;
  long items_bound = 0;  // work items at most
  long q_bound = 0;      // split-path queries at most (combine grid)
  int grid = 0;          // persistent blocks
  bool pairs = false;    // the paired kernel runs it (split_pairs_wanted): the plan kernel writes sa.pairs
  size_t int_bytes = 0;  // item_off, qoff, counter, order (+ pairs, num_pairs) (rounded up to 256 bytes)
  size_t bytes = 0;      // whole workspace
};

// The ints of the plan's tables: item_off and qoff [G + 1] each, counter, order [items], and with pairs the entries
// [items][2] and their count; rounded up to 256 bytes.
size_t split_int_bytes(long G, long items, bool pairs) {
  return (static_cast<size_t>(2 * (G + 1) + 1 + items + (pairs ? 2 * items + 1 : 0)) * sizeof(int) + 255) / 256 * 256;
}

// A plan of nsplit chunks of chunk_len slots, `items` work items at most, q_bound split-path queries, over G groups
// (use = false when the sizes overflow the kernels' int indexing).
SplitPlan finish_split_plan(long G, long nsplit, long chunk_len, long items, long q_bound, long resident,
                            int head_dim) {
  SplitPlan sp;
  if (items > INT_MAX / kSplitBM || chunk_len > INT_MAX / 2) return sp;
  sp.use = true;
  sp.nsplit = static_cast<int>(nsplit);
  sp.chunk_len = static_cast<int>(chunk_len);
  sp.items_bound = items;
  sp.q_bound = q_bound;
  sp.grid = static_cast<int>(std::max(1L, std::min(items, resident)));
  sp.int_bytes = split_int_bytes(G, items, false);
  sp.bytes = sp.int_bytes + (nsplit > 1 ? static_cast<size_t>(items) * kSplitBM * (head_dim + 2) * sizeof(float) : 0);
  return sp;
}

SplitPlan plan_split_bound(const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim) {
  SplitPlan sp;
  if (!split_enabled() || g.num_groups <= 0 || g.total_q <= 0 || g.max_kv <= 0 || num_heads > 65535) return sp;
  if (g.num_groups == 1 && g.total_q > kSplitMaxQ) return sp;  // one long group
  const long G = g.num_groups, ratio = num_heads / num_kv_heads;
  const long q_bound = std::min<long>(g.total_q, static_cast<long>(kSplitMaxQ) * G);
  const long len_bound = std::min(g.max_q, kSplitMaxQ);
  // Row tiles of the split groups: sum_g ceil(ratio len_g / BM) <= ceil(ratio sum len / BM) + G, and
  // <= G ceil(ratio max len / BM).
  const long rt_bound = std::min(ceil_div(ratio * q_bound, kSplitBM) + G, G * ceil_div(ratio * len_bound, kSplitBM));
  const long tiles = ceil_div(g.max_kv, kBN);
  const long resident = split_resident_blocks(head_dim);
  // Chunks sized so that the (over-)estimated work, every tile's KV at max_kv, makes ~kSplitWaves items
  // per resident block; at least kMinTilesPerChunk pages per chunk.
  long ct = std::max<long>(kMinTilesPerChunk, ceil_div(num_kv_heads * rt_bound * tiles, kSplitWaves * resident));
  ct = std::min(ct, tiles);
  const long nsplit = ceil_div(tiles, ct);
  const long items = num_kv_heads * rt_bound * nsplit;
  return finish_split_plan(G, nsplit, ct * kBN, items, q_bound, resident, head_dim);
}

void check_host_tables(const char* fn, const AttnGroups& g);

// The split path planned from the host copies of q_start / slot0 (HYPIC_ATTN_SPLIT_EXACT, a candidate: switches.h):
// the real row tiles and KV lengths of the split groups instead of bounds from max_q / max_kv, so the chunks are
// sized from the real work (the 1-token query of a 32k prefill: 18 items of ~28 pages each on 18 of 264 resident
// blocks from the bounds, 478 us per layer; here 2-page chunks over every block). attn_split_plan_kernel computes the
// same items from the device tables (same nsplit, chunk_len and per-group formulas), so the workspace is exact.
// use = false when no group takes the split path.
SplitPlan plan_split_exact(const char* fn, const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim) {
  SplitPlan sp;
  if (!split_enabled() || g.num_groups <= 0 || g.total_q <= 0 || num_heads > 65535) return sp;
  check_host_tables(fn, g);
  const long ratio = num_heads / num_kv_heads;
  long q = 0, work = 0, max_tiles = 0;
  for (int i = 0; i < g.num_groups; ++i) {
    const long len = g.q_start_host[i + 1] - g.q_start_host[i];
    if (len < 1 || len > kSplitMaxQ) continue;
    const long rt = ceil_div(ratio * len, kSplitBM), tiles = ceil_div(g.slot0_host[i] + len, kBN);
    q += len;
    work += num_kv_heads * rt * tiles;
    max_tiles = std::max(max_tiles, tiles);
  }
  if (q == 0) return sp;
  const long resident = split_resident_blocks(head_dim);
  const long ct = std::min(max_tiles, std::max<long>(kMinTilesPerChunk, ceil_div(work, kSplitWaves * resident)));
  const long nsplit = ceil_div(max_tiles, ct), chunk_len = ct * kBN;
  long items = 0;
  for (int i = 0; i < g.num_groups; ++i) {
    const long len = g.q_start_host[i + 1] - g.q_start_host[i];
    if (len < 1 || len > kSplitMaxQ) continue;
    items += num_kv_heads * ceil_div(ratio * len, kSplitBM) *
             std::min(nsplit, ceil_div(g.slot0_host[i] + len, chunk_len));
  }
  return finish_split_plan(g.num_groups, nsplit, chunk_len, items, q, resident, head_dim);
}

bool split_exact_on() {
  static CandidateSwitch on("HYPIC_ATTN_SPLIT_EXACT");
  return on.on();
}

// The split plan of one call: exact from the host tables where given, HYPIC_ATTN_SPLIT_EXACT is on (the default) and the stream is not
// being captured (a graph replays its plan's chunking and workspace with whatever tables its replays hold: only the
// bound plan holds for all of them), else from bounds.
SplitPlan plan_split_chunks(const char* fn, const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim,
                            cudaStream_t stream) {
  if (g.q_start_host && g.slot0_host && split_exact_on()) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
    if (capturing == cudaStreamCaptureStatusNone) return plan_split_exact(fn, g, num_heads, num_kv_heads, head_dim);
  }
  return plan_split_bound(g, num_heads, num_kv_heads, head_dim);
}

// Whether the paired split kernel runs the call's split path: HYPIC_ATTN_SPLIT_PAIR (a candidate) on, the caller's
// groups windows of one sequence (AttnGroups::shared_sequence: the pairs it makes share their K / V tiles; the plan
// kernel still checks the pages of each pair) and the wgmma split kernel available.
bool split_pairs_wanted(const AttnGroups& g, int head_dim) {
#if HYPIC_ATTN_WGMMA_BUILT
  static CandidateSwitch pair("HYPIC_ATTN_SPLIT_PAIR");
  return g.shared_sequence && pair.on() && wgmma_split_available(head_dim);
#else
  (void)g, (void)head_dim;
  return false;
#endif
}

// sp with the paired kernel's tables when split_pairs_wanted.
SplitPlan with_pairs(SplitPlan sp, const AttnGroups& g, int head_dim) {
  if (sp.use && split_pairs_wanted(g, head_dim)) {
    const size_t ints = split_int_bytes(g.num_groups, sp.items_bound, true);
    sp.bytes += ints - sp.int_bytes;
    sp.int_bytes = ints;
    sp.pairs = true;
  }
  return sp;
}

SplitPlan plan_split(const char* fn, const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim,
                     cudaStream_t stream) {
  return with_pairs(plan_split_chunks(fn, g, num_heads, num_kv_heads, head_dim, stream), g, head_dim);
}

void check_groups(const char* fn, const AttnGroups& g) {
  if (g.num_groups < 0) bad(fn, "num_groups " + std::to_string(g.num_groups) + " is negative");
  if (g.num_groups > 65535) bad(fn, "num_groups " + std::to_string(g.num_groups) + " exceeds 65535");
  if (g.num_groups == 0) return;
  check_ptr(fn, g.q_start, "q_start");
  check_ptr(fn, g.slot0, "slot0");
  check_ptr(fn, g.block_table, "block_table");
  if (g.max_pages <= 0) bad(fn, "max_pages " + std::to_string(g.max_pages) + " must be positive");
  if (g.total_q < 0) bad(fn, "total_q " + std::to_string(g.total_q) + " is negative");
  if (g.max_q < 0) bad(fn, "max_q " + std::to_string(g.max_q) + " is negative");
  if (g.total_q > 0 && g.max_q == 0) bad(fn, "max_q 0 with total_q " + std::to_string(g.total_q));
}

void check_attn_args(const char* fn, const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim,
                     const bf16* q, const bf16* k_pool, const bf16* v_pool, bf16* out) {
  check_groups(fn, g);
  check_heads(fn, num_heads, num_kv_heads);
  check_head_dim(fn, head_dim);
  check_aligned16(fn, q, "q");
  check_aligned16(fn, k_pool, "k_pool");
  check_aligned16(fn, v_pool, "v_pool");
  check_aligned16(fn, out, "out");
}

AttnParams make_params(const AttnGroups& g, int num_heads, int num_kv_heads, const bf16* q, const bf16* k_pool,
                       const bf16* v_pool, float scale, const bf16* gate, long gate_ts, int gate_hs, bf16* out) {
  AttnParams p{};
  p.q_start = g.q_start;
  p.slot0 = g.slot0;
  p.block_table = g.block_table;
  p.max_pages = g.max_pages;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.ratio = num_heads / num_kv_heads;
  p.q = q;
  p.k_pool = k_pool;
  p.v_pool = v_pool;
  p.scale_log2 = scale * kLog2e;
  p.gate = gate;
  p.gate_ts = gate_ts;
  p.gate_hs = gate_hs;
  p.out = out;
  p.long_rule = CudnnRule{};  // (takes no group)
  return p;
}

// split_max_q > 0: groups of at most that many queries are left to the split path.
template <int HD>
void launch_prefill(const AttnParams& p, int num_groups, int max_q, cudaStream_t stream, int split_max_q = 0) {
  using C = PrefillCfg<HD>;
#if HYPIC_ATTN_WGMMA_BUILT
  if (wgmma_prefill_available(HD)) {  // Hopper: the wgmma kernel (attention_wgmma.cu)
    launch_prefill_wgmma(p, HD, num_groups, max_q, split_max_q, stream);
    return;
  }
#endif
  prefill_setup<HD>();
  const dim3 grid(p.num_heads, num_groups, static_cast<unsigned>(ceil_div(max_q, C::kBM)));
  if (split_max_q > 0)
    attn_prefill_kernel<HD, true><<<grid, C::kThreads, C::kSmem, stream>>>(p, split_max_q);
  else
    attn_prefill_kernel<HD, false><<<grid, C::kThreads, C::kSmem, stream>>>(p, 0);
  check_cuda(cudaGetLastError(), "attn_prefill_kernel<" + std::to_string(HD) + "> launch");
}

template <int HD>
void launch_split(const AttnParams& p, const SplitArgs& sa, const AttnGroups& g, const SplitPlan& sp,
                  cudaStream_t stream) {
  using C = SplitCfg<HD>;
  split_setup<HD>();
  attn_split_plan_kernel<<<1, kPlanThreads, 0, stream>>>(p, sa);
  check_cuda(cudaGetLastError(), "attn_split_plan_kernel launch");
#if HYPIC_ATTN_WGMMA_BUILT
  if (sa.pairs) {  // (split_pairs_wanted) two items per block over shared K / V tiles
    launch_split_pair(p, sa, HD, sp.items_bound, stream);
  } else if (wgmma_split_available(HD)) {  // Hopper: the wgmma split kernel (attention_wgmma.cu)
    launch_split_wgmma(p, sa, HD, sp.items_bound, stream);
  } else
#endif
  {
    attn_split_kernel<HD><<<sp.grid, C::kThreads, C::kSmem, stream>>>(p, sa);
    check_cuda(cudaGetLastError(), "attn_split_kernel<" + std::to_string(HD) + "> launch");
  }
  if (g.max_q > sa.split_max_q)  // longer groups (those p.long_rule takes are cuDNN's: skipped)
    launch_prefill<HD>(p, g.num_groups, g.max_q, stream, sa.split_max_q);
  if (sp.nsplit > 1) {
    attn_split_combine_kernel<HD><<<dim3(static_cast<unsigned>(sp.q_bound), p.num_heads), HD, 0, stream>>>(p, sa);
    check_cuda(cudaGetLastError(), "attn_split_combine_kernel<" + std::to_string(HD) + "> launch");
  }
}

// The split path's arguments over a workspace of sp.bytes at `base`.
SplitArgs split_args(const AttnGroups& g, const SplitPlan& sp, unsigned char* base, int head_dim) {
  SplitArgs sa{};
  sa.item_off = reinterpret_cast<int*>(base);
  sa.qoff = sa.item_off + (g.num_groups + 1);
  sa.counter = sa.qoff + (g.num_groups + 1);
  sa.order = sa.counter + 1;
  if (sp.pairs) {
    sa.pairs = sa.order + sp.items_bound;
    sa.num_pairs = sa.pairs + 2 * sp.items_bound;
  }
  if (sp.nsplit > 1) {
    sa.ws_acc = reinterpret_cast<float*>(base + sp.int_bytes);
    sa.ws_ml = sa.ws_acc + static_cast<size_t>(sp.items_bound) * kSplitBM * head_dim;
  }
  sa.split_max_q = kSplitMaxQ;
  sa.chunk_major = split_chunk_major();
  static CandidateSwitch skip_rescale("HYPIC_ATTN_SKIP_RESCALE");
  sa.skip_rescale = skip_rescale.on() ? 1 : 0;
  sa.nsplit = sp.nsplit;
  sa.chunk_len = sp.chunk_len;
  sa.num_groups = g.num_groups;
  return sa;
}

// The long groups of one attention_prefill call that cuDNN runs: runs of consecutive groups of equal (length,
// slot0) (plan_cudnn_runs, cudnn_route.h), each one SDPA call over its groups' K/V gathered into the workspace.
struct CudnnRun : CudnnRunPlan {
  CudnnSdpaShape shape;  // the plan's: (b, s_q, s_kv) and the heads; runtime_offset with the buckets
  size_t plan_ws = 0;
  bool pad_q() const { return s_q != q_len; }  // q / out through padded scratch
};
struct CudnnRoute {
  std::vector<CudnnRun> runs;
  CudnnRule rule;            // the groups it takes are cuDNN's (our kernels skip them)
  bool all_routed = false;   // every non-empty group is cuDNN's: our kernels have nothing to do
  size_t scratch_bytes = 0;  // K/V gather (+ padded q / out copies) + cuDNN workspace of the largest run
};

// The counted FLOP (4 x len x (slot0 + len / 2) x heads x head_dim; by default a group is counted as if at slot0 0)
// from which a group goes to cuDNN: its plan costs 35-72 ms to build, once per shape (cuDNN compiles its kernel), and
// cuDNN saves about 8e-16 s per FLOP against our kernels on the H200 (209.4 against 139.2 ms for ten 32k layers,
// 2026-12-04), so at 6e12 one prefill of a new length with ten attention layers roughly pays for its plan (48 ms):
// 27k queries at 16 x 256 heads. The rule depends on the call's groups alone (not on what ran before).
constexpr double kCudnnMinFlops = 6e12;

// Which groups cuDNN takes (cudnn_route.h): every group of more than kSplitMaxQ queries with HYPIC_ATTN_CUDNN=all;
// else those whose counted FLOP reach kCudnnMinFlops, counted at slot0 0 (by length alone) or, with
// HYPIC_ATTN_CUDNN_PREFIX (default on), with their cached slots (the later chunks of a prompt cut into the workers'
// 16384-token passes: the second chunk of a 32k prompt does 6.6e12 at 16 x 256 heads, the first 2.2e12); and with the
// buckets (HYPIC_ATTN_CUDNN_BUCKETS, default on) also every group of more than kSplitMaxQ queries at slot0 0 (one plan
// per length bucket, a bounded set; a group with cached slots would need a plan per slot0, compiled within its
// request's TTFT: only its own work pays for that).
CudnnRule cudnn_rule(int num_heads, int head_dim, bool buckets) {
  if (cudnn_sdpa_all_long_groups()) {
    CudnnRule r;
    r.min_len = r.min_q = kSplitMaxQ + 1;
    return r;
  }
  static CandidateSwitch prefix_switch("HYPIC_ATTN_CUDNN_PREFIX");
  CudnnRule r = cudnn_flop_rule(kCudnnMinFlops, num_heads, head_dim, kSplitMaxQ + 1, prefix_switch.on());
  if (buckets) r.min_q0 = kSplitMaxQ + 1;
  return r;
}

size_t cudnn_gather_bytes(const CudnnSdpaShape& s) {
  return static_cast<size_t>(2) * s.b * s.s_kv * s.num_kv_heads * s.head_dim * sizeof(bf16);
}

// Bytes of one padded q (or out) copy of a run: [b][s_q][num_heads][head_dim] bf16.
size_t cudnn_q_bytes(const CudnnSdpaShape& s) {
  return static_cast<size_t>(s.b) * s.s_q * s.num_heads * s.head_dim * sizeof(bf16);
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// The host copies of q_start / slot0 against the call's bounds (they index q, out and the block table).
void check_host_tables(const char* fn, const AttnGroups& g) {
  if (g.q_start_host[0] != 0) bad(fn, "q_start_host[0] is " + std::to_string(g.q_start_host[0]) + ", not 0");
  for (int i = 0; i < g.num_groups; ++i) {
    const long len = static_cast<long>(g.q_start_host[i + 1]) - g.q_start_host[i];
    const int s0 = g.slot0_host[i];
    if (len < 0 || len > g.max_q)
      bad(fn, "q_start_host gives group " + std::to_string(i) + " " + std::to_string(len) + " queries (max_q " +
                  std::to_string(g.max_q) + ")");
    if (s0 < 0) bad(fn, "slot0_host[" + std::to_string(i) + "] " + std::to_string(s0) + " is negative");
    if (static_cast<long>(s0) + len > static_cast<long>(g.max_pages) * kKvPageTokens)
      bad(fn, "slot0_host[" + std::to_string(i) + "] " + std::to_string(s0) + " + " + std::to_string(len) +
                  " queries exceed the block table's " + std::to_string(g.max_pages) + " pages");
  }
  if (g.q_start_host[g.num_groups] != g.total_q)
    bad(fn, "q_start_host[num_groups] " + std::to_string(g.q_start_host[g.num_groups]) + " differs from total_q " +
                std::to_string(g.total_q));
}

// Plans the cuDNN route of attention_prefill(..., ws, ...) (see attention.h); false: our kernels run every group.
// `sdpa` is the workspace's cuDNN state (created here on first use).
bool plan_cudnn_route(const char* fn, const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim,
                      std::unique_ptr<CudnnSdpa>& sdpa, cudaStream_t stream, CudnnRoute& r) {
  if (!g.q_start_host || !g.slot0_host || g.max_q <= kSplitMaxQ) return false;
  check_host_tables(fn, g);
  if (!cudnn_sdpa_available()) return false;
  int major = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, current_device()),
             "cudaDeviceGetAttribute");
  if (major < 8) return false;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
  if (capturing != cudaStreamCaptureStatusNone) return false;  // plans are built eagerly only
  // HYPIC_ATTN_CUDNN_BUCKETS: every group of more than kSplitMaxQ queries, on plans of padded length buckets (the
  // KV padded by as many rows as the queries, so that the plan's diagonal offset is the real slot0: cuDNN's engine
  // took the diagonal from the plan's dims, not from the by-value lengths each call passes, CudnnSdpaShape::
  // runtime_offset, which stay as the graph's inputs; test_gpu_attention "[cudnn]" checks groups with cached slots).
  static CandidateSwitch buckets_switch("HYPIC_ATTN_CUDNN_BUCKETS");
  const bool buckets = buckets_switch.on();
  r.rule = cudnn_rule(num_heads, head_dim, buckets);
  std::vector<CudnnRunPlan> plans;
  bool others = false;  // a non-empty group left to our kernels
  if (!plan_cudnn_runs(g.num_groups, g.q_start_host, g.slot0_host, r.rule, buckets, plans, others)) return false;
  if (plans.empty()) return false;
  for (const CudnnRunPlan& p : plans) {
    CudnnRun run;
    static_cast<CudnnRunPlan&>(run) = p;
    run.shape = CudnnSdpaShape{p.b, p.s_q, p.s_kv, num_heads, num_kv_heads, head_dim, buckets};
    r.runs.push_back(run);
  }
  r.all_routed = !others;
  if (!sdpa) sdpa = std::make_unique<CudnnSdpa>();
  sdpa->trim(stream);
  for (CudnnRun& run : r.runs) {
    if (!sdpa->prepare(run.shape, &run.plan_ws)) return false;  // (no engine: our kernels run every group)
    const size_t q_copies = run.pad_q() ? 2 * align256(cudnn_q_bytes(run.shape)) : 0;
    r.scratch_bytes =
        std::max(r.scratch_bytes, align256(cudnn_gather_bytes(run.shape)) + q_copies + align256(run.plan_ws));
  }
  return true;
}

void run_cudnn_route(const AttnGroups& g, const CudnnRoute& r, int num_heads, int num_kv_heads, int head_dim,
                     const bf16* q, const bf16* k_pool, const bf16* v_pool, float scale, const bf16* gate,
                     long gate_token_stride, int gate_head_stride, bf16* out, unsigned char* scratch,
                     CudnnSdpa& sdpa, long& launches, cudaStream_t stream) {
  for (const CudnnRun& run : r.runs) {  // one scratch for every run, in stream order
    const CudnnSdpaShape& s = run.shape;
    // Scratch: gathered K, V | padded q, out copies (when the queries are padded) | cuDNN's workspace.
    bf16* kg = reinterpret_cast<bf16*>(scratch);
    bf16* vg = kg + static_cast<size_t>(s.b) * s.s_kv * num_kv_heads * head_dim;
    unsigned char* next = scratch + align256(cudnn_gather_bytes(s));
    bf16* q_pad = nullptr;
    bf16* out_pad = nullptr;
    if (run.pad_q()) {
      q_pad = reinterpret_cast<bf16*>(next);
      out_pad = reinterpret_cast<bf16*>(next + align256(cudnn_q_bytes(s)));
      next += 2 * align256(cudnn_q_bytes(s));
    }
    void* plan_ws = run.plan_ws ? next : nullptr;
    gather_kv(s.b, run.kv_len, s.s_kv, num_kv_heads, head_dim, g.block_table, g.max_pages, run.group0, k_pool, v_pool,
              kg, vg, stream);
    const size_t row0 = static_cast<size_t>(run.q0) * num_heads * head_dim;
    if (run.pad_q()) {  // each group's rows into its padded slot, the padding rows zero (their outputs are dropped)
      const size_t row = static_cast<size_t>(num_heads) * head_dim;  // elements per query row
      const size_t real = static_cast<size_t>(run.q_len) * row, padded = static_cast<size_t>(s.s_q) * row;
      for (int j = 0; j < s.b; ++j) {  // (1D copies: a 2D copy's pitch may pass the device's limit at long s_q)
        check_cuda(cudaMemcpyAsync(q_pad + j * padded, q + row0 + j * real, real * sizeof(bf16),
                                   cudaMemcpyDeviceToDevice, stream),
                   "cuDNN route: padded q copy");
        check_cuda(cudaMemsetAsync(q_pad + j * padded + real, 0, (padded - real) * sizeof(bf16), stream),
                   "cuDNN route: q padding");
      }
      sdpa.run(s, q_pad, kg, vg, scale, out_pad, plan_ws, run.q_len, run.kv_len, stream);
      for (int j = 0; j < s.b; ++j)
        check_cuda(cudaMemcpyAsync(out + row0 + j * real, out_pad + j * padded, real * sizeof(bf16),
                                   cudaMemcpyDeviceToDevice, stream),
                   "cuDNN route: output copy");
    } else {
      sdpa.run(s, q + row0, kg, vg, scale, out + row0, plan_ws, run.q_len, run.kv_len, stream);
    }
    ++launches;
    if (gate)
      apply_output_gate(s.b * run.q_len, num_heads, head_dim, gate + static_cast<long>(run.q0) * gate_token_stride,
                        gate_token_stride, gate_head_stride, out + row0, stream);
  }
}

template <int HD>
void launch_decode(const AttnParams& p, int batch, int nsplit, bool kv_read_early, cudaStream_t stream) {
  const dim3 grid(nsplit, p.num_kv_heads * p.head_blocks, batch);
  const bool pdl = detail::mixer_pdl();
  // (without PDL the kernel starts after its predecessor completed: nothing to gain)
  static CandidateSwitch kv_early_switch("HYPIC_ATTN_DECODE_KV_EARLY");
  const int kv_early = kv_read_early && pdl && detail::pdl_enabled() && kv_early_switch.on() ? 1 : 0;
  const std::string what =
      "attn_decode_kernel<" + std::to_string(HD) + ", " + std::to_string(decode_d_split()) + "> launch";
  if (decode_d_split() == 2) {
    using C = DecodeCfg<HD, 2>;
    decode_setup<HD, 2>();
    detail::launch_pdl_if(pdl, attn_decode_kernel<HD, 2>, grid, dim3(C::kThreads), C::kSmem, stream, what, p,
                          kv_early);
  } else {
    using C = DecodeCfg<HD, 1>;
    decode_setup<HD, 1>();
    detail::launch_pdl_if(pdl, attn_decode_kernel<HD, 1>, grid, dim3(C::kThreads), C::kSmem, stream, what, p,
                          kv_early);
  }
  static CandidateSwitch groups("HYPIC_ATTN_COMBINE_GROUPS");
  if (nsplit > 1 && groups.on()) {
    detail::launch_pdl_if(pdl, attn_decode_combine_groups_kernel<HD>, dim3(p.num_heads, batch),
                          dim3(kCombineGroups * HD), 0, stream,
                          "attn_decode_combine_groups_kernel<" + std::to_string(HD) + "> launch", p, nsplit);
  } else if (nsplit > 1) {
    detail::launch_pdl_if(pdl, attn_decode_combine_kernel<HD>, dim3(p.num_heads, batch), dim3(HD), 0, stream,
                          "attn_decode_combine_kernel<" + std::to_string(HD) + "> launch", p, nsplit);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------

void attention_prefill(const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim, const bf16* q,
                       const bf16* k_pool, const bf16* v_pool, float scale, const bf16* gate, long gate_token_stride,
                       int gate_head_stride, bf16* out, cudaStream_t stream) {
  const char* fn = "attention_prefill";
  check_attn_args(fn, g, num_heads, num_kv_heads, head_dim, q, k_pool, v_pool, out);
  if (g.max_q > 65535L * PrefillCfg<64>::kBM) bad(fn, "max_q " + std::to_string(g.max_q) + " exceeds 65535 * 128");
  if (g.num_groups == 0 || g.total_q == 0) return;
  const AttnParams p =
      make_params(g, num_heads, num_kv_heads, q, k_pool, v_pool, scale, gate, gate_token_stride, gate_head_stride, out);
  switch (head_dim) {
    case 64: launch_prefill<64>(p, g.num_groups, g.max_q, stream); break;
    case 128: launch_prefill<128>(p, g.num_groups, g.max_q, stream); break;
    default: launch_prefill<256>(p, g.num_groups, g.max_q, stream); break;
  }
}

void attention_prefill(const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim, const bf16* q,
                       const bf16* k_pool, const bf16* v_pool, float scale, const bf16* gate, long gate_token_stride,
                       int gate_head_stride, bf16* out, AttnDecodeWorkspace& ws, cudaStream_t stream) {
  const char* fn = "attention_prefill";
  check_attn_args(fn, g, num_heads, num_kv_heads, head_dim, q, k_pool, v_pool, out);
  if (g.max_q > 65535L * PrefillCfg<64>::kBM) bad(fn, "max_q " + std::to_string(g.max_q) + " exceeds 65535 * 128");
  if (g.num_groups == 0 || g.total_q == 0) return;
  const SplitPlan sp = plan_split(fn, g, num_heads, num_kv_heads, head_dim, stream);
  CudnnRoute route;
  bool cudnn = plan_cudnn_route(fn, g, num_heads, num_kv_heads, head_dim, ws.cudnn_, stream, route);
  // The split path's area first (none when cuDNN takes every group), then cuDNN's scratch.
  const size_t split_bytes = sp.use && !(cudnn && route.all_routed) ? (sp.bytes + 255) / 256 * 256 : 0;
  if (cudnn && split_bytes + route.scratch_bytes > ws.bytes_) {
    if (ws.cudnn_failed_bytes_ && split_bytes + route.scratch_bytes >= ws.cudnn_failed_bytes_) {
      cudnn = false;  // did not fit before: our kernels (they need no gather)
    } else {
      try {
        ws.ensure(split_bytes + route.scratch_bytes, stream, fn);
      } catch (const std::runtime_error&) {
        if (cudaGetLastError() != cudaErrorMemoryAllocation) throw;  // not an allocation failure: report it
        ws.cudnn_failed_bytes_ = split_bytes + route.scratch_bytes;
        std::fprintf(stderr,
                     "hypic attention: no room for cuDNN's %zu-byte K/V gather; calls needing that much run on our "
                     "kernels\n",
                     ws.cudnn_failed_bytes_);
        cudnn = false;
      }
    }
  }
  AttnParams p =
      make_params(g, num_heads, num_kv_heads, q, k_pool, v_pool, scale, gate, gate_token_stride, gate_head_stride, out);
  if (cudnn) p.long_rule = route.rule;  // our kernels skip cuDNN's groups
  if (!(cudnn && route.all_routed)) {
    if (sp.use) {
      ws.ensure(sp.bytes, stream, fn);  // (no growth when the cuDNN route reserved more)
      const SplitArgs sa = split_args(g, sp, static_cast<unsigned char*>(ws.mem_), head_dim);
      switch (head_dim) {
        case 64: launch_split<64>(p, sa, g, sp, stream); break;
        case 128: launch_split<128>(p, sa, g, sp, stream); break;
        default: launch_split<256>(p, sa, g, sp, stream); break;
      }
    } else {
      switch (head_dim) {
        case 64: launch_prefill<64>(p, g.num_groups, g.max_q, stream); break;
        case 128: launch_prefill<128>(p, g.num_groups, g.max_q, stream); break;
        default: launch_prefill<256>(p, g.num_groups, g.max_q, stream); break;
      }
    }
  }
  if (cudnn)
    run_cudnn_route(g, route, num_heads, num_kv_heads, head_dim, q, k_pool, v_pool, scale, gate, gate_token_stride,
                    gate_head_stride, out, static_cast<unsigned char*>(ws.mem_) + split_bytes, *ws.cudnn_,
                    ws.cudnn_launches_, stream);
}

size_t AttnDecodeWorkspace::cudnn_plans() const { return cudnn_ ? cudnn_->plans() : 0; }

bool attention_cudnn_available() { return cudnn_sdpa_available(); }

std::string attention_cudnn_status() { return cudnn_sdpa_unavailable_reason(); }

int attention_decode_splits(int batch, int num_heads, int num_kv_heads, int head_dim, int max_kv) {
  const char* fn = "attention_decode_splits";
  if (batch <= 0 || batch > 65535) bad(fn, "batch " + std::to_string(batch) + " must be in 1 .. 65535");
  check_heads(fn, num_heads, num_kv_heads);
  if (max_kv <= 0) bad(fn, "max_kv " + std::to_string(max_kv) + " must be positive");
  check_head_dim(fn, head_dim);
  return decode_shape(fn, batch, num_heads, num_kv_heads, head_dim, max_kv).split.nsplit;
}

bool attention_split_wgmma_available(int head_dim) {
#if HYPIC_ATTN_WGMMA_BUILT
  return detail::wgmma_split_available(head_dim);
#else
  (void)head_dim;
  return false;
#endif
}

uint64_t attention_split_pair_launches() {
#if HYPIC_ATTN_WGMMA_BUILT
  return detail::split_pair_launches();
#else
  return 0;
#endif
}

void AttnDecodeWorkspace::reserve_prefill(const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim) {
  const char* fn = "AttnDecodeWorkspace::reserve_prefill";
  check_groups(fn, g);
  check_heads(fn, num_heads, num_kv_heads);
  check_head_dim(fn, head_dim);
  // The bound plan: what a captured call runs (plan_split); eager calls with the exact plan grow the workspace.
  const SplitPlan sp = with_pairs(plan_split_bound(g, num_heads, num_kv_heads, head_dim), g, head_dim);
  if (sp.use) ensure(sp.bytes, nullptr, fn);
}

AttnDecodeWorkspace::AttnDecodeWorkspace() = default;

AttnDecodeWorkspace::~AttnDecodeWorkspace() {
  if (mem_) cudaFree(mem_);
}

void AttnDecodeWorkspace::ensure(size_t bytes, cudaStream_t stream, const char* fn) {
  if (bytes <= bytes_) return;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
  if (capturing != cudaStreamCaptureStatusNone)
    throw std::invalid_argument(std::string(fn) + ": the workspace would grow from " + std::to_string(bytes_) +
                                " to " + std::to_string(bytes) +
                                " bytes during CUDA graph capture: call AttnDecodeWorkspace::reserve (decode) or "
                                "reserve_prefill first");
  if (mem_) {
    check_cuda(cudaDeviceSynchronize(), "AttnDecodeWorkspace: synchronise before freeing the old buffer");
    check_cuda(cudaFree(mem_), "cudaFree(AttnDecodeWorkspace)");
    mem_ = nullptr;
    bytes_ = 0;
  }
  check_cuda(cudaMalloc(&mem_, bytes), "cudaMalloc(AttnDecodeWorkspace, " + std::to_string(bytes) + " bytes)");
  bytes_ = bytes;
}

void AttnDecodeWorkspace::reserve(int max_batch, int num_heads, int head_dim, int max_kv) {
  const char* fn = "AttnDecodeWorkspace::reserve";
  if (max_batch <= 0) bad(fn, "max_batch " + std::to_string(max_batch) + " must be positive");
  if (num_heads <= 0) bad(fn, "num_heads " + std::to_string(num_heads) + " must be positive");
  if (max_kv <= 0) bad(fn, "max_kv " + std::to_string(max_kv) + " must be positive");
  check_head_dim(fn, head_dim);
  // Either form of the decode kernel (HYPIC_ATTN_DECODE_D_SPLIT may change after the reserve): the more resident
  // blocks, the more splits.
  const int sms = sm_count(), bps = std::max(decode_blocks_per_sm(head_dim, 1), decode_blocks_per_sm(head_dim, 2));
  // Upper bound over every batch <= max_batch, KV head count and max_kv' <= max_kv (splits do not grow
  // with more units per request or a shorter max_kv).
  long entries = 0;
  for (int b = 1; b <= max_batch; ++b) {
    const long ns = max_splits(b, 1, max_kv, sms, bps);
    if (ns > 1) entries = std::max(entries, static_cast<long>(b) * num_heads * ns);
  }
  if (entries > 0) ensure(decode_ws_bytes(entries, head_dim), nullptr, fn);
}

void attention_decode(const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim, const bf16* q,
                      const bf16* k_pool, const bf16* v_pool, float scale, const bf16* gate, long gate_token_stride,
                      int gate_head_stride, bf16* out, AttnDecodeWorkspace& ws, cudaStream_t stream,
                      bool kv_read_early) {
  const char* fn = "attention_decode";
  check_attn_args(fn, g, num_heads, num_kv_heads, head_dim, q, k_pool, v_pool, out);
  if (g.num_groups == 0) return;
  if (g.max_q != 1) bad(fn, "max_q " + std::to_string(g.max_q) + " must be 1 (one query per group)");
  if (g.total_q != g.num_groups)
    bad(fn, "total_q " + std::to_string(g.total_q) + " must equal num_groups " + std::to_string(g.num_groups));
  if (g.max_kv <= 0) bad(fn, "max_kv " + std::to_string(g.max_kv) + " must be positive");
  AttnParams p =
      make_params(g, num_heads, num_kv_heads, q, k_pool, v_pool, scale, gate, gate_token_stride, gate_head_stride, out);
  const DecodeShape shape = decode_shape(fn, g.num_groups, num_heads, num_kv_heads, head_dim, g.max_kv);
  p.head_blocks = shape.head_blocks;
  const DecodeSplit sp = shape.split;
  p.chunk_len = sp.chunk_len;
  static CandidateSwitch l2_ahead("HYPIC_ATTN_DECODE_L2_AHEAD");
  p.l2_ahead = l2_ahead.on() ? kDecodeL2Ahead : 0;
  static CandidateSwitch seq_chunks("HYPIC_ATTN_DECODE_SEQ_CHUNKS");
  p.seq_chunks = seq_chunks.on() ? 1 : 0;
  if (sp.nsplit > 1) {
    const long entries = static_cast<long>(g.num_groups) * num_heads * sp.nsplit;
    ws.ensure(decode_ws_bytes(entries, head_dim), stream, fn);
    p.ws_acc = static_cast<float*>(ws.mem_);
    p.ws_ml = p.ws_acc + static_cast<size_t>(entries) * head_dim;
  }
  switch (head_dim) {
    case 64: launch_decode<64>(p, g.num_groups, sp.nsplit, kv_read_early, stream); break;
    case 128: launch_decode<128>(p, g.num_groups, sp.nsplit, kv_read_early, stream); break;
    default: launch_decode<256>(p, g.num_groups, sp.nsplit, kv_read_early, stream); break;
  }
}

}  // namespace hypic::kernels::cuda
