// MiniMax's lightning-attention mixer on the CPU, fp32, as the Model (engine/cpu/model.cpp) calls it for linear
// layers. Its softmax layers (MiniMaxAttention: GQA with full-head RoPE, no gate, no qk-norm), its post-norm
// alpha/beta residuals and its softmax-routed MoE (MiniMaxSparseMoeBlock) run in the Model's shared attention,
// residual and MoE code. Part of hypic_engine_core. Shapes and state layouts follow engine/cpu/model.h
// (LinearLayerState::ssm [nh][d][d]); x is the mixer input [T][hidden] (already normed), out [T][hidden] the mixer
// output (before the residual).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/cpu/model.h"

namespace hypic::engine::families::minimax {

/// Lightning layer (MiniMaxLightningAttention.forward, transformers 5.17): [q | k | v] = silu(qkv_proj x) per head
/// (no scaling, no RoPE), the scalar-decay recurrence with decay e^{-slope_h} (block-wise over lightning_block_size
/// tokens, or token by token when `recurrent`), RMSNorm over nh*d (eps linear_norm_eps), * sigmoid(output_gate x),
/// out_proj (shared::lightning_qkv, shared::lightning_output). transition: when not null, receives T_C as one scalar
/// per head [nh].
void lightning_layer(const ModelConfig& c, const LightningWeights& w, LinearLayerState& st, const float* x,
                     int64_t T, bool recurrent, std::vector<float>* transition, float* out);

/// Checks the shapes of layer lw's mixer tensors (LightningWeights or the plain AttentionWeights, under
/// `<p>self_attn.`, p e.g. "layers.3.") against the config; throws std::invalid_argument naming the tensor and both
/// shapes.
void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p);

}  // namespace hypic::engine::families::minimax
