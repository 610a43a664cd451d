// Consistent hashing over segment-cache replicas: ownership matches the definition (first point
// clockwise), load is balanced, and membership changes move only the keys they must.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <random>

#include <fmt/format.h>
#include <xxhash.h>

#include "segment_cache/ring.h"

using hypic::cache::HashRing;

namespace {
std::vector<std::string> nodes(int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(fmt::format("10.0.0.{}:7000", i + 1));
  return out;
}
// Independent reference: scan every point, take the smallest hash >= key, else the smallest.
size_t brute_owner(const std::vector<std::string>& ns, int vnodes, uint64_t key) {
  uint64_t best = UINT64_MAX, lowest = UINT64_MAX;
  size_t best_node = SIZE_MAX, lowest_node = 0;
  for (size_t i = 0; i < ns.size(); ++i) {
    for (int j = 0; j < vnodes; ++j) {
      const std::string label = ns[i] + "#" + std::to_string(j);
      const uint64_t h = XXH3_64bits(label.data(), label.size());
      if (h >= key && (h < best || (h == best && i < best_node))) best = h, best_node = i;
      if (h < lowest) lowest = h, lowest_node = i;
    }
  }
  return best_node == SIZE_MAX ? lowest_node : best_node;
}
}  // namespace

TEST_CASE("owner is the first ring point at or after the key", "[hash_ring]") {
  const auto ns = nodes(3);
  HashRing ring(ns, 16);
  std::mt19937_64 rng(1);
  for (int i = 0; i < 500; ++i) {
    const uint64_t k = rng();
    CHECK(ring.owner(k) == brute_owner(ns, 16, k));
  }
  CHECK(ring.owner(UINT64_MAX) == brute_owner(ns, 16, UINT64_MAX));  // wraps around
  CHECK(ring.owner(0) == brute_owner(ns, 16, 0));
}

TEST_CASE("digest key hash is its first 8 bytes little-endian", "[hash_ring]") {
  hypic::rpc::Digest d{};
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<uint8_t>(i + 1);
  CHECK(HashRing::key_hash(d) == 0x0807060504030201ull);
}

TEST_CASE("keys spread evenly over replicas", "[hash_ring]") {
  HashRing ring(nodes(4), 160);
  std::vector<int> count(4, 0);
  std::mt19937_64 rng(7);
  const int n = 100000;
  for (int i = 0; i < n; ++i) ++count[ring.owner(rng())];
  // 160 virtual nodes per replica: each share within 20% of the mean.
  for (int c : count) {
    CHECK(c > n / 4 * 0.8);
    CHECK(c < n / 4 * 1.2);
  }
}

TEST_CASE("adding or removing a replica moves only the keys it gains or loses", "[hash_ring]") {
  const auto four = nodes(4);
  auto five = nodes(5);
  HashRing r4(four, 160), r5(five, 160);
  std::mt19937_64 rng(3);
  int moved = 0;
  const int n = 50000;
  for (int i = 0; i < n; ++i) {
    const uint64_t k = rng();
    const size_t a = r4.owner(k), b = r5.owner(k);
    if (a != b) {
      ++moved;
      CHECK(b == 4);  // a moved key always goes to the new replica
    }
  }
  // About 1/5 of the keys move.
  CHECK(moved > n / 5 * 0.7);
  CHECK(moved < n / 5 * 1.3);

  // Removing replica 1: keys of the others stay where they were.
  std::vector<std::string> without = {four[0], four[2], four[3]};
  HashRing r3(without, 160);
  for (int i = 0; i < 20000; ++i) {
    const uint64_t k = rng();
    const std::string before = four[r4.owner(k)];
    const std::string after = without[r3.owner(k)];
    if (before != four[1]) CHECK(after == before);
  }
}

TEST_CASE("bad replica lists are rejected", "[hash_ring]") {
  CHECK_THROWS_AS(HashRing({}, 10), std::invalid_argument);
  CHECK_THROWS_AS(HashRing({"a:1", "a:1"}, 10), std::invalid_argument);
  CHECK_THROWS_AS(HashRing({"a:1"}, 0), std::invalid_argument);
  CHECK_THROWS_AS(HashRing({""}, 10), std::invalid_argument);
}
