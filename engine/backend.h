// One engine interface, two backends (DESIGN.md section 4, "engine"): the CPU fp32 backend (development, CI,
// the numerical reference; engine/cpu) and the CUDA bf16 backend (serving; engine/cuda). The services call
// only this interface; which backend runs is a DeviceSpec ("cpu", "cuda", "cuda:N").
//
// What lives where:
//  - a Sequence (one request's running state: linear states, conv states, KV cache) lives where the backend
//    computes: host memory for the CPU backend, device memory for CUDA;
//  - a ResidentEntry (a segment's cache entry, DESIGN.md 3.2) likewise; it crosses to the host only at the wire
//    and the cache (ResidentEntry::host(), Backend::import_entry);
//  - logits come back to the host as fp32 (sampling runs on the host).
// A splice is data (SplicePlan: which entries, which segments, which mode), executed by Backend::splice; the
// request path is plan, then execute, inside one backend.
//
// Numerics and fingerprints: entries made by one numerics (e.g. "cuda-bf16") are never spliced by another
// ("cpu-fp32"). Backend::fingerprint() = model_fingerprint(config, numerics) is what entries, digests and worker
// identities carry, so a mismatch is an EntryError naming both.
//
// Threading: a Backend is driven by ONE thread, its engine loop (engine/engine_loop.h); the CPU backend is also
// safe to call from several threads at once, the CUDA backend is not, except that its decode() may run on a second
// thread beside the others (Backend::concurrent_decode).
//
// Headers: this interface includes no backend and no model runtime: only the config, the entry format, the host state
// layout (engine/model_state.h), the splice modes (engine/splice_mode.h) and the splice planner
// (engine/splice_schedule.h, which every backend executes), so that the services that only plan
// (the router) compile without the CPU model (engine/cpu/model.h) or the CPU splice (engine/cpu/splice.h).
#pragma once
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/model_state.h"
#include "engine/segment.h"
#include "engine/splice_mode.h"
#include "engine/splice_schedule.h"

