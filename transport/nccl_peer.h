// The GPU-to-GPU data plane for segment entries (DESIGN.md section 5, "data plane"): a two-rank NCCL communicator
// between one combine worker (rank 0, receives) and one scatter worker (rank 1, sends), over which a resident
// entry's device block (engine/backend.h DeviceBlock) goes from the scatter worker's device memory straight into the
// combine worker's, by ncclSend / ncclRecv point to point. gRPC carries the control: CombineWorker.OpenPeer hands out
// the unique id, EntryHeader names the communicator (its epoch) and the block's size, ClosePeer tears it down
// (combine_worker/service.cpp, scatter_worker/service.cpp). gRPC streaming stays the fallback wherever this is not
// available: a build without CUDA, the CPU backend, two workers on the same GPU, or a peer that failed.
//
// Faults: every wait is bounded. A transfer polls its completion against a deadline, an asynchronous NCCL error
// (ncclCommGetAsyncError) and the caller's give-up test (its RPC cancelled); on any of them the communicator is
// aborted (ncclCommAbort) and marked broken, and TransportError says why. A broken peer is never used again: the
// services open a new one (a new epoch) for the next entry and send this one over gRPC.
//
// NVLink multicast stays off (NCCL_NVLS_ENABLE=0, forced in this process before any communicator is made): on the
// shared GPU hosts a program using it can put every GPU of the host out of service.
//
// Threading: a NcclPeer runs one transfer at a time; callers hold exclusive() across a transfer and the control
// message that announces it, so that both ranks post their operations in the same order. abort_soon() may be called
// from any thread.
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>

namespace hypic::transport {

/// A transport failure: the communicator could not be made, or a transfer failed and the communicator was aborted.
class TransportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Empty when this build has the NCCL data plane (CUDA and NCCL found at configure time: HYPIC_WITH_NCCL); else why
/// not, e.g. "this build has no NCCL data plane (configured without CUDA)".
std::string nccl_unavailable_reason();

/// The linked NCCL's version, "2.28.9" (ncclGetVersion); empty without NCCL.
std::string nccl_version();

/// Sets NCCL_NVLS_ENABLE=0 in this process's environment (overriding any other value, with a warning naming it), so
/// that no communicator made here uses NVLink multicast. Idempotent; NcclPeer::join calls it.
void disable_nvls();

/// A new communicator's unique id (ncclGetUniqueId): 128 raw bytes, made by the rank-0 side (the combine worker) and
/// sent to the other in OpenPeerResponse. Throws TransportError (no NCCL in this build, or NCCL failed).
std::string new_unique_id();

/// The UUID of CUDA device `device` as 32 hex digits (cudaDeviceProp::uuid): two workers whose devices have the same
/// UUID share one GPU, which NCCL does not allow in one communicator. Throws TransportError (no CUDA, bad ordinal).
std::string device_uuid(int device);

/// Limits of one transfer.
struct TransferLimits {
  size_t chunk_bytes = size_t(16) << 20;  ///< bytes per ncclSend / ncclRecv; both ranks must use the same (> 0)
  std::chrono::steady_clock::time_point deadline;  ///< abort if the transfer has not completed by then
  std::function<bool()> give_up;                   ///< optional: polled; true aborts (e.g. the RPC was cancelled)
};

/// A deadline for moving `bytes`: now + base + bytes at `min_bytes_per_s` (the slowest link we accept; NVLink moves
/// hundreds of GB/s, PCIe and RDMA tens).
std::chrono::steady_clock::time_point transfer_deadline(size_t bytes, std::chrono::milliseconds base,
                                                        double min_bytes_per_s = 1e9);

/// One communicator of two ranks. Rank 0 receives, rank 1 sends (entries flow from scatter to combine workers).
class NcclPeer {
 public:
  /// Joins the communicator `unique_id` (new_unique_id) as `rank` (0 or 1) of 2 on CUDA device `device`, with
  /// nonblocking NCCL calls; returns once both ranks joined. Throws TransportError if it has not by `timeout`
  /// (the half-made communicator is aborted), or on any NCCL / CUDA error, naming it.
  static std::unique_ptr<NcclPeer> join(std::string_view unique_id, int rank, int device,
                                        std::chrono::milliseconds timeout);
  /// Destroys the communicator (aborts it if broken or a transfer is pending).
  ~NcclPeer();
  NcclPeer(const NcclPeer&) = delete;
  NcclPeer& operator=(const NcclPeer&) = delete;

  /// Rank 1: sends `bytes` bytes at device pointer `data` (on this peer's device) in chunks of limits.chunk_bytes
  /// and waits until they are sent. Throws TransportError after aborting the communicator (deadline, give_up, NCCL
  /// or CUDA error), or if it is broken already.
  void send(const void* data, size_t bytes, const TransferLimits& limits);
  /// Rank 1: posts the send of `bytes` at `data` and returns without waiting; wait() completes it. Lets the caller
  /// wait on the control message (the receiver's answer) meanwhile. Throws as send().
  void post_send(const void* data, size_t bytes, const TransferLimits& limits);
  /// Rank 0: receives `bytes` bytes into device pointer `data` (on this peer's device), in chunks of
  /// limits.chunk_bytes, and waits until they are in. Throws as send().
  void recv(void* data, size_t bytes, const TransferLimits& limits);
  /// Rank 0: receives `bytes` bytes and drops them (into one chunk of scratch), keeping the communicator in step when
  /// an announced entry is refused. Throws as send().
  void discard(size_t bytes, const TransferLimits& limits);
  /// Waits for the operations posted so far (post_send) until limits.deadline / give_up; throws as send().
  void wait(const TransferLimits& limits);

  /// Aborts the communicator now if no transfer runs, else makes the running transfer abort at its next poll.
  /// Thread-safe. The peer is broken afterwards.
  void abort_soon(std::string why);
  /// True once aborted (or failed); broken_reason() says why.
  bool broken() const { return broken_.load(); }
  std::string broken_reason() const;

  /// Held across one transfer and the control message announcing it (see the header comment).
  std::unique_lock<std::mutex> exclusive() { return std::unique_lock<std::mutex>(order_); }

  int rank() const { return rank_; }
  int device() const { return device_; }

 private:
  struct Impl;
  explicit NcclPeer(std::unique_ptr<Impl> impl, int rank, int device);
  void fail(const std::string& why);  // aborts, marks broken, throws TransportError(why)
  void post(bool is_send, void* data, size_t bytes, const TransferLimits& limits);

  std::unique_ptr<Impl> impl_;
  int rank_ = 0, device_ = 0;
  std::mutex order_;          // exclusive()
  std::mutex state_;          // guards the communicator's life against abort_soon from other threads
  bool busy_ = false;         // a transfer polls (abort_soon defers to it)
  std::atomic<bool> broken_{false}, abort_requested_{false};
  std::string broken_reason_, abort_reason_;
};

}  // namespace hypic::transport
