#include "router/service.h"

#include "router/segment_plan.h"

#include "proto/rpc/log_limit.h"

#include "router/metrics.h"

#include <algorithm>
#include <map>
#include <optional>
#include <random>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "engine/backend.h"
#include "engine/segment.h"
#include "proto/rpc/status.h"

namespace hypic::router {

namespace v1 = hypic::v1;
using Clock = std::chrono::steady_clock;

namespace {
constexpr uint32_t kLocal = UINT32_MAX;  // SegState::worker of a segment the combine worker prefills

}  // namespace

RouterService::RouterService(const engine::Tokenizer& tokenizer, RouterModel model, RouterConfig config,
                             rpc::Lifecycle& life)
    : tokenizer_(tokenizer), model_(std::move(model)), cfg_(std::move(config)), life_(life),
      cache_(cfg_.cache_replicas, cache::SegmentCacheClient::Options{160, cfg_.lookup_timeout, rpc::kChunkBytes}) {
  if (cfg_.combine_workers.empty()) throw std::invalid_argument("--combine: at least one combine worker is required");
  if (cfg_.max_scatter_attempts < 1) throw std::invalid_argument("--max-scatter-attempts: must be >= 1");
  for (const auto& a : cfg_.scatter_workers) {
    auto w = std::make_unique<Worker>();
    w->address = a;
    w->channel = rpc::make_channel(a);
    w->scatter = v1::ScatterWorker::NewStub(w->channel);
    scatter_.push_back(std::move(w));
  }
  for (const auto& a : cfg_.combine_workers) {
    auto w = std::make_unique<Worker>();
    w->address = a;
    w->channel = rpc::make_channel(a);
    w->combine = v1::CombineWorker::NewStub(w->channel);
    combine_.push_back(std::move(w));
  }
  if (!scatter_.empty()) {
    scheduler_ = std::make_unique<ScatterScheduler>(scatter_.size(), cfg_.policy);
    builds_ = std::make_unique<InflightBuilds>(*scheduler_);
  }
  if (!model_.numerics.empty()) {
    numerics_ = model_.numerics;
    fingerprint_ = engine::model_fingerprint(model_.config, numerics_);
    numerics_from_ = "--numerics";
  }
  probe_workers();
  prober_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(probe_mu_);
    while (true) {  // every health_interval, or at once when a request finds no combine worker (probe_now_)
      probe_cv_.wait_for(lock, cfg_.health_interval, [&] { return stop_probe_ || probe_now_; });
      if (stop_probe_) break;
      probe_now_ = false;
      lock.unlock();
      probe_workers();
      lock.lock();
    }
  });
}

RouterService::~RouterService() {
  {
    std::lock_guard<std::mutex> lock(probe_mu_);
    stop_probe_ = true;
  }
  probe_cv_.notify_all();
  prober_.join();
}

void RouterService::set_scatter_available(size_t worker, bool available) {
  Worker& w = *scatter_[worker];
  if (w.available.exchange(available) != available) {
    spdlog::log(available ? spdlog::level::info : spdlog::level::warn, "scatter worker {} is {}", w.address,
                available ? "available" : "out of rotation");
  }
  scheduler_->set_available(worker, available);
}

std::pair<std::string, std::string> RouterService::numerics_and_fingerprint() const {
  std::lock_guard<std::mutex> lock(numerics_mu_);
  return {numerics_, fingerprint_};
}

template <class Service>
bool RouterService::probe(Worker& w) {
  if (rpc::check_health(w.channel, Service::service_full_name(), std::chrono::milliseconds(1500)) != 1) return false;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1500));
  v1::WorkerInfo info;
  if (!Service::NewStub(w.channel)->GetWorkerInfo(&ctx, v1::WorkerInfoRequest{}, &info).ok()) return false;
  {
    std::lock_guard<std::mutex> lock(w.info_mu);
    w.numerics = info.numerics();
    w.device = info.device();
    w.counters = info;
  }
  // Same model: the worker's fingerprint is the backend fingerprint of the router's config under its numerics (and,
  // for a benchmark-only worker with seeded random weights, under that seed's weights identity).
  std::string why;
  engine::ModelConfig expected = model_.config;
  if (info.random_weights_seed() != 0) expected.weights_digest = engine::random_weights_digest(info.random_weights_seed());
  if (info.model_fingerprint() != engine::model_fingerprint(expected, info.numerics())) {
    why = fmt::format("serves model {} (numerics '{}'), not the router's model (config {})", info.model_fingerprint(),
                      info.numerics(), model_.config.fingerprint());
  } else {
    std::lock_guard<std::mutex> lock(numerics_mu_);
    if (numerics_.empty()) {
      numerics_ = info.numerics();
      fingerprint_ = info.model_fingerprint();
      numerics_from_ = "worker " + w.address;
      spdlog::info("cluster numerics {} (fingerprint {}), learned from worker {}", numerics_, fingerprint_, w.address);
      if (info.random_weights_seed() != 0)
        spdlog::warn("BENCHMARK ONLY: worker {} runs seeded random weights (seed {}): the text is meaningless",
                     w.address, info.random_weights_seed());
    } else if (info.numerics() != numerics_) {
      why = fmt::format("computes numerics {} but the cluster's are {} (from {}): entries of mixed numerics are "
                        "never spliced together",
                        info.numerics(), numerics_, numerics_from_);
    } else if (info.model_fingerprint() != fingerprint_) {
      why = fmt::format("computes under fingerprint {} (numerics {}{}) but the cluster's is {} (from {}): entries "
                        "of other weights are never spliced together",
                        info.model_fingerprint(), info.numerics(),
                        info.random_weights_seed() ? fmt::format(", random weights seed {}", info.random_weights_seed())
                                                   : std::string(),
                        fingerprint_, numerics_from_);
    }
  }
  const bool bad = !why.empty();
  if (bad && !w.model_mismatch.exchange(true)) spdlog::error("worker {} {}: not using it", w.address, why);
  if (!bad) w.model_mismatch.store(false);
  return !bad;
}

