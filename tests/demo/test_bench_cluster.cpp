// Unit tests of the cluster benchmark's statistics and workload generator (bench/cluster).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "bench/cluster/stats.h"
#include "bench/cluster/workload.h"

using namespace hypic::bench;

namespace {

hypic::engine::Tokenizer tiny_tokenizer() {
  return hypic::engine::Tokenizer::load(std::filesystem::path(HYPIC_SOURCE_DIR) / "tests/fixtures/tokenizer/tiny_subword.json");
}

}  // namespace

TEST_CASE("percentile interpolates linearly between closest ranks (numpy's default)", "[bench]") {
  // Hand-computed with h = (n - 1) p / 100 on the sorted values 15 20 35 40 50.
  const std::vector<double> v = {40, 15, 50, 35, 20};  // unsorted on purpose
  CHECK(percentile(v, 0) == 15.0);
  CHECK(percentile(v, 40) == Approx(29.0));   // h = 1.6: 20 + 0.6 * 15
  CHECK(percentile(v, 50) == 35.0);           // h = 2
  CHECK(percentile(v, 90) == Approx(46.0));   // h = 3.6: 40 + 0.6 * 10
  CHECK(percentile(v, 99) == Approx(49.6));   // h = 3.96
  CHECK(percentile(v, 100) == 50.0);
  CHECK(percentile({7.5}, 99) == 7.5);
  CHECK_THROWS_AS(percentile({}, 50), std::invalid_argument);
  CHECK_THROWS_AS(percentile(v, 100.5), std::invalid_argument);
  CHECK_THROWS_AS(percentile(v, -1), std::invalid_argument);
  CHECK_THROWS_AS(percentile({1.0, std::nan("")}, 50), std::invalid_argument);
}

TEST_CASE("summarize gives n, mean, extremes and percentiles", "[bench]") {
  const Summary s = summarize({4, 1, 3, 2});
  CHECK(s.n == 4);
  CHECK(s.mean == Approx(2.5));
  CHECK(s.min == 1.0);
  CHECK(s.max == 4.0);
  CHECK(s.p50 == Approx(2.5));
  CHECK(s.p90 == Approx(3.7));  // h = 2.7
  const Summary empty = summarize({});
  CHECK(empty.n == 0);
  CHECK(empty.p90 == 0.0);
  const auto j = to_json(s);
  CHECK(j.at("p99").get<double>() == Approx(3.97));
}

TEST_CASE("length specs and rate lists parse or name the flag", "[bench]") {
  const LengthSpec fixed = parse_length_spec("512", "--segment-tokens");
  CHECK(fixed.min == 512);
  CHECK(fixed.max == 512);
  const LengthSpec range = parse_length_spec("256:1024", "--segment-tokens");
  CHECK(range.min == 256);
  CHECK(range.max == 1024);
  // Whole decimal numbers only (proto/rpc/flags.h): std::stoll took blanks, and "010" stays 10.
  CHECK(parse_length_spec("010:+020", "--segment-tokens").max == 20);
  for (const char* bad : {"0", "5:3", "abc", "12x", "", ":4", "-3", "0x10", " 512", "512 ", "1e3", "256:0x400", "+",
                          "99999999999999999999"}) {
    INFO(bad);
    CHECK_THROWS_WITH(parse_length_spec(bad, "--segment-tokens"), Catch::Contains("--segment-tokens"));
  }
  CHECK(parse_positive_list("0.5,1,2", "--rates") == std::vector<double>{0.5, 1.0, 2.0});
  CHECK(parse_positive_list("1e3,.5,+2", "--rates") == std::vector<double>{1000.0, 0.5, 2.0});
  // Finite decimal numbers only: std::stod read "0x10" as 16 and took blanks.
  for (const char* bad : {"", "1,,2", "-1", "0", "1,x", "nan", "inf", "1e400", "0x10", " 1", "1 ", "-0"}) {
    INFO(bad);
    CHECK_THROWS_WITH(parse_positive_list(bad, "--rates"), Catch::Contains("--rates"));
  }
}

TEST_CASE("uniform_int stays in range and reaches every value", "[bench]") {
  std::mt19937_64 rng(7);
  std::set<int64_t> seen;
  for (int i = 0; i < 2000; ++i) {
    const int64_t v = uniform_int(rng, -3, 4);
    REQUIRE(v >= -3);
    REQUIRE(v <= 4);
    seen.insert(v);
  }
  CHECK(seen.size() == 8);
  CHECK(uniform_int(rng, 5, 5) == 5);
  CHECK_THROWS_AS(uniform_int(rng, 2, 1), std::invalid_argument);
  for (int i = 0; i < 1000; ++i) {
    const double u = uniform_unit(rng);
    REQUIRE(u >= 0.0);
    REQUIRE(u < 1.0);
  }
}

