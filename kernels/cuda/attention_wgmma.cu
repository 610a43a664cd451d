// The long-group path of attention_prefill on Hopper's warpgroup tensor-core instructions (sm_90a: wgmma.mma_async
// with shared-memory descriptors), in the manner of FlashAttention-3 (Shah et al. 2024, section 3.1, without its
// warp specialization): a block takes a 128-row query tile of one head (two warpgroups of 64 rows) and walks the
// 64-slot KV tiles (one page each) of its group up to the causal diagonal. S = Q K^T is one m64n64k16 wgmma per 16
// head dims with Q and K read from shared memory; P stays in registers (the accumulator layout is the A-fragment
// layout) for O += P V, m64n{HD}k16 wgmmas with V read N-major from shared memory. K and V are double buffered with
// cp.async; Q and every tile are stored in the 128-byte-swizzled layout the descriptors name (PTX ISA,
// "Shared Memory Matrix Layout", K-major and MN-major 128B swizzling). The softmax, masking and epilogue are
// attention_common.cuh's, so rows, numerics and the gate are those of attn_prefill_kernel (attention.cu); only
// the fp32 summation order inside the tensor-core products differs.
//
// The split path of attention_prefill with a workspace (short groups over long contexts: a splice's seam windows and
// query) has its wgmma kernel here too (attn_split_wgmma_kernel, below).
//
// Built for sm_90a only (kernels/cuda/CMakeLists.txt); attention.cu calls it on compute capability 9.0 devices.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/wgmma.cuh"

namespace hypic::kernels::cuda::detail {
namespace {

using namespace sm90;

template <int HD>
struct WgmmaCfg {
  static constexpr int kWarpgroups = 2;
  static constexpr int kThreads = 128 * kWarpgroups;
  static constexpr int kBM = 64 * kWarpgroups;          // query rows per block
  static constexpr int kUnits = HD / 8;                 // 16-byte units per row
  static constexpr int kQBytes = kBM * HD * 2;
  static constexpr int kTileBytes = kBN * HD * 2;       // one K or one V tile
  static constexpr int kVBufs = 2;
  static constexpr int kSmem = kQBytes + (2 + kVBufs) * kTileBytes + 1024;  // + slack for the 1024-byte alignment
};
static_assert(WgmmaCfg<256>::kSmem <= 227 * 1024, "wgmma prefill smem");

// Byte offset of 16-byte unit `unit` (head dims 8 unit .. 8 unit + 7) of row `row` in a [ROWS][HD] bf16 tile stored
// as HD / 64 column chunks of [ROWS][128 bytes], the unit's position within its 128-byte row XOR-ed with row % 8
// (the 128-byte swizzle: chunks start on 1024-byte boundaries since ROWS % 8 == 0).
template <int ROWS>
__device__ __forceinline__ uint32_t sw128(int row, int unit) {
  return static_cast<uint32_t>((unit >> 3) * (ROWS * 128) + row * 128 + (((unit & 7) ^ (row & 7)) << 4));
}

// d (64 x 32 fp32, accumulator layout) = (scale_d ? d : 0) + A (64 x 16, K-major in shared memory, descriptor da)
// * B (16 x 32, K-major in shared memory, descriptor db): wgmma.mma_async m64n32k16, bf16 in, fp32 accumulate.
// Issued, not waited for.
__device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[4][4], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db), "r"(scale_d));
}

