// The shape checks of a layer's tensors, dispatched by family. Contract: family_layers.h.
#include "engine/families/family_layers.h"

namespace hypic::engine::families {

void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p) {
  switch (c.family) {
    case ModelFamily::Qwen: qwen::check_layer_shapes(c, lw, p); return;  // no router bias
    case ModelFamily::KimiLinear: kimi_linear::check_layer_shapes(c, lw, p); break;
    case ModelFamily::MiniMax: minimax::check_layer_shapes(c, lw, p); break;
    case ModelFamily::RingLinear: ring_linear::check_layer_shapes(c, lw, p); break;
  }
  if (lw.is_moe && c.router_bias) expect_shape(lw.moe.router_bias, {c.num_experts}, p + "mlp.gate.e_score_correction_bias");
}

}  // namespace hypic::engine::families
