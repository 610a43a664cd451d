// The NCCL data plane's control and fallback where NCCL cannot run (transport/nccl_peer.h, CombineWorker.OpenPeer /
// ClosePeer / DeliverEntry with transport NCCL, the scatter worker's NcclLinks): a build without NCCL says why and
// refuses to make communicators; a combine worker on the CPU backend (or with --nccl off) refuses peers with
// FAILED_PRECONDITION naming the reason; an NCCL delivery on a communicator it does not hold is refused the same way,
// so the scatter worker falls back to gRPC; a scatter worker on the CPU never tries. NVLink multicast is forced off.
// The GPU-to-GPU cases (bit-identity with gRPC, aborts on deadline) are in tests/gpu/test_gpu_data_plane.cpp.
#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <functional>
#include <thread>

#include "combine_worker/service.h"
#include "tests/unit/cluster/combine_fixture.h"
#include "engine/cpu/cpu_backend.h"
#include "transport/nccl_links.h"
#include "scatter_worker/service.h"
#include "transport/nccl_peer.h"

using namespace std::chrono_literals;
namespace tr = hypic::transport;
namespace v1 = hypic::v1;

namespace {

// A combine worker on the CPU backend (fixture model, no cache), with or without NCCL.
struct CombineServer {
  std::unique_ptr<hypic::engine::CpuBackend> backend = hypic::engine::CpuBackend::load(hypic::test::kCombineModel);
  hypic::test::CombineServer s;
  explicit CombineServer(bool nccl) : s(*backend, options(nccl)) {}
  static hypic::combine::CombineOptions options(bool nccl) {
    hypic::combine::CombineOptions opt;
    opt.nccl = nccl;
    return opt;
  }
};
using hypic::test::context;

}  // namespace

TEST_CASE("data plane: a build without NCCL says why and makes no communicator", "[data-plane]") {
#if defined(HYPIC_WITH_NCCL) && HYPIC_WITH_NCCL
  CHECK(tr::nccl_unavailable_reason().empty());
  CHECK_FALSE(tr::nccl_version().empty());
#else
  const std::string why = tr::nccl_unavailable_reason();
  CHECK_THAT(why, Catch::Contains("no NCCL data plane"));
  CHECK(tr::nccl_version().empty());
  CHECK_THROWS_WITH(tr::new_unique_id(), why);
  CHECK_THROWS_WITH(tr::NcclPeer::join(std::string(128, '\0'), 0, 0, 1s), why);
#endif
}

TEST_CASE("data plane: transfer deadlines grow with the bytes at the slowest accepted link", "[data-plane]") {
  const auto now = std::chrono::steady_clock::now();
  const auto d = tr::transfer_deadline(size_t(3e9), 2000ms, 1e9);  // 2 s + 3 GB at 1 GB/s
  const double s = std::chrono::duration<double>(d - now).count();
  CHECK(s == Approx(5.0).margin(0.25));
  const double s0 = std::chrono::duration<double>(tr::transfer_deadline(0, 500ms) - now).count();
  CHECK(s0 == Approx(0.5).margin(0.25));
}

TEST_CASE("data plane: NVLink multicast is forced off, whatever the environment said", "[data-plane]") {
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  tr::disable_nvls();
  REQUIRE(std::getenv("NCCL_NVLS_ENABLE") != nullptr);
  CHECK(std::string(std::getenv("NCCL_NVLS_ENABLE")) == "0");
}

