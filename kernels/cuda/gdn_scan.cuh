// The chunk scan of the gated delta rule prefill (gated_delta_prefill.cu, which describes the whole pipeline; section
// 2 there), as a kernel template shared by two translation units: gated_delta_prefill.cu instantiates the mma.sync
// products (kWgmma = false, compute capability 9.0 machine code with compute_90 PTX), gdn_wgmma.cu (sm_90a only)
// the products on Hopper's warpgroup MMAs (kWgmma = true, the switch HYPIC_GDN_SCAN_WGMMA, default on). Also the
// per-(chunk, value head) workspace layout that the WY kernel writes and the scan reads. Internal to kernels/cuda.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace hypic::kernels::cuda::detail::gdn {


constexpr int D = kGdnHeadDim;  // 128
constexpr int C = kGdnChunk;    // 64
constexpr int LD = D + 8;       // padded row of a [*][128] bf16 tile
constexpr int LDP = C + 8;      // padded row of a [*][64] bf16 tile

// Workspace layout per (chunk, value head), in elements.
constexpr size_t kWElems = size_t(C) * D;  // W [64][128] and U^T [128][64], bf16
constexpr size_t kPElems = size_t(C) * C;  // P [64][64] bf16
constexpr int kScal = 3 * C;               // kf[64], qf[64], G[64] fp32
constexpr size_t kPerChunkHeadBytes = 2 * kWElems * 2 + kPElems * 2 + kScal * sizeof(float);

struct ChunkInfo {
  int seq, t0, len;
  int checkpoint;  // 1 + index into GdnPrefillArgs::checkpoint_states written after this chunk; 0 = none
};

struct WsView {
  bf16* W;
  bf16* UT;
  bf16* P;
  float* scal;
  const ChunkInfo* chunks;
};

__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}

// Rows t < len of a raw [T][H][128] bf16 input (row stride `stride` elements) into a [64][LD] tile;
// rows >= len are zero-filled.
__device__ __forceinline__ void cp_async_rows(bf16* s, const bf16* g, size_t stride, int len, int tid, int nthreads) {
  for (int p = tid; p < C * 16; p += nthreads) {
    const int row = p >> 4, col = (p & 15) * 8;
    const bool valid = row < len;
    cp_async16_zfill(s + row * LD + col, g + (valid ? size_t(row) * stride + col : 0), valid);
  }
}

// ---------------------------------------------------------------------------------------------
// 2. Sequential scan over chunks with fused outputs.
// A column block is 64 columns (four 16-column groups) of S or of T for one (sequence, value
// head). Warps have one of three roles for one group: S recurrence, T recurrence (they keep h^T of
// their group in accumulators and run v_new and the state update) and output (o^T of an S group,
// one chunk behind its recurrence warp, from the bf16 fragments of h^T and v_new^T that the
// recurrence warp leaves in shared memory). Output warps also stage the tiles, so the recurrence
// warps, which carry the sequential dependency, do nothing else. Block layouts (ScanParams):
//   separate: S blocks of 4 S-recurrence (+ 4 output) warps, T blocks of T-recurrence warps (8 when
//             S blocks have 8 warps, one T block per head; else 4);
//   mixed:    blocks of 4 S-recurrence (+ 4 output) + 4 T-recurrence warps sharing the staged tiles.
// Shared memory: ring A (2 slots: W, K, U^T of the block's columns, kf, G) for the recurrence
// warps, ring B (3 slots: Q, P, qf) for the output warps, the h^T / v_new^T fragment exchange
// (double-buffered) and one output staging tile per output warp.
constexpr int kGroupsPerBlock = 4;
constexpr int kRingA = 2, kRingB = 3;
constexpr int kStageA = 2 * C * LD * 2 + kGroupsPerBlock * 16 * LDP * 2 + 2 * C * 4;  // W, K, U^T, kf, G
constexpr int kStageB = C * LD * 2 + C * LDP * 2 + C * 4;                             // Q, P, qf
constexpr int kExchUint4 = 12 * 32;  // per group and buffer: 8 k-steps of h^T, 4 of v_new^T, per lane
constexpr int kExchBytes = 2 * kGroupsPerBlock * kExchUint4 * 16;
constexpr int kOutLd = 24;  // staging row: 16 columns + 8 pad (48 bytes: conflict-free, 16-byte aligned)
constexpr int kOutStageBytes = kGroupsPerBlock * C * kOutLd * 2;
constexpr int kScanSmem = kRingA * kStageA + kRingB * kStageB + kExchBytes + kOutStageBytes;
// The wgmma scan (kWgmma): the tiles that wgmma reads (W, K in ring A; Q, P in ring B) in the 128-byte-swizzled
// layout that wgmma descriptors name (PTX ISA, "Shared Memory Matrix Layout": a [64][8 u] bf16 tile as u / 8 column
// chunks of [64 rows][128 bytes], each row's 16-byte unit u at u % 8 ^ (row % 8), chunks on 1024-byte boundaries; the
// layout of attention_wgmma.cu's K / V tiles). Ring A: W0 K0 W1 K1 (64 KiB), then U^T, kf, G of stage 0 and 1;
// ring B: Q0 P0 Q1 P1 Q2 P2 (72 KiB), then qf of the three stages; the exchange and the output staging follow as in
// the mma.sync layout. + 1024 bytes to align the base.
constexpr int kSwTile = C * D * 2;                                             // a [64][128] tile: 16384
constexpr int kSwTileP = C * C * 2;                                            // a [64][64] tile: 8192
constexpr int kStageAUtWg = kGroupsPerBlock * 16 * LDP * 2 + 2 * C * 4;        // U^T, kf, G of one stage
constexpr int kRingABytesWg = kRingA * 2 * kSwTile + kRingA * kStageAUtWg;
constexpr int kRingBBytesWg = kRingB * (kSwTile + kSwTileP) + kRingB * C * 4;
constexpr int kScanSmemWg = kRingABytesWg + kRingBBytesWg + kExchBytes + kOutStageBytes + 1024;
static_assert(kScanSmemWg <= 227 * 1024, "wgmma scan shared memory over the per-block limit");
static_assert(kRingABytesWg % 1024 == 0 && (kSwTile + kSwTileP) % 1024 == 0, "swizzled tiles on 1024-byte bounds");
// The whole-TMA staging (gdn_scan_tma_kernel<kProf, true>, HYPIC_GDN_SCAN_TMA_ALL, default) places ring A's U^T,
// kf and G differently inside the same bytes: U^T of stage 0 and 1 swizzled as [64 block columns][64 tokens] (8 KiB
// each, 1024-byte aligned, a TMA box), then kf, G of stage 0 and 1 (512 bytes each, bulk copies).
constexpr int kUtSwOffset = kRingA * 2 * kSwTile;
constexpr int kScalSwOffset = kUtSwOffset + kRingA * kSwTileP;
static_assert(kScalSwOffset + kRingA * 2 * C * 4 <= kRingABytesWg && kUtSwOffset % 1024 == 0,
              "the whole-TMA staging's ring A fits the wgmma layout's");
