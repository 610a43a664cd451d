// Causal attention through cuDNN's fused scaled-dot-product attention (the graph API's runtime-fusion SDPA forward,
// the kernels PyTorch's SDPA cudnn backend runs), for the long query groups of attention_prefill (attention.h).
// Internal to kernels/cuda: attention.cu routes to it; the public switch is HYPIC_ATTN_CUDNN (attention.h).
//
// cuDNN is loaded at run time (dlopen of libcudnn.so.9 and dlsym of the backend API): a build or a machine without
// cuDNN still runs, on our own kernels. The operation graph is the composite form of SDPA that cuDNN's engines
// recognise and fuse into one kernel (cuDNN developer guide, "Scaled Dot Product Attention" fprop pattern):
//   S = Q K^T (fp32) -> S * scale -> causal mask (row + s_kv - s_q >= col, else -inf; GEN_INDEX / CMP_GE /
//   BINARY_SELECT) -> row max -> exp(S - max) -> row sum -> P = exp / sum (bf16) -> O = P V (fp32 accumulate, bf16).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <tuple>

namespace hypic::kernels::cuda::detail {

/// One SDPA problem shape: b sequences of s_q queries each over s_kv keys, bottom-right causal (query i of a sequence
/// sees keys 0 ..= s_kv - s_q + i), num_heads query heads over num_kv_heads K/V heads (GQA), head_dim.
/// runtime_offset: the plan takes the mask's diagonal from the two lengths CudnnSdpa::run is given (query i sees keys
/// 0 ..= kv_len - q_len + i) rather than from s_kv - s_q: the padded length buckets (attention.cu), where a plan of
/// bucket dimensions serves every q_len <= s_q, kv_len <= s_kv whose offset kv_len - q_len is at most the plan's
/// s_kv - s_q (padded queries' rows are garbage, padded keys are seen by padded queries only).
struct CudnnSdpaShape {
  int b = 0, s_q = 0, s_kv = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  bool runtime_offset = false;
  auto key() const { return std::make_tuple(b, s_q, s_kv, num_heads, num_kv_heads, head_dim, runtime_offset); }
  bool operator<(const CudnnSdpaShape& o) const { return key() < o.key(); }
};

/// Whether cuDNN could be loaded on this machine (libcudnn.so.9 found, every backend symbol resolved, version 9.0 or
/// later) and HYPIC_ATTN_CUDNN is not "0". Read once per process. Throws std::invalid_argument when HYPIC_ATTN_CUDNN
/// is not "", "0", "1" or "all". (A handle is created by the first CudnnSdpa::prepare; if that fails, that object
/// runs our kernels from then on.)
bool cudnn_sdpa_available();

/// HYPIC_ATTN_CUDNN=all: every group of more than 512 queries goes to cuDNN (else only those of at least
/// kCudnnMinFlops, attention.cu). Same throws as cudnn_sdpa_available.
bool cudnn_sdpa_all_long_groups();

/// Why cudnn_sdpa_available() is false (empty when it is true): the library missing, a symbol, the variable.
std::string cudnn_sdpa_unavailable_reason();

/// A cuDNN handle and its execution plans, one per shape (at most kMaxPlans, least recently used dropped), for one
/// stream at a time (as AttnDecodeWorkspace, which owns one). Layouts (all bf16, DEVICE, 16-byte aligned):
///   q, out: sequence j's query i, head h at element ((j * s_q + i) * num_heads + h) * head_dim (row-major
///           [b][s_q][num_heads][head_dim]: attention_prefill's q / out rows of consecutive equal groups; a
///           head-major copy measured no faster on the H200, 2026-12-04: 142.7 against 141.2 ms for ten 32k layers);
///   k, v:   [b][num_kv_heads][s_kv][head_dim] contiguous (gather_kv's layout: each head's keys contiguous).
/// Numerics: fp32 scores and softmax, P rounded to bf16 for the P.V product, fp32 accumulation, out rounded to bf16
/// once (cuDNN's flash kernels; not bit-equal to our kernels).
class CudnnSdpa {
 public:
  /// Plans kept (HYPIC_ATTN_CUDNN_BUCKETS pads the queries to 16 buckets per octave, 128 from 513 to 2^17, and with a
  /// cached prefix each query bucket meets several KV buckets: the cap holds the common ones, not every pair).
  static constexpr int kMaxPlans = 160;
  CudnnSdpa();
  ~CudnnSdpa();
  CudnnSdpa(const CudnnSdpa&) = delete;
  CudnnSdpa& operator=(const CudnnSdpa&) = delete;
  /// Finds the plan of `s` on the current device or builds it (35-72 ms on the H200, 2026-12-04: cuDNN compiles its
  /// kernel; once per shape while cached). True with *workspace_bytes (DEVICE bytes run needs) when the plan is ready;
  /// false when no cuDNN engine supports the shape or building it failed (remembered; one line on stderr), or when
  /// the cuDNN handle cannot be created (then false for every shape). Never evicts: trim() does, between calls.
  /// Throws std::runtime_error only on CUDA errors (cudaGetDevice).
  bool prepare(const CudnnSdpaShape& s, size_t* workspace_bytes);
  /// Drops the least recently used plans beyond kMaxPlans (call before preparing a new call's shapes), after
  /// synchronising `stream` (the stream their launches went to) when any is dropped. Throws std::runtime_error on
  /// CUDA errors.
  void trim(cudaStream_t stream);
  /// Plans held (built or found unsupported), for tests.
  size_t plans() const;
  /// Runs the plan of `s` (prepare(s) must have returned true) on `stream`; `workspace` holds the bytes prepare
  /// returned (may be null when 0). q_len / kv_len: the mask's lengths (query i sees keys 0 ..= kv_len - q_len + i);
  /// they must be s.s_q / s.s_kv unless s.runtime_offset, and 1 <= q_len <= s.s_q, q_len <= kv_len <= s.s_kv,
  /// kv_len - q_len <= s.s_kv - s.s_q with it (then the key rows kv_len .. s_kv-1 must hold finite values: a masked
  /// score still multiplies its V row by 0).
  /// Asynchronous. Throws std::runtime_error on cuDNN errors, std::logic_error on lengths that break these rules.
  void run(const CudnnSdpaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
           float scale, __nv_bfloat16* out, void* workspace, int q_len, int kv_len, cudaStream_t stream);