namespace hypic::engine {

/// Which implementation computes.
enum class BackendKind { Cpu, Cuda };

/// A compute device: "cpu", "cuda" (= "cuda:0") or "cuda:N".
struct DeviceSpec {
  BackendKind kind = BackendKind::Cpu;
  int index = 0;  ///< CUDA device ordinal (0 for cpu)
  /// Parses the spellings above; throws std::invalid_argument naming the text and the accepted forms.
  static DeviceSpec parse(std::string_view text);
  /// "cpu" or "cuda:N".
  std::string name() const;
  bool operator==(const DeviceSpec&) const = default;
};

/// Numerics tag of a backend: "cpu-fp32" or "cuda-bf16" (goes into the fingerprint and the entry header).
const char* backend_numerics(BackendKind kind);

/// The fingerprint entries are made and checked under: XXH3-128 hex over (ModelConfig::fingerprint(), numerics).
std::string model_fingerprint(const ModelConfig& config, std::string_view numerics);

/// One request's running model state, resident where its backend computes. Made by Backend::splice, advanced by
/// Backend::decode, released by destruction (returns its KV pages / memory to the backend's pools). Must not
/// outlive its backend.
class Sequence {
 public:
  virtual ~Sequence() = default;
  /// Tokens consumed so far: the position of the next decode step.
  virtual int64_t num_tokens() const = 0;
  /// Bytes it holds (linear and conv states, KV cache), wherever they live.
  virtual size_t bytes() const = 0;
  /// A host copy in the CPU layout (engine/model_state.h ModelState: fp32, K rotated at real positions), for tests
  /// and evaluation. Costs a device-to-host copy on CUDA.
  virtual ModelState to_host() const = 0;
};

/// A segment's cache entry resident where a backend computes (host for CPU; device for CUDA: per linear layer
/// the fp32 (T, S) pairs and the conv tail, per attention layer K and V in bf16).
class ResidentEntry {
 public:
  virtual ~ResidentEntry() = default;
  /// Fingerprint (model + numerics), w, token ids and geometry; the tensors may be absent (CUDA keeps them on the
  /// device): use host() for them.
  virtual const SegmentEntry& header() const = 0;
  /// The whole entry in host memory (fp32 tensors, the wire format's content). CPU: the entry itself. CUDA: a
  /// device-to-host copy made on the first call and kept.
  virtual std::shared_ptr<const SegmentEntry> host() const = 0;
  /// Bytes held where it is resident.
  virtual size_t resident_bytes() const = 0;
  int num_tokens() const { return header().num_tokens(); }
};

class HostBlock;

/// One segment of a splice plan: its token ids (full and prefix modes compute them), and its entry (required by
/// naive / transition / hypic): resident (made by this backend or imported into it), or, on a backend whose entries
/// live in device memory (Backend::device_entries), a pinned host block of it (Backend::copy_to_host,
/// block_of_entry, wire_block) that the splice copies in for the passes that fold it and lets go after them
/// (SplicePlan::block_staging_bytes), so that a prompt's entries need not all fit in device memory at once.
/// `entry` wins where both are given.
struct PlanSegment {
  std::vector<int32_t> ids;
  std::shared_ptr<const ResidentEntry> entry;
  std::shared_ptr<const HostBlock> block;
};

/// A prompt to assemble (DESIGN.md 3.3-3.4): segments in order, then the query (never cached).
struct SplicePlan {
  std::vector<PlanSegment> segments;
  std::vector<int32_t> query;
  SpliceMode mode = SpliceMode::Hypic;
  int seam_width = 8;               ///< w (hypic); entries must have been made with the same w
  bool all_query_logits = false;    ///< logits for every query position (evaluation), else the last only
  bool keep_context_state = false;  ///< return each linear layer's S after the last segment (evaluation)
  bool use_prefix_cache = true;     ///< prefix mode: look up / store running states in the backend's prefix cache
  /// Hypic: segments (indices >= 1) recomputed whole in context (SpliceRequest::recompute_segments).
  std::vector<int> recompute_segments;
  /// Hypic: query-aware refresh of the k segments the query's last token attends to most
  /// (SpliceRequest::refresh_segments). 0 = off.
  int refresh_segments = 0;
  /// Hypic: the last t segments recomputed whole in context (SpliceRequest::refresh_tail). 0 = off.
  int refresh_tail = 0;
  /// Checked between two forward passes of the splice (the refresh's probe and the splice after it, the passes of a
  /// chunked prefill; SpliceRequest::cancel): set, the splice throws SpliceCancelled instead of running the next
  /// one. Null: never cancelled.
  std::shared_ptr<const std::atomic<bool>> cancel;
  /// Chunked prefill (SpliceRequest::max_pass_tokens): when > 0, no forward pass of the splice runs more than this
  /// many tokens (longer spans are cut; with all_query_logits the query stays in one pass), and between two passes
  /// between_passes runs (the engine loop steps its decoding sequences there, on the same thread) before the cancel
  /// check. Results agree with unchunked passes within the scan's rounding. 0: passes as large as the backend allows.
  int64_t max_pass_tokens = 0;
  std::function<void()> between_passes;
  /// Called with each schedule the backend executes for this plan (the refresh's probe first, when one runs, then
  /// the answer's), before it runs: every backend executes the schedules of the one planner (engine/splice_schedule.h),
  /// which a test compares across backends. Optional.
  std::function<void(const SpliceSchedule&)> on_schedule;
  /// Segments that bring a host block instead of a resident entry (PlanSegment::block; device backends only): the
  /// device memory the splice may take to stage them, bytes. Their entries are copied in group by group, in the order
  /// the schedule folds them, while earlier groups' passes run (two halves of the staging area: one group in use, the
  /// next one arriving; one half alone when the area holds only the largest entry), and a forward pass folds the
  /// entries of one group only, so a long prompt's splice runs more passes. A room the device cannot give now (what
  /// is free less a margin of 512 MiB) shrinks to what it can, down to the largest entry alone (one group per entry,
  /// each copy waited for). 0 = auto: the larger of four entries and half of what is free less the margin (room for
  /// other requests' allocations meanwhile), or every block where that holds them all. Each entry counts with the scratch
  /// its fold takes in a pass (naive mode's S(C|0), Ring-linear's rotated states). Throws ResourceExhausted ("device
  /// memory") when not even the largest entry can be had, or the room given is below it (a room that holds it but
  /// not its scratch too is taken as both).
  size_t block_staging_bytes = 0;
};

/// What the splice planner sees of a plan (engine/splice_schedule.h): mode, w, each segment's tokens (its ids, or its
/// entry's when the ids are omitted) and whether it brings an entry, the query's length, the recompute and refresh
/// settings. Every backend plans from it.
SpliceShape splice_shape(const SplicePlan& plan);

/// What a splice returns.
struct SpliceOutput {
  std::unique_ptr<Sequence> sequence;  ///< ready for decode at position num_tokens
  std::vector<float> logits;           ///< [Tq][V] if all_query_logits else [1][V], fp32, host
  int64_t num_tokens = 0;              ///< prompt length (segments + query)
  int64_t computed_tokens = 0;         ///< tokens run through the model (seams + query; all for full)
  int prefix_segments_reused = 0;      ///< prefix mode: segments restored from the prefix cache
  std::vector<int> recomputed_segments;  ///< hypic: segments recomputed whole, ascending
  std::vector<std::vector<float>> context_states;  ///< keep_context_state: per linear layer [H_v][d_k][d_v], host
  /// Host blocks staged (PlanSegment::block): segments brought in as blocks, the groups they were copied in (one per
  /// execution of the schedule: the refresh's probe and the answer each copy theirs), the staging area's bytes.
  int staged_segments = 0;
  int staged_groups = 0;
  size_t staging_bytes = 0;
};

/// Backend::build_entries' cancellation test: true when segment i (its index in the call) is no longer wanted.
using BuildCancelled = std::function<bool(size_t segment)>;

/// A device entry's memory as one contiguous block in its backend's own layout (the CUDA backend's CudaEntry:
/// per linear layer S_seam (when w > 0), T_int, S_int fp32 and the conv tail bf16, then per attention layer K and V bf16,
/// each 256-byte aligned; engine/cuda/cuda_backend_impl.h EntryLayout). Two backends of the same fingerprint lay an entry of n tokens
/// out identically, so a GPU-to-GPU transfer (transport/nccl_peer.h) moves the block as is.
struct DeviceBlock {
  void* data = nullptr;  ///< device pointer
  size_t bytes = 0;
  int device = -1;       ///< CUDA ordinal the block lives on
};

/// A host copy of a device entry in its backend's own device layout (DeviceBlock's bytes, no conversion), in pinned
/// (page-locked) host memory so that copies to and from the device run at PCIe bandwidth. Made by
/// Backend::copy_to_host (from a resident entry) or Backend::block_of_entry (from the wire form); made resident again
/// by Backend::import_block (one host-to-device copy). Immutable once made; safe to share between threads. Its memory
/// goes back to its backend's pinned pool when the last reference goes (which may outlive the backend).
class HostBlock {
 public:
  virtual ~HostBlock() = default;
  /// Fingerprint, numerics, w, token ids and geometry (no tensors).
  virtual const SegmentEntry& header() const = 0;
  /// Bytes of the block (equal to the device entry's resident_bytes()).
  virtual size_t bytes() const = 0;
  /// Pinned host memory it holds (its pieces: at least bytes()); what a host tier's budget counts.
  virtual size_t pinned_bytes() const { return bytes(); }
  int num_tokens() const { return header().num_tokens(); }
};

/// A host block being filled from an entry's wire bytes (Backend::wire_block): `regions` are byte spans of its pinned
/// memory in wire order (EntryReaderChecks::destination), to be written once each before `block` is used.
struct WireBlock {
  std::shared_ptr<const HostBlock> block;
  std::vector<std::span<char>> regions;
};

/// Memory a backend holds, by pool (bytes). Budgets of 0 mean unbounded.
struct BackendMemory {
  size_t weights = 0;
  size_t kv_used = 0, kv_budget = 0;        ///< KV cache pool (pages of all sequences)
  size_t entries_used = 0;                  ///< resident entries made or imported and still referenced (CUDA:
                                            ///< with prefix mode's checkpoints)
  size_t freed_pending = 0;                 ///< CUDA: dropped entries' memory not yet freed (at the next engine call)
  /// CUDA: memory the stream-ordered allocator's pool holds free (freed entries and checkpoints it has not handed back
  /// to the device: reused by the next entries, not counted in device_free).
  size_t pool_free = 0;
  size_t workspace = 0;                     ///< scratch of the forward pass
  /// CUDA: device memory free now (cudaMemGetInfo) and in all; 0 on the CPU backend.
  size_t device_free = 0, device_total = 0;
  /// CUDA: pinned host memory held by the pool of host blocks (in use or kept for reuse); 0 on the CPU backend.
  size_t pinned_host = 0;
};

/// Options of make_backend.
struct BackendOptions {
  size_t prefix_cache_bytes = size_t(1) << 30;  ///< prefix-mode state checkpoints (host on CPU, device on CUDA)
  /// CUDA: KV cache pool for all sequences, bytes (0 = 40% of the device memory free after the weights).
  size_t kv_pool_bytes = 0;
  /// CUDA: the most tokens one forward pass carries (longer prefills run in chunks); sizes the activations.
  int64_t max_batch_tokens = 16384;
  /// CUDA: the longest segment an entry build takes in one pass (the router's default --max-segment-tokens); the
  /// activations are sized for max(max_batch_tokens, max_segment_tokens) tokens.
  int64_t max_segment_tokens = 32768;
  /// CUDA: the most sequences alive at once (each holds one linear-state slot: n_linear * H_v * 64 KiB fp32).
  int max_sequences = 64;
  /// CUDA: replay decode steps as CUDA graphs (captured on a batch shape's second step; same kernels, same bits).
  bool decode_graphs = true;
  /// CUDA: decode steps may run on a second thread beside builds and splices (Backend::concurrent_decode): on a
  /// stream of the device's highest priority with activations of their own, so that running sequences keep their
  /// inter-token latency while a long prefill pass runs. Same kernels, same bits. false: the engine loop interleaves
  /// decode steps between passes (chunked prefill) instead.
  bool concurrent_decode = true;
  /// CUDA, with concurrent_decode: streaming multiprocessors set aside for decode steps while they run beside a
  /// prefill call (green contexts, CUDA 12.5+ driver; rounded up to the device's partition granularity, 8 SMs on
  /// Hopper). A splice or entry build that starts while sequences decode runs on the other SMs, so its long-running
  /// blocks never delay a step's kernels (the steps themselves run on the whole device at the highest priority, so
  /// the SMs set aside take their blocks first); one that starts while none decode uses the whole device. Same
  /// kernels, same bits. -1 = auto: about an eighth of the device in
  /// multiples of 8 (16 of an H200's 132 SMs), none below 32 SMs, and none, with a warning, where the driver has
  /// no green contexts. 0 = no partition (the decode stream's priority alone favours the steps). An explicit count
  /// the driver cannot give (no green contexts, too few SMs left for the prefill) makes construction throw.
  /// Measured on an H200 at Qwen3.5-35B-A3B dimensions (bench/results/decode_beside_h200.md, against
  /// decode_beside_no_partition_h200.md): a batch-4 step beside 2048-token entry builds takes 1.35x its time alone
  /// with 16 SMs against 1.77x without, beside 16k-token prefills 1.72x against 4.2x; the builds beside the steps
  /// take 2.1x their time alone against 1.5x (prefill throughput is what the partition costs).
  int decode_sms = -1;
  /// Benchmark only: ignore the checkpoint's safetensors and make seeded random weights from config.json on
  /// the device (logged and reported as benchmark-only; text is meaningless). 0 = load the real weights.
  /// Not supported by the CPU backend (make_backend throws; write a random checkpoint with `hypic-model init`).
  /// A backend with random weights sets its config().weights_digest to random_weights_digest(seed), so its
  /// fingerprint (and every digest and entry) differs from the checkpoint's and from other seeds'.
  uint64_t random_weights_seed = 0;
  /// Benchmark only: build_entries skips the segment transitions T_C (and what only they need), so that a
  /// benchmark can time an entry build without T_C against one with it. Entries made so have NO valid T_C and
  /// must not be spliced, exported or cached. Default false (every entry carries its T_C).
  bool benchmark_skip_transitions = false;
  /// CPU: threads that run the independent items of one call in parallel (the segments of build_entries, the
  /// sequences of decode); 1 = the calling thread alone. Results do not depend on it. Ignored by CUDA.
  int cpu_threads = 1;
};

/// The engine interface (see the header comment). Errors: std::invalid_argument for bad requests (empty
/// segment, id out of range, missing entry), EntryError for entries of another model / numerics / w,
/// ResourceExhausted when a memory budget would be exceeded (naming the budget).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const ModelConfig& config() const = 0;
  virtual DeviceSpec device() const = 0;
  /// "cpu-fp32" | "cuda-bf16".
  virtual std::string_view numerics() const = 0;
  /// model_fingerprint(config(), numerics()), computed once.
  virtual const std::string& fingerprint() const = 0;

