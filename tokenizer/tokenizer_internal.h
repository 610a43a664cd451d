// Internals shared by tokenizer/tokenizer*.cpp (not part of the public API).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace hypic::engine::tokenizer_detail {

/// Unicode normalisation forms supported by the normaliser.
enum class NormForm { NFC, NFD, NFKC, NFKD };

/// Appends the normalisation of `in` (valid UTF-8) to `out`.
void normalize_append(NormForm form, std::string_view in, std::string& out);

/// Appends to `out` the text of the longest decodable prefix of `bytes`, each maximal invalid
/// subsequence replaced by U+FFFD. With final=false a trailing sequence that is incomplete but
/// still valid so far is left unconsumed; with final=true it becomes U+FFFD. Returns the number of
/// bytes consumed.
size_t utf8_lossy_append(std::string_view bytes, bool final, std::string& out);

/// Length (1..4) of the well-formed UTF-8 sequence starting at s[i] (s must be valid UTF-8).
inline size_t utf8_seq_len(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

/// Decodes the code point at s[i] of valid UTF-8; sets `len` to its byte length.
inline uint32_t utf8_decode(const char* s, size_t& len) {
  const auto* u = reinterpret_cast<const unsigned char*>(s);
  if (u[0] < 0x80) { len = 1; return u[0]; }
  if (u[0] < 0xE0) { len = 2; return ((u[0] & 0x1Fu) << 6) | (u[1] & 0x3Fu); }
  if (u[0] < 0xF0) { len = 3; return ((u[0] & 0x0Fu) << 12) | ((u[1] & 0x3Fu) << 6) | (u[2] & 0x3Fu); }
  len = 4;
  return ((u[0] & 0x07u) << 18) | ((u[1] & 0x3Fu) << 12) | ((u[2] & 0x3Fu) << 6) | (u[3] & 0x3Fu);
}

/// Appends the UTF-8 encoding of code point `cp` (<= 0x10FFFF, not a surrogate).
inline void utf8_append(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

/// Unicode White_Space property (what Oniguruma's and Rust regex's Unicode `\s` match).
inline bool is_white_space(uint32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
         cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/// Rust regex's Unicode `\w` (Alphabetic, marks, decimal digits, connector punctuation,
/// Join_Control), approximated through utf8proc categories: letters, marks, Nd, Nl, Pc, U+200C/D
/// and the Other_Alphabetic symbols (circled / squared Latin letters).
bool is_word_char(uint32_t cp);

}  // namespace hypic::engine::tokenizer_detail
