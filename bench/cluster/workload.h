// Workload generator of the cluster benchmark: segments of chosen or random lengths, drawn from a seeded
// RNG either as random token ids over a tokenizer's vocabulary or as windows of real text, every segment
// new to the generator; prompts mixing warm (already sent) and cold (new) segments at a hit ratio; and
// Poisson arrival times for open-loop load.
//
// Determinism: everything derives from one 64-bit seed through std::mt19937_64 (whose output sequence the
// C++ standard fixes); the distributions are computed here rather than with <random>'s distribution
// classes (whose algorithms are implementation-defined), so a seed gives the same workload on every
// platform and standard library.
#pragma once
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace hypic::bench {

/// Segment length in tokens: fixed (min == max) or uniform in [min, max].
struct LengthSpec {
  int64_t min = 0, max = 0;
};

/// Parses "512" (fixed) or "256:1024" (uniform range, inclusive). Throws std::invalid_argument naming
/// `flag` for anything else, a length < 1, or min > max.
LengthSpec parse_length_spec(std::string_view text, std::string_view flag);

/// Parses a comma-separated list of positive numbers ("0.5,1,2"). Throws std::invalid_argument naming
/// `flag` for an empty list, a malformed item or a value <= 0.
std::vector<double> parse_positive_list(std::string_view text, std::string_view flag);

/// Uniform integer in [lo, hi] (inclusive) from `rng`; lo <= hi. The modulo bias is below 2^-40 for
/// ranges under 2^24, negligible here.
int64_t uniform_int(std::mt19937_64& rng, int64_t lo, int64_t hi);
/// Uniform double in [0, 1) with 53 random bits.
double uniform_unit(std::mt19937_64& rng);

/// Fisher-Yates shuffle driven by uniform_int (deterministic across standard libraries).
template <class T>
void shuffle(std::vector<T>& v, std::mt19937_64& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[size_t(uniform_int(rng, 0, int64_t(i) - 1))]);
}

/// Arrival times (seconds from the start) of n requests of a Poisson process with `rate` requests per
/// second: exponential gaps -ln(1 - U) / rate. Throws std::invalid_argument if rate <= 0 or n < 0.
std::vector<double> poisson_arrivals(double rate, int n, std::mt19937_64& rng);

/// Draws segments (token ids) that this source has never returned before.
class SegmentSource {
 public:
  /// Random ids, uniform over the tokenizer's ids that are not special tokens (ids below
  /// tokenizer.vocab_size() that have a token string). Cost-wise a segment is its token count, so
  /// random ids measure the same prefill work as text of that length.
  static SegmentSource random_ids(const engine::Tokenizer& tokenizer, uint64_t seed);
  /// Windows of real text: the files are tokenised (add_special_tokens = false) and concatenated in the
  /// order given; a segment is the run of ids starting at a random offset. Throws std::runtime_error for
  /// an unreadable file and std::invalid_argument when the files hold no tokens.
  static SegmentSource corpus(const engine::Tokenizer& tokenizer, const std::vector<std::filesystem::path>& files,
                              uint64_t seed);

  /// A segment of `tokens` ids whose content differs from every segment returned before. Throws
  /// std::invalid_argument if tokens < 1 or (corpus) exceeds the corpus length, std::runtime_error if no
  /// new content was found in 1000 draws (a corpus too small for that many distinct windows).
  std::vector<int32_t> fresh(int64_t tokens);
  /// A length drawn from `spec`.
  int64_t draw_length(const LengthSpec& spec) { return uniform_int(rng_, spec.min, spec.max); }
  std::mt19937_64& rng() { return rng_; }
  /// "random token ids over 151643 ids" or "windows of 3 text files (25000 tokens)".
  const std::string& description() const { return description_; }

 private:
  SegmentSource(uint64_t seed, std::vector<int32_t> pool, bool windows, std::string description);
  std::mt19937_64 rng_;
  std::vector<int32_t> pool_;  // ids to draw from (random) or the corpus token stream (windows)
  bool windows_ = false;
  std::string description_;
  std::unordered_set<uint64_t> seen_;  // XXH3-64 of every returned segment
};

}  // namespace hypic::bench
