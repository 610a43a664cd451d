// A scatter worker's shared builds (scatter_worker/shared_builds.h) on a real engine loop (CPU backend, fixture
// model): requests of one digest share one build and all receive it, also while its cache put is pending; a failed
// build fails every waiter; a queued build nobody waits for is dropped, a running one finishes and is stored; a
// request rejoining an abandoned queued build gets it built.
#include <catch2/catch.hpp>

#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "engine/cpu/cpu_backend.h"
#include "engine/engine_loop.h"
#include "scatter_worker/shared_builds.h"

using namespace hypic::engine;
using namespace hypic::worker;

namespace {

CpuBackend& backend() {
  static std::unique_ptr<CpuBackend> b = CpuBackend::load(std::string(HYPIC_SOURCE_DIR) + "/tests/fixtures/qwen3_next_moe");
  return *b;
}

hypic::rpc::Digest digest_of(uint8_t n) {
  hypic::rpc::Digest d{};
  d.fill(n);
  return d;
}
// n token ids from `base` on (the fixture's vocabulary has 256 ids).
std::vector<int32_t> ids_of(int n, int32_t base) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ids[size_t(i)] = (base + 3 * i) % 256;
  return ids;
}

// The outcomes one test receives, by name; and the cache puts it was asked for.
struct Harness {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, SharedOutcome> got;
  std::vector<std::string> stored;                  // request ids of the puts
  std::vector<std::function<void(bool)>> pending;   // their done callbacks, called by the test
  bool accept_puts = true;

  SharedBuilds::StoreFn store() {
    return [this](const hypic::rpc::Digest&, std::vector<int32_t>, std::shared_ptr<const std::string>,
                  std::string request_id, std::function<void(bool)> done) {
      std::lock_guard<std::mutex> lock(mu);
      if (!accept_puts) return false;
      stored.push_back(request_id);
      pending.push_back(std::move(done));
      cv.notify_all();
      return true;
    };
  }
  std::function<void(SharedOutcome)> receiver(const std::string& name) {
    return [this, name](SharedOutcome o) {
      std::lock_guard<std::mutex> lock(mu);
      got.emplace(name, std::move(o));
      cv.notify_all();
    };
  }
  void wait_for(const std::function<bool()>& ready) {
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, std::chrono::seconds(60), ready));
  }
  SharedOutcome outcome(const std::string& name) {
    wait_for([&] { return got.count(name) > 0; });
    std::lock_guard<std::mutex> lock(mu);
    return got.at(name);
  }
  bool has(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu);
    return got.count(name) > 0;
  }
  std::vector<std::string> stores() {
    std::lock_guard<std::mutex> lock(mu);
    return stored;
  }
  void finish_puts() {
    std::vector<std::function<void(bool)>> done;
    {
      std::lock_guard<std::mutex> lock(mu);
      done.swap(pending);
    }
    for (auto& d : done) d(true);
  }
};

// Holds the loop thread inside a build callback until released, so that what is submitted meanwhile stays queued.
struct LoopBlocker {
  std::promise<void> entered, release;
  explicit LoopBlocker(EngineLoop& loop) {
    std::shared_future<void> released = release.get_future().share();
    // Resident: its callback runs on the loop thread, which it holds (a Wire build's would run on the egress
    // thread, leaving the loop free to start the builds queued behind it).
    loop.submit_build(ids_of(3, 250), 0, nullptr, [this, released](BuildOutcome) {
      entered.set_value();
      released.wait();
    }, BuildHandover::Resident);
    entered.get_future().wait();
  }
  void open() { release.set_value(); }
};

}  // namespace

