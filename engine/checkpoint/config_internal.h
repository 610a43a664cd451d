// Internal helpers of the config parsers (engine/checkpoint/config.cpp and each family's
// engine/families/<family>/config.cpp): typed JSON field access that names the field in every error, and the size
// bounds shared by every family. Not a public API.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "engine/checkpoint/config.h"

namespace hypic::engine::config_detail {

using nlohmann::json;

inline std::invalid_argument field_error(std::string_view origin, std::string_view field, const std::string& what) {
  return std::invalid_argument(std::string(origin) + ": field '" + std::string(field) + "' " + what);
}

/// Whether JSON value `v` converts to T without loss: integral T needs a JSON integer within T's range (nlohmann's
/// get<int>() of 1e300 or of 2^40 would be undefined or truncate), floating T any number; other T are checked by
/// get<T>() itself.
template <typename T>
inline bool representable(const json& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return true;
  } else if constexpr (std::is_integral_v<T>) {
    if (v.is_number_unsigned()) return v.get<uint64_t>() <= uint64_t(std::numeric_limits<T>::max());
    if (v.is_number_integer()) {
      const auto i = v.get<int64_t>();
      return i >= int64_t(std::numeric_limits<T>::min()) && uint64_t(i) <= uint64_t(std::numeric_limits<T>::max());
    }
    return !v.is_number();  // a float: refused; a string etc.: get<T>() reports the wrong type
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    return !v.is_array() || std::all_of(v.begin(), v.end(), [](const json& e) { return representable<int>(e); });
  } else {
    return true;
  }
}

/// Reads `key` from `obj` as T; absent or null -> `fallback`; wrong JSON type, or a number T cannot hold (a
/// fraction or an out-of-range value for an integer field) -> invalid_argument.
template <typename T>
inline T get_or(const json& obj, std::string_view origin, const char* key, T fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!representable<T>(*it)) throw field_error(origin, key, "is not an integer in range (value " + it->dump() + ")");
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    throw field_error(origin, key, "has the wrong type (value " + it->dump() + ")");
  }
}

template <typename T>
inline T get_required(const json& obj, std::string_view origin, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) throw field_error(origin, key, "is missing");
  return get_or<T>(obj, origin, key, T{});
}

inline void require_positive(std::string_view origin, const char* field, int64_t v) {
  if (v <= 0) throw field_error(origin, field, "must be > 0, got " + std::to_string(v));
}

/// Upper bounds of the sizes (generous: the largest released hybrid models are far below them). They keep every
/// derived size (state and KV bytes, conv_dim, entry geometry) within int64 / int, and a corrupt config from
/// allocating or looping without bound (e.g. 2^31 layers).
constexpr int64_t kMaxLayers = 4096, kMaxHeads = 4096, kMaxHeadDim = 4096, kMaxConvKernel = 1024;
constexpr int64_t kMaxHidden = int64_t{1} << 20, kMaxIntermediate = int64_t{1} << 24, kMaxExperts = 65536;
constexpr int64_t kMaxVocab = std::numeric_limits<int32_t>::max();  // token ids are int32

inline void require_at_most(std::string_view origin, const char* field, int64_t v, int64_t max) {
  if (v > max) throw field_error(origin, field, std::to_string(v) + " exceeds the supported maximum " + std::to_string(max));
}

inline void require_multiple(std::string_view origin, const char* field, int64_t v, const char* of_field, int64_t of) {
  if (v % of != 0)
    throw field_error(origin, field,
                      std::to_string(v) + " is not a multiple of " + of_field + " " + std::to_string(of));
}

/// Reads RoPE settings into c.rope_theta / c.partial_rotary_factor: transformers 5.x `rope_parameters`, else legacy
/// top-level `rope_theta` / `partial_rotary_factor`; a rope_type other than "default" is rejected (config.cpp).
void parse_rope(const json& t, std::string_view origin, ModelConfig& c);

/// Appends `layer_types` of config object t (a list of HF spellings, parse_layer_type) to c.layer_types; returns false
/// (nothing appended) when the key is absent or null. Throws std::invalid_argument naming origin o and the field for a
/// non-list, a non-string entry or an unknown type (config.cpp).
bool parse_layer_types_list(const json& t, std::string_view o, ModelConfig& c);

/// The config.json fields every family writes the same way (each family's config_to_json): vocab_size,
/// hidden_size, num_hidden_layers, layer_types, rms_norm_eps, max_position_embeddings (when > 0), hidden_act "silu",
/// num_attention_heads, num_key_value_heads (config.cpp).
json common_config_json(const ModelConfig& c);

}  // namespace hypic::engine::config_detail
