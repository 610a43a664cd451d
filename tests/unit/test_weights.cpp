// load_weights on the HF fixtures: both checkpoint layouts give identical ModelWeights, parameter counts
// agree with the config formula and with the files, Qwen3-Next's grouped projections regroup like a
// hand-grouped copy, bf16 files convert exactly, and missing / mis-shaped / unexpected tensors are errors
// naming the tensor and the shapes. Also the random checkpoints of write_random_checkpoint.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/weights.h"

using namespace hypic::engine;
namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = fs::path(HYPIC_SOURCE_DIR) / "tests" / "fixtures";

fs::path scratch(const std::string& name) {
  const fs::path p = fs::path(HYPIC_BINARY_DIR) / "test_scratch" / "weights" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

/// Every tensor of a model, keyed by an internal name, for whole-model comparisons.
std::map<std::string, const Tensor*> flatten(const ModelWeights& w) {
  std::map<std::string, const Tensor*> m{{"embed", &w.embed}, {"final_norm", &w.final_norm}, {"lm_head", &w.lm_head}};
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = std::to_string(i) + ".";
    const std::pair<const char*, const Tensor*> items[] = {
        {"in_norm", &l.input_layernorm},
        {"post_norm", &l.post_attention_layernorm},
        {"qkv", &l.linear.in_proj_qkv},
        {"z", &l.linear.in_proj_z},
        {"b", &l.linear.in_proj_b},
        {"a", &l.linear.in_proj_a},
        {"conv", &l.linear.conv1d},
        {"A_log", &l.linear.A_log},
        {"dt_bias", &l.linear.dt_bias},
        {"gnorm", &l.linear.norm},
        {"out", &l.linear.out_proj},
        {"q", &l.attention.q_proj},
        {"k", &l.attention.k_proj},
        {"v", &l.attention.v_proj},
        {"o", &l.attention.o_proj},
        {"qn", &l.attention.q_norm},
        {"kn", &l.attention.k_norm},
        {"router", &l.moe.router},
        {"gate_up", &l.moe.experts_gate_up},
        {"down", &l.moe.experts_down},
        {"sh_gate", &l.moe.shared_expert.gate_proj},
        {"sh_up", &l.moe.shared_expert.up_proj},
        {"sh_down", &l.moe.shared_expert.down_proj},
        {"sh_g", &l.moe.shared_expert_gate},
        {"mlp_gate", &l.mlp.gate_proj},
        {"mlp_up", &l.mlp.up_proj},
        {"mlp_down", &l.mlp.down_proj},
    };
    for (const auto& [k, t] : items) m[p + k] = t;
  }
  return m;
}

/// Bitwise equality of two models' weights, reporting the first differing tensor.
void require_identical(const ModelWeights& a, const ModelWeights& b) {
  REQUIRE(a.tied == b.tied);
  REQUIRE(a.layers.size() == b.layers.size());
  for (size_t i = 0; i < a.layers.size(); ++i) {
    REQUIRE(a.layers[i].type == b.layers[i].type);
    REQUIRE(a.layers[i].is_moe == b.layers[i].is_moe);
  }
  const auto fa = flatten(a), fb = flatten(b);
  for (const auto& [name, t] : fa) {
    INFO("tensor " << name);
    const Tensor* u = fb.at(name);
    REQUIRE(t->shape == u->shape);
    REQUIRE(t->data.size() == u->data.size());
    REQUIRE((t->data.empty() || std::memcmp(t->data.data(), u->data.data(), t->data.size() * sizeof(float)) == 0));
  }
}

/// One tensor on its way through rewrite(): values held as fp32, written as `dtype`.
struct TensorCopy {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype;
  std::vector<float> values;
};

/// Copies the checkpoint in `src` to dst/model.safetensors (plus config.json), passing every tensor through
/// `edit`, which returns the tensors to write in its place (none to drop it, several to split it).
void rewrite(const fs::path& src, const fs::path& dst, const std::function<std::vector<TensorCopy>(TensorCopy)>& edit) {
  const Checkpoint ck = Checkpoint::open(src);
  SafetensorsWriter w;
  for (const auto& name : ck.names()) {
    const TensorInfo& info = *ck.find(name);
    for (auto& t : edit(TensorCopy{name, info.shape, info.dtype, ck.file_of(name).read_f32(info)}))
      w.add_f32(t.name, t.shape, t.values, t.dtype);
  }
  w.write(dst / "model.safetensors");
  fs::copy_file(src / "config.json", dst / "config.json", fs::copy_options::overwrite_existing);
}