  /// Standalone prefills of several segments at position 0 into their entries (DESIGN.md 3.2), as one varlen
  /// pass where the backend can (T_C from the same pass). Each entry is resident here; host() gives the wire
  /// form. Throws std::invalid_argument for an empty segment, an id out of range or w < 0.
  /// `cancelled(i)`, when given, says segment i is no longer wanted: it is asked as the build goes (CPU: before each
  /// segment and each decoder layer of its prefill; CUDA: before each batch and each layer, a batch stopping when all
  /// of its segments are), and a segment stopped so has a null entry (a cancelled build costs at most about one
  /// layer past its cancellation).
  virtual std::vector<std::shared_ptr<const ResidentEntry>> build_entries(
      std::span<const std::vector<int32_t>> segments, int seam_width, const BuildCancelled& cancelled = {}) = 0;

  /// Makes a host entry (received over the wire or from the cache) resident here. Throws EntryError if it was
  /// made under another fingerprint or geometry, or is inconsistent.
  virtual std::shared_ptr<const ResidentEntry> import_entry(std::shared_ptr<const SegmentEntry> entry) = 0;

  /// Assembles the prompt (DESIGN.md 3.3) and runs the query: the sequence plus the query logits.
  virtual SpliceOutput splice(const SplicePlan& plan) = 0;

