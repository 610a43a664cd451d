#include "engine/checkpoint/weights.h"
#include "engine/checkpoint/weights_internal.h"

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

/// Qwen3-Next's grouped projections -> the flat internal layout. Per key head h the qkvz rows are
/// [q_h (dk) | k_h (dk) | v of value heads h*r..h*r+r-1 (r*dv) | z of those heads (r*dv)] and the ba rows
/// [b of those heads (r) | a of those heads (r)] (Qwen3NextGatedDeltaNet.fix_query_key_value_ordering).
void regroup_qwen3_next(const ModelConfig& c, const Tensor& qkvz, const Tensor& ba, LinearAttnWeights& w) {
  const int64_t H = c.hidden_size, nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, r = nv / nk;
  const int64_t group = 2 * dk + 2 * r * dv;
  w.in_proj_qkv.shape = {c.conv_dim(), H};
  w.in_proj_qkv.data.resize(size_t(c.conv_dim() * H));
  w.in_proj_z.shape = {nv * dv, H};
  w.in_proj_z.data.resize(size_t(nv * dv * H));
  w.in_proj_b.shape = w.in_proj_a.shape = {nv, H};
  w.in_proj_b.data.resize(size_t(nv * H));
  w.in_proj_a.data.resize(size_t(nv * H));
  auto copy_rows = [H](const Tensor& src, int64_t src_row, Tensor& dst, int64_t dst_row, int64_t rows) {
    std::memcpy(dst.data.data() + dst_row * H, src.data.data() + src_row * H, size_t(rows * H) * sizeof(float));
  };
  for (int64_t h = 0; h < nk; ++h) {
    const int64_t base = h * group;
    copy_rows(qkvz, base, w.in_proj_qkv, h * dk, dk);                                 // q
    copy_rows(qkvz, base + dk, w.in_proj_qkv, nk * dk + h * dk, dk);                  // k
    copy_rows(qkvz, base + 2 * dk, w.in_proj_qkv, 2 * nk * dk + h * r * dv, r * dv);  // v
    copy_rows(qkvz, base + 2 * dk + r * dv, w.in_proj_z, h * r * dv, r * dv);         // z
    copy_rows(ba, h * 2 * r, w.in_proj_b, h * r, r);                                  // b
    copy_rows(ba, h * 2 * r + r, w.in_proj_a, h * r, r);                              // a
  }
}

void load_linear(const ModelConfig& c, Reader& rd, const std::string& p, LinearAttnWeights& w) {
  const int64_t H = c.hidden_size, nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, K = c.linear_conv_kernel_dim;
  const int64_t C = c.conv_dim();
  if (rd.has(p + "in_proj_qkvz.weight")) {
    const Tensor qkvz = rd.take(p + "in_proj_qkvz.weight", {2 * nk * dk + 2 * nv * dv, H});
    const Tensor ba = rd.take(p + "in_proj_ba.weight", {2 * nv, H});
    regroup_qwen3_next(c, qkvz, ba, w);
  } else {
    w.in_proj_qkv = rd.take(p + "in_proj_qkv.weight", {C, H});
    w.in_proj_z = rd.take(p + "in_proj_z.weight", {nv * dv, H});
    w.in_proj_b = rd.take(p + "in_proj_b.weight", {nv, H});
    w.in_proj_a = rd.take(p + "in_proj_a.weight", {nv, H});
  }
  w.conv1d = rd.take_any(p + "conv1d.weight", {{C, 1, K}, {C, K}}, {C, K});
  w.A_log = rd.take(p + "A_log", {nv});
  w.dt_bias = rd.take(p + "dt_bias", {nv});
  w.norm = rd.take(p + "norm.weight", {dv});
  w.out_proj = rd.take(p + "out_proj.weight", {H, nv * dv});
}

void load_attention(const ModelConfig& c, Reader& rd, const std::string& p, AttentionWeights& w) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  w.q_proj = rd.take(p + "q_proj.weight", {(c.attn_output_gate ? 2 : 1) * nh * hd, H});
  w.k_proj = rd.take(p + "k_proj.weight", {nkv * hd, H});
  w.v_proj = rd.take(p + "v_proj.weight", {nkv * hd, H});
  w.o_proj = rd.take(p + "o_proj.weight", {H, nh * hd});
  w.q_norm = rd.take(p + "q_norm.weight", {hd});
  w.k_norm = rd.take(p + "k_norm.weight", {hd});
}

