// The combine worker's tiers: the device tier of resident entries and the host tier of pinned blocks (LRU under a byte
// budget, id check), host copies off the critical path, the default budgets, and the service around them (local
// builds spliced with no host round trip, LookupEntries, ClearTiers, a failed policy rebuild fetched instead).
#include <catch2/catch.hpp>

#include <functional>
#include <future>
#include <thread>

#include "combine_worker/budgets.h"
#include "combine_worker/host_copies.h"
#include "combine_worker/memory_tier.h"
#include "engine/checkpoint/config.h"
#include "proto/rpc/chunks.h"
#include "proto/rpc/metrics.h"
#include "segment_cache/service.h"
#include "segment_cache/store.h"
#include "tests/unit/cluster/cache_fixture.h"
#include "tests/unit/cluster/combine_fixture.h"

using namespace std::chrono_literals;

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

// ---- the host tier, host copies and the combine worker's tiers through its service ------------------------------

namespace {
// A host block of n tokens holding its header only.
struct TestBlock final : hypic::engine::HostBlock {
  SegmentEntry e;
  size_t n_bytes = 0;
  const SegmentEntry& header() const override { return e; }
  size_t bytes() const override { return n_bytes; }
};

// The CPU backend, counting what crosses between an entry's resident form and its host form: host() calls on the
// entries it built (the CUDA backend's device-to-host copy) made before a splice uses them, and import_entry calls
// (the way back). A locally built entry must take neither on its way to the splice.
class CountingBackend final : public hypic::engine::Backend {
 public:
  struct Entry final : hypic::engine::ResidentEntry {
    std::shared_ptr<const hypic::engine::ResidentEntry> inner;
    std::atomic<int>* host_calls;
    const SegmentEntry& header() const override { return inner->header(); }
    std::shared_ptr<const SegmentEntry> host() const override {
      ++*host_calls;
      return inner->host();
    }
    size_t resident_bytes() const override { return inner->resident_bytes(); }
  };
  explicit CountingBackend(std::unique_ptr<hypic::engine::Backend> inner) : b_(std::move(inner)) {}
  const hypic::engine::ModelConfig& config() const override { return b_->config(); }
  hypic::engine::DeviceSpec device() const override { return b_->device(); }
  std::string_view numerics() const override { return b_->numerics(); }
  const std::string& fingerprint() const override { return b_->fingerprint(); }
  std::vector<std::shared_ptr<const hypic::engine::ResidentEntry>> build_entries(
      std::span<const std::vector<int32_t>> segments, int seam_width,
      const hypic::engine::BuildCancelled& cancelled = {}) override {
    ++entered;
    while (hold) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (fail_builds > 0) {  // device memory short, as a CUDA backend reports it
      --fail_builds;
      throw hypic::engine::ResourceExhausted("device memory exhausted (test)");
    }
    if (fail_other > 0) {
      --fail_other;
      throw std::runtime_error("kernel failed (test)");
    }
    if (fail_slots > 0) {  // out of something a full prefill needs too
      --fail_slots;
      throw hypic::engine::ResourceExhausted("all 64 sequence slots are in use (test)");
    }
    built += int(segments.size());
    std::vector<std::shared_ptr<const hypic::engine::ResidentEntry>> out;
    for (auto& e : b_->build_entries(segments, seam_width, cancelled)) {
      if (!e) {  // cancelled part way
        out.push_back(nullptr);
        continue;
      }
      auto w = std::make_shared<Entry>();
      w->inner = std::move(e);
      w->host_calls = &host_calls;
      out.push_back(std::move(w));
    }
    return out;
  }
  std::shared_ptr<const hypic::engine::ResidentEntry> import_entry(
      std::shared_ptr<const SegmentEntry> entry) override {
    ++imported;
    return b_->import_entry(std::move(entry));
  }
  hypic::engine::SpliceOutput splice(const hypic::engine::SplicePlan& plan) override {
    host_calls_before_splice.push_back(host_calls.load());
    hypic::engine::SplicePlan p = plan;
    for (auto& s : p.segments) {
      if (auto* w = dynamic_cast<const Entry*>(s.entry.get())) s.entry = w->inner;
      if (!s.entry && s.block) {  // staged: a CUDA backend copies the block in for the passes that fold it
        s.entry = b_->import_entry(dynamic_cast<const Block&>(*s.block).e);
        s.block = nullptr;
        ++staged_seen;
      }
    }
    return b_->splice(p);
  }
  // Host blocks (with device_like): a block is the entry's host form, `block_bytes` bytes.
  struct Block final : hypic::engine::HostBlock {
    std::shared_ptr<const SegmentEntry> e;
    size_t n = 0;
    const SegmentEntry& header() const override { return *e; }
    size_t bytes() const override { return n; }
  };
  std::shared_ptr<const hypic::engine::HostBlock> block_of_entry(const SegmentEntry& entry) const override {
    auto b = std::make_shared<Block>();
    b->e = std::make_shared<SegmentEntry>(entry);
    b->n = 4096;
    return b;
  }
  std::shared_ptr<const hypic::engine::HostBlock> copy_to_host(const hypic::engine::ResidentEntry& e) const override {
    while (hold_copies) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ++copies_made;
    return block_of_entry(*e.host());
  }
  std::shared_ptr<const hypic::engine::ResidentEntry> import_block(const hypic::engine::HostBlock& b) const override {
    ++block_imports;
    return b_->import_entry(dynamic_cast<const Block&>(b).e);
  }
  std::shared_ptr<const SegmentEntry> entry_of_block(const hypic::engine::HostBlock& b) const override {
    return dynamic_cast<const Block&>(b).e;
  }
  size_t entry_bytes(int64_t tokens) const override {
    return entry_bytes_each ? entry_bytes_each.load() : b_->entry_bytes(tokens);
  }
  /// The wrapped CPU backend (entries built on it directly are plain CPU entries).
  hypic::engine::Backend& inner() { return *b_; }
  void decode(std::span<hypic::engine::Sequence* const> s, std::span<const int32_t> t,
              std::vector<float>& logits) override {
    b_->decode(s, t, logits);
  }
  hypic::engine::BackendMemory memory() const override {
    hypic::engine::BackendMemory m = b_->memory();
    if (device_like) m.device_free = device_free, m.device_total = device_free + (size_t(1) << 30);
    return m;
  }
  bool device_entries() const override { return device_like; }
  std::atomic<int> built{0}, imported{0}, host_calls{0};
  std::atomic<int> fail_builds{0};  ///< the next this many build_entries calls throw ResourceExhausted
  std::atomic<int> fail_other{0};   ///< then this many throw std::runtime_error
  std::atomic<int> fail_slots{0};   ///< then this many throw a ResourceExhausted that is not device memory
  /// Reports its entries as device-resident with `device_free` bytes free (CombineService::check_entry_room); only
  /// for requests whose entries are all built here (nothing imported).
  std::atomic<bool> device_like{false};
  std::atomic<size_t> device_free{0};
  std::atomic<bool> hold{false};    ///< build_entries waits while set (a build kept running)
  std::atomic<bool> hold_copies{false};  ///< copy_to_host waits while set (a host copy kept in the making)
  mutable std::atomic<int> copies_made{0};  ///< copy_to_host calls returned
  std::atomic<size_t> entry_bytes_each{0};  ///< entry_bytes() of every entry (0: the CPU backend's)
  mutable std::atomic<int> block_imports{0};  ///< import_block calls
  std::atomic<int> staged_seen{0};  ///< plan segments spliced from host blocks (staged)
  std::atomic<int> entered{0};      ///< build_entries calls begun
  std::vector<int> host_calls_before_splice;  // engine loop thread only

