#include "bench/cluster/workload.h"
#include "engine/io_error.h"
#include "proto/rpc/flags.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <xxhash.h>

namespace hypic::bench {

LengthSpec parse_length_spec(std::string_view text, std::string_view flag) {
  LengthSpec spec;
  // Signed, so that "0" and "-3" get the message below; whole decimal numbers only (rpc/flags.h).
  const auto number = [flag](std::string_view t) {
    return rpc::require_decimal<int64_t>(t, flag, INT64_MIN, INT64_MAX);
  };
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos) {
    spec.min = spec.max = number(text);
  } else {
    spec.min = number(text.substr(0, colon));
    spec.max = number(text.substr(colon + 1));
  }
  if (spec.min < 1) throw std::invalid_argument(fmt::format("{}: lengths must be >= 1 token, got '{}'", flag, text));
  if (spec.min > spec.max) {
    throw std::invalid_argument(fmt::format("{}: range '{}' has its minimum above its maximum", flag, text));
  }
  return spec;
}

std::vector<double> parse_positive_list(std::string_view text, std::string_view flag) {
  std::vector<double> out;
  std::stringstream ss{std::string(text)};
  std::string item;
  while (std::getline(ss, item, ',')) {
    // Finite decimal numbers only (rpc/flags.h): no blanks, hex, "inf" or "nan".
    const auto v = rpc::parse_finite_real(item, 0, std::numeric_limits<double>::max());
    if (!v || !(*v > 0)) throw std::invalid_argument(fmt::format("{}: '{}' is not a positive number", flag, item));
    out.push_back(*v);
  }
  if (out.empty()) throw std::invalid_argument(fmt::format("{}: the list is empty", flag));
  return out;
}

int64_t uniform_int(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  if (lo > hi) throw std::invalid_argument(fmt::format("uniform_int: empty range [{}, {}]", lo, hi));
  const uint64_t span = uint64_t(hi - lo) + 1;
  return lo + int64_t(span == 0 ? rng() : rng() % span);
}

double uniform_unit(std::mt19937_64& rng) { return double(rng() >> 11) * 0x1.0p-53; }

std::vector<double> poisson_arrivals(double rate, int n, std::mt19937_64& rng) {
  if (!(rate > 0) || !std::isfinite(rate)) throw std::invalid_argument(fmt::format("arrival rate must be > 0, got {}", rate));
  if (n < 0) throw std::invalid_argument(fmt::format("request count must be >= 0, got {}", n));
  std::vector<double> t(static_cast<size_t>(n));
  double now = 0;
  for (int i = 0; i < n; ++i) {
    now += -std::log1p(-uniform_unit(rng)) / rate;
    t[size_t(i)] = now;
  }
  return t;
}

SegmentSource::SegmentSource(uint64_t seed, std::vector<int32_t> pool, bool windows, std::string description)
    : rng_(seed), pool_(std::move(pool)), windows_(windows), description_(std::move(description)) {}

SegmentSource SegmentSource::random_ids(const engine::Tokenizer& tokenizer, uint64_t seed) {
  std::vector<int32_t> ids;
  for (size_t id = 0; id < tokenizer.vocab_size(); ++id) {
    if (!tokenizer.is_special(int32_t(id)) && tokenizer.id_to_token(int32_t(id))) ids.push_back(int32_t(id));
  }
  if (ids.empty()) throw std::invalid_argument("random_ids: the tokenizer has no ordinary tokens");
  const std::string desc = fmt::format("random token ids, uniform over {} ordinary ids of the tokenizer", ids.size());
  return SegmentSource(seed, std::move(ids), false, desc);
}

SegmentSource SegmentSource::corpus(const engine::Tokenizer& tokenizer, const std::vector<std::filesystem::path>& files,
                                    uint64_t seed) {
  std::vector<int32_t> stream;
  for (const auto& f : files) {
    tokenizer.encode_into(engine::read_file_bytes(f, "--corpus: cannot read "), false, stream);
  }
  if (stream.empty()) throw std::invalid_argument("--corpus: the files hold no tokens");
  const std::string desc = fmt::format("windows of real text: {} file(s), {} tokens", files.size(), stream.size());
  return SegmentSource(seed, std::move(stream), true, desc);
}

std::vector<int32_t> SegmentSource::fresh(int64_t tokens) {
  if (tokens < 1) throw std::invalid_argument(fmt::format("segment length must be >= 1, got {}", tokens));
  if (windows_ && tokens > int64_t(pool_.size())) {
    throw std::invalid_argument(fmt::format("segment of {} tokens requested but the corpus has only {} tokens", tokens,
                                            pool_.size()));
  }
  std::vector<int32_t> out(static_cast<size_t>(tokens));
  for (int attempt = 0; attempt < 1000; ++attempt) {
    if (windows_) {
      const int64_t off = uniform_int(rng_, 0, int64_t(pool_.size()) - tokens);
      std::copy(pool_.begin() + off, pool_.begin() + off + tokens, out.begin());
    } else {
      for (auto& id : out) id = pool_[size_t(uniform_int(rng_, 0, int64_t(pool_.size()) - 1))];
    }
    if (seen_.insert(XXH3_64bits(out.data(), out.size() * sizeof(int32_t))).second) return out;
  }
  throw std::runtime_error(fmt::format("no new segment of {} tokens in 1000 draws from {} ({} segments drawn so far): "
                                       "give a larger corpus or shorter segments",
                                       tokens, description_, seen_.size()));
}

}  // namespace hypic::bench
