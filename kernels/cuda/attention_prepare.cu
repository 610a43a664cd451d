// The steps around attention (see attention.h): attention_prepare (q/k zero-centred RMSNorm, partial NeoX RoPE,
// K/V written into the paged pool) and kv_import (cached K/V rows into the pool, K re-rotated by a position delta).
// One warp per head row.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/switches.h"

namespace hypic::kernels::cuda {
namespace {

using namespace detail;

// ---------------------------------------------------------------------------------------------------------
// Row helpers of prepare / import: one warp per head row of HD elements, lane holds E = HD / 32 consecutive
// elements, loaded and stored as one E*2-byte vector when the address allows.
template <int E>
struct VecOf;
template <>
struct VecOf<2> {
  using T = unsigned int;
};
template <>
struct VecOf<4> {
  using T = uint2;
};
template <>
struct VecOf<8> {
  using T = uint4;
};

template <int E>
__device__ __forceinline__ bool vec_ok(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & (2 * E - 1)) == 0;
}

template <int E>
__device__ __forceinline__ void load_lane(const bf16* src, float (&x)[E]) {  // src: the lane's first element
  using V = typename VecOf<E>::T;
  if (vec_ok<E>(src)) {
    const V raw = *reinterpret_cast<const V*>(src);
    const bf16* pv = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = __bfloat162float(pv[e]);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = __bfloat162float(src[e]);
  }
}

template <int E>
__device__ __forceinline__ void store_lane(bf16* dst, const float (&x)[E]) {
  using V = typename VecOf<E>::T;
  if (vec_ok<E>(dst)) {
    V raw;
    bf16* pv = reinterpret_cast<bf16*>(&raw);
#pragma unroll
    for (int e = 0; e < E; ++e) pv[e] = __float2bfloat16_rn(x[e]);
    *reinterpret_cast<V*>(dst) = raw;
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) dst[e] = __float2bfloat16_rn(x[e]);
  }
}

template <int E>
__device__ __forceinline__ void copy_lane(const bf16* src, bf16* dst) {  // bit-exact copy of E elements
  using V = typename VecOf<E>::T;
  if (vec_ok<E>(src) && vec_ok<E>(dst)) {
    *reinterpret_cast<V*>(dst) = *reinterpret_cast<const V*>(src);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) dst[e] = src[e];
  }
}

// NeoX rotate_half RoPE of one head row held by the warp (x: the lane's E values, elements lane*E ..), in fp32
// without contraction (as the CPU reference): x_j cos - x_{j+half} sin below half, x_j cos + x_{j-half} sin above,
// with (cos, sin) = cs_of(i) of pair i = j mod half. sx: the warp's HD-float staging row.
template <int HD, class CosSin>
__device__ __forceinline__ void rope_apply(float (&x)[HD / 32], float* sx, int lane, int rot, CosSin cs_of) {
  constexpr int E = HD / 32;
  const int half = rot / 2;
  __syncwarp();
#pragma unroll
  for (int e = 0; e < E; ++e) sx[lane * E + e] = x[e];
  __syncwarp();
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int jd = lane * E + e;
    if (jd < rot) {
      const float2 cs = cs_of(jd < half ? jd : jd - half);
      if (jd < half)
        x[e] = __fsub_rn(__fmul_rn(x[e], cs.x), __fmul_rn(sx[jd + half], cs.y));
      else
        x[e] = __fadd_rn(__fmul_rn(x[e], cs.x), __fmul_rn(sx[jd - half], cs.y));
    }
  }
}

// The angle of pair i at position pos: pos * inv_freq[i] rounded to fp32, then cosf / sinf.
__device__ __forceinline__ float2 rope_cos_sin(float pos, const float* __restrict__ inv_freq, int i) {
  const float ang = __fmul_rn(pos, inv_freq[i]);
  return make_float2(cosf(ang), sinf(ang));
}