 private:
  std::unique_ptr<hypic::engine::Backend> b_;
};

namespace v1 = hypic::v1;

double fallbacks() {
  return hypic::rpc::MetricsRegistry::global().counter("hypic:combine_full_fallbacks_total", "").value();
}

double staged_cold_in_full() {
  return hypic::rpc::MetricsRegistry::global().counter("hypic:combine_staged_cold_in_full_total", "").value();
}

struct Combined {
  v1::CombineReport report;
  std::vector<int32_t> tokens;
};

// One Combine call: `segs` planned as `source`, a fixed query, 4 greedy tokens; `cache_segments`: built entries are
// put in the segment cache; `call`: the client context (else one with a 10 s deadline).
Combined combine(hypic::test::CombineServer& c, const std::string& id, const std::vector<std::vector<int32_t>>& segs,
                 v1::PlannedSegment::Source source, grpc::Status* status = nullptr, bool cache_segments = false,
                 grpc::ClientContext* call = nullptr, const std::string& mode = "hypic") {
  v1::CombineRequest req;
  req.set_request_id(id);
  req.set_cache_segments(cache_segments);
  for (size_t i = 0; i < segs.size(); ++i) {
    auto* ps = req.add_segments();
    ps->set_index(uint32_t(i));
    const auto d = hypic::engine::segment_digest(c.backend.fingerprint(),
                                                 hypic::engine::entry_format_version(c.backend.config()), 4, segs[i]);
    ps->mutable_key()->set_digest(std::string(reinterpret_cast<const char*>(d.data()), d.size()));
    ps->mutable_key()->mutable_token_ids()->Add(segs[i].begin(), segs[i].end());
    ps->set_source(source);
  }
  for (int32_t t : {5, 6, 7}) req.add_query_ids(t);
  req.mutable_sampling()->set_max_tokens(4);
  req.mutable_sampling()->set_seed(1);
  req.set_mode(mode);
  req.set_seam_width(4);
  auto ctx = hypic::test::context();
  auto reader = c.stub->Combine(call ? call : ctx.get(), req);
  Combined out;
  v1::CombineEvent ev;
  while (reader->Read(&ev)) {
    if (ev.has_delta()) out.tokens.insert(out.tokens.end(), ev.delta().token_ids().begin(), ev.delta().token_ids().end());
    if (ev.has_report()) out.report = ev.report();
  }
  const grpc::Status st = reader->Finish();
  if (status) {
    *status = st;
    return out;
  }
  INFO(st.error_message());
  REQUIRE(st.ok());
  return out;
}

std::vector<v1::EntryTier> lookup(hypic::test::CombineServer& c, const std::vector<std::vector<int32_t>>& segs) {
  v1::LookupEntriesRequest req;
  for (const auto& s : segs) {
    const auto d = hypic::engine::segment_digest(c.backend.fingerprint(),
                                                 hypic::engine::entry_format_version(c.backend.config()), 4, s);
    req.add_digests(std::string(reinterpret_cast<const char*>(d.data()), d.size()));
  }
  v1::LookupEntriesResponse resp;
  auto ctx = hypic::test::context();
  REQUIRE(c.stub->LookupEntries(ctx.get(), req, &resp).ok());
  std::vector<v1::EntryTier> out;
  for (int t : resp.tiers()) out.push_back(v1::EntryTier(t));
  return out;
}

// Polls `done` every 5 ms for up to 5 s; its last value.
bool wait_for(const std::function<bool()>& done) {
  for (int i = 0; i < 1000 && !done(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return done();
}

std::vector<v1::SegmentSource> sources(const Combined& r) {
  std::vector<v1::SegmentSource> s;
  for (const auto& seg : r.report.segments()) s.push_back(seg.source());
  return s;
}
}  // namespace

TEST_CASE("host tier: LRU by block bytes -- clear and contains", "[memory_tier]") {
  auto block = [](int n, int32_t first, size_t bytes) {
    auto b = std::make_shared<TestBlock>();
    for (int i = 0; i < n; ++i) b->e.token_ids.push_back(first + i);
    b->n_bytes = bytes;
    return b;
  };
  hypic::combine::HostBlockTier tier(300);
  auto a = block(3, 10, 100), b = block(3, 20, 150), c = block(3, 30, 100);
  tier.put(digest_of(1), a);
  tier.put(digest_of(2), b);
  CHECK(tier.contains(digest_of(1)));
  CHECK_FALSE(tier.contains(digest_of(3)));
  CHECK(tier.get(digest_of(1), a->e.token_ids) == a);
  tier.put(digest_of(3), c);  // 350 > 300: evicts the least recent (2)
  CHECK_FALSE(tier.contains(digest_of(2)));
  CHECK(tier.bytes() == 200);
  CHECK(tier.clear() == 2);
  CHECK(tier.entries() == 0);
  CHECK(tier.bytes() == 0);
  CHECK(tier.budget() == 300);
}

TEST_CASE("host copies: nothing to do without a host tier or a cache -- a full queue drops and counts", "[memory_tier]") {
  auto backend = hypic::engine::make_backend(hypic::engine::DeviceSpec{}, hypic::test::kCombineModel);
  const auto entries = backend->build_entries(std::vector<std::vector<int32_t>>{{1, 2, 3, 4, 5}}, 2);
  hypic::cache::SegmentCacheClient none{std::vector<std::string>{}};
  hypic::cache::AsyncCachePutter putter{none, 1 << 20};
  hypic::combine::HostBlockTier host(1 << 20);
  {
    // The CPU backend keeps entries in host memory (no host tier copies) and there is no cache: nothing is queued.
    hypic::combine::HostCopier copier(*backend, &host, putter, 1 << 30);
    CHECK_FALSE(copier.enqueue(digest_of(1), entries[0], true, "r"));
    copier.wait_idle();
    CHECK(copier.counters().made == 0);
    CHECK(copier.counters().dropped == 0);
  }
  {
    // A cache put asked for with a cache configured (unreachable: the put fails later), queue smaller than the entry.
    hypic::cache::SegmentCacheClient one{std::vector<std::string>{"127.0.0.1:1"}};
    hypic::cache::AsyncCachePutter p1{one, 1 << 30};
    hypic::combine::HostCopier copier(*backend, nullptr, p1, entries[0]->resident_bytes() - 1);
    CHECK_FALSE(copier.enqueue(digest_of(2), entries[0], true, "r"));
    CHECK(copier.counters().dropped == 1);
    // The cache put queue drops (and counts) what does not fit in its byte budget.
    hypic::cache::AsyncCachePutter tight{one, 10};
    CHECK_FALSE(tight.enqueue(digest_of(4), {1, 2}, std::make_shared<const std::string>(100, 'x'), "r"));
    CHECK(tight.counters().dropped == 1);
    CHECK(tight.pending() == 0);
    hypic::combine::HostCopier roomy(*backend, nullptr, p1, uint64_t(1) << 30);
    CHECK(roomy.enqueue(digest_of(3), entries[0], true, "r"));
    roomy.wait_idle();
    CHECK(roomy.counters().made == 1);
    CHECK(roomy.counters().queued_bytes == 0);
  }
}

TEST_CASE("host copies: a waiter's on_copied is called once -- with the block, or null when dropped or without "
          "host blocks", "[memory_tier]") {
  CountingBackend device(hypic::engine::make_backend(hypic::engine::DeviceSpec{}, hypic::test::kCombineModel));
  const auto entries = device.inner().build_entries(std::vector<std::vector<int32_t>>{{1, 2, 3, 4, 5}}, 2);
  hypic::cache::SegmentCacheClient none{std::vector<std::string>{}};
  hypic::cache::AsyncCachePutter putter{none, 1 << 20};
  std::atomic<int> calls{0}, blocks{0};
  std::vector<int32_t> ids;
  std::mutex mu;
  auto cb = [&](std::shared_ptr<const hypic::engine::HostBlock> b) {
    ++calls;
    if (!b) return;
    ++blocks;
    std::lock_guard<std::mutex> lock(mu);
    ids = b->header().token_ids;
  };
  {  // entries in host memory: no block, said at once
    hypic::combine::HostCopier copier(device, nullptr, putter, 1 << 30);
    CHECK_FALSE(copier.enqueue(digest_of(1), entries[0], false, "r", cb));
    CHECK(calls == 1);
    CHECK(blocks == 0);
  }
  device.device_like = true;
  {  // device entries, no host tier and no cache: copied for the waiter alone
    hypic::combine::HostCopier copier(device, nullptr, putter, 1 << 30);
    CHECK(copier.enqueue(digest_of(2), entries[0], false, "r", cb));
    copier.wait_idle();
    CHECK(calls == 2);
    CHECK(blocks == 1);
    CHECK(ids == std::vector<int32_t>{1, 2, 3, 4, 5});
    CHECK(copier.counters().made == 1);
  }
  {  // a queue smaller than the entry: dropped, said at once
    hypic::combine::HostCopier copier(device, nullptr, putter, entries[0]->resident_bytes() - 1);
    CHECK_FALSE(copier.enqueue(digest_of(3), entries[0], false, "r", cb));
    CHECK(calls == 3);
    CHECK(blocks == 1);
  }
  device.device_like = false;
}

TEST_CASE("combine worker: local builds are spliced resident (no host round trip) -- its tiers are looked up and cleared",
          "[memory_tier]") {
  CountingBackend backend(hypic::engine::make_backend(hypic::engine::DeviceSpec{}, hypic::test::kCombineModel));
  hypic::test::CombineServer c(backend, {}, size_t(1) << 30);
  const std::vector<std::vector<int32_t>> segs = {{11, 12, 13, 14, 15, 16, 17}, {21, 22, 23, 24, 25, 26}, {31, 32}};
  CHECK(lookup(c, segs) == std::vector<v1::EntryTier>(3, v1::ENTRY_TIER_NONE));

  const Combined cold = combine(c, "r-cold", segs, v1::PlannedSegment::LOCAL);
  CHECK(sources(cold) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_COMPUTED));
  CHECK(backend.built == 3);
  // Built here and spliced as built: no host copy before the splice (none at all: no cache, no host tier), no import.
  CHECK(backend.host_calls_before_splice == std::vector<int>{0});
  CHECK(backend.host_calls == 0);
  CHECK(backend.imported == 0);
  CHECK(cold.tokens.size() == 4);
  CHECK(lookup(c, segs) == std::vector<v1::EntryTier>(3, v1::ENTRY_TIER_DEVICE));

  // Planned warm (the router saw them in this worker's tier): spliced from the device tier, same tokens.
  const Combined warm = combine(c, "r-warm", segs, v1::PlannedSegment::WARM);
  CHECK(sources(warm) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_MEMORY));
  for (const auto& s : warm.report.segments()) CHECK(s.reused());
  CHECK(warm.tokens == cold.tokens);
  CHECK(backend.built == 3);
  CHECK(backend.imported == 0);

