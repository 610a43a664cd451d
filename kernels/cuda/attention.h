// CUDA kernels of the gated full-attention layers of Qwen3-Next / Qwen3.5 (HF Qwen3NextAttention,
// Qwen3_5Attention) over a paged KV pool:
//   attention_prepare  q/k zero-centred RMSNorm + partial NeoX RoPE, K/V written into the pool;
//   kv_import          cached segment K/V copied into the pool, K re-rotated by a position delta;
//   attention_prefill  varlen causal-by-slot attention (FlashAttention-2 style, mma.sync bf16; on compute
//                      capability 9.0 at head_dim 128/256 the long groups take a wgmma kernel), gate fused;
//   attention_decode   one query per request, flash-decoding (KV split over blocks + combine), gate fused.
// CPU references: kernels/cpu/attention.h (attention_causal), kernels/cpu/ops.h (rms_norm_zero_centred,
// apply_rope, apply_rope_uniform).
//
// Conventions shared by every function here:
//  - all pointers are DEVICE pointers unless named *_host; bf16 = __nv_bfloat16, row-major;
//  - head_dim is 64, 128 or 256 (anything else throws std::invalid_argument naming the value);
//  - GQA: query head h reads KV head h / (num_heads / num_kv_heads);
//  - every call is asynchronous on `stream`, never synchronises the host, and throws
//    std::invalid_argument (naming the bad value) on bad shapes or null / misaligned pointers and
//    std::runtime_error on CUDA errors (launch errors via cudaGetLastError).
//  - attention_prepare, kv_import and attention_prefill allocate nothing and can be captured in a
//    CUDA graph; attention_decode and attention_prefill(..., ws, ...) likewise once their workspace is
//    reserved (AttnDecodeWorkspace::reserve / reserve_prefill) or has grown in an earlier eager call.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string>