  /// One decode step for a batch of sequences (continuous batching): sequence b consumes tokens[b] at position
  /// sequences[b]->num_tokens() and advances by one. logits becomes [B][V] fp32 (host). The sequences must be
  /// this backend's and distinct. Throws std::invalid_argument (sizes differ, id out of range), ResourceExhausted
  /// (a sequence needs a KV page the pool no longer has); a throw advances no sequence (everything is checked and
  /// reserved first), so the caller may retry the sequences one by one.
  virtual void decode(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
                      std::vector<float>& logits) = 0;

  /// What decode_step returns to the host.
  struct DecodeStepOutput {
    /// [B]: for a greedy row (kStepGreedy) the argmax of its logits (lowest id on ties, as engine/sampling.h
    /// argmax); for a sampling row (kStepSample) the token Sampler::pick gives for its draw; -1 for a logits row
    /// (kStepLogits). A greedy or sampling row with a NaN logit gets nan_logits_code(j) (<= -2, j the lowest id of a
    /// NaN); a sampling row without a finite logit to sample from (all -inf, or a +inf) gets kNoFiniteLogitCode.
    std::vector<int32_t> argmax;
    /// [n][V] fp32: the logits of the kStepLogits rows, in batch order (n = their count).
    std::vector<float> logits;
  };
  /// DecodeStepOutput::argmax of a greedy row whose logit j (the lowest such id) is NaN, and back.
  static constexpr int32_t nan_logits_code(int32_t j) { return -2 - j; }
  static constexpr int32_t nan_logits_id(int32_t code) { return -2 - code; }
  /// DecodeStepOutput::argmax of a sampling row whose logits have no finite maximum (Sampler::pick's
  /// "no finite logit to sample from").
  static constexpr int32_t kNoFiniteLogitCode = INT32_MIN;
  /// What decode_step does with a row (`modes[b]`).
  static constexpr uint8_t kStepGreedy = 0;  ///< the argmax
  static constexpr uint8_t kStepLogits = 1;  ///< the whole logits row back to the host
  static constexpr uint8_t kStepSample = 2;  ///< the token of draws[b] (Sampler::pick over the row's logits)
  /// A sampling row's draw: the request's SamplingConfig (temperature > 0, top_k >= 0, top_p in (0, 1]) and the
  /// uniform u in [0, 1) its Sampler drew for this step (Sampler::next_uniform).
  struct SampleDraw {
    float temperature = 1.0f;
    int32_t top_k = 0;
    float top_p = 1.0f;
    double u = 0.0;
  };
  /// One decode step as decode() for a batch whose rows need their greedy token, a sampled token or their full
  /// logits (`modes`, kStep*): the CUDA backend takes the argmax on the device and copies only the rows that need
  /// logits (a batch of 64 rows would copy 64 x V x 4 bytes = 63 MB at V = 248k); the default runs decode() and picks
  /// on the host. A sampling row's token is Sampler::pick(logits, its draw's config, draw.u), so a request that draws
  /// u from its Sampler gets the tokens Sampler::sample would give. Same preconditions, errors and all-or-nothing
  /// advance as decode(); modes.size() must equal sequences.size(), draws.size() too when a row samples, modes[b] <= 2
  /// and each sampling row's draw valid (std::invalid_argument naming the row, before anything advances).
  virtual void decode_step(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
                           std::span<const uint8_t> modes, DecodeStepOutput& out,
                           std::span<const SampleDraw> draws = {});
  /// Checks decode_step's modes and draws against a batch of `batch` rows (std::invalid_argument as there).
  static void check_step_rows(size_t batch, std::span<const uint8_t> modes, std::span<const SampleDraw> draws);
  /// A sampling row's DecodeStepOutput::argmax on the host: Sampler::pick(logits [V], the draw's config, d.u);
  /// nan_logits_code(j) for a NaN at j (the lowest), kNoFiniteLogitCode when the logits have no finite maximum.
  static int32_t sample_row(std::span<const float> logits, const SampleDraw& d);

