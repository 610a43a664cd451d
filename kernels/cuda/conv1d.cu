// Depthwise causal conv1d + SiLU in front of the gated delta rule (see gated_delta.h).
// PyTorch cross-correlation convention: y[t][c] = silu(sum_j w[c][j] z[t - (K-1) + j][c]), where z
// is the sequence's inputs preceded by its K-1 conv-state inputs; fp32 accumulation, one rounding
// to bf16 (HF runs F.conv1d + silu in the model dtype; docs/research/hybrid_models.md 1.5 step 2).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/gated_delta_internal.h"
#include "kernels/cuda/gates.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/switches.h"

namespace hypic::kernels::cuda {
namespace {

constexpr int kMaxKernel = 8;
constexpr int kConvThreads = 128;  // channel groups of 8 per block
constexpr int kConvRun = 16;       // tokens per thread (one sliding window)
constexpr int kConvRunShort = 4;   // ... when kConvRun leaves fewer than kConvMinBlocks blocks (a splice's seams)
constexpr int kConvMinBlocks = 256;

using detail::conv_silu;       // (gates.cuh: shared with the conv fused into the WY kernel)
using detail::conv_silu_fast;

// CPT bf16 channels as one vector: 8 (16 bytes) or 4 (8 bytes).
template <int CPT>
struct ChanVec;
template <>
struct ChanVec<8> {
  using T = uint4;
  __device__ static T zero() { return make_uint4(0, 0, 0, 0); }
};
template <>
struct ChanVec<4> {
  using T = uint2;
  __device__ static T zero() { return make_uint2(0, 0); }
};

// Destination of output channels (whole [T][channels] rows, or split [Q | K | V] rows; see ConvQkvOut).
struct ConvDst {
  bf16* p[3];
  int c1, c2;   // channels [0, c1) -> p[0], [c1, c2) -> p[1], [c2, C) -> p[2]
  int w[3];     // row widths of p[0..2]
  __device__ __forceinline__ bf16* at(long long t, int c) const {
    return c < c1 ? p[0] + t * w[0] + c : c < c2 ? p[1] + t * w[1] + (c - c1) : p[2] + t * w[2] + (c - c2);
  }
};

ConvDst whole(bf16* y, int channels) { return {{y, y, y}, channels, channels, {channels, channels, channels}}; }

ConvDst split(const ConvQkvOut& o, int channels, const char* fn) {
  if (o.q_dim < 8 || o.q_dim % 8 != 0 || 2 * o.q_dim >= channels)
    throw std::invalid_argument(std::string(fn) + ": q_dim must be a positive multiple of 8 below channels / 2, got " +
                                std::to_string(o.q_dim) + " for " + std::to_string(channels) + " channels");
  return {{o.q, o.k, o.v}, o.q_dim, 2 * o.q_dim, {o.q_dim, o.q_dim, channels - 2 * o.q_dim}};
}

template <class V>
__device__ __forceinline__ void to_float(const V& raw, float* f) {
  const bf16* v = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
  for (int e = 0; e < int(sizeof(V) / 2); ++e) f[e] = __bfloat162float(v[e]);
}

// Input at local position p (< the run's first token) of sequence s for channels c0..c0+CPT-1: x inside the
// sequence, else the conv state's history (p in [-(K-1), 0)), else zero.
template <int CPT>
__device__ __forceinline__ typename ChanVec<CPT>::T history(const int* __restrict__ cu, int s, int p, int K,
                                                            int channels, int c0, const bf16* __restrict__ x,
                                                            const bf16* __restrict__ state) {
  using V = typename ChanVec<CPT>::T;
  if (p >= 0) return __ldg(reinterpret_cast<const V*>(x + size_t(cu[s] + p) * channels + c0));
  if (state) return __ldg(reinterpret_cast<const V*>(state + (size_t(s) * (K - 1) + (K - 1 + p)) * channels + c0));
  return ChanVec<CPT>::zero();
}

// Thread (token run r, channel group g): channels c0 = CPT g .. c0 + CPT - 1 of tokens [r RUN, (r + 1) RUN), sliding
// the window of the last K-1 inputs in registers; each input row is read once (plus K-1 rows of history per run) and
// each output written once. A sequence boundary inside the run restarts the window from that sequence's history.
// Outputs do not depend on RUN (a run's window starts from the same inputs the previous run slid over) nor on CPT;
// NARROW (CPT = 4, HYPIC_CONV_NARROW) also takes SiLU's division approximately (conv_silu_fast): half the registers, so
// twice the warps per SM to hide the FMA chains and the loads (the 8-channel kernel: 154 registers, 1.8 TB/s).
template <int K, int RUN, int CPT = 8, bool NARROW = false>
__global__ void __launch_bounds__(kConvThreads) conv_prefill_kernel(int num_seqs, const int* __restrict__ cu,
                                                                    int total, int channels,
                                                                    const bf16* __restrict__ x,
                                                                    const bf16* __restrict__ w,
                                                                    const bf16* __restrict__ state, ConvDst dst) {
  using V = typename ChanVec<CPT>::T;
  const int g = blockIdx.x * kConvThreads + threadIdx.x;
  if (g >= channels / CPT) return;
  const int c0 = g * CPT;
  float wf[K][CPT];  // w[c0 + e][j] -> wf[j][e]; the CPT K weights are contiguous, sizeof(V)-aligned
  {
    V raw[K];
#pragma unroll
    for (int i = 0; i < K; ++i) raw[i] = __ldg(reinterpret_cast<const V*>(w + size_t(c0) * K) + i);
    const bf16* wv = reinterpret_cast<const bf16*>(raw);
#pragma unroll
    for (int e = 0; e < CPT; ++e)
#pragma unroll
      for (int j = 0; j < K; ++j) wf[j][e] = __bfloat162float(wv[e * K + j]);
  }
  const int runs = (total + RUN - 1) / RUN;
  for (int r = blockIdx.y; r < runs; r += gridDim.y) {
    const int t0 = r * RUN, n = min(RUN, total - t0);
    V xr[RUN];
#pragma unroll
    for (int i = 0; i < RUN; ++i)
      if (i < n) xr[i] = __ldcs(reinterpret_cast<const V*>(x + size_t(t0 + i) * channels + c0));
    int lo = 0, hi = num_seqs;  // largest s with cu[s] <= t0: a sequence holding t0 (empty ones skipped)
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (cu[mid] <= t0) lo = mid; else hi = mid;
    }
    int s = lo, next = cu[s + 1];
    float win[K - 1][CPT];
#pragma unroll
    for (int j = 0; j < K - 1; ++j)
      to_float(history<CPT>(cu, s, t0 - cu[s] - (K - 1) + j, K, channels, c0, x, state), win[j]);
#pragma unroll
    for (int i = 0; i < RUN; ++i) {
      if (i >= n) break;
      const int t = t0 + i;
      if (t == next) {  // a new sequence starts here (block-uniform): its history, not the previous inputs
        while (s + 1 < num_seqs && cu[s + 1] <= t) ++s;  // bounded even if cu[num_seqs] != total (bad input)
        next = s + 1 < num_seqs ? cu[s + 1] : INT_MAX;
#pragma unroll
        for (int j = 0; j < K - 1; ++j) to_float(history<CPT>(cu, s, j - (K - 1), K, channels, c0, x, state), win[j]);
      }
      float xt[CPT], acc[CPT];
      to_float(xr[i], xt);
#pragma unroll
      for (int e = 0; e < CPT; ++e) {
        float a = 0.f;
#pragma unroll
        for (int j = 0; j < K - 1; ++j) a = fmaf(wf[j][e], win[j][e], a);
        acc[e] = fmaf(wf[K - 1][e], xt[e], a);
      }
#pragma unroll
      for (int j = 0; j + 1 < K - 1; ++j)
#pragma unroll
        for (int e = 0; e < CPT; ++e) win[j][e] = win[j + 1][e];
#pragma unroll
      for (int e = 0; e < CPT; ++e) win[K - 2][e] = xt[e];
      V o;
      bf16* ov = reinterpret_cast<bf16*>(&o);
#pragma unroll
      for (int e = 0; e < CPT; ++e) ov[e] = __float2bfloat16_rn(NARROW ? conv_silu_fast(acc[e]) : conv_silu(acc[e]));
      __stcs(reinterpret_cast<V*>(dst.at(t, c0)), o);
    }
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

__global__ void conv_decode_kernel(int batch, int channels, int K, const bf16* x,
                                   const bf16* __restrict__ w, bf16* state, ConvDst dst,
                                   const int* __restrict__ slots, int state_early) {
  const long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  const bool in = idx < static_cast<long long>(batch) * channels;
  const int b = in ? static_cast<int>(idx / channels) : 0, c = in ? static_cast<int>(idx % channels) : 0;
  bf16* st = state + size_t(in && slots ? slots[b] : b) * (K - 1) * channels + c;
  float z[kMaxKernel];
  auto load_state = [&] {  // (through L2: read once, and before the wait with state_early)
    for (int j = 0; j < K - 1; ++j) z[j] = __bfloat162float(__ldcg(st + size_t(j) * channels));
  };
  // state_early (the caller's state_read_early and HYPIC_CONV_STATE_EARLY): the conv state before the wait for the
  // previous kernel (x's writer): its writer completed before that kernel started waiting (conv1d_silu_decode's
  // contract; pdl.cuh).
  if (in && state_early) load_state();
  // (launched with PDL under HYPIC_DECODE_PDL_MIXERS: x is the previous kernel's output, so no __restrict__ on it:
  // a coherent load after the wait; see pdl.cuh)
  detail::griddep_wait();
  detail::griddep_launch_dependents();
  if (!in) return;
  if (!state_early) load_state();
  const bf16 xin = x[idx];
  z[K - 1] = __bfloat162float(xin);
  float acc = 0.f;
  for (int j = 0; j < K; ++j) acc = fmaf(__bfloat162float(w[c * K + j]), z[j], acc);
  for (int j = 0; j + 1 < K - 1; ++j) st[size_t(j) * channels] = st[size_t(j + 1) * channels];
  st[size_t(K - 2) * channels] = xin;
  *dst.at(b, c) = __float2bfloat16_rn(conv_silu(acc));
}

bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

void check_conv(int channels, int kernel, const char* fn) {
  if (channels < 8 || channels % 8 != 0)
    throw std::invalid_argument(std::string(fn) + ": channels must be a positive multiple of 8, got " +
                                std::to_string(channels));
  if (kernel < 2 || kernel > kMaxKernel)
    throw std::invalid_argument(std::string(fn) + ": kernel must be in [2, 8], got " + std::to_string(kernel));
}

template <int K, int CPT, bool NARROW>
void launch_conv_prefill_cpt(int num_seqs, const int* cu, int total, int channels, const bf16* x, const bf16* w,
                             const bf16* state, const ConvDst& dst, cudaStream_t stream) {
  const int gx = (channels / CPT + kConvThreads - 1) / kConvThreads;
  const int runs = (total + kConvRun - 1) / kConvRun;
  if (long(gx) * runs < kConvMinBlocks) {  // few tokens: shorter runs, more blocks (a latency-bound launch)
    const int short_runs = (total + kConvRunShort - 1) / kConvRunShort;
    conv_prefill_kernel<K, kConvRunShort, CPT, NARROW>
        <<<dim3(gx, std::min(short_runs, 65535)), kConvThreads, 0, stream>>>(num_seqs, cu, total, channels, x, w,
                                                                            state, dst);
    return;
  }
  const dim3 grid(gx, std::min(runs, 65535));
  conv_prefill_kernel<K, kConvRun, CPT, NARROW>
      <<<grid, kConvThreads, 0, stream>>>(num_seqs, cu, total, channels, x, w, state, dst);
}

// The 8-channel kernel, or with HYPIC_CONV_NARROW (a measured default, switches.h) the 4-channel one.
template <int K>
void launch_conv_prefill(int num_seqs, const int* cu, int total, int channels, const bf16* x, const bf16* w,
                         const bf16* state, const ConvDst& dst, cudaStream_t stream) {
  if (detail::conv_narrow_on())
    launch_conv_prefill_cpt<K, 4, true>(num_seqs, cu, total, channels, x, w, state, dst, stream);
  else
    launch_conv_prefill_cpt<K, 8, false>(num_seqs, cu, total, channels, x, w, state, dst, stream);
}

void launch_conv_tail(int num_seqs, const int* cu_seqlens, int channels, int kernel, const bf16* x, bf16* conv_state,
                      cudaStream_t stream) {
  const long long work = static_cast<long long>(num_seqs) * channels;
  conv_tail_kernel<<<static_cast<int>((work + 255) / 256), 256, 0, stream>>>(num_seqs, cu_seqlens, channels, kernel, x,
                                                                            conv_state);
  check_cuda(cudaGetLastError(), "conv_tail_kernel launch");
}

void conv_prefill(int num_seqs, const int* cu_seqlens, int total_tokens, int channels, int kernel, const bf16* x,
                  const bf16* weight, bf16* conv_state, const ConvDst& dst, cudaStream_t stream) {
  check_conv(channels, kernel, "conv1d_silu_prefill");
  if (num_seqs < 1 || total_tokens < 0 || total_tokens > INT_MAX - kConvRun)
    throw std::invalid_argument("conv1d_silu_prefill: num_seqs must be >= 1 and total_tokens in [0, 2^31 - 17], got " +
                                std::to_string(num_seqs) + ", " + std::to_string(total_tokens));
  if (!cu_seqlens || !weight || (total_tokens > 0 && (!x || !dst.p[0] || !dst.p[1] || !dst.p[2])))
    throw std::invalid_argument("conv1d_silu_prefill: cu_seqlens, weight, x and the outputs must be non-null");
  if (!aligned16({x, weight, conv_state, dst.p[0], dst.p[1], dst.p[2]}))
    throw std::invalid_argument("conv1d_silu_prefill: x, weight, conv_state and the outputs must be 16-byte aligned");
  if (total_tokens > 0) {
    using Launch = void (*)(int, const int*, int, int, const bf16*, const bf16*, const bf16*, const ConvDst&,
                            cudaStream_t);
    static constexpr Launch launch[kMaxKernel + 1] = {nullptr,
                                                      nullptr,
                                                      launch_conv_prefill<2>,
                                                      launch_conv_prefill<3>,
                                                      launch_conv_prefill<4>,
                                                      launch_conv_prefill<5>,
                                                      launch_conv_prefill<6>,
                                                      launch_conv_prefill<7>,
                                                      launch_conv_prefill<8>};
    launch[kernel](num_seqs, cu_seqlens, total_tokens, channels, x, weight, conv_state, dst, stream);
    check_cuda(cudaGetLastError(), "conv_prefill_kernel launch");
  }
  if (conv_state) launch_conv_tail(num_seqs, cu_seqlens, channels, kernel, x, conv_state, stream);
}

void conv_decode(int batch, int channels, int kernel, const bf16* x, const bf16* weight, bf16* conv_state,
                 const ConvDst& dst, cudaStream_t stream, const int* state_slots, bool state_read_early = false) {
  check_conv(channels, kernel, "conv1d_silu_decode");
  if (batch < 0) throw std::invalid_argument("conv1d_silu_decode: negative batch " + std::to_string(batch));
  if (batch == 0) return;
  if (!x || !weight || !conv_state || !dst.p[0] || !dst.p[1] || !dst.p[2])
    throw std::invalid_argument("conv1d_silu_decode: x, weight, conv_state and the outputs must be non-null");
  const long long work = static_cast<long long>(batch) * channels;
  static CandidateSwitch state_early("HYPIC_CONV_STATE_EARLY");
  detail::launch_pdl_if(detail::mixer_pdl(), conv_decode_kernel, dim3(static_cast<int>((work + 255) / 256)), dim3(256),
                        0, stream, "conv_decode_kernel launch", batch, channels, kernel, x, weight, conv_state, dst,
                        state_slots, state_read_early && state_early.on() ? 1 : 0);
}

}  // namespace

bool detail::conv_narrow_on() {
  static CandidateSwitch narrow("HYPIC_CONV_NARROW");
  return narrow.on();
}

void conv1d_state_tail(int num_seqs, const int* cu_seqlens, int channels, int kernel, const bf16* x, bf16* conv_state,
                       cudaStream_t stream) {
  check_conv(channels, kernel, "conv1d_state_tail");
  if (num_seqs < 1)
    throw std::invalid_argument("conv1d_state_tail: num_seqs must be >= 1, got " + std::to_string(num_seqs));
  if (!cu_seqlens || !x || !conv_state)
    throw std::invalid_argument("conv1d_state_tail: cu_seqlens, x and conv_state must be non-null");
  launch_conv_tail(num_seqs, cu_seqlens, channels, kernel, x, conv_state, stream);
}

void conv1d_silu_prefill(int num_seqs, const int* cu_seqlens, int total_tokens, int channels, int kernel,
                         const bf16* x, const bf16* weight, bf16* conv_state, bf16* y, cudaStream_t stream) {
  conv_prefill(num_seqs, cu_seqlens, total_tokens, channels, kernel, x, weight, conv_state, whole(y, channels), stream);
}

void conv1d_silu_prefill(int num_seqs, const int* cu_seqlens, int total_tokens, int channels, int kernel,
                         const bf16* x, const bf16* weight, bf16* conv_state, const ConvQkvOut& out,
                         cudaStream_t stream) {
  check_conv(channels, kernel, "conv1d_silu_prefill");
  conv_prefill(num_seqs, cu_seqlens, total_tokens, channels, kernel, x, weight, conv_state,
               split(out, channels, "conv1d_silu_prefill"), stream);
}

void conv1d_silu_decode(int batch, int channels, int kernel, const bf16* x, const bf16* weight, bf16* conv_state,
                        bf16* y, cudaStream_t stream, const int* state_slots) {
  conv_decode(batch, channels, kernel, x, weight, conv_state, whole(y, channels), stream, state_slots);
}

void conv1d_silu_decode(int batch, int channels, int kernel, const bf16* x, const bf16* weight, bf16* conv_state,
                        const ConvQkvOut& out, cudaStream_t stream, const int* state_slots, bool state_read_early) {
  check_conv(channels, kernel, "conv1d_silu_decode");
  conv_decode(batch, channels, kernel, x, weight, conv_state, split(out, channels, "conv1d_silu_decode"), stream,
              state_slots, state_read_early);
}

}  // namespace hypic::kernels::cuda
