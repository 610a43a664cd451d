// The engine interface's CPU backend (engine/cpu/cpu_backend.h: a wrapper, bit for bit the reference engine) and the
// engine loop (engine/engine_loop.h): batched decode equals decoding alone, builds in one batch equal
// build_segment_entry, cancellation, stop with queued work, failures reported per job.
#include <catch2/catch.hpp>

#include <condition_variable>
#include <future>
#include <thread>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <cmath>

#include "engine/backend.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/engine_loop.h"

using namespace hypic::engine;

namespace {

const std::string kFixture = std::string(HYPIC_SOURCE_DIR) + "/tests/fixtures/qwen3_next_moe";

CpuBackend& fixture_backend() {
  static std::unique_ptr<CpuBackend> b = CpuBackend::load(kFixture);
  return *b;
}

std::vector<int32_t> random_ids(int n, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& x : ids) x = static_cast<int32_t>(rng() % vocab);
  return ids;
}

// Collects a generation's callbacks (they run on the loop thread).
struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int32_t> tokens;
  bool spliced = false, ended = false;
  GenerateEnd end;
  void wait() {
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return ended; }));
  }
  GenerateJob job(SpliceJob splice, SamplingConfig sampling, int max_tokens, CancelFlag cancel = nullptr) {
    GenerateJob g;
    g.splice = std::move(splice);
    g.sampling = std::move(sampling);
    g.max_tokens = max_tokens;
    g.cancel = std::move(cancel);
    g.on_spliced = [this](const SpliceInfo&) {
      std::lock_guard<std::mutex> lock(mu);
      spliced = true;
    };
    g.on_token = [this](int32_t t) {
      std::lock_guard<std::mutex> lock(mu);
      tokens.push_back(t);
      cv.notify_all();
    };
    g.on_end = [this](const GenerateEnd& e) {
      std::lock_guard<std::mutex> lock(mu);
      end = e;
      ended = true;
      cv.notify_all();
    };
    return g;
  }
};

// A request of `n_seg` random segments (entries built by the reference builder) and a query.
struct Prompt {
  std::vector<std::vector<int32_t>> segments;
  std::vector<std::shared_ptr<const SegmentEntry>> entries;
  std::vector<int32_t> query;
};

Prompt make_prompt(const CpuBackend& b, uint32_t seed, int n_seg, int w) {
  Prompt p;
  const int vocab = int(b.config().vocab_size);
  for (int i = 0; i < n_seg; ++i) {
    p.segments.push_back(random_ids(7 + 5 * i + int(seed % 5), seed * 31 + uint32_t(i), vocab));
    p.entries.push_back(std::make_shared<const SegmentEntry>(build_segment_entry(b.model(), p.segments.back(), w)));
  }
  p.query = random_ids(3, seed + 1000, vocab);
  return p;
}

SpliceJob splice_job(const Prompt& p, SpliceMode mode, int w) {
  SpliceJob j;
  j.plan.mode = mode;
  j.plan.seam_width = w;
  j.plan.query = p.query;
  for (size_t i = 0; i < p.segments.size(); ++i) j.plan.segments.push_back({p.segments[i], nullptr});
  j.host_entries = p.entries;
  return j;
}

// Holds the engine loop's thread inside the splice callback of a generation of `max_tokens` tokens, from construction
// until release(): the work queued meanwhile waits, then goes as the loop picks it. release() also waits for that
// generation's end.
struct LoopHold {
  Stream stream;
  std::promise<void> go;
  LoopHold(EngineLoop& loop, const CpuBackend& b, int max_tokens) {
    std::shared_future<void> released = go.get_future().share();
    GenerateJob hold = stream.job(splice_job(make_prompt(b, 7, 2, 4), SpliceMode::Hypic, 4), {}, max_tokens);
    std::promise<void> entered;
    hold.on_spliced = [released, &entered](const SpliceInfo&) {
      entered.set_value();
      released.wait();
    };
    loop.submit_generate(std::move(hold));
    entered.get_future().wait();
  }
  void release() {
    released = true;
    go.set_value();
    stream.wait();
  }
  ~LoopHold() {  // (after a failed REQUIRE: the loop thread goes on, so the loop can stop)
    if (!released) go.set_value();
  }
  bool released = false;
};

// What the reference engine generates alone: splice(), then Model::decode, sampled by a Sampler of its own.
std::vector<int32_t> reference_tokens(const CpuBackend& b, const Prompt& p, SpliceMode mode, int w,
                                      const SamplingConfig& sc, int max_tokens) {
  SpliceRequest req;
  req.mode = mode;
  req.seam_width = w;
  req.query = p.query;
  for (size_t i = 0; i < p.segments.size(); ++i) req.segments.push_back({p.segments[i], p.entries[i]});
  SpliceResult r = splice(b.model(), req);
  Sampler sampler(sc);
  std::vector<int32_t> out;
  std::vector<float> logits = r.logits;
  int64_t pos = r.num_tokens;
  for (int i = 0; i < max_tokens; ++i) {
    const int32_t t = sampler.sample(logits);
    out.push_back(t);
    if (sampler.is_stop_token(t)) break;
    if (i + 1 < max_tokens) logits = b.model().decode(r.state, t, pos++);
  }
  return out;
}

}  // namespace

TEST_CASE("device specs parse, print and refuse bad spellings", "[backend]") {
  CHECK(DeviceSpec::parse("cpu") == DeviceSpec{BackendKind::Cpu, 0});
  CHECK(DeviceSpec::parse("cuda") == DeviceSpec{BackendKind::Cuda, 0});
  CHECK(DeviceSpec::parse("cuda:3") == DeviceSpec{BackendKind::Cuda, 3});
  CHECK(DeviceSpec::parse("cuda:3").name() == "cuda:3");
  CHECK(DeviceSpec::parse("cuda").name() == "cuda:0");
  CHECK(DeviceSpec::parse("cpu").name() == "cpu");
  for (const char* bad : {"", "gpu", "cuda:", "cuda:-1", "cuda:1x", "CPU", "cuda:0:1"})
    CHECK_THROWS_WITH(DeviceSpec::parse(bad), Catch::Contains("expected cpu, cuda or cuda:N"));
  CHECK(std::string(backend_numerics(BackendKind::Cpu)) == "cpu-fp32");
  CHECK(std::string(backend_numerics(BackendKind::Cuda)) == "cuda-bf16");
#if !(defined(HYPIC_WITH_CUDA) && HYPIC_WITH_CUDA)
  CHECK_FALSE(cuda_available());
  CHECK(default_device() == DeviceSpec{});
  CHECK_THROWS_WITH(make_backend(DeviceSpec::parse("cuda:0"), kFixture), Catch::Contains("no CUDA backend"));
#endif
}

