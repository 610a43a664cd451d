#include "segment_cache/store.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "proto/rpc/chunks.h"
#include "engine/io_error.h"

namespace hypic::cache {

namespace {
// Disk-tier file layout (native little-endian): magic "HYPSEG02", u64 checksum, u64 payload size,
// u32 number of token ids, i32 ids[n], u32 MAC size m (at most 64), the entry's MAC (m bytes, opaque here), payload
// bytes. Files of the first layout ("HYPSEG01": no MAC fields) are still read (entries without a MAC). File name:
// <digest hex>.entry.
constexpr char kMagic[8] = {'H', 'Y', 'P', 'S', 'E', 'G', '0', '2'};
constexpr char kMagicV1[8] = {'H', 'Y', 'P', 'S', 'E', 'G', '0', '1'};
constexpr uint64_t kFixedHeader = sizeof(kMagic) + 8 + 8 + 4;
constexpr uint32_t kMaxMacBytes = 64;
constexpr std::string_view kSuffix = ".entry";

struct DiskHeader {
  uint64_t checksum = 0;
  uint64_t size = 0;
  std::vector<int32_t> ids;
  std::string mac;
};

// Reads the header of an entry file; throws std::runtime_error naming the file on any problem.
DiskHeader read_header(std::ifstream& in, const std::filesystem::path& path) {
  char magic[8];
  DiskHeader h;
  uint32_t n = 0;
  in.read(magic, sizeof magic);
  in.read(reinterpret_cast<char*>(&h.checksum), 8);
  in.read(reinterpret_cast<char*>(&h.size), 8);
  in.read(reinterpret_cast<char*>(&n), 4);
  const bool v2 = in && std::memcmp(magic, kMagic, sizeof magic) == 0;
  if (!in || (!v2 && std::memcmp(magic, kMagicV1, sizeof magic) != 0)) {
    throw std::runtime_error(fmt::format("{}: not a segment entry file (bad magic or truncated header)", path.string()));
  }
  std::error_code ec;
  const auto file_size = std::filesystem::file_size(path, ec);
  const uint64_t before_mac = kFixedHeader + uint64_t{n} * 4;
  if (ec || before_mac + (v2 ? 4 : 0) + h.size > file_size) {
    throw std::runtime_error(fmt::format("{}: file has {} bytes, header announces {} ids and {} payload bytes",
                                         path.string(), ec ? 0 : file_size, n, h.size));
  }
  h.ids.resize(n);
  in.read(reinterpret_cast<char*>(h.ids.data()), std::streamsize(n) * 4);
  if (!in) throw std::runtime_error(fmt::format("{}: truncated token ids", path.string()));
  uint32_t m = 0;
  if (v2) in.read(reinterpret_cast<char*>(&m), 4);
  if (!in || m > kMaxMacBytes || before_mac + (v2 ? 4 : 0) + m + h.size != file_size) {
    throw std::runtime_error(fmt::format("{}: file has {} bytes, header announces {} ids, a MAC of {} bytes and {} "
                                         "payload bytes",
                                         path.string(), file_size, n, m, h.size));
  }
  h.mac.resize(m);
  in.read(h.mac.data(), std::streamsize(m));
  if (!in) throw std::runtime_error(fmt::format("{}: truncated MAC", path.string()));
  return h;
}

bool same_ids(std::span<const int32_t> a, const std::vector<int32_t>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

std::string fmt_bytes(uint64_t b) { return fmt::format("{} bytes", b); }
}  // namespace

size_t SegmentStore::DigestHash::operator()(const Digest& d) const noexcept {
  size_t h;
  std::memcpy(&h, d.data(), sizeof h);  // the digest is already a uniform hash
  return h;
}

SegmentStore::Handle::Handle(SegmentStore* s, Digest d, uint64_t gen, std::shared_ptr<const rpc::SharedBytes> b,
                             uint64_t c, Tier t, std::vector<int32_t> ids, std::string mac)
    : store_(s), digest_(d), generation_(gen), bytes_(std::move(b)), checksum_(c), tier_(t), ids_(std::move(ids)),
      mac_(std::move(mac)) {}

SegmentStore::Handle::Handle(Handle&& o) noexcept
    : store_(o.store_), digest_(o.digest_), generation_(o.generation_), bytes_(std::move(o.bytes_)),
      checksum_(o.checksum_), tier_(o.tier_), ids_(std::move(o.ids_)), mac_(std::move(o.mac_)) {
  o.store_ = nullptr;
}

SegmentStore::Handle::~Handle() {
  if (store_) store_->unpin(digest_, generation_);
}

SegmentStore::SegmentStore(StoreOptions options) : opt_(std::move(options)) {
  if (opt_.memory_budget_bytes == 0) throw std::invalid_argument("memory_budget_bytes: must be > 0");
  if (!(opt_.max_leased_fraction >= 0.0 && opt_.max_leased_fraction <= 1.0)) {
    throw std::invalid_argument(fmt::format("max_leased_fraction: must be in [0, 1], got {}", opt_.max_leased_fraction));
  }
  counters_.memory_budget_bytes = opt_.memory_budget_bytes;
  max_leased_bytes_ = static_cast<uint64_t>(opt_.max_leased_fraction * double(opt_.memory_budget_bytes));
  counters_.max_leased_bytes = max_leased_bytes_;
  if (!opt_.disk_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(opt_.disk_dir, ec);
    if (ec) throw std::runtime_error(fmt::format("disk_dir: cannot create {}: {}", opt_.disk_dir.string(), ec.message()));
    counters_.disk_budget_bytes = opt_.disk_budget_bytes;
    index_disk_dir();
  }
}

SegmentStore::~SegmentStore() = default;

std::chrono::steady_clock::time_point SegmentStore::now() const {
  return opt_.clock ? opt_.clock() : std::chrono::steady_clock::now();
}

std::filesystem::path SegmentStore::file_of(const Digest& d) const {
  return opt_.disk_dir / (rpc::digest_hex(d) + std::string(kSuffix));
}

void SegmentStore::index_disk_dir() {
  struct Found {
    Digest d;
    DiskHeader h;
    std::filesystem::file_time_type mtime;
  };
  std::vector<Found> found;
  for (const auto& de : std::filesystem::directory_iterator(opt_.disk_dir)) {
    const auto path = de.path();
    const std::string name = path.filename().string();
    if (!de.is_regular_file() || name.size() != 32 + kSuffix.size() || !name.ends_with(kSuffix)) continue;
    try {
      const Digest d = rpc::digest_from_hex(std::string_view(name).substr(0, 32));
      std::ifstream in(path, std::ios::binary);
      found.push_back({d, read_header(in, path), de.last_write_time()});
    } catch (const std::exception& e) {
      spdlog::warn("disk tier: deleting unreadable entry file: {}", e.what());
      std::filesystem::remove(path);
      ++counters_.corruptions;
    }
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime > b.mtime; });
  for (auto& f : found) {
    Entry e;
    e.ids = std::move(f.h.ids);
    e.mac = std::move(f.h.mac);
    e.checksum = f.h.checksum;
    e.size = f.h.size;
    e.tier = Tier::Disk;
    e.generation = next_generation_++;
    disk_lru_.push_back(f.d);  // newest first
    e.lru = std::prev(disk_lru_.end());
    disk_bytes_ += e.size;
    map_.emplace(f.d, std::move(e));
  }
  // A smaller budget than last time: drop the oldest.
  while (disk_bytes_ > opt_.disk_budget_bytes && !disk_lru_.empty()) {
    drop(map_.find(disk_lru_.back()), StoreEvent::Kind::Evicted, "lru");
    ++counters_.evictions;
  }
  if (!found.empty()) spdlog::info("disk tier: indexed {} entries ({} bytes) in {}", map_.size(), disk_bytes_,
                                   opt_.disk_dir.string());
}

void SegmentStore::write_disk_file(const Digest& d, const Entry& e, std::string_view bytes) const {
  const auto path = file_of(d);
  const auto tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    const uint32_t n = static_cast<uint32_t>(e.ids.size());
    out.write(kMagic, sizeof kMagic);
    out.write(reinterpret_cast<const char*>(&e.checksum), 8);
    out.write(reinterpret_cast<const char*>(&e.size), 8);
    out.write(reinterpret_cast<const char*>(&n), 4);
    out.write(reinterpret_cast<const char*>(e.ids.data()), std::streamsize(n) * 4);
    const uint32_t m = static_cast<uint32_t>(e.mac.size());
    out.write(reinterpret_cast<const char*>(&m), 4);
    out.write(e.mac.data(), std::streamsize(m));
    out.write(bytes.data(), std::streamsize(bytes.size()));
    out.flush();
    if (!out) {
      std::filesystem::remove(tmp);
      throw std::runtime_error(fmt::format("cannot write {} (disk full?)", tmp));
    }
  }
  std::filesystem::rename(tmp, path);
}

