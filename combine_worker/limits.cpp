#include "combine_worker/limits.h"

#include <limits>

#include <fmt/format.h>

#include "proto/rpc/flags.h"
#include "proto/rpc/status.h"

namespace hypic::combine {

void add_request_limit_flags(CLI::App& app, RequestLimits& l) {
  constexpr int32_t kI32 = std::numeric_limits<int32_t>::max();
  constexpr int64_t kI64 = std::numeric_limits<int64_t>::max();
  rpc::add_strict_int_option(app, "--max-new-tokens", l.max_new_tokens, 1, kI32,
                             "most tokens a request may decode (sampling.max_tokens), whatever the router allows")
      ->capture_default_str();
  rpc::add_strict_int_option(app, "--max-segments", l.max_segments, 1, kI32, "most segments per request")
      ->capture_default_str();
  rpc::add_strict_int_option(app, "--max-segment-tokens", l.max_segment_tokens, 1, kI64, "most token ids per segment")
      ->capture_default_str();
  rpc::add_strict_int_option(app, "--max-prompt-tokens", l.max_prompt_tokens, 1, kI64,
                             "most token ids per request (segments and query)")
      ->capture_default_str();
}

void check_request_limits(const hypic::v1::CombineRequest& req, const RequestLimits& l) {
  if (req.sampling().max_tokens() > l.max_new_tokens) {
    throw rpc::invalid_argument("sampling.max_tokens", fmt::format("{} exceeds this combine worker's limit of {} "
                                                                   "(--max-new-tokens)",
                                                                   req.sampling().max_tokens(), l.max_new_tokens));
  }
  if (req.segments_size() > l.max_segments) {
    throw rpc::invalid_argument("segments", fmt::format("{} segments exceed this combine worker's limit of {} "
                                                        "(--max-segments)",
                                                        req.segments_size(), l.max_segments));
  }
  int64_t total = req.query_ids_size();
  for (int i = 0; i < req.segments_size(); ++i) {
    const int64_t n = req.segments(i).key().token_ids_size();
    if (n > l.max_segment_tokens) {
      throw rpc::invalid_argument(fmt::format("segments[{}].key.token_ids", i),
                                  fmt::format("{} tokens exceed this combine worker's limit of {} "
                                              "(--max-segment-tokens)",
                                              n, l.max_segment_tokens));
    }
    total += n;
  }
  if (total > l.max_prompt_tokens) {
    throw rpc::invalid_argument("segments", fmt::format("{} prompt tokens (segments and query) exceed this combine "
                                                        "worker's limit of {} (--max-prompt-tokens)",
                                                        total, l.max_prompt_tokens));
  }
}

}  // namespace hypic::combine
