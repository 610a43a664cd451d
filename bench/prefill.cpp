// hypic-bench-prefill: CPU prefill throughput (tokens/s) of a model directory at given prompt lengths.
// For every length T it runs Model::prefill of T deterministic pseudo-random token ids from the initial state
// at position 0 (logits of the last position only), `repeats` times, and reports the best and median wall
// time (after one untimed warm-up prefill); unless --no-transitions, it also times the same prefill with
// capture_transitions (the per-linear-layer span transitions a segment entry needs) to show their overhead.
// Output: one JSON object on stdout; a human-readable table on stderr.
// If OpenBLAS picked a weaker kernel set than the CPU supports, the program re-executes itself with
// OPENBLAS_CORETYPE set (kernels/cpu/blas_env.h); set OPENBLAS_CORETYPE yourself to choose.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cpu/model.h"
#include "kernels/cpu/blas_env.h"
#include "proto/rpc/flags.h"

using hypic::engine::Model;
using hypic::engine::PrefillOptions;
using hypic::rpc::add_strict_int_option;

namespace {

struct Timing {
  double best = 0, median = 0;
};

Timing time_prefill(const Model& model, const std::vector<int32_t>& ids, int repeats, bool transitions) {
  std::vector<double> secs;
  for (int r = 0; r < repeats; ++r) {
    auto state = model.initial_state();
    PrefillOptions opt;
    opt.capture_transitions = transitions;
    const auto t0 = std::chrono::steady_clock::now();
    const auto res = model.prefill(state, ids, 0, opt);
    const auto t1 = std::chrono::steady_clock::now();
    if (res.logits.empty()) throw std::runtime_error("prefill returned no logits");
    secs.push_back(std::chrono::duration<double>(t1 - t0).count());
  }
  std::sort(secs.begin(), secs.end());
  return {secs.front(), secs[secs.size() / 2]};
}

std::vector<int64_t> parse_lengths(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ','))
    out.push_back(hypic::rpc::require_decimal<int64_t>(item, "--tokens", 1, std::numeric_limits<int64_t>::max()));
  if (out.empty()) throw std::invalid_argument("--tokens: no lengths given");
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  hypic::kernels::cpu::reexec_with_recommended_blas_core(argv);
  CLI::App app{"CPU prefill throughput of a hypic model (tokens/s)"};
  std::string model_dir, tokens = "512,2048";
  int repeats = 3, threads = 0;
  uint32_t seed = 1;
  bool no_transitions = false;
  app.add_option("--model", model_dir, "checkpoint directory (config.json + safetensors)")->required();
  app.add_option("--tokens", tokens, "comma-separated prompt lengths")->capture_default_str();
  add_strict_int_option(app, "--repeats", repeats, 1, std::numeric_limits<int>::max(),
                        "runs per length (best and median reported)")
      ->capture_default_str();
  add_strict_int_option(app, "--threads", threads, 0, std::numeric_limits<int>::max(),
                        "OpenBLAS threads (0 = OpenBLAS default)");
  add_strict_int_option(app, "--seed", seed, 0, std::numeric_limits<uint32_t>::max(), "seed of the random token ids")
      ->capture_default_str();
  app.add_flag("--no-transitions", no_transitions, "skip the timing with capture_transitions");
  CLI11_PARSE(app, argc, argv);

  try {
    const auto lengths = parse_lengths(tokens);
    if (threads > 0) openblas_set_num_threads(threads);
    const auto t0 = std::chrono::steady_clock::now();
    const Model model = Model::load(model_dir);
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto& c = model.config();

    nlohmann::json out;
    out["bench"] = "prefill";
    out["model"] = model_dir;
    out["model_type"] = c.model_type;
    out["layers"] = c.num_hidden_layers;
    out["linear_layers"] = c.num_linear_layers();
    out["attention_layers"] = c.num_attention_layers();
    out["hidden_size"] = c.hidden_size;
    out["vocab_size"] = c.vocab_size;
    out["parameters"] = model.weights().parameter_count();
    out["blas_threads"] = openblas_get_num_threads();
    out["blas_core"] = hypic::kernels::cpu::blas_core_name();
    out["load_seconds"] = load_s;
    out["repeats"] = repeats;
    out["results"] = nlohmann::json::array();

    std::fprintf(stderr,
                 "model %s (%s, %d layers: %d linear / %d attention, hidden %lld), %d BLAS threads, %s kernels\n",
                 model_dir.c_str(), c.model_type.c_str(), c.num_hidden_layers, c.num_linear_layers(),
                 c.num_attention_layers(), static_cast<long long>(c.hidden_size), openblas_get_num_threads(),
                 hypic::kernels::cpu::blas_core_name().c_str());
    std::fprintf(stderr, "%8s %10s %10s %12s %14s %10s\n", "tokens", "best_s", "median_s", "tokens/s",
                 "tok/s (+T_C)", "T_C cost");
    std::mt19937 rng(seed);
    {  // Warm-up (not timed): first-touch page faults, BLAS thread start-up.
      auto state = model.initial_state();
      const std::vector<int32_t> warm(static_cast<size_t>(std::min<int64_t>(64, lengths.front())), 0);
      model.prefill(state, warm, 0);
    }
    for (int64_t T : lengths) {
      std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(c.vocab_size - 1));
      std::vector<int32_t> ids(static_cast<size_t>(T));
      for (auto& id : ids) id = dist(rng);
      const Timing plain = time_prefill(model, ids, repeats, false);
      nlohmann::json r = {{"tokens", T},
                          {"best_seconds", plain.best},
                          {"median_seconds", plain.median},
                          {"tokens_per_second", double(T) / plain.best}};
      std::string with = "-", cost = "-";
      if (!no_transitions) {
        const Timing tr = time_prefill(model, ids, repeats, true);
        r["best_seconds_with_transitions"] = tr.best;
        r["tokens_per_second_with_transitions"] = double(T) / tr.best;
        r["transition_overhead_percent"] = 100.0 * (tr.best / plain.best - 1.0);
        char buf[64];
        std::snprintf(buf, sizeof buf, "%.1f", double(T) / tr.best);
        with = buf;
        std::snprintf(buf, sizeof buf, "%+.1f%%", 100.0 * (tr.best / plain.best - 1.0));
        cost = buf;
      }
      std::fprintf(stderr, "%8lld %10.3f %10.3f %12.1f %14s %10s\n", static_cast<long long>(T), plain.best,
                   plain.median, double(T) / plain.best, with.c_str(), cost.c_str());
      out["results"].push_back(r);
    }
    std::cout << out.dump() << std::endl;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hypic-bench-prefill: %s\n", e.what());
    return 1;
  }
  return 0;
}
