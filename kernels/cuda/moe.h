// Sparse MoE block (Qwen3NextSparseMoeBlock / Qwen3_5MoeSparseMoeBlock) and the dense SwiGLU MLP
// (Qwen3NextMLP) on the GPU, bf16 weights and activations, fp32 accumulation and fp32 output.
// Reference: engine/cpu/model.cpp Model::moe_block / Model::mlp_block (CPU fp32, matches HF).
//
// All pointers are DEVICE pointers; matrices are row-major; every call is asynchronous on
// `stream`. Supported sizes: H a multiple of 64, I and Is multiples of 32, 1 <= topk <= 16,
// topk <= E <= 512, T >= 0 (T = 0 is a no-op); x and the weights 16-byte aligned, out 16-byte
// aligned. Anything else throws std::invalid_argument naming the value.
//
// moe_forward pipeline (all on the device; with GroupedGemm::Own no host synchronisation):
//   1. router logits [T][E] = x W_router^T, fp32 output (GemmRunner)
//   2. route: per token softmax over E (fp32), top-k (ties: lower expert first), optional
//      renormalisation (or MoeScoring::Sigmoid: grouped top-k of sigmoid + bias, see there); the k (expert, weight) pairs stored in ascending expert order; the shared
//      expert gate sigmoid(x . shared_gate) (fp32); per-chunk (32 tokens) expert histograms
//   3. stable counting sort of the (token, slot) pairs by expert: per-expert prefix over chunks,
//      expert offsets by a prefix sum over E, the m-tile schedule of the grouped GEMM, and each
//      pair's position in the expert-sorted order (tokens ascending within an expert)
//   4. grouped GEMM gate_up on the gathered rows, SwiGLU fused in the epilogue:
//      act[p][j] = bf16( silu(bf16(g)) * bf16(u) ) (fp32 math on the bf16-rounded GEMM outputs)
//   5. grouped GEMM down: y[p][H] bf16 = act[p] D_e^T
//      Steps 4-5 on the prefill tiles (128-row m-tiles of one expert each; OwnWgmma below 32 routed
//      rows per expert on average: 64-row m-tiles): on Hopper (compute capability 9.0, library built
//      with CUDA >= 12 for sm_90a) wgmma kernels (moe_wgmma.cu: 128 x 256 tiles, two warpgroups of
//      m64n256k16, a 4-stage cp.async pipeline; or 64 x 256 tiles, two warpgroups of m64n128k16 over
//      the same 64 rows, 5 stages; both operands from 128-byte-swizzled shared memory; gate_up writes
//      128 act columns per tile),
//      elsewhere (or HYPIC_MOE_WGMMA=0 in the environment, read once) mma.sync kernels; same
//      inputs, outputs, roundings and schedule, only the fp32 summation order differs.
//   6. shared expert (when Is > 0): GemmRunner gate_up (bf16), silu_mul, down (fp32 [T][H]);
//      on the decode path (GroupedGemm::OwnDecode, and Own for T <= 64) steps 4-6 are two
//      launches: the shared expert is one more "expert" of the grouped decode GEMMs (same
//      roundings: bf16 SwiGLU activation, fp32 output), and steps 2-3 are one single-block kernel
//      for T <= 64, where step 1 is a decode_linear for T <= kMaxDecodeLinearTokens (16; no GemmRunner
//      call at all then; decode_linear.h). The
//      decode kernels are launched with programmatic dependent launch (PDL; HYPIC_MOE_PDL=0 in
//      the environment turns it off).
//   7. combine (deterministic gather, no atomics): out[t] += sum over the token's k experts in
//      ascending expert order of w * y[pos] (fp32), + sigmoid gate * shared[t]
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/gemm.h"