  // Cleared: nothing held any more; a warm plan falls back to building here (no cache), with the same tokens.
  v1::ClearTiersRequest clear;
  clear.set_device(true);
  clear.set_host(true);
  v1::ClearTiersResponse cleared;
  auto ctx = hypic::test::context();
  REQUIRE(c.stub->ClearTiers(ctx.get(), clear, &cleared).ok());
  CHECK(cleared.device_entries_dropped() == 3);
  CHECK(cleared.host_entries_dropped() == 0);
  CHECK(lookup(c, segs) == std::vector<v1::EntryTier>(3, v1::ENTRY_TIER_NONE));
  const Combined again = combine(c, "r-again", segs, v1::PlannedSegment::WARM);
  CHECK(sources(again) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_COMPUTED));
  CHECK(again.tokens == cold.tokens);
  CHECK(backend.built == 6);

  // Device memory short for a build: the device tier gives entries up and the build is retried once.
  REQUIRE(combine(c, "r-fill", segs, v1::PlannedSegment::WARM).report.segments_size() == 3);  // tier holds 3 again
  backend.fail_builds = 1;
  const std::vector<std::vector<int32_t>> fresh = {{41, 42, 43, 44, 45, 46}};
  const Combined retried = combine(c, "r-retry", fresh, v1::PlannedSegment::LOCAL);
  CHECK(sources(retried) == std::vector<v1::SegmentSource>{v1::SEGMENT_SOURCE_COMBINE_COMPUTED});
  CHECK_THAT(retried.report.segments(0).note(), Catch::Contains("device-tier entries evicted and the build retried"));
  CHECK(c.tier.entries() < 4);  // some of the 3 gave way before the new one went in
  // Failing again after the retry: the request's entries do not fit, and it is answered by a full prefill instead,
  // with full recomputation's tokens, every segment saying so, counted.
  backend.fail_builds = 1000;  // every build attempt (the batch, each alone, the retry after the tier gave way)
  {
    const std::vector<std::vector<int32_t>> prompt = {{51, 52, 53, 54, 55}, {56, 57, 58}};
    const double fallbacks0 = fallbacks();
    const Combined full = combine(c, "r-fail", prompt, v1::PlannedSegment::LOCAL);
    CHECK(fallbacks() == fallbacks0 + 1);
    CHECK(sources(full) == std::vector<v1::SegmentSource>(2, v1::SEGMENT_SOURCE_IN_CONTEXT));
    for (const auto& seg : full.report.segments()) {
      CHECK_THAT(seg.note(), Catch::Contains("did not fit in device memory: answered by a full prefill"));
      CHECK_FALSE(seg.reused());
    }
    const Combined reference = combine(c, "r-fail-ref", prompt, v1::PlannedSegment::LOCAL, nullptr, false, nullptr,
                                       "full");
    CHECK(full.tokens == reference.tokens);
    CHECK(full.tokens.size() == 4);
    CHECK(fallbacks() == fallbacks0 + 1);  // (mode full itself never falls back)
    // Entries that cannot fit whatever the tier gives up: answered in full at once, before any build is started.
    v1::ClearTiersRequest clear_all;
    clear_all.set_device(true);
    v1::ClearTiersResponse cleared_all;
    auto cctx = hypic::test::context();
    REQUIRE(c.stub->ClearTiers(cctx.get(), clear_all, &cleared_all).ok());
    backend.fail_builds = 0;
    backend.device_like = true;
    backend.device_free = 1000;
    const int entered0 = backend.entered;
    const Combined early = combine(c, "r-early", prompt, v1::PlannedSegment::LOCAL);
    CHECK(backend.entered == entered0);
    CHECK(fallbacks() == fallbacks0 + 2);
    CHECK(early.tokens == reference.tokens);
    CHECK_THAT(early.report.segments(1).note(), Catch::Contains("did not fit in device memory"));
    backend.device_free = size_t(1) << 40;  // room: built as usual
    const Combined roomy = combine(c, "r-roomy", {{61, 62, 63}}, v1::PlannedSegment::LOCAL);
    CHECK(sources(roomy) == std::vector<v1::SegmentSource>{v1::SEGMENT_SOURCE_COMBINE_COMPUTED});
    CHECK(fallbacks() == fallbacks0 + 2);
    backend.device_like = false;
    // Out of something else (sequence slots): no full prefill, which would need them too; the request fails.
    backend.fail_slots = 2;
    grpc::Status slots_st;
    combine(c, "r-slots", {{71, 72, 73, 74}}, v1::PlannedSegment::LOCAL, &slots_st);
    CHECK(slots_st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK_THAT(slots_st.error_message(), Catch::Contains("sequence slots"));
    CHECK(fallbacks() == fallbacks0 + 2);
    backend.fail_slots = 0;
  }
  backend.fail_builds = 0;

  // A digest of another length is named.
  v1::LookupEntriesRequest bad;
  bad.add_digests("short");
  v1::LookupEntriesResponse resp;
  auto bctx = hypic::test::context();
  const grpc::Status st = c.stub->LookupEntries(bctx.get(), bad, &resp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("digests[0]"));

  // WorkerInfo reports the tiers.
  v1::WorkerInfo info;
  auto ictx = hypic::test::context();
  REQUIRE(c.stub->GetWorkerInfo(ictx.get(), v1::WorkerInfoRequest{}, &info).ok());
  CHECK(info.device_tier_entries() == c.tier.entries());
  CHECK(info.device_tier_bytes() == c.tier.bytes());
  CHECK(info.device_tier_budget() == size_t(1) << 30);
  CHECK(info.host_tier_budget() == 0);
}