  virtual BackendMemory memory() const = 0;

  /// True if decode() may be called from one other thread while build_entries, import_entry or splice run (on
  /// distinct sequences; decode calls themselves never overlap one another). The engine loop then steps its running
  /// sequences on a thread of their own (EngineLoop), so that a prefill pass no longer stalls them. Default false
  /// (the CPU backend: one thread calls everything).
  virtual bool concurrent_decode() const { return false; }
  /// With concurrent_decode(): the caller tells how many sequences it steps on its decode thread now, counting
  /// those handed over but not stepped yet (the engine loop calls it whenever the count changes), so that the
  /// backend can set resources aside for those steps while a prefill call runs (CUDA: BackendOptions::decode_sms)
  /// and give the whole device back to the prefill when none run. A hint: results do not depend on it. Thread-safe.
  /// Default: ignored.
  virtual void set_decoding_sequences(int /*n*/) {}

  /// The device block of `entry` if it is one of this backend's device entries (CUDA); nullopt where entries live
  /// in host memory (CPU) or `entry` is not this backend's. Thread-safe (reads what never changes).
  virtual std::optional<DeviceBlock> device_block(const ResidentEntry& entry) const;
  /// A device entry for `header` (fingerprint, numerics, w, token ids and geometry; its tensors are ignored) whose
  /// block the caller then fills with a sender's block (a GPU-to-GPU receive) before splicing it: until then its
  /// content is undefined. The sizes equal what build_entries makes for the same tokens. Thread-safe (allocates
  /// stream-ordered on a transfer stream of its own: never on the engine's stream, never synchronizing the device).
  /// Throws EntryError if `header` is another model's, numerics or geometry; ResourceExhausted if device memory is
  /// short; std::logic_error on a backend without device entries.
  virtual std::pair<std::shared_ptr<const ResidentEntry>, DeviceBlock> allocate_entry(const SegmentEntry& header) const;

