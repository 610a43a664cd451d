// Ring-linear's lightning layer on the CPU, fp32. Contracts: ring_linear/layers.h.
#include "engine/families/ring_linear/layers.h"

#include <cmath>

#include "engine/families/shared/layers.h"
#include "kernels/cpu/ops.h"

namespace hypic::engine::families::ring_linear {

namespace cpu = hypic::kernels::cpu;

void lightning_layer(const ModelConfig& c, const LightningWeights& w, LinearLayerState& st, const float* x,
                     int64_t T, int64_t start_position, const std::vector<float>& inv_freq, bool recurrent,
                     std::vector<float>* transition, float* out) {
  const int nh = c.num_attention_heads, d = c.head_dim;
  std::vector<float> q, k, v;
  shared::lightning_qkv(c, w, x, T, q, k, v);
  const float eps = static_cast<float>(c.rms_norm_eps);
  if (c.use_qk_norm) {
    cpu::rms_norm(T * nh, d, q.data(), w.q_norm.ptr(), eps, q.data());
    cpu::rms_norm(T * nh, d, k.data(), w.k_norm.ptr(), eps, k.data());
  }
  if (c.linear_rope) {
    cpu::apply_rope(q.data(), T, nh, d, inv_freq, start_position);
    cpu::apply_rope(k.data(), T, nh, d, inv_freq, start_position);
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  for (auto& e : q) e *= scale;
  shared::lightning_output(c, w, st, x, T, q, k, v, recurrent, transition, out);
}

void check_layer_shapes(const ModelConfig& c, const LayerWeights& lw, const std::string& p) {
  const std::string q = p + "attention.";
  if (lw.type == LayerType::Linear) {
    shared::check_lightning_shapes(c, lw.lightning, q);
    if (c.use_qk_norm) {
      const int64_t d = c.head_dim;
      expect_shape(lw.lightning.q_norm, {d}, q + "query_layernorm");
      expect_shape(lw.lightning.k_norm, {d}, q + "key_layernorm");
    }
  } else {
    shared::check_attention_shapes(c, lw.attention, q);
  }
}

}  // namespace hypic::engine::families::ring_linear
