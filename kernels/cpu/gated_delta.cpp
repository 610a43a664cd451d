// Gated delta rule on the CPU, fp32. Conventions and contracts: gated_delta.h.
//
// Chunked form (per value head h, chunk of L <= C tokens, G_i the in-chunk cumulative log decay,
// gamma = e^{G_L}; HF torch_chunk_gated_delta_rule, docs/research/hybrid_models.md 5.2 and 5.4):
//   A_ij  = b_i (k_i . k_j) e^{G_i - G_j}   (j < i), solve (I + A) [U | W] = [diag(b) V | diag(b e^G) K]
//   Vnew  = U - W S                         (the part of the writes the entering state does not predict)
//   o_i   = e^{G_i} q_i^T S + sum_{j<=i} e^{G_i - G_j} (q_i . k_j) Vnew_j
//   S'    = gamma S + K~^T Vnew,            K~_j = e^{G_L - G_j} k_j
//   T'    = (gamma I - K~^T W) T = gamma T - K~^T (W T)     (the chunk's transition applied to the running one)
// The last line is the same chunk map as S' with the write term dropped, so T_C comes out of the same pass,
// sharing A, the triangular solve and K~; it costs two extra L x d_k x d_k GEMMs per chunk and head.
// Values that would be subnormal (|x| < FLT_MIN: decays e^G, and S and T after each chunk) are set to 0
// (see flush_subnormals): a deviation below 1.2e-38 that keeps the GEMMs at full speed.
#include "kernels/cpu/gated_delta.h"

#include "kernels/cpu/ops.h"
#include "kernels/cpu/scan_util.h"

#include <cblas.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace hypic::kernels::cpu {
using namespace scan_detail;
namespace {

// Chunks whose cumulative log decay stays above this use e^{G_i} e^{-G_j} for the pairwise decays:
// e^{-G_j} <= e^{60} ~ 1e26 and e^{G_i} >= e^{-60} ~ 1e-26 keep both factors normal and finite.
constexpr float kFactoredDecayLimit = -60.0f;

void check_inputs(const char* fn, const GatedDeltaShape& s, const GatedDeltaInputs& in, const float* state) {
  const std::string name(fn);
  if (s.num_tokens < 0 || s.num_k_heads <= 0 || s.num_v_heads <= 0 || s.d_k <= 0 || s.d_v <= 0) {
    throw std::invalid_argument(name + ": bad shape T=" + std::to_string(s.num_tokens) +
                                " H_k=" + std::to_string(s.num_k_heads) + " H_v=" + std::to_string(s.num_v_heads) +
                                " d_k=" + std::to_string(s.d_k) + " d_v=" + std::to_string(s.d_v));
  }
  if (s.num_v_heads % s.num_k_heads != 0) {
    throw std::invalid_argument(name + ": num_v_heads " + std::to_string(s.num_v_heads) +
                                " is not a multiple of num_k_heads " + std::to_string(s.num_k_heads));
  }
  if (state == nullptr) throw std::invalid_argument(name + ": state is null");
  if (s.num_tokens > 0 && (!in.q || !in.k || !in.v || !in.g || !in.beta)) {
    throw std::invalid_argument(name + ": an input pointer (q, k, v, g or beta) is null");
  }
}

}  // namespace

