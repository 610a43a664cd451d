// hypic.v1.CombineWorker: gathers a request's segment entries (memory tier, segment cache,
// scatter-worker deliveries, or its own prefill), splices them with the query and decodes with the
// sampling parameters on the worker's engine loop (engine/engine_loop.h: every request decoding here
// is stepped in one batch), and streams the tokens (semantics in combine.proto).
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>
#include <string>

#include "combine_worker/fetch_policy.h"
#include "combine_worker/host_copies.h"
#include "combine_worker/limits.h"
#include "combine_worker/memory_tier.h"
#include "combine_worker/output.h"
#include "engine/engine_loop.h"
#include "tokenizer/tokenizer.h"
#include "hypic/v1/combine.grpc.pb.h"
#include "proto/rpc/server.h"
#include "segment_cache/async_put.h"
#include "segment_cache/client.h"
#include "transport/nccl_accepts.h"
#include "transport/nccl_peer.h"

namespace hypic::combine {

struct CombineOptions {
  size_t chunk_bytes = 1 << 20;
  /// Longest wait for a request's entries (on top of the request's own deadline).
  std::chrono::seconds gather_timeout{300};
  /// Parallel cache fetches per request. 8: a 16k-token prompt of 8 segments fetches all at once (its 8 x 232 MB from
  /// the cache at 35B dims in 1245 ms where 4 at a time took 1611 ms, H200, bench/results/serving_rows_fetch8_h200.md).
  int fetch_parallelism = 8;
  /// A segment only the segment cache holds: fetched, or (Auto) prefilled here instead where this worker's measured
  /// fetch and build rates say its entries arrive sooner that way (fetch_policy.h).
  CacheFetchPolicy cache_fetch_policy = CacheFetchPolicy::Auto;
  /// Starting estimates of this worker's cache fetch rate (MB/s per entry) and build rate (tokens/s) for Auto, until
  /// its own fetches and builds move them (FetchCostModel::set_priors); 0: unknown (fetch until both were seen).
  double fetch_prior_mb_per_s = 0, build_prior_tokens_per_s = 0;
  /// A request whose entries are staged (request_entry_bytes, plan_entry_room) and whose cold segments would be
  /// prefilled here: true (--staged-cold-policy auto) answers it by a full prefill where the measured rates say that is
  /// sooner (FetchCostModel::plan_staged_cold), its cold segments' entries built after the first token; false (stage)
  /// builds them first and stages every entry into its splice.
  bool staged_cold_in_full = true;
  /// Starting estimate of a staged splice's rate (GB/s of host blocks copied in, passes included), until staged
  /// splices here move it; 0: unknown (the builds alone counted until one was seen).
  double staged_prior_gb_per_s = 0;
  /// Accept NCCL communicators from scatter workers (OpenPeer) when this build and backend can (CUDA, NCCL); false:
  /// every entry comes over gRPC (--nccl off).
  bool nccl = true;
  /// How long both ranks get to join a new communicator.
  std::chrono::milliseconds nccl_join_timeout{20000};
  /// Fixed part of an NCCL receive's deadline (transport::transfer_deadline adds the bytes at 1 GB/s).
  std::chrono::milliseconds nccl_transfer_base{10000};
  /// Communicators unused this long are closed (their scatter worker may be gone); it opens a new one when needed.
  std::chrono::seconds nccl_idle_timeout{600};
  /// The most communicators held at once (OpenPeer beyond it: RESOURCE_EXHAUSTED, the entries go over gRPC).
  int nccl_max_links = 256;
  /// This worker's own caps on a request (limits.h); checked by Combine before any work.
  RequestLimits limits;
  /// Device backends: the most device memory one request's entries take resident at once (bytes; 0 = what the
  /// device has free, waiting to be freed and in the device tier). A request whose entries need more keeps them as
  /// pinned host blocks, and its splice stages them in a staging area of at most this many bytes (0: what is free
  /// then, less a margin) a group at a time (engine::SplicePlan::block_staging_bytes; CombineService::plan_entry_room).
  uint64_t request_entry_bytes = 0;
};

/// Everything a combine worker serves with; all must outlive the service. Every engine call (local builds,
/// splices, decoding) goes through `loop` (engine/engine_loop.h); digests and entries are checked against its
/// backend's fingerprint and numerics.
struct CombineDeps {
  const engine::Tokenizer& tokenizer;
  const cache::SegmentCacheClient& cache;
  cache::AsyncCachePutter& putter;
  engine::EngineLoop& loop;
  EntryMemoryTier& memory_tier;  ///< the device tier (resident entries)
  HostBlockTier& host_tier;      ///< pinned host copies (CUDA; budget 0 on the CPU backend)
  HostCopier& copier;            ///< host copies of resident entries, off the critical path
  rpc::Lifecycle& life;
  int compute_threads = 1;  ///< reported in WorkerInfo
  uint64_t random_weights_seed = 0;  ///< BENCHMARK ONLY, reported in WorkerInfo and every report (0: real weights)
};

struct Delivery;  // how a delivered entry arrived (service.cpp)

class CombineService final : public hypic::v1::CombineWorker::Service {
 public:
  CombineService(CombineDeps deps, CombineOptions options);
  ~CombineService() override;
  /// The address reported as built_by for the segments this worker prefills itself.
  void set_address(std::string address) { address_ = std::move(address); }

