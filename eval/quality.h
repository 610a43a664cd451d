// Answer-quality benchmark of the splice modes against full recomputation (DESIGN.md 3.4) over a dataset of
// multi-document prompts with known answers, on the CPU engine (Model, splice). hypic-eval --dataset runs it; the
// tests check its identities.
//
// Dataset: JSON Lines, one prompt per line (blank lines are skipped, unknown fields ignored):
//   {"id": str, "kind": str (e.g. "one_hop", "two_hop", "recall"), "documents": [str, ...] (prompt order, each one
//    segment), "query": str, "answer": str (the expected completion, e.g. " 4821"),
//    "warm_order": [int, ...] (optional: a permutation of the document indices, the order of an earlier request that
//    warmed the prefix cache; default: reversed order)}
// Every document, the query and the answer are tokenised on their own with add_special_tokens=false, as the router
// does (Tokenizer::encode(text, false)). The end of an answer is the tokenizer's "<|endoftext|>" token.
//
// Per prompt and per mode (full, the reference, always; then prefix, naive, naive_local, transition,
// transition_local, hypic_w<w> for each seam width w; see quality_modes):
//  - exact match: the greedy continuation (argmax, lowest id on ties) of at most max_new_tokens tokens, cut before
//    "<|endoftext|>", decoded and stripped of leading/trailing ASCII whitespace, equals the stripped answer;
//  - KL(full || mode) on the answer: the answer's k tokens are teacher-forced, then "<|endoftext|>" is the target;
//    the k + 1 next-token distributions (at the last query position and after each answer token) of the mode vs
//    those of full; their mean, and the fraction of positions where both argmaxes agree (answer top-1 agreement);
//  - per linear layer, the relative error of the state after the last segment vs full's (state_rel_errors);
//  - tokens computed, prompt tokens and the splice's seconds.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/cpu/model.h"
#include "engine/cpu/splice.h"
#include "tokenizer/tokenizer.h"

namespace hypic::engine {

// ---- measures shared with hypic-eval's single-prompt comparison -----------------------------------------

/// KL(p || q) in nats of the softmax distributions of two logit vectors [V] (softmax in double, max-subtracted;
/// terms with p_i = 0 contribute 0, q_i is floored at 1e-300). Throws std::invalid_argument when the sizes differ
/// or are 0.
double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits);

/// Per layer, ||mine - ref||_2 / ||ref||_2 (||ref||_2^2 floored at 1e-300). `mine` and `ref` hold one
/// tensor per layer (e.g. SpliceResult::context_states). Throws std::invalid_argument when the layer counts or a
/// layer's sizes differ.
std::vector<double> state_rel_errors(const std::vector<std::vector<float>>& mine,
                                     const std::vector<std::vector<float>>& ref);

/// Greedy decoding from a spliced (or prefilled) state.
struct GreedyResult {
  std::vector<int32_t> ids;  ///< generated tokens, the stop token excluded
  bool stopped = false;      ///< the stop token was generated (else max_new_tokens were)
};
/// Generates at most max_new_tokens tokens: the first is argmax(first_logits) (lowest id on ties), each next one
/// the argmax of Model::decode of the previous at positions position, position + 1, ...; generating stop_id ends
/// it (stop_id < 0: never). `state` is consumed (pass a copy to keep yours). Throws std::invalid_argument for NaN
/// logits (sampling.h argmax) and whatever Model::decode throws.
GreedyResult greedy_decode(const Model& model, ModelState state, std::span<const float> first_logits,
                           int64_t position, int max_new_tokens, int32_t stop_id = -1);

/// Teacher forcing: the next-token logits [V] at the state's end (`first_logits`, copied) and after each of
/// `forced` fed at positions position, position + 1, ...: forced.size() + 1 vectors. `state` is consumed.
std::vector<std::vector<float>> teacher_forced_logits(const Model& model, ModelState state,
                                                      std::span<const float> first_logits, int64_t position,
                                                      std::span<const int32_t> forced);

// ---- dataset ------------------------------------------------------------------------------------------

/// One prompt of a dataset (texts as in the file).
struct QualityPrompt {
  std::string id;
  std::string kind;                    ///< groups accuracy (e.g. "one_hop")
  std::vector<std::string> documents;  ///< in prompt order; each one segment
  std::string query;
  std::string answer;                  ///< the expected completion text
  std::vector<int> warm_order;         ///< permutation of 0..documents.size()-1 (the loader fills the default)
  int line = 0;                        ///< 1-based line in the dataset file; 0 when not read from one
};

/// Parses JSON Lines text (see the file comment). `origin` prefixes error messages (e.g. the file name).
/// Throws std::invalid_argument naming the line and the field, e.g. "data.jsonl line 3: field 'documents':
/// missing", for invalid JSON, a line that is not an object, a missing or mistyped field, an empty "documents"
/// array, an empty document or query, or a "warm_order" that is not a permutation of the document indices.
std::vector<QualityPrompt> parse_quality_dataset(std::string_view jsonl, std::string_view origin = "dataset");
/// Reads and parses a dataset file. Throws std::runtime_error if it cannot be read, else as parse_quality_dataset.
std::vector<QualityPrompt> load_quality_dataset(const std::filesystem::path& path);