void RouterService::probe_workers() {
  // A worker leaves the rotation after two failed probes in a row (one slow answer on a loaded host is not a
  // fault; a call that fails with UNAVAILABLE takes it out at once), and comes back after one good probe.
  // Before its first good probe a worker is out of rotation.
  auto verdict = [](Worker& w, bool ok) {
    w.failed_probes = ok ? 0 : w.failed_probes + 1;
    return ok || (w.available.load() && w.failed_probes < 2);
  };
  for (size_t i = 0; i < scatter_.size(); ++i) {
    const bool ok = probe<v1::ScatterWorker>(*scatter_[i]);
    set_scatter_available(i, verdict(*scatter_[i], ok) && !scatter_[i]->model_mismatch.load());
  }
  for (auto& w : combine_) {
    const bool ok = verdict(*w, probe<v1::CombineWorker>(*w)) &&
                    !w->model_mismatch.load();
    if (w->available.exchange(ok) != ok) {
      spdlog::log(ok ? spdlog::level::info : spdlog::level::warn, "combine worker {} is {}", w->address,
                  ok ? "available" : "out of rotation");
    }
  }
}

RouterService::Worker* RouterService::wait_for_combine(std::chrono::system_clock::time_point deadline,
                                                       const std::vector<size_t>* held, grpc::ServerContextBase* call) {
  if (Worker* w = pick_combine(held)) return w;
  const auto until = std::min(deadline, std::chrono::system_clock::now() + cfg_.combine_wait);
  while (std::chrono::system_clock::now() < until) {
    if (call && call->IsCancelled()) return nullptr;
    {
      std::lock_guard<std::mutex> lock(probe_mu_);
      if (stop_probe_) return nullptr;
      probe_now_ = true;
    }
    probe_cv_.notify_all();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (Worker* w = pick_combine(held)) return w;
  }
  return nullptr;
}

// CombineWorker.LookupEntries takes at most this many digests per call.
constexpr size_t kMaxTierLookup = 4096;

RouterService::Worker* RouterService::pick_combine(const std::vector<size_t>* held) {
  Worker* best = nullptr;
  size_t best_held = 0;
  const size_t n = combine_.size();
  const size_t start = combine_turn_++ % n;  // rotate among equally loaded workers
  uint32_t least = std::numeric_limits<uint32_t>::max();
  for (const auto& w : combine_)
    if (w->available.load()) least = std::min(least, w->active.load());
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (start + k) % n;
    Worker* w = combine_[i].get();
    if (!w->available.load()) continue;
    // Held entries count only where the worker is not much busier than the least busy one.
    const bool near = w->active.load() <= least + cfg_.combine_affinity_slack;
    const size_t h = held && i < held->size() && near ? (*held)[i] : 0;
    if (!best || h > best_held || (h == best_held && w->active.load() < best->active.load())) {
      best = w;
      best_held = h;
    }
  }
  return best;
}

std::vector<std::vector<v1::EntryTier>> RouterService::lookup_combine_tiers(const std::vector<rpc::Digest>& digests,
                                                                            const grpc::ServerContextBase* parent) {
  std::vector<std::vector<v1::EntryTier>> out(combine_.size());
  v1::LookupEntriesRequest req;
  for (const auto& d : digests) req.add_digests(rpc::digest_bytes(d));
  const auto now_ms = [] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
  };
  auto ask = [&](size_t i) {
    Worker& w = *combine_[i];
    if (!w.available.load() || digests.empty() || now_ms() < w.tier_lookup_off_until_ms.load()) return;
    std::vector<v1::EntryTier> tiers;
    // In calls of at most 4096 digests (the worker's limit), within one budget.
    const auto until = std::chrono::system_clock::now() + cfg_.tier_lookup_timeout;
    for (size_t off = 0; off < digests.size(); off += kMaxTierLookup) {
      v1::LookupEntriesRequest part;
      for (size_t k = off; k < std::min(digests.size(), off + kMaxTierLookup); ++k) *part.add_digests() = req.digests(int(k));
      auto cctx = rpc::make_client_context(parent);
      cctx->set_deadline(std::min(cctx->deadline(), until));
      v1::LookupEntriesResponse resp;
      const grpc::Status st = w.combine->LookupEntries(cctx.get(), part, &resp);
      if (!st.ok() || resp.tiers_size() != part.digests_size()) {
        w.tier_lookup_off_until_ms.store(now_ms() + 5000);
        static rpc::LogLimit limit;
        uint64_t unlogged = 0;
        if (limit.allow(&unlogged))
          spdlog::warn("combine worker {}: tier lookup failed ({}): its tiers count as empty, not asked again for 5 s{}",
                       w.address, st.ok() ? "wrong answer size" : rpc::describe(st),
                       unlogged ? fmt::format(" ({} more such failures since the last line)", unlogged) : std::string());
        return;
      }
      for (int t : resp.tiers()) tiers.push_back(v1::EntryTier(t));
    }
    out[i] = std::move(tiers);
  };
  if (combine_.size() == 1) {
    ask(0);
    return out;
  }
  std::vector<std::thread> threads;
  for (size_t i = 0; i < combine_.size(); ++i) threads.emplace_back(ask, i);
  for (auto& t : threads) t.join();
  return out;
}

// ---------------------------------------------------------------------------------------------
// One Generate call.
class GenerateCall {
 public:
  GenerateCall(RouterService& svc, grpc::ServerContext* ctx, const v1::GenerateRequest& req,
               grpc::ServerWriter<v1::GenerateResponse>* writer)
      : svc_(svc), ctx_(ctx), req_(req), writer_(writer) {}
  ~GenerateCall() {
    stop_scatter();
    release_leases();
    if (lease_release_.joinable()) lease_release_.join();
  }
  grpc::Status run();

 private:
  // The request's phase in the router's gauges: waiting until the first token, running after it (vLLM's
  // num_requests_waiting / running).
  struct Phase {
    RouterMetrics& m;
    bool running = false;
    explicit Phase(RouterMetrics& m) : m(m) { m.waiting.inc(); }
    void first_token() {
      m.waiting.dec();
      m.running.inc();
      running = true;
    }
    ~Phase() { running ? m.running.dec() : m.waiting.dec(); }
  };
  struct SegState {
    std::vector<int32_t> ids;
    rpc::Digest digest{};
    bool hit = false;
    bool cache_hit = false;  // hit in the segment cache (hit also counts the chosen combine worker's tiers)
    bool whole = false;  // cold and in the refresh's tail: recomputed whole by the splice, nothing built for it now
    v1::EntryTier combine_tier = v1::ENTRY_TIER_NONE;  // the chosen combine worker holds it in this tier
    std::optional<uint32_t> repeat_of;  // an earlier segment of the same digest: planned once, as that one
    uint32_t worker = kLocal;           // current scatter assignee
    bool held = false;                  // holds the in-flight build (digest, worker) in svc_.builds_
    bool delivered = false;
    std::string delivery_note;  // the scatter worker's: why the entry went over gRPC where NCCL was tried
    uint32_t attempts = 0;
  };

