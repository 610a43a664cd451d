// Helpers for the GPU tests: an owning device buffer, bf16 conversions, random inputs shaped like Gated DeltaNet
// activations, relative-error measures, a host-side paged KV pool (attention), and the MoE / MLP layers with their CPU
// fp32 references (test_gpu_moe, test_gpu_ops_table).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/switches.h"

namespace hypic::gputest {

using kernels::cuda::check_cuda;

/// Owning device allocation of n elements of T (cudaMalloc / cudaFree).
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n) check_cuda(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)), "cudaMalloc(" + std::to_string(n * sizeof(T)) + " bytes)");
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    if (host.size() != n_) throw std::invalid_argument("DeviceBuffer::upload: size mismatch");
    if (n_) check_cuda(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_) check_cuda(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  /// Fills every byte with `byte` (0xFF gives NaN in fp32 and bf16: catches unwritten outputs).
  void poison(int byte = 0xFF) {
    if (n_) check_cuda(cudaMemset(p_, byte, n_ * sizeof(T)), "cudaMemset");
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// Sets the candidate switch `name` (kernels/cuda/switches.h) on or off for this scope, so one test runs a kernel's
// candidate path and its default path in one process; the variable's old value comes back at the end of the scope.
struct ScopedCandidate : kernels::cuda::CandidateScope {
  ScopedCandidate(const char* name, bool on) : CandidateScope(name) { set(on); }
};

inline float bf16_to_float(__nv_bfloat16 x) {
  uint16_t b;
  std::memcpy(&b, &x, 2);
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// Round-to-nearest-even fp32 -> bf16 (NaN kept NaN).
inline __nv_bfloat16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t b;
  if (std::isnan(f)) {
    b = 0x7FC0;
  } else {
    u += 0x7FFFu + ((u >> 16) & 1u);
    b = static_cast<uint16_t>(u >> 16);
  }
  __nv_bfloat16 x;
  std::memcpy(&x, &b, 2);
  return x;
}

/// The fp32 values of bf16 values.
inline std::vector<float> to_float(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_float(v[i]);
  return f;
}

/// n bf16 values ~ N(0, sigma), and their exact fp32 values in `as_float`.
inline std::vector<__nv_bfloat16> random_bf16(std::mt19937& rng, size_t n, float sigma, std::vector<float>& as_float) {
  std::normal_distribution<float> d(0.f, sigma);
  std::vector<__nv_bfloat16> out(n);
  as_float.resize(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = float_to_bf16(d(rng));
    as_float[i] = bf16_to_float(out[i]);
  }
  return out;
}

/// Log decays like Qwen3.5's g = -exp(A_log) softplus(a + dt_bias): mostly slow (so that T_C over
/// a thousand tokens stays far from fp32 underflow), 2% strong.
inline std::vector<float> random_log_decay(std::mt19937& rng, size_t n) {
  std::uniform_real_distribution<float> u(0.f, 1.f);
  std::vector<float> g(n);
  for (auto& x : g) x = u(rng) < 0.02f ? -1.f * u(rng) : -0.02f * u(rng);
  return g;
}

/// Write strengths b = sigmoid(.) in (0, 1).
inline std::vector<float> random_beta(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> d(0.f, 1.5f);
  std::vector<float> b(n);
  for (auto& x : b) x = 1.f / (1.f + std::exp(-d(rng)));
  return b;
}

/// ||a - b|| / ||b|| over [offset, offset + n); NaN anywhere gives +inf.
inline double rel_err(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

/// True when a CUDA device is present and usable.
inline bool cuda_device_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

/// One CUDA graph captured from `fn` on stream `st` (warm the shapes and workspaces first: a new call shape cannot be
/// planned during capture; a throw inside fn ends the capture and rethrows); replay() first finishes work on the
/// legacy default stream (cudaMemset / cudaMemcpy of the test), which a non-blocking stream does not wait for.
struct CapturedGraph {
  cudaStream_t st;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  template <class F>
  CapturedGraph(cudaStream_t s, F&& fn) : st(s) {
    check_cuda(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "begin capture");
    try {
      fn();
    } catch (...) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(st, &g);
      if (g) cudaGraphDestroy(g);
      throw;
    }
    check_cuda(cudaStreamEndCapture(st, &graph), "end capture");
    check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
  void replay() {
    check_cuda(cudaDeviceSynchronize(), "default-stream work before the replay");
    check_cuda(cudaGraphLaunch(exec, st), "graph launch");
    check_cuda(cudaStreamSynchronize(st), "graph replay");
  }
};

// ---- attention: bf16 bits and a paged KV pool on the host (kernels/cuda/attention.h kKvPageTokens layout) ----

inline float bfr(float x) { return bf16_to_float(float_to_bf16(x)); }

// The number of kernel nodes of a CUDA graph captured from fn() on stream st (fn launches on st): which kernels a
// call runs (e.g. one fused launch or two).
template <class F>
inline size_t captured_kernels(cudaStream_t st, F&& fn) {
  cudaGraph_t g = nullptr;
  check_cuda(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "begin capture");
  try {
    fn();
  } catch (...) {
    cudaStreamEndCapture(st, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  check_cuda(cudaStreamEndCapture(st, &g), "end capture");
  size_t n = 0;
  check_cuda(cudaGraphGetNodes(g, nullptr, &n), "cudaGraphGetNodes");
  std::vector<cudaGraphNode_t> nodes(n);
  if (n) check_cuda(cudaGraphGetNodes(g, nodes.data(), &n), "cudaGraphGetNodes");
  size_t kernels = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType t;
    check_cuda(cudaGraphNodeGetType(node, &t), "cudaGraphNodeGetType");
    kernels += t == cudaGraphNodeTypeKernel;
  }
  cudaGraphDestroy(g);
  return kernels;
}

// Whether two host arrays hold the same bits (NaN poison included, which == would call unequal).
template <class T>
inline bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

inline __nv_bfloat16 nan_bf16() {
  const uint16_t b = 0xFFFF;
  __nv_bfloat16 x;
  std::memcpy(&x, &b, 2);
  return x;
}

inline uint16_t bits(__nv_bfloat16 x) {
  uint16_t b;
  std::memcpy(&b, &x, 2);
  return b;
}

// A paged KV pool on the host: pages handed out from a shuffled list, unwritten rows NaN.
struct HostPool {
  static constexpr int kPage = kernels::cuda::kKvPageTokens;
  int hkv, hd, pages;
  std::vector<__nv_bfloat16> k, v;
  std::vector<int> order;
  size_t next = 0;
  HostPool(int pages_, int hkv_, int hd_, std::mt19937& rng) : hkv(hkv_), hd(hd_), pages(pages_), order(pages_) {
    k.assign(size_t(pages) * kPage * hkv * hd, nan_bf16());
    v = k;
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
  }
  size_t row_elems() const { return size_t(hkv) * hd; }
  std::vector<int> take(int slots) {
    const size_t n = (slots + kPage - 1) / kPage;
    if (next + n > order.size()) throw std::logic_error("HostPool: out of pages");
    std::vector<int> p(order.begin() + next, order.begin() + next + n);
    next += n;
    return p;
  }
};

// One sequence's KV: kv_len slots of random K/V written into the pool at its (shuffled) pages; k, v keep
// the exact values as fp32 [kv_len][hkv][hd].
struct Seq {
  int kv_len = 0;
  std::vector<int> pages;
  std::vector<float> k, v;
};

inline Seq make_seq(HostPool& pool, int kv_len, std::mt19937& rng) {
  Seq s;
  s.kv_len = kv_len;
  s.pages = pool.take(kv_len);
  const size_t row = pool.row_elems();
  const auto kb = random_bf16(rng, size_t(kv_len) * row, 1.0f, s.k);
  const auto vb = random_bf16(rng, size_t(kv_len) * row, 1.0f, s.v);
  for (int slot = 0; slot < kv_len; ++slot) {
    const size_t r = size_t(s.pages[slot / HostPool::kPage]) * HostPool::kPage + slot % HostPool::kPage;
    std::copy(kb.begin() + slot * row, kb.begin() + (slot + 1) * row, pool.k.begin() + r * row);
    std::copy(vb.begin() + slot * row, vb.begin() + (slot + 1) * row, pool.v.begin() + r * row);
  }
  return s;
}

// ---- MoE / MLP layers (kernels/cuda/moe.h) and their CPU fp32 references ----

// Fast deterministic generator (splitmix64); values uniform with the given standard deviation.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return float(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
  float sym(float sigma) { return (2.0f * uniform() - 1.0f) * sigma * 1.7320508f; }
};

inline std::vector<__nv_bfloat16> rand_bf16(Rng& r, size_t n, float sigma, std::vector<float>& as_float) {
  std::vector<__nv_bfloat16> out(n);
  as_float.resize(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = float_to_bf16(r.sym(sigma));
    as_float[i] = bf16_to_float(out[i]);
  }
  return out;
}

inline std::vector<float> rand_f32(Rng& r, size_t n, float sigma) {
  std::vector<float> v(n);
  for (auto& x : v) x = r.sym(sigma);
  return v;
}

struct Err {
  double max_rel = 0;  // max |a - b| / max |b|
  double fro = 0;      // ||a - b|| / ||b||
};
// a vs b over n values, optionally after subtracting `base` from a (outputs accumulated into base).
inline Err compare(const float* a, const float* b, size_t n, const float* base = nullptr) {
  double mx = 0, md = 0, num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double av = double(a[i]) - (base ? double(base[i]) : 0.0);
    if (!std::isfinite(a[i])) return {INFINITY, INFINITY};
    const double d = av - double(b[i]);
    mx = std::max(mx, std::fabs(double(b[i])));
    md = std::max(md, std::fabs(d));
    num += d * d;
    den += double(b[i]) * b[i];
  }
  return {md / (mx > 0 ? mx : 1.0), std::sqrt(num / (den > 0 ? den : 1.0))};
}

// A non-blocking CUDA stream.
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(s); }
};

