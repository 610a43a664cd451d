// Segment cache events (segment_cache/events.h, SegmentStore's event sink): every change to what the store holds
// is reported once, in order, with the right kind, tier and reason; a listing plus a subscription taken under the
// store's lock covers every entry exactly once; a slow subscriber is overflowed instead of growing without bound.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "proto/rpc/chunks.h"
#include "segment_cache/events.h"
#include "segment_cache/store.h"

using namespace hypic::cache;
using hypic::rpc::Digest;
using Kind = StoreEvent::Kind;

namespace {
Digest digest_of(uint8_t n) {
  Digest d{};
  d.fill(n);
  return d;
}
std::vector<int32_t> ids_of(uint8_t n) { return {int32_t(n), 5, 9}; }
void put(SegmentStore& st, uint8_t n, size_t size) {
  std::string b(size, char(n));
  const uint64_t c = hypic::rpc::checksum64(b);
  st.put(digest_of(n), ids_of(n), std::move(b), c);
}
struct Recorder {
  std::vector<StoreEvent> events;
  std::function<void(const StoreEvent&)> sink() {
    return [this](const StoreEvent& e) { events.push_back(e); };
  }
};
struct TempDir {
  std::filesystem::path path = std::filesystem::temp_directory_path() /
                               ("hypic-events-test-" + std::to_string(std::random_device{}()));
  TempDir() { std::filesystem::create_directories(path); }
  ~TempDir() { std::filesystem::remove_all(path); }
};
bool is(const StoreEvent& e, Kind k, uint8_t n, Tier tier, std::string_view reason = "", Tier from = Tier::None) {
  return e.kind == k && e.digest == digest_of(n) && e.tier == tier && reason == e.reason && e.from_tier == from;
}
}  // namespace

TEST_CASE("cache events: memory-only store: stored, evicted by LRU, replaced, deleted", "[cache_events]") {
  StoreOptions o;
  o.memory_budget_bytes = 300;
  SegmentStore st(o);
  Recorder r;
  st.set_event_sink(r.sink());
  put(st, 1, 100);
  put(st, 2, 100);
  put(st, 3, 100);
  put(st, 4, 100);  // evicts 1, the least recently used
  REQUIRE(r.events.size() == 5);
  CHECK(is(r.events[0], Kind::Stored, 1, Tier::Memory));
  CHECK(is(r.events[3], Kind::Evicted, 1, Tier::Memory, "lru"));
  CHECK(is(r.events[4], Kind::Stored, 4, Tier::Memory));
  CHECK(r.events[4].size_bytes == 100);
  r.events.clear();
  put(st, 2, 50);  // replaced
  REQUIRE(r.events.size() == 2);
  CHECK(is(r.events[0], Kind::Cleared, 2, Tier::Memory, "replaced"));
  CHECK(r.events[0].size_bytes == 100);
  CHECK(is(r.events[1], Kind::Stored, 2, Tier::Memory));
  CHECK(r.events[1].size_bytes == 50);
  r.events.clear();
  CHECK(st.erase(digest_of(3)));
  CHECK_FALSE(st.erase(digest_of(3)));  // absent: no event
  REQUIRE(r.events.size() == 1);
  CHECK(is(r.events[0], Kind::Cleared, 3, Tier::Memory, "deleted"));
  // A refused put changes nothing and reports nothing.
  r.events.clear();
  CHECK_THROWS(put(st, 9, 1000));
  CHECK(r.events.empty());
}

