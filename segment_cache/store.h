// The segment cache's store: serialized segment entries (opaque bytes) keyed by their 128-bit
// digest, in a host-memory tier with a byte budget and LRU eviction, and optionally a local-disk
// tier that memory evictions spill to (its own byte budget, LRU). Thread-safe (one mutex; disk
// I/O happens under it, so a disk read of one entry delays other calls by its duration).
//
// Invariants:
// - Every entry carries its token ids and an XXH3-64 checksum of its bytes. Lookups and reads
//   that give token ids only hit when the stored ids are equal (a digest collision is a miss and
//   is counted in `collisions`).
// - Every read verifies the checksum (memory and disk). A mismatch drops the entry, counts a
//   corruption and throws RpcError(DATA_LOSS).
// - Entries that are pinned (a Handle is alive) or leased are never evicted. Erasing or replacing a
//   pinned or leased entry is allowed: the handle keeps the bytes it holds alive, the lease ends.
// - Leases: a lookup hit with a lease duration leases the entry under an owner (e.g. one id per router
//   request; several owners may lease one entry, and the same owner again extends its lease). A lease
//   ends when its owner releases it (release_leases) or its duration passes. The bytes of the leased
//   entries (each counted once, whatever its tier) never exceed max_leased_fraction of the memory
//   budget: a hit that would go past it is answered without a lease (LookupResult::leased false,
//   counted in unleased_hits), so leases never lock out the whole budget.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "proto/rpc/shared_memory.h"
#include "proto/rpc/status.h"

namespace hypic::cache {

using Digest = rpc::Digest;

enum class Tier { None = 0, Memory = 1, Disk = 2 };  ///< same numbering as hypic.v1.CacheTier

struct StoreOptions {
  uint64_t memory_budget_bytes = uint64_t{1} << 30;  ///< bytes of entry payload held in memory
  std::filesystem::path disk_dir;                     ///< empty: no disk tier
  uint64_t disk_budget_bytes = uint64_t{8} << 30;     ///< bytes of entry payload on disk
  /// Leased entries may hold at most this fraction of memory_budget_bytes, in [0, 1] (0: no leases).
  double max_leased_fraction = 0.5;
  /// Memory-tier entries of at least this many bytes are held in sealed memfds (proto/rpc/shared_memory.h), which a
  /// reader on the same host maps instead of streaming them (Get with accept_shared_memory); smaller ones, and every
  /// one where no memfd can be made, on the heap. UINT64_MAX: none.
  uint64_t shared_memory_min_bytes = UINT64_MAX;
  /// Clock for leases (tests inject a fake one); defaults to steady_clock::now.
  std::function<std::chrono::steady_clock::time_point()> clock;
};

/// A change to what the store holds (hypic.v1.CacheEvent, segment_cache.proto WatchEvents).
struct StoreEvent {
  enum class Kind { Stored = 1, Evicted = 2, Cleared = 3, Moved = 4 };  ///< CacheEvent.Kind numbering
  Kind kind = Kind::Stored;
  Digest digest{};
  uint64_t size_bytes = 0;
  Tier tier = Tier::None;       ///< now (Stored, Moved) or before (Evicted, Cleared)
  Tier from_tier = Tier::None;  ///< Moved: the tier it left
  const char* reason = "";      ///< Cleared: "deleted", "replaced", "corrupt"; Evicted: "lru", "spill failed"
};

/// Counters and sizes (field meanings as in hypic.v1.CacheStats).
struct StoreStats {
  uint64_t memory_entries = 0, memory_bytes = 0, memory_budget_bytes = 0;
  uint64_t disk_entries = 0, disk_bytes = 0, disk_budget_bytes = 0;
  uint64_t lookups = 0, hits = 0, misses = 0, evictions = 0, spills = 0, promotions = 0;
  uint64_t puts = 0, rejected_puts = 0, corruptions = 0, collisions = 0, pinned_entries = 0;
  uint64_t leased_entries = 0, leased_bytes = 0, max_leased_bytes = 0, unleased_hits = 0, leases_released = 0;
};

class SegmentStore {
 public:
  /// A pinned entry: its bytes stay valid, and the entry is not evicted, while the handle lives.
  class Handle {
   public:
    Handle(Handle&&) noexcept;
    Handle& operator=(Handle&&) = delete;
    Handle(const Handle&) = delete;
    ~Handle();
    std::string_view bytes() const { return bytes_->view(); }
    /// Where a reader on this host maps the bytes (fd -1: they are on the heap: below the store's
    /// shared_memory_min_bytes, read from the disk tier without being promoted, or no memfd could be made).
    rpc::MemfdRef memfd_ref() const { return bytes_->memfd_ref(); }
    uint64_t checksum() const { return checksum_; }
    Tier tier() const { return tier_; }  ///< the tier the entry was read from
    const std::vector<int32_t>& token_ids() const { return ids_; }
    /// The MAC stored with the entry (opaque to the store; empty if it was put without one).
    const std::string& mac() const { return mac_; }

