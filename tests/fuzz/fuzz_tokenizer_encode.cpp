// libFuzzer target: the tokenizer's encoder and decoder (tokenizer/tokenizer.h, Tokenizer::encode / decode).
//
// Feeds: the first input byte picks a tokenizer (the real Qwen3 tokenizer.json, its "added_token_flags" and
// "split_behaviors" golden variants, the two hand-made fixtures tiny_subword / tiny_byte_fallback); the remaining
// bytes are the text.
// Asserts, beyond "no crash, no leak, no UB, no hang":
//  - invalid UTF-8 is refused with std::invalid_argument (exactly when find_invalid_utf8 finds it); valid text is
//    refused only by a tokenizer with neither byte fallback nor unk token;
//  - every id is < vocab_size() and has a token string; encode_into appends the same ids as encode;
//  - Qwen3 family: with SpecialTokens::Split no special id is produced; plain Qwen3 (NFC normaliser, byte-level,
//    nothing removed) decodes its ids back to NFC(text) in both modes (round trip), and a text without '<' (no
//    special-token string) gets the same ids in both modes.
// Seeds (scripts/fuzz.sh): the golden corpus texts and fuzz strings of tests/fixtures/tokenizer, each prefixed with
// every selector byte.
#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_common.h"

using hypic::engine::SpecialTokens;
using hypic::engine::Tokenizer;

namespace {
struct Entry {
  std::string name;
  Tokenizer tok;
  bool qwen3_family;  ///< special tokens that BPE can never produce
  bool nfc_roundtrip; ///< decode(encode(x)) == NFC(x)
};
std::vector<Entry>* g_toks = nullptr;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_toks = new std::vector<Entry>;
  const auto fixtures = hypic::fuzz::source_dir() / "tests/fixtures/tokenizer";
  const char* qwen = std::getenv("HYPIC_FUZZ_QWEN3");
  if (qwen && *qwen) {
    const std::string text = hypic::fuzz::read_file(qwen);
    g_toks->push_back({"qwen3", Tokenizer::from_json_string(text), true, true});
    const auto variants = nlohmann::json::parse(hypic::fuzz::read_file(fixtures / "variants.json"));
    for (const char* v : {"added_token_flags", "split_behaviors"}) {
      auto j = nlohmann::json::parse(text);
      j.merge_patch(variants.at(v));
      g_toks->push_back({v, Tokenizer::from_json_string(j.dump()), true, false});
    }
  } else {
    std::fprintf(stderr, "fuzz_tokenizer_encode: HYPIC_FUZZ_QWEN3 is not set; fuzzing the hand-made tokenizers only\n");
  }
  for (const char* f : {"tiny_subword.json", "tiny_byte_fallback.json"})
    g_toks->push_back({f, Tokenizer::load(fixtures / f), false, false});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Entry& e = (*g_toks)[data[0] % g_toks->size()];
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const bool valid = !hypic::engine::find_invalid_utf8(text).has_value();
  std::vector<int32_t> ids[2];
  const SpecialTokens modes[2] = {SpecialTokens::Match, SpecialTokens::Split};
  for (int m = 0; m < 2; ++m) {
    try {
      ids[m] = e.tok.encode(text, false, modes[m]);
    } catch (const std::invalid_argument& ex) {
      FUZZ_CHECK(!valid || std::string(ex.what()).find("has no vocab entry") != std::string::npos,
                 e.name + ": valid text refused: " + ex.what());
      return 0;
    }
    FUZZ_CHECK(valid, e.name + ": invalid UTF-8 accepted");
    for (const int32_t id : ids[m]) {
      FUZZ_CHECK(id >= 0 && size_t(id) < e.tok.vocab_size() && e.tok.id_to_token(id), e.name + ": bad id");
      if (m == 1 && e.qwen3_family) FUZZ_CHECK(!e.tok.is_special(id), e.name + ": special id in split mode");
    }
    std::vector<int32_t> appended = {7};
    e.tok.encode_into(text, false, modes[m], appended);
    FUZZ_CHECK(appended.size() == ids[m].size() + 1 && std::equal(ids[m].begin(), ids[m].end(), appended.begin() + 1),
               e.name + ": encode_into differs from encode");
    const std::string back = e.tok.decode(ids[m]);
    if (e.nfc_roundtrip)
      FUZZ_CHECK(back == hypic::engine::unicode_normalize(text, "NFC"), e.name + ": decode(encode(x)) != NFC(x)");
  }
  if (e.name == "qwen3" && text.find('<') == std::string_view::npos)
    FUZZ_CHECK(ids[0] == ids[1], "qwen3: modes differ on a text without special-token strings");
  return 0;
}
