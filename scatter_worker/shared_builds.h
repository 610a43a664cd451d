// The entry builds of one scatter worker, shared by digest (scatter.proto, "Shared builds").
//
// A worker builds each digest once at a time: a request whose segment is already being built here (queued on the
// engine loop or running), or was built and waits for its cache put, joins that build instead of queueing another,
// and receives the same outcome. The build is put in the segment cache once, when it finishes, whether or not
// anyone still waits for it (if any request that asked for it allowed caching). A build nobody waits for any more is
// dropped while it is still queued (its cancel flag is set; a request joining again before the loop reaches it
// clears the flag, and if the loop skipped it in between it is submitted again), and finishes when it is already
// running (so that the next request for it is a cache hit).
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine_loop.h"
#include "proto/rpc/status.h"

namespace hypic::worker {

/// What one request receives from a (possibly shared) build.
struct SharedOutcome {
  /// The build's outcome (bytes, compute_ms, errors, cancelled: only when the engine loop stops; entry and host are
  /// null for a join of a finished build, which keeps only the bytes). queue_ms is this request's wait: from its
  /// join until the build started (0 when it joined a running or finished build).
  engine::BuildOutcome build;
  bool joined = false;      ///< the build was started for another request, or for an earlier join of this one
  std::string started_for;  ///< the request id the build was started for
};

/// Counters since start (reported in WorkerInfo).
struct SharedBuildCounters {
  uint64_t built = 0;           ///< successful builds (each once, however many requests received it)
  uint64_t joined = 0;          ///< joins of a build in flight (no work of their own)
  uint64_t dropped = 0;         ///< queued builds dropped: no request waited for them any more
  uint64_t orphans_stored = 0;  ///< builds that finished with nobody waiting and were queued for the cache
};

class SharedBuilds {
 public:
  /// Queues a finished build for the segment cache: returns false when it cannot be queued; otherwise it calls
  /// `done` exactly once when the put has ended (cache::AsyncCachePutter::enqueue's contract).
  using StoreFn = std::function<bool(const rpc::Digest& digest, std::vector<int32_t> ids,
                                     std::shared_ptr<const std::string> bytes, std::string request_id,
                                     std::function<void(bool stored)> done)>;

  /// Builds run on `loop`, which must outlive this object and run every build callback before it goes away
  /// (EngineLoop::stop()); `store`'s `done` may come later (it is ignored once this object is gone).
  SharedBuilds(engine::EngineLoop& loop, StoreFn store);
  ~SharedBuilds();
  SharedBuilds(const SharedBuilds&) = delete;
  SharedBuilds& operator=(const SharedBuilds&) = delete;

  /// One request's wait for a build. Destroying it (or leave()) stops the wait: `done` is not called any more,
  /// unless the build was ending at that very moment (then it runs once, maybe after leave returned); when it was
  /// the build's last waiter, the build is dropped if it has not started.
  class Ticket {
   public:
    ~Ticket() { leave(); }
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    void leave();
    bool joined() const { return joined_; }  ///< it joined a build in flight

   private:
    friend class SharedBuilds;
    Ticket(SharedBuilds* owner, rpc::Digest digest, uint64_t waiter, bool joined)
        : owner_(owner), digest_(digest), waiter_(waiter), joined_(joined) {}
    SharedBuilds* owner_;  // null once left
    rpc::Digest digest_;
    uint64_t waiter_;
    bool joined_;
  };

  /// Waits for the entry of `digest` (made from `ids` with seam width `seam_width`; the caller checked that the
  /// digest is theirs): joins the build of this digest in flight here if its ids are the same, else submits one.
  /// `done` runs exactly once unless the ticket is left first: on the engine loop's thread when the build ends, or
  /// on this thread before join returns when the build had already finished (it awaits its cache put). It must be
  /// quick (queue and notify). `cache`: may this request's entry go to the segment cache (a build is stored when any
  /// request that waited for it allowed it). Thread-safe.
  std::unique_ptr<Ticket> join(const rpc::Digest& digest, std::vector<int32_t> ids, int seam_width,
                               const std::string& request_id, bool cache, std::function<void(SharedOutcome)> done);

  SharedBuildCounters counters() const;
  /// Builds tracked: queued, running, or finished and waiting for their cache put.
  size_t in_flight() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Waiter {
    std::function<void(SharedOutcome)> done;
    Clock::time_point joined_at;
    bool joined = false;
  };
  struct Build {
    uint64_t id = 0;  // of the current submission (a resubmission gets a new one)
    std::vector<int32_t> ids;
    int seam_width = 0;
    std::string started_for;
    std::shared_ptr<std::atomic<bool>> cancel;  // set when nobody waits: dropped while queued
    std::shared_ptr<std::atomic<bool>> stop;    // set when nobody waits and it would not be stored: stopped running
    std::map<uint64_t, Waiter> waiters;
    bool store = false;
    Clock::time_point submitted;
    std::shared_ptr<const engine::BuildOutcome> result;  // set once built, while its cache put is pending
  };
  // Shared with the cache puts' callbacks, which may outlive this object.
  struct State {
    mutable std::mutex mu;
    std::map<rpc::Digest, Build> builds;
    void forget(const rpc::Digest& digest, uint64_t build);  // the put of this build ended
  };

  void submit(const rpc::Digest& digest, uint64_t build, std::vector<int32_t> ids, int seam_width,
              engine::CancelFlag cancel, engine::CancelFlag stop);
  void on_built(const rpc::Digest& digest, uint64_t build, engine::BuildOutcome r);
  void leave(const rpc::Digest& digest, uint64_t waiter);

  engine::EngineLoop& loop_;
  StoreFn store_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
  std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> built_{0}, joined_{0}, dropped_{0}, orphans_stored_{0};
};

}  // namespace hypic::worker
