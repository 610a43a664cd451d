#include "engine/cuda/cuda_weights.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <thread>

#include "engine/checkpoint/safetensors.h"
#include "kernels/cuda/ops.h"

namespace hypic::engine::cuda {
namespace {

namespace kc = hypic::kernels::cuda;

using Parts = std::vector<const Tensor*>;
/// Which tensors of a host LayerWeights make one device tensor (concatenated in order). Captureless, so that one
/// declaration serves upload (a whole ModelWeights), load (one streamed part at a time) and random (none).
using Pick = Parts (*)(const LayerWeights&);

/// Host groups, in the order of load_weights_streaming: embed, final_norm, lm_head, then layer i at kLayer0 + i.
constexpr int kEmbed = 0, kFinalNorm = 1, kLmHead = 2, kLayer0 = 3;

int group_of(const WeightsPart& p) {
  switch (p.kind) {
    case WeightsPart::Kind::Embed: return kEmbed;
    case WeightsPart::Kind::FinalNorm: return kFinalNorm;
    case WeightsPart::Kind::LmHead: return kLmHead;
    case WeightsPart::Kind::Layer: return kLayer0 + p.layer;
  }
  return -1;
}

std::string group_name(int g) {
  return g == kEmbed ? "embed" : g == kFinalNorm ? "final_norm" : g == kLmHead ? "lm_head" : "layer " + std::to_string(g - kLayer0);
}

/// How one device tensor is filled: from host fp32 tensors of one group (concatenated in order), or at random.
struct Spec {
  std::string name;
  size_t numel = 0;
  bool fp32 = false;
  int group = kEmbed;
  Pick pick = nullptr;  // layer groups: the host tensors; null for embed / final_norm / lm_head (the group's tensor)
  TensorRole role = TensorRole::Matrix;
  int64_t conv_kernel = 4;
  size_t offset = 0;
  const void** slot = nullptr;  // where the device pointer goes
  std::vector<float> fixed;     // random weights: these values (fp32) instead of a draw (lightning's slopes)
};

/// fp32 -> bf16 (f32_to_bf16: round to nearest even) or fp32 copy of n values, on several threads when large
/// (element-wise: the bytes do not depend on the split).
void convert(const float* src, size_t n, bool fp32, void* dst) {
  auto run = [&](size_t b, size_t e) {
    if (fp32) {
      std::memcpy(static_cast<float*>(dst) + b, src + b, (e - b) * sizeof(float));
    } else {
      uint16_t* o = static_cast<uint16_t*>(dst);
      for (size_t i = b; i < e; ++i) o[i] = f32_to_bf16(src[i]);
    }
  };
  const size_t threads = n < (size_t(1) << 20) ? 1 : std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8);
  if (threads == 1) return run(0, n);
  std::vector<std::thread> pool;
  const size_t per = (n + threads - 1) / threads;
  for (size_t t = 1; t < threads && t * per < n; ++t) pool.emplace_back(run, t * per, std::min(n, (t + 1) * per));
  run(0, std::min(n, per));
  for (auto& th : pool) th.join();
}

/// Host-to-device copies through two pinned staging buffers of kHalf bytes on a private stream: a chunk is
/// converted into one buffer while the other's copy runs. Pinned host memory: 2 * kHalf, whatever the tensor sizes.
/// Uses the current device. finish() waits for the copies and reports their errors.
class Stager {
 public:
  static constexpr size_t kHalf = size_t(32) << 20;

  Stager() {
    try {
      check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate(weight staging)");
      for (int b = 0; b < 2; ++b) {
        check_cuda(cudaMallocHost(&buf_[b], kHalf), "cudaMallocHost(" + std::to_string(kHalf) + " bytes, weight staging)");
        check_cuda(cudaEventCreateWithFlags(&done_[b], cudaEventDisableTiming), "cudaEventCreate(weight staging)");
      }
    } catch (...) {
      release();
      throw;
    }
  }
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;
  ~Stager() { release(); }

