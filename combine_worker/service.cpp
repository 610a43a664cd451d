#include "combine_worker/service.h"

#include "combine_worker/budgets.h"

#include "combine_worker/pending.h"

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

#include "engine/checkpoint/weights.h"
#include "engine/sampling.h"
#include "engine/segment.h"
#include "proto/engine_rpc/checks.h"
#include "proto/rpc/chunks.h"
#include "proto/rpc/entry_mac.h"
#include "proto/rpc/status.h"

namespace hypic::combine {

namespace v1 = hypic::v1;
using Clock = std::chrono::steady_clock;

CombineService::CombineService(CombineDeps deps, CombineOptions options)
    : d_(deps),
      opt_(options),
      backend_(deps.loop.backend()),
      device_(backend_.device().name()),
      accepts_({backend_.device().index, options.nccl_join_timeout,
                std::chrono::duration_cast<std::chrono::milliseconds>(options.nccl_idle_timeout),
                options.nccl_max_links}) {
  fetch_costs_.set_priors(opt_.fetch_prior_mb_per_s, opt_.build_prior_tokens_per_s, opt_.staged_prior_gb_per_s);
  // Prometheus metrics (proto/rpc/metrics.h), read at each scrape; this service lives until the server stopped.
  auto& reg = rpc::MetricsRegistry::global();
  builds_joined_counter();  // (registered now: scraped as 0 before the first one)
  cache_hits_rebuilt_counter();
  cache_entries_refused_counter();
  delivery_mac_failures_counter();
  full_fallbacks_counter();
  staged_requests_counter();
  staged_cold_in_full_counter();
  if (backend_.device_entries()) {
    using Part = size_t engine::BackendMemory::*;
    auto& backend = backend_;
    for (const auto& [part, field] : {std::pair<const char*, Part>{"weights", &engine::BackendMemory::weights},
                                      {"kv_pool", &engine::BackendMemory::kv_budget},
                                      {"kv_used", &engine::BackendMemory::kv_used},
                                      {"workspace", &engine::BackendMemory::workspace},
                                      {"entries", &engine::BackendMemory::entries_used},
                                      {"freed_pending", &engine::BackendMemory::freed_pending},
                                      {"pool_free", &engine::BackendMemory::pool_free},
                                      {"free", &engine::BackendMemory::device_free},
                                      {"total", &engine::BackendMemory::device_total}}) {
      reg.gauge_fn("hypic:device_memory_bytes",
                   "The backend's device memory by part (kv_used is part of kv_pool; entries: alive, with prefix "
                   "checkpoints)",
                   [&backend, f = field] { return double(backend.memory().*f); }, {{"part", part}});
    }
  }
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
  reg.gauge_fn("hypic:combine_background_build_tokens",
               "Tokens of entry builds queued in the background (built after a request's first token, for later "
               "requests; they wait while other work is queued)",
               [&loop] { return double(loop.background_tokens()); });
  reg.gauge_fn("hypic:combine_local_builds", "This worker's own entry builds: in flight, or built with their host "
               "copy being made", [this] { return double(local_build_counts().in_flight); }, {{"state", "building"}});
  reg.gauge_fn("hypic:combine_local_builds", "This worker's own entry builds: in flight, or built with their host "
               "copy being made", [this] { return double(local_build_counts().copies_in_flight); },
               {{"state", "copying"}});
  reg.counter_fn("hypic:decode_iterations_total", "Batched decode steps run",
                 [&loop] { return double(loop.decode_iterations()); });
  reg.counter_fn("hypic:decode_sequence_steps_total", "Sequence-steps decoded (mean batch = this / iterations)",
                 [&loop] { return double(loop.decode_steps()); });
}

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

engine::SpliceInfo CombineService::splice(const std::shared_ptr<Pending>& p, const v1::CombineRequest& req,
                                          grpc::ServerContext* ctx, std::shared_ptr<GenerationEvents>& events) {
  engine::GenerateJob job;
  job.splice.plan.mode = p->mode;
  job.splice.plan.seam_width = req.seam_width();
  if (p->mode == engine::SpliceMode::Hypic) {  // (not after answer_in_full)
    job.splice.plan.refresh_segments = req.refresh_segments();
    job.splice.plan.refresh_tail = req.refresh_tail();
  }
  job.splice.plan.query = p->query;
  job.splice.plan.block_staging_bytes = opt_.request_entry_bytes;  // (0: what the device has free then)
  for (auto& s : p->slots) {  // (full and prefix modes take the ids alone; a late fill may still touch the entries)
    job.splice.plan.segments.push_back({s.ids, p->uses_entries ? s.resident : nullptr,
                                        p->uses_entries ? s.block : nullptr});
    job.splice.host_entries.push_back(p->uses_entries ? s.entry : nullptr);
  }
  job.sampling = p->sampling;
  job.max_tokens = req.sampling().max_tokens();
  job.cancel = p->cancel;
  events = GenerationEvents::attach(job);
  d_.loop.submit_generate(std::move(job));
  engine::SpliceInfo sinfo = events->wait_spliced(*ctx);
  if (p->mode == engine::SpliceMode::Full && sinfo.computed_tokens > 0)  // (prefix mode reuses checkpoints)
    fetch_costs_.observe_prefill(engine::forward_flops(backend_.config(), sinfo.computed_tokens), sinfo.splice_ms);
  if (sinfo.staged_segments > 0) {
    uint64_t staged_bytes = 0;
    {
      std::lock_guard<std::mutex> lock(p->mu);
      for (const Slot& s : p->slots)
        if (s.block && !s.repeat_of) staged_bytes += s.block->bytes();
    }
    fetch_costs_.observe_staged_splice(staged_bytes, sinfo.splice_ms);
  }
  if (sinfo.staged_segments > 0)
    spdlog::info("[req {}] the splice staged {} entries from pinned host blocks in {} groups ({:.2f} GiB of device "
                 "memory for them), {:.1f} ms",
                 p->id, sinfo.staged_segments, sinfo.staged_groups, double(sinfo.staging_bytes) / double(1ull << 30),
                 sinfo.splice_ms);
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
  // The refresh's cold tail segments were recomputed whole, and a staged request's cold segments were answered by a
  // full prefill (build_after): their entries are built now, after the splice, for later requests, between this
  // worker's decode steps.
  {
    std::vector<size_t> later;
    for (size_t i = 0; i < p->slots.size(); ++i)
      if (p->slots[i].build_after || (p->uses_entries && p->slots[i].planned == v1::PlannedSegment::WHOLE))
        later.push_back(i);
    if (!later.empty()) build_after_first_token(p, later);
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
        if (p.in_full) sr->set_note(s.note);  // why an entry mode was answered by a full prefill (answer_in_full)
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
    p->call = ctx;
    {
      // The id's previous call may still be ending here: the router cancels a call whose client went away and may
      // take the id up again for a new request before this worker has cleaned the old call up (milliseconds). Wait
      // for such a call, at most 2 s; a call with the same id that is not ending is a real duplicate.
      std::unique_lock<std::mutex> lock(mu_);
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      for (auto it = active_.find(p->id); it != active_.end(); it = active_.find(p->id)) {
        const bool ending = it->second->cancel->load() || it->second->call->IsCancelled();
        if (!ending || std::chrono::steady_clock::now() >= until) {
          throw rpc::RpcError(grpc::StatusCode::ALREADY_EXISTS,
                              fmt::format("request_id: {} is already active on this combine worker", p->id));
        }
        active_cv_.wait_until(lock, std::min(until, std::chrono::steady_clock::now() + std::chrono::milliseconds(20)));
      }
      active_.emplace(p->id, p);
    }
    Fetchers fetch;  // declared before the cleanup that joins its threads
    struct Cleanup {
      CombineService& svc;
      Pending& p;
      Fetchers& fetch;
      ~Cleanup() {
        p.cancel->store(true);
        p.gather_cancel->store(true);
        for (auto& t : fetch.threads) t.join();
        svc.leave_local_builds(p);  // (build_locally starts nothing for a cancelled request: p.cancel is set first)
        std::lock_guard<std::mutex> lock(svc.mu_);
        svc.active_.erase(p.id);
        svc.active_cv_.notify_all();
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
    // An entry mode whose entries do not fit in device memory (RESOURCE_EXHAUSTED making them resident, here or in
    // the splice's imports) is answered by a full prefill instead, once: nothing is lost but the time.
    bool in_full = false;
    const auto fall_back = [&](const rpc::RpcError& e) {
      // Device memory only (DeviceMemory's and plan_entry_room's errors say so): a full KV pool or every sequence
      // slot taken would fail a full prefill alike.
      if (in_full || !p->uses_entries || e.code() != grpc::StatusCode::RESOURCE_EXHAUSTED ||
          std::string_view(e.what()).find("device memory") == std::string_view::npos) {
        return false;
      }
      answer_in_full(*p, fetch, e.what());
      in_full = true;
      return true;
    };
    try {
      gather(p, *req, ctx, fetch);
    } catch (const rpc::RpcError& e) {
      if (!fall_back(e)) throw;
    }
    const double gather_ms = rpc::ms_between(t_start, Clock::now());
    ev.mutable_entries_ready();
    send(ev);
    // The loop splices, then samples and decodes this request in one batch with every other request decoding
    // here; its callbacks only queue events for this handler (combine_worker/output.h).
    std::shared_ptr<GenerationEvents> events;
    engine::SpliceInfo sinfo;
    try {
      sinfo = splice(p, *req, ctx, events);
    } catch (const rpc::RpcError& e) {
      if (!fall_back(e)) throw;
      sinfo = splice(p, *req, ctx, events);
    }
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

size_t CombineService::switch_to_full(Pending& p, Fetchers& fetch, const std::string& note) {
  p.gather_cancel->store(true);
  for (auto& t : fetch.threads) t.join();
  fetch.threads.clear();
  leave_local_builds(p);
  size_t let_go = 0;
  std::lock_guard<std::mutex> lock(p.mu);
  p.in_full = true;
  p.mode = engine::SpliceMode::Full;
  p.uses_entries = false;
  p.failure.clear();
  for (Slot& s : p.slots) {
    let_go += s.has_entry() ? 1 : 0;
    s.entry.reset();
    s.resident.reset();
    s.block.reset();
    s.note = s.note.empty() ? note : s.note + "; " + note;
  }
  return let_go;
}

void CombineService::answer_in_full(Pending& p, Fetchers& fetch, const std::string& why) {
  const size_t let_go =
      switch_to_full(p, fetch, "its entries did not fit in device memory: answered by a full prefill of the prompt");
  size_t tokens = p.query.size();
  for (const Slot& s : p.slots) tokens += s.ids.size();  // (ids are immutable after registration)
  full_fallbacks_counter().inc();
  const std::string memory = describe_device_memory(backend_.memory());
  spdlog::warn("[req {}] its entries do not fit in device memory ({}); {} of them let go, answered by a full prefill "
               "of its {} tokens instead{}",
               p.id, why, let_go, tokens, memory.empty() ? std::string() : "; device memory: " + memory);
}

bool CombineService::answer_cold_in_full(Pending& p, Fetchers& fetch,
                                         const std::vector<std::pair<size_t, std::string>>& local) {
  if (!opt_.staged_cold_in_full || !p.stage_blocks.load()) return false;
  std::vector<size_t> joining;  // WARM slots being built here (ENTRY_TIER_BUILDING): fetch_warm would join the build
  {
    std::lock_guard<std::mutex> lock(local_mu_);
    for (size_t i = 0; i < p.slots.size(); ++i)
      if (p.slots[i].planned == v1::PlannedSegment::WARM && local_builds_.contains(p.slots[i].digest))
        joining.push_back(i);
  }
  if (local.empty() && joining.empty()) return false;
  StagedColdCase c;
  int64_t prompt_tokens = int64_t(p.query.size());
  for (const Slot& s : p.slots) prompt_tokens += int64_t(s.ids.size());  // (ids are immutable after registration)
  c.staged_bytes = p.staged_entry_bytes;
  std::vector<size_t> built(joining);
  for (const auto& l : local) built.push_back(l.first);
  for (size_t slot : built) {
    const auto n = int64_t(p.slots[slot].ids.size());
    c.local_tokens += n;
    c.local_flops += engine::forward_flops(backend_.config(), n);
  }
  c.full_flops = engine::forward_flops(backend_.config(), prompt_tokens);
  const StagedColdPlan plan = fetch_costs_.plan_staged_cold(c);
  if (!plan.full) {
    if (plan.staged_ms > 0)
      spdlog::info("[req {}] {} cold segments prefilled here and {} being built here joined, then staged: estimated "
                   "{:.0f} ms against {:.0f} ms for a full prefill (--staged-cold-policy auto)",
                   p.id, local.size(), joining.size(), plan.staged_ms, plan.full_ms);
    return false;
  }
  const std::string what =
      joining.empty()  ? fmt::format("{} of its segments were cold, to be prefilled here,", local.size())
      : local.empty()  ? fmt::format("{} of its segments were being built on this worker,", joining.size())
                       : fmt::format("{} of its segments were cold, to be prefilled here, {} being built here,",
                                     local.size(), joining.size());
  const std::string note = fmt::format(
      "{} and its entries staged: answered by a full prefill of the prompt, estimated {:.0f} ms against {:.0f} ms "
      "building them and staging {:.2f} GiB (--staged-cold-policy auto); {}",
      what, plan.full_ms, plan.staged_ms, double(c.staged_bytes) / double(1ull << 30),
      local.empty() ? "the builds in flight go on for later requests"
                    : "cold segments' entries are built after the first token");
  switch_to_full(p, fetch, note);
  {
    std::lock_guard<std::mutex> lock(p.mu);
    for (Slot& s : p.slots)
      s.build_after = !s.repeat_of && (s.planned == v1::PlannedSegment::LOCAL || s.planned == v1::PlannedSegment::WHOLE);
    for (size_t slot : joining) p.slots[slot].build_after = !p.slots[slot].repeat_of;
  }
  staged_cold_in_full_counter().inc();
  spdlog::info("[req {}] {}", p.id, note);
  return true;
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
      // The device tier, then what is on its way into the tiers (a build here, then a host copy of one), then the
      // tiers again (fetch_warm's order), so that an entry moving along is not missed in between.
      v1::EntryTier tier = d_.memory_tier.contains(d) ? v1::ENTRY_TIER_DEVICE : v1::ENTRY_TIER_NONE;
      if (tier == v1::ENTRY_TIER_NONE) {
        std::lock_guard<std::mutex> lock(local_mu_);
        if (local_builds_.contains(d)) {
          tier = v1::ENTRY_TIER_BUILDING;
        } else {
          std::lock_guard<std::mutex> copies(copying_->mu);
          if (copying_->copies.contains(d)) tier = v1::ENTRY_TIER_HOST;  // its pinned copy is being made
        }
      }
      if (tier == v1::ENTRY_TIER_NONE) {
        tier = d_.memory_tier.contains(d) ? v1::ENTRY_TIER_DEVICE
               : d_.host_tier.contains(d) ? v1::ENTRY_TIER_HOST
                                          : v1::ENTRY_TIER_NONE;
      }
      resp->add_tiers(tier);
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