   private:
    friend class SegmentStore;
    Handle(SegmentStore* s, Digest d, uint64_t gen, std::shared_ptr<const rpc::SharedBytes> b, uint64_t c, Tier t,
           std::vector<int32_t> ids, std::string mac);
    SegmentStore* store_;
    Digest digest_;
    uint64_t generation_;
    std::shared_ptr<const rpc::SharedBytes> bytes_;
    uint64_t checksum_;
    Tier tier_;
    std::vector<int32_t> ids_;
    std::string mac_;
  };

  struct LookupResult {
    bool hit = false;
    Tier tier = Tier::None;
    uint64_t size_bytes = 0;
    bool leased = false;  ///< the hit is leased (see lookup)
  };

  /// Creates the store; with a disk tier, creates disk_dir if needed and indexes the entry files
  /// already there (entries survive a restart; unreadable files are deleted and counted as
  /// corruptions). Throws std::invalid_argument for a zero memory budget or a max_leased_fraction
  /// outside [0, 1], std::runtime_error if disk_dir cannot be created.
  explicit SegmentStore(StoreOptions options);
  ~SegmentStore();
  SegmentStore(const SegmentStore&) = delete;
  SegmentStore& operator=(const SegmentStore&) = delete;

  /// Is the entry present (with these token ids)? On a hit with lease > 0, leases it under `owner`
  /// until released or for `lease` (a lease of this owner on it is extended), unless that would put
  /// the leased bytes past the cap (then leased = false). `owner` empty: an anonymous lease, which
  /// only expires. Does not change LRU order and reads no payload.
  LookupResult lookup(const Digest& digest, std::span<const int32_t> token_ids, std::chrono::milliseconds lease,
                      std::string_view owner = {});

  /// Ends every lease held by `owner` (on any entry; nothing for an unknown owner). Returns how many
  /// leases ended. The empty owner's anonymous leases are not released (they only expire).
  size_t release_leases(std::string_view owner);

  /// Reads and pins an entry, verifying its checksum (a memory-tier copy outside the store's lock, so that Gets hash
  /// in parallel). `token_ids` == nullopt skips the id check (administration). Returns nullopt on a miss or an id
  /// mismatch. A disk hit is promoted to memory when it fits. Throws RpcError(DATA_LOSS) if the bytes fail their
  /// checksum (the entry is dropped). `verify_memfd` false: a memory-tier copy held in a sealed memfd is handed out
  /// unverified, for a reader that maps it and verifies it itself (and Deletes it when it fails: nobody can write a
  /// sealed memfd, so only the hardware could have changed it).
  std::optional<Handle> get(const Digest& digest, std::optional<std::span<const int32_t>> token_ids,
                            bool verify_memfd = true);

