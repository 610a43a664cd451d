// The combine worker's gathering (CombineService, service.h): how each segment's entry reaches the request's slot --
// a warm entry from the device or host tier or the segment cache (fetch_warm), a scatter worker's delivery over gRPC
// or NCCL (DeliverEntry, deliver_nccl), or a build on this worker's own engine (build_locally) -- and the wait for all
// of them (gather). The rest of the request (parse, splice, decode, report) is in service.cpp.
#include "combine_worker/pending.h"

#include <algorithm>
#include <string_view>
#include <system_error>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "proto/engine_rpc/checks.h"
#include "proto/rpc/chunks.h"
#include "proto/rpc/entry_mac.h"
#include "proto/rpc/log_limit.h"
#include "proto/rpc/status.h"

namespace hypic::combine {

using Clock = std::chrono::steady_clock;

// How a fetch's failure note ends when the segment is prefilled here instead (build_locally strips it where that
// prefill already failed and the request fails with both reasons).
constexpr std::string_view kPrefilledHere = "; prefilled by the combine worker";

void CombineService::build_locally(const std::shared_ptr<Pending>& p, size_t slot, std::string note) {
  build_locally(p, {{slot, std::move(note)}});
}

void CombineService::build_locally(const std::shared_ptr<Pending>& p,
                                   const std::vector<std::pair<size_t, std::string>>& slots) {
  std::vector<engine::EngineLoop::BuildSubmission> builds;
  for (const auto& [slot, note] : slots) {
    {
      std::lock_guard<std::mutex> lock(p->mu);
      Slot& s = p->slots[slot];
      if (s.has_entry()) continue;
      if (s.local_started) {
        // The fallback fetch of a failed policy rebuild failed too (fetch_warm ends here): the request fails with
        // both reasons, the build's code.
        if (s.fetch_fallback && p->failure.empty()) {
          std::string_view why = note;  // fetch_warm's reason, less kPrefilledHere
          if (why.ends_with(kPrefilledHere)) why.remove_suffix(kPrefilledHere.size());
          p->failure = fmt::format("segment {}: prefilling it failed ({}), and so did fetching it from the segment "
                                   "cache instead ({})",
                                   slot, s.build_error, why);
          p->failure_code = s.build_error_code;
          p->cv.notify_all();
        }
        continue;
      }
      s.local_started = true;
      if (!note.empty()) s.note = s.note.empty() ? note : s.note + "; " + note;
    }
    const Slot& s = p->slots[slot];  // digest and ids are immutable after registration
    std::string joined_for;
    uint64_t id = 0;
    std::shared_ptr<std::atomic<bool>> cancel;
    std::shared_ptr<const engine::ResidentEntry> held;
    bool copy_joined = false;
    {
      std::lock_guard<std::mutex> lock(local_mu_);
      // A request that is ending (its cleanup set the flag, then leaves local_builds_ under this lock) starts and
      // joins nothing: a late fetch failure or ComputeLocally would otherwise leave a build nobody waits for.
      if (p->cancel->load() || p->gather_cancel->load()) continue;
      auto it = local_builds_.find(s.digest);
      if (it != local_builds_.end() && it->second.ids == s.ids && it->second.seam_width == p->entry_seam_width) {
        it->second.waiters.emplace_back(p, slot);
        if (it->second.background) it->second.background->store(false);  // a request waits for it now
        joined_for = it->second.started_for;
        ++local_joined_;
      } else if (it == local_builds_.end() && (held = d_.memory_tier.get(s.digest, s.ids))) {
        // Built here for another request since this one was planned (a finished build is in the device tier before
        // it leaves local_builds_, on_local_built): spliced from the tier.
      } else if (it == local_builds_.end() && (copy_joined = take_host_copy_locked(p, slot, held))) {
        // Built here since, kept out of the device tier, its host copy in the making: held (resident) or, staged,
        // the copy's block once made.
      } else if (it == local_builds_.end()) {
        id = next_local_build_++;
        cancel = std::make_shared<std::atomic<bool>>(false);
        LocalBuild& b = local_builds_[s.digest];
        b.id = id, b.ids = s.ids, b.seam_width = p->entry_seam_width, b.started_for = p->id, b.cancel = cancel;
        b.waiters.emplace_back(p, slot);
      }
      // (else: the same digest of other ids or seam width -- a collision -- is built on its own, unshared)
    }
    if (held) {
      count_segment(v1::SEGMENT_SOURCE_COMBINE_MEMORY);
      const size_t bytes = held->resident_bytes();
      p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_MEMORY, "", 0, bytes, "", std::move(held),
              copy_joined ? "built on this worker for another request since this request was planned, its host copy "
                            "being made: spliced resident"
                          : "built on this worker for another request since this request was planned: from its "
                            "device tier");
      continue;
    }
    if (copy_joined) continue;  // staged: filled with the host copy's block (fill_local_build's on_copied)
    if (!joined_for.empty()) {
      builds_joined_counter().inc();
      p->add_note(slot, joined_for == p->id ? "joined this request's own build of the same segment"
                                            : fmt::format("joined this worker's build of the same segment for "
                                                          "request {} (one build for both)",
                                                          joined_for));
      continue;
    }
    if (id == 0) {  // unshared: its own cancel flag is the request's
      builds.push_back({s.ids, p->entry_seam_width, p->gather_cancel,
                        [this, p, slot](engine::BuildOutcome r) {
                          if (r.cancelled) return;
                          if (!r.error.empty()) return local_build_failed(p, slot, r);
                          if (!p->stage_blocks.load()) d_.memory_tier.put(p->slots[slot].digest, r.entry);
                          fill_local_build(p->slots[slot].digest, {{p, slot}}, std::move(r));
                        },
                        engine::BuildHandover::Resident});
      continue;
    }
    builds.push_back({s.ids, p->entry_seam_width, cancel,
                      [this, digest = s.digest, id](engine::BuildOutcome r) { on_local_built(digest, id, std::move(r)); },
                      engine::BuildHandover::Resident});
  }
  // In one submission, so that they share one batch (one forward pass) on the engine loop.
  if (!builds.empty()) d_.loop.submit_builds(std::move(builds));
}

