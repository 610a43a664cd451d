#include "engine/checkpoint/weights.h"
#include "engine/checkpoint/weights_internal.h"
#include "engine/families/kimi_linear/weights.h"
#include "engine/families/minimax/weights.h"
#include "engine/families/qwen/weights.h"
#include "engine/families/ring_linear/weights.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numbers>
#include <set>
#include <stdexcept>
#include <thread>

namespace hypic::engine {

using namespace weights_detail;

namespace {

/// The checkpoint layout of c's family (hf_checkpoint_layout without the validation).
std::vector<CheckpointTensorSpec> checkpoint_layout_of(const ModelConfig& c) {
  switch (c.family) {
    case ModelFamily::Qwen: return families::qwen::checkpoint_layout(c);
    case ModelFamily::KimiLinear: return families::kimi_linear::checkpoint_layout(c);
    case ModelFamily::MiniMax: return families::minimax::checkpoint_layout(c);
    case ModelFamily::RingLinear: return families::ring_linear::checkpoint_layout(c);
  }
  throw std::logic_error("checkpoint layout: unknown family " + std::to_string(static_cast<int>(c.family)));
}

}  // namespace

int64_t Tensor::numel() const { return product(shape); }

std::string Tensor::shape_str() const { return shape_text(shape); }

int64_t ModelWeights::parameter_count() const {
  int64_t n = embed.numel() + final_norm.numel() + (tied ? 0 : lm_head.numel());
  for (const auto& l : layers) {
    for (const Tensor* t : {&l.input_layernorm,
                            &l.post_attention_layernorm,
                            &l.linear.in_proj_qkv,
                            &l.linear.in_proj_z,
                            &l.linear.in_proj_b,
                            &l.linear.in_proj_a,
                            &l.linear.conv1d,
                            &l.linear.A_log,
                            &l.linear.dt_bias,
                            &l.linear.norm,
                            &l.linear.out_proj,
                            &l.attention.q_proj,
                            &l.attention.k_proj,
                            &l.attention.v_proj,
                            &l.attention.o_proj,
                            &l.attention.q_norm,
                            &l.attention.k_norm,
                            &l.moe.router,
                            &l.moe.experts_gate_up,
                            &l.moe.experts_down,
                            &l.moe.shared_expert.gate_proj,
                            &l.moe.shared_expert.up_proj,
                            &l.moe.shared_expert.down_proj,
                            &l.moe.shared_expert_gate,
                            &l.moe.router_bias,
                            &l.kda.q_proj,
                            &l.kda.k_proj,
                            &l.kda.v_proj,
                            &l.kda.conv1d,
                            &l.kda.f_a_proj,
                            &l.kda.f_b_proj,
                            &l.kda.A_log,
                            &l.kda.dt_bias,
                            &l.kda.b_proj,
                            &l.kda.g_a_proj,
                            &l.kda.g_b_proj,
                            &l.kda.o_norm,
                            &l.kda.o_proj,
                            &l.mla.q_proj,
                            &l.mla.q_a_proj,
                            &l.mla.q_a_layernorm,
                            &l.mla.q_b_proj,
                            &l.mla.kv_a_proj,
                            &l.mla.kv_a_layernorm,
                            &l.mla.kv_b_proj,
                            &l.mla.o_proj,
                            &l.lightning.qkv_proj,
                            &l.lightning.gate,
                            &l.lightning.norm,
                            &l.lightning.out_proj,
                            &l.lightning.q_norm,
                            &l.lightning.k_norm,
                            &l.mlp.gate_proj,
                            &l.mlp.up_proj,
                            &l.mlp.down_proj})
      n += t->empty() ? 0 : t->numel();
  }
  return n;
}

void load_weights_streaming(const ModelConfig& cfg, const std::filesystem::path& dir, const WeightsSink& sink) {
  cfg.validate();
  Reader rd(dir);
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
  std::string prefix, embed_name = "embed_tokens.weight";
  if (rd.has("model.language_model.embed_tokens.weight")) {
    prefix = "model.language_model.";
  } else if (rd.has("model.embed_tokens.weight")) {
    prefix = "model.";
  } else if (cfg.family == ModelFamily::RingLinear &&
             rd.has(std::string("model.") + families::ring_linear::kEmbedName)) {
    prefix = "model.";
    embed_name = families::ring_linear::kEmbedName;
  } else
    throw std::runtime_error(
        "checkpoint " + dir.string() +
        ": missing tensor 'model.embed_tokens.weight' (nor 'model.language_model.embed_tokens.weight')");

  auto send = [&sink](WeightsPart::Kind kind, Tensor t) {
    WeightsPart part;
    part.kind = kind;
    part.tensor = std::move(t);
    sink(std::move(part));
  };
  send(WeightsPart::Kind::Embed, rd.take(prefix + embed_name, {V, H}));
  send(WeightsPart::Kind::FinalNorm, rd.take(prefix + "norm.weight", {H}));
  if (cfg.tie_word_embeddings)
    rd.ignore("lm_head.weight");  // tied: HF uses embed_tokens whatever the file holds
  else
    send(WeightsPart::Kind::LmHead, rd.take("lm_head.weight", {V, H}));

  for (int i = 0; i < cfg.num_hidden_layers; ++i) {
    WeightsPart part;
    part.kind = WeightsPart::Kind::Layer;
    part.layer = i;
    LayerWeights& l = part.weights;
    const std::string p = prefix + "layers." + std::to_string(i) + ".";
    l.type = cfg.layer_types[size_t(i)];
    l.is_moe = cfg.is_moe_layer(i);
    l.input_layernorm = rd.take(p + "input_layernorm.weight", {H});
    l.post_attention_layernorm = rd.take(p + "post_attention_layernorm.weight", {H});
    switch (cfg.family) {  // the mixer and the MLP, under each family's names
      case ModelFamily::Qwen: families::qwen::load_layer(cfg, rd, p, i, l); break;
      case ModelFamily::KimiLinear: families::kimi_linear::load_layer(cfg, rd, p, i, l); break;
      case ModelFamily::MiniMax: families::minimax::load_layer(cfg, rd, p, i, l); break;
      case ModelFamily::RingLinear: families::ring_linear::load_layer(cfg, rd, p, i, l); break;
    }
    sink(std::move(part));
  }
  rd.check_all_used();
}

ModelWeights load_weights(const ModelConfig& cfg, const std::filesystem::path& dir) {
  ModelWeights w;
  w.tied = cfg.tie_word_embeddings;
  load_weights_streaming(cfg, dir, [&w](WeightsPart&& part) {
    switch (part.kind) {
      case WeightsPart::Kind::Embed: w.embed = std::move(part.tensor); break;
      case WeightsPart::Kind::FinalNorm: w.final_norm = std::move(part.tensor); break;
      case WeightsPart::Kind::LmHead: w.lm_head = std::move(part.tensor); break;
      case WeightsPart::Kind::Layer: w.layers.push_back(std::move(part.weights)); break;  // sent in layer order
    }
  });
  return w;
}

ParameterCounts count_parameters(const ModelConfig& c) {
  if (c.family == ModelFamily::Qwen) return families::qwen::count_parameters(c);
  // The layout's tensors; the routed experts a token does not use are inactive.
  const int64_t H = c.hidden_size;
  ParameterCounts n;
  for (const auto& s : checkpoint_layout_of(c)) n.total += product(s.shape);
  int64_t inactive = 0;
  for (int i = 0; i < c.num_hidden_layers; ++i)
    if (c.is_moe_layer(i))
      inactive += int64_t(c.num_experts - c.num_experts_per_tok) * 3 * c.moe_intermediate_size * H;
  n.active_per_token = n.total - inactive;
  return n;
}

double forward_flops(const ModelConfig& c, int64_t tokens) {
  if (tokens <= 0) return 0;
  const double T = double(tokens), H = double(c.hidden_size), V = double(c.vocab_size);
  const double body = double(count_parameters(c).active_per_token) - V * H * (c.tie_word_embeddings ? 1 : 2);
  const double attn = double(c.num_attention_layers()) * 2.0 * c.num_attention_heads *
                      double(c.head_dim + c.attn_v_head_dim()) * (T * T / 2);
  return 2 * T * body + attn;
}

std::vector<CheckpointTensorSpec> hf_checkpoint_layout(const ModelConfig& c) {
  c.validate();
  return checkpoint_layout_of(c);
}

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Uniform in (0, 1) from a 64-bit word (53 random bits, never 0).
double unit(uint64_t bits) { return (double(bits >> 11) + 0.5) * 0x1.0p-53; }

/// Fills dst[0..n) for a tensor of the given role. Element j uses counter-based random numbers keyed by
/// (key, j / 2), so any split of the range over threads gives the same values.
void fill_role(TensorRole role, uint64_t key, double std, int64_t kernel, float* dst, int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    const uint64_t pair = uint64_t(j) >> 1;
    const double u1 = unit(splitmix64(key ^ (2 * pair))), u2 = unit(splitmix64(key ^ (2 * pair + 1)));
    double v = 0;
    switch (role) {
      case TensorRole::Matrix:
      case TensorRole::ZeroCentredNorm:
      case TensorRole::GatedNorm: {
        // Box-Muller: the pair (u1, u2) gives two independent normals, element parity picks one.
        const double r = std::sqrt(-2.0 * std::log(u1)), a = 2.0 * std::numbers::pi * u2;
        const double z = (j & 1) ? r * std::sin(a) : r * std::cos(a);
        v = role == TensorRole::Matrix ? std * z : role == TensorRole::ZeroCentredNorm ? 0.05 * z : 1.0 + 0.05 * z;
        break;
      }
      case TensorRole::ALog:
        v = std::log(1.0 + 15.0 * ((j & 1) ? u2 : u1));
        break;
      case TensorRole::DtBias:
        v = 1.0;
        break;
      case TensorRole::Conv: {
        const double bound = 1.0 / std::sqrt(double(kernel));
        v = bound * (2.0 * ((j & 1) ? u2 : u1) - 1.0);
        break;
      }
    }
    dst[j] = float(v);
  }
}

}  // namespace

