// Client library of the segment cache service: batch lookup, chunked get/put, delete and stats,
// with the key space sharded over several replicas by consistent hashing (segment_cache/ring.h).
// Each key lives on exactly one replica; a replica that cannot be reached makes its keys misses
// (lookup) or fails the call with UNAVAILABLE (get/put) — callers then compute instead.
// Thread-safe; channels are created once per replica and shared.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "hypic/v1/segment_cache.grpc.pb.h"
#include "proto/rpc/chunks.h"
#include "proto/rpc/shared_memory.h"
#include "segment_cache/ring.h"

namespace CLI {
class App;
}  // namespace CLI

namespace hypic::cache {

/// A segment key as the services handle it: digest plus the token ids that verify a hit.
struct CacheKey {
  rpc::Digest digest{};
  std::span<const int32_t> token_ids;
};

struct CacheLookup {
  bool hit = false;
  int tier = 0;           ///< hypic.v1.CacheTier
  uint64_t size_bytes = 0;
  bool leased = false;    ///< the replica leased the hit (see segment_cache.proto: leases are capped)
};

struct BatchLookup {
  std::vector<CacheLookup> results;  ///< one per key, in order
  bool all_reachable = true;         ///< false if some replica failed (its keys count as misses)
  std::string error;                 ///< the first failure, for logs and reports
};

/// A put in flight that another thread may cancel (AsyncCachePutter's shutdown): put() registers its call here while
/// it runs; cancel() cancels the call running now (gRPC's TryCancel: it ends with CANCELLED unless it had already
/// finished) and every later one at once. One put at a time per PutCancel.
class PutCancel {
 public:
  void cancel();
 private:
  friend class SegmentCacheClient;
  std::mutex mu_;
  grpc::ClientContext* ctx_ = nullptr;
  bool cancelled_ = false;
};

/// How one get_stream call went (wall-clock ms on the calling thread, of the call that delivered the bytes).
struct FetchReport {
  bool mapped = false;    ///< the bytes were read in place from the replica's sealed memfd, not streamed
  double answer_ms = 0;   ///< from the call's start to the replica's first message (its EntryInfo)
  double map_ms = 0;      ///< opening and mapping the replica's memfd (PeerMemfd::open), when mapped
  double read_ms = 0;     ///< handing the bytes to the consumer (what it does with them included) and hashing them
  double end_ms = 0;      ///< from the last byte handed over to the call's status (the replica ending the call)
  double verify_ms = 0;   ///< the checksum and MAC verdicts (waiting for the MAC's thread)
  /// The replica's EntryInfo for the entry read: set as soon as it arrives (also when the read then fails), so that
  /// a caller that finds the entry bad deletes that one only (erase_read).
  bool has_info = false;
  uint64_t checksum = 0;
  std::string mac;
};

class SegmentCacheClient {
 public:
  struct Options {
    int vnodes = 160;                                   ///< ring points per replica
    std::chrono::milliseconds timeout{5000};            ///< per call, capped by the parent deadline; calls that
                                                        ///< move an entry get more (transfer_timeout, put_wait)
    size_t chunk_bytes = rpc::kChunkBytes;
    /// The slowest transfer a call's deadline allows for its bytes, bytes per second: a put of B bytes, and a get
    /// told to expect B, get timeout + B / transfer_rate (a 280 MB entry: + 2.8 s at the default 100 MB/s), so
    /// that an entry at real model size is not cut by a deadline sized for a small call.
    uint64_t transfer_rate = 100'000'000;
    /// How long a put may wait at the cache for room to receive it, on top of that: the segment cache's
    /// --max-put-wait-ms (default 30 s), so that a put the cache would still admit is not given up before.
    std::chrono::milliseconds put_wait{30000};
    /// TCP connections per replica (at least 1); calls take them in turn, so that parallel fetches of large entries
    /// do not share one connection's HTTP/2 stream (rpc::make_channel).
    int connections = 1;
    /// Ask for entries the cache holds in sealed memfds (segment_cache.proto Get, proto/rpc/shared_memory.h) and map
    /// them when the replica runs on this host, and put large entries as sealed memfds it adopts; a replica whose
    /// memfds cannot be opened from here, or that cannot open ours, is streamed from, or to (and not asked again).
    bool shared_memory = true;
  };

  /// The deadline of a call that moves `bytes`: timeout + bytes / transfer_rate, in ms rounded up, at most 2^40 ms
  /// more (a put adds put_wait). Per call: parallel transfers sharing a link each get their own allowance.
  std::chrono::milliseconds transfer_timeout(uint64_t bytes) const;

  /// `replicas`: host:port of every replica (may be empty: a client with no cache, every lookup
  /// misses and get/put fail with UNAVAILABLE).
  /// Throws std::invalid_argument when options.transfer_rate is 0 or options.connections < 1.
  explicit SegmentCacheClient(std::vector<std::string> replicas, Options options);
  explicit SegmentCacheClient(std::vector<std::string> replicas) : SegmentCacheClient(std::move(replicas), Options{}) {}

