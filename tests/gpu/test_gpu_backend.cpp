// The CUDA backend (engine/cuda) against the CPU fp32 engine (engine/cpu/model.h, engine/cpu/splice.h: the path that
// matches Hugging Face to ~1e-5) on random-weight checkpoints with real head sizes (tests/gpu/configs: a
// Qwen3-Next-style MoE model of 8 layers, a Qwen3.5-MoE-style and a Qwen3.5-dense-style model of 4 layers;
// d_k = d_v = 128, attention head_dim 256 / 128). Needs an NVIDIA GPU (scripts/test_gpu.sh).
//
// Stated bf16 tolerances. The yardstick is Hugging Face's own bf16 run of the same checkpoint against its fp32 run
// (tests/fixtures/gpu/<model>_hf_bf16.safetensors, made on the GPU host by tools/make_gpu_fixtures.py): e_hf, the
// relative Frobenius error of HF bf16's logits against HF fp32's over a 150-token prompt (20.1% / 12.5% / 3.5% for
// the three models: random MoE models flip near-tied expert choices, and strong random decays make a state hinge on
// its last few tokens, so single rows and single states can be far off in ANY bf16 implementation).
//   On the fixtures' prompt: our logits against HF fp32 (= the CPU engine) <= 1.25 e_hf, and our argmax agreement
//   with fp32 at least HF bf16's minus 3 points (the direct statement: we are as close to fp32 as HF's bf16 is).
//   Against the CPU engine elsewhere (relative Frobenius ||gpu - cpu|| / ||cpu|| of logits, linear and conv states,
//   KV, entry tensors), over each test's population of cases and layers: median <= 2 e_hf and max <= 5 e_hf;
//   transitions T (strongly decaying: ||T|| can be far below 1) by ||dT|| / max(||T||, ||I||) <= 2e-2; greedy
//   decoding teacher-forced on the CPU's tokens: the median per-step logits error <= 2 e_hf, and the argmax equals
//   the CPU's at every step where the CPU's top-1 / top-2 gap exceeds 10% of its logit spread.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <numeric>
#include <set>
#include <span>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "engine/backend.h"
#include "engine/checkpoint/config.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/sm_partition.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/ops.h"
#include "engine/cpu/model.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/cpu/splice.h"
#include "engine/checkpoint/weights.h"
#include "tests/gpu/backend_test_util.h"
#include "tests/gpu/gpu_util.h"

namespace eng = hypic::engine;
namespace kc = hypic::kernels::cuda;
using hypic::gputest::cuda_device_present;
using hypic::gputest::argmax;
using hypic::gputest::full_plan;
using hypic::gputest::margin;
using hypic::gputest::random_ids;
using hypic::gputest::rel_err;

namespace {

void require_gpu() {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
}

// Two bf16 runs of one request whose forward passes differ only in shape (prefix checkpoints, chunked prefill): the
// GEMMs and the scan round differently, and in these random-weight MoE fixtures a near-tied expert choice can flip
// (HF's own bf16 run is 3-20% from fp32 on them, e_hf below). Measured on an H200: logits 1.2e-2, states 1.4e-2,
// later layers' K 2.9e-2.
constexpr double kPassShapeTol = 5e-2;

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  return rel_err(a.data(), b.data(), a.size());
}

// The test checkpoints: tests/gpu/configs/<name>.json with write_random_checkpoint(seed kSeed, bf16, std kStd), the
// same bytes as `hypic-model init --config tests/gpu/configs/<name>.json --seed 20261201 --std 0.05 --dtype bf16`,
// which is what tools/make_gpu_fixtures.py ran HF on (tests/fixtures/gpu/README.md).
constexpr uint64_t kSeed = 20261201;
constexpr double kStd = 0.05;

// One test model: config, host fp32 weights (bf16-exact: written as bf16), the CPU model and the CUDA backend.
struct Fixture {
  std::string name;
  eng::ModelConfig cfg;
  std::unique_ptr<eng::Model> cpu;
  std::unique_ptr<eng::Backend> gpu;
};

// The test checkpoint of tests/gpu/configs/<name>.json, written to a temporary folder on first use.
std::filesystem::path checkpoint_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("hypic_gpu_" + name + "_std005");
  if (!std::filesystem::exists(dir / "model.safetensors")) {
    const eng::ModelConfig c = eng::load_config("tests/gpu/configs/" + name + ".json");
    eng::write_random_checkpoint(c, kSeed, dir, eng::DType::BF16, kStd);
  }
  return dir;
}

Fixture& fixture(const std::string& name, int64_t max_batch_tokens = 4096) {
  static std::map<std::string, std::unique_ptr<Fixture>> cache;
  const std::string key = name + "/" + std::to_string(max_batch_tokens);
  auto& slot = cache[key];
  if (slot) return *slot;
  auto f = std::make_unique<Fixture>();
  f->name = name;
  const std::filesystem::path dir = checkpoint_dir(name);
  f->cfg = eng::load_config(dir);
  eng::ModelWeights w = eng::load_weights(f->cfg, dir);
  eng::BackendOptions opt;
  opt.max_batch_tokens = max_batch_tokens;
  opt.kv_pool_bytes = size_t(1) << 30;
  opt.max_sequences = 40;
  f->gpu = eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, f->cfg, &w, opt);
  f->cpu = std::make_unique<eng::Model>(f->cfg, std::move(w));
  slot = std::move(f);
  return *slot;
}

const char* kModels[] = {"qwen3_next_gpu", "qwen3_5_moe_gpu", "qwen3_5_dense_gpu"};

// The HF bf16 fixture of a model: its prompt, bf16 and fp32 logits, greedy tokens, and e_hf.
struct HfFixture {
  std::vector<int32_t> ids, greedy, greedy_fp32;
  std::vector<float> logits_bf16, logits_fp32;
  double e_hf = 0;
};

const HfFixture& hf(const std::string& name) {
  static std::map<std::string, HfFixture> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  const auto f = eng::SafetensorsFile::open("tests/fixtures/gpu/" + name + "_hf_bf16.safetensors");
  HfFixture h;
  for (int64_t v : f.read_i64(f.at("ids"))) h.ids.push_back(int32_t(v));
  for (int64_t v : f.read_i64(f.at("greedy"))) h.greedy.push_back(int32_t(v));
  for (int64_t v : f.read_i64(f.at("greedy_fp32"))) h.greedy_fp32.push_back(int32_t(v));
  h.logits_bf16 = f.read_f32(f.at("logits"));
  h.logits_fp32 = f.read_f32(f.at("logits_fp32"));
  h.e_hf = rel_err(h.logits_bf16.data(), h.logits_fp32.data(), h.logits_fp32.size());
  return cache[name] = std::move(h);
}

// Checks a population of errors: median <= 2 e_hf, max <= 5 e_hf (see the header).
void check_population(std::vector<double> e, double e_hf, const char* what) {
  REQUIRE(!e.empty());
  std::sort(e.begin(), e.end());
  const double median = e[e.size() / 2], worst = e.back();
  std::printf("[backend]   %s: %zu values, median %.3e (bound %.3e), max %.3e (bound %.3e)\n", what, e.size(), median,
              2 * e_hf, worst, 5 * e_hf);
  CHECK(median <= 2 * e_hf);
  CHECK(worst <= 5 * e_hf);
}

// Relative error of transitions, judged against the identity's scale when ||T|| is small.
double rel_t(const std::vector<float>& a, const std::vector<float>& b, int heads, int dk) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), den += double(b[i]) * b[i];
  return std::sqrt(num / std::max(den, double(heads) * dk));
}




// A hypic splice (w = 8) of `segs` with their entries, then `steps` greedy decode steps: the first logits and tokens.
std::pair<std::vector<float>, std::vector<int32_t>> splice_and_decode(
    eng::Backend& gpu, const std::vector<std::vector<int32_t>>& segs,
    const std::vector<std::shared_ptr<const eng::ResidentEntry>>& entries, const std::vector<int32_t>& query,
    int steps) {
  const size_t V = size_t(gpu.config().vocab_size);
  eng::SplicePlan p;
  p.mode = eng::SpliceMode::Hypic;
  p.seam_width = 8;
  p.query = query;
  for (size_t i = 0; i < segs.size(); ++i) p.segments.push_back({segs[i], entries[i]});
  eng::SpliceOutput o = gpu.splice(p);
  std::vector<int32_t> toks;
  std::vector<float> lg = o.logits;
  for (int s = 0; s < steps; ++s) {
    toks.push_back(argmax(lg.data(), V));
    eng::Sequence* q[1] = {o.sequence.get()};
    gpu.decode(q, std::span<const int32_t>(&toks.back(), 1), lg);
  }
  return {o.logits, toks};
}


}  // namespace

