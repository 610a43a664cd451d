// The services' strict integer flags (proto/rpc/flags.h): whole decimal numbers in a range, byte sizes with binary
// units, each refusal a CLI::ValidationError naming the flag, the value and the range, with nothing written. CLI11's
// own conversions read 0100 as octal (64) and 0x10 as hex, and wrapped -1 to 2^64 - 1 for unsigned options.
#include <catch2/catch.hpp>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "combine_worker/limits.h"
#include "proto/engine_rpc/engine_flags.h"
#include "proto/rpc/flags.h"

using hypic::rpc::add_strict_int_option;
using hypic::rpc::add_strict_size_option;

namespace {

/// Registers options on a fresh CLI::App and parses `args` (after a program name) with it: "" when the parse
/// succeeds, else the text of the CLI::ParseError (a CLI::ValidationError for a refused value; anything else fails).
std::string parse(const std::function<void(CLI::App&)>& add, const std::vector<std::string>& args) {
  CLI::App app{"service"};
  add(app);
  std::vector<const char*> argv{"service"};
  for (const auto& a : args) argv.push_back(a.c_str());
  try {
    app.parse(int(argv.size()), argv.data());
  } catch (const CLI::ValidationError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("strict integer flags: whole decimal numbers in range, leading zeros in base 10", "[flags]") {
  uint64_t n = 7;
  const auto flag = [&n](CLI::App& app) { add_strict_int_option(app, "--n", n, 1, 1000, "a count"); };
  for (const auto& [text, value] : std::vector<std::pair<std::string, uint64_t>>{
           {"0100", 100}, {"+5", 5}, {"1", 1}, {"1000", 1000}, {"0001000", 1000}, {"42", 42}}) {
    INFO(text);
    n = 7;
    CHECK(parse(flag, {"--n", text}) == "");
    CHECK(n == value);
  }
  n = 7;
  CHECK(parse(flag, {"--n=010"}) == "");
  CHECK(n == 10);  // CLI11 read it as octal: 8
}

TEST_CASE("strict integer flags: anything but a whole decimal number in range is refused naming the flag, the value "
          "and the range, and nothing is written",
          "[flags]") {
  uint64_t n = 7;
  const auto flag = [&n](CLI::App& app) { add_strict_int_option(app, "--n", n, 1, 1000, "a count"); };
  for (const std::string bad : {"0", "1001", "-1", "0x10", "0X10", "1e3", "12.5", " 5", "5 ", "5k", "+", "-",
                                "+-5", "--5", "0b1", "5,000", "1_000", "18446744073709551616",
                                "99999999999999999999999999"}) {
    INFO('"' << bad << '"');
    const std::string err = parse(flag, {"--n=" + bad});
    CHECK_THAT(err, Catch::StartsWith("--n: "));
    CHECK_THAT(err, Catch::Contains("is not a whole decimal number in [1, 1000]"));
    CHECK(n == 7);
  }
  CHECK(parse(flag, {"--n", "0x10"}) == "--n: 0x10 is not a whole decimal number in [1, 1000]");
  CHECK(parse(flag, {"--n", " 5"}) == "--n: \" 5\" is not a whole decimal number in [1, 1000]");
  // (as "--n=", CLI11 itself finds no value)
  CHECK(parse(flag, {"--n", ""}) == "--n: \"\" is not a whole decimal number in [1, 1000]");
  CHECK_THAT(parse(flag, {"--n", "18446744073709551616"}), Catch::EndsWith("(it overflows 64 bits)"));
  CHECK(n == 7);
}

TEST_CASE("strict integer flags: each type's own limits, signed ranges, repeated flags and milliseconds", "[flags]") {
  {  // the whole range of uint64_t: its max is accepted, one past it refused (CLI11 wrapped or clamped it)
    uint64_t n = 7;
    const auto flag = [&n](CLI::App& app) {
      add_strict_int_option(app, "--seed", n, 0, std::numeric_limits<uint64_t>::max(), "a seed");
    };
    CHECK(parse(flag, {"--seed", "18446744073709551615"}) == "");
    CHECK(n == std::numeric_limits<uint64_t>::max());
    n = 7;
    CHECK_THAT(parse(flag, {"--seed", "18446744073709551616"}), Catch::StartsWith("--seed: 18446744073709551616 is"));
    CHECK_THAT(parse(flag, {"--seed", "-1"}), Catch::StartsWith("--seed: -1 is not"));
    CHECK(parse(flag, {"--seed", "0"}) == "");
    CHECK(n == 0);
  }
  {  // int32_t: both ends of the type, one past each refused
    int32_t n = 7;
    const auto flag = [&n](CLI::App& app) {
      add_strict_int_option(app, "--k", n, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(),
                            "k");
    };
    CHECK(parse(flag, {"--k", "-2147483648"}) == "");
    CHECK(n == std::numeric_limits<int32_t>::min());
    CHECK(parse(flag, {"--k", "2147483647"}) == "");
    CHECK(n == std::numeric_limits<int32_t>::max());
    n = 7;
    CHECK_THAT(parse(flag, {"--k", "2147483648"}), Catch::StartsWith("--k: 2147483648 is not"));
    CHECK_THAT(parse(flag, {"--k", "-2147483649"}), Catch::StartsWith("--k: -2147483649 is not"));
    CHECK(n == 7);
  }
  {  // a range below zero: '-' only there
    int n = 3;
    const auto flag = [&n](CLI::App& app) { add_strict_int_option(app, "--w", n, -1, 5, "w"); };
    CHECK(parse(flag, {"--w", "-1"}) == "");
    CHECK(n == -1);
    CHECK(parse(flag, {"--w=-01"}) == "");
    CHECK(n == -1);
    CHECK(parse(flag, {"--w", "5"}) == "");
    CHECK(n == 5);
    n = 3;
    CHECK(parse(flag, {"--w", "-2"}) == "--w: -2 is not a whole decimal number in [-1, 5]");
    CHECK(parse(flag, {"--w", "6"}) == "--w: 6 is not a whole decimal number in [-1, 5]");
    CHECK(n == 3);
  }
  {  // a repeated flag: every value checked, none written when one is refused
    std::vector<int32_t> ids;
    const auto flag = [&ids](CLI::App& app) { add_strict_int_option(app, "--id", ids, 0, 100, "ids"); };
    CHECK(parse(flag, {"--id", "010", "--id", "+7"}) == "");
    CHECK(ids == std::vector<int32_t>{10, 7});
    ids.clear();
    CHECK(parse(flag, {"--id", "1", "--id", "0x2"}) == "--id: 0x2 is not a whole decimal number in [0, 100]");
    CHECK(ids.empty());
  }
  {  // milliseconds: whole units, its current value as the help's default
    std::chrono::milliseconds ms{250};
    const auto flag = [&ms](CLI::App& app) { add_strict_int_option(app, "--wait-ms", ms, 0, 60000, "a wait"); };
    CHECK(parse(flag, {"--wait-ms", "0100"}) == "");
    CHECK(ms == std::chrono::milliseconds(100));
    ms = std::chrono::milliseconds(250);
    CHECK(parse(flag, {"--wait-ms", "1.5"}) == "--wait-ms: 1.5 is not a whole decimal number in [0, 60000]");
    CHECK(ms == std::chrono::milliseconds(250));
    CLI::App app;
    flag(app);
    CHECK_THAT(app.help(), Catch::Contains("250"));
  }
  {  // the default stays in the help text where the option captures it
    int n = 8;
    CLI::App app;
    add_strict_int_option(app, "--fetch-parallelism", n, 1, 64, "fetches")->capture_default_str();
    CHECK_THAT(app.help(), Catch::Contains("--fetch-parallelism") && Catch::Contains("=8") &&
                               Catch::Contains("[1, 64]"));
  }
  uint32_t n = 0;
  CLI::App app;
  CHECK_THROWS_AS(add_strict_int_option(app, "--x", n, 5, 4, "x"), std::invalid_argument);  // an empty range
}

TEST_CASE("strict byte-size flags: decimal digits with an optional binary unit, in range", "[flags]") {
  uint64_t bytes = 1 << 20;
  const auto flag = [&bytes](CLI::App& app) {
    add_strict_size_option(app, "--chunk-bytes", bytes, 4096, uint64_t{4} << 20, "chunks");
  };
  for (const auto& [text, value] : std::vector<std::pair<std::string, uint64_t>>{
           {"4096", 4096}, {"04096", 4096}, {"4k", 4096}, {"4KB", 4096}, {"4KiB", 4096}, {"4ki", 4096},
           {"1m", 1 << 20}, {"4MiB", 4 << 20}, {"4194304", 4 << 20}, {"8192b", 8192}}) {
    INFO(text);
    bytes = 1;
    CHECK(parse(flag, {"--chunk-bytes", text}) == "");
    CHECK(bytes == value);
  }
  bytes = 1 << 20;
  for (const std::string bad : {"4095", "4194305", "5M", "0x1000", "4 KiB", " 4096", "1.5k", "-4096", "+4096", "k",
                                "4XB", "1e4", "4kk"}) {
    INFO('"' << bad << '"');
    CHECK_THAT(parse(flag, {"--chunk-bytes=" + bad}),
               Catch::StartsWith("--chunk-bytes: ") && Catch::Contains("is not a byte size in [4096, 4194304]"));
    CHECK(bytes == 1 << 20);
  }
  CHECK(parse(flag, {"--chunk-bytes", ""}) == "--chunk-bytes: \"\" is not a byte size in [4096, 4194304] (decimal "
                                               "digits, an optional unit: b, k = kb = kib = 1024, m, g, t, p, e)");
  CHECK(bytes == 1 << 20);
  const auto whole = [&bytes](CLI::App& app) {
    add_strict_size_option(app, "--disk-bytes", bytes, 0, std::numeric_limits<uint64_t>::max(), "disk");
  };
  CHECK(parse(whole, {"--disk-bytes", "15EiB"}) == "");
  CHECK(bytes == uint64_t{15} << 60);
  CHECK(parse(whole, {"--disk-bytes", "0"}) == "");
  CHECK(bytes == 0);
  CHECK_THAT(parse(whole, {"--disk-bytes", "16EiB"}), Catch::StartsWith("--disk-bytes: 16EiB is not a byte size"));
  CHECK_THAT(parse(whole, {"--disk-bytes", "18446744073709551616"}), Catch::EndsWith("(it overflows 64 bits)"));
  CHECK(bytes == 0);
}

TEST_CASE("the workers' engine flags parse strictly through add_engine_flags", "[flags]") {
  using hypic::rpc::EngineFlags;
  const auto engine = [](EngineFlags& f) {
    return [&f](CLI::App& app) { hypic::rpc::add_engine_flags(app, f, /*prefix_cache=*/true, /*inject_delay=*/true); };
  };
  {
    EngineFlags f;
    CHECK(parse(engine(f), {"--max-pass-tokens", "-1", "--decode-sms", "0100", "--kv-pool-bytes", "2GiB",
                            "--max-batch-tokens", "+512", "--random-weights-seed", "18446744073709551615",
                            "--prefix-cache-bytes", "0", "--compute-threads", "08", "--inject-delay-ms", "010",
                            "--max-pass-tokens-decoding", "0", "--max-build-tokens-decoding", "0256"}) == "");
    CHECK(f.max_pass_tokens == -1);
    CHECK(f.decode_sms == 100);
    CHECK(f.kv_pool_bytes == uint64_t{2} << 30);
    CHECK(f.max_batch_tokens == 512);
    CHECK(f.random_weights_seed == std::numeric_limits<uint64_t>::max());
    CHECK(f.prefix_cache_bytes == 0);
    CHECK(f.compute_threads == 8);
    CHECK(f.inject_delay_ms == 10);
    CHECK(f.max_pass_tokens_decoding == 0);
    CHECK(f.max_build_tokens_decoding == 256);
  }
  for (const std::vector<std::string>& bad : std::vector<std::vector<std::string>>{
           {"--compute-threads", "0"},
           {"--kv-pool-bytes", "-1"},
           {"--max-pass-tokens", "-2"},
           {"--decode-sms", "100001"},
           {"--decode-sms", "-2"},
           {"--max-batch-tokens", "0x10"},
           {"--max-build-tokens-decoding", "0"},
           {"--max-pass-tokens-decoding", "-1"},
           {"--inject-delay-ms", "1e3"},
           {"--random-weights-seed", "18446744073709551616"},
           {"--prefix-cache-bytes", "1.5GiB"}}) {
    INFO(bad[0] << " " << bad[1]);
    EngineFlags f;
    const EngineFlags before = f;
    CHECK_THAT(parse(engine(f), bad), Catch::StartsWith(bad[0] + ": " + bad[1] + " is not "));
    CHECK(f.compute_threads == before.compute_threads);
    CHECK(f.kv_pool_bytes == before.kv_pool_bytes);
    CHECK(f.max_pass_tokens == before.max_pass_tokens);
    CHECK(f.decode_sms == before.decode_sms);
    CHECK(f.max_batch_tokens == before.max_batch_tokens);
    CHECK(f.max_build_tokens_decoding == before.max_build_tokens_decoding);
    CHECK(f.max_pass_tokens_decoding == before.max_pass_tokens_decoding);
    CHECK(f.inject_delay_ms == before.inject_delay_ms);
    CHECK(f.random_weights_seed == before.random_weights_seed);
    CHECK(f.prefix_cache_bytes == before.prefix_cache_bytes);
  }
}

TEST_CASE("the combine worker's request limits parse strictly through add_request_limit_flags", "[flags]") {
  using hypic::combine::RequestLimits;
  const auto limits = [](RequestLimits& l) {
    return [&l](CLI::App& app) { hypic::combine::add_request_limit_flags(app, l); };
  };
  {
    RequestLimits l;
    CHECK(parse(limits(l), {"--max-segments", "0100", "--max-new-tokens", "2147483647", "--max-segment-tokens", "1",
                            "--max-prompt-tokens", "9223372036854775807"}) == "");
    CHECK(l.max_segments == 100);  // CLI11 read it as octal: 64
    CHECK(l.max_new_tokens == 2147483647);
    CHECK(l.max_segment_tokens == 1);
    CHECK(l.max_prompt_tokens == std::numeric_limits<int64_t>::max());
  }
  for (const std::vector<std::string>& bad : std::vector<std::vector<std::string>>{
           {"--max-new-tokens", "2147483648"},
           {"--max-segments", "0"},
           {"--max-segments", "0x10"},
           {"--max-segment-tokens", "-1"},
           {"--max-prompt-tokens", "9223372036854775808"},
           {"--max-prompt-tokens", "262144 "}}) {
    INFO(bad[0] << " " << bad[1]);
    RequestLimits l;
    CHECK_THAT(parse(limits(l), bad), Catch::StartsWith(bad[0] + ": ") && Catch::Contains(" is not a whole decimal"));
    CHECK(l.max_new_tokens == RequestLimits{}.max_new_tokens);
    CHECK(l.max_segments == RequestLimits{}.max_segments);
    CHECK(l.max_segment_tokens == RequestLimits{}.max_segment_tokens);
    CHECK(l.max_prompt_tokens == RequestLimits{}.max_prompt_tokens);
  }
}

TEST_CASE("strict decimal parsing without CLI11: parse_decimal and parse_byte_size", "[flags]") {
  using hypic::rpc::parse_byte_size;
  using hypic::rpc::parse_decimal;
  CHECK(parse_decimal<int64_t>("-9223372036854775808", INT64_MIN, INT64_MAX) == INT64_MIN);
  CHECK_FALSE(parse_decimal<int64_t>("-9223372036854775809", INT64_MIN, INT64_MAX));
  CHECK(parse_decimal<int64_t>("9223372036854775807", INT64_MIN, INT64_MAX) == INT64_MAX);
  CHECK_FALSE(parse_decimal<int64_t>("9223372036854775808", INT64_MIN, INT64_MAX));
  CHECK(parse_decimal<int>("-0", -1, 1) == 0);
  CHECK_FALSE(parse_decimal<int>("-0", 0, 1));  // no '-' where the range has no negative value
  CHECK(parse_decimal<uint32_t>("000000000000000000000000000042", 0, 100) == 42u);
  CHECK_FALSE(parse_decimal<uint32_t>("\t5", 0, 100));
  CHECK_FALSE(parse_decimal<uint32_t>("5\n", 0, 100));
  CHECK(parse_byte_size("1e", 0, UINT64_MAX) == uint64_t{1} << 60);  // CLI11's e unit: 1024^6
  CHECK_FALSE(parse_byte_size("1eb5", 0, UINT64_MAX));
}

TEST_CASE("numbers inside a flag's own value: require_decimal names the flag, the text and the range", "[flags]") {
  using hypic::rpc::require_decimal;
  CHECK(require_decimal<int64_t>("0100", "--tokens", 1, INT64_MAX) == 100);  // stoll and CLI11 alike: not octal
  CHECK(require_decimal<int>("+7", "--tokens", 1, 10) == 7);
  CHECK(require_decimal<int>("-3", "--segment-tokens", -5, 5) == -3);
  CHECK_THROWS_WITH(require_decimal<int64_t>("0x10", "--tokens", 1, 100),
                    "--tokens: 0x10 is not a whole decimal number in [1, 100]");
  CHECK_THROWS_WITH(require_decimal<int64_t>(" 512", "--tokens", 1, 1000),
                    "--tokens: \" 512\" is not a whole decimal number in [1, 1000]");
  for (const char* bad : {"", "0", "101", "-1", "1e2", "12.5", "5k", "nan"})
    CHECK_THROWS_AS(require_decimal<uint32_t>(bad, "--n", 1, 100), std::invalid_argument);
  CHECK_THROWS_WITH(require_decimal<uint64_t>("18446744073709551616", "--n", 0, UINT64_MAX),
                    Catch::StartsWith("--n: 18446744073709551616 is not") && Catch::EndsWith("(it overflows 64 bits)"));
}

TEST_CASE("strict real flags: finite decimal numbers in range, NaN and infinities refused", "[flags]") {
  using hypic::rpc::parse_finite_real;
  // Accepted: the value as written (compared exactly: each is a short decimal that from_chars rounds correctly).
  CHECK(parse_finite_real("0.5", 0, 1) == 0.5);
  CHECK(parse_finite_real("+2", 0, 10) == 2.0);
  CHECK(parse_finite_real("1e3", 0, 1e4) == 1000.0);
  CHECK(parse_finite_real("-0.25", -1, 0) == -0.25);
  CHECK(parse_finite_real(".5", 0, 1) == 0.5);
  CHECK(parse_finite_real("0.05", 0.05, 3600) == 0.05);  // both range ends
  CHECK(parse_finite_real("3600", 0.05, 3600) == 3600.0);
  // Refused: not finite, not decimal, blanks, junk, outside the range.
  for (const char* bad : {"nan", "NaN", "-nan", "inf", "+inf", "infinity", "1e400", "", " 1", "1 ", "0x1p3", "1,5",
                          "1.2.3", "e5", "+", "-", "++1", "3601", "0.049", "-0.0001"})
    CHECK_FALSE(parse_finite_real(bad, 0.05, 3600).has_value());
  CHECK_THROWS_AS(hypic::rpc::strict_real(1, 0), std::invalid_argument);
  // Through CLI11: the refusal names the flag and the value, and the target keeps its value.
  double t = 600;
  auto add = [&](CLI::App& app) {
    app.add_option("--request-timeout-seconds", t)->check(hypic::rpc::strict_real(0.001, 604800.0));
  };
  CHECK(parse(add, {"--request-timeout-seconds", "2.5"}).empty());
  CHECK(t == 2.5);
  t = 600;
  for (const char* bad : {"nan", "1e300", "0", "inf", "604801"}) {
    const std::string err = parse(add, {"--request-timeout-seconds", bad});
    INFO(err);
    CHECK(err.find("--request-timeout-seconds") != std::string::npos);
    CHECK(err.find(bad) != std::string::npos);
    CHECK(t == 600);
  }
}
