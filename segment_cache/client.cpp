#include "segment_cache/client.h"

#include <algorithm>
#include <cmath>
#include <future>
#include <optional>
#include <regex>
#include <stdexcept>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "proto/rpc/entry_mac.h"
#include "proto/rpc/flags.h"
#include "proto/rpc/log_limit.h"
#include "proto/rpc/metrics.h"
#include "proto/rpc/server.h"
#include "proto/rpc/shared_memory.h"
#include "segment_cache/shared_memory_proto.h"
#include "proto/rpc/status.h"

namespace hypic::cache {

namespace v1 = hypic::v1;

using Clock = std::chrono::steady_clock;

/// Pieces a mapped entry is handed to its consumer in (as a stream's chunks would be): small enough that the piece the
/// checksum just read is still in the core's cache when the consumer copies and hashes it (fewer passes over memory:
/// 256 KiB read a round of 2 x 232 MB mapped fetches 4-7% sooner than 4 MiB on 2 cores).
constexpr size_t kSharedPieceBytes = size_t{256} << 10;
/// Answers in a row naming a holder with no process here before a replica counts as on another host.
constexpr int kNoProcessTries = 3;
/// How long shared memory stays off for a replica found elsewhere, before it is tried again.
constexpr std::chrono::milliseconds kSharedRetry{60000};

int64_t steady_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Whether shared memory may be tried with a replica now (its "off until" has passed).
bool shared_allowed(const std::atomic<int64_t>& until) { return until.load(std::memory_order_relaxed) <= steady_ms(); }

// Turns it off for kSharedRetry (unless off for good); true when it was on (the caller logs).
bool shared_off(std::atomic<int64_t>& until) {
  int64_t was = until.load();
  const int64_t now = steady_ms();
  if (was == INT64_MAX) return false;
  while (!until.compare_exchange_weak(was, now + kSharedRetry.count())) {
    if (was == INT64_MAX) return false;
  }
  return was <= now;
}

namespace {
/// hypic:entry_mac_failures_total: entries read from the cache whose MAC did not verify.
rpc::Counter& entry_mac_failures_counter() {
  static auto& c = rpc::MetricsRegistry::global().counter(
      "hypic:entry_mac_failures_total",
      "Segment entries read from the cache whose MAC did not verify (forged, relabelled, corrupt, or made with a "
      "key no longer configured): refused and deleted from the cache");
  return c;
}
/// hypic:cache_fetched_total{transport}: entries this process read from the segment cache, by how they came.
rpc::Counter& fetched_counter(bool shared_memory) {
  static auto& grpc_count = rpc::MetricsRegistry::global().counter(
      "hypic:cache_fetched_total", "Segment entries read from the segment cache, by transport (grpc: streamed; "
      "shared_memory: a sealed memfd of a replica on this host, mapped)", {{"transport", "grpc"}});
  static auto& shm_count = rpc::MetricsRegistry::global().counter(
      "hypic:cache_fetched_total", "Segment entries read from the segment cache, by transport (grpc: streamed; "
      "shared_memory: a sealed memfd of a replica on this host, mapped)", {{"transport", "shared_memory"}});
  return shared_memory ? shm_count : grpc_count;
}
}  // namespace

SegmentCacheClient::SegmentCacheClient(std::vector<std::string> replicas, Options options)
    : replicas_(std::move(replicas)), opt_(options) {
  if (opt_.transfer_rate == 0) throw std::invalid_argument("SegmentCacheClient: transfer_rate must be positive");
  if (opt_.connections < 1) throw std::invalid_argument("SegmentCacheClient: connections must be at least 1");
  if (replicas_.empty()) return;
  entry_mac_failures_counter();  // (registered now: scraped as 0 before the first failure)
  fetched_counter(false);
  fetched_counter(true);
  ring_.emplace(replicas_, opt_.vnodes);
  no_shared_memory_until_ = std::make_unique<std::atomic<int64_t>[]>(replicas_.size());
  no_shared_put_until_ = std::make_unique<std::atomic<int64_t>[]>(replicas_.size());
  no_process_ = std::make_unique<std::atomic<int>[]>(replicas_.size());
  for (size_t r = 0; r < replicas_.size(); ++r) {
    no_shared_memory_until_[r] = no_shared_put_until_[r] = opt_.shared_memory ? 0 : INT64_MAX;
    no_process_[r] = 0;
  }
  for (const auto& r : replicas_) {
    auto& per = stubs_.emplace_back();
    for (int c = 0; c < opt_.connections; ++c) per.push_back(v1::SegmentCache::NewStub(rpc::make_channel(r, c)));
  }
}

std::string SegmentCacheClient::owner(const rpc::Digest& digest) const {
  return ring_ ? replicas_[ring_->owner(digest)] : std::string();
}

v1::SegmentCache::Stub& SegmentCacheClient::stub_for(const rpc::Digest& digest) const {
  if (!ring_) throw rpc::unavailable("no segment cache replica is configured");
  const auto& per = stubs_[ring_->owner(digest)];
  return *per[per.size() == 1 ? 0 : next_connection_.fetch_add(1, std::memory_order_relaxed) % per.size()];
}

BatchLookup SegmentCacheClient::lookup(std::span<const CacheKey> keys, uint32_t lease_ms,
                                       const std::string& lease_owner, const grpc::ServerContextBase* parent) const {
  BatchLookup out;
  out.results.resize(keys.size());
  if (keys.empty()) return out;
  if (!ring_) {
    out.all_reachable = false;
    out.error = "no segment cache replica is configured";
    return out;
  }
  // Group key positions by owner.
  std::vector<std::vector<size_t>> by_replica(replicas_.size());
  for (size_t i = 0; i < keys.size(); ++i) by_replica[ring_->owner(keys[i].digest)].push_back(i);

  std::vector<std::future<grpc::Status>> calls(replicas_.size());
  std::vector<v1::LookupResponse> responses(replicas_.size());
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(replicas_.size());
  for (size_t r = 0; r < replicas_.size(); ++r) {
    if (by_replica[r].empty()) continue;
    v1::LookupRequest req;
    req.set_lease_ms(lease_ms);
    req.set_lease_owner(lease_owner);
    for (size_t i : by_replica[r]) {
      auto* k = req.add_keys();
      k->set_digest(rpc::digest_bytes(keys[i].digest));
      k->mutable_token_ids()->Add(keys[i].token_ids.begin(), keys[i].token_ids.end());
    }
    contexts[r] = rpc::make_client_context(parent, opt_.timeout);
    calls[r] = std::async(std::launch::async, [this, r, req = std::move(req), ctx = contexts[r].get(), &responses] {
      return stubs_[r][0]->Lookup(ctx, req, &responses[r]);
    });
  }
  for (size_t r = 0; r < replicas_.size(); ++r) {
    if (by_replica[r].empty()) continue;
    const grpc::Status st = calls[r].get();
    if (!st.ok() || responses[r].results_size() != static_cast<int>(by_replica[r].size())) {
      out.all_reachable = false;
      if (out.error.empty()) {
        out.error = st.ok() ? fmt::format("segment cache {} answered {} results for {} keys", replicas_[r],
                                          responses[r].results_size(), by_replica[r].size())
                            : fmt::format("segment cache {}: {}", replicas_[r], rpc::describe(st));
      }
      continue;
    }
    for (size_t j = 0; j < by_replica[r].size(); ++j) {
      const auto& res = responses[r].results(static_cast<int>(j));
      out.results[by_replica[r][j]] =
          CacheLookup{res.hit(), static_cast<int>(res.tier()), res.size_bytes(), res.leased()};
    }
  }
  return out;
}

std::string SegmentCacheClient::release_leases(const std::string& lease_owner,
                                               std::span<const rpc::Digest> digests) const {
  if (!ring_ || digests.empty() || lease_owner.empty()) return {};
  std::vector<bool> involved(replicas_.size(), false);
  for (const auto& d : digests) involved[ring_->owner(d)] = true;
  std::vector<std::future<grpc::Status>> calls(replicas_.size());
  for (size_t r = 0; r < replicas_.size(); ++r) {
    if (!involved[r]) continue;
    calls[r] = std::async(std::launch::async, [this, r, &lease_owner] {
      auto ctx = rpc::make_client_context(nullptr, opt_.timeout);
      v1::ReleaseLeasesRequest req;
      req.set_lease_owner(lease_owner);
      v1::ReleaseLeasesResponse resp;
      return stubs_[r][0]->ReleaseLeases(ctx.get(), req, &resp);
    });
  }
  std::string error;
  for (size_t r = 0; r < replicas_.size(); ++r) {
    if (!involved[r]) continue;
    const grpc::Status st = calls[r].get();
    if (!st.ok() && error.empty()) error = fmt::format("segment cache {}: {}", replicas_[r], rpc::describe(st));
  }
  return error;
}

std::optional<std::vector<int32_t>> SegmentCacheClient::stream(const rpc::Digest& digest,
                                                                std::span<const int32_t> ids, bool check_ids,
                                                                const grpc::ServerContextBase* parent,
                                                                uint64_t expected_bytes,
                                                                const std::function<void(uint64_t)>& begin,
                                                                const std::function<void(std::string_view)>& consume,
                                                                std::string* mac_out, FetchReport* report) const {
  auto& stub = stub_for(digest);
  const size_t replica = ring_->owner(digest);
  const std::string what = fmt::format("segment entry {} from {}", rpc::digest_hex(digest), owner(digest));
  const auto& keys = rpc::entry_mac_keys();
  const bool check_mac = check_ids && keys.enabled();
  // At most two calls: one that accepts shared memory, then, when its memfd could not be opened here, a plain one.
  for (bool accept = shared_allowed(no_shared_memory_until_[replica]);; accept = false) {
    const auto t0 = Clock::now();
    auto r0_end = t0;  // when the consumer had the last byte
    FetchReport r;
    auto ctx = rpc::make_client_context(parent, transfer_timeout(expected_bytes));
    v1::GetRequest req;
    req.set_digest(rpc::digest_bytes(digest));
    req.mutable_token_ids()->Add(ids.begin(), ids.end());
    req.set_skip_token_check(!check_ids);
    req.set_accept_shared_memory(accept);
    auto reader = stub.Get(ctx.get(), req);
    v1::GetResponse msg;
    rpc::ChunkVerifier check;
    std::vector<int32_t> stored_ids;
    std::string mac;
    uint64_t stored_checksum = 0;
    std::unique_ptr<rpc::PeerMemfd> mapped;  // (outlives the MAC check, which reads it in place)
    std::optional<rpc::EntryMacCheck> mac_stream;
    bool ask_again = false;
    try {
      while (reader->Read(&msg)) {
        if (msg.has_info()) {
          r.answer_ms = rpc::ms_between(t0, Clock::now());
          const auto& info = msg.info();
          if (check.started()) throw rpc::RpcError(grpc::StatusCode::DATA_LOSS, what + ": a second EntryInfo");
          if (info.has_shared_memory()) {
            if (!accept) throw rpc::RpcError(grpc::StatusCode::DATA_LOSS, what + ": shared memory not asked for");
            const auto& sm = info.shared_memory();
            rpc::PeerMemfd::Failure failure{};
            std::string why;
            // Far past the expected size (an estimate, engine::wire_entry_bytes): not mapped; the stream's checks say.
            if (expected_bytes > 0 && info.total_bytes() > 2 * expected_bytes + (uint64_t{1} << 20)) {
              failure = rpc::PeerMemfd::Failure::Invalid;
              why = fmt::format("{} bytes announced where about {} were expected", info.total_bytes(), expected_bytes);
            } else {
              const auto m0 = Clock::now();
              mapped = rpc::PeerMemfd::open(from_proto(sm, info.total_bytes()), &failure, &why);
              r.map_ms = rpc::ms_between(m0, Clock::now());
            }
            // A holder with no process here: it exited meanwhile (a restart), or lives elsewhere; three in a row
            // without a mapping between them say elsewhere.
            const bool elsewhere = failure == rpc::PeerMemfd::Failure::Unreachable ||
                                   (failure == rpc::PeerMemfd::Failure::NoProcess &&
                                    no_process_[replica].fetch_add(1) + 1 >= kNoProcessTries);
            if (mapped) no_process_[replica] = 0;
            if (!mapped) {
              if (elsewhere) {
                if (shared_off(no_shared_memory_until_[replica])) {
                  spdlog::info("segment cache {}: its shared memory cannot be opened from this process ({}); its "
                               "entries are streamed over gRPC (tried again in {} s)", owner(digest), why,
                               kSharedRetry.count() / 1000);
                }
              } else {
                static rpc::LogLimit limit;
                uint64_t suppressed = 0;
                if (limit.allow(&suppressed)) {
                  spdlog::warn("{}: its shared memory could not be mapped ({}); streaming it instead{}", what, why,
                               suppressed ? fmt::format(" ({} more not logged)", suppressed) : std::string());
                }
              }
              ask_again = true;
              break;
            }
          }
          check.begin(info.total_bytes(), info.checksum(), what);
          stored_checksum = info.checksum();
          r.has_info = true, r.checksum = info.checksum(), r.mac = info.mac();
          if (report) report->has_info = true, report->checksum = r.checksum, report->mac = r.mac;
          stored_ids.assign(info.token_ids().begin(), info.token_ids().end());
          mac = info.mac();
          if (check_mac) {  // (a MAC of neither form is verified as an HMAC's and fails)
            mac_stream.emplace(keys, digest, stored_ids, info.total_bytes(), rpc::EntryMacKeys::head_of(mac));
          }
          begin(info.total_bytes());
          if (mapped) {  // read in place, in pieces, as the stream's chunks would come
            const auto r0 = Clock::now();
            const std::string_view all = mapped->view();
            for (size_t off = 0; off < all.size(); off += kSharedPieceBytes) {
              const std::string_view piece = all.substr(off, kSharedPieceBytes);
              check.append(piece);
              if (mac_stream) mac_stream->update_borrowed(piece);  // hashed beside the parse
              consume(piece);
            }
            r0_end = Clock::now();
            r.read_ms = rpc::ms_between(r0, r0_end);
          }
        } else {
          if (mapped) throw rpc::RpcError(grpc::StatusCode::DATA_LOSS, what + ": data after a shared memory answer");
          const auto r0 = Clock::now();
          check.append(msg.data());
          consume(msg.data());
          if (mac_stream) mac_stream->update(std::move(*msg.mutable_data()));  // hashed beside the receive
          r0_end = Clock::now();
          r.read_ms += rpc::ms_between(r0, r0_end);
        }
      }
    } catch (...) {  // a bad stream or a consumer that gave up: end the call before leaving
      ctx->TryCancel();
      (void)reader->Finish();
      throw;
    }
    if (ask_again) {
      ctx->TryCancel();
      (void)reader->Finish();
      continue;
    }
    const grpc::Status st = reader->Finish();
    const auto v0 = Clock::now();
    r.end_ms = rpc::ms_between(r0_end, v0);
    if (st.error_code() == grpc::StatusCode::NOT_FOUND) return std::nullopt;
    if (!st.ok()) rpc::throw_status(st, what);
    // Deletes the entry read (not one put since) from the cache; says how that went (`done` when it did).
    auto delete_entry = [&](std::string_view done, bool corrupt) -> std::string {
      try {
        return erase_read(digest, stored_checksum, mac, corrupt)
                   ? std::string(done)
                   : "already gone from the cache or replaced there";
      } catch (const std::exception& ex) {
        return fmt::format("could not be deleted from the cache: {}", ex.what());
      }
    };
    try {
      check.finish();
    } catch (const rpc::RpcError& e) {
      if (!mapped || e.code() != grpc::StatusCode::DATA_LOSS) throw;
      // The cache hands its memfds out unverified (their reader checks them; nobody can write a sealed memfd): one
      // that fails here is corrupt in the cache's memory, and deleted there as the cache deletes one it finds so.
      const std::string dropped = delete_entry("dropped from the cache", true);
      spdlog::error("{}: its memfd failed its integrity check ({}); {}", what, e.what(), dropped);
      throw rpc::RpcError(grpc::StatusCode::DATA_LOSS,
                          fmt::format("{}: its memfd failed its integrity check and was {} ({})", what, dropped,
                                      e.what()));
    }
    if (mac_stream && !mac_stream->verify(mac)) {
      entry_mac_failures_counter().inc();
      static rpc::LogLimit limit;
      uint64_t suppressed = 0;
      const std::string dropped = delete_entry("deleted from the cache", false);
      const std::string msg = fmt::format("{}: {} (forged, relabelled or corrupt entry, or signed with a key no longer "
                                          "configured): refused, {}",
                                          what, mac.empty() ? "it carries no MAC" : "its MAC does not verify", dropped);
      if (limit.allow(&suppressed)) {
        spdlog::error("{}{}", msg, suppressed ? fmt::format(" ({} more not logged)", suppressed) : std::string());
      }
      throw rpc::RpcError(grpc::StatusCode::DATA_LOSS, msg);
    }
    fetched_counter(mapped != nullptr).inc();
    r.mapped = mapped != nullptr;
    r.verify_ms = rpc::ms_between(v0, Clock::now());
    if (report) *report = r;
    if (mac_out) *mac_out = std::move(mac);
    return stored_ids;
  }
}

std::optional<std::pair<std::string, std::vector<int32_t>>> SegmentCacheClient::fetch(
    const rpc::Digest& digest, std::span<const int32_t> ids, bool check_ids, const grpc::ServerContextBase* parent,
    std::string* mac_out, uint64_t expected_bytes) const {
  rpc::ChunkAssembler assembler;  // its reservation policy: memory follows the bytes received
  auto stored = stream(
      digest, ids, check_ids, parent, expected_bytes,
      [&](uint64_t total) { assembler.begin(total, 0, "segment entry"); },
      [&](std::string_view chunk) { assembler.append(chunk); }, mac_out);
  if (!stored) return std::nullopt;
  std::string bytes = assembler.take();  // size and checksum verified by stream()
  return std::make_pair(std::move(bytes), std::move(*stored));
}

std::optional<std::string> SegmentCacheClient::get(const CacheKey& key, const grpc::ServerContextBase* parent,
                                                   uint64_t expected_bytes) const {
  auto got = fetch(key.digest, key.token_ids, true, parent, nullptr, expected_bytes);
  if (!got) return std::nullopt;
  return std::move(got->first);
}

bool SegmentCacheClient::get_stream(const CacheKey& key, const std::function<void(uint64_t)>& begin,
                                    const std::function<void(std::string_view)>& consume,
                                    const grpc::ServerContextBase* parent, uint64_t expected_bytes,
                                    FetchReport* report) const {
  return stream(key.digest, key.token_ids, true, parent, expected_bytes, begin, consume, nullptr, report).has_value();
}

std::optional<std::pair<std::string, std::vector<int32_t>>> SegmentCacheClient::get_unchecked(
    const rpc::Digest& digest, std::string* mac) const {
  return fetch(digest, {}, false, nullptr, mac);
}

void PutCancel::cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
  if (ctx_) ctx_->TryCancel();
}

