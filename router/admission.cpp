#include "router/admission.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "engine/sampling.h"
#include "tokenizer/tokenizer.h"
#include "proto/engine_rpc/checks.h"
#include "proto/rpc/status.h"

namespace hypic::router {

namespace v1 = hypic::v1;
using rpc::invalid_argument;
using rpc::resource_exhausted;

namespace {
/// Checks one segment (or the query) and adds its text bytes to `text_bytes`; max_bytes = 0: no per-segment limit.
void check_segment(const v1::Segment& seg, const std::string& field, int64_t vocab_size, uint64_t max_bytes,
                   uint64_t& text_bytes) {
  switch (seg.content_case()) {
    case v1::Segment::kText: {
      if (seg.text().empty()) throw invalid_argument(field + ".text", "must not be empty");
      if (max_bytes && seg.text().size() > max_bytes) {
        throw resource_exhausted(fmt::format("{}: {} bytes of text exceed the limit of {} bytes per segment "
                                             "(--max-segment-bytes)",
                                             field, seg.text().size(), max_bytes));
      }
      text_bytes += seg.text().size();
      if (auto bad = engine::find_invalid_utf8(seg.text())) {
        throw invalid_argument(field + ".text", fmt::format("invalid UTF-8 at byte {} (byte 0x{:02x})", *bad,
                                                            static_cast<unsigned char>(seg.text()[*bad])));
      }
      break;
    }
    case v1::Segment::kTokens: {
      const auto& ids = seg.tokens().ids();
      rpc::check_token_ids(std::span<const int32_t>(ids.data(), size_t(ids.size())), vocab_size,
                           field + ".tokens.ids");
      break;
    }
    default:
      throw invalid_argument(field, "neither text nor tokens is set");
  }
}

// A refresh count of the cache options (refresh_segments, refresh_tail): the value asked for, checked against
// [0, max] and the mode (hypic only, 0 anywhere), else the server default for hypic requests and 0 for the others.
int refresh_option(bool has, int32_t value, const char* field, int default_value, int max, engine::SpliceMode mode) {
  if (!has) return mode == engine::SpliceMode::Hypic ? default_value : 0;
  if (value < 0 || value > max)
    throw invalid_argument(field, fmt::format("must be in [0, {}] (--max-refresh-segments), got {}", max, value));
  if (value > 0 && mode != engine::SpliceMode::Hypic)
    throw invalid_argument(field, fmt::format("applies to mode hypic only, not {}", engine::splice_mode_name(mode)));
  return value;
}
}  // namespace

RequestOptions validate_request(const v1::GenerateRequest& req, const RouterLimits& limits, int64_t vocab_size) {
  rpc::validate_request_id(req.request_id());
  if (req.segments().empty()) throw invalid_argument("segments", "at least one segment is required");
  if (uint32_t(req.segments_size()) > limits.max_segments) {
    throw resource_exhausted(fmt::format("segments: {} segments exceed the limit of {} (--max-segments)",
                                         req.segments_size(), limits.max_segments));
  }
  // Sizes first, before anything reads the text (tokenising 10 MB takes about 0.5 s).
  uint64_t text_bytes = 0;
  const uint64_t max_prompt_bytes = limits.prompt_bytes_limit();
  const auto check_total = [&](const std::string& field) {
    if (text_bytes > max_prompt_bytes) {
      throw resource_exhausted(fmt::format("{}: the request's text reaches {} bytes, over the limit of {} bytes for "
                                           "all segments and the query (--max-prompt-bytes)",
                                           field, text_bytes, max_prompt_bytes));
    }
  };
  for (int i = 0; i < req.segments_size(); ++i) {
    const std::string field = fmt::format("segments[{}]", i);
    check_segment(req.segments(i), field, vocab_size, limits.segment_bytes_limit(), text_bytes);
    check_total(field);
  }
  if (!req.has_query() || req.query().content_case() == v1::Segment::CONTENT_NOT_SET) {
    throw invalid_argument("query", "must not be empty");
  }
  check_segment(req.query(), "query", vocab_size, 0, text_bytes);
  check_total("query");

  RequestOptions o;
  const auto& c = req.cache();
  try {
    o.mode = engine::parse_splice_mode(c.mode().empty() ? "hypic" : c.mode());
  } catch (const std::invalid_argument&) {  // its message echoes the text whole: name it escaped and cut instead
    throw invalid_argument("cache.mode", fmt::format("unknown splice mode {} (expected full, prefix, naive, "
                                                     "transition or hypic)", rpc::untrusted(c.mode())));
  }
  o.seam_width = c.has_seam_width() ? c.seam_width() : limits.default_seam_width;
  if (o.seam_width < 0 || o.seam_width > limits.max_seam_width) {
    throw invalid_argument("cache.seam_width", fmt::format("must be in [0, {}] (--max-seam-width), got {}",
                                                           limits.max_seam_width, o.seam_width));
  }
  o.entry_seam_width = o.mode == engine::SpliceMode::Hypic ? o.seam_width : 0;
  o.refresh_segments = refresh_option(c.has_refresh_segments(), c.refresh_segments(), "cache.refresh_segments",
                                      limits.default_refresh_segments, limits.max_refresh_segments, o.mode);
  o.refresh_tail = refresh_option(c.has_refresh_tail(), c.refresh_tail(), "cache.refresh_tail",
                                  limits.default_refresh_tail, limits.max_refresh_segments, o.mode);
  o.uses_entries = o.mode != engine::SpliceMode::Full && o.mode != engine::SpliceMode::Prefix;
  o.cache_segments = c.has_cache_segments() ? c.cache_segments() : true;

  const auto& s = req.sampling();
  o.max_tokens = s.has_max_tokens() ? s.max_tokens() : limits.default_max_tokens;
  o.max_tokens_given = s.has_max_tokens();
  if (o.max_tokens < 1) throw invalid_argument("sampling.max_tokens", fmt::format("must be >= 1, got {}", o.max_tokens));
  if (uint32_t(o.max_tokens) > limits.max_new_tokens) {
    throw resource_exhausted(fmt::format("sampling.max_tokens: {} exceeds the limit of {} (--max-new-tokens)",
                                         o.max_tokens, limits.max_new_tokens));
  }
  o.temperature = s.temperature();
  o.top_k = s.top_k();
  o.top_p = s.has_top_p() ? s.top_p() : 1.0f;
  if (s.has_seed()) o.seed = s.seed();
  if (s.stop_token_ids_size() > kMaxStops)
    throw invalid_argument("sampling.stop_token_ids",
                           fmt::format("at most {} stop token ids, got {}", kMaxStops, s.stop_token_ids_size()));
  if (s.stop_size() > kMaxStops)
    throw invalid_argument("sampling.stop", fmt::format("at most {} stop strings, got {}", kMaxStops, s.stop_size()));
  o.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  if (!o.stop_token_ids.empty())
    rpc::check_token_ids(std::span<const int32_t>(o.stop_token_ids.data(), o.stop_token_ids.size()), vocab_size,
                         "sampling.stop_token_ids");
  try {
    engine::SamplingConfig{o.temperature, o.top_k, o.top_p, 0, o.stop_token_ids}.validate();
  } catch (const std::invalid_argument& e) {
    throw invalid_argument("sampling", e.what());
  }
  for (int i = 0; i < s.stop_size(); ++i) {
    const std::string field = fmt::format("sampling.stop[{}]", i);
    if (s.stop(i).empty()) throw invalid_argument(field, "must not be empty");
    if (s.stop(i).size() > kMaxStopBytes)
      throw invalid_argument(field, fmt::format("{} bytes, more than the {} a stop string may have", s.stop(i).size(),
                                                kMaxStopBytes));
    if (auto bad = engine::find_invalid_utf8(s.stop(i))) {
      throw invalid_argument(field, fmt::format("invalid UTF-8 at byte {}", *bad));
    }
    o.stop.push_back(s.stop(i));
  }
  o.ignore_eos = s.ignore_eos();
  return o;
}

std::vector<int32_t> segment_token_ids(const engine::Tokenizer& tokenizer, const v1::Segment& seg,
                                       const std::string& field) {
  if (seg.content_case() == v1::Segment::kTokens) return {seg.tokens().ids().begin(), seg.tokens().ids().end()};
  try {
    return tokenizer.encode(seg.text(), /*add_special_tokens=*/false,
                            seg.allow_special_tokens() ? engine::SpecialTokens::Match : engine::SpecialTokens::Split);
  } catch (const std::invalid_argument& e) {
    throw invalid_argument(field + ".text", e.what());
  }
}

void check_token_limits(std::span<const size_t> segment_tokens, size_t query_tokens, const RouterLimits& limits) {
  size_t total = query_tokens;
  for (size_t i = 0; i < segment_tokens.size(); ++i) {
    if (segment_tokens[i] == 0) {
      throw invalid_argument(fmt::format("segments[{}]", i), "the text tokenises to no tokens");
    }
    if (segment_tokens[i] > limits.max_segment_tokens) {
      throw resource_exhausted(fmt::format("segments[{}]: {} tokens exceed the limit of {} per segment "
                                           "(--max-segment-tokens)",
                                           i, segment_tokens[i], limits.max_segment_tokens));
    }
    total += segment_tokens[i];
  }
  if (query_tokens == 0) throw invalid_argument("query", "the text tokenises to no tokens");
  if (total > limits.max_prompt_tokens) {
    throw resource_exhausted(fmt::format("prompt: {} tokens (segments + query) exceed the limit of {} "
                                         "(--max-prompt-tokens)",
                                         total, limits.max_prompt_tokens));
  }
}

void fit_context(size_t prompt_tokens, RequestOptions& o, const RouterLimits& limits) {
  const uint64_t ctx = limits.max_model_len;
  if (ctx == 0) return;
  constexpr std::string_view kFlag = "(--max-model-len; by default the model's max_position_embeddings)";
  if (prompt_tokens >= ctx) {
    throw resource_exhausted(fmt::format("prompt: {} tokens (segments + query) leave no room in the model's context "
                                         "of {} tokens {}: shorten the prompt",
                                         prompt_tokens, ctx, kFlag));
  }
  const uint64_t left = ctx - prompt_tokens;
  if (!o.max_tokens_given) {
    o.max_tokens = int(std::min<uint64_t>(uint64_t(std::max(o.max_tokens, 1)), left));
    return;
  }
  if (uint64_t(std::max(o.max_tokens, 0)) > left) {
    throw resource_exhausted(fmt::format("prompt: {} tokens (segments + query) + max_tokens {} exceed the model's "
                                         "context of {} tokens {}: shorten the prompt or ask for at most {} tokens",
                                         prompt_tokens, o.max_tokens, ctx, kFlag, left));
  }
}

}  // namespace hypic::router
