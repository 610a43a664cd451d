// The CUDA backend (engine/cuda) on the other hybrid families (issue 29) against the CPU fp32 engine (engine/cpu: the
// path that matches Hugging Face to ~1e-6 on these families' fixtures, tests/unit/test_families.cpp), on random-weight
// checkpoints with real head sizes (tests/gpu/configs, 4 layers covering both layer kinds):
//   kimi_linear_gpu  3 KDA : 1 MLA (KDA heads 128; MLA nope 128 / rope 64 / v 128, kv_lora_rank 512), a dense first
//                    layer, sigmoid-routed grouped MoE with an ungated shared expert;
//   minimax_gpu      3 lightning : 1 GQA softmax (head 128), post-norm residuals with alpha / beta != 1, softmax MoE;
//   ring_linear_gpu  3 lightning (qk-norm, partial RoPE inside the layer, group norm) : 1 GQA softmax, a dense first
//                    layer, sigmoid-routed grouped MoE.
// Needs an NVIDIA GPU (scripts/test_gpu.sh).
//
// Each model runs twice: as configured (top-2 routing), and with every expert routed ("all experts": top-k = E, so no
// expert choice can flip between bf16 and fp32). Stated bf16 tolerances on the relative Frobenius error
// ||gpu - cpu|| / ||cpu|| of logits, states and KV over each test's population (cases x layers):
//  - all experts: median <= 2e-2, max <= 5e-2 (bf16 weights and activations against fp32, no discontinuity);
//  - top-2 routing: median <= 1.5e-1, max <= 3e-1: a near-tied choice that flips moves that token's hidden state, and
//    the later layers see it, so errors grow with the prompt (measured on the H200 2026-12-04: Kimi-Linear 1.5e-2 at
//    2 tokens to 1.4e-1 at 1000; the CUDA backend's Qwen models are 3.5-20% from fp32, as far as HF's own bf16 run,
//    test_gpu_backend.cpp).
// Teacher-forced greedy decoding (all experts): argmax equal to the CPU's wherever the CPU's top-1 / top-2 gap exceeds
// 10% of its logit spread. Identities of the backend with itself (hit == miss, graphs == eager, decode_step ==
// decode) are bit for bit (tests/conformance/backend_conformance.h).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/cpu/model.h"
#include "engine/cpu/splice.h"
#include "engine/cuda/cuda_backend.h"
#include "tests/conformance/backend_conformance.h"
#include "tests/gpu/backend_test_util.h"
#include "tests/gpu/gpu_util.h"

namespace eng = hypic::engine;
using hypic::gputest::cuda_device_present;
using hypic::gputest::argmax;
using hypic::gputest::full_plan;
using hypic::gputest::margin;
using hypic::gputest::random_ids;
using hypic::gputest::rel_err;

namespace {

const char* kFamilies[] = {"kimi_linear_gpu", "minimax_gpu", "ring_linear_gpu"};

// The routing variants (see the header) and their tolerances.
struct Tol {
  double median, max;
};
constexpr Tol kAllExperts{2e-2, 5e-2}, kTop2{1.5e-1, 3e-1};

// The config edits that route every expert: top-k = E (and every group kept).
std::vector<std::pair<std::string, std::string>> all_experts_edits(const std::string& name) {
  if (name == "kimi_linear_gpu")
    return {{"\"num_experts_per_token\": 2", "\"num_experts_per_token\": 8"}, {"\"topk_group\": 1", "\"topk_group\": 2"}};
  return {{"\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 8"}};
}

void require_gpu() {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  return rel_err(a.data(), b.data(), a.size());
}

void check_population(std::vector<double> e, const std::string& what, Tol tol) {
  REQUIRE(!e.empty());
  std::sort(e.begin(), e.end());
  const double median = e[e.size() / 2], worst = e.back();
  std::printf("[families]   %s: %zu values, median %.3e (bound %.1e), max %.3e (bound %.1e)\n", what.c_str(), e.size(),
              median, tol.median, worst, tol.max);
  CHECK(median <= tol.median);
  CHECK(worst <= tol.max);
}

std::string read_text(const std::string& path) {
  std::string text;
  std::FILE* fp = std::fopen(path.c_str(), "rb");
  REQUIRE(fp);
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, fp)) > 0) text.append(buf, n);
  std::fclose(fp);
  return text;
}

