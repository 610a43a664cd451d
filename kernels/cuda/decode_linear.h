// Dense projections of a decode step on the GPU: y = x W^T (torch.nn.Linear convention) for a few tokens, as one
// weight-streaming kernel per call that reads each weight matrix once at memory bandwidth (kernels/cuda/
// stream_gemm.cuh), for up to kMaxDecodeLinearOutputs weight matrices that share the input x in one launch (a GDN
// layer's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; an attention layer's q_proj and k/v_proj).
//
// Why not cuBLASLt at these shapes: for M <= 64 its kernels read a 16-34 MB weight at 1.3-2.8 TB/s and the fp32
// residual projections take a split-K pass plus a reduction kernel (Nsight Compute, bench/results/
// decode_kernels_h200.md). Here each token's result is also independent of the other tokens of the batch (fixed
// summation order, no split depending on M), so a sequence decoded alone or in a batch gets the same bits.
//
// Numerics: bf16 operands, fp32 accumulation (each warp sums its K slice in ascending k through m16n8k16 mma; the
// slices are added in ascending order), then y = bf16(sum) (Store bf16), y = sum (Store fp32) or y += sum (Add
// fp32, the residual stream). All pointers are DEVICE pointers; matrices row-major.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>


namespace hypic::kernels::cuda {

using bf16 = __nv_bfloat16;

/// Largest M (tokens) of decode_linear: the decode batches of the CUDA backend's graphs (the MoE router of every
/// decode step up to 64 tokens, so that a token's routing does not depend on its batch).
constexpr int kMaxDecodeLinearTokens = 64;
/// Largest M at which the CUDA backend runs its dense decode projections through decode_linear: above it every row
/// group's copy of all of x [M][K] costs more than the weight stream saves (at M = 64 a 2048 x 4096 fp32-residual
/// projection took 41 us against cuBLASLt's 13 with x read through L1/L2; Nsight Compute, H200, 2026-12-04).
constexpr int kDecodeLinearProjectionTokens = 16;
/// Most weight matrices sharing one x in one decode_linear launch.
constexpr int kMaxDecodeLinearOutputs = 4;

/// What decode_linear writes into each output.
enum class DecodeLinearEpilogue {
  StoreBf16,  ///< y (bf16) = round(x W^T)
  StoreF32,   ///< y (fp32) = x W^T
  AddF32,     ///< y (fp32) += x W^T (beta = 1 into a residual stream)
};

/// One weight matrix and its output: W [N][K] bf16 dense (row stride K); y [M][N] with row stride ldy >= N
/// (elements of y's type: bf16 for StoreBf16, fp32 otherwise).
struct DecodeLinearOutput {
  const bf16* W = nullptr;
  int N = 0;
  void* y = nullptr;
  long ldy = 0;
};

/// The RMSNorm of the rows decode_linear adds into (AddF32, one output: the residual stream), done by the launch's
/// last block once every block has added its part (the next step of a decode layer: the post-attention norm before
/// the MoE), so no separate norm kernel runs: y[m] = bf16(r[m] * rsqrt(mean(r[m]^2) + eps) * (zero_centred ? 1 + w :
/// w)) over the output's N columns of row m of r = the output (fp32, after the add), exactly rms_norm_residual's
/// arithmetic and bits (kernels/cuda/row_norm.cuh). w: [N] bf16, y: [M][N] bf16, counter: one DEVICE
/// unsigned, zero before the call and left zero (the caller's, one per stream: launches on one stream run in order).
struct DecodeLinearNorm {
  const bf16* w = nullptr;
  float eps = 1e-6f;
  bool zero_centred = true;
  bf16* y = nullptr;
  unsigned* counter = nullptr;
};
/// Largest M whose norm the last block does (one row after another: beyond it a separate norm kernel is faster);
/// decode_linear runs rms_norm_residual after the launch for larger M.
constexpr int kDecodeLinearNormInBlockMaxTokens = 2;

/// True when decode_linear takes these arguments: 1 <= M <= kMaxDecodeLinearTokens, K > 0 a multiple of 32,
/// 1 .. kMaxDecodeLinearOutputs outputs each with N >= 1 and ldy >= N, x and every W 16-byte aligned, ldx >= K and
/// a multiple of 8, and the current device's shared memory holds the kernel's rings (up to 160 KiB). Host only (queries
/// the current device once); callers fall back to GemmRunner otherwise.
bool decode_linear_supported(int M, int K, const bf16* x, long ldx, const DecodeLinearOutput* outputs, int n_outputs);

/// For each output o: o.y[M][o.N] (row stride o.ldy) (=, +=) x[M][K] (row stride ldx) o.W^T, asynchronously on
/// `stream`, one launch (with programmatic dependent launch: its weight loads start while the stream's previous
/// kernel drains; see kernels/cuda/pdl.cuh). Capturable in a CUDA graph (no allocation, no host synchronisation;
/// the first call sets the kernels' shared-memory attribute, do it uncaptured). Outputs must not overlap x or each
/// other. Throws std::invalid_argument when !decode_linear_supported (naming the value), std::runtime_error on
/// CUDA errors.
/// norm (optional, see DecodeLinearNorm): also the RMSNorm of the output rows; needs epilogue AddF32, one output,
/// its N and ldy multiples of 4, non-null w, y and counter (std::invalid_argument otherwise); the norm is done in the
/// launch's last block for M <= kDecodeLinearNormInBlockMaxTokens where HYPIC_FUSE_POST_NORM (a candidate:
/// kernels/cuda/switches.h) is on, else by rms_norm_residual after it (the same bits either way).
void decode_linear(int M, int K, const bf16* x, long ldx, const DecodeLinearOutput* outputs, int n_outputs,
                   DecodeLinearEpilogue epilogue, cudaStream_t stream, const DecodeLinearNorm* norm = nullptr);

}  // namespace hypic::kernels::cuda
