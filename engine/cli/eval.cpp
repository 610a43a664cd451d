// hypic-eval: runs one multi-segment prompt through every splice mode and compares each with `full`
// (DESIGN.md 3.4): per linear layer the relative error of the final recurrent state, the KL divergence and
// top-1 agreement of the next-token distributions over the query positions, the greedy continuation's
// agreement, and the time spent.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "engine/model.h"
#include "engine/splice.h"
#include "engine/tokenizer.h"
#include "kernels/cpu/blas_env.h"

using namespace hypic::engine;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

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

std::vector<double> softmax(const float* logits, size_t V) {
  double mx = -INFINITY;
  for (size_t i = 0; i < V; ++i) mx = std::max(mx, double(logits[i]));
  std::vector<double> p(V);
  double z = 0;
  for (size_t i = 0; i < V; ++i) z += p[i] = std::exp(double(logits[i]) - mx);
  for (auto& x : p) x /= z;
  return p;
}

size_t argmax(const float* x, size_t V) { return static_cast<size_t>(std::max_element(x, x + V) - x); }

std::vector<int32_t> greedy(const Model& model, ModelState state, const std::vector<float>& last_logits,
                            int64_t pos, int n) {
  std::vector<int32_t> out;
  const size_t V = last_logits.size();
  std::vector<float> logits = last_logits;
  for (int i = 0; i < n; ++i) {
    const int32_t id = static_cast<int32_t>(argmax(logits.data(), V));
    out.push_back(id);
    if (i + 1 < n) logits = model.decode(state, id, pos++);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  hypic::kernels::cpu::reexec_with_recommended_blas_core(argv);  // before OpenBLAS is used
  CLI::App app{"hypic-eval: compare the splice modes (full, prefix, naive, transition, hypic) on one prompt"};
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
  app.add_option("--seam-width", seam_width, "seam window w in tokens (hypic mode)")->check(CLI::NonNegativeNumber);
  app.add_option("--max-new-tokens", max_new_tokens, "greedy continuation length compared per mode")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--modes", modes_text, "comma-separated modes; full is always run as the reference");
  app.add_flag("--json", as_json, "print one JSON object instead of tables");
  CLI11_PARSE(app, argc, argv);

  try {
    const auto t_load = Clock::now();
    const Model model = Model::load(model_dir);
    const double load_seconds = seconds_since(t_load);
    std::optional<Tokenizer> tok;
    if (!tokenizer_path.empty()) tok = Tokenizer::load(tokenizer_path);
    auto need_tok = [&](const char* what) -> const Tokenizer& {
      if (!tok) throw std::invalid_argument(std::string(what) + " needs --tokenizer");
      return *tok;
    };

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
    {
      std::stringstream ss(modes_text);
      std::string m;
      while (std::getline(ss, m, ','))
        if (!m.empty() && parse_splice_mode(m) != SpliceMode::Full) modes.push_back(parse_splice_mode(m));
    }

    // Entries: built once, standalone, shared by naive / transition / hypic (as a cache would hold them).
    const auto t_build = Clock::now();
    std::vector<SpliceSegment> segs;
    int64_t prompt_tokens = 0;
    for (const auto& ids : segments) {
      segs.push_back({ids, std::make_shared<const SegmentEntry>(build_segment_entry(model, ids, seam_width))});
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
      req.segments = segs;
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
      std::vector<int32_t> g = greedy(model, r.state, last, r.num_tokens, max_new_tokens);
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
    for (const Row& row : rows) {
      nlohmann::json j;
      // state_rel_err: each linear layer's state after the last segment (what splicing produced) vs full's;
      // query_state_rel_err: after the query too (fast-decaying heads forget the difference within the query).
      auto rel_errs = [](const auto& mine, const auto& theirs) {
        std::vector<double> errs;
        for (size_t l = 0; l < mine.size(); ++l) {
          const std::vector<float>& a = mine[l];
          const std::vector<float>& b = theirs[l];
          double num = 0, den = 0;
          for (size_t i = 0; i < a.size(); ++i) { num += (a[i] - b[i]) * double(a[i] - b[i]); den += double(b[i]) * b[i]; }
          errs.push_back(std::sqrt(num / std::max(den, 1e-300)));
        }
        return errs;
      };
      auto final_states = [](const SpliceResult& r) {
        std::vector<std::vector<float>> s;
        for (const auto& l : r.state.linear) s.push_back(l.ssm);
        return s;
      };
      const std::vector<double> errs = rel_errs(row.res.context_states, ref.res.context_states);
      const std::vector<double> query_errs = rel_errs(final_states(row.res), final_states(ref.res));
      double kl = 0;
      int top1 = 0;
      const size_t Tq = query.size();
      for (size_t t = 0; t < Tq; ++t) {
        const float* lp = ref.res.logits.data() + t * V;
        const float* lq = row.res.logits.data() + t * V;
        const auto p = softmax(lp, V), q = softmax(lq, V);
        double k = 0;
        for (size_t i = 0; i < V; ++i)
          if (p[i] > 0) k += p[i] * (std::log(p[i]) - std::log(std::max(q[i], 1e-300)));
        kl += k;
        top1 += argmax(lp, V) == argmax(lq, V);
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
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hypic-eval: error: %s\n", e.what());
    return 2;
  }
}
