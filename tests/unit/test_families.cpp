// The Kimi-Linear, MiniMax and Ring-linear families (issue 14, stage 1): config parsing and its errors, the KDA and
// lightning kernels against the token-level recurrences of engine/families/linear_families.h, checkpoint layouts (both
// names of every tensor), and the forward pass of small random models: chunked prefill == token-by-token decode,
// one span == two spans, captured T_C composes, position independence where the family has no positions. The
// HF transformers 5.17 fixtures (tests/fixtures/<dir>/ with a config.json of model_type kimi_linear / minimax /
// bailing_moe_linear and a reference.safetensors) are compared when present and skipped (with a warning) otherwise.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/weights.h"
#include "engine/cpu/model.h"
#include "engine/families/kimi_linear/layers.h"
#include "engine/families/linear_families.h"
#include "engine/segment.h"
#include "engine/transition.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/lightning.h"
#include "tests/unit/family_models.h"
#include "tests/unit/state_checks.h"

using namespace hypic::engine;
namespace fs = std::filesystem;
namespace cpu = hypic::kernels::cpu;
using hypic::testing::check_states_close;
using hypic::testing::kKimiReleased;
using hypic::testing::kMiniMax;
using hypic::testing::kRing;
using hypic::testing::random_model;
using hypic::testing::temp_dir;
using hypic::testing::with;
using hypic::testing::max_abs;
using hypic::testing::random_ids;
using hypic::testing::rel_err;

