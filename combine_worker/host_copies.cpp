#include "combine_worker/host_copies.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "engine/segment.h"
#include "proto/rpc/log_limit.h"

namespace hypic::combine {

namespace {
// Calls a waiter's on_copied, never letting an exception out (a copier thread, a destructor).
void notify(HostCopier::OnCopied& on_copied, std::shared_ptr<const engine::HostBlock> block) noexcept {
  if (!on_copied) return;
  HostCopier::OnCopied done = std::move(on_copied);
  on_copied = nullptr;
  try {
    done(std::move(block));
  } catch (const std::exception& e) {
    spdlog::error("host copy: its waiter failed: {}", e.what());
  } catch (...) {
    spdlog::error("host copy: its waiter failed");
  }
}
}  // namespace

HostCopier::HostCopier(const engine::Backend& backend, HostBlockTier* host_tier, cache::AsyncCachePutter& putter,
                       uint64_t max_queued_bytes)
    : backend_(backend), host_tier_(host_tier), putter_(putter), max_bytes_(max_queued_bytes),
      thread_([this] { run_copies(); }), wire_thread_([this] { run_wire(); }) {}

HostCopier::~HostCopier() {
  std::deque<Item> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    counters_.dropped += queue_.size() + wire_.size();
    dropped.swap(queue_);
    wire_.clear();
    counters_.queued_bytes = counters_.wire_queued_bytes = 0;
  }
  cv_.notify_all();
  thread_.join();
  wire_thread_.join();
  for (Item& item : dropped) notify(item.on_copied, nullptr);
}

void HostCopier::log_drop(const Item& item, const char* what, uint64_t queued, uint64_t limit) {
  static rpc::LogLimit limit_log;
  uint64_t unlogged = 0;
  if (limit_log.allow(&unlogged)) {
    spdlog::warn("[req {}] {} of {} ({} bytes) dropped: {} bytes already wait (limit {}, --host-copy-queue-bytes){}",
                 item.request_id, what, rpc::digest_hex(item.digest), item.bytes, queued, limit,
                 unlogged ? fmt::format("; {} more dropped since the last such line", unlogged) : std::string());
  }
}

bool HostCopier::enqueue(const rpc::Digest& digest, std::shared_ptr<const engine::ResidentEntry> entry, bool put,
                         std::string request_id, OnCopied on_copied) {
  if (!backend_.device_entries()) notify(on_copied, nullptr);  // no host blocks here
  const auto refuse = [&] {
    notify(on_copied, nullptr);
    return false;
  };
  const bool to_host_tier = host_tier_ && host_tier_->budget() > 0 && backend_.device_entries();
  put = put && putter_.enabled();  // no cache: no wire form to make
  if (!entry || (!to_host_tier && !put && !on_copied)) return refuse();
  Item item{digest, std::move(entry), nullptr, put, std::move(request_id), 0, std::move(on_copied)};
  item.bytes = item.entry->resident_bytes();
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) {
    lock.unlock();
    notify(item.on_copied, nullptr);
    return false;
  }
  if (!backend_.device_entries()) return push_wire_locked(std::move(item));  // host already: stage 2 only
  if (counters_.queued_bytes + item.bytes > max_bytes_) {
    ++counters_.dropped;
    const uint64_t queued = counters_.queued_bytes;
    lock.unlock();
    log_drop(item, "host copy", queued, max_bytes_);
    notify(item.on_copied, nullptr);
    return false;
  }
  counters_.queued_bytes += item.bytes;
  queue_.push_back(std::move(item));
  cv_.notify_all();
  return true;
}

bool HostCopier::push_wire_locked(Item item) {
  if (counters_.wire_queued_bytes + item.bytes > max_bytes_) {
    ++counters_.dropped;
    log_drop(item, "cache put", counters_.wire_queued_bytes, max_bytes_);
    return false;
  }
  counters_.wire_queued_bytes += item.bytes;
  wire_.push_back(std::move(item));
  cv_.notify_all();
  return true;
}

void HostCopier::keep_block(const rpc::Digest& digest, std::shared_ptr<const engine::HostBlock> block) {
  if (host_tier_ && block) host_tier_->put(digest, std::move(block));
}

void HostCopier::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && wire_.empty() && !busy_ && !wire_busy_; });
}

