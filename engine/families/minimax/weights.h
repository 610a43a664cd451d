// Checkpoint tensors of MiniMax-Text-01 (MiniMaxForCausalLM, transformers 5.17; the released
// MiniMaxAI/MiniMax-Text-01 checkpoints), read into the internal layout of engine/checkpoint/weights.h
// (LightningWeights, AttentionWeights, MoeWeights), and the per-head decay rates of its lightning layers. Part of
// hypic_engine_core; the entry points are load_weights / hf_checkpoint_layout / lightning_slope_rates
// (engine/checkpoint/weights.h), which dispatch here by family. Names under `model.layers.{i}.self_attn.`:
//  - lightning layers (MiniMaxLightningAttention): `qkv_proj` [3*nh*d, H] with rows per head [q_h | k_h | v_h]
//    (regrouped at load to [Q all heads | K | V]), `output_gate` [nh*d, H], `norm` [nh*d], `out_proj` [H, nh*d];
//    the buffer `slope_rate` [nh,1,1] or [nh] is used when present (as HF does), else slope_rates(); the derived
//    buffers `query_decay` / `key_decay` / `diagonal_decay` are ignored;
//  - softmax layers (MiniMaxAttention): q_proj [nh*hd, H], k_proj / v_proj [nkv*hd, H], o_proj [H, nh*hd];
//  - MoE: shared::load_ffn (`block_sparse_moe.`, experts w1/w2/w3, or the save_pretrained names).
#pragma once
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/checkpoint/weights_internal.h"

namespace hypic::engine::families::minimax {

/// Loads decoder layer `i` (prefix `p`, e.g. "model.layers.3."; l.type and l.is_moe set, the two layer norms read
/// by the caller) into `l`: l.lightning or l.attention, then l.moe or l.mlp. Throws std::runtime_error naming a
/// missing or mis-shaped tensor.
void load_layer(const ModelConfig& c, weights_detail::Reader& rd, const std::string& p, int i, LayerWeights& l);

/// The released checkpoints' tensors for this config, in order (model.embed_tokens, per layer its norms, mixer and
/// `block_sparse_moe.` experts w1/w2/w3 per expert, model.norm, lm_head unless tied).
std::vector<CheckpointTensorSpec> checkpoint_layout(const ModelConfig& c);

/// MiniMaxLightningAttention.get_slope_rate for lightning layer `layer` (0-based over all L layers), fp32:
/// s_h = (2^(-8/nh))^(h+1) * (1 - layer/(L - 1 + 1e-5) + 1e-5). `layer` must be in range (lightning_slope_rates
/// checks).
std::vector<float> slope_rates(const ModelConfig& c, int layer);

}  // namespace hypic::engine::families::minimax
