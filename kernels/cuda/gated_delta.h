// CUDA kernels for the linear-attention path of Gated DeltaNet models (Qwen3-Next, Qwen3.5):
// chunked gated delta rule prefill with the segment transition T_C, the recurrent decode step,
// composition of cached (T, S) pairs, and the depthwise causal conv1d + SiLU in front of it.
//
// Conventions are those of kernels/cpu/gated_delta.h (the reference these kernels are tested
// against): one head's state S is d_k x d_v fp32 row-major ([d_k][d_v]), S_t = T_t S_{t-1} + u_t
// with T_t = e^{g_t}(I - b_t k_t k_t^T), u_t = b_t k_t v_t^T, o_t = S_t^T q_t (updated state).
// A transition T is d_k x d_k fp32 row-major. Value head j reads key head j / (H_v / H_k) (GVA).
// These kernels support d_k = d_v = 128 only (Qwen3-Next and Qwen3.5 head size); other sizes throw.
//
// All pointers are device pointers unless named *_host; every call is asynchronous on `stream`
// and throws std::invalid_argument for bad shapes and std::runtime_error for CUDA errors.
// Source of the chunked algorithm: DESIGN.md 3.1 and docs/research/hybrid_models.md 5.2 / 5.4
// (UT transform, W = T_A diag(b e^G) K, U = T_A diag(b) V, chunk transition T = gamma I - K~^T W).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cuda/ops.h"  // AffineStep, ChainLowRankFactors

