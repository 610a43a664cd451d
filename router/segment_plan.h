// What the router plans for each segment of a request, decided once from the lookup's results: a pure function
// (no service state), so that every decision of who builds a segment starts here.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "engine/splice_mode.h"
#include "proto/rpc/status.h"

namespace hypic::router {

/// One segment's plan.
enum class SegmentRole {
  Warm,    ///< an entry exists (the segment cache or the chosen combine worker's tiers): fetched, not built
  Build,   ///< cold, the first of its digest: built now (by a scatter worker, or the combine worker without one)
  Repeat,  ///< the same digest as an earlier segment: uses that one's entry (or, if it is Whole, is whole too)
  Whole,   ///< cold and in the refresh's tail (hypic mode, refresh_tail): recomputed whole in context by the
           ///< splice, nothing built on the critical path (the combine worker builds it after the first token)
  InContext,  ///< full and prefix modes: no entries at all, the combine worker prefills the prompt
};

struct SegmentPlan {
  std::vector<SegmentRole> roles;                   ///< per segment, in prompt order
  std::vector<std::optional<uint32_t>> repeat_of;  ///< per segment: the earlier segment a Repeat uses
  std::vector<uint32_t> builds;                     ///< indices of the Build segments, ascending
};

/// The plan of a request of `digests.size()` segments (hits[i]: an entry was found for segment i, in the segment
/// cache or the chosen combine worker's tiers). Modes that splice no entries (full, prefix) plan every segment
/// InContext. Otherwise, in prompt order, with tail = the last refresh_tail segments in hypic mode (never segment 0;
/// none when refresh_tail is 0 or another mode): a digest seen before is a Repeat of its first segment unless that
/// one is Whole; a cold segment in the tail is Whole (so is a repeat of a Whole one, which lies in the tail too);
/// another cold first occurrence is Build; the rest are Warm. `building` (empty, or one per segment): the hit is
/// only a build in flight on the combine worker (ENTRY_TIER_BUILDING, in no cache or tier yet): such a segment counts
/// as cold in the tail, which recomputes it whole anyway (waiting for that build would only delay the request), and
/// as a hit elsewhere (the request joins the build). Throws std::invalid_argument when digests, hits and a non-empty
/// `building` differ in length or refresh_tail < 0.
SegmentPlan plan_segments(std::span<const rpc::Digest> digests, const std::vector<bool>& hits, engine::SpliceMode mode,
                          int refresh_tail, const std::vector<bool>& building = {});

}  // namespace hypic::router
