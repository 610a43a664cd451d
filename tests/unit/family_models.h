// Small random-weight models of the Kimi-Linear, MiniMax and Ring-linear families that the family tests share
// (tests/unit/test_families.cpp, test_family_splice.cpp): their config.json texts, an editor for them, and a loader
// that writes a random F32 checkpoint and loads it.
#pragma once
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/cpu/model.h"

namespace hypic::testing {

// A Kimi-Linear config.json as the released checkpoints write it (linear_attn_config with 1-based layer lists,
// first_k_dense_replace), small: layers L L F L F (1-based full layers 3 and 5), 2 expert groups.
inline const char* kKimiReleased = R"({
  "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
  "vocab_size": 97, "hidden_size": 48, "num_hidden_layers": 5, "intermediate_size": 64,
  "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 8,
  "q_lora_rank": null, "kv_lora_rank": 12, "qk_nope_head_dim": 10, "qk_rope_head_dim": 6, "v_head_dim": 14,
  "mla_use_nope": true, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": false,
  "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                         "kda_layers": [1, 2, 4], "full_attn_layers": [3, 5]},
  "num_experts": 8, "num_experts_per_token": 3, "num_shared_experts": 1, "moe_intermediate_size": 20,
  "moe_router_activation_func": "sigmoid", "moe_renormalize": true, "num_expert_group": 2, "topk_group": 1,
  "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "moe_layer_freq": 1, "model_max_length": 4096 })";

// A MiniMax config.json (transformers 5.17 names), small: layers F L L F L L (layer_types), block_size 16.
inline const char* kMiniMax = R"({
  "model_type": "minimax", "architectures": ["MiniMaxForCausalLM"],
  "vocab_size": 97, "hidden_size": 48, "num_hidden_layers": 6, "intermediate_size": 40,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "rms_norm_eps": 1e-5,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
  "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention",
                  "linear_attention"],
  "block_size": 16, "num_local_experts": 6, "num_experts_per_tok": 2,
  "full_attn_alpha_factor": 1.5, "full_attn_beta_factor": 0.75, "linear_attn_alpha_factor": 1.25,
  "linear_attn_beta_factor": 1.1, "mlp_alpha_factor": 1.3, "mlp_beta_factor": 0.9, "tie_word_embeddings": false })";

// A Ring-linear-2.0 config.json (hub names), small: layer_group_size 3 -> L L F L L F, group norm of 2 groups.
inline const char* kRing = R"({
  "model_type": "bailing_moe_linear", "architectures": ["BailingMoeLinearV2ForCausalLM"],
  "vocab_size": 97, "hidden_size": 48, "num_hidden_layers": 6, "intermediate_size": 56,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
  "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "use_qk_norm": true, "layer_group_size": 3,
  "group_norm_size": 2, "first_k_dense_replace": 1, "num_experts": 8, "num_experts_per_tok": 2,
  "num_shared_experts": 1, "moe_intermediate_size": 12, "moe_shared_expert_intermediate_size": 12,
  "n_group": 2, "topk_group": 2, "routed_scaling_factor": 2.0, "score_function": "sigmoid",
  "norm_topk_prob": true, "tie_word_embeddings": false })";

/// `text` with the first occurrence of `from` replaced by `to`.
inline std::string with(const char* text, const std::string& from, const std::string& to) {
  std::string t = text;
  const auto at = t.find(from);
  REQUIRE(at != std::string::npos);
  t.replace(at, from.size(), to);
  return t;
}

/// A fresh, empty directory under the system temp dir, named after `name` and this process.
inline std::filesystem::path temp_dir(const std::string& name) {
  const std::filesystem::path d =
      std::filesystem::temp_directory_path() / ("hypic_test_families_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

/// A random F32 checkpoint of `cfg` (write_random_checkpoint with a larger std than HF's 0.02, so the layers do
/// more than pass the residual through), loaded as a Model.
inline engine::Model random_model(const engine::ModelConfig& cfg, const std::string& name, uint64_t seed = 7) {
  const std::filesystem::path d = temp_dir(name);
  engine::write_random_checkpoint(cfg, seed, d, engine::DType::F32, 0.15);
  engine::Model m = engine::Model::load(d);
  std::filesystem::remove_all(d);
  return m;
}

}  // namespace hypic::testing