TEST_CASE("the CPU backend's fingerprint covers config and numerics -- entries carry both", "[backend]") {
  CpuBackend& b = fixture_backend();
  const ModelConfig& cfg = b.config();
  CHECK(b.numerics() == "cpu-fp32");
  CHECK(b.fingerprint() == model_fingerprint(cfg, "cpu-fp32"));
  CHECK(b.fingerprint() != model_fingerprint(cfg, "cuda-bf16"));
  CHECK(b.fingerprint() != cfg.fingerprint());
  CHECK(b.fingerprint().size() == 32);
  // Seeded random weights have a weights identity of their own: another fingerprint per seed.
  CHECK(random_weights_digest(1) == "random-0000000000000001");
  ModelConfig random = cfg;
  random.weights_digest = random_weights_digest(1);
  CHECK(model_fingerprint(random, "cpu-fp32") != b.fingerprint());
  random.weights_digest = random_weights_digest(2);
  CHECK(model_fingerprint(random, "cpu-fp32") != model_fingerprint(cfg, "cpu-fp32"));
  CHECK(b.device().name() == "cpu");

  const auto ids = random_ids(12, 5, int(cfg.vocab_size));
  const auto built = b.build_entries(std::vector<std::vector<int32_t>>{ids}, 4);
  REQUIRE(built.size() == 1);
  const SegmentEntry& e = built[0]->header();
  CHECK(e.numerics == "cpu-fp32");
  CHECK(e.model_fingerprint == b.fingerprint());
  CHECK(e.format_version == kSegmentFormatVersion);
  // Bit for bit the reference builder.
  CHECK(serialize_entry(e) == serialize_entry(build_segment_entry(b.model(), ids, 4)));
  // Round trip keeps the numerics; an entry of other numerics is refused, naming both.
  const SegmentEntry back = deserialize_entry(serialize_entry(e));
  CHECK(back.numerics == "cpu-fp32");
  auto other = std::make_shared<SegmentEntry>(back);
  other->numerics = "cuda-bf16";
  other->model_fingerprint = model_fingerprint(cfg, "cuda-bf16");
  CHECK_THROWS_AS(b.import_entry(other), EntryError);
  CHECK_THROWS_WITH(b.import_entry(other), Catch::Contains("cuda-bf16") && Catch::Contains("cpu-fp32"));
  CHECK_NOTHROW(b.import_entry(std::make_shared<const SegmentEntry>(back)));
  CHECK_THROWS_WITH(b.build_entries(std::vector<std::vector<int32_t>>{{1, 2}, {}}, 4),
                    Catch::Contains("segment 1") && Catch::Contains("empty"));
  CHECK_THROWS_WITH(b.build_entries(std::vector<std::vector<int32_t>>{{int32_t(cfg.vocab_size)}}, 4),
                    Catch::Contains("outside the vocabulary"));
  CHECK_THROWS_WITH(CpuBackend::load(kFixture, BackendOptions{.random_weights_seed = 7}),
                    Catch::Contains("hypic-model init"));
}

TEST_CASE("CPU builds stop when cancelled: a skipped segment's entry is null, the others unchanged bit for bit",
          "[backend][cancel]") {
  CpuBackend& b = fixture_backend();
  const int vocab = int(b.config().vocab_size);
  const std::vector<std::vector<int32_t>> segs = {random_ids(40, 1, vocab), random_ids(1100, 2, vocab),
                                                  random_ids(25, 3, vocab)};
  // Segment 1 not wanted: skipped; 0 and 2 are what the reference builder makes.
  const auto some = b.build_entries(segs, 4, [](size_t i) { return i == 1; });
  REQUIRE(some.size() == 3);
  CHECK(some[1] == nullptr);
  for (size_t i : {size_t(0), size_t(2)}) {
    REQUIRE(some[i] != nullptr);
    CHECK(serialize_entry(some[i]->header()) == serialize_entry(build_segment_entry(b.model(), segs[i], 4)));
  }
  // Cancelled part way: asked before the segment and before every decoder layer of each pass (the seam, then the
  // interior in passes of kBuildPassTokens), it stops at the first true answer.
  const int layers = b.config().num_hidden_layers;
  for (int stop_at : {1, 2, layers + 1, 2 * layers + 3}) {
    INFO("stop at the " << stop_at << "th question");
    int asked = 0;
    const auto one = b.build_entries(std::span(segs).subspan(1, 1), 4, [&](size_t) { return ++asked >= stop_at; });
    CHECK(one[0] == nullptr);
    CHECK(asked == stop_at);  // nothing asked after it stopped
  }
  // Never cancelled: asked once before the segment and once per layer of each of its passes.
  int asked = 0;
  const auto whole = b.build_entries(std::span(segs).subspan(1, 1), 4, [&](size_t) { return ++asked < 0; });
  REQUIRE(whole[0] != nullptr);
  const int passes = 1 + (1100 - 4 + kBuildPassTokens - 1) / kBuildPassTokens;  // the seam, then the interior's
  CHECK(asked == 1 + passes * layers);
  CHECK(serialize_entry(whole[0]->header()) == serialize_entry(build_segment_entry(b.model(), segs[1], 4)));
}