  void tokenise();
  std::vector<std::vector<v1::EntryTier>> lookup();
  /// refused: the previous attempt's combine worker's refusal (empty on the first), named in the error when no
  /// combine worker becomes available. Sets tier_hits_.
  void choose_combine(const std::vector<std::vector<v1::EntryTier>>& tiers, const std::string& refused);
  /// Undoes one attempt before planning again on another combine worker: releases its held builds, keeps only the
  /// segment cache's hits, and clears what an attempt that had started left (its scatter calls, joined by
  /// stop_scatter; deliveries; the combine worker's events). Nothing reached the client.
  void reset_plan();
  std::map<size_t, std::vector<uint32_t>> plan();
  v1::CombineRequest combine_request();
  /// *retryable: set when the call failed with UNAVAILABLE (a combine worker that died, or one shutting down; or its
  /// ComputeLocally did, which ended the call; a worker whose drain ran out ends its calls so too) before anything
  /// reached the client: before the combine worker's Started event (nothing launched), or after it with no token
  /// streamed yet (*started also set: the attempt's scatter builds are stopped). The request may then be planned
  /// again on another combine worker, or on the same one back.
  grpc::Status stream_combine(const v1::CombineRequest& creq, const std::map<size_t, std::vector<uint32_t>>& by_worker,
                              Phase& phase, bool* retryable, bool* started);
  grpc::Status write_report();
  void launch_locked(size_t worker, const std::vector<uint32_t>& segments);
  void on_event(size_t worker, const v1::PrefillEvent& ev);
  void on_failure(size_t worker, const std::vector<uint32_t>& segments, const grpc::Status& st);
  void compute_locally(const std::vector<uint32_t>& segments, const std::string& reason);
  /// Plans segments `jobs` on scatter workers (joining builds in flight, see router/inflight_builds.h), excluding
  /// the workers in failed_; records the assignees and returns them by worker. Segments left without a worker are
  /// appended to `local`.
  std::map<size_t, std::vector<uint32_t>> plan_builds_locked(const std::vector<uint32_t>& jobs,
                                                             std::vector<uint32_t>& local);
  void release_build_locked(SegState& s);
  /// Ends the leases this request's lookup took (once; in the background, joined by the destructor).
  void release_leases();
  void stop_scatter();
  std::unique_ptr<grpc::ClientContext> child_context() const {
    return rpc::make_client_context(ctx_, std::chrono::milliseconds(svc_.cfg_.default_deadline));
  }

  RouterService& svc_;
  grpc::ServerContext* ctx_;
  const v1::GenerateRequest& req_;
  grpc::ServerWriter<v1::GenerateResponse>* writer_;
  std::string rid_;
  RequestOptions opts_;
  std::vector<int32_t> query_;
  RouterService::Worker* combine_ = nullptr;
  bool cache_available_ = false;
  std::vector<uint32_t> jobs_;  // the segments to build (router/segment_plan.h)
  uint64_t seed_ = 0;           // the sampling seed sent (and reported)
  // The call's clock: start, lookup, dispatch to the scatter workers, and the combine worker's events.
  Clock::time_point t0_, t_lookup0_, t_lookup1_, t_dispatch_;
  std::optional<Clock::time_point> t_ready_, t_spliced_, t_first_;
  // The combine worker's own time for its engine phase (SpliceDone: queue + splice), ms.
  double engine_ms_ = 0;
  std::optional<v1::CombineReport> creport_;
  uint32_t completion_ = 0;  // tokens streamed to the client

  std::mutex mu_;
  std::vector<SegState> segs_;
  std::vector<std::thread> threads_;
  std::vector<std::unique_ptr<grpc::ClientContext>> scatter_ctxs_;
  std::vector<bool> failed_;  // scatter workers that failed during this request
  bool stopping_ = false;
  grpc::Status fatal_;
  bool combine_lost_ = false;  // fatal_ is the combine worker's UNAVAILABLE answer to ComputeLocally (it died)
  uint32_t scatter_failures_ = 0;
  std::optional<Clock::time_point> last_computed_;
  grpc::ClientContext* combine_ctx_ = nullptr;
  uint32_t joined_builds_ = 0;  // plans that joined a build in flight (re-plans after a failure included)
  size_t tier_hits_ = 0;        // segments that are hits only through the chosen combine worker's tiers

  std::string lease_owner_;              // this request's lease owner id in the segment cache
  std::vector<rpc::Digest> leased_;      // hits the cache leased to it
  bool leases_released_ = false;
  std::thread lease_release_;
};

void GenerateCall::tokenise() {
  // Special-token strings are plain text unless the segment allows them (router.proto Segment).
  segs_.resize(size_t(req_.segments_size()));
  std::vector<size_t> counts;
  for (int i = 0; i < req_.segments_size(); ++i) {
    segs_[size_t(i)].ids = segment_token_ids(svc_.tokenizer_, req_.segments(i), fmt::format("segments[{}]", i));
    counts.push_back(segs_[size_t(i)].ids.size());
  }
  query_ = segment_token_ids(svc_.tokenizer_, req_.query(), "query");
  check_token_limits(counts, query_.size(), svc_.cfg_.limits);
  size_t prompt_tokens = query_.size();
  for (const size_t c : counts) prompt_tokens += c;
  fit_context(prompt_tokens, opts_, svc_.cfg_.limits);
  const std::string fingerprint = svc_.numerics_and_fingerprint().second;
  if (fingerprint.empty())
    throw rpc::unavailable("no worker has reported its numerics yet (--numerics auto): none is reachable");
  for (auto& s : segs_) {
    s.digest = engine::segment_digest(fingerprint, engine::entry_format_version(svc_.model_.config), opts_.entry_seam_width,
                                      s.ids);
  }
}

void GenerateCall::release_build_locked(SegState& s) {
  if (s.held) svc_.builds_->release(s.digest, s.worker);
  s.held = false;
}

std::map<size_t, std::vector<uint32_t>> GenerateCall::plan_builds_locked(const std::vector<uint32_t>& jobs,
                                                                         std::vector<uint32_t>& local) {
  std::map<size_t, std::vector<uint32_t>> by_worker;
  std::vector<BuildJob> builds;
  for (uint32_t i : jobs) builds.push_back({{i, int64_t(segs_[i].ids.size())}, segs_[i].digest});
  std::vector<bool> planned(segs_.size(), false);
  if (svc_.builds_ && !builds.empty()) {
    for (const auto& p : svc_.builds_->plan(builds, failed_)) {
      SegState& s = segs_[p.segment];
      s.worker = uint32_t(p.worker);
      s.held = true;
      ++s.attempts;
      joined_builds_ += p.joined;
      planned[p.segment] = true;
      by_worker[p.worker].push_back(p.segment);
    }
  }
  for (uint32_t i : jobs) {
    if (!planned[i]) {
      segs_[i].worker = kLocal;
      local.push_back(i);
    }
  }
  return by_worker;
}

