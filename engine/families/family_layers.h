// The model families' layer math as the CPU forward pass (engine/cpu/model.cpp) reaches it: each family's mixers
// (engine/families/<family>/layers.h: Qwen's Gated DeltaNet, Kimi-Linear's KDA and MLA, MiniMax's and Ring's
// lightning attention), what several share (shared/layers.h: the lightning halves, the sigmoid router,
// expect_shape), and check_layer_shapes, which dispatches the shape checks of a layer's tensors to its family.
// Internal to the engine (hypic_engine_core).
#pragma once
#include <string>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/families/kimi_linear/layers.h"
#include "engine/families/minimax/layers.h"
#include "engine/families/qwen/layers.h"
#include "engine/families/ring_linear/layers.h"
#include "engine/families/shared/layers.h"

namespace hypic::engine::families {

/// Checks the shapes of layer `lw`'s mixer tensors against the config, by family (<family>::check_layer_shapes),
/// then, for the non-Qwen families, the MoE router bias [E] when the layer is MoE and router_bias is set. p names
/// the layer in messages (e.g. "layers.3."); throws std::invalid_argument naming the tensor and both shapes.
void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p);

}  // namespace hypic::engine::families
