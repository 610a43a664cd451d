// MiniMax's lightning layer on the CPU, fp32. Contracts: minimax/layers.h.
#include "engine/families/minimax/layers.h"

#include "engine/families/shared/layers.h"

namespace hypic::engine::families::minimax {

void lightning_layer(const ModelConfig& c, const LightningWeights& w, LinearLayerState& st, const float* x,
                     int64_t T, bool recurrent, std::vector<float>* transition, float* out) {
  std::vector<float> q, k, v;
  shared::lightning_qkv(c, w, x, T, q, k, v);
  shared::lightning_output(c, w, st, x, T, q, k, v, recurrent, transition, out);
}

void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p) {
  const std::string q = p + "self_attn.";
  if (lw.type == LayerType::Linear)
    shared::check_lightning_shapes(c, lw.lightning, q);
  else
    shared::check_attention_shapes(c, lw.attention, q);
}

}  // namespace hypic::engine::families::minimax