std::shared_ptr<const rpc::SharedBytes> SegmentStore::read_disk_file(const Digest& d, const Entry& e) const {
  const auto path = file_of(d);
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("{}: cannot open: {}", path.string(), engine::io_error_reason(path, errno)));
  const DiskHeader h = read_header(in, path);
  if (h.checksum != e.checksum || h.size != e.size || h.ids != e.ids || h.mac != e.mac) {
    throw std::runtime_error(fmt::format("{}: header does not match the index (checksum, size, token ids or MAC)",
                                         path.string()));
  }
  std::string b(h.size, '\0');
  in.read(b.data(), std::streamsize(h.size));
  if (!in) throw std::runtime_error(fmt::format("{}: truncated payload", path.string()));
  auto bytes = rpc::SharedBytes::heap(std::move(b));
  const uint64_t got = rpc::checksum64(bytes->view());
  if (got != e.checksum) {
    throw std::runtime_error(fmt::format("{}: XXH3-64 checksum {:016x} != stored {:016x}", path.string(), got,
                                         e.checksum));
  }
  return bytes;
}

void SegmentStore::drop(Map::iterator it, StoreEvent::Kind kind, const char* reason) {
  Entry& e = it->second;
  emit(kind, it->first, e.size, e.tier, reason);
  if (e.leases > 0) leased_bytes_ -= e.size;  // its lease records are stale now (generation), ended later
  if (e.tier == Tier::Memory) {
    mem_lru_.erase(e.lru);
    mem_bytes_ -= e.size;
    if (e.bytes && e.bytes->shared()) memfd_inodes_.erase(e.bytes->inode());
  } else if (e.tier == Tier::Disk) {
    disk_lru_.erase(e.lru);
    disk_bytes_ -= e.size;
    std::error_code ec;
    std::filesystem::remove(file_of(it->first), ec);
  }
  map_.erase(it);
}

