// Elementwise and small building blocks of the CUDA hybrid forward pass (engine/cuda): embedding gather, the
// RMSNorm flavours of Qwen3-Next / Qwen3.5, the split of the Gated DeltaNet conv output into q / k / v, the
// affine chain that folds cached (T, S) pairs into running states, dtype conversions, and seeded random fills
// for benchmark-only weights. CPU references: kernels/cpu/ops.h (same formulas in fp32).
//
// All pointers are DEVICE pointers unless named *_host; every call is asynchronous on `stream`, allocates nothing
// (CUDA-graph capturable) and throws std::invalid_argument on bad sizes / null pointers, std::runtime_error on
// CUDA launch errors. Activations are bf16, the residual stream fp32, norms computed in fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace hypic::kernels::cuda {

using bf16 = __nv_bfloat16;

/// x[t][:] = float(embed[ids[t]][:]) for t < T. ids: [T] int32 in [0, vocab) (checked on the host by the caller);
/// embed: [vocab][H] bf16; x: [T][H] fp32 (the residual stream).
void embed_gather(int T, int H, const int32_t* ids, const bf16* embed, float* x, cudaStream_t stream = nullptr);

/// Zero-centred RMSNorm (HF Qwen3NextRMSNorm / Qwen3_5RMSNorm): y = x * rsqrt(mean(x^2) + eps) * (1 + w), fp32
/// math, rounded to bf16 once; with zero_centred = false the plain RMSNorm of the other families (* w: HF
/// MiniMaxRMSNorm, KimiLinearRMSNorm, BailingMoeV2RMSNorm). x: fp32 rows of `dim` with row stride ldx; row r of the
/// output reads input row rows_index[r] when rows_index != nullptr (e.g. only each sequence's last token before the
/// LM head), else r. w: [dim] bf16; y: [rows][dim] bf16.
/// post_alpha != 0: MiniMax's post-norm residual (HF MiniMaxDecoderLayer: x = alpha norm(x) + beta f(norm(x))): the
/// rows of x are also overwritten, in fp32, with post_alpha * norm(x) (the unrounded values y rounds), so that the
/// layer's output projection adds beta f into them (GemmRunner alpha, MoeWeightsView::output_scale); x_out must
/// then be x (the same pointer, a reminder that x is written) and rows_index null. Throws std::invalid_argument
/// otherwise, on bad sizes or null pointers.
void rms_norm_residual(int rows, int dim, const float* x, long ldx, const int* rows_index, const bf16* w, float eps,
                       bf16* y, cudaStream_t stream = nullptr, bool zero_centred = true, float post_alpha = 0.f,
                       float* x_out = nullptr);

/// The gate function of rms_norm_gated.
enum class NormGate {
  Silu,     ///< silu(z): Gated DeltaNet (HF Qwen3NextRMSNormGated)
  Sigmoid,  ///< sigmoid(z): KDA (HF KimiLinear's KimiRMSNormGated), lightning's output gate (MiniMax, Ring-linear)
};

/// Gated RMSNorm: per row of `dim`, y = (x * rsqrt(mean(x^2) + eps)) * w * gate(z) (plain weight w), fp32 math,
/// bf16 out. Row r uses weight row r % w_rows of w [w_rows][dim], so a grouped norm over rows of G groups is
/// rows x G rows of dim / G with w_rows = G (lightning's output RMSNorm over H * d in group_norm_size groups, HF
/// MiniMaxLightningAttention.norm / BailingMoeV2's group norm); per-head norms (Gated DeltaNet, KDA: one row per
/// token and head) use w_rows = 1. x, z, y: [rows][dim] bf16 (y may alias x); dim even.
/// Throws std::invalid_argument on bad sizes or null pointers.
void rms_norm_gated(int rows, int dim, const bf16* x, const bf16* z, const bf16* w, float eps, bf16* y,
                    cudaStream_t stream = nullptr, NormGate gate = NormGate::Silu, int w_rows = 1);

/// Whether rms_norm_gated runs its 16-byte kernel for these arguments (row_norm.cuh gated_norm_lanes8: another
/// summation order than the warp kernel's gated_norm_row_warp): the switch HYPIC_NORM_GATED_VEC on (the default), dim / 8
/// lanes per row in {4, 8, 16, 32}, every pointer 16-byte aligned. Fused callers that must give rms_norm_gated's bits
/// pick their order by it. Host only.
bool rms_norm_gated_vectorized(int dim, const bf16* x, const bf16* z, const bf16* w, const bf16* y);

/// How affine_chain multiplies: Tf32x3 (tensor cores, fp32-accurate split: on compute capability 9.0 with the
/// sm_90a build, warpgroup MMAs (wgmma, kernels/cuda/chain_wgmma.cu), elsewhere mma.sync), Tf32x3Mma (the same
/// products on mma.sync on every device: comparisons) or Fp32Fma (CUDA cores). Read once from HYPIC_CHAIN_MATH
/// (unset or "tf32x3": Tf32x3; "tf32x3-mma": Tf32x3Mma; "fp32": Fp32Fma; anything else: std::invalid_argument).
enum class ChainMath { Tf32x3, Tf32x3Mma, Fp32Fma };
ChainMath affine_chain_math();

