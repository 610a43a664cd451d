// hypic-engine-reference: what the engine alone (no services, no cache, no network) generates for a
// request, the reference the cluster integration tests compare against. Greedy decoding only.
//
// Input (JSON file): {"segments": ["text", ...], "query": "text", "mode": "hypic", "seam_width": 8,
//                     "max_tokens": 16, "allow_special_tokens": false}
// A segment or the query may instead be {"tokens": [ids]} (token ids as they are, as hypic-client sends them: for
// models whose vocabulary the tokenizer does not fit, e.g. the 256-id family fixtures).
// Output (stdout): {"token_ids": [...], "prompt_tokens": N}
// Each segment is tokenised on its own (add_special_tokens = false; special-token strings as plain text
// unless allow_special_tokens, as the router does), its entry built standalone
// from position 0 (build_segment_entry; seam width w in hypic mode, 0 otherwise), the entries
// spliced with the query (splice), then greedy decoding: argmax (lowest id on ties) of the
// next-token logits, max_tokens tokens, no stop token.
#include <fstream>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include "engine/cpu/model.h"
#include "engine/cpu/splice.h"
#include "tokenizer/tokenizer.h"
#include "kernels/cpu/blas_env.h"

int main(int argc, char** argv) {
  hypic::kernels::cpu::reexec_with_recommended_blas_core(argv);  // the same GEMM kernels as the workers
  // stdout carries the JSON result only.
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("reference", std::make_shared<spdlog::sinks::stderr_sink_mt>()));
  CLI::App app{"engine-only reference generation for the cluster integration tests"};
  std::string model_dir, tokenizer_path, request_path;
  app.add_option("--model", model_dir, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json")->required()->check(CLI::ExistingFile);
  app.add_option("--request", request_path, "request JSON")->required()->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);
  try {
    std::ifstream in(request_path);
    const auto req = nlohmann::json::parse(in);
    const auto model = hypic::engine::Model::load(model_dir);
    const auto tok = hypic::engine::Tokenizer::load(tokenizer_path);
    hypic::engine::SpliceRequest sreq;
    sreq.mode = hypic::engine::parse_splice_mode(req.value("mode", std::string("hypic")));
    sreq.seam_width = req.value("seam_width", 8);
    const int entry_w = sreq.mode == hypic::engine::SpliceMode::Hypic ? sreq.seam_width : 0;
    const bool uses_entries = sreq.mode != hypic::engine::SpliceMode::Full && sreq.mode != hypic::engine::SpliceMode::Prefix;
    hypic::engine::PrefixStateCache prefix(size_t{1} << 30);
    sreq.prefix_cache = &prefix;
    // As the router tokenises text: special-token strings as plain text unless the request allows them.
    const auto special = req.value("allow_special_tokens", false) ? hypic::engine::SpecialTokens::Match
                                                                  : hypic::engine::SpecialTokens::Split;
    auto ids_of = [&](const nlohmann::json& s) {
      return s.is_object() ? s.at("tokens").get<std::vector<int32_t>>()
                           : tok.encode(s.get<std::string>(), false, special);
    };
    int64_t prompt = 0;
    for (const auto& s : req.at("segments")) {
      hypic::engine::SpliceSegment seg;
      seg.ids = ids_of(s);
      if (uses_entries) {
        seg.entry = std::make_shared<const hypic::engine::SegmentEntry>(
            hypic::engine::build_segment_entry(model, seg.ids, entry_w));
      }
      prompt += int64_t(seg.ids.size());
      sreq.segments.push_back(std::move(seg));
    }
    sreq.query = ids_of(req.at("query"));
    prompt += int64_t(sreq.query.size());
    auto res = hypic::engine::splice(model, sreq);
    std::vector<int32_t> out;
    std::vector<float> logits = std::move(res.logits);
    int64_t pos = res.num_tokens;
    const int max_tokens = req.value("max_tokens", 16);
    for (int i = 0; i < max_tokens; ++i) {
      int32_t best = 0;
      for (int32_t v = 1; v < int32_t(logits.size()); ++v)
        if (logits[size_t(v)] > logits[size_t(best)]) best = v;
      out.push_back(best);
      if (i + 1 < max_tokens) logits = model.decode(res.state, best, pos++);
    }
    std::cout << nlohmann::json{{"token_ids", out}, {"prompt_tokens", prompt}}.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "hypic-engine-reference: " << e.what() << "\n";
    return 1;
  }
}
