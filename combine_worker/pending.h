// The combine worker's state of one active request and the metrics both of its files count (internal to
// combine_worker/: service.cpp runs the request, gather.cpp fills its segments' slots).
#pragma once
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "combine_worker/service.h"
#include "engine/sampling.h"
#include "engine/segment.h"
#include "proto/rpc/metrics.h"
#include "proto/rpc/status.h"

namespace hypic::combine {

namespace v1 = hypic::v1;

// One segment of an active request.
struct Slot {
  rpc::Digest digest{};
  std::vector<int32_t> ids;
  v1::PlannedSegment::Source planned = v1::PlannedSegment::WARM;
  std::optional<size_t> repeat_of;  // planned REPEAT: filled with that segment's entry
  // Set once, at least one of the three: the host form (delivered, fetched), the form resident on the backend (built
  // here, or a memory-tier hit), or, for a request whose entries are staged by its splice (Pending::stage_blocks), the
  // pinned host block the splice copies in (delivered, fetched, or from the host tier).
  std::shared_ptr<const engine::SegmentEntry> entry;
  std::shared_ptr<const engine::ResidentEntry> resident;
  std::shared_ptr<const engine::HostBlock> block;
  bool has_entry() const { return entry || resident || block; }
  const engine::SegmentEntry* header() const {
    return resident ? &resident->header() : entry ? entry.get() : block ? &block->header() : nullptr;
  }
  v1::SegmentSource source = v1::SEGMENT_SOURCE_UNSPECIFIED;
  std::string built_by, device, note;
  double compute_ms = 0;
  uint64_t entry_bytes = 0;
  bool local_started = false;
  // The request was answered by a full prefill (in_full) and this cold segment's entry is built after the first token
  // (CombineService::splice), for later requests: --staged-cold-policy auto.
  bool build_after = false;
  bool in_cache = false;  // prefilled here although the segment cache holds it (--cache-fetch-policy): no put back
  // That prefill failed: the slot is fetched from the cache after all (gather's fallback); why the prefill failed.
  bool fetch_fallback = false;
  std::string build_error;
  grpc::StatusCode build_error_code = grpc::StatusCode::INTERNAL;
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
  // Its Combine call (set by run_combine; valid while this Pending is in CombineService::active_).
  const grpc::ServerContextBase* call = nullptr;
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
  // Policy rebuilds (Slot::in_cache) that failed, to be fetched from the segment cache instead: queued by the engine
  // loop's build callback, taken by gather's wait (which owns the request's fetch threads and its call).
  std::vector<size_t> refetch;
  std::string failure;  // a local build failed: the request cannot complete
  grpc::StatusCode failure_code = grpc::StatusCode::INTERNAL;  // what the build's error maps to
  std::shared_ptr<std::atomic<bool>> cancel = std::make_shared<std::atomic<bool>>(false);
  // The request's entries are no longer wanted (it ended, or it is answered by a full prefill instead: in_full): no
  // build or fetch starts for it, its unshared builds stop, and fill() keeps nothing. The pointer is immutable.
  std::shared_ptr<std::atomic<bool>> gather_cancel = std::make_shared<std::atomic<bool>>(false);
  // Under mu: answered by a full prefill (CombineService::switch_to_full: answer_in_full, answer_cold_in_full).
  bool in_full = false;
  // Its entries do not all fit in device memory at once (CombineService::plan_entry_room, before any fetch or build
  // starts): those that arrive as bytes (deliveries over gRPC, cache fetches, the host tier) are kept as pinned host
  // blocks and staged by the splice a group at a time (engine::PlanSegment::block) instead of made resident.
  std::atomic<bool> stage_blocks{false};
  // With stage_blocks: the bytes of the entries it lacks (plan_entry_room's count, which answer_cold_in_full reuses).
  uint64_t staged_entry_bytes = 0;

