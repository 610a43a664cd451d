// Checkpoint-reading helpers the Kimi-Linear, MiniMax and Ring-linear loaders share. Contracts: shared/weights.h.
#include "engine/families/shared/weights.h"

#include <string>
#include <vector>

namespace hypic::engine::families::shared {

std::string either_weight(const Reader& rd, const std::string& name) {
  return rd.has(name) ? name : name + ".weight";
}

std::string first_present(const Reader& rd, std::initializer_list<std::string> names) {
  for (const auto& n : names)
    if (rd.has(n)) return n;
  return *names.begin();
}

void load_mlp(Reader& rd, const std::string& p, int64_t H, int64_t I, MlpWeights& w) {
  w.gate_proj = rd.take(p + "gate_proj.weight", {I, H});
  w.up_proj = rd.take(p + "up_proj.weight", {I, H});
  w.down_proj = rd.take(p + "down_proj.weight", {H, I});
}

namespace {

/// `layer.mlp.` or `layer.block_sparse_moe.`: the one holding `probe`.
std::string ffn_prefix(const Reader& rd, const std::string& layer, const std::string& probe) {
  return rd.has(layer + "block_sparse_moe." + probe) && !rd.has(layer + "mlp." + probe) ? layer + "block_sparse_moe."
                                                                                        : layer + "mlp.";
}

void load_experts(const ModelConfig& c, Reader& rd, const std::string& p, MoeWeights& w) {
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  const std::string fused = either_weight(rd, p + "experts.gate_up_proj");
  if (rd.has(fused)) {
    w.experts_gate_up = rd.take(fused, {E, 2 * I, H});
    w.experts_down = rd.take(either_weight(rd, p + "experts.down_proj"), {E, H, I});
    return;
  }
  w.experts_gate_up.shape = {E, 2 * I, H};
  w.experts_gate_up.data.resize(size_t(E * 2 * I * H));
  w.experts_down.shape = {E, H, I};
  w.experts_down.data.resize(size_t(E * H * I));
  const bool mixtral_names = rd.has(p + "experts.0.w1.weight");
  for (int64_t e = 0; e < E; ++e) {
    const std::string q = p + "experts." + std::to_string(e) + ".";
    float* gu = w.experts_gate_up.data.data() + e * 2 * I * H;
    rd.take_into(q + (mixtral_names ? "w1.weight" : "gate_proj.weight"), {I, H}, gu);
    rd.take_into(q + (mixtral_names ? "w3.weight" : "up_proj.weight"), {I, H}, gu + I * H);
    rd.take_into(q + (mixtral_names ? "w2.weight" : "down_proj.weight"), {H, I}, w.experts_down.data.data() + e * H * I);
  }
}

}  // namespace

void load_ffn(const ModelConfig& c, Reader& rd, const std::string& layer, LayerWeights& l) {
  const int64_t H = c.hidden_size;
  if (!l.is_moe) {
    load_mlp(rd, ffn_prefix(rd, layer, "gate_proj.weight"), H, c.intermediate_size, l.mlp);
    return;
  }
  const std::string p = ffn_prefix(rd, layer, "gate.weight");
  MoeWeights& w = l.moe;
  w.router = rd.take(p + "gate.weight", {c.num_experts, H});
  if (c.router_bias)
    w.router_bias = rd.take(first_present(rd, {p + "gate.e_score_correction_bias", p + "gate.expert_bias"}),
                            {c.num_experts});
  load_experts(c, rd, p, w);
  if (c.shared_expert_intermediate_size > 0)
    load_mlp(rd, p + "shared_experts.", H, c.shared_expert_intermediate_size, w.shared_expert);
}

void add_ffn_layout(const ModelConfig& c, LayoutSink& add, const std::string& p, int i, const MoeNames& names) {
  const int64_t H = c.hidden_size;
  if (c.is_moe_layer(i)) {
    const std::string m = p + names.block;
    add(m + "gate.weight", {c.num_experts, H});
    if (c.router_bias) add(m + names.router_bias, {c.num_experts});
    const bool mixtral = names.mixtral_experts;
    const int64_t I = c.moe_intermediate_size;
    for (int e = 0; e < c.num_experts; ++e) {
      const std::string x = m + "experts." + std::to_string(e) + ".";
      add(x + (mixtral ? "w1.weight" : "gate_proj.weight"), {I, H});
      add(x + (mixtral ? "w2.weight" : "down_proj.weight"), {H, I});
      add(x + (mixtral ? "w3.weight" : "up_proj.weight"), {I, H});
    }
    if (c.shared_expert_intermediate_size > 0) add.mlp(m + "shared_experts.", c.shared_expert_intermediate_size);
  } else {
    add.mlp(p + "mlp.", c.intermediate_size);
  }
}

std::vector<CheckpointTensorSpec> checkpoint_layout(const ModelConfig& c, const std::string& embed,
                                                    const LayerLayout& layer) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  LayoutSink add{H, {}};
  const TensorRole norm = TensorRole::GatedNorm;  // applied as w
  add(embed, {V, H});
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {H}, norm);
    layer(i, p, add);
    add(p + "post_attention_layernorm.weight", {H}, norm);
  }
  add("model.norm.weight", {H}, norm);
  if (!c.tie_word_embeddings) add("lm_head.weight", {V, H});
  return std::move(add.specs);
}

}  // namespace hypic::engine::families::shared
