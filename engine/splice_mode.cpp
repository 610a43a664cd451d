// Splice mode names (engine/splice_mode.h), in hypic_engine_base (the router parses modes without the model runtime).
#include <stdexcept>
#include <string>

#include "engine/splice_mode.h"

namespace hypic::engine {

const char* splice_mode_name(SpliceMode mode) {
  switch (mode) {
    case SpliceMode::Full: return "full";
    case SpliceMode::Prefix: return "prefix";
    case SpliceMode::Naive: return "naive";
    case SpliceMode::Transition: return "transition";
    case SpliceMode::Hypic: return "hypic";
  }
  return "unknown";
}

SpliceMode parse_splice_mode(std::string_view name) {
  for (SpliceMode m : {SpliceMode::Full, SpliceMode::Prefix, SpliceMode::Naive, SpliceMode::Transition,
                       SpliceMode::Hypic})
    if (name == splice_mode_name(m)) return m;
  throw std::invalid_argument("unknown splice mode '" + std::string(name) +
                              "' (expected full, prefix, naive, transition or hypic)");
}

int entry_seam_width(SpliceMode mode, int seam_width) {
  switch (mode) {
    case SpliceMode::Hypic: return seam_width;
    case SpliceMode::Transition: return 0;
    default: return -1;
  }
}

}  // namespace hypic::engine
