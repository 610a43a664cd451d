#include "engine/cpu/cpu_backend.h"

#include <algorithm>
#include <exception>
#include <set>
#include <thread>

namespace hypic::engine {
namespace {

// Runs body(i) for i in [0, n) on up to `threads` threads (the caller's included); rethrows the exception of the
// lowest failing i after every item ran.
template <class Body>
void parallel_for(size_t n, int threads, const Body& body) {
  std::vector<std::exception_ptr> errors(n);
  const size_t workers = std::min<size_t>(n, size_t(std::max(1, threads)));
  std::atomic<size_t> next{0};
  auto drain = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        body(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < workers; ++t) pool.emplace_back(drain);
  drain();
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

void check_options(const BackendOptions& o) {
  if (o.cpu_threads < 1)
    throw std::invalid_argument("cpu backend: cpu_threads must be >= 1, got " + std::to_string(o.cpu_threads));
  if (o.random_weights_seed != 0)
    throw std::invalid_argument("cpu backend: random weights on the device (--random-weights-seed) are a CUDA "
                                "benchmark option; on the CPU write a random checkpoint with `hypic-model init --seed N`");
}

}  // namespace

// ---- sequences and entries -------------------------------------------------------------------------

CpuSequence::CpuSequence(const void* owner, ModelState state, int64_t position,
                         std::shared_ptr<std::atomic<int64_t>> live_bytes)
    : owner_(owner), state_(std::move(state)), position_(position), live_bytes_(std::move(live_bytes)) {
  recount();
}

CpuSequence::~CpuSequence() { *live_bytes_ -= counted_; }

void CpuSequence::recount() {
  const int64_t now = int64_t(model_state_bytes(state_));
  *live_bytes_ += now - counted_;
  counted_ = now;
}

CpuEntry::CpuEntry(std::shared_ptr<const SegmentEntry> entry, std::shared_ptr<std::atomic<int64_t>> live_bytes)
    : entry_(std::move(entry)), bytes_(entry_->byte_size()), live_bytes_(std::move(live_bytes)) {
  *live_bytes_ += int64_t(bytes_);
}

CpuEntry::~CpuEntry() { *live_bytes_ -= int64_t(bytes_); }

// ---- backend ---------------------------------------------------------------------------------------

std::unique_ptr<CpuBackend> CpuBackend::load(const std::filesystem::path& model_dir, const BackendOptions& options) {
  check_options(options);
  return std::make_unique<CpuBackend>(Model::load(model_dir), options);
}

CpuBackend::CpuBackend(Model model, const BackendOptions& options)
    : model_(std::move(model)), options_(options),
      fingerprint_(model_fingerprint(model_.config(), backend_numerics(BackendKind::Cpu))),
      geometry_(EntryGeometry::of(model_.config())),
      weight_bytes_(size_t(model_.weights().parameter_count()) * sizeof(float)),
      prefix_(options.prefix_cache_bytes) {
  check_options(options);
}

std::shared_ptr<const ResidentEntry> CpuBackend::wrap(std::shared_ptr<const SegmentEntry> entry) {
  return std::shared_ptr<const ResidentEntry>(new CpuEntry(std::move(entry), entries_used_));
}

std::vector<std::shared_ptr<const ResidentEntry>> CpuBackend::build_entries(
    std::span<const std::vector<int32_t>> segments, int seam_width, const BuildCancelled& cancelled) {
  if (seam_width < 0)
    throw std::invalid_argument("build_entries: seam width must be >= 0, got " + std::to_string(seam_width));
  for (size_t i = 0; i < segments.size(); ++i)
    check_token_ids(segments[i], config().vocab_size, "build_entries: segment " + std::to_string(i) + " token ids");
  std::vector<std::shared_ptr<const SegmentEntry>> built(segments.size());
  parallel_for(segments.size(), options_.cpu_threads, [&](size_t i) {
    const std::function<bool()> stop = cancelled ? std::function<bool()>([&cancelled, i] { return cancelled(i); })
                                                 : std::function<bool()>();
    if (stop && stop()) return;  // null: not wanted any more
    try {
      built[i] = std::make_shared<const SegmentEntry>(build_segment_entry(model_, segments[i], seam_width, stop));
    } catch (const PrefillCancelled&) {  // stopped between two layers: null
    }
  });
  std::vector<std::shared_ptr<const ResidentEntry>> out;
  out.reserve(built.size());
  for (auto& e : built) out.push_back(e ? wrap(std::move(e)) : nullptr);
  return out;
}

std::shared_ptr<const ResidentEntry> CpuBackend::import_entry(std::shared_ptr<const SegmentEntry> entry) {
  if (!entry) throw std::invalid_argument("import_entry: no entry");
  entry->check_consistent();
  entry->check_compatible(fingerprint_, geometry_, -1, numerics());
  return wrap(std::move(entry));
}

SpliceOutput CpuBackend::splice(const SplicePlan& plan) {
  SpliceRequest req;
  req.mode = plan.mode;
  req.seam_width = plan.seam_width;
  req.query = plan.query;
  req.all_query_logits = plan.all_query_logits;
  req.keep_context_state = plan.keep_context_state;
  req.recompute_segments = plan.recompute_segments;
  req.refresh_segments = plan.refresh_segments;
  req.refresh_tail = plan.refresh_tail;
  req.cancel = plan.cancel;
  req.max_pass_tokens = plan.max_pass_tokens;
  req.between_passes = plan.between_passes;
  req.on_schedule = plan.on_schedule;
  req.prefix_cache = plan.use_prefix_cache ? &prefix_ : nullptr;
  req.segments.reserve(plan.segments.size());
  for (size_t i = 0; i < plan.segments.size(); ++i) {
    const PlanSegment& s = plan.segments[i];
    if (s.block && !s.entry)
      throw std::invalid_argument("splice: segment " + std::to_string(i) + " brings a host block; the " +
                                  std::string(numerics()) + " backend keeps entries in host memory (give its entry)");
    std::shared_ptr<const SegmentEntry> host;
    if (s.entry) {
      if (!dynamic_cast<const CpuEntry*>(s.entry.get()))
        throw std::invalid_argument("splice: segment " + std::to_string(i) +
                                    "'s entry is resident on another backend (import_entry its host() copy first)");
      host = s.entry->host();
    }
    req.segments.push_back({s.ids, std::move(host)});
  }
  SpliceResult r = engine::splice(model_, req);
  SpliceOutput out;
  out.sequence.reset(new CpuSequence(this, std::move(r.state), r.num_tokens, kv_used_));
  out.logits = std::move(r.logits);
  out.num_tokens = r.num_tokens;
  out.computed_tokens = r.computed_tokens;
  out.prefix_segments_reused = r.prefix_segments_reused;
  out.recomputed_segments = std::move(r.recomputed_segments);
  out.context_states = std::move(r.context_states);
  return out;
}

void CpuBackend::decode(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
                        std::vector<float>& logits) {
  if (sequences.size() != tokens.size())
    throw std::invalid_argument("decode: " + std::to_string(sequences.size()) + " sequences but " +
                                std::to_string(tokens.size()) + " tokens");
  const int64_t vocab = config().vocab_size;
  std::vector<CpuSequence*> seqs(sequences.size());
  std::set<const Sequence*> seen;
  for (size_t b = 0; b < sequences.size(); ++b) {
    auto* s = dynamic_cast<CpuSequence*>(sequences[b]);
    if (!s || s->owner_ != this)
      throw std::invalid_argument("decode: sequence " + std::to_string(b) + " was not made by this backend");
    if (!seen.insert(s).second) throw std::invalid_argument("decode: sequence " + std::to_string(b) + " appears twice");
    if (tokens[b] < 0 || tokens[b] >= vocab)
      throw std::invalid_argument("decode: token " + std::to_string(b) + " (" + std::to_string(tokens[b]) +
                                  ") is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    seqs[b] = s;
  }
  logits.assign(sequences.size() * size_t(vocab), 0.0f);
  parallel_for(seqs.size(), options_.cpu_threads, [&](size_t b) {
    CpuSequence& s = *seqs[b];
    const std::vector<float> row = model_.decode(s.state_, tokens[b], s.position_);
    std::copy(row.begin(), row.end(), logits.begin() + ptrdiff_t(b * size_t(vocab)));
    ++s.position_;
  });
  for (CpuSequence* s : seqs) s->recount();
}

BackendMemory CpuBackend::memory() const {
  BackendMemory m;
  m.weights = weight_bytes_;
  m.kv_used = size_t(std::max<int64_t>(0, kv_used_->load()));
  m.entries_used = size_t(std::max<int64_t>(0, entries_used_->load()));
  return m;
}

}  // namespace hypic::engine
