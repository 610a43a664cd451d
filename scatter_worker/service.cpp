#include "scatter_worker/service.h"

#include "proto/rpc/metrics.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <future>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "engine/segment.h"
#include "proto/engine_rpc/checks.h"
#include "proto/rpc/chunks.h"
#include "proto/rpc/status.h"

namespace hypic::worker {

namespace {
/// hypic:entry_bytes_sent_total{transport}: entry bytes sent to combine workers (transport "grpc" or "nccl").
rpc::Counter& bytes_sent_counter(const char* transport) {
  return rpc::MetricsRegistry::global().counter(
      "hypic:entry_bytes_sent_total", "Segment entry bytes sent to combine workers, by transport",
      {{"transport", transport}});
}
/// hypic:prefill_tokens_total: segment tokens this worker prefilled (a build joined by another request counts once).
rpc::Counter& prefill_tokens_counter() {
  static auto& c = rpc::MetricsRegistry::global().counter("hypic:prefill_tokens_total",
                                                          "Segment tokens prefilled by this worker");
  return c;
}
/// hypic:segment_build_seconds: compute time of one segment entry build, seconds.
rpc::Histogram& build_seconds_histogram() {
  static auto& h = rpc::MetricsRegistry::global().histogram(
      "hypic:segment_build_seconds", "Compute time of one segment entry build", rpc::latency_buckets_seconds());
  return h;
}
}  // namespace

namespace v1 = hypic::v1;

v1::CombineWorker::Stub& CombineStubs::get(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& stub = stubs_[address];
  if (!stub) stub = v1::CombineWorker::NewStub(rpc::make_channel(address));
  return *stub;
}

grpc::Status deliver_entry(v1::CombineWorker::Stub& stub, grpc::ClientContext& ctx, const v1::EntryHeader& header,
                           std::string_view bytes, size_t chunk_bytes, const rpc::EntryMacKeys& keys,
                           const rpc::Digest& digest, std::span<const int32_t> token_ids, bool* duplicate,
                           size_t* written) {
  v1::EntryChunk head;
  *head.mutable_header() = header;
  if (written) *written = 0;
  // The MAC is made on another thread while the chunks go (no pass over the bytes before the first one), sent last,
  // its head (scheme and nonce) in the header; a stream that breaks stops it within a piece (so a refused delivery
  // does not wait for the whole MAC). Started before the stream opens: what throws here (no thread, no random
  // nonce) leaves no stream behind.
  std::atomic<bool> abandoned{false};
  std::future<std::string> mac;
  struct Abandon {  // a MAC thread still running when this returns or throws stops within a piece
    std::atomic<bool>& flag;
    ~Abandon() { flag = true; }
  } abandon_on_exit{abandoned};
  if (keys.enabled()) {
    const std::string mac_head = keys.new_head();
    head.mutable_header()->set_mac_head(mac_head);
    mac = std::async(std::launch::async, [&keys, &digest, &abandoned, token_ids, bytes, mac_head] {
      constexpr size_t kPiece = size_t(4) << 20;
      rpc::EntryMacKeys::Stream s(keys, digest, token_ids, bytes.size(), mac_head);
      for (size_t off = 0; off < bytes.size(); off += kPiece) {
        if (abandoned) return std::string();
        s.update(bytes.substr(off, kPiece));
      }
      return s.sign();
    });
  }
  v1::DeliverEntryResponse resp;
  auto writer = stub.DeliverEntry(&ctx, &resp);
  bool all = false;
  if (writer->Write(head)) {
    all = rpc::write_chunks<v1::EntryChunk>(
        bytes, chunk_bytes, [](v1::EntryChunk& m, std::string_view c) { m.set_data(std::string(c)); },
        [&](const v1::EntryChunk& m) {
          if (!writer->Write(m)) return false;
          if (written) *written += m.data().size();
          return true;
        });
  }
  if (!all) abandoned = true;
  if (all && mac.valid()) {
    v1::EntryChunk tail;
    try {
      tail.set_mac(mac.get());
    } catch (const std::exception& e) {  // (OpenSSL failed on the MAC's thread): the delivery ends unsigned, refused
      ctx.TryCancel();
      (void)writer->Finish();
      return grpc::Status(grpc::StatusCode::INTERNAL, fmt::format("the entry's MAC could not be made: {}", e.what()));
    }
    writer->Write(tail);
  }
  writer->WritesDone();
  const grpc::Status st = writer->Finish();
  if (duplicate) *duplicate = resp.duplicate();
  return st;
}

grpc::Status deliver_entry_nccl(v1::CombineWorker::Stub& stub, grpc::ClientContext& ctx, v1::EntryHeader header,
                                const NcclLinks::Link& link, const engine::DeviceBlock& block, size_t chunk_bytes,
                                std::chrono::milliseconds transfer_base, bool* duplicate, bool* link_broken,
                                std::chrono::milliseconds inject_stall) {
  *link_broken = false;
  header.set_transport(v1::ENTRY_TRANSPORT_NCCL);
  header.set_peer_epoch(link.epoch);
  header.set_device_bytes(block.bytes);
  header.set_chunk_bytes(chunk_bytes);
  transport::NcclPeer& peer = *link.peer;
  // Both ranks post their operations in the order of the headers: one delivery at a time on this link.
  auto order = peer.exclusive();
  v1::DeliverEntryResponse resp;
  auto writer = stub.DeliverEntry(&ctx, &resp);
  v1::EntryChunk head;
  *head.mutable_header() = header;
  const bool wrote = writer->Write(head);
  writer->WritesDone();
  transport::TransferLimits limits;
  limits.chunk_bytes = chunk_bytes;
  limits.deadline = transport::transfer_deadline(block.bytes, transfer_base);
  bool posted = false;
  grpc::Status failure;
  if (wrote) {
    spdlog::info("[req {}] segment {}: NCCL transfer of {} bytes on communicator {}", header.request_id(),
                 header.index(), block.bytes, link.epoch);
    if (inject_stall.count() > 0) {
      spdlog::warn("[req {}] segment {}: stalling the NCCL transfer {} ms (--inject-transfer-stall-ms, testing only)",
                   header.request_id(), header.index(), inject_stall.count());
      std::this_thread::sleep_for(inject_stall);
    }
    try {
      peer.post_send(block.data, block.bytes, limits);
      posted = true;
    } catch (const transport::TransportError& e) {
      ctx.TryCancel();  // the combine worker gives its receive up when the call is cancelled
      failure = grpc::Status(grpc::StatusCode::UNAVAILABLE, fmt::format("NCCL send failed: {}", e.what()));
    }
  }
  // The combine worker answers once the block is in, or received and dropped when it refused the entry; its
  // trailing metadata says whether it matched the send. Anything else (no answer, a refusal before it posted a
  // receive) leaves the link out of step, even when our send completed: NCCL buffers small sends on the receiver
  // before any receive is posted. Then the link goes.
  const grpc::Status st = writer->Finish();
  if (duplicate) *duplicate = resp.duplicate();
  bool matched = st.ok();
  for (const auto& [k, v] : ctx.GetServerTrailingMetadata())
    if (k == "hypic-nccl-matched" && v == "1") matched = true;
  if (!failure.ok() || !posted || !matched) {
    *link_broken = true;
    if (posted) {
      peer.abort_soon("the combine worker did not take the block: " + rpc::describe(st));
      try {
        limits.deadline = std::chrono::steady_clock::now();
        peer.wait(limits);
      } catch (const transport::TransportError&) {
      }
    } else {
      peer.abort_soon(failure.ok() ? "the delivery call broke before the send" : failure.error_message());
    }
    return failure.ok() ? st : failure;
  }
  if (!st.ok()) limits.deadline = std::min(limits.deadline, std::chrono::steady_clock::now() + std::chrono::seconds(2));
  try {
    peer.wait(limits);
  } catch (const transport::TransportError& e) {
    *link_broken = true;
    if (st.ok()) return st;  // the combine worker has the entry; only the link is lost
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        fmt::format("{}; and the NCCL send did not complete: {}", rpc::describe(st), e.what()));
  }
  return st;
}

