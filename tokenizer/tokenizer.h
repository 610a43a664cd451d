// Hugging Face `tokenizer.json` reader and byte-level BPE tokenizer (Qwen3, Llama-3, GPT-2 style).
//
// Reproduces the ids of Hugging Face `tokenizers` (0.23, Rust crate `tokenizers`, class
// `TokenizerImpl`) for the component kinds listed below; any other kind is rejected by load() with a
// std::invalid_argument naming the JSON field and the type found. The pipeline is HF's:
//   1. added tokens with normalized=false are matched in the raw text (leftmost-longest, honouring
//      special / lstrip / rstrip / single_word; HF `AddedVocabulary::extract_and_normalize`). With
//      SpecialTokens::Split a match of a special=true token is skipped (HF `encode_special_tokens`,
//      transformers' `split_special_tokens=True`): the search goes on after it, so its text stays in the
//      surrounding piece and goes through steps 2-5 as ordinary text; non-special added tokens are still
//      matched (same in step 3);
//   2. the remaining pieces are normalised (NFC/NFD/NFKC/NFKD through utf8proc, or a Sequence);
//   3. added tokens with normalized=true are matched in the normalised pieces;
//   4. pre-tokenisation: `Split` (PCRE2 with UTF+UCP+JIT; behaviours Removed, Isolated,
//      MergedWithPrevious, MergedWithNext, Contiguous; `invert`), `ByteLevel` (add_prefix_space,
//      use_regex with the GPT-2 pattern; it must be the last step), or a Sequence of these;
//   5. BPE with merge ranks (merges as "a b" strings or [a, b] pairs), ignore_merges,
//      continuing_subword_prefix / end_of_word_suffix (not with ByteLevel), unk_token + fuse_unk,
//      byte_fallback; dropout must be null or 0;
//   6. add_special_tokens: post_processor ByteLevel (no ids), TemplateProcessing (single
//      template), BertProcessing, RobertaProcessing, or a Sequence of these.
// Decoding: decoder ByteLevel (or a Sequence holding only ByteLevel; bytes are turned into text
// with U+FFFD for invalid sequences, like Rust's String::from_utf8_lossy) or null (tokens joined
// by one space, HF's behaviour without a decoder). `truncation` and `padding` must be null.
//
// Regex dialect: HF compiles the Split pattern with Oniguruma. PCRE2 differs in `\s`/`\S` (PCRE2
// also counts U+180E as space), so those escapes are rewritten to \p{White_Space}/\P{White_Space}
// (Oniguruma's Unicode `\s` is the White_Space property). Unicode tables are those of the
// installed PCRE2 and utf8proc (Unicode 14/15); characters assigned later may split differently.
//
// Invalid UTF-8 input: encode() throws std::invalid_argument naming the byte offset and the byte
// (HF's Python API cannot receive invalid UTF-8 at all, so there is no behaviour to match).
// Departures from HF, all raising instead of silently losing data: a character with no vocab
// entry, no byte fallback and no unk_token throws (HF drops it); decode() of an id that is not in
// the vocabulary throws (HF skips it).
//
// Thread safety: a Tokenizer is immutable after load and cheap to copy (shared state); encode()
// and decode() may run concurrently from any number of threads. Each thread keeps its own bounded
// cache of BPE results per pre-token word (like HF's thread-local BPE cache).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hypic::engine {

namespace tokenizer_detail {
struct Impl;
}

/// What encode() does with the text of special added tokens (special=true in tokenizer.json, e.g.
/// "<|im_end|>", "<|endoftext|>") found in the input.
enum class SpecialTokens {
  /// Recognised as their ids (HF's default). For text you built yourself, e.g. a chat template.
  Match,
  /// Tokenised as ordinary text, split into ordinary tokens (HF `encode_special_tokens=true`,
  /// transformers `split_special_tokens=True`): for untrusted text, which must not forge control tokens.
  /// Non-special added tokens (Qwen3: "<think>", "<tool_call>") are still matched, as in HF.
  Split,
};

class Tokenizer {
 public:
  /// Reads and validates a Hugging Face tokenizer.json. Throws std::runtime_error if the file
  /// cannot be read or is not JSON, std::invalid_argument for unsupported or inconsistent content
  /// (the message names the field, e.g. "pre_tokenizer.pretokenizers[0].type: unsupported 'Digits'").
  static Tokenizer load(const std::filesystem::path& tokenizer_json);
  /// Same as load() from the JSON text itself (tests build small tokenizers this way).
  static Tokenizer from_json_string(std::string_view json_text);

