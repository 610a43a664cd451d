// MLA kernels around the latent KV cache (store, gather, expansion, query layouts). Contracts: mla.h.
#include "kernels/cuda/mla.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_check.h"

namespace hypic::kernels::cuda {

int MlaDims::padded() const {
  const int need = std::max(nope + rope, v);
  for (int p : {64, 128, 256})
    if (need <= p) return p;
  return 0;
}

namespace {

void check_dims(const char* fn, const MlaDims& d) {
  if (d.heads <= 0 || d.nope < 0 || d.rope < 0 || d.v <= 0 || d.rank <= 0 || d.nope + d.rope <= 0 || d.padded() == 0)
    throw std::invalid_argument(std::string(fn) + ": unsupported MLA sizes heads " + std::to_string(d.heads) +
                                ", nope " + std::to_string(d.nope) + ", rope " + std::to_string(d.rope) + ", v " +
                                std::to_string(d.v) + ", rank " + std::to_string(d.rank) +
                                " (nope + rope and v at most 256)");
}

// One warp per token: the normed latent and the copied k_rot into pool row kv_rows[t].
__global__ void mla_latent_store_kernel(int T, int R, int rope, const bf16* __restrict__ ckv,
                                        const bf16* __restrict__ w, float eps, const int* __restrict__ kv_rows,
                                        bf16* __restrict__ pool) {
  const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (t >= T) return;
  const int D = R + rope;
  const bf16* x = ckv + size_t(t) * D;
  bf16* row = pool + size_t(kv_rows[t]) * D;
  float ss = 0.f;
  for (int i = lane; i < R; i += 32) {
    const float v = __bfloat162float(x[i]);
    ss = fmaf(v, v, ss);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float inv = 1.0f / sqrtf(ss / R + eps);
  for (int i = lane; i < R; i += 32) row[i] = __float2bfloat16_rn(__bfloat162float(w[i]) * (__bfloat162float(x[i]) * inv));
  for (int i = R + lane; i < D; i += 32) row[i] = x[i];
}

__global__ void mla_gather_kernel(int n, int D, const int* __restrict__ src_rows, const bf16* __restrict__ pool,
                                  bf16* __restrict__ out) {
  const int i = blockIdx.x;
  const int src = src_rows[i];
  for (int j = threadIdx.x; j < D; j += blockDim.x)
    out[size_t(i) * D + j] = src >= 0 ? pool[size_t(src) * D + j] : __float2bfloat16_rn(0.f);
}

__global__ void mla_import_kernel(int D, int num_runs, const int* __restrict__ run_start,
                                  const bf16* const* __restrict__ src, const int* __restrict__ kv_rows,
                                  bf16* __restrict__ pool) {
  const int i = blockIdx.x;
  const int r = detail::find_group(run_start, num_runs, i);
  const bf16* s = src[r] + size_t(i - run_start[r]) * D;
  bf16* d = pool + size_t(kv_rows[i]) * D;
  for (int j = threadIdx.x; j < D; j += blockDim.x) d[j] = s[j];
}

// Grid-stride over (row, head, 8-value chunk of rope): k_out[i][h][nope + 8c ..] = lat[i][R + 8c ..], 16-byte moves
// (vec) or element by element.
__global__ void mla_expand_rope_kernel(int n, int nh, int nope, int rope, int R, int P, bool vec,
                                       const bf16* __restrict__ lat, bf16* __restrict__ k_out) {
  const int chunks = (rope + 7) / 8;
  const size_t total = size_t(n) * nh * chunks;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const int c = int(i % chunks);
    const size_t th = i / chunks, row = th / nh;
    const bf16* src = lat + row * (R + rope) + R + c * 8;
    bf16* dst = k_out + th * P + nope + c * 8;
    if (vec) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int j = 0; j < 8 && c * 8 + j < rope; ++j) dst[j] = src[j];
    }
  }
}