ScatterService::ScatterService(engine::EngineLoop& loop, cache::AsyncCachePutter& putter, rpc::Lifecycle& life,
                               size_t chunk_bytes, int compute_threads, uint64_t random_weights_seed,
                               DataPlaneOptions data_plane)
    : loop_(loop), fingerprint_(loop.backend().fingerprint()), device_(loop.backend().device().name()), life_(life),
      chunk_bytes_(chunk_bytes), compute_threads_(compute_threads), random_weights_seed_(random_weights_seed),
      data_plane_(std::move(data_plane)),
      builds_(loop, [&putter](const rpc::Digest& digest, std::vector<int32_t> ids,
                              std::shared_ptr<const std::string> bytes, std::string request_id,
                              std::function<void(bool)> done) {
        return putter.enqueue(digest, std::move(ids), std::move(bytes), std::move(request_id), std::move(done));
      }) {
  if (data_plane_.entry_transport != "auto" && data_plane_.entry_transport != "grpc") {
    throw std::invalid_argument(fmt::format("entry transport \"{}\": must be auto or grpc", data_plane_.entry_transport));
  }
  if (data_plane_.nccl_chunk_bytes == 0) throw std::invalid_argument("nccl chunk bytes: must be > 0");
  NcclLinks::Options o;
  o.fingerprint = fingerprint_;
  o.device = loop_.backend().device().index;
  o.retry_after = data_plane_.nccl_retry_after;
  const std::string unavailable = transport::nccl_unavailable_reason();
  if (data_plane_.entry_transport == "grpc") {
    o.disabled_reason = "--entry-transport grpc";
  } else if (!unavailable.empty()) {
    o.disabled_reason = unavailable;
  } else if (loop_.backend().device().kind != engine::BackendKind::Cuda) {
    o.disabled_reason = fmt::format("the {} backend keeps entries in host memory", loop_.backend().numerics());
  } else {
    o.enabled = true;
  }
  links_ = std::make_unique<NcclLinks>(std::move(o));
  // Prometheus metrics (proto/rpc/metrics.h), read at each scrape; this service lives until the server stopped.
  auto& reg = rpc::MetricsRegistry::global();
  bytes_sent_counter("grpc");  // (registered now: scraped as 0 before the first build or send)
  bytes_sent_counter("nccl");
  prefill_tokens_counter();
  build_seconds_histogram();
  reg.gauge_fn("hypic:scatter_queued_tokens", "Tokens of builds queued or running on this scatter worker",
               [this] { return double(loop_.queued_tokens()); });
  reg.counter_fn("hypic:segments_built_total", "Segment entries built (prefilled) by this worker",
                 [this] { return double(builds_.counters().built); });
  reg.counter_fn("hypic:builds_joined_total", "Segment requests that joined a build already in flight",
                 [this] { return double(builds_.counters().joined); });
  reg.counter_fn("hypic:builds_dropped_total", "Queued builds dropped because no request waited for them",
                 [this] { return double(builds_.counters().dropped); });
  reg.counter_fn("hypic:orphan_builds_stored_total", "Builds finished after every waiter left, stored in the cache",
                 [this] { return double(builds_.counters().orphans_stored); });
  reg.counter_fn("hypic:cache_puts_total", "Entries this worker stored in the segment cache",
                 [&putter] { return double(putter.counters().stored); }, {{"outcome", "stored"}});
  reg.counter_fn("hypic:cache_puts_total", "Entries this worker stored in the segment cache",
                 [&putter] { return double(putter.counters().failed); }, {{"outcome", "failed"}});
  reg.counter_fn("hypic:cache_puts_total", "Entries this worker stored in the segment cache",
                 [&putter] { return double(putter.counters().dropped); }, {{"outcome", "dropped"}});
}