void CombineService::on_local_built(const rpc::Digest& digest, uint64_t build, engine::BuildOutcome r) {
  // Into the device tier before the build leaves local_builds_, so that a request arriving in between finds it in one
  // or the other (build_locally); also when every request waiting for it ended (the next one hits). Not when every
  // waiter stages its entries from host blocks (fill_local_build): there its device memory is to go after the copy.
  // One the tier does not keep goes into copying_ as it leaves local_builds_, until its host copy is made.
  const bool built = !r.cancelled && r.error.empty() && r.entry;
  LocalBuild b;
  bool retry = false, copying = false;
  {
    std::lock_guard<std::mutex> lock(local_mu_);  // (then the tier's: the order build_locally takes them in)
    auto it = local_builds_.find(digest);
    if (it == local_builds_.end() || it->second.id != build) {  // every request waiting for it ended
      if (built) d_.memory_tier.put(digest, r.entry);
      return;
    }
    const bool to_device = built && (it->second.device_tier ||
                                     std::any_of(it->second.waiters.begin(), it->second.waiters.end(),
                                                 [](const auto& w) { return !w.first->stage_blocks.load(); }));
    if (to_device) d_.memory_tier.put(digest, r.entry);
    // Not kept by the device tier (not put, or no room), on its way to the host tier: findable until its block lands
    // there (copying_).
    copying = built && d_.host_tier.budget() > 0 && !d_.memory_tier.contains(digest);
    // (Not for a build nobody waits for, after a first token: it does not evict other requests' entries.)
    if (!r.cancelled && r.error_kind == engine::EngineErrorKind::ResourceExhausted && !it->second.retried &&
        d_.memory_tier.entries() > 0 && !it->second.waiters.empty()) {
      it->second.retried = true;
      retry = true;
      b.ids = it->second.ids, b.seam_width = it->second.seam_width, b.cancel = it->second.cancel;
      b.waiters = it->second.waiters;
    } else {
      b = std::move(it->second);
      local_builds_.erase(it);
      if (copying) {  // (one copy in flight per digest: a second build of it leaves the first's waiters as they are)
        std::lock_guard<std::mutex> copies(copying_->mu);
        copying = copying_->copies.try_emplace(digest, HostCopiesInFlight::Copy{b.ids, b.seam_width, r.entry, {}})
                      .second;
      }
    }
  }
  if (r.cancelled) return;  // the engine loop stopped, or nobody waits any more
  if (retry) {
    // Device memory short (other work on the GPU took what the device tier was sized from): the tier gives up
    // entries, as many bytes as the build needs, and the build is retried once.
    const size_t freed = d_.memory_tier.evict(backend_.entry_bytes(int64_t(b.ids.size())) * 2);
    for (const auto& [p, slot] : b.waiters) {
      spdlog::warn("[req {}] segment {}: device memory short ({}); {} bytes of the device tier evicted, build retried",
                   p->id, slot, r.error, freed);
      p->add_note(slot, "device memory short: device-tier entries evicted and the build retried");
    }
    std::vector<engine::EngineLoop::BuildSubmission> again;
    again.push_back({std::move(b.ids), b.seam_width, b.cancel,
                     [this, digest, build](engine::BuildOutcome r2) { on_local_built(digest, build, std::move(r2)); },
                     engine::BuildHandover::Resident});
    d_.loop.submit_builds(std::move(again));
    return;
  }
  if (!r.error.empty()) {
    if (b.after_first_token)
      spdlog::warn("[req {}] the entry built after its first token failed (a later request builds it): {}",
                   b.started_for, r.error);
    for (const auto& [p, slot] : b.waiters) local_build_failed(p, slot, r);
    return;
  }
  fill_local_build(digest, b.waiters, std::move(r), b.put, b.started_for, copying);
}

