// Router request validation and admission limits: codes and messages naming the field.
#include <catch2/catch.hpp>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "proto/rpc/status.h"
#include "router/admission.h"

using hypic::router::check_token_limits;
using hypic::router::fit_context;
using hypic::router::RequestOptions;
using hypic::router::RouterLimits;
using hypic::router::validate_request;
using hypic::rpc::RpcError;
namespace v1 = hypic::v1;

namespace {
constexpr int64_t kVocab = 1000;
v1::GenerateRequest good() {
  v1::GenerateRequest r;
  r.add_segments()->set_text("First document.");
  r.add_segments()->mutable_tokens()->add_ids(5);
  r.mutable_query()->set_text("Question?");
  return r;
}
// The code and message a bad request gets.
std::pair<grpc::StatusCode, std::string> error_of(const v1::GenerateRequest& r, const RouterLimits& l = {}) {
  try {
    validate_request(r, l, kVocab);
  } catch (const RpcError& e) {
    return {e.code(), e.what()};
  }
  return {grpc::StatusCode::OK, ""};
}
}  // namespace

TEST_CASE("a valid request gets the defaults", "[admission]") {
  RouterLimits l;
  l.default_seam_width = 6;
  l.default_max_tokens = 17;
  const auto o = validate_request(good(), l, kVocab);
  CHECK(o.mode == hypic::engine::SpliceMode::Hypic);
  CHECK(o.seam_width == 6);
  CHECK(o.entry_seam_width == 6);
  CHECK(o.max_tokens == 17);
  CHECK(o.cache_segments);
  CHECK(o.uses_entries);
  CHECK(o.top_p == 1.0f);
  CHECK_FALSE(o.seed.has_value());

  auto r = good();
  r.mutable_cache()->set_mode("transition");
  r.mutable_cache()->set_seam_width(4);
  r.mutable_cache()->set_cache_segments(false);
  r.mutable_sampling()->set_seed(9);
  auto o2 = validate_request(r, l, kVocab);
  CHECK(o2.entry_seam_width == 0);  // entries without seam outside hypic mode
  CHECK_FALSE(o2.cache_segments);
  CHECK(*o2.seed == 9);
  r.mutable_cache()->set_mode("full");
  CHECK_FALSE(validate_request(r, l, kVocab).uses_entries);
}

TEST_CASE("cache.refresh_segments: the router's default for hypic requests, checked against the limit and the mode",
          "[admission]") {
  RouterLimits l;
  l.default_refresh_segments = 2;
  l.max_refresh_segments = 5;
  CHECK(validate_request(good(), l, kVocab).refresh_segments == 2);  // hypic by default
  auto r = good();
  r.mutable_cache()->set_mode("transition");
  CHECK(validate_request(r, l, kVocab).refresh_segments == 0);  // the default applies to hypic only
  r = good();
  r.mutable_cache()->set_refresh_segments(5);
  CHECK(validate_request(r, l, kVocab).refresh_segments == 5);
  r.mutable_cache()->set_refresh_segments(0);
  CHECK(validate_request(r, l, kVocab).refresh_segments == 0);  // asked off
  r.mutable_cache()->set_refresh_segments(6);
  CHECK_THROWS_WITH(validate_request(r, l, kVocab),
                    Catch::Contains("cache.refresh_segments: must be in [0, 5] (--max-refresh-segments), got 6"));
  r.mutable_cache()->set_refresh_segments(-1);
  CHECK_THROWS_WITH(validate_request(r, l, kVocab), Catch::Contains("got -1"));
  r.mutable_cache()->set_refresh_segments(1);
  r.mutable_cache()->set_mode("prefix");
  CHECK_THROWS_WITH(validate_request(r, l, kVocab),
                    Catch::Contains("cache.refresh_segments: applies to mode hypic only, not prefix"));
  r.mutable_cache()->set_refresh_segments(0);
  CHECK(validate_request(r, l, kVocab).refresh_segments == 0);  // 0 is fine in any mode
}

