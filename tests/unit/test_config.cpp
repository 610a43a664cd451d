// ModelConfig parsing: every config flavour (Qwen3-Next flat, Qwen3.5 text-only, Qwen3.5 nested, legacy
// RoPE fields, derived layer types), errors, derived quantities, fingerprint and JSON round trip.
// Expected values come from the fixture configs written by transformers 5.17 (tests/fixtures/README.md)
// and from the published Qwen3-Next-80B-A3B architecture (docs/research/hybrid_models.md 1.2).
#include <catch2/catch.hpp>
#include <limits>
#include <string>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"

using namespace hypic::engine;
namespace fs = std::filesystem;

namespace {
const fs::path kFixtures = fs::path(HYPIC_SOURCE_DIR) / "tests" / "fixtures";
constexpr LayerType L = LayerType::Linear;
constexpr LayerType F = LayerType::FullAttention;

// A Qwen3-Next-80B-A3B style config.json (legacy style: no layer_types, top-level rope fields).
const char* kQwen3Next80B = R"({
  "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
  "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48, "full_attention_interval": 4,
  "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
  "rope_theta": 10000000, "partial_rotary_factor": 0.25,
  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
  "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
  "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
  "shared_expert_intermediate_size": 512, "norm_topk_prob": true, "decoder_sparse_step": 1,
  "mlp_only_layers": [], "intermediate_size": 5120, "tie_word_embeddings": false,
  "max_position_embeddings": 262144 })";

/// kQwen3Next80B with the first occurrence of `from` replaced by `to`.
std::string with(const std::string& from, const std::string& to) {
  std::string t = kQwen3Next80B;
  t.replace(t.find(from), from.size(), to);
  return t;
}
}  // namespace

TEST_CASE("Qwen3-Next fixture config (save_pretrained)", "[config]") {
  const ModelConfig c = load_config(kFixtures / "qwen3_next_moe" / "config.json");
  CHECK(c.model_type == "qwen3_next");
  CHECK(c.vocab_size == 256);
  CHECK(c.hidden_size == 64);
  CHECK(c.layer_types == std::vector<LayerType>{L, F, L, F});
  CHECK(c.num_attention_heads == 4);
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.head_dim == 32);
  CHECK(c.rotary_dim() == 8);
  CHECK(c.rope_theta == 10000.0);
  CHECK(c.linear_num_key_heads == 2);
  CHECK(c.linear_num_value_heads == 4);
  CHECK(c.linear_key_head_dim == 16);
  CHECK(c.linear_value_head_dim == 24);
  CHECK(c.conv_dim() == 160);
  CHECK(c.num_experts == 8);
  CHECK(c.num_experts_per_tok == 2);
  CHECK(c.moe_intermediate_size == 24);
  CHECK(c.shared_expert_intermediate_size == 40);
  CHECK(c.intermediate_size == 96);
  CHECK_FALSE(c.norm_topk_prob);
  CHECK(c.mlp_only_layers == std::vector<int>{2});
  CHECK(c.is_moe_layer(0));
  CHECK(c.is_moe_layer(1));
  CHECK_FALSE(c.is_moe_layer(2));
  CHECK(c.is_moe_layer(3));
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK(c.rms_norm_eps == 1e-6);
  CHECK(c.attn_output_gate);
  // A checkpoint directory also yields the weights digest; a bare config.json does not.
  CHECK(c.weights_digest.empty());
  CHECK(load_config(kFixtures / "qwen3_next_moe").weights_digest.size() == 32);
  // Hand-computed sizes: S = 4*16*24 floats + conv tail 3*160 floats; KV = 2 layers * (K+V) * 2 heads * 32 * 4 B.
  CHECK(c.linear_state_bytes() == (4 * 16 * 24 + 3 * 160) * 4);
  CHECK(c.kv_bytes_per_token() == 2 * 2 * 2 * 32 * 4);
  CHECK(c.linear_index(2) == 1);
  CHECK(c.attention_index(3) == 1);
  CHECK_THROWS_AS(c.linear_index(1), std::invalid_argument);
  CHECK_THROWS_AS(c.attention_index(4), std::out_of_range);
}

