// Helpers the kernel benchmarks of bench/gpu share: hashed random fills on the device, allocation, median timing with
// CUDA events, and the H200 ceilings (device copy bandwidth, bf16 GEMM rate through cuBLAS) measured in the same run.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/cuda/cuda_check.h"

namespace hypic::bench {

using kernels::cuda::check_cuda;

/// Uniform in [0, 1) from (index, seed): a 64-bit mix (splitmix64's finaliser).
__device__ __forceinline__ float hash_uniform(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return float(x >> 40) * (1.0f / 16777216.0f);
}

/// p[0, n) <- uniform in [-amp, amp) as bf16 (amp = sqrt 3: unit variance).
__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint32_t seed, float amp = 1.7320508f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16_rn((hash_uniform(i, seed) * 2.f - 1.f) * amp);
}

/// p[0, n) <- uniform in [-amp, amp), fp32.
__global__ void fill_f32(float* p, size_t n, uint32_t seed, float amp) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = (hash_uniform(i, seed) * 2.f - 1.f) * amp;
}

/// cudaMalloc of n elements of T (at least one); throws std::runtime_error naming the size on failure.
template <class T>
T* dalloc(size_t n) {
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc(" + std::to_string(n * sizeof(T)) + " bytes)");
  return static_cast<T*>(p);
}

/// Median time in ms of `fn` over `reps` runs after `warm` warm-ups, CUDA events around each run.
inline double time_ms(const std::function<void()>& fn, int reps, int warm = 3) {
  for (int i = 0; i < warm; ++i) fn();
  check_cuda(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t(reps);
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    fn();
    cudaEventRecord(b);
    check_cuda(cudaEventSynchronize(b), "timed run");
    cudaEventElapsedTime(&t[i], a, b);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[reps / 2];
}

/// Parses "[--json PATH] [--reps N]"; prints the usage of `name` and returns false on anything else.
inline bool parse_json_reps(int argc, char** argv, const char* name, std::string& json_path, int& reps) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::stoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--json out.json] [--reps N]\n", name);
      return false;
    }
  }
  return true;
}

/// The report's header: device name, SM count (device 0) and the repetitions.
inline nlohmann::json device_header(int reps, cudaDeviceProp& prop) {
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  nlohmann::json J;
  J["device"] = prop.name;
  J["sms"] = prop.multiProcessorCount;
  J["reps"] = reps;
  return J;
}

/// Measures the ceilings into J["ceiling"]: copy_GBps (1 GiB device-to-device copy, bytes read + written) and
/// bf16_gemm_TFLOPs (8192^3 cuBLAS GEMM, fp32 accumulation).
inline void measure_ceilings(cublasHandle_t blas, nlohmann::json& J) {
  const size_t n = size_t(1) << 30;
  auto* a = dalloc<unsigned char>(n);
  auto* b = dalloc<unsigned char>(n);
  cudaMemset(a, 1, n);
  const double ms = time_ms([&] { cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice); }, 10);
  J["ceiling"]["copy_GBps"] = 2.0 * n / (ms * 1e-3) / 1e9;
  cudaFree(a);
  cudaFree(b);
  const int m = 8192;
  auto* x = dalloc<__nv_bfloat16>(size_t(m) * m);
  auto* y = dalloc<__nv_bfloat16>(size_t(m) * m);
  auto* z = dalloc<__nv_bfloat16>(size_t(m) * m);
  fill_bf16<<<1024, 256>>>(x, size_t(m) * m, 1);
  fill_bf16<<<1024, 256>>>(y, size_t(m) * m, 2);
  const float one = 1.f, zero = 0.f;
  const double gms = time_ms(
      [&] {
        cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, &one, x, CUDA_R_16BF, m, y, CUDA_R_16BF, m, &zero, z,
                     CUDA_R_16BF, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      },
      10);
  J["ceiling"]["bf16_gemm_TFLOPs"] = 2.0 * m * double(m) * m / (gms * 1e-3) / 1e12;
  cudaFree(x);
  cudaFree(y);
  cudaFree(z);
}

}  // namespace hypic::bench
