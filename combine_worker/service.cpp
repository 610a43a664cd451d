#include "combine_worker/service.h"

#include "combine_worker/output.h"

#include "proto/rpc/metrics.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <optional>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "engine/sampling.h"
#include "engine/segment.h"
#include "proto/engine_rpc/checks.h"
#include "proto/rpc/chunks.h"
#include "proto/rpc/entry_mac.h"
#include "proto/rpc/status.h"

namespace hypic::combine {

namespace v1 = hypic::v1;
using Clock = std::chrono::steady_clock;

// One segment of an active request.
struct Slot {
  rpc::Digest digest{};
  std::vector<int32_t> ids;
  v1::PlannedSegment::Source planned = v1::PlannedSegment::WARM;
  std::optional<size_t> repeat_of;  // planned REPEAT: filled with that segment's entry
  // Set once, at least one of the two: the host form (delivered, fetched) and/or the form resident on the backend
  // (built here, or a memory-tier hit).
  std::shared_ptr<const engine::SegmentEntry> entry;
  std::shared_ptr<const engine::ResidentEntry> resident;
  bool has_entry() const { return entry || resident; }
  const engine::SegmentEntry* header() const { return resident ? &resident->header() : entry.get(); }
  v1::SegmentSource source = v1::SEGMENT_SOURCE_UNSPECIFIED;
  std::string built_by, device, note;
  double compute_ms = 0;
  uint64_t entry_bytes = 0;
  bool local_started = false;
  bool retried_after_eviction = false;  // a local build refused for memory was retried once after evicting
  // Delivered by a scatter worker: how ("grpc", "nccl"), how long from its header to acceptance, bytes moved.
  std::string transport;
  double transfer_ms = 0;
  uint64_t transfer_bytes = 0;
  // Warm from the host tier or the cache: the copy that made it resident (ms, bytes moved).
  double fetch_ms = 0;
  uint64_t fetch_bytes = 0;
};

// How an entry arrived (Slot's transport and fetch fields).
struct Delivery {
  std::string transport;
  double transfer_ms = 0;
  uint64_t transfer_bytes = 0;
  double fetch_ms = 0;
  uint64_t fetch_bytes = 0;
};

struct CombineService::Pending {
  std::string id;
  // The request, parsed (parse_combine).
  engine::SpliceMode mode = engine::SpliceMode::Hypic;
  bool uses_entries = true;  // not full / prefix mode (which compute in context)
  std::vector<int32_t> query;
  engine::SamplingConfig sampling;
  std::vector<std::string> stops;
  int entry_seam_width = 0;
  bool cache_segments = true;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Slot> slots;
  std::vector<std::vector<size_t>> repeats;  // per slot, the REPEAT slots that take its entry (immutable)
  size_t filled = 0;
  std::string failure;  // a local build failed: the request cannot complete
  grpc::StatusCode failure_code = grpc::StatusCode::INTERNAL;  // what the build's error maps to
  std::shared_ptr<std::atomic<bool>> cancel = std::make_shared<std::atomic<bool>>(false);

