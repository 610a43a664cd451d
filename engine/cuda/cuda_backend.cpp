// The CUDA backend (contracts in cuda_backend.h and engine/backend.h).
//
// A request's path: splice() turns the plan into "items" (folds of cached entries and spans of tokens to run in
// context), apply_folds() folds entries into the sequence's state slot, and run_pass() runs one forward pass over
// up to max_batch_tokens tokens of spans: per linear layer the spans form "runs" (consecutive spans with no fold
// between them); the runs' initial states come from the affine chain (DESIGN.md 3.1 composition law):
//   init[0] = slot state, init[r] = fold_r(T_{run r-1} init[r-1] + S(run r-1|0)),
// with (T, S(.|0)) of each run from a first zero-start prefill (phase A), then the outputs from a second prefill
// from the true initial states (phase C). Attention layers run every span of the pass in one call, with the
// folded entries' K (re-rotated to real positions) and V imported into the sequence's KV pages first.
#include "engine/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <cmath>
#include <cstring>
#include <list>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <map>
#include <set>
#include <type_traits>
#include <unordered_map>

#include "engine/cuda/cuda_weights.h"
#include "engine/cuda/device_memory.h"
#include "engine/cuda/pinned_pool.h"
#include "engine/cuda/sm_partition.h"
#include "engine/safetensors.h"
#include "engine/splice.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"

namespace hypic::engine::cuda {
namespace {

namespace kc = hypic::kernels::cuda;
constexpr int D = kc::kGdnHeadDim;
constexpr int kPage = kc::kKvPageTokens;
constexpr size_t kStateFloats = size_t(D) * D;

std::string mib(size_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

// Small host tables of one pass, uploaded to the device in one copy. add() returns an offset; dev() resolves it
// after upload().
class Tables {
 public:
  template <class T>
  size_t add(const std::vector<T>& v) {
    return add_bytes(v.data(), v.size() * sizeof(T));
  }
  size_t add_bytes(const void* p, size_t n) {
    const size_t off = (host_.size() + 15) / 16 * 16;
    host_.resize(off + std::max<size_t>(n, 1));
    if (n) std::memcpy(host_.data() + off, p, n);
    return off;
  }
  void upload(DeviceMemory& dev, cudaStream_t stream) {
    ensure_capacity(dev, host_.size(), "pass tables");
    base_ = dev.bytes_ptr();
    if (!host_.empty())
      check_cuda(cudaMemcpyAsync(base_, host_.data(), host_.size(), cudaMemcpyHostToDevice, stream), "table upload");
  }
  template <class T>
  T* dev(size_t off) const {
    return reinterpret_cast<T*>(base_ + off);
  }
  void clear() {
    host_.clear();
    base_ = nullptr;
  }

 private:
  std::vector<uint8_t> host_;
  char* base_ = nullptr;
};

class CudaBackend;

// ---- entries ---------------------------------------------------------------------------------------------------

// Where each part of an entry of n tokens lies in its device block (byte offsets, 256-byte aligned): per linear layer
// S_seam (only when the seam is not empty: `seam`), T_int, S_int ([H_v][128][128] fp32 each; T_seam is not stored,
// engine/segment.h) and the conv tail [K-1][C] bf16; then per attention layer K and V [n][H_kv][hd] bf16. A host
// block (pinned copy) uses the same offsets.
struct EntryLayout {
  size_t state = 0, conv = 0, lin_stride = 0, kv = 0, kv_off = 0, total = 0;
  int states = 0;  // fp32 [H_v][128][128] blocks per linear layer: 3 with a seam, else 2
  EntryLayout(const EntryGeometry& g, size_t kv_row_bytes, int64_t n, bool seam) {
    states = seam ? 3 : 2;
    state = size_t(g.linear_heads) * kStateFloats * sizeof(float);
    conv = size_t(g.conv_rows) * g.conv_dim * 2;
    lin_stride = (size_t(states) * state + conv + 255) / 256 * 256;
    kv = (size_t(n) * kv_row_bytes + 255) / 256 * 256;
    kv_off = size_t(g.num_linear) * lin_stride;
    total = kv_off + size_t(g.num_attention) * 2 * kv;
  }
  size_t S_seam(int l) const { return size_t(l) * lin_stride; }  // only when states == 3
  size_t T_int(int l) const { return size_t(l) * lin_stride + size_t(states - 2) * state; }
  size_t S_int(int l) const { return T_int(l) + state; }
  size_t conv_at(int l) const { return size_t(l) * lin_stride + size_t(states) * state; }
  size_t K(int a) const { return kv_off + size_t(a) * 2 * kv; }
  size_t V(int a) const { return K(a) + kv; }
};

// A host block (engine/backend.h): an entry's device block in pinned pieces of the backend's pool.
class CudaHostBlock final : public HostBlock {
 public:
  CudaHostBlock(SegmentEntry header, size_t bytes, std::shared_ptr<PinnedPool> pool)
      : header_(std::move(header)), bytes_(bytes), pool_(std::move(pool)), pieces_(pool_->acquire(bytes)) {}
  ~CudaHostBlock() override { pool_->release(pieces_); }
  const SegmentEntry& header() const override { return header_; }
  size_t bytes() const override { return bytes_; }
  size_t pinned_bytes() const override {
    size_t n = 0;
    for (const auto& p : pieces_) n += p.capacity;
    return n;
  }
  const std::vector<PinnedPool::Piece>& pieces() const { return pieces_; }
  /// Calls f(host pointer, block offset, length) for the pieces covering [offset, offset + n).
  template <class F>
  void span(size_t offset, size_t n, F&& f) const {
    size_t base = 0;
    for (const auto& p : pieces_) {
      const size_t lo = std::max(offset, base), hi = std::min(offset + n, base + p.used);
      if (lo < hi) f(p.data + (lo - base), lo, hi - lo);
      base += p.used;
      if (base >= offset + n) break;
    }
  }
  void read(size_t offset, void* dst, size_t n) const {
    span(offset, n, [&](const char* p, size_t at, size_t len) { std::memcpy(static_cast<char*>(dst) + (at - offset), p, len); });
  }
  void write(size_t offset, const void* src, size_t n) {
    span(offset, n, [&](char* p, size_t at, size_t len) { std::memcpy(p, static_cast<const char*>(src) + (at - offset), len); });
  }

 private:
  SegmentEntry header_;
  size_t bytes_;
  std::shared_ptr<PinnedPool> pool_;
  std::vector<PinnedPool::Piece> pieces_;
};

// A segment entry on the device (EntryLayout): per linear layer S_seam (when the seam is not empty), T_int, S_int
// ([H_v][128][128] fp32 each) and the conv tail [K-1][C] bf16; per attention layer K and V [n][H_kv][hd] bf16 (K
// rotated at local positions).
class CudaEntry final : public ResidentEntry {
 public:
  /// Allocates the block stream-ordered on `stream` (the engine's stream for its own entries; the backend's transfer
  /// stream for Backend::allocate_entry, on any thread), or with plain cudaMalloc when `stream` is null.
  CudaEntry(CudaBackend& b, SegmentEntry header, cudaStream_t stream);
  /// The whole block (DeviceBlock; engine/backend.h).
  DeviceBlock block() const { return {mem_.bytes_ptr(), mem_.size(), device_}; }
  /// Hands the device memory back to the backend, which frees it on its engine thread (entries are dropped on gRPC
  /// threads too, where a free on the engine's stream could meet a CUDA-graph capture).
  ~CudaEntry() override;
  const SegmentEntry& header() const override { return header_; }
  std::shared_ptr<const SegmentEntry> host() const override;
  size_t resident_bytes() const override { return mem_.size(); }

  /// S(seam|0) of linear layer l; null when the seam is empty (w = 0).
  float* S_seam(int l) const { return has_seam() ? f32(lay_.S_seam(l)) : nullptr; }
  float* T_int(int l) const { return f32(lay_.T_int(l)); }
  float* S_int(int l) const { return f32(lay_.S_int(l)); }
  kc::bf16* conv(int l) const { return reinterpret_cast<kc::bf16*>(mem_.bytes_ptr(lay_.conv_at(l))); }
  bool has_seam() const { return lay_.states == 3; }
  kc::bf16* K(int a) const { return reinterpret_cast<kc::bf16*>(mem_.bytes_ptr(lay_.K(a))); }
  kc::bf16* V(int a) const { return reinterpret_cast<kc::bf16*>(mem_.bytes_ptr(lay_.V(a))); }
  int n() const { return header_.num_tokens(); }
  size_t state_bytes() const { return lay_.state; }
  size_t conv_bytes() const { return lay_.conv; }
  size_t kv_bytes() const { return lay_.kv; }
  int device() const { return device_; }
  bool no_transitions = false;  ///< made with BackendOptions::benchmark_skip_transitions: not spliceable

 private:
  float* f32(size_t off) const { return reinterpret_cast<float*>(mem_.bytes_ptr(off)); }
  SegmentEntry header_;
  CudaBackend* owner_;
  EntryLayout lay_;
  int device_ = 0;
  DeviceMemory mem_;
  mutable std::mutex mu_;
  mutable std::shared_ptr<const SegmentEntry> host_;
};

// ---- sequences -------------------------------------------------------------------------------------------------

class CudaSequence final : public Sequence {
 public:
  CudaSequence(CudaBackend& b, int slot) : b_(&b), slot_(slot) {}
  ~CudaSequence() override;
  int64_t num_tokens() const override { return n_; }
  size_t bytes() const override;
  ModelState to_host() const override;

  CudaBackend* b_;
  int slot_;
  std::vector<int> pages_;
  int64_t n_ = 0;
};

// One fold of a cached entry into a running state (DESIGN.md 3.3).
struct Fold {
  enum Kind { Install, Transition, Interior, Naive } kind;
  const CudaEntry* e;
  int64_t base;  // real position of the entry's first token
  int from() const { return kind == Interior ? e->header().seam_tokens() : 0; }
  // Affine steps per layer (fold_steps): an Install of an entry with a seam takes two, every other fold one.
  int steps() const { return kind == Install && e->has_seam() ? 2 : 1; }
};

struct Span {
  std::span<const int32_t> ids;
  int64_t position;
};

// What to run after folding: a span, preceded by folds.
struct Item {
  std::vector<Fold> folds;
  Span span;
};

struct Run {
  std::vector<Fold> folds_before;  // empty for run 0 (folded before the pass)
  std::vector<Span> spans;
};

// ---- the backend ---------------------------------------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  CudaBackend(const DeviceSpec& dev, ModelConfig cfg, const ModelWeights* weights, const BackendOptions& opt,
              const std::filesystem::path& checkpoint = {});  // non-empty: DeviceWeights::load from it, not weights
  ~CudaBackend() override;

  const ModelConfig& config() const override { return cfg_; }
  DeviceSpec device() const override { return dev_; }
  std::string_view numerics() const override { return backend_numerics(BackendKind::Cuda); }
  const std::string& fingerprint() const override { return fingerprint_; }
  std::vector<std::shared_ptr<const ResidentEntry>> build_entries(std::span<const std::vector<int32_t>> segments,
                                                                  int seam_width,
                                                                  const BuildCancelled& cancelled = {}) override;
  std::shared_ptr<const ResidentEntry> import_entry(std::shared_ptr<const SegmentEntry> entry) override;
  std::optional<DeviceBlock> device_block(const ResidentEntry& entry) const override;
  std::pair<std::shared_ptr<const ResidentEntry>, DeviceBlock> allocate_entry(const SegmentEntry& header) const override;
  SpliceOutput splice(const SplicePlan& plan) override;
  void decode(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
              std::vector<float>& logits) override;
  BackendMemory memory() const override;
  bool concurrent_decode() const override { return opt_.concurrent_decode; }
  void set_decoding_sequences(int n) override { decoders_.store(n); }
  bool device_entries() const override { return true; }
  std::shared_ptr<const HostBlock> copy_to_host(const ResidentEntry& entry) const override;
  std::shared_ptr<const ResidentEntry> import_block(const HostBlock& block) const override;
  std::shared_ptr<const SegmentEntry> entry_of_block(const HostBlock& block) const override;
  std::shared_ptr<const HostBlock> block_of_entry(const SegmentEntry& entry) const override;
  std::string wire_of_block(const HostBlock& block) const override;
  size_t entry_bytes(int64_t tokens) const override { return EntryLayout(geom_, kv_row_, tokens, true).total; }
  void reserve_host_blocks(size_t bytes) const override { pinned_->reserve(bytes); }

  // Used by entries and sequences (any thread).
  void release(int slot, const std::vector<int>& pages);
  void defer_free(DeviceMemory&& m) {
    std::lock_guard lock(free_mu_);
    pending_free_.push_back(std::move(m));
  }
  ModelState download_state(const CudaSequence& s) const;
  size_t sequence_state_bytes() const { return size_t(n_lin_) * (state_layer_bytes_ + conv_layer_bytes_); }
  size_t page_bytes() const { return size_t(n_attn_) * 2 * kPage * kv_row_; }
  /// The prefill lane's whole-device stream (never switched; the partition stream's work is joined into it at the
  /// end of each engine-loop call).
  cudaStream_t stream() const { return full_stream_; }
  const EntryGeometry& geometry() const { return geom_; }
  int n_lin() const { return n_lin_; }
  int n_attn() const { return n_attn_; }
  size_t kv_row_bytes() const { return kv_row_; }
  void set_device() const { check_cuda(cudaSetDevice(dev_.index), "cudaSetDevice(" + dev_.name() + ")"); }

 private:
  // Prefix mode's checkpoint after one segment of a chain: the linear layers' states and conv tails at position n
  // and the segment's own KV rows [start, n) (the rows before it live in the chain's earlier checkpoints).
  // Device memory: per linear layer [H_v][128][128] fp32 state then [K-1][conv channels] bf16 tail; then per
  // attention layer K then V rows, [n - start][kv heads][head dim] bf16.
  struct Checkpoint {
    DeviceMemory mem;
    int64_t start = 0, n = 0;
  };
  // A checkpoint taken in a forward pass: the state after the token at position at - 1, into cp.
  struct CheckpointCut {
    int64_t at;
    Checkpoint* cp;
  };
  void check_supported() const;
  void allocate_pools();
  std::unique_ptr<CudaSequence> new_sequence();
  void ensure_pages(CudaSequence& s, int64_t tokens);
  int page_row(const CudaSequence& s, int64_t slot) const {
    return s.pages_[size_t(slot / kPage)] * kPage + int(slot % kPage);
  }
  float* ssm(int l, int slot) const { return ssm_pool_[l].as<float>() + size_t(slot) * cfg_.linear_num_value_heads * kStateFloats; }
  kc::bf16* convs(int l, int slot) const {
    return reinterpret_cast<kc::bf16*>(conv_pool_[l].bytes_ptr(size_t(slot) * conv_layer_bytes_));
  }
  void check_ids(std::span<const int32_t> ids, const std::string& where) const;
  void check_entry(const PlanSegment& s, size_t i, const SplicePlan& plan) const;

