#include "engine/families/linear_families.h"

#include <stdexcept>
#include <string>

namespace hypic::engine {
namespace {

bool uses_beta(LinearFamily f) {
  return f == LinearFamily::DeltaRule || f == LinearFamily::GatedDelta || f == LinearFamily::KDA;
}

void check_span(LinearFamily family, const FamilySpan& s) {
  auto need = [&](std::span<const float> x, size_t want, const char* name) {
    if (x.size() != want) {
      throw std::invalid_argument(std::string(linear_family_name(family)) + " span: " + name + " has " +
                                  std::to_string(x.size()) + " floats, expected " + std::to_string(want));
    }
  };
  if (s.num_tokens < 0 || s.heads <= 0 || s.d_k <= 0 || s.d_v <= 0)
    throw std::invalid_argument("family span: num_tokens must be >= 0 and heads, d_k, d_v positive");
  const size_t th = static_cast<size_t>(s.num_tokens) * s.heads;
  need(s.k, th * s.d_k, "k");
  need(s.v, th * s.d_v, "v");
  switch (family) {
    case LinearFamily::ScalarDecay:
    case LinearFamily::GatedDelta: need(s.decay, th, "decay"); break;
    case LinearFamily::Diagonal:
    case LinearFamily::KDA: need(s.decay, th * s.d_k, "decay"); break;
    case LinearFamily::DeltaRule: break;
  }
  if (uses_beta(family)) need(s.beta, th, "beta");
}

// One token for one head: S <- T_t S + u_t; optionally also T_acc <- T_t T_acc in compact form.
void step(LinearFamily family, const FamilySpan& s, int t, int h, float* S, float* T_acc, std::vector<float>& tmp) {
  const int dk = s.d_k, dv = s.d_v;
  const size_t th = static_cast<size_t>(t) * s.heads + h;
  const float* k = s.k.data() + th * dk;
  const float* v = s.v.data() + th * dv;
  if (family == LinearFamily::ScalarDecay || family == LinearFamily::Diagonal) {
    for (int i = 0; i < dk; ++i) {
      const float a = family == LinearFamily::ScalarDecay ? s.decay[th] : s.decay[th * dk + i];
      for (int j = 0; j < dv; ++j) S[i * dv + j] = a * S[i * dv + j] + k[i] * v[j];
    }
    if (T_acc) {
      if (family == LinearFamily::ScalarDecay) T_acc[0] *= s.decay[th];
      else for (int i = 0; i < dk; ++i) T_acc[i] *= s.decay[th * dk + i];
    }
    return;
  }
  // Delta family: T_t = P_t (I - b k k^T) Q_t with (P, Q) = (alpha, I) for gated delta, (I, diag a) for KDA.
  const float b = s.beta[th];
  const float alpha = family == LinearFamily::GatedDelta ? s.decay[th] : 1.0f;
  const float* diag = family == LinearFamily::KDA ? s.decay.data() + th * dk : nullptr;
  auto apply_T = [&](float* M, int cols) {  // M [dk][cols] <- T_t M
    if (diag)
      for (int i = 0; i < dk; ++i)
        for (int j = 0; j < cols; ++j) M[i * cols + j] *= diag[i];
    tmp.assign(cols, 0.0f);  // k^T M
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < cols; ++j) tmp[j] += k[i] * M[i * cols + j];
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < cols; ++j) M[i * cols + j] = alpha * (M[i * cols + j] - b * k[i] * tmp[j]);
  };
  apply_T(S, dv);
  for (int i = 0; i < dk; ++i)
    for (int j = 0; j < dv; ++j) S[i * dv + j] += b * k[i] * v[j];
  if (T_acc) apply_T(T_acc, dk);
}

}  // namespace

const char* linear_family_name(LinearFamily family) {
  switch (family) {
    case LinearFamily::ScalarDecay: return "scalar_decay";
    case LinearFamily::Diagonal: return "diagonal";
    case LinearFamily::DeltaRule: return "delta";
    case LinearFamily::GatedDelta: return "gated_delta";
    case LinearFamily::KDA: return "kda";
  }
  return "unknown";
}

TransitionKind transition_kind_of(LinearFamily family) {
  switch (family) {
    case LinearFamily::ScalarDecay: return TransitionKind::Scalar;
    case LinearFamily::Diagonal: return TransitionKind::Diagonal;
    default: return TransitionKind::Dense;
  }
}

void run_family_recurrence(LinearFamily family, const FamilySpan& span, std::span<float> state) {
  check_span(family, span);
  const size_t hs = static_cast<size_t>(span.d_k) * span.d_v;
  if (state.size() != hs * span.heads)
    throw std::invalid_argument("family recurrence: state has " + std::to_string(state.size()) +
                                " floats, expected " + std::to_string(hs * span.heads));
  std::vector<float> tmp;
  for (int t = 0; t < span.num_tokens; ++t)
    for (int h = 0; h < span.heads; ++h) step(family, span, t, h, state.data() + h * hs, nullptr, tmp);
}

SegmentSummary summarize_family_segment(LinearFamily family, const FamilySpan& span) {
  check_span(family, span);
  SegmentSummary out{TransitionOperator::identity(transition_kind_of(family), span.heads, span.d_k),
                     std::vector<float>(static_cast<size_t>(span.heads) * span.d_k * span.d_v, 0.0f)};
  const size_t hs = static_cast<size_t>(span.d_k) * span.d_v;
  const size_t ts = out.transition.per_head();
  std::vector<float> tmp;
  for (int t = 0; t < span.num_tokens; ++t)
    for (int h = 0; h < span.heads; ++h)
      step(family, span, t, h, out.state.data() + h * hs, out.transition.data.data() + h * ts, tmp);
  return out;
}

}  // namespace hypic::engine
