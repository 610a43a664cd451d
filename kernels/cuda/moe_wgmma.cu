// The prefill grouped GEMMs of moe_forward (gate_up with the SwiGLU epilogue, and down) on Hopper's warpgroup
// tensor-core instructions (sm_90a: wgmma.mma_async with both operands in shared memory), driven by the same
// 128-row m-tile schedule, buffers and roundings as moe.cu's mma.sync grouped_gemm_kernel, so routing, gather
// and combine are unchanged and only the fp32 summation order inside the tensor-core products differs. With few
// rows per expert (OwnWgmma, wgmma_bm) the schedule has 64-row m-tiles and the 64 x 256 configuration runs.
//
// Block = 2 warpgroups (256 threads) on a 128 x BN output tile of one expert: warpgroup w computes rows
// 64 w .. 64 w + 63 as m64nBNk16 wgmmas, A (128 x 64 bf16 per k-step) and B (BN x 64) read from shared memory
// through descriptors. On a 64 x BN tile both warpgroups compute the 64 rows, warpgroup w over B rows
// w BN/2 .. (w + 1) BN/2 - 1 as m64n(BN/2)k16 wgmmas (WgCfg::WG_N columns each). Both operands are K-major
// (A = rows of x / act, B = rows of the weight [N][K], exactly the
// layout of S = Q K^T in attention_wgmma.cu) and stored 128-byte swizzled (PTX ISA, "Shared Memory Matrix
// Layout", K-major 128B swizzling): row r of a tile is 128 bytes at r * 128 with its 16-byte unit u stored at
// unit u ^ (r % 8); tiles start on 1024-byte boundaries; descriptor SBO = 1024 (8 rows), LBO unused (16), and the
// k16 steps inside the 64-wide k-step advance the start address by 32 bytes. The encodings are those of
// attention_wgmma.cu (run on the H200).
//
// Pipeline: STAGES shared-memory slots filled by cp.async (every thread copies 16-byte units of A and B); at
// k-step kt the block waits for slot kt, fences the async proxy and synchronises, issues the 4 wgmmas of kt
// asynchronously, then the copies of k-step kt + STAGES - 2 into the slot of k-step kt - 2 (free: every
// warpgroup waited for its wgmmas of kt - 2 before this barrier), and waits until at most one k-step (kt) of
// wgmmas is in flight. So the copies of STAGES - 2 k-steps are in flight while the tensor cores run, and the
// wgmmas of kt run while the block synchronises and issues k-step kt + 1.
//
// Rows past the expert's count and weight rows past N are not loaded (their shared-memory rows hold stale data
// that only reaches accumulator rows / columns that are never stored: rows and columns of a GEMM tile are
// independent); k beyond K (K % 64 != 0) is zero-filled in both operands (cp.async with src-size 0), so any K
// that is a multiple of 8 works.
//
// gate_up (GATE_UP): each warpgroup's WG_N B rows are WG_N/2 gate rows j followed by the matching up rows I + j
// (128-row tiles: the whole tile, j = n0 .. n0 + BN/2 - 1; 64-row tiles: warpgroup w's j = n0 + w BN/4 ..), so
// accumulator fragment f < NF/2 (columns 8 f .. 8 f + 7) holds gate and fragment f + NF/2 the up values of the same
// intermediate columns in the same thread: SwiGLU runs in registers, act[p][j] = bf16( silu(bf16(g)) * bf16(u) )
// (fp32 math, moe.h step 4), BN/2 act columns per block.
// down: y[p][n] = bf16(acc), BN columns per block.
//
// Grid: one block per (m-tile, n-tile), n-tile fastest (the blocks of one m-tile run together and share its A
// rows in L2; an expert's m-tiles follow each other and share its weights); an upper bound of the m-tile count
// is launched and blocks past num_tiles exit. Variants (HYPIC_MOE_WGMMA, moe_internal.cuh): the down GEMM on
// 128 x 128 tiles (2 blocks per SM), persistent blocks (moe_wgmma_persistent_kernel), and warp-specialised
// persistent blocks with TMA weight loads (moe_wgmma_ws_kernel; the default below 512 routed rows per expert).
//
// Shapes, layouts, memory: x [T][H], act [P][I], y [P][H] bf16 row-major in device memory; weights gate_up
// [E][2I][H] and down [E][H][I] bf16 row-major; fp32 accumulators in registers (m64n256: 128 per thread,
// m64n128: 64).
//
// Built for sm_90a only (kernels/cuda/CMakeLists.txt, HYPIC_MOE_WGMMA_BUILT); moe.cu calls it on compute
// capability 9.0 devices.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/switches.h"
#include "kernels/cuda/tensor_map.h"
#include "kernels/cuda/wgmma.cuh"
#include "kernels/cuda/wgmma_ss_n.cuh"