TEST_CASE("cuda backend: prefill logits, states and KV match the CPU engine", "[backend]") {
  require_gpu();
  for (const char* name : kModels) {
    Fixture& f = fixture(name);
    const size_t V = size_t(f.cfg.vocab_size);
    std::mt19937 rng(7);
    std::vector<double> pop_logits, pop_state, pop_kv;
    for (size_t T : {2, 65, 300, 1000}) {
      const auto ids = random_ids(rng, T, f.cfg.vocab_size);
      eng::ModelState st = f.cpu->initial_state();
      eng::PrefillOptions po;
      po.all_logits = true;
      const auto ref = f.cpu->prefill(st, ids, 0, po).logits;  // [T][V]
      eng::SpliceOutput out = f.gpu->splice(full_plan(ids, 1, true));
      REQUIRE(out.logits.size() == (T - 1) * V);
      const std::vector<float> ref_tail(ref.begin() + V, ref.end());
      const double e_logits = rel(out.logits, ref_tail);
      const eng::ModelState gs = out.sequence->to_host();
      double e_ssm = 0, e_conv = 0, e_kv = 0;
      std::string per_layer;
      for (int i = 0; i < f.cfg.num_hidden_layers; ++i) {
        char buf[96];
        if (f.cfg.layer_types[i] == eng::LayerType::Linear) {
          const int l = f.cfg.linear_index(i);
          const double es = rel(gs.linear[l].ssm, st.linear[l].ssm), ec = rel(gs.linear[l].conv, st.linear[l].conv);
          e_ssm = std::max(e_ssm, es), e_conv = std::max(e_conv, ec);
          pop_state.push_back(es), pop_state.push_back(ec);
          std::snprintf(buf, sizeof buf, " L%d S %.1e conv %.1e;", i, es, ec);
        } else {
          const int a = f.cfg.attention_index(i);
          const double ek = rel(gs.attention[a].k, st.attention[a].k), ev = rel(gs.attention[a].v, st.attention[a].v);
          e_kv = std::max(e_kv, std::max(ek, ev));
          pop_kv.push_back(ek), pop_kv.push_back(ev);
          std::snprintf(buf, sizeof buf, " F%d K %.1e V %.1e;", i, ek, ev);
        }
        per_layer += buf;
      }
      std::vector<double> rows;
      for (size_t t = 0; t + 1 < T; ++t) rows.push_back(rel_err(out.logits.data() + t * V, ref_tail.data() + t * V, V));
      std::sort(rows.begin(), rows.end());
      std::printf("[backend] %s prefill T=%zu: logits %.3e (per row median %.2e p90 %.2e max %.2e), linear state "
                  "%.3e, conv %.3e, KV %.3e |%s\n",
                  name, T, e_logits, rows[rows.size() / 2], rows[rows.size() * 9 / 10], rows.back(), e_ssm, e_conv,
                  e_kv, per_layer.c_str());
      CHECK(out.num_tokens == int64_t(T));
      pop_logits.push_back(e_logits);
    }
    const double e_hf = hf(name).e_hf;
    check_population(pop_logits, e_hf, "prefill logits");
    check_population(pop_state, e_hf, "linear and conv states");
    check_population(pop_kv, e_hf, "K and V");
  }
}

TEST_CASE("cuda backend: as close to HF fp32 as HF's own bf16 run, on the HF fixtures", "[backend]") {
  require_gpu();
  for (const char* name : kModels) {
    Fixture& f = fixture(name);
    const HfFixture& h = hf(name);
    const size_t V = size_t(f.cfg.vocab_size), T = h.ids.size();
    REQUIRE(h.logits_fp32.size() == T * V);
    // The CPU engine is the fp32 reference: it must equal HF fp32 (run on the GPU host's GPU) closely.
    eng::ModelState st = f.cpu->initial_state();
    eng::PrefillOptions po;
    po.all_logits = true;
    const auto cpu = f.cpu->prefill(st, h.ids, 0, po).logits;
    const double e_cpu = rel(cpu, h.logits_fp32);
    eng::SpliceOutput out = f.gpu->splice(full_plan(h.ids, 1, true));
    const std::vector<float> fp32_tail(h.logits_fp32.begin() + V, h.logits_fp32.end());
    const std::vector<float> bf16_tail(h.logits_bf16.begin() + V, h.logits_bf16.end());
    const double e_ours = rel(out.logits, fp32_tail), e_hf = rel(bf16_tail, fp32_tail);
    const double e_vs_hf_bf16 = rel(out.logits, bf16_tail);
    int agree_ours = 0, agree_hf = 0;
    for (size_t t = 0; t + 1 < T; ++t) {
      const int ref = argmax(fp32_tail.data() + t * V, V);
      agree_ours += argmax(out.logits.data() + t * V, V) == ref;
      agree_hf += argmax(bf16_tail.data() + t * V, V) == ref;
    }
    // Greedy continuation from the prompt.
    std::vector<int32_t> greedy;
    std::vector<float> lg(out.logits.end() - V, out.logits.end());
    for (size_t s = 0; s < h.greedy.size(); ++s) {
      greedy.push_back(argmax(lg.data(), V));
      eng::Sequence* q[1] = {out.sequence.get()};
      f.gpu->decode(q, std::span<const int32_t>(&greedy.back(), 1), lg);
    }
    auto prefix = [](const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
      size_t n = 0;
      while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
      return n;
    };
    std::printf("[backend] %s vs HF (%zu-token prompt): CPU vs HF fp32 %.2e; ours vs HF fp32 %.3e, HF bf16 vs HF fp32 "
                "%.3e, ours vs HF bf16 %.3e; argmax agreement with fp32: ours %.3f, HF bf16 %.3f; greedy prefix equal "
                "to HF fp32's: ours %zu, HF bf16 %zu; to HF bf16's: ours %zu (of %zu)\n",
                name, T, e_cpu, e_ours, e_hf, e_vs_hf_bf16, double(agree_ours) / double(T - 1),
                double(agree_hf) / double(T - 1), prefix(greedy, h.greedy_fp32), prefix(h.greedy, h.greedy_fp32),
                prefix(greedy, h.greedy), h.greedy.size());
    CHECK(e_cpu <= 1e-3);
    CHECK(e_ours <= 1.25 * e_hf);
    CHECK(double(agree_ours) >= double(agree_hf) - 0.03 * double(T - 1));
  }
}

TEST_CASE("cuda backend: chunked prefill (max_batch_tokens below the prompt) equals the CPU engine", "[backend]") {
  require_gpu();
  Fixture& f = fixture("qwen3_5_moe_gpu", 128);
  std::mt19937 rng(11);
  const auto ids = random_ids(rng, 700, f.cfg.vocab_size);
  eng::ModelState st = f.cpu->initial_state();
  const auto ref = f.cpu->prefill(st, ids, 0).logits;
  eng::SpliceOutput out = f.gpu->splice(full_plan(ids, 500, false));
  const double e = rel(out.logits, ref);
  std::printf("[backend] chunked prefill (128-token passes, 700 tokens): last logits %.3e\n", e);
  std::vector<double> pop{e};
  const eng::ModelState gs = out.sequence->to_host();
  for (size_t l = 0; l < st.linear.size(); ++l) pop.push_back(rel(gs.linear[l].ssm, st.linear[l].ssm));
  check_population(pop, hf("qwen3_5_moe_gpu").e_hf, "chunked prefill logits and states");
}

TEST_CASE("cuda backend: greedy decoding follows the CPU engine", "[backend]") {
  require_gpu();
  for (const char* name : kModels) {
    Fixture& f = fixture(name);
    const size_t V = size_t(f.cfg.vocab_size);
    std::mt19937 rng(3);
    const auto ids = random_ids(rng, 200, f.cfg.vocab_size);
    eng::ModelState st = f.cpu->initial_state();
    std::vector<float> ref = f.cpu->prefill(st, ids, 0).logits;
    eng::SpliceOutput out = f.gpu->splice(full_plan(ids, 150, false));
    std::vector<float> got = out.logits;
    int free_run_agree = 0, checked = 0;
    double worst = 0;
    std::vector<double> step_err;
    int gpu_free = argmax(got.data(), V);
    bool diverged = false;
    for (int step = 0; step < 32; ++step) {
      const int tok = argmax(ref.data(), V);  // teacher forcing on the CPU's greedy tokens
      const double e = rel(got, ref);
      worst = std::max(worst, e);
      step_err.push_back(e);
      if (margin(ref.data(), V) > 0.1) {
        ++checked;
        CHECK(argmax(got.data(), V) == tok);
      }
      if (!diverged && gpu_free == tok) ++free_run_agree;
      else diverged = true;
      ref = f.cpu->decode(st, tok, int64_t(ids.size()) + step);
      eng::Sequence* seqs[1] = {out.sequence.get()};
      const int32_t toks[1] = {tok};
      f.gpu->decode(seqs, toks, got);
      gpu_free = argmax(got.data(), V);
    }
    std::sort(step_err.begin(), step_err.end());
    const double median = step_err[step_err.size() / 2];
    std::printf("[backend] %s greedy 32: teacher-forced logits error median %.3e worst %.3e, argmax checked at %d "
                "steps, GPU's own greedy run agrees for its first %d tokens\n",
                name, median, worst, checked, free_run_agree);
    CHECK(median <= 2 * hf(name).e_hf);
  }
}