// rope_apply with the trig per element (and head).
template <int HD>
__device__ __forceinline__ void rope_lane(float (&x)[HD / 32], float* sx, int lane, int rot, float pos,
                                          const float* __restrict__ inv_freq) {
  rope_apply<HD>(x, sx, lane, rot, [&](int i) { return rope_cos_sin(pos, inv_freq, i); });
}

// The rotation table of one position (or position delta) for rope_lane_tab: tab[i] = rope_cos_sin(pos, inv_freq,
// i), i < rot / 2, filled by the warp's lanes i = lane, lane + 32, ... The warp's earlier readers of tab are done
// (__syncwarp) before it is overwritten, and every lane sees the new table after it.
__device__ __forceinline__ void rope_fill_tab(float2* tab, int lane, int rot, float pos,
                                              const float* __restrict__ inv_freq) {
  __syncwarp();
  for (int i = lane; i < rot / 2; i += 32) tab[i] = rope_cos_sin(pos, inv_freq, i);
  __syncwarp();
}

// rope_apply with the angles' cos / sin from tab (rope_fill_tab): the same arithmetic and bits as rope_lane, the
// trig once per position instead of once per element and head (which dominated attn_prepare: 564 us per 32k-token
// layer).
template <int HD>
__device__ __forceinline__ void rope_lane_tab(float (&x)[HD / 32], float* sx, int lane, int rot, const float2* tab) {
  rope_apply<HD>(x, sx, lane, rot, [&](int i) { return tab[i]; });
}

// Whether attention_prepare / kv_import take the angles from a per-position table (rope_fill_tab; attention_prepare's
// items then cover a token and a group of heads): HYPIC_ROPE_TABLE, a candidate (switches.h).
bool rope_table_on() {
  static CandidateSwitch on("HYPIC_ROPE_TABLE");
  return on.on();
}

struct PrepareParams {
  int T, num_heads, num_kv_heads, rot;
  int q_head_stride;  // (output_gate ? 2 : 1) * HD
  const bf16* qg;
  const bf16* k;
  const bf16* v;
  long kv_in_stride;
  const bf16* q_norm;
  const bf16* k_norm;
  QkNorm norm;
  float eps;
  const int* positions;
  const float* inv_freq;
  const int* kv_rows;
  bf16* q_out;
  bf16* k_pool;
  bf16* v_pool;
};

constexpr int kRowWarps = 8;  // warps per block of the row kernels

