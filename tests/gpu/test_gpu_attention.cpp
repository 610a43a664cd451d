// GPU attention kernels of kernels/cuda/attention.h against the CPU fp32 reference of kernels/cpu
// (attention_causal on gathered K/V, rms_norm_zero_centred, apply_rope, apply_rope_uniform), on random
// bf16 inputs (the reference sees the same bf16-rounded values), KV pages handed out in a shuffled
// order and every unwritten pool row poisoned with NaN. Needs an NVIDIA GPU (scripts/test_gpu.sh).
//
// Every case prints one line per checked unit (group / request / row set) with its error, so a single
// run tells which case fails and by how much. Stated tolerances:
//   attention_prefill / attention_decode (bf16 q, K, V and output, bf16 P on the tensor cores, fp32
//     softmax and accumulators): per group, max |gpu - ref| / max |ref| <= 1e-2 (expected ~3e-3), no NaN;
//   CUDA-graph replays: bit for bit equal to the eager call;
//   attention_prepare (norm rounded to bf16, then RoPE in fp32 rounded once, as the reference does):
//     per head row max |gpu - ref| <= 2^-6 max |ref row| (about 2 bf16 ulps of the row's largest value;
//     differences come from the fp32 sum of squares vs the reference's double one and cosf/sinf vs libm)
//     and >= 95% of elements bitwise equal; V copied bit for bit; no other pool row written;
//   kv_import: same K tolerance against apply_rope_uniform, delta 0 and V bit for bit;
//   kv_import(delta) after attention_prepare(p) vs attention_prepare(p + delta): per row
//     max |d| <= 2^-6 max |ref row| (two bf16 roundings and fp32 angles; positions < 5000).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/switches.h"
#include "tests/gpu/gpu_util.h"

using namespace hypic::gputest;
namespace gpu = hypic::kernels::cuda;
namespace cpu = hypic::kernels::cpu;
using bf16 = __nv_bfloat16;

namespace {

constexpr int kPage = gpu::kKvPageTokens;

void require_gpu() {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
}

struct GroupSpec {
  int seq, slot0, len;
};

struct AttnCase {
  std::string name;
  int hd, nh, nkv;
  std::vector<int> seq_kv;  // KV length of each sequence
  std::vector<GroupSpec> groups;
  bool gate = true;
  bool decode = false;
  int max_kv_override = 0;  // decode: the max_kv passed (0: the true bound)
  bool host_tables = false;  // prefill with workspace: also pass host copies of q_start / slot0 (the cuDNN route)
  bool kv_read_early = false;  // decode: attention_decode's kv_read_early promise (nothing writes the pool before it)
  bool shared_sequence = false;  // prefill: AttnGroups::shared_sequence (the paired split kernel's hint)
};

// Device copies of one case's inputs.
struct AttnSetup {
  int G = 0, total_q = 0, max_q = 0, max_kv = 0, max_pages = 0;
  std::vector<int> q_start, slot0;
  std::vector<float> qf, gf;  // [total_q][nh][hd] query and gate values
  std::optional<DeviceBuffer<bf16>> dk, dv, dq, dqg, dout;
  std::optional<DeviceBuffer<int>> dqs, ds0, dbt;
  gpu::AttnGroups groups() const {
    gpu::AttnGroups g;
    g.num_groups = G;
    g.q_start = dqs->get();
    g.slot0 = ds0->get();
    g.block_table = dbt->get();
    g.max_pages = max_pages;
    g.total_q = total_q;
    g.max_q = max_q;
    g.max_kv = max_kv;
    return g;
  }
};

// Builds the pool, the sequences and the queries of `c`; the gate lives in an HF-layout q_proj output
// qg [total_q][nh][2 hd] (query, then gate per head) and is passed as qg + hd with strides (nh 2 hd, 2 hd).
void build_case(const AttnCase& c, std::mt19937& rng, std::vector<Seq>& seqs, AttnSetup& s) {
  int pages = 5;  // a few spare pages so the shuffle leaves holes
  for (int kv : c.seq_kv) pages += (kv + kPage - 1) / kPage;
  HostPool pool(pages, c.nkv, c.hd, rng);
  for (int kv : c.seq_kv) seqs.push_back(make_seq(pool, kv, rng));
  s.G = static_cast<int>(c.groups.size());
  s.q_start.assign(s.G + 1, 0);
  std::vector<int>& slot0 = s.slot0;
  slot0.assign(s.G, 0);
  for (int g = 0; g < s.G; ++g) {
    const auto& gs = c.groups[g];
    if (gs.slot0 + gs.len > c.seq_kv[gs.seq]) throw std::logic_error("group beyond its sequence");
    s.q_start[g + 1] = s.q_start[g] + gs.len;
    slot0[g] = gs.slot0;
    s.max_q = std::max(s.max_q, gs.len);
    s.max_kv = std::max(s.max_kv, gs.slot0 + gs.len);
  }
  s.total_q = s.q_start[s.G];
  for (const auto& sq : seqs) s.max_pages = std::max(s.max_pages, static_cast<int>(sq.pages.size()));
  std::vector<int> bt(size_t(s.G) * s.max_pages, -1);  // padding never read
  for (int g = 0; g < s.G; ++g) {
    const auto& pg = seqs[c.groups[g].seq].pages;
    std::copy(pg.begin(), pg.end(), bt.begin() + size_t(g) * s.max_pages);
  }
  const size_t qe = size_t(s.total_q) * c.nh * c.hd;
  const auto qb = random_bf16(rng, qe, 1.0f, s.qf);
  const auto gb = random_bf16(rng, qe, 2.0f, s.gf);
  std::vector<bf16> qg(2 * qe);
  for (size_t r = 0; r < size_t(s.total_q) * c.nh; ++r)
    for (int d = 0; d < c.hd; ++d) {
      qg[r * 2 * c.hd + d] = qb[r * c.hd + d];
      qg[r * 2 * c.hd + c.hd + d] = gb[r * c.hd + d];
    }
  s.dk.emplace(pool.k);
  s.dv.emplace(pool.v);
  s.dq.emplace(qb);
  s.dqg.emplace(qg);
  s.dout.emplace(qe);
  s.dout->poison();
  s.dqs.emplace(s.q_start);
  s.ds0.emplace(slot0);
  s.dbt.emplace(bt);
}

void run_attention(const AttnCase& c, AttnSetup& s, gpu::AttnDecodeWorkspace* ws, cudaStream_t st = nullptr) {
  gpu::AttnGroups g = s.groups();
  if (c.max_kv_override) g.max_kv = c.max_kv_override;
  if (c.host_tables) g.q_start_host = s.q_start.data(), g.slot0_host = s.slot0.data();
  g.shared_sequence = c.shared_sequence;
  const float scale = 1.0f / std::sqrt(float(c.hd));
  const bf16* gate = c.gate ? s.dqg->get() + c.hd : nullptr;
  const long gts = long(c.nh) * 2 * c.hd;
  const int ghs = 2 * c.hd;
  if (c.decode)
    gpu::attention_decode(g, c.nh, c.nkv, c.hd, s.dq->get(), s.dk->get(), s.dv->get(), scale, gate, gts, ghs,
                          s.dout->get(), *ws, st, c.kv_read_early);
  else if (ws)  // the workspace overload: split-KV path for groups of <= 512 queries
    gpu::attention_prefill(g, c.nh, c.nkv, c.hd, s.dq->get(), s.dk->get(), s.dv->get(), scale, gate, gts, ghs,
                           s.dout->get(), *ws, st);
  else  // no workspace: one block per (group, head, 128-query tile) for every group
    gpu::attention_prefill(g, c.nh, c.nkv, c.hd, s.dq->get(), s.dk->get(), s.dv->get(), scale, gate, gts, ghs,
                           s.dout->get(), st);
}

// Compares every group of `c` against attention_causal; prints one line per group.
void check_against_cpu(const AttnCase& c, const std::vector<Seq>& seqs, const AttnSetup& s,
                       const std::vector<bf16>& out) {
  const size_t qrow = size_t(c.nh) * c.hd, kvrow = size_t(c.nkv) * c.hd;
  const float scale = 1.0f / std::sqrt(float(c.hd));
  double worst = 0;
  int worst_g = -1;
  for (int g = 0; g < s.G; ++g) {
    const auto& gs = c.groups[g];
    const int q0 = s.q_start[g], keys = gs.slot0 + gs.len;
    std::vector<float> ref(size_t(gs.len) * qrow);
    cpu::AttentionShape shape;
    shape.num_queries = gs.len;
    shape.num_keys = keys;
    shape.num_heads = c.nh;
    shape.num_kv_heads = c.nkv;
    shape.head_dim = c.hd;
    cpu::attention_causal(shape, s.qf.data() + size_t(q0) * qrow, seqs[gs.seq].k.data(), seqs[gs.seq].v.data(),
                          scale, ref.data());
    (void)kvrow;
    double max_ref = 0, max_d = 0, num = 0, den = 0;
    size_t nonfinite = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      if (c.gate) ref[i] *= cpu::sigmoid(s.gf[size_t(q0) * qrow + i]);
      const float o = bf16_to_float(out[size_t(q0) * qrow + i]);
      if (!std::isfinite(o)) {
        ++nonfinite;
        continue;
      }
      const double d = std::fabs(double(o) - ref[i]);
      max_d = std::max(max_d, d);
      max_ref = std::max(max_ref, double(std::fabs(ref[i])));
      num += d * d;
      den += double(ref[i]) * ref[i];
    }
    const double rel = nonfinite ? INFINITY : max_d / std::max(max_ref, 1e-30);
    std::printf("  [%s] group %d (seq %d, slot0 %d, len %d): max|d|/max|ref| = %.3e, rel fro = %.3e%s\n",
                c.name.c_str(), g, gs.seq, gs.slot0, gs.len, rel, std::sqrt(num / std::max(den, 1e-30)),
                nonfinite ? " NON-FINITE OUTPUTS" : "");
    INFO(c.name << ": group " << g << " (seq " << gs.seq << ", slot0 " << gs.slot0 << ", len " << gs.len
                << "): max|d| " << max_d << " max|ref| " << max_ref << " non-finite " << nonfinite);
    CHECK(nonfinite == 0);
    CHECK(rel <= 1e-2);
    if (rel > worst) worst = rel, worst_g = g;
  }
  std::printf("[%s] worst group %d: %.3e (tolerance 1e-2)\n", c.name.c_str(), worst_g, worst);
  std::fflush(stdout);
}

// Prefill cases run through the workspace overload (split path for short groups) unless no_ws.
long run_attention_case(const AttnCase& c, uint32_t seed, bool no_ws = false) {
  std::mt19937 rng(seed);
  std::vector<Seq> seqs;
  AttnSetup s;
  build_case(c, rng, seqs, s);
  gpu::AttnDecodeWorkspace ws;
  run_attention(c, s, no_ws && !c.decode ? nullptr : &ws);
  check_cuda(cudaDeviceSynchronize(), c.name);
  std::printf("[%s] %s, workspace %zu bytes, cuDNN SDPA launches %ld\n", c.name.c_str(),
              c.decode ? "decode" : no_ws ? "prefill without workspace" : "prefill with workspace", ws.bytes(),
              ws.cudnn_launches());
  check_against_cpu(c, seqs, s, s.dout->download());
  return ws.cudnn_launches();
}

// Groups of the listed (len, slot0), each on its own sequence of KV length slot0 + len.
AttnCase own_sequences(std::string name, int hd, int nh, int nkv, const std::vector<std::pair<int, int>>& len_slot0,
                       bool gate) {
  AttnCase c{std::move(name), hd, nh, nkv, {}, {}, gate};
  for (const auto& [len, s0] : len_slot0) {
    c.groups.push_back({static_cast<int>(c.seq_kv.size()), s0, len});
    c.seq_kv.push_back(s0 + len);
  }
  return c;
}

AttnCase decode_case(std::string name, int hd, int nh, int nkv, const std::vector<int>& contexts, bool gate) {
  AttnCase c{std::move(name), hd, nh, nkv, {}, {}, gate, true};
  for (int ctx : contexts) {
    c.groups.push_back({static_cast<int>(c.seq_kv.size()), ctx - 1, 1});
    c.seq_kv.push_back(ctx);
  }
  return c;
}

// One CUDA graph captured from fn on a non-blocking stream.
struct Graph {
  cudaStream_t st = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  Graph() { check_cuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate"); }
  template <class F>
  void capture(F&& fn) {
    check_cuda(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "begin capture");
    fn();
    check_cuda(cudaStreamEndCapture(st, &graph), "end capture");
    check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  }
  void replay() {
    check_cuda(cudaDeviceSynchronize(), "before replay");
    check_cuda(cudaGraphLaunch(exec, st), "graph launch");
    check_cuda(cudaStreamSynchronize(st), "graph replay");
  }
  ~Graph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (st) cudaStreamDestroy(st);
  }
};

// The prefill of `c` captured once into a CUDA graph over workspace ws (reserved), then replayed twice (the second
// replay shows that the plan kernel resets the work counter); the outputs of both replays, poisoned before each.
std::pair<std::vector<bf16>, std::vector<bf16>> replay_twice(const AttnCase& c, AttnSetup& s,
                                                             gpu::AttnDecodeWorkspace& ws) {
  s.dout->poison();
  Graph gr;
  gr.capture([&] { run_attention(c, s, &ws, gr.st); });
  gr.replay();
  auto first = s.dout->download();
  s.dout->poison();
  gr.replay();
  return {std::move(first), s.dout->download()};
}

}  // namespace