  /// Stores (or replaces) an entry. `checksum` must be XXH3-64 of `bytes` (else DATA_LOSS, nothing
  /// stored). Makes room by evicting least recently used unpinned, unleased entries (memory
  /// evictions spill to disk when there is a disk tier). An entry larger than the memory budget
  /// goes straight to disk if it fits there. Throws RpcError(RESOURCE_EXHAUSTED) when it cannot
  /// fit. Returns true if an entry with this digest was replaced. `mac` (at most 64 bytes, else INVALID_ARGUMENT) is
  /// kept with the entry, in memory and on disk, and handed back by get(): the store does not check it (the combine
  /// worker does, proto/rpc/entry_mac.h).
  bool put(const Digest& digest, std::vector<int32_t> token_ids, std::string bytes, uint64_t checksum,
           std::string mac = {});
  /// put() of bytes already held (the service receives a large entry straight into a sealed memfd,
  /// make_shared_writer, or adopts the sender's); kept as they are when they go to memory. A memfd that another
  /// entry's bytes are in already is refused (RpcError FAILED_PRECONDITION: its pages would count twice).
  bool put(const Digest& digest, std::vector<int32_t> token_ids, std::shared_ptr<const rpc::SharedBytes> bytes,
           uint64_t checksum, std::string mac = {});
  /// A writer of a sealed memfd for an entry of `size` bytes when the store holds entries that large in shared memory
  /// (StoreOptions::shared_memory_min_bytes) and a memfd can be made; nullptr otherwise (the first failure is logged).
  std::unique_ptr<rpc::SealedMemfdWriter> make_shared_writer(uint64_t size) const;
  /// `bytes` moved into a sealed memfd when the store holds entries that large in one and it can be made (else, or
  /// when they are shared already, `bytes` itself).
  std::shared_ptr<const rpc::SharedBytes> share(std::shared_ptr<const rpc::SharedBytes> bytes) const;
  /// Whether this store holds entries in sealed memfds at all (StoreOptions::shared_memory_min_bytes set).
  bool holds_shared_memory() const { return opt_.shared_memory_min_bytes != UINT64_MAX; }
  uint64_t shared_memory_min_bytes() const { return opt_.shared_memory_min_bytes; }
  /// Whether an entry held in memory is in the memfd of this inode (a put of the same pages under another digest
  /// would count them twice against the budget: the service declines it).
  bool holds_memfd(uint64_t inode) const {
    std::lock_guard<std::mutex> lock(mu_);
    return inode != 0 && memfd_inodes_.count(inode) > 0;
  }
  /// The largest entry put() could ever store: the memory budget, or the disk budget when it is larger (bytes).
  uint64_t max_entry_bytes() const {
    return opt_.disk_dir.empty() ? opt_.memory_budget_bytes : std::max(opt_.memory_budget_bytes, opt_.disk_budget_bytes);
  }

  /// Counts a put refused before it reached the store (the service's checks on its header) in rejected_puts.
  void count_rejected_put() {
    std::lock_guard<std::mutex> lock(mu_);
    ++counters_.rejected_puts;
  }

  /// What a conditional erase must find: the stored entry's checksum (XXH3-64 it was put with) and MAC, where given.
  struct EraseIf {
    std::optional<uint64_t> checksum;
    std::optional<std::string> mac;
  };
  /// Removes an entry from every tier; false if absent or, with `only_if`, when the entry held is not the one named
  /// (replaced since the caller read it). `corrupt`: its reader found it failing its checksum (a memfd handed out
  /// unverified); counted in corruptions and reported with the reason "corrupt" instead of "deleted".
  bool erase(const Digest& digest, const EraseIf& only_if = {}, bool corrupt = false);

  /// Counters and sizes; also ends the leases that have expired.
  StoreStats stats();

  /// Receives every StoreEvent, in order, on the thread that caused it and under the store's lock: it must be quick
  /// and must not call the store (CacheEventHub::publish is). Set once, before the store is shared.
  void set_event_sink(std::function<void(const StoreEvent&)> sink);
  /// One Stored event per entry held now (tier as held), and, under the same lock, `then()`: what then() registers
  /// sees exactly the events after this listing (none lost, none twice).
  std::vector<StoreEvent> list_entries_then(const std::function<void()>& then);