  bool enabled() const { return ring_.has_value(); }
  const std::vector<std::string>& replicas() const { return replicas_; }
  /// Address of the replica that owns `digest` (empty without replicas).
  std::string owner(const rpc::Digest& digest) const;

  /// One Lookup RPC per replica that owns some of the keys, all in parallel; hits are leased under
  /// `lease_owner` (empty: anonymous leases) for at most lease_ms (0: no lease). `parent` (may be null)
  /// propagates the serving call's deadline and cancellation.
  BatchLookup lookup(std::span<const CacheKey> keys, uint32_t lease_ms, const std::string& lease_owner = {},
                     const grpc::ServerContextBase* parent = nullptr) const;

  /// Ends the leases `lease_owner` holds on the replicas that own `digests` (one ReleaseLeases RPC per
  /// such replica, in parallel, each bounded by the client timeout; no parent context, so that it
  /// also runs for a request that was cancelled). Returns the first failure ("" when every replica
  /// answered); a lease that could not be released still ends when its lease_ms passes.
  std::string release_leases(const std::string& lease_owner, std::span<const rpc::Digest> digests) const;

  /// Fetches an entry and verifies its checksum end to end, and, when the process has entry keys
  /// (rpc::entry_mac_keys(), proto/rpc/entry_mac.h), its MAC: an entry whose MAC does not verify is
  /// counted (hypic:entry_mac_failures_total), deleted from the cache and refused with DATA_LOSS.
  /// nullopt when the replica says NOT_FOUND; throws rpc::RpcError with the replica's code otherwise
  /// (UNAVAILABLE, DATA_LOSS for an entry the cache found corrupt, DEADLINE_EXCEEDED...).
  /// `expected_bytes` (0: unknown): the entry's expected size, so that the call's deadline allows its transfer
  /// (transfer_timeout; still capped by the parent's deadline).
  std::optional<std::string> get(const CacheKey& key, const grpc::ServerContextBase* parent = nullptr,
                                 uint64_t expected_bytes = 0) const;
  /// get() without assembling the entry: `begin(total_bytes)` once the size is known, then `consume(chunk)` for each
  /// piece as it arrives (the caller parses it straight into its destination; a 230 MB entry is never held twice).
  /// The checksum and MAC cover the whole stream, so they are verified after the last consume: use what was parsed
  /// only when this returns true. false: NOT_FOUND. Throws as get() does; an exception from begin or consume cancels
  /// the read and propagates. `*report` (when given) says how the bytes came and where the time went.
  bool get_stream(const CacheKey& key, const std::function<void(uint64_t)>& begin,
                  const std::function<void(std::string_view)>& consume,
                  const grpc::ServerContextBase* parent = nullptr, uint64_t expected_bytes = 0,
                  FetchReport* report = nullptr) const;
  /// Fetch without the token-id or MAC check (administration): returns the bytes and the stored ids; *mac (when
  /// given) receives the stored MAC (empty: none).
  std::optional<std::pair<std::string, std::vector<int32_t>>> get_unchecked(const rpc::Digest& digest,
                                                                            std::string* mac = nullptr) const;

  /// Stores an entry, with its MAC when the process has entry keys: an entry of 1 MiB or more is copied into a sealed
  /// memfd that a replica on this host adopts (Options::shared_memory; segment_cache.proto PutHeader), else, or where
  /// the replica does not take it, streamed in chunks. Throws rpc::RpcError on failure
  /// (RESOURCE_EXHAUSTED when the cache found no room within its wait, DEADLINE_EXCEEDED past timeout + put_wait +
  /// bytes / transfer_rate, CANCELLED through `cancel`). Returns true if it replaced one.
  /// `mac` (administration: an entry moved as is) replaces the MAC this process would make.
  bool put(const CacheKey& key, std::string_view bytes, const std::optional<std::string>& mac = std::nullopt,
           PutCancel* cancel = nullptr) const;
  /// put() of bytes that may already be in a sealed memfd of this process (rpc::SharedBytes::shared()): that memfd is
  /// offered as it is (no copy) where put() would offer one; heap bytes are put as put() does. Same errors.
  bool put(const CacheKey& key, const rpc::SharedBytes& bytes, const std::optional<std::string>& mac = std::nullopt,
           PutCancel* cancel = nullptr) const;
  /// Whether a put of `digest` (of at least 1 MiB) would be offered to its replica as a sealed memfd now: shared memory
  /// on (Options::shared_memory) and that replica not found unable to take this process's memfds within the last
  /// minute. A caller that makes the bytes can then write them straight into a memfd (rpc::SealedMemfdWriter).
  bool offers_shared_memory(const rpc::Digest& digest) const;
  /// The smallest put offered as a sealed memfd (bytes; the segment cache's default --shared-memory-min-bytes);
  /// smaller ones are streamed.
  static constexpr size_t kMinSharedPutBytes = size_t{1} << 20;
  /// Removes an entry; false if the owner did not have it. Throws rpc::RpcError on failure.
  bool erase(const rpc::Digest& digest) const;
  /// Removes the entry that a read found bad, and only that one: false when the owner holds none or another (put
  /// since: its checksum or MAC differs from `checksum` / `mac`, EntryInfo's of the read). `corrupt`: its bytes failed
  /// their checksum (the cache counts it with its corruptions); else its MAC failed. Throws rpc::RpcError on failure.
  bool erase_read(const rpc::Digest& digest, uint64_t checksum, const std::string& mac, bool corrupt) const;
  /// Stats of one replica. Throws rpc::RpcError on failure.
  hypic::v1::CacheStats stats(size_t replica) const;

