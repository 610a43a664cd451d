// Entries shared through sealed memfds (proto/rpc/shared_memory.h) and the segment cache's Get over them
// (segment_cache.proto accept_shared_memory; SegmentStore's shared_memory_min_bytes; SegmentCacheClient's
// shared_memory): the bytes a reader maps are the bytes put, they cannot be changed once sealed, a reference that does
// not name what it claims is refused with the right failure, and the client falls back to the stream (remembering a
// replica it cannot reach) with the same checksum and MAC checks. A real gRPC server on loopback; the peer is this
// process, through its own /proc entries, as a process on the same host would reach them.
#include <catch2/catch.hpp>

#include <atomic>
#include <filesystem>
#include <cerrno>
#include <random>
#include <thread>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/mman.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include "proto/rpc/chunks.h"
#include "proto/rpc/entry_mac.h"
#include "proto/rpc/metrics.h"
#include "proto/rpc/shared_memory.h"
#include "proto/rpc/status.h"
#include "segment_cache/client.h"
#include "segment_cache/service.h"
#include "segment_cache/shared_memory_proto.h"
#include "tests/unit/cluster/cache_fixture.h"

using namespace hypic;
using namespace std::chrono_literals;

namespace {

std::string random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = char(rng());
  return s;
}

std::shared_ptr<const rpc::SharedBytes> sealed(const std::string& bytes) {
  std::string why;
  auto w = rpc::SealedMemfdWriter::create(bytes.size(), &why);
  REQUIRE(w);
  w->append(std::string_view(bytes).substr(0, bytes.size() / 3));  // (in two pieces)
  w->append(std::string_view(bytes).substr(bytes.size() / 3));
  return w->seal();
}

rpc::Digest digest_of(uint8_t n) {
  rpc::Digest d{};
  d.fill(n);
  return d;
}

double fetched(const char* transport) {
  return rpc::MetricsRegistry::global().counter("hypic:cache_fetched_total", "", {{"transport", transport}}).value();
}

}  // namespace

TEST_CASE("sealed memfd: a peer maps exactly the bytes written, and nobody can change them after the seal",
          "[shared_memory]") {
  const std::string bytes = random_bytes(3 * 1000 * 1000 + 7, 1);  // (no multiple of a page)
  auto held = sealed(bytes);
  CHECK(held->shared());
  CHECK(held->view() == bytes);
  const rpc::MemfdRef ref = held->memfd_ref();
  CHECK(ref.pid == uint32_t(::getpid()));
  CHECK(ref.size == bytes.size());
  rpc::PeerMemfd::Failure failure{};
  std::string why;
  auto peer = rpc::PeerMemfd::open(ref, &failure, &why);
  INFO(why);
  REQUIRE(peer);
  CHECK(failure == rpc::PeerMemfd::Failure::None);
  CHECK(peer->view() == bytes);
  // Reopened for writing through /proc, the memfd still refuses writes and resizing: the seals hold for everyone.
  const int w = ::open(("/proc/self/fd/" + std::to_string(ref.fd)).c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(w >= 0);
  CHECK(::pwrite(w, "x", 1, 0) == -1);
  CHECK(errno == EPERM);
  CHECK(::ftruncate(w, 10) == -1);
  CHECK(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, w, 0) == MAP_FAILED);
  ::close(w);
  // The creator lets go: the reader's mapping stays whole (the kernel keeps the pages while it is mapped).
  held.reset();
  CHECK(peer->view() == bytes);
  // ... but the reference names nothing any more.
  auto again = rpc::PeerMemfd::open(ref, &failure, &why);
  CHECK_FALSE(again);
  CHECK(failure == rpc::PeerMemfd::Failure::Gone);
}

