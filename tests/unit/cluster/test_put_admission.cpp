// Segment cache put admission (segment_cache/service.cpp, SegmentCacheService::Put): beside other puts being
// received, a put that would take the received bytes past the memory budget waits for room instead of being dropped;
// it is refused (RESOURCE_EXHAUSTED, "retry later") once max_put_wait passes, or at once when the waiting puts' bytes
// with its own would pass the budget; puts wait in arrival order; a waiting put whose caller gives up leaves no bytes
// counted; a put whose sender stops sending is cancelled after put_idle (one that keeps sending is not). The client's
// side: a put's deadline allows the cache's wait for room and its bytes (SegmentCacheClient::Options put_wait,
// transfer_rate), a put can be cancelled from another thread (PutCancel), and AsyncCachePutter's shutdown cancels its
// put in flight. A real gRPC server on loopback, a put held open half-sent by a raw stream.
#include <catch2/catch.hpp>

#include <CLI/CLI.hpp>

#include <atomic>
#include <future>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "proto/rpc/chunks.h"
#include "proto/rpc/status.h"
#include "segment_cache/async_put.h"
#include "segment_cache/client.h"
#include "segment_cache/service.h"
#include "tests/unit/cluster/cache_fixture.h"

using namespace hypic;
using namespace std::chrono_literals;

namespace {

constexpr uint64_t kBudget = 1 << 20;  // memory budget, bytes: two entries of kEntry do not fit beside each other
constexpr size_t kEntry = 600 << 10;

// The cache of these tests: a memory budget of kBudget.
struct CacheServer : test::CacheServer {
  explicit CacheServer(std::chrono::milliseconds max_put_wait, std::chrono::milliseconds put_idle = 30s)
      : test::CacheServer(cache::StoreOptions{.memory_budget_bytes = kBudget}, max_put_wait, put_idle) {}
};

rpc::Digest digest_of(uint8_t n) {
  rpc::Digest d{};
  d.fill(n);
  return d;
}

// A put sent by hand: its header and the first half of its bytes, then held until finish().
struct HeldPut {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::SegmentCache::Stub> stub;
  grpc::ClientContext ctx;
  v1::PutResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer;
  std::string bytes;
  HeldPut(const std::string& address, uint8_t n, size_t size)
      : channel(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        stub(v1::SegmentCache::NewStub(channel)), bytes(size, char(n)) {
    ctx.set_deadline(std::chrono::system_clock::now() + 30s);
    writer = stub->Put(&ctx, &resp);
    v1::PutRequest head;
    head.mutable_header()->mutable_key()->set_digest(rpc::digest_bytes(digest_of(n)));
    head.mutable_header()->mutable_key()->add_token_ids(n);
    head.mutable_header()->set_total_bytes(bytes.size());
    head.mutable_header()->set_checksum(rpc::checksum64(bytes));
    REQUIRE(writer->Write(head));
    v1::PutRequest part;
    part.set_data(bytes.substr(0, bytes.size() / 2));
    REQUIRE(writer->Write(part));
  }
  grpc::Status finish() {
    v1::PutRequest part;
    part.set_data(bytes.substr(bytes.size() / 2));
    REQUIRE(writer->Write(part));
    writer->WritesDone();
    return writer->Finish();
  }
};

void wait_receiving(const cache::SegmentCacheService& s, uint64_t bytes) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (s.receiving_bytes() != bytes && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  REQUIRE(s.receiving_bytes() == bytes);
}

void wait_waiting(const cache::SegmentCacheService& s, size_t puts) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (s.waiting_puts() != puts && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  REQUIRE(s.waiting_puts() == puts);
}

void put_entry(const cache::SegmentCacheClient& client, uint8_t n, size_t size) {
  const std::string b(size, char(n));
  const std::vector<int32_t> ids{n};
  client.put(cache::CacheKey{digest_of(n), ids}, b);
}

// The put of entry n (size bytes) fails with `code`, its message containing every one of `words`.
void put_refused(const cache::SegmentCacheClient& client, uint8_t n, size_t size, grpc::StatusCode code,
                 std::initializer_list<const char*> words = {}) {
  try {
    put_entry(client, n, size);
    FAIL("the put of entry " << int(n) << " was not refused");
  } catch (const rpc::RpcError& e) {
    CHECK(e.code() == code);
    for (const char* w : words) CHECK_THAT(e.what(), Catch::Contains(w));
  }
}

}  // namespace

TEST_CASE("put admission: a put past the receive budget waits for the put in flight, then is stored, later puts "
          "wait in line behind it, and one that would take the waiting bytes past the budget is refused at once",
          "[put_admission]") {
  CacheServer cache(30s);
  HeldPut first(cache.address(), 1, kEntry);
  wait_receiving(cache.service, kEntry);

  cache::SegmentCacheClient client({cache.address()}, {.timeout = 20s});
  auto second = std::async(std::launch::async, [&] { put_entry(client, 2, kEntry); });
  // It is not admitted beside the first (600 + 600 KiB > 1 MiB): it waits, counted nowhere.
  CHECK(second.wait_for(300ms) == std::future_status::timeout);
  CHECK(cache.service.receiving_bytes() == kEntry);
  // A small put that would fit beside the first waits in line behind the second (arrival order: a large put is not
  // passed forever by small ones).
  auto third = std::async(std::launch::async, [&] { put_entry(client, 3, 1000); });
  CHECK(third.wait_for(300ms) == std::future_status::timeout);
  // A put whose bytes with the waiting ones' would pass the budget (600 KiB + 1000 + 600 KiB): refused at once.
  const auto t0 = std::chrono::steady_clock::now();
  put_refused(client, 4, kEntry, grpc::StatusCode::RESOURCE_EXHAUSTED, {"already waiting", "retry later"});
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);