namespace hypic::kernels::cuda::moe_detail {

namespace {

using namespace sm90;
using detail::pack_bf16;
using detail::smem_addr;

// Tile configuration: BM rows, BN columns of B (weight rows), BK = 64 (one 128-byte swizzled row of bf16 per operand
// row), STAGES shared-memory slots, MINB blocks per SM (launch bounds). BM = 128: warpgroup w computes rows
// 64 w .. 64 w + 63 over all BN columns (m64nBNk16); BM = 64 (few rows per expert, as a splice's 184 tokens give:
// half the A bytes per slot buys a fifth slot, so more weight bytes are in flight): both warpgroups compute all
// 64 rows, warpgroup w over B rows w BN/2 .. (w + 1) BN/2 - 1 (m64n(BN/2)k16). NF: n8 accumulator fragments per
// thread.
template <int BN_, int STAGES_, int MINB_, int BM_ = kWgmmaBM>
struct WgCfg {
  static constexpr int BM = BM_, BN = BN_, BK = 64, STAGES = STAGES_, MINB = MINB_;
  static constexpr int THREADS = 256;
  static constexpr int WG_N = BM == 128 ? BN : BN / 2;        // B rows (output columns) per warpgroup
  static constexpr int NF = WG_N / 8;                         // n8 accumulator fragments per thread
  static constexpr int A_BYTES = BM * 128, B_BYTES = BN * 128;  // one k-step of A and of B
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int SMEM = STAGES * STAGE_BYTES + 1024;    // + slack for the 1024-byte alignment
  static constexpr int ROWS_PER_PASS = THREADS / 8;           // a pass copies 8 units (128 bytes) of 32 rows
  static constexpr int A_IT = BM / ROWS_PER_PASS, B_IT = BN / ROWS_PER_PASS;
  static_assert((BM == 128 || BM == 64) && (BN == 128 || BN == 256) && (NF == 16 || NF == 32), "tile shape");
  static_assert(STAGES >= 3, "the slot of k-step kt - 2 is refilled at kt");
  static_assert(SMEM * MINB <= 228 * 1024 && SMEM <= 227 * 1024, "shared memory per SM / block");
};
// gate_up: 128 x 256 (128 act columns), 4 stages: 193 KiB, 1 block per SM, 128 fp32 accumulators per thread.
using GateUpCfg = WgCfg<256, 4, 1>;
// down: 128 x 256, 4 stages (default) or 128 x 128, 3 stages: 97 KiB, 2 blocks per SM (HYPIC_MOE_WGMMA=2).
using DownCfg = WgCfg<256, 4, 1>;
using Down128Cfg = WgCfg<128, 3, 2>;
// Few rows per expert (wgmma_bm): 64 x 256 tiles, 5 stages (201 KiB), for both GEMMs.
using GateUpSmallCfg = WgCfg<256, 5, 1, 64>;
using DownSmallCfg = WgCfg<256, 5, 1, 64>;

// Vector epilogue (VEC, HYPIC_MOE_EPILOGUE_VEC): the weight row loaded into B row c of a warpgroup's block (c = 32 k + 8 j
// + 2 q + e: n8 fragment 4 k + j, lane q of the quad, element e) is output column vec_col_of_row(c) = 32 k + 8 q + 2 j
// + e of the block (j and q swapped), so lane q's fragments 4 k .. 4 k + 3 hold the 8 consecutive columns
// 32 k + 8 q .. + 7 of each of its two rows: one 16-byte store each (the m16n8 layout alone gives 4-byte stores that
// fill 16 of a sector's 32 bytes per warp instruction). Each column's dot product is the same; only which accumulator
// register holds it moves. gate_up applies it within the gate half and within the up half (each a multiple of 32).
__host__ __device__ constexpr int vec_col_of_row(int c) {
  return (c & ~31) | (((c >> 1) & 3) << 3) | (((c >> 3) & 3) << 1) | (c & 1);
}
constexpr bool vec_col_is_involution() {
  for (int c = 0; c < 256; ++c)
    if (vec_col_of_row(vec_col_of_row(c)) != c || vec_col_of_row(c) / 32 != c / 32) return false;
  return vec_col_of_row(2) == 8 && vec_col_of_row(8) == 2 && vec_col_of_row(31) == 31;
}
static_assert(vec_col_is_involution(), "vec_col_of_row: a permutation of each 32-column group");

// cp.async of 16 bytes into shared address dst; src_bytes = 0 writes zeros (src is not read).
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// d (64 x 256 fp32, accumulator layout) = (scale_d ? d : 0) + A (64 x 16 bf16, K-major in shared memory, descriptor
// da) * B (16 x 256, K-major in shared memory, descriptor db): wgmma.mma_async m64n256k16, bf16 in, fp32
// accumulate. Issued, not waited for.
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[32][4], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <int NF>
__device__ __forceinline__ void wgmma_k16(float (&d)[NF][4], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (NF == 32)
    wgmma_m64n256k16_ss(d, da, db, scale_d);
  else
    wgmma_m64nk16_ss<128>(d, da, db, scale_d);  // (kernels/cuda/wgmma_ss_n.cuh)
}

// One block tile: rows m0 .. m0 + BM - 1 of expert e (sorted rows seg + m for m < cnt), output columns n0 ..
struct TileInfo {
  int e, m0, seg, cnt, n0;
};

// The tile of schedule entry mt (an m-tile) and n-tile nt.
template <class C, bool GATE_UP>
__device__ __forceinline__ TileInfo tile_info(const GroupedArgs& a, int mt, int nt) {
  const int2 tile = a.tiles[mt];
  const int seg = a.offsets[tile.x];
  return TileInfo{tile.x, tile.y, seg, a.offsets[tile.x + 1] - seg, nt * (GATE_UP ? C::BN / 2 : C::BN)};
}

// The A rows this thread copies (tile rows r0 + 32 i, see load_stage): the row of A (gate_up: the token, through
// a_rows; down: the sorted position), -1 past the expert's count (not loaded, never stored).
template <class C, bool GATE_UP>
__device__ __forceinline__ void a_rows_of(const GroupedArgs& a, const TileInfo& t, int r0, int (&rows)[C::A_IT]) {
#pragma unroll
  for (int i = 0; i < C::A_IT; ++i) {
    const int m = t.m0 + r0 + i * C::ROWS_PER_PASS;
    rows[i] = m < t.cnt ? (GATE_UP ? a.a_rows[t.seg + m] : t.seg + m) : -1;
  }
}

// Global sources of this thread's copies for one tile: its 16-byte unit u (k = 8 u .. 8 u + 7 of each k-step) of
// A rows r0 + 32 i and B rows r0 + 32 i, at k-step 0; null where the row is not loaded. gate_up's B rows: per
// warpgroup block of WG_N rows, WG_N/2 gate rows then the matching up rows (see the top of the file).
template <class C>
struct TileSrc {
  const bf16* a[C::A_IT];
  const bf16* b[C::B_IT];
};
template <class C, bool GATE_UP, bool VEC>
__device__ __forceinline__ void tile_src(const GroupedArgs& a, const TileInfo& t, const int (&rows)[C::A_IT], int u,
                                         int r0, TileSrc<C>& s) {
  const int K = a.K, N = a.N;
#pragma unroll
  for (int i = 0; i < C::A_IT; ++i) s.a[i] = rows[i] >= 0 ? a.A + size_t(rows[i]) * K + u * 8 : nullptr;
  const bf16* Bexp = a.B + size_t(t.e) * a.b_expert_stride;
#pragma unroll
  for (int i = 0; i < C::B_IT; ++i) {
    const int r = r0 + i * C::ROWS_PER_PASS;
    int wrow;
    bool on;
    if (GATE_UP) {  // each warpgroup's B rows: its gate rows, then the matching up rows
      const int half = C::WG_N / 2, w = r / C::WG_N, rr = r % C::WG_N;
      const int j = t.n0 + w * half + (VEC ? vec_col_of_row(rr % half) : rr % half);
      on = j < N;
      wrow = rr < half ? j : N + j;
    } else {
      wrow = t.n0 + (VEC ? (r / C::WG_N) * C::WG_N + vec_col_of_row(r % C::WG_N) : r);
      on = wrow < N;
    }
    s.b[i] = on ? Bexp + size_t(wrow) * K + u * 8 : nullptr;  // weight rows past N: not loaded, never stored
  }
}

// Copies of k-step kt (k = 64 kt ..) into the slot whose shared address plus this thread's offset is st: thread
// (u = tid % 8, r0 = tid / 8) writes unit u of tile row r = r0 + 32 i at r * 128 + ((u ^ (r % 8)) << 4) (the
// 128-byte swizzle; r % 8 = r0 % 8 for every i), A rows first, then B rows at A_BYTES. k past K: zeros.
template <class C>
__device__ __forceinline__ void load_stage(const TileSrc<C>& s, uint32_t st, int kt, int K, int u) {
  const int k0 = kt * C::BK;
  const uint32_t bytes = k0 + u * 8 < K ? 16u : 0u;  // K is a multiple of 8
  const int ko = bytes ? k0 : 0;
#pragma unroll
  for (int i = 0; i < C::A_IT; ++i)
    if (s.a[i]) cp_async16_zfill(st + uint32_t(i * C::ROWS_PER_PASS * 128), s.a[i] + ko, bytes);
#pragma unroll
  for (int i = 0; i < C::B_IT; ++i)
    if (s.b[i]) cp_async16_zfill(st + uint32_t(C::A_BYTES + i * C::ROWS_PER_PASS * 128), s.b[i] + ko, bytes);
}

// The 4 k16 wgmmas of one k-step of the warpgroup (da, db: descriptors of its A rows and of B in the slot),
// committed as one group; accumulate = false starts the tile (acc's old values are ignored).
template <class C>
__device__ __forceinline__ void mma_kstep(float (&acc)[C::NF][4], uint64_t da, uint64_t db, bool accumulate) {
  wgmma_fence();
  wgmma_k16<C::NF>(acc, da, db, accumulate ? 1 : 0);
#pragma unroll
  for (int kk = 1; kk < C::BK / 16; ++kk) wgmma_k16<C::NF>(acc, da + kk * 2, db + kk * 2, 1);
  wgmma_commit();
}

// The packed bf16 pair that fragment f's row half h (accumulator elements 2 h, 2 h + 1) stores: gate_up act =
// bf16(silu(bf16(g)) * bf16(u)) with u in fragment f + NF / 2; down y = bf16(acc).
template <class C, bool GATE_UP>
__device__ __forceinline__ uint32_t out_pair(const float (&acc)[C::NF][4], int f, int h) {
  if (GATE_UP) {
    const float g0 = round_bf16(acc[f][2 * h]), g1 = round_bf16(acc[f][2 * h + 1]);
    const float u0 = round_bf16(acc[f + C::NF / 2][2 * h]), u1 = round_bf16(acc[f + C::NF / 2][2 * h + 1]);
    return pack_bf16(silu_f(g0) * u0, silu_f(g1) * u1);
  }
  return pack_bf16(acc[f][2 * h], acc[f][2 * h + 1]);
}

// Epilogue of warpgroup wg: fragment f of warp w (of the warpgroup), lane (g, q) holds rows 16 w + g
// (acc[f][0..1]) and + 8 (acc[f][2..3]), columns col0 + 8 f + 2 q, + 1 (the m16n8 accumulator layout per n8 block;
// col0 the warpgroup's first column on 64-row tiles, else 0).
// gate_up: act[p][j] = bf16(silu(bf16(g)) * bf16(u)) with g in fragment f < NF / 2 and u in f + NF / 2; down:
// y[p][n] = bf16(acc). Rows past the count and columns past N are not stored.
template <class C, bool GATE_UP, bool VEC>
__device__ __forceinline__ void store_tile(const GroupedArgs& a, const TileInfo& t, const float (&acc)[C::NF][4],
                                           int tid) {
  const int N = a.N;
  const int lane = tid & 31, g = lane >> 2, c2 = (lane & 3) * 2;
  const int wg = tid >> 7;
  const int row0 = t.m0 + (C::BM == 128 ? wg * 64 : 0) + ((tid >> 5) & 3) * 16 + g;
  const int col0 = C::BM == 128 ? 0 : wg * (GATE_UP ? C::WG_N / 2 : C::WG_N);  // this warpgroup's first column
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = row0 + h * 8;
    if (m >= t.cnt) continue;
    bf16* orow = a.out + size_t(t.seg + m) * N;
    if (VEC) {  // fragments 4 k .. 4 k + 3: columns 32 k + 8 q .. + 7 (vec_col_of_row); N % 8 == 0, out 16-byte aligned
      const int q8 = (lane & 3) * 8;
      constexpr int groups = (GATE_UP ? C::NF / 2 : C::NF) / 4;
#pragma unroll
      for (int k = 0; k < groups; ++k) {
        const int n = t.n0 + col0 + 32 * k + q8;
        if (n >= N) continue;
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          w[j] = out_pair<C, GATE_UP>(acc, 4 * k + j, h);
        }
        *reinterpret_cast<uint4*>(orow + n) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    } else if (GATE_UP) {
#pragma unroll
      for (int f = 0; f < C::NF / 2; ++f) {
        const int j = t.n0 + col0 + f * 8 + c2;
        if (j >= N) continue;
        const float g0 = round_bf16(acc[f][2 * h]), g1 = round_bf16(acc[f][2 * h + 1]);
        const float u0 = round_bf16(acc[f + C::NF / 2][2 * h]), u1 = round_bf16(acc[f + C::NF / 2][2 * h + 1]);
        *reinterpret_cast<uint32_t*>(orow + j) = pack_bf16(silu_f(g0) * u0, silu_f(g1) * u1);
      }
    } else {
#pragma unroll
      for (int f = 0; f < C::NF; ++f) {
        const int n = t.n0 + col0 + f * 8 + c2;
        if (n >= N) continue;
        *reinterpret_cast<uint32_t*>(orow + n) = pack_bf16(acc[f][2 * h], acc[f][2 * h + 1]);
      }
    }
  }
}

// store_tile of a tile loaded without the vector epilogue's row permutation (the warp-specialised kernel's TMA
// boxes), with its 16-byte stores: lane q of a quad holds the pairs of columns 32 k + 8 j + 2 q (fragment 4 k + j)
// and needs those of columns 32 k + 8 q + 2 j' (lane j''s fragment 4 k + q), a 4 x 4 transpose of packed pairs
// across the quad (three shuffles per 4 fragments and row). Same values as store_tile; N % 8 == 0 and out 16-byte
// aligned (use_vec_epilogue). Every lane runs the shuffles; only the stores are masked.
template <class C, bool GATE_UP>
__device__ __forceinline__ void store_tile_quad(const GroupedArgs& a, const TileInfo& t, const float (&acc)[C::NF][4],
                                                int tid) {
  const int N = a.N;
  const int lane = tid & 31, q = lane & 3, wg = tid >> 7;
  const int row0 = t.m0 + (C::BM == 128 ? wg * 64 : 0) + ((tid >> 5) & 3) * 16 + (lane >> 2);
  const int col0 = C::BM == 128 ? 0 : wg * (GATE_UP ? C::WG_N / 2 : C::WG_N);  // as store_tile
  constexpr int groups = (GATE_UP ? C::NF / 2 : C::NF) / 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = row0 + h * 8;
#pragma unroll
    for (int k = 0; k < groups; ++k) {
      uint32_t v[4], o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[j] = out_pair<C, GATE_UP>(acc, 4 * k + j, h);
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {  // round s: send my fragment q ^ s to lane q ^ s, which sends me its q ^ s
        const int j = q ^ s;
        const uint32_t send = j == 0 ? v[0] : j == 1 ? v[1] : j == 2 ? v[2] : v[3];
        const uint32_t got = s ? __shfl_xor_sync(0xffffffffu, send, s) : send;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
          if (jj == j) o[jj] = got;
      }
      const int n = t.n0 + col0 + 32 * k + 8 * q;
      if (m < t.cnt && n < N)
        *reinterpret_cast<uint4*>(a.out + size_t(t.seg + m) * N + n) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

// One block per (m-tile, n-tile): blockIdx.x = m-tile * n_tiles + n-tile (see the top of the file). a as for
// grouped_gemm_kernel (moe_internal.cuh: GroupedArgs); K a multiple of 8, N even.
template <class C, bool GATE_UP, bool VEC>
__global__ void __launch_bounds__(C::THREADS, C::MINB) moe_wgmma_kernel(const GroupedArgs a, int n_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int mt = int(blockIdx.x) / n_tiles;
  if (mt >= *a.num_tiles) return;
  const TileInfo t = tile_info<C, GATE_UP>(a, mt, int(blockIdx.x) % n_tiles);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t s_base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // slot s: A at s * STAGE_BYTES, then B
  const int tid = threadIdx.x, u = tid & 7, r0 = tid >> 3, wg = tid >> 7;
  const uint32_t dst = s_base + uint32_t(r0 * 128 + ((u ^ (r0 & 7)) << 4));
  TileSrc<C> src;
  {
    int rows[C::A_IT];
    a_rows_of<C, GATE_UP>(a, t, r0, rows);
    tile_src<C, GATE_UP, VEC>(a, t, rows, u, r0, src);
  }
  const int K = a.K, KT = (K + C::BK - 1) / C::BK;
#pragma unroll
  for (int s = 0; s < C::STAGES - 2; ++s) {
    if (s < KT) load_stage<C>(src, dst + uint32_t(s * C::STAGE_BYTES), s, K, u);
    cp_async_commit();
  }
  float acc[C::NF][4];
#pragma unroll
  for (int f = 0; f < C::NF; ++f) acc[f][0] = acc[f][1] = acc[f][2] = acc[f][3] = 0.f;
  // Warpgroup-uniform: a warpgroup whose 64 rows all lie past the count issues no wgmma (BM = 64: both share them).
  const bool wg_active = t.m0 + (C::BM == 128 ? wg * 64 : 0) < t.cnt;
  const uint64_t da0 = sw128_desc(s_base + uint32_t(C::BM == 128 ? wg * 64 * 128 : 0), 16, 1024);
  const uint64_t db0 = sw128_desc(s_base + uint32_t(C::A_BYTES + (C::BM == 128 ? 0 : wg * C::WG_N * 128)), 16, 1024);
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<C::STAGES - 3>();  // this thread's copies of k-step kt have landed ...
    fence_proxy_async();             // ... are made visible to the async proxy (wgmma) ...
    __syncthreads();                 // ... and everyone's; every warpgroup is done with k-step kt - 2
    if (wg_active) {                 // the wgmmas of k-step kt first: the tensor cores never wait for the copies
      const uint64_t so = uint64_t(((kt % C::STAGES) * C::STAGE_BYTES) >> 4);
      mma_kstep<C>(acc, da0 + so, db0 + so, true);
    }
    const int nk = kt + C::STAGES - 2;  // into the slot of k-step kt - 2
    if (nk < KT) load_stage<C>(src, dst + uint32_t((nk % C::STAGES) * C::STAGE_BYTES), nk, K, u);
    cp_async_commit();  // possibly empty: keeps the group count per iteration fixed
    wgmma_wait<1>();    // k-step kt - 1 done: its slot is refilled after the next barrier
    pin<C::NF>(acc);
  }
  wgmma_wait<0>();
  pin<C::NF>(acc);
  cp_async_wait<0>();  // only empty groups remain; nothing may be in flight when the block exits
  if (wg_active) store_tile<C, GATE_UP, VEC>(a, t, acc, tid);
#else
  (void)a;
  (void)n_tiles;
  __trap();  // built for sm_90a only; moe.cu checks the device (wgmma_device)
#endif
}

// Persistent variant (HYPIC_MOE_WGMMA=3 / 4): gridDim.x blocks (MINB per SM) walk the tiles t = blockIdx.x,
// + gridDim.x, .. (t = m-tile * n_tiles + n-tile as above) as ONE stream of k-steps: the copies run STAGES - 2
// k-steps ahead across tile boundaries, so the next tile's first k-steps load while the last ones of the current
// tile compute and while its epilogue stores. The loader spreads the next tile's schedule reads over the current
// tile's first k-steps (schedule entry, offsets, gate_up's token rows), so no load latency remains at the switch;
// the tile's (m0, seg, cnt, n0) reach the epilogue through a 4-entry shared ring written by thread 0 when the
// loader enters the tile (at least one barrier before the consumer reads it; the loader is < 4 tiles ahead).
template <class C, bool GATE_UP, bool VEC>
__global__ void __launch_bounds__(C::THREADS, C::MINB) moe_wgmma_persistent_kernel(const GroupedArgs a, int n_tiles) {
  static_assert(C::BM == 128, "the persistent variant runs 128-row tiles");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ int4 ring[4];
  const int total = *a.num_tiles * n_tiles, G = int(gridDim.x), b = int(blockIdx.x);
  if (b >= total) return;
  const int my_tiles = (total - 1 - b) / G + 1;
  const int K = a.K, KT = (K + C::BK - 1) / C::BK;
  const int iters = my_tiles * KT;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t s_base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const int tid = threadIdx.x, u = tid & 7, r0 = tid >> 3, wg = tid >> 7;
  const uint32_t dst = s_base + uint32_t(r0 * 128 + ((u ^ (r0 & 7)) << 4));

  // Loader: k-step l_kt of the block's tile l_seq (global tile b + l_seq G).
  TileInfo lt = tile_info<C, GATE_UP>(a, b / n_tiles, b % n_tiles);
  TileSrc<C> src;
  {
    int rows[C::A_IT];
    a_rows_of<C, GATE_UP>(a, lt, r0, rows);
    tile_src<C, GATE_UP, VEC>(a, lt, rows, u, r0, src);
  }
  TileInfo ct = lt;  // the consumer's (wgmma, epilogue) tile
  int l_seq = 0, l_kt = 0, nx_mt = 0, nx_nt = 0, nx_seg = 0, nx_cnt = 0;
  int2 nx_tile = make_int2(0, 0);
  int nx_rows[C::A_IT];
#pragma unroll
  for (int i = 0; i < C::A_IT; ++i) nx_rows[i] = -1;
  // Issues the copies of the loader's current k-step into slot `slot` and moves the loader on.
  auto load_next = [&](int slot) {
    load_stage<C>(src, dst + uint32_t(slot * C::STAGE_BYTES), l_kt, K, u);
    const bool more = l_seq + 1 < my_tiles;
    if (more) {  // the next tile's schedule reads, one dependent step per k-step (all at once when KT is small)
      if (l_kt == 0) {
        const int t = b + (l_seq + 1) * G;
        nx_mt = t / n_tiles, nx_nt = t % n_tiles;
        nx_tile = a.tiles[nx_mt];
      }
      if (l_kt == min(1, KT - 1)) {
        nx_seg = a.offsets[nx_tile.x];
        nx_cnt = a.offsets[nx_tile.x + 1] - nx_seg;
      }
      if (l_kt == min(2, KT - 1))
        a_rows_of<C, GATE_UP>(a, TileInfo{nx_tile.x, nx_tile.y, nx_seg, nx_cnt, 0}, r0, nx_rows);
    }
    if (++l_kt == KT) {
      l_kt = 0;
      ++l_seq;
      if (more) {
        lt = TileInfo{nx_tile.x, nx_tile.y, nx_seg, nx_cnt, nx_nt * (GATE_UP ? C::BN / 2 : C::BN)};
        tile_src<C, GATE_UP, VEC>(a, lt, nx_rows, u, r0, src);
        if (tid == 0) ring[l_seq & 3] = make_int4(lt.m0, lt.seg, lt.cnt, lt.n0);
      }
    }
  };
  int issued = 0;  // k-steps whose copies are issued
#pragma unroll
  for (int s = 0; s < C::STAGES - 2; ++s) {
    if (issued < iters) load_next(s), ++issued;
    cp_async_commit();
  }
  float acc[C::NF][4];
#pragma unroll
  for (int f = 0; f < C::NF; ++f) acc[f][0] = acc[f][1] = acc[f][2] = acc[f][3] = 0.f;
  bool wg_active = ct.m0 + wg * 64 < ct.cnt;
  const uint64_t da0 = sw128_desc(s_base + uint32_t(wg * 64 * 128), 16, 1024);
  const uint64_t db0 = sw128_desc(s_base + uint32_t(C::A_BYTES), 16, 1024);
  int c_seq = 0, c_kt = 0;
  // The accumulators are written by the wgmmas only (a tile starts with scale-d = 0) and read by the epilogue
  // after wait_group 0, so no register copy of them is live across an asynchronous wgmma.
#pragma unroll 1
  for (int it = 0; it < iters; ++it) {
    cp_async_wait<C::STAGES - 3>();
    fence_proxy_async();
    __syncthreads();  // k-step it landed everywhere; every warpgroup is done with k-step it - 2
    if (wg_active) {
      const uint64_t so = uint64_t(((it % C::STAGES) * C::STAGE_BYTES) >> 4);
      mma_kstep<C>(acc, da0 + so, db0 + so, c_kt != 0);
    }
    if (issued < iters) load_next(issued % C::STAGES), ++issued;  // issued == it + STAGES - 2
    cp_async_commit();
    wgmma_wait<1>();
    pin<C::NF>(acc);
    if (c_kt == KT - 1) {  // the tile's last k-step: drain, store, move to the next tile
      wgmma_wait<0>();     // (in this block: ptxas then sees no use of in-flight accumulators)
      pin<C::NF>(acc);
      if (wg_active) store_tile<C, GATE_UP, VEC>(a, ct, acc, tid);
      c_kt = 0;
      if (++c_seq < my_tiles) {
        const int4 r = ring[c_seq & 3];
        ct = TileInfo{0, r.x, r.y, r.z, r.w};
        wg_active = ct.m0 + wg * 64 < ct.cnt;
      }
    } else {
      ++c_kt;
    }
  }
  wgmma_wait<0>();     // (nothing is in flight: the last k-step drained)
  cp_async_wait<0>();
#else
  (void)a;
  (void)n_tiles;
  __trap();  // built for sm_90a only; moe.cu checks the device (wgmma_device)
#endif
}

// Warp-specialised persistent variant (variant 6: HYPIC_MOE_WGMMA=6, or variant 1's 128-row tiles below 512 rows per
// expert under the measured default HYPIC_MOE_WARP_SPECIALIZED, moe.cu wgmma_variant), in the manner of FlashAttention-3's producer / consumer
// warpgroups (section 3.1): 3 warpgroups per block, at most one block per SM, each taking the launch's tiles (m-tile
// * n_tiles + n-tile, as moe_wgmma_kernel's blocks) in order from a counter in device memory whenever its loader is
// ready for one, so the tiles in flight stay a narrow window (an expert's tiles run close together and share its
// weights in L2; a static b, b + G, .. walk let the blocks drift apart and read the weights from DRAM again).
// Warpgroup 0 only loads, into a ring of STAGES slots: each k-step's A rows (gathered token rows for gate_up:
// cp.async, thread (u = tid % 8, r0 = tid / 8) copying unit u of rows r0 + 16 i, each thread's arrival made when its
// copies land: cp.async.mbarrier.arrive.noinc) and its B rows, the expert's weight rows, as TMA boxes of the 3-D
// tensor map [E][rows][K] (`bmap`, 64 x BOX_ROWS x 1 boxes, 128-byte swizzled, which is the wgmma operand layout
// here; thread 0 arms the slot's `full` mbarrier with the boxes' bytes, 129 arrivals per phase), and refills a slot
// once both consumer warpgroups released it (`empty`: 256 arrivals). Thread 0 takes each tile and writes its
// (m0, seg, cnt, n0) to a shared ring that the consumers read once the tile's first slot is full (the arrival
// releases it); past the last tile it writes an end mark and completes the next slot's phase without data. gate_up's
// B rows are two boxes of BN/2 rows, the gate rows n0 .. and the up rows N + n0 .. (moe_wgmma_kernel's row order
// without the vector epilogue's permutation); down's one box of BN rows. Rows past N and past K read as zeros or as
// rows of other columns that are never stored. Warpgroups 1 and 2 are moe_wgmma_kernel's two warpgroups (rows
// 64 w .. 64 w + 63, w = warpgroup - 1; on 64-row tiles both the tile's 64 rows, each over its BN/2 B rows):
// per k-step they wait for its slot, issue its 4 wgmmas, wait until the
// previous k-step's are done and release that slot; after a tile's last k-step they drain and store (VEC: 16-byte
// stores after a transpose across each quad, store_tile_quad; else the m16n8 pairs). No block-wide barrier in the
// loop: the loads run up to STAGES k-steps ahead, across tiles and while the consumers store. Same tiles, products
// and k order as moe_wgmma_kernel: the same bits. tile_counter: zero before the launch (launch_ws).
//
// 64-row tiles (variant 9: HYPIC_MOE_WGMMA=9, or the 64-row schedule of few rows per expert under the measured
// default HYPIC_MOE_WS_SMALL): the same blocks with moe_wgmma_kernel's 64 x 256 configuration (5 slots of 8 KB of A and 32 KB
// of B): gate_up's B rows are four boxes of 64, warpgroup w's gate rows n0 + 64 w .. then its up rows N + n0 + 64 w ..
// (the 64-row order of moe_wgmma_kernel); down's one box of 256. Where a splice's 184 tokens or a short prompt give a
// few rows per expert the GEMMs stream every expert's weights once, one tile after another on each SM: the loader
// keeps streaming the next tile's weights through a tile's last k-steps and its epilogue, where one block per tile
// leaves DRAM idle from its last loads until the next block's first land.
//
// PAIR (variant 7: HYPIC_MOE_WGMMA=7, or the candidate HYPIC_MOE_CLUSTER_PAIRS): clusters of two such blocks on the
// m-tile pairs (2 j, 2 j + 1) of the schedule, one m-tile each (rank r: m-tile 2 j + r, the same n-tile), so that
// where both m-tiles belong to one expert (offsets_kernel puts the experts with an even m-tile count first, so each of
// their pairs does; an odd count leaves one pair of two experts) the weights are read from L2 once for the two (the 128 x 256 tiles of one block read 48 KB per k-step, the
// bandwidth between L2 and the SMs bounds them; CUTLASS's Hopper GEMMs use 2-CTA clusters for the same reason): each
// block loads one 128-row TMA box of the slot's B (gate_up: rank 0 the gate rows, rank 1 the up rows; down: rows
// n0 + 128 r ..) multicast into both blocks' slots, and each slot's `full` barrier expects the whole B in both. A pair
// of two experts' m-tiles loads its own B in each block; a missing second m-tile (odd count) is an empty tile whose
// block only loads its half of B. Rank 0's loader takes the pairs from the counter and hands each to both loaders
// through a mailbox in each block's shared memory (st.shared::cluster + a remote mbarrier arrival); a slot is refilled
// once the consumers of both blocks released it (`empty`: one arrival per consumer warp of each block, 16), since
// the peer's multicast writes it; the blocks synchronise as a cluster before the first and after the last access to
// each other's shared memory.
template <class C, bool GATE_UP, bool PAIR = false>
struct WsLayout {
  static constexpr int THREADS = 384;
  static constexpr int ROWS_PER_PASS = 16;  // 128 copying threads, 8 16-byte units per 128-byte row
  static constexpr int A_IT = C::BM / ROWS_PER_PASS;
  // TMA box rows (at most 256): gate_up's gate and up rows of each warpgroup (128-row tiles: the tile's two halves;
  // 64-row tiles: warpgroup w's gate rows, then its up rows, 64 each); down's whole tile, or its halves in pairs
  static constexpr int BOX_ROWS = GATE_UP ? C::WG_N / 2 : PAIR ? C::BN / 2 : C::BN;
  static constexpr int BOXES = C::BN / BOX_ROWS;  // per slot (PAIR: one per block where multicast)
  // Tile ring entries: the loader runs at most STAGES k-steps (so STAGES + 1 tiles with the end mark) ahead. With
  // PAIR, rank 0's loader also runs at most STAGES k-steps ahead of rank 1's consumers (the shared `empty`), so at
  // most STAGES + 1 tiles ahead of rank 1's loader: the mailbox has RING entries too.
  static constexpr int RING = 8;
  static_assert(RING > C::STAGES + 1, "tile ring");
  static constexpr int EMPTY_ARRIVALS = PAIR ? 2 * 8 : 256;
  static constexpr int BAR_OFFSET = C::STAGES * C::STAGE_BYTES;  // from the 1024-byte aligned base: full[S], empty[S]
  static constexpr int SMEM = BAR_OFFSET + 2 * C::STAGES * 8 + 1024;
  // No register reallocation (setmaxnreg): the consumers fit the 168 registers per thread of 384-thread blocks.
  static_assert(((C::BM == 128 && C::WG_N == C::BN) || (C::BM == 64 && C::WG_N == C::BN / 2 && !PAIR)) &&
                    BOX_ROWS <= 256 && (!PAIR || BOXES == 2),
                "the warp-specialised variant's tiles (clusters of two: 128-row tiles)");
  static_assert(SMEM <= 227 * 1024, "shared memory per block");
};

template <class C, bool GATE_UP, bool VEC, bool PAIR = false>
__global__ void __launch_bounds__(WsLayout<C, GATE_UP, PAIR>::THREADS, 1)
    moe_wgmma_ws_kernel(const GroupedArgs a, int n_tiles, int* tile_counter,
                        const __grid_constant__ CUtensorMap bmap) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WsLayout<C, GATE_UP, PAIR>;
  constexpr int S = C::STAGES;
  __shared__ int4 ring[L::RING];  // the tiles the loader took, in order: (m0, seg, cnt, n0); cnt < 0: no more
  __shared__ int ring_e[L::RING];
  __shared__ int ring_mc[L::RING];          // PAIR: 1 where the pair's B is multicast (one expert)
  __shared__ int4 mailbox[L::RING];         // PAIR: the pair index rank 0 took (x)
  __shared__ uint64_t mail_bar[L::RING];    // PAIR: one arrival (rank 0's) per entry and use
  const uint32_t rank = PAIR ? cluster_rank() : 0u;
  // tiles (PAIR: m-tile pairs) of the launch
  const int total = PAIR ? (*a.num_tiles + 1) / 2 * n_tiles : *a.num_tiles * n_tiles;
  const int K = a.K, KT = (K + C::BK - 1) / C::BK;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t pad = ((smem_addr(smem_raw) + 1023u) & ~1023u) - smem_addr(smem_raw);
  const uint32_t s_base = smem_addr(smem_raw) + pad;  // slot s: A at s * STAGE_BYTES, then B
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw + pad + L::BAR_OFFSET);
  uint64_t* empty = full + S;
  const int tid = threadIdx.x, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full + s, 128 + 1);
      mbar_init(empty + s, L::EMPTY_ARRIVALS);
    }
    if (PAIR)
      for (int i = 0; i < L::RING; ++i) mbar_init(mail_bar + i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (PAIR)
    cluster_sync();  // the peer's barriers are initialised before this block arrives on them or multicasts
  else
    __syncthreads();
  // (PAIR: the empty barriers gather the consumers of both blocks; their arrivals order nothing but the async
  // proxy's reads, so the waits need no cluster-scope acquire)
  auto wait_empty = [&](int s, uint32_t parity) { mbar_wait(empty + s, parity); };

  if (wg == 0) {  // loader: k-step `it` of the block's stream into slot it % S
    const int u = tid & 7, r0 = tid >> 3;
    const uint32_t dst0 = s_base + uint32_t(r0 * 128 + ((u ^ (r0 & 7)) << 4));  // r % 8 == r0 % 8 for every row
    int it = 0;
#pragma unroll 1
    for (int seq = 0;; ++seq) {
      const int ri = seq % L::RING;
      if (tid == 0) {  // the next tile of the launch (taken in order by whichever block is ready first)
        int4 e = make_int4(0, 0, -1, 0);
        int ex = 0, mc = 0;
        if constexpr (PAIR) {
          if (rank == 0) {  // take the next pair, hand it to both blocks
            const int q = atomicAdd(tile_counter, 1);
            for (uint32_t cta = 0; cta < 2; ++cta) {
              st_cluster_v4(mailbox + ri, cta, make_int4(q, 0, 0, 0));
              mbar_arrive_cluster(mail_bar + ri, cta, true);
            }
          }
          mbar_wait_cluster(mail_bar + ri, uint32_t((seq / L::RING) & 1));
          const int q = mailbox[ri].x;
          if (q < total) {
            const int mt0 = 2 * (q / n_tiles), nt = q % n_tiles, mt = mt0 + int(rank);
            const TileInfo t0 = tile_info<C, GATE_UP>(a, mt0, nt);
            const bool second = mt0 + 1 < *a.num_tiles;
            mc = !second || a.tiles[mt0 + 1].x == t0.e;
            // the block's m-tile, or (no second m-tile) an empty one of rank 0's expert and columns
            const TileInfo t = mt == mt0 ? t0 : second ? tile_info<C, GATE_UP>(a, mt, nt) : TileInfo{t0.e, 0, 0, 0, t0.n0};
            e = make_int4(t.m0, t.seg, t.cnt, t.n0);
            ex = t.e;
          }
        } else {
          const int tt = atomicAdd(tile_counter, 1);
          if (tt < total) {
            const TileInfo t = tile_info<C, GATE_UP>(a, tt / n_tiles, tt % n_tiles);
            e = make_int4(t.m0, t.seg, t.cnt, t.n0);
            ex = t.e;
          }
        }
        ring[ri] = e;
        ring_e[ri] = ex;
        ring_mc[ri] = mc;
      }
      named_sync(1, 128);
      const int4 e = ring[ri];
      const int s_first = it % S;
      if (e.z < 0) {  // no more tiles: complete the next phase of the next slot with no data (the consumers exit)
        if (it >= S) wait_empty(s_first, uint32_t((it / S - 1) & 1));
        mbar_arrive(full + s_first);
        if (tid == 0) mbar_arrive(full + s_first);
        break;
      }
      const TileInfo t{ring_e[ri], e.x, e.y, e.z, e.w};
      const bool multicast = PAIR && ring_mc[ri];
      int rows[L::A_IT];
#pragma unroll
      for (int i = 0; i < L::A_IT; ++i) {
        const int m = t.m0 + r0 + i * L::ROWS_PER_PASS;
        rows[i] = m < t.cnt ? (GATE_UP ? a.a_rows[t.seg + m] : t.seg + m) : -1;
      }
#pragma unroll 1
      for (int kt = 0; kt < KT; ++kt, ++it) {
        const int s = it % S;
        if (it >= S) wait_empty(s, uint32_t((it / S - 1) & 1));  // the consumers done with k-step it - S
        const int k0 = kt * C::BK;
        if (tid == 0) {  // (its arrival releases the ring entry written above to the consumers)
          const uint32_t sb = s_base + uint32_t(s * C::STAGE_BYTES + C::A_BYTES);
          mbar_arrive_expect_tx(full + s, uint32_t(C::B_BYTES));  // (PAIR: half from each block where multicast)
          // box b holds B rows b * BOX_ROWS .. of the slot: gate_up's gate rows n0 + (b / 2) BOX_ROWS .. (b even) or
          // the matching up rows N + .. (b odd); down's rows n0 + b * BOX_ROWS ..
          auto box_row = [&](int b) {
            return GATE_UP ? (b & 1 ? a.N : 0) + t.n0 + (b >> 1) * L::BOX_ROWS : t.n0 + b * L::BOX_ROWS;
          };
          if (multicast) {
            tma_load_3d_multicast(sb + rank * uint32_t(L::BOX_ROWS * 128), &bmap, full + s, k0, box_row(int(rank)),
                                  t.e, uint16_t(0x3));
          } else {
#pragma unroll
            for (int b = 0; b < L::BOXES; ++b)
              tma_load_3d(sb + uint32_t(b * L::BOX_ROWS * 128), &bmap, full + s, k0, box_row(b), t.e);
          }
        }
        const uint32_t bytes = k0 + u * 8 < K ? 16u : 0u;  // K is a multiple of 8; past K: zeros
        const int ko = (bytes ? k0 : 0) + u * 8;
        const uint32_t st = dst0 + uint32_t(s * C::STAGE_BYTES);
#pragma unroll
        for (int i = 0; i < L::A_IT; ++i)
          if (rows[i] >= 0)
            cp_async16_zfill(st + uint32_t(i * L::ROWS_PER_PASS * 128), a.A + size_t(rows[i]) * K + ko, bytes);
        cp_async_mbar_arrive(full + s);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    if (PAIR) cluster_sync();
    return;
  }

  // consumer thread 0 .. 255; its warpgroup's row half (128-row tiles) or column half (64-row tiles)
  const int ct = tid - 128, cw = wg - 1;
  const uint64_t da0 = sw128_desc(s_base + uint32_t(C::BM == 128 ? cw * 64 * 128 : 0), 16, 1024);
  const uint64_t db0 = sw128_desc(s_base + uint32_t(C::A_BYTES + (C::BM == 128 ? 0 : cw * C::WG_N * 128)), 16, 1024);
  // The slot's release by this thread (PAIR: by this warp, in both blocks, once every lane's wgmmas are done).
  auto release = [&](int s) {
    if constexpr (PAIR) {
      __syncwarp();
      if ((tid & 31) == 0) {
        mbar_arrive_cluster(empty + s, 0);
        mbar_arrive_cluster(empty + s, 1);
      }
    } else {
      mbar_arrive(empty + s);
    }
  };
  float acc[C::NF][4];
#pragma unroll
  for (int f = 0; f < C::NF; ++f) acc[f][0] = acc[f][1] = acc[f][2] = acc[f][3] = 0.f;
  int it = 0;
#pragma unroll 1
  for (int seq = 0;; ++seq) {
    mbar_wait(full + it % S, uint32_t((it / S) & 1));  // the tile's first k-step, or the end
    const int4 e = ring[seq % L::RING];
    if (e.z < 0) break;
    const TileInfo t{0, e.x, e.y, e.z, e.w};
    // warpgroup-uniform: rows all past the count issue no wgmma (64-row tiles: both share the rows)
    const bool active = t.m0 + (C::BM == 128 ? cw * 64 : 0) < t.cnt;
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt, ++it) {
      const int s = it % S;
      if (kt > 0) mbar_wait(full + s, uint32_t((it / S) & 1));
      fence_proxy_async();  // A was written by cp.async (generic proxy), wgmma reads it (async proxy)
      if (active) {
        const uint64_t so = uint64_t((s * C::STAGE_BYTES) >> 4);
        mma_kstep<C>(acc, da0 + so, db0 + so, kt != 0);
      }
      wgmma_wait<1>();  // k-step it - 1 done: its slot is free
      pin<C::NF>(acc);
      if (kt > 0) release((it - 1) % S);
    }
    wgmma_wait<0>();
    pin<C::NF>(acc);
    release((it - 1) % S);
    if (active) {
      if (VEC)
        store_tile_quad<C, GATE_UP>(a, t, acc, ct);
      else
        store_tile<C, GATE_UP, false>(a, t, acc, ct);
    }
  }
  if (PAIR) cluster_sync();  // (the peer's last multicast and remote arrivals on this block are done)
#else
  (void)a;
  (void)n_tiles;
  (void)tile_counter;
  (void)bmap;
  __trap();  // built for sm_90a only; moe.cu checks the device (wgmma_device)
#endif
}

// Swap-AB tiles (the candidate HYPIC_MOE_SWAP_AB; moe.cu own_wgmma_bm): the expert's weights are the wgmma M side and
// its tokens the N side, D[w][t] = W[w][:] . X[t][:], so a tile is 256 weight rows (128 per consumer warpgroup, as two
// m64 halves) by the expert's tokens of one 128-row m-tile of the schedule (kSwapBM), in steps of 16 (m64nNk16,
// N = 16 ceil(cnt / 16): at most 15 padded rows per m-tile, where the 128-row tiles above pad up to 127 and stream the
// expert's weights once per m-tile). Both operands stay K-major and 128-byte swizzled, as above with their roles
// exchanged: A = the weight rows by TMA (the slot's first 32 KB), B = the token rows by cp.async (gate_up: x rows
// gathered through a_rows; down: act rows seg + m), at most 128 x 128 bytes per k-step. Same k order (k-steps of 64,
// four k16 each) as the kernels above. 256 weight rows per tile (not 128 with up to 256 tokens) halve the token rows
// read from L2 per weight byte: at 128 rows the L2 ran at 83% of its rate beside DRAM at 75% (H100, 4096 tokens).
//
// gate_up (GATE_UP): a tile's 256 weight rows are sixteen (8 gate rows, 8 up rows) pairs, pair p the gate rows
// n0 + 8 p .. + 7 and the matching up rows I + n0 + 8 p .., n0 = 128 wb (wb: the tile's weight block): one TMA box of
// the 5-D view of swap_map_5d per k-step (HYPIC_MOE_SWAP_5D, where the driver encodes it) or 32 boxes of 8 rows. Warp
// w of half h of consumer warpgroup c holds the gate rows of act columns j = n0 + 8 (8 c + 4 h + w) + g in its
// accumulator rows g and their up rows in rows g + 8 (the m64 accumulator layout): SwiGLU in registers, act[p][j] =
// bf16(silu(bf16(g)) * bf16(u)), 128 act columns per tile. down: one 256-row box, rows n0 = 256 wb .., y[p][n] =
// bf16(acc). Stores: lane (g, q) of fragment f holds columns (tokens) 8 f + 2 q, + 1 of rows g (and g + 8); one
// shuffle with lane g ^ 1 gives each lane two adjacent output columns of one token, one 4-byte store (N even).
//
// Block: as moe_wgmma_ws_kernel (warpgroup 0 loads into a ring of 4 slots of 32 + 16 KB, `full` / `empty`
// mbarriers, tiles from a counter in device memory, tile t = m-tile (t / wblocks) x weight block (t % wblocks), an
// m-tile's weight blocks consecutive so that an expert's next m-tile finds its weights in L2; warpgroups 1 and 2
// compute). Token rows past the tile's count are not loaded (stale shared memory reaching accumulator columns that
// are never stored); weight rows past the tensor (and k past K) are zeros, gate rows past I are up rows whose act
// columns are not stored.
// setmaxnreg split of the swap-AB blocks: the loader warpgroup's registers per thread and the two consumer
// warpgroups' (multiples of 8 in [24, 256]); their sum over the block must not pass its allocation.
constexpr int kSwapLoaderRegs = 48, kSwapConsumerRegs = 224;
constexpr int kSwapSetmaxnregRegs = 128 * kSwapLoaderRegs + 256 * kSwapConsumerRegs;
static_assert(kSwapSetmaxnregRegs <= 384 * 168, "setmaxnreg within the allocation under __launch_bounds__(384, 1)");
struct SwapCfg {
  static constexpr int BW = 256;       // weight rows per tile
  static constexpr int NT = kSwapBM;   // tokens per tile at most (the schedule's m-tile rows)
  static constexpr int BK = 64, STAGES = 4, THREADS = 384, RING = 8;
  static constexpr int A_BYTES = BW * 128, B_BYTES = NT * 128, STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int ROWS_PER_PASS = 16, B_IT = NT / ROWS_PER_PASS;  // 128 copying threads, 8 units per row
  static constexpr int BAR_OFFSET = STAGES * STAGE_BYTES;
  static constexpr int SMEM = BAR_OFFSET + 2 * STAGES * 8 + 1024;
  static_assert(NT % 16 == 0 && NT <= 128 && BW == 256 && RING > STAGES + 1 && SMEM <= 227 * 1024, "swap-AB tile");
};
// Output columns per tile: gate_up 128 act columns, down 256.
template <bool GATE_UP>
constexpr int swap_cols() {
  return GATE_UP ? SwapCfg::BW / 2 : SwapCfg::BW;
}

// The stores of one swap-AB tile of consumer thread ct (0 .. 255) over the first 2 J fragments of each half's
// accumulators (N = 16 J tokens): e = (expert, first sorted row, token count, weight block).
template <int J, bool GATE_UP>
__device__ __forceinline__ void swap_store(const GroupedArgs& a, int4 e, const float (&acc)[2][16][4], int ct) {
  const int lane = ct & 31, g = lane >> 2, q = lane & 3, w = (ct >> 5) & 3, c = ct >> 7;
  const int odd = g & 1, N = a.N, cnt = e.z;
  bf16* out = a.out + size_t(e.y) * N;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (GATE_UP) {
      const int jp = e.w * 128 + 8 * (8 * c + 4 * h + w) + (g & ~1);  // the pair of act columns this lane stores
#pragma unroll
      for (int f = 0; f < 2 * J; ++f) {
        const float a0 = silu_f(round_bf16(acc[h][f][0])) * round_bf16(acc[h][f][2]);  // token 8 f + 2 q, column g
        const float a1 = silu_f(round_bf16(acc[h][f][1])) * round_bf16(acc[h][f][3]);  // token 8 f + 2 q + 1
        const float r = __shfl_xor_sync(0xffffffffu, odd ? a0 : a1, 4);
        const int tok = 8 * f + 2 * q + odd;
        if (tok < cnt && jp < N)
          *reinterpret_cast<uint32_t*>(out + size_t(tok) * N + jp) = odd ? pack_bf16(r, a1) : pack_bf16(a0, r);
      }
    } else {
      const int np0 = e.w * 256 + 128 * c + 64 * h + 16 * w + (g & ~1);
#pragma unroll
      for (int f = 0; f < 2 * J; ++f) {
#pragma unroll
        for (int r8 = 0; r8 < 2; ++r8) {
          const float v0 = acc[h][f][2 * r8], v1 = acc[h][f][2 * r8 + 1];
          const float r = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
          const int tok = 8 * f + 2 * q + odd, np = np0 + 8 * r8;
          if (tok < cnt && np < N)
            *reinterpret_cast<uint32_t*>(out + size_t(tok) * N + np) = odd ? pack_bf16(r, v1) : pack_bf16(v0, r);
        }
      }
    }
  }
}

