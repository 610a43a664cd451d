// GemmRunner (cuBLASLt bf16 GEMM, fp32 accumulation) and the dense GEMM ceiling measurement.
//
// Layout mapping (cuBLAS is column-major). A row-major matrix R[rows][cols] with row stride ld is,
// read column-major, the matrix R^T of shape cols x rows with leading dimension ld. So
//   x[M][K] (ld ldx)  is column-major X^T : K x M, ld = ldx
//   W[N][K] (ld K)    is column-major W^T : K x N, ld = K
//   y[M][N] (ld ldy)  is column-major Y^T : N x M, ld = ldy
// and y = x W^T  <=>  Y^T = W X^T  = op(A) op(B) with
//   A = the stored W^T (K x N, ld K), op(A) = A^T = W (N x K)   -> TRANSA = T
//   B = the stored X^T (K x M, ld ldx), op(B) = B  (K x M)       -> TRANSB = N
//   C = D = the stored Y^T (N x M, ld ldy);  m = N, n = M, k = K.
#include "kernels/cuda/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"

namespace hypic::kernels::cuda {

namespace {

std::string shape_str(int M, int N, int K) {
  return "(M=" + std::to_string(M) + ", N=" + std::to_string(N) + ", K=" + std::to_string(K) + ")";
}

void check_lt(cublasStatus_t s, const std::string& what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(what + ": " + cublasLtGetStatusName(s) + " (" + cublasLtGetStatusString(s) + ")");
}

// Largest power of two (<= 256) dividing the address: the alignment cuBLASLt may assume.
int pointer_alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int al = 256;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

void destroy_plan(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                  cublasLtMatrixLayout_t c) {
  if (c) cublasLtMatrixLayoutDestroy(c);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (op) cublasLtMatmulDescDestroy(op);
}

}  // namespace

GemmRunner::GemmRunner(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  check_lt(cublasLtCreate(&lt_), "GemmRunner: cublasLtCreate");
  if (workspace_bytes_) {
    const cudaError_t e = cudaMalloc(&workspace_, workspace_bytes_);
    if (e != cudaSuccess) {
      cublasLtDestroy(lt_);
      check_cuda(e, "GemmRunner: cudaMalloc(workspace of " + std::to_string(workspace_bytes_) + " bytes)");
    }
  }
}

GemmRunner::~GemmRunner() {
  for (auto& kv : plans_) destroy_plan(kv.second.op, kv.second.a, kv.second.b, kv.second.c);
  if (workspace_) cudaFree(workspace_);
  if (lt_) cublasLtDestroy(lt_);
}

const GemmRunner::Plan& GemmRunner::plan_for(const Key& key) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  const auto [M, N, K, ldx, ldy, ytype, al_x, al_w, al_y, batch, sx, sw, sy] = key;
  const std::string what = std::string(std::get<9>(key) > 1 ? "GemmRunner::linear_batched " : "GemmRunner::linear ") +
                           shape_str(M, N, K);
  Plan p;
  cublasLtMatmulPreference_t pref = nullptr;
  try {
    check_lt(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), what + ": cublasLtMatmulDescCreate");
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    check_lt(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), what + ": TRANSA");
    check_lt(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), what + ": TRANSB");
    // See the comment at the top of the file: A = W^T stored (K x N, ld K), B = x^T (K x M, ld ldx),
    // C = D = y^T (N x M, ld ldy).
    check_lt(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, uint64_t(K), uint64_t(N), int64_t(K)), what + ": layout A");
    check_lt(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, uint64_t(K), uint64_t(M), int64_t(ldx)), what + ": layout B");
    check_lt(cublasLtMatrixLayoutCreate(&p.c, cudaDataType_t(ytype), uint64_t(N), uint64_t(M), int64_t(ldy)),
             what + ": layout C");
    if (batch > 1) {
      const int32_t bc = batch;
      const int64_t strides[3] = {sw, sx, sy};
      cublasLtMatrixLayout_t lays[3] = {p.a, p.b, p.c};
      for (int i = 0; i < 3; ++i) {
        check_lt(cublasLtMatrixLayoutSetAttribute(lays[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof(bc)),
                 what + ": batch count");
        check_lt(cublasLtMatrixLayoutSetAttribute(lays[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i],
                                                  sizeof(strides[i])),
                 what + ": batch stride");
      }
    }
    check_lt(cublasLtMatmulPreferenceCreate(&pref), what + ": cublasLtMatmulPreferenceCreate");
    const uint64_t ws = workspace_bytes_;
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
             what + ": workspace preference");
    const uint32_t aa = uint32_t(al_w), ab = uint32_t(al_x), ac = uint32_t(al_y);
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof(aa)),
             what + ": alignment A");
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof(ab)),
             what + ": alignment B");
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof(ac)),
             what + ": alignment C");
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof(ac)),
             what + ": alignment D");
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    check_lt(cublasLtMatmulAlgoGetHeuristic(lt_, p.op, p.a, p.b, p.c, p.c, pref, 1, &res, &found),
             what + ": cublasLtMatmulAlgoGetHeuristic");
    if (found < 1) check_lt(CUBLAS_STATUS_NOT_SUPPORTED, what + ": no cuBLASLt algorithm for this shape");
    p.algo = res.algo;
    cublasLtMatmulPreferenceDestroy(pref);
  } catch (...) {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    destroy_plan(p.op, p.a, p.b, p.c);
    throw;
  }
  return plans_.emplace(key, p).first->second;
}

