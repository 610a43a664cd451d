// hypic-bench-prefill-gpu: whole-model benchmark of the CUDA backend (engine/backend.h) at Qwen3.5-35B-A3B
// dimensions (bench/gpu/qwen3_5_35b_a3b.json), with BENCHMARK-ONLY seeded random weights made on the device
// (BackendOptions::random_weights_seed: the model's text is meaningless; the numbers are the point).
//
// What it measures, in one process on one GPU (each number a median of --reps timed runs after --warmup runs):
//  - ceilings: the bf16 GEMM rate (kernels/cuda/gemm.h measure_bf16_tflops, n = 8192) and the device-to-device
//    copy bandwidth (1 GiB cudaMemcpyAsync), measured here, first;
//  - parts: each part's kernels timed standalone at the shapes a full prefill of T tokens runs, summed over the
//    model's layers (CUDA events): dense projections through GemmRunner (every linear and attention layer's
//    projections with weights of their own, plus the LM head for one logits row), moe_forward (one layer's
//    weights, run once per MoE layer), attention_prepare + attention_prefill (once per attention layer), and
//    conv1d_silu_prefill (q, k, v out) + gdn_prefill (gates fused, once per linear layer); "rest" = end-to-end
//    minus their sum (norms, embedding, copies, host work, launch gaps);
//  - full prefill of T tokens (SplicePlan mode Full: one segment of T - 1 tokens + a 1-token query, one forward
//    pass of T tokens): ms, tokens/s, achieved TFLOP/s from counted FLOPs (GEMMs 2 x active parameters per token,
//    the LM head for the logits row only; attention 4 T^2 / 2 nh hd per attention layer; Gated DeltaNet chunk
//    FLOPs as bench/gpu/gdn_bench.cu counts them) against the measured bf16 GEMM rate;
//  - an entry build of --segments x --segment-tokens in one Backend::build_entries call, with T_C (the default
//    backend) and without (a second backend made with BackendOptions::benchmark_skip_transitions);
//  - the hypic splice (w = --seam-width) of those cached segments + a --query-tokens query: TTFT (the splice call
//    returning the first logits) against the full prefill of the same prompt, and with the query-aware refresh of
//    k segments (--refresh, SplicePlan::refresh_segments: a probe splice, then k segments recomputed whole) and its
//    tail of t segments (--refresh-tail, SplicePlan::refresh_tail), alone and with each k; and staged (--staged):
//    the same splice with every entry brought as a pinned host block (Backend::copy_to_host; PlanSegment::block),
//    copied in a group at a time within a staging room of N entries (SplicePlan::block_staging_bytes), against the
//    resident splice in the same run;
//  - decode inter-token latency (Backend::decode of a batch) at --decode-batches with contexts of
//    segments x segment-tokens + --decode-query-tokens tokens, each context a hypic splice of the same cached
//    segments + a distinct query;
//  - decode beside prefill (Backend::concurrent_decode, as the engine loop runs it): --beside-steps decode steps of
//    --beside-batch of those contexts on a second thread while this thread runs, back to back, nothing, then entry
//    builds of one --segment-tokens segment, then full prefills of --beside-prefill-tokens tokens: each step's
//    wall time (median, p90, p99, max, and the median against the steps alone) and the prefill work's time against
//    the same work alone.
// Timing of backend calls: wall clock (steady_clock) around the call and a cudaDeviceSynchronize (the backend
// synchronises its stream itself and copies the logits to the host inside the call).
// With --hf-json (tools/hf_prefill_bench.py's output) each prompt length's row gets `hf_ms`.
// With --best-json (tools/best_kernels_bench.py's output, run in the same call) the parts_vs_best table puts core
// attention, the MoE block and GDN next to cuDNN SDPA, a torch._grouped_mm MoE block and fla at the same shapes.
//
// Output: a human table on stdout; --json FILE (one row per prompt length with tokens, ours_ms, hf_ms, plus the
// sections ceilings, parts, build, splice, decode, command, utc, git_commit, build_commit:
// the commit this binary was built from, cmake/build_info.cmake); --md FILE (the Markdown report).
// Usage: hypic-bench-prefill-gpu [--config FILE] [--json FILE] [--md FILE] [--hf-json FILE] [--quick] ...
//        (--help lists every flag); hypic-bench-prefill-gpu --render RESULTS.json [--md FILE] re-renders a report.
// Profiling: the timed full prefills, hypic splices and decode steps run inside NVTX ranges "full_prefill",
// "hypic_splice" and "decode_step" (e.g. ncu --nvtx --nvtx-include "hypic_splice/" ... profiles only the splices).
#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <atomic>
#include <string>
#include <vector>

#include "bench/gpu/prefill_report.h"
#include "engine/backend.h"
#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/mla.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/switches.h"
#include "hypic_build_info.h"  // HYPIC_BUILD_COMMIT (generated: cmake/build_info.cmake)

namespace kc = hypic::kernels::cuda;
namespace eng = hypic::engine;
using namespace hypic::bench::gpu;
using json = nlohmann::json;
using kc::bf16;
using kc::check_cuda;

namespace {
// An NVTX range around one timed call (a no-op unless a profiler listens), so that a profile can be restricted to
// one section: ncu --nvtx --nvtx-include "hypic_splice/" (or "full_prefill/", "decode_step/").
struct NvtxRange {
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};
}  // namespace

namespace {

// ---- small utilities -------------------------------------------------------------------------------------------

/// Summary of repeated timings, ms.
struct Stats {
  double median = NAN, min = NAN, max = NAN;
  int n = 0;
  json to_json() const { return {{"median_ms", median}, {"min_ms", min}, {"max_ms", max}, {"runs", n}}; }
};

Stats summarize(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.n = int(v.size());
  s.min = v.front();
  s.max = v.back();
  s.median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  return s;
}

/// Wall-clock ms of fn() + cudaDeviceSynchronize(), `warm` untimed runs, then `reps` timed ones; `before` (if
/// given) runs untimed before every run (e.g. dropping the previous run's results).
Stats time_wall(const std::function<void()>& fn, int warm, int reps, const std::function<void()>& before = {}) {
  for (int i = 0; i < warm; ++i) {
    if (before) before();
    fn();
    check_cuda(cudaDeviceSynchronize(), "warm-up");
  }
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    if (before) before();
    check_cuda(cudaDeviceSynchronize(), "before a timed run");
    const auto a = std::chrono::steady_clock::now();
    fn();
    check_cuda(cudaDeviceSynchronize(), "timed run");
    const auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::milli>(b - a).count());
  }
  return summarize(t);
}

/// time_wall of fn() with the candidate switch `name` off and on, side by side: `warm` untimed runs of each, then
/// `reps` timed pairs, off-on and on-off alternating, so that both see the same machine state and neither always
/// runs first. The switch's value from before comes back afterwards. Returns (off, on).
std::pair<Stats, Stats> time_ab(const std::string& name, const std::function<void()>& fn, int warm, int reps) {
  kc::CandidateScope sw(name);
  for (int i = 0; i < warm; ++i)
    for (bool on : {false, true}) {
      sw.set(on);
      fn();
      check_cuda(cudaDeviceSynchronize(), "warm-up");
    }
  std::vector<double> t[2];
  for (int i = 0; i < reps; ++i)
    for (int j = 0; j < 2; ++j) {
      const bool on = (i + j) % 2 == 1;
      sw.set(on);
      check_cuda(cudaDeviceSynchronize(), "before a timed run");
      const auto a = std::chrono::steady_clock::now();
      fn();
      check_cuda(cudaDeviceSynchronize(), "timed run");
      t[on].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
    }
  return {summarize(t[0]), summarize(t[1])};
}

