// Sampler (greedy, temperature, top-k, top-p, seeded determinism) and stop-string matching.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <random>

#include "engine/sampling.h"

using hypic::engine::argmax;
using hypic::engine::Sampler;
using hypic::engine::SamplingConfig;
using hypic::engine::StopStringMatcher;

namespace {
std::vector<double> softmax(const std::vector<float>& l, double T) {
  std::vector<double> p(l.size());
  double z = 0;
  for (size_t i = 0; i < l.size(); ++i) z += p[i] = std::exp(l[i] / T);
  for (auto& x : p) x /= z;
  return p;
}
}  // namespace

TEST_CASE("temperature 0 is greedy argmax with the lowest id on ties", "[sampling]") {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.9f};
  CHECK(argmax(logits) == 1);
  for (uint64_t seed : {0ull, 1ull, 99ull}) {
    Sampler s(SamplingConfig{.temperature = 0.0f, .top_k = 3, .top_p = 0.2f, .seed = seed});
    for (int i = 0; i < 5; ++i) CHECK(s.sample(logits) == 1);
  }
  const auto d = Sampler::distribution(logits, SamplingConfig{});
  REQUIRE(d.size() == 1);
  CHECK(d[0].first == 1);
  CHECK(d[0].second == 1.0);
}

TEST_CASE("a draw follows the documented generator contract", "[sampling]") {
  // No filter: candidates walked in id order; u = (mt19937_64 output >> 11) * 2^-53.
  const std::vector<float> logits = {0.3f, -0.2f, 1.1f, 0.0f};
  const double T = 0.8;
  const auto p = softmax(logits, T);
  Sampler s(SamplingConfig{.temperature = float(T), .seed = 1234});
  std::mt19937_64 ref(1234);
  for (int draw = 0; draw < 200; ++draw) {
    const double u = double(ref() >> 11) * 0x1.0p-53;
    int expected = 3;
    double cum = 0;
    for (int i = 0; i < 4; ++i) {
      cum += p[size_t(i)];
      if (u < cum) {
        expected = i;
        break;
      }
    }
    REQUIRE(s.sample(logits) == expected);
  }
}

TEST_CASE("next_uniform and pick split a draw: pick at the reference u, the walk order of each filter", "[sampling]") {
  // u from the documented generator contract; pick walks the candidates in id order without a filter, else by
  // decreasing probability (ties: lower id first).
  const std::vector<float> logits = {0.3f, 1.1f, -0.2f, 1.1f, 0.0f};
  std::mt19937_64 ref(77);
  Sampler s(SamplingConfig{.temperature = 0.7f, .seed = 77});
  for (int draw = 0; draw < 50; ++draw) REQUIRE(s.next_uniform() == double(ref() >> 11) * 0x1.0p-53);
  // Hand-computed walks at T = 1: p = softmax(logits).
  const auto p = softmax(logits, 1.0);
  const SamplingConfig plain{.temperature = 1.0f};
  CHECK(Sampler::pick(logits, plain, 0.0) == 0);                      // id order: token 0 first
  CHECK(Sampler::pick(logits, plain, p[0] + 0.5 * p[1]) == 1);
  CHECK(Sampler::pick(logits, plain, 1.0 - 0.5 * p[4]) == 4);
  const SamplingConfig topk{.temperature = 1.0f, .top_k = 2};           // {1, 3} (tie at 1.1: id 1 first), 1/2 each
  CHECK(Sampler::pick(logits, topk, 0.0) == 1);
  CHECK(Sampler::pick(logits, topk, 0.49) == 1);
  CHECK(Sampler::pick(logits, topk, 0.51) == 3);
  const SamplingConfig topp{.temperature = 1.0f, .top_p = 0.3f};       // p[1] = 0.31 > 0.3: {1} alone
  REQUIRE(p[1] >= 0.3);
  CHECK(Sampler::pick(logits, topp, 0.99) == 1);
  // sample() is pick at the next draw.
  Sampler a(SamplingConfig{.temperature = 1.3f, .top_k = 3, .top_p = 0.9f, .seed = 5});
  Sampler b(SamplingConfig{.temperature = 1.3f, .top_k = 3, .top_p = 0.9f, .seed = 5});
  for (int i = 0; i < 100; ++i) REQUIRE(a.sample(logits) == Sampler::pick(logits, b.config(), b.next_uniform()));
}