// ---------------------------------------------------------------------------------------------
// MoE layer on host (fp32 copies of bf16 values) and device, and the CPU reference
// ---------------------------------------------------------------------------------------------

struct MoeCfg {
  int E, topk, H, I, Is;
  bool shared_gate = true;  // the shared expert's sigmoid gate (Qwen); false: added ungated (Kimi, Ring)
};

struct HostMoe {
  MoeCfg c;
  std::vector<float> router, gate_up, down, s_gate_up, s_down, s_gate;  // fp32 of the bf16 weights
  std::optional<DeviceBuffer<__nv_bfloat16>> d_router, d_gate_up, d_down, d_s_gate_up, d_s_down, d_s_gate;
  // hot_experts = n: router[e][e] = 2.5 for e < n (n <= H), so that x[t][e] = 4 (set by the test) adds 10 to
  // expert e's logit: with n = 1 and x[t][0] = 4 every token picks expert 0.
  HostMoe(const MoeCfg& cfg, uint64_t seed, int hot_experts = 0) : c(cfg) {
    Rng r(seed);
    const float sh = 1.0f / std::sqrt(float(c.H));
    // Router logits ~ N(0, 1.5^2): a spread-out softmax with few near-ties.
    std::vector<__nv_bfloat16> rb = rand_bf16(r, size_t(c.E) * c.H, 1.5f * sh, router);
    for (int e = 0; e < hot_experts; ++e) {
      rb[size_t(e) * c.H + e] = float_to_bf16(2.5f);
      router[size_t(e) * c.H + e] = 2.5f;
    }
    d_router.emplace(rb);
    d_gate_up.emplace(rand_bf16(r, size_t(c.E) * 2 * c.I * c.H, sh, gate_up));
    d_down.emplace(rand_bf16(r, size_t(c.E) * c.H * c.I, 1.0f / std::sqrt(float(c.I)), down));
    if (c.Is > 0) {
      d_s_gate_up.emplace(rand_bf16(r, size_t(2) * c.Is * c.H, sh, s_gate_up));
      d_s_down.emplace(rand_bf16(r, size_t(c.H) * c.Is, 1.0f / std::sqrt(float(c.Is)), s_down));
      if (c.shared_gate) d_s_gate.emplace(rand_bf16(r, size_t(c.H), sh, s_gate));
    }
  }
  kernels::cuda::MoeWeightsView view(bool renorm) const {
    kernels::cuda::MoeWeightsView v;
    v.E = c.E, v.H = c.H, v.I = c.I, v.topk = c.topk, v.renormalize = renorm;
    v.router = d_router->get(), v.experts_gate_up = d_gate_up->get(), v.experts_down = d_down->get();
    v.Is = c.Is;
    if (c.Is > 0)
      v.shared_gate_up = d_s_gate_up->get(), v.shared_down = d_s_down->get(),
      v.shared_gate = c.shared_gate ? d_s_gate->get() : nullptr;
    return v;
  }
};

