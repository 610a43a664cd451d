// Fan-out of the segment store's events to WatchEvents subscribers (segment_cache.proto), each with a bounded queue:
// the store publishes under its lock (quick: a copy into each queue), a subscriber's stream drains its own queue.
// A subscriber whose queue is full is marked overflowed and gets nothing more (its stream then ends with
// RESOURCE_EXHAUSTED), so a slow reader can neither block the store nor grow memory without bound.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "segment_cache/store.h"

namespace hypic::cache {

/// A StoreEvent with its place in the replica's sequence (1, 2, ...) and time (microseconds since the Unix epoch).
struct SequencedEvent {
  StoreEvent event;
  uint64_t sequence = 0;
  int64_t unix_micros = 0;
};

class CacheEventHub {
 public:
  /// `max_queued` >= 1: events a subscriber may be behind before it is overflowed.
  explicit CacheEventHub(size_t max_queued);

  class Subscriber {
   public:
    /// Waits up to `timeout` for events; returns those queued (possibly none). Sets *overflowed when the
    /// subscriber fell too far behind (nothing more will come).
    std::vector<SequencedEvent> wait(std::chrono::milliseconds timeout, bool* overflowed);

   private:
    friend class CacheEventHub;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<SequencedEvent> queue_;
    bool overflowed_ = false;
  };

  /// Numbers `e` and queues it for every subscriber (the store's event sink; thread-safe).
  void publish(const StoreEvent& e);
  /// A new subscriber, receiving every event published from now on. Call inside SegmentStore::list_entries_then to
  /// line it up with a listing of the entries.
  std::shared_ptr<Subscriber> subscribe();
  void unsubscribe(const std::shared_ptr<Subscriber>& s);
  size_t subscribers() const;
  uint64_t published() const;

 private:
  size_t max_queued_;
  mutable std::mutex mu_;
  uint64_t sequence_ = 0;
  std::vector<std::shared_ptr<Subscriber>> subs_;
};

}  // namespace hypic::cache
