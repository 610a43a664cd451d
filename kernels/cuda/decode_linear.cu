// Weight-streaming dense projections of decode (decode_linear.h): one block per row group of 16 weight rows (or a
// few row groups when K is short), its 8 warps splitting K; the core is kernels/cuda/stream_gemm.cuh.
#include "kernels/cuda/decode_linear.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/row_norm.cuh"
#include "kernels/cuda/stream_gemm.cuh"
#include "kernels/cuda/switches.h"

namespace hypic::kernels::cuda {

namespace {

using detail::kStreamChunk;
using detail::kStreamThreads;
using detail::kStreamWarps;

struct LinearOut {
  const bf16* W;
  void* y;
  long ldy;
  int N;
  int rg_begin;  // first row group (16 rows) of this output in the launch's numbering
};

struct LinearArgs {
  const bf16* x;
  long ldx;
  int M, K, ks_count, n_out, rg_total;
  LinearOut out[kMaxDecodeLinearOutputs];
  DecodeLinearNorm norm;  // NORM launches: the last block's norm of out[0]'s rows
};

static_assert(kStreamThreads == detail::kNormThreads, "the last block's norm uses rms_norm_residual's thread mapping");

// The last block's part of a NORM launch: every block counts itself done after its stores (each thread's stores
// fenced first); the block that counts last normalises the M output rows, row after row, with rms_norm_residual's
// thread mapping and order (row_norm.cuh), reading the rows from L2 (__ldcg: other blocks wrote them), and resets
// the counter for the stream's next launch.
template <bool kZeroCentred>
__device__ __forceinline__ void last_block_norm(const LinearArgs& a) {
  __shared__ float part[detail::kNormThreads / 32];
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(a.norm.counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const LinearOut& o = a.out[0];
  const float* y = static_cast<const float*>(o.y);
  for (int m = 0; m < a.M; ++m) {
    const float* xr = y + size_t(m) * o.ldy;
    float ss = 0.f;
    for (int c = threadIdx.x * 4; c < o.N; c += detail::kNormThreads * 4)
      ss = detail::norm_add_sq4(ss, __ldcg(reinterpret_cast<const float4*>(xr + c)));
    const float inv = detail::norm_block_inv(ss, part, o.N, a.norm.eps);
    for (int c = threadIdx.x * 4; c < o.N; c += detail::kNormThreads * 4)
      detail::norm_apply4<kZeroCentred>(__ldcg(reinterpret_cast<const float4*>(xr + c)), inv, a.norm.w,
                                        a.norm.y + size_t(m) * o.N, c);
    __syncthreads();  // part is rewritten by the next row
  }
  if (threadIdx.x == 0) *a.norm.counter = 0u;
}

// S: ring stages per warp (dense_stages). NORM: 0 none, 1 zero-centred, 2 plain (last_block_norm). XD: x loads
// ahead (stream_consume; NT = 1).
template <int NT, int EPI, int S, int NORM = 0, int XD = 0>
__global__ void __launch_bounds__(kStreamThreads, detail::stream_blocks_per_sm(S, NT))
    decode_linear_kernel(const LinearArgs a) {
  constexpr int kRing = S * detail::stream_stage_uint4(NT);  // a warp's ring, 16-byte words
  extern __shared__ uint4 ring_all[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int rg_per_block = kStreamWarps / a.ks_count;
  const int rg = blockIdx.x * rg_per_block + warp / a.ks_count, ks = warp % a.ks_count;
  const bool active = rg < a.rg_total;
  int oi = 0;
#pragma unroll
  for (int o = 1; o < kMaxDecodeLinearOutputs; ++o)
    if (o < a.n_out && rg >= a.out[o].rg_begin) oi = o;
  const LinearOut o = a.out[oi];
  const int r0 = (rg - o.rg_begin) * 16;
  // Rows past N (the last row group of an output) load row N - 1 and are not stored.
  const bf16* wlo = o.W + size_t(min(r0 + g, o.N - 1)) * a.K + q * 8;
  const bf16* whi = o.W + size_t(min(r0 + 8 + g, o.N - 1)) * a.K + q * 8;
  const bf16* xp[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) xp[t] = a.x + size_t(min(t * 8 + g, a.M - 1)) * a.ldx + q * 8;
  const int ntl = (a.M + 7) >> 3;
  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  const int kt = a.K / kStreamChunk;
  const int kb = (ks * kt) / a.ks_count, ke = ((ks + 1) * kt) / a.ks_count;
  uint4* ring = ring_all + warp * kRing;
  if (active) detail::stream_prologue<NT, S>(wlo, whi, kb, ke, ring, lane);  // weights: before the wait (pdl.cuh)
  detail::griddep_wait();
  detail::griddep_launch_dependents();
  if (active) detail::stream_consume<NT, S, XD>(wlo, whi, kb, ke, xp, ntl, ring, lane, acc);
  const bool store = detail::stream_reduce<NT, kRing>(acc, ntl, a.ks_count, ring_all) && active;
  if (!NORM && !store) return;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= ntl || !store) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = t * 8 + 2 * q + h;
      if (m >= a.M) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + half * 8 + g;
        if (r >= o.N) continue;
        const float v = acc[t][half * 2 + h];
        const size_t idx = size_t(m) * o.ldy + r;
        if (EPI == int(DecodeLinearEpilogue::StoreBf16))
          static_cast<bf16*>(o.y)[idx] = __float2bfloat16(v);
        else if (EPI == int(DecodeLinearEpilogue::StoreF32))
          static_cast<float*>(o.y)[idx] = v;
        else
          static_cast<float*>(o.y)[idx] += v;
      }
    }
  }
  if constexpr (NORM != 0) last_block_norm<NORM == 1>(a);
}