// -------------------------------------------------------------------------------------------------------
TEST_CASE("attention_prefill matches attention_causal: head sizes 64/128/256, GQA 1/4/8, ragged groups",
          "[gpu][attention]") {
  require_gpu();
  // (len, slot0): lengths {1, 3, 64, 65, 200, 1000}, context before the span, nothing tile-aligned.
  const std::vector<std::pair<int, int>> a = {{1, 0}, {3, 5}, {64, 130}, {65, 63}, {200, 64}, {1000, 1000}};
  const std::vector<std::pair<int, int>> b = {{1, 77}, {3, 0}, {64, 64}, {65, 1}, {200, 333}, {1000, 129}};
  SECTION("hd 64, MHA 4/4, no gate") { run_attention_case(own_sequences("prefill hd64 4/4", 64, 4, 4, a, false), 101); }
  SECTION("hd 64, GQA 8 (8/1), gate") { run_attention_case(own_sequences("prefill hd64 8/1 gate", 64, 8, 1, b, true), 102); }
  SECTION("hd 128, GQA 4 (8/2), gate") { run_attention_case(own_sequences("prefill hd128 8/2 gate", 128, 8, 2, a, true), 103); }
  SECTION("hd 128, MHA 2/2, no gate") { run_attention_case(own_sequences("prefill hd128 2/2", 128, 2, 2, b, false), 104); }
  SECTION("hd 256, GQA 8 (16/2), gate") {
    run_attention_case(own_sequences("prefill hd256 16/2 gate", 256, 16, 2, a, true), 105);
  }
  SECTION("hd 256, GQA 8 (16/2), no gate") {
    run_attention_case(own_sequences("prefill hd256 16/2", 256, 16, 2, b, false), 106);
  }
  SECTION("hd 256, MHA 2/2, gate") { run_attention_case(own_sequences("prefill hd256 2/2 gate", 256, 2, 2, b, true), 107); }
  SECTION("hd 256, GQA 4 (4/1), no gate, one group at slot0 0") {
    run_attention_case(own_sequences("prefill hd256 4/1 causal", 256, 4, 1, {{777, 0}}, false), 108);
  }
  SECTION("hd 256, GQA 8 (16/2), gate, without workspace (no split path)") {
    run_attention_case(own_sequences("prefill hd256 16/2 gate no-ws", 256, 16, 2, a, true), 109, true);
  }
  SECTION("hd 128, GQA 4 (8/2), gate, without workspace (no split path)") {
    run_attention_case(own_sequences("prefill hd128 8/2 gate no-ws", 128, 8, 2, b, true), 110, true);
  }
}

TEST_CASE("attention_prefill: several groups share one sequence's block table (seam windows of a splice)",
          "[gpu][attention]") {
  require_gpu();
  for (int hd : {128, 256}) {
    AttnCase c{"splice hd" + std::to_string(hd) + " 16/2 gate", hd, 16, 2, {1500, 700, 64}, {}, true};
    // Windows of sequence 0 interleaved with windows of sequences 1 and 2, in no particular order.
    c.groups = {{0, 0, 200}, {1, 0, 1}, {0, 300, 8}, {1, 650, 50}, {0, 777, 65}, {2, 0, 64}, {0, 1400, 100},
                {0, 64, 8},  {2, 63, 1}, {0, 1499, 1}};
    DYNAMIC_SECTION("head_dim " << hd) { run_attention_case(c, 200 + hd); }
    DYNAMIC_SECTION("head_dim " << hd << ", without workspace") {
      c.name += " no-ws";
      run_attention_case(c, 200 + hd, true);
    }
  }
}

// -------------------------------------------------------------------------------------------------------
// The split-KV path of attention_prefill(..., ws): groups of <= 512 queries, KV cut into chunks of whole
// pages (on an H200, 132 SMs, the first case gets chunks of 75 pages = 4800 slots, 9 of them for the
// 40000-slot groups: the group at slot0 4790 has a row tile whose rows all end before its second chunk).
TEST_CASE("attention_prefill split path: groups of 1..64 queries over contexts of 1..40000 slots",
          "[gpu][attention]") {
  require_gpu();
  // Sequences: 0: 40000 slots, 1: 5000, 2: 64, 3: 1, 4: 130.
  const std::vector<int> seq_kv = {40000, 5000, 64, 1, 130};
  const std::vector<GroupSpec> groups = {
      {0, 0, 1},     {3, 0, 1},      {0, 39999, 1}, {0, 39936, 64}, {0, 20000, 33}, {1, 4992, 8},   {1, 0, 64},
      {2, 0, 64},    {2, 1, 63},     {1, 4095, 17}, {0, 12345, 5},  {4, 66, 64},    {0, 4790, 20},  {0, 4799, 2},
      {0, 9599, 64}, {0, 38000, 7},  {4, 129, 1},   {1, 4800, 31},  {0, 63, 2},     {0, 31999, 16}};
  struct Shape {
    int hd, nh, nkv;
    bool gate;
  };
  // (head_dim 128 / 256 run the wgmma split kernel on Hopper: also a GQA ratio of 3 and one of 16 there.)
  for (const Shape sh : {Shape{256, 16, 2, true}, Shape{256, 16, 2, false}, Shape{128, 8, 2, true},
                         Shape{64, 6, 2, true}, Shape{64, 32, 1, false}, Shape{128, 4, 4, true},
                         Shape{128, 6, 2, true}, Shape{256, 16, 1, false}}) {
    AttnCase c{"split hd" + std::to_string(sh.hd) + " " + std::to_string(sh.nh) + "/" + std::to_string(sh.nkv) +
                   (sh.gate ? " gate" : ""),
               sh.hd, sh.nh, sh.nkv, seq_kv, groups, sh.gate};
    DYNAMIC_SECTION(c.name) { run_attention_case(c, 900 + sh.hd + sh.nh); }
  }
  // The plan from the host tables (HYPIC_ATTN_SPLIT_EXACT: chunks sized from the real row tiles and KV lengths),
  // against the CPU as the bound plan is; the 40000-slot groups then take many more, shorter chunks.
  for (const Shape sh : {Shape{256, 16, 2, true}, Shape{128, 8, 2, false}, Shape{64, 6, 2, true}}) {
    AttnCase c{"split exact hd" + std::to_string(sh.hd) + " " + std::to_string(sh.nh) + "/" + std::to_string(sh.nkv) +
                   (sh.gate ? " gate" : ""),
               sh.hd, sh.nh, sh.nkv, seq_kv, groups, sh.gate};
    c.host_tables = true;
    DYNAMIC_SECTION(c.name) {
      ScopedCandidate sw("HYPIC_ATTN_SPLIT_EXACT", true);
      run_attention_case(c, 960 + sh.hd + sh.nh);
    }
  }
  // Chunks sized for the wgmma split kernel's resident blocks (HYPIC_ATTN_SPLIT_WG_PLAN: on an H100 / H200 two per
  // SM at head_dim 256 where the mma.sync kernel's count is one, three against two at 128, so more items over shorter
  // chunks), from bounds and from the host tables, against the CPU as the default plans are (on devices without the
  // wgmma split kernel the switch changes nothing; the graph test below checks that it changes the plan).
  for (const bool exact : {false, true}) {
    for (const Shape sh : {Shape{256, 16, 2, true}, Shape{128, 8, 2, false}}) {
      AttnCase c{std::string("split wg-plan") + (exact ? " exact" : "") + " hd" + std::to_string(sh.hd) + " " +
                     std::to_string(sh.nh) + "/" + std::to_string(sh.nkv) + (sh.gate ? " gate" : ""),
                 sh.hd, sh.nh, sh.nkv, seq_kv, groups, sh.gate};
      c.host_tables = exact;
      DYNAMIC_SECTION(c.name) {
        ScopedCandidate sw("HYPIC_ATTN_SPLIT_WG_PLAN", true);
        ScopedCandidate ex("HYPIC_ATTN_SPLIT_EXACT", exact);
        run_attention_case(c, 970 + sh.hd + sh.nh);
      }
    }
  }
  SECTION("hd 256 16/2, max_kv understated (100): the last chunk covers the rest") {
    AttnCase c{"split hd256 max_kv 100", 256, 16, 2, seq_kv, groups, true};
    c.max_kv_override = 100;
    run_attention_case(c, 950);
  }
  SECTION("hd 128 8/2, max_kv understated (5000) with 40000-slot groups") {
    AttnCase c{"split hd128 max_kv 5000", 128, 8, 2, seq_kv, groups, true};
    c.max_kv_override = 5000;
    run_attention_case(c, 951);
  }
}

// -------------------------------------------------------------------------------------------------------
// Groups of more than 512 queries through cuDNN's SDPA (attention_prefill with a workspace and host tables): runs of
// consecutive long groups of equal (length, slot0) are one cuDNN call each; short groups in the same launch take the
// split path. The number of cuDNN launches is counted from the group list independently.
namespace {
// Sets HYPIC_ATTN_CUDNN for one scope (read on every call for the routing rule), restoring it after.
struct CudnnModeScope {
  std::optional<std::string> old;
  explicit CudnnModeScope(const char* v) {
    if (const char* e = std::getenv("HYPIC_ATTN_CUDNN")) old = e;
    setenv("HYPIC_ATTN_CUDNN", v, 1);
  }
  ~CudnnModeScope() {
    if (old)
      setenv("HYPIC_ATTN_CUDNN", old->c_str(), 1);
    else
      unsetenv("HYPIC_ATTN_CUDNN");
  }
};

// `calls` calls of one gated group of `len` queries over `slot0` cached slots (hd 128, 8 / 2 heads) through `ws`
// (whose cuDNN plans persist across calls), each checked against the CPU reference; the host ms of each call.
std::vector<double> checked_calls(gpu::AttnDecodeWorkspace& ws, const std::string& prefix, int len, int slot0,
                                  uint32_t seed, int calls) {
  AttnCase c = own_sequences(prefix + " " + std::to_string(len) + "@" + std::to_string(slot0), 128, 8, 2,
                             {{len, slot0}}, true);
  c.host_tables = true;
  std::mt19937 rng(seed);
  std::vector<Seq> seqs;
  AttnSetup s;
  build_case(c, rng, seqs, s);
  std::vector<double> ms;
  for (int i = 0; i < calls; ++i) {
    s.dout->poison();
    const auto t0 = std::chrono::steady_clock::now();
    run_attention(c, s, &ws);
    check_cuda(cudaDeviceSynchronize(), c.name);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    check_against_cpu(c, seqs, s, s.dout->download());
  }
  return ms;
}
}  // namespace

namespace {

// Runs `c` with host tables through a workspace (the cuDNN route) and again without one (our kernel for every group,
// itself checked against the CPU reference in the cases above); checks the cuDNN launches, that the first ours_rows
// query rows are the same bits both times (our kernel ran them) and that the rest, cuDNN's, are finite and within
// 1e-2 of the largest |value| of ours (bf16 outputs, other summation orders).
void check_routed_against_ours(AttnCase c, uint32_t seed, long want_launches, size_t ours_rows) {
  c.host_tables = true;
  std::mt19937 rng(seed);
  std::vector<Seq> seqs;
  AttnSetup s;
  build_case(c, rng, seqs, s);
  gpu::AttnDecodeWorkspace ws;
  run_attention(c, s, &ws);
  check_cuda(cudaDeviceSynchronize(), c.name);
  const auto routed = s.dout->download();
  s.dout->poison();
  run_attention(c, s, nullptr);  // our kernel for every group
  check_cuda(cudaDeviceSynchronize(), c.name);
  const auto ours = s.dout->download();
  std::printf("[%s] cuDNN launches %ld\n", c.name.c_str(), ws.cudnn_launches());
  CHECK(ws.cudnn_launches() == want_launches);
  const size_t row = size_t(c.nh) * c.hd, split = std::min(ours_rows * row, ours.size());
  REQUIRE(routed.size() == ours.size());
  CHECK(std::memcmp(routed.data(), ours.data(), split * sizeof(bf16)) == 0);
  double max_d = 0, max_ref = 0;
  size_t nonfinite = 0;
  for (size_t i = split; i < ours.size(); ++i) {
    const float a = bf16_to_float(routed[i]), b = bf16_to_float(ours[i]);
    if (!std::isfinite(a)) ++nonfinite;
    max_d = std::max(max_d, double(std::fabs(a - b)));
    max_ref = std::max(max_ref, double(std::fabs(b)));
  }
  if (split < ours.size())
    std::printf("[%s] cuDNN's rows vs our kernel: max|d|/max|ref| = %.3e\n", c.name.c_str(), max_d / max_ref);
  CHECK(nonfinite == 0);
  CHECK(max_d <= 1e-2 * max_ref);
}

}  // namespace

