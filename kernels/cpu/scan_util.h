// Helpers shared by the CPU linear-attention scans (gated_delta.cpp, kda.cpp, lightning.cpp): subnormal-free
// exponentials and the power-of-two-scaled running transitions. Internal to kernels/cpu.
#pragma once
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace hypic::kernels::cpu::scan_detail {

constexpr float kMinNormalLog = -87.33654f;  // log(FLT_MIN)
inline void set_identity(float* t, int n) {
  std::fill(t, t + static_cast<size_t>(n) * n, 0.0f);
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i) * n + i] = 1.0f;
}

// e^x, with results below the smallest normal float returned as 0 rather than as a subnormal.
inline float exp_normal(float x) { return x < kMinNormalLog ? 0.0f : std::exp(x); }

// Sets entries smaller in magnitude than the smallest normal float to 0 (x86 arithmetic on subnormals is
// ~100x slower; the change is below 1.2e-38).
inline void flush_subnormals(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] = std::abs(x[i]) < FLT_MIN ? 0.0f : x[i];
}

// The running span transitions of all heads, kept as T_h = 2^{e_h} M_h with max |M_h| near 1. A span
// transition decays like e^{sum g} and falls far below FLT_MIN over long spans (g = -0.05 over 2048 tokens
// gives e^-102); updating it in place drove the GEMMs into subnormals and made capturing T_C ten times
// slower than the state update. The update is linear in T, so it runs on M, and a power-of-two rescale
// (exact) keeps M normal; finish() writes T = 2^e M, flushing what would be subnormal to 0.
class ScaledTransitions {
 public:
  ScaledTransitions(float* data, int heads, int d_k)
      : data_(data), n_(static_cast<size_t>(d_k) * d_k), exponent_(heads, 0), zero_(heads, false) {
    if (!data_) return;
    for (int h = 0; h < heads; ++h) set_identity(head(h), d_k);
  }
  bool active() const { return data_ != nullptr; }
  float* head(int h) { return data_ + static_cast<size_t>(h) * n_; }
  /// True once head h's transition is exactly 0 (it stays 0: the update is linear); skip its work.
  bool is_zero(int h) const { return zero_[h]; }
  /// Call after each update of head(h): flushes subnormals and rescales M by a power of two when
  /// max |M| < 2^-16.
  void renormalize(int h) {
    float* m = head(h);
    flush_subnormals(m, n_);
    float mx = 0.0f;
    for (size_t i = 0; i < n_; ++i) mx = std::max(mx, std::abs(m[i]));
    if (mx == 0.0f) {
      zero_[h] = true;
      return;
    }
    if (mx >= kLow) return;
    int ex = 0;
    std::frexp(mx, &ex);  // mx = f 2^ex, f in [0.5, 1)
    for (size_t i = 0; i < n_; ++i) m[i] = std::ldexp(m[i], -ex);
    exponent_[h] += ex;
  }
  /// Writes the true transitions T = 2^e M into the buffer.
  void finish() {
    if (!data_) return;
    for (size_t h = 0; h < exponent_.size(); ++h) {
      if (exponent_[h] == 0) continue;
      float* m = head(static_cast<int>(h));
      const int e = static_cast<int>(std::max<int64_t>(exponent_[h], -1000));
      for (size_t i = 0; i < n_; ++i) m[i] = std::ldexp(m[i], e);
      flush_subnormals(m, n_);
    }
  }

 private:
  static constexpr float kLow = 1.0f / 65536.0f;
  float* data_;
  size_t n_;
  std::vector<int64_t> exponent_;
  std::vector<bool> zero_;
};

}  // namespace hypic::kernels::cpu::scan_detail