  /// Writes n values of src to the device at dst: bf16 (fp32 when `fp32`). Returns once src may be freed.
  void put(const float* src, size_t n, bool fp32, char* dst, const std::string& what) {
    const size_t es = fp32 ? 4 : 2, per = kHalf / es;
    for (size_t i = 0; i < n; i += per) {
      const size_t k = std::min(per, n - i);
      check_cuda(cudaEventSynchronize(done_[cur_]), "upload of " + what);  // this buffer's previous copy is done
      convert(src + i, k, fp32, buf_[cur_]);
      check_cuda(cudaMemcpyAsync(dst + i * es, buf_[cur_], k * es, cudaMemcpyHostToDevice, stream_), "upload of " + what);
      check_cuda(cudaEventRecord(done_[cur_], stream_), "upload of " + what);
      cur_ ^= 1;
    }
  }
  void finish() { check_cuda(cudaStreamSynchronize(stream_), "weight upload"); }

 private:
  void release() noexcept {
    if (stream_) cudaStreamSynchronize(stream_);  // no copy may still read a buffer freed below
    for (int b = 0; b < 2; ++b) {
      if (done_[b]) cudaEventDestroy(done_[b]);
      if (buf_[b]) cudaFreeHost(buf_[b]);
      done_[b] = nullptr, buf_[b] = nullptr;
    }
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
  void* buf_[2] = {nullptr, nullptr};
  cudaEvent_t done_[2] = {nullptr, nullptr};
  int cur_ = 0;
};

class Builder {
 public:
  template <class T>
  void add(const std::string& name, size_t numel, bool fp32, int group, Pick pick, TensorRole role, const T** slot,
           int64_t conv_kernel = 4, std::vector<float> fixed = {}) {
    Spec s;
    s.fixed = std::move(fixed);
    s.name = name;
    s.numel = numel;
    s.fp32 = fp32;
    s.group = group;
    s.pick = pick;
    s.role = role;
    s.conv_kernel = conv_kernel;
    s.offset = layout_.add(numel * (fp32 ? 4 : 2));
    s.slot = reinterpret_cast<const void**>(slot);
    if (size_t(group) + 1 < groups_.size()) throw std::logic_error("DeviceWeights: " + name + " declared out of group order");
    if (size_t(group) >= groups_.size()) groups_.resize(size_t(group) + 1, {specs_.size(), specs_.size()});
    groups_[size_t(group)].second = specs_.size() + 1;  // groups are declared in order, each contiguous
    specs_.push_back(std::move(s));
  }

  DeviceMemory allocate() {
    DeviceMemory m(layout_.total(), "model weights");
    for (auto& s : specs_) *s.slot = m.bytes_ptr(s.offset);
    filled_.assign(groups_.size(), false);
    return m;
  }

  /// Converts and copies every device tensor of host group `group`: from `top` (embed / final_norm / lm_head) or
  /// from `layer`. Throws std::invalid_argument for a group the config does not have, a group given twice, or
  /// host tensors whose sizes do not match the config.
  void fill(const DeviceMemory& m, Stager& st, int group, const Tensor* top, const LayerWeights* layer) {
    if (group < 0 || size_t(group) >= groups_.size() || groups_[size_t(group)].first == groups_[size_t(group)].second)
      throw std::invalid_argument("DeviceWeights: the config has no " + group_name(group));
    if (filled_[size_t(group)]) throw std::invalid_argument("DeviceWeights: " + group_name(group) + " given twice");
    filled_[size_t(group)] = true;
    for (size_t i = groups_[size_t(group)].first; i < groups_[size_t(group)].second; ++i) {
      const Spec& s = specs_[i];
      const Parts parts = s.pick ? s.pick(*layer) : Parts{top};
      size_t n = 0;
      for (const Tensor* t : parts) n += t->data.size();
      if (n != s.numel)
        throw std::invalid_argument("DeviceWeights: tensor " + s.name + " has " + std::to_string(n) +
                                    " values, the config implies " + std::to_string(s.numel));
      char* dst = m.bytes_ptr(s.offset);
      for (const Tensor* t : parts) {
        st.put(t->data.data(), t->data.size(), s.fp32, dst, s.name);
        dst += t->data.size() * (s.fp32 ? 4 : 2);
      }
    }
  }