// tests/gpu/configs/<name>.json with each (from, to) replaced once.
eng::ModelConfig edited_config(const std::string& name, const std::vector<std::pair<std::string, std::string>>& edits) {
  std::string text = read_text("tests/gpu/configs/" + name + ".json");
  for (const auto& [from, to] : edits) {
    const auto at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
  }
  return eng::parse_config(text);
}

struct Fixture {
  eng::ModelConfig cfg;
  std::unique_ptr<eng::Model> cpu;
  std::unique_ptr<eng::Backend> gpu;
};

// The model `name` (all_experts: the every-expert variant), its random bf16 checkpoint written once per machine.
Fixture& fixture(const std::string& name, bool all_experts = false,
                 const std::vector<std::pair<std::string, std::string>>& more_edits = {},
                 const std::string& variant = "") {
  static std::map<std::string, std::unique_ptr<Fixture>> cache;
  const std::string key = name + (all_experts ? "_all_experts" : "") + variant;
  auto& slot = cache[key];
  if (slot) return *slot;
  auto f = std::make_unique<Fixture>();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("hypic_gpu_families_" + key);
  if (!std::filesystem::exists(dir / "model.safetensors")) {
    auto edits = all_experts ? all_experts_edits(name) : decltype(all_experts_edits(name)){};
    edits.insert(edits.end(), more_edits.begin(), more_edits.end());
    const eng::ModelConfig c = edited_config(name, edits);
    eng::write_random_checkpoint(c, 20261204, dir, eng::DType::BF16, 0.05);
  }
  f->cfg = eng::load_config(dir);
  eng::ModelWeights w = eng::load_weights(f->cfg, dir);
  eng::BackendOptions opt;
  opt.max_batch_tokens = 4096;
  opt.kv_pool_bytes = size_t(1) << 30;
  opt.max_sequences = 40;
  f->gpu = eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, f->cfg, &w, opt);
  f->cpu = std::make_unique<eng::Model>(f->cfg, std::move(w));
  slot = std::move(f);
  return *slot;
}





// Errors of every linear state, conv tail and K / V of a GPU sequence against the CPU state.
void state_errors(const eng::ModelConfig& c, const eng::ModelState& g, const eng::ModelState& r,
                  std::vector<double>& pop, std::string& line) {
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    char buf[96];
    if (c.layer_types[i] == eng::LayerType::Linear) {
      const int l = c.linear_index(i);
      const double es = rel(g.linear[l].ssm, r.linear[l].ssm);
      pop.push_back(es);
      double ec = 0;
      if (!r.linear[l].conv.empty()) pop.push_back(ec = rel(g.linear[l].conv, r.linear[l].conv));
      std::snprintf(buf, sizeof buf, " L%d S %.1e conv %.1e;", i, es, ec);
    } else {
      const int a = c.attention_index(i);
      const double ek = rel(g.attention[a].k, r.attention[a].k), ev = rel(g.attention[a].v, r.attention[a].v);
      pop.push_back(ek), pop.push_back(ev);
      std::snprintf(buf, sizeof buf, " F%d K %.1e V %.1e;", i, ek, ev);
    }
    line += buf;
  }
}

}  // namespace

