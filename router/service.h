// hypic.v1.Router: the public API (semantics and fault handling in router.proto). Tokenises each
// segment on its own, hashes it, asks the segment cache which segments are warm (one batch
// lookup, hits leased until the combine worker has them), plans the cold ones (each digest once: a build
// in flight for another request is joined, router/inflight_builds.h; the rest go to scatter workers,
// router/scheduler.h), sends the plan to a combine worker and relays its token stream and report.
#pragma once
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "engine/checkpoint/config.h"
#include "tokenizer/tokenizer.h"
#include "hypic/v1/combine.grpc.pb.h"
#include "hypic/v1/router.grpc.pb.h"
#include "hypic/v1/scatter.grpc.pb.h"
#include "proto/rpc/server.h"
#include "router/admission.h"
#include "router/inflight_builds.h"
#include "router/scheduler.h"
#include "segment_cache/client.h"

namespace hypic::router {

namespace v1 = hypic::v1;

struct RouterConfig {
  RouterLimits limits;
  std::vector<std::string> scatter_workers;  ///< host:port
  std::vector<std::string> combine_workers;  ///< host:port, at least one
  std::vector<std::string> cache_replicas;   ///< host:port (none: no caching)
  SchedulePolicy policy = SchedulePolicy::Lpt;
  std::chrono::milliseconds lookup_timeout{500};   ///< batch lookup budget; past it, all segments are cold
  /// Longest lease of a lookup hit; leases are released when the request has its entries or ends, so this only
  /// bounds the ones whose release is lost (router gone).
  uint32_t lease_ms = 30000;
  int max_scatter_attempts = 3;                    ///< per segment; then the combine worker prefills it
  std::chrono::seconds default_deadline{600};      ///< for requests that carry no deadline
  std::chrono::milliseconds health_interval{1000}; ///< worker health probing period
  /// With no combine worker in rotation, how long a request waits for one to come back (probing at once, then
  /// every 50 ms), bounded by its deadline, before it fails with UNAVAILABLE: a combine worker that restarts
  /// within this time (it is stateless between requests) costs its callers latency, not errors.
  std::chrono::milliseconds combine_wait{10000};
  /// Budget of one combine worker's tier lookup (CombineWorker.LookupEntries, in parallel with the cache lookup); a
  /// worker that misses it (frozen, overloaded) counts as holding nothing and is not asked again for 5 s.
  std::chrono::milliseconds tier_lookup_timeout{100};
  /// Affinity against load: a request goes to the combine worker holding most of its segments among those with at
  /// most this many more active requests than the least busy one (0: always the least busy).
  uint32_t combine_affinity_slack = 4;
  /// Bearer tokens that Generate and GetServerInfo require (--auth-token-file, proto/rpc/security.h); empty: open.
  rpc::BearerTokens auth;
};

/// The model facts the router needs (it does not load weights).
struct RouterModel {
  engine::ModelConfig config;     ///< of the served checkpoint (config.json + the weights' identity)
  int64_t vocab_size = 0;         ///< valid token ids are [0, vocab_size)
  std::vector<int32_t> eos_ids;   ///< end-of-text ids that stop decoding unless ignore_eos
  /// The workers' numerics ("cpu-fp32", "cuda-bf16"): digests are made under
  /// engine::model_fingerprint(config, numerics). Empty = learn it from the first worker whose identity probe
  /// matches the model (--numerics auto); either way a worker of other numerics is not used (logged).
  std::string numerics;
  std::string name;  ///< what GetServerInfo calls the model: the checkpoint directory's name
  std::string path;  ///< the checkpoint directory (absolute)
};

class RouterService final : public hypic::v1::Router::Service {
 public:
  /// Throws std::invalid_argument for a configuration without combine workers.
  RouterService(const engine::Tokenizer& tokenizer, RouterModel model, RouterConfig config, rpc::Lifecycle& life);
  /// Stops the health prober.
  ~RouterService() override;

