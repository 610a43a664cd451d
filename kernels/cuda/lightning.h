// CUDA kernels of lightning attention (MiniMax-Text-01, Ring-linear-2.0): linear attention with one constant scalar
// decay per head and no delta rule, its segment transition T_C (one scalar per head), the composition of cached
// (T_C, S) pairs and the re-rotation of a cached state to the position it is used at (Ring-linear's RoPE inside the
// linear layer).
//
// Conventions are those of kernels/cpu/lightning.h, the reference these kernels are tested against: one head's state
// S is d x d fp32 row-major ([d_k][d_v], rows = key dims), left-multiplied,
//     S_t = e^{-s_h} S_{t-1} + k_t v_t^T,     o_t = S_t^T q_t   (the updated state),
// as HF MiniMaxLightningAttention / BailingMoeLinear's lightning layer compute it (q, k, v as the layer feeds them:
// MiniMax silu'd, Ring normed, rotated and scaled). A span's transition is T_C = e^{-s_h |C|}, kept as the product of
// the chunks' e^{-s_h n} in fp32 with values below FLT_MIN flushed to 0 (as the CPU reference does).
// Head sizes d_k = d_v = 64 or 128 (MiniMax-Text-01 and Ring-linear-2.0 use 128); other sizes throw.
//
// All pointers are device pointers unless named *_host; every call is asynchronous on `stream` and throws
// std::invalid_argument for bad shapes, null or misaligned pointers and std::runtime_error for CUDA errors.
// Source of the chunked form: Lightning Attention-2 (Qin et al. 2024, Algorithm 1: intra-block masked product plus
// inter-block state product), the block loop of HF MiniMaxLightningAttention.forward.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace hypic::kernels::cuda {

using bf16 = __nv_bfloat16;

/// Chunk length of the lightning prefill (tokens). The CPU reference's block (the checkpoint's block_size, 256 in HF)
/// only changes rounding: the chunked form is exact for any block.
inline constexpr int kLightningChunk = 64;

/// True for the head sizes the lightning kernels are built for (64, 128).
bool lightning_head_dim_supported(int head_dim);

/// One chunked lightning prefill over `num_seqs` independent sequences (segments) packed back to back along the token
/// axis ("varlen"); T = the last cu_seqlens entry.
struct LightningPrefillArgs {
  int num_seqs = 0;
  const int* cu_seqlens = nullptr;  ///< DEVICE int32 [num_seqs + 1], 0 first, non-decreasing (lengths may be 0)
  int max_seqlen = 0;               ///< HOST: the longest sequence's length, tokens (chooses the scan parts)
  int num_heads = 0;                ///< H
  int head_dim = 128;               ///< d = d_k = d_v: 64 or 128
  const bf16* q = nullptr;          ///< [T][H][d] (already scaled as the layer scales it)
  const bf16* k = nullptr;          ///< [T][H][d]
  const bf16* v = nullptr;          ///< [T][H][d]
  const float* slope = nullptr;     ///< [H] decay rates s_h >= 0 (HF slope_rate, per layer)
  const float* initial_state = nullptr;  ///< [num_seqs][H][d][d] fp32, or nullptr (zero state)
  float* final_state = nullptr;     ///< [num_seqs][H][d][d] fp32 or nullptr; may alias initial_state
  float* transition = nullptr;      ///< [num_seqs][H] fp32 T_C, or nullptr
  bf16* out = nullptr;              ///< [T][H][d] o_t, bf16, or nullptr (states only)
  /// Sequence-parallel scan (DESIGN.md 3.1 composition law, which for a scalar T_C is S = T S' + S''): sequences are
  /// cut at chunk boundaries into parts of one common length; a first launch computes each part's zero-start state,
  /// a fold composes the parts' initial states, and a second launch runs every part from its true initial state.
  /// 0 = chosen by occupancy (lightning_scan_parts); 1 = never; P >= 2 = parts of ceil(max_chunks / P) chunks. Results
  /// agree with the unsplit scan within bf16 rounding, not bit for bit.
  int seq_parts = 0;
  void* workspace = nullptr;        ///< DEVICE scratch of lightning_prefill_workspace_bytes(args) bytes (nullptr if 0)
  size_t workspace_bytes = 0;
};

/// The number of scan parts lightning_prefill uses for `a` (1 = unsplit): with seq_parts = 0, a split only when the
/// unsplit launch (num_seqs x H x d/64 blocks) fills less than half of one wave and the longest sequence has at least
/// 16 chunks, into at most max_chunks / 8 parts, as many as fill one wave (every part but the last of
/// ceil(max_chunks / P) chunks). Queries the current device.
/// Throws std::invalid_argument on the shape errors lightning_prefill rejects.
int lightning_scan_parts(const LightningPrefillArgs& a);

/// Device scratch lightning_prefill needs for `a`, bytes: the parts' initial states, num_seqs x P x H x d x d fp32 when
/// the scan is split into P >= 2 parts, else 0.
size_t lightning_prefill_workspace_bytes(const LightningPrefillArgs& a);

