// Building segment entries and splicing them into a prompt (DESIGN.md 3.2-3.4): the combine step.
#pragma once
#include <stdexcept>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "engine/cpu/model.h"
#include "engine/prefix_cache.h"
#include "engine/segment.h"
#include "engine/splice_mode.h"
#include "engine/splice_schedule.h"

namespace hypic::engine {

/// Standalone prefill of one segment at position 0 into its cache entry (DESIGN.md 3.2): the seam part
/// (first min(w, n) tokens) and the interior are run as two spans of one prefill; each span's T comes from the
/// chunked pass (capture_transitions), S(seam|0) is the state after the seam, and
/// S(interior|0) = S_end - T_int S(seam|0) (the affine map of the interior, exact in exact arithmetic).
/// T is in the family's compact form (linear_transition_kind: dense [H_v][d_k][d_k] for Gated DeltaNet and KDA, one
/// scalar per head [H_v] for lightning); the entry's format version is entry_format_version of its geometry (4 for
/// Qwen, 5 for the other families). K is kept at local positions 0..n-1, and so are the keys inside Ring-linear's
/// linear states (splice re-rotates them). The entry is stamped with the CPU backend's numerics ("cpu-fp32") and
/// fingerprint (model_fingerprint, engine/backend.h). Throws std::invalid_argument for an empty segment or w < 0;
/// PrefillCancelled when `cancelled` (asked before each decoder layer of the prefill) answers true.
SegmentEntry build_segment_entry(const Model& model, std::span<const int32_t> ids, int seam_width,
                                 const std::function<bool()>& cancelled = {});

/// Tokens of one forward pass of a CPU entry build (build_segment_entry cuts its prefill there, and at the seam): a
/// cancelled build stops within one pass's layer, and the cut is the same everywhere so that builds stay bit for bit
/// reproducible.
inline constexpr int kBuildPassTokens = 512;

/// The entries of one segment for several seam widths from ONE standalone prefill at position 0 (what an
/// evaluation comparing widths needs: one prefill per segment instead of one per width).
/// Returns one entry per element of `seam_widths`, in the order given (duplicates allowed, each its own copy),
/// entry i made for w = seam_widths[i]. The prefill runs as consecutive spans cut at the distinct breakpoints
/// min(w, n) strictly inside (0, n), sorted; after each span it records every linear layer's state and the span's
/// transition (compact form, as build_segment_entry). For each w, with s = min(w, n): S(seam|0) = the state at s (kept
/// when s > 0; T_seam is not kept, engine/segment.h), T_int = product of the spans after s (identity if none),
/// S(interior|0) = S_end - T_int S(seam|0) (zeros when n <= w); conv tail and attention K/V (local positions
/// 0..n-1) come from the end state and are the same for every w.
/// Cost: one prefill of n tokens (k + 1 spans for k breakpoints) plus at most k d_k x d_k products per head
/// and linear layer (dense families; scalar ones multiply one number per head); memory: the returned entries plus the k + 1 span transitions while building.
/// With one width it computes exactly what build_segment_entry does (that function calls this one); with several,
/// each entry equals build_segment_entry(model, ids, w) to fp32 rounding, not bit for bit (the chunked scan's chunk
/// boundaries fall elsewhere once a span starts at another breakpoint).
/// Throws std::invalid_argument for an empty segment or a negative w (naming it); an empty `seam_widths` gives {}.
std::vector<SegmentEntry> build_segment_entries(const Model& model, std::span<const int32_t> ids,
                                                std::span<const int> seam_widths);

/// One segment of a request: its token ids, and its entry (required by naive / transition / hypic; ignored by
/// full and prefix, which compute in context).
struct SpliceSegment {
  std::vector<int32_t> ids;
  std::shared_ptr<const SegmentEntry> entry;
};

/// Running model states checkpointed at segment ends, keyed by the digest of the whole token chain so far
/// (chain_digest, engine/splice_schedule.h): classic prefix caching for hybrid models (what SGLang and vLLM offer).
/// Byte budget with LRU eviction; thread-safe.
class PrefixStateCache {
 public:
  explicit PrefixStateCache(size_t budget_bytes) : cache_(budget_bytes) {}
  /// The state stored under `chain` (shared, immutable), made the most recently used; nullptr when absent.
  std::shared_ptr<const ModelState> get(const SegmentDigest& chain) { return cache_.get(chain); }
  /// Stores a copy (evicting least recently used states to stay within budget; a state larger than the
  /// budget is not stored).
  void put(const SegmentDigest& chain, const ModelState& state);
  size_t bytes() const { return cache_.bytes(); }
  size_t entries() const { return cache_.entries(); }

