// A spatial split of one GPU's streaming multiprocessors between decode steps and prefill passes (CUDA green
// contexts, driver API, CUDA 12.5+ drivers).
#pragma once
#include <cuda_runtime_api.h>

#include <memory>
#include <string>

namespace hypic::engine::cuda {

/// Two disjoint SM partitions of one device, each with a stream whose kernels run only on its SMs: a decode
/// partition of at least `decode_sms` SMs (rounded up to the device's partition granularity: multiples of 8 SMs
/// on compute capability 9.x, cuDevSmResourceSplitByCount) and a prefill partition of the rest. Both streams are
/// non-blocking streams of green contexts of the device's primary context (cuGreenCtxCreate +
/// cuGreenCtxStreamCreate): they share its memory, and runtime-API launches, cuBLAS calls and CUDA graphs work on
/// them from any thread with the primary context current. The decode stream has the device's highest priority.
/// Kernels keep sizing their grids for the whole device on these streams (their split counts, cuBLASLt's
/// algorithms), so that results do not depend on which partition ran them: same kernels, same bits. (Measured on
/// an H200, planning for the partition's SMs instead made a prefill beside decode steps about 10% faster: 2048-token builds 114 against 131 ms, 16k-token prefills 552 against 600 ms; not worth
/// results that change with the load.)
///
/// Used by the CUDA backend while decode steps run beside a prefill pass (BackendOptions::decode_sms): the pass runs
/// on prefill_stream(), so its long-running blocks never occupy the decode partition's SMs, and each of a step's
/// hundreds of small kernels, launched on a whole-device stream of the highest priority, starts there at once
/// instead of waiting for a prefill block to retire (and spreads to prefill SMs as they free). The backend keeps
/// decode steps off decode_stream(): a CUDA graph's kernels run on the SMs of the stream it was captured on, wherever
/// it is launched, and a step's graph is captured on the whole device; decode_stream() serves tests and tools.
///
/// The driver's entry points are resolved at run time (cudaGetDriverEntryPointByVersion), so nothing links
/// libcuda. Not copyable; destroying it synchronizes and destroys both streams and contexts.
class SmPartition {
 public:
  /// Splits device `device` (an ordinal; the runtime's primary context must be initialized on it). Throws
  /// std::invalid_argument naming the counts when decode_sms is < 1 or leaves the prefill partition fewer SMs than
  /// the driver's minimum partition, std::runtime_error naming the call when the driver has no green contexts
  /// (older than 12.5) or a driver call fails.
  static std::unique_ptr<SmPartition> create(int device, int decode_sms);
  SmPartition(const SmPartition&) = delete;
  SmPartition& operator=(const SmPartition&) = delete;
  ~SmPartition();

  /// The decode partition's stream (highest priority).
  cudaStream_t decode_stream() const { return decode_stream_; }
  /// The prefill partition's stream (default priority).
  cudaStream_t prefill_stream() const { return prefill_stream_; }
  /// A second stream of the prefill partition, for work forked beside prefill_stream() (the gated-delta
  /// transition folds: kernels::cuda::GdnWorkspace::set_side_stream).
  cudaStream_t prefill_side_stream() const { return prefill_side_stream_; }
  /// SMs of each partition and of the whole device.
  int decode_sms() const { return decode_sms_; }
  int prefill_sms() const { return prefill_sms_; }
  int device_sms() const { return device_sms_; }
  /// "decode 16 + prefill 116 of 132 SMs".
  std::string describe() const;

 private:
  struct Impl;
  SmPartition() = default;
  std::unique_ptr<Impl> impl_;
  cudaStream_t decode_stream_ = nullptr, prefill_stream_ = nullptr, prefill_side_stream_ = nullptr;
  int decode_sms_ = 0, prefill_sms_ = 0, device_sms_ = 0;
};

}  // namespace hypic::engine::cuda
