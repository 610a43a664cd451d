// hypic-model: make, inspect and run hybrid-model checkpoints on the CPU (fp32).
//
//   hypic-model init --config CFG.json --seed N --out DIR [--dtype bf16|f32|f16] [--std 0.02]
//       deterministic random checkpoint in transformers' save_pretrained layout (config.json +
//       model.safetensors), any size (engine/checkpoint/weights.h write_random_checkpoint)
//   hypic-model info --model DIR|CFG.json [--segment-tokens 2048] [--json]
//       layer pattern, parameter counts (total, active per token), recurrent-state bytes per linear layer,
//       KV bytes per token, and the tensor bytes of one segment cache entry (DESIGN.md 3.2)
//   hypic-model logits --model DIR (--ids 1,2,3 | --ids-file F) --out F.safetensors
//       one prefill from position 0; writes `logits` [T, V] F32 (every position) and `input_ids` [T] I64
//   hypic-model generate --model DIR (--ids ... | --ids-file F) --max-new-tokens N [--eos ID]
//       greedy continuation (prefill, then token-by-token decode); prints the new ids as a JSON array
//
// Errors (unreadable or inconsistent checkpoint, bad ids) go to stderr with exit status 1.
#include "kernels/cpu/blas_env.h"
#include "engine/cpu/model.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/weights.h"
#include "engine/io_error.h"
#include "proto/rpc/flags.h"

using namespace hypic::engine;
using hypic::rpc::add_strict_int_option;
namespace fs = std::filesystem;