  // Fills a slot, and the slots that repeat it with the same entry; false if it was already filled (a duplicate
  // delivery or a late local build). `note` is added to the slot's note.
  bool fill(size_t i, std::shared_ptr<const engine::SegmentEntry> entry, v1::SegmentSource source,
            std::string built_by, double compute_ms, uint64_t bytes, std::string device = {},
            std::shared_ptr<const engine::ResidentEntry> resident = nullptr, const std::string& note = {},
            const Delivery& delivery = {}) {
    {
      std::lock_guard<std::mutex> lock(mu);
      Slot& s = slots[i];
      if (s.has_entry()) return false;
      s.transport = delivery.transport;
      s.transfer_ms = delivery.transfer_ms;
      s.transfer_bytes = delivery.transfer_bytes;
      s.fetch_ms = delivery.fetch_ms;
      s.fetch_bytes = delivery.fetch_bytes;
      s.entry = std::move(entry);
      s.source = source;
      s.built_by = std::move(built_by);
      s.compute_ms = compute_ms;
      s.entry_bytes = bytes;
      s.device = std::move(device);
      s.resident = std::move(resident);
      if (!note.empty()) s.note = s.note.empty() ? note : s.note + "; " + note;
      ++filled;
      for (size_t j : repeats[i]) {
        Slot& r = slots[j];
        if (r.has_entry()) continue;
        r.entry = s.entry;
        r.resident = s.resident;
        r.source = v1::SEGMENT_SOURCE_REPEAT;
        r.built_by = s.built_by;
        r.device = s.device;
        r.entry_bytes = s.entry_bytes;
        r.note = fmt::format("same entry as segment {}", i);
        ++filled;
      }
    }
    cv.notify_all();
    return true;
  }
  void add_note(size_t i, const std::string& note) {
    std::lock_guard<std::mutex> lock(mu);
    slots[i].note = slots[i].note.empty() ? note : slots[i].note + "; " + note;
  }
};

CombineService::CombineService(CombineDeps deps, CombineOptions options)
    : d_(deps),
      opt_(options),
      backend_(deps.loop.backend()),
      device_(backend_.device().name()),
      accepts_({backend_.device().index, options.nccl_join_timeout,
                std::chrono::duration_cast<std::chrono::milliseconds>(options.nccl_idle_timeout),
                options.nccl_max_links}) {
  // Prometheus metrics (proto/rpc/metrics.h), read at each scrape; this service lives until the server stopped.
  auto& reg = rpc::MetricsRegistry::global();
  auto& tier = d_.memory_tier;
  auto& loop = d_.loop;
  reg.gauge_fn("hypic:cache_bytes", "Bytes of segment entries held, by tier", [&tier] { return double(tier.bytes()); },
               {{"tier", "combine-memory"}});
  reg.gauge_fn("hypic:cache_entries", "Segment entries held, by tier", [&tier] { return double(tier.entries()); },
               {{"tier", "combine-memory"}});
  auto& host = d_.host_tier;
  reg.gauge_fn("hypic:cache_bytes", "Bytes of segment entries held, by tier", [&host] { return double(host.bytes()); },
               {{"tier", "combine-host"}});
  reg.gauge_fn("hypic:cache_entries", "Segment entries held, by tier", [&host] { return double(host.entries()); },
               {{"tier", "combine-host"}});
  reg.gauge_fn("hypic:cache_budget_bytes", "Byte budget of a tier of segment entries", [&tier] { return double(tier.budget()); },
               {{"tier", "combine-memory"}});
  reg.gauge_fn("hypic:cache_budget_bytes", "Byte budget of a tier of segment entries", [&host] { return double(host.budget()); },
               {{"tier", "combine-host"}});
  // Counters by outcome, each read from its component's counters at scrape time.
  auto& copier = d_.copier;
  auto& putter = d_.putter;
  using CopierCount = uint64_t HostCopier::Counters::*;
  using PutterCount = uint64_t cache::AsyncCachePutter::Counters::*;
  for (const auto& [outcome, field] : {std::pair<const char*, CopierCount>{"made", &HostCopier::Counters::made},
                                       {"dropped", &HostCopier::Counters::dropped},
                                       {"failed", &HostCopier::Counters::failed}}) {
    reg.counter_fn("hypic:host_copies_total", "Host copies of resident entries (host tier, cache puts), by outcome",
                   [&copier, f = field] { return double(copier.counters().*f); }, {{"outcome", outcome}});
  }
  for (const auto& [outcome, field] :
       {std::pair<const char*, PutterCount>{"stored", &cache::AsyncCachePutter::Counters::stored},
        {"failed", &cache::AsyncCachePutter::Counters::failed},
        {"dropped", &cache::AsyncCachePutter::Counters::dropped}}) {
    reg.counter_fn("hypic:cache_puts_total", "Entries this worker stored in the segment cache",
                   [&putter, f = field] { return double(putter.counters().*f); }, {{"outcome", outcome}});
  }
  reg.gauge_fn("hypic:num_sequences_decoding", "Sequences in this combine worker's decode batch",
               [&loop] { return double(loop.active_sequences()); });
  reg.counter_fn("hypic:decode_iterations_total", "Batched decode steps run",
                 [&loop] { return double(loop.decode_iterations()); });
  reg.counter_fn("hypic:decode_sequence_steps_total", "Sequence-steps decoded (mean batch = this / iterations)",
                 [&loop] { return double(loop.decode_steps()); });
}

namespace {
/// hypic:entry_bytes_received_total{from}: entry bytes this combine worker received from scatter workers or the cache.
void count_received(const char* from, size_t bytes) {
  rpc::MetricsRegistry::global()
      .counter("hypic:entry_bytes_received_total", "Segment entry bytes received, by sender", {{"from", from}})
      .inc(double(bytes));
}
/// hypic:combine_segments_total{source}: segments this combine worker used, by where the entry came from.
void count_segment(v1::SegmentSource source) {
  rpc::MetricsRegistry::global()
      .counter("hypic:combine_segments_total", "Segment entries used by this combine worker, by source",
               {{"source", std::string(rpc::segment_source_name(source))}})
      .inc();
}
}  // namespace

CombineService::~CombineService() = default;

std::shared_ptr<CombineService::Pending> CombineService::find(const std::string& request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = active_.find(request_id);
  if (it == active_.end()) {
    throw rpc::RpcError(grpc::StatusCode::NOT_FOUND,
                        fmt::format("request {} is not active on this combine worker (finished, cancelled or never "
                                    "started)",
                                    rpc::untrusted(request_id)));
  }
  return it->second;
}

void CombineService::build_locally(const std::shared_ptr<Pending>& p, size_t slot, std::string note) {
  build_locally(p, {{slot, std::move(note)}});
}

void CombineService::build_locally(const std::shared_ptr<Pending>& p,
                                   const std::vector<std::pair<size_t, std::string>>& slots) {
  std::vector<engine::EngineLoop::BuildSubmission> builds;
  for (const auto& [slot, note] : slots) {
    std::vector<int32_t> ids;
    {
      std::lock_guard<std::mutex> lock(p->mu);
      Slot& s = p->slots[slot];
      if (s.has_entry() || s.local_started) continue;
      s.local_started = true;
      ids = s.ids;
      if (!note.empty()) s.note = s.note.empty() ? note : s.note + "; " + note;
    }
    auto done = [this, p, slot](engine::BuildOutcome r) {
      if (r.cancelled) return;
      if (r.error_kind == engine::EngineErrorKind::ResourceExhausted && d_.memory_tier.entries() > 0) {
        // Device memory short (other work on the GPU took what the device tier was sized from): the tier gives up
        // entries, as many bytes as the build needs, and the build is retried once.
        bool retry = false;
        std::vector<int32_t> ids;
        {
          std::lock_guard<std::mutex> lock(p->mu);
          Slot& s = p->slots[slot];
          if (!s.retried_after_eviction) {
            s.retried_after_eviction = true;
            retry = true;
            ids = s.ids;
          }
        }
        if (retry) {
          const size_t freed = d_.memory_tier.evict(backend_.entry_bytes(int64_t(ids.size())) * 2);
          spdlog::warn("[req {}] segment {}: device memory short ({}); {} bytes of the device tier evicted, build retried",
                       p->id, slot, r.error, freed);
          p->add_note(slot, "device memory short: device-tier entries evicted and the build retried");
          std::vector<engine::EngineLoop::BuildSubmission> again;
          again.push_back({std::move(ids), p->entry_seam_width, p->cancel,
                           [this, p, slot](engine::BuildOutcome r2) { finish_local_build(p, slot, std::move(r2)); },
                           engine::BuildHandover::Resident});
          d_.loop.submit_builds(std::move(again));
          return;
        }
      }
      finish_local_build(p, slot, std::move(r));
    };
    builds.push_back({std::move(ids), p->entry_seam_width, p->cancel, std::move(done), engine::BuildHandover::Resident});
  }
  // In one submission, so that they share one batch (one forward pass) on the engine loop.
  if (!builds.empty()) d_.loop.submit_builds(std::move(builds));
}

void CombineService::finish_local_build(const std::shared_ptr<Pending>& p, size_t slot, engine::BuildOutcome r) {
  if (r.cancelled) return;
  if (!r.error.empty()) {
    spdlog::error("[req {}] segment {}: local prefill failed: {}", p->id, slot, r.error);
    {
      std::lock_guard<std::mutex> lock(p->mu);
      p->failure = fmt::format("segment {}: prefill failed: {}", slot, r.error);
      p->failure_code = rpc::engine_error_code(r.error_kind);
    }
    p->cv.notify_all();
    return;
  }
  // Spliced as it is (resident, no host round trip); its host copy (host tier, cache put) is made afterwards, off the
  // critical path.
  const rpc::Digest digest = p->slots[slot].digest;  // immutable after registration
  d_.memory_tier.put(digest, r.entry);
  d_.copier.enqueue(digest, r.entry, p->cache_segments, p->id);
  count_segment(v1::SEGMENT_SOURCE_COMBINE_COMPUTED);
  const size_t bytes = r.entry->resident_bytes();
  p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_COMPUTED, address_, r.compute_ms, bytes, device_, std::move(r.entry));
}

