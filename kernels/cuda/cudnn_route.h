// The host-side plan of attention_prefill's cuDNN route (kernels/cuda/attention.h): which query groups go to cuDNN's
// fused SDPA, batched into which calls, on which plan shapes (the padded length buckets of the switch
// HYPIC_ATTN_CUDNN_BUCKETS included). No CUDA needed: attention.cu runs it (CudnnRule::takes also on the device, in
// the prefill kernels' skip), tests/unit/test_cudnn_route.cpp checks it on the CPU.
#pragma once
#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#if defined(__CUDACC__)
#define HYPIC_CUDNN_ROUTE_HD __host__ __device__
#else
#define HYPIC_CUDNN_ROUTE_HD
#endif

namespace hypic::kernels::cuda::detail {

/// Which query groups of an attention_prefill call go to cuDNN: a group of len queries whose first query sits at KV
/// slot slot0 does when len >= min_len and (slot0 == 0 and len >= min_q0, or len >= min_q, or len x (2 slot0 + len) >=
/// min_work). min_q0 is the buckets' (HYPIC_ATTN_CUDNN_BUCKETS): a group without cached slots has one plan per length
/// bucket, a bounded set compiled once per server, where a group with cached slots needs a plan per slot0 (the
/// plan's diagonal), so it goes to cuDNN only when its own work pays for a compile (min_q / min_work). The work term is the
/// group's counted FLOP over 2 x heads x head_dim (4 x len x (slot0 + len / 2) x heads x head_dim: every query sees
/// the slot0 cached slots and, on average, half of its own group), in exact 64-bit integers, so that the host's plan
/// and the device kernels' skip (AttnParams, attention_common.cuh) always agree. The default-constructed rule takes
/// no group.
struct CudnnRule {
  int min_len = INT_MAX;           // shorter groups never (the split path's are at most kSplitMaxQ queries)
  int min_q0 = INT_MAX;            // groups at slot0 0 of at least this many queries
  int min_q = INT_MAX;             // groups of at least this many queries
  long long min_work = LLONG_MAX;  // or whose len x (2 slot0 + len) reaches this
  HYPIC_CUDNN_ROUTE_HD bool takes(int len, int slot0) const {
    return len >= min_len && ((slot0 == 0 && len >= min_q0) || len >= min_q ||
                              static_cast<long long>(len) * (2LL * slot0 + len) >= min_work);
  }
};

/// The rule of a FLOP threshold: groups of more than min_len - 1 queries whose counted FLOP (see CudnnRule) reach
/// min_flops at num_heads x head_dim. prefix = false counts a group as if at slot0 0 (len^2 / 2 causal pairs: the rule
/// by length alone, min_q = the smallest len with len^2 >= min_work, min_work not used); prefix = true counts its
/// cached slots too (a 16384-query chunk after 16384 cached slots does three times the work of the first chunk).
/// min_work = ceil(min_flops / (2 x num_heads x head_dim)); 732421875 and min_q 27064 for 6e12 at 16 x 256.
inline CudnnRule cudnn_flop_rule(double min_flops, int num_heads, int head_dim, int min_len, bool prefix) {
  CudnnRule r;
  r.min_len = min_len;
  const double w = std::ceil(min_flops / (2.0 * num_heads * head_dim));
  if (!(w < 0x1p62)) return r;  // (no group of int lengths gets there: none taken; NaN too)
  const long long work = std::max(1LL, static_cast<long long>(w));
  // The smallest len with len^2 >= work (from the double square root, corrected in integers; < 2^31 + 1, so no
  // product below overflows).
  long long q = static_cast<long long>(std::sqrt(static_cast<double>(work)));
  while (q > 0 && (q - 1) * (q - 1) >= work) --q;
  while (q * q < work) ++q;
  r.min_q = static_cast<int>(std::min<long long>(std::max<long long>(q, min_len), INT_MAX));
  if (prefix) r.min_work = work;
  return r;
}

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
/// (q_len, kv_len) unpadded, or with buckets (q_len's bucket, that + slot0: the plan's diagonal offset s_kv - s_q is
/// the real kv_len - q_len, so plans are shared by the query lengths of a bucket at one slot0).
struct CudnnRunPlan {
  int group0 = 0, q0 = 0, b = 0;
  int q_len = 0, kv_len = 0;
  int s_q = 0, s_kv = 0;
};

/// The cuDNN runs of one attention_prefill call: group i holds q_start[i + 1] - q_start[i] queries at slot0[i]
/// (host arrays of num_groups + 1 and num_groups entries, checked by the caller: non-negative lengths, q_start[0] = 0).
/// The groups that `rule` takes are cuDNN's (empty groups are skipped); consecutive ones of equal (q_len, slot0)
/// share a run while b * s_kv <= kCudnnMaxRunRows. Fills `runs` (cleared first) and `others` (whether a non-empty
/// group stays on our kernels). Returns false, meaning that our kernels run the whole call, when a cuDNN group alone
/// needs more than kCudnnMaxRunRows KV slots (padded ones with buckets); `runs` is then unspecified.
inline bool plan_cudnn_runs(int num_groups, const int* q_start, const int* slot0, const CudnnRule& rule, bool buckets,
                            std::vector<CudnnRunPlan>& runs, bool& others) {
  runs.clear();
  others = false;
  for (int i = 0; i < num_groups; ++i) {
    const int len = q_start[i + 1] - q_start[i], s0 = slot0[i];
    if (len <= 0) continue;
    if (!rule.takes(len, s0)) {
      others = true;
      continue;
    }
    if (static_cast<long>(s0) + len > kCudnnMaxRunRows) return false;  // its gather would be too large
    const int kv = s0 + len, s_q = buckets ? cudnn_length_bucket(len) : len;
    // With buckets the KV slots are padded by as many rows as the queries, so that the plan's diagonal offset
    // s_kv - s_q is the real slot0: on the H200 (2026-12-05) cuDNN's engine took the diagonal from the plan's
    // shape, not from the by-value lengths of each call, and a KV bucket of its own (offset above slot0) gave wrong
    // outputs for every group with cached slots. Real row i then sees slots <= slot0 + i < kv_len: never a padded one.
    const int s_kv = buckets ? s_q + s0 : kv;  // (s_q + s0 <= 2^18: no overflow)
    if (s_kv > kCudnnMaxRunRows) return false;  // the padded gather would be too large
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