  // Forward passes.
  void apply_folds(CudaSequence& s, const std::vector<Fold>& folds);
  // mass_dev (DEVICE fp32, zeroed, >= the pass's KV length): the last token's attention per KV slot is added to it.
  // cuts: checkpoints whose position falls in this pass's spans (one run only) get their linear states here.
  std::vector<float> run_pass(CudaSequence& s, const std::vector<Run>& runs, bool want_logits, bool all_logits,
                              float* mass_dev = nullptr, std::span<const CheckpointCut> cuts = {});
  // mass: if set, the query's last token's attention per KV slot (PrefillOptions::attention_mass).
  // cuts: prefix checkpoints taken in the same passes (increasing positions; items without folds): linear states
  // in the pass that reaches each, KV rows after the last pass.
  // pacing: a splice's chunked prefill (SplicePlan::max_pass_tokens; between_passes and the cancel check after every
  // pass but the last), or null.
  void execute(CudaSequence& s, const std::vector<Item>& items, bool all_logits, std::vector<float>& logits,
               bool keep_context, std::vector<std::vector<float>>* context, std::vector<float>* mass = nullptr,
               std::span<const CheckpointCut> cuts = {}, const SplicePlan* pacing = nullptr);
  // Between two passes of a splice: its between_passes, then SpliceCancelled (naming `where`) if it was cancelled.
  static void pause(const SplicePlan& plan, const char* where);
  // The hypic items (DESIGN.md 3.3): seams (or whole segments, where whole[i]) in context, interiors folded.
  std::vector<Item> hypic_items(const SplicePlan& plan, const std::vector<char>& whole, int64_t& pos,
                                int64_t& computed, std::vector<int>& recomputed) const;
  // One varlen build pass; `stop` asked before each layer (true: nothing more is launched, null entries).
  void build_batch(std::span<const std::vector<int32_t>> segments, int w,
                   std::vector<std::shared_ptr<CudaEntry>>& out, const std::function<bool()>& stop);
  // What one thread's forward passes compute with: its stream, GEMM runner, MoE workspace and activations (DEVICE,
  // rows of tokens: ids int32 [T]; x fp32 [T][hidden], the residual stream; the rest bf16 [T][width]). Two exist:
  // pre_, the engine loop's (builds and splices, on stream_), and dec_, the decode steps' (their own stream of the
  // device's highest priority, buffers for max_sequences tokens), so that a decode step may run on another thread
  // while a prefill pass runs (Backend::concurrent_decode): the two share only the weights (read) and the pools,
  // where each sequence's slot and pages are its own.
  struct Lane {
    cudaStream_t stream = nullptr;
    kc::GemmRunner* gemm = nullptr;
    kc::MoeWorkspace* moe_ws = nullptr;
    int32_t* ids = nullptr;
    float* x = nullptr;
    kc::bf16 *hn = nullptr, *qkv = nullptr, *conv_out = nullptr, *q = nullptr, *k = nullptr, *v = nullptr,
             *z = nullptr, *ga = nullptr, *gb = nullptr, *o = nullptr, *qg = nullptr, *kv = nullptr, *aq = nullptr,
             *ao = nullptr;
  };
  // Allocates `mem` for T tokens' activations and points a lane's buffers into it.
  void carve_activations(DeviceMemory& mem, size_t T, const std::string& what, Lane& lane);
  void linear_gemms(const Lane& ln, const DevLinear& L, int T);
  void linear_finish(const Lane& ln, const DevLinear& L, int T);
  void attention_gemms(const Lane& ln, const DevAttention& A, int T);
  void attention_mixer(const Lane& ln, const DevAttention& A, int a, int T, const int* positions, const int* kv_rows,
                       const kc::AttnGroups& groups, bool decode);
  /// Post-attention norm and MLP / MoE of T tokens added into the residual; decode: a (capturable) decode step.
  void ffn(const Lane& ln, const DevLayer& L, int T, bool decode = false);
  kc::MoeWeightsView moe_view(const DevLayer& L) const;
  void lm_head(int rows, const int* rows_index, std::vector<float>& logits);
  void snapshot_linear(const CudaSequence& s, std::vector<std::vector<float>>& out) const;
  std::vector<float> fetch_logits(int rows);

  // Decode steps: fixed-layout tables (int32 offsets) for a batch of B sequences and block tables cap pages wide.
  struct DecodeTables {
    DecodeTables(int B, int cap)
        : ids(0), pos(B), rows(2 * B), slots(3 * B), qs(4 * B), lr(5 * B + 1), bt(6 * B + 1),
          ints(size_t(6 * B + 1) + size_t(B) * cap) {}
    int ids, pos, rows, slots, qs, lr, bt;
    size_t ints;
  };
  void decode_body(int B, int cap, const DecodeTables& t);
  struct GraphExec {
    explicit GraphExec(cudaGraphExec_t e) : e_(e, [](cudaGraphExec_t x) { if (x) cudaGraphExecDestroy(x); }) {}
    cudaGraphExec_t get() const { return e_.get(); }
    std::shared_ptr<std::remove_pointer_t<cudaGraphExec_t>> e_;
  };

  // Prefix checkpoints (prefix mode): states at segment ends and each segment's KV rows, keyed by the chain digest.
  size_t checkpoint_bytes(int64_t tokens) const {
    return size_t(n_lin_) * (state_layer_bytes_ + conv_layer_bytes_) + size_t(n_attn_) * 2 * size_t(tokens) * kv_row_;
  }
  float* checkpoint_state(const Checkpoint& c, int l) const {
    return reinterpret_cast<float*>(c.mem.bytes_ptr(size_t(l) * (state_layer_bytes_ + conv_layer_bytes_)));
  }
  char* checkpoint_conv(const Checkpoint& c, int l) const {
    return c.mem.bytes_ptr(size_t(l) * (state_layer_bytes_ + conv_layer_bytes_) + state_layer_bytes_);
  }
  char* checkpoint_kv(const Checkpoint& c, int a, int kvi) const {
    return c.mem.bytes_ptr(size_t(n_lin_) * (state_layer_bytes_ + conv_layer_bytes_) +
                           (size_t(a) * 2 + size_t(kvi)) * size_t(c.n - c.start) * kv_row_);
  }
  // The KV rows of each cut's segment, from the sequence's pages into its checkpoint (one batched copy).
  void save_checkpoint_kv(const CudaSequence& s, std::span<const CheckpointCut> cuts);
  // A chain's checkpoints 0..k-1 into the sequence: every segment's KV rows, the last one's linear states.
  void restore_chain(CudaSequence& s, const std::vector<const Checkpoint*>& chain);