TEST_CASE("cuda backend: entries and splices in every mode match the CPU engine", "[backend]") {
  require_gpu();
  for (const char* name : kModels) {
    Fixture& f = fixture(name);
    const int w = 8;
    std::mt19937 rng(5);
    std::vector<std::vector<int32_t>> segs;
    for (size_t n : {40, 7, 130, 65, 1}) segs.push_back(random_ids(rng, n, f.cfg.vocab_size));
    const auto query = random_ids(rng, 20, f.cfg.vocab_size);
    const auto gentries = f.gpu->build_entries(segs, w);
    REQUIRE(gentries.size() == segs.size());
    std::vector<std::shared_ptr<const eng::SegmentEntry>> centries;
    for (const auto& s : segs) centries.push_back(std::make_shared<eng::SegmentEntry>(eng::build_segment_entry(*f.cpu, s, w)));
    // Transition mode's entries: w = 0, no seam state (engine/segment.h); (T_int, S_int) = (T_C, S(C|0)).
    const auto gentries0 = f.gpu->build_entries(segs, 0);
    std::vector<std::shared_ptr<const eng::SegmentEntry>> centries0;
    for (const auto& s : segs) centries0.push_back(std::make_shared<eng::SegmentEntry>(eng::build_segment_entry(*f.cpu, s, 0)));
    std::vector<double> pop_entry;
    const int H = f.cfg.linear_num_value_heads, dk = f.cfg.linear_key_head_dim;
    const size_t state_bytes = size_t(H) * dk * f.cfg.linear_value_head_dim * 4;
    for (size_t i = 0; i < segs.size(); ++i) {
      const auto h = gentries[i]->host(), h0 = gentries0[i]->host();
      const auto& c = *centries[i];
      double e[7] = {0, 0, 0, 0, 0, 0, 0};  // T_C (w = 0) S_seam T_int S_int conv K V
      CHECK(gentries[i]->resident_bytes() - gentries0[i]->resident_bytes() >= c.linear.size() * state_bytes);
      for (size_t l = 0; l < c.linear.size(); ++l) {
        CHECK(h0->linear[l].seam_state.empty());
        e[0] = std::max(e[0], rel_t(h0->linear[l].interior_transition.to_dense(),
                                    centries0[i]->linear[l].interior_transition.to_dense(), H, dk));
        pop_entry.push_back(rel(h0->linear[l].interior_state, centries0[i]->linear[l].interior_state));
        e[1] = std::max(e[1], rel(h->linear[l].seam_state, c.linear[l].seam_state));
        e[2] = std::max(e[2], rel_t(h->linear[l].interior_transition.to_dense(),
                                    c.linear[l].interior_transition.to_dense(), H, dk));
        if (c.num_tokens() > w) e[3] = std::max(e[3], rel(h->linear[l].interior_state, c.linear[l].interior_state));
        else CHECK(*std::max_element(h->linear[l].interior_state.begin(), h->linear[l].interior_state.end()) == 0.f);
        e[4] = std::max(e[4], rel(h->linear[l].conv_tail, c.linear[l].conv_tail));
      }
      for (size_t a = 0; a < c.attention.size(); ++a) {
        e[5] = std::max(e[5], rel(h->attention[a].k, c.attention[a].k));
        e[6] = std::max(e[6], rel(h->attention[a].v, c.attention[a].v));
      }
      std::printf("[backend] %s entry %zu (%d tokens): T_C(w=0) %.2e S_seam %.2e T_int %.2e S_int %.2e conv %.2e K %.2e "
                  "V %.2e\n",
                  name, i, c.num_tokens(), e[0], e[1], e[2], e[3], e[4], e[5], e[6]);
      CHECK(e[0] <= 2e-2);
      CHECK(e[2] <= 2e-2);
      for (int j : {1, 3, 4, 5, 6})
        if (j != 3 || c.num_tokens() > w) pop_entry.push_back(e[j]);
    }
    // A build cancelled part way (asked before each layer) gives null entries and leaves the backend as it was; one
    // with a segment still wanted runs on (a batch stops when none of its segments is).
    {
      const size_t kv_before = f.gpu->memory().kv_used;
      int asked = 0;
      const auto stopped = f.gpu->build_entries(segs, w, [&](size_t) { return ++asked > 2; });  // at layer 1
      REQUIRE(stopped.size() == segs.size());
      for (const auto& e : stopped) CHECK(e == nullptr);
      const auto partly = f.gpu->build_entries(segs, w, [](size_t i) { return i != 2; });
      for (const auto& e : partly) CHECK(e != nullptr);
      CHECK(f.gpu->memory().kv_used == kv_before);
    }
    // The wire form written straight from the device copy equals the host entry's, bit for bit (w = 8 and w = 0).
    for (size_t i = 0; i < segs.size(); ++i) {
      CHECK(f.gpu->wire_of(*gentries[i]) == eng::serialize_entry(*gentries[i]->host()));
      CHECK(f.gpu->wire_of_block(*f.gpu->copy_to_host(*gentries0[i])) == eng::serialize_entry(*gentries0[i]->host()));
    }
    const double e_hf = hf(name).e_hf;
    check_population(pop_entry, e_hf, "entry states, conv tails, K and V");
    std::vector<double> pop_logits, pop_state;
    for (eng::SpliceMode mode : {eng::SpliceMode::Full, eng::SpliceMode::Prefix, eng::SpliceMode::Naive,
                                 eng::SpliceMode::Transition, eng::SpliceMode::Hypic}) {
      eng::SplicePlan gp;
      eng::SpliceRequest cr;
      gp.mode = cr.mode = mode;
      gp.seam_width = cr.seam_width = w;
      gp.query = cr.query = query;
      gp.all_query_logits = cr.all_query_logits = true;
      gp.use_prefix_cache = false;
      const bool w0 = mode == eng::SpliceMode::Transition;  // its entries are made with w = 0
      for (size_t i = 0; i < segs.size(); ++i) {
        gp.segments.push_back({segs[i], w0 ? gentries0[i] : gentries[i]});
        cr.segments.push_back({segs[i], w0 ? centries0[i] : centries[i]});
      }
      if (w0) {  // a w = 8 entry is refused, naming the width transition mode needs
        eng::SplicePlan bad = gp;
        bad.segments[1].entry = gentries[1];
        CHECK_THROWS_WITH(f.gpu->splice(bad), Catch::Contains("seam width 8") && Catch::Contains("transition mode"));
      }
      // Both backends execute the one planner's schedule (engine/splice_schedule.h): the same steps, folds and
      // positions.
      std::vector<eng::SpliceSchedule> gsch, csch;
      gp.on_schedule = [&](const eng::SpliceSchedule& s) { gsch.push_back(s); };
      cr.on_schedule = [&](const eng::SpliceSchedule& s) { csch.push_back(s); };
      const eng::SpliceResult ref = eng::splice(*f.cpu, cr);
      const eng::SpliceOutput got = f.gpu->splice(gp);
      CHECK(gsch.size() == 1);
      CHECK(gsch == csch);
      const double e = rel(got.logits, ref.logits);
      std::printf("[backend] %s splice %-10s: query logits %.3e (computed %lld / %lld tokens)\n", name,
                  eng::splice_mode_name(mode), e, (long long)got.computed_tokens, (long long)ref.computed_tokens);
      pop_logits.push_back(e);
      CHECK(got.num_tokens == ref.num_tokens);
      CHECK(got.computed_tokens == ref.computed_tokens);
      const eng::ModelState gs = got.sequence->to_host();
      for (size_t l = 0; l < gs.linear.size(); ++l) pop_state.push_back(rel(gs.linear[l].ssm, ref.state.linear[l].ssm));
      for (size_t a = 0; a < gs.attention.size(); ++a) pop_state.push_back(rel(gs.attention[a].k, ref.state.attention[a].k));
    }
    check_population(pop_logits, e_hf, "splice query logits (5 modes)");
    check_population(pop_state, e_hf, "spliced states and K");
  }
}

TEST_CASE("cuda backend: recompute_segments, refresh_segments and refresh_tail match the CPU engine", "[backend]") {
  require_gpu();
  for (const char* name : kModels) {
    Fixture& f = fixture(name);
    const int w = 8;
    std::mt19937 rng(9);
    std::vector<std::vector<int32_t>> segs;
    for (size_t n : {40, 7, 130, 65}) segs.push_back(random_ids(rng, n, f.cfg.vocab_size));
    const auto query = random_ids(rng, 20, f.cfg.vocab_size);
    const auto gentries = f.gpu->build_entries(segs, w);
    std::vector<std::shared_ptr<const eng::SegmentEntry>> centries;
    for (const auto& s : segs) centries.push_back(std::make_shared<eng::SegmentEntry>(eng::build_segment_entry(*f.cpu, s, w)));
    auto plans = [&](std::vector<int> recompute, int refresh) {
      eng::SplicePlan gp;
      eng::SpliceRequest cr;
      gp.mode = cr.mode = eng::SpliceMode::Hypic;
      gp.seam_width = cr.seam_width = w;
      gp.query = cr.query = query;
      gp.all_query_logits = cr.all_query_logits = true;
      gp.recompute_segments = cr.recompute_segments = recompute;
      gp.refresh_segments = cr.refresh_segments = refresh;
      for (size_t i = 0; i < segs.size(); ++i) {
        gp.segments.push_back({segs[i], gentries[i]});
        cr.segments.push_back({segs[i], centries[i]});
      }
      return std::make_pair(gp, cr);
    };
    std::vector<double> pop;
    {  // explicit: segments 1 and 3 whole in context
      auto [gp, cr] = plans({3, 1}, 0);
      const eng::SpliceResult ref = eng::splice(*f.cpu, cr);
      const eng::SpliceOutput got = f.gpu->splice(gp);
      CHECK(got.recomputed_segments == std::vector<int>{1, 3});
      CHECK(got.computed_tokens == ref.computed_tokens);
      pop.push_back(rel(got.logits, ref.logits));
      const eng::ModelState gs = got.sequence->to_host();
      for (size_t l = 0; l < gs.linear.size(); ++l) pop.push_back(rel(gs.linear[l].ssm, ref.state.linear[l].ssm));
      for (size_t a = 0; a < gs.attention.size(); ++a) pop.push_back(rel(gs.attention[a].k, ref.state.attention[a].k));
    }
    {  // refresh 2: the probe picks two segments; the answer is the explicit splice of those, bit for bit
      auto [gp, cr] = plans({}, 2);
      std::vector<eng::SpliceSchedule> gsch, csch;  // the probe's schedule, then the answer's
      gp.on_schedule = [&](const eng::SpliceSchedule& s) { gsch.push_back(s); };
      cr.on_schedule = [&](const eng::SpliceSchedule& s) { csch.push_back(s); };
      const eng::SpliceResult ref = eng::splice(*f.cpu, cr);
      const eng::SpliceOutput got = f.gpu->splice(gp);
      REQUIRE(gsch.size() == 2);
      REQUIRE(csch.size() == 2);
      CHECK(gsch[0].probe);
      CHECK(gsch[0] == csch[0]);
      if (got.recomputed_segments == ref.recomputed_segments) CHECK(gsch[1] == csch[1]);
      std::printf("[backend] %s refresh 2: cuda chose", name);
      for (int i : got.recomputed_segments) std::printf(" %d", i);
      std::printf(", cpu chose");
      for (int i : ref.recomputed_segments) std::printf(" %d", i);
      std::printf("\n");
      REQUIRE(got.recomputed_segments.size() == 2);
      auto [gx, cx] = plans(got.recomputed_segments, 0);
      const eng::SpliceOutput same = f.gpu->splice(gx);
      CHECK(got.logits == same.logits);
      // + the probe: the seams (segment 1 has 7 tokens: its seam is all of it) and the query.
      CHECK(got.computed_tokens == same.computed_tokens + (w + 7 + w) + 20);
      if (got.recomputed_segments == ref.recomputed_segments) pop.push_back(rel(got.logits, ref.logits));
    }
    {  // refresh of every later segment is full recomputation (segment 1, 7 tokens <= w, has no interior to refresh:
       // its seam window already recomputes it whole)
      auto [gp, cr] = plans({}, 5);
      const eng::SpliceOutput got = f.gpu->splice(gp);
      CHECK(got.recomputed_segments == std::vector<int>{2, 3});
      cr.mode = eng::SpliceMode::Full;
      cr.refresh_segments = 0;
      const eng::SpliceResult full = eng::splice(*f.cpu, cr);
      pop.push_back(rel(got.logits, full.logits));
    }
    {  // refresh_tail 2: segments 2 and 3 whole, no probe; the CPU engine's tail, and the explicit splice bit for bit
      auto [gp, cr] = plans({}, 0);
      gp.refresh_tail = cr.refresh_tail = 2;
      const eng::SpliceResult ref = eng::splice(*f.cpu, cr);
      const eng::SpliceOutput got = f.gpu->splice(gp);
      CHECK(got.recomputed_segments == std::vector<int>{2, 3});
      CHECK(ref.recomputed_segments == std::vector<int>{2, 3});
      CHECK(got.computed_tokens == ref.computed_tokens);
      auto [gx, cx] = plans({2, 3}, 0);
      CHECK(got.logits == f.gpu->splice(gx).logits);
      pop.push_back(rel(got.logits, ref.logits));
      // With refresh 1 on top, the choice is among the segments outside the tail: only segment 1, which has no
      // interior (7 tokens <= w): nothing more is recomputed, and no probe pass runs.
      gp.refresh_segments = 1;
      const eng::SpliceOutput more = f.gpu->splice(gp);
      CHECK(more.recomputed_segments == std::vector<int>{2, 3});
      CHECK(more.computed_tokens == got.computed_tokens);
    }
    check_population(pop, hf(name).e_hf, "recompute / refresh splices");
    auto [bad, unused] = plans({0}, 0);
    CHECK_THROWS_WITH(f.gpu->splice(bad), Catch::Contains("index 0 is outside [1, 4)"));
    auto [bad_tail, unused2] = plans({}, 0);
    bad_tail.refresh_tail = -1;
    CHECK_THROWS_WITH(f.gpu->splice(bad_tail), Catch::Contains("refresh_tail must be >= 0"));
  }
}