template <int NT, int EPI, int S, int NORM = 0, int XD = 0>
void launch_s(const LinearArgs& a, unsigned blocks, cudaStream_t stream) {
  auto kernel = decode_linear_kernel<NT, EPI, S, NORM, XD>;
  constexpr int smem = detail::stream_smem_bytes(S, NT);
  static DeviceOnce once;  // the attribute is per device
  once.run(current_device(), [&](int) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "decode_linear: shared memory attribute");
    return 0;
  });
  detail::launch_pdl(kernel, dim3(blocks), dim3(kStreamThreads), size_t(smem), stream, "decode_linear launch", a);
}

// Token groups (NT) and ring depth (S) for M tokens and K: 8 stages with one token group (64 KiB blocks, 3 per SM),
// 4 with more (x staged in the ring too); twice that when each warp's K slice has 16 chunks or more (K = 4096: a
// warp's whole slice in flight at once).
struct RingShape {
  int nt, stages;
};
RingShape ring_shape(int M, int K) {
  const int kt = K / kStreamChunk;
  const bool long_slices = kt / detail::stream_k_slices(kt) >= 16;
  if (M <= 8) return {1, long_slices ? 16 : 8};
  if (M <= 16) return {2, long_slices ? 8 : 4};
  return {M <= 32 ? 4 : 8, 4};
}

// x loads ahead at one token group (HYPIC_STREAM_X_AHEAD; stream_consume's XD).
constexpr int kXAhead = detail::kStreamXAhead;
bool x_ahead() {
  static CandidateSwitch sw("HYPIC_STREAM_X_AHEAD");
  return sw.on();
}

template <int EPI>
void launch_epi(const LinearArgs& a, unsigned blocks, cudaStream_t stream) {
  const RingShape r = ring_shape(a.M, a.K);
  if (r.nt == 1 && x_ahead())
    r.stages == 16 ? launch_s<1, EPI, 16, 0, kXAhead>(a, blocks, stream)
                   : launch_s<1, EPI, 8, 0, kXAhead>(a, blocks, stream);
  else if (r.nt == 1)
    r.stages == 16 ? launch_s<1, EPI, 16>(a, blocks, stream) : launch_s<1, EPI, 8>(a, blocks, stream);
  else if (r.nt == 2)
    r.stages == 8 ? launch_s<2, EPI, 8>(a, blocks, stream) : launch_s<2, EPI, 4>(a, blocks, stream);
  else if (r.nt == 4)
    launch_s<4, EPI, 4>(a, blocks, stream);
  else
    launch_s<8, EPI, 4>(a, blocks, stream);
}

// A NORM launch (M <= kDecodeLinearNormInBlockMaxTokens: one token group) of the AddF32 kernel.
template <int NORM>
void launch_norm(const LinearArgs& a, unsigned blocks, cudaStream_t stream) {
  constexpr int kAdd = int(DecodeLinearEpilogue::AddF32);
  const RingShape r = ring_shape(a.M, a.K);
  if (x_ahead())
    r.stages == 16 ? launch_s<1, kAdd, 16, NORM, kXAhead>(a, blocks, stream)
                   : launch_s<1, kAdd, 8, NORM, kXAhead>(a, blocks, stream);
  else
    r.stages == 16 ? launch_s<1, kAdd, 16, NORM>(a, blocks, stream) : launch_s<1, kAdd, 8, NORM>(a, blocks, stream);
}
static_assert(kDecodeLinearNormInBlockMaxTokens <= 8, "NORM launches have one token group");

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