TEST_CASE("sealed memfd: references that do not name what they claim are refused with the failure that says what to "
          "do", "[shared_memory]") {
  const std::string bytes = random_bytes(100000, 2);
  auto held = sealed(bytes);
  auto other = sealed(random_bytes(100000, 3));
  const rpc::MemfdRef ref = held->memfd_ref();
  rpc::PeerMemfd::Failure failure{};
  std::string why;
  auto open = [&](rpc::MemfdRef r) { return rpc::PeerMemfd::open(r, &failure, &why); };
  SECTION("the anchor is not there: another host or PID namespace") {
    auto r = ref;
    r.anchor_fd = ref.fd;  // an entry's memfd, not the anchor
    CHECK_FALSE(open(r));
    CHECK(failure == rpc::PeerMemfd::Failure::Unreachable);
    r = ref;
    r.pid = 0x7ffffff0;  // no such process here (exited, or elsewhere)
    CHECK_FALSE(open(r));
    CHECK(failure == rpc::PeerMemfd::Failure::NoProcess);
    r = ref;
    r.anchor_name = "hypic-0123456789abcdef-anchor";  // another holder's anchor: not this process's
    CHECK_FALSE(open(r));
    CHECK(failure == rpc::PeerMemfd::Failure::Unreachable);
  }
  SECTION("the descriptor holds another memfd of the creator: released and reused") {
    auto r = ref;
    r.fd = other->memfd_ref().fd;
    CHECK_FALSE(open(r));
    CHECK(failure == rpc::PeerMemfd::Failure::Gone);
    CHECK(why.find("no longer") != std::string::npos);
  }
  SECTION("the descriptor holds a memfd of that name but another inode: released, and the number reused") {
    auto r = ref;
    r.inode = ref.inode + 1;
    CHECK_FALSE(open(r));
    CHECK(failure == rpc::PeerMemfd::Failure::Gone);
    CHECK(why.find("inode") != std::string::npos);
  }
  SECTION("the size differs from the announced one") {
    auto r = ref;
    r.size = bytes.size() + 1;
    CHECK_FALSE(open(r));
    CHECK(failure == rpc::PeerMemfd::Failure::Invalid);
  }
  // A memfd of this holder's (its name prefix, number `n`) of the announced size: its bytes written or not, the
  // seals given; the reference naming it (inode not checked).
  auto holder_memfd = [&](const char* n, bool write, unsigned seals, int* fd) {
    auto r = ref;
    r.name = ref.name.substr(0, ref.name.rfind('-')) + "-" + n;
    r.inode = 0;
    *fd = ::memfd_create(r.name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(*fd >= 0);
    REQUIRE(::ftruncate(*fd, off_t(bytes.size())) == 0);
    if (write) REQUIRE(::pwrite(*fd, bytes.data(), bytes.size(), 0) == ssize_t(bytes.size()));
    if (seals) REQUIRE(::fcntl(*fd, F_ADD_SEALS, seals) == 0);
    r.fd = *fd;
    return r;
  };
  SECTION("an unsealed memfd of the holder is refused: its bytes could change under the reader") {
    int fd = -1;
    CHECK_FALSE(open(holder_memfd("999998", true, 0, &fd)));
    CHECK(failure == rpc::PeerMemfd::Failure::Invalid);
    CHECK(why.find("not sealed") != std::string::npos);
    ::close(fd);
  }
  SECTION("a FIFO or a sparse memfd under a good name is refused, and opening it does not block") {
    const auto fifo = std::filesystem::temp_directory_path() / ("hypic-shm-fifo-" + std::to_string(::getpid()));
    std::filesystem::remove(fifo);
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    const int rd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);  // (no writer: a blocking open for reading would hang)
    REQUIRE(rd >= 0);
    auto r = ref;
    r.fd = rd;
    CHECK_FALSE(open(r));
    CHECK(failure == rpc::PeerMemfd::Failure::Gone);
    ::close(rd);
    std::filesystem::remove(fifo);
    // A memfd of the holder's, sealed, of the announced size, with no page written.
    int sparse = -1;
    r = holder_memfd("999999", false, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, &sparse);
    CHECK_FALSE(open(r));
    CHECK(failure == rpc::PeerMemfd::Failure::Invalid);
    CHECK(why.find("sparse") != std::string::npos);
    ::close(sparse);
  }
  SECTION("a malformed reference") {
    for (const std::string bad : {"noname", "hypic-0123456789abcdef/../1", "../../etc/passwd", ""}) {
      auto r = ref;
      r.name = bad;
      CHECK_FALSE(open(r));
      CHECK(failure == rpc::PeerMemfd::Failure::Invalid);
      r = ref;
      r.anchor_name = bad;
      CHECK_FALSE(open(r));
      CHECK(failure == rpc::PeerMemfd::Failure::Invalid);
    }
    auto r = ref;
    r.anchor_name = ref.name;  // an entry's name where the anchor's belongs
    CHECK_FALSE(open(r));
    CHECK(failure == rpc::PeerMemfd::Failure::Invalid);
    r = ref;
    r.fd = -1;
    CHECK_FALSE(open(r));
    CHECK(failure == rpc::PeerMemfd::Failure::Invalid);
  }
}

