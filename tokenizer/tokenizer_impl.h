// Internals of the tokenizer shared by tokenizer/tokenizer.cpp (encoding, decoding) and tokenizer/tokenizer_load.cpp
// (reading tokenizer.json): the lookup tables, the regex wrapper, the added-token matcher and the loaded
// tokenizer (Impl). Not part of the public API (tokenizer/tokenizer.h).
#pragma once
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_internal.h"

namespace hypic::engine::tokenizer_detail {

using nlohmann::json;

// ------------------------------------------------------------------------------------------------
// GPT-2 byte <-> unicode table (HF pre_tokenizers/byte_level.rs `bytes_char`): printable bytes map
// to themselves, the other 68 bytes to U+0100.. in byte order.
struct ByteLevelTable {
  std::array<uint32_t, 256> byte_to_cp{};
  std::array<int16_t, 512> cp_to_byte{};  // -1 where the code point is not an image
  std::array<std::string, 256> byte_to_utf8;
  ByteLevelTable() {
    cp_to_byte.fill(-1);
    uint32_t extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : 256 + extra++;
      byte_to_cp[b] = cp;
      cp_to_byte[cp] = static_cast<int16_t>(b);
      utf8_append(cp, byte_to_utf8[b]);
    }
  }
};
inline const ByteLevelTable& byte_table() {
  static const ByteLevelTable t;
  return t;
}

/// Raw bytes of a byte-level token string, or nullopt if a character is outside the alphabet.
inline std::optional<std::string> byte_level_unmap(std::string_view token) {
  const auto& t = byte_table();
  std::string out;
  out.reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    size_t len;
    const uint32_t cp = utf8_decode(token.data() + i, len);
    if (cp >= 512 || t.cp_to_byte[cp] < 0) return std::nullopt;
    out.push_back(static_cast<char>(t.cp_to_byte[cp]));
    i += len;
  }
  return out;
}

inline std::string byte_level_map(std::string_view bytes) {
  std::string out;
  for (const char c : bytes) out += byte_table().byte_to_utf8[static_cast<unsigned char>(c)];
  return out;
}

// ------------------------------------------------------------------------------------------------
/// Open-addressing map byte string -> id, keys kept in one arena (a vocab of 150k tokens is a
/// few MB and one probe sequence per lookup). insert_or_assign overwrites an existing key.
class FlatStrMap {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    if (cap > slots_.size()) rehash(cap);
  }
  void insert_or_assign(std::string_view key, int32_t value) {
    if (2 * (size_ + 1) > slots_.size()) rehash(std::max<size_t>(16, slots_.size() * 2));
    const uint64_t h = XXH3_64bits(key.data(), key.size());
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.len == kEmpty) {
        s = {h, static_cast<uint32_t>(arena_.size()), static_cast<uint32_t>(key.size()), value};
        arena_.append(key);
        ++size_;
        return;
      }
      if (s.hash == h && s.len == key.size() && std::memcmp(arena_.data() + s.off, key.data(), key.size()) == 0) {
        s.value = value;
        return;
      }
    }
  }
  /// The id of `key`, or -1.
  int32_t find(std::string_view key) const {
    if (size_ == 0) return -1;
    const uint64_t h = XXH3_64bits(key.data(), key.size());
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.len == kEmpty) return -1;
      if (s.hash == h && s.len == key.size() && std::memcmp(arena_.data() + s.off, key.data(), key.size()) == 0) {
        return s.value;
      }
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint32_t kEmpty = ~uint32_t{0};
  struct Slot {
    uint64_t hash = 0;
    uint32_t off = 0, len = kEmpty;
    int32_t value = -1;
  };
  void rehash(size_t cap) {
    std::vector<Slot> old(cap);
    old.swap(slots_);
    mask_ = cap - 1;
    for (const Slot& s : old) {
      if (s.len == kEmpty) continue;
      size_t i = s.hash & mask_;
      while (slots_[i].len != kEmpty) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
  std::string arena_;
};

/// Open-addressing map (id_a, id_b) -> (rank, merged id) for BPE merges.
class PairMap {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    uint32_t rank = 0;
    int32_t new_id = -1;
  };
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    slots_.assign(cap, Entry{});
    mask_ = cap - 1;
  }
  /// Later insertions of the same pair overwrite earlier ones (HF collects merges into a map).
  void insert_or_assign(uint32_t a, uint32_t b, uint32_t rank, int32_t new_id) {
    const uint64_t k = key(a, b);
    for (size_t i = mix(k) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == kEmpty) { slots_[i] = {k, rank, new_id}; ++size_; return; }
      if (slots_[i].key == k) { slots_[i].rank = rank; slots_[i].new_id = new_id; return; }
    }
  }
  const Entry* find(uint32_t a, uint32_t b) const {
    const uint64_t k = key(a, b);
    for (size_t i = mix(k) & mask_;; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.key == k) return &e;
      if (e.key == kEmpty) return nullptr;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static uint64_t key(uint32_t a, uint32_t b) { return (uint64_t{a} << 32) | b; }
  static uint64_t mix(uint64_t k) {
    k ^= k >> 33; k *= 0xff51afd7ed558ccdULL; k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53ULL; k ^= k >> 33;
    return k;
  }
  std::vector<Entry> slots_;
  uint64_t mask_ = 0;
  size_t size_ = 0;
};

