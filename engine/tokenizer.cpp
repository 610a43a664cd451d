// Hugging Face tokenizer.json: loading, encoding and decoding (see engine/tokenizer.h for the
// supported components and the exact semantics reproduced). Component references are to the Rust
// crate `tokenizers` 0.23 (files tokenizer/added_vocabulary.rs, tokenizer/normalizer.rs,
// pre_tokenizers/split.rs, pre_tokenizers/byte_level.rs, models/bpe/{model,word}.rs).
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "engine/tokenizer.h"
#include "engine/io_error.h"
#include "engine/tokenizer_internal.h"

namespace hypic::engine {
namespace tokenizer_detail {

using nlohmann::json;

namespace {

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
const ByteLevelTable& byte_table() {
  static const ByteLevelTable t;
  return t;
}

/// Raw bytes of a byte-level token string, or nullopt if a character is outside the alphabet.
std::optional<std::string> byte_level_unmap(std::string_view token) {
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

std::string byte_level_map(std::string_view bytes) {
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
std::string onig_to_pcre2(std::string_view pat) {
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

std::string escape_literal(std::string_view s) {
  std::string out;
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

constexpr const char* kGpt2Pattern =
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

std::atomic<uint64_t> g_next_instance{1};

}  // namespace

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

namespace {

// ------------------------------------------------------------------------------------------------
// Per-thread working state: PCRE2 match data, buffers, and the BPE word cache.

/// Bounded cache word bytes -> token ids (open addressing, arena storage, cleared when full).
class WordCache {
 public:
  const int32_t* find(std::string_view w, uint64_t h, uint32_t& n) const {
    if (slots_.empty()) return nullptr;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key_off == kEmpty) return nullptr;
      if (s.hash == h && s.key_len == w.size() && std::memcmp(keys_.data() + s.key_off, w.data(), w.size()) == 0) {
        n = s.val_len;
        return vals_.data() + s.val_off;
      }
    }
  }
  void insert(std::string_view w, uint64_t h, const int32_t* ids, uint32_t n) {
    if (w.size() > kMaxWordBytes) return;
    if (count_ + 1 > slots_.size() / 2) {
      if (slots_.size() >= kMaxSlots) clear();
      grow();
    }
    if (keys_.size() + w.size() > kMaxArenaBytes) {
      clear();
      grow();
    }
    Slot s{h, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(w.size()),
           static_cast<uint32_t>(vals_.size()), n};
    keys_.append(w);
    vals_.insert(vals_.end(), ids, ids + n);
    place(s);
    ++count_;
  }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_off = kEmpty, key_len = 0, val_off = 0, val_len = 0;
  };
  static constexpr uint32_t kEmpty = ~uint32_t{0};
  static constexpr size_t kMaxWordBytes = 256;      // longer words are not cached (as HF)
  static constexpr size_t kMaxSlots = size_t{1} << 18;  // at most 131072 words per thread
  static constexpr size_t kMaxArenaBytes = size_t{16} << 20;

  void place(const Slot& s) {
    for (size_t i = s.hash & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key_off == kEmpty) { slots_[i] = s; return; }
    }
  }
  void grow() {
    const size_t cap = slots_.empty() ? 4096 : slots_.size() * 2;
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    for (const Slot& s : old) if (s.key_off != kEmpty) place(s);
  }
  void clear() {
    slots_.clear();
    keys_.clear();
    vals_.clear();
    count_ = 0;
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  std::string keys_;
  std::vector<int32_t> vals_;
  size_t count_ = 0;
};

struct Piece {
  const char* p;
  size_t n;
};

struct Scratch {
  Scratch() {
    md = pcre2_match_data_create(1, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
    if (!md || !mctx || !jit_stack) throw std::bad_alloc();
    pcre2_jit_stack_assign(mctx, nullptr, jit_stack);
  }
  ~Scratch() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mctx);
    pcre2_jit_stack_free(jit_stack);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  std::string norm_a, norm_b, prefixed;
  std::vector<Piece> pieces, pieces_next;
  struct Seg {
    size_t b, e;
    bool is_match;
  };
  std::vector<Seg> segs, acc;
  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };
  std::vector<Sym> syms;
  struct HeapItem {
    uint32_t rank, pos;
    int32_t new_id;
  };
  std::vector<HeapItem> heap;
  std::vector<int32_t> word_ids;
  WordCache cache;
};

Scratch& scratch_for(const Impl& impl) {
  struct Slot {
    uint64_t id;
    std::unique_ptr<Scratch> s;
  };
  thread_local std::vector<Slot> slots;
  for (auto& slot : slots) if (slot.id == impl.instance_id) return *slot.s;
  if (slots.size() >= 4) slots.erase(slots.begin());
  slots.push_back({impl.instance_id, std::make_unique<Scratch>()});
  return *slots.back().s;
}

// ------------------------------------------------------------------------------------------------
// Encoding

/// HF `Pattern for &SysRegex` + Oniguruma's find_iter: matches and gaps covering subject[0, n);
/// an empty match directly at the end of the previous match is skipped (the search advances one
/// character), as onig's FindMatches does.
void regex_segments(const Regex& re, const char* s, size_t n, Scratch& sc) {
  sc.segs.clear();
  if (n == 0) {
    sc.segs.push_back({0, 0, false});
    return;
  }
  size_t pos = 0, prev = 0;
  size_t last_end = SIZE_MAX;
  while (pos <= n) {
    size_t mb, me;
    if (!re.match(s, n, pos, sc.md, sc.mctx, mb, me)) break;
    if (mb == me && me == last_end) {
      if (pos >= n) break;
      pos += utf8_seq_len(static_cast<unsigned char>(s[pos]));
      continue;
    }
    if (prev != mb) sc.segs.push_back({prev, mb, false});
    sc.segs.push_back({mb, me, true});
    prev = me;
    pos = me;
    last_end = me;
  }
  if (prev != n) sc.segs.push_back({prev, n, false});
}

/// HF NormalizedString::split: applies a SplitDelimiterBehavior to the segments and appends the
/// kept, non-empty pieces.
void split_piece(const SplitStep& step, Piece in, Scratch& sc, std::vector<Piece>& out) {
  regex_segments(*step.regex, in.p, in.n, sc);
  auto& segs = sc.segs;
  if (step.invert) for (auto& s : segs) s.is_match = !s.is_match;
  auto emit = [&](size_t b, size_t e) {
    if (e > b) out.push_back({in.p + b, e - b});
  };
  switch (step.behavior) {
    case SplitBehavior::Isolated:
      for (const auto& s : segs) emit(s.b, s.e);
      return;
    case SplitBehavior::Removed:
      for (const auto& s : segs) if (!s.is_match) emit(s.b, s.e);
      return;
    case SplitBehavior::Contiguous:
    case SplitBehavior::MergedWithPrevious: {
      // Fold left: a segment is merged into the previous output when the rule says so.
      auto& acc = sc.acc;
      acc.clear();
      bool prev_match = false;
      for (const auto& s : segs) {
        const bool merge = step.behavior == SplitBehavior::Contiguous ? (s.is_match == prev_match)
                                                                       : (s.is_match && !prev_match);
        if (merge && !acc.empty()) acc.back().e = s.e;
        else acc.push_back({s.b, s.e, false});
        prev_match = s.is_match;
      }
      for (const auto& s : acc) emit(s.b, s.e);
      return;
    }
    case SplitBehavior::MergedWithNext: {
      auto& acc = sc.acc;  // built right to left
      acc.clear();
      bool prev_match = false;
      for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
        if (it->is_match && !prev_match && !acc.empty()) acc.back().b = it->b;
        else acc.push_back({it->b, it->e, false});
        prev_match = it->is_match;
      }
      for (auto it = acc.rbegin(); it != acc.rend(); ++it) emit(it->b, it->e);
      return;
    }
  }
}

/// HF BPE Word::merge_all (no dropout): repeatedly applies the lowest-rank merge, leftmost first.
void merge_symbols(const Impl& im, Scratch& sc) {
  auto& syms = sc.syms;
  auto& heap = sc.heap;
  heap.clear();
  const auto cmp = [](const Scratch::HeapItem& a, const Scratch::HeapItem& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;  // min-heap on (rank, pos)
  };
  for (size_t i = 0; i + 1 < syms.size(); ++i) {
    if (const auto* e = im.merges.find(syms[i].id, syms[i + 1].id)) {
      heap.push_back({e->rank, static_cast<uint32_t>(i), e->new_id});
    }
  }
  std::make_heap(heap.begin(), heap.end(), cmp);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), cmp);
    const Scratch::HeapItem top = heap.back();
    heap.pop_back();
    Scratch::Sym& cur = syms[top.pos];
    if (!cur.alive || cur.next < 0) continue;
    const int32_t nx = cur.next;
    const auto* e = im.merges.find(cur.id, syms[nx].id);
    if (!e || e->new_id != top.new_id) continue;  // stale entry
    cur.id = top.new_id;
    cur.next = syms[nx].next;
    syms[nx].alive = false;
    if (cur.next >= 0) syms[cur.next].prev = static_cast<int32_t>(top.pos);
    if (cur.prev >= 0) {
      if (const auto* e2 = im.merges.find(syms[cur.prev].id, cur.id)) {
        heap.push_back({e2->rank, static_cast<uint32_t>(cur.prev), e2->new_id});
        std::push_heap(heap.begin(), heap.end(), cmp);
      }
    }
    if (cur.next >= 0) {
      if (const auto* e3 = im.merges.find(cur.id, syms[cur.next].id)) {
        heap.push_back({e3->rank, top.pos, e3->new_id});
        std::push_heap(heap.begin(), heap.end(), cmp);
      }
    }
  }
}

