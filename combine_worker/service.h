// hypic.v1.CombineWorker: gathers a request's segment entries (memory tier, segment cache,
// scatter-worker deliveries, or its own prefill), splices them with the query (engine/splice.h),
// decodes with the sampling parameters and streams the tokens (semantics in combine.proto).
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <string>

#include "combine_worker/memory_tier.h"
#include "engine/model.h"
#include "engine/splice.h"
#include "engine/tokenizer.h"
#include "hypic/v1/combine.grpc.pb.h"
#include "proto/rpc/server.h"
#include "scatter_worker/entry_builder.h"
#include "segment_cache/async_put.h"
#include "segment_cache/client.h"

namespace hypic::combine {

struct CombineOptions {
  size_t chunk_bytes = 1 << 20;
  /// Longest wait for a request's entries (on top of the request's own deadline).
  std::chrono::seconds gather_timeout{300};
  /// Parallel cache fetches per request.
  int fetch_parallelism = 4;
  /// Splices and decode steps that may run at once, over all requests (0: no limit, the default). With a limit,
  /// requests beyond it wait their turn per decode step (FIFO), so concurrent streams interleave instead of
  /// oversubscribing the cores. Measured on 2 cores with the demo model, 48 concurrent streams finished
  /// fastest without a limit (12.8 s vs 17.3-17.9 s with 2 or 8 slots), hence the default.
  int max_concurrent_compute = 0;
};

/// A counting semaphore handing out compute slots in arrival order (FIFO tickets), so no request starves.
class ComputeSlots {
 public:
  explicit ComputeSlots(int slots);
  /// Blocks until a slot is free. Returns false (without a slot) if `cancelled()` turns true while waiting;
  /// it is polled every 50 ms.
  bool acquire(const std::function<bool()>& cancelled);
  void release();
  int slots() const { return slots_; }

 private:
  void skip_abandoned();  // with mu_ held
  std::mutex mu_;
  std::condition_variable cv_;
  int slots_, free_;
  uint64_t next_ticket_ = 0, serving_ = 0;  // FIFO: ticket t may take a slot once serving_ == t
  std::set<uint64_t> abandoned_;            // tickets whose holder was cancelled while waiting
};

/// Everything a combine worker serves with; all must outlive the service.
struct CombineDeps {
  const engine::Model& model;
  const engine::Tokenizer& tokenizer;
  const cache::SegmentCacheClient& cache;
  cache::AsyncCachePutter& putter;
  worker::EntryBuilder& builder;
  EntryMemoryTier& memory_tier;
  engine::PrefixStateCache& prefix_cache;
  rpc::Lifecycle& life;
};

class CombineService final : public hypic::v1::CombineWorker::Service {
 public:
  CombineService(CombineDeps deps, CombineOptions options);
  ~CombineService() override;
  /// The address reported as built_by for the segments this worker prefills itself.
  void set_address(std::string address) { address_ = std::move(address); }

  grpc::Status Combine(grpc::ServerContext* ctx, const hypic::v1::CombineRequest* req,
                       grpc::ServerWriter<hypic::v1::CombineEvent>* writer) override;
  grpc::Status DeliverEntry(grpc::ServerContext* ctx, grpc::ServerReader<hypic::v1::EntryChunk>* reader,
                            hypic::v1::DeliverEntryResponse* resp) override;
  grpc::Status ComputeLocally(grpc::ServerContext* ctx, const hypic::v1::ComputeLocallyRequest* req,
                              hypic::v1::ComputeLocallyResponse* resp) override;
  grpc::Status GetWorkerInfo(grpc::ServerContext* ctx, const hypic::v1::WorkerInfoRequest* req,
                             hypic::v1::WorkerInfo* resp) override;

  struct Pending;  // one active request (defined in service.cpp)

 private:
  grpc::Status run_combine(grpc::ServerContext* ctx, const hypic::v1::CombineRequest* req,
                           grpc::ServerWriter<hypic::v1::CombineEvent>* writer);
  std::shared_ptr<Pending> find(const std::string& request_id);
  void build_locally(const std::shared_ptr<Pending>& p, size_t slot, std::string note);
  void fetch_warm(const std::shared_ptr<Pending>& p, size_t slot, const grpc::ServerContextBase* ctx);

  CombineDeps d_;
  CombineOptions opt_;
  std::unique_ptr<ComputeSlots> compute_;
  std::string fingerprint_;
  engine::EntryGeometry geometry_;
  std::string address_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Pending>> active_;
};

}  // namespace hypic::combine
