// Segment cache store: LRU under a byte budget, pins and leases, disk tier (spill, promotion,
// restart), integrity checks, token-id verification, concurrency.
#include <catch2/catch.hpp>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "proto/rpc/chunks.h"
#include "segment_cache/store.h"

using hypic::cache::SegmentStore;
using hypic::cache::StoreOptions;
using hypic::cache::Tier;
using hypic::rpc::Digest;
using hypic::rpc::RpcError;

namespace {
Digest digest_of(uint8_t n) {
  Digest d{};
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<uint8_t>(n * 31 + i * 7 + 1);
  return d;
}
std::vector<int32_t> ids_of(uint8_t n) { return {int32_t(n), int32_t(n) + 1000, 7}; }
// Payload of entry n: `size` bytes, distinct per n.
std::string bytes_of(uint8_t n, size_t size) {
  std::string s(size, '\0');
  for (size_t i = 0; i < size; ++i) s[i] = static_cast<char>((n * 131 + i * 17) & 0xff);
  return s;
}
void put(SegmentStore& st, uint8_t n, size_t size) {
  auto b = bytes_of(n, size);
  const uint64_t c = hypic::rpc::checksum64(b);
  st.put(digest_of(n), ids_of(n), std::move(b), c);
}
bool present(SegmentStore& st, uint8_t n) {
  const auto ids = ids_of(n);
  return st.lookup(digest_of(n), ids, std::chrono::milliseconds(0)).hit;
}
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           ("hypic-store-test-" + std::to_string(std::random_device{}()) + "-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};
grpc::StatusCode code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const RpcError& e) {
    return e.code();
  }
  return grpc::StatusCode::OK;
}
}  // namespace

TEST_CASE("put then get returns the same bytes, verifies ids and checksums", "[segment_store]") {
  SegmentStore st(StoreOptions{.memory_budget_bytes = 1000});
  put(st, 1, 100);
  const auto ids = ids_of(1);
  auto h = st.get(digest_of(1), std::span<const int32_t>(ids));
  REQUIRE(h);
  CHECK(h->bytes() == bytes_of(1, 100));
  CHECK(h->tier() == Tier::Memory);
  CHECK(h->checksum() == hypic::rpc::checksum64(bytes_of(1, 100)));

  // Same digest, other token ids: a collision is a miss, never the other segment's entry.
  const std::vector<int32_t> other = {1, 2, 3};
  CHECK_FALSE(st.get(digest_of(1), std::span<const int32_t>(other)));
  CHECK_FALSE(st.lookup(digest_of(1), other, std::chrono::milliseconds(0)).hit);
  CHECK(st.stats().collisions == 2);
  CHECK_FALSE(st.get(digest_of(2), std::span<const int32_t>(ids)));  // absent

  // A put whose checksum does not match its bytes is refused and stores nothing.
  CHECK(code_of([&] { st.put(digest_of(3), ids_of(3), bytes_of(3, 10), 12345); }) == grpc::StatusCode::DATA_LOSS);
  CHECK_FALSE(present(st, 3));
  CHECK(st.stats().rejected_puts == 1);
}

TEST_CASE("LRU eviction under the memory budget follows recency of use", "[segment_store]") {
  SegmentStore st(StoreOptions{.memory_budget_bytes = 300});
  put(st, 1, 100);
  put(st, 2, 100);
  put(st, 3, 100);
  const auto ids1 = ids_of(1);
  REQUIRE(st.get(digest_of(1), std::span<const int32_t>(ids1)));  // 1 becomes most recent; 2 is LRU
  put(st, 4, 100);
  CHECK(present(st, 1));
  CHECK_FALSE(present(st, 2));
  CHECK(present(st, 3));
  CHECK(present(st, 4));
  put(st, 5, 150);  // needs two evictions: 3 then 1
  CHECK_FALSE(present(st, 3));
  CHECK_FALSE(present(st, 1));
  CHECK(present(st, 4));
  const auto s = st.stats();
  CHECK(s.evictions == 3);
  CHECK(s.memory_bytes == 250);
  CHECK(s.memory_entries == 2);
}