TEST_CASE("attention_prefill long groups through cuDNN SDPA match attention_causal", "[gpu][attention][cudnn]") {
  require_gpu();
  if (!gpu::attention_cudnn_available()) {
    WARN("cuDNN SDPA unavailable (" << gpu::attention_cudnn_status() << "): the cuDNN route is not tested here");
    return;
  }
  const CudnnModeScope all("all");  // every group of more than 512 queries to cuDNN (default: >= ~27k at 16 x 256)
  // (len, slot0): 513 and 600 alone, three equal 1000-query groups at slot0 0 (one batched call), short groups
  // between them (split path), 777 over 1234 cached slots (bottom-right causal), a 2048-query group at slot0 0.
  const std::vector<std::pair<int, int>> mixed = {{513, 0},   {1, 5},     {600, 100}, {64, 0},   {1000, 0},
                                                  {1000, 0},  {1000, 0},  {300, 40},  {777, 1234}, {2048, 0}};
  auto runs_of = [](const std::vector<std::pair<int, int>>& gs) {
    long runs = 0;
    for (size_t i = 0; i < gs.size(); ++i)
      if (gs[i].first > 512 && (i == 0 || gs[i - 1] != gs[i])) ++runs;
    return runs;
  };
  struct Shape {
    int hd, nh, nkv;
    bool gate;
  };
  for (const Shape sh : {Shape{256, 16, 2, true}, Shape{256, 16, 2, false}, Shape{128, 8, 2, true},
                         Shape{128, 6, 2, false}, Shape{64, 4, 4, true}}) {
    AttnCase c = own_sequences("cudnn hd" + std::to_string(sh.hd) + " " + std::to_string(sh.nh) + "/" +
                                   std::to_string(sh.nkv) + (sh.gate ? " gate" : ""),
                               sh.hd, sh.nh, sh.nkv, mixed, sh.gate);
    c.host_tables = true;
    DYNAMIC_SECTION(c.name) { CHECK(run_attention_case(c, 1500 + sh.hd + sh.nh) == runs_of(mixed)); }
  }
  SECTION("two equal long groups, nothing for our kernels (split plan made, unused): one batched call") {
    AttnCase c = own_sequences("cudnn two equal", 256, 16, 2, {{1000, 0}, {1000, 0}}, true);
    c.host_tables = true;
    CHECK(run_attention_case(c, 1605) == 1);
  }
  SECTION("one long group alone (no split path), hd 256 16/2 gate") {
    AttnCase c = own_sequences("cudnn single 3000", 256, 16, 2, {{3000, 0}}, true);
    c.host_tables = true;
    CHECK(run_attention_case(c, 1600) == 1);
  }
  // Plans built once per shape: each new shape compiles its kernel (36-63 ms at 8 / 2 heads on the H200, 2026-12-05).
  // cuDNN's dynamic-shape graphs with a kernel cache, which would bind an earlier shape's kernel, gave an illegal
  // address on the second shape there (cuDNN 9.19, the backend API with CUDNN_ATTR_EXECUTION_PLAN_KERNEL_CACHE; not
  // kept). Every call against the reference; host times printed, not asserted.
  SECTION("plans: built once per shape (host times printed, not asserted)") {
    gpu::AttnDecodeWorkspace ws;  // shared by the calls: its plans persist
    auto timed_case = [&](int len, int slot0, uint32_t seed) {
      // Both calls checked: the first builds the plan, the second reuses it.
      const std::vector<double> ms = checked_calls(ws, "cudnn plan", len, slot0, seed, 2);
      std::printf("[cudnn plan %d@%d] first call %.1f ms, second (plan cached) %.1f ms\n", len, slot0, ms[0], ms[1]);
    };
    timed_case(4000, 0, 1602);    // the first plan of these heads: compiles
    timed_case(3000, 0, 1603);    // a new shape
    timed_case(2500, 700, 1604);  // another, bottom-right
    timed_case(3500, 900, 1605);  // bottom-right again, new lengths
    timed_case(1500, 0, 1606);    // and plain again
    CHECK(ws.cudnn_launches() == 10);
  }
  // HYPIC_ATTN_CUDNN_BUCKETS (default on): plans padded to the groups' length buckets (16 per octave). Under
  // HYPIC_ATTN_CUDNN=all every group of more than 512 queries goes to cuDNN, those with cached slots too (by default
  // only those at slot0 0 or whose work reaches the rule's: the section after next). Groups whose queries, KV slots or
  // both are padded, batched equal groups, short groups between them; against the CPU reference like every case here.
  SECTION("length buckets: padded plans match the reference") {
    const CudnnModeScope def("all");
    gpu::CandidateScope on("HYPIC_ATTN_CUDNN_BUCKETS");
    on.set(true);
    // (len, slot0) -> plan (s_q, s_kv) = (bucket(len), bucket(len) + slot0): 1000 at 0 -> 1024 / 1024 twice (one
    // batched call, queries padded); 1000 over 24 cached -> 1024 / 1048 (queries and KV padded by 24 rows); 1024
    // over 100 -> 1024 / 1124 (exact); 777 over 1234 -> 800 / 2034; 2048 at 0 exact; 3001 at 0 -> 3072 / 3072; 513
    // over 5 -> 544 / 549. (With a KV bucket of its own, 1088 / 1152 / 2048 / 576 here, the plan's diagonal offset
    // exceeded slot0 and every group with cached slots was wrong on the H200, 2026-12-05: cuDNN took the diagonal from
    // the plan's shape, not from the lengths passed at run time.)
    const std::vector<std::pair<int, int>> groups = {{1000, 0}, {1000, 0}, {1000, 24}, {3, 7},     {1024, 100},
                                                     {777, 1234}, {64, 0}, {2048, 0}, {3001, 0}, {513, 5}};
    for (const bool gate : {true, false}) {
      AttnCase c = own_sequences(std::string("cudnn buckets hd256 16/2") + (gate ? " gate" : ""), 256, 16, 2, groups,
                                 gate);
      c.host_tables = true;
      CHECK(run_attention_case(c, 1620 + gate) == 7);
    }
    AttnCase c = own_sequences("cudnn buckets hd128 8/2 gate", 128, 8, 2, groups, true);
    c.host_tables = true;
    CHECK(run_attention_case(c, 1622) == 7);
  }
  SECTION("length buckets: one plan per bucket, shared by its lengths") {
    const CudnnModeScope def("all");
    gpu::CandidateScope on("HYPIC_ATTN_CUDNN_BUCKETS");
    on.set(true);
    gpu::AttnDecodeWorkspace ws;  // shared by the calls: its plans persist
    auto checked_call = [&](int len, int slot0, uint32_t seed) {
      const double ms = checked_calls(ws, "cudnn bucket", len, slot0, seed, 1)[0];
      std::printf("[cudnn bucket %d@%d] %.1f ms (host), plans held %zu\n", len, slot0, ms, ws.cudnn_plans());
    };
    checked_call(3000, 0, 1630);  // bucket 3072 / 3072: compiled
    CHECK(ws.cudnn_plans() == 1);
    checked_call(3050, 0, 1631);  // the same bucket: no new plan
    checked_call(2945, 0, 1632);  // 2945 -> 3072 too
    CHECK(ws.cudnn_plans() == 1);
    checked_call(2944, 0, 1633);  // 2944 is a bucket of its own (23 x 128)
    CHECK(ws.cudnn_plans() == 2);
    checked_call(2000, 1000, 1634);  // 2000 -> 2048 queries over 2048 + 1000 slots: a third plan
    checked_call(2030, 1000, 1635);  // 2048 / 3048 again: the same bucket at the same slot0
    CHECK(ws.cudnn_plans() == 3);
    checked_call(2030, 1010, 1636);  // another slot0, another diagonal: a fourth plan (2048 / 3058)
    CHECK(ws.cudnn_plans() == 4);
    CHECK(ws.cudnn_launches() == 7);
  }
  // By default (HYPIC_ATTN_CUDNN=1 with the buckets): a group at slot0 0 of more than 512 queries goes to cuDNN (one
  // plan per bucket), one with cached slots stays on our kernel unless its work reaches the rule's (a plan per slot0
  // would be compiled within its request). 1000 queries over 3000 cached slots first (our kernel: the same bits as
  // ours alone), then 1000 at slot0 0 (cuDNN, bucket 1024).
  SECTION("default rule with buckets: groups at slot0 0 past 512 queries, not those with cached slots") {
    const CudnnModeScope def("1");
    gpu::CandidateScope buckets("HYPIC_ATTN_CUDNN_BUCKETS");
    buckets.set(true);
    check_routed_against_ours(own_sequences("cudnn buckets default", 256, 16, 2, {{1000, 3000}, {1000, 0}}, true),
                              1612, 1, 1000);
  }
  SECTION("default rule: groups from ceil(sqrt(2 x 6e12 / (4 x heads x head_dim))) queries on, by length alone") {
    const CudnnModeScope def("1");
    gpu::CandidateScope no_buckets("HYPIC_ATTN_CUDNN_BUCKETS");  // (which takes every group over 512 queries)
    no_buckets.set(false);
    const int nh = 4, nkv = 1, hd = 256;
    const int min_q = static_cast<int>(std::ceil(std::sqrt(2.0 * 6e12 / (4.0 * nh * hd))));  // 54127
    // One group just below the bound, one at it: only the second goes to cuDNN.
    check_routed_against_ours(own_sequences("cudnn default rule", hd, nh, nkv, {{min_q - 1, 0}, {min_q, 0}}, true),
                              1610, 1, min_q - 1);
  }
  // HYPIC_ATTN_CUDNN_PREFIX: the rule counts the cached slots, 4 x len x (slot0 + len / 2) x heads x head_dim >= 6e12,
  // i.e. len x (2 slot0 + len) >= 2929687500 at 4 x 256 heads: 20000 queries over 63242 cached slots fall short
  // (2929680000), over 63243 reach it (2929720000). Each group its own sequence; the first stays on our kernel.
  SECTION("prefix rule: a group's cached slots count, to the exact integer bound") {
    const CudnnModeScope def("1");
    gpu::CandidateScope no_buckets("HYPIC_ATTN_CUDNN_BUCKETS");
    no_buckets.set(false);
    gpu::CandidateScope prefix("HYPIC_ATTN_CUDNN_PREFIX");
    const AttnCase c = own_sequences("cudnn prefix rule", 256, 4, 1, {{20000, 63242}, {20000, 63243}}, true);
    prefix.set(true);
    check_routed_against_ours(c, 1611, 1, 20000);
    prefix.set(false);  // by length alone: neither
    check_routed_against_ours(c, 1611, 0, 40000);
  }
  SECTION("without host tables the same groups take our kernels") {
    AttnCase c = own_sequences("no host tables", 256, 16, 2, mixed, true);
    CHECK(run_attention_case(c, 1601) == 0);
  }
}

namespace {

// The hypic splice: 16 cached 2k segments of one 32k sequence, the 8-token seam window of each recomputed
// (group i at slot0 2048 i), then the 64-token query at the end; all groups share one block table.
AttnCase splice_case(std::string name, int hd, int nh, int nkv, bool with_long) {
  const int T = 16 * 2048 + 64;
  AttnCase c{std::move(name), hd, nh, nkv, {T}, {}, true};
  for (int i = 0; i < 16; ++i) c.groups.push_back({0, 2048 * i, 8});
  c.groups.push_back({0, T - 64, 64});
  if (with_long) {  // mixed with longer groups in the same launch: 600 (> 512: the kernel without split) and 300
    c.seq_kv.push_back(1800);
    c.groups.insert(c.groups.begin() + 5, {1, 1200, 600});
    c.groups.push_back({0, 20000, 300});
  }
  return c;
}

}  // namespace

TEST_CASE("attention_prefill split path: the splice pattern (16 x 8 seam queries + 64 over 32k), mixed launches",
          "[gpu][attention]") {
  require_gpu();
  SECTION("hd 256 16/2") { run_attention_case(splice_case("splice16 hd256 16/2", 256, 16, 2, false), 1001); }
  SECTION("hd 256 16/2, with a 600- and a 300-query group") {
    run_attention_case(splice_case("splice16+long hd256 16/2", 256, 16, 2, true), 1002);
  }
  SECTION("hd 128 8/2, with long groups") {
    run_attention_case(splice_case("splice16+long hd128 8/2", 128, 8, 2, true), 1003);
  }
  SECTION("hd 256 16/2, without workspace (reference path)") {
    run_attention_case(splice_case("splice16 hd256 16/2 no-ws", 256, 16, 2, false), 1001, true);
  }
  SECTION("hd 256 16/2, the plan from the host tables (HYPIC_ATTN_SPLIT_EXACT)") {
    ScopedCandidate sw("HYPIC_ATTN_SPLIT_EXACT", true);
    AttnCase c = splice_case("splice16 exact hd256 16/2", 256, 16, 2, false);
    c.host_tables = true;
    run_attention_case(c, 1001);
  }
  SECTION("hd 128 8/2, with long groups, the plan from the host tables") {
    ScopedCandidate sw("HYPIC_ATTN_SPLIT_EXACT", true);
    AttnCase c = splice_case("splice16+long exact hd128 8/2", 128, 8, 2, true);
    c.host_tables = true;
    run_attention_case(c, 1003);
  }
  SECTION("hd 256 16/2, host tables, chunks for the wgmma kernel's resident blocks (HYPIC_ATTN_SPLIT_WG_PLAN)") {
    ScopedCandidate sw("HYPIC_ATTN_SPLIT_EXACT", true);
    ScopedCandidate wg("HYPIC_ATTN_SPLIT_WG_PLAN", true);
    AttnCase c = splice_case("splice16 exact wg-plan hd256 16/2", 256, 16, 2, false);
    c.host_tables = true;
    run_attention_case(c, 1001);
  }
}

TEST_CASE("attention_prefill split path: two items per block over shared K / V tiles (HYPIC_ATTN_SPLIT_PAIR) and "
          "the rescale skipped where no max moved (HYPIC_ATTN_SKIP_RESCALE), bit for bit the one-item kernel",
          "[gpu][attention]") {
  require_gpu();
  // Windows of one 20000-slot sequence at ragged positions and lengths (1 .. 64 queries, rows that are no multiple
  // of the 64-row tile, windows ending inside a 32-slot tile, one at slot0 0), and a launch mixing windows of three
  // sequences under the hint (pairs of different sequences' groups must not share tiles: the plan enters them alone).
  AttnCase ragged{"pair ragged hd256 16/2", 256, 16, 2, {20000}, {}, true};
  for (const auto& [s0, len] : std::vector<std::pair<int, int>>{
           {0, 1}, {5, 7}, {2047, 9}, {4100, 63}, {6000, 64}, {9999, 1}, {12001, 33}, {16384, 8}, {19900, 64}})
    ragged.groups.push_back({0, s0, len});
  AttnCase mixed{"pair mixed sequences hd128 8/2", 128, 8, 2, {3000, 2900, 130}, {}, true};
  mixed.groups = {{0, 0, 8}, {1, 0, 8}, {0, 1000, 8}, {1, 1000, 8}, {2, 60, 64}, {0, 2000, 40}, {1, 2100, 9},
                  {0, 2936, 64}};
  std::vector<AttnCase> cases = {splice_case("pair splice16 hd256 16/2", 256, 16, 2, false),
                                 splice_case("pair splice16+long hd128 8/2", 128, 8, 2, true), ragged, mixed};
  AttnCase exact = splice_case("pair splice16 exact hd256 16/2", 256, 16, 2, false);
  exact.host_tables = true;
  cases.push_back(exact);
  for (size_t i = 0; i < cases.size(); ++i) {
    AttnCase c = cases[i];
    c.shared_sequence = true;
    DYNAMIC_SECTION(c.name) {
      std::mt19937 rng(1300 + uint32_t(i));
      std::vector<Seq> seqs;
      AttnSetup s;
      build_case(c, rng, seqs, s);
      auto run = [&](bool pair, size_t& ws_bytes, bool skip = false) {
        ScopedCandidate sw("HYPIC_ATTN_SPLIT_PAIR", pair), sk("HYPIC_ATTN_SKIP_RESCALE", skip);
        gpu::AttnDecodeWorkspace ws;
        s.dout->poison();
        run_attention(c, s, &ws);
        check_cuda(cudaDeviceSynchronize(), c.name);
        ws_bytes = ws.bytes();
        return s.dout->download();
      };
      size_t bytes_one = 0, bytes_pair = 0;
      const uint64_t l0 = gpu::attention_split_pair_launches();
      const auto one = run(false, bytes_one);
      const uint64_t l1 = gpu::attention_split_pair_launches();
      const auto pair = run(true, bytes_pair);
      const uint64_t l2 = gpu::attention_split_pair_launches();
      const bool paired = gpu::attention_split_wgmma_available(c.hd);  // where the paired kernel can run
      const bool same = std::memcmp(one.data(), pair.data(), one.size() * sizeof(bf16)) == 0;
      std::printf("[%s] workspace %zu -> %zu bytes, paired launches %lu (off) / %lu (on; kernel available: %s), "
                  "bit-identical to the one-item kernel: %d\n",
                  c.name.c_str(), bytes_one, bytes_pair, (unsigned long)(l1 - l0), (unsigned long)(l2 - l1),
                  paired ? "yes" : "no", same);
      CHECK(l1 == l0);
      CHECK(l2 - l1 == (paired ? 1u : 0u));  // the switch and the hint reached the launch
      CHECK(same);
      size_t bytes_skip = 0;
      const auto skipped = run(false, bytes_skip, true);
      const bool same_skip = std::memcmp(one.data(), skipped.data(), one.size() * sizeof(bf16)) == 0;
      std::printf("[%s] rescale skipped where no row's max moved: bit-identical: %d\n", c.name.c_str(), same_skip);
      CHECK(same_skip);
      check_against_cpu(c, seqs, s, pair);
    }
  }
  SECTION("graph replay of the paired kernel (reserved workspace)") {
    ScopedCandidate sw("HYPIC_ATTN_SPLIT_PAIR", true);
    AttnCase c = splice_case("pair graph splice16 hd256 16/2", 256, 16, 2, true);
    c.shared_sequence = true;
    std::mt19937 rng(1400);
    std::vector<Seq> seqs;
    AttnSetup s;
    build_case(c, rng, seqs, s);
    gpu::AttnDecodeWorkspace ws;
    gpu::AttnGroups rg = s.groups();
    rg.shared_sequence = true;
    ws.reserve_prefill(rg, c.nh, c.nkv, c.hd);
    const size_t reserved = ws.bytes();
    const uint64_t l0 = gpu::attention_split_pair_launches();
    run_attention(c, s, &ws);
    check_cuda(cudaDeviceSynchronize(), "eager paired split prefill");
    CHECK(ws.bytes() == reserved);
    CHECK(gpu::attention_split_pair_launches() - l0 == (gpu::attention_split_wgmma_available(c.hd) ? 1u : 0u));
    const auto eager = s.dout->download();
    const auto [replayed, replayed2] = replay_twice(c, s, ws);
    CHECK(std::memcmp(eager.data(), replayed.data(), eager.size() * sizeof(bf16)) == 0);
    CHECK(std::memcmp(eager.data(), replayed2.data(), eager.size() * sizeof(bf16)) == 0);
    check_against_cpu(c, seqs, s, replayed);
  }
}

