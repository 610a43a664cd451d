// A combine worker's own request limits: it does not trust the router's (a caller of CombineWorker.Combine may ask
// for anything), so it refuses a request past its own caps before any work.
#pragma once
#include <cstdint>

#include <CLI/CLI.hpp>

#include "hypic/v1/combine.pb.h"

namespace hypic::combine {

/// The caps (defaults: the router's, so that every request the router admits passes).
struct RequestLimits {
  int32_t max_new_tokens = 4096;         ///< --max-new-tokens: sampling.max_tokens at most this
  int32_t max_segments = 256;            ///< --max-segments: segments per request
  int64_t max_segment_tokens = 32768;    ///< --max-segment-tokens: token ids per segment
  int64_t max_prompt_tokens = 262144;    ///< --max-prompt-tokens: all segments' ids plus the query's
};

/// Registers --max-new-tokens, --max-segments, --max-segment-tokens and --max-prompt-tokens on `app`: each a whole
/// decimal number from 1 to its field's largest value (proto/rpc/flags.h); anything else fails the parse with a
/// CLI::ValidationError naming the flag and the value, and leaves `limits` as it was.
void add_request_limit_flags(CLI::App& app, RequestLimits& limits);

/// Throws rpc::RpcError(INVALID_ARGUMENT) naming the field, the value and the flag of the first cap `req` passes.
void check_request_limits(const hypic::v1::CombineRequest& req, const RequestLimits& limits);

}  // namespace hypic::combine