TEST_CASE("cache.refresh_tail: the router's default for hypic requests, checked against the limit and the mode",
          "[admission]") {
  RouterLimits l;
  l.default_refresh_tail = 2;
  l.max_refresh_segments = 5;
  CHECK(validate_request(good(), l, kVocab).refresh_tail == 2);  // hypic by default
  CHECK(validate_request(good(), l, kVocab).refresh_segments == 0);  // independent of the refresh count
  auto r = good();
  r.mutable_cache()->set_mode("naive");
  CHECK(validate_request(r, l, kVocab).refresh_tail == 0);  // the default applies to hypic only
  r = good();
  r.mutable_cache()->set_refresh_tail(5);
  CHECK(validate_request(r, l, kVocab).refresh_tail == 5);
  r.mutable_cache()->set_refresh_tail(0);
  CHECK(validate_request(r, l, kVocab).refresh_tail == 0);  // asked off
  r.mutable_cache()->set_refresh_tail(6);
  CHECK_THROWS_WITH(validate_request(r, l, kVocab),
                    Catch::Contains("cache.refresh_tail: must be in [0, 5] (--max-refresh-segments), got 6"));
  r.mutable_cache()->set_refresh_tail(-3);
  CHECK_THROWS_WITH(validate_request(r, l, kVocab), Catch::Contains("got -3"));
  r.mutable_cache()->set_refresh_tail(1);
  r.mutable_cache()->set_mode("full");
  CHECK_THROWS_WITH(validate_request(r, l, kVocab),
                    Catch::Contains("cache.refresh_tail: applies to mode hypic only, not full"));
}

TEST_CASE("bad requests get INVALID_ARGUMENT naming the field", "[admission]") {
  using C = grpc::StatusCode;
  auto r = good();
  r.clear_segments();
  auto e = error_of(r);
  CHECK(e.first == C::INVALID_ARGUMENT);
  CHECK_THAT(e.second, Catch::StartsWith("segments:"));

  r = good();
  r.clear_query();
  e = error_of(r);
  CHECK(e.first == C::INVALID_ARGUMENT);
  CHECK_THAT(e.second, Catch::StartsWith("query"));
  r.mutable_query()->set_text("");
  CHECK_THAT(error_of(r).second, Catch::StartsWith("query.text: must not be empty"));

  r = good();
  r.mutable_segments(0)->set_text(std::string("ok \xC3\x28 bad", 9));
  e = error_of(r);
  CHECK(e.first == C::INVALID_ARGUMENT);
  CHECK(e.second == "segments[0].text: invalid UTF-8 at byte 3 (byte 0xc3)");

  r = good();
  r.mutable_segments(1)->mutable_tokens()->add_ids(kVocab);
  CHECK(error_of(r).second == "segments[1].tokens.ids[1]: 1000 is outside the vocabulary [0, 1000)");
  r = good();
  r.add_segments();
  CHECK(error_of(r).second == "segments[2]: neither text nor tokens is set");

  r = good();
  r.mutable_cache()->set_mode("magic");
  e = error_of(r);
  CHECK(e.first == C::INVALID_ARGUMENT);
  CHECK_THAT(e.second, Catch::StartsWith("cache.mode:") && Catch::Contains("magic"));

  r = good();
  r.mutable_cache()->set_seam_width(-1);
  CHECK_THAT(error_of(r).second, Catch::StartsWith("cache.seam_width:"));

  r = good();
  r.mutable_sampling()->set_max_tokens(-3);
  e = error_of(r);
  CHECK(e.first == C::INVALID_ARGUMENT);
  CHECK(e.second == "sampling.max_tokens: must be >= 1, got -3");

  r = good();
  r.mutable_sampling()->set_temperature(-1.0f);
  CHECK_THAT(error_of(r).second, Catch::StartsWith("sampling: temperature"));
  r = good();
  r.mutable_sampling()->set_top_p(0.0f);
  CHECK_THAT(error_of(r).second, Catch::StartsWith("sampling: top_p"));
  r = good();
  r.mutable_sampling()->add_stop("");
  CHECK(error_of(r).second == "sampling.stop[0]: must not be empty");
  // Stop strings and stop token ids: at most 64 of each, strings of at most 1024 bytes, ids in the vocabulary.
  r = good();
  for (int i = 0; i < 64; ++i) r.mutable_sampling()->add_stop(std::string(1024, 'a' + i % 26));
  for (int i = 0; i < 64; ++i) r.mutable_sampling()->add_stop_token_ids(int32_t(kVocab) - 1 - i);
  CHECK(error_of(r).first == C::OK);
  r.mutable_sampling()->add_stop("x");
  CHECK(error_of(r).second == "sampling.stop: at most 64 stop strings, got 65");
  r.mutable_sampling()->add_stop_token_ids(1);
  CHECK(error_of(r).second == "sampling.stop_token_ids: at most 64 stop token ids, got 65");
  r = good();
  r.mutable_sampling()->add_stop("ok");
  r.mutable_sampling()->add_stop(std::string(1025, 'z'));
  e = error_of(r);
  CHECK(e.first == C::INVALID_ARGUMENT);
  CHECK(e.second == "sampling.stop[1]: 1025 bytes, more than the 1024 a stop string may have");
  r = good();
  r.mutable_sampling()->add_stop_token_ids(3);
  r.mutable_sampling()->add_stop_token_ids(int32_t(kVocab));
  e = error_of(r);
  CHECK(e.first == C::INVALID_ARGUMENT);
  CHECK_THAT(e.second, Catch::StartsWith("sampling.stop_token_ids[1]: " + std::to_string(kVocab) +
                                         " is outside the vocabulary"));
  r = good();
  r.set_request_id("has space");
  CHECK_THAT(error_of(r).second, Catch::StartsWith("request_id:"));
}

