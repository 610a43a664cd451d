// Tests of the CPU building blocks (kernels/cpu/ops.h, kernels/cpu/attention.h) against direct
// double-precision formulas written here.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/ops.h"

namespace cpu = hypic::kernels::cpu;

namespace {
std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
double max_rel(const std::vector<float>& a, const std::vector<double>& b) {
  double m = 0, s = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, std::abs(a[i] - b[i]));
    s = std::max(s, std::abs(b[i]));
  }
  return m / s;
}
}  // namespace

TEST_CASE("linear is x W^T for one and many rows", "[ops]") {
  const int rows = 5, in = 7, out = 3;
  const auto x = randn(rows * in, 1), w = randn(out * in, 2);
  for (int r : {1, rows}) {
    std::vector<float> y(r * out);
    cpu::linear(r, in, out, x.data(), w.data(), y.data());
    std::vector<double> ref(r * out, 0.0);
    for (int i = 0; i < r; ++i)
      for (int o = 0; o < out; ++o)
        for (int k = 0; k < in; ++k) ref[i * out + o] += double(x[i * in + k]) * w[o * in + k];
    CHECK(max_rel(y, ref) < 1e-6);
  }
  CHECK_THROWS_AS(cpu::linear(-1, in, out, x.data(), w.data(), nullptr), std::invalid_argument);
}

TEST_CASE("RMSNorm flavours and l2norm follow their formulas", "[ops]") {
  const int rows = 3, dim = 16;
  const auto x = randn(rows * dim, 3), w = randn(dim, 4, 0.3f), z = randn(rows * dim, 5);
  const float eps = 1e-6f;
  std::vector<float> y0(rows * dim), yg(rows * dim), l2 = x;
  cpu::rms_norm_zero_centred(rows, dim, x.data(), w.data(), eps, y0.data());
  cpu::rms_norm_gated(rows, dim, x.data(), z.data(), w.data(), eps, yg.data());
  cpu::l2_normalize_rows(rows, dim, l2.data(), eps);
  std::vector<double> r0(rows * dim), rg(rows * dim), rl(rows * dim);
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += double(x[r * dim + i]) * x[r * dim + i];
    const double inv_rms = 1.0 / std::sqrt(ss / dim + eps), inv_l2 = 1.0 / std::sqrt(ss + eps);
    for (int i = 0; i < dim; ++i) {
      const double xi = x[r * dim + i], zi = z[r * dim + i];
      r0[r * dim + i] = xi * inv_rms * (1.0 + w[i]);
      rg[r * dim + i] = xi * inv_rms * w[i] * (zi / (1.0 + std::exp(-zi)));
      rl[r * dim + i] = xi * inv_l2;
    }
  }
  CHECK(max_rel(y0, r0) < 1e-6);
  CHECK(max_rel(yg, rg) < 1e-6);
  CHECK(max_rel(l2, rl) < 1e-6);
}

TEST_CASE("activations match torch's definitions", "[ops]") {
  CHECK(cpu::softplus(25.0f) == 25.0f);  // threshold 20: identity above
  CHECK(cpu::softplus(1.0f) == Approx(std::log1p(std::exp(1.0))).epsilon(1e-6));
  CHECK(cpu::sigmoid(0.0f) == 0.5f);
  CHECK(cpu::silu(2.0f) == Approx(2.0 / (1.0 + std::exp(-2.0))).epsilon(1e-6));
}