std::chrono::milliseconds SegmentCacheClient::transfer_timeout(uint64_t bytes) const {
  // bytes * 1000 / rate, rounded up, in 128 bits (no overflow for any 64-bit size and rate); capped at 2^40 ms
  const unsigned __int128 ms =
      (static_cast<unsigned __int128>(bytes) * 1000 + opt_.transfer_rate - 1) / opt_.transfer_rate;
  const uint64_t capped = ms > (uint64_t(1) << 40) ? uint64_t(1) << 40 : static_cast<uint64_t>(ms);
  return opt_.timeout + std::chrono::milliseconds(static_cast<int64_t>(capped));
}

bool SegmentCacheClient::offers_shared_memory(const rpc::Digest& digest) const {
  return ring_ && shared_allowed(no_shared_put_until_[ring_->owner(digest)]);
}

bool SegmentCacheClient::put(const CacheKey& key, std::string_view bytes, const std::optional<std::string>& mac,
                             PutCancel* cancel) const {
  // A large entry goes to a replica on this host as a sealed memfd the cache adopts (one copy here, none there);
  // where the cache cannot take it, as a stream.
  std::shared_ptr<const rpc::SharedBytes> held;
  if (bytes.size() >= kMinSharedPutBytes && offers_shared_memory(key.digest)) {
    std::string why;
    if (auto w = rpc::SealedMemfdWriter::create(bytes.size(), &why)) {
      try {
        w->append(bytes);
        held = w->seal();
      } catch (const std::exception& e) {  // no memory for the copy now: streamed
        spdlog::debug("put {}: no sealed memfd for it ({}); streamed", rpc::digest_hex(key.digest), e.what());
      }
    }
  }
  return put_as(key, bytes, held && held->shared() ? held.get() : nullptr, mac, cancel);
}