void GenerateCall::release_leases() {
  if (leases_released_) return;
  leases_released_ = true;
  if (leased_.empty()) return;
  // Off the request's path: the combine worker has its entries (or the request is over).
  lease_release_ = std::thread([this] {
    const std::string err = svc_.cache_.release_leases(lease_owner_, leased_);
    if (!err.empty()) spdlog::warn("[req {}] releasing {} cache leases failed (they expire by themselves): {}", rid_,
                                   leased_.size(), err);
  });
}

void GenerateCall::launch_locked(size_t worker, const std::vector<uint32_t>& segments) {
  v1::PrefillRequest preq;
  preq.set_request_id(rid_);
  preq.set_seam_width(opts_.entry_seam_width);
  preq.set_combine_address(combine_->address);
  preq.set_cache_segments(opts_.cache_segments);
  for (uint32_t i : segments) {
    auto* ps = preq.add_segments();
    ps->set_index(i);
    ps->mutable_key()->set_digest(rpc::digest_bytes(segs_[i].digest));
    ps->mutable_key()->mutable_token_ids()->Add(segs_[i].ids.begin(), segs_[i].ids.end());
  }
  scatter_ctxs_.push_back(child_context());
  grpc::ClientContext* cctx = scatter_ctxs_.back().get();
  threads_.emplace_back([this, worker, segments, preq = std::move(preq), cctx] {
    auto reader = svc_.scatter_[worker]->scatter->Prefill(cctx, preq);
    v1::PrefillEvent ev;
    while (reader->Read(&ev)) on_event(worker, ev);
    const grpc::Status st = reader->Finish();
    if (!st.ok()) on_failure(worker, segments, st);
  });
}

void GenerateCall::on_event(size_t worker, const v1::PrefillEvent& ev) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ev.index() >= segs_.size()) return;
  SegState& s = segs_[ev.index()];
  if (ev.has_computed() && s.worker == worker) {
    svc_.builds_->computed(s.digest, worker);
    last_computed_ = Clock::now();
  } else if (ev.has_delivered()) {
    s.delivered = true;
    s.delivery_note = ev.delivered().note();
  }
}

void GenerateCall::on_failure(size_t worker, const std::vector<uint32_t>& segments, const grpc::Status& st) {
  std::vector<uint32_t> local;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint32_t i : segments) {
      if (segs_[i].worker == worker) release_build_locked(segs_[i]);
    }
    if (stopping_ || ctx_->IsCancelled() || st.error_code() == grpc::StatusCode::CANCELLED ||
        st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return;
    }
    ++scatter_failures_;
    failed_[worker] = true;
    const std::string& addr = svc_.scatter_[worker]->address;
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE) svc_.set_scatter_available(worker, false);
    std::vector<uint32_t> jobs;
    for (uint32_t i : segments) {
      SegState& s = segs_[i];
      if (s.worker != worker || s.delivered) continue;
      if (s.attempts >= uint32_t(svc_.cfg_.max_scatter_attempts)) {
        s.worker = kLocal;
        local.push_back(i);
      } else {
        jobs.push_back(i);
      }
    }
    // Planned again like new segments: a rebuild another request already started elsewhere is joined.
    const size_t exhausted = local.size();
    const auto by_worker = plan_builds_locked(jobs, local);
    for (const auto& [w, segs] : by_worker) launch_locked(w, segs);
    spdlog::warn("[req {}] scatter worker {} failed ({}); segments reassigned: {} to other scatter workers, {} to "
                 "the combine worker",
                 rid_, addr, rpc::describe(st), jobs.size() - (local.size() - exhausted), local.size());
    reason = fmt::format("scatter worker {} failed ({})", addr, rpc::describe(st));
  }
  if (!local.empty()) compute_locally(local, reason + "; no other scatter worker left: prefilled by the combine worker");
}

void GenerateCall::compute_locally(const std::vector<uint32_t>& segments, const std::string& reason) {
  v1::ComputeLocallyRequest creq;
  creq.set_request_id(rid_);
  creq.mutable_indices()->Add(segments.begin(), segments.end());
  creq.set_reason(reason);
  auto cctx = child_context();
  v1::ComputeLocallyResponse resp;
  const grpc::Status st = combine_->combine->ComputeLocally(cctx.get(), creq, &resp);
  if (st.ok()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;
  combine_lost_ = st.error_code() == grpc::StatusCode::UNAVAILABLE;
  fatal_ = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        fmt::format("{}; and combine worker {} could not take the segments over: {}", reason,
                                    combine_->address, rpc::describe(st)));
  if (combine_ctx_) combine_ctx_->TryCancel();
}

void GenerateCall::stop_scatter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (auto& c : scatter_ctxs_) c->TryCancel();
  }
  for (;;) {
    std::vector<std::thread> joinable;
    {
      std::lock_guard<std::mutex> lock(mu_);
      joinable.swap(threads_);
    }
    if (joinable.empty()) break;
    for (auto& t : joinable) t.join();
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& s : segs_) release_build_locked(s);
}

