// Kimi Delta Attention on the GPU: chunk table, per-chunk factors, sequential scan with T_C, decode step, forget
// gate. Contracts: kda.h; math and the test oracle: kernels/cpu/kda.h.
#include "kernels/cuda/kda.h"

#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/state_tile.cuh"

namespace hypic::kernels::cuda {
namespace {

using namespace detail;

constexpr int D = kKdaHeadDim;  // 128
constexpr int C = kKdaChunk;    // 64
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float flush(float x) { return fabsf(x) < FLT_MIN ? 0.0f : x; }
// e^x for x <= 0 with results below the smallest normal float flushed to 0 (kernels/cpu exp_normal).
__device__ __forceinline__ float exp_normal(float x) { return flush(__expf(x)); }
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

// Per chunk and head, the scan's factors in the workspace (bf16 row-major unless said): W [C][D], U [C][D],
// K~ [C][D], Q o e^G [C][D], P [C][C], e^{G_L} [D] fp32.
struct Factors {
  static constexpr size_t kW = 0, kU = kW + C * D * 2, kKt = kU + C * D * 2, kQd = kKt + C * D * 2,
                          kP = kQd + C * D * 2, kGL = kP + C * C * 2, kBytes = kGL + D * 4;
};
static_assert(Factors::kBytes % 256 == 0, "factor blocks stay 256-byte aligned");

constexpr size_t kTableBytes(int num_seqs) { return (size_t(num_seqs + 1) * sizeof(int) + 255) / 256 * 256; }

// chunk_first[s] = sum over sequences before s of ceil(len / C); chunk_first[num_seqs] = the total. One block.
constexpr int kTableThreads = 1024;
__global__ void __launch_bounds__(kTableThreads) kda_chunk_table_kernel(int num_seqs, const int* __restrict__ cu,
                                                                        int* __restrict__ chunk_first) {
  using Scan = cub::BlockScan<int, kTableThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  bool decreasing = false;
  for (int base = 0; base < num_seqs; base += kTableThreads) {
    const int s = base + threadIdx.x;
    const long len = s < num_seqs ? long(cu[s + 1]) - cu[s] : 0;
    decreasing = decreasing || len < 0;
    const int n = static_cast<int>(len > 0 ? (len + C - 1) / C : 0);
    int excl, total;
    Scan(tmp).ExclusiveSum(n, excl, total);
    if (s < num_seqs) chunk_first[s] = carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  // A decreasing table marks itself bad (more chunks than any workspace holds: bad_lengths).
  if (__syncthreads_or(decreasing) && threadIdx.x == 0) chunk_first[num_seqs] = INT_MAX;
  else if (threadIdx.x == 0) chunk_first[num_seqs] = carry;
}

struct KdaParams {
  const int* cu;
  const int* chunk_first;
  int num_seqs, H;
  const bf16 *q, *k, *v;
  const float *g, *beta;
  bool l2norm;
  float scale;
  bool outputs;
  unsigned char* factors;  // [chunk][H][Factors::kBytes]
  const float* init;
  float* final_state;
  float* transition;
  bf16* out;
  int total_tokens;  // host's T: cu_seqlens must end there
  int max_chunks;    // the factor slots of the workspace
};

// cu_seqlens disagreeing with the host's total_tokens (the workspace and the launches were sized from it): nothing
// may be read or written by its rows; the scan writes NaN into the states instead (a loud, in-bounds failure).
__device__ __forceinline__ bool bad_lengths(const KdaParams& p) {
  return p.cu[0] != 0 || p.cu[p.num_seqs] != p.total_tokens || p.chunk_first[p.num_seqs] > p.max_chunks;
}

// ---- per-chunk factors ---------------------------------------------------------------------------------------
// One block (256 threads) per (chunk, head). fp32 throughout; the outputs rounded to bf16 once.
constexpr int kFacThreads = 256;
constexpr int kLdA = C + 1;
constexpr int kLdOp = D + 8;  // padded bf16 rows of the tensor-core operands
struct FacSmem {
  static constexpr size_t kK = 0;                              // bf16 [C][D] keys as given (exact)
  static constexpr size_t kG = kK + size_t(C) * D * 2;         // fp32 [C][D] cumulative log decay
  static constexpr size_t kQ = kG + size_t(C) * D * 4;         // bf16 [C][D] queries as given
  static constexpr size_t kA = kQ + size_t(C) * D * 2;         // fp32 [C][kLdA] (strictly lower, b_i folded in)
  static constexpr size_t kL = kA + size_t(C) * kLdA * 4;      // bf16 [32][kLdOp]: one row block's K and Q, decayed
  static constexpr size_t kR = kL + size_t(32) * kLdOp * 2;    // bf16 [48][kLdOp]: the earlier keys, decayed
  static constexpr size_t kB = kR + size_t(48) * kLdOp * 2;    // fp32 [C] beta
  static constexpr size_t kN = kB + C * 4;                     // fp32 [2][C] per-row factors of k and q
  static constexpr size_t kBytes = kN + 2 * C * 4;
};

// Per (chunk, head): A = diag(b) (K K^T with pairwise decays), strictly lower, and P = Q K^T with pairwise decays,
// lower with the diagonal, e^{G_i - G_j} per channel. The 16 x 16 blocks below the diagonal on the tensor cores with
// the reference row n = 16 I of row block I: e^{G_i - G_j} = e^{G_i - G_n} e^{G_n - G_j}, both factors <= 1 since
// G decreases (flash-linear-attention's chunk_kda splits the same way); the diagonal blocks directly in fp32.
__global__ void __launch_bounds__(kFacThreads) kda_factor_kernel(KdaParams p) {
  extern __shared__ __align__(16) unsigned char fsm[];
  bf16* sK = reinterpret_cast<bf16*>(fsm + FacSmem::kK);
  float* sG = reinterpret_cast<float*>(fsm + FacSmem::kG);
  bf16* sQ = reinterpret_cast<bf16*>(fsm + FacSmem::kQ);
  float* sA = reinterpret_cast<float*>(fsm + FacSmem::kA);
  bf16* sL = reinterpret_cast<bf16*>(fsm + FacSmem::kL);
  bf16* sR = reinterpret_cast<bf16*>(fsm + FacSmem::kR);
  float* sB = reinterpret_cast<float*>(fsm + FacSmem::kB);
  float* sKn = reinterpret_cast<float*>(fsm + FacSmem::kN);  // k_i = sK[i] * sKn[i] in fp32 (the l2 norm)
  float* sQn = sKn + C;                                       // q_i = sQ[i] * sQn[i] (l2 norm and scale)
  const int ci = blockIdx.x, h = blockIdx.y, H = p.H, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (ci >= p.chunk_first[p.num_seqs] || bad_lengths(p)) return;
  // The chunk's sequence: the last s with chunk_first[s] <= ci (sequences of length 0 own no chunk).
  int lo = 0, hi = p.num_seqs;  // chunk_first[lo] <= ci < chunk_first[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (p.chunk_first[mid] <= ci) lo = mid; else hi = mid;
  }
  const int seq = lo, c = ci - p.chunk_first[seq];
  const int t0 = p.cu[seq] + c * C, L = min(C, p.cu[seq + 1] - t0);
  const size_t ld = size_t(H) * D;
  unsigned char* F = p.factors + (size_t(ci) * H + h) * Factors::kBytes;

  // Keys and queries as given plus their rows' normalising factors (warp per row, lane owns channels lane + 32 m):
  // the normalised values in fp32 at bf16 storage. Beta, cumulative decays.
  {
    constexpr int kRows = C / (kFacThreads / 32);  // rows per warp: i = warp + 8 r
    float kx[kRows][4], qx[kRows][4];
#pragma unroll
    for (int r = 0; r < kRows; ++r)  // every load in flight before any is used
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int i = warp + 8 * r, d = lane + 32 * m;
        const size_t src = (size_t(t0) + i) * ld + size_t(h) * D + d;
        kx[r][m] = i < L ? __bfloat162float(p.k[src]) : 0.f;
        qx[r][m] = i < L && p.outputs ? __bfloat162float(p.q[src]) : 0.f;
      }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = warp + 8 * r;
      float rk = 1.f, rq = 1.f;
      if (p.l2norm) {
        rk = rsqrtf(warp_sum(kx[r][0] * kx[r][0] + kx[r][1] * kx[r][1] + kx[r][2] * kx[r][2] + kx[r][3] * kx[r][3]) +
                    1e-6f);
        rq = rsqrtf(warp_sum(qx[r][0] * qx[r][0] + qx[r][1] * qx[r][1] + qx[r][2] * qx[r][2] + qx[r][3] * qx[r][3]) +
                    1e-6f);
      }
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int d = lane + 32 * m;
        sK[i * D + d] = __float2bfloat16_rn(kx[r][m]);  // exact: the values came from bf16
        sQ[i * D + d] = __float2bfloat16_rn(qx[r][m]);
      }
      if (lane == 0) sKn[i] = rk, sQn[i] = rq * p.scale;
    }
  }
  if (tid < C) sB[tid] = tid < L ? p.beta[(size_t(t0) + tid) * H + h] : 0.f;
  if (tid < D) {
    float gv[C];
#pragma unroll
    for (int i = 0; i < C; ++i) gv[i] = i < L ? p.g[(size_t(t0) + i) * ld + size_t(h) * D + tid] : 0.f;
    float run = 0.f;
#pragma unroll
    for (int i = 0; i < C; ++i) {
      run += gv[i];
      sG[i * D + tid] = run;
    }
  }
  __syncthreads();

  bf16* gP = reinterpret_cast<bf16*>(F + Factors::kP);
  // Diagonal 16 x 16 blocks, directly: warp per row i (row i's channels held in registers); zeros right of them.
  for (int i = warp; i < C; i += kFacThreads / 32) {
    float ki[4], qi[4], gi[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int d = lane + 32 * m;
      ki[m] = __bfloat162float(sK[i * D + d]) * sKn[i];
      qi[m] = __bfloat162float(sQ[i * D + d]) * sQn[i];
      gi[m] = sG[i * D + d];
    }
    const int jb = i & ~15;
    for (int j = jb; j <= i; ++j) {
      float a = 0.f, pp = 0.f;
      if (i < L) {
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int d = lane + 32 * m;
          const float kd = __bfloat162float(sK[j * D + d]) * sKn[j] * exp_normal(gi[m] - sG[j * D + d]);
          a = fmaf(ki[m], kd, a);
          pp = fmaf(qi[m], kd, pp);
        }
        a = warp_sum(a);
        if (p.outputs) pp = warp_sum(pp);
      }
      if (lane == 0) {
        sA[i * kLdA + j] = j < i ? sB[i] * a : 0.f;
        if (p.outputs) gP[i * C + j] = __float2bfloat16_rn(pp);
      }
    }
    for (int j = i + 1 + lane; j < C; j += 32) {
      sA[i * kLdA + j] = 0.f;
      if (p.outputs) gP[i * C + j] = __float2bfloat16_rn(0.f);
    }
  }
  // Blocks below the diagonal, row block I = 1..3 against the earlier keys, on the tensor cores.
  for (int I = 1; I < C / 16; ++I) {
    const int n = 16 * I;
    __syncthreads();  // the previous round's operands are consumed
    for (int idx = tid; idx < (32 + n) * D; idx += kFacThreads) {
      const int r = idx / D, d = idx % D;
      if (r < 32) {  // rows 0..15: K of rows n.., 16..31: Q of rows n.., times e^{G_i - G_n}
        const int i = n + (r & 15);
        const float e = exp_normal(sG[i * D + d] - sG[n * D + d]);
        const float x = r < 16 ? __bfloat162float(sK[i * D + d]) * sKn[i] : __bfloat162float(sQ[i * D + d]) * sQn[i];
        sL[r * kLdOp + d] = __float2bfloat16_rn(x * e);
      } else {  // key j < n times e^{G_n - G_j}
        const int j = r - 32;
        sR[j * kLdOp + d] =
            __float2bfloat16_rn(__bfloat162float(sK[j * D + d]) * sKn[j] * exp_normal(sG[n * D + d] - sG[j * D + d]));
      }
    }
    __syncthreads();
    // Work items: (part: 0 = A, 1 = P) x (key block J < I), one warp each.
    const int items = (p.outputs ? 2 : 1) * I;
    if (warp < items) {
      const int part = warp / I, J = warp % I;
      float acc[2][4] = {};
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[4], b[4];
        load_a(a, sL, kLdOp, 16 * part, 16 * ks, lane);
        load_b_nk(b, sR, kLdOp, 16 * ks, 16 * J, lane);
        mma_bf16(acc[0], a, b[0], b[1]);
        mma_bf16(acc[1], a, b[2], b[3]);
      }
      const int g = lane >> 2, cq = (lane & 3) * 2;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int j = 16 * J + 8 * hh + cq;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = n + g + 8 * half;
          const float v0 = acc[hh][2 * half], v1 = acc[hh][2 * half + 1];
          if (part == 0) {
            sA[i * kLdA + j] = sB[i] * v0;
            sA[i * kLdA + j + 1] = sB[i] * v1;
          } else {
            *reinterpret_cast<uint32_t*>(gP + i * C + j) = pack_bf16(v0, v1);
          }
        }
      }
    }
  }
  __syncthreads();

  // (I + A) X = [diag(b) V | diag(b) (K o e^G)]: thread `col` solves its column by forward substitution in registers.
  {
    const int col = tid;
    float x[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {  // right-hand side first: every load in flight at once
      float r;
      if (col < D)
        r = i < L ? __bfloat162float(p.v[(size_t(t0) + i) * ld + size_t(h) * D + col]) : 0.f;
      else
        r = __bfloat162float(sK[i * D + col - D]) * sKn[i] * exp_normal(sG[i * D + col - D]);
      x[i] = sB[i] * r;
    }
#pragma unroll
    for (int i = 1; i < C; ++i)
#pragma unroll
      for (int j = 0; j < i; ++j) x[i] = fmaf(-sA[i * kLdA + j], x[j], x[i]);
    bf16* dst = reinterpret_cast<bf16*>(F + (col < D ? Factors::kU : Factors::kW)) + (col % D);
#pragma unroll
    for (int i = 0; i < C; ++i) dst[i * D] = __float2bfloat16_rn(x[i]);
  }
  // K~ = k o e^{G_L - G}, Q o e^G, e^{G_L}.
  bf16* gKt = reinterpret_cast<bf16*>(F + Factors::kKt);
  bf16* gQd = reinterpret_cast<bf16*>(F + Factors::kQd);
  const float* GL = sG + (L - 1) * D;
  for (int idx = tid; idx < C * D; idx += kFacThreads) {
    const int i = idx / D, d = idx % D;
    gKt[idx] = __float2bfloat16_rn(__bfloat162float(sK[idx]) * sKn[i] * exp_normal(GL[d] - sG[idx]));
    if (p.outputs) gQd[idx] = __float2bfloat16_rn(__bfloat162float(sQ[idx]) * sQn[i] * exp_normal(sG[idx]));
  }
  if (tid < D) reinterpret_cast<float*>(F + Factors::kGL)[tid] = exp_normal(GL[tid]);
}