TEST_CASE("same seed gives the same tokens, another seed other tokens", "[sampling]") {
  std::vector<float> logits(64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = float(std::sin(double(i)));
  auto run = [&](uint64_t seed) {
    Sampler s(SamplingConfig{.temperature = 1.0f, .top_p = 0.95f, .seed = seed});
    std::vector<int32_t> out;
    for (int i = 0; i < 50; ++i) out.push_back(s.sample(logits));
    return out;
  };
  CHECK(run(7) == run(7));
  CHECK(run(7) != run(8));
}

TEST_CASE("sampled frequencies match softmax(logits / T)", "[sampling]") {
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, -1.0f};
  const double T = 0.7;
  const auto p = softmax(logits, T);
  Sampler s(SamplingConfig{.temperature = float(T), .seed = 42});
  const int N = 100000;
  std::vector<int> count(4, 0);
  for (int i = 0; i < N; ++i) ++count[size_t(s.sample(logits))];
  for (size_t i = 0; i < 4; ++i) {
    const double sigma = std::sqrt(p[i] * (1 - p[i]) / N);
    CHECK(std::abs(double(count[i]) / N - p[i]) < 5 * sigma);
  }
}

TEST_CASE("top-k keeps the k most likely tokens, renormalised", "[sampling]") {
  const std::vector<float> logits = {3.0f, 1.0f, 2.0f, 0.0f};
  const auto d = Sampler::distribution(logits, SamplingConfig{.temperature = 1.0f, .top_k = 2});
  REQUIRE(d.size() == 2);
  const double z = std::exp(3.0) + std::exp(2.0);
  CHECK(d[0].first == 0);
  CHECK(d[0].second == Approx(std::exp(3.0) / z).epsilon(1e-12));
  CHECK(d[1].first == 2);
  CHECK(d[1].second == Approx(std::exp(2.0) / z).epsilon(1e-12));
  // Never draws outside the kept set.
  Sampler s(SamplingConfig{.temperature = 5.0f, .top_k = 2, .seed = 3});
  for (int i = 0; i < 2000; ++i) {
    const int32_t t = s.sample(logits);
    REQUIRE((t == 0 || t == 2));
  }
  // k >= V keeps everything.
  CHECK(Sampler::distribution(logits, SamplingConfig{.temperature = 1.0f, .top_k = 10}).size() == 4);
}

TEST_CASE("top-p keeps the smallest most-likely set reaching p", "[sampling]") {
  const std::vector<float> logits = {float(std::log(0.5)), float(std::log(0.3)), float(std::log(0.2))};
  auto d = Sampler::distribution(logits, SamplingConfig{.temperature = 1.0f, .top_p = 0.6f});
  REQUIRE(d.size() == 2);  // 0.5 < 0.6 <= 0.8
  CHECK(d[0].first == 0);
  CHECK(d[0].second == Approx(0.625).epsilon(1e-6));
  CHECK(d[1].first == 1);
  CHECK(d[1].second == Approx(0.375).epsilon(1e-6));
  d = Sampler::distribution(logits, SamplingConfig{.temperature = 1.0f, .top_p = 0.45f});
  REQUIRE(d.size() == 1);
  CHECK(d[0].first == 0);
  // top-k first, then top-p on the renormalised survivors: {0.625, 0.375}, p = 0.9 keeps both.
  d = Sampler::distribution(logits, SamplingConfig{.temperature = 1.0f, .top_k = 2, .top_p = 0.9f});
  CHECK(d.size() == 2);
  d = Sampler::distribution(logits, SamplingConfig{.temperature = 1.0f, .top_k = 2, .top_p = 0.6f});
  CHECK(d.size() == 1);  // 0.625 >= 0.6
}