HostCopier::Counters HostCopier::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  Counters c = counters_;
  c.pending = queue_.size() + wire_.size() + (busy_ ? 1 : 0) + (wire_busy_ ? 1 : 0);
  return c;
}

std::optional<HostCopier::Item> HostCopier::copy(Item& item) {
  auto block = backend_.copy_to_host(*item.entry);
  if (host_tier_) host_tier_->put(item.digest, block);  // a host-tier hit from now on
  notify(item.on_copied, block);
  if (!item.put) return std::nullopt;
  return Item{item.digest, nullptr, std::move(block), true, item.request_id, item.bytes};
}

void HostCopier::run_copies() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) break;
    Item item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    std::optional<Item> next;
    bool ok = true;
    try {
      next = copy(item);
    } catch (const std::exception& e) {
      ok = false;
      static rpc::LogLimit limit;
      uint64_t unlogged = 0;
      if (limit.allow(&unlogged))
        spdlog::warn("[req {}] host copy of {} failed: {}{}", item.request_id, rpc::digest_hex(item.digest), e.what(),
                     unlogged ? fmt::format(" ({} more failures since the last such line)", unlogged) : std::string());
    }
    notify(item.on_copied, nullptr);  // (the copy failed, if still set)
    item.entry.reset();  // its device memory may go now
    lock.lock();
    counters_.queued_bytes -= std::min<uint64_t>(counters_.queued_bytes, item.bytes);
    ++(ok ? counters_.made : counters_.failed);
    if (next && !stop_) push_wire_locked(std::move(*next));
    busy_ = false;
    if (queue_.empty() && wire_.empty() && !wire_busy_) idle_cv_.notify_all();
  }
  busy_ = false;
  idle_cv_.notify_all();
}

std::shared_ptr<const rpc::SharedBytes> HostCopier::wire_bytes(const Item& item) const {
  if (!item.block) return rpc::SharedBytes::heap(backend_.wire_of(*item.entry));
  // Straight from the pinned block (no fp32 host entry in between), into the sealed memfd the cache on this host
  // will adopt where the put offers one (no heap copy in between either), else onto the heap.
  const bool memfd = putter_.offers_shared_memory(item.digest);
  std::unique_ptr<rpc::SealedMemfdWriter> writer;
  std::string heap;
  backend_.write_wire_of_block(
      *item.block,
      [&](uint64_t total) {
        std::string why;
        if (memfd && total >= cache::SegmentCacheClient::kMinSharedPutBytes) {
          writer = rpc::SealedMemfdWriter::create(total, &why);
          if (!writer) {
            static rpc::LogLimit limit;
            uint64_t unlogged = 0;
            if (limit.allow(&unlogged))
              spdlog::info("[req {}] wire form of {} made on the heap, not in a sealed memfd ({}); the cache put "
                           "copies it into one or streams it{}", item.request_id, rpc::digest_hex(item.digest), why,
                           unlogged ? fmt::format(" ({} more since the last such line)", unlogged) : std::string());
          }
        }
        if (!writer) heap.reserve(total);
      },
      [&](std::string_view piece) {
        if (writer) writer->append(piece);
        else heap.append(piece);
      });
  return writer ? writer->seal() : rpc::SharedBytes::heap(std::move(heap));
}

void HostCopier::run_wire() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !wire_.empty(); });
    if (stop_) break;
    Item item = std::move(wire_.front());
    wire_.pop_front();
    wire_busy_ = true;
    lock.unlock();
    bool ok = true;
    try {
      const auto& header = item.block ? item.block->header() : item.entry->header();
      putter_.enqueue(item.digest, header.token_ids, wire_bytes(item), item.request_id);
    } catch (const std::exception& e) {
      ok = false;
      spdlog::warn("[req {}] wire form of {} failed: {}", item.request_id, rpc::digest_hex(item.digest), e.what());
    }
    item.block.reset();
    item.entry.reset();
    lock.lock();
    counters_.wire_queued_bytes -= std::min<uint64_t>(counters_.wire_queued_bytes, item.bytes);
    ++(ok ? counters_.made : counters_.failed);
    wire_busy_ = false;
    if (queue_.empty() && wire_.empty() && !busy_) idle_cv_.notify_all();
  }
  wire_busy_ = false;
  idle_cv_.notify_all();
}

}  // namespace hypic::combine
