// MLA expansion kernels. Contracts: mla.h.
#include "kernels/cuda/mla.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

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

__global__ void mla_latent_norm_kernel(int T, int R, int ld, const bf16* __restrict__ ckv, const bf16* __restrict__ w,
                                       float eps, bf16* __restrict__ latent) {
  const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (t >= T) return;
  const bf16* x = ckv + size_t(t) * ld;
  float ss = 0.f;
  for (int i = lane; i < R; i += 32) {
    const float v = __bfloat162float(x[i]);
    ss = fmaf(v, v, ss);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float inv = 1.0f / sqrtf(ss / R + eps);
  for (int i = lane; i < R; i += 32)
    latent[size_t(t) * R + i] = __float2bfloat16_rn(__bfloat162float(w[i]) * (__bfloat162float(x[i]) * inv));
}

// One block per (token, head): thread j < P writes element j of q_pad, K and V.
__global__ void mla_expand_kernel(int nh, int nope, int rope, int v, int R, int P, const bf16* __restrict__ q,
                                  const bf16* __restrict__ ckv, const bf16* __restrict__ kvb,
                                  const int* __restrict__ kv_rows, bf16* __restrict__ q_pad, bf16* __restrict__ k_pool,
                                  bf16* __restrict__ v_pool) {
  const int t = blockIdx.x, h = blockIdx.y, qk = nope + rope;
  const bf16 zero = __float2bfloat16_rn(0.f);
  const size_t row = size_t(kv_rows[t]);
  const bf16* kv = kvb + (size_t(t) * nh + h) * (nope + v);
  for (int j = threadIdx.x; j < P; j += blockDim.x) {
    q_pad[(size_t(t) * nh + h) * P + j] = j < qk ? q[(size_t(t) * nh + h) * qk + j] : zero;
    k_pool[(row * nh + h) * P + j] = j < nope ? kv[j] : j < qk ? ckv[size_t(t) * (R + rope) + R + (j - nope)] : zero;
    v_pool[(row * nh + h) * P + j] = j < v ? kv[nope + j] : zero;
  }
}

__global__ void mla_pack_kernel(int T, int nh, int v, int P, const bf16* __restrict__ attn, bf16* __restrict__ out) {
  const size_t n = size_t(T) * nh * v;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t th = i / v;
    const int j = static_cast<int>(i % v);
    out[i] = attn[th * P + j];
  }
}

// One block per (row, head): pool row [P] <-> entry rows [qk] and [v] (to_pool: entry -> pool, zero-padded).
__global__ void mla_kv_rows_kernel(int nh, int qk, int v, int P, bool to_pool, const bf16* const* __restrict__ k_rows,
                                   const bf16* const* __restrict__ v_rows, bf16* const* __restrict__ k_out,
                                   bf16* const* __restrict__ v_out, const int* __restrict__ kv_rows,
                                   bf16* __restrict__ k_pool, bf16* __restrict__ v_pool) {
  const int i = blockIdx.x, h = blockIdx.y;
  const size_t prow = (size_t(kv_rows[i]) * nh + h) * P;
  const bf16 zero = __float2bfloat16_rn(0.f);
  if (to_pool) {
    const bf16* ks = k_rows[i] + size_t(h) * qk;
    const bf16* vs = v_rows[i] + size_t(h) * v;
    for (int j = threadIdx.x; j < P; j += blockDim.x) {
      k_pool[prow + j] = j < qk ? ks[j] : zero;
      v_pool[prow + j] = j < v ? vs[j] : zero;
    }
  } else {
    bf16* kd = k_out[i] + size_t(h) * qk;
    bf16* vd = v_out[i] + size_t(h) * v;
    for (int j = threadIdx.x; j < qk; j += blockDim.x) kd[j] = k_pool[prow + j];
    for (int j = threadIdx.x; j < v; j += blockDim.x) vd[j] = v_pool[prow + j];
  }
}

}  // namespace

