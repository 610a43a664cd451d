// Ring-linear's lightning-attention mixer on the CPU, fp32, as the Model (engine/cpu/model.cpp) calls it for linear
// layers. Its softmax layers (GQA with plain (w) qk-norm and partial RoPE) and its MoE (routed by
// shared::route_sigmoid, ungated shared experts) run in the Model's shared attention and MoE code. Part of
// hypic_engine_core. Source: the linear attention of BailingMoeLinearV2ForCausalLM, not in transformers (vLLM's
// bailing_moe_linear.py / bailing_linear_attn.py and sglang's bailing_moe_linear.py implement it;
// tools/ring_linear_reference.py, the fp32 PyTorch reference of the test fixtures). Shapes and state layouts follow
// engine/cpu/model.h (LinearLayerState::ssm [nh][d][d]); x is the mixer input [T][hidden] (already normed), out
// [T][hidden] the mixer output (before the residual).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/cpu/model.h"

namespace hypic::engine::families::ring_linear {

/// Lightning layer: [q | k | v] = query_key_value x (silu'd when linear_qkv_silu), per-head RMSNorm of q and k
/// (query_layernorm / key_layernorm, applied as w, eps rms_norm_eps; when use_qk_norm), partial NeoX RoPE at
/// positions start_position.. (when linear_rope; `inv_freq` over rotary_dim()), q *= d^-1/2, the scalar-decay
/// recurrence with decay e^{-slope_h}, group RMSNorm (group_norm_size contiguous groups of nh*d / group_norm_size
/// channels), * sigmoid(g_proj x), dense (shared::lightning_qkv, shared::lightning_output around the q/k
/// preparation). transition: when not null, receives T_C as one scalar per head [nh].
void lightning_layer(const ModelConfig& c, const LightningWeights& w, LinearLayerState& st, const float* x,
                     int64_t T, int64_t start_position, const std::vector<float>& inv_freq, bool recurrent,
                     std::vector<float>* transition, float* out);

/// Checks the shapes of layer lw's mixer tensors (LightningWeights with its qk-norms, or the plain AttentionWeights,
/// under `<p>attention.`, p e.g. "layers.3.") against the config; throws std::invalid_argument naming the tensor
/// and both shapes.
void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p);

}  // namespace hypic::engine::families::ring_linear
