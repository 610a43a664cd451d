#include "combine_worker/service.h"

#include <atomic>
#include <condition_variable>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "engine/backend.h"
#include "engine/sampling.h"
#include "engine/segment.h"
#include "proto/rpc/chunks.h"
#include "proto/rpc/status.h"

namespace hypic::combine {

namespace v1 = hypic::v1;
using Clock = std::chrono::steady_clock;

// One segment of an active request.
struct Slot {
  rpc::Digest digest{};
  std::vector<int32_t> ids;
  v1::PlannedSegment::Source planned = v1::PlannedSegment::WARM;
  std::shared_ptr<const engine::SegmentEntry> entry;  // set once
  v1::SegmentSource source = v1::SEGMENT_SOURCE_UNSPECIFIED;
  std::string built_by, note;
  double compute_ms = 0;
  uint64_t entry_bytes = 0;
  bool local_started = false;
};

struct CombineService::Pending {
  std::string id;
  int entry_seam_width = 0;
  bool cache_segments = true;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Slot> slots;
  size_t filled = 0;
  std::string failure;  // a local build failed: the request cannot complete
  std::shared_ptr<std::atomic<bool>> cancel = std::make_shared<std::atomic<bool>>(false);

  // Fills a slot; false if it was already filled (a duplicate delivery or a late local build).
  bool fill(size_t i, std::shared_ptr<const engine::SegmentEntry> entry, v1::SegmentSource source,
            std::string built_by, double compute_ms, uint64_t bytes, std::string note = {}) {
    {
      std::lock_guard<std::mutex> lock(mu);
      Slot& s = slots[i];
      if (s.entry) return false;
      s.entry = std::move(entry);
      s.source = source;
      s.built_by = std::move(built_by);
      s.compute_ms = compute_ms;
      s.entry_bytes = bytes;
      if (!note.empty()) s.note = s.note.empty() ? std::move(note) : s.note + "; " + note;
      ++filled;
    }
    cv.notify_all();
    return true;
  }
  void add_note(size_t i, const std::string& note) {
    std::lock_guard<std::mutex> lock(mu);
    slots[i].note = slots[i].note.empty() ? note : slots[i].note + "; " + note;
  }
};

namespace {
// Releases a compute slot taken with ComputeSlots::acquire when the scope ends (also on exceptions).
// (No-op without a limit.)
struct SlotGuard {
  explicit SlotGuard(ComputeSlots* s) : slots(s) {}
  ~SlotGuard() {
    if (slots) slots->release();
  }
  ComputeSlots* slots;
};
}  // namespace

ComputeSlots::ComputeSlots(int slots) : slots_(std::max(1, slots)), free_(std::max(1, slots)) {}

bool ComputeSlots::acquire(const std::function<bool()>& cancelled) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  while (!(serving_ == ticket && free_ > 0)) {
    if (cancelled && cancelled()) {
      // Give up the place in line: later tickets must not wait for this one.
      if (serving_ == ticket) {
        ++serving_;
      } else {
        abandoned_.insert(ticket);
      }
      skip_abandoned();
      cv_.notify_all();
      return false;
    }
    cv_.wait_for(lock, std::chrono::milliseconds(50));
  }
  --free_;
  ++serving_;
  skip_abandoned();
  cv_.notify_all();
  return true;
}

void ComputeSlots::skip_abandoned() {
  while (abandoned_.erase(serving_) > 0) ++serving_;
}

void ComputeSlots::release() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++free_;
  }
  cv_.notify_all();
}

CombineService::CombineService(CombineDeps deps, CombineOptions options)
    : d_(deps), opt_(options),
      fingerprint_(engine::model_fingerprint(deps.model.config(), engine::backend_numerics(engine::BackendKind::Cpu))),
      geometry_(engine::EntryGeometry::of(deps.model.config())) {
  if (opt_.max_concurrent_compute > 0) compute_ = std::make_unique<ComputeSlots>(opt_.max_concurrent_compute);
}

CombineService::~CombineService() = default;