 private:
  /// get() less the memory-tier checksum (the rest under the lock: lookup, id check, disk read and promotion, pin).
  /// *pending: a memory-tier copy get() still has to verify (its hit and LRU touch not counted yet).
  std::optional<Handle> get_unverified(const Digest& digest, std::optional<std::span<const int32_t>> token_ids,
                                       bool verify_memfd, bool* pending);
  struct Entry {
    std::vector<int32_t> ids;
    std::string mac;
    uint64_t checksum = 0;
    uint64_t size = 0;
    Tier tier = Tier::None;
    std::shared_ptr<const rpc::SharedBytes> bytes;  // memory tier only
    std::list<Digest>::iterator lru;           // in the list of its tier
    uint32_t pins = 0;
    uint32_t leases = 0;  // live leases (of distinct owners) on this generation of the entry
    uint64_t generation = 0;
  };
  using LeaseKey = std::pair<std::string, Digest>;  // (owner, entry)
  struct Lease {
    uint64_t generation = 0;  // of the entry it was taken on (a replaced entry's leases are stale)
    std::multimap<std::chrono::steady_clock::time_point, LeaseKey>::iterator expiry;
  };
  struct DigestHash {
    size_t operator()(const Digest& d) const noexcept;
  };
  using Map = std::unordered_map<Digest, Entry, DigestHash>;

  std::chrono::steady_clock::time_point now() const;
  bool evictable(const Entry& e) const { return e.pins == 0 && e.leases == 0; }
  // Takes or extends owner's lease on the entry; false when the cap forbids a new one.
  bool lease_locked(const std::string& owner, const Digest& d, Entry& e, std::chrono::milliseconds duration);
  // Ends one lease (its entry stops counting as leased when it was the last).
  void end_lease_locked(std::map<LeaseKey, Lease>::iterator it);
  // Ends the leases whose time has passed; every public call starts with it.
  void expire_leases_locked();
  std::filesystem::path file_of(const Digest& d) const;
  void unpin(const Digest& d, uint64_t generation);
  // Removes an entry from its tier and the map, telling the event sink (kind, reason).
  void drop(Map::iterator it, StoreEvent::Kind kind, const char* reason);
  void touch(Entry& e, const Digest& d);
  // Frees memory until `need` more bytes fit; false if pinned/leased entries prevent it.
  bool make_memory_room(uint64_t need);
  bool make_disk_room(uint64_t need);
  // Moves a memory entry to disk (or drops it when it cannot be written or does not fit).
  void spill(Map::iterator it);
  void write_disk_file(const Digest& d, const Entry& e, std::string_view bytes) const;
  std::shared_ptr<const rpc::SharedBytes> read_disk_file(const Digest& d, const Entry& e) const;
  void index_disk_dir();

  StoreOptions opt_;
  mutable std::mutex mu_;
  Map map_;
  std::list<Digest> mem_lru_, disk_lru_;  // front = most recently used
  uint64_t mem_bytes_ = 0, disk_bytes_ = 0;
  uint64_t leased_bytes_ = 0, max_leased_bytes_ = 0;  // bytes of the entries with leases > 0, and the cap
  std::map<LeaseKey, Lease> leases_;
  std::unordered_map<uint64_t, Digest> memfd_inodes_;  // inode of each memory-tier entry held in a memfd -> its digest
  std::multimap<std::chrono::steady_clock::time_point, LeaseKey> lease_expiry_;
  uint64_t next_generation_ = 1;
  StoreStats counters_;
  std::function<void(const StoreEvent&)> sink_;
  void emit(StoreEvent::Kind kind, const Digest& d, uint64_t size, Tier tier, const char* reason = "",
            Tier from = Tier::None) const {
    if (sink_) sink_(StoreEvent{kind, d, size, tier, from, reason});
  }
};

}  // namespace hypic::cache
