#include "kernels/cpu/ops.h"

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

namespace hypic::kernels::cpu {
namespace {

int blas_int(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX) {
    throw std::invalid_argument(std::string("linear: ") + what + " = " + std::to_string(v) +
                                " is outside [0, INT_MAX]");
  }
  return static_cast<int>(v);
}

// Sum of squares of one row, accumulated in double so the result does not depend on the order.
double sum_squares(const float* x, int64_t dim) {
  double acc = 0.0;
  for (int64_t i = 0; i < dim; ++i) acc += static_cast<double>(x[i]) * x[i];
  return acc;
}
float mean_square(const float* x, int64_t dim) {
  return static_cast<float>(sum_squares(x, dim) / static_cast<double>(dim));
}

// Rotates one head's first 2*half dims by the angles whose cos/sin are given (NeoX rotate_half form).
inline void rotate_head(float* x, int half, const float* cs, const float* sn) {
  for (int i = 0; i < half; ++i) {
    const float a = x[i];
    const float b = x[i + half];
    x[i] = a * cs[i] - b * sn[i];
    x[i + half] = b * cs[i] + a * sn[i];
  }
}

void check_rope(int heads, int head_dim, const std::vector<float>& inv_freq) {
  if (heads < 0 || head_dim <= 0 || static_cast<int64_t>(inv_freq.size()) * 2 > head_dim) {
    throw std::invalid_argument("apply_rope: rotary dims 2*" + std::to_string(inv_freq.size()) +
                                " must fit head_dim " + std::to_string(head_dim) + " (heads " +
                                std::to_string(heads) + ")");
  }
}

// cos/sin of position * inv_freq[i], the product rounded to fp32 first (HF's fp32 rotary embedding).
void rope_angles(int64_t position, const std::vector<float>& inv_freq, float* cs, float* sn) {
  const float p = static_cast<float>(position);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float f = p * inv_freq[i];
    cs[i] = std::cos(f);
    sn[i] = std::sin(f);
  }
}

}  // namespace

void linear(int64_t rows, int64_t in_features, int64_t out_features, const float* x, const float* w, float* y,
            float beta) {
  const int m = blas_int(rows, "rows");
  const int k = blas_int(in_features, "in_features");
  const int n = blas_int(out_features, "out_features");
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < rows * out_features; ++i) y[i] = beta == 0.0f ? 0.0f : beta * y[i];
    return;
  }
  if (m == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, w, k, x, 1, beta, y, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x, k, w, k, beta, y, n);
  }
}

void rms_norm_zero_centred(int64_t rows, int64_t dim, const float* x, const float* w, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float inv = 1.0f / std::sqrt(mean_square(xr, dim) + eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = (xr[i] * inv) * (1.0f + w[i]);
  }
}

void rms_norm_gated(int64_t rows, int64_t dim, const float* x, const float* z, const float* w, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    const float* zr = z + r * dim;
    float* yr = y + r * dim;
    const float inv = 1.0f / std::sqrt(mean_square(xr, dim) + eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = (w[i] * (xr[i] * inv)) * silu(zr[i]);
  }
}

void rms_norm(int64_t rows, int64_t dim, const float* x, const float* w, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float inv = 1.0f / std::sqrt(mean_square(xr, dim) + eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

void rms_norm_grouped(int64_t rows, int64_t dim, int groups, const float* x, const float* w, float eps, float* y) {
  if (groups <= 0 || dim % groups != 0)
    throw std::invalid_argument("rms_norm_grouped: " + std::to_string(groups) + " groups do not divide dim " +
                                std::to_string(dim));
  const int64_t gs = dim / groups;
  for (int64_t r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) rms_norm(1, gs, x + r * dim + g * gs, w + g * gs, eps, y + r * dim + g * gs);
}

void rms_norm_gated_sigmoid(int64_t rows, int64_t dim, const float* x, const float* z, const float* w, float eps,
                            float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    const float* zr = z + r * dim;
    float* yr = y + r * dim;
    const float inv = 1.0f / std::sqrt(mean_square(xr, dim) + eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = (w[i] * (xr[i] * inv)) * sigmoid(zr[i]);
  }
}

void l2_normalize_rows(int64_t rows, int64_t dim, float* x, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * dim;
    const float inv = 1.0f / std::sqrt(static_cast<float>(sum_squares(xr, dim)) + eps);
    for (int64_t i = 0; i < dim; ++i) xr[i] *= inv;
  }
}

std::vector<float> rope_inv_freq(double theta, int rot_dim) {
  if (rot_dim <= 0 || rot_dim % 2 != 0 || !(theta > 0.0)) {
    throw std::invalid_argument("rope_inv_freq: rotary dim " + std::to_string(rot_dim) +
                                " must be positive and even, theta " + std::to_string(theta) + " positive");
  }
  std::vector<float> inv(rot_dim / 2);
  const float base = static_cast<float>(theta);
  for (int i = 0; i < rot_dim / 2; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(rot_dim);
    inv[i] = 1.0f / std::pow(base, e);
  }
  return inv;
}

void apply_rope(float* x, int64_t n_tokens, int heads, int head_dim, const std::vector<float>& inv_freq,
                int64_t first_position) {
  check_rope(heads, head_dim, inv_freq);
  const int half = static_cast<int>(inv_freq.size());
  std::vector<float> cs(half), sn(half);
  for (int64_t t = 0; t < n_tokens; ++t) {
    rope_angles(first_position + t, inv_freq, cs.data(), sn.data());
    for (int h = 0; h < heads; ++h) rotate_head(x + (t * heads + h) * head_dim, half, cs.data(), sn.data());
  }
}

void apply_rope_uniform(float* x, int64_t n_tokens, int heads, int head_dim, const std::vector<float>& inv_freq,
                        int64_t position) {
  check_rope(heads, head_dim, inv_freq);
  const int half = static_cast<int>(inv_freq.size());
  std::vector<float> cs(half), sn(half);
  rope_angles(position, inv_freq, cs.data(), sn.data());
  for (int64_t row = 0; row < n_tokens * heads; ++row) rotate_head(x + row * head_dim, half, cs.data(), sn.data());
}

void apply_rope_key_axis(float* state, int heads, int d_k, int d_v, const std::vector<float>& inv_freq,
                         int64_t position) {
  check_rope(heads, d_k, inv_freq);
  if (d_v <= 0) throw std::invalid_argument("apply_rope_key_axis: d_v " + std::to_string(d_v) + " must be positive");
  const int half = static_cast<int>(inv_freq.size());
  std::vector<float> cs(half), sn(half);
  rope_angles(position, inv_freq, cs.data(), sn.data());
  for (int h = 0; h < heads; ++h) {
    float* s = state + size_t(h) * d_k * d_v;
    for (int i = 0; i < half; ++i) {
      float* ra = s + size_t(i) * d_v;
      float* rb = s + size_t(i + half) * d_v;
      for (int j = 0; j < d_v; ++j) {
        const float a = ra[j], b = rb[j];
        ra[j] = a * cs[i] - b * sn[i];
        rb[j] = b * cs[i] + a * sn[i];
      }
    }
  }
}

void softmax_rows(int64_t rows, int64_t n, float* x, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * ld;
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, xr[i]);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      xr[i] = std::exp(xr[i] - m);
      sum += xr[i];
    }
    for (int64_t i = 0; i < n; ++i) xr[i] /= sum;
  }
}

}  // namespace hypic::kernels::cpu
