// Splice modes (DESIGN.md 3.4) and what every backend's splice shares: the mode names, the seam width a mode's
// entries are made with, and the exception of a cancelled splice. The CPU splice is engine/cpu/splice.h; the interface
// every backend implements is engine/backend.h.
#pragma once
#include <stdexcept>
#include <string_view>

namespace hypic::engine {

/// How a prompt of segments is assembled (DESIGN.md 3.4).
enum class SpliceMode {
  Full,        ///< one in-context prefill of the whole prompt, no cache (the quality reference)
  Prefix,      ///< reuse the longest cached chain of whole segments from the start, compute the rest in context
  Naive,       ///< S <- S + S(C|0): no transition, no seam (the strawman)
  Transition,  ///< exact composition S <- T_C S + S(C|0), seam w = 0
  Hypic,       ///< composition plus seam windows recomputed in context (the default)
};
/// "full" | "prefix" | "naive" | "transition" | "hypic".
const char* splice_mode_name(SpliceMode mode);
/// The seam width the entries a mode splices must have been made with (SegmentEntry::check_compatible's w): the
/// request's w for hypic, 0 for transition (it composes whole segments, T_C = T_int of a w = 0 entry; T_seam is not
/// stored), -1 (any) for naive (S(C|0) only) and for the modes without entries.
int entry_seam_width(SpliceMode mode, int seam_width);
/// Inverse of splice_mode_name; throws std::invalid_argument naming the unknown mode and the valid ones.
SpliceMode parse_splice_mode(std::string_view name);

/// Thrown by a splice whose cancel flag was set between two of its passes (SpliceRequest::cancel, SplicePlan::cancel).
class SpliceCancelled : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace hypic::engine