TEST_CASE("combine worker: entries that do not fit in device memory at once are staged by the splice from pinned "
          "host blocks -- resident where they fit, a full prefill where not even the largest fits", "[memory_tier]") {
  CountingBackend backend(hypic::engine::make_backend(hypic::engine::DeviceSpec{}, hypic::test::kCombineModel));
  // No device tier (a warm plan is the host tier's), a host tier of 1 GiB.
  hypic::test::CombineServer c(backend, {}, 0, {}, size_t(1) << 30);
  const std::vector<std::vector<int32_t>> segs = {{11, 12, 13, 14, 15, 16, 17}, {21, 22, 23, 24, 25, 26}, {31, 32}};
  const Combined reference = combine(c, "s-ref", segs, v1::PlannedSegment::LOCAL);
  const Combined full_reference =
      combine(c, "s-full", segs, v1::PlannedSegment::LOCAL, nullptr, false, nullptr, "full");
  // The host tier holds the entries' blocks (as a device backend's host copies leave them).
  const auto built = backend.inner().build_entries(segs, 4);
  const auto fill_host_tier = [&](hypic::test::CombineServer& server) {
    for (size_t i = 0; i < segs.size(); ++i) {
      const auto d = hypic::engine::segment_digest(backend.fingerprint(),
                                                   hypic::engine::entry_format_version(backend.config()), 4, segs[i]);
      server.host_tier.put(d, backend.block_of_entry(*built[i]->host()));
    }
  };
  fill_host_tier(c);
  REQUIRE(c.host_tier.entries() == 3);
  const auto GiB = size_t(1) << 30;
  const double staged0 =
      hypic::rpc::MetricsRegistry::global().counter("hypic:combine_staged_requests_total", "").value();
  backend.device_like = true;
  backend.entry_bytes_each = GiB;  // 3 GiB for the three
  SECTION("2 GiB free: staged by the splice, nothing imported before it") {
    backend.device_free = 2 * GiB;
    const Combined staged = combine(c, "s-staged", segs, v1::PlannedSegment::WARM);
    CHECK(sources(staged) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_HOST));
    CHECK(backend.staged_seen == 3);
    CHECK(backend.block_imports == 0);
    CHECK(staged.tokens == reference.tokens);
    for (const auto& seg : staged.report.segments()) {
      CHECK_THAT(seg.note(), Catch::Contains("staged into device memory by the splice"));
      CHECK(seg.reused());
    }
    CHECK(hypic::rpc::MetricsRegistry::global().counter("hypic:combine_staged_requests_total", "").value() ==
          staged0 + 1);
  }
  SECTION("2 GiB free, cold, --staged-cold-policy stage: built here, each entry's host copy (not the resident entry) "
          "goes to the splice") {
    backend.device_free = 2 * GiB;
    hypic::combine::CombineOptions stage;
    stage.staged_cold_in_full = false;  // (auto: a full prefill timed above may beat these builds, by the clock)
    hypic::test::CombineServer cs(backend, stage, 0, {}, size_t(1) << 30);
    const std::vector<std::vector<int32_t>> cold = {{81, 82, 83, 84}, {85, 86, 87}, {88, 89}};
    const int built0 = backend.built;
    const Combined staged = combine(cs, "s-cold", cold, v1::PlannedSegment::LOCAL);
    CHECK(backend.built == built0 + 3);
    CHECK(sources(staged) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_COMPUTED));
    CHECK(backend.staged_seen == 3);
    for (const auto& seg : staged.report.segments())
      CHECK_THAT(seg.note(), Catch::Contains("copied to a pinned host block for the staged splice"));
    // The same prompt built and spliced resident (nothing staged): the same tokens.
    backend.device_like = false;
    const Combined resident = combine(cs, "s-cold-resident", cold, v1::PlannedSegment::LOCAL);
    CHECK(backend.staged_seen == 3);
    CHECK(staged.tokens == resident.tokens);
  }
  SECTION("2 GiB free, cold, a staged splice's rate known to make staging slower: answered by a full prefill, the "
          "entries built after the first token into the host tier") {
    backend.device_free = 2 * GiB;
    hypic::combine::CombineOptions slow;
    slow.staged_prior_gb_per_s = 1e-3;  // 3 GiB staged at 1 MB/s: an hour, against milliseconds of prefill
    slow.build_prior_tokens_per_s = 1000;
    hypic::test::CombineServer c2(backend, slow, 0, {}, size_t(1) << 30);
    const std::vector<std::vector<int32_t>> cold = {{91, 92, 93, 94}, {95, 96, 97}, {98, 99}};
    const Combined full_ref = combine(c2, "s-cold-full-ref", cold, v1::PlannedSegment::LOCAL, nullptr, false, nullptr,
                                      "full");
    const double in_full0 =
        hypic::rpc::MetricsRegistry::global().counter("hypic:combine_staged_cold_in_full_total", "").value();
    const int built0 = backend.built;
    const Combined answered = combine(c2, "s-cold-full", cold, v1::PlannedSegment::LOCAL);
    CHECK(sources(answered) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_IN_CONTEXT));
    CHECK(answered.tokens == full_ref.tokens);
    CHECK(backend.staged_seen == 0);
    for (const auto& seg : answered.report.segments()) {
      CHECK_THAT(seg.note(), Catch::Contains("answered by a full prefill of the prompt, estimated"));
      CHECK_THAT(seg.note(), Catch::Contains("built after the first token"));
      CHECK_FALSE(seg.reused());
    }
    CHECK(hypic::rpc::MetricsRegistry::global().counter("hypic:combine_staged_cold_in_full_total", "").value() ==
          in_full0 + 1);
    // Built after the first token, copied to the host tier (no device tier here): the next request is warm.
    for (int k = 0; k < 500 && lookup(c2, cold) != std::vector<v1::EntryTier>(3, v1::ENTRY_TIER_HOST); ++k)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    CHECK(lookup(c2, cold) == std::vector<v1::EntryTier>(3, v1::ENTRY_TIER_HOST));
    CHECK(backend.built == built0 + 3);
    const Combined warm = combine(c2, "s-cold-warm", cold, v1::PlannedSegment::WARM);
    CHECK(sources(warm) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_HOST));
    CHECK(backend.staged_seen == 3);
    CHECK(backend.built == built0 + 3);
    backend.device_like = false;
    const Combined resident = combine(c2, "s-cold-resident", cold, v1::PlannedSegment::LOCAL);
    CHECK(warm.tokens == resident.tokens);
    backend.device_like = true;
    // --staged-cold-policy stage: built first and staged, whatever the rates say.
    slow.staged_cold_in_full = false;
    hypic::test::CombineServer c3(backend, slow, 0, {}, size_t(1) << 30);
    const std::vector<std::vector<int32_t>> cold2 = {{101, 102, 103}, {104, 105}, {106, 107, 108}};
    const int staged_seen0 = backend.staged_seen;
    const Combined staged = combine(c3, "s-cold-stage", cold2, v1::PlannedSegment::LOCAL);
    CHECK(sources(staged) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_COMPUTED));
    CHECK(backend.staged_seen == staged_seen0 + 3);
    CHECK(hypic::rpc::MetricsRegistry::global().counter("hypic:combine_staged_cold_in_full_total", "").value() ==
          in_full0 + 1);
  }
  SECTION("8 GiB free: made resident from the host tier as they are fetched, not staged") {
    backend.device_free = 8 * GiB;
    const Combined roomy = combine(c, "s-roomy", segs, v1::PlannedSegment::WARM);
    CHECK(sources(roomy) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_HOST));
    CHECK(backend.staged_seen == 0);
    CHECK(backend.block_imports == 3);
    CHECK(roomy.tokens == reference.tokens);
  }
  SECTION("8 GiB free but --request-entry-bytes 2 GiB: staged") {
    backend.device_free = 8 * GiB;
    hypic::combine::CombineOptions capped;
    capped.request_entry_bytes = 2 * GiB;
    hypic::test::CombineServer c2(backend, capped, 0, {}, size_t(1) << 30);
    fill_host_tier(c2);
    const Combined staged = combine(c2, "s-capped", segs, v1::PlannedSegment::WARM);
    CHECK(backend.staged_seen == 3);
    CHECK(backend.block_imports == 0);
    CHECK(staged.tokens == reference.tokens);
    // Under the cap: resident.
    capped.request_entry_bytes = 4 * GiB;
    hypic::test::CombineServer c3(backend, capped, 0, {}, size_t(1) << 30);
    fill_host_tier(c3);
    CHECK(combine(c3, "s-under", segs, v1::PlannedSegment::WARM).tokens == reference.tokens);
    CHECK(backend.staged_seen == 3);
    CHECK(backend.block_imports == 3);
  }
  SECTION("1.25 GiB free: not even the largest entry and the staging margin fit, answered by a full prefill") {
    backend.device_free = GiB + GiB / 4;
    const double fallbacks0 = fallbacks();
    const Combined full = combine(c, "s-tight", segs, v1::PlannedSegment::WARM);
    CHECK(fallbacks() == fallbacks0 + 1);
    CHECK(backend.staged_seen == 0);
    CHECK(sources(full) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_IN_CONTEXT));
    CHECK(full.tokens == full_reference.tokens);
  }
  backend.device_like = false;
}