TEST_CASE("Qwen3-Next legacy config: derived layer types and top-level RoPE fields", "[config]") {
  const ModelConfig a = load_config(kFixtures / "qwen3_next_moe");
  const ModelConfig b = load_config(kFixtures / "qwen3_next_moe_released");  // full_attention_interval 2
  CHECK(b.layer_types == a.layer_types);
  CHECK(b.rope_theta == a.rope_theta);
  CHECK(b.partial_rotary_factor == a.partial_rotary_factor);
  // Same architecture, but different files: the fingerprints differ only through the weights digest.
  ModelConfig a2 = a, b2 = b;
  a2.weights_digest = b2.weights_digest = "";
  CHECK(a2.fingerprint() == b2.fingerprint());
  CHECK(a.fingerprint() != b.fingerprint());
}

TEST_CASE("Qwen3.5 dense and MoE text configs, and the nested release config", "[config]") {
  const ModelConfig d = load_config(kFixtures / "qwen3_5_dense");
  CHECK(d.model_type == "qwen3_5_text");
  CHECK(d.layer_types == std::vector<LayerType>{L, L, F, L, F});
  CHECK(d.tie_word_embeddings);
  CHECK_FALSE(d.is_moe());
  for (int i = 0; i < 5; ++i) CHECK_FALSE(d.is_moe_layer(i));
  CHECK(d.intermediate_size == 96);

  const ModelConfig m = load_config(kFixtures / "qwen3_5_moe");
  CHECK(m.model_type == "qwen3_5_moe_text");
  CHECK(m.layer_types == std::vector<LayerType>{L, L, L, F});
  CHECK(m.num_experts_per_tok == 3);
  CHECK(m.norm_topk_prob);  // Qwen3.5-MoE always renormalises
  for (int i = 0; i < 4; ++i) CHECK(m.is_moe_layer(i));

  const ModelConfig r = load_config(kFixtures / "qwen3_5_moe_released");
  CHECK(r.model_type == "qwen3_5_moe");
  CHECK(r.layer_types == m.layer_types);
  CHECK(r.hidden_size == m.hidden_size);
  CHECK(r.num_experts == m.num_experts);
  CHECK(r.moe_intermediate_size == m.moe_intermediate_size);
  CHECK(r.partial_rotary_factor == m.partial_rotary_factor);
  CHECK(r.linear_value_head_dim == m.linear_value_head_dim);
}

TEST_CASE("layer types derive from full_attention_interval, default 4", "[config]") {
  const std::string base = R"("vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 8, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 8, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
    "linear_key_head_dim": 4, "linear_value_head_dim": 4, "intermediate_size": 16)";
  const ModelConfig a = parse_config("{\"model_type\": \"qwen3_5_text\", " + base + "}");
  CHECK(a.layer_types == std::vector<LayerType>{L, L, L, F, L, L, L, F});
  const ModelConfig b =
      parse_config("{\"model_type\": \"qwen3_5_text\", \"full_attention_interval\": 3, " + base + "}");
  CHECK(b.layer_types == std::vector<LayerType>{L, L, F, L, L, F, L, L});
  // Legacy names "mamba" / "attention" map as transformers' remap_legacy_layer_types does.
  const ModelConfig c = parse_config(
      "{\"model_type\": \"qwen3_5_text\", \"layer_types\": [\"mamba\",\"attention\",\"linear_attention\","
      "\"full_attention\",\"mamba\",\"mamba\",\"mamba\",\"attention\"], " +
      base + "}");
  CHECK(c.layer_types == std::vector<LayerType>{L, F, L, F, L, L, L, F});
}