TEST_CASE("cuda backend: hit and miss give bit-identical tokens -- a request run twice too", "[backend]") {
  require_gpu();
  Fixture& f = fixture("qwen3_5_moe_gpu");
  std::mt19937 rng(9);
  std::vector<std::vector<int32_t>> segs;
  for (size_t n : {100, 64, 33}) segs.push_back(random_ids(rng, n, f.cfg.vocab_size));
  const auto query = random_ids(rng, 12, f.cfg.vocab_size);
  const auto built = f.gpu->build_entries(segs, 8);
  auto run = [&](const std::vector<std::shared_ptr<const eng::ResidentEntry>>& entries) {
    return splice_and_decode(*f.gpu, segs, entries, query, 16);
  };
  const auto miss = run(built);
  std::vector<std::shared_ptr<const eng::ResidentEntry>> imported;
  for (const auto& e : built) {
    const std::string bytes = eng::serialize_entry(*e->host());
    imported.push_back(f.gpu->import_entry(std::make_shared<eng::SegmentEntry>(eng::deserialize_entry(bytes))));
  }
  const auto hit = run(imported);
  const auto again = run(built);
  CHECK(miss.first == hit.first);
  CHECK(miss.second == hit.second);
  CHECK(miss.first == again.first);
  CHECK(miss.second == again.second);
}