TEST_CASE("sealed memfd writer: the announced size is kept exactly", "[shared_memory]") {
  std::string why;
  auto w = rpc::SealedMemfdWriter::create(10, &why);
  REQUIRE(w);
  w->append("12345");
  CHECK_THROWS_AS(w->append("123456"), std::logic_error);  // past the size: nothing written
  CHECK(w->written() == 5);
  CHECK_THROWS_AS(w->seal(), std::logic_error);  // short
  w->append("67890");
  CHECK(w->seal()->view() == "1234567890");
  CHECK_FALSE(rpc::SealedMemfdWriter::create(0, &why));
  CHECK_FALSE(why.empty());
  CHECK_FALSE(rpc::SharedBytes::heap("abc")->shared());
  CHECK(rpc::SharedBytes::heap("abc")->memfd_ref().fd == -1);
}

TEST_CASE("EntryMacCheck: borrowed pieces verify as handed-over ones do", "[shared_memory]") {
  const auto keys = rpc::EntryMacKeys::of({std::string(32, 'k')});
  const std::string bytes = random_bytes(1 << 20, 4);
  const std::vector<int32_t> ids = {1, 2, 3};
  const std::string mac = keys.sign(digest_of(1), ids, bytes);
  for (const bool borrowed : {false, true}) {
    for (const bool right : {true, false}) {
      rpc::EntryMacCheck check(keys, digest_of(right ? 1 : 2), ids, bytes.size(), rpc::EntryMacKeys::head_of(mac));
      for (size_t off = 0; off < bytes.size(); off += 300000) {
        const std::string_view piece = std::string_view(bytes).substr(off, 300000);
        if (borrowed) check.update_borrowed(piece);
        else check.update(std::string(piece));
      }
      CHECK(check.verify(mac) == right);
    }
  }
}

TEST_CASE("segment store: entries from shared_memory_min_bytes up are held in sealed memfds, in memory and when "
          "promoted from disk", "[shared_memory]") {
  const auto dir = std::filesystem::temp_directory_path() / ("hypic-shm-store-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  struct Cleanup {
    std::filesystem::path d;
    ~Cleanup() { std::filesystem::remove_all(d); }
  } cleanup{dir};
  cache::SegmentStore store(cache::StoreOptions{.memory_budget_bytes = 250000, .disk_dir = dir,
                                                .shared_memory_min_bytes = 1000});
  const std::string big = random_bytes(200000, 5), small = random_bytes(999, 6), big2 = random_bytes(200000, 7);
  store.put(digest_of(1), {1}, big, rpc::checksum64(big));
  store.put(digest_of(2), {2}, small, rpc::checksum64(small));
  {
    auto h = store.get(digest_of(1), std::vector<int32_t>{1});
    REQUIRE(h);
    CHECK(h->bytes() == big);
    const auto ref = h->memfd_ref();
    REQUIRE(ref.fd >= 0);
    rpc::PeerMemfd::Failure failure{};
    std::string why;
    auto peer = rpc::PeerMemfd::open(ref, &failure, &why);
    REQUIRE(peer);
    CHECK(peer->view() == big);
    auto s = store.get(digest_of(2), std::vector<int32_t>{2});
    REQUIRE(s);
    CHECK(s->bytes() == small);
    CHECK(s->memfd_ref().fd == -1);  // below the threshold: on the heap
  }
  store.put(digest_of(3), {3}, big2, rpc::checksum64(big2));  // spills 1 to disk
  {
    auto h3 = store.get(digest_of(3), std::vector<int32_t>{3});  // pinned: no room to promote 1 while held
    auto h1 = store.get(digest_of(1), std::vector<int32_t>{1});
    REQUIRE(h1);
    CHECK(h1->bytes() == big);
    CHECK(h1->memfd_ref().fd == -1);  // read for this get alone: on the heap, streamed (a memfd would close at once)
    CHECK(store.stats().promotions == 0);
  }
  auto h1 = store.get(digest_of(1), std::vector<int32_t>{1});   // read from disk, promoted (3 spills)
  REQUIRE(h1);
  CHECK(h1->tier() == cache::Tier::Disk);
  CHECK(h1->bytes() == big);
  CHECK(h1->memfd_ref().fd >= 0);
  CHECK(store.stats().promotions == 1);
}