void write_random_checkpoint(const ModelConfig& cfg, uint64_t seed, const std::filesystem::path& dir, DType dtype,
                             double std) {
  if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16)
    throw std::invalid_argument("write_random_checkpoint: dtype must be F32, BF16 or F16, got " +
                                std::string(dtype_name(dtype)));
  if (!(std > 0 && std < 10))
    throw std::invalid_argument("write_random_checkpoint: std must be in (0, 10), got " + std::to_string(std));
  const auto specs = hf_checkpoint_layout(cfg);
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir / "config.json");
    f << config_to_json(cfg);
    if (!f) throw std::runtime_error("cannot write " + (dir / "config.json").string());
  }
  const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  const int64_t kernel = std::max(1, cfg.linear_conv_kernel_dim);
  SafetensorsWriter wr;
  wr.set_metadata("format", "pt");
  wr.set_metadata("hypic_init_seed", std::to_string(seed));
  for (const auto& s : specs) {
    const uint64_t key = splitmix64(seed ^ XXH3_64bits(s.name.data(), s.name.size()));
    const int64_t n = product(s.shape);
    const TensorRole role = s.role;
    wr.add(s.name, dtype, s.shape, [=](uint8_t* dst) {
      std::vector<float> vals(static_cast<size_t>(n));
      std::vector<std::thread> pool;
      const int64_t per = n < (int64_t(1) << 16) ? n : (n + threads - 1) / threads;  // small: one thread
      for (unsigned t = 0; t < threads && int64_t(t) * per < n; ++t)
        if (per == n)
          fill_role(role, key, std, kernel, vals.data(), 0, n);
        else
          pool.emplace_back(fill_role, role, key, std, kernel, vals.data(), int64_t(t) * per,
                            std::min(n, int64_t(t + 1) * per));
      for (auto& th : pool) th.join();
      convert_from_f32(vals.data(), size_t(n), dtype, dst);
    });
  }
  wr.write(dir / "model.safetensors");
}

std::optional<std::string> random_init_seed(const std::filesystem::path& dir) {
  const Checkpoint ck = Checkpoint::open(dir);
  for (const SafetensorsFile& f : ck.files()) {
    const auto& meta = f.metadata();
    if (auto it = meta.find("hypic_init_seed"); it != meta.end()) return it->second;
  }
  return std::nullopt;
}

std::vector<float> lightning_slope_rates(const ModelConfig& c, int layer) {
  if (c.family != ModelFamily::MiniMax && c.family != ModelFamily::RingLinear)
    throw std::invalid_argument(std::string("lightning_slope_rates: family ") + model_family_name(c.family) +
                                " has no lightning layers");
  if (layer < 0 || layer >= c.num_hidden_layers)
    throw std::invalid_argument("lightning_slope_rates: layer " + std::to_string(layer) + " out of range");
  return c.family == ModelFamily::MiniMax ? families::minimax::slope_rates(c, layer)
                                          : families::ring_linear::slope_rates(c, layer);
}

}  // namespace hypic::engine