std::shared_ptr<CombineService::Pending> CombineService::find(const std::string& request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = active_.find(request_id);
  if (it == active_.end()) {
    throw rpc::RpcError(grpc::StatusCode::NOT_FOUND,
                        fmt::format("request {} is not active on this combine worker (finished, cancelled or never "
                                    "started)",
                                    request_id));
  }
  return it->second;
}

void CombineService::build_locally(const std::shared_ptr<Pending>& p, size_t slot, std::string note) {
  std::vector<int32_t> ids;
  {
    std::lock_guard<std::mutex> lock(p->mu);
    Slot& s = p->slots[slot];
    if (s.entry || s.local_started) return;
    s.local_started = true;
    ids = s.ids;
    if (!note.empty()) s.note = s.note.empty() ? note : s.note + "; " + note;
  }
  d_.builder.submit(std::move(ids), p->entry_seam_width, p->cancel, [this, p, slot](worker::BuildResult r) {
    if (r.cancelled) return;
    if (!r.error.empty()) {
      spdlog::error("[req {}] segment {}: local prefill failed: {}", p->id, slot, r.error);
      {
        std::lock_guard<std::mutex> lock(p->mu);
        p->failure = fmt::format("segment {}: prefill failed: {}", slot, r.error);
      }
      p->cv.notify_all();
      return;
    }
    const rpc::Digest digest = p->slots[slot].digest;  // immutable after registration
    d_.memory_tier.put(digest, r.entry);
    if (p->cache_segments) d_.putter.enqueue(digest, r.entry->token_ids, r.bytes, p->id);
    p->fill(slot, r.entry, v1::SEGMENT_SOURCE_COMBINE_COMPUTED, address_, r.compute_ms, r.bytes->size());
  });
}

void CombineService::fetch_warm(const std::shared_ptr<Pending>& p, size_t slot, const grpc::ServerContextBase* ctx) {
  const rpc::Digest digest = p->slots[slot].digest;
  const std::vector<int32_t>& ids = p->slots[slot].ids;
  if (auto e = d_.memory_tier.get(digest, ids)) {
    p->fill(slot, e, v1::SEGMENT_SOURCE_COMBINE_MEMORY, "", 0, e->byte_size());
    return;
  }
  std::string why;
  try {
    auto bytes = d_.cache.get(cache::CacheKey{digest, ids}, ctx);
    if (!bytes) {
      why = "not in the segment cache any more (evicted after the lookup)";
    } else {
      try {
        auto entry = std::make_shared<const engine::SegmentEntry>(engine::deserialize_entry(*bytes));
        if (entry->token_ids != ids) throw engine::EntryError("its token ids differ from the segment's");
        entry->check_compatible(fingerprint_, geometry_, p->entry_seam_width, engine::backend_numerics(engine::BackendKind::Cpu));
        d_.memory_tier.put(digest, entry);
        p->fill(slot, entry, v1::SEGMENT_SOURCE_CACHE, "", 0, bytes->size());
        return;
      } catch (const engine::EntryError& e) {
        why = fmt::format("cache entry corrupt ({}): dropped from the cache", e.what());
        spdlog::error("[req {}] segment {} ({}): {}", p->id, slot, rpc::digest_hex(digest), why);
        try {
          d_.cache.erase(digest);
        } catch (const std::exception& ex) {
          spdlog::warn("[req {}] could not drop corrupt entry {}: {}", p->id, rpc::digest_hex(digest), ex.what());
        }
      }
    }
  } catch (const rpc::RpcError& e) {
    if (e.code() == grpc::StatusCode::DATA_LOSS) {
      why = fmt::format("cache entry failed its integrity check and was dropped by the cache ({})", e.what());
    } else if (e.code() == grpc::StatusCode::CANCELLED) {
      return;  // the request is going away
    } else {
      why = fmt::format("segment cache unreachable ({})", e.what());
    }
    spdlog::warn("[req {}] segment {}: {}", p->id, slot, why);
  }
  build_locally(p, slot, why + "; prefilled by the combine worker");
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

void check_ids(std::span<const int32_t> ids, const std::string& field, int64_t vocab) {
  if (ids.empty()) throw rpc::invalid_argument(field, "must not be empty");
  for (size_t j = 0; j < ids.size(); ++j) {
    if (ids[j] < 0 || ids[j] >= vocab) {
      throw rpc::invalid_argument(fmt::format("{}[{}]", field, j),
                                  fmt::format("{} is outside the vocabulary [0, {})", ids[j], vocab));
    }
  }
}
}  // namespace

