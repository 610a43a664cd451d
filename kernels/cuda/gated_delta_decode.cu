// Recurrent gated delta rule decode step and the composition of cached (T, S) pairs
// (see gated_delta.h for the contracts).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/fold.cuh"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/gates.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/row_norm.cuh"
#include "kernels/cuda/switches.h"

namespace hypic::kernels::cuda {
namespace {

using detail::GateInputs;

constexpr int D = kGdnHeadDim;

__device__ __forceinline__ float block_sum128(float x, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  const int warp = threadIdx.x >> 5;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[warp] = x;
  __syncthreads();
  return (red[0] + red[1]) + (red[2] + red[3]);
}

// One block per (request, value head, 32-column slice of the 128 x 128 state), so that one request's 32 heads
// still fill 128 SMs: S <- e^g S; d = b (v - S^T k); S <- S + k d^T; o = S^T q. Thread (rg, lane) owns column
// c0 + lane of rows 32 rg .. 32 rg + 31, held in registers between the two passes (all 32 loads in flight at
// once); the column sums S^T k and S^T q are added over the four row groups in shared memory in a fixed order.
constexpr int kDecCols = 32, kDecRowGroups = D / 32;
static_assert(D / kDecCols == 4, "the counters count a head's four column blocks");

// With nrm.counters (gdn_decode_gated's GdnDecodeNorm): after a block's outputs are stored, the last of the head's
// D / kDecCols column blocks to finish (a per-(request, head) counter, reset by it) runs the gated RMSNorm of the
// head's output row in place with rms_norm_gated_kernel's warp code (row_norm.cuh gated_norm_row_warp: the same
// bits), reading the other blocks' columns through L2.
__global__ void __launch_bounds__(D) gdn_decode_kernel(const bf16* q, const bf16* k, const bf16* v, const float* g,
                                                       const float* beta, GateInputs gates, int Hk,
                                                       int Hv, bool l2norm, float scale, float* __restrict__ state,
                                                       bf16* __restrict__ out, const int* __restrict__ slots,
                                                       GdnDecodeNorm nrm = {}, bool state_early = false) {
  __shared__ float sq[D], sk[D], red[4], part[kDecRowGroups][kDecCols];
  const int b = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int lane = tid & 31, rg = tid >> 5, c = blockIdx.z * kDecCols + lane;
  const int kh = h / (Hv / Hk);
  const size_t hv = size_t(b) * Hv + h;
  float* S = state + ((slots ? size_t(slots[b]) * Hv + h : hv) * D + size_t(rg) * 32) * D + c;
  float sv[32];
  auto load_state = [&] {  // (through L2: read once, and before the wait with state_early)
#pragma unroll
    for (int r = 0; r < 32; ++r) sv[r] = __ldcg(S + size_t(r) * D);
  };
  // state_early (the caller's state_read_early and HYPIC_GDN_STATE_EARLY): the state rows are loaded before the wait
  // for the previous kernel (the conv, whose outputs q, k, v are): their last writer completed before that kernel
  // began waiting (gdn_decode_gated's contract; pdl.cuh).
  if (state_early) load_state();
  // (launched with PDL under HYPIC_DECODE_PDL_MIXERS: q, k, v come from the conv kernel, so no __restrict__ on the
  // inputs: coherent loads after the wait; see pdl.cuh)
  detail::griddep_wait();
  detail::griddep_launch_dependents();
  float qj = __bfloat162float(q[(size_t(b) * Hk + kh) * D + tid]);
  float kj = __bfloat162float(k[(size_t(b) * Hk + kh) * D + tid]);
  if (l2norm) {
    const float rq = rsqrtf(block_sum128(qj * qj, red) + 1e-6f);
    const float rk = rsqrtf(block_sum128(kj * kj, red) + 1e-6f);
    qj *= rq;
    kj *= rk;
  }
  sq[tid] = qj * scale;
  sk[tid] = kj;
  const float decay = expf(gates.a ? detail::gate_log_decay(gates, hv, h) : g[hv]);
  const float bt = gates.a ? detail::gate_beta(gates, hv) : beta[hv];
  if (!state_early) load_state();
  __syncthreads();  // sq, sk
  float kv = 0.f;
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    sv[r] *= decay;
    kv = fmaf(sv[r], sk[rg * 32 + r], kv);
  }
  part[rg][lane] = kv;
  __syncthreads();
  kv = (part[0][lane] + part[1][lane]) + (part[2][lane] + part[3][lane]);
  const float delta = bt * (__bfloat162float(v[hv * D + c]) - kv);
  float o = 0.f;
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    const float s = fmaf(sk[rg * 32 + r], delta, sv[r]);
    o = fmaf(s, sq[rg * 32 + r], o);
    S[size_t(r) * D] = s;
  }
  __syncthreads();  // every thread has read part[][] for kv
  part[rg][lane] = o;
  __syncthreads();
  if (out && rg == 0) out[hv * D + c] = __float2bfloat16_rn((part[0][lane] + part[1][lane]) + (part[2][lane] + part[3][lane]));
  if (nrm.counters && out) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(nrm.counters + hv, 1u) == gridDim.z - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (rg == 0 && !nrm.vec) {
      detail::gated_norm_row_warp<true>(out + hv * D, nrm.z + hv * D, nrm.w, D, nrm.eps, out + hv * D, lane,
                                        [](const bf16* p) { return __ldcg(reinterpret_cast<const __nv_bfloat162*>(p)); });
    } else if (rg == 0) {  // rms_norm_gated's 16-byte order: 16 lanes of 8 (lanes 16 .. 31 repeat them, unstored)
      const int c8 = (lane & 15) * 8;
      const uint4 xv = __ldcg(reinterpret_cast<const uint4*>(out + hv * D + c8));
      const uint4 zv = *reinterpret_cast<const uint4*>(nrm.z + hv * D + c8);
      const uint4 wv = *reinterpret_cast<const uint4*>(nrm.w + c8);
      const uint4 y = detail::gated_norm_lanes8<true, D / 8>(xv, zv, wv, D, nrm.eps);
      if (lane < 16) *reinterpret_cast<uint4*>(out + hv * D + c8) = y;
    }
    if (tid == 0) nrm.counters[hv] = 0u;
  }
}

