// hypic-eval: runs one multi-segment prompt through every splice mode and compares each with `full`
// (DESIGN.md 3.4): per linear layer the relative error of the final recurrent state, the KL divergence and
// top-1 agreement of the next-token distributions over the query positions, the greedy continuation's
// agreement, and the time spent.
// With --dataset FILE.jsonl it runs the answer-quality benchmark of eval/quality.h instead: every mode (and
// hypic at each --seam-widths w) on every prompt of the dataset (or --limit / --shard of it): exact-match
// accuracy, per kind, flips against full, KL on the answer tokens, state errors, tokens computed and time.
#include <CLI/CLI.hpp>
#include <fmt/chrono.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>

#include "engine/cpu/model.h"
#include "engine/io_error.h"
#include "eval/quality.h"
#include "engine/sampling.h"
#include "engine/cpu/splice.h"
#include "tokenizer/tokenizer.h"
#include "engine/checkpoint/weights.h"
#include "kernels/cpu/blas_env.h"
#include "proto/rpc/flags.h"

using namespace hypic::engine;
using Clock = std::chrono::steady_clock;
using hypic::rpc::add_strict_int_option;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string read_file(const std::string& path) { return hypic::engine::read_file_bytes(path); }

std::vector<int32_t> parse_ids(const std::string& text, const std::string& origin) {
  std::vector<int32_t> ids;
  std::string cleaned = text;
  for (char& c : cleaned)
    if (c == ',' || c == '[' || c == ']') c = ' ';
  std::istringstream in(cleaned);
  std::string tok;
  while (in >> tok) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != tok.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(origin + ": not a token id: '" + tok + "'");
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

// "full,prefix,..." -> the modes besides full (full always runs first as the reference).
std::vector<SpliceMode> parse_modes(const std::string& text) {
  std::vector<SpliceMode> modes;
  std::stringstream ss(text);
  std::string m;
  while (std::getline(ss, m, ','))
    if (!m.empty() && parse_splice_mode(m) != SpliceMode::Full) modes.push_back(parse_splice_mode(m));
  return modes;
}

// --dataset: the answer-quality benchmark (eval/quality.h) over a JSONL dataset.
struct DatasetRun {
  std::string model_dir, tokenizer_path, dataset_path, json_out, command, modes_text;
  std::vector<QualityPrompt> prompts;  ///< the whole dataset
  QualityOptions options;
  size_t limit = 0;
  QualityShard shard;
  bool as_json = false;
  double load_seconds = 0;
  std::string random_weights_seed;  // non-empty: a hypic-model init checkpoint (random weights)
};

void print_quality_table(const QualityReport& report) {
  std::vector<std::string> kinds;
  for (const ModeSummary& s : report.summary) {
    std::string k;
    for (const auto& [kind, acc] : s.accuracy_by_kind) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.3f", acc);
      k += (k.empty() ? "" : " ") + kind + "=" + buf;
    }
    kinds.push_back(k.empty() ? "-" : k);
  }
  size_t kw = 8;
  for (const auto& k : kinds) kw = std::max(kw, k.size());
  std::printf("%-16s %8s  %-*s %9s %10s %7s %9s %9s %9s\n", "mode", "accuracy", static_cast<int>(kw), "per kind",
              "flips-/+", "KL answer", "top1", "computed", "seconds", "max_err");
  for (size_t m = 0; m < report.summary.size(); ++m) {
    const ModeSummary& s = report.summary[m];
    double mx = 0;
    for (double e : s.mean_state_rel_err) mx = std::max(mx, e);
    const std::string flips = std::to_string(s.flips_right_to_wrong) + "/" + std::to_string(s.flips_wrong_to_right);
    std::printf("%-16s %8.3f  %-*s %9s %10.3e %7.3f %9.1f %9.3f %9.2e\n", s.mode.c_str(), s.accuracy,
                static_cast<int>(kw), kinds[m].c_str(), flips.c_str(), s.mean_kl, s.mean_answer_top1,
                s.mean_computed_tokens, s.total_seconds, mx);
  }
  std::printf("\naccuracy: mean exact match of the greedy answer; flips-/+: prompts full gets right and this mode\n"
              "wrong / the reverse; KL answer: mean KL(full || mode) over the teacher-forced answer positions; top1:\n"
              "argmax agreement there; computed: mean tokens run through the model; seconds: total splice time;\n"
              "max_err: largest mean relative error of a linear layer's state after the last segment vs full.\n");
}