void gated_delta_chunked(const GatedDeltaShape& shape, const GatedDeltaInputs& in, float* state, float* out,
                         float* transition, int chunk) {
  check_inputs("gated_delta_chunked", shape, in, state);
  if (chunk <= 0) throw std::invalid_argument("gated_delta_chunked: chunk " + std::to_string(chunk) + " <= 0");
  ScaledTransitions trans(transition, shape.num_v_heads, shape.d_k);
  const int T = shape.num_tokens;
  if (T == 0) return;
  const int Hk = shape.num_k_heads, Hv = shape.num_v_heads, dk = shape.d_k, dv = shape.d_v;
  const int ratio = Hv / Hk;
  const int C = std::min(chunk, T);
  const int ldx = dv + dk;  // row stride of X = [U | W]

  std::vector<float> Kc(static_cast<size_t>(C) * dk), Qc(Kc.size()), Kd(Kc.size()), Qd(Kc.size()), WT(Kc.size());
  std::vector<float> gram(static_cast<size_t>(C) * C), qk(gram.size()), A(gram.size()), P(gram.size());
  std::vector<float> X(static_cast<size_t>(C) * ldx), G(C), eG(C), eNegG(C), b(C);

  for (int kh = 0; kh < Hk; ++kh) {
    for (int c0 = 0; c0 < T; c0 += C) {
      const int L = std::min(C, T - c0);
      for (int i = 0; i < L; ++i) {
        const size_t src = (static_cast<size_t>(c0 + i) * Hk + kh) * dk;
        std::copy(in.k + src, in.k + src + dk, Kc.data() + static_cast<size_t>(i) * dk);
        std::copy(in.q + src, in.q + src + dk, Qc.data() + static_cast<size_t>(i) * dk);
      }
      // Key Gram matrix and query-key scores: shared by the `ratio` value heads of this key head.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, L, L, dk, 1.0f, Kc.data(), dk, Kc.data(), dk, 0.0f,
                  gram.data(), L);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, L, L, dk, 1.0f, Qc.data(), dk, Kc.data(), dk, 0.0f,
                  qk.data(), L);

      for (int r = 0; r < ratio; ++r) {
        const int h = kh * ratio + r;
        float* S = state + static_cast<size_t>(h) * dk * dv;
        float acc = 0.0f;
        for (int i = 0; i < L; ++i) {
          const size_t ti = static_cast<size_t>(c0 + i) * Hv + h;
          acc += in.g[ti];
          G[i] = acc;
          eG[i] = exp_normal(acc);
          b[i] = in.beta[ti];
        }
        const float gamma = eG[L - 1];

        // A (strictly lower; the unit diagonal is implied by the solve) and the decayed scores P (lower).
        // e^{G_i - G_j} as e^{G_i} e^{-G_j} (2L exponentials instead of L^2/2) while e^{-G_j} <= e^{-G_L}
        // stays far from overflow; otherwise one exponential per pair.
        const bool factored = G[L - 1] > kFactoredDecayLimit;
        if (factored)
          for (int j = 0; j < L; ++j) eNegG[j] = std::exp(-G[j]);
        for (int i = 0; i < L; ++i) {
          for (int j = 0; j <= i; ++j) {
            const float d = factored ? eG[i] * eNegG[j] : exp_normal(G[i] - G[j]);
            A[static_cast<size_t>(i) * L + j] = b[i] * gram[static_cast<size_t>(i) * L + j] * d;
            P[static_cast<size_t>(i) * L + j] = qk[static_cast<size_t>(i) * L + j] * d;
          }
          for (int j = i + 1; j < L; ++j) P[static_cast<size_t>(i) * L + j] = 0.0f;
        }
        // X = [b v | b e^G k], then X <- (I + A)^{-1} X = [U | W].
        for (int i = 0; i < L; ++i) {
          const float* vi = in.v + (static_cast<size_t>(c0 + i) * Hv + h) * dv;
          float* xi = X.data() + static_cast<size_t>(i) * ldx;
          for (int e = 0; e < dv; ++e) xi[e] = b[i] * vi[e];
          const float s = b[i] * eG[i];
          const float* ki = Kc.data() + static_cast<size_t>(i) * dk;
          for (int e = 0; e < dk; ++e) xi[dv + e] = s * ki[e];
        }
        cblas_strsm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasUnit, L, ldx, 1.0f, A.data(), L,
                    X.data(), ldx);
        float* U = X.data();
        const float* W = X.data() + dv;
        // Vnew = U - W S (in place in U).
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, L, dv, dk, -1.0f, W, ldx, S, dv, 1.0f, U, ldx);

        if (out) {
          for (int i = 0; i < L; ++i) {
            const float* qi = Qc.data() + static_cast<size_t>(i) * dk;
            float* qd = Qd.data() + static_cast<size_t>(i) * dk;
            for (int e = 0; e < dk; ++e) qd[e] = qi[e] * eG[i];
          }
          float* O = out + (static_cast<size_t>(c0) * Hv + h) * dv;
          const int ldo = Hv * dv;
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, L, dv, dk, 1.0f, Qd.data(), dk, S, dv, 0.0f, O,
                      ldo);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, L, dv, L, 1.0f, P.data(), L, U, ldx, 1.0f, O, ldo);
        }

        // K~ rows e^{G_L - G_j} k_j.
        for (int i = 0; i < L; ++i) {
          const float s = exp_normal(G[L - 1] - G[i]);
          const float* ki = Kc.data() + static_cast<size_t>(i) * dk;
          float* kd = Kd.data() + static_cast<size_t>(i) * dk;
          for (int e = 0; e < dk; ++e) kd[e] = s * ki[e];
        }
        if (trans.active() && !trans.is_zero(h)) {
          float* Tm = trans.head(h);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, L, dk, dk, 1.0f, W, ldx, Tm, dk, 0.0f, WT.data(),
                      dk);
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, dk, dk, L, -1.0f, Kd.data(), dk, WT.data(), dk, gamma,
                      Tm, dk);
          trans.renormalize(h);
        }
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, dk, dv, L, 1.0f, Kd.data(), dk, U, ldx, gamma, S, dv);
        flush_subnormals(S, static_cast<size_t>(dk) * dv);
      }
    }
  }
  trans.finish();
}