TEST_CASE("cuda backend families: prefill logits, linear states, conv tails and KV match the CPU engine",
          "[families][backend]") {
  require_gpu();
  for (const char* family : kFamilies)
  for (bool all : {true, false}) {
    Fixture& f = fixture(family, all);
    const std::string name = std::string(family) + (all ? " (all experts)" : " (top-2)");
    const Tol tol = all ? kAllExperts : kTop2;
    const size_t V = size_t(f.cfg.vocab_size);
    std::mt19937 rng(7);
    std::vector<double> pop_logits, pop_state;
    for (size_t T : {2, 65, 300, 1000}) {
      const auto ids = random_ids(rng, T, f.cfg.vocab_size);
      eng::ModelState st = f.cpu->initial_state();
      eng::PrefillOptions po;
      po.all_logits = true;
      const auto ref = f.cpu->prefill(st, ids, 0, po).logits;
      eng::SpliceOutput out = f.gpu->splice(full_plan(ids, 1, true));
      REQUIRE(out.logits.size() == (T - 1) * V);
      const std::vector<float> ref_tail(ref.begin() + V, ref.end());
      const double e = rel(out.logits, ref_tail);
      std::string line;
      state_errors(f.cfg, out.sequence->to_host(), st, pop_state, line);
      std::printf("[families] %s prefill T=%zu: logits %.3e |%s\n", name.c_str(), T, e, line.c_str());
      pop_logits.push_back(e);
      CHECK(out.num_tokens == int64_t(T));
    }
    check_population(pop_logits, name + " prefill logits", tol);
    check_population(pop_state, name + " states, conv tails, K and V", tol);
  }
}

TEST_CASE("cuda backend families: greedy decoding (32 tokens) follows the CPU engine", "[families][backend]") {
  require_gpu();
  for (const char* name : kFamilies) {
    Fixture& f = fixture(name, true);
    const size_t V = size_t(f.cfg.vocab_size);
    std::mt19937 rng(3);
    const auto ids = random_ids(rng, 200, f.cfg.vocab_size);
    eng::ModelState st = f.cpu->initial_state();
    std::vector<float> ref = f.cpu->prefill(st, ids, 0).logits;
    eng::SpliceOutput out = f.gpu->splice(full_plan(ids, 150, false));
    std::vector<float> got = out.logits;
    std::vector<double> step_err;
    int checked = 0, agree = 0;
    for (int step = 0; step < 32; ++step) {
      const int tok = argmax(ref.data(), V);  // teacher forcing on the CPU's greedy tokens
      step_err.push_back(rel(got, ref));
      if (margin(ref.data(), V) > 0.1) {
        ++checked;
        agree += argmax(got.data(), V) == tok;
        CHECK(argmax(got.data(), V) == tok);
      }
      ref = f.cpu->decode(st, tok, int64_t(ids.size()) + step);
      eng::Sequence* seqs[1] = {out.sequence.get()};
      const int32_t toks[1] = {tok};
      f.gpu->decode(seqs, toks, got);
    }
    std::printf("[families] %s greedy 32 (teacher-forced): argmax equal at %d of %d clear steps\n", name, agree, checked);
    check_population(step_err, std::string(name) + " (all experts) decode logits per step", kAllExperts);
  }
}