void load_mlp(Reader& rd, const std::string& p, int64_t H, int64_t I, MlpWeights& w) {
  w.gate_proj = rd.take(p + "gate_proj.weight", {I, H});
  w.up_proj = rd.take(p + "up_proj.weight", {I, H});
  w.down_proj = rd.take(p + "down_proj.weight", {H, I});
}

/// `name` or `name.weight`, whichever the checkpoint holds (fused experts come both ways).
std::string with_optional_weight(const Reader& rd, const std::string& name) {
  return rd.has(name) ? name : rd.has(name + ".weight") ? name + ".weight" : name;
}

void load_moe(const ModelConfig& c, Reader& rd, const std::string& p, MoeWeights& w) {
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  w.router = rd.take(p + "gate.weight", {E, H});
  const std::string fused = with_optional_weight(rd, p + "experts.gate_up_proj");
  if (rd.has(fused)) {
    w.experts_gate_up = rd.take(fused, {E, 2 * I, H});
    w.experts_down = rd.take(with_optional_weight(rd, p + "experts.down_proj"), {E, H, I});
  } else {
    // Per-expert tensors (released Qwen3-Next, transformers 5.17 save_pretrained): fuse, gate rows first.
    w.experts_gate_up.shape = {E, 2 * I, H};
    w.experts_gate_up.data.resize(size_t(E * 2 * I * H));
    w.experts_down.shape = {E, H, I};
    w.experts_down.data.resize(size_t(E * H * I));
    for (int64_t e = 0; e < E; ++e) {
      const std::string q = p + "experts." + std::to_string(e) + ".";
      float* gu = w.experts_gate_up.data.data() + e * 2 * I * H;
      rd.take_into(q + "gate_proj.weight", {I, H}, gu);
      rd.take_into(q + "up_proj.weight", {I, H}, gu + I * H);
      rd.take_into(q + "down_proj.weight", {H, I}, w.experts_down.data.data() + e * H * I);
    }
  }
  if (c.shared_expert_intermediate_size > 0) {
    load_mlp(rd, p + "shared_expert.", H, c.shared_expert_intermediate_size, w.shared_expert);
    w.shared_expert_gate = rd.take(p + "shared_expert_gate.weight", {1, H});
  }
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
  } else if (cfg.family == ModelFamily::RingLinear && rd.has("model.word_embeddings.weight")) {
    prefix = "model.";
    embed_name = "word_embeddings.weight";
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
    if (cfg.family != ModelFamily::Qwen) {
      load_family_layer(cfg, rd, p, i, l);
      sink(std::move(part));
      continue;
    }
    if (l.type == LayerType::Linear)
      load_linear(cfg, rd, p + "linear_attn.", l.linear);
    else
      load_attention(cfg, rd, p + "self_attn.", l.attention);
    if (l.is_moe)
      load_moe(cfg, rd, p + "mlp.", l.moe);
    else
      load_mlp(rd, p + "mlp.", H, cfg.intermediate_size, l.mlp);
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
  const int64_t H = c.hidden_size, V = c.vocab_size;
  ParameterCounts n;
  if (c.family != ModelFamily::Qwen) {
    // The layout's tensors; the routed experts a token does not use are inactive.
    for (const auto& s : family_checkpoint_layout(c)) n.total += product(s.shape);
    int64_t inactive = 0;
    for (int i = 0; i < c.num_hidden_layers; ++i)
      if (c.is_moe_layer(i))
        inactive += int64_t(c.num_experts - c.num_experts_per_tok) * 3 * c.moe_intermediate_size * H;
    n.active_per_token = n.total - inactive;
    (void)V;
    return n;
  }
  n.total = V * H + H + (c.tie_word_embeddings ? 0 : V * H);
  int64_t inactive = 0;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    int64_t layer = 2 * H;
    if (c.layer_types[size_t(i)] == LayerType::Linear) {
      const int64_t nv = c.linear_num_value_heads, vd = c.linear_v_dim();
      layer += c.conv_dim() * H + vd * H + 2 * nv * H + c.conv_dim() * c.linear_conv_kernel_dim + 2 * nv +
               c.linear_value_head_dim + H * vd;
    } else {
      const int64_t qd = int64_t(c.num_attention_heads) * c.head_dim, kvd = int64_t(c.num_key_value_heads) * c.head_dim;
      layer += (c.attn_output_gate ? 2 : 1) * qd * H + 2 * kvd * H + H * qd + 2 * c.head_dim;
    }
    if (c.is_moe_layer(i)) {
      const int64_t expert = 3 * c.moe_intermediate_size * H;
      layer += int64_t(c.num_experts) * H + c.num_experts * expert;
      if (c.shared_expert_intermediate_size > 0) layer += 3 * c.shared_expert_intermediate_size * H + H;
      inactive += int64_t(c.num_experts - c.num_experts_per_tok) * expert;
    } else {
      layer += 3 * c.intermediate_size * H;
    }
    n.total += layer;
  }
  n.active_per_token = n.total - inactive;
  return n;
}