namespace hypic::kernels::cuda {

/// How a token's experts are scored and picked (step 2 of moe_forward).
enum class MoeScoring {
  /// softmax over the E logits, top-k of the probabilities (Qwen3-Next / Qwen3.5, MiniMax); weights = the
  /// probabilities (renormalised over the k when `renormalize`)
  Softmax,
  /// s = sigmoid(logits); experts picked by the choice score s + expert_bias, within the topk_group groups (of E /
  /// n_group experts) whose two best choice scores sum highest (the one best for groups of one); weights = s of the
  /// picks, / (their sum + 1e-20) when `renormalize`, times routed_scaling (DeepSeek-V3's noaux_tc routing as
  /// Kimi-Linear and Ring-linear use it: HF KimiMoEGate, BailingMoeV2Gate; CPU: engine/families/shared route_sigmoid)
  Sigmoid,
};

/// The weights of one MoE layer, all bf16 row-major on the device (views, not owned).
struct MoeWeightsView {
  int E = 0;                 ///< number of routed experts, topk <= E <= 512
  int H = 0;                 ///< hidden size, multiple of 64
  int I = 0;                 ///< routed expert intermediate size, multiple of 32
  int topk = 0;              ///< experts per token, 1..16
  bool renormalize = true;   ///< HF norm_topk_prob: top-k weights /= their sum
  MoeScoring scoring = MoeScoring::Softmax;
  const float* expert_bias = nullptr;  ///< Sigmoid: [E] fp32 choice bias (e_score_correction_bias), or nullptr
  int n_group = 1;                     ///< Sigmoid: expert groups, divides E, 1..32
  int topk_group = 1;                  ///< Sigmoid: groups kept, 1..n_group, topk <= topk_group E / n_group
  float routed_scaling = 1.0f;         ///< Sigmoid: multiplier of the routed weights (routed_scaling_factor)
  /// The block's output is added to `out` times this (MiniMax's post-norm mlp_beta factor; 1 elsewhere, exact).
  float output_scale = 1.0f;
  const bf16* router = nullptr;           ///< [E][H]
  const bf16* experts_gate_up = nullptr;  ///< [E][2I][H]: per expert I gate rows, then I up rows
  const bf16* experts_down = nullptr;     ///< [E][H][I]
  int Is = 0;                             ///< shared expert width (multiple of 32), 0 = no shared expert
  const bf16* shared_gate_up = nullptr;   ///< [2Is][H]: gate rows then up rows
  const bf16* shared_down = nullptr;      ///< [H][Is]
  const bf16* shared_gate = nullptr;      ///< [1][H] (shared_expert_gate), or nullptr: the shared expert's output
                                          ///< is added ungated (Kimi-Linear, Ring-linear)
};

/// Which grouped GEMM moe_forward runs for the routed experts.
enum class GroupedGemm {
  Own,         ///< hypic's kernels (capturable): T <= 64 the decode path (OwnDecode), else the
               ///< tiles chosen from T * topk / E: OwnSmallM up to 16 rows per expert on average,
               ///< beyond that the prefill tiles, on wgmma where moe_wgmma_available() (OwnWgmma),
               ///< else on mma.sync (OwnLargeM)
  Cublas,      ///< cublasGemmGroupedBatchedEx (host sync for the per-expert counts; NOT capturable)
  OwnSmallM,   ///< 16 x 64 smem-tiled kernels forced, shared expert via cuBLASLt, multi-kernel routing
               ///< (= Own before the decode path; tests, benchmarks)
  OwnLargeM,   ///< the mma.sync prefill tiles (128 x 128) forced (tests, benchmarks)
  OwnDecode,   ///< the decode path forced at any T: weight-streaming GEMMs (weights straight from
               ///< global memory into mma fragments, split-K inside a block, deterministic smem
               ///< reduction), the shared expert as one more expert of the same launches, PDL
               ///< launches, and for T <= 64 the whole routing in one block (tests, benchmarks)
  OwnLargeN,   ///< wide prefill tiles (128 x 256, 64 x 64 warp tiles) forced (tests, benchmarks)
  OwnWgmma,    ///< the Hopper wgmma prefill tiles (128 x 256, or 64 x 256 for few rows per expert) forced at any T
               ///< says (tests, benchmarks); on devices without them (not compute capability 9.0, or a
               ///< build without sm_90a) the mma.sync prefill tiles (OwnLargeM)
};

/// True when GroupedGemm::Own runs its prefill tiles on the wgmma kernels: the library was built
/// with them (CUDA >= 12, sm_90a), the current device has compute capability 9.0 and the
/// environment variable HYPIC_MOE_WGMMA is not "0" (read once). Variants for comparisons (also for
/// OwnWgmma): "2" the down GEMM on 128 x 128 tiles (two blocks per SM), "3" persistent blocks (one
/// per SM, the copies of the next tile overlapping the current one's last k-steps and epilogue),
/// "4" both, "5" the default without OwnWgmma's 64 x 256 tiles, "6" persistent warp-specialised blocks (a
/// loading warpgroup and two wgmma warpgroups per SM, synchronised by mbarriers; also variant 1's 128-row tiles
/// below 512 routed rows per expert under the measured default HYPIC_MOE_WARP_SPECIALIZED), "7" 6 in clusters of two
/// on m-tile pairs, "8" gate_up as 6 and down as the default, "9" the default with its 64 x 256 tiles on the
/// warp-specialised blocks (also variant 1 under the measured default HYPIC_MOE_WS_SMALL); unset or anything else
/// the default (one
/// block per 128 x 256 tile; OwnWgmma below 32 routed rows per expert: 64 x 256). Host only; throws
/// std::runtime_error on CUDA errors.
bool moe_wgmma_available();

/// Launches of the persistent wgmma GEMM kernels (HYPIC_MOE_WGMMA=3 / 4, or variant 1's long calls under the
/// candidate HYPIC_MOE_PERSISTENT_LONG: from 256 routed rows per expert on average) in this process, counted on the
/// host as each is issued (two per moe_forward that takes them; a CUDA graph counts them once, at its capture, and
/// none per replay): lets a test tell which schedule ran. Host only.
uint64_t moe_persistent_launches();

/// Launches of the warp-specialised wgmma GEMM kernels (HYPIC_MOE_WGMMA=6, or variant 1's 128-row tiles below 512
/// routed rows per expert under HYPIC_MOE_WARP_SPECIALIZED; their 64-row tiles: HYPIC_MOE_WGMMA=9, or variant 1's
/// below 32 routed rows per expert under HYPIC_MOE_WS_SMALL), counted as moe_persistent_launches counts. Host only.
uint64_t moe_warp_specialized_launches();

/// Launches of the warp-specialised wgmma GEMM kernels in clusters of two on m-tile pairs (HYPIC_MOE_WGMMA=7, or
/// variant 1's 128-row tiles under the candidate HYPIC_MOE_CLUSTER_PAIRS), counted as moe_persistent_launches counts
/// (not among moe_warp_specialized_launches). Host only.
uint64_t moe_cluster_pair_launches();

/// Launches of the swap-AB wgmma GEMM kernels (the candidate HYPIC_MOE_SWAP_AB: OwnWgmma below 512 routed rows per
/// expert on average, the expert weights as the wgmma M side and its tokens as N in steps of 16), counted as
/// moe_persistent_launches counts (two per moe_forward that takes them). Host only.
uint64_t moe_swap_ab_launches();

/// The swap-AB gate_up launches that loaded each k-step's 128 weight rows as one TMA box of a 5-D view of the weights
/// (the candidate HYPIC_MOE_SWAP_AB's HYPIC_MOE_SWAP_5D, where the driver encodes that view), counted as
/// moe_swap_ab_launches counts; the others load 16 boxes of 8 rows. Host only.
uint64_t moe_swap_ab_5d_launches();

/// Device scratch of moe_forward / mlp_forward, grown on demand and then reused: after
/// reserve(max_tokens, view) (or one call with that many tokens and those sizes) calls with
/// T <= max_tokens allocate nothing, so they can be captured in a CUDA graph (GroupedGemm::Own).
/// A captured graph reads this workspace's buffers: keep it alive and do not grow it (no larger
/// T or other sizes) between the capture and the last replay. The Cublas path also holds a cuBLAS
/// handle, pinned host staging and gathered-input buffers ([T*topk][H] and [T*topk][2I] bf16),
/// allocated on its first use. One workspace per stream; not thread-safe.
class MoeWorkspace {
 public:
  MoeWorkspace() = default;
  MoeWorkspace(const MoeWorkspace&) = delete;
  MoeWorkspace& operator=(const MoeWorkspace&) = delete;
  ~MoeWorkspace();
  /// Makes room for moe_forward (GroupedGemm::Own*) with up to max_tokens tokens of a layer
  /// shaped like `w` (validated as moe_forward does). Throws std::invalid_argument on bad sizes or
  /// when moe_forward finds that it must grow while its stream is being captured,
  /// std::runtime_error when cudaMalloc fails.
  void reserve(int max_tokens, const MoeWeightsView& w);
  /// Same for mlp_forward alone: T <= max_tokens, hidden H, intermediate I.
  void reserve_mlp(int max_tokens, int H, int I);
  /// Bytes held on the device.
  size_t bytes() const;