// One warp per item: a token t and the heads h0 .. h0 + hg - 1 of its num_heads + num_kv_heads rows (hg: heads per
// item; TAB: the angles from the warp's per-position table, filled once per item; else hg = 1 and rope_lane).
template <int HD, bool TAB>
__global__ void __launch_bounds__(32 * kRowWarps, 4) attn_prepare_kernel(const PrepareParams p, int hg) {
  // (launched with PDL under HYPIC_DECODE_PDL_MIXERS: q / k / v are the projections' output; see pdl.cuh)
  detail::griddep_wait();
  detail::griddep_launch_dependents();
  constexpr int E = HD / 32;
  __shared__ float sx[kRowWarps][HD];
  __shared__ float2 stab[TAB ? kRowWarps : 1][TAB ? HD / 2 : 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int heads = p.num_heads + p.num_kv_heads;
  const int groups = (heads + hg - 1) / hg;
  const long total = static_cast<long>(p.T) * groups;
  for (long w = static_cast<long>(blockIdx.x) * kRowWarps + warp; w < total;
       w += static_cast<long>(gridDim.x) * kRowWarps) {
    const int t = static_cast<int>(w / groups), h0 = static_cast<int>(w % groups) * hg;
    const int h1 = min(h0 + hg, heads);
    if (TAB && p.rot > 0) rope_fill_tab(stab[warp], lane, p.rot, static_cast<float>(p.positions[t]), p.inv_freq);
    for (int hh = h0; hh < h1; ++hh) {
      const bf16* src;
      const bf16* wn;
      bf16* dst;
      if (hh < p.num_heads) {
        src = p.qg + (static_cast<size_t>(t) * p.num_heads + hh) * p.q_head_stride;
        wn = p.q_norm;
        dst = p.q_out + (static_cast<size_t>(t) * p.num_heads + hh) * HD;
      } else {
        const int kh = hh - p.num_heads;
        const size_t row = static_cast<size_t>(p.kv_rows[t]);
        src = p.k + static_cast<long>(t) * p.kv_in_stride + static_cast<long>(kh) * HD;
        wn = p.k_norm;
        dst = p.k_pool + (row * p.num_kv_heads + kh) * HD;
        copy_lane<E>(p.v + static_cast<long>(t) * p.kv_in_stride + static_cast<long>(kh) * HD + lane * E,
                     p.v_pool + (row * p.num_kv_heads + kh) * HD + lane * E);
      }
      float x[E];
      load_lane<E>(src + lane * E, x);
      if (p.norm != QkNorm::None) {  // block-uniform
        float wv[E];
        load_lane<E>(wn + lane * E, wv);
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) ss = fmaf(x[e], x[e], ss);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float inv = 1.0f / sqrtf(ss / static_cast<float>(HD) + p.eps);
        const float w0 = p.norm == QkNorm::ZeroCentred ? 1.0f : 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e)  // (x * inv) * (1 + w) or * w, rounded to bf16 (HF casts the norm output)
          x[e] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(x[e], inv), w0 + wv[e])));
      }
      if (p.rot > 0) {
        if constexpr (TAB)
          rope_lane_tab<HD>(x, sx[warp], lane, p.rot, stab[warp]);
        else
          rope_lane<HD>(x, sx[warp], lane, p.rot, static_cast<float>(p.positions[t]), p.inv_freq);
      }
      store_lane<E>(dst + lane * E, x);
    }
  }
}

struct ImportParams {
  int n, num_runs, num_kv_heads, rot;
  const int* run_start;
  const bf16* const* k_src;
  const bf16* const* v_src;
  const int* deltas;
  const float* inv_freq;
  const int* kv_rows;
  bf16* k_pool;
  bf16* v_pool;
};

// One warp per kImportRows consecutive import rows (all their KV heads): the run of the first row is found once (a
// binary search over run_start: a chain of dependent loads), later rows step to the next run when they cross its
// start, so each (row, head) costs one round trip for its K / V data (one warp per (row, head) with its own search took
// 68 us for a 16 x 2k splice's 32k rows and 2 heads, 2 TB/s).
constexpr int kImportRows = 8;

