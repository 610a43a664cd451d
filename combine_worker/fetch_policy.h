// Fetch or rebuild: whether a segment whose entry only the segment cache holds is fetched over the network or
// prefilled again on this worker, whichever its measured rates say gives the request its entries sooner. At real model
// size an entry is large (232 MB for 2048 tokens at Qwen3.5-35B-A3B dimensions) and a gRPC fetch moves about 0.2 GB/s
// per entry, so eight cache-only entries took 1.5 s where prefilling the same eight segments took 0.4 s
// (bench/results/serving_h200.md, hypic_warm_remote against hypic_cold): a cached segment must not make a request
// slower than recomputing it. The rates are learned from this worker's own fetches and builds; until both have been
// seen, everything is fetched.
#pragma once
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace hypic::combine {

/// How the combine worker treats a segment that only the segment cache holds (--cache-fetch-policy).
enum class CacheFetchPolicy {
  Auto,    ///< fetch, or rebuild here where the measured rates say that is sooner (FetchCostModel::plan)
  Always,  ///< always fetch (the behaviour before this policy)
};

/// Parses "auto" / "always"; std::invalid_argument naming the value otherwise.
CacheFetchPolicy parse_cache_fetch_policy(const std::string& s);

/// One cache-only segment of a request: its slot, tokens, and the bytes its entry has on the wire.
struct FetchCandidate {
  size_t slot = 0;
  int64_t tokens = 0;
  uint64_t wire_bytes = 0;
};

/// The plan for a request's cache-only segments: which to rebuild here (slots), and the estimates behind it (ms;
/// zero when no rates are known yet).
struct FetchPlan {
  std::vector<size_t> rebuild;  ///< slots to prefill here instead of fetching; the rest are fetched
  double fetch_all_ms = 0;      ///< estimated time to the last entry if every candidate were fetched
  double chosen_ms = 0;         ///< estimated time to the last entry under the plan
  bool probe = false;           ///< one candidate kept fetched only to measure the fetch rate again (FetchCostModel)
};

/// A request whose entries are staged from host blocks (CombineService::plan_entry_room) and whose cold segments are
/// prefilled here (LOCAL): the work of either answer. Counted FLOPs from engine::forward_flops.
struct StagedColdCase {
  int64_t local_tokens = 0;     ///< tokens of the LOCAL segments
  double local_flops = 0;       ///< their entry builds, each segment a forward pass of its own
  double full_flops = 0;        ///< one forward pass of the whole prompt (segments and query)
  uint64_t staged_bytes = 0;    ///< entry bytes the staged splice would copy in from host blocks (every segment's)
};

/// Staged splice after local builds, or a full prefill (entries built after the first token): the estimates (ms;
/// zero when a rate is unknown) and the choice.
struct StagedColdPlan {
  bool full = false;        ///< answer by a full prefill of the prompt
  double staged_ms = 0;     ///< the LOCAL builds plus the staged splice
  double full_ms = 0;       ///< the full prefill
};

/// Rates learned from this worker's cache fetches (ms per wire byte, each fetch timed under whatever concurrency it
/// ran with) and local builds (ms per token: a build's share of its batch), as exponentially weighted means (weight
/// `alpha` for the newest observation). A plan that would fetch nothing counts towards a probe: the `probe_every`-th
/// such plan since the last fetch observed keeps its smallest candidate fetched, so that a fetch rate measured once in
/// a bad moment (or a pessimistic prior) is measured again. Thread-safe.
class FetchCostModel {
 public:
  /// std::invalid_argument unless 0 < alpha <= 1, margin >= 1 and probe_every >= 1.
  explicit FetchCostModel(double alpha = 0.3, double margin = 1.25, int probe_every = 16);

  /// Starting estimates, used until observations move them (each observation is weighted in as above): a fetch rate
  /// in MB/s (10^6 bytes per second) per entry, a build rate in tokens/s and a staged splice's rate in GB/s (10^9
  /// bytes of host blocks per second); 0 leaves that rate unknown. std::invalid_argument on a negative or non-finite
  /// rate, or one so small that its inverse is not finite.
  void set_priors(double fetch_mb_per_s, double build_tokens_per_s, double staged_gb_per_s = 0);

  /// A cache fetch of `bytes` wire bytes that took `ms` (transfer, parse, verify, device copy). Ignored when either
  /// is not positive.
  void observe_fetch(uint64_t bytes, double ms);
  /// A local build of `tokens` tokens whose share of its batch took `ms`. Ignored when either is not positive.
  void observe_build(int64_t tokens, double ms);

  /// The plan for `candidates` (cache-only segments) of a request that also builds `local_tokens` tokens here
  /// (its LOCAL segments, and the builds queued ahead of them on the engine loop), with up to `parallelism` fetches at once. With both rates known, the time to the last entry is
  /// estimated as max(fetch time, build time): fetch time = max(the largest fetched entry's bytes, the fetched bytes /
  /// parallelism) x ms per byte (the last of parallel streams ends no sooner than either; 0 with none fetched), build
  /// time = (local_tokens + rebuilt tokens) x ms per token (0 with none). The rebuilt set is a prefix of the
  /// candidates shortest first or longest first (a long entry can be the fetches' straggler), whichever estimate is
  /// lowest (shortest first on ties), and any are rebuilt only when that beats fetching every one by `margin` (1.25:
  /// a 25% win, so that noise in the rates does not flip the choice); a probe (above) keeps the smallest entry
  /// fetched. Without both rates, or parallelism < 1: fetch every one.
  FetchPlan plan(std::vector<FetchCandidate> candidates, int64_t local_tokens, int parallelism);

  /// A staged splice (engine::SpliceOutput::staged_segments > 0) that copied `bytes` of host blocks in and took `ms`
  /// (its passes included). Ignored when either is not positive.
  void observe_staged_splice(uint64_t bytes, double ms);

  /// A full prefill (mode full, or an entry mode answered in full) of `flops` counted FLOPs (engine::forward_flops)
  /// that took `ms`. Ignored when either is not positive.
  void observe_prefill(double flops, double ms);

  /// Staged splice or full prefill for `c` (--staged-cold-policy auto): with the build rate known, staged_ms =
  /// local_tokens x build ms per token + staged_bytes x staged ms per byte (before a staged splice was timed, the
  /// builds alone: a lower bound), full_ms = full_flops x the full prefills' measured ms per FLOP, or, before one was
  /// seen, the builds' at these segments' lengths (build ms per token x local_tokens / local_flops: the same kernels,
  /// the full pass's longer attention counted in its FLOPs); full when full_ms < staged_ms. Without the build rate,
  /// or nothing local: staged (its builds and splice measure the rates).
  StagedColdPlan plan_staged_cold(const StagedColdCase& c) const;

  std::optional<double> fetch_ms_per_byte() const;
  std::optional<double> build_ms_per_token() const;
  std::optional<double> staged_ms_per_byte() const;
  std::optional<double> prefill_ms_per_flop() const;

 private:
  mutable std::mutex mu_;
  double alpha_, margin_;
  int probe_every_;
  int plans_without_fetch_ = 0;  // plans that fetched nothing since the last fetch observed
  std::optional<double> fetch_ms_per_byte_, build_ms_per_token_, staged_ms_per_byte_, prefill_ms_per_flop_;
};

}  // namespace hypic::combine