void CombineService::fetch_warm(const std::shared_ptr<Pending>& p, size_t slot, const grpc::ServerContextBase* ctx) {
  const rpc::Digest digest = p->slots[slot].digest;
  const std::vector<int32_t>& ids = p->slots[slot].ids;
  if (auto e = d_.memory_tier.get(digest, ids)) {
    count_segment(v1::SEGMENT_SOURCE_COMBINE_MEMORY);
    p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_MEMORY, "", 0, e->resident_bytes(), "", e);
    return;
  }
  std::string why;
  if (auto block = d_.host_tier.get(digest, ids)) {
    // One host-to-device copy of the pinned block on this thread (the engine loop keeps computing meanwhile).
    const auto t0 = Clock::now();
    try {
      auto e = backend_.import_block(*block);
      Delivery d;
      d.fetch_ms = rpc::ms_between(t0, Clock::now());
      d.fetch_bytes = block->bytes();
      d_.memory_tier.put(digest, e);
      count_segment(v1::SEGMENT_SOURCE_COMBINE_HOST);
      p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_HOST, "", 0, e->resident_bytes(), "", e, "", d);
      return;
    } catch (const std::exception& e) {  // device memory short, or the block refused: the cache may still serve it
      why = fmt::format("host tier copy failed ({}); ", e.what());
      spdlog::warn("[req {}] segment {}: {}", p->id, slot, why);
      if (dynamic_cast<const engine::EntryError*>(&e)) d_.host_tier.erase(digest);
    }
  }
  if (!d_.cache.enabled()) {  // it was in this worker's tiers at the router's lookup
    build_locally(p, slot, why + "not in this worker's tiers any more (evicted or cleared after the lookup) and no "
                                 "segment cache is configured; prefilled by the combine worker");
    return;
  }
  try {
    const auto t0 = Clock::now();
    // Parsed as it arrives (no assembled copy of the bytes); used only once get_stream verified checksum and MAC. Its
    // header sizes nothing before it matched the stream's size, this model and these token ids (EntryReaderChecks).
    std::optional<engine::EntryReader> reader;
    uint64_t size = 0;
    try {
      if (!d_.cache.get_stream(
              cache::CacheKey{digest, ids},
              [&](uint64_t total) {
                size = total;
                reader.emplace(entry_checks(total, ids, p->entry_seam_width));
              },
              [&](std::string_view chunk) { reader->feed(chunk); }, ctx)) {
        why += "not in the segment cache any more (evicted after the lookup)";
      } else {
        const auto t1 = Clock::now();
        if (!reader) throw engine::EntryError("the cache's answer carried no entry");
        auto entry = std::make_shared<const engine::SegmentEntry>(reader->finish());
        rpc::verify_entry(*entry, ids, backend_, p->entry_seam_width);
        const auto t2 = Clock::now();
        auto resident = make_resident(digest, *entry);
        Delivery d;
        d.fetch_ms = rpc::ms_between(t0, Clock::now());
        d.fetch_bytes = size;
        spdlog::info("[req {}] segment {} from the segment cache: {:.1f} MB in {:.0f} ms (transfer and parse {:.0f}, "
                     "verify {:.0f}, device layout and copy {:.0f})",
                     p->id, slot, double(size) / 1e6, d.fetch_ms, rpc::ms_between(t0, t1), rpc::ms_between(t1, t2),
                     rpc::ms_between(t2, Clock::now()));
        count_received("cache", size);
        count_segment(v1::SEGMENT_SOURCE_CACHE);
        if (resident) entry.reset();  // spliced resident; the host form is not needed any more
        p->fill(slot, entry, v1::SEGMENT_SOURCE_CACHE, "", 0, size, "", std::move(resident), "", d);
        return;
      }
    } catch (const engine::EntryError& e) {  // while parsing (the stream was cut there), or after
      static auto& refused = rpc::MetricsRegistry::global().counter(
          "hypic:cache_entries_refused_total",
          "Segment entries read from the cache that did not parse or did not fit this model, these token ids or the "
          "size of their stream (corrupt, forged or foreign): dropped from the cache and recomputed (MAC failures: "
          "hypic:entry_mac_failures_total)");
      refused.inc();
      why += fmt::format("cache entry corrupt ({}): dropped from the cache", e.what());
      spdlog::error("[req {}] segment {} ({}): {}", p->id, slot, rpc::digest_hex(digest), why);
      try {
        d_.cache.erase(digest);
      } catch (const std::exception& ex) {
        spdlog::warn("[req {}] could not drop corrupt entry {}: {}", p->id, rpc::digest_hex(digest), ex.what());
      }
    } catch (const engine::ResourceExhausted& e) {
      why += fmt::format("fetched from the cache, but it could not be made resident ({})", e.what());
      spdlog::warn("[req {}] segment {}: {}", p->id, slot, why);
    }
  } catch (const rpc::RpcError& e) {
    if (e.code() == grpc::StatusCode::DATA_LOSS) {
      why += fmt::format("cache entry failed its integrity check and was dropped by the cache ({})", e.what());
    } else if (e.code() == grpc::StatusCode::CANCELLED) {
      return;  // the request is going away
    } else {
      why += fmt::format("segment cache unreachable ({})", e.what());
    }
    spdlog::warn("[req {}] segment {}: {}", p->id, slot, why);
  }
  build_locally(p, slot, why + "; prefilled by the combine worker");
}

engine::EntryReaderChecks CombineService::entry_checks(uint64_t total_bytes, std::span<const int32_t> ids,
                                                       int seam_width) const {
  std::vector<int32_t> want(ids.begin(), ids.end());
  // The longest header this model's entry of these ids has (engine/segment.h: version, fingerprint, numerics, w, n,
  // ids, geometry and family fields, a kind per linear layer, the K/V type), plus slack.
  const uint64_t header = 4 + 4 + backend_.fingerprint().size() + 4 + backend_.numerics().size() + 4 + 4 +
                          4 * uint64_t(ids.size()) + 12 * 4 + uint64_t(backend_.config().num_linear_layers()) + 1 + 64;
  return {.total_bytes = total_bytes,
          .max_header_bytes = header,
          .header = [this, want = std::move(want), seam_width](const engine::SegmentEntry& h) {
            rpc::verify_entry(h, want, backend_, seam_width);
          }};
}

std::shared_ptr<const engine::ResidentEntry> CombineService::make_resident(const rpc::Digest& digest,
                                                                           const engine::SegmentEntry& entry) {
  if (!backend_.device_entries()) return nullptr;
  auto block = backend_.block_of_entry(entry);
  auto resident = backend_.import_block(*block);
  d_.memory_tier.put(digest, resident);
  d_.copier.keep_block(digest, std::move(block));
  return resident;
}

namespace {
engine::SamplingConfig sampling_config(const v1::SamplingParams& s) {
  engine::SamplingConfig c;
  c.temperature = s.temperature();
  c.top_k = s.top_k();
  c.top_p = s.has_top_p() ? s.top_p() : 1.0f;
  c.seed = s.has_seed() ? s.seed() : 0;
  c.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw rpc::invalid_argument("sampling", e.what());
  }
  return c;
}

}  // namespace

grpc::Status CombineService::Combine(grpc::ServerContext* ctx, const v1::CombineRequest* req,
                                     grpc::ServerWriter<v1::CombineEvent>* writer) {
  if (auto st = rpc::require_service_caller(*ctx, "CombineWorker.Combine"); !st.ok()) return st;
  const grpc::Status st = run_combine(ctx, req, writer);
  if (!st.ok()) spdlog::warn("[req {}] combine ended: {}", rpc::untrusted(req->request_id()), rpc::describe(st));
  return st;
}