TEST_CASE("the CPU backend's splice and batched decode equal splice() and Model::decode bit for bit", "[backend]") {
  CpuBackend& b = fixture_backend();
  const int vocab = int(b.config().vocab_size);
  for (SpliceMode mode : {SpliceMode::Hypic, SpliceMode::Transition, SpliceMode::Full}) {
    std::vector<Prompt> prompts;
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<SpliceResult> refs;
    for (uint32_t s = 0; s < 3; ++s) {
      prompts.push_back(make_prompt(b, 10 + s, 3, mode == SpliceMode::Transition ? 0 : 4));  // entry_seam_width
      const Prompt& p = prompts.back();
      SplicePlan plan;
      plan.mode = mode;
      plan.seam_width = 4;
      plan.query = p.query;
      for (size_t i = 0; i < p.segments.size(); ++i)
        plan.segments.push_back({p.segments[i], b.import_entry(p.entries[i])});
      SpliceOutput out = b.splice(plan);
      SpliceRequest req;
      req.mode = mode;
      req.seam_width = 4;
      req.query = p.query;
      for (size_t i = 0; i < p.segments.size(); ++i) req.segments.push_back({p.segments[i], p.entries[i]});
      refs.push_back(splice(b.model(), req));
      CHECK(out.logits == refs.back().logits);
      CHECK(out.num_tokens == refs.back().num_tokens);
      CHECK(out.sequence->num_tokens() == refs.back().num_tokens);
      seqs.push_back(std::move(out.sequence));
    }
    for (int step = 0; step < 3; ++step) {
      std::vector<Sequence*> batch;
      std::vector<int32_t> toks;
      for (size_t k = 0; k < seqs.size(); ++k) {
        batch.push_back(seqs[k].get());
        toks.push_back(int32_t((k * 7919 + size_t(step) * 104729) % size_t(vocab)));
      }
      std::vector<float> logits;
      b.decode(batch, toks, logits);
      REQUIRE(logits.size() == seqs.size() * size_t(vocab));
      for (size_t k = 0; k < seqs.size(); ++k) {
        const std::vector<float> want = b.model().decode(refs[k].state, toks[k], refs[k].num_tokens + step);
        CHECK(std::equal(want.begin(), want.end(), logits.begin() + ptrdiff_t(k * size_t(vocab))));
      }
    }
    CHECK(b.memory().kv_used > 0);
    // Errors: sizes, duplicates, ids.
    std::vector<float> logits;
    std::vector<Sequence*> two = {seqs[0].get(), seqs[0].get()};
    CHECK_THROWS_WITH(b.decode(two, std::vector<int32_t>{1, 2}, logits), Catch::Contains("twice"));
    std::vector<Sequence*> one = {seqs[0].get()};
    CHECK_THROWS_WITH(b.decode(one, std::vector<int32_t>{1, 2}, logits), Catch::Contains("1 sequences but 2 tokens"));
    CHECK_THROWS_WITH(b.decode(one, std::vector<int32_t>{vocab}, logits), Catch::Contains("outside the vocabulary"));
  }
}

TEST_CASE("engine loop: N sequences decoded in one batch get exactly the tokens each gets alone", "[engine_loop]") {
  CpuBackend& b = fixture_backend();
  const int n = 5, w = 4, max_tokens = 12;
  std::vector<Prompt> prompts;
  std::vector<SamplingConfig> samplings;
  for (int k = 0; k < n; ++k) {
    prompts.push_back(make_prompt(b, 100 + uint32_t(k), 1 + k % 3, w));
    SamplingConfig sc;
    if (k % 2 == 1) {  // some sample, some are greedy: each request's sampler is its own
      sc.temperature = 0.8f;
      sc.top_k = 50;
      sc.seed = 1234 + uint64_t(k);
    }
    samplings.push_back(sc);
  }
  EngineLoop loop(b);
  std::vector<std::unique_ptr<Stream>> streams;
  for (int k = 0; k < n; ++k) {
    streams.push_back(std::make_unique<Stream>());
    loop.submit_generate(streams.back()->job(splice_job(prompts[k], SpliceMode::Hypic, w), samplings[k], max_tokens));
  }
  for (auto& s : streams) s->wait();
  for (int k = 0; k < n; ++k) {
    INFO("sequence " << k);
    CHECK(streams[k]->spliced);
    CHECK(streams[k]->end.reason == GenerateEndReason::Length);
    CHECK(streams[k]->end.tokens == max_tokens);
    CHECK(streams[k]->tokens == reference_tokens(b, prompts[k], SpliceMode::Hypic, w, samplings[k], max_tokens));
  }
  // The sequences were stepped together: more sequence-steps than iterations.
  CHECK(loop.decode_steps() == uint64_t(n * (max_tokens - 1)));
  CHECK(loop.decode_iterations() < loop.decode_steps());
  CHECK(loop.active_sequences() == 0);
}

TEST_CASE("engine loop: builds batch into one call, equal the reference builder, fail alone", "[engine_loop]") {
  CpuBackend& b = fixture_backend();
  const int vocab = int(b.config().vocab_size);
  EngineLoopOptions opt;
  opt.inject_delay = std::chrono::milliseconds(0);
  EngineLoop loop(b, opt);
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, BuildOutcome> got;
  std::vector<std::vector<int32_t>> ids;
  // Hold the loop thread inside a splice callback until every build is queued, so they batch together.
  LoopHold hold(loop, b, 3);
  for (int k = 0; k < 5; ++k) {
    ids.push_back(random_ids(5 + 3 * k, 50 + uint32_t(k), vocab));
    if (k == 2) ids.back()[1] = vocab + 5;  // out of range: this one fails, the others build
    loop.submit_build(ids.back(), 4, nullptr, [&, k](BuildOutcome r) {
      std::lock_guard<std::mutex> lock(mu);
      got[k] = std::move(r);
      cv.notify_all();
    });
  }
  CHECK(loop.queued_tokens() > 0);
  hold.release();
  {
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return got.size() == 5; }));
  }
  CHECK(loop.queued_tokens() == 0);
  for (int k = 0; k < 5; ++k) {
    INFO("build " << k);
    const BuildOutcome& r = got[k];
    CHECK_FALSE(r.cancelled);
    if (k == 2) {
      CHECK(r.entry == nullptr);
      CHECK(r.error_kind == EngineErrorKind::InvalidArgument);
      CHECK_THAT(r.error, Catch::Contains("outside the vocabulary"));
      continue;
    }
    REQUIRE(r.error.empty());
    REQUIRE(r.entry);
    CHECK(*r.bytes == serialize_entry(build_segment_entry(b.model(), ids[size_t(k)], 4)));
    CHECK(r.host == r.entry->host());
    CHECK(r.compute_ms <= r.batch_ms + 1000);
  }
  // The four good builds (queued together behind the splice) ran as one build_entries call.
  CHECK(got[0].batch_segments == 4);
  CHECK(loop.build_batches() == 1);
}