TEST_CASE("attention_prefill split path replays from a CUDA graph bit for bit (reserved workspace)",
          "[gpu][attention]") {
  require_gpu();
  // (exact: host tables given and HYPIC_ATTN_SPLIT_EXACT on: a captured call still runs the bound plan, which holds
  // for any tables a replay may see, so the replays equal an eager run with the switch off, and reserve_prefill's
  // bound plan suffices.)
  // (wg_plan: HYPIC_ATTN_SPLIT_WG_PLAN, chunks for the wgmma split kernel's resident blocks: where that kernel runs,
  // its reserved workspace is larger than the default plan's, i.e. the switch reached the plan.)
  struct GraphCase {
    bool with_long, exact, wg_plan;
  };
  for (const auto& [with_long, exact, wg_plan] : {GraphCase{false, false, false}, GraphCase{true, false, false},
                                                  GraphCase{false, true, false}, GraphCase{false, false, true}}) {
    DYNAMIC_SECTION("splice pattern" << (with_long ? " with long groups" : "") << (exact ? ", exact plan" : "")
                                     << (wg_plan ? ", wgmma kernel's plan" : "")) {
      ScopedCandidate sw("HYPIC_ATTN_SPLIT_EXACT", exact);
      ScopedCandidate wgp("HYPIC_ATTN_SPLIT_WG_PLAN", wg_plan);
      AttnCase c = splice_case(with_long ? "graph splice16+long"
                               : exact   ? "graph splice16 exact"
                               : wg_plan ? "graph splice16 wg-plan"
                                         : "graph splice16",
                               256, 16, 2, with_long);
      c.host_tables = exact;
      std::mt19937 rng(1100 + with_long);
      std::vector<Seq> seqs;
      AttnSetup s;
      build_case(c, rng, seqs, s);
      gpu::AttnDecodeWorkspace ws;
      gpu::AttnGroups rg = s.groups();
      if (exact) rg.q_start_host = s.q_start.data(), rg.slot0_host = s.slot0.data();
      ws.reserve_prefill(rg, c.nh, c.nkv, c.hd);
      const size_t reserved = ws.bytes();
      std::printf("[%s] reserved workspace %zu bytes\n", c.name.c_str(), reserved);
      CHECK(reserved > 0);
      if (wg_plan) {  // the same reservation under the default plan
        ScopedCandidate off("HYPIC_ATTN_SPLIT_WG_PLAN", false);
        gpu::AttnDecodeWorkspace ws0;
        ws0.reserve_prefill(rg, c.nh, c.nkv, c.hd);
        const bool wg_runs = gpu::attention_split_wgmma_available(c.hd);
        std::printf("[%s] default plan's workspace %zu bytes (wgmma split kernel: %s)\n", c.name.c_str(), ws0.bytes(),
                    wg_runs ? "yes" : "no");
        if (wg_runs)
          CHECK(reserved > ws0.bytes());
        else
          CHECK(reserved == ws0.bytes());
      }
      {
        ScopedCandidate bound("HYPIC_ATTN_SPLIT_EXACT", false);
        run_attention(c, s, &ws);
      }
      check_cuda(cudaDeviceSynchronize(), "eager split prefill");
      CHECK(ws.bytes() == reserved);  // the reserve sufficed
      const auto eager = s.dout->download();
      const auto [replayed, replayed2] = replay_twice(c, s, ws);
      const bool same1 = std::memcmp(eager.data(), replayed.data(), eager.size() * sizeof(bf16)) == 0;
      const bool same2 = std::memcmp(eager.data(), replayed2.data(), eager.size() * sizeof(bf16)) == 0;
      std::printf("[%s] replay 1 bit-identical: %d, replay 2 bit-identical: %d\n", c.name.c_str(), same1, same2);
      CHECK(same1);
      CHECK(same2);
      check_against_cpu(c, seqs, s, replayed);
      // A fresh (empty) workspace would have to allocate inside the capture.
      gpu::AttnDecodeWorkspace empty;
      cudaStream_t st;
      check_cuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
      check_cuda(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "begin capture");
      CHECK_THROWS_WITH(run_attention(c, s, &empty, st), Catch::Contains("during CUDA graph capture"));
      cudaGraph_t graph = nullptr;
      cudaStreamEndCapture(st, &graph);
      if (graph) cudaGraphDestroy(graph);
      cudaStreamDestroy(st);
      (void)cudaGetLastError();
    }
  }
}

TEST_CASE("attention_prefill: a long causal span, spot-checked rows against a double-precision reference",
          "[gpu][attention]") {
  require_gpu();
  // One group of 8192 queries at slot0 0 (64 query tiles, 128 KV tiles), hd 256, 16/2 heads.
  const int T = 8192, hd = 256, nh = 16, nkv = 2;
  AttnCase c = own_sequences("prefill long 8192", hd, nh, nkv, {{T, 0}}, true);
  std::mt19937 rng(300);
  std::vector<Seq> seqs;
  AttnSetup s;
  build_case(c, rng, seqs, s);
  run_attention(c, s, nullptr);
  check_cuda(cudaDeviceSynchronize(), "long prefill");
  const auto out = s.dout->download();
  std::vector<int> rows = {0, 1, 63, 64, 127, 128, 129, 4095, 4096, 8190, 8191};
  std::uniform_int_distribution<int> u(0, T - 1);
  for (int i = 0; i < 12; ++i) rows.push_back(u(rng));
  const float scale = 1.0f / std::sqrt(float(hd));
  double worst = 0;
  for (int i : rows) {
    double max_d = 0, max_ref = 0;
    size_t nonfinite = 0;
    for (int h = 0; h < nh; ++h) {
      const int kvh = h / (nh / nkv);
      const float* q = s.qf.data() + (size_t(i) * nh + h) * hd;
      std::vector<double> sc(i + 1);
      double mx = -INFINITY;
      for (int j = 0; j <= i; ++j) {
        const float* k = seqs[0].k.data() + (size_t(j) * nkv + kvh) * hd;
        double dot = 0;
        for (int d = 0; d < hd; ++d) dot += double(q[d]) * k[d];
        sc[j] = dot * scale;
        mx = std::max(mx, sc[j]);
      }
      double l = 0;
      for (auto& x : sc) l += (x = std::exp(x - mx));
      for (int d = 0; d < hd; ++d) {
        double acc = 0;
        for (int j = 0; j <= i; ++j) acc += sc[j] * seqs[0].v[(size_t(j) * nkv + kvh) * hd + d];
        const size_t idx = (size_t(i) * nh + h) * hd + d;
        const double ref = acc / l / (1.0 + std::exp(-double(s.gf[idx])));
        const float o = bf16_to_float(out[idx]);
        if (!std::isfinite(o)) ++nonfinite;
        max_d = std::max(max_d, std::fabs(o - ref));
        max_ref = std::max(max_ref, std::fabs(ref));
      }
    }
    const double rel = nonfinite ? INFINITY : max_d / max_ref;
    std::printf("  [prefill long 8192] row %d (all heads): max|d|/max|ref| = %.3e\n", i, rel);
    INFO("row " << i << " max|d| " << max_d << " max|ref| " << max_ref << " non-finite " << nonfinite);
    CHECK(rel <= 1e-2);
    worst = std::max(worst, rel);
  }
  // Rows that were not spot-checked must all be written (finite).
  size_t nonfinite = 0;
  for (const auto& x : out) nonfinite += !std::isfinite(bf16_to_float(x));
  CHECK(nonfinite == 0);
  std::printf("[prefill long 8192] worst spot-checked row: %.3e (tolerance 1e-2), non-finite outputs %zu\n", worst,
              nonfinite);
}

// One decode case on the device (inputs from `seed`, its own workspace), run under switch settings: the outputs,
// written over a poisoned output buffer.
struct DecodeSwitchRun {
  const AttnCase& c;
  std::vector<Seq> seqs;
  AttnSetup s;
  gpu::AttnDecodeWorkspace ws;
  DecodeSwitchRun(const AttnCase& cs, uint32_t seed) : c(cs) {
    std::mt19937 rng(seed);
    build_case(c, rng, seqs, s);
  }
  gpu::AttnDecodeWorkspace* ws_override = nullptr;  // another run's workspace (the PDL ordering check)
  std::vector<bf16> run(std::initializer_list<std::pair<const char*, bool>> switches) {
    std::vector<std::unique_ptr<ScopedCandidate>> set;
    for (const auto& [name, on] : switches) set.push_back(std::make_unique<ScopedCandidate>(name, on));
    s.dout->poison();
    run_attention(c, s, ws_override ? ws_override : &ws);
    check_cuda(cudaDeviceSynchronize(), c.name);
    return s.dout->download();
  }
};

