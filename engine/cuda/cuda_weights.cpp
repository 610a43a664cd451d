#include "engine/cuda/cuda_weights.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <functional>
#include <stdexcept>

#include "engine/safetensors.h"
#include "kernels/cuda/ops.h"

namespace hypic::engine::cuda {
namespace {

namespace kc = hypic::kernels::cuda;

/// How one device tensor is filled: from host fp32 parts (concatenated in order), or at random.
struct Spec {
  std::string name;
  size_t numel = 0;
  bool fp32 = false;
  std::vector<const Tensor*> parts;  // upload: host tensors, concatenated
  TensorRole role = TensorRole::Matrix;
  int64_t conv_kernel = 4;
  size_t offset = 0;
  const void** slot = nullptr;  // where the device pointer goes
};

class Builder {
 public:
  template <class T>
  void add(const std::string& name, size_t numel, bool fp32, std::vector<const Tensor*> parts, TensorRole role,
           const T** slot, int64_t conv_kernel = 4) {
    Spec s;
    s.name = name;
    s.numel = numel;
    s.fp32 = fp32;
    s.parts = std::move(parts);
    s.role = role;
    s.conv_kernel = conv_kernel;
    s.offset = layout_.add(numel * (fp32 ? 4 : 2));
    s.slot = reinterpret_cast<const void**>(slot);
    specs_.push_back(std::move(s));
  }

  DeviceMemory allocate() {
    DeviceMemory m(layout_.total(), "model weights");
    for (auto& s : specs_) *s.slot = m.bytes_ptr(s.offset);
    return m;
  }

  void upload(const DeviceMemory& m) {
    size_t cap = 0;
    for (const auto& s : specs_) cap = std::max(cap, s.numel * (s.fp32 ? 4 : 2));
    void* pinned = nullptr;
    check_cuda(cudaMallocHost(&pinned, cap ? cap : 1), "cudaMallocHost(weight staging)");
    try {
      for (const auto& s : specs_) {
        size_t n = 0;
        for (const Tensor* t : s.parts) {
          if (!t) throw std::invalid_argument("DeviceWeights: tensor " + s.name + " is missing");
          for (float v : t->data) {
            if (s.fp32) static_cast<float*>(pinned)[n] = v;
            else static_cast<uint16_t*>(pinned)[n] = f32_to_bf16(v);
            ++n;
          }
        }
        if (n != s.numel)
          throw std::invalid_argument("DeviceWeights: tensor " + s.name + " has " + std::to_string(n) +
                                      " values, the config implies " + std::to_string(s.numel));
        check_cuda(cudaMemcpy(m.bytes_ptr(s.offset), pinned, n * (s.fp32 ? 4 : 2), cudaMemcpyHostToDevice),
                   "upload of " + s.name);
      }
    } catch (...) {
      cudaFreeHost(pinned);
      throw;
    }
    cudaFreeHost(pinned);
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
      kc::fill_random(long(s.numel), kind, a, b, seed, id, s.fp32 ? nullptr : static_cast<bf16*>(p),
                      s.fp32 ? static_cast<float*>(p) : nullptr);
    }
    check_cuda(cudaDeviceSynchronize(), "random weights");
  }