 private:
  hypic::v1::SegmentCache::Stub& stub_for(const rpc::Digest& digest) const;
  // One Delete call to the owner of `digest`; throws rpc::RpcError on failure.
  bool delete_once(const rpc::Digest& digest, const hypic::v1::DeleteRequest& req) const;
  std::optional<std::pair<std::string, std::vector<int32_t>>> fetch(const rpc::Digest& digest,
                                                                     std::span<const int32_t> ids, bool check_ids,
                                                                     const grpc::ServerContextBase* parent,
                                                                     std::string* mac_out = nullptr,
                                                                     uint64_t expected_bytes = 0) const;
  // One Get streamed to begin / consume, with the checksum (and, when check_ids and keys are configured, the MAC)
  // verified once it ended; returns the stored token ids, nullopt for NOT_FOUND.
  std::optional<std::vector<int32_t>> stream(const rpc::Digest& digest, std::span<const int32_t> ids, bool check_ids,
                                             const grpc::ServerContextBase* parent, uint64_t expected_bytes,
                                             const std::function<void(uint64_t)>& begin,
                                             const std::function<void(std::string_view)>& consume,
                                             std::string* mac_out, FetchReport* report = nullptr) const;

  std::vector<std::string> replicas_;
  Options opt_;
  std::optional<HashRing> ring_;
  std::vector<std::vector<std::unique_ptr<hypic::v1::SegmentCache::Stub>>> stubs_;  // [replica][connection]
  // [replica]: until when (steady-clock ms; INT64_MAX: never again, Options::shared_memory off) its memfds are not
  // asked for (they could not be opened from here: PeerMemfd::Failure::Unreachable), or ours not offered to it (it
  // could not open them, or runs without shared memory); 0: they are. A replica that was elsewhere is tried again
  // after kSharedRetry (it may have moved here: a restart).
  std::unique_ptr<std::atomic<int64_t>[]> no_shared_memory_until_;
  std::unique_ptr<std::atomic<int64_t>[]> no_shared_put_until_;
  // [replica]: its answers in a row whose holder had no process here (PeerMemfd::Failure::NoProcess).
  std::unique_ptr<std::atomic<int>[]> no_process_;
  // One Put call: the bytes streamed, or with `shared` the memfd holding them handed over instead; a shared put the
  // cache did not take (FAILED_PRECONDITION or INVALID_ARGUMENT) sets *shared_refused (and, unless it only declined
  // this one, no_shared_put_until_) and returns false; other failures throw as put() does.
  bool put_once(const CacheKey& key, std::string_view bytes, const std::string& mac, PutCancel* cancel,
                const rpc::MemfdRef* shared, bool* shared_refused) const;
  /// Signs `bytes` (unless `mac` is given), offers `memfd` (the same bytes in a sealed memfd of this process) when not
  /// null, and streams them where it is null or refused.
  bool put_as(const CacheKey& key, std::string_view bytes, const rpc::SharedBytes* memfd,
              const std::optional<std::string>& mac, PutCancel* cancel) const;
  mutable std::atomic<uint64_t> next_connection_{0};
};

/// The workers' flags for their segment-cache client, each defaulting to the value in `options` and written there
/// when given: --cache-timeout-ms (Options::timeout, whole decimal ms in [1, 3,600,000] as rpc::add_strict_int_option
/// reads them), --cache-transfer-rate (Options::transfer_rate, bytes per second in [1, 10^18], a decimal number with an
/// optional 1000-based unit: 12.5MB = 12,500,000) and --cache-put-wait-ms (Options::put_wait, [0, 3,600,000]: set it
/// to the segment cache's --max-put-wait-ms when that is raised), --cache-connections (Options::connections, [1, 64]),
/// --cache-shared-memory (Options::shared_memory, true or false).
/// Anything else fails the parse (CLI::ValidationError
/// naming the flag and the value); nothing is written then.
void add_cache_client_flags(CLI::App& app, SegmentCacheClient::Options& options);

/// "base deadline 5000 ms, transfer rate 100000000 B/s, put wait 30000 ms": the options for the workers' start-up log.
std::string describe(const SegmentCacheClient::Options& options);

}  // namespace hypic::cache
