#include "segment_cache/async_put.h"

#include <spdlog/spdlog.h>

#include "proto/rpc/log_limit.h"
#include "proto/rpc/status.h"

namespace hypic::cache {

AsyncCachePutter::AsyncCachePutter(const SegmentCacheClient& client, uint64_t max_queued_bytes)
    : client_(client), max_bytes_(max_queued_bytes), thread_([this] { run(); }) {}

AsyncCachePutter::~AsyncCachePutter() {
  std::deque<Item> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (!queue_.empty()) spdlog::info("shutting down: {} queued cache puts dropped", queue_.size());
    counters_.dropped += queue_.size();
    for (const auto& item : queue_) queued_bytes_ -= item.bytes->size();  // the put in flight stays counted
    dropped.swap(queue_);
  }
  cancel_.cancel();  // a put in flight ends now (CANCELLED), not after its deadline
  cv_.notify_all();
  thread_.join();
  for (auto& item : dropped)
    if (item.done) item.done(false);
}

bool AsyncCachePutter::enqueue(const rpc::Digest& digest, std::vector<int32_t> token_ids,
                               std::shared_ptr<const std::string> bytes, std::string request_id,
                               std::function<void(bool)> done) {
  if (!client_.enabled()) return false;
  return enqueue(digest, std::move(token_ids), rpc::SharedBytes::heap(std::move(bytes)), std::move(request_id),
                 std::move(done));
}

bool AsyncCachePutter::enqueue(const rpc::Digest& digest, std::vector<int32_t> token_ids,
                               std::shared_ptr<const rpc::SharedBytes> bytes, std::string request_id,
                               std::function<void(bool)> done) {
  if (!client_.enabled()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (queued_bytes_ + bytes->size() > max_bytes_) {
    ++counters_.dropped;
    static rpc::LogLimit limit;  // one line per 10 s under pressure (the metric counts every drop)
    uint64_t unlogged = 0;
    if (limit.allow(&unlogged)) {
      spdlog::warn("[req {}] cache put of {} ({} bytes) dropped: {} bytes already queued (limit {}, --put-queue-bytes)"
                   "{}",
                   request_id, rpc::digest_hex(digest), bytes->size(), queued_bytes_, max_bytes_,
                   unlogged ? fmt::format("; {} more dropped since the last such line", unlogged) : std::string());
    }
    return false;
  }
  queued_bytes_ += bytes->size();
  queue_.push_back({digest, std::move(token_ids), std::move(bytes), std::move(request_id), std::move(done)});
  cv_.notify_all();
  return true;
}

void AsyncCachePutter::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

size_t AsyncCachePutter::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size() + (busy_ ? 1 : 0);
}

AsyncCachePutter::Counters AsyncCachePutter::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

void AsyncCachePutter::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    Item item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    bool ok = false, shutdown = false;
    std::string error;
    try {
      client_.put(CacheKey{item.digest, item.ids}, *item.bytes, std::nullopt, &cancel_);
      ok = true;
    } catch (const rpc::RpcError& e) {
      error = e.what();
      shutdown = e.code() == grpc::StatusCode::CANCELLED;
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    queued_bytes_ -= item.bytes->size();
    shutdown = shutdown && stop_;  // cancelled by the destructor
    if (shutdown) {
      ++counters_.dropped;
      spdlog::info("[req {}] shutting down: cache put of {} in flight cancelled (entry not cached)", item.request_id,
                   rpc::digest_hex(item.digest));
    } else if (ok) {
      ++counters_.stored;
      last_failed_ = false;
      spdlog::debug("[req {}] stored {} in the segment cache ({} bytes)", item.request_id, rpc::digest_hex(item.digest),
                    item.bytes->size());
    } else {
      ++counters_.failed;
      spdlog::log(last_failed_ ? spdlog::level::debug : spdlog::level::warn,
                  "[req {}] cache put of {} failed (entry not cached): {}", item.request_id,
                  rpc::digest_hex(item.digest), error);
      last_failed_ = true;
    }
    if (item.done) {  // still busy_: wait_idle() returns after it
      lock.unlock();
      item.done(ok);
      lock.lock();
    }
    busy_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
}

}  // namespace hypic::cache
