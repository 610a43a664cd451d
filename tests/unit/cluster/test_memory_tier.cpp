// The combine worker's memory tier of deserialized entries: LRU under a byte budget, id check.
#include <catch2/catch.hpp>

#include "combine_worker/memory_tier.h"

using hypic::combine::EntryMemoryTier;
using hypic::engine::SegmentEntry;

namespace {
std::shared_ptr<const SegmentEntry> entry_of(int n_tokens, int32_t first) {
  auto e = std::make_shared<SegmentEntry>();
  for (int i = 0; i < n_tokens; ++i) e->token_ids.push_back(first + i);
  return e;
}
hypic::rpc::Digest digest_of(uint8_t n) {
  hypic::rpc::Digest d{};
  d.fill(n);
  return d;
}
}  // namespace

TEST_CASE("memory tier: LRU by entry bytes, token ids verified", "[memory_tier]") {
  auto a = entry_of(10, 100), b = entry_of(10, 200), c = entry_of(10, 300);
  REQUIRE(a->byte_size() == b->byte_size());
  EntryMemoryTier tier(a->byte_size() + b->byte_size());
  tier.put(digest_of(1), a);
  tier.put(digest_of(2), b);
  CHECK(tier.entries() == 2);
  CHECK(tier.bytes() == a->byte_size() * 2);
  CHECK(tier.get(digest_of(1), a->token_ids) == a);  // 1 becomes most recent
  tier.put(digest_of(3), c);                          // evicts 2
  CHECK(tier.get(digest_of(2), b->token_ids) == nullptr);
  CHECK(tier.get(digest_of(1), a->token_ids) == a);
  CHECK(tier.get(digest_of(3), c->token_ids) == c);
  // Same digest, other ids: a miss.
  CHECK(tier.get(digest_of(1), b->token_ids) == nullptr);
  tier.erase(digest_of(1));
  CHECK(tier.get(digest_of(1), a->token_ids) == nullptr);
  CHECK(tier.bytes() == c->byte_size());
  // Larger than the budget: not stored.
  auto big = entry_of(1000, 0);
  tier.put(digest_of(4), big);
  CHECK(tier.get(digest_of(4), big->token_ids) == nullptr);
  CHECK(tier.entries() == 1);
}

TEST_CASE("memory tier with a zero budget stores nothing", "[memory_tier]") {
  EntryMemoryTier tier(0);
  auto a = entry_of(3, 1);
  tier.put(digest_of(1), a);
  CHECK(tier.get(digest_of(1), a->token_ids) == nullptr);
  CHECK(tier.entries() == 0);
}