void CombineService::build_after_first_token(const std::shared_ptr<Pending>& p, const std::vector<size_t>& slots) {
  const bool staged = p->stage_blocks.load();
  std::vector<engine::EngineLoop::BuildSubmission> builds;
  // Background builds wait while other work is queued: under sustained load they pile up. Past this many queued
  // tokens no more are added (a later request builds those entries when it needs them).
  int64_t background = d_.loop.background_tokens();
  size_t skipped = 0;
  for (size_t slot : slots) {
    const Slot& s = p->slots[slot];  // digest and ids are immutable after registration
    uint64_t id = 0;
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    std::shared_ptr<std::atomic<bool>> background_flag;
    {
      std::lock_guard<std::mutex> lock(local_mu_);  // (then the tiers': the order build_locally takes them in)
      if (auto it = local_builds_.find(s.digest); it != local_builds_.end()) {
        // Being built for another request: it carries on when that request leaves, and keeps what this one asks.
        LocalBuild& b = it->second;
        if (b.ids == s.ids && b.seam_width == p->entry_seam_width) {
          b.after_first_token = true;
          b.put = b.put || p->cache_segments;
          b.device_tier = b.device_tier || !staged;
        }
        continue;
      }
      if (copy_in_flight_locked(s.digest) || d_.memory_tier.contains(s.digest) || d_.host_tier.contains(s.digest))
        continue;
      // Nothing would keep it: no device tier for a staged request's entries, no host tier, no cache put.
      if (staged && d_.host_tier.budget() == 0 && !(p->cache_segments && d_.cache.enabled())) continue;
      if (background + int64_t(s.ids.size()) > kMaxBackgroundBuildTokens) {
        ++skipped;
        continue;
      }
      background += int64_t(s.ids.size());
      id = next_local_build_++;
      LocalBuild& b = local_builds_[s.digest];
      b.id = id, b.ids = s.ids, b.seam_width = p->entry_seam_width, b.started_for = p->id, b.cancel = cancel;
      b.after_first_token = true, b.put = p->cache_segments, b.device_tier = !staged;
      b.background = background_flag = std::make_shared<std::atomic<bool>>(true);  // nobody waits for it yet
    }
    builds.push_back({s.ids, p->entry_seam_width, cancel,
                      [this, digest = s.digest, id](engine::BuildOutcome r) { on_local_built(digest, id, std::move(r)); },
                      engine::BuildHandover::Resident, nullptr, background_flag});
  }
  if (skipped) {
    static rpc::LogLimit limit;
    uint64_t unlogged = 0;
    if (limit.allow(&unlogged))
      spdlog::warn("[req {}] {} entries not built after its first token: {} tokens of background builds already wait "
                   "(at most {}){}",
                   p->id, skipped, background, kMaxBackgroundBuildTokens,
                   unlogged ? fmt::format("; {} more such lines since the last", unlogged) : std::string());
  }
  if (!builds.empty()) {
    spdlog::info("[req {}] {} entries to build after its first token, in the background ({} tokens queued so)",
                 p->id, builds.size(), background);
    d_.loop.submit_builds(std::move(builds));
  }
}

void CombineService::fill_local_build(const rpc::Digest& digest,
                                      const std::vector<std::pair<std::shared_ptr<Pending>, size_t>>& waiters,
                                      engine::BuildOutcome r, bool put_anyway, const std::string& request_id,
                                      bool copying) {
  // Spliced as it is (resident, no host round trip; the caller put it in the device tier); its host copy (host tier,
  // cache put) is made afterwards, off the critical path, once. Put in the cache when a waiter asked for that and
  // none rebuilt it from the cache's copy.
  fetch_costs_.observe_build(int64_t(r.entry->header().token_ids.size()), r.compute_ms);
  bool put = put_anyway, in_cache = false;
  for (const auto& [p, slot] : waiters) {
    std::lock_guard<std::mutex> lock(p->mu);
    put = put || p->cache_segments;
    in_cache = in_cache || p->slots[slot].in_cache;
  }
  // A request whose entries are staged by its splice takes the entry's pinned host copy once the copier made it
  // (its device memory then goes, unless the device tier keeps it): its builds do not pile up in device memory.
  std::vector<std::pair<std::shared_ptr<Pending>, size_t>> staged;
  const size_t bytes = r.entry->resident_bytes();
  for (const auto& [p, slot] : waiters) {
    count_segment(v1::SEGMENT_SOURCE_COMBINE_COMPUTED);
    if (p->stage_blocks.load()) {
      staged.emplace_back(p, slot);
      continue;
    }
    p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_COMPUTED, address_, r.compute_ms, bytes, device_, r.entry);
  }
  HostCopier::OnCopied on_copied;
  if (!staged.empty() || copying) {
    // (No `this`: the copier may call it while it is destroyed, after the service.)
    on_copied = [staged, entry = r.entry, bytes, ms = r.compute_ms, addr = address_, dev = device_, digest,
                 joins = copying ? copying_ : nullptr](std::shared_ptr<const engine::HostBlock> b) {
      for (const auto& [p, slot] : staged) {
        if (b) {
          p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_COMPUTED, addr, ms, bytes, dev, nullptr,
                  "built here, then copied to a pinned host block for the staged splice", {}, b);
        } else {  // no host copy (dropped or failed): spliced resident
          p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_COMPUTED, addr, ms, bytes, dev, entry);
        }
      }
      if (!joins) return;
      // The slots that asked for this copy while it was made (take_host_copy_locked); the block is in the host tier
      // by now (HostCopier::copy puts it there first), so a lookup from here on finds it there.
      std::vector<std::pair<std::shared_ptr<Pending>, size_t>> waiters;
      {
        std::lock_guard<std::mutex> lock(joins->mu);
        auto it = joins->copies.find(digest);
        if (it == joins->copies.end() || it->second.entry != entry) return;
        waiters = std::move(it->second.waiters);
        joins->copies.erase(it);
      }
      for (const auto& [p, slot] : waiters) {
        if (b) {
          count_segment(v1::SEGMENT_SOURCE_COMBINE_HOST);
          p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_HOST, "", 0, b->bytes(), "", nullptr,
                  "built on this worker for another request: staged from its host copy, made meanwhile", {}, b);
        } else {  // no host copy (dropped or failed): spliced resident
          count_segment(v1::SEGMENT_SOURCE_COMBINE_MEMORY);
          p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_MEMORY, "", 0, bytes, "", entry,
                  "built on this worker for another request; its host copy failed: spliced resident");
        }
      }
    };
  }
  const std::string rid = !request_id.empty() ? request_id : waiters.empty() ? std::string() : waiters.front().first->id;
  d_.copier.enqueue(digest, r.entry, put && !in_cache, rid, std::move(on_copied));
}