namespace {

// A segment cache holding entries of `min_shared` bytes and up in sealed memfds.
struct CacheServer : test::CacheServer {
  explicit CacheServer(uint64_t min_shared)
      : test::CacheServer(
            cache::StoreOptions{.memory_budget_bytes = 64 << 20, .shared_memory_min_bytes = min_shared}) {}
};

// What a client's get_stream hands its consumer, assembled.
std::optional<std::string> fetch(const cache::SegmentCacheClient& client, const rpc::Digest& d,
                                 const std::vector<int32_t>& ids, cache::FetchReport* report = nullptr) {
  std::string got;
  uint64_t announced = 0;
  const bool found = client.get_stream(
      {d, ids}, [&](uint64_t total) { announced = total; }, [&](std::string_view c) { got.append(c); }, nullptr, 0,
      report);
  if (!found) return std::nullopt;
  CHECK(announced == got.size());
  return got;
}

}  // namespace

TEST_CASE("segment cache over shared memory: a client on this host maps what was put, byte for byte, and one that "
          "does not ask, or an entry on the heap, is streamed", "[shared_memory]") {
  CacheServer cache(1000);
  const std::string big = random_bytes(5 * 1000 * 1000 + 3, 8), small = random_bytes(500, 9);
  const std::vector<int32_t> ids_big = {7, 8, 9}, ids_small = {4};
  cache::SegmentCacheClient client({cache.address()});
  client.put({digest_of(1), ids_big}, big);
  client.put({digest_of(2), ids_small}, small);
  const double shm0 = fetched("shared_memory"), grpc0 = fetched("grpc");
  cache::FetchReport how;
  CHECK(fetch(client, digest_of(1), ids_big, &how) == big);
  CHECK(fetched("shared_memory") == shm0 + 1);
  CHECK(how.mapped);
  CHECK(how.answer_ms > 0);
  CHECK(how.read_ms > 0);
  CHECK(fetch(client, digest_of(2), ids_small, &how) == small);  // on the heap: streamed
  CHECK(fetched("grpc") == grpc0 + 1);
  CHECK_FALSE(how.mapped);
  CHECK(how.map_ms == 0);
  CHECK(client.get({digest_of(1), ids_big}) == big);
  CHECK(fetched("shared_memory") == shm0 + 2);
  cache::SegmentCacheClient::Options off;
  off.shared_memory = false;
  cache::SegmentCacheClient streamed({cache.address()}, off);
  CHECK(fetch(streamed, digest_of(1), ids_big) == big);
  CHECK(fetched("grpc") == grpc0 + 2);
  CHECK(fetched("shared_memory") == shm0 + 2);
  // The token-id check happens before any memfd is handed out.
  CHECK_FALSE(fetch(client, digest_of(1), std::vector<int32_t>{7, 8}));
  // An entry the cache dropped meanwhile is a miss, as over the stream.
  CHECK(client.erase(digest_of(1)));
  CHECK_FALSE(fetch(client, digest_of(1), ids_big));
}

