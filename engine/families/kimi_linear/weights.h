// Checkpoint tensors of Kimi-Linear (KimiLinearForCausalLM, transformers 5.17; the released
// moonshotai/Kimi-Linear-48B-A3B checkpoints), read into the internal layout of engine/checkpoint/weights.h
// (KdaWeights, MlaWeights, MoeWeights). Part of hypic_engine_core; the entry points are load_weights /
// hf_checkpoint_layout (engine/checkpoint/weights.h), which dispatch here by family. Names under
// `model.layers.{i}.`:
//  - KDA (linear layers, `self_attn.`): q_proj / k_proj / v_proj [nh*d, H]; the short convs as three
//    `{q,k,v}_conv1d.weight` [nh*d, 1, K] (or [nh*d, K]) or one packed `conv1d.weight` [3*nh*d, 1, K], stored
//    [3*nh*d, K]; the forget gate `f_a_proj` [d, H], `f_b_proj` [nh*d, d], `A_log` ([1,1,nh,1], [nh,1] or [nh];
//    stored [nh]), `dt_bias` ([nh*d] or [nh, d]; stored [nh*d]), directly under `self_attn.` or under
//    `self_attn.forget_gate.`; b_proj [nh, H], g_a_proj [d, H], g_b_proj [nh*d, d], o_norm [d], o_proj [H, nh*d].
//  - MLA (full-attention layers, `self_attn.`): q_proj [nh*qk, H] or q_a_proj [Q, H] + q_a_layernorm [Q] +
//    q_b_proj [nh*qk, Q]; kv_a_proj_with_mqa [R + qk_rope, H], kv_a_layernorm [R], kv_b_proj
//    [nh*(qk_nope + v_head_dim), R], o_proj [H, nh*v_head_dim].
//  - MLP / MoE: shared::load_ffn (`block_sparse_moe.` or `mlp.`, router bias `gate.e_score_correction_bias`,
//    experts w1/w2/w3 or gate/up/down_proj or fused, ungated `shared_experts.`).
#pragma once
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/checkpoint/weights_internal.h"

namespace hypic::engine::families::kimi_linear {

/// Loads decoder layer `i` (prefix `p`, e.g. "model.layers.3."; l.type and l.is_moe set, the two layer norms read
/// by the caller) into `l`: l.kda or l.mla, then l.moe or l.mlp. Throws std::runtime_error naming a missing or
/// mis-shaped tensor.
void load_layer(const ModelConfig& c, weights_detail::Reader& rd, const std::string& p, int i, LayerWeights& l);

/// The released checkpoints' tensors for this config, in order (model.embed_tokens, per layer its norms, mixer and
/// `block_sparse_moe.` experts w1/w2/w3 per expert, model.norm, lm_head): what write_random_checkpoint writes.
std::vector<CheckpointTensorSpec> checkpoint_layout(const ModelConfig& c);

}  // namespace hypic::engine::families::kimi_linear