void CombineService::local_build_failed(const std::shared_ptr<Pending>& p, size_t slot,
                                        const engine::BuildOutcome& r) {
  {
    std::lock_guard<std::mutex> lock(p->mu);
    Slot& s = p->slots[slot];
    if (s.in_cache && !s.fetch_fallback) {
      // Prefilled here by the fetch policy's choice although the segment cache holds it: fetched after all (gather's
      // wait starts the fetch; a failure there fails the request with both reasons, build_locally).
      s.fetch_fallback = true;
      s.in_cache = false;
      s.build_error = r.error;
      s.build_error_code = rpc::engine_error_code(r.error_kind);
      p->refetch.push_back(slot);
      p->cv.notify_all();
      return;
    }
    spdlog::error("[req {}] segment {}: local prefill failed: {}", p->id, slot, r.error);
    p->failure = fmt::format("segment {}: prefill failed: {}", slot, r.error);
    p->failure_code = rpc::engine_error_code(r.error_kind);
  }
  p->cv.notify_all();
}

void CombineService::leave_local_builds(const Pending& p) {
  std::lock_guard<std::mutex> lock(local_mu_);
  for (const Slot& s : p.slots) {  // (digests are immutable after registration)
    auto it = local_builds_.find(s.digest);
    if (it == local_builds_.end()) continue;
    std::erase_if(it->second.waiters, [&](const auto& w) { return w.first.get() == &p; });
    if (it->second.waiters.empty() && !it->second.after_first_token) {
      it->second.cancel->store(true);
      local_builds_.erase(it);
    } else if (it->second.waiters.empty() && it->second.background) {
      it->second.background->store(true);  // nobody waits for it any more: background work again
    }
  }
}

CombineService::LocalBuildCounts CombineService::local_build_counts() const {
  std::lock_guard<std::mutex> lock(local_mu_);
  std::lock_guard<std::mutex> copies(copying_->mu);
  size_t copy_waiters = 0;
  for (const auto& [digest, c] : copying_->copies) copy_waiters += c.waiters.size();
  return {local_builds_.size(), local_joined_, copying_->copies.size(), copy_waiters};
}

bool CombineService::copy_in_flight_locked(const rpc::Digest& digest) const {
  std::lock_guard<std::mutex> lock(copying_->mu);
  return copying_->copies.contains(digest);
}

bool CombineService::take_host_copy_locked(const std::shared_ptr<Pending>& p, size_t slot,
                                           std::shared_ptr<const engine::ResidentEntry>& resident) {
  const Slot& s = p->slots[slot];  // digest and ids are immutable after registration
  std::lock_guard<std::mutex> lock(copying_->mu);
  auto it = copying_->copies.find(s.digest);
  if (it == copying_->copies.end() || it->second.ids != s.ids || it->second.seam_width != p->entry_seam_width)
    return false;
  if (p->stage_blocks.load())
    it->second.waiters.emplace_back(p, slot);
  else
    resident = it->second.entry;
  return true;
}