TEST_CASE("segment cache over shared memory: a forged MAC is refused and the entry deleted, as over the stream",
          "[shared_memory][hostile]") {
  const auto keys = rpc::EntryMacKeys::of({std::string(32, 'k')});
  rpc::configure_entry_mac(keys);
  struct Reset {
    ~Reset() { rpc::configure_entry_mac(rpc::EntryMacKeys{}); }
  } reset;
  CacheServer cache(1000);
  const std::string bytes = random_bytes(2 * 1000 * 1000, 10);
  const std::vector<int32_t> ids = {5, 6};
  cache::SegmentCacheClient client({cache.address()});
  client.put({digest_of(1), ids}, bytes);  // signed with the key
  client.put({digest_of(2), ids}, bytes, keys.sign(digest_of(1), ids, bytes));  // another digest's MAC: relabelled
  const double shm0 = fetched("shared_memory");
  CHECK(fetch(client, digest_of(1), ids) == bytes);
  CHECK(fetched("shared_memory") == shm0 + 1);
  try {
    (void)fetch(client, digest_of(2), ids);
    FAIL("a relabelled entry was accepted");
  } catch (const rpc::RpcError& e) {
    CHECK(e.code() == grpc::StatusCode::DATA_LOSS);
    CHECK(std::string(e.what()).find("MAC does not verify") != std::string::npos);
  }
  CHECK_FALSE(cache.store.get(digest_of(2), std::nullopt));  // deleted from the cache
  // A delete of the entry read keeps one put since (another checksum or MAC): a replacement is not lost.
  client.put({digest_of(3), ids}, bytes);
  std::string stored_mac;
  {
    const auto held = cache.store.get(digest_of(3), std::nullopt);
    REQUIRE(held);
    stored_mac = held->mac();
  }
  const uint64_t sum = rpc::checksum64(bytes);
  CHECK_FALSE(client.erase_read(digest_of(3), sum ^ 1, stored_mac, false));
  CHECK_FALSE(client.erase_read(digest_of(3), sum, keys.sign(digest_of(3), ids, bytes), false));  // another nonce
  CHECK(cache.store.get(digest_of(3), std::nullopt));
  const uint64_t corruptions0 = cache.store.stats().corruptions;
  CHECK(client.erase_read(digest_of(3), sum, stored_mac, true));
  CHECK_FALSE(cache.store.get(digest_of(3), std::nullopt));
  CHECK(cache.store.stats().corruptions == corruptions0 + 1);
}

namespace {

// A SegmentCache whose Get answers a request accepting shared memory with a reference it chooses (one that cannot
// be opened here), and streams the entry to one that does not; counts both kinds.
class FakeCache final : public v1::SegmentCache::Service {
 public:
  std::string bytes;
  std::function<rpc::MemfdRef()> ref;
  std::atomic<int> asked_shared{0}, asked_plain{0};
  // Put: a shared-memory put is refused with FAILED_PRECONDITION and this hypic-shared-memory value; a streamed one
  // is read whole and stored in `put_bytes`.
  std::string put_refusal = "unreachable";
  std::atomic<int> put_shared{0}, put_plain{0};
  std::string put_bytes;
  std::atomic<int> deleted{0};
  v1::DeleteRequest last_delete;
  grpc::Status Delete(grpc::ServerContext*, const v1::DeleteRequest* req, v1::DeleteResponse* resp) override {
    ++deleted;
    last_delete = *req;
    resp->set_deleted(true);
    return grpc::Status::OK;
  }
  grpc::Status Put(grpc::ServerContext* ctx, grpc::ServerReader<v1::PutRequest>* r, v1::PutResponse*) override {
    v1::PutRequest m;
    if (!r->Read(&m)) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no header");
    if (m.header().has_shared_memory()) {
      ++put_shared;
      ctx->AddTrailingMetadata("hypic-shared-memory", put_refusal);
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "not taken (test)");
    }
    ++put_plain;
    put_bytes.clear();
    while (r->Read(&m)) put_bytes += m.data();
    return grpc::Status::OK;
  }
  grpc::Status Get(grpc::ServerContext*, const v1::GetRequest* req,
                   grpc::ServerWriter<v1::GetResponse>* w) override {
    v1::GetResponse head;
    auto* info = head.mutable_info();
    info->set_total_bytes(bytes.size());
    info->set_checksum(rpc::checksum64(bytes));
    info->mutable_token_ids()->CopyFrom(req->token_ids());
    if (req->accept_shared_memory()) {
      ++asked_shared;
      cache::to_proto(ref(), info->mutable_shared_memory());
      w->Write(head);
      return grpc::Status::OK;
    }
    ++asked_plain;
    w->Write(head);
    v1::GetResponse data;
    data.set_data(bytes);
    w->Write(data);
    return grpc::Status::OK;
  }
};

