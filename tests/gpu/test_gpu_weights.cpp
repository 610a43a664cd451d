// DeviceWeights::load (the checkpoint streamed to the device one part at a time, engine/checkpoint/weights.h
// load_weights_streaming) against DeviceWeights::upload of the whole host model (load_weights): every device tensor
// downloaded and compared byte for byte, on the committed HF fixtures (F32 on disk; both layouts; the sharded
// qwen3_next_moe_released; tied embeddings) and on random BF16 / F16 checkpoints of a GPU-sized config whose
// embedding (17.9M values) is larger than one pinned staging buffer. Also: bf16 rounding of the host values,
// fp32 A_log / dt_bias, and load's errors are load_weights's. Needs an NVIDIA GPU (scripts/test_gpu.sh).
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/weights.h"
#include "engine/cuda/cuda_weights.h"
#include "tests/gpu/gpu_util.h"

namespace eng = hypic::engine;
namespace ec = hypic::engine::cuda;
namespace fs = std::filesystem;
using hypic::gputest::check_cuda;
using hypic::gputest::cuda_device_present;

namespace {

void require_gpu() {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
}

const fs::path kFixtures = fs::path("tests") / "fixtures";

/// One device tensor of a DeviceWeights: name, device pointer, size in bytes (from the config).
struct DevTensor {
  std::string name;
  const void* ptr;
  size_t bytes;
};

/// Every tensor of `d`, sized from the config (bf16 = 2 bytes, A_log / dt_bias fp32 = 4).
std::vector<DevTensor> tensors_of(const eng::ModelConfig& c, const ec::DeviceWeights& d) {
  const size_t H = c.hidden_size, V = c.vocab_size, nv = c.linear_num_value_heads, dv = c.linear_value_head_dim;
  const size_t C = c.conv_dim(), K = c.linear_conv_kernel_dim, nh = c.num_attention_heads,
               nkv = c.num_key_value_heads, hd = c.head_dim;
  std::vector<DevTensor> out{{"embed", d.embed, V * H * 2}, {"final_norm", d.final_norm, H * 2}};
  if (!c.tie_word_embeddings) out.push_back({"lm_head", d.lm_head, V * H * 2});
  REQUIRE(d.layers.size() == size_t(c.num_hidden_layers));
  for (size_t i = 0; i < d.layers.size(); ++i) {
    const ec::DevLayer& L = d.layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    auto add = [&](const char* n, const void* ptr, size_t bytes) { out.push_back({p + n, ptr, bytes}); };
    add("input_layernorm", L.input_layernorm, H * 2);
    add("post_attention_layernorm", L.post_attention_layernorm, H * 2);
    if (L.type == eng::LayerType::Linear) {
      add("in_proj_qkv", L.linear.in_proj_qkv, C * H * 2);
      add("in_proj_z", L.linear.in_proj_z, nv * dv * H * 2);
      add("in_proj_b", L.linear.in_proj_b, nv * H * 2);
      add("in_proj_a", L.linear.in_proj_a, nv * H * 2);
      add("conv1d", L.linear.conv1d, C * K * 2);
      add("A_log", L.linear.A_log, nv * 4);
      add("dt_bias", L.linear.dt_bias, nv * 4);
      add("norm", L.linear.norm, dv * 2);
      add("out_proj", L.linear.out_proj, H * nv * dv * 2);
    } else {
      add("q_proj", L.attention.q_proj, (c.attn_output_gate ? 2 : 1) * nh * hd * H * 2);
      add("kv_proj", L.attention.kv_proj, 2 * nkv * hd * H * 2);
      add("o_proj", L.attention.o_proj, H * nh * hd * 2);
      add("q_norm", L.attention.q_norm, hd * 2);
      add("k_norm", L.attention.k_norm, hd * 2);
    }
    if (L.is_moe) {
      const size_t E = c.num_experts, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
      add("router", L.ffn.router, E * H * 2);
      add("experts_gate_up", L.ffn.experts_gate_up, E * 2 * I * H * 2);
      add("experts_down", L.ffn.experts_down, E * H * I * 2);
      if (Is > 0) {
        add("shared_gate_up", L.ffn.shared_gate_up, 2 * Is * H * 2);
        add("shared_down", L.ffn.shared_down, H * Is * 2);
        add("shared_gate", L.ffn.shared_gate, H * 2);
      }
    } else {
      add("mlp_gate_up", L.ffn.gate_up, 2 * c.intermediate_size * H * 2);
      add("mlp_down", L.ffn.down, H * c.intermediate_size * 2);
    }
  }
  return out;
}

std::vector<uint8_t> download(const void* p, size_t bytes) {
  std::vector<uint8_t> h(bytes);
  check_cuda(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost), "download");
  return h;
}