void SegmentStore::touch(Entry& e, const Digest& d) {
  auto& lru = e.tier == Tier::Memory ? mem_lru_ : disk_lru_;
  lru.erase(e.lru);
  lru.push_front(d);
  e.lru = lru.begin();
}

void SegmentStore::unpin(const Digest& d, uint64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(d);
  if (it != map_.end() && it->second.generation == generation && it->second.pins > 0) --it->second.pins;
}

namespace {
// Victims (least recently used first) whose sizes free at least `need` bytes, or {} if the
// evictable entries are not enough.
template <class IsEvictable, class SizeOf>
std::vector<Digest> pick_victims(const std::list<Digest>& lru, uint64_t used, uint64_t budget, uint64_t need,
                                 IsEvictable&& evictable, SizeOf&& size_of) {
  std::vector<Digest> victims;
  if (need > budget) return victims;
  uint64_t after = used;
  for (auto rit = lru.rbegin(); rit != lru.rend() && after + need > budget; ++rit) {
    if (!evictable(*rit)) continue;
    victims.push_back(*rit);
    after -= size_of(*rit);
  }
  if (after + need > budget) victims.clear();
  return victims;
}
}  // namespace

bool SegmentStore::make_memory_room(uint64_t need) {
  if (need > opt_.memory_budget_bytes) return false;
  if (mem_bytes_ + need <= opt_.memory_budget_bytes) return true;
  auto victims = pick_victims(
      mem_lru_, mem_bytes_, opt_.memory_budget_bytes, need, [&](const Digest& d) { return evictable(map_.at(d)); },
      [&](const Digest& d) { return map_.at(d).size; });
  if (victims.empty()) return false;
  for (const Digest& d : victims) spill(map_.find(d));
  return true;
}