TEST_CASE("cuda backend families: entries and splices in every mode match the CPU engine", "[families][backend]") {
  require_gpu();
  for (const char* name : kFamilies) {
    Fixture& f = fixture(name, true);
    const int w = 8;
    std::mt19937 rng(5);
    std::vector<std::vector<int32_t>> segs;
    for (size_t n : {40, 7, 130, 65, 1}) segs.push_back(random_ids(rng, n, f.cfg.vocab_size));
    const auto query = random_ids(rng, 20, f.cfg.vocab_size);
    const auto gentries = f.gpu->build_entries(segs, w);
    const auto gentries0 = f.gpu->build_entries(segs, 0);
    REQUIRE(gentries.size() == segs.size());
    std::vector<std::shared_ptr<const eng::SegmentEntry>> centries, centries0;
    for (const auto& s : segs) {
      centries.push_back(std::make_shared<eng::SegmentEntry>(eng::build_segment_entry(*f.cpu, s, w)));
      centries0.push_back(std::make_shared<eng::SegmentEntry>(eng::build_segment_entry(*f.cpu, s, 0)));
    }
    // A one-token segment's lightning output is o = (q . k) v, so the group norm after it divides by |q . k|: bf16
    // rounding of q and k is amplified by |q| |k| / |q . k| (about 10 for random 128-dim heads; measured on the H200:
    // Ring's one-token entry 1.0e-1 at layer 2, alone or in any batch position, where every longer segment is at
    // 1e-2), and the layers after it inherit that. Those tensors are held to the top-2 bound.
    std::vector<double> pop_entry, pop_one;
    double worst_t = 0, worst_e = 0;
    std::string worst_what;
    auto note = [&](double e, size_t i, const char* what, size_t layer) {
      (segs[i].size() == 1 ? pop_one : pop_entry).push_back(e);
      if (e > worst_e) worst_e = e, worst_what = "entry " + std::to_string(i) + " (" + std::to_string(segs[i].size()) +
                                              " tokens) " + what + " of layer " + std::to_string(layer);
    };
    for (size_t i = 0; i < segs.size(); ++i) {
      const auto h = gentries[i]->host(), h0 = gentries0[i]->host();
      const auto& c = *centries[i];
      REQUIRE(h->linear.size() == c.linear.size());
      for (size_t l = 0; l < c.linear.size(); ++l) {
        CHECK(h->linear[l].interior_transition.kind == c.linear[l].interior_transition.kind);
        // Transitions decay strongly: judged against max(||T||, ||I||).
        auto rel_t = [](const eng::TransitionOperator& a, const eng::TransitionOperator& b) {
          const auto x = a.to_dense(), y = b.to_dense();
          double num = 0, den = 0;
          for (size_t j = 0; j < x.size(); ++j) num += (double(x[j]) - y[j]) * (x[j] - y[j]), den += double(y[j]) * y[j];
          return std::sqrt(num / std::max(den, double(b.heads) * b.d_k));
        };
        worst_t = std::max({worst_t, rel_t(h->linear[l].interior_transition, c.linear[l].interior_transition),
                            rel_t(h0->linear[l].interior_transition, centries0[i]->linear[l].interior_transition)});
        note(rel(h0->linear[l].interior_state, centries0[i]->linear[l].interior_state), i, "S(C|0) (w = 0)", l);
        if (c.num_tokens() > w) note(rel(h->linear[l].interior_state, c.linear[l].interior_state), i, "S_int", l);
        note(rel(h->linear[l].seam_state, c.linear[l].seam_state), i, "S_seam", l);
        if (!c.linear[l].conv_tail.empty()) note(rel(h->linear[l].conv_tail, c.linear[l].conv_tail), i, "conv tail", l);
      }
      for (size_t a = 0; a < c.attention.size(); ++a) {
        note(rel(h->attention[a].k, c.attention[a].k), i, "K", a);
        note(rel(h->attention[a].v, c.attention[a].v), i, "V", a);
      }
      // The wire form written from the device copy equals the host entry's, bit for bit.
      CHECK(f.gpu->wire_of(*gentries[i]) == eng::serialize_entry(*h));
      CHECK(f.gpu->wire_of_block(*f.gpu->copy_to_host(*gentries0[i])) == eng::serialize_entry(*h0));
    }
    std::printf("[families] %s entries: worst transition error %.3e; worst tensor %.3e: %s\n", name, worst_t, worst_e,
                worst_what.c_str());
    CHECK(worst_t <= 2e-2);
    check_population(pop_entry, std::string(name) + " (all experts) entry states, conv tails, K and V", kAllExperts);
    check_population(pop_one, std::string(name) + " (all experts) one-token entry states, K and V", kTop2);
    std::vector<double> pop_logits, pop_state;
    for (eng::SpliceMode mode : {eng::SpliceMode::Full, eng::SpliceMode::Prefix, eng::SpliceMode::Naive,
                                 eng::SpliceMode::Transition, eng::SpliceMode::Hypic}) {
      eng::SplicePlan gp;
      eng::SpliceRequest cr;
      gp.mode = cr.mode = mode;
      gp.seam_width = cr.seam_width = w;
      gp.query = cr.query = query;
      gp.all_query_logits = cr.all_query_logits = true;
      const bool w0 = mode == eng::SpliceMode::Transition;
      for (size_t i = 0; i < segs.size(); ++i) {
        gp.segments.push_back({segs[i], w0 ? gentries0[i] : gentries[i]});
        cr.segments.push_back({segs[i], w0 ? centries0[i] : centries[i]});
      }
      const eng::SpliceResult ref = eng::splice(*f.cpu, cr);
      const eng::SpliceOutput got = f.gpu->splice(gp);
      const double e = rel(got.logits, ref.logits);
      std::string line;
      state_errors(f.cfg, got.sequence->to_host(), ref.state, pop_state, line);
      std::printf("[families] %s splice %-10s: query logits %.3e |%s\n", name, eng::splice_mode_name(mode), e,
                  line.c_str());
      pop_logits.push_back(e);
      CHECK(got.num_tokens == ref.num_tokens);
      CHECK(got.computed_tokens == ref.computed_tokens);
    }
    check_population(pop_logits, std::string(name) + " (all experts) splice query logits (5 modes)", kAllExperts);
    check_population(pop_state, std::string(name) + " (all experts) spliced states and KV", kAllExperts);
  }
}

