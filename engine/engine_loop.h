// The engine loop (DESIGN.md section 4, "engine"): ONE thread owns a Backend and runs all of its work; gRPC
// handlers only enqueue and wait for callbacks (the pattern of TensorRT-LLM's executor, llama.cpp server's slots,
// vLLM's scheduler). Used by scatter workers (entry builds) and combine workers (builds, splices, decoding).
//
// Three kinds of work:
//  - entry builds: every queued build (same seam width, FIFO) up to a token budget goes into ONE
//    Backend::build_entries call (a varlen pass on CUDA); a build that asked for its wire form (BuildHandover::Wire)
//    is then copied to the host and serialized on the loop's egress thread, while the loop goes on with the next
//    batch; one that did not (BuildHandover::Resident) is handed over at once, resident, with no host copy at all;
//  - splices: a plan is executed (Backend::splice), optionally followed by decoding; a host entry given for several
//    segments of one plan (a segment repeated in the prompt) is imported once;
//  - decoding (continuous batching): every active sequence is stepped together in one Backend::decode call per
//    iteration; a sequence joins the batch after its splice and leaves when it reaches max_tokens, samples a stop
//    token, or its cancel flag is set. The loop samples (engine/sampling.h, one Sampler per request), so a handler
//    only receives token ids.
// A build whose cancel flag is set while its batch runs stops at the backend's next check (before a decoder layer), so a
// cancelled request's cold segments stop costing compute within about one layer.
// Decoding beside prefill: where the backend allows it (Backend::concurrent_decode, the CUDA backend: decode steps
// on a stream of the device's highest priority with buffers of their own), the running sequences are stepped on a
// decode thread of the loop's own, continuously, while the loop thread runs builds and splices: a prefill pass no
// longer stalls their inter-token latency, it only shares the GPU with them (a step beside a 2048-token pass takes
// about 1.8x its time alone, beside a 16k-token pass 3.7x: H200, 35B dimensions). A generation's first token comes
// from its splice on the loop thread, then the sequence joins the decode thread's batch.
// Otherwise (the CPU backend), fairness: each iteration runs one decode step of the whole batch, then one queued
// unit of other work (a build batch or a splice, alternating when both wait), so neither a long splice nor a long
// decode starves the other.
// Either way, while sequences decode a build batch is held to EngineLoopOptions::max_build_tokens_decoding tokens and
// a splice runs in passes of at most max_pass_tokens_decoding tokens (chunked prefill), with a decode step of the
// batch between two passes where decoding is not concurrent. Background builds (BuildSubmission::background: nobody
// waits for them yet) run only when no splice and no other build waits, in batches of that smaller size.
//
// Callbacks run on the loop thread (those of BuildHandover::Wire builds that were built: on its egress thread; a
// generation's tokens after its first and its end, with a concurrent decode: on the decode thread): they must be
// quick and must not call back into the loop's waiting operations (push into a queue and notify). Every job gets
// exactly one final callback (done / on_end).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/backend.h"
#include "engine/sampling.h"

