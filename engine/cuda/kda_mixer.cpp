// The KDA layer on the GPU. Contracts: kda_mixer.h.
#include "engine/cuda/kda_mixer.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/ops.h"

namespace hypic::engine::cuda {

namespace kc = hypic::kernels::cuda;

KdaLayerConfig KdaLayerConfig::of(const ModelConfig& c) {
  const std::string f = "KdaLayerConfig: ";
  if (c.family != ModelFamily::KimiLinear)
    throw std::invalid_argument(f + "family " + model_family_name(c.family) + " has no KDA layers");
  if (c.linear_key_head_dim != kc::kKdaHeadDim || c.linear_value_head_dim != kc::kKdaHeadDim)
    throw std::invalid_argument(f + "KDA head size " + std::to_string(c.linear_key_head_dim) + " / " +
                                std::to_string(c.linear_value_head_dim) + " is not supported by the GPU kernels (128)");
  if (c.linear_num_key_heads != c.linear_num_value_heads)
    throw std::invalid_argument(f + "KDA key heads " + std::to_string(c.linear_num_key_heads) + " != value heads " +
                                std::to_string(c.linear_num_value_heads));
  if (c.linear_conv_kernel_dim < 2 || c.linear_conv_kernel_dim > 8)
    throw std::invalid_argument(f + "short conv kernel " + std::to_string(c.linear_conv_kernel_dim) +
                                " outside [2, 8]");
  KdaLayerConfig l;
  l.hidden = c.hidden_size, l.heads = c.linear_num_value_heads, l.head_dim = c.linear_value_head_dim;
  l.conv_kernel = c.linear_conv_kernel_dim;
  l.eps = static_cast<float>(c.rms_norm_eps);
  l.scale = static_cast<float>(1.0 / std::sqrt(double(l.head_dim)));
  l.out_scale = static_cast<float>(c.linear_attn_beta);
  return l;
}

namespace {

// The low-rank gate projections and the gates: low = [f_a | g_a | b] x, g and beta (fp32), gate = g_b(g_a x).
void gates(kc::GemmRunner& gemm, const DevKda& w, const KdaLayerConfig& c, int T, const __nv_bfloat16* xn,
           const KdaScratch& s, cudaStream_t stream) {
  const int d = c.head_dim, hd = c.heads * d, lw = c.low_width();
  gemm.linear(T, 2 * d + c.heads, c.hidden, xn, c.hidden, w.low_proj, s.low, CUDA_R_16BF, lw, 0.0f, stream);
  gemm.linear(T, hd, d, s.low, lw, w.f_b_proj, s.graw, CUDA_R_16BF, hd, 0.0f, stream);
  kc::kda_gate(T, c.heads, s.graw, w.A_log, w.dt_bias, s.g, stream, s.low + 2 * d, lw, s.beta);
  gemm.linear(T, hd, d, s.low + d, lw, w.g_b_proj, s.gate, CUDA_R_16BF, hd, 0.0f, stream);
}

}  // namespace

// y += out_scale o_proj(RMSNorm_head(o) o_norm * sigmoid(gate)).
void kda_mixer_finish(kc::GemmRunner& gemm, const DevKda& w, const KdaLayerConfig& c, int T, const KdaScratch& s,
                      float* y, cudaStream_t stream) {
  const int hd = c.heads * c.head_dim;
  kc::rms_norm_gated(T * c.heads, c.head_dim, s.o, s.gate, w.o_norm, c.eps, s.o, stream, kc::NormGate::Sigmoid, 1);
  gemm.linear(T, c.hidden, hd, s.o, hd, w.o_proj, y, CUDA_R_32F, c.hidden, 1.0f, stream, c.out_scale);
}

void kda_mixer_project(kc::GemmRunner& gemm, const DevKda& w, const KdaLayerConfig& c, int T, const __nv_bfloat16* xn,
                       int num_seqs, const int* cu_seqlens, __nv_bfloat16* conv_state, const KdaScratch& s,
                       cudaStream_t stream) {
  const int hd = c.heads * c.head_dim;
  gemm.linear(T, 3 * hd, c.hidden, xn, c.hidden, w.qkv_proj, s.pre, CUDA_R_16BF, 3 * hd, 0.0f, stream);
  kc::conv1d_silu_prefill(num_seqs, cu_seqlens, T, 3 * hd, c.conv_kernel, s.pre, w.conv1d, conv_state,
                          kc::ConvQkvOut{s.q, s.k, s.v, hd}, stream);
  gates(gemm, w, c, T, xn, s, stream);
}

void kda_mixer_prefill(kc::GemmRunner& gemm, const DevKda& w, const KdaLayerConfig& c, int T, const __nv_bfloat16* xn,
                       kc::KdaPrefillArgs seqs, __nv_bfloat16* conv_state, const KdaScratch& s, float* y,
                       cudaStream_t stream) {
  if (T == 0) return;
  if (seqs.num_seqs <= 0)
    throw std::invalid_argument("kda_mixer_prefill: " + std::to_string(T) + " tokens but no sequences");
  kda_mixer_project(gemm, w, c, T, xn, seqs.num_seqs, seqs.cu_seqlens, conv_state, s, stream);
  seqs.num_heads = c.heads, seqs.total_tokens = T;
  seqs.q = s.q, seqs.k = s.k, seqs.v = s.v, seqs.g = s.g, seqs.beta = s.beta;
  seqs.l2norm_qk = true, seqs.scale = c.scale, seqs.out = s.o;
  seqs.workspace = s.workspace, seqs.workspace_bytes = s.workspace_bytes;
  kc::kda_prefill(seqs, stream);
  kda_mixer_finish(gemm, w, c, T, s, y, stream);
}

void kda_mixer_decode(kc::GemmRunner& gemm, const DevKda& w, const KdaLayerConfig& c, int batch,
                      const __nv_bfloat16* xn, float* state, __nv_bfloat16* conv_state, const int* state_slots,
                      const KdaScratch& s, float* y, cudaStream_t stream) {
  if (batch == 0) return;
  const int hd = c.heads * c.head_dim;
  gemm.linear(batch, 3 * hd, c.hidden, xn, c.hidden, w.qkv_proj, s.pre, CUDA_R_16BF, 3 * hd, 0.0f, stream);
  kc::conv1d_silu_decode(batch, 3 * hd, c.conv_kernel, s.pre, w.conv1d, conv_state, kc::ConvQkvOut{s.q, s.k, s.v, hd},
                         stream, state_slots);
  gates(gemm, w, c, batch, xn, s, stream);
  kc::kda_decode(batch, c.heads, s.q, s.k, s.v, s.g, s.beta, true, c.scale, state, s.o, stream, state_slots);
  kda_mixer_finish(gemm, w, c, batch, s, y, stream);
}

}  // namespace hypic::engine::cuda