// d (64 x 256 fp32, accumulator layout) += A (64 x 16 bf16 in registers, the mma.m16n8k16 A-fragment layout per
// warp) * B (16 x 256, MN-major in shared memory, descriptor db): wgmma.mma_async m64n256k16 with trans-b. Issued,
// not waited for.
__device__ __forceinline__ void wgmma_m64n256k16_rs_tb(float (&d)[32][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

template <int HD>
__device__ __forceinline__ void wgmma_pv(float (&o)[HD / 8][4], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (HD == 256)
    wgmma_m64n256k16_rs_tb(o, a, db);
  else
    wgmma_m64n128k16_rs_tb(o, a, db);
}

// K and V of KV tile `tile` into the swizzled buffers at sK / sV; slots beyond last_slot are zero-filled.
template <int HD>
__device__ __forceinline__ void load_kv_tile_sw(unsigned char* sK, unsigned char* sV, const AttnParams& p,
                                                const int* bt, int tile, int last_slot, int kvh, int tid) {
  using C = WgmmaCfg<HD>;
  const int slot_base = tile * kBN;
  const size_t page_row0 = static_cast<size_t>(bt[tile]) * kBN;
  static_assert((kBN * C::kUnits) % C::kThreads == 0, "whole passes");
#pragma unroll
  for (int it = 0; it < kBN * C::kUnits / C::kThreads; ++it) {
    const int i = tid + it * C::kThreads, r = i / C::kUnits, u = i % C::kUnits;
    const uint32_t so = sw128<kBN>(r, u);
    if (slot_base + r <= last_slot) {
      const size_t off = ((page_row0 + r) * p.num_kv_heads + kvh) * HD + u * 8;
      cp_async16(sK + so, p.k_pool + off);
      cp_async16(sV + so, p.v_pool + off);
    } else {
      *reinterpret_cast<uint4*>(sK + so) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(sV + so) = make_uint4(0, 0, 0, 0);
    }
  }
}

// Grid and skipping as attn_prefill_kernel: (num_heads, num_groups, query tiles counted from the last one).
template <int HD, bool kSkipSplit>
__global__ void __launch_bounds__(WgmmaCfg<HD>::kThreads, 1)
    attn_prefill_wgmma_kernel(const AttnParams p, int split_max_q) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = WgmmaCfg<HD>;
  constexpr int kBM = C::kBM;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sQ = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* sK0 = sQ + C::kQBytes;           // K buffers 0, 1
  unsigned char* sV0 = sK0 + 2 * C::kTileBytes;   // V buffers 0 .. kVBufs - 1

  PrefillTile t;
  if (!prefill_tile<kBM, kSkipSplit>(p, split_max_q, t)) return;
  const int h = t.h, qs = t.qs, len = t.len, m0 = t.m0, s0 = t.s0, rows = t.rows, last_slot = t.last_slot;
  const int n_tiles = t.n_tiles, kvh = t.kvh;
  const int* bt = t.bt;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;

  // Q tile (rows past the group: zeros) and KV tile 0: one commit group.
  {
    const bf16* q0 = p.q + (static_cast<size_t>(qs + m0) * p.num_heads + h) * HD;
#pragma unroll 4
    for (int it = 0; it < kBM * C::kUnits / C::kThreads; ++it) {
      const int i = tid + it * C::kThreads, r = i / C::kUnits, u = i % C::kUnits;
      unsigned char* dst = sQ + sw128<kBM>(r, u);
      if (r < rows)
        cp_async16(dst, q0 + static_cast<size_t>(r) * p.num_heads * HD + u * 8);
      else
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
  load_kv_tile_sw<HD>(sK0, sV0, p, bt, 0, last_slot, kvh, tid);
  cp_async_commit();

  float o[HD / 8][4];
#pragma unroll
  for (int dt = 0; dt < HD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int g = lane >> 2, c2 = (lane & 3) * 2;
  const int wq0 = m0 + warp * 16;  // group-local query of the warp's row 0 (warpgroup wg holds rows 64 wg ..)
  const bool wg_active = m0 + wg * 64 < len;
  // KV tiles the warpgroup computes: 0 .. n_wg - 1 (the rest lie above its last row's diagonal).
  const int n_wg = min(n_tiles, (s0 + m0 + wg * 64 + 63) / kBN + 1);
  const int wlim_lo = s0 + wq0;
  const int lim0 = wlim_lo + g, lim1 = lim0 + 8;
  const uint32_t q_addr = smem_addr(sQ) + wg * 64 * 128;
  uint32_t pa[4][4];  // P of the tile, bf16 A fragments of the P.V product

  // O += P V_t: V of tile t from its buffer; N spans the HD / 64 column chunks, 16 slots per wgmma.
  auto issue_pv = [&](int t) {
    const uint32_t v_addr = smem_addr(sV0) + (t % C::kVBufs) * C::kTileBytes;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_pv<HD>(o, pa[kk], sw128_desc(v_addr + kk * 16 * 128, kBN * 128, 1024));
  };

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles)
      load_kv_tile_sw<HD>(sK0 + ((j + 1) & 1) * C::kTileBytes, sV0 + ((j + 1) % C::kVBufs) * C::kTileBytes, p, bt,
                          j + 1, last_slot, kvh, tid);
    cp_async_commit();
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    const int n0 = j * kBN;
    if (wg_active && j < n_wg) {  // warpgroup-uniform: wgmma needs all 128 threads
      const uint32_t k_addr = smem_addr(sK0) + (j & 1) * C::kTileBytes;
      float s[8][4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        const uint64_t da = sw128_desc(q_addr + (kk >> 2) * (kBM * 128) + (kk & 3) * 32, 16, 1024);
        const uint64_t db = sw128_desc(k_addr + (kk >> 2) * (kBN * 128) + (kk & 3) * 32, 16, 1024);
        wgmma_m64n64k16_ss(s, da, db, kk > 0);
      }
      wgmma_commit();
      float alpha[2];
      wgmma_wait<0>();
      pin<8>(s);
      softmax_tile<8>(s, pa, m, l, alpha, p.scale_log2, n0 + kBN - 1 > wlim_lo, n0, c2, lim0, lim1);
      rescale_rows<HD / 8>(o, alpha);
      pin<HD / 8>(o);
      wgmma_fence();
      issue_pv(j);
      wgmma_commit();
      wgmma_wait<0>();
      pin<HD / 8>(o);
    }
    __syncthreads();  // the buffers of tile j are refilled by the next iteration's prefetch
  }
  cp_async_wait<0>();
  if (wq0 < len) write_prefill_rows<HD>(p, o, l, qs, wq0, len, h, lane);
#else
  __trap();  // built for sm_90a only; launch_prefill_wgmma checks the device
#endif
}

// ---- Warp-specialised variant (FlashAttention-3 section 3.1: producer warpgroup + two consumer warpgroups in
// ping-pong) ---------------------------------------------------------------------------------------------------
// Warpgroup 0 only loads: K and V of each KV tile into a ring of kStages stages (cp.async, 128 threads; slots past
// the tile's last visible one zero-filled by the same cp.async), each stage's K and V signalled on their own
// mbarrier when the copies complete (cp.async.mbarrier.arrive). Warpgroups 1 and 2 each own 64 query rows and
// take turns on the tensor cores: in turn i a consumer issues O += P_{i-1} V_{i-1} and S_i = Q K_i^T back to back,
// hands the turn to the other consumer (named barriers), waits for its products, frees the stage of tile i-1 (its
// own mbarrier per stage) and runs the softmax of tile i while the other consumer's products run. Per tile the
// arithmetic and its order are those of attn_prefill_wgmma_kernel, so both give the same bits.
template <int HD>
struct WsCfg {
  static constexpr int kStages = HD == 256 ? 2 : 4;
  static constexpr int kThreads = 384;
  static constexpr int kBM = 128;
  static constexpr int kUnits = HD / 8;
  static constexpr int kQBytes = kBM * HD * 2;
  static constexpr int kTileBytes = kBN * HD * 2;
  static constexpr int kBarBytes = 6 * kStages * 8;  // full_k, full_v, empty_k and empty_v of each consumer
  static constexpr int kSmem = kQBytes + 2 * kStages * kTileBytes + kBarBytes + 1024;
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;  // 128 (40 + 2 x 232) <= 64K registers
};
static_assert(WsCfg<256>::kSmem <= 227 * 1024 && WsCfg<128>::kSmem <= 227 * 1024, "ws prefill smem");

// kOverlap (FlashAttention-3 section 3.2, intra-warpgroup overlap): in turn i, S_i is issued first and waited for
// alone, so the softmax of tile i runs while P_{i-1} V_{i-1} is still on the tensor cores; P alternates between two
// register tiles (the in-flight product reads the other one), and O is rescaled once the product is done.
template <int HD, bool kSkipSplit, bool kOverlap>
__global__ void __launch_bounds__(WsCfg<HD>::kThreads, 1) attn_prefill_ws_kernel(const AttnParams p, int split_max_q) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = WsCfg<HD>;
  constexpr int S = C::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sQ = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* sK0 = sQ + C::kQBytes;            // K stages
  unsigned char* sV0 = sK0 + S * C::kTileBytes;    // V stages
  uint64_t* full_k = reinterpret_cast<uint64_t*>(sV0 + S * C::kTileBytes);
  uint64_t* full_v = full_k + S;
  uint64_t* empty_k = full_v + S;       // [consumer][stage]
  uint64_t* empty_v = empty_k + 2 * S;  // [consumer][stage]

  PrefillTile t;
  if (!prefill_tile<C::kBM, kSkipSplit>(p, split_max_q, t)) return;
  const int tid = threadIdx.x, wg = tid >> 7;
  if (tid == 0) {
    for (int i = 0; i < 6 * S; ++i) mbar_init(full_k + i, 128);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // KV tiles consumer c computes: 0 .. n_c - 1 (the rest lie above its last row's diagonal); 0 when its rows are
  // past the group. Turns: n_c + 1 (the last one only adds P V of the last tile); both consumers take the same
  // number of turns so that the hand-overs pair up.
  int n_c[2], turns = 0;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    n_c[c] = t.m0 + c * 64 < t.len ? min(t.n_tiles, (t.s0 + t.m0 + c * 64 + 63) / kBN + 1) : 0;
    turns = max(turns, n_c[c] > 0 ? n_c[c] + 1 : 0);
  }

  if (wg == 0) {  // producer
    regs_dec<C::kProducerRegs>();
    const int n_load = max(n_c[0], n_c[1]);
    const uint32_t k_base = smem_addr(sK0), v_base = smem_addr(sV0);
    for (int j = 0; j < n_load; ++j) {
      const int st = j % S;
      const int slot_base = j * kBN;
      const size_t page_row0 = static_cast<size_t>(t.bt[j]) * kBN;
#pragma unroll
      for (int kv = 0; kv < 2; ++kv) {
        if (j >= S)  // the consumers that computed tile j - S are done with its K (V) stage
#pragma unroll
          for (int c = 0; c < 2; ++c)
            if (j - S < n_c[c]) mbar_wait((kv ? empty_v : empty_k) + c * S + st, ((j - S) / S) & 1);
        const bf16* pool = kv ? p.v_pool : p.k_pool;
        const uint32_t base = (kv ? v_base : k_base) + st * C::kTileBytes;
#pragma unroll 4
        for (int it = 0; it < kBN * C::kUnits / 128; ++it) {
          const int i = tid + it * 128, r = i / C::kUnits, u = i % C::kUnits;
          const bool live = slot_base + r <= t.last_slot;
          const bf16* src = pool + (live ? ((page_row0 + r) * p.num_kv_heads + t.kvh) * HD + u * 8 : 0);
          cp_async16_zfill(base + sw128<kBN>(r, u), src, live ? 16 : 0);
        }
        cp_async_mbar_arrive(kv ? full_v + st : full_k + st);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  regs_inc<C::kConsumerRegs>();
  const int c = wg - 1, ct = tid - 128 * wg, warp = ct >> 5, lane = tid & 31;
  const int h = t.h, qs = t.qs, len = t.len, m0 = t.m0, s0 = t.s0, rows = t.rows;
  {  // this consumer's 64 rows of the Q tile (rows past the group: zeros)
    const bf16* q0 = p.q + (static_cast<size_t>(qs + m0) * p.num_heads + h) * HD;
#pragma unroll 4
    for (int it = 0; it < 64 * C::kUnits / 128; ++it) {
      const int i = ct + it * 128, r = c * 64 + i / C::kUnits, u = i % C::kUnits;
      unsigned char* dst = sQ + sw128<C::kBM>(r, u);
      if (r < rows)
        cp_async16(dst, q0 + static_cast<size_t>(r) * p.num_heads * HD + u * 8);
      else
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    named_sync(3 + c, 128);
  }
  const int n = c == 0 ? n_c[0] : n_c[1];
  float o[HD / 8][4];
#pragma unroll
  for (int dt = 0; dt < HD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float s[8][4];
  uint32_t pa[4][4], pb[4][4];  // P of the last softmax'd tiles (pb: kOverlap only), bf16 A fragments of P.V
  const int g = lane >> 2, c2 = (lane & 3) * 2;
  const int wq0 = m0 + c * 64 + warp * 16;  // group-local query of the warp's row 0
  const int wlim_lo = s0 + wq0;
  const int lim0 = wlim_lo + g, lim1 = lim0 + 8;
  const uint32_t q_addr = smem_addr(sQ) + c * 64 * 128;
  // Turn hand-over: consumer c waits on barrier 1 + c; consumer 1 opens consumer 0's first turn. Turn i issues
  // P_{i-1} V_{i-1} (i >= 1) and S_i (i < n); turns past n + 1 (the other consumer has more tiles) only hand over.
  auto begin_turn = [&] { named_sync(1 + c, 256); };
  auto end_turn = [&](int i) {
    if (c == 0 || i + 1 < turns) named_arrive(2 - c, 256);
  };
  auto issue_pv_from = [&](const uint32_t(&a)[4][4], int tile) {
    const uint32_t v_addr = smem_addr(sV0) + (tile % S) * C::kTileBytes;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_pv<HD>(o, a[kk], sw128_desc(v_addr + kk * 16 * 128, kBN * 128, 1024));
  };
  auto issue_pv = [&](int tile) { issue_pv_from(pa, tile); };
  auto issue_s = [&](int tile) {
    const uint32_t k_addr = smem_addr(sK0) + (tile % S) * C::kTileBytes;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint64_t da = sw128_desc(q_addr + (kk >> 2) * (C::kBM * 128) + (kk & 3) * 32, 16, 1024);
      const uint64_t db = sw128_desc(k_addr + (kk >> 2) * (kBN * 128) + (kk & 3) * 32, 16, 1024);
      wgmma_m64n64k16_ss(s, da, db, kk > 0);
    }
  };
  auto softmax = [&](int tile) {
    const int n0 = tile * kBN;
    float alpha[2];
    softmax_tile<8>(s, pa, m, l, alpha, p.scale_log2, n0 + kBN - 1 > wlim_lo, n0, c2, lim0, lim1);
    rescale_rows<HD / 8>(o, alpha);
    pin<HD / 8>(o);
  };
  auto wait_k = [&](int tile) { mbar_wait(full_k + tile % S, (tile / S) & 1); };
  auto wait_v = [&](int tile) { mbar_wait(full_v + tile % S, (tile / S) & 1); };
  // K of a tile is free once its S is computed, V once its P V is.
  auto release_k = [&](int tile) { mbar_arrive(empty_k + c * S + tile % S); };
  auto release_v = [&](int tile) { mbar_arrive(empty_v + c * S + tile % S); };
  if (c == 1) named_arrive(1, 256);
  int i = 0;
  if (n > 0) {
    wait_k(0);
    fence_proxy_async();  // the stages were written by cp.async (generic proxy)
    begin_turn();
    wgmma_fence();
    issue_s(0);
    wgmma_commit();
    end_turn(0);
    wgmma_wait<0>();
    pin<8>(s);
    release_k(0);
    softmax(0);
    // Turn i of the overlapped schedule: P_i into `cur` while P_{i-1} V_{i-1} reads `prev`.
    auto overlap_turn = [&](int i, uint32_t(&cur)[4][4], uint32_t(&prev)[4][4]) {
      wait_k(i);
      wait_v(i - 1);
      fence_proxy_async();
      begin_turn();
      wgmma_fence();
      issue_s(i);
      wgmma_commit();
      issue_pv_from(prev, i - 1);
      wgmma_commit();
      end_turn(i);
      wgmma_wait<1>();  // S_i (groups complete in order)
      pin<8>(s);
      release_k(i);
      const int n0 = i * kBN;
      float alpha[2];
      softmax_tile<8>(s, cur, m, l, alpha, p.scale_log2, n0 + kBN - 1 > wlim_lo, n0, c2, lim0, lim1);
      wgmma_wait<0>();  // P_{i-1} V_{i-1}
      pin<HD / 8>(o);
      pin_u<4>(prev);  // read by the product until here: not reused before
      release_v(i - 1);
      rescale_rows<HD / 8>(o, alpha);
      pin<HD / 8>(o);
    };
    if (kOverlap) {
      for (i = 1; i + 1 < n; i += 2) {
        overlap_turn(i, pb, pa);
        overlap_turn(i + 1, pa, pb);
      }
      if (i < n) {  // one more (odd) tile: its P lands in pb; the last product reads pa
        overlap_turn(i, pb, pa);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int e = 0; e < 4; ++e) pa[kk][e] = pb[kk][e];
      }
    }
    for (i = 1; !kOverlap && i < n; ++i) {
      wait_k(i);
      wait_v(i - 1);
      fence_proxy_async();
      begin_turn();
      wgmma_fence();
      issue_pv(i - 1);
      issue_s(i);
      wgmma_commit();
      end_turn(i);
      wgmma_wait<0>();
      pin<HD / 8>(o);
      pin<8>(s);
      release_v(i - 1);
      release_k(i);
      softmax(i);
    }
    wait_v(n - 1);
    fence_proxy_async();
    begin_turn();
    wgmma_fence();
    issue_pv(n - 1);
    wgmma_commit();
    end_turn(n);
    wgmma_wait<0>();
    pin<HD / 8>(o);
    release_v(n - 1);
    i = n + 1;
  }
  for (; i < turns; ++i) {
    begin_turn();
    end_turn(i);
  }
  if (n > 0 && wq0 < len) write_prefill_rows<HD>(p, o, l, qs, wq0, len, h, lane);
#else
  __trap();  // built for sm_90a only; launch_prefill_wgmma checks the device
#endif
}

// Which Hopper kernel runs the long groups: HYPIC_ATTN_WGMMA unset or "1": the single-role one
// (attn_prefill_wgmma_kernel); "2": the warp-specialised one (attn_prefill_ws_kernel); "3": the same with the
// intra-warpgroup overlap; "0": none (attention.cu's mma.sync kernel, for comparisons).
int prefill_variant() {
  static const int v = [] {
    const char* e = std::getenv("HYPIC_ATTN_WGMMA");
    if (!e) return 1;
    const std::string s(e);
    return s == "0" ? 0 : s == "2" ? 2 : s == "3" ? 3 : 1;
  }();
  return v;
}

template <typename Cfg, typename Kernel>
void launch_kernel(Kernel kernel, const AttnParams& p, int num_groups, int max_q, int split_max_q,
                   cudaStream_t stream) {
  const dim3 grid(p.num_heads, num_groups, static_cast<unsigned>((max_q + Cfg::kBM - 1) / Cfg::kBM));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(p, split_max_q);
}

template <int HD>
void launch_hd(const AttnParams& p, int num_groups, int max_q, int split_max_q, cudaStream_t stream) {
  using C = WgmmaCfg<HD>;
  using W = WsCfg<HD>;
  static DeviceOnce once;
  once.run(current_device(), [](int) {
    const std::string hd = std::to_string(HD);
    auto allow = [&](const void* fn, int bytes, const std::string& name) {
      check_cuda(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                 "cudaFuncSetAttribute(" + name + "<" + hd + ">)");
    };
    allow(reinterpret_cast<const void*>(attn_prefill_wgmma_kernel<HD, false>), C::kSmem, "attn_prefill_wgmma_kernel");
    allow(reinterpret_cast<const void*>(attn_prefill_wgmma_kernel<HD, true>), C::kSmem, "attn_prefill_wgmma_kernel");
    allow(reinterpret_cast<const void*>(attn_prefill_ws_kernel<HD, false, false>), W::kSmem, "attn_prefill_ws_kernel");
    allow(reinterpret_cast<const void*>(attn_prefill_ws_kernel<HD, true, false>), W::kSmem, "attn_prefill_ws_kernel");
    allow(reinterpret_cast<const void*>(attn_prefill_ws_kernel<HD, false, true>), W::kSmem, "attn_prefill_ws_kernel");
    allow(reinterpret_cast<const void*>(attn_prefill_ws_kernel<HD, true, true>), W::kSmem, "attn_prefill_ws_kernel");
    return 0;
  });
  const bool split = split_max_q > 0;
  if (prefill_variant() == 1)
    launch_kernel<C>(split ? attn_prefill_wgmma_kernel<HD, true> : attn_prefill_wgmma_kernel<HD, false>, p,
                     num_groups, max_q, split_max_q, stream);
  else if (prefill_variant() == 2)
    launch_kernel<W>(split ? attn_prefill_ws_kernel<HD, true, false> : attn_prefill_ws_kernel<HD, false, false>, p,
                     num_groups, max_q, split_max_q, stream);
  else
    launch_kernel<W>(split ? attn_prefill_ws_kernel<HD, true, true> : attn_prefill_ws_kernel<HD, false, true>, p,
                     num_groups, max_q, split_max_q, stream);
  check_cuda(cudaGetLastError(), "attention prefill (wgmma) <" + std::to_string(HD) + "> launch");
}

// ---- Split path (attention_prefill with a workspace: short groups over long contexts) ---------------------------
// One warpgroup per block, two or more blocks per SM; each block takes work items (group, KV head, 64-row tile of
// (query, head) rows, KV chunk) in the plan kernel's order (sa.order, attention.cu), exactly the items, partials and
// outputs of attn_split_kernel: Q of the tile (row r: query r / ratio at head kv_head * ratio + r % ratio) and the
// chunk's KV in 32-slot tiles (half a page; K and V double buffered, 128-byte swizzled), S = Q K^T by m64n32k16
// wgmmas from shared memory, P in registers for O += P V (m64n{HD}k16, V MN-major), the softmax, masking and rounding
// points of attention_common.cuh. Smaller KV tiles than the prefill kernel's so that two blocks of Q + 2 x (K, V)
// (97 KB at head_dim 256) share an SM and hide each other's waits.
template <int HD>
struct SplitWgCfg {
  static constexpr int kThreads = 128;
  static constexpr int kBM = kSplitBM;   // 64 rows: one warpgroup
  static constexpr int kBT = 32;         // KV slots per tile
  static constexpr int kUnits = HD / 8;  // 16-byte units per row
  static constexpr int kQBytes = kBM * HD * 2;
  static constexpr int kTileBytes = kBT * HD * 2;
  static constexpr int kSmem = kQBytes + 4 * kTileBytes + 1024;  // Q, K x 2, V x 2, + the 1024-byte alignment
  static constexpr int kMinBlocks = HD == 256 ? 2 : 3;
};
static_assert(2 * SplitWgCfg<256>::kSmem <= 227 * 1024, "two split blocks per SM");
static_assert(kBN % SplitWgCfg<256>::kBT == 0, "KV tiles within one page");

// K and V of the 32-slot tile `tile` (slots 32 tile .. 32 tile + 31, within page bt[32 tile / 64]) into the swizzled
// buffers by NT threads (tid < NT); slots beyond last_slot are zero-filled.
template <int HD, int NT = SplitWgCfg<HD>::kThreads>
__device__ __forceinline__ void load_kv32_sw(unsigned char* sK, unsigned char* sV, const AttnParams& p, const int* bt,
                                             int tile, int last_slot, int kvh, int tid) {
  using C = SplitWgCfg<HD>;
  const int slot_base = tile * C::kBT;
  const size_t row0 = static_cast<size_t>(bt[slot_base / kBN]) * kBN + slot_base % kBN;
  static_assert((C::kBT * C::kUnits) % NT == 0, "whole passes");
#pragma unroll
  for (int it = 0; it < C::kBT * C::kUnits / NT; ++it) {
    const int i = tid + it * NT, r = i / C::kUnits, u = i % C::kUnits;
    const uint32_t so = sw128<C::kBT>(r, u);
    if (slot_base + r <= last_slot) {
      const size_t off = ((row0 + r) * p.num_kv_heads + kvh) * HD + u * 8;
      cp_async16(sK + so, p.k_pool + off);
      cp_async16(sV + so, p.v_pool + off);
    } else {
      *reinterpret_cast<uint4*>(sK + so) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(sV + so) = make_uint4(0, 0, 0, 0);
    }
  }
}

// The 64 Q rows of split item w (rows past its valid ones: zeros) into the swizzled buffer sQ by one warpgroup
// (t = thread in the warpgroup); the caller commits.
template <int HD>
__device__ __forceinline__ void load_split_q(unsigned char* sQ, const AttnParams& p, const SplitItem& w, int t) {
  constexpr int kUnits = HD / 8;
#pragma unroll 4
  for (int it = 0; it < kSplitBM * kUnits / 128; ++it) {
    const int i = t + it * 128, r = i / kUnits, u = i % kUnits;
    unsigned char* dst = sQ + sw128<kSplitBM>(r, u);
    if (r < w.nrows) {
      const int R = w.R0 + r, qi = R / p.ratio, hh = R - qi * p.ratio;
      cp_async16(dst, p.q + (static_cast<size_t>(w.qs + qi) * p.num_heads + w.h0 + hh) * HD + u * 8);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
}

// s = Q K^T of a 32-slot tile: Q (64 rows) at q_addr, K at k_addr, both swizzled in shared memory; m64n32k16 wgmmas,
// issued, not committed.
template <int HD>
__device__ __forceinline__ void issue_s32(float (&s)[4][4], uint32_t q_addr, uint32_t k_addr) {
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    const uint64_t da = sw128_desc(q_addr + (kk >> 2) * (kSplitBM * 128) + (kk & 3) * 32, 16, 1024);
    const uint64_t db = sw128_desc(k_addr + (kk >> 2) * (32 * 128) + (kk & 3) * 32, 16, 1024);
    wgmma_m64n32k16_ss(s, da, db, kk > 0);
  }
}

// A warpgroup's 64-row tile of split item `item` (w) from its accumulators: the row sums l reduced over the quad,
// then each valid row's final output (one chunk) or the chunk's partial (m, l, acc) for the combine kernel.
template <int HD>
__device__ __forceinline__ void store_split_tile(const AttnParams& p, const SplitArgs& sa, const float (&o)[HD / 8][4],
                                                 const float (&m)[2], float (&l)[2], const SplitItem& w, int item,
                                                 int warp, int g, int c2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + r * 8;  // tile row
    if (row < w.nrows) split_store_row<HD>(p, sa, o, r, m[r], l[r], row, w.qs, w.R0, w.h0, w.n_c, item, c2);
  }
}

template <int HD>
__global__ void __launch_bounds__(SplitWgCfg<HD>::kThreads, SplitWgCfg<HD>::kMinBlocks)
    attn_split_wgmma_kernel(const AttnParams p, const SplitArgs sa) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = SplitWgCfg<HD>;
  constexpr int kBM = C::kBM, kBT = C::kBT;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sQ = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* sK0 = sQ + C::kQBytes;          // K buffers 0, 1
  unsigned char* sV0 = sK0 + 2 * C::kTileBytes;  // V buffers 0, 1
  __shared__ int s_item;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c2 = (lane & 3) * 2;
  for (;;) {
    if (tid == 0) s_item = atomicAdd(sa.counter, 1);
    __syncthreads();
    const int k = s_item;
    __syncthreads();  // s_item is rewritten at the next item
    const int total = sa.item_off[sa.num_groups];
    if (k >= total) break;
    const int item = sa.order[k];
    SplitItem wi;
    if (!split_item(p, sa, item, wi)) continue;
    const int s0 = wi.s0, R0 = wi.R0, kvh = wi.kvh;
    const int last_slot = wi.last_slot;
    const int j0 = wi.start / kBT;
    const int n_tiles = last_slot / kBT - j0 + 1;
    const int* bt = wi.bt;

    // Q rows (rows past the group: zeros) and KV tile j0: one commit group.
    static_assert(kBM == kSplitBM && C::kThreads == 128, "one warpgroup's 64-row tile");
    load_split_q<HD>(sQ, p, wi, tid);
    load_kv32_sw<HD>(sK0, sV0, p, bt, j0, last_slot, kvh, tid);
    cp_async_commit();

    float o[HD / 8][4];
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const int Rw = R0 + warp * 16;             // group row of the warp's row 0
    const int wlim_lo = s0 + Rw / p.ratio;     // last visible slot of the warp's first row
    const int lim0 = s0 + (Rw + g) / p.ratio, lim1 = s0 + (Rw + g + 8) / p.ratio;
    const uint32_t q_addr = smem_addr(sQ);
    uint32_t pa[2][4];  // P of the tile, bf16 A fragments of the P.V product

    for (int j = 0; j < n_tiles; ++j) {
      const int buf = j & 1;
      if (j + 1 < n_tiles)
        load_kv32_sw<HD>(sK0 + (buf ^ 1) * C::kTileBytes, sV0 + (buf ^ 1) * C::kTileBytes, p, bt, j0 + j + 1,
                         last_slot, kvh, tid);
      cp_async_commit();   // possibly empty group
      cp_async_wait<1>();  // tile j (and Q) landed
      fence_proxy_async();
      __syncthreads();
      const int n0 = (j0 + j) * kBT;
      const uint32_t k_addr = smem_addr(sK0) + buf * C::kTileBytes;
      const uint32_t v_addr = smem_addr(sV0) + buf * C::kTileBytes;
      float s[4][4];
      wgmma_fence();
      issue_s32<HD>(s, q_addr, k_addr);
      wgmma_commit();
      float alpha[2];
      wgmma_wait<0>();
      pin<4>(s);
      // Slots past last_slot (zero-filled) lie past every valid row's limit: masked whenever present.
      softmax_tile<4>(s, pa, m, l, alpha, p.scale_log2, n0 + kBT - 1 > wlim_lo, n0, c2, lim0, lim1);
      if (sa.skip_rescale)
        rescale_rows_if_moved<HD / 8>(o, alpha);
      else
        rescale_rows<HD / 8>(o, alpha);
      pin<HD / 8>(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBT / 16; ++kk) wgmma_pv<HD>(o, pa[kk], sw128_desc(v_addr + kk * 16 * 128, kBT * 128, 1024));
      wgmma_commit();
      wgmma_wait<0>();
      pin<HD / 8>(o);
      __syncthreads();  // buffer `buf` is refilled by the next iteration's prefetch
    }
    cp_async_wait<0>();

    // The tile's rows: final output (one chunk) or the chunk's partial (m, l, acc) for the combine kernel.
    store_split_tile<HD>(p, sa, o, m, l, wi, item, warp, g, c2);
    __syncthreads();  // sQ is overwritten by the next item
  }
#else
  __trap();  // built for sm_90a only; launch_split_wgmma checks the device
#endif
}

// ---- Paired split kernel (HYPIC_ATTN_SPLIT_PAIR) -------------------------------------------------------------------
// attn_split_wgmma_kernel reads each 32-slot K / V tile once per item: a splice's 15 seam windows and 64-token query
// over 32k slots move about 1 GB per layer from L2 into shared memory (23 row tiles per KV head, each over its whole
// context; 3.8 TB/s at the kernel's 284 us on an H100). Measured slower (bench/results/split_pair_h100.md: half the
// traffic, 381 against 347 us; that kernel is latency-bound, not L2-bound), kept as a candidate. Here a block of two
// warpgroups takes an entry of sa.pairs: two items of one KV head and chunk whose groups name the same pages there
// (attn_split_plan_kernel), warpgroup w the 64-row tile of item w, both multiplying the same K / V tiles, which the
// block's 256 threads load once by cp.async
// into rings of kKStages K and kVStages V tiles two tiles ahead (one block barrier per tile). The item with the later
// last slot leads: its block-table row and last slot name the tiles (slots past it zero-filled); the other warpgroup
// stops after its own last tile, and the lead's slots past its own last slot lie past every one of its rows' causal
// limits (masked as the zero-filled ones are). Per tile a warpgroup issues S_j = Q K_j^T and the previous tile's
// O += P_{j-1} V_{j-1} back to back, runs the softmax of tile j while the product runs, then rescales O
// (FlashAttention-3 section 3.2's intra-warpgroup overlap): O sees the same products, rescales and order as in
// attn_split_wgmma_kernel, so both give the same bits; items, partials and outputs are that kernel's.
template <int HD>
struct SplitPairCfg {
  static constexpr int kThreads = 256;       // two warpgroups
  static constexpr int kBT = 32;             // KV slots per tile
  static constexpr int kUnits = HD / 8;      // 16-byte units per row
  static constexpr int kQBytes = kSplitBM * HD * 2;  // one warpgroup's Q
  static constexpr int kTileBytes = kBT * HD * 2;
  static constexpr int kKStages = 3;         // K_j read, K_{j+1} landed or landing, K_{j+2} landing
  static constexpr int kVStages = 4;         // V_{j-1} read, V_j .. V_{j+2}
  static constexpr int kSmem = 2 * kQBytes + (kKStages + kVStages) * kTileBytes + 1024;
};
static_assert(SplitPairCfg<256>::kSmem <= 227 * 1024, "paired split smem");
static_assert(SplitPairCfg<256>::kBT == SplitWgCfg<256>::kBT && SplitWgCfg<256>::kBT == 32, "issue_s32's tiles");

template <int HD>
__global__ void __launch_bounds__(SplitPairCfg<HD>::kThreads, 1)
    attn_split_pair_kernel(const AttnParams p, const SplitArgs sa) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = SplitPairCfg<HD>;
  constexpr int kBT = C::kBT, KS = C::kKStages, VS = C::kVStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sQ0 = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* sK0 = sQ0 + 2 * C::kQBytes;         // K ring
  unsigned char* sV0 = sK0 + KS * C::kTileBytes;     // V ring
  __shared__ int s_entry;
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, warp = wtid >> 5, lane = tid & 31;
  const int g = lane >> 2, c2 = (lane & 3) * 2;
  unsigned char* sQ = sQ0 + wg * C::kQBytes;
  const uint32_t q_addr = smem_addr(sQ);
  const int entries = *sa.num_pairs;
  for (;;) {
    if (tid == 0) s_entry = atomicAdd(sa.counter, 1);
    __syncthreads();
    const int k = s_entry;
    __syncthreads();  // s_entry is rewritten at the next entry
    if (k >= entries) break;
    const int ia = sa.pairs[2 * k], ib = sa.pairs[2 * k + 1];
    SplitItem a, b;
    const bool has_a = split_item(p, sa, ia, a);  // (the plan enters only items with work: true)
    const bool has_b = ib >= 0 && split_item(p, sa, ib, b);
    if (!has_a) continue;  // (block-uniform)
    if (!has_b) b = a;
    const int j0 = a.start / kBT;  // (one chunk: the same first slot)
    const bool lead_b = has_b && b.last_slot > a.last_slot;
    const int last_slot = lead_b ? b.last_slot : a.last_slot;
    const int* bt = lead_b ? b.bt : a.bt;
    const int n = last_slot / kBT - j0 + 1;  // tiles the block loads
    const SplitItem w = wg == 0 ? a : b;  // (the same KV head and chunk as the other)
    const int item = wg == 0 ? ia : ib;
    const int nw = wg == 0 || has_b ? w.last_slot / kBT - j0 + 1 : 0;  // tiles this warpgroup computes

    // This warpgroup's Q rows (rows past its tile: zeros) and KV tile 0: one commit group; tile 1: the next.
    if (nw > 0) load_split_q<HD>(sQ, p, w, wtid);
    load_kv32_sw<HD, C::kThreads>(sK0, sV0, p, bt, j0, last_slot, a.kvh, tid);
    cp_async_commit();
    if (n > 1)
      load_kv32_sw<HD, C::kThreads>(sK0 + C::kTileBytes, sV0 + C::kTileBytes, p, bt, j0 + 1, last_slot, a.kvh, tid);
    cp_async_commit();

    float o[HD / 8][4];
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const int Rw = w.R0 + warp * 16;             // group row of the warp's row 0
    const int wlim_lo = w.s0 + Rw / p.ratio;     // last visible slot of the warp's first row
    const int lim0 = w.s0 + (Rw + g) / p.ratio, lim1 = w.s0 + (Rw + g + 8) / p.ratio;
    uint32_t pc[2][4], pp[2][4];  // P of this tile and of the previous one (read by the P V product in flight)
    // O += P_{t} V_{t} from pp, V of tile t from its ring slot.
    auto issue_pv = [&](int t) {
      const uint32_t v_addr = smem_addr(sV0) + (t % VS) * C::kTileBytes;
#pragma unroll
      for (int kk = 0; kk < kBT / 16; ++kk)
        wgmma_pv<HD>(o, pp[kk], sw128_desc(v_addr + kk * 16 * 128, kBT * 128, 1024));
    };

    for (int j = 0; j <= n; ++j) {
      cp_async_wait<1>();  // tile j (and at j = 0 the Q rows) landed for this thread
      fence_proxy_async();
      __syncthreads();     // ... for every thread; iteration j - 1 done: K_{j-1}'s and V_{j-2}'s slots are free
      if (j + 2 < n)
        load_kv32_sw<HD, C::kThreads>(sK0 + ((j + 2) % KS) * C::kTileBytes, sV0 + ((j + 2) % VS) * C::kTileBytes, p,
                                      bt, j0 + j + 2, last_slot, a.kvh, tid);
      cp_async_commit();   // possibly empty group
      if (j < nw) {        // warpgroup-uniform: S_j (+ P_{j-1} V_{j-1}), softmax of tile j, rescale
        const int n0 = (j0 + j) * kBT;
        const uint32_t k_addr = smem_addr(sK0) + (j % KS) * C::kTileBytes;
        float s[4][4];
        wgmma_fence();
        issue_s32<HD>(s, q_addr, k_addr);
        wgmma_commit();
        if (j > 0) {
          issue_pv(j - 1);
          wgmma_commit();
          wgmma_wait<1>();  // S_j (groups complete in order)
        } else {
          wgmma_wait<0>();
        }
        pin<4>(s);
        float alpha[2];
        // Slots past the lead's last slot (zero-filled) or this item's (the lead's data) lie past every valid row's
        // limit: masked whenever present.
        softmax_tile<4>(s, pc, m, l, alpha, p.scale_log2, n0 + kBT - 1 > wlim_lo, n0, c2, lim0, lim1);
        wgmma_wait<0>();  // P_{j-1} V_{j-1}
        pin<HD / 8>(o);
        pin_u<2>(pp);     // read by the product until here: rewritten below
        rescale_rows<HD / 8>(o, alpha);
        pin<HD / 8>(o);
#pragma unroll
        for (int kk = 0; kk < 2; ++kk)
#pragma unroll
          for (int e = 0; e < 4; ++e) pp[kk][e] = pc[kk][e];
      } else if (j == nw && nw > 0) {  // the last tile's P V
        wgmma_fence();
        issue_pv(j - 1);
        wgmma_commit();
        wgmma_wait<0>();
        pin<HD / 8>(o);
      }
    }
    cp_async_wait<0>();

    if (nw > 0) store_split_tile<HD>(p, sa, o, m, l, w, item, warp, g, c2);
    __syncthreads();  // Q and the rings are overwritten by the next entry
  }
#else
  __trap();  // built for sm_90a only; launch_split_pair checks the device
#endif
}

bool split_wgmma_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("HYPIC_ATTN_SPLIT_WGMMA");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

// Blocks of the persistent split kernel K (shared memory C::kSmem, C::kThreads threads) resident per SM, after its
// shared-memory opt-in; asked once per device, at least 1.
template <auto K, class C>
int split_blocks_setup(const std::string& name) {
  static DeviceOnce once;
  return once.run(current_device(), [&name](int) {
    check_cuda(cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem),
               "cudaFuncSetAttribute(" + name + ")");
    int blocks = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, K, C::kThreads, C::kSmem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor(" + name + ")");
    return std::max(blocks, 1);
  });
}

template <int HD>
int split_wgmma_setup() {
  return split_blocks_setup<attn_split_wgmma_kernel<HD>, SplitWgCfg<HD>>("attn_split_wgmma_kernel<" +
                                                                         std::to_string(HD) + ">");
}

// min(max_items, resident blocks) persistent blocks of K (config C) over sa's items.
template <auto K, class C>
void launch_split_persistent(const AttnParams& p, const SplitArgs& sa, long max_items, cudaStream_t stream,
                             const std::string& name) {
  const long resident = static_cast<long>(sm_count()) * split_blocks_setup<K, C>(name);
  const int grid = static_cast<int>(std::max(1L, std::min(max_items, resident)));
  K<<<grid, C::kThreads, C::kSmem, stream>>>(p, sa);
  check_cuda(cudaGetLastError(), name + " launch");
}

template <int HD>
void launch_split_hd(const AttnParams& p, const SplitArgs& sa, long max_items, cudaStream_t stream) {
  launch_split_persistent<attn_split_wgmma_kernel<HD>, SplitWgCfg<HD>>(
      p, sa, max_items, stream, "attn_split_wgmma_kernel<" + std::to_string(HD) + ">");
}

template <int HD>
void launch_split_pair_hd(const AttnParams& p, const SplitArgs& sa, long max_items, cudaStream_t stream) {
  launch_split_persistent<attn_split_pair_kernel<HD>, SplitPairCfg<HD>>(
      p, sa, max_items, stream, "attn_split_pair_kernel<" + std::to_string(HD) + ">");
}

}  // namespace