/// Where an affine chain's low-rank steps read their factors (affine_chain's `low_rank`): the chunk-form factors of
/// zero-start Gated DeltaNet runs of at most 64 tokens each, as gdn_prefill's WY launch leaves them in its workspace
/// (gdn_low_rank_factors, kernels/cuda/gated_delta.h, fills this). For chunk c and value head h (slot c * heads + h):
/// W rows t < len at W + slot * w_stride + t * 128 (bf16), U^T at UT + slot * w_stride, row v (value column) holding
/// U[t][v] at v * ut_ld + t (bf16), kf_t (fp32) at scal + slot * scal_stride + t and the chunk's log decay G_C at
/// scal + slot * scal_stride + gamma_at; the raw k of the pass's token t for key head kh at k + (t * num_k_heads + kh)
/// * 128 (bf16), kh = h / (heads / num_k_heads). All DEVICE pointers.
struct ChainLowRankFactors {
  const bf16* W = nullptr;
  const bf16* UT = nullptr;
  const float* scal = nullptr;
  const bf16* k = nullptr;
  long w_stride = 0, scal_stride = 0;
  int ut_ld = 0, gamma_at = 0, num_k_heads = 0, heads = 0;
};

/// One step of an affine chain: R <- alpha (T R) + S; T == nullptr means the identity, S == nullptr zero; then
/// if out != nullptr, out <- R. Every pointer addresses `heads` blocks [heads][128][128] fp32 (head h at
/// h * 128 * 128); so does every init / final pointer. A step's S may be an earlier step's out (of the same chain);
/// a T must not be any step's out in the same call (T is read a step ahead, by several blocks).
/// A low-rank step instead (lr_len in 1..64; T, S, alpha unused): the transition and zero-start state of a Gated
/// DeltaNet run of lr_len tokens in chunk form (hybrid_models.md 5.4, DESIGN.md 3.1), T_run = gamma I - K~^T W and
/// S_run = K~^T U with K~ = diag(kf) K (kf, gamma = e^{G_C}, W, U of chunk lr_chunk, K the raw k rows of the pass's
/// tokens lr_t0 ..), applied without forming T_run: R <- gamma R - K~^T (W R - U), in fp32 from the bf16 factors
/// (about 2 x 128 x 128 x lr_len multiply-adds per head instead of a 128^3 product). A splice's seam windows take
/// these steps, read from the factors its own scan then reuses.
struct AffineStep {
  const float* T = nullptr;
  const float* S = nullptr;
  float* out = nullptr;
  float alpha = 1.f;
  int lr_chunk = 0, lr_t0 = 0, lr_len = 0;
};

/// Folds cached segments into running states (DESIGN.md 3.1 composition law S <- T_C S + S(C|0)), for
/// `num_chains` independent chains (e.g. the linear layers of a splice, or the segments of an entry build) of
/// `steps_per_chain` steps each, over `heads` heads of 128 x 128 fp32 states: R = init[c] (nullptr entry: zero),
/// then steps[c * steps_per_chain + i] for i in order, then final[c] <- R (nullptr entry / array: not written).
/// steps, init, final: DEVICE arrays. init may alias final. Arithmetic (affine_chain_math()): by default the
/// products T R on the tensor cores as 3xTF32 (each fp32 operand split into a TF32 high part and a residual,
/// T_hi R_hi + T_hi R_lo + T_lo R_hi accumulated in fp32 by wgmma on Hopper, mma.sync elsewhere; deterministic):
/// measured (mma.sync; the wgmma kernel agrees to the same figures) against products in double, 2-5e-7 relative
/// (Frobenius) after one to four steps and 1.9e-6 after 16 (fp32 FMA: 1-2e-7); on an H200 (gdn_bench, 33 steps over 32
/// heads) 3.7 us per step on wgmma, 4.5 on mma.sync, 6.8 in fp32 FMA. Non-finite values become NaN
/// (kernels/cuda/mma.cuh split_tf32). A T that is exactly the identity is not exact through the split (R to ~1
/// ulp): pass nullptr for identity steps, which copy R exactly either way. HYPIC_CHAIN_MATH=fp32 selects fp32 FMA on
/// the CUDA cores in a fixed k order. Low-rank steps (AffineStep::lr_len > 0) read `low_rank` (HOST pointer to the
/// description, passed by value to the kernels; it must be given when any step has lr_len > 0: a kernel meeting such
/// a step without it traps, a CUDA error), the same fp32 code in every arithmetic. Fewer than 2^29 chains. Throws
/// std::invalid_argument on bad sizes or a bad HYPIC_CHAIN_MATH.
void affine_chain(int num_chains, int heads, int steps_per_chain, const AffineStep* steps, const float* const* init,
                  float* const* final_states, cudaStream_t stream = nullptr,
                  const ChainLowRankFactors* low_rank = nullptr);