TEST_CASE("cuda backend families: refresh_segments (the probe's attention mass) and recompute_segments",
          "[families][backend]") {
  require_gpu();
  for (const char* name : kFamilies) {
    Fixture& f = fixture(name, true);
    std::mt19937 rng(31);
    std::vector<std::vector<int32_t>> segs;
    for (size_t n : {40, 90, 130, 65}) segs.push_back(random_ids(rng, n, f.cfg.vocab_size));
    const auto query = random_ids(rng, 16, f.cfg.vocab_size);
    const auto gentries = f.gpu->build_entries(segs, 8);
    auto plan = [&](std::vector<int> recompute, int refresh) {
      eng::SplicePlan gp;
      gp.mode = eng::SpliceMode::Hypic;
      gp.seam_width = 8;
      gp.query = query;
      gp.all_query_logits = true;
      gp.recompute_segments = std::move(recompute);
      gp.refresh_segments = refresh;
      for (size_t i = 0; i < segs.size(); ++i) gp.segments.push_back({segs[i], gentries[i]});
      return gp;
    };
    // The probe picks 2 segments by the query's attention mass (MLA: over the padded pool); the answer is the
    // explicit recomputation of those, bit for bit.
    const eng::SpliceOutput got = f.gpu->splice(plan({}, 2));
    REQUIRE(got.recomputed_segments.size() == 2);
    const eng::SpliceOutput same = f.gpu->splice(plan(got.recomputed_segments, 0));
    CHECK(got.logits == same.logits);
    // Against the CPU engine's recomputation of the same segments.
    eng::SpliceRequest cr;
    cr.mode = eng::SpliceMode::Hypic;
    cr.seam_width = 8;
    cr.query = query;
    cr.all_query_logits = true;
    cr.recompute_segments = got.recomputed_segments;
    for (const auto& sg : segs)
      cr.segments.push_back({sg, std::make_shared<eng::SegmentEntry>(eng::build_segment_entry(*f.cpu, sg, 8))});
    const double e = rel(got.logits, eng::splice(*f.cpu, cr).logits);
    std::printf("[families] %s refresh 2 chose %d and %d; logits vs the CPU's recomputation %.3e\n", name,
                got.recomputed_segments[0], got.recomputed_segments[1], e);
    CHECK(e <= kAllExperts.max);
  }
}

TEST_CASE("cuda backend families: the conformance suite (hit == miss, prefix, decode identities)",
          "[families][backend][conformance]") {
  require_gpu();
  uint32_t seed = 11;
  for (const char* name : kFamilies)
  for (bool all : {true, false}) {
    Fixture& f = fixture(name, all);
    hypic::testing::ConformanceOptions o;
    // Passes of other shapes in bf16: the all-experts bound above; with top-2 routing a near-tied choice may flip
    // between two shapes' roundings (test_gpu_conformance.cpp), the top-2 bound.
    o.tol = all ? kAllExperts.max : kTop2.max;
    o.all_rows = false;
    o.seed = seed++;
    std::printf("[families] conformance suite on %s (%s)\n", name, all ? "all experts" : "top-2");
    hypic::testing::check_backend_conformance(*f.gpu, o);
  }
}