struct FakeServer {
  FakeCache fake;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  FakeServer() {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&fake);
    server = b.BuildAndStart();
    REQUIRE(server);
  }
  ~FakeServer() { server->Shutdown(std::chrono::system_clock::now() + 2s); }
};

}  // namespace

TEST_CASE("segment cache client: a replica whose memfds cannot be opened here is streamed from, and not asked for "
          "shared memory again, and one whose memfd was released is asked again next time", "[shared_memory]") {
  FakeServer s;
  s.fake.bytes = random_bytes(300000, 11);
  const std::vector<int32_t> ids = {1};
  cache::SegmentCacheClient client({"127.0.0.1:" + std::to_string(s.port)});
  SECTION("unreachable: another holder's anchor under this pid (another PID namespace)") {
    s.fake.ref = [] {
      return rpc::MemfdRef{uint32_t(::getpid()), 5, "hypic-0123456789abcdef-1", 300000, 4,
                           "hypic-0123456789abcdef-anchor"};
    };
    CHECK(fetch(client, digest_of(1), ids) == s.fake.bytes);
    CHECK(fetch(client, digest_of(1), ids) == s.fake.bytes);
    CHECK(s.fake.asked_shared == 1);  // once, then never again
    CHECK(s.fake.asked_plain == 2);
  }
  SECTION("no such process here: a holder that exited is asked again, three in a row mean another host") {
    s.fake.ref = [] {
      return rpc::MemfdRef{0x7ffffff0, 5, "hypic-0123456789abcdef-1", 300000, 4, "hypic-0123456789abcdef-anchor"};
    };
    for (int i = 0; i < 5; ++i) CHECK(fetch(client, digest_of(1), ids) == s.fake.bytes);
    CHECK(s.fake.asked_shared == 3);
    CHECK(s.fake.asked_plain == 5);
  }
  SECTION("gone: released between the answer and the open") {
    s.fake.ref = [] { return sealed(std::string(300000, 'x'))->memfd_ref(); };  // (closed when it returns)
    CHECK(fetch(client, digest_of(1), ids) == s.fake.bytes);
    CHECK(fetch(client, digest_of(1), ids) == s.fake.bytes);
    CHECK(s.fake.asked_shared == 2);  // asked each time: the creator is reachable
    CHECK(s.fake.asked_plain == 2);
  }
  SECTION("a mapped answer whose bytes are not the announced ones fails its checksum, and is deleted from the cache") {
    auto other = sealed(random_bytes(300000, 12));
    s.fake.ref = [&] { return other->memfd_ref(); };
    try {
      (void)fetch(client, digest_of(1), ids);
      FAIL("wrong bytes were accepted");
    } catch (const rpc::RpcError& e) {
      CHECK(e.code() == grpc::StatusCode::DATA_LOSS);
      CHECK_THAT(e.what(), Catch::Contains("failed its integrity check and was dropped from the cache"));
    }
    CHECK(s.fake.deleted == 1);
    // Only the entry read (its checksum and MAC as answered), reported corrupt.
    CHECK(s.fake.last_delete.has_if_checksum());
    CHECK(s.fake.last_delete.if_checksum() == rpc::checksum64(s.fake.bytes));
    CHECK(s.fake.last_delete.has_if_mac());
    CHECK(s.fake.last_delete.corrupt());
  }
}

TEST_CASE("segment cache client: a put the replica does not take as shared memory is streamed, and a replica that "
          "cannot open this process's memfds is not offered them again", "[shared_memory]") {
  FakeServer s;
  const std::string bytes = random_bytes(2 << 20, 13);
  const std::vector<int32_t> ids = {1};
  cache::SegmentCacheClient client({"127.0.0.1:" + std::to_string(s.port)});
  SECTION("unreachable") {
    client.put({digest_of(1), ids}, bytes);
    CHECK(s.fake.put_bytes == bytes);
    client.put({digest_of(2), ids}, bytes);
    CHECK(s.fake.put_shared == 1);
    CHECK(s.fake.put_plain == 2);
  }
  SECTION("declined: this one only") {
    s.fake.put_refusal = "declined";
    client.put({digest_of(1), ids}, bytes);
    client.put({digest_of(2), ids}, bytes);
    CHECK(s.fake.put_bytes == bytes);
    CHECK(s.fake.put_shared == 2);
    CHECK(s.fake.put_plain == 2);
  }
  SECTION("an entry below 1 MiB is streamed without asking") {
    client.put({digest_of(1), ids}, std::string_view(bytes).substr(0, (1 << 20) - 1));
    CHECK(s.fake.put_shared == 0);
    CHECK(s.fake.put_plain == 1);
  }
}