grpc::Status CombineService::Combine(grpc::ServerContext* ctx, const v1::CombineRequest* req,
                                     grpc::ServerWriter<v1::CombineEvent>* writer) {
  const grpc::Status st = run_combine(ctx, req, writer);
  if (!st.ok()) spdlog::warn("[req {}] combine ended: {}", req->request_id(), rpc::describe(st));
  return st;
}

grpc::Status CombineService::run_combine(grpc::ServerContext* ctx, const v1::CombineRequest* req,
                                         grpc::ServerWriter<v1::CombineEvent>* writer) {
  return rpc::handle_errors([&]() -> grpc::Status {
    auto life_call = d_.life.enter();
    const auto t_start = Clock::now();
    rpc::validate_request_id(req->request_id());
    if (req->request_id().empty()) throw rpc::invalid_argument("request_id", "must not be empty");
    if (req->segments().empty()) throw rpc::invalid_argument("segments", "at least one segment is required");
    const int64_t vocab = d_.model.config().vocab_size;
    const std::vector<int32_t> query(req->query_ids().begin(), req->query_ids().end());
    check_ids(query, "query_ids", vocab);
    engine::SpliceMode mode;
    try {
      mode = engine::parse_splice_mode(req->mode().empty() ? "hypic" : req->mode());
    } catch (const std::invalid_argument& e) {
      throw rpc::invalid_argument("mode", e.what());
    }
    if (req->seam_width() < 0) throw rpc::invalid_argument("seam_width", fmt::format("must be >= 0, got {}", req->seam_width()));
    if (!req->sampling().has_max_tokens() || req->sampling().max_tokens() < 1) {
      throw rpc::invalid_argument("sampling.max_tokens", "must be set and >= 1");
    }
    const engine::SamplingConfig scfg = sampling_config(req->sampling());
    std::vector<std::string> stops(req->sampling().stop().begin(), req->sampling().stop().end());
    engine::StopStringMatcher stop_matcher(stops);  // validates (non-empty strings)
    const bool uses_entries = mode != engine::SpliceMode::Full && mode != engine::SpliceMode::Prefix;

    auto p = std::make_shared<Pending>();
    p->id = req->request_id();
    p->entry_seam_width = mode == engine::SpliceMode::Hypic ? req->seam_width() : 0;
    p->cache_segments = req->cache_segments();
    p->slots.resize(size_t(req->segments_size()));
    for (int i = 0; i < req->segments_size(); ++i) {
      const auto& ps = req->segments(i);
      const std::string field = fmt::format("segments[{}]", i);
      if (ps.index() != uint32_t(i)) {
        throw rpc::invalid_argument(field + ".index", fmt::format("segments must be listed in prompt order: expected "
                                                                  "{}, got {}",
                                                                  i, ps.index()));
      }
      Slot& s = p->slots[size_t(i)];
      s.digest = rpc::parse_digest(ps.key().digest(), field + ".key.digest");
      s.ids.assign(ps.key().token_ids().begin(), ps.key().token_ids().end());
      check_ids(s.ids, field + ".key.token_ids", vocab);
      s.planned = ps.source();
      if (uses_entries && engine::segment_digest(fingerprint_, engine::kSegmentFormatVersion, p->entry_seam_width,
                                                 s.ids) != s.digest) {
        throw rpc::invalid_argument(field + ".key.digest",
                                    fmt::format("does not match the token ids under this worker's model (fingerprint "
                                                "{}, format {}, w {}): do router and worker serve the same model?",
                                                fingerprint_, engine::kSegmentFormatVersion, p->entry_seam_width));
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!active_.emplace(p->id, p).second) {
        throw rpc::RpcError(grpc::StatusCode::ALREADY_EXISTS,
                            fmt::format("request_id: {} is already active on this combine worker", p->id));
      }
    }
    std::vector<size_t> warm;  // declared before the fetchers that read it (joined in cleanup)
    std::vector<std::thread> fetchers;
    auto cleanup = [&] {
      p->cancel->store(true);
      for (auto& t : fetchers) t.join();
      std::lock_guard<std::mutex> lock(mu_);
      active_.erase(p->id);
    };
    struct Guard {
      std::function<void()> f;
      ~Guard() { f(); }
    } guard{cleanup};

    auto send = [&](const v1::CombineEvent& ev) {
      if (!writer->Write(ev)) throw rpc::RpcError(grpc::StatusCode::CANCELLED, "the router went away");
    };
    v1::CombineEvent ev;
    ev.mutable_started();
    send(ev);
    spdlog::info("[req {}] combine: {} segments, {} query tokens, mode {}", p->id, p->slots.size(), query.size(),
                 engine::splice_mode_name(mode));

    // ---- gather ----
    if (uses_entries) {
      for (size_t i = 0; i < p->slots.size(); ++i) {
        if (p->slots[i].planned == v1::PlannedSegment::LOCAL) build_locally(p, i, req->segments(int(i)).reason());
        if (p->slots[i].planned == v1::PlannedSegment::WARM) warm.push_back(i);
      }
      auto next = std::make_shared<std::atomic<size_t>>(0);
      const int nf = std::min<int>(opt_.fetch_parallelism, int(warm.size()));
      for (int f = 0; f < nf; ++f) {
        fetchers.emplace_back([&, next] {
          for (size_t k; (k = next->fetch_add(1)) < warm.size() && !p->cancel->load();) fetch_warm(p, warm[k], ctx);
        });
      }
      const auto give_up = Clock::now() + opt_.gather_timeout;
      std::unique_lock<std::mutex> lock(p->mu);
      while (p->filled < p->slots.size()) {
        if (!p->failure.empty()) throw rpc::RpcError(grpc::StatusCode::INTERNAL, p->failure);
        if (ctx->IsCancelled()) throw rpc::RpcError(grpc::StatusCode::CANCELLED, "request cancelled by the router");
        if (Clock::now() > give_up) {
          std::vector<size_t> missing;
          for (size_t i = 0; i < p->slots.size(); ++i)
            if (!p->slots[i].entry) missing.push_back(i);
          throw rpc::RpcError(grpc::StatusCode::DEADLINE_EXCEEDED,
                              fmt::format("segments {} did not arrive within {} s (--gather-timeout-seconds)",
                                          fmt::join(missing, ","), opt_.gather_timeout.count()));
        }
        p->cv.wait_for(lock, std::chrono::milliseconds(50));
      }
    }
    const double gather_ms = rpc::ms_between(t_start, Clock::now());
    ev.mutable_entries_ready();
    send(ev);

    // ---- splice ----
    engine::SpliceRequest sreq;
    sreq.mode = mode;
    sreq.seam_width = req->seam_width();
    sreq.query = query;
    sreq.prefix_cache = &d_.prefix_cache;
    for (auto& s : p->slots) sreq.segments.push_back({s.ids, s.entry});
    const auto t_splice = Clock::now();
    engine::SpliceResult sres;
    const auto cancelled = [ctx] { return ctx->IsCancelled(); };
    {
      if (compute_ && !compute_->acquire(cancelled))
        throw rpc::RpcError(grpc::StatusCode::CANCELLED, "request cancelled by the router");
      SlotGuard slot(compute_.get());
      try {
        sres = engine::splice(d_.model, sreq);
      } catch (const std::exception& e) {
        throw rpc::RpcError(grpc::StatusCode::INTERNAL, fmt::format("splice failed: {}", e.what()));
      }
    }
    const double splice_ms = rpc::ms_between(t_splice, Clock::now());
    ev.mutable_splice_done()->set_splice_ms(splice_ms);
    send(ev);

    // ---- decode ----
    engine::Sampler sampler(scfg);
    engine::IncrementalDecoder detok(d_.tokenizer, /*skip_special_tokens=*/true);
    std::vector<float> logits = std::move(sres.logits);
    int64_t position = sres.num_tokens;
    const int max_tokens = req->sampling().max_tokens();
    v1::FinishReason finish = v1::FINISH_REASON_LENGTH;
    uint32_t produced = 0;
    const auto t_first = Clock::now();
    for (int step = 0; step < max_tokens; ++step) {
      if (ctx->IsCancelled()) throw rpc::RpcError(grpc::StatusCode::CANCELLED, "request cancelled by the router");
      const int32_t tok = sampler.sample(logits);
      ++produced;
      v1::CombineEvent dev;
      dev.mutable_delta()->add_token_ids(tok);
      if (sampler.is_stop_token(tok)) {
        finish = v1::FINISH_REASON_STOP_TOKEN;
        send(dev);
        break;
      }
      // Ids of the model's padded vocabulary beyond the tokenizer's (e.g. 151669..151935 for Qwen3)
      // have no text: they are returned as ids only.
      const bool has_text = size_t(tok) < d_.tokenizer.vocab_size();
      const auto r = stop_matcher.push(has_text ? detok.push(tok) : std::string());
      dev.mutable_delta()->set_text(r.text);
      send(dev);
      if (r.stopped) {
        finish = v1::FINISH_REASON_STOP_STRING;
        break;
      }
      if (step + 1 < max_tokens) {
        if (compute_ && !compute_->acquire(cancelled))
          throw rpc::RpcError(grpc::StatusCode::CANCELLED, "request cancelled by the router");
        SlotGuard slot(compute_.get());
        logits = d_.model.decode(sres.state, tok, position++);
      }
    }
    if (finish != v1::FINISH_REASON_STOP_STRING) {
      auto r = stop_matcher.push(detok.flush());
      std::string tail = r.text + (r.stopped ? std::string() : stop_matcher.flush());
      if (r.stopped) finish = v1::FINISH_REASON_STOP_STRING;
      if (!tail.empty()) {
        v1::CombineEvent dev;
        dev.mutable_delta()->set_text(tail);
        send(dev);
      }
    }
    const double decode_ms = rpc::ms_between(t_first, Clock::now());

    // ---- report ----
    v1::CombineEvent rev;
    auto* rep = rev.mutable_report();
    rep->set_finish_reason(finish);
    rep->set_completion_tokens(produced);
    rep->set_gather_ms(gather_ms);
    rep->set_splice_ms(splice_ms);
    rep->set_decode_ms(decode_ms);
    {
      std::lock_guard<std::mutex> lock(p->mu);
      for (size_t i = 0; i < p->slots.size(); ++i) {
        const Slot& s = p->slots[i];
        auto* sr = rep->add_segments();
        sr->set_index(uint32_t(i));
        sr->set_num_tokens(uint32_t(s.ids.size()));
        sr->set_digest_hex(rpc::digest_hex(s.digest));
        if (!uses_entries) {
          const bool reused = mode == engine::SpliceMode::Prefix && int(i) < sres.prefix_segments_reused;
          sr->set_source(reused ? v1::SEGMENT_SOURCE_COMBINE_MEMORY : v1::SEGMENT_SOURCE_IN_CONTEXT);
          if (reused) sr->set_note("restored from a prefix checkpoint");
          continue;
        }
        sr->set_source(s.source);
        sr->set_built_by(s.built_by);
        sr->set_compute_ms(s.compute_ms);
        sr->set_entry_bytes(s.entry_bytes);
        sr->set_note(s.note);
      }
    }
    send(rev);
    spdlog::info("[req {}] done: {} tokens, gather {:.1f} ms, splice {:.1f} ms, decode {:.1f} ms", p->id, produced,
                 gather_ms, splice_ms, decode_ms);
    return grpc::Status::OK;
  });
}

