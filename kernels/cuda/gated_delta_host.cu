// The host side of the gated delta rule prefill that needs none of its kernels' internals: the gates kernel, the
// workspace's streams and split-state buffers, argument checks and the sequence-parallel split (gated_delta.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/gated_delta_internal.h"
#include "kernels/cuda/gates.cuh"

namespace hypic::kernels::cuda {

using namespace detail;

namespace {

__global__ void gdn_gates_kernel(long n, int Hv, GateInputs gates, float* __restrict__ g, float* __restrict__ beta) {
  for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < n; i += long(gridDim.x) * blockDim.x) {
    const int h = static_cast<int>(i % Hv);
    g[i] = gate_log_decay(gates, size_t(i), h);
    beta[i] = gate_beta(gates, size_t(i));
  }
}

}  // namespace

void gdn_gates(int tokens, int num_v_heads, const bf16* a, const bf16* b, const float* A_log, const float* dt_bias,
               float* g, float* beta, cudaStream_t stream) {
  if (tokens < 0 || num_v_heads < 1)
    throw std::invalid_argument("gdn_gates: tokens must be >= 0 and num_v_heads >= 1, got " + std::to_string(tokens) +
                                ", " + std::to_string(num_v_heads));
  if (tokens == 0) return;
  for (const auto& [ptr, name] : {std::pair<const void*, const char*>{a, "a"}, {b, "b"}, {A_log, "A_log"},
                                  {dt_bias, "dt_bias"}, {g, "g"}, {beta, "beta"}})
    if (!ptr) throw std::invalid_argument(std::string("gdn_gates: ") + name + " is null");
  const long n = long(tokens) * num_v_heads;
  const int blocks = static_cast<int>(std::min<long>((n + 255) / 256, 65535));
  gdn_gates_kernel<<<blocks, 256, 0, stream>>>(n, num_v_heads, GateInputs{a, b, A_log, dt_bias}, g, beta);
  check_cuda(cudaGetLastError(), "gdn_gates_kernel launch");
}

void GdnWorkspace::ensure_side_stream() {
  if (side_) return;
  check_cuda(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags(GdnWorkspace)");
  check_cuda(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), "cudaEventCreate(GdnWorkspace fork)");
  check_cuda(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming), "cudaEventCreate(GdnWorkspace join)");
}

void GdnWorkspace::reserve_split(size_t state_bytes, size_t job_bytes) {
  // Callers on this stream may still be reading the old buffers: cudaFree waits for the device.
  if (state_bytes > split_bytes_) {
    if (split_mem_) check_cuda(cudaFree(split_mem_), "cudaFree(GdnWorkspace split states)");
    split_mem_ = nullptr;
    split_bytes_ = 0;
    check_cuda(cudaMalloc(&split_mem_, state_bytes),
               "cudaMalloc(GdnWorkspace split states, " + std::to_string(state_bytes) + " bytes)");
    split_bytes_ = state_bytes;
  }
  if (job_bytes > job_bytes_ || !job_mem_) {
    job_bytes = std::max<size_t>(job_bytes, 4096);
    if (job_mem_) check_cuda(cudaFree(job_mem_), "cudaFree(GdnWorkspace scan jobs)");
    job_mem_ = nullptr;
    job_bytes_ = 0;
    check_cuda(cudaMalloc(&job_mem_, job_bytes), "cudaMalloc(GdnWorkspace scan jobs)");
    job_bytes_ = job_bytes;
  }
}