bool SegmentCacheClient::put(const CacheKey& key, const rpc::SharedBytes& bytes, const std::optional<std::string>& mac,
                             PutCancel* cancel) const {
  if (!bytes.shared()) return put(key, bytes.view(), mac, cancel);
  const bool offer = bytes.size() >= kMinSharedPutBytes && offers_shared_memory(key.digest);
  return put_as(key, bytes.view(), offer ? &bytes : nullptr, mac, cancel);
}

bool SegmentCacheClient::put_as(const CacheKey& key, std::string_view bytes, const rpc::SharedBytes* memfd,
                                const std::optional<std::string>& mac, PutCancel* cancel) const {
  const std::string signature = mac ? *mac : rpc::entry_mac_keys().sign(key.digest, key.token_ids, bytes);
  if (memfd) {
    const rpc::MemfdRef ref = memfd->memfd_ref();
    bool refused = false;
    const bool replaced = put_once(key, bytes, signature, cancel, &ref, &refused);
    if (!refused) return replaced;
  }
  return put_once(key, bytes, signature, cancel, nullptr, nullptr);
}

bool SegmentCacheClient::put_once(const CacheKey& key, std::string_view bytes, const std::string& mac,
                                  PutCancel* cancel, const rpc::MemfdRef* shared, bool* shared_refused) const {
  auto& stub = stub_for(key.digest);
  auto ctx = rpc::make_client_context(nullptr, transfer_timeout(bytes.size()) + opt_.put_wait);
  // Registered for `cancel` while the call runs (a cancel before the call starts cancels it at once).
  struct Registration {
    PutCancel* c;
    Registration(PutCancel* c, grpc::ClientContext* ctx) : c(c) {
      if (!c) return;
      std::lock_guard<std::mutex> lock(c->mu_);
      c->ctx_ = ctx;
      if (c->cancelled_) ctx->TryCancel();
    }
    ~Registration() {
      if (!c) return;
      std::lock_guard<std::mutex> lock(c->mu_);
      c->ctx_ = nullptr;
    }
  } registration(cancel, ctx.get());
  v1::PutResponse resp;
  auto writer = stub.Put(ctx.get(), &resp);
  v1::PutRequest head;
  auto* h = head.mutable_header();
  h->mutable_key()->set_digest(rpc::digest_bytes(key.digest));
  h->mutable_key()->mutable_token_ids()->Add(key.token_ids.begin(), key.token_ids.end());
  h->set_total_bytes(bytes.size());
  h->set_checksum(rpc::checksum64(bytes));
  h->set_mac(mac);
  if (shared) {
    to_proto(*shared, h->mutable_shared_memory());
    writer->Write(head);
  } else if (writer->Write(head)) {
    rpc::write_chunks<v1::PutRequest>(
        bytes, opt_.chunk_bytes, [](v1::PutRequest& m, std::string_view c) { m.set_data(std::string(c)); },
        [&](const v1::PutRequest& m) { return writer->Write(m); });
  }
  writer->WritesDone();
  const grpc::Status st = writer->Finish();
  if (shared && (st.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
                 st.error_code() == grpc::StatusCode::INVALID_ARGUMENT)) {
    // Not taken: streamed instead. Unless it declined this one alone, not offered to that replica for a while.
    const auto& md = ctx->GetServerTrailingMetadata();
    const auto it = md.find("hypic-shared-memory");
    const std::string kind = it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
    *shared_refused = true;
    if (kind != "declined" && shared_off(no_shared_put_until_[ring_->owner(key.digest)])) {
      spdlog::info("segment cache {} does not take this process's shared memory ({}); entries are put over gRPC",
                   owner(key.digest), rpc::describe(st));
    }
    return false;
  }
  if (!st.ok()) rpc::throw_status(st, fmt::format("put {} to {}", rpc::digest_hex(key.digest), owner(key.digest)));
  return resp.replaced();
}