TEST_CASE("combine worker: a cache-only segment the fetch policy prefills is fetched after all when its prefill fails",
          "[memory_tier]") {
  // A segment cache served in-process; a combine worker with no tiers of its own, so that a segment the router plans
  // warm is the cache's alone, and rates that make --cache-fetch-policy auto prefill it (a fetch of 1 kB/s).
  hypic::test::CacheServer cache_srv(hypic::cache::StoreOptions{});
  CountingBackend backend(hypic::engine::make_backend(hypic::engine::DeviceSpec{}, hypic::test::kCombineModel));
  hypic::combine::CombineOptions opt;
  opt.cache_fetch_policy = hypic::combine::CacheFetchPolicy::Auto;
  opt.fetch_prior_mb_per_s = 0.001;
  opt.build_prior_tokens_per_s = 1e6;
  hypic::test::CombineServer c(backend, opt, 0, {cache_srv.address()});

  const std::vector<std::vector<int32_t>> segs = {{61, 62, 63, 64, 65, 66, 67}, {71, 72, 73, 74, 75}};
  const Combined cold = combine(c, "r-cold", segs, v1::PlannedSegment::LOCAL, nullptr, /*cache_segments=*/true);
  CHECK(sources(cold) == std::vector<v1::SegmentSource>(2, v1::SEGMENT_SOURCE_COMBINE_COMPUTED));
  for (int i = 0; i < 200 && cache_srv.store.stats().memory_entries < 2; ++i) std::this_thread::sleep_for(50ms);
  REQUIRE(cache_srv.store.stats().memory_entries == 2);  // the cold entries were put (asynchronously)

  // Planned warm: the policy prefills both here; their builds fail (device memory short: the batch, then each alone,
  // and no tier entries to give up), so both are fetched from the cache after all: the same tokens, a note saying
  // so, nothing put back.
  const int built_before = backend.built;
  backend.fail_builds = 3;
  const Combined warm = combine(c, "r-warm", segs, v1::PlannedSegment::WARM);
  CHECK(sources(warm) == std::vector<v1::SegmentSource>(2, v1::SEGMENT_SOURCE_CACHE));
  for (const auto& s : warm.report.segments()) {
    CHECK_THAT(s.note(), Catch::Contains("prefilled here instead"));
    CHECK_THAT(s.note(), Catch::Contains("prefilling it failed (device memory exhausted (test))"));
    CHECK_THAT(s.note(), Catch::Contains("fetched from the segment cache instead"));
  }
  CHECK(warm.tokens == cold.tokens);
  CHECK(backend.built == built_before);  // the batch and each segment alone threw
  CHECK(backend.fail_builds == 0);
  // Short for the two together only: the batch fails, each segment alone is built (and fetched from nowhere).
  const std::vector<std::vector<int32_t>> pair = {{91, 92, 93, 94, 95}, {96, 97, 98}};
  backend.fail_builds = 1;
  const Combined two = combine(c, "r-pair", pair, v1::PlannedSegment::LOCAL);
  CHECK(sources(two) == std::vector<v1::SegmentSource>(2, v1::SEGMENT_SOURCE_COMBINE_COMPUTED));
  CHECK(backend.built == built_before + 2);
  CHECK(backend.fail_builds == 0);

  // Planned warm but gone from the cache (evicted after the router's lookup), and the prefill fails for device
  // memory: answered at once by a full prefill (not at the gather deadline), the note giving both reasons.
  backend.fail_builds = 1;
  const auto t0 = std::chrono::steady_clock::now();
  const Combined gone = combine(c, "r-gone", {{81, 82, 83, 84}}, v1::PlannedSegment::WARM);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  REQUIRE(gone.report.segments_size() == 1);
  CHECK(gone.report.segments(0).source() == v1::SEGMENT_SOURCE_IN_CONTEXT);
  CHECK_THAT(gone.report.segments(0).note(), Catch::Contains("did not fit in device memory"));
  CHECK(gone.tokens == combine(c, "r-gone-ref", {{81, 82, 83, 84}}, v1::PlannedSegment::WARM, nullptr, false, nullptr,
                               "full").tokens);
  // A failure that is not device memory still fails the request, with both reasons and the build's code.
  backend.fail_builds = 0;
  backend.fail_other = 1;
  grpc::Status st;
  combine(c, "r-gone-2", {{85, 86, 87, 88}}, v1::PlannedSegment::WARM, &st);
  CHECK(st.error_code() == grpc::StatusCode::INTERNAL);
  CHECK_THAT(st.error_message(), Catch::Contains("prefilling it failed (kernel failed (test))"));
  CHECK_THAT(st.error_message(), Catch::Contains("not in the segment cache any more"));
  CHECK_THAT(st.error_message(), !Catch::Contains("prefilled by the combine worker"));
  backend.fail_other = 0;
  cache_srv.server->Shutdown(std::chrono::system_clock::now() + 2s);
}