grpc::Status CombineService::DeliverEntry(grpc::ServerContext*, grpc::ServerReader<v1::EntryChunk>* reader,
                                          v1::DeliverEntryResponse* resp) {
  return rpc::handle_errors([&]() -> grpc::Status {
    // Not refused while draining: it serves a request already in flight (unknown ids get NOT_FOUND).
    v1::EntryChunk msg;
    if (!reader->Read(&msg) || !msg.has_header()) {
      throw rpc::invalid_argument("header", "the first message of a delivery must be its header");
    }
    const v1::EntryHeader h = msg.header();
    auto p = find(h.request_id());
    if (h.index() >= p->slots.size()) {
      throw rpc::invalid_argument("header.index", fmt::format("{} but the request has {} segments", h.index(),
                                                              p->slots.size()));
    }
    Slot& slot = p->slots[h.index()];  // digest and ids are immutable after registration
    if (rpc::parse_digest(h.digest(), "header.digest") != slot.digest) {
      throw rpc::invalid_argument("header.digest", fmt::format("segment {} of request {} has digest {}", h.index(),
                                                               p->id, rpc::digest_hex(slot.digest)));
    }
    const std::string what = fmt::format("entry of segment {} of request {} from {}", h.index(), p->id, h.built_by());
    rpc::ChunkAssembler assembler;
    assembler.begin(h.total_bytes(), h.checksum(), what);
    while (reader->Read(&msg)) {
      if (msg.has_header()) throw rpc::invalid_argument("header", "a delivery carries exactly one header");
      assembler.append(msg.data());
    }
    const std::string bytes = assembler.finish();
    std::shared_ptr<const engine::SegmentEntry> entry;
    try {
      entry = std::make_shared<const engine::SegmentEntry>(engine::deserialize_entry(bytes));
      if (entry->token_ids != slot.ids) throw engine::EntryError("its token ids differ from the segment's");
      entry->check_compatible(fingerprint_, geometry_, p->entry_seam_width, engine::backend_numerics(engine::BackendKind::Cpu));
    } catch (const engine::EntryError& e) {
      spdlog::error("[req {}] rejected {}: {}", p->id, what, e.what());
      throw rpc::RpcError(grpc::StatusCode::DATA_LOSS, fmt::format("{} rejected by the engine: {}", what, e.what()));
    }
    d_.memory_tier.put(slot.digest, entry);
    const bool fresh = p->fill(h.index(), entry, v1::SEGMENT_SOURCE_SCATTER, h.built_by(), h.compute_ms(), bytes.size());
    resp->set_duplicate(!fresh);
    spdlog::debug("[req {}] received {} ({} bytes){}", p->id, what, bytes.size(), fresh ? "" : ", duplicate dropped");
    return grpc::Status::OK;
  });
}