grpc::Status GenerateCall::run() {
  t0_ = Clock::now();
  Phase phase(RouterMetrics::get());
  opts_ = validate_request(req_, svc_.cfg_.limits, svc_.model_.vocab_size);
  rid_ = req_.request_id().empty() ? rpc::make_request_id() : req_.request_id();
  // A client-given id names one request in flight (logs, cancellation, the combine worker's table): a second call
  // with the same id while the first runs is the client's mistake, refused before any work.
  struct ClientIdGuard {
    RouterService& svc;
    std::string id;
    ~ClientIdGuard() {
      if (id.empty()) return;
      std::lock_guard<std::mutex> lock(svc.ids_mu_);
      svc.client_ids_.erase(id);
    }
  } id_guard{svc_, ""};
  if (!req_.request_id().empty()) {
    std::lock_guard<std::mutex> lock(svc_.ids_mu_);
    if (!svc_.client_ids_.insert(rid_).second)
      throw rpc::RpcError(grpc::StatusCode::ALREADY_EXISTS,
                          fmt::format("request_id: {} is already in use by a request in flight; give each request "
                                      "its own id, or none (the router then makes one)",
                                      rpc::untrusted(rid_)));
    id_guard.id = rid_;
  }
  tokenise();
  std::vector<std::vector<v1::EntryTier>> tiers = lookup();
  struct ActiveGuard {  // the chosen combine worker's count of this router's requests on it
    RouterService::Worker* w = nullptr;
    void set(RouterService::Worker* next) {
      if (w) --w->active;
      w = next;
      ++w->active;
    }
    ~ActiveGuard() {
      if (w) --w->active;
    }
  } active_guard;
  // A combine worker that died since the router's last probe refuses the call (UNAVAILABLE) before it has started:
  // nothing was launched or streamed, so the request is planned again on another (or, waiting up to
  // --combine-wait-ms, on one back in rotation); each refusal takes that worker out of the rotation until a probe
  // finds it healthy, so at most one attempt per configured worker and a last one after the wait. One that dies
  // after starting but before the request's first token reached the client (a long prefill, entries in transit) is
  // planned again the same way, once: a request that kills every worker it runs on stops after two.
  const size_t max_attempts = svc_.combine_.size() + 1;
  std::string refused;  // the last refusal, named if no combine worker comes back
  bool restarted = false;  // planned again after an attempt that had started
  grpc::Status st;
  for (size_t attempt = 1;; ++attempt) {
    choose_combine(tiers, refused);
    active_guard.set(combine_);
    const std::map<size_t, std::vector<uint32_t>> by_worker = plan();
    const v1::CombineRequest creq = combine_request();
    bool retryable = false, started = false;
    st = stream_combine(creq, by_worker, phase, &retryable, &started);
    if (st.ok() || !retryable || attempt >= max_attempts || ctx_->IsCancelled() || (started && restarted)) break;
    refused = st.error_message();
    if (started) {
      spdlog::warn("[req {}] {} after it started, before the first token; planning the request again once (another "
                   "combine worker, or one back in rotation)", rid_, refused);
      restarted = true;
    } else {
      spdlog::warn("[req {}] {} before it started; planning the request again (another combine worker, or one back "
                   "in rotation)", rid_, refused);
    }
    RouterMetrics::get().combine_retries.inc();
    reset_plan();
    tiers.clear();
    if (opts_.uses_entries) {
      std::vector<rpc::Digest> digests;
      for (const auto& sg : segs_) digests.push_back(sg.digest);
      tiers = svc_.lookup_combine_tiers(digests, ctx_);
    }
  }
  // The chosen combine worker's tier hits (and, without a segment cache, the lookup itself), counted once, for the
  // attempt that ran.
  auto& metrics = RouterMetrics::get();
  metrics.cache_hits.inc(double(tier_hits_));
  if (opts_.uses_entries && !svc_.cache_.enabled()) metrics.cache_queries.inc(double(segs_.size()));
  if (!st.ok()) return st;
  return write_report();
}

void GenerateCall::reset_plan() {
  std::lock_guard<std::mutex> lock(mu_);
  for (SegState& sg : segs_) {
    release_build_locked(sg);
    sg.hit = sg.cache_hit;
    sg.combine_tier = v1::ENTRY_TIER_NONE;
    sg.worker = kLocal;
    sg.attempts = 0;
    sg.delivered = false;
    sg.delivery_note.clear();
  }
  jobs_.clear();
  joined_builds_ = 0;
  stopping_ = false;
  scatter_ctxs_.clear();  // (their threads were joined by stop_scatter)
  // What failed with the combine worker (a scatter worker's delivery to it, its ComputeLocally) is not held against
  // the scatter workers or the new attempt; a scatter worker that is really gone is out of rotation already.
  failed_.assign(svc_.scatter_.size(), false);
  fatal_ = grpc::Status::OK;
  combine_lost_ = false;
  last_computed_.reset();
  t_ready_.reset();
  t_spliced_.reset();
  creport_.reset();
  engine_ms_ = 0;
}

// The segment cache (leasing its hits) and, at the same time, every combine worker's own tiers: an entry a combine
// worker holds is a hit too, with or without a cache. Sets segs_[i].hit, leased_, cache_available_; returns each
// combine worker's tier per segment (empty when the mode uses no entries).
std::vector<std::vector<v1::EntryTier>> GenerateCall::lookup() {
  auto& metrics = RouterMetrics::get();
  const size_t n = segs_.size();
  t_lookup0_ = Clock::now();
  std::vector<std::vector<v1::EntryTier>> tiers;
  std::thread tier_lookup;
  if (opts_.uses_entries) {
    std::vector<rpc::Digest> digests;
    for (const auto& s : segs_) digests.push_back(s.digest);
    tier_lookup = std::thread([this, digests = std::move(digests), &tiers] {
      tiers = svc_.lookup_combine_tiers(digests, ctx_);
    });
  }
  struct Join {
    std::thread& t;
    ~Join() {
      if (t.joinable()) t.join();
    }
  } join_tier_lookup{tier_lookup};
  cache_available_ = svc_.cache_.enabled();
  if (opts_.uses_entries && svc_.cache_.enabled()) {
    std::vector<cache::CacheKey> keys;
    for (const auto& s : segs_) keys.push_back({s.digest, s.ids});
    // Hits are leased under an id of this call, released once the combine worker has the entries (release_leases).
    lease_owner_ = fmt::format("{}/{}", rid_, rpc::make_request_id());
    const auto res = svc_.cache_.lookup(keys, svc_.cfg_.lease_ms, lease_owner_, ctx_);
    cache_available_ = res.all_reachable;
    if (!res.all_reachable) spdlog::warn("[req {}] segment cache lookup failed, computing: {}", rid_, res.error);
    for (size_t i = 0; i < n; ++i) {
      segs_[i].hit = segs_[i].cache_hit = res.results[i].hit;
      if (res.results[i].leased) leased_.push_back(segs_[i].digest);
    }
    metrics.cache_queries.inc(double(n));
    metrics.cache_hits.inc(double(std::count_if(segs_.begin(), segs_.end(), [](const SegState& s) { return s.hit; })));
  }
  if (tier_lookup.joinable()) tier_lookup.join();
  t_lookup1_ = Clock::now();
  return tiers;
}