// ---- sequential scan -----------------------------------------------------------------------------------------
// One block (4 warps) per (sequence, head, z): z < 2 carries columns 64 z .. 64 z + 63 of S (and writes those output
// columns), z >= 2 columns 64 (z - 2) .. of T (starting from I). Per chunk (X = the carried columns):
//   Vnew = [U] - W X;   o = Qd X + P Vnew;   X <- diag(e^{G_L}) X + K~^T Vnew.
// Warp w computes rows 16 w .. 16 w + 15 of Vnew and o, and owns rows 32 w .. 32 w + 31 of X (fp32 accumulators).
constexpr int kScanThreads = 128;
constexpr int LDK = D + 8, LDV = 64 + 8;
struct ScanSmem {
  static constexpr size_t kW = 0;                                 // bf16 [C][LDK]
  static constexpr size_t kKt = kW + size_t(C) * LDK * 2;         // bf16 [C][LDK]
  static constexpr size_t kQd = kKt + size_t(C) * LDK * 2;        // bf16 [C][LDK]
  static constexpr size_t kU = kQd + size_t(C) * LDK * 2;         // bf16 [C][LDV] (the block's columns)
  static constexpr size_t kP = kU + size_t(C) * LDV * 2;          // bf16 [C][LDV]
  static constexpr size_t kX = kP + size_t(C) * LDV * 2;          // bf16 [D][LDV]
  static constexpr size_t kVn = kX + size_t(D) * LDV * 2;         // bf16 [C][LDV]
  static constexpr size_t kGL = kVn + size_t(C) * LDV * 2;        // fp32 [D]
  static constexpr size_t kBytes = kGL + D * 4;
};