/// affine_chain with the arithmetic chosen by the caller (tests, benchmarks).
void affine_chain(int num_chains, int heads, int steps_per_chain, const AffineStep* steps, const float* const* init,
                  float* const* final_states, cudaStream_t stream, ChainMath math,
                  const ChainLowRankFactors* low_rank = nullptr);
/// Launches of affine_chain given a `low_rank` description in this process, counted on the host as each is issued:
/// lets a test tell whether a splice took its seam windows as low-rank steps (HYPIC_SPLICE_SEAM_FOLD).
uint64_t affine_chain_low_rank_launches();

/// affine_chain with scalar transitions (lightning attention's T_C: one scalar per head; DESIGN.md 3.1; the steps'
/// lr_* fields are ignored, a low-rank step being a Gated DeltaNet form): per chain c
/// and head h, R = init[c] (nullptr: zero), then for each step R <- alpha (t R) + S with t = step.T[h] (step.T an
/// fp32 [heads] array; nullptr: t = 1) and S = step.S's head h (nullptr: 0), written to step.out when set; then
/// final[c] <- R. States are [heads][head_floats] fp32 (head_floats = d_k d_v, a multiple of 4, 16-byte aligned).
/// fp32 FMA arithmetic, as the CPU's compose_state. init may alias final. Throws std::invalid_argument on bad sizes.
void affine_chain_scalar(int num_chains, int heads, int head_floats, int steps_per_chain, const AffineStep* steps,
                         const float* const* init, float* const* final_states, cudaStream_t stream = nullptr);

/// Greedy decoding on the device: out[r] = the index of the largest of x[r][0..V) (fp32, row stride ldx; the lowest
/// index on ties, as engine/sampling.h argmax), or, when the row holds a NaN, -1 - j with j the lowest index of a NaN
/// (so out[r] < 0 exactly for NaN rows). x, out (int32 [rows]): DEVICE. One block per row, or under
/// HYPIC_ARGMAX_CLUSTER (a measured default, switches.h) a cluster of 8 blocks per row, each a contiguous eighth (one
/// block read a 248k-entry row in 37 us on the H200, bench/results/decode_kernels_h200.md). Throws
/// std::invalid_argument for rows < 0, V <= 0, ldx < V or null pointers.
void argmax_rows(int rows, int V, const float* x, long ldx, int32_t* out, cudaStream_t stream = nullptr);

/// y[i] = bf16(x[i]) (round to nearest even), n elements.
void fp32_to_bf16(long n, const float* x, bf16* y, cudaStream_t stream = nullptr);
/// y[i] = float(x[i]), n elements (exact).
void bf16_to_fp32(long n, const bf16* x, float* y, cudaStream_t stream = nullptr);

/// Gathers `n` rows of `row_elems` bf16 elements: dst[i] = src[src_rows[i]] (both row-major, src_rows DEVICE
/// int32 [n]). row_elems even (16-byte copies when it is a multiple of 8).
void gather_rows(int n, int row_elems, const bf16* src, const int* src_rows, bf16* dst, cudaStream_t stream = nullptr);

/// One copy of a batched_copy: `bytes` from src to dst (device memory; both 16-byte aligned and bytes a multiple
/// of 16 for the fast path, else 4-byte aligned and a multiple of 4).
struct CopyDesc {
  const void* src = nullptr;
  void* dst = nullptr;
  long bytes = 0;
};

/// Runs `n` device-to-device copies described by the DEVICE array descs in one launch (many small copies of
/// states, conv tails and KV pages without one cudaMemcpyAsync each). Copies must not overlap each other.
void batched_copy(int n, const CopyDesc* descs, cudaStream_t stream = nullptr);

/// How fill_random draws values (the roles of engine/checkpoint/weights.h TensorRole, for benchmark-only weights
/// made on the device): Normal N(mean, std), Uniform U(lo = mean - std, hi = mean + std), LogUniform log U(mean,
/// std) (A_log: log of U(1, 16)), Constant (mean).
enum class RandomFill { Normal, Uniform, LogUniform, Constant };

/// Deterministic pseudo-random fill: element j depends only on (seed, stream_id, j), so the same arguments give
/// the same bits on any GPU. bf16 or fp32 destination (exactly one non-null).
void fill_random(long n, RandomFill kind, float a, float b, uint64_t seed, uint64_t stream_id, bf16* y_bf16,
                 float* y_fp32, cudaStream_t stream = nullptr);

/// Diagnostics of SM placement (engine/cuda/sm_partition.h): `blocks` blocks of 32 threads, each spinning about
/// `spin_ns` nanoseconds of its SM's clock so that the launch spreads over every SM it may use, write the id of
/// the SM they ran on (%smid) to sm_of_block[block] (device memory, int32).
void record_block_sms(int blocks, int64_t spin_ns, int* sm_of_block, cudaStream_t stream = nullptr);

}  // namespace hypic::kernels::cuda
