#include "segment_cache/service.h"

#include <algorithm>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "proto/rpc/chunks.h"
#include "proto/rpc/metrics.h"
#include "proto/rpc/security.h"
#include "segment_cache/shared_memory_proto.h"

namespace hypic::cache {

namespace v1 = hypic::v1;

namespace {
constexpr size_t kMaxLeaseOwnerBytes = 128;

/// hypic:cache_gets_total{transport}: Gets answered with the bytes streamed, or with a sealed memfd to map.
rpc::Counter& gets_counter(const char* transport) {
  return rpc::MetricsRegistry::global().counter(
      "hypic:cache_gets_total", "Entries read by Get, by transport (grpc: streamed; shared_memory: a sealed memfd the "
      "reader on this host maps)", {{"transport", transport}});
}

/// hypic:cache_puts_received_total{transport}: Puts whose bytes were streamed, or whose sender's memfd was adopted.
rpc::Counter& puts_counter(const char* transport) {
  return rpc::MetricsRegistry::global().counter(
      "hypic:cache_puts_received_total", "Entries received by Put, by transport (grpc: streamed; shared_memory: the "
      "sender's sealed memfd adopted)", {{"transport", transport}});
}

rpc::Counter& bytes_counter(const char* direction) {
  return rpc::MetricsRegistry::global().counter("hypic:cache_entry_bytes_total",
                                                "Entry bytes moved by the segment cache (in: puts, out: gets)",
                                                {{"direction", direction}});
}
}  // namespace

SegmentCacheService::SegmentCacheService(SegmentStore& store, rpc::Lifecycle& life, size_t chunk_bytes,
                                         uint32_t max_lease_ms, size_t max_queued_events,
                                         std::chrono::milliseconds max_put_wait,
                                         std::chrono::milliseconds put_idle_timeout)
    : store_(store), life_(life), chunk_bytes_(chunk_bytes), max_lease_ms_(max_lease_ms), events_(max_queued_events),
      max_receiving_bytes_(store.stats().memory_budget_bytes), max_put_wait_(max_put_wait),
      put_idle_timeout_(put_idle_timeout) {
  if (put_idle_timeout_.count() > 0) watchdog_ = std::thread([this] { watch_idle_puts(); });
  store_.set_event_sink([this](const StoreEvent& e) { events_.publish(e); });
  auto& reg = rpc::MetricsRegistry::global();
  bytes_counter("in");  // (registered now: scraped as 0 before the first put or get)
  bytes_counter("out");
  gets_counter("grpc");
  gets_counter("shared_memory");
  puts_counter("grpc");
  puts_counter("shared_memory");
  auto stat = [&store](uint64_t StoreStats::*field) { return [&store, field] { return double(store.stats().*field); }; };
  reg.gauge_fn("hypic:cache_bytes", "Bytes of segment entries held, by tier", stat(&StoreStats::memory_bytes),
               {{"tier", "memory"}});
  reg.gauge_fn("hypic:cache_bytes", "Bytes of segment entries held, by tier", stat(&StoreStats::disk_bytes),
               {{"tier", "disk"}});
  reg.gauge_fn("hypic:cache_budget_bytes", "Byte budget of each tier", stat(&StoreStats::memory_budget_bytes),
               {{"tier", "memory"}});
  reg.gauge_fn("hypic:cache_budget_bytes", "Byte budget of each tier", stat(&StoreStats::disk_budget_bytes),
               {{"tier", "disk"}});
  reg.gauge_fn("hypic:cache_entries", "Segment entries held, by tier", stat(&StoreStats::memory_entries),
               {{"tier", "memory"}});
  reg.gauge_fn("hypic:cache_entries", "Segment entries held, by tier", stat(&StoreStats::disk_entries),
               {{"tier", "disk"}});
  reg.gauge_fn("hypic:cache_leased_bytes", "Bytes of entries under a hit lease", stat(&StoreStats::leased_bytes));
  reg.gauge_fn("hypic:cache_receiving_bytes", "Announced bytes of the puts being received (admitted past their header)",
               [this] { return double(receiving_bytes()); });
  reg.counter_fn("hypic:cache_lookups_total", "Lookups and gets of a digest", stat(&StoreStats::lookups));
  reg.counter_fn("hypic:cache_hits_total", "Lookups and gets that found the entry", stat(&StoreStats::hits));
  reg.counter_fn("hypic:cache_evictions_total", "Entries evicted to make room (memory spills to disk not included)",
                 stat(&StoreStats::evictions));
  reg.counter_fn("hypic:cache_spills_total", "Entries moved from memory to the disk tier", stat(&StoreStats::spills));
  reg.counter_fn("hypic:cache_stored_total", "Entries stored by puts", stat(&StoreStats::puts));
  reg.counter_fn("hypic:cache_rejected_puts_total",
                 "Puts refused (no room, or none freed within --max-put-wait-ms) or cancelled (--put-idle-ms)",
                 stat(&StoreStats::rejected_puts));
  reg.counter_fn("hypic:cache_corruptions_total", "Entries dropped for a failed integrity check",
                 stat(&StoreStats::corruptions));
}

SegmentCacheService::~SegmentCacheService() {
  {
    std::lock_guard<std::mutex> lock(receive_mu_);
    stop_watchdog_ = true;
  }
  watchdog_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  store_.set_event_sink(nullptr);
}

// Every put_idle_timeout_ / 4 (at most 1 s, at least 10 ms): cancels the puts being received that got no bytes for
// put_idle_timeout_. ServerContext::TryCancel may be called from any thread; a put leaves active_ (under the same lock)
// before its handler returns, so the context is alive while listed.
void SegmentCacheService::watch_idle_puts() {
  const auto period = std::clamp<std::chrono::milliseconds>(put_idle_timeout_ / 4, std::chrono::milliseconds(10),
                                                             std::chrono::milliseconds(1000));
  std::unique_lock<std::mutex> lock(receive_mu_);
  while (!stop_watchdog_) {
    watchdog_cv_.wait_for(lock, period, [this] { return stop_watchdog_; });
    const auto now = std::chrono::steady_clock::now();
    for (auto& [id, p] : active_)
      if (!p.cancelled && !p.paused && now - p.last >= put_idle_timeout_) {
        p.cancelled = true;
        p.ctx->TryCancel();
      }
  }
}

namespace {
void to_proto(const StoreEvent& e, uint64_t sequence, int64_t unix_micros, v1::CacheEvent* out) {
  out->set_kind(static_cast<v1::CacheEvent::Kind>(e.kind));
  out->set_digest(rpc::digest_bytes(e.digest));
  out->set_size_bytes(e.size_bytes);
  out->set_tier(static_cast<v1::CacheTier>(e.tier));
  out->set_from_tier(static_cast<v1::CacheTier>(e.from_tier));
  out->set_reason(e.reason);
  out->set_sequence(sequence);
  out->set_unix_micros(unix_micros);
}
}  // namespace

grpc::Status SegmentCacheService::WatchEvents(grpc::ServerContext* ctx, const v1::WatchEventsRequest* req,
                                              grpc::ServerWriter<v1::CacheEvent>* writer) {
  if (auto st = rpc::require_service_caller(*ctx, "SegmentCache.WatchEvents"); !st.ok()) return st;
  return rpc::handle_errors([&] {
    auto call = life_.enter();
    std::shared_ptr<CacheEventHub::Subscriber> sub;
    std::vector<StoreEvent> existing;
    if (req->include_existing()) {
      existing = store_.list_entries_then([&] { sub = events_.subscribe(); });
    } else {
      sub = events_.subscribe();
    }
    struct Leave {
      CacheEventHub& hub;
      std::shared_ptr<CacheEventHub::Subscriber> s;
      ~Leave() { hub.unsubscribe(s); }
    } leave{events_, sub};
    spdlog::info("event subscriber {} joined ({} existing entries listed)", ctx->peer(), existing.size());
    v1::CacheEvent ev;
    for (const auto& e : existing) {
      to_proto(e, 0, 0, &ev);
      if (!writer->Write(ev)) return grpc::Status(grpc::StatusCode::CANCELLED, "subscriber went away");
    }
    for (;;) {
      if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "subscriber went away");
      if (life_.draining()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "segment cache is shutting down");
      bool overflowed = false;
      for (const auto& se : sub->wait(std::chrono::milliseconds(100), &overflowed)) {
        to_proto(se.event, se.sequence, se.unix_micros, &ev);
        if (!writer->Write(ev)) return grpc::Status(grpc::StatusCode::CANCELLED, "subscriber went away");
      }
      if (overflowed) {
        spdlog::warn("event subscriber {} fell behind: stream ended", ctx->peer());
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            "the subscriber fell more than --max-queued-events behind; reconnect with include_existing "
                            "to resync");
      }
    }
  });
}

