// Depthwise causal conv1d + SiLU in front of the gated delta rule (see gated_delta.h).
// PyTorch cross-correlation convention: y[t][c] = silu(sum_j w[c][j] z[t - (K-1) + j][c]), where z
// is the sequence's inputs preceded by its K-1 conv-state inputs; fp32 accumulation, one rounding
// to bf16 (HF runs F.conv1d + silu in the model dtype; docs/research/hybrid_models.md 1.5 step 2).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gated_delta.h"

namespace hypic::kernels::cuda {
namespace {

constexpr int kMaxKernel = 8;

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }

// One thread per (token, 8 channels).
__global__ void conv_prefill_kernel(int num_seqs, const int* __restrict__ cu, int total, int channels, int K,
                                    const bf16* __restrict__ x, const bf16* __restrict__ w,
                                    const bf16* __restrict__ state, bf16* __restrict__ y) {
  const int groups = channels / 8;
  const long long n = static_cast<long long>(total) * groups;
  for (long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(idx / groups), c0 = static_cast<int>(idx % groups) * 8;
    int lo = 0, hi = num_seqs;  // largest s with cu[s] <= t (empty sequences skipped)
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (cu[mid] <= t) lo = mid; else hi = mid;
    }
    const int s = lo, tl = t - cu[s];
    float acc[8] = {};
    for (int j = 0; j < K; ++j) {
      const int p = tl - (K - 1) + j;
      uint4 raw;
      if (p >= 0)
        raw = *reinterpret_cast<const uint4*>(x + size_t(cu[s] + p) * channels + c0);
      else if (state)
        raw = *reinterpret_cast<const uint4*>(state + (size_t(s) * (K - 1) + (K - 1 + p)) * channels + c0);
      else
        raw = make_uint4(0, 0, 0, 0);
      const bf16* xv = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = fmaf(__bfloat162float(w[(c0 + e) * K + j]), __bfloat162float(xv[e]), acc[e]);
    }
    uint4 o;
    bf16* ov = reinterpret_cast<bf16*>(&o);
#pragma unroll
    for (int e = 0; e < 8; ++e) ov[e] = __float2bfloat16_rn(silu(acc[e]));
    *reinterpret_cast<uint4*>(y + size_t(t) * channels + c0) = o;
  }
}

// One thread per (sequence, channel): conv tail = last K-1 entries of (state ++ x). Entry m reads
// position len + m of that concatenation, never an entry this thread already overwrote.
__global__ void conv_tail_kernel(int num_seqs, const int* __restrict__ cu, int channels, int K,
                                 const bf16* __restrict__ x, bf16* state) {
  const long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<long long>(num_seqs) * channels) return;
  const int s = static_cast<int>(idx / channels), c = static_cast<int>(idx % channels);
  const int t0 = cu[s], len = cu[s + 1] - t0;
  bf16* st = state + size_t(s) * (K - 1) * channels + c;
  for (int m = 0; m < K - 1; ++m) {
    const int p = len + m;  // index into state ++ x
    st[size_t(m) * channels] =
        p < K - 1 ? st[size_t(p) * channels] : x[size_t(t0 + p - (K - 1)) * channels + c];
  }
}

__global__ void conv_decode_kernel(int batch, int channels, int K, const bf16* __restrict__ x,
                                   const bf16* __restrict__ w, bf16* state, bf16* __restrict__ y,
                                   const int* __restrict__ slots) {
  const long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<long long>(batch) * channels) return;
  const int b = static_cast<int>(idx / channels), c = static_cast<int>(idx % channels);
  bf16* st = state + size_t(slots ? slots[b] : b) * (K - 1) * channels + c;
  float z[kMaxKernel];
  for (int j = 0; j < K - 1; ++j) z[j] = __bfloat162float(st[size_t(j) * channels]);
  const bf16 xin = x[idx];
  z[K - 1] = __bfloat162float(xin);
  float acc = 0.f;
  for (int j = 0; j < K; ++j) acc = fmaf(__bfloat162float(w[c * K + j]), z[j], acc);
  for (int j = 0; j + 1 < K - 1; ++j) st[size_t(j) * channels] = st[size_t(j + 1) * channels];
  st[size_t(K - 2) * channels] = xin;
  y[idx] = __float2bfloat16_rn(silu(acc));
}

void check_conv(int channels, int kernel, const char* fn) {
  if (channels < 8 || channels % 8 != 0)
    throw std::invalid_argument(std::string(fn) + ": channels must be a positive multiple of 8, got " +
                                std::to_string(channels));
  if (kernel < 2 || kernel > kMaxKernel)
    throw std::invalid_argument(std::string(fn) + ": kernel must be in [2, 8], got " + std::to_string(kernel));
}

}  // namespace

void conv1d_silu_prefill(int num_seqs, const int* cu_seqlens, int total_tokens, int channels, int kernel,
                         const bf16* x, const bf16* weight, bf16* conv_state, bf16* y, cudaStream_t stream) {
  check_conv(channels, kernel, "conv1d_silu_prefill");
  if (num_seqs < 1 || total_tokens < 0)
    throw std::invalid_argument("conv1d_silu_prefill: num_seqs must be >= 1 and total_tokens >= 0, got " +
                                std::to_string(num_seqs) + ", " + std::to_string(total_tokens));
  if (!cu_seqlens || !weight || (total_tokens > 0 && (!x || !y)))
    throw std::invalid_argument("conv1d_silu_prefill: cu_seqlens, weight, x and y must be non-null");
  if (total_tokens > 0) {
    const long long work = static_cast<long long>(total_tokens) * (channels / 8);
    const int blocks = static_cast<int>(std::min<long long>((work + 255) / 256, 1 << 20));
    conv_prefill_kernel<<<blocks, 256, 0, stream>>>(num_seqs, cu_seqlens, total_tokens, channels, kernel, x, weight,
                                                    conv_state, y);
    check_cuda(cudaGetLastError(), "conv_prefill_kernel launch");
  }
  if (conv_state) {
    const long long work = static_cast<long long>(num_seqs) * channels;
    conv_tail_kernel<<<static_cast<int>((work + 255) / 256), 256, 0, stream>>>(num_seqs, cu_seqlens, channels, kernel,
                                                                              x, conv_state);
    check_cuda(cudaGetLastError(), "conv_tail_kernel launch");
  }
}

void conv1d_silu_decode(int batch, int channels, int kernel, const bf16* x, const bf16* weight, bf16* conv_state,
                        bf16* y, cudaStream_t stream, const int* state_slots) {
  check_conv(channels, kernel, "conv1d_silu_decode");
  if (batch < 0) throw std::invalid_argument("conv1d_silu_decode: negative batch " + std::to_string(batch));
  if (batch == 0) return;
  if (!x || !weight || !conv_state || !y)
    throw std::invalid_argument("conv1d_silu_decode: x, weight, conv_state and y must be non-null");
  const long long work = static_cast<long long>(batch) * channels;
  conv_decode_kernel<<<static_cast<int>((work + 255) / 256), 256, 0, stream>>>(batch, channels, kernel, x, weight,
                                                                              conv_state, y, state_slots);
  check_cuda(cudaGetLastError(), "conv_decode_kernel launch");
}

}  // namespace hypic::kernels::cuda
