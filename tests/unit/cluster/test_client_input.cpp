// hypic-client's input parsing (client/input.h): --segments-json documents and token id lists. Every id is checked
// as an integer in [0, 2^31) and every error names the field, the index and the value as written (they used to be
// truncated: 2^40 became 0, 2^32+5 became 5, 1.7 became 1, 2^31 became -2147483648).
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "client/input.h"

using hypic::client::parse_token_id_list;
using hypic::client::segments_from_json_text;
using hypic::client::token_id_from_json;
namespace v1 = hypic::v1;
using nlohmann::json;

namespace {
/// The error message segments_from_json_text gives for `doc` ("" when it succeeds).
std::string error_of(const std::string& doc) {
  v1::GenerateRequest req;
  try {
    segments_from_json_text(doc, "req.json", &req);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("segments JSON: every form of segment, ids exact", "[client]") {
  std::filesystem::create_directories(std::string(HYPIC_BINARY_DIR) + "/test_scratch");  // a fresh build has none
  const std::string path = std::string(HYPIC_BINARY_DIR) + "/test_scratch/client_input_doc.txt";
  std::ofstream(path) << "file text";
  v1::GenerateRequest req;
  segments_from_json_text(R"({"segments": ["plain", {"text": "obj", "allow_special_tokens": true},
                                          {"tokens": [0, 5, 2147483647]}, {"file": ")" + path + R"("}],
                              "query": {"text": "q?"}})",
                          "req.json", &req);
  REQUIRE(req.segments_size() == 4);
  CHECK(req.segments(0).text() == "plain");
  CHECK_FALSE(req.segments(0).allow_special_tokens());
  CHECK(req.segments(1).text() == "obj");
  CHECK(req.segments(1).allow_special_tokens());
  CHECK(std::vector<int32_t>(req.segments(2).tokens().ids().begin(), req.segments(2).tokens().ids().end()) ==
        std::vector<int32_t>{0, 5, 2147483647});
  CHECK(req.segments(3).text() == "file text");
  CHECK(req.query().text() == "q?");
  std::remove(path.c_str());

  v1::GenerateRequest list;  // a bare array
  segments_from_json_text(R"(["a", "b"])", "req.json", &list);
  CHECK(list.segments_size() == 2);
  CHECK_FALSE(list.has_query());
}

TEST_CASE("segments JSON: ids that do not fit are refused naming segment, index and value", "[client]") {
  CHECK(error_of(R"([{"tokens": [1, 1099511627776]}])") ==
        "req.json: segments[0].tokens[1]: 1099511627776 is out of range: token ids are integers in [0, 2147483648)");
  CHECK(error_of(R"(["x", {"tokens": [4294967301]}])") ==
        "req.json: segments[1].tokens[0]: 4294967301 is out of range: token ids are integers in [0, 2147483648)");
  CHECK(error_of(R"([{"tokens": [1.7]}])") ==
        "req.json: segments[0].tokens[0]: 1.7 is not an integer: token ids are integers in [0, 2147483648)");
  CHECK(error_of(R"([{"tokens": [2147483648]}])") ==
        "req.json: segments[0].tokens[0]: 2147483648 is out of range: token ids are integers in [0, 2147483648)");
  CHECK(error_of(R"([{"tokens": [-1]}])") ==
        "req.json: segments[0].tokens[0]: -1 is out of range: token ids are integers in [0, 2147483648)");
  CHECK(error_of(R"([{"tokens": [3, "12"]}])") ==
        "req.json: segments[0].tokens[1]: \"12\" is a string, not an integer: token ids are integers in [0, 2147483648)");
  CHECK(error_of(R"({"segments": ["a"], "query": {"tokens": [true]}})") ==
        "req.json: query.tokens[0]: true is a boolean, not an integer: token ids are integers in [0, 2147483648)");
  CHECK(error_of(R"([{"tokens": [1e3]}])") ==
        "req.json: segments[0].tokens[0]: 1000.0 is not an integer: token ids are integers in [0, 2147483648)");
  CHECK(token_id_from_json(json(2147483647), "t") == 2147483647);
  CHECK(token_id_from_json(json(0), "t") == 0);
}

TEST_CASE("segments JSON: malformed documents name the field", "[client]") {
  CHECK_THAT(error_of("[1, "), Catch::StartsWith("req.json: not valid JSON: "));
  CHECK(error_of(R"({"segs": []})") == "req.json: unknown key 'segs' (expected segments and query)");
  CHECK(error_of(R"({"query": "q"})") == "req.json: the object has no 'segments'");
  CHECK(error_of("5") ==
        "req.json: expected an array of segments or {\"segments\": [...], \"query\": ...}, got an integer");
  CHECK(error_of(R"([{"text": 5}])") == "req.json: segments[0].text: expected a string, got 5");
  CHECK(error_of(R"([{"txt": "a"}])") ==
        "req.json: segments[0].txt: unknown key (expected text, tokens or file, and optionally allow_special_tokens)");
  CHECK(error_of(R"([{"text": "a", "tokens": [1]}])") ==
        "req.json: segments[0]: expected exactly one of text, tokens or file, got 2");
  CHECK(error_of(R"([{"allow_special_tokens": true}])") ==
        "req.json: segments[0]: expected exactly one of text, tokens or file, got 0");
  CHECK(error_of(R"([{"text": "a", "allow_special_tokens": 1}])") ==
        "req.json: segments[0].allow_special_tokens: expected true or false, got 1");
  CHECK(error_of(R"([{"tokens": 7}])") == "req.json: segments[0].tokens: expected an array of token ids");
  CHECK(error_of("[[1]]") == "req.json: segments[0]: expected a string or an object with text, tokens or file, got an array");
  CHECK(error_of(R"([{"file": "/nonexistent/x"}])") ==
        "req.json: segments[0].file: cannot read /nonexistent/x: No such file or directory");
}

