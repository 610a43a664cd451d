// The host-side plan of attention_prefill's cuDNN route (kernels/cuda/attention.h): which query groups go to cuDNN's
// fused SDPA, batched into which calls, on which plan shapes (the padded length buckets of the candidate switch
// HYPIC_ATTN_CUDNN_BUCKETS included). Host only, no CUDA: attention.cu runs it, tests/unit/test_cudnn_route.cpp checks
// it on the CPU.
#pragma once
#include <algorithm>
#include <climits>
#include <vector>

namespace hypic::kernels::cuda::detail {

/// KV slots gathered per cuDNN call (batched groups together, padding included; a longer single group stays on our
/// kernels): bounds the gather scratch to 2 x 2^17 x num_kv_heads x head_dim bf16 (256 MiB at 2 x 256).
inline constexpr long kCudnnMaxRunRows = 1L << 17;

/// The length bucket of HYPIC_ATTN_CUDNN_BUCKETS: the smallest multiple of 2^(floor(log2 len) - 4) at or above len,
/// i.e. 16 buckets per octave, at most len / 16 padding (4096, 4352, ..., 7936, 8192, 8704, ...); len itself below
/// 16 and for len <= 0. A cuDNN plan is compiled per shape, so padding to buckets lets one plan serve every length of
/// its bucket.
inline int cudnn_length_bucket(int len) {
  if (len < 16) return len;
  int k = 0;
  while ((2L << k) <= len) ++k;  // 2^k <= len < 2^(k+1)
  const long step = 1L << (k - 4);
  return static_cast<int>(std::min<long>((len + step - 1) / step * step, INT_MAX));
}

/// One cuDNN call: the b consecutive groups group0 .. group0 + b - 1, each of q_len queries over kv_len KV slots
/// (slot0 + q_len; their query rows q0 .. q0 + b * q_len - 1), on a plan of s_q queries over s_kv slots per group:
/// (q_len, kv_len) unpadded, or with buckets (q_len's bucket, the bucket of that + slot0: so that the plan's diagonal
/// offset s_kv - s_q is at least the real kv_len - q_len).
struct CudnnRunPlan {
  int group0 = 0, q0 = 0, b = 0;
  int q_len = 0, kv_len = 0;
  int s_q = 0, s_kv = 0;
};

/// The cuDNN runs of one attention_prefill call: group i holds q_start[i + 1] - q_start[i] queries at slot0[i]
/// (host arrays of num_groups + 1 and num_groups entries, checked by the caller: non-negative lengths, q_start[0] = 0).
/// Groups of at least min_q queries are cuDNN's (empty groups are skipped); consecutive ones of equal (q_len, slot0)
/// share a run while b * s_kv <= kCudnnMaxRunRows. Fills `runs` (cleared first) and `others` (whether a non-empty
/// group stays on our kernels). Returns false, meaning that our kernels run the whole call, when a cuDNN group alone
/// needs more than kCudnnMaxRunRows KV slots (padded ones with buckets); `runs` is then unspecified.
inline bool plan_cudnn_runs(int num_groups, const int* q_start, const int* slot0, int min_q, bool buckets,
                            std::vector<CudnnRunPlan>& runs, bool& others) {
  runs.clear();
  others = false;
  for (int i = 0; i < num_groups; ++i) {
    const int len = q_start[i + 1] - q_start[i], s0 = slot0[i];
    if (len <= 0) continue;
    if (len < min_q) {
      others = true;
      continue;
    }
    if (static_cast<long>(s0) + len > kCudnnMaxRunRows) return false;  // its gather would be too large
    const int kv = s0 + len, s_q = buckets ? cudnn_length_bucket(len) : len;
    const int s_kv = buckets ? cudnn_length_bucket(s_q + s0) : kv;  // (s_q + s0 <= 2^18: no overflow)
    if (s_kv > kCudnnMaxRunRows) return false;                      // the padded gather would be too large
    CudnnRunPlan* last = runs.empty() ? nullptr : &runs.back();
    if (last && last->group0 + last->b == i && last->q_len == len && last->kv_len == kv &&
        static_cast<long>(last->b + 1) * s_kv <= kCudnnMaxRunRows) {
      ++last->b;
    } else {
      runs.push_back(CudnnRunPlan{i, q_start[i], 1, len, kv, s_q, s_kv});
    }
  }
  return true;
}

}  // namespace hypic::kernels::cuda::detail
