// Segment-cumulative transition operators T_C for every linear-attention family, and composition.
//
// Every linear-attention layer follows S_t = T_t S_{t-1} + u_t (DESIGN.md 3.1; HYPIC paper section 2.2,
// Table 1). Over a segment C the tokens fold into one affine map S -> T_C S + S(C|0), with
//   T_C = T_{t_n} ... T_{t_1}  and  S(C|0) the segment's end state from a zero start.
// Composition law (paper Eq. 4/6): S(C1 C2 | P) = T_{C2} (T_{C1} P + S(C1|0)) + S(C2|0).
//
// Conventions (shared with kernels/cpu/gated_delta.h): one head's state S is d_k x d_v row-major
// ([d_k][d_v]) and transitions left-multiply it. A layer holds H heads: state [H][d_k][d_v].
// T_C storage per family (paper section 3.1, Table 3):
//   Scalar   (RetNet, Lightning / Ring-linear, Mamba2): gamma per head          -> data [H]
//   Diagonal (GLA):                                     diag(g) per head        -> data [H][d_k]
//   Dense    (DeltaNet, Gated DeltaNet, KDA):           d_k x d_k per head      -> data [H][d_k][d_k]
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hypic::engine {

/// How a transition operator is stored (one of the three families of DESIGN.md 3.1).
enum class TransitionKind : uint8_t { Scalar = 1, Diagonal = 2, Dense = 3 };

/// Name for messages ("scalar", "diagonal", "dense").
const char* transition_kind_name(TransitionKind kind);

/// T_C of one layer: `heads` independent d_k x d_k operators in the family's compact form, fp32.
/// Invariant: data.size() == heads * (1 | d_k | d_k*d_k) for (Scalar | Diagonal | Dense).
struct TransitionOperator {
  TransitionKind kind = TransitionKind::Dense;
  int heads = 0;
  int d_k = 0;
  std::vector<float> data;

  /// The identity operator (T_C of an empty segment).
  static TransitionOperator identity(TransitionKind kind, int heads, int d_k);
  /// Wraps dense [heads][d_k][d_k] row-major data (e.g. gated_delta_chunked's transition output).
  /// Throws std::invalid_argument when data.size() != heads*d_k*d_k.
  static TransitionOperator dense(int heads, int d_k, std::vector<float> data);
  /// Wraps data in `kind`'s layout ([heads], [heads][d_k] or [heads][d_k][d_k], as PrefillResult::transitions holds
  /// them by PrefillResult::transition_kind). Throws std::invalid_argument when data.size() != heads * per_head().
  static TransitionOperator wrap(TransitionKind kind, int heads, int d_k, std::vector<float> data);

  /// Elements per head for this kind (1, d_k or d_k*d_k).
  size_t per_head() const;

  /// state [heads][d_k][d_v] <- T state, in place. Cost O(H d_k d_v) for scalar/diagonal, O(H d_k^2 d_v) dense.
  /// Throws std::invalid_argument if state.size() != heads*d_k*d_v.
  void apply(std::span<float> state, int d_v) const;

  /// Returns later * this (apply this first, then `later`): T_{C1 C2} = T_{C2} T_{C1}.
  /// Operators of different kinds promote to the wider kind. Throws on mismatched heads/d_k.
  TransitionOperator then(const TransitionOperator& later) const;

  /// The operator as dense [heads][d_k][d_k] (for tests and mixed-kind composition).
  std::vector<float> to_dense() const;
};

/// Composition step S <- T S + S_seg for one layer (DESIGN.md 3.1 "composition").
/// state, seg_state: [heads][d_k][d_v]. Throws std::invalid_argument on size mismatch.
void compose_state(std::span<float> state, const TransitionOperator& transition, std::span<const float> seg_state,
                   int d_v);

/// Appends the operator's binary form (kind u8, heads u32, d_k u32, count u64, fp32 little-endian data) to out.
void serialize_transition(const TransitionOperator& t, std::string& out);
/// Reads one operator from bytes at *offset (advanced past it). Throws std::runtime_error naming the problem on
/// truncated data, unknown kind or inconsistent sizes.
TransitionOperator deserialize_transition(std::string_view bytes, size_t* offset);

}  // namespace hypic::engine