TEST_CASE("attention_decode matches attention_causal: batches 1/5/33, contexts 1 .. 20000", "[gpu][attention]") {
  require_gpu();
  const std::vector<int> mixed = {1, 63, 64, 1000, 20000};
  SECTION("batch 1, context 20000, hd 256 16/2, gate") {
    run_attention_case(decode_case("decode b1 hd256 16/2 gate", 256, 16, 2, {20000}, true), 401);
  }
  SECTION("batch 5, mixed contexts, hd 64 4/4, no gate") {
    run_attention_case(decode_case("decode b5 hd64 4/4", 64, 4, 4, mixed, false), 402);
  }
  SECTION("batch 5, mixed contexts, hd 128 8/2, gate") {
    run_attention_case(decode_case("decode b5 hd128 8/2 gate", 128, 8, 2, mixed, true), 403);
  }
  SECTION("batch 5, mixed contexts, hd 256 16/2, gate") {
    run_attention_case(decode_case("decode b5 hd256 16/2 gate", 256, 16, 2, {20000, 1, 1000, 64, 63}, true), 404);
  }
  SECTION("batch 33, mixed contexts, hd 256 16/2, gate") {
    std::vector<int> ctx;
    for (int i = 0; i < 33; ++i) ctx.push_back(mixed[(i * 3) % 5] + (i % 7));  // 1 .. 20006, mixed order
    run_attention_case(decode_case("decode b33 hd256 16/2 gate", 256, 16, 2, ctx, true), 405);
  }
  SECTION("batch 5, GQA 32 (32/1: two head blocks per KV head), hd 64, gate") {
    run_attention_case(decode_case("decode b5 hd64 32/1 gate", 64, 32, 1, mixed, true), 406);
  }
  SECTION("batch 5, hd 128 8/2, max_kv understated (64): the last chunk covers the rest") {
    AttnCase c = decode_case("decode b5 hd128 max_kv 64", 128, 8, 2, mixed, true);
    c.max_kv_override = 64;
    run_attention_case(c, 407);
  }
  // The split-KV combine over four thread groups (HYPIC_ATTN_COMBINE_GROUPS): fewer chunks than groups (context 1,
  // 63), a few, and hundreds (20000 slots), every head size.
  const std::vector<AttnCase> grouped = {decode_case("decode b1 hd256 16/2 gate, grouped combine", 256, 16, 2, {20000}, true),
                                         decode_case("decode b5 hd128 8/2 gate, grouped combine", 128, 8, 2, mixed, true),
                                         decode_case("decode b5 hd64 32/1 gate, grouped combine", 64, 32, 1, mixed, true)};
  for (size_t i = 0; i < grouped.size(); ++i)
    DYNAMIC_SECTION(grouped[i].name) {
      const AttnCase& c = grouped[i];
      DecodeSwitchRun r(c, 408 + uint32_t(i));
      const auto one = r.run({{"HYPIC_ATTN_COMBINE_GROUPS", false}});
      const auto four = r.run({{"HYPIC_ATTN_COMBINE_GROUPS", true}});
      // Against the one-group combine: only the fp32 order of the chunk sums differs, so two fp32 values a few ulps
      // apart, which round to the same bf16 or to neighbours: at most one bf16 ulp apart (2^-7 of the value at the
      // bottom of a binade; 2^-8 failed there once the wave plan's chunks were the default), plus the summation's few
      // fp32 ulps of the row's scale.
      size_t far = 0;
      for (size_t e = 0; e < one.size(); ++e) {
        const float a = bf16_to_float(four[e]), b = bf16_to_float(one[e]);
        far += !(std::fabs(a - b) <= std::ldexp(std::fabs(b), -7) + 1e-6f);
      }
      std::printf("[%s] vs the one-group combine: %zu of %zu outputs beyond one bf16 rounding\n", c.name.c_str(), far,
                  one.size());
      CHECK(far == 0);
      check_against_cpu(c, r.seqs, r.s, four);
    }
  // The decode split sized by waves of resident blocks (HYPIC_ATTN_DECODE_WAVES): never more chunks than the default
  // plan, the outputs against the CPU either way (other chunk bounds: another fp32 order in the combine). The first
  // case is the benchmark's batch 16 over 32k-slot contexts, where an H200's plan goes from 9 chunks to 4. And the
  // L2 prefetch ahead of the KV ring (HYPIC_ATTN_DECODE_L2_AHEAD, a hint) bit for bit against the plain run.
  const std::vector<AttnCase> waves = {
      decode_case("decode b16 hd256 16/2 gate, 32768 slots, wave plan", 256, 16, 2, std::vector<int>(16, 32768), true),
      decode_case("decode b1 hd256 16/2 gate, wave plan", 256, 16, 2, {20000}, true),
      decode_case("decode b5 hd128 8/2 gate, wave plan", 128, 8, 2, mixed, true),
      decode_case("decode b5 hd64 32/1 gate, wave plan", 64, 32, 1, mixed, true),
      decode_case("decode b3 hd256 16/2 gate, short contexts, wave plan", 256, 16, 2, {100, 1, 64}, true)};
  for (size_t i = 0; i < waves.size(); ++i)
    DYNAMIC_SECTION(waves[i].name) {
      const AttnCase& c = waves[i];
      DecodeSwitchRun r(c, 420 + uint32_t(i));
      const int batch = static_cast<int>(c.seq_kv.size());
      const int max_kv = *std::max_element(c.seq_kv.begin(), c.seq_kv.end());
      int splits[2] = {0, 0};
      for (bool on : {false, true}) {
        ScopedCandidate sw("HYPIC_ATTN_DECODE_WAVES", on), ds("HYPIC_ATTN_DECODE_D_SPLIT", false);
        splits[on] = gpu::attention_decode_splits(batch, c.nh, c.nkv, c.hd, max_kv);
        std::printf("[%s] HYPIC_ATTN_DECODE_WAVES=%d: %d chunks per context\n", c.name.c_str(), int(on), splits[on]);
      }
      // (every switch named: HYPIC_CANDIDATES=1 turns the others on)
      const auto plain = r.run({{"HYPIC_ATTN_DECODE_WAVES", false}, {"HYPIC_ATTN_DECODE_L2_AHEAD", false},
                                {"HYPIC_ATTN_DECODE_D_SPLIT", false}});
      check_against_cpu(c, r.seqs, r.s, plain);
      check_against_cpu(c, r.seqs, r.s,
                        r.run({{"HYPIC_ATTN_DECODE_WAVES", true}, {"HYPIC_ATTN_DECODE_L2_AHEAD", false},
                               {"HYPIC_ATTN_DECODE_D_SPLIT", false}}));
      const auto ahead = r.run({{"HYPIC_ATTN_DECODE_WAVES", false}, {"HYPIC_ATTN_DECODE_L2_AHEAD", true},
                                {"HYPIC_ATTN_DECODE_D_SPLIT", false}});
      const bool same = ahead.size() == plain.size() &&
                        std::memcmp(ahead.data(), plain.data(), ahead.size() * sizeof(bf16)) == 0;
      std::printf("[%s] HYPIC_ATTN_DECODE_L2_AHEAD=1 == off: %s\n", c.name.c_str(), same ? "yes" : "NO");
      CHECK(same);
      // The 8-warp kernel (HYPIC_ATTN_DECODE_D_SPLIT: warp pairs share a slot quarter, each the P V of half the head
      // dim): the same products per output, so the same bits when its plan has the same chunks (the same resident
      // blocks per SM; else against the CPU), alone and with the L2 prefetch.
      int dsplit_splits = 0;
      {
        ScopedCandidate sw("HYPIC_ATTN_DECODE_D_SPLIT", true), wv("HYPIC_ATTN_DECODE_WAVES", false);
        dsplit_splits = gpu::attention_decode_splits(batch, c.nh, c.nkv, c.hd, max_kv);
      }
      CHECK(dsplit_splits == splits[0]);  // the same resident blocks per SM (shared memory decides on sm_90)
      for (bool l2 : {false, true}) {
        const auto dsplit = r.run({{"HYPIC_ATTN_DECODE_WAVES", false}, {"HYPIC_ATTN_DECODE_L2_AHEAD", l2},
                                   {"HYPIC_ATTN_DECODE_D_SPLIT", true}});
        if (dsplit_splits == splits[0]) {
          const bool same_ds = dsplit.size() == plain.size() &&
                               std::memcmp(dsplit.data(), plain.data(), dsplit.size() * sizeof(bf16)) == 0;
          std::printf("[%s] HYPIC_ATTN_DECODE_D_SPLIT=1 (L2 ahead %s) == off: %s\n", c.name.c_str(),
                      l2 ? "on" : "off", same_ds ? "yes" : "NO");
          CHECK(same_ds);
        } else {
          std::printf("[%s] HYPIC_ATTN_DECODE_D_SPLIT=1: %d chunks against %d: checked against the CPU\n",
                      c.name.c_str(), dsplit_splits, splits[0]);
          check_against_cpu(c, r.seqs, r.s, dsplit);
        }
      }
      CHECK(splits[1] >= 1);
      CHECK(splits[1] <= splits[0]);
      int sms = 0;
      check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "SM count");
      if (i == 0 && sms == 132) {  // H100 SXM / H200: one block per SM at hd 256, 9 chunks (3 waves) -> 4 (1 wave)
        CHECK(splits[0] == 9);
        CHECK(splits[1] == 4);
      }
    }
}

// Each request's KV chunks cut from its own length (HYPIC_ATTN_DECODE_SEQ_CHUNKS) against the CPU: max_kv as the
// CUDA backend passes it (the block table's power-of-two width, up to twice the longest context: the planned chunks
// past a request's length were empty before), exact, understated (one chunk takes the rest), mixed lengths where the
// short requests get chunks of a tile, the grouped combine; and each launched with PDL, bit for bit.
TEST_CASE("attention_decode with per-request KV chunks matches attention_causal", "[gpu][attention]") {
  require_gpu();
  const std::vector<int> mixed = {1, 63, 64, 1000, 20000};
  struct Run {
    AttnCase c;
    bool grouped;
  };
  std::vector<Run> runs;
  auto add = [&](AttnCase c, int max_kv, bool grouped) {
    c.max_kv_override = max_kv;
    runs.push_back({std::move(c), grouped});
  };
  add(decode_case("decode b16 hd256 16/2 gate, 32784 slots, max_kv 65536", 256, 16, 2, std::vector<int>(16, 32784),
                  true), 65536, false);
  add(decode_case("decode b1 hd256 16/2 gate, 20000 slots, max_kv 32768", 256, 16, 2, {20000}, true), 32768, false);
  add(decode_case("decode b5 hd128 8/2 gate, mixed, max_kv 32768", 128, 8, 2, mixed, true), 32768, false);
  add(decode_case("decode b5 hd64 32/1 gate, mixed, exact max_kv", 64, 32, 1, mixed, true), 0, false);
  add(decode_case("decode b5 hd128 8/2 gate, mixed, max_kv 64 (understated)", 128, 8, 2, mixed, true), 64, false);
  add(decode_case("decode b5 hd128 8/2 gate, mixed, max_kv 4096 (understated, split)", 128, 8, 2, mixed, true), 4096,
      false);
  add(decode_case("decode b5 hd256 16/2 gate, mixed, max_kv 32768, grouped combine", 256, 16, 2, mixed, true), 32768,
      true);
  add(decode_case("decode b3 hd256 16/2 gate, short, max_kv 256", 256, 16, 2, {100, 1, 64}, true), 256, false);
  for (size_t i = 0; i < runs.size(); ++i)
    DYNAMIC_SECTION(runs[i].c.name) {
      const AttnCase& c = runs[i].c;
      DecodeSwitchRun r(c, 440 + uint32_t(i));
      const auto on = r.run({{"HYPIC_ATTN_DECODE_SEQ_CHUNKS", true}, {"HYPIC_ATTN_COMBINE_GROUPS", runs[i].grouped},
                             {"HYPIC_ATTN_DECODE_WAVES", false}, {"HYPIC_ATTN_DECODE_D_SPLIT", false},
                             {"HYPIC_DECODE_PDL_MIXERS", false}});
      check_against_cpu(c, r.seqs, r.s, on);
      // The same launches with programmatic dependent launch (HYPIC_DECODE_PDL_MIXERS): the same bits. In between,
      // other inputs of the same shape run through this workspace, so that a combine reading the chunks' partials
      // before the decode kernel wrote them would see the other run's and give other bits.
      DecodeSwitchRun other(c, 540 + uint32_t(i));
      other.ws_override = &r.ws;
      other.run({{"HYPIC_ATTN_DECODE_SEQ_CHUNKS", true}, {"HYPIC_ATTN_COMBINE_GROUPS", runs[i].grouped},
                 {"HYPIC_ATTN_DECODE_WAVES", false}, {"HYPIC_ATTN_DECODE_D_SPLIT", false},
                 {"HYPIC_DECODE_PDL_MIXERS", false}});
      const auto pdl = r.run({{"HYPIC_ATTN_DECODE_SEQ_CHUNKS", true}, {"HYPIC_ATTN_COMBINE_GROUPS", runs[i].grouped},
                              {"HYPIC_ATTN_DECODE_WAVES", false}, {"HYPIC_ATTN_DECODE_D_SPLIT", false},
                              {"HYPIC_DECODE_PDL_MIXERS", true}});
      CHECK(std::memcmp(pdl.data(), on.data(), on.size() * sizeof(bf16)) == 0);
      // The first KV tiles issued before the PDL wait (HYPIC_ATTN_DECODE_KV_EARLY with the kv_read_early promise: the
      // tiles without a request's last slot; Q and the rest after the wait, one commit group more): the same tiles in
      // the same slots, so the same bits, with per-request chunks and with the planned chunk length (other chunk
      // bounds: checked against the CPU and against its own run without the early tiles).
      AttnCase ce = c;
      ce.kv_read_early = true;
      DecodeSwitchRun re(ce, 440 + uint32_t(i));
      const auto early = re.run({{"HYPIC_ATTN_DECODE_SEQ_CHUNKS", true}, {"HYPIC_ATTN_COMBINE_GROUPS", runs[i].grouped},
                                 {"HYPIC_ATTN_DECODE_WAVES", false}, {"HYPIC_ATTN_DECODE_D_SPLIT", false},
                                 {"HYPIC_DECODE_PDL_MIXERS", true}, {"HYPIC_ATTN_DECODE_KV_EARLY", true}});
      const bool same_early = std::memcmp(early.data(), on.data(), on.size() * sizeof(bf16)) == 0;
      std::printf("[%s] HYPIC_ATTN_DECODE_KV_EARLY=1 == off: %s\n", c.name.c_str(), same_early ? "yes" : "NO");
      CHECK(same_early);
      for (bool ds : {false, true}) {
        auto sw = [&](bool kv_early) {
          return re.run({{"HYPIC_ATTN_DECODE_SEQ_CHUNKS", false}, {"HYPIC_ATTN_COMBINE_GROUPS", runs[i].grouped},
                         {"HYPIC_ATTN_DECODE_WAVES", false}, {"HYPIC_ATTN_DECODE_D_SPLIT", ds},
                         {"HYPIC_DECODE_PDL_MIXERS", true}, {"HYPIC_ATTN_DECODE_KV_EARLY", kv_early}});
        };
        const auto planned = sw(false), planned_early = sw(true);
        check_against_cpu(c, re.seqs, re.s, planned_early);
        const bool same_planned = std::memcmp(planned_early.data(), planned.data(), planned.size() * sizeof(bf16)) == 0;
        std::printf("[%s] planned chunks%s: HYPIC_ATTN_DECODE_KV_EARLY=1 == off: %s\n", c.name.c_str(),
                    ds ? ", HYPIC_ATTN_DECODE_D_SPLIT" : "", same_planned ? "yes" : "NO");
        CHECK(same_planned);
      }
    }
}

// HYPIC_ATTN_DECODE_KV_EARLY where it matters: attention_prepare writes each request's new KV row (poisoned with NaN
// before) and attention_decode follows it on the stream at once, both launched with PDL, the decode kernel issuing its
// early tiles while the prepare kernel may still run. An early tile holding a new row would read the poison (NaN
// outputs, other bits); the runs must give the bits of the same calls with a synchronisation between them. Contexts
// with the new row at a tile's first slot, inside a tile, past a few whole tiles and past many chunks' worth.
TEST_CASE("attention_decode right after attention_prepare with PDL and early KV tiles: same bits", "[gpu][attention]") {
  require_gpu();
  const std::vector<int> ctx = {1, 63, 64, 65, 130, 1000, 20000};
  const int B = int(ctx.size()), nh = 16, nkv = 2, hd = 256, rot = 64;
  AttnCase c = decode_case("decode b7 hd256 16/2 gate, after attention_prepare", hd, nh, nkv, ctx, true);
  c.kv_read_early = true;
  DecodeSwitchRun r(c, 470);
  AttnSetup& s = r.s;
  for (int b = 0; b < B; ++b) REQUIRE(s.q_start[b] == b);  // (prepare's q rows are the decode's query rows)
  std::mt19937 rng(471);
  std::vector<float> tmp;
  const size_t row = size_t(nkv) * hd;
  DeviceBuffer<bf16> dqg(random_bf16(rng, size_t(B) * nh * 2 * hd, 1.f, tmp)),
      dk(random_bf16(rng, size_t(B) * row, 1.f, tmp)), dv(random_bf16(rng, size_t(B) * row, 1.f, tmp)),
      dqw(random_bf16(rng, hd, 0.3f, tmp)), dkw(random_bf16(rng, hd, 0.3f, tmp)), dq(size_t(B) * nh * hd);
  const std::vector<int> bt = s.dbt->download();
  std::vector<int> rows(B);  // the pool row of each request's last slot (slot0[b])
  for (int b = 0; b < B; ++b)
    rows[b] = bt[size_t(b) * s.max_pages + s.slot0[b] / kPage] * kPage + s.slot0[b] % kPage;
  DeviceBuffer<int> dpos(s.slot0), drows(rows);
  DeviceBuffer<float> dinv(cpu::rope_inv_freq(1e7, rot));
  gpu::AttnGroups g = s.groups();
  const float scale = 1.0f / std::sqrt(float(hd));
  auto step = [&](bool early, bool sync_between) {
    ScopedCandidate pdl("HYPIC_DECODE_PDL_MIXERS", true), kv("HYPIC_ATTN_DECODE_KV_EARLY", early),
        seq("HYPIC_ATTN_DECODE_SEQ_CHUNKS", true);
    for (int b = 0; b < B; ++b) {  // the new rows poisoned (bf16 0xFFFF: NaN) until prepare writes them
      check_cuda(cudaMemset(s.dk->get() + size_t(rows[b]) * row, 0xFF, row * sizeof(bf16)), "poison K row");
      check_cuda(cudaMemset(s.dv->get() + size_t(rows[b]) * row, 0xFF, row * sizeof(bf16)), "poison V row");
    }
    s.dout->poison();
    check_cuda(cudaDeviceSynchronize(), "poison");
    gpu::attention_prepare(B, nh, nkv, hd, rot, true, dqg.get(), dk.get(), dv.get(), long(row), dqw.get(), dkw.get(),
                           1e-6f, dpos.get(), dinv.get(), drows.get(), dq.get(), s.dk->get(), s.dv->get());
    if (sync_between) check_cuda(cudaDeviceSynchronize(), "prepare");
    gpu::attention_decode(g, nh, nkv, hd, dq.get(), s.dk->get(), s.dv->get(), scale, dqg.get() + hd, long(nh) * 2 * hd,
                          2 * hd, s.dout->get(), r.ws, nullptr, /*kv_read_early=*/true);
    check_cuda(cudaDeviceSynchronize(), "decode");
    return s.dout->download();
  };
  const auto ref = step(false, true);
  size_t nonfinite = 0;
  for (bf16 x : ref) nonfinite += !std::isfinite(bf16_to_float(x));
  CHECK(nonfinite == 0);  // (the poison is overwritten before the synchronised decode reads it)
  int same = 0;
  const int reps = 8;
  for (int i = 0; i < reps; ++i) {
    const auto early = step(true, false);
    same += early.size() == ref.size() && std::memcmp(early.data(), ref.data(), ref.size() * sizeof(bf16)) == 0;
  }
  const auto plain = step(false, false);
  std::printf("[%s] early KV tiles right after prepare: %d of %d runs bit-identical to the synchronised calls\n",
              c.name.c_str(), same, reps);
  CHECK(same == reps);
  CHECK(std::memcmp(plain.data(), ref.data(), ref.size() * sizeof(bf16)) == 0);
}