// Composition: one block per (batch entry, BN-column block of the running state). The block keeps
// its 128 x BN running block in shared memory across all segments and, per segment, computes
// R <- T R + S with T staged in shared memory. Thread (rg, cg) of the 256 owns columns
// 4 cg .. 4 cg + 3 and rows rg + RG r (r < 128 / RG), with BN / 4 column groups and RG = 1024 / BN
// row groups. BN = 64 for large batches; 32 or 16 spread a small batch over more SMs.
constexpr int kCompLdT = D + 4;
template <int BN>
constexpr int comp_smem() {
  return (D * kCompLdT + D * (BN + 4)) * 4;
}

template <int BN>
__global__ void __launch_bounds__(256) compose_fold_kernel(int batch, int num_segments, float* running,
                                                           const float* __restrict__ transitions,
                                                           const float* __restrict__ states) {
  constexpr int CG = BN / 4, RG = 256 / CG, RPT = D / RG, LDR = BN + 4;
  extern __shared__ __align__(16) float csm[];
  float* sT = csm;
  float* sR = csm + D * kCompLdT;
  const int b = blockIdx.x, c0 = blockIdx.y * BN, tid = threadIdx.x;
  const int rg = tid / CG, cg = tid % CG;
  float* R = running + size_t(b) * D * D + c0;
#pragma unroll
  for (int i = 0; i < D * CG / 256; ++i) {
    const int p = tid + 256 * i, row = p / CG, col = (p % CG) * 4;
    *reinterpret_cast<float4*>(sR + row * LDR + col) = *reinterpret_cast<const float4*>(R + row * D + col);
  }
  float acc[RPT][4];
  for (int seg = 0; seg < num_segments; ++seg) {
    const size_t off = (size_t(seg) * batch + b) * D * D;
    const float* T = transitions + off;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int p = tid + 256 * i, row = p >> 5, col = (p & 31) * 4;
      *reinterpret_cast<float4*>(sT + row * kCompLdT + col) = __ldg(reinterpret_cast<const float4*>(T + row * D + col));
    }
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const float4 sv = states ? __ldg(reinterpret_cast<const float4*>(states + off + c0 + (rg + RG * r) * D + 4 * cg))
                               : make_float4(0.f, 0.f, 0.f, 0.f);
      acc[r][0] = sv.x;
      acc[r][1] = sv.y;
      acc[r][2] = sv.z;
      acc[r][3] = sv.w;
    }
    __syncthreads();
    detail::fold_rows<RPT, RG>(sT, kCompLdT, sR, LDR, rg, cg, acc);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < RPT; ++r)
      *reinterpret_cast<float4*>(sR + (rg + RG * r) * LDR + 4 * cg) =
          make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < D * CG / 256; ++i) {
    const int p = tid + 256 * i, row = p / CG, col = (p % CG) * 4;
    *reinterpret_cast<float4*>(R + row * D + col) = *reinterpret_cast<const float4*>(sR + row * LDR + col);
  }
}

