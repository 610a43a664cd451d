// Helpers for the GPU tests and the GPU benchmark: an owning device buffer, bf16 conversions,
// random inputs shaped like Gated DeltaNet activations, and relative-error measures.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"

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

}  // namespace hypic::gputest