TEST_CASE("cuda backend: host blocks round-trip bit for bit, on other threads while the engine splices", "[backend][host_block]") {
  require_gpu();
  Fixture& f = fixture("qwen3_5_moe_gpu");
  std::mt19937 rng(19);
  std::vector<std::vector<int32_t>> segs;
  for (size_t n : {150, 70, 9, 41}) segs.push_back(random_ids(rng, n, f.cfg.vocab_size));
  const auto query = random_ids(rng, 10, f.cfg.vocab_size);
  const auto built = f.gpu->build_entries(segs, 8);
  REQUIRE(f.gpu->device_entries());
  auto raw = [&](const eng::ResidentEntry& e) {  // the device block's bytes, read with a plain cudaMemcpy
    const auto b = f.gpu->device_block(e);
    REQUIRE(b);
    std::vector<char> out(b->bytes);
    REQUIRE(cudaMemcpy(out.data(), b->data, b->bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  };
  auto run = [&](const std::vector<std::shared_ptr<const eng::ResidentEntry>>& entries) {
    return splice_and_decode(*f.gpu, segs, entries, query, 8);
  };
  const auto reference = run(built);
  // Copies to the host and back, made on four threads while the engine thread splices the same prompt.
  std::vector<std::shared_ptr<const eng::HostBlock>> blocks(segs.size());
  std::vector<std::shared_ptr<const eng::ResidentEntry>> back(segs.size());
  std::vector<std::string> errors(segs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < segs.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        blocks[i] = f.gpu->copy_to_host(*built[i]);
        back[i] = f.gpu->import_block(*blocks[i]);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  const auto during = run(built);
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < segs.size(); ++i) {
    INFO("segment " << i);
    REQUIRE(errors[i].empty());
    CHECK(blocks[i]->bytes() == built[i]->resident_bytes());
    CHECK(blocks[i]->bytes() == f.gpu->entry_bytes(int64_t(segs[i].size())));
    CHECK(blocks[i]->header().token_ids == segs[i]);
    CHECK(raw(*back[i]) == raw(*built[i]));  // every byte of the block, padding included
  }
  CHECK(during == reference);
  CHECK(run(back) == reference);
  // The wire form of a block is the entry's host() form, and a block made from it imports to the same bytes.
  for (size_t i = 0; i < segs.size(); ++i) {
    const auto wire = f.gpu->entry_of_block(*blocks[i]);
    CHECK(eng::serialize_entry(*wire) == eng::serialize_entry(*built[i]->host()));
    const auto again = f.gpu->import_block(*f.gpu->block_of_entry(*wire));
    const auto a = raw(*again), b = raw(*built[i]);
    // Alignment padding is not part of the wire form: compare the entry through a splice instead of raw bytes.
    CHECK(a.size() == b.size());
    back[i] = again;
  }
  CHECK(run(back) == reference);
  // Received as wire bytes (a delivery, a cache fetch): straight into a pinned block whose wire form is those bytes, bit
  // for bit, in chunks of any size; it imports to an entry that splices as the built one.
  for (size_t i = 0; i < segs.size(); ++i) {
    const std::string wire = f.gpu->wire_of_block(*blocks[i]);
    for (size_t chunk : {size_t(4099), wire.size()}) {
      eng::EntryReceiver rx(*f.gpu, {.total_bytes = wire.size()});
      for (size_t off = 0; off < wire.size(); off += chunk) rx.feed(std::string_view(wire).substr(off, chunk));
      const auto got = rx.finish();
      REQUIRE(got.block);
      CHECK(got.entry->token_ids == segs[i]);
      CHECK(got.entry->linear.empty());
      CHECK(got.block->bytes() == built[i]->resident_bytes());
      CHECK(f.gpu->wire_of_block(*got.block) == wire);
      std::string pieces;
      uint64_t total = 0;
      f.gpu->write_wire_of_block(*got.block, [&](uint64_t n) { total = n; }, [&](std::string_view p) { pieces += p; });
      CHECK(total == wire.size());
      CHECK(pieces == wire);
      back[i] = f.gpu->import_block(*got.block);
    }
  }
  CHECK(run(back) == reference);
  {
    // A wire form of other dtypes (fp32 K/V: one value that is not a bf16 value) is parsed into a host entry instead.
    auto fp32 = std::make_shared<eng::SegmentEntry>(*built[0]->host());
    fp32->attention[0].k[0] = 1.0f + 1.0f / 1024 / 1024;
    const std::string wire = eng::serialize_entry(*fp32);
    eng::EntryReceiver rx(*f.gpu, {.total_bytes = wire.size()});
    rx.feed(wire);
    const auto got = rx.finish();
    CHECK_FALSE(got.block);
    CHECK(got.entry->attention.size() == fp32->attention.size());
    eng::WireShape shape{std::vector<eng::TransitionKind>(fp32->linear.size(), eng::TransitionKind::Dense), false, 0};
    CHECK_FALSE(f.gpu->wire_block(*fp32, shape));
    shape.kv_bf16 = true;
    shape.interior_kinds.back() = eng::TransitionKind::Diagonal;
    CHECK_FALSE(f.gpu->wire_block(*fp32, shape));
  }
  // Errors: a block of another backend's geometry is refused by import_block; the CPU backend has no host blocks.
  const auto host = built[0]->host();
  auto other = std::make_shared<eng::SegmentEntry>(*host);
  other->model_fingerprint = "another-model";
  CHECK_THROWS_AS(f.gpu->block_of_entry(*other), eng::EntryError);
  CHECK(f.gpu->memory().pinned_host > 0);
  CHECK(f.gpu->memory().device_free > 0);
}

TEST_CASE("cuda backend: entries brought as host blocks are staged during the splice -- at once bit for bit, "
          "group by group within the pass-shape tolerance", "[backend][host_block]") {
  require_gpu();
  Fixture& f = fixture("qwen3_5_moe_gpu");
  std::mt19937 rng(23);
  std::vector<std::vector<int32_t>> segs;
  for (size_t n : {150, 70, 9, 41, 64, 33}) segs.push_back(random_ids(rng, n, f.cfg.vocab_size));
  const auto query = random_ids(rng, 12, f.cfg.vocab_size);
  const size_t V = size_t(f.cfg.vocab_size);
  std::vector<std::shared_ptr<const eng::HostBlock>> blocks;
  std::vector<std::shared_ptr<const eng::ResidentEntry>> built, built0;
  for (int w : {8, 0}) {
    auto& b = w ? built : built0;
    b = f.gpu->build_entries(segs, w);
  }
  size_t largest = 0;
  for (const auto& e : built) {
    blocks.push_back(f.gpu->copy_to_host(*e));
    largest = std::max(largest, (e->resident_bytes() + 255) / 256 * 256);
  }
  struct Run {
    std::vector<float> logits;
    std::vector<int32_t> tokens;
    eng::ModelState state;
    eng::SpliceOutput out;
  };
  // A splice of `mode` whose segments bring resident entries (room 0 and !use_blocks) or host blocks staged in `room`
  // bytes (0 = auto), then 6 greedy decode steps.
  auto run = [&](eng::SpliceMode mode, bool use_blocks, size_t room, int refresh = 0, int64_t max_pass = 0,
                 bool every_logit = false) {
    const bool transition = mode == eng::SpliceMode::Transition;
    std::vector<std::shared_ptr<const eng::HostBlock>> tblocks;
    if (transition && use_blocks)
      for (const auto& e : built0) tblocks.push_back(f.gpu->copy_to_host(*e));
    eng::SplicePlan p;
    p.mode = mode;
    p.seam_width = transition ? 0 : 8;
    p.query = query;
    p.refresh_segments = refresh;
    p.block_staging_bytes = room;
    p.max_pass_tokens = max_pass;
    p.all_query_logits = every_logit;
    p.keep_context_state = every_logit;
    for (size_t i = 0; i < segs.size(); ++i) {
      if (use_blocks) p.segments.push_back({segs[i], nullptr, transition ? tblocks[i] : blocks[i]});
      else p.segments.push_back({segs[i], transition ? built0[i] : built[i]});
    }
    Run r;
    r.out = f.gpu->splice(p);
    r.logits = r.out.logits;
    std::vector<float> lg(r.logits.end() - std::ptrdiff_t(V), r.logits.end());  // (the last query position's)
    for (int s = 0; s < 6; ++s) {
      r.tokens.push_back(argmax(lg.data(), V));
      eng::Sequence* q[1] = {r.out.sequence.get()};
      f.gpu->decode(q, std::span<const int32_t>(&r.tokens.back(), 1), lg);
    }
    r.state = r.out.sequence->to_host();
    return r;
  };
  auto state_err = [&](const eng::ModelState& a, const eng::ModelState& b) {
    double e = 0;
    for (size_t l = 0; l < a.linear.size(); ++l) e = std::max(e, rel(a.linear[l].ssm, b.linear[l].ssm));
    return e;
  };
  const Run ref = run(eng::SpliceMode::Hypic, false, 0);
  CHECK(ref.out.staged_segments == 0);
  SECTION("every block at once (auto): one group, the passes of resident entries, bit for bit") {
    const Run r = run(eng::SpliceMode::Hypic, true, 0);
    CHECK(r.out.staged_segments == int(segs.size()));
    CHECK(r.out.staged_groups == 1);
    CHECK(r.out.staging_bytes >= largest);
    CHECK(hypic::gputest::same_bits(r.logits, ref.logits));
    CHECK(r.tokens == ref.tokens);
    CHECK(state_err(r.state, ref.state) == 0);
  }
  SECTION("a room of one entry: one group per entry, the copies waited for; two halves of one: the same groups, "
          "each copied while the previous group's passes run -- the same bits") {
    const Run one = run(eng::SpliceMode::Hypic, true, largest);
    const Run two = run(eng::SpliceMode::Hypic, true, 2 * largest);
    std::printf("[backend] staged splice: room 1 entry %d groups, 2 entries %d groups (%zu staging bytes)\n",
                one.out.staged_groups, two.out.staged_groups, two.out.staging_bytes);
    CHECK(one.out.staged_segments == int(segs.size()));
    CHECK(one.out.staged_groups == int(segs.size()));  // (the largest entry's room holds no two entries)
    CHECK(two.out.staged_groups == one.out.staged_groups);
    CHECK(one.out.staging_bytes <= largest);
    CHECK(two.out.staging_bytes <= 2 * largest);
    CHECK(hypic::gputest::same_bits(one.logits, two.logits));
    CHECK(one.tokens == two.tokens);
    CHECK(state_err(one.state, two.state) == 0);
    // Against the resident splice: the same arithmetic in more, smaller passes.
    const double el = rel(two.logits, ref.logits), es = state_err(two.state, ref.state);
    std::printf("[backend] staged splice against resident: logits %.3e, states %.3e\n", el, es);
    CHECK(el <= kPassShapeTol);
    CHECK(es <= kPassShapeTol);
    CHECK(two.out.num_tokens == ref.out.num_tokens);
    CHECK(two.out.computed_tokens == ref.out.computed_tokens);
  }
  SECTION("naive and transition folds (all before the query) go group by group, the refresh's probe stages too") {
    for (const auto mode : {eng::SpliceMode::Naive, eng::SpliceMode::Transition}) {
      const Run a = run(mode, false, 0), b = run(mode, true, 2 * largest);
      INFO(eng::splice_mode_name(mode));
      CHECK(b.out.staged_groups == int(segs.size()));
      CHECK(rel(b.logits, a.logits) <= kPassShapeTol);
      CHECK(state_err(b.state, a.state) <= kPassShapeTol);
    }
    const Run a = run(eng::SpliceMode::Hypic, false, 0, 2), b = run(eng::SpliceMode::Hypic, true, 2 * largest, 2);
    CHECK(b.out.recomputed_segments == a.out.recomputed_segments);
    CHECK(b.out.staged_groups > int(segs.size()));  // the probe's groups, then the answer's
    CHECK(rel(b.logits, a.logits) <= kPassShapeTol);
  }
  SECTION("two entries a group, passes of at most 64 tokens, every query logit and the context states") {
    const Run a = run(eng::SpliceMode::Hypic, false, 0, 0, 64, true);
    const Run b = run(eng::SpliceMode::Hypic, true, 5 * largest, 0, 64, true);
    std::printf("[backend] staged splice, 64-token passes: %d groups\n", b.out.staged_groups);
    CHECK(b.out.staged_groups >= 2);
    CHECK(b.out.staged_groups < int(segs.size()));  // (some group holds two entries)
    REQUIRE(b.logits.size() == query.size() * V);
    CHECK(rel(b.logits, a.logits) <= kPassShapeTol);
    REQUIRE(b.out.context_states.size() == a.out.context_states.size());
    for (size_t l = 0; l < a.out.context_states.size(); ++l)
      CHECK(rel(b.out.context_states[l], a.out.context_states[l]) <= kPassShapeTol);
    CHECK(state_err(b.state, a.state) <= kPassShapeTol);
  }
  SECTION("errors: a room below the largest entry, a block of other ids or another seam width") {
    try {
      run(eng::SpliceMode::Hypic, true, largest - 4096);
      FAIL("a staging room below the largest entry was accepted");
    } catch (const eng::ResourceExhausted& e) {
      CHECK_THAT(e.what(), Catch::Contains("largest entry"));
    }
    eng::SplicePlan p;
    p.mode = eng::SpliceMode::Hypic;
    p.seam_width = 8;
    p.query = query;
    p.segments.push_back({segs[0], nullptr, blocks[0]});
    p.segments.push_back({segs[2], nullptr, blocks[1]});
    CHECK_THROWS_WITH(f.gpu->splice(p), Catch::Contains("segment 1's token ids differ"));
    p.seam_width = 4;
    p.segments[1].block = blocks[2];
    CHECK_THROWS_AS(f.gpu->splice(p), eng::EntryError);  // entries made with w = 8
  }
}

TEST_CASE("cuda backend: prefix mode takes its checkpoints in the same pass and restores chains", "[backend]") {
  require_gpu();
  Fixture& f = fixture("qwen3_next_gpu");
  std::mt19937 rng(13);
  std::vector<std::vector<int32_t>> segs;
  for (size_t n : {90, 70, 20}) segs.push_back(random_ids(rng, n, f.cfg.vocab_size));
  const auto query = random_ids(rng, 9, f.cfg.vocab_size);
  auto plan_of = [&](eng::SpliceMode mode, const std::vector<std::vector<int32_t>>& ss) {
    eng::SplicePlan p;
    p.mode = mode;
    p.query = query;
    for (const auto& s : ss) p.segments.push_back({s, nullptr});
    return p;
  };
  // Same device, same numerics: the prefix passes differ from full mode's only in where the scan's chunks restart and
  // in the passes' shapes. Tolerance kPassShapeTol (see there).
  auto close_states = [&](const eng::SpliceOutput& a, const eng::SpliceOutput& b) {
    const eng::ModelState sa = a.sequence->to_host(), sb = b.sequence->to_host();
    for (size_t l = 0; l < sa.linear.size(); ++l) CHECK(rel(sa.linear[l].ssm, sb.linear[l].ssm) <= kPassShapeTol);
    for (size_t at = 0; at < sa.attention.size(); ++at) {
      CHECK(rel(sa.attention[at].k, sb.attention[at].k) <= kPassShapeTol);
      CHECK(rel(sa.attention[at].v, sb.attention[at].v) <= kPassShapeTol);
    }
  };
  const eng::SpliceOutput full = f.gpu->splice(plan_of(eng::SpliceMode::Full, segs));
  const eng::SpliceOutput first = f.gpu->splice(plan_of(eng::SpliceMode::Prefix, segs));
  CHECK(first.prefix_segments_reused == 0);
  CHECK(first.computed_tokens == full.computed_tokens);
  CHECK(rel(first.logits, full.logits) <= kPassShapeTol);
  close_states(first, full);
  // Every checkpoint restored: only the query runs; the state is the full pass's.
  const eng::SpliceOutput second = f.gpu->splice(plan_of(eng::SpliceMode::Prefix, segs));
  CHECK(second.prefix_segments_reused == 3);
  CHECK(second.computed_tokens == int64_t(query.size()));
  CHECK(rel(second.logits, full.logits) <= kPassShapeTol);
  CHECK(argmax(second.logits.data(), second.logits.size()) == argmax(full.logits.data(), full.logits.size()));
  close_states(second, full);
  // Another last segment: the first two checkpoints (their KV rows and the second one's states) are reused.
  auto other = segs;
  other[2] = random_ids(rng, 33, f.cfg.vocab_size);
  const eng::SpliceOutput full_other = f.gpu->splice(plan_of(eng::SpliceMode::Full, other));
  const eng::SpliceOutput third = f.gpu->splice(plan_of(eng::SpliceMode::Prefix, other));
  CHECK(third.prefix_segments_reused == 2);
  CHECK(third.computed_tokens == int64_t(33 + query.size()));
  CHECK(rel(third.logits, full_other.logits) <= kPassShapeTol);
  close_states(third, full_other);
  // Another first segment: nothing reused.
  auto fresh = segs;
  fresh[0] = random_ids(rng, 90, f.cfg.vocab_size);
  CHECK(f.gpu->splice(plan_of(eng::SpliceMode::Prefix, fresh)).prefix_segments_reused == 0);
}

TEST_CASE("cuda backend: chunked prefill -- passes of max_pass_tokens with between_passes, the cancel flag between them",
          "[backend]") {
  require_gpu();
  Fixture& f = fixture("qwen3_next_gpu");
  std::mt19937 rng(29);
  std::vector<std::vector<int32_t>> segs;
  for (size_t n : {90, 70, 45}) segs.push_back(random_ids(rng, n, f.cfg.vocab_size));
  const auto query = random_ids(rng, 9, f.cfg.vocab_size);
  for (eng::SpliceMode mode : {eng::SpliceMode::Full, eng::SpliceMode::Prefix}) {
    INFO(eng::splice_mode_name(mode));
    eng::SplicePlan p;
    p.mode = mode;
    p.query = query;
    p.use_prefix_cache = false;
    for (const auto& s : segs) p.segments.push_back({s, nullptr});
    const eng::SpliceOutput whole = f.gpu->splice(p);
    int paused = 0;
    p.max_pass_tokens = 32;
    p.between_passes = [&] { ++paused; };
    const eng::SpliceOutput chunked = f.gpu->splice(p);
    CHECK(paused == (205 + 9 + 31) / 32 - 1);  // 214 tokens in passes of 32
    CHECK(rel(chunked.logits, whole.logits) <= kPassShapeTol);
    CHECK(argmax(chunked.logits.data(), chunked.logits.size()) == argmax(whole.logits.data(), whole.logits.size()));
    const eng::ModelState a = chunked.sequence->to_host(), b = whole.sequence->to_host();
    for (size_t l = 0; l < a.linear.size(); ++l) CHECK(rel(a.linear[l].ssm, b.linear[l].ssm) <= kPassShapeTol);
    for (size_t at = 0; at < a.attention.size(); ++at) CHECK(rel(a.attention[at].k, b.attention[at].k) <= kPassShapeTol);
    // Cancelled during the third pause: the fourth pass never runs.
    auto flag = std::make_shared<std::atomic<bool>>(false);
    p.cancel = flag;
    paused = 0;
    p.between_passes = [&] {
      if (++paused == 3) flag->store(true);
    };
    CHECK_THROWS_AS(f.gpu->splice(p), eng::SpliceCancelled);
    CHECK(paused == 3);
  }
}

TEST_CASE("cuda backend: a request decoded alone vs batched with 15 others", "[backend]") {
  require_gpu();
  Fixture& f = fixture("qwen3_next_gpu");
  const size_t V = size_t(f.cfg.vocab_size);
  std::mt19937 rng(17);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 16; ++i) prompts.push_back(random_ids(rng, 50 + 13 * i, f.cfg.vocab_size));
  auto greedy = [&](const std::vector<int>& which, int steps) {
    std::vector<eng::SpliceOutput> outs;
    for (int i : which) outs.push_back(f.gpu->splice(full_plan(prompts[i], prompts[i].size() - 1, false)));
    std::vector<std::vector<int32_t>> toks(which.size());
    std::vector<std::vector<float>> lg;
    for (auto& o : outs) lg.push_back(o.logits);
    std::vector<float> batch;
    for (int s = 0; s < steps; ++s) {
      std::vector<eng::Sequence*> seqs;
      std::vector<int32_t> next;
      for (size_t b = 0; b < outs.size(); ++b) {
        next.push_back(argmax(lg[b].data(), V));
        toks[b].push_back(next.back());
        seqs.push_back(outs[b].sequence.get());
      }
      f.gpu->decode(seqs, next, batch);
      for (size_t b = 0; b < outs.size(); ++b) lg[b].assign(batch.begin() + b * V, batch.begin() + (b + 1) * V);
    }
    return toks;
  };
  const auto alone = greedy({0}, 64);
  std::vector<int> all(16);
  std::iota(all.begin(), all.end(), 0);
  const auto batched = greedy(all, 64);
  int differ = 0;
  for (int s = 0; s < 64; ++s) differ += alone[0][s] != batched[0][s];
  std::printf("[backend] decode alone vs batched with 15 others: %d of 64 greedy tokens differ\n", differ);
  CHECK(alone[0][0] == batched[0][0]);  // the first token comes from the same prefill
}

TEST_CASE("cuda backend: decode steps replayed as CUDA graphs equal the eager steps bit for bit", "[backend]") {
  require_gpu();
  Fixture& f = fixture("qwen3_5_moe_gpu");
  const size_t V = size_t(f.cfg.vocab_size);
  eng::BackendOptions opt;
  opt.kv_pool_bytes = size_t(1) << 28;
  opt.max_sequences = 8;
  opt.decode_graphs = false;
  auto eager = eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, f.cfg, &f.cpu->weights(), opt);
  opt.decode_graphs = true;
  auto graphs = eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, f.cfg, &f.cpu->weights(), opt);
  std::mt19937 rng(21);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 3; ++i) prompts.push_back(random_ids(rng, 60 + 10 * i, f.cfg.vocab_size));
  auto run = [&](eng::Backend& b) {
    std::vector<eng::SpliceOutput> outs;
    for (const auto& p : prompts) outs.push_back(b.splice(full_plan(p, p.size() - 1, false)));
    std::vector<std::vector<float>> all;
    std::vector<int32_t> next;
    for (auto& o : outs) next.push_back(argmax(o.logits.data(), V));
    std::vector<float> lg;
    for (int s = 0; s < 70; ++s) {  // crosses a page boundary: the block-table width grows from 2 to 4 pages
      std::vector<eng::Sequence*> seqs;
      for (auto& o : outs) seqs.push_back(o.sequence.get());
      b.decode(seqs, next, lg);
      all.push_back(lg);
      for (size_t i = 0; i < outs.size(); ++i) next[i] = argmax(lg.data() + i * V, V);
    }
    return all;
  };
  const auto a = run(*eager), g = run(*graphs);
  REQUIRE(a.size() == g.size());
  int same = 0;
  for (size_t s = 0; s < a.size(); ++s) same += a[s] == g[s];
  std::printf("[backend] decode with CUDA graphs: %d of %zu steps bit-identical to eager\n", same, a.size());
  CHECK(same == int(a.size()));
}