// SwiGLU MLP in fp32 (Model::mlp_block): out = down(silu(x G^T) * (x U^T)), gate_up = [G; U].
inline void mlp_ref(int64_t T, int64_t H, int64_t I, const float* x, const float* gate_up, const float* down,
                    float* out) {
  std::vector<float> g(size_t(T) * I), u(size_t(T) * I);
  kernels::cpu::linear(T, H, I, x, gate_up, g.data());
  kernels::cpu::linear(T, H, I, x, gate_up + size_t(I) * H, u.data());
  for (size_t i = 0; i < g.size(); ++i) g[i] = kernels::cpu::silu(g[i]) * u[i];
  kernels::cpu::linear(T, I, H, g.data(), down, out);
}

// The experts of an MoE block in fp32 on the host copies (Model::moe_block after routing): routed[e] lists the
// (token, weight) pairs of expert e; plus the shared expert, gated by sigmoid(x . s_gate) when the layer has the
// gate.
inline std::vector<float> moe_experts_ref(const HostMoe& m, const std::vector<std::vector<std::pair<int, float>>>& routed,
                                          int T, const float* x) {
  const int E = m.c.E;
  const int64_t H = m.c.H, I = m.c.I, Is = m.c.Is;
  std::vector<float> out(size_t(T) * H, 0.f), xe, gu, act, ye;
  for (int e = 0; e < E; ++e) {
    const auto& list = routed[e];
    if (list.empty()) continue;
    const int64_t n = int64_t(list.size());
    xe.resize(size_t(n) * H), gu.resize(size_t(n) * 2 * I), act.resize(size_t(n) * I), ye.resize(size_t(n) * H);
    for (int64_t r = 0; r < n; ++r) std::copy(x + size_t(list[r].first) * H, x + size_t(list[r].first + 1) * H,
                                              xe.data() + size_t(r) * H);
    kernels::cpu::linear(n, H, 2 * I, xe.data(), m.gate_up.data() + size_t(e) * 2 * I * H, gu.data());
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < I; ++j)
        act[size_t(r) * I + j] = kernels::cpu::silu(gu[size_t(r) * 2 * I + j]) * gu[size_t(r) * 2 * I + I + j];
    kernels::cpu::linear(n, I, H, act.data(), m.down.data() + size_t(e) * H * I, ye.data());
    for (int64_t r = 0; r < n; ++r) {
      float* dst = out.data() + size_t(list[r].first) * H;
      for (int64_t j = 0; j < H; ++j) dst[j] += ye[size_t(r) * H + j] * list[r].second;
    }
  }
  if (Is > 0) {
    std::vector<float> shared(size_t(T) * H), sg(T);
    mlp_ref(T, H, Is, x, m.s_gate_up.data(), m.s_down.data(), shared.data());
    if (m.c.shared_gate) kernels::cpu::linear(T, H, 1, x, m.s_gate.data(), sg.data());
    for (int t = 0; t < T; ++t) {
      const float g = m.c.shared_gate ? kernels::cpu::sigmoid(sg[t]) : 1.0f;
      for (int64_t j = 0; j < H; ++j) out[size_t(t) * H + j] += g * shared[size_t(t) * H + j];
    }
  }
  return out;
}