std::vector<CheckpointTensorSpec> hf_checkpoint_layout(const ModelConfig& c) {
  c.validate();
  if (c.family != ModelFamily::Qwen) return family_checkpoint_layout(c);
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const int64_t nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const std::string prefix = nested_type(c) ? "model.language_model." : "model.";
  LayoutSink add{H, {}};
  add(prefix + "embed_tokens.weight", {V, H});
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = prefix + "layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {H}, TensorRole::ZeroCentredNorm);
    if (c.layer_types[size_t(i)] == LayerType::Linear) {
      const std::string q = p + "linear_attn.";
      if (c.model_type == "qwen3_next") {
        add(q + "in_proj_qkvz.weight", {2 * nk * dk + 2 * nv * dv, H});
        add(q + "in_proj_ba.weight", {2 * nv, H});
      } else {
        add(q + "in_proj_qkv.weight", {c.conv_dim(), H});
        add(q + "in_proj_z.weight", {nv * dv, H});
        add(q + "in_proj_b.weight", {nv, H});
        add(q + "in_proj_a.weight", {nv, H});
      }
      add(q + "conv1d.weight", {c.conv_dim(), 1, c.linear_conv_kernel_dim}, TensorRole::Conv);
      add(q + "A_log", {nv}, TensorRole::ALog);
      add(q + "dt_bias", {nv}, TensorRole::DtBias);
      add(q + "norm.weight", {dv}, TensorRole::GatedNorm);
      add(q + "out_proj.weight", {H, nv * dv});
    } else {
      const std::string q = p + "self_attn.";
      const int64_t hd = c.head_dim, qd = int64_t(c.num_attention_heads) * hd,
                    kvd = int64_t(c.num_key_value_heads) * hd;
      add(q + "q_proj.weight", {(c.attn_output_gate ? 2 : 1) * qd, H});
      add(q + "k_proj.weight", {kvd, H});
      add(q + "v_proj.weight", {kvd, H});
      add(q + "o_proj.weight", {H, qd});
      add(q + "q_norm.weight", {hd}, TensorRole::ZeroCentredNorm);
      add(q + "k_norm.weight", {hd}, TensorRole::ZeroCentredNorm);
    }
    if (c.is_moe_layer(i)) {
      add(p + "mlp.gate.weight", {c.num_experts, H});
      for (int e = 0; e < c.num_experts; ++e)
        add.mlp(p + "mlp.experts." + std::to_string(e) + ".", c.moe_intermediate_size);
      if (c.shared_expert_intermediate_size > 0) {
        add.mlp(p + "mlp.shared_expert.", c.shared_expert_intermediate_size);
        add(p + "mlp.shared_expert_gate.weight", {1, H});
      }
    } else {
      add.mlp(p + "mlp.", c.intermediate_size);
    }
    add(p + "post_attention_layernorm.weight", {H}, TensorRole::ZeroCentredNorm);
  }
  add(prefix + "norm.weight", {H}, TensorRole::ZeroCentredNorm);
  if (!c.tie_word_embeddings) add("lm_head.weight", {V, H});
  return std::move(add.specs);
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

}  // namespace hypic::engine
