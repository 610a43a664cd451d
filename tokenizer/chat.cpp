// ChatML formatting for the Qwen models (tokenizer/chat.h).
#include "tokenizer/chat.h"

#include <stdexcept>

namespace hypic::engine {
namespace {

constexpr std::string_view kStart = "<|im_start|>";
constexpr std::string_view kEnd = "<|im_end|>";
constexpr std::string_view kEmptyThink = "<think>\n\n</think>\n\n";

void check_content(std::string_view content, std::string_view what) {
  for (const std::string_view ctl : {kStart, kEnd}) {
    if (content.find(ctl) != std::string_view::npos) {
      throw std::invalid_argument(std::string(what) + " contains the ChatML control string '" + std::string(ctl) + "'");
    }
  }
}

std::string generation_prompt(const ChatOptions& options) {
  if (!options.add_generation_prompt) {
    if (options.disable_thinking) throw std::invalid_argument("ChatOptions: disable_thinking needs add_generation_prompt");
    return {};
  }
  std::string s = std::string(kStart) + "assistant\n";
  if (options.disable_thinking) s += kEmptyThink;
  return s;
}

}  // namespace

std::string chatml_turn(std::string_view role, std::string_view content) {
  if (role != "system" && role != "user" && role != "assistant") {
    throw std::invalid_argument("chatml_turn: role must be system, user or assistant, got '" + std::string(role) + "'");
  }
  check_content(content, "chatml_turn: content of the " + std::string(role) + " turn");
  std::string s;
  s.reserve(content.size() + role.size() + kStart.size() + kEnd.size() + 2);
  s += kStart;
  s += role;
  s += '\n';
  s += content;
  s += kEnd;
  s += '\n';
  return s;
}

std::string format_chatml(std::span<const ChatMessage> messages, const ChatOptions& options) {
  if (messages.empty()) throw std::invalid_argument("format_chatml: no messages");
  // The template's last_query_index: the last user message (the whole list if there is none).
  size_t last_query = messages.size() - 1;
  for (size_t i = messages.size(); i-- > 0;) {
    if (messages[i].role == "user") { last_query = i; break; }
  }
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const std::string where = "format_chatml: message " + std::to_string(i);
    if (m.role == "assistant" && m.content.find("</think>") != std::string::npos) {
      throw std::invalid_argument(where + ": assistant content with </think> is not supported (the template rewrites it)");
    }
    try {
      if (m.role == "assistant" && i > last_query && i + 1 == messages.size()) {
        // The template gives a final answer after the last question an (empty) reasoning block
        // and strips the content's leading newlines.
        const size_t skip = m.content.find_first_not_of('\n');
        const std::string_view body = skip == std::string::npos ? std::string_view() : std::string_view(m.content).substr(skip);
        std::string turn = chatml_turn(m.role, body);
        turn.insert(kStart.size() + m.role.size() + 1, kEmptyThink);
        out += turn;
      } else {
        out += chatml_turn(m.role, m.content);
      }
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(where + ": " + e.what());
    }
  }
  out += generation_prompt(options);
  return out;
}

std::string chatml_open_user(std::string_view system) {
  std::string s = system.empty() ? std::string() : chatml_turn("system", system);
  s += kStart;
  s += "user\n";
  return s;
}

std::string format_chatml_query(std::string_view query, const ChatOptions& options) {
  check_content(query, "format_chatml_query: query");
  if (!options.add_generation_prompt) throw std::invalid_argument("format_chatml_query: the query must open the answer");
  std::string s(query);
  s += kEnd;
  s += '\n';
  s += generation_prompt(options);
  return s;
}

}  // namespace hypic::engine