// The TMA staging (gdn_scan_tma_kernel, HYPIC_GDN_SCAN_TMA, the default): the wgmma layout, plus two mbarriers
// after the output staging, one per parity of the job's chunk index, on which a chunk's TMA boxes complete.
constexpr int kScanTmaBarOffset = kRingABytesWg + kRingBBytesWg + kExchBytes + kOutStageBytes;
constexpr int kScanSmemWgTma = kScanSmemWg + 2 * 8;
static_assert(kScanSmemWgTma <= 227 * 1024, "TMA scan shared memory over the per-block limit");
static_assert(kScanTmaBarOffset % 8 == 0, "mbarriers 8-byte aligned");
template <bool kWgmma>
constexpr int ring_a_bytes() {
  return kWgmma ? kRingABytesWg : kRingA * kStageA;
}
template <bool kWgmma>
constexpr int ring_b_bytes() {
  return kWgmma ? kRingBBytesWg : kRingB * kStageB;
}
constexpr int kScanMaxThreads = 3 * kGroupsPerBlock * 32;
constexpr int kPrefetchAhead = 4;  // chunks ahead that the L2 prefetch runs
static_assert(kScanSmem <= 227 * 1024, "scan shared memory over the per-block limit");

enum ScanRole { kRecS, kRecT, kOut };

// One scan job (blockIdx.z): chunks [c_begin, c_begin + nc) of sequence `seq` (all of it, or one
// part of a split sequence). Jobs hold no pointers, so that a plan (the job table on the device)
// serves every layer of a forward pass: each state is a reference resolved against the launch's
// pointers, kRefNone (zero start / not written), kRefUser (the caller's [num_seqs][H_v][128][128]
// buffer at `seq`) or a slot >= 0 of the workspace's split-state arena ([slot][H_v][128][128]).
// kRefUserLast: the caller's final_state buffer itself (GdnPrefillArgs::final_state_last_only).
constexpr int kRefNone = -1, kRefUser = -2, kRefUserLast = -3;
struct ScanJob {
  int c_begin, nc;
  int out;  // 1: the job's outputs are computed (needs output warps in the launch)
  int seq;
  int init;         // S columns start from this state (kRefNone: zero)
  int init_t;       // T columns start from this transition (a prefix's T; kRefNone: I)
  int final_state;  // S columns end here
  int transition;   // T columns end here (kRefNone: the job wants no T)
  int checkpoints;  // 1: the job's S starts from the true state, so it writes the checkpoints of its chunks
};

struct ScanParams {
  int Hk, Hv;
  bool mixed;     // block layout (see above)
  bool with_out;  // the launch has output warps
  int s_blocks;   // separate layout: blocks per head carrying S columns (the rest carry T)
  const bf16* q;  // raw inputs
  const bf16* k;
  bf16* out;
  const float* user_init;  // the caller's state buffers (each may be null)
  float* user_final;
  float* user_transition;
  float* split;  // split-state arena
  float* const* checkpoints;  // GdnPrefillArgs::checkpoint_states (device), or null
  const ScanJob* jobs;
  WsView ws;
};

// The TMA tensor maps of the tiles that gdn_scan_tma_kernel stages by TMA (tensor_map.h's encode_bf16_map_3d: bf16,
// 128-byte swizzled, zeros outside), made on the host per launch (launch_scan_wgmma):
//   w: the workspace's W, [slots][64][128] as dims {128, 64, slots}, boxes {64, 64, 1} (two per tile);
//   p: the workspace's P, [slots][64][64] as dims {64, 64, slots}, boxes {64, 64, 1};
//   ut: the workspace's U^T, [slots][128][64] as dims {64, 128, slots}, boxes {64, 64, 1} (a column block's 64 rows;
//       read by the whole-TMA staging only);
//   k, q: the raw inputs [T][H_k][128] as dims {128, H_k, T}, boxes {64, 1, 64} (two per tile; q only with outputs).
// slots: the workspace's (chunk, value head) capacity; T: the call's tokens.
struct ScanMaps {
  CUtensorMap w, p, ut, k, q;
};

// Address of a job's [H_v][128][128] state reference (see ScanJob), or null.
__host__ __device__ __forceinline__ float* state_ref(int ref, int seq, const float* user, float* split, int Hv) {
  const size_t elems = size_t(Hv) * kGdnHeadDim * kGdnHeadDim;
  if (ref == kRefUser) return user ? const_cast<float*>(user) + size_t(seq) * elems : nullptr;
  if (ref == kRefUserLast) return const_cast<float*>(user);
  if (ref >= 0) return split + size_t(ref) * elems;
  return nullptr;
}

