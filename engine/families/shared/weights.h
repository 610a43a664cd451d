// Checkpoint-reading helpers the Kimi-Linear, MiniMax and Ring-linear loaders share (engine/families/<family>/
// weights.cpp): tensor-name alternatives, their MLP / MoE blocks (one loader for the names of all three: transformers
// 5.17 save_pretrained and the released checkpoints) and the skeleton of their checkpoint layouts. Part of
// hypic_engine_core. Not a public API: the entry points are load_weights / hf_checkpoint_layout
// (engine/checkpoint/weights.h), which dispatch to the families.
#pragma once
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/checkpoint/weights_internal.h"

namespace hypic::engine::families::shared {

using weights_detail::LayoutSink;
using weights_detail::Reader;

/// `name` or `name.weight`, whichever the checkpoint holds (`name.weight` when neither, so the error names it).
std::string either_weight(const Reader& rd, const std::string& name);

/// The first of the candidate names the checkpoint holds, else the first (so the error names it).
std::string first_present(const Reader& rd, std::initializer_list<std::string> names);

/// A dense SwiGLU MLP of width I under prefix p: `gate_proj.weight`, `up_proj.weight` [I, H] and `down_proj.weight`
/// [H, I] (Qwen's `mlp.` and `shared_expert.` too).
void load_mlp(Reader& rd, const std::string& p, int64_t H, int64_t I, MlpWeights& w);

/// The MLP of decoder layer `layer` (prefix, e.g. "model.layers.3."), by l.is_moe:
///  - dense SwiGLU of intermediate_size: `gate_proj` / `up_proj` [I, H], `down_proj` [H, I] under `mlp.` or
///    `block_sparse_moe.`;
///  - MoE under `mlp.` or `block_sparse_moe.` (the one holding `gate.weight`): router `gate.weight` [E, H], its bias
///    when router_bias (`gate.e_score_correction_bias` or Ring's `gate.expert_bias`) [E], experts fused
///    (`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I], with or without `.weight`) or per
///    expert (`experts.{e}.w1/w3/w2.weight`, Mixtral's gate / up / down, or `experts.{e}.{gate,up,down}_proj.weight`),
///    shared experts `shared_experts.{gate,up,down}_proj.weight` (ungated, width shared_expert_intermediate_size).
/// Into l.mlp or l.moe (MoeWeights: experts_gate_up per expert I gate rows then I up rows).
void load_ffn(const ModelConfig& c, Reader& rd, const std::string& layer, LayerWeights& l);

/// The names of a family's MoE block in its released checkpoints.
struct MoeNames {
  const char* block;        ///< under the layer: "block_sparse_moe." (Kimi, MiniMax) or "mlp." (Ring)
  const char* router_bias;  ///< "gate.e_score_correction_bias" (Kimi) or "gate.expert_bias" (Ring)
  bool mixtral_experts;     ///< experts.{e}.w1/w2/w3 (Kimi, MiniMax) rather than experts.{e}.{gate,down,up}_proj
};

/// Adds layer `i`'s MLP to a layout (prefix `p`, e.g. "model.layers.3."): the MoE block under `names` (router
/// [E, H], router bias [E] when router_bias, per expert gate / down / up, shared experts when
/// shared_expert_intermediate_size > 0) when the layer is MoE, else a dense `mlp.` of intermediate_size.
void add_ffn_layout(const ModelConfig& c, LayoutSink& add, const std::string& p, int i, const MoeNames& names);

/// Adds one decoder layer's mixer and MLP to a layout: (i, p = "model.layers.{i}.", sink).
using LayerLayout = std::function<void(int, const std::string&, LayoutSink&)>;

/// The checkpoint layout of a Kimi-Linear / MiniMax / Ring model, in order: `embed` [V, H]; per layer
/// input_layernorm [H], what `layer` adds, post_attention_layernorm [H]; model.norm.weight [H]; lm_head.weight
/// [V, H] unless tied. Every norm is TensorRole::GatedNorm (applied as w).
std::vector<CheckpointTensorSpec> checkpoint_layout(const ModelConfig& c, const std::string& embed,
                                                    const LayerLayout& layer);

}  // namespace hypic::engine::families::shared