/// GPU ms of fn() (asynchronous work on `stream`) between two CUDA events; `warm` untimed runs first.
Stats time_gpu(const std::function<void()>& fn, int warm, int reps, cudaStream_t stream) {
  for (int i = 0; i < warm; ++i) fn();
  check_cuda(cudaStreamSynchronize(stream), "warm-up");
  cudaEvent_t a, b;
  check_cuda(cudaEventCreate(&a), "cudaEventCreate");
  check_cuda(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    check_cuda(cudaEventRecord(a, stream), "cudaEventRecord");
    fn();
    check_cuda(cudaEventRecord(b, stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(b), "timed run");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return summarize(t);
}

/// One owned cudaMalloc allocation of `bytes` bytes (256-byte aligned).
class DevBuf {
 public:
  DevBuf() = default;
  DevBuf(size_t bytes, const std::string& what) : bytes_(bytes) {
    if (bytes) check_cuda(cudaMalloc(&p_, bytes), "cudaMalloc(" + std::to_string(bytes) + " bytes) for " + what);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DevBuf() {
    if (p_) cudaFree(p_);
  }
  template <class T = void>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

/// Deterministic fills through kernels/cuda/ops.h fill_random (stream ids count up per call).
struct Filler {
  uint64_t seed;
  uint64_t next_id = 1;
  cudaStream_t stream;
  void bf(bf16* p, size_t n, kc::RandomFill kind, float a, float b) {
    kc::fill_random(long(n), kind, a, b, seed, next_id++, p, nullptr, stream);
  }
  void f32(float* p, size_t n, kc::RandomFill kind, float a, float b) {
    kc::fill_random(long(n), kind, a, b, seed, next_id++, nullptr, p, stream);
  }
};

std::vector<int32_t> random_ids(size_t n, int64_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> d(0, int32_t(vocab - 1));
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<int64_t> parse_list(const std::string& text, const char* flag) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v <= 0) throw std::invalid_argument(std::string(flag) + ": bad value '" + item + "'");
    out.push_back(v);
  }
  if (out.empty()) throw std::invalid_argument(std::string(flag) + ": no values given");
  return out;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

std::string shell_line(const char* cmd) {
  std::string out;
  if (FILE* p = popen(cmd, "r")) {
    char buf[256];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

// ---- model dimensions and counted FLOPs ------------------------------------------------------------------------

/// The sizes the benchmark needs, from the config.
struct Dims {
  int64_t H, V;
  int nk, nv, dk, C, qd, vd, K;   // Gated DeltaNet: key / value heads, head size, conv channels, q / v widths
  int nh, nkv, hd, rd, qrows;     // attention: heads, KV heads, head size, rotary dims, q_proj rows (query + gate)
  int E, topk, I, Is, I_dense;    // MoE: experts, top-k, expert / shared widths; dense MLP width
  int n_lin, n_attn, n_moe, n_mlp;
  double eps, rope_theta;
  // The other families (Kimi-Linear, MiniMax, Ring-linear): GEMMs counted from the active parameters of the layers
  // (count_parameters, without the embedding and the LM head); attention with its own K and V head sizes (MLA: qk
  // nope + rope, v), the KV pool's row the latent (R + rope); lightning scans' nominal count per (chunk, head).
  bool qwen = true, lightning = false, mla = false;
  double body_active = 0;  // active parameters per token outside the embedding and the LM head
  int hd_qk = 0, hd_v = 0, latent = 0;
  explicit Dims(const eng::ModelConfig& c)
      : H(c.hidden_size), V(c.vocab_size), nk(c.linear_num_key_heads), nv(c.linear_num_value_heads),
        dk(c.linear_key_head_dim), C(int(c.conv_dim())), qd(int(c.linear_q_dim())), vd(int(c.linear_v_dim())),
        K(c.linear_conv_kernel_dim), nh(c.num_attention_heads), nkv(c.num_key_value_heads), hd(c.head_dim),
        rd(c.rotary_dim()), qrows((c.attn_output_gate ? 2 : 1) * c.num_attention_heads * c.head_dim),
        E(c.num_experts), topk(c.num_experts_per_tok), I(int(c.moe_intermediate_size)),
        Is(int(c.shared_expert_intermediate_size)), I_dense(int(c.intermediate_size)), n_lin(c.num_linear_layers()),
        n_attn(c.num_attention_layers()), n_moe(0), n_mlp(0), eps(c.rms_norm_eps), rope_theta(c.rope_theta) {
    for (int i = 0; i < c.num_hidden_layers; ++i) (c.is_moe_layer(i) ? n_moe : n_mlp) += 1;
    qwen = c.family == eng::ModelFamily::Qwen;
    lightning = c.family == eng::ModelFamily::MiniMax || c.family == eng::ModelFamily::RingLinear;
    mla = c.family == eng::ModelFamily::KimiLinear;
    hd_qk = hd, hd_v = c.attn_v_head_dim();
    if (mla) latent = c.kv_lora_rank + c.qk_rope_head_dim;
    if (lightning) nv = nh, dk = hd;
    body_active = double(eng::count_parameters(c).active_per_token) - double(V) * H * (c.tie_word_embeddings ? 1 : 2);
  }
  /// Dense projection weights (elements) of one linear / attention layer.
  double lin_proj() const { return double(C) * H + double(vd) * H + 2.0 * nv * H + double(H) * vd; }
  double attn_proj() const { return double(qrows) * H + 2.0 * nkv * hd * H + double(H) * nh * hd; }
  /// Active FFN weights per token of one MoE layer (router, top-k experts, shared expert and its gate).
  double moe_active() const { return double(E) * H + double(topk) * 3 * I * H + 3.0 * Is * H + (Is > 0 ? H : 0); }
  /// Counted FLOPs of one forward pass of T new tokens after `past` cached tokens, with `logit_rows` LM-head rows.
  double dense_flops(double T, double logit_rows) const {
    if (!qwen) return 2 * T * (body_active - ffn_params()) + 2 * logit_rows * double(V) * H;
    return 2 * T * (n_lin * lin_proj() + n_attn * attn_proj()) + 2 * logit_rows * double(V) * H;
  }
  /// FFN parameters active per token over all layers (MoE: router, top-k experts, shared expert; dense MLPs).
  double ffn_params() const { return n_moe * moe_active() + n_mlp * 3.0 * I_dense * H; }
  double ffn_flops(double T) const { return 2 * T * ffn_params(); }
  /// Causal attention: every query attends to past + its position: 4 nh hd per (query, key) pair, T^2/2 + T past.
  double attn_flops(double T, double past = 0) const {
    return n_attn * 2.0 * nh * (hd_qk + hd_v) * (T * T / 2 + T * past);
  }
  /// gdn_bench.cu's nominal count per (chunk, value head), C = 64: 10 C^2 D + 6 C D^2 (no T_C).
  /// Lightning: 4 C^2 D + 4 C D^2 (intra-chunk scores and values, inter-chunk q S and the state update).
  double gdn_flops(double T) const {
    const double chunks = std::ceil(T / kc::kGdnChunk) * nv, Cc = kc::kGdnChunk, D = dk;
    if (lightning) return n_lin * chunks * (4 * Cc * Cc * D + 4 * Cc * D * D);
    return n_lin * chunks * (10 * Cc * Cc * D + 6 * Cc * D * D);
  }
  double total_flops(double T, double logit_rows) const {
    return dense_flops(T, logit_rows) + ffn_flops(T) + attn_flops(T) + gdn_flops(T);
  }
  /// KV bytes per token over all attention layers as the CUDA backend stores it (bf16 K and V; MLA: the latent row).
  double kv_bytes_per_token() const { return mla ? double(n_attn) * latent * 2 : double(n_attn) * 2 * nkv * hd * 2; }
  /// One KV pool page of the CUDA backend (kKvPageTokens tokens of every attention layer), bytes.
  double page_bytes() const { return kv_bytes_per_token() * kc::kKvPageTokens; }
};

// ---- parts: each part's kernels standalone at the shapes of a full prefill -------------------------------------

/// Device buffers for the standalone part timings, sized for up to Tm tokens.
struct PartBuffers {
  DevBuf x, resid, big, z, a, b, kv, aq, ao, q, k, v, o, logits;
  DevBuf w_lin, w_attn, w_lm;  // dense weights: every layer its own
  DevBuf moe_w;                // one MoE layer (or dense MLP) weights
  DevBuf kpool, vpool, state, conv_state, conv_w, A_log, dt_bias, qn, kn, inv_freq;
  DevBuf positions, rows, qstart, slot0, btable, cu;
  int pages = 0;
};

json measure_parts(const eng::ModelConfig& cfg, const Dims& d, const std::vector<int64_t>& lengths, int warm,
                   int reps, cudaStream_t s, uint64_t seed) {
  const int64_t Tm = *std::max_element(lengths.begin(), lengths.end());
  PartBuffers B;
  const size_t T = size_t(Tm), H = size_t(d.H);
  Filler fill{seed ^ 0x5eedull, 1, s};
  B.x = DevBuf(T * H * 2, "parts: x");
  B.resid = DevBuf(T * H * 4, "parts: residual");
  B.big = DevBuf(T * size_t(std::max(d.C, d.qrows)) * 2, "parts: qkv / qg");
  B.z = DevBuf(T * size_t(std::max(d.vd, 1)) * 2, "parts: z");
  B.a = DevBuf(T * size_t(std::max(d.nv, 1)) * 2 + 16, "parts: a");
  B.b = DevBuf(T * size_t(std::max(d.nv, 1)) * 2 + 16, "parts: b");
  B.kv = DevBuf(T * size_t(2 * d.nkv * d.hd) * 2 + 16, "parts: kv");
  B.aq = DevBuf(T * size_t(d.nh * d.hd) * 2 + 16, "parts: attention q");
  B.ao = DevBuf(T * size_t(d.nh * d.hd) * 2 + 16, "parts: attention out");
  B.logits = DevBuf(size_t(d.V) * 4, "parts: logits");
  fill.bf(B.x.as<bf16>(), T * H, kc::RandomFill::Normal, 0.f, 1.f);
  check_cuda(cudaMemsetAsync(B.resid.as(), 0, B.resid.bytes(), s), "memset");
  fill.bf(B.z.as<bf16>(), B.z.bytes() / 2, kc::RandomFill::Normal, 0.f, 1.f);
  fill.bf(B.ao.as<bf16>(), B.ao.bytes() / 2, kc::RandomFill::Normal, 0.f, 1.f);
  // Dense weights N(0, 0.02), as DeviceWeights::random.
  const size_t lin_w = size_t(d.lin_proj()), attn_w = size_t(d.attn_proj());
  B.w_lin = DevBuf(size_t(d.n_lin) * lin_w * 2, "parts: linear-layer projections");
  B.w_attn = DevBuf(size_t(d.n_attn) * attn_w * 2, "parts: attention projections");
  B.w_lm = DevBuf(size_t(d.V) * H * 2, "parts: LM head");
  fill.bf(B.w_lin.as<bf16>(), B.w_lin.bytes() / 2, kc::RandomFill::Normal, 0.f, 0.02f);
  fill.bf(B.w_attn.as<bf16>(), B.w_attn.bytes() / 2, kc::RandomFill::Normal, 0.f, 0.02f);
  fill.bf(B.w_lm.as<bf16>(), B.w_lm.bytes() / 2, kc::RandomFill::Normal, 0.f, 0.02f);

  kc::GemmRunner gemm;
  json out = json::array();

  // MoE layer weights (one layer, run once per MoE layer).
  kc::MoeWeightsView mv;
  size_t o_router = 0, o_gu = 0, o_dn = 0, o_sgu = 0, o_sdn = 0, o_sg = 0, o_mgu = 0, o_mdn = 0, moe_elems = 0;
  auto take = [&](size_t n) {
    const size_t off = moe_elems;
    moe_elems += (n + 127) / 128 * 128;  // 256-byte aligned sub-buffers
    return off;
  };
  if (d.n_moe) {
    o_router = take(size_t(d.E) * H), o_gu = take(size_t(d.E) * 2 * d.I * H), o_dn = take(size_t(d.E) * H * d.I);
    if (d.Is) o_sgu = take(size_t(2) * d.Is * H), o_sdn = take(H * d.Is), o_sg = take(H);
  }
  if (d.n_mlp) o_mgu = take(size_t(2) * d.I_dense * H), o_mdn = take(H * d.I_dense);
  B.moe_w = DevBuf(moe_elems * 2, "parts: MoE layer weights");
  fill.bf(B.moe_w.as<bf16>(), moe_elems, kc::RandomFill::Normal, 0.f, 0.02f);
  const bf16* mw = B.moe_w.as<bf16>();
  kc::MoeWorkspace moe_ws;
  if (d.n_moe) {
    mv.E = d.E, mv.H = int(d.H), mv.I = d.I, mv.topk = d.topk, mv.renormalize = cfg.norm_topk_prob;
    mv.router = mw + o_router, mv.experts_gate_up = mw + o_gu, mv.experts_down = mw + o_dn;
    mv.Is = d.Is;
    if (d.Is) mv.shared_gate_up = mw + o_sgu, mv.shared_down = mw + o_sdn, mv.shared_gate = mw + o_sg;
    moe_ws.reserve(int(Tm), mv);
  }
  if (d.n_mlp) moe_ws.reserve_mlp(int(Tm), int(d.H), d.I_dense);

  // Attention: pool of Tm tokens, identity block table, positions 0..T-1.
  if (d.n_attn) {
    B.pages = int((Tm + kc::kKvPageTokens - 1) / kc::kKvPageTokens);
    const size_t row = size_t(d.nkv) * d.hd;
    B.kpool = DevBuf(size_t(B.pages) * kc::kKvPageTokens * row * 2, "parts: K pool");
    B.vpool = DevBuf(size_t(B.pages) * kc::kKvPageTokens * row * 2, "parts: V pool");
    B.qn = DevBuf(size_t(d.hd) * 2, "parts: q_norm");
    B.kn = DevBuf(size_t(d.hd) * 2, "parts: k_norm");
    fill.bf(B.qn.as<bf16>(), size_t(d.hd), kc::RandomFill::Normal, 0.f, 0.05f);
    fill.bf(B.kn.as<bf16>(), size_t(d.hd), kc::RandomFill::Normal, 0.f, 0.05f);
    fill.bf(B.kv.as<bf16>(), B.kv.bytes() / 2, kc::RandomFill::Normal, 0.f, 1.f);
    std::vector<float> inv(size_t(std::max(d.rd / 2, 1)));
    for (int i = 0; i < d.rd / 2; ++i) inv[size_t(i)] = float(1.0 / std::pow(d.rope_theta, 2.0 * i / d.rd));
    B.inv_freq = DevBuf(inv.size() * 4, "parts: inv_freq");
    check_cuda(cudaMemcpy(B.inv_freq.as(), inv.data(), inv.size() * 4, cudaMemcpyHostToDevice), "inv_freq");
    std::vector<int> iota(T), bt(size_t(B.pages));
    for (size_t t = 0; t < T; ++t) iota[t] = int(t);
    for (int p = 0; p < B.pages; ++p) bt[size_t(p)] = p;
    B.positions = DevBuf(T * 4, "parts: positions");
    B.rows = DevBuf(T * 4, "parts: kv rows");
    B.btable = DevBuf(bt.size() * 4, "parts: block table");
    B.qstart = DevBuf(2 * 4, "parts: q_start");
    B.slot0 = DevBuf(4, "parts: slot0");
    check_cuda(cudaMemcpy(B.positions.as(), iota.data(), T * 4, cudaMemcpyHostToDevice), "positions");
    check_cuda(cudaMemcpy(B.rows.as(), iota.data(), T * 4, cudaMemcpyHostToDevice), "rows");
    check_cuda(cudaMemcpy(B.btable.as(), bt.data(), bt.size() * 4, cudaMemcpyHostToDevice), "block table");
    check_cuda(cudaMemset(B.slot0.as(), 0, 4), "slot0");
  }
  // Gated DeltaNet: conv input = the qkv buffer, gates a / b, A_log = log U(1, 16), dt_bias = 1.
  kc::GdnWorkspace gdn_ws;
  if (d.n_lin) {
    B.q = DevBuf(T * size_t(d.qd) * 2, "parts: q");
    B.k = DevBuf(T * size_t(d.qd) * 2, "parts: k");
    B.v = DevBuf(T * size_t(d.vd) * 2, "parts: v");
    B.o = DevBuf(T * size_t(d.vd) * 2, "parts: gdn out");
    B.state = DevBuf(size_t(d.nv) * kc::kGdnHeadDim * kc::kGdnHeadDim * 4, "parts: state");
    B.conv_state = DevBuf(size_t(d.K - 1) * d.C * 2 + 16, "parts: conv state");
    B.conv_w = DevBuf(size_t(d.C) * d.K * 2, "parts: conv weight");
    B.A_log = DevBuf(size_t(d.nv) * 4, "parts: A_log");
    B.dt_bias = DevBuf(size_t(d.nv) * 4, "parts: dt_bias");
    B.cu = DevBuf(2 * 4, "parts: cu_seqlens");
    fill.bf(B.big.as<bf16>(), T * size_t(d.C), kc::RandomFill::Normal, 0.f, 1.f);
    fill.bf(B.a.as<bf16>(), T * size_t(d.nv), kc::RandomFill::Normal, 0.f, 1.f);
    fill.bf(B.b.as<bf16>(), T * size_t(d.nv), kc::RandomFill::Normal, 0.f, 1.f);
    fill.bf(B.conv_w.as<bf16>(), size_t(d.C) * d.K, kc::RandomFill::Uniform, 0.f, float(1.0 / std::sqrt(double(d.K))));
    fill.f32(B.A_log.as<float>(), size_t(d.nv), kc::RandomFill::LogUniform, 1.f, 16.f);
    fill.f32(B.dt_bias.as<float>(), size_t(d.nv), kc::RandomFill::Constant, 1.f, 0.f);
    check_cuda(cudaMemsetAsync(B.state.as(), 0, B.state.bytes(), s), "memset");
    check_cuda(cudaMemsetAsync(B.conv_state.as(), 0, B.conv_state.bytes(), s), "memset");
  }
  check_cuda(cudaStreamSynchronize(s), "parts setup");

  for (int64_t Tl : lengths) {
    const int Ti = int(Tl);
    json row = {{"tokens", Tl}};
    // Dense projections: every layer's own weights, in layer order, then the LM head for one row.
    auto dense = [&] {
      int li = 0, ai = 0;
      for (int i = 0; i < cfg.num_hidden_layers; ++i) {
        if (cfg.layer_types[size_t(i)] == eng::LayerType::Linear) {
          const bf16* w = B.w_lin.as<bf16>() + size_t(li++) * lin_w;
          const bf16 *w_qkv = w, *w_z = w_qkv + size_t(d.C) * H, *w_b = w_z + size_t(d.vd) * H,
                     *w_a = w_b + size_t(d.nv) * H, *w_o = w_a + size_t(d.nv) * H;
          gemm.linear(Ti, d.C, int(H), B.x.as<bf16>(), long(H), w_qkv, B.big.as(), CUDA_R_16BF, d.C, 0.f, s);
          gemm.linear(Ti, d.vd, int(H), B.x.as<bf16>(), long(H), w_z, B.z.as(), CUDA_R_16BF, d.vd, 0.f, s);
          gemm.linear(Ti, d.nv, int(H), B.x.as<bf16>(), long(H), w_b, B.b.as(), CUDA_R_16BF, d.nv, 0.f, s);
          gemm.linear(Ti, d.nv, int(H), B.x.as<bf16>(), long(H), w_a, B.a.as(), CUDA_R_16BF, d.nv, 0.f, s);
          gemm.linear(Ti, int(H), d.vd, B.z.as<bf16>(), d.vd, w_o, B.resid.as(), CUDA_R_32F, long(H), 1.f, s);
        } else {
          const bf16* w = B.w_attn.as<bf16>() + size_t(ai++) * attn_w;
          const bf16 *w_q = w, *w_kv = w_q + size_t(d.qrows) * H, *w_o = w_kv + size_t(2 * d.nkv * d.hd) * H;
          gemm.linear(Ti, d.qrows, int(H), B.x.as<bf16>(), long(H), w_q, B.big.as(), CUDA_R_16BF, d.qrows, 0.f, s);
          gemm.linear(Ti, 2 * d.nkv * d.hd, int(H), B.x.as<bf16>(), long(H), w_kv, B.kv.as(), CUDA_R_16BF,
                      2 * d.nkv * d.hd, 0.f, s);
          gemm.linear(Ti, int(H), d.nh * d.hd, B.ao.as<bf16>(), d.nh * d.hd, w_o, B.resid.as(), CUDA_R_32F, long(H),
                      1.f, s);
        }
      }
      gemm.linear(1, int(d.V), int(H), B.x.as<bf16>(), long(H), B.w_lm.as<bf16>(), B.logits.as(), CUDA_R_32F,
                  long(d.V), 0.f, s);
    };
    const Stats t_dense = time_gpu(dense, warm, reps, s);
    // FFN: moe_forward once per MoE layer (dense MLP once per dense layer).
    auto ffn = [&] {
      for (int i = 0; i < d.n_moe; ++i)
        kc::moe_forward(Ti, B.x.as<bf16>(), mv, B.resid.as<float>(), moe_ws, gemm, kc::grouped_gemm_for_tokens(Ti), s);
      for (int i = 0; i < d.n_mlp; ++i)
        kc::mlp_forward(Ti, B.x.as<bf16>(), int(H), d.I_dense, mw + o_mgu, mw + o_mdn, B.resid.as<float>(), moe_ws,
                        gemm, s);
    };
    const Stats t_ffn = (d.n_moe + d.n_mlp) ? time_gpu(ffn, warm, reps, s) : Stats{0, 0, 0, 0};
    // Attention: prepare (norms, RoPE, K/V into the pool) + varlen causal prefill, once per attention layer.
    Stats t_attn{0, 0, 0, 0}, t_attn_core{0, 0, 0, 0};
    long cudnn_launches = 0;  // attention_prefill's long group through cuDNN's SDPA (else our kernel)
    if (d.n_attn) {
      const int qs[2] = {0, Ti};
      check_cuda(cudaMemcpy(B.qstart.as(), qs, sizeof qs, cudaMemcpyHostToDevice), "q_start");
      kc::AttnGroups g;
      g.num_groups = 1, g.q_start = B.qstart.as<int>(), g.slot0 = B.slot0.as<int>(), g.block_table = B.btable.as<int>();
      g.max_pages = B.pages, g.total_q = Ti, g.max_q = Ti, g.max_kv = Ti;
      const int slot0_host = 0;  // host tables, as the backend passes them: long groups may take cuDNN's SDPA
      g.q_start_host = qs, g.slot0_host = &slot0_host;
      kc::AttnDecodeWorkspace attn_ws;  // (the backend's rule: HYPIC_ATTN_CUDNN=all routes every long group)
      const bool gate = cfg.attn_output_gate;
      const float scale = float(1.0 / std::sqrt(double(d.hd)));
      auto attn = [&] {
        for (int i = 0; i < d.n_attn; ++i) {
          kc::attention_prepare(Ti, d.nh, d.nkv, d.hd, d.rd, gate, B.big.as<bf16>(), B.kv.as<bf16>(),
                                B.kv.as<bf16>() + d.nkv * d.hd, 2 * d.nkv * d.hd, B.qn.as<bf16>(), B.kn.as<bf16>(),
                                float(d.eps), B.positions.as<int>(), B.inv_freq.as<float>(), B.rows.as<int>(),
                                B.aq.as<bf16>(), B.kpool.as<bf16>(), B.vpool.as<bf16>(), s);
          kc::attention_prefill(g, d.nh, d.nkv, d.hd, B.aq.as<bf16>(), B.kpool.as<bf16>(), B.vpool.as<bf16>(), scale,
                                gate ? B.big.as<bf16>() + d.hd : nullptr, gate ? long(2) * d.nh * d.hd : 0,
                                gate ? 2 * d.hd : 0, B.ao.as<bf16>(), attn_ws, s);
        }
      };
      fill.bf(B.big.as<bf16>(), size_t(Ti) * d.qrows, kc::RandomFill::Normal, 0.f, 1.f);
      t_attn = time_gpu(attn, warm, reps, s);
      auto core = [&] {  // attention_prefill alone (K/V and q as the last prepare left them): next to library SDPA
        for (int i = 0; i < d.n_attn; ++i)
          kc::attention_prefill(g, d.nh, d.nkv, d.hd, B.aq.as<bf16>(), B.kpool.as<bf16>(), B.vpool.as<bf16>(), scale,
                                gate ? B.big.as<bf16>() + d.hd : nullptr, gate ? long(2) * d.nh * d.hd : 0,
                                gate ? 2 * d.hd : 0, B.ao.as<bf16>(), attn_ws, s);
      };
      t_attn_core = time_gpu(core, warm, reps, s);
      cudnn_launches = attn_ws.cudnn_launches();
    }
    // Gated DeltaNet: conv1d + SiLU, split into q / k / v, chunked prefill with fused gates, once per linear layer.
    Stats t_gdn{0, 0, 0, 0};
    if (d.n_lin) {
      const int cu_h[2] = {0, Ti};
      check_cuda(cudaMemcpy(B.cu.as(), cu_h, sizeof cu_h, cudaMemcpyHostToDevice), "cu_seqlens");
      fill.bf(B.big.as<bf16>(), size_t(Ti) * d.C, kc::RandomFill::Normal, 0.f, 1.f);
      kc::GdnPrefillArgs ga;
      ga.num_seqs = 1, ga.cu_seqlens_host = cu_h, ga.num_k_heads = d.nk, ga.num_v_heads = d.nv;
      ga.q = B.q.as<bf16>(), ga.k = B.k.as<bf16>(), ga.v = B.v.as<bf16>();
      ga.gate_a = B.a.as<bf16>(), ga.gate_b = B.b.as<bf16>(), ga.A_log = B.A_log.as<float>();
      ga.dt_bias = B.dt_bias.as<float>(), ga.l2norm_qk = true, ga.scale = float(1.0 / std::sqrt(double(d.dk)));
      ga.initial_state = B.state.as<float>(), ga.final_state = B.state.as<float>(), ga.out = B.o.as<bf16>();
      auto gdn = [&] {
        for (int i = 0; i < d.n_lin; ++i) {
          kc::conv1d_silu_prefill(1, B.cu.as<int>(), Ti, d.C, d.K, B.big.as<bf16>(), B.conv_w.as<bf16>(),
                                  B.conv_state.as<bf16>(), kc::ConvQkvOut{B.q.as<bf16>(), B.k.as<bf16>(), B.v.as<bf16>(), d.qd},
                                  s);
          kc::gdn_prefill(ga, gdn_ws, s);
        }
      };
      t_gdn = time_gpu(gdn, warm, reps, s);
    }
    const double T_d = double(Tl);
    auto part = [&](const Stats& st, double flops, const char* what) {
      return json{{"ms", st.median}, {"min_ms", st.min}, {"gflop", flops / 1e9},
                  {"TFLOPs", st.median > 0 ? flops / (st.median * 1e-3) / 1e12 : NAN}, {"what", what}};
    };
    row["dense_gemm"] = part(t_dense, d.dense_flops(T_d, 1),
                             "GemmRunner: every linear layer's in_proj_qkv / z / b / a and out_proj, every attention "
                             "layer's q_proj (query + gate), kv_proj and o_proj, each layer its own weights; LM head "
                             "for 1 row");
    row["moe"] = part(t_ffn, d.ffn_flops(T_d),
                      "moe_forward (router, top-k, grouped expert GEMMs, shared expert, combine), once per MoE layer "
                      "on one layer's weights");
    row["attention"] = part(t_attn, d.attn_flops(T_d),
                            "attention_prepare (q/k norms, partial RoPE, K/V into the pool) + attention_prefill "
                            "(causal, with the output gate), once per attention layer");
    const std::string attn_impl = cudnn_launches ? "cuDNN SDPA (K/V gathered from the pool) + output gate kernel"
                                                 : "our kernel, gate fused";
    row["attention_core"] = part(t_attn_core, d.attn_flops(T_d),
                                 ("attention_prefill alone (causal, gate), once per attention layer: " + attn_impl).c_str());
    row["attention_impl"] = cudnn_launches ? "cudnn_sdpa" : "hypic";
    row["gdn"] = part(t_gdn, d.gdn_flops(T_d),
                      "conv1d_silu_prefill (q, k, v out) + gdn_prefill (gates fused, no T_C), once per linear layer");
    row["sum_ms"] = t_dense.median + t_ffn.median + t_attn.median + t_gdn.median;
    out.push_back(row);
    std::printf("parts at %6lld tokens (GPU ms, standalone): dense GEMMs %.2f, MoE %.2f, attention %.2f, GDN %.2f\n",
                (long long)Tl, t_dense.median, t_ffn.median, t_attn.median, t_gdn.median);
    std::fflush(stdout);
  }
  check_cuda(cudaStreamSynchronize(s), "parts");
  return out;
}

/// p-th percentile (0..100) of v, nearest rank; NAN when empty.
double percentile(std::vector<double> v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t i = size_t(std::ceil(p / 100.0 * double(v.size())));
  return v[std::min(v.size() - 1, i == 0 ? 0 : i - 1)];
}

/// Decode beside prefill: `steps` decode steps of the first `batch` of `seqs` on a second thread (as the engine loop
/// runs them when Backend::concurrent_decode()), while this thread runs, back to back until the steps are done:
/// nothing; entry builds of one `segment_tokens` segment (seam `seam`); full prefills of `prefill_tokens` tokens.
/// Each load's step times (ms: median, p90, p99, max; the median over the median alone) and its prefill work's
/// median ms beside the steps against the same work alone (3 runs). Wall clock; the backend synchronises itself.
json decode_beside(eng::Backend& be, std::vector<std::unique_ptr<eng::Sequence>>& seqs, int batch, int steps,
                   int segment_tokens, int seam, int64_t prefill_tokens, int64_t V, std::mt19937_64& rng) {
  json out = {{"batch", batch}, {"steps", steps}, {"concurrent_decode", be.concurrent_decode()},
              {"context_tokens", seqs.empty() ? 0 : seqs[0]->num_tokens()}, {"loads", json::array()}};
  if (!be.concurrent_decode()) {
    out["error"] = "the backend has no concurrent decode";
    return out;
  }
  std::vector<eng::Sequence*> ptr;
  for (int b = 0; b < batch; ++b) ptr.push_back(seqs[size_t(b)].get());
  const std::vector<int32_t> seg = random_ids(size_t(segment_tokens), V, rng);
  eng::SplicePlan full;
  full.mode = eng::SpliceMode::Full;
  full.segments.push_back({random_ids(size_t(prefill_tokens - 1), V, rng), nullptr});
  full.query = random_ids(1, V, rng);
  struct Load {
    std::string name;
    std::function<void()> work;
  };
  const std::vector<Load> loads = {
      {"none", nullptr},
      {"entry builds of " + std::to_string(segment_tokens) + " tokens",
       [&] { (void)be.build_entries(std::vector<std::vector<int32_t>>{seg}, seam); }},
      {"full prefills of " + std::to_string(prefill_tokens) + " tokens", [&] { (void)be.splice(full); }}};
  double alone_median = NAN;
  for (const Load& load : loads) {
    json row = {{"load", load.name}};
    try {
      double work_alone = NAN;
      if (load.work) work_alone = time_wall(load.work, 1, 3).median;
      std::vector<double> step_ms, work_ms;
      std::atomic<bool> done{false};
      std::exception_ptr failed;
      const std::vector<int32_t> toks = random_ids(size_t(batch), V, rng);
      be.set_decoding_sequences(batch);  // as the engine loop does while its decode thread steps sequences
      std::thread decoder([&] {
        try {
          std::vector<float> logits;
          be.decode(ptr, toks, logits);  // untimed: the graph of this shape exists
          for (int i = 0; i < steps; ++i) {
            const auto a = std::chrono::steady_clock::now();
            be.decode(ptr, toks, logits);
            step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
          }
        } catch (...) {
          failed = std::current_exception();
        }
        done = true;
      });
      while (!done) {
        if (!load.work) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          continue;
        }
        const auto a = std::chrono::steady_clock::now();
        load.work();
        work_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
      }
      decoder.join();
      be.set_decoding_sequences(0);
      if (failed) std::rethrow_exception(failed);
      const Stats st = summarize(step_ms);
      const Stats wk = summarize(work_ms);
      if (!load.work) alone_median = st.median;
      row.update({{"step_ms_median", st.median}, {"step_ms_p90", percentile(step_ms, 90)},
                  {"step_ms_p99", percentile(step_ms, 99)}, {"step_ms_max", st.max},
                  {"step_over_alone", st.median / alone_median}, {"work_runs", wk.n},
                  {"work_ms_median", wk.median}, {"work_ms_alone", work_alone},
                  {"work_over_alone", wk.median / work_alone}});
      std::printf("decode beside prefill, batch %d, load %s: step median %.2f ms (%.2fx alone), p90 %.2f, p99 %.2f, "
                  "max %.2f; the load's work %.1f ms (%.2fx alone, %d runs)\n",
                  batch, load.name.c_str(), st.median, st.median / alone_median, percentile(step_ms, 90),
                  percentile(step_ms, 99), st.max, wk.median, wk.median / work_alone, wk.n);
    } catch (const std::exception& e) {
      row["error"] = e.what();
      std::printf("decode beside prefill, load %s: FAILED: %s\n", load.name.c_str(), e.what());
    }
    std::fflush(stdout);
    out["loads"].push_back(row);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  CLI::App app{"Whole-model benchmark of the CUDA backend at a model's real dimensions (Qwen3.5-35B-A3B by default; "
               "any config the backend serves), benchmark-only random weights"};
  std::string config = "bench/gpu/qwen3_5_35b_a3b.json", device = "cuda:0", lengths_s = "4096,16384,32768";
  std::vector<std::string> ab_switches;
  std::string staged_s = "16,8,4,2";
  std::string json_path, md_path, hf_json, best_json, commit, command, batches_s = "1,16,64", skip_s, refresh_s = "2,4",
              tails_s = "2";
  uint64_t seed = 1;
  int warm = 2, reps = 5, segments = 16, segment_tokens = 2048, query_tokens = 64, seam = 8, decode_query = 16;
  int decode_warm = 3, decode_steps = 10;
  int beside_batch = 4, beside_steps = 60;
  int64_t beside_prefill = 16384;
  int decode_sms = -1;
  int64_t max_batch_tokens = 0;
  double kv_pool_gib = 0;
  bool quick = false;
  app.add_option("--config", config, "config.json of the model (random weights are made from it)")->capture_default_str();
  app.add_option("--device", device, "cuda:N")->capture_default_str();
  app.add_option("--seed", seed, "seed of the random weights and token ids (non-zero)")->capture_default_str();
  app.add_option("--lengths", lengths_s, "full-prefill prompt lengths, tokens, comma-separated")->capture_default_str();
  app.add_option("--warmup", warm, "untimed runs before each measurement")->capture_default_str();
  app.add_option("--reps", reps, "timed runs per measurement (the median is reported)")->capture_default_str();
  app.add_option("--segments", segments, "segments of the entry build / splice / decode contexts")->capture_default_str();
  app.add_option("--segment-tokens", segment_tokens, "tokens per segment")->capture_default_str();
  app.add_option("--query-tokens", query_tokens, "query tokens of the splice measurement")->capture_default_str();
  app.add_option("--seam-width", seam, "hypic seam width w, tokens")->capture_default_str();
  app.add_option("--refresh", refresh_s,
                 "refresh counts k timed in the splice section (SplicePlan::refresh_segments), comma-separated; "
                 "empty = none")
      ->capture_default_str();
  app.add_option("--refresh-tail", tails_s,
                 "refresh tails t timed in the splice section (SplicePlan::refresh_tail), alone and with each "
                 "--refresh k, comma-separated; empty = none")
      ->capture_default_str();
  app.add_option("--staged", staged_s,
                 "staging rooms timed in the splice section, in entries (each entry brought as a pinned host block, "
                 "copied in a group at a time within that many entries' bytes), comma-separated; empty = none")
      ->capture_default_str();
  app.add_option("--decode-batches", batches_s, "decode batch sizes, comma-separated")->capture_default_str();
  app.add_option("--decode-query-tokens", decode_query, "query tokens of each decode context")->capture_default_str();
  app.add_option("--decode-warmup", decode_warm, "untimed decode steps per batch size")->capture_default_str();
  app.add_option("--decode-steps", decode_steps, "timed decode steps per batch size")->capture_default_str();
  app.add_option("--beside-batch", beside_batch, "decode beside prefill: batch size (at most the largest decode batch)")
      ->capture_default_str();
  app.add_option("--beside-steps", beside_steps, "decode beside prefill: timed steps per load")->capture_default_str();
  app.add_option("--beside-prefill-tokens", beside_prefill, "decode beside prefill: tokens of the full prefills")
      ->capture_default_str();
  app.add_option("--decode-sms", decode_sms,
                 "BackendOptions::decode_sms: SMs of the decode partition while decode steps run beside prefill "
                 "(-1 = auto, 0 = none)")
      ->capture_default_str();
  app.add_option("--max-batch-tokens", max_batch_tokens,
                 "BackendOptions::max_batch_tokens (0 = the longest prompt, so every prefill is one pass)");
  app.add_option("--kv-pool-gib", kv_pool_gib, "KV pool, GiB (0 = what the decode contexts need, computed)");
  app.add_option("--skip", skip_s,
                 "sections to skip, comma-separated: parts,prefill,build,notc,splice,decode,beside");
  app.add_flag("--quick", quick, "quick mode: 1 warm-up, 2 timed runs, 1 + 3 decode steps");
  app.add_option("--ab", ab_switches,
                 "candidate switches (kernels/cuda/switches.h, e.g. HYPIC_ROPE_TABLE, or HYPIC_CANDIDATES for all) to "
                 "time off and on side by side: run by run for each full-prefill length and the warm splice, in "
                 "blocks of steps (off, on, on, off) for greedy decode at each batch size")
      ->delimiter(',');
  app.add_option("--json", json_path, "write the results as JSON here");
  app.add_option("--md", md_path, "write the Markdown report here");
  app.add_option("--hf-json", hf_json, "tools/hf_prefill_bench.py's JSON: fills hf_ms per prompt length");
  app.add_option("--best-json", best_json,
                 "tools/best_kernels_bench.py's JSON: the parts_vs_best table (each part next to the library's best)");
  app.add_option("--git-commit", commit,
                 "commit recorded in the results as git_commit (default: $HYPIC_GIT_COMMIT, else git); build_commit "
                 "is always the commit the binary was built from");
  app.add_option("--command", command, "command line recorded in the results (default: this program's argv)");
  std::string render;
  app.add_option("--render", render, "no GPU work: re-render the Markdown of a results JSON (to stdout and --md)");
  CLI11_PARSE(app, argc, argv);
  if (!render.empty()) {
    std::ifstream f(render);
    if (!f) throw std::runtime_error("cannot open " + render);
    const json R = json::parse(f);
    const std::string md = markdown(R);
    std::printf("%s", md.c_str());
    if (!md_path.empty()) {
      std::ofstream o(md_path);
      o << md;
      if (!o) throw std::runtime_error("cannot write " + md_path);
    }
    return 0;
  }
  if (quick) warm = 1, reps = 2, decode_warm = 1, decode_steps = 3, beside_steps = 10;
  if (seed == 0) throw std::invalid_argument("--seed must be non-zero (0 means real weights to the backend)");
  if (reps < 1 || warm < 0 || decode_steps < 1 || decode_warm < 0)
    throw std::invalid_argument("--reps / --decode-steps must be >= 1, warm-ups >= 0");
  if (segments < 1 || segment_tokens < 1 || query_tokens < 1 || decode_query < 1 || seam < 0)
    throw std::invalid_argument("--segments, --segment-tokens, --query-tokens, --decode-query-tokens must be >= 1");
  for (const std::string& a : ab_switches)
    if (!kc::is_candidate_switch(a.c_str()) && !kc::is_measured_default_switch(a.c_str()))
      throw std::invalid_argument("--ab: " + a + " is neither a candidate nor a measured-default switch "
                                  "(kernels/cuda/switches.h)");
  const std::vector<int64_t> lengths = parse_list(lengths_s, "--lengths");
  const std::vector<int64_t> batches = parse_list(batches_s, "--decode-batches");
  std::vector<int> refresh_counts;
  if (!refresh_s.empty())
    for (int64_t k : parse_list(refresh_s, "--refresh"))  // >= 1 (parse_list); k >= --segments refreshes them all
      refresh_counts.push_back(static_cast<int>(std::min<int64_t>(k, 1 << 20)));
  std::vector<int64_t> staged_rooms;
  if (!staged_s.empty()) staged_rooms = parse_list(staged_s, "--staged");  // (>= 1 entry each)
  std::vector<int> refresh_tails;
  if (!tails_s.empty())
    for (int64_t t : parse_list(tails_s, "--refresh-tail"))  // >= 1; t >= --segments recomputes every later one
      refresh_tails.push_back(static_cast<int>(std::min<int64_t>(t, 1 << 20)));
  auto skipped = [&](const char* what) {
    std::stringstream ss(skip_s);
    std::string item;
    while (std::getline(ss, item, ','))
      if (item == what) return true;
    return false;
  };
  if (command.empty())
    for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  if (commit.empty())
    if (const char* e = std::getenv("HYPIC_GIT_COMMIT")) commit = e;
  if (commit.empty()) commit = shell_line("git rev-parse HEAD 2>/dev/null");
  if (commit.empty()) commit = "unknown";

  const eng::DeviceSpec dev = eng::DeviceSpec::parse(device);
  if (dev.kind != eng::BackendKind::Cuda) throw std::invalid_argument("--device must be a CUDA device, got " + device);
  check_cuda(cudaSetDevice(dev.index), "cudaSetDevice");
  const eng::ModelConfig cfg = eng::load_config(config);
  const Dims d(cfg);
  const eng::ParameterCounts pc = eng::count_parameters(cfg);

  json J;
  J["benchmark"] = "hypic-bench-prefill-gpu";
  J["command"] = command;
  J["utc"] = utc_now();
  J["git_commit"] = commit;
  J["build_commit"] = HYPIC_BUILD_COMMIT;  // the sources this binary was built from
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, dev.index), "cudaGetDeviceProperties");
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  J["device"] = {{"name", prop.name},       {"index", dev.index}, {"sms", prop.multiProcessorCount},
                 {"memory_bytes", double(prop.totalGlobalMem)}, {"driver", driver}, {"runtime", runtime}};
  std::string pattern;
  for (int i = 0; i < cfg.num_hidden_layers; ++i)
    pattern += cfg.layer_types[size_t(i)] == eng::LayerType::Linear ? 'L' : 'F';
  J["model"] = {{"config", config},
                {"model_type", cfg.model_type},
                {"layers", cfg.num_hidden_layers},
                {"linear_layers", d.n_lin},
                {"attention_layers", d.n_attn},
                {"layer_pattern", pattern},
                {"parameters_total", double(pc.total)},
                {"parameters_active_per_token", double(pc.active_per_token)},
                {"random_weights_seed", seed},
                {"weights", "BENCHMARK-ONLY seeded random weights made on the device (text is meaningless)"}};
  J["method"] = {{"warmup", warm}, {"reps", reps}, {"quick", quick},
                 {"timing", "backend calls: wall clock (steady_clock) around the call + cudaDeviceSynchronize, the "
                            "median of the timed runs; parts: CUDA events around the part's kernels over all layers"},
                 {"flops", "GEMMs 2 x active parameters per token (LM head for the logits rows only); attention "
                           "4 T^2/2 nh hd per attention layer (causal); GDN per (64-token chunk, value head) "
                           "10 C^2 D + 6 C D^2 (bench/gpu/gdn_bench.cu); conv1d, norms, elementwise not counted"}};

  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  // ---- ceilings --------------------------------------------------------------------------------------------------
  {
    const int n = 8192;
    const double tf = kc::measure_bf16_tflops(n, stream);
    const size_t bytes = size_t(1) << 30;
    DevBuf a(bytes, "copy ceiling"), b(bytes, "copy ceiling");
    check_cuda(cudaMemset(a.as(), 1, bytes), "memset");
    const Stats c = time_gpu(
        [&] { check_cuda(cudaMemcpyAsync(b.as(), a.as(), bytes, cudaMemcpyDeviceToDevice, stream), "copy"); }, 2, 10,
        stream);
    J["ceilings"] = {{"bf16_gemm_TFLOPs", tf}, {"bf16_gemm_n", n}, {"copy_GBps", 2.0 * double(bytes) / (c.median * 1e-3) / 1e9},
                     {"copy_bytes_each_way", double(bytes)}};
    std::printf("device %s (%d SMs); measured ceilings: bf16 GEMM %.0f TFLOP/s, copy %.0f GB/s\n", prop.name,
                prop.multiProcessorCount, tf, J["ceilings"]["copy_GBps"].get<double>());
    std::fflush(stdout);
  }
  const double peak = J["ceilings"]["bf16_gemm_TFLOPs"];

  // ---- parts, standalone (before any backend holds the device's memory) ------------------------------------------
  json parts = json::array();
  if (!skipped("parts") && !d.qwen) {
    J["parts_error"] = "the standalone parts time the Qwen kernels (Gated DeltaNet, gated attention): skipped for " +
                       cfg.model_type;
  } else if (!skipped("parts")) {
    try {
      parts = measure_parts(cfg, d, lengths, warm, reps, stream, seed);
    } catch (const std::exception& e) {
      J["parts_error"] = e.what();
      std::printf("parts: FAILED: %s\n", e.what());
    }
  }

  // ---- the backend -------------------------------------------------------------------------------------------------
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 7);
  const int64_t ctx_tokens = int64_t(segments) * segment_tokens;
  const int64_t longest = std::max<int64_t>(*std::max_element(lengths.begin(), lengths.end()), ctx_tokens + query_tokens);
  if (max_batch_tokens <= 0) max_batch_tokens = (longest + 63) / 64 * 64;
  const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
  const bool want_decode = !skipped("decode");
  const int decode_seqs = want_decode ? int(max_batch) : 0;
  // KV pages: each decode context (segments + query + every decode step it takes part in), or the longest prefill.
  const bool want_beside = want_decode && !skipped("beside") && beside_batch >= 1 && beside_batch <= max_batch;
  // Each batch size is timed four times (logits to the host, greedy with the argmax on the device, sampling rows
  // picked on the host and on the device).
  // Plus, with --ab, four blocks of greedy steps per switch and batch size.
  const int64_t steps_per_seq =
      int64_t(batches.size()) * (4 + 4 * int64_t(ab_switches.size())) * (std::max(decode_warm, 2) + decode_steps) +
      (want_beside ? 3 * (beside_steps + 1) : 0);
  const int64_t pages_per_ctx = (ctx_tokens + decode_query + steps_per_seq + 63) / 64;
  const int64_t pages_prefill = (longest + 63) / 64 + 1;
  // Beside: the decode contexts and one prefill (or build) alive at once.
  const int64_t pages_beside = want_beside ? (std::max<int64_t>(beside_prefill, segment_tokens) + 63) / 64 + 1 : 0;
  const int64_t pages =
      std::max<int64_t>(int64_t(decode_seqs) * pages_per_ctx + pages_beside, pages_prefill) + 16;
  const size_t kv_bytes = kv_pool_gib > 0 ? size_t(kv_pool_gib * double(1ull << 30)) : size_t(double(pages) * d.page_bytes());
  eng::BackendOptions opt;
  opt.random_weights_seed = seed;
  opt.max_batch_tokens = max_batch_tokens;
  opt.kv_pool_bytes = kv_bytes;
  // build_entries packs at most max_sequences segments into one pass: room for every segment at once.
  opt.max_sequences = std::max({decode_seqs + 1, segments, 2});
  opt.decode_sms = decode_sms;
  opt.prefix_cache_bytes = 0;
  J["options"] = {{"max_batch_tokens", max_batch_tokens}, {"kv_pool_bytes", double(kv_bytes)},
                  {"max_sequences", opt.max_sequences}, {"kv_bytes_per_token", d.kv_bytes_per_token()}};

  // Token ids: the segments (shared by build, splice, decode), the queries.
  std::vector<std::vector<int32_t>> segs;
  for (int i = 0; i < segments; ++i) segs.push_back(random_ids(size_t(segment_tokens), d.V, rng));
  const std::vector<int32_t> query = random_ids(size_t(query_tokens), d.V, rng);

  json rows = json::array(), build = json::object(), splice = json::object(), decode = json::object(), memory;
  json beside = json::object(), ab = json::array();
  std::vector<std::shared_ptr<const eng::ResidentEntry>> entries;
  double build_with_tc = NAN;
  try {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<eng::Backend> be = eng::make_backend(dev, config, opt);
    check_cuda(cudaDeviceSynchronize(), "backend");
    const double make_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    J["backend"] = {{"numerics", std::string(be->numerics())}, {"fingerprint", be->fingerprint()},
                    {"construction_ms", make_ms}, {"weights_bytes", double(be->memory().weights)}};
    std::printf("backend %s on %s: weights %.1f GiB, made in %.0f ms (benchmark-only random weights)\n",
                std::string(be->numerics()).c_str(), device.c_str(), double(be->memory().weights) / double(1 << 30),
                make_ms);
    std::fflush(stdout);

    // Full prefill at each length: one segment of N - 1 tokens + a 1-token query.
    if (!skipped("prefill")) {
      for (int64_t N : lengths) {
        json row = {{"tokens", N}};
        try {
          eng::SplicePlan plan;
          plan.mode = eng::SpliceMode::Full;
          plan.segments.push_back({random_ids(size_t(N - 1), d.V, rng), nullptr});
          plan.query = random_ids(1, d.V, rng);
          const Stats st = time_wall(
              [&] {
                NvtxRange r("full_prefill");
                (void)be->splice(plan);
              },
              warm, reps);
          const double fl = d.total_flops(double(N), 1);
          const double tf = fl / (st.median * 1e-3) / 1e12;
          row.update({{"ours_ms", st.median}, {"ours_ms_min", st.min}, {"ours_ms_max", st.max}, {"runs", st.n},
                      {"tokens_per_s", double(N) / (st.median * 1e-3)}, {"counted_gflop", fl / 1e9},
                      {"TFLOPs", tf}, {"pct_of_bf16_gemm", 100.0 * tf / peak}});
          std::printf("full prefill %6lld tokens: %8.1f ms (min %.1f), %8.0f tokens/s, %6.1f TFLOP/s (%.1f%% of GEMM)\n",
                      (long long)N, st.median, st.min, double(N) / (st.median * 1e-3), tf, 100.0 * tf / peak);
        } catch (const std::exception& e) {
          row["error"] = e.what();
          std::printf("full prefill %lld tokens: FAILED: %s\n", (long long)N, e.what());
        }
        std::fflush(stdout);
        rows.push_back(row);
      }
    }

    // Entry build with T_C (this backend); the entries of the last run are kept for the splice and decode.
    if (!skipped("build") || !skipped("splice") || want_decode) {
      build = {{"segments", segments}, {"segment_tokens", segment_tokens}, {"seam_width", seam}};
      try {
        const int w_b = skipped("build") ? 0 : warm, r_b = skipped("build") ? 1 : reps;
        const Stats st = time_wall([&] { entries = be->build_entries(segs, seam); }, w_b, r_b,
                                  [&] { entries.clear(); });
        if (!skipped("build")) {
          build_with_tc = st.median;
          build["with_tc_ms"] = st.median;
          build["with_tc"] = st.to_json();
          build["tokens_per_s_with_tc"] = double(ctx_tokens) / (st.median * 1e-3);
          std::printf("entry build %d x %d tokens, with T_C: %.1f ms (min %.1f)\n", segments, segment_tokens, st.median,
                      st.min);
        }
      } catch (const std::exception& e) {
        build["error"] = e.what();
        std::printf("entry build: FAILED: %s\n", e.what());
      }
      std::fflush(stdout);
    }

    // Warm splice: hypic over the resident entries vs the full prefill of the same prompt.
    if (!skipped("splice") && !entries.empty()) {
      splice = {{"segments", segments}, {"segment_tokens", segment_tokens}, {"query_tokens", query_tokens},
                {"seam_width", seam}, {"mode", "hypic"}, {"prompt_tokens", ctx_tokens + query_tokens}};
      try {
        eng::SplicePlan hp;
        hp.mode = eng::SpliceMode::Hypic;
        hp.seam_width = seam;
        // The token ids travel with the entries: the refresh recomputes chosen segments whole from them.
        for (size_t i = 0; i < entries.size(); ++i) hp.segments.push_back({segs[i], entries[i]});
        hp.query = query;
        int64_t computed = 0;
        const Stats th = time_wall(
            [&] {
              NvtxRange r("hypic_splice");
              computed = be->splice(hp).computed_tokens;
            },
            warm, reps);
        eng::SplicePlan fp;
        fp.mode = eng::SpliceMode::Full;
        for (const auto& s : segs) fp.segments.push_back({s, nullptr});
        fp.query = query;
        const Stats tfull = time_wall([&] { (void)be->splice(fp); }, warm, reps);
        splice.update({{"hypic_ttft_ms", th.median}, {"hypic", th.to_json()},
                       {"hypic_computed_tokens", computed}, {"full_ms", tfull.median}, {"full", tfull.to_json()},
                       {"full_over_hypic", tfull.median / th.median}});
        std::printf("splice %d x %d + %d (hypic, w = %d): TTFT %.1f ms (%lld tokens computed); full prefill of the "
                    "same prompt %.1f ms: %.1fx\n",
                    segments, segment_tokens, query_tokens, seam, th.median, (long long)computed, tfull.median,
                    tfull.median / th.median);
        // The query-aware refresh (SplicePlan::refresh_segments = k): a probe splice that measures the query's
        // attention, then a splice with the k chosen segments recomputed whole; and its tail (refresh_tail = t: the
        // last t segments whole, no probe). With random weights the choice means nothing, but every segment has
        // the same length, so the cost does not depend on it.
        std::vector<std::pair<int, int>> refresh_plans;  // (k, t)
        for (int k : refresh_counts) refresh_plans.emplace_back(k, 0);
        for (int t : refresh_tails) {
          refresh_plans.emplace_back(0, t);
          for (int k : refresh_counts) refresh_plans.emplace_back(k, t);
        }
        json refresh_rows = json::array();
        for (const auto& [k, t] : refresh_plans) {
          eng::SplicePlan rp = hp;
          rp.refresh_segments = k;
          rp.refresh_tail = t;
          int64_t rc = 0;
          size_t recomputed = 0;
          const Stats tr = time_wall([&] {
            eng::SpliceOutput o = be->splice(rp);
            rc = o.computed_tokens;
            recomputed = o.recomputed_segments.size();
          }, warm, reps);
          refresh_rows.push_back({{"refresh_segments", k}, {"refresh_tail", t}, {"ttft_ms", tr.median},
                                  {"stats", tr.to_json()},
                                  {"computed_tokens", rc}, {"recomputed_segments", recomputed},
                                  {"full_over_refresh", tfull.median / tr.median},
                                  {"refresh_over_hypic", tr.median / th.median}});
          std::printf("splice with refresh %d, tail %d: TTFT %.1f ms (%lld tokens computed, %zu segments "
                      "recomputed): full / refresh %.1fx, refresh / hypic %.2fx\n",
                      k, t, tr.median, (long long)rc, recomputed, tfull.median / tr.median, tr.median / th.median);
        }
        if (!refresh_rows.empty()) splice["refresh"] = refresh_rows;
        // Staged: the same splice from pinned host blocks, a group at a time within a room of N entries.
        if (!staged_rooms.empty() && be->device_entries()) {
          std::vector<std::shared_ptr<const eng::HostBlock>> blocks;
          size_t entry_bytes = 0;
          for (const auto& e : entries) {
            blocks.push_back(be->copy_to_host(*e));
            entry_bytes = std::max(entry_bytes, (e->resident_bytes() + 255) / 256 * 256);
          }
          json staged_rows = json::array();
          for (const int64_t n : staged_rooms) {
            eng::SplicePlan sp = hp;
            for (size_t i = 0; i < sp.segments.size(); ++i) sp.segments[i] = {segs[i], nullptr, blocks[i]};
            sp.block_staging_bytes = size_t(n) * entry_bytes;
            eng::SpliceOutput last;
            Stats ts;
            try {  // (the previous run's sequence let go before each run, outside the timing)
              ts = time_wall([&] { last = be->splice(sp); }, warm, reps, [&] { last = {}; });
            } catch (const std::exception& e) {
              staged_rows.push_back({{"room_entries", n}, {"error", e.what()}});
              std::printf("splice staged from host blocks, room %lld entries: FAILED: %s\n", (long long)n, e.what());
              continue;
            }
            staged_rows.push_back({{"room_entries", n}, {"room_bytes", sp.block_staging_bytes},
                                   {"ttft_ms", ts.median}, {"stats", ts.to_json()},
                                   {"groups", last.staged_groups}, {"staging_bytes", last.staging_bytes},
                                   {"staged_over_resident", ts.median / th.median},
                                   {"full_over_staged", tfull.median / ts.median}});
            std::printf("splice staged from host blocks, room %lld entries: TTFT %.1f ms (%d groups, %.2f GiB "
                        "staging): staged / resident %.2fx, full / staged %.1fx\n",
                        (long long)n, ts.median, last.staged_groups, double(last.staging_bytes) / double(1ull << 30),
                        ts.median / th.median, tfull.median / ts.median);
            last = {};
          }
          splice["staged"] = staged_rows;
        }
      } catch (const std::exception& e) {
        splice["error"] = e.what();
        std::printf("splice: FAILED: %s\n", e.what());
      }
      std::fflush(stdout);
    }

    // Candidate switches off and on side by side (--ab): each full-prefill length, then the warm splice.
    for (const std::string& sw : ab_switches) {
      auto record = [&](const std::string& what, const std::pair<Stats, Stats>& r) {
        ab.push_back({{"switch", sw}, {"what", what}, {"off_ms", r.first.median}, {"on_ms", r.second.median},
                      {"off", r.first.to_json()}, {"on", r.second.to_json()},
                      {"on_over_off", r.second.median / r.first.median}});
        std::printf("A/B %s, %s: off %.2f ms, on %.2f ms (on / off %.3f)\n", sw.c_str(), what.c_str(),
                    r.first.median, r.second.median, r.second.median / r.first.median);
        std::fflush(stdout);
      };
      try {
        if (!skipped("prefill"))
          for (int64_t N : lengths) {
            eng::SplicePlan plan;
            plan.mode = eng::SpliceMode::Full;
            plan.segments.push_back({random_ids(size_t(N - 1), d.V, rng), nullptr});
            plan.query = random_ids(1, d.V, rng);
            record("full prefill " + std::to_string(N) + " tokens",
                   time_ab(sw, [&] { (void)be->splice(plan); }, warm, reps));
          }
        if (!skipped("splice") && !entries.empty()) {
          eng::SplicePlan hp;
          hp.mode = eng::SpliceMode::Hypic;
          hp.seam_width = seam;
          for (size_t i = 0; i < entries.size(); ++i) hp.segments.push_back({segs[i], entries[i]});
          hp.query = query;
          record("warm splice " + std::to_string(segments) + " x " + std::to_string(segment_tokens) + " + " +
                     std::to_string(query_tokens),
                 time_ab(sw, [&] { (void)be->splice(hp); }, warm, reps));
        }
      } catch (const std::exception& e) {
        ab.push_back({{"switch", sw}, {"error", e.what()}});
        std::printf("A/B %s: FAILED: %s\n", sw.c_str(), e.what());
      }
    }

    // Decode: contexts made by hypic splices of the cached segments + distinct queries, then batched steps.
    if (want_decode && !entries.empty()) {
      decode = {{"context_tokens", ctx_tokens + decode_query}, {"contexts", decode_seqs},
                {"decode_warmup", decode_warm}, {"decode_steps", decode_steps}, {"batches", json::array()}};
      try {
        std::vector<std::unique_ptr<eng::Sequence>> seqs;
        std::vector<double> make_ms;
        for (int i = 0; i < decode_seqs; ++i) {
          eng::SplicePlan p;
          p.mode = eng::SpliceMode::Hypic;
          p.seam_width = seam;
          for (const auto& e : entries) p.segments.push_back({{}, e});
          p.query = random_ids(size_t(decode_query), d.V, rng);
          const auto a = std::chrono::steady_clock::now();
          seqs.push_back(be->splice(p).sequence);
          make_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
        }
        decode["context_splice"] = summarize(make_ms).to_json();
        const eng::BackendMemory bm = be->memory();
        memory = {{"weights", double(bm.weights)}, {"kv_used", double(bm.kv_used)}, {"kv_budget", double(bm.kv_budget)},
                  {"entries_used", double(bm.entries_used)}, {"workspace", double(bm.workspace)}};
        size_t free_b = 0, total_b = 0;
        check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
        memory["device_free"] = double(free_b);
        memory["device_total"] = double(total_b);
        std::vector<float> logits;
        for (int64_t Bn : batches) {
          std::vector<eng::Sequence*> ptr;
          for (int64_t b = 0; b < Bn; ++b) ptr.push_back(seqs[size_t(b)].get());
          const std::vector<int32_t> toks = random_ids(size_t(Bn), d.V, rng);
          const Stats st = time_wall(
              [&] {
                NvtxRange r("decode_step");
                be->decode(ptr, toks, logits);
              },
              decode_warm, decode_steps);
          // The same steps for greedy requests (Backend::decode_step: argmax on the device, no logits copy).
          const std::vector<uint8_t> none(size_t(Bn), 0);
          eng::Backend::DecodeStepOutput step_out;
          const Stats gst = time_wall(
              [&] {
                NvtxRange r("decode_step_greedy");
                be->decode_step(ptr, toks, none, step_out);
              },
              decode_warm, decode_steps);
          // --ab over greedy decode steps: each switch off, on, on, off in blocks of steps (a flip drops the decode
          // graphs: at least 2 warm-up steps after each recapture them), each mode's time the mean of its two
          // blocks' medians.
          for (const std::string& sw : ab_switches) {
            kc::CandidateScope scope(sw);
            double sum[2] = {0, 0};
            for (const bool on : {false, true, true, false}) {
              scope.set(on);
              sum[on] += time_wall([&] { be->decode_step(ptr, toks, none, step_out); }, std::max(decode_warm, 2),
                                   decode_steps)
                             .median;
            }
            Stats off, on;
            off.median = sum[0] / 2, on.median = sum[1] / 2, off.n = on.n = 2 * decode_steps;
            ab.push_back({{"switch", sw}, {"what", "decode batch " + std::to_string(Bn) + " (greedy)"},
                          {"off_ms", off.median}, {"on_ms", on.median}, {"off", off.to_json()}, {"on", on.to_json()},
                          {"on_over_off", on.median / off.median}});
            std::printf("A/B %s, decode batch %lld (greedy): off %.2f ms, on %.2f ms (on / off %.3f)\n", sw.c_str(),
                        (long long)Bn, off.median, on.median, on.median / off.median);
            std::fflush(stdout);
          }
          // Sampling requests (temperature 0.7, top_k 20, top_p 0.8: a common serving setting; a fresh u per row
          // and step): picked on the host from the copied logits (the default), then on the device
          // (HYPIC_DEVICE_SAMPLING, kernels/cuda/sample.h), in the same call.
          const std::vector<uint8_t> sample_modes(size_t(Bn), eng::Backend::kStepSample);
          std::vector<eng::Backend::SampleDraw> sample_draws(size_t(Bn), {0.7f, 20, 0.8f, 0.5});
          std::uniform_real_distribution<double> uni(0.0, 1.0);
          auto sampled_step = [&] {
            for (auto& dr : sample_draws) dr.u = uni(rng);
            NvtxRange r("decode_step_sampled");
            be->decode_step(ptr, toks, sample_modes, step_out, sample_draws);
          };
          Stats sst_host, sst_dev;
          {
            kc::CandidateScope sw("HYPIC_DEVICE_SAMPLING");
            for (const bool on_dev : {false, true}) {
              sw.set(on_dev);  // (a flip drops the decode graphs: the warm-ups capture them again, 2 at least)
              (on_dev ? sst_dev : sst_host) = time_wall(sampled_step, std::max(decode_warm, 2), decode_steps);
            }
          }
          // Bytes one step must read (an estimate): every dense weight, the experts the batch touches (uniform
          // routing: E (1 - (1 - k/E)^B) per layer), the LM head, KV of every context, linear states in and out.
          double ctx = 0;
          for (auto* s : ptr) ctx += double(s->num_tokens());
          const double experts_touched =
              d.E ? d.E * (1 - std::pow(1 - double(d.topk) / d.E, double(Bn))) : 0.0;
          const double w_bytes = 2.0 * (d.n_lin * d.lin_proj() + d.n_attn * d.attn_proj() + double(d.V) * d.H +
                                        d.n_moe * (double(d.E) * d.H + experts_touched * 3.0 * d.I * d.H +
                                                   3.0 * d.Is * d.H) +
                                        d.n_mlp * 3.0 * d.I_dense * d.H);
          const double kv_b = ctx * d.kv_bytes_per_token();
          const double st_b = 2.0 * d.n_lin * double(Bn) * d.nv * kc::kGdnHeadDim * kc::kGdnHeadDim * 4;
          const double est = w_bytes + kv_b + st_b;
          decode["batches"].push_back({{"batch", Bn}, {"ms", st.median}, {"min_ms", st.min}, {"max_ms", st.max},
                                       {"greedy_ms", gst.median}, {"greedy_min_ms", gst.min},
                                       {"sampled_host_ms", sst_host.median}, {"sampled_device_ms", sst_dev.median},
                                       {"tokens_per_s", double(Bn) / (st.median * 1e-3)},
                                       {"mean_context_tokens", ctx / double(Bn)}, {"est_bytes", est},
                                       {"est_weight_bytes", w_bytes}, {"est_kv_bytes", kv_b},
                                       {"est_state_bytes", st_b}, {"est_GBps", est / (st.median * 1e-3) / 1e9}});
          std::printf("decode batch %3lld, contexts of %lld tokens: %.2f ms per step (min %.2f), %.0f tokens/s; greedy "
                      "(argmax on the device) %.2f ms (min %.2f); sampled (top-k 20, top-p 0.8) on the host %.2f ms, "
                      "on the device %.2f ms\n",
                      (long long)Bn, (long long)(ctx / double(Bn)), st.median, st.min, double(Bn) / (st.median * 1e-3),
                      gst.median, gst.min, sst_host.median, sst_dev.median);
          std::fflush(stdout);
        }
        if (want_beside) {
          beside = decode_beside(*be, seqs, beside_batch, beside_steps, segment_tokens, seam, beside_prefill, d.V, rng);
          beside["decode_sms"] = decode_sms;
        }
      } catch (const std::exception& e) {
        decode["error"] = e.what();
        std::printf("decode: FAILED: %s\n", e.what());
      }
    }
    entries.clear();
  } catch (const std::exception& e) {
    J["backend_error"] = e.what();
    std::printf("backend: FAILED: %s\n", e.what());
  }

  // Entry build without T_C: a second backend (the first is gone) with benchmark_skip_transitions.
  if (!skipped("build") && !skipped("notc")) {
    try {
      eng::BackendOptions o2 = opt;
      o2.benchmark_skip_transitions = true;
      o2.max_sequences = std::max(segments, 2);  // all segments in one build pass, as above
      o2.kv_pool_bytes = size_t(double(pages_prefill + 16) * d.page_bytes());
      std::unique_ptr<eng::Backend> be2 = eng::make_backend(dev, config, o2);
      std::vector<std::shared_ptr<const eng::ResidentEntry>> e2;
      const Stats st = time_wall([&] { e2 = be2->build_entries(segs, seam); }, warm, reps, [&] { e2.clear(); });
      e2.clear();
      build["without_tc_ms"] = st.median;
      build["without_tc"] = st.to_json();
      build["without_tc_option"] = "BackendOptions::benchmark_skip_transitions = true (a second backend, same seed)";
      if (std::isfinite(build_with_tc)) build["tc_overhead_pct"] = 100.0 * (build_with_tc / st.median - 1.0);
      std::printf("entry build %d x %d tokens, without T_C: %.1f ms (min %.1f)%s\n", segments, segment_tokens,
                  st.median, st.min,
                  std::isfinite(build_with_tc)
                      ? (", T_C adds " + fmt("%+.1f%%", 100.0 * (build_with_tc / st.median - 1.0))).c_str()
                      : "");
    } catch (const std::exception& e) {
      build["without_tc_error"] = e.what();
      std::printf("entry build without T_C: FAILED: %s\n", e.what());
    }
    std::fflush(stdout);
  }

  // ---- HF rows, parts' rest, targets, output -------------------------------------------------------------------
  json hf;
  if (!hf_json.empty()) {
    try {
      std::ifstream f(hf_json);
      if (!f) throw std::runtime_error("cannot open " + hf_json);
      hf = json::parse(f);
    } catch (const std::exception& e) {
      J["hf_error"] = std::string("--hf-json: ") + e.what();
      hf = nullptr;
    }
  }
  for (json& r : rows) {
    r["hf_ms"] = nullptr;
    if (!hf.is_object()) continue;
    for (const json& h : hf.value("lengths", json::array()))
      if (h.value("tokens", int64_t(-1)) == r.value("tokens", int64_t(0)) && h.contains("hf_ms") && h["hf_ms"].is_number()) {
        r["hf_ms"] = h["hf_ms"];
        r["hf_ms_measured"] = h.value("hf_ms_measured", NAN);
        r["hf_layers_timed"] = h.value("layers_timed", hf.value("layers_timed", 0));
        if (r.contains("ours_ms")) r["hf_over_ours"] = h["hf_ms"].get<double>() / r["ours_ms"].get<double>();
      }
  }
  for (json& p : parts) {
    for (const json& r : rows)
      if (r.value("tokens", int64_t(0)) == p.value("tokens", int64_t(-1)) && r.contains("ours_ms")) {
        p["end_to_end_ms"] = r["ours_ms"];
        p["rest_ms"] = r["ours_ms"].get<double>() - p["sum_ms"].get<double>();
      }
  }
  // Each part next to the best library kernel at the same shapes (tools/best_kernels_bench.py, run in the same call).
  json parts_vs_best = json::array();
  if (!best_json.empty()) {
    try {
      std::ifstream f(best_json);
      if (!f) throw std::runtime_error("cannot open " + best_json);
      const json best = json::parse(f);
      J["best"] = best;
      for (const json& p : parts)
        for (const json& b : best.value("rows", json::array())) {
          if (b.value("tokens", int64_t(-1)) != p.value("tokens", int64_t(0))) continue;
          // (our part, the library's): core attention against SDPA, the MoE block against torch's, GDN against fla
          for (const auto& [ours, lib] : {std::pair<const char*, const char*>{"attention_core", "attention"},
                                          {"moe", "moe"},
                                          {"gdn", "gdn"}}) {
            if (!p.contains(ours) || !b.contains(lib)) continue;
            const json& lb = b[lib];
            json e = {{"tokens", p["tokens"]}, {"part", ours}, {"ours_ms", p[ours].value("ms", NAN)},
                      {"ours_what", p[ours].value("what", "")}};
            if (lb.contains("ms") && lb["ms"].is_number()) {
              e["best_ms"] = lb["ms"];
              e["best_what"] = lb.contains("what")      ? lb["what"].get<std::string>()
                               : lb.contains("backend") ? "torch SDPA " + lb["backend"].get<std::string>()
                                                        : std::string(lib);
              e["ours_over_best"] = e["ours_ms"].get<double>() / lb["ms"].get<double>();
              if (lb.contains("sdpa_ms") && lb["sdpa_ms"].is_number()) e["best_sdpa_only_ms"] = lb["sdpa_ms"];
            } else {
              e["best_ms"] = nullptr;
              e["best_error"] = lb.value("error", std::string("not measured"));
            }
            parts_vs_best.push_back(e);
          }
        }
    } catch (const std::exception& e) {
      J["best_error"] = std::string("--best-json: ") + e.what();
    }
  }
  J["rows"] = rows;
  J["parts"] = parts;
  J["parts_vs_best"] = parts_vs_best;
  J["build"] = build;
  J["splice"] = splice;
  J["decode"] = decode;
  J["decode_beside"] = beside;
  J["ab"] = ab;
  J["memory"] = memory;
  J["hf"] = hf.is_object() ? hf : json(nullptr);

  json targets = json::array();
  auto target = [&](const std::string& what, const std::string& measured, json met) {
    targets.push_back({{"target", what}, {"measured", measured}, {"met", met}});
  };
  {
    double ms32 = NAN, min_ratio = NAN;
    for (const json& r : rows) {
      if (r.value("tokens", 0) == 32768 && r.contains("ours_ms")) ms32 = r["ours_ms"];
      const double q = jnum(r, "hf_over_ours");
      if (std::isfinite(q)) min_ratio = std::isfinite(min_ratio) ? std::min(min_ratio, q) : q;
    }
    target("32k full prefill at most 500 ms", fmt("%.1f ms", ms32), std::isfinite(ms32) ? json(ms32 <= 500) : json());
    target("at least 3x faster than transformers (every length)", fmt("lowest HF / ours %.2fx", min_ratio),
           std::isfinite(min_ratio) ? json(min_ratio >= 3) : json());
    const double tco = jnum(build, "tc_overhead_pct");
    target("T_C adds at most 10% to the entry build", fmt("%+.1f%%", tco), std::isfinite(tco) ? json(tco <= 10) : json());
    const double sr = jnum(splice, "full_over_hypic");
    target("warm 16 x 2k splice at least 20x below its full prefill", fmt("%.1fx", sr),
           std::isfinite(sr) ? json(sr >= 20) : json());
  }
  J["targets"] = targets;

  std::printf("\n%s", markdown(J).c_str());
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << J.dump(2) << "\n";
    if (!f) throw std::runtime_error("cannot write " + json_path);
  }
  if (!md_path.empty()) {
    std::ofstream f(md_path);
    f << markdown(J);
    if (!f) throw std::runtime_error("cannot write " + md_path);
  }
  cudaStreamDestroy(stream);
  const bool failed = J.contains("backend_error") || J.contains("parts_error");
  return failed ? 1 : 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "hypic-bench-prefill-gpu: %s\n", e.what());
  return 1;
}