namespace hypic::kernels::cuda {

using bf16 = __nv_bfloat16;

namespace detail {
struct GdnFactorsAccess;  // gated_delta_prefill.cu: the checks, plan and WY launch that gdn_prefill and
                          // gdn_prefill_factors share
}  // namespace detail

/// Head size the GPU gated-delta kernels are built for (d_k = d_v).
inline constexpr int kGdnHeadDim = 128;
/// Chunk length of the chunked prefill.
inline constexpr int kGdnChunk = 64;

/// The depthwise causal conv1d + SiLU in front of the prefill (HF Qwen3NextGatedDeltaNet's conv1d over the in_proj
/// [Q | K | V] channels, conv1d_silu_prefill below), computed inside the prefill's WY kernel from the raw in_proj rows
/// instead of by a launch of its own (GdnPrefillArgs::conv): the same arithmetic (fp32 multiply-adds of the K taps in
/// conv1d_silu_prefill's order, SiLU's division approximate where that kernel's is, HYPIC_CONV_NARROW, one rounding to
/// bf16), so the same bits. Qwen3-Next / Qwen3.5's kernel size 4 only (gdn_conv_fused_supported).
struct GdnConvIn {
  const bf16* x = nullptr;       ///< [T][channels] bf16, the raw rows: channels = 2 H_k 128 (Q, K) + H_v 128 (V)
  const bf16* weight = nullptr;  ///< [channels][kernel] bf16 (the checkpoint's conv1d.weight, squeezed)
  /// [num_seqs][kernel - 1][channels] bf16: the kernel - 1 inputs before each sequence's conv_start, or nullptr (zero
  /// history). Read only: the caller updates it after the prefill's last call with conv1d_state_tail.
  const bf16* state = nullptr;
  /// DEVICE int32 [num_seqs]: the token where sequence s's conv input begins, at most cu_seqlens_host[s] (not
  /// checked: a later start reads history rows that are not there); rows before it belong to another sequence and
  /// the history comes from `state` (row s, the prefill's sequence index) instead. The conv's cu_seqlens when its
  /// sequences are the prefill's; a sequence cut into pieces for the scan gives each piece the whole one's start.
  const int* conv_start = nullptr;
  int kernel = 0;  ///< taps (4)
};

/// Inputs and outputs of one chunked prefill launch over `num_seqs` independent sequences
/// (segments) packed back to back along the token axis ("varlen"); T = cu_seqlens_host[num_seqs].
struct GdnPrefillArgs {
  int num_seqs = 0;
  const int* cu_seqlens_host = nullptr;  ///< HOST [num_seqs + 1], 0 = first, non-decreasing (lengths may be 0)
  int num_k_heads = 0;                   ///< H_k
  int num_v_heads = 0;                   ///< H_v, a multiple of H_k
  const bf16* q = nullptr;               ///< [T][H_k][128] raw (l2-normalised in-kernel when l2norm_qk)
  const bf16* k = nullptr;               ///< [T][H_k][128]
  const bf16* v = nullptr;               ///< [T][H_v][128]
  const float* g = nullptr;              ///< [T][H_v] log decay (<= 0), post softplus/exp (HF `g`)
  const float* beta = nullptr;           ///< [T][H_v] write strength, post sigmoid
  /// Gates fused into the prefill instead of g and beta (HF Qwen3NextGatedDeltaNet / Qwen3.5):
  /// g_t = -exp(A_log[h]) softplus(a_t + dt_bias[h]) (softplus threshold 20), beta_t = sigmoid(b_t),
  /// fp32, per token and value head (gdn_gates computes the same values as a separate kernel).
  /// Give either g and beta, or all four of these.
  const bf16* gate_a = nullptr;          ///< [T][H_v] HF `a` (in_proj_a output), bf16
  const bf16* gate_b = nullptr;          ///< [T][H_v] HF `b` (in_proj_b output), bf16
  const float* A_log = nullptr;          ///< [H_v]
  const float* dt_bias = nullptr;        ///< [H_v]
  bool l2norm_qk = true;                 ///< q, k <- x * rsqrt(sum x^2 + 1e-6) in fp32 (HF use_qk_l2norm_in_kernel)
  float scale = 0.08838834764831845f;    ///< q multiplier after the l2 norm (d_k^-1/2)
  const float* initial_state = nullptr;  ///< [num_seqs][H_v][128][128] or nullptr (zero state)
  float* final_state = nullptr;          ///< [num_seqs][H_v][128][128] or nullptr; may alias initial_state
  /// Only the last sequence's final state is wanted: final_state then addresses [H_v][128][128] (that sequence's),
  /// and the other sequences' final states are not written (a splice's seam runs, whose states only the last
  /// matters: 64 KB per run and head less to write). The buffer must not overlap another sequence's initial state.
  bool final_state_last_only = false;
  float* transition = nullptr;           ///< [num_seqs][H_v][128][128] T_C or nullptr (not computed)
  bf16* out = nullptr;                   ///< [T][H_v][128] o_t = S_t^T q_t, bf16; nullptr = not computed
  /// Block layout of the state scan, for benchmarks and tests (results are bitwise identical in
  /// every layout): 0 = chosen by occupancy; 1 = S and T columns in separate blocks; 2 = each block
  /// carries 64 columns of both S and T (same as 1 without T_C). Applies to unsplit scans.
  int scan_layout = 0;
  /// Sequence-parallel scan (DESIGN.md 3.1 composition law): a long sequence is cut at chunk
  /// boundaries into P parts whose (T, S(part|0)) pairs are scanned in parallel and composed, so
  /// that a few long sequences fill the GPU. 0 = chosen by occupancy (see gdn_scan_parts: sequences
  /// of at least 48 chunks, parts of at least 16, when one part of each such sequence per SM pair
  /// leaves room); 1 = never; P >= 2 = every sequence of at least P chunks in P parts (tests,
  /// benchmarks). Every setting falls back to whole sequences when the first scan launch would
  /// need more than 65535 jobs. Results agree with the unsplit scan within bf16 rounding, not bit
  /// for bit (the state fed to the tensor cores is rounded per part).
  int seq_parts = 0;
  /// States at chosen tokens, written in the same pass (prefix mode's checkpoints at segment ends):
  /// checkpoint i is the state after the token at offset checkpoint_tokens_host[i] - 1 (HOST,
  /// increasing, each in (cu_seqlens[s], cu_seqlens[s + 1]] of some sequence s), written to
  /// checkpoint_states[i] (a DEVICE array of num_checkpoints pointers, each to [H_v][128][128] fp32,
  /// the layout of final_state). The chunking restarts after each checkpoint (a shorter chunk ends
  /// there), so outputs agree with a call without checkpoints within fp32 rounding, not bit for bit.
  /// Without `out`, sequences are then scanned whole (seq_parts ignored).
  int num_checkpoints = 0;
  const int* checkpoint_tokens_host = nullptr;
  float* const* checkpoint_states = nullptr;
  /// The per-chunk factors of these arguments are in the workspace already (gdn_prefill_factors, or a gdn_prefill, with
  /// the same plan: cu_seqlens, heads, requested outputs, seq_parts, checkpoints; the same q, k, v and gate pointers,
  /// scale and l2 norm; the output and state pointers may differ): the WY launch is skipped, the results are the same
  /// bits. The workspace compares those, not the inputs' contents: rewriting them in between is the caller's error.
  /// gdn_prefill throws std::invalid_argument when the workspace's factors are of other arguments (or of none, e.g.
  /// after a call of another shape).
  bool reuse_factors = false;
  /// The conv fused in (see GdnConvIn; x null: none, q / k / v are the conv's outputs as above). With it q, k and v
  /// are not read: the WY kernel computes them from conv.x and writes the conv's k (and, with `out`, q) to `k` (and
  /// `q`), [T][H_k][128] bf16 each, where the scan reads them and where they stay for the caller (a splice's
  /// low-rank chain steps read k); v is never written (may be null). Sequences are those of cu_seqlens_host, their
  /// conv inputs starting at conv.conv_start. Throws std::invalid_argument on a kernel size other than 4
  /// (gdn_conv_fused_supported), a null weight or conv_start, or x, weight or state not 16-byte aligned.
  GdnConvIn conv;
  /// Diagnostics (gdn_bench --scan-profile): DEVICE int64 [kGdnScanProfileSlots], or null (the default: nothing is
  /// recorded; the serving kernels have no clock reads, a separate instantiation runs when it is set). When set, the
  /// first block (column block 0, value head 0, job 0) of each chunk-scan launch adds to it, per warp w < 12 (its role
  /// by the launch's layout), the SM cycles (clock64) its chunk steps spent in slot 6 w: the cp.async wait for the
  /// step's staged tiles, 6 w + 1: the block barrier after it, 6 w + 2: issuing the next chunk's tile copies
  /// (cp.async), 6 w + 3: the L2 prefetch of a later chunk, 6 w + 4: the warp's role work (recurrence or outputs,
  /// their MMA waits included), and in 6 w + 5 its chunk steps; slot 72: the block's chunk steps, 73: its cycles from
  /// the first step to the end, 74: the launches. Sums over the launches of every call that passes it. The profiled
  /// wgmma kernel spills a few registers, so its times are near, not equal to, the serving kernel's; outputs and
  /// states are the same.
  long long* scan_profile = nullptr;
};
/// Slots of GdnPrefillArgs::scan_profile.
inline constexpr int kGdnScanProfileSlots = 80;

struct GdnPlan;

/// Device scratch of the chunked prefill (per-chunk WY factors W and U^T, the intra-chunk output
/// matrix P, per-token factors: about 41 KB per chunk and value head; when sequences are scanned in
/// parts also 3 max(P) H_v x 64 KB of part states per split sequence) and its plan: the chunk
/// table and scan jobs on the device, built from cu_seqlens, the head counts, which outputs are
/// requested and seq_parts. The plan is kept while those stay the same (every layer of a forward
/// pass), so such calls copy nothing from the host and can be captured in a CUDA graph after a
/// first, uncaptured call of that shape (capturing a call of a new shape throws
/// std::invalid_argument). A captured graph reads this workspace's buffers and plan: between the
/// capture and its last replay, no call of any other shape may use the workspace (keep one
/// workspace per captured shape). Grows on demand and is reused across calls; not thread-safe;
/// one per stream (it owns one more stream and two events: the transition folds of split sequences
/// run there, forked from and joined back into the caller's stream within each call).
class GdnWorkspace {
 public:
  GdnWorkspace();
  GdnWorkspace(const GdnWorkspace&) = delete;
  GdnWorkspace& operator=(const GdnWorkspace&) = delete;
  ~GdnWorkspace();
  /// Bytes currently held on the device.
  size_t bytes() const { return bytes_ + split_bytes_ + job_bytes_; }
  /// How many times a plan was built (and copied to the device) so far.
  long plans_built() const { return plans_built_; }
  /// The stream the transition folds of split sequences run on beside the caller's (forked from and joined back
  /// into it within each call): `side`, e.g. a second stream of the SM partition the caller's stream runs on
  /// (engine/cuda/sm_partition.h), or nullptr for the workspace's own whole-device stream. Takes effect at the next
  /// call; the stream must outlive the calls that use it.
  void set_side_stream(cudaStream_t side) { side_override_ = side; }

