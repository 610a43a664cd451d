// CUDA kernels around multi-head latent attention as Kimi-Linear's full-attention layers use it (HF
// KimiLinearAttention in transformers 5.17: no rotary embedding, q_proj or the q LoRA, the compressed KV
// kv_a_proj_with_mqa -> RMSNorm -> kv_b_proj). The KV cache holds the latent: one row of D = R + rope values per token
// ([normed c_kv | k_rot], mla_latent_store), 1152 bytes at Kimi-Linear's 512 + 64 against 32 KB expanded. Two ways to
// attend over it (engine/cuda/mla_mixer.h picks per pass):
//  - expanded (long query spans, prefill): the context's latent rows gathered, kv_b_proj applied per head straight into
//    every head's K = [k_nope | k_rot] and V in scratch at a padded head size P (the smallest of 64, 128, 256 that holds
//    both qk = nope + rope and v dims; the padding is zeros, so q.k and the outputs are unchanged), and the attention
//    kernels of kernels/cuda/attention.h run at that head size with scale qk^-1/2;
//  - absorbed (decode, seam windows): mla_attention_latent, W_UK folded into the query and W_UV applied after.
// All pointers are DEVICE pointers; every call is asynchronous on `stream` and throws std::invalid_argument on bad
// sizes or null pointers, std::runtime_error on launch errors.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>

#include "kernels/cuda/attention.h"

namespace hypic::kernels::cuda {

using bf16 = __nv_bfloat16;

/// Sizes of one MLA layer.
struct MlaDims {
  int heads = 0;  ///< nh (query heads = KV heads after the expansion)
  int nope = 0;   ///< qk_nope_head_dim
  int rope = 0;   ///< qk_rope_head_dim (the shared k_rot slice; not rotated in Kimi-Linear)
  int v = 0;      ///< v_head_dim
  int rank = 0;   ///< kv_lora_rank R
  /// The padded head size the attention runs at (64, 128 or 256), or 0 when nope + rope or v exceeds 256.
  int padded() const;
};

/// Widest latent row (R + rope) the absorbed attention takes (Kimi-Linear, DeepSeek-V3: 512 + 64).
inline constexpr int kMlaLatentMaxDim = 576;

/// The latent KV cache rows of T tokens (HF KimiLinearAttention: kv_a_proj_with_mqa, then
/// KimiLinearRMSNorm(kv_lora_rank) of the first R values): pool row kv_rows[t], D = R + rope bf16 values, is
///   [ RMSNorm(ckv[t][0, R)) * w  (fp32 math, rounded to bf16 once)  |  ckv[t][R, R + rope)  (copied) ].
/// ckv: [T][R + rope] bf16 (kv_a_proj output); w: [R] bf16 (plain weight); kv_rows: DEVICE int32 [T];
/// pool: [rows][D] bf16 (the layer's latent pool, pages of kKvPageTokens rows). One warp per token.
void mla_latent_store(int T, const MlaDims& d, const bf16* ckv, const bf16* w, float eps, const int* kv_rows,
                      bf16* pool, cudaStream_t stream = nullptr);

/// out[i] = pool[src_rows[i]] ([D] bf16 rows, D = R + rope), or zeros where src_rows[i] < 0; out: [n][D].
void mla_gather_latent(int n, const MlaDims& d, const int* src_rows, const bf16* pool, bf16* out,
                       cudaStream_t stream = nullptr);

/// The shared k_rot of n latent rows into every head of the expanded K (the k_nope and V columns come from GEMMs, the
/// padding stays as it is): k_out[i][h][nope + j] = lat[i][R + j] for j < rope; lat: [n][R + rope]; k_out: [n][nh][P]
/// (P = d.padded()). 16-byte stores where nope, rope and P allow.
void mla_expand_rope(int n, const MlaDims& d, const bf16* lat, bf16* k_out, cudaStream_t stream = nullptr);

/// Cached latent rows into the pool, in runs of consecutive rows as kv_import (attention.h): import row i of run r
/// (run_start[r] <= i < run_start[r + 1]) is the [D] bf16 row src[r] + (i - run_start[r]) D (D = rank + rope), copied
/// to pool[kv_rows[i]] (no RoPE to re-apply in Kimi-Linear). run_start: DEVICE int32 [num_runs + 1] (0 .. n,
/// non-decreasing); src: DEVICE array of num_runs row pointers; kv_rows: DEVICE int32 [n]. Copies only. Throws
/// std::invalid_argument on bad sizes or null pointers.
void mla_latent_import(int n, int num_runs, const MlaDims& d, const int* run_start, const bf16* const* src,
                       const int* kv_rows, bf16* pool, cudaStream_t stream = nullptr);

/// q_pad[t][h] = [q[t][h] (nope + rope) | 0]: q [T][nh][nope + rope] (q_proj output) to [T][nh][P].
void mla_pad_query(int T, const MlaDims& d, const bf16* q, bf16* q_pad, cudaStream_t stream = nullptr);

/// The rope part of the absorbed queries: q_lat[t][h][R + j] = q[t][h][nope + j] for j < rope (the first R values of
/// q_lat[t][h] are q_nope W_UK, written by a GEMM). q: [T][nh][nope + rope]; q_lat: [T][nh][R + rope].
void mla_query_rope(int T, const MlaDims& d, const bf16* q, bf16* q_lat, cudaStream_t stream = nullptr);

/// W_UK^T per head, for the absorbed query q_nope W_UK as a "linear" GEMM: w_uk_t[h][r][i] = kv_b[h (nope + v) + i][r]
/// (kv_b_proj [nh (nope + v)][R], per head its nope K rows then its v V rows); w_uk_t: [nh][R][nope].
void mla_transpose_uk(const MlaDims& d, const bf16* kv_b, bf16* w_uk_t, cudaStream_t stream = nullptr);

/// out[t][h * v + j] = attn[t][h][j] for j < v: the attention output [T][nh][P] packed to o_proj's input
/// [T][nh * v].
void mla_pack_output(int T, const MlaDims& d, const bf16* attn, bf16* out, cudaStream_t stream = nullptr);

/// Whether mla_attention_latent takes these sizes: rank R of 128, 256 or 512, R + rope a multiple of 16 and at most
/// kMlaLatentMaxDim, 1 ..= 65535 heads.
bool mla_latent_supported(const MlaDims& d);

/// Device scratch of mla_attention_latent's split-KV chunks (per (group, 32-row tile, chunk) the rows' (m, l) and fp32
/// accumulators [32][R]; at most 512 MiB: a larger launch runs unsplit). Grows on demand (a growth synchronises the device before freeing the old buffer); not
/// thread-safe (one per stream). A captured graph reads its buffer: reserve before capturing.
class MlaAttnWorkspace {
 public:
  MlaAttnWorkspace() = default;
  MlaAttnWorkspace(const MlaAttnWorkspace&) = delete;
  MlaAttnWorkspace& operator=(const MlaAttnWorkspace&) = delete;
  ~MlaAttnWorkspace();
  /// Sizes the scratch so that calls with at most max_groups groups, groups of at most max_q queries, these heads
  /// and rank, and AttnGroups::max_kv <= max_kv allocate nothing (and can be captured). Throws
  /// std::invalid_argument on non-positive sizes, std::runtime_error when cudaMalloc fails.
  void reserve(int max_groups, int max_q, int heads, int rank, int max_kv);
  /// Bytes held on the device.
  size_t bytes() const { return bytes_; }