TEST_CASE("attention_prefill and attention_decode replay from CUDA graphs bit for bit", "[gpu][attention]") {
  require_gpu();
  SECTION("prefill") {
    AttnCase c = own_sequences("graph prefill hd256", 256, 16, 2, {{200, 70}, {3, 0}, {65, 1000}}, true);
    std::mt19937 rng(501);
    std::vector<Seq> seqs;
    AttnSetup s;
    build_case(c, rng, seqs, s);
    run_attention(c, s, nullptr);
    check_cuda(cudaDeviceSynchronize(), "eager prefill");
    const auto eager = s.dout->download();
    s.dout->poison();
    Graph gr;
    gr.capture([&] { run_attention(c, s, nullptr, gr.st); });
    gr.replay();
    const auto replayed = s.dout->download();
    CHECK(std::memcmp(eager.data(), replayed.data(), eager.size() * sizeof(bf16)) == 0);
    check_against_cpu(c, seqs, s, replayed);
  }
  SECTION("decode, reserved workspace; growth during capture throws") {
    AttnCase c = decode_case("graph decode hd256", 256, 16, 2, {5000, 1, 130, 20000}, true);
    std::mt19937 rng(502);
    std::vector<Seq> seqs;
    AttnSetup s;
    build_case(c, rng, seqs, s);
    gpu::AttnDecodeWorkspace ws;
    ws.reserve(4, 16, 256, 20000);
    const size_t reserved = ws.bytes();
    run_attention(c, s, &ws);
    check_cuda(cudaDeviceSynchronize(), "eager decode");
    CHECK(ws.bytes() == reserved);  // the reserve sufficed: nothing allocated
    const auto eager = s.dout->download();
    s.dout->poison();
    Graph gr;
    gr.capture([&] { run_attention(c, s, &ws, gr.st); });
    gr.replay();
    const auto replayed = s.dout->download();
    CHECK(std::memcmp(eager.data(), replayed.data(), eager.size() * sizeof(bf16)) == 0);
    check_against_cpu(c, seqs, s, replayed);
    // A fresh (empty) workspace would have to allocate inside the capture.
    gpu::AttnDecodeWorkspace empty;
    cudaStream_t st;
    check_cuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "begin capture");
    CHECK_THROWS_WITH(run_attention(c, s, &empty, st), Catch::Contains("during CUDA graph capture"));
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(st, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaStreamDestroy(st);
    (void)cudaGetLastError();
  }
}

// -------------------------------------------------------------------------------------------------------
namespace {

// Per head row comparison of a bf16 result against its reference (both as fp32 values).
struct RowStats {
  double worst = 0;  // max over rows of max|d| / max|ref row|
  size_t equal = 0, total = 0, nonfinite = 0;
  void add(const float* got, const float* ref, int n) {
    double md = 0, mr = 0;
    for (int i = 0; i < n; ++i) {
      if (!std::isfinite(got[i])) ++nonfinite;
      md = std::max(md, double(std::fabs(got[i] - ref[i])));
      mr = std::max(mr, double(std::fabs(ref[i])));
      equal += got[i] == ref[i];
    }
    total += n;
    worst = std::max(worst, nonfinite ? INFINITY : md / std::max(mr, 1e-30));
  }
  double equal_fraction() const { return total ? double(equal) / total : 1.0; }
};

// The reference of one q or k head row: zero-centred RMSNorm (fp32) rounded to bf16, then RoPE at `pos`
// in fp32 rounded to bf16.
void prepare_ref(const float* x, const std::vector<float>& w, int hd, float eps, const std::vector<float>& inv_freq,
                 int pos, float* y) {
  cpu::rms_norm_zero_centred(1, hd, x, w.data(), eps, y);
  for (int d = 0; d < hd; ++d) y[d] = bfr(y[d]);
  if (!inv_freq.empty()) {
    cpu::apply_rope(y, 1, 1, hd, inv_freq, pos);
    for (int d = 0; d < hd; ++d) y[d] = bfr(y[d]);
  }
}

struct PrepareCase {
  std::string name;
  int T, nh, nkv, hd, rot;
  bool gate;
  int stride_extra;  // kv_in_stride = 2 * nkv * hd + stride_extra (k and v interleaved in one buffer)
  int max_pos;
};

void run_prepare_case(const PrepareCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const float eps = 1e-6f;
  const int qhs = (c.gate ? 2 : 1) * c.hd;
  const long kvs = 2L * c.nkv * c.hd + c.stride_extra;
  std::vector<float> qgf, kvf, qwf, kwf;
  const auto qg = random_bf16(rng, size_t(c.T) * c.nh * qhs, 1.5f, qgf);
  const auto kv = random_bf16(rng, size_t(c.T) * kvs + 8, 1.5f, kvf);
  const auto qw = random_bf16(rng, c.hd, 0.3f, qwf);
  const auto kw = random_bf16(rng, c.hd, 0.3f, kwf);
  std::uniform_int_distribution<int> upos(0, c.max_pos - 1);
  std::vector<int> pos(c.T);
  for (auto& p : pos) p = upos(rng);
  pos[0] = 0;
  const auto inv = c.rot ? cpu::rope_inv_freq(1e7, c.rot) : std::vector<float>{};
  const int pages = (c.T + kPage - 1) / kPage + 2;
  std::vector<int> rows(size_t(pages) * kPage);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  rows.resize(c.T);
  const size_t pool_elems = size_t(pages) * kPage * c.nkv * c.hd;

  DeviceBuffer<bf16> dqg(qg), dkv(kv), dqw(qw), dkw(kw), dq(size_t(c.T) * c.nh * c.hd), dk(pool_elems),
      dv(pool_elems);
  DeviceBuffer<int> dpos(pos), drows(rows);
  DeviceBuffer<float> dinv(inv.empty() ? std::vector<float>{0.f} : inv);
  // Both RoPE paths (the per-position angle table, HYPIC_ROPE_TABLE, with several heads per warp at large T; and the
  // trig per element): the same arithmetic, so the same bits.
  auto prepare = [&](bool table) {
    ScopedCandidate sw("HYPIC_ROPE_TABLE", table);
    dq.poison();
    dk.poison();
    dv.poison();
    gpu::attention_prepare(c.T, c.nh, c.nkv, c.hd, c.rot, c.gate, dqg.get(), dkv.get(), dkv.get() + c.nkv * c.hd,
                           kvs, dqw.get(), dkw.get(), eps, dpos.get(), c.rot ? dinv.get() : nullptr, drows.get(),
                           dq.get(), dk.get(), dv.get());
    check_cuda(cudaDeviceSynchronize(), c.name);
    return std::make_tuple(dq.download(), dk.download(), dv.download());
  };
  const auto [q0, k0, v0] = prepare(false);
  const auto [q, k, v] = prepare(true);
  const bool table_same = same_bits(q0, q) && same_bits(k0, k) && same_bits(v0, v);
  std::printf("[%s] angle table vs trig per element: %s\n", c.name.c_str(), table_same ? "bit-identical" : "DIFFER");
  CHECK(table_same);

  RowStats qs, ks;
  size_t v_mismatch = 0, stray = 0;
  std::vector<float> y(c.hd), got(c.hd);
  std::vector<char> written(size_t(pages) * kPage, 0);
  for (int t = 0; t < c.T; ++t) {
    written[rows[t]] = 1;
    for (int h = 0; h < c.nh; ++h) {
      prepare_ref(&qgf[(size_t(t) * c.nh + h) * qhs], qwf, c.hd, eps, inv, pos[t], y.data());
      for (int d = 0; d < c.hd; ++d) got[d] = bf16_to_float(q[(size_t(t) * c.nh + h) * c.hd + d]);
      qs.add(got.data(), y.data(), c.hd);
    }
    for (int h = 0; h < c.nkv; ++h) {
      prepare_ref(&kvf[size_t(t) * kvs + size_t(h) * c.hd], kwf, c.hd, eps, inv, pos[t], y.data());
      const size_t dst = (size_t(rows[t]) * c.nkv + h) * c.hd;
      for (int d = 0; d < c.hd; ++d) got[d] = bf16_to_float(k[dst + d]);
      ks.add(got.data(), y.data(), c.hd);
      for (int d = 0; d < c.hd; ++d)
        v_mismatch += bits(v[dst + d]) != bits(kv[size_t(t) * kvs + size_t(c.nkv + h) * c.hd + d]);
    }
  }
  for (size_t r = 0; r < written.size(); ++r)
    if (!written[r])
      for (size_t e = 0; e < size_t(c.nkv) * c.hd; ++e)
        stray += bits(k[r * c.nkv * c.hd + e]) != 0xFFFF || bits(v[r * c.nkv * c.hd + e]) != 0xFFFF;
  std::printf("[%s] q: worst row max|d|/max|ref| %.3e, bitwise equal %.4f; k: %.3e, %.4f; v mismatches %zu; "
              "stray pool writes %zu\n",
              c.name.c_str(), qs.worst, qs.equal_fraction(), ks.worst, ks.equal_fraction(), v_mismatch, stray);
  std::fflush(stdout);
  INFO(c.name);
  CHECK(qs.nonfinite == 0);
  CHECK(ks.nonfinite == 0);
  CHECK(qs.worst <= 1.0 / 64);
  CHECK(ks.worst <= 1.0 / 64);
  CHECK(qs.equal_fraction() >= 0.95);
  CHECK(ks.equal_fraction() >= 0.95);
  CHECK(v_mismatch == 0);
  CHECK(stray == 0);
}

}  // namespace

TEST_CASE("attention_prepare matches zero-centred RMSNorm + partial NeoX RoPE and writes the pool rows",
          "[gpu][attention]") {
  require_gpu();
  SECTION("hd 256, 16/2 heads, rotary 64 (Qwen3-Next), output gate, aligned stride") {
    run_prepare_case({"prepare hd256 rot64 gate", 37, 16, 2, 256, 64, true, 0, 200000}, 601);
  }
  SECTION("hd 128, 8/2 heads, full rotary, no gate, stride +8") {
    run_prepare_case({"prepare hd128 rot128", 70, 8, 2, 128, 128, false, 8, 40000}, 602);
  }
  SECTION("hd 64, 4/4 heads, rotary 32, gate, odd stride (scalar loads)") {
    run_prepare_case({"prepare hd64 rot32 odd stride", 65, 4, 4, 64, 32, true, 1, 5000}, 603);
  }
  SECTION("hd 128, 4/1 heads, no rotary") { run_prepare_case({"prepare hd128 rot0", 9, 4, 1, 128, 0, true, 0, 10}, 604); }
  // Enough tokens that the table path gives each warp several heads of a token (attention_prepare: heads per item
  // from 32 warps per SM; 12 of the 18 at T = 3000 on 132 SMs, all 18 at 5000, all 10 at 9000).
  const std::vector<PrepareCase> many_tokens = {
      {"prepare hd256 rot64 gate T3000", 3000, 16, 2, 256, 64, true, 0, 262144},
      {"prepare hd256 rot64 gate T5000", 5000, 16, 2, 256, 64, true, 0, 32768},
      {"prepare hd128 rot128 stride+8 T9000", 9000, 8, 2, 128, 128, false, 8, 100000}};
  for (size_t i = 0; i < many_tokens.size(); ++i)
    DYNAMIC_SECTION(many_tokens[i].name) { run_prepare_case(many_tokens[i], 605 + uint32_t(i)); }
}