 private:
  Layout layout_;
  std::vector<Spec> specs_;
};

// Declares every tensor of the model (host parts when `w` is given).
void declare(const ModelConfig& c, const ModelWeights* w, Builder& b, DeviceWeights& d) {
  const size_t H = c.hidden_size, V = c.vocab_size;
  auto part = [&](auto f) -> std::vector<const Tensor*> { return w ? std::vector<const Tensor*>{f()} : std::vector<const Tensor*>{}; };
  b.add("embed", V * H, false, part([&] { return &w->embed; }), TensorRole::Matrix, &d.embed);
  b.add("final_norm", H, false, part([&] { return &w->final_norm; }), TensorRole::ZeroCentredNorm, &d.final_norm);
  if (!c.tie_word_embeddings)
    b.add("lm_head", V * H, false, part([&] { return &w->lm_head; }), TensorRole::Matrix, &d.lm_head);
  d.layers.resize(c.num_hidden_layers);
  const size_t nv = c.linear_num_value_heads, dv = c.linear_value_head_dim, C = c.conv_dim();
  const size_t K = c.linear_conv_kernel_dim, nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    const LayerWeights* lw = w ? &w->layers[i] : nullptr;
    DevLayer& L = d.layers[i];
    L.type = c.layer_types[i];
    L.is_moe = c.is_moe_layer(i);
    b.add(p + "input_layernorm", H, false, part([&] { return &lw->input_layernorm; }), TensorRole::ZeroCentredNorm,
          &L.input_layernorm);
    b.add(p + "post_attention_layernorm", H, false, part([&] { return &lw->post_attention_layernorm; }),
          TensorRole::ZeroCentredNorm, &L.post_attention_layernorm);
    if (L.type == LayerType::Linear) {
      DevLinear& l = L.linear;
      b.add(p + "in_proj_qkv", C * H, false, part([&] { return &lw->linear.in_proj_qkv; }), TensorRole::Matrix, &l.in_proj_qkv);
      b.add(p + "in_proj_z", nv * dv * H, false, part([&] { return &lw->linear.in_proj_z; }), TensorRole::Matrix, &l.in_proj_z);
      b.add(p + "in_proj_b", nv * H, false, part([&] { return &lw->linear.in_proj_b; }), TensorRole::Matrix, &l.in_proj_b);
      b.add(p + "in_proj_a", nv * H, false, part([&] { return &lw->linear.in_proj_a; }), TensorRole::Matrix, &l.in_proj_a);
      b.add(p + "conv1d", C * K, false, part([&] { return &lw->linear.conv1d; }), TensorRole::Conv, &l.conv1d, int64_t(K));
      b.add(p + "A_log", nv, true, part([&] { return &lw->linear.A_log; }), TensorRole::ALog, &l.A_log);
      b.add(p + "dt_bias", nv, true, part([&] { return &lw->linear.dt_bias; }), TensorRole::DtBias, &l.dt_bias);
      b.add(p + "norm", dv, false, part([&] { return &lw->linear.norm; }), TensorRole::GatedNorm, &l.norm);
      b.add(p + "out_proj", H * nv * dv, false, part([&] { return &lw->linear.out_proj; }), TensorRole::Matrix, &l.out_proj);
    } else {
      DevAttention& a = L.attention;
      const size_t qrows = (c.attn_output_gate ? 2 : 1) * nh * hd;
      b.add(p + "q_proj", qrows * H, false, part([&] { return &lw->attention.q_proj; }), TensorRole::Matrix, &a.q_proj);
      b.add(p + "kv_proj", 2 * nkv * hd * H, false,
            w ? std::vector<const Tensor*>{&lw->attention.k_proj, &lw->attention.v_proj} : std::vector<const Tensor*>{},
            TensorRole::Matrix, &a.kv_proj);
      b.add(p + "o_proj", H * nh * hd, false, part([&] { return &lw->attention.o_proj; }), TensorRole::Matrix, &a.o_proj);
      b.add(p + "q_norm", hd, false, part([&] { return &lw->attention.q_norm; }), TensorRole::ZeroCentredNorm, &a.q_norm);
      b.add(p + "k_norm", hd, false, part([&] { return &lw->attention.k_norm; }), TensorRole::ZeroCentredNorm, &a.k_norm);
    }
    DevFfn& f = L.ffn;
    if (L.is_moe) {
      const size_t E = c.num_experts, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
      b.add(p + "router", E * H, false, part([&] { return &lw->moe.router; }), TensorRole::Matrix, &f.router);
      b.add(p + "experts_gate_up", E * 2 * I * H, false, part([&] { return &lw->moe.experts_gate_up; }),
            TensorRole::Matrix, &f.experts_gate_up);
      b.add(p + "experts_down", E * H * I, false, part([&] { return &lw->moe.experts_down; }), TensorRole::Matrix,
            &f.experts_down);
      if (Is > 0) {
        b.add(p + "shared_gate_up", 2 * Is * H, false,
              w ? std::vector<const Tensor*>{&lw->moe.shared_expert.gate_proj, &lw->moe.shared_expert.up_proj}
                : std::vector<const Tensor*>{},
              TensorRole::Matrix, &f.shared_gate_up);
        b.add(p + "shared_down", H * Is, false, part([&] { return &lw->moe.shared_expert.down_proj; }),
              TensorRole::Matrix, &f.shared_down);
        b.add(p + "shared_gate", H, false, part([&] { return &lw->moe.shared_expert_gate; }), TensorRole::Matrix,
              &f.shared_gate);
      }
    } else {
      const size_t I = c.intermediate_size;
      b.add(p + "mlp_gate_up", 2 * I * H, false,
            w ? std::vector<const Tensor*>{&lw->mlp.gate_proj, &lw->mlp.up_proj} : std::vector<const Tensor*>{},
            TensorRole::Matrix, &f.gate_up);
      b.add(p + "mlp_down", H * I, false, part([&] { return &lw->mlp.down_proj; }), TensorRole::Matrix, &f.down);
    }
  }
}

}  // namespace

DeviceWeights DeviceWeights::upload(const ModelConfig& cfg, const ModelWeights& w) {
  DeviceWeights d;
  Builder b;
  declare(cfg, &w, b, d);
  d.mem_ = b.allocate();
  b.upload(d.mem_);
  if (cfg.tie_word_embeddings) d.lm_head = d.embed;
  return d;
}

DeviceWeights DeviceWeights::random(const ModelConfig& cfg, uint64_t seed) {
  DeviceWeights d;
  Builder b;
  declare(cfg, nullptr, b, d);
  d.mem_ = b.allocate();
  b.randomize(d.mem_, seed);
  if (cfg.tie_word_embeddings) d.lm_head = d.embed;
  return d;
}

}  // namespace hypic::engine::cuda