template <int BN>
void launch_compose(int batch, int num_segments, float* running, const float* transitions, const float* states,
                    cudaStream_t stream) {
  static DeviceOnce once;  // the shared-memory opt-in is per device
  once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(compose_fold_kernel<BN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    comp_smem<BN>()),
               "cudaFuncSetAttribute(compose_fold_kernel)");
    return 0;
  });
  compose_fold_kernel<BN><<<dim3(batch, D / BN), 256, comp_smem<BN>(), stream>>>(batch, num_segments, running,
                                                                                 transitions, states);
  check_cuda(cudaGetLastError(), "compose_fold_kernel launch");
}

void check_heads(int num_k_heads, int num_v_heads, const char* fn) {
  if (num_k_heads < 1 || num_v_heads < 1 || num_v_heads % num_k_heads != 0 || num_v_heads > 65535)
    throw std::invalid_argument(std::string(fn) + ": num_v_heads (" + std::to_string(num_v_heads) +
                                ") must be a positive multiple of num_k_heads (" + std::to_string(num_k_heads) + ")");
}

void check_compose(int batch, int num_segments, const void* running, const void* t, const void* s, const char* fn) {
  if (batch < 1 || num_segments < 0)
    throw std::invalid_argument(std::string(fn) + ": batch must be >= 1 and num_segments >= 0, got " +
                                std::to_string(batch) + ", " + std::to_string(num_segments));
  if (!running || (num_segments > 0 && !t))
    throw std::invalid_argument(std::string(fn) + ": running and transitions must be non-null");
  (void)s;  // states may be null: S = 0
}

// HYPIC_GDN_STATE_EARLY (a measured default; =0 reads it after the wait): gdn_decode_kernel loads its state rows
// before griddepcontrol.wait.
bool state_early() {
  static CandidateSwitch sw("HYPIC_GDN_STATE_EARLY");
  return sw.on();
}

}  // namespace

void gdn_decode(int batch, int num_k_heads, int num_v_heads, const bf16* q, const bf16* k, const bf16* v,
                const float* g, const float* beta, bool l2norm_qk, float scale, float* state, bf16* out,
                cudaStream_t stream, const int* state_slots) {
  check_heads(num_k_heads, num_v_heads, "gdn_decode");
  if (batch < 0 || batch > (1 << 30)) throw std::invalid_argument("gdn_decode: bad batch " + std::to_string(batch));
  if (batch == 0) return;
  if (!q || !k || !v || !g || !beta || !state)
    throw std::invalid_argument("gdn_decode: q, k, v, g, beta and state must be non-null");
  detail::launch_pdl_if(detail::mixer_pdl(), gdn_decode_kernel, dim3(batch, num_v_heads, D / kDecCols), dim3(D), 0,
                        stream, "gdn_decode_kernel launch", q, k, v, g, beta, GateInputs{}, num_k_heads, num_v_heads,
                        l2norm_qk, scale, state, out, state_slots, GdnDecodeNorm{}, false);
}