 private:
  friend void mla_attention_latent(const AttnGroups&, const MlaDims&, const bf16*, const bf16*, float, bf16*,
                                   MlaAttnWorkspace&, cudaStream_t);
  void ensure(size_t bytes, cudaStream_t stream, const char* fn);
  void* mem_ = nullptr;
  size_t bytes_ = 0;
  std::array<int, 5> reserved_for_{};  // the last reserve's arguments
};

/// Multi-head latent attention in the absorbed form (DeepSeek-V2 paper section 2.1.2, "absorb W_UK into W_Q and W_UV
/// into W_O"), over the latent pool: every query head reads the one shared latent row of each slot, as MQA with a
/// key of D = R + rope values and a value of the first R values:
///   q_lat: [total_q][nh][D] bf16, per head [q_nope W_UK_h (R) | q_rope (rope)] (GEMM + mla_query_rope);
///   pool: [rows][D] bf16 latent rows (mla_latent_store), addressed through g.block_table as the paged KV pool of
///     kernels/cuda/attention.h (query i of group g sees slots 0 ..= slot0[g] + i);
///   scale: multiplies q_lat . row = q_nope . k_nope + q_rope . k_rot (the expanded scores): (nope + rope)^-1/2;
///   out: [total_q][nh][R] bf16, softmax-weighted sums of the rows' first R values (o_lat; o = o_lat W_UV^T).
/// Numerics as attention_prefill: fp32 scores and online softmax (exp2), P rounded to bf16 for the tensor-core
/// product, fp32 accumulators, split-KV chunks merged in fp32. Any group length; meant for short groups over long
/// contexts (decode, seam windows): the work grows with nh * (2R + rope) per (query, slot), 2-3x the expanded form's.
/// 256-thread blocks, one per (tile of 32 (query, head) rows, KV chunk, group), about 200 KB of shared memory; any
/// group length (max_q * nh up to 2^31 - 1).
/// Requires 16-byte aligned q_lat, pool and out, g.max_kv >= the groups' KV lengths for the split (a longer one is
/// still computed, by its last chunk), num_groups <= 65535. Throws std::invalid_argument on unsupported sizes
/// (mla_latent_supported), null / misaligned pointers, or a workspace that must grow while `stream` captures;
/// std::runtime_error on CUDA errors.
void mla_attention_latent(const AttnGroups& g, const MlaDims& d, const bf16* q_lat, const bf16* pool, float scale,
                          bf16* out, MlaAttnWorkspace& ws, cudaStream_t stream = nullptr);

}  // namespace hypic::kernels::cuda