// One swap-AB tile of a consumer warpgroup over N = 16 J tokens: its KT k-steps from the ring (it: the block's
// k-step count so far, advanced; da0: the descriptor of its first 64 weight rows, the second half 64 rows on), then
// the stores.
template <int J, bool GATE_UP>
__device__ __forceinline__ void swap_tile(const GroupedArgs& a, int4 e, float (&acc)[2][16][4], uint64_t da0,
                                          uint64_t db0, uint64_t* full, uint64_t* empty, int& it, int KT, int ct) {
  constexpr int S = SwapCfg::STAGES;
  constexpr uint64_t kHalf = (64 * 128) >> 4;  // descriptor units from the first half's rows to the second's
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt, ++it) {
    const int s = it % S;
    if (kt > 0) mbar_wait(full + s, uint32_t((it / S) & 1));
    fence_proxy_async();  // B was written by cp.async (generic proxy), wgmma reads it (async proxy)
    const uint64_t so = uint64_t((s * SwapCfg::STAGE_BYTES) >> 4);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < SwapCfg::BK / 16; ++kk) {
      const int acc_on = kt != 0 || kk != 0 ? 1 : 0;
      wgmma_m64nk16_ss<16 * J>(acc[0], da0 + so + kk * 2, db0 + so + kk * 2, acc_on);
      wgmma_m64nk16_ss<16 * J>(acc[1], da0 + kHalf + so + kk * 2, db0 + so + kk * 2, acc_on);
    }
    wgmma_commit();
    wgmma_wait<1>();  // k-step it - 1 done: its slot is free
    pin<16>(acc[0]);
    pin<16>(acc[1]);
    if (kt > 0) mbar_arrive(empty + (it - 1) % S);
  }
  wgmma_wait<0>();
  pin<16>(acc[0]);
  pin<16>(acc[1]);
  mbar_arrive(empty + (it - 1) % S);
  swap_store<J, GATE_UP>(a, e, acc, ct);
}