TEST_CASE("cache events: disk tier: spills and promotions are moves, disk evictions and corruptions are reported",
          "[cache_events]") {
  TempDir dir;
  StoreOptions o;
  o.memory_budget_bytes = 200;
  o.disk_dir = dir.path;
  o.disk_budget_bytes = 200;
  SegmentStore st(o);
  Recorder r;
  st.set_event_sink(r.sink());
  put(st, 1, 100);
  put(st, 2, 100);
  put(st, 3, 100);  // 1 spills to disk
  REQUIRE(r.events.size() == 4);
  CHECK(is(r.events[2], Kind::Moved, 1, Tier::Disk, "", Tier::Memory));
  CHECK(is(r.events[3], Kind::Stored, 3, Tier::Memory));
  r.events.clear();
  put(st, 4, 100);  // 2 spills
  put(st, 5, 100);  // 3 spills; the disk is full, so 1 (least recent on disk) is evicted
  std::vector<std::string> seen;
  for (const auto& e : r.events) seen.push_back(std::to_string(int(e.kind)) + ":" + std::to_string(e.digest[0]));
  CHECK(seen == std::vector<std::string>{"4:2", "1:4", "2:1", "4:3", "1:5"});
  CHECK(is(r.events[2], Kind::Evicted, 1, Tier::Disk, "lru"));
  r.events.clear();
  // A hit on a disk entry promotes it (it fits after spilling the least recent memory entry).
  const auto ids = ids_of(2);
  REQUIRE(st.get(digest_of(2), std::span<const int32_t>(ids)));
  REQUIRE(!r.events.empty());
  CHECK(is(r.events.back(), Kind::Moved, 2, Tier::Memory, "", Tier::Disk));
  r.events.clear();
  // A corrupt disk file is dropped and reported as cleared (any entry on disk now; its name is its digest's hex).
  std::filesystem::path file;
  for (const auto& de : std::filesystem::directory_iterator(dir.path)) file = de.path();
  REQUIRE(!file.empty());
  const auto n = uint8_t(std::stoi(file.filename().string().substr(0, 2), nullptr, 16));
  const auto ids3 = ids_of(n);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('X');
  }
  CHECK_THROWS(st.get(digest_of(n), std::span<const int32_t>(ids3)));
  REQUIRE(r.events.size() == 1);
  CHECK(is(r.events[0], Kind::Cleared, n, Tier::Disk, "corrupt"));
}

TEST_CASE("cache events: a listing and a subscription under one lock see every entry exactly once",
          "[cache_events]") {
  StoreOptions o;
  o.memory_budget_bytes = 1 << 20;
  SegmentStore st(o);
  CacheEventHub hub(1 << 16);
  st.set_event_sink([&hub](const StoreEvent& e) { hub.publish(e); });
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (int i = 0; !stop.load(); i = (i + 1) % 200) put(st, uint8_t(i), 64);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::shared_ptr<CacheEventHub::Subscriber> sub;
  const auto listed = st.list_entries_then([&] { sub = hub.subscribe(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  stop = true;
  writer.join();
  // Replaying the listing, then the events, gives exactly what the store holds now.
  std::set<Digest> held;
  for (const auto& e : listed) {
    CHECK(e.kind == Kind::Stored);
    CHECK(held.insert(e.digest).second);
  }
  bool overflowed = false;
  uint64_t last = 0;
  for (const auto& se : sub->wait(std::chrono::milliseconds(0), &overflowed)) {
    CHECK(se.sequence == (last == 0 ? se.sequence : last + 1));  // consecutive on one stream
    last = se.sequence;
    if (se.event.kind == Kind::Stored) CHECK(held.insert(se.event.digest).second);
    if (se.event.kind == Kind::Cleared || se.event.kind == Kind::Evicted) CHECK(held.erase(se.event.digest) == 1);
  }
  CHECK_FALSE(overflowed);
  std::set<Digest> now;
  for (const auto& e : st.list_entries_then([] {})) now.insert(e.digest);
  CHECK(held == now);
  CHECK(now.size() == 200);
}

TEST_CASE("cache events: a subscriber that falls behind is overflowed -- others are not affected", "[cache_events]") {
  CacheEventHub hub(3);
  auto slow = hub.subscribe();
  auto fast = hub.subscribe();
  bool over = false;
  StoreEvent e;
  for (int i = 0; i < 3; ++i) hub.publish(e);
  CHECK(fast->wait(std::chrono::milliseconds(0), &over).size() == 3);
  CHECK_FALSE(over);
  hub.publish(e);  // slow now has 4 > 3 pending
  CHECK(fast->wait(std::chrono::milliseconds(0), &over).size() == 1);
  CHECK_FALSE(over);
  CHECK(slow->wait(std::chrono::milliseconds(0), &over).empty());
  CHECK(over);
  hub.unsubscribe(slow);
  CHECK(hub.subscribers() == 1);
  CHECK(hub.published() == 4);
  CHECK_THROWS_AS(CacheEventHub(0), std::invalid_argument);
}