bool SegmentStore::make_disk_room(uint64_t need) {
  if (opt_.disk_dir.empty() || need > opt_.disk_budget_bytes) return false;
  if (disk_bytes_ + need <= opt_.disk_budget_bytes) return true;
  auto victims = pick_victims(
      disk_lru_, disk_bytes_, opt_.disk_budget_bytes, need, [&](const Digest& d) { return evictable(map_.at(d)); },
      [&](const Digest& d) { return map_.at(d).size; });
  if (victims.empty()) return false;
  for (const Digest& d : victims) {
    drop(map_.find(d), StoreEvent::Kind::Evicted, "lru");
    ++counters_.evictions;
  }
  return true;
}

void SegmentStore::spill(Map::iterator it) {
  Entry& e = it->second;
  const Digest d = it->first;
  std::shared_ptr<const rpc::SharedBytes> bytes = std::move(e.bytes);
  if (bytes->shared()) memfd_inodes_.erase(bytes->inode());
  mem_lru_.erase(e.lru);
  mem_bytes_ -= e.size;
  e.tier = Tier::None;
  if (make_disk_room(e.size)) {
    try {
      write_disk_file(d, e, bytes->view());
      e.tier = Tier::Disk;
      disk_lru_.push_front(d);
      e.lru = disk_lru_.begin();
      disk_bytes_ += e.size;
      ++counters_.spills;
      emit(StoreEvent::Kind::Moved, d, e.size, Tier::Disk, "", Tier::Memory);
      return;
    } catch (const std::exception& ex) {
      spdlog::warn("disk tier: spilling {} failed, dropping it: {}", rpc::digest_hex(d), ex.what());
    }
  }
  emit(StoreEvent::Kind::Evicted, d, e.size, Tier::Memory, opt_.disk_dir.empty() ? "lru" : "spill failed");
  map_.erase(it);
  ++counters_.evictions;
}

bool SegmentStore::lease_locked(const std::string& owner, const Digest& d, Entry& e,
                                std::chrono::milliseconds duration) {
  const auto until = now() + duration;
  if (auto it = leases_.find(LeaseKey{owner, d}); it != leases_.end()) {
    if (it->second.generation == e.generation) {  // this owner's lease on this entry: extend it
      if (it->second.expiry->first < until) {
        lease_expiry_.erase(it->second.expiry);
        it->second.expiry = lease_expiry_.emplace(until, it->first);
      }
      return true;
    }
    end_lease_locked(it);  // taken on an entry since replaced
  }
  if (e.leases == 0) {
    if (leased_bytes_ + e.size > max_leased_bytes_) return false;
    leased_bytes_ += e.size;
  }
  ++e.leases;
  auto ins = leases_.emplace(LeaseKey{owner, d}, Lease{e.generation, {}}).first;
  ins->second.expiry = lease_expiry_.emplace(until, ins->first);
  return true;
}

void SegmentStore::end_lease_locked(std::map<LeaseKey, Lease>::iterator it) {
  auto m = map_.find(it->first.second);
  if (m != map_.end() && m->second.generation == it->second.generation && m->second.leases > 0) {
    if (--m->second.leases == 0) leased_bytes_ -= m->second.size;
  }
  lease_expiry_.erase(it->second.expiry);
  leases_.erase(it);
}

void SegmentStore::expire_leases_locked() {
  const auto t = now();
  while (!lease_expiry_.empty() && lease_expiry_.begin()->first <= t) {
    end_lease_locked(leases_.find(lease_expiry_.begin()->second));
  }
}

size_t SegmentStore::release_leases(std::string_view owner) {
  if (owner.empty()) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  expire_leases_locked();
  size_t n = 0;
  for (auto it = leases_.lower_bound(LeaseKey{std::string(owner), Digest{}});
       it != leases_.end() && it->first.first == owner; ++n) {
    end_lease_locked(it++);
  }
  counters_.leases_released += n;
  return n;
}