/// Chunked lightning prefill (chunk 64): per sequence and head the outputs, the final state and T_C from one pass
/// (two launches and a fold when split, see seq_parts). One block per (sequence part, head, 64 value columns) carries
/// its 64 state columns in registers across the chunks. Numerics: bf16 operands on tensor cores (mma.sync) with fp32
/// accumulation; the running state stays fp32, the masked score matrix, the decay-scaled values and the state fed to
/// the tensor cores for the inter-chunk term are bf16 (as in flash-linear-attention). A sequence of length 0 yields
/// final = initial, T_C = 1. q, k, v, out and the states must be 16-byte aligned.
/// Throws std::invalid_argument on null required or misaligned pointers, a head size other than 64 or 128,
/// num_seqs < 0, H <= 0, max_seqlen < 0, seq_parts < 0, or a workspace smaller than needed; std::runtime_error on
/// CUDA errors. cu_seqlens is read on the device only: a sequence longer than max_seqlen is still scanned whole (its
/// last part takes the rest: only slower); q, k, v and out must hold cu_seqlens[num_seqs] rows.
void lightning_prefill(const LightningPrefillArgs& args, cudaStream_t stream = nullptr);

/// One recurrent decode step for `batch` requests (one token each), in place on fp32 states:
///   S <- e^{-s_h} S + k v^T,  o = S^T q   (HF MiniMaxLightningAttention's decode branch), fp32 throughout.
///   q, k, v: [batch][H][d] bf16; slope: [H]; state: [batch][H][d][d] fp32; out: [batch][H][d] bf16 (nullable);
///   state_slots: nullptr, or DEVICE int32 [batch]: request b's state is state[state_slots[b]] of a slot pool
///   [slots][H][d][d] (distinct slots).
/// Throws std::invalid_argument on bad sizes or null inputs.
void lightning_decode(int batch, int num_heads, int head_dim, const bf16* q, const bf16* k, const bf16* v,
                      const float* slope, float* state, bf16* out, cudaStream_t stream = nullptr,
                      const int* state_slots = nullptr);

/// Composition with scalar transitions (DESIGN.md 3.1): folds `num_segments` cached (T, S) pairs into running states,
///   running[b] <- T[i][b] running[b] + S[i][b],  i = 0 .. num_segments-1,
/// b enumerating (layer, head) pairs. running: [batch][dim] fp32 in/out (dim = d_k d_v); transitions:
/// [num_segments][batch] fp32 (one scalar per head); states: [num_segments][batch][dim] fp32, or nullptr (S = 0).
/// fp32 FMA arithmetic. dim must be a multiple of 4 and the arrays 16-byte aligned.
void scalar_compose_fold(int batch, int dim, int num_segments, float* running, const float* transitions,
                         const float* states, cudaStream_t stream = nullptr);

/// What lightning_qkv_prepare does to the fused projection's output (HF MiniMaxLightningAttention: silu only;
/// BailingMoeV2 linear attention (Ring-linear-2.0): optional silu, RMSNorm of q and k per head, partial NeoX RoPE,
/// q scaled by d^-1/2).
struct LightningQkvArgs {
  int tokens = 0;                  ///< T
  int num_heads = 0;               ///< H
  int head_dim = 128;              ///< d: 64 or 128
  const bf16* qkv = nullptr;       ///< [T][3][H][d] bf16: q heads, then k heads, then v heads (qkv_proj output)
  bool silu = false;               ///< silu on every value first (MiniMax; Ring's linear_silu)
  const bf16* q_norm = nullptr;    ///< [d] plain RMSNorm weight of q (w * x * rsqrt(mean x^2 + eps)), or nullptr
  const bf16* k_norm = nullptr;    ///< [d] the same for k, or nullptr
  float eps = 1e-6f;
  const float* inv_freq = nullptr;  ///< [rope_half] fp32, or nullptr (no RoPE): dims i, i + rope_half (i < rope_half)
  int rope_half = 0;                ///< of q and k rotated by angle float(positions[t]) * inv_freq[i] (fp32)
  const int* positions = nullptr;   ///< [T] int32 absolute positions (with inv_freq)
  float scale = 1.0f;               ///< q multiplier, last
  bf16* q = nullptr;                ///< [T][H][d] out
  bf16* k = nullptr;                ///< [T][H][d] out
  bf16* v = nullptr;                ///< [T][H][d] out (silu'd when `silu`, else copied)
};

/// The lightning layer's q, k, v from its fused projection, in the order silu, norm, RoPE, scale (the HF classes
/// above; CPU: engine/families/shared lightning_qkv and ring_linear lightning_layer), fp32 math, one rounding to bf16
/// per output. One warp per (token, part, head) row.
/// Throws std::invalid_argument on a head size other than 64 or 128, negative sizes, null required pointers, pointers
/// not 4-byte aligned, or RoPE asked for (inv_freq or rope_half) without inv_freq, positions and 0 < 2 rope_half <= d.
void lightning_qkv_prepare(const LightningQkvArgs& args, cudaStream_t stream = nullptr);

/// Rotates linear-attention states on their key axis by one angle (kernels/cpu apply_rope_key_axis, DESIGN.md 3.3):
/// for each of `heads` states [d_k][d_v] fp32 row-major and i < half, rows i and i + half become
///   row_i cos - row_{i+half} sin,  row_{i+half} cos + row_i sin,   angle = float(position) * inv_freq[i] (fp32),
/// i.e. R(position) S, the state the same tokens give with keys rotated `position` further (the cached S(C|0) of a
/// Ring-linear segment moved to its offset). inv_freq: DEVICE [half] fp32, 2 half <= d_k.
void rope_key_axis(int heads, int d_k, int d_v, int half, const float* inv_freq, int64_t position, float* state,
                   cudaStream_t stream = nullptr);

}  // namespace hypic::kernels::cuda
