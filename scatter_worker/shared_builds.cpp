#include "scatter_worker/shared_builds.h"

#include <algorithm>

#include <spdlog/spdlog.h>

namespace hypic::worker {

namespace {
double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
}  // namespace

SharedBuilds::SharedBuilds(engine::EngineLoop& loop, StoreFn store) : loop_(loop), store_(std::move(store)) {}

SharedBuilds::~SharedBuilds() = default;

void SharedBuilds::Ticket::leave() {
  if (!owner_) return;
  owner_->leave(digest_, waiter_);
  owner_ = nullptr;
}

std::unique_ptr<SharedBuilds::Ticket> SharedBuilds::join(const rpc::Digest& digest, std::vector<int32_t> ids,
                                                         int seam_width, const std::string& request_id, bool cache,
                                                         std::function<void(SharedOutcome)> done) {
  const uint64_t waiter = next_id_++;
  std::unique_lock<std::mutex> lock(state_->mu);
  auto it = state_->builds.find(digest);
  if (it != state_->builds.end() && it->second.ids == ids && it->second.seam_width == seam_width) {
    Build& b = it->second;
    ++joined_;
    b.store = b.store || cache;
    if (b.result) {  // built, waiting for its cache put: hand it over now
      SharedOutcome o{*b.result, true, b.started_for};
      o.build.queue_ms = 0;
      lock.unlock();
      spdlog::debug("[req {}] {}: joined the finished build of request {}", request_id, rpc::digest_hex(digest),
                    o.started_for);
      done(std::move(o));
      return std::unique_ptr<Ticket>(new Ticket(nullptr, digest, waiter, true));
    }
    b.cancel->store(false);  // wanted again if every earlier waiter had gone
    b.stop->store(false);
    b.waiters.emplace(waiter, Waiter{std::move(done), Clock::now(), true});
    spdlog::debug("[req {}] {}: joined the build of request {}", request_id, rpc::digest_hex(digest), b.started_for);
    return std::unique_ptr<Ticket>(new Ticket(this, digest, waiter, true));
  }
  if (it != state_->builds.end()) {
    // Same digest, other ids or seam width (a 128-bit collision, or a caller's bad key): built on its own, unshared
    // and not registered (nor dropped when its request goes: this is never expected to happen).
    lock.unlock();
    spdlog::warn("[req {}] {}: a build with this digest but other token ids is in flight; building separately",
                 request_id, rpc::digest_hex(digest));
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    auto shared_done = std::make_shared<std::function<void(SharedOutcome)>>(std::move(done));
    loop_.submit_build(std::move(ids), seam_width, cancel, [shared_done, request_id](engine::BuildOutcome r) {
      (*shared_done)(SharedOutcome{std::move(r), false, request_id});
    });
    return std::unique_ptr<Ticket>(new Ticket(nullptr, digest, waiter, false));
  }
  Build b;
  b.id = next_id_++;
  b.ids = ids;
  b.seam_width = seam_width;
  b.started_for = request_id;
  b.cancel = std::make_shared<std::atomic<bool>>(false);
  b.stop = std::make_shared<std::atomic<bool>>(false);
  b.store = cache;
  b.submitted = Clock::now();
  b.waiters.emplace(waiter, Waiter{std::move(done), b.submitted, false});
  const uint64_t build = b.id;
  engine::CancelFlag cancel = b.cancel, stop = b.stop;
  state_->builds.emplace(digest, std::move(b));
  lock.unlock();
  submit(digest, build, std::move(ids), seam_width, std::move(cancel), std::move(stop));
  return std::unique_ptr<Ticket>(new Ticket(this, digest, waiter, false));
}

void SharedBuilds::submit(const rpc::Digest& digest, uint64_t build, std::vector<int32_t> ids, int seam_width,
                          engine::CancelFlag cancel, engine::CancelFlag stop) {
  // Not under the lock: a stopped loop calls back at once, on this thread.
  loop_.submit_build(
      std::move(ids), seam_width, std::move(cancel),
      [this, digest, build](engine::BuildOutcome r) { on_built(digest, build, std::move(r)); },
      engine::BuildHandover::Wire, std::move(stop));
}

void SharedBuilds::leave(const rpc::Digest& digest, uint64_t waiter) {
  std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->builds.find(digest);
  if (it == state_->builds.end()) return;
  Build& b = it->second;
  if (b.waiters.erase(waiter) && b.waiters.empty() && !b.result) {
    b.cancel->store(true);                // dropped while queued
    if (!b.store) b.stop->store(true);    // and stopped while running when its entry would be thrown away
  }
}

void SharedBuilds::on_built(const rpc::Digest& digest, uint64_t build, engine::BuildOutcome r) {
  std::map<uint64_t, Waiter> waiters;
  std::string started_for;
  std::vector<int32_t> ids;
  Clock::time_point started;
  bool store = false;
  {
    std::unique_lock<std::mutex> lock(state_->mu);
    auto it = state_->builds.find(digest);
    if (it == state_->builds.end() || it->second.id != build) return;  // cannot happen: one callback per submission
    Build& b = it->second;
    if (r.cancelled && !b.waiters.empty() && !loop_.stopping()) {
      // Skipped in the moment nobody waited for it, but joined again since: build it after all.
      b.id = next_id_++;
      b.cancel = std::make_shared<std::atomic<bool>>(false);
      b.stop = std::make_shared<std::atomic<bool>>(false);
      b.submitted = Clock::now();
      const uint64_t again = b.id;
      std::vector<int32_t> again_ids = b.ids;
      const int w = b.seam_width;
      engine::CancelFlag cancel = b.cancel, stop = b.stop;
      lock.unlock();
      submit(digest, again, std::move(again_ids), w, std::move(cancel), std::move(stop));
      return;
    }
    waiters.swap(b.waiters);
    started_for = b.started_for;
    started = b.submitted + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(r.queue_ms));
    const bool ok = !r.cancelled && r.error.empty();
    store = ok && b.store;
    if (store) {
      // Joinable until its cache put ends: the wire bytes only (not the backend-resident entry, which may hold
      // device memory, nor its host copy).
      auto kept = std::make_shared<engine::BuildOutcome>(r);
      kept->entry.reset();
      kept->host.reset();
      b.result = std::move(kept);
      ids = b.ids;
    } else {
      state_->builds.erase(it);
    }
    if (ok) ++built_;
    if (r.cancelled && waiters.empty()) {
      ++dropped_;
      spdlog::info("[req {}] {} of {} dropped: no request waits for it any more", started_for,
                   r.batch_ms > 0 ? "running build (stopped part way)" : "queued build", rpc::digest_hex(digest));
    } else if (ok && !store && waiters.empty()) {
      spdlog::info("[req {}] build of {} finished after every request waiting for it had gone: discarded (caching "
                   "not allowed or no cache)",
                   started_for, rpc::digest_hex(digest));
    }
  }
  if (store) {
    std::weak_ptr<State> state = state_;
    const bool queued = store_(digest, std::move(ids), r.bytes, started_for, [state, digest, build](bool) {
      if (auto s = state.lock()) s->forget(digest, build);
    });
    if (!queued) state_->forget(digest, build);
    if (waiters.empty()) {
      if (queued) ++orphans_stored_;
      spdlog::info("[req {}] build of {} finished after every request waiting for it had gone: {}", started_for,
                   rpc::digest_hex(digest), queued ? "queued for the segment cache" : "the cache put was dropped");
    }
  }
  for (auto& [id, w] : waiters) {
    SharedOutcome o{r, w.joined, started_for};
    o.build.queue_ms = std::max(0.0, ms_between(w.joined_at, started));
    w.done(std::move(o));
  }
}

void SharedBuilds::State::forget(const rpc::Digest& digest, uint64_t build) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = builds.find(digest);
  if (it != builds.end() && it->second.id == build && it->second.result) builds.erase(it);
}

SharedBuildCounters SharedBuilds::counters() const {
  return {built_.load(), joined_.load(), dropped_.load(), orphans_stored_.load()};
}

size_t SharedBuilds::in_flight() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->builds.size();
}

}  // namespace hypic::worker
