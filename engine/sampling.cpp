#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace hypic::engine {

void SamplingConfig::validate() const {
  if (!std::isfinite(temperature) || temperature < 0.0f) {
    throw std::invalid_argument("temperature: must be a finite number >= 0, got " + std::to_string(temperature));
  }
  if (top_k < 0) throw std::invalid_argument("top_k: must be >= 0 (0 disables it), got " + std::to_string(top_k));
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    throw std::invalid_argument("top_p: must be in (0, 1], got " + std::to_string(top_p));
  }
  for (size_t i = 0; i < stop_token_ids.size(); ++i) {
    if (stop_token_ids[i] < 0) {
      throw std::invalid_argument("stop_token_ids[" + std::to_string(i) + "]: must be >= 0, got " +
                                  std::to_string(stop_token_ids[i]));
    }
  }
}

namespace {
void check_logits(std::span<const float> logits) {
  if (logits.empty()) throw std::invalid_argument("logits: empty");
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) throw std::invalid_argument("logits: NaN at token id " + std::to_string(i));
  }
}
}  // namespace

int32_t argmax(std::span<const float> logits) {
  check_logits(logits);
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

std::vector<std::pair<int32_t, double>> Sampler::distribution(std::span<const float> logits,
                                                              const SamplingConfig& cfg) {
  check_logits(logits);
  if (cfg.temperature == 0.0f) return {{argmax(logits), 1.0}};
  const size_t V = logits.size();
  std::vector<std::pair<int32_t, double>> cand(V);  // (id, scaled logit), then (id, probability)
  for (size_t i = 0; i < V; ++i) cand[i] = {static_cast<int32_t>(i), double(logits[i]) / double(cfg.temperature)};
  const auto by_score = [](const auto& a, const auto& b) { return a.second > b.second || (a.second == b.second && a.first < b.first); };
  bool sorted = false;
  if (cfg.top_k > 0 && size_t(cfg.top_k) < V) {
    std::partial_sort(cand.begin(), cand.begin() + cfg.top_k, cand.end(), by_score);
    cand.resize(size_t(cfg.top_k));
    sorted = true;
  }
  // Softmax (max-subtracted; -inf logits get probability 0).
  double mx = -INFINITY;
  for (const auto& c : cand) mx = std::max(mx, c.second);
  if (!std::isfinite(mx)) throw std::invalid_argument("logits: no finite logit to sample from");
  double z = 0.0;
  for (auto& c : cand) {
    c.second = std::exp(c.second - mx);
    z += c.second;
  }
  for (auto& c : cand) c.second /= z;
  if (cfg.top_p < 1.0f) {
    if (!sorted) std::sort(cand.begin(), cand.end(), by_score);
    double cum = 0.0;
    size_t keep = 0;
    while (keep < cand.size()) {
      cum += cand[keep].second;
      ++keep;
      if (cum >= double(cfg.top_p)) break;
    }
    cand.resize(keep);
    for (auto& c : cand) c.second /= cum;
  }
  return cand;
}

Sampler::Sampler(SamplingConfig config) : cfg_(std::move(config)), rng_(cfg_.seed) { cfg_.validate(); }

int32_t Sampler::sample(std::span<const float> logits) {
  if (cfg_.temperature == 0.0f) return argmax(logits);
  check_logits(logits);  // (before the draw, as before pick existed)
  return pick(logits, cfg_, next_uniform());
}

double Sampler::next_uniform() { return double(rng_() >> 11) * 0x1.0p-53; }  // uniform in [0, 1), 53 random bits

int32_t Sampler::pick(std::span<const float> logits, const SamplingConfig& cfg, double u) {
  if (cfg.temperature == 0.0f) return argmax(logits);
  const auto cand = distribution(logits, cfg);
  double cum = 0.0;
  for (const auto& [id, p] : cand) {
    cum += p;
    if (u < cum) return id;
  }
  // Rounding left the total a hair below u: the last candidate with non-zero probability.
  for (auto it = cand.rbegin(); it != cand.rend(); ++it) {
    if (it->second > 0.0) return it->first;
  }
  return cand.back().first;
}

bool Sampler::is_stop_token(int32_t id) const {
  return std::find(cfg_.stop_token_ids.begin(), cfg_.stop_token_ids.end(), id) != cfg_.stop_token_ids.end();
}

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (size_t i = 0; i < stops_.size(); ++i) {
    if (stops_[i].empty()) throw std::invalid_argument("stop[" + std::to_string(i) + "]: empty stop string");
  }
}

StopStringMatcher::Result StopStringMatcher::push(std::string_view delta) {
  if (stopped_) return {"", true};
  pending_.append(delta);
  // The occurrence that completes first (smallest end; on a tie the longer one, which starts
  // earlier): what a token-by-token check would find first, whatever the delta boundaries.
  size_t hit = std::string::npos, hit_end = std::string::npos;
  for (const auto& s : stops_) {
    const size_t pos = pending_.find(s);
    if (pos == std::string::npos) continue;
    if (pos + s.size() < hit_end || (pos + s.size() == hit_end && pos < hit)) {
      hit = pos;
      hit_end = pos + s.size();
    }
  }
  if (hit != std::string::npos) {
    stopped_ = true;
    Result r{pending_.substr(0, hit), true};
    pending_.clear();
    return r;
  }
  // Hold back the longest suffix of pending_ that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const auto& s : stops_) {
    for (size_t len = std::min(s.size() - 1, pending_.size()); len > hold; --len) {
      if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  Result r{pending_.substr(0, pending_.size() - hold), false};
  pending_.erase(0, pending_.size() - hold);
  return r;
}

std::string StopStringMatcher::flush() {
  std::string out;
  if (!stopped_) out.swap(pending_);
  pending_.clear();
  return out;
}

}  // namespace hypic::engine