void ScatterService::set_address(std::string address) {
  address_ = std::move(address);
  links_->set_address(address_);
}

// Shared between the Prefill handler, the engine thread (build callbacks) and the delivery thread of one call.
struct ScatterService::PrefillCall {
  struct Event {
    enum Kind { Computed, Delivered, Failed } kind;
    uint32_t position;  // in the request's segment list
    SharedOutcome built;
    double transfer_ms = 0;
    std::string transport, note;  // Delivered: how it went, and why not over NCCL where that was tried
    grpc::Status status;
  };
  explicit PrefillCall(const hypic::v1::PrefillRequest& r) : req(r) {}
  // The handler's request: read by the handler and the delivery thread (joined before the handler returns), never
  // by the build callbacks, which may outlive the handler and only push().
  const hypic::v1::PrefillRequest& req;
  std::vector<rpc::Digest> digests;             // per segment of req
  std::vector<std::vector<int32_t>> ids;        // per segment of req
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Event> events;
  std::deque<std::pair<uint32_t, SharedOutcome>> to_deliver;
  bool stop_delivery = false;
  grpc::ClientContext* delivering = nullptr;  // the delivery in flight, to abort it on failure

  void push(Event e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      events.push_back(std::move(e));
    }
    cv.notify_all();
  }
  // Marks `cctx` as the delivery in flight (nullptr: none); false when the call stopped meanwhile.
  bool set_delivering(grpc::ClientContext* cctx) {
    std::lock_guard<std::mutex> lock(mu);
    if (cctx && stop_delivery) return false;
    delivering = cctx;
    return true;
  }
};

