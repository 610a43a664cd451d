// ChatML prompt text for the Qwen models (`<|im_start|>role\ncontent<|im_end|>\n` turns).
//
// Matches what the Qwen3 chat template (tokenizer_config.json "chat_template", rendered by
// transformers' apply_chat_template) produces for plain system / user / assistant messages
// without tools; it is a fixed format, not a template engine. Tool calls, tool messages and the
// template's stripping of <think> blocks from earlier assistant turns are not handled: an
// assistant content containing "</think>" is rejected so the difference cannot go unnoticed.
//
// For segment caching the prompt is cut into pieces that are tokenised separately: the opening
// (chatml_open_user: optional system turn and the start of the user turn), the document
// segments (raw text), and the query (format_chatml_query: the question, the end of the user
// turn and the start of the assistant turn, where decoding begins).
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace hypic::engine {

struct ChatMessage {
  std::string role;     // "system", "user" or "assistant"
  std::string content;  // UTF-8 text
};

struct ChatOptions {
  /// End with "<|im_start|>assistant\n" so that generation starts the assistant's answer.
  bool add_generation_prompt = true;
  /// Qwen3 hybrid-thinking models: append the empty "<think>\n\n</think>\n\n" block that the
  /// template adds for enable_thinking=false (only with add_generation_prompt).
  bool disable_thinking = false;
};

/// One turn: "<|im_start|>" + role + "\n" + content + "<|im_end|>\n".
/// Throws std::invalid_argument if role is not system/user/assistant or content holds a ChatML
/// control string ("<|im_start|>", "<|im_end|>"), which would let text forge turns.
std::string chatml_turn(std::string_view role, std::string_view content);

/// The whole conversation as the Qwen3 chat template renders it (see the file comment), including
/// its one special case: a final assistant message after the last user message gets the empty
/// think block before its content (leading newlines of the content dropped). Throws
/// std::invalid_argument naming the message index for a bad role, ChatML control strings in a
/// content, assistant content containing "</think>", or an empty list.
std::string format_chatml(std::span<const ChatMessage> messages, const ChatOptions& options = {});

/// The text before the cached segments of a single-turn prompt: the system turn (omitted when
/// `system` is empty) followed by "<|im_start|>user\n".
std::string chatml_open_user(std::string_view system = {});

/// The query segment closing that prompt: query + "<|im_end|>\n<|im_start|>assistant\n" (+ the
/// empty think block when options.disable_thinking). chatml_open_user(s) + documents + query text
/// passed here equals format_chatml({system s, user documents+query}).
std::string format_chatml_query(std::string_view query, const ChatOptions& options = {});

}  // namespace hypic::engine
