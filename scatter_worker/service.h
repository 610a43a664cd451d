// hypic.v1.ScatterWorker: standalone prefill of cold segments, each entry streamed to the combine
// worker as soon as it is built (overlapping the next build) and put in the segment cache in the
// background; builds of one digest are shared by every request waiting for it (scatter_worker/shared_builds.h;
// semantics in scatter.proto).
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/engine_loop.h"
#include "hypic/v1/combine.grpc.pb.h"
#include "hypic/v1/scatter.grpc.pb.h"
#include "proto/rpc/server.h"
#include "scatter_worker/shared_builds.h"
#include "segment_cache/async_put.h"

namespace hypic::worker {

/// Stubs of combine workers by address, created on first use and shared.
class CombineStubs {
 public:
  hypic::v1::CombineWorker::Stub& get(const std::string& address);

 private:
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<hypic::v1::CombineWorker::Stub>> stubs_;
};

/// Streams one serialized entry to a combine worker (CombineWorker.DeliverEntry) on `ctx`: a
/// header, then chunks. Returns the call's status; *duplicate tells whether the combine worker
/// already had the segment; *written (when not null) the entry bytes the stream accepted (chunks whose Write
/// returned true), which is all of `bytes` unless the call broke off.
grpc::Status deliver_entry(hypic::v1::CombineWorker::Stub& stub, grpc::ClientContext& ctx,
                           const hypic::v1::EntryHeader& header, std::string_view bytes, size_t chunk_bytes,
                           bool* duplicate, size_t* written = nullptr);

class ScatterService final : public hypic::v1::ScatterWorker::Service {
 public:
  /// The referenced objects must outlive the service; builds run on `loop` (its backend's fingerprint is what
  /// digests are checked under), which must be stopped before the service goes away (its build callbacks use the
  /// service); finished builds go to the segment cache through `putter`. `compute_threads` and
  /// `random_weights_seed` (0: real weights) are reported in WorkerInfo. `address` is what this worker reports as
  /// built_by (filled in once the port is known).
  ScatterService(engine::EngineLoop& loop, cache::AsyncCachePutter& putter, rpc::Lifecycle& life, size_t chunk_bytes,
                 int compute_threads, uint64_t random_weights_seed = 0);
  void set_address(std::string address) { address_ = std::move(address); }

  grpc::Status Prefill(grpc::ServerContext* ctx, const hypic::v1::PrefillRequest* req,
                       grpc::ServerWriter<hypic::v1::PrefillEvent>* writer) override;
  grpc::Status GetWorkerInfo(grpc::ServerContext* ctx, const hypic::v1::WorkerInfoRequest* req,
                             hypic::v1::WorkerInfo* resp) override;

 private:
  engine::EngineLoop& loop_;
  std::string fingerprint_, device_;
  rpc::Lifecycle& life_;
  size_t chunk_bytes_;
  int compute_threads_;
  uint64_t random_weights_seed_;
  std::string address_;
  CombineStubs combines_;
  SharedBuilds builds_;
};

}  // namespace hypic::worker