void ScatterService::validate(const v1::PrefillRequest& req, PrefillCall& call) const {
  const std::string& rid = req.request_id();
  if (req.segments().empty()) throw rpc::invalid_argument("segments", "at least one segment is required");
  if (req.seam_width() < 0) {
    throw rpc::invalid_argument("seam_width", fmt::format("must be >= 0, got {}", req.seam_width()));
  }
  if (req.combine_address().empty()) throw rpc::invalid_argument("combine_address", "must not be empty");
  if (!allowed_combines_.empty() && std::find(allowed_combines_.begin(), allowed_combines_.end(),
                                              req.combine_address()) == allowed_combines_.end()) {
    spdlog::warn("[req {}] refused: combine_address {} is not a configured combine worker (--combine)", rid,
                 rpc::untrusted(req.combine_address()));
    throw rpc::RpcError(grpc::StatusCode::PERMISSION_DENIED,
                        fmt::format("combine_address: {} is not one of this scatter worker's combine workers "
                                    "(--combine)",
                                    rpc::untrusted(req.combine_address())));
  }
  if (req.segments_size() > max_segments_) {
    throw rpc::invalid_argument("segments", fmt::format("{} segments exceed this scatter worker's limit of {} "
                                                        "(--max-segments)",
                                                        req.segments_size(), max_segments_));
  }
  for (int i = 0; i < req.segments_size(); ++i) {
    if (req.segments(i).key().token_ids_size() > max_segment_tokens_) {
      throw rpc::invalid_argument(fmt::format("segments[{}].key.token_ids", i),
                                  fmt::format("{} tokens exceed this scatter worker's limit of {} "
                                              "(--max-segment-tokens)",
                                              req.segments(i).key().token_ids_size(), max_segment_tokens_));
    }
  }
  const int n = req.segments_size();
  const engine::ModelConfig& model = loop_.backend().config();
  call.digests.resize(size_t(n));
  call.ids.resize(size_t(n));
  for (int i = 0; i < n; ++i) {
    const auto& key = req.segments(i).key();
    const std::string field = fmt::format("segments[{}].key", i);
    call.ids[size_t(i)].assign(key.token_ids().begin(), key.token_ids().end());
    call.digests[size_t(i)] = rpc::check_segment_key(key.digest(), call.ids[size_t(i)], field, model.vocab_size, fingerprint_,
                                                engine::entry_format_version(model), req.seam_width());
  }
}