// Role, 16-column group (0..7) and column block (0..1) of warp w in block b.
__device__ __forceinline__ void scan_role(const ScanParams& p, int b, int w, ScanRole& role, int& group, int& cb) {
  const int nout = p.with_out ? 4 : 0;
  if (p.mixed) {
    cb = b;
    if (w < 4) role = kRecS, group = 4 * cb + w;
    else if (w < 4 + nout) role = kOut, group = 4 * cb + w - 4;
    else role = kRecT, group = 4 * cb + w - 4 - nout;
  } else if (b < p.s_blocks) {
    cb = b;
    role = w < 4 ? kRecS : kOut;
    group = 4 * cb + (w & 3);
  } else {  // T block: all warps T recurrence; 8 warps cover both column blocks
    role = kRecT;
    cb = (b - p.s_blocks) + (w >> 2);
    group = 4 * cb + (w & 3);
  }
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// A dense [rows][cols] bf16 global block (row stride gstride) into a [rows][ld] shared tile.
__device__ __forceinline__ void cp_async_dense(bf16* s, int ld, const bf16* g, int gstride, int rows, int cols,
                                               int tid, int nthreads) {
  const int per_row = cols / 8;
  for (int p = tid; p < rows * per_row; p += nthreads) {
    const int row = p / per_row, col = (p % per_row) * 8;
    cp_async16(s + row * ld + col, g + row * gstride + col);
  }
}

struct StageA {
  bf16 *W, *K, *UT;  // W, K [64][LD] (kWgmma: swizzled [2][64][64], see kScanSmemWg); U^T [64 block columns][LDP]
  float *kf, *G;
};
struct StageB {
  bf16 *Q, *P;  // Q [64][LD], P [64][LDP] (kWgmma: swizzled, see kScanSmemWg)
  float* qf;
};

// Stage i of ring A (kUtSw: the whole-TMA staging's U^T, kf, G; kWgmma only).
template <bool kWgmma, bool kUtSw = false>
__device__ __forceinline__ StageA stage_a(unsigned char* smem, int i) {
  static_assert(kWgmma || !kUtSw, "the swizzled U^T is the wgmma scan's");
  StageA s;
  if constexpr (kUtSw) {
    s.W = reinterpret_cast<bf16*>(smem + i * 2 * kSwTile);
    s.K = reinterpret_cast<bf16*>(smem + i * 2 * kSwTile + kSwTile);
    s.UT = reinterpret_cast<bf16*>(smem + kUtSwOffset + i * kSwTileP);
    s.kf = reinterpret_cast<float*>(smem + kScalSwOffset + i * 2 * C * 4);
    s.G = s.kf + C;
    return s;
  } else if constexpr (kWgmma) {
    s.W = reinterpret_cast<bf16*>(smem + i * 2 * kSwTile);
    s.K = reinterpret_cast<bf16*>(smem + i * 2 * kSwTile + kSwTile);
    s.UT = reinterpret_cast<bf16*>(smem + kRingA * 2 * kSwTile + i * kStageAUtWg);
  } else {
    unsigned char* b = smem + i * kStageA;
    s.W = reinterpret_cast<bf16*>(b);
    s.K = s.W + C * LD;
    s.UT = s.K + C * LD;
  }
  s.kf = reinterpret_cast<float*>(s.UT + kGroupsPerBlock * 16 * LDP);
  s.G = s.kf + C;
  return s;
}

template <bool kWgmma>
__device__ __forceinline__ StageB stage_b(unsigned char* smem, int i) {
  unsigned char* b = smem + ring_a_bytes<kWgmma>();
  StageB s;
  if constexpr (kWgmma) {
    s.Q = reinterpret_cast<bf16*>(b + i * (kSwTile + kSwTileP));
    s.P = reinterpret_cast<bf16*>(b + i * (kSwTile + kSwTileP) + kSwTile);
    s.qf = reinterpret_cast<float*>(b + kRingB * (kSwTile + kSwTileP) + i * C * 4);
  } else {
    b += i * kStageB;
    s.Q = reinterpret_cast<bf16*>(b);
    s.P = s.Q + C * LD;
    s.qf = reinterpret_cast<float*>(s.P + C * LDP);
  }
  return s;
}

// Byte offset of the 16-byte unit `unit` (elements 8 unit .. 8 unit + 7) of row `row` in a [64][8 u] bf16 tile in
// the 128-byte-swizzled layout of kScanSmemWg (u / 8 column chunks of [64 rows][128 bytes], the unit at
// unit % 8 ^ row % 8).
__device__ __forceinline__ uint32_t sw_off(int row, int unit) {
  return static_cast<uint32_t>((unit >> 3) * (C * 128) + row * 128 + (((unit & 7) ^ (row & 7)) << 4));
}

// Rows t < len of a [64][8 UNITS] bf16 global tile (row stride `stride` elements) into the swizzled layout of
// kScanSmemWg at s; rows >= len are zero-filled.
template <int UNITS>
__device__ __forceinline__ void cp_async_rows_sw(unsigned char* s, const bf16* g, size_t stride, int len, int tid,
                                                 int nthreads) {
  for (int p = tid; p < C * UNITS; p += nthreads) {
    const int row = p / UNITS, u = p % UNITS;
    const bool valid = row < len;
    cp_async16_zfill(s + sw_off(row, u), g + (valid ? size_t(row) * stride + u * 8 : 0), valid);
  }
}

// cp.async of workspace slot `slot`'s U^T columns of column block s_cb (when block_s) and its kf, G into stage a.
__device__ __forceinline__ void issue_ut_scalars(const StageA& a, const ScanParams& p, size_t slot, bool block_s,
                                                 int s_cb, int tid, int nthreads) {
  if (block_s) cp_async_dense(a.UT, LDP, p.ws.UT + slot * kWElems + s_cb * 64 * C, C, 64, C, tid, nthreads);
  const float* sc = p.ws.scal + slot * kScal;
  for (int i = tid; i < 2 * C / 4; i += nthreads)  // kf (scal[0..63]) and G (scal[128..191])
    cp_async16(a.kf + 4 * i, sc + (i < C / 4 ? 4 * i : C + 4 * i));
}
// cp.async of workspace slot `slot`'s qf (scal[64..127]) into stage b.
__device__ __forceinline__ void issue_qf(const StageB& b, const ScanParams& p, size_t slot, int tid, int nthreads) {
  const float* sc = p.ws.scal + slot * kScal;
  for (int i = tid; i < C / 4; i += nthreads) cp_async16(b.qf + 4 * i, sc + C + 4 * i);
}

// Stages chunk `chunk` (tokens t0 .. t0 + len - 1) for value head h / key head kh: ring A (U^T only
// for blocks with S columns, the 64 columns of column block s_cb) and, for blocks with output warps,
// ring B.
template <bool kWgmma>
__device__ __forceinline__ void scan_issue(unsigned char* smem, const ScanParams& p, int chunk, int t0, int len, int h,
                                           int kh, bool block_s, int s_cb, bool block_out, int tid, int nthreads) {
  const size_t slot = size_t(chunk) * p.Hv + h;
  const StageA a = stage_a<kWgmma>(smem, (chunk & 1));
  const size_t stride = size_t(p.Hk) * D, base = (size_t(t0) * p.Hk + kh) * D;
  if constexpr (kWgmma) {
    cp_async_rows_sw<D / 8>(reinterpret_cast<unsigned char*>(a.W), p.ws.W + slot * kWElems, D, C, tid, nthreads);
    cp_async_rows_sw<D / 8>(reinterpret_cast<unsigned char*>(a.K), p.k + base, stride, len, tid, nthreads);
  } else {
    cp_async_dense(a.W, LD, p.ws.W + slot * kWElems, D, C, D, tid, nthreads);
    cp_async_rows(a.K, p.k + base, stride, len, tid, nthreads);
  }
  issue_ut_scalars(a, p, slot, block_s, s_cb, tid, nthreads);
  if (block_out) {
    const StageB b = stage_b<kWgmma>(smem, chunk % kRingB);
    if constexpr (kWgmma) {
      cp_async_rows_sw<D / 8>(reinterpret_cast<unsigned char*>(b.Q), p.q + base, stride, len, tid, nthreads);
      cp_async_rows_sw<C / 8>(reinterpret_cast<unsigned char*>(b.P), p.ws.P + slot * kPElems, C, C, tid, nthreads);
    } else {
      cp_async_rows(b.Q, p.q + base, stride, len, tid, nthreads);
      cp_async_dense(b.P, LDP, p.ws.P + slot * kPElems, C, C, C, tid, nthreads);
    }
    issue_qf(b, p, slot, tid, nthreads);
  }
}

// scan_issue with the tiles that wgmma reads staged by TMA (sm_90a only): thread 0 of the issuers raises `bar`'s
// expected bytes and issues the boxes of W and P and, for a whole chunk (len == 64), of K and Q; a partial chunk's K
// and Q rows go by cp.async as in scan_issue (rows past len must be zeros, and the tensor's next rows belong to the
// next sequence or checkpoint run), as do U^T, kf, G and qf (U^T is read by ld.shared in its padded layout). kAll
// (HYPIC_GDN_SCAN_TMA_ALL, default): U^T as one swizzled box (block_s) and kf, G, qf as bulk copies on the same
// mbarrier too, into stage_a<true, true>'s places: no cp.async for a whole chunk. The caller waits on `bar` (parity
// of its use) and for the cp.async group before reading the stage.
template <bool kAll>
__device__ __forceinline__ void scan_issue_tma(unsigned char* smem, const ScanParams& p, const ScanMaps& maps,
                                               uint64_t* bar, int chunk, int t0, int len, int h, int kh, bool block_s,
                                               int s_cb, bool block_out, int tid, int nthreads) {
  const int slot = chunk * p.Hv + h;
  const StageA a = stage_a<true, kAll>(smem, (chunk & 1));
  const StageB b = stage_b<true>(smem, chunk % kRingB);
  const bool whole = len == C;
  const size_t stride = size_t(p.Hk) * D, base = (size_t(t0) * p.Hk + kh) * D;
  constexpr uint32_t kScalBytes = C * 4;  // one of kf, G, qf
  if (tid == 0) {
    uint32_t bytes = kSwTile + (whole ? kSwTile : 0) + (block_out ? kSwTileP + (whole ? kSwTile : 0) : 0);
    if constexpr (kAll) bytes += (block_s ? kSwTileP : 0) + 2 * kScalBytes + (block_out ? kScalBytes : 0);
    sm90::mbar_arrive_expect_tx(bar, bytes);
    const uint32_t w = smem_addr(a.W), k = smem_addr(a.K);
    sm90::tma_load_3d(w, &maps.w, bar, 0, 0, slot);  // columns 0..63, then 64..127 (the next 64 x 128-byte chunk)
    sm90::tma_load_3d(w + C * 128, &maps.w, bar, 64, 0, slot);
    if (whole) {
      sm90::tma_load_3d(k, &maps.k, bar, 0, kh, t0);
      sm90::tma_load_3d(k + C * 128, &maps.k, bar, 64, kh, t0);
    }
    if (block_out) {
      const uint32_t q = smem_addr(b.Q);
      if (whole) {
        sm90::tma_load_3d(q, &maps.q, bar, 0, kh, t0);
        sm90::tma_load_3d(q + C * 128, &maps.q, bar, 64, kh, t0);
      }
      sm90::tma_load_3d(smem_addr(b.P), &maps.p, bar, 0, 0, slot);
    }
    if constexpr (kAll) {
      if (block_s) sm90::tma_load_3d(smem_addr(a.UT), &maps.ut, bar, 0, s_cb * 64, slot);
      const float* sc = p.ws.scal + size_t(slot) * kScal;  // kf [0, 64), qf [64, 128), G [128, 192)
      sm90::bulk_load(smem_addr(a.kf), sc, kScalBytes, bar);
      sm90::bulk_load(smem_addr(a.G), sc + 2 * C, kScalBytes, bar);
      if (block_out) sm90::bulk_load(smem_addr(b.qf), sc + C, kScalBytes, bar);
    }
  }
  if (!whole) {
    cp_async_rows_sw<D / 8>(reinterpret_cast<unsigned char*>(a.K), p.k + base, stride, len, tid, nthreads);
    if (block_out)
      cp_async_rows_sw<D / 8>(reinterpret_cast<unsigned char*>(b.Q), p.q + base, stride, len, tid, nthreads);
  }
  if constexpr (!kAll) {
    issue_ut_scalars(a, p, size_t(slot), block_s, s_cb, tid, nthreads);
    if (block_out) issue_qf(b, p, size_t(slot), tid, nthreads);
  }
}

// L2 prefetch of what scan_issue will stage for `chunk`.
__device__ __forceinline__ void scan_prefetch(const ScanParams& p, int chunk, int t0, int len, int h, int kh,
                                              bool block_s, int s_cb, bool block_out, int tid, int nthreads) {
  const size_t slot = size_t(chunk) * p.Hv + h;
  const size_t stride = size_t(p.Hk) * D, base = (size_t(t0) * p.Hk + kh) * D;
  // 128-byte lines: W 128, K rows 128, U^T (64 columns) 64, Q rows 128, P 64, scal 6.
  for (int i = tid; i < 518; i += nthreads) {
    const void* a;
    if (i < 128) a = p.ws.W + slot * kWElems + i * 64;
    else if (i < 256) a = p.k + base + size_t(min((i - 128) >> 1, len - 1)) * stride + ((i - 128) & 1) * 64;
    else if (i < 262) a = p.ws.scal + slot * kScal + (i - 256) * 32;
    else if (i < 326) {
      if (!block_s) continue;
      a = p.ws.UT + slot * kWElems + s_cb * 64 * C + (i - 262) * 64;
    } else if (!block_out) break;
    else if (i < 454) a = p.q + base + size_t(min((i - 326) >> 1, len - 1)) * stride + ((i - 326) & 1) * 64;
    else a = p.ws.P + slot * kPElems + (i - 454) * 64;
    prefetch_l2(a);
  }
}

// bf16 A fragment (16 x 16, k-step of two n-tiles) from the C fragments lo (n-tile 2s) and hi
// (2s + 1) of a 16 x 8n accumulator, each column scaled: lo's columns by fa, hi's by fb.
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4],
                                       float2 fa = make_float2(1.f, 1.f), float2 fb = make_float2(1.f, 1.f)) {
  a[0] = pack_bf16(lo[0] * fa.x, lo[1] * fa.y);
  a[1] = pack_bf16(lo[2] * fa.x, lo[3] * fa.y);
  a[2] = pack_bf16(hi[0] * fb.x, hi[1] * fb.y);
  a[3] = pack_bf16(hi[2] * fb.x, hi[3] * fb.y);
}