__global__ void __launch_bounds__(kScanThreads) kda_scan_kernel(KdaParams p) {
  extern __shared__ __align__(16) unsigned char ssm[];
  bf16* sW = reinterpret_cast<bf16*>(ssm + ScanSmem::kW);
  bf16* sKt = reinterpret_cast<bf16*>(ssm + ScanSmem::kKt);
  bf16* sQd = reinterpret_cast<bf16*>(ssm + ScanSmem::kQd);
  bf16* sU = reinterpret_cast<bf16*>(ssm + ScanSmem::kU);
  bf16* sP = reinterpret_cast<bf16*>(ssm + ScanSmem::kP);
  bf16* sX = reinterpret_cast<bf16*>(ssm + ScanSmem::kX);
  bf16* sVn = reinterpret_cast<bf16*>(ssm + ScanSmem::kVn);
  float* sGL = reinterpret_cast<float*>(ssm + ScanSmem::kGL);
  const int seq = blockIdx.x, h = blockIdx.y, z = blockIdx.z, H = p.H;
  const bool is_S = z < 2;
  const int v0 = 64 * (is_S ? z : z - 2);
  const bool outs = is_S && p.outputs && p.out;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, cq = (lane & 3) * 2;
  const size_t hd = size_t(D) * D;
  if (bad_lengths(p)) {
    float* dst = is_S ? p.final_state : p.transition;
    if (dst)
      for (int i = tid; i < D * 64; i += kScanThreads)
        dst[(size_t(seq) * H + h) * hd + size_t(i / 64) * D + v0 + i % 64] = __int_as_float(0x7fc00000);
    return;
  }
  const int start = p.cu[seq], len = p.cu[seq + 1] - start, nch = static_cast<int>((long(len) + C - 1) / C);
  const int cf = nch > 0 ? p.chunk_first[seq] : 0;

  const int rb = 32 * warp;
  float xacc[2][8][4];
  state_tile_load<2>(xacc, is_S && p.init ? p.init + (size_t(seq) * H + h) * hd : nullptr, D, rb, v0, lane, !is_S);
  state_tile_to_smem<2>(xacc, sX, LDV, rb, lane);

  for (int c = 0; c < nch; ++c) {
    const int t0 = start + c * C, L = min(C, len - c * C);
    const unsigned char* F = p.factors + (size_t(cf + c) * H + h) * Factors::kBytes;
    // Stage the chunk's factors.
    for (int idx = tid; idx < C * (D / 8); idx += kScanThreads) {
      const int row = idx / (D / 8), pc = (idx % (D / 8)) * 8;
      cp_async16(sW + row * LDK + pc, F + Factors::kW + (size_t(row) * D + pc) * 2);
      cp_async16(sKt + row * LDK + pc, F + Factors::kKt + (size_t(row) * D + pc) * 2);
      if (outs) cp_async16(sQd + row * LDK + pc, F + Factors::kQd + (size_t(row) * D + pc) * 2);
    }
    for (int idx = tid; idx < C * 8; idx += kScanThreads) {
      const int row = idx / 8, pc = (idx % 8) * 8;
      if (is_S) cp_async16(sU + row * LDV + pc, F + Factors::kU + (size_t(row) * D + v0 + pc) * 2);
      if (outs) cp_async16(sP + row * LDV + pc, F + Factors::kP + (size_t(row) * C + pc) * 2);
    }
    if (tid < D / 4) cp_async16(sGL + 4 * tid, F + Factors::kGL + size_t(tid) * 16);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // W X and Qd X (rows 16 w .. of the chunk, the block's 64 columns), sharing the X fragments.
    float wx[8][4], o[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) wx[nt][e] = o[nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t aw[4], aq[4];
      load_a(aw, sW, LDK, 16 * warp, 16 * ks, lane);
      if (outs) load_a(aq, sQd, LDK, 16 * warp, 16 * ks, lane);
#pragma unroll
      for (int nt2 = 0; nt2 < 4; ++nt2) {
        uint32_t b[4];
        load_b_kn(b, sX, LDV, 16 * ks, 16 * nt2, lane);
        mma_bf16(wx[2 * nt2], aw, b[0], b[1]);
        mma_bf16(wx[2 * nt2 + 1], aw, b[2], b[3]);
        if (outs) {
          mma_bf16(o[2 * nt2], aq, b[0], b[1]);
          mma_bf16(o[2 * nt2 + 1], aq, b[2], b[3]);
        }
      }
    }
    // Vnew = [U] - W X, to shared memory as bf16.
    const int r0 = 16 * warp + g, r1 = r0 + 8;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int col = 8 * nt + cq;
      float u0 = 0.f, u1 = 0.f, u2 = 0.f, u3 = 0.f;
      if (is_S) {
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sU + r0 * LDV + col));
        const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sU + r1 * LDV + col));
        u0 = a.x, u1 = a.y, u2 = b.x, u3 = b.y;
      }
      *reinterpret_cast<uint32_t*>(sVn + r0 * LDV + col) = pack_bf16(u0 - wx[nt][0], u1 - wx[nt][1]);
      *reinterpret_cast<uint32_t*>(sVn + r1 * LDV + col) = pack_bf16(u2 - wx[nt][2], u3 - wx[nt][3]);
    }
    __syncthreads();
    if (outs) {
      // o += P Vnew (key tiles at or left of the diagonal).
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if (kk > warp) continue;
        uint32_t a[4];
        load_a(a, sP, LDV, 16 * warp, 16 * kk, lane);
#pragma unroll
        for (int nt2 = 0; nt2 < 4; ++nt2) {
          uint32_t b[4];
          load_b_kn(b, sVn, LDV, 16 * kk, 16 * nt2, lane);
          mma_bf16(o[2 * nt2], a, b[0], b[1]);
          mma_bf16(o[2 * nt2 + 1], a, b[2], b[3]);
        }
      }
      const size_t ld = size_t(H) * D;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const size_t col = size_t(h) * D + v0 + 8 * nt + cq;
        if (r0 < L) *reinterpret_cast<uint32_t*>(p.out + (size_t(t0) + r0) * ld + col) = pack_bf16(o[nt][0], o[nt][1]);
        if (r1 < L) *reinterpret_cast<uint32_t*>(p.out + (size_t(t0) + r1) * ld + col) = pack_bf16(o[nt][2], o[nt][3]);
      }
    }
    // X <- diag(e^{G_L}) X + K~^T Vnew.
    state_tile_scale_rows<2>(xacc, rb, lane, [sGL](int row) { return sGL[row]; });
    state_tile_rank_update<2>(xacc, sKt, LDK, sVn, LDV, rb, lane, [](int, int, uint32_t(&)[4]) {});
    state_tile_flush<2>(xacc);
    __syncthreads();  // every warp is done with this chunk's stage, sX and sVn
    if (c + 1 < nch) state_tile_to_smem<2>(xacc, sX, LDV, rb, lane);
  }

  float* dst = is_S ? (p.final_state ? p.final_state + (size_t(seq) * H + h) * hd : nullptr)
                    : p.transition + (size_t(seq) * H + h) * hd;
  if (dst) state_tile_store<2>(xacc, dst, D, rb, v0, lane);
}