bool decode_linear_supported(int M, int K, const bf16* x, long ldx, const DecodeLinearOutput* outputs, int n_outputs) {
  if (M < 1 || M > kMaxDecodeLinearTokens || K <= 0 || K % kStreamChunk != 0) return false;
  if (!x || !aligned16(x) || ldx < K || ldx % 8 != 0) return false;
  if (!outputs || n_outputs < 1 || n_outputs > kMaxDecodeLinearOutputs) return false;
  for (int i = 0; i < n_outputs; ++i) {
    const DecodeLinearOutput& o = outputs[i];
    if (!o.W || !aligned16(o.W) || !o.y || o.N < 1 || o.ldy < o.N) return false;
  }
  // The ring's shared memory must fit the device (227 KiB on sm_90; less elsewhere, where callers fall back).
  const RingShape r = ring_shape(M, K);
  return detail::stream_smem_bytes(r.stages, r.nt) <= current_device_smem_optin();
}

void decode_linear(int M, int K, const bf16* x, long ldx, const DecodeLinearOutput* outputs, int n_outputs,
                   DecodeLinearEpilogue epilogue, cudaStream_t stream, const DecodeLinearNorm* norm) {
  if (!decode_linear_supported(M, K, x, ldx, outputs, n_outputs))
    throw std::invalid_argument("decode_linear: unsupported arguments (M " + std::to_string(M) + " in 1.." +
                                std::to_string(kMaxDecodeLinearTokens) + ", K " + std::to_string(K) +
                                " a multiple of 32, ldx " + std::to_string(ldx) + " >= K and a multiple of 8, " +
                                std::to_string(n_outputs) + " outputs in 1.." +
                                std::to_string(kMaxDecodeLinearOutputs) +
                                ", 16-byte aligned x and weights, N >= 1, ldy >= N)");
  if (norm) {
    const bool ok = epilogue == DecodeLinearEpilogue::AddF32 && n_outputs == 1 && outputs[0].N % 4 == 0 &&
                    outputs[0].ldy % 4 == 0 && norm->w && norm->y && norm->counter;
    if (!ok)
      throw std::invalid_argument("decode_linear: the norm needs the AddF32 epilogue, one output with N and ldy "
                                  "multiples of 4 (got " + std::to_string(n_outputs) + " outputs, N " +
                                  std::to_string(outputs[0].N) + ", ldy " + std::to_string(outputs[0].ldy) +
                                  "), and non-null weight, output and counter");
  }
  LinearArgs a{};
  a.x = x;
  a.ldx = ldx;
  a.M = M;
  a.K = K;
  a.n_out = n_outputs;
  long rg = 0;
  for (int i = 0; i < n_outputs; ++i) {
    a.out[i] = LinearOut{outputs[i].W, outputs[i].y, outputs[i].ldy, outputs[i].N, int(rg)};
    rg += (outputs[i].N + 15) / 16;
  }
  if (rg > (long(1) << 30)) throw std::invalid_argument("decode_linear: too many output rows");
  a.rg_total = int(rg);
  // K slices: one wave at one token's ring shape (8 stages, 3 blocks per SM), for every M, so that the choice (and
  // with it each token's summation order) does not depend on the batch.
  a.ks_count = detail::stream_k_slices_for(K / kStreamChunk, rg, long(sm_count()) * detail::stream_blocks_per_sm(8, 1));
  const int rg_per_block = kStreamWarps / a.ks_count;
  const unsigned blocks = unsigned((rg + rg_per_block - 1) / rg_per_block);
  static CandidateSwitch fuse("HYPIC_FUSE_POST_NORM");
  if (norm && M <= kDecodeLinearNormInBlockMaxTokens && fuse.on()) {
    a.norm = *norm;
    norm->zero_centred ? launch_norm<1>(a, blocks, stream) : launch_norm<2>(a, blocks, stream);
    return;
  }
  switch (epilogue) {
    case DecodeLinearEpilogue::StoreBf16: launch_epi<int(DecodeLinearEpilogue::StoreBf16)>(a, blocks, stream); break;
    case DecodeLinearEpilogue::StoreF32: launch_epi<int(DecodeLinearEpilogue::StoreF32)>(a, blocks, stream); break;
    case DecodeLinearEpilogue::AddF32: launch_epi<int(DecodeLinearEpilogue::AddF32)>(a, blocks, stream); break;
  }
  if (norm)
    rms_norm_residual(M, outputs[0].N, static_cast<const float*>(outputs[0].y), outputs[0].ldy, nullptr, norm->w,
                      norm->eps, norm->y, stream, norm->zero_centred);
}

}  // namespace hypic::kernels::cuda