TEST_CASE("engine loop: background builds wait for queued splices and builds, then go in small batches",
          "[engine_loop]") {
  CpuBackend& b = fixture_backend();
  const int vocab = int(b.config().vocab_size);
  EngineLoopOptions opt;
  opt.max_build_tokens_decoding = 6;  // background batches: one 5-token build each
  EngineLoop loop(b, opt);
  std::mutex mu;
  std::vector<std::string> order;  // callbacks as they ran
  auto note = [&](std::string what) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(std::move(what));
  };
  LoopHold hold(loop, b, 1);  // until everything is queued
  const auto bg = std::make_shared<std::atomic<bool>>(true), bg2 = std::make_shared<std::atomic<bool>>(true),
             joined = std::make_shared<std::atomic<bool>>(true);
  std::vector<EngineLoop::BuildSubmission> subs;
  auto build = [&](const char* name, uint32_t seed, CancelFlag background) {
    return EngineLoop::BuildSubmission{random_ids(5, seed, vocab), 4, nullptr,
                                       [&note, name](BuildOutcome r) {
                                         CHECK(r.entry);
                                         note(name);
                                       },
                                       BuildHandover::Resident, nullptr, std::move(background)};
  };
  subs.push_back(build("background", 61, bg));
  subs.push_back(build("joined", 62, joined));  // background when queued; a request joins it before it runs
  subs.push_back(build("background2", 63, bg2));
  subs.push_back(build("foreground", 64, nullptr));
  loop.submit_builds(std::move(subs));
  std::promise<void> spliced;
  loop.submit_splice(splice_job(make_prompt(b, 9, 2, 4), SpliceMode::Hypic, 4), nullptr, [&](SpliceOutcome r) {
    CHECK(r.error.empty());
    note("splice");
    spliced.set_value();
  });
  CHECK(loop.background_tokens() == 15);
  joined->store(false);
  CHECK(loop.background_tokens() == 10);  // (the two still in the background)
  const uint64_t batches0 = loop.build_batches();
  hold.release();
  spliced.get_future().wait();
  for (int i = 0; i < 2000; ++i) {  // (up to 20 s)
    {
      std::lock_guard<std::mutex> lock(mu);
      if (order.size() == 5) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::lock_guard<std::mutex> lock(mu);
  // The foreground builds first (the joined one with them, in one batch), then the queued splice, then the background
  // builds one batch each (6-token budget).
  CHECK(order == std::vector<std::string>{"joined", "foreground", "splice", "background", "background2"});
  CHECK(loop.build_batches() == batches0 + 3);
  CHECK(loop.background_tokens() == 0);
}

TEST_CASE("engine loop: while sequences decode, builds go in smaller batches with decode steps between -- Resident "
          "builds hand over the entry alone", "[engine_loop]") {
  CpuBackend& b = fixture_backend();
  const int vocab = int(b.config().vocab_size);
  EngineLoopOptions opt;
  opt.max_build_tokens_decoding = 12;  // two 6-token segments per batch while decoding
  EngineLoop loop(b, opt);
  // A generation long enough to decode through all the builds, held in its splice callback until they are queued.
  Stream gen;
  std::promise<void> release, entered;
  std::shared_future<void> released = release.get_future().share();
  GenerateJob job = gen.job(splice_job(make_prompt(b, 9, 2, 4), SpliceMode::Hypic, 4), {}, 400);
  job.on_spliced = [released, &entered](const SpliceInfo&) {
    entered.set_value();
    released.wait();
  };
  loop.submit_generate(std::move(job));
  entered.get_future().wait();
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, BuildOutcome> got;
  std::map<int, uint64_t> iterations_at;  // decode iterations when each build was handed over
  std::vector<EngineLoop::BuildSubmission> subs;
  std::vector<std::vector<int32_t>> ids;
  for (int k = 0; k < 6; ++k) {
    ids.push_back(random_ids(6, 300 + uint32_t(k), vocab));
    subs.push_back({ids.back(), 4, nullptr, [&, k](BuildOutcome r) {
                      std::lock_guard<std::mutex> lock(mu);
                      iterations_at[k] = loop.decode_iterations();
                      got[k] = std::move(r);
                      cv.notify_all();
                    },
                    k % 2 ? BuildHandover::Resident : BuildHandover::Wire});
  }
  loop.submit_builds(std::move(subs));
  release.set_value();
  {
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return got.size() == 6; }));
  }
  gen.wait();
  CHECK(gen.tokens.size() == 400);
  // Three batches of two (12 tokens each), with decode steps of the running sequence between them.
  CHECK(loop.build_batches() == 3);
  for (int k = 0; k < 6; ++k) {
    INFO("build " << k);
    const BuildOutcome& r = got[k];
    REQUIRE(r.error.empty());
    REQUIRE(r.entry);
    CHECK(r.batch_segments == 2);
    // The same entry as the reference builder's whatever its batch.
    CHECK(serialize_entry(*r.entry->host()) == serialize_entry(build_segment_entry(b.model(), ids[size_t(k)], 4)));
    if (k % 2) {  // Resident: no wire form made
      CHECK(r.host == nullptr);
      CHECK(r.bytes == nullptr);
    } else {
      REQUIRE(r.bytes);
      CHECK(*r.bytes == serialize_entry(*r.entry->host()));
    }
  }
  CHECK(iterations_at[1] < iterations_at[3]);  // at least one decode step between two batches
  CHECK(iterations_at[3] < iterations_at[5]);
  // With nothing decoding, the same six go in one batch (max_build_tokens).
  std::atomic<int> left{6};
  std::promise<void> all;
  std::vector<EngineLoop::BuildSubmission> again;
  for (int k = 0; k < 6; ++k)
    again.push_back({ids[size_t(k)], 4, nullptr, [&](BuildOutcome) {
                       if (--left == 0) all.set_value();
                     },
                     BuildHandover::Resident});
  loop.submit_builds(std::move(again));
  all.get_future().wait();
  CHECK(loop.build_batches() == 4);
  CHECK_THROWS_WITH(EngineLoop(b, EngineLoopOptions{16384, 0}), Catch::Contains("max_build_tokens_decoding"));
  EngineLoopOptions negative_pass;
  negative_pass.max_pass_tokens_decoding = -1;
  CHECK_THROWS_WITH(EngineLoop(b, negative_pass), Catch::Contains("max_pass_tokens_decoding"));
}