std::shared_ptr<CombineService::Pending> CombineService::parse_combine(const v1::CombineRequest& req) const {
  rpc::validate_request_id(req.request_id());
  if (req.request_id().empty()) throw rpc::invalid_argument("request_id", "must not be empty");
  if (req.segments().empty()) throw rpc::invalid_argument("segments", "at least one segment is required");
  const int64_t vocab = backend_.config().vocab_size;
  auto p = std::make_shared<Pending>();
  p->query.assign(req.query_ids().begin(), req.query_ids().end());
  rpc::check_token_ids(p->query, vocab, "query_ids");
  engine::SpliceMode& mode = p->mode;
  try {
    mode = engine::parse_splice_mode(req.mode().empty() ? "hypic" : req.mode());
  } catch (const std::invalid_argument&) {
    throw rpc::invalid_argument("mode", fmt::format("unknown splice mode {}", rpc::untrusted(req.mode())));
  }
  if (req.seam_width() < 0) throw rpc::invalid_argument("seam_width", fmt::format("must be >= 0, got {}", req.seam_width()));
  for (const auto& [field, value] : {std::pair{"refresh_segments", req.refresh_segments()},
                                     std::pair{"refresh_tail", req.refresh_tail()}}) {
    if (value < 0 || (value > 0 && mode != engine::SpliceMode::Hypic)) {
      throw rpc::invalid_argument(field, fmt::format("must be >= 0, and 0 outside mode hypic; got {} in mode {}",
                                                     value, engine::splice_mode_name(mode)));
    }
  }
  if (!req.sampling().has_max_tokens() || req.sampling().max_tokens() < 1) {
    throw rpc::invalid_argument("sampling.max_tokens", "must be set and >= 1");
  }
  p->sampling = sampling_config(req.sampling());
  p->stops.assign(req.sampling().stop().begin(), req.sampling().stop().end());
  engine::StopStringMatcher check_stops(p->stops);  // validates (non-empty strings)
  check_request_limits(req, opt_.limits);        // this worker's own caps, whatever the router allowed
  p->uses_entries = mode != engine::SpliceMode::Full && mode != engine::SpliceMode::Prefix;
  const bool uses_entries = p->uses_entries;
  p->id = req.request_id();
  p->entry_seam_width = mode == engine::SpliceMode::Hypic ? req.seam_width() : 0;
  p->cache_segments = req.cache_segments();
  p->slots.resize(size_t(req.segments_size()));
  for (int i = 0; i < req.segments_size(); ++i) {
    const auto& ps = req.segments(i);
    const std::string field = fmt::format("segments[{}]", i);
    if (ps.index() != uint32_t(i)) {
      throw rpc::invalid_argument(field + ".index", fmt::format("segments must be listed in prompt order: expected "
                                                                "{}, got {}",
                                                                i, ps.index()));
    }
    Slot& s = p->slots[size_t(i)];
    s.ids.assign(ps.key().token_ids().begin(), ps.key().token_ids().end());
    if (uses_entries) {
      s.digest = rpc::check_segment_key(ps.key().digest(), s.ids, field + ".key", vocab, backend_.fingerprint(),
                                        engine::entry_format_version(backend_.config()), p->entry_seam_width);
    } else {  // full and prefix modes compute in context: the digest is only echoed
      s.digest = rpc::parse_digest(ps.key().digest(), field + ".key.digest");
      rpc::check_token_ids(s.ids, vocab, field + ".key.token_ids");
    }
    s.planned = ps.source();
    if (s.planned == v1::PlannedSegment::WHOLE &&
        (mode != engine::SpliceMode::Hypic || i == 0 || i < req.segments_size() - req.refresh_tail())) {
      throw rpc::invalid_argument(field + ".source", "WHOLE is for the refresh's tail segments (mode hypic, index >= "
                                                     "max(1, segments - refresh_tail))");
    }
    if (uses_entries && s.planned == v1::PlannedSegment::REPEAT) {
      const uint32_t k = ps.repeat_of();
      if (k >= uint32_t(i) || p->slots[k].planned == v1::PlannedSegment::REPEAT ||
          p->slots[k].planned == v1::PlannedSegment::WHOLE || p->slots[k].digest != s.digest ||
          p->slots[k].ids != s.ids) {
        throw rpc::invalid_argument(field + ".repeat_of",
                                    fmt::format("{} is not an earlier, not repeated segment with the same key", k));
      }
      s.repeat_of = k;
    }
  }
  p->repeats.resize(p->slots.size());
  for (size_t i = 0; i < p->slots.size(); ++i)
    if (p->slots[i].repeat_of) p->repeats[*p->slots[i].repeat_of].push_back(i);
  return p;
}

void CombineService::gather(const std::shared_ptr<Pending>& p, const v1::CombineRequest& req,
                            grpc::ServerContext* ctx, Fetchers& fetch) {
  if (!p->uses_entries) return;  // full and prefix modes compute in context
  std::vector<size_t>& warm = fetch.warm;
  std::vector<std::thread>& fetchers = fetch.threads;
  std::vector<std::pair<size_t, std::string>> local;
  for (size_t i = 0; i < p->slots.size(); ++i) {
    if (p->slots[i].planned == v1::PlannedSegment::LOCAL) local.emplace_back(i, req.segments(int(i)).reason());
    if (p->slots[i].planned == v1::PlannedSegment::WARM) warm.push_back(i);
    if (p->slots[i].planned == v1::PlannedSegment::WHOLE) {  // recomputed whole from its ids: nothing to wait for
      std::lock_guard<std::mutex> lock(p->mu);
      Slot& s = p->slots[i];
      s.source = v1::SEGMENT_SOURCE_IN_CONTEXT;
      s.note = "in the refresh's tail, cold: recomputed whole in context; its entry is built after the first token";
      ++p->filled;
    }
  }
  build_locally(p, local);
  auto next = std::make_shared<std::atomic<size_t>>(0);
  const int nf = std::min<int>(opt_.fetch_parallelism, int(warm.size()));
  for (int f = 0; f < nf; ++f) {
    // The threads outlive this call (joined by run_combine's cleanup): by reference only what run_combine owns.
    fetchers.emplace_back([this, p, ctx, next, &warm = fetch.warm] {
      for (size_t k; (k = next->fetch_add(1)) < warm.size() && !p->cancel->load();) {
        try {
          fetch_warm(p, warm[k], ctx);
        } catch (const std::exception& e) {  // never out of the thread (std::terminate): the segment is computed
          try {
            build_locally(p, warm[k], fmt::format("fetching it failed ({}); prefilled by the combine worker",
                                                  rpc::untrusted(e.what())));
          } catch (const std::exception& again) {  // the request fails with the reason
            std::lock_guard<std::mutex> lock(p->mu);
            if (p->failure.empty()) {
              p->failure = fmt::format("segment {}: fetching it failed ({}), and so did computing it ({})", warm[k],
                                       rpc::untrusted(e.what()), rpc::untrusted(again.what()));
              p->failure_code = grpc::StatusCode::INTERNAL;
            }
            p->cv.notify_all();
          }
        }
      }
    });
  }
  const auto give_up = Clock::now() + opt_.gather_timeout;
  std::unique_lock<std::mutex> lock(p->mu);
  while (p->filled < p->slots.size()) {
    if (!p->failure.empty()) throw rpc::RpcError(p->failure_code, p->failure);
    if (ctx->IsCancelled()) throw rpc::RpcError(grpc::StatusCode::CANCELLED, "request cancelled by the router");
    if (Clock::now() > give_up) {
      std::vector<size_t> missing;
      for (size_t i = 0; i < p->slots.size(); ++i)
        if (!p->slots[i].has_entry()) missing.push_back(i);
      throw rpc::RpcError(grpc::StatusCode::DEADLINE_EXCEEDED,
                          fmt::format("segments {} did not arrive within {} s (--gather-timeout-seconds)",
                                      fmt::join(missing, ","), opt_.gather_timeout.count()));
    }
    p->cv.wait_for(lock, std::chrono::milliseconds(50));
  }
}