TEST_CASE("shuffle permutes and is reproducible from the seed", "[bench]") {
  std::vector<int> a(50), b;
  for (int i = 0; i < 50; ++i) a[size_t(i)] = i;
  b = a;
  std::mt19937_64 r1(3), r2(3);
  shuffle(a, r1);
  shuffle(b, r2);
  CHECK(a == b);
  std::vector<int> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 50; ++i) REQUIRE(sorted[size_t(i)] == i);
  int fixed_points = 0;
  for (int i = 0; i < 50; ++i) fixed_points += a[size_t(i)] == i;
  CHECK(fixed_points < 50);
}

TEST_CASE("Poisson arrivals have exponential gaps of mean 1/rate", "[bench]") {
  std::mt19937_64 rng(11);
  const double rate = 4.0;
  const int n = 20000;
  const auto t = poisson_arrivals(rate, n, rng);
  REQUIRE(t.size() == size_t(n));
  int below_mean = 0;
  double prev = 0;
  for (double x : t) {
    REQUIRE(x > prev);
    below_mean += (x - prev) < 1.0 / rate;
    prev = x;
  }
  // Mean gap 1/rate (standard error 0.25/sqrt(n) = 0.0018, so 3% is over 4 sigma); P(gap < mean) = 1 - 1/e.
  CHECK(t.back() / n == Approx(1.0 / rate).epsilon(0.03));
  CHECK(double(below_mean) / n == Approx(1.0 - std::exp(-1.0)).epsilon(0.03));
  CHECK(poisson_arrivals(1.0, 0, rng).empty());
  CHECK_THROWS_AS(poisson_arrivals(0.0, 3, rng), std::invalid_argument);
  CHECK_THROWS_AS(poisson_arrivals(1.0, -1, rng), std::invalid_argument);
}

TEST_CASE("random-id segments avoid special tokens, are new each time and follow the seed", "[bench]") {
  const auto tok = tiny_tokenizer();
  auto src = SegmentSource::random_ids(tok, 5);
  auto again = SegmentSource::random_ids(tok, 5);
  std::set<std::vector<int32_t>> seen;
  for (int i = 0; i < 200; ++i) {
    const auto seg = src.fresh(6);
    REQUIRE(seg.size() == 6);
    for (int32_t id : seg) {
      REQUIRE(id >= 0);
      REQUIRE(size_t(id) < tok.vocab_size());
      REQUIRE_FALSE(tok.is_special(id));
    }
    CHECK(seen.insert(seg).second);
    CHECK(again.fresh(6) == seg);
  }
  CHECK_THROWS_AS(src.fresh(0), std::invalid_argument);
}

TEST_CASE("corpus segments are distinct windows of the tokenised text", "[bench]") {
  const auto tok = tiny_tokenizer();
  const auto dir = std::filesystem::temp_directory_path() / "hypic-test-bench-corpus";
  std::filesystem::create_directories(dir);
  const auto file = dir / "corpus.txt";
  const std::string text = "low lower newest widest lowest new low wide newer lower lowest widest";
  std::ofstream(file) << text;
  const auto stream = tok.encode(text, false);
  REQUIRE(stream.size() >= 8);

  auto src = SegmentSource::corpus(tok, {file}, 9);
  const int64_t len = 4;
  std::set<std::vector<int32_t>> windows;  // every distinct window of the stream
  for (size_t off = 0; off + size_t(len) <= stream.size(); ++off) {
    windows.insert(std::vector<int32_t>(stream.begin() + long(off), stream.begin() + long(off) + len));
  }
  std::set<std::vector<int32_t>> got;
  for (size_t i = 0; i < windows.size(); ++i) {
    const auto seg = src.fresh(len);
    CHECK(windows.count(seg) == 1);
    CHECK(got.insert(seg).second);
  }
  // Every distinct window has been handed out: the next one cannot be new.
  CHECK_THROWS_AS(src.fresh(len), std::runtime_error);
  CHECK_THROWS_AS(src.fresh(int64_t(stream.size()) + 1), std::invalid_argument);
  CHECK_THROWS_AS(SegmentSource::corpus(tok, {dir / "missing.txt"}, 1), std::runtime_error);
  std::filesystem::remove_all(dir);
}