// The recurrence warp's v_new^T = -vn as bf16 A fragments (its four k-steps of 16 tokens) into the exchange slots
// 8 .. 11 of the lane (ex: the lane's first slot) for the output warp.
__device__ __forceinline__ void export_vnew(uint4* ex, const float (&vn)[8][4]) {
#pragma unroll
  for (int s = 0; s < C / 16; ++s) {
    uint32_t a[4];
    pack_a(a, vn[2 * s], vn[2 * s + 1], make_float2(-1.f, -1.f), make_float2(-1.f, -1.f));
    ex[(8 + s) * 32] = make_uint4(a[0], a[1], a[2], a[3]);
  }
}

// o[j][e] (token 8 j + cc + (e & 1)) *= f[token]: the C fragments of a 16 x 64 (tokens) accumulator scaled per token
// (f: 64 fp32 in shared memory).
__device__ __forceinline__ void scale_tokens(float (&o)[8][4], const float* f, int cc) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 v = *reinterpret_cast<const float2*>(f + 8 * j + cc);
    o[j][0] *= v.x;
    o[j][1] *= v.y;
    o[j][2] *= v.x;
    o[j][3] *= v.y;
  }
}

// kWgmma (sm_90a code only): d (64 x 64 tokens) += A B^T over the 128 state rows, A the bf16 fragments a[s] of k-step
// s (register operand), B a swizzled [64 tokens][128] tile at shared address b (K-major: W or Q): eight m64n64k16,
// waited for (wgmma_batch_rs).
__device__ __forceinline__ void rs_times_tile_t(float (&d)[8][4], uint32_t (&a)[D / 16][4], uint32_t b) {
  sm90::wgmma_batch_rs(d, a, [&] {
#pragma unroll
    for (int s = 0; s < D / 16; ++s)
      sm90::wgmma_m64n64k16_rs(d, a[s], sm90::sw128_desc(b + (s >> 2) * (C * 128) + (s & 3) * 32, 16, 1024));
  });
}