TEST_CASE("combine worker: concurrent requests prefilling the same segment share one build", "[memory_tier]") {
  CountingBackend backend(hypic::engine::make_backend(hypic::engine::DeviceSpec{}, hypic::test::kCombineModel));
  hypic::test::CombineServer c(backend, {}, size_t(1) << 30);
  // B arrives while A's builds run (held in the backend): B's segments join them; one build per segment fills both.
  const std::vector<std::vector<int32_t>> segs = {{91, 92, 93, 94, 95, 96, 97}, {101, 102, 103, 104, 105}};
  backend.hold = true;
  auto a = std::async(std::launch::async, [&] { return combine(c, "r-a", segs, v1::PlannedSegment::LOCAL); });
  REQUIRE(wait_for([&] { return backend.entered >= 1; }));
  auto b = std::async(std::launch::async, [&] { return combine(c, "r-b", segs, v1::PlannedSegment::LOCAL); });
  REQUIRE(wait_for([&] { return c.svc->local_build_counts().joined == 2; }));
  CHECK(c.svc->local_build_counts().in_flight == 2);
  backend.hold = false;
  const Combined ra = a.get(), rb = b.get();
  CHECK(backend.built == 2);  // each segment once
  CHECK(sources(ra) == std::vector<v1::SegmentSource>(2, v1::SEGMENT_SOURCE_COMBINE_COMPUTED));
  CHECK(sources(rb) == std::vector<v1::SegmentSource>(2, v1::SEGMENT_SOURCE_COMBINE_COMPUTED));
  for (const auto& s : rb.report.segments())
    CHECK_THAT(s.note(), Catch::Contains("joined this worker's build of the same segment for request r-a"));
  CHECK(rb.tokens == ra.tokens);
  CHECK(c.svc->local_build_counts().in_flight == 0);
  // C was planned to prefill them too (planned before the builds ended, say): they are in the device tier now.
  const Combined rc = combine(c, "r-c", segs, v1::PlannedSegment::LOCAL);
  CHECK(sources(rc) == std::vector<v1::SegmentSource>(2, v1::SEGMENT_SOURCE_COMBINE_MEMORY));
  for (const auto& s : rc.report.segments()) CHECK_THAT(s.note(), Catch::Contains("from its device tier"));
  CHECK(rc.tokens == ra.tokens);
  CHECK(backend.built == 2);

  // The request the builds were started for goes away mid-build: they go on for the one that joined them.
  const std::vector<std::vector<int32_t>> segs2 = {{111, 112, 113, 114, 115, 116}, {121, 122, 123}};
  backend.hold = true;
  const int entered = backend.entered;
  grpc::ClientContext ctx_a;
  grpc::Status st_a;
  auto a2 = std::async(std::launch::async,
                       [&] { return combine(c, "r-a2", segs2, v1::PlannedSegment::LOCAL, &st_a, false, &ctx_a); });
  REQUIRE(wait_for([&] { return backend.entered > entered; }));
  auto b2 = std::async(std::launch::async, [&] { return combine(c, "r-b2", segs2, v1::PlannedSegment::LOCAL); });
  REQUIRE(wait_for([&] { return c.svc->local_build_counts().joined == 4; }));
  ctx_a.TryCancel();
  a2.get();
  CHECK(st_a.error_code() == grpc::StatusCode::CANCELLED);
  // (the client sees CANCELLED at once; A's handler notices within its 50 ms wait, leaves, then ends its call)
  REQUIRE(wait_for([&] { return c.life.active() == 1; }));
  CHECK(c.svc->local_build_counts().in_flight == 2);  // B still waits for both
  backend.hold = false;
  const Combined rb2 = b2.get();
  CHECK(sources(rb2) == std::vector<v1::SegmentSource>(2, v1::SEGMENT_SOURCE_COMBINE_COMPUTED));
  CHECK(backend.built == 4);
  // The same tokens as the entries spliced from the device tier (hit and miss agree).
  const Combined warm = combine(c, "r-warm2", segs2, v1::PlannedSegment::WARM);
  CHECK(sources(warm) == std::vector<v1::SegmentSource>(2, v1::SEGMENT_SOURCE_COMBINE_MEMORY));
  CHECK(warm.tokens == rb2.tokens);

  // Everyone waiting goes away: the builds are forgotten (and cancelled); the next request builds again.
  const std::vector<std::vector<int32_t>> segs3 = {{131, 132, 133, 134}};
  backend.hold = true;
  const int entered3 = backend.entered;
  grpc::ClientContext ctx_3;
  grpc::Status st_3;
  auto a3 = std::async(std::launch::async,
                       [&] { return combine(c, "r-a3", segs3, v1::PlannedSegment::LOCAL, &st_3, false, &ctx_3); });
  REQUIRE(wait_for([&] { return backend.entered > entered3; }));
  CHECK(c.svc->local_build_counts().in_flight == 1);
  ctx_3.TryCancel();
  a3.get();
  CHECK(st_3.error_code() == grpc::StatusCode::CANCELLED);
  // (the client sees CANCELLED at once; the handler notices within its 50 ms wait and leaves then)
  CHECK(wait_for([&] { return c.svc->local_build_counts().in_flight == 0; }));
  backend.hold = false;
  const Combined again = combine(c, "r-again3", segs3, v1::PlannedSegment::LOCAL);
  CHECK(again.tokens.size() == 4);
  CHECK(c.svc->local_build_counts().joined == 4);
}

