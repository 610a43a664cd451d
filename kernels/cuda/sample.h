// Sampling of decode rows on the device: the token engine/sampling.h Sampler::pick gives for a row of logits and a
// draw (temperature, top-k, top-p, the uniform u), without copying the row's V fp32 logits to the host (a batch of
// 64 rows at V = 248k is 63 MB per step, plus a host partial sort of each row).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace hypic::kernels::cuda {

/// Largest top_k that sample_rows takes (the candidates are sorted in one block's shared memory); rows with a larger
/// top_k, or none (top_k = 0: the whole vocabulary), stay on the host.
inline constexpr int kSampleMaxTopK = 1024;

/// One row's draw (engine Backend::SampleDraw): temperature >= 0 (0: the argmax), 1 <= top_k <= kSampleMaxTopK and
/// top_k < V, top_p in (0, 1], u in [0, 1) (the request's Sampler::next_uniform()).
struct SampleRowDraw {
  float temperature = 1.0f;
  int32_t top_k = 1;
  float top_p = 1.0f;
  double u = 0.0;
};

/// out[r] for r < n: the token Sampler::pick(x row, {temperature, top_k, top_p}, u) gives for row rows[r] of x
/// (fp32 [*][ldx], DEVICE; rows: DEVICE int32 [n], or nullptr for rows 0 .. n-1) and draws[r] (DEVICE [n]):
/// the top_k largest logits (ties: the lower id first, as Sampler::distribution's partial sort), their softmax of
/// logit / temperature in double (max-subtracted; the normaliser summed in that order), the top-p prefix
/// renormalised, then the first candidate whose cumulative probability exceeds u (or the last with a non-zero
/// probability). The same double operations in the same order as the host, except that exp is CUDA's (within 1 ulp
/// of glibc's): a token can differ only when u falls within a few ulp of a cumulative boundary.
/// A row with a NaN gets -1 - j (j the lowest index of a NaN); a row without a finite maximum (all -inf, or a +inf)
/// gets INT32_MIN (engine Backend::kNoFiniteLogitCode). One block of 1024 threads per row: radix selection of the
/// top_k-th largest key over 4 byte passes, an ordered gather of the ties, a bitonic sort of the candidates, the
/// double arithmetic by one thread. Throws std::invalid_argument for n < 0, V <= 0, ldx < V or null pointers
/// (the draws are the caller's to check: see above). Allocates nothing (capturable).
void sample_rows(int n, int V, const float* x, long ldx, const int32_t* rows, const SampleRowDraw* draws,
                 int32_t* out, cudaStream_t stream = nullptr);

}  // namespace hypic::kernels::cuda
