#include "engine/engine_loop.h"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

namespace hypic::engine {
namespace {

double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

EngineErrorKind classify_engine_error(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const EntryError&) {
    return EngineErrorKind::Entry;
  } catch (const ResourceExhausted&) {
    return EngineErrorKind::ResourceExhausted;
  } catch (const std::invalid_argument&) {
    return EngineErrorKind::InvalidArgument;
  } catch (...) {
    return EngineErrorKind::Internal;
  }
}

EngineLoop::EngineLoop(Backend& backend, EngineLoopOptions options)
    : backend_(backend), options_(options), concurrent_(backend.concurrent_decode()) {
  if (options_.max_build_tokens < 1)
    throw std::invalid_argument("engine loop: max_build_tokens must be >= 1, got " +
                                std::to_string(options_.max_build_tokens));
  if (options_.max_build_tokens_decoding < 1)
    throw std::invalid_argument("engine loop: max_build_tokens_decoding must be >= 1, got " +
                                std::to_string(options_.max_build_tokens_decoding));
  if (options_.max_pass_tokens_decoding < 0)
    throw std::invalid_argument("engine loop: max_pass_tokens_decoding must be >= 0, got " +
                                std::to_string(options_.max_pass_tokens_decoding));
  if (options_.max_pass_tokens < 0)
    throw std::invalid_argument("engine loop: max_pass_tokens must be >= 0, got " +
                                std::to_string(options_.max_pass_tokens));
  egress_thread_ = std::thread([this] { run_egress(); });
  if (concurrent_) decode_thread_ = std::thread([this] { run_decode(); });
  thread_ = std::thread([this] { run(); });
}

EngineLoop::~EngineLoop() { stop(); }

void EngineLoop::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // The decode thread last: the loop thread may hand it a sequence while finishing its splice.
  {
    std::lock_guard<std::mutex> lock(dec_mu_);
    dec_stop_ = true;
  }
  dec_cv_.notify_all();
  if (decode_thread_.joinable()) decode_thread_.join();
  // The builds already made still get their wire form (the egress thread drains its queue, then ends).
  {
    std::lock_guard<std::mutex> lock(egress_mu_);
    egress_stop_ = true;
  }
  egress_cv_.notify_all();
  if (egress_thread_.joinable()) egress_thread_.join();
}

void EngineLoop::run_egress() {
  for (;;) {
    Egress e;
    {
      std::unique_lock<std::mutex> lock(egress_mu_);
      egress_cv_.wait(lock, [&] { return egress_stop_ || !egress_.empty(); });
      if (egress_.empty()) return;
      e = std::move(egress_.front());
      egress_.pop_front();
    }
    BuildOutcome& r = e.outcome;
    const auto s0 = Clock::now();
    try {
      // Straight from the device copy where entries live on a device (no fp32 host entry in between).
      r.bytes = std::make_shared<const std::string>(backend_.wire_of(*r.entry));
      if (!backend_.device_entries()) r.host = r.entry->host();
    } catch (...) {
      r.error_kind = classify_engine_error(std::current_exception());
      r.error = message_of(std::current_exception());
      r.host.reset();
      r.entry.reset();
    }
    r.compute_ms += ms_between(s0, Clock::now());
    queued_tokens_ -= e.tokens;
    e.done(std::move(r));
  }
}

void EngineLoop::submit_build(std::vector<int32_t> ids, int seam_width, CancelFlag cancel,
                              std::function<void(BuildOutcome)> done, BuildHandover handover, CancelFlag stop) {
  std::vector<BuildSubmission> one;
  one.push_back({std::move(ids), seam_width, std::move(cancel), std::move(done), handover, std::move(stop)});
  submit_builds(std::move(one));
}

int64_t EngineLoop::background_tokens() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const BuildJob& b : builds_)
    if (b.in_background()) n += int64_t(b.ids.size());
  return n;
}

void EngineLoop::submit_builds(std::vector<BuildSubmission> builds) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      const auto now = Clock::now();
      for (auto& b : builds) {
        queued_tokens_ += int64_t(b.ids.size());
        builds_.push_back({std::move(b.ids), b.seam_width, std::move(b.cancel), std::move(b.done), now, b.handover,
                           std::move(b.stop), std::move(b.background)});
      }
      cv_.notify_all();
      return;
    }
  }
  for (auto& b : builds) {
    BuildOutcome r;
    r.cancelled = true;
    b.done(std::move(r));
  }
}

