// A worker's compute queue of segment-entry builds: standalone prefills (build_segment_entry,
// engine/splice.h) followed by serialization, run in FIFO order by a fixed number of engine
// threads, for every request the worker serves (the llama.cpp pattern: one engine loop fed by a
// thread-safe queue). Used by scatter workers for cold segments and by combine workers for the
// segments they prefill themselves.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/model.h"
#include "engine/segment.h"

namespace hypic::worker {

/// Outcome of one build.
struct BuildResult {
  std::shared_ptr<const engine::SegmentEntry> entry;  ///< null if cancelled or failed
  std::shared_ptr<const std::string> bytes;           ///< serialize_entry(*entry)
  double queue_ms = 0;    ///< waiting in the queue
  double compute_ms = 0;  ///< prefill + serialization
  bool cancelled = false; ///< skipped because its cancel flag was set before it started
  std::string error;      ///< non-empty if the build threw (the exception's message)
};

class EntryBuilder {
 public:
  /// `model` must outlive the builder. `threads` >= 1 engine threads. `inject_delay` (testing
  /// only) sleeps that long before each build, to widen fault-injection windows.
  EntryBuilder(const engine::Model& model, int threads, std::chrono::milliseconds inject_delay = {});
  /// Calls stop().
  ~EntryBuilder();
  /// Finishes the builds in progress, reports the queued ones cancelled and joins the engine
  /// threads (their callbacks run before this returns). Idempotent; submit() must not follow.
  void stop();
  EntryBuilder(const EntryBuilder&) = delete;
  EntryBuilder& operator=(const EntryBuilder&) = delete;

  /// Queues a build of `ids` with seam width `seam_width`; `done` runs on an engine thread when it
  /// finished, failed or was skipped because *cancel became true before it started.
  void submit(std::vector<int32_t> ids, int seam_width, std::shared_ptr<const std::atomic<bool>> cancel,
              std::function<void(BuildResult)> done);
  /// Tokens queued or being computed.
  int64_t queued_tokens() const { return queued_tokens_.load(); }
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  struct Job {
    std::vector<int32_t> ids;
    int seam_width;
    std::shared_ptr<const std::atomic<bool>> cancel;
    std::function<void(BuildResult)> done;
    std::chrono::steady_clock::time_point queued_at;
  };
  void run();

  const engine::Model& model_;
  std::chrono::milliseconds inject_delay_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::atomic<int64_t> queued_tokens_{0};
  std::vector<std::thread> threads_;
};

}  // namespace hypic::worker
