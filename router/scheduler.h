// Assignment of cold segments to scatter workers.
//
// LPT (longest processing time first; Graham, "Bounds on multiprocessing timing anomalies", 1969):
// a request's jobs are taken longest first (most tokens; ties: lower segment index) and each goes
// to the available worker with the least queued work, where queued work counts the tokens of
// every job assigned to that worker and not yet completed, from all concurrent requests. On idle
// workers its makespan is at most (4/3 - 1/(3m)) times the optimum for m workers.
// Round-robin: jobs in segment order go to the available workers in turn, the turn carried over
// between requests; it ignores sizes and queues (the baseline to measure LPT against).
// The cost of a job is its token count (prefill time is close to linear in tokens at these sizes).
#pragma once
#include <cstdint>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

namespace hypic::router {

enum class SchedulePolicy { Lpt, RoundRobin };
/// "lpt" or "round-robin"; throws std::invalid_argument naming the valid names otherwise.
SchedulePolicy parse_schedule_policy(std::string_view name);
const char* schedule_policy_name(SchedulePolicy policy);

struct ScatterJob {
  uint32_t segment = 0;  ///< index of the segment in its request
  int64_t tokens = 0;    ///< cost, >= 1
};

struct Assignment {
  uint32_t segment = 0;
  size_t worker = 0;
  int64_t tokens = 0;
};

/// Queued work per scatter worker and the assignment policy. Thread-safe.
class ScatterScheduler {
 public:
  /// Throws std::invalid_argument if num_workers == 0.
  ScatterScheduler(size_t num_workers, SchedulePolicy policy);

  /// Assigns every job to an available worker not marked in `exclude` (indexed by worker; may be
  /// shorter than the worker count) and adds the tokens to that worker's queued work. Returns the
  /// assignments in dispatch order (for LPT, longest first, which is also the order each worker
  /// should compute its share in). Returns an empty vector when no worker qualifies (and then
  /// changes nothing). Throws std::invalid_argument for a job with tokens < 1.
  std::vector<Assignment> assign(std::span<const ScatterJob> jobs, const std::vector<bool>& exclude = {});
  /// Removes a finished (or abandoned) job's tokens from the worker's queued work.
  void complete(size_t worker, int64_t tokens);

  void set_available(size_t worker, bool available);
  bool available(size_t worker) const;
  size_t num_available() const;
  int64_t queued_tokens(size_t worker) const;
  size_t num_workers() const { return queued_.size(); }
  SchedulePolicy policy() const { return policy_; }

 private:
  void check_worker(size_t worker) const;
  SchedulePolicy policy_;
  mutable std::mutex mu_;
  std::vector<int64_t> queued_;
  std::vector<bool> available_;
  size_t cursor_ = 0;  // round-robin turn
};

}  // namespace hypic::router
