// The OpenAI-compatible request and response shapes of hypic-openai, and how a request becomes a hypic.v1 Generate
// call: parsing and checking the JSON (every error names the field), assembling the prompt into segments and a query
// as token ids, formatting answers, stream chunks and errors, and mapping gRPC statuses to HTTP. Pure functions (no
// I/O, no network): the HTTP server (openai_front/http_server.h) calls them, the unit tests
// (tests/unit/cluster/test_openai_front.cpp) check them.
//
// What becomes a segment (openai_front/README.md says it for users):
//  - /v1/chat/completions: each message before the last one, as its whole ChatML turn
//    ("<|im_start|>" role "\n" content "<|im_end|>" "\n"), one segment per message; then the opening of the last
//    user turn ("<|im_start|>user\n") as a segment of its own; then each document of the `documents` extension as
//    one segment (its text verbatim); the query is the last message's content followed by
//    "<|im_end|>\n<|im_start|>assistant\n" (tokenizer/chat.h format_chatml_query). The segment texts and the query
//    concatenate to engine::format_chatml of the conversation whose last user message holds the documents followed
//    by the question (tokenizer/chat.h's identity).
//  - /v1/completions: with documents, each document is a segment and the prompt is the query; without, the
//    prompt's token ids except the last are one segment and the last id is the query (the same ids as tokenising
//    the whole prompt).
// Token ids are sent (hypic.v1.Segment.tokens), never text: the ChatML markers are their special ids, and every
// text a user supplies (message contents, documents) is tokenised with engine::SpecialTokens::Split, so a
// "<|im_end|>" inside a message stays plain text and cannot forge a turn. The /v1/completions prompt is the raw model
// input and is tokenised with SpecialTokens::Match (as OpenAI-compatible servers do), so it can spell a ChatML prompt
// itself; its documents are Split like every other document.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <grpcpp/support/status.h>
#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"
#include "hypic/v1/router.pb.h"

namespace hypic::openai {

/// An error answered in OpenAI's shape: HTTP `status`, body
/// {"error": {"message": what(), "type": type, "param": param or null, "code": code or null}}.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, std::string message, std::string param = {}, std::string code = {})
      : std::runtime_error(std::move(message)), status_(status), type_(std::move(type)), param_(std::move(param)),
        code_(std::move(code)) {}
  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& param() const { return param_; }
  const std::string& code() const { return code_; }
  /// {"error": {...}} (param and code null when empty).
  nlohmann::json body() const;

 private:
  int status_;
  std::string type_, param_, code_;
};

/// 400 invalid_request_error naming `param`; the message is "<param>: <problem>" (just `problem` when param is empty).
ApiError invalid_request(std::string_view param, std::string_view problem, std::string_view code = {});

/// Which endpoint a request came to.
enum class Endpoint { Chat, Completions };

/// The special token ids the chat prompt needs, from the tokenizer ("<|im_start|>", "<|im_end|>"); -1 when absent
/// (then chat requests are refused with a 400 saying so).
struct ChatTokens {
  int32_t im_start = -1;
  int32_t im_end = -1;
  static ChatTokens from(const engine::Tokenizer& tokenizer);
  bool available() const { return im_start >= 0 && im_end >= 0; }
};

/// One chat message as parsed: role "system" (also for "developer"), "user" or "assistant"; content as UTF-8 text
/// (an array of text parts is joined with "\n").
struct ChatMessage {
  std::string role;
  std::string content;
};

/// One segment sent to the router: its token ids and where it came from in the user's request ("messages[0]",
/// "messages[2]:user-opening", "documents[1]", "prompt"), used in errors and in the hypic report.
struct PromptSegment {
  std::vector<int32_t> ids;
  std::string origin;
};

/// The prompt as the router receives it: cacheable segments in order, then the query (never cached).
struct Prompt {
  std::vector<PromptSegment> segments;
  std::vector<int32_t> query;
  std::string query_origin;  ///< "messages[N].content" or "prompt"
};

/// Chat prompt (see the file comment). `messages` must be non-empty and end with a user message (checked by
/// parse_request; here std::invalid_argument). disable_thinking appends the empty "<think>\n\n</think>\n\n" block
/// to the query (Qwen3 enable_thinking=false). Throws ApiError (400) for a tokenizer without ChatML tokens, an
/// assistant content containing "</think>" (the Qwen3 template rewrites those turns; not supported) or text the
/// tokenizer refuses, naming the message or document.
Prompt assemble_chat_prompt(std::span<const ChatMessage> messages, std::span<const std::string> documents,
                            const engine::Tokenizer& tokenizer, bool disable_thinking = false);

/// Completions prompt (see the file comment). Throws ApiError (400) naming the field for a prompt without documents
/// that tokenises to fewer than 2 ids (a segment and a query need one each) or text the tokenizer refuses.
Prompt assemble_completion_prompt(std::string_view prompt, std::span<const std::string> documents,
                                  const engine::Tokenizer& tokenizer);