grpc::Status SegmentCacheService::Lookup(grpc::ServerContext* ctx, const v1::LookupRequest* req,
                                         v1::LookupResponse* resp) {
  if (auto st = rpc::require_service_caller(*ctx, "SegmentCache.Lookup"); !st.ok()) return st;
  return rpc::handle_errors([&] {
    auto call = life_.enter();
    if (req->lease_ms() > max_lease_ms_) {
      throw rpc::invalid_argument("lease_ms", fmt::format("{} exceeds the limit {}", req->lease_ms(), max_lease_ms_));
    }
    if (req->lease_owner().size() > kMaxLeaseOwnerBytes) {
      throw rpc::invalid_argument("lease_owner", fmt::format("{} bytes, at most {} allowed", req->lease_owner().size(),
                                                             kMaxLeaseOwnerBytes));
    }
    std::vector<rpc::Digest> digests;
    for (int i = 0; i < req->keys_size(); ++i) {
      digests.push_back(rpc::parse_digest(req->keys(i).digest(), fmt::format("keys[{}].digest", i)));
    }
    for (int i = 0; i < req->keys_size(); ++i) {
      const auto& ids = req->keys(i).token_ids();
      const auto r = store_.lookup(digests[size_t(i)], std::span<const int32_t>(ids.data(), size_t(ids.size())),
                                   std::chrono::milliseconds(req->lease_ms()), req->lease_owner());
      auto* out = resp->add_results();
      out->set_hit(r.hit);
      out->set_tier(static_cast<v1::CacheTier>(r.tier));
      out->set_size_bytes(r.size_bytes);
      out->set_leased(r.leased);
    }
    return grpc::Status::OK;
  });
}

