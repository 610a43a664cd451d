// Decode path of moe_forward (GroupedGemm::OwnDecode; Own for T <= 64; see moe.h): the two grouped expert GEMMs
// (routed and shared experts in the same launches) as weight-streaming kernels on the core of
// kernels/cuda/stream_gemm.cuh, launched with programmatic dependent launch. The router GEMM is a decode_linear
// (decode_linear.h); routing (route_small_kernel) and combine stay in moe.cu.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/stream_gemm.cuh"
#include "kernels/cuda/switches.h"

namespace hypic::kernels::cuda::moe_detail {

namespace {

using detail::kStreamChunk;
using detail::kStreamThreads;
using detail::kStreamWarps;

// ---------------------------------------------------------------------------------------------
// Decode grouped GEMM (weight streaming)
// ---------------------------------------------------------------------------------------------
//
// For a few rows per expert the GEMMs are weight-bandwidth bound: each block streams 16-row groups of one expert's
// weights once (stream_gemm.cuh: per-warp cp.async rings, the expert's tokens as the mma N dimension, at most kDecBM
// = 32 per tile in NT groups of 8). A block's 8 warps are row groups x K slices (stream_k_slices_for: e.g. at batch 1
// 4 slices of H = 2048 for gate_up, which puts its 9 x 32 blocks in one wave, 2 slices of I = 512 and 4 row groups
// for down); the slices' partial sums are
// added in ascending order (bit-identical from run to run; no atomics). A gate_up row group is the 8 gate rows
// j0..j0+7 (A rows 0..7) and the 8 up rows I + j0.. (A rows 8..15), so the accumulator of lane (g, q) holds gate and
// up of column j0 + g for tokens 2q, 2q + 1 and SwiGLU runs in the epilogue; a down row group is 16 output columns.
//
// Grid: x = tile (an upper bound is launched; blocks past num_tiles exit), y = column block. Tile expert index E is
// the shared expert (rows = tokens 0..T-1, its own weights, sizes and outputs: gate_up -> s_act [T][Is] bf16, down
// -> s_out [T][H] fp32 unrounded, as the cuBLASLt shared path), so one launch covers routed and shared experts.

struct DecodeArgs {
  const bf16* A;           // gate_up: x [T][K] gathered through a_rows; down: act [P][K]
  const int* a_rows;       // gate_up: sorted_tok [P]; down: nullptr (identity)
  const bf16* B;           // gate_up: [E][2N][K]; down: [E][N][K]
  size_t b_expert_stride;  // elements per expert of B
  bf16* out;               // gate_up: act [P][N]; down: y [P][N]
  int K, N;
  const bf16* sA;  // shared expert: gate_up: x [T][sK]; down: s_act [T][sK]
  const bf16* sB;  // gate_up: [2 sN][sK]; down: [sN][sK]
  void* sout;      // gate_up: s_act [T][sN] bf16; down: s_out [T][sN] fp32
  int sK, sN;
  int ks, sks;  // K slices per row group (stream_k_slices_for): routed experts, shared expert
  int deep;     // NT >= 2: a tile with one token group streams W-only stages over the whole ring (decode_gemm_kernel)
  int early;    // down: the schedule read and the weight copies issued before griddep_wait (HYPIC_MOE_DOWN_EARLY)
  int shared_fixed;  // HYPIC_MOE_SHARED_EARLY: the shared expert's ceil(T / kDecBM) tiles on the grid's last blocks
                     // (their weight copies before griddep_wait), the schedule's shared tiles skipped; 0: off
  int E, T;
  const int2* tiles;
  const int* num_tiles;
  const int* offsets;      // [E + 1]
  const int4* tile_info;   // null, or per tile (expert, first row, expert's offset, expert's rows): replaces tiles and
                           // offsets (shared tiles: (E, first row, 0, T))
};

enum DecodeMode { kDecDown = 0, kDecGateUp = 1 };

// Output columns per block of a decode GEMM with ks K slices per row group (a gate_up row group yields 8 act
// columns, a down one 16).
__host__ __device__ constexpr int decode_block_cols(int mode, int ks) {
  return (kStreamWarps / ks) * (mode == kDecGateUp ? 8 : 16);
}

// NT: token groups of 8 per tile, at least the tile's rows (min(T, kDecBM): an expert gets each token at most once).
// Ring depth: 8 stages for one token group (64 KiB blocks, 3 per SM), 4 for more (x staged in the ring too).
template <int NT>
constexpr int decode_stages() {
  return NT == 1 ? 8 : 4;
}

// XD: x loads ahead on the one-token-group paths (stream_consume; HYPIC_STREAM_X_AHEAD), 0 for none.
template <int MODE, int NT, int XD = 0>
__global__ void __launch_bounds__(kStreamThreads, detail::stream_blocks_per_sm(decode_stages<NT>(), NT))
    decode_gemm_kernel(DecodeArgs a) {
  extern __shared__ uint4 ring_all[];
  constexpr int S = decode_stages<NT>();
  constexpr int kRing = S * detail::stream_stage_uint4(NT);
  constexpr bool GATE_UP = MODE == kDecGateUp;
  constexpr int COLS = GATE_UP ? 8 : 16;  // output columns per row group
  static_assert(NT * 8 <= kDecBM, "tile rows");
  // The tile schedule comes from the routing kernel. gate_up waits for it (its predecessor). The down GEMM's
  // predecessor is gate_up, which this launch follows only once every gate_up block has passed its own wait for the
  // routing kernel, so with a.early the down blocks read the schedule and issue their weight copies before their wait
  // (the weights are never written during a step): they stream while gate_up finishes; the act rows it writes are
  // read only after the wait below.
  // With a.shared_fixed the shared expert's tiles are the grid's last blocks, known without the schedule, so they issue
  // their weight copies before the wait too (gate_up: while the routing kernel runs); the schedule's own shared tiles
  // return.
  const int fixed0 = int(gridDim.x) - a.shared_fixed;
  const bool fixed_sh = a.shared_fixed > 0 && int(blockIdx.x) >= fixed0;
  const bool early = (MODE == kDecDown && a.early) || fixed_sh;
  if (!early) {
    griddep_wait();
    griddep_launch_dependents();
  }
  int e, m0;
  int4 info = make_int4(0, 0, 0, 0);
  if (fixed_sh) {
    e = a.E, m0 = (int(blockIdx.x) - fixed0) * kDecBM;
  } else if (a.tile_info) {
    // Both loads in flight at once (the buffer holds the launched grid's tiles; past num_tiles stale, unused).
    const int n_tiles = __ldcg(a.num_tiles);
    info = __ldcg(a.tile_info + blockIdx.x);
    if (int(blockIdx.x) >= n_tiles) return;
    e = info.x, m0 = info.y;
  } else {
    if (int(blockIdx.x) >= __ldcg(a.num_tiles)) return;
    const int2 tile = __ldcg(a.tiles + blockIdx.x);
    e = tile.x, m0 = tile.y;
  }
  if (a.shared_fixed > 0 && !fixed_sh && e >= a.E) return;  // (done by the fixed blocks)
  const bool sh = e >= a.E;
  const int K = sh ? a.sK : a.K, N = sh ? a.sN : a.N;
  const bf16* W = sh ? a.sB : a.B + size_t(e) * a.b_expert_stride;
  const int kt = K / kStreamChunk, ks_count = sh ? a.sks : a.ks;
  const int col_block = blockIdx.y * decode_block_cols(MODE, ks_count);
  if (col_block >= N) return;  // block-uniform (the grid covers the larger of routed / shared column blocks)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int rg = warp / ks_count, ks = warp % ks_count;
  const int c0 = col_block + rg * COLS;
  const bool active = c0 < N;  // N is a multiple of 32 >= COLS: a row group is all in or all out
  const int r_lo = active ? c0 + g : 0;
  const int r_hi = !active ? 0 : GATE_UP ? N + c0 + g : c0 + 8 + g;
  const bf16* wlo = W + size_t(r_lo) * K + q * 8;
  const bf16* whi = W + size_t(r_hi) * K + q * 8;
  const int kb = (ks * kt) / ks_count, ke = ((ks + 1) * kt) / ks_count;
  uint4* ring = ring_all + warp * kRing;
  // The weight copies go out as soon as the expert is known; the token rows' lookups overlap them.
  if (active) detail::stream_prologue<NT, S>(wlo, whi, kb, ke, ring, lane);
  if (early) {
    griddep_wait();  // act: gate_up's output; x (gate_up's shared tiles) and s_act
    griddep_launch_dependents();
  }

  const int seg = sh ? 0 : a.tile_info ? info.z : __ldcg(a.offsets + e);
  const int cnt = sh ? a.T : a.tile_info ? info.w : __ldcg(a.offsets + e + 1) - seg;
  const bf16* A = sh ? a.sA : a.A;
  const int nrows = min(kDecBM, cnt - m0);  // >= 1
  const int ntl = (nrows + 7) >> 3;         // token groups with at least one row, 1..NT
  const bf16* xp[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = m0 + t * 8 + g;
    const int mm = m < cnt ? m : m0;  // rows past the count: a valid row, never stored
    const int src = sh ? mm : (GATE_UP ? __ldcg(a.a_rows + seg + mm) : seg + mm);
    xp[t] = A + size_t(src) * K + q * 8;
  }

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  // A tile whose rows fit one token group (most tiles at batch 9..64: 8 x 64 routed rows over 256 experts) leaves
  // the ring's x region unused: with a.deep its weights stream through S1 W-only stages over the whole ring (12 at
  // NT = 4 instead of 4: three times the weight bytes in flight), x read through L1 as at NT = 1. The same products in
  // the same order: the same bits.
  constexpr int S1 = NT >= 2 ? kRing / detail::kStreamWStage : S;
  if (active && NT >= 2 && a.deep && ntl == 1) {
    detail::stream_prologue_extend<S, S1>(wlo, whi, kb, ke, ring, lane);
    const bf16* const xp1[1] = {xp[0]};
    float acc1[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    detail::stream_consume<1, S1, XD>(wlo, whi, kb, ke, xp1, 1, ring, lane, acc1);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[0][i] = acc1[0][i];
  } else if (active) {
    detail::stream_consume<NT, S, NT == 1 ? XD : 0>(wlo, whi, kb, ke, xp, ntl, ring, lane, acc);
  }
  if (!detail::stream_reduce<NT, kRing>(acc, ntl, ks_count, ring_all) || !active) return;

  // Epilogue: acc[t][h] = (A row g, token t*8 + 2q + h), acc[t][2 + h] = (A row g + 8, same token).
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= ntl) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + t * 8 + 2 * q + h;
      if (m >= cnt) continue;
      const size_t orow = size_t(sh ? m : seg + m) * N;
      if (GATE_UP) {
        const float gv = round_bf16(acc[t][h]), uv = round_bf16(acc[t][2 + h]);
        bf16* o = sh ? static_cast<bf16*>(a.sout) : a.out;
        o[orow + c0 + g] = __float2bfloat16(silu_f(gv) * uv);
      } else if (sh) {
        float* o = static_cast<float*>(a.sout);
        o[orow + c0 + g] = acc[t][h];
        o[orow + c0 + 8 + g] = acc[t][2 + h];
      } else {
        a.out[orow + c0 + g] = __float2bfloat16(acc[t][h]);
        a.out[orow + c0 + 8 + g] = __float2bfloat16(acc[t][2 + h]);
      }
    }
  }
}