void EngineLoop::submit_splice(SpliceJob job, CancelFlag cancel, std::function<void(SpliceOutcome)> done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      splices_.push_back({std::move(job), std::move(cancel), std::move(done), nullptr, Clock::now()});
      cv_.notify_all();
      return;
    }
  }
  SpliceOutcome r;
  r.cancelled = true;
  r.error = "engine loop stopped";
  done(std::move(r));
}

void EngineLoop::submit_generate(GenerateJob job) {
  auto gen = std::make_shared<GenerateJob>(std::move(job));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      SpliceTask t;
      t.job = std::move(gen->splice);
      t.cancel = gen->cancel;
      t.gen = gen;
      t.queued_at = Clock::now();
      splices_.push_back(std::move(t));
      cv_.notify_all();
      return;
    }
  }
  GenerateEnd end;
  end.reason = GenerateEndReason::Cancelled;
  end.error = "engine loop stopped";
  if (gen->on_end) gen->on_end(end);
}

void EngineLoop::run() {
  for (;;) {
    std::vector<BuildJob> batch;
    std::optional<SpliceTask> splice;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !builds_.empty() || !splices_.empty() || (!concurrent_ && !active_.empty()); });
      if (stop_) break;
      // One unit of non-decode work per iteration, alternating between the queues when both wait; background builds
      // only when nothing else waits.
      const auto first_fg = std::find_if(builds_.begin(), builds_.end(), [](const BuildJob& b) {
        return !b.in_background();
      });
      const bool take_build = first_fg != builds_.end() && (builds_turn_ || splices_.empty());
      const bool take_background = !take_build && first_fg == builds_.end() && !builds_.empty() && splices_.empty();
      if (take_build || take_background) {
        // Every queued build of the first one's kind and seam width, FIFO, up to the token budget (the first always
        // goes); a smaller budget while sequences decode, so that their next step comes sooner, and for background
        // builds, so that a request arriving meanwhile starts sooner.
        const int w = take_build ? first_fg->seam_width : builds_.front().seam_width;
        const int64_t budget = !decoding() && take_build
                                   ? options_.max_build_tokens
                                   : std::min(options_.max_build_tokens, options_.max_build_tokens_decoding);
        int64_t tokens = 0;
        for (auto it = builds_.begin(); it != builds_.end();) {
          const int64_t n = int64_t(it->ids.size());
          if (it->seam_width != w || it->in_background() == take_build) {
            ++it;
            continue;
          }
          if (!batch.empty() && tokens + n > budget) break;
          tokens += n;
          batch.push_back(std::move(*it));
          it = builds_.erase(it);
        }
        if (take_build) builds_turn_ = false;
      } else if (!splices_.empty()) {
        splice = std::move(splices_.front());
        splices_.pop_front();
        builds_turn_ = true;
      }
    }
    if (!concurrent_ && !active_.empty()) decode_step();
    if (!batch.empty()) run_builds(std::move(batch));
    if (splice) run_splice(std::move(*splice));
  }
  // Stopping: the work in progress has finished; report the rest.
  std::deque<BuildJob> builds;
  std::deque<SpliceTask> splices;
  {
    std::lock_guard<std::mutex> lock(mu_);
    builds.swap(builds_);
    splices.swap(splices_);
  }
  for (auto& b : builds) {
    queued_tokens_ -= int64_t(b.ids.size());
    BuildOutcome r;
    r.cancelled = true;
    r.queue_ms = ms_between(b.queued_at, Clock::now());
    b.done(std::move(r));
  }
  for (auto& s : splices) {
    if (s.gen) {
      GenerateEnd end;
      end.reason = GenerateEndReason::Cancelled;
      end.error = "engine loop stopped";
      if (s.gen->on_end) s.gen->on_end(end);
    } else {
      SpliceOutcome r;
      r.cancelled = true;
      r.error = "engine loop stopped";
      s.done(std::move(r));
    }
  }
  if (!concurrent_) end_active("engine loop stopped");
}

void EngineLoop::end_active(const char* why) {
  set_active(0);  // before the callbacks: a caller woken by on_end sees the count without this sequence
  for (auto& a : active_) {
    GenerateEnd end;
    end.reason = GenerateEndReason::Cancelled;
    end.tokens = a.produced;
    end.error = why;
    if (a.gen->on_end) a.gen->on_end(end);
  }
  active_.clear();
  set_active(0);
}

void EngineLoop::run_decode() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(dec_mu_);
      dec_cv_.wait(lock, [&] { return dec_stop_ || !joining_.empty() || !active_.empty(); });
      for (auto& a : joining_) active_.push_back(std::move(a));
      joining_.clear();
      if (dec_stop_) break;
    }
    decode_step();
  }
  end_active("engine loop stopped");
}

