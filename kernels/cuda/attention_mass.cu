// attention_key_mass (kernels/cuda/attention.h): the attention probability a span's queries pay each KV slot,
// the probe of a splice's query-aware refresh. One block per (query, head): pass 1 the softmax max and sum over the
// visible slots (fp32, online), pass 2 each slot's probability added to mass[slot] with atomicAdd. K is read twice;
// the probe runs once per refreshing request on a short query, so simplicity wins over a fused kernel.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cfloat>
#include <stdexcept>
#include <string>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_check.h"

namespace hypic::kernels::cuda {
namespace {

constexpr int kMassThreads = 256;

__device__ __forceinline__ float slot_score(const float* q_s, const bf16* k_pool, const int* block_table, int slot,
                                            int num_kv_heads, int kv_head, int head_dim, float scale) {
  const long row = long(block_table[slot / kKvPageTokens]) * kKvPageTokens + slot % kKvPageTokens;
  const bf16* k = k_pool + (row * num_kv_heads + kv_head) * head_dim;
  float d = 0.f;
  for (int e = 0; e < head_dim; e += 2) {
    const __nv_bfloat162 kk = *reinterpret_cast<const __nv_bfloat162*>(k + e);
    d += q_s[e] * __bfloat162float(kk.x) + q_s[e + 1] * __bfloat162float(kk.y);
  }
  return d * scale;
}

__global__ void key_mass_kernel(int num_heads, int num_kv_heads, int head_dim, const bf16* q, int slot0,
                                const int* block_table, const bf16* k_pool, float scale, float* mass) {
  extern __shared__ float q_s[];  // [head_dim]
  __shared__ float red_m[kMassThreads / 32], red_l[kMassThreads / 32];
  const int t = blockIdx.x, h = blockIdx.y;
  const int kv_head = h / (num_heads / num_kv_heads);
  const bf16* qrow = q + (long(t) * num_heads + h) * head_dim;
  for (int e = threadIdx.x; e < head_dim; e += blockDim.x) q_s[e] = __bfloat162float(qrow[e]);
  __syncthreads();
  const int visible = slot0 + t + 1;
  float m = -FLT_MAX, l = 0.f;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) {
    const float s = slot_score(q_s, k_pool, block_table, j, num_kv_heads, kv_head, head_dim, scale);
    if (s > m) {
      l = l * __expf(m - s) + 1.f;
      m = s;
    } else {
      l += __expf(s - m);
    }
  }
  // Block reduction of (m, l): warp shuffles, then the warps' partials.
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l, off);
    const float mm = fmaxf(m, m2);
    l = (m == -FLT_MAX ? 0.f : l * __expf(m - mm)) + (m2 == -FLT_MAX ? 0.f : l2 * __expf(m2 - mm));
    m = mm;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) red_m[warp] = m, red_l[warp] = l;
  __syncthreads();
  if (threadIdx.x == 0) {
    float M = -FLT_MAX, L = 0.f;
    for (int w = 0; w < int(blockDim.x / 32); ++w) {
      if (red_m[w] == -FLT_MAX) continue;
      const float mm = fmaxf(M, red_m[w]);
      L = (M == -FLT_MAX ? 0.f : L * __expf(M - mm)) + red_l[w] * __expf(red_m[w] - mm);
      M = mm;
    }
    red_m[0] = M, red_l[0] = L;
  }
  __syncthreads();
  const float M = red_m[0], inv_L = 1.f / red_l[0];
  for (int j = threadIdx.x; j < visible; j += blockDim.x) {
    const float s = slot_score(q_s, k_pool, block_table, j, num_kv_heads, kv_head, head_dim, scale);
    atomicAdd(mass + j, __expf(s - M) * inv_L);
  }
}

}  // namespace

void attention_key_mass(int num_queries, int num_heads, int num_kv_heads, int head_dim, const bf16* q, int slot0,
                        const int* block_table, const bf16* k_pool, float scale, float* mass, cudaStream_t stream) {
  const char* fn = "attention_key_mass";
  if (num_queries < 0 || slot0 < 0)
    throw std::invalid_argument(std::string(fn) + ": num_queries " + std::to_string(num_queries) + " and slot0 " +
                                std::to_string(slot0) + " must be >= 0");
  if (num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0)
    throw std::invalid_argument(std::string(fn) + ": num_heads " + std::to_string(num_heads) +
                                " must be a positive multiple of num_kv_heads " + std::to_string(num_kv_heads));
  if (head_dim <= 0 || head_dim % 2 != 0 || head_dim > 1024)
    throw std::invalid_argument(std::string(fn) + ": head_dim " + std::to_string(head_dim) +
                                " must be even and in (0, 1024]");
  if (num_heads > 65535)
    throw std::invalid_argument(std::string(fn) + ": num_heads " + std::to_string(num_heads) + " above 65535");
  if (num_queries == 0) return;
  if (!q || !block_table || !k_pool || !mass)
    throw std::invalid_argument(std::string(fn) + ": null q, block_table, k_pool or mass");
  key_mass_kernel<<<dim3(unsigned(num_queries), unsigned(num_heads)), kMassThreads, size_t(head_dim) * sizeof(float),
                    stream>>>(num_heads, num_kv_heads, head_dim, q, slot0, block_table, k_pool, scale, mass);
  check_cuda(cudaGetLastError(), fn);
}

}  // namespace hypic::kernels::cuda