namespace {

/// Token ids from text: non-negative integers separated by commas and/or whitespace. `what` names the
/// source in errors.
std::vector<int32_t> parse_ids(const std::string& text, const std::string& what) {
  std::vector<int32_t> ids;
  size_t i = 0;
  auto is_sep = [](char ch) { return ch == ',' || std::isspace(static_cast<unsigned char>(ch)); };
  while (i < text.size()) {
    if (is_sep(text[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && !is_sep(text[j])) ++j;
    int32_t v = -1;
    const auto [end, ec] = std::from_chars(text.data() + i, text.data() + j, v);
    if (ec != std::errc() || end != text.data() + j || v < 0)
      throw std::invalid_argument(what + ": '" + text.substr(i, j - i) + "' (item " + std::to_string(ids.size()) +
                                  ") is not a token id (an integer in [0, 2^31))");
    ids.push_back(v);
    i = j;
  }
  if (ids.empty()) throw std::invalid_argument(what + ": no token ids");
  return ids;
}

std::vector<int32_t> read_ids(const std::string& ids, const std::string& ids_file) {
  if (!ids_file.empty()) {
    return parse_ids(hypic::engine::read_file_bytes(ids_file, "cannot read ids file "), ids_file);
  }
  return parse_ids(ids, "--ids");
}

DType parse_store_dtype(const std::string& s) {
  if (s == "bf16") return DType::BF16;
  if (s == "f32") return DType::F32;
  if (s == "f16") return DType::F16;
  throw std::invalid_argument("--dtype must be bf16, f32 or f16, got '" + s + "'");
}

std::string layer_pattern(const ModelConfig& c) {
  std::string s;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    s += c.layer_types[size_t(i)] == LayerType::Linear ? 'L' : 'F';
    if (c.num_experts > 0) s += c.is_moe_layer(i) ? "" : "d";
    if (i + 1 < c.num_hidden_layers) s += ' ';
  }
  return s;
}

std::string human_bytes(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", b, unit[u]);
  return buf;
}

int run_init(const std::string& config, uint64_t seed, const std::string& out, const std::string& dtype, double std) {
  const ModelConfig cfg = load_config(config);
  write_random_checkpoint(cfg, seed, out, parse_store_dtype(dtype), std);
  const ModelConfig written = load_config(out);
  const ParameterCounts n = count_parameters(cfg);
  std::cout << "wrote " << out << ": " << cfg.model_type << ", " << n.total << " parameters, "
            << human_bytes(double(fs::file_size(fs::path(out) / "model.safetensors"))) << " (" << dtype
            << "), fingerprint " << written.fingerprint() << "\n";
  return 0;
}

int run_info(const std::string& model, int64_t segment_tokens, bool as_json) {
  if (segment_tokens <= 0) throw std::invalid_argument("--segment-tokens must be > 0");
  const ModelConfig c = load_config(model);
  const ParameterCounts n = count_parameters(c);
  const int64_t f = sizeof(float);
  const int64_t nv = c.linear_num_value_heads, dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t ssm_bytes = nv * dk * dv * f;
  const int64_t conv_bytes = int64_t(c.conv_rows()) * c.conv_dim() * f;
  const bool scalar_tc = linear_transition_kind(c) == TransitionKind::Scalar;
  // T_C: dense (gated delta rule, KDA) or one scalar per head (lightning).
  const int64_t transition_bytes = scalar_tc ? nv * f : nv * dk * dk * f;
  // Segment entry tensors (DESIGN.md 3.2, engine/segment.h) of an entry made with a seam (w > 0): per linear layer
  // S of the seam, (T, S) of the interior and the conv tail (T_seam is not stored; w = 0 entries also drop S_seam);
  // per attention layer K and V of every token (MLA: its latent row, no V); plus the token ids. Header bytes excluded.
  const int64_t per_linear_entry = transition_bytes + 2 * ssm_bytes + conv_bytes;
  const int64_t per_attention_entry =
      segment_tokens * c.kv_cache_heads() * (int64_t(c.kv_cache_k_dim()) + c.kv_cache_v_dim()) * f;
  const int64_t entry = c.num_linear_layers() * per_linear_entry + c.num_attention_layers() * per_attention_entry +
                        segment_tokens * int64_t(sizeof(int32_t));
  const int64_t state_total = c.num_linear_layers() * c.linear_state_bytes();
  // Weights: none (a config.json), random (hypic-model init) or trained.
  std::optional<std::string> random_seed;
  const bool has_weights = std::filesystem::is_directory(model) && has_safetensors(model);
  if (has_weights) random_seed = random_init_seed(model);
  const std::string weights = !has_weights ? "none (a config only)"
                              : random_seed ? "RANDOM (hypic-model init, seed " + *random_seed + ")"
                                            : "from the checkpoint (not made by hypic-model init)";
  nlohmann::json j = {
      {"model_type", c.model_type},
      {"fingerprint", c.fingerprint()},
      {"weights_digest", c.weights_digest},
      {"layers", c.num_hidden_layers},
      {"layer_pattern", layer_pattern(c)},
      {"linear_layers", c.num_linear_layers()},
      {"attention_layers", c.num_attention_layers()},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"context_tokens", c.max_position_embeddings},
      {"parameters_total", n.total},
      {"parameters_active_per_token", n.active_per_token},
      {"linear_state_bytes_per_layer", c.linear_state_bytes()},
      {"linear_ssm_bytes_per_layer", ssm_bytes},
      {"linear_conv_bytes_per_layer", conv_bytes},
      {"linear_state_bytes_total", state_total},
      {"kv_bytes_per_token", c.kv_bytes_per_token()},
      {"kv_cache_latent", c.attention_is_latent()},
      {"segment_tokens", segment_tokens},
      {"segment_entry_bytes", entry},
      {"segment_entry_linear_bytes_per_layer", per_linear_entry},
      {"segment_entry_attention_bytes_per_layer", per_attention_entry},
      {"weights", !has_weights ? "none" : random_seed ? "random" : "checkpoint"},
  };
  if (random_seed) j["random_weights_seed"] = *random_seed;
  if (as_json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << "model_type        " << c.model_type << "\n"
            << "fingerprint       " << c.fingerprint() << (c.weights_digest.empty() ? " (no weights)" : "") << "\n"
            << "layers            " << c.num_hidden_layers << " (" << c.num_linear_layers() << " linear, "
            << c.num_attention_layers() << " full attention)\n"
            << "pattern           " << layer_pattern(c) << "   (L linear, F full attention"
            << (layer_pattern(c).find('d') != std::string::npos ? ", d dense MLP in a MoE model" : "") << ")\n"
            << "weights           " << weights << "\n"
            << "hidden / vocab    " << c.hidden_size << " / " << c.vocab_size << "\n"
            << "context           "
            << (c.max_position_embeddings > 0 ? std::to_string(c.max_position_embeddings) + " tokens" : "not given")
            << " (config.json; the router's default --max-model-len)\n"
            << "parameters        " << n.total << " total, " << n.active_per_token << " active per token\n"
            << "linear state      " << human_bytes(double(c.linear_state_bytes())) << " per layer (S "
            << human_bytes(double(ssm_bytes)) << " + conv tail " << human_bytes(double(conv_bytes)) << "), "
            << human_bytes(double(state_total)) << " in all, fp32\n"
            << "KV cache          " << human_bytes(double(c.kv_bytes_per_token())) << " per token, fp32"
            << (c.attention_is_latent() ? " (MLA latent: " + std::to_string(c.kv_lora_rank) + " + " +
                                              std::to_string(c.qk_rope_head_dim) + " values per layer, no V)"
                                        : std::string())
            << "\n"
            << "segment entry     " << human_bytes(double(entry)) << " for " << segment_tokens << " tokens (linear "
            << human_bytes(double(per_linear_entry)) << " per layer: S of the seam, T+S of the interior, "
            << "conv tail; attention " << human_bytes(double(per_attention_entry)) << " per layer: "
            << (c.attention_is_latent() ? "MLA latent" : "K+V") << ")\n";
  return 0;
}

int run_logits(const std::string& model, const std::vector<int32_t>& ids, const std::string& out) {
  const Model m = Model::load(model);
  ModelState state = m.initial_state();
  PrefillOptions opt;
  opt.all_logits = true;
  const PrefillResult r = m.prefill(state, ids, 0, opt);
  const int64_t T = int64_t(ids.size()), V = m.config().vocab_size;
  SafetensorsWriter w;
  w.add_f32("logits", {T, V}, r.logits);
  std::vector<int64_t> ids64(ids.begin(), ids.end());
  w.add_int("input_ids", {T}, ids64);
  w.set_metadata("fingerprint", m.config().fingerprint());
  w.write(out);
  std::cerr << "wrote logits [" << T << ", " << V << "] to " << out << "\n";
  return 0;
}

int run_generate(const std::string& model, const std::vector<int32_t>& ids, int max_new, int64_t eos) {
  if (max_new < 0) throw std::invalid_argument("--max-new-tokens must be >= 0");
  const Model m = Model::load(model);
  ModelState state = m.initial_state();
  std::vector<float> logits = m.prefill(state, ids, 0).logits;
  std::vector<int32_t> out;
  for (int i = 0; i < max_new; ++i) {
    const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(next);
    if (next == eos || i + 1 == max_new) break;
    logits = m.decode(state, next, int64_t(ids.size()) + i);
  }
  std::cout << nlohmann::json(out).dump() << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  hypic::kernels::cpu::reexec_with_recommended_blas_core(argv);  // before OpenBLAS is used
  CLI::App app{
      "Make, inspect and run hybrid-model checkpoints (Qwen3-Next, Qwen3.5, Kimi-Linear, MiniMax, Ring-linear) on the "
      "CPU"};
  app.require_subcommand(1);

  std::string config, out, dtype = "bf16", model, ids, ids_file;
  uint64_t seed = 0;
  double std = 0.02;
  int64_t segment_tokens = 2048, eos = -1;
  int max_new = 16;
  bool as_json = false;

  auto* init = app.add_subcommand("init", "write a deterministic random checkpoint in save_pretrained layout");
  init->add_option("--config", config, "config.json to instantiate")->required()->check(CLI::ExistingFile);
  add_strict_int_option(*init, "--seed", seed, 0, std::numeric_limits<uint64_t>::max(), "random seed")->required();
  init->add_option("--out", out, "output directory (created)")->required();
  init->add_option("--dtype", dtype, "stored dtype: bf16 (default), f32 or f16");
  // write_random_checkpoint refuses the two ends itself: std in (0, 10).
  init->add_option("--std", std, "std of the projection / embedding weights (HF initializer_range, 0.02)")
      ->check(hypic::rpc::strict_real(0, 10));

  auto* info = app.add_subcommand("info", "layer pattern, parameter counts, state / KV / segment-entry bytes");
  info->add_option("--model", model, "checkpoint directory or config.json")->required()->check(CLI::ExistingPath);
  add_strict_int_option(*info, "--segment-tokens", segment_tokens, 1, std::numeric_limits<int32_t>::max(),
                        "segment length for the entry size (default 2048)");
  info->add_flag("--json", as_json, "print JSON");

  auto* logits = app.add_subcommand("logits", "prefill ids from position 0 and write every position's logits");
  logits->add_option("--model", model, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  auto* ids_opt = logits->add_option("--ids", ids, "comma-separated token ids");
  logits->add_option("--ids-file", ids_file, "file of whitespace-separated token ids")->excludes(ids_opt);
  logits->add_option("--out", out, "output .safetensors (tensor `logits` [T, V] F32)")->required();

  auto* gen = app.add_subcommand("generate", "greedy continuation; prints the new token ids as a JSON array");
  gen->add_option("--model", model, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  auto* gen_ids = gen->add_option("--ids", ids, "comma-separated prompt token ids");
  gen->add_option("--ids-file", ids_file, "file of whitespace-separated prompt token ids")->excludes(gen_ids);
  add_strict_int_option(*gen, "--max-new-tokens", max_new, 0, std::numeric_limits<int>::max(),
                        "tokens to generate (default 16)");
  add_strict_int_option(*gen, "--eos", eos, -1, std::numeric_limits<int32_t>::max(),
                        "stop after generating this id");

  CLI11_PARSE(app, argc, argv);
  try {
    if (init->parsed()) return run_init(config, seed, out, dtype, std);
    if (info->parsed()) return run_info(model, segment_tokens, as_json);
    if (ids.empty() && ids_file.empty()) throw std::invalid_argument("give the prompt with --ids or --ids-file");
    const std::vector<int32_t> prompt = read_ids(ids, ids_file);
    if (logits->parsed()) return run_logits(model, prompt, out);
    return run_generate(model, prompt, max_new, eos);
  } catch (const std::exception& e) {
    std::cerr << "hypic-model: " << e.what() << "\n";
    return 1;
  }
}