 private:
  friend void gdn_prefill(const GdnPrefillArgs&, GdnWorkspace&, cudaStream_t);
  friend struct detail::GdnFactorsAccess;
  void reserve(size_t chunk_heads);
  // What the factors in mem_ were computed from (the plan key, the input pointers, scale, l2 norm; empty: none):
  // GdnPrefillArgs::reuse_factors and gdn_low_rank_factors check it.
  std::vector<uintptr_t> factors_key_;
  void reserve_split(size_t state_bytes, size_t job_bytes);
  void* mem_ = nullptr;
  size_t bytes_ = 0;
  size_t chunk_heads_cap_ = 0;
  void* split_mem_ = nullptr;  // per-part (T, S) and initial states of split sequences
  size_t split_bytes_ = 0;
  void* job_mem_ = nullptr;  // chunk table and the scan jobs of the (up to two) scan launches
  size_t job_bytes_ = 0;
  std::unique_ptr<GdnPlan> plan_;
  long plans_built_ = 0;
  // A second stream for the transition folds of split sequences, which run beside the state folds.
  void ensure_side_stream();
  cudaStream_t side_ = nullptr, side_override_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
};

/// Chunked gated delta rule prefill (chunk 64) over a varlen batch: per sequence and value head,
/// the outputs, the final state and optionally the sequence's cumulative transition
/// T_C = T_{t_n} ... T_{t_1}, all from one pass (the state scan carries T alongside S, and the
/// outputs are computed inside the scan). Launches: the per-chunk factors, then one scan launch
/// (two with outputs when sequences are scanned in parts, with compose_fold between them).
/// Numerics: bf16 operands on tensor cores with fp32 accumulation; the running state and T stay
/// fp32, the per-chunk factors (W, U, P) and the state fed to the tensor cores are bf16 (as in
/// flash-linear-attention). A sequence of length 0 yields final = initial, T_C = I.
/// Long sequences may be scanned in parts (see GdnPrefillArgs::seq_parts): with outputs, a first
/// scan launch runs part 0 from the initial state and the middle parts from zero with their T,
/// the parts' initial states are composed (compose_fold), and a second launch reruns parts 1..
/// from their true initial states for the outputs; without outputs every part runs in the first
/// launch and compose_fold gives the final state and T_C. q, k, v, out and the state pointers must
/// be 16-byte aligned.
/// Throws std::invalid_argument on null required or misaligned pointers, bad head counts, bad
/// cu_seqlens, a scan_layout outside [0, 2], a negative seq_parts, or a new call shape during CUDA
/// graph capture; std::runtime_error on CUDA errors (an out-of-memory workspace leaves no plan
/// behind: the next call rebuilds it).
void gdn_prefill(const GdnPrefillArgs& args, GdnWorkspace& ws, cudaStream_t stream = nullptr);

/// gdn_prefill's first launch alone: the plan and the per-chunk factors (W, U^T, P, the per-token factors) of every
/// chunk of `a` into `ws`, for a caller that reads them before the scan runs: a splice takes its seam runs as low-rank
/// chain steps (gdn_low_rank_factors, gdn_low_rank_step) from the factors its last pass's scan then reuses (gdn_prefill
/// with `reuse_factors`), instead of computing the seam runs' factors twice. `a` as for gdn_prefill (its outputs and
/// states are not written here; reuse_factors ignored). Throws what gdn_prefill throws for its arguments;
/// std::runtime_error on CUDA errors.
void gdn_prefill_factors(const GdnPrefillArgs& a, GdnWorkspace& ws, cudaStream_t stream = nullptr);

/// Where affine_chain's low-rank steps find the factors that gdn_prefill_factors(a, ws) left in `ws` (and the raw k
/// rows of `a`): valid until the next call on `ws` that computes factors. Host only. Throws std::invalid_argument when
/// the workspace's factors are not of `a`, or `a` has checkpoints (gdn_low_rank_step's chunk indices assume none).
ChainLowRankFactors gdn_low_rank_factors(const GdnPrefillArgs& a, const GdnWorkspace& ws);

/// The affine-chain step of sequence `seq` of `a` run from zero, (T, S(seq|0)), as a low-rank step over the factors of
/// gdn_low_rank_factors (AffineStep::lr_chunk: its chunk in the plan, lr_t0, lr_len), or the identity step for an
/// empty sequence. Host only. Throws std::invalid_argument on seq outside [0, num_seqs), a sequence longer than
/// kGdnChunk tokens, or checkpoints in `a` (they cut the chunking).
AffineStep gdn_low_rank_step(const GdnPrefillArgs& a, int seq);

/// How gdn_prefill will scan each sequence of `a`: the number of parts (1 = whole; see
/// GdnPrefillArgs::seq_parts). With seq_parts = 0 a sequence of n >= 48 chunks is cut into
/// min(P, n / 16) parts, where P is how many parts of every such sequence fit in one wave of
/// two blocks per value head over the GPU's SMs (plus one with outputs, as part 0 runs once);
/// P < 3 with outputs (2 without) means no cut. Short sequences are not counted (they run beside
/// the parts in the first launch). Queries the current device's SM count.
/// Throws std::invalid_argument on the shape errors gdn_prefill rejects (head counts, num_seqs,
/// cu_seqlens, seq_parts, scan_layout).
std::vector<int> gdn_scan_parts(const GdnPrefillArgs& a);

/// Whether this build carries the sm_90a kernels of gdn_wgmma.cu (a CUDA toolkit of 12.0 or later built them). Host
/// only.
bool gdn_wgmma_built();

/// Whether gdn_prefill runs its chunk scan's products on warpgroup MMAs now (gdn_scan.cuh, the switch
/// HYPIC_GDN_SCAN_WGMMA): the switch on, this build's sm_90a code present and the current device of compute
/// capability 9.0. Host only; throws std::runtime_error on a CUDA error querying the device.
bool gdn_scan_wgmma_active();

/// Whether gdn_prefill runs its WY kernel's products (P, K K^T, W, U) on warpgroup MMAs now (gdn_wy.cuh, the
/// switch HYPIC_GDN_WY_WGMMA): the switch on, this build's sm_90a code present and the current device of
/// compute capability 9.0. Host only; throws std::runtime_error on a CUDA error querying the device.
bool gdn_wy_wgmma_active();

/// Whether gdn_prefill can take a conv of `kernel` taps fused in (GdnPrefillArgs::conv): kernel 4, the size of every
/// Qwen3-Next and Qwen3.5 checkpoint. Host only.
inline bool gdn_conv_fused_supported(int kernel) { return kernel == 4; }

/// Whether a caller should fuse the conv into gdn_prefill now: gdn_conv_fused_supported(kernel) and the switch
/// HYPIC_GDN_CONV_FUSED (a candidate: kernels/cuda/switches.h) on. Host only.
bool gdn_conv_fused_active(int kernel);

/// Launches of the wgmma kernels (gdn_scan_kernel<true>, gdn_wy_kernel<true>) that gdn_prefill and
/// gdn_prefill_factors have issued in this process, counted on the host as each is issued (a launch
/// captured into a CUDA graph counts once, its replays not at all). Lets a test tell which kernels ran where both
/// give the same bits (on Hopper the wgmma and mma.sync products add the same k16 dot products in the same order).
/// scan_tma: those of the wgmma scans that staged their tiles by TMA (HYPIC_GDN_SCAN_TMA; also counted in scan);
/// scan_tma_all: those of them that staged U^T and the gate scalars by TMA too (HYPIC_GDN_SCAN_TMA_ALL).
/// wy_conv: WY launches (either kind of products) with the conv fused in (GdnPrefillArgs::conv).
struct GdnWgmmaLaunches {
  uint64_t scan = 0, wy = 0, scan_tma = 0, scan_tma_all = 0, wy_conv = 0;
};
GdnWgmmaLaunches gdn_wgmma_launches();

/// Gated DeltaNet gates as a separate kernel (for the decode step, or when the prefill does not
/// fuse them): g[t][h] = -exp(A_log[h]) softplus(a[t][h] + dt_bias[h]) (softplus threshold 20) and
/// beta[t][h] = sigmoid(b[t][h]), fp32 (HF Qwen3NextGatedDeltaNet). a, b: [tokens][H_v] bf16;
/// A_log, dt_bias: [H_v] fp32; g, beta: [tokens][H_v] fp32 out. Throws std::invalid_argument on
/// null pointers or non-positive H_v.
void gdn_gates(int tokens, int num_v_heads, const bf16* a, const bf16* b, const float* A_log, const float* dt_bias,
               float* g, float* beta, cudaStream_t stream = nullptr);

/// One recurrent decode step for `batch` requests (one token each), in place on fp32 states.
///   q, k: [batch][H_k][128] bf16 raw; v: [batch][H_v][128] bf16; g, beta: [batch][H_v] fp32
///   state: [batch][H_v][128][128] fp32, updated in place; out: [batch][H_v][128] bf16 (nullable).
///   state_slots: nullptr, or DEVICE int32 [batch]: request b's state is state[state_slots[b]] of a larger
///   slot pool [slots][H_v][128][128] (an engine's per-sequence state slots; slots distinct).
/// Same math as gdn_prefill for T = 1 (HF torch_recurrent_gated_delta_rule), fp32 throughout.
/// Launched with programmatic dependent launch under HYPIC_DECODE_PDL_MIXERS (on by default): q, k, v (and the gates)
/// may come from the kernel launched just before on the stream; the state is read after the wait.
void gdn_decode(int batch, int num_k_heads, int num_v_heads, const bf16* q, const bf16* k, const bf16* v,
                const float* g, const float* beta, bool l2norm_qk, float scale, float* state, bf16* out,
                cudaStream_t stream = nullptr, const int* state_slots = nullptr);

/// The layer's gated output norm after a decode step (HF Qwen3NextRMSNormGated, ops.h rms_norm_gated with the silu
/// gate and one weight row): out[b][h] = norm(out[b][h]) * w * silu(z[b][h]) per (request, value head) row of 128.
/// z: [batch][H_v][128] bf16, w: [128] bf16, counters: DEVICE unsigned [batch * H_v], zero before the call and left
/// zero (the caller's, one array per stream).
struct GdnDecodeNorm {
  const bf16* z = nullptr;
  const bf16* w = nullptr;
  float eps = 1e-6f;
  unsigned* counters = nullptr;
  bool vec = false;  ///< set by gdn_decode_gated: rms_norm_gated's 16-byte order (ops.h rms_norm_gated_vectorized)
};

/// gdn_decode with the gates fused in (as GdnPrefillArgs::gate_a ..): g and beta of each request and
/// value head computed from gate_a, gate_b [batch][H_v] bf16 and A_log, dt_bias [H_v] fp32, bit for
/// bit as gdn_gates would, without its launch. norm (optional): then the gated norm of out (GdnDecodeNorm), in the
/// same launch (the last of each head's column blocks) where HYPIC_GDN_DECODE_NORM (a candidate: switches.h) is on,
/// else rms_norm_gated after it: the same bits either way. Throws std::invalid_argument on null inputs.
/// state_read_early: the caller's promise that the state's (and state_slots') last writer completed before the kernel
/// launched just before this one on the stream began waiting for its own predecessor (pdl.cuh; a decode step: the
/// writer is the previous step's call, and conv1d_silu_decode, launched just before, waits before it lets this one
/// start). Never pass it for a call right after another call on the same state. With it, and HYPIC_GDN_STATE_EARLY
/// (a measured default, switches.h), the state rows are read (through L2) before the wait; the same values either way.
void gdn_decode_gated(int batch, int num_k_heads, int num_v_heads, const bf16* q, const bf16* k, const bf16* v,
                      const bf16* gate_a, const bf16* gate_b, const float* A_log, const float* dt_bias,
                      bool l2norm_qk, float scale, float* state, bf16* out, cudaStream_t stream = nullptr,
                      const int* state_slots = nullptr, const GdnDecodeNorm* norm = nullptr,
                      bool state_read_early = false);

/// Composition (DESIGN.md 3.1): folds `num_segments` cached (T, S) pairs into running states,
///   running[b] <- T[i][b] running[b] + S[i][b],  for i = 0 .. num_segments-1, every b < batch,
/// where b enumerates (layer, head) pairs. running: [batch][128][128] fp32 in/out;
/// transitions, states: [num_segments][batch][128][128] fp32; states may be nullptr (S = 0: a
/// product of transitions). fp32 FMA arithmetic throughout.
/// This is hypic's own kernel: it keeps each running column block on chip across all segments.
void compose_fold(int batch, int num_segments, float* running, const float* transitions, const float* states,
                  cudaStream_t stream = nullptr);

/// Same contract as compose_fold, through cuBLAS: one strided-batched SGEMM (fp32, no TF32) per
/// segment, plus a device copy of S[i] into a scratch buffer the GEMM accumulates into.
///   scratch: [batch][128][128] fp32 device buffer. `cublas_handle` is a cublasHandle_t.
void compose_fold_cublas(void* cublas_handle, int batch, int num_segments, float* running,
                         const float* transitions, const float* states, float* scratch,
                         cudaStream_t stream = nullptr);

/// Where the conv writes its output rows: channels [0, q_dim) to q ([T][q_dim]), [q_dim, 2 q_dim) to k
/// ([T][q_dim]) and [2 q_dim, channels) to v ([T][channels - 2 q_dim]), bf16, each buffer row-contiguous: the
/// Gated DeltaNet's [Q | K | V] conv channels (HF Qwen3NextGatedDeltaNet splits them after the conv) written
/// straight to the prefill's q, k and v inputs, with no [T][channels] intermediate. q_dim: a positive multiple
/// of 8 with 2 q_dim < channels.
struct ConvQkvOut {
  bf16* q = nullptr;
  bf16* k = nullptr;
  bf16* v = nullptr;
  int q_dim = 0;
};

/// Depthwise causal conv1d + SiLU over a varlen batch (PyTorch cross-correlation convention, as
/// kernels/cpu causal_conv1d_silu): y[t][c] = silu(sum_j w[c][j] x[c, t-(K-1)+j]), fp32 accumulation,
/// one rounding to bf16. Reads x once and writes y once (each thread slides a K-1 input window over
/// a run of tokens of 8 channels): memory-bound.
///   cu_seqlens: DEVICE int32 [num_seqs + 1], 0 first, non-decreasing, cu_seqlens[num_seqs] == total_tokens (T);
///   x, y: [T][channels] bf16; weight: [channels][kernel] bf16
///   conv_state: [num_seqs][kernel-1][channels] bf16 in/out, or nullptr (zero history, no tail out):
///     on entry the K-1 inputs preceding each sequence; on exit the conv tail (last K-1 inputs of
///     state ++ x). channels must be a multiple of 8; 2 <= kernel <= 8.
/// Throws std::invalid_argument on bad sizes or null pointers, std::runtime_error on launch errors.
void conv1d_silu_prefill(int num_seqs, const int* cu_seqlens, int total_tokens, int channels, int kernel,
                         const bf16* x, const bf16* weight, bf16* conv_state, bf16* y,
                         cudaStream_t stream = nullptr);

/// conv1d_silu_prefill with its output split into q, k, v (see ConvQkvOut), bit for bit the same values.
void conv1d_silu_prefill(int num_seqs, const int* cu_seqlens, int total_tokens, int channels, int kernel,
                         const bf16* x, const bf16* weight, bf16* conv_state, const ConvQkvOut& out,
                         cudaStream_t stream = nullptr);

/// conv1d_silu_prefill's conv tail alone: conv_state [num_seqs][kernel-1][channels] bf16 in/out becomes the last
/// kernel - 1 inputs of (state ++ x) of each sequence (x: [T][channels] bf16, cu_seqlens: DEVICE int32 [num_seqs + 1]),
/// the history the next call of each sequence reads. For a caller whose conv ran fused into gdn_prefill
/// (GdnPrefillArgs::conv): after the last prefill call that reads the history. Throws std::invalid_argument on bad
/// sizes or null pointers, std::runtime_error on launch errors.
void conv1d_state_tail(int num_seqs, const int* cu_seqlens, int channels, int kernel, const bf16* x,
                       bf16* conv_state, cudaStream_t stream = nullptr);

/// Decode step of the conv: x, y: [batch][channels]; conv_state [batch][kernel-1][channels] in place, or with
/// state_slots (DEVICE int32 [batch], distinct) request b's state is conv_state[state_slots[b]] of a slot pool.
/// Launched with programmatic dependent launch under HYPIC_DECODE_PDL_MIXERS (x may be the output of the kernel just
/// before on the stream; the state is read after the wait).
void conv1d_silu_decode(int batch, int channels, int kernel, const bf16* x, const bf16* weight, bf16* conv_state,
                        bf16* y, cudaStream_t stream = nullptr, const int* state_slots = nullptr);

/// conv1d_silu_decode with its output split into q, k, v ([batch][..] each, see ConvQkvOut).
/// state_read_early: the caller's promise that the conv state's (and state_slots') last writer completed before the
/// kernel launched just before this one on the stream began waiting for its own predecessor (pdl.cuh; a decode step:
/// the writer is the previous step's conv, and the in_proj GEMM before this call waits before it lets this one
/// start). Never pass it for a call right after another call on the same state. With it, and HYPIC_CONV_STATE_EARLY
/// (a measured default, switches.h), the state is read before the wait; the same values either way.
void conv1d_silu_decode(int batch, int channels, int kernel, const bf16* x, const bf16* weight, bf16* conv_state,
                        const ConvQkvOut& out, cudaStream_t stream = nullptr, const int* state_slots = nullptr,
                        bool state_read_early = false);

}  // namespace hypic::kernels::cuda