namespace {
double cache_puts(const char* transport) {
  return rpc::MetricsRegistry::global()
      .counter("hypic:cache_puts_received_total", "", {{"transport", transport}})
      .value();
}
}  // namespace

TEST_CASE("segment cache over shared memory: a large put hands over a sealed memfd the cache adopts, which outlives "
          "the sender's copy, and a cache without shared memory is streamed to", "[shared_memory]") {
  const std::string bytes = random_bytes(3 << 20, 14);
  const std::vector<int32_t> ids = {3, 4};
  SECTION("adopted") {
    CacheServer cache(1 << 20);
    cache::SegmentCacheClient client({cache.address()});
    const double shm0 = cache_puts("shared_memory"), grpc0 = cache_puts("grpc");
    CHECK_FALSE(client.put({digest_of(1), ids}, bytes));
    CHECK(cache_puts("shared_memory") == shm0 + 1);
    CHECK(cache_puts("grpc") == grpc0);
    auto h = cache.store.get(digest_of(1), ids);  // the sender's memfd is closed by now: the cache's copy is its own
    REQUIRE(h);
    CHECK(h->bytes() == bytes);
    CHECK(h->memfd_ref().fd >= 0);
    CHECK(fetch(client, digest_of(1), ids) == bytes);  // and handed on to readers
    CHECK(client.put({digest_of(1), ids}, bytes));      // replaced
  }
  SECTION("bytes the sender already holds in a sealed memfd are adopted as they are, heap ones copied into one") {
    CacheServer cache(1 << 20);
    cache::SegmentCacheClient client({cache.address()});
    REQUIRE(client.offers_shared_memory(digest_of(1)));
    std::string why;
    auto w = rpc::SealedMemfdWriter::create(bytes.size(), &why);
    REQUIRE(w);
    w->append(std::string_view(bytes).substr(0, 1000));
    w->append(std::string_view(bytes).substr(1000));
    const auto held = w->seal();
    REQUIRE(held->shared());
    const double shm0 = cache_puts("shared_memory");
    CHECK_FALSE(client.put({digest_of(1), ids}, *held));
    auto h = cache.store.get(digest_of(1), ids);
    REQUIRE(h);
    CHECK(h->bytes() == bytes);
    CHECK(h->memfd_ref().inode == held->inode());  // the same pages: no copy on either side
    const auto on_heap = rpc::SharedBytes::heap(std::make_shared<const std::string>(bytes));
    CHECK_FALSE(client.put({digest_of(2), ids}, *on_heap));
    auto h2 = cache.store.get(digest_of(2), ids);
    REQUIRE(h2);
    CHECK(h2->bytes() == bytes);
    CHECK(h2->memfd_ref().fd >= 0);
    CHECK(h2->memfd_ref().inode != held->inode());
    CHECK(cache_puts("shared_memory") == shm0 + 2);
  }
  SECTION("the cache runs without shared memory") {
    CacheServer cache(UINT64_MAX);
    cache::SegmentCacheClient client({cache.address()});
    const double shm0 = cache_puts("shared_memory"), grpc0 = cache_puts("grpc");
    client.put({digest_of(1), ids}, bytes);
    client.put({digest_of(2), ids}, bytes);
    CHECK(cache_puts("shared_memory") == shm0);
    CHECK(cache_puts("grpc") == grpc0 + 2);
    CHECK(cache.store.stats().rejected_puts == 1);  // offered once ("off"), then never
    auto h = cache.store.get(digest_of(2), ids);
    REQUIRE(h);
    CHECK(h->bytes() == bytes);
    CHECK(h->memfd_ref().fd == -1);
  }
}