namespace hypic::engine {

/// Set to true to cancel a job: a queued job is skipped, a decoding sequence leaves the batch at the next step.
using CancelFlag = std::shared_ptr<const std::atomic<bool>>;

/// How a job failed, for the services' status codes.
enum class EngineErrorKind {
  None,
  InvalidArgument,    ///< std::invalid_argument: a bad request (INVALID_ARGUMENT)
  Entry,              ///< EntryError: an entry of another model / numerics / w, or corrupt (DATA_LOSS / INVALID_ARGUMENT)
  ResourceExhausted,  ///< ResourceExhausted: a memory budget (RESOURCE_EXHAUSTED)
  Internal,           ///< anything else (INTERNAL)
};

/// What a finished build hands over (EngineLoop::submit_build).
enum class BuildHandover {
  /// The resident entry alone, on the loop thread right after its batch: the caller splices it as it is (on CUDA it
  /// stays in device memory) and makes any host copy itself, off the critical path.
  Resident,
  /// Also its wire form (host, bytes), made on the loop's egress thread (a device-to-host copy and a serialization:
  /// hundreds of ms for a 280 MB entry) while the loop computes the next batch.
  Wire,
};

/// Outcome of one entry build.
struct BuildOutcome {
  std::shared_ptr<const ResidentEntry> entry;   ///< resident on the loop's backend; null if cancelled or failed
  /// BuildHandover::Wire on a backend whose entries live in host memory: entry->host(); null otherwise (for a device
  /// backend the wire form is written straight from the entry's device copy, Backend::wire_of).
  std::shared_ptr<const SegmentEntry> host;
  std::shared_ptr<const std::string> bytes;     ///< BuildHandover::Wire: Backend::wire_of(*entry); null for Resident
  double queue_ms = 0;     ///< from submit_build to the start of its batch
  /// Its share of the batch: batch_ms * its tokens / the batch's tokens (plus, for Wire, its host copy and
  /// serialization).
  double compute_ms = 0;
  double batch_ms = 0;     ///< the whole Backend::build_entries call it was part of
  int batch_segments = 0;  ///< segments in that call
  /// Skipped or stopped: its cancel flag was set (or the loop stopped) before its batch started, or while the batch
  /// ran (Backend::build_entries asks between layers; entry null).
  bool cancelled = false;
  EngineErrorKind error_kind = EngineErrorKind::None;
  std::string error;       ///< non-empty if the build failed (the exception's message)
};

/// A splice to run: the plan, plus host entries for the segments whose plan entry is null (imported into the
/// backend on the loop thread first, Backend::import_entry; their EntryError fails the job).
struct SpliceJob {
  SplicePlan plan;
  std::vector<std::shared_ptr<const SegmentEntry>> host_entries;  ///< empty, or one per plan segment (null = none)
};

/// What a splice reports.
struct SpliceInfo {
  double queue_ms = 0;   ///< waiting in the splice queue
  double splice_ms = 0;  ///< entry imports + Backend::splice
  int64_t num_tokens = 0, computed_tokens = 0;
  int prefix_segments_reused = 0;
  std::vector<int> recomputed_segments;  ///< hypic: segments recomputed whole (SpliceOutput), ascending
  /// Chunked prefill: pauses between this splice's passes (a decode step of the running sequences in each, if any
  /// and the backend has no concurrent decode; included in splice_ms).
  int passes_paused = 0;
  /// Segments brought in as pinned host blocks and staged group by group (SpliceOutput::staged_segments,
  /// staged_groups, staging_bytes).
  int staged_segments = 0, staged_groups = 0;
  size_t staging_bytes = 0;
  /// Per plan segment, the entry imported from SpliceJob::host_entries (null where none was): callers may keep
  /// them (resident on the backend) to splice again without another import.
  std::vector<std::shared_ptr<const ResidentEntry>> imported;
};

/// Outcome of submit_splice: the SpliceOutput (its sequence belongs to the loop's backend: with a backend that is
/// not thread-safe, use it only through this loop or after stop()).
struct SpliceOutcome {
  SpliceOutput output;
  SpliceInfo info;
  bool cancelled = false;
  EngineErrorKind error_kind = EngineErrorKind::None;
  std::string error;
};

/// Why a generation ended.
enum class GenerateEndReason { Length, StopToken, Cancelled, Failed };

/// The final callback of a generation.
struct GenerateEnd {
  GenerateEndReason reason = GenerateEndReason::Length;
  int tokens = 0;  ///< tokens produced (on_token calls)
  EngineErrorKind error_kind = EngineErrorKind::None;
  std::string error;  ///< Failed: the message; Cancelled: who cancelled (caller or loop stop)
};

/// A generation: splice, then sample and decode in the shared batch.
struct GenerateJob {
  SpliceJob splice;
  SamplingConfig sampling;  ///< validated by Sampler's constructor (a bad one fails the job)
  int max_tokens = 1;       ///< >= 1 tokens to produce (the first comes from the splice's logits)
  CancelFlag cancel;
  std::function<void(const SpliceInfo&)> on_spliced;  ///< optional: after the splice, before the first token
  std::function<void(int32_t token)> on_token;        ///< each sampled token, in order (a stop token included)
  std::function<void(const GenerateEnd&)> on_end;     ///< exactly once, last
};

/// Options of the loop.
struct EngineLoopOptions {
  /// Most tokens of one build_entries call (a single longer segment still runs, alone). >= 1.
  int64_t max_build_tokens = 16384;
  /// The same while sequences are decoding (min with max_build_tokens): queued builds then go in smaller batches with
  /// a decode step of the running sequences between two, so that a burst of cold segments does not stall their
  /// inter-token latency for a whole large batch (vLLM's and SGLang's chunked prefill, at the granularity of whole
  /// segments; each build's entry is the same whatever batch it is in). Where decode steps run beside the builds
  /// (Backend::concurrent_decode) the smaller batches slow the steps less. >= 1.
  int64_t max_build_tokens_decoding = 2048;
  /// Chunked prefill of splices: while sequences are decoding, no forward pass of a splice runs more than this many
  /// tokens, and the decoding sequences take one step between two of its passes (SplicePlan::max_pass_tokens,
  /// between_passes), so a long prompt's prefill stalls their inter-token latency for one pass, not for its whole
  /// length (the splice's cancel flag is checked there too). Costs the splice some speed (smaller passes) only while
  /// others decode. Where decode steps run beside the passes (Backend::concurrent_decode), no step waits for a pass
  /// and smaller passes slow them less. 0 = splices are never cut. >= 0.
  int64_t max_pass_tokens_decoding = 2048;
  /// The same when nothing decodes: it bounds how far a cancelled (or expired) request's prefill runs past its
  /// cancellation (one pass). 0 = passes as large as the backend allows (CUDA: max_batch_tokens). >= 0.
  int64_t max_pass_tokens = 0;
  /// TESTING ONLY: each build (per segment) first sleeps this long, as part of its run (its cancel flag was read
  /// at the start of its batch, so the sleep is like a longer build: it is not skipped), to widen fault-injection
  /// windows and to stand in for a long build.
  std::chrono::milliseconds inject_delay{0};
};

class EngineLoop {
 public:
  /// Starts the loop thread. `backend` must outlive the loop; nothing else may call it while the loop runs.
  /// Throws std::invalid_argument for max_build_tokens < 1.
  EngineLoop(Backend& backend, EngineLoopOptions options = {});
  /// Calls stop().
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  /// Finishes the work in progress (the current build batch, splice or decode step), then reports every queued
  /// build and splice cancelled and ends every decoding sequence (GenerateEndReason::Cancelled, "engine loop
  /// stopped"), and joins the thread (all callbacks have run when it returns). Idempotent. Jobs submitted after it
  /// are reported cancelled at once, on the caller's thread.
  void stop();
  /// True once stop() has begun (a build submitted now is reported cancelled at once). Thread-safe.
  bool stopping() const { return stopping_.load(); }

