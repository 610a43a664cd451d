#include "proto/rpc/flags.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>

#include <fmt/format.h>

#include "proto/rpc/escape.h"

namespace hypic::rpc {

namespace {

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The magnitude of the decimal digits `digits` (non-empty, digits only); nullopt past 2^64 - 1.
std::optional<uint64_t> magnitude(std::string_view digits) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v, 10);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return v;
}

}  // namespace

std::optional<int64_t> parse_decimal_int(std::string_view text, int64_t lo, int64_t hi) {
  const bool negative = !text.empty() && text[0] == '-';
  if (!text.empty() && (text[0] == '+' || negative)) text.remove_prefix(1);
  if ((negative && lo >= 0) || !all_digits(text)) return std::nullopt;
  const auto m = magnitude(text);
  constexpr uint64_t kMinMagnitude = uint64_t{1} << 63;  // |INT64_MIN|
  if (!m || *m > (negative ? kMinMagnitude : kMinMagnitude - 1)) return std::nullopt;
  const int64_t v = negative ? int64_t(0 - *m) : int64_t(*m);  // 0 - 2^63 wraps to INT64_MIN, as wanted
  if (v < lo || v > hi) return std::nullopt;
  return v;
}

std::optional<uint64_t> parse_decimal_uint(std::string_view text, uint64_t lo, uint64_t hi) {
  if (!text.empty() && text[0] == '+') text.remove_prefix(1);
  if (!all_digits(text)) return std::nullopt;
  const auto v = magnitude(text);
  if (!v || *v < lo || *v > hi) return std::nullopt;
  return v;
}

std::optional<uint64_t> parse_byte_size(std::string_view text, uint64_t lo, uint64_t hi) {
  const size_t unit_at = std::min(text.find_first_not_of("0123456789"), text.size());
  const std::string_view digits = text.substr(0, unit_at);
  std::string unit(text.substr(unit_at));
  for (char& c : unit) c = char(std::tolower(static_cast<unsigned char>(c)));
  // CLI11's AsSizeValue(false): b, then k, m, g, t, p, e alone or with b, i or ib, every one a power of 1024.
  int power = -1;
  if (unit.empty() || unit == "b") {
    power = 0;
  } else if (const auto p = std::string_view("kmgtpe").find(unit[0]); p != std::string_view::npos) {
    const std::string_view rest = std::string_view(unit).substr(1);
    if (rest.empty() || rest == "b" || rest == "i" || rest == "ib") power = int(p) + 1;
  }
  auto v = all_digits(digits) ? magnitude(digits) : std::nullopt;
  if (power < 0 || !v) return std::nullopt;
  for (int i = 0; i < power; ++i)
    if (__builtin_mul_overflow(*v, uint64_t{1024}, &*v)) return std::nullopt;
  if (*v < lo || *v > hi) return std::nullopt;
  return v;
}

std::string flag_value_refusal(std::string_view text, std::string_view expected) {
  const std::string_view digits = !text.empty() && (text[0] == '+' || text[0] == '-') ? text.substr(1) : text;
  const bool overflows = all_digits(digits) && !magnitude(digits);
  return untrusted(text, 64) + " is not " + std::string(expected) + (overflows ? " (it overflows 64 bits)" : "");
}

CLI::Validator strict_byte_size(uint64_t lo, uint64_t hi) {
  if (lo > hi) throw std::invalid_argument("strict_byte_size: empty range " + range_text(lo, hi));
  const std::string range = range_text(lo, hi);
  return CLI::Validator(
      [lo, hi, range](std::string& v) {
        const auto x = parse_byte_size(v, lo, hi);
        if (!x) {
          return flag_value_refusal(v, "a byte size in " + range + " (" + std::string(kByteSizeForm) + ")");
        }
        v = std::to_string(*x);
        return std::string();
      },
      "SIZE [b, kb(=1024b), ...] in " + range, "STRICT_SIZE");
}

std::optional<double> parse_finite_real(std::string_view text, double lo, double hi) {
  std::string_view t = text;
  if (!t.empty() && t[0] == '+') t.remove_prefix(1);
  if (t.empty() || !(std::isdigit(static_cast<unsigned char>(t[0])) || t[0] == '-' || t[0] == '.')) return std::nullopt;
  double v = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v, std::chars_format::general);
  if (ec != std::errc() || end != t.data() + t.size() || !std::isfinite(v) || v < lo || v > hi) return std::nullopt;
  return v;
}

CLI::Validator strict_real(double lo, double hi) {
  if (!std::isfinite(lo) || !std::isfinite(hi) || lo > hi)
    throw std::invalid_argument("strict_real: bad range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  const std::string range = "[" + fmt::format("{}", lo) + ", " + fmt::format("{}", hi) + "]";
  return CLI::Validator(
      [lo, hi, range](std::string& v) {
        return parse_finite_real(v, lo, hi) ? std::string() : flag_value_refusal(v, "a finite number in " + range);
      },
      "NUMBER in " + range, "STRICT_REAL");
}

}  // namespace hypic::rpc