template <int MODE, int NT, int XD>
void launch_decode_gemm(dim3 grid, const DecodeArgs& g, cudaStream_t stream, const char* what) {
  auto kernel = decode_gemm_kernel<MODE, NT, XD>;
  constexpr int smem = detail::stream_smem_bytes(decode_stages<NT>(), NT);
  static DeviceOnce once;  // the attribute is per device
  once.run(current_device(), [&](int) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), what);
    return 0;
  });
  launch_pdl(kernel, grid, dim3(kStreamThreads), size_t(smem), stream, what, g);
}

template <int MODE>
void launch_decode_nt(int T, dim3 grid, const DecodeArgs& g, cudaStream_t stream, const char* what) {
  static CandidateSwitch x_ahead("HYPIC_STREAM_X_AHEAD");
  constexpr int kXAhead = detail::kStreamXAhead;
  const int rows = std::min(T, kDecBM);
  const bool xa = x_ahead.on();
  auto launch = [&](auto nt) {
    constexpr int NT = decltype(nt)::value;
    xa ? launch_decode_gemm<MODE, NT, kXAhead>(grid, g, stream, what)
       : launch_decode_gemm<MODE, NT, 0>(grid, g, stream, what);
  };
  if (rows <= 8)
    launch(std::integral_constant<int, 1>{});
  else if (rows <= 16)
    launch(std::integral_constant<int, 2>{});
  else
    launch(std::integral_constant<int, 4>{});
}