  REQUIRE(first.finish().ok());
  REQUIRE(second.wait_for(20s) == std::future_status::ready);
  REQUIRE(third.wait_for(20s) == std::future_status::ready);
  second.get();  // throw if the put failed
  third.get();
  wait_receiving(cache.service, 0);
  const auto stats = cache.store.stats();
  CHECK(stats.puts == 3);  // (the memory tier then holds what fits of them)
  CHECK(stats.rejected_puts == 1);
}

TEST_CASE("put admission: a put that finds no room within max_put_wait is refused, and one whose caller gives up "
          "while waiting leaves no bytes counted",
          "[put_admission]") {
  CacheServer cache(400ms);
  HeldPut first(cache.address(), 1, kEntry);
  wait_receiving(cache.service, kEntry);

  cache::SegmentCacheClient patient({cache.address()}, {.timeout = 20s});
  const auto t0 = std::chrono::steady_clock::now();
  put_refused(patient, 2, kEntry, grpc::StatusCode::RESOURCE_EXHAUSTED, {"retry later", "memory budget"});
  CHECK(std::chrono::steady_clock::now() - t0 >= 400ms);
  CHECK(cache.store.stats().rejected_puts == 1);

  cache::SegmentCacheClient hasty({cache.address()}, {.timeout = 150ms, .put_wait = 0ms});
  put_refused(hasty, 4, kEntry, grpc::StatusCode::DEADLINE_EXCEEDED);
  CHECK(cache.service.receiving_bytes() == kEntry);
  // The server's deadline of that call is the client's plus the header's transit: let it pass before room frees, so
  // that what this checks is that a put past its deadline is never admitted.
  std::this_thread::sleep_for(200ms);

  REQUIRE(first.finish().ok());
  wait_receiving(cache.service, 0);
  put_entry(patient, 2, kEntry);  // room again: stored at once
  const auto stats = cache.store.stats();
  CHECK(stats.puts == 2);  // the first and the last: neither refused put was stored
  CHECK(stats.rejected_puts == 2);  // the refused one and the one whose caller gave up
}

TEST_CASE("put admission: a sender that stops sending in the middle of a put is cancelled after put_idle, and the "
          "put waiting for its room is then stored",
          "[put_admission]") {
  CacheServer cache(30s, 300ms);
  HeldPut stalled(cache.address(), 1, kEntry);  // its header and half its bytes, then nothing
  wait_receiving(cache.service, kEntry);
  cache::SegmentCacheClient client({cache.address()}, {.timeout = 20s});
  const auto t0 = std::chrono::steady_clock::now();
  auto waiting = std::async(std::launch::async, [&] { put_entry(client, 2, kEntry); });
  // The waiting put is admitted once the watchdog cancels the stalled one (300 ms without bytes, checked every 75).
  REQUIRE(waiting.wait_for(10s) == std::future_status::ready);
  waiting.get();  // throw if the put failed
  CHECK(std::chrono::steady_clock::now() - t0 >= 200ms);
  wait_receiving(cache.service, 0);
  stalled.writer->WritesDone();
  const grpc::Status st = stalled.writer->Finish();
  CHECK(st.error_code() == grpc::StatusCode::CANCELLED);
  const auto stats = cache.store.stats();
  CHECK(stats.puts == 1);           // the waiting one; the stalled one was not stored
  CHECK(stats.rejected_puts == 1);  // the cancelled one
}

