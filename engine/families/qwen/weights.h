// Checkpoint tensors of Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5 / Qwen3.5-MoE (Qwen3_5ForCausalLM,
// Qwen3_5MoeForCausalLM, and their ForConditionalGeneration wrappers), transformers 5.17, read into the internal
// layout of engine/checkpoint/weights.h (LinearAttnWeights, AttentionWeights, MoeWeights, MlpWeights). Part of
// hypic_engine_core; the entry points are load_weights / hf_checkpoint_layout / count_parameters
// (engine/checkpoint/weights.h), which dispatch here by family. Names under `model.layers.{i}.` (Qwen3.5's nested
// types: `model.language_model.layers.{i}.`):
//  - Gated DeltaNet (`linear_attn.`): Qwen3.5's flat in_proj_qkv [conv_dim, H], in_proj_z [nv*dv, H], in_proj_b /
//    in_proj_a [nv, H], or Qwen3-Next's grouped in_proj_qkvz [2*nk*dk + 2*nv*dv, H] and in_proj_ba [2*nv, H]
//    (regrouped at load, Qwen3NextGatedDeltaNet.fix_query_key_value_ordering); conv1d [conv_dim, 1, K] (or
//    [conv_dim, K]), A_log [nv], dt_bias [nv], norm [dv], out_proj [H, nv*dv];
//  - gated attention (`self_attn.`): q_proj [2*nh*hd, H] with attn_output_gate (per head hd query rows then hd gate
//    rows), else [nh*hd, H]; k_proj / v_proj [nkv*hd, H], o_proj [H, nh*hd], q_norm / k_norm [hd];
//  - `mlp.`: dense gate/up/down_proj, or router `gate.weight` [E, H], experts fused (`experts.gate_up_proj`
//    [E, 2I, H] and `experts.down_proj` [E, H, I], with or without `.weight`) or per expert
//    `experts.{e}.{gate,up,down}_proj.weight`, `shared_expert.*` and `shared_expert_gate.weight` [1, H].
#pragma once
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/checkpoint/weights_internal.h"

namespace hypic::engine::families::qwen {

/// Loads decoder layer `i` (prefix `p`, e.g. "model.layers.3."; l.type and l.is_moe set, the two layer norms read
/// by the caller) into `l`: l.linear or l.attention, then l.moe or l.mlp. Throws std::runtime_error naming a
/// missing or mis-shaped tensor.
void load_layer(const ModelConfig& c, weights_detail::Reader& rd, const std::string& p, int i, LayerWeights& l);

/// The tensors transformers 5.17 save_pretrained writes for this config, in order (embed_tokens, per layer
/// input_layernorm, mixer, mlp with per-expert experts, post_attention_layernorm; norm; lm_head unless tied; every
/// norm zero-centred): what write_random_checkpoint writes. The config is not validated here.
std::vector<CheckpointTensorSpec> checkpoint_layout(const ModelConfig& c);

/// count_parameters for a Qwen config, computed from the sizes (total and active per token: the routed experts a
/// token does not use are inactive).
ParameterCounts count_parameters(const ModelConfig& c);

}  // namespace hypic::engine::families::qwen
