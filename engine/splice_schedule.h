// The splice planner every backend shares (DESIGN.md 3.3-3.4): what a splice does, decided once as data by code that
// knows no backend, no model and no tensor; each backend (the CPU splice, engine/cpu/splice.cpp; the CUDA backend,
// engine/cuda/cuda_splice.cpp) only executes the schedule it is given. In the manner of vLLM v1's SchedulerOutput,
// which the model runner executes.
//
// A schedule is a list of steps in prompt order; a step folds cached entries into the running state (at every layer,
// before the step's tokens run there), then runs one span of the prompt in context. Which segments fold where, which
// spans run, at which positions, which segments are recomputed whole, the refresh's probe and choice, and where prefix
// mode reuses and stores checkpoints are all decided here; how a fold or a pass is computed is the backend's.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine/segment.h"  // SegmentDigest
#include "engine/splice_mode.h"

namespace hypic::engine {

/// What a splice request looks like to the planner: sizes and flags, no tokens and no tensors.
struct SpliceShape {
  SpliceMode mode = SpliceMode::Hypic;
  int seam_width = 8;                  ///< w (hypic); transition splices w = 0 entries; naive any
  std::vector<int64_t> segment_tokens;  ///< tokens of each segment, in prompt order (each > 0)
  std::vector<char> has_entry;          ///< per segment: 1 when the request brings its entry
  int64_t query_tokens = 0;             ///< the query's tokens (> 0), run in context after every segment
  /// Naive / transition only (SpliceRequest::local_positions): every segment placed as if it started at 0.
  bool local_positions = false;
  std::vector<int> recompute_segments;  ///< hypic: segments (>= 1) recomputed whole (SpliceRequest)
  int refresh_segments = 0;             ///< hypic: the query-aware refresh's k (SpliceRequest)
  int refresh_tail = 0;                 ///< hypic: the last t segments recomputed whole (SpliceRequest)
};

/// One fold of a cached entry into the running state (DESIGN.md 3.3), applied at every layer:
///  - Install: S = S(C|0) (= T_int S(seam|0) + S(interior|0)), conv state = the tail, K/V rows [0, n) (segment 0,
///    at position 0, where its standalone prefill is exact);
///  - Naive: S <- S + S(C|base); Transition: S <- T_C S + S(C|base) (w = 0 entries: T_C = T_int); both with the conv
///    tail and K/V rows [0, n);
///  - Interior: S <- T_int S + S(interior|base), the conv tail, K/V rows [from, n) (hypic, after the seam).
/// K rows are re-rotated from local position j to base + j where the family's attention has RoPE, and rotating
/// linear states (Ring-linear) by base (Model::rotate_linear_state).
struct ScheduledFold {
  enum class Kind : uint8_t { Install, Naive, Transition, Interior };
  Kind kind = Kind::Install;
  int segment = 0;    ///< index into the request's segments (whose entry folds in)
  int from = 0;       ///< first token of the entry brought in: the seam length for Interior, else 0
  int64_t base = 0;   ///< where the segment's token 0 is placed: its real position (0 with local_positions)
  bool operator==(const ScheduledFold&) const = default;
};

/// One step: folds (in order), then the prompt's tokens at positions [position, position + tokens) run in context
/// (segments' tokens in prompt order, then the query's; a span may cross segment boundaries, as full mode's does).
struct ScheduledStep {
  std::vector<ScheduledFold> folds;
  int64_t position = 0;  ///< first prompt position of the span (its tokens' real positions)
  int64_t tokens = 0;    ///< span length in tokens (> 0)
  /// Prefix mode: the span is segment checkpoint_segment, after which the state may be stored as a checkpoint under
  /// the chain key of segments 0..checkpoint_segment (chain_digest; the backend decides whether its budget holds it).
  /// -1: no checkpoint.
  int checkpoint_segment = -1;
  bool operator==(const ScheduledStep&) const = default;
};

/// A splice as data: the steps one forward pattern runs, and what the request reports.
struct SpliceSchedule {
  SpliceMode mode = SpliceMode::Hypic;
  bool probe = false;               ///< the refresh's probe (its result is the query's attention mass only)
  std::vector<ScheduledStep> steps;  ///< non-empty; the last step's span is the query
  int prefix_reused = 0;             ///< prefix mode: segments 0..reused-1 restored from checkpoints first
  int64_t num_tokens = 0;            ///< prompt length (segments + query): the next decode position
  /// Tokens run through the model by this schedule, plus, for the answer after a probe, by the probe
  int64_t computed_tokens = 0;
  std::vector<int> recomputed_segments;  ///< hypic: segments recomputed whole, ascending
  bool operator==(const SpliceSchedule&) const = default;
};

/// The shape of a request of either form (engine/backend.h SplicePlan, engine/cpu/splice.h SpliceRequest: fields
/// mode, seam_width, query, recompute_segments, refresh_segments, refresh_tail, segments[i].ids / .entry, and
/// SplicePlan's segments[i].block, which brings an entry as a host block): each segment's tokens are its ids, or its
/// entry's (block's) when the ids are omitted (0 when it has neither).
template <class Request>
SpliceShape shape_of_request(const Request& r) {
  SpliceShape shape;
  shape.mode = r.mode;
  shape.seam_width = r.seam_width;
  shape.query_tokens = int64_t(r.query.size());
  shape.recompute_segments = r.recompute_segments;
  shape.refresh_segments = r.refresh_segments;
  shape.refresh_tail = r.refresh_tail;
  for (const auto& seg : r.segments) {
    int64_t entry_tokens = seg.entry ? int64_t(seg.entry->num_tokens()) : 0;
    bool has = bool(seg.entry);
    if constexpr (requires { seg.block; }) {  // SplicePlan: an entry may come as a pinned host block
      if (!has && seg.block) entry_tokens = int64_t(seg.block->num_tokens()), has = true;
    }
    shape.segment_tokens.push_back(seg.ids.empty() && has ? entry_tokens : int64_t(seg.ids.size()));
    shape.has_entry.push_back(has ? 1 : 0);
  }
  return shape;
}

/// Checks a shape against the rules every backend enforces, throwing std::invalid_argument naming what is wrong (the
/// messages start "splice: "): no segments, a segment or the query without tokens, a negative seam width,
/// local_positions with a mode other than naive / transition, check_recompute_request's rules, a segment without an
/// entry where needs_entry says one is required.
void check_splice_shape(const SpliceShape& shape);

/// Whether segment i must come with an entry: every segment in naive / transition / hypic, except (hypic) a segment
/// recomputed whole in the answer (recompute_segments or refresh_tail) that comes with its ids; never in full /
/// prefix.
bool needs_entry(const SpliceShape& shape, size_t i);

/// The schedule of the refresh's probe (SpliceRequest::refresh_segments), or an empty schedule (no steps) when the
/// request has no refresh or no segment could be refreshed (every later one already whole or no longer than w). The
/// probe recomputes the explicit recompute_segments whole and leaves the tail cached (so the tail is computed once),
/// except tail segments that came without an entry. Its executor returns the query's last token's attention mass
/// per KV row (PrefillOptions::attention_mass), which schedule_splice takes. The shape must have passed
/// check_splice_shape.
SpliceSchedule schedule_refresh_probe(const SpliceShape& shape);

/// The schedule that gives the answer. `prefix_reused`: prefix mode, the segments whose state the backend restores
/// from its checkpoints (the longest cached chain of segments from the start, keyed by chain_digest; 0..segments);
/// every later segment gets a checkpoint step. `probe` / `probe_mass`: the probe's schedule and the mass it measured (an empty
/// probe when none ran): the refresh chooses (choose_refresh_segments) among the segments not yet whole and adds
/// the probe's computed tokens. Steps by mode:
///  - full: one span of every segment, then the query;
///  - prefix: one span per segment from prefix_reused on (each a checkpoint step), then the query;
///  - naive / transition: the query span, preceded by folds of every segment (Install for segment 0);
///  - hypic: segment 0 installed; per later segment its seam window (the first min(w, n) tokens, all n when
///    recomputed whole) as a span, its interior folded before the next span; then the query.
SpliceSchedule schedule_splice(const SpliceShape& shape, int prefix_reused = 0, const SpliceSchedule& probe = {},
                               std::span<const float> probe_mass = {});

/// How a splice's entries brought as host blocks (engine/backend.h PlanSegment::block) lie in a device backend's
/// staging area (engine/cuda/cuda_splice.cpp Stager), decided from sizes alone. Folds are taken in the order the
/// schedule applies them; groups are consecutive runs of them, and a forward pass folds one group's entries only.
struct StagingLayout {
  int halves = 1;              ///< 1: the groups take turns in one area (each copy waited for); 2: group g in half g % 2
  size_t half_bytes = 0;       ///< bytes of one half: the largest group's entries
  int groups = 0;
  std::vector<int> group;      ///< per fold: its group (non-decreasing, from 0)
  std::vector<size_t> offset;  ///< per fold: its entry's offset in its half (bytes, each a multiple of kStagingAlign)
};
/// Alignment of entries in a staging area (bytes).
inline constexpr size_t kStagingAlign = 256;
/// Device memory a staged splice leaves free beside its staging area (bytes): its passes' other allocations. The
/// combine worker stages a request only where what is free holds its largest entry and this margin.
inline constexpr size_t kStagingMarginBytes = size_t(512) << 20;
/// Lays out the staged folds for a room of `room` bytes: `entry_bytes[i]` is fold i's entry (multiples of
/// kStagingAlign), `cost[i]` >= it that entry plus the scratch its fold takes in a pass beside the area. One group
/// when every cost fits in the room; else two halves when the room holds two of the largest cost (a group's cost at
/// most half the room, rounded down to kStagingAlign, and never below the largest cost); else one area of the room.
/// Throws std::invalid_argument when the spans differ in length, a cost is below its entry's bytes, an entry is not
/// aligned, or the room is below the largest cost.
StagingLayout layout_staging(std::span<const size_t> entry_bytes, std::span<const size_t> cost, size_t room);

/// Prefix mode's key of a chain of segments: XXH3-128 over the previous chain's key (all zero before the first
/// segment) then the segment's token ids (int32, host byte order). Two prompts share the checkpoint after segment i
/// exactly when their segments 0..i are the same token ids in the same order.
SegmentDigest chain_digest(const SegmentDigest& prev, std::span<const int32_t> ids);

/// Checks a request's recompute_segments / refresh_segments / refresh_tail (SpliceRequest, SplicePlan) against its
/// mode and its number of segments: all are hypic-only, indices lie in [1, num_segments) without repeats,
/// refresh_segments >= 0 and refresh_tail >= 0 (either may exceed the number of segments: it then takes them all).
/// Throws std::invalid_argument naming what is wrong. check_splice_shape calls it.
void check_recompute_request(SpliceMode mode, std::span<const int> recompute_segments, int refresh_segments,
                             int refresh_tail, size_t num_segments);

/// The segments recomputed whole before the refresh's choice, one flag per segment (1 = whole): those listed in
/// recompute_segments and the last refresh_tail ones (never segment 0); with refresh_tail = 0, those of the refresh's
/// probe pass. Indices must have passed check_recompute_request.
std::vector<char> whole_segments_before_refresh(std::span<const int> recompute_segments, int refresh_tail,
                                                size_t num_segments);

/// The query-aware refresh choice (SpliceRequest::refresh_segments): given the query's attention mass per KV row in
/// prompt order (`mass`, fp32 host, as PrefillOptions::attention_mass; rows past its end count 0), each segment's
/// length in tokens, the seam width w and which segments are already recomputed whole (`whole`, one flag per
/// segment), returns the indices (>= 1, ascending) of at most k segments not yet whole whose interior rows (from
/// start + min(w, n) to start + n) hold the most mass, ties (e.g. no measured attention: a model without
/// full-attention layers, or probabilities below fp32's range) to the earlier segment. Segments without an interior
/// (n <= w: the seam window already recomputes them whole) are never chosen, so k >= the later segments recomputes
/// every one of them: full recomputation.
std::vector<int> choose_refresh_segments(std::span<const float> mass, std::span<const int64_t> segment_tokens,
                                         int seam_width, std::span<const char> whole, int k);

}  // namespace hypic::engine
