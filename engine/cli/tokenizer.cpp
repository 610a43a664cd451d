// hypic-tokenizer: encode UTF-8 text to token ids and decode ids to text with a Hugging Face
// tokenizer.json (tokenizer/tokenizer.h).
//
//   hypic-tokenizer encode --tokenizer FILE [--special] [--split-special-tokens]
//                                                            stdin: UTF-8 text  -> stdout: JSON array of ids
//   hypic-tokenizer decode --tokenizer FILE [--skip-special] stdin: JSON array  -> stdout: text
//
// The whole of stdin is one input (no newline is stripped). Errors (unreadable tokenizer, invalid
// UTF-8, bad JSON, unknown ids) go to stderr with exit status 1.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace {

std::string read_stdin() {
  std::ios::sync_with_stdio(false);
  std::string s((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  if (std::cin.bad()) throw std::runtime_error(std::string("cannot read stdin: ") + std::strerror(errno));
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Encode / decode text with a Hugging Face tokenizer.json"};
  app.require_subcommand(1);
  std::string tokenizer_path;
  bool special = false, skip_special = false, split_special = false;

  auto* enc = app.add_subcommand("encode", "read UTF-8 text on stdin, print its token ids as a JSON array");
  enc->add_option("--tokenizer", tokenizer_path, "path to tokenizer.json")->required()->check(CLI::ExistingFile);
  enc->add_flag("--special", special, "add the post-processor's special tokens (add_special_tokens=true)");
  enc->add_flag("--split-special-tokens", split_special,
                "tokenise special-token strings in the text as plain text, as the router does for untrusted text "
                "(HF split_special_tokens=True)");

  auto* dec = app.add_subcommand("decode", "read a JSON array of token ids on stdin, print the text");
  dec->add_option("--tokenizer", tokenizer_path, "path to tokenizer.json")->required()->check(CLI::ExistingFile);
  dec->add_flag("--skip-special", skip_special, "drop special tokens (skip_special_tokens=true)");

  CLI11_PARSE(app, argc, argv);
  try {
    const auto tok = hypic::engine::Tokenizer::load(tokenizer_path);
    const std::string input = read_stdin();
    if (enc->parsed()) {
      const std::vector<int32_t> ids = tok.encode(
          input, special, split_special ? hypic::engine::SpecialTokens::Split : hypic::engine::SpecialTokens::Match);
      std::cout << nlohmann::json(ids).dump() << "\n";
    } else {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(input);
      } catch (const nlohmann::json::parse_error& e) {
        throw std::invalid_argument(std::string("stdin is not JSON: ") + e.what());
      }
      if (!j.is_array()) throw std::invalid_argument("stdin must be a JSON array of token ids");
      std::vector<int32_t> ids;
      ids.reserve(j.size());
      for (size_t i = 0; i < j.size(); ++i) {
        // Checked, not truncated: get<int32_t>() of 2^40 would be 0, another token.
        if (!j[i].is_number_integer() || j[i].get<int64_t>() < INT32_MIN || j[i].get<int64_t>() > INT32_MAX ||
            (j[i].is_number_unsigned() && j[i].get<uint64_t>() > uint64_t(INT32_MAX))) {
          throw std::invalid_argument("element " + std::to_string(i) + " of the array is not a 32-bit integer: " +
                                      j[i].dump());
        }
        ids.push_back(j[i].get<int32_t>());
      }
      std::cout << tok.decode(ids, skip_special);
    }
    std::cout.flush();
    return std::cout ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "hypic-tokenizer: " << e.what() << "\n";
    return 1;
  }
}