// ---- decode ----------------------------------------------------------------------------------------------------
// Grid (batch, H, 4 slices of 32 columns), 128 threads: thread (rg, lane) owns column 32 z + lane of rows
// 32 rg .. 32 rg + 31 in registers between the two passes; column sums over the four row groups in a fixed order.
__global__ void __launch_bounds__(128) kda_decode_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                         const bf16* __restrict__ v, const float* __restrict__ g,
                                                         const float* __restrict__ beta, int H, bool l2norm,
                                                         float scale, float* __restrict__ state,
                                                         bf16* __restrict__ out, const int* __restrict__ slots) {
  __shared__ float sq[D], sk[D], sa[D], red[4], part[4][32];
  const int b = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, rg = tid >> 5;
  const int c = blockIdx.z * 32 + lane;
  const size_t bh = size_t(b) * H + h;
  float qj = __bfloat162float(q[bh * D + tid]), kj = __bfloat162float(k[bh * D + tid]);
  if (l2norm) {
    float sq2 = warp_sum(qj * qj), sk2 = warp_sum(kj * kj);
    if (lane == 0) red[rg] = sq2;
    __syncthreads();
    sq2 = (red[0] + red[1]) + (red[2] + red[3]);
    __syncthreads();
    if (lane == 0) red[rg] = sk2;
    __syncthreads();
    sk2 = (red[0] + red[1]) + (red[2] + red[3]);
    qj *= rsqrtf(sq2 + 1e-6f);
    kj *= rsqrtf(sk2 + 1e-6f);
  }
  sq[tid] = qj * scale;
  sk[tid] = kj;
  sa[tid] = exp_normal(g[bh * D + tid]);
  const float bt = beta[bh];
  float* S = state + ((slots ? size_t(slots[b]) * H + h : bh) * D + size_t(rg) * 32) * D + c;
  float sv[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) sv[r] = S[size_t(r) * D];
  __syncthreads();
  float kv = 0.f;
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    sv[r] *= sa[rg * 32 + r];
    kv = fmaf(sv[r], sk[rg * 32 + r], kv);
  }
  part[rg][lane] = kv;
  __syncthreads();
  kv = (part[0][lane] + part[1][lane]) + (part[2][lane] + part[3][lane]);
  const float delta = bt * (__bfloat162float(v[bh * D + c]) - kv);
  float o = 0.f;
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    const float s = flush(fmaf(sk[rg * 32 + r], delta, sv[r]));
    o = fmaf(s, sq[rg * 32 + r], o);
    S[size_t(r) * D] = s;
  }
  __syncthreads();
  part[rg][lane] = o;
  __syncthreads();
  if (out && rg == 0)
    out[bh * D + c] = __float2bfloat16_rn((part[0][lane] + part[1][lane]) + (part[2][lane] + part[3][lane]));
}