void EngineLoop::set_active(int n) {
  active_count_ = n;
  tell_backend();
}

void EngineLoop::add_active(int delta) {
  active_count_ += delta;
  tell_backend();
}

void EngineLoop::tell_backend() {
  if (!concurrent_) return;
  // Under a mutex, reading the count inside it: the last call passes the newest value whichever thread changed it.
  std::lock_guard<std::mutex> lock(hint_mu_);
  backend_.set_decoding_sequences(active_count_.load());
}

void EngineLoop::publish_active_count() {
  if (!concurrent_) {
    set_active(int(active_.size()));
    return;
  }
  std::lock_guard<std::mutex> lock(dec_mu_);
  set_active(int(active_.size() + joining_.size()));
}

void EngineLoop::run_builds(std::vector<BuildJob> batch) {
  const auto started = Clock::now();
  std::vector<size_t> run;  // indices of the jobs still wanted
  for (size_t i = 0; i < batch.size(); ++i) {
    if (is_cancelled(batch[i].cancel)) continue;
    run.push_back(i);
  }
  // TESTING ONLY: the injected delay is part of the run (a cancel from now on does not skip the build).
  if (options_.inject_delay.count() > 0) std::this_thread::sleep_for(options_.inject_delay * int(run.size()));
  std::vector<BuildOutcome> out(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    out[i].queue_ms = ms_between(batch[i].queued_at, started);
    out[i].cancelled = true;
  }
  // Each outcome is handed over as soon as it is complete: a Resident build right after the batch, a Wire build
  // through the egress thread (its wire form made there while the loop goes on).
  std::vector<bool> handed(batch.size(), false);
  auto hand_over = [&](size_t i) {
    handed[i] = true;
    if (out[i].entry && batch[i].handover == BuildHandover::Wire) {
      {
        std::lock_guard<std::mutex> lock(egress_mu_);
        egress_.push_back({std::move(out[i]), std::move(batch[i].done), int64_t(batch[i].ids.size())});
      }
      egress_cv_.notify_all();
      return;
    }
    queued_tokens_ -= int64_t(batch[i].ids.size());
    try {  // (a callback that throws must not end the loop's thread nor skip the batch's other callbacks)
      batch[i].done(std::move(out[i]));
    } catch (const std::exception& e) {
      spdlog::error("engine loop: a build's callback failed: {}", e.what());
    }
  };
  // Jobs whose ids the backend would refuse fail alone, not their batch.
  std::vector<size_t> good;
  for (size_t i : run) {
    out[i].cancelled = false;
    try {
      check_token_ids(batch[i].ids, backend_.config().vocab_size, "token ids");
      if (batch[i].seam_width < 0)
        throw std::invalid_argument("seam width must be >= 0, got " + std::to_string(batch[i].seam_width));
      good.push_back(i);
    } catch (...) {
      out[i].error_kind = classify_engine_error(std::current_exception());
      out[i].error = message_of(std::current_exception());
    }
  }
  // Cancelled and refused jobs are complete already: handed over before the build runs.
  {
    std::vector<bool> is_good(batch.size(), false);
    for (size_t i : good) is_good[i] = true;
    for (size_t i = 0; i < batch.size(); ++i)
      if (!is_good[i]) hand_over(i);
  }
  if (!good.empty()) {
    std::vector<std::vector<int32_t>> segs;
    int64_t tokens = 0;
    for (size_t i : good) {
      segs.push_back(batch[i].ids);
      tokens += int64_t(batch[i].ids.size());
    }
    const auto t0 = Clock::now();
    std::vector<std::shared_ptr<const ResidentEntry>> entries;
    std::exception_ptr failed;
    try {
      // A build cancelled while the batch runs stops within about a layer (its entry null: reported cancelled).
      entries = backend_.build_entries(segs, batch[good.front()].seam_width, [&](size_t k) {
        const BuildJob& j = batch[good[k]];
        return is_cancelled(j.stop ? j.stop : j.cancel);
      });
      if (entries.size() != segs.size()) throw std::logic_error("build_entries returned a wrong number of entries");
      build_batches_++;
    } catch (...) {
      failed = std::current_exception();
    }
    double batch_ms = ms_between(t0, Clock::now());
    // Out of memory for the batch together (its partial entries are gone): each segment alone, so that those that
    // fit are built and one request's segment does not fail another's that shared its batch. Each is handed over as
    // soon as it is built, so that a caller that lets its entry go (a host copy made, then dropped) gives its device
    // memory back before the next one is built (freed at that build's start).
    std::vector<std::exception_ptr> errors(good.size(), failed);
    std::vector<int> batch_segments(good.size(), int(good.size()));
    std::vector<double> compute_ms(good.size(), 0);
    if (failed && good.size() > 1 && classify_engine_error(failed) == EngineErrorKind::ResourceExhausted) {
      entries.assign(good.size(), nullptr);
      for (size_t k = 0; k < good.size(); ++k) {
        const BuildJob& j = batch[good[k]];
        const auto t1 = Clock::now();
        // Out of memory after earlier ones were handed over: their callers may still be letting them go (a host copy
        // in progress), so where some memory comes to wait to be freed within kWaitForFrees it is tried again, once.
        for (int attempt = 0; attempt < 2; ++attempt) {
          try {
            auto one = backend_.build_entries(std::span(segs).subspan(k, 1), j.seam_width,
                                              [&](size_t) { return is_cancelled(j.stop ? j.stop : j.cancel); });
            if (one.size() != 1) throw std::logic_error("build_entries returned a wrong number of entries");
            entries[k] = std::move(one[0]);
            errors[k] = nullptr;
            batch_segments[k] = 1;
            build_batches_++;
            break;
          } catch (...) {
            errors[k] = std::current_exception();
          }
          if (attempt > 0 || k == 0 || classify_engine_error(errors[k]) != EngineErrorKind::ResourceExhausted) break;
          constexpr auto kWaitForFrees = std::chrono::milliseconds(250);
          const auto until = Clock::now() + kWaitForFrees;
          bool freed = false;
          while (!(freed = backend_.memory().freed_pending > 0) && Clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
          if (!freed) break;  // nothing is coming back: the segment fails
        }
        compute_ms[k] = ms_between(t1, Clock::now());
        if (!errors[k]) {
          BuildOutcome& r = out[good[k]];
          r.batch_ms = ms_between(t0, Clock::now());
          r.batch_segments = 1;
          r.entry = std::move(entries[k]);
          r.cancelled = !r.entry;  // stopped part way by its cancel flag
          r.compute_ms = compute_ms[k];
          hand_over(good[k]);
        }
      }
      batch_ms = ms_between(t0, Clock::now());
    } else if (!failed) {
      for (size_t k = 0; k < good.size(); ++k) compute_ms[k] = batch_ms * double(segs[k].size()) / double(tokens);
    }
    for (size_t k = 0; k < good.size(); ++k) {
      if (handed[good[k]]) continue;  // (built alone and handed over already)
      BuildOutcome& r = out[good[k]];
      r.batch_ms = batch_ms;
      r.batch_segments = batch_segments[k];
      if (errors[k]) {
        r.error_kind = classify_engine_error(errors[k]);
        r.error = message_of(errors[k]);
        continue;
      }
      r.entry = std::move(entries[k]);
      r.cancelled = !r.entry;  // stopped part way by its cancel flag
      r.compute_ms = compute_ms[k];
      hand_over(good[k]);
    }
  }
  for (size_t i = 0; i < batch.size(); ++i)
    if (!handed[i]) hand_over(i);
}

void EngineLoop::run_splice(SpliceTask task) {
  const auto t0 = Clock::now();
  SpliceOutcome r;
  r.info.queue_ms = ms_between(task.queued_at, t0);
  auto fail_gen = [&](GenerateEndReason reason, EngineErrorKind kind, std::string msg) {
    GenerateEnd end;
    end.reason = reason;
    end.error_kind = kind;
    end.error = std::move(msg);
    if (task.gen->on_end) task.gen->on_end(end);
  };
  if (is_cancelled(task.cancel)) {
    if (task.gen) return fail_gen(GenerateEndReason::Cancelled, EngineErrorKind::None, "cancelled by the caller");
    r.cancelled = true;
    r.error = "cancelled by the caller";
    return task.done(std::move(r));
  }
  std::unique_ptr<Sampler> sampler;
  try {
    if (task.gen) {
      if (task.gen->max_tokens < 1)
        throw std::invalid_argument("max_tokens must be >= 1, got " + std::to_string(task.gen->max_tokens));
      sampler = std::make_unique<Sampler>(task.gen->sampling);
    }
    SplicePlan& plan = task.job.plan;
    const auto& hosts = task.job.host_entries;
    if (!hosts.empty() && hosts.size() != plan.segments.size())
      throw std::invalid_argument("splice job: " + std::to_string(hosts.size()) + " host entries for " +
                                  std::to_string(plan.segments.size()) + " segments");
    r.info.imported.resize(hosts.size());
    for (size_t i = 0; i < hosts.size(); ++i) {
      if (plan.segments[i].entry || !hosts[i]) continue;
      for (size_t k = 0; k < i && !plan.segments[i].entry; ++k)  // the same entry again: imported once
        if (hosts[k] == hosts[i] && r.info.imported[k]) plan.segments[i].entry = r.info.imported[k];
      if (plan.segments[i].entry) continue;
      plan.segments[i].entry = backend_.import_entry(hosts[i]);
      r.info.imported[i] = plan.segments[i].entry;
    }
    plan.cancel = task.cancel;  // a splice of several passes stops between them once the request is cancelled
    // Chunked prefill while sequences decode: decode steps of the running sequences between passes, or, where they
    // run on their own thread, beside passes small enough not to slow them much; the cancel flag is read there too.
    plan.max_pass_tokens = decoding() ? options_.max_pass_tokens_decoding : options_.max_pass_tokens;
    plan.between_passes = [this, &r] {
      if (!concurrent_) decode_step();
      ++r.info.passes_paused;
    };
    r.output = backend_.splice(plan);
  } catch (const SpliceCancelled& e) {
    if (task.gen) return fail_gen(GenerateEndReason::Cancelled, EngineErrorKind::None, e.what());
    r.cancelled = true;
    r.error = e.what();
    return task.done(std::move(r));
  } catch (...) {
    const auto kind = classify_engine_error(std::current_exception());
    std::string msg = message_of(std::current_exception());
    if (task.gen) return fail_gen(GenerateEndReason::Failed, kind, std::move(msg));
    r.error_kind = kind;
    r.error = std::move(msg);
    return task.done(std::move(r));
  }
  r.info.splice_ms = ms_between(t0, Clock::now());
  r.info.num_tokens = r.output.num_tokens;
  r.info.computed_tokens = r.output.computed_tokens;
  r.info.staged_segments = r.output.staged_segments;
  r.info.staged_groups = r.output.staged_groups;
  r.info.staging_bytes = r.output.staging_bytes;
  r.info.recomputed_segments = r.output.recomputed_segments;
  r.info.prefix_segments_reused = r.output.prefix_segments_reused;
  if (!task.gen) return task.done(std::move(r));

  if (task.gen->on_spliced) task.gen->on_spliced(r.info);
  Active a;
  a.gen = task.gen;
  a.sequence = std::move(r.output.sequence);
  a.sampler = std::move(sampler);
  const size_t vocab = size_t(backend_.config().vocab_size);
  const std::vector<float>& logits = r.output.logits;
  int32_t first = 0;
  try {  // a sampler error (e.g. NaN logits) ends this request only
    first = a.sampler->sample(std::span<const float>(logits).subspan(logits.size() - vocab, vocab));
  } catch (...) {
    return fail_gen(GenerateEndReason::Failed, classify_engine_error(std::current_exception()),
                    "sampling failed: " + message_of(std::current_exception()));
  }
  if (is_cancelled(a.gen->cancel)) {
    GenerateEnd end;
    end.reason = GenerateEndReason::Cancelled;
    end.error = "cancelled by the caller";
    if (a.gen->on_end) a.gen->on_end(end);
    return;
  }
  if (emit(a, first, /*counted=*/false)) return;
  if (!concurrent_) {
    active_.push_back(std::move(a));
    set_active(int(active_.size()));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(dec_mu_);
    joining_.push_back(std::move(a));
    add_active(1);
  }
  dec_cv_.notify_all();
}

bool EngineLoop::emit(Active& a, int32_t token, bool counted) {
  ++a.produced;
  if (a.gen->on_token) a.gen->on_token(token);
  GenerateEnd end;
  end.tokens = a.produced;
  if (a.sampler->is_stop_token(token)) {
    end.reason = GenerateEndReason::StopToken;
  } else if (a.produced >= a.gen->max_tokens) {
    end.reason = GenerateEndReason::Length;
  } else {
    a.next_token = token;
    return false;
  }
  if (counted) add_active(-1);  // before on_end (see end_active)
  if (a.gen->on_end) a.gen->on_end(end);
  return true;
}

void EngineLoop::decode_step() {
  // Cancelled sequences leave the batch before the step.
  for (size_t i = 0; i < active_.size();) {
    if (is_cancelled(active_[i].gen->cancel)) {
      GenerateEnd end;
      end.reason = GenerateEndReason::Cancelled;
      end.tokens = active_[i].produced;
      end.error = "cancelled by the caller";
      add_active(-1);  // before on_end (see end_active)
      if (active_[i].gen->on_end) active_[i].gen->on_end(end);
      active_.erase(active_.begin() + ptrdiff_t(i));
    } else {
      ++i;
    }
  }
  publish_active_count();
  if (active_.empty()) return;
  std::vector<Sequence*> seqs;
  std::vector<int32_t> tokens;
  for (auto& a : active_) {
    seqs.push_back(a.sequence.get());
    tokens.push_back(a.next_token);
  }
  // Greedy rows take their argmax, sampling rows the token of the uniform their Sampler draws now (the CUDA backend
  // picks both on the device: no logits copy); the draws are made once, so a retry below reuses them.
  std::vector<uint8_t> modes(active_.size(), Backend::kStepGreedy);
  std::vector<Backend::SampleDraw> draws(active_.size());
  for (size_t b = 0; b < active_.size(); ++b) {
    const SamplingConfig& c = active_[b].sampler->config();
    if (c.temperature == 0.0f) continue;
    modes[b] = Backend::kStepSample;
    draws[b] = {c.temperature, c.top_k, c.top_p, active_[b].sampler->next_uniform()};
  }
  Backend::DecodeStepOutput out;
  auto fail = [this](Active& a, EngineErrorKind kind, const std::string& msg) {
    GenerateEnd end;
    end.reason = GenerateEndReason::Failed;
    end.tokens = a.produced;
    end.error_kind = kind;
    end.error = msg;
    add_active(-1);  // before on_end (see end_active)
    if (a.gen->on_end) a.gen->on_end(end);
  };
  try {
    backend_.decode_step(seqs, tokens, modes, out, draws);
  } catch (...) {
    // A backend refuses a whole batch before advancing any sequence (engine/backend.h), e.g. when one sequence needs
    // a KV page the pool no longer has: step each sequence alone so that only the ones that fail end.
    const auto kind = classify_engine_error(std::current_exception());
    const std::string msg = "decode failed: " + message_of(std::current_exception());
    if (active_.size() == 1) {
      fail(active_[0], kind, msg);
      active_.clear();
      publish_active_count();
      return;
    }
    Backend::DecodeStepOutput kept_out;
    std::vector<Active> kept;
    for (size_t b = 0; b < active_.size(); ++b) {
      Sequence* one[1] = {seqs[b]};
      Backend::DecodeStepOutput o1;
      try {
        backend_.decode_step(std::span<Sequence* const>(one, 1), std::span<const int32_t>(&tokens[b], 1),
                             std::span<const uint8_t>(&modes[b], 1), o1,
                             std::span<const Backend::SampleDraw>(&draws[b], 1));
      } catch (...) {
        fail(active_[b], classify_engine_error(std::current_exception()),
             "decode failed: " + message_of(std::current_exception()));
        continue;
      }
      kept.push_back(std::move(active_[b]));
      kept_out.argmax.push_back(o1.argmax.at(0));
    }
    active_ = std::move(kept);
    out = std::move(kept_out);
    publish_active_count();
    if (active_.empty()) return;
  }
  decode_iterations_++;
  decode_steps_ += active_.size();
  const size_t vocab = size_t(backend_.config().vocab_size);
  std::vector<Active> still;
  still.reserve(active_.size());
  for (size_t b = 0; b < active_.size(); ++b) {
    Active& a = active_[b];
    int32_t tok = 0;
    try {  // a sampler error (e.g. NaN logits) ends this request only; the messages are Sampler::sample's
      tok = out.argmax.at(b);
      if (tok == Backend::kNoFiniteLogitCode) throw std::invalid_argument("logits: no finite logit to sample from");
      if (tok <= -2)
        throw std::invalid_argument("logits: NaN at token id " + std::to_string(Backend::nan_logits_id(tok)));
      if (tok < 0 || tok >= int32_t(vocab))
        throw std::logic_error("decode_step returned token " + std::to_string(tok) + " for row " + std::to_string(b));
    } catch (...) {
      fail(a, classify_engine_error(std::current_exception()), "sampling failed: " + message_of(std::current_exception()));
      continue;
    }
    if (!emit(a, tok, /*counted=*/true)) still.push_back(std::move(a));
  }
  active_ = std::move(still);
  publish_active_count();
}

}  // namespace hypic::engine