  /// Token ids for `text` (UTF-8). add_special_tokens applies the post_processor template (e.g.
  /// a BOS id); for Qwen3 (ByteLevel post-processor) it changes nothing. `special` says whether
  /// special-token strings in the text are recognised (Match, HF's default) or tokenised as plain
  /// text (Split); the post-processor's own ids are added either way.
  /// Throws std::invalid_argument on invalid UTF-8 ("invalid UTF-8 at byte offset N (byte 0xXX)")
  /// and on characters that cannot be tokenised (see the file comment).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens,
                              SpecialTokens special = SpecialTokens::Match) const;
  /// Appends the ids of `text` to `out` (no reallocation of `out` beyond its growth); same rules.
  void encode_into(std::string_view text, bool add_special_tokens, std::vector<int32_t>& out) const;
  /// Same, with the special-token mode.
  void encode_into(std::string_view text, bool add_special_tokens, SpecialTokens special,
                   std::vector<int32_t>& out) const;

  /// Text of `ids` (HF `Tokenizer.decode`). skip_special_tokens drops ids of special added tokens.
  /// Invalid UTF-8 produced by byte tokens becomes U+FFFD. Throws std::invalid_argument for an id
  /// outside the vocabulary.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  /// Id of a token string as written in tokenizer.json (added tokens first, then the BPE vocab,
  /// e.g. "Ġthe" or "<|im_end|>"); -1 when absent.
  int32_t token_to_id(std::string_view token) const;
  /// Token string of an id as written in tokenizer.json; std::nullopt when the id is unknown.
  std::optional<std::string> id_to_token(int32_t id) const;
  /// True for added tokens marked "special" (e.g. <|im_start|>); false for others and unknown ids.
  bool is_special(int32_t id) const;
  /// One past the largest id (BPE vocab and added tokens): every valid id is < vocab_size().
  /// Qwen3: 151669 (the model's embedding table is larger, 151936, padded).
  size_t vocab_size() const;
  /// Number of merge rules of the BPE model.
  size_t num_merges() const;

 private:
  explicit Tokenizer(std::shared_ptr<const tokenizer_detail::Impl> impl);
  std::shared_ptr<const tokenizer_detail::Impl> impl_;
  friend class IncrementalDecoder;
};

/// Streaming detokeniser for generated tokens: push() returns only complete UTF-8 text, holding back
/// the bytes of a character split across byte-level tokens (e.g. an emoji spread over 4 tokens)
/// until it is complete. A sequence that can no longer become valid is emitted as U+FFFD exactly
/// as decode() would, so the concatenation of every push() plus flush() equals
/// decode(all ids, skip_special_tokens). Holds a copy of the Tokenizer (shared state).
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  /// Adds one id; returns the newly completed text (possibly empty). Throws std::invalid_argument
  /// for an unknown id (the decoder's state is unchanged then).
  std::string push(int32_t id);
  /// Returns whatever is held back (incomplete bytes become U+FFFD) and resets the decoder.
  std::string flush();
  /// Bytes currently held back waiting for the rest of a UTF-8 sequence (0..3).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  Tokenizer tok_;
  bool skip_special_;
  bool first_ = true;
  std::string pending_;
};

/// Byte offset of the first byte that makes `s` invalid UTF-8 (overlong forms, surrogates, code
/// points above U+10FFFF and truncated sequences are invalid), or std::nullopt if `s` is valid.
std::optional<size_t> find_invalid_utf8(std::string_view s);

/// `bytes` as valid UTF-8 text: each maximal invalid subsequence becomes one U+FFFD (the Unicode
/// "substitution of maximal subparts" practice, as Rust's String::from_utf8_lossy).
std::string utf8_lossy(std::string_view bytes);

/// Unicode normalisation through utf8proc. `form` is "NFC", "NFD", "NFKC" or "NFKD"; throws
/// std::invalid_argument for another name or invalid UTF-8. NFC takes a fast path that leaves
/// runs of characters that cannot change under NFC untouched.
std::string unicode_normalize(std::string_view text, std::string_view form);

}  // namespace hypic::engine
