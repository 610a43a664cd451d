// Device sampling of decode rows (contract in sample.h): the host's Sampler::pick (engine/sampling.cpp) step by step.
#include "kernels/cuda/sample.h"

#include <climits>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace hypic::kernels::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kLoads = 2;  // row elements each thread loads before using them (loads in flight per pass)

// Every pass over a row: f(i, x) for each element i < V (x = row[i]; i >= V: f(i, 0.f) too, so that every thread
// calls the warp and block collectives inside f the same number of times), in chunks of kThreads consecutive
// elements in ascending order, each thread's kLoads loads issued before its first f.
template <class F>
__device__ __forceinline__ void for_row(const float* __restrict__ row, int V, F f) {
  for (int base = 0; base < V; base += kLoads * kThreads) {
    float x[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = base + j * kThreads + int(threadIdx.x);
      x[j] = i < V ? row[i] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) f(base + j * kThreads + int(threadIdx.x), x[j]);
  }
}
static_assert(kSampleMaxTopK == kThreads, "one candidate slot per thread in the sort");

// An order-preserving key of a non-NaN float: a larger float has a larger key; -0.0 and +0.0 get the same key (the
// host compares them equal and breaks the tie by id).
__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) == 0) u = 0;  // -0.0 -> +0.0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// hist[bin] += 1 for every lane with valid set, one shared atomic per distinct bin of the warp (logits cluster in a
// few top-byte bins: per-lane atomics on them serialise).
__device__ __forceinline__ void hist_add(unsigned* hist, unsigned bin, bool valid) {
  const unsigned active = __ballot_sync(0xffffffffu, valid);
  if (!valid) return;
  const unsigned same = __match_any_sync(active, bin);
  if ((threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], unsigned(__popc(same)));
}

// Exclusive prefix count of `flag` over the block's threads in thread order; total: the block's count. Every thread
// calls it; s_w: kWarps ints of shared scratch (free again when it returns).
__device__ __forceinline__ int block_rank(bool flag, int* s_w, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned b = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) s_w[warp] = __popc(b);
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kWarps; ++w) {  // (32 shared reads, broadcast)
    const int c = s_w[w];
    before += w < warp ? c : 0;
    all += c;
  }
  __syncthreads();
  total = all;
  return before + __popc(b & ((1u << lane) - 1u));
}