TEST_CASE("partial NeoX RoPE rotates the first rotary dims and composes", "[ops][rope]") {
  const int heads = 2, hd = 8, rot = 4;
  const double theta = 10000.0;
  const auto inv = cpu::rope_inv_freq(theta, rot);
  REQUIRE(inv.size() == 2);
  CHECK(inv[1] == Approx(1.0 / std::pow(theta, 0.5)).epsilon(1e-6));
  const auto x = randn(3 * heads * hd, 6);
  std::vector<float> y = x;
  cpu::apply_rope(y.data(), 3, heads, hd, inv, 5);
  for (int t = 0; t < 3; ++t)
    for (int h = 0; h < heads; ++h) {
      const float* a = &x[(t * heads + h) * hd];
      const float* b = &y[(t * heads + h) * hd];
      for (int i = 0; i < 2; ++i) {
        const double ang = double(5 + t) * inv[i];
        CHECK(b[i] == Approx(a[i] * std::cos(ang) - a[i + 2] * std::sin(ang)).margin(1e-5));
        CHECK(b[i + 2] == Approx(a[i + 2] * std::cos(ang) + a[i] * std::sin(ang)).margin(1e-5));
      }
      for (int i = rot; i < hd; ++i) CHECK(b[i] == a[i]);  // pass-through dims
    }
  // R(d) R(p) = R(p + d): rotate at 5.., then by a uniform delta 9 == rotate at 14...
  std::vector<float> direct = x;
  cpu::apply_rope(direct.data(), 3, heads, hd, inv, 14);
  cpu::apply_rope_uniform(y.data(), 3, heads, hd, inv, 9);
  for (size_t i = 0; i < y.size(); ++i) CHECK(y[i] == Approx(direct[i]).margin(1e-5));
  CHECK_THROWS_AS(cpu::rope_inv_freq(theta, 3), std::invalid_argument);
  CHECK_THROWS_AS(cpu::apply_rope(y.data(), 1, 1, 2, inv, 0), std::invalid_argument);
}

TEST_CASE("causal GQA attention over a cache matches the direct softmax formula", "[attention]") {
  const int nh = 4, nkv = 2, hd = 8;
  for (int64_t past : {0, 5, 300}) {
    for (int64_t T : {1, 7, 130}) {  // 130 > the kernel's 128-query block
      const int64_t n = past + T;
      const auto q = randn(T * nh * hd, 10 + T), k = randn(n * nkv * hd, 20 + n), v = randn(n * nkv * hd, 30 + n);
      const float scale = 1.0f / std::sqrt(float(hd));
      std::vector<float> out(T * nh * hd);
      std::vector<float> mass(n, 1.0f), last(n, 0.0f);  // key_mass accumulates: starts at 1 here
      cpu::attention_causal({T, n, nh, nkv, hd}, q.data(), k.data(), v.data(), scale, out.data(), mass.data());
      cpu::attention_causal({T, n, nh, nkv, hd}, q.data(), k.data(), v.data(), scale, out.data(), last.data(), 1);
      std::vector<double> ref(out.size(), 0.0), ref_mass(n, 1.0), ref_last(n, 0.0);
      for (int64_t i = 0; i < T; ++i)
        for (int h = 0; h < nh; ++h) {
          const int kvh = h / (nh / nkv);
          const int64_t visible = past + i + 1;
          std::vector<double> s(visible);
          double m = -1e300, sum = 0;
          for (int64_t j = 0; j < visible; ++j) {
            double d = 0;
            for (int e = 0; e < hd; ++e) d += double(q[(i * nh + h) * hd + e]) * k[(j * nkv + kvh) * hd + e];
            s[j] = d * scale;
            m = std::max(m, s[j]);
          }
          for (auto& sj : s) sum += (sj = std::exp(sj - m));
          for (int64_t j = 0; j < visible; ++j) {
            for (int e = 0; e < hd; ++e) ref[(i * nh + h) * hd + e] += s[j] / sum * v[(j * nkv + kvh) * hd + e];
            ref_mass[j] += s[j] / sum;
            if (i == T - 1) ref_last[j] += s[j] / sum;
          }
        }
      INFO("past " << past << " T " << T);
      CHECK(max_rel(out, ref) < 1e-5);
      CHECK(max_rel(mass, ref_mass) < 1e-5);  // per key: 1 + the probability summed over queries and heads
      CHECK(max_rel(last, ref_last) < 1e-5);  // key_mass_queries = 1: the last query's alone
    }
  }
  std::vector<float> dummy(64);
  CHECK_THROWS_AS(cpu::attention_causal({4, 3, 2, 2, 4}, dummy.data(), dummy.data(), dummy.data(), 1.0f, dummy.data()),
                  std::invalid_argument);
}