__global__ void kda_gate_kernel(size_t n, int H, const bf16* __restrict__ x, const float* __restrict__ A_log,
                                const float* __restrict__ dt_bias, float* __restrict__ g, const bf16* __restrict__ b,
                                long ldb, float* __restrict__ beta) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const int hd = static_cast<int>(i % (size_t(H) * D)), h = hd / D;
    const float y = __bfloat162float(x[i]) + dt_bias[hd];
    const float sp = y > 20.f ? y : logf(1.f + expf(y));
    g[i] = -expf(A_log[h]) * sp;
    if (b && hd % D == 0) {  // one thread per (token, head)
      const size_t t = i / (size_t(H) * D);
      beta[t * H + h] = 1.f / (1.f + expf(-__bfloat162float(b[t * ldb + h])));
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

void check_shape(const KdaPrefillArgs& a) {
  const std::string f = "kda_prefill: ";
  if (a.num_seqs < 0) throw std::invalid_argument(f + "num_seqs " + std::to_string(a.num_seqs) + " < 0");
  if (a.num_heads <= 0 || a.num_heads > 65535)
    throw std::invalid_argument(f + "num_heads " + std::to_string(a.num_heads) + " outside [1, 65535]");
  if (a.total_tokens < 0) throw std::invalid_argument(f + "total_tokens " + std::to_string(a.total_tokens) + " < 0");
  if (a.num_seqs > 65535) throw std::invalid_argument(f + "num_seqs " + std::to_string(a.num_seqs) + " > 65535");
}

size_t chunk_bound(const KdaPrefillArgs& a) { return size_t(a.num_seqs) + (size_t(a.total_tokens) + C - 1) / C; }

}  // namespace