TEST_CASE("shared builds: one build per digest for every waiter, joinable until its cache put ends",
          "[shared_builds]") {
  EngineLoop loop(backend());
  Harness h;
  {
    SharedBuilds builds(loop, h.store());
    const auto a = digest_of(1), b = digest_of(2);
    std::vector<std::unique_ptr<SharedBuilds::Ticket>> tickets;
    {
      LoopBlocker block(loop);
      tickets.push_back(builds.join(a, ids_of(20, 10), 4, "r1", true, h.receiver("r1")));
      tickets.push_back(builds.join(a, ids_of(20, 10), 4, "r2", false, h.receiver("r2")));
      tickets.push_back(builds.join(b, ids_of(12, 70), 4, "r3", true, h.receiver("r3")));
      CHECK_FALSE(tickets[0]->joined());
      CHECK(tickets[1]->joined());
      CHECK_FALSE(tickets[2]->joined());
      CHECK(builds.in_flight() == 2);
      block.open();
    }
    const SharedOutcome r1 = h.outcome("r1"), r2 = h.outcome("r2"), r3 = h.outcome("r3");
    REQUIRE(r1.build.error.empty());
    REQUIRE(r1.build.bytes);
    CHECK(r2.build.bytes == r1.build.bytes);  // the same build
    CHECK(r3.build.bytes != r1.build.bytes);
    CHECK_FALSE(r1.joined);
    CHECK(r2.joined);
    CHECK(r2.started_for == "r1");
    CHECK(r1.build.entry->num_tokens() == 20);
    // Stored once each (r2 did not allow caching, r1 did).
    h.wait_for([&] { return h.stored.size() == 2; });
    CHECK(h.stores() == std::vector<std::string>{"r1", "r3"});

    // While the puts are pending a new request for `a` receives the finished build at once, without a build.
    auto late = builds.join(a, ids_of(20, 10), 4, "r4", true, h.receiver("r4"));
    CHECK(late->joined());
    CHECK(h.outcome("r4").build.bytes == r1.build.bytes);
    CHECK_FALSE(h.outcome("r4").build.entry);  // only the bytes are kept after the build
    auto c = builds.counters();
    CHECK(c.built == 2);
    CHECK(c.joined == 2);
    CHECK(builds.in_flight() == 2);

    // Once the puts have ended the builds are forgotten: the next request builds again.
    h.finish_puts();
    CHECK(builds.in_flight() == 0);
    tickets.push_back(builds.join(a, ids_of(20, 10), 4, "r5", true, h.receiver("r5")));
    CHECK_FALSE(tickets.back()->joined());
    CHECK(h.outcome("r5").build.bytes != r1.build.bytes);
    CHECK(builds.counters().built == 3);
    loop.stop();  // every build callback has run before `builds` goes
  }
}

TEST_CASE("shared builds: a failed build fails every waiter and is not kept", "[shared_builds]") {
  EngineLoop loop(backend());
  Harness h;
  {
    SharedBuilds builds(loop, h.store());
    const auto a = digest_of(3);
    auto bad = ids_of(10, 10);
    bad[4] = int32_t(backend().config().vocab_size) + 7;  // outside the vocabulary: the engine refuses it
    std::vector<std::unique_ptr<SharedBuilds::Ticket>> tickets;
    {
      LoopBlocker block(loop);
      tickets.push_back(builds.join(a, bad, 4, "r1", true, h.receiver("r1")));
      tickets.push_back(builds.join(a, bad, 4, "r2", true, h.receiver("r2")));
      block.open();
    }
    CHECK_FALSE(h.outcome("r1").build.error.empty());
    CHECK(h.outcome("r2").build.error == h.outcome("r1").build.error);
    CHECK(builds.in_flight() == 0);
    CHECK(builds.counters().built == 0);
    CHECK(h.stores().empty());
    loop.stop();
  }
}

TEST_CASE("shared builds: nobody waiting drops a queued build, a running one finishes and is stored, a rejoined "
          "queued build is built",
          "[shared_builds]") {
  EngineLoopOptions opt;
  opt.inject_delay = std::chrono::milliseconds(1500);  // every build runs 1.5 s: long enough to leave it running
  EngineLoop loop(backend(), opt);
  Harness h;
  {
    SharedBuilds builds(loop, h.store());
    const auto a = digest_of(4), b = digest_of(5);
    {
      LoopBlocker block(loop);
      // Queued, then abandoned by its only waiter: dropped when the loop reaches it.
      builds.join(a, ids_of(16, 20), 4, "gone", true, h.receiver("gone"))->leave();
      // Abandoned, then joined again before the loop reaches it: built for the new waiter.
      builds.join(b, ids_of(16, 30), 4, "gone-too", true, h.receiver("gone-too"))->leave();
      auto back = builds.join(b, ids_of(16, 30), 4, "back", true, h.receiver("back"));
      CHECK(back->joined());
      block.open();
      CHECK(h.outcome("back").build.error.empty());
    }
    CHECK_FALSE(h.has("gone"));
    CHECK_FALSE(h.has("gone-too"));
    auto c = builds.counters();
    CHECK(c.dropped == 1);
    CHECK(c.built == 1);
    CHECK(c.orphans_stored == 0);

    // A running build whose waiter goes (a deadline): it finishes and goes to the cache.
    h.finish_puts();
    const size_t puts_before = h.stores().size();
    auto t = builds.join(digest_of(6), ids_of(16, 40), 4, "late", true, h.receiver("late"));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the loop is inside the 1.5 s build by now
    t->leave();
    h.wait_for([&] { return h.stored.size() == puts_before + 1; });
    CHECK(h.stores().back() == "late");
    CHECK_FALSE(h.has("late"));
    // The counter is raised on the loop thread just after the put was accepted, so it may lag the put by a moment.
    for (int i = 0; i < 2000 && builds.counters().orphans_stored == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    c = builds.counters();
    CHECK(c.orphans_stored == 1);
    CHECK(c.dropped == 1);
    h.finish_puts();
    loop.stop();
  }
}