bool SegmentCacheClient::erase(const rpc::Digest& digest) const {
  v1::DeleteRequest req;
  req.set_digest(rpc::digest_bytes(digest));
  return delete_once(digest, req);
}

bool SegmentCacheClient::erase_read(const rpc::Digest& digest, uint64_t checksum, const std::string& mac,
                                    bool corrupt) const {
  v1::DeleteRequest req;
  req.set_digest(rpc::digest_bytes(digest));
  req.set_if_checksum(checksum);
  req.set_if_mac(mac);
  req.set_corrupt(corrupt);
  return delete_once(digest, req);
}

bool SegmentCacheClient::delete_once(const rpc::Digest& digest, const v1::DeleteRequest& req) const {
  auto& stub = stub_for(digest);
  auto ctx = rpc::make_client_context(nullptr, opt_.timeout);
  v1::DeleteResponse resp;
  const grpc::Status st = stub.Delete(ctx.get(), req, &resp);
  if (!st.ok()) rpc::throw_status(st, fmt::format("delete {} at {}", rpc::digest_hex(digest), owner(digest)));
  return resp.deleted();
}

v1::CacheStats SegmentCacheClient::stats(size_t replica) const {
  if (replica >= stubs_.size()) {
    throw std::out_of_range(fmt::format("replica {}: only {} configured", replica, stubs_.size()));
  }
  auto ctx = rpc::make_client_context(nullptr, opt_.timeout);
  v1::CacheStats out;
  const grpc::Status st = stubs_[replica][0]->Stats(ctx.get(), v1::StatsRequest{}, &out);
  if (!st.ok()) rpc::throw_status(st, fmt::format("stats of {}", replicas_[replica]));
  return out;
}