SegmentStore::LookupResult SegmentStore::lookup(const Digest& digest, std::span<const int32_t> token_ids,
                                                std::chrono::milliseconds lease, std::string_view owner) {
  std::lock_guard<std::mutex> lock(mu_);
  expire_leases_locked();
  ++counters_.lookups;
  auto it = map_.find(digest);
  if (it == map_.end()) {
    ++counters_.misses;
    return {};
  }
  Entry& e = it->second;
  if (!same_ids(token_ids, e.ids)) {
    ++counters_.collisions;
    ++counters_.misses;
    return {};
  }
  ++counters_.hits;
  bool leased = false;
  if (lease.count() > 0) {
    leased = lease_locked(std::string(owner), digest, e, lease);
    if (!leased) ++counters_.unleased_hits;
  }
  return {true, e.tier, e.size, leased};
}

std::optional<SegmentStore::Handle> SegmentStore::get(const Digest& digest,
                                                      std::optional<std::span<const int32_t>> token_ids,
                                                      bool verify_memfd) {
  bool pending = false;
  std::optional<Handle> h = get_unverified(digest, token_ids, verify_memfd, &pending);
  // A memory-tier copy is verified outside the store's lock (a 232 MB entry takes tens of ms to hash; Gets of
  // several entries at once hash them in parallel), unless it is in a sealed memfd that the reader verifies itself.
  // Its hit (and LRU touch) is counted once it verified, so that the counters only ever grow.
  if (!pending) return h;
  const uint64_t got = rpc::checksum64(h->bytes());
  const uint64_t generation = h->generation_, stored = h->checksum();
  if (got == stored) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counters_.hits;
    auto it = map_.find(digest);
    if (it != map_.end() && it->second.generation == generation) touch(it->second, digest);
    return h;
  }
  const std::shared_ptr<const rpc::SharedBytes> bytes = h->bytes_;
  h.reset();  // unpinned
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.misses;
  // Dropped and counted once, by the Get that finds it still in place: not by a second Get that hashed the same copy
  // meanwhile, nor when a put replaced it meanwhile (the new generation stays).
  auto it = map_.find(digest);
  const bool dropped = it != map_.end() && it->second.generation == generation && it->second.bytes == bytes;
  if (dropped) {
    ++counters_.corruptions;
    drop(it, StoreEvent::Kind::Cleared, "corrupt");
  }
  const std::string why = fmt::format("memory copy: XXH3-64 checksum {:016x} != stored {:016x}", got, stored);
  const char* what = dropped ? "was dropped" : "had been dropped or replaced meanwhile";
  spdlog::error("entry {} is corrupt and {}: {}", rpc::digest_hex(digest), what, why);
  throw rpc::RpcError(grpc::StatusCode::DATA_LOSS, fmt::format("segment entry {} failed its integrity check and {}: {}",
                                                               rpc::digest_hex(digest), what, why));
}