TEST_CASE("admission limits get RESOURCE_EXHAUSTED naming the flag", "[admission]") {
  RouterLimits l;
  l.max_segments = 1;
  auto e = error_of(good(), l);
  CHECK(e.first == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(e.second == "segments: 2 segments exceed the limit of 1 (--max-segments)");

  l = RouterLimits{};
  l.max_new_tokens = 10;
  auto r = good();
  r.mutable_sampling()->set_max_tokens(11);
  e = error_of(r, l);
  CHECK(e.first == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK_THAT(e.second, Catch::Contains("--max-new-tokens"));

  l = RouterLimits{};
  l.max_segment_tokens = 100;
  l.max_prompt_tokens = 150;
  const std::vector<size_t> ok = {100, 40};
  CHECK_NOTHROW(check_token_limits(ok, 10, l));
  try {
    const std::vector<size_t> big = {10, 101};
    check_token_limits(big, 1, l);
    FAIL("no error");
  } catch (const RpcError& err) {
    CHECK(err.code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(std::string(err.what()) ==
          "segments[1]: 101 tokens exceed the limit of 100 per segment (--max-segment-tokens)");
  }
  try {
    check_token_limits(ok, 11, l);
    FAIL("no error");
  } catch (const RpcError& err) {
    CHECK(err.code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK_THAT(err.what(), Catch::StartsWith("prompt: 151 tokens"));
  }
}

TEST_CASE("the context limit: prompt + max_tokens at most --max-model-len, the default max_tokens fits what is left",
          "[admission]") {
  RouterLimits l;
  RequestOptions o;
  o.max_tokens = 4096;
  o.max_tokens_given = true;
  CHECK_NOTHROW(fit_context(1u << 30, o, l));  // 0: no limit
  l.max_model_len = 1000;
  o.max_tokens = 100;
  CHECK_NOTHROW(fit_context(900, o, l));  // exactly the context
  CHECK(o.max_tokens == 100);
  for (const auto& [prompt, max_tokens] : std::vector<std::pair<size_t, int>>{{900, 101}, {999, 2}}) {
    INFO(prompt << " + " << max_tokens);
    o.max_tokens = max_tokens;
    try {
      fit_context(prompt, o, l);
      FAIL("no error");
    } catch (const RpcError& err) {
      CHECK(err.code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
      CHECK_THAT(err.what(), Catch::StartsWith("prompt: " + std::to_string(prompt) + " tokens (segments + query) + "
                                               "max_tokens " + std::to_string(max_tokens) +
                                               " exceed the model's context of 1000 tokens (--max-model-len"));
      CHECK_THAT(err.what(), Catch::EndsWith("ask for at most " + std::to_string(1000 - prompt) + " tokens"));
    }
  }
  // A prompt that fills the context leaves no room, whatever max_tokens.
  for (bool given : {true, false}) {
    o.max_tokens = 1;
    o.max_tokens_given = given;
    try {
      fit_context(1000, o, l);
      FAIL("no error");
    } catch (const RpcError& err) {
      CHECK(err.code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
      CHECK_THAT(err.what(), Catch::StartsWith("prompt: 1000 tokens (segments + query) leave no room in the model's "
                                               "context of 1000 tokens (--max-model-len"));
    }
  }
  // The default (--default-max-tokens, not given by the request) is lowered to what is left, never refused.
  o.max_tokens_given = false;
  for (const auto& [prompt, def, want] : std::vector<std::tuple<size_t, int, int>>{{900, 128, 100}, {999, 128, 1},
                                                                                   {100, 128, 128}}) {
    o.max_tokens = def;
    CHECK_NOTHROW(fit_context(prompt, o, l));
    CHECK(o.max_tokens == want);
  }
  // validate_request says which it was.
  auto r = good();
  CHECK_FALSE(validate_request(r, RouterLimits{}, kVocab).max_tokens_given);
  r.mutable_sampling()->set_max_tokens(5);
  CHECK(validate_request(r, RouterLimits{}, kVocab).max_tokens_given);
}

TEST_CASE("token ids: out of the vocabulary is INVALID_ARGUMENT naming the segment, the index and the value",
          "[admission]") {
  // The router checks ids against the model's vocabulary (hypic-client refuses ids >= 2^31 itself: the wire is int32).
  auto r = good();
  r.mutable_segments(1)->mutable_tokens()->add_ids(-7);
  auto e = error_of(r);
  CHECK(e.first == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(e.second == "segments[1].tokens.ids[1]: -7 is outside the vocabulary [0, 1000)");
  r = good();
  r.mutable_query()->mutable_tokens()->add_ids(3);
  r.mutable_query()->mutable_tokens()->add_ids(2147483647);
  e = error_of(r);
  CHECK(e.first == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(e.second == "query.tokens.ids[1]: 2147483647 is outside the vocabulary [0, 1000)");
}

TEST_CASE("text size limits are checked before tokenisation (RESOURCE_EXHAUSTED naming segment, size, limit)",
          "[admission]") {
  RouterLimits l;
  CHECK(l.segment_bytes_limit() == 16u * 32768u);  // defaults: 16 bytes per token of the token limits
  CHECK(l.prompt_bytes_limit() == 16u * 262144u);
  l.max_segment_bytes = 20;
  l.max_prompt_bytes = 40;
  auto r = good();  // "First document." is 15 bytes
  CHECK_NOTHROW(validate_request(r, l, kVocab));
  r.mutable_segments(0)->set_text(std::string(21, 'a'));
  auto e = error_of(r, l);
  CHECK(e.first == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(e.second == "segments[0]: 21 bytes of text exceed the limit of 20 bytes per segment (--max-segment-bytes)");
  // Refused before the text is even looked at: invalid UTF-8 past the limit is not what is reported.
  r.mutable_segments(0)->set_text(std::string(25, '\xff'));
  CHECK(error_of(r, l).first == grpc::StatusCode::RESOURCE_EXHAUSTED);
  // The total over all segments and the query.
  r = good();
  r.mutable_segments(0)->set_text(std::string(20, 'a'));
  r.add_segments()->set_text(std::string(15, 'b'));
  r.mutable_query()->set_text(std::string(6, 'q'));
  e = error_of(r, l);
  CHECK(e.first == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(e.second == "query: the request's text reaches 41 bytes, over the limit of 40 bytes for all segments and "
                    "the query (--max-prompt-bytes)");
  r.mutable_query()->set_text(std::string(5, 'q'));
  CHECK_NOTHROW(validate_request(r, l, kVocab));
}

TEST_CASE("segment text: special-token strings are plain text unless the segment allows them", "[admission]") {
  using hypic::router::segment_token_ids;
  const auto tok = hypic::engine::Tokenizer::from_json_string(R"({"model": {"type": "BPE", "merges": [],
      "vocab": {"<": 0, "|": 1, "i": 2, "m": 3, "_": 4, "e": 5, "n": 6, "d": 7, ">": 8, "h": 9}},
      "added_tokens": [{"id": 10, "content": "<|im_end|>", "special": true}]})");
  v1::Segment seg;
  seg.set_text("hi<|im_end|>");
  CHECK(segment_token_ids(tok, seg, "segments[0]") == std::vector<int32_t>{9, 2, 0, 1, 2, 3, 4, 5, 6, 7, 1, 8});
  seg.set_allow_special_tokens(true);
  CHECK(segment_token_ids(tok, seg, "segments[0]") == std::vector<int32_t>{9, 2, 10});
  seg.set_text("hi?");  // '?' is in no vocabulary entry: the tokenizer's error, named
  try {
    segment_token_ids(tok, seg, "query");
    FAIL("no error");
  } catch (const RpcError& err) {
    CHECK(err.code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(err.what(), Catch::StartsWith("query.text: "));
  }
  v1::Segment ids;
  ids.mutable_tokens()->add_ids(10);  // token ids are taken as sent
  CHECK(segment_token_ids(tok, ids, "segments[1]") == std::vector<int32_t>{10});
}