  // ---- host blocks (DESIGN.md 4, "data plane"): where entries live in device memory (CUDA) ----------------------
  // These are thread-safe and never use the engine's stream: they run on gRPC and background threads while the
  // engine loop computes. A backend whose entries live in host memory (CPU) throws std::logic_error from all four.

  /// True where entries live in device memory, so that host blocks (the methods below) apply.
  virtual bool device_entries() const { return false; }
  /// A pinned host copy of `entry` (one of this backend's device entries), made device-to-host on a copy stream of
  /// the backend's own and waited for. Cost: the entry's bytes at PCIe bandwidth (about 20-50 GB/s), on the calling
  /// thread. Throws EntryError for another backend's entry, ResourceExhausted when pinned memory cannot be had.
  virtual std::shared_ptr<const HostBlock> copy_to_host(const ResidentEntry& entry) const;
  /// A device entry made from a host block (allocated stream-ordered on a transfer stream, the block copied
  /// host-to-device and waited for): the entry build_entries would have made for the same tokens, bit for bit.
  /// Throws EntryError (another model, numerics or geometry; a block of another size), ResourceExhausted (device
  /// memory).
  virtual std::shared_ptr<const ResidentEntry> import_block(const HostBlock& block) const;
  /// The wire form of a block (fp32 tensors, engine/segment.h): the same values as ResidentEntry::host() of its
  /// device entry. Host work only.
  virtual std::shared_ptr<const SegmentEntry> entry_of_block(const HostBlock& block) const;
  /// A block of a host entry (received over the wire or from the cache), converted into the device layout in pinned
  /// memory: import_block of it equals import_entry of `entry`, bit for bit. Host work only. Throws EntryError as
  /// import_entry does.
  virtual std::shared_ptr<const HostBlock> block_of_entry(const SegmentEntry& entry) const;
  /// A pinned host block for the entry whose wire header is `header` (fingerprint, numerics, w, token ids, geometry)
  /// and whose tensors the wire carries as `shape` says, where those bytes are the device layout's as they are (CUDA:
  /// T dense, or one scalar per head for lightning; K, V and conv tails bf16): an entry received over the wire or
  /// mapped from the segment cache becomes a block with one copy and no conversion (EntryReaderChecks::destination),
  /// then resident with import_block, bit for bit what import_entry of the parsed entry makes. nullopt where the wire
  /// form differs (fp32 K/V, other transition kinds: parse a SegmentEntry, then block_of_entry) and where entries live
  /// in host memory (the default). Host work only; thread-safe. Throws EntryError as import_block does (another
  /// model, numerics or geometry; no tokens), ResourceExhausted when pinned memory cannot be had.
  virtual std::optional<WireBlock> wire_block(const SegmentEntry& header, const WireShape& shape) const;
  /// The wire form of a host block (serialize_entry of entry_of_block(block), bit for bit), written straight from the
  /// block where the backend can (CUDA: its states are fp32 and its K, V and conv tails bf16 in both layouts, so the
  /// bytes are copied as they are, with no fp32 SegmentEntry in between). Host work only; thread-safe. Throws
  /// EntryError for a block of another backend or size.
  virtual std::string wire_of_block(const HostBlock& block) const;
  /// wire_of_block's bytes handed over in pieces (write_entry_parts: `begin` with the total, then `out` with each
  /// piece in order, views valid during the call only), so that a caller can lay them where they go (a sealed memfd
  /// for the segment cache) without a whole-entry buffer in between (CUDA: straight from the pinned block). The
  /// default makes wire_of_block's buffer and hands it over whole. Same errors as wire_of_block, plus what the
  /// callbacks throw.
  virtual void write_wire_of_block(const HostBlock& block, const std::function<void(uint64_t)>& begin,
                                   const std::function<void(std::string_view)>& out) const;
  /// The wire form of a resident entry: wire_of_block of its host copy where entries live on a device (a
  /// device-to-host copy, then host work), else serialize_entry(*entry.host()). Thread-safe (not the engine's thread).
  std::string wire_of(const ResidentEntry& entry) const;
  /// Pins `bytes` of host memory for host blocks now (a server at start-up, sized to its host tier), so that making
  /// host blocks later pins nothing: pinning stalls the device's other work while it runs. Host blocks then take
  /// whole 32 MiB pieces. Thread-safe. Throws ResourceExhausted when the host cannot pin that much; a no-op where
  /// !device_entries().
  virtual void reserve_host_blocks(size_t bytes) const { (void)bytes; }
  /// Bytes a device entry of `tokens` tokens takes here (its resident_bytes()), for budgets stated in entries.
  virtual size_t entry_bytes(int64_t tokens) const;
};

