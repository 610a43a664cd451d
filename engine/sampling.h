// Next-token sampling and stop conditions for decoding.
//
// Sampler: temperature, top-k and top-p (nucleus, Holtzman et al. 2020) over raw fp32 logits, in
// that order (the order of Hugging Face's TemperatureLogitsWarper -> TopKLogitsWarper ->
// TopPLogitsWarper). temperature == 0 is greedy decoding (argmax, lowest id on ties; top_k and top_p
// are then irrelevant). Otherwise the draw is fully determined by the seed: a std::mt19937_64
// (its output sequence is fixed by the C++ standard) gives u = (x >> 11) * 2^-53 in [0, 1), and
// the token is the first candidate whose cumulative probability exceeds u. Candidates are walked
// in id order when no filter is active, else in order of decreasing probability (ties: lower id
// first); the distribution is the same either way.
//
// StopStringMatcher: finds stop strings in streamed text, holding back any tail that could still
// become a stop string, so that no byte of a stop string is ever emitted.
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace hypic::engine {

struct SamplingConfig {
  float temperature = 0.0f;  ///< >= 0; 0 = greedy
  int top_k = 0;             ///< >= 0; 0 = keep every token
  float top_p = 1.0f;        ///< in (0, 1]; 1 = keep every token
  uint64_t seed = 0;         ///< seeds the generator (ignored when greedy)
  std::vector<int32_t> stop_token_ids;  ///< sampling one of these ends decoding
  /// Throws std::invalid_argument naming the field and value (negative temperature or top_k,
  /// top_p outside (0, 1], non-finite values, negative stop ids).
  void validate() const;
};

class Sampler {
 public:
  /// Validates `config` (see SamplingConfig::validate) and seeds the generator.
  explicit Sampler(SamplingConfig config);
  /// The next token from logits [V] (fp32, before any softmax). Advances the generator by one draw
  /// unless greedy: pick(logits, config(), next_uniform()). Throws std::invalid_argument for empty logits or a NaN
  /// logit (naming its id).
  int32_t sample(std::span<const float> logits);
  /// The next uniform draw u = (x >> 11) * 2^-53 in [0, 1) of the generator (advances it by one): what sample()
  /// draws, for a caller that picks the token elsewhere (Backend::decode_step's sampling rows).
  double next_uniform();
  /// The token a draw u in [0, 1) selects from logits [V] under `config` (temperature > 0): the first candidate of
  /// distribution(logits, config) whose cumulative probability exceeds u (rounding that leaves the total below u:
  /// the last candidate with non-zero probability). With temperature 0 the argmax. Throws like distribution().
  static int32_t pick(std::span<const float> logits, const SamplingConfig& config, double u);
  bool is_stop_token(int32_t id) const;
  const SamplingConfig& config() const { return cfg_; }

  /// The candidate distribution the sampler draws from (temperature > 0): (id, probability) pairs
  /// in walk order, probabilities summing to 1. With temperature == 0, the single argmax with
  /// probability 1. Throws like sample().
  static std::vector<std::pair<int32_t, double>> distribution(std::span<const float> logits,
                                                              const SamplingConfig& config);

 private:
  SamplingConfig cfg_;
  std::mt19937_64 rng_;
};

/// Index of the largest logit (lowest index on ties). Throws std::invalid_argument for empty
/// logits or a NaN.
int32_t argmax(std::span<const float> logits);

/// Stop-string matching on decoded text, fed delta by delta (UTF-8 in, UTF-8 out).
class StopStringMatcher {
 public:
  /// `stops`: the stop strings; each non-empty (std::invalid_argument naming its index otherwise).
  explicit StopStringMatcher(std::vector<std::string> stops);
  struct Result {
    std::string text;      ///< text that can be emitted now
    bool stopped = false;  ///< a stop string was found; `text` ends right before it
  };
  /// Appends `delta`. Returns the text that can no longer be part of a stop string; once a stop
  /// string is complete, everything from its start on is dropped and `stopped` is true (later
  /// calls return nothing and stopped = true). When several stop strings occur, the one that
  /// completes first wins (ties: the longer), so the result does not depend on how the text was
  /// split into deltas.
  Result push(std::string_view delta);
  /// At the end of decoding: the text still held back (it did not turn into a stop string).
  std::string flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

}  // namespace hypic::engine