TEST_CASE("engine loop: chunked prefill -- while a sequence decodes, a long splice runs in passes with its decode steps "
          "between them, gives the unchunked tokens, and stops between passes when cancelled", "[engine_loop]") {
  CpuBackend& b = fixture_backend();
  const int vocab = int(b.config().vocab_size);
  EngineLoopOptions opt;
  opt.max_pass_tokens_decoding = 16;
  EngineLoop loop(b, opt);
  // A: decodes throughout, held in its splice callback until the long requests are queued.
  Stream a;
  std::promise<void> release, entered;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> a_tokens{0};
  std::atomic<int> cancel_after{-1};  // A's token count at which C is cancelled
  auto c_cancel = std::make_shared<std::atomic<bool>>(false);
  GenerateJob ja = a.job(splice_job(make_prompt(b, 9, 2, 4), SpliceMode::Hypic, 4), {}, 600);
  ja.on_spliced = [released, &entered](const SpliceInfo&) {
    entered.set_value();
    released.wait();
  };
  auto a_on_token = ja.on_token;
  ja.on_token = [&, a_on_token](int32_t t) {
    const int n = ++a_tokens;
    if (n == cancel_after.load()) c_cancel->store(true);
    a_on_token(t);
  };
  loop.submit_generate(std::move(ja));
  entered.get_future().wait();
  // B: full mode over 3 segments (well over 16 tokens): passes of 16 tokens with A's decode steps between them.
  Prompt pb;
  for (int i = 0; i < 3; ++i) pb.segments.push_back(random_ids(40 + 3 * i, 700 + uint32_t(i), vocab));
  pb.entries.assign(3, nullptr);  // full mode: ids only
  pb.query = random_ids(5, 799, vocab);
  const int64_t b_tokens = 40 + 43 + 46 + 5;
  Stream sb;
  SpliceInfo b_info;
  GenerateJob jb = sb.job(splice_job(pb, SpliceMode::Full, 4), {}, 8);
  jb.on_spliced = [&](const SpliceInfo& i) {  // C's splice comes next: cancel it three of A's steps from now
    b_info = i;
    cancel_after = a_tokens.load() + 3;
  };
  loop.submit_generate(std::move(jb));
  // C: the same prompt, cancelled from A's token callback a few decode steps into its passes.
  Stream sc;
  GenerateJob jc = sc.job(splice_job(pb, SpliceMode::Full, 4), {}, 8, c_cancel);
  loop.submit_generate(std::move(jc));
  release.set_value();
  sb.wait();
  // B's tokens are those of the unchunked reference (the scan's chunk boundaries move: fp32 rounding only).
  CHECK(sb.end.reason == GenerateEndReason::Length);
  CHECK(sb.tokens == reference_tokens(b, pb, SpliceMode::Full, 4, {}, 8));
  // ceil(129 / 16) passes over the segments, then the query: one decode step of A between two passes.
  CHECK(b_info.passes_paused == int((b_tokens - 5 + 15) / 16));
  sc.wait();
  CHECK(sc.end.reason == GenerateEndReason::Cancelled);
  CHECK_THAT(sc.end.error, Catch::Contains("between two of its passes"));
  CHECK(sc.tokens.empty());
  a.wait();
  CHECK(a.tokens.size() == 600);
  // Nothing decoding (max_pass_tokens 0): the segments in one pass, the query in a second.
  Stream sd;
  SpliceInfo d_info;
  GenerateJob jd = sd.job(splice_job(pb, SpliceMode::Full, 4), {}, 1);
  jd.on_spliced = [&](const SpliceInfo& i) { d_info = i; };
  loop.submit_generate(std::move(jd));
  sd.wait();
  CHECK(d_info.passes_paused == 1);
  CHECK(sd.tokens == reference_tokens(b, pb, SpliceMode::Full, 4, {}, 1));
  // With max_pass_tokens, an idle loop cuts splices too (a cancelled request stops within a pass).
  EngineLoopOptions idle_opt;
  idle_opt.max_pass_tokens = 16;
  EngineLoop idle(b, idle_opt);
  Stream se;
  SpliceInfo e_info;
  GenerateJob je = se.job(splice_job(pb, SpliceMode::Full, 4), {}, 8);
  je.on_spliced = [&](const SpliceInfo& i) { e_info = i; };
  idle.submit_generate(std::move(je));
  se.wait();
  CHECK(e_info.passes_paused == int((b_tokens - 5 + 15) / 16));
  CHECK(se.tokens == reference_tokens(b, pb, SpliceMode::Full, 4, {}, 8));
}

TEST_CASE("engine loop: cancellation of queued builds and of decoding sequences", "[engine_loop]") {
  CpuBackend& b = fixture_backend();
  EngineLoop loop(b);
  // A queued build whose flag is set is skipped.
  auto cancelled = std::make_shared<std::atomic<bool>>(true);
  std::promise<BuildOutcome> built;
  loop.submit_build({1, 2, 3}, 4, cancelled, [&](BuildOutcome r) { built.set_value(std::move(r)); });
  const BuildOutcome r = built.get_future().get();
  CHECK(r.cancelled);
  CHECK(r.entry == nullptr);

  // A long generation cancelled after a few tokens leaves the batch; another one keeps going to its end.
  auto flag = std::make_shared<std::atomic<bool>>(false);
  Stream cancel_me, keep;
  const Prompt p = make_prompt(b, 3, 2, 4);
  loop.submit_generate(cancel_me.job(splice_job(p, SpliceMode::Hypic, 4), {}, 100000, flag));
  loop.submit_generate(keep.job(splice_job(p, SpliceMode::Hypic, 4), {}, 20));
  {
    std::unique_lock<std::mutex> lock(cancel_me.mu);
    REQUIRE(cancel_me.cv.wait_for(lock, std::chrono::seconds(60), [&] { return cancel_me.tokens.size() >= 3; }));
  }
  flag->store(true);
  cancel_me.wait();
  keep.wait();
  CHECK(cancel_me.end.reason == GenerateEndReason::Cancelled);
  CHECK(cancel_me.end.tokens < 100000);
  CHECK(keep.end.reason == GenerateEndReason::Length);
  CHECK(keep.tokens == reference_tokens(b, p, SpliceMode::Hypic, 4, {}, 20));
  // The cancelled one's tokens are a prefix of the same greedy continuation.
  const auto ref = reference_tokens(b, p, SpliceMode::Hypic, 4, {}, int(cancel_me.tokens.size()));
  CHECK(cancel_me.tokens == ref);
}