void CombineService::fetch_warm(const std::shared_ptr<Pending>& p, size_t slot, const grpc::ServerContextBase* ctx) {
  const rpc::Digest digest = p->slots[slot].digest;
  const std::vector<int32_t>& ids = p->slots[slot].ids;
  // The device tier; then what is on its way into the tiers (a build here, then its host copy); then the tiers again:
  // an entry moves that way, so looking in this order does not miss one in between (build_locally looks again).
  if (auto e = d_.memory_tier.get(digest, ids)) {
    count_segment(v1::SEGMENT_SOURCE_COMBINE_MEMORY);
    p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_MEMORY, "", 0, e->resident_bytes(), "", e);
    return;
  }
  bool building = false, copying = false;
  std::shared_ptr<const engine::ResidentEntry> resident;
  {
    std::lock_guard<std::mutex> lock(local_mu_);
    building = local_builds_.contains(digest);
    copying = !building && take_host_copy_locked(p, slot, resident);
  }
  if (building) {  // being built here (the router's lookup saw ENTRY_TIER_BUILDING): joined, not fetched
    build_locally(p, slot, "being built on this worker: joined that build");
    return;
  }
  if (copying) {  // built here, its host copy being made (the lookup saw ENTRY_TIER_HOST)
    if (resident) {
      count_segment(v1::SEGMENT_SOURCE_COMBINE_MEMORY);
      const size_t bytes = resident->resident_bytes();
      p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_MEMORY, "", 0, bytes, "", std::move(resident),
              "built on this worker for another request, its host copy being made: spliced resident");
    }  // (else staged: the copy's callback fills the slot with the block)
    return;
  }
  if (auto e = d_.memory_tier.get(digest, ids)) {
    count_segment(v1::SEGMENT_SOURCE_COMBINE_MEMORY);
    p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_MEMORY, "", 0, e->resident_bytes(), "", e);
    return;
  }
  std::string why;
  if (auto block = d_.host_tier.get(digest, ids)) {
    if (p->stage_blocks.load()) {  // staged by the splice from the pinned block itself
      count_segment(v1::SEGMENT_SOURCE_COMBINE_HOST);
      const size_t bytes = block->bytes();
      p->fill(slot, nullptr, v1::SEGMENT_SOURCE_COMBINE_HOST, "", 0, bytes, "", nullptr, "", {}, std::move(block));
      return;
    }
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
                                 "segment cache is configured" + std::string(kPrefilledHere));
    return;
  }
  try {
    const auto t0 = Clock::now();
    // Parsed as it arrives (no assembled copy of the bytes; on a device backend into a pinned block where the wire
    // has its layout); used only once get_stream verified checksum and MAC. Its header sizes nothing before it
    // matched the stream's size, this model and these token ids (EntryReaderChecks).
    std::optional<engine::EntryReceiver> receiver;
    uint64_t size = 0;
    cache::FetchReport how;
    try {
      if (!d_.cache.get_stream(
              cache::CacheKey{digest, ids},
              [&](uint64_t total) {
                size = total;
                receiver.emplace(backend_, entry_checks(total, ids, p->entry_seam_width));
              },
              [&](std::string_view chunk) { receiver->feed(chunk); }, ctx,
              engine::wire_entry_bytes(backend_.config(), int64_t(ids.size())),  // (its deadline allows the bytes)
              &how)) {
        why += "not in the segment cache any more (evicted after the lookup)";
      } else {
        const auto t1 = Clock::now();
        if (!receiver) throw engine::EntryError("the cache's answer carried no entry");
        engine::EntryReceiver::Received got = receiver->finish();
        rpc::verify_entry(*got.entry, ids, backend_, p->entry_seam_width);
        const auto t2 = Clock::now();
        Kept kept = keep_received(*p, digest, got);
        std::shared_ptr<const engine::SegmentEntry> entry = std::move(got.entry);
        Delivery d;
        d.fetch_ms = rpc::ms_between(t0, Clock::now());
        d.fetch_bytes = size;
        spdlog::info("[req {}] segment {} from the segment cache ({}{}): {:.1f} MB in {:.0f} ms (transfer and parse "
                     "{:.0f}: answer {:.0f}, map {:.0f}, read and parse {:.0f}, call's end {:.0f}, checks {:.0f}; "
                     "verify {:.0f}, device layout and copy {:.0f})",
                     p->id, slot, how.mapped ? "its memfd mapped" : "streamed",
                     got.block ? ", into a pinned block" : "", double(size) / 1e6, d.fetch_ms,
                     rpc::ms_between(t0, t1), how.answer_ms, how.map_ms, how.read_ms, how.end_ms, how.verify_ms,
                     rpc::ms_between(t1, t2), rpc::ms_between(t2, Clock::now()));
        count_received("cache", size);
        count_segment(v1::SEGMENT_SOURCE_CACHE);
        fetch_costs_.observe_fetch(size, d.fetch_ms);
        if (kept.any()) entry.reset();  // spliced resident or staged; the host form is not needed any more
        p->fill(slot, entry, v1::SEGMENT_SOURCE_CACHE, "", 0, size, "", std::move(kept.resident), "", d,
                std::move(kept.block));
        return;
      }
    } catch (const engine::EntryError& e) {  // while parsing (the stream was cut there), or after
      cache_entries_refused_counter().inc();
      why += fmt::format("cache entry corrupt ({}): dropped from the cache", e.what());
      spdlog::error("[req {}] segment {} ({}): {}", p->id, slot, rpc::digest_hex(digest), why);
      try {  // the entry read, not one put since
        if (how.has_info) {
          d_.cache.erase_read(digest, how.checksum, how.mac, /*corrupt=*/false);
        } else {
          d_.cache.erase(digest);
        }
      } catch (const std::exception& ex) {
        spdlog::warn("[req {}] could not drop corrupt entry {}: {}", p->id, rpc::digest_hex(digest), ex.what());
      }
    } catch (const engine::ResourceExhausted& e) {
      why += fmt::format("fetched from the cache, but it could not be made resident ({})", e.what());
      spdlog::warn("[req {}] segment {}: {}", p->id, slot, why);
    }
  } catch (const rpc::RpcError& e) {
    if (e.code() == grpc::StatusCode::DATA_LOSS) {
      // (The error says who dropped it: the cache, or this worker's Delete of a mapped entry, and whether that held.)
      why += fmt::format("cache entry failed its integrity check ({})", e.what());
    } else if (e.code() == grpc::StatusCode::CANCELLED) {
      return;  // the request is going away
    } else {
      why += fmt::format("segment cache unreachable ({})", e.what());
    }
    spdlog::warn("[req {}] segment {}: {}", p->id, slot, why);
  }
  build_locally(p, slot, why + std::string(kPrefilledHere));
}

