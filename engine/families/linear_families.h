// Token-level recurrences of every linear-attention family, summarised per segment as (T_C, S(C|0)).
//
// This is the recurrence-level reference the families share (DESIGN.md 3.1 table; HYPIC paper Table 1):
//   family        T_t                          u_t             T_C stored as
//   ScalarDecay   gamma_t I                    k_t v_t^T       scalar per head  (RetNet, Lightning, Mamba2)
//   Diagonal      diag(a_t)                    k_t v_t^T       vector d_k       (GLA)
//   DeltaRule     I - b_t k_t k_t^T            b_t k_t v_t^T   dense d_k x d_k  (DeltaNet)
//   GatedDelta    alpha_t (I - b_t k_t k_t^T)  b_t k_t v_t^T   dense            (Gated DeltaNet: Qwen3-Next/3.5)
//   KDA           (I - b_t k_t k_t^T) diag(a_t) b_t k_t v_t^T  dense            (Kimi Delta Attention)
// States are [H][d_k][d_v] row-major and left-multiplied (see kernels/cpu/gated_delta.h).
// The model's Gated DeltaNet layers use the chunked kernel in kernels/cpu/gated_delta.h, which produces the
// same T_C in its chunked pass; this file lets scalar/diagonal/KDA models (Ring-linear, Kimi-Linear) plug in.
#pragma once
#include <span>
#include <vector>

#include "engine/transition.h"

namespace hypic::engine {

/// The linear-attention families of DESIGN.md 3.1.
enum class LinearFamily { ScalarDecay, Diagonal, DeltaRule, GatedDelta, KDA };

/// Family name for messages ("scalar_decay", "diagonal", "delta", "gated_delta", "kda").
const char* linear_family_name(LinearFamily family);

/// The storage kind of T_C for a family (Scalar, Diagonal or Dense).
TransitionKind transition_kind_of(LinearFamily family);

/// One span of per-token inputs for H heads, fp32, token-major:
///   k     [T][H][d_k]  keys (for the delta families: l2-normalised by the caller, as the models do)
///   v     [T][H][d_v]  values
///   decay ScalarDecay, GatedDelta: [T][H] multiplicative decay in (0, 1] (gamma_t, alpha_t = e^{g_t});
///         Diagonal, KDA: [T][H][d_k] per-channel multiplicative decay; DeltaRule: unused (may be empty)
///   beta  delta families: [T][H] write strength; others: unused (may be empty)
struct FamilySpan {
  int num_tokens = 0;
  int heads = 0;
  int d_k = 0;
  int d_v = 0;
  std::span<const float> k, v, decay, beta;
};

/// The per-segment summary: S(C|0) [H][d_k][d_v] and T_C.
struct SegmentSummary {
  TransitionOperator transition;
  std::vector<float> state;
};

/// Runs the literal recurrence S_t = T_t S_{t-1} + u_t over the span, starting from `state` ([H][d_k][d_v],
/// updated in place). Throws std::invalid_argument when an input's size does not match the shape.
void run_family_recurrence(LinearFamily family, const FamilySpan& span, std::span<float> state);

/// Summarises a span as (T_C, S(C|0)) token by token, accumulating T_C in the family's compact form
/// (T_C = T_{t_n} ... T_{t_1}). Cost O(T d_k^2) per head for dense families, O(T d_k) otherwise.
SegmentSummary summarize_family_segment(LinearFamily family, const FamilySpan& span);

}  // namespace hypic::engine