size_t kda_prefill_workspace_bytes(const KdaPrefillArgs& a) {
  check_shape(a);
  return kTableBytes(a.num_seqs) + chunk_bound(a) * a.num_heads * Factors::kBytes;
}

void kda_prefill(const KdaPrefillArgs& a, cudaStream_t stream) {
  check_shape(a);
  const std::string f = "kda_prefill: ";
  if (a.num_seqs == 0) return;
  if (!a.cu_seqlens) throw std::invalid_argument(f + "cu_seqlens is null");
  if (a.total_tokens > 0 && (!a.k || !a.v || !a.g || !a.beta || (a.out && !a.q)))
    throw std::invalid_argument(f + "k, v, g, beta (or q with outputs) is null");
  for (const void* ptr : {static_cast<const void*>(a.q), static_cast<const void*>(a.k),
                          static_cast<const void*>(a.v), static_cast<const void*>(a.out),
                          static_cast<const void*>(a.initial_state), static_cast<const void*>(a.final_state),
                          static_cast<const void*>(a.transition), static_cast<const void*>(a.workspace)})
    if (!aligned16(ptr)) throw std::invalid_argument(f + "q, k, v, out, the states and the workspace must be 16-byte aligned");
  if (chunk_bound(a) > 0x7fffffffu) throw std::invalid_argument(f + "too many chunks");
  const size_t need = kda_prefill_workspace_bytes(a);
  if (!a.workspace || a.workspace_bytes < need)
    throw std::invalid_argument(f + "workspace of " + std::to_string(a.workspace_bytes) + " bytes given, " +
                                std::to_string(need) + " needed");
  static DeviceOnce once;
  once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(kda_factor_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(FacSmem::kBytes)),
               "kda_prefill: factor kernel shared memory");
    check_cuda(cudaFuncSetAttribute(kda_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(ScanSmem::kBytes)),
               "kda_prefill: scan kernel shared memory");
    return 0;
  });
  auto* base = static_cast<unsigned char*>(a.workspace);
  int* chunk_first = reinterpret_cast<int*>(base);
  KdaParams p{a.cu_seqlens, chunk_first, a.num_seqs, a.num_heads, a.q, a.k, a.v, a.g, a.beta, a.l2norm_qk, a.scale,
              a.out != nullptr, base + kTableBytes(a.num_seqs), a.initial_state, a.final_state, a.transition, a.out,
              a.total_tokens, static_cast<int>(chunk_bound(a))};
  kda_chunk_table_kernel<<<1, kTableThreads, 0, stream>>>(a.num_seqs, a.cu_seqlens, chunk_first);
  check_cuda(cudaGetLastError(), "kda_prefill: chunk table launch");
  const size_t bound = chunk_bound(a);
  if (bound > 0) {
    kda_factor_kernel<<<dim3(unsigned(bound), unsigned(a.num_heads)), kFacThreads, FacSmem::kBytes, stream>>>(p);
    check_cuda(cudaGetLastError(), "kda_prefill: factor launch");
  }
  const int tiles = a.transition ? 4 : 2;
  kda_scan_kernel<<<dim3(unsigned(a.num_seqs), unsigned(a.num_heads), tiles), kScanThreads, ScanSmem::kBytes,
                    stream>>>(p);
  check_cuda(cudaGetLastError(), "kda_prefill: scan launch");
}