// The switched kernel paths that keep the arithmetic (kernels/cuda/switches.h, candidates and measured defaults: the
// next layer's norm in the MoE combine, RoPE angle tables, the MoE wgmma vector epilogue, deep decode MoE rings, each
// checked bit for bit against the other path in its kernel test; the post-attention norm in decode_linear's last
// block, the one-token MoE routing, the conv in the Gated DeltaNet WY kernel with the conv state's tails after the
// layer: the decode steps read them) through the whole model: full prefills of 10 prompts (MoE layers of 20 .. 47
// tokens: the wgmma tiles), a hypic splice, then 12 greedy decode steps of the 10 (two token groups per MoE tile ring)
// and 6 of one, then 6 of the splice's 69-slot sequence beside a 150-token prompt's (contexts past a 64-slot KV page:
// the decode attention's whole tiles before the last slot, HYPIC_ATTN_DECODE_KV_EARLY's early loads), the CUDA graphs
// captured again after each flip. Every logit bit for bit, switch off against on.
TEST_CASE("cuda backend: switched kernel paths that keep the arithmetic give the same bits end to end", "[backend]") {
  require_gpu();
  Fixture& f = fixture("qwen3_5_moe_gpu");
  const size_t V = size_t(f.cfg.vocab_size);
  std::mt19937 rng(33);
  const std::vector<std::vector<int32_t>> prompts = [&] {
    std::vector<std::vector<int32_t>> p(10);
    for (size_t i = 0; i < p.size(); ++i) p[i] = random_ids(rng, 20 + 3 * int(i), f.cfg.vocab_size);
    return p;
  }();
  const std::vector<int32_t> long_prompt = random_ids(rng, 150, f.cfg.vocab_size);
  auto run = [&] {
    std::vector<std::vector<float>> all;
    std::vector<eng::SpliceOutput> outs, longer;  // longer: contexts past one KV page (69 and 150 slots)
    for (const auto& p : prompts) {
      outs.push_back(f.gpu->splice(full_plan(p, p.size() - 1, false)));
      all.push_back(outs.back().logits);
    }
    {  // a hypic splice of two cached segments and a query
      const std::vector<std::vector<int32_t>> segs = {prompts[0], prompts[1]};
      const auto entries = f.gpu->build_entries(segs, 4);
      eng::SplicePlan hp;
      hp.mode = eng::SpliceMode::Hypic;
      hp.seam_width = 4;
      hp.segments.push_back({prompts[0], entries[0]});
      hp.segments.push_back({prompts[1], entries[1]});
      hp.query = prompts[2];
      longer.push_back(f.gpu->splice(hp));
      all.push_back(longer.back().logits);
    }
    longer.push_back(f.gpu->splice(full_plan(long_prompt, long_prompt.size() - 1, false)));
    all.push_back(longer.back().logits);
    std::vector<int32_t> next;
    for (auto& o : outs) next.push_back(argmax(o.logits.data(), V));
    std::vector<float> lg;
    for (int step = 0; step < 12; ++step) {
      std::vector<eng::Sequence*> seqs;
      for (auto& o : outs) seqs.push_back(o.sequence.get());
      f.gpu->decode(seqs, next, lg);
      all.push_back(lg);
      for (size_t i = 0; i < outs.size(); ++i) next[i] = argmax(lg.data() + i * V, V);
    }
    for (int step = 0; step < 6; ++step) {  // batch 1 (the post-attention norm in the out_proj launch)
      eng::Sequence* one = outs[0].sequence.get();
      f.gpu->decode(std::span<eng::Sequence* const>(&one, 1), std::span<const int32_t>(&next[0], 1), lg);
      all.push_back(lg);
      next[0] = argmax(lg.data(), V);
    }
    std::vector<int32_t> next_long;
    std::vector<eng::Sequence*> long_seqs;
    for (auto& o : longer) next_long.push_back(argmax(o.logits.data(), V)), long_seqs.push_back(o.sequence.get());
    for (int step = 0; step < 6; ++step) {
      f.gpu->decode(long_seqs, next_long, lg);
      all.push_back(lg);
      for (size_t i = 0; i < longer.size(); ++i) next_long[i] = argmax(lg.data() + i * V, V);
    }
    return all;
  };
  for (const char* sw : {"HYPIC_FUSE_NEXT_NORM", "HYPIC_ROPE_TABLE", "HYPIC_MOE_EPILOGUE_VEC", "HYPIC_MOE_DECODE_DEEP",
                         "HYPIC_FUSE_POST_NORM", "HYPIC_GDN_DECODE_NORM", "HYPIC_ROUTE_ONE_TOKEN",
                         "HYPIC_ROUTE_SPREAD", "HYPIC_MOE_DECODE_TILE_INFO", "HYPIC_STREAM_X_AHEAD",
                         "HYPIC_ATTN_DECODE_D_SPLIT", "HYPIC_DECODE_PDL_MIXERS", "HYPIC_MOE_DOWN_EARLY",
                         "HYPIC_GDN_STATE_EARLY", "HYPIC_ROUTE_SGATE_EARLY",
                         "HYPIC_CONV_STATE_EARLY", "HYPIC_COMBINE_EARLY",
                         "HYPIC_MOE_SHARED_EARLY", "HYPIC_ATTN_DECODE_KV_EARLY", "HYPIC_GDN_CONV_FUSED"}) {
    DYNAMIC_SECTION(sw) {
      std::vector<std::vector<float>> off, on;
      {
        hypic::gputest::ScopedCandidate c(sw, false);
        off = run();
      }
      {
        hypic::gputest::ScopedCandidate c(sw, true);
        on = run();
      }
      REQUIRE(off.size() == on.size());
      size_t same = 0;
      for (size_t i = 0; i < off.size(); ++i) same += hypic::gputest::same_bits(off[i], on[i]);
      std::printf("[backend] %s on vs off: %zu of %zu prefill / splice / decode logit sets bit-identical\n", sw, same,
                  off.size());
      CHECK(same == off.size());
    }
  }
}