engine::SpliceInfo CombineService::splice(const std::shared_ptr<Pending>& p, const v1::CombineRequest& req,
                                          grpc::ServerContext* ctx, std::shared_ptr<GenerationEvents>& events) {
  engine::GenerateJob job;
  job.splice.plan.mode = p->mode;
  job.splice.plan.seam_width = req.seam_width();
  job.splice.plan.refresh_segments = req.refresh_segments();
  job.splice.plan.refresh_tail = req.refresh_tail();
  job.splice.plan.query = p->query;
  for (auto& s : p->slots) {
    job.splice.plan.segments.push_back({s.ids, s.resident});
    job.splice.host_entries.push_back(s.entry);
  }
  job.sampling = p->sampling;
  job.max_tokens = req.sampling().max_tokens();
  job.cancel = p->cancel;
  events = GenerationEvents::attach(job);
  d_.loop.submit_generate(std::move(job));
  engine::SpliceInfo sinfo = events->wait_spliced(*ctx);
  // Entries the splice imported (delivered or fetched) stay resident in the memory tier for later requests.
  for (size_t i = 0; i < sinfo.imported.size() && i < p->slots.size(); ++i)
    if (sinfo.imported[i]) d_.memory_tier.put(p->slots[i].digest, sinfo.imported[i]);
  sinfo.imported.clear();
  // So do the entries that came over NCCL (resident on arrival, never imported).
  {
    std::lock_guard<std::mutex> lock(p->mu);
    for (const Slot& s : p->slots)
      if (s.transport == "nccl" && s.resident) {
        d_.memory_tier.put(s.digest, s.resident);
        d_.copier.enqueue(s.digest, s.resident, /*put=*/false, p->id);  // the scatter worker puts it in the cache
      }
  }
  // The refresh's cold tail segments were recomputed whole: their entries are built now, after the splice, for
  // later requests (device tier, host copy, cache), between this worker's decode steps.
  {
    std::vector<engine::EngineLoop::BuildSubmission> later;
    for (size_t i = 0; i < p->slots.size(); ++i) {
      if (p->slots[i].planned != v1::PlannedSegment::WHOLE) continue;
      const rpc::Digest digest = p->slots[i].digest;
      const bool put = p->cache_segments;
      const std::string rid = p->id;
      later.push_back({p->slots[i].ids, p->entry_seam_width, nullptr,
                       [this, digest, put, rid](engine::BuildOutcome r) {
                         if (!r.entry) return;  // failed or the loop stopped: a later request builds it
                         d_.memory_tier.put(digest, r.entry);
                         d_.copier.enqueue(digest, r.entry, put, rid);
                       },
                       engine::BuildHandover::Resident});
    }
    if (!later.empty()) d_.loop.submit_builds(std::move(later));
  }
  return sinfo;
}

v1::CombineEvent CombineService::report(Pending& p, const engine::SpliceInfo& sinfo, const OutputSummary& out,
                                        double gather_ms) const {
  v1::CombineEvent rev;
  auto* rep = rev.mutable_report();
  rep->set_finish_reason(out.finish);
  rep->set_completion_tokens(out.completion_tokens);
  rep->set_gather_ms(gather_ms);
  rep->set_splice_ms(sinfo.splice_ms);
  rep->set_decode_ms(out.decode_ms);
  rep->set_device(device_);
  rep->set_numerics(std::string(backend_.numerics()));
  rep->set_random_weights_seed(d_.random_weights_seed);
  {
    std::lock_guard<std::mutex> lock(p.mu);
    for (size_t i = 0; i < p.slots.size(); ++i) {
      const Slot& s = p.slots[i];
      auto* sr = rep->add_segments();
      sr->set_index(uint32_t(i));
      sr->set_num_tokens(uint32_t(s.ids.size()));
      sr->set_digest_hex(rpc::digest_hex(s.digest));
      if (!p.uses_entries) {
        const bool reused = p.mode == engine::SpliceMode::Prefix && int(i) < sinfo.prefix_segments_reused;
        sr->set_source(reused ? v1::SEGMENT_SOURCE_COMBINE_MEMORY : v1::SEGMENT_SOURCE_IN_CONTEXT);
        sr->set_reused(reused);
        if (reused) sr->set_note("restored from a prefix checkpoint");
        continue;
      }
      sr->set_source(s.source);
      sr->set_reused(s.source == v1::SEGMENT_SOURCE_COMBINE_MEMORY || s.source == v1::SEGMENT_SOURCE_COMBINE_HOST ||
                     s.source == v1::SEGMENT_SOURCE_CACHE ||
                     s.source == v1::SEGMENT_SOURCE_SHARED_BUILD || s.source == v1::SEGMENT_SOURCE_REPEAT);
      if (s.repeat_of && s.source == v1::SEGMENT_SOURCE_REPEAT) sr->set_repeat_of(uint32_t(*s.repeat_of));
      sr->set_built_by(s.built_by);
      sr->set_compute_ms(s.compute_ms);
      sr->set_entry_bytes(s.entry_bytes);
      sr->set_note(s.note);
      sr->set_device(s.device);
      sr->set_transport(s.transport);
      sr->set_transfer_ms(s.transfer_ms);
      sr->set_transfer_bytes(s.transfer_bytes);
      sr->set_fetch_ms(s.fetch_ms);
      sr->set_fetch_bytes(s.fetch_bytes);
      if (std::binary_search(sinfo.recomputed_segments.begin(), sinfo.recomputed_segments.end(), int(i))) {
        sr->set_refreshed(true);
        sr->set_reused(false);  // its entry was not what the splice used: it was computed here, in context
      }
      if (s.has_entry()) sr->set_numerics(s.header()->numerics);
    }
  }
  return rev;
}

