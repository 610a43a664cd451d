// Kimi Delta Attention on the CPU, fp32. Conventions and contracts: kda.h.
#include "kernels/cpu/kda.h"

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

void check(const char* fn, const KdaShape& s, const KdaInputs& in, const float* state) {
  if (s.num_tokens < 0 || s.num_heads <= 0 || s.d_k <= 0 || s.d_v <= 0)
    throw std::invalid_argument(std::string(fn) + ": bad shape T=" + std::to_string(s.num_tokens) +
                                " H=" + std::to_string(s.num_heads) + " d_k=" + std::to_string(s.d_k) +
                                " d_v=" + std::to_string(s.d_v));
  if (state == nullptr) throw std::invalid_argument(std::string(fn) + ": state is null");
  if (s.num_tokens > 0 && (!in.q || !in.k || !in.v || !in.g || !in.beta))
    throw std::invalid_argument(std::string(fn) + ": an input pointer (q, k, v, g or beta) is null");
}

}  // namespace

void kda_chunked(const KdaShape& shape, const KdaInputs& in, float* state, float* out, float* transition,
                 int chunk) {
  check("kda_chunked", shape, in, state);
  if (chunk <= 0) throw std::invalid_argument("kda_chunked: chunk " + std::to_string(chunk) + " <= 0");
  const int T = shape.num_tokens, Hh = shape.num_heads, dk = shape.d_k, dv = shape.d_v;
  ScaledTransitions trans(transition, Hh, dk);
  if (T == 0) return;
  const int C = std::min(chunk, T);
  const int ldx = dv + dk;  // X = [U | W]
  std::vector<float> Kc(size_t(C) * dk), Qc(Kc.size()), Gc(Kc.size()), Qd(Kc.size()), Kd(Kc.size()), WT(Kc.size());
  std::vector<float> A(size_t(C) * C), P(A.size()), X(size_t(C) * ldx), b(C), gL(dk);

  for (int h = 0; h < Hh; ++h) {
    float* S = state + size_t(h) * dk * dv;
    for (int c0 = 0; c0 < T; c0 += C) {
      const int L = std::min(C, T - c0);
      for (int i = 0; i < L; ++i) {
        const size_t src = (size_t(c0 + i) * Hh + h) * dk;
        std::copy(in.k + src, in.k + src + dk, Kc.data() + size_t(i) * dk);
        std::copy(in.q + src, in.q + src + dk, Qc.data() + size_t(i) * dk);
        // Inclusive cumulative log decay per channel (transformers: g.cumsum over the chunk).
        float* Gi = Gc.data() + size_t(i) * dk;
        const float* gi = in.g + src;
        for (int d = 0; d < dk; ++d) Gi[d] = (i == 0 ? 0.0f : Gi[d - dk]) + gi[d];
        b[i] = in.beta[size_t(c0 + i) * Hh + h];
      }
      // A (strictly lower) and P (lower incl. diagonal) with the per-channel pairwise decays e^{G_i - G_j}.
      for (int i = 0; i < L; ++i) {
        const float* ki = Kc.data() + size_t(i) * dk;
        const float* qi = Qc.data() + size_t(i) * dk;
        const float* Gi = Gc.data() + size_t(i) * dk;
        for (int j = 0; j <= i; ++j) {
          const float* kj = Kc.data() + size_t(j) * dk;
          const float* Gj = Gc.data() + size_t(j) * dk;
          float a = 0.0f, p = 0.0f;
          for (int d = 0; d < dk; ++d) {
            const float kd = kj[d] * exp_normal(Gi[d] - Gj[d]);
            a += ki[d] * kd;
            p += qi[d] * kd;
          }
          A[size_t(i) * L + j] = j < i ? b[i] * a : 0.0f;
          P[size_t(i) * L + j] = p;
        }
        for (int j = i + 1; j < L; ++j) P[size_t(i) * L + j] = A[size_t(i) * L + j] = 0.0f;
      }
      // X = [b v | b (k o e^G)], then X <- (I + A)^{-1} X = [U | W].
      for (int i = 0; i < L; ++i) {
        const float* vi = in.v + (size_t(c0 + i) * Hh + h) * dv;
        const float* ki = Kc.data() + size_t(i) * dk;
        const float* Gi = Gc.data() + size_t(i) * dk;
        float* xi = X.data() + size_t(i) * ldx;
        for (int e = 0; e < dv; ++e) xi[e] = b[i] * vi[e];
        for (int d = 0; d < dk; ++d) xi[dv + d] = b[i] * (ki[d] * exp_normal(Gi[d]));
      }
      cblas_strsm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasUnit, L, ldx, 1.0f, A.data(), L, X.data(),
                  ldx);
      float* U = X.data();
      const float* W = X.data() + dv;
      // Vnew = U - W S (in place in U).
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, L, dv, dk, -1.0f, W, ldx, S, dv, 1.0f, U, ldx);
      if (out) {
        for (int i = 0; i < L; ++i) {
          const float* qi = Qc.data() + size_t(i) * dk;
          const float* Gi = Gc.data() + size_t(i) * dk;
          float* qd = Qd.data() + size_t(i) * dk;
          for (int d = 0; d < dk; ++d) qd[d] = qi[d] * exp_normal(Gi[d]);
        }
        float* O = out + (size_t(c0) * Hh + h) * dv;
        const int ldo = Hh * dv;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, L, dv, dk, 1.0f, Qd.data(), dk, S, dv, 0.0f, O, ldo);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, L, dv, L, 1.0f, P.data(), L, U, ldx, 1.0f, O, ldo);
      }
      // K~ rows k_j o e^{G_L - G_j}; the chunk decay diag(e^{G_L}).
      const float* GL = Gc.data() + size_t(L - 1) * dk;
      for (int d = 0; d < dk; ++d) gL[d] = exp_normal(GL[d]);
      for (int i = 0; i < L; ++i) {
        const float* ki = Kc.data() + size_t(i) * dk;
        const float* Gi = Gc.data() + size_t(i) * dk;
        float* kd = Kd.data() + size_t(i) * dk;
        for (int d = 0; d < dk; ++d) kd[d] = ki[d] * exp_normal(GL[d] - Gi[d]);
      }
      if (trans.active() && !trans.is_zero(h)) {
        // T <- diag(e^{G_L}) T - K~^T (W T).
        float* Tm = trans.head(h);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, L, dk, dk, 1.0f, W, ldx, Tm, dk, 0.0f, WT.data(), dk);
        for (int r = 0; r < dk; ++r)
          for (int e = 0; e < dk; ++e) Tm[size_t(r) * dk + e] *= gL[r];
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, dk, dk, L, -1.0f, Kd.data(), dk, WT.data(), dk, 1.0f, Tm,
                    dk);
        trans.renormalize(h);
      }
      // S <- diag(e^{G_L}) S + K~^T Vnew.
      for (int r = 0; r < dk; ++r)
        for (int e = 0; e < dv; ++e) S[size_t(r) * dv + e] *= gL[r];
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, dk, dv, L, 1.0f, Kd.data(), dk, U, ldx, 1.0f, S, dv);
      flush_subnormals(S, size_t(dk) * dv);
    }
  }
  trans.finish();
}