grpc::Status SegmentCacheService::Get(grpc::ServerContext* ctx, const v1::GetRequest* req,
                                      grpc::ServerWriter<v1::GetResponse>* writer) {
  if (auto st = rpc::require_service_caller(*ctx, "SegmentCache.Get"); !st.ok()) return st;
  return rpc::handle_errors([&] {
    auto call = life_.enter();
    const rpc::Digest d = rpc::parse_digest(req->digest(), "digest");
    if (req->token_ids().empty() && !req->skip_token_check()) {
      throw rpc::invalid_argument("token_ids", "required to verify the hit (or set skip_token_check)");
    }
    std::optional<std::span<const int32_t>> ids;
    if (!req->skip_token_check()) ids.emplace(req->token_ids().data(), size_t(req->token_ids().size()));
    // Throws DATA_LOSS for a corrupt entry. One handed out as a sealed memfd is verified by its reader instead (its
    // checksum and MAC over the mapping; it Deletes an entry that fails): not hashed twice on a request's path.
    auto handle = store_.get(d, ids, /*verify_memfd=*/!req->accept_shared_memory());
    if (!handle) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, fmt::format("segment entry {} not in the cache", rpc::digest_hex(d)));
    }
    v1::GetResponse head;
    auto* info = head.mutable_info();
    info->set_total_bytes(handle->bytes().size());
    info->set_checksum(handle->checksum());
    info->set_tier(static_cast<v1::CacheTier>(handle->tier()));
    info->mutable_token_ids()->Add(handle->token_ids().begin(), handle->token_ids().end());
    info->set_mac(handle->mac());
    static auto& out = bytes_counter("out");
    if (req->accept_shared_memory()) {
      if (const rpc::MemfdRef ref = handle->memfd_ref(); ref.fd >= 0) {
        to_proto(ref, info->mutable_shared_memory());
        if (!writer->Write(head)) return grpc::Status(grpc::StatusCode::CANCELLED, "reader went away");
        static auto& by_memfd = gets_counter("shared_memory");
        by_memfd.inc();
        out.inc(double(handle->bytes().size()));
        return grpc::Status::OK;
      }
    }
    bool ok = writer->Write(head) &&
              rpc::write_chunks<v1::GetResponse>(
                  handle->bytes(), chunk_bytes_, [](v1::GetResponse& m, std::string_view c) { m.set_data(std::string(c)); },
                  [&](const v1::GetResponse& m) { return writer->Write(m); });
    if (!ok || ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "reader went away");
    static auto& by_stream = gets_counter("grpc");
    by_stream.inc();
    out.inc(double(handle->bytes().size()));
    return grpc::Status::OK;
  });
}

