// hypic.v1.CombineWorker: gathers a request's segment entries (memory tier, segment cache,
// scatter-worker deliveries, or its own prefill), splices them with the query and decodes with the
// sampling parameters on the worker's engine loop (engine/engine_loop.h: every request decoding here
// is stepped in one batch), and streams the tokens (semantics in combine.proto).
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "combine_worker/memory_tier.h"
#include "engine/engine_loop.h"
#include "engine/tokenizer.h"
#include "hypic/v1/combine.grpc.pb.h"
#include "proto/rpc/server.h"
#include "segment_cache/async_put.h"
#include "segment_cache/client.h"

namespace hypic::combine {

struct CombineOptions {
  size_t chunk_bytes = 1 << 20;
  /// Longest wait for a request's entries (on top of the request's own deadline).
  std::chrono::seconds gather_timeout{300};
  /// Parallel cache fetches per request.
  int fetch_parallelism = 4;
};

/// Everything a combine worker serves with; all must outlive the service. Every engine call (local builds,
/// splices, decoding) goes through `loop` (engine/engine_loop.h); digests and entries are checked against its
/// backend's fingerprint and numerics.
struct CombineDeps {
  const engine::Tokenizer& tokenizer;
  const cache::SegmentCacheClient& cache;
  cache::AsyncCachePutter& putter;
  engine::EngineLoop& loop;
  EntryMemoryTier& memory_tier;
  rpc::Lifecycle& life;
  int compute_threads = 1;  ///< reported in WorkerInfo
  uint64_t random_weights_seed = 0;  ///< BENCHMARK ONLY, reported in WorkerInfo and every report (0: real weights)
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
  const engine::Backend& backend_;  // d_.loop's: immutable facts only (config, fingerprint, numerics, device)
  std::string device_;
  std::string address_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Pending>> active_;
};

}  // namespace hypic::combine