// The combine worker that holds most of the segments (waiting for one to be healthy, UNAVAILABLE past the wait);
// its tiers count as hits.
void GenerateCall::choose_combine(const std::vector<std::vector<v1::EntryTier>>& tiers, const std::string& refused) {
  const size_t n = segs_.size();
  std::vector<size_t> held(tiers.size(), 0);
  for (size_t w = 0; w < tiers.size(); ++w)
    for (auto t : tiers[w]) held[w] += t != v1::ENTRY_TIER_NONE;
  combine_ = svc_.wait_for_combine(ctx_->deadline(), &held, ctx_);
  if (!combine_ && ctx_->IsCancelled())
    throw rpc::RpcError(grpc::StatusCode::CANCELLED,
                        "request cancelled by the client while waiting for a combine worker");
  if (!combine_) {
    throw rpc::unavailable(fmt::format("no combine worker is available ({} configured, none healthy after waiting "
                                       "{} ms for one){}", svc_.combine_.size(), svc_.cfg_.combine_wait.count(),
                                       refused.empty() ? "" : "; before that, " + refused));
  }
  tier_hits_ = 0;
  for (size_t w = 0; w < tiers.size(); ++w) {
    if (svc_.combine_[w].get() != combine_ || tiers[w].size() != n) continue;
    for (size_t i = 0; i < n; ++i) {
      segs_[i].combine_tier = tiers[w][i];
      if (tiers[w][i] != v1::ENTRY_TIER_NONE) {
        tier_hits_ += !segs_[i].hit;
        segs_[i].hit = true;
      }
    }
  }
}

// Each digest once: a repeated segment uses its first copy's entry. The cold ones (router/segment_plan.h) join a
// build in flight for another request or go to a scatter worker (LPT); with none available, the combine worker
// prefills them. The refresh's cold tail is recomputed whole in context by the splice (built after the first
// token, off the critical path). Returns the scatter workers' segments.
std::map<size_t, std::vector<uint32_t>> GenerateCall::plan() {
  std::vector<uint32_t> local;
  const size_t n = segs_.size();
  {
    std::vector<rpc::Digest> digests;
    std::vector<bool> hits, building;
    for (const auto& s : segs_) {
      digests.push_back(s.digest);
      hits.push_back(s.hit);
      building.push_back(s.hit && !s.cache_hit && s.combine_tier == v1::ENTRY_TIER_BUILDING);
    }
    const SegmentPlan plan = plan_segments(digests, hits, opts_.mode, opts_.refresh_tail, building);
    for (size_t i = 0; i < n; ++i) {
      segs_[i].repeat_of = plan.repeat_of[i];
      segs_[i].whole = plan.roles[i] == SegmentRole::Whole;
    }
    jobs_ = plan.builds;
  }
  failed_.assign(svc_.scatter_.size(), false);
  std::lock_guard<std::mutex> lock(mu_);
  return plan_builds_locked(jobs_, local);
}

// The combine worker's request: every segment with its source (router.proto PlannedSegment), the query, sampling.
v1::CombineRequest GenerateCall::combine_request() {
  const size_t n = segs_.size();
  v1::CombineRequest creq;
  creq.set_request_id(rid_);
  for (size_t i = 0; i < n; ++i) {
    auto* ps = creq.add_segments();
    ps->set_index(uint32_t(i));
    ps->mutable_key()->set_digest(rpc::digest_bytes(segs_[i].digest));
    ps->mutable_key()->mutable_token_ids()->Add(segs_[i].ids.begin(), segs_[i].ids.end());
    if (segs_[i].repeat_of) {
      ps->set_source(v1::PlannedSegment::REPEAT);
      ps->set_repeat_of(*segs_[i].repeat_of);
    } else if (segs_[i].whole) {
      ps->set_source(v1::PlannedSegment::WHOLE);
    } else if (!opts_.uses_entries || segs_[i].hit) {
      ps->set_source(v1::PlannedSegment::WARM);
    } else if (segs_[i].worker != kLocal) {
      ps->set_source(v1::PlannedSegment::REMOTE);
    } else {
      ps->set_source(v1::PlannedSegment::LOCAL);
      ps->set_reason("no scatter worker available: prefilled by the combine worker");
    }
  }
  creq.mutable_query_ids()->Add(query_.begin(), query_.end());
  auto* sp = creq.mutable_sampling();
  sp->set_max_tokens(opts_.max_tokens);
  sp->set_temperature(opts_.temperature);
  sp->set_top_k(opts_.top_k);
  sp->set_top_p(opts_.top_p);
  seed_ = opts_.seed ? *opts_.seed : (uint64_t(std::random_device{}()) << 32 | std::random_device{}());
  sp->set_seed(seed_);
  for (const auto& s : opts_.stop) sp->add_stop(s);
  sp->mutable_stop_token_ids()->Add(opts_.stop_token_ids.begin(), opts_.stop_token_ids.end());
  if (!opts_.ignore_eos) sp->mutable_stop_token_ids()->Add(svc_.model_.eos_ids.begin(), svc_.model_.eos_ids.end());
  creq.set_mode(engine::splice_mode_name(opts_.mode));
  creq.set_seam_width(opts_.seam_width);
  creq.set_cache_segments(opts_.cache_segments);
  creq.set_refresh_segments(opts_.refresh_segments);
  creq.set_refresh_tail(opts_.refresh_tail);

  return creq;
}

