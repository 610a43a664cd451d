#include "segment_cache/ring.h"

#include <algorithm>
#include <set>
#include <stdexcept>

#include <fmt/format.h>
#include <xxhash.h>

namespace hypic::cache {

HashRing::HashRing(std::vector<std::string> nodes, int vnodes) : nodes_(std::move(nodes)) {
  if (nodes_.empty()) throw std::invalid_argument("cache replicas: at least one address is needed");
  if (vnodes < 1) throw std::invalid_argument(fmt::format("vnodes: must be >= 1, got {}", vnodes));
  std::set<std::string> seen;
  for (const auto& n : nodes_) {
    if (n.empty()) throw std::invalid_argument("cache replicas: empty address");
    if (!seen.insert(n).second) throw std::invalid_argument(fmt::format("cache replicas: {} listed twice", n));
  }
  points_.reserve(nodes_.size() * size_t(vnodes));
  for (uint32_t i = 0; i < nodes_.size(); ++i) {
    for (int j = 0; j < vnodes; ++j) points_.emplace_back(point_hash(nodes_[i], j), i);
  }
  // Ties between equal hashes (astronomically rare) resolve to the lower node index.
  std::sort(points_.begin(), points_.end());
}

uint64_t HashRing::point_hash(const std::string& address, int j) {
  const std::string label = fmt::format("{}#{}", address, j);
  return XXH3_64bits(label.data(), label.size());
}

uint64_t HashRing::key_hash(const rpc::Digest& digest) {
  uint64_t h = 0;
  for (int i = 7; i >= 0; --i) h = (h << 8) | digest[size_t(i)];
  return h;
}

size_t HashRing::owner(uint64_t key_hash) const {
  auto it = std::lower_bound(points_.begin(), points_.end(), std::make_pair(key_hash, uint32_t{0}));
  if (it == points_.end()) it = points_.begin();
  return it->second;
}

size_t HashRing::owner(const rpc::Digest& digest) const { return owner(key_hash(digest)); }

}  // namespace hypic::cache