  /// The backend's immutable facts (config, device, numerics, fingerprint) are safe to read from any thread.
  const Backend& backend() const { return backend_; }

  /// Queues a standalone build of `ids` (entry made with seam width `seam_width`); `done` runs on the loop thread, or
  /// for a Wire build that was built, on the egress thread once its wire form is made.
  /// `cancel` drops it while it is queued and, unless `stop` is given, stops it while it runs (within about a layer,
  /// Backend::build_entries); with `stop`, only `stop` stops a running build (a build whose entry is still wanted
  /// for the cache once its requests are gone runs on while `cancel` alone is set).
  void submit_build(std::vector<int32_t> ids, int seam_width, CancelFlag cancel,
                    std::function<void(BuildOutcome)> done, BuildHandover handover = BuildHandover::Wire,
                    CancelFlag stop = nullptr);
  /// One build of submit_builds.
  struct BuildSubmission {
    std::vector<int32_t> ids;
    int seam_width = 0;
    CancelFlag cancel;
    std::function<void(BuildOutcome)> done;
    BuildHandover handover = BuildHandover::Wire;
    CancelFlag stop;  ///< as submit_build's
    /// Set (true): background work, a build no request waits for yet (a combine worker's entries built after a
    /// request's first token, for later requests): it waits while any splice or other build is queued, and goes in
    /// batches of at most max_build_tokens_decoding tokens (a longer single build alone), so that a request arriving
    /// meanwhile waits for one such batch at most. Cleared by whoever comes to wait for it (read when the loop picks
    /// its next batch). Null: not background.
    CancelFlag background;
  };
  /// Queues several builds at once, so that they go into one batch (up to the token budget) rather than the first
  /// alone when the loop wakes up between two submit_build calls. Each as submit_build.
  void submit_builds(std::vector<BuildSubmission> builds);
  /// Queues a splice whose result (sequence included) is handed to `done` (evaluation, tests).
  void submit_splice(SpliceJob job, CancelFlag cancel, std::function<void(SpliceOutcome)> done);
  /// Queues a generation (splice, then decoding in the batch). Callbacks as GenerateJob says.
  void submit_generate(GenerateJob job);

