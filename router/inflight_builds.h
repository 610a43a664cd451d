// Cold segments in flight on scatter workers, shared between requests (router.proto, "Shared builds").
//
// The plan of a request's cold segments: a segment whose digest is already being built for another request, on a
// scatter worker that is available (and not excluded by this request, e.g. after it failed there), joins that
// build: it goes to the same worker, which builds the digest once for all of them (scatter_worker/shared_builds.h),
// and adds no queued work. The other segments are assigned by the ScatterScheduler (LPT or round-robin) and
// registered, so that later requests join them. A build is tracked per (digest, worker) while some request holds it
// (from its plan until it releases it: its worker failed, or the request ended), so a request that failed on one
// worker plans the segment again elsewhere and the requests after it join that rebuild: one rebuild for all.
// A build's tokens count in its worker's queued work until the first Computed event for it (or until its last
// holder lets go).
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "proto/rpc/status.h"
#include "router/scheduler.h"

namespace hypic::router {

/// One cold segment of a request to plan: a scheduler job (segment index, tokens) and its digest.
struct BuildJob : ScatterJob {
  rpc::Digest digest{};  ///< the segment's digest (model, entry format, seam width, token ids)
};

/// Where a job goes: the scheduler's assignment (segment, worker, tokens), or a build in flight joined.
struct PlannedBuild : Assignment {
  bool joined = false;  ///< it joins a build that another holder started (no work added)
};

/// The shared registry of builds in flight. Thread-safe.
class InflightBuilds {
 public:
  /// `scheduler` assigns new builds and keeps the queued work; it must outlive this object.
  explicit InflightBuilds(ScatterScheduler& scheduler) : scheduler_(scheduler) {}

  /// Plans `jobs` (several jobs of one digest are planned as one build). Each job joins a build of its digest held
  /// by some request on an available worker not marked in `exclude` (indexed by worker, may be shorter); the others
  /// are assigned by the scheduler, with its policy and `exclude`, and registered. Returns one plan per job that got
  /// a worker: the joined ones first, then the new ones in the scheduler's dispatch order; a job left out had no
  /// worker (none available: the caller computes it elsewhere). Every returned plan is a hold on (digest, worker)
  /// that the caller must give back with release() exactly once. Throws std::invalid_argument for tokens < 1.
  std::vector<PlannedBuild> plan(std::span<const BuildJob> jobs, const std::vector<bool>& exclude = {});

  /// A Computed event came for the build of `digest` on `worker`: its tokens leave the worker's queued work (once
  /// per build; later calls and unknown builds are ignored).
  void computed(const rpc::Digest& digest, size_t worker);

  /// Gives back one hold. The last one forgets the build (and removes its tokens if not computed yet).
  void release(const rpc::Digest& digest, size_t worker);

  /// Builds tracked now, and holds on them in all.
  size_t builds() const;
  size_t holds() const;

 private:
  struct Build {
    int64_t tokens = 0;
    uint32_t holds = 0;
    bool load_pending = true;  // its tokens are in the worker's queued work
  };
  using Key = std::pair<rpc::Digest, size_t>;  // (digest, worker)

  ScatterScheduler& scheduler_;
  mutable std::mutex mu_;  // taken before the scheduler's
  std::map<Key, Build> builds_;
};

}  // namespace hypic::router
