// Strict command-line values for integer and real-number flags: counts, milliseconds, seconds, byte sizes, ratios, of
// the services and of the command-line tools (hypic-model, hypic-eval, the benchmarks). CLI11 2.1's own conversions
// read "0100" as octal (64) and "0x10" as hex, wrap "-1" to 2^64 - 1 for an unsigned option and clamp or wrap values
// past its type before any range check. The options added here read whole decimal numbers only (byte sizes with an
// optional binary unit) and refuse anything else before anything is written, with a CLI::ValidationError naming the
// flag, the value and the range: "--max-segments: 0x10 is not a whole decimal number in [1, 2147483647]".
// Library hypic_flags (proto/CMakeLists.txt): CLI11 and fmt only, no gRPC, so that the tools link it without gRPC.
#pragma once
#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>

namespace hypic::rpc {

/// A whole decimal integer in [lo, hi]: an optional '+' (or '-' when lo < 0), then decimal digits only; leading zeros
/// are read in base 10 ("0100" = 100). nullopt for anything else: empty text, blanks anywhere, base prefixes ("0x10"),
/// fractions, exponents, units or other trailing characters, '-' when lo >= 0, values outside [lo, hi] or 64 bits.
std::optional<int64_t> parse_decimal_int(std::string_view text, int64_t lo, int64_t hi);
/// parse_decimal_int for unsigned values: an optional '+' and decimal digits, in [lo, hi] ("-1" is refused, not
/// wrapped).
std::optional<uint64_t> parse_decimal_uint(std::string_view text, uint64_t lo, uint64_t hi);

/// A byte size in [lo, hi]: decimal digits with an optional unit, case-insensitive and binary as CLI11's
/// AsSizeValue(false) reads them (b = 1; k, kb, ki, kib = 1024; m, g, t, p, e likewise): "4096", "4KiB", "512mb".
/// nullopt for anything else: signs, blanks, fractions, exponents, a unit alone, unknown units, values outside
/// [lo, hi] or past 2^64 - 1.
std::optional<uint64_t> parse_byte_size(std::string_view text, uint64_t lo, uint64_t hi);
/// What parse_byte_size reads, for messages.
inline constexpr std::string_view kByteSizeForm =
    "decimal digits, an optional unit: b, k = kb = kib = 1024, m, g, t, p, e";

/// The message of a refused value: "TEXT is not EXPECTED" (TEXT as untrusted() writes it, at most 64 bytes; " (it
/// overflows 64 bits)" added when TEXT is a sign and digits past 64 bits), e.g.
/// `" 5" is not a whole decimal number in [0, 10]`.
std::string flag_value_refusal(std::string_view text, std::string_view expected);

/// "[lo, hi]".
template <class T>
std::string range_text(T lo, T hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

/// parse_decimal_int / parse_decimal_uint for the integer type T, in [lo, hi] (also within T's range).
template <class T>
std::optional<T> parse_decimal(std::string_view text, T lo, T hi) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>, "an integer type");
  if constexpr (std::is_signed_v<T>) {
    const auto v = parse_decimal_int(text, lo, hi);
    return v ? std::optional<T>(T(*v)) : std::nullopt;
  } else {
    const auto v = parse_decimal_uint(text, lo, hi);
    return v ? std::optional<T>(T(*v)) : std::nullopt;
  }
}

/// parse_decimal<T>(text, lo, hi), else a std::invalid_argument "FLAG: TEXT is not a whole decimal number in [LO, HI]"
/// (strict_int's message): for the numbers inside a flag's own value (a list "512,2048", a range "256:1024"), which
/// CLI11 does not convert.
template <class T>
T require_decimal(std::string_view text, std::string_view flag, T lo, T hi) {
  if (const auto v = parse_decimal<T>(text, lo, hi)) return *v;
  throw std::invalid_argument(std::string(flag) + ": " +
                              flag_value_refusal(text, "a whole decimal number in " + range_text(lo, hi)));
}

/// A CLI11 transform accepting what parse_decimal<T> accepts in [lo, hi] and rewriting the value in plain decimal (so
/// that CLI11's own conversion, which reads "0100" as octal, only ever sees "100"). Anything else fails with
/// flag_value_refusal's message, which CLI11 raises as a CLI::ValidationError prefixed with the flag's name.
/// Throws std::invalid_argument when lo > hi.
template <class T>
CLI::Validator strict_int(T lo, T hi) {
  if (lo > hi) throw std::invalid_argument("strict_int: empty range " + range_text(lo, hi));
  const std::string range = range_text(lo, hi);
  return CLI::Validator(
      [lo, hi, range](std::string& v) {
        const auto x = parse_decimal<T>(v, lo, hi);
        if (!x) return flag_value_refusal(v, "a whole decimal number in " + range);
        v = std::to_string(*x);
        return std::string();
      },
      "DECIMAL in " + range, "STRICT_INT");
}

