// Prefix mode's checkpoint cache, the one every backend keeps (DESIGN.md 3.4, mode `prefix`): values keyed by the
// chain digest of the segments before them (chain_digest, engine/splice_schedule.h), least recently used first out
// under a byte budget. What a value holds is the backend's: the CPU keeps a copy of the whole model state
// (engine/cpu/splice.h PrefixStateCache), the CUDA backend one segment's KV rows and the states at its end in device
// memory (engine/cuda/cuda_backend_impl.h). Which checkpoints a splice restores and stores is the planner's
// (schedule_splice's prefix_reused and checkpoint steps).
#pragma once
#include <cstddef>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "engine/segment.h"  // SegmentDigest

namespace hypic::engine {

/// An LRU map SegmentDigest -> shared_ptr<V> under a budget in bytes (each value's size given when stored).
/// Thread-safe; values stay alive while a caller holds them, evicted or not.
template <class V>
class PrefixCache {
 public:
  explicit PrefixCache(size_t budget_bytes) : budget_(budget_bytes) {}
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  /// The value under `key`, made the most recently used; null when absent.
  std::shared_ptr<V> get(const SegmentDigest& key) {
    std::lock_guard lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    lru_.splice(lru_.begin(), lru_, it->second);
    return it->second->value;
  }
  /// The value under `key`, the order untouched; null when absent.
  std::shared_ptr<V> peek(const SegmentDigest& key) const {
    std::lock_guard lock(mu_);
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : it->second->value;
  }
  /// Evicts least recently used values until `extra` more bytes fit the budget (or none is left).
  void make_room(size_t extra) {
    std::lock_guard lock(mu_);
    evict_locked(extra);
  }
  /// Stores `value` of `bytes` under `key` as the most recently used, replacing what was there and evicting least
  /// recently used values to stay within the budget. A value larger than the whole budget is not stored (returns
  /// false).
  bool put(const SegmentDigest& key, std::shared_ptr<V> value, size_t bytes) {
    if (bytes > budget_) return false;
    std::lock_guard lock(mu_);
    if (auto it = index_.find(key); it != index_.end()) {
      used_ -= it->second->bytes;
      lru_.erase(it->second);
      index_.erase(it);
    }
    evict_locked(bytes);
    lru_.push_front(Item{key, std::move(value), bytes});
    index_[key] = lru_.begin();
    used_ += bytes;
    return true;
  }
  /// Drops every value.
  void clear() {
    std::lock_guard lock(mu_);
    lru_.clear();
    index_.clear();
    used_ = 0;
  }
  size_t bytes() const {
    std::lock_guard lock(mu_);
    return used_;
  }
  size_t entries() const {
    std::lock_guard lock(mu_);
    return lru_.size();
  }
  size_t budget() const { return budget_; }

 private:
  struct Item {
    SegmentDigest key;
    std::shared_ptr<V> value;
    size_t bytes;
  };
  struct Hash {
    size_t operator()(const SegmentDigest& d) const {
      size_t h;
      std::memcpy(&h, d.data(), sizeof(h));
      return h;
    }
  };
  void evict_locked(size_t extra) {
    while (used_ + extra > budget_ && !lru_.empty()) {
      used_ -= lru_.back().bytes;
      index_.erase(lru_.back().key);
      lru_.pop_back();
    }
  }
  const size_t budget_;
  size_t used_ = 0;
  std::list<Item> lru_;  // front = most recent
  std::unordered_map<SegmentDigest, typename std::list<Item>::iterator, Hash> index_;
  mutable std::mutex mu_;
};

}  // namespace hypic::engine
