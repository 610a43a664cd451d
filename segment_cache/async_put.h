// Puts entries into the segment cache off the critical path: callers hand over serialized
// entries (on the heap, or in a sealed memfd the cache on this host adopts as it is) and return at once; one background thread sends them in order. The queue is bounded in
// bytes; when it is full (the cache is slow or down) new entries are dropped, since the cache is
// an optimisation and a dropped put only costs a later recompute. Failures are logged (the first
// in a row at warn level, the rest at debug) and counted.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "segment_cache/client.h"

namespace hypic::cache {

class AsyncCachePutter {
 public:
  /// `client` must outlive the putter. `max_queued_bytes` bounds the bytes waiting to be sent.
  AsyncCachePutter(const SegmentCacheClient& client, uint64_t max_queued_bytes);
  /// Cancels the put in flight (it may be waiting at the cache for room, for up to the client's put_wait) and waits
  /// for its call to end (counted as dropped, logged at info, if it ended CANCELLED); entries still queued are
  /// dropped (the cache is an optimisation, and a shutdown must not wait on a slow or dead cache).
  ~AsyncCachePutter();
  AsyncCachePutter(const AsyncCachePutter&) = delete;
  AsyncCachePutter& operator=(const AsyncCachePutter&) = delete;

  /// Queues a put; returns false (and drops it) when the queue is full or the client has no replica.
  /// When it returns true, `done` (optional) runs exactly once, on the putter's thread (or in the
  /// destructor, for a put dropped at shutdown), after the put ended: with true if the cache stored the
  /// entry, false if the put failed or was dropped. It must be quick and must not call enqueue.
  bool enqueue(const rpc::Digest& digest, std::vector<int32_t> token_ids, std::shared_ptr<const rpc::SharedBytes> bytes,
               std::string request_id, std::function<void(bool stored)> done = {});
  /// enqueue() of heap bytes shared with their other holders (no copy).
  bool enqueue(const rpc::Digest& digest, std::vector<int32_t> token_ids, std::shared_ptr<const std::string> bytes,
               std::string request_id, std::function<void(bool stored)> done = {});
  /// The client's SegmentCacheClient::offers_shared_memory: whether the bytes of `digest` are best made in a sealed
  /// memfd (the put hands it over as it is).
  bool offers_shared_memory(const rpc::Digest& digest) const { return client_.offers_shared_memory(digest); }
  /// False when the client has no replica (every enqueue would be refused): callers skip making the bytes.
  bool enabled() const { return client_.enabled(); }
  /// Puts queued or in flight.
  size_t pending() const;
  /// Blocks until the queue is empty and the put in flight finished (tests, shutdown).
  void wait_idle();

  struct Counters {
    uint64_t stored = 0, failed = 0, dropped = 0;
  };
  Counters counters() const;

 private:
  struct Item {
    rpc::Digest digest;
    std::vector<int32_t> ids;
    std::shared_ptr<const rpc::SharedBytes> bytes;
    std::string request_id;
    std::function<void(bool)> done;
  };
  void run();

  const SegmentCacheClient& client_;
  uint64_t max_bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Item> queue_;
  uint64_t queued_bytes_ = 0;
  bool busy_ = false, stop_ = false, last_failed_ = false;
  Counters counters_;
  PutCancel cancel_;  // the put in flight, cancelled by the destructor
  std::thread thread_;
};

}  // namespace hypic::cache