TEST_CASE("data plane: a CPU combine worker refuses NCCL peers and NCCL deliveries, naming why", "[data-plane]") {
  for (const bool nccl : {true, false}) {
    CombineServer c(nccl);
    v1::OpenPeerRequest req;
    req.set_scatter_address("127.0.0.1:1");
    req.set_model_fingerprint(c.backend->fingerprint());
    req.set_device_uuid(std::string(32, 'a'));
    v1::OpenPeerResponse resp;
    auto ctx = context();
    const grpc::Status st = c.s.stub->OpenPeer(ctx.get(), req, &resp);
    CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    if (!nccl) {
      CHECK_THAT(st.error_message(), Catch::Contains("--nccl off"));
    } else if (!tr::nccl_unavailable_reason().empty()) {
      CHECK_THAT(st.error_message(), Catch::Contains(tr::nccl_unavailable_reason()));
    } else {
      CHECK_THAT(st.error_message(), Catch::Contains("cpu-fp32 backend keeps entries in host memory"));
    }
    CHECK(resp.unique_id().empty());
    CHECK(c.s.svc->nccl_peers() == 0);

    // Closing a communicator it never had is fine (a scatter worker giving up twice).
    v1::ClosePeerRequest creq;
    creq.set_scatter_address("127.0.0.1:1");
    creq.set_epoch(7);
    v1::ClosePeerResponse cresp;
    auto cctx = context();
    CHECK(c.s.stub->ClosePeer(cctx.get(), creq, &cresp).ok());

    // An NCCL delivery on a communicator it does not hold: FAILED_PRECONDITION (the sender falls back to gRPC).
    {
      v1::DeliverEntryResponse dresp;
      auto dctx = context();
      auto writer = c.s.stub->DeliverEntry(dctx.get(), &dresp);
      v1::EntryChunk head;
      auto* h = head.mutable_header();
      h->set_request_id("r-1");
      h->set_transport(v1::ENTRY_TRANSPORT_NCCL);
      h->set_peer_epoch(7);
      h->set_device_bytes(4096);
      h->set_total_bytes(8192);
      h->set_chunk_bytes(4096);
      REQUIRE(writer->Write(head));
      writer->WritesDone();
      const grpc::Status ds = writer->Finish();
      CHECK(ds.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
      CHECK_THAT(ds.error_message(), Catch::Contains("no NCCL communicator 7 here"));
    }
    // An unknown transport is named.
    {
      v1::DeliverEntryResponse dresp;
      auto dctx = context();
      auto writer = c.s.stub->DeliverEntry(dctx.get(), &dresp);
      v1::EntryChunk head;
      head.mutable_header()->set_request_id("r-1");
      head.mutable_header()->set_transport(static_cast<v1::EntryTransport>(5));
      REQUIRE(writer->Write(head));
      writer->WritesDone();
      const grpc::Status ds = writer->Finish();
      CHECK(ds.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK_THAT(ds.error_message(), Catch::Contains("unknown transport 5"));
    }
  }
}

TEST_CASE("data plane: a scatter worker's links fall back to gRPC with the reason, and ask again only later",
          "[data-plane]") {
  CombineServer c(true);
  hypic::transport::NcclLinks::Options off;
  off.enabled = false;
  off.disabled_reason = "the cpu-fp32 backend keeps entries in host memory";
  hypic::transport::NcclLinks disabled(off);
  std::string why;
  CHECK_FALSE(disabled.get(c.s.address(), *c.s.stub, &why));
  CHECK(why == off.disabled_reason);

  // Enabled links to a combine worker that refuses: no link, the refusal's reason, held off for retry_after.
  hypic::transport::NcclLinks::Options on;
  on.enabled = true;
  on.address = "127.0.0.1:2";
  on.fingerprint = c.backend->fingerprint();
  on.retry_after = 60s;
  hypic::transport::NcclLinks links(on);
  why.clear();
  CHECK_FALSE(links.get(c.s.address(), *c.s.stub, &why));  // never waits: the open runs in the background
  CHECK(why == "the NCCL link is being opened");
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (why == "the NCCL link is being opened" && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
    CHECK_FALSE(links.get(c.s.address(), *c.s.stub, &why));
  }
  // No usable CUDA device here (a build without CUDA, or no driver), or on a GPU host the CPU combine worker's
  // refusal: the reason, remembered.
  CHECK_THAT(why, Catch::Contains("device_uuid(cuda:0): ") || Catch::Contains("keeps entries in host memory"));
  const std::string first = why;
  why.clear();
  CHECK_FALSE(links.get(c.s.address(), *c.s.stub, &why));
  CHECK(why == first);  // not asked again within retry_after
  CHECK(links.open_links() == 0);
}

TEST_CASE("data plane: a scatter worker refuses an unknown entry transport", "[data-plane]") {
  auto backend = hypic::engine::CpuBackend::load(hypic::test::kCombineModel);
  hypic::engine::EngineLoop loop(*backend);
  hypic::cache::SegmentCacheClient cache{std::vector<std::string>{}};
  hypic::cache::AsyncCachePutter putter{cache, 1 << 20};
  hypic::rpc::Lifecycle life("scatter worker");
  hypic::worker::DataPlaneOptions dp;
  dp.entry_transport = "rdma";
  CHECK_THROWS_WITH(hypic::worker::ScatterService(loop, putter, life, 1 << 16, 1, 0, dp),
                    Catch::Contains("entry transport \"rdma\": must be auto or grpc"));
  dp.entry_transport = "grpc";
  dp.nccl_chunk_bytes = 0;
  CHECK_THROWS_WITH(hypic::worker::ScatterService(loop, putter, life, 1 << 16, 1, 0, dp),
                    Catch::Contains("nccl chunk bytes"));
  loop.stop();
}

TEST_CASE("a scatter worker delivers only to its configured combine workers and keeps its own limits",
          "[data-plane][hostile]") {
  auto backend = hypic::engine::CpuBackend::load(hypic::test::kCombineModel);
  hypic::engine::EngineLoop loop(*backend);
  hypic::cache::SegmentCacheClient cache{std::vector<std::string>{}};
  hypic::cache::AsyncCachePutter putter{cache, 1 << 20};
  hypic::rpc::Lifecycle life("scatter worker");
  hypic::worker::ScatterService svc(loop, putter, life, 1 << 16, 1);
  svc.set_allowed_combine_workers({"127.0.0.1:50071"});
  svc.set_limits(4, 2);
  hypic::v1::PrefillRequest req;
  req.set_request_id("r1");
  req.set_combine_address("attacker.example:443\nforged");
  auto* seg = req.add_segments();
  seg->mutable_key()->set_digest(std::string(16, '\0'));
  seg->mutable_key()->add_token_ids(1);
  grpc::ServerContext ctx;
  grpc::Status st = svc.Prefill(&ctx, &req, nullptr);  // refused before anything is written
  CHECK(st.error_code() == grpc::StatusCode::PERMISSION_DENIED);
  CHECK_THAT(st.error_message(), Catch::Contains("combine_address: \"attacker.example:443\\nforged\" is not one of this "
                                                 "scatter worker's combine workers (--combine)"));
  req.set_combine_address("127.0.0.1:50071");
  for (int i = 0; i < 4; ++i) seg->mutable_key()->add_token_ids(1);  // 5 ids, the limit is 4
  st = svc.Prefill(&ctx, &req, nullptr);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("(--max-segment-tokens)"));
  loop.stop();
}

TEST_CASE("a combine worker refuses requests past its own limits", "[data-plane][hostile]") {
  hypic::combine::RequestLimits limits;
  limits.max_new_tokens = 16;
  limits.max_segment_tokens = 8;
  limits.max_prompt_tokens = 12;
  hypic::v1::CombineRequest req;
  req.mutable_sampling()->set_max_tokens(5080);
  req.add_query_ids(1);
  auto* s = req.add_segments()->mutable_key();
  for (int i = 0; i < 8; ++i) s->add_token_ids(1);
  CHECK_THROWS_WITH(hypic::combine::check_request_limits(req, limits),
                    Catch::Contains("sampling.max_tokens: 5080 exceeds this combine worker's limit of 16 "
                                    "(--max-new-tokens)"));
  req.mutable_sampling()->set_max_tokens(16);
  CHECK_NOTHROW(hypic::combine::check_request_limits(req, limits));
  s->add_token_ids(1);
  CHECK_THROWS_WITH(hypic::combine::check_request_limits(req, limits), Catch::Contains("--max-segment-tokens"));
  auto* s2 = req.add_segments()->mutable_key();
  req.mutable_segments(0)->mutable_key()->mutable_token_ids()->RemoveLast();
  for (int i = 0; i < 4; ++i) s2->add_token_ids(1);
  CHECK_THROWS_WITH(hypic::combine::check_request_limits(req, limits), Catch::Contains("--max-prompt-tokens"));
}

namespace {

// One Combine call of one segment planned as `source` (seam width 4, a fixed query, 4 greedy tokens), read on the
// calling thread; `between` runs after the Started event (deliveries to it), before the rest is read.
std::vector<int32_t> combine_one(hypic::test::CombineServer& c, const std::string& id, const std::vector<int32_t>& seg,
                                 v1::PlannedSegment::Source source, const std::function<void()>& between = {}) {
  v1::CombineRequest req;
  req.set_request_id(id);
  auto* ps = req.add_segments();
  ps->set_index(0);
  const auto d = hypic::engine::segment_digest(c.backend.fingerprint(),
                                               hypic::engine::entry_format_version(c.backend.config()), 4, seg);
  ps->mutable_key()->set_digest(std::string(reinterpret_cast<const char*>(d.data()), d.size()));
  ps->mutable_key()->mutable_token_ids()->Add(seg.begin(), seg.end());
  ps->set_source(source);
  for (int32_t t : {5, 6, 7}) req.add_query_ids(t);
  req.mutable_sampling()->set_max_tokens(4);
  req.set_mode("hypic");
  req.set_seam_width(4);
  auto ctx = context();
  auto reader = c.stub->Combine(ctx.get(), req);
  v1::CombineEvent ev;
  REQUIRE(reader->Read(&ev));
  REQUIRE(ev.has_started());
  if (between) between();
  std::vector<int32_t> tokens;
  while (reader->Read(&ev))
    if (ev.has_delta()) tokens.insert(tokens.end(), ev.delta().token_ids().begin(), ev.delta().token_ids().end());
  const grpc::Status st = reader->Finish();
  INFO(st.error_message());
  REQUIRE(st.ok());
  return tokens;
}

}  // namespace

TEST_CASE("a gRPC delivery is used only with its builder's MAC -- a missing, wrong or misplaced one is refused",
          "[data-plane][hostile]") {
  namespace rpc = hypic::rpc;
  const auto keys = rpc::EntryMacKeys::of({std::string(32, 'k')});
  rpc::configure_entry_mac(keys);
  struct Reset {
    ~Reset() { rpc::configure_entry_mac(rpc::EntryMacKeys{}); }
  } reset;
  CombineServer c(false);
  const std::vector<int32_t> seg = {11, 12, 13, 14, 15, 16, 17, 18, 19};
  const auto d = hypic::engine::segment_digest(c.backend->fingerprint(),
                                               hypic::engine::entry_format_version(c.backend->config()), 4, seg);
  const std::string bytes =
      hypic::engine::serialize_entry(*c.backend->build_entries(std::vector<std::vector<int32_t>>{seg}, 4)[0]->host());
  v1::EntryHeader h;
  h.set_request_id("mac-1");
  h.set_index(0);
  h.set_digest(std::string(reinterpret_cast<const char*>(d.data()), d.size()));
  h.set_total_bytes(bytes.size());
  h.set_checksum(rpc::checksum64(bytes));
  h.set_built_by("127.0.0.1:9\nforged log line");
  h.set_device("cpu");
  auto deliver = [&](const rpc::EntryMacKeys& k) {
    auto ctx = context();
    bool duplicate = false;
    return hypic::worker::deliver_entry(*c.s.stub, *ctx, h, bytes, 4096, k, d, seg, &duplicate);
  };
  const std::vector<int32_t> local = combine_one(c.s, "mac-0", seg, v1::PlannedSegment::LOCAL);
  const std::vector<int32_t> delivered = combine_one(c.s, "mac-1", seg, v1::PlannedSegment::REMOTE, [&] {
    const grpc::Status wrong = deliver(rpc::EntryMacKeys::of({std::string(32, 'x')}));
    CHECK(wrong.error_code() == grpc::StatusCode::DATA_LOSS);
    CHECK_THAT(wrong.error_message(), Catch::Contains("MAC does not verify"));
    CHECK_THAT(wrong.error_message(), !Catch::Contains("\n"));  // the sender's name is escaped
    const grpc::Status none = deliver(rpc::EntryMacKeys{});
    CHECK(none.error_code() == grpc::StatusCode::DATA_LOSS);
    CHECK_THAT(none.error_message(), Catch::Contains("carries no MAC"));
    {  // the MAC first, then the bytes
      auto ctx = context();
      v1::DeliverEntryResponse resp;
      auto writer = c.s.stub->DeliverEntry(ctx.get(), &resp);
      v1::EntryChunk m;
      *m.mutable_header() = h;
      REQUIRE(writer->Write(m));
      m.set_mac(keys.sign(d, seg, bytes));
      REQUIRE(writer->Write(m));
      m.set_data(bytes);
      writer->Write(m);
      writer->WritesDone();
      const grpc::Status st = writer->Finish();
      CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK_THAT(st.error_message(), Catch::Contains("must be its last message"));
    }
    // A header, bytes, a MAC: with a header's mac_head that is none, or that is not the MAC's head.
    auto raw = [&](const v1::EntryHeader& header, const std::string& mac) {
      auto ctx = context();
      v1::DeliverEntryResponse resp;
      auto writer = c.s.stub->DeliverEntry(ctx.get(), &resp);
      v1::EntryChunk m;
      *m.mutable_header() = header;
      writer->Write(m);
      m.set_data(bytes);
      writer->Write(m);
      m.set_mac(mac);
      writer->Write(m);
      writer->WritesDone();
      return writer->Finish();
    };
    v1::EntryHeader odd = h;
    odd.set_mac_head("xyz");
    const grpc::Status odd_head = raw(odd, keys.sign(d, seg, bytes));
    CHECK(odd_head.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(odd_head.error_message(), Catch::Contains("header.mac_head"));
    v1::EntryHeader other = h;
    other.set_mac_head(keys.new_head());  // another nonce than the MAC's
    const grpc::Status other_head = raw(other, keys.sign(d, seg, bytes));
    CHECK(other_head.error_code() == grpc::StatusCode::DATA_LOSS);
    CHECK_THAT(other_head.error_message(), Catch::Contains("MAC does not verify"));
    // The builder's MAC, made as the chunks go: accepted, and the request completes with it.
    const grpc::Status good = deliver(keys);
    INFO(good.error_message());
    CHECK(good.ok());
  });
  // The delivered entry gives the tokens of the same segment built here.
  CHECK(delivered.size() == 4);
  CHECK(delivered == local);
}