grpc::Status CombineService::run_combine(grpc::ServerContext* ctx, const v1::CombineRequest* req,
                                         grpc::ServerWriter<v1::CombineEvent>* writer) {
  return rpc::handle_errors([&]() -> grpc::Status {
    auto life_call = d_.life.enter();
    const auto t_start = Clock::now();
    const std::shared_ptr<Pending> p = parse_combine(*req);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!active_.emplace(p->id, p).second) {
        throw rpc::RpcError(grpc::StatusCode::ALREADY_EXISTS,
                            fmt::format("request_id: {} is already active on this combine worker", p->id));
      }
    }
    Fetchers fetch;  // declared before the cleanup that joins its threads
    struct Cleanup {
      CombineService& svc;
      Pending& p;
      Fetchers& fetch;
      ~Cleanup() {
        p.cancel->store(true);
        for (auto& t : fetch.threads) t.join();
        std::lock_guard<std::mutex> lock(svc.mu_);
        svc.active_.erase(p.id);
      }
    } cleanup{*this, *p, fetch};
    auto send = [&](const v1::CombineEvent& ev) {
      if (!writer->Write(ev)) throw rpc::RpcError(grpc::StatusCode::CANCELLED, "the router went away");
    };
    v1::CombineEvent ev;
    ev.mutable_started();
    send(ev);
    spdlog::info("[req {}] combine: {} segments, {} query tokens, mode {}", p->id, p->slots.size(), p->query.size(),
                 engine::splice_mode_name(p->mode));
    gather(p, *req, ctx, fetch);
    const double gather_ms = rpc::ms_between(t_start, Clock::now());
    ev.mutable_entries_ready();
    send(ev);
    // The loop splices, then samples and decodes this request in one batch with every other request decoding
    // here; its callbacks only queue events for this handler (combine_worker/output.h).
    std::shared_ptr<GenerationEvents> events;
    const engine::SpliceInfo sinfo = splice(p, *req, ctx, events);
    ev.mutable_splice_done()->set_splice_ms(sinfo.splice_ms);
    ev.mutable_splice_done()->set_queue_ms(sinfo.queue_ms);
    send(ev);
    engine::StopStringMatcher stop_matcher(p->stops);
    const OutputSummary out = stream_tokens(
        *events, *ctx, d_.tokenizer, req->sampling().max_tokens(),
        std::set<int32_t>(p->sampling.stop_token_ids.begin(), p->sampling.stop_token_ids.end()), stop_matcher, send,
        [&] { p->cancel->store(true); });
    send(report(*p, sinfo, out, gather_ms));
    // Full and prefix modes splice nothing: their engine time is an in-context prefill (the report's prefill_ms).
    spdlog::info("[req {}] done: {} tokens, gather {:.1f} ms, {} {:.1f} ms ({} passes), decode {:.1f} ms", p->id,
                 out.completion_tokens, gather_ms, p->uses_entries ? "splice" : "prefill", sinfo.splice_ms,
                 sinfo.passes_paused + 1, out.decode_ms);
    return grpc::Status::OK;
  });
}

grpc::Status CombineService::DeliverEntry(grpc::ServerContext* ctx, grpc::ServerReader<v1::EntryChunk>* reader,
                                          v1::DeliverEntryResponse* resp) {
  if (auto st = rpc::require_service_caller(*ctx, "CombineWorker.DeliverEntry"); !st.ok()) return st;
  return rpc::handle_errors([&]() -> grpc::Status {
    // Not refused while draining: it serves a request already in flight (unknown ids get NOT_FOUND).
    const auto t0 = Clock::now();
    v1::EntryChunk msg;
    if (!reader->Read(&msg) || !msg.has_header()) {
      throw rpc::invalid_argument("header", "the first message of a delivery must be its header");
    }
    const v1::EntryHeader h = msg.header();
    if (h.transport() == v1::ENTRY_TRANSPORT_NCCL) {
      // The header is the whole stream: the block comes over the communicator.
      const bool extra = reader->Read(&msg);
      deliver_nccl(ctx, h, extra, resp);
      return grpc::Status::OK;
    }
    if (h.transport() != v1::ENTRY_TRANSPORT_GRPC) {
      throw rpc::invalid_argument("header.transport", fmt::format("unknown transport {}", int(h.transport())));
    }
    auto p = delivery_target(h);
    const Slot& slot = p->slots[h.index()];  // digest and ids are immutable after registration
    const std::string what =
        fmt::format("entry of segment {} of request {} from {}", h.index(), p->id, rpc::untrusted(h.built_by()));
    // Parsed as it arrives (no assembled copy of the bytes); used once the whole stream's size and checksum held.
    rpc::ChunkVerifier check;
    check.begin(h.total_bytes(), h.checksum(), what);
    engine::EntryReader parser(entry_checks(h.total_bytes(), slot.ids, p->entry_seam_width));
    // With entry keys the stream ends with the builder's MAC, checked before the entry is used.
    rpc::EntryMacCheck mac(rpc::entry_mac_keys(), slot.digest, slot.ids, h.total_bytes());
    std::optional<std::string> mac_sent;
    std::shared_ptr<const engine::SegmentEntry> entry;
    std::shared_ptr<const engine::ResidentEntry> resident;
    try {
      while (reader->Read(&msg)) {
        if (msg.has_header()) throw rpc::invalid_argument("header", "a delivery carries exactly one header");
        if (mac_sent) throw rpc::invalid_argument("mac", "a delivery's MAC must be its last message");
        if (msg.has_mac()) {
          mac_sent = msg.mac();
          continue;
        }
        check.append(msg.data());
        parser.feed(msg.data());
        mac.update(std::move(*msg.mutable_data()));  // hashed on its own thread while the next piece arrives
      }
      check.finish();
      if (mac.enabled() && !(mac_sent && mac.verify(*mac_sent))) {
        static auto& failures = rpc::MetricsRegistry::global().counter(
            "hypic:delivery_mac_failures_total",
            "Segment entries delivered by scatter workers over gRPC whose MAC was missing or did not verify: refused "
            "(DATA_LOSS)");
        failures.inc();
        const std::string why = mac_sent ? "its MAC does not verify under this cluster's keys"
                                         : "it carries no MAC (is --cache-key-file the same on every worker?)";
        spdlog::error("[req {}] refused {}: {}", p->id, what, why);
        throw rpc::RpcError(grpc::StatusCode::DATA_LOSS, fmt::format("{} refused: {}", what, why));
      }
      entry = std::make_shared<const engine::SegmentEntry>(parser.finish());
      rpc::verify_entry(*entry, slot.ids, backend_, p->entry_seam_width);
      resident = make_resident(slot.digest, *entry);  // on this thread, not the engine loop's (device backends)
      if (resident) entry.reset();
    } catch (const engine::EntryError& e) {
      spdlog::error("[req {}] rejected {}: {}", p->id, what, e.what());
      throw rpc::RpcError(grpc::StatusCode::DATA_LOSS, fmt::format("{} rejected by the engine: {}", what, e.what()));
    } catch (const engine::ResourceExhausted& e) {
      throw rpc::RpcError(grpc::StatusCode::RESOURCE_EXHAUSTED, fmt::format("{}: {}", what, e.what()));
    }
    accept_delivery(*p, h, std::move(entry), std::move(resident), check.total_bytes(),
                    Delivery{"grpc", rpc::ms_between(t0, Clock::now()), check.total_bytes()}, what, resp);
    return grpc::Status::OK;
  });
}