// c0 += a b(n-tile 0), c1 += a b(n-tile 1) for the B fragments bb of two n-tiles (load_b_*).
__device__ __forceinline__ void mma_x2(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                       const uint32_t (&bb)[4]) {
  mma_bf16(c0, a, bb[0], bb[1]);
  mma_bf16(c1, a, bb[2], bb[3]);
}

// kWgmma: every product runs on warpgroup MMAs (sm_90a only: gdn_wgmma.cu) with the same register layouts.
// The recurrence warpgroups (S warps 0..3, T warps 4..7 or 8..11 in mixed blocks, 0..7 in T blocks) keep h^T as the
// m64n128 accumulator (warp w: columns 16 w .. of the warpgroup's 64) and vn as the m64n64 one, with the bf16 A
// fragments packed from them exactly as for mma.sync: v_new^T takes eight m64n64k16 (B = W, K-major), the state update
// four m64n128k16 (B = K, MN-major: attention_wgmma.cu's V operand). The output warpgroup (warps 4..7) takes the
// exchange's fragments as A: o = h^T Q^T (eight m64n64k16, B = Q K-major), scaled by qf, then + v_new^T P^T (four,
// B = P K-major, whose zeros above the diagonal the WY kernel writes). Q, P, W and K are staged swizzled
// (kScanSmemWg). Same inputs, outputs and exchange; only the fp32 summation order inside the products differs (and,
// with a non-finite v_new, the zero blocks of P that mma.sync skips carry its NaN to earlier tokens' outputs of the
// chunk, whose state is NaN either way).
// kProf: the instantiation with the clock reads of GdnPrefillArgs::scan_profile into `profile` (launched only when it
// is set; a separate argument, not a ScanParams field, so that the serving kernels' code stays as it was). The wgmma
// one spills a few registers (120 bytes): it times nearly, not exactly, the serving kernel.
// kL2Prefetch (HYPIC_GDN_SCAN_NO_L2_PREFETCH, on by default, turns it off in the wgmma scan): the issuing warps ask L2
// for the chunk kPrefetchAhead ahead (518 prefetch instructions per step, about 1050 of a step's 6300 cycles on the
// output warps' path on an H100: bench/results/gdn_scan_profile_h100.md).
// kTma (gdn_scan_tma_kernel, kWgmma only): W, K, Q, P staged by TMA (scan_issue_tma, `maps`), the rest by cp.async;
// the same tiles in the same layout, so the same products and bits as the cp.async staging. kAll (with kTma,
// HYPIC_GDN_SCAN_TMA_ALL, default): U^T and the scalars by TMA too, U^T read from its swizzled layout; same bits.
template <bool kWgmma, bool kProf, bool kL2Prefetch, bool kTma, bool kAll = false>
__device__ __forceinline__ void gdn_scan_body(const ScanParams& p, const ScanMaps* maps, long long* profile) {
  static_assert(!kTma || kWgmma, "the TMA staging writes the wgmma scan's swizzled layout");
  static_assert(kTma || !kAll, "the whole-TMA staging is a TMA staging");
  extern __shared__ __align__(16) unsigned char smem_raw[];  // (kWgmma aligns its base to 1024 below)
  unsigned char* smem = smem_raw;
  if constexpr (kWgmma) smem += (1024u - (smem_addr(smem_raw) & 1023u)) & 1023u;
  const int b = blockIdx.x, h = blockIdx.y;
  const int tid = threadIdx.x, nwarps = blockDim.x >> 5, lane = tid & 31;
  // (kWgmma: the warp index through a shuffle, so that the compiler sees the role branches as warp-uniform and keeps
  // the wgmmas pipelined instead of serialising them.)
  const int warp = kWgmma ? __shfl_sync(0xffffffffu, tid >> 5, 0) : tid >> 5;
  const int gi = lane >> 2, cc = (lane & 3) * 2;
  const int kh = h / (p.Hv / p.Hk);
  const WsView& ws = p.ws;
  const ScanJob job = p.jobs[blockIdx.z];
  const int c_begin = job.c_begin, nc = job.nc;
  const float* j_init = state_ref(job.init, job.seq, p.user_init, p.split, p.Hv);
  const float* j_init_t = state_ref(job.init_t, job.seq, p.user_transition, p.split, p.Hv);
  float* j_final = state_ref(job.final_state, job.seq, p.user_final, p.split, p.Hv);
  float* j_trans = state_ref(job.transition, job.seq, p.user_transition, p.split, p.Hv);
  const size_t head_off = size_t(h) * D * D;
  const bool job_out = p.with_out && job.out;
  // Chunk c of the job: its entry of the chunk table (64 tokens, fewer at a sequence's end or a checkpoint).
  auto chunk_t0 = [&](int c) { return ws.chunks[c_begin + c].t0; };
  auto chunk_len = [&](int c) { return ws.chunks[c_begin + c].len; };

  ScanRole role;
  int group, cb;
  scan_role(p, b, warp, role, group, cb);
  bool block_s = false, has_out_warps = false, block_t = false;
  int s_cb = 0, first_out = nwarps;
  for (int w = 0; w < nwarps; ++w) {
    ScanRole r;
    int g, c2;
    scan_role(p, b, w, r, g, c2);
    if (r == kRecS) block_s = true, s_cb = c2;
    if (r == kRecT) block_t = true;
    if (r == kOut && !has_out_warps) has_out_warps = true, first_out = w;
  }
  // A block of T columns only, for a job that wants no T: nothing to do.
  if (!block_s && block_t && !j_trans) return;
  const bool block_out = has_out_warps && job_out;  // ring B staged, outputs computed
  // Output warps stage the tiles where they exist; otherwise every warp does.
  const bool issuer = has_out_warps ? role == kOut : true;
  const int itid = has_out_warps ? tid - 32 * first_out : tid;
  const int nissue = has_out_warps ? 32 * kGroupsPerBlock : blockDim.x;
  // T warps of a job that wants no T only keep the barriers.
  const bool rec_active = role == kRecS || (role == kRecT && j_trans);
  const int col0 = 16 * group;  // the warp's first column of S (or T)
  const int gl = group & 3;     // group within its column block
  uint4* exch = reinterpret_cast<uint4*>(smem + ring_a_bytes<kWgmma>() + ring_b_bytes<kWgmma>());

  // (kTma: the mbarriers of chunk parities 0 and 1, initialised before the first issue)
  uint64_t* tma_bar = nullptr;
  if constexpr (kTma) {
    tma_bar = reinterpret_cast<uint64_t*>(smem + kScanTmaBarOffset);
    if (tid == 0) {
      sm90::mbar_init(tma_bar, 1);
      sm90::mbar_init(tma_bar + 1, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  auto issue = [&](int c) {
    if constexpr (kTma)
      scan_issue_tma<kAll>(smem, p, *maps, tma_bar + (c & 1), c_begin + c, chunk_t0(c), chunk_len(c), h, kh, block_s,
                           s_cb, block_out, itid, nissue);
    else
      scan_issue<kWgmma>(smem, p, c_begin + c, chunk_t0(c), chunk_len(c), h, kh, block_s, s_cb, block_out, itid,
                         nissue);
  };
  if (issuer && nc > 0) issue(0);
  cp_async_commit();

  // Recurrence warps: acc[n][e] = h^T[col0 + gi (+8 for e >= 2)][d], d = 8n + cc + (e & 1), i.e.
  // S[d][col] (or T[d][col]).
  float acc[16][4];
  if (role != kOut) {
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = 8 * n + cc + (e & 1), col = col0 + gi + (e >= 2 ? 8 : 0);
        float val;
        if (role == kRecS)
          val = j_init ? j_init[head_off + size_t(d) * D + col] : 0.f;
        else
          val = j_init_t ? j_init_t[head_off + size_t(d) * D + col] : (d == col ? 1.f : 0.f);
        acc[n][e] = val;
      }
  }

  const int steps = nc + (block_out ? 1 : 0);  // output warps trail by one chunk
  // (GdnPrefillArgs::scan_profile: the first block's per-warp cycles by phase; block-uniform)
  const bool prof = kProf && profile && b == 0 && h == 0 && blockIdx.z == 0;
  // (the clock read as volatile asm with a memory clobber: the builtin's read was scheduled across the block barrier,
  // which then measured about 30 cycles for every warp)
  auto clock_now = [] {
    long long t;
    asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(t)::"memory");
    return t;
  };
  long long pt[5] = {0, 0, 0, 0, 0}, t_prev = prof ? clock_now() : 0;
  const long long t_first = t_prev;
  auto mark = [&](int i) {
    if (prof) {
      const long long t = clock_now();
      pt[i] += t - t_prev;
      t_prev = t;
    }
  };
  for (int c = 0; c < steps; ++c) {
    mark(4);  // (the previous step's role work)
    cp_async_wait<0>();
    if constexpr (kTma) {  // chunk c's TMA boxes: use (c >> 1) of its parity's mbarrier
      if (c < nc) sm90::mbar_wait(tma_bar + (c & 1), (c >> 1) & 1);
    }
    if constexpr (kWgmma) sm90::fence_proxy_async();  // cp.async's writes, read next by wgmma (async proxy)
    mark(0);
    __syncthreads();  // chunk c staged; every warp is done with the slots and exchange buffer it reuses
    mark(1);
    if (issuer && c + 1 < nc) issue(c + 1);
    cp_async_commit();
    mark(2);
    if (kL2Prefetch && !kTma && issuer && c + kPrefetchAhead < nc) {
      const int cn = c + kPrefetchAhead;
      scan_prefetch(p, c_begin + cn, chunk_t0(cn), chunk_len(cn), h, kh, block_s, s_cb, block_out, itid, nissue);
    }
    mark(3);

    if (rec_active && c < nc) {
      const StageA st = stage_a<kWgmma, kAll>(smem, (c_begin + c) & 1);
      uint4* ex = exch + ((c & 1) * kGroupsPerBlock + gl) * kExchUint4 + lane;
      const bool share = role == kRecS && block_out;
      // vn = -(v_new^T) = h^T W^T - U^T, C fragments over t = 8j + cc (+1), rows col0 + gi (+8).
      float vn[8][4];
      if (role == kRecS) {
        // (kAll: U^T swizzled as sw_off, [64][8 units]; rows r and r + 8 share r % 8, so one unit offset serves both)
        const int r = 16 * gl + gi;
        const unsigned char* ut = reinterpret_cast<const unsigned char*>(st.UT) + (kAll ? r * 128 : r * LDP * 2);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int o = kAll ? int(sw_off(0, j ^ (r & 7))) + cc * 2 : (8 * j + cc) * 2;
          const int o8 = o + (kAll ? 8 * 128 : 8 * LDP * 2);
          const float2 u0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(ut + o));
          const float2 u1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(ut + o8));
          vn[j][0] = -u0.x;
          vn[j][1] = -u0.y;
          vn[j][2] = -u1.x;
          vn[j][3] = -u1.y;
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) vn[j][0] = vn[j][1] = vn[j][2] = vn[j][3] = 0.f;
      }
      if constexpr (kWgmma) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        // vn += h^T W^T: eight m64n64k16 over the 128 state rows, A = h^T packed to bf16 (kept until the wait).
        uint32_t ha[D / 16][4];
#pragma unroll
        for (int s = 0; s < D / 16; ++s) {
          pack_a(ha[s], acc[2 * s], acc[2 * s + 1]);
          if (share) ex[s * 32] = make_uint4(ha[s][0], ha[s][1], ha[s][2], ha[s][3]);
        }
        const uint32_t w_addr = smem_addr(st.W), k_addr = smem_addr(st.K);
        rs_times_tile_t(vn, ha, w_addr);
        const float gamma = __expf(st.G[C - 1]);
        // (Scaling acc while the products above run made ptxas wait for them anyway: acc was last written by the
        // previous chunk's wgmmas.)
#pragma unroll
        for (int n = 0; n < 16; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[n][e] *= gamma;
        if (share) export_vnew(ex, vn);  // v_new^T = -vn as bf16 A fragments for the output warp
        // h^T += v_new^T diag(kf) K: four m64n128k16 over the chunk's 64 tokens, B = K read MN-major.
        uint32_t va[C / 16][4];
#pragma unroll
        for (int s = 0; s < C / 16; ++s) {
          const float2 fa = *reinterpret_cast<const float2*>(st.kf + 16 * s + cc);
          const float2 fb = *reinterpret_cast<const float2*>(st.kf + 16 * s + 8 + cc);
          pack_a(va[s], vn[2 * s], vn[2 * s + 1], make_float2(-fa.x, -fa.y), make_float2(-fb.x, -fb.y));
        }
        sm90::wgmma_batch_rs(acc, va, [&] {
#pragma unroll
          for (int s = 0; s < C / 16; ++s)
            sm90::wgmma_m64n128k16_rs_tb(acc, va[s], sm90::sw128_desc(k_addr + s * 16 * 128, C * 128, 1024));
        });
#else
        __trap();  // built for sm_90a only (gdn_wgmma.cu); the host checks the device
#endif
      } else {
#pragma unroll
        for (int s = 0; s < D / 16; ++s) {
          uint32_t a[4];
          pack_a(a, acc[2 * s], acc[2 * s + 1]);
          if (share) ex[s * 32] = make_uint4(a[0], a[1], a[2], a[3]);
#pragma unroll
          for (int jp = 0; jp < 4; ++jp) {
            uint32_t bb[4];
            load_b_nk(bb, st.W, LD, 16 * s, 16 * jp, lane);
            mma_x2(vn[2 * jp], vn[2 * jp + 1], a, bb);
          }
        }
        if (share) export_vnew(ex, vn);  // v_new^T = -vn as bf16 A fragments for the output warp
        // h^T = gamma h^T + v_new^T diag(kf) K.
        const float gamma = __expf(st.G[C - 1]);
#pragma unroll
        for (int n = 0; n < 16; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[n][e] *= gamma;
#pragma unroll
        for (int s = 0; s < C / 16; ++s) {
          const float2 fa = *reinterpret_cast<const float2*>(st.kf + 16 * s + cc);
          const float2 fb = *reinterpret_cast<const float2*>(st.kf + 16 * s + 8 + cc);
          uint32_t a[4];  // v_new^T diag(kf) = -vn diag(kf)
          pack_a(a, vn[2 * s], vn[2 * s + 1], make_float2(-fa.x, -fa.y), make_float2(-fb.x, -fb.y));
#pragma unroll
          for (int np = 0; np < 8; ++np) {
            uint32_t bb[4];
            load_b_kn(bb, st.K, LD, 16 * s, 16 * np, lane);
            mma_x2(acc[2 * np], acc[2 * np + 1], a, bb);
          }
        }
      }
      if (role == kRecS && job.checkpoints) {  // the state after this chunk, when a checkpoint ends here
        const int ck = ws.chunks[c_begin + c].checkpoint;
        if (ck > 0) {
          float* dst = p.checkpoints[ck - 1] + head_off;
#pragma unroll
          for (int n = 0; n < 16; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              dst[size_t(8 * n + cc + (e & 1)) * D + col0 + gi + (e >= 2 ? 8 : 0)] = acc[n][e];
        }
      }
    } else if (role == kOut && block_out && c >= 1) {
      // Chunk c - 1: o^T = (h^T Q^T) diag(qf) + v_new^T P^T, bf16 rows of out through the staging tile.
      const int co = c - 1;
      const StageB st = stage_b<kWgmma>(smem, (c_begin + co) % kRingB);
      const uint4* ex = exch + ((co & 1) * kGroupsPerBlock + gl) * kExchUint4 + lane;
      float o[8][4] = {};
      if constexpr (kWgmma) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        // o = h^T Q^T (eight m64n64k16, B = Q K-major), scaled by qf per token, then o += v_new^T P^T (four
        // m64n64k16, B = P K-major: P[i][j] at row i; its zeros above the diagonal written by the WY kernel).
        // (ha and va live one after the other: the registers of this warp's unused acc stay allocated here.)
        uint32_t ha[D / 16][4];
#pragma unroll
        for (int s = 0; s < D / 16; ++s) {
          const uint4 av = ex[s * 32];
          ha[s][0] = av.x, ha[s][1] = av.y, ha[s][2] = av.z, ha[s][3] = av.w;
        }
        const uint32_t q_addr = smem_addr(st.Q), p_addr = smem_addr(st.P);
        rs_times_tile_t(o, ha, q_addr);
        scale_tokens(o, st.qf, cc);  // (h^T Q^T) diag(qf)
        uint32_t va[C / 16][4];
#pragma unroll
        for (int s = 0; s < C / 16; ++s) {
          const uint4 av = ex[(8 + s) * 32];
          va[s][0] = av.x, va[s][1] = av.y, va[s][2] = av.z, va[s][3] = av.w;
        }
        sm90::wgmma_batch_rs(o, va, [&] {
#pragma unroll
          for (int s = 0; s < C / 16; ++s)
            sm90::wgmma_m64n64k16_rs(o, va[s], sm90::sw128_desc(p_addr + s * 32, 16, 1024));
        });
#else
        __trap();  // built for sm_90a only (gdn_wgmma.cu); the host checks the device
#endif
      } else {
#pragma unroll
        for (int s = 0; s < D / 16; ++s) {
          const uint4 av = ex[s * 32];
          const uint32_t a[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
          for (int jp = 0; jp < 4; ++jp) {
            uint32_t bb[4];
            load_b_nk(bb, st.Q, LD, 16 * s, 16 * jp, lane);
            mma_x2(o[2 * jp], o[2 * jp + 1], a, bb);
          }
        }
        scale_tokens(o, st.qf, cc);  // (h^T Q^T) diag(qf)
#pragma unroll
        for (int s = 0; s < C / 16; ++s) {
          const uint4 av = ex[(8 + s) * 32];
          const uint32_t a[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
          for (int jp = 0; jp < 4; ++jp) {
            if (jp >= s) {  // P is lower triangular
              uint32_t bb[4];
              load_b_nk(bb, st.P, LDP, 16 * s, 16 * jp, lane);
              mma_x2(o[2 * jp], o[2 * jp + 1], a, bb);
            }
          }
        }
      }
      unsigned char* out_stage = smem + ring_a_bytes<kWgmma>() + ring_b_bytes<kWgmma>() + kExchBytes;
      bf16* sOut = reinterpret_cast<bf16*>(out_stage) + gl * C * kOutLd;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int t = 8 * j + cc;
        sOut[t * kOutLd + gi] = __float2bfloat16_rn(o[j][0]);
        sOut[(t + 1) * kOutLd + gi] = __float2bfloat16_rn(o[j][1]);
        sOut[t * kOutLd + gi + 8] = __float2bfloat16_rn(o[j][2]);
        sOut[(t + 1) * kOutLd + gi + 8] = __float2bfloat16_rn(o[j][3]);
      }
      __syncwarp();
      const int t0 = chunk_t0(co), len = chunk_len(co);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int pidx = lane + 32 * i, t = pidx >> 1, half = pidx & 1;
        if (t < len)
          *reinterpret_cast<uint4*>(p.out + (size_t(t0 + t) * p.Hv + h) * D + col0 + 8 * half) =
              *reinterpret_cast<const uint4*>(sOut + t * kOutLd + 8 * half);
      }
      __syncwarp();
    }
  }
  cp_async_wait<0>();
  mark(4);
  if (prof && lane == 0) {  // (GdnPrefillArgs::scan_profile's slots)
    auto add = [&](int slot, long long v) {
      atomicAdd(reinterpret_cast<unsigned long long*>(profile + slot), static_cast<unsigned long long>(v));
    };
    for (int i = 0; i < 5; ++i) add(6 * warp + i, pt[i]);
    add(6 * warp + 5, steps);
    if (warp == 0) {
      add(72, steps);
      add(73, clock_now() - t_first);
      add(74, 1);
    }
  }

  if (rec_active) {
    float* dst = role == kRecS ? j_final : j_trans;
    if (dst) {
      dst += head_off;
#pragma unroll
      for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = 8 * n + cc + (e & 1), col = col0 + gi + (e >= 2 ? 8 : 0);
          dst[size_t(d) * D + col] = acc[n][e];
        }
    }
  }
}