void kda_recurrent(const KdaShape& shape, const KdaInputs& in, float* state, float* out, float* transition) {
  check("kda_recurrent", shape, in, state);
  const int T = shape.num_tokens, Hh = shape.num_heads, dk = shape.d_k, dv = shape.d_v;
  ScaledTransitions trans(transition, Hh, dk);
  std::vector<float> delta(dv), kT(dk), a(dk);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < Hh; ++h) {
      const size_t th = size_t(t) * Hh + h;
      const float* q = in.q + th * dk;
      const float* k = in.k + th * dk;
      const float* v = in.v + th * dv;
      const float* g = in.g + th * dk;
      const float bt = in.beta[th];
      for (int d = 0; d < dk; ++d) a[d] = exp_normal(g[d]);
      float* S = state + size_t(h) * dk * dv;
      // S <- diag(a) S; delta = b (v - S^T k); S <- S + k delta^T; o = S^T q.
      for (int d = 0; d < dk; ++d)
        for (int e = 0; e < dv; ++e) S[size_t(d) * dv + e] *= a[d];
      std::fill(delta.begin(), delta.end(), 0.0f);
      for (int d = 0; d < dk; ++d)
        for (int e = 0; e < dv; ++e) delta[e] += S[size_t(d) * dv + e] * k[d];
      for (int e = 0; e < dv; ++e) delta[e] = (v[e] - delta[e]) * bt;
      for (int d = 0; d < dk; ++d)
        for (int e = 0; e < dv; ++e) S[size_t(d) * dv + e] += k[d] * delta[e];
      if (out) {
        float* o = out + th * dv;
        std::fill(o, o + dv, 0.0f);
        for (int d = 0; d < dk; ++d)
          for (int e = 0; e < dv; ++e) o[e] += S[size_t(d) * dv + e] * q[d];
      }
      if (trans.active() && !trans.is_zero(h)) {
        // T <- (I - b k k^T) diag(a) T.
        float* Tm = trans.head(h);
        for (int d = 0; d < dk; ++d)
          for (int e = 0; e < dk; ++e) Tm[size_t(d) * dk + e] *= a[d];
        std::fill(kT.begin(), kT.end(), 0.0f);
        for (int d = 0; d < dk; ++d)
          for (int e = 0; e < dk; ++e) kT[e] += k[d] * Tm[size_t(d) * dk + e];
        for (int d = 0; d < dk; ++d) {
          const float s = bt * k[d];
          for (int e = 0; e < dk; ++e) Tm[size_t(d) * dk + e] -= s * kT[e];
        }
        trans.renormalize(h);
      }
    }
  }
  trans.finish();
}

}  // namespace hypic::kernels::cpu