void mla_latent_norm(int T, const MlaDims& d, const bf16* ckv, const bf16* w, float eps, bf16* latent,
                     cudaStream_t stream) {
  check_dims("mla_latent_norm", d);
  if (T < 0) throw std::invalid_argument("mla_latent_norm: T " + std::to_string(T) + " < 0");
  if (T == 0) return;
  if (!ckv || !w || !latent) throw std::invalid_argument("mla_latent_norm: null pointer");
  mla_latent_norm_kernel<<<(T + 7) / 8, 256, 0, stream>>>(T, d.rank, d.rank + d.rope, ckv, w, eps, latent);
  check_cuda(cudaGetLastError(), "mla_latent_norm launch");
}

void mla_expand(int T, const MlaDims& d, const bf16* q, const bf16* ckv, const bf16* kvb, const int* kv_rows,
                bf16* q_pad, bf16* k_pool, bf16* v_pool, cudaStream_t stream) {
  check_dims("mla_expand", d);
  if (T < 0) throw std::invalid_argument("mla_expand: T " + std::to_string(T) + " < 0");
  if (T == 0) return;
  if (!q || !ckv || !kvb || !kv_rows || !q_pad || !k_pool || !v_pool)
    throw std::invalid_argument("mla_expand: null pointer");
  if (d.heads > 65535) throw std::invalid_argument("mla_expand: heads > 65535");
  const int P = d.padded();
  mla_expand_kernel<<<dim3(unsigned(T), unsigned(d.heads)), std::min(P, 256), 0, stream>>>(
      d.heads, d.nope, d.rope, d.v, d.rank, P, q, ckv, kvb, kv_rows, q_pad, k_pool, v_pool);
  check_cuda(cudaGetLastError(), "mla_expand launch");
}

void mla_pack_output(int T, const MlaDims& d, const bf16* attn, bf16* out, cudaStream_t stream) {
  check_dims("mla_pack_output", d);
  if (T < 0) throw std::invalid_argument("mla_pack_output: T " + std::to_string(T) + " < 0");
  if (T == 0) return;
  if (!attn || !out) throw std::invalid_argument("mla_pack_output: null pointer");
  const size_t n = size_t(T) * d.heads * d.v;
  const int blocks = static_cast<int>(std::min<size_t>((n + 255) / 256, size_t(sm_count()) * 8));
  mla_pack_kernel<<<blocks, 256, 0, stream>>>(T, d.heads, d.v, d.padded(), attn, out);
  check_cuda(cudaGetLastError(), "mla_pack_output launch");
}

void mla_kv_import(int n, const MlaDims& d, const bf16* const* k_src, const bf16* const* v_src, const int* kv_rows,
                   bf16* k_pool, bf16* v_pool, cudaStream_t stream) {
  check_dims("mla_kv_import", d);
  if (n < 0) throw std::invalid_argument("mla_kv_import: n " + std::to_string(n) + " < 0");
  if (n == 0) return;
  if (!k_src || !v_src || !kv_rows || !k_pool || !v_pool) throw std::invalid_argument("mla_kv_import: null pointer");
  const int P = d.padded();
  mla_kv_rows_kernel<<<dim3(unsigned(n), unsigned(d.heads)), std::min(P, 256), 0, stream>>>(
      d.heads, d.nope + d.rope, d.v, P, true, k_src, v_src, nullptr, nullptr, kv_rows, k_pool, v_pool);
  check_cuda(cudaGetLastError(), "mla_kv_import launch");
}

void mla_kv_export(int n, const MlaDims& d, const bf16* k_pool, const bf16* v_pool, const int* kv_rows,
                   bf16* const* k_dst, bf16* const* v_dst, cudaStream_t stream) {
  check_dims("mla_kv_export", d);
  if (n < 0) throw std::invalid_argument("mla_kv_export: n " + std::to_string(n) + " < 0");
  if (n == 0) return;
  if (!k_dst || !v_dst || !kv_rows || !k_pool || !v_pool) throw std::invalid_argument("mla_kv_export: null pointer");
  const int P = d.padded();
  mla_kv_rows_kernel<<<dim3(unsigned(n), unsigned(d.heads)), std::min(P, 256), 0, stream>>>(
      d.heads, d.nope + d.rope, d.v, P, false, nullptr, nullptr, k_dst, v_dst, kv_rows, const_cast<bf16*>(k_pool),
      const_cast<bf16*>(v_pool));
  check_cuda(cudaGetLastError(), "mla_kv_export launch");
}

}  // namespace hypic::kernels::cuda