bool ScatterService::deliver_one(grpc::ServerContext* ctx, PrefillCall& call, uint32_t position,
                                 const SharedOutcome& built_outcome, v1::CombineWorker::Stub& stub) {
  const int i = int(position);
  v1::EntryHeader h;
  h.set_request_id(call.req.request_id());
  h.set_index(call.req.segments(i).index());
  h.set_digest(rpc::digest_bytes(call.digests[size_t(i)]));
  const engine::BuildOutcome& built = built_outcome.build;
  h.set_total_bytes(built.bytes->size());
  h.set_checksum(rpc::checksum64(*built.bytes));
  h.set_built_by(address_);
  h.set_compute_ms(built.compute_ms);
  h.set_device(device_);
  if (built_outcome.joined) h.set_shared_from(built_outcome.started_for);
  const auto t0 = std::chrono::steady_clock::now();
  bool duplicate = false;
  std::string transport = "grpc", note;
  grpc::Status st;
  // NCCL first where the entry lives on a GPU and a link to this combine worker is (or can be made) up; gRPC
  // when that is not possible, or when the NCCL delivery failed in a way gRPC may not (the link broke, the
  // combine worker refused the block): the host bytes are at hand either way.
  std::optional<engine::DeviceBlock> block;
  if (links_->enabled() && built.entry) block = loop_.backend().device_block(*built.entry);
  std::string why_not;
  std::optional<NcclLinks::Link> link;
  if (block) link = links_->get(call.req.combine_address(), stub, &why_not);
  bool via_grpc = !link;
  if (link) {
    auto cctx = rpc::make_client_context(ctx);  // the router's deadline and cancellation propagate
    if (!call.set_delivering(cctx.get())) return false;
    bool broken = false;
    st = deliver_entry_nccl(stub, *cctx, h, *link, *block, data_plane_.nccl_chunk_bytes,
                            data_plane_.nccl_transfer_base, &duplicate, &broken,
                            data_plane_.inject_transfer_stall);
    call.set_delivering(nullptr);
    if (broken) links_->drop(call.req.combine_address(), link->epoch, rpc::describe(st));
    static auto& nccl_sent = bytes_sent_counter("nccl");
    if (st.ok()) {
      transport = "nccl";
      nccl_sent.inc(double(block->bytes));
    } else if (st.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
               st.error_code() == grpc::StatusCode::DATA_LOSS ||
               st.error_code() == grpc::StatusCode::UNAVAILABLE ||
               st.error_code() == grpc::StatusCode::INTERNAL || st.error_code() == grpc::StatusCode::UNKNOWN) {
      // The link or the block was refused (or broke): gRPC may well succeed. A request that is gone
      // (NOT_FOUND), cancelled or past its deadline, or a combine worker short of memory, would refuse it
      // over gRPC too.
      note = fmt::format("NCCL delivery failed ({}); sent over gRPC", rpc::describe(st));
      spdlog::warn("[req {}] segment {}: {}", call.req.request_id(), call.req.segments(i).index(), note);
      via_grpc = true;
    }
  } else if (block) {
    note = fmt::format("gRPC: {}", why_not);
  }
  if (via_grpc) {
    size_t written = 0;
    auto cctx = rpc::make_client_context(ctx);  // the router's deadline and cancellation propagate
    if (!call.set_delivering(cctx.get())) return false;
    try {
      st = deliver_entry(stub, *cctx, h, *built.bytes, chunk_bytes_, rpc::entry_mac_keys(), call.digests[size_t(i)],
                         call.ids[size_t(i)], &duplicate, &written);
    } catch (const std::exception& e) {  // no MAC thread or nonce to be had: this delivery fails, the worker stays
      st = grpc::Status(grpc::StatusCode::INTERNAL, fmt::format("could not deliver: {}", e.what()));
    }
    // Bytes count as sent once the stream took them, whatever the call's end: the router cancels this call
    // when its request is done, which can land after the combine worker used the entry but before its reply.
    static auto& sent = bytes_sent_counter("grpc");
    sent.inc(double(written));
    call.set_delivering(nullptr);
  }
  if (st.ok()) {
    static auto& transfer = rpc::MetricsRegistry::global().histogram(
        "hypic:entry_transfer_seconds", "Time to send one segment entry to the combine worker",
        rpc::latency_buckets_seconds());
    transfer.observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  PrefillCall::Event e{st.ok() ? PrefillCall::Event::Delivered : PrefillCall::Event::Failed, position, {}};
  e.transfer_ms = rpc::ms_between(t0, std::chrono::steady_clock::now());
  e.transport = transport;
  e.note = note;
  // A failed delivery is reported as ABORTED (the underlying code is in the message), so the
  // router does not mistake the combine worker's failure for this worker's.
  e.status = st.ok() ? st
                     : grpc::Status(grpc::StatusCode::ABORTED,
                                    fmt::format("delivering segment {} to combine worker {}: {}",
                                                call.req.segments(i).index(), call.req.combine_address(),
                                                rpc::describe(st)));
  const bool ok = e.status.ok();
  call.push(std::move(e));
  return ok;
}

void ScatterService::delivery_loop(grpc::ServerContext* ctx, PrefillCall& call, v1::CombineWorker::Stub& stub) {
  for (;;) {
    std::pair<uint32_t, SharedOutcome> item;
    {
      std::unique_lock<std::mutex> lock(call.mu);
      call.cv.wait(lock, [&] { return call.stop_delivery || !call.to_deliver.empty(); });
      if (call.stop_delivery) return;
      item = std::move(call.to_deliver.front());
      call.to_deliver.pop_front();
    }
    if (!deliver_one(ctx, call, item.first, item.second, stub)) return;
  }
}

grpc::Status ScatterService::computed_event(const PrefillCall& call, uint32_t position, const SharedOutcome& built,
                                            v1::PrefillEvent& out) const {
  const std::string& rid = call.req.request_id();
  const uint32_t index = out.index();
  const engine::BuildOutcome& b = built.build;
  if (b.cancelled) return grpc::Status(grpc::StatusCode::CANCELLED, "worker shutting down");
  if (!b.error.empty()) {
    spdlog::error("[req {}] segment {}: prefill failed{}: {}", rid, index,
                  built.joined ? fmt::format(" (build shared with request {})", built.started_for) : "",
                  b.error);
    return grpc::Status(rpc::engine_error_code(b.error_kind),
                        fmt::format("segment {}: prefill failed: {}", index, b.error));
  }
  spdlog::debug("[req {}] segment {} built: {} tokens, {:.1f} ms (queued {:.1f} ms), {} bytes{}", rid, index,
                call.ids[position].size(), b.compute_ms, b.queue_ms, b.bytes->size(),
                built.joined ? fmt::format(", shared with request {}", built.started_for) : "");
  if (!built.joined) {
    prefill_tokens_counter().inc(double(call.ids[position].size()));
    build_seconds_histogram().observe(b.compute_ms / 1000.0);
  }
  auto* c = out.mutable_computed();
  c->set_queue_ms(b.queue_ms);
  c->set_compute_ms(b.compute_ms);
  c->set_entry_bytes(b.bytes->size());
  c->set_device(device_);
  c->set_batch_ms(b.batch_ms);
  c->set_batch_segments(uint32_t(b.batch_segments));
  c->set_joined(built.joined);
  return grpc::Status::OK;
}

grpc::Status ScatterService::Prefill(grpc::ServerContext* ctx, const v1::PrefillRequest* req,
                                     grpc::ServerWriter<v1::PrefillEvent>* writer) {
  if (auto st = rpc::require_service_caller(*ctx, "ScatterWorker.Prefill"); !st.ok()) return st;
  return rpc::handle_errors([&]() -> grpc::Status {
    auto life_call = life_.enter();
    rpc::validate_request_id(req->request_id());
    const std::string& rid = req->request_id();
    auto call = std::make_shared<PrefillCall>(*req);
    validate(*req, *call);
    const int n = req->segments_size();
    // Each segment joins the build of its digest in flight here, or starts one (SharedBuilds); the tickets end this
    // call's waits when it finishes, which drops the builds nobody else waits for if they have not started.
    std::vector<std::unique_ptr<SharedBuilds::Ticket>> tickets;
    size_t joined = 0;
    for (int i = 0; i < n; ++i) {
      tickets.push_back(builds_.join(call->digests[size_t(i)], call->ids[size_t(i)], req->seam_width(), rid,
                                     req->cache_segments(), [call, i](SharedOutcome r) {
                                       call->push({PrefillCall::Event::Computed, uint32_t(i), std::move(r)});
                                     }));
      joined += tickets.back()->joined();
    }
    spdlog::info("[req {}] prefill of {} segments for {}{}", rid, n, rpc::untrusted(req->combine_address()),
                 joined ? fmt::format(" ({} joined builds in flight)", joined) : std::string());
    // Delivery thread: streams built entries to the combine worker in the order they were built.
    std::thread delivery([this, ctx, call, &stub = combines_.get(req->combine_address())] {
      delivery_loop(ctx, *call, stub);
    });
    auto finish = [&](grpc::Status st) {
      tickets.clear();  // this call waits for no build any more
      {
        std::lock_guard<std::mutex> lock(call->mu);
        call->stop_delivery = true;
        if (call->delivering && !st.ok()) call->delivering->TryCancel();
      }
      call->cv.notify_all();
      delivery.join();
      return st;
    };
    const grpc::Status gone(grpc::StatusCode::CANCELLED, "the router went away");
    for (int delivered = 0; delivered < n;) {
      PrefillCall::Event e;
      {
        std::unique_lock<std::mutex> lock(call->mu);
        if (!call->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return !call->events.empty(); })) {
          if (!ctx->IsCancelled()) continue;
          lock.unlock();
          spdlog::info("[req {}] prefill cancelled by the caller", rid);
          return finish(grpc::Status(grpc::StatusCode::CANCELLED, "prefill cancelled by the caller"));
        }
        e = std::move(call->events.front());
        call->events.pop_front();
      }
      v1::PrefillEvent out;
      out.set_index(req->segments(int(e.position)).index());
      if (e.kind == PrefillCall::Event::Failed) {
        spdlog::warn("[req {}] {}", rid, rpc::describe(e.status));
        return finish(e.status);
      }
      if (e.kind == PrefillCall::Event::Computed) {
        if (auto st = computed_event(*call, e.position, e.built, out); !st.ok()) return finish(st);
        // Tell the router first (its clock marks the end of this segment's compute), then deliver. The build was
        // queued for the segment cache when it finished (SharedBuilds), whoever still waited for it.
        if (!writer->Write(out)) return finish(gone);
        {
          std::lock_guard<std::mutex> lock(call->mu);
          call->to_deliver.emplace_back(e.position, std::move(e.built));
        }
        call->cv.notify_all();
        continue;
      }
      out.mutable_delivered()->set_transfer_ms(e.transfer_ms);
      out.mutable_delivered()->set_transport(e.transport);
      out.mutable_delivered()->set_note(e.note);
      ++delivered;
      if (!writer->Write(out)) return finish(gone);
    }
    spdlog::info("[req {}] {} segments built and delivered", rid, n);
    return finish(grpc::Status::OK);
  });
}

grpc::Status ScatterService::GetWorkerInfo(grpc::ServerContext* ctx, const v1::WorkerInfoRequest*, v1::WorkerInfo* resp) {
  if (auto st = rpc::require_service_caller(*ctx, "ScatterWorker.GetWorkerInfo"); !st.ok()) return st;
  resp->set_role("scatter");
  resp->set_model_fingerprint(fingerprint_);
  resp->set_entry_format_version(engine::entry_format_version(loop_.backend().config()));
  resp->set_address(address_);
  resp->set_compute_threads(uint32_t(compute_threads_));
  resp->set_queued_tokens(loop_.queued_tokens());
  resp->set_active_requests(uint32_t(life_.active()));
  resp->set_numerics(std::string(loop_.backend().numerics()));
  resp->set_device(device_);
  resp->set_random_weights_seed(random_weights_seed_);
  const SharedBuildCounters c = builds_.counters();
  resp->set_entries_built(c.built);
  resp->set_builds_joined(c.joined);
  resp->set_builds_dropped(c.dropped);
  resp->set_orphan_builds_stored(c.orphans_stored);
  return grpc::Status::OK;
}

}  // namespace hypic::worker