unsigned column_blocks(int mode, int ks, int N) {
  const int cols = decode_block_cols(mode, ks);
  return unsigned((N + cols - 1) / cols);
}

// K slices of one expert GEMM (K; N routed, Ns shared output columns): one wave of blocks for a single token's tiles
// (topk routed + the shared expert's, at one token's ring shape) when a choice allows it (stream_k_slices_for). The same at every T, so that a
// token's summation order, and with it its result, does not depend on the batch it is decoded in.
int decode_k_slices(int mode, int K, int N, int Ns, int topk, bool shared) {
  const int cols = mode == kDecGateUp ? 8 : 16;
  const long row_groups = long(topk) * ((N + cols - 1) / cols) + (shared ? (Ns + cols - 1) / cols : 0);
  return detail::stream_k_slices_for(K / kStreamChunk, row_groups,
                                     long(sm_count()) * detail::stream_blocks_per_sm(decode_stages<1>(), 1));
}

}  // namespace

// Routed + shared experts through the decode GEMMs (the schedule has kDecBM-row tiles and, with
// Is > 0, the shared expert's tiles).
void launch_decode(const MoeWeightsView& w, int T, size_t P, const bf16* x, MoeWorkspace& ws, const int4* tile_info,
                   cudaStream_t stream) {
  static CandidateSwitch deep("HYPIC_MOE_DECODE_DEEP");
  static CandidateSwitch shared_early("HYPIC_MOE_SHARED_EARLY");
  const bool shared = w.Is > 0;
  const int fixed = shared && shared_early.on() ? (T + kDecBM - 1) / kDecBM : 0;
  const unsigned grid_m = unsigned(decode_grid_tiles(P, w.E, T, shared)) + unsigned(fixed);
  DecodeArgs g1{};
  g1.A = x;
  g1.a_rows = static_cast<const int*>(ws.sorted_tok.p);
  g1.B = w.experts_gate_up;
  g1.b_expert_stride = size_t(2) * w.I * w.H;
  g1.out = static_cast<bf16*>(ws.act.p);
  g1.K = w.H;
  g1.N = w.I;
  g1.sA = x;
  g1.sB = shared ? w.shared_gate_up : nullptr;
  g1.sout = shared ? ws.s_act.p : nullptr;
  g1.sK = w.H;
  g1.sN = shared ? w.Is : 0;
  g1.deep = deep.on() ? 1 : 0;
  g1.shared_fixed = fixed;
  g1.E = w.E;
  g1.T = T;
  g1.tiles = static_cast<const int2*>(ws.tiles.p);
  g1.num_tiles = static_cast<const int*>(ws.num_tiles.p);
  g1.offsets = static_cast<const int*>(ws.offsets.p);
  g1.tile_info = tile_info;
  g1.ks = decode_k_slices(kDecGateUp, w.H, w.I, w.Is, w.topk, shared);
  g1.sks = g1.ks;  // same K (H)
  unsigned cb1 = column_blocks(kDecGateUp, g1.ks, w.I);
  if (shared) cb1 = std::max(cb1, column_blocks(kDecGateUp, g1.sks, w.Is));
  launch_decode_nt<kDecGateUp>(T, dim3(grid_m, cb1), g1, stream, "moe_forward: decode gate_up GEMM launch");
  DecodeArgs g2 = g1;
  g2.A = static_cast<const bf16*>(ws.act.p);
  g2.a_rows = nullptr;
  g2.B = w.experts_down;
  g2.b_expert_stride = size_t(w.H) * w.I;
  g2.out = static_cast<bf16*>(ws.y.p);
  g2.K = w.I;
  g2.N = w.H;
  g2.sA = shared ? static_cast<const bf16*>(ws.s_act.p) : nullptr;
  g2.sB = shared ? w.shared_down : nullptr;
  g2.sout = shared ? ws.s_out.p : nullptr;
  g2.sK = shared ? w.Is : 0;
  g2.sN = w.H;
  static CandidateSwitch down_early("HYPIC_MOE_DOWN_EARLY");
  g2.early = down_early.on() ? 1 : 0;
  g2.ks = decode_k_slices(kDecDown, w.I, w.H, w.H, w.topk, shared);
  g2.sks = shared ? decode_k_slices(kDecDown, w.Is, w.H, w.H, w.topk, shared) : g2.ks;
  unsigned cb2 = column_blocks(kDecDown, g2.ks, w.H);
  if (shared) cb2 = std::max(cb2, column_blocks(kDecDown, g2.sks, w.H));
  launch_decode_nt<kDecDown>(T, dim3(grid_m, cb2), g2, stream, "moe_forward: decode down GEMM launch");
}

}  // namespace hypic::kernels::cuda::moe_detail