  /// Throws std::invalid_argument naming the first group of the config that fill() was not given.
  void check_complete() const {
    for (size_t g = 0; g < groups_.size(); ++g)
      if (groups_[g].first != groups_[g].second && !filled_[g])
        throw std::invalid_argument("DeviceWeights: no weights for " + group_name(int(g)));
  }

  void randomize(const DeviceMemory& m, uint64_t seed) {
    uint64_t id = 0;
    for (const auto& s : specs_) {
      ++id;
      kc::RandomFill kind = kc::RandomFill::Normal;
      float a = 0.f, b = 0.02f;
      switch (s.role) {
        case TensorRole::Matrix: break;
        case TensorRole::ZeroCentredNorm: b = 0.05f; break;
        case TensorRole::GatedNorm: a = 1.f, b = 0.05f; break;
        case TensorRole::ALog: kind = kc::RandomFill::LogUniform, a = 1.f, b = 16.f; break;
        case TensorRole::DtBias: kind = kc::RandomFill::Constant, a = 1.f; break;
        case TensorRole::Conv: kind = kc::RandomFill::Uniform, a = 0.f, b = float(1.0 / std::sqrt(double(s.conv_kernel))); break;
      }
      void* p = m.bytes_ptr(s.offset);
      if (!s.fixed.empty()) {
        check_cuda(cudaMemcpy(p, s.fixed.data(), s.fixed.size() * sizeof(float), cudaMemcpyHostToDevice), "fixed weights");
        continue;
      }
      kc::fill_random(long(s.numel), kind, a, b, seed, id, s.fp32 ? nullptr : static_cast<bf16*>(p),
                      s.fp32 ? static_cast<float*>(p) : nullptr);
    }
    check_cuda(cudaDeviceSynchronize(), "random weights");
  }