void gdn_decode_gated(int batch, int num_k_heads, int num_v_heads, const bf16* q, const bf16* k, const bf16* v,
                      const bf16* gate_a, const bf16* gate_b, const float* A_log, const float* dt_bias,
                      bool l2norm_qk, float scale, float* state, bf16* out, cudaStream_t stream,
                      const int* state_slots, const GdnDecodeNorm* norm, bool state_read_early) {
  check_heads(num_k_heads, num_v_heads, "gdn_decode_gated");
  if (batch < 0 || batch > (1 << 30))
    throw std::invalid_argument("gdn_decode_gated: bad batch " + std::to_string(batch));
  if (batch == 0) return;
  for (const auto& [ptr, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {v, "v"}, {gate_a, "gate_a"},
                                  {gate_b, "gate_b"}, {A_log, "A_log"}, {dt_bias, "dt_bias"}, {state, "state"}})
    if (!ptr) throw std::invalid_argument(std::string("gdn_decode_gated: ") + name + " is null");
  if (norm && (!norm->z || !norm->w || !norm->counters || !out))
    throw std::invalid_argument("gdn_decode_gated: the gated norm needs z, w, counters and out");
  static CandidateSwitch fuse("HYPIC_GDN_DECODE_NORM");
  const bool fused = norm && fuse.on();
  GdnDecodeNorm nrm = fused ? *norm : GdnDecodeNorm{};
  if (fused) nrm.vec = rms_norm_gated_vectorized(D, out, norm->z, norm->w, out);  // rms_norm_gated's own order
  detail::launch_pdl_if(detail::mixer_pdl(), gdn_decode_kernel, dim3(batch, num_v_heads, D / kDecCols), dim3(D), 0,
                        stream, "gdn_decode_kernel launch", q, k, v, static_cast<const float*>(nullptr),
                        static_cast<const float*>(nullptr), GateInputs{gate_a, gate_b, A_log, dt_bias}, num_k_heads,
                        num_v_heads, l2norm_qk, scale, state, out, state_slots, nrm, state_read_early && state_early());
  if (norm && !fused)
    rms_norm_gated(batch * num_v_heads, D, out, norm->z, norm->w, norm->eps, out, stream, NormGate::Silu);
}

void compose_fold(int batch, int num_segments, float* running, const float* transitions, const float* states,
                  cudaStream_t stream) {
  check_compose(batch, num_segments, running, transitions, states, "compose_fold");
  if (num_segments == 0) return;
  // Column blocks of 64 when the batch alone fills the GPU; narrower ones for small batches (the
  // fold of a split sequence's parts: one layer's heads).
  const int sms = sm_count();
  if (long(batch) * 2 >= sms)
    launch_compose<64>(batch, num_segments, running, transitions, states, stream);
  else if (long(batch) * 4 >= sms)
    launch_compose<32>(batch, num_segments, running, transitions, states, stream);
  else
    launch_compose<16>(batch, num_segments, running, transitions, states, stream);
}

void compose_fold_cublas(void* cublas_handle, int batch, int num_segments, float* running, const float* transitions,
                         const float* states, float* scratch, cudaStream_t stream) {
  check_compose(batch, num_segments, running, transitions, states, "compose_fold_cublas");
  if (!cublas_handle || !scratch)
    throw std::invalid_argument("compose_fold_cublas: cublas_handle and scratch must be non-null");
  auto h = static_cast<cublasHandle_t>(cublas_handle);
  if (cublasSetStream(h, stream) != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error("compose_fold_cublas: cublasSetStream failed");
  const size_t mat = size_t(D) * D;
  float* cur = running;
  float* nxt = scratch;
  const float one = 1.f;
  for (int i = 0; i < num_segments; ++i) {
    if (states)
      check_cuda(cudaMemcpyAsync(nxt, states + i * batch * mat, batch * mat * sizeof(float), cudaMemcpyDeviceToDevice,
                                 stream),
                 "compose_fold_cublas: copy of S");
    else
      check_cuda(cudaMemsetAsync(nxt, 0, batch * mat * sizeof(float), stream), "compose_fold_cublas: zero S");
    // Row-major nxt = T cur + nxt is column-major nxt^T = cur^T T^T + nxt^T.
    const cublasStatus_t st = cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, D, D, D, &one, cur, D, mat,
                                                        transitions + i * batch * mat, D, mat, &one, nxt, D, mat,
                                                        batch);
    if (st != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error("compose_fold_cublas: cublasSgemmStridedBatched failed, status " +
                               std::to_string(static_cast<int>(st)));
    std::swap(cur, nxt);
  }
  if (cur != running)
    check_cuda(cudaMemcpyAsync(running, cur, batch * mat * sizeof(float), cudaMemcpyDeviceToDevice, stream),
               "compose_fold_cublas: copy back");
}

}  // namespace hypic::kernels::cuda