// A combine worker on a device-like CPU backend whose requests of three 1 GiB entries are staged (2 GiB free), with no
// device tier, a 1 GiB host tier, and staging priced at 1 MB/s: a staged request with segments to build is answered
// by a full prefill.
struct StagedWorker {
  static constexpr size_t GiB = size_t(1) << 30;
  static hypic::combine::CombineOptions options() {
    hypic::combine::CombineOptions o;
    o.staged_prior_gb_per_s = 1e-3;  // staging takes an hour
    o.build_prior_tokens_per_s = 1000;
    return o;
  }
  CountingBackend backend{hypic::engine::make_backend(hypic::engine::DeviceSpec{}, hypic::test::kCombineModel)};
  hypic::test::CombineServer c{backend, options(), 0, {}, GiB};
  StagedWorker() {
    backend.device_like = true;
    backend.entry_bytes_each = GiB;
    backend.device_free = 2 * GiB;
  }
  ~StagedWorker() {  // (also after a failed REQUIRE: nothing left held, so the server stops)
    backend.hold = false;
    backend.hold_copies = false;
    backend.device_like = false;
  }
};

TEST_CASE("combine worker: a request arriving while an entry is built after another's first token joins that build",
          "[memory_tier]") {
  StagedWorker w;
  CountingBackend& backend = w.backend;
  hypic::test::CombineServer& c = w.c;
  const auto GiB = StagedWorker::GiB;
  const std::vector<std::vector<int32_t>> segs = {{141, 142, 143, 144}, {145, 146, 147}, {148, 149}};
  const int built0 = backend.built, entered0 = backend.entered;
  const uint64_t joined0 = c.svc->local_build_counts().joined;
  backend.hold = true;  // the builds after A's first token start and wait
  auto a = std::async(std::launch::async, [&] { return combine(c, "after-a", segs, v1::PlannedSegment::LOCAL); });
  REQUIRE(wait_for([&] { return backend.entered > entered0; }));
  CHECK(c.svc->local_build_counts().in_flight == 3);
  // The lookup says so (a router plans such segments warm on this worker).
  CHECK(lookup(c, segs) == std::vector<v1::EntryTier>(3, v1::ENTRY_TIER_BUILDING));
  // B, planned warm, has room for its entries resident (not staged): it joins A's builds.
  backend.device_free = 8 * GiB;
  auto b = std::async(std::launch::async, [&] { return combine(c, "after-b", segs, v1::PlannedSegment::WARM); });
  REQUIRE(wait_for([&] { return c.svc->local_build_counts().joined == joined0 + 3; }));
  // C, planned warm too, would stage its entries: joining the builds (counted whole) and staging is estimated slower
  // than a full prefill here (staging at the prior's 1 MB/s), so C is answered in full and joins nothing.
  backend.device_free = 2 * GiB;
  const double in_full0 = staged_cold_in_full();
  auto cf = std::async(std::launch::async, [&] { return combine(c, "after-c", segs, v1::PlannedSegment::WARM); });
  REQUIRE(wait_for([&] { return staged_cold_in_full() == in_full0 + 1; }));
  backend.hold = false;
  const Combined ra = a.get(), rb = b.get(), rcf = cf.get();
  CHECK(sources(ra) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_IN_CONTEXT));
  CHECK(sources(rb) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_COMPUTED));
  CHECK(sources(rcf) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_IN_CONTEXT));
  for (const auto& seg : rcf.report.segments())
    CHECK_THAT(seg.note(), Catch::Contains("3 of its segments were being built on this worker, and its entries staged: "
                                           "answered by a full prefill"));
  CHECK(rcf.tokens == ra.tokens);  // (both full recomputations of the same prompt)
  CHECK(c.svc->local_build_counts().joined == joined0 + 3);
  for (const auto& seg : rb.report.segments()) {
    CHECK_THAT(seg.note(), Catch::Contains("being built on this worker: joined that build"));
    CHECK_THAT(seg.note(), Catch::Contains("joined this worker's build of the same segment for request after-a"));
  }
  CHECK(backend.built == built0 + 3);  // once each
  // Their host copies reach the host tier (A's entries were staged: no device tier either way here).
  CHECK(wait_for([&] { return lookup(c, segs) == std::vector<v1::EntryTier>(3, v1::ENTRY_TIER_HOST); }));
  CHECK(c.svc->local_build_counts().in_flight == 0);
  // B's tokens are the hypic splice's of these entries: the same as a warm request's from the host tier.
  const Combined warm = combine(c, "after-warm", segs, v1::PlannedSegment::WARM);
  CHECK(sources(warm) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_HOST));
  CHECK(warm.tokens == rb.tokens);
  CHECK(backend.built == built0 + 3);
}

TEST_CASE("combine worker: a request arriving while a built entry's host copy is made takes that copy",
          "[memory_tier]") {
  StagedWorker w;
  CountingBackend& backend = w.backend;
  hypic::test::CombineServer& c = w.c;
  const auto GiB = StagedWorker::GiB;
  const std::vector<std::vector<int32_t>> segs = {{151, 152, 153, 154}, {155, 156, 157}, {158, 159}};
  const int built0 = backend.built;
  backend.hold_copies = true;  // the builds after A's first token finish; their host copies wait
  const Combined ra = combine(c, "copy-a", segs, v1::PlannedSegment::LOCAL);
  CHECK(sources(ra) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_IN_CONTEXT));
  REQUIRE(wait_for([&] { return backend.built == built0 + 3 && c.svc->local_build_counts().in_flight == 0; }));
  // Built, out of the device tier (A was staged), not yet in the host tier: the lookup names the host tier, where it
  // is going (a router plans the segments warm here, not cold).
  CHECK(backend.copies_made == 0);
  CHECK(lookup(c, segs) == std::vector<v1::EntryTier>(3, v1::ENTRY_TIER_HOST));
  CHECK(c.svc->local_build_counts().copies_in_flight == 3);
  // B is staged too: it waits for the pinned copies (no build), and splices them once made.
  const int staged0 = backend.staged_seen;
  auto b = std::async(std::launch::async, [&] { return combine(c, "copy-b", segs, v1::PlannedSegment::WARM); });
  REQUIRE(wait_for([&] { return c.svc->local_build_counts().copy_waiters == 3; }));
  CHECK(b.wait_for(std::chrono::seconds(0)) == std::future_status::timeout);  // (still waiting for the copies)
  // C has room for its entries resident (not staged): it splices the built entries at once, copies or not.
  backend.device_free = 8 * GiB;
  const Combined rc = combine(c, "copy-c", segs, v1::PlannedSegment::WARM);
  CHECK(sources(rc) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_MEMORY));
  for (const auto& seg : rc.report.segments())
    CHECK_THAT(seg.note(), Catch::Contains("its host copy being made: spliced resident"));
  backend.hold_copies = false;
  const Combined rb = b.get();
  CHECK(sources(rb) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_HOST));
  for (const auto& seg : rb.report.segments())
    CHECK_THAT(seg.note(), Catch::Contains("staged from its host copy, made meanwhile"));
  CHECK(backend.staged_seen == staged0 + 3);
  CHECK(backend.built == built0 + 3);  // built once, for A
  CHECK(backend.copies_made == 3);     // one host copy each
  CHECK(c.svc->local_build_counts().copies_in_flight == 0);
  CHECK(lookup(c, segs) == std::vector<v1::EntryTier>(3, v1::ENTRY_TIER_HOST));
  // The same tokens as the resident splice of the same entries, and as a warm request from the host tier.
  CHECK(rb.tokens == rc.tokens);
  const Combined warm = combine(c, "copy-warm", segs, v1::PlannedSegment::WARM);
  CHECK(sources(warm) == std::vector<v1::SegmentSource>(3, v1::SEGMENT_SOURCE_COMBINE_HOST));
  CHECK(warm.tokens == rb.tokens);
  CHECK(backend.built == built0 + 3);
}