namespace {

// Bytes per second: a decimal number (a fraction allowed) with an optional 1000-based unit k / M / G / T, an optional
// B and /s: "12.5MB" = 12,500,000, "100MB/s", "1000000". At least 1, at most 10^18; anything else (signs, exponents,
// 1024-based units, a unit alone) is refused.
std::optional<uint64_t> parse_rate(const std::string& s) {
  static const std::regex re(R"(^([0-9]+(\.[0-9]*)?|\.[0-9]+)([kKmMgGtT]?)[bB]?(/s)?$)");
  std::smatch m;
  if (s.size() > 40 || !std::regex_match(s, m, re)) return std::nullopt;
  const std::string unit = m[3].str();
  const int e3 = unit.empty() ? 0 : std::string("kmgt").find(char(std::tolower(unit[0]))) + 1;
  const long double v = std::stold(m[1].str()) * std::pow(10.0L, 3 * e3);
  if (!(v >= 1.0L) || v > 1e18L) return std::nullopt;
  return static_cast<uint64_t>(std::llround(v));
}

}  // namespace

void add_cache_client_flags(CLI::App& app, SegmentCacheClient::Options& options) {
  constexpr int64_t kMaxMs = 3'600'000;
  rpc::add_strict_int_option(app, "--cache-timeout-ms", options.timeout, 1, kMaxMs,
                             "segment cache calls' base deadline in ms (entry transfers add their bytes at "
                             "--cache-transfer-rate)");
  app.add_option_function<std::string>(
         "--cache-transfer-rate", [&options](const std::string& v) { options.transfer_rate = *parse_rate(v); },
         "slowest transfer rate a segment cache call's deadline allows for an entry's bytes, bytes per second, "
         "1000-based units (12.5MB = 12,500,000)")
      ->check(CLI::Validator(
          [](std::string& v) {
            return parse_rate(v) ? std::string()
                                 : rpc::flag_value_refusal(v, "bytes per second from 1 to 10^18, a number with an "
                                                              "optional 1000-based unit k, M, G or T (e.g. 12.5MB)");
          },
          "RATE", "rate"))
      ->default_str(std::to_string(options.transfer_rate));
  rpc::add_strict_int_option(app, "--cache-put-wait-ms", options.put_wait, 0, kMaxMs,
                             "how long a put may wait at the segment cache for room, in ms, on top of its deadline "
                             "(set it to the cache's --max-put-wait-ms)");
  rpc::add_strict_int_option(app, "--cache-connections", options.connections, 1, 64,
                             "TCP connections to each segment cache replica; calls take them in turn, so that "
                             "parallel fetches of large entries do not share one connection")
      ->capture_default_str();
  app.add_option("--cache-shared-memory", options.shared_memory,
                 "map the entries a segment cache replica on this host holds in sealed memfds instead of streaming "
                 "them, and put entries of 1 MiB and up as sealed memfds it adopts (a replica whose memfds cannot be "
                 "opened from here is streamed from, one that cannot open ours streamed to)")
      ->capture_default_str();
}

std::string describe(const SegmentCacheClient::Options& o) {
  return fmt::format("base deadline {} ms, transfer rate {} B/s, put wait {} ms, {} connection(s) per replica, shared "
                     "memory {}",
                     o.timeout.count(), o.transfer_rate, o.put_wait.count(), o.connections,
                     o.shared_memory ? "where the replica is on this host" : "off");
}

}  // namespace hypic::cache