void SegmentCacheService::admit_put(grpc::ServerContext* ctx, const rpc::Digest& d, uint64_t n) {
  using Steady = std::chrono::steady_clock;
  const auto start = Steady::now();
  // The call's deadline, read once (ServerContext::deadline() converts from gRPC's clock at each call) and moved to
  // the steady clock, so that a step of the wall clock neither refuses nor stretches a wait.
  const auto deadline = ctx->deadline();
  const auto sys_now = std::chrono::system_clock::now();
  const bool by_deadline = deadline < sys_now + max_put_wait_;
  const auto limit = by_deadline ? start + std::chrono::duration_cast<Steady::duration>(deadline - sys_now)
                                 : start + std::chrono::duration_cast<Steady::duration>(max_put_wait_);
  std::unique_lock<std::mutex> lock(receive_mu_);
  auto fits = [&] { return receiving_bytes_ == 0 || receiving_bytes_ + n <= max_receiving_bytes_; };
  if (waiting_.empty() && fits()) {
    receiving_bytes_ += n;
    return;
  }
  auto refuse = [&](std::string_view why) {
    store_.count_rejected_put();
    return rpc::resource_exhausted(fmt::format(
        "put {}: {} bytes would put the puts being received ({} bytes) past {} bytes (the memory budget), and {}; "
        "retry later",
        rpc::digest_hex(d), n, receiving_bytes_, max_receiving_bytes_, why));
  };
  if (!waiting_.empty() && waiting_bytes_ + n > max_receiving_bytes_) {
    throw refuse(fmt::format("the {} puts already waiting announce {} bytes", waiting_.size(), waiting_bytes_));
  }
  const uint64_t ticket = next_ticket_++;
  waiting_.push_back(ticket);
  waiting_bytes_ += n;
  struct Waiting {  // leaves the line however the wait ends (the lock held)
    SegmentCacheService& self;
    uint64_t ticket, n;
    ~Waiting() {
      self.waiting_.erase(std::find(self.waiting_.begin(), self.waiting_.end(), ticket));
      self.waiting_bytes_ -= n;
      self.receive_cv_.notify_all();  // (the next in line may be admitted now)
    }
  } waiting{*this, ticket, n};
  for (;;) {
    // A caller that gave up is never admitted, even when room frees just then; counted as refused.
    if (ctx->IsCancelled()) {
      store_.count_rejected_put();
      throw rpc::RpcError(grpc::StatusCode::CANCELLED, "put cancelled while waiting for room");
    }
    if (life_.draining()) {
      store_.count_rejected_put();
      throw rpc::unavailable("the segment cache is shutting down (a put was waiting for room)");
    }
    const auto now = Steady::now();
    if (by_deadline && now >= limit) {
      store_.count_rejected_put();
      throw rpc::RpcError(grpc::StatusCode::DEADLINE_EXCEEDED, "put's deadline passed while waiting for room");
    }
    if (waiting_.front() == ticket && fits()) break;
    if (now >= limit) {
      throw refuse(fmt::format("no room freed for it within {} ms (--max-put-wait-ms)",
                               std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count()));
    }
    // Slices of at most 100 ms: a cancelled call or a draining server is noticed without a notification.
    receive_cv_.wait_until(lock, std::min(limit, now + std::chrono::milliseconds(100)));
  }
  receiving_bytes_ += n;
}

