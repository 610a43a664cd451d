// The combine worker's own tiers of segment entries (DESIGN.md 4, "data plane"), each LRU under a byte budget, hits
// verified against the token ids:
//  - the device tier (EntryMemoryTier): entries resident on its backend (device memory on CUDA, host memory on the
//    CPU backend): a hit is spliced as it is, with no copy;
//  - the host tier (HostBlockTier, CUDA only): pinned host copies of device entries (engine/backend.h HostBlock): a hit
//    costs one host-to-device copy at PCIe bandwidth (Backend::import_block).
// The router asks which digests a worker holds (CombineWorker.LookupEntries) and counts them as hits. Thread-safe.
#pragma once
#include <algorithm>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>

#include "engine/backend.h"
#include "proto/rpc/status.h"

namespace hypic::combine {

/// Bytes an item holds where it lives (the budget's unit).
inline size_t tier_bytes(const engine::ResidentEntry& e) { return e.resident_bytes(); }
inline size_t tier_bytes(const engine::HostBlock& b) { return b.pinned_bytes(); }

/// An LRU store of shared items by digest under a byte budget. T: engine::ResidentEntry or engine::HostBlock.
template <class T>
class LruTier {
 public:
  /// budget_bytes == 0 disables the tier (get always misses, put stores nothing).
  explicit LruTier(size_t budget_bytes) : budget_(budget_bytes) {}
  /// The item stored under `digest` if its token ids equal `ids` (and marks it most recent).
  std::shared_ptr<const T> get(const rpc::Digest& digest, std::span<const int32_t> ids) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(digest);
    if (it == index_.end()) return nullptr;
    const auto& stored = it->second->item->header().token_ids;
    if (!std::equal(stored.begin(), stored.end(), ids.begin(), ids.end())) return nullptr;
    lru_.splice(lru_.begin(), lru_, it->second);
    return it->second->item;
  }
  /// Whether `digest` is held (no LRU update, no id check: what a lookup reports).
  bool contains(const rpc::Digest& digest) const {
    std::lock_guard<std::mutex> lock(mu_);
    return index_.count(digest) > 0;
  }
  /// Stores (or refreshes) an item, evicting least recently used ones to stay within budget; an item larger than the
  /// whole budget is not stored. Evicted items are freed when their last user lets go.
  void put(const rpc::Digest& digest, std::shared_ptr<const T> item) {
    const size_t bytes = tier_bytes(*item);
    std::lock_guard<std::mutex> lock(mu_);
    erase_locked(digest);
    if (bytes > budget_) return;
    while (used_ + bytes > budget_) erase_locked(lru_.back().digest);
    lru_.push_front({digest, std::move(item), bytes});
    index_[digest] = lru_.begin();
    used_ += bytes;
  }
  /// Forgets an item (e.g. found inconsistent).
  void erase(const rpc::Digest& digest) {
    std::lock_guard<std::mutex> lock(mu_);
    erase_locked(digest);
  }
  /// Evicts least recently used items until at least `bytes` were freed or the tier is empty; returns the bytes
  /// evicted (freed once their last user lets go).
  size_t evict(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    size_t freed = 0;
    while (freed < bytes && !lru_.empty()) {
      freed += lru_.back().bytes;
      erase_locked(lru_.back().digest);
    }
    return freed;
  }
  /// Forgets every item; returns how many there were.
  size_t clear() {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t n = lru_.size();
    lru_.clear();
    index_.clear();
    used_ = 0;
    return n;
  }
  size_t bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return used_;
  }
  size_t entries() const {
    std::lock_guard<std::mutex> lock(mu_);
    return lru_.size();
  }
  size_t budget() const { return budget_; }

 private:
  struct Item {
    rpc::Digest digest;
    std::shared_ptr<const T> item;
    size_t bytes;
  };
  struct Hash {
    size_t operator()(const rpc::Digest& d) const noexcept {
      size_t h;
      std::memcpy(&h, d.data(), sizeof h);
      return h;
    }
  };
  void erase_locked(const rpc::Digest& digest) {
    auto it = index_.find(digest);
    if (it == index_.end()) return;
    used_ -= it->second->bytes;
    lru_.erase(it->second);
    index_.erase(it);
  }
  size_t budget_, used_ = 0;
  std::list<Item> lru_;  // front = most recent
  std::unordered_map<rpc::Digest, typename std::list<Item>::iterator, Hash> index_;
  mutable std::mutex mu_;
};

/// The device tier: entries resident on the backend.
using EntryMemoryTier = LruTier<engine::ResidentEntry>;
/// The host tier: pinned host copies of device entries (CUDA).
using HostBlockTier = LruTier<engine::HostBlock>;

}  // namespace hypic::combine