/// A shard of a dataset: the prompts whose index % count == index.
struct QualityShard {
  int index = 0;
  int count = 1;
};
/// Parses "I/N" (0 <= I < N). Throws std::invalid_argument naming the text otherwise.
QualityShard parse_quality_shard(std::string_view text);
/// Dataset indices a run evaluates, ascending: among the first `limit` prompts (0 = all), those of the shard.
/// Throws std::invalid_argument for a shard with count < 1 or index outside [0, count).
std::vector<size_t> select_quality_prompts(size_t num_prompts, size_t limit, QualityShard shard);

// ---- evaluation ---------------------------------------------------------------------------------------

/// What to run.
struct QualityOptions {
  /// Modes besides full (which is always run, first): any of Prefix, Naive, Transition, Hypic; Full is ignored,
  /// duplicates are dropped; they run in the order of quality_modes.
  std::vector<SpliceMode> modes = {SpliceMode::Prefix, SpliceMode::Naive, SpliceMode::Transition, SpliceMode::Hypic};
  std::vector<int> seam_widths = {0, 2, 4, 8, 16, 32};  ///< w of each hypic_w<w> mode, in tokens (>= 0)
  int max_new_tokens = 24;                              ///< greedy continuation limit, tokens (>= 0)
  size_t prefix_cache_bytes = size_t(8) << 30;          ///< budget of each prompt's own PrefixStateCache
  /// Also run naive_local after naive and transition_local after transition (where those are asked for): the same
  /// modes with SpliceRequest::local_positions, every segment's K (and Ring-linear's linear states) left at its
  /// local positions, as the reference implementation's `addition` and `transition` modes are taken to leave it.
  /// naive_local stands for the paper's Naive Addition baseline; against naive it shows what the RoPE fix is worth,
  /// naive against transition what T_C is worth. For a family with no RoPE (Kimi-Linear) the _local rows repeat
  /// naive's and transition's.
  bool local_position_ablations = true;
  /// Query-aware refresh (SpliceRequest::refresh_segments): for each k here (>= 1), a mode hypic_w<w>_r<k> at
  /// w = refresh_seam_width that recomputes the k segments the query attends to most. Empty = none.
  std::vector<int> refresh_counts;
  /// The refresh's tail (SpliceRequest::refresh_tail): for each t here (>= 1), a mode hypic_w<w>_t<t> (the last t
  /// segments recomputed whole, no probe) and, for each k of refresh_counts, hypic_w<w>_r<k>_t<t>. Empty = none.
  std::vector<int> refresh_tails;
  int refresh_seam_width = 8;  ///< w of the hypic_w<w>_r<k> / _t<t> modes, tokens (>= 0)
};

/// One evaluated mode: its name ("full", "prefix", "naive", "naive_local", "transition", "transition_local",
/// "hypic_w8", "hypic_w8_r2"), how it splices, the w of the entries it uses (hypic: its seam width; naive and
/// transition: 0; full and prefix use none: 0), whether it leaves K at local positions
/// (SpliceRequest::local_positions), how many segments it refreshes (SpliceRequest::refresh_segments) and how many
/// at the end of the prompt (SpliceRequest::refresh_tail).
struct QualityMode {
  std::string name;
  SpliceMode mode = SpliceMode::Full;
  int seam_width = 0;
  bool local_positions = false;
  int refresh_segments = 0;
  int refresh_tail = 0;
};
/// The modes `options` asks for, full first, then prefix, naive, naive_local, transition, transition_local (the
/// _local ones with local_position_ablations), hypic_w<w> in seam_widths order (repeated widths once) and
/// hypic_w<refresh_seam_width>_r<k> in refresh_counts order (repeats once; with Hypic asked for), then for each t of
/// refresh_tails (repeats once) hypic_w<refresh_seam_width>_t<t> and hypic_w<refresh_seam_width>_r<k>_t<t>.
/// Throws std::invalid_argument for a negative seam width, max_new_tokens < 0, Hypic with no seam width, or a
/// refresh count or refresh tail < 1.
std::vector<QualityMode> quality_modes(const QualityOptions& options);

/// The id of "<|endoftext|>"; throws std::invalid_argument if the tokenizer lacks it.
int32_t end_of_text_id(const Tokenizer& tokenizer);