// The warp-specialised swap-AB kernel (see SwapCfg): a as for moe_wgmma_ws_kernel with the schedule's m-tiles of
// kSwapBM rows; wblocks: weight blocks per expert (gate_up ceil(I / 128), down ceil(H / 256)); wmap: the weights'
// 3-D tensor map [E][rows][K] in boxes of 64 x 8 (gate_up) or 64 x 256 (down) rows, 128-byte swizzled, or with
// gate_up_5d (gate_up only) the 5-D view of swap_map_5d whose one box per k-step is the tile's 256 interleaved rows;
// tile_counter zero before the launch.
template <bool GATE_UP>
__global__ void __launch_bounds__(SwapCfg::THREADS, 1)
    moe_swap_ws_kernel(const GroupedArgs a, int wblocks, int* tile_counter, const __grid_constant__ CUtensorMap wmap,
                       int gate_up_5d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = SwapCfg;
  constexpr int S = C::STAGES;
  __shared__ int4 ring[C::RING];  // (expert, first sorted row, token count, weight block); count < 0: no more
  const int total = *a.num_tiles * wblocks;
  const int K = a.K, KT = (K + C::BK - 1) / C::BK;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t pad = ((smem_addr(smem_raw) + 1023u) & ~1023u) - smem_addr(smem_raw);
  const uint32_t s_base = smem_addr(smem_raw) + pad;  // slot s: the weight rows at s * STAGE_BYTES, then the tokens
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw + pad + C::BAR_OFFSET);
  uint64_t* empty = full + S;
  const int tid = threadIdx.x, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full + s, 128 + 1);
      mbar_init(empty + s, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // The loader's registers lowered and the consumers' raised within the block's allocation (384 x 168 under the
  // launch bounds; swap_regs_ok checks the count the toolkit gave): setmaxnreg.inc waits until the block's pool has
  // the registers, so a larger sum never returns.
  if (wg == 0) {  // loader
    regs_dec<kSwapLoaderRegs>();
    const int u = tid & 7, r0 = tid >> 3;
    const uint32_t dst0 = s_base + uint32_t(C::A_BYTES + r0 * 128 + ((u ^ (r0 & 7)) << 4));
    int it = 0;
#pragma unroll 1
    for (int seq = 0;; ++seq) {
      const int ri = seq % C::RING;
      if (tid == 0) {
        int4 e = make_int4(0, 0, -1, 0);
        const int tt = atomicAdd(tile_counter, 1);
        if (tt < total) {
          const int2 tile = a.tiles[tt / wblocks];
          const int seg = a.offsets[tile.x];
          e = make_int4(tile.x, seg + tile.y, min(C::NT, a.offsets[tile.x + 1] - seg - tile.y), tt % wblocks);
        }
        ring[ri] = e;
      }
      named_sync(1, 128);
      const int4 e = ring[ri];
      const int s_first = it % S;
      if (e.z < 0) {  // no more tiles: complete the next phase of the next slot with no data (the consumers exit)
        if (it >= S) mbar_wait(empty + s_first, uint32_t((it / S - 1) & 1));
        mbar_arrive(full + s_first);
        if (tid == 0) mbar_arrive(full + s_first);
        break;
      }
      int rows[C::B_IT];
#pragma unroll
      for (int i = 0; i < C::B_IT; ++i) {
        const int m = r0 + i * C::ROWS_PER_PASS;
        rows[i] = m < e.z ? (GATE_UP ? a.a_rows[e.y + m] : e.y + m) : -1;
      }
#pragma unroll 1
      for (int kt = 0; kt < KT; ++kt, ++it) {
        const int s = it % S;
        if (it >= S) mbar_wait(empty + s, uint32_t((it / S - 1) & 1));  // the consumers done with k-step it - S
        const int k0 = kt * C::BK;
        if (tid == 0) {  // (its arrival releases the ring entry written above to the consumers)
          const uint32_t sa = s_base + uint32_t(s * C::STAGE_BYTES);
          mbar_arrive_expect_tx(full + s, uint32_t(C::A_BYTES));
          if (GATE_UP && gate_up_5d) {  // one box: 16 groups x (8 gate rows, 8 up rows)
            tma_load_5d(sa, &wmap, full + s, k0, 0, 0, e.w * 16, e.x);
          } else if constexpr (GATE_UP) {
#pragma unroll 1
            for (int p = 0; p < 16; ++p) {
              const int j = e.w * 128 + 8 * p;
              tma_load_3d(sa + uint32_t(2 * p * 1024), &wmap, full + s, k0, j, e.x);
              tma_load_3d(sa + uint32_t((2 * p + 1) * 1024), &wmap, full + s, k0, a.N + j, e.x);
            }
          } else {
            tma_load_3d(sa, &wmap, full + s, k0, e.w * C::BW, e.x);
          }
        }
        const uint32_t bytes = k0 + u * 8 < K ? 16u : 0u;  // K is a multiple of 8; past K: zeros
        const int ko = (bytes ? k0 : 0) + u * 8;
        const uint32_t st = dst0 + uint32_t(s * C::STAGE_BYTES);
#pragma unroll
        for (int i = 0; i < C::B_IT; ++i)
          if (rows[i] >= 0)
            cp_async16_zfill(st + uint32_t(i * C::ROWS_PER_PASS * 128), a.A + size_t(rows[i]) * K + ko, bytes);
        cp_async_mbar_arrive(full + s);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  // consumer thread 0 .. 255 of warpgroup c = wg - 1: weight rows 128 c .. 128 c + 127 of the tile, every token
  regs_inc<kSwapConsumerRegs>();
  const int ct = tid - 128, c = wg - 1;
  const uint64_t da0 = sw128_desc(s_base + uint32_t(c * 128 * 128), 16, 1024);
  const uint64_t db0 = sw128_desc(s_base + uint32_t(C::A_BYTES), 16, 1024);
  float acc[2][16][4];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int f = 0; f < 16; ++f) acc[h][f][0] = acc[h][f][1] = acc[h][f][2] = acc[h][f][3] = 0.f;
  int it = 0;
#pragma unroll 1
  for (int seq = 0;; ++seq) {
    mbar_wait(full + it % S, uint32_t((it / S) & 1));  // the tile's first k-step, or the end
    const int4 e = ring[seq % C::RING];
    if (e.z < 0) break;
    switch ((e.z + 15) >> 4) {  // N = 16 J tokens
#define HYPIC_SWAP_CASE(J) \
  case J: swap_tile<J, GATE_UP>(a, e, acc, da0, db0, full, empty, it, KT, ct); break;
      HYPIC_SWAP_CASE(1) HYPIC_SWAP_CASE(2) HYPIC_SWAP_CASE(3) HYPIC_SWAP_CASE(4) HYPIC_SWAP_CASE(5)
      HYPIC_SWAP_CASE(6) HYPIC_SWAP_CASE(7)
      default: swap_tile<8, GATE_UP>(a, e, acc, da0, db0, full, empty, it, KT, ct); break;
#undef HYPIC_SWAP_CASE
    }
  }
#else
  (void)a;
  (void)wblocks;
  (void)tile_counter;
  (void)wmap;
  (void)gate_up_5d;
  __trap();  // built for sm_90a only; moe.cu checks the device (wgmma_device)
#endif
}

// Whether g's weights can be a TMA tensor map: 16-byte aligned base and strides (K and the expert stride multiples
// of 8 elements), at least one row and expert (the encoder checks the rest; weights_tensor_map says if it refuses).
bool weights_tma_ok(const GroupedArgs& g, int E, int rows) {
  return reinterpret_cast<uintptr_t>(g.B) % 16 == 0 && g.K % 8 == 0 && g.b_expert_stride % 8 == 0 &&
         size_t(rows) * size_t(g.K) <= g.b_expert_stride && rows > 0 && E > 0;
}

// The 3-D tensor map of g's weights [E][rows][K] bf16 (row stride K, expert stride b_expert_stride elements) in boxes
// of 64 x box_rows x 1, 128-byte swizzled, zeros outside, into *m. False when the driver has no encoder or refuses the
// map (the caller then runs one block per tile).
bool weights_tensor_map(const GroupedArgs& g, int E, int rows, int box_rows, CUtensorMap* m) {
  return encode_bf16_map_3d(m, g.B, {uint64_t(g.K), uint64_t(rows), uint64_t(E)},
                            {uint64_t(g.K) * 2, uint64_t(g.b_expert_stride) * 2}, {64, uint32_t(box_rows), 1});
}

template <class C, bool GATE_UP, bool VEC>
void set_smem_one(const char* what) {
  check_cuda(cudaFuncSetAttribute(moe_wgmma_kernel<C, GATE_UP, VEC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  C::SMEM),
             std::string("cudaFuncSetAttribute(moe_wgmma_kernel ") + what + ")");
  if constexpr (C::BM == 128) {
    check_cuda(cudaFuncSetAttribute(moe_wgmma_persistent_kernel<C, GATE_UP, VEC>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM),
               std::string("cudaFuncSetAttribute(moe_wgmma_persistent_kernel ") + what + ")");
    if constexpr (C::BN == 256)
      check_cuda(cudaFuncSetAttribute(moe_wgmma_ws_kernel<C, GATE_UP, VEC, true>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, WsLayout<C, GATE_UP, true>::SMEM),
                 std::string("cudaFuncSetAttribute(moe_wgmma_ws_kernel, pairs ") + what + ")");
  }
  if constexpr (C::BN == 256)
    check_cuda(cudaFuncSetAttribute(moe_wgmma_ws_kernel<C, GATE_UP, VEC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    WsLayout<C, GATE_UP>::SMEM),
               std::string("cudaFuncSetAttribute(moe_wgmma_ws_kernel ") + what + ")");
}
template <class C, bool GATE_UP>
void set_smem(const char* what) {
  set_smem_one<C, GATE_UP, false>(what);
  set_smem_one<C, GATE_UP, true>(what);
}

// Per device: the shared-memory opt-in of every kernel; returns the multiprocessor count.
int setup_device(int dev) {
  set_smem<GateUpCfg, true>("gate_up");
  set_smem<DownCfg, false>("down");
  set_smem<Down128Cfg, false>("down 128");
  set_smem<GateUpSmallCfg, true>("gate_up, 64-row tiles");
  set_smem<DownSmallCfg, false>("down, 64-row tiles");
  check_cuda(cudaFuncSetAttribute(moe_swap_ws_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, SwapCfg::SMEM),
             "cudaFuncSetAttribute(moe_swap_ws_kernel gate_up)");
  check_cuda(cudaFuncSetAttribute(moe_swap_ws_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  SwapCfg::SMEM),
             "cudaFuncSetAttribute(moe_swap_ws_kernel down)");
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute(SMs)");
  return sms;
}

std::atomic<uint64_t> g_persistent_launches{0};  // (moe_persistent_launches)
std::atomic<uint64_t> g_ws_launches{0};          // (moe_warp_specialized_launches)
std::atomic<uint64_t> g_pair_launches{0};        // (moe_cluster_pair_launches)

// How a GEMM's 128-row tiles are walked: one block per tile, persistent blocks (variants 3 / 4), or persistent
// warp-specialised blocks (variant 6).
enum class Sched { kPerTile, kPersistent, kWarpSpecialized };

// grid_m m-tiles (an upper bound) x the n-tiles covering g.N; persistent schedules: at most MINB blocks per SM
// (warp-specialised: one).
template <class C, bool GATE_UP, bool VEC>
void launch_tiles(const GroupedArgs& g, size_t grid_m, Sched sched, int sms, cudaStream_t stream, const char* what) {
  constexpr int cols = GATE_UP ? C::BN / 2 : C::BN;
  const int n_tiles = (g.N + cols - 1) / cols;
  const size_t blocks = grid_m * size_t(n_tiles);
  if (blocks > size_t(INT_MAX))
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(blocks) + " tiles do not fit a grid");
  if constexpr (C::BM == 128) {
    if (sched == Sched::kPersistent) {
      const unsigned grid = unsigned(std::min(blocks, size_t(sms) * C::MINB));
      moe_wgmma_persistent_kernel<C, GATE_UP, VEC><<<grid, C::THREADS, C::SMEM, stream>>>(g, n_tiles);
      check_cuda(cudaGetLastError(), what);
      g_persistent_launches.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  if (sched != Sched::kPerTile) throw std::logic_error(std::string(what) + ": no such schedule for this tile shape");
  moe_wgmma_kernel<C, GATE_UP, VEC><<<unsigned(blocks), C::THREADS, C::SMEM, stream>>>(g, n_tiles);
  check_cuda(cudaGetLastError(), what);
}

// The most clusters of two blocks of moe_wgmma_ws_kernel<C, GATE_UP, VEC, true> that the current device `dev` runs at
// once (cudaOccupancyMaxActiveClusters: pairs of SMs of one GPC), asked once per device and instantiation (each time
// for ordinals past 63); 0 where none fits (the caller then runs the blocks alone).
template <class C, bool GATE_UP, bool VEC>
int max_pair_clusters(int dev) {
  static std::atomic<int> cached[64];  // (+ 1: 0 = not asked yet)
  const bool cacheable = dev >= 0 && dev < 64;
  if (cacheable) {
    const int c = cached[dev].load(std::memory_order_relaxed);
    if (c > 0) return c - 1;
  }
  int n = 0;
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 2, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
  cfg.gridDim = dim3(2), cfg.blockDim = dim3(WsLayout<C, GATE_UP, true>::THREADS);
  cfg.dynamicSmemBytes = WsLayout<C, GATE_UP, true>::SMEM;
  cfg.attrs = &attr, cfg.numAttrs = 1;
  check_cuda(cudaOccupancyMaxActiveClusters(&n, moe_wgmma_ws_kernel<C, GATE_UP, VEC, true>, &cfg),
             "cudaOccupancyMaxActiveClusters(moe_wgmma_ws_kernel, pairs)");
  n = std::max(n, 0);
  if (cacheable) cached[dev].store(n + 1, std::memory_order_relaxed);
  return n;
}

// The warp-specialised kernel over grid_m m-tiles (an upper bound; C::BM rows each: 128, or 64 for variant 9) of
// expert weights with `rows` rows each (gate_up 2N, down N): one block per SM at most; `pair` (128-row tiles only,
// else std::logic_error): in clusters of two on m-tile pairs (as many clusters as run at once). False (nothing
// launched) where the weights cannot be a TMA tensor map, or (pair) no cluster of two fits the device.
template <class C, bool GATE_UP>
bool launch_ws(const GroupedArgs& g, int E, int rows, size_t grid_m, bool vec, bool pair, int* tile_counter, int sms,
               cudaStream_t stream, const char* what) {
  if (!weights_tma_ok(g, E, rows)) return false;
  constexpr int cols = GATE_UP ? C::BN / 2 : C::BN;
  const int n_tiles = (g.N + cols - 1) / cols;
  const size_t blocks = grid_m * size_t(n_tiles);
  if (blocks > size_t(INT_MAX))
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(blocks) + " tiles do not fit a grid");
  if (pair && C::BM != 128) throw std::logic_error(std::string(what) + ": clusters of two run 128-row tiles");
  CUtensorMap map;
  if constexpr (C::BM == 128) {
    const int clusters = !pair ? 0
                         : vec  ? max_pair_clusters<C, GATE_UP, true>(current_device())
                                : max_pair_clusters<C, GATE_UP, false>(current_device());
    if (pair && clusters == 0) return false;  // one block per tile instead
    const int box_rows = pair ? WsLayout<C, GATE_UP, true>::BOX_ROWS : WsLayout<C, GATE_UP>::BOX_ROWS;
    if (!weights_tensor_map(g, E, rows, box_rows, &map)) return false;  // one block per tile instead
    check_cuda(cudaMemsetAsync(tile_counter, 0, sizeof(int), stream), std::string(what) + " (tile counter)");
    if (pair) {
      using L = WsLayout<C, GATE_UP, true>;
      const size_t pairs = (grid_m + 1) / 2 * size_t(n_tiles);
      cudaLaunchConfig_t cfg{};
      cudaLaunchAttribute attr{};
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = 2, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
      cfg.gridDim = dim3(unsigned(2 * std::min(pairs, size_t(clusters)))), cfg.blockDim = dim3(L::THREADS);
      cfg.dynamicSmemBytes = L::SMEM, cfg.stream = stream;
      cfg.attrs = &attr, cfg.numAttrs = 1;
      auto kernel = vec ? moe_wgmma_ws_kernel<C, GATE_UP, true, true> : moe_wgmma_ws_kernel<C, GATE_UP, false, true>;
      check_cuda(cudaLaunchKernelEx(&cfg, kernel, g, n_tiles, tile_counter, map), what);
      g_pair_launches.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
  } else {
    if (!weights_tensor_map(g, E, rows, WsLayout<C, GATE_UP>::BOX_ROWS, &map)) return false;  // one block per tile
    check_cuda(cudaMemsetAsync(tile_counter, 0, sizeof(int), stream), std::string(what) + " (tile counter)");
  }
  using L = WsLayout<C, GATE_UP>;
  const unsigned grid = unsigned(std::min(blocks, size_t(sms)));
  if (vec)
    moe_wgmma_ws_kernel<C, GATE_UP, true><<<grid, L::THREADS, L::SMEM, stream>>>(g, n_tiles, tile_counter, map);
  else
    moe_wgmma_ws_kernel<C, GATE_UP, false><<<grid, L::THREADS, L::SMEM, stream>>>(g, n_tiles, tile_counter, map);
  check_cuda(cudaGetLastError(), what);
  g_ws_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// The warp-specialised kernels' tile counters (gemm 0: gate_up, 1: down): ints 2 and 3 of ws.num_tiles.
int* ws_counter(MoeWorkspace& ws, int gemm) { return static_cast<int*>(ws.num_tiles.p) + 2 + gemm; }

// The swap-AB kernels' weight map: [E][rows][K] (gate_up rows = 2 I, down rows = H) in boxes of 64 x 8 rows (gate_up:
// sixteen pairs of gate and up boxes per k-step) or 64 x 256 (down); false where TMA cannot load g's weights.
bool swap_map(const GroupedArgs& g, int E, int rows, bool gate_up, CUtensorMap* m) {
  return weights_tma_ok(g, E, rows) && weights_tensor_map(g, E, rows, gate_up ? 8 : SwapCfg::BW, m);
}

std::atomic<uint64_t> g_swap_launches{0};     // (moe_swap_ab_launches)
std::atomic<uint64_t> g_swap_5d_launches{0};  // gate_up launches on the 5-D map (printed by test_gpu_moe)

// gate_up's weights [E][2 I][H] as the 5-D view (H, 8, 2, I / 8, E): dimension 1 the row in an 8-row group (stride
// H), 2 gate or up (stride I H), 3 the group (stride 8 H), 4 the expert, in boxes of 64 x 8 x 2 x 16 x 1, which land
// as sixteen (8 gate rows, 8 up rows) pairs: the 32 boxes of swap_map's 3-D map in one. False where the driver refuses
// it (its strides are not in increasing order) or I % 8 != 0; the caller then loads the 32 boxes.
bool swap_map_5d(const GroupedArgs& g, int E, CUtensorMap* m) {
  if (g.N % 8 || !weights_tma_ok(g, E, 2 * g.N)) return false;
  const uint64_t K = uint64_t(g.K), I = uint64_t(g.N);
  return encode_bf16_map_5d(m, g.B, {K, 8, 2, I / 8, uint64_t(E)},
                            {K * 2, I * K * 2, 8 * K * 2, uint64_t(g.b_expert_stride) * 2}, {64, 8, 2, 16, 1});
}

// moe_swap_ws_kernel over grid_m m-tiles (an upper bound, kSwapBM rows each) of expert weights with `rows` rows each:
// one block per SM at most. std::runtime_error where the driver makes no tensor map (swap_ab_supported said it would).
template <bool GATE_UP>
void launch_swap(const GroupedArgs& g, int E, int rows, size_t grid_m, int* tile_counter, int sms,
                 cudaStream_t stream, const char* what) {
  CUtensorMap map;
  static CandidateSwitch one_box("HYPIC_MOE_SWAP_5D");
  const bool five = GATE_UP && one_box.on() && swap_map_5d(g, E, &map);
  if (!five && !swap_map(g, E, rows, GATE_UP, &map))
    throw std::runtime_error(std::string(what) + ": the driver made no tensor map of the expert weights");
  if (five) g_swap_5d_launches.fetch_add(1, std::memory_order_relaxed);
  const int wblocks = (g.N + swap_cols<GATE_UP>() - 1) / swap_cols<GATE_UP>();
  const size_t tiles = grid_m * size_t(wblocks);
  if (tiles > size_t(INT_MAX))
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(tiles) + " tiles do not fit a counter");
  check_cuda(cudaMemsetAsync(tile_counter, 0, sizeof(int), stream), std::string(what) + " (tile counter)");
  const unsigned grid = unsigned(std::max<size_t>(1, std::min(tiles, size_t(sms))));
  moe_swap_ws_kernel<GATE_UP>
      <<<grid, SwapCfg::THREADS, SwapCfg::SMEM, stream>>>(g, wblocks, tile_counter, map, five ? 1 : 0);
  check_cuda(cudaGetLastError(), what);
  g_swap_launches.fetch_add(1, std::memory_order_relaxed);
}

// launch_tiles with the vector epilogue (vec) or the m16n8 pairs.
template <class C, bool GATE_UP>
void launch_one(const GroupedArgs& g, size_t grid_m, Sched sched, bool vec, int sms, cudaStream_t stream,
                const char* what) {
  if (vec)
    launch_tiles<C, GATE_UP, true>(g, grid_m, sched, sms, stream, what);
  else
    launch_tiles<C, GATE_UP, false>(g, grid_m, sched, sms, stream, what);
}

// The vector epilogue (vec_col_of_row) where HYPIC_MOE_EPILOGUE_VEC (a candidate, switches.h) is on and both outputs
// start on 16 bytes (N % 8 == 0 is wgmma_supported's).
bool use_vec_epilogue(const MoeWorkspace& ws) {
  static CandidateSwitch on("HYPIC_MOE_EPILOGUE_VEC");
  return on.on() && reinterpret_cast<uintptr_t>(ws.act.p) % 16 == 0 && reinterpret_cast<uintptr_t>(ws.y.p) % 16 == 0;
}

}  // namespace

bool wgmma_device() { return current_device_is_sm90(); }

uint64_t persistent_launches() { return g_persistent_launches.load(std::memory_order_relaxed); }

uint64_t ws_launches() { return g_ws_launches.load(std::memory_order_relaxed); }

uint64_t pair_launches() { return g_pair_launches.load(std::memory_order_relaxed); }

uint64_t swap_launches() { return g_swap_launches.load(std::memory_order_relaxed); }

uint64_t swap_5d_launches() { return g_swap_5d_launches.load(std::memory_order_relaxed); }

// Whether both swap-AB instantiations start with enough registers per thread for their setmaxnreg split (asked once
// per process; a toolkit or flags that gave them fewer would make setmaxnreg.inc wait for ever).
bool swap_regs_ok() {
  static const bool ok = [] {
    for (const void* k : {reinterpret_cast<const void*>(moe_swap_ws_kernel<true>),
                          reinterpret_cast<const void*>(moe_swap_ws_kernel<false>)}) {
      cudaFuncAttributes attr{};
      if (cudaFuncGetAttributes(&attr, k) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
      }
      if (attr.numRegs * SwapCfg::THREADS < kSwapSetmaxnregRegs) return false;
    }
    return true;
  }();
  return ok;
}

bool swap_ab_supported(const MoeWeightsView& w) {
  if (!swap_regs_ok()) return false;
  GroupedArgs gu{}, dn{};
  gu.B = w.experts_gate_up, gu.b_expert_stride = size_t(2) * w.I * w.H, gu.K = w.H, gu.N = w.I;
  dn.B = w.experts_down, dn.b_expert_stride = size_t(w.H) * w.I, dn.K = w.I, dn.N = w.H;
  CUtensorMap m;
  return w.H % 2 == 0 && w.I % 2 == 0 && swap_map(gu, w.E, 2 * w.I, true, &m) && swap_map(dn, w.E, w.H, false, &m);
}

bool wgmma_supported(const MoeWeightsView& w, size_t P) {
  if (w.H % 8 || w.I % 8 || w.H % 2 || w.I % 2) return false;
  const size_t grid_m = max_tiles(P, w.E, 64);  // (the 64-row schedule's bound covers the 128-row one)
  const size_t n1 = size_t((w.I + GateUpCfg::BN / 2 - 1) / (GateUpCfg::BN / 2));
  const size_t n2 = size_t((w.H + Down128Cfg::BN - 1) / Down128Cfg::BN);  // the most down n-tiles of the variants
  return grid_m * std::max(n1, n2) <= size_t(INT_MAX);
}

int wgmma_env_mode() {
  static const int mode = [] {
    const char* v = std::getenv("HYPIC_MOE_WGMMA");
    if (!v) return 1;
    const std::string s(v);
    for (const char* known : {"0", "2", "3", "4", "5", "6", "7", "8", "9"})
      if (s == known) return std::atoi(known);
    return 1;  // (unset, "1" or anything else: the default)
  }();
  return mode;
}

int wgmma_bm(size_t P, int E, int variant) {
  return (variant == 1 || variant == 9) && P < size_t(kWgmmaSmallRowsPerExpert) * size_t(E) ? 64 : kWgmmaBM;
}

void launch_wgmma(const MoeWeightsView& w, size_t P, const bf16* x, MoeWorkspace& ws, int variant, int bm,
                  bool tail64, bool swap, cudaStream_t stream) {
  static DeviceOnce once;
  const int sms = once.run(current_device(), setup_device);
  if (swap) {  // the swap-AB kernels (moe.cu own_wgmma_swap chose them)
    if (bm != kSwapBM || tail64)
      throw std::logic_error("launch_wgmma: the swap-AB kernels on a " + std::to_string(bm) + "-row schedule" +
                             (tail64 ? " with tail tiles" : ""));
    const size_t grid_m = max_tiles(P, w.E, kSwapBM);
    launch_swap<true>(gate_up_args(w, x, ws), w.E, 2 * w.I, grid_m, ws_counter(ws, 0), sms, stream,
                      "moe_forward: swap-AB wgmma gate_up GEMM launch");
    launch_swap<false>(down_args(w, ws), w.E, w.H, grid_m, ws_counter(ws, 1), sms, stream,
                       "moe_forward: swap-AB wgmma down GEMM launch");
    return;
  }
  if (bm != 64 && bm != kWgmmaBM) throw std::invalid_argument("launch_wgmma: bm " + std::to_string(bm));
  if (tail64 && bm != kWgmmaBM) throw std::invalid_argument("launch_wgmma: tail tiles with bm " + std::to_string(bm));
  const bool vec = use_vec_epilogue(ws);
  if (bm == 64) {  // variant 9: on the warp-specialised blocks (each falls back to one block per tile without TMA)
    const size_t grid_m = max_tiles(P, w.E, 64);
    const GroupedArgs g1 = gate_up_args(w, x, ws), g2 = down_args(w, ws);
    if (variant != 9 || !launch_ws<GateUpSmallCfg, true>(g1, w.E, 2 * w.I, grid_m, vec, false, ws_counter(ws, 0), sms,
                                                          stream, "moe_forward: warp-specialised wgmma gate_up GEMM "
                                                                  "launch (64-row tiles)"))
      launch_one<GateUpSmallCfg, true>(g1, grid_m, Sched::kPerTile, vec, sms, stream,
                                       "moe_forward: wgmma gate_up GEMM launch (64-row tiles)");
    if (variant != 9 || !launch_ws<DownSmallCfg, false>(g2, w.E, w.H, grid_m, vec, false, ws_counter(ws, 1), sms,
                                                         stream, "moe_forward: warp-specialised wgmma down GEMM launch "
                                                                 "(64-row tiles)"))
      launch_one<DownSmallCfg, false>(g2, grid_m, Sched::kPerTile, vec, sms, stream,
                                      "moe_forward: wgmma down GEMM launch (64-row tiles)");
    return;
  }
  const Sched sched = variant == 3 || variant == 4            ? Sched::kPersistent
                      : variant == 6 || variant == 7 || variant == 8 ? Sched::kWarpSpecialized
                                                                     : Sched::kPerTile;
  const bool pair = variant == 7;
  const bool down_128 = variant == 2 || variant == 4;
  const size_t grid_m = max_tiles(P, w.E, kWgmmaBM);
  const GroupedArgs g1 = gate_up_args(w, x, ws);
  // The tail list (tail64): the same GEMMs over its tiles on the 64 x 256 kernels, at most one tile per expert.
  const size_t tail_m = std::min(P, size_t(w.E));
  auto tail = [&](GroupedArgs g) {
    g.tiles += tail_tiles_at(P, w.E);
    g.num_tiles += 1;
    return g;
  };
  const bool ws_on = sched == Sched::kWarpSpecialized;  // (falls back to one block per tile where TMA cannot load)
  const bool ws_down = ws_on && variant != 8;           // (variant 8: gate_up only)
  const Sched tiles_sched = ws_on ? Sched::kPerTile : sched;
  if (!ws_on || !launch_ws<GateUpCfg, true>(g1, w.E, 2 * w.I, grid_m, vec, pair, ws_counter(ws, 0), sms, stream,
                                             "moe_forward: warp-specialised wgmma gate_up GEMM launch"))
    launch_one<GateUpCfg, true>(g1, grid_m, tiles_sched, vec, sms, stream, "moe_forward: wgmma gate_up GEMM launch");
  if (tail64)
    launch_one<GateUpSmallCfg, true>(tail(g1), tail_m, Sched::kPerTile, vec, sms, stream,
                                     "moe_forward: wgmma gate_up GEMM launch (tail tiles)");
  const GroupedArgs g2 = down_args(w, ws);
  if (down_128)
    launch_one<Down128Cfg, false>(g2, grid_m, sched, vec, sms, stream, "moe_forward: wgmma down GEMM launch (128)");
  else if (!ws_down || !launch_ws<DownCfg, false>(g2, w.E, w.H, grid_m, vec, pair, ws_counter(ws, 1), sms, stream,
                                                "moe_forward: warp-specialised wgmma down GEMM launch"))
    launch_one<DownCfg, false>(g2, grid_m, tiles_sched, vec, sms, stream, "moe_forward: wgmma down GEMM launch");
  if (tail64)
    launch_one<DownSmallCfg, false>(tail(g2), tail_m, Sched::kPerTile, vec, sms, stream,
                                    "moe_forward: wgmma down GEMM launch (tail tiles)");
}

}  // namespace hypic::kernels::cuda::moe_detail