 private:
  PrefixCache<const ModelState> cache_;
};

/// Bytes of a model state (linear states, conv states, KV).
size_t model_state_bytes(const ModelState& state);

/// A prompt to splice: segments in order, then the query (never cached).
struct SpliceRequest {
  std::vector<SpliceSegment> segments;
  std::vector<int32_t> query;
  SpliceMode mode = SpliceMode::Hypic;
  int seam_width = 8;                 ///< w (hypic mode); entries must have been made with the same w
  bool all_query_logits = false;      ///< logits for every query position (evaluation), else the last only
  bool keep_context_state = false;    ///< copy each linear layer's state as it stands after the last segment
  /// Naive / transition only, an evaluation ablation: every later segment's cached K (and, for Ring-linear, its
  /// rotating linear states) stays at the local positions 0..n-1 it was computed at instead of being re-rotated to
  /// its real positions. The reference implementation's modes are named `addition`, `transition`,
  /// `transition_rope`, `transition_rope_recompute` (docs/research/hypic_and_pic_peers.md 1.10): by their names the
  /// RoPE fix comes only in `transition_rope`, so naive with this flag is taken for the paper's "Naive Addition"
  /// baseline. A no-op for families with no RoPE anywhere (Kimi-Linear). Slots and the query's positions stay
  /// real. splice() throws std::invalid_argument when it is set with another mode.
  bool local_positions = false;
  /// Hypic only: indices (into `segments`, each >= 1, any order, no repeats) of segments recomputed WHOLE in context
  /// instead of composed from their entries: such a segment runs like a seam window as long as itself (from the
  /// running state, attending to every cached token before it), so its KV and its effect on the linear states are
  /// those of full recomputation given what precedes it. Segment 0 is exact from its entry and cannot be listed.
  std::vector<int> recompute_segments;
  /// Hypic only, query-aware refresh: after the splice, the attention of the query's last token (the one whose
  /// logits give the first answer token) ranks the later segments (>= 1, not already in recompute_segments) by the
  /// mass it pays to their interior tokens, summed over every full-attention layer and head
  /// (PrefillOptions::attention_mass; choose_refresh_segments); the refresh_segments highest (ties to the earlier segment) are
  /// added to recompute_segments and the prompt is spliced again. This restores what position-independent segments
  /// cannot see, the tokens before them, where the query says it matters (a document that updates or refers to an
  /// earlier one: both the statement the query reads and the one it should read are attended, so k >= 2 is the
  /// useful setting). Costs one more splice pass plus the refreshed segments' tokens (SpliceResult::computed_tokens
  /// counts both passes). A segment-granular counterpart of CacheBlend's selective recompute
  /// (docs/research/hypic_and_pic_peers.md 1.5: on hybrids single tokens cannot be recomputed). 0 = off.
  int refresh_segments = 0;
  /// (Hypic: a segment recomputed whole in the final splice, by recompute_segments or the tail, may come without an
  /// entry, its ids alone; the refresh's probe then recomputes it whole too.)
  /// Hypic only, the tail of the refresh: the last refresh_tail segments (indices >= max(1, segments - t)) are
  /// recomputed whole in context, like recompute_segments, in the splice that gives the answer; refresh_segments
  /// chooses among the others (its probe pass leaves the tail cached, so the tail is computed once). What it
  /// repairs: a cached segment's tokens never saw the documents before it, and a model reads the order of documents
  /// at their boundaries, where a segment's seam reads the body before it. A refreshed segment in the middle of cached ones makes the segment after it look like
  /// the newest one to a trained model (measured, README "Answer quality"), so a question about the prompt's order
  /// ("which comes last", the newest tool result) needs the boundary into the last segment exact: t = 2 recomputes
  /// the last segment and the one before it. Costs those segments' tokens and no extra pass. 0 = off; t >= the later
  /// segments recomputes every one of them (full recomputation).
  int refresh_tail = 0;
  PrefixStateCache* prefix_cache = nullptr;  ///< prefix mode: where checkpoints are looked up and stored
  /// Set (by another thread) to stop the request: checked between two passes of the splice (the refresh's probe and
  /// the splice that follows it; the passes of a chunked prefill), the next of which is then not run
  /// (SpliceCancelled). Null: never cancelled.
  std::shared_ptr<const std::atomic<bool>> cancel;
  /// Chunked prefill (vLLM's and SGLang's, without mixing a pass with decode steps): when > 0, the spans run in
  /// context (every mode's: full and prefix modes' segments, hypic's seams and whole segments, the query unless
  /// all_query_logits) are packed into passes of at most this many tokens, a longer span cut, and between_passes runs
  /// between two passes of the splice (then the cancel check). Results agree with unchunked passes within fp32
  /// rounding (the chunked scan's boundaries move). 0: no cut.
  int64_t max_pass_tokens = 0;
  std::function<void()> between_passes;
  /// Called with each schedule the splice executes (the refresh's probe first, when one runs, then the answer's),
  /// before it runs (engine/splice_schedule.h): what a test compares across backends, or a trace records. Optional.
  std::function<void(const SpliceSchedule&)> on_schedule;
};

/// The assembled model state and the query logits.
struct SpliceResult {
  ModelState state;            ///< ready for Model::decode at position `num_tokens`
  std::vector<float> logits;   ///< [Tq][V] if all_query_logits, else [1][V] (the next-token logits)
  int64_t num_tokens = 0;      ///< prompt length (segments + query), the next decode position
  int64_t computed_tokens = 0; ///< tokens run through the model here (seams + query; everything for full)
  int prefix_segments_reused = 0;  ///< prefix mode: segments restored from the prefix cache
  /// hypic: the segments recomputed whole (recompute_segments, the refresh_tail ones and those refresh_segments
  /// chose), ascending
  std::vector<int> recomputed_segments;
  /// keep_context_state: per linear layer, S [H_v][d_k][d_v] after the last segment, before the query (the state
  /// composition produces; the query's own tokens then move every mode's state the same way).
  std::vector<std::vector<float>> context_states;
};

/// Splices a prompt (DESIGN.md 3.3) in the requested mode. The first segment's entry is used whole (exact at
/// position 0); each later segment's seam (first w tokens) is recomputed in context through every layer, its
/// interior composed (S <- T_int S + S_int, conv state <- conv tail) and its interior K re-rotated to real
/// positions; segments of at most w tokens are recomputed whole; then the query runs in context.
/// Families: K is re-rotated only where the attention has RoPE (not Kimi-Linear's MLA, whose K rows are its latent
/// and whose V rows are empty); V rows are EntryGeometry::v_dim() wide; for linear layers with RoPE (Ring-linear, Model::linear_states_rotate) every cached
/// state of a segment starting at real position b (S(C|0) in naive / transition mode, S(interior|0), whose keys
/// sit at local positions s..n-1, in hypic mode) is re-rotated on the key axis by b before it is folded in,
/// S(C|b) = R(b) S(C|0) (Model::rotate_linear_state, DESIGN.md 3.3; the scalar T commutes with R); the first
/// segment (b = 0) is used as cached. With request.local_positions (naive / transition only) neither K nor those
/// states are re-rotated: every segment is placed as if it started at 0.
/// recompute_segments / refresh_segments / refresh_tail (hypic) recompute chosen segments whole in context (see
/// their docs).
/// The request's shape is checked first (check_splice_shape, engine/splice_schedule.h), then the entries against the
/// model. Throws std::invalid_argument (no segments, empty segment, empty query, negative seam width, missing entry for a
/// cached mode, token ids differing from the entry's, local_positions with a mode other than naive or transition,
/// recompute_segments / refresh_segments / refresh_tail with a mode other than hypic, a recompute index out of
/// [1, segments) or repeated, refresh_segments < 0, refresh_tail < 0)
/// and EntryError (entry from another model, numerics (CPU: "cpu-fp32") or w).
SpliceResult splice(const Model& model, const SpliceRequest& request);

}  // namespace hypic::engine
