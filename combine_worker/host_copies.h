// Host copies of the entries a combine worker made resident itself (built here, delivered over NCCL, or fetched),
// made OFF the critical path (DESIGN.md 4, "data plane"): a request splices the resident entry at once, and this
// worker's own thread later copies it to the host, into pinned memory on the backend's copy stream (CUDA:
// Backend::copy_to_host), for the host tier, and, when asked, converts it to the wire form and queues it for the
// segment cache (cache::AsyncCachePutter). The queue is bounded in bytes (each queued entry keeps its device memory):
// beyond it, copies are dropped, counted (hypic:host_copies_total{outcome="dropped"}) and logged at most once per
// 10 s, since a dropped copy only costs a later recompute.
#pragma once
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "combine_worker/memory_tier.h"
#include "engine/backend.h"
#include "segment_cache/async_put.h"

namespace hypic::combine {

class HostCopier {
 public:
  /// `backend` (thread-safe host-block methods), `host_tier` (null: none, e.g. the CPU backend) and `putter` must
  /// outlive the copier. `max_queued_bytes`: resident bytes of the entries waiting for their copy.
  HostCopier(const engine::Backend& backend, HostBlockTier* host_tier, cache::AsyncCachePutter& putter,
             uint64_t max_queued_bytes);
  /// Finishes the copy in progress; the queued ones are dropped (counted).
  ~HostCopier();
  HostCopier(const HostCopier&) = delete;
  HostCopier& operator=(const HostCopier&) = delete;

  /// Queues the host copy of a resident entry: into the host tier (if any and the backend has device entries) and,
  /// with `put`, into the segment cache. Never blocks; false when it was dropped (queue full, or nothing to do).
  bool enqueue(const rpc::Digest& digest, std::shared_ptr<const engine::ResidentEntry> entry, bool put,
               std::string request_id);
  /// Puts a host block already in hand (made while fetching) into the host tier, no copy.
  void keep_block(const rpc::Digest& digest, std::shared_ptr<const engine::HostBlock> block);
  /// Blocks until the queue is empty and the copy in progress is done (tests).
  void wait_idle();

  struct Counters {
    uint64_t made = 0;     ///< host copies made
    uint64_t dropped = 0;  ///< copies dropped: the queue was full
    uint64_t failed = 0;   ///< copies that failed (e.g. no pinned memory)
    uint64_t queued_bytes = 0;
    uint64_t pending = 0;  ///< copies queued or in progress
  };
  Counters counters() const;

 private:
  struct Item {
    rpc::Digest digest;
    std::shared_ptr<const engine::ResidentEntry> entry;
    bool put;
    std::string request_id;
  };
  void run();
  void copy(const Item& item);

  const engine::Backend& backend_;
  HostBlockTier* host_tier_;
  cache::AsyncCachePutter& putter_;
  uint64_t max_bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Item> queue_;
  bool busy_ = false, stop_ = false;
  Counters counters_;
  std::thread thread_;
};

}  // namespace hypic::combine