// HYPIC_SPLICE_SEAM_FOLD: a hypic splice's seam runs taken by the affine chain as low-rank steps from their WY factors
// (gdn_low_rank_step) instead of scanned from zero and chained as full steps. Another arithmetic (fp32 rank-w products
// from the bf16 WY factors instead of the scan's T columns), so the logits (2e-2) and every linear layer's state after
// the splice (kPassShapeTol) are compared within rounding: seam widths 4 and 8 over five segments (on: chains with
// low-rank factors launched, other bits), and a seam wider than one chunk (72 tokens: the full steps, the same bits).
// The backend here has every Gated DeltaNet layer's decay made weak (A_log = log 1e-3: g about -7e-4 per token): with
// the checkpoint's random A_log (g about -0.7 per token) a 90-token segment scales the state before it by e^-60, so the
// state after each fold is its S(interior|0) to the last bit whatever came before, and the seam runs, folded or not,
// cannot change a bit of the splice (the first GPU run found on and off bit-identical for that reason).
TEST_CASE("cuda backend: seam windows as low-rank chain steps (HYPIC_SPLICE_SEAM_FOLD) give the splice within "
          "rounding", "[backend]") {
  require_gpu();
  Fixture& f = fixture("qwen3_5_moe_gpu");
  eng::ModelWeights weak = eng::load_weights(f.cfg, checkpoint_dir("qwen3_5_moe_gpu"));
  int weak_layers = 0;
  for (eng::LayerWeights& L : weak.layers) {
    if (L.type != eng::LayerType::Linear) continue;
    for (float& a : L.linear.A_log.data) a = std::log(1e-3f);
    ++weak_layers;
  }
  REQUIRE(weak_layers > 0);
  eng::BackendOptions opt;
  opt.kv_pool_bytes = size_t(1) << 28;
  opt.max_sequences = 8;
  auto gpu = eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, f.cfg, &weak, opt);
  std::mt19937 rng(41);
  std::vector<std::vector<int32_t>> segs;
  for (int i = 0; i < 5; ++i) segs.push_back(random_ids(rng, 90 + 7 * i, f.cfg.vocab_size));
  const std::vector<int32_t> query = random_ids(rng, 12, f.cfg.vocab_size);
  for (const int w : {4, 8, 72}) {
    DYNAMIC_SECTION("seam width " << w) {
      const auto entries = gpu->build_entries(segs, w);
      auto splice = [&](bool fold, eng::ModelState& state) {
        hypic::gputest::ScopedCandidate c("HYPIC_SPLICE_SEAM_FOLD", fold);
        eng::SplicePlan hp;
        hp.mode = eng::SpliceMode::Hypic;
        hp.seam_width = w;
        for (size_t i = 0; i < segs.size(); ++i) hp.segments.push_back({segs[i], entries[i]});
        hp.query = query;
        eng::SpliceOutput out = gpu->splice(hp);
        state = out.sequence->to_host();
        return out.logits;
      };
      eng::ModelState s_off, s_on;
      const uint64_t folds0 = kc::affine_chain_low_rank_launches();
      const std::vector<float> off = splice(false, s_off);
      const uint64_t folds1 = kc::affine_chain_low_rank_launches();
      const std::vector<float> on = splice(true, s_on);
      const uint64_t folds2 = kc::affine_chain_low_rank_launches();
      // (Which path ran, told apart by the chains launched with low-rank factors: none with the switch off, one per
      // linear layer on with every seam run within a chunk.)
      std::printf("[backend] seam fold, w = %d: low-rank chain launches off %llu, on %llu\n", w,
                  static_cast<unsigned long long>(folds1 - folds0), static_cast<unsigned long long>(folds2 - folds1));
      CHECK(folds1 == folds0);
      REQUIRE(s_off.linear.size() == s_on.linear.size());
      double es = 0;
      std::vector<double> es_layer;
      for (size_t l = 0; l < s_off.linear.size(); ++l) {
        es_layer.push_back(rel(s_on.linear[l].ssm, s_off.linear[l].ssm));
        es = std::max(es, es_layer.back());
        std::printf("[backend] seam fold, w = %d: linear layer %zu state rel %.3e\n", w, l, es_layer.back());
      }
      REQUIRE(off.size() == on.size());
      const hypic::gputest::Err e = hypic::gputest::compare(on.data(), off.data(), off.size());
      const bool same = hypic::gputest::same_bits(off, on);
      std::printf("[backend] seam fold, w = %d: logits max rel %.3e, fro %.3e, bit-identical %d; linear states %.3e\n",
                  w, e.max_rel, e.fro, int(same), es);
      if (w > kc::kGdnChunk) {
        CHECK(same);  // a run longer than a chunk: the default path
        CHECK(es == 0);
        CHECK(folds2 == folds1);
      } else {
        CHECK(folds2 - folds1 == uint64_t(s_on.linear.size()));
        CHECK_FALSE(same);
        CHECK(e.max_rel <= 2e-2);
        CHECK(es <= kPassShapeTol);  // (the states through another arithmetic: as the pass-shape comparisons)
        // The first layer (linear in this family) sees the same bf16 inputs on both paths: its state differs by the
        // fold's fp32 arithmetic, then by how the query's scan rounds its initial state to bf16 for the tensor cores
        // (gdn_prefill's numerics: a 1e-6 change can move a rounding by 2^-9). Measured on an H100: 4.3e-4 (w = 4),
        // 5.2e-4 (w = 8); the later layers add their inputs' bf16 differences (3e-3 - 8e-3).
        CHECK(es_layer.front() <= 2e-3);
      }
    }
  }
}