// Grid-stride over (t, h, j): q_pad (j < P) or the rope part of q_lat (j < rope).
__global__ void mla_query_copy_kernel(int T, int nh, int qk, int nope, int width, int out_ld, int out_off, bool pad,
                                      const bf16* __restrict__ q, bf16* __restrict__ out) {
  const size_t n = size_t(T) * nh * width;
  const bf16 zero = __float2bfloat16_rn(0.f);
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t th = i / width;
    const int j = int(i % width);
    const bf16* src = q + th * qk;
    if (pad)
      out[th * out_ld + j] = j < qk ? src[j] : zero;
    else
      out[th * out_ld + out_off + j] = src[nope + j];
  }
}

__global__ void mla_transpose_uk_kernel(int nope, int v, int R, const bf16* __restrict__ kv_b, bf16* __restrict__ out) {
  const int h = blockIdx.y, r = blockIdx.x;
  for (int i = threadIdx.x; i < nope; i += blockDim.x)
    out[(size_t(h) * R + r) * nope + i] = kv_b[(size_t(h) * (nope + v) + i) * R + r];
}

__global__ void mla_pack_kernel(int T, int nh, int v, int P, const bf16* __restrict__ attn, bf16* __restrict__ out) {
  const size_t n = size_t(T) * nh * v;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t th = i / v;
    const int j = static_cast<int>(i % v);
    out[i] = attn[th * P + j];
  }
}

int grid_for(size_t n) { return static_cast<int>(std::max<size_t>(1, std::min<size_t>((n + 255) / 256, size_t(sm_count()) * 8))); }

}  // namespace

void mla_latent_store(int T, const MlaDims& d, const bf16* ckv, const bf16* w, float eps, const int* kv_rows,
                      bf16* pool, cudaStream_t stream) {
  check_dims("mla_latent_store", d);
  if (T < 0) throw std::invalid_argument("mla_latent_store: T " + std::to_string(T) + " < 0");
  if (T == 0) return;
  if (!ckv || !w || !kv_rows || !pool) throw std::invalid_argument("mla_latent_store: null pointer");
  mla_latent_store_kernel<<<(T + 7) / 8, 256, 0, stream>>>(T, d.rank, d.rope, ckv, w, eps, kv_rows, pool);
  check_cuda(cudaGetLastError(), "mla_latent_store launch");
}

void mla_gather_latent(int n, const MlaDims& d, const int* src_rows, const bf16* pool, bf16* out, cudaStream_t stream) {
  check_dims("mla_gather_latent", d);
  if (n < 0) throw std::invalid_argument("mla_gather_latent: n " + std::to_string(n) + " < 0");
  if (n == 0) return;
  if (!src_rows || !pool || !out) throw std::invalid_argument("mla_gather_latent: null pointer");
  mla_gather_kernel<<<n, 128, 0, stream>>>(n, d.rank + d.rope, src_rows, pool, out);
  check_cuda(cudaGetLastError(), "mla_gather_latent launch");
}

void mla_latent_import(int n, int num_runs, const MlaDims& d, const int* run_start, const bf16* const* src,
                       const int* kv_rows, bf16* pool, cudaStream_t stream) {
  check_dims("mla_latent_import", d);
  if (n < 0) throw std::invalid_argument("mla_latent_import: n " + std::to_string(n) + " < 0");
  if (num_runs < 0 || (n > 0 && num_runs == 0))
    throw std::invalid_argument("mla_latent_import: num_runs " + std::to_string(num_runs) + " for " +
                                std::to_string(n) + " rows");
  if (n == 0) return;
  for (const auto& [ptr, name] : {std::pair<const void*, const char*>{run_start, "run_start"}, {src, "src"},
                                  {kv_rows, "kv_rows"}, {pool, "pool"}})
    if (!ptr) throw std::invalid_argument(std::string("mla_latent_import: ") + name + " is null");
  mla_import_kernel<<<n, 128, 0, stream>>>(d.rank + d.rope, num_runs, run_start, src, kv_rows, pool);
  check_cuda(cudaGetLastError(), "mla_latent_import launch");
}