std::vector<TensorCopy> keep(TensorCopy t) { return {std::move(t)}; }

/// Sum of numel over every tensor in a checkpoint's files (independent of load_weights).
int64_t file_parameter_count(const fs::path& dir) {
  int64_t n = 0;
  const Checkpoint ck = Checkpoint::open(dir);
  for (const auto& f : ck.files())
    for (const auto& t : f.tensors()) n += t.numel();
  return n;
}

}  // namespace

TEST_CASE("fixtures load and parameter counts match the config formula and the files", "[weights]") {
  for (const char* name : {"qwen3_next_moe", "qwen3_5_dense", "qwen3_5_moe"}) {
    INFO(name);
    const ModelConfig cfg = load_config(kFixtures / name);
    const ModelWeights w = load_weights(cfg, kFixtures / name);
    CHECK(w.parameter_count() == count_parameters(cfg).total);
    CHECK(file_parameter_count(kFixtures / name) == count_parameters(cfg).total);
    CHECK(w.layers.size() == cfg.layer_types.size());
    // The layout the loader expects for this config is exactly what transformers 5.17 wrote.
    std::vector<std::string> spec_names;
    for (const auto& s : hf_checkpoint_layout(cfg)) spec_names.push_back(s.name);
    std::sort(spec_names.begin(), spec_names.end());
    CHECK(spec_names == Checkpoint::open(kFixtures / name).names());
  }
}

TEST_CASE("tied embeddings: no lm_head tensor, output embedding is embed", "[weights]") {
  const ModelConfig cfg = load_config(kFixtures / "qwen3_5_dense");
  const ModelWeights w = load_weights(cfg, kFixtures / "qwen3_5_dense");
  CHECK(w.tied);
  CHECK(w.lm_head.empty());
  CHECK(&w.output_embedding() == &w.embed);
  const ModelWeights n = load_weights(load_config(kFixtures / "qwen3_5_moe"), kFixtures / "qwen3_5_moe");
  CHECK_FALSE(n.tied);
  CHECK(&n.output_embedding() == &n.lm_head);
  CHECK(n.lm_head.shape == std::vector<int64_t>{256, 64});
}

TEST_CASE("Qwen3.5 released layout (language_model prefix, fused experts, mtp/visual) == save_pretrained",
          "[weights]") {
  const ModelWeights a = load_weights(load_config(kFixtures / "qwen3_5_moe"), kFixtures / "qwen3_5_moe");
  const ModelWeights b =
      load_weights(load_config(kFixtures / "qwen3_5_moe_released"), kFixtures / "qwen3_5_moe_released");
  require_identical(a, b);
  // Fused gate_up [E, 2I, H]: expert 3's gate rows first, then its up rows, as the per-expert tensors.
  const Checkpoint ck = Checkpoint::open(kFixtures / "qwen3_5_moe");
  const std::string p = "model.layers.1.mlp.experts.3.";
  const auto gate = ck.file_of(p + "gate_proj.weight").read_f32(*ck.find(p + "gate_proj.weight"));
  const auto up = ck.file_of(p + "up_proj.weight").read_f32(*ck.find(p + "up_proj.weight"));
  const float* fused = a.layers[1].moe.experts_gate_up.ptr() + 3 * 48 * 64;
  CHECK(std::memcmp(fused, gate.data(), gate.size() * 4) == 0);
  CHECK(std::memcmp(fused + 24 * 64, up.data(), up.size() * 4) == 0);
}

TEST_CASE("Qwen3-Next released layout (sharded, legacy config, mtp) == save_pretrained", "[weights]") {
  const ModelWeights a = load_weights(load_config(kFixtures / "qwen3_next_moe"), kFixtures / "qwen3_next_moe");
  const ModelWeights b =
      load_weights(load_config(kFixtures / "qwen3_next_moe_released"), kFixtures / "qwen3_next_moe_released");
  require_identical(a, b);
  CHECK(a.layers[2].mlp.gate_proj.shape == std::vector<int64_t>{96, 64});  // mlp_only_layers = [2]
  CHECK(a.layers[2].moe.experts_gate_up.empty());
}