  // Fills a slot, and the slots that repeat it with the same entry; false if it was already filled (a duplicate
  // delivery or a late local build). `note` is added to the slot's note.
  bool fill(size_t i, std::shared_ptr<const engine::SegmentEntry> entry, v1::SegmentSource source,
            std::string built_by, double compute_ms, uint64_t bytes, std::string device = {},
            std::shared_ptr<const engine::ResidentEntry> resident = nullptr, const std::string& note = {},
            const Delivery& delivery = {}, std::shared_ptr<const engine::HostBlock> block = nullptr) {
    {
      std::lock_guard<std::mutex> lock(mu);
      Slot& s = slots[i];
      if (s.has_entry() || in_full) return false;
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
      s.block = std::move(block);
      if (!note.empty()) s.note = s.note.empty() ? note : s.note + "; " + note;
      ++filled;
      for (size_t j : repeats[i]) {
        Slot& r = slots[j];
        if (r.has_entry()) continue;
        r.entry = s.entry;
        r.resident = s.resident;
        r.block = s.block;
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
  bool answered_in_full() {
    std::lock_guard<std::mutex> lock(mu);
    return in_full;
  }
  void add_note(size_t i, const std::string& note) {
    std::lock_guard<std::mutex> lock(mu);
    slots[i].note = slots[i].note.empty() ? note : slots[i].note + "; " + note;
  }
};

/// hypic:entry_bytes_received_total{from}: entry bytes this combine worker received from scatter workers or the cache.
inline void count_received(const char* from, size_t bytes) {
  rpc::MetricsRegistry::global()
      .counter("hypic:entry_bytes_received_total", "Segment entry bytes received, by sender", {{"from", from}})
      .inc(double(bytes));
}
/// hypic:combine_full_fallbacks_total: requests of an entry mode answered by a full prefill instead, their entries not
/// fitting in device memory.
inline rpc::Counter& full_fallbacks_counter() {
  static auto& c = rpc::MetricsRegistry::global().counter(
      "hypic:combine_full_fallbacks_total",
      "Requests of an entry mode (hypic, naive, transition) answered by a full prefill instead because their entries "
      "did not fit in device memory");
  return c;
}
/// hypic:combine_staged_cold_in_full_total: staged requests answered by a full prefill instead (--staged-cold-policy
/// auto), a subset of hypic:combine_staged_requests_total.
inline rpc::Counter& staged_cold_in_full_counter() {
  static auto& c = rpc::MetricsRegistry::global().counter(
      "hypic:combine_staged_cold_in_full_total",
      "Staged requests with cold segments to prefill here answered by a full prefill instead, where the measured rates "
      "said that is sooner (--staged-cold-policy auto; counted in hypic:combine_staged_requests_total too); their "
      "entries were built after the first token");
  return c;
}
/// hypic:combine_staged_requests_total: requests whose entries were to be staged by the splice from pinned host blocks.
inline rpc::Counter& staged_requests_counter() {
  static auto& c = rpc::MetricsRegistry::global().counter(
      "hypic:combine_staged_requests_total",
      "Requests of an entry mode whose entries did not all fit in device memory at once: kept as pinned host blocks "
      "and staged into device memory by the splice a group at a time (or answered in full instead: "
      "hypic:combine_staged_cold_in_full_total)");
  return c;
}
/// hypic:combine_builds_joined_total: segments that joined a local build of the same segment for another request.
inline rpc::Counter& builds_joined_counter() {
  static auto& c = rpc::MetricsRegistry::global().counter(
      "hypic:combine_builds_joined_total",
      "Segments this combine worker was to prefill that joined its build of the same segment for another request "
      "(one build for both)");
  return c;
}
/// hypic:cache_hits_rebuilt_total: cache-only segments the fetch policy prefilled here instead.
inline rpc::Counter& cache_hits_rebuilt_counter() {
  static auto& c = rpc::MetricsRegistry::global().counter(
      "hypic:cache_hits_rebuilt_total",
      "Segments the segment cache held that this combine worker prefilled again because its measured fetch and build "
      "rates said their entries would arrive sooner (--cache-fetch-policy auto)");
  return c;
}
/// hypic:cache_entries_refused_total: cache entries that did not parse or fit (MAC failures counted apart).
inline rpc::Counter& cache_entries_refused_counter() {
  static auto& c = rpc::MetricsRegistry::global().counter(
      "hypic:cache_entries_refused_total",
      "Segment entries read from the cache that did not parse or did not fit this model, these token ids or the "
      "size of their stream (corrupt, forged or foreign): dropped from the cache and recomputed (MAC failures: "
      "hypic:entry_mac_failures_total)");
  return c;
}
/// hypic:delivery_mac_failures_total: scatter workers' gRPC deliveries refused for their MAC.
inline rpc::Counter& delivery_mac_failures_counter() {
  static auto& c = rpc::MetricsRegistry::global().counter(
      "hypic:delivery_mac_failures_total",
      "Segment entries delivered by scatter workers over gRPC whose MAC was missing or did not verify: refused "
      "(DATA_LOSS)");
  return c;
}
/// hypic:combine_segments_total{source}: segments this combine worker used, by where the entry came from.
inline void count_segment(v1::SegmentSource source) {
  rpc::MetricsRegistry::global()
      .counter("hypic:combine_segments_total", "Segment entries used by this combine worker, by source",
               {{"source", std::string(rpc::segment_source_name(source))}})
      .inc();
}

}  // namespace hypic::combine