std::shared_ptr<CombineService::Pending> CombineService::delivery_target(const v1::EntryHeader& h) {
  auto p = find(h.request_id());
  if (h.index() >= p->slots.size()) {
    throw rpc::invalid_argument("header.index", fmt::format("{} but the request has {} segments", h.index(),
                                                            p->slots.size()));
  }
  const Slot& slot = p->slots[h.index()];  // digest and ids are immutable after registration
  if (rpc::parse_digest(h.digest(), "header.digest") != slot.digest) {
    throw rpc::invalid_argument("header.digest", fmt::format("segment {} of request {} has digest {}", h.index(),
                                                             p->id, rpc::digest_hex(slot.digest)));
  }
  return p;
}

void CombineService::accept_delivery(Pending& p, const v1::EntryHeader& h,
                                     std::shared_ptr<const engine::SegmentEntry> entry,
                                     std::shared_ptr<const engine::ResidentEntry> resident, uint64_t entry_bytes,
                                     const Delivery& delivery, const std::string& what,
                                     v1::DeliverEntryResponse* resp) {
  // A build the scatter worker shared with another request is reported as such.
  const bool shared = !h.shared_from().empty();
  const bool fresh = p.fill(
      h.index(), std::move(entry), shared ? v1::SEGMENT_SOURCE_SHARED_BUILD : v1::SEGMENT_SOURCE_SCATTER,
      h.built_by(), h.compute_ms(), entry_bytes, h.device(), std::move(resident),
      shared ? fmt::format("shared build: started on {} for request {}, joined by this one", h.built_by(),
                           h.shared_from())
             : std::string(),
      delivery);
  count_received("scatter", delivery.transfer_bytes);
  if (fresh) count_segment(shared ? v1::SEGMENT_SOURCE_SHARED_BUILD : v1::SEGMENT_SOURCE_SCATTER);
  resp->set_duplicate(!fresh);
  spdlog::debug("[req {}] received {} ({} bytes){}", p.id, what, delivery.transfer_bytes,
                fresh ? "" : ", duplicate dropped");
}

void CombineService::deliver_nccl(grpc::ServerContext* ctx, const v1::EntryHeader& h, bool extra_chunks,
                                  v1::DeliverEntryResponse* resp) {
  const auto t0 = Clock::now();
  // No matching operation is posted for an unknown, foreign or broken communicator: the sender aborts its side.
  auto peer = accepts_.peer(h.peer_epoch(), h.built_by());
  const auto drop_link = [&](const std::string& why) {
    peer->abort_soon(why);
    accepts_.forget(h.peer_epoch());
  };
  // One transfer at a time per communicator, in the order the headers came (the sender holds its side alike).
  auto order = peer->exclusive();
  transport::TransferLimits limits;
  limits.chunk_bytes = h.chunk_bytes();
  limits.deadline = transport::transfer_deadline(h.device_bytes(), opt_.nccl_transfer_base);
  limits.give_up = [ctx] { return ctx->IsCancelled(); };  // the scatter worker died or gave up
  // Protocol violations: the announced operations cannot be matched sensibly, so the communicator goes (the sender
  // sees no "matched" mark and aborts its side too).
  std::string violation;
  if (extra_chunks) {
    violation = "an NCCL delivery carries its header alone (no data chunks)";
  } else if (limits.chunk_bytes == 0) {
    violation = "header.chunk_bytes: must be > 0 for an NCCL delivery";
  } else if (h.device_bytes() == 0 || h.device_bytes() > 2 * h.total_bytes() + (uint64_t(1) << 20)) {
    // A device block is at most the serialized entry plus its alignment (bf16 KV against fp32 on the wire).
    violation = fmt::format("header.device_bytes: {} for a serialized entry of {} bytes", h.device_bytes(),
                            h.total_bytes());
  }
  if (!violation.empty()) {
    drop_link(violation);
    throw rpc::invalid_argument("header", violation);
  }
  // From here on, whatever happens, the announced block is matched: received, or received into scratch and
  // dropped; the answer's trailing metadata says so, and only then does the sender keep the link.
  bool matched = false;
  const auto mark_matched = [&] {
    matched = true;
    ctx->AddTrailingMetadata("hypic-nccl-matched", "1");
  };
  std::shared_ptr<Pending> p;
  std::pair<std::shared_ptr<const engine::ResidentEntry>, engine::DeviceBlock> dst;
  std::string what;
  try {
    p = delivery_target(h);
    const Slot& slot = p->slots[h.index()];  // digest and ids are immutable after registration
    what = fmt::format("entry of segment {} of request {} from {} over NCCL", h.index(), p->id,
                       rpc::untrusted(h.built_by()));
    // The digest covers the fingerprint, w and the tokens: the entry is this model's, laid out as ours.
    engine::SegmentEntry header;
    header.format_version = engine::entry_format_version(backend_.config());
    header.model_fingerprint = backend_.fingerprint();
    header.numerics = std::string(backend_.numerics());
    header.seam_width = p->entry_seam_width;
    header.token_ids = slot.ids;
    header.geometry = engine::EntryGeometry::of(backend_.config());
    try {
      dst = backend_.allocate_entry(header);
    } catch (const engine::ResourceExhausted& e) {
      throw rpc::RpcError(grpc::StatusCode::RESOURCE_EXHAUSTED, fmt::format("{}: {}", what, e.what()));
    } catch (const engine::EntryError& e) {
      throw rpc::RpcError(grpc::StatusCode::DATA_LOSS, fmt::format("{} rejected by the engine: {}", what, e.what()));
    } catch (const std::logic_error& e) {
      throw rpc::RpcError(grpc::StatusCode::FAILED_PRECONDITION, fmt::format("{}: {}", what, e.what()));
    }
    if (dst.second.bytes != h.device_bytes()) {
      throw rpc::RpcError(grpc::StatusCode::DATA_LOSS,
                          fmt::format("{}: a block of {} bytes was announced, but this worker lays the entry out in {}",
                                      what, h.device_bytes(), dst.second.bytes));
    }
    try {
      peer->recv(dst.second.data, dst.second.bytes, limits);
      mark_matched();
    } catch (const transport::TransportError& e) {
      drop_link(e.what());
      spdlog::warn("[req {}] {}: receive failed: {}", p->id, what, e.what());
      throw rpc::RpcError(grpc::StatusCode::UNAVAILABLE, fmt::format("{}: NCCL receive failed: {}", what, e.what()));
    }
  } catch (...) {
    if (!matched && !peer->broken()) {
      try {
        peer->discard(h.device_bytes(), limits);
        mark_matched();
      } catch (const transport::TransportError& te) {
        drop_link(te.what());
      }
    }
    throw;
  }
  accept_delivery(*p, h, nullptr, dst.first, h.total_bytes(),
                  Delivery{"nccl", rpc::ms_between(t0, Clock::now()), h.device_bytes()}, what, resp);
}

