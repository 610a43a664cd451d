#include "scatter_worker/nccl_links.h"

#include <spdlog/spdlog.h>

#include "proto/rpc/status.h"

namespace hypic::worker {

using Clock = std::chrono::steady_clock;

NcclLinks::NcclLinks(Options options) : opt_(std::move(options)) {}

NcclLinks::~NcclLinks() {
  std::map<std::string, std::shared_ptr<Entry>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    links.swap(links_);
  }
  for (auto& [address, e] : links) {
    std::lock_guard<std::mutex> lock(e->opening);
    if (!e->link || !e->stub) continue;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::ClosePeerRequest req;
    req.set_scatter_address(opt_.address);
    req.set_epoch(e->link->epoch);
    v1::ClosePeerResponse resp;
    e->stub->ClosePeer(&ctx, req, &resp);  // best effort: the combine worker may be gone
    e->link.reset();
  }
}

std::shared_ptr<NcclLinks::Entry> NcclLinks::entry(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& e = links_[address];
  if (!e) e = std::make_shared<Entry>();
  return e;
}

size_t NcclLinks::open_links() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [address, e] : links_) {
    std::lock_guard<std::mutex> l2(e->opening);
    n += e->link && !e->link->peer->broken();
  }
  return n;
}

std::optional<NcclLinks::Link> NcclLinks::get(const std::string& combine_address, v1::CombineWorker::Stub& stub,
                                             std::string* why) {
  if (!opt_.enabled) {
    if (why) *why = opt_.disabled_reason;
    return std::nullopt;
  }
  auto e = entry(combine_address);
  std::lock_guard<std::mutex> lock(e->opening);
  e->stub = &stub;
  if (e->link && !e->link->peer->broken()) return e->link;
  e->link.reset();
  if (Clock::now() < e->refused_until) {
    if (why) *why = e->refused_why;
    return std::nullopt;
  }
  auto refuse = [&](std::string reason) -> std::optional<Link> {
    e->refused_until = Clock::now() + opt_.retry_after;
    e->refused_why = reason;
    spdlog::info("NCCL data plane to combine worker {}: not used for {} s: {}", combine_address,
                 std::chrono::duration_cast<std::chrono::seconds>(opt_.retry_after).count(), reason);
    if (why) *why = std::move(reason);
    return std::nullopt;
  };
  v1::OpenPeerRequest req;
  req.set_scatter_address(opt_.address);
  req.set_model_fingerprint(opt_.fingerprint);
  try {
    req.set_device_uuid(transport::device_uuid(opt_.device));
  } catch (const transport::TransportError& err) {
    return refuse(err.what());
  }
  req.set_nccl_version(transport::nccl_version());
  v1::OpenPeerResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + opt_.open_timeout);
  const grpc::Status st = stub.OpenPeer(&ctx, req, &resp);
  if (!st.ok()) return refuse("the combine worker refused a communicator: " + rpc::describe(st));
  try {
    const auto timeout = std::chrono::milliseconds(resp.join_timeout_ms() ? resp.join_timeout_ms() : 20000);
    std::shared_ptr<transport::NcclPeer> peer = transport::NcclPeer::join(resp.unique_id(), 1, opt_.device, timeout);
    e->link = Link{std::move(peer), resp.epoch()};
    spdlog::info("NCCL data plane to combine worker {}: communicator {} up (cuda:{}, NCCL {})", combine_address,
                 resp.epoch(), opt_.device, transport::nccl_version());
    return e->link;
  } catch (const transport::TransportError& err) {
    grpc::ClientContext cctx;
    cctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::ClosePeerRequest creq;
    creq.set_scatter_address(opt_.address);
    creq.set_epoch(resp.epoch());
    v1::ClosePeerResponse cresp;
    stub.ClosePeer(&cctx, creq, &cresp);
    return refuse(std::string("joining communicator ") + std::to_string(resp.epoch()) + " failed: " + err.what());
  }
}

void NcclLinks::drop(const std::string& combine_address, uint64_t epoch, const std::string& why) {
  auto e = entry(combine_address);
  std::lock_guard<std::mutex> lock(e->opening);
  if (!e->link || e->link->epoch != epoch) return;
  e->link->peer->abort_soon(why);
  e->link.reset();
  e->refused_until = Clock::now() + opt_.retry_after;
  e->refused_why = "communicator " + std::to_string(epoch) + " failed: " + why;
  spdlog::warn("NCCL data plane to combine worker {}: communicator {} dropped ({}); gRPC for {} s", combine_address,
               epoch, why, std::chrono::duration_cast<std::chrono::seconds>(opt_.retry_after).count());
  if (e->stub) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::ClosePeerRequest req;
    req.set_scatter_address(opt_.address);
    req.set_epoch(epoch);
    v1::ClosePeerResponse resp;
    e->stub->ClosePeer(&ctx, req, &resp);
  }
}

}  // namespace hypic::worker
