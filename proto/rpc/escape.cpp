#include "proto/rpc/escape.h"

#include <algorithm>

#include <fmt/format.h>

namespace hypic::rpc {

namespace {
// Appends the escaped form of byte c (untrusted()); with `quotes` (untrusted text) also quotes, backslashes and bytes
// above 0x7e; without (status messages: our own text, UTF-8 kept) only control bytes.
void escape_byte(std::string& out, unsigned char c, bool quotes) {
  switch (c) {
    case '\n': out += "\\n"; return;
    case '\r': out += "\\r"; return;
    case '\t': out += "\\t"; return;
    case '\\': out += quotes ? "\\\\" : "\\"; return;
    case '"': out += quotes ? "\\\"" : "\""; return;
    default: break;
  }
  if (c < 0x20 || c == 0x7f || (quotes && c > 0x7f)) {
    out += fmt::format("\\x{:02x}", c);
  } else {
    out += static_cast<char>(c);
  }
}

std::string escape_capped(std::string_view text, size_t max_bytes, bool quotes) {
  std::string out;
  out.reserve(std::min(text.size(), max_bytes) + 2);
  if (quotes) out += '"';
  const size_t limit = max_bytes + (quotes ? 1 : 0);
  size_t i = 0;
  for (; i < text.size(); ++i) {
    const size_t before = out.size();
    escape_byte(out, static_cast<unsigned char>(text[i]), quotes);
    if (out.size() > limit) {
      out.resize(before);
      break;
    }
  }
  if (i < text.size()) {
    out += quotes ? fmt::format("...\" ({} bytes)", text.size()) : fmt::format("... ({} bytes)", text.size());
  } else if (quotes) {
    out += '"';
  }
  return out;
}
}  // namespace

std::string untrusted(std::string_view text, size_t max_bytes) {
  const bool plain = !text.empty() && text.size() <= max_bytes &&
                     std::all_of(text.begin(), text.end(), [](char ch) {
                       const auto c = static_cast<unsigned char>(ch);
                       return c > 0x20 && c < 0x7f && c != '"' && c != '\\';
                     });
  return plain ? std::string(text) : escape_capped(text, max_bytes, true);
}

std::string capped_message(std::string_view message) {
  return escape_capped(message, kMaxStatusMessageBytes, false);
}

}  // namespace hypic::rpc