template <bool kWgmma, bool kProf = false, bool kL2Prefetch = true>
__global__ void __launch_bounds__(kScanMaxThreads, 1) gdn_scan_kernel(ScanParams p, long long* profile = nullptr) {
  gdn_scan_body<kWgmma, kProf, kL2Prefetch, false>(p, nullptr, profile);
}

// The wgmma scan with its W, K, Q, P tiles staged by TMA (kTma above; sm_90a only, gdn_wgmma.cu), kAll: and U^T and the
// scalars (kAll above): `maps` as ScanMaps describes, kScanSmemWgTma bytes of dynamic shared memory.
template <bool kProf, bool kAll>
__global__ void __launch_bounds__(kScanMaxThreads, 1)
    gdn_scan_tma_kernel(ScanParams p, const __grid_constant__ ScanMaps maps, long long* profile) {
  gdn_scan_body<true, kProf, false, true, kAll>(p, &maps, profile);
}

/// How launch_scan_wgmma stages the chunk scan's tiles.
struct ScanStaging {
  bool l2_prefetch = true;  // the cp.async staging's kL2Prefetch (false: HYPIC_GDN_SCAN_NO_L2_PREFETCH)
  bool tma = false;         // W, K, Q, P by TMA (gdn_scan_tma_kernel, HYPIC_GDN_SCAN_TMA) where the maps can be made
  bool tma_all = false;     // with tma: U^T, kf, G, qf too (HYPIC_GDN_SCAN_TMA_ALL, default)
  int total_tokens = 0;     // tokens T of the raw inputs q, k ([T][H_k][128] bf16): the K / Q maps' extent
  size_t ws_slots = 0;      // the workspace's (chunk, value head) capacity: the W / P maps' extent
};

/// Launches the wgmma chunk scan (gdn_scan_kernel<true>, or gdn_scan_tma_kernel with staging.tma; with `profile`,
/// GdnPrefillArgs::scan_profile, their clock-reading instantiations) on `grid` x `threads` with kScanSmemWg
/// (kScanSmemWgTma) bytes of dynamic shared memory, the attribute set once per device. The TMA kernel's tensor maps
/// (ScanMaps) are encoded here, on the host, per launch; where the driver has no encoder or refuses one, the cp.async
/// staging runs instead. Returns whether the TMA staging ran. Defined in gdn_wgmma.cu, built for sm_90a only
/// (HYPIC_GDN_WGMMA_BUILT): call it on compute capability 9.0 devices only. Throws std::runtime_error on a CUDA
/// error.
bool launch_scan_wgmma(dim3 grid, int threads, const ScanParams& p, long long* profile, const ScanStaging& staging,
                       cudaStream_t stream);

}  // namespace hypic::kernels::cuda::detail::gdn