__global__ void __launch_bounds__(kThreads, 1) sample_rows_kernel(int V, const float* __restrict__ x, long ldx,
                                                               const int32_t* __restrict__ rows,
                                                               const SampleRowDraw* __restrict__ draws,
                                                               int32_t* __restrict__ out) {
  __shared__ unsigned hist[256];
  __shared__ unsigned long long cand[kThreads];  // (key << 32) | (0xFFFFFFFF - id), sorted descending
  __shared__ double ev[kThreads];
  __shared__ int s_w[kWarps];
  __shared__ int s_nan, s_count;
  __shared__ unsigned s_kmax, s_prefix, s_krem, s_first;
  const int r = blockIdx.x, tid = threadIdx.x;
  const float* row = x + long(rows ? rows[r] : r) * ldx;
  const SampleRowDraw d = draws[r];
  if (tid < 256) hist[tid] = 0;
  if (tid == 0) s_nan = INT_MAX, s_kmax = 0, s_count = 0, s_first = UINT_MAX;
  __syncthreads();

  // Pass 0: the lowest NaN, the largest key, the histogram of the keys' top bytes.
  int nan_i = INT_MAX;
  unsigned kmax = 0;
  for_row(row, V, [&](int i, float f) {
    const bool nan = i < V && isnan(f);
    if (nan && nan_i == INT_MAX) nan_i = i;
    const unsigned key = order_key(f);
    const bool valid = i < V && !nan;
    if (valid) kmax = max(kmax, key);
    hist_add(hist, key >> 24, valid);
  });
  if (nan_i != INT_MAX) atomicMin(&s_nan, nan_i);
  atomicMax(&s_kmax, kmax);
  __syncthreads();
  if (s_nan != INT_MAX) {
    if (tid == 0) out[r] = -1 - s_nan;
    return;
  }
  const float fmax = key_float(s_kmax);
  if (!isfinite(fmax)) {  // all -inf, or a +inf (the host's sample_row: no finite maximum)
    if (tid == 0) out[r] = INT32_MIN;
    return;
  }
  if (d.temperature == 0.f) {  // Sampler::pick: the argmax, the lowest index of the maximum
    for (int i = tid; i < V; i += kThreads)
      if (order_key(row[i]) == s_kmax) {
        atomicMin(&s_first, unsigned(i));
        break;
      }
    __syncthreads();
    if (tid == 0) out[r] = int32_t(s_first);
    return;
  }

  // Radix selection of the k-th largest key, a byte per pass from the top: prefix holds the bytes chosen so far,
  // krem how many of the keys with that prefix are still to take.
  const int k = max(1, min(d.top_k, kThreads));
  if (tid == 0) s_prefix = 0, s_krem = unsigned(k);
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    if (pass > 0) {
      const unsigned mask = 0xFFFFFFFFu << (shift + 8), prefix = s_prefix;
      for_row(row, V, [&](int i, float f) {
        const unsigned key = order_key(f);
        hist_add(hist, (key >> shift) & 255u, i < V && (key & mask) == prefix);
      });
      __syncthreads();
    }
    if (tid == 0) {  // the bin holding the krem-th largest of the prefix's keys
      unsigned above = 0, krem = s_krem;
      int b = 255;
      for (; b > 0; --b) {
        if (above + hist[b] >= krem) break;
        above += hist[b];
      }
      s_krem = krem - above;
      s_prefix |= unsigned(b) << shift;
    }
    __syncthreads();
    if (tid < 256) hist[tid] = 0;
    __syncthreads();
  }
  const unsigned kth = s_prefix, need = s_krem;  // take every key > kth and the `need` lowest ids of key == kth

  // Gather the k candidates: keys above kth in any order, the ties in id order (block ranks, chunk by chunk).
  int eq_seen = 0;  // ties before this chunk (every thread keeps the same count)
  for_row(row, V, [&](int i, float f) {
    const unsigned key = order_key(f);
    const bool gt = i < V && key > kth, eq = i < V && key == kth;
    int eq_total = 0;
    const int rank = block_rank(eq, s_w, eq_total);
    if (gt || (eq && eq_seen + rank < int(need))) {
      const int slot = atomicAdd(&s_count, 1);
      if (slot < kThreads) cand[slot] = (static_cast<unsigned long long>(key) << 32) | (0xFFFFFFFFu - unsigned(i));
    }
    eq_seen += eq_total;
  });
  __syncthreads();
  const int kc = min(s_count, kThreads);  // == k for a valid draw (1 <= top_k <= min(V - 1, kSampleMaxTopK))
  if (tid >= kc) cand[tid] = 0ull;        // below every real key (0 is the key of no float)
  __syncthreads();
  // Bitonic sort of the kThreads slots, descending.
  for (int size = 2; size <= kThreads; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const int j = tid ^ stride;
      if (j > tid) {
        const unsigned long long a = cand[tid], b = cand[j];
        const bool desc = (tid & size) == 0;
        if (desc ? a < b : a > b) cand[tid] = b, cand[j] = a;
      }
      __syncthreads();
    }
  }

  // Sampler::distribution and pick in double: scores logit / T, e = exp(score - max), in candidate order.
  const double T = double(d.temperature);
  const double mx = double(key_float(unsigned(cand[0] >> 32))) / T;
  if (tid < kc) ev[tid] = exp(double(key_float(unsigned(cand[tid] >> 32))) / T - mx);
  __syncthreads();
  if (tid != 0) return;
  auto id_of = [&](int j) { return int32_t(0xFFFFFFFFu - unsigned(cand[j] & 0xFFFFFFFFull)); };
  double z = 0.0;
  for (int j = 0; j < kc; ++j) z += ev[j];
  int keep = kc;
  double cum = 1.0;  // top-p renormaliser (1: none)
  if (d.top_p < 1.0f) {
    double c = 0.0;
    keep = 0;
    while (keep < kc) {
      c += ev[keep] / z;
      ++keep;
      if (c >= double(d.top_p)) break;
    }
    cum = c;
  }
  auto prob = [&](int j) { return d.top_p < 1.0f ? (ev[j] / z) / cum : ev[j] / z; };
  double walk = 0.0;
  for (int j = 0; j < keep; ++j) {
    walk += prob(j);
    if (d.u < walk) {
      out[r] = id_of(j);
      return;
    }
  }
  for (int j = keep - 1; j >= 0; --j)  // rounding left the total a hair below u: the last non-zero candidate
    if (prob(j) > 0.0) {
      out[r] = id_of(j);
      return;
    }
  out[r] = id_of(keep - 1);
}

}  // namespace

void sample_rows(int n, int V, const float* x, long ldx, const int32_t* rows, const SampleRowDraw* draws,
                 int32_t* out, cudaStream_t stream) {
  if (n < 0 || V <= 0 || ldx < V)
    throw std::invalid_argument("sample_rows: need n >= 0, V > 0 and ldx >= V; got n=" + std::to_string(n) +
                                " V=" + std::to_string(V) + " ldx=" + std::to_string(ldx));
  if (n == 0) return;
  if (!x || !draws || !out) throw std::invalid_argument("sample_rows: null pointer");
  sample_rows_kernel<<<n, kThreads, 0, stream>>>(V, x, ldx, rows, draws, out);
  check_cuda(cudaGetLastError(), "sample_rows launch");
}

}  // namespace hypic::kernels::cuda