namespace {

// kv_import of n rows in runs of 1 .. max_run rows (each run: consecutive source rows from a random place, one delta;
// every fifth run delta 0, every third one repeating the previous run's delta), against apply_rope_uniform, with the
// angles from the per-delta table (HYPIC_ROPE_TABLE) and from the trig per element: the same bits.
void run_import_case(const std::string& name, int n, int nkv, int hd, int rot, bool misaligned, uint32_t seed,
                     int max_run = 1) {
  std::mt19937 rng(seed);
  const size_t row = size_t(nkv) * hd;
  std::vector<float> kf, vf;
  const auto kh = random_bf16(rng, size_t(n) * row + 8, 1.0f, kf);
  const auto vh = random_bf16(rng, size_t(n) * row + 8, 1.0f, vf);
  const size_t base = misaligned ? 1 : 0;  // 2-byte aligned rows: the scalar path
  std::uniform_int_distribution<int> ud(-5000, 5000), ulen(1, max_run);
  std::vector<int> run_start{0}, run_src, run_delta;  // run r: rows run_start[r] .., source rows run_src[r] ..
  while (run_start.back() < n) {
    const int len = std::min(ulen(rng), n - run_start.back()), r = int(run_delta.size());
    run_src.push_back(std::uniform_int_distribution<int>(0, n - len)(rng));
    run_delta.push_back(r % 5 == 0 ? 0 : r % 3 == 0 && r > 0 ? run_delta.back() : ud(rng));
    run_start.push_back(run_start.back() + len);
  }
  const int runs = int(run_delta.size());
  std::vector<int> src(n), deltas(n);
  for (int r = 0; r < runs; ++r)
    for (int i = run_start[r]; i < run_start[r + 1]; ++i) src[i] = run_src[r] + (i - run_start[r]), deltas[i] = run_delta[r];
  const int pages = (n + kPage - 1) / kPage + 1;
  std::vector<int> rows(size_t(pages) * kPage);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  rows.resize(n);
  const auto inv = rot ? cpu::rope_inv_freq(1e7, rot) : std::vector<float>{};

  DeviceBuffer<bf16> dks(kh), dvs(vh), dk(size_t(pages) * kPage * row), dv(dk.size());
  std::vector<const bf16*> kp(runs), vp(runs);
  for (int r = 0; r < runs; ++r) {
    kp[r] = dks.get() + base + size_t(run_src[r]) * row;
    vp[r] = dvs.get() + base + size_t(run_src[r]) * row;
  }
  DeviceBuffer<const bf16*> dkp(kp), dvp(vp);
  DeviceBuffer<int> ddel(run_delta), drows(rows), dstart(run_start);
  DeviceBuffer<float> dinv(inv.empty() ? std::vector<float>{0.f} : inv);
  auto import = [&](bool table) {
    ScopedCandidate sw("HYPIC_ROPE_TABLE", table);
    dk.poison();
    dv.poison();
    gpu::kv_import(n, runs, nkv, hd, rot, dstart.get(), dkp.get(), dvp.get(), ddel.get(), rot ? dinv.get() : nullptr,
                   drows.get(), dk.get(), dv.get());
    check_cuda(cudaDeviceSynchronize(), name);
    return std::make_pair(dk.download(), dv.download());
  };
  const auto [k0, v0] = import(false);
  const auto [k, v] = import(true);
  const bool table_same = same_bits(k0, k) && same_bits(v0, v);
  RowStats ks;
  size_t v_mismatch = 0, zero_delta_mismatch = 0;
  std::vector<float> y(row), got(row);
  for (int i = 0; i < n; ++i) {
    const size_t s = base + size_t(src[i]) * row, dst = size_t(rows[i]) * row;
    std::copy(kf.begin() + s, kf.begin() + s + row, y.begin());
    if (rot) cpu::apply_rope_uniform(y.data(), 1, nkv, hd, inv, deltas[i]);
    for (size_t e = 0; e < row; ++e) {
      y[e] = bfr(y[e]);
      got[e] = bf16_to_float(k[dst + e]);
      v_mismatch += bits(v[dst + e]) != bits(vh[s + e]);
      if (deltas[i] == 0) zero_delta_mismatch += bits(k[dst + e]) != bits(kh[s + e]);
    }
    for (int h = 0; h < nkv; ++h) ks.add(got.data() + h * hd, y.data() + h * hd, hd);
  }
  std::printf("[%s] %d runs: k: worst row max|d|/max|ref| %.3e, bitwise equal %.4f; delta-0 mismatches %zu; v "
              "mismatches %zu; angle table vs trig per element: %s\n",
              name.c_str(), runs, ks.worst, ks.equal_fraction(), zero_delta_mismatch, v_mismatch,
              table_same ? "bit-identical" : "DIFFER");
  std::fflush(stdout);
  INFO(name);
  CHECK(table_same);
  CHECK(ks.nonfinite == 0);
  CHECK(ks.worst <= 1.0 / 64);
  CHECK(ks.equal_fraction() >= 0.95);
  CHECK(zero_delta_mismatch == 0);
  CHECK(v_mismatch == 0);
}

}  // namespace

TEST_CASE("kv_import re-rotates cached K by position deltas like apply_rope_uniform", "[gpu][attention]") {
  require_gpu();
  SECTION("hd 256, 2 KV heads, rotary 64") { run_import_case("import hd256 rot64", 300, 2, 256, 64, false, 701); }
  SECTION("hd 128, 2 KV heads, full rotary, misaligned sources") {
    run_import_case("import hd128 rot128 misaligned", 130, 2, 128, 128, true, 702);
  }
  SECTION("hd 64, 4 KV heads, rotary 32") { run_import_case("import hd64 rot32", 65, 4, 64, 32, false, 703); }
  SECTION("hd 256, no rotary (plain copy)") { run_import_case("import hd256 rot0", 17, 2, 256, 0, false, 704); }
  SECTION("hd 256, 2 KV heads, rotary 64, runs of 1-40 rows") {
    run_import_case("import hd256 rot64 runs", 2000, 2, 256, 64, false, 705, 40);
  }
  SECTION("hd 128, 2 KV heads, full rotary, runs of 1-9 rows, misaligned") {
    run_import_case("import hd128 rot128 runs misaligned", 700, 2, 128, 128, true, 706, 9);
  }
}

TEST_CASE("kv_import(delta) after attention_prepare at p equals attention_prepare at p + delta", "[gpu][attention]") {
  require_gpu();
  for (int hd : {64, 256}) {
    DYNAMIC_SECTION("head_dim " << hd) {
      std::mt19937 rng(800 + hd);
      const int T = 150, nh = 4, nkv = 2, rot = hd / 4;
      const float eps = 1e-6f;
      const size_t row = size_t(nkv) * hd;
      std::vector<float> tmp;
      const auto qg = random_bf16(rng, size_t(T) * nh * hd, 1.f, tmp);
      const auto k = random_bf16(rng, size_t(T) * row, 1.f, tmp);
      const auto v = random_bf16(rng, size_t(T) * row, 1.f, tmp);
      const auto qw = random_bf16(rng, hd, 0.3f, tmp), kw = random_bf16(rng, hd, 0.3f, tmp);
      std::uniform_int_distribution<int> up(0, 2999), ud(-2000, 2000);
      std::vector<int> p(T), d(T), pd(T), rows(T);
      for (int t = 0; t < T; ++t) {
        p[t] = up(rng);
        d[t] = std::max(ud(rng), -p[t]);
        pd[t] = p[t] + d[t];
        rows[t] = t;
      }
      const auto inv = cpu::rope_inv_freq(1e7, rot);
      DeviceBuffer<bf16> dqg(qg), dk(k), dv(v), dqw(qw), dkw(kw), dq(qg.size());
      DeviceBuffer<bf16> poolA_k(size_t(T + 64) * row), poolA_v(poolA_k.size()), poolB_k(poolA_k.size()),
          poolB_v(poolA_k.size()), poolC_k(poolA_k.size()), poolC_v(poolA_k.size());
      DeviceBuffer<int> dp(p), dd(d), dpd(pd), drows(rows);
      DeviceBuffer<float> dinv(inv);
      gpu::attention_prepare(T, nh, nkv, hd, rot, false, dqg.get(), dk.get(), dv.get(), long(row), dqw.get(),
                             dkw.get(), eps, dp.get(), dinv.get(), drows.get(), dq.get(), poolA_k.get(),
                             poolA_v.get());
      gpu::attention_prepare(T, nh, nkv, hd, rot, false, dqg.get(), dk.get(), dv.get(), long(row), dqw.get(),
                             dkw.get(), eps, dpd.get(), dinv.get(), drows.get(), dq.get(), poolC_k.get(),
                             poolC_v.get());
      std::vector<const bf16*> kp(T), vp(T);
      for (int t = 0; t < T; ++t) {
        kp[t] = poolA_k.get() + size_t(t) * row;
        vp[t] = poolA_v.get() + size_t(t) * row;
      }
      DeviceBuffer<const bf16*> dkp(kp), dvp(vp);
      std::vector<int> one_row_runs(T + 1);  // per-row deltas: every row its own run
      std::iota(one_row_runs.begin(), one_row_runs.end(), 0);
      DeviceBuffer<int> dstart(one_row_runs);
      gpu::kv_import(T, T, nkv, hd, rot, dstart.get(), dkp.get(), dvp.get(), dd.get(), dinv.get(), drows.get(),
                     poolB_k.get(), poolB_v.get());
      check_cuda(cudaDeviceSynchronize(), "prepare / import composition");
      const auto B = poolB_k.download(), C = poolC_k.download(), BV = poolB_v.download(), CV = poolC_v.download();
      RowStats st;
      std::vector<float> b(hd), c(hd);
      size_t v_mismatch = 0;
      for (size_t r = 0; r < size_t(T) * nkv; ++r) {
        for (int e = 0; e < hd; ++e) {
          b[e] = bf16_to_float(B[r * hd + e]);
          c[e] = bf16_to_float(C[r * hd + e]);
          v_mismatch += bits(BV[r * hd + e]) != bits(CV[r * hd + e]);
        }
        st.add(b.data(), c.data(), hd);
      }
      std::printf("[compose hd%d] kv_import(delta) o prepare(p) vs prepare(p + delta): worst row max|d|/max|ref| "
                  "%.3e, bitwise equal %.4f, v mismatches %zu\n",
                  hd, st.worst, st.equal_fraction(), v_mismatch);
      CHECK(st.nonfinite == 0);
      CHECK(st.worst <= 1.0 / 64);
      CHECK(v_mismatch == 0);
    }
  }
}

TEST_CASE("attention_key_mass matches attention_causal's key_mass: GQA, pages out of order, contexts 1 .. 3000",
          "[gpu][attention]") {
  require_gpu();
  std::mt19937 rng(77);
  std::normal_distribution<float> nd;
  struct Case { int nh, nkv, hd, slot0, tq; };
  for (const Case c : {Case{4, 4, 64, 0, 1}, Case{16, 2, 256, 200, 7}, Case{8, 2, 128, 2990, 10}, Case{4, 1, 128, 63, 65}}) {
    const int n = c.slot0 + c.tq, pages = (n + kPage - 1) / kPage;
    // Pages in shuffled order inside a pool with spare pages.
    std::vector<int> table(pages);
    std::iota(table.begin(), table.end(), 0);
    for (int& t : table) t = t * 2 + 1;
    std::shuffle(table.begin(), table.end(), rng);
    const int pool_pages = 2 * pages + 1;
    std::vector<bf16> kpool(size_t(pool_pages) * kPage * c.nkv * c.hd, float_to_bf16(0.f));
    std::vector<float> kdense(size_t(n) * c.nkv * c.hd), q(size_t(c.tq) * c.nh * c.hd);
    for (int j = 0; j < n; ++j)
      for (int e = 0; e < c.nkv * c.hd; ++e) {
        const float x = bfr(nd(rng));
        kdense[size_t(j) * c.nkv * c.hd + e] = x;
        kpool[(size_t(table[j / kPage]) * kPage + j % kPage) * c.nkv * c.hd + e] = float_to_bf16(x);
      }
    std::vector<bf16> qb(q.size());
    for (size_t i = 0; i < q.size(); ++i) qb[i] = float_to_bf16(q[i] = bfr(nd(rng)));
    const float scale = 1.f / std::sqrt(float(c.hd));
    // CPU reference: the kernel's contract is cpu::attention_causal's key_mass (V is irrelevant to it).
    std::vector<float> vdense(kdense.size(), 0.f), out(size_t(c.tq) * c.nh * c.hd), want(n, 0.5f);
    hypic::kernels::cpu::attention_causal({c.tq, n, c.nh, c.nkv, c.hd}, q.data(), kdense.data(), vdense.data(), scale,
                                          out.data(), want.data());
    DeviceBuffer<bf16> dk(kpool), dq(qb);
    DeviceBuffer<int> dt(table);
    std::vector<float> start(n, 0.5f);  // accumulates onto what is there
    DeviceBuffer<float> dm(start);
    gpu::attention_key_mass(c.tq, c.nh, c.nkv, c.hd, dq.get(), c.slot0, dt.get(), dk.get(), scale, dm.get());
    const std::vector<float> got = dm.download();
    double err = 0, total = 0;
    for (int j = 0; j < n; ++j) err = std::max(err, double(std::fabs(got[j] - want[j]))), total += got[j] - 0.5;
    INFO("heads " << c.nh << "/" << c.nkv << " hd " << c.hd << " slot0 " << c.slot0 << " queries " << c.tq);
    CHECK(err < 1e-4 * c.tq * c.nh + 1e-5);
    CHECK(total == Approx(double(c.tq) * c.nh).epsilon(1e-4));  // each (query, head) distributes probability 1
  }
  DeviceBuffer<float> dm(4);
  DeviceBuffer<bf16> buf(256);
  DeviceBuffer<int> ibuf(4);
  CHECK_THROWS_WITH(gpu::attention_key_mass(1, 6, 4, 64, buf.get(), 0, ibuf.get(), buf.get(), 1.f, dm.get()),
                    Catch::Contains("num_heads 6"));
  CHECK_THROWS_WITH(gpu::attention_key_mass(1, 4, 4, 64, nullptr, 0, ibuf.get(), buf.get(), 1.f, dm.get()),
                    Catch::Contains("null"));
}

