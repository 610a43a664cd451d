// Model weights on the device for the CUDA backend: bf16 matrices and norm weights, fp32 gate parameters, in the
// layout the CUDA forward pass reads (projections fused where one GEMM can produce several outputs).
// All pointers are DEVICE pointers into one allocation owned by DeviceWeights.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/cuda/device_memory.h"
#include "engine/cuda/kda_mixer.h"
#include "engine/cuda/lightning_mixer.h"
#include "engine/cuda/mla_mixer.h"

namespace hypic::engine::cuda {

using bf16 = __nv_bfloat16;

/// Gated DeltaNet layer (HF Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet), H hidden, C = conv_dim.
struct DevLinear {
  const bf16* in_proj_qkv = nullptr;  ///< [C][H] rows [Q | K | V]
  const bf16* in_proj_z = nullptr;    ///< [nv*dv][H]
  const bf16* in_proj_b = nullptr;    ///< [nv][H]
  const bf16* in_proj_a = nullptr;    ///< [nv][H]
  const bf16* conv1d = nullptr;       ///< [C][K]
  const float* A_log = nullptr;       ///< [nv] fp32
  const float* dt_bias = nullptr;     ///< [nv] fp32
  const bf16* norm = nullptr;         ///< [dv] gated norm weight (applied as w)
  const bf16* out_proj = nullptr;     ///< [H][nv*dv]
};

/// Gated full attention (HF Qwen3NextAttention).
struct DevAttention {
  const bf16* q_proj = nullptr;   ///< [(gate ? 2 : 1) nh hd][H], per head query rows then gate rows
  const bf16* kv_proj = nullptr;  ///< [2 nkv hd][H]: k_proj rows then v_proj rows (one GEMM)
  const bf16* o_proj = nullptr;   ///< [H][nh hd]
  const bf16* q_norm = nullptr;   ///< [hd] zero-centred
  const bf16* k_norm = nullptr;   ///< [hd] zero-centred
};

/// SwiGLU MLP / MoE block.
struct DevFfn {
  const bf16* gate_up = nullptr;         ///< dense: [2I][H] gate rows then up rows
  const bf16* down = nullptr;            ///< dense: [H][I]
  const bf16* router = nullptr;          ///< MoE: [E][H]
  const float* router_bias = nullptr;    ///< MoE with ModelConfig::router_bias: [E] fp32 choice bias, else null
  const bf16* experts_gate_up = nullptr; ///< MoE: [E][2I][H]
  const bf16* experts_down = nullptr;    ///< MoE: [E][H][I]
  const bf16* shared_gate_up = nullptr;  ///< MoE: [2Is][H] (null when Is = 0)
  const bf16* shared_down = nullptr;     ///< MoE: [H][Is]
  const bf16* shared_gate = nullptr;     ///< MoE: [1][H]; null when the shared expert is ungated (Kimi, Ring)
};

/// One decoder layer: exactly one mixer is set, by `type` and the family (ModelConfig::family): linear (Qwen's Gated
/// DeltaNet), kda (Kimi-Linear), lightning (MiniMax, Ring-linear) for linear layers; attention (Qwen gated, MiniMax /
/// Ring plain GQA: q_proj [nh hd][H], q_norm / k_norm applied as w for Ring, null for MiniMax) or mla (Kimi-Linear).
struct DevLayer {
  LayerType type = LayerType::Linear;
  bool is_moe = false;
  const bf16* input_layernorm = nullptr;           ///< [H] zero-centred (Qwen) or applied as w (the others)
  const bf16* post_attention_layernorm = nullptr;  ///< [H] likewise
  DevLinear linear;
  DevKda kda;
  DevLightning lightning;
  DevAttention attention;
  DevMla mla;
  DevFfn ffn;
};

/// All weights of a model on one device.
class DeviceWeights {
 public:
  /// Converts host fp32 weights (engine/checkpoint/weights.h load_weights) to bf16 (round to nearest even; exact for
  /// checkpoints stored in bf16) and uploads them to the current device through two 32 MiB pinned staging
  /// buffers. A_log and dt_bias stay fp32. The same per-group conversion as load(), so that
  /// upload(cfg, load_weights(cfg, dir)) and load(cfg, dir) give identical bytes. Throws std::runtime_error when
  /// device memory runs out (naming the bytes), std::invalid_argument when `w` does not match the config (layer
  /// count, or a tensor whose size differs from the config's: "DeviceWeights: tensor layers.3.router has ...").
  static DeviceWeights upload(const ModelConfig& cfg, const ModelWeights& w);
  /// Streams the checkpoint in `dir` (what load_weights accepts: model.safetensors or a sharded index, either
  /// layout, BF16 / F16 / F32 on disk) straight to the current device: allocates the whole device layout from the
  /// config first (so running out of device memory fails before any reading), then takes load_weights_streaming's
  /// parts one at a time (embed, final_norm, lm_head, layer 0, 1, ...), converts each as upload() does, copies it
  /// into place and frees it. Host memory: the memory mappings of the files, ONE part in fp32 (the largest of
  /// the embedding [V, H] and one decoder layer) and 64 MiB of pinned staging, never the whole model. Throws
  /// load_weights's errors (std::runtime_error naming the checkpoint and the tensor: missing, mis-shaped, unused,
  /// corrupt file; the unused-tensor check runs after the last layer was copied), and std::runtime_error for CUDA
  /// failures (device memory naming the bytes). The device memory is freed on any error.
  static DeviceWeights load(const ModelConfig& cfg, const std::filesystem::path& dir);
  /// Benchmark-only weights made on the device from the config alone, seeded: matrices N(0, 0.02), zero-centred
  /// norms N(0, 0.05), gated norms 1 + N(0, 0.05), A_log log U(1, 16), dt_bias 1, conv U(+-1/sqrt(K))
  /// (the distributions of engine/checkpoint/weights.h write_random_checkpoint, drawn by another generator); the
  /// norms of the non-Qwen families 1 + N(0, 0.05) (applied as w); lightning slopes the model's own
  /// (lightning_slope_rates).
  static DeviceWeights random(const ModelConfig& cfg, uint64_t seed);

  const bf16* embed = nullptr;       ///< [V][H]
  const bf16* final_norm = nullptr;  ///< [H] zero-centred (Qwen) or applied as w
  const bf16* lm_head = nullptr;     ///< [V][H] (== embed when tied)
  std::vector<DevLayer> layers;
  size_t bytes() const { return mem_.size(); }

 private:
  DeviceMemory mem_;
};

}  // namespace hypic::engine::cuda