void CombineService::fetch_or_fail(const std::shared_ptr<Pending>& p, size_t slot,
                                   const grpc::ServerContextBase* ctx) {
  try {
    fetch_warm(p, slot, ctx);
  } catch (const std::exception& e) {  // never out of the thread (std::terminate): the segment is computed
    try {
      build_locally(p, slot,
                    fmt::format("fetching it failed ({}){}", rpc::untrusted(e.what()), kPrefilledHere));
    } catch (const std::exception& again) {  // the request fails with the reason
      std::lock_guard<std::mutex> lock(p->mu);
      if (p->failure.empty()) {
        p->failure = fmt::format("segment {}: fetching it failed ({}), and so did computing it ({})", slot,
                                 rpc::untrusted(e.what()), rpc::untrusted(again.what()));
        p->failure_code = grpc::StatusCode::INTERNAL;
      }
      p->cv.notify_all();
    }
  }
}

void CombineService::rebuild_cache_only(const std::shared_ptr<Pending>& p, const v1::CombineRequest& req,
                                        std::vector<size_t>& warm,
                                        std::vector<std::pair<size_t, std::string>>& local) {
  if (opt_.cache_fetch_policy != CacheFetchPolicy::Auto || !d_.cache.enabled() || warm.empty()) return;
  // The refresh's tail (hypic mode) is recomputed in context by the splice: a tail segment's entry is fetched as
  // before (building it would put on the critical path the work that WHOLE keeps off it).
  const size_t n = p->slots.size();
  const size_t tail_from = p->mode == engine::SpliceMode::Hypic && req.refresh_tail() > 0
                               ? std::max<size_t>(1, n - std::min<size_t>(n, size_t(req.refresh_tail())))
                               : n;
  std::vector<FetchCandidate> candidates;  // WARM slots this worker neither holds nor makes: the cache's alone
  for (size_t i : warm) {
    const Slot& s = p->slots[i];  // digest and ids are immutable after registration
    if (i >= tail_from || d_.memory_tier.contains(s.digest) || d_.host_tier.contains(s.digest)) continue;
    {
      std::lock_guard<std::mutex> lock(local_mu_);
      if (local_builds_.contains(s.digest) || copy_in_flight_locked(s.digest)) continue;
    }
    const auto tokens = int64_t(s.ids.size());
    candidates.push_back({i, tokens, engine::wire_entry_bytes(backend_.config(), tokens)});
  }
  // Builds here wait behind what the engine loop has queued (other requests' builds): those tokens count as this
  // request's LOCAL ones do, in both estimates.
  int64_t local_tokens = d_.loop.queued_tokens();
  for (const auto& l : local) local_tokens += int64_t(p->slots[l.first].ids.size());
  const FetchPlan plan = fetch_costs_.plan(candidates, local_tokens, opt_.fetch_parallelism);
  if (plan.rebuild.empty()) return;
  const double mb_s = 1e-3 / *fetch_costs_.fetch_ms_per_byte(), tok_s = 1e3 / *fetch_costs_.build_ms_per_token();
  const std::string note =
      fmt::format("in the segment cache, prefilled here instead: {} of its {} cache-only segments rebuilt, their "
                  "entries estimated in {:.0f} ms against {:.0f} ms fetching them all (this worker's rates: fetch "
                  "{:.3g} MB/s per entry, build {:.3g} tokens/s; --cache-fetch-policy auto)",
                  plan.rebuild.size(), candidates.size(), plan.chosen_ms, plan.fetch_all_ms, mb_s, tok_s) +
      (plan.probe ? "; one kept fetched to time the segment cache again" : "");
  spdlog::info("[req {}] segments {}: {}", p->id, fmt::join(plan.rebuild, ","), note);
  cache_hits_rebuilt_counter().inc(double(plan.rebuild.size()));
  {
    std::lock_guard<std::mutex> lock(p->mu);
    for (size_t i : plan.rebuild) p->slots[i].in_cache = true;
  }
  for (size_t i : plan.rebuild) local.emplace_back(i, note);
  std::erase_if(warm, [&](size_t i) { return std::binary_search(plan.rebuild.begin(), plan.rebuild.end(), i); });
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

void CombineService::plan_entry_room(Pending& p) const {
  if (!backend_.device_entries()) return;
  uint64_t need = 0, largest = 0;
  size_t missing = 0;
  for (const Slot& s : p.slots) {  // (digests, ids and plans are immutable after registration)
    if (s.repeat_of || s.planned == v1::PlannedSegment::WHOLE || d_.memory_tier.contains(s.digest)) continue;
    const uint64_t bytes = backend_.entry_bytes(int64_t(s.ids.size()));
    need += bytes;
    largest = std::max(largest, bytes);
    ++missing;
  }
  if (missing == 0) return;
  // At most what is free, what waits to be freed and what the device tier could give up (other requests' entries
  // in use aside): a request needing more fails at its last allocations anyway, after evicting the tier for nothing.
  const engine::BackendMemory m = backend_.memory();
  const uint64_t free = m.device_free + m.pool_free + m.freed_pending;
  const uint64_t cap = opt_.request_entry_bytes;  // --request-entry-bytes (0: none)
  const uint64_t could = cap ? std::min(cap, free + d_.memory_tier.bytes()) : free + d_.memory_tier.bytes();
  if (need <= could) return;
  const auto gib = [](uint64_t b) { return double(b) / double(1ull << 30); };
  // Staged by the splice instead: what is free then (less the engine's margin) must hold the largest entry, and the
  // cap too.
  constexpr uint64_t kStagingMargin = engine::kStagingMarginBytes;
  if (free >= largest + kStagingMargin && (cap == 0 || cap >= largest)) {
    p.stage_blocks = true;
    p.staged_entry_bytes = need;
    staged_requests_counter().inc();
    const std::string note = fmt::format(
        "the request's {} entries need {:.2f} GiB of device memory and {:.2f} GiB could be had: kept as pinned host "
        "blocks and staged into device memory by the splice a group at a time", missing, gib(need), gib(could));
    spdlog::info("[req {}] {}", p.id, note);
    std::lock_guard<std::mutex> lock(p.mu);
    for (Slot& s : p.slots)
      if (!s.repeat_of && s.planned != v1::PlannedSegment::WHOLE) s.note = s.note.empty() ? note : s.note + "; " + note;
    return;
  }
  throw rpc::RpcError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      fmt::format("the {} entries it lacks need {:.2f} GiB of device memory, and at most {:.2f} GiB "
                                  "could be had ({:.2f} free, {:.2f} in the device tier{}); staging them by the "
                                  "splice needs {:.2f} GiB free",
                                  missing, gib(need), gib(could), gib(free), gib(d_.memory_tier.bytes()),
                                  cap ? fmt::format(", --request-entry-bytes {:.2f}", gib(cap)) : std::string(),
                                  gib(largest + kStagingMargin)));
}

