#include "segment_cache/events.h"

#include <algorithm>
#include <stdexcept>

namespace hypic::cache {

CacheEventHub::CacheEventHub(size_t max_queued) : max_queued_(max_queued) {
  if (max_queued_ < 1) throw std::invalid_argument("--max-queued-events must be >= 1");
}

void CacheEventHub::publish(const StoreEvent& e) {
  const int64_t micros = std::chrono::duration_cast<std::chrono::microseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  std::lock_guard<std::mutex> lock(mu_);
  const SequencedEvent se{e, ++sequence_, micros};
  for (const auto& s : subs_) {
    {
      std::lock_guard<std::mutex> sl(s->mu_);
      if (s->overflowed_) continue;
      if (s->queue_.size() >= max_queued_) {
        s->overflowed_ = true;
        s->queue_.clear();
      } else {
        s->queue_.push_back(se);
      }
    }
    s->cv_.notify_all();
  }
}

std::shared_ptr<CacheEventHub::Subscriber> CacheEventHub::subscribe() {
  auto s = std::make_shared<Subscriber>();
  std::lock_guard<std::mutex> lock(mu_);
  subs_.push_back(s);
  return s;
}

void CacheEventHub::unsubscribe(const std::shared_ptr<Subscriber>& s) {
  std::lock_guard<std::mutex> lock(mu_);
  subs_.erase(std::remove(subs_.begin(), subs_.end(), s), subs_.end());
}

size_t CacheEventHub::subscribers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return subs_.size();
}

uint64_t CacheEventHub::published() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sequence_;
}

std::vector<SequencedEvent> CacheEventHub::Subscriber::wait(std::chrono::milliseconds timeout, bool* overflowed) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return overflowed_ || !queue_.empty(); });
  *overflowed = overflowed_;
  std::vector<SequencedEvent> out(queue_.begin(), queue_.end());
  queue_.clear();
  return out;
}

}  // namespace hypic::cache