// Sends the plan to the combine worker, starts the scatter builds once it has started, and streams its tokens to
// the client; fills the phase times and the combine worker's report. The call's first error, the client's
// cancellation, or the combine worker's status.
grpc::Status GenerateCall::stream_combine(const v1::CombineRequest& creq,
                                          const std::map<size_t, std::vector<uint32_t>>& by_worker, Phase& phase,
                                          bool* retryable, bool* started) {
  auto& metrics = RouterMetrics::get();
  auto cctx = child_context();
  {
    std::lock_guard<std::mutex> lock(mu_);
    combine_ctx_ = cctx.get();
  }
  auto reader = combine_->combine->Combine(cctx.get(), creq);
  v1::CombineEvent ev;
  auto combine_error = [&](const grpc::Status& st) {
    if (ctx_->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "request cancelled by the client");
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE) combine_->available.store(false);
    return grpc::Status(st.error_code(), fmt::format("combine worker {}: {}", combine_->address, st.error_message()));
  };
  if (!reader->Read(&ev) || !ev.has_started()) {
    const grpc::Status st = reader->Finish();
    {
      std::lock_guard<std::mutex> lock(mu_);
      combine_ctx_ = nullptr;  // cctx ends with this function
    }
    *retryable = st.error_code() == grpc::StatusCode::UNAVAILABLE && !ctx_->IsCancelled();
    return combine_error(st.ok() ? grpc::Status(grpc::StatusCode::INTERNAL, "stream did not start with Started") : st);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [w, segs] : by_worker) launch_locked(w, segs);
  }
  t_dispatch_ = Clock::now();
  std::optional<Clock::time_point> t_last;
  bool client_gone = false;
  bool sent = false;  // a delta written to the client
  while (reader->Read(&ev)) {
    if (ev.has_entries_ready()) {
      t_ready_ = Clock::now();
      release_leases();  // the combine worker holds every entry: the cache may evict them again
    } else if (ev.has_splice_done()) {
      t_spliced_ = Clock::now();
      engine_ms_ = ev.splice_done().queue_ms() + ev.splice_done().splice_ms();
    } else if (ev.has_delta()) {
      v1::GenerateResponse out;
      *out.mutable_delta() = ev.delta();
      completion_ += uint32_t(ev.delta().token_ids_size());
      sent = true;
      if (!writer_->Write(out)) {
        client_gone = true;
        cctx->TryCancel();
        break;
      }
      const auto now = Clock::now();
      if (ev.delta().token_ids_size() > 0) {
        if (!t_first_) {
          t_first_ = now;
          metrics.ttft.observe(std::chrono::duration<double>(now - t0_).count());
          phase.first_token();
        } else {
          // A delta of k tokens after a gap g: k gaps of g / k (the combine worker batches tokens it has ready).
          const double gap = std::chrono::duration<double>(now - *t_last).count() / ev.delta().token_ids_size();
          for (int k = 0; k < ev.delta().token_ids_size(); ++k) metrics.itl.observe(gap);
        }
        metrics.generation_tokens.inc(ev.delta().token_ids_size());
        t_last = now;
      }
    } else if (ev.has_report()) {
      creport_ = ev.report();
    }
  }
  const grpc::Status st = reader->Finish();
  stop_scatter();
  grpc::Status fatal;
  bool combine_lost = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    combine_ctx_ = nullptr;
    fatal = fatal_;
    combine_lost = combine_lost_;
  }
  // The combine worker gone (its call's UNAVAILABLE: it died, or its drain ran out, --drain-seconds; or
  // ComputeLocally's, which cancelled the call) with nothing sent to the client yet (no token, no report): the
  // request may run again from its plan.
  const bool worker_ended = st.error_code() == grpc::StatusCode::UNAVAILABLE || combine_lost;
  *started = true;
  *retryable = worker_ended && !sent && !client_gone && !ctx_->IsCancelled();
  if (*retryable) {
    combine_->available.store(false);
    return combine_lost ? fatal : combine_error(st);
  }
  if (!fatal.ok()) return fatal;
  if (client_gone || ctx_->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "request cancelled by the client");
  if (!st.ok()) return combine_error(st);
  if (!creport_ || !t_ready_ || !t_spliced_ || !t_first_) {
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        fmt::format("combine worker {} ended the stream without a complete report", combine_->address));
  }

  return grpc::Status::OK;
}

// The client's report: per segment what happened, the TTFT phases, the totals; and the request's metrics.
grpc::Status GenerateCall::write_report() {
  auto& metrics = RouterMetrics::get();
  const size_t n = segs_.size();
  size_t prompt_tokens = query_.size();
  for (const auto& s : segs_) prompt_tokens += s.ids.size();
  v1::GenerateResponse out;
  auto* rep = out.mutable_report();
  rep->set_request_id(rid_);
  for (size_t i = 0; i < n; ++i) {
    auto* sr = rep->add_segments();
    if (int(i) < creport_->segments_size()) *sr = creport_->segments(int(i));
    sr->set_index(uint32_t(i));
    sr->set_num_tokens(uint32_t(segs_[i].ids.size()));
    sr->set_digest_hex(rpc::digest_hex(segs_[i].digest));
    // Prefix mode has no lookup: its hits are the segments the combine worker restored from a checkpoint.
    sr->set_cache_hit(opts_.mode == engine::SpliceMode::Prefix ? sr->reused() : segs_[i].hit);
    sr->set_combine_tier(segs_[i].combine_tier);
    sr->set_attempts(segs_[i].attempts);
    if (!segs_[i].delivery_note.empty()) {
      sr->set_note(sr->note().empty() ? segs_[i].delivery_note : sr->note() + "; " + segs_[i].delivery_note);
    }
  }
  // TTFT phases, consecutive on this clock (see TtftBreakdown in common.proto). The engine phase (splice or
  // in-context prefill) ends at SpliceDone; it started when EntriesReady arrived, or, where gRPC delivered the two
  // events together (their gap here then reads about 0), the combine worker's own engine time before SpliceDone (its
  // queue + splice), taken from the transfer phase before it.
  const auto engine_dur = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(engine_ms_));
  const auto ready = std::max(t_dispatch_, std::min(*t_ready_, *t_spliced_ - engine_dur));
  const auto scatter_end = std::min(ready, std::max(t_dispatch_, last_computed_.value_or(t_dispatch_)));
  auto* tt = rep->mutable_ttft();
  tt->set_router_ms(rpc::ms_between(t0_, t_lookup0_) + rpc::ms_between(t_lookup1_, t_dispatch_));
  tt->set_lookup_ms(rpc::ms_between(t_lookup0_, t_lookup1_));
  tt->set_scatter_ms(rpc::ms_between(t_dispatch_, scatter_end));
  tt->set_transfer_ms(rpc::ms_between(scatter_end, ready));
  // Full and prefix modes splice no entries: the combine worker's phase is an in-context prefill (full: the whole
  // prompt), billed as prefill_ms, not as a splice.
  const double splice_phase_ms = rpc::ms_between(ready, *t_spliced_);
  const bool in_context = opts_.mode == engine::SpliceMode::Full || opts_.mode == engine::SpliceMode::Prefix;
  tt->set_splice_ms(in_context ? 0.0 : splice_phase_ms);
  tt->set_prefill_ms(in_context ? splice_phase_ms : 0.0);
  tt->set_first_decode_ms(rpc::ms_between(*t_spliced_, *t_first_));
  tt->set_total_ms(rpc::ms_between(t0_, *t_first_));
  rep->set_prompt_tokens(uint32_t(prompt_tokens));
  rep->set_query_tokens(uint32_t(query_.size()));
  rep->set_completion_tokens(creport_->completion_tokens());
  rep->set_finish_reason(creport_->finish_reason());
  rep->set_mode(engine::splice_mode_name(opts_.mode));
  rep->set_seam_width(opts_.entry_seam_width);  // the w actually used: 0 outside hypic mode
  rep->set_refresh_segments(opts_.refresh_segments);
  rep->set_refresh_tail(opts_.refresh_tail);
  rep->set_seed(seed_);
  rep->set_combine_worker(combine_->address);
  rep->set_cache_available(cache_available_);
  rep->set_scatter_failures(scatter_failures_);
  rep->set_total_ms(rpc::ms_between(t0_, Clock::now()));
  rep->set_decode_ms(creport_->decode_ms());
  rep->set_combine_device(creport_->device());
  rep->set_numerics(creport_->numerics());
  rep->set_random_weights_seed(creport_->random_weights_seed());
  rep->set_schedule_policy(svc_.scheduler_ ? schedule_policy_name(svc_.scheduler_->policy()) : "none");
  size_t hits = 0, repeats = 0;
  for (const auto& s : segs_) {
    hits += s.hit;
    repeats += s.repeat_of.has_value();
  }
  spdlog::info("[req {}] {} segments ({} hits, {} cold of which {} joined builds in flight, {} repeats), {} prompt "
               "tokens, ttft {:.1f} ms, {} tokens, combine {}",
               rid_, n, hits, jobs_.size(), joined_builds_, repeats, prompt_tokens, tt->total_ms(), completion_,
               combine_->address);
  // Counted before the report is written, so that a scrape after the client has its report sees this request.
  metrics.prompt_tokens.inc(double(prompt_tokens));
  metrics.scatter_failures.inc(scatter_failures_);
  for (const auto& sr : rep->segments()) {
    RouterMetrics::count_planned(std::string(rpc::segment_source_name(sr.source())));
    if (sr.reused()) metrics.cached_tokens.inc(sr.num_tokens());
  }
  metrics.e2e.observe(std::chrono::duration<double>(Clock::now() - t0_).count());
  metrics.success.inc();
  if (!writer_->Write(out)) return grpc::Status(grpc::StatusCode::CANCELLED, "request cancelled by the client");
  return grpc::Status::OK;
}

