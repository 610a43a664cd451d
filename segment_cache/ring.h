// Consistent hashing of segment digests over segment-cache replicas (Karger et al., 1997, with
// virtual nodes): each replica owns `vnodes` points on a 64-bit ring, point j of replica r at
// XXH3-64("<address>#<j>"); a key belongs to the first point at or after its hash, wrapping around.
// Adding or removing a replica moves only the keys of the arcs it gains or loses (about 1/n of
// them), so the other replicas' contents stay valid.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "proto/rpc/status.h"

namespace hypic::cache {

class HashRing {
 public:
  /// `nodes`: replica addresses, non-empty and distinct; `vnodes` >= 1 points per replica.
  /// Throws std::invalid_argument naming the problem.
  explicit HashRing(std::vector<std::string> nodes, int vnodes = 160);
  /// Index (into nodes()) of the replica owning a 64-bit key hash.
  size_t owner(uint64_t key_hash) const;
  /// The owner of a segment digest; its key hash is the digest's first 8 bytes, little-endian.
  size_t owner(const rpc::Digest& digest) const;
  const std::vector<std::string>& nodes() const { return nodes_; }
  /// Hash of point j of replica `address` (exposed for tests and tools).
  static uint64_t point_hash(const std::string& address, int j);
  /// The key hash owner(digest) uses.
  static uint64_t key_hash(const rpc::Digest& digest);

 private:
  std::vector<std::string> nodes_;
  std::vector<std::pair<uint64_t, uint32_t>> points_;  // (hash, node index), sorted by hash
};

}  // namespace hypic::cache