void push_sym(Scratch& sc, int32_t id) {
  const auto n = static_cast<int32_t>(sc.syms.size());
  if (n > 0) sc.syms.back().next = n;
  sc.syms.push_back({id, n - 1, -1, true});
}

/// HF BPE::merge_word's initial symbols for the general path (missing units: byte fallback,
/// then unk with fuse_unk; with neither, an error).
void initial_symbols_general(const Impl& im, std::string_view w, Scratch& sc) {
  sc.syms.clear();
  int32_t pending_unk = -1;
  std::string unit;
  size_t i = 0;
  while (i < w.size()) {
    const size_t len = im.byte_level ? 1 : utf8_seq_len(static_cast<unsigned char>(w[i]));
    const bool first = i == 0, last = i + len >= w.size();
    unit.clear();
    if (!first) unit += im.cont_prefix;
    unit.append(w.data() + i, len);
    if (last) unit += im.eow_suffix;
    i += len;
    const int32_t id = im.vocab.find(unit);
    if (id >= 0) {
      if (pending_unk >= 0) { push_sym(sc, pending_unk); pending_unk = -1; }
      push_sym(sc, id);
      continue;
    }
    // The unit as HF sees it: in byte-level mode, the mapped character.
    const std::string shown = im.byte_level ? byte_level_map(unit) : unit;
    if (im.byte_fallback) {
      bool all = true;
      for (const char c : shown) all = all && im.fallback_id[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        for (const char c : shown) push_sym(sc, im.fallback_id[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    if (!im.unk_token.empty()) {
      if (im.unk_id < 0) {
        throw std::invalid_argument("Tokenizer::encode: model.unk_token '" + im.unk_token + "' is not in the vocab");
      }
      if (pending_unk >= 0 && !im.fuse_unk) push_sym(sc, pending_unk);
      pending_unk = im.unk_id;
      continue;
    }
    throw std::invalid_argument("Tokenizer::encode: '" + shown +
                                "' has no vocab entry, no byte fallback and the model has no unk_token");
  }
  if (pending_unk >= 0) push_sym(sc, pending_unk);
}

/// BPE of one pre-token (raw bytes in byte-level mode), appended to `out`.
void bpe_word(const Impl& im, std::string_view w, Scratch& sc, std::vector<int32_t>& out) {
  if (im.fast_bytes && w.size() == 1) {
    out.push_back(im.byte_id[static_cast<unsigned char>(w[0])]);
    return;
  }
  if (im.ignore_merges) {
    if (const int32_t id = im.vocab.find(w); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  const uint64_t h = XXH3_64bits(w.data(), w.size());
  uint32_t n = 0;
  if (const int32_t* hit = sc.cache.find(w, h, n)) {
    out.insert(out.end(), hit, hit + n);
    return;
  }
  if (im.fast_bytes) {
    sc.syms.resize(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      sc.syms[i] = {im.byte_id[static_cast<unsigned char>(w[i])], static_cast<int32_t>(i) - 1,
                    i + 1 < w.size() ? static_cast<int32_t>(i + 1) : -1, true};
    }
  } else {
    initial_symbols_general(im, w, sc);
  }
  merge_symbols(im, sc);
  sc.word_ids.clear();
  for (const auto& s : sc.syms) if (s.alive) sc.word_ids.push_back(s.id);
  sc.cache.insert(w, h, sc.word_ids.data(), static_cast<uint32_t>(sc.word_ids.size()));
  out.insert(out.end(), sc.word_ids.begin(), sc.word_ids.end());
}

/// Pre-tokenisation (Split steps, then ByteLevel) and BPE of one normalised text piece.
void pretokenize_and_bpe(const Impl& im, std::string_view text, Scratch& sc, std::vector<int32_t>& out) {
  if (text.empty()) return;
  auto finish = [&](Piece p) {
    if (!im.byte_level || (!im.bl_add_prefix_space && !im.bl_regex)) {
      bpe_word(im, {p.p, p.n}, sc, out);
      return;
    }
    // ByteLevel pre-tokenizer: optional prefix space, then the GPT-2 regex (Isolated).
    Piece q = p;
    if (im.bl_add_prefix_space && p.p[0] != ' ') {
      sc.prefixed.assign(1, ' ');
      sc.prefixed.append(p.p, p.n);
      q = {sc.prefixed.data(), sc.prefixed.size()};
    }
    if (!im.bl_regex) {
      bpe_word(im, {q.p, q.n}, sc, out);
      return;
    }
    regex_segments(*im.bl_regex, q.p, q.n, sc);
    // bpe_word does not touch sc.segs, so iterating it here is safe.
    for (const auto& s : sc.segs) if (s.e > s.b) bpe_word(im, {q.p + s.b, s.e - s.b}, sc, out);
  };
  if (im.splits.empty()) {
    finish({text.data(), text.size()});
    return;
  }
  sc.pieces.clear();
  sc.pieces.push_back({text.data(), text.size()});
  for (size_t k = 0; k < im.splits.size(); ++k) {
    sc.pieces_next.clear();
    for (const Piece& p : sc.pieces) split_piece(im.splits[k], p, sc, sc.pieces_next);
    sc.pieces.swap(sc.pieces_next);
  }
  for (const Piece& p : sc.pieces) finish(p);
}

bool ends_with_word_char(std::string_view s) {
  if (s.empty()) return false;
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  size_t len;
  return is_word_char(utf8_decode(s.data() + i, len));
}
bool starts_with_word_char(std::string_view s) {
  if (s.empty()) return false;
  size_t len;
  return is_word_char(utf8_decode(s.data(), len));
}
/// Start of the run of White_Space characters that ends `s` (HF regex `\s*$`).
size_t trailing_space_start(std::string_view s) {
  size_t i = s.size();
  while (i > 0) {
    size_t j = i - 1;
    while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
    size_t len;
    if (!is_white_space(utf8_decode(s.data() + j, len))) break;
    i = j;
  }
  return i;
}
/// Length of the run of White_Space characters that starts `s` (HF regex `^\s*`).
size_t leading_space_len(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t len;
    if (!is_white_space(utf8_decode(s.data() + i, len))) break;
    i += len;
  }
  return i;
}

/// HF AddedVocabulary::find_matches: calls on_text(begin, end) for the gaps and on_token(id) for
/// the added tokens found in `s`, in order.
/// With skip_special (SpecialTokens::Split) the matches of special tokens are passed over, as HF's
/// `encode_special_tokens` does: the search resumes after them and their text stays in the gap.
template <class OnText, class OnToken>
void split_added(const Impl& im, const AddedMatcher& matcher, std::string_view s, bool skip_special, OnText&& on_text,
                 OnToken&& on_token) {
  if (matcher.empty()) {
    on_text(0, s.size());
    return;
  }
  size_t start_offset = 0, search = 0;
  size_t mb, mlen;
  uint32_t ti;
  while (search <= s.size() && matcher.find(s, search, mb, mlen, ti)) {
    search = mb + mlen;
    const AddedToken& t = im.added[ti];
    if (skip_special && t.special_content) continue;
    size_t start = mb, stop = mb + mlen;
    if (t.single_word) {
      const bool start_space = start == 0 || !ends_with_word_char(s.substr(0, start));
      const bool stop_space = stop == s.size() || !starts_with_word_char(s.substr(stop));
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) start = std::max(trailing_space_start(s.substr(0, start)), start_offset);
    if (t.rstrip) stop += leading_space_len(s.substr(stop));
    if (start_offset < start) on_text(start_offset, start);
    on_token(t.id);
    start_offset = stop;
  }
  if (start_offset < s.size()) on_text(start_offset, s.size());
}

/// Normalises `in` with the normaliser sequence; returns a view into sc.norm_a/norm_b or `in`.
std::string_view normalize(const Impl& im, std::string_view in, Scratch& sc) {
  std::string_view cur = in;
  std::string* bufs[2] = {&sc.norm_a, &sc.norm_b};
  int which = 0;
  for (const NormForm f : im.norm) {
    std::string& dst = *bufs[which];
    dst.clear();
    normalize_append(f, cur, dst);
    cur = dst;
    which ^= 1;
  }
  return cur;
}

// ------------------------------------------------------------------------------------------------
// Loading

[[noreturn]] void bad(const std::string& where, const std::string& what) {
  throw std::invalid_argument("tokenizer.json: " + where + ": " + what);
}

std::string type_of(const json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) bad(where, "expected an object with a string 'type'");
  return j["type"].get<std::string>();
}

bool get_bool(const json& j, const char* key, bool dflt, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return dflt;
  if (!j[key].is_boolean()) bad(where + "." + key, "expected a boolean");
  return j[key].get<bool>();
}

std::string get_str(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return {};
  if (!j[key].is_string()) bad(where + "." + key, "expected a string or null");
  return j[key].get<std::string>();
}

void parse_normalizer(const json& j, const std::string& where, Impl& im) {
  if (j.is_null()) return;
  const std::string t = type_of(j, where);
  if (t == "NFC") im.norm.push_back(NormForm::NFC);
  else if (t == "NFD") im.norm.push_back(NormForm::NFD);
  else if (t == "NFKC") im.norm.push_back(NormForm::NFKC);
  else if (t == "NFKD") im.norm.push_back(NormForm::NFKD);
  else if (t == "Sequence") {
    const json& list = j.value("normalizers", json());
    if (!list.is_array()) bad(where + ".normalizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) parse_normalizer(list[i], where + ".normalizers[" + std::to_string(i) + "]", im);
  } else {
    bad(where + ".type", "unsupported normalizer '" + t + "' (supported: NFC, NFD, NFKC, NFKD, Sequence)");
  }
}

SplitBehavior parse_behavior(const json& j, const std::string& where) {
  if (!j.is_string()) bad(where, "expected a string");
  const std::string b = j.get<std::string>();
  if (b == "Removed") return SplitBehavior::Removed;
  if (b == "Isolated") return SplitBehavior::Isolated;
  if (b == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (b == "Contiguous") return SplitBehavior::Contiguous;
  bad(where, "unknown behavior '" + b + "'");
}

void parse_pre_tokenizer(const json& j, const std::string& where, Impl& im) {
  if (j.is_null()) return;
  const std::string t = type_of(j, where);
  if (im.byte_level) bad(where, "a pre-tokenizer after ByteLevel is not supported (ByteLevel must be last)");
  if (t == "Sequence") {
    const json& list = j.value("pretokenizers", json());
    if (!list.is_array()) bad(where + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_pre_tokenizer(list[i], where + ".pretokenizers[" + std::to_string(i) + "]", im);
    }
  } else if (t == "Split") {
    SplitStep step;
    const json& pat = j.value("pattern", json());
    std::string pattern;
    if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string()) {
      pattern = onig_to_pcre2(pat["Regex"].get<std::string>());
    } else if (pat.is_object() && pat.contains("String") && pat["String"].is_string()) {
      pattern = escape_literal(pat["String"].get<std::string>());
    } else {
      bad(where + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    step.regex = std::make_shared<const Regex>(pattern, "tokenizer.json: " + where + ".pattern");
    step.behavior = parse_behavior(j.value("behavior", json()), where + ".behavior");
    step.invert = get_bool(j, "invert", false, where);
    im.splits.push_back(std::move(step));
  } else if (t == "ByteLevel") {
    im.byte_level = true;
    im.bl_add_prefix_space = get_bool(j, "add_prefix_space", true, where);
    if (get_bool(j, "use_regex", true, where)) {
      im.bl_regex = std::make_shared<const Regex>(onig_to_pcre2(kGpt2Pattern), "ByteLevel regex");
    }
  } else {
    bad(where + ".type", "unsupported pre-tokenizer '" + t + "' (supported: Split, ByteLevel, Sequence)");
  }
}

void parse_decoder(const json& j, const std::string& where, Impl& im) {
  if (j.is_null()) return;
  const std::string t = type_of(j, where);
  if (t == "ByteLevel") {
    im.decoder_byte_level = true;
  } else if (t == "Sequence") {
    const json& list = j.value("decoders", json());
    if (!list.is_array() || list.size() != 1 || type_of(list[0], where + ".decoders[0]") != "ByteLevel") {
      bad(where, "only a Sequence holding exactly one ByteLevel decoder is supported");
    }
    im.decoder_byte_level = true;
  } else {
    bad(where + ".type", "unsupported decoder '" + t + "' (supported: ByteLevel, Sequence[ByteLevel], null)");
  }
}

int32_t special_id(const json& arr, const std::string& where) {
  // BertProcessing / RobertaProcessing: ["[CLS]", 101]
  if (!arr.is_array() || arr.size() != 2 || !arr[1].is_number_integer()) bad(where, "expected [token, id]");
  return arr[1].get<int32_t>();
}

void parse_post_processor(const json& j, const std::string& where, Impl& im) {
  if (j.is_null()) return;
  const std::string t = type_of(j, where);
  std::vector<int32_t> pre, suf;
  if (t == "ByteLevel") {
    return;
  } else if (t == "Sequence") {
    const json& list = j.value("processors", json());
    if (!list.is_array()) bad(where + ".processors", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) parse_post_processor(list[i], where + ".processors[" + std::to_string(i) + "]", im);
    return;
  } else if (t == "BertProcessing" || t == "RobertaProcessing") {
    pre.push_back(special_id(j.value("cls", json()), where + ".cls"));
    suf.push_back(special_id(j.value("sep", json()), where + ".sep"));
  } else if (t == "TemplateProcessing") {
    const json& single = j.value("single", json());
    const json& specials = j.value("special_tokens", json::object());
    if (!single.is_array()) bad(where + ".single", "expected an array of template pieces");
    bool seen_a = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string w = where + ".single[" + std::to_string(i) + "]";
      const json& piece = single[i];
      if (piece.contains("Sequence")) {
        const std::string id = piece["Sequence"].value("id", std::string());
        if (id != "A" || seen_a) bad(w, "the single template must hold sequence A exactly once (found '" + id + "')");
        seen_a = true;
      } else if (piece.contains("SpecialToken")) {
        const std::string name = piece["SpecialToken"].value("id", std::string());
        if (!specials.contains(name)) bad(w, "special token '" + name + "' missing from special_tokens");
        const json& ids = specials[name].value("ids", json());
        if (!ids.is_array()) bad(where + ".special_tokens." + name + ".ids", "expected an array");
        for (const auto& id : ids) (seen_a ? suf : pre).push_back(id.get<int32_t>());
      } else {
        bad(w, "expected a Sequence or SpecialToken piece");
      }
    }
    if (!seen_a) bad(where + ".single", "template has no sequence A");
  } else {
    bad(where + ".type", "unsupported post_processor '" + t +
                             "' (supported: ByteLevel, TemplateProcessing, BertProcessing, RobertaProcessing, Sequence)");
  }
  // Apply after the processors already parsed: ids -> pre + ids + suf.
  im.prefix_ids.insert(im.prefix_ids.begin(), pre.begin(), pre.end());
  im.suffix_ids.insert(im.suffix_ids.end(), suf.begin(), suf.end());
}

/// model.vocab and model.merges of tokenizer.json, captured while parsing (they are 99% of a
/// large file; a DOM of them costs more than the rest of loading).
struct ModelArrays {
  bool have_vocab = false;
  std::vector<std::pair<std::string, int64_t>> vocab;  // in file order
  bool have_merges = false;
  std::vector<std::pair<std::string, std::string>> merges;  // [a, b] form
  std::vector<std::string> merge_lines;                      // "a b" form
};

/// SAX handler: builds a DOM of the document except model.vocab / model.merges, which go
/// straight into ModelArrays. Content errors inside those two stop the parse with `error` set.
class LoaderSax : public nlohmann::json_sax<json> {
 public:
  json root;
  ModelArrays arrays;
  std::string error;  // content error (the JSON itself may be fine)

  bool null() override { return value(nullptr, "null"); }
  bool boolean(bool v) override { return value(v, "a boolean"); }
  bool number_integer(number_integer_t v) override { return mode_ == Mode::Vocab ? vocab_id(v) : value(v, "a number"); }
  bool number_unsigned(number_unsigned_t v) override {
    return mode_ == Mode::Vocab ? vocab_id(v > static_cast<number_unsigned_t>(INT64_MAX) ? -1 : static_cast<int64_t>(v))
                                : value(v, "a number");
  }
  bool number_float(number_float_t v, const string_t&) override { return value(v, "a number"); }
  bool binary(binary_t& v) override { return value(json::binary(std::move(v)), "binary data"); }
  bool string(string_t& v) override {
    if (mode_ == Mode::Merges) {
      if (depth_ == 1) {
        if (!arrays.merges.empty()) return fail(merge_where() + ": merges mix \"a b\" strings and [a, b] pairs");
        arrays.merge_lines.push_back(std::move(v));
        return true;
      }
      if (pair_len_ >= 2) return fail(merge_where() + ": expected \"a b\" or [a, b]");
      (pair_len_ == 0 ? pair_.first : pair_.second) = std::move(v);
      ++pair_len_;
      return true;
    }
    return value(std::move(v), "a string");
  }
  bool start_object(std::size_t) override {
    if (mode_ == Mode::None && at_model_field("vocab")) {
      mode_ = Mode::Vocab;
      arrays.have_vocab = true;
      return true;
    }
    if (mode_ != Mode::None) return value(json::object(), "an object");
    stack_.push_back(handle(json::object()));
    keys_.resize(stack_.size() - 1);
    return true;
  }
  bool key(string_t& k) override {
    if (mode_ == Mode::Vocab) {
      key_ = std::move(k);
      return true;
    }
    const size_t level = stack_.size() - 1;
    if (keys_.size() <= level) keys_.resize(level + 1);
    keys_[level] = k;
    object_element_ = &(*stack_.back())[k];
    return true;
  }
  bool end_object() override {
    if (mode_ == Mode::Vocab) {
      mode_ = Mode::None;
      return true;
    }
    stack_.pop_back();
    keys_.resize(std::min(keys_.size(), stack_.size()));
    return true;
  }
  bool start_array(std::size_t) override {
    if (mode_ == Mode::None && at_model_field("merges")) {
      mode_ = Mode::Merges;
      depth_ = 1;
      arrays.have_merges = true;
      return true;
    }
    if (mode_ == Mode::Merges && depth_ == 1) {
      if (!arrays.merge_lines.empty()) return fail(merge_where() + ": merges mix \"a b\" strings and [a, b] pairs");
      depth_ = 2;
      pair_len_ = 0;
      return true;
    }
    if (mode_ != Mode::None) return value(json::array(), "an array");
    stack_.push_back(handle(json::array()));
    keys_.resize(stack_.size() - 1);
    return true;
  }
  bool end_array() override {
    if (mode_ == Mode::Merges) {
      if (depth_ == 2) {
        if (pair_len_ != 2) return fail(merge_where() + ": expected \"a b\" or [a, b]");
        arrays.merges.push_back(std::move(pair_));
        pair_ = {};
        depth_ = 1;
      } else {
        mode_ = Mode::None;
      }
      return true;
    }
    stack_.pop_back();
    keys_.resize(std::min(keys_.size(), stack_.size()));
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override {
    parse_message_ = ex.what();
    return false;
  }
  const std::string& parse_message() const { return parse_message_; }

 private:
  enum class Mode { None, Vocab, Merges };

  bool at_model_field(const char* name) const {
    return stack_.size() == 2 && keys_.size() == 2 && keys_[0] == "model" && keys_[1] == name && stack_[0]->is_object() &&
           stack_[1]->is_object();
  }
  json* handle(json v) {
    if (stack_.empty()) {
      root = std::move(v);
      return &root;
    }
    if (stack_.back()->is_array()) {
      stack_.back()->push_back(std::move(v));
      return &stack_.back()->back();
    }
    *object_element_ = std::move(v);
    return object_element_;
  }
  template <class V>
  bool value(V&& v, const char* what) {
    if (mode_ == Mode::Vocab) return fail("model.vocab['" + key_ + "']: expected a non-negative integer id, got " + what);
    if (mode_ == Mode::Merges) return fail(merge_where() + ": expected \"a b\" or [a, b], got " + what);
    handle(json(std::forward<V>(v)));
    return true;
  }
  bool vocab_id(int64_t id) {
    if (id < 0 || id >= INT32_MAX) return fail("model.vocab['" + key_ + "']: expected a non-negative integer id");
    arrays.vocab.emplace_back(std::move(key_), id);
    return true;
  }
  std::string merge_where() const {
    return "model.merges[" + std::to_string(arrays.merges.size() + arrays.merge_lines.size()) + "]";
  }
  bool fail(std::string msg) {
    error = "tokenizer.json: " + std::move(msg);
    return false;
  }

  std::vector<json*> stack_;
  std::vector<std::string> keys_;  // last key seen at each open object level
  json* object_element_ = nullptr;
  Mode mode_ = Mode::None;
  int depth_ = 0;
  std::string key_;
  std::pair<std::string, std::string> pair_;
  int pair_len_ = 0;
  std::string parse_message_;
};

/// Internal vocab key of a token string (raw bytes in byte-level mode).
std::optional<std::string> internal_key(const Impl& im, const std::string& token) {
  if (!im.byte_level) return token;
  return byte_level_unmap(token);
}

void parse_model(const json& m, const ModelArrays& arrays, Impl& im,
                 std::vector<std::pair<int32_t, std::string>>& id_tokens) {
  const std::string where = "model";
  if (!m.is_object()) bad(where, "expected an object");
  if (m.contains("type") && !(m["type"].is_string() && m["type"].get<std::string>() == "BPE")) {
    bad(where + ".type", "unsupported model '" + m["type"].dump() + "' (supported: BPE)");
  }
  if (m.contains("dropout") && !m["dropout"].is_null()) {
    if (!m["dropout"].is_number() || m["dropout"].get<double>() != 0.0) {
      bad(where + ".dropout", "BPE dropout is random; only null or 0 is supported (got " + m["dropout"].dump() + ")");
    }
  }
  im.cont_prefix = get_str(m, "continuing_subword_prefix", where);
  im.eow_suffix = get_str(m, "end_of_word_suffix", where);
  im.unk_token = get_str(m, "unk_token", where);
  im.fuse_unk = get_bool(m, "fuse_unk", false, where);
  im.byte_fallback = get_bool(m, "byte_fallback", false, where);
  im.ignore_merges = get_bool(m, "ignore_merges", false, where);
  if (im.byte_level && (!im.cont_prefix.empty() || !im.eow_suffix.empty())) {
    bad(where, "continuing_subword_prefix / end_of_word_suffix together with a ByteLevel pre-tokenizer is not supported");
  }
  if (!arrays.have_vocab) bad(where + ".vocab", "expected an object token -> id");
  if (!arrays.have_merges) bad(where + ".merges", "expected an array");
  im.vocab.reserve(arrays.vocab.size());
  // Token strings as written in the file -> id, for resolving merges.
  FlatStrMap by_str;
  by_str.reserve(arrays.vocab.size());
  for (const auto& [token, id64] : arrays.vocab) {
    const auto id = static_cast<int32_t>(id64);
    id_tokens.emplace_back(id, token);
    by_str.insert_or_assign(token, id);
    if (auto key = internal_key(im, token)) im.vocab.insert_or_assign(*key, id);
    else im.vocab_unmappable.insert_or_assign(token, id);
  }
  const size_t n_merges = arrays.merges.size() + arrays.merge_lines.size();
  im.merges.reserve(n_merges);
  const size_t plen = im.cont_prefix.size();
  uint32_t rank = 0;
  std::string merged;
  for (size_t i = 0; i < n_merges; ++i) {
    const auto at = [&] { return where + ".merges[" + std::to_string(i) + "]"; };
    std::string_view a, b;
    if (arrays.merge_lines.empty()) {
      a = arrays.merges[i].first;
      b = arrays.merges[i].second;
    } else {
      const std::string& line = arrays.merge_lines[i];
      if (line.rfind("#version", 0) == 0) continue;  // HF skips a "#version" header line
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos) {
        bad(at(), "expected \"a b\" with exactly one space, got '" + line + "'");
      }
      a = std::string_view(line).substr(0, sp);
      b = std::string_view(line).substr(sp + 1);
    }
    const int32_t ia = by_str.find(a), ib = by_str.find(b);
    if (ia < 0) bad(at(), "token '" + std::string(a) + "' is not in the vocab");
    if (ib < 0) bad(at(), "token '" + std::string(b) + "' is not in the vocab");
    if (b.size() < plen) bad(at(), "token '" + std::string(b) + "' is shorter than continuing_subword_prefix");
    merged.assign(a);
    merged.append(b.substr(plen));
    const int32_t im_id = by_str.find(merged);
    if (im_id < 0) bad(at(), "merged token '" + merged + "' is not in the vocab");
    im.merges.insert_or_assign(static_cast<uint32_t>(ia), static_cast<uint32_t>(ib), rank, im_id);
    ++rank;
  }
  im.num_merges = rank;

  // Byte tables.
  im.byte_id.fill(-1);
  im.fallback_id.fill(-1);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    im.fallback_id[b] = im.model_token_to_id(name);
    if (im.byte_level) im.byte_id[b] = im.vocab.find(std::string(1, static_cast<char>(b)));
  }
  if (!im.unk_token.empty()) im.unk_id = im.model_token_to_id(im.unk_token);
  im.fast_bytes = im.byte_level &&
                  std::all_of(im.byte_id.begin(), im.byte_id.end(), [](int32_t id) { return id >= 0; });
}

void parse_added_tokens(const json& list, Impl& im, std::vector<std::pair<int32_t, std::string>>& id_tokens,
                        size_t model_vocab_len) {
  if (list.is_null()) return;
  if (!list.is_array()) bad("added_tokens", "expected an array");
  // HF AddedVocabulary::add_tokens: an added token takes the id of an existing token with the
  // same content, else the next free id from the model's vocab size. Refuse files whose ids
  // disagree with that (HF would renumber them with only a warning).
  int64_t next_id = static_cast<int64_t>(model_vocab_len);
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = "added_tokens[" + std::to_string(i) + "]";
    const json& j = list[i];
    if (!j.is_object() || !j.contains("content") || !j["content"].is_string() || !j.contains("id") ||
        !j["id"].is_number_integer()) {
      bad(where, "expected an object with 'id' and 'content'");
    }
    AddedToken t;
    t.content = j["content"].get<std::string>();
    t.id = j["id"].get<int32_t>();
    t.special = get_bool(j, "special", false, where);
    t.lstrip = get_bool(j, "lstrip", false, where);
    t.rstrip = get_bool(j, "rstrip", false, where);
    t.single_word = get_bool(j, "single_word", false, where);
    t.normalized = get_bool(j, "normalized", !t.special, where);
    if (t.content.empty()) continue;  // HF ignores empty added tokens
    if (find_invalid_utf8(t.content)) bad(where + ".content", "invalid UTF-8");
    int64_t expect;
    if (const int32_t prev = im.added_by_content.find(t.content); prev >= 0) expect = prev;
    else if (int32_t mid = im.model_token_to_id(t.content); mid >= 0) expect = mid;
    else expect = next_id++;
    if (expect != t.id) {
      bad(where, "token '" + t.content + "' has id " + std::to_string(t.id) + " but Hugging Face tokenizers would give it id " +
                     std::to_string(expect));
    }
    t.pattern = t.content;
    if (t.normalized && !im.norm.empty()) {
      std::string cur = t.content;
      for (const NormForm f : im.norm) {
        std::string next;
        normalize_append(f, cur, next);
        cur.swap(next);
      }
      t.pattern = cur;
    }
    im.added_by_content.insert_or_assign(t.content, t.id);
    // HF decodes a normalized added token through its normalised form (simple_id_to_token).
    id_tokens.emplace_back(t.id, t.normalized ? t.pattern : t.content);
    im.added.push_back(std::move(t));
  }
  std::unordered_set<std::string> special_contents;
  for (const auto& t : im.added) if (t.special) special_contents.insert(t.content);
  for (auto& t : im.added) t.special_content = special_contents.count(t.content) > 0;
  im.raw_matcher.build(im.added, /*normalized=*/false);
  im.norm_matcher.build(im.added, /*normalized=*/true);
}

void build_id_tables(Impl& im, std::vector<std::pair<int32_t, std::string>>& id_tokens) {
  int64_t max_id = -1;
  for (const auto& [id, s] : id_tokens) max_id = std::max<int64_t>(max_id, id);
  im.vocab_size = static_cast<size_t>(max_id + 1);
  // Later entries (added tokens) win over model tokens with the same id, as in HF's id_to_token.
  std::vector<const std::string*> by_id(im.vocab_size, nullptr);
  for (const auto& [id, s] : id_tokens) by_id[id] = &s;
  im.flags.assign(im.vocab_size, 0);
  im.tok_off.assign(im.vocab_size + 1, 0);
  im.dec_off.assign(im.vocab_size + 1, 0);
  std::unordered_set<std::string> special_contents;
  for (const auto& t : im.added) if (t.special) special_contents.insert(t.content);
  for (size_t id = 0; id < im.vocab_size; ++id) {
    im.tok_off[id] = static_cast<uint32_t>(im.tok_str.size());
    im.dec_off[id] = static_cast<uint32_t>(im.dec_bytes.size());
    if (!by_id[id]) continue;
    const std::string& s = *by_id[id];
    im.flags[id] |= Impl::kPresent;
    if (special_contents.count(s)) im.flags[id] |= Impl::kSpecial;
    im.tok_str += s;
    if (im.decoder_byte_level) {
      // HF ByteLevel decoder: characters of the byte alphabet become bytes; a token with any other
      // character is taken as its UTF-8 text.
      if (auto raw = byte_level_unmap(s)) im.dec_bytes += *raw;
      else im.dec_bytes += s;
    } else {
      im.dec_bytes += s;
    }
  }
  im.tok_off[im.vocab_size] = static_cast<uint32_t>(im.tok_str.size());
  im.dec_off[im.vocab_size] = static_cast<uint32_t>(im.dec_bytes.size());
  for (int32_t id : im.prefix_ids) if (!im.valid_id(id)) bad("post_processor", "special token id " + std::to_string(id) + " is not in the vocabulary");
  for (int32_t id : im.suffix_ids) if (!im.valid_id(id)) bad("post_processor", "special token id " + std::to_string(id) + " is not in the vocabulary");
}

std::shared_ptr<const Impl> build_impl(const json& root, const ModelArrays& arrays) {
  if (!root.is_object()) bad("(root)", "expected a JSON object");
  auto im = std::make_shared<Impl>();
  for (const char* key : {"truncation", "padding"}) {
    if (root.contains(key) && !root[key].is_null()) bad(key, "must be null (truncation/padding are not supported)");
  }
  parse_normalizer(root.value("normalizer", json()), "normalizer", *im);
  parse_pre_tokenizer(root.value("pre_tokenizer", json()), "pre_tokenizer", *im);
  std::vector<std::pair<int32_t, std::string>> id_tokens;
  if (!root.contains("model")) bad("model", "missing");
  parse_model(root["model"], arrays, *im, id_tokens);
  const size_t model_vocab_len = id_tokens.size();
  parse_added_tokens(root.value("added_tokens", json()), *im, id_tokens, model_vocab_len);
  parse_decoder(root.value("decoder", json()), "decoder", *im);
  parse_post_processor(root.value("post_processor", json()), "post_processor", *im);
  build_id_tables(*im, id_tokens);
  return im;
}

}  // namespace
}  // namespace tokenizer_detail

using tokenizer_detail::Impl;

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::from_json_string(std::string_view json_text) {
  tokenizer_detail::LoaderSax sax;
  if (!nlohmann::json::sax_parse(json_text.begin(), json_text.end(), &sax)) {
    if (!sax.error.empty()) throw std::invalid_argument(sax.error);
    throw std::runtime_error("tokenizer.json: not valid JSON: " + sax.parse_message());
  }
  return Tokenizer(tokenizer_detail::build_impl(sax.root, sax.arrays));
}

Tokenizer Tokenizer::load(const std::filesystem::path& tokenizer_json) {
  const std::string text = read_file_bytes(tokenizer_json, "Tokenizer::load: cannot read ");
  try {
    return from_json_string(text);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(tokenizer_json.string() + ": " + e.what());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(tokenizer_json.string() + ": " + e.what());
  }
}

void Tokenizer::encode_into(std::string_view text, bool add_special_tokens, std::vector<int32_t>& out) const {
  encode_into(text, add_special_tokens, SpecialTokens::Match, out);
}

void Tokenizer::encode_into(std::string_view text, bool add_special_tokens, SpecialTokens special,
                            std::vector<int32_t>& out) const {
  using namespace tokenizer_detail;
  const bool skip = special == SpecialTokens::Split;
  const Impl& im = *impl_;
  if (const auto bad_at = find_invalid_utf8(text)) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned>(static_cast<unsigned char>(text[*bad_at])));
    throw std::invalid_argument("Tokenizer::encode: invalid UTF-8 at byte offset " + std::to_string(*bad_at) + " (byte " +
                                hex + ")");
  }
  if (add_special_tokens) out.insert(out.end(), im.prefix_ids.begin(), im.prefix_ids.end());
  Scratch& sc = scratch_for(im);
  const auto push_id = [&](int32_t id) { out.push_back(id); };
  split_added(
      im, im.raw_matcher, text, skip,
      [&](size_t b, size_t e) {
        const std::string_view normed = normalize(im, text.substr(b, e - b), sc);
        if (im.norm_matcher.empty()) {
          pretokenize_and_bpe(im, normed, sc, out);
          return;
        }
        split_added(
            im, im.norm_matcher, normed, skip,
            [&](size_t b2, size_t e2) { pretokenize_and_bpe(im, normed.substr(b2, e2 - b2), sc, out); }, push_id);
      },
      push_id);
  if (add_special_tokens) out.insert(out.end(), im.suffix_ids.begin(), im.suffix_ids.end());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens, SpecialTokens special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 8);
  encode_into(text, add_special_tokens, special, out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& im = *impl_;
  std::string bytes;
  bool first = true;
  for (const int32_t id : ids) {
    if (!im.valid_id(id)) {
      throw std::invalid_argument("Tokenizer::decode: token id " + std::to_string(id) + " is not in the vocabulary (size " +
                                  std::to_string(im.vocab_size) + ")");
    }
    if (skip_special_tokens && (im.flags[id] & Impl::kSpecial)) continue;
    if (!im.decoder_byte_level && !first) bytes += ' ';  // no decoder: HF joins tokens with spaces
    bytes += im.token_bytes(id);
    first = false;
  }
  if (!im.decoder_byte_level) return bytes;
  std::string out;
  out.reserve(bytes.size());
  tokenizer_detail::utf8_lossy_append(bytes, /*final=*/true, out);
  return out;
}