TEST_CASE("tier budgets: derived from device memory, host memory and the entry size", "[memory_tier]") {
  constexpr uint64_t GiB = uint64_t(1) << 30;
  hypic::combine::BudgetInputs in;
  in.device_entries = true;
  in.device_free = 40 * GiB;
  in.host_memory = 128 * GiB;
  in.entry_bytes = 280'000'000;
  in.wire_entry_bytes = 330'000'000;
  in.prefix_cache_bytes = GiB;
  in.fetch_parallelism = 4;
  const auto b = hypic::combine::default_tier_budgets(in);
  // 40 GiB free - (4 GiB + 4 GiB + 1 GiB + 4 x 280 MB) = 31 GiB - 1.12 GB
  CHECK(b.device_tier == 40 * GiB - (4 * GiB + 4 * GiB + GiB + 4 * 280'000'000ull));
  CHECK(b.host_tier == 32 * GiB);  // a quarter of host memory, below 256 entries (71.7 GB)
  {
    hypic::combine::BudgetInputs small = in;
    small.entry_bytes = 1'000'000;  // a small model: 256 entries are far below a quarter of the host
    CHECK(hypic::combine::default_tier_budgets(small).host_tier == GiB);
    small.entry_bytes = 10'000'000;
    CHECK(hypic::combine::default_tier_budgets(small).host_tier == 2'560'000'000ull);
  }
  CHECK(b.put_queue == 16 * 330'000'000ull);
  CHECK(b.host_copy_queue == 16 * 280'000'000ull);
  // Room for one request's entries: 40 GiB free - the tier - 1 GiB of prefix checkpoints - 1 GiB of runtime.
  CHECK(hypic::combine::request_entry_room(in, b.device_tier) == 40 * GiB - b.device_tier - 2 * GiB);
  in.device_free = 5 * GiB;  // less than the reserve: no device tier rather than a negative one
  CHECK(hypic::combine::default_tier_budgets(in).device_tier == 0);
  CHECK(hypic::combine::request_entry_room(in, 0) == 3 * GiB);
  in.device_free = GiB;
  CHECK(hypic::combine::request_entry_room(in, 0) == 0);
  in.device_free = 5 * GiB;
  in.device_entries = false;  // CPU: the memory tier is host memory; no host tier; queues at least 1 GiB
  in.entry_bytes = in.wire_entry_bytes = 2'000'000;
  const auto cpu = hypic::combine::default_tier_budgets(in);
  CHECK(cpu.device_tier == 16 * GiB);
  CHECK(cpu.host_tier == 0);
  CHECK(cpu.put_queue == GiB);
  CHECK(cpu.host_copy_queue == GiB);
  CHECK_THAT(hypic::combine::describe_budget(31 * GiB, 280'000'000), Catch::Contains("about 118 entries of 2048 tokens"));
  CHECK_THAT(hypic::combine::describe_budget(0, 280'000'000), Catch::StartsWith("off"));
  CHECK_THAT(hypic::combine::describe_budget(32 << 20, 6'000'000), Catch::StartsWith("32.0 MiB (about 5 entries"));
  // Qwen3.5-35B-A3B: 30 linear layers of 32 value heads of 128 x 128, 10 attention layers of 2 KV heads of 256.
  hypic::engine::EntryGeometry g;
  g.linear_heads = 32, g.d_k = 128, g.d_v = 128, g.conv_rows = 3, g.conv_dim = 8192, g.kv_heads = 2, g.head_dim = 256;
  g.num_linear = 30, g.num_attention = 10;
  const std::string parts = hypic::combine::describe_entry_parts(g, 2048, 2);
  CHECK_THAT(parts, Catch::Contains("3 x 62.9 MB of linear operators"));  // 30 x 32 x 128 x 128 x 4 bytes
  CHECK_THAT(parts, Catch::StartsWith("2048 tokens: 232.2 MB"));  // 3 x 62.9 + 30 x 3 x 8192 x 2 (1.5) + 41.9 MB
  CHECK_THAT(parts, Catch::Contains("(20480 bytes per token)"));           // 10 x 2 x (256 + 256) x 2 bytes
  CHECK_THAT(parts, Catch::Contains("41.9 MB of KV"));
  // Ring-mini-linear-2.0: 16 lightning layers of 16 heads of 128 x 128 (scalar T: 64 bytes per layer), 4 attention
  // layers of 4 KV heads of 128, no conv.
  hypic::engine::EntryGeometry r;
  r.linear_heads = 16, r.d_k = 128, r.d_v = 128, r.kv_heads = 4, r.head_dim = 128, r.num_linear = 16, r.num_attention = 4;
  r.family = int(hypic::engine::ModelFamily::RingLinear), r.linear_rotary_dim = 64;
  const std::string ring = hypic::combine::describe_entry_parts(r, 2048, 2);
  CHECK_THAT(ring, Catch::Contains("2 x 16.8 MB of linear states"));  // 16 x 16 x 128 x 128 x 4 bytes
  CHECK_THAT(ring, Catch::Contains("1024 bytes of scalar T_int"));     // 16 x 16 x 4
  CHECK_THAT(ring, Catch::StartsWith("2048 tokens: 50.3 MB"));        // 2 x 16.78 + 0.001 + 16.78 MB of KV
  // Kimi-Linear-48B-A3B: 20 KDA layers of 32 heads of 128 x 128 (conv tails 3 x 3 x 32 x 128), 7 MLA layers whose
  // entries keep the latent: one row of 512 + 64 values per token and layer, no V.
  hypic::engine::EntryGeometry k;
  k.linear_heads = 32, k.d_k = 128, k.d_v = 128, k.conv_rows = 3, k.conv_dim = 3 * 32 * 128, k.kv_heads = 1,
  k.head_dim = 512 + 64, k.num_linear = 20, k.num_attention = 7;
  k.family = int(hypic::engine::ModelFamily::KimiLinear), k.kv_latent_rank = 512;
  REQUIRE(k.v_dim() == 0);
  const std::string kimi = hypic::combine::describe_entry_parts(k, 2048, 2);
  CHECK_THAT(kimi, Catch::Contains("(8064 bytes per token)"));          // 7 x 1 x (576 + 0) x 2 bytes
  CHECK_THAT(kimi, Catch::Contains("16.5 MB of MLA latent KV"));        // 2048 x 8064
  CHECK_THAT(kimi, Catch::Contains("3 x 41.9 MB of linear operators"));  // 20 x 32 x 128 x 128 x 4 bytes
  CHECK_THAT(kimi, Catch::StartsWith("2048 tokens: 143.8 MB"));         // 3 x 41.94 + 1.47 + 16.51
}