grpc::Status SegmentCacheService::Put(grpc::ServerContext* ctx, grpc::ServerReader<v1::PutRequest>* reader,
                                      v1::PutResponse* resp) {
  if (auto st = rpc::require_service_caller(*ctx, "SegmentCache.Put"); !st.ok()) return st;
  return rpc::handle_errors([&] {
    auto call = life_.enter();
    // Listed for the idle watchdog from the start (a sender that never sends its header is cancelled too), paused
    // while the put waits for room (that wait has its own bound), unlisted once its last byte is in.
    struct Listed {
      SegmentCacheService& self;
      uint64_t id;
      ~Listed() {
        std::lock_guard<std::mutex> lock(self.receive_mu_);
        self.active_.erase(id);
      }
    };
    uint64_t id = 0;
    {
      std::lock_guard<std::mutex> lock(receive_mu_);
      id = next_active_++;
      active_[id] = ActivePut{ctx, std::chrono::steady_clock::now()};
    }
    Listed listed{*this, id};
    // Whether the watchdog cancelled this put; with `unlist`, also takes it off the list (under the same lock, so the
    // watchdog cannot cancel it afterwards). A cancelled put is counted and logged here.
    auto idle_cancelled = [&](bool unlist, std::string_view digest) {
      std::lock_guard<std::mutex> lock(receive_mu_);
      const auto it = active_.find(id);
      if (it == active_.end()) return false;
      const ActivePut p = it->second;
      if (unlist) active_.erase(it);
      if (!p.cancelled) return false;
      store_.count_rejected_put();
      spdlog::warn("put {}: no bytes for {} ms after {} of {} bytes; cancelled (--put-idle-ms)", digest,
                   put_idle_timeout_.count(), p.received, p.total);
      return true;
    };
    auto pause_watch = [&](bool paused, uint64_t total) {
      std::lock_guard<std::mutex> lock(receive_mu_);
      ActivePut& p = active_.at(id);
      p.paused = paused;
      p.total = total;
      p.last = std::chrono::steady_clock::now();
    };
    v1::PutRequest msg;
    if (!reader->Read(&msg) || !msg.has_header()) {
      if (idle_cancelled(true, "(no header yet)"))
        throw rpc::RpcError(grpc::StatusCode::CANCELLED, fmt::format("put: the sender sent no header for {} ms; "
                                                                     "cancelled", put_idle_timeout_.count()));
      throw rpc::invalid_argument("header", "the first message of a Put must be its header");
    }
    pause_watch(true, 0);
    const v1::PutHeader header = msg.header();
    const rpc::Digest d = rpc::parse_digest(header.key().digest(), "header.key.digest");
    if (header.key().token_ids().empty()) throw rpc::invalid_argument("header.key.token_ids", "must not be empty");
    if (header.total_bytes() == 0) throw rpc::invalid_argument("header.total_bytes", "must be > 0");
    // The budget is enforced from the header, before any byte is buffered: an entry that could never be stored, or
    // one that would put the bytes of the puts being received past the memory budget, is refused at once.
    if (header.total_bytes() > store_.max_entry_bytes()) {
      store_.count_rejected_put();
      throw rpc::resource_exhausted(fmt::format("put {}: an entry of {} bytes is larger than the cache's budget of {} "
                                                "bytes; refused before reading it",
                                                rpc::digest_hex(d), header.total_bytes(), store_.max_entry_bytes()));
    }
    // One put alone may stream an entry up to max_entry_bytes (one larger than memory goes to the disk tier); beside
    // others, the bytes being received stay within the memory budget. A put past it waits for room, in arrival order
    // (a large put is not passed forever by small ones), up to its deadline or max_put_wait_. Waiting puts are bounded
    // too: gRPC's flow-control window lets a waiting sender's bytes pile up in the server, so a put that would take the
    // announced bytes of the waiting puts past the memory budget (when another waits) is refused at once.
    const uint64_t n = header.total_bytes();
    if (header.has_shared_memory()) {  // the quick refusals, before any wait for room
      if (!store_.holds_shared_memory()) {
        throw refuse_shared(ctx, d, "off", "this cache runs with --shared-memory false");
      }
      if (n < store_.shared_memory_min_bytes()) {
        throw refuse_shared(ctx, d, "declined", fmt::format("{} bytes, below this cache's --shared-memory-min-bytes {}",
                                                            n, store_.shared_memory_min_bytes()));
      }
    }
    admit_put(ctx, d, n);
    struct Receiving {
      SegmentCacheService& self;
      uint64_t n;
      ~Receiving() {
        {
          std::lock_guard<std::mutex> lock(self.receive_mu_);
          self.receiving_bytes_ -= n;
        }
        self.receive_cv_.notify_all();
      }
    } receiving{*this, n};
    pause_watch(false, n);  // admitted: the watchdog counts from here
    if (header.has_shared_memory()) {
      // The stream ends after the header; read to its end under the watchdog (a sender that never half-closes is
      // cancelled after put_idle), and store nothing for a sender that gave up.
      if (reader->Read(&msg)) {
        store_.count_rejected_put();
        throw rpc::invalid_argument("data", "a put that hands over shared memory carries no data messages");
      }
      if (idle_cancelled(true, rpc::digest_hex(d)) || ctx->IsCancelled()) {
        throw rpc::RpcError(grpc::StatusCode::CANCELLED, fmt::format("put {}: cancelled", rpc::digest_hex(d)));
      }
      resp->set_replaced(adopt_put(ctx, header, d));
      return grpc::Status::OK;
    }
    // A large entry goes straight into the sealed memfd it will be held in (StoreOptions::shared_memory_min_bytes),
    // checked as it comes; others are assembled on the heap.
    auto shared = store_.make_shared_writer(n);
    rpc::ChunkVerifier verifier;
    rpc::ChunkAssembler assembler;
    const std::string what = fmt::format("put {}", rpc::digest_hex(d));
    if (shared) verifier.begin(n, header.checksum(), what);
    else assembler.begin(n, header.checksum(), what);
    while (reader->Read(&msg)) {
      if (msg.has_header()) throw rpc::invalid_argument("header", "a Put carries exactly one header");
      if (shared) {
        verifier.append(msg.data());  // (throws before an overflowing chunk is written)
        shared->append(msg.data());
      } else {
        assembler.append(msg.data());
      }
      std::lock_guard<std::mutex> lock(receive_mu_);
      ActivePut& p = active_.at(id);
      p.last = std::chrono::steady_clock::now();
      p.received += msg.data().size();
    }
    // Off the watchdog's list before the checks and the store (which may take longer than put_idle): a put whose bytes
    // are all in is not cancelled.
    if (idle_cancelled(true, rpc::digest_hex(d)))
      throw rpc::RpcError(grpc::StatusCode::CANCELLED,
                          fmt::format("put {}: the sender sent nothing for {} ms; cancelled", rpc::digest_hex(d),
                                      put_idle_timeout_.count()));
    std::shared_ptr<const rpc::SharedBytes> bytes;
    if (shared) {
      verifier.finish();
      bytes = shared->seal();
    } else {
      bytes = rpc::SharedBytes::heap(assembler.finish());
    }
    static auto& in = bytes_counter("in");
    in.inc(double(bytes->size()));
    static auto& streamed = puts_counter("grpc");
    streamed.inc();
    std::vector<int32_t> ids(header.key().token_ids().begin(), header.key().token_ids().end());
    resp->set_replaced(store_.put(d, std::move(ids), std::move(bytes), header.checksum(), header.mac()));
    spdlog::debug("stored {} ({} bytes{})", rpc::digest_hex(d), header.total_bytes(),
                  resp->replaced() ? ", replaced" : "");
    return grpc::Status::OK;
  });
}