/// Everything a request asks for, checked.
struct ParsedRequest {
  Endpoint endpoint = Endpoint::Chat;
  std::string model;                 ///< as given ("" when absent)
  Prompt prompt;
  std::optional<int32_t> max_tokens; ///< absent: chat -> the router's --default-max-tokens; completions -> 16
  std::string max_tokens_param = "max_tokens";  ///< the field the user set it with (for errors)
  float temperature = 1.0f;          ///< OpenAI's default is 1; 0 = greedy
  std::optional<float> top_p;
  int32_t top_k = 0;                 ///< extension (vLLM's name); 0 = off
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool ignore_eos = false;           ///< extension (vLLM's name)
  bool stream = false;
  bool include_usage = false;        ///< stream_options.include_usage
  // The `hypic` request object (all optional): cache options and the request id.
  std::string mode;
  std::optional<int32_t> seam_width;
  std::optional<int32_t> refresh_segments;  ///< hypic.refresh_segments (CacheOptions.refresh_segments)
  std::optional<int32_t> refresh_tail;      ///< hypic.refresh_tail (CacheOptions.refresh_tail)
  std::optional<bool> cache_segments;
  std::string request_id;
};

/// Limits and names parse_request needs.
struct ParseOptions {
  std::string model_name;            ///< the served model's id: a request naming another model gets 404
  int32_t default_completion_max_tokens = 16;  ///< OpenAI's default for /v1/completions
  int max_json_depth = 64;           ///< deeper nesting is refused before parsing
};

/// Parses and checks a request body for `endpoint` and assembles its prompt. Throws ApiError: 400 for bad JSON
/// ("invalid JSON: ..."), a field of the wrong type or out of range, an unknown or unsupported field (each names the
/// field in `param` and the message), 404 (code model_not_found) for a `model` other than options.model_name.
ParsedRequest parse_request(Endpoint endpoint, std::string_view body, const engine::Tokenizer& tokenizer,
                            const ParseOptions& options);

/// The hypic.v1 request for a parsed one; `request_id` is set on it (the caller makes one up when the user gave none).
v1::GenerateRequest to_generate_request(const ParsedRequest& req, const std::string& request_id);

/// The OpenAI error for a failed Generate call (every gRPC code is mapped; see openai_front/README.md "Errors"):
/// INVALID_ARGUMENT / OUT_OF_RANGE -> 400 with param naming the user's field (segments[i] -> its origin, query ->
/// the query's origin, sampling.max_tokens -> max_tokens, ...); RESOURCE_EXHAUSTED -> 429 for the router's
/// concurrency limit and other capacity limits, 413 for the size limits (segments, bytes, tokens, message size), 400
/// for --max-new-tokens; UNAVAILABLE and CANCELLED -> 503; DEADLINE_EXCEEDED -> 504; UNAUTHENTICATED /
/// PERMISSION_DENIED -> 502 (the router refused the front's own credentials, not the user's); UNIMPLEMENTED -> 501;
/// UNKNOWN, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION, ABORTED -> 502; INTERNAL, DATA_LOSS -> 500.
ApiError map_grpc_status(const grpc::Status& status, const ParsedRequest& req);

/// "stop" or "length" for a report's finish reason.
std::string finish_reason_name(v1::FinishReason reason);

/// The `hypic` extension object of an answer: request id, mode, seam width, seed, per-segment rows (index, origin,
/// tokens, cache_hit, reused, source as in deploy/README.md, built_by, device, compute_ms, entry_bytes, digest,
/// note), TTFT breakdown in ms (router, lookup, scatter, transfer, splice, prefill, first_decode, total; the phases add up
/// to total), prompt and query
/// tokens, decode and total ms, combine worker and device, numerics, cache availability, scatter failures.
nlohmann::json hypic_report_json(const v1::GenerateReport& report, const Prompt& prompt);

/// {prompt_tokens, completion_tokens, total_tokens} from a report.
nlohmann::json usage_json(const v1::GenerateReport& report);

/// What a response needs besides the text: the id ("chatcmpl-<request id>" / "cmpl-<request id>"), creation time
/// (Unix seconds) and the model id.
struct ResponseMeta {
  std::string id;
  int64_t created = 0;
  std::string model;
};

/// "chatcmpl-..." or "cmpl-..." for a request id.
std::string response_id(Endpoint endpoint, const std::string& request_id);

/// The non-streaming answer: "chat.completion" (choices[0].message {role assistant, content}) or "text_completion"
/// (choices[0].text), finish_reason, usage and the hypic object.
nlohmann::json completion_response(Endpoint endpoint, const ResponseMeta& meta, const std::string& text,
                                   const v1::GenerateReport& report, const Prompt& prompt);

/// One stream chunk ("chat.completion.chunk" / "text_completion") carrying `text` (chat: delta.content; the first
/// chat chunk also carries delta.role "assistant"); finish_reason null; "usage": null when include_usage.
nlohmann::json stream_text_chunk(Endpoint endpoint, const ResponseMeta& meta, const std::string& text, bool first,
                                 bool include_usage);
/// The chunk with the finish reason (chat: empty delta); it carries the hypic object unless include_usage, in which
/// case stream_usage_chunk (choices [], usage) follows it and carries the hypic object, as the final chunk.
nlohmann::json stream_finish_chunk(Endpoint endpoint, const ResponseMeta& meta, const v1::GenerateReport& report,
                                   const Prompt& prompt, bool include_usage);
nlohmann::json stream_usage_chunk(Endpoint endpoint, const ResponseMeta& meta, const v1::GenerateReport& report,
                                  const Prompt& prompt);

/// "data: <json>\n\n" (invalid UTF-8 replaced, never throws).
std::string sse_event(const nlohmann::json& j);
/// JSON text for a response body (invalid UTF-8 replaced, never throws).
std::string dump_json(const nlohmann::json& j);

/// True when `body` nests arrays/objects deeper than `max_depth` (strings are skipped); checked before parsing so
/// that a hostile body cannot exhaust the stack.
bool json_too_deep(std::string_view body, int max_depth);

}  // namespace hypic::openai