TEST_CASE("engine loop: a failing splice reports its error -- stop finishes in-flight work, cancels the rest",
          "[engine_loop]") {
  CpuBackend& b = fixture_backend();
  const int vocab = int(b.config().vocab_size);
  {
    EngineLoop loop(b);
    Stream s;
    SpliceJob j;
    j.plan.mode = SpliceMode::Hypic;
    j.plan.query = {1, 2};
    j.plan.segments.push_back({{3, 4, 5}, nullptr});  // no entry for a cached mode
    loop.submit_generate(s.job(std::move(j), {}, 4));
    s.wait();
    CHECK(s.end.reason == GenerateEndReason::Failed);
    CHECK(s.end.error_kind == EngineErrorKind::InvalidArgument);
    CHECK_THAT(s.end.error, Catch::Contains("has no entry"));
    // An entry of other numerics fails the job as an entry error.
    const Prompt p = make_prompt(b, 9, 2, 4);
    SpliceJob bad = splice_job(p, SpliceMode::Hypic, 4);
    auto other = std::make_shared<SegmentEntry>(*p.entries[1]);
    other->numerics = "cuda-bf16";
    bad.host_entries[1] = other;
    Stream s2;
    loop.submit_generate(s2.job(std::move(bad), {}, 4));
    s2.wait();
    CHECK(s2.end.reason == GenerateEndReason::Failed);
    CHECK(s2.end.error_kind == EngineErrorKind::Entry);
    CHECK_THAT(s2.end.error, Catch::Contains("cuda-bf16"));
  }
  // Stop with queued work: the splice in progress (held in its callback while stop() is called) completes and
  // emits its first token, then its sequence ends cancelled; the queued builds are reported cancelled; work
  // submitted afterwards is cancelled at once.
  auto loop = std::make_unique<EngineLoop>(b);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<BuildOutcome> got(4);
  int done = 0;
  Stream gen;
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  GenerateJob hold = gen.job(splice_job(make_prompt(b, 11, 1, 4), SpliceMode::Hypic, 4), {}, 100000);
  hold.on_spliced = [released, &entered](const SpliceInfo&) {
    entered.set_value();
    released.wait();
  };
  loop->submit_generate(std::move(hold));
  entered.get_future().wait();
  for (int k = 0; k < 4; ++k) {
    loop->submit_build(random_ids(6, 70 + uint32_t(k), vocab), 4, nullptr, [&, k](BuildOutcome r) {
      std::lock_guard<std::mutex> lock(mu);
      got[size_t(k)] = std::move(r);
      ++done;
      cv.notify_all();
    });
  }
  std::thread stopper([&] { loop->stop(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // stop() is waiting for the splice
  release.set_value();
  stopper.join();
  CHECK(done == 4);
  CHECK(gen.ended);
  CHECK(gen.tokens.size() == 1);
  CHECK(gen.end.reason == GenerateEndReason::Cancelled);
  for (int k = 0; k < 4; ++k) CHECK(got[size_t(k)].cancelled);
  CHECK(loop->queued_tokens() == 0);
  std::promise<BuildOutcome> late;
  loop->submit_build({1, 2}, 4, nullptr, [&](BuildOutcome r) { late.set_value(std::move(r)); });
  CHECK(late.get_future().get().cancelled);
  Stream late_gen;
  loop->submit_generate(late_gen.job(splice_job(make_prompt(b, 12, 1, 4), SpliceMode::Hypic, 4), {}, 2));
  CHECK(late_gen.ended);
  CHECK(late_gen.end.reason == GenerateEndReason::Cancelled);
}

TEST_CASE("the CPU backend's threads change nothing in the results", "[backend]") {
  CpuBackend& one = fixture_backend();
  CpuBackend two(Model::load(kFixture), BackendOptions{.cpu_threads = 3});
  CHECK(two.fingerprint() == one.fingerprint());
  const int vocab = int(one.config().vocab_size);
  std::vector<std::vector<int32_t>> segs;
  for (int k = 0; k < 5; ++k) segs.push_back(random_ids(4 + 6 * k, 300 + uint32_t(k), vocab));
  const auto a = one.build_entries(segs, 4), b = two.build_entries(segs, 4);
  REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) CHECK(serialize_entry(a[k]->header()) == serialize_entry(b[k]->header()));
  // Decode of a batch on 3 threads equals the batch on one.
  std::vector<std::unique_ptr<Sequence>> sa, sb;
  for (size_t k = 0; k < segs.size(); ++k) {
    SplicePlan plan;
    plan.mode = SpliceMode::Full;
    plan.query = {int32_t(k + 1)};
    plan.segments.push_back({segs[k], nullptr});
    sa.push_back(one.splice(plan).sequence);
    sb.push_back(two.splice(plan).sequence);
  }
  std::vector<Sequence*> ba, bb;
  std::vector<int32_t> toks;
  for (size_t k = 0; k < segs.size(); ++k) {
    ba.push_back(sa[k].get());
    bb.push_back(sb[k].get());
    toks.push_back(int32_t(17 * k + 3));
  }
  std::vector<float> la, lb;
  one.decode(ba, toks, la);
  two.decode(bb, toks, lb);
  CHECK(la == lb);
  CHECK_THROWS_WITH(CpuBackend(Model::load(kFixture), BackendOptions{.cpu_threads = 0}),
                    Catch::Contains("cpu_threads must be >= 1"));
}

namespace {

// Delegates to the CPU backend but injects faults: a decode batch holding a "poisoned" sequence is refused with
// ResourceExhausted before any sequence advances (as the CUDA backend refuses a batch when one sequence needs a KV
// page the pool no longer has), and a "NaN" sequence gets NaN logits from its decode steps. Sequences are marked by
// the first token of their query.
class FaultyBackend final : public Backend {
 public:
  explicit FaultyBackend(CpuBackend& inner) : inner_(inner) {}
  static constexpr int32_t kPoison = 1, kNan = 2;
  const ModelConfig& config() const override { return inner_.config(); }
  DeviceSpec device() const override { return inner_.device(); }
  std::string_view numerics() const override { return inner_.numerics(); }
  const std::string& fingerprint() const override { return inner_.fingerprint(); }
  std::vector<std::shared_ptr<const ResidentEntry>> build_entries(std::span<const std::vector<int32_t>> s, int w,
                                                                  const BuildCancelled& c = {}) override {
    ++build_calls;
    if (max_build_segments > 0 && s.size() > max_build_segments) {
      throw ResourceExhausted("device memory exhausted (injected by the test: " + std::to_string(s.size()) +
                              " segments at once)");
    }
    if (s.size() == 1 && singles_built > 0 && single_failures > 0) {
      --single_failures;
      throw ResourceExhausted("device memory exhausted (injected by the test: a single segment)");
    }
    if (s.size() == 1) ++singles_built;
    return inner_.build_entries(s, w, c);
  }
  /// A single-segment build after the first fails this many times (out of device memory).
  std::atomic<int> single_failures{0}, singles_built{0};
  /// memory().freed_pending reported (memory waiting to be freed).
  std::atomic<size_t> freed_pending{0};
  /// build_entries of more segments than this (0: any) runs out of device memory.
  std::atomic<size_t> max_build_segments{0};
  std::atomic<int> build_calls{0};
  std::shared_ptr<const ResidentEntry> import_entry(std::shared_ptr<const SegmentEntry> e) override {
    return inner_.import_entry(std::move(e));
  }
  SpliceOutput splice(const SplicePlan& plan) override {
    SpliceOutput out = inner_.splice(plan);
    std::lock_guard<std::mutex> lock(mu_);
    // A new sequence may sit at the address of one that ended: its marks are its own query's only.
    poison_.erase(out.sequence.get());
    nan_.erase(out.sequence.get());
    if (plan.query[0] == kPoison) poison_.insert(out.sequence.get());
    if (plan.query[0] == kNan) nan_.insert(out.sequence.get());
    return out;
  }
  void decode(std::span<Sequence* const> seqs, std::span<const int32_t> tokens, std::vector<float>& logits) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (Sequence* s : seqs)
      if (poison_.count(s)) throw ResourceExhausted("KV pool exhausted (injected by the test)");
    inner_.decode(seqs, tokens, logits);
    const size_t V = size_t(config().vocab_size);
    for (size_t b = 0; b < seqs.size(); ++b)
      if (nan_.count(seqs[b])) std::fill(logits.begin() + ptrdiff_t(b * V), logits.begin() + ptrdiff_t((b + 1) * V), NAN);
  }
  BackendMemory memory() const override {
    BackendMemory m = inner_.memory();
    m.freed_pending = freed_pending;
    return m;
  }

 private:
  CpuBackend& inner_;
  std::mutex mu_;
  std::set<const Sequence*> poison_, nan_;
};

}  // namespace

TEST_CASE("engine loop: a build batch out of device memory is built again one segment at a time", "[engine_loop]") {
  CpuBackend& cpu = fixture_backend();
  FaultyBackend b(cpu);
  b.max_build_segments = 1;
  const int vocab = int(b.config().vocab_size);
  EngineLoopOptions opt;
  opt.inject_delay = std::chrono::milliseconds(0);
  EngineLoop loop(b, opt);
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, BuildOutcome> got;
  std::vector<std::vector<int32_t>> ids;
  for (int k = 0; k < 3; ++k) ids.push_back(random_ids(6 + 2 * k, 70 + uint32_t(k), vocab));
  std::vector<EngineLoop::BuildSubmission> subs;
  for (int k = 0; k < 3; ++k) {
    subs.push_back({ids[size_t(k)], 4, nullptr, [&, k](BuildOutcome r) {
                      std::lock_guard<std::mutex> lock(mu);
                      got[k] = std::move(r);
                      cv.notify_all();
                    }});
  }
  loop.submit_builds(std::move(subs));  // one submission: one batch of 3, refused whole
  {
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return got.size() == 3; }));
  }
  CHECK(b.build_calls == 4);  // the batch, then each alone
  for (int k = 0; k < 3; ++k) {
    INFO("build " << k);
    REQUIRE(got[k].error.empty());
    REQUIRE(got[k].entry);
    CHECK(got[k].batch_segments == 1);
    CHECK(*got[k].bytes == serialize_entry(build_segment_entry(cpu.model(), ids[size_t(k)], 4)));
  }
  // Resident handover: each entry is handed over (on the loop thread) as soon as it is built alone, before the next
  // one's build starts, so that a caller that lets it go gives its memory back in time.
  std::map<int, int> calls_at;  // build k's callback: build_entries calls made by then
  const auto build_three_resident = [&] {  // one submission of the three, Resident handover, waited for
    got.clear();
    std::vector<EngineLoop::BuildSubmission> resident;
    for (int k = 0; k < 3; ++k) {
      resident.push_back({ids[size_t(k)], 4, nullptr,
                          [&, k](BuildOutcome r) {
                            std::lock_guard<std::mutex> lock(mu);
                            calls_at[k] = b.build_calls.load();
                            got[k] = std::move(r);
                            cv.notify_all();
                          },
                          BuildHandover::Resident});
    }
    loop.submit_builds(std::move(resident));
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return got.size() == 3; }));
  };
  const int calls0 = b.build_calls;
  build_three_resident();
  for (int k = 0; k < 3; ++k) {
    INFO("build " << k);
    REQUIRE(got[k].entry);
    CHECK(calls_at[k] == calls0 + 2 + k);  // the batch, then builds 0..k alone
  }
  // A single build out of memory after earlier ones were handed over is tried again once memory waits to be freed
  // (their callers letting them go): once is enough; twice fails that segment alone.
  for (const int failures : {1, 2}) {
    INFO(failures << " failure(s)");
    b.singles_built = 0;
    b.single_failures = failures;
    b.freed_pending = 1;
    const int before = b.build_calls;
    build_three_resident();
    CHECK(b.build_calls == before + 1 + 3 + 1);  // the batch, each alone, one retry
    CHECK(got[0].entry);
    CHECK(got[2].entry);
    if (failures == 1) {
      CHECK(got[1].entry);
    } else {
      CHECK_FALSE(got[1].entry);
      CHECK(got[1].error_kind == EngineErrorKind::ResourceExhausted);
    }
  }
  b.freed_pending = 0;
}