TEST_CASE("cuda backend families: a request decoded alone vs batched with 15 others, graphs vs eager",
          "[families][backend]") {
  require_gpu();
  for (const char* name : kFamilies) {
    Fixture& f = fixture(name);
    const size_t V = size_t(f.cfg.vocab_size);
    std::mt19937 rng(17);
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < 16; ++i) prompts.push_back(random_ids(rng, 50 + 13 * i, f.cfg.vocab_size));
    auto greedy = [&](eng::Backend& b, const std::vector<int>& which, int steps) {
      std::vector<eng::SpliceOutput> outs;
      for (int i : which) outs.push_back(b.splice(full_plan(prompts[i], prompts[i].size() - 1, false)));
      std::vector<std::vector<int32_t>> toks(which.size());
      std::vector<std::vector<float>> lg;
      for (auto& o : outs) lg.push_back(o.logits);
      std::vector<std::vector<float>> steps_logits;
      std::vector<float> batch;
      for (int s = 0; s < steps; ++s) {
        std::vector<eng::Sequence*> seqs;
        std::vector<int32_t> next;
        for (size_t k = 0; k < outs.size(); ++k) {
          next.push_back(argmax(lg[k].data(), V));
          toks[k].push_back(next.back());
          seqs.push_back(outs[k].sequence.get());
        }
        b.decode(seqs, next, batch);
        steps_logits.push_back(batch);
        for (size_t k = 0; k < outs.size(); ++k) lg[k].assign(batch.begin() + k * V, batch.begin() + (k + 1) * V);
      }
      return std::make_pair(toks, steps_logits);
    };
    const auto alone = greedy(*f.gpu, {0}, 64);
    std::vector<int> all(16);
    std::iota(all.begin(), all.end(), 0);
    const auto batched = greedy(*f.gpu, all, 64);
    int differ = 0;
    for (int s = 0; s < 64; ++s) differ += alone.first[0][s] != batched.first[0][s];
    std::printf("[families] %s decode alone vs batched with 15 others: %d of 64 greedy tokens differ\n", name, differ);
    CHECK(alone.first[0][0] == batched.first[0][0]);
    // Graphs (the default, captured from the second step of a shape) vs eager steps: bit for bit.
    eng::BackendOptions opt;
    opt.kv_pool_bytes = size_t(1) << 28;
    opt.max_sequences = 16;
    opt.decode_graphs = false;
    auto eager = eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, f.cfg, &f.cpu->weights(), opt);
    const auto e = greedy(*eager, {0, 1, 2}, 70);
    opt.decode_graphs = true;
    auto graphs = eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, f.cfg, &f.cpu->weights(), opt);
    const auto g = greedy(*graphs, {0, 1, 2}, 70);
    int same = 0;
    for (size_t s = 0; s < e.second.size(); ++s) same += e.second[s] == g.second[s];
    std::printf("[families] %s decode with CUDA graphs: %d of %zu steps bit-identical to eager\n", name, same,
                e.second.size());
    CHECK(same == int(e.second.size()));
  }
}

TEST_CASE("cuda backend families: lightning heads of 64 (state slots of another size), sequences in slots 0 to 2",
          "[families][backend]") {
  require_gpu();
  // MiniMax with head_dim 64 (the lightning kernels' other size; d x d states of 16 KB): three sequences alive at once
  // hold three state slots; each one's prefill and a batched decode step against the CPU engine.
  Fixture& f = fixture("minimax_gpu", true, {{"\"head_dim\": 128", "\"head_dim\": 64"}}, "_head64");
  REQUIRE(f.cfg.head_dim == 64);
  const size_t V = size_t(f.cfg.vocab_size);
  std::mt19937 rng(23);
  std::vector<std::vector<int32_t>> prompts;
  for (size_t n : {90, 33, 150}) prompts.push_back(random_ids(rng, n, f.cfg.vocab_size));
  std::vector<eng::SpliceOutput> outs;
  std::vector<eng::ModelState> states;
  std::vector<double> pop;
  std::vector<int32_t> next;
  for (const auto& p : prompts) {
    states.push_back(f.cpu->initial_state());
    const auto ref = f.cpu->prefill(states.back(), p, 0).logits;
    outs.push_back(f.gpu->splice(full_plan(p, p.size() - 1, false)));
    pop.push_back(rel(outs.back().logits, ref));
    next.push_back(int32_t(argmax(ref.data(), V)));
  }
  std::vector<eng::Sequence*> seqs;
  for (auto& o : outs) seqs.push_back(o.sequence.get());
  std::vector<float> got;
  f.gpu->decode(seqs, next, got);
  for (size_t b = 0; b < prompts.size(); ++b) {
    const auto ref = f.cpu->decode(states[b], next[b], int64_t(prompts[b].size()));
    pop.push_back(rel(std::vector<float>(got.begin() + b * V, got.begin() + (b + 1) * V), ref));
    std::string line;
    state_errors(f.cfg, outs[b].sequence->to_host(), states[b], pop, line);
    std::printf("[families] minimax head 64, sequence %zu:%s\n", b, line.c_str());
  }
  check_population(pop, "minimax_gpu head_dim 64 (all experts) prefill, decode and states of 3 slots", kAllExperts);
}