TEST_CASE("grouped in_proj_qkvz / in_proj_ba regroup to the flat layout", "[weights]") {
  // Hand-group the flat Qwen3.5 projections the way Qwen3-Next stores them (per key head h:
  // q_h | k_h | v and z of value heads h*r..h*r+r-1; ba: b then a of those heads) and load both.
  const fs::path src = kFixtures / "qwen3_5_moe", dst = scratch("grouped");
  const int64_t H = 64, nk = 2, nv = 4, dk = 16, dv = 24, r = nv / nk;
  const Checkpoint ck = Checkpoint::open(src);
  auto rows = [&](const std::string& name) { return ck.file_of(name).read_f32(*ck.find(name)); };
  auto append = [H](std::vector<float>& out, const std::vector<float>& m, int64_t row, int64_t n) {
    out.insert(out.end(), m.begin() + row * H, m.begin() + (row + n) * H);
  };
  rewrite(src, dst, [&](TensorCopy t) -> std::vector<TensorCopy> {
    for (const char* s : {"in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"})
      if (t.name.ends_with(s)) return {};
    if (!t.name.ends_with("in_proj_qkv.weight")) return keep(std::move(t));
    const std::string p = t.name.substr(0, t.name.size() - std::string("in_proj_qkv.weight").size());
    const auto z = rows(p + "in_proj_z.weight"), b = rows(p + "in_proj_b.weight"), a = rows(p + "in_proj_a.weight");
    std::vector<float> qkvz, ba;
    for (int64_t h = 0; h < nk; ++h) {
      append(qkvz, t.values, h * dk, dk);
      append(qkvz, t.values, nk * dk + h * dk, dk);
      append(qkvz, t.values, 2 * nk * dk + h * r * dv, r * dv);
      append(qkvz, z, h * r * dv, r * dv);
      append(ba, b, h * r, r);
      append(ba, a, h * r, r);
    }
    return {{p + "in_proj_qkvz.weight", {2 * nk * dk + 2 * nv * dv, H}, DType::F32, qkvz},
            {p + "in_proj_ba.weight", {2 * nv, H}, DType::F32, ba}};
  });
  const ModelConfig cfg = load_config(src);
  require_identical(load_weights(cfg, src), load_weights(cfg, dst));
}

TEST_CASE("bf16 and f16 checkpoints load as the rounded fp32 values", "[weights]") {
  const fs::path src = kFixtures / "qwen3_5_dense";
  const ModelConfig cfg = load_config(src);
  const ModelWeights ref = load_weights(cfg, src);
  for (DType d : {DType::BF16, DType::F16}) {
    const fs::path dst = scratch(std::string("half_") + std::string(dtype_name(d)));
    rewrite(src, dst, [d](TensorCopy t) {
      t.dtype = d;
      return keep(std::move(t));
    });
    const ModelWeights w = load_weights(cfg, dst);
    const auto fa = flatten(ref), fb = flatten(w);
    for (const auto& [name, t] : fa) {
      INFO(name << " " << dtype_name(d));
      for (size_t i = 0; i < t->data.size(); ++i) {
        const float x = t->data[i];
        const float want = d == DType::BF16 ? bf16_to_f32(f32_to_bf16(x)) : f16_to_f32(f32_to_f16(x));
        if (fb.at(name)->data[i] != want) FAIL("element " << i << ": " << fb.at(name)->data[i] << " vs " << want);
      }
    }
  }
}