void GemmRunner::linear(int M, int N, int K, const bf16* x, long ldx, const bf16* W, void* y, cudaDataType_t y_type,
                        long ldy, float beta, cudaStream_t stream, float alpha) {
  linear_batched(1, M, N, K, x, ldx, 0, W, 0, y, y_type, ldy, 0, beta, stream, alpha);
}

void GemmRunner::linear_batched(int batch, int M, int N, int K, const bf16* x, long ldx, long stride_x,
                                const bf16* W, long stride_w, void* y, cudaDataType_t y_type, long ldy, long stride_y,
                                float beta, cudaStream_t stream, float alpha) {
  const char* name = batch == 1 ? "GemmRunner::linear " : "GemmRunner::linear_batched ";  // messages built on failure only
  auto bad = [&](const std::string& why) {
    throw std::invalid_argument(std::string(name) + shape_str(M, N, K) + ": " + why);
  };
  if (batch < 1) bad("batch < 1");
  if (M < 0) bad("M < 0");
  if (N <= 0) bad("N <= 0");
  if (K <= 0) bad("K <= 0");
  if (ldx < K) bad("ldx = " + std::to_string(ldx) + " < K");
  if (ldy < N) bad("ldy = " + std::to_string(ldy) + " < N");
  if (ldx > INT_MAX || ldy > INT_MAX) bad("leading dimension beyond the int range");
  if (stride_x < 0 || stride_w < 0 || stride_y < 0) bad("negative batch stride");
  if (y_type != CUDA_R_16BF && y_type != CUDA_R_32F) bad("y_type must be CUDA_R_16BF or CUDA_R_32F");
  if (M == 0) return;
  if (!x || !W || !y) bad("null pointer");
  const bool b1 = batch == 1;
  // Every batch member's alignment: the base's, lowered by the stride's (bytes).
  const size_t ysz = y_type == CUDA_R_32F ? 4 : 2;
  auto align = [&](const void* base, long stride, size_t elem) {
    int al = pointer_alignment(base);
    if (!b1 && stride) al = std::min(al, pointer_alignment(reinterpret_cast<const void*>(uintptr_t(stride) * elem)));
    return al;
  };
  const Key key{M, N, K, ldx, ldy, int(y_type), align(x, stride_x, 2), align(W, stride_w, 2), align(y, stride_y, ysz),
                batch, b1 ? 0 : stride_x, b1 ? 0 : stride_w, b1 ? 0 : stride_y};
  const Plan& p = plan_for(key);
  const cublasStatus_t st = cublasLtMatmul(lt_, p.op, &alpha, W, p.a, x, p.b, &beta, y, p.c, y, p.c, &p.algo,
                                           workspace_, workspace_bytes_, stream);
  if (st != CUBLAS_STATUS_SUCCESS) check_lt(st, std::string(name) + shape_str(M, N, K) + ": cublasLtMatmul");
}

namespace {

// Deterministic pseudo-random bf16 values in [-1, 1) (hash of the index).
__global__ void fill_pattern_kernel(bf16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(float(h & 0xFFFF) / 32768.0f - 1.0f);
  }
}

}  // namespace

double measure_bf16_tflops(int n, cudaStream_t stream) {
  if (n <= 0 || n > 46340) throw std::invalid_argument("measure_bf16_tflops: n = " + std::to_string(n));
  const size_t nn = size_t(n) * n;
  bf16 *a = nullptr, *b = nullptr, *c = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  auto cleanup = [&] {
    if (a) cudaFree(a);
    if (b) cudaFree(b);
    if (c) cudaFree(c);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
  };
  try {
    check_cuda(cudaMalloc(&a, nn * sizeof(bf16)), "measure_bf16_tflops: cudaMalloc");
    check_cuda(cudaMalloc(&b, nn * sizeof(bf16)), "measure_bf16_tflops: cudaMalloc");
    check_cuda(cudaMalloc(&c, nn * sizeof(bf16)), "measure_bf16_tflops: cudaMalloc");
    fill_pattern_kernel<<<1024, 256, 0, stream>>>(a, nn, 1u);
    fill_pattern_kernel<<<1024, 256, 0, stream>>>(b, nn, 7u);
    check_cuda(cudaGetLastError(), "measure_bf16_tflops: fill");
    check_cuda(cudaEventCreate(&e0), "cudaEventCreate");
    check_cuda(cudaEventCreate(&e1), "cudaEventCreate");
    GemmRunner g;
    for (int i = 0; i < 3; ++i) g.linear(n, n, n, a, n, b, c, CUDA_R_16BF, n, 0.f, stream);
    check_cuda(cudaEventRecord(e0, stream), "cudaEventRecord");
    g.linear(n, n, n, a, n, b, c, CUDA_R_16BF, n, 0.f, stream);
    check_cuda(cudaEventRecord(e1, stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float one_ms = 0;
    check_cuda(cudaEventElapsedTime(&one_ms, e0, e1), "cudaEventElapsedTime");
    const int iters = std::max(10, std::min(10000, int(200.0f / std::max(one_ms, 1e-3f))));
    check_cuda(cudaEventRecord(e0, stream), "cudaEventRecord");
    for (int i = 0; i < iters; ++i) g.linear(n, n, n, a, n, b, c, CUDA_R_16BF, n, 0.f, stream);
    check_cuda(cudaEventRecord(e1, stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    cleanup();
    return 2.0 * double(n) * n * n * iters / (double(ms) * 1e-3) / 1e12;
  } catch (...) {
    cleanup();
    throw;
  }
}

}  // namespace hypic::kernels::cuda