std::optional<SegmentStore::Handle> SegmentStore::get_unverified(const Digest& digest,
                                                                 std::optional<std::span<const int32_t>> token_ids,
                                                                 bool verify_memfd, bool* pending) {
  std::lock_guard<std::mutex> lock(mu_);
  expire_leases_locked();
  ++counters_.lookups;
  auto it = map_.find(digest);
  if (it == map_.end()) {
    ++counters_.misses;
    return std::nullopt;
  }
  Entry& e = it->second;
  if (token_ids && !same_ids(*token_ids, e.ids)) {
    ++counters_.collisions;
    ++counters_.misses;
    return std::nullopt;
  }
  const Tier read_from = e.tier;
  std::shared_ptr<const rpc::SharedBytes> bytes;
  try {
    if (e.tier == Tier::Memory) {
      bytes = e.bytes;  // verified by get(), outside the lock
    } else {
      bytes = read_disk_file(digest, e);
    }
  } catch (const std::exception& ex) {
    ++counters_.corruptions;
    ++counters_.misses;
    drop(it, StoreEvent::Kind::Cleared, "corrupt");
    spdlog::error("entry {} is corrupt and was dropped: {}", rpc::digest_hex(digest), ex.what());
    throw rpc::RpcError(grpc::StatusCode::DATA_LOSS,
                        fmt::format("segment entry {} failed its integrity check and was dropped: {}",
                                    rpc::digest_hex(digest), ex.what()));
  }
  if (e.tier == Tier::Disk) {
    // Promote to memory (exclusive tiers: the disk copy goes away) when it fits. Pin the entry
    // first so that making room cannot pick it.
    ++e.pins;
    const bool fits = make_memory_room(e.size);
    --e.pins;
    if (fits) {
      disk_lru_.erase(e.lru);
      disk_bytes_ -= e.size;
      std::error_code ec;
      std::filesystem::remove(file_of(digest), ec);
      e.tier = Tier::Memory;
      e.bytes = share(std::move(bytes));  // held in a sealed memfd from now on, where entries this large are
      bytes = e.bytes;
      if (bytes->shared()) memfd_inodes_[bytes->inode()] = digest;
      mem_lru_.push_front(digest);
      e.lru = mem_lru_.begin();
      mem_bytes_ += e.size;
      ++counters_.promotions;
      emit(StoreEvent::Kind::Moved, digest, e.size, Tier::Memory, "", Tier::Disk);
    }
  }
  *pending = read_from == Tier::Memory && (verify_memfd || !bytes->shared());
  if (!*pending) {  // (else counted by get() once verified)
    touch(e, digest);
    ++counters_.hits;
  }
  ++e.pins;
  return Handle(this, digest, e.generation, std::move(bytes), e.checksum, read_from, e.ids, e.mac);
}

std::unique_ptr<rpc::SealedMemfdWriter> SegmentStore::make_shared_writer(uint64_t size) const {
  if (size == 0 || size < opt_.shared_memory_min_bytes) return nullptr;
  std::string why;
  auto w = rpc::SealedMemfdWriter::create(size, &why);
  if (!w) {
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true)) {
      spdlog::warn("segment store: an entry of {} bytes is held on the heap, not in shared memory ({}); readers on "
                   "this host stream it (logged once)", size, why);
    }
  }
  return w;
}

std::shared_ptr<const rpc::SharedBytes> SegmentStore::share(std::shared_ptr<const rpc::SharedBytes> bytes) const {
  if (bytes->shared()) return bytes;
  auto w = make_shared_writer(bytes->size());
  if (!w) return bytes;
  try {
    w->append(bytes->view());
    return w->seal();
  } catch (const std::exception& e) {  // no memory for a second copy now: the heap copy serves (streamed)
    spdlog::debug("segment store: an entry of {} bytes stays on the heap: {}", bytes->size(), e.what());
    return bytes;
  }
}

bool SegmentStore::put(const Digest& digest, std::vector<int32_t> token_ids, std::string bytes, uint64_t checksum,
                       std::string mac) {
  return put(digest, std::move(token_ids), share(rpc::SharedBytes::heap(std::move(bytes))), checksum, std::move(mac));
}

