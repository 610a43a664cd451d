// The CUDA bf16 backend of engine/backend.h: Qwen3-Next / Qwen3.5 (dense and MoE) on one GPU.
//
// Numerics (DESIGN.md 5): bf16 weights and activations, fp32 accumulation in every GEMM (cuBLASLt) and in the
// attention softmax, an fp32 residual stream, fp32 linear-attention states and transitions.
//
// Memory (all on the device, carved at construction unless stated):
//  - weights (engine/cuda/cuda_weights.h);
//  - per-sequence state slots: per linear layer [max_sequences][H_v][128][128] fp32 and the conv state
//    [max_sequences][K-1][conv_dim] bf16;
//  - the KV pool: per attention layer K and V [pages][64][H_kv][head_dim] bf16, pages handed to sequences as
//    they grow (BackendOptions::kv_pool_bytes; RESOURCE_EXHAUSTED naming it when a request does not fit);
//  - activations for BackendOptions::max_batch_tokens tokens per forward pass;
//  - entries and prefix checkpoints: stream-ordered allocations (cudaMallocAsync), freed when released.
// Supported: linear_key_head_dim = linear_value_head_dim = 128 (kernels/cuda/gated_delta.h), attention head_dim
// 64, 128 or 256, hidden size a multiple of 64; others are refused at load with std::invalid_argument.
#pragma once
#include <filesystem>
#include <memory>

#include "engine/backend.h"
#include "engine/checkpoint/weights.h"

namespace hypic::engine::cuda {

/// Builds the CUDA backend on `device` (kind Cuda). Loads the checkpoint in model_dir (config.json and the
/// safetensors weights through engine/checkpoint/weights.h, converted to bf16 on upload), or, with
/// options.random_weights_seed != 0, config.json alone and seeded random weights made on the device
/// (benchmark-only: logged as such). Throws std::invalid_argument (unsupported config, no such device) or
/// std::runtime_error (CUDA errors, out of device memory naming the pool).
std::unique_ptr<Backend> make_backend(const DeviceSpec& device, const std::filesystem::path& model_dir,
                                      const BackendOptions& options);

/// Same, from a config and host weights already in memory (tests); weights == nullptr means random weights
/// with options.random_weights_seed (which must then be non-zero).
std::unique_ptr<Backend> make_backend(const DeviceSpec& device, const ModelConfig& config, const ModelWeights* weights,
                                      const BackendOptions& options);

}  // namespace hypic::engine::cuda
