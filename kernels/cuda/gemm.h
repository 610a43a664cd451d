// Dense bf16 GEMM on the GPU through cuBLASLt: the projections of the hybrid forward pass
// (y = x W^T, torch.nn.Linear convention), with fp32 accumulation and bf16 or fp32 output.
//
// Layouts: every matrix is ROW-major. x[M][K] with row stride ldx (elements), W[N][K] dense
// (row stride K, like torch.nn.Linear.weight), y[M][N] with row stride ldy. All pointers are
// DEVICE pointers. Numerics: bf16 operands, fp32 accumulation (CUBLAS_COMPUTE_32F, never TF32),
// fp32 alpha = 1 / beta, result rounded once to y's type.
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>

namespace hypic::kernels::cuda {

using bf16 = __nv_bfloat16;

/// Owns a cuBLASLt handle and a device workspace (32 MiB by default) and caches, per call shape
/// (M, N, K, ldx, ldy, y type, pointer alignments), the matmul descriptors and the
/// algorithm chosen by cublasLtMatmulAlgoGetHeuristic. Once a shape has been run uncaptured,
/// further calls of that shape allocate nothing and never synchronise with the host, so they can
/// be captured in a CUDA graph. One runner per stream (the workspace is shared by its calls);
/// not thread-safe. Construction needs a current CUDA device (cudaMalloc of the workspace).
class GemmRunner {
 public:
  static constexpr size_t kDefaultWorkspaceBytes = size_t(32) << 20;
  /// Throws std::runtime_error on cuBLASLt / CUDA failures.
  explicit GemmRunner(size_t workspace_bytes = kDefaultWorkspaceBytes);
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;
  ~GemmRunner();

  /// y[M][N] = alpha x[M][K] * W[N][K]^T + beta * y, asynchronously on `stream`.
  ///   x: bf16, row stride ldx >= K; W: bf16 [N][K] dense; y: y_type (CUDA_R_16BF or CUDA_R_32F),
  ///   row stride ldy >= N. beta = 0 ignores y's old contents (NaN there is not propagated);
  ///   beta = 1 with an fp32 y adds the projection into a residual stream (alpha != 1: scaled, as MiniMax's
  ///   residual beta factors). M = 0 is a no-op.
  /// The first call of a shape queries the heuristic (host only) and caches descriptors; do it
  /// uncaptured. Pointers need only the alignment of their element type; the alignment actually
  /// seen is part of the cache key (cuBLASLt kernels need to know it).
  /// Throws std::invalid_argument on M < 0, N <= 0, K <= 0, ldx < K, ldy < N, sizes beyond the
  /// int range, null pointers or another y_type; std::runtime_error("GemmRunner::linear ...:
  /// <cuBLAS status name>") when cuBLASLt fails or finds no algorithm.
  void linear(int M, int N, int K, const bf16* x, long ldx, const bf16* W, void* y, cudaDataType_t y_type, long ldy,
              float beta, cudaStream_t stream, float alpha = 1.0f);

  /// `batch` independent products of linear's form, the i-th on x + i stride_x, W + i stride_w, y + i stride_y
  /// (elements; cuBLASLt strided batch): y_i[M][N] = alpha x_i[M][K] W_i[N][K]^T + beta y_i. Used per head (MLA's
  /// absorbed W_UK / W_UV, engine/cuda/mla_mixer.h). batch = 1 is linear. Same contract and errors as linear, plus
  /// std::invalid_argument on batch < 1 or negative strides.
  void linear_batched(int batch, int M, int N, int K, const bf16* x, long ldx, long stride_x, const bf16* W,
                      long stride_w, void* y, cudaDataType_t y_type, long ldy, long stride_y, float beta,
                      cudaStream_t stream, float alpha = 1.0f);

  /// The raw cuBLASLt handle (for callers that need one on the same device).
  cublasLtHandle_t handle() const { return lt_; }
  /// Number of distinct shapes planned so far (each cost one heuristic query).
  size_t plans() const { return plans_.size(); }

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // (M, N, K, ldx, ldy, y_type, align_x, align_w, align_y, batch, stride_x, stride_w, stride_y)
  using Key = std::tuple<int, int, int, long, long, int, int, int, int, int, long, long, long>;
  const Plan& plan_for(const Key& key);

  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, Plan> plans_;
};

/// Runs an n x n x n bf16 GEMM (bf16 output, fp32 accumulation) through a fresh GemmRunner:
/// 3 warm-up runs, then timed runs (at least 10 and about 200 ms) between CUDA events on
/// `stream`, and returns the achieved TFLOP/s (2 n^3 per GEMM). Used by the benchmark as the
/// machine's dense GEMM ceiling. Allocates and frees 3 n^2 bf16 on the device; synchronises.
/// Throws std::invalid_argument for n <= 0 or n > 46340, std::runtime_error on CUDA errors.
double measure_bf16_tflops(int n, cudaStream_t stream);

}  // namespace hypic::kernels::cuda