TEST_CASE("cuda backend families: other shapes (head counts, layer patterns, MLA ranks and sizes, RoPE fractions)",
          "[families][backend]") {
  require_gpu();
  // Configs unlike the fixtures above: MLA at padded head size 128 with v != nope and rank 256, three KDA heads and
  // attention layers every other layer; MiniMax with 6 query / 3 KV heads and the softmax layer first; Ring with 6
  // heads, 3 norm groups, a quarter of the head rotated and a softmax layer every third. Every expert routed.
  struct Variant {
    const char* name;
    std::vector<std::pair<std::string, std::string>> edits;
  };
  const Variant variants[] = {
      {"kimi_linear_gpu",
       {{"\"linear_num_heads\": 2", "\"linear_num_heads\": 3"},
        {"\"num_attention_heads\": 2", "\"num_attention_heads\": 3"},
        {"\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"},
        {"\"kv_lora_rank\": 512", "\"kv_lora_rank\": 256"},
        {"\"qk_nope_head_dim\": 128", "\"qk_nope_head_dim\": 64"},
        {"\"qk_rope_head_dim\": 64", "\"qk_rope_head_dim\": 32"},
        {"\"v_head_dim\": 128", "\"v_head_dim\": 96"},
        {"\"linear_attention\", \"linear_attention\", \"linear_attention\", \"full_attention\"",
         "\"linear_attention\", \"full_attention\", \"linear_attention\", \"full_attention\""}}},
      {"minimax_gpu",
       {{"\"num_attention_heads\": 4", "\"num_attention_heads\": 6"},
        {"\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"},
        {"\"linear_attention\", \"linear_attention\", \"linear_attention\", \"full_attention\"",
         "\"full_attention\", \"linear_attention\", \"linear_attention\", \"linear_attention\""}}},
      {"ring_linear_gpu",
       {{"\"num_attention_heads\": 4", "\"num_attention_heads\": 6"},
        {"\"group_norm_size\": 4", "\"group_norm_size\": 3"},
        {"\"partial_rotary_factor\": 0.5", "\"partial_rotary_factor\": 0.25"},
        {"\"layer_group_size\": 4", "\"layer_group_size\": 3"}}},
  };
  for (const Variant& v : variants) {
    Fixture& f = fixture(v.name, true, v.edits, "_shapes");
    const size_t V = size_t(f.cfg.vocab_size);
    std::mt19937 rng(29);
    std::vector<double> pop;
    // Prefill of 300 tokens, then one decode step.
    const auto ids = random_ids(rng, 300, f.cfg.vocab_size);
    eng::ModelState st = f.cpu->initial_state();
    const auto ref = f.cpu->prefill(st, ids, 0).logits;
    eng::SpliceOutput out = f.gpu->splice(full_plan(ids, 299, false));
    pop.push_back(rel(out.logits, ref));
    const int32_t tok = int32_t(argmax(ref.data(), V));
    const auto ref2 = f.cpu->decode(st, tok, 300);
    std::vector<float> got;
    eng::Sequence* seqs[1] = {out.sequence.get()};
    f.gpu->decode(seqs, std::span<const int32_t>(&tok, 1), got);
    pop.push_back(rel(got, ref2));
    std::string line;
    state_errors(f.cfg, out.sequence->to_host(), st, pop, line);
    // A hypic splice of three segments against the CPU engine's.
    std::vector<std::vector<int32_t>> segs;
    for (size_t n : {70, 5, 130}) segs.push_back(random_ids(rng, n, f.cfg.vocab_size));
    const auto query = random_ids(rng, 12, f.cfg.vocab_size);
    const auto gentries = f.gpu->build_entries(segs, 8);
    eng::SplicePlan gp;
    eng::SpliceRequest cr;
    gp.mode = cr.mode = eng::SpliceMode::Hypic;
    gp.seam_width = cr.seam_width = 8;
    gp.query = cr.query = query;
    for (size_t i = 0; i < segs.size(); ++i) {
      gp.segments.push_back({segs[i], gentries[i]});
      cr.segments.push_back({segs[i], std::make_shared<eng::SegmentEntry>(eng::build_segment_entry(*f.cpu, segs[i], 8))});
    }
    const double es = rel(f.gpu->splice(gp).logits, eng::splice(*f.cpu, cr).logits);
    pop.push_back(es);
    std::printf("[families] %s other shapes: prefill %.2e, decode %.2e, hypic splice %.2e |%s\n", v.name, pop[0],
                pop[1], es, line.c_str());
    check_population(pop, std::string(v.name) + " (other shapes, all experts)", kAllExperts);
  }
}