// "cannot read FILE" used to give no reason, and a directory read as an empty segment.
TEST_CASE("read_file names why a file cannot be read", "[client]") {
  using hypic::client::read_file;
  const std::string dir = std::string(HYPIC_BINARY_DIR) + "/test_scratch";
  CHECK_THROWS_WITH(read_file("/nonexistent/x"), "cannot read /nonexistent/x: No such file or directory");
  CHECK_THROWS_WITH(read_file(dir), "cannot read " + dir + ": Is a directory");
  const std::string locked = dir + "/client_input_unreadable.txt";
  std::ofstream(locked) << "secret";
  std::filesystem::permissions(locked, std::filesystem::perms::none);
  if (std::ifstream(locked)) {
    WARN("running as root: a file without read permission is still readable, not checked");
  } else {
    CHECK_THROWS_WITH(read_file(locked), "cannot read " + locked + ": Permission denied");
  }
  std::filesystem::permissions(locked, std::filesystem::perms::owner_all);
  CHECK(read_file(locked) == "secret");
  const std::string empty = dir + "/client_input_empty.txt";
  std::ofstream(empty).flush();
  CHECK(read_file(empty).empty());  // an empty file is not an error
  std::filesystem::remove(locked);
  std::filesystem::remove(empty);
}

TEST_CASE("token id lists (--token-ids): digits only, in range, named by position", "[client]") {
  CHECK(parse_token_id_list("1, 2,3 ,, 2147483647", "--token-ids") == std::vector<int32_t>{1, 2, 3, 2147483647});
  CHECK(parse_token_id_list("", "--token-ids").empty());
  CHECK_THROWS_WITH(parse_token_id_list("1,5abc", "--token-ids"),
                    "--token-ids[1]: \"5abc\" is not an integer: token ids are integers in [0, 2147483648)");
  CHECK_THROWS_WITH(parse_token_id_list("1.7", "--token-ids"),
                    "--token-ids[0]: \"1.7\" is not an integer: token ids are integers in [0, 2147483648)");
  CHECK_THROWS_WITH(parse_token_id_list("-1", "--token-ids"), Catch::StartsWith("--token-ids[0]: \"-1\" is not an integer"));
  CHECK_THROWS_WITH(parse_token_id_list("2147483648", "--token-ids"),
                    "--token-ids[0]: 2147483648 is out of range: token ids are integers in [0, 2147483648)");
  CHECK_THROWS_WITH(parse_token_id_list("99999999999999999999999", "--token-ids"),
                    Catch::StartsWith("--token-ids[0]: 99999999999999999999999 is out of range"));
}

TEST_CASE("client flag values: finite seconds, whole integers, ports in range", "[client_input][flags]") {
  using namespace hypic::client;
  CHECK(parse_seconds("2.5", "--timeout-seconds", true) == 2.5);
  CHECK(parse_seconds("0", "--timeout-seconds", true) == 0);
  for (const char* bad : {"nan", "NaN", "-1", "-inf", "inf", "1e308", "", " 1", "1s", "0x10"}) {
    CHECK_THROWS_WITH(parse_seconds(bad, "--timeout-seconds", true), Catch::StartsWith("--timeout-seconds: "));
  }
  CHECK_THROWS(parse_seconds("0", "--x", false));
  CHECK(parse_uint64("18446744073709551615", "--seed") == UINT64_MAX);
  CHECK(parse_uint64("+1", "--seed") == 1u);
  CHECK(parse_uint64("010", "--seed") == 10u);  // decimal, as every integer flag (proto/rpc/flags.h)
  for (const char* bad : {"18446744073709551616", "-1", "1.0", "1e3", "", " 1", "0x10"}) {
    CHECK_THROWS_WITH(parse_uint64(bad, "--seed"), Catch::StartsWith("--seed: "));
  }
  CHECK_THROWS_WITH(parse_uint64("18446744073709551616", "--seed"), Catch::Contains("overflows"));
  CHECK(parse_integer("-3", "--n", -5, 5) == -3);
  CHECK_THROWS_WITH(parse_integer("-1", "--count", 0, 5), "--count: -1 is not an integer in [0, 5]");
  CHECK_THROWS_WITH(parse_integer("99999999999999999999", "--n", 0, 10), Catch::Contains("overflow"));
  CHECK(check_address("127.0.0.1:65535", "--router") == "127.0.0.1:65535");
  CHECK(check_address("[::1]:80", "--router") == "[::1]:80");
  CHECK(check_address("hypic-router.hypic.svc:50050", "--router") == "hypic-router.hypic.svc:50050");
  for (const char* bad : {"127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1", "::1:80", "host:", ":80", "h:+80", "h:8 0"}) {
    CHECK_THROWS_WITH(check_address(bad, "--router"), Catch::StartsWith("--router: "));
  }
}

TEST_CASE("input files are capped before they are read to the end", "[client_input][flags]") {
  using namespace hypic::client;
  CHECK_THROWS_WITH(read_file("/dev/zero", 1 << 20), Catch::Contains("more than the 1048576 bytes"));
  const auto path = std::filesystem::temp_directory_path() / "hypic-test-client-input-big";
  { std::ofstream(path) << std::string(2000, 'a'); }
  CHECK_THROWS_WITH(read_file(path.string(), 1000), Catch::Contains("2000 bytes, more than the 1000"));
  CHECK(read_file(path.string(), 2000).size() == 2000);
  std::filesystem::remove(path);
}