/// An entry arriving as wire bytes (engine/segment.h: a delivery, a segment cache fetch), parsed as it is fed: where
/// `backend` keeps entries on a device and the wire carries its layout's dtypes (Backend::wire_block), straight into a
/// pinned host block (one copy of each byte, no fp32 SegmentEntry in between; then Backend::import_block), else into a
/// SegmentEntry (EntryReader). Not thread-safe; neither copyable nor movable (the reader points into it).
class EntryReceiver {
 public:
  /// `checks` as EntryReader's; its destination is this receiver's. The backend must outlive the receiver.
  EntryReceiver(const Backend& backend, EntryReaderChecks checks);
  EntryReceiver(const EntryReceiver&) = delete;
  EntryReceiver& operator=(const EntryReceiver&) = delete;
  /// EntryReader::feed: throws EntryError (bad header, checks failed, bytes past the end), ResourceExhausted (no
  /// pinned memory for the block).
  void feed(std::string_view chunk) { reader_.feed(chunk); }
  struct Received {
    /// The entry: with its tensors when `block` is null, else its header fields alone (EntryReader::finish).
    std::shared_ptr<const SegmentEntry> entry;
    /// The complete pinned block the tensors went into, or null.
    std::shared_ptr<const HostBlock> block;
  };
  /// Verifies the whole stream's checksum and returns what arrived. Throws EntryError (truncated, corrupt).
  Received finish();

