// The lightning-attention layer on the GPU. Contracts: lightning_mixer.h.
#include "engine/cuda/lightning_mixer.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cuda/ops.h"

namespace hypic::engine::cuda {

namespace kc = hypic::kernels::cuda;

LightningLayerConfig LightningLayerConfig::of(const ModelConfig& c) {
  if (c.family != ModelFamily::MiniMax && c.family != ModelFamily::RingLinear)
    throw std::invalid_argument(std::string("LightningLayerConfig: family ") + model_family_name(c.family) +
                                " has no lightning layers");
  if (!kc::lightning_head_dim_supported(c.head_dim))
    throw std::invalid_argument("LightningLayerConfig: head_dim " + std::to_string(c.head_dim) +
                                " is not supported by the GPU lightning kernels (64 or 128)");
  LightningLayerConfig l;
  l.hidden = c.hidden_size, l.heads = c.num_attention_heads, l.head_dim = c.head_dim, l.groups = c.group_norm_size;
  l.qkv_silu = c.linear_qkv_silu;
  l.qk_norm = c.family == ModelFamily::RingLinear && c.use_qk_norm;
  l.qk_norm_eps = static_cast<float>(c.rms_norm_eps);
  l.norm_eps = static_cast<float>(c.linear_norm_eps);
  l.rope_half = c.linear_rope ? c.rotary_dim() / 2 : 0;
  l.scale = c.family == ModelFamily::RingLinear ? static_cast<float>(1.0 / std::sqrt(double(c.head_dim))) : 1.0f;
  l.out_scale = static_cast<float>(c.linear_attn_beta);
  return l;
}

// q, k, v from the fused projection (steps 1-2 of the layer).
void lightning_mixer_project(kc::GemmRunner& gemm, const DevLightning& w, const LightningLayerConfig& c, int T,
                 const __nv_bfloat16* xn, const int* positions, const float* inv_freq, const LightningScratch& s,
                 cudaStream_t stream) {
  const int hd = c.heads * c.head_dim;
  gemm.linear(T, 3 * hd, c.hidden, xn, c.hidden, w.qkv_proj, s.qkv, CUDA_R_16BF, 3 * hd, 0.0f, stream);
  kc::LightningQkvArgs a;
  a.tokens = T, a.num_heads = c.heads, a.head_dim = c.head_dim, a.qkv = s.qkv, a.silu = c.qkv_silu;
  a.q_norm = c.qk_norm ? w.q_norm : nullptr, a.k_norm = c.qk_norm ? w.k_norm : nullptr, a.eps = c.qk_norm_eps;
  a.inv_freq = c.rope_half ? inv_freq : nullptr, a.rope_half = c.rope_half, a.positions = positions;
  a.scale = c.scale, a.q = s.q, a.k = s.k, a.v = s.v;
  kc::lightning_qkv_prepare(a, stream);
}

// y += out_scale out_proj(sigmoid(gate xn) * grouped RMSNorm(o) * norm) (the steps after the recurrence).
void lightning_mixer_finish(kc::GemmRunner& gemm, const DevLightning& w, const LightningLayerConfig& c, int T,
            const __nv_bfloat16* xn, const LightningScratch& s, float* y, cudaStream_t stream) {
  const int hd = c.heads * c.head_dim;
  gemm.linear(T, hd, c.hidden, xn, c.hidden, w.gate, s.gate, CUDA_R_16BF, hd, 0.0f, stream);
  kc::rms_norm_gated(T * c.groups, hd / c.groups, s.o, s.gate, w.norm, c.norm_eps, s.o, stream, kc::NormGate::Sigmoid,
                     c.groups);
  gemm.linear(T, c.hidden, hd, s.o, hd, w.out_proj, y, CUDA_R_32F, c.hidden, 1.0f, stream, c.out_scale);
}

void lightning_mixer_prefill(kc::GemmRunner& gemm, const DevLightning& w, const LightningLayerConfig& c, int T,
                             const __nv_bfloat16* xn, const int* positions, const float* inv_freq,
                             kc::LightningPrefillArgs seqs, const LightningScratch& s, float* y, cudaStream_t stream) {
  if (T == 0) return;
  if (seqs.num_seqs <= 0)
    throw std::invalid_argument("lightning_mixer_prefill: " + std::to_string(T) + " tokens but no sequences");
  lightning_mixer_project(gemm, w, c, T, xn, positions, inv_freq, s, stream);
  seqs.num_heads = c.heads, seqs.head_dim = c.head_dim;
  seqs.q = s.q, seqs.k = s.k, seqs.v = s.v, seqs.slope = w.slope, seqs.out = s.o;
  seqs.workspace = s.workspace, seqs.workspace_bytes = s.workspace_bytes;
  kc::lightning_prefill(seqs, stream);
  lightning_mixer_finish(gemm, w, c, T, xn, s, y, stream);
}

void lightning_mixer_decode(kc::GemmRunner& gemm, const DevLightning& w, const LightningLayerConfig& c, int batch,
                            const __nv_bfloat16* xn, const int* positions, const float* inv_freq, float* state,
                            const int* state_slots, const LightningScratch& s, float* y, cudaStream_t stream) {
  if (batch == 0) return;
  lightning_mixer_project(gemm, w, c, batch, xn, positions, inv_freq, s, stream);
  kc::lightning_decode(batch, c.heads, c.head_dim, s.q, s.k, s.v, w.slope, state, s.o, stream, state_slots);
  lightning_mixer_finish(gemm, w, c, batch, xn, s, y, stream);
}

}  // namespace hypic::engine::cuda