bool wgmma_prefill_available(int head_dim) {
  if (prefill_variant() == 0 || (head_dim != 128 && head_dim != 256)) return false;
  return current_device_is_sm90();
}

void launch_prefill_wgmma(const AttnParams& p, int head_dim, int num_groups, int max_q, int split_max_q,
                          cudaStream_t stream) {
  if (head_dim == 256)
    launch_hd<256>(p, num_groups, max_q, split_max_q, stream);
  else
    launch_hd<128>(p, num_groups, max_q, split_max_q, stream);
}

bool wgmma_split_available(int head_dim) {
  if (!split_wgmma_enabled() || (head_dim != 128 && head_dim != 256)) return false;
  return current_device_is_sm90();
}

void launch_split_wgmma(const AttnParams& p, const SplitArgs& sa, int head_dim, long max_items, cudaStream_t stream) {
  if (head_dim == 256)
    launch_split_hd<256>(p, sa, max_items, stream);
  else
    launch_split_hd<128>(p, sa, max_items, stream);
}

std::atomic<uint64_t> g_split_pair_launches{0};

uint64_t split_pair_launches() { return g_split_pair_launches.load(std::memory_order_relaxed); }

void launch_split_pair(const AttnParams& p, const SplitArgs& sa, int head_dim, long max_items, cudaStream_t stream) {
  g_split_pair_launches.fetch_add(1, std::memory_order_relaxed);
  if (head_dim == 256)
    launch_split_pair_hd<256>(p, sa, max_items, stream);
  else
    launch_split_pair_hd<128>(p, sa, max_items, stream);
}

int split_wgmma_blocks_per_sm(int head_dim) {
  return head_dim == 256 ? split_wgmma_setup<256>() : split_wgmma_setup<128>();
}

}  // namespace hypic::kernels::cuda::detail