 private:
  std::optional<WireBlock> block_;
  EntryReader reader_;
};

/// Raised when a request needs more memory than a budget allows; the message names the budget and the sizes.
class ResourceExhausted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// About the bytes of a serialized entry of `tokens` tokens of this model, made with w > 0 (the wire and cache form,
/// engine/segment.h; transitions counted dense, K, V and conv tails fp32: an upper bound), for budgets stated in entries.
size_t wire_entry_bytes(const ModelConfig& config, int64_t tokens);

/// The weights identity of seeded random weights (BackendOptions::random_weights_seed): "random-" + 16 hex digits.
std::string random_weights_digest(uint64_t seed);

/// The one token-id check of every service and backend: throws std::invalid_argument "`what`: must not be empty"
/// or "`what`[j]: ID is outside the vocabulary [0, vocab_size)".
void check_token_ids(std::span<const int32_t> ids, int64_t vocab_size, const std::string& what);

/// True when this build has the CUDA backend and a CUDA device is visible.
bool cuda_available();

/// The default device: "cuda:0" when cuda_available(), else "cpu".
DeviceSpec default_device();

/// Loads the model in `model_dir` onto `device`. Throws std::invalid_argument for a device this build or machine
/// lacks (naming it: "this build has no CUDA backend" without HYPIC_WITH_CUDA, "no CUDA device is visible", "only N
/// CUDA device(s) are visible"), for options the backend does not support (cpu_threads < 1; random_weights_seed on
/// the CPU), and whatever loading throws (engine/checkpoint/weights.h).
std::unique_ptr<Backend> make_backend(const DeviceSpec& device, const std::filesystem::path& model_dir,
                                      const BackendOptions& options = {});

/// The CUDA backend's factory (engine/cuda, library hypic_engine_cuda, built only with HYPIC_WITH_CUDA); called by
/// make_backend for BackendKind::Cuda. Same contract as make_backend.
std::unique_ptr<Backend> make_cuda_backend(const DeviceSpec& device, const std::filesystem::path& model_dir,
                                           const BackendOptions& options);

}  // namespace hypic::engine
