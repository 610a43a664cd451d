// Kimi-Linear's MLA layer on the GPU. Contracts: mla_mixer.h.
#include "engine/cuda/mla_mixer.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace hypic::engine::cuda {

namespace kc = hypic::kernels::cuda;

MlaLayerConfig MlaLayerConfig::of(const ModelConfig& c) {
  const std::string f = "MlaLayerConfig: ";
  if (c.family != ModelFamily::KimiLinear)
    throw std::invalid_argument(f + "family " + model_family_name(c.family) + " has no MLA layers");
  if (c.q_lora_rank > 0)
    throw std::invalid_argument(f + "q_lora_rank " + std::to_string(c.q_lora_rank) +
                                " (the q LoRA) is not supported on the GPU yet; q_proj checkpoints are");
  MlaLayerConfig l;
  l.hidden = c.hidden_size;
  l.dims = {c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank};
  if (l.dims.padded() == 0)
    throw std::invalid_argument(f + "qk head dim " + std::to_string(c.qk_nope_head_dim + c.qk_rope_head_dim) +
                                " or v head dim " + std::to_string(c.v_head_dim) + " is over 256");
  l.scale = static_cast<float>(1.0 / std::sqrt(double(c.qk_nope_head_dim + c.qk_rope_head_dim)));
  l.out_scale = static_cast<float>(c.full_attn_beta);
  return l;
}

void mla_mixer(kc::GemmRunner& gemm, const DevMla& w, const MlaLayerConfig& c, int T, const __nv_bfloat16* xn,
               const int* kv_rows, const kc::AttnGroups& groups, __nv_bfloat16* k_pool, __nv_bfloat16* v_pool,
               kc::AttnDecodeWorkspace* ws, bool decode, const MlaScratch& s, float* y, cudaStream_t stream) {
  if (T == 0) return;
  const kc::MlaDims& d = c.dims;
  const int qk = d.nope + d.rope, P = d.padded(), nh = d.heads;
  gemm.linear(T, nh * qk, c.hidden, xn, c.hidden, w.q_proj, s.q, CUDA_R_16BF, nh * qk, 0.0f, stream);
  gemm.linear(T, d.rank + d.rope, c.hidden, xn, c.hidden, w.kv_a_proj, s.ckv, CUDA_R_16BF, d.rank + d.rope, 0.0f,
              stream);
  kc::mla_latent_norm(T, d, s.ckv, w.kv_a_layernorm, c.latent_eps, s.latent, stream);
  gemm.linear(T, nh * (d.nope + d.v), d.rank, s.latent, d.rank, w.kv_b_proj, s.kvb, CUDA_R_16BF, nh * (d.nope + d.v),
              0.0f, stream);
  kc::mla_expand(T, d, s.q, s.ckv, s.kvb, kv_rows, s.q_pad, k_pool, v_pool, stream);
  if (decode) {
    if (!ws) throw std::invalid_argument("mla_mixer: decode needs an attention workspace");
    kc::attention_decode(groups, nh, nh, P, s.q_pad, k_pool, v_pool, c.scale, nullptr, 0, 0, s.attn, *ws, stream);
  } else if (ws) {
    kc::attention_prefill(groups, nh, nh, P, s.q_pad, k_pool, v_pool, c.scale, nullptr, 0, 0, s.attn, *ws, stream);
  } else {
    kc::attention_prefill(groups, nh, nh, P, s.q_pad, k_pool, v_pool, c.scale, nullptr, 0, 0, s.attn, stream);
  }
  kc::mla_pack_output(T, d, s.attn, s.packed, stream);
  gemm.linear(T, c.hidden, nh * d.v, s.packed, nh * d.v, w.o_proj, y, CUDA_R_32F, c.hidden, 1.0f, stream, c.out_scale);
}

}  // namespace hypic::engine::cuda