TEST_CASE("cuda backend: decode steps on another thread beside builds and splices equal them alone bit for bit",
          "[backend][concurrent_decode]") {
  require_gpu();
  Fixture& f = fixture("qwen3_5_moe_gpu");
  const size_t V = size_t(f.cfg.vocab_size);
  eng::BackendOptions opt;
  opt.kv_pool_bytes = size_t(1) << 28;
  opt.max_sequences = 12;
  // Two backends of the same weights: one runs everything alone (the reference), the other decodes beside its
  // builds and splices from its first step, so its decode graphs are captured while they run; with an SM partition
  // (BackendOptions::decode_sms) the steps and the prefill calls started while they run take disjoint SMs.
  const int decode_sms = GENERATE(0, 16);
  CAPTURE(decode_sms);
  auto alone_b = eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, f.cfg, &f.cpu->weights(), opt);
  opt.decode_sms = decode_sms;
  auto beside_b = eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, f.cfg, &f.cpu->weights(), opt);
  REQUIRE(beside_b->concurrent_decode());
  eng::Backend* b = alone_b.get();
  std::mt19937 rng(33);
  std::vector<std::vector<int32_t>> prompts, segs, others;
  for (int i = 0; i < 3; ++i) prompts.push_back(random_ids(rng, 50 + 10 * i, f.cfg.vocab_size));
  for (int i = 0; i < 4; ++i) segs.push_back(random_ids(rng, 90 + 13 * i, f.cfg.vocab_size));
  for (int i = 0; i < 2; ++i) others.push_back(random_ids(rng, 300 + 40 * i, f.cfg.vocab_size));
  // 80 greedy decode steps of the three prompts (crossing page boundaries: new pages taken while the other thread
  // takes and returns pages too).
  auto decode_run = [&] {
    std::vector<eng::SpliceOutput> outs;
    for (const auto& p : prompts) outs.push_back(b->splice(full_plan(p, p.size() - 1, false)));
    std::vector<int32_t> next;
    for (auto& o : outs) next.push_back(argmax(o.logits.data(), V));
    return std::make_pair(std::move(outs), std::move(next));
  };
  auto steps = [&](std::vector<eng::SpliceOutput>& outs, std::vector<int32_t> next) {
    std::vector<std::vector<float>> all;
    std::vector<float> lg;
    for (int s = 0; s < 80; ++s) {
      std::vector<eng::Sequence*> seqs;
      for (auto& o : outs) seqs.push_back(o.sequence.get());
      b->decode(seqs, next, lg);
      all.push_back(lg);
      for (size_t i = 0; i < outs.size(); ++i) next[i] = argmax(lg.data() + i * V, V);
    }
    return all;
  };
  auto prefill_work = [&] {  // entries and the logits of two full splices (their sequences dropped)
    std::vector<std::vector<float>> out;
    const auto entries = b->build_entries(segs, 8);
    for (const auto& e : entries) {
      const auto h = e->host();
      out.push_back(h->attention[0].k);
      out.push_back(h->linear[0].interior_state);
    }
    for (const auto& o : others) out.push_back(b->splice(full_plan(o, o.size() - 1, false)).logits);
    return out;
  };
  auto [outs_a, next_a] = decode_run();
  const auto alone = steps(outs_a, next_a);
  outs_a.clear();
  const auto prefill_alone = prefill_work();
  // The same steps on a second thread while this one builds and splices, round after round.
  b = beside_b.get();
  auto [outs_b, next_b] = decode_run();
  std::atomic<bool> done{false};
  std::vector<std::vector<float>> beside;
  std::exception_ptr failed;
  beside_b->set_decoding_sequences(int(outs_b.size()));  // as the engine loop does
  std::thread decoder([&] {
    try {
      beside = steps(outs_b, next_b);
    } catch (...) {
      failed = std::current_exception();
    }
    done = true;
  });
  int rounds = 0, prefill_same = 0;
  while (!done || rounds == 0) {
    prefill_same += prefill_work() == prefill_alone;
    ++rounds;
  }
  decoder.join();
  beside_b->set_decoding_sequences(0);
  if (failed) std::rethrow_exception(failed);
  REQUIRE(beside.size() == alone.size());
  int same = 0;
  for (size_t s = 0; s < alone.size(); ++s) same += alone[s] == beside[s];
  std::printf("[backend] concurrent decode (decode SMs %d): %d of %zu steps bit-identical to decode alone; %d of %d "
              "prefill rounds beside them bit-identical\n",
              decode_sms, same, alone.size(), prefill_same, rounds);
  CHECK(same == int(alone.size()));
  CHECK(prefill_same == rounds);
}

TEST_CASE("cuda backend: bad input and budgets give clear errors", "[backend]") {
  require_gpu();
  Fixture& f = fixture("qwen3_5_dense_gpu");
  eng::SplicePlan p = full_plan({1, 2, 3}, 1, false);
  p.query.push_back(int32_t(f.cfg.vocab_size));
  CHECK_THROWS_AS(f.gpu->splice(p), std::invalid_argument);
  CHECK_THROWS_AS(f.gpu->build_entries(std::vector<std::vector<int32_t>>{{}}, 8), std::invalid_argument);
  CHECK_THROWS_AS(f.gpu->build_entries(std::vector<std::vector<int32_t>>{{-1}}, 8), std::invalid_argument);
  eng::SplicePlan h;
  h.mode = eng::SpliceMode::Hypic;
  h.segments.push_back({{1, 2, 3}, nullptr});
  h.query = {4};
  CHECK_THROWS_AS(f.gpu->splice(h), std::invalid_argument);  // no entry
  // An entry made for another model is refused when imported.
  Fixture& other = fixture("qwen3_5_moe_gpu");
  const auto e = other.gpu->build_entries(std::vector<std::vector<int32_t>>{{1, 2, 3}}, 8);
  CHECK_THROWS_AS(f.gpu->import_entry(e[0]->host()), eng::EntryError);
  // A KV pool too small for the request.
  eng::ModelConfig c = f.cfg;
  eng::BackendOptions opt;
  opt.kv_pool_bytes = size_t(64) * 2 * 2 * c.num_key_value_heads * c.head_dim * 2 * 3;  // three pages
  opt.random_weights_seed = 1;
  opt.max_batch_tokens = 1024;
  auto small = eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, c, nullptr, opt);
  std::vector<int32_t> ids(500, 1);
  CHECK_THROWS_AS(small->splice(full_plan(ids, 400, false)), eng::ResourceExhausted);
  // Unsupported head sizes are refused at load.
  c.linear_key_head_dim = c.linear_value_head_dim = 64;
  CHECK_THROWS_AS(eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, c, nullptr, opt),
                  std::invalid_argument);
}

TEST_CASE("SM partition: the decode and prefill streams run on disjoint SMs of the requested counts",
          "[backend][sm_partition]") {
  require_gpu();
  int device_sms = 0;
  REQUIRE(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess);
  const int want = 16;
  auto part = eng::cuda::SmPartition::create(0, want);
  CHECK(part->device_sms() == device_sms);
  CHECK(part->decode_sms() >= want);
  CHECK(part->decode_sms() + part->prefill_sms() <= device_sms);
  // Enough spinning blocks on each stream, both at once, to fill every SM each may use (32 resident blocks per SM).
  const int blocks = 32 * device_sms;
  int* dev = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dev), size_t(2) * blocks * sizeof(int)) == cudaSuccess);
  kc::record_block_sms(blocks, 20000, dev, part->decode_stream());
  kc::record_block_sms(blocks, 20000, dev + blocks, part->prefill_stream());
  std::vector<int> host(size_t(2) * blocks);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(cudaMemcpy(host.data(), dev, host.size() * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
  cudaFree(dev);
  std::set<int> dec(host.begin(), host.begin() + blocks), pre(host.begin() + blocks, host.end());
  std::vector<int> both;
  std::set_intersection(dec.begin(), dec.end(), pre.begin(), pre.end(), std::back_inserter(both));
  std::printf("[backend] SM partition %s: decode blocks ran on %zu SMs, prefill blocks on %zu, %zu shared\n",
              part->describe().c_str(), dec.size(), pre.size(), both.size());
  CHECK(int(dec.size()) == part->decode_sms());
  CHECK(int(pre.size()) == part->prefill_sms());
  CHECK(both.empty());

  // A CUDA graph's kernels keep the SMs of the stream they were captured on, wherever the graph is launched (why the
  // backend captures and launches its decode graphs on its whole-device stream only).
  auto graph_sms = [&](cudaStream_t capture_on, cudaStream_t launch_on) {
    int* d = nullptr;
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&d), size_t(blocks) * sizeof(int)) == cudaSuccess);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaStreamBeginCapture(capture_on, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    kc::record_block_sms(blocks, 20000, d, capture_on);
    REQUIRE(cudaStreamEndCapture(capture_on, &graph) == cudaSuccess);
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, launch_on) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(launch_on) == cudaSuccess);
    std::vector<int> h(blocks);
    REQUIRE(cudaMemcpy(h.data(), d, h.size() * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFree(d);
    return std::set<int>(h.begin(), h.end()).size();
  };
  cudaStream_t whole = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&whole, cudaStreamNonBlocking) == cudaSuccess);
  const size_t whole_on_part = graph_sms(whole, part->prefill_stream());
  const size_t part_on_whole = graph_sms(part->prefill_stream(), whole);
  cudaStreamDestroy(whole);
  std::printf("[backend] graph captured on the whole device, launched on the prefill partition: %zu SMs; captured on "
              "the prefill partition, launched on the whole device: %zu SMs\n",
              whole_on_part, part_on_whole);
  CHECK(int(whole_on_part) == device_sms);
  CHECK(int(part_on_whole) == part->prefill_sms());
  CHECK_THROWS_AS(eng::cuda::SmPartition::create(0, 0), std::invalid_argument);
  CHECK_THROWS_AS(eng::cuda::SmPartition::create(0, device_sms), std::invalid_argument);
}