rpc::RpcError SegmentCacheService::refuse_shared(grpc::ServerContext* ctx, const rpc::Digest& d, const char* kind,
                                                const std::string& why) {
  store_.count_rejected_put();
  ctx->AddTrailingMetadata("hypic-shared-memory", kind);
  return rpc::RpcError(grpc::StatusCode::FAILED_PRECONDITION,
                       fmt::format("put {}: the sender's shared memory was not taken: {}", rpc::digest_hex(d), why));
}

bool SegmentCacheService::adopt_put(grpc::ServerContext* ctx, const v1::PutHeader& header, const rpc::Digest& d) {
  rpc::PeerMemfd::Failure failure{};
  std::string why;
  auto peer = rpc::PeerMemfd::open(from_proto(header.shared_memory(), header.total_bytes()), &failure, &why);
  if (!peer) {
    // The sender is alive and holds its memfd during the call: no process, or another one's anchor, under its pid
    // here means another host or PID namespace.
    if (failure == rpc::PeerMemfd::Failure::Unreachable || failure == rpc::PeerMemfd::Failure::NoProcess)
      throw refuse_shared(ctx, d, "unreachable", why);
    if (failure == rpc::PeerMemfd::Failure::Gone) throw refuse_shared(ctx, d, "declined", why);
    store_.count_rejected_put();
    throw rpc::invalid_argument("header.shared_memory", why);
  }
  if (store_.holds_memfd(peer->inode())) {  // (its own, handed back, or another entry's adopted already)
    throw refuse_shared(ctx, d, "declined", "its memfd holds another entry of this cache already");
  }
  auto bytes = rpc::SharedBytes::adopt(std::move(peer), &why);
  if (!bytes) throw refuse_shared(ctx, d, "declined", why);
  static auto& in = bytes_counter("in");
  in.inc(double(bytes->size()));
  static auto& adopted = puts_counter("shared_memory");
  adopted.inc();
  std::vector<int32_t> ids(header.key().token_ids().begin(), header.key().token_ids().end());
  bool replaced = false;
  try {
    replaced = store_.put(d, std::move(ids), std::move(bytes), header.checksum(), header.mac());
  } catch (const rpc::RpcError& e) {  // the same memfd put under another digest meanwhile: this one declined
    if (e.code() != grpc::StatusCode::FAILED_PRECONDITION) throw;
    ctx->AddTrailingMetadata("hypic-shared-memory", "declined");
    throw;
  }
  spdlog::debug("stored {} ({} bytes, the sender's memfd adopted{})", rpc::digest_hex(d), header.total_bytes(),
                replaced ? ", replaced" : "");
  return replaced;
}