TEST_CASE("cuda backend families: configs the kernels do not take are refused at load, naming the value",
          "[families][backend]") {
  require_gpu();
  eng::BackendOptions opt;
  opt.max_sequences = 2;
  opt.kv_pool_bytes = size_t(1) << 24;
  opt.random_weights_seed = 1;
  auto refuse = [&](const std::string& name, const std::string& from, const std::string& to, const char* what) {
    const eng::ModelConfig c = edited_config(name, {{from, to}});
    CHECK_THROWS_WITH(eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, 0}, c, nullptr, opt),
                      Catch::Contains(what));
  };
  refuse("kimi_linear_gpu", "\"linear_head_dim\": 128", "\"linear_head_dim\": 64", "KDA head size 64");
  refuse("kimi_linear_gpu", "\"q_lora_rank\": null", "\"q_lora_rank\": 64", "q_lora_rank 64");
  refuse("minimax_gpu", "\"head_dim\": 128", "\"head_dim\": 96", "head_dim 96");
  refuse("ring_linear_gpu", "\"group_norm_size\": 4", "\"group_norm_size\": 512", "group_norm_size 512");
  refuse("minimax_gpu", "\"mlp_alpha_factor\": 1.3", "\"mlp_alpha_factor\": 0", "alpha of 0");
}

// Diagnostics (hidden: run with "[.diag]"): a length-1 segment's w = 0 entry built alone, first and last in a batch.
TEST_CASE("cuda backend families: a one-token entry alone and in a batch", "[.diag]") {
  require_gpu();
  for (const char* name : kFamilies) {
    Fixture& f = fixture(name, true);
    std::mt19937 rng(5);
    std::vector<std::vector<int32_t>> segs;
    for (size_t n : {40, 7, 130, 65, 1}) segs.push_back(random_ids(rng, n, f.cfg.vocab_size));
    const auto one = segs.back();
    const auto ref = eng::build_segment_entry(*f.cpu, one, 0);
    auto report = [&](const char* how, const std::vector<std::vector<int32_t>>& batch, size_t at) {
      const auto e = f.gpu->build_entries(batch, 0)[at]->host();
      std::printf("[families] %s one-token entry %s:", name, how);
      for (size_t l = 0; l < ref.linear.size(); ++l)
        std::printf(" L%zu %.2e", l, rel(e->linear[l].interior_state, ref.linear[l].interior_state));
      for (size_t a = 0; a < ref.attention.size(); ++a)
        std::printf(" K%zu %.2e V %.2e", a, rel(e->attention[a].k, ref.attention[a].k),
                    rel(e->attention[a].v, ref.attention[a].v));
      std::printf("\n");
    };
    report("alone", {one}, 0);
    report("last of 5", segs, 4);
    std::vector<std::vector<int32_t>> rev(segs.rbegin(), segs.rend());
    report("first of 5", rev, 0);
    report("with a copy of itself", {one, one}, 1);
  }
}
