// libFuzzer target: the config.json loader (engine/checkpoint/config.h, parse_config).
//
// Feeds: the input bytes as config.json text.
// Asserts, beyond "no crash, no leak, no UB" (UBSan catches overflowing derived sizes and out-of-range float to
// integer conversions):
//  - parse_config fails only with std::runtime_error (not JSON / not an object) or std::invalid_argument (a field,
//    named);
//  - an accepted config passes validate(), and its derived sizes (conv_dim, state and KV bytes, rotary_dim, layer
//    indices) are computed;
//  - round trip: config_to_json -> parse_config gives the same fingerprint, and serialising that again gives the
//    same text.
// Seeds (scripts/fuzz.sh): every config.json of tests/fixtures, tests/integration/tiny_model.json and the demo
// model's config.
#include "engine/checkpoint/config.h"
#include "tests/fuzz/fuzz_common.h"

using namespace hypic::engine;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  ModelConfig c;
  try {
    c = parse_config(text, "fuzz");
  } catch (const std::invalid_argument&) {
    return 0;
  } catch (const std::runtime_error&) {
    return 0;
  }
  c.validate();  // must not throw for an accepted config
  (void)c.conv_dim();
  (void)c.linear_state_bytes();
  (void)c.kv_bytes_per_token();
  (void)c.rotary_dim();
  int lin = 0, att = 0;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    (void)c.is_moe_layer(i);
    if (c.layer_types[size_t(i)] == LayerType::Linear) FUZZ_CHECK(c.linear_index(i) == lin++, "linear_index");
    else FUZZ_CHECK(c.attention_index(i) == att++, "attention_index");
  }
  FUZZ_CHECK(lin == c.num_linear_layers() && att == c.num_attention_layers(), "layer counts");
  const std::string j = config_to_json(c);
  ModelConfig d;
  try {
    d = parse_config(j, "round trip");
  } catch (const std::exception& e) {
    FUZZ_CHECK(false, std::string("config_to_json output rejected: ") + e.what() + "\n" + j);
  }
  FUZZ_CHECK(d.fingerprint() == c.fingerprint(), "round trip changed the fingerprint:\n" + j);
  FUZZ_CHECK(config_to_json(d) == j, "round trip changed the JSON:\n" + j);
  return 0;
}