 private:
  Layout layout_;
  std::vector<Spec> specs_;
  std::vector<std::pair<size_t, size_t>> groups_;  // group -> its specs [first, second)
  std::vector<bool> filled_;                       // group -> fill() done
};

// Declares every tensor of the model, with the host group and tensors each comes from.
void declare(const ModelConfig& c, Builder& b, DeviceWeights& d) {
  const size_t H = c.hidden_size, V = c.vocab_size;
  // RMSNorm weights: zero-centred (1 + w) in the Qwen families, applied as w in the others.
  const TensorRole norm_role = c.zero_centred_norms() ? TensorRole::ZeroCentredNorm : TensorRole::GatedNorm;
  b.add("embed", V * H, false, kEmbed, nullptr, TensorRole::Matrix, &d.embed);
  b.add("final_norm", H, false, kFinalNorm, nullptr, norm_role, &d.final_norm);
  if (!c.tie_word_embeddings) b.add("lm_head", V * H, false, kLmHead, nullptr, TensorRole::Matrix, &d.lm_head);
  d.layers.resize(c.num_hidden_layers);
  const size_t nv = c.linear_num_value_heads, dv = c.linear_value_head_dim, C = c.conv_dim();
  const size_t K = c.linear_conv_kernel_dim, nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  using LW = const LayerWeights&;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    const int g = kLayer0 + i;
    DevLayer& L = d.layers[i];
    L.type = c.layer_types[i];
    L.is_moe = c.is_moe_layer(i);
    b.add(p + "input_layernorm", H, false, g, [](LW l) { return Parts{&l.input_layernorm}; }, norm_role,
          &L.input_layernorm);
    b.add(p + "post_attention_layernorm", H, false, g, [](LW l) { return Parts{&l.post_attention_layernorm}; },
          norm_role, &L.post_attention_layernorm);
    if (L.type == LayerType::Linear && c.family == ModelFamily::Qwen) {
      DevLinear& l = L.linear;
      b.add(p + "in_proj_qkv", C * H, false, g, [](LW w) { return Parts{&w.linear.in_proj_qkv}; }, TensorRole::Matrix, &l.in_proj_qkv);
      b.add(p + "in_proj_z", nv * dv * H, false, g, [](LW w) { return Parts{&w.linear.in_proj_z}; }, TensorRole::Matrix, &l.in_proj_z);
      b.add(p + "in_proj_b", nv * H, false, g, [](LW w) { return Parts{&w.linear.in_proj_b}; }, TensorRole::Matrix, &l.in_proj_b);
      b.add(p + "in_proj_a", nv * H, false, g, [](LW w) { return Parts{&w.linear.in_proj_a}; }, TensorRole::Matrix, &l.in_proj_a);
      b.add(p + "conv1d", C * K, false, g, [](LW w) { return Parts{&w.linear.conv1d}; }, TensorRole::Conv, &l.conv1d, int64_t(K));
      b.add(p + "A_log", nv, true, g, [](LW w) { return Parts{&w.linear.A_log}; }, TensorRole::ALog, &l.A_log);
      b.add(p + "dt_bias", nv, true, g, [](LW w) { return Parts{&w.linear.dt_bias}; }, TensorRole::DtBias, &l.dt_bias);
      b.add(p + "norm", dv, false, g, [](LW w) { return Parts{&w.linear.norm}; }, TensorRole::GatedNorm, &l.norm);
      b.add(p + "out_proj", H * nv * dv, false, g, [](LW w) { return Parts{&w.linear.out_proj}; }, TensorRole::Matrix, &l.out_proj);
    } else if (L.type == LayerType::Linear && c.family == ModelFamily::KimiLinear) {
      DevKda& l = L.kda;  // HF KimiDeltaAttention, projections sharing an input stacked (kda_mixer.h)
      const size_t n = nv, dk = dv, HD = n * dk;
      b.add(p + "kda_qkv_proj", 3 * HD * H, false, g,
            [](LW w) { return Parts{&w.kda.q_proj, &w.kda.k_proj, &w.kda.v_proj}; }, TensorRole::Matrix, &l.qkv_proj);
      b.add(p + "kda_conv1d", 3 * HD * K, false, g, [](LW w) { return Parts{&w.kda.conv1d}; }, TensorRole::Conv,
            &l.conv1d, int64_t(K));
      b.add(p + "kda_low_proj", (2 * dk + n) * H, false, g,
            [](LW w) { return Parts{&w.kda.f_a_proj, &w.kda.g_a_proj, &w.kda.b_proj}; }, TensorRole::Matrix,
            &l.low_proj);
      b.add(p + "kda_f_b_proj", HD * dk, false, g, [](LW w) { return Parts{&w.kda.f_b_proj}; }, TensorRole::Matrix,
            &l.f_b_proj);
      b.add(p + "kda_g_b_proj", HD * dk, false, g, [](LW w) { return Parts{&w.kda.g_b_proj}; }, TensorRole::Matrix,
            &l.g_b_proj);
      b.add(p + "kda_A_log", n, true, g, [](LW w) { return Parts{&w.kda.A_log}; }, TensorRole::ALog, &l.A_log);
      b.add(p + "kda_dt_bias", HD, true, g, [](LW w) { return Parts{&w.kda.dt_bias}; }, TensorRole::DtBias,
            &l.dt_bias);
      b.add(p + "kda_o_norm", dk, false, g, [](LW w) { return Parts{&w.kda.o_norm}; }, TensorRole::GatedNorm,
            &l.o_norm);
      b.add(p + "kda_o_proj", H * HD, false, g, [](LW w) { return Parts{&w.kda.o_proj}; }, TensorRole::Matrix,
            &l.o_proj);
    } else if (L.type == LayerType::Linear) {  // MiniMax, Ring-linear: lightning attention
      DevLightning& l = L.lightning;
      const size_t HD = nh * hd;
      b.add(p + "lightning_qkv_proj", 3 * HD * H, false, g, [](LW w) { return Parts{&w.lightning.qkv_proj}; },
            TensorRole::Matrix, &l.qkv_proj);
      b.add(p + "lightning_gate", HD * H, false, g, [](LW w) { return Parts{&w.lightning.gate}; }, TensorRole::Matrix,
            &l.gate);
      b.add(p + "lightning_norm", HD, false, g, [](LW w) { return Parts{&w.lightning.norm}; }, TensorRole::GatedNorm,
            &l.norm);
      b.add(p + "lightning_out_proj", H * HD, false, g, [](LW w) { return Parts{&w.lightning.out_proj}; },
            TensorRole::Matrix, &l.out_proj);
      if (c.family == ModelFamily::RingLinear && c.use_qk_norm) {
        b.add(p + "lightning_q_norm", hd, false, g, [](LW w) { return Parts{&w.lightning.q_norm}; },
              TensorRole::GatedNorm, &l.q_norm);
        b.add(p + "lightning_k_norm", hd, false, g, [](LW w) { return Parts{&w.lightning.k_norm}; },
              TensorRole::GatedNorm, &l.k_norm);
      }
      // Random weights keep the model's own slopes (HF's ALiBi-style rates, engine/checkpoint lightning_slope_rates).
      b.add(p + "lightning_slope", nh, true, g, [](LW w) { return Parts{&w.lightning.slope}; }, TensorRole::Matrix,
            &l.slope, 4, lightning_slope_rates(c, i));
    } else if (c.family == ModelFamily::KimiLinear) {
      DevMla& a = L.mla;  // q LoRA refused by MlaLayerConfig::of
      const size_t qk = size_t(c.qk_nope_head_dim) + c.qk_rope_head_dim, R = c.kv_lora_rank;
      b.add(p + "mla_q_proj", nh * qk * H, false, g, [](LW w) { return Parts{&w.mla.q_proj}; }, TensorRole::Matrix,
            &a.q_proj);
      b.add(p + "mla_kv_a_proj", (R + c.qk_rope_head_dim) * H, false, g, [](LW w) { return Parts{&w.mla.kv_a_proj}; },
            TensorRole::Matrix, &a.kv_a_proj);
      b.add(p + "mla_kv_a_layernorm", R, false, g, [](LW w) { return Parts{&w.mla.kv_a_layernorm}; },
            TensorRole::GatedNorm, &a.kv_a_layernorm);
      b.add(p + "mla_kv_b_proj", nh * (size_t(c.qk_nope_head_dim) + c.v_head_dim) * R, false, g,
            [](LW w) { return Parts{&w.mla.kv_b_proj}; }, TensorRole::Matrix, &a.kv_b_proj);
      b.add(p + "mla_o_proj", H * nh * c.v_head_dim, false, g, [](LW w) { return Parts{&w.mla.o_proj}; },
            TensorRole::Matrix, &a.o_proj);
    } else {
      DevAttention& a = L.attention;
      const size_t qrows = (c.attn_output_gate ? 2 : 1) * nh * hd;
      b.add(p + "q_proj", qrows * H, false, g, [](LW w) { return Parts{&w.attention.q_proj}; }, TensorRole::Matrix, &a.q_proj);
      b.add(p + "kv_proj", 2 * nkv * hd * H, false, g, [](LW w) { return Parts{&w.attention.k_proj, &w.attention.v_proj}; },
            TensorRole::Matrix, &a.kv_proj);
      b.add(p + "o_proj", H * nh * hd, false, g, [](LW w) { return Parts{&w.attention.o_proj}; }, TensorRole::Matrix, &a.o_proj);
      if (c.family == ModelFamily::Qwen || c.use_qk_norm) {  // MiniMax: no q/k norm
        b.add(p + "q_norm", hd, false, g, [](LW w) { return Parts{&w.attention.q_norm}; }, norm_role, &a.q_norm);
        b.add(p + "k_norm", hd, false, g, [](LW w) { return Parts{&w.attention.k_norm}; }, norm_role, &a.k_norm);
      }
    }
    DevFfn& f = L.ffn;
    if (L.is_moe) {
      const size_t E = c.num_experts, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
      b.add(p + "router", E * H, false, g, [](LW w) { return Parts{&w.moe.router}; }, TensorRole::Matrix, &f.router);
      if (c.router_bias)
        b.add(p + "router_bias", E, true, g, [](LW w) { return Parts{&w.moe.router_bias}; }, TensorRole::Matrix,
              &f.router_bias);
      b.add(p + "experts_gate_up", E * 2 * I * H, false, g, [](LW w) { return Parts{&w.moe.experts_gate_up}; },
            TensorRole::Matrix, &f.experts_gate_up);
      b.add(p + "experts_down", E * H * I, false, g, [](LW w) { return Parts{&w.moe.experts_down}; }, TensorRole::Matrix,
            &f.experts_down);
      if (Is > 0) {
        b.add(p + "shared_gate_up", 2 * Is * H, false, g,
              [](LW w) { return Parts{&w.moe.shared_expert.gate_proj, &w.moe.shared_expert.up_proj}; },
              TensorRole::Matrix, &f.shared_gate_up);
        b.add(p + "shared_down", H * Is, false, g, [](LW w) { return Parts{&w.moe.shared_expert.down_proj}; },
              TensorRole::Matrix, &f.shared_down);
        if (c.shared_expert_gated)
          b.add(p + "shared_gate", H, false, g, [](LW w) { return Parts{&w.moe.shared_expert_gate}; },
                TensorRole::Matrix, &f.shared_gate);
      }
    } else {
      const size_t I = c.intermediate_size;
      b.add(p + "mlp_gate_up", 2 * I * H, false, g, [](LW w) { return Parts{&w.mlp.gate_proj, &w.mlp.up_proj}; },
            TensorRole::Matrix, &f.gate_up);
      b.add(p + "mlp_down", H * I, false, g, [](LW w) { return Parts{&w.mlp.down_proj}; }, TensorRole::Matrix, &f.down);
    }
  }
}

}  // namespace

