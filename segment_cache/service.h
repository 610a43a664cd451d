// gRPC front of the segment store (hypic.v1.SegmentCache; semantics in segment_cache.proto).
#pragma once
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "hypic/v1/segment_cache.grpc.pb.h"
#include "proto/rpc/server.h"
#include "segment_cache/events.h"
#include "segment_cache/store.h"

namespace hypic::cache {

class SegmentCacheService final : public hypic::v1::SegmentCache::Service {
 public:
  /// `max_lease_ms` caps the lease a Lookup may ask for.
  /// Registers the cache's Prometheus metrics (hypic:cache_bytes{tier}, hypic:cache_evictions_total, ...,
  /// proto/rpc/metrics.h), read from `store` at each scrape.
  /// Becomes `store`'s event sink (WatchEvents; a subscriber may be `max_queued_events` behind) until destroyed.
  /// Under mutual TLS every RPC but Stats is refused (PERMISSION_DENIED) to callers without a service identity
  /// (rpc::require_service_caller). A Put is refused (RESOURCE_EXHAUSTED) from its header when its entry is larger
  /// than store.max_entry_bytes() or, while other puts are being received, when the bytes of all would pass the memory
  /// budget (so puts in flight hold at most the memory budget, or one entry).
  SegmentCacheService(SegmentStore& store, rpc::Lifecycle& life, size_t chunk_bytes, uint32_t max_lease_ms,
                      size_t max_queued_events = 65536,
                      std::chrono::milliseconds max_put_wait = std::chrono::seconds(30));
  ~SegmentCacheService() override;

  grpc::Status Lookup(grpc::ServerContext* ctx, const hypic::v1::LookupRequest* req,
                      hypic::v1::LookupResponse* resp) override;
  grpc::Status Get(grpc::ServerContext* ctx, const hypic::v1::GetRequest* req,
                   grpc::ServerWriter<hypic::v1::GetResponse>* writer) override;
  grpc::Status Put(grpc::ServerContext* ctx, grpc::ServerReader<hypic::v1::PutRequest>* reader,
                   hypic::v1::PutResponse* resp) override;
  grpc::Status Delete(grpc::ServerContext* ctx, const hypic::v1::DeleteRequest* req,
                      hypic::v1::DeleteResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const hypic::v1::StatsRequest* req,
                     hypic::v1::CacheStats* resp) override;
  grpc::Status ReleaseLeases(grpc::ServerContext* ctx, const hypic::v1::ReleaseLeasesRequest* req,
                             hypic::v1::ReleaseLeasesResponse* resp) override;
  /// Announced bytes of the puts being received now (admitted past their header), for tests and logs.
  uint64_t receiving_bytes() const {
    std::lock_guard<std::mutex> lock(receive_mu_);
    return receiving_bytes_;
  }

  grpc::Status WatchEvents(grpc::ServerContext* ctx, const hypic::v1::WatchEventsRequest* req,
                           grpc::ServerWriter<hypic::v1::CacheEvent>* writer) override;

 private:
  SegmentStore& store_;
  rpc::Lifecycle& life_;
  size_t chunk_bytes_;
  uint32_t max_lease_ms_;
  CacheEventHub events_;
  mutable std::mutex receive_mu_;
  std::condition_variable receive_cv_;      // notified as a put being received ends
  uint64_t receiving_bytes_ = 0;            // announced bytes of the puts being received now (under receive_mu_)
  uint64_t max_receiving_bytes_;            // their cap beside another put: the memory budget
  std::chrono::milliseconds max_put_wait_;  // longest wait of a put for room among those being received
};

}  // namespace hypic::cache