// ------------------------------------------------------------------------------------------------
/// A compiled PCRE2 pattern (UTF + UCP, JIT when available).
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int err = 0;
    PCRE2_SIZE err_off = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &err_off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw std::invalid_argument(where + ": cannot compile regex '" + pattern + "' at offset " +
                                  std::to_string(err_off) + ": " + reinterpret_cast<const char*>(msg));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// Leftmost match at or after `start` in subject[0, len); false when none.
  bool match(const char* subject, size_t len, size_t start, pcre2_match_data* md, pcre2_match_context* mctx,
             size_t& mb, size_t& me) const {
    const auto* s = reinterpret_cast<PCRE2_SPTR>(subject);
    const int rc = jit_ ? pcre2_jit_match(code_, s, len, start, 0, md, mctx)
                        : pcre2_match(code_, s, len, start, PCRE2_NO_UTF_CHECK, md, mctx);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw std::runtime_error(std::string("tokenizer: regex match failed: ") + reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    mb = ov[0];
    me = ov[1];
    return true;
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

/// Oniguruma's Unicode `\s` is White_Space; PCRE2's also matches U+180E. Rewrites \s and \S
/// (outside and inside classes) to the White_Space property so both engines agree.
inline std::string onig_to_pcre2(std::string_view pat) {
  std::string out;
  out.reserve(pat.size() + 32);
  for (size_t i = 0; i < pat.size(); ++i) {
    if (pat[i] == '\\' && i + 1 < pat.size()) {
      const char c = pat[i + 1];
      if (c == 's') out += "\\p{White_Space}";
      else if (c == 'S') out += "\\P{White_Space}";
      else { out += '\\'; out += c; }
      ++i;
    } else {
      out += pat[i];
    }
  }
  return out;
}

inline std::string escape_literal(std::string_view s) {
  std::string out;
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

inline constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ------------------------------------------------------------------------------------------------
enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct SplitStep {
  std::shared_ptr<const Regex> regex;
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
};

struct AddedToken {
  int32_t id = -1;
  std::string content;  // as in the file
  std::string pattern;  // what is matched: content, or its normalised form when normalized=true
  bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = true;
  /// Some added token with this content is special (HF's `special_tokens_set` is keyed by content):
  /// SpecialTokens::Split skips its matches.
  bool special_content = false;
};

/// Leftmost-longest multi-pattern matcher (what HF's Aho-Corasick with MatchKind::LeftmostLongest
/// returns), bucketed by first byte; patterns in a bucket are tried longest first.
class AddedMatcher {
 public:
  void build(const std::vector<AddedToken>& tokens, bool normalized) {
    pats_.clear();
    for (uint32_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i].normalized == normalized && !tokens[i].pattern.empty()) pats_.push_back({tokens[i].pattern, i});
    }
    std::sort(pats_.begin(), pats_.end(), [](const Pat& a, const Pat& b) {
      const auto fa = static_cast<unsigned char>(a.s[0]), fb = static_cast<unsigned char>(b.s[0]);
      if (fa != fb) return fa < fb;
      if (a.s.size() != b.s.size()) return a.s.size() > b.s.size();
      return a.token < b.token;
    });
    begin_.fill(0);
    present_.fill(false);
    for (const Pat& p : pats_) present_[static_cast<unsigned char>(p.s[0])] = true;
    single_first_ = -1;
    if (!pats_.empty() && static_cast<unsigned char>(pats_.front().s[0]) == static_cast<unsigned char>(pats_.back().s[0])) {
      single_first_ = static_cast<unsigned char>(pats_.front().s[0]);
    }
    size_t k = 0;
    for (int b = 0; b <= 256; ++b) {
      while (k < pats_.size() && static_cast<unsigned char>(pats_[k].s[0]) < b) ++k;
      begin_[b] = static_cast<uint32_t>(k);
    }
  }
  bool empty() const { return pats_.empty(); }
  /// Leftmost-longest match at or after `from`: sets start, length and the token index.
  bool find(std::string_view text, size_t from, size_t& start, size_t& len, uint32_t& token) const {
    const auto* p = reinterpret_cast<const unsigned char*>(text.data());
    const size_t n = text.size();
    for (size_t i = from; i < n; ++i) {
      if (single_first_ >= 0) {  // all patterns start with one byte (Qwen3: '<'): memchr to it
        const void* hit = std::memchr(p + i, single_first_, n - i);
        if (!hit) return false;
        i = static_cast<size_t>(static_cast<const unsigned char*>(hit) - p);
      } else if (!present_[p[i]]) {
        continue;
      }
      for (uint32_t k = begin_[p[i]]; k < begin_[p[i] + 1]; ++k) {
        const std::string& s = pats_[k].s;
        if (s.size() <= n - i && (s.size() < 2 || s[1] == text[i + 1]) &&
            std::memcmp(text.data() + i, s.data(), s.size()) == 0) {
          start = i;
          len = s.size();
          token = pats_[k].token;
          return true;
        }
      }
    }
    return false;
  }

 private:
  struct Pat {
    std::string s;
    uint32_t token;
  };
  std::vector<Pat> pats_;
  std::array<uint32_t, 257> begin_{};
  std::array<bool, 256> present_{};
  int single_first_ = -1;
};

inline std::atomic<uint64_t> g_next_instance{1};


// ------------------------------------------------------------------------------------------------
struct Impl {
  uint64_t instance_id = g_next_instance.fetch_add(1);

  // normaliser
  std::vector<NormForm> norm;

  // pre-tokeniser: Split steps, then optionally ByteLevel (always last)
  std::vector<SplitStep> splits;
  bool byte_level = false;
  bool bl_add_prefix_space = false;
  std::shared_ptr<const Regex> bl_regex;  // ByteLevel use_regex

  // BPE model. In byte-level mode vocab keys are the raw bytes a token stands for.
  FlatStrMap vocab;
  FlatStrMap vocab_unmappable;  // byte-level mode: tokens with characters outside the byte alphabet
  PairMap merges;
  size_t num_merges = 0;
  std::array<int32_t, 256> byte_id{};  // byte-level: id of each single byte (-1 if absent)
  bool fast_bytes = false;             // byte-level with all 256 byte tokens and no prefix/suffix
  std::string cont_prefix, eow_suffix;
  std::string unk_token;
  int32_t unk_id = -1;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::array<int32_t, 256> fallback_id{};  // id of "<0xXX>" (-1 if absent)

  // added tokens
  std::vector<AddedToken> added;
  FlatStrMap added_by_content;
  AddedMatcher raw_matcher, norm_matcher;

  // post-processor (single sequence)
  std::vector<int32_t> prefix_ids, suffix_ids;

  // decoding
  bool decoder_byte_level = false;
  std::vector<uint32_t> dec_off;  // [vocab_size + 1] offsets into dec_bytes
  std::string dec_bytes;          // per id: bytes its token decodes to
  std::vector<uint32_t> tok_off;  // [vocab_size + 1] offsets into tok_str
  std::string tok_str;            // per id: token string (HF id_to_token)
  std::vector<uint8_t> flags;     // per id: kPresent | kSpecial
  static constexpr uint8_t kPresent = 1, kSpecial = 2;
  size_t vocab_size = 0;

  std::string_view token_bytes(int32_t id) const { return {dec_bytes.data() + dec_off[id], dec_off[id + 1] - dec_off[id]}; }
  std::string_view token_string(int32_t id) const { return {tok_str.data() + tok_off[id], tok_off[id + 1] - tok_off[id]}; }
  bool valid_id(int32_t id) const { return id >= 0 && static_cast<size_t>(id) < vocab_size && (flags[id] & kPresent); }

  /// Model id of a token string as written in the file, -1 if absent.
  int32_t model_token_to_id(std::string_view token) const {
    if (byte_level) {
      if (auto raw = byte_level_unmap(token)) return vocab.find(*raw);
      return vocab_unmappable.find(token);
    }
    return vocab.find(token);
  }
};

/// Parses a tokenizer.json text into a tokenizer (tokenizer/tokenizer_load.cpp). Throws std::invalid_argument naming
/// the component and what is wrong for a malformed or unsupported file, std::runtime_error for text that is not
/// JSON.
std::shared_ptr<const Impl> load_impl(std::string_view json_text);

}  // namespace hypic::engine::tokenizer_detail