DeviceWeights DeviceWeights::upload(const ModelConfig& cfg, const ModelWeights& w) {
  if (w.layers.size() != size_t(cfg.num_hidden_layers))
    throw std::invalid_argument("DeviceWeights: " + std::to_string(w.layers.size()) + " host layers, the config has " +
                                std::to_string(cfg.num_hidden_layers));
  DeviceWeights d;
  Builder b;
  declare(cfg, b, d);
  d.mem_ = b.allocate();
  Stager st;  // after d: destroyed (its copies waited for) before d's memory on an exception
  b.fill(d.mem_, st, kEmbed, &w.embed, nullptr);
  b.fill(d.mem_, st, kFinalNorm, &w.final_norm, nullptr);
  if (!cfg.tie_word_embeddings) b.fill(d.mem_, st, kLmHead, &w.lm_head, nullptr);
  for (size_t i = 0; i < w.layers.size(); ++i) b.fill(d.mem_, st, kLayer0 + int(i), nullptr, &w.layers[i]);
  b.check_complete();
  st.finish();
  if (cfg.tie_word_embeddings) d.lm_head = d.embed;
  return d;
}

DeviceWeights DeviceWeights::load(const ModelConfig& cfg, const std::filesystem::path& dir) {
  cfg.validate();  // before declare() indexes layer_types
  DeviceWeights d;
  Builder b;
  declare(cfg, b, d);
  d.mem_ = b.allocate();  // all device memory first: running out fails before the checkpoint is read
  Stager st;
  load_weights_streaming(cfg, dir, [&](WeightsPart&& part) {
    const WeightsPart p = std::move(part);  // freed when this returns, once its values are in pinned memory
    b.fill(d.mem_, st, group_of(p), &p.tensor, &p.weights);
  });
  b.check_complete();
  st.finish();
  if (cfg.tie_word_embeddings) d.lm_head = d.embed;
  return d;
}

DeviceWeights DeviceWeights::random(const ModelConfig& cfg, uint64_t seed) {
  DeviceWeights d;
  Builder b;
  declare(cfg, b, d);
  d.mem_ = b.allocate();
  b.randomize(d.mem_, seed);
  if (cfg.tie_word_embeddings) d.lm_head = d.embed;
  return d;
}

}  // namespace hypic::engine::cuda
