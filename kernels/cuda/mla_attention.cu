// Absorbed MLA attention over the latent KV pool (mla_attention_latent) and its workspace. Contracts: mla.h.
//
// One block of 256 threads (8 warps) per work item (group g, tile of 32 (query, head) rows, KV chunk). The rows'
// absorbed queries [32][D] stay in shared memory; the chunk's pages (64 latent rows of D = R + rope each) stream
// through a double-buffered cp.async ring. Per page:
//   S = Q K^T    [32 x 64], each warp one 16 x 16 piece (mma.sync m16n8k16 over D / 16 steps), to shared fp32;
//   online softmax per row (8 threads per row: running max m, sum l, the factor alpha of the old accumulator);
//   O = alpha O + P C   [32 x R], C = the first R columns of the same rows (V is the latent itself), each warp R / 8
//   columns for both 16-row halves, P rounded to bf16 as in kernels/cuda/attention.cu.
// A chunk that covers the whole KV range writes the normalised rows; otherwise (m, l, O) go to the workspace and
// mla_combine_kernel merges the chunks.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mla.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/switches.h"

namespace hypic::kernels::cuda {

namespace {

using namespace detail;

constexpr int kRows = 32;     // (query, head) rows per tile
constexpr int kThreads = 256;  // 8 warps
constexpr int kPage = kKvPageTokens;
constexpr float kLog2e = 1.4426950408889634f;

struct MlaAttnParams {
  int num_groups, heads, R, D, nsplit, chunk_pages, row_tiles;
  int seq_chunks;  // 1: each group's pages cut into nsplit chunks from its own KV end (HYPIC_MLA_SEQ_CHUNKS)
  const int* q_start;
  const int* slot0;
  const int* block_table;
  int max_pages;
  const bf16* q;     // [total_q][heads][D]
  const bf16* pool;  // [rows][D]
  float scale_log2;  // scale * log2(e)
  bf16* out;         // [total_q][heads][R]
  float* ws_ml;      // [items][nsplit][kRows][2]
  float* ws_o;       // [items][nsplit][kRows][R]
};

__host__ __device__ constexpr int ld_of(int D) { return D + 8; }  // elements; keeps rows 16-byte aligned, no conflicts

size_t smem_bytes(int D) {
  return size_t(kRows + 2 * kPage) * ld_of(D) * 2 + size_t(kRows) * (kPage + 4) * 4 + size_t(kRows) * (kPage + 8) * 2 +
         size_t(kRows) * 3 * 4;
}

// NT: n8 tiles per warp in the P.C product (R = 64 NT).
template <int NT>
__global__ void __launch_bounds__(kThreads, 1) mla_attn_kernel(const MlaAttnParams p) {
  constexpr int R = NT * 64;
  const int rt = blockIdx.x, chunk = blockIdx.y, g = blockIdx.z;
  const int q0 = p.q_start[g], len = p.q_start[g + 1] - q0, s0 = p.slot0[g];
  const int rows_g = len * p.heads;
  if (rt * kRows >= rows_g) return;
  const int kv_end = s0 + len;  // slots 0 .. kv_end - 1 are visible to the group's last query
  const int pages = (kv_end + kPage - 1) / kPage;
  // Pages per chunk: planned from max_kv, or (seq_chunks) from the group's own pages, so that no planned chunk of a
  // group far below max_kv is empty (a decode step's max_kv is the block table's power-of-two width).
  const int chunk_pages = p.seq_chunks ? (pages + p.nsplit - 1) / p.nsplit : p.chunk_pages;
  const int pg0 = chunk * chunk_pages;
  const int pg1 = chunk == p.nsplit - 1 ? pages : min(pages, pg0 + chunk_pages);
  const int D = p.D, ld = ld_of(D);

  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Ks = Qs + size_t(kRows) * ld;  // [2][kPage][ld]
  float* Ss = reinterpret_cast<float*>(Ks + size_t(2) * kPage * ld);  // [kRows][kPage + 4]
  bf16* Ps = reinterpret_cast<bf16*>(Ss + kRows * (kPage + 4));    // [kRows][kPage + 8]
  float* m_s = reinterpret_cast<float*>(Ps + kRows * (kPage + 8));
  float* l_s = m_s + kRows;
  float* a_s = l_s + kRows;
  constexpr int lds = kPage + 4, ldp = kPage + 8;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int chunks_per_row = D / 8;

  // Q rows: row r = (query (rt*32 + r) / heads, head (rt*32 + r) % heads); rows past the group are zeros.
  for (int i = tid; i < kRows * chunks_per_row; i += kThreads) {
    const int r = i / chunks_per_row, c = i % chunks_per_row, gr = rt * kRows + r;
    bf16* dst = Qs + r * ld + c * 8;
    if (gr < rows_g) {
      const int qi = gr / p.heads, h = gr % p.heads;
      cp_async16(dst, p.q + (size_t(q0 + qi) * p.heads + h) * D + c * 8);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
  if (tid < kRows) m_s[tid] = -INFINITY, l_s[tid] = 0.f;
  const int* bt = p.block_table + size_t(g) * p.max_pages;
  // Rows past the group's KV end are zeros: their P is 0, but 0 times unwritten pool memory could be NaN.
  auto load_page = [&](int pg, int buf) {
    const bf16* src = p.pool + size_t(bt[pg]) * kPage * D;
    bf16* dst = Ks + size_t(buf) * kPage * ld;
    const int valid = min(kPage, kv_end - pg * kPage);
    for (int i = tid; i < kPage * chunks_per_row; i += kThreads) {
      const int r = i / chunks_per_row, c = i % chunks_per_row;
      if (r < valid)
        cp_async16(dst + r * ld + c * 8, src + size_t(r) * D + c * 8);
      else
        *reinterpret_cast<uint4*>(dst + r * ld + c * 8) = make_uint4(0, 0, 0, 0);
    }
  };
  if (pg0 < pg1) load_page(pg0, 0);
  cp_async_commit();

  float o[2][NT][4];
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < NT; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[a][b][c] = 0.f;

  const int mt = warp & 1, nc = (warp >> 1) * 16;  // S piece of this warp: rows mt*16.., cols nc..nc+15
  const int gq = lane >> 2, cq = (lane & 3) * 2;
  for (int pg = pg0; pg < pg1; ++pg) {
    const int buf = (pg - pg0) & 1;
    if (pg + 1 < pg1) load_page(pg + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16* K = Ks + size_t(buf) * kPage * ld;
    // S piece.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    for (int k0 = 0; k0 < D; k0 += 16) {
      uint32_t a[4], b[4];
      load_a(a, Qs, ld, mt * 16, k0, lane);
      load_b_nk(b, K, ld, k0, nc, lane);
      mma_bf16(s[0], a, b[0], b[1]);
      mma_bf16(s[1], a, b[2], b[3]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = mt * 16 + gq + (e >> 1) * 8, j = nc + nt * 8 + cq + (e & 1);
        const int gr = rt * kRows + r, slot = pg * kPage + j;
        const bool ok = gr < rows_g && slot <= s0 + gr / p.heads;
        Ss[r * lds + j] = ok ? s[nt][e] * p.scale_log2 : -INFINITY;
      }
    __syncthreads();
    // Online softmax: 8 threads per row, 8 columns each.
    {
      const int r = tid >> 3, part = tid & 7;
      float v[8], mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = Ss[r * lds + part * 8 + j], mx = fmaxf(mx, v[j]);
#pragma unroll
      for (int o2 = 1; o2 < 8; o2 <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o2));
      const float m_old = m_s[r], m_new = fmaxf(m_old, mx);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float e = m_new == -INFINITY ? 0.f : exp2f(v[j] - m_new);
        sum += e;
        Ps[r * ldp + part * 8 + j] = __float2bfloat16_rn(e);
      }
#pragma unroll
      for (int o2 = 1; o2 < 8; o2 <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o2);
      __syncwarp();
      if (part == 0) {
        const float alpha = m_old == -INFINITY ? 0.f : exp2f(m_old - m_new);
        a_s[r] = alpha;
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();
    // O = alpha O + P C over this warp's R / 8 columns.
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      const float al0 = a_s[a * 16 + gq], al1 = a_s[a * 16 + gq + 8];
#pragma unroll
      for (int b = 0; b < NT; ++b) o[a][b][0] *= al0, o[a][b][1] *= al0, o[a][b][2] *= al1, o[a][b][3] *= al1;
    }
    const int col0 = warp * (R / 8);
#pragma unroll
    for (int k0 = 0; k0 < kPage; k0 += 16) {
      uint32_t a0[4], a1[4];
      load_a(a0, Ps, ldp, 0, k0, lane);
      load_a(a1, Ps, ldp, 16, k0, lane);
#pragma unroll
      for (int b = 0; b < NT; b += 2) {
        uint32_t bb[4];
        load_b_kn(bb, K, ld, k0, col0 + b * 8, lane);
        mma_bf16(o[0][b], a0, bb[0], bb[1]);
        mma_bf16(o[1][b], a1, bb[0], bb[1]);
        mma_bf16(o[0][b + 1], a0, bb[2], bb[3]);
        mma_bf16(o[1][b + 1], a1, bb[2], bb[3]);
      }
    }
    __syncthreads();  // K[buf], Ss, Ps free for the next page
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue.
  const size_t item = size_t(g) * p.row_tiles + rt;
  const bool direct = p.nsplit == 1;
  const int col0 = warp * (R / 8);
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = a * 16 + gq + half * 8, gr = rt * kRows + r;
      if (gr >= rows_g) continue;
      const float l = l_s[r];
      if (direct) {
        const float inv = l > 0.f ? 1.0f / l : 0.f;
        const int qi = gr / p.heads, h = gr % p.heads;
        bf16* dst = p.out + (size_t(q0 + qi) * p.heads + h) * R + col0;
#pragma unroll
        for (int b = 0; b < NT; ++b)
          *reinterpret_cast<__nv_bfloat162*>(dst + b * 8 + cq) =
              __floats2bfloat162_rn(o[a][b][half * 2] * inv, o[a][b][half * 2 + 1] * inv);
      } else {
        float* dst = p.ws_o + ((item * p.nsplit + chunk) * kRows + r) * R + col0;
#pragma unroll
        for (int b = 0; b < NT; ++b)
          *reinterpret_cast<float2*>(dst + b * 8 + cq) = make_float2(o[a][b][half * 2], o[a][b][half * 2 + 1]);
      }
    }
  if (!direct && tid < kRows) {
    float* ml = p.ws_ml + ((item * p.nsplit + chunk) * kRows + tid) * 2;
    ml[0] = m_s[tid], ml[1] = l_s[tid];
  }
}

constexpr int kMaxSplit = 256;
constexpr int kMaxRank = 512;
constexpr int64_t kMaxWorkspaceBytes = int64_t(512) << 20;
constexpr int kCombineThreads = 128;

// One block per (group, row): merges that (query, head) row's chunks (m, l, O); float4 columns.
__global__ void __launch_bounds__(kCombineThreads) mla_combine_kernel(const MlaAttnParams p) {
  const int gr = blockIdx.x, g = blockIdx.y;
  const int q0 = p.q_start[g], len = p.q_start[g + 1] - q0;
  if (gr >= len * p.heads) return;
  const int rt = gr / kRows, r = gr % kRows;
  const size_t item = size_t(g) * p.row_tiles + rt;
  __shared__ float w_s[kMaxSplit];
  __shared__ float inv_s;
  if (threadIdx.x < 32) {  // one warp: the row's max, the chunks' weights exp2(m_c - m) and the total L
    float m = -INFINITY;
    for (int c = threadIdx.x; c < p.nsplit; c += 32) m = fmaxf(m, p.ws_ml[((item * p.nsplit + c) * kRows + r) * 2]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float L = 0.f;
    for (int c = threadIdx.x; c < p.nsplit; c += 32) {
      const float* ml = p.ws_ml + ((item * p.nsplit + c) * kRows + r) * 2;
      const float e = ml[0] == -INFINITY ? 0.f : exp2f(ml[0] - m);
      w_s[c] = e;
      L += e * ml[1];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    if (threadIdx.x == 0) inv_s = L > 0.f ? 1.0f / L : 0.f;
  }
  __syncthreads();
  const float inv = inv_s;
  const int R4 = p.R / 4;
  const int qi = gr / p.heads, h = gr % p.heads;
  bf16* out = p.out + (size_t(q0 + qi) * p.heads + h) * p.R;
  for (int c4 = threadIdx.x; c4 < R4; c4 += kCombineThreads) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int c = 0; c < p.nsplit; ++c) {
      const float4 v = reinterpret_cast<const float4*>(p.ws_o + ((item * p.nsplit + c) * kRows + r) * p.R)[c4];
      const float w = w_s[c];
      acc.x = fmaf(w, v.x, acc.x), acc.y = fmaf(w, v.y, acc.y), acc.z = fmaf(w, v.z, acc.z), acc.w = fmaf(w, v.w, acc.w);
    }
    *reinterpret_cast<__nv_bfloat162*>(out + c4 * 4) = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    *reinterpret_cast<__nv_bfloat162*>(out + c4 * 4 + 2) = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  }
}



int row_tiles_of(int max_q, int heads) { return int((int64_t(max_q) * heads + kRows - 1) / kRows); }

// Chunks per item (one block per SM: ~200 KB of shared memory each): the count whose modelled time, waves of blocks
// times pages per chunk (ceil(items ns / SMs) * ceil(pages / ns)), is lowest; the smallest such count, at most one per
// page and kMaxSplit. Fewer chunks also mean less combine work.
int nsplit_of(int items, int max_kv, int sms = sm_count()) {
  const int pages = std::max(1, (max_kv + kPage - 1) / kPage);
  // The split's partial rows are at most kMaxWorkspaceBytes (a prefill-sized launch runs unsplit).
  const int64_t per = int64_t(items) * kRows * (kMaxRank + 2) * int64_t(sizeof(float));
  const int top = int(std::min<int64_t>({pages, kMaxSplit, std::max<int64_t>(1, kMaxWorkspaceBytes / per)}));
  int best = 1;
  double best_t = 1e300;
  for (int ns = 1; ns <= top; ++ns) {
    const double t = double((int64_t(items) * ns + sms - 1) / sms) * double((pages + ns - 1) / ns) + 0.02 * ns;
    if (t < best_t) best_t = t, best = ns;
  }
  return best;
}

size_t ws_bytes_of(size_t items, int nsplit, int R) {
  return nsplit <= 1 ? 0 : items * size_t(nsplit) * kRows * (size_t(R) + 2) * sizeof(float);
}

void check_latent(const char* fn, const MlaDims& d) {
  const int D = d.rank + d.rope;
  if (d.heads <= 0 || d.heads > 65535 || (d.rank != 128 && d.rank != 256 && d.rank != 512) || d.rope < 0 ||
      D % 16 != 0 || D > kMlaLatentMaxDim)
    throw std::invalid_argument(std::string(fn) + ": unsupported latent sizes heads " + std::to_string(d.heads) +
                                ", rank " + std::to_string(d.rank) + ", rope " + std::to_string(d.rope) +
                                " (rank 128, 256 or 512; rank + rope a multiple of 16, at most " +
                                std::to_string(kMlaLatentMaxDim) + ")");
}

}  // namespace

bool mla_latent_supported(const MlaDims& d) {
  try {
    check_latent("", d);
    return true;
  } catch (const std::invalid_argument&) {
    return false;
  }
}

MlaAttnWorkspace::~MlaAttnWorkspace() {
  if (mem_) cudaFree(mem_);
}

void MlaAttnWorkspace::reserve(int max_groups, int max_q, int heads, int rank, int max_kv) {
  if (max_groups <= 0 || max_q <= 0 || heads <= 0 || rank <= 0 || max_kv <= 0)
    throw std::invalid_argument("MlaAttnWorkspace::reserve: sizes must be positive");
  // The chunk count depends on the launch's item count: the largest need over every group count up to max_groups.
  const std::array<int, 5> key{max_groups, max_q, heads, rank, max_kv};
  if (key == reserved_for_) return;  // decode steps reserve every step: the answer is the same
  const int tiles = row_tiles_of(max_q, heads), sms = sm_count();
  size_t need = 0;
  for (int g = 1; g <= max_groups; ++g) {
    const size_t items = size_t(g) * tiles;
    need = std::max(need, ws_bytes_of(items, nsplit_of(int(std::min<size_t>(items, 1 << 30)), max_kv, sms), rank));
  }
  ensure(need, nullptr, "MlaAttnWorkspace::reserve");
  reserved_for_ = key;
}

void MlaAttnWorkspace::ensure(size_t bytes, cudaStream_t stream, const char* fn) {
  if (bytes <= bytes_) return;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (stream) check_cuda(cudaStreamIsCapturing(stream, &cs), fn);
  if (cs != cudaStreamCaptureStatusNone)
    throw std::invalid_argument(std::string(fn) + ": the workspace would grow to " + std::to_string(bytes) +
                                " bytes while the stream is capturing (reserve it first)");
  if (mem_) {
    check_cuda(cudaDeviceSynchronize(), fn);
    check_cuda(cudaFree(mem_), fn);
    mem_ = nullptr, bytes_ = 0;
  }
  check_cuda(cudaMalloc(&mem_, bytes), std::string(fn) + ": cudaMalloc of " + std::to_string(bytes) + " bytes");
  bytes_ = bytes;
}

void mla_attention_latent(const AttnGroups& g, const MlaDims& d, const bf16* q_lat, const bf16* pool, float scale,
                          bf16* out, MlaAttnWorkspace& ws, cudaStream_t stream) {
  const char* fn = "mla_attention_latent";
  check_latent(fn, d);
  if (g.num_groups < 0 || g.num_groups > 65535)
    throw std::invalid_argument(std::string(fn) + ": num_groups " + std::to_string(g.num_groups) +
                                " outside 0 ..= 65535");
  if (g.num_groups == 0 || g.total_q == 0) return;
  if (!g.q_start || !g.slot0 || !g.block_table || !q_lat || !pool || !out)
    throw std::invalid_argument(std::string(fn) + ": null pointer");
  if (g.max_pages < 1 || g.max_q < 1 || g.max_kv < 1)
    throw std::invalid_argument(std::string(fn) + ": max_pages, max_q and max_kv must be >= 1");
  if ((reinterpret_cast<uintptr_t>(q_lat) | reinterpret_cast<uintptr_t>(pool) | reinterpret_cast<uintptr_t>(out)) %
      16)
    throw std::invalid_argument(std::string(fn) + ": q_lat, pool and out must be 16-byte aligned");
  const int row_tiles = row_tiles_of(g.max_q, d.heads);
  if (int64_t(row_tiles) * kRows > INT32_MAX)
    throw std::invalid_argument(std::string(fn) + ": max_q * heads over 2^31 - 1");
  const size_t items = size_t(g.num_groups) * row_tiles;
  MlaAttnParams p{};
  p.num_groups = g.num_groups, p.heads = d.heads, p.R = d.rank, p.D = d.rank + d.rope;
  p.nsplit = nsplit_of(int(std::min<size_t>(items, 1 << 30)), g.max_kv);
  const int pages = (g.max_kv + kPage - 1) / kPage;
  p.chunk_pages = (pages + p.nsplit - 1) / p.nsplit;
  static CandidateSwitch seq_chunks("HYPIC_MLA_SEQ_CHUNKS");
  p.seq_chunks = seq_chunks.on() ? 1 : 0;
  p.row_tiles = row_tiles;
  p.q_start = g.q_start, p.slot0 = g.slot0, p.block_table = g.block_table, p.max_pages = g.max_pages;
  p.q = q_lat, p.pool = pool, p.scale_log2 = scale * kLog2e, p.out = out;
  if (p.nsplit > 1) {
    ws.ensure(ws_bytes_of(items, p.nsplit, d.rank), stream, fn);
    p.ws_ml = static_cast<float*>(ws.mem_);
    p.ws_o = p.ws_ml + items * p.nsplit * kRows * 2;
  }
  const size_t smem = smem_bytes(p.D);
  const dim3 grid(unsigned(row_tiles), unsigned(p.nsplit), unsigned(g.num_groups));  // nsplit <= kMaxSplit
  auto launch = [&](auto kernel) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), fn);
    kernel<<<grid, kThreads, smem, stream>>>(p);
  };
  switch (d.rank) {
    case 128: launch(mla_attn_kernel<2>); break;
    case 256: launch(mla_attn_kernel<4>); break;
    default: launch(mla_attn_kernel<8>); break;
  }
  check_cuda(cudaGetLastError(), std::string(fn) + " launch");
  if (p.nsplit > 1) {
    mla_combine_kernel<<<dim3(unsigned(row_tiles * kRows), unsigned(g.num_groups)), kCombineThreads, 0, stream>>>(p);
    check_cuda(cudaGetLastError(), std::string(fn) + " combine launch");
  }
}

}  // namespace hypic::kernels::cuda