  ModelConfig cfg_;
  DeviceSpec dev_;
  BackendOptions opt_;
  std::string fingerprint_;
  EntryGeometry geom_;
  int n_lin_ = 0, n_attn_ = 0;
  int nk_ = 0, nv_ = 0, C_ = 0, K_ = 0, qd_ = 0, vd_ = 0, nh_ = 0, nkv_ = 0, hd_ = 0, H_ = 0;
  size_t state_layer_bytes_ = 0, conv_layer_bytes_ = 0, kv_row_ = 0;
  float eps_ = 1e-6f, attn_scale_ = 1.f, gdn_scale_ = 1.f;
  bool renorm_topk_ = true;
  // The prefill lane's stream: full_stream_ (the whole device), or the SM partition's prefill stream while a call
  // runs beside decode steps (PartitionScope). Read and switched only under capture_mu_ by the engine loop's calls.
  cudaStream_t stream_ = nullptr, full_stream_ = nullptr;
  // BackendOptions::decode_sms > 0: decode and prefill SM partitions (green contexts), used while both run.
  std::unique_ptr<SmPartition> sms_;
  cudaEvent_t lane_ev_ = nullptr;  // orders the prefill lane's work across its two streams
  int partition_depth_ = 0;        // nested engine-loop calls inside one PartitionScope (capture_mu_ is recursive)
  std::atomic<bool> partitioned_{false};        // a prefill call runs on the prefill partition now
  std::atomic<int> decoding_{0};                // decode steps in flight
  std::atomic<int> decoders_{0};                // set_decoding_sequences: sequences the caller's decode thread steps
  // True while sequences may decode beside a prefill call: the caller steps some (set_decoding_sequences, counting
  // a request whose first token came from its splice and whose first step has not started yet), or a step is in
  // flight (callers that give no count).
  bool decode_beside_likely() const { return decoders_.load() > 0 || decoding_.load() > 0; }
  // For the duration of one engine-loop call (splice, build_entries): when an SM partition exists and sequences
  // may decode beside it (decode_beside_likely), the prefill lane runs on the prefill partition's SMs (ordered after
  // the whole-device stream's work by an event, and joined back into it at the end); decode steps keep the whole
  // device at the highest priority, so the SMs the partition leaves out run their blocks at once.
  struct PartitionScope {
    explicit PartitionScope(CudaBackend& b);
    ~PartitionScope();
    CudaBackend& b;
    bool switched = false;
  };
  // Allocations and frees of entries made for a GPU-to-GPU receive (allocate_entry, on any thread): stream-ordered
  // on a stream of their own, since plain cudaMalloc / cudaFree synchronize the whole device (the engine's work and
  // any NCCL receive still waiting for its sender).
  cudaStream_t xfer_stream_ = nullptr;
  // Host blocks: device-to-host and host-to-device copies on streams of their own (any thread), into and out of
  // pinned pieces of pinned_ (shared with the blocks, which may outlive the backend).
  cudaStream_t d2h_stream_ = nullptr, h2d_stream_ = nullptr;
  std::shared_ptr<PinnedPool> pinned_;
  /// Waits for the work queued so far on `stream` (an event of the caller's own: other threads' later work on the
  /// same stream is not waited for).
  void wait_stream(cudaStream_t stream, const char* what) const;
  DeviceWeights w_;
  kc::GemmRunner gemm_;
  kc::MoeWorkspace moe_ws_;
  kc::GdnWorkspace ws_a_, ws_c_, ws_seam_, ws_pieces_;
  kc::AttnDecodeWorkspace attn_ws_;      // attention split-KV scratch of prefill passes
  kc::AttnDecodeWorkspace attn_dec_ws_;  // decode steps' own: the CUDA graphs point at it
  // Pools.
  std::vector<DeviceMemory> ssm_pool_, conv_pool_, k_pool_, v_pool_;
  std::vector<int> free_slots_, free_pages_;  // guarded by pool_mu_ (sequences may be released on any thread)
  mutable std::mutex pool_mu_;
  // Device memory of dropped entries, freed on the engine thread at the next call (drain_frees).
  std::mutex free_mu_;
  std::vector<DeviceMemory> pending_free_;
  void drain_frees() {
    if (partition_depth_ > 0) return;  // inside a PartitionScope: at the next top-level call
    std::vector<DeviceMemory> drop;
    {
      std::lock_guard lock(free_mu_);
      drop.swap(pending_free_);
    }
    // A stream-ordered free on the prefill partition's stream (memory allocated there) must follow the
    // whole-device stream's later uses of it too.
    if (sms_ && !drop.empty() &&
        (cudaEventRecord(lane_ev_, full_stream_) != cudaSuccess ||
         cudaStreamWaitEvent(sms_->prefill_stream(), lane_ev_, 0) != cudaSuccess)) {
      cudaGetLastError();  // (no throw: the destructor drains too) then the plain way: both streams done
      cudaStreamSynchronize(full_stream_);
      cudaStreamSynchronize(sms_->prefill_stream());
    }
  }
  int num_pages_ = 0;
  DeviceMemory inv_freq_;
  // Activations: the engine loop's for max(max_batch_tokens, max_segment_tokens) tokens (pre_), the decode lane's
  // for max_sequences tokens (dec_).
  int64_t Tmax_ = 0;
  DeviceMemory act_, dec_act_;
  Lane pre_, dec_;
  // The decode lane's own stream (whole device, the highest priority; dec_stream_ == dec_full_stream_), GEMM runner
  // and MoE workspace.
  cudaStream_t dec_stream_ = nullptr, dec_full_stream_ = nullptr;
  kc::GemmRunner dec_gemm_;
  kc::MoeWorkspace dec_moe_ws_;
  DeviceMemory logits_dev_;
  DeviceMemory mass_dev_;  // the refresh probe's attention mass per KV slot (fp32)
  DeviceMemory dec_tables_, dec_logits_;          // decode steps (fixed, so that graphs can point at them)
  // Captured decode steps by (batch, block-table width), captured and launched on dec_full_stream_ only (a graph's
  // kernels keep the context, and so the SMs, of the stream they were captured on).
  std::map<std::pair<int, int>, GraphExec> graphs_;
  // Held by the engine loop's calls (splice, build_entries, import_entry) for their whole run and by a decode step's
  // graph capture, which only try-locks it (else the step runs eager and captures later): a capture never overlaps
  // the loop's allocations and frees, which synchronize the device and would invalidate it.
  std::recursive_mutex capture_mu_;  // recursive: without a concurrent decode, decode() runs inside splice()
  std::set<std::pair<int, int>> warmed_;              // shapes run once eagerly (GEMM plans made)
  DeviceMemory tables_dev_;
  DeviceMemory run_scratch_;  // per-run states of a pass
  std::vector<float> logits_host_;
  // Prefix cache.
  struct PrefixItem {
    SegmentDigest key;
    std::shared_ptr<Checkpoint> cp;
  };
  std::list<PrefixItem> prefix_lru_;
  size_t prefix_bytes_ = 0;
  std::vector<std::vector<int>> live_pages_unused_;
};

// ---- entry / sequence methods ----------------------------------------------------------------------------------

CudaEntry::CudaEntry(CudaBackend& b, SegmentEntry header, cudaStream_t stream)
    : header_(std::move(header)), owner_(&b), lay_(b.geometry(), b.kv_row_bytes(), n(), header_.seam_tokens() > 0) {
  const size_t total = lay_.total;
  device_ = b.device().index;
  mem_ = DeviceMemory(total, "segment entry (" + std::to_string(n()) + " tokens)", stream,
                      /*stream_ordered=*/stream != nullptr);
}

std::shared_ptr<const SegmentEntry> CudaEntry::host() const {
  std::lock_guard lock(mu_);
  if (!host_) host_ = owner_->entry_of_block(*owner_->copy_to_host(*this));
  return host_;
}

CudaSequence::~CudaSequence() { b_->release(slot_, pages_); }

CudaEntry::~CudaEntry() { owner_->defer_free(std::move(mem_)); }

size_t CudaSequence::bytes() const { return b_->sequence_state_bytes() + pages_.size() * b_->page_bytes(); }

ModelState CudaSequence::to_host() const { return b_->download_state(*this); }

// ---- construction ----------------------------------------------------------------------------------------------

CudaBackend::CudaBackend(const DeviceSpec& dev, ModelConfig cfg, const ModelWeights* weights,
                         const BackendOptions& opt, const std::filesystem::path& checkpoint)
    : cfg_(std::move(cfg)), dev_(dev), opt_(opt) {
  cfg_.validate();
  check_supported();
  int count = 0;
  check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (dev_.index < 0 || dev_.index >= count)
    throw std::invalid_argument("device " + dev_.name() + " does not exist (" + std::to_string(count) +
                                " CUDA device(s) visible)");
  set_device();
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  full_stream_ = stream_;
  check_cuda(cudaStreamCreateWithFlags(&xfer_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  check_cuda(cudaStreamCreateWithFlags(&d2h_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  check_cuda(cudaStreamCreateWithFlags(&h2d_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  {  // decode steps: the highest priority, so that their blocks go first as a prefill pass's blocks retire
    int least = 0, greatest = 0;
    check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    check_cuda(cudaStreamCreateWithPriority(&dec_stream_, cudaStreamNonBlocking, greatest), "cudaStreamCreate");
    dec_full_stream_ = dec_stream_;
  }
  if (opt_.decode_sms < -1)
    throw std::invalid_argument("decode_sms must be >= 0 (or -1: auto), got " + std::to_string(opt_.decode_sms));
  if (!opt_.concurrent_decode && opt_.decode_sms > 0)
    spdlog::warn("cuda backend on {}: decode_sms {} ignored: decode steps do not run beside prefill "
                 "(--concurrent-decode=false)",
                 dev_.name(), opt_.decode_sms);
  if (opt_.concurrent_decode && opt_.decode_sms != 0) {
    int want = opt_.decode_sms;
    if (want < 0) {  // auto: about an eighth of the device in multiples of 8 SMs; none on small devices
      int device_sms = 0;
      check_cuda(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, dev_.index), "SM count");
      want = device_sms >= 32 ? std::max(8, (device_sms / 8 + 4) / 8 * 8) : 0;
    }
    if (want > 0) {
      try {
        sms_ = SmPartition::create(dev_.index, want);
        check_cuda(cudaEventCreateWithFlags(&lane_ev_, cudaEventDisableTiming), "cudaEventCreate(lane)");
        spdlog::info("cuda backend on {}: SM partition while decode steps run beside prefill: {}", dev_.name(),
                     sms_->describe());
      } catch (const std::exception& e) {
        cudaGetLastError();  // a failed driver entry-point query leaves the runtime's last error set
        if (opt_.decode_sms > 0) throw;  // asked for explicitly
        sms_.reset();
        spdlog::warn("cuda backend on {}: no SM partition for decode beside prefill ({}); decode steps share every "
                     "SM with prefill passes (--decode-sms 0 silences this)",
                     dev_.name(), e.what());
      }
    }
  }
  pinned_ = std::make_shared<PinnedPool>(dev_.index);
  if (!weights && checkpoint.empty()) cfg_.weights_digest = random_weights_digest(opt_.random_weights_seed);
  fingerprint_ = model_fingerprint(cfg_, numerics());
  geom_ = EntryGeometry::of(cfg_);
  n_lin_ = cfg_.num_linear_layers();
  n_attn_ = cfg_.num_attention_layers();
  nk_ = cfg_.linear_num_key_heads, nv_ = cfg_.linear_num_value_heads, K_ = cfg_.linear_conv_kernel_dim;
  C_ = int(cfg_.conv_dim()), qd_ = int(cfg_.linear_q_dim()), vd_ = int(cfg_.linear_v_dim());
  nh_ = cfg_.num_attention_heads, nkv_ = cfg_.num_key_value_heads, hd_ = cfg_.head_dim, H_ = int(cfg_.hidden_size);
  state_layer_bytes_ = size_t(nv_) * kStateFloats * sizeof(float);
  conv_layer_bytes_ = size_t(K_ - 1) * C_ * 2;
  kv_row_ = size_t(nkv_) * hd_ * 2;
  eps_ = float(cfg_.rms_norm_eps);
  attn_scale_ = float(1.0 / std::sqrt(double(hd_)));
  gdn_scale_ = float(1.0 / std::sqrt(double(cfg_.linear_key_head_dim)));
  renorm_topk_ = cfg_.norm_topk_prob || cfg_.model_type.rfind("qwen3_5_moe", 0) == 0;
  if (!checkpoint.empty()) {
    w_ = DeviceWeights::load(cfg_, checkpoint);  // streamed: one layer on the host at a time
  } else if (weights) {
    w_ = DeviceWeights::upload(cfg_, *weights);
  } else {
    if (opt_.random_weights_seed == 0)
      throw std::invalid_argument("cuda backend: no weights given and random_weights_seed is 0");
    spdlog::warn("cuda backend: BENCHMARK-ONLY random weights (seed {}) made on {} from the config alone: the model's "
                 "text is meaningless",
                 opt_.random_weights_seed, dev_.name());
    w_ = DeviceWeights::random(cfg_, opt_.random_weights_seed);
  }
  allocate_pools();
  spdlog::info("cuda backend on {}: weights {}, {} state slots ({} each), {} KV pages of {} tokens ({}), activations "
               "for {} tokens ({})",
               dev_.name(), mib(w_.bytes()), opt_.max_sequences, mib(sequence_state_bytes()), num_pages_, kPage,
               mib(size_t(num_pages_) * page_bytes()), Tmax_, mib(act_.size()));
}

CudaBackend::~CudaBackend() {
  if (stream_) {
    cudaSetDevice(dev_.index);
    cudaStreamSynchronize(stream_);
    if (dec_full_stream_) cudaStreamSynchronize(dec_full_stream_);
    if (sms_) {
      cudaStreamSynchronize(sms_->prefill_stream());
      cudaStreamSynchronize(sms_->decode_stream());
    }
    prefix_lru_.clear();
    graphs_.clear();
    drain_frees();
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  if (lane_ev_) cudaEventDestroy(lane_ev_);
  for (cudaStream_t st : {d2h_stream_, h2d_stream_, dec_full_stream_}) {
    if (!st) continue;
    cudaStreamSynchronize(st);
    cudaStreamDestroy(st);
  }
  if (xfer_stream_) {
    cudaStreamSynchronize(xfer_stream_);
    cudaStreamDestroy(xfer_stream_);
  }
}

void CudaBackend::check_supported() const {
  const ModelConfig& c = cfg_;
  auto bad = [&](const std::string& what) {
    throw std::invalid_argument("cuda backend: " + what + " is not supported (model_type " + c.model_type + ")");
  };
  if (c.family != ModelFamily::Qwen)
    bad(std::string("model family ") + model_family_name(c.family) +
        " (the CUDA kernels cover Qwen3-Next / Qwen3.5 only; run it on the CPU backend)");
  if (c.num_linear_layers() > 0 && (c.linear_key_head_dim != D || c.linear_value_head_dim != D))
    bad("linear_key_head_dim " + std::to_string(c.linear_key_head_dim) + " / linear_value_head_dim " +
        std::to_string(c.linear_value_head_dim) + " (the GPU gated-delta kernels need 128 / 128)");
  if (c.num_attention_layers() > 0 && c.head_dim != 64 && c.head_dim != 128 && c.head_dim != 256)
    bad("attention head_dim " + std::to_string(c.head_dim) + " (64, 128 or 256)");
  if (c.hidden_size % 64 != 0) bad("hidden_size " + std::to_string(c.hidden_size) + " (a multiple of 64)");
  if (c.is_moe() && c.moe_intermediate_size % 32 != 0)
    bad("moe_intermediate_size " + std::to_string(c.moe_intermediate_size) + " (a multiple of 32)");
  if (c.is_moe() && c.shared_expert_intermediate_size % 32 != 0)
    bad("shared_expert_intermediate_size " + std::to_string(c.shared_expert_intermediate_size) + " (a multiple of 32)");
  if (c.conv_dim() % 8 != 0) bad("conv_dim " + std::to_string(c.conv_dim()) + " (a multiple of 8)");
  if (c.num_attention_layers() > 0 && c.rotary_dim() % 2 != 0) bad("odd rotary_dim");
  if (c.vocab_size > (int64_t(1) << 31) - 1) bad("vocab_size above 2^31");
}

void CudaBackend::allocate_pools() {
  if (opt_.max_sequences < 1) throw std::invalid_argument("max_sequences must be >= 1");
  if (opt_.max_batch_tokens < 64) throw std::invalid_argument("max_batch_tokens must be >= 64");
  const int S = opt_.max_sequences;
  for (int l = 0; l < n_lin_; ++l) {
    ssm_pool_.emplace_back(size_t(S) * state_layer_bytes_, "linear state slots");
    conv_pool_.emplace_back(size_t(S) * conv_layer_bytes_, "conv state slots");
  }
  for (int s = S - 1; s >= 0; --s) free_slots_.push_back(s);
  // Activations.
  Tmax_ = std::max(opt_.max_batch_tokens, opt_.max_segment_tokens);
  carve_activations(act_, size_t(Tmax_), "activations (--max-batch-tokens " + std::to_string(Tmax_) + ")", pre_);
  pre_.stream = stream_, pre_.gemm = &gemm_, pre_.moe_ws = &moe_ws_;
  carve_activations(dec_act_, size_t(opt_.max_sequences), "decode activations (--max-sequences)", dec_);
  dec_.stream = dec_stream_, dec_.gemm = &dec_gemm_, dec_.moe_ws = &dec_moe_ws_;
  dec_logits_ = DeviceMemory(size_t(opt_.max_sequences) * cfg_.vocab_size * 4, "decode logits (--max-sequences)");
  if (n_attn_) {
    const std::vector<float> inv = kernels::cpu::rope_inv_freq(cfg_.rope_theta, cfg_.rotary_dim());
    inv_freq_ = DeviceMemory(inv.size() * 4, "rope inverse frequencies");
    check_cuda(cudaMemcpy(inv_freq_.as(), inv.data(), inv.size() * 4, cudaMemcpyHostToDevice), "inv_freq upload");
  }
  // Workspaces sized once for the largest pass so that later passes allocate nothing.
  for (const DevLayer& L : w_.layers)
    if (L.is_moe) {
      moe_ws_.reserve(int(Tmax_), moe_view(L));
      dec_moe_ws_.reserve(opt_.max_sequences, moe_view(L));
      break;
    }
  if (cfg_.intermediate_size > 0) {
    moe_ws_.reserve_mlp(int(Tmax_), H_, int(cfg_.intermediate_size));
    dec_moe_ws_.reserve_mlp(opt_.max_sequences, H_, int(cfg_.intermediate_size));
  }
  // KV pool: what the budget allows, else 40% of what is free now.
  if (n_attn_) {
    size_t budget = opt_.kv_pool_bytes;
    if (!budget) {
      size_t free = 0, total = 0;
      check_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
      budget = free / 10 * 4;
    }
    num_pages_ = int(std::min<size_t>(budget / page_bytes(), size_t(1) << 30));
    if (num_pages_ < 1)
      throw ResourceExhausted("KV pool budget (--kv-pool-bytes) of " + std::to_string(budget) +
                              " bytes holds no page of " + std::to_string(page_bytes()) + " bytes");
    for (int a = 0; a < n_attn_; ++a) {
      k_pool_.emplace_back(size_t(num_pages_) * kPage * kv_row_, "KV pool (K)");
      v_pool_.emplace_back(size_t(num_pages_) * kPage * kv_row_, "KV pool (V)");
    }
    for (int p = num_pages_ - 1; p >= 0; --p) free_pages_.push_back(p);
  }
}

void CudaBackend::carve_activations(DeviceMemory& mem, size_t T, const std::string& what, Lane& lane) {
  Layout lay;
  const size_t o_ids = lay.add(T * 4), o_x = lay.add(T * H_ * 4), o_hn = lay.add(T * H_ * 2);
  size_t o_qkv = 0, o_conv = 0, o_q = 0, o_k = 0, o_v = 0, o_z = 0, o_a = 0, o_b = 0, o_o = 0;
  if (n_lin_) {
    o_qkv = lay.add(T * C_ * 2), o_conv = lay.add(T * C_ * 2), o_q = lay.add(T * qd_ * 2), o_k = lay.add(T * qd_ * 2);
    o_v = lay.add(T * vd_ * 2), o_z = lay.add(T * vd_ * 2), o_a = lay.add(T * nv_ * 2), o_b = lay.add(T * nv_ * 2);
    o_o = lay.add(T * vd_ * 2);
  }
  size_t o_qg = 0, o_kv = 0, o_aq = 0, o_ao = 0;
  if (n_attn_) {
    o_qg = lay.add(T * (cfg_.attn_output_gate ? 2 : 1) * nh_ * hd_ * 2), o_kv = lay.add(T * 2 * nkv_ * hd_ * 2);
    o_aq = lay.add(T * nh_ * hd_ * 2), o_ao = lay.add(T * nh_ * hd_ * 2);
  }
  mem = DeviceMemory(lay.total(), what);
  auto bp = [&](size_t off) { return reinterpret_cast<kc::bf16*>(mem.bytes_ptr(off)); };
  lane.ids = reinterpret_cast<int32_t*>(mem.bytes_ptr(o_ids));
  lane.x = reinterpret_cast<float*>(mem.bytes_ptr(o_x));
  lane.hn = bp(o_hn);
  if (n_lin_)
    lane.qkv = bp(o_qkv), lane.conv_out = bp(o_conv), lane.q = bp(o_q), lane.k = bp(o_k), lane.v = bp(o_v),
    lane.z = bp(o_z), lane.ga = bp(o_a), lane.gb = bp(o_b), lane.o = bp(o_o);
  if (n_attn_) lane.qg = bp(o_qg), lane.kv = bp(o_kv), lane.aq = bp(o_aq), lane.ao = bp(o_ao);
}

std::unique_ptr<CudaSequence> CudaBackend::new_sequence() {
  std::unique_lock lock(pool_mu_);
  if (free_slots_.empty())
    throw ResourceExhausted("all " + std::to_string(opt_.max_sequences) +
                            " sequence slots of the cuda backend are in use (--max-sequences)");
  const int slot = free_slots_.back();
  free_slots_.pop_back();
  lock.unlock();
  auto s = std::make_unique<CudaSequence>(*this, slot);
  for (int l = 0; l < n_lin_; ++l) {
    check_cuda(cudaMemsetAsync(ssm(l, slot), 0, state_layer_bytes_, stream_), "zero state slot");
    check_cuda(cudaMemsetAsync(convs(l, slot), 0, conv_layer_bytes_, stream_), "zero conv slot");
  }
  return s;
}

void CudaBackend::ensure_pages(CudaSequence& s, int64_t tokens) {
  if (!n_attn_) return;
  const size_t need = size_t((tokens + kPage - 1) / kPage);
  if (need <= s.pages_.size()) return;
  std::lock_guard lock(pool_mu_);
  const size_t more = need - s.pages_.size();
  if (more > free_pages_.size())
    throw ResourceExhausted("KV pool exhausted (--kv-pool-bytes): " + std::to_string(tokens) + " tokens need " +
                            std::to_string(need) + " pages of " + std::to_string(kPage) + " tokens, " +
                            std::to_string(free_pages_.size() + s.pages_.size()) + " available to this request of " +
                            std::to_string(num_pages_));
  for (size_t i = 0; i < more; ++i) {
    s.pages_.push_back(free_pages_.back());
    free_pages_.pop_back();
  }
}

void CudaBackend::release(int slot, const std::vector<int>& pages) {
  std::lock_guard lock(pool_mu_);
  free_slots_.push_back(slot);
  free_pages_.insert(free_pages_.end(), pages.begin(), pages.end());
}

BackendMemory CudaBackend::memory() const {
  BackendMemory m;
  m.weights = w_.bytes();
  m.kv_budget = size_t(num_pages_) * page_bytes();
  {
    std::lock_guard lock(pool_mu_);
    m.kv_used = size_t(num_pages_ - int(free_pages_.size())) * page_bytes();
  }
  m.workspace = act_.size() + dec_act_.size() + moe_ws_.bytes() + dec_moe_ws_.bytes() + ws_a_.bytes() + ws_c_.bytes() + ws_seam_.bytes() + ws_pieces_.bytes() +
                attn_ws_.bytes() + attn_dec_ws_.bytes() + run_scratch_.size() + tables_dev_.size() + logits_dev_.size();
  for (const auto& p : prefix_lru_) m.entries_used += p.cp->mem.size();
  size_t free = 0, total = 0;
  if (cudaSetDevice(dev_.index) == cudaSuccess && cudaMemGetInfo(&free, &total) == cudaSuccess) {
    m.device_free = free;
    m.device_total = total;
  }
  m.pinned_host = pinned_->bytes_held();
  return m;
}

void CudaBackend::check_ids(std::span<const int32_t> ids, const std::string& where) const {
  for (size_t t = 0; t < ids.size(); ++t)
    if (ids[t] < 0 || ids[t] >= cfg_.vocab_size)
      throw std::invalid_argument("token id " + std::to_string(ids[t]) + " at index " + std::to_string(t) + " of " +
                                  where + " is outside [0, " + std::to_string(cfg_.vocab_size) + ")");
}

// ---- layer pieces ----------------------------------------------------------------------------------------------

void CudaBackend::linear_gemms(const Lane& ln, const DevLinear& L, int T) {
  ln.gemm->linear(T, C_, H_, ln.hn, H_, L.in_proj_qkv, ln.qkv, CUDA_R_16BF, C_, 0.f, ln.stream);
  ln.gemm->linear(T, vd_, H_, ln.hn, H_, L.in_proj_z, ln.z, CUDA_R_16BF, vd_, 0.f, ln.stream);
  ln.gemm->linear(T, nv_, H_, ln.hn, H_, L.in_proj_b, ln.gb, CUDA_R_16BF, nv_, 0.f, ln.stream);
  ln.gemm->linear(T, nv_, H_, ln.hn, H_, L.in_proj_a, ln.ga, CUDA_R_16BF, nv_, 0.f, ln.stream);
}

// Gated RMSNorm of the delta-rule output times silu(z), then out_proj added into the residual stream.
void CudaBackend::linear_finish(const Lane& ln, const DevLinear& L, int T) {
  kc::rms_norm_gated(T * nv_, D, ln.o, ln.z, L.norm, eps_, ln.o, ln.stream);
  ln.gemm->linear(T, H_, vd_, ln.o, vd_, L.out_proj, ln.x, CUDA_R_32F, H_, 1.f, ln.stream);
}

kc::AttnGroups attn_groups(int num_groups, const int* q_start, const int* slot0, const int* block_table, int max_pages,
                           int total_q, int max_q, int max_kv) {
  kc::AttnGroups g;
  g.num_groups = num_groups, g.q_start = q_start, g.slot0 = slot0, g.block_table = block_table;
  g.max_pages = max_pages, g.total_q = total_q, g.max_q = max_q, g.max_kv = max_kv;
  return g;
}

// Gated attention layer a over T tokens (HF Qwen3NextAttention): projections, q/k norms and RoPE with K and V written
// to the pool rows kv_rows (DEVICE [T]) at positions (DEVICE [T]), attention over the groups (prefill, or one query
// per group in decode), the output gate, o_proj added into the residual stream.
void CudaBackend::attention_mixer(const Lane& ln, const DevAttention& A, int a, int T, const int* positions, const int* kv_rows,
                                  const kc::AttnGroups& groups, bool decode) {
  attention_gemms(ln, A, T);
  kc::bf16* kp = k_pool_[a].as<kc::bf16>();
  kc::bf16* vp = v_pool_[a].as<kc::bf16>();
  kc::attention_prepare(T, nh_, nkv_, hd_, cfg_.rotary_dim(), cfg_.attn_output_gate, ln.qg, ln.kv, ln.kv + nkv_ * hd_,
                        2 * nkv_ * hd_, A.q_norm, A.k_norm, eps_, positions, inv_freq_.as<float>(), kv_rows, ln.aq, kp, vp,
                        ln.stream);
  const bool gate = cfg_.attn_output_gate;
  const kc::bf16* g = gate ? ln.qg + hd_ : nullptr;
  const long g_token = gate ? long(2) * nh_ * hd_ : 0;
  const int g_head = gate ? 2 * hd_ : 0;
  if (decode)
    kc::attention_decode(groups, nh_, nkv_, hd_, ln.aq, kp, vp, attn_scale_, g, g_token, g_head, ln.ao, attn_dec_ws_,
                         ln.stream);
  else
    kc::attention_prefill(groups, nh_, nkv_, hd_, ln.aq, kp, vp, attn_scale_, g, g_token, g_head, ln.ao, attn_ws_, ln.stream);
  ln.gemm->linear(T, H_, nh_ * hd_, ln.ao, nh_ * hd_, A.o_proj, ln.x, CUDA_R_32F, H_, 1.f, ln.stream);
}

void CudaBackend::attention_gemms(const Lane& ln, const DevAttention& A, int T) {
  const int qrows = (cfg_.attn_output_gate ? 2 : 1) * nh_ * hd_;
  ln.gemm->linear(T, qrows, H_, ln.hn, H_, A.q_proj, ln.qg, CUDA_R_16BF, qrows, 0.f, ln.stream);
  ln.gemm->linear(T, 2 * nkv_ * hd_, H_, ln.hn, H_, A.kv_proj, ln.kv, CUDA_R_16BF, 2 * nkv_ * hd_, 0.f, ln.stream);
}

void CudaBackend::ffn(const Lane& ln, const DevLayer& L, int T, bool decode) {
  kc::rms_norm_residual(T, H_, ln.x, H_, nullptr, L.post_attention_layernorm, eps_, ln.hn, ln.stream);
  if (L.is_moe) {
    const kc::GroupedGemm impl = kc::grouped_gemm_for_tokens(T, decode);
    kc::moe_forward(T, ln.hn, moe_view(L), ln.x, *ln.moe_ws, *ln.gemm, impl, ln.stream);
  } else {
    kc::mlp_forward(T, ln.hn, H_, int(cfg_.intermediate_size), L.ffn.gate_up, L.ffn.down, ln.x, *ln.moe_ws, *ln.gemm,
                    ln.stream);
  }
}

kc::MoeWeightsView CudaBackend::moe_view(const DevLayer& L) const {
  kc::MoeWeightsView v;
  v.E = cfg_.num_experts, v.H = H_, v.I = int(cfg_.moe_intermediate_size), v.topk = cfg_.num_experts_per_tok;
  v.renormalize = renorm_topk_;
  v.router = L.ffn.router, v.experts_gate_up = L.ffn.experts_gate_up, v.experts_down = L.ffn.experts_down;
  v.Is = int(cfg_.shared_expert_intermediate_size);
  v.shared_gate_up = L.ffn.shared_gate_up, v.shared_down = L.ffn.shared_down, v.shared_gate = L.ffn.shared_gate;
  return v;
}

void CudaBackend::lm_head(int rows, const int* rows_index, std::vector<float>& logits) {
  const size_t V = size_t(cfg_.vocab_size);
  ensure_capacity(logits_dev_, size_t(rows) * V * 4, "logits");
  kc::rms_norm_residual(rows, H_, pre_.x, H_, rows_index, w_.final_norm, eps_, pre_.hn, stream_);
  gemm_.linear(rows, int(V), H_, pre_.hn, H_, w_.lm_head, logits_dev_.as(), CUDA_R_32F, long(V), 0.f, stream_);
  logits.resize(size_t(rows) * V);
  check_cuda(cudaMemcpyAsync(logits.data(), logits_dev_.as(), logits.size() * 4, cudaMemcpyDeviceToHost, stream_),
             "logits download");
}

// ---- folds -----------------------------------------------------------------------------------------------------

// Appends fold f's affine steps for linear layer l (DESIGN.md 3.3): Install S = S(C|0) = T_int S_seam + S_int (S_int
// when the seam is empty); Transition S <- T_C S + S(C|0), which for the w = 0 entries transition mode splices
// (check_entry) is T_int, S_int; Interior S <- T_int S + S_int; Naive S <- S + S(C|0) (S(C|0) precomputed in
// `naive_whole` at [fold index][layer]).
void fold_steps(const Fold& f, int l, std::vector<kc::AffineStep>& out, const float* naive_whole) {
  switch (f.kind) {
    case Fold::Install:
      if (f.e->has_seam()) {
        out.push_back({nullptr, f.e->S_seam(l), nullptr, 0.f});
        out.push_back({f.e->T_int(l), f.e->S_int(l), nullptr, 1.f});
      } else {
        out.push_back({nullptr, f.e->S_int(l), nullptr, 0.f});
      }
      break;
    case Fold::Transition:
      if (f.e->has_seam()) throw std::logic_error("fold_steps: transition mode folds entries made with w = 0");
      out.push_back({f.e->T_int(l), f.e->S_int(l), nullptr, 1.f});
      break;
    case Fold::Interior: out.push_back({f.e->T_int(l), f.e->S_int(l), nullptr, 1.f}); break;
    case Fold::Naive: out.push_back({nullptr, naive_whole, nullptr, 1.f}); break;
  }
}

// KV rows a fold brings in, per attention layer: the entry's rows [from, n) at real positions base + from ...
struct KvRows {
  std::vector<const kc::bf16*> k, v;  // [n_attn][rows]
  std::vector<int> deltas, dst;        // [rows]
};

void CudaBackend::apply_folds(CudaSequence& s, const std::vector<Fold>& folds) {
  if (folds.empty()) return;
  Tables tb;
  // Naive folds need S(C|0) of each entry: a chain per (fold, layer) from zero.
  DeviceMemory whole;
  std::vector<int> naive_index(folds.size(), -1);
  int n_naive = 0;
  for (size_t i = 0; i < folds.size(); ++i)
    if (folds[i].kind == Fold::Naive) naive_index[i] = n_naive++;
  if (n_naive && n_lin_) {
    whole = DeviceMemory(size_t(n_naive) * n_lin_ * state_layer_bytes_, "naive-mode segment states", stream_, true);
    std::vector<kc::AffineStep> st;
    std::vector<float*> fin;
    for (size_t i = 0; i < folds.size(); ++i) {
      if (naive_index[i] < 0) continue;
      for (int l = 0; l < n_lin_; ++l) {
        if (folds[i].e->has_seam()) {  // S(C|0) = T_int S_seam + S_int
          st.push_back({nullptr, folds[i].e->S_seam(l), nullptr, 0.f});
          st.push_back({folds[i].e->T_int(l), folds[i].e->S_int(l), nullptr, 1.f});
        } else {  // S_int, then an identity step (every chain has two)
          st.push_back({nullptr, folds[i].e->S_int(l), nullptr, 0.f});
          st.push_back({nullptr, nullptr, nullptr, 1.f});
        }
        fin.push_back(reinterpret_cast<float*>(whole.bytes_ptr((size_t(naive_index[i]) * n_lin_ + l) * state_layer_bytes_)));
      }
    }
    Tables t0;
    const size_t o_st = t0.add(st), o_fin = t0.add(fin);
    DeviceMemory dev;
    t0.upload(dev, stream_);
    kc::affine_chain(n_naive * n_lin_, nv_, 2, t0.dev<kc::AffineStep>(o_st), nullptr, t0.dev<float*>(o_fin), stream_);
    check_cuda(cudaStreamSynchronize(stream_), "naive states");
  }
  // Linear layers: one chain per layer from the slot state back into it; conv state <- the last fold's tail.
  std::vector<kc::AffineStep> steps;
  std::vector<const float*> init;
  std::vector<float*> fin;
  std::vector<kc::CopyDesc> copies;
  int steps_per_chain = 0;
  for (const Fold& f : folds) steps_per_chain += f.steps();
  for (int l = 0; l < n_lin_; ++l) {
    for (size_t i = 0; i < folds.size(); ++i) {
      const float* nw = naive_index[i] >= 0 ? reinterpret_cast<const float*>(whole.bytes_ptr(
                                                  (size_t(naive_index[i]) * n_lin_ + l) * state_layer_bytes_))
                                            : nullptr;
      fold_steps(folds[i], l, steps, nw);
    }
    init.push_back(ssm(l, s.slot_));
    fin.push_back(ssm(l, s.slot_));
    copies.push_back({folds.back().e->conv(l), convs(l, s.slot_), long(conv_layer_bytes_)});
  }
  // Attention layers: K/V rows of every fold.
  KvRows kv;
  kv.k.resize(n_attn_), kv.v.resize(n_attn_);
  std::vector<std::vector<const kc::bf16*>> kp(n_attn_), vp(n_attn_);
  int64_t top = s.n_;
  for (const Fold& f : folds) top = std::max<int64_t>(top, f.base + f.e->n());
  ensure_pages(s, top);
  for (const Fold& f : folds) {
    for (int j = f.from(); j < f.e->n(); ++j) {
      kv.deltas.push_back(int(f.base));
      kv.dst.push_back(page_row(s, f.base + j));
      for (int a = 0; a < n_attn_; ++a) {
        kp[a].push_back(f.e->K(a) + size_t(j) * nkv_ * hd_);
        vp[a].push_back(f.e->V(a) + size_t(j) * nkv_ * hd_);
      }
    }
  }
  const size_t o_steps = tb.add(steps), o_init = tb.add(init), o_fin = tb.add(fin), o_cp = tb.add(copies);
  const size_t o_delta = tb.add(kv.deltas), o_dst = tb.add(kv.dst);
  std::vector<size_t> o_k(n_attn_), o_v(n_attn_);
  for (int a = 0; a < n_attn_; ++a) o_k[a] = tb.add(kp[a]), o_v[a] = tb.add(vp[a]);
  tb.upload(tables_dev_, stream_);
  kc::affine_chain(n_lin_, nv_, steps_per_chain, tb.dev<kc::AffineStep>(o_steps), tb.dev<const float*>(o_init),
                   tb.dev<float*>(o_fin), stream_);
  if (n_lin_) kc::batched_copy(int(copies.size()), tb.dev<kc::CopyDesc>(o_cp), stream_);
  const int rows = int(kv.dst.size());
  for (int a = 0; a < n_attn_ && rows; ++a)
    kc::kv_import(rows, nkv_, hd_, cfg_.rotary_dim(), tb.dev<const kc::bf16*>(o_k[a]), tb.dev<const kc::bf16*>(o_v[a]),
                  tb.dev<int>(o_delta), inv_freq_.as<float>(), tb.dev<int>(o_dst), k_pool_[a].as<kc::bf16>(),
                  v_pool_[a].as<kc::bf16>(), stream_);
  for (const Fold& f : folds) s.n_ = std::max<int64_t>(s.n_, f.base + f.e->n());
  check_cuda(cudaStreamSynchronize(stream_), "apply_folds");
}

// ---- one forward pass over runs of spans ----------------------------------------------------------------------

std::vector<float> CudaBackend::run_pass(CudaSequence& s, const std::vector<Run>& runs, bool want_logits,
                                         bool all_logits, float* mass_dev, std::span<const CheckpointCut> cuts) {
  const int R = int(runs.size());
  // Tokens, positions, KV rows, attention groups, run boundaries.
  std::vector<int32_t> ids, pos, rows;
  std::vector<int> q_start{0}, slot0, run_cu{0};
  int max_q = 0;
  int64_t top = s.n_;
  for (const Run& r : runs) {
    for (const Span& sp : r.spans) top = std::max<int64_t>(top, sp.position + int64_t(sp.ids.size()));
    for (const Fold& f : r.folds_before) top = std::max<int64_t>(top, f.base + f.e->n());
  }
  ensure_pages(s, top);
  for (const Run& r : runs) {
    for (const Span& sp : r.spans) {
      for (size_t t = 0; t < sp.ids.size(); ++t) {
        ids.push_back(sp.ids[t]);
        pos.push_back(int32_t(sp.position + int64_t(t)));
        rows.push_back(page_row(s, sp.position + int64_t(t)));
      }
      q_start.push_back(int(ids.size()));
      slot0.push_back(int(sp.position));
      max_q = std::max(max_q, int(sp.ids.size()));
    }
    run_cu.push_back(int(ids.size()));
  }
  const int T = int(ids.size());
  const int G = int(slot0.size());
  if (T > Tmax_) throw std::logic_error("run_pass: more tokens than max_batch_tokens");
  const int max_pages = std::max<int>(1, int(s.pages_.size()));
  std::vector<int> bt;
  for (int g = 0; g < G; ++g) {
    bt.insert(bt.end(), s.pages_.begin(), s.pages_.end());
    bt.resize(size_t(g + 1) * max_pages, 0);
  }
  // Linear layers: chain steps, conv initial states, run states.
  const bool chain = R > 1;
  const size_t S1 = state_layer_bytes_;
  Layout rl;
  const size_t o_init = rl.add(R * S1), o_fin = rl.add(R * S1), o_tz = rl.add(std::max(R - 1, 0) * S1),
               o_sz = rl.add(std::max(R - 1, 0) * S1), o_cs = rl.add(R * conv_layer_bytes_);
  if (n_lin_) ensure_capacity(run_scratch_, rl.total(), "per-run states of a pass");
  auto rs_f = [&](size_t off, int i) { return reinterpret_cast<float*>(run_scratch_.bytes_ptr(off + i * S1)); };
  kc::bf16* conv_states = n_lin_ ? reinterpret_cast<kc::bf16*>(run_scratch_.bytes_ptr(o_cs)) : nullptr;
  std::vector<kc::AffineStep> steps;
  std::vector<const float*> chain_init;
  std::vector<kc::CopyDesc> conv_in, conv_out_copy, fin_copy;
  int steps_per_chain = 0;
  if (chain) {
    steps_per_chain = 1;
    for (int r = 1; r < R; ++r) {
      steps_per_chain += 1;
      for (const Fold& f : runs[r].folds_before) steps_per_chain += f.steps();
      if (runs[r].folds_before.empty()) throw std::logic_error("run_pass: a run after the first has no fold");
    }
  }
  for (int l = 0; l < n_lin_; ++l) {
    if (chain) {
      steps.push_back({nullptr, nullptr, rs_f(o_init, 0), 1.f});
      for (int r = 1; r < R; ++r) {
        steps.push_back({rs_f(o_tz, r - 1), rs_f(o_sz, r - 1), nullptr, 1.f});
        for (const Fold& f : runs[r].folds_before) fold_steps(f, l, steps, nullptr);
        steps.back().out = rs_f(o_init, r);
      }
      chain_init.push_back(ssm(l, s.slot_));
      fin_copy.push_back({rs_f(o_fin, R - 1), ssm(l, s.slot_), long(S1)});
    }
    for (int r = 0; r < R; ++r) {
      const void* src = r == 0 ? static_cast<const void*>(convs(l, s.slot_))
                               : static_cast<const void*>(runs[r].folds_before.back().e->conv(l));
      conv_in.push_back({src, reinterpret_cast<char*>(conv_states) + size_t(r) * conv_layer_bytes_, long(conv_layer_bytes_)});
    }
    conv_out_copy.push_back(
        {reinterpret_cast<char*>(conv_states) + size_t(R - 1) * conv_layer_bytes_, convs(l, s.slot_), long(conv_layer_bytes_)});
  }
  for (const Run& r : runs)
    for (const Fold& f : r.folds_before)
      if (f.kind == Fold::Naive) throw std::logic_error("run_pass: naive folds go through apply_folds");
  // KV rows of the folds inside the pass.
  std::vector<std::vector<const kc::bf16*>> kp(n_attn_), vp(n_attn_);
  std::vector<int> kv_delta, kv_dst;
  for (const Run& r : runs)
    for (const Fold& f : r.folds_before)
      for (int j = f.from(); j < f.e->n(); ++j) {
        kv_delta.push_back(int(f.base));
        kv_dst.push_back(page_row(s, f.base + j));
        for (int a = 0; a < n_attn_; ++a) {
          kp[a].push_back(f.e->K(a) + size_t(j) * nkv_ * hd_);
          vp[a].push_back(f.e->V(a) + size_t(j) * nkv_ * hd_);
        }
      }
  // Prefix checkpoints ending in this pass: the pass-local token count at each; per linear layer the state pointers
  // (written by the scan) and the conv tails (the K-1 conv inputs before the cut: this pass's rows, or the history
  // the pass starts from where the cut is within K-1 tokens of the pass's start).
  std::vector<int> cut_at;
  std::vector<const CheckpointCut*> cut_of;
  for (const CheckpointCut& c : cuts) {
    int at = -1;
    for (size_t g = 0; g < slot0.size() && at < 0; ++g) {
      const int64_t p0 = slot0[g], len = q_start[g + 1] - q_start[g];
      if (c.at > p0 && c.at <= p0 + len) at = q_start[g] + int(c.at - p0);
    }
    if (at < 0) continue;
    if (R > 1) throw std::logic_error("run_pass: prefix checkpoints in a pass with folds");
    if (!cut_at.empty() && at <= cut_at.back()) throw std::logic_error("run_pass: prefix checkpoints out of order");
    cut_at.push_back(at);
    cut_of.push_back(&c);
  }
  const int ncut = int(cut_at.size());
  std::vector<float*> cut_states;
  std::vector<kc::CopyDesc> cut_convs;
  const size_t conv_row = size_t(C_) * sizeof(kc::bf16);
  for (int l = 0; l < n_lin_ && ncut; ++l)
    for (int c = 0; c < ncut; ++c) {
      cut_states.push_back(checkpoint_state(*cut_of[c]->cp, l));
      char* dst = checkpoint_conv(*cut_of[c]->cp, l);
      for (int j = 0; j < K_ - 1; ++j) {
        const int src_row = cut_at[c] - (K_ - 1) + j;  // < 0: row K-1 + src_row of the pass's initial history
        const char* src = src_row >= 0 ? reinterpret_cast<const char*>(pre_.qkv) + size_t(src_row) * conv_row
                                       : reinterpret_cast<const char*>(conv_states) + size_t(K_ - 1 + src_row) * conv_row;
        cut_convs.push_back({src, dst + size_t(j) * conv_row, long(conv_row)});
      }
    }
  // Logit rows: the last span's tokens (all_logits) or its last token.
  std::vector<int> logit_rows;
  if (want_logits) {
    const int last_start = q_start[G - 1];
    for (int t = all_logits ? last_start : T - 1; t < T; ++t) logit_rows.push_back(t);
  }
  Tables tb;
  const size_t t_ids = tb.add(ids), t_pos = tb.add(pos), t_rows = tb.add(rows), t_qs = tb.add(q_start),
               t_s0 = tb.add(slot0), t_bt = tb.add(bt), t_cu = tb.add(run_cu), t_steps = tb.add(steps),
               t_cinit = tb.add(chain_init), t_cin = tb.add(conv_in), t_cout = tb.add(conv_out_copy),
               t_fin = tb.add(fin_copy), t_kd = tb.add(kv_delta), t_kdst = tb.add(kv_dst), t_lr = tb.add(logit_rows),
               t_cst = tb.add(cut_states), t_cconv = tb.add(cut_convs);
  std::vector<size_t> t_k(n_attn_), t_v(n_attn_);
  for (int a = 0; a < n_attn_; ++a) t_k[a] = tb.add(kp[a]), t_v[a] = tb.add(vp[a]);
  tb.upload(tables_dev_, stream_);
  check_cuda(cudaMemcpyAsync(pre_.ids, tb.dev<int32_t>(t_ids), size_t(T) * 4, cudaMemcpyDeviceToDevice, stream_), "ids");

  const kc::AttnGroups groups =
      attn_groups(G, tb.dev<int>(t_qs), tb.dev<int>(t_s0), tb.dev<int>(t_bt), max_pages, T, max_q, int(top));
  const int import_rows = int(kv_dst.size());

  kc::embed_gather(T, H_, pre_.ids, w_.embed, pre_.x, stream_);
  for (int i = 0; i < cfg_.num_hidden_layers; ++i) {
    const DevLayer& L = w_.layers[i];
    kc::rms_norm_residual(T, H_, pre_.x, H_, nullptr, L.input_layernorm, eps_, pre_.hn, stream_);
    if (L.type == LayerType::Linear) {
      const int l = cfg_.linear_index(i);
      linear_gemms(pre_, L.linear, T);
      kc::batched_copy(R, tb.dev<kc::CopyDesc>(t_cin) + size_t(l) * R, stream_);
      if (ncut)  // conv tails at the checkpoints, before the conv overwrites the history
        kc::batched_copy(ncut * (K_ - 1), tb.dev<kc::CopyDesc>(t_cconv) + size_t(l) * ncut * (K_ - 1), stream_);
      kc::conv1d_silu_prefill(R, tb.dev<int>(t_cu), T, C_, K_, pre_.qkv, L.linear.conv1d, conv_states, pre_.conv_out, stream_);
      kc::batched_copy(1, tb.dev<kc::CopyDesc>(t_cout) + l, stream_);
      kc::split_qkv(T, qd_, vd_, pre_.conv_out, pre_.q, pre_.k, pre_.v, stream_);
      kc::GdnPrefillArgs g;
      g.num_k_heads = nk_, g.num_v_heads = nv_, g.q = pre_.q, g.k = pre_.k, g.v = pre_.v;
      g.gate_a = pre_.ga, g.gate_b = pre_.gb, g.A_log = L.linear.A_log, g.dt_bias = L.linear.dt_bias;
      g.l2norm_qk = true, g.scale = gdn_scale_;
      if (chain) {
        kc::GdnPrefillArgs a = g;  // phase A: runs 0..R-2 from zero: (T, S(run|0))
        a.num_seqs = R - 1, a.cu_seqlens_host = run_cu.data();
        a.final_state = rs_f(o_sz, 0), a.transition = rs_f(o_tz, 0), a.out = nullptr;
        kc::gdn_prefill(a, ws_a_, stream_);
        kc::affine_chain(1, nv_, steps_per_chain, tb.dev<kc::AffineStep>(t_steps) + size_t(l) * steps_per_chain,
                         tb.dev<const float*>(t_cinit) + l, nullptr, stream_);
        g.initial_state = rs_f(o_init, 0), g.final_state = rs_f(o_fin, 0);
      } else {
        g.initial_state = ssm(l, s.slot_), g.final_state = ssm(l, s.slot_);
      }
      g.num_seqs = R, g.cu_seqlens_host = run_cu.data(), g.out = pre_.o;
      if (ncut) {
        g.num_checkpoints = ncut, g.checkpoint_tokens_host = cut_at.data();
        g.checkpoint_states = tb.dev<float* const>(t_cst) + size_t(l) * ncut;
      }
      kc::gdn_prefill(g, ws_c_, stream_);
      if (chain) kc::batched_copy(1, tb.dev<kc::CopyDesc>(t_fin) + l, stream_);
      linear_finish(pre_, L.linear, T);
    } else {
      const int a = cfg_.attention_index(i);
      if (import_rows)  // the folded entries' K (re-rotated to real positions) and V, before anything attends to them
        kc::kv_import(import_rows, nkv_, hd_, cfg_.rotary_dim(), tb.dev<const kc::bf16*>(t_k[a]),
                      tb.dev<const kc::bf16*>(t_v[a]), tb.dev<int>(t_kd), inv_freq_.as<float>(), tb.dev<int>(t_kdst),
                      k_pool_[a].as<kc::bf16>(), v_pool_[a].as<kc::bf16>(), stream_);
      attention_mixer(pre_, L.attention, a, T, tb.dev<int>(t_pos), tb.dev<int>(t_rows), groups, false);
      if (mass_dev)  // the last span's last token over every slot it sees (PrefillOptions::attention_mass)
        kc::attention_key_mass(1, nh_, nkv_, hd_, pre_.aq + size_t(T - 1) * nh_ * hd_, slot0[G - 1] + (T - 1 - q_start[G - 1]),
                               tb.dev<int>(t_bt) + size_t(G - 1) * max_pages, k_pool_[a].as<kc::bf16>(), attn_scale_,
                               mass_dev, stream_);
    }
    ffn(pre_, L, T);
  }
  for (const Run& r : runs)
    for (const Fold& f : r.folds_before) s.n_ = std::max<int64_t>(s.n_, f.base + f.e->n());
  s.n_ = std::max<int64_t>(s.n_, top);
  std::vector<float> logits;
  if (want_logits) lm_head(int(logit_rows.size()), tb.dev<int>(t_lr), logits);
  check_cuda(cudaStreamSynchronize(stream_), "forward pass");
  return logits;
}

void CudaBackend::snapshot_linear(const CudaSequence& s, std::vector<std::vector<float>>& out) const {
  out.assign(n_lin_, std::vector<float>(state_layer_bytes_ / 4));
  for (int l = 0; l < n_lin_; ++l)
    check_cuda(cudaMemcpyAsync(out[l].data(), ssm(l, s.slot_), state_layer_bytes_, cudaMemcpyDeviceToHost, stream_),
               "state snapshot");
  check_cuda(cudaStreamSynchronize(stream_), "state snapshot");
}

// Packs items into passes of at most max_batch_tokens tokens and runs them. A span longer than the room left is cut;
// its rest continues in the next pass from the slot state. Folds before the first span of a pass are applied
// before it (apply_folds); later folds go between the pass's runs.
void CudaBackend::execute(CudaSequence& s, const std::vector<Item>& items_in, bool all_logits,
                          std::vector<float>& logits, bool keep_context, std::vector<std::vector<float>>* context,
                          std::vector<float>* mass, std::span<const CheckpointCut> cuts, const SplicePlan* pacing) {
  std::vector<Item> items = items_in;
  // Tokens per pass: max_batch_tokens, or the splice's chunk (the query with all_logits still in one pass).
  const int64_t cap = pacing && pacing->max_pass_tokens > 0 ? std::min(Tmax_, pacing->max_pass_tokens) : Tmax_;
  const size_t n = items.size();
  std::vector<Run> runs;
  int64_t used = 0;
  int64_t kv_len = 0;  // the KV length after the last span (the mass vector's length)
  for (const Item& it : items) {
    kv_len = std::max<int64_t>(kv_len, it.span.position + int64_t(it.span.ids.size()));
    for (const Fold& f : it.folds) kv_len = std::max<int64_t>(kv_len, f.base + f.e->n());
  }
  if (mass && n_attn_) {
    ensure_capacity(mass_dev_, size_t(kv_len) * 4, "refresh probe");
    check_cuda(cudaMemsetAsync(mass_dev_.as(), 0, size_t(kv_len) * 4, stream_), "refresh probe");
  }
  auto flush = [&](bool last) {
    if (runs.empty()) return;
    std::vector<float> lg =
        run_pass(s, runs, last, all_logits, last && mass && n_attn_ ? mass_dev_.as<float>() : nullptr, cuts);
    if (last) logits = std::move(lg);
    runs.clear();
    used = 0;
    if (!last && pacing) pause(*pacing, "between two of its passes");
  };
  for (size_t i = 0; i < n; ++i) {
    Item it = items[i];
    const bool is_last = i + 1 == n;
    const int64_t pass_cap = is_last && all_logits ? Tmax_ : cap;
    if (is_last && keep_context) {  // the state after every segment: flush, fold, snapshot, then the query alone
      flush(false);
      apply_folds(s, it.folds);
      it.folds.clear();
      snapshot_linear(s, *context);
    }
    while (true) {
      const int64_t len = int64_t(it.span.ids.size());
      // The query's logits (all of them with all_logits) come from one pass: start a new one when it would be cut.
      if (is_last && all_logits && !runs.empty() && len <= Tmax_ && len > Tmax_ - used) flush(false);
      if (!it.folds.empty() && runs.empty()) {  // folds at the start of a pass: into the slot before it
        apply_folds(s, it.folds);
        it.folds.clear();
      }
      const int64_t room = std::max<int64_t>(pass_cap - used, 0);
      if (len <= room) {
        if (runs.empty() || !it.folds.empty()) runs.push_back(Run{it.folds, {}});
        runs.back().spans.push_back(it.span);
        used += len;
        break;
      }
      if (room > 0 && it.folds.empty()) {  // cut the span: the head fills this pass
        if (runs.empty()) runs.push_back(Run{});
        runs.back().spans.push_back({it.span.ids.subspan(0, size_t(room)), it.span.position});
        it.span = {it.span.ids.subspan(size_t(room)), it.span.position + room};
      }
      flush(false);
    }
  }
  flush(true);
  if (!cuts.empty()) save_checkpoint_kv(s, cuts);
  if (mass) {
    mass->assign(size_t(kv_len), 0.f);
    if (n_attn_) {
      check_cuda(cudaMemcpyAsync(mass->data(), mass_dev_.as(), size_t(kv_len) * 4, cudaMemcpyDeviceToHost, stream_),
                 "refresh probe");
      check_cuda(cudaStreamSynchronize(stream_), "refresh probe");
    }
  }
}

void CudaBackend::pause(const SplicePlan& plan, const char* where) {
  if (plan.between_passes) plan.between_passes();
  if (plan.cancel && plan.cancel->load()) throw SpliceCancelled(std::string("splice cancelled ") + where);
}

// ---- checkpoints (prefix mode) ---------------------------------------------------------------------------------

void CudaBackend::save_checkpoint_kv(const CudaSequence& s, std::span<const CheckpointCut> cuts) {
  std::vector<kc::CopyDesc> c;
  for (const CheckpointCut& cut : cuts)
    for (int a = 0; a < n_attn_; ++a)
      for (int kvi = 0; kvi < 2; ++kvi) {
        char* p = checkpoint_kv(*cut.cp, a, kvi);
        for (int64_t t = cut.cp->start; t < cut.cp->n;) {  // runs of rows within one page
          const int64_t cnt = std::min<int64_t>(kPage - t % kPage, cut.cp->n - t);
          const char* src = (kvi ? v_pool_[a] : k_pool_[a]).bytes_ptr(size_t(page_row(s, t)) * kv_row_);
          c.push_back({src, p, long(cnt * kv_row_)}), p += cnt * kv_row_;
          t += cnt;
        }
      }
  if (c.empty()) return;
  Tables tb;
  const size_t o = tb.add(c);
  tb.upload(tables_dev_, stream_);
  kc::batched_copy(int(c.size()), tb.dev<kc::CopyDesc>(o), stream_);
  check_cuda(cudaStreamSynchronize(stream_), "prefix checkpoint");
}

void CudaBackend::restore_chain(CudaSequence& s, const std::vector<const Checkpoint*>& chain) {
  const Checkpoint& last = *chain.back();
  ensure_pages(s, last.n);
  std::vector<kc::CopyDesc> c;
  for (int l = 0; l < n_lin_; ++l) {
    c.push_back({checkpoint_state(last, l), ssm(l, s.slot_), long(state_layer_bytes_)});
    c.push_back({checkpoint_conv(last, l), convs(l, s.slot_), long(conv_layer_bytes_)});
  }
  for (const Checkpoint* cp : chain)
    for (int a = 0; a < n_attn_; ++a)
      for (int kvi = 0; kvi < 2; ++kvi) {
        const char* p = checkpoint_kv(*cp, a, kvi);
        for (int64_t t = cp->start; t < cp->n;) {
          const int64_t cnt = std::min<int64_t>(kPage - t % kPage, cp->n - t);
          char* dst = (kvi ? v_pool_[a] : k_pool_[a]).bytes_ptr(size_t(page_row(s, t)) * kv_row_);
          c.push_back({p, dst, long(cnt * kv_row_)}), p += cnt * kv_row_;
          t += cnt;
        }
      }
  Tables tb;
  const size_t o = tb.add(c);
  tb.upload(tables_dev_, stream_);
  kc::batched_copy(int(c.size()), tb.dev<kc::CopyDesc>(o), stream_);
  check_cuda(cudaStreamSynchronize(stream_), "prefix restore");
  s.n_ = last.n;
}

// ---- splice ----------------------------------------------------------------------------------------------------

void CudaBackend::check_entry(const PlanSegment& seg, size_t i, const SplicePlan& plan) const {
  const std::string which = "segment " + std::to_string(i);
  if (!seg.entry)
    throw std::invalid_argument("splice: " + which + " has no entry (required by mode " + splice_mode_name(plan.mode) +
                                ")");
  const auto* ce = dynamic_cast<const CudaEntry*>(seg.entry.get());
  if (!ce) throw EntryError("splice: " + which + "'s entry is not resident on this backend (import it first)");
  if (ce->no_transitions)
    throw EntryError("splice: " + which + "'s entry was built with benchmark_skip_transitions (no T_C)");
  if (ce->device() != dev_.index)
    throw EntryError("splice: " + which + "'s entry lives on cuda:" + std::to_string(ce->device()) + ", not " +
                     dev_.name());
  ce->header().check_compatible(fingerprint_, geom_, entry_seam_width(plan.mode, plan.seam_width), numerics());
  if (!seg.ids.empty() && seg.ids != ce->header().token_ids)
    throw std::invalid_argument("splice: " + which + "'s token ids differ from its entry's");
}

std::vector<Item> CudaBackend::hypic_items(const SplicePlan& plan, const std::vector<char>& whole, int64_t& pos,
                                           int64_t& computed, std::vector<int>& recomputed) const {
  auto entry_of = [&](size_t i) { return static_cast<const CudaEntry*>(plan.segments[i].entry.get()); };
  std::vector<Item> items;
  std::vector<Fold> pending{{Fold::Install, entry_of(0), 0}};
  pos = entry_of(0)->n();
  for (size_t i = 1; i < plan.segments.size(); ++i) {
    const CudaEntry* e = entry_of(i);  // null for a segment recomputed whole that came without an entry
    const std::vector<int32_t>& ids = plan.segments[i].ids.empty() ? e->header().token_ids : plan.segments[i].ids;
    const int n = int(ids.size()), sw = whole[i] ? n : std::min(plan.seam_width, n);
    if (whole[i]) recomputed.push_back(int(i));
    if (sw > 0) {
      items.push_back({std::move(pending), {std::span<const int32_t>(ids).subspan(0, size_t(sw)), pos}});
      pending.clear();
      computed += sw;
    }
    if (n > sw) pending.push_back({Fold::Interior, e, pos});
    pos += n;
  }
  items.push_back({std::move(pending), {std::span<const int32_t>(plan.query), pos}});
  return items;
}

SpliceOutput CudaBackend::splice(const SplicePlan& plan) {
  set_device();
  std::lock_guard<std::recursive_mutex> no_capture(capture_mu_);  // see capture_mu_
  drain_frees();
  PartitionScope lane(*this);
  check_recompute_request(plan.mode, plan.recompute_segments, plan.refresh_segments, plan.refresh_tail,
                          plan.segments.size());
  if (plan.segments.empty()) throw std::invalid_argument("splice: the segment list is empty");
  if (plan.query.empty()) throw std::invalid_argument("splice: the query has no tokens");
  if (plan.all_query_logits && int64_t(plan.query.size()) > Tmax_)
    throw std::invalid_argument("splice: all_query_logits needs a query of at most max_batch_tokens (" +
                                std::to_string(Tmax_) + ") tokens, got " + std::to_string(plan.query.size()));
  if (plan.seam_width < 0)
    throw std::invalid_argument("splice: seam width must be >= 0, got " + std::to_string(plan.seam_width));
  const bool cached = plan.mode == SpliceMode::Naive || plan.mode == SpliceMode::Transition ||
                      plan.mode == SpliceMode::Hypic;
  check_ids(plan.query, "the query");
  // Hypic: a segment recomputed whole in the final splice may come without an entry (its ids suffice).
  const std::vector<char> whole_final =
      plan.mode == SpliceMode::Hypic
          ? whole_segments_before_refresh(plan.recompute_segments, plan.refresh_tail, plan.segments.size())
          : std::vector<char>(plan.segments.size(), 0);
  for (size_t i = 0; i < plan.segments.size(); ++i) {
    const PlanSegment& seg = plan.segments[i];
    const bool ids_suffice = i > 0 && whole_final[i] && !seg.entry && !seg.ids.empty();
    if (cached && !ids_suffice) check_entry(seg, i, plan);
    else if (seg.ids.empty() && !(seg.entry && seg.entry->num_tokens() > 0))
      throw std::invalid_argument("splice: segment " + std::to_string(i) + " has no tokens");
    if (!seg.ids.empty()) check_ids(seg.ids, "segment " + std::to_string(i));
  }
  auto ids_of = [&](size_t i) -> const std::vector<int32_t>& {
    return plan.segments[i].ids.empty() ? plan.segments[i].entry->header().token_ids : plan.segments[i].ids;
  };
  auto entry_of = [&](size_t i) { return static_cast<const CudaEntry*>(plan.segments[i].entry.get()); };

  SpliceOutput out;
  auto seq = new_sequence();
  std::vector<Item> items;
  int64_t pos = 0;
  std::vector<int32_t> all;  // full mode: every segment's ids then the query, as one span (prefix: those not reused)
  std::vector<std::pair<SegmentDigest, std::shared_ptr<Checkpoint>>> fresh;  // prefix: new checkpoints, shallow first
  std::vector<CheckpointCut> cuts;
  if (plan.mode == SpliceMode::Full) {  // every segment in context as one span, then the query
    for (size_t i = 0; i < plan.segments.size(); ++i) all.insert(all.end(), ids_of(i).begin(), ids_of(i).end());
    pos = int64_t(all.size());
    out.computed_tokens = pos;
    items.push_back({{}, {std::span<const int32_t>(all), 0}});
  } else if (plan.mode == SpliceMode::Prefix) {
    // The longest chain of cached checkpoints 0..k-1 restores the state after segment k-1; the other segments and
    // the query run as one span (as full mode's), with a checkpoint taken at each segment's end in the same passes.
    SegmentDigest chain{};
    std::vector<SegmentDigest> chains;
    for (size_t i = 0; i < plan.segments.size(); ++i) chains.push_back(chain = chain_digest(chain, ids_of(i)));
    std::vector<std::list<PrefixItem>::iterator> hits;
    if (plan.use_prefix_cache)
      for (size_t i = 0; i < plan.segments.size(); ++i) {
        auto it = std::find_if(prefix_lru_.begin(), prefix_lru_.end(), [&](const PrefixItem& p) { return p.key == chains[i]; });
        if (it == prefix_lru_.end()) break;
        hits.push_back(it);
      }
    const size_t reused = hits.size();
    if (reused) {
      std::vector<const Checkpoint*> cps;
      for (auto it : hits) cps.push_back(it->cp.get());
      restore_chain(*seq, cps);
      for (size_t k = reused; k-- > 0;) prefix_lru_.splice(prefix_lru_.begin(), prefix_lru_, hits[k]);  // shallow = fresh
    }
    for (size_t i = 0; i < reused; ++i) pos += int64_t(ids_of(i).size());
    // New checkpoints, shallow first, while the budget holds them (the LRU's oldest give way).
    const int64_t start = pos;
    bool taking = plan.use_prefix_cache && opt_.prefix_cache_bytes > 0;
    size_t held = 0;
    for (size_t i = reused; i < plan.segments.size(); ++i) {
      all.insert(all.end(), ids_of(i).begin(), ids_of(i).end());
      if (!taking) continue;
      auto cp = std::make_shared<Checkpoint>();
      cp->start = start + int64_t(all.size() - ids_of(i).size());
      cp->n = start + int64_t(all.size());
      const size_t bytes = checkpoint_bytes(cp->n - cp->start);
      if (held + bytes > opt_.prefix_cache_bytes) {  // a deeper checkpoint is useless without this one
        taking = false;
        continue;
      }
      while (prefix_bytes_ + held + bytes > opt_.prefix_cache_bytes && !prefix_lru_.empty()) {
        prefix_bytes_ -= prefix_lru_.back().cp->mem.size();
        prefix_lru_.pop_back();
      }
      try {
        cp->mem = DeviceMemory(bytes, "prefix checkpoint", stream_, true);
      } catch (const ResourceExhausted&) {
        taking = false;  // no room on the device: the request runs without more checkpoints
        continue;
      }
      held += bytes;
      cuts.push_back({cp->n, cp.get()});
      fresh.emplace_back(chains[i], std::move(cp));
    }
    out.computed_tokens += int64_t(all.size());
    if (!all.empty()) items.push_back({{}, {std::span<const int32_t>(all), pos}});
    pos += int64_t(all.size());
    items.push_back({{}, {std::span<const int32_t>(plan.query), pos}});
    out.prefix_segments_reused = int(reused);
  } else if (plan.mode == SpliceMode::Naive || plan.mode == SpliceMode::Transition) {
    std::vector<Fold> folds{{Fold::Install, entry_of(0), 0}};
    pos = entry_of(0)->n();
    for (size_t i = 1; i < plan.segments.size(); ++i) {
      folds.push_back({plan.mode == SpliceMode::Naive ? Fold::Naive : Fold::Transition, entry_of(i), pos});
      pos += entry_of(i)->n();
    }
    items.push_back({std::move(folds), {std::span<const int32_t>(plan.query), pos}});
  } else {  // hypic: seams in context, interiors folded (DESIGN.md 3.3)
    std::vector<char> whole =
        whole_segments_before_refresh(plan.recompute_segments, plan.refresh_tail, plan.segments.size());
    std::vector<int64_t> lengths;
    for (size_t i = 0; i < plan.segments.size(); ++i) lengths.push_back(int64_t(ids_of(i).size()));
    // No probe when no segment could be refreshed (with no mass the choice is every candidate: empty = none).
    if (plan.refresh_segments > 0 && !choose_refresh_segments({}, lengths, plan.seam_width, whole, 1).empty()) {
      // Probe pass (the explicit recompute_segments whole, the tail still cached): the query's attention per slot
      // ranks the segments; the chosen ones are recomputed whole, with the tail, in a second splice from scratch
      // (SpliceRequest::refresh_segments, refresh_tail).
      int64_t probe_pos = 0, probe_computed = 0;
      std::vector<int> probe_recomputed;
      std::vector<char> probe_whole = whole_segments_before_refresh(plan.recompute_segments, 0, plan.segments.size());
      for (size_t i = 1; i < plan.segments.size(); ++i)  // a tail segment without an entry is whole in the probe too
        if (!plan.segments[i].entry) probe_whole[i] = 1;
      const std::vector<Item> probe_items = hypic_items(plan, probe_whole, probe_pos, probe_computed, probe_recomputed);
      std::vector<float> mass, probe_logits;
      seq.reset();  // the probe takes the request's one state slot, then gives it back
      {
        auto probe_seq = new_sequence();
        execute(*probe_seq, probe_items, false, probe_logits, false, nullptr, &mass, {}, &plan);
      }
      pause(plan, "after the refresh's probe");
      seq = new_sequence();
      const std::vector<int> chosen =
          choose_refresh_segments(mass, lengths, plan.seam_width, whole, plan.refresh_segments);
      for (int i : chosen) whole[size_t(i)] = 1;
      out.computed_tokens += probe_computed + int64_t(plan.query.size());
    }
    items = hypic_items(plan, whole, pos, out.computed_tokens, out.recomputed_segments);
  }
  if (plan.mode == SpliceMode::Full) items.push_back({{}, {std::span<const int32_t>(plan.query), pos}});
  out.computed_tokens += int64_t(plan.query.size());
  execute(*seq, items, plan.all_query_logits, out.logits, plan.keep_context_state, &out.context_states, nullptr, cuts,
          &plan);
  for (size_t k = fresh.size(); k-- > 0;) {  // prefix: the chain's shallow checkpoints freshest in the LRU
    for (auto it = prefix_lru_.begin(); it != prefix_lru_.end(); ++it)
      if (it->key == fresh[k].first) {
        prefix_bytes_ -= it->cp->mem.size();
        prefix_lru_.erase(it);
        break;
      }
    prefix_bytes_ += fresh[k].second->mem.size();
    prefix_lru_.push_front({fresh[k].first, std::move(fresh[k].second)});
  }
  out.num_tokens = pos + int64_t(plan.query.size());
  seq->n_ = out.num_tokens;
  out.sequence = std::move(seq);
  return out;
}

// ---- decode ----------------------------------------------------------------------------------------------------

void CudaBackend::decode(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
                         std::vector<float>& logits) {
  set_device();  // no drain_frees: freeing synchronizes the device, and this may run beside a prefill pass
  // Always the whole device at the highest priority: while a prefill call runs confined to the prefill partition
  // (PartitionScope), the SMs it leaves out take this step's blocks at once and freed prefill SMs take more. (A
  // step on the 16-SM decode partition itself cannot replay a graph captured on the whole device, and capturing
  // one there waits for a pause in prefill: measured 4.3x slower steps than this, 2026-12-03.)
  decoding_.fetch_add(1);
  struct StepEnd {
    CudaBackend& b;
    int exceptions = std::uncaught_exceptions();
    ~StepEnd() {
      // A step that failed part-way may have kernels in flight on its stream: the next step may take the other one.
      if (std::uncaught_exceptions() > exceptions) cudaStreamSynchronize(b.dec_stream_);
      b.decoding_.fetch_sub(1);
    }
  } step_end{*this};
  if (sequences.size() != tokens.size())
    throw std::invalid_argument("decode: " + std::to_string(sequences.size()) + " sequences but " +
                                std::to_string(tokens.size()) + " tokens");
  const int B = int(sequences.size());
  if (B == 0) {
    logits.clear();
    return;
  }
  if (B > opt_.max_sequences)
    throw std::invalid_argument("decode: batch of " + std::to_string(B) + " above max_sequences (" +
                                std::to_string(opt_.max_sequences) + ")");
  check_ids(tokens, "the decode batch");
  std::vector<CudaSequence*> seqs(B);
  for (int b = 0; b < B; ++b) {
    seqs[b] = dynamic_cast<CudaSequence*>(sequences[b]);
    if (!seqs[b] || seqs[b]->b_ != this) throw std::invalid_argument("decode: sequence " + std::to_string(b) + " is not this backend's");
    for (int c = 0; c < b; ++c)
      if (seqs[c] == seqs[b]) throw std::invalid_argument("decode: sequence " + std::to_string(b) + " appears twice");
  }
  for (auto* s : seqs) ensure_pages(*s, s->n_ + 1);
  // The step's tables in a fixed layout for (B, cap): cap = the block-table width, a power of two >= every
  // sequence's page count, so that a CUDA graph captured for (B, cap) serves every later step of that shape.
  int max_pages = 1;
  for (int b = 0; b < B; ++b) max_pages = std::max<int>(max_pages, int(seqs[b]->pages_.size()));
  int cap = 1;
  while (cap < max_pages) cap *= 2;
  DecodeTables t(B, cap);
  std::vector<int32_t> host(t.ints, 0);
  for (int b = 0; b < B; ++b) {
    const CudaSequence& s = *seqs[b];
    host[t.ids + b] = tokens[b];
    host[t.pos + b] = int32_t(s.n_);
    host[t.rows + b] = n_attn_ ? page_row(s, s.n_) : 0;
    host[t.slots + b] = s.slot_;
    host[t.qs + b] = b;
    host[t.lr + b] = b;
    std::copy(s.pages_.begin(), s.pages_.end(), host.begin() + t.bt + size_t(b) * cap);
  }
  host[t.qs + B] = B;
  if (dec_tables_.size() < host.size() * 4) {  // the graphs hold pointers into it: they go with it
    graphs_.clear();
    dec_tables_ = DeviceMemory(std::max<size_t>(host.size() * 4 * 2, 1 << 16), "decode tables");
  }
  check_cuda(cudaMemcpyAsync(dec_tables_.as(), host.data(), host.size() * 4, cudaMemcpyHostToDevice, dec_stream_),
             "decode tables");
  if (n_attn_) {  // sized before any step of this width runs, eager or captured; growing drops the graphs
    const size_t before = attn_dec_ws_.bytes();
    attn_dec_ws_.reserve(opt_.max_sequences, nh_, hd_, cap * kPage);
    if (attn_dec_ws_.bytes() != before) graphs_.clear();
  }
  const auto key = std::make_pair(B, cap);
  auto it = graphs_.find(key);
  std::unique_lock<std::recursive_mutex> capturing(capture_mu_, std::defer_lock);
  if (it == graphs_.end() && opt_.decode_graphs && warmed_.count(key) && capturing.try_lock()) {
    // Second step of this shape: every GEMM plan and workspace exists, so the step can be captured (while no
    // engine-loop call runs: capture_mu_).
    cudaGraph_t graph = nullptr;
    check_cuda(cudaStreamBeginCapture(dec_stream_, cudaStreamCaptureModeThreadLocal), "decode capture");
    try {
      decode_body(B, cap, t);
    } catch (...) {
      cudaStreamEndCapture(dec_stream_, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    check_cuda(cudaStreamEndCapture(dec_stream_, &graph), "decode capture");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    check_cuda(err, "decode graph instantiate");
    it = graphs_.emplace(key, GraphExec(exec)).first;
    capturing.unlock();
  }
  if (it != graphs_.end()) {
    check_cuda(cudaGraphLaunch(it->second.get(), dec_stream_), "decode graph launch");
  } else {
    decode_body(B, cap, t);
    warmed_.insert(key);
  }
  const size_t V = size_t(cfg_.vocab_size);
  logits.resize(size_t(B) * V);
  check_cuda(cudaMemcpyAsync(logits.data(), dec_logits_.as(), logits.size() * 4, cudaMemcpyDeviceToHost, dec_stream_),
             "logits download");
  check_cuda(cudaStreamSynchronize(dec_stream_), "decode step");
  for (auto* s : seqs) s->n_ += 1;
}

CudaBackend::PartitionScope::PartitionScope(CudaBackend& backend) : b(backend) {
  if (!b.sms_ || b.partition_depth_++ > 0 || !b.decode_beside_likely()) return;
  const cudaStream_t part = b.sms_->prefill_stream();
  try {
    check_cuda(cudaEventRecord(b.lane_ev_, b.full_stream_), "lane event");
    check_cuda(cudaStreamWaitEvent(part, b.lane_ev_, 0), "lane event wait");
  } catch (...) {
    --b.partition_depth_;
    throw;
  }
  b.stream_ = b.pre_.stream = part;
  for (kc::GdnWorkspace* ws : {&b.ws_a_, &b.ws_c_, &b.ws_seam_, &b.ws_pieces_})
    ws->set_side_stream(b.sms_->prefill_side_stream());
  b.partitioned_.store(true);
  switched = true;
}

CudaBackend::PartitionScope::~PartitionScope() {
  if (!b.sms_) return;
  --b.partition_depth_;
  if (!switched) return;
  b.partitioned_.store(false);
  // Joined back: the whole-device stream's later work (and frees) follow this call's.
  if (cudaEventRecord(b.lane_ev_, b.stream_) != cudaSuccess ||
      cudaStreamWaitEvent(b.full_stream_, b.lane_ev_, 0) != cudaSuccess) {
    cudaGetLastError();  // not left for the next launch check to report
    cudaStreamSynchronize(b.stream_);
  }
  b.stream_ = b.pre_.stream = b.full_stream_;
  for (kc::GdnWorkspace* ws : {&b.ws_a_, &b.ws_c_, &b.ws_seam_, &b.ws_pieces_}) ws->set_side_stream(nullptr);
}

// One decode step of B sequences from the fixed tables (no host work, no allocation: capturable).
void CudaBackend::decode_body(int B, int cap, const DecodeTables& t) {
  const Lane& ln = dec_;
  const int* tab = dec_tables_.as<int>();
  const kc::AttnGroups groups = attn_groups(B, tab + t.qs, tab + t.pos, tab + t.bt, cap, B, 1, cap * kPage);
  const int* slots = tab + t.slots;
  kc::embed_gather(B, H_, tab + t.ids, w_.embed, ln.x, ln.stream);
  for (int i = 0; i < cfg_.num_hidden_layers; ++i) {
    const DevLayer& L = w_.layers[i];
    kc::rms_norm_residual(B, H_, ln.x, H_, nullptr, L.input_layernorm, eps_, ln.hn, ln.stream);
    if (L.type == LayerType::Linear) {
      const int l = cfg_.linear_index(i);
      linear_gemms(dec_, L.linear, B);
      kc::conv1d_silu_decode(B, C_, K_, ln.qkv, L.linear.conv1d, convs(l, 0), ln.conv_out, ln.stream, slots);
      kc::split_qkv(B, qd_, vd_, ln.conv_out, ln.q, ln.k, ln.v, ln.stream);
      kc::gdn_decode_gated(B, nk_, nv_, ln.q, ln.k, ln.v, ln.ga, ln.gb, L.linear.A_log, L.linear.dt_bias, true, gdn_scale_,
                           ssm(l, 0), ln.o, ln.stream, slots);
      linear_finish(dec_, L.linear, B);
    } else {
      attention_mixer(dec_, L.attention, cfg_.attention_index(i), B, tab + t.pos, tab + t.rows, groups, true);
    }
    ffn(dec_, L, B, /*decode=*/true);
  }
  const int V = int(cfg_.vocab_size);
  kc::rms_norm_residual(B, H_, ln.x, H_, nullptr, w_.final_norm, eps_, ln.hn, ln.stream);
  ln.gemm->linear(B, V, H_, ln.hn, H_, w_.lm_head, dec_logits_.as(), CUDA_R_32F, V, 0.f, ln.stream);
}

// ---- entry builds ----------------------------------------------------------------------------------------------

std::vector<std::shared_ptr<const ResidentEntry>> CudaBackend::build_entries(
    std::span<const std::vector<int32_t>> segments, int seam_width, const BuildCancelled& cancelled) {
  set_device();
  std::lock_guard<std::recursive_mutex> no_capture(capture_mu_);  // see capture_mu_
  drain_frees();
  PartitionScope lane(*this);
  if (seam_width < 0) throw std::invalid_argument("build_entries: seam width must be >= 0, got " + std::to_string(seam_width));
  for (size_t i = 0; i < segments.size(); ++i) {
    if (segments[i].empty()) throw std::invalid_argument("build_entries: segment " + std::to_string(i) + " has no tokens");
    if (int64_t(segments[i].size()) > Tmax_)
      throw ResourceExhausted("build_entries: segment " + std::to_string(i) + " has " +
                              std::to_string(segments[i].size()) + " tokens, above the " + std::to_string(Tmax_) +
                              "-token forward pass of this worker (the larger of --max-batch-tokens and max_segment_tokens)");
    check_ids(segments[i], "segment " + std::to_string(i));
  }
  std::vector<std::shared_ptr<CudaEntry>> built;
  // Greedy batches of at most max_batch_tokens tokens, max_sequences segments and the KV pages free now (a batch's
  // segments hold pages while they are built).
  auto pages_of = [&](size_t i) { return n_attn_ ? (segments[i].size() + kPage - 1) / kPage : 0; };
  size_t begin = 0;
  while (begin < segments.size()) {
    size_t free_pages = 0;
    {
      std::lock_guard lock(pool_mu_);
      free_pages = free_pages_.size();
    }
    // With a concurrent decode, running sequences take pages while the batch runs (one each per 64 tokens): a batch
    // of several segments leaves them max_sequences pages (a lone segment still takes what it needs).
    if (opt_.concurrent_decode) free_pages -= std::min(free_pages, size_t(opt_.max_sequences));
    size_t end = begin, pages = 0;
    int64_t tok = 0;
    while (end < segments.size() && tok + int64_t(segments[end].size()) <= std::max<int64_t>(opt_.max_batch_tokens, int64_t(segments[begin].size())) &&
           int(end - begin) < std::max(1, opt_.max_sequences) && (end == begin || pages + pages_of(end) <= free_pages)) {
      tok += int64_t(segments[end].size());
      pages += pages_of(end);
      ++end;
    }
    // A batch stops (its entries null) once none of its segments is wanted any more.
    const std::function<bool()> none_wanted = [&cancelled, begin, end] {
      if (!cancelled) return false;
      for (size_t i = begin; i < end; ++i)
        if (!cancelled(i)) return false;
      return true;
    };
    if (none_wanted()) built.insert(built.end(), end - begin, nullptr);
    else build_batch(segments.subspan(begin, end - begin), seam_width, built, none_wanted);
    begin = end;
  }
  return {built.begin(), built.end()};
}

void CudaBackend::build_batch(std::span<const std::vector<int32_t>> segs, int w,
                              std::vector<std::shared_ptr<CudaEntry>>& out, const std::function<bool()>& stop) {
  const int N = int(segs.size());
  // Temporary pages for each segment's KV (taken from the pool, returned at the end).
  std::vector<std::vector<int>> pages(N);
  int max_pages = 1;
  struct PageGuard {
    CudaBackend* b;
    std::vector<std::vector<int>>* p;
    ~PageGuard() {
      std::lock_guard lock(b->pool_mu_);
      for (auto& v : *p) b->free_pages_.insert(b->free_pages_.end(), v.begin(), v.end());
    }
  } guard{this, &pages};
  if (n_attn_) {
    std::lock_guard lock(pool_mu_);
    size_t need = 0;
    for (const auto& s : segs) need += (s.size() + kPage - 1) / kPage;
    if (need > free_pages_.size())
      throw ResourceExhausted("KV pool exhausted (--kv-pool-bytes): building " + std::to_string(N) + " segments needs " +
                              std::to_string(need) + " pages, " + std::to_string(free_pages_.size()) + " free");
    for (int i = 0; i < N; ++i) {
      for (size_t p = 0; p < (segs[i].size() + kPage - 1) / kPage; ++p) {
        pages[i].push_back(free_pages_.back());
        free_pages_.pop_back();
      }
      max_pages = std::max<int>(max_pages, int(pages[i].size()));
    }
  }
  std::vector<int32_t> ids, pos, rows;
  std::vector<int> cu{0}, pieces{0}, seam_cu{0}, seam_rows, bt(size_t(N) * max_pages, 0), slot0(N, 0);
  int max_q = 0, max_kv = 1;
  std::vector<std::shared_ptr<CudaEntry>> entries;
  for (int i = 0; i < N; ++i) {
    const int n = int(segs[i].size()), sw = std::min(w, n);
    const int base = int(ids.size());
    for (int t = 0; t < n; ++t) {
      ids.push_back(segs[i][t]);
      pos.push_back(t);
      rows.push_back(n_attn_ ? pages[i][t / kPage] * kPage + t % kPage : 0);
    }
    for (int t = 0; t < sw; ++t) seam_rows.push_back(base + t);
    cu.push_back(int(ids.size()));
    pieces.push_back(base + sw);
    pieces.push_back(int(ids.size()));
    seam_cu.push_back(int(seam_rows.size()));
    std::copy(pages[i].begin(), pages[i].end(), bt.begin() + size_t(i) * max_pages);
    max_q = std::max(max_q, n);
    max_kv = std::max(max_kv, n);
    SegmentEntry h;
    h.model_fingerprint = fingerprint_;
    h.numerics = std::string(numerics());
    h.seam_width = w;
    h.token_ids = segs[i];
    h.geometry = geom_;
    entries.push_back(std::make_shared<CudaEntry>(*this, std::move(h), stream_));
    entries.back()->no_transitions = opt_.benchmark_skip_transitions;
  }
  const int T = int(ids.size());
  const int S = int(seam_rows.size());
  // Per-layer scratch: seam finals [N], piece initial states [2N], finals [2N], transitions [2N], conv states [N].
  const size_t S1 = state_layer_bytes_;
  Layout rl;
  const size_t o_sf = rl.add(N * S1), o_pi = rl.add(2 * N * S1), o_pf = rl.add(2 * N * S1), o_pt = rl.add(2 * N * S1),
               o_cs = rl.add(N * conv_layer_bytes_), o_sq = rl.add(S * qd_ * 2 + 16), o_sk = rl.add(S * qd_ * 2 + 16),
               o_sv = rl.add(S * vd_ * 2 + 16), o_sa = rl.add(S * nv_ * 2 + 16), o_sb = rl.add(S * nv_ * 2 + 16);
  if (n_lin_) ensure_capacity(run_scratch_, rl.total(), "per-segment states of an entry build");
  auto rs_f = [&](size_t off, int i) { return reinterpret_cast<float*>(run_scratch_.bytes_ptr(off + i * S1)); };
  auto rs_b = [&](size_t off) { return reinterpret_cast<kc::bf16*>(run_scratch_.bytes_ptr(off)); };
  kc::bf16* conv_states = n_lin_ ? rs_b(o_cs) : nullptr;
  // Copy tables, per linear layer: seam finals -> odd piece initials; entry S_seam (when w > 0), T_int, conv tail
  // (the seam pieces' T, T_seam, is not stored: engine/segment.h).
  std::vector<kc::CopyDesc> init_copy, entry_copy;
  std::vector<kc::AffineStep> sub;   // [layer][N]: S_int = S_end - T_int S_seam
  std::vector<const float*> sub_init;
  std::vector<float*> sub_fin;
  for (int l = 0; l < n_lin_; ++l) {
    for (int i = 0; i < N; ++i) {
      init_copy.push_back({rs_f(o_sf, i), rs_f(o_pi, 2 * i + 1), long(S1)});
      CudaEntry& e = *entries[i];
      if (e.has_seam()) entry_copy.push_back({rs_f(o_pf, 2 * i), e.S_seam(l), long(S1)});
      entry_copy.push_back({rs_f(o_pt, 2 * i + 1), e.T_int(l), long(S1)});
      entry_copy.push_back({conv_states + size_t(i) * conv_layer_bytes_ / 2, e.conv(l), long(conv_layer_bytes_)});
      sub.push_back({rs_f(o_pt, 2 * i + 1), rs_f(o_pf, 2 * i + 1), nullptr, -1.f});
      sub_init.push_back(rs_f(o_pf, 2 * i));
      sub_fin.push_back(e.S_int(l));
    }
  }
  Tables tb;
  const size_t t_ids = tb.add(ids), t_pos = tb.add(pos), t_rows = tb.add(rows), t_cu = tb.add(cu), t_bt = tb.add(bt),
               t_s0 = tb.add(slot0), t_sr = tb.add(seam_rows), t_ic = tb.add(init_copy), t_ec = tb.add(entry_copy),
               t_sub = tb.add(sub), t_si = tb.add(sub_init), t_sf = tb.add(sub_fin);
  tb.upload(tables_dev_, stream_);
  check_cuda(cudaMemcpyAsync(pre_.ids, tb.dev<int32_t>(t_ids), size_t(T) * 4, cudaMemcpyDeviceToDevice, stream_), "ids");
  const kc::AttnGroups groups =
      attn_groups(N, tb.dev<int>(t_cu), tb.dev<int>(t_s0), tb.dev<int>(t_bt), max_pages, T, max_q, max_kv);
  const int per_layer_copies = n_lin_ ? int(entry_copy.size()) / n_lin_ : 0;  // the same for every layer

  kc::embed_gather(T, H_, pre_.ids, w_.embed, pre_.x, stream_);
  for (int i = 0; i < cfg_.num_hidden_layers; ++i) {
    if (stop()) {  // cancelled: what was launched finishes (at most a layer), the pages go back, no entries
      check_cuda(cudaStreamSynchronize(stream_), "cancelled entry build");
      out.insert(out.end(), size_t(N), nullptr);
      return;
    }
    const DevLayer& L = w_.layers[i];
    kc::rms_norm_residual(T, H_, pre_.x, H_, nullptr, L.input_layernorm, eps_, pre_.hn, stream_);
    if (L.type == LayerType::Linear) {
      const int l = cfg_.linear_index(i);
      linear_gemms(pre_, L.linear, T);
      check_cuda(cudaMemsetAsync(conv_states, 0, size_t(N) * conv_layer_bytes_, stream_), "conv zero");
      kc::conv1d_silu_prefill(N, tb.dev<int>(t_cu), T, C_, K_, pre_.qkv, L.linear.conv1d, conv_states, pre_.conv_out, stream_);
      kc::split_qkv(T, qd_, vd_, pre_.conv_out, pre_.q, pre_.k, pre_.v, stream_);
      kc::GdnPrefillArgs g;
      g.num_k_heads = nk_, g.num_v_heads = nv_;
      g.A_log = L.linear.A_log, g.dt_bias = L.linear.dt_bias, g.l2norm_qk = true, g.scale = gdn_scale_;
      check_cuda(cudaMemsetAsync(rs_f(o_pi, 0), 0, 2 * size_t(N) * S1, stream_), "zero piece states");
      if (S > 0) {  // the seams alone from zero: S(seam|0), the interiors' true initial states
        kc::gather_rows(S, qd_, pre_.q, tb.dev<int>(t_sr), rs_b(o_sq), stream_);
        kc::gather_rows(S, qd_, pre_.k, tb.dev<int>(t_sr), rs_b(o_sk), stream_);
        kc::gather_rows(S, vd_, pre_.v, tb.dev<int>(t_sr), rs_b(o_sv), stream_);
        kc::gather_rows(S, nv_, pre_.ga, tb.dev<int>(t_sr), rs_b(o_sa), stream_);
        kc::gather_rows(S, nv_, pre_.gb, tb.dev<int>(t_sr), rs_b(o_sb), stream_);
        kc::GdnPrefillArgs a = g;
        a.num_seqs = N, a.cu_seqlens_host = seam_cu.data();
        a.q = rs_b(o_sq), a.k = rs_b(o_sk), a.v = rs_b(o_sv), a.gate_a = rs_b(o_sa), a.gate_b = rs_b(o_sb);
        a.final_state = rs_f(o_sf, 0);
        kc::gdn_prefill(a, ws_seam_, stream_);
        kc::batched_copy(N, tb.dev<kc::CopyDesc>(t_ic) + size_t(l) * N, stream_);
      }
      // Every piece (seam_i from zero, interior_i from S(seam_i|0)): outputs, finals and T of each piece.
      g.num_seqs = 2 * N, g.cu_seqlens_host = pieces.data();
      g.q = pre_.q, g.k = pre_.k, g.v = pre_.v, g.gate_a = pre_.ga, g.gate_b = pre_.gb;
      g.initial_state = rs_f(o_pi, 0), g.final_state = rs_f(o_pf, 0), g.out = pre_.o;
      g.transition = opt_.benchmark_skip_transitions ? nullptr : rs_f(o_pt, 0);
      kc::gdn_prefill(g, ws_pieces_, stream_);
      if (!opt_.benchmark_skip_transitions)
        kc::affine_chain(N, nv_, 1, tb.dev<kc::AffineStep>(t_sub) + size_t(l) * N,
                         tb.dev<const float*>(t_si) + size_t(l) * N, tb.dev<float*>(t_sf) + size_t(l) * N, stream_);
      kc::batched_copy(per_layer_copies, tb.dev<kc::CopyDesc>(t_ec) + size_t(l) * per_layer_copies, stream_);
      linear_finish(pre_, L.linear, T);
    } else {
      attention_mixer(pre_, L.attention, cfg_.attention_index(i), T, tb.dev<int>(t_pos), tb.dev<int>(t_rows), groups, false);
    }
    ffn(pre_, L, T);
  }
  // K/V out of the pages into the entries.
  std::vector<kc::CopyDesc> kvc;
  for (int i = 0; i < N; ++i) {
    const int n = int(segs[i].size());
    for (int a = 0; a < n_attn_; ++a)
      for (int p = 0; p * kPage < n; ++p) {
        const long cnt = std::min(kPage, n - p * kPage);
        const size_t src = size_t(pages[i][p]) * kPage * kv_row_;
        kvc.push_back({k_pool_[a].bytes_ptr(src), reinterpret_cast<char*>(entries[i]->K(a)) + size_t(p) * kPage * kv_row_,
                       long(cnt * kv_row_)});
        kvc.push_back({v_pool_[a].bytes_ptr(src), reinterpret_cast<char*>(entries[i]->V(a)) + size_t(p) * kPage * kv_row_,
                       long(cnt * kv_row_)});
      }
  }
  if (!kvc.empty()) {
    check_cuda(cudaStreamSynchronize(stream_), "entry build");  // the tables buffer is reused below
    Tables t2;
    const size_t o = t2.add(kvc);
    t2.upload(tables_dev_, stream_);
    kc::batched_copy(int(kvc.size()), t2.dev<kc::CopyDesc>(o), stream_);
  }
  check_cuda(cudaStreamSynchronize(stream_), "entry build");
  out.insert(out.end(), entries.begin(), entries.end());
}

// ---- import / download -----------------------------------------------------------------------------------------

// An entry's header without its tensors: what a CudaEntry keeps on the host.
static SegmentEntry header_of(const SegmentEntry& e) {
  SegmentEntry h;
  h.format_version = e.format_version;
  h.model_fingerprint = e.model_fingerprint;
  h.numerics = e.numerics;
  h.seam_width = e.seam_width;
  h.token_ids = e.token_ids;
  h.geometry = e.geometry;
  return h;
}

std::optional<DeviceBlock> CudaBackend::device_block(const ResidentEntry& entry) const {
  const auto* e = dynamic_cast<const CudaEntry*>(&entry);
  if (!e || e->device() != dev_.index || e->no_transitions) return std::nullopt;
  return e->block();
}

std::pair<std::shared_ptr<const ResidentEntry>, DeviceBlock> CudaBackend::allocate_entry(const SegmentEntry& header) const {
  // Any thread: nothing here touches the engine's stream or mutable state (the allocation is on xfer_stream_).
  header.check_compatible(fingerprint_, geom_, -1, numerics());
  if (header.num_tokens() < 1) throw EntryError("allocate_entry: an entry has at least one token");
  check_cuda(cudaSetDevice(dev_.index), "cudaSetDevice");
  // The entry hands its memory back through the (mutex-guarded) deferred frees: const_cast is safe there. Its block
  // is freed stream-ordered on xfer_stream_ too; every engine call ends with its stream synchronized, so no engine
  // work still reads an entry whose last reference went.
  auto e = std::make_shared<CudaEntry>(const_cast<CudaBackend&>(*this), header_of(header), xfer_stream_);
  check_cuda(cudaStreamSynchronize(xfer_stream_), "entry allocation");  // ready before another stream writes it
  const DeviceBlock block = e->block();
  return {std::move(e), block};
}

std::shared_ptr<const ResidentEntry> CudaBackend::import_entry(std::shared_ptr<const SegmentEntry> host) {
  set_device();
  std::lock_guard<std::recursive_mutex> no_capture(capture_mu_);  // see capture_mu_
  drain_frees();
  if (!host) throw std::invalid_argument("import_entry: null entry");
  // Converted into a pinned block, then one host-to-device copy at PCIe bandwidth (not the engine's stream).
  return import_block(*block_of_entry(*host));
}

// ---- host blocks -----------------------------------------------------------------------------------------------

void CudaBackend::wait_stream(cudaStream_t stream, const char* what) const {
  cudaEvent_t ev = nullptr;
  check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), what);
  cudaError_t err = cudaEventRecord(ev, stream);
  if (err == cudaSuccess) err = cudaEventSynchronize(ev);
  cudaEventDestroy(ev);
  check_cuda(err, what);
}

std::shared_ptr<const HostBlock> CudaBackend::copy_to_host(const ResidentEntry& entry) const {
  const auto* e = dynamic_cast<const CudaEntry*>(&entry);
  if (!e || e->device() != dev_.index) throw EntryError("copy_to_host: the entry is not one of " + dev_.name() + "'s");
  if (e->no_transitions) throw EntryError("copy_to_host: the entry was built with benchmark_skip_transitions (no T_C)");
  check_cuda(cudaSetDevice(dev_.index), "cudaSetDevice");
  const DeviceBlock dev = e->block();
  auto block = std::make_shared<CudaHostBlock>(header_of(e->header()), dev.bytes, pinned_);
  size_t off = 0;
  for (const auto& p : block->pieces()) {
    check_cuda(cudaMemcpyAsync(p.data, static_cast<const char*>(dev.data) + off, p.used, cudaMemcpyDeviceToHost,
                               d2h_stream_),
               "entry copy to host");
    off += p.used;
  }
  wait_stream(d2h_stream_, "entry copy to host");
  return block;
}

std::shared_ptr<const ResidentEntry> CudaBackend::import_block(const HostBlock& hb) const {
  const auto* block = dynamic_cast<const CudaHostBlock*>(&hb);
  if (!block) throw EntryError("import_block: not a host block of the CUDA backend");
  const SegmentEntry& h = block->header();
  h.check_compatible(fingerprint_, geom_, -1, numerics());
  if (h.num_tokens() < 1) throw EntryError("import_block: an entry has at least one token");
  const size_t want = EntryLayout(geom_, kv_row_, h.num_tokens(), h.seam_tokens() > 0).total;
  if (block->bytes() != want)
    throw EntryError("import_block: a block of " + std::to_string(block->bytes()) + " bytes for " +
                     std::to_string(h.num_tokens()) + " tokens (expected " + std::to_string(want) + ")");
  check_cuda(cudaSetDevice(dev_.index), "cudaSetDevice");
  // Allocated and filled in order on h2d_stream_ (stream-ordered: no device-wide synchronization), then waited for,
  // so that the engine's stream only ever sees a complete entry. Freed stream-ordered on h2d_stream_ too.
  auto e = std::make_shared<CudaEntry>(const_cast<CudaBackend&>(*this), header_of(h), h2d_stream_);
  const DeviceBlock dev = e->block();
  size_t off = 0;
  for (const auto& p : block->pieces()) {
    check_cuda(cudaMemcpyAsync(static_cast<char*>(dev.data) + off, p.data, p.used, cudaMemcpyHostToDevice, h2d_stream_),
               "entry copy to device");
    off += p.used;
  }
  wait_stream(h2d_stream_, "entry copy to device");
  return e;
}

std::shared_ptr<const SegmentEntry> CudaBackend::entry_of_block(const HostBlock& hb) const {
  const auto* block = dynamic_cast<const CudaHostBlock*>(&hb);
  if (!block) throw EntryError("entry_of_block: not a host block of the CUDA backend");
  const SegmentEntry& h = block->header();
  const EntryGeometry& g = h.geometry;
  const EntryLayout lay(g, size_t(g.kv_heads) * g.head_dim * 2, h.num_tokens(), h.seam_tokens() > 0);
  if (block->bytes() != lay.total) throw EntryError("entry_of_block: the block's size does not match its header");
  auto e = std::make_shared<SegmentEntry>(h);
  const size_t sf = lay.state / sizeof(float);
  auto get_f32 = [&](size_t off) {
    std::vector<float> v(sf);
    block->read(off, v.data(), lay.state);
    return v;
  };
  std::vector<uint16_t> raw;
  auto get_bf16 = [&](size_t off, size_t count) {
    raw.resize(count);
    block->read(off, raw.data(), count * 2);
    std::vector<float> v(count);
    for (size_t i = 0; i < count; ++i) v[i] = bf16_to_f32(raw[i]);
    return v;
  };
  e->linear.resize(size_t(g.num_linear));
  for (int l = 0; l < g.num_linear; ++l) {
    LinearLayerEntry& L = e->linear[size_t(l)];
    if (lay.states == 3) L.seam_state = get_f32(lay.S_seam(l));
    L.interior_transition = TransitionOperator::dense(g.linear_heads, g.d_k, get_f32(lay.T_int(l)));
    L.interior_state = get_f32(lay.S_int(l));
    L.conv_tail = get_bf16(lay.conv_at(l), size_t(g.conv_rows) * g.conv_dim);
  }
  e->attention.resize(size_t(g.num_attention));
  const size_t kvn = size_t(h.num_tokens()) * g.kv_heads * g.head_dim;
  for (int a = 0; a < g.num_attention; ++a) {
    e->attention[size_t(a)].k = get_bf16(lay.K(a), kvn);
    e->attention[size_t(a)].v = get_bf16(lay.V(a), kvn);
  }
  e->check_consistent();
  return e;
}

// The block's regions in wire order (engine/segment.h): per linear layer S_seam (with a seam), T_int (dense), S_int,
// fp32 in both layouts, and the conv tail, then per attention layer K and V, bf16 in both (the wire's K/V type 2: every
// value of a CUDA entry is a bf16 value, as serialize_entry finds). Views into the pinned pieces, copied once into the
// wire buffer.
std::string CudaBackend::wire_of_block(const HostBlock& hb) const {
  const auto* block = dynamic_cast<const CudaHostBlock*>(&hb);
  if (!block) throw EntryError("wire_of_block: not a host block of the CUDA backend");
  const SegmentEntry& h = block->header();
  const EntryGeometry& g = h.geometry;
  const EntryLayout lay(g, size_t(g.kv_heads) * g.head_dim * 2, h.num_tokens(), h.seam_tokens() > 0);
  if (block->bytes() != lay.total) throw EntryError("wire_of_block: the block's size does not match its header");
  WireParts parts;
  parts.interior_kinds.assign(size_t(g.num_linear), TransitionKind::Dense);
  const size_t conv = size_t(g.conv_rows) * g.conv_dim * 2, kv = size_t(h.num_tokens()) * g.kv_heads * g.head_dim * 2;
  parts.kv_bf16 = (g.num_linear > 0 && conv > 0) || (g.num_attention > 0 && kv > 0);
  auto add = [&](size_t off, size_t n) {
    block->span(off, n, [&](const char* p, size_t, size_t len) { parts.bytes.emplace_back(p, len); });
  };
  for (int l = 0; l < g.num_linear; ++l) {
    if (lay.states == 3) add(lay.S_seam(l), lay.state);
    add(lay.T_int(l), lay.state);
    add(lay.S_int(l), lay.state);
    add(lay.conv_at(l), conv);
  }
  for (int a = 0; a < g.num_attention; ++a) {
    add(lay.K(a), kv);
    add(lay.V(a), kv);
  }
  return serialize_entry_parts(h, parts);
}

std::shared_ptr<const HostBlock> CudaBackend::block_of_entry(const SegmentEntry& host) const {
  host.check_consistent();
  host.check_compatible(fingerprint_, geom_, -1, numerics());
  if (host.num_tokens() < 1) throw EntryError("block_of_entry: an entry has at least one token");
  const EntryLayout lay(geom_, kv_row_, host.num_tokens(), host.seam_tokens() > 0);
  auto block = std::make_shared<CudaHostBlock>(header_of(host), lay.total, pinned_);
  std::vector<uint16_t> buf;
  auto put_bf16 = [&](size_t off, const std::vector<float>& src) {
    buf.resize(src.size());
    for (size_t i = 0; i < src.size(); ++i) buf[i] = f32_to_bf16(src[i]);
    block->write(off, buf.data(), buf.size() * 2);
  };
  for (int l = 0; l < n_lin_; ++l) {
    const LinearLayerEntry& L = host.linear[size_t(l)];
    const std::vector<float> Ti = L.interior_transition.to_dense();
    if (lay.states == 3) block->write(lay.S_seam(l), L.seam_state.data(), lay.state);
    block->write(lay.T_int(l), Ti.data(), lay.state);
    block->write(lay.S_int(l), L.interior_state.data(), lay.state);
    put_bf16(lay.conv_at(l), L.conv_tail);
  }
  for (int a = 0; a < n_attn_; ++a) {
    put_bf16(lay.K(a), host.attention[size_t(a)].k);
    put_bf16(lay.V(a), host.attention[size_t(a)].v);
  }
  return block;
}

ModelState CudaBackend::download_state(const CudaSequence& s) const {
  ModelState st;
  st.num_tokens = s.n_;
  st.linear.resize(n_lin_);
  std::vector<uint16_t> raw;
  auto bf = [&](const void* src, size_t count, std::vector<float>& dst) {
    raw.resize(count);
    if (count) check_cuda(cudaMemcpy(raw.data(), src, count * 2, cudaMemcpyDeviceToHost), "state download");
    dst.resize(count);
    for (size_t i = 0; i < count; ++i) dst[i] = bf16_to_f32(raw[i]);
  };
  check_cuda(cudaStreamSynchronize(full_stream_), "state download");
  for (int l = 0; l < n_lin_; ++l) {
    st.linear[l].ssm.resize(state_layer_bytes_ / 4);
    check_cuda(cudaMemcpy(st.linear[l].ssm.data(), ssm(l, s.slot_), state_layer_bytes_, cudaMemcpyDeviceToHost),
               "state download");
    bf(convs(l, s.slot_), conv_layer_bytes_ / 2, st.linear[l].conv);
  }
  st.attention.resize(n_attn_);
  const size_t row = size_t(nkv_) * hd_;
  for (int a = 0; a < n_attn_; ++a) {
    AttentionLayerState& A = st.attention[a];
    A.n_tokens = s.n_;
    A.k.resize(size_t(s.n_) * row);
    A.v.resize(A.k.size());
    std::vector<float> tmp;
    for (int64_t t = 0; t < s.n_; t += kPage) {
      const int64_t cnt = std::min<int64_t>(kPage, s.n_ - t);
      const size_t off = size_t(page_row(s, t)) * kv_row_;
      bf(k_pool_[a].bytes_ptr(off), size_t(cnt) * row, tmp);
      std::copy(tmp.begin(), tmp.end(), A.k.begin() + size_t(t) * row);
      bf(v_pool_[a].bytes_ptr(off), size_t(cnt) * row, tmp);
      std::copy(tmp.begin(), tmp.end(), A.v.begin() + size_t(t) * row);
    }
  }
  return st;
}

}  // namespace

std::unique_ptr<Backend> make_backend(const DeviceSpec& device, const ModelConfig& config, const ModelWeights* weights,
                                      const BackendOptions& options) {
  if (device.kind != BackendKind::Cuda) throw std::invalid_argument("cuda::make_backend: device " + device.name() + " is not a CUDA device");
  return std::make_unique<CudaBackend>(device, config, weights, options);
}

std::unique_ptr<Backend> make_backend(const DeviceSpec& device, const std::filesystem::path& model_dir,
                                      const BackendOptions& options) {
  ModelConfig cfg = load_config(model_dir);
  if (options.random_weights_seed) return make_backend(device, cfg, nullptr, options);
  if (device.kind != BackendKind::Cuda) throw std::invalid_argument("cuda::make_backend: device " + device.name() + " is not a CUDA device");
  return std::make_unique<CudaBackend>(device, cfg, nullptr, options, model_dir);
}

}  // namespace hypic::engine::cuda

namespace hypic::engine {

std::unique_ptr<Backend> make_cuda_backend(const DeviceSpec& device, const std::filesystem::path& model_dir,
                                           const BackendOptions& options) {
  return cuda::make_backend(device, model_dir, options);
}

}  // namespace hypic::engine