CombineService::Kept CombineService::keep_received(const Pending& p, const rpc::Digest& digest,
                                                   const engine::EntryReceiver::Received& got) {
  if (!backend_.device_entries()) return {};
  auto block = got.block ? got.block : backend_.block_of_entry(*got.entry);
  if (p.stage_blocks.load()) {
    d_.copier.keep_block(digest, block);
    return {nullptr, std::move(block)};
  }
  auto resident = backend_.import_block(*block);
  d_.memory_tier.put(digest, resident);
  d_.copier.keep_block(digest, std::move(block));
  return {std::move(resident), nullptr};
}

void CombineService::gather(const std::shared_ptr<Pending>& p, const v1::CombineRequest& req,
                            grpc::ServerContext* ctx, Fetchers& fetch) {
  if (!p->uses_entries) return;  // full and prefix modes compute in context
  plan_entry_room(*p);
  std::vector<size_t>& warm = fetch.warm;
  std::vector<std::thread>& fetchers = fetch.threads;
  std::vector<std::pair<size_t, std::string>> local;
  for (size_t i = 0; i < p->slots.size(); ++i)
    if (p->slots[i].planned == v1::PlannedSegment::LOCAL) local.emplace_back(i, req.segments(int(i)).reason());
  if (answer_cold_in_full(*p, fetch, local)) return;
  for (size_t i = 0; i < p->slots.size(); ++i) {
    if (p->slots[i].planned == v1::PlannedSegment::WARM) warm.push_back(i);
    if (p->slots[i].planned == v1::PlannedSegment::WHOLE) {  // recomputed whole from its ids: nothing to wait for
      std::lock_guard<std::mutex> lock(p->mu);
      Slot& s = p->slots[i];
      s.source = v1::SEGMENT_SOURCE_IN_CONTEXT;
      s.note = "in the refresh's tail, cold: recomputed whole in context; its entry is built after the first token";
      ++p->filled;
    }
  }
  rebuild_cache_only(p, req, warm, local);
  build_locally(p, local);
  auto next = std::make_shared<std::atomic<size_t>>(0);
  const int nf = std::min<int>(opt_.fetch_parallelism, int(warm.size()));
  for (int f = 0; f < nf; ++f) {
    // The threads outlive this call (joined by run_combine's cleanup): by reference only what run_combine owns.
    fetchers.emplace_back([this, p, ctx, next, &warm = fetch.warm] {
      for (size_t k; (k = next->fetch_add(1)) < warm.size() && !p->gather_cancel->load();) {
        fetch_or_fail(p, warm[k], ctx);
      }
    });
  }
  const auto give_up = Clock::now() + opt_.gather_timeout;
  std::unique_lock<std::mutex> lock(p->mu);
  while (p->filled < p->slots.size()) {
    if (!p->failure.empty()) throw rpc::RpcError(p->failure_code, p->failure);
    if (!p->refetch.empty()) {  // failed policy rebuilds: each fetched on a thread of its own, as the warm ones
      std::vector<size_t> slots;
      slots.swap(p->refetch);
      for (size_t i : slots) {
        spdlog::warn("[req {}] segment {}: prefilling it failed ({}); fetched from the segment cache instead", p->id,
                     i, p->slots[i].build_error);
        p->slots[i].note += fmt::format("; prefilling it failed ({}): fetched from the segment cache instead",
                                        p->slots[i].build_error);
      }
      lock.unlock();
      for (size_t i : slots) {
        try {
          fetchers.emplace_back([this, p, ctx, i] { fetch_or_fail(p, i, ctx); });
        } catch (const std::system_error& e) {  // no thread to be had: the request fails with both reasons
          lock.lock();
          if (p->failure.empty()) {
            p->failure = fmt::format("segment {}: prefilling it failed ({}), and no thread could be started to fetch "
                                     "it from the segment cache instead ({})",
                                     i, p->slots[i].build_error, e.what());
            p->failure_code = p->slots[i].build_error_code;
          }
          lock.unlock();
        }
      }
      lock.lock();
      continue;
    }
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
    if (p->answered_in_full()) {  // its entries are not wanted any more: read and drop, nothing parsed or allocated
      while (reader->Read(&msg)) {
      }
      resp->set_duplicate(true);
      return grpc::Status::OK;
    }
    const Slot& slot = p->slots[h.index()];  // digest and ids are immutable after registration
    const std::string what =
        fmt::format("entry of segment {} of request {} from {}", h.index(), p->id, rpc::untrusted(h.built_by()));
    // Parsed as it arrives (no assembled copy of the bytes); used once the whole stream's size and checksum held.
    rpc::ChunkVerifier check;
    check.begin(h.total_bytes(), h.checksum(), what);
    engine::EntryReceiver parser(backend_, entry_checks(h.total_bytes(), slot.ids, p->entry_seam_width));
    // With entry keys the stream ends with the builder's MAC, checked before the entry is used.
    if (!rpc::EntryMacKeys::is_head(h.mac_head())) {
      throw rpc::invalid_argument("header.mac_head", fmt::format("{} bytes starting with {}: neither empty nor a "
                                                                 "gmac MAC's head (proto/rpc/entry_mac.h)",
                                                                 h.mac_head().size(), int(uint8_t(h.mac_head()[0]))));
    }
    rpc::EntryMacCheck mac(rpc::entry_mac_keys(), slot.digest, slot.ids, h.total_bytes(), h.mac_head());
    std::optional<std::string> mac_sent;
    std::shared_ptr<const engine::SegmentEntry> entry;
    Kept kept;
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
        delivery_mac_failures_counter().inc();
        const std::string why = mac_sent ? "its MAC does not verify under this cluster's keys"
                                         : "it carries no MAC (is --cache-key-file the same on every worker?)";
        spdlog::error("[req {}] refused {}: {}", p->id, what, why);
        throw rpc::RpcError(grpc::StatusCode::DATA_LOSS, fmt::format("{} refused: {}", what, why));
      }
      engine::EntryReceiver::Received got = parser.finish();
      rpc::verify_entry(*got.entry, slot.ids, backend_, p->entry_seam_width);
      kept = keep_received(*p, slot.digest, got);  // on this thread, not the engine loop's (device backends)
      if (!kept.any()) entry = std::move(got.entry);
    } catch (const engine::EntryError& e) {
      spdlog::error("[req {}] rejected {}: {}", p->id, what, e.what());
      throw rpc::RpcError(grpc::StatusCode::DATA_LOSS, fmt::format("{} rejected by the engine: {}", what, e.what()));
    } catch (const engine::ResourceExhausted& e) {
      throw rpc::RpcError(grpc::StatusCode::RESOURCE_EXHAUSTED, fmt::format("{}: {}", what, e.what()));
    }
    accept_delivery(*p, h, std::move(entry), std::move(kept.resident), check.total_bytes(),
                    Delivery{"grpc", rpc::ms_between(t0, Clock::now()), check.total_bytes()}, what, resp,
                    std::move(kept.block));
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
                                     v1::DeliverEntryResponse* resp, std::shared_ptr<const engine::HostBlock> block) {
  // A build the scatter worker shared with another request is reported as such.
  const bool shared = !h.shared_from().empty();
  const bool fresh = p.fill(
      h.index(), std::move(entry), shared ? v1::SEGMENT_SOURCE_SHARED_BUILD : v1::SEGMENT_SOURCE_SCATTER,
      h.built_by(), h.compute_ms(), entry_bytes, h.device(), std::move(resident),
      shared ? fmt::format("shared build: started on {} for request {}, joined by this one", h.built_by(),
                           h.shared_from())
             : std::string(),
      delivery, std::move(block));
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
  // A request whose entries are staged by its splice takes the pinned host copy (made here, on this delivery's
  // thread), and the received block's device memory goes; where no copy can be had it is spliced resident.
  std::shared_ptr<const engine::HostBlock> block;
  order.unlock();  // the transfer is over: the link's next one need not wait for the copy below
  if (p->stage_blocks.load() && !p->answered_in_full()) {
    try {
      block = backend_.copy_to_host(*dst.first);
      d_.copier.keep_block(p->slots[h.index()].digest, block);
      dst.first.reset();
    } catch (const std::exception& e) {
      spdlog::warn("[req {}] {}: no host copy for the staged splice ({}); spliced resident", p->id, what, e.what());
    }
  }
  accept_delivery(*p, h, nullptr, dst.first, h.total_bytes(),
                  Delivery{"nccl", rpc::ms_between(t0, Clock::now()), h.device_bytes()}, what, resp, std::move(block));
}

}  // namespace hypic::combine
