#include "transport/nccl_links.h"

#include <spdlog/spdlog.h>

#include "proto/rpc/status.h"

namespace hypic::transport {

using Clock = std::chrono::steady_clock;

NcclLinks::NcclLinks(Options options) : opt_(std::move(options)) {}

NcclLinks::~NcclLinks() {
  std::map<std::string, std::shared_ptr<Entry>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    links.swap(links_);
  }
  for (auto& [address, e] : links) {
    if (e->opener.valid()) e->opener.wait();  // bounded: the OpenPeer deadline plus the join timeout
    std::optional<Link> link;
    hypic::v1::CombineWorker::Stub* stub = nullptr;
    {
      std::lock_guard<std::mutex> lock(e->mu);
      link.swap(e->link);
      stub = e->stub;
    }
    if (link && stub) close_peer(stub, link->epoch);
  }
}

void NcclLinks::set_address(std::string address) {
  std::lock_guard<std::mutex> lock(mu_);
  opt_.address = std::move(address);
}

std::string NcclLinks::address() const {
  std::lock_guard<std::mutex> lock(mu_);
  return opt_.address;
}

std::shared_ptr<NcclLinks::Entry> NcclLinks::entry(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& e = links_[address];
  if (!e) e = std::make_shared<Entry>();
  return e;
}

size_t NcclLinks::open_links() const {
  std::vector<std::shared_ptr<Entry>> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [address, e] : links_) entries.push_back(e);
  }
  size_t n = 0;
  for (const auto& e : entries) {
    std::lock_guard<std::mutex> lock(e->mu);
    n += e->link && !e->link->peer->broken();
  }
  return n;
}

void NcclLinks::close_peer(v1::CombineWorker::Stub* stub, uint64_t epoch) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::ClosePeerRequest req;
  req.set_scatter_address(address());
  req.set_epoch(epoch);
  v1::ClosePeerResponse resp;
  stub->ClosePeer(&ctx, req, &resp);  // best effort: the combine worker may be gone
}

std::optional<NcclLinks::Link> NcclLinks::get(const std::string& combine_address, v1::CombineWorker::Stub& stub,
                                             std::string* why) {
  if (!opt_.enabled) {
    if (why) *why = opt_.disabled_reason;
    return std::nullopt;
  }
  auto e = entry(combine_address);
  std::lock_guard<std::mutex> lock(e->mu);
  e->stub = &stub;
  if (e->link && !e->link->peer->broken()) return e->link;
  e->link.reset();
  if (e->opener.valid() && e->opener.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    if (why) *why = "the NCCL link is being opened";
    return std::nullopt;
  }
  if (Clock::now() < e->refused_until) {
    if (why) *why = e->refused_why;
    return std::nullopt;
  }
  // Entries are never removed from links_ before the destructor, which waits for the opener: the raw pointer holds.
  e->opener = std::async(std::launch::async, [this, raw = e.get(), combine_address, s = &stub] {
    open(raw, combine_address, s);
  });
  if (why) *why = "the NCCL link is being opened";
  return std::nullopt;
}

void NcclLinks::open(Entry* e, std::string combine_address, v1::CombineWorker::Stub* stub) {
  auto refuse = [&](std::string reason) {
    spdlog::info("NCCL data plane to combine worker {}: not used for {} s: {}", combine_address,
                 std::chrono::duration_cast<std::chrono::seconds>(opt_.retry_after).count(), reason);
    std::lock_guard<std::mutex> lock(e->mu);
    e->refused_until = Clock::now() + opt_.retry_after;
    e->refused_why = std::move(reason);
  };
  v1::OpenPeerRequest req;
  req.set_scatter_address(address());
  req.set_model_fingerprint(opt_.fingerprint);
  try {
    req.set_device_uuid(device_uuid(opt_.device));
  } catch (const TransportError& err) {
    return refuse(err.what());
  }
  req.set_nccl_version(nccl_version());
  v1::OpenPeerResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + opt_.open_timeout);
  const grpc::Status st = stub->OpenPeer(&ctx, req, &resp);
  if (!st.ok()) return refuse("the combine worker refused a communicator: " + rpc::describe(st));
  try {
    const auto timeout = std::chrono::milliseconds(resp.join_timeout_ms() ? resp.join_timeout_ms() : 20000);
    std::shared_ptr<NcclPeer> peer = NcclPeer::join(resp.unique_id(), 1, opt_.device, timeout);
    spdlog::info("NCCL data plane to combine worker {}: communicator {} up (cuda:{}, NCCL {})", combine_address,
                 resp.epoch(), opt_.device, nccl_version());
    std::lock_guard<std::mutex> lock(e->mu);
    e->link = Link{std::move(peer), resp.epoch()};
  } catch (const TransportError& err) {
    close_peer(stub, resp.epoch());
    refuse(std::string("joining communicator ") + std::to_string(resp.epoch()) + " failed: " + err.what());
  }
}

void NcclLinks::drop(const std::string& combine_address, uint64_t epoch, const std::string& why) {
  auto e = entry(combine_address);
  std::optional<Link> link;
  hypic::v1::CombineWorker::Stub* stub = nullptr;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    if (!e->link || e->link->epoch != epoch) return;
    link.swap(e->link);
    stub = e->stub;
    e->refused_until = Clock::now() + opt_.retry_after;
    e->refused_why = "communicator " + std::to_string(epoch) + " failed: " + why;
  }
  link->peer->abort_soon(why);
  spdlog::warn("NCCL data plane to combine worker {}: communicator {} dropped ({}); gRPC for {} s", combine_address,
               epoch, why, std::chrono::duration_cast<std::chrono::seconds>(opt_.retry_after).count());
  if (stub) close_peer(stub, epoch);
}

}  // namespace hypic::transport
