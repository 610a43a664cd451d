// Router request validation and admission limits: codes and messages naming the field.
#include <catch2/catch.hpp>

#include "proto/rpc/status.h"
#include "router/admission.h"

using hypic::router::check_token_limits;
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