grpc::Status SegmentCacheService::Delete(grpc::ServerContext* ctx, const v1::DeleteRequest* req,
                                         v1::DeleteResponse* resp) {
  if (auto st = rpc::require_service_caller(*ctx, "SegmentCache.Delete"); !st.ok()) return st;
  return rpc::handle_errors([&] {
    auto call = life_.enter();
    const rpc::Digest d = rpc::parse_digest(req->digest(), "digest");
    SegmentStore::EraseIf only_if;
    if (req->has_if_checksum()) only_if.checksum = req->if_checksum();
    if (req->has_if_mac()) only_if.mac = req->if_mac();
    resp->set_deleted(store_.erase(d, only_if, req->corrupt()));
    if (resp->deleted()) {
      spdlog::info("deleted {}{}", rpc::digest_hex(d), req->corrupt() ? " (its reader found it corrupt)" : "");
    } else if (only_if.checksum || only_if.mac) {
      spdlog::info("kept {}: not the entry the delete named (replaced since, or gone)", rpc::digest_hex(d));
    }
    return grpc::Status::OK;
  });
}

grpc::Status SegmentCacheService::Stats(grpc::ServerContext*, const v1::StatsRequest*, v1::CacheStats* resp) {
  return rpc::handle_errors([&] {
    const StoreStats s = store_.stats();
    resp->set_entries(s.memory_entries + s.disk_entries);
    resp->set_bytes(s.memory_bytes + s.disk_bytes);
    resp->set_memory_entries(s.memory_entries);
    resp->set_memory_bytes(s.memory_bytes);
    resp->set_memory_budget_bytes(s.memory_budget_bytes);
    resp->set_disk_entries(s.disk_entries);
    resp->set_disk_bytes(s.disk_bytes);
    resp->set_disk_budget_bytes(s.disk_budget_bytes);
    resp->set_lookups(s.lookups);
    resp->set_hits(s.hits);
    resp->set_misses(s.misses);
    resp->set_evictions(s.evictions);
    resp->set_spills(s.spills);
    resp->set_promotions(s.promotions);
    resp->set_puts(s.puts);
    resp->set_rejected_puts(s.rejected_puts);
    resp->set_corruptions(s.corruptions);
    resp->set_collisions(s.collisions);
    resp->set_pinned_entries(s.pinned_entries);
    resp->set_leased_entries(s.leased_entries);
    resp->set_leased_bytes(s.leased_bytes);
    resp->set_max_leased_bytes(s.max_leased_bytes);
    resp->set_unleased_hits(s.unleased_hits);
    resp->set_leases_released(s.leases_released);
    return grpc::Status::OK;
  });
}

grpc::Status SegmentCacheService::ReleaseLeases(grpc::ServerContext* ctx, const v1::ReleaseLeasesRequest* req,
                                                v1::ReleaseLeasesResponse* resp) {
  if (auto st = rpc::require_service_caller(*ctx, "SegmentCache.ReleaseLeases"); !st.ok()) return st;
  return rpc::handle_errors([&] {
    // Not refused while draining: ending leases only frees room.
    if (req->lease_owner().empty()) throw rpc::invalid_argument("lease_owner", "must not be empty");
    resp->set_released(uint32_t(store_.release_leases(req->lease_owner())));
    return grpc::Status::OK;
  });
}

}  // namespace hypic::cache
