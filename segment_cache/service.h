// gRPC front of the segment store (hypic.v1.SegmentCache; semantics in segment_cache.proto).
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

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
  /// than store.max_entry_bytes(). While other puts are being received and the bytes of all would pass the memory
  /// budget (so puts in flight hold at most the memory budget, or one entry), a Put waits for room after its header,
  /// in arrival order behind the puts already waiting; it is refused (RESOURCE_EXHAUSTED, "retry later") at once when
  /// the announced bytes of the waiting puts with its own would pass the memory budget (gRPC's flow control lets a
  /// waiting sender's bytes pile up in the server; one waiter alone may be larger), or when no room frees within
  /// `max_put_wait`; a wait ends with DEADLINE_EXCEEDED at the call's deadline, CANCELLED when the caller cancels and
  /// UNAVAILABLE when the server drains. Every refusal and every wait that ends so counts in rejected_puts.
  /// A put whose sender sends nothing for `put_idle_timeout` (0: never) is cancelled (the caller sees CANCELLED;
  /// logged, counted in rejected_puts), so that a stalled sender holds neither a handler thread nor the receive budget
  /// the waiting puts need: counted from the call's start until its header, then from its admission between messages
  /// (not while it waits for room, nor once its last byte is in: a put being checked and stored is not cancelled). A
  /// watchdog thread checks every put_idle_timeout / 4 (at most 1 s). It is counted per message: it must be well
  /// above the time one message takes to arrive (the CLI takes 0 or at least 1000 ms).
  SegmentCacheService(SegmentStore& store, rpc::Lifecycle& life, size_t chunk_bytes, uint32_t max_lease_ms,
                      size_t max_queued_events = 65536,
                      std::chrono::milliseconds max_put_wait = std::chrono::seconds(30),
                      std::chrono::milliseconds put_idle_timeout = std::chrono::seconds(30));
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
  /// Puts waiting for room now (past their header, not admitted yet), for tests and logs.
  size_t waiting_puts() const {
    std::lock_guard<std::mutex> lock(receive_mu_);
    return waiting_.size();
  }

  grpc::Status WatchEvents(grpc::ServerContext* ctx, const hypic::v1::WatchEventsRequest* req,
                           grpc::ServerWriter<hypic::v1::CacheEvent>* writer) override;

 private:
  // A Put whose header hands over the sender's sealed memfd (PutHeader.shared_memory), admitted and read to its end:
  // opened, checked and adopted as the entry's bytes (proto/rpc/shared_memory.h). Returns whether it replaced an
  // entry. Throws RpcError: FAILED_PRECONDITION with trailing metadata hypic-shared-memory (segment_cache.proto), or
  // INVALID_ARGUMENT for a memfd that is not as announced, or what SegmentStore::put throws.
  bool adopt_put(grpc::ServerContext* ctx, const hypic::v1::PutHeader& header, const rpc::Digest& d);
  // FAILED_PRECONDITION for a shared-memory put not taken, `kind` in its trailing metadata; counted as rejected.
  rpc::RpcError refuse_shared(grpc::ServerContext* ctx, const rpc::Digest& d, const char* kind, const std::string& why);
  SegmentStore& store_;
  rpc::Lifecycle& life_;
  size_t chunk_bytes_;
  uint32_t max_lease_ms_;
  CacheEventHub events_;
  /// Waits (if needed) until a put of `n` announced bytes may be received beside the others, then counts it in
  /// receiving_bytes_; throws RpcError as the constructor's comment says.
  void admit_put(grpc::ServerContext* ctx, const rpc::Digest& d, uint64_t n);

  mutable std::mutex receive_mu_;
  std::condition_variable receive_cv_;      // notified as a put being received ends or a waiting one leaves
  std::deque<uint64_t> waiting_;            // tickets of the puts waiting for room, in arrival order
  uint64_t waiting_bytes_ = 0;              // their announced bytes
  uint64_t next_ticket_ = 0;
  uint64_t receiving_bytes_ = 0;            // announced bytes of the puts being received now (under receive_mu_)
  uint64_t max_receiving_bytes_;            // their cap beside another put: the memory budget
  std::chrono::milliseconds max_put_wait_;  // longest wait of a put for room among those being received

  // The puts being received, for the idle watchdog (under receive_mu_): when each last received bytes.
  struct ActivePut {
    grpc::ServerContext* ctx;
    std::chrono::steady_clock::time_point last;
    uint64_t received = 0, total = 0;
    bool paused = false;     // waiting for room (bounded by max_put_wait_ instead)
    bool cancelled = false;  // the watchdog cancelled it
  };
  std::map<uint64_t, ActivePut> active_;
  uint64_t next_active_ = 0;
  std::chrono::milliseconds put_idle_timeout_;
  bool stop_watchdog_ = false;
  std::condition_variable watchdog_cv_;
  std::thread watchdog_;
  void watch_idle_puts();
};

}  // namespace hypic::cache