namespace detail {

void validate_gdn_args(const GdnPrefillArgs& a, const char* fn) {
  const std::string f(fn);
  if (a.num_seqs < 1 || a.num_seqs > 65535)
    throw std::invalid_argument(f + ": num_seqs must be in [1, 65535], got " + std::to_string(a.num_seqs));
  if (!a.cu_seqlens_host) throw std::invalid_argument(f + ": cu_seqlens_host is null");
  if (a.num_k_heads < 1 || a.num_v_heads < 1 || a.num_v_heads % a.num_k_heads != 0 || a.num_v_heads > 65535)
    throw std::invalid_argument(f + ": num_v_heads (" + std::to_string(a.num_v_heads) +
                                ") must be a positive multiple of num_k_heads (" + std::to_string(a.num_k_heads) +
                                "), at most 65535");
  if (a.scan_layout < 0 || a.scan_layout > 2)
    throw std::invalid_argument(f + ": scan_layout must be in [0, 2], got " + std::to_string(a.scan_layout));
  if (a.seq_parts < 0) throw std::invalid_argument(f + ": seq_parts must be >= 0, got " + std::to_string(a.seq_parts));
  if (a.cu_seqlens_host[0] != 0) throw std::invalid_argument(f + ": cu_seqlens_host[0] must be 0");
  for (int s = 0; s < a.num_seqs; ++s)
    if (a.cu_seqlens_host[s + 1] < a.cu_seqlens_host[s])
      throw std::invalid_argument(f + ": cu_seqlens_host decreases at sequence " + std::to_string(s) + " (" +
                                  std::to_string(a.cu_seqlens_host[s]) + " > " +
                                  std::to_string(a.cu_seqlens_host[s + 1]) + ")");
  if (a.num_checkpoints < 0)
    throw std::invalid_argument(f + ": num_checkpoints must be >= 0, got " + std::to_string(a.num_checkpoints));
  if (a.num_checkpoints > 0 && (!a.checkpoint_tokens_host || !a.checkpoint_states))
    throw std::invalid_argument(f + ": num_checkpoints > 0 needs checkpoint_tokens_host and checkpoint_states");
  for (int i = 0, s = 0; i < a.num_checkpoints; ++i) {
    const int t = a.checkpoint_tokens_host[i];
    if (i > 0 && t <= a.checkpoint_tokens_host[i - 1])
      throw std::invalid_argument(f + ": checkpoint_tokens_host must increase, got " +
                                  std::to_string(a.checkpoint_tokens_host[i - 1]) + " then " + std::to_string(t));
    while (s < a.num_seqs && a.cu_seqlens_host[s + 1] < t) ++s;
    if (s == a.num_seqs || t <= a.cu_seqlens_host[s])
      throw std::invalid_argument(f + ": checkpoint " + std::to_string(i) + " at token " + std::to_string(t) +
                                  " is not after a token of a sequence (in (cu_seqlens[s], cu_seqlens[s + 1]])");
  }
}

}  // namespace detail

std::vector<int> gdn_scan_parts(const GdnPrefillArgs& a) {
  constexpr int kMinPartChunks = 16;
  detail::validate_gdn_args(a, "gdn_scan_parts");
  std::vector<int> parts(a.num_seqs, 1), nc(a.num_seqs);
  for (int s = 0; s < a.num_seqs; ++s)
    nc[s] = std::max(0, (a.cu_seqlens_host[s + 1] - a.cu_seqlens_host[s] + kGdnChunk - 1) / kGdnChunk);
  const bool with_out = a.out != nullptr;
  if (a.seq_parts >= 2) {
    for (int s = 0; s < a.num_seqs; ++s) parts[s] = nc[s] >= a.seq_parts ? a.seq_parts : 1;
  } else if (a.seq_parts == 0) {
    const int num_sms = sm_count();
    int n_long = 0;
    for (int s = 0; s < a.num_seqs; ++s) n_long += nc[s] >= 3 * kMinPartChunks;
    if (n_long > 0) {
      // Blocks of one part of every long sequence (two per value head), and how many such parts
      // run in one wave; with outputs part 0 runs once, the other parts twice.
      const long per_part = 2L * a.num_v_heads * n_long;
      const long fit = num_sms / per_part;
      const long P = with_out ? fit + 1 : fit;
      if (P >= (with_out ? 3 : 2))
        for (int s = 0; s < a.num_seqs; ++s)
          if (nc[s] >= 3 * kMinPartChunks) parts[s] = static_cast<int>(std::min<long>(P, nc[s] / kMinPartChunks));
    }
  }
  if (a.num_checkpoints > 0 && !with_out)  // parts after the first never rescan from their true states
    std::fill(parts.begin(), parts.end(), 1);
  long jobs1 = 0;  // blocks along z of the first scan launch (at most 65535)
  for (int s = 0; s < a.num_seqs; ++s) jobs1 += parts[s] > 1 ? (with_out ? parts[s] - 1 : parts[s]) : 1;
  if (jobs1 > 65535) std::fill(parts.begin(), parts.end(), 1);
  return parts;
}

}  // namespace hypic::kernels::cuda