TEST_CASE("a decode failure or NaN logits end only the request concerned -- the others finish and the loop serves on",
          "[engine_loop]") {
  CpuBackend& b = fixture_backend();
  FaultyBackend faulty(b);
  EngineLoop loop(faulty);
  const int w = 4, max_tokens = 6;
  SamplingConfig greedy;
  Prompt good = make_prompt(b, 71, 2, w), poisoned = make_prompt(b, 72, 2, w), nan = make_prompt(b, 73, 2, w);
  poisoned.query[0] = FaultyBackend::kPoison;
  nan.query[0] = FaultyBackend::kNan;
  good.query[0] = 3;
  Stream s_good, s_poison, s_nan;
  loop.submit_generate(s_good.job(splice_job(good, SpliceMode::Hypic, w), greedy, max_tokens));
  loop.submit_generate(s_poison.job(splice_job(poisoned, SpliceMode::Hypic, w), greedy, max_tokens));
  loop.submit_generate(s_nan.job(splice_job(nan, SpliceMode::Hypic, w), greedy, max_tokens));
  s_good.wait();
  s_poison.wait();
  s_nan.wait();
  CHECK(s_good.end.reason == GenerateEndReason::Length);
  CHECK(s_good.tokens == reference_tokens(b, good, SpliceMode::Hypic, w, greedy, max_tokens));
  CHECK(s_poison.end.reason == GenerateEndReason::Failed);
  CHECK(s_poison.end.error_kind == EngineErrorKind::ResourceExhausted);
  CHECK_THAT(s_poison.end.error, Catch::Contains("KV pool exhausted"));
  CHECK(s_poison.tokens.size() == 1);  // the first token comes from the splice
  CHECK(s_nan.end.reason == GenerateEndReason::Failed);
  CHECK_THAT(s_nan.end.error, Catch::Contains("sampling failed") && Catch::Contains("NaN at token id 0"));
  // The loop keeps serving.
  Stream s_after;
  loop.submit_generate(s_after.job(splice_job(good, SpliceMode::Hypic, w), greedy, max_tokens));
  s_after.wait();
  CHECK(s_after.tokens == s_good.tokens);
}