namespace hypic::kernels::cuda {
namespace detail {
class CudnnSdpa;
}

using bf16 = __nv_bfloat16;

/// Tokens per KV page. One attention layer's pool is K and V, each [num_pages][64][H_kv][head_dim]
/// bf16; pool row r = page * 64 + offset addresses one token's [H_kv][head_dim] (element offset
/// (r * H_kv + kv_head) * head_dim). The token at slot s of a sequence (its index in the sequence's
/// KV order) lives at pool row block_table[s / 64] * 64 + s % 64. K is stored RoPE-rotated at the
/// token's real position.
inline constexpr int kKvPageTokens = 64;

/// A varlen batch of query groups. Query i of group g (0 <= i < len(g)) attends to the KV slots
/// 0 ..= slot0[g] + i of its sequence (causal by slot); all those slots' K/V must be in the pool.
/// Several groups may share one sequence (the same block-table rows repeated): that is how a splice
/// runs several seam windows of one prompt in one call.
struct AttnGroups {
  int num_groups = 0;               ///< host; >= 0 (0: nothing to do)
  const int* q_start = nullptr;     ///< DEVICE int32 [num_groups + 1]: rows of q of group g are q_start[g] .. q_start[g+1]-1
  const int* slot0 = nullptr;       ///< DEVICE int32 [num_groups]: KV slot of the group's first query (>= 0)
  const int* block_table = nullptr; ///< DEVICE int32 [num_groups][max_pages]: page ids of the group's sequence
  int max_pages = 0;                ///< host; row stride of block_table (>= 1)
  int total_q = 0;                  ///< host copy of q_start[num_groups]
  int max_q = 0;                    ///< host: longest group (upper bound of len(g))
  int max_kv = 0;                   ///< host: upper bound of slot0[g] + len(g) (the KV length); used by decode
  /// Optional HOST copies of q_start [num_groups + 1] and slot0 [num_groups] (read during the call only). With both
  /// set, attention_prefill(..., ws, ...) may run the groups of more than 512 queries through cuDNN's fused SDPA
  /// (see there); without them every group takes our kernels.
  const int* q_start_host = nullptr;
  const int* slot0_host = nullptr;
  /// Host hint: the groups are windows of one sequence (every block-table row lists that sequence's pages: a
  /// splice's seam windows and query). With HYPIC_ATTN_SPLIT_PAIR on, attention_prefill's split path then runs two
  /// work items per block over shared K / V tiles (attention_common.cuh, launch_split_pair). Only the speed depends on
  /// it: the plan kernel pairs two groups' items only where their block-table rows agree.
  bool shared_sequence = false;
};

/// Varlen causal attention over the paged pool (FlashAttention-2 style: 128-query tiles of one head
/// per block, 64-slot KV tiles = one page each, cp.async double buffering, tiles above the causal
/// diagonal skipped, query tiles nearest the diagonal's far end launched first).
/// On a device of compute capability 9.0 (H100, H200) with head_dim 128 or 256 the same tiles run on Hopper's
/// warpgroup MMA instead (wgmma.mma_async from 128-byte-swizzled shared memory, FlashAttention-3 style without
/// warp specialization; attention_wgmma.cu, built for sm_90a): same masking, softmax and rounding points, only
/// the fp32 summation order within the products differs. HYPIC_ATTN_WGMMA in the environment (read once): "0"
/// keeps the mma.sync kernel (comparisons); "2" runs the warp-specialised variant (a producer warpgroup loading K
/// and V through an mbarrier ring, two consumer warpgroups taking turns on the tensor cores; same bits); "3" the
/// same with the softmax of each tile beside the previous tile's P.V product (both measured slower on the H200,
/// 2026-12-04: 24.7 and 27.1 ms against 19.5 ms per 32k-token layer).
///   q:   [total_q][num_heads][head_dim] bf16, normed and rotated (attention_prepare's q_out);
///   k_pool, v_pool: the layer's pool (see kKvPageTokens), K rotated at real positions;
///   scale: multiplies q.k (head_dim^-1/2);
///   gate: nullptr (no output gate) or the gate element of token 0, head 0: the gate of (t, h, d) is
///     gate[t * gate_token_stride + h * gate_head_stride + d] (for HF q_proj output [T][nh][2 hd] with
///     the gate after the query of each head: gate = qg + head_dim, token stride nh * 2 hd, head
///     stride 2 hd);
///   out: [total_q][num_heads][head_dim] bf16: out = attn * sigmoid(gate) (sigmoid and product in fp32
///     on the fp32 attention value, rounded to bf16 once), or attn without a gate.
/// Numerics: fp32 scores, fp32 online softmax (exp2 of log2e-scaled scores), P rounded to bf16 for the
/// P.V tensor-core product, fp32 accumulators. Requires q, k_pool, v_pool, out 16-byte aligned;
/// num_groups <= 65535 and max_q <= 65535 * 128. Allocates nothing (graph capturable).
void attention_prefill(const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim, const bf16* q,
                       const bf16* k_pool, const bf16* v_pool, float scale, const bf16* gate, long gate_token_stride,
                       int gate_head_stride, bf16* out, cudaStream_t stream = nullptr);

/// Device scratch of attention_decode (per (request, query head, KV chunk) the partial (m, l) and the
/// fp32 accumulator [head_dim]) and of attention_prefill(..., ws, ...) (per work item 64 rows of partial
/// (m, l, acc) and the launch's item / query offsets; for cuDNN's groups the gathered K/V, up to 2 x 2^17 KV slots,
/// and a cuDNN handle with its plans); one workspace may serve both, in stream order. Grows on demand (a growth synchronises the device before freeing the
/// old buffer) and is reused across calls; not thread-safe (one per stream). A captured graph reads
/// its buffer: between a capture and the graph's last replay the workspace must not grow.
class AttnDecodeWorkspace {
 public:
  AttnDecodeWorkspace();
  AttnDecodeWorkspace(const AttnDecodeWorkspace&) = delete;
  AttnDecodeWorkspace& operator=(const AttnDecodeWorkspace&) = delete;
  ~AttnDecodeWorkspace();
  /// Sizes the scratch for every attention_decode call on the current device with at most
  /// max_batch requests, num_heads query heads (any num_kv_heads dividing it), this head_dim and
  /// AttnGroups::max_kv <= max_kv, so that such calls allocate nothing (and can be captured).
  /// Throws std::invalid_argument on non-positive sizes or an unsupported head_dim.
  void reserve(int max_batch, int num_heads, int head_dim, int max_kv);
  /// Sizes the scratch for attention_prefill(..., ws, stream) calls whose AttnGroups host fields
  /// (num_groups, total_q, max_q, max_kv) are those of `g` (device pointers unused), with these head
  /// counts and head_dim, on the current device: such calls then allocate nothing (and can be captured).
  /// Throws std::invalid_argument on bad shapes.
  void reserve_prefill(const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim);
  /// Bytes held on the device.
  size_t bytes() const { return bytes_; }
  /// cuDNN SDPA launches made through this workspace so far (attention_prefill's long groups; tests, benchmarks).
  long cudnn_launches() const { return cudnn_launches_; }
  /// cuDNN SDPA plans this workspace holds (one per shape, attention_prefill's cuDNN route; tests).
  size_t cudnn_plans() const;


