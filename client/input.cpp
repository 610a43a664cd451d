#include "client/input.h"
#include "engine/io_error.h"
#include "proto/rpc/flags.h"
#include "proto/rpc/status.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace hypic::client {

namespace v1 = hypic::v1;
using nlohmann::json;

namespace {
/// "a string", "an integer", ... for error messages.
const char* type_name(const json& v) {
  if (v.is_number_float()) return "a non-integer number";
  if (v.is_number()) return "an integer";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

[[noreturn]] void bad_id(const std::string& what, std::string_view value, std::string_view why) {
  throw std::invalid_argument(fmt::format("{}: {} {}: token ids are integers in [0, {})", what, value, why,
                                          kTokenIdLimit));
}
}  // namespace

std::string read_file(const std::string& path, uint64_t max_bytes) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  std::error_code ec;
  if (!in) throw std::runtime_error("cannot read " + path + ": " + engine::io_error_reason(path, errno));
  if (std::filesystem::is_directory(path, ec)) throw std::runtime_error("cannot read " + path + ": Is a directory");
  if (std::filesystem::is_regular_file(path, ec)) {
    const auto size = std::filesystem::file_size(path, ec);
    if (!ec && size > max_bytes) {
      throw std::runtime_error(fmt::format("cannot read {}: {} bytes, more than the {} bytes hypic-client reads from a "
                                           "file",
                                           path, size, max_bytes));
    }
  }
  std::string out;
  char buf[1 << 16];
  while (in) {
    in.read(buf, sizeof buf);
    out.append(buf, size_t(in.gcount()));
    if (out.size() > max_bytes) {
      throw std::runtime_error(fmt::format("cannot read {}: more than the {} bytes hypic-client reads from a file "
                                           "(not a regular file?)",
                                           path, max_bytes));
    }
  }
  if (in.bad()) throw std::runtime_error("cannot read " + path + ": read error");
  return out;
}

double parse_seconds(std::string_view text, std::string_view flag, bool zero_means_none) {
  constexpr double kMaxSeconds = 31536000.0;
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  const bool parsed = !text.empty() && ec == std::errc() && end == text.data() + text.size();
  if (!parsed || !std::isfinite(v) || v < 0 || v > kMaxSeconds || (v == 0 && !zero_means_none)) {
    throw std::invalid_argument(fmt::format("{}: {} is not a number of seconds in {}{}] (finite; no NaN, infinity or "
                                            "negative value)",
                                            flag, rpc::untrusted(text, 64), zero_means_none ? "[0 (none), " : "(0, ",
                                            kMaxSeconds));
  }
  return v;
}

int64_t parse_integer(std::string_view text, std::string_view flag, int64_t min, int64_t max) {
  if (const auto v = rpc::parse_decimal_int(text, min, max)) return *v;
  throw std::invalid_argument(fmt::format("{}: {}", flag, rpc::flag_value_refusal(text, "an integer in " +
                                                                                          rpc::range_text(min, max))));
}

uint64_t parse_uint64(std::string_view text, std::string_view flag) {
  if (const auto v = rpc::parse_decimal_uint(text, 0, UINT64_MAX)) return *v;
  throw std::invalid_argument(
      fmt::format("{}: {}", flag, rpc::flag_value_refusal(text, "an integer in [0, 18446744073709551615]")));
}

std::string check_address(std::string_view text, std::string_view flag) {
  const auto colon = text.rfind(':');
  const bool bracketed = !text.empty() && text[0] == '[';
  bool ok = colon != std::string_view::npos && colon > 0 && (!bracketed || text[colon - 1] == ']');
  if (ok && !bracketed && text.substr(0, colon).find(':') != std::string_view::npos) ok = false;  // IPv6 needs [ ]
  int port = 0;
  if (ok) {
    const std::string_view p = text.substr(colon + 1);
    const auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), port);
    ok = !p.empty() && p[0] != '+' && ec == std::errc() && end == p.data() + p.size() && port >= 1 && port <= 65535;
  }
  if (!ok) {
    throw std::invalid_argument(fmt::format("{}: {} is not HOST:PORT with a port in [1, 65535] (IPv6 as [ADDR]:PORT)",
                                            flag, rpc::untrusted(text, 100)));
  }
  return std::string(text);
}