int32_t Tokenizer::token_to_id(std::string_view token) const {
  const Impl& im = *impl_;
  if (const int32_t id = im.added_by_content.find(token); id >= 0) return id;
  if (find_invalid_utf8(token)) return -1;
  return im.model_token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (!impl_->valid_id(id)) return std::nullopt;
  return std::string(impl_->token_string(id));
}

bool Tokenizer::is_special(int32_t id) const { return impl_->valid_id(id) && (impl_->flags[id] & Impl::kSpecial); }

size_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

size_t Tokenizer::num_merges() const { return impl_->num_merges; }

// ------------------------------------------------------------------------------------------------
IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tok_(tokenizer), skip_special_(skip_special_tokens) {}

std::string IncrementalDecoder::push(int32_t id) {
  const Impl& im = *tok_.impl_;
  if (!im.valid_id(id)) {
    throw std::invalid_argument("IncrementalDecoder::push: token id " + std::to_string(id) +
                                " is not in the vocabulary (size " + std::to_string(im.vocab_size) + ")");
  }
  if (skip_special_ && (im.flags[id] & Impl::kSpecial)) return {};
  if (!im.decoder_byte_level && !first_) pending_ += ' ';
  pending_ += im.token_bytes(id);
  first_ = false;
  std::string out;
  const size_t used = tokenizer_detail::utf8_lossy_append(pending_, /*final=*/false, out);
  pending_.erase(0, used);
  return out;
}

std::string IncrementalDecoder::flush() {
  std::string out;
  tokenizer_detail::utf8_lossy_append(pending_, /*final=*/true, out);
  pending_.clear();
  first_ = true;
  return out;
}

}  // namespace hypic::engine