 private:
  struct Plan;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Copies slots 0 .. s_kv-1 of `num_seqs` sequences from the paged pool into contiguous k_out / v_out
/// ([num_seqs][num_kv_heads][s_kv_pad][head_dim] bf16, head-major) and zeroes their slots s_kv .. s_kv_pad-1 (the
/// padding of a length bucket): sequence j's slot s is pool row block_table[(group0 + j) * max_pages + s / 64] * 64 +
/// s % 64. DEVICE pointers, all 16-byte aligned; head_dim a multiple of 8; num_seqs <= 65535. Asynchronous; throws
/// std::logic_error when s_kv_pad < s_kv, std::runtime_error on a launch error.
void gather_kv(int num_seqs, int s_kv, int s_kv_pad, int num_kv_heads, int head_dim, const int* block_table,
               int max_pages, int group0, const __nv_bfloat16* k_pool, const __nv_bfloat16* v_pool,
               __nv_bfloat16* k_out, __nv_bfloat16* v_out, cudaStream_t stream);

/// The output gate of HF Qwen3NextAttention on cuDNN's bf16 output, in place, for t < rows (token-major rows):
/// out[t][h][d] = bf16(float(out[t][h][d]) * sigmoid(float(gate[t * gate_ts + h * gate_hs + d]))) (fp32, rounded
/// once; HF likewise gates SDPA's rounded output). head_dim a multiple of 8, out 16-byte aligned (gate: any
/// alignment). Asynchronous; throws std::runtime_error on a launch error.
void apply_output_gate(int rows, int num_heads, int head_dim, const __nv_bfloat16* gate, long gate_ts, int gate_hs,
                       __nv_bfloat16* out, cudaStream_t stream);

}  // namespace hypic::kernels::cuda::detail