namespace {

// A Put sent by hand whose header hands over the memfd `r` for digest_of(n) (total bytes, checksum as given); with
// `data`, one data message follows; with `cancel_after`, the sender gives up that long after its header instead of
// ending the stream. Returns the status and the trailing hypic-shared-memory value ("" without).
std::pair<grpc::Status, std::string> raw_shared_put(v1::SegmentCache::Stub& stub, const rpc::MemfdRef& r, uint8_t n,
                                                    uint64_t total, uint64_t checksum, bool data = false,
                                                    std::chrono::milliseconds cancel_after = 0ms) {
  grpc::ClientContext ctx;
  v1::PutResponse resp;
  auto w = stub.Put(&ctx, &resp);
  v1::PutRequest head;
  auto* h = head.mutable_header();
  h->mutable_key()->set_digest(rpc::digest_bytes(digest_of(n)));
  h->mutable_key()->add_token_ids(n);
  h->set_total_bytes(total);
  h->set_checksum(checksum);
  cache::to_proto(r, h->mutable_shared_memory());
  w->Write(head);
  if (data) {
    v1::PutRequest m;
    m.set_data("x");
    w->Write(m);
  }
  if (cancel_after.count() > 0) {
    std::this_thread::sleep_for(cancel_after);
    ctx.TryCancel();
  } else {
    w->WritesDone();
  }
  const grpc::Status st = w->Finish();
  const auto& md = ctx.GetServerTrailingMetadata();
  const auto it = md.find("hypic-shared-memory");
  return {st, it == md.end() ? std::string() : std::string(it->second.data(), it->second.size())};
}

}  // namespace

TEST_CASE("segment cache: a put whose memfd is not what its header announces is refused and stores nothing, and "
          "one it should not take is declined or refused with the reason", "[shared_memory][hostile]") {
  CacheServer cache(1 << 20);
  const std::string bytes = random_bytes(2 << 20, 15);
  const uint64_t sum = rpc::checksum64(bytes);
  auto held = sealed(bytes);
  const rpc::MemfdRef ref = held->memfd_ref();
  auto stub = v1::SegmentCache::NewStub(grpc::CreateChannel(cache.address(), grpc::InsecureChannelCredentials()));
  CHECK(raw_shared_put(*stub, ref, 9, bytes.size() + 1, sum).first.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(raw_shared_put(*stub, ref, 9, bytes.size(), sum ^ 1).first.error_code() == grpc::StatusCode::DATA_LOSS);
  CHECK(raw_shared_put(*stub, ref, 9, bytes.size(), sum, true).first.error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
  // A sender with no process here (another host or PID namespace): unreachable, nothing opened.
  const rpc::MemfdRef elsewhere{0x7ffffff0, 5, "hypic-0123456789abcdef-1", bytes.size(), 4,
                                "hypic-0123456789abcdef-anchor", 0};
  const auto [st, kind] = raw_shared_put(*stub, elsewhere, 8, bytes.size(), sum);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(kind == "unreachable");
  // A sender that gives up after its header: nothing is stored.
  CHECK(raw_shared_put(*stub, ref, 9, bytes.size(), sum, false, 200ms).first.error_code() ==
        grpc::StatusCode::CANCELLED);
  std::this_thread::sleep_for(200ms);
  CHECK_FALSE(cache.store.get(digest_of(9), std::nullopt));
  CHECK(raw_shared_put(*stub, ref, 9, bytes.size(), sum).first.ok());
  held.reset();
  {
    auto h = cache.store.get(digest_of(9), std::nullopt);
    REQUIRE(h);
    CHECK(h->bytes() == bytes);
    // The cache's own memfd handed back under another digest (a Get's reference): declined, its pages are not
    // counted twice.
    const auto [st2, kind2] = raw_shared_put(*stub, h->memfd_ref(), 10, bytes.size(), sum);
    CHECK(st2.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(kind2 == "declined");
  }
  // A memfd below the cache's --shared-memory-min-bytes: declined.
  const std::string small(1000, 's');
  auto tiny = sealed(small);
  CHECK(raw_shared_put(*stub, tiny->memfd_ref(), 11, small.size(), rpc::checksum64(small)).second == "declined");
  CHECK_FALSE(cache.store.get(digest_of(10), std::nullopt));
  CHECK_FALSE(cache.store.get(digest_of(11), std::nullopt));
  CHECK(cache.store.stats().memory_bytes == bytes.size());
}
