// Lightning attention on the CPU, fp32. Conventions and contracts: lightning.h.
#include "kernels/cpu/lightning.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/scan_util.h"

namespace hypic::kernels::cpu {
using namespace scan_detail;
namespace {

void check(const char* fn, const LightningShape& s, const float* q, const float* k, const float* v,
           const float* slope, const float* state) {
  if (s.num_tokens < 0 || s.num_heads <= 0 || s.d_k <= 0 || s.d_v <= 0)
    throw std::invalid_argument(std::string(fn) + ": bad shape T=" + std::to_string(s.num_tokens) +
                                " H=" + std::to_string(s.num_heads) + " d_k=" + std::to_string(s.d_k) +
                                " d_v=" + std::to_string(s.d_v));
  if (state == nullptr || slope == nullptr) throw std::invalid_argument(std::string(fn) + ": state or slope is null");
  if (s.num_tokens > 0 && (!q || !k || !v)) throw std::invalid_argument(std::string(fn) + ": q, k or v is null");
}

}  // namespace

void lightning_chunked(const LightningShape& shape, const float* q, const float* k, const float* v, const float* slope,
                       float* state, float* out, float* transition, int block) {
  check("lightning_chunked", shape, q, k, v, slope, state);
  if (block <= 0) throw std::invalid_argument("lightning_chunked: block " + std::to_string(block) + " <= 0");
  const int T = shape.num_tokens, Hh = shape.num_heads, dk = shape.d_k, dv = shape.d_v;
  if (transition) std::fill(transition, transition + Hh, 1.0f);
  if (T == 0) return;
  const int B = std::min(block, T);
  const int ld_k = Hh * dk, ld_v = Hh * dv;
  std::vector<float> scores(size_t(B) * B), Kd(size_t(B) * dk), Qd(size_t(B) * dk), decay(size_t(B) + 1);
  for (int h = 0; h < Hh; ++h) {
    const float s = slope[h];
    // decay[n] = e^{-s n}, the factor of a distance of n tokens (fp32 product s * n, as HF's buffers).
    for (int n = 0; n <= B; ++n) decay[size_t(n)] = exp_normal(-s * static_cast<float>(n));
    float* S = state + size_t(h) * dk * dv;
    for (int c0 = 0; c0 < T; c0 += B) {
      const int n = std::min(B, T - c0);
      const float* qb = q + size_t(c0) * ld_k + size_t(h) * dk;
      const float* kb = k + size_t(c0) * ld_k + size_t(h) * dk;
      const float* vb = v + size_t(c0) * ld_v + size_t(h) * dv;
      if (out) {
        float* ob = out + size_t(c0) * ld_v + size_t(h) * dv;
        // Intra-block: (Q K^T o D) V, D_ij = e^{-s (i - j)} for j <= i.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, dk, 1.0f, qb, ld_k, kb, ld_k, 0.0f, scores.data(),
                    n);
        for (int i = 0; i < n; ++i)
          for (int j = 0; j < n; ++j) scores[size_t(i) * n + j] = j <= i ? scores[size_t(i) * n + j] * decay[size_t(i - j)] : 0.0f;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, dv, n, 1.0f, scores.data(), n, vb, ld_v, 0.0f, ob,
                    ld_v);
        // Inter-block: (Q o e^{-s (i + 1)}) S.
        for (int i = 0; i < n; ++i)
          for (int d = 0; d < dk; ++d) Qd[size_t(i) * dk + d] = qb[size_t(i) * ld_k + d] * decay[size_t(i + 1)];
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, dv, dk, 1.0f, Qd.data(), dk, S, dv, 1.0f, ob, ld_v);
      }
      // S <- e^{-s n} S + (K o e^{-s (n - 1 - j)})^T V.
      for (int j = 0; j < n; ++j)
        for (int d = 0; d < dk; ++d) Kd[size_t(j) * dk + d] = kb[size_t(j) * ld_k + d] * decay[size_t(n - 1 - j)];
      const float block_decay = exp_normal(-s * static_cast<float>(n));
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, dk, dv, n, 1.0f, Kd.data(), dk, vb, ld_v, block_decay, S,
                  dv);
      flush_subnormals(S, size_t(dk) * dv);
      if (transition) {
        transition[h] *= block_decay;
        if (std::abs(transition[h]) < FLT_MIN) transition[h] = 0.0f;
      }
    }
  }
}

void lightning_recurrent(const LightningShape& shape, const float* q, const float* k, const float* v,
                         const float* slope, float* state, float* out, float* transition) {
  check("lightning_recurrent", shape, q, k, v, slope, state);
  const int T = shape.num_tokens, Hh = shape.num_heads, dk = shape.d_k, dv = shape.d_v;
  if (transition) std::fill(transition, transition + Hh, 1.0f);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < Hh; ++h) {
      const size_t th = size_t(t) * Hh + h;
      const float* qt = q + th * dk;
      const float* kt = k + th * dk;
      const float* vt = v + th * dv;
      const float a = exp_normal(-slope[h]);
      float* S = state + size_t(h) * dk * dv;
      for (int d = 0; d < dk; ++d)
        for (int e = 0; e < dv; ++e) S[size_t(d) * dv + e] = a * S[size_t(d) * dv + e] + kt[d] * vt[e];
      flush_subnormals(S, size_t(dk) * dv);
      if (out) {
        float* o = out + th * dv;
        std::fill(o, o + dv, 0.0f);
        for (int d = 0; d < dk; ++d)
          for (int e = 0; e < dv; ++e) o[e] += S[size_t(d) * dv + e] * qt[d];
      }
      if (transition) {
        transition[h] *= a;
        if (std::abs(transition[h]) < FLT_MIN) transition[h] = 0.0f;
      }
    }
  }
}

}  // namespace hypic::kernels::cpu