  grpc::Status Combine(grpc::ServerContext* ctx, const hypic::v1::CombineRequest* req,
                       grpc::ServerWriter<hypic::v1::CombineEvent>* writer) override;
  grpc::Status DeliverEntry(grpc::ServerContext* ctx, grpc::ServerReader<hypic::v1::EntryChunk>* reader,
                            hypic::v1::DeliverEntryResponse* resp) override;
  grpc::Status ComputeLocally(grpc::ServerContext* ctx, const hypic::v1::ComputeLocallyRequest* req,
                              hypic::v1::ComputeLocallyResponse* resp) override;
  grpc::Status GetWorkerInfo(grpc::ServerContext* ctx, const hypic::v1::WorkerInfoRequest* req,
                             hypic::v1::WorkerInfo* resp) override;
  grpc::Status OpenPeer(grpc::ServerContext* ctx, const hypic::v1::OpenPeerRequest* req,
                        hypic::v1::OpenPeerResponse* resp) override;
  grpc::Status ClosePeer(grpc::ServerContext* ctx, const hypic::v1::ClosePeerRequest* req,
                         hypic::v1::ClosePeerResponse* resp) override;
  grpc::Status LookupEntries(grpc::ServerContext* ctx, const hypic::v1::LookupEntriesRequest* req,
                             hypic::v1::LookupEntriesResponse* resp) override;
  grpc::Status ClearTiers(grpc::ServerContext* ctx, const hypic::v1::ClearTiersRequest* req,
                          hypic::v1::ClearTiersResponse* resp) override;
  /// NCCL communicators held now (joined or joining), for tests and logs.
  size_t nccl_peers() const;
  /// This worker's own entry builds shared between requests (build_locally, build_after_first_token): builds in
  /// flight now, and joins of a build started for another request since start (also
  /// hypic:combine_builds_joined_total).
  struct LocalBuildCounts {
    size_t in_flight = 0;
    uint64_t joined = 0;
    size_t copies_in_flight = 0;  ///< finished builds whose host copy is being made (not kept by the device tier)
    size_t copy_waiters = 0;      ///< staged slots waiting for one of those copies
  };
  LocalBuildCounts local_build_counts() const;

  struct Pending;  // one active request (defined in service.cpp)