int32_t token_id_from_json(const json& v, const std::string& what) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u >= uint64_t(kTokenIdLimit)) bad_id(what, v.dump(), "is out of range");
    return int32_t(u);
  }
  if (v.is_number_integer()) {
    const auto i = v.get<int64_t>();
    if (i < 0 || i >= kTokenIdLimit) bad_id(what, v.dump(), "is out of range");
    return int32_t(i);
  }
  bad_id(what, v.dump(), v.is_number_float() ? "is not an integer" : fmt::format("is {}, not an integer", type_name(v)));
}

void segment_from_json(const json& j, v1::Segment* seg, const std::string& what) {
  if (j.is_string()) {
    seg->set_text(j.get<std::string>());
    return;
  }
  if (!j.is_object()) {
    throw std::invalid_argument(fmt::format("{}: expected a string or an object with text, tokens or file, got {}",
                                            what, type_name(j)));
  }
  int contents = 0;
  for (const auto& [key, value] : j.items()) {
    const std::string field = what + "." + key;
    if (key == "text" || key == "file") {
      if (!value.is_string()) throw std::invalid_argument(fmt::format("{}: expected a string, got {}", field, value.dump()));
      if (key == "text") {
        seg->set_text(value.get<std::string>());
      } else {
        try {
          seg->set_text(read_file(value.get<std::string>()));
        } catch (const std::runtime_error& e) {
          throw std::invalid_argument(fmt::format("{}: {}", field, e.what()));
        }
      }
      ++contents;
    } else if (key == "tokens") {
      if (!value.is_array()) throw std::invalid_argument(fmt::format("{}: expected an array of token ids", field));
      auto* ids = seg->mutable_tokens()->mutable_ids();
      ids->Reserve(int(value.size()));
      for (size_t i = 0; i < value.size(); ++i) ids->Add(token_id_from_json(value[i], fmt::format("{}[{}]", field, i)));
      ++contents;
    } else if (key == "allow_special_tokens") {
      if (!value.is_boolean()) throw std::invalid_argument(fmt::format("{}: expected true or false, got {}", field, value.dump()));
      seg->set_allow_special_tokens(value.get<bool>());
    } else {
      throw std::invalid_argument(fmt::format("{}: unknown key (expected text, tokens or file, and optionally "
                                              "allow_special_tokens)",
                                              field));
    }
  }
  if (contents != 1) {
    throw std::invalid_argument(fmt::format("{}: expected exactly one of text, tokens or file, got {}", what, contents));
  }
}

void segments_from_json_text(std::string_view text, const std::string& source, v1::GenerateRequest* req) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw std::invalid_argument(fmt::format("{}: not valid JSON: {}", source, e.what()));
  }
  const json* list = &j;
  if (j.is_object()) {
    for (const auto& [key, value] : j.items()) {
      if (key != "segments" && key != "query")
        throw std::invalid_argument(fmt::format("{}: unknown key '{}' (expected segments and query)", source, key));
    }
    if (!j.contains("segments")) throw std::invalid_argument(fmt::format("{}: the object has no 'segments'", source));
    list = &j["segments"];
  }
  if (!list->is_array()) {
    throw std::invalid_argument(fmt::format("{}: expected an array of segments or {{\"segments\": [...], \"query\": "
                                            "...}}, got {}",
                                            source, type_name(*list)));
  }
  try {
    for (size_t i = 0; i < list->size(); ++i)
      segment_from_json((*list)[i], req->add_segments(), fmt::format("segments[{}]", i));
    if (j.is_object() && j.contains("query")) segment_from_json(j["query"], req->mutable_query(), "query");
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{}: {}", source, e.what()));
  }
}

std::vector<int32_t> parse_token_id_list(std::string_view text, const std::string& what) {
  std::vector<int32_t> ids;
  size_t index = 0;
  for (size_t pos = 0; pos <= text.size();) {
    size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view item = text.substr(pos, comma - pos);
    pos = comma + 1;
    const auto b = item.find_first_not_of(" \t\n\r");
    if (b == std::string_view::npos) continue;
    item = item.substr(b, item.find_last_not_of(" \t\n\r") - b + 1);
    const std::string where = fmt::format("{}[{}]", what, index++);
    uint64_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.find_first_not_of("0123456789") != std::string_view::npos || end != item.data() + item.size())
      bad_id(where, fmt::format("\"{}\"", item), "is not an integer");
    if (ec == std::errc::result_out_of_range || v >= uint64_t(kTokenIdLimit)) bad_id(where, item, "is out of range");
    ids.push_back(int32_t(v));
  }
  return ids;
}

}  // namespace hypic::client
