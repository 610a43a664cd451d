// CPU fp32 building blocks of the hybrid forward pass: GEMM wrapper (OpenBLAS), the RMSNorm
// flavours of Qwen3-Next / Qwen3.5, l2 normalisation, activations and partial NeoX RoPE.
// All tensors are row-major fp32; "rows" is the number of tokens (or token x head rows).
// Sources: HF transformers 5.x modeling_qwen3_5.py / modeling_qwen3_next.py (Qwen3_5RMSNorm,
// Qwen3_5RMSNormGated, l2norm, Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb);
// docs/research/hybrid_models.md sections 0 and 1.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

namespace hypic::kernels::cpu {

/// silu(x) = x * sigmoid(x) (torch.nn.functional.silu).
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

/// sigmoid(x) = 1 / (1 + e^-x).
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

/// torch.nn.functional.softplus with beta = 1, threshold = 20: x for x > 20, else log1p(e^x).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

/// Dense layer without bias, as torch.nn.functional.linear:
///   y[rows][out_features] = x[rows][in_features] * w[out_features][in_features]^T  (+ beta * y).
/// Goes through OpenBLAS (cblas_sgemm, or cblas_sgemv for one row).
/// Throws std::invalid_argument on negative sizes or sizes beyond the BLAS int range.
void linear(int64_t rows, int64_t in_features, int64_t out_features, const float* x, const float* w, float* y,
            float beta = 0.0f);

/// Zero-centred RMSNorm (Qwen3_5RMSNorm / Qwen3NextRMSNorm): y = x * rsqrt(mean(x^2) + eps) * (1 + w).
///   x, y: [rows][dim] (y may alias x); w: [dim].
void rms_norm_zero_centred(int64_t rows, int64_t dim, const float* x, const float* w, float eps, float* y);

/// Gated RMSNorm of the Gated DeltaNet output (Qwen3_5RMSNormGated / Qwen3NextRMSNormGated):
///   y = (x * rsqrt(mean(x^2) + eps)) * w * silu(z)    (plain weight w, NOT 1 + w).
///   x, z, y: [rows][dim] (y may alias x); w: [dim].
void rms_norm_gated(int64_t rows, int64_t dim, const float* x, const float* z, const float* w, float eps, float* y);

/// Standard RMSNorm (KimiLinearRMSNorm, MiniMaxRMSNorm, Ring's RMSNorm; T5LayerNorm):
///   y = w * (x * rsqrt(mean(x^2) + eps)).  x, y: [rows][dim] (y may alias x); w: [dim].
void rms_norm(int64_t rows, int64_t dim, const float* x, const float* w, float eps, float* y);

/// Group RMSNorm (Ring's lightning output norm, BailingHybridGroupRMSNorm): each row of dim channels is split into
/// `groups` groups of dim / groups channels, each normalised on its own, then multiplied by w (one weight per channel).
///   x, y: [rows][dim] (y may alias x); w: [dim]. groups must divide dim (std::invalid_argument otherwise).
void rms_norm_grouped(int64_t rows, int64_t dim, int groups, const float* x, const float* w, float eps, float* y);

/// Gated RMSNorm with a sigmoid gate (KimiLinearRMSNormGated, the KDA output norm):
///   y = (w * (x * rsqrt(mean(x^2) + eps))) * sigmoid(z).  x, z, y: [rows][dim] (y may alias x); w: [dim].
void rms_norm_gated_sigmoid(int64_t rows, int64_t dim, const float* x, const float* z, const float* w, float eps,
                            float* y);

/// In-place l2 normalisation of each row (HF `l2norm`, as in the FLA library): x *= rsqrt(sum(x^2) + eps).
/// The eps sits inside the rsqrt of the SUM (not the mean). x: [rows][dim].
void l2_normalize_rows(int64_t rows, int64_t dim, float* x, float eps = 1e-6f);

/// Inverse RoPE frequencies for partial rotary embedding over rot_dim dims, computed in fp32 as HF
/// compute_default_rope_parameters does: inv_freq[i] = 1 / theta^(2i / rot_dim), i < rot_dim / 2.
/// Throws std::invalid_argument when rot_dim is not a positive even number or theta <= 0.
std::vector<float> rope_inv_freq(double theta, int rot_dim);

/// Applies NeoX-style (rotate_half) RoPE in place to the first 2 * inv_freq.size() dims of every head;
/// the remaining dims pass through (partial rotary, apply_rotary_pos_emb).
///   x: [n_tokens][heads][head_dim]; token t is rotated by angle (first_position + t) * inv_freq[i],
///   computed in fp32 (the product rounded to fp32 before cos/sin, as HF's fp32 rotary embedding).
/// A negative first_position rotates backwards; R(a) R(b) = R(a + b) up to rounding.
void apply_rope(float* x, int64_t n_tokens, int heads, int head_dim, const std::vector<float>& inv_freq,
                int64_t first_position);

/// Like apply_rope, but every token is rotated by the same angle position * inv_freq[i] (used to move
/// already-rotated cached keys by a position delta: R(p + d) = R(d) R(p)).
void apply_rope_uniform(float* x, int64_t n_tokens, int heads, int head_dim, const std::vector<float>& inv_freq,
                        int64_t position);

/// Rotates linear-attention states on their key axis by one angle: state [heads][d_k][d_v] row-major (rows = key
/// dims), rows i and i + h (h = inv_freq.size(), i < h) rotated as apply_rope rotates dims i and i + h of a key:
/// row_i <- row_i cos - row_{i+h} sin, row_{i+h} <- row_{i+h} cos + row_i sin, angle position * inv_freq[i] (fp32).
/// S = sum_t k_t v_t^T is linear in the keys, so this is R(position) S, the state the same tokens give with keys
/// rotated `position` further (DESIGN.md 3.3). Throws std::invalid_argument if 2 h > d_k or d_v <= 0.
void apply_rope_key_axis(float* state, int heads, int d_k, int d_v, const std::vector<float>& inv_freq,
                         int64_t position);

/// Softmax in place over each row of x[rows][n] (max-subtracted, fp32), as torch.softmax(dim=-1).
void softmax_rows(int64_t rows, int64_t n, float* x, int64_t ld);

}  // namespace hypic::kernels::cpu