 private:
  // One Combine call: parse, gather the entries, splice, stream the tokens, report.
  grpc::Status run_combine(grpc::ServerContext* ctx, const hypic::v1::CombineRequest* req,
                           grpc::ServerWriter<hypic::v1::CombineEvent>* writer);
  // Validates a Combine request (rpc::RpcError INVALID_ARGUMENT naming the field) into a new Pending: mode, query,
  // sampling, stop strings and each segment's slot (digest checked against this worker's model, planned source).
  std::shared_ptr<Pending> parse_combine(const hypic::v1::CombineRequest& req) const;
  // The fetcher threads of one call and the WARM slots they take (joined by the call's cleanup).
  struct Fetchers {
    std::vector<size_t> warm;
    std::vector<std::thread> threads;
  };
  // Fills every slot: LOCAL ones built here, WARM ones fetched (their fetchers in `fetch`), WHOLE ones left to the
  // splice, REMOTE ones delivered by scatter workers (DeliverEntry); returns when all are filled. Throws
  // rpc::RpcError with the failure's code, CANCELLED, or DEADLINE_EXCEEDED past --gather-timeout-seconds.
  void gather(const std::shared_ptr<Pending>& p, const hypic::v1::CombineRequest& req, grpc::ServerContext* ctx,
              Fetchers& fetch);
  // Submits the splice and generation to the engine loop (events: its GenerationEvents) and waits for the splice;
  // keeps the imported and NCCL-delivered entries in the memory tier and queues the builds of the refresh's cold tail.
  engine::SpliceInfo splice(const std::shared_ptr<Pending>& p, const hypic::v1::CombineRequest& req,
                            grpc::ServerContext* ctx, std::shared_ptr<combine::GenerationEvents>& events);
  // The router's report: finish, timings, this worker, and per segment where its entry came from.
  hypic::v1::CombineEvent report(Pending& p, const engine::SpliceInfo& sinfo, const combine::OutputSummary& out,
                                 double gather_ms) const;
  std::shared_ptr<Pending> find(const std::string& request_id);
  /// Queues local builds of the given slots (with a note each) on the engine loop, in one submission; each is spliced
  /// resident as built and its host copy made afterwards (HostCopier). A slot whose digest is being built here for
  /// another active request (same ids and seam width) joins that build instead: one build fills every waiting slot;
  /// one whose build finished since (for another request) is taken from the device tier, or while its host copy is
  /// made (copying_), resident or, staged, as that copy's block.
  void build_locally(const std::shared_ptr<Pending>& p, const std::vector<std::pair<size_t, std::string>>& slots);
  void build_locally(const std::shared_ptr<Pending>& p, size_t slot, std::string note);
  /// Entries built after a request's first token, for later requests (the refresh's cold tail, recomputed whole in
  /// context; a staged request's cold segments answered by a full prefill): each registered as a local build with no
  /// waiter (local_builds_, LocalBuild::after_first_token) so that a request arriving meanwhile joins it instead of
  /// building it again, and kept going when nobody waits; into the device tier unless the request's entries were
  /// staged, its host copy to the host tier and (the request's cache_segments) the cache. Segments already in a tier,
  /// being built or having their host copy made are skipped. Submitted as background builds
  /// (EngineLoop::BuildSubmission::background: they wait while requests' splices and builds are queued) until a
  /// request joins one; none past kMaxBackgroundBuildTokens queued (logged).
  void build_after_first_token(const std::shared_ptr<Pending>& p, const std::vector<size_t>& slots);
  /// A local build's outcome (on the engine loop's thread): device memory short with device-tier entries to give up,
  /// retried once after evicting; else into the device tier (unless every waiter stages its entries and the build is
  /// not for the tier), or into copying_ where the tier does not keep it, its host copy queued once (a cache put when
  /// some waiter asked for one and none was a policy rebuild), every waiting slot filled; or each waiter's failure
  /// (local_build_failed).
  void on_local_built(const rpc::Digest& digest, uint64_t build, engine::BuildOutcome r);
  /// A finished local build (in the device tier, or in copying_): its host copy queued once, every waiting slot filled
  /// (a staged one with the copy's block).
  /// `put`: a cache put whatever the waiters ask; `request_id`: the request it is built for (logs), else the first
  /// waiter's.
  /// `copying`: the build was registered in copying_ (on_local_built), whose slots its copy's callback fills.
  void fill_local_build(const rpc::Digest& digest,
                        const std::vector<std::pair<std::shared_ptr<Pending>, size_t>>& waiters,
                        engine::BuildOutcome r, bool put = false, const std::string& request_id = {},
                        bool copying = false);
  /// A failed local build, for one waiting slot: a policy rebuild is fetched from the cache instead (gather's wait
  /// starts it), any other fails the request with the build's code.
  void local_build_failed(const std::shared_ptr<Pending>& p, size_t slot, const engine::BuildOutcome& r);
  /// A request ends: its slots stop waiting for shared local builds; a build nobody waits for any more is cancelled
  /// (dropped while queued, stopped while running) and forgotten.
  void leave_local_builds(const Pending& p);
  // A request of an entry mode whose entries did not fit in device memory (`why`: the RESOURCE_EXHAUSTED it met in
  // gather or splice) is answered by a full prefill of its prompt instead: its fetches and builds stop (their threads
  // in `fetch` joined), its entries are let go, its mode becomes full; logged with where the device memory is, noted
  // on every segment and counted (hypic:combine_full_fallbacks_total). The answer is full recomputation's.
  void answer_in_full(Pending& p, Fetchers& fetch, const std::string& why);
  // Stops a request's fetches and builds (their threads in `fetch` joined), lets its entries go and makes its mode full,
  // `note` added to every segment's note; how many entries were let go.
  size_t switch_to_full(Pending& p, Fetchers& fetch, const std::string& note);
  // --staged-cold-policy auto, for a request whose entries are staged (after plan_entry_room) with cold segments to
  // prefill here (`local`: LOCAL slots) or warm ones whose build here it would join (WARM slots being built on this
  // worker, ENTRY_TIER_BUILDING, counted whole: how far a build got is not known): when
  // FetchCostModel::plan_staged_cold says a full prefill of the prompt is sooner than building them and staging every
  // entry, answers it so (switch_to_full), its LOCAL, WHOLE and joined segments marked build_after (their entries built
  // after the first token, or the builds in flight kept, CombineService::splice); logged, noted, counted in
  // hypic:combine_staged_cold_in_full_total. True when it did.
  bool answer_cold_in_full(Pending& p, Fetchers& fetch, const std::vector<std::pair<size_t, std::string>>& local);
  // Where a request's entries go, decided before any fetch or build starts (a device backend only): when the entries
  // it lacks (not in the device tier, not repeats or refresh-tail segments) need more device memory than is free,
  // waiting to be freed and held by the device tier together, they are staged by the splice from pinned host blocks
  // (Pending::stage_blocks: logged, noted, counted in hypic:combine_staged_requests_total) where that memory holds
  // the largest of them and a margin (engine::SplicePlan::block_staging_bytes); else throws RESOURCE_EXHAUSTED
  // (which answer_in_full takes).
  void plan_entry_room(Pending& p) const;
  void fetch_warm(const std::shared_ptr<Pending>& p, size_t slot, const grpc::ServerContextBase* ctx);
  /// fetch_warm on a fetch thread: an exception out of it is a local build instead, or the request's failure.
  void fetch_or_fail(const std::shared_ptr<Pending>& p, size_t slot, const grpc::ServerContextBase* ctx);
  /// --cache-fetch-policy auto: moves from `warm` to `local` (with a note) the WARM slots that only the segment cache
  /// holds and that fetch_costs_ says are sooner prefilled here (FetchCostModel::plan, given the LOCAL builds'
  /// tokens), never the refresh's tail (hypic mode); counted in hypic:cache_hits_rebuilt_total, not put back in the
  /// cache once built. `warm` stays in order.
  void rebuild_cache_only(const std::shared_ptr<Pending>& p, const hypic::v1::CombineRequest& req,
                          std::vector<size_t>& warm, std::vector<std::pair<size_t, std::string>>& local);
  /// What a received entry's header must satisfy before its tensors are sized (engine::EntryReaderChecks): the stream's
  /// size, this worker's model, numerics and seam width, and the segment's token ids (rpc::verify_entry).
  engine::EntryReaderChecks entry_checks(uint64_t total_bytes, std::span<const int32_t> ids, int seam_width) const;
  /// Where an entry received over gRPC or mapped from the cache (engine::EntryReceiver) is kept on a device backend:
  /// its pinned block (made by Backend::block_of_entry where it arrived as a host entry) goes to the host tier and,
  /// for a request whose entries are staged (Pending::stage_blocks), to the splice as it is; else it is made resident
  /// here, on the calling thread (import_block: never on the engine loop), and put in the device tier. On the CPU
  /// backend both are null (the engine imports the host entry, for free).
  struct Kept {
    std::shared_ptr<const engine::ResidentEntry> resident;
    std::shared_ptr<const engine::HostBlock> block;
    bool any() const { return resident || block; }
  };
  Kept keep_received(const Pending& p, const rpc::Digest& digest, const engine::EntryReceiver::Received& got);
  /// The active request a delivery names, its header's index and digest checked (NOT_FOUND, INVALID_ARGUMENT).
  std::shared_ptr<Pending> delivery_target(const hypic::v1::EntryHeader& h);
  /// Fills the delivered segment's slot (host entry, resident one or pinned host block), counts it, answers duplicate
  /// or not.
  void accept_delivery(Pending& p, const hypic::v1::EntryHeader& h, std::shared_ptr<const engine::SegmentEntry> entry,
                       std::shared_ptr<const engine::ResidentEntry> resident, uint64_t entry_bytes,
                       const Delivery& delivery, const std::string& what,
                       hypic::v1::DeliverEntryResponse* resp,
                       std::shared_ptr<const engine::HostBlock> block = nullptr);
  /// DeliverEntry with transport NCCL: receives the announced block over communicator h.peer_epoch() (refused, the
  /// block still received and dropped, when anything is wrong with it; `extra_chunks`: the stream carried data).
  void deliver_nccl(grpc::ServerContext* ctx, const hypic::v1::EntryHeader& h, bool extra_chunks,
                    hypic::v1::DeliverEntryResponse* resp);