/// One mode on one prompt.
struct ModeOutcome {
  std::string mode;                   ///< QualityMode::name
  bool exact_match = false;
  std::vector<int32_t> generated_ids; ///< greedy continuation, "<|endoftext|>" excluded
  bool stopped = false;               ///< the continuation ended with "<|endoftext|>"
  std::string generated_text;         ///< decoded generated_ids (ids the tokenizer lacks: U+FFFD), unstripped
  double answer_kl = 0;               ///< mean KL(full || mode) over the answer_positions distributions, nats
  std::vector<double> position_kl;    ///< [answer_positions] KL per teacher-forced position
  std::vector<bool> position_top1;    ///< [answer_positions] the mode's argmax equals full's there
  double answer_top1 = 0;             ///< fraction of those positions where the mode's argmax equals full's
  std::vector<double> state_rel_err;  ///< [linear layers] state after the last segment vs full's
  int64_t computed_tokens = 0;        ///< SpliceResult::computed_tokens
  int64_t prompt_tokens = 0;          ///< documents + query, tokens
  int prefix_segments_reused = 0;     ///< prefix mode: leading segments restored from the warmed cache
  std::vector<int> recomputed_segments;  ///< hypic: the segments recomputed whole (SpliceResult::recomputed_segments)
  double seconds = 0;                 ///< wall time of the splice call (not the entry builds, the prefix warm-up,
                                      ///< nor the decoding)
};

/// One prompt: its token counts and every mode's outcome.
struct PromptOutcome {
  size_t index = 0;  ///< position in the dataset (0-based), the key for merging shards
  int line = 0;      ///< QualityPrompt::line
  std::string id, kind, answer;
  std::vector<int64_t> document_tokens;  ///< per document, tokens
  int64_t query_tokens = 0, answer_tokens = 0, prompt_tokens = 0;
  int answer_positions = 0;          ///< answer_tokens + 1 teacher-forced distributions
  double entry_build_seconds = 0;    ///< build_segment_entries for every document (one prefill each)
  std::vector<ModeOutcome> modes;    ///< in quality_modes order; modes[0] is full
};

/// Runs every mode on one prompt (`index`: its dataset position, recorded). Entries for all needed widths are
/// built once per document (build_segment_entries) and shared by naive, transition and hypic_w*. Prefix mode uses
/// a fresh PrefixStateCache warmed by a splice of the documents in warm_order with the query's first token as
/// query. Throws std::invalid_argument naming the prompt for a document or query with no tokens, and whatever
/// end_of_text_id, quality_modes, splice and decode throw.
PromptOutcome evaluate_prompt(const Model& model, const Tokenizer& tokenizer, const QualityPrompt& prompt,
                              const QualityOptions& options, size_t index = 0);

/// Aggregate of one mode over the evaluated prompts.
struct ModeSummary {
  std::string mode;
  size_t prompts = 0;
  double accuracy = 0;                           ///< mean exact match
  std::map<std::string, double> accuracy_by_kind;
  std::map<std::string, size_t> prompts_by_kind;
  size_t flips_right_to_wrong = 0;               ///< full right, this mode wrong
  size_t flips_wrong_to_right = 0;               ///< full wrong, this mode right
  double mean_kl = 0;                            ///< mean over prompts of ModeOutcome::answer_kl, nats
  double mean_answer_top1 = 0;                   ///< mean over prompts of ModeOutcome::answer_top1
  std::vector<double> mean_state_rel_err;        ///< [linear layers] mean over prompts
  double mean_computed_tokens = 0, mean_prompt_tokens = 0;  ///< tokens
  double total_seconds = 0;                      ///< sum of ModeOutcome::seconds
};

/// Aggregates per mode (in `modes` order) over `prompts` (each holding those modes, full first). Throws
/// std::invalid_argument when a prompt lacks a mode or holds them in another order. No prompts: zero counts.
std::vector<ModeSummary> summarize_quality(const std::vector<QualityMode>& modes,
                                           const std::vector<PromptOutcome>& prompts);

/// A run over some prompts of a dataset.
struct QualityReport {
  std::vector<QualityMode> modes;
  std::vector<PromptOutcome> prompts;  ///< in evaluation order (ascending dataset index)
  std::vector<ModeSummary> summary;    ///< per mode, in modes order
};

/// Called after each prompt: how many are done (1-based), how many there are, and the prompt's outcome.
using QualityProgress = std::function<void(size_t done, size_t total, const PromptOutcome& outcome)>;

/// Evaluates prompts[i] for each i of `indices` (e.g. select_quality_prompts) and summarises. Throws
/// std::out_of_range for an index past the dataset, else as evaluate_prompt.
QualityReport evaluate_quality(const Model& model, const Tokenizer& tokenizer,
                               const std::vector<QualityPrompt>& prompts, std::span<const size_t> indices,
                               const QualityOptions& options, const QualityProgress& progress = {});

/// JSON of a report: {"modes": [names in order], "summary": {mode name: to_json(ModeSummary)}, "prompts": [rows,
/// to_json(PromptOutcome)]}. The rows carry everything the summary is computed from, so the files of several
/// shards can be merged (by index) and summarised again.
nlohmann::json to_json(const QualityReport& report);
/// One row: every field of PromptOutcome under its own name, but "modes" is an object {mode name: every field of
/// ModeOutcome under its own name (mode included)}.
nlohmann::json to_json(const PromptOutcome& outcome);
/// Every field of ModeSummary under its own name (accuracy_by_kind and prompts_by_kind as objects by kind).
nlohmann::json to_json(const ModeSummary& summary);

}  // namespace hypic::engine
