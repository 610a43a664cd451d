// The combine worker's own memory tier: segment entries resident on its backend (host memory on the CPU, device
// memory on CUDA: a hit needs no import), most recently used first, under a byte budget
// (ResidentEntry::resident_bytes()). Hits verify the token ids. Thread-safe.
#pragma once
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>

#include "engine/backend.h"
#include "proto/rpc/status.h"

namespace hypic::combine {

class EntryMemoryTier {
 public:
  /// budget_bytes == 0 disables the tier (get always misses, put stores nothing).
  explicit EntryMemoryTier(size_t budget_bytes) : budget_(budget_bytes) {}
  /// The entry stored under `digest` if its token ids equal `ids` (and marks it most recent).
  std::shared_ptr<const engine::ResidentEntry> get(const rpc::Digest& digest, std::span<const int32_t> ids);
  /// Stores (or refreshes) an entry, evicting least recently used ones to stay within budget; an
  /// entry larger than the whole budget is not stored.
  void put(const rpc::Digest& digest, std::shared_ptr<const engine::ResidentEntry> entry);
  /// Forgets an entry (e.g. found inconsistent).
  void erase(const rpc::Digest& digest);
  size_t bytes() const;
  size_t entries() const;

 private:
  struct Item {
    rpc::Digest digest;
    std::shared_ptr<const engine::ResidentEntry> entry;
    size_t bytes;
  };
  struct Hash {
    size_t operator()(const rpc::Digest& d) const noexcept;
  };
  void erase_locked(const rpc::Digest& digest);
  size_t budget_, used_ = 0;
  std::list<Item> lru_;  // front = most recent
  std::unordered_map<rpc::Digest, std::list<Item>::iterator, Hash> index_;
  mutable std::mutex mu_;
};

}  // namespace hypic::combine
