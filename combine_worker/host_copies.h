// Host copies of the entries a combine worker made resident itself (built here, delivered over NCCL, or fetched),
// made OFF the critical path (DESIGN.md 4, "data plane"): a request splices the resident entry at once, and two
// threads of this worker's own do the rest, in two stages:
//  1. copy: the device-to-host copy into pinned memory on the backend's copy stream (CUDA: Backend::copy_to_host),
//     straight into the host tier (tens of ms for a 280 MB entry);
//  2. wire, when a cache put was asked for: the host block's wire form, written straight from the block
//     (Backend::write_wire_of_block) into a sealed memfd that the segment cache on this host adopts as it is, or onto
//     the heap where the put would be streamed, and queued for the segment cache (cache::AsyncCachePutter): host work
//     that no longer holds device memory nor delays the next host copy.
// Each stage's queue is bounded in bytes (stage 1: device memory its entries keep; stage 2: host memory its blocks
// keep); beyond it, work is dropped, counted (hypic:host_copies_total{outcome="dropped"}) and logged at most once per
// 10 s, since a dropped copy only costs a later recompute.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
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

  /// What a host copy hands to whoever waits for it (enqueue's `on_copied`): the pinned block, or null when the copy
  /// failed or was dropped. Runs on the copier's thread (on the caller's when enqueue drops it at once): keep it short.
  using OnCopied = std::function<void(std::shared_ptr<const engine::HostBlock>)>;
  /// Queues the host copy of a resident entry: into the host tier (if any and the backend has device entries) and,
  /// with `put`, into the segment cache. Never blocks; false when it was dropped (queue full, or nothing to do).
  /// `on_copied` (device backends), when given, is called exactly once with the block once it is made (the copy is then
  /// made even without a host tier or a put), or with null (dropped, failed, or the copier stopping); the entry's
  /// device memory is let go after it returns.
  bool enqueue(const rpc::Digest& digest, std::shared_ptr<const engine::ResidentEntry> entry, bool put,
               std::string request_id, OnCopied on_copied = {});
  /// Puts a host block already in hand (made while fetching) into the host tier, no copy.
  void keep_block(const rpc::Digest& digest, std::shared_ptr<const engine::HostBlock> block);
  /// Blocks until the queue is empty and the copy in progress is done (tests).
  void wait_idle();

  struct Counters {
    uint64_t made = 0;     ///< host copies made (stage 1) and wire forms queued for the cache (stage 2)
    uint64_t dropped = 0;  ///< dropped: a stage's queue was full
    uint64_t failed = 0;   ///< failed (e.g. no pinned memory)
    uint64_t queued_bytes = 0;       ///< stage 1: resident bytes of the entries waiting for their copy
    uint64_t wire_queued_bytes = 0;  ///< stage 2: bytes of the blocks (or host entries) waiting for their wire form
    uint64_t pending = 0;  ///< work queued or in progress, both stages
  };
  Counters counters() const;

 private:
  struct Item {
    rpc::Digest digest;
    std::shared_ptr<const engine::ResidentEntry> entry;  ///< stage 1; stage 2 on the CPU backend (host already)
    std::shared_ptr<const engine::HostBlock> block;      ///< stage 2 on device backends
    bool put;
    std::string request_id;
    size_t bytes = 0;
    OnCopied on_copied;  ///< stage 1 only
  };
  void run_copies();
  void run_wire();
  /// Stage 1 of one item; returns the stage-2 item when a put is still to be made.
  std::optional<Item> copy(Item& item);
  /// Stage 2's bytes: the wire form of the item's block (in a sealed memfd where the putter offers one for its digest)
  /// or of its host entry. Throws what the backend or SealedMemfdWriter throw.
  std::shared_ptr<const rpc::SharedBytes> wire_bytes(const Item& item) const;
  /// Stage 2 queue, under mu_: false (counted, logged) when full.
  bool push_wire_locked(Item item);
  void log_drop(const Item& item, const char* what, uint64_t queued, uint64_t limit);

  const engine::Backend& backend_;
  HostBlockTier* host_tier_;
  cache::AsyncCachePutter& putter_;
  uint64_t max_bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Item> queue_, wire_;
  bool busy_ = false, wire_busy_ = false, stop_ = false;
  Counters counters_;
  std::thread thread_, wire_thread_;
};

}  // namespace hypic::combine