// Model::moe_block in fp32 on the host copies; also each token's top-k set (ascending) and
// whether its k-th / (k+1)-th probabilities are a near-tie (routing may legitimately differ).
inline std::vector<float> moe_ref(const HostMoe& m, bool renorm, int T, const float* x,
                                  std::vector<std::vector<int>>& sets, std::vector<char>& near_tie) {
  const int E = m.c.E, k = m.c.topk;
  const int64_t H = m.c.H;
  std::vector<float> probs(size_t(T) * E);
  kernels::cpu::linear(T, H, E, x, m.router.data(), probs.data());
  kernels::cpu::softmax_rows(T, E, probs.data(), E);
  std::vector<std::vector<std::pair<int, float>>> routed(E);
  sets.assign(T, {});
  near_tie.assign(T, 0);
  std::vector<int> order(E);
  for (int t = 0; t < T; ++t) {
    const float* p = probs.data() + size_t(t) * E;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + std::min(k + 1, E), order.end(),
                      [p](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    if (k < E && p[order[k - 1]] - p[order[k]] <= 1e-4f * p[order[k - 1]]) near_tie[t] = 1;
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += p[order[j]];
    for (int j = 0; j < k; ++j) {
      routed[order[j]].emplace_back(t, renorm ? p[order[j]] / sum : p[order[j]]);
      sets[t].push_back(order[j]);
    }
    std::sort(sets[t].begin(), sets[t].end());
  }
  return moe_experts_ref(m, routed, T, x);
}

}  // namespace hypic::gputest
