// hypic.v1.ScatterWorker: standalone prefill of cold segments, each entry streamed to the combine
// worker as soon as it is built (overlapping the next build) and put in the segment cache in the
// background; builds of one digest are shared by every request waiting for it (scatter_worker/shared_builds.h;
// semantics in scatter.proto).
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "engine/engine_loop.h"
#include "hypic/v1/combine.grpc.pb.h"
#include "hypic/v1/scatter.grpc.pb.h"
#include "proto/rpc/entry_mac.h"
#include "proto/rpc/server.h"
#include "transport/nccl_links.h"
#include "scatter_worker/shared_builds.h"
#include "segment_cache/async_put.h"

namespace hypic::worker {

using transport::NcclLinks;

/// Stubs of combine workers by address, created on first use and shared.
class CombineStubs {
 public:
  hypic::v1::CombineWorker::Stub& get(const std::string& address);

 private:
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<hypic::v1::CombineWorker::Stub>> stubs_;
};

/// Streams one serialized entry to a combine worker (CombineWorker.DeliverEntry) on `ctx`: a
/// header, then chunks, then, when `keys` has a key, the entry's MAC over `digest`, `token_ids` and the bytes
/// (proto/rpc/entry_mac.h; computed as the chunks are sent). Returns the call's status; *duplicate tells whether the
/// combine worker already had the segment; *written (when not null) the entry bytes the stream accepted (chunks whose
/// Write returned true), which is all of `bytes` unless the call broke off.
grpc::Status deliver_entry(hypic::v1::CombineWorker::Stub& stub, grpc::ClientContext& ctx,
                           const hypic::v1::EntryHeader& header, std::string_view bytes, size_t chunk_bytes,
                           const rpc::EntryMacKeys& keys, const rpc::Digest& digest,
                           std::span<const int32_t> token_ids, bool* duplicate, size_t* written = nullptr);

/// Streams one entry's device block over the NCCL link `link` (transport/nccl_peer.h): writes `header` (its transport
/// fields filled in here: NCCL, the link's epoch, block.bytes, chunk_bytes) on a DeliverEntry call on `ctx`, posts the
/// send, and waits for the combine worker's answer, then for the send. *link_broken tells that the communicator was
/// aborted (the caller drops the link); the status is the combine worker's answer, or UNAVAILABLE naming the NCCL
/// failure when it never answered OK. `transfer_base` is the fixed part of the transfer deadline
/// (transport::transfer_deadline).
grpc::Status deliver_entry_nccl(hypic::v1::CombineWorker::Stub& stub, grpc::ClientContext& ctx,
                                hypic::v1::EntryHeader header, const NcclLinks::Link& link,
                                const engine::DeviceBlock& block, size_t chunk_bytes,
                                std::chrono::milliseconds transfer_base, bool* duplicate, bool* link_broken,
                                std::chrono::milliseconds inject_stall = std::chrono::milliseconds(0));

/// How entries travel to combine workers.
struct DataPlaneOptions {
  /// "auto": over NCCL, device to device, wherever both workers can (CUDA backends on different GPUs, NCCL in both
  /// builds, the combine worker's --nccl on), else gRPC; "grpc": always gRPC streaming.
  std::string entry_transport = "auto";
  size_t nccl_chunk_bytes = size_t(16) << 20;  ///< bytes per ncclSend
  std::chrono::milliseconds nccl_transfer_base{10000};  ///< fixed part of a transfer's deadline
  std::chrono::milliseconds nccl_retry_after{30000};    ///< NCCL held off for a combine worker after a failure
  /// TESTING ONLY: each NCCL delivery waits this long between announcing the entry (its header is sent) and posting
  /// the send, logging it first, so that a test can kill the worker mid-transfer.
  std::chrono::milliseconds inject_transfer_stall{0};
};

class ScatterService final : public hypic::v1::ScatterWorker::Service {
 public:
  /// The referenced objects must outlive the service; builds run on `loop` (its backend's fingerprint is what
  /// digests are checked under), which must be stopped before the service goes away (its build callbacks use the
  /// service); finished builds go to the segment cache through `putter`. `compute_threads` and
  /// `random_weights_seed` (0: real weights) are reported in WorkerInfo. `address` is what this worker reports as
  /// built_by (filled in once the port is known).
  /// `data_plane` says how entries travel (gRPC, or NCCL where both ends can). Throws std::invalid_argument for an
  /// unknown entry_transport or a zero nccl_chunk_bytes.
  ScatterService(engine::EngineLoop& loop, cache::AsyncCachePutter& putter, rpc::Lifecycle& life, size_t chunk_bytes,
                 int compute_threads, uint64_t random_weights_seed = 0, DataPlaneOptions data_plane = {});
  /// Also names this worker in the NCCL links it opens.
  void set_address(std::string address);
  /// The combine workers (host:port, as the router names them) this worker may deliver to (--combine); a Prefill
  /// naming another combine_address is refused with PERMISSION_DENIED. Empty: any (a warning at start-up). Call
  /// before serving.
  void set_allowed_combine_workers(std::vector<std::string> addresses) { allowed_combines_ = std::move(addresses); }
  /// This worker's own caps: token ids per segment and segments per Prefill (INVALID_ARGUMENT past them). Call
  /// before serving.
  void set_limits(int64_t max_segment_tokens, int max_segments) {
    max_segment_tokens_ = max_segment_tokens;
    max_segments_ = max_segments;
  }

