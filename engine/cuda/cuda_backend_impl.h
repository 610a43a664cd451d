// Internal to engine/cuda: the CUDA backend's types (entries, sequences, the pass's items) and the CudaBackend
// class, shared by cuda_backend.cpp (construction, memory, decode, entry transfer) and cuda_splice.cpp (the splice
// and entry-build passes). Users include engine/cuda/cuda_backend.h.
// A request's path through the backend: the header of cuda_splice.cpp.
#pragma once

#include "engine/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <initializer_list>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <map>
#include <set>
#include <type_traits>
#include <unordered_map>

#include "engine/checkpoint/safetensors.h"
#include "engine/cpu/splice.h"
#include "engine/cuda/cuda_weights.h"
#include "engine/cuda/device_memory.h"
#include "engine/cuda/kda_mixer.h"
#include "engine/cuda/lightning_mixer.h"
#include "engine/cuda/mla_mixer.h"
#include "engine/cuda/pinned_pool.h"
#include "engine/cuda/sm_partition.h"
#include "engine/prefix_cache.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/decode_linear.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/lightning.h"
#include "kernels/cuda/mla.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sample.h"
#include "kernels/cuda/switches.h"


namespace hypic::engine::cuda::impl {

namespace kc = hypic::kernels::cuda;
constexpr int D = kc::kGdnHeadDim;
constexpr int kPage = kc::kKvPageTokens;
constexpr size_t kStateFloats = size_t(D) * D;

inline std::string mib(size_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

// Host tables of one pass, uploaded to the device in one copy. add() returns an offset; dev() resolves it after
// upload(). clear() keeps the host buffer: a Tables reused across passes (CudaBackend::pass_tables_) neither
// reallocates nor page-faults its megabytes of KV-row pointers again (a 16 x 2k splice's tables: 5 MB, 9 ms when
// built in a fresh vector each pass, measured with HYPIC_PASS_TRACE on the H200).
class Tables {
 public:
  template <class T>
  size_t add(const std::vector<T>& v) {
    return add_bytes(v.data(), v.size() * sizeof(T));
  }
  size_t add_bytes(const void* p, size_t n) {
    const size_t off = (used_ + 15) / 16 * 16;
    used_ = off + std::max<size_t>(n, 1);
    if (used_ > host_.size()) host_.resize(std::max(used_, host_.size() * 2));
    if (n) std::memcpy(host_.data() + off, p, n);
    return off;
  }
  void upload(DeviceMemory& dev, cudaStream_t stream) {
    ensure_capacity(dev, used_, "pass tables");
    base_ = dev.bytes_ptr();
    if (used_)  // pageable: the call returns once the bytes are staged, so the buffer may be refilled afterwards
      check_cuda(cudaMemcpyAsync(base_, host_.data(), used_, cudaMemcpyHostToDevice, stream), "table upload");
  }
  template <class T>
  T* dev(size_t off) const {
    return reinterpret_cast<T*>(base_ + off);
  }
  void clear() {
    used_ = 0;
    base_ = nullptr;
  }

 private:
  std::vector<uint8_t> host_;
  size_t used_ = 0;
  char* base_ = nullptr;
};

class CudaBackend;

// ---- entries ---------------------------------------------------------------------------------------------------

// The kind of a linear layer's transition operator on the device: one scalar per head for lightning attention
// (MiniMax, Ring-linear), else dense [H][d_k][d_k] (Gated DeltaNet, KDA).
inline bool scalar_transitions(const EntryGeometry& g) {
  return g.family == int(ModelFamily::MiniMax) || g.family == int(ModelFamily::RingLinear);
}

// Where each part of an entry of n tokens lies in its device block (byte offsets, each part 256-byte aligned): per
// linear layer S_seam (only when the seam is not empty: `seam`), T_int, S_int and the conv tail [K-1][C] bf16 (absent
// without a short conv); then per attention layer K [n][H_kv][head_dim] and V [n][H_kv][v_dim] bf16. States are
// [H_v][d_k][d_v] fp32, T_int [H_v][d_k][d_k] fp32, or [H_v] fp32 for scalar transitions (T_seam is not stored,
// engine/segment.h). A host block (pinned copy) uses the same offsets.
struct EntryLayout {
  size_t state = 0, trans = 0, conv = 0, lin_stride = 0, k_row = 0, v_row = 0, k = 0, v = 0, kv_off = 0, total = 0;
  int states = 0;  // fp32 state blocks per linear layer: 2 with a seam (S_seam, S_int), else 1
  static size_t up(size_t b) { return (b + 255) / 256 * 256; }
  EntryLayout(const EntryGeometry& g, int64_t n, bool seam) {
    states = seam ? 2 : 1;
    state = size_t(g.linear_heads) * g.d_k * g.d_v * sizeof(float);
    trans = scalar_transitions(g) ? size_t(g.linear_heads) * sizeof(float)
                                  : size_t(g.linear_heads) * g.d_k * g.d_k * sizeof(float);
    conv = size_t(g.conv_rows) * g.conv_dim * 2;
    lin_stride = size_t(states) * up(state) + up(trans) + up(conv);
    k_row = size_t(g.kv_heads) * g.head_dim * 2;
    v_row = size_t(g.kv_heads) * g.v_dim() * 2;
    k = up(size_t(n) * k_row);
    v = up(size_t(n) * v_row);
    kv_off = size_t(g.num_linear) * lin_stride;
    total = kv_off + size_t(g.num_attention) * (k + v);
  }
  size_t S_seam(int l) const { return size_t(l) * lin_stride; }  // only when states == 2
  size_t T_int(int l) const { return size_t(l) * lin_stride + size_t(states - 1) * up(state); }
  size_t S_int(int l) const { return T_int(l) + up(trans); }
  size_t conv_at(int l) const { return S_int(l) + up(state); }
  size_t K(int a) const { return kv_off + size_t(a) * (k + v); }
  size_t V(int a) const { return K(a) + k; }
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
// (fp32) and the conv tail [K-1][C] bf16; per attention layer K [n][H_kv][hd] and V [n][H_kv][v_dim] bf16 (K rotated
// at local positions where the family has RoPE).
/// An entry's header without its tensors (what a CudaEntry keeps on the host).
SegmentEntry header_of(const SegmentEntry& e);

class CudaEntry final : public ResidentEntry {
 public:
  /// Allocates the block stream-ordered on `stream` (the engine's stream for its own entries; the backend's transfer
  /// stream for Backend::allocate_entry, on any thread), or with plain cudaMalloc when `stream` is null.
  CudaEntry(CudaBackend& b, SegmentEntry header, cudaStream_t stream);
  /// A view of an entry of `header` whose block the splice's staging area holds (a host block copied in; Stager in
  /// cuda_splice.cpp): it owns no memory, and its tensors are undefined until bind() gives it its place.
  struct StagedView {};
  CudaEntry(CudaBackend& b, SegmentEntry header, StagedView);
  /// A staged view's place in the staging area (device memory of at least total_bytes()).
  void bind(char* base) { base_ = base; }
  /// The block's bytes in this backend's layout (EntryLayout::total).
  size_t total_bytes() const { return lay_.total; }
  /// The whole block (DeviceBlock; engine/backend.h).
  DeviceBlock block() const { return {base_, lay_.total, device_}; }
  /// Hands the device memory back to the backend, which frees it on its engine thread (entries are dropped on gRPC
  /// threads too, where a free on the engine's stream could meet a CUDA-graph capture).
  ~CudaEntry() override;
  const SegmentEntry& header() const override { return header_; }
  std::shared_ptr<const SegmentEntry> host() const override;
  size_t resident_bytes() const override { return mem_.size(); }  // (0 for a staged view)

  /// S(seam|0) of linear layer l; null when the seam is empty (w = 0).
  float* S_seam(int l) const { return has_seam() ? f32(lay_.S_seam(l)) : nullptr; }
  float* T_int(int l) const { return f32(lay_.T_int(l)); }
  float* S_int(int l) const { return f32(lay_.S_int(l)); }
  kc::bf16* conv(int l) const { return reinterpret_cast<kc::bf16*>(base_ + lay_.conv_at(l)); }
  bool has_seam() const { return lay_.states == 2; }
  kc::bf16* K(int a) const { return reinterpret_cast<kc::bf16*>(base_ + lay_.K(a)); }
  kc::bf16* V(int a) const { return reinterpret_cast<kc::bf16*>(base_ + lay_.V(a)); }
  int n() const { return header_.num_tokens(); }
  size_t state_bytes() const { return lay_.state; }
  size_t trans_bytes() const { return lay_.trans; }
  size_t conv_bytes() const { return lay_.conv; }
  int device() const { return device_; }
  bool no_transitions = false;  ///< made with BackendOptions::benchmark_skip_transitions: not spliceable

 private:
  float* f32(size_t off) const { return reinterpret_cast<float*>(base_ + off); }
  SegmentEntry header_;
  CudaBackend* owner_;
  EntryLayout lay_;
  int device_ = 0;
  DeviceMemory mem_;       // empty for a staged view
  char* base_ = nullptr;   // mem_'s bytes, or a staged view's place
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
  // A segment brought as a host block (PlanSegment::block): the block, whose entry `e` (a StagedView) is copied into
  // the splice's staging area, and its staging group (assigned by the Stager; -1 until then). Null / -1 otherwise.
  const CudaHostBlock* block = nullptr;
  int stage = -1;
  int from() const { return kind == Interior ? e->header().seam_tokens() : 0; }
  // Affine steps per layer (fold_steps): an Install of an entry with a seam takes two, every other fold one.
  int steps() const { return kind == Install && e->has_seam() ? 2 : 1; }
};

// Ring-linear's cached states rotated to their real positions (CudaBackend::place_states): (entry state, base) ->
// the rotated copy.
using Placed = std::map<std::pair<const float*, int64_t>, const float*>;

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
  /// Greedy rows' argmax on the device (kernels/cuda/ops.h argmax_rows); the logits rows are copied, and the
  /// sampling rows' logits too, picked on the host (Backend::sample_row).
  void decode_step(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
                   std::span<const uint8_t> modes, DecodeStepOutput& out,
                   std::span<const SampleDraw> draws = {}) override;
  BackendMemory memory() const override;
  bool concurrent_decode() const override { return opt_.concurrent_decode; }
  void set_decoding_sequences(int n) override { decoders_.store(n); }
  bool device_entries() const override { return true; }
  std::shared_ptr<const HostBlock> copy_to_host(const ResidentEntry& entry) const override;
  std::shared_ptr<const ResidentEntry> import_block(const HostBlock& block) const override;
  std::shared_ptr<const SegmentEntry> entry_of_block(const HostBlock& block) const override;
  std::shared_ptr<const HostBlock> block_of_entry(const SegmentEntry& entry) const override;
  std::string wire_of_block(const HostBlock& block) const override;
  void write_wire_of_block(const HostBlock& block, const std::function<void(uint64_t)>& begin,
                           const std::function<void(std::string_view)>& out) const override;
  std::optional<WireBlock> wire_block(const SegmentEntry& header, const WireShape& shape) const override;
  size_t entry_bytes(int64_t tokens) const override { return EntryLayout(geom_, tokens, true).total; }
  void reserve_host_blocks(size_t bytes) const override { pinned_->reserve(bytes); }

  // Used by entries and sequences (any thread).
  void release(int slot, const std::vector<int>& pages);
  void defer_free(DeviceMemory&& m) {
    std::lock_guard lock(free_mu_);
    pending_free_bytes_ += m.size();
    pending_free_.push_back(std::move(m));
  }
  /// Device bytes of the entries alive now (CudaEntry objects; BackendMemory::entries_used).
  std::atomic<size_t> live_entry_bytes{0};
  /// A new entry allocated stream-ordered on `stream` from any thread (import_block, allocate_entry). When the device
  /// is out of memory while dropped entries wait for the engine loop's next call to free them (deferred frees), it
  /// frees them now (under capture_mu_, so after the loop's running call and never during a graph capture), waits for
  /// the streams they were freed on, and tries once more. Throws ResourceExhausted as CudaEntry does.
  std::shared_ptr<CudaEntry> new_entry_any_thread(const SegmentEntry& header, cudaStream_t stream) const;
  ModelState download_state(const CudaSequence& s) const;
  size_t sequence_state_bytes() const { return size_t(n_lin_) * (state_layer_bytes_ + conv_layer_bytes_); }
  size_t page_bytes() const { return size_t(n_attn_) * kPage * (kv_row_ + v_row_); }
  /// The prefill lane's whole-device stream (never switched; the partition stream's work is joined into it at the
  /// end of each engine-loop call).
  cudaStream_t stream() const { return full_stream_; }
  const EntryGeometry& geometry() const { return geom_; }
  int n_lin() const { return n_lin_; }
  int n_attn() const { return n_attn_; }
  size_t kv_row_bytes() const { return kv_row_; }
  /// Which kernels the linear and attention layers run (by the config's family).
  enum class Lin { Gdn, Kda, Lightning };
  enum class Attn { Gated, Plain, Mla };
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
  // Slot `slot`'s state of linear layer l: [H][d_k][d_v] fp32 (the pool's stride is the family's state size: the
  // kernels index slots with it too).
  float* ssm(int l, int slot) const { return ssm_pool_[l].as<float>() + size_t(slot) * (state_layer_bytes_ / sizeof(float)); }
  kc::bf16* convs(int l, int slot) const {
    return reinterpret_cast<kc::bf16*>(conv_pool_[l].bytes_ptr(size_t(slot) * conv_layer_bytes_));
  }
  void check_ids(std::span<const int32_t> ids, const std::string& where) const;
  void check_entry(const PlanSegment& s, size_t i, const SplicePlan& plan) const;
  // A staged view (CudaEntry::StagedView) of segment i's host block, checked against this model, the plan's w and
  // the segment's ids. Throws EntryError / std::invalid_argument naming the segment.
  std::unique_ptr<CudaEntry> staged_view(const PlanSegment& s, size_t i, const SplicePlan& plan);

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
  // The items of a schedule (engine/splice_schedule.h): its folds on this backend's entries, its spans over `prompt`
  // (every segment's ids, then the query); prefix mode's consecutive segment spans joined into one.
  // views: per plan segment, the staged view of its host block (null where it brings a resident entry or none).
  std::vector<Item> items_of(const SplicePlan& plan, const SpliceSchedule& sch, std::span<const int32_t> prompt,
                             std::span<const std::unique_ptr<CudaEntry>> views) const;
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
    kc::bf16 *hn = nullptr, *qkv = nullptr, *q = nullptr, *k = nullptr, *v = nullptr,
             *z = nullptr, *ga = nullptr, *gb = nullptr, *o = nullptr, *qg = nullptr, *kv = nullptr, *aq = nullptr,
             *ao = nullptr;
    // The other families' mixers (engine/cuda/*_mixer.h); the workspace pointers stay null (prefill scans get theirs
    // from lin_ws_).
    KdaScratch kda;
    LightningScratch light;
    MlaScratch mla;
    bool decode = false;  ///< the decode lane (project: decode_linear for small batches)
    unsigned* norm_counter = nullptr;  ///< DEVICE: decode_linear's last-block norm counter (decode lane only)
  };
  // Allocates `mem` for T tokens' activations and points a lane's buffers into it.
  void carve_activations(DeviceMemory& mem, size_t T, const std::string& what, Lane& lane);
  /// Projections of T tokens sharing the input x [T][K] (row stride K), DEVICE pointers: on the decode lane up to
  /// kDecodeLinearProjectionTokens tokens one weight-streaming decode_linear launch when it takes the shape
  /// (kernels/cuda/decode_linear.h), else one GemmRunner call per output (bf16 or fp32 y; AddF32 = beta 1).
  /// then_norm (optional): the RMSNorm weight [H] of the next step; with one AddF32 output on decode_linear (no
  /// post-norm residuals) the launch also writes ln.hn = norm(the output rows) (kernels/cuda/decode_linear.h
  /// DecodeLinearNorm) and project returns true; otherwise it returns false and the caller runs the norm.
  bool project(const Lane& ln, int T, int K, const kc::bf16* x, std::initializer_list<kc::DecodeLinearOutput> outs,
               kc::DecodeLinearEpilogue epilogue, float alpha = 1.f, const kc::bf16* then_norm = nullptr);
  void linear_gemms(const Lane& ln, const DevLinear& L, int T);
  /// The layer's input norm: hn = norm(x) (zero-centred for Qwen, else w); MiniMax's post-norm layers also set
  /// x = alpha norm(x) (kernels/cuda/ops.h rms_norm_residual post_alpha) before the mixer adds beta f into it.
  void mixer_norm(const Lane& ln, const DevLayer& L, int T);
  /// The other families' linear layers over a varlen batch (prefill lane): the first half (projections, KDA's convs
  /// with per-sequence conv states conv_state [num_seqs][K-1][C] bf16 in/out, or the lightning q/k/v at positions),
  /// then linear_scan (any number of times), then linear_family_finish.
  void linear_family_project(const Lane& ln, const DevLayer& L, int T, int num_seqs, const int* cu_dev,
                             kc::bf16* conv_state, const int* positions);
  /// One KDA / lightning scan (layer L's) of the lane's q/k/v (and gates) rows [0, cu_host[num_seqs]) (or of the rows given in
  /// q, k, v, g, beta when set: seams gathered elsewhere): init / final [num_seqs][H][d_k][d_v] fp32 (null: zero /
  /// not kept), trans [num_seqs] x (dense [H][d][d] | scalar [H]) fp32 (null: not computed), the output into ln's o
  /// when `out`. cu_dev: DEVICE copy of cu_host.
  void linear_scan(const Lane& ln, const DevLayer& L, int num_seqs, const int* cu_dev, const int* cu_host, const float* init, float* fin,
                   float* trans, bool out, const kc::bf16* q = nullptr, const kc::bf16* k = nullptr,
                   const kc::bf16* v = nullptr, const float* g = nullptr, const float* beta = nullptr);
  void linear_family_finish(const Lane& ln, const DevLayer& L, int T);
  /// affine_chain (dense transitions) or affine_chain_scalar (lightning) over this model's linear states.
  void chain(int num_chains, int steps_per_chain, const kc::AffineStep* steps, const float* const* init,
             float* const* fin, cudaStream_t stream) const;
  /// Ring-linear: copies of the cached states that `folds` use, rotated on the key axis to their real positions
  /// (kernels/cuda/lightning.h rope_key_axis; DESIGN.md 3.3), in `mem`; fold_steps reads them through the map.
  /// Empty for every other family and for folds at base 0. Synchronizes the engine's stream.
  Placed place_states(const std::vector<const Fold*>& folds, DeviceMemory& mem);
  /// The K/V rows that folds bring into the pool (host tables of kv_import / mla_latent_import): per fold with rows
  /// past its from(), one run of the entry's consecutive rows [from, n) going to the pool rows of real positions
  /// base + from .. base + n - 1, K re-rotated by base. k / v: per attention layer, each run's first row (device).
  /// (MLA reads k and run_start / dst only: latent rows, no V, no RoPE.)
  struct KvImport {
    std::vector<int> run_start{0};                   // [runs + 1], import rows
    std::vector<int> deltas;                         // [runs]: the fold's base
    std::vector<int> dst;                            // [rows]: pool rows
    std::vector<std::vector<const kc::bf16*>> k, v;  // [n_attn][runs]
    int rows() const { return run_start.back(); }
    int runs() const { return int(deltas.size()); }
  };
  /// Offsets of a KvImport's vectors in a pass's Tables.
  struct KvImportTables {
    size_t run_start = 0, deltas = 0, dst = 0;
    std::vector<size_t> k, v;  // [n_attn]
  };
  /// The import of `folds`' rows into s's pages (which must already cover them: ensure_pages).
  KvImport plan_kv_import(const CudaSequence& s, const std::vector<const Fold*>& folds) const;
  KvImportTables add_kv_import(Tables& tb, const KvImport& kv) const;
  /// K/V rows of cached entries into the pool for attention layer a, from tables uploaded in tb: Plain / Gated
  /// kv_import (K re-rotated by the runs' deltas), MLA mla_latent_import (latent rows; no V, no RoPE).
  void import_kv(int a, const KvImport& kv, const KvImportTables& t, const Tables& tb);
  /// Attention layer a of any family (Gated / Plain: attention_mixer; MLA: mla_mixer, expanded over `mla_expand`'s
  /// scratch pages when given, else absorbed).
  void attention_layer(const Lane& ln, const DevLayer& L, int a, int T, const int* positions, const int* kv_rows,
                       const kc::AttnGroups& groups, bool decode, const MlaExpandPass* mla_expand = nullptr);
  /// MLA prefill passes: when the expanded form is the cheaper (mla_pass_form) and its scratch holds the plan's rows
  /// (grown here when the device has room; else the pass stays absorbed, which takes any length, only slower), the expansion
  /// plan's tables go into `tb` (before its upload) and on = true; mla_expand_pass then gives the device view (after
  /// the upload).
  struct MlaExpandTables {
    bool on = false;
    int rows = 0, max_pages = 0;
    size_t t_src = 0, t_bt = 0;
  };
  MlaExpandTables plan_mla_expand(Tables& tb, int G, const int* q_start, const int* slot0, const int* bt,
                                  int max_pages);
  MlaExpandPass mla_expand_pass(const MlaExpandTables& x, const Tables& tb, const kc::AttnGroups& groups) const;
  /// Grows the MLA expansion scratch to at least `rows` rows (to a multiple of 4096); false when the device has no
  /// room (the scratch then keeps its old size where it can; a size that failed is tried again only when
  /// cudaMemGetInfo shows room for it).
  bool grow_mla_scratch(int rows);
  /// The GDN layer's gated norm and out_proj added into the residual; with then_norm (the post-attention norm's
  /// weight) returns whether the out_proj launch also wrote ln.hn = norm(x) (project).
  /// gated_normed: ln.o already holds the gated norm (gdn_decode_gated did it).
  bool linear_finish(const Lane& ln, const DevLinear& L, int T, const kc::bf16* then_norm = nullptr,
                     bool gated_normed = false);
  void attention_gemms(const Lane& ln, const DevAttention& A, int T);
  void attention_mixer(const Lane& ln, const DevAttention& A, int a, int T, const int* positions, const int* kv_rows,
                       const kc::AttnGroups& groups, bool decode);
  /// Post-attention norm and MLP / MoE of T tokens added into the residual; decode: a (capturable) decode step.
  /// next_norm: the RMSNorm weight [H] bf16 of what reads the residual next (the next layer's input norm, or the final
  /// norm before the LM head), or nullptr. Returns true when it also wrote ln.hn = norm(x) with it (a MoE layer
  /// without post-norm residuals: kernels/cuda/moe.h MoeNextNorm), so the caller skips that norm.
  /// normed: ln.hn already holds the post-attention norm of x (linear_finish did it), so ffn skips it.
  bool ffn(const Lane& ln, const DevLayer& L, int T, bool decode = false, const kc::bf16* next_norm = nullptr,
           bool normed = false);
  /// The weight of layer i's successor's input norm (nullptr for the last layer): ffn's next_norm in the layer loops.
  const kc::bf16* next_input_norm(int i) const;
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
  /// decode() and decode_step(): one step whose logits stay in dec_logits_ [B][V] (device); then `download` (on
  /// dec_stream_, before the step's synchronisation) copies what the caller needs.
  void decode_device(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
                     const std::function<void(int B)>& download);
  struct GraphExec {
    explicit GraphExec(cudaGraphExec_t e) : e_(e, [](cudaGraphExec_t x) { if (x) cudaGraphExecDestroy(x); }) {}
    cudaGraphExec_t get() const { return e_.get(); }
    std::shared_ptr<std::remove_pointer_t<cudaGraphExec_t>> e_;
  };

  // Prefix checkpoints (prefix mode): states at segment ends and each segment's KV rows, keyed by the chain digest.
  size_t checkpoint_bytes(int64_t tokens) const {
    return size_t(n_lin_) * (state_layer_bytes_ + conv_layer_bytes_) + size_t(n_attn_) * size_t(tokens) * (kv_row_ + v_row_);
  }
  float* checkpoint_state(const Checkpoint& c, int l) const {
    return reinterpret_cast<float*>(c.mem.bytes_ptr(size_t(l) * (state_layer_bytes_ + conv_layer_bytes_)));
  }
  char* checkpoint_conv(const Checkpoint& c, int l) const {
    return c.mem.bytes_ptr(size_t(l) * (state_layer_bytes_ + conv_layer_bytes_) + state_layer_bytes_);
  }
  char* checkpoint_kv(const Checkpoint& c, int a, int kvi) const {
    return c.mem.bytes_ptr(size_t(n_lin_) * (state_layer_bytes_ + conv_layer_bytes_) +
                           (size_t(a) * (kv_row_ + v_row_) + size_t(kvi) * kv_row_) * size_t(c.n - c.start));
  }
  // The slot's linear states and conv tails into checkpoint cp (the state after the pass that ended at cp.n).
  void save_checkpoint_states(const CudaSequence& s, Checkpoint& cp);
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
  // kv_row_ / v_row_: bytes of one token's K / V row in the pool, [nkv][hd] bf16 (MLA: K is the latent row [R + rope],
  // v_row_ 0, no V pool); pool rows are entry rows (EntryLayout). trans_layer_bytes_: one linear layer's T (dense or
  // scalar).
  size_t state_layer_bytes_ = 0, trans_layer_bytes_ = 0, conv_layer_bytes_ = 0, kv_row_ = 0, v_row_ = 0;
  size_t row_bytes(int kvi) const { return kvi ? v_row_ : kv_row_; }
  Lin lin_ = Lin::Gdn;
  Attn attn_ = Attn::Gated;
  bool zc_ = true;         // zero-centred RMSNorms (Qwen)
  bool post_norm_ = false;  // MiniMax's post-norm residuals
  int state_heads_ = 0, state_head_floats_ = 0;  // linear states: [heads][d_k d_v]
  KdaLayerConfig kda_cfg_;
  LightningLayerConfig light_cfg_;
  MlaLayerConfig mla_cfg_;
  DeviceMemory lin_ws_;  // KDA / lightning prefill workspace (prefill lane), grown on demand
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
  // A splice's host blocks copied into its staging area (Stager, cuda_splice.cpp; engine thread only).
  cudaStream_t stage_stream_ = nullptr;
  class Stager;
  struct StageStats {
    int segments = 0, groups = 0;
    size_t bytes = 0;
  };
  StageStats stage_stats_;  // of the running splice (engine thread only)
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
  kc::MlaAttnWorkspace mla_ws_, mla_dec_ws_;  // MLA's absorbed attention: prefill passes', decode steps' (graphs)
  Tables pass_tables_;                        // run_pass's host tables, reused (engine thread only)
  DeviceMemory mla_uk_t_;                     // W_UK^T of every MLA layer ([nh][R][nope] each)
  DeviceMemory mla_x_mem_;                    // MLA's expansion scratch (grown to the longest expanded pass)
  MlaExpandScratch mla_xs_;
  int mla_x_failed_rows_ = 0;                 // the smallest scratch rows whose allocation failed (0: none)
  // Pools.
  std::vector<DeviceMemory> ssm_pool_, conv_pool_, k_pool_, v_pool_;
  std::vector<int> free_slots_, free_pages_;  // guarded by pool_mu_ (sequences may be released on any thread)
  mutable std::mutex pool_mu_;
  // Device memory of dropped entries, freed on the engine thread at the next call (drain_frees).
  mutable std::mutex free_mu_;
  std::vector<DeviceMemory> pending_free_;
  size_t pending_free_bytes_ = 0;  // of pending_free_, guarded by free_mu_
  void drain_frees() {
    if (partition_depth_ > 0) return;  // inside a PartitionScope: at the next top-level call
    std::vector<DeviceMemory> drop;
    {
      std::lock_guard lock(free_mu_);
      drop.swap(pending_free_);
      pending_free_bytes_ = 0;
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
  DeviceMemory dec_argmax_;                       // decode_step: greedy tokens [max_sequences] int32
  // decode_step's device-sampled rows: row ids [max_sequences] int32, their tokens [max_sequences] int32, then (at
  // sample_draws_offset(), 16-byte aligned) their draws [max_sequences] kernels::cuda::SampleRowDraw.
  DeviceMemory dec_sample_;
  DeviceMemory dec_norm_counter_;  // decode lane: decode_linear's last-block norm counter (one unsigned)
  DeviceMemory dec_gdn_counters_;  // decode lane: gdn_decode_gated's norm counters [max_sequences][nv] unsigned
  size_t sample_draws_offset() const { return (size_t(opt_.max_sequences) * 8 + 15) / 16 * 16; }
  // Captured decode steps by (batch, block-table width), captured and launched on dec_full_stream_ only (a graph's
  // kernels keep the context, and so the SMs, of the stream they were captured on).
  std::map<std::pair<int, int>, GraphExec> graphs_;
  // Held by the engine loop's calls (splice, build_entries, import_entry) for their whole run and by a decode step's
  // graph capture, which only try-locks it (else the step runs eager and captures later): a capture never overlaps
  // the loop's allocations and frees, which synchronize the device and would invalidate it.
  std::recursive_mutex capture_mu_;  // recursive: without a concurrent decode, decode() runs inside splice()
  int graphs_generation_ = 0;                         // kernels/cuda/switches.h candidate_generation of graphs_
  std::set<std::pair<int, int>> warmed_;              // shapes run once eagerly (GEMM plans made)
  DeviceMemory tables_dev_;
  DeviceMemory run_scratch_;  // per-run states of a pass
  std::vector<float> logits_host_;
  // Prefix mode's checkpoints (engine/prefix_cache.h), budget BackendOptions::prefix_cache_bytes of device memory.
  PrefixCache<Checkpoint> prefix_;
  std::vector<std::vector<int>> live_pages_unused_;
};

// q_start_host / slot0_host: optional host copies (kept alive through the pass) that let attention_prefill run the
// long groups through cuDNN's SDPA (kernels/cuda/attention.h).
inline kc::AttnGroups attn_groups(int num_groups, const int* q_start, const int* slot0, const int* block_table, int max_pages,
                           int total_q, int max_q, int max_kv, const int* q_start_host = nullptr,
                           const int* slot0_host = nullptr) {
  kc::AttnGroups g;
  g.num_groups = num_groups, g.q_start = q_start, g.slot0 = slot0, g.block_table = block_table;
  g.max_pages = max_pages, g.total_q = total_q, g.max_q = max_q, g.max_kv = max_kv;
  g.q_start_host = q_start_host, g.slot0_host = slot0_host;
  return g;
}

}  // namespace hypic::engine::cuda::impl