  CombineDeps d_;
  CombineOptions opt_;
  FetchCostModel fetch_costs_;  // this worker's cache fetch and local build rates (cache_fetch_policy Auto)
  const engine::Backend& backend_;  // d_.loop's: immutable facts only (config, fingerprint, numerics, device)
  std::string device_;
  std::string address_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Pending>> active_;
  std::condition_variable active_cv_;  // mu_: notified when a call leaves active_
  transport::NcclAccepts accepts_;  // the NCCL communicators scatter workers opened here
  // This worker's own entry builds in flight, by digest, with the slots waiting for each (build_locally).
  struct LocalBuild {
    uint64_t id = 0;  // the submission's (a build forgotten and started again gets a new one)
    std::vector<int32_t> ids;
    int seam_width = 0;
    std::string started_for;  // the request id
    std::shared_ptr<std::atomic<bool>> cancel;  // the engine's cancel flag: set when no slot waits any more
    std::vector<std::pair<std::shared_ptr<Pending>, size_t>> waiters;
    bool retried = false;  // refused for device memory once, retried after evicting
    // Built after a request's first token for later requests (build_after_first_token): kept going when no request
    // waits for it; put in the cache (`put`) and the device tier (`device_tier`) whatever its waiters ask.
    bool after_first_token = false, put = false, device_tier = false;
    // The engine loop's background flag of a build started after a first token (EngineLoop::BuildSubmission::
    // background), cleared when a request joins it; null for the others.
    std::shared_ptr<std::atomic<bool>> background;
  };
  /// Most tokens of background builds (build_after_first_token) queued on the engine loop at once.
  static constexpr int64_t kMaxBackgroundBuildTokens = int64_t(1) << 18;
  mutable std::mutex local_mu_;  // never held together with a Pending::mu
  std::map<rpc::Digest, LocalBuild> local_builds_;
  uint64_t next_local_build_ = 1;
  uint64_t local_joined_ = 0;
  // Finished local builds the device tier does not keep (their requests' entries were staged, they were built after
  // a staged request's first token, or the tier had no room) while the copier makes their host copies: a request
  // arriving before a copy lands in the host tier takes that copy instead of building the segment again
  // (take_host_copy_locked; build_after_first_token and the cache policy's rebuilds leave them alone). A build leaves
  // local_builds_ and enters here under local_mu_, and leaves here once its copy was made (its block put in the host
  // tier first, unless the tier refused it), dropped or failed: its waiters then get the block, or the resident entry.
  // Shared with the copies' callbacks, which may run after the service is gone (HostCopier::enqueue). Lock order:
  // local_mu_, then `mu`; neither with a Pending::mu.
  struct HostCopiesInFlight {
    struct Copy {
      std::vector<int32_t> ids;
      int seam_width = 0;
      std::shared_ptr<const engine::ResidentEntry> entry;  // device memory, until the copy is made
      std::vector<std::pair<std::shared_ptr<Pending>, size_t>> waiters;  // staged slots waiting for the block
    };
    std::mutex mu;
    std::map<rpc::Digest, Copy> copies;
  };
  std::shared_ptr<HostCopiesInFlight> copying_ = std::make_shared<HostCopiesInFlight>();
  /// (local_mu_ held) A finished build's host copy in the making for this slot (same digest, token ids and seam
  /// width): a staged request's slot waits for the pinned block (registered here; the copy's callback fills it with
  /// the block, or with the resident entry when the copy failed or was dropped) and `resident` stays null; any other
  /// takes the resident entry at once (`resident`, filled by the caller). False: no such copy in flight.
  bool take_host_copy_locked(const std::shared_ptr<Pending>& p, size_t slot,
                             std::shared_ptr<const engine::ResidentEntry>& resident);
  /// (local_mu_ held) Whether a host copy of this digest's build is in the making (copying_).
  bool copy_in_flight_locked(const rpc::Digest& digest) const;
};

}  // namespace hypic::combine
