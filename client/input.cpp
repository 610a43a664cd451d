#include "client/input.h"
#include "engine/io_error.h"

#include <charconv>
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

std::string read_file(const std::string& path) { return engine::read_file_bytes(path); }

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