bool SegmentStore::put(const Digest& digest, std::vector<int32_t> token_ids,
                       std::shared_ptr<const rpc::SharedBytes> bytes, uint64_t checksum, std::string mac) {
  const uint64_t got = rpc::checksum64(bytes->view());
  std::lock_guard<std::mutex> lock(mu_);
  expire_leases_locked();
  if (mac.size() > kMaxMacBytes) {
    ++counters_.rejected_puts;
    throw rpc::invalid_argument("mac", fmt::format("{} bytes, at most {}", mac.size(), kMaxMacBytes));
  }
  if (got != checksum) {
    ++counters_.rejected_puts;
    throw rpc::RpcError(grpc::StatusCode::DATA_LOSS,
                        fmt::format("put {}: XXH3-64 checksum of the {} bytes is {:016x}, the header says {:016x}",
                                    rpc::digest_hex(digest), bytes->size(), got, checksum));
  }
  if (bytes->shared()) {
    if (const auto it = memfd_inodes_.find(bytes->inode()); it != memfd_inodes_.end() && it->second != digest) {
      ++counters_.rejected_puts;
      throw rpc::RpcError(grpc::StatusCode::FAILED_PRECONDITION,
                          fmt::format("put {}: its memfd holds entry {} already (its pages would count twice)",
                                      rpc::digest_hex(digest), rpc::digest_hex(it->second)));
    }
  }
  ++counters_.puts;
  bool replaced = false;
  if (auto it = map_.find(digest); it != map_.end()) {
    drop(it, StoreEvent::Kind::Cleared, "replaced");
    replaced = true;
  }
  Entry e;
  e.ids = std::move(token_ids);
  e.mac = std::move(mac);
  e.checksum = checksum;
  e.size = bytes->size();
  e.generation = next_generation_++;
  if (make_memory_room(e.size)) {
    e.tier = Tier::Memory;
    e.bytes = std::move(bytes);
    if (e.bytes->shared()) memfd_inodes_[e.bytes->inode()] = digest;
    mem_lru_.push_front(digest);
    e.lru = mem_lru_.begin();
    mem_bytes_ += e.size;
    emit(StoreEvent::Kind::Stored, digest, e.size, Tier::Memory);
    map_.emplace(digest, std::move(e));
    return replaced;
  }
  if (make_disk_room(e.size)) {
    try {
      write_disk_file(digest, e, bytes->view());
      e.tier = Tier::Disk;
      disk_lru_.push_front(digest);
      e.lru = disk_lru_.begin();
      disk_bytes_ += e.size;
      emit(StoreEvent::Kind::Stored, digest, e.size, Tier::Disk);
      map_.emplace(digest, std::move(e));
      return replaced;
    } catch (const std::exception& ex) {
      ++counters_.rejected_puts;
      throw rpc::RpcError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          fmt::format("put {}: {}", rpc::digest_hex(digest), ex.what()));
    }
  }
  ++counters_.rejected_puts;
  throw rpc::RpcError(
      grpc::StatusCode::RESOURCE_EXHAUSTED,
      fmt::format("put {}: an entry of {} does not fit (memory {} of {} used, leased entries {}{}; what cannot be "
                  "evicted is pinned or leased)",
                  rpc::digest_hex(digest), fmt_bytes(e.size), fmt_bytes(mem_bytes_), fmt_bytes(opt_.memory_budget_bytes),
                  fmt_bytes(leased_bytes_),
                  opt_.disk_dir.empty() ? std::string(", no disk tier")
                                        : fmt::format(", disk {} of {} used", fmt_bytes(disk_bytes_),
                                                      fmt_bytes(opt_.disk_budget_bytes))));
}

bool SegmentStore::erase(const Digest& digest, const EraseIf& only_if, bool corrupt) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(digest);
  if (it == map_.end()) return false;
  if (only_if.checksum && *only_if.checksum != it->second.checksum) return false;
  if (only_if.mac && *only_if.mac != it->second.mac) return false;
  if (corrupt) ++counters_.corruptions;
  drop(it, StoreEvent::Kind::Cleared, corrupt ? "corrupt" : "deleted");
  return true;
}

void SegmentStore::set_event_sink(std::function<void(const StoreEvent&)> sink) {
  std::lock_guard<std::mutex> lock(mu_);
  sink_ = std::move(sink);
}

std::vector<StoreEvent> SegmentStore::list_entries_then(const std::function<void()>& then) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<StoreEvent> out;
  out.reserve(map_.size());
  for (const auto* lru : {&mem_lru_, &disk_lru_}) {
    for (const Digest& d : *lru) {
      const Entry& e = map_.at(d);
      out.push_back(StoreEvent{StoreEvent::Kind::Stored, d, e.size, e.tier, Tier::None, ""});
    }
  }
  then();
  return out;
}

StoreStats SegmentStore::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  expire_leases_locked();
  StoreStats s = counters_;
  s.memory_entries = mem_lru_.size();
  s.memory_bytes = mem_bytes_;
  s.disk_entries = disk_lru_.size();
  s.disk_bytes = disk_bytes_;
  s.pinned_entries = static_cast<uint64_t>(
      std::count_if(map_.begin(), map_.end(), [](const auto& kv) { return kv.second.pins > 0; }));
  s.leased_entries = static_cast<uint64_t>(
      std::count_if(map_.begin(), map_.end(), [](const auto& kv) { return kv.second.leases > 0; }));
  s.leased_bytes = leased_bytes_;
  return s;
}

}  // namespace hypic::cache