void kda_decode(int batch, int num_heads, const bf16* q, const bf16* k, const bf16* v, const float* g,
                const float* beta, bool l2norm_qk, float scale, float* state, bf16* out, cudaStream_t stream,
                const int* state_slots) {
  const std::string f = "kda_decode: ";
  if (batch < 0 || num_heads <= 0 || num_heads > 65535)
    throw std::invalid_argument(f + "bad batch " + std::to_string(batch) + " or num_heads " + std::to_string(num_heads));
  if (batch == 0) return;
  if (!q || !k || !v || !g || !beta || !state) throw std::invalid_argument(f + "q, k, v, g, beta or state is null");
  kda_decode_kernel<<<dim3(unsigned(batch), unsigned(num_heads), D / 32), 128, 0, stream>>>(
      q, k, v, g, beta, num_heads, l2norm_qk, scale, state, out, state_slots);
  check_cuda(cudaGetLastError(), "kda_decode: launch");
}

void kda_gate(int tokens, int num_heads, const bf16* x, const float* A_log, const float* dt_bias, float* g,
              cudaStream_t stream, const bf16* b, long ldb, float* beta) {
  const std::string f = "kda_gate: ";
  if (tokens < 0 || num_heads <= 0)
    throw std::invalid_argument(f + "bad tokens " + std::to_string(tokens) + " or num_heads " +
                                std::to_string(num_heads));
  if (b && (!beta || ldb < num_heads))
    throw std::invalid_argument(f + "b needs beta and a row stride >= num_heads (got " + std::to_string(ldb) + ")");
  if (tokens == 0) return;
  if (!x || !A_log || !dt_bias || !g) throw std::invalid_argument(f + "null pointer");
  const size_t n = size_t(tokens) * num_heads * D;
  const int blocks = static_cast<int>(std::min<size_t>((n + 255) / 256, size_t(sm_count()) * 8));
  kda_gate_kernel<<<blocks, 256, 0, stream>>>(n, num_heads, x, A_log, dt_bias, g, b, ldb, beta);
  check_cuda(cudaGetLastError(), "kda_gate: launch");
}

}  // namespace hypic::kernels::cuda