void mla_expand_rope(int n, const MlaDims& d, const bf16* lat, bf16* k_out, cudaStream_t stream) {
  check_dims("mla_expand_rope", d);
  if (n < 0) throw std::invalid_argument("mla_expand_rope: n " + std::to_string(n) + " < 0");
  if (n == 0 || d.rope == 0) return;
  if (!lat || !k_out) throw std::invalid_argument("mla_expand_rope: null pointer");
  const int P = d.padded(), D = d.rank + d.rope;
  const bool vec = d.nope % 8 == 0 && d.rope % 8 == 0 && P % 8 == 0 && D % 8 == 0 && d.rank % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(lat) % 16 == 0 && reinterpret_cast<uintptr_t>(k_out) % 16 == 0;
  mla_expand_rope_kernel<<<grid_for(size_t(n) * d.heads * ((d.rope + 7) / 8)), 256, 0, stream>>>(
      n, d.heads, d.nope, d.rope, d.rank, P, vec, lat, k_out);
  check_cuda(cudaGetLastError(), "mla_expand_rope launch");
}

void mla_pad_query(int T, const MlaDims& d, const bf16* q, bf16* q_pad, cudaStream_t stream) {
  check_dims("mla_pad_query", d);
  if (T < 0) throw std::invalid_argument("mla_pad_query: T " + std::to_string(T) + " < 0");
  if (T == 0) return;
  if (!q || !q_pad) throw std::invalid_argument("mla_pad_query: null pointer");
  const int P = d.padded(), qk = d.nope + d.rope;
  mla_query_copy_kernel<<<grid_for(size_t(T) * d.heads * P), 256, 0, stream>>>(T, d.heads, qk, d.nope, P, P, 0, true,
                                                                               q, q_pad);
  check_cuda(cudaGetLastError(), "mla_pad_query launch");
}

void mla_query_rope(int T, const MlaDims& d, const bf16* q, bf16* q_lat, cudaStream_t stream) {
  check_dims("mla_query_rope", d);
  if (T < 0) throw std::invalid_argument("mla_query_rope: T " + std::to_string(T) + " < 0");
  if (T == 0 || d.rope == 0) return;
  if (!q || !q_lat) throw std::invalid_argument("mla_query_rope: null pointer");
  const int qk = d.nope + d.rope, D = d.rank + d.rope;
  mla_query_copy_kernel<<<grid_for(size_t(T) * d.heads * d.rope), 256, 0, stream>>>(T, d.heads, qk, d.nope, d.rope, D,
                                                                                     d.rank, false, q, q_lat);
  check_cuda(cudaGetLastError(), "mla_query_rope launch");
}

void mla_transpose_uk(const MlaDims& d, const bf16* kv_b, bf16* w_uk_t, cudaStream_t stream) {
  check_dims("mla_transpose_uk", d);
  if (d.nope == 0) return;
  if (!kv_b || !w_uk_t) throw std::invalid_argument("mla_transpose_uk: null pointer");
  if (d.heads > 65535) throw std::invalid_argument("mla_transpose_uk: heads > 65535");
  mla_transpose_uk_kernel<<<dim3(unsigned(d.rank), unsigned(d.heads)), 128, 0, stream>>>(d.nope, d.v, d.rank, kv_b,
                                                                                        w_uk_t);
  check_cuda(cudaGetLastError(), "mla_transpose_uk launch");
}

void mla_pack_output(int T, const MlaDims& d, const bf16* attn, bf16* out, cudaStream_t stream) {
  check_dims("mla_pack_output", d);
  if (T < 0) throw std::invalid_argument("mla_pack_output: T " + std::to_string(T) + " < 0");
  if (T == 0) return;
  if (!attn || !out) throw std::invalid_argument("mla_pack_output: null pointer");
  mla_pack_kernel<<<grid_for(size_t(T) * d.heads * d.v), 256, 0, stream>>>(T, d.heads, d.v, d.padded(), attn, out);
  check_cuda(cudaGetLastError(), "mla_pack_output launch");
}

}  // namespace hypic::kernels::cuda