 private:
  friend void attention_decode(const AttnGroups&, int, int, int, const bf16*, const bf16*, const bf16*, float,
                               const bf16*, long, int, bf16*, AttnDecodeWorkspace&, cudaStream_t, bool);
  friend void attention_prefill(const AttnGroups&, int, int, int, const bf16*, const bf16*, const bf16*, float,
                                const bf16*, long, int, bf16*, AttnDecodeWorkspace&, cudaStream_t);
  void ensure(size_t bytes, cudaStream_t stream, const char* fn);
  void* mem_ = nullptr;
  size_t bytes_ = 0;
  std::unique_ptr<detail::CudnnSdpa> cudnn_;  // created on first use: a cuDNN handle and its plans
  long cudnn_launches_ = 0;
  size_t cudnn_failed_bytes_ = 0;  // a cuDNN-route size that could not be allocated (not retried at or above it)
};

/// Whether attention_prefill(..., ws, ...) can take cuDNN's SDPA for long groups in this process: libcudnn.so.9
/// (9.0 or later; its runtime-compiled engines also need libnvrtc on the loader path) loadable at run time and
/// HYPIC_ATTN_CUDNN not "0" ("0" read once). Both throw std::invalid_argument when HYPIC_ATTN_CUDNN is not "", "0", "1" or
/// "all". attention_cudnn_status() says why not (empty when available). cuDNN is loaded by the first call of either
/// or of attention_prefill with host tables, never otherwise.
bool attention_cudnn_available();
std::string attention_cudnn_status();

/// How many KV chunks attention_decode splits each request's context into on the current device for `batch` requests
/// of one query each, contexts of at most max_kv slots (tokens): 1 = no split-KV combine. Host only; throws
/// std::invalid_argument where attention_decode would (batch outside 1 .. 65535, non-positive max_kv, heads that do
/// not group, an unsupported head_dim, too many KV heads), std::runtime_error on CUDA errors.
int attention_decode_splits(int batch, int num_heads, int num_kv_heads, int head_dim, int max_kv);

/// Whether attention_prefill's split path (with a workspace) runs the wgmma split kernel at this head_dim on the
/// current device: a build with the sm_90a kernels, compute capability 9.0, head_dim 128 or 256, HYPIC_ATTN_SPLIT_WGMMA
/// not "0" (tests, benchmarks: where the candidate HYPIC_ATTN_SPLIT_WG_PLAN changes the split plans). Host only; throws
/// std::runtime_error on CUDA errors.
bool attention_split_wgmma_available(int head_dim);

/// Launches of the paired split kernel (HYPIC_ATTN_SPLIT_PAIR with AttnGroups::shared_sequence; attention_common.cuh,
/// launch_split_pair) in this process, counted on the host as each is issued (a CUDA graph counts its launch once, at
/// capture): lets a test tell which kernel ran. 0 in a build without the sm_90a kernels. Host only.
uint64_t attention_split_pair_launches();

/// attention_prefill with a workspace: the same result (up to fp32 summation order), faster for short
/// groups over long contexts (the hypic splice: seam windows of a few tokens and a short query, each
/// attending to up to tens of thousands of slots). Groups of 1 ..= 512 queries take a split-KV path
/// (flash-decoding style): each group's KV range is cut into chunks of whole pages (the chunk length
/// chosen from the SM count, the launch's host bounds and g.max_kv; a KV length beyond g.max_kv is still
/// computed correctly, by the last chunk), one work item per (group, KV head, 64-row tile, chunk) with
/// the query heads of that KV head and the group's queries packed into the tile rows (row r of the
/// group: query r / ratio, head kv_head * ratio + r % ratio), so K/V are read once per (tile, chunk);
/// items are scheduled dynamically over persistent blocks, partial (m, l, acc) in fp32 in `ws`, then a
/// combine kernel (skipped for groups whose KV fits one chunk: the item writes `out`). Longer groups
/// in the same launch run the kernel above. Launches: a 1-block plan kernel, the split kernel, the
/// kernel above when g.max_q > 512, the combine kernel when some group can have several chunks.
/// Needs g.max_kv >= 1 for the split path (g.max_kv <= 0: the kernel above for every group). The
/// environment variable HYPIC_ATTN_PREFILL_SPLIT=0 (read once) disables the split path (comparisons). The persistent
/// blocks take the items chunk-major (every group's items of KV chunk 0, then chunk 1, ...: a splice's groups are
/// windows of one sequence, so blocks running together read the same pages); HYPIC_ATTN_SPLIT_ORDER=group (read once)
/// takes them group by group instead (comparisons; unset, empty or "chunk": chunk-major; anything else but "group"
/// throws std::invalid_argument). On compute capability 9.0 at head_dim 128 / 256 the split kernel runs on warpgroup
/// MMAs (attention_wgmma.cu: one warpgroup per item, 32-slot KV tiles, two or three blocks per SM; same items and
/// partials, equal up to rounding: fp32 sums in another order, P rounded to bf16 against one running max per row where
/// the mma.sync kernel keeps one per 32-slot half); HYPIC_ATTN_SPLIT_WGMMA=0 (read once) keeps the mma.sync kernel
/// (comparisons).
/// Long groups through cuDNN: when g.q_start_host and g.slot0_host are given (checked against total_q, max_q and the
/// block table: std::invalid_argument naming the bad entry), attention_cudnn_available(), the device has compute
/// capability 8.0 or later and the stream is not capturing, the groups of at least min_q queries run on cuDNN's fused
/// SDPA (graph API, bottom-right causal mask), each run of consecutive such groups of equal (length, slot0) one call:
/// their K/V slots are gathered from the pool into `ws` head-major (2 x groups x KV length x num_kv_heads x head_dim
/// bf16), the gate applied after cuDNN's bf16 output (as HF gates SDPA's). Our kernels run the other groups in the
/// same call (they skip cuDNN's). min_q = ceil(sqrt(2 x 6e12 / (4 x num_heads x head_dim))) (27064 at 16 x 256: a
/// cuDNN plan costs 35-72 ms to build once per shape, and cuDNN saves about 8e-16 s per counted FLOP on the H200, so
/// one prefill of a new length with ten attention layers roughly pays for its plan), or 513 with
/// HYPIC_ATTN_CUDNN=all (re-read on every call; for workloads that repeat their lengths). With the switch
/// HYPIC_ATTN_CUDNN_PREFIX (default on) the rule counts a group's cached slots too: groups of more than 512 queries whose
/// 4 x len x (slot0 + len / 2) x num_heads x head_dim counted FLOP reach 6e12 (cudnn_route.h CudnnRule, the same
/// integer test on the host and in the kernels' skip), such as the second 16384-query chunk of a 32k prompt cut into
/// the workers' default passes. With the switch HYPIC_ATTN_CUDNN_BUCKETS (kernels/cuda/switches.h, default on) every
/// group at slot0 0 of more than 512 queries goes to cuDNN too (CudnnRule::min_q0; a group with cached slots needs a
/// plan per slot0, so it still goes by the rule above), and each run's plan has padded dimensions, so that
/// one plan serves a range of lengths: the queries rounded up to the next multiple of 2^(floor(log2 len) - 4) (16
/// buckets per octave, at most 1/16 padding) and the KV slots by as many rows (padded queries + slot0: the plan's
/// diagonal offset is the real slot0, so plans are shared within a bucket at one slot0; cuDNN took the diagonal from
/// the plan's shape, not from the lengths passed at run time, on the H200 on 2026-12-05), the padding K/V rows zero, q / out through padded copies in `ws` when the queries are padded (their
/// padding rows dropped; 2 x b x s_q x num_heads x head_dim bf16 more scratch: 256 MiB at 16384 queries of 16 x 256
/// heads, the engine's default prefill chunk). A padding key is seen by padding queries only, so the real rows are
/// those of the unpadded problem, within the same tolerance (another plan shape: other bits). Our kernels run the whole
/// call instead when one of its cuDNN groups reaches past 2^17 KV slots (padded ones with the buckets), when a shape
/// has no cuDNN engine or its plan fails to build (one line on stderr; remembered while cached), or when the gather
/// (and copies) cannot be allocated (one line; not retried at that size for this workspace). So the choice depends on
/// the call's groups, not on what ran before, except after such an allocation failure; a worker without cuDNN gives
/// other bits for cuDNN's groups (within the same tolerance). Plans are cached per shape in `ws` (at most 160, the
/// least recently used dropped between calls). One device per workspace. reserve_prefill does not reserve the gather: a
/// captured call runs our kernels. Same tolerance against the reference; not bit-equal to our kernels.
/// Throws as attention_prefill, and std::invalid_argument when `ws` would have to grow while `stream`
/// is capturing (AttnDecodeWorkspace::reserve_prefill sizes it beforehand).
void attention_prefill(const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim, const bf16* q,
                       const bf16* k_pool, const bf16* v_pool, float scale, const bf16* gate, long gate_token_stride,
                       int gate_head_stride, bf16* out, AttnDecodeWorkspace& ws, cudaStream_t stream = nullptr);

/// Decode attention: every group holds exactly one query (g.max_q == 1, total_q == num_groups; the
/// query row of request b is q_start[b], its KV length slot0[b] + 1). Flash-decoding: each request's
/// KV range is cut into chunks of whole pages (the split count chosen from the batch size, g.max_kv
/// and the SM count; a KV length beyond g.max_kv is still computed correctly, by the last chunk),
/// one block per (request, KV head, chunk) with the query heads of that KV head packed into the
/// 16 tile rows (GQA ratio up to 16 per block; larger ratios take several blocks), partial (m, l,
/// acc) in `ws`, then a combine kernel (skipped when one chunk suffices: the block writes `out`).
/// Arguments and numerics as attention_prefill (fp32 softmax, gate fused). g.max_kv >= 1 required.
/// kv_read_early: the caller's promise that every KV slot of every request except its last (slot0[b]), the block
/// table and slot0 were last written before the kernel launched just before this call on `stream` began, and that
/// that kernel waits (griddepcontrol.wait) before it triggers its dependents (attention_prepare's kernel does); then,
/// with HYPIC_ATTN_DECODE_KV_EARLY (a measured default) and the decode PDL launches (HYPIC_DECODE_PDL_MIXERS), the
/// decode kernel issues its first KV tiles before its PDL wait (pdl.cuh). The same outputs bit for bit either way.
/// Throws std::invalid_argument as attention_prefill, when g.max_q != 1 or total_q != num_groups,
/// num_groups > 65535, or when `ws` would have to grow while `stream` is capturing.
void attention_decode(const AttnGroups& g, int num_heads, int num_kv_heads, int head_dim, const bf16* q,
                      const bf16* k_pool, const bf16* v_pool, float scale, const bf16* gate, long gate_token_stride,
                      int gate_head_stride, bf16* out, AttnDecodeWorkspace& ws, cudaStream_t stream = nullptr,
                      bool kv_read_early = false);

/// The attention probability one sequence's span of queries pays each KV slot (the probe of a splice's query-aware
/// refresh, engine/cpu/splice.h SpliceRequest::refresh_segments; CPU counterpart: cpu::attention_causal's key_mass):
///   q: [num_queries][num_heads][head_dim] bf16 (normed and rotated, attention_prepare's q_out rows of the span);
///   query i sits at slot slot0 + i and sees slots 0 ..= slot0 + i, whose K are in k_pool through block_table
///   (DEVICE int32 [pages] of the sequence, see kKvPageTokens);
///   mass: DEVICE fp32 [slot0 + num_queries]: softmax(scale * q.k) over the visible slots, summed over the queries
///   and the heads, is ADDED to it (fp32 scores from bf16 inputs, atomicAdd: the summation order varies).
/// head_dim even, <= 1024; num_heads a multiple of num_kv_heads, <= 65535. One block per (query, head), K read twice:
/// meant for short spans. Throws std::invalid_argument on bad shapes or null pointers, std::runtime_error on launch
/// errors. Allocates nothing.
void attention_key_mass(int num_queries, int num_heads, int num_kv_heads, int head_dim, const bf16* q, int slot0,
                        const int* block_table, const bf16* k_pool, float scale, float* mass,
                        cudaStream_t stream = nullptr);

/// The q/k norm of an attention layer before RoPE.
enum class QkNorm {
  ZeroCentred,  ///< y = x rsqrt(mean x^2 + eps) (1 + w) (HF Qwen3NextRMSNorm, Qwen3.5)
  Plain,        ///< y = x rsqrt(mean x^2 + eps) w (Ring-linear's query_layernorm / key_layernorm)
  None,         ///< no norm (MiniMax); q_norm and k_norm may be null
};

/// Between the projections and attention (HF Qwen3NextAttention.forward), for T tokens:
///   qg: q_proj output [T][num_heads][(output_gate ? 2 : 1) * head_dim] bf16 (per head: head_dim query
///       values, then head_dim gate values when output_gate; the gate is left in qg for attention);
///   k, v: k_proj / v_proj outputs: row t at k + t * kv_in_stride (elements), [num_kv_heads][head_dim];
///   q_norm, k_norm: [head_dim] bf16 RMSNorm weights, by `norm`: zero-centred y = x * rsqrt(mean(x^2) + eps) *
///       (1 + w), or plain (* w), per head over head_dim in fp32, rounded to bf16 (as HF Qwen3NextRMSNorm); with
///       QkNorm::None the values pass unnormed (and unrounded) to RoPE;
///   then partial NeoX RoPE of the first rotary_dim dims of each q and k head, from the bf16 normed values:
///       pairs (i, i + rotary_dim/2), angle = float(positions[t]) * inv_freq[i] (fp32), cosf / sinf,
///       x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin in fp32 (kernels/cpu apply_rope), rounded to bf16
///       once; dims >= rotary_dim pass through;
///   positions: DEVICE int32 [T]; inv_freq: DEVICE fp32 [rotary_dim / 2] (may be null if rotary_dim == 0);
///   kv_rows: DEVICE int32 [T] destination pool rows;
///   q_out: [T][num_heads][head_dim] bf16 (normed, rotated); K (normed, rotated) and V (copied) to
///       k_pool / v_pool rows kv_rows[t].
/// rotary_dim: even, 0 <= rotary_dim <= head_dim. 16-byte vector loads where pointers and strides allow.
void attention_prepare(int T, int num_heads, int num_kv_heads, int head_dim, int rotary_dim, bool output_gate,
                       const bf16* qg, const bf16* k, const bf16* v, long kv_in_stride, const bf16* q_norm,
                       const bf16* k_norm, float eps, const int* positions, const float* inv_freq, const int* kv_rows,
                       bf16* q_out, bf16* k_pool, bf16* v_pool, cudaStream_t stream = nullptr,
                       QkNorm norm = QkNorm::ZeroCentred);

/// Copies n cached K/V rows into the pool, re-rotating K by a position delta (R(p + d) = R(d) R(p)). The rows come
/// in num_runs runs of consecutive rows of one source (a cached segment's K / V, DESIGN.md 3.2): run r is import
/// rows [run_start[r], run_start[r + 1]) and its j-th row is the [num_kv_heads][head_dim] bf16 row at
/// k_src[r] + j * num_kv_heads * head_dim (V: v_src[r] + j * num_kv_heads * head_dim). K is rotated on its first
/// rotary_dim dims by angle float(deltas[r]) * inv_freq[j] (x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, fp32,
/// rounded to bf16 once; kernels/cpu apply_rope_uniform), V copied; import row i goes to pool row kv_rows[i].
/// run_start: DEVICE int32 [num_runs + 1], non-decreasing, run_start[0] = 0, run_start[num_runs] = n (empty runs
/// allowed); k_src, v_src: DEVICE arrays of num_runs device pointers; deltas: DEVICE int32 [num_runs] (0 or negative
/// allowed; delta 0 copies K bit for bit); kv_rows: DEVICE int32 [n]. rotary_dim even, 0 <= rotary_dim <= head_dim.
/// 16-byte vectorised where every pointer allows. The tables are per run, not per row: a 16 x 2k splice's import
/// is 16 pointers per layer and tensor, not 32k. Throws std::invalid_argument on bad sizes or null pointers.
void kv_import(int n, int num_runs, int num_kv_heads, int head_dim, int rotary_dim, const int* run_start,
               const bf16* const* k_src, const bf16* const* v_src, const int* deltas, const float* inv_freq,
               const int* kv_rows, bf16* k_pool, bf16* v_pool, cudaStream_t stream = nullptr);

}  // namespace hypic::kernels::cuda
