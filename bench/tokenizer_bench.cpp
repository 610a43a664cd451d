// hypic-bench-tokenizer: encode throughput of tokenizer/tokenizer.h on text files, single-threaded.
//
//   hypic-bench-tokenizer --tokenizer tokenizer.json --text a.txt [--text b.txt ...]
//                         [--chunk-bytes 65536] [--passes 5] [--json out.json] [--ids-out ids.bin]
//
// Each file is cut into segments of at most --chunk-bytes bytes (at the last newline inside the
// limit, else at a UTF-8 character boundary), the way the router tokenises documents segment by
// segment, and every segment is encoded with add_special_tokens=false. Per file a fresh tokenizer
// (empty word cache) runs pass 1 ("cold"), then passes 2..N reuse it ("warm", best time kept).
// Prints a table on stderr and a JSON object on stdout (also written to --json) with bytes, tokens, seconds, MB/s
// (1e6 bytes) and tokens/s, and the segment boundaries so that tools/bench_tokenizer_hf.py can
// time Hugging Face tokenizers on exactly the same segments. --ids-out writes every id of pass 1
// as little-endian int32, files and segments in order.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"
#include "engine/io_error.h"
#include "proto/rpc/flags.h"

namespace {

using Clock = std::chrono::steady_clock;

std::string read_file(const std::string& path) { return hypic::engine::read_file_bytes(path); }

/// Segment boundaries [begin, end) of at most max_bytes each (see the file comment).
std::vector<std::pair<size_t, size_t>> cut_segments(const std::string& text, size_t max_bytes) {
  std::vector<std::pair<size_t, size_t>> out;
  size_t b = 0;
  while (b < text.size()) {
    size_t e = std::min(text.size(), b + max_bytes);
    if (e < text.size()) {
      const size_t nl = text.rfind('\n', e - 1);
      if (nl != std::string::npos && nl >= b) {
        e = nl + 1;
      } else {
        while (e > b && (static_cast<unsigned char>(text[e]) & 0xC0) == 0x80) --e;  // UTF-8 boundary
        if (e == b) e = std::min(text.size(), b + max_bytes);
      }
    }
    out.emplace_back(b, e);
    b = e;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Single-threaded encode throughput of the hypic tokenizer"};
  std::string tokenizer_path, json_out, ids_out;
  std::vector<std::string> texts;
  size_t chunk_bytes = 65536;
  int passes = 5;
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json")->required()->check(CLI::ExistingFile);
  app.add_option("--text", texts, "UTF-8 text file(s) to encode")->required()->check(CLI::ExistingFile);
  hypic::rpc::add_strict_int_option(app, "--chunk-bytes", chunk_bytes, 1, size_t{1} << 30,
                                    "maximum segment size in bytes");
  hypic::rpc::add_strict_int_option(app, "--passes", passes, 2, 100, "passes per file (first cold, rest warm)");
  app.add_option("--json", json_out, "also write the JSON result here");
  app.add_option("--ids-out", ids_out, "write the ids of pass 1 (int32 little-endian)");
  CLI11_PARSE(app, argc, argv);

  try {
    std::ofstream ids_file;
    if (!ids_out.empty()) {
      ids_file.open(ids_out, std::ios::binary);
      if (!ids_file) throw std::runtime_error("cannot write " + ids_out);
    }
    nlohmann::json result;
    result["tool"] = "hypic-bench-tokenizer";
    result["tokenizer"] = tokenizer_path;
    result["chunk_bytes"] = chunk_bytes;
    result["passes"] = passes;
    result["files"] = nlohmann::json::array();

    std::fprintf(stderr, "%-28s %10s %9s %10s %9s %9s %12s %12s\n", "file", "bytes", "segments", "tokens", "cold MB/s",
                "warm MB/s", "cold tok/s", "warm tok/s");
    for (const std::string& path : texts) {
      const std::string text = read_file(path);
      if (const auto bad = hypic::engine::find_invalid_utf8(text)) {
        throw std::runtime_error(path + ": invalid UTF-8 at byte offset " + std::to_string(*bad));
      }
      const auto segs = cut_segments(text, chunk_bytes);
      const auto t_load0 = Clock::now();
      const auto tok = hypic::engine::Tokenizer::load(tokenizer_path);  // fresh: empty word cache
      const double load_s = std::chrono::duration<double>(Clock::now() - t_load0).count();

      std::vector<int32_t> ids;
      ids.reserve(text.size() / 2);
      std::vector<double> times;
      size_t tokens = 0;
      for (int p = 0; p < passes; ++p) {
        ids.clear();
        const auto t0 = Clock::now();
        for (const auto& [b, e] : segs) tok.encode_into(std::string_view(text).substr(b, e - b), false, ids);
        times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        if (p == 0) {
          tokens = ids.size();
          if (ids_file) ids_file.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
        } else if (ids.size() != tokens) {
          throw std::runtime_error(path + ": pass " + std::to_string(p) + " gave a different token count");
        }
      }
      const double cold = times[0];
      const double warm = *std::min_element(times.begin() + 1, times.end());
      const double mb = static_cast<double>(text.size()) / 1e6;
      nlohmann::json f;
      f["file"] = path;
      f["bytes"] = text.size();
      f["segments"] = segs.size();
      f["tokens"] = tokens;
      f["load_seconds"] = load_s;
      f["cold_seconds"] = cold;
      f["warm_seconds"] = warm;
      f["all_seconds"] = times;
      f["cold_mb_per_s"] = mb / cold;
      f["warm_mb_per_s"] = mb / warm;
      f["cold_tokens_per_s"] = static_cast<double>(tokens) / cold;
      f["warm_tokens_per_s"] = static_cast<double>(tokens) / warm;
      f["segment_bounds"] = segs;
      result["files"].push_back(f);
      std::string name = path.size() > 28 ? "..." + path.substr(path.size() - 25) : path;
      std::fprintf(stderr, "%-28s %10zu %9zu %10zu %9.2f %9.2f %12.0f %12.0f\n", name.c_str(), text.size(), segs.size(), tokens,
                  mb / cold, mb / warm, tokens / cold, tokens / warm);
    }
    if (!json_out.empty()) {
      std::ofstream jf(json_out);
      jf << result.dump(1) << "\n";
      if (!jf) throw std::runtime_error("cannot write " + json_out);
    }
    // Keep stdout readable: the JSON on stdout leaves out the segment bounds.
    for (auto& f : result["files"]) f.erase("segment_bounds");
    std::cout << result.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hypic-bench-tokenizer: %s\n", e.what());
    return 1;
  }
}
