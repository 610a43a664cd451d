#include "scatter_worker/entry_builder.h"

#include <stdexcept>

#include "engine/splice.h"
#include "proto/rpc/server.h"

namespace hypic::worker {

EntryBuilder::EntryBuilder(const engine::Model& model, int threads, std::chrono::milliseconds inject_delay)
    : model_(model), inject_delay_(inject_delay) {
  if (threads < 1) throw std::invalid_argument("--compute-threads: must be >= 1, got " + std::to_string(threads));
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

EntryBuilder::~EntryBuilder() { stop(); }

void EntryBuilder::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void EntryBuilder::submit(std::vector<int32_t> ids, int seam_width, std::shared_ptr<const std::atomic<bool>> cancel,
                          std::function<void(BuildResult)> done) {
  queued_tokens_ += static_cast<int64_t>(ids.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back({std::move(ids), seam_width, std::move(cancel), std::move(done), std::chrono::steady_clock::now()});
  }
  cv_.notify_one();
}

void EntryBuilder::run() {
  for (;;) {
    Job job;
    bool stopping;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
      stopping = stop_;
    }
    BuildResult r;
    auto cancelled = [&] { return stopping || (job.cancel && job.cancel->load()); };
    if (inject_delay_.count() > 0 && !cancelled()) std::this_thread::sleep_for(inject_delay_);
    const auto start = std::chrono::steady_clock::now();
    r.queue_ms = rpc::ms_between(job.queued_at, start);
    if (cancelled()) {
      r.cancelled = true;
    } else {
      try {
        auto entry = std::make_shared<engine::SegmentEntry>(engine::build_segment_entry(model_, job.ids, job.seam_width));
        r.bytes = std::make_shared<const std::string>(engine::serialize_entry(*entry));
        r.entry = std::move(entry);
      } catch (const std::exception& e) {
        r.error = e.what();
      }
    }
    r.compute_ms = rpc::ms_between(start, std::chrono::steady_clock::now());
    queued_tokens_ -= static_cast<int64_t>(job.ids.size());
    job.done(std::move(r));
  }
}

}  // namespace hypic::worker