/// load(dir) == upload(load_weights(dir)), tensor by tensor, plus spot checks against the host values.
void check_same(const fs::path& dir) {
  INFO("checkpoint " << dir.string());
  const eng::ModelConfig cfg = eng::load_config(dir);
  const eng::ModelWeights host = eng::load_weights(cfg, dir);
  const ec::DeviceWeights up = ec::DeviceWeights::upload(cfg, host);
  const ec::DeviceWeights st = ec::DeviceWeights::load(cfg, dir);
  CHECK(st.bytes() == up.bytes());
  if (cfg.tie_word_embeddings) CHECK(st.lm_head == st.embed);
  const auto a = tensors_of(cfg, up), b = tensors_of(cfg, st);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("tensor " << a[i].name);
    REQUIRE(a[i].ptr != nullptr);
    REQUIRE(b[i].ptr != nullptr);
    REQUIRE(download(a[i].ptr, a[i].bytes) == download(b[i].ptr, b[i].bytes));
  }
  // Independent of upload: the embedding is the bf16 rounding of the host fp32 values, A_log stays fp32.
  const auto emb = download(st.embed, host.embed.data.size() * 2);
  for (size_t j = 0; j < host.embed.data.size(); ++j) {
    uint16_t v;
    std::memcpy(&v, emb.data() + 2 * j, 2);
    if (v != eng::f32_to_bf16(host.embed.data[j])) FAIL("embed element " << j << " is not the bf16 rounding");
  }
  for (size_t i = 0; i < host.layers.size(); ++i) {
    if (host.layers[i].type != eng::LayerType::Linear) continue;
    const auto& A = host.layers[i].linear.A_log.data;
    CHECK(download(st.layers[i].linear.A_log, A.size() * 4) ==
          std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(A.data()),
                               reinterpret_cast<const uint8_t*>(A.data()) + A.size() * 4));
  }
}

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("hypic_gpu_weights_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
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

TEST_CASE("DeviceWeights::load == upload(load_weights) on the HF fixtures", "[gpu][weights]") {
  require_gpu();
  for (const char* name :
       {"qwen3_next_moe", "qwen3_5_moe", "qwen3_5_moe_released", "qwen3_next_moe_released", "qwen3_5_dense"})
    check_same(kFixtures / name);
}

TEST_CASE("DeviceWeights::load == upload(load_weights) on BF16 / F16 checkpoints larger than the staging buffer",
          "[gpu][weights]") {
  require_gpu();
  eng::ModelConfig big = eng::load_config("tests/gpu/configs/qwen3_5_dense_gpu.json");
  big.vocab_size = 70000;  // embed 70000 x 256 = 17.9M values: two chunks of the 32 MiB staging buffer
  const eng::ModelConfig moe = eng::load_config("tests/gpu/configs/qwen3_5_moe_gpu.json");
  const eng::ModelConfig next = eng::load_config("tests/gpu/configs/qwen3_next_gpu.json");
  check_same([&] { const fs::path d = scratch("big_bf16"); eng::write_random_checkpoint(big, 3, d, eng::DType::BF16); return d; }());
  check_same([&] { const fs::path d = scratch("big_f16"); eng::write_random_checkpoint(big, 4, d, eng::DType::F16); return d; }());
  check_same([&] { const fs::path d = scratch("moe_bf16"); eng::write_random_checkpoint(moe, 5, d, eng::DType::BF16); return d; }());
  check_same([&] { const fs::path d = scratch("next_bf16"); eng::write_random_checkpoint(next, 6, d, eng::DType::BF16); return d; }());
}

TEST_CASE("DeviceWeights::load fails with load_weights's messages", "[gpu][weights]") {
  require_gpu();
  const fs::path src = kFixtures / "qwen3_5_moe";
  const eng::ModelConfig cfg = eng::load_config(src);
  // Copies of the fixture without one tensor, and with one extra tensor.
  auto copy_with = [&](const std::string& name, const std::string& drop, bool extra) {
    const fs::path dst = scratch(name);
    const eng::Checkpoint ck = eng::Checkpoint::open(src);
    eng::SafetensorsWriter w;
    for (const auto& n : ck.names()) {
      if (n == drop) continue;
      const eng::TensorInfo& info = *ck.find(n);
      w.add_f32(n, info.shape, ck.file_of(n).read_f32(info));
    }
    if (extra) w.add_f32("model.layers.1.self_attn.o_proj.bias", {64}, std::vector<float>(64, 0.f));
    w.write(dst / "model.safetensors");
    fs::copy_file(src / "config.json", dst / "config.json");
    return dst;
  };
  const fs::path missing = copy_with("missing", "model.layers.3.self_attn.k_norm.weight", false);
  const std::string e = error_of([&] { ec::DeviceWeights::load(cfg, missing); });
  CHECK_THAT(e, Catch::Contains("missing tensor 'model.layers.3.self_attn.k_norm.weight'"));
  CHECK(e == error_of([&] { eng::load_weights(cfg, missing); }));
  const fs::path extra = copy_with("extra", "", true);
  const std::string u = error_of([&] { ec::DeviceWeights::load(cfg, extra); });
  CHECK_THAT(u, Catch::Contains("tensors the config does not use: model.layers.1.self_attn.o_proj.bias"));
  CHECK(u == error_of([&] { eng::load_weights(cfg, extra); }));
  // Host weights that do not match the config are refused by upload.
  eng::ModelWeights w = eng::load_weights(cfg, src);
  w.layers.pop_back();
  CHECK_THROWS_WITH(ec::DeviceWeights::upload(cfg, w), Catch::Contains("host layers, the config has 4"));
}