  /// Tokens of builds queued or being computed (what a worker reports for LPT scheduling).
  int64_t queued_tokens() const { return queued_tokens_.load(); }
  /// Tokens of the background builds queued now (BuildSubmission::background set), not yet in a batch.
  int64_t background_tokens() const;
  /// Sequences decoding now.
  int active_sequences() const { return active_count_.load(); }
  /// Decode iterations run and sequence-steps in them (mean batch = steps / iterations).
  uint64_t decode_iterations() const { return decode_iterations_.load(); }
  uint64_t decode_steps() const { return decode_steps_.load(); }
  /// Backend::build_entries calls made.
  uint64_t build_batches() const { return build_batches_.load(); }

 private:
  using Clock = std::chrono::steady_clock;
  struct BuildJob {
    std::vector<int32_t> ids;
    int seam_width;
    CancelFlag cancel;
    std::function<void(BuildOutcome)> done;
    Clock::time_point queued_at;
    BuildHandover handover = BuildHandover::Wire;
    CancelFlag stop;  // stops it while it runs (null: cancel does)
    CancelFlag background;  // BuildSubmission::background
    bool in_background() const { return background && background->load(); }
  };
  struct Egress {  // a built Wire job whose wire form is still to be made
    BuildOutcome outcome;
    std::function<void(BuildOutcome)> done;
    int64_t tokens;
  };
  void run_egress();
  struct SpliceTask {  // a plain splice (done set) or a generation (gen set)
    SpliceJob job;
    CancelFlag cancel;
    std::function<void(SpliceOutcome)> done;
    std::shared_ptr<GenerateJob> gen;
    Clock::time_point queued_at;
  };
  struct Active {
    std::shared_ptr<GenerateJob> gen;
    std::unique_ptr<Sequence> sequence;
    std::unique_ptr<Sampler> sampler;
    int32_t next_token = 0;  // sampled, not yet consumed by decode
    int produced = 0;
  };

  void run();
  void run_builds(std::vector<BuildJob> batch);
  void run_splice(SpliceTask task);
  /// One step of active_ (on the loop thread, or with concurrent_ on the decode thread, which owns active_ then).
  void decode_step();
  /// The decode thread (concurrent_): takes the sequences joining_, steps active_ while it is not empty.
  void run_decode();
  /// Ends every sequence of active_ as Cancelled (the loop stopping).
  void end_active(const char* why);
  /// active_count_ = active_ (+ joining_ with concurrent_).
  void publish_active_count();
  /// Every change of active_count_: sets or adds, then (concurrent_) passes the count to
  /// Backend::set_decoding_sequences.
  void set_active(int n);
  void add_active(int delta);
  void tell_backend();
  /// Whether sequences are decoding (the loop thread's view: active_, or with concurrent_ the published count).
  bool decoding() const { return concurrent_ ? active_count_.load() > 0 : !active_.empty(); }
  /// Delivers a sampled token; true if the sequence ends here (stop token or max_tokens). `counted`: the sequence is
  /// in active_count_, which drops by one before its on_end runs.
  bool emit(Active& a, int32_t token, bool counted);
  static bool is_cancelled(const CancelFlag& c) { return c && c->load(); }

  Backend& backend_;
  EngineLoopOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<BuildJob> builds_;
  std::deque<SpliceTask> splices_;
  bool stop_ = false;
  bool builds_turn_ = true;  // alternation between the two queues
  const bool concurrent_;  // backend_.concurrent_decode(): decode steps run on decode_thread_
  std::vector<Active> active_;  // the thread that decodes only (the loop thread, or decode_thread_)
  std::mutex dec_mu_;
  std::condition_variable dec_cv_;
  std::vector<Active> joining_;  // concurrent_: spliced (first token out), for decode_thread_ to take; under dec_mu_
  bool dec_stop_ = false;        // under dec_mu_
  std::atomic<int64_t> queued_tokens_{0};
  std::atomic<int> active_count_{0};
  std::mutex hint_mu_;  // orders Backend::set_decoding_sequences calls (tell_backend)
  std::atomic<uint64_t> decode_iterations_{0}, decode_steps_{0}, build_batches_{0};
  std::atomic<bool> stopping_{false};
  std::mutex egress_mu_;
  std::condition_variable egress_cv_;
  std::deque<Egress> egress_;
  bool egress_stop_ = false;
  std::thread thread_, egress_thread_, decode_thread_;
};

/// The EngineErrorKind of an exception.
EngineErrorKind classify_engine_error(const std::exception_ptr& e);

}  // namespace hypic::engine
