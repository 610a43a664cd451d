// Validation and admission limits of Router.Generate requests (everything the router can check
// before and right after tokenising), and the tokenisation of segments. Errors are rpc::RpcError:
// INVALID_ARGUMENT naming the field ("segments[2].text: invalid UTF-8 at byte 17"), RESOURCE_EXHAUSTED
// naming the limit and the flag that sets it.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/splice_mode.h"
#include "tokenizer/tokenizer.h"
#include "hypic/v1/router.pb.h"

namespace hypic::router {

/// Admission limits and defaults (router flags).
struct RouterLimits {
  uint32_t max_concurrent_requests = 64;  ///< --max-concurrent-requests
  uint32_t max_segments = 256;            ///< --max-segments
  uint32_t max_segment_tokens = 32768;    ///< --max-segment-tokens
  uint32_t max_prompt_tokens = 262144;    ///< --max-prompt-tokens (segments + query)
  uint32_t max_new_tokens = 4096;         ///< --max-new-tokens (upper bound of sampling.max_tokens)
  /// --max-model-len: prompt tokens + sampling.max_tokens of one request (the model's context); 0 = no limit. The
  /// router resolves its default (flag 0) to the model's max_position_embeddings (config.json) where it gives one.
  uint32_t max_model_len = 0;
  /// --max-segment-bytes: text bytes per segment, checked before tokenising; 0 = kBytesPerToken x max_segment_tokens.
  uint64_t max_segment_bytes = 0;
  /// --max-prompt-bytes: text bytes of all segments and the query; 0 = kBytesPerToken x max_prompt_tokens.
  uint64_t max_prompt_bytes = 0;
  int max_seam_width = 256;               ///< --max-seam-width
  int default_seam_width = 8;             ///< --seam-width
  int max_refresh_segments = 64;          ///< --max-refresh-segments
  int default_refresh_segments = 0;       ///< --refresh-segments (hypic requests that do not say; 0 = off)
  int default_refresh_tail = 0;           ///< --refresh-tail (hypic requests that do not say; 0 = off)
  int default_max_tokens = 128;           ///< --default-max-tokens

  /// Bytes of text per token the default byte limits allow. Byte-level BPE text averages 2-5 bytes per token
  /// (English prose about 4.5, CJK about 2); only long runs of characters that merge into one token (whitespace
  /// art, "=====") go beyond 16, so the byte limit refuses nothing the token limit would have accepted except such
  /// text, and bounds tokenisation work (about 50 ms per MB) before the token count is known.
  static constexpr uint64_t kBytesPerToken = 16;
  /// The effective --max-segment-bytes / --max-prompt-bytes (the defaults resolved), in bytes.
  uint64_t segment_bytes_limit() const {
    return max_segment_bytes ? max_segment_bytes : kBytesPerToken * max_segment_tokens;
  }
  uint64_t prompt_bytes_limit() const { return max_prompt_bytes ? max_prompt_bytes : kBytesPerToken * max_prompt_tokens; }
};

/// Most stop strings (each at most kMaxStopBytes bytes) and stop token ids one request may give (SamplingParams).
inline constexpr int kMaxStops = 64;
inline constexpr size_t kMaxStopBytes = 1024;

/// The request's options with defaults applied.
struct RequestOptions {
  engine::SpliceMode mode = engine::SpliceMode::Hypic;
  int seam_width = 8;       ///< w as requested (or the default)
  int entry_seam_width = 8; ///< w the entries are built and hashed with: w in hypic mode, 0 otherwise
  int refresh_segments = 0; ///< hypic: segments the query-aware refresh recomputes (CacheOptions.refresh_segments)
  int refresh_tail = 0;     ///< hypic: last segments recomputed whole (CacheOptions.refresh_tail)
  bool cache_segments = true;
  /// Whether segments go through entries (lookup, scatter, splice): false for full and prefix,
  /// which compute segments in context on the combine worker.
  bool uses_entries = true;
  int max_tokens = 128;
  bool max_tokens_given = false;  ///< sampling.max_tokens was set (else max_tokens is --default-max-tokens)
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
};

/// Checks the request's structure and options (not the token counts): request_id, at least one
/// segment and at most max_segments (RESOURCE_EXHAUSTED), each segment's text at most
/// segment_bytes_limit() bytes and all text at most prompt_bytes_limit() (RESOURCE_EXHAUSTED naming the
/// segment, its size and the limit: checked before any tokenisation), each segment and the query
/// non-empty, text valid UTF-8, token ids within [0, vocab_size) (INVALID_ARGUMENT naming the segment,
/// the index and the value), sampling and cache options in range (stop strings and stop token ids: at most
/// kMaxStops each, strings of at most kMaxStopBytes, ids within the vocabulary). Returns the options with defaults
/// applied.
RequestOptions validate_request(const hypic::v1::GenerateRequest& req, const RouterLimits& limits, int64_t vocab_size);

/// Token ids of a validated segment or query (`field` names it: "segments[3]", "query"): the ids as sent, or
/// the text tokenised on its own (add_special_tokens=false), special-token strings as plain text unless
/// seg.allow_special_tokens() (engine::SpecialTokens::Split / Match). Throws RpcError INVALID_ARGUMENT
/// "`field`.text: ..." when the tokenizer refuses the text.
std::vector<int32_t> segment_token_ids(const engine::Tokenizer& tokenizer, const hypic::v1::Segment& seg,
                                       const std::string& field);

/// Token-count limits after tokenisation: each segment <= max_segment_tokens and the whole prompt
/// <= max_prompt_tokens (RESOURCE_EXHAUSTED); an empty tokenisation is INVALID_ARGUMENT.
void check_token_limits(std::span<const size_t> segment_tokens, size_t query_tokens, const RouterLimits& limits);

/// The context limit limits.max_model_len (when set) on prompt_tokens (segments + query) + o.max_tokens, so that a
/// prompt past the positions the model was trained for is refused instead of answered with degraded text (vLLM's
/// max_model_len): a prompt that fills the context is RESOURCE_EXHAUSTED "prompt: N tokens (segments + query) leave
/// no room ..."; a max_tokens the request gave (o.max_tokens_given) past what is left is RESOURCE_EXHAUSTED "prompt:
/// N tokens (segments + query) + max_tokens M exceed the model's context of L tokens (--max-model-len ...)"; the
/// default max_tokens is lowered to what is left instead (as OpenAI and vLLM do).
void fit_context(size_t prompt_tokens, RequestOptions& o, const RouterLimits& limits);

}  // namespace hypic::router