grpc::Status CombineService::ComputeLocally(grpc::ServerContext*, const v1::ComputeLocallyRequest* req,
                                            v1::ComputeLocallyResponse*) {
  return rpc::handle_errors([&]() -> grpc::Status {
    // Not refused while draining: it serves a request already in flight (unknown ids get NOT_FOUND).
    auto p = find(req->request_id());
    for (int j = 0; j < req->indices_size(); ++j) {
      if (req->indices(j) >= p->slots.size()) {
        throw rpc::invalid_argument(fmt::format("indices[{}]", j), fmt::format("{} but the request has {} segments",
                                                                                req->indices(j), p->slots.size()));
      }
    }
    for (uint32_t i : req->indices()) {
      spdlog::info("[req {}] prefilling segment {} here: {}", p->id, i, req->reason());
      build_locally(p, i, req->reason());
    }
    return grpc::Status::OK;
  });
}

grpc::Status CombineService::GetWorkerInfo(grpc::ServerContext*, const v1::WorkerInfoRequest*, v1::WorkerInfo* resp) {
  resp->set_role("combine");
  resp->set_model_fingerprint(fingerprint_);
  resp->set_entry_format_version(engine::kSegmentFormatVersion);
  resp->set_address(address_);
  resp->set_compute_threads(uint32_t(d_.builder.threads()));
  resp->set_queued_tokens(d_.builder.queued_tokens());
  resp->set_active_requests(uint32_t(d_.life.active()));
  resp->set_numerics(engine::backend_numerics(engine::BackendKind::Cpu));
  resp->set_device("cpu");
  return grpc::Status::OK;
}

}  // namespace hypic::combine
