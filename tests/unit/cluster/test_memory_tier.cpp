// The combine worker's memory tier of resident entries: LRU under a byte budget, id check.
#include <catch2/catch.hpp>

#include "combine_worker/memory_tier.h"

using hypic::combine::EntryMemoryTier;
using hypic::engine::SegmentEntry;

namespace {
// A resident entry of n tokens holding its header only, resident_bytes = its serialized size.
struct TestEntry final : hypic::engine::ResidentEntry {
  SegmentEntry e;
  const SegmentEntry& header() const override { return e; }
  std::shared_ptr<const SegmentEntry> host() const override { return std::make_shared<const SegmentEntry>(e); }
  size_t resident_bytes() const override { return e.byte_size(); }
  const std::vector<int32_t>& ids() const { return e.token_ids; }
};
std::shared_ptr<const TestEntry> entry_of(int n_tokens, int32_t first) {
  auto t = std::make_shared<TestEntry>();
  for (int i = 0; i < n_tokens; ++i) t->e.token_ids.push_back(first + i);
  return t;
}
hypic::rpc::Digest digest_of(uint8_t n) {
  hypic::rpc::Digest d{};
  d.fill(n);
  return d;
}
}  // namespace

TEST_CASE("memory tier: LRU by entry bytes, token ids verified", "[memory_tier]") {
  auto a = entry_of(10, 100), b = entry_of(10, 200), c = entry_of(10, 300);
  REQUIRE(a->resident_bytes() == b->resident_bytes());
  EntryMemoryTier tier(a->resident_bytes() + b->resident_bytes());
  tier.put(digest_of(1), a);
  tier.put(digest_of(2), b);
  CHECK(tier.entries() == 2);
  CHECK(tier.bytes() == a->resident_bytes() * 2);
  CHECK(tier.get(digest_of(1), a->ids()) == a);  // 1 becomes most recent
  tier.put(digest_of(3), c);                          // evicts 2
  CHECK(tier.get(digest_of(2), b->ids()) == nullptr);
  CHECK(tier.get(digest_of(1), a->ids()) == a);
  CHECK(tier.get(digest_of(3), c->ids()) == c);
  // Same digest, other ids: a miss.
  CHECK(tier.get(digest_of(1), b->ids()) == nullptr);
  tier.erase(digest_of(1));
  CHECK(tier.get(digest_of(1), a->ids()) == nullptr);
  CHECK(tier.bytes() == c->resident_bytes());
  // Larger than the budget: not stored.
  auto big = entry_of(1000, 0);
  tier.put(digest_of(4), big);
  CHECK(tier.get(digest_of(4), big->ids()) == nullptr);
  CHECK(tier.entries() == 1);
}

TEST_CASE("memory tier with a zero budget stores nothing", "[memory_tier]") {
  EntryMemoryTier tier(0);
  auto a = entry_of(3, 1);
  tier.put(digest_of(1), a);
  CHECK(tier.get(digest_of(1), a->ids()) == nullptr);
  CHECK(tier.entries() == 0);
}