TEST_CASE("Qwen3-Next-80B-A3B architecture numbers", "[config]") {
  const ModelConfig c = parse_config(kQwen3Next80B);
  CHECK(c.num_linear_layers() == 36);
  CHECK(c.num_attention_layers() == 12);
  CHECK(c.layer_types[3] == F);
  CHECK(c.layer_types[4] == L);
  CHECK(c.conv_dim() == 8192);
  CHECK(c.rotary_dim() == 64);
  CHECK(c.rope_theta == 1e7);
  // The model card: 80B parameters in total, about 3B activated per token (not counting the
  // 2 * 151936 * 2048 = 0.62B of embedding and LM head).
  const ParameterCounts n = count_parameters(c);
  CHECK(n.total > 79'000'000'000LL);
  CHECK(n.total < 82'000'000'000LL);
  const int64_t embeddings = 2 * c.vocab_size * c.hidden_size;
  CHECK(n.active_per_token - embeddings > 2'700'000'000LL);
  CHECK(n.active_per_token - embeddings < 3'300'000'000LL);
  // KV: 12 layers * 2 * 2 heads * 256 * 4 B = 48 KiB per token (fp32).
  CHECK(c.kv_bytes_per_token() == 12 * 2 * 2 * 256 * 4);
  // Without head_dim the HF default 256 applies (Qwen3NextConfig), not hidden / heads = 128.
  std::string no_hd = kQwen3Next80B;
  no_hd.erase(no_hd.find("\"head_dim\": 256,"), std::string("\"head_dim\": 256,").size());
  CHECK(parse_config(no_hd).head_dim == 256);
}

TEST_CASE("forward_flops: 2 per active body parameter per token plus causal attention pairs", "[config]") {
  const ModelConfig c = parse_config(kQwen3Next80B);
  // Worked by hand from the config: 12 full-attention layers x 2 x 16 heads x (256 + 256) per (query, key) pair,
  // T^2 / 2 pairs; the body is the active parameters less the untied embedding and LM head (151936 x 2048 each).
  const double pair = 12.0 * 2 * 16 * (256 + 256);
  const double body = double(count_parameters(c).active_per_token) - 2.0 * 151936 * 2048;
  for (int64_t T : {1, 2048, 32768})
    CHECK(forward_flops(c, T) == Approx(2.0 * double(T) * body + pair * double(T) * double(T) / 2).epsilon(1e-12));
  // One pass over 2T tokens against two over T each: the cross pairs, T^2 of them.
  CHECK(forward_flops(c, 8192) - 2 * forward_flops(c, 4096) == Approx(pair * 4096.0 * 4096.0).epsilon(1e-9));
  CHECK(forward_flops(c, 0) == 0);
  CHECK(forward_flops(c, -5) == 0);
}

TEST_CASE("config errors name the file and the field", "[config]") {
  CHECK_THROWS_WITH(
      parse_config(R"({"model_type": "llama", "vocab_size": 10})", "x/config.json"),
      "x/config.json: unknown model_type 'llama' (supported: qwen3_next, qwen3_5, qwen3_5_text, qwen3_5_moe, "
      "qwen3_5_moe_text, kimi_linear, minimax, bailing_moe_linear)");
  CHECK_THROWS_AS(parse_config(R"({"model_type": "llama"})"), std::invalid_argument);
  CHECK_THROWS_WITH(parse_config(R"({"vocab_size": 3})"), Catch::Contains("'model_type' is missing"));
  CHECK_THROWS_WITH(parse_config("{not json"), Catch::Contains("not valid JSON"));
  CHECK_THROWS_WITH(parse_config(R"({"model_type": "qwen3_5"})"), Catch::Contains("'text_config'"));
  CHECK_THROWS_WITH(load_config("/nonexistent/dir"), Catch::Contains("not found: /nonexistent/dir"));

  CHECK_THROWS_WITH(parse_config(with("\"hidden_size\": 2048,", "")), Catch::Contains("'hidden_size' is missing"));
  CHECK_THROWS_WITH(parse_config(with("\"linear_num_value_heads\": 32", "\"linear_num_value_heads\": 24")),
                    Catch::Contains("24 is not a multiple of linear_num_key_heads 16"));
  CHECK_THROWS_WITH(parse_config(with("\"num_experts_per_tok\": 10", "\"num_experts_per_tok\": 600")),
                    Catch::Contains("num_experts_per_tok"));
  CHECK_THROWS_WITH(parse_config(with("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"")),
                    Catch::Contains("only silu"));
  CHECK_THROWS_WITH(parse_config(with("\"partial_rotary_factor\": 0.25",
                                      "\"partial_rotary_factor\": 0.25, \"rope_scaling\": {\"rope_type\": \"yarn\"}")),
                    Catch::Contains("rope_type 'yarn'"));
  CHECK_THROWS_WITH(parse_config(with("\"hidden_size\": 2048", "\"hidden_size\": \"big\"")),
                    Catch::Contains("'hidden_size' has the wrong type"));
}

TEST_CASE("fingerprint is stable and changes with every architecture field and the weights", "[config]") {
  const ModelConfig c = parse_config(kQwen3Next80B);
  const std::string fp = c.fingerprint();
  CHECK(fp.size() == 32);
  CHECK(parse_config(kQwen3Next80B).fingerprint() == fp);
  auto differs = [&](auto mutate) {
    ModelConfig d = c;
    mutate(d);
    return d.fingerprint() != fp;
  };
  CHECK(differs([](ModelConfig& d) { d.rope_theta = 5e6; }));
  CHECK(differs([](ModelConfig& d) { d.layer_types[0] = F; }));
  CHECK(differs([](ModelConfig& d) { d.norm_topk_prob = false; }));
  CHECK(differs([](ModelConfig& d) { d.linear_value_head_dim = 64; }));
  CHECK(differs([](ModelConfig& d) { d.rms_norm_eps = 1e-5; }));
  CHECK(differs([](ModelConfig& d) { d.tie_word_embeddings = true; }));
  CHECK(differs([](ModelConfig& d) { d.weights_digest = "00"; }));
}

TEST_CASE("config_to_json round-trips through parse_config", "[config]") {
  for (const char* name : {"qwen3_next_moe", "qwen3_5_dense", "qwen3_5_moe", "qwen3_5_moe_released"}) {
    const ModelConfig a = load_config(kFixtures / name / "config.json");
    const ModelConfig b = parse_config(config_to_json(a));
    INFO(name);
    CHECK(b.model_type == a.model_type);
    CHECK(b.fingerprint() == a.fingerprint());  // every architecture field
    CHECK(b.max_position_embeddings == a.max_position_embeddings);
  }
}

// Found by fuzzing (tests/fuzz/fuzz_config_json.cpp); each of these escaped the documented errors or was undefined.
TEST_CASE("fuzz regressions: numbers that do not fit, absurd sizes", "[config][fuzz]") {
  // A number too large for a double: nlohmann throws out_of_range (406), which used to escape parse_config.
  CHECK_THROWS_AS(parse_config(R"({"model_type": "qwen3_next", "vocab_size": 95555555555555E55555})"),
                  std::runtime_error);
  CHECK_THROWS_WITH(parse_config("95555555555555E55555"), Catch::Contains("not valid JSON"));
  // A float or an out-of-range integer in an integer field (get<int64_t>() of 1e300 was undefined behaviour; of
  // 2^40 for an int it truncated).
  CHECK_THROWS_WITH(parse_config(with("\"hidden_size\": 2048", "\"hidden_size\": 1e300")),
                    Catch::Contains("'hidden_size' is not an integer in range"));
  CHECK_THROWS_WITH(parse_config(with("\"hidden_size\": 2048", "\"hidden_size\": 2048.5")),
                    Catch::Contains("'hidden_size' is not an integer in range"));
  CHECK_THROWS_WITH(parse_config(with("\"head_dim\": 256", "\"head_dim\": 1099511627776")),
                    Catch::Contains("'head_dim' is not an integer in range"));
  CHECK_THROWS_WITH(parse_config(with("\"mlp_only_layers\": []", "\"mlp_only_layers\": [1.5]")),
                    Catch::Contains("'mlp_only_layers' is not an integer in range"));
  // 2^31 - 1 layers: deriving layer_types used to loop and allocate 8 GB before validate() looked at them.
  CHECK_THROWS_WITH(parse_config(with("\"num_hidden_layers\": 48", "\"num_hidden_layers\": 2147483647")),
                    Catch::Contains("'num_hidden_layers' 2147483647 exceeds the supported maximum 4096"));
  // Sizes whose derived byte counts overflow int64 (linear_state_bytes, kv_bytes_per_token).
  CHECK_THROWS_WITH(parse_config(with("\"linear_key_head_dim\": 128", "\"linear_key_head_dim\": 2000000000")),
                    Catch::Contains("'linear_key_head_dim' 2000000000 exceeds"));
  ModelConfig c = parse_config(kQwen3Next80B);
  c.rope_theta = std::numeric_limits<double>::infinity();  // config_to_json would write null
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("'rope_theta' must be finite"));
  // A dense qwen3_next (num_experts 0) is accepted, but config_to_json left out the MoE fields that parse_config
  // requires for qwen3_next, so its output could not be read back.
  const ModelConfig dense = parse_config(with("\"num_experts\": 512", "\"num_experts\": 0"));
  CHECK_FALSE(dense.is_moe());
  CHECK(parse_config(config_to_json(dense)).fingerprint() == dense.fingerprint());
}