/// A CLI11 transform accepting what parse_byte_size accepts in [lo, hi], rewriting the value as its number of bytes;
/// anything else fails as strict_int's does. Throws std::invalid_argument when lo > hi.
CLI::Validator strict_byte_size(uint64_t lo, uint64_t hi);

/// The value of `text` when it is a finite real number in [lo, hi] written in decimal (an optional sign, digits with an
/// optional '.', an optional exponent: 0.5, +2, 1e3, -0.25), else nullopt: blanks, hex floats, "inf", "nan" and
/// trailing characters are refused.
std::optional<double> parse_finite_real(std::string_view text, double lo, double hi);

/// A CLI11 check for floating-point flags accepting what parse_finite_real accepts in [lo, hi] (CLI::Range and
/// CLI::PositiveNumber let NaN through, which then reached the services' arithmetic); anything else fails as
/// strict_int's does. Throws std::invalid_argument when lo > hi or a bound is not finite.
CLI::Validator strict_real(double lo, double hi);

namespace detail {
/// The integer a strict option's target holds: T itself, a std::vector's element (a repeated flag) or a
/// std::chrono::duration's count.
template <class T>
struct StrictTarget {
  using type = T;
};
template <class T, class A>
struct StrictTarget<std::vector<T, A>> {
  using type = T;
};
template <class R, class P>
struct StrictTarget<std::chrono::duration<R, P>> {
  using type = R;
};
template <class T>
using strict_value_t = typename StrictTarget<T>::type;
template <class T>
inline constexpr bool is_duration_v = false;
template <class R, class P>
inline constexpr bool is_duration_v<std::chrono::duration<R, P>> = true;
}  // namespace detail

/// Registers the option `name` on `app`, written to `target` only from a whole decimal number in [lo, hi] (what
/// parse_decimal accepts: "+5", "0100" = 100; not " 5", "0x10", "1e3", "12.5", "5k", "-1" where lo >= 0, nor values
/// past T). `target`: a signed or unsigned integer, a std::vector of them (a repeated flag, each value checked) or a
/// std::chrono::duration (whole units of it, e.g. milliseconds; its help shows the current value as the default).
/// A refused value fails the parse with a CLI::ValidationError "NAME: TEXT is not a whole decimal number in [LO, HI]",
/// and `target` keeps its value. Returns the option (chain ->capture_default_str() and the like).
/// Throws std::invalid_argument when lo > hi.
template <class T>
CLI::Option* add_strict_int_option(CLI::App& app, const std::string& name, T& target,
                                   detail::strict_value_t<T> lo, detail::strict_value_t<T> hi,
                                   const std::string& description) {
  using V = detail::strict_value_t<T>;
  if constexpr (detail::is_duration_v<T>) {
    return app
        .add_option_function<std::string>(
            name, [&target, lo, hi](const std::string& v) { target = T(*parse_decimal<V>(v, lo, hi)); }, description)
        ->transform(strict_int<V>(lo, hi))
        ->type_name("INT")
        ->default_str(std::to_string(target.count()));
  } else {
    return app.add_option(name, target, description)->transform(strict_int<V>(lo, hi));
  }
}

/// Registers the option `name` on `app`, written to `target` (an unsigned integer of at least 64 bits) only from a
/// byte size in [lo, hi] as parse_byte_size reads it (decimal digits with an optional binary unit: "4096", "4KiB",
/// "1g"); anything else fails the parse with a CLI::ValidationError naming the flag, the value and the range, and
/// `target` keeps its value. Returns the option. Throws std::invalid_argument when lo > hi.
template <class T>
CLI::Option* add_strict_size_option(CLI::App& app, const std::string& name, T& target, uint64_t lo, uint64_t hi,
                                    const std::string& description) {
  static_assert(std::is_unsigned_v<T> && sizeof(T) >= sizeof(uint64_t), "a 64-bit unsigned target");
  return app.add_option(name, target, description)->transform(strict_byte_size(lo, hi));
}

}  // namespace hypic::rpc
