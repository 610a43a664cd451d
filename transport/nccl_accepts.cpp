// The combine worker's NCCL communicators (contract in nccl_accepts.h).
#include "transport/nccl_accepts.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "proto/rpc/status.h"

namespace hypic::transport {

using Clock = std::chrono::steady_clock;

NcclAccepts::NcclAccepts(Options options) : opt_(options) {}

void NcclAccepts::retire_locked(Link link, const std::string& why) {
  // A join still running is left to finish (bounded by its timeout) in retired_; a joined peer is aborted now, which
  // never waits for the other rank, and destroyed with its last user.
  if (link.peer.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
    try {
      if (auto peer = link.peer.get()) peer->abort_soon(why);
    } catch (const TransportError&) {
    }
    return;
  }
  retired_.push_back(std::move(link.peer));
}

void NcclAccepts::sweep_locked() {
  const auto now = Clock::now();
  for (auto it = links_.begin(); it != links_.end();) {
    if (now - it->second.last_used > opt_.idle_timeout) {
      spdlog::info("NCCL communicator {} with scatter worker {}: idle for {} s, closed", it->first,
                   it->second.scatter_address,
                   std::chrono::duration_cast<std::chrono::seconds>(now - it->second.last_used).count());
      retire_locked(std::move(it->second), "idle");
      it = links_.erase(it);
    } else {
      ++it;
    }
  }
  // Joins that ended since they were retired: abort what came up.
  for (auto it = retired_.begin(); it != retired_.end();) {
    if (it->wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      try {
        if (auto peer = it->get()) peer->abort_soon("closed while joining");
      } catch (const TransportError&) {
      }
      it = retired_.erase(it);
    } else {
      ++it;
    }
  }
}

NcclAccepts::Opened NcclAccepts::open(const std::string& scatter_address) {
  Opened out;
  try {
    out.unique_id = new_unique_id();
  } catch (const TransportError& e) {
    throw rpc::RpcError(grpc::StatusCode::INTERNAL, e.what());
  }
  const std::string uid = out.unique_id;
  const int device = opt_.device;
  const auto timeout = opt_.join_timeout;
  std::lock_guard<std::mutex> lock(mu_);
  sweep_locked();
  // Random epochs: a scatter worker still holding a link to an earlier process at this address never names a
  // communicator of this one.
  do {
    out.epoch = epoch_rng_();
  } while (out.epoch == 0 || links_.count(out.epoch));
  // A scatter worker opens a new communicator only when it gave the old one up: its old ones go.
  for (auto it = links_.begin(); it != links_.end();) {
    if (it->second.scatter_address == scatter_address) {
      retire_locked(std::move(it->second), "replaced by communicator " + std::to_string(out.epoch));
      it = links_.erase(it);
    } else {
      ++it;
    }
  }
  if (links_.size() >= size_t(opt_.max_links))
    throw rpc::RpcError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        fmt::format("this combine worker holds {} NCCL communicators already (the limit); send "
                                    "entries over gRPC",
                                    links_.size()));
  links_[out.epoch] = Link{scatter_address,
                           std::async(std::launch::async, [uid, device, timeout] {
                             return std::shared_ptr<NcclPeer>(NcclPeer::join(uid, 0, device, timeout));
                           }).share(),
                           Clock::now()};
  return out;
}

std::shared_ptr<NcclPeer> NcclAccepts::peer(uint64_t epoch, const std::string& sender) {
  std::shared_future<std::shared_ptr<NcclPeer>> f;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(epoch);
    if (it == links_.end())
      throw rpc::RpcError(grpc::StatusCode::FAILED_PRECONDITION,
                          fmt::format("no NCCL communicator {} here (closed, or never opened)", epoch));
    if (it->second.scatter_address != sender)
      throw rpc::RpcError(grpc::StatusCode::FAILED_PRECONDITION,
                          fmt::format("NCCL communicator {} belongs to scatter worker {}, not {}", epoch,
                                      it->second.scatter_address, sender));
    it->second.last_used = Clock::now();
    f = it->second.peer;
  }
  std::shared_ptr<NcclPeer> peer;
  try {
    peer = f.get();  // the join is bounded by join_timeout
  } catch (const TransportError& e) {
    throw rpc::RpcError(grpc::StatusCode::FAILED_PRECONDITION,
                        fmt::format("NCCL communicator {} did not come up: {}", epoch, e.what()));
  }
  if (peer->broken())
    throw rpc::RpcError(grpc::StatusCode::FAILED_PRECONDITION,
                        fmt::format("NCCL communicator {} is broken: {}", epoch, peer->broken_reason()));
  return peer;
}

void NcclAccepts::forget(uint64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  links_.erase(epoch);
}

void NcclAccepts::close(uint64_t epoch, const std::string& sender) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(epoch);
  if (it != links_.end() && it->second.scatter_address == sender) {
    spdlog::info("NCCL communicator {} with scatter worker {}: closed", epoch, sender);
    retire_locked(std::move(it->second), "closed by the scatter worker");
    links_.erase(it);
  }
  sweep_locked();
}

size_t NcclAccepts::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return links_.size();
}

}  // namespace hypic::transport
