// Checkpoint tensors of Ring-linear-2.0 (BailingMoeLinearV2ForCausalLM: the hub checkpoints of
// inclusionAI/Ring-mini-linear-2.0 and Ring-flash-linear-2.0), read into the internal layout of
// engine/checkpoint/weights.h (LightningWeights, AttentionWeights, MoeWeights), and the per-head decay rates of its
// lightning layers. Part of hypic_engine_core; the entry points are load_weights / hf_checkpoint_layout /
// lightning_slope_rates (engine/checkpoint/weights.h), which dispatch here by family. Names: the embedding
// `model.word_embeddings.weight` (kEmbedName); under `model.layers.{i}.attention.`:
//  - lightning layers: `query_key_value` [3*nh*d, H] (rows [Q | K | V] already flat), `g_proj` [nh*d, H],
//    `g_norm` [nh*d], `dense` [H, nh*d], with use_qk_norm `query_layernorm` / `key_layernorm` [d]; slopes from
//    slope_rates() (the checkpoint holds none);
//  - softmax layers: `query_key_value` [(nh + 2*nkv)*hd, H] (rows [Q | K | V], split at load into q/k/v_proj),
//    `dense` [H, nh*hd], with use_qk_norm `query_layernorm` / `key_layernorm` [hd];
//  - MLP / MoE: shared::load_ffn (`mlp.`, router bias `mlp.gate.expert_bias`, experts gate/up/down_proj, ungated
//    `shared_experts.`).
#pragma once
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/checkpoint/weights_internal.h"

namespace hypic::engine::families::ring_linear {

/// Ring's token embedding, under `model.` (the other families' is `embed_tokens.weight`).
inline constexpr const char* kEmbedName = "word_embeddings.weight";

/// Loads decoder layer `i` (prefix `p`, e.g. "model.layers.3."; l.type and l.is_moe set, the two layer norms read
/// by the caller) into `l`: l.lightning or l.attention, then l.moe or l.mlp. Throws std::runtime_error naming a
/// missing or mis-shaped tensor.
void load_layer(const ModelConfig& c, weights_detail::Reader& rd, const std::string& p, int i, LayerWeights& l);

/// The hub checkpoints' tensors for this config, in order (model.word_embeddings, per layer its norms, mixer under
/// `attention.` and `mlp.` experts gate/down/up_proj per expert, model.norm, lm_head unless tied).
std::vector<CheckpointTensorSpec> checkpoint_layout(const ModelConfig& c);

/// The slopes of Ring's lightning layer `layer` (0-based over all L layers; BailingMoeV2 linear attention), fp32:
/// ALiBi slopes of nh heads (the power-of-two construction, interleaved from 2p heads for other nh) times
/// (1 - (layer - 1)/(L - 1) + 1e-5) (1 + 1e-5 when L == 1). `layer` must be in range (lightning_slope_rates checks).
std::vector<float> slope_rates(const ModelConfig& c, int layer);

}  // namespace hypic::engine::families::ring_linear
