// libFuzzer target: the segment entry deserialiser (engine/segment.h, deserialize_entry and EntryReader).
//
// Feeds: the input bytes as a serialised entry, once whole (deserialize_entry), once streamed through an
// EntryReader in chunks whose sizes come from a generator seeded with the input's hash (so a crash reproduces), and
// once with the tensors laid into a buffer of the header's announced size (EntryReaderChecks::destination).
// Asserts, beyond "no crash, no leak, no UB" (and no allocation that a corrupt header could make huge):
//  - all three paths fail only with EntryError, and fail or succeed together; the laid-out one's buffer holds the
//    input's tensor bytes as they are;
//  - an accepted entry is consistent (check_consistent), byte_size() equals the input size, and serialize_entry
//    of it reproduces the input byte for byte (round trip), for the whole and the streamed result alike.
// Seeds: written by this target itself (HYPIC_FUZZ_WRITE_SEEDS=DIR, see fuzz_common.h), entries serialised
// for the geometry of each tests/fixtures model config and for a tiny geometry, with dense, diagonal and scalar
// transitions and 0, 1 and 5 tokens.
#include <xxhash.h>

#include <random>

#include "engine/checkpoint/config.h"
#include "engine/segment.h"
#include "tests/fuzz/fuzz_common.h"
#include "tests/unit/random_entry.h"

using namespace hypic::engine;

namespace {
void write_seeds(const std::filesystem::path& dir) {
  std::vector<std::pair<std::string, EntryGeometry>> geoms;
  EntryGeometry tiny;
  tiny.linear_heads = 1, tiny.d_k = 2, tiny.d_v = 2, tiny.conv_dim = 3, tiny.conv_rows = 1, tiny.kv_heads = 1,
  tiny.head_dim = 2, tiny.num_linear = 2, tiny.num_attention = 1;
  geoms.emplace_back("tiny", tiny);
  const auto fixtures = hypic::fuzz::source_dir() / "tests/fixtures";
  for (const char* m : {"qwen3_next_moe", "qwen3_5_dense", "qwen3_5_moe"}) {
    const ModelConfig c = parse_config(hypic::fuzz::read_file(fixtures / m / "config.json"), m);
    geoms.emplace_back(m, EntryGeometry::of(c));
  }
  uint32_t seed = 1;
  for (const auto& [name, g] : geoms) {
    for (const TransitionKind k : {TransitionKind::Dense, TransitionKind::Diagonal, TransitionKind::Scalar}) {
      for (const int n : {0, 1, 5}) {
        if (name != "tiny" && (n == 5 || k != TransitionKind::Dense)) continue;  // keep the corpus small
        const std::string bytes =
            serialize_entry(hypic::testing::random_entry(g, n, 2, seed++, [k = k](int, bool) { return k; }));
        hypic::fuzz::write_seed(dir, name + "-k" + std::to_string(int(k)) + "-n" + std::to_string(n) + ".entry", bytes);
      }
    }
  }
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  hypic::fuzz::maybe_write_seeds(write_seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  std::optional<SegmentEntry> whole, streamed;
  std::string whole_error, streamed_error;
  try {
    whole.emplace(deserialize_entry(bytes));
  } catch (const EntryError& e) {
    whole_error = e.what();
  }
  try {
    EntryReader r;
    std::mt19937_64 rng(XXH3_64bits(data, size));
    for (size_t off = 0; off < size;) {
      const size_t n = std::min<size_t>(size - off, 1 + rng() % 64);
      r.feed(bytes.substr(off, n));
      off += n;
    }
    streamed.emplace(r.finish());
  } catch (const EntryError& e) {
    streamed_error = e.what();
  }
  FUZZ_CHECK(whole.has_value() == streamed.has_value(),
             "whole vs streamed disagree: '" + whole_error + "' vs '" + streamed_error + "'");
  // Once more with the tensors laid into a caller's buffer (EntryReaderChecks::destination, as a device backend's
  // pinned block takes them), sized by the checked header only: the same verdict, the tensor bytes as they are.
  std::string laid, laid_error;
  std::optional<SegmentEntry> header;
  try {
    EntryReader r({.total_bytes = size, .destination = [&](const SegmentEntry&, const WireShape& shape) {
                     laid.assign(size_t(shape.tensor_bytes), '\0');
                     return std::vector<std::span<char>>{std::span<char>(laid)};
                   }});
    r.feed(bytes);
    header.emplace(r.finish());
    FUZZ_CHECK(r.laid_out(), "a destination was given but not used");
  } catch (const EntryError& e) {
    laid_error = e.what();
  }
  FUZZ_CHECK(whole.has_value() == header.has_value(),
             "whole vs laid out disagree: '" + whole_error + "' vs '" + laid_error + "'");
  if (!whole) return 0;
  FUZZ_CHECK(header->token_ids == whole->token_ids && header->geometry == whole->geometry &&
                 header->model_fingerprint == whole->model_fingerprint && header->linear.empty(),
             "laid-out header");
  FUZZ_CHECK(size >= laid.size() + 8 && bytes.substr(size - 8 - laid.size(), laid.size()) == laid,
             "laid-out tensors differ from the input's");
  for (const SegmentEntry* e : {&*whole, &*streamed}) {
    e->check_consistent();
    FUZZ_CHECK(e->byte_size() == size, "byte_size");
    FUZZ_CHECK(serialize_entry(*e) == bytes, "serialize(deserialize(x)) != x");
  }
  return 0;
}
