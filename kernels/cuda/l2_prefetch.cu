// L2 prefetch of weights (see l2_prefetch.h).
#include "kernels/cuda/l2_prefetch.h"

#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace hypic::kernels::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kBlocks = 4;
constexpr unsigned kPiece = 16384;  // bytes per bulk prefetch instruction

struct Ranges {
  const char* p[kL2PrefetchMaxRanges];
  unsigned long long bytes[kL2PrefetchMaxRanges];
  int n;
};

// Pieces [0, count) of one range, strided over the grid's threads.
__device__ __forceinline__ void prefetch_range(const char* p, unsigned long long bytes, unsigned thread,
                                               unsigned threads) {
  const unsigned long long pieces = (bytes + kPiece - 1) / kPiece;
  for (unsigned long long i = thread; i < pieces; i += threads) {
    const char* a = p + i * kPiece;
    const unsigned len = static_cast<unsigned>(bytes - i * kPiece < kPiece ? bytes - i * kPiece : kPiece);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(a), "r"(len) : "memory");
#else
    for (unsigned o = 0; o < len; o += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(a + o));
#endif
  }
}

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(Ranges r) {
  const unsigned thread = blockIdx.x * blockDim.x + threadIdx.x, threads = gridDim.x * blockDim.x;
  for (int i = 0; i < r.n; ++i) prefetch_range(r.p[i], r.bytes[i], thread, threads);
}

// One block per pick.
__global__ void __launch_bounds__(kThreads) l2_prefetch_experts_kernel(const int* topk_e, int num_experts,
                                                                        const char* base,
                                                                        unsigned long long expert_bytes) {
  const int e = topk_e[blockIdx.x];
  if (e < 0 || e >= num_experts) return;
  prefetch_range(base + static_cast<unsigned long long>(e) * expert_bytes, expert_bytes, threadIdx.x, blockDim.x);
}

}  // namespace

void l2_prefetch(const L2Range* ranges, int n, cudaStream_t stream) {
  if (n < 0 || n > kL2PrefetchMaxRanges || (n > 0 && !ranges))
    throw std::invalid_argument("l2_prefetch: " + std::to_string(n) + " ranges (0 .. " +
                                std::to_string(kL2PrefetchMaxRanges) + ")");
  Ranges r{};
  for (int i = 0; i < n; ++i) {
    const L2Range& x = ranges[i];
    const size_t bytes = x.bytes / 16 * 16;
    if (!x.p || bytes == 0) continue;
    if (reinterpret_cast<uintptr_t>(x.p) % 16)
      throw std::invalid_argument("l2_prefetch: a range's address is not 16-byte aligned");
    r.p[r.n] = static_cast<const char*>(x.p);
    r.bytes[r.n++] = bytes;
  }
  if (r.n == 0) return;
  l2_prefetch_kernel<<<kBlocks, kThreads, 0, stream>>>(r);
  check_cuda(cudaGetLastError(), "l2_prefetch launch");
}

void l2_prefetch_experts(int picks, const int* topk_e, int num_experts, const void* base, size_t expert_bytes,
                         cudaStream_t stream) {
  if (picks < 0) throw std::invalid_argument("l2_prefetch_experts: picks = " + std::to_string(picks));
  if (reinterpret_cast<uintptr_t>(base) % 16 || expert_bytes % 16)
    throw std::invalid_argument("l2_prefetch_experts: base and expert_bytes must be multiples of 16 bytes");
  if (picks == 0 || !topk_e || !base || expert_bytes == 0) return;
  l2_prefetch_experts_kernel<<<picks, kThreads, 0, stream>>>(topk_e, num_experts, static_cast<const char*>(base),
                                                             expert_bytes);
  check_cuda(cudaGetLastError(), "l2_prefetch_experts launch");
}

size_t l2_prefetch_budget() {
  static std::mutex mu;
  static std::map<int, size_t> by_device;
  const int dev = current_device();
  std::lock_guard<std::mutex> lock(mu);
  auto it = by_device.find(dev);
  if (it == by_device.end()) {
    int l2 = 0;
    check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev), "cudaDeviceGetAttribute(L2 size)");
    it = by_device.emplace(dev, size_t(l2) / 2).first;
  }
  return it->second;
}

int l2_prefetch_fit(L2Range* ranges, int n, size_t budget) {
  size_t used = 0;
  for (int i = 0; i < n; ++i) {
    if (used + ranges[i].bytes > budget) {
      ranges[i].bytes = budget - used;
      return ranges[i].bytes ? i + 1 : i;
    }
    used += ranges[i].bytes;
  }
  return n;
}

void fork_stream(cudaStream_t stream, cudaEvent_t fork, cudaStream_t side) {
  check_cuda(cudaEventRecord(fork, stream), "fork_stream: event record");
  check_cuda(cudaStreamWaitEvent(side, fork, 0), "fork_stream: stream wait");
}

}  // namespace hypic::kernels::cuda
