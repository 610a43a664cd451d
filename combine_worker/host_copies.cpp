#include "combine_worker/host_copies.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "engine/segment.h"
#include "proto/rpc/log_limit.h"

namespace hypic::combine {

HostCopier::HostCopier(const engine::Backend& backend, HostBlockTier* host_tier, cache::AsyncCachePutter& putter,
                       uint64_t max_queued_bytes)
    : backend_(backend), host_tier_(host_tier), putter_(putter), max_bytes_(max_queued_bytes),
      thread_([this] { run(); }) {}

HostCopier::~HostCopier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    counters_.dropped += queue_.size();
    queue_.clear();
    counters_.queued_bytes = 0;
  }
  cv_.notify_all();
  thread_.join();
}

bool HostCopier::enqueue(const rpc::Digest& digest, std::shared_ptr<const engine::ResidentEntry> entry, bool put,
                         std::string request_id) {
  const bool to_host_tier = host_tier_ && host_tier_->budget() > 0 && backend_.device_entries();
  put = put && putter_.enabled();  // no cache: no wire form to make
  if (!entry || (!to_host_tier && !put)) return false;
  const size_t bytes = entry->resident_bytes();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_ && counters_.queued_bytes + bytes <= max_bytes_) {
      counters_.queued_bytes += bytes;
      queue_.push_back({digest, std::move(entry), put, std::move(request_id)});
      cv_.notify_all();
      return true;
    }
    ++counters_.dropped;
  }
  static rpc::LogLimit limit;
  uint64_t unlogged = 0;
  if (limit.allow(&unlogged)) {
    spdlog::warn("[req {}] host copy of {} ({} bytes) dropped: {} bytes of entries already wait for theirs (limit {}, "
                 "--host-copy-queue-bytes){}",
                 request_id, rpc::digest_hex(digest), bytes, counters().queued_bytes, max_bytes_,
                 unlogged ? fmt::format("; {} more dropped since the last such line", unlogged) : std::string());
  }
  return false;
}

void HostCopier::keep_block(const rpc::Digest& digest, std::shared_ptr<const engine::HostBlock> block) {
  if (host_tier_ && block) host_tier_->put(digest, std::move(block));
}

void HostCopier::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

HostCopier::Counters HostCopier::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  Counters c = counters_;
  c.pending = queue_.size() + (busy_ ? 1 : 0);
  return c;
}

void HostCopier::copy(const Item& item) {
  std::shared_ptr<const std::string> bytes;
  if (backend_.device_entries()) {
    auto block = backend_.copy_to_host(*item.entry);
    if (host_tier_) host_tier_->put(item.digest, block);  // a host-tier hit from now on, before the slower wire form
    if (item.put) bytes = std::make_shared<const std::string>(engine::serialize_entry(*backend_.entry_of_block(*block)));
  } else if (item.put) {
    bytes = std::make_shared<const std::string>(engine::serialize_entry(*item.entry->host()));
  }
  if (bytes) putter_.enqueue(item.digest, item.entry->header().token_ids, std::move(bytes), item.request_id);
}

void HostCopier::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) break;
    Item item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    bool ok = true;
    try {
      copy(item);
    } catch (const std::exception& e) {
      ok = false;
      static rpc::LogLimit limit;
      uint64_t unlogged = 0;
      if (limit.allow(&unlogged))
        spdlog::warn("[req {}] host copy of {} failed: {}{}", item.request_id, rpc::digest_hex(item.digest), e.what(),
                     unlogged ? fmt::format(" ({} more failures since the last such line)", unlogged) : std::string());
    }
    const size_t bytes = item.entry->resident_bytes();
    item.entry.reset();  // its device memory may go now
    lock.lock();
    counters_.queued_bytes -= std::min<uint64_t>(counters_.queued_bytes, bytes);
    ++(ok ? counters_.made : counters_.failed);
    busy_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
  busy_ = false;
  idle_cv_.notify_all();
}

}  // namespace hypic::combine
