// The model-free part of engine/backend.h (device specs, numerics tags, fingerprints, token-id checks), in
// hypic_engine_base: the router computes digests under the backend fingerprint without the model runtime.
#include <xxhash.h>

#include <charconv>
#include <cstdio>

#include "engine/backend.h"

namespace hypic::engine {

DeviceSpec DeviceSpec::parse(std::string_view text) {
  const auto bad = [&](const std::string& why) {
    return std::invalid_argument("device '" + std::string(text) + "': " + why +
                                 " (expected cpu, cuda or cuda:N with N a device ordinal)");
  };
  if (text == "cpu") return {BackendKind::Cpu, 0};
  if (text == "cuda") return {BackendKind::Cuda, 0};
  if (text.starts_with("cuda:")) {
    const std::string_view num = text.substr(5);
    int index = -1;
    const auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), index);
    if (num.empty() || ec != std::errc() || end != num.data() + num.size() || index < 0)
      throw bad("not a device ordinal: '" + std::string(num) + "'");
    return {BackendKind::Cuda, index};
  }
  throw bad("unknown device");
}

std::string DeviceSpec::name() const {
  return kind == BackendKind::Cpu ? std::string("cpu") : "cuda:" + std::to_string(index);
}

const char* backend_numerics(BackendKind kind) { return kind == BackendKind::Cpu ? "cpu-fp32" : "cuda-bf16"; }

std::string random_weights_digest(uint64_t seed) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "random-%016llx", static_cast<unsigned long long>(seed));
  return buf;
}

std::string model_fingerprint(const ModelConfig& config, std::string_view numerics) {
  std::string s = "hypic-backend-v1|" + config.fingerprint() + "|numerics=";
  s += numerics;
  const XXH128_hash_t h = XXH3_128bits(s.data(), s.size());
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return buf;
}

void check_token_ids(std::span<const int32_t> ids, int64_t vocab_size, const std::string& what) {
  if (ids.empty()) throw std::invalid_argument(what + ": must not be empty");
  for (size_t j = 0; j < ids.size(); ++j)
    if (ids[j] < 0 || ids[j] >= vocab_size)
      throw std::invalid_argument(what + "[" + std::to_string(j) + "]: " + std::to_string(ids[j]) +
                                  " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
}

}  // namespace hypic::engine