// TAB: the rotation by a run's delta from the warp's table (rope_fill_tab), filled when the warp's rows enter a run
// with a new delta, instead of the trig per row, head and element.
template <int HD, bool TAB>
__global__ void __launch_bounds__(32 * kRowWarps, 4) kv_import_kernel(const ImportParams p) {
  constexpr int E = HD / 32;
  __shared__ float sx[kRowWarps][HD];
  __shared__ float2 stab[TAB ? kRowWarps : 1][TAB ? HD / 2 : 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long groups = (static_cast<long>(p.n) + kImportRows - 1) / kImportRows;
  for (long w = static_cast<long>(blockIdx.x) * kRowWarps + warp; w < groups;
       w += static_cast<long>(gridDim.x) * kRowWarps) {
    const int i0 = static_cast<int>(w * kImportRows), i1 = i0 + min(kImportRows, p.n - i0);
    int r = find_group(p.run_start, p.num_runs, i0);  // the run of row i0 (the last of equal starts)
    int tab_delta = 0;                                 // the delta in stab (0: none filled; delta 0 copies)
    for (int i = i0; i < i1; ++i) {
      while (r + 1 < p.num_runs && p.run_start[r + 1] <= i) ++r;  // (skipping empty runs, as find_group)
      if (TAB && p.rot > 0 && p.deltas[r] != 0 && p.deltas[r] != tab_delta) {  // warp-uniform
        tab_delta = p.deltas[r];
        rope_fill_tab(stab[warp], lane, p.rot, static_cast<float>(tab_delta), p.inv_freq);
      }
      const size_t row = static_cast<size_t>(p.kv_rows[i]);
      const size_t src_row = static_cast<size_t>(i - p.run_start[r]) * p.num_kv_heads;
      const bf16* k_run = p.k_src[r];
      const bf16* v_run = p.v_src[r];
      const int delta = p.deltas[r];
      for (int kh = 0; kh < p.num_kv_heads; ++kh) {
        const size_t off = (row * p.num_kv_heads + kh) * HD + lane * E;
        const size_t src = (src_row + kh) * HD + lane * E;
        copy_lane<E>(v_run + src, p.v_pool + off);
        if (delta == 0 || p.rot == 0) {  // warp-uniform
          copy_lane<E>(k_run + src, p.k_pool + off);
          continue;
        }
        float x[E];
        load_lane<E>(k_run + src, x);
        if constexpr (TAB)
          rope_lane_tab<HD>(x, sx[warp], lane, p.rot, stab[warp]);
        else
          rope_lane<HD>(x, sx[warp], lane, p.rot, static_cast<float>(delta), p.inv_freq);
        store_lane<E>(p.k_pool + off, x);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Host side.

void check_rot(const char* fn, int rotary_dim, int head_dim, const float* inv_freq) {
  if (rotary_dim < 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
    bad(fn, "rotary_dim " + std::to_string(rotary_dim) + " must be even and in [0, head_dim " +
                std::to_string(head_dim) + "]");
  if (rotary_dim > 0 && !inv_freq) bad(fn, "inv_freq is null (rotary_dim " + std::to_string(rotary_dim) + ")");
}

int row_grid(long warps) {
  const long blocks = (warps + kRowWarps - 1) / kRowWarps;
  return static_cast<int>(std::min(blocks, 16L * sm_count()));
}

}  // namespace

void attention_prepare(int T, int num_heads, int num_kv_heads, int head_dim, int rotary_dim, bool output_gate,
                       const bf16* qg, const bf16* k, const bf16* v, long kv_in_stride, const bf16* q_norm,
                       const bf16* k_norm, float eps, const int* positions, const float* inv_freq, const int* kv_rows,
                       bf16* q_out, bf16* k_pool, bf16* v_pool, cudaStream_t stream, QkNorm norm) {
  const char* fn = "attention_prepare";
  if (T < 0) bad(fn, "T " + std::to_string(T) + " is negative");
  check_heads(fn, num_heads, num_kv_heads);
  check_head_dim(fn, head_dim);
  check_rot(fn, rotary_dim, head_dim, inv_freq);
  if (kv_in_stride < static_cast<long>(num_kv_heads) * head_dim)
    bad(fn, "kv_in_stride " + std::to_string(kv_in_stride) + " is smaller than num_kv_heads * head_dim");
  if (T == 0) return;
  check_ptr(fn, qg, "qg");
  check_ptr(fn, k, "k");
  check_ptr(fn, v, "v");
  if (norm != QkNorm::None) {
    check_ptr(fn, q_norm, "q_norm");
    check_ptr(fn, k_norm, "k_norm");
  }
  if (rotary_dim > 0) check_ptr(fn, positions, "positions");
  check_ptr(fn, kv_rows, "kv_rows");
  check_ptr(fn, q_out, "q_out");
  check_ptr(fn, k_pool, "k_pool");
  check_ptr(fn, v_pool, "v_pool");
  PrepareParams p{};
  p.T = T;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.rot = rotary_dim;
  p.q_head_stride = (output_gate ? 2 : 1) * head_dim;
  p.qg = qg;
  p.k = k;
  p.v = v;
  p.kv_in_stride = kv_in_stride;
  p.q_norm = q_norm;
  p.k_norm = k_norm;
  p.norm = norm;
  p.eps = eps;
  p.positions = positions;
  p.inv_freq = inv_freq;
  p.kv_rows = kv_rows;
  p.q_out = q_out;
  p.k_pool = k_pool;
  p.v_pool = v_pool;
  const int heads = num_heads + num_kv_heads;
  const bool tab = rope_table_on() && rotary_dim > 0;
  // With the table: as many heads per item as still leave 32 warps per SM (a token's table then serves them all;
  // decode's few tokens keep one head per warp).
  int hg = 1;
  if (tab) {
    const long want = 32L * sm_count();
    hg = static_cast<int>(std::clamp<long>(static_cast<long>(heads) * T / want, 1, heads));
  }
  const int grid = row_grid(static_cast<long>(T) * ((heads + hg - 1) / hg));
  auto launch = [&](auto hd_tag) {
    constexpr int HD = decltype(hd_tag)::value;
    if (tab)
      detail::launch_pdl_if(detail::mixer_pdl(), attn_prepare_kernel<HD, true>, dim3(grid), dim3(32 * kRowWarps), 0,
                            stream, "attn_prepare_kernel launch", p, hg);
    else
      detail::launch_pdl_if(detail::mixer_pdl(), attn_prepare_kernel<HD, false>, dim3(grid), dim3(32 * kRowWarps), 0,
                            stream, "attn_prepare_kernel launch", p, 1);
  };
  switch (head_dim) {
    case 64: launch(std::integral_constant<int, 64>{}); break;
    case 128: launch(std::integral_constant<int, 128>{}); break;
    default: launch(std::integral_constant<int, 256>{}); break;
  }
}

void kv_import(int n, int num_runs, int num_kv_heads, int head_dim, int rotary_dim, const int* run_start,
               const bf16* const* k_src, const bf16* const* v_src, const int* deltas, const float* inv_freq,
               const int* kv_rows, bf16* k_pool, bf16* v_pool, cudaStream_t stream) {
  const char* fn = "kv_import";
  if (n < 0) bad(fn, "n " + std::to_string(n) + " is negative");
  if (num_runs < 0 || (n > 0 && num_runs == 0))
    bad(fn, "num_runs " + std::to_string(num_runs) + " for " + std::to_string(n) + " rows");
  if (num_kv_heads <= 0) bad(fn, "num_kv_heads " + std::to_string(num_kv_heads) + " must be positive");
  check_head_dim(fn, head_dim);
  check_rot(fn, rotary_dim, head_dim, inv_freq);
  if (n == 0) return;
  check_ptr(fn, run_start, "run_start");
  check_ptr(fn, k_src, "k_src");
  check_ptr(fn, v_src, "v_src");
  check_ptr(fn, deltas, "deltas");
  check_ptr(fn, kv_rows, "kv_rows");
  check_ptr(fn, k_pool, "k_pool");
  check_ptr(fn, v_pool, "v_pool");
  ImportParams p{};
  p.n = n;
  p.num_runs = num_runs;
  p.num_kv_heads = num_kv_heads;
  p.rot = rotary_dim;
  p.run_start = run_start;
  p.k_src = k_src;
  p.v_src = v_src;
  p.deltas = deltas;
  p.inv_freq = inv_freq;
  p.kv_rows = kv_rows;
  p.k_pool = k_pool;
  p.v_pool = v_pool;
  const int grid = row_grid((static_cast<long>(n) + kImportRows - 1) / kImportRows);
  auto launch = [&](auto hd_tag) {
    constexpr int HD = decltype(hd_tag)::value;
    if (rope_table_on())
      kv_import_kernel<HD, true><<<grid, 32 * kRowWarps, 0, stream>>>(p);
    else
      kv_import_kernel<HD, false><<<grid, 32 * kRowWarps, 0, stream>>>(p);
  };
  switch (head_dim) {
    case 64: launch(std::integral_constant<int, 64>{}); break;
    case 128: launch(std::integral_constant<int, 128>{}); break;
    default: launch(std::integral_constant<int, 256>{}); break;
  }
  check_cuda(cudaGetLastError(), "kv_import_kernel launch");
}

}  // namespace hypic::kernels::cuda
