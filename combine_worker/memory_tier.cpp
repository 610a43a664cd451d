#include "combine_worker/memory_tier.h"

#include <algorithm>
#include <cstring>

namespace hypic::combine {

size_t EntryMemoryTier::Hash::operator()(const rpc::Digest& d) const noexcept {
  size_t h;
  std::memcpy(&h, d.data(), sizeof h);
  return h;
}

std::shared_ptr<const engine::ResidentEntry> EntryMemoryTier::get(const rpc::Digest& digest,
                                                                 std::span<const int32_t> ids) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(digest);
  if (it == index_.end()) return nullptr;
  const auto& stored = it->second->entry->header().token_ids;
  if (!std::equal(stored.begin(), stored.end(), ids.begin(), ids.end())) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->entry;
}

void EntryMemoryTier::erase_locked(const rpc::Digest& digest) {
  auto it = index_.find(digest);
  if (it == index_.end()) return;
  used_ -= it->second->bytes;
  lru_.erase(it->second);
  index_.erase(it);
}

void EntryMemoryTier::put(const rpc::Digest& digest, std::shared_ptr<const engine::ResidentEntry> entry) {
  const size_t bytes = entry->resident_bytes();
  std::lock_guard<std::mutex> lock(mu_);
  erase_locked(digest);
  if (bytes > budget_) return;
  while (used_ + bytes > budget_) erase_locked(lru_.back().digest);
  lru_.push_front({digest, std::move(entry), bytes});
  index_[digest] = lru_.begin();
  used_ += bytes;
}

void EntryMemoryTier::erase(const rpc::Digest& digest) {
  std::lock_guard<std::mutex> lock(mu_);
  erase_locked(digest);
}

size_t EntryMemoryTier::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

size_t EntryMemoryTier::entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lru_.size();
}

}  // namespace hypic::combine