TEST_CASE("missing, mis-shaped and unexpected tensors are load-time errors naming them", "[weights]") {
  const fs::path src = kFixtures / "qwen3_next_moe";
  const ModelConfig cfg = load_config(src);

  const fs::path missing = scratch("missing");
  rewrite(src, missing, [](TensorCopy t) -> std::vector<TensorCopy> {
    if (t.name == "model.layers.2.linear_attn.dt_bias") return {};
    return keep(std::move(t));
  });
  CHECK_THROWS_WITH(load_weights(cfg, missing),
                    Catch::Contains("missing tensor 'model.layers.2.linear_attn.dt_bias' (expected shape [4])") &&
                        Catch::Contains(missing.string()));

  const fs::path expert = scratch("missing_expert");
  rewrite(src, expert, [](TensorCopy t) -> std::vector<TensorCopy> {
    if (t.name == "model.layers.3.mlp.experts.5.up_proj.weight") return {};
    return keep(std::move(t));
  });
  CHECK_THROWS_WITH(
      load_weights(cfg, expert),
      Catch::Contains("missing tensor 'model.layers.3.mlp.experts.5.up_proj.weight' (expected shape [24, 64])"));

  const fs::path shaped = scratch("misshaped");
  rewrite(src, shaped, [](TensorCopy t) {
    if (t.name == "model.layers.1.self_attn.k_proj.weight") t.shape = {32, 128};  // same count, wrong shape
    return keep(std::move(t));
  });
  CHECK_THROWS_WITH(load_weights(cfg, shaped),
                    Catch::Contains("tensor 'model.layers.1.self_attn.k_proj.weight' has shape [32, 128] (F32), "
                                    "expected [64, 64]"));

  const fs::path conv = scratch("misshaped_conv");
  rewrite(src, conv, [](TensorCopy t) {
    if (t.name == "model.layers.0.linear_attn.conv1d.weight") t.shape = {160, 4, 1};
    return keep(std::move(t));
  });
  CHECK_THROWS_WITH(load_weights(cfg, conv),
                    Catch::Contains("has shape [160, 4, 1] (F32), expected [160, 1, 4] or [160, 4]"));

  const fs::path extra = scratch("unexpected");
  rewrite(src, extra, [](TensorCopy t) -> std::vector<TensorCopy> {
    if (t.name != "model.layers.1.self_attn.o_proj.weight") return keep(std::move(t));
    TensorCopy bias{"model.layers.1.self_attn.o_proj.bias", {64}, DType::F32, std::vector<float>(64, 0.0f)};
    return {std::move(t), std::move(bias)};
  });
  CHECK_THROWS_WITH(load_weights(cfg, extra), Catch::Contains("tensors the config does not use: "
                                                              "model.layers.1.self_attn.o_proj.bias"));

  // A config that does not match the checkpoint (one more layer) fails on the first absent tensor.
  ModelConfig five = cfg;
  five.num_hidden_layers = 5;
  five.layer_types.push_back(LayerType::Linear);
  CHECK_THROWS_WITH(load_weights(five, src), Catch::Contains("missing tensor 'model.layers.4.input_layernorm.weight'"));
}

TEST_CASE("write_random_checkpoint: HF layout, deterministic, sensible scales", "[weights]") {
  ModelConfig cfg = load_config(kFixtures / "qwen3_next_moe" / "config.json");
  const fs::path a = scratch("init_a"), b = scratch("init_b"), c = scratch("init_c");
  write_random_checkpoint(cfg, 7, a, DType::F32, 0.02);
  write_random_checkpoint(cfg, 7, b, DType::F32, 0.02);
  write_random_checkpoint(cfg, 8, c, DType::F32, 0.02);
  CHECK(weights_identity(a) == weights_identity(b));
  CHECK(weights_identity(a) != weights_identity(c));
  // Provenance: init checkpoints say they are random; the HF fixtures (trained-like, from save_pretrained) do not.
  CHECK(random_init_seed(a) == std::optional<std::string>("7"));
  CHECK(random_init_seed(c) == std::optional<std::string>("8"));
  CHECK_FALSE(random_init_seed(kFixtures / "qwen3_next_moe").has_value());
  CHECK_FALSE(random_init_seed(kFixtures / "qwen3_next_moe_released").has_value());  // sharded
  const ModelConfig ca = load_config(a);
  CHECK(ca.fingerprint() == load_config(b).fingerprint());
  CHECK(ca.fingerprint() != load_config(c).fingerprint());
  // config.json round trip: same architecture as the source config.
  ModelConfig plain = ca;
  plain.weights_digest.clear();
  CHECK(plain.fingerprint() == cfg.fingerprint());

  const ModelWeights w = load_weights(ca, a);
  CHECK(w.parameter_count() == count_parameters(cfg).total);
  auto stats = [](const Tensor& t) {
    double s = 0, s2 = 0;
    for (float x : t.data) s += x, s2 += double(x) * x;
    const double n = double(t.data.size()), mean = s / n;
    return std::pair<double, double>{mean, std::sqrt(s2 / n - mean * mean)};
  };
  const auto [m_embed, s_embed] = stats(w.embed);  // 16384 samples of N(0, 0.02)
  CHECK(std::abs(m_embed) < 0.001);
  CHECK(std::abs(s_embed - 0.02) < 0.0008);
  const auto [m_exp, s_exp] = stats(w.layers[0].moe.experts_gate_up);
  CHECK(std::abs(s_exp - 0.02) < 0.0008);
  CHECK(std::abs(m_exp) < 0.001);
  const auto [m_norm, s_norm] = stats(w.layers[1].input_layernorm);
  CHECK(std::abs(m_norm) < 0.03);
  CHECK(s_norm > 0.02);
  CHECK(s_norm < 0.08);
  const auto [m_gn, s_gn] = stats(w.layers[0].linear.norm);
  CHECK(std::abs(m_gn - 1.0) < 0.05);
  for (float x : w.layers[0].linear.dt_bias.data) CHECK(x == 1.0f);
  for (float x : w.layers[2].linear.A_log.data) {
    CHECK(std::exp(x) >= 1.0f);
    CHECK(std::exp(x) <= 16.0f);
  }
  for (float x : w.layers[0].linear.conv1d.data) CHECK(std::abs(x) <= 0.5f);
  // Same values whatever the element's neighbours: a bf16 copy is the rounding of the f32 one.
  const fs::path h = scratch("init_bf16");
  write_random_checkpoint(cfg, 7, h, DType::BF16, 0.02);
  const ModelWeights wh = load_weights(load_config(h), h);
  for (size_t i = 0; i < w.embed.data.size(); ++i)
    if (wh.embed.data[i] != bf16_to_f32(f32_to_bf16(w.embed.data[i]))) FAIL("bf16 init differs at " << i);

  CHECK_THROWS_AS(write_random_checkpoint(cfg, 7, h, DType::I32, 0.02), std::invalid_argument);
  CHECK_THROWS_AS(write_random_checkpoint(cfg, 7, h, DType::F32, -1.0), std::invalid_argument);
}