namespace {

constexpr LayerType L = LayerType::Linear;
constexpr LayerType F = LayerType::FullAttention;
constexpr double kTol = 2e-5;

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.0f, float mean = 0.0f) {
  std::normal_distribution<float> d(mean, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Config
// ---------------------------------------------------------------------------------------------------------------

TEST_CASE("Kimi-Linear config: released layout", "[families][config]") {
  const ModelConfig c = parse_config(kKimiReleased);
  CHECK(c.family == ModelFamily::KimiLinear);
  CHECK(c.layer_types == std::vector<LayerType>{L, L, F, L, F});
  CHECK(c.linear_num_key_heads == 2);
  CHECK(c.linear_num_value_heads == 2);
  CHECK(c.linear_key_head_dim == 16);
  CHECK(c.linear_value_head_dim == 16);
  CHECK(c.conv_dim() == 3 * 2 * 16);
  CHECK(c.conv_rows() == 3);
  CHECK(c.head_dim == 16);  // qk_nope + qk_rope (the MLA K head dim)
  CHECK(c.attn_v_head_dim() == 14);
  CHECK(c.num_key_value_heads == 3);
  CHECK(c.rotary_dim() == 0);
  CHECK_FALSE(c.attention_has_rope());
  CHECK(c.kv_lora_rank == 12);
  CHECK(c.q_lora_rank == 0);
  CHECK(c.router_score == RouterScore::Sigmoid);
  CHECK(c.router_bias);
  CHECK(c.n_group == 2);
  CHECK(c.topk_group == 1);
  CHECK(c.routed_scaling_factor == 2.5);
  CHECK(c.shared_expert_intermediate_size == 20);
  CHECK_FALSE(c.shared_expert_gated);
  CHECK(c.max_position_embeddings == 4096);
  CHECK(c.rms_norm_eps == 1e-5);
  CHECK_FALSE(c.is_moe_layer(0));
  for (int i = 1; i < 5; ++i) CHECK(c.is_moe_layer(i));
  // State geometry: S 2*16*16 + conv tail 3*96; KV per token 2 layers * 1 latent row of kv_lora_rank 12 +
  // qk_rope 6 floats (no V).
  CHECK(c.linear_state_bytes() == (2 * 16 * 16 + 3 * 96) * 4);
  CHECK(c.attention_is_latent());
  CHECK(c.kv_cache_heads() == 1);
  CHECK(c.kv_cache_k_dim() == 12 + 6);
  CHECK(c.kv_cache_v_dim() == 0);
  CHECK(c.kv_bytes_per_token() == 2 * 1 * (12 + 6) * 4);
  // The same model as transformers 5.17 save_pretrained writes it (explicit lists, attribute_map spellings).
  const ModelConfig saved = parse_config(R"({
    "model_type": "kimi_linear", "vocab_size": 97, "hidden_size": 48, "num_hidden_layers": 5,
    "intermediate_size": 64, "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": null,
    "kv_lora_rank": 12, "qk_nope_head_dim": 10, "qk_rope_head_dim": 6, "v_head_dim": 14, "rms_norm_eps": 1e-5,
    "linear_num_heads": 2, "linear_head_dim": 16, "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
    "num_local_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 1, "moe_intermediate_size": 20,
    "norm_topk_prob": true, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
    "max_position_embeddings": 4096 })");
  CHECK(saved.fingerprint() == c.fingerprint());
  // Round trip through config_to_json.
  CHECK(parse_config(config_to_json(c)).fingerprint() == c.fingerprint());
  // Default layer types (no lists): full attention iff i > 0 and i % 4 == 0 (KimiLinearConfig).
  std::string no_lists = with(kKimiReleased, R"("kda_layers": [1, 2, 4], "full_attn_layers": [3, 5])", R"("x": 0)");
  CHECK(parse_config(no_lists).layer_types == std::vector<LayerType>{L, L, L, L, F});
  // moe_layer_freq 2 (remote-code DeepSeek rule, when mlp_layer_types is absent): sparse iff i >= 1 and i % 2 == 0.
  const ModelConfig freq2 = parse_config(with(kKimiReleased, R"("moe_layer_freq": 1)", R"("moe_layer_freq": 2)"));
  CHECK(freq2.mlp_only_layers == std::vector<int>{0, 1, 3});
}

TEST_CASE("Kimi-Linear-48B-A3B architecture numbers (bench/gpu/kimi_linear_48b_a3b.json)", "[families][config]") {
  // The benchmark config at real size: the 1-based KDA / MLA lists become 3 KDA : 1 MLA with MLA last, and the
  // parameter counts match the model card (48B in total, 3B activated per token; the embedding and LM head,
  // 2 * 163840 * 2304 = 0.75B, are not counted in the card's 3B).
  const ModelConfig c = load_config(fs::path(HYPIC_SOURCE_DIR) / "bench" / "gpu" / "kimi_linear_48b_a3b.json");
  CHECK(c.family == ModelFamily::KimiLinear);
  CHECK(c.num_linear_layers() == 20);
  CHECK(c.num_attention_layers() == 7);
  for (int i : {3, 7, 11, 15, 19, 23, 26}) CHECK(c.layer_types[size_t(i)] == F);
  CHECK_FALSE(c.is_moe_layer(0));
  CHECK(c.is_moe_layer(26));
  CHECK(c.head_dim == 192);  // qk_nope 128 + qk_rope 64: the MLA K head
  CHECK(c.attn_v_head_dim() == 128);
  CHECK(c.kv_lora_rank == 512);
  CHECK(c.linear_key_head_dim == 128);
  CHECK(c.conv_rows() == 3);  // q, k, v short convolutions
  const ParameterCounts n = count_parameters(c);
  CHECK(n.total > 47'000'000'000LL);
  CHECK(n.total < 50'000'000'000LL);
  const int64_t embeddings = 2 * c.vocab_size * c.hidden_size;
  CHECK(n.active_per_token - embeddings > 2'500'000'000LL);
  CHECK(n.active_per_token - embeddings < 3'300'000'000LL);
  // MLA's latent per attention layer and token, fp32: one row of kv_lora_rank 512 + qk_rope 64, no V: 7 * 576 * 4
  // bytes, 1/17.8 of what the expanded K (32 x 192) and V (32 x 128) took.
  CHECK(c.kv_cache_heads() == 1);
  CHECK(c.kv_cache_k_dim() == 576);
  CHECK(c.kv_cache_v_dim() == 0);
  CHECK(c.kv_bytes_per_token() == 7 * 1 * (512 + 64) * 4);
  const EntryGeometry g = EntryGeometry::of(c);
  CHECK(g.kv_heads == 1);
  CHECK(g.head_dim == 576);
  CHECK(g.kv_latent_rank == 512);
  CHECK(g.v_dim() == 0);
  CHECK(entry_format_version(c) == 6);
}

TEST_CASE("MiniMax-Text-01 architecture numbers (bench/gpu/minimax_text_01.json)", "[families][config]") {
  // The benchmark config at real size: every 8th layer softmax, DeepNorm residual factors, and the parameter counts of
  // the model card (456B in total, 45.9B activated per token without the embedding and LM head,
  // 2 * 200064 * 6144 = 2.46B).
  const ModelConfig c = load_config(fs::path(HYPIC_SOURCE_DIR) / "bench" / "gpu" / "minimax_text_01.json");
  CHECK(c.family == ModelFamily::MiniMax);
  CHECK(c.num_linear_layers() == 70);
  CHECK(c.num_attention_layers() == 10);
  for (int i = 0; i < 80; ++i) CHECK((c.layer_types[size_t(i)] == F) == ((i + 1) % 8 == 0));
  CHECK(c.head_dim == 128);
  CHECK(c.rotary_dim() == 128);  // MiniMaxRotaryEmbedding rotates the whole head
  CHECK(std::abs(c.mlp_alpha - std::pow(160.0, 0.25)) < 1e-12);
  CHECK(c.mlp_beta == 1.0);
  const ParameterCounts n = count_parameters(c);
  CHECK(n.total > 455'000'000'000LL);
  CHECK(n.total < 457'500'000'000LL);
  const int64_t embeddings = 2 * c.vocab_size * c.hidden_size;
  CHECK(n.active_per_token - embeddings > 45'500'000'000LL);
  CHECK(n.active_per_token - embeddings < 46'300'000'000LL);
}

TEST_CASE("Kimi-Linear config errors name the field", "[families][config][errors]") {
  auto fails = [](const std::string& text, const std::string& field) {
    INFO(field);
    CHECK_THROWS_WITH(parse_config(text), Catch::Contains("'" + field + "'"));
  };
  fails(with(kKimiReleased, R"("mla_use_nope": true)", R"("mla_use_nope": false)"), "mla_use_nope");
  fails(with(kKimiReleased, R"("num_key_value_heads": 3)", R"("num_key_value_heads": 1)"), "num_key_value_heads");
  fails(with(kKimiReleased, R"("kda_layers": [1, 2, 4])", R"("kda_layers": [1, 2])"), "kda_layers");
  fails(with(kKimiReleased, R"("kda_layers": [1, 2, 4])", R"("kda_layers": [1, 2, 4, 9])"), "kda_layers");
  fails(with(kKimiReleased, R"("kda_layers": [1, 2, 4])", R"("kda_layers": [1, 2, 3, 4])"), "kda_layers");
  fails(with(kKimiReleased, R"("moe_router_activation_func": "sigmoid")",
             R"("moe_router_activation_func": "softmax")"),
        "moe_router_activation_func");
  fails(with(kKimiReleased, R"("num_expert_group": 2)", R"("num_expert_group": 3)"), "num_experts");
  fails(with(kKimiReleased, R"("topk_group": 1)", R"("topk_group": 3)"), "topk_group");
  fails(with(kKimiReleased, R"("num_experts_per_token": 3)", R"("num_experts_per_token": 5)"), "num_experts_per_tok");
  fails(with(kKimiReleased, R"("kv_lora_rank": 12)", R"("kv_lora_rank": 0)"), "kv_lora_rank");
  fails(with(kKimiReleased, R"("short_conv_kernel_size": 4)", R"("short_conv_kernel_size": 0)"),
        "linear_conv_kernel_dim");
  fails(with(kKimiReleased, R"("hidden_act": "silu")", R"("hidden_act": "gelu")"), "hidden_act");
  fails(with(kKimiReleased, R"("moe_layer_freq": 1)", R"("moe_layer_freq": 0)"), "moe_layer_freq");
  // one list without the other would silently fall back to the default layout
  fails(with(kKimiReleased, R"("kda_layers": [1, 2, 4], "full_attn_layers": [3, 5])", R"("full_attn_layers": [3, 5])"),
        "full_attn_layers");
  fails(with(kKimiReleased, R"("kda_layers": [1, 2, 4], "full_attn_layers": [3, 5])", R"("kda_layers": [1, 2, 4])"),
        "kda_layers");
}

TEST_CASE("MiniMax config", "[families][config]") {
  const ModelConfig c = parse_config(kMiniMax);
  CHECK(c.family == ModelFamily::MiniMax);
  CHECK(c.layer_types == std::vector<LayerType>{F, L, L, F, L, L});
  CHECK(c.linear_num_value_heads == 4);
  CHECK(c.linear_key_head_dim == 12);
  CHECK(c.conv_rows() == 0);
  CHECK(c.linear_state_bytes() == 4 * 12 * 12 * 4);
  CHECK(c.rotary_dim() == 12);  // MiniMaxRotaryEmbedding rotates the whole head
  CHECK(c.lightning_block_size == 16);
  CHECK(c.linear_norm_eps == 1e-6);
  CHECK(c.moe_intermediate_size == 40);
  CHECK(c.num_experts == 6);
  CHECK(c.router_score == RouterScore::Softmax);
  CHECK(c.norm_topk_prob);
  CHECK(c.full_attn_alpha == 1.5);
  CHECK(c.mlp_beta == 0.9);
  for (int i = 0; i < 6; ++i) CHECK(c.is_moe_layer(i));
  CHECK(parse_config(config_to_json(c)).fingerprint() == c.fingerprint());
  // Defaults: layer i is full attention iff i is even; head_dim = hidden / heads; rope theta 1e6.
  std::string bare = kMiniMax;
  bare = with(bare.c_str(), R"("head_dim": 12, )", "");
  const auto lt_at = bare.find(R"("layer_types")");
  const auto lt_end = bare.find("],", lt_at);
  bare.erase(lt_at, lt_end + 2 - lt_at);
  bare = with(bare.c_str(), R"("rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},)", "");
  const ModelConfig d = parse_config(bare);
  CHECK(d.layer_types == std::vector<LayerType>{F, L, F, L, F, L});
  CHECK(d.head_dim == 12);
  CHECK(d.rope_theta == 1e6);
  // The original MiniMax-Text-01 names.
  const ModelConfig orig = parse_config(with(
      with(bare.c_str(), R"("full_attn_alpha_factor": 1.5)", R"("layernorm_full_attention_alpha": 1.5)").c_str(),
      R"("block_size": 16,)", R"("block_size": 16, "attn_type_list": [1, 0, 0, 1, 0, 0], "postnorm": true,)"));
  CHECK(orig.layer_types == c.layer_types);
  CHECK(orig.full_attn_alpha == 1.5);
  // Errors name the field.
  // MiniMax rotates the whole head: an odd head_dim is named as such
  CHECK_THROWS_WITH(parse_config(with(kMiniMax, R"("head_dim": 12)", R"("head_dim": 7)")),
                    Catch::Contains("'head_dim'") && Catch::Contains("rotary_dim 7"));
  CHECK_THROWS_WITH(parse_config(with(kMiniMax, R"("block_size": 16)", R"("block_size": 0)")),
                    Catch::Contains("'block_size'"));
  CHECK_THROWS_WITH(parse_config(with(kMiniMax, R"("block_size": 16)", R"("block_size": 16, "sliding_window": 8)")),
                    Catch::Contains("'sliding_window'"));
  CHECK_THROWS_WITH(parse_config(with(kMiniMax, R"("block_size": 16)", R"("block_size": 16, "postnorm": false)")),
                    Catch::Contains("'postnorm'"));
  CHECK_THROWS_WITH(parse_config(with(kMiniMax, R"("num_key_value_heads": 2)", R"("num_key_value_heads": 3)")),
                    Catch::Contains("'num_attention_heads'"));
  CHECK_THROWS_WITH(parse_config(with(kMiniMax, R"("mlp_beta_factor": 0.9)", R"("mlp_beta_factor": "x")")),
                    Catch::Contains("'mlp_beta_factor'"));
}

TEST_CASE("Ring-linear config", "[families][config]") {
  const ModelConfig c = parse_config(kRing);
  CHECK(c.family == ModelFamily::RingLinear);
  CHECK(c.layer_types == std::vector<LayerType>{L, L, F, L, L, F});
  CHECK(c.rotary_dim() == 8);
  CHECK(c.linear_rope);
  CHECK(c.use_qk_norm);
  CHECK(c.group_norm_size == 2);
  CHECK(c.conv_rows() == 0);
  CHECK_FALSE(c.is_moe_layer(0));
  CHECK(c.is_moe_layer(1));
  CHECK(c.shared_expert_intermediate_size == 12);
  CHECK(c.router_bias);
  CHECK(parse_config(config_to_json(c)).fingerprint() == c.fingerprint());
  // layer_group_size: layers past the last whole group are softmax too.
  const ModelConfig g4 = parse_config(with(kRing, R"("layer_group_size": 3)", R"("layer_group_size": 4)"));
  CHECK(g4.layer_types == std::vector<LayerType>{L, L, L, F, F, F});
  CHECK_THROWS_WITH(parse_config(with(kRing, R"("group_norm_size": 2)", R"("group_norm_size": 5)")),
                    Catch::Contains("'group_norm_size'") && Catch::Contains("5 must divide num_attention_heads"));
  CHECK_THROWS_WITH(parse_config(with(kRing, R"("score_function": "sigmoid")", R"("score_function": "softmax")")),
                    Catch::Contains("'score_function'"));
  CHECK_THROWS_WITH(parse_config(with(kRing, R"("use_qk_norm": true)", R"("use_qk_norm": true, "use_qkv_bias": true)")),
                    Catch::Contains("'use_qkv_bias'"));
}

TEST_CASE("fingerprints: Qwen digests unchanged, new family fields covered", "[families][config]") {
  // Values computed by the code before the families were added (hypic-model info on the fixture checkpoints).
  const fs::path fx = fs::path(HYPIC_SOURCE_DIR) / "tests" / "fixtures";
  CHECK(load_config(fx / "qwen3_next_moe").fingerprint() == "add8a00278177315622ad29f9a84dfd3");
  CHECK(load_config(fx / "qwen3_5_dense").fingerprint() == "64d75f04f8299d32e2e0f3afdb6882ef");
  CHECK(load_config(fx / "qwen3_5_moe").fingerprint() == "2ec38272ffbc3f7683fc371b1d26e374");
  const ModelConfig k = parse_config(kKimiReleased);
  const std::string fp = k.fingerprint();
  auto differs = [&](auto edit) {
    ModelConfig d = k;
    edit(d);
    return d.fingerprint() != fp;
  };
  CHECK(differs([](ModelConfig& d) { d.kv_lora_rank += 1; }));
  CHECK(differs([](ModelConfig& d) { d.v_head_dim += 1; }));
  CHECK(differs([](ModelConfig& d) { d.qk_rope_head_dim += 1; }));
  CHECK(differs([](ModelConfig& d) { d.q_lora_rank = 4; }));
  CHECK(differs([](ModelConfig& d) { d.routed_scaling_factor = 2.0; }));
  CHECK(differs([](ModelConfig& d) { d.n_group = 4; }));
  CHECK(differs([](ModelConfig& d) { d.topk_group = 2; }));
  CHECK(differs([](ModelConfig& d) { d.router_bias = false; }));
  CHECK(differs([](ModelConfig& d) { d.shared_expert_gated = true; }));
  CHECK(differs([](ModelConfig& d) { d.linear_norm_eps = 1e-3; }));
  const ModelConfig m = parse_config(kMiniMax);
  auto mdiff = [&](auto edit) {
    ModelConfig d = m;
    edit(d);
    return d.fingerprint() != m.fingerprint();
  };
  CHECK(mdiff([](ModelConfig& d) { d.lightning_block_size = 32; }));
  CHECK(mdiff([](ModelConfig& d) { d.full_attn_alpha = 1.0; }));
  CHECK(mdiff([](ModelConfig& d) { d.full_attn_beta = 1.0; }));
  CHECK(mdiff([](ModelConfig& d) { d.linear_attn_alpha = 1.0; }));
  CHECK(mdiff([](ModelConfig& d) { d.linear_attn_beta = 1.0; }));
  CHECK(mdiff([](ModelConfig& d) { d.mlp_alpha = 1.0; }));
  CHECK(mdiff([](ModelConfig& d) { d.mlp_beta = 1.0; }));
  CHECK(mdiff([](ModelConfig& d) { d.group_norm_size = 2; }));
  CHECK(mdiff([](ModelConfig& d) { d.linear_rope = true; }));
  CHECK(mdiff([](ModelConfig& d) { d.linear_qkv_silu = false; }));
  CHECK(mdiff([](ModelConfig& d) { d.use_qk_norm = true; }));
  CHECK(mdiff([](ModelConfig& d) { d.family = ModelFamily::RingLinear; }));
}

// ---------------------------------------------------------------------------------------------------------------
// Kernels against the token-level recurrences (engine/families/linear_families.h)
// ---------------------------------------------------------------------------------------------------------------

TEST_CASE("KDA kernels: chunked == recurrent == the KDA family recurrence, T_C included", "[families][kda]") {
  const int T = 150, H = 2, dk = 16, dv = 12;
  std::mt19937 rng(5);
  auto q = randn(size_t(T) * H * dk, rng), k = randn(q.size(), rng), v = randn(size_t(T) * H * dv, rng);
  auto normalise = [&](std::vector<float>& x) {
    for (int r = 0; r < T * H; ++r) {
      double s = 0;
      for (int d = 0; d < dk; ++d) s += double(x[size_t(r) * dk + d]) * x[size_t(r) * dk + d];
      for (int d = 0; d < dk; ++d) x[size_t(r) * dk + d] = float(x[size_t(r) * dk + d] / std::sqrt(s));
    }
  };
  normalise(q);
  normalise(k);
  std::uniform_real_distribution<float> ug(-0.4f, 0.0f), ub(0.05f, 0.95f);
  std::vector<float> g(size_t(T) * H * dk), beta(size_t(T) * H);
  for (auto& x : g) x = ug(rng);
  for (auto& x : beta) x = ub(rng);
  const cpu::KdaShape shape{T, H, dk, dv};
  const cpu::KdaInputs in{q.data(), k.data(), v.data(), g.data(), beta.data()};
  const auto s0 = randn(size_t(H) * dk * dv, rng);
  for (int chunk : {64, 16, 7}) {
    INFO("chunk " << chunk);
    std::vector<float> sc = s0, sr = s0, oc(size_t(T) * H * dv), orr(oc.size()), tc(size_t(H) * dk * dk),
                       tr(tc.size());
    cpu::kda_chunked(shape, in, sc.data(), oc.data(), tc.data(), chunk);
    cpu::kda_recurrent(shape, in, sr.data(), orr.data(), tr.data());
    CHECK(rel_err(oc, orr) < kTol);
    CHECK(rel_err(sc, sr) < kTol);
    CHECK(rel_err(tc, tr) < kTol);
  }
  // The family-level summary (T_C as the plain product of per-token matrices, S(C|0)).
  std::vector<float> decay(g.size());
  for (size_t i = 0; i < g.size(); ++i) decay[i] = std::exp(g[i]);
  const FamilySpan span{T, H, dk, dv, k, v, decay, beta};
  const SegmentSummary sum = summarize_family_segment(LinearFamily::KDA, span);
  std::vector<float> from_zero(size_t(H) * dk * dv, 0.0f), tc(size_t(H) * dk * dk);
  cpu::kda_chunked(shape, in, from_zero.data(), nullptr, tc.data(), 64);
  CHECK(rel_err(from_zero, sum.state) < kTol);
  CHECK(rel_err(tc, sum.transition.to_dense()) < kTol);
  // Composition: S(s0) = T_C s0 + S(C|0).
  std::vector<float> sc = s0;
  cpu::kda_chunked(shape, in, sc.data(), nullptr, nullptr, 64);
  std::vector<float> composed = s0;
  compose_state(composed, TransitionOperator::dense(H, dk, tc), from_zero, dv);
  CHECK(rel_err(composed, sc) < kTol);
}

TEST_CASE("lightning kernels: block-wise == recurrent == the scalar-decay family recurrence", "[families][lightning]") {
  const int T = 83, H = 3, d = 8;
  std::mt19937 rng(6);
  const auto q = randn(size_t(T) * H * d, rng, 0.5f), k = randn(q.size(), rng, 0.5f), v = randn(q.size(), rng);
  const std::vector<float> slope = {0.9f, 0.1f, 0.004f};
  const cpu::LightningShape shape{T, H, d, d};
  const auto s0 = randn(size_t(H) * d * d, rng);
  std::vector<float> sr = s0, orr(q.size()), tr(H);
  cpu::lightning_recurrent(shape, q.data(), k.data(), v.data(), slope.data(), sr.data(), orr.data(), tr.data());
  for (int block : {256, 16, 5, 1}) {
    INFO("block " << block);
    std::vector<float> sc = s0, oc(q.size()), tc(H);
    cpu::lightning_chunked(shape, q.data(), k.data(), v.data(), slope.data(), sc.data(), oc.data(), tc.data(), block);
    CHECK(rel_err(oc, orr) < kTol);
    CHECK(rel_err(sc, sr) < kTol);
    for (int h = 0; h < H; ++h) CHECK(tc[h] == Approx(std::exp(-double(slope[h]) * T)).epsilon(1e-5));
  }
  std::vector<float> decay(size_t(T) * H);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) decay[size_t(t) * H + h] = std::exp(-slope[h]);
  const FamilySpan span{T, H, d, d, k, v, decay, {}};
  const SegmentSummary sum = summarize_family_segment(LinearFamily::ScalarDecay, span);
  std::vector<float> zero(size_t(H) * d * d, 0.0f), tc(H);
  cpu::lightning_chunked(shape, q.data(), k.data(), v.data(), slope.data(), zero.data(), nullptr, tc.data(), 16);
  CHECK(rel_err(zero, sum.state) < kTol);
  CHECK(rel_err(tc, sum.transition.data) < kTol);
  std::vector<float> composed = s0;
  compose_state(composed, TransitionOperator{TransitionKind::Scalar, H, d, tc}, zero, d);
  CHECK(rel_err(composed, sr) < kTol);
}

TEST_CASE("lightning slope rates follow MiniMax's get_slope_rate and Ring's ALiBi slopes", "[families][lightning]") {
  const ModelConfig m = parse_config(kMiniMax);
  const auto s = lightning_slope_rates(m, 2);
  REQUIRE(s.size() == 4);
  const double base = 1.0 / std::pow(2.0, 8.0 / 4), factor = 1.0 - 2.0 / (5.0 + 1e-5) + 1e-5;
  for (int h = 0; h < 4; ++h) CHECK(s[size_t(h)] == Approx(std::pow(base, h + 1) * factor).epsilon(1e-6));
  const ModelConfig r = parse_config(kRing);
  const auto sr = lightning_slope_rates(r, 0);  // layer 0: factor 1 + 1/(L-1) + 1e-5
  for (int h = 0; h < 4; ++h)
    CHECK(sr[size_t(h)] == Approx(std::pow(std::pow(2.0, -2.0), h + 1) * (1.0 + 1.0 / 5.0 + 1e-5)).epsilon(1e-6));
  ModelConfig r6 = r;
  r6.num_attention_heads = 6;  // not a power of two: slopes of 4, then every other slope of 8
  const auto s6 = lightning_slope_rates(r6, 1);
  const double f1 = 1.0 + 1e-5;
  CHECK(s6[3] == Approx(std::pow(0.25, 4) * f1).epsilon(1e-6));
  CHECK(s6[4] == Approx(std::pow(0.5, 1) * f1).epsilon(1e-6));
  CHECK(s6[5] == Approx(std::pow(0.5, 3) * f1).epsilon(1e-6));
  CHECK_THROWS_AS(lightning_slope_rates(parse_config(kKimiReleased), 0), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------------------------
// Random models through the Model interface
// ---------------------------------------------------------------------------------------------------------------

namespace {

void check_forward_identities(const Model& m, const std::string& what) {
  INFO(what);
  const ModelConfig& c = m.config();
  const int V = int(c.vocab_size);
  const int T = 70;
  const auto ids = random_ids(T, V, 11);
  // Chunked prefill == token-by-token decode (logits and every state).
  ModelState sp = m.initial_state();
  const auto pre = m.prefill(sp, ids, 0, {.all_logits = true});
  REQUIRE(pre.logits.size() == size_t(T) * V);
  CHECK(max_abs(pre.logits) > 0.1);
  ModelState sd = m.initial_state();
  double worst = 0;
  for (int t = 0; t < T; ++t) {
    const auto lg = m.decode(sd, ids[size_t(t)], t);
    const std::vector<float> row(pre.logits.begin() + size_t(t) * V, pre.logits.begin() + size_t(t + 1) * V);
    worst = std::max(worst, rel_err(lg, row));
  }
  CHECK(worst < kTol);
  check_states_close(sp, sd, kTol);
  // One span == two spans (at several splits, crossing chunk and block boundaries).
  for (int split : {1, 17, 64}) {
    INFO("split " << split);
    ModelState two = m.initial_state();
    m.prefill(two, std::span(ids).first(size_t(split)), 0);
    const auto r2 = m.prefill(two, std::span(ids).subspan(size_t(split)), split);
    const std::vector<float> last(pre.logits.end() - V, pre.logits.end());
    CHECK(rel_err(r2.logits, last) < kTol);
    check_states_close(two, sp, kTol);
  }
  // The first layer is linear: its captured span transition composes from any start state.
  REQUIRE(c.layer_types[0] == LayerType::Linear);
  ModelState from_s0 = m.initial_state(), from_zero = m.initial_state();
  std::mt19937 rng(3);
  for (auto& x : from_s0.linear[0].ssm) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  const auto s0 = from_s0.linear[0].ssm;
  const auto res = m.prefill(from_s0, ids, 0, {.capture_transitions = true});
  m.prefill(from_zero, ids, 0);
  REQUIRE(res.transitions.size() == size_t(c.num_linear_layers()));
  const bool scalar = c.family == ModelFamily::MiniMax || c.family == ModelFamily::RingLinear;
  CHECK(res.transition_kind == (scalar ? TransitionKind::Scalar : TransitionKind::Dense));
  const int nv = c.linear_num_value_heads, dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  for (const auto& t : res.transitions) CHECK(t.size() == (scalar ? size_t(nv) : size_t(nv) * dk * dk));
  const TransitionOperator op{res.transition_kind, nv, dk, res.transitions[0]};
  std::vector<float> composed = s0;
  compose_state(composed, op, from_zero.linear[0].ssm, dv);
  CHECK(rel_err(from_s0.linear[0].ssm, composed) < kTol);
}

}  // namespace

TEST_CASE("Kimi-Linear random model: prefill == decode, spans, T_C composition, no positions", "[families][model]") {
  const Model m = random_model(parse_config(kKimiReleased), "kimi");
  check_forward_identities(m, "kimi_linear");
  // MLA has no RoPE and KDA no positions: the same tokens at another position give the same numbers exactly.
  const auto ids = random_ids(40, 97, 12);
  ModelState a = m.initial_state(), b = m.initial_state();
  const auto ra = m.prefill(a, ids, 0, {.all_logits = true});
  const auto rb = m.prefill(b, ids, 12345, {.all_logits = true});
  CHECK(ra.logits == rb.logits);
  CHECK(a.attention[0].k == b.attention[0].k);
  // The KV cache holds MLA's latent: one row [kv_lora_rank normed c_kv | qk_rope k_rot] per token, no V.
  const auto& c = m.config();
  const size_t row = size_t(c.kv_lora_rank) + c.qk_rope_head_dim;
  for (const auto& at : a.attention) {
    CHECK(at.n_tokens == 40);
    CHECK(at.k.size() == size_t(40) * row);
    CHECK(at.v.empty());
  }
  CHECK_THROWS_WITH(m.rope_rotate(a.attention[0].k.data(), 40, 1, 5), Catch::Contains("no RoPE"));
  // With a q LoRA.
  const Model lora = random_model(parse_config(with(kKimiReleased, R"("q_lora_rank": null)", R"("q_lora_rank": 10)")),
                                  "kimi_lora");
  check_forward_identities(lora, "kimi_linear q_lora_rank 10");
}

namespace {

// MLA (KimiLinearAttention, eager) computed directly in double from the weights, for the span x [T][H] after
// `cached` latent rows: the span's latent rows [R normed c_kv | k_rot] (appended to `cached`) and the layer output
// [T][H], expanding every cached row through kv_b_proj.
std::vector<double> mla_reference(const ModelConfig& c, const MlaWeights& w, const std::vector<float>& x, int64_t T,
                                  std::vector<double>& cached) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim,
                vd = c.v_head_dim, qk = nope + rope, R = c.kv_lora_rank, row = R + rope, Q = c.q_lora_rank;
  auto matvec = [](const std::vector<float>& W, int64_t out, int64_t in, const double* v) {
    std::vector<double> y(size_t(out), 0.0);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) y[size_t(o)] += double(W[size_t(o * in + i)]) * v[i];
    return y;
  };
  auto rms = [](std::vector<double>& v, int64_t n, const std::vector<float>& wt) {
    double ms = 0;
    for (int64_t i = 0; i < n; ++i) ms += v[size_t(i)] * v[size_t(i)];
    const double inv = 1.0 / std::sqrt(ms / double(n) + 1e-6);  // KimiLinearRMSNorm's default eps
    for (int64_t i = 0; i < n; ++i) v[size_t(i)] = double(wt[size_t(i)]) * (v[size_t(i)] * inv);
  };
  const int64_t before = int64_t(cached.size()) / row;
  std::vector<std::vector<double>> q(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> xt(x.begin() + t * H, x.begin() + (t + 1) * H);
    if (Q > 0) {
      std::vector<double> qa = matvec(w.q_a_proj.data, Q, H, xt.data());
      rms(qa, Q, w.q_a_layernorm.data);
      q[size_t(t)] = matvec(w.q_b_proj.data, nh * qk, Q, qa.data());
    } else {
      q[size_t(t)] = matvec(w.q_proj.data, nh * qk, H, xt.data());
    }
    std::vector<double> ckv = matvec(w.kv_a_proj.data, row, H, xt.data());
    rms(ckv, R, w.kv_a_layernorm.data);  // the first R values only; k_rot stays raw
    cached.insert(cached.end(), ckv.begin(), ckv.end());
  }
  const int64_t n = before + T;
  std::vector<std::vector<double>> kvb(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) kvb[size_t(s)] = matvec(w.kv_b_proj.data, nh * (nope + vd), R, &cached[size_t(s * row)]);
  std::vector<double> out(size_t(T * H), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> attn(size_t(nh * vd), 0.0);
    for (int64_t h = 0; h < nh; ++h) {
      const double* qh = &q[size_t(t)][size_t(h * qk)];
      std::vector<double> sc(size_t(before + t + 1));
      double mx = -1e300;
      for (int64_t s = 0; s <= before + t; ++s) {
        const double* kn = &kvb[size_t(s)][size_t(h * (nope + vd))];  // k_nope of head h
        const double* kr = &cached[size_t(s * row + R)];             // the shared k_rot
        double d = 0;
        for (int64_t e = 0; e < nope; ++e) d += qh[e] * kn[e];
        for (int64_t e = 0; e < rope; ++e) d += qh[nope + e] * kr[e];
        sc[size_t(s)] = d / std::sqrt(double(qk));
        mx = std::max(mx, sc[size_t(s)]);
      }
      double z = 0;
      for (auto& v : sc) z += (v = std::exp(v - mx));
      for (int64_t s = 0; s <= before + t; ++s)
        for (int64_t e = 0; e < vd; ++e)
          attn[size_t(h * vd + e)] += sc[size_t(s)] / z * kvb[size_t(s)][size_t(h * (nope + vd) + nope + e)];
    }
    const std::vector<double> o = matvec(w.o_proj.data, H, nh * vd, attn.data());
    std::copy(o.begin(), o.end(), out.begin() + t * H);
  }
  return out;
}

std::vector<float> to_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

}  // namespace

TEST_CASE("Kimi-Linear MLA caches its latent: rows and attention equal a direct computation from the weights",
          "[families][model]") {
  for (const char* q_lora : {"null", "10"}) {
    INFO("q_lora_rank " << q_lora);
    const Model m = random_model(
        parse_config(with(kKimiReleased, R"("q_lora_rank": null)", std::string(R"("q_lora_rank": )") + q_lora)),
        std::string("kimi_latent_") + (q_lora[0] == 'n' ? "plain" : "lora"));
    const ModelConfig& c = m.config();
    REQUIRE(c.layer_types[2] == F);
    const MlaWeights& w = m.weights().layers[2].mla;
    const int64_t H = c.hidden_size, row = c.kv_lora_rank + c.qk_rope_head_dim;
    std::mt19937 rng(31);
    AttentionLayerState st;
    std::vector<double> cached;
    // A prefill of 6 tokens, a span of 3, then a single token: each call expands every row cached so far.
    for (const int64_t T : {6, 3, 1}) {
      INFO("span of " << T << " after " << st.n_tokens);
      const std::vector<float> x = randn(size_t(T * H), rng);
      std::vector<float> out(size_t(T * H));
      families::kimi_linear::mla_layer(c, w, st, x.data(), T, out.data());
      const std::vector<double> want = mla_reference(c, w, x, T, cached);
      REQUIRE(st.n_tokens == int64_t(cached.size()) / row);
      REQUIRE(st.k.size() == cached.size());  // [n][1][R + rope]
      CHECK(st.v.empty());
      // The first R columns are the normed c_kv, the last rope kv_a_proj's raw k_rot (not normed with it).
      CHECK(rel_err(st.k, to_float(cached)) < 1e-5);
      CHECK(rel_err(out, to_float(want)) < 1e-5);
    }
    // The same through the model: every attention layer's state is the latent of its layer input, no V, and a state
    // of the wrong layout (expanded K/V as earlier builds kept it) is refused.
    ModelState s = m.initial_state();
    m.prefill(s, random_ids(9, int(c.vocab_size), 4), 0);
    for (const auto& a : s.attention) {
      CHECK(a.k.size() == size_t(9 * row));
      CHECK(a.v.empty());
    }
    ModelState expanded = m.initial_state();
    expanded.attention[0].n_tokens = 1;
    expanded.attention[0].k.resize(size_t(c.num_key_value_heads) * c.head_dim);
    expanded.attention[0].v.resize(size_t(c.num_key_value_heads) * c.v_head_dim);
    CHECK_THROWS_WITH(m.decode(expanded, 1, 1), Catch::Contains("attention layer state 0"));
    AttentionLayerState bad;
    bad.n_tokens = 1;
    bad.k.resize(size_t(row));
    bad.v.resize(1);
    std::vector<float> x1(static_cast<size_t>(H), 0.5f), o1(static_cast<size_t>(H));
    CHECK_THROWS_WITH(families::kimi_linear::mla_layer(c, w, bad, x1.data(), 1, o1.data()),
                      Catch::Contains("no V"));
  }
}

TEST_CASE("MiniMax random model: prefill == decode, spans, scalar T_C, RoPE shift", "[families][model]") {
  // Layer 0 linear for the composition check: L F L L F L.
  const std::string cfg = with(kMiniMax, R"(["full_attention", "linear_attention", "linear_attention",)",
                               R"(["linear_attention", "full_attention", "linear_attention",)");
  const Model m = random_model(parse_config(cfg), "minimax");
  check_forward_identities(m, "minimax");
  const auto ids = random_ids(30, 97, 13);
  ModelState a = m.initial_state(), b = m.initial_state();
  const auto ra = m.prefill(a, ids, 0);
  const auto rb = m.prefill(b, ids, 500);
  CHECK(rel_err(rb.logits, ra.logits) < kTol);
  std::vector<float> k = a.attention[0].k;
  m.rope_rotate(k.data(), 30, m.config().num_key_value_heads, 500);
  CHECK(rel_err(k, b.attention[0].k) < kTol);
  CHECK(a.linear[0].conv.empty());
}

TEST_CASE("Ring-linear random model: prefill == decode, spans, scalar T_C", "[families][model]") {
  const Model m = random_model(parse_config(kRing), "ring");
  check_forward_identities(m, "bailing_moe_linear");
  // RoPE inside the linear layers: a shifted start changes the linear state, but not the logits much... the
  // attention is relative, the linear layers are not: the state differs.
  const auto ids = random_ids(30, 97, 14);
  ModelState a = m.initial_state(), b = m.initial_state();
  m.prefill(a, ids, 0);
  m.prefill(b, ids, 100);
  CHECK(rel_err(a.linear[0].ssm, b.linear[0].ssm) > 1e-3);
}

// ---------------------------------------------------------------------------------------------------------------
// Checkpoint names: every accepted spelling loads to the same weights
// ---------------------------------------------------------------------------------------------------------------

namespace {

/// Copies checkpoint `from` into `to`, renaming / merging tensors through `edit` (name -> list of (name, tensor)).
using Renamer = std::function<void(const std::string& name, const std::vector<int64_t>& shape,
                                   const std::vector<float>& data, SafetensorsWriter& out)>;

void rewrite_checkpoint(const fs::path& from, const fs::path& to, const Renamer& edit) {
  fs::create_directories(to);
  fs::copy_file(from / "config.json", to / "config.json", fs::copy_options::overwrite_existing);
  const SafetensorsFile f = SafetensorsFile::open(from / "model.safetensors");
  SafetensorsWriter w;
  for (const auto& info : f.tensors()) edit(info.name, info.shape, f.read_f32(info), w);
  w.write(to / "model.safetensors");
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

TEST_CASE("Kimi-Linear checkpoints: save_pretrained and released names load the same weights", "[families][weights]") {
  const ModelConfig cfg = parse_config(kKimiReleased);
  const fs::path base = temp_dir("kimi_names");
  write_random_checkpoint(cfg, 9, base / "released", DType::F32, 0.1);
  const Model a = Model::load(base / "released");
  // transformers' load-time form: packed conv1d, forget_gate.* names, A_log [nh], mlp. prefix, fused experts.
  const int64_t hd = 2 * 16, K = 4, E = 8, I = 20, H = 48;
  std::map<std::string, std::vector<float>> convs, experts;
  rewrite_checkpoint(base / "released", base / "hf", [&](const std::string& n, const std::vector<int64_t>& shape,
                                                         const std::vector<float>& data, SafetensorsWriter& out) {
    std::string name = n;
    for (const char* g : {"f_a_proj", "f_b_proj", "dt_bias", "A_log"})
      if (name.find(std::string("self_attn.") + g) != std::string::npos)
        name.replace(name.find("self_attn."), 10, "self_attn.forget_gate.");
    if (name.find("block_sparse_moe.") != std::string::npos) name.replace(name.find("block_sparse_moe."), 17, "mlp.");
    if (ends_with(name, "A_log")) {
      out.add_f32(name, {shape[2]}, data);
      return;
    }
    for (const char* part : {"q_conv1d", "k_conv1d", "v_conv1d"})
      if (name.find(part) != std::string::npos) {
        const std::string layer = name.substr(0, name.find(part));
        convs[layer + part] = data;
        if (std::string(part) == "v_conv1d") {
          std::vector<float> packed;
          for (const char* p2 : {"q_conv1d", "k_conv1d", "v_conv1d"})
            packed.insert(packed.end(), convs[layer + p2].begin(), convs[layer + p2].end());
          out.add_f32(layer + "conv1d.weight", {3 * hd, 1, K}, packed);
        }
        return;
      }
    if (name.find(".experts.") != std::string::npos) {
      experts[name] = data;
      const std::string layer = name.substr(0, name.find(".experts.") + 1);
      if (ends_with(name, "experts." + std::to_string(E - 1) + ".w3.weight")) {
        std::vector<float> gu, down;
        for (int e = 0; e < E; ++e) {
          const std::string x = layer + "experts." + std::to_string(e) + ".";
          gu.insert(gu.end(), experts[x + "w1.weight"].begin(), experts[x + "w1.weight"].end());
          gu.insert(gu.end(), experts[x + "w3.weight"].begin(), experts[x + "w3.weight"].end());
          down.insert(down.end(), experts[x + "w2.weight"].begin(), experts[x + "w2.weight"].end());
        }
        out.add_f32(layer + "experts.gate_up_proj", {E, 2 * I, H}, gu);
        out.add_f32(layer + "experts.down_proj", {E, H, I}, down);
      }
      return;
    }
    out.add_f32(name, shape, data);
  });
  const Model b = Model::load(base / "hf");
  for (size_t i = 0; i < a.weights().layers.size(); ++i) {
    INFO("layer " << i);
    const auto& la = a.weights().layers[i];
    const auto& lb = b.weights().layers[i];
    CHECK(la.kda.conv1d.data == lb.kda.conv1d.data);
    CHECK(la.kda.A_log.data == lb.kda.A_log.data);
    CHECK(la.kda.f_b_proj.data == lb.kda.f_b_proj.data);
    CHECK(la.moe.experts_gate_up.data == lb.moe.experts_gate_up.data);
    CHECK(la.moe.experts_down.data == lb.moe.experts_down.data);
    CHECK(la.moe.router_bias.data == lb.moe.router_bias.data);
    CHECK(la.mlp.gate_proj.data == lb.mlp.gate_proj.data);
  }
  const auto ids = random_ids(20, 97, 15);
  ModelState sa = a.initial_state(), sb = b.initial_state();
  CHECK(a.prefill(sa, ids, 0).logits == b.prefill(sb, ids, 0).logits);
  // A mis-shaped tensor is named.
  rewrite_checkpoint(base / "released", base / "bad", [&](const std::string& n, const std::vector<int64_t>& shape,
                                                          const std::vector<float>& data, SafetensorsWriter& out) {
    if (n == "model.layers.2.self_attn.kv_b_proj.weight") {
      out.add_f32(n, {shape[0] - 1, shape[1]}, std::vector<float>(data.begin(), data.end() - shape[1]));
      return;
    }
    out.add_f32(n, shape, data);
  });
  CHECK_THROWS_WITH(Model::load(base / "bad"), Catch::Contains("model.layers.2.self_attn.kv_b_proj.weight"));
  fs::remove_all(base);
}

TEST_CASE("MiniMax checkpoints: per-head qkv regrouped, slope_rate used when present", "[families][weights]") {
  const ModelConfig cfg = parse_config(kMiniMax);
  const fs::path base = temp_dir("minimax_names");
  write_random_checkpoint(cfg, 10, base / "a", DType::F32, 0.1);
  const Model a = Model::load(base / "a");
  const auto& lw = a.weights().layers[1];
  CHECK(lw.lightning.slope.data == lightning_slope_rates(cfg, 1));
  // The regrouped qkv: row block [K all heads] of head 1 = rows (1*3 + 1)*d.. of the checkpoint.
  const SafetensorsFile f = SafetensorsFile::open(base / "a" / "model.safetensors");
  const auto raw = f.read_f32(f.at("model.layers.1.self_attn.qkv_proj.weight"));
  const int64_t d = 12, nh = 4, H = 48;
  for (int64_t j = 0; j < d * H; ++j)
    CHECK(lw.lightning.qkv_proj.data[size_t((nh * d + d) * H + j)] == raw[size_t((4 * d) * H + j)]);
  // A slope_rate buffer in the checkpoint (and the other buffers) is used / ignored as HF does; fused experts and
  // the mlp. prefix load too.
  rewrite_checkpoint(base / "a", base / "b", [&](const std::string& n, const std::vector<int64_t>& shape,
                                                 const std::vector<float>& data, SafetensorsWriter& out) {
    std::string name = n;
    if (name.find("block_sparse_moe.") != std::string::npos) name.replace(name.find("block_sparse_moe."), 17, "mlp.");
    if (ends_with(name, "experts.0.w1.weight")) {
      const std::string layer = name.substr(0, name.find("experts."));
      out.add_f32(layer + "experts.0.gate_proj.weight", shape, data);
      return;
    }
    if (ends_with(name, "experts.0.w3.weight")) {
      out.add_f32(name.substr(0, name.find("w3.weight")) + "up_proj.weight", shape, data);
      return;
    }
    if (ends_with(name, "experts.0.w2.weight")) {
      out.add_f32(name.substr(0, name.find("w2.weight")) + "down_proj.weight", shape, data);
      return;
    }
    out.add_f32(name, shape, data);
    if (ends_with(name, "self_attn.out_proj.weight")) {
      const std::string p = name.substr(0, name.find("out_proj.weight"));
      out.add_f32(p + "slope_rate", {nh, 1, 1}, std::vector<float>{0.5f, 0.25f, 0.125f, 0.0625f});
      out.add_f32(p + "query_decay", {nh, 16, 1}, std::vector<float>(size_t(nh) * 16, 0.0f));
    }
  });
  // Mixing expert spellings within a layer is refused (expert 0 renamed only): the loader names the tensor.
  CHECK_THROWS_WITH(Model::load(base / "b"), Catch::Contains("experts.1.gate_proj.weight"));
  fs::remove_all(base / "b");
  rewrite_checkpoint(base / "a", base / "b", [&](const std::string& n, const std::vector<int64_t>& shape,
                                                 const std::vector<float>& data, SafetensorsWriter& out) {
    std::string name = n;
    if (name.find("block_sparse_moe.") != std::string::npos) name.replace(name.find("block_sparse_moe."), 17, "mlp.");
    out.add_f32(name, shape, data);
    if (ends_with(name, "self_attn.out_proj.weight")) {
      const std::string p = name.substr(0, name.find("out_proj.weight"));
      out.add_f32(p + "slope_rate", {nh, 1, 1}, std::vector<float>{0.5f, 0.25f, 0.125f, 0.0625f});
      out.add_f32(p + "diagonal_decay", {1, 1, 16, 16}, std::vector<float>(256, 0.0f));
    }
  });
  const Model b = Model::load(base / "b");
  CHECK(b.weights().layers[1].lightning.slope.data == std::vector<float>{0.5f, 0.25f, 0.125f, 0.0625f});
  CHECK(b.weights().layers[1].moe.experts_gate_up.data == lw.moe.experts_gate_up.data);
  fs::remove_all(base);
}

TEST_CASE("the CPU model refuses family weights that do not match the config", "[families][errors]") {
  const Model m = random_model(parse_config(kKimiReleased), "kimi_err");
  ModelWeights w = m.weights();
  w.layers[0].kda.g_b_proj.shape = {31, 16};
  CHECK_THROWS_WITH(Model(m.config(), w), Catch::Contains("layers.0.self_attn.g_b_proj"));
  w = m.weights();
  w.layers[1].moe.router_bias.data.pop_back();
  CHECK_THROWS_WITH(Model(m.config(), w), Catch::Contains("e_score_correction_bias"));
  ModelState s = m.initial_state();
  s.attention[0].v.resize(3);
  s.attention[0].n_tokens = 1;
  s.attention[0].k.resize(size_t(m.config().kv_cache_heads()) * m.config().kv_cache_k_dim());  // V must be empty
  CHECK_THROWS_WITH(m.decode(s, 1, 0), Catch::Contains("attention layer state 0"));
}

// ---------------------------------------------------------------------------------------------------------------
// HF transformers 5.17 / Ring reference fixtures (skipped when absent)
// ---------------------------------------------------------------------------------------------------------------

namespace {

constexpr double kHfTol = 2e-5;

/// Fixture folders under tests/fixtures (and under $HYPIC_FAMILY_FIXTURES when set, e.g. fixtures made locally
/// with tools/ring_linear_reference.py) whose config.json has one of the new families' model_type.
std::vector<fs::path> family_fixtures() {
  std::vector<fs::path> out;
  std::vector<fs::path> roots = {fs::path(HYPIC_SOURCE_DIR) / "tests" / "fixtures"};
  if (const char* extra = std::getenv("HYPIC_FAMILY_FIXTURES")) roots.emplace_back(extra);
  for (const auto& root : roots) {
  if (!fs::is_directory(root)) continue;
  for (const auto& e : fs::directory_iterator(root)) {
    if (!e.is_directory() || !fs::exists(e.path() / "config.json") || !fs::exists(e.path() / "reference.safetensors"))
      continue;
    try {
      const ModelConfig c = load_config(e.path() / "config.json");
      if (c.family != ModelFamily::Qwen) out.push_back(e.path());
    } catch (const std::exception& err) {
      FAIL("fixture " << e.path().string() << ": " << err.what());
    }
  }
  }
  std::sort(out.begin(), out.end());
  return out;
}

int argmax(const float* x, int64_t n) { return int(std::max_element(x, x + n) - x); }

void check_family_fixture(const fs::path& dir) {
  const std::string name = dir.filename().string();
  INFO("fixture " << name);
  const Model m = Model::load(dir);
  const auto& c = m.config();
  hypic::testing::ReferenceRun run = hypic::testing::run_reference(m, dir / "reference.safetensors", kHfTol);
  auto& [ref, ids, T, V, st, res, logits_rel] = run;
  // Final recurrent states (our layout [H][d_k][d_v]) and, where the reference holds one, the conv cache
  // ([C][K] channel-major, the last K inputs; ours [K-1][C]).
  double state_rel = 0, conv_rel = 0;
  int compared = 0;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    if (c.layer_types[size_t(i)] != LayerType::Linear) continue;
    const std::string p = "layers." + std::to_string(i) + ".";
    const auto& ls = st.linear[size_t(c.linear_index(i))];
    if (const TensorInfo* t = ref.find(p + "recurrent_state")) {
      const double r = rel_err(ls.ssm, ref.read_f32(*t));
      CHECK(r <= kHfTol);
      state_rel = std::max(state_rel, r);
      ++compared;
    }
    if (const TensorInfo* t = ref.find(p + "conv_state"); t && c.conv_rows() > 0) {
      const auto hf = ref.read_f32(*t);
      const int64_t C = c.conv_dim(), K = int64_t(hf.size()) / C;
      REQUIRE(K >= c.conv_rows());
      std::vector<float> conv(size_t(c.conv_rows()) * C);
      for (int r = 0; r < c.conv_rows(); ++r)
        for (int64_t ch = 0; ch < C; ++ch) conv[size_t(r) * C + ch] = hf[size_t(ch * K + K - c.conv_rows() + r)];
      const double r = rel_err(ls.conv, conv);
      CHECK(r <= kHfTol);
      conv_rel = std::max(conv_rel, r);
    }
  }
  if (compared == 0) WARN(name << ": reference.safetensors holds no recurrent_state tensors; states not compared");
  // Lightning decay rates: MiniMax `slope_rate` [H] (decay e^{-s}), Ring `log_decay` [H] (= -s).
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    if (c.layer_types[size_t(i)] != LayerType::Linear) continue;
    const std::string p = "layers." + std::to_string(i) + ".";
    const auto& slope = m.weights().layers[size_t(i)].lightning.slope.data;
    if (const TensorInfo* t = ref.find(p + "slope_rate")) CHECK(rel_err(slope, ref.read_f32(*t)) <= 1e-6);
    if (const TensorInfo* t = ref.find(p + "log_decay")) {
      std::vector<float> neg = ref.read_f32(*t);
      for (auto& x : neg) x = -x;
      CHECK(rel_err(slope, neg) <= 1e-6);
    }
  }
  // KV caches. GQA layers: key / value [H_kv][T][hd] (ours token-major). MLA (Kimi): HF caches the latents
  // kv_latent [T][R] (after kv_a_layernorm) and k_rope [T][qk_rope]; ours holds them too, as one row
  // [kv_latent | k_rope] per token: compare both parts, and kv_b_proj of our latent (the per-head k_nope | v every
  // call expands) with kv_b_proj of HF's.
  double kv_rel = 0;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    if (c.layer_types[size_t(i)] != LayerType::FullAttention) continue;
    const std::string p = "layers." + std::to_string(i) + ".";
    const auto& as = st.attention[size_t(c.attention_index(i))];
    REQUIRE(as.n_tokens == T);
    const int64_t nkv = c.num_key_value_heads, hd = c.head_dim, vd = c.attn_v_head_dim();
    if (ref.find(p + "key") && ref.find(p + "value")) {
      REQUIRE_FALSE(c.attention_is_latent());
      for (const char* which : {"key", "value"}) {
        const int64_t d = std::string(which) == "key" ? hd : vd;
        const auto hf = ref.read_f32(ref.at(p + which));
        REQUIRE(hf.size() == size_t(nkv * T * d));
        std::vector<float> tm(hf.size());
        for (int64_t h = 0; h < nkv; ++h)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t e = 0; e < d; ++e) tm[size_t((t * nkv + h) * d + e)] = hf[size_t((h * T + t) * d + e)];
        const double r = rel_err(std::string(which) == "key" ? as.k : as.v, tm);
        CHECK(r <= kHfTol);
        kv_rel = std::max(kv_rel, r);
      }
    }
    if (ref.find(p + "kv_latent") && ref.find(p + "k_rope")) {
      REQUIRE(c.attention_is_latent());
      const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, R = c.kv_lora_rank, row = R + rope;
      const auto latent = ref.read_f32(ref.at(p + "kv_latent"));
      const auto krope = ref.read_f32(ref.at(p + "k_rope"));
      REQUIRE(latent.size() == size_t(T * R));
      REQUIRE(krope.size() == size_t(T * rope));
      REQUIRE(as.k.size() == size_t(T * row));  // [T][1][R + rope]
      REQUIRE(as.v.empty());
      std::vector<float> ours_latent(size_t(T * R)), ours_rope(size_t(T * rope));
      for (int64_t t = 0; t < T; ++t) {
        std::copy_n(as.k.begin() + t * row, R, ours_latent.begin() + t * R);
        std::copy_n(as.k.begin() + t * row + R, rope, ours_rope.begin() + t * rope);
      }
      std::vector<float> hf_kv(size_t(T * nkv * (nope + vd))), ours_kv(hf_kv.size());
      const auto& kvb = m.weights().layers[size_t(i)].mla.kv_b_proj.data;  // [nkv*(nope+vd)][R]
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < nkv; ++h)
          for (int64_t r = 0; r < nope + vd; ++r) {
            double hf_acc = 0, our_acc = 0;
            for (int64_t j = 0; j < R; ++j) {
              const double wj = kvb[size_t((h * (nope + vd) + r) * R + j)];
              hf_acc += wj * latent[size_t(t * R + j)];
              our_acc += wj * ours_latent[size_t(t * R + j)];
            }
            hf_kv[size_t((t * nkv + h) * (nope + vd) + r)] = float(hf_acc);
            ours_kv[size_t((t * nkv + h) * (nope + vd) + r)] = float(our_acc);
          }
      const double r0 = rel_err(ours_latent, latent), r1 = rel_err(ours_rope, krope), r2 = rel_err(ours_kv, hf_kv);
      CHECK(r0 <= kHfTol);
      CHECK(r1 <= kHfTol);
      CHECK(r2 <= kHfTol);
      kv_rel = std::max({kv_rel, r0, r1, r2});
    }
  }
  std::printf("[family-fixture] %-24s KV rel %.3g\n", name.c_str(), kv_rel);
  // Greedy continuation by recurrent decode.
  if (const TensorInfo* g = ref.find("greedy")) {
    const auto greedy = ref.read_i64(*g);
    const TensorInfo* gl = ref.find("greedy_logits");
    const std::vector<float> hf_rows = gl ? ref.read_f32(*gl) : std::vector<float>{};
    std::vector<float> logits(res.logits.end() - V, res.logits.end());
    std::vector<int64_t> ours;
    double greedy_rel = 0;
    for (size_t j = 0; j < greedy.size(); ++j) {
      if (j > 0) logits = m.decode(st, int32_t(greedy[j - 1]), T + int64_t(j) - 1);
      if (!hf_rows.empty()) {
        const std::vector<float> row(hf_rows.begin() + int64_t(j) * V, hf_rows.begin() + int64_t(j + 1) * V);
        greedy_rel = std::max(greedy_rel, rel_err(logits, row));
      }
      ours.push_back(argmax(logits.data(), V));
    }
    CHECK(ours == greedy);
    CHECK(greedy_rel <= kHfTol);
    std::printf("[family-fixture] %-24s logits rel %.3g; recurrent state rel %.3g; conv rel %.3g; greedy rel %.3g\n",
                name.c_str(), logits_rel, state_rel, conv_rel, greedy_rel);
  } else {
    std::printf("[family-fixture] %-24s logits rel %.3g; recurrent state rel %.3g; conv rel %.3g\n", name.c_str(),
                logits_rel, state_rel, conv_rel);
  }
}

}  // namespace

TEST_CASE("HF / Ring reference fixtures of the new families", "[families][hf]") {
  const auto dirs = family_fixtures();
  if (dirs.empty()) {
    WARN("no kimi_linear / minimax / bailing_moe_linear fixture under tests/fixtures: skipped");
    return;
  }
  for (const auto& d : dirs) check_family_fixture(d);
}