  grpc::Status Generate(grpc::ServerContext* ctx, const hypic::v1::GenerateRequest* req,
                        grpc::ServerWriter<hypic::v1::GenerateResponse>* writer) override;
  grpc::Status GetServerInfo(grpc::ServerContext* ctx, const hypic::v1::GetServerInfoRequest* req,
                             hypic::v1::ServerInfo* resp) override;

  /// The cluster's numerics and backend fingerprint (what digests are made under); both empty while unknown.
  std::pair<std::string, std::string> numerics_and_fingerprint() const;

  /// A worker known to the router.
  struct Worker {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<hypic::v1::ScatterWorker::Stub> scatter;  // scatter workers only
    std::unique_ptr<hypic::v1::CombineWorker::Stub> combine;  // combine workers only
    std::atomic<bool> available{false};
    std::atomic<bool> model_mismatch{false};
    std::mutex info_mu;
    std::string numerics, device;  ///< from its last identity probe (info_mu)
    hypic::v1::WorkerInfo counters;  ///< its last WorkerInfo (info_mu): the shared-build counters of scatter workers
    std::atomic<uint32_t> active{0};
    int failed_probes = 0;  ///< consecutive failed health probes (prober thread only)
    /// Combine workers: steady-clock ms until which its tiers are not asked (its last tier lookup failed).
    std::atomic<int64_t> tier_lookup_off_until_ms{0};
  };

 private:
  friend class GenerateCall;
  void probe_workers();
  /// A combine worker in rotation, waiting up to cfg_.combine_wait (and at most until `deadline`) for one to come
  /// back when none is, with the prober woken at once; nullptr when none came back in time, or as soon as `call`
  /// (the client's call, when given) is cancelled, so that a client that gave up frees its admission slot at once.
  Worker* wait_for_combine(std::chrono::system_clock::time_point deadline, const std::vector<size_t>* held = nullptr,
                           grpc::ServerContextBase* call = nullptr);
  /// Health and identity of one worker: SERVING, the router's model, the cluster's numerics (adopted from it in
  /// auto mode when none is known yet). Logs each refusal once.
  template <class Service>
  bool probe(Worker& w);
  void set_scatter_available(size_t worker, bool available);
  /// The available combine worker holding most of a request's entries in its own tiers (held[w]: how many of its
  /// segments combine worker w holds; null: none known) among those with at most cfg_.combine_affinity_slack more
  /// active requests than the least busy one; ties broken by the fewest active requests, then in turn (nullptr if
  /// none is available).
  Worker* pick_combine(const std::vector<size_t>* held = nullptr);
  /// Asks every available combine worker which of `digests` it holds in its own tiers (CombineWorker.LookupEntries,
  /// in parallel, each bounded by the lookup timeout and the request's deadline). Per combine worker, per digest, the
  /// tier; a worker that is out of rotation or did not answer in time holds nothing.
  std::vector<std::vector<v1::EntryTier>> lookup_combine_tiers(const std::vector<rpc::Digest>& digests,
                                                               const grpc::ServerContextBase* parent);

  const engine::Tokenizer& tokenizer_;
  RouterModel model_;
  RouterConfig cfg_;
  rpc::Lifecycle& life_;
  cache::SegmentCacheClient cache_;
  std::vector<std::unique_ptr<Worker>> scatter_, combine_;
  std::unique_ptr<ScatterScheduler> scheduler_;  // null without scatter workers
  std::unique_ptr<InflightBuilds> builds_;       // over scheduler_ (null without scatter workers)
  std::atomic<uint32_t> active_requests_{0};
  std::mutex ids_mu_;
  std::unordered_set<std::string> client_ids_;  ///< ids_mu_: the client-given request_ids of calls in flight
  std::atomic<size_t> combine_turn_{0};
  mutable std::mutex numerics_mu_;
  std::string numerics_, fingerprint_;  ///< numerics_mu_; empty until known
  std::string numerics_from_;           ///< "--numerics" or the worker it was learned from

  std::mutex probe_mu_;
  std::condition_variable probe_cv_;
  bool stop_probe_ = false;
  bool probe_now_ = false;  ///< wakes the prober early (probe_mu_)
  std::thread prober_;
};

}  // namespace hypic::router