int run_dataset(const Model& model, const Tokenizer& tok, const DatasetRun& run) {
  const std::vector<QualityPrompt>& prompts = run.prompts;
  const std::vector<size_t> indices = select_quality_prompts(prompts.size(), run.limit, run.shard);
  const std::string shard = std::to_string(run.shard.index) + "/" + std::to_string(run.shard.count);
  std::fprintf(stderr, "hypic-eval: %zu prompts in %s, evaluating %zu (limit %zu, shard %s)\n", prompts.size(),
               run.dataset_path.c_str(), indices.size(), run.limit, shard.c_str());
  const auto t_start = Clock::now();
  auto t_prev = t_start;
  const QualityReport report = evaluate_quality(
      model, tok, prompts, indices, run.options, [&](size_t done, size_t total, const PromptOutcome& p) {
        const auto now = Clock::now();
        std::fprintf(stderr, "[%zu/%zu] prompt %zu '%s': %lld tokens, %.2f s, full %s\n", done, total, p.index,
                     p.id.c_str(), static_cast<long long>(p.prompt_tokens),
                     std::chrono::duration<double>(now - t_prev).count(),
                     p.modes.front().exact_match ? "right" : "wrong");
        t_prev = now;
      });
  nlohmann::json out = to_json(report);
  nlohmann::json& settings = out["settings"];
  settings["command"] = run.command;
  settings["modes"] = run.modes_text;
  settings["prefix_cache_bytes"] = run.options.prefix_cache_bytes;
  settings["model"] = run.model_dir;
  settings["tokenizer"] = run.tokenizer_path;
  settings["dataset"] = run.dataset_path;
  settings["seam_widths"] = run.options.seam_widths;
  settings["local_position_ablations"] = run.options.local_position_ablations;
  settings["refresh_counts"] = run.options.refresh_counts;
  settings["refresh_tails"] = run.options.refresh_tails;
  settings["refresh_seam_width"] = run.options.refresh_seam_width;
  settings["max_new_tokens"] = run.options.max_new_tokens;
  settings["limit"] = run.limit;
  settings["shard"] = shard;
  out["dataset_prompts"] = prompts.size();
  out["evaluated_prompts"] = indices.size();
  out["utc_time"] = fmt::format("{:%Y-%m-%dT%H:%M:%SZ}", fmt::gmtime(std::time(nullptr)));
  out["load_seconds"] = run.load_seconds;
  out["total_seconds"] = seconds_since(t_start);
  out["random_weights"] = !run.random_weights_seed.empty();  // hypic-model init checkpoint: figures mean nothing
  if (!run.random_weights_seed.empty()) out["random_weights_seed"] = run.random_weights_seed;
  const std::string text = out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
  if (!run.json_out.empty()) {
    std::ofstream f(run.json_out, std::ios::binary);
    if (!(f << text << "\n")) throw std::runtime_error("cannot write " + run.json_out);
  }
  if (run.as_json) {
    std::cout << text << "\n";
    return 0;
  }
  int64_t tokens = 0;
  for (const PromptOutcome& p : report.prompts) tokens += p.prompt_tokens;
  std::printf("hypic-eval --dataset %s: %zu of %zu prompts (shard %s), %lld prompt tokens, at most %d new tokens, "
              "%.1f s\n", run.dataset_path.c_str(), indices.size(), prompts.size(), shard.c_str(),
              static_cast<long long>(tokens), run.options.max_new_tokens, out["total_seconds"].get<double>());
  print_quality_table(report);
  if (!run.random_weights_seed.empty())
    std::printf("RANDOM WEIGHTS (hypic-model init, seed %s): these figures say nothing about answer quality.\n",
                run.random_weights_seed.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  hypic::kernels::cpu::reexec_with_recommended_blas_core(argv);  // before OpenBLAS is used
  CLI::App app{"hypic-eval: compare the splice modes (full, prefix, naive, transition, hypic) on one prompt, or on a "
               "dataset of prompts with known answers (--dataset)"};
  std::string model_dir, tokenizer_path, query_text, query_ids_text, modes_text = "full,prefix,naive,transition,hypic";
  std::vector<std::string> segment_files, segment_texts, token_files;
  int seam_width = 8, max_new_tokens = 16;
  bool as_json = false;
  app.add_option("--model", model_dir, "checkpoint directory (config.json + safetensors)")->required();
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json (needed for text segments and text queries)");
  app.add_option("--segment-file", segment_files, "a text file per segment (repeatable, in prompt order)");
  app.add_option("--segment-text", segment_texts, "a segment given inline (repeatable; after --segment-file ones)");
  app.add_option("--token-file", token_files, "a file of token ids (whitespace/comma separated) per segment");
  app.add_option("--query", query_text, "the query text");
  app.add_option("--query-ids", query_ids_text, "the query as token ids, e.g. 1,2,3");
  constexpr int kIntMax = std::numeric_limits<int>::max();
  add_strict_int_option(app, "--seam-width", seam_width, 0, kIntMax, "seam window w in tokens (hypic mode)");
  add_strict_int_option(app, "--max-new-tokens", max_new_tokens, 0, kIntMax,
                        "greedy continuation length compared per mode (16; --dataset: the most per answer, 24)");
  app.add_option("--modes", modes_text,
                 "comma-separated modes; full is always run as the reference (--dataset: naive and transition also "
                 "run as naive_local and transition_local unless --no-local-ablations)");
  app.add_flag("--json", as_json, "print one JSON object instead of tables");
  DatasetRun run;
  std::string shard_text = "0/1";
  auto* dataset_opt = app.add_option("--dataset", run.dataset_path,
                                     "JSONL of prompts with known answers (eval/quality.h): the quality benchmark "
                                     "instead of one prompt; needs --tokenizer");
  std::vector<CLI::Option*> dataset_only = {
      add_strict_int_option(app, "--seam-widths", run.options.seam_widths, 0, kIntMax,
                            "--dataset: comma-separated hypic seam widths, one mode hypic_w<w> each (0,2,4,8,16,32)")
          ->delimiter(','),
      add_strict_int_option(app, "--refresh", run.options.refresh_counts, 1, kIntMax,
                            "--dataset: comma-separated k, one mode hypic_w<w>_r<k> each: hypic at w = "
                            "--refresh-seam-width that recomputes whole the k segments the query attends to most "
                            "(SpliceRequest::refresh_segments)")
          ->delimiter(','),
      add_strict_int_option(app, "--refresh-tail", run.options.refresh_tails, 1, kIntMax,
                            "--dataset: comma-separated t, modes hypic_w<w>_t<t> (the last t segments recomputed "
                            "whole, SpliceRequest::refresh_tail) and hypic_w<w>_r<k>_t<t> for each --refresh k")
          ->delimiter(','),
      add_strict_int_option(app, "--refresh-seam-width", run.options.refresh_seam_width, 0, kIntMax,
                            "--dataset: w of the --refresh and --refresh-tail modes, tokens (8)"),
      add_strict_int_option(app, "--limit", run.limit, 0, std::numeric_limits<size_t>::max(),
                            "--dataset: only the first N prompts (0 = all)"),
      app.add_option("--shard", shard_text, "--dataset: shard I/N, the prompts with index % N == I"),
      app.add_option("--json-out", run.json_out, "--dataset: write the report (summary, per-prompt rows, settings)"),
      app.add_flag("!--no-local-ablations", run.options.local_position_ablations,
                   "--dataset: skip naive_local and transition_local (naive and transition with every segment's K, "
                   "and Ring-linear's linear states, left at its local positions: the reference's Naive Addition "
                   "baseline)")};
  CLI11_PARSE(app, argc, argv);
  const bool dataset_mode = dataset_opt->count() > 0;
  if (!dataset_mode) {
    for (const CLI::Option* o : dataset_only)
      if (o->count() > 0) {
        std::fprintf(stderr, "hypic-eval: error: %s needs --dataset\n", o->get_name().c_str());
        return 2;
      }
  } else if (!segment_files.empty() || !segment_texts.empty() || !token_files.empty() || !query_text.empty() ||
             !query_ids_text.empty() || app.get_option("--seam-width")->count() > 0) {
    std::fprintf(stderr, "hypic-eval: error: --dataset takes its segments, queries and seam widths from the dataset "
                         "(drop --segment-*, --token-file, --query*, --seam-width)\n");
    return 2;
  }

  try {
    if (dataset_mode) {  // before the model loads
      if (tokenizer_path.empty()) throw std::invalid_argument("--dataset needs --tokenizer");
      run.shard = parse_quality_shard(shard_text);
      run.options.modes = parse_modes(modes_text);
      run.prompts = load_quality_dataset(run.dataset_path);
    }
    const auto t_load = Clock::now();
    const Model model = Model::load(model_dir);
    const double load_seconds = seconds_since(t_load);
    // Random weights (hypic-model init): say so loudly, in the table and the JSON.
    const std::optional<std::string> random_seed = random_init_seed(model_dir);
    if (random_seed)
      std::fprintf(stderr, "hypic-eval: WARNING: %s has RANDOM weights (hypic-model init, seed %s): its text, "
                   "accuracy and agreement figures say nothing about a trained model's answer quality\n",
                   model_dir.c_str(), random_seed->c_str());
    std::optional<Tokenizer> tok;
    if (!tokenizer_path.empty()) tok = Tokenizer::load(tokenizer_path);
    auto need_tok = [&](const char* what) -> const Tokenizer& {
      if (!tok) throw std::invalid_argument(std::string(what) + " needs --tokenizer");
      return *tok;
    };
    if (dataset_mode) {
      run.model_dir = model_dir;
      run.tokenizer_path = tokenizer_path;
      run.modes_text = modes_text;
      run.options.max_new_tokens = app.get_option("--max-new-tokens")->count() > 0 ? max_new_tokens : 24;
      run.as_json = as_json;
      run.load_seconds = load_seconds;
      run.random_weights_seed = random_seed.value_or("");
      for (int i = 0; i < argc; ++i) run.command += (i ? " " : "") + std::string(argv[i]);
      return run_dataset(model, need_tok("--dataset"), run);
    }

    std::vector<std::vector<int32_t>> segments;
    for (const auto& f : segment_files) segments.push_back(need_tok("--segment-file").encode(read_file(f), false));
    for (const auto& t : segment_texts) segments.push_back(need_tok("--segment-text").encode(t, false));
    for (const auto& f : token_files) segments.push_back(parse_ids(read_file(f), f));
    if (segments.empty()) throw std::invalid_argument("no segments: give --segment-file, --segment-text or --token-file");
    for (size_t i = 0; i < segments.size(); ++i)
      if (segments[i].empty()) throw std::invalid_argument("segment " + std::to_string(i) + " has no tokens");
    std::vector<int32_t> query;
    if (!query_ids_text.empty()) query = parse_ids(query_ids_text, "--query-ids");
    else if (!query_text.empty()) query = need_tok("--query").encode(query_text, false);
    if (query.empty()) throw std::invalid_argument("the query has no tokens: give --query or --query-ids");

    std::vector<SpliceMode> modes = {SpliceMode::Full};
    for (SpliceMode m : parse_modes(modes_text)) modes.push_back(m);

    // Entries: built once per segment, standalone, shared by naive / hypic at --seam-width and by transition at w = 0
    // (transition mode folds T_C of entries made without a seam window), as a cache would hold them: both widths
    // from one prefill of the segment (build_segment_entries).
    const bool want_w0 = seam_width != 0 && std::find(modes.begin(), modes.end(), SpliceMode::Transition) != modes.end();
    const std::vector<int> widths = want_w0 ? std::vector<int>{seam_width, 0} : std::vector<int>{seam_width};
    const auto t_build = Clock::now();
    std::vector<SpliceSegment> segs, segs_w0;  // entries at seam_width; at w = 0 (transition) when that differs
    int64_t prompt_tokens = 0;
    for (const auto& ids : segments) {
      std::vector<SegmentEntry> es = build_segment_entries(model, ids, widths);
      segs.push_back({ids, std::make_shared<const SegmentEntry>(std::move(es[0]))});
      if (want_w0) segs_w0.push_back({ids, std::make_shared<const SegmentEntry>(std::move(es[1]))});
      prompt_tokens += static_cast<int64_t>(ids.size());
    }
    const double build_seconds = seconds_since(t_build);
    const size_t V = static_cast<size_t>(model.config().vocab_size);

    struct Row {
      SpliceMode mode;
      SpliceResult res;
      double seconds;
      std::vector<int32_t> greedy_ids;
    };
    std::vector<Row> rows;
    PrefixStateCache prefix_cache(size_t(8) << 30);
    for (SpliceMode m : modes) {
      SpliceRequest req;
      req.segments = m == SpliceMode::Transition && want_w0 ? segs_w0 : segs;
      req.query = query;
      req.mode = m;
      req.seam_width = seam_width;
      req.all_query_logits = true;
      req.keep_context_state = true;
      if (m == SpliceMode::Prefix) {  // warm the prefix cache with the same segments under another query
        req.prefix_cache = &prefix_cache;
        SpliceRequest warm = req;
        warm.query = {query.front()};
        warm.all_query_logits = false;
        splice(model, warm);
      }
      const auto t0 = Clock::now();
      SpliceResult r = splice(model, req);
      const double secs = seconds_since(t0);
      std::vector<float> last(r.logits.end() - static_cast<long>(V), r.logits.end());
      std::vector<int32_t> g = greedy_decode(model, r.state, last, r.num_tokens, max_new_tokens).ids;
      rows.push_back({m, std::move(r), secs, std::move(g)});
    }

    const Row& ref = rows.front();
    nlohmann::json out;
    out["model"] = model_dir;
    out["segments"] = segments.size();
    out["prompt_tokens"] = prompt_tokens + static_cast<int64_t>(query.size());
    out["query_tokens"] = query.size();
    out["seam_width"] = seam_width;
    out["load_seconds"] = load_seconds;
    out["entry_build_seconds"] = build_seconds;
    out["random_weights"] = random_seed.has_value();  // hypic-model init checkpoint: the figures mean nothing
    if (random_seed) out["random_weights_seed"] = *random_seed;
    for (const Row& row : rows) {
      nlohmann::json j;
      // state_rel_err: each linear layer's state after the last segment (what splicing produced) vs full's;
      // query_state_rel_err: after the query too (fast-decaying heads forget the difference within the query).
      auto final_states = [](const SpliceResult& r) {
        std::vector<std::vector<float>> s;
        for (const auto& l : r.state.linear) s.push_back(l.ssm);
        return s;
      };
      const std::vector<double> errs = state_rel_errors(row.res.context_states, ref.res.context_states);
      const std::vector<double> query_errs = state_rel_errors(final_states(row.res), final_states(ref.res));
      double kl = 0;
      int top1 = 0;
      const size_t Tq = query.size();
      for (size_t t = 0; t < Tq; ++t) {
        const std::span<const float> lp(ref.res.logits.data() + t * V, V), lq(row.res.logits.data() + t * V, V);
        kl += kl_divergence(lp, lq);
        top1 += argmax(lp) == argmax(lq);
      }
      int same = 0, prefix_match = 0;
      bool diverged = false;
      for (size_t i = 0; i < row.greedy_ids.size(); ++i) {
        const bool eq = row.greedy_ids[i] == ref.greedy_ids[i];
        same += eq;
        if (!eq) diverged = true;
        if (!diverged) ++prefix_match;
      }
      j["state_rel_err"] = errs;
      j["query_state_rel_err"] = query_errs;
      j["kl"] = kl / static_cast<double>(Tq);
      j["top1_agreement"] = static_cast<double>(top1) / static_cast<double>(Tq);
      j["greedy_agreement"] = row.greedy_ids.empty() ? 1.0 : double(same) / double(row.greedy_ids.size());
      j["greedy_prefix_match"] = prefix_match;
      j["greedy_ids"] = row.greedy_ids;
      j["seconds"] = row.seconds;
      j["computed_tokens"] = row.res.computed_tokens;
      out["modes"][splice_mode_name(row.mode)] = j;
    }
    if (as_json) {
      std::cout << out.dump(2) << "\n";
      return 0;
    }
    std::printf("hypic-eval: %zu segments, %lld prompt tokens (query %zu), w = %d, entries built in %.3f s\n",
                segments.size(), static_cast<long long>(out["prompt_tokens"].get<int64_t>()), query.size(),
                seam_width, build_seconds);
    std::printf("%-11s %10s %10s %8s %8s %9s %9s\n", "mode", "KL", "top1", "greedy", "computed", "seconds",
                "max_err");
    for (const Row& row : rows) {
      const auto& j = out["modes"][splice_mode_name(row.mode)];
      double mx = 0;
      for (double e : j["state_rel_err"]) mx = std::max(mx, e);
      std::printf("%-11s %10.3e %10.3f %8.3f %8lld %9.4f %9.2e\n", splice_mode_name(row.mode), j["kl"].get<double>(),
                  j["top1_agreement"].get<double>(), j["greedy_agreement"].get<double>(),
                  static_cast<long long>(j["computed_tokens"].get<int64_t>()), j["seconds"].get<double>(), mx);
    }
    std::printf("\nrelative error of each linear layer's state after the last segment vs full:\n%-11s", "mode");
    const size_t L = rows.front().res.state.linear.size();
    for (size_t l = 0; l < L; ++l) std::printf("  lin%-5zu", l);
    std::printf("\n");
    for (const Row& row : rows) {
      std::printf("%-11s", splice_mode_name(row.mode));
      for (double e : out["modes"][splice_mode_name(row.mode)]["state_rel_err"]) std::printf("  %8.2e", e);
      std::printf("\n");
    }
    if (random_seed)
      std::printf("\nRANDOM WEIGHTS (hypic-model init, seed %s): the generated text and these agreement figures say "
                  "nothing about a trained model's answer quality.\n", random_seed->c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hypic-eval: error: %s\n", e.what());
    return 2;
  }
}