TEST_CASE("invalid sampling parameters and logits are rejected with the field named", "[sampling]") {
  auto msg = [](SamplingConfig c) {
    try {
      Sampler s(c);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK_THAT(msg({.temperature = -0.5f}), Catch::Contains("temperature"));
  CHECK_THAT(msg({.temperature = NAN}), Catch::Contains("temperature"));
  CHECK_THAT(msg({.top_k = -1}), Catch::Contains("top_k"));
  CHECK_THAT(msg({.top_p = 0.0f}), Catch::Contains("top_p"));
  CHECK_THAT(msg({.top_p = 1.5f}), Catch::Contains("top_p"));
  CHECK_THAT(msg({.stop_token_ids = {5, -2}}), Catch::Contains("stop_token_ids[1]"));
  Sampler s(SamplingConfig{.temperature = 1.0f});
  const std::vector<float> empty;
  CHECK_THROWS_AS(s.sample(empty), std::invalid_argument);
  const std::vector<float> nan = {0.0f, NAN};
  CHECK_THROWS_WITH(s.sample(nan), Catch::Contains("token id 1"));
  CHECK_THROWS_WITH(argmax(nan), Catch::Contains("token id 1"));
}

TEST_CASE("stop token ids", "[sampling]") {
  Sampler s(SamplingConfig{.stop_token_ids = {151645, 151643}});
  CHECK(s.is_stop_token(151643));
  CHECK_FALSE(s.is_stop_token(0));
}

TEST_CASE("stop strings: held back while they may still match, cut at the first match", "[sampling]") {
  StopStringMatcher m({"END", "\n\n"});
  auto r = m.push("Hello E");
  CHECK(r.text == "Hello ");
  CHECK_FALSE(r.stopped);
  r = m.push("x");  // "Ex" can no longer become a stop string
  CHECK(r.text == "Ex");
  r = m.push(" E");
  CHECK(r.text == " ");
  r = m.push("N");
  CHECK(r.text.empty());
  r = m.push("D and more");
  CHECK(r.text.empty());
  CHECK(r.stopped);
  CHECK(m.push("later").stopped);
  CHECK(m.flush().empty());

  StopStringMatcher m2({"é!"});
  CHECK(m2.push("café").text == "caf");  // the two bytes of é are held
  CHECK(m2.push("?").text == "é?");
  CHECK(m2.push("...é").text == "...");
  CHECK(m2.flush() == "é");

  CHECK_THROWS_WITH(StopStringMatcher({"a", ""}), Catch::Contains("stop[1]"));
}

TEST_CASE("stop strings: any split of the text gives the text cut at the earliest stop", "[sampling]") {
  const std::string text = "The answer is 42.\nThe end.\n\nIgnored STOP tail";
  const std::vector<std::string> stops = {"STOP", "end.\n\n", "nd.\n"};
  // Reference: in the whole text, the stop occurrence that ends first. "nd.\n" ends before
  // "end.\n\n" although the latter starts one byte earlier.
  size_t cut = std::string::npos, end = std::string::npos;
  for (const auto& s : stops) {
    const size_t pos = text.find(s);
    if (pos != std::string::npos && pos + s.size() < end) cut = pos, end = pos + s.size();
  }
  REQUIRE(cut == text.find("nd.\n"));
  const std::string expected = text.substr(0, cut);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    StopStringMatcher m(stops);
    std::string out;
    bool stopped = false;
    for (size_t pos = 0; pos < text.size() && !stopped;) {
      const size_t len = 1 + rng() % 5;
      auto r = m.push(std::string_view(text).substr(pos, len));
      out += r.text;
      stopped = r.stopped;
      pos += len;
    }
    CHECK(stopped);
    CHECK(out == expected);
  }
  // Without a match, everything comes out (flush releases the held tail).
  StopStringMatcher m({"XYZ"});
  std::string out = m.push("abcXY").text;
  out += m.flush();
  CHECK(out == "abcXY");
}