namespace {

// The CPU backend behind a mutex, declaring concurrent_decode(): the engine loop then decodes on a thread of its own.
// A splice whose query starts with kGate first waits (holding no lock) until `steps_to_wait` more decode calls have
// run, which only a decode running beside the splice can give (a loop that interleaved decode steps between passes
// would wait here until the deadline and report the gate missed).
class ConcurrentCpuBackend final : public Backend {
 public:
  explicit ConcurrentCpuBackend(CpuBackend& inner) : inner_(inner) {}
  static constexpr int32_t kGate = 5;
  int steps_to_wait = 4;
  std::atomic<int> gates_passed{0}, gates_missed{0};
  std::atomic<int> decoding_hint{-1}, hint_at_gate{-1};  // the last Backend::set_decoding_sequences; at the gate
  void set_decoding_sequences(int n) override { decoding_hint = n; }
  const ModelConfig& config() const override { return inner_.config(); }
  DeviceSpec device() const override { return inner_.device(); }
  std::string_view numerics() const override { return inner_.numerics(); }
  const std::string& fingerprint() const override { return inner_.fingerprint(); }
  bool concurrent_decode() const override { return true; }
  std::vector<std::shared_ptr<const ResidentEntry>> build_entries(std::span<const std::vector<int32_t>> s, int w,
                                                                  const BuildCancelled& c = {}) override {
    std::lock_guard<std::mutex> lock(mu_);
    return inner_.build_entries(s, w, c);
  }
  std::shared_ptr<const ResidentEntry> import_entry(std::shared_ptr<const SegmentEntry> e) override {
    std::lock_guard<std::mutex> lock(mu_);
    return inner_.import_entry(std::move(e));
  }
  SpliceOutput splice(const SplicePlan& plan) override {
    if (plan.query[0] == kGate) {
      hint_at_gate = decoding_hint.load();
      std::unique_lock<std::mutex> lock(step_mu_);
      const int target = decode_calls_ + steps_to_wait;
      if (step_cv_.wait_for(lock, std::chrono::seconds(20), [&] { return decode_calls_ >= target; })) ++gates_passed;
      else ++gates_missed;
    }
    std::lock_guard<std::mutex> lock(mu_);
    return inner_.splice(plan);
  }
  void decode(std::span<Sequence* const> seqs, std::span<const int32_t> tokens, std::vector<float>& logits) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      inner_.decode(seqs, tokens, logits);
    }
    std::lock_guard<std::mutex> lock(step_mu_);
    ++decode_calls_;
    step_cv_.notify_all();
  }
  BackendMemory memory() const override { return inner_.memory(); }

 private:
  CpuBackend& inner_;
  std::mutex mu_, step_mu_;
  std::condition_variable step_cv_;
  int decode_calls_ = 0;
};

}  // namespace

TEST_CASE("engine loop with a concurrent decode -- running sequences step while a splice runs, tokens unchanged, "
          "cancel and stop reach them",
          "[engine_loop]") {
  CpuBackend& b = fixture_backend();
  ConcurrentCpuBackend conc(b);
  const int w = 4;
  SamplingConfig greedy, sampled;
  sampled.temperature = 0.8f;
  sampled.top_k = 50;
  sampled.seed = 77;
  const Prompt pa = make_prompt(b, 201, 2, w), pc = make_prompt(b, 203, 1, w);
  Prompt pb = make_prompt(b, 202, 3, w);
  pb.query[0] = ConcurrentCpuBackend::kGate;
  auto loop = std::make_unique<EngineLoop>(conc);
  // A decodes (until cancelled); B's splice cannot finish before A has taken 4 more steps: it does, so they ran
  // beside it.
  Stream a, bs, c;
  auto a_flag = std::make_shared<std::atomic<bool>>(false);
  loop->submit_generate(a.job(splice_job(pa, SpliceMode::Hypic, w), greedy, 100000, a_flag));
  {
    std::unique_lock<std::mutex> lock(a.mu);
    REQUIRE(a.cv.wait_for(lock, std::chrono::seconds(60), [&] { return a.tokens.size() >= 2; }));
  }
  loop->submit_generate(bs.job(splice_job(pb, SpliceMode::Hypic, w), sampled, 12));
  bs.wait();
  a_flag->store(true);
  a.wait();
  CHECK(conc.gates_passed == 1);
  CHECK(conc.gates_missed == 0);
  // The loop told the backend how many sequences its decode thread steps: A while B's splice ran, none at the end.
  CHECK(conc.hint_at_gate == 1);
  CHECK(conc.decoding_hint == 0);
  CHECK(a.end.reason == GenerateEndReason::Cancelled);
  CHECK(a.tokens.size() > 6);
  CHECK(a.tokens == reference_tokens(b, pa, SpliceMode::Hypic, w, greedy, int(a.tokens.size())));
  CHECK(bs.end.reason == GenerateEndReason::Length);
  CHECK(bs.tokens == reference_tokens(b, pb, SpliceMode::Hypic, w, sampled, 12));
  CHECK(loop->active_sequences() == 0);

  // A cancelled sequence leaves the decode thread's batch; stop() ends the ones still running.
  auto flag = std::make_shared<std::atomic<bool>>(false);
  Stream cancel_me, stopped;
  loop->submit_generate(cancel_me.job(splice_job(pc, SpliceMode::Hypic, w), greedy, 100000, flag));
  loop->submit_generate(stopped.job(splice_job(pa, SpliceMode::Hypic, w), greedy, 100000));
  for (Stream* s : {&cancel_me, &stopped}) {
    std::unique_lock<std::mutex> lock(s->mu);
    REQUIRE(s->cv.wait_for(lock, std::chrono::seconds(60), [&] { return s->tokens.size() >= 3; }));
  }
  CHECK(loop->active_sequences() == 2);
  CHECK(conc.decoding_hint == 2);
  flag->store(true);
  cancel_me.wait();
  CHECK(cancel_me.end.reason == GenerateEndReason::Cancelled);
  CHECK(cancel_me.end.error == "cancelled by the caller");
  loop->stop();
  REQUIRE(stopped.ended);
  CHECK(stopped.end.reason == GenerateEndReason::Cancelled);
  CHECK(stopped.end.error == "engine loop stopped");
  CHECK(loop->active_sequences() == 0);
  CHECK(conc.decoding_hint == 0);
  // What each produced is the start of its reference continuation.
  CHECK(cancel_me.tokens == reference_tokens(b, pc, SpliceMode::Hypic, w, greedy, int(cancel_me.tokens.size())));
  CHECK(stopped.tokens == reference_tokens(b, pa, SpliceMode::Hypic, w, greedy, int(stopped.tokens.size())));
  // A generation submitted after stop is reported cancelled at once.
  Stream late;
  loop->submit_generate(late.job(splice_job(pa, SpliceMode::Hypic, w), greedy, 3));
  CHECK(late.ended);
  CHECK(late.end.reason == GenerateEndReason::Cancelled);
}