TEST_CASE("pinned and leased entries are not evicted", "[segment_store]") {
  auto fake_now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  SegmentStore st(StoreOptions{.memory_budget_bytes = 200, .clock = [&] { return fake_now; }});
  put(st, 1, 100);
  put(st, 2, 100);
  {
    const auto ids1 = ids_of(1), ids2 = ids_of(2);
    auto h1 = st.get(digest_of(1), std::span<const int32_t>(ids1));
    REQUIRE(st.get(digest_of(2), std::span<const int32_t>(ids2)));  // 1 is now LRU, but pinned
    CHECK(st.stats().pinned_entries == 1);
    put(st, 3, 100);
    CHECK(present(st, 1));
    CHECK_FALSE(present(st, 2));
    // Both remaining entries pinned: nothing can make room.
    const auto ids3 = ids_of(3);
    auto h3 = st.get(digest_of(3), std::span<const int32_t>(ids3));
    CHECK(code_of([&] { put(st, 4, 100); }) == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(st.stats().rejected_puts == 1);
  }
  CHECK(st.stats().pinned_entries == 0);

  // Leases: 1 is LRU; a lookup leases it for 10 s, so 3 goes instead.
  const auto ids1 = ids_of(1);
  REQUIRE(st.lookup(digest_of(1), ids1, std::chrono::seconds(10)).hit);
  put(st, 5, 100);
  CHECK(present(st, 1));
  CHECK_FALSE(present(st, 3));
  // Once the lease expires, 1 is the LRU entry again and is evicted.
  fake_now += std::chrono::seconds(11);
  put(st, 6, 100);
  CHECK_FALSE(present(st, 1));
  CHECK(present(st, 5));
}

TEST_CASE("too large entries are refused without a disk tier", "[segment_store]") {
  SegmentStore st(StoreOptions{.memory_budget_bytes = 100});
  CHECK(code_of([&] { put(st, 1, 101); }) == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(st.stats().memory_entries == 0);
}

TEST_CASE("replacing an entry keeps the bytes a reader holds", "[segment_store]") {
  SegmentStore st(StoreOptions{.memory_budget_bytes = 1000});
  put(st, 1, 100);
  const auto ids = ids_of(1);
  auto old = st.get(digest_of(1), std::span<const int32_t>(ids));
  std::string fresh(50, 'x');
  const uint64_t c = hypic::rpc::checksum64(fresh);
  CHECK(st.put(digest_of(1), ids_of(1), fresh, c));
  CHECK(old->bytes() == bytes_of(1, 100));
  CHECK(st.get(digest_of(1), std::span<const int32_t>(ids))->bytes() == fresh);
  CHECK(st.erase(digest_of(1)));
  CHECK_FALSE(st.erase(digest_of(1)));
  CHECK(old->bytes() == bytes_of(1, 100));
}

TEST_CASE("a memory copy that changed after its put fails its checksum on get, is dropped, and readers holding it keep "
          "theirs", "[segment_store]") {
  SegmentStore st(StoreOptions{.memory_budget_bytes = 1000});
  put(st, 1, 100);
  const auto ids = ids_of(1);
  auto held = st.get(digest_of(1), std::span<const int32_t>(ids));
  REQUIRE(held);
  REQUIRE(held->memfd_ref().fd == -1);  // on the heap (below shared_memory_min_bytes): it can be changed in place
  const_cast<char*>(held->bytes().data())[50] ^= 0x20;  // what a bit flip in the cache's memory does
  // Verified on every get (outside the store's lock), whatever verify_memfd says for heap bytes.
  CHECK(code_of([&] { (void)st.get(digest_of(1), std::span<const int32_t>(ids), /*verify_memfd=*/false); }) ==
        grpc::StatusCode::DATA_LOSS);
  CHECK_FALSE(present(st, 1));
  const auto s = st.stats();
  CHECK(s.corruptions == 1);
  CHECK(s.hits == 1);  // the first get; the corrupt one counts as a miss
  CHECK(held->bytes().size() == 100);  // the reader's handle stays valid
  CHECK_FALSE(st.get(digest_of(1), std::span<const int32_t>(ids)));
  put(st, 1, 100);  // put again: a new generation, verified and served
  CHECK(st.get(digest_of(1), std::span<const int32_t>(ids))->bytes() == bytes_of(1, 100));
}

TEST_CASE("a corrupt memory copy hashed by several Gets at once is dropped and counted once, and no counter goes "
          "back", "[segment_store]") {
  constexpr size_t kSize = size_t{32} << 20;  // long enough to hash that the Gets overlap
  SegmentStore st(StoreOptions{.memory_budget_bytes = 2 * kSize});
  put(st, 1, kSize);
  const auto ids = ids_of(1);
  {
    auto held = st.get(digest_of(1), std::span<const int32_t>(ids));
    REQUIRE(held);
    const_cast<char*>(held->bytes().data())[kSize - 1] ^= 0x20;
  }
  const auto before = st.stats();
  std::atomic<bool> done{false}, went_back{false};
  std::thread poll([&] {  // what a metrics scrape sees meanwhile
    uint64_t hits = before.hits;
    while (!done) {
      const uint64_t now = st.stats().hits;
      if (now < hits) went_back = true;
      hits = now;
    }
  });
  std::atomic<int> losses{0}, dropped{0};
  std::vector<std::thread> readers;
  for (int i = 0; i < 3; ++i) {
    readers.emplace_back([&] {
      try {
        (void)st.get(digest_of(1), std::span<const int32_t>(ids));
      } catch (const RpcError& e) {
        if (e.code() == grpc::StatusCode::DATA_LOSS) ++losses;
        if (std::string_view(e.what()).find("and was dropped") != std::string_view::npos) ++dropped;
      }
    });
  }
  for (auto& t : readers) t.join();
  done = true;
  poll.join();
  const auto after = st.stats();
  CHECK(losses >= 1);
  CHECK(dropped == 1);  // the one that found it in place; the others say it had been dropped meanwhile (or missed)
  CHECK(after.corruptions - before.corruptions == 1);
  CHECK(after.misses - before.misses == 3);  // every Get: a corrupt copy or, after the drop, no entry
  CHECK(after.hits == before.hits);
  CHECK_FALSE(went_back);
  CHECK_FALSE(present(st, 1));
}

TEST_CASE("disk tier: spill, promotion, corruption, restart", "[segment_store]") {
  TempDir dir;
  StoreOptions opt{.memory_budget_bytes = 200, .disk_dir = dir.path, .disk_budget_bytes = 250};
  {
    SegmentStore st(opt);
    put(st, 1, 100);
    put(st, 2, 100);
    put(st, 3, 100);  // 1 spills to disk
    auto s = st.stats();
    CHECK(s.spills == 1);
    CHECK(s.disk_entries == 1);
    CHECK(s.memory_entries == 2);
    const auto f1 = dir.path / (hypic::rpc::digest_hex(digest_of(1)) + ".entry");
    CHECK(std::filesystem::exists(f1));
    CHECK(st.lookup(digest_of(1), ids_of(1), std::chrono::milliseconds(0)).tier == Tier::Disk);

    // A disk hit is served from disk and promoted; 2 (LRU in memory) spills in its place.
    const auto ids1 = ids_of(1);
    {
      auto h = st.get(digest_of(1), std::span<const int32_t>(ids1));
      REQUIRE(h);
      CHECK(h->tier() == Tier::Disk);
      CHECK(h->bytes() == bytes_of(1, 100));
    }
    s = st.stats();
    CHECK(s.promotions == 1);
    CHECK(s.spills == 2);
    CHECK_FALSE(std::filesystem::exists(f1));
    CHECK(st.lookup(digest_of(2), ids_of(2), std::chrono::milliseconds(0)).tier == Tier::Disk);

    // Fill the disk past its 250-byte budget: the LRU disk entry is evicted.
    put(st, 4, 100);  // 3 spills (disk: 2, 3)
    put(st, 5, 100);  // 1 spills, disk needs room: 2 is evicted
    CHECK_FALSE(present(st, 2));
    CHECK(st.lookup(digest_of(1), ids_of(1), std::chrono::milliseconds(0)).tier == Tier::Disk);
    CHECK(st.stats().disk_bytes <= 250);
  }
  {
    // Restart on the same directory: the disk entries are still there.
    SegmentStore st(opt);
    CHECK(st.stats().disk_entries == 2);
    CHECK(present(st, 3));
    CHECK(present(st, 1));
    // Flip one payload byte of 3's file: the read detects it, drops the entry and the file.
    const auto f3 = dir.path / (hypic::rpc::digest_hex(digest_of(3)) + ".entry");
    {
      std::fstream f(f3, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(-10, std::ios::end);
      char c = 0;
      f.seekg(-10, std::ios::end);
      f.get(c);
      f.seekp(-10, std::ios::end);
      f.put(static_cast<char>(c ^ 0x01));
    }
    const auto ids3 = ids_of(3);
    CHECK(code_of([&] { st.get(digest_of(3), std::span<const int32_t>(ids3)); }) == grpc::StatusCode::DATA_LOSS);
    CHECK(st.stats().corruptions == 1);
    CHECK_FALSE(present(st, 3));
    CHECK_FALSE(std::filesystem::exists(f3));
    // An unreadable file is deleted when a store indexes the directory.
    std::ofstream(dir.path / (hypic::rpc::digest_hex(digest_of(9)) + ".entry")) << "garbage";
  }
  SegmentStore st(opt);
  CHECK(st.stats().corruptions == 1);
  CHECK(st.stats().disk_entries == 1);
  CHECK(present(st, 1));
}

TEST_CASE("an entry larger than memory goes straight to disk", "[segment_store]") {
  TempDir dir;
  SegmentStore st(StoreOptions{.memory_budget_bytes = 100, .disk_dir = dir.path, .disk_budget_bytes = 1000});
  put(st, 1, 500);
  const auto ids = ids_of(1);
  auto h = st.get(digest_of(1), std::span<const int32_t>(ids));
  REQUIRE(h);
  CHECK(h->bytes() == bytes_of(1, 500));
  CHECK(h->tier() == Tier::Disk);
  CHECK(st.stats().promotions == 0);  // cannot fit in memory: served from disk
}

TEST_CASE("concurrent puts and gets keep the budget and never return wrong bytes", "[segment_store]") {
  SegmentStore st(StoreOptions{.memory_budget_bytes = 2000});
  std::atomic<int> wrong{0}, hits{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 2000; ++i) {
        const uint8_t n = static_cast<uint8_t>(rng() % 40);
        const size_t size = 50 + n;  // size determined by n, so a reader knows what to expect
        if (rng() % 3 == 0) {
          put(st, n, size);
        } else {
          const auto ids = ids_of(n);
          auto h = st.get(digest_of(n), std::span<const int32_t>(ids));
          if (h) {
            ++hits;
            if (h->bytes() != bytes_of(n, size)) ++wrong;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(wrong == 0);
  CHECK(hits > 0);
  const auto s = st.stats();
  CHECK(s.memory_bytes <= 2000);
  CHECK(s.pinned_entries == 0);
}

namespace {
SegmentStore::LookupResult lease(SegmentStore& st, uint8_t n, std::chrono::milliseconds ms, std::string_view owner) {
  const auto ids = ids_of(n);
  return st.lookup(digest_of(n), ids, ms, owner);
}
}  // namespace

TEST_CASE("leases end when their owner releases them and are capped at a fraction of memory", "[segment_store]") {
  auto fake_now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  SegmentStore st(StoreOptions{.memory_budget_bytes = 400, .max_leased_fraction = 0.5, .clock = [&] { return fake_now; }});
  for (uint8_t n = 1; n <= 4; ++n) put(st, n, 100);  // full; LRU order 1 (oldest) .. 4
  const auto ten_s = std::chrono::seconds(10);
  CHECK(lease(st, 1, ten_s, "req-a").leased);
  CHECK(lease(st, 2, ten_s, "req-a").leased);
  // 200 of the 400 bytes are leased: the cap. A third entry is a hit without a lease.
  const auto capped = lease(st, 3, ten_s, "req-b");
  CHECK(capped.hit);
  CHECK_FALSE(capped.leased);
  auto s = st.stats();
  CHECK(s.leased_entries == 2);
  CHECK(s.leased_bytes == 200);
  CHECK(s.max_leased_bytes == 200);
  CHECK(s.unleased_hits == 1);
  // An entry already leased takes another owner's lease without more leased bytes.
  CHECK(lease(st, 1, ten_s, "req-b").leased);
  CHECK(st.stats().leased_bytes == 200);

  put(st, 5, 100);  // 1 and 2 are leased: 3 goes
  CHECK(present(st, 1));
  CHECK(present(st, 2));
  CHECK_FALSE(present(st, 3));
  CHECK(st.release_leases("req-a") == 2);  // 2 is free again; 1 is still req-b's
  s = st.stats();
  CHECK(s.leased_entries == 1);
  CHECK(s.leased_bytes == 100);
  put(st, 6, 100);  // LRU: 1 (leased), then 2
  CHECK(present(st, 1));
  CHECK_FALSE(present(st, 2));
  CHECK(st.release_leases("req-b") == 1);
  CHECK(st.release_leases("nobody") == 0);
  CHECK(st.release_leases("req-b") == 0);
  s = st.stats();
  CHECK(s.leased_entries == 0);
  CHECK(s.leased_bytes == 0);
  CHECK(s.leases_released == 3);
  put(st, 7, 100);  // nothing leased: 1, the LRU entry, goes although its leases have not expired
  CHECK_FALSE(present(st, 1));
  CHECK(st.stats().rejected_puts == 0);
}

TEST_CASE("leases: extended by their owner, expire, anonymous, and end with a replaced entry", "[segment_store]") {
  auto fake_now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  SegmentStore st(StoreOptions{.memory_budget_bytes = 1000, .clock = [&] { return fake_now; }});
  for (uint8_t n = 1; n <= 4; ++n) put(st, n, 100);
  // The same owner looking an entry up again extends its one lease.
  CHECK(lease(st, 1, std::chrono::seconds(1), "x").leased);
  CHECK(lease(st, 1, std::chrono::seconds(10), "x").leased);
  fake_now += std::chrono::seconds(5);
  CHECK(st.stats().leased_entries == 1);
  fake_now += std::chrono::seconds(6);
  CHECK(st.stats().leased_entries == 0);  // expired
  CHECK(st.release_leases("x") == 0);

  // Anonymous leases cannot be released, only expire.
  CHECK(lease(st, 2, std::chrono::seconds(10), "").leased);
  CHECK(st.release_leases("") == 0);
  CHECK(st.stats().leased_bytes == 100);
  fake_now += std::chrono::seconds(11);
  CHECK(st.stats().leased_bytes == 0);

  // Replacing a leased entry ends its leases (the new entry is not leased); the stale lease releases harmlessly.
  CHECK(lease(st, 3, std::chrono::seconds(10), "y").leased);
  put(st, 3, 50);
  auto s = st.stats();
  CHECK(s.leased_entries == 0);
  CHECK(s.leased_bytes == 0);
  CHECK(lease(st, 3, std::chrono::seconds(10), "y").leased);  // a fresh lease on the new entry
  CHECK(st.stats().leased_bytes == 50);
  CHECK(st.erase(digest_of(3)));
  CHECK(st.stats().leased_bytes == 0);
  CHECK(st.release_leases("y") == 1);
  CHECK(st.stats().leased_bytes == 0);

  // A fraction of 0 disables leases; a fraction outside [0, 1] is refused.
  SegmentStore none(StoreOptions{.memory_budget_bytes = 1000, .max_leased_fraction = 0.0});
  put(none, 1, 100);
  CHECK(lease(none, 1, std::chrono::seconds(10), "z").hit);
  CHECK_FALSE(lease(none, 1, std::chrono::seconds(10), "z").leased);
  CHECK_THROWS_AS(SegmentStore(StoreOptions{.memory_budget_bytes = 1000, .max_leased_fraction = 1.5}),
                  std::invalid_argument);
}

TEST_CASE("leases never lock the budget: with owners that never release, puts are still accepted", "[segment_store]") {
  // Worst case for leases: every lookup hit leased for a long time and never released (a router that died), on a
  // small cache under a skewed workload. The cap leaves half of the memory to unleased entries, so every put of an
  // entry up to half the budget finds room.
  SegmentStore st(StoreOptions{.memory_budget_bytes = 1000});
  std::mt19937 rng(7);
  std::discrete_distribution<int> zipf({1.0, 1.0 / 2, 1.0 / 3, 1.0 / 4, 1.0 / 5, 1.0 / 6, 1.0 / 7, 1.0 / 8, 1.0 / 9,
                                        1.0 / 10, 1.0 / 11, 1.0 / 12, 1.0 / 13, 1.0 / 14, 1.0 / 15, 1.0 / 16});
  int misses = 0;
  for (int r = 0; r < 400; ++r) {
    const auto n = static_cast<uint8_t>(zipf(rng) + 1);
    if (!lease(st, n, std::chrono::hours(1), "request-" + std::to_string(r)).hit) {
      ++misses;
      put(st, n, 100);
    }
  }
  const auto s = st.stats();
  CHECK(misses > 16);  // the workload does evict
  CHECK(s.rejected_puts == 0);
  CHECK(s.leased_bytes <= 500);
  CHECK(s.unleased_hits > 0);
}

TEST_CASE("an entry's MAC is kept in memory, on disk and across a restart", "[segment_store][mac]") {
  TempDir dir;
  const std::string mac(32, '\x5a');
  {
    SegmentStore st(StoreOptions{.memory_budget_bytes = 100, .disk_dir = dir.path, .disk_budget_bytes = 1000});
    auto b = bytes_of(1, 60);
    const uint64_t c = hypic::rpc::checksum64(b);
    st.put(digest_of(1), ids_of(1), std::move(b), c, mac);
    const auto ids = ids_of(1);
    {
      auto h = st.get(digest_of(1), std::span<const int32_t>(ids));
      REQUIRE(h);
      CHECK(h->mac() == mac);
      CHECK(h->tier() == Tier::Memory);
    }
    put(st, 2, 80);  // spills entry 1 to disk (no longer pinned)
  }
  SegmentStore again(StoreOptions{.memory_budget_bytes = 100, .disk_dir = dir.path, .disk_budget_bytes = 1000});
  const auto ids = ids_of(1);
  auto h = again.get(digest_of(1), std::span<const int32_t>(ids));
  REQUIRE(h);
  CHECK(h->mac() == mac);
  CHECK(h->bytes() == bytes_of(1, 60));
  // A MAC over 64 bytes is refused.
  auto b = bytes_of(3, 10);
  const uint64_t c = hypic::rpc::checksum64(b);
  CHECK(code_of([&] { again.put(digest_of(3), ids_of(3), b, c, std::string(65, 'x')); }) ==
        grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(again.max_entry_bytes() == 1000);
}