void gated_delta_recurrent(const GatedDeltaShape& shape, const GatedDeltaInputs& in, float* state, float* out,
                           float* transition) {
  check_inputs("gated_delta_recurrent", shape, in, state);
  ScaledTransitions trans(transition, shape.num_v_heads, shape.d_k);
  const int T = shape.num_tokens;
  const int Hk = shape.num_k_heads, Hv = shape.num_v_heads, dk = shape.d_k, dv = shape.d_v;
  const int ratio = Hv / Hk;
  std::vector<float> delta(dv), kT(dk);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < Hv; ++h) {
      const size_t th = static_cast<size_t>(t) * Hv + h;
      const float* q = in.q + (static_cast<size_t>(t) * Hk + h / ratio) * dk;
      const float* k = in.k + (static_cast<size_t>(t) * Hk + h / ratio) * dk;
      const float* v = in.v + th * dv;
      const float decay = exp_normal(in.g[th]);
      const float b = in.beta[th];
      float* S = state + static_cast<size_t>(h) * dk * dv;
      // S <- e^g S; delta = b (v - S^T k); S <- S + k delta^T; o = S^T q.
      for (size_t i = 0; i < static_cast<size_t>(dk) * dv; ++i) S[i] *= decay;
      for (int e = 0; e < dv; ++e) delta[e] = 0.0f;
      for (int i = 0; i < dk; ++i) {
        const float* Si = S + static_cast<size_t>(i) * dv;
        for (int e = 0; e < dv; ++e) delta[e] += Si[e] * k[i];
      }
      for (int e = 0; e < dv; ++e) delta[e] = (v[e] - delta[e]) * b;
      for (int i = 0; i < dk; ++i) {
        float* Si = S + static_cast<size_t>(i) * dv;
        for (int e = 0; e < dv; ++e) Si[e] += k[i] * delta[e];
      }
      if (out) {
        float* o = out + th * dv;
        for (int e = 0; e < dv; ++e) o[e] = 0.0f;
        for (int i = 0; i < dk; ++i) {
          const float* Si = S + static_cast<size_t>(i) * dv;
          for (int e = 0; e < dv; ++e) o[e] += Si[e] * q[i];
        }
      }
      if (trans.active() && !trans.is_zero(h)) {
        // T <- e^g (I - b k k^T) T = e^g (T - b k (k^T T)).
        float* Tm = trans.head(h);
        for (int e = 0; e < dk; ++e) kT[e] = 0.0f;
        for (int i = 0; i < dk; ++i) {
          const float* Ti = Tm + static_cast<size_t>(i) * dk;
          for (int e = 0; e < dk; ++e) kT[e] += k[i] * Ti[e];
        }
        for (int i = 0; i < dk; ++i) {
          float* Ti = Tm + static_cast<size_t>(i) * dk;
          const float s = b * k[i];
          for (int e = 0; e < dk; ++e) Ti[e] = decay * (Ti[e] - s * kT[e]);
        }
        trans.renormalize(h);
      }
    }
  }
  trans.finish();
}

void causal_conv1d_silu(int num_tokens, int channels, int kernel, const float* x, const float* weight,
                        float* conv_state, float* y) {
  if (num_tokens < 0 || channels <= 0 || kernel <= 0) {
    throw std::invalid_argument("causal_conv1d_silu: bad shape T=" + std::to_string(num_tokens) +
                                " channels=" + std::to_string(channels) + " kernel=" + std::to_string(kernel));
  }
  if (num_tokens > 0 && (x == nullptr || y == nullptr || weight == nullptr)) {
    throw std::invalid_argument("causal_conv1d_silu: x, weight or y is null");
  }
  if (kernel > 1 && conv_state == nullptr) throw std::invalid_argument("causal_conv1d_silu: conv_state is null");
  if (num_tokens > 0 && static_cast<const void*>(x) == static_cast<const void*>(y)) {
    throw std::invalid_argument("causal_conv1d_silu: y must not alias x");
  }
  const int T = num_tokens, Cn = channels, K = kernel, P = kernel - 1;
  // Row r of the extended input (conv_state ++ x), r in [0, P + T).
  auto row = [&](int r) -> const float* {
    return r < P ? conv_state + static_cast<size_t>(r) * Cn : x + static_cast<size_t>(r - P) * Cn;
  };
  std::vector<float> wt(static_cast<size_t>(K) * Cn);  // weight transposed to [K][C] for contiguous rows
  for (int c = 0; c < Cn; ++c)
    for (int j = 0; j < K; ++j) wt[static_cast<size_t>(j) * Cn + c] = weight[static_cast<size_t>(c) * K + j];
  for (int t = 0; t < T; ++t) {
    float* yt = y + static_cast<size_t>(t) * Cn;
    std::fill(yt, yt + Cn, 0.0f);
    for (int j = 0; j < K; ++j) {
      const float* xr = row(t + j);
      const float* wj = wt.data() + static_cast<size_t>(j) * Cn;
      for (int c = 0; c < Cn; ++c) yt[c] += wj[c] * xr[c];
    }
    for (int c = 0; c < Cn; ++c) yt[c] = silu(yt[c]);
  }
  // New conv tail: the last P rows of the extended input. Rows move forward only, so copy in order.
  if (P > 0 && T > 0) {
    for (int i = 0; i < P; ++i) {
      const float* src = row(T + i);
      if (src != conv_state + static_cast<size_t>(i) * Cn)
        std::copy(src, src + Cn, conv_state + static_cast<size_t>(i) * Cn);
    }
  }
}

}  // namespace hypic::kernels::cpu
