// Segment digests, entry geometry and format versions (engine/segment.h): the model-free part of the segment code,
// in hypic_engine_base (the router links it without the model runtime).
#include <xxhash.h>

#include <cstring>
#include <stdexcept>

#include "engine/segment.h"

#include "engine/checkpoint/config.h"

namespace hypic::engine {
namespace {
template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
}  // namespace

// ---- digest ------------------------------------------------------------------------------------------

std::string to_hex(const SegmentDigest& d) {
  static const char* hex = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[2 * i] = hex[d[i] >> 4];
    s[2 * i + 1] = hex[d[i] & 15];
  }
  return s;
}

SegmentDigest digest_from_hex(std::string_view hex) {
  if (hex.size() != 32) throw std::invalid_argument("segment digest must be 32 hex digits, got " + std::to_string(hex.size()) + " characters");
  auto val = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    throw std::invalid_argument(std::string("segment digest: not a hex digit: '") + c + "'");
  };
  SegmentDigest d{};
  for (int i = 0; i < 16; ++i) d[i] = static_cast<uint8_t>(val(hex[2 * i]) * 16 + val(hex[2 * i + 1]));
  return d;
}

SegmentDigest segment_digest(std::string_view model_fingerprint, uint32_t format_version, int seam_width,
                             std::span<const int32_t> ids) {
  std::string buf;
  put<uint32_t>(buf, static_cast<uint32_t>(model_fingerprint.size()));
  buf += model_fingerprint;
  put<uint32_t>(buf, format_version);
  put<int32_t>(buf, seam_width);
  put<uint64_t>(buf, ids.size());
  buf.append(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int32_t));
  const XXH128_hash_t h = XXH3_128bits(buf.data(), buf.size());
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  SegmentDigest d;
  std::memcpy(d.data(), c.digest, 16);
  return d;
}

EntryGeometry EntryGeometry::of(const ModelConfig& cfg) {
  EntryGeometry g;
  g.linear_heads = cfg.linear_num_value_heads;
  g.d_k = cfg.linear_key_head_dim;
  g.d_v = cfg.linear_value_head_dim;
  g.conv_dim = static_cast<int>(cfg.conv_dim());
  g.conv_rows = cfg.conv_rows();
  g.kv_heads = cfg.kv_cache_heads();
  g.head_dim = cfg.kv_cache_k_dim();
  g.num_linear = cfg.num_linear_layers();
  g.num_attention = cfg.num_attention_layers();
  g.family = static_cast<int>(cfg.family);
  g.kv_latent_rank = cfg.attention_is_latent() ? cfg.kv_lora_rank : 0;
  g.linear_rotary_dim = cfg.linear_rope && cfg.num_linear_layers() > 0 ? cfg.rotary_dim() : 0;
  return g;
}

uint32_t entry_format_version(const EntryGeometry& g) {
  return g.family == 0 && g.kv_latent_rank == 0 && g.linear_rotary_dim == 0 ? kSegmentFormatVersion
                                                                         : kSegmentFormatVersionFamilies;
}

uint32_t entry_format_version(const ModelConfig& cfg) { return entry_format_version(EntryGeometry::of(cfg)); }

}  // namespace hypic::engine
