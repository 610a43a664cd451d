// The CPU fp32 backend (engine/backend.h): a thin wrapper over the reference forward pass (engine/cpu/model.h),
// the splice (engine/cpu/splice.h) and the entry builder (build_segment_entry). It adds no arithmetic of its own, so
// its numbers are those of Model / splice() bit for bit. Numerics "cpu-fp32"; everything lives in host memory.
#pragma once
#include <atomic>
#include <memory>

#include "engine/backend.h"
#include "engine/cpu/model.h"
#include "engine/cpu/splice.h"

namespace hypic::engine {

/// A CPU request state: the ModelState of engine/cpu/model.h and the next decode position.
class CpuSequence final : public Sequence {
 public:
  int64_t num_tokens() const override { return position_; }
  size_t bytes() const override { return model_state_bytes(state_); }
  ModelState to_host() const override { return state_; }
  /// The state itself (no copy).
  const ModelState& state() const { return state_; }
  ~CpuSequence() override;

 private:
  friend class CpuBackend;
  CpuSequence(const void* owner, ModelState state, int64_t position,
              std::shared_ptr<std::atomic<int64_t>> live_bytes);
  const void* owner_;
  ModelState state_;
  int64_t position_;
  std::shared_ptr<std::atomic<int64_t>> live_bytes_;  // the backend's kv_used counter (may outlive it)
  int64_t counted_ = 0;                               // what this sequence added to it
  void recount();
};

/// A CPU-resident entry: the host SegmentEntry itself, shared (host() costs nothing).
class CpuEntry final : public ResidentEntry {
 public:
  const SegmentEntry& header() const override { return *entry_; }
  std::shared_ptr<const SegmentEntry> host() const override { return entry_; }
  size_t resident_bytes() const override { return bytes_; }
  ~CpuEntry() override;

 private:
  friend class CpuBackend;
  CpuEntry(std::shared_ptr<const SegmentEntry> entry, std::shared_ptr<std::atomic<int64_t>> live_bytes);
  std::shared_ptr<const SegmentEntry> entry_;
  size_t bytes_;
  std::shared_ptr<std::atomic<int64_t>> live_bytes_;  // the backend's entries_used counter (may outlive it)
};

/// The CPU backend. Safe to call from several threads at once (the model is immutable, the prefix cache locks).
class CpuBackend final : public Backend {
 public:
  /// Loads `model_dir` (Model::load). Throws std::invalid_argument for cpu_threads < 1 or a random_weights_seed
  /// (CUDA only), and whatever Model::load throws.
  static std::unique_ptr<CpuBackend> load(const std::filesystem::path& model_dir, const BackendOptions& options = {});
  /// Wraps an already loaded model (tests, tools). Same option checks as load().
  CpuBackend(Model model, const BackendOptions& options = {});

  const ModelConfig& config() const override { return model_.config(); }
  DeviceSpec device() const override { return {}; }
  std::string_view numerics() const override { return backend_numerics(BackendKind::Cpu); }
  const std::string& fingerprint() const override { return fingerprint_; }

  std::vector<std::shared_ptr<const ResidentEntry>> build_entries(std::span<const std::vector<int32_t>> segments,
                                                                  int seam_width,
                                                                  const BuildCancelled& cancelled = {}) override;
  std::shared_ptr<const ResidentEntry> import_entry(std::shared_ptr<const SegmentEntry> entry) override;
  SpliceOutput splice(const SplicePlan& plan) override;
  void decode(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
              std::vector<float>& logits) override;
  BackendMemory memory() const override;

  /// The wrapped model (evaluation tools compare against it).
  const Model& model() const { return model_; }
  /// The prefix-mode state checkpoints (BackendOptions::prefix_cache_bytes).
  const PrefixStateCache& prefix_cache() const { return prefix_; }

 private:
  std::shared_ptr<const ResidentEntry> wrap(std::shared_ptr<const SegmentEntry> entry);
  Model model_;
  BackendOptions options_;
  std::string fingerprint_;
  EntryGeometry geometry_;
  size_t weight_bytes_ = 0;
  PrefixStateCache prefix_;
  std::shared_ptr<std::atomic<int64_t>> kv_used_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<std::atomic<int64_t>> entries_used_ = std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace hypic::engine
