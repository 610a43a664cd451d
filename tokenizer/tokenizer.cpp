// Hugging Face tokenizer.json: loading, encoding and decoding (see tokenizer/tokenizer.h for the
// supported components and the exact semantics reproduced). Component references are to the Rust
// crate `tokenizers` 0.23 (files tokenizer/added_vocabulary.rs, tokenizer/normalizer.rs,
// pre_tokenizers/split.rs, pre_tokenizers/byte_level.rs, models/bpe/{model,word}.rs).
#include <cstdio>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "engine/io_error.h"
#include "tokenizer/tokenizer_impl.h"

namespace hypic::engine {
namespace tokenizer_detail {

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

}  // namespace
}  // namespace tokenizer_detail

using tokenizer_detail::Impl;

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::from_json_string(std::string_view json_text) {
  return Tokenizer(tokenizer_detail::load_impl(json_text));
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
