// Internals shared by the MoE sources (moe.cu: routing, mma.sync grouped GEMMs, combine and the entry points;
// moe_decode.cu: the decode path's weight-streaming GEMMs; moe_wgmma.cu: the Hopper wgmma prefill GEMMs).
// Not part of the library's interface: see moe.h for the contract.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/pdl.cuh"

namespace hypic::kernels::cuda::moe_detail {

constexpr int kSmallT = 64;  // largest T of the single-block routing (and of Own's decode path)
constexpr int kDecBM = 32;   // rows (tokens) per tile of the decode GEMMs

// SwiGLU's silu in fp32 (HF: x * sigmoid(x)); every MoE kernel uses this one formula.
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Programmatic dependent launch (griddep_wait, launch_pdl, ...): kernels/cuda/pdl.cuh.
using detail::griddep_launch_dependents;
using detail::griddep_wait;
using detail::launch_pdl;

// Upper bound of the m-tile count of a schedule with bm-row tiles over P rows and E experts
// (each expert's last tile may be partial).
inline size_t max_tiles(size_t P, int E, int bm) { return P / bm + std::min<size_t>(size_t(E), P); }

// Where the wgmma tail list starts in the tiles buffer (offsets_kernel tail_at): past the 128-row schedule's bound.
// It holds at most min(E, P) entries (one per expert).
inline size_t tail_tiles_at(size_t P, int E) { return max_tiles(P, E, 128); }

// Tiles of the decode schedule: routed kDecBM-row tiles, then the shared expert's over T rows.
inline size_t decode_grid_tiles(size_t P, int E, int T, bool shared) {
  return max_tiles(P, E, kDecBM) + (shared ? size_t((T + kDecBM - 1) / kDecBM) : 0);
}

// Arguments of the prefill grouped GEMMs (mma.sync grouped_gemm_kernel in moe.cu, the wgmma kernels of
// moe_wgmma.cu): one launch covers every expert; m-tile i of the schedule is rows tiles[i].y .. + BM - 1 of
// expert tiles[i].x, i.e. rows offsets[e] + those of the expert-sorted order (P rows in all).
struct GroupedArgs {
  const bf16* A;           // gate_up: x [T][K] (rows gathered through a_rows); down: act [P][K]
  const int* a_rows;       // gate_up: sorted_tok [P]; down: unused (identity)
  const bf16* B;           // [E][.][K]: gate_up [E][2N][K], down [E][N][K]
  size_t b_expert_stride;  // elements per expert of B
  bf16* out;               // gate_up: act [P][N]; down: y [P][N]
  int K, N;                // gate_up: K = H, N = I; down: K = I, N = H
  const int2* tiles;
  const int* num_tiles;
  const int* offsets;      // [E + 1]
};

// The two prefill GEMMs' arguments over the routed rows of ws (sorted_tok, tiles, num_tiles, offsets filled by the
// routing): gate_up reads x [T][H] through sorted_tok and writes act [P][I]; down reads act and writes y [P][H].
inline GroupedArgs gate_up_args(const MoeWeightsView& w, const bf16* x, const MoeWorkspace& ws) {
  GroupedArgs g{};
  g.A = x;
  g.a_rows = static_cast<const int*>(ws.sorted_tok.p);
  g.B = w.experts_gate_up;
  g.b_expert_stride = size_t(2) * w.I * w.H;
  g.out = static_cast<bf16*>(ws.act.p);
  g.K = w.H;
  g.N = w.I;
  g.tiles = static_cast<const int2*>(ws.tiles.p);
  g.num_tiles = static_cast<const int*>(ws.num_tiles.p);
  g.offsets = static_cast<const int*>(ws.offsets.p);
  return g;
}
inline GroupedArgs down_args(const MoeWeightsView& w, const MoeWorkspace& ws) {
  GroupedArgs g = gate_up_args(w, nullptr, ws);
  g.A = static_cast<const bf16*>(ws.act.p);
  g.a_rows = nullptr;
  g.B = w.experts_down;
  g.b_expert_stride = size_t(w.H) * w.I;
  g.out = static_cast<bf16*>(ws.y.p);
  g.K = w.I;
  g.N = w.H;
  return g;
}

// ---------------------------------------------------------------------------------------------
// Decode path (moe_decode.cu)
// ---------------------------------------------------------------------------------------------

// Routed + shared experts through the decode GEMMs (the schedule has kDecBM-row tiles and, with
// Is > 0, the shared expert's tiles). tile_info: the schedule as (expert, first row, expert's offset, expert's rows)
// per tile (HYPIC_MOE_DECODE_TILE_INFO: one lookup per block instead of the tile, then the expert's offsets), or
// null (tiles, offsets).
void launch_decode(const MoeWeightsView& w, int T, size_t P, const bf16* x, MoeWorkspace& ws, const int4* tile_info,
                   cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Hopper wgmma prefill GEMMs (moe_wgmma.cu, built for sm_90a only: HYPIC_MOE_WGMMA_BUILT)
// ---------------------------------------------------------------------------------------------

constexpr int kWgmmaBM = 128;  // rows per m-tile of the wgmma kernels (the schedule's bm)
// Below this many routed rows per expert on average, OwnWgmma schedules 64-row m-tiles (wgmma_bm): well under 64, so
// that few experts need two m-tiles (each of which streams the expert's weights). Measured at 5.75 (a splice).
constexpr int kWgmmaSmallRowsPerExpert = 32;
// From this many routed rows per expert on average (8192 tokens at top-8 of 256 experts), the default variant runs
// the persistent blocks of variant 3 under the candidate switch HYPIC_MOE_PERSISTENT_LONG (moe.cu wgmma_variant):
// H200, 2026-12-05 (bench/results/moe_variants_h200.md), variant 3 against 1 per layer: 4096 tokens 1.05x (slower),
// 16384 0.95x, 32768 0.98x; 8192 not measured alone. The same tiles in the same k order: the same bits.
constexpr int kWgmmaPersistentRowsPerExpert = 256;
// Below this many routed rows per expert on average (16384 tokens at top-8 of 256 experts), variant 1's 128-row tiles
// run on the warp-specialised blocks (variant 6) under the measured default HYPIC_MOE_WARP_SPECIALIZED (moe.cu
// wgmma_variant). H100, 2026-12-05 (bench/results/moe_warp_specialized.md), whole model side by side: 4096 / 8192
// tokens 0.983x / 0.986x, 16384 0.999x, 32768 1.005x (one MoE layer: 0.97-0.98x at
// 1k-4k, 1.00-1.02x at 16k, 1.02x at 32k).
constexpr int kWgmmaWsMaxRowsPerExpert = 512;
// From kWgmmaWsMaxRowsPerExpert routed rows per expert on, the measured default HYPIC_MOE_WS_GATE_UP_LONG runs the
// gate_up GEMM alone on the warp-specialised blocks (variant 8, moe.cu wgmma_variant): H100, 2026-12-06, one layer at
// 32768 tokens under Nsight Compute (one launch each, locked clocks): gate_up 2.07 ms on them against 2.16 ms one
// block per tile (tensor pipes 72% / 69% active), down 1.38 against 1.28 ms (53% / 58%: its 8 k-steps per tile leave
// the warp-specialised blocks' exposed epilogue, the shuffles of store_tile_quad, a larger share than the prologue
// they hide); whole model side by side (bench/results/moe_ws_small.md): 16384 tokens 0.981x, 32768 0.993x.
// Below kWgmmaSmallRowsPerExpert (the 64-row tiles), the measured default HYPIC_MOE_WS_SMALL runs both GEMMs on the
// warp-specialised blocks (variant 9): H100, 2026-12-06, whole model side by side: 512-token prefill 0.973x, warm
// 16 x 2k splice 0.981x (every run faster).

// The swap-AB kernels (moe_swap_ws_kernel, the candidate HYPIC_MOE_SWAP_AB): the schedule's m-tile rows when they run
// (an m-tile is at most this many of an expert's tokens, the wgmma N side of its tiles, in steps of 16; equal to
// kWgmmaBM, so the choice travels as its own flag, not as bm), and the routed rows per expert on average below which
// OwnWgmma takes them (own_wgmma_swap in moe.cu).
constexpr int kSwapBM = 128;
constexpr int kSwapMaxRowsPerExpert = 512;

// True when the current device can run the wgmma kernels: compute capability 9.0 (the sm_90a build). Host only.
bool wgmma_device();

// The HYPIC_MOE_WGMMA environment variable, read once: 0 = off (Own keeps the mma.sync tiles); the variants (for
// comparisons) 1 = default (unset or anything else): one block per tile, 128 x 256 tiles for both GEMMs, or for
// OwnWgmma with fewer than kWgmmaSmallRowsPerExpert rows per expert 64 x 256 tiles (wgmma_bm); 2 = the down GEMM on
// 128 x 128 tiles (2 blocks per SM); 3 = persistent blocks (one per SM) walking the tiles with the copies running
// ahead across tile boundaries; 4 = 3 with the down GEMM on persistent 128 x 128 tiles (2 per SM); 5 = 1 without the
// 64-row tiles; 6 = persistent warp-specialised blocks (one per SM: a copying warpgroup and two wgmma warpgroups
// synchronised by mbarriers, moe_wgmma_ws_kernel); 7 = 6 in clusters of two blocks on m-tile pairs, the weights of a
// pair of one expert multicast to both (moe_wgmma_ws_kernel's PAIR); 8 = gate_up as 6, down as 1 (one block per
// tile); 9 = 1 with its 64-row tiles on the warp-specialised blocks (what variant 1 runs under the measured default
// HYPIC_MOE_WS_SMALL).
int wgmma_env_mode();

// Launches of moe_wgmma_persistent_kernel issued in this process (moe_persistent_launches). Host only.
uint64_t persistent_launches();

// Launches of moe_wgmma_ws_kernel issued in this process (moe_warp_specialized_launches). Host only.
uint64_t ws_launches();

// Launches of moe_wgmma_ws_kernel in clusters of two (variant 7) issued in this process (moe_cluster_pair_launches).
// Host only.
uint64_t pair_launches();

// Launches of moe_swap_ws_kernel issued in this process (moe_swap_ab_launches). Host only.
uint64_t swap_launches();
// Those of the gate_up launches among them that loaded the weights by the one-box 5-D map (HYPIC_MOE_SWAP_5D). Host only.
uint64_t swap_5d_launches();

// Whether the swap-AB kernels can take w's expert weights: 16-byte aligned, K (H and I) multiples of 8, and the
// driver encodes both GEMMs' tensor maps (gate_up [E][2I][H] in 64 x 8 boxes, down [E][H][I] in 64 x 256), and the
// kernels were given enough registers for their setmaxnreg split. Host only.
bool swap_ab_supported(const MoeWeightsView& w);

// The m-tile rows (the routing schedule's bm) of OwnWgmma's kernels for P routed rows over E experts under
// `variant` (wgmma_env_mode): 64 for variants 1 and 9 below kWgmmaSmallRowsPerExpert rows per expert on average (a
// splice's seams and query: tiles mostly empty, the GEMMs stream weights), else kWgmmaBM.
int wgmma_bm(size_t P, int E, int variant);

// Whether the wgmma kernels take a layer of these sizes with P routed rows: K (H and I) a multiple of 8, N (I and H)
// even, and the grid (m-tile bound x n-tiles) within 2^31 - 1 blocks. True at every size moe_forward accepts except
// grids that large (counted with 64-row m-tiles, which bound the 128-row count); moe.cu runs the mma.sync kernel
// otherwise. Host only.
bool wgmma_supported(const MoeWeightsView& w, size_t P);

// Both prefill GEMMs of moe_forward on wgmma over the bm-row schedule already in ws (tiles, num_tiles, offsets,
// sorted_tok; bm 64 or kWgmmaBM; swap: the swap-AB kernels over a kSwapBM-row schedule without tail tiles, whatever
// the variant, std::logic_error otherwise, std::runtime_error if the driver then makes no tensor map of the weights,
// which swap_ab_supported checks first): gate_up + SwiGLU -> ws.act [P][I] bf16, then down -> ws.y [P][H] bf16; same
// buffers, roundings and masking as launch_grouped's mma.sync kernels (a row's result does not depend on bm: the
// k order of its products is the same). variant: 1 .. 9 as wgmma_env_mode (bm 64 runs the 64 x 256 tiles one block
// per tile, on the warp-specialised blocks for variant 9, whatever the other variants). tail64 (bm = kWgmmaBM only): the schedule also has the tail list (offsets_kernel tail_at: experts'
// last tiles of 1 .. 64 rows at tiles + tail_tiles_at(P, E), their count in num_tiles[1]), run by the 64 x 256
// kernels after each GEMM's 128-row tiles. Throws std::invalid_argument when the grid does not fit (see wgmma_supported) or on a bad bm,
// std::runtime_error on CUDA errors. Requires wgmma_device().
void launch_wgmma(const MoeWeightsView& w, size_t P, const bf16* x, MoeWorkspace& ws, int variant, int bm,
                  bool tail64, bool swap, cudaStream_t stream);

}  // namespace hypic::kernels::cuda::moe_detail