grpc::Status CombineService::OpenPeer(grpc::ServerContext* ctx, const v1::OpenPeerRequest* req,
                                      v1::OpenPeerResponse* resp) {
  if (auto st = rpc::require_service_caller(*ctx, "CombineWorker.OpenPeer"); !st.ok()) return st;
  return rpc::handle_errors([&]() -> grpc::Status {
    const auto refuse = [&](const std::string& why) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          fmt::format("no NCCL data plane with combine worker {}: {}", address_, why));
    };
    if (!opt_.nccl) return refuse("NCCL is off here (--nccl off)");
    if (const std::string why = transport::nccl_unavailable_reason(); !why.empty()) return refuse(why);
    if (backend_.device().kind != engine::BackendKind::Cuda) {
      return refuse(fmt::format("its {} backend keeps entries in host memory", backend_.numerics()));
    }
    if (req->scatter_address().empty()) throw rpc::invalid_argument("scatter_address", "must not be empty");
    if (req->model_fingerprint() != backend_.fingerprint()) {
      return refuse(fmt::format("the scatter worker serves model {}, this worker {}", req->model_fingerprint(),
                                backend_.fingerprint()));
    }
    const int device = backend_.device().index;
    const std::string uuid = transport::device_uuid(device);
    if (req->device_uuid() == uuid) return refuse(fmt::format("the scatter worker runs on the same GPU ({})", uuid));
    if (d_.life.draining()) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining: no new NCCL communicators");
    }
    const transport::NcclAccepts::Opened opened = accepts_.open(req->scatter_address());
    spdlog::info("NCCL communicator {} with scatter worker {} (NCCL {}): joining", opened.epoch,
                 req->scatter_address(), req->nccl_version());
    resp->set_unique_id(opened.unique_id);
    resp->set_epoch(opened.epoch);
    resp->set_join_timeout_ms(uint32_t(opt_.nccl_join_timeout.count()));
    return grpc::Status::OK;
  });
}

grpc::Status CombineService::ClosePeer(grpc::ServerContext* ctx, const v1::ClosePeerRequest* req,
                                       v1::ClosePeerResponse*) {
  if (auto st = rpc::require_service_caller(*ctx, "CombineWorker.ClosePeer"); !st.ok()) return st;
  return rpc::handle_errors([&]() -> grpc::Status {
    accepts_.close(req->epoch(), req->scatter_address());
    return grpc::Status::OK;  // unknown epochs are fine (already gone)
  });
}

size_t CombineService::nccl_peers() const { return accepts_.size(); }

grpc::Status CombineService::ComputeLocally(grpc::ServerContext* ctx, const v1::ComputeLocallyRequest* req,
                                            v1::ComputeLocallyResponse*) {
  if (auto st = rpc::require_service_caller(*ctx, "CombineWorker.ComputeLocally"); !st.ok()) return st;
  return rpc::handle_errors([&]() -> grpc::Status {
    // Not refused while draining: it serves a request already in flight (unknown ids get NOT_FOUND).
    auto p = find(req->request_id());
    for (int j = 0; j < req->indices_size(); ++j) {
      if (req->indices(j) >= p->slots.size()) {
        throw rpc::invalid_argument(fmt::format("indices[{}]", j), fmt::format("{} but the request has {} segments",
                                                                                req->indices(j), p->slots.size()));
      }
    }
    std::vector<std::pair<size_t, std::string>> local;
    for (uint32_t i : req->indices()) {
      spdlog::info("[req {}] prefilling segment {} here: {}", p->id, i, rpc::untrusted(req->reason()));
      local.emplace_back(i, req->reason());
    }
    build_locally(p, local);
    return grpc::Status::OK;
  });
}

grpc::Status CombineService::GetWorkerInfo(grpc::ServerContext* ctx, const v1::WorkerInfoRequest*, v1::WorkerInfo* resp) {
  if (auto st = rpc::require_service_caller(*ctx, "CombineWorker.GetWorkerInfo"); !st.ok()) return st;
  resp->set_role("combine");
  resp->set_model_fingerprint(backend_.fingerprint());
  resp->set_entry_format_version(engine::entry_format_version(backend_.config()));
  resp->set_address(address_);
  resp->set_compute_threads(uint32_t(d_.compute_threads));
  resp->set_queued_tokens(d_.loop.queued_tokens());
  resp->set_active_requests(uint32_t(d_.life.active()));
  resp->set_numerics(std::string(backend_.numerics()));
  resp->set_device(device_);
  resp->set_random_weights_seed(d_.random_weights_seed);
  resp->set_device_tier_bytes(d_.memory_tier.bytes());
  resp->set_device_tier_budget(d_.memory_tier.budget());
  resp->set_device_tier_entries(d_.memory_tier.entries());
  resp->set_host_tier_bytes(d_.host_tier.bytes());
  resp->set_host_tier_budget(d_.host_tier.budget());
  resp->set_host_tier_entries(d_.host_tier.entries());
  resp->set_host_copies_pending(d_.copier.counters().pending);
  resp->set_cache_puts_pending(d_.putter.pending());
  return grpc::Status::OK;
}

grpc::Status CombineService::LookupEntries(grpc::ServerContext* ctx, const v1::LookupEntriesRequest* req,
                                           v1::LookupEntriesResponse* resp) {
  if (auto st = rpc::require_service_caller(*ctx, "CombineWorker.LookupEntries"); !st.ok()) return st;
  return rpc::handle_errors([&]() -> grpc::Status {
    constexpr int kMaxDigests = 4096;
    if (req->digests_size() > kMaxDigests) {
      throw rpc::invalid_argument("digests", fmt::format("at most {} per call, got {}", kMaxDigests, req->digests_size()));
    }
    for (int i = 0; i < req->digests_size(); ++i) {
      const rpc::Digest d = rpc::parse_digest(req->digests(i), fmt::format("digests[{}]", i));
      resp->add_tiers(d_.memory_tier.contains(d) ? v1::ENTRY_TIER_DEVICE
                      : d_.host_tier.contains(d) ? v1::ENTRY_TIER_HOST
                                                 : v1::ENTRY_TIER_NONE);
    }
    return grpc::Status::OK;
  });
}

grpc::Status CombineService::ClearTiers(grpc::ServerContext* ctx, const v1::ClearTiersRequest* req,
                                        v1::ClearTiersResponse* resp) {
  if (auto st = rpc::require_service_caller(*ctx, "CombineWorker.ClearTiers"); !st.ok()) return st;
  return rpc::handle_errors([&]() -> grpc::Status {
    if (req->device()) resp->set_device_entries_dropped(d_.memory_tier.clear());
    if (req->host()) resp->set_host_entries_dropped(d_.host_tier.clear());
    spdlog::info("tiers cleared: {} device-tier and {} host-tier entries dropped", resp->device_entries_dropped(),
                 resp->host_entries_dropped());
    return grpc::Status::OK;
  });
}

}  // namespace hypic::combine
