// A rate limit for log lines of events that can repeat many times a second under pressure (dropped cache puts,
// dropped host copies): at most one line per interval, which says how many were left unlogged since the last.
#pragma once
#include <chrono>
#include <cstdint>
#include <mutex>

namespace hypic::rpc {

class LogLimit {
 public:
  explicit LogLimit(std::chrono::milliseconds interval = std::chrono::seconds(10)) : interval_(interval) {}
  /// True when a line may be written now; *suppressed is then the number of events not logged since the last line.
  /// Thread-safe.
  bool allow(uint64_t* suppressed) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (logged_once_ && now - last_ < interval_) {
      ++suppressed_;
      return false;
    }
    logged_once_ = true;
    last_ = now;
    *suppressed = suppressed_;
    suppressed_ = 0;
    return true;
  }

 private:
  std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point last_{};
  bool logged_once_ = false;
  uint64_t suppressed_ = 0;
};

}  // namespace hypic::rpc