TEST_CASE("attention kernels reject bad arguments with invalid_argument naming the value", "[gpu][attention]") {
  require_gpu();
  DeviceBuffer<bf16> buf(4096);
  DeviceBuffer<int> ibuf(64);
  check_cuda(cudaMemset(ibuf.get(), 0, 64 * sizeof(int)), "memset");
  gpu::AttnGroups g;
  g.num_groups = 1;
  g.q_start = ibuf.get();
  g.slot0 = ibuf.get();
  g.block_table = ibuf.get();
  g.max_pages = 1;
  g.total_q = 1;
  g.max_q = 1;
  g.max_kv = 1;
  bf16* p = buf.get();
  gpu::AttnDecodeWorkspace ws;
  using Catch::Contains;
  CHECK_THROWS_WITH(gpu::attention_prefill(g, 4, 4, 96, p, p, p, 1.f, nullptr, 0, 0, p), Contains("head_dim 96"));
  CHECK_THROWS_WITH(gpu::attention_decode(g, 4, 4, 96, p, p, p, 1.f, nullptr, 0, 0, p, ws), Contains("head_dim 96"));
  CHECK_THROWS_WITH(gpu::attention_prefill(g, 6, 4, 64, p, p, p, 1.f, nullptr, 0, 0, p), Contains("num_heads 6"));
  CHECK_THROWS_WITH(gpu::attention_prefill(g, 4, 4, 64, nullptr, p, p, 1.f, nullptr, 0, 0, p), Contains("q is null"));
  CHECK_THROWS_WITH(gpu::attention_prefill(g, 4, 4, 64, p, p, p, 1.f, nullptr, 0, 0, p + 1),
                    Contains("out is not 16-byte aligned"));
  gpu::AttnGroups neg = g;
  neg.num_groups = -1;
  CHECK_THROWS_WITH(gpu::attention_prefill(neg, 4, 4, 64, p, p, p, 1.f, nullptr, 0, 0, p), Contains("num_groups -1"));
  gpu::AttnGroups two = g;
  two.max_q = 2;
  two.total_q = 2;
  CHECK_THROWS_WITH(gpu::attention_decode(two, 4, 4, 64, p, p, p, 1.f, nullptr, 0, 0, p, ws), Contains("max_q 2"));
  CHECK_THROWS_WITH(gpu::attention_prepare(1, 4, 4, 64, 3, false, p, p, p, 256, p, p, 1e-6f, ibuf.get(), nullptr,
                                           ibuf.get(), p, p, p),
                    Contains("rotary_dim 3"));
  CHECK_THROWS_WITH(gpu::attention_prepare(1, 4, 4, 80, 0, false, p, p, p, 512, p, p, 1e-6f, ibuf.get(), nullptr,
                                           ibuf.get(), p, p, p),
                    Contains("head_dim 80"));
  CHECK_THROWS_WITH(gpu::kv_import(1, 1, 2, 256, 300, ibuf.get(), nullptr, nullptr, nullptr, nullptr, nullptr, p, p),
                    Contains("rotary_dim 300"));
  const int* ib = ibuf.get();
  CHECK_THROWS_WITH(gpu::kv_import(1, 1, 2, 256, 64, ib, nullptr, nullptr, ib, nullptr, ib, p, p),
                    Contains("inv_freq is null"));
  CHECK_THROWS_WITH(gpu::kv_import(3, 0, 2, 256, 64, ib, nullptr, nullptr, ib, nullptr, ib, p, p),
                    Contains("num_runs 0 for 3 rows"));
  CHECK_THROWS_WITH(gpu::kv_import(3, 1, 2, 256, 0, nullptr, nullptr, nullptr, ibuf.get(), nullptr, ibuf.get(), p, p),
                    Contains("run_start"));
  CHECK_THROWS_WITH(ws.reserve(0, 16, 256, 100), Contains("max_batch 0"));
  check_cuda(cudaDeviceSynchronize(), "nothing was launched");
}

// -------------------------------------------------------------------------------------------------------
// Benchmark (hidden: run with the tag "[.bench]" or "[attention_bench]"): 32k causal prefill, seam windows and
// the splice pattern (16 x 8 + 64 or 500 queries over 32k) without / with the workspace (split path), and
// decode at batch 1/16/64 with 32k contexts, head_dim 256, 16 query / 2 KV heads (Qwen3-Next, Qwen3.5-35B-A3B).
TEST_CASE("attention benchmark: 32k causal prefill and 32k-context decode, hd 256, 16/2 heads",
          "[.bench][attention_bench]") {
  require_gpu();
  const int hd = 256, nh = 16, nkv = 2;
  const float scale = 1.0f / std::sqrt(float(hd));
  cudaEvent_t e0, e1;
  check_cuda(cudaEventCreate(&e0), "event");
  check_cuda(cudaEventCreate(&e1), "event");
  auto time_ms = [&](int reps, auto&& fn) {
    fn();
    fn();
    check_cuda(cudaDeviceSynchronize(), "warm-up");
    check_cuda(cudaEventRecord(e0), "record");
    for (int i = 0; i < reps; ++i) fn();
    check_cuda(cudaEventRecord(e1), "record");
    check_cuda(cudaEventSynchronize(e1), "sync");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    return double(ms) / reps;
  };
  {  // prefill: one sequence of 32768 tokens at slot0 0 (pages contiguous; values: a byte pattern)
    const int T = 32768, pages = T / kPage;
    DeviceBuffer<bf16> q(size_t(T) * nh * hd), qg(size_t(T) * nh * 2 * hd), k(size_t(T) * nkv * hd),
        v(k.size()), out(q.size());
    check_cuda(cudaMemset(q.get(), 0x3C, q.size() * 2), "memset");
    check_cuda(cudaMemset(qg.get(), 0x3D, qg.size() * 2), "memset");
    check_cuda(cudaMemset(k.get(), 0x3B, k.size() * 2), "memset");
    check_cuda(cudaMemset(v.get(), 0x3C, v.size() * 2), "memset");
    std::vector<int> bt(pages);
    std::iota(bt.begin(), bt.end(), 0);
    DeviceBuffer<int> dqs(std::vector<int>{0, T}), ds0(std::vector<int>{0}), dbt(bt);
    gpu::AttnGroups g;
    g.num_groups = 1;
    g.q_start = dqs.get();
    g.slot0 = ds0.get();
    g.block_table = dbt.get();
    g.max_pages = pages;
    g.total_q = g.max_q = g.max_kv = T;
    const double flops = 4.0 * double(T) * T / 2 * nh * hd;
    for (bool gate : {false, true}) {
      const double ms = time_ms(5, [&] {
        gpu::attention_prefill(g, nh, nkv, hd, q.get(), k.get(), v.get(), scale, gate ? qg.get() + hd : nullptr,
                               long(nh) * 2 * hd, 2 * hd, out.get());
      });
      std::printf("attention_prefill T=%d causal hd=%d heads %d/%d gate=%d: %.3f ms, %.1f TFLOP/s\n", T, hd, nh, nkv,
                  gate, ms, flops / ms * 1e-9);
    }
    // Splice-like shape: 8 windows of 8 queries at the end of a 32k context.
    {
      std::vector<int> qs(9), s0(8);
      for (int i = 0; i < 8; ++i) qs[i + 1] = qs[i] + 8, s0[i] = T - 8 * (8 - i) * 50;
      std::vector<int> bt8;
      for (int i = 0; i < 8; ++i) bt8.insert(bt8.end(), bt.begin(), bt.end());
      DeviceBuffer<int> dqs8(qs), ds08(s0), dbt8(bt8);
      gpu::AttnGroups g8 = g;
      g8.num_groups = 8;
      g8.q_start = dqs8.get();
      g8.slot0 = ds08.get();
      g8.block_table = dbt8.get();
      g8.total_q = 64;
      g8.max_q = 8;
      const double ms = time_ms(20, [&] {
        gpu::attention_prefill(g8, nh, nkv, hd, q.get(), k.get(), v.get(), scale, qg.get() + hd, long(nh) * 2 * hd,
                               2 * hd, out.get());
      });
      std::printf("attention_prefill 8 seam windows x 8 queries over ~32k slots: %.3f ms\n", ms);
      gpu::AttnDecodeWorkspace ws;
      const double ms_split = time_ms(20, [&] {
        gpu::attention_prefill(g8, nh, nkv, hd, q.get(), k.get(), v.get(), scale, qg.get() + hd, long(nh) * 2 * hd,
                               2 * hd, out.get(), ws);
      });
      std::printf("attention_prefill 8 seam windows x 8 queries over ~32k slots, split path: %.3f ms (workspace %zu "
                  "bytes)\n",
                  ms_split, ws.bytes());
    }
    // The hypic splice: 16 seam windows of 8 queries at slot0 2048 i plus the query (64, or 500 tokens) at the
    // end of the 32k sequence, all groups on one block table; without the workspace (one block per group,
    // head and 128-query tile) and with it (split-KV path).
    for (int qlen : {64, 500}) {
      std::vector<int> qs(18), s0(17);
      for (int i = 0; i < 16; ++i) qs[i + 1] = qs[i] + 8, s0[i] = 2048 * i;
      qs[17] = qs[16] + qlen;
      s0[16] = T - qlen;
      std::vector<int> bt17;
      for (int i = 0; i < 17; ++i) bt17.insert(bt17.end(), bt.begin(), bt.end());
      DeviceBuffer<int> dqs17(qs), ds017(s0), dbt17(bt17);
      gpu::AttnGroups gs = g;
      gs.num_groups = 17;
      gs.q_start = dqs17.get();
      gs.slot0 = ds017.get();
      gs.block_table = dbt17.get();
      gs.total_q = qs[17];
      gs.max_q = qlen;
      gs.max_kv = T;
      double flops_s = 0;  // causal: query i of group g sees slot0 + i + 1 slots
      for (int i = 0; i < 17; ++i)
        for (int j = 0; j < qs[i + 1] - qs[i]; ++j) flops_s += 4.0 * (s0[i] + j + 1) * nh * hd;
      const double ms_old = time_ms(10, [&] {
        gpu::attention_prefill(gs, nh, nkv, hd, q.get(), k.get(), v.get(), scale, qg.get() + hd, long(nh) * 2 * hd,
                               2 * hd, out.get());
      });
      gpu::AttnDecodeWorkspace ws;
      const double ms_new = time_ms(20, [&] {
        gpu::attention_prefill(gs, nh, nkv, hd, q.get(), k.get(), v.get(), scale, qg.get() + hd, long(nh) * 2 * hd,
                               2 * hd, out.get(), ws);
      });
      std::printf("attention_prefill splice 16 x 8 seam queries + %d query over 32k (hd %d, %d/%d heads): "
                  "no workspace %.3f ms (%.1f TFLOP/s), split path %.3f ms (%.1f TFLOP/s, workspace %zu bytes)\n",
                  qlen, hd, nh, nkv, ms_old, flops_s / ms_old * 1e-9, ms_new, flops_s / ms_new * 1e-9, ws.bytes());
    }
  }
  // decode: batch 1 / 16 / 64 requests with 32768-slot contexts planned at max_kv 32768, then contexts of 32784 slots
  // planned at 65536 (the CUDA backend's decode step after a 32768-token prompt and 16 tokens: the block table's
  // power-of-two width, 1024 pages, gives max_kv)
  for (const auto [ctx, max_kv] : {std::pair<int, int>{32768, 32768}, std::pair<int, int>{32784, 65536}}) {
    const int per = (ctx + kPage - 1) / kPage, max_b = 64;
    DeviceBuffer<bf16> k(size_t(max_b) * per * kPage * nkv * hd), v(k.size()), q(size_t(max_b) * nh * hd),
        qg(size_t(max_b) * nh * 2 * hd), out(q.size());
    check_cuda(cudaMemset(k.get(), 0x3B, k.size() * 2), "memset");
    check_cuda(cudaMemset(v.get(), 0x3C, v.size() * 2), "memset");
    check_cuda(cudaMemset(q.get(), 0x3C, q.size() * 2), "memset");
    check_cuda(cudaMemset(qg.get(), 0x3D, qg.size() * 2), "memset");
    std::vector<int> bt(size_t(max_b) * per), qs(max_b + 1), s0(max_b, ctx - 1);
    std::iota(bt.begin(), bt.end(), 0);
    std::iota(qs.begin(), qs.end(), 0);
    DeviceBuffer<int> dbt(bt), dqs(qs), ds0(s0);
    gpu::AttnDecodeWorkspace ws;
    ws.reserve(max_b, nh, hd, max_kv);
    for (int b : {1, 16, 64}) {
      gpu::AttnGroups g;
      g.num_groups = b;
      g.q_start = dqs.get();
      g.slot0 = ds0.get();
      g.block_table = dbt.get();
      g.max_pages = per;
      g.total_q = b;
      g.max_q = 1;
      g.max_kv = max_kv;
      // Each call on the next b of the 64 contexts (block-table rows), so that batches below 64 read their KV from
      // DRAM as a decode step does (one 32k context is 67 MB, about the L2's size: the same one again hits in it).
      int rot = 0;
      auto decode = [&] {
        gpu::AttnGroups gr = g;
        gr.block_table = dbt.get() + size_t(rot) * b * per;
        rot = (rot + 1) % (max_b / b);
        gpu::attention_decode(gr, nh, nkv, hd, q.get(), k.get(), v.get(), scale, qg.get() + hd, long(nh) * 2 * hd,
                              2 * hd, out.get(), ws);
      };
      const double bytes = double(b) * ctx * nkv * hd * 2 * 2;
      const double flops = 4.0 * b * ctx * nh * hd;
      // The decode candidates side by side (each: off, on, on, off; every switch named, so HYPIC_CANDIDATES=1 turns
      // no other on): the mean of each mode's two timings.
      constexpr int kNs = 4;
      const char* kSw[kNs] = {"HYPIC_ATTN_DECODE_D_SPLIT", "HYPIC_ATTN_DECODE_WAVES", "HYPIC_ATTN_DECODE_L2_AHEAD",
                              "HYPIC_ATTN_DECODE_SEQ_CHUNKS"};
      // 0: all off; then each switch alone, then per-request chunks with the wave plan (bits of kSw).
      for (const int mask : {0, 1, 2, 4, 8, 8 | 2}) {
        double t[2] = {0, 0};
        for (int on : {0, 1, 1, 0}) {
          std::vector<std::unique_ptr<ScopedCandidate>> set;
          for (int i = 0; i < kNs; ++i) set.push_back(std::make_unique<ScopedCandidate>(kSw[i], on && (mask >> i & 1)));
          t[on] += time_ms(20, decode) / 2;
        }
        std::string name;
        for (int i = 0; i < kNs; ++i)
          if (mask >> i & 1) name += std::string(name.empty() ? "" : " + ") + kSw[i];
        if (mask == 0)
          std::printf("attention_decode batch %d ctx %d (max_kv %d) hd=%d heads %d/%d: %.3f ms, KV read %.0f GB/s, "
                      "%.2f TFLOP/s\n",
                      b, ctx, max_kv, hd, nh, nkv, t[0], bytes / t[0] * 1e-6, flops / t[0] * 1e-9);
        else
          std::printf("attention_decode batch %d ctx %d (max_kv %d), %s: off %.3f ms, on %.3f ms (%.0f GB/s), on / "
                      "off %.3f\n",
                      b, ctx, max_kv, name.c_str(), t[0], t[1], bytes / t[1] * 1e-6, t[1] / t[0]);
      }
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}