  grpc::Status Prefill(grpc::ServerContext* ctx, const hypic::v1::PrefillRequest* req,
                       grpc::ServerWriter<hypic::v1::PrefillEvent>* writer) override;
  grpc::Status GetWorkerInfo(grpc::ServerContext* ctx, const hypic::v1::WorkerInfoRequest* req,
                             hypic::v1::WorkerInfo* resp) override;

 private:
  struct PrefillCall;  // one Prefill call's state, shared with its delivery thread and build callbacks (service.cpp)
  // Checks a request against this worker's limits (INVALID_ARGUMENT), its allowed combine workers
  // (PERMISSION_DENIED) and its model's keys; fills call.digests and call.ids. Throws rpc::RpcError.
  void validate(const hypic::v1::PrefillRequest& req, PrefillCall& call) const;
  // The delivery thread of one call: sends each built entry in call.to_deliver (deliver_one) until stopped or one
  // fails, pushing Delivered / Failed events.
  void delivery_loop(grpc::ServerContext* ctx, PrefillCall& call, hypic::v1::CombineWorker::Stub& stub);
  // One entry (segment `position` of the call) to the combine worker: over NCCL where the entry lives on this GPU and
  // a link is (or can be made) up, else, or when NCCL failed in a way gRPC may not, over gRPC; pushes the Delivered
  // or Failed event. False when the delivery failed or the call stopped meanwhile (no event then).
  bool deliver_one(grpc::ServerContext* ctx, PrefillCall& call, uint32_t position, const SharedOutcome& built,
                   hypic::v1::CombineWorker::Stub& stub);
  // A finished build of segment `position` as the router's Computed event (and this worker's build metrics); the
  // build's error or cancellation as a status.
  grpc::Status computed_event(const PrefillCall& call, uint32_t position, const SharedOutcome& built,
                              hypic::v1::PrefillEvent& out) const;
  engine::EngineLoop& loop_;
  std::string fingerprint_, device_;
  rpc::Lifecycle& life_;
  size_t chunk_bytes_;
  int compute_threads_;
  uint64_t random_weights_seed_;
  std::string address_;
  std::vector<std::string> allowed_combines_;
  int64_t max_segment_tokens_ = 32768;
  int max_segments_ = 256;
  DataPlaneOptions data_plane_;
  CombineStubs combines_;
  std::unique_ptr<NcclLinks> links_;
  SharedBuilds builds_;
};

}  // namespace hypic::worker
