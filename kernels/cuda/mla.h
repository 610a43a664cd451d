// CUDA kernels around multi-head latent attention as Kimi-Linear's full-attention layers use it (HF
// KimiLinearAttention in transformers 5.17: no rotary embedding, q_proj or the q LoRA, the compressed KV
// kv_a_proj_with_mqa -> RMSNorm -> kv_b_proj). hypic runs MLA expanded: every head's K = [k_nope | k_rot] and V are
// formed from the latent and written to the paged KV pool (kernels/cuda/attention.h) at a padded head size P (the
// smallest of 64, 128, 256 that holds both qk = nope + rope and v dims; the padding is zeros, so q.k and the
// outputs are unchanged), and the attention kernels run at that head size with scale qk^-1/2.
// All pointers are DEVICE pointers; every call is asynchronous on `stream` and throws std::invalid_argument on bad
// sizes or null pointers, std::runtime_error on launch errors.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

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

/// latent[t][0, R) = RMSNorm(ckv[t][0, R)) * w (plain weight; HF KimiLinearRMSNorm(kv_lora_rank), eps), fp32 math,
/// bf16 out. ckv: [T][R + rope] bf16 (kv_a_proj output); w: [R] bf16; latent: [T][R] bf16. One warp per token.
void mla_latent_norm(int T, const MlaDims& d, const bf16* ckv, const bf16* w, float eps, bf16* latent,
                     cudaStream_t stream = nullptr);

/// The expanded q, K and V at the padded head size P = d.padded():
///   q_pad[t][h] = [q[t][h] (nope + rope) | 0],  q: [T][nh][nope + rope] (q_proj output)
///   K row kv_rows[t], head h = [kvb[t][h][0, nope) | ckv[t][R, R + rope) | 0]
///   V row kv_rows[t], head h = [kvb[t][h][nope, nope + v) | 0],  kvb: [T][nh][nope + v] (kv_b_proj output)
/// q_pad: [T][nh][P]; k_pool, v_pool: [rows][nh][P] (kernels/cuda/attention.h pool layout). Copies, no rounding.
void mla_expand(int T, const MlaDims& d, const bf16* q, const bf16* ckv, const bf16* kvb, const int* kv_rows,
                bf16* q_pad, bf16* k_pool, bf16* v_pool, cudaStream_t stream = nullptr);

/// out[t][h * v + j] = attn[t][h][j] for j < v: the attention output [T][nh][P] packed to o_proj's input
/// [T][nh * v].
void mla_pack_output(int T, const MlaDims& d, const bf16* attn, bf16* out, cudaStream_t stream = nullptr);

/// Cached MLA K/V rows (a segment entry's layout, engine/segment.h: K [nh][nope + rope], V [nh][v] per token, no
/// RoPE to re-apply in Kimi-Linear) into the pool at the padded head size P, zero-padded:
///   k_pool[kv_rows[i]][h] = [k_src[i][h] | 0],  v_pool[kv_rows[i]][h] = [v_src[i][h] | 0]   for i < n.
/// k_src, v_src: DEVICE arrays of n row pointers (each row's own entry); kv_rows: DEVICE int32 [n]. Copies only.
/// Throws std::invalid_argument on n < 0, bad dims or null pointers (n > 0).
void mla_kv_import(int n, const MlaDims& d, const bf16* const* k_src, const bf16* const* v_src, const int* kv_rows,
                   bf16* k_pool, bf16* v_pool, cudaStream_t stream = nullptr);

/// The inverse of mla_kv_import: pool rows kv_rows[i] packed to entry rows, k_dst[i] [nh][nope + rope] and v_dst[i]
/// [nh][v] (DEVICE arrays of n row pointers). Copies only.
void mla_kv_export(int n, const MlaDims& d, const bf16* k_pool, const bf16* v_pool, const int* kv_rows,
                   bf16* const* k_dst, bf16* const* v_dst, cudaStream_t stream = nullptr);

}  // namespace hypic::kernels::cuda
