// libFuzzer target: the tokenizer.json loader (tokenizer/tokenizer.h, Tokenizer::from_json_string).
//
// Feeds: the input bytes as tokenizer.json text.
// Asserts, beyond "no crash, no leak, no UB, no hang":
//  - loading fails only with std::invalid_argument (unsupported or inconsistent content, the field named) or
//    std::runtime_error (not JSON);
//  - a loaded tokenizer encodes a fixed set of texts (with and without add_special_tokens, special tokens matched
//    and split) to ids that are all < vocab_size() and have a token string, or refuses a text with
//    std::invalid_argument; it decodes the ids it produced; token_to_id(id_to_token(id)) is a valid id.
// Seeds (scripts/fuzz.sh): tests/fixtures/tokenizer/tiny_*.json and the Qwen3 tokenizer.json and its five golden
// variants (tests/fixtures/tokenizer/variants.json) with the vocabulary cut to the byte tokens and the first
// merges.
#include "tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_common.h"

using hypic::engine::SpecialTokens;
using hypic::engine::Tokenizer;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::optional<Tokenizer> tok;
  try {
    tok.emplace(Tokenizer::from_json_string(std::string_view(reinterpret_cast<const char*>(data), size)));
  } catch (const std::invalid_argument&) {
    return 0;
  } catch (const std::runtime_error&) {
    return 0;
  }
  static const char* const kTexts[] = {"", "a", "Hello, world! 123", "  x\n\ny\t ", "<|im_end|> <s>[CLS]",
                                       "caf\xC3\xA9 \xE2\x80\x94 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80"};
  for (const char* text : kTexts) {
    for (const bool add : {false, true}) {
      for (const SpecialTokens sp : {SpecialTokens::Match, SpecialTokens::Split}) {
        std::vector<int32_t> ids;
        try {
          ids = tok->encode(text, add, sp);
        } catch (const std::invalid_argument&) {
          continue;
        }
        for (const int32_t id : ids) {
          FUZZ_CHECK(id >= 0 && size_t(id) < tok->vocab_size(), "id " + std::to_string(id) + " out of range");
          const auto s = tok->id_to_token(id);
          FUZZ_CHECK(s.has_value(), "id " + std::to_string(id) + " has no token string");
          FUZZ_CHECK(tok->token_to_id(*s) >= 0, "token string of id " + std::to_string(id) + " not found back");
        }
        (void)tok->decode(ids, false);
        (void)tok->decode(ids, true);
      }
    }
  }
  return 0;
}