grpc::Status RouterService::Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                                     grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const grpc::Status st = rpc::handle_errors([&]() -> grpc::Status {
    if (grpc::Status auth = cfg_.auth.check(*ctx); !auth.ok()) return auth;
    auto call = life_.enter();
    const uint32_t active = ++active_requests_;
    struct Release {
      std::atomic<uint32_t>& n;
      ~Release() { --n; }
    } release{active_requests_};
    if (active > cfg_.limits.max_concurrent_requests) {
      RouterMetrics::get().refused.inc();
      throw rpc::resource_exhausted(fmt::format("the router is at its limit of {} concurrent requests "
                                                "(--max-concurrent-requests); retry later",
                                                cfg_.limits.max_concurrent_requests));
    }
    GenerateCall g(*this, ctx, *req, writer);
    try {
      return g.run();
    } catch (const rpc::RpcError& e) {
      spdlog::info("[req {}] rejected: {}: {}", req->request_id().empty() ? "-" : rpc::untrusted(req->request_id()),
                   rpc::code_name(e.code()), rpc::capped_message(e.what()));
      throw;
    }
  });
  if (!st.ok()) RouterMetrics::count_failure(std::string(rpc::code_name(st.error_code())));
  return st;
}

grpc::Status RouterService::GetServerInfo(grpc::ServerContext* ctx, const v1::GetServerInfoRequest*,
                                          v1::ServerInfo* resp) {
  if (grpc::Status auth = cfg_.auth.check(*ctx); !auth.ok()) return auth;
  const auto [numerics, fingerprint] = numerics_and_fingerprint();
  resp->set_model_fingerprint(fingerprint);
  resp->set_numerics(numerics);
  resp->set_model_name(model_.name);
  resp->set_model_path(model_.path);
  resp->set_model_type(model_.config.model_type);
  auto identity = [](Worker& w, v1::WorkerStatus* st) {
    std::lock_guard<std::mutex> lock(w.info_mu);
    st->set_numerics(w.numerics);
    st->set_device(w.device);
  };
  resp->set_entry_format_version(engine::entry_format_version(model_.config));
  resp->set_default_seam_width(cfg_.limits.default_seam_width);
  resp->set_max_seam_width(cfg_.limits.max_seam_width);
  resp->set_default_refresh_segments(cfg_.limits.default_refresh_segments);
  resp->set_default_refresh_tail(cfg_.limits.default_refresh_tail);
  resp->set_max_refresh_segments(cfg_.limits.max_refresh_segments);
  resp->set_schedule_policy(schedule_policy_name(cfg_.policy));
  for (size_t i = 0; i < scatter_.size(); ++i) {
    auto* w = resp->add_scatter_workers();
    w->set_address(scatter_[i]->address);
    w->set_available(scatter_[i]->available.load());
    w->set_queued_tokens(scheduler_->queued_tokens(i));
    identity(*scatter_[i], w);
    {
      std::lock_guard<std::mutex> lock(scatter_[i]->info_mu);
      const auto& c = scatter_[i]->counters;
      w->set_entries_built(c.entries_built());
      w->set_builds_joined(c.builds_joined());
      w->set_builds_dropped(c.builds_dropped());
      w->set_orphan_builds_stored(c.orphan_builds_stored());
    }
  }
  for (const auto& c : combine_) {
    auto* w = resp->add_combine_workers();
    w->set_address(c->address);
    w->set_available(c->available.load());
    w->set_active_requests(c->active.load());
    identity(*c, w);
    std::lock_guard<std::mutex> lock(c->info_mu);
    const auto& k = c->counters;
    w->set_device_tier_bytes(k.device_tier_bytes());
    w->set_device_tier_budget(k.device_tier_budget());
    w->set_device_tier_entries(k.device_tier_entries());
    w->set_host_tier_bytes(k.host_tier_bytes());
    w->set_host_tier_budget(k.host_tier_budget());
    w->set_host_tier_entries(k.host_tier_entries());
  }
  for (const auto& r : cfg_.cache_replicas) resp->add_cache_replicas(r);
  resp->set_active_requests(active_requests_.load());
  const auto& l = cfg_.limits;
  resp->set_max_concurrent_requests(l.max_concurrent_requests);
  resp->set_max_segments(l.max_segments);
  resp->set_max_segment_tokens(l.max_segment_tokens);
  resp->set_max_prompt_tokens(l.max_prompt_tokens);
  resp->set_max_new_tokens(l.max_new_tokens);
  resp->set_max_model_len(l.max_model_len);
  return grpc::Status::OK;
}

}  // namespace hypic::router