  // Implementation detail (used by moe.cu): growable device buffers.
  struct Buf {
    void* p = nullptr;
    size_t bytes = 0;
  };
  /// Reallocates b (contents lost) when it holds fewer than `bytes`; returns whether it did. Throws
  /// std::invalid_argument while capturing, std::runtime_error when cudaMalloc fails.
  bool grow(Buf& b, size_t bytes, const char* name);
  Buf logits, topk_e, topk_w, sgate, chunk_counts, counts, offsets, tiles, num_tiles, sorted_tok, pos_of, act, y,
      s_gu, s_act, s_out, mlp_gu, mlp_act;
  // One int: the decode routing's ticket (route_small_kernel over several blocks), zero when allocated and left zero
  // by every launch; nothing else may write it.
  Buf route_ticket;
  // Decode GEMM tiles as int4 (expert, first row, expert's offset, expert's rows) for T <= 64, written by the
  // routing beside `tiles` and read by the decode GEMMs (HYPIC_MOE_DECODE_TILE_INFO, on by default; allocated
  // whatever the switch says).
  Buf dec_tiles;
  // Cublas path only.
  Buf xs, gu, ptrs;
  bool capturing = false;  // set by moe_forward / mlp_forward: growth then throws
  void* host_pinned = nullptr;
  size_t host_pinned_bytes = 0;
  void* cublas = nullptr;  // cublasHandle_t
};

/// The grouped-GEMM implementation for a prefill pass of T tokens: ours below kMoeCublasFromTokens tokens; from there
/// the wgmma prefill tiles where moe_wgmma_available() (GroupedGemm::OwnWgmma; no host synchronisation), else cuBLAS's
/// grouped GEMM. Measured on the H200 at Qwen3.5-35B-A3B sizes, one MoE layer, ms (test_gpu_moe [.bench], 2026-12-04,
/// one call): T = 16: Own 0.268, OwnWgmma 0.251, Cublas 0.316; 32: 0.443 / 0.337 / -; 64: 0.587 / 0.431 / 0.544;
/// 128: 0.664 / 0.481 / 0.593; 256: 0.693 / 0.501 / 0.599; 1024: Own (on the wgmma tiles) 0.555, mma.sync tiles
/// 1.056; and (test_gpu_moe [.bench_wgmma], 2026-12-03) 32768 tokens: OwnWgmma 4.815, cuBLAS 7.950, mma.sync 8.76.
/// Decode steps always use Own (the weight-streaming decode GEMMs up to 64 tokens: a token's result does not depend
/// on the batch it is decoded in, and they are captured in CUDA graphs whose replays must give the eager bits): pass
/// capturing = true.
inline constexpr int kMoeCublasFromTokens = 32;
inline GroupedGemm grouped_gemm_for_tokens(int T, bool capturing = false) {
  if (capturing || T < kMoeCublasFromTokens) return GroupedGemm::Own;
  return moe_wgmma_available() ? GroupedGemm::OwnWgmma : GroupedGemm::Cublas;
}

/// The next layer's input RMSNorm of the rows moe_forward updates (the forward pass's next step, done in the same
/// pass as the combine that adds the MoE output into the residual): y[t] = bf16(out[t] * rsqrt(mean(out[t]^2) + eps)
/// * (zero_centred ? 1 + w : w)), exactly rms_norm_residual's arithmetic and bits (kernels/cuda/ops.h; HF
/// Qwen3_5RMSNorm / the plain RMSNorm of the other families) on the updated out rows. w: [H] bf16; y: [T][H] bf16,
/// may alias moe_forward's x (its input, read before); both device memory, 4-byte aligned.
struct MoeNextNorm {
  const bf16* w = nullptr;
  float eps = 1e-6f;
  bool zero_centred = true;
  bf16* y = nullptr;
};

/// out[t][:] += MoE(x[t]) for t < T (see the pipeline above); with next, then y = next norm(out) (MoeNextNorm:
/// fused into the combine kernel for H <= 8192 where the candidate switch HYPIC_FUSE_NEXT_NORM is on
/// (kernels/cuda/switches.h), else rms_norm_residual after it: the same bits either way). x: [T][H] bf16 (the normed
/// hidden state); out: [T][H] fp32, ACCUMULATED. Routed results are bit-identical from run to
/// run (no float atomics) and, for GroupedGemm::Own, a token's routed output does not depend on
/// the other tokens of the batch (rows of a GEMM tile are independent and the k order is fixed).
/// With every impl but Cublas the call never synchronises with the host and is capturable in a
/// CUDA graph for a fixed T after a first uncaptured call (which plans the GemmRunner shapes and
/// grows the workspace). Cublas copies the per-expert counts to the host and waits.
/// Throws std::invalid_argument on bad sizes (see the top of the file) or null pointers,
/// std::runtime_error on CUDA / cuBLAS errors.
void moe_forward(int T, const bf16* x, const MoeWeightsView& w, float* out, MoeWorkspace& ws, GemmRunner& gemm,
                 GroupedGemm impl, cudaStream_t stream, const MoeNextNorm* next = nullptr);

/// Dense SwiGLU MLP (HF Qwen3NextMLP): out[T][H] (fp32) += down(silu(gate) * up) with
/// gate_up = x gate_up^T computed in bf16 (gate_up: [2I][H], gate rows then up rows),
/// act = bf16(silu(g) * u) in fp32 math, down: [H][I], the down GEMM accumulating into out
/// (GemmRunner, beta = 1). H a multiple of 64, I a multiple of 32. Capturable after a first call.
void mlp_forward(int T, const bf16* x, int H, int I, const bf16* gate_up, const bf16* down, float* out,
                 MoeWorkspace& ws, GemmRunner& gemm, cudaStream_t stream);

/// act[t][j] = bf16( silu(gu[t][j]) * gu[t][I + j] ) for t < T, j < I (fp32 math on the bf16
/// values). gu: [T][2I] bf16 (row stride 2I); act: [T][I] bf16. I a multiple of 8 (throws
/// std::invalid_argument otherwise), pointers 16-byte aligned.
void silu_mul(int T, int I, const bf16* gu, bf16* act, cudaStream_t stream);

}  // namespace hypic::kernels::cuda