TEST_CASE("put admission: a put that keeps sending, longer than put_idle in total, is not cancelled",
          "[put_admission]") {
  CacheServer cache(30s, 600ms);
  HeldPut slow(cache.address(), 1, kEntry);  // its header and the first half at once
  wait_receiving(cache.service, kEntry);
  // The second half in three parts 250 ms apart: 750 ms from header to end, never 600 ms without bytes.
  const size_t half = slow.bytes.size() / 2, third = (slow.bytes.size() - half) / 3;
  for (int i = 0; i < 3; ++i) {
    std::this_thread::sleep_for(250ms);
    v1::PutRequest part;
    const size_t from = half + i * third;
    part.set_data(slow.bytes.substr(from, i < 2 ? third : std::string::npos));
    REQUIRE(slow.writer->Write(part));
  }
  slow.writer->WritesDone();
  REQUIRE(slow.writer->Finish().ok());
  wait_receiving(cache.service, 0);
  CHECK(cache.store.stats().puts == 1);
  CHECK(cache.store.stats().rejected_puts == 0);
}

TEST_CASE("put admission: a caller that opens a put and never sends its header is cancelled after put_idle",
          "[put_admission]") {
  CacheServer cache(30s, 300ms);
  auto channel = grpc::CreateChannel(cache.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::SegmentCache::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 30s);
  v1::PutResponse resp;
  auto writer = stub->Put(&ctx, &resp);
  // Counted as a refused put once the watchdog cancels it (300 ms without a message, checked every 75 ms).
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (cache.store.stats().rejected_puts == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(10ms);
  CHECK(cache.store.stats().rejected_puts == 1);
  writer->WritesDone();
  CHECK(writer->Finish().error_code() == grpc::StatusCode::CANCELLED);
  CHECK(cache.service.receiving_bytes() == 0);
  CHECK(cache.store.stats().puts == 0);
}

TEST_CASE("cache client deadlines: timeout + bytes / transfer_rate, rounded up to the millisecond", "[put_admission]") {
  cache::SegmentCacheClient c({}, {.timeout = 5000ms, .transfer_rate = 100'000'000});
  CHECK(c.transfer_timeout(0) == 5000ms);
  CHECK(c.transfer_timeout(1) == 5001ms);              // 0.00001 ms, rounded up
  CHECK(c.transfer_timeout(280'000'000) == 7800ms);    // a 280 MB entry: 2.8 s at 100 MB/s
  CHECK(c.transfer_timeout(280'000'001) == 7801ms);
  // No overflow at the largest sizes: capped at 2^40 ms.
  CHECK(c.transfer_timeout(UINT64_MAX) == 5000ms + std::chrono::milliseconds(int64_t(1) << 40));
  CHECK_THROWS_AS(cache::SegmentCacheClient({}, {.transfer_rate = 0}), std::invalid_argument);
}

TEST_CASE("put admission, client side: a put that waits at the cache longer than the client's base timeout is stored "
          "(its deadline allows put_wait), and without put_wait it gives up",
          "[put_admission]") {
  CacheServer cache(30s);
  HeldPut first(cache.address(), 1, kEntry);
  wait_receiving(cache.service, kEntry);
  // Base timeout 200 ms: the wait for room below (about 700 ms) is longer; put_wait covers it.
  cache::SegmentCacheClient client({cache.address()}, {.timeout = 200ms, .put_wait = 10s});
  auto waiting = std::async(std::launch::async, [&] { put_entry(client, 2, kEntry); });
  wait_waiting(cache.service, 1);                                 // waiting at the cache for room
  CHECK(waiting.wait_for(700ms) == std::future_status::timeout);  // still waiting, past 200 ms
  REQUIRE(first.finish().ok());
  REQUIRE(waiting.wait_for(10s) == std::future_status::ready);
  waiting.get();  // throw if the put failed
  wait_receiving(cache.service, 0);
  CHECK(cache.store.stats().puts == 2);

  // The same wait with put_wait 0: the client's deadline (200 ms + its bytes at 100 MB/s) passes first.
  HeldPut third(cache.address(), 3, kEntry);
  wait_receiving(cache.service, kEntry);
  cache::SegmentCacheClient hasty({cache.address()}, {.timeout = 200ms, .put_wait = 0ms});
  put_refused(hasty, 4, kEntry, grpc::StatusCode::DEADLINE_EXCEEDED);
  REQUIRE(third.finish().ok());
}

TEST_CASE("put admission, client side: a put waiting for room is cancelled by PutCancel from another thread, one "
          "cancelled before it starts ends at once, and AsyncCachePutter's shutdown cancels its put in flight",
          "[put_admission]") {
  CacheServer cache(30s);
  HeldPut first(cache.address(), 1, kEntry);
  wait_receiving(cache.service, kEntry);
  cache::SegmentCacheClient client({cache.address()}, {.timeout = 20s});
  const std::string bytes(kEntry, char(2));
  const std::vector<int32_t> ids{2};
  {
    cache::PutCancel cancel;
    auto waiting =
        std::async(std::launch::async, [&] { client.put(cache::CacheKey{digest_of(2), ids}, bytes, {}, &cancel); });
    wait_waiting(cache.service, 1);  // waiting for room
    CHECK(waiting.wait_for(100ms) == std::future_status::timeout);
    const auto t0 = std::chrono::steady_clock::now();
    cancel.cancel();
    REQUIRE(waiting.wait_for(5s) == std::future_status::ready);
    CHECK(std::chrono::steady_clock::now() - t0 < 2s);
    try {
      waiting.get();
      FAIL("the cancelled put succeeded");
    } catch (const rpc::RpcError& e) {
      CHECK(e.code() == grpc::StatusCode::CANCELLED);
    }
    // Cancelled before the call: it ends at once, CANCELLED.
    const auto t1 = std::chrono::steady_clock::now();
    try {
      client.put(cache::CacheKey{digest_of(2), ids}, bytes, {}, &cancel);
      FAIL("a put after cancel() succeeded");
    } catch (const rpc::RpcError& e) {
      CHECK(e.code() == grpc::StatusCode::CANCELLED);
    }
    CHECK(std::chrono::steady_clock::now() - t1 < 2s);
  }
  wait_waiting(cache.service, 0);  // the server saw both cancels (none of them left waiting)
  {
    std::atomic<int> done_calls{0}, stored_calls{0};
    auto putter = std::make_unique<cache::AsyncCachePutter>(client, uint64_t(64) << 20);
    auto entry = std::make_shared<const std::string>(kEntry, char(5));
    REQUIRE(putter->enqueue(digest_of(5), {5}, entry, "test", [&](bool ok) {
      ++done_calls;
      stored_calls += ok;
    }));
    wait_waiting(cache.service, 1);  // its put is in flight, waiting at the cache for room
    const auto t0 = std::chrono::steady_clock::now();
    putter.reset();  // (the client's deadline would be 20 s + 30 s of put_wait away)
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
    CHECK(done_calls == 1);
    CHECK(stored_calls == 0);
    wait_waiting(cache.service, 0);
  }
  REQUIRE(first.finish().ok());
  wait_receiving(cache.service, 0);
  CHECK(cache.store.stats().puts == 1);  // the held one alone
}

namespace {
// Parses `args` (after a program name) into a fresh CLI::App with the workers' cache client flags over `o`.
void parse_cache_flags(hypic::cache::SegmentCacheClient::Options& o, std::vector<std::string> args) {
  CLI::App app{"worker"};
  hypic::cache::add_cache_client_flags(app, o);
  std::vector<const char*> argv{"worker"};
  for (const auto& a : args) argv.push_back(a.c_str());
  app.parse(int(argv.size()), argv.data());
}
}  // namespace

TEST_CASE("cache client flags: the workers' --cache-timeout-ms, --cache-transfer-rate and --cache-put-wait-ms set the "
          "client's deadlines, out-of-range values are refused",
          "[put_admission]") {
  using std::chrono::milliseconds;
  using Options = hypic::cache::SegmentCacheClient::Options;
  {
    Options o;
    parse_cache_flags(o, {});
    CHECK(o.timeout == milliseconds(5000));
    CHECK(o.transfer_rate == 100'000'000u);
    CHECK(o.put_wait == milliseconds(30000));
    CHECK(o.connections == 1);
  }
  {
    Options o;
    parse_cache_flags(o, {"--cache-connections", "4"});
    CHECK(o.connections == 4);
  }
  {
    Options o;
    parse_cache_flags(o, {"--cache-timeout-ms", "250", "--cache-transfer-rate", "1GB", "--cache-put-wait-ms", "120000"});
    CHECK(o.timeout == milliseconds(250));
    CHECK(o.transfer_rate == 1'000'000'000u);
    CHECK(o.put_wait == milliseconds(120000));
    // A 280 MB entry at 1 GB/s: 250 + 280 ms.
    const hypic::cache::SegmentCacheClient client({}, o);
    CHECK(client.transfer_timeout(280'000'000) == milliseconds(530));
  }
  {
    Options o;
    parse_cache_flags(o, {"--cache-put-wait-ms", "0", "--cache-transfer-rate", "100000"});
    CHECK(o.put_wait == milliseconds(0));
    CHECK(o.transfer_rate == 100'000u);
  }
  {  // decimal rates and units (1000-based), zero-padded milliseconds read in base 10
    Options o;
    parse_cache_flags(o, {"--cache-transfer-rate", "12.5MB", "--cache-timeout-ms", "08", "--cache-put-wait-ms", "060000"});
    CHECK(o.transfer_rate == 12'500'000u);
    CHECK(o.timeout == milliseconds(8));
    CHECK(o.put_wait == milliseconds(60000));
    parse_cache_flags(o, {"--cache-transfer-rate", "100MB/s"});
    CHECK(o.transfer_rate == 100'000'000u);
    parse_cache_flags(o, {"--cache-transfer-rate", "2k"});
    CHECK(o.transfer_rate == 2000u);
    parse_cache_flags(o, {"--cache-transfer-rate", "1.5G"});
    CHECK(o.transfer_rate == 1'500'000'000u);
  }
  for (const std::vector<std::string>& bad :
       std::vector<std::vector<std::string>>{{"--cache-transfer-rate", "0"},
                                             {"--cache-transfer-rate", "-1"},
                                             {"--cache-transfer-rate", "MB"},
                                             {"--cache-transfer-rate", "1GiB"},
                                             {"--cache-transfer-rate", "1e9"},
                                             {"--cache-transfer-rate", "0.4"},
                                             {"--cache-transfer-rate", "18446744073709551616"},
                                             {"--cache-transfer-rate", "2000000T"},
                                             {"--cache-timeout-ms", "0"},
                                             {"--cache-timeout-ms", "0x10"},
                                             {"--cache-timeout-ms", "1.5"},
                                             {"--cache-put-wait-ms", "-1"},
                                             {"--cache-put-wait-ms", "3600001"},
                                             {"--cache-put-wait-ms", ""},
                                             {"--cache-timeout-ms", "soon"},
                                             {"--cache-connections", "0"},
                                             {"--cache-connections", "65"},
                                             {"--cache-connections", "two"}}) {
    INFO(bad[0] << " " << bad[1]);
    Options o;
    CHECK_THROWS_AS(parse_cache_flags(o, bad), CLI::ParseError);
    CHECK(o.put_wait == milliseconds(30000));  // nothing written on a refused value
    CHECK(o.timeout == milliseconds(5000));
    CHECK(o.transfer_rate == 100'000'000u);
    CHECK(o.connections == 1);
  }
}

TEST_CASE("cache client connections: calls take a replica's connections in turn, every entry whole", "[put_admission]") {
  CacheServer server(30s);
  hypic::cache::SegmentCacheClient::Options opt;
  opt.connections = 0;
  CHECK_THROWS_AS(hypic::cache::SegmentCacheClient({server.address()}, opt), std::invalid_argument);
  opt.connections = 3;
  const hypic::cache::SegmentCacheClient client({server.address()}, opt);
  std::vector<int32_t> ids{7};
  for (uint8_t n = 1; n <= 7; ++n) {  // more calls than connections: each one's put and get on its own turn
    const std::string bytes(100'000 + n, char('a' + n));
    client.put({digest_of(n), ids}, bytes);
    const auto got = client.get({digest_of(n), ids});
    REQUIRE(got.has_value());
    CHECK(*got == bytes);
  }
  CHECK(client.stats(0).memory_entries() == 7);
}