TEST_CASE("write_random_checkpoint for nested Qwen3.5 writes the language_model layout", "[weights]") {
  const ModelConfig cfg = load_config(kFixtures / "qwen3_5_moe_released" / "config.json");
  const fs::path d = scratch("init_nested");
  write_random_checkpoint(cfg, 1, d, DType::BF16, 0.02);
  const Checkpoint ck = Checkpoint::open(d);
  CHECK(ck.contains("model.language_model.layers.0.mlp.experts.7.down_proj.weight"));
  CHECK(ck.contains("model.language_model.layers.0.linear_attn.in_proj_qkv.weight"));
  CHECK(ck.contains("lm_head.weight"));
  const ModelConfig back = load_config(d);
  CHECK(back.model_type == "qwen3_5_moe");
  CHECK(load_weights(back, d).parameter_count() == count_parameters(cfg).total);
}

namespace {

/// What load_weights_streaming sent, in order: the parts, and load_weights's ModelWeights rebuilt from them.
struct Streamed {
  std::vector<std::pair<WeightsPart::Kind, int>> order;  // (kind, layer) of each part
  ModelWeights weights;
  int64_t values = 0;  // fp32 values over all parts
};

Streamed stream_all(const ModelConfig& cfg, const fs::path& dir) {
  Streamed s;
  s.weights.tied = cfg.tie_word_embeddings;
  load_weights_streaming(cfg, dir, [&s](WeightsPart&& p) {
    s.order.emplace_back(p.kind, p.layer);
    if (p.kind == WeightsPart::Kind::Layer) {
      CHECK(p.tensor.empty());
      const ModelWeights one{.layers = {p.weights}};  // named: flatten returns pointers into it
      for (const auto& [name, t] : flatten(one)) s.values += int64_t(t->data.size());
      s.weights.layers.push_back(std::move(p.weights));
      return;
    }
    CHECK(p.layer == -1);
    CHECK(p.weights.input_layernorm.empty());
    s.values += int64_t(p.tensor.data.size());
    Tensor& slot = p.kind == WeightsPart::Kind::Embed       ? s.weights.embed
                   : p.kind == WeightsPart::Kind::FinalNorm ? s.weights.final_norm
                                                            : s.weights.lm_head;
    CHECK(slot.empty());  // each top-level tensor once
    slot = std::move(p.tensor);
  });
  return s;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("load_weights_streaming: embed, final_norm, lm_head, layers in order == load_weights", "[weights]") {
  for (const char* name :
       {"qwen3_next_moe", "qwen3_5_moe", "qwen3_5_moe_released", "qwen3_next_moe_released", "qwen3_5_dense"}) {
    INFO(name);
    const ModelConfig cfg = load_config(kFixtures / name);
    const Streamed s = stream_all(cfg, kFixtures / name);
    std::vector<std::pair<WeightsPart::Kind, int>> want{{WeightsPart::Kind::Embed, -1},
                                                        {WeightsPart::Kind::FinalNorm, -1}};
    if (!cfg.tie_word_embeddings) want.emplace_back(WeightsPart::Kind::LmHead, -1);
    for (int i = 0; i < cfg.num_hidden_layers; ++i) want.emplace_back(WeightsPart::Kind::Layer, i);
    CHECK(s.order == want);
    require_identical(s.weights, load_weights(cfg, kFixtures / name));
    CHECK(s.weights.parameter_count() == count_parameters(cfg).total);
    CHECK(s.values == count_parameters(cfg).total);  // nothing sent twice (tied: no lm_head part)
  }
}

TEST_CASE("load_weights_streaming: the same errors as load_weights, at the same point", "[weights]") {
  const fs::path src = kFixtures / "qwen3_next_moe";
  const ModelConfig cfg = load_config(src);
  using K = WeightsPart::Kind;
  auto streamed = [&cfg](const fs::path& dir, std::vector<std::pair<K, int>>& sent) {
    return error_of([&] { load_weights_streaming(cfg, dir, [&](WeightsPart&& p) { sent.emplace_back(p.kind, p.layer); }); });
  };

  // Missing tensor in layer 2: layers 0 and 1 were sent, then load_weights's message.
  const fs::path missing = scratch("stream_missing");
  rewrite(src, missing, [](TensorCopy t) -> std::vector<TensorCopy> {
    if (t.name == "model.layers.2.linear_attn.dt_bias") return {};
    return keep(std::move(t));
  });
  std::vector<std::pair<K, int>> sent;
  const std::string e_missing = streamed(missing, sent);
  CHECK_THAT(e_missing, Catch::Contains("missing tensor 'model.layers.2.linear_attn.dt_bias' (expected shape [4])"));
  CHECK(e_missing == error_of([&] { load_weights(cfg, missing); }));
  CHECK(sent == std::vector<std::pair<K, int>>{{K::Embed, -1}, {K::FinalNorm, -1}, {K::LmHead, -1}, {K::Layer, 0},
                                               {K::Layer, 1}});

  // Mis-shaped tensor.
  const fs::path shaped = scratch("stream_misshaped");
  rewrite(src, shaped, [](TensorCopy t) {
    if (t.name == "model.layers.1.self_attn.k_proj.weight") t.shape = {32, 128};
    return keep(std::move(t));
  });
  sent.clear();
  const std::string e_shaped = streamed(shaped, sent);
  CHECK_THAT(e_shaped, Catch::Contains("tensor 'model.layers.1.self_attn.k_proj.weight' has shape [32, 128] (F32), "
                                       "expected [64, 64]"));
  CHECK(e_shaped == error_of([&] { load_weights(cfg, shaped); }));
  CHECK(sent.size() == 4);  // embed, final_norm, lm_head, layer 0

  // Unused tensor: checked at the end, after every part was sent.
  const fs::path extra = scratch("stream_unexpected");
  rewrite(src, extra, [](TensorCopy t) -> std::vector<TensorCopy> {
    if (t.name != "model.layers.1.self_attn.o_proj.weight") return keep(std::move(t));
    TensorCopy bias{"model.layers.1.self_attn.o_proj.bias", {64}, DType::F32, std::vector<float>(64, 0.0f)};
    return {std::move(t), std::move(bias)};
  });
  sent.clear();
  const std::string e_extra = streamed(extra, sent);
  CHECK_THAT(e_extra, Catch::Contains("tensors the config does not use: model.layers.1.self_attn.o_proj.bias"));
  CHECK(e_extra == error_of([&] { load_weights(cfg, extra); }));
  CHECK(sent.size() == size_t(3 + cfg.num_hidden_layers));

  // No checkpoint at all, and a config with one layer too many.
  const fs::path empty = scratch("stream_empty");
  sent.clear();
  CHECK(streamed(empty, sent) == error_of([&] { load_weights(cfg, empty); }));
  CHECK(sent.empty());
  ModelConfig five = cfg;
  five.num_hidden_layers = 5;
  five.layer_types.push_back(LayerType::Linear);
  const std::string e_five =
      error_of([&] { load_weights_streaming(five, src, [](WeightsPart&&) {}); });
  CHECK_THAT(e_five, Catch::Contains("missing tensor 'model.layers.4.input_layernorm.weight'"));
  CHECK(e_five == error_of([&] { load_weights(five, src); }));

  // An exception from the sink stops the load and propagates unchanged.
  sent.clear();
  const std::string e_sink = error_of([&] {
    load_weights_streaming(cfg, src, [&](WeightsPart&& p) {
      sent.emplace_back(p.kind, p.layer);
      if (p.kind == K::Layer && p.layer == 1) throw std::runtime_error("sink full");
    });
  });
  CHECK(e_sink == "sink full");
  CHECK(sent.size() == 5);
}
