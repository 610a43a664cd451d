// GPU kernels of the non-Qwen hybrid families against their CPU references (kernels/cpu): lightning attention
// (MiniMax-Text-01, Ring-linear-2.0): chunked prefill with T_C, sequence-parallel parts, decode, the scalar
// composition and the key-axis rotation of cached states. Inputs are bf16-rounded on both sides; the CPU side runs
// fp32 token by token (kernels/cpu lightning_recurrent), an independent form of the recurrence.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <memory>
#include <tuple>
#include <vector>

#include "gpu_util.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/lightning.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/lightning.h"
#include "kernels/cuda/ops.h"
#include "engine/checkpoint/config.h"
#include "engine/checkpoint/weights.h"
#include "engine/cuda/kda_mixer.h"
#include "engine/cuda/lightning_mixer.h"
#include "engine/cuda/mla_mixer.h"
#include "engine/families/kimi_linear/layers.h"
#include "engine/families/minimax/layers.h"
#include "engine/families/ring_linear/layers.h"
#include "engine/families/shared/layers.h"
#include "kernels/cuda/moe.h"

namespace {

using namespace hypic::gputest;
namespace kc = hypic::kernels::cuda;
namespace cpu = hypic::kernels::cpu;
using bf16 = __nv_bfloat16;

// max |a - b| / max |b| over one block of n values (NaN anywhere: +inf).
double scaled_err(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num = std::max(num, std::abs(double(a[i]) - double(b[i])));
    den = std::max(den, std::abs(double(b[i])));
  }
  return den > 0 ? num / den : num;
}

// A random bf16 weight of `shape`, N(mean, sigma^2): t gets the exact fp32 values, the bf16 values are returned.
std::vector<bf16> random_weight(std::mt19937& rng, hypic::engine::Tensor& t, std::vector<int64_t> shape, float sigma,
                                float mean = 0.f) {
  int64_t n = 1;
  for (auto e : shape) n *= e;
  std::vector<float> f;
  auto b = random_bf16(rng, size_t(n), sigma, f);
  for (size_t i = 0; i < b.size(); ++i) b[i] = float_to_bf16(f[i] + mean), f[i] = bf16_to_float(b[i]);
  t.shape = std::move(shape), t.data = f;
  return b;
}

// The worst scaled_err over the (sequence, head) blocks of token-major outputs [T][H][D] (sequences by cu).
double worst_block_err(const std::vector<float>& got, const std::vector<float>& ref, const std::vector<int>& cu, int H,
                       int D) {
  double worst = 0;
  const size_t row = size_t(H) * D;
  for (size_t i = 0; i + 1 < cu.size(); ++i)
    for (int h = 0; h < H; ++h) {
      std::vector<float> go, ro;
      for (int t = cu[i]; t < cu[i + 1]; ++t)
        for (int e = 0; e < D; ++e) {
          go.push_back(got[size_t(t) * row + size_t(h) * D + e]);
          ro.push_back(ref[size_t(t) * row + size_t(h) * D + e]);
        }
      if (!go.empty()) worst = std::max(worst, scaled_err(go.data(), ro.data(), go.size()));
    }
  return worst;
}

struct LightningCase {
  int head_dim = 128;
  int heads = 3;
  std::vector<int> lens;
  bool initial = true;
  bool outputs = true;
  int seq_parts = 1;
  bool alias_states = false;  // final_state written over initial_state
};

// Per-head decay rates covering no decay, MiniMax-like slow decay and fast decay.
std::vector<float> test_slopes(int heads) {
  std::vector<float> s(heads);
  for (int h = 0; h < heads; ++h) s[h] = h == 0 ? 0.0f : std::pow(2.0f, -8.0f * float(h) / float(heads)) * (h % 2 ? 1.0f : 0.05f);
  return s;
}

struct LightningResult {
  double out_err = 0, state_err = 0, transition_err = 0;
  int parts = 0;
};

LightningResult run_lightning(const LightningCase& cs, uint32_t seed) {
  std::mt19937 rng(seed);
  const int H = cs.heads, D = cs.head_dim, S = static_cast<int>(cs.lens.size());
  std::vector<int> cu(S + 1, 0);
  for (int i = 0; i < S; ++i) cu[i + 1] = cu[i] + cs.lens[i];
  const int T = cu[S], max_len = S ? *std::max_element(cs.lens.begin(), cs.lens.end()) : 0;
  const size_t row = size_t(H) * D, hd = size_t(D) * D;
  std::vector<float> qf, kf, vf;
  auto q = random_bf16(rng, size_t(T) * row, 0.4f, qf);
  auto k = random_bf16(rng, size_t(T) * row, 0.4f, kf);
  auto v = random_bf16(rng, size_t(T) * row, 1.0f, vf);
  const std::vector<float> slope = test_slopes(H);
  std::vector<float> init(size_t(S) * H * hd, 0.0f);
  if (cs.initial) {
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& x : init) x = nd(rng);
  }
  // CPU reference, sequence by sequence.
  std::vector<float> ref_out(size_t(T) * row), ref_state = init, ref_tr(size_t(S) * H);
  for (int i = 0; i < S; ++i) {
    const cpu::LightningShape shape{cs.lens[i], H, D, D};
    const size_t o = size_t(cu[i]) * row;
    cpu::lightning_recurrent(shape, qf.data() + o, kf.data() + o, vf.data() + o, slope.data(),
                             ref_state.data() + size_t(i) * H * hd, ref_out.data() + o, ref_tr.data() + size_t(i) * H);
  }

  DeviceBuffer<bf16> dq(q), dk(k), dv(v);
  DeviceBuffer<float> dslope(slope), dinit(init), dfinal(init.size()), dtr(size_t(S) * H);
  DeviceBuffer<int> dcu(cu);
  DeviceBuffer<bf16> dout(size_t(T) * row);
  dout.poison();
  dfinal.poison();
  dtr.poison();
  kc::LightningPrefillArgs a;
  a.num_seqs = S;
  a.cu_seqlens = dcu.get();
  a.max_seqlen = max_len;
  a.num_heads = H;
  a.head_dim = D;
  a.q = dq.get(), a.k = dk.get(), a.v = dv.get(), a.slope = dslope.get();
  a.initial_state = cs.initial ? dinit.get() : nullptr;
  a.final_state = cs.alias_states ? dinit.get() : dfinal.get();
  a.transition = dtr.get();
  a.out = cs.outputs ? dout.get() : nullptr;
  a.seq_parts = cs.seq_parts;
  LightningResult res;
  res.parts = kc::lightning_scan_parts(a);
  const size_t ws_bytes = kc::lightning_prefill_workspace_bytes(a);
  DeviceBuffer<float> ws(ws_bytes / sizeof(float));
  ws.poison();
  a.workspace = ws.get();
  a.workspace_bytes = ws_bytes;
  kc::lightning_prefill(a);
  check_cuda(cudaDeviceSynchronize(), "lightning_prefill");
  const auto out = to_float(dout.download());
  const auto fin = (cs.alias_states ? dinit : dfinal).download();
  const auto tr = dtr.download();
  for (int i = 0; i < S; ++i)
    for (int h = 0; h < H; ++h) {
      const size_t so = (size_t(i) * H + h) * hd;
      res.state_err = std::max(res.state_err, scaled_err(fin.data() + so, ref_state.data() + so, hd));
      const double t_ref = ref_tr[size_t(i) * H + h], t = tr[size_t(i) * H + h];
      res.transition_err =
          std::max(res.transition_err, std::isfinite(t) ? std::abs(t - t_ref) / std::max(t_ref, 1e-30) : INFINITY);
    }
  if (cs.outputs) res.out_err = worst_block_err(out, ref_out, cu, H, D);
  return res;
}

void expect_close(const LightningCase& cs, uint32_t seed, int expect_parts = 0) {
  const LightningResult r = run_lightning(cs, seed);
  std::printf("[lightning d%d H%d parts %d] out %.3e state %.3e T_C %.3e\n", cs.head_dim, cs.heads, r.parts,
              r.out_err, r.state_err, r.transition_err);
  if (expect_parts > 0) CHECK(r.parts == expect_parts);
  CHECK(r.out_err < 2e-2);
  CHECK(r.state_err < 1e-2);
  CHECK(r.transition_err < 1e-4);
}

}  // namespace

TEST_CASE("lightning_prefill matches the CPU recurrence: ragged lengths, length 0 and 1, head sizes 64 and 128",
          "[gpu][families][lightning]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  const std::vector<int> lens{1, 63, 64, 0, 65, 200, 333};
  for (int d : {128, 64}) {
    DYNAMIC_SECTION("d " << d << ", random initial states") { expect_close({d, 3, lens, true, true, 1}, 7 + d, 1); }
    DYNAMIC_SECTION("d " << d << ", zero initial states") { expect_close({d, 2, lens, false, true, 1}, 8 + d, 1); }
    DYNAMIC_SECTION("d " << d << ", states only, final over initial") {
      expect_close({d, 3, lens, true, false, 1, true}, 9 + d, 1);
    }
  }
}

TEST_CASE("lightning_prefill sequence-parallel parts compose through the scalar T", "[gpu][families][lightning]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  SECTION("forced 4 parts, ragged batch, final over initial") {
    expect_close({128, 2, {1500, 70, 0, 1024}, true, true, 4, true}, 21, 4);
  }
  SECTION("forced 3 parts, states only, d 64") { expect_close({64, 3, {900, 1}, true, false, 3}, 22, 3); }
  SECTION("automatic: one long sequence with few heads is split") {
    const LightningCase cs{128, 2, {4000}, true, true, 0};
    const LightningResult r = run_lightning(cs, 23);
    std::printf("[lightning auto] parts %d out %.3e state %.3e\n", r.parts, r.out_err, r.state_err);
    CHECK(r.parts >= 2);
    CHECK(r.out_err < 2e-2);
    CHECK(r.state_err < 1e-2);
    CHECK(r.transition_err < 1e-4);
  }
  SECTION("automatic: many heads fill the GPU unsplit") {
    kc::LightningPrefillArgs a;
    a.num_seqs = 8, a.num_heads = 64, a.head_dim = 128, a.max_seqlen = 4096;
    CHECK(kc::lightning_scan_parts(a) == 1);
    CHECK(kc::lightning_prefill_workspace_bytes(a) == 0);
  }
}

TEST_CASE("lightning_prefill rejects what it does not support", "[gpu][families][lightning]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  DeviceBuffer<bf16> x(4096);
  DeviceBuffer<float> s(8);
  DeviceBuffer<int> cu(std::vector<int>{0, 8});
  kc::LightningPrefillArgs a;
  a.num_seqs = 1, a.cu_seqlens = cu.get(), a.max_seqlen = 8, a.num_heads = 2, a.head_dim = 96;
  a.q = a.k = a.v = x.get();
  a.slope = s.get();
  CHECK_THROWS_AS(kc::lightning_prefill(a), std::invalid_argument);  // head size 96
  a.head_dim = 128;
  a.q = x.get() + 1;
  CHECK_THROWS_AS(kc::lightning_prefill(a), std::invalid_argument);  // misaligned
  a.q = x.get();
  a.max_seqlen = 5000, a.seq_parts = 4;
  CHECK(kc::lightning_prefill_workspace_bytes(a) > 0);
  CHECK_THROWS_AS(kc::lightning_prefill(a), std::invalid_argument);  // no workspace
  CHECK_THROWS_AS(kc::lightning_decode(1, 2, 80, x.get(), x.get(), x.get(), s.get(), s.get(), nullptr),
                  std::invalid_argument);
  CHECK_THROWS_AS(kc::rope_key_axis(1, 128, 128, 65, s.get(), 3, s.get()), std::invalid_argument);
  CHECK_THROWS_AS(kc::scalar_compose_fold(1, 6, 1, s.get(), s.get(), nullptr), std::invalid_argument);
}

TEST_CASE("lightning_decode continues a prefill as the CPU recurrence does, with state slots",
          "[gpu][families][lightning]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  for (int D : {128, 64}) {
    DYNAMIC_SECTION("d " << D) {
      std::mt19937 rng(31 + D);
      const int B = 5, H = 3, steps = 3, slots = 8;
      const size_t row = size_t(H) * D, hd = size_t(D) * D;
      const std::vector<int> slot_of{6, 0, 3, 7, 2};
      const std::vector<float> slope = test_slopes(H);
      std::vector<float> pool(size_t(slots) * H * hd);
      std::normal_distribution<float> nd(0.f, 1.f);
      for (auto& x : pool) x = nd(rng);
      DeviceBuffer<float> dpool(pool), dslope(slope);
      DeviceBuffer<int> dslots(slot_of);
      double worst_o = 0, worst_s = 0;
      for (int step = 0; step < steps; ++step) {
        std::vector<float> qf, kf, vf;
        auto q = random_bf16(rng, B * row, 0.4f, qf);
        auto k = random_bf16(rng, B * row, 0.4f, kf);
        auto v = random_bf16(rng, B * row, 1.0f, vf);
        DeviceBuffer<bf16> dq(q), dk(k), dv(v), dout(B * row);
        dout.poison();
        kc::lightning_decode(B, H, D, dq.get(), dk.get(), dv.get(), dslope.get(), dpool.get(), dout.get(), nullptr,
                             dslots.get());
        check_cuda(cudaDeviceSynchronize(), "lightning_decode");
        const auto out = to_float(dout.download());
        std::vector<float> ref_out(row);
        for (int b = 0; b < B; ++b) {
          const cpu::LightningShape shape{1, H, D, D};
          cpu::lightning_recurrent(shape, qf.data() + b * row, kf.data() + b * row, vf.data() + b * row,
                                   slope.data(), pool.data() + size_t(slot_of[b]) * H * hd, ref_out.data(), nullptr);
          for (int h = 0; h < H; ++h)
            worst_o = std::max(worst_o, scaled_err(out.data() + b * row + h * D, ref_out.data() + h * D, D));
        }
      }
      const auto got = dpool.download();
      for (int sl = 0; sl < slots; ++sl)
        for (int h = 0; h < H; ++h) {
          const size_t o = (size_t(sl) * H + h) * hd;
          worst_s = std::max(worst_s, scaled_err(got.data() + o, pool.data() + o, hd));
        }
      std::printf("[lightning decode d%d] out %.3e state %.3e\n", D, worst_o, worst_s);
      CHECK(worst_o < 8e-3);  // bf16 outputs
      CHECK(worst_s < 1e-5);
    }
  }
}

TEST_CASE("lightning segment summaries compose: T_B S(A|0) + S(B|0) is the state of A then B",
          "[gpu][families][lightning][compose]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  std::mt19937 rng(51);
  const int H = 4, D = 128, la = 300, lb = 170;
  const size_t row = size_t(H) * D, hd = size_t(D) * D;
  std::vector<float> qf, kf, vf;
  auto q = random_bf16(rng, size_t(la + lb) * row, 0.4f, qf);
  auto k = random_bf16(rng, size_t(la + lb) * row, 0.4f, kf);
  auto v = random_bf16(rng, size_t(la + lb) * row, 1.0f, vf);
  const std::vector<float> slope = test_slopes(H);
  DeviceBuffer<bf16> dq(q), dk(k), dv(v);
  DeviceBuffer<float> dslope(slope);
  // Segments A and B as two sequences (each from zero), and A ++ B as one.
  DeviceBuffer<int> cu2(std::vector<int>{0, la, la + lb}), cu1(std::vector<int>{0, la + lb});
  DeviceBuffer<float> seg_state(2 * H * hd), seg_tr(2 * H), whole(H * hd), running(H * hd);
  kc::LightningPrefillArgs a;
  a.num_heads = H, a.head_dim = D, a.q = dq.get(), a.k = dk.get(), a.v = dv.get(), a.slope = dslope.get();
  a.seq_parts = 1;
  a.num_seqs = 2, a.cu_seqlens = cu2.get(), a.max_seqlen = la;
  a.final_state = seg_state.get(), a.transition = seg_tr.get();
  kc::lightning_prefill(a);
  a.num_seqs = 1, a.cu_seqlens = cu1.get(), a.max_seqlen = la + lb;
  a.final_state = whole.get(), a.transition = nullptr;
  kc::lightning_prefill(a);
  check_cuda(cudaMemset(running.get(), 0, running.size() * sizeof(float)), "memset");
  kc::scalar_compose_fold(H, int(hd), 2, running.get(), seg_tr.get(), seg_state.get());
  check_cuda(cudaDeviceSynchronize(), "compose");
  const auto got = running.download(), ref = whole.download();
  double worst = 0;
  for (int h = 0; h < H; ++h) worst = std::max(worst, scaled_err(got.data() + h * hd, ref.data() + h * hd, hd));
  std::printf("[lightning compose] composed vs whole: %.3e\n", worst);
  CHECK(worst < 1e-2);

  SECTION("scalar_compose_fold is the fp32 FMA left fold, bit for bit") {
    const int B = 6, dim = 64, segs = 5;
    std::vector<float> run0(B * dim), Ts(segs * B), Ss(size_t(segs) * B * dim);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_real_distribution<float> ud(0.f, 1.f);
    for (auto& x : run0) x = nd(rng);
    for (auto& x : Ts) x = ud(rng);
    for (auto& x : Ss) x = nd(rng);
    DeviceBuffer<float> dr(run0), dT(Ts), dS(Ss);
    kc::scalar_compose_fold(B, dim, segs, dr.get(), dT.get(), dS.get());
    const auto g = dr.download();
    std::vector<float> r = run0;
    for (int s = 0; s < segs; ++s)
      for (int b = 0; b < B; ++b)
        for (int i = 0; i < dim; ++i)
          r[b * dim + i] = std::fma(Ts[s * B + b], r[b * dim + i], Ss[(size_t(s) * B + b) * dim + i]);
    CHECK(g == r);
  }
}

TEST_CASE("rope_key_axis rotates cached states as rotating the keys does (Ring-linear's RoPE in the linear layer)",
          "[gpu][families][lightning][rope]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  std::mt19937 rng(61);
  const int H = 3, D = 128, L = 90, half = 32;  // partial rotary: 64 of 128 dims
  const int64_t delta = 1234;
  const auto inv_freq = cpu::rope_inv_freq(10000.0, 2 * half);
  std::vector<float> qf, kf, vf;
  random_bf16(rng, size_t(L) * H * D, 0.4f, qf);
  random_bf16(rng, size_t(L) * H * D, 0.4f, kf);
  random_bf16(rng, size_t(L) * H * D, 1.0f, vf);
  const std::vector<float> slope = test_slopes(H);
  const cpu::LightningShape shape{L, H, D, D};
  // S from keys at positions 0.., then the same keys rotated delta further.
  std::vector<float> s0(size_t(H) * D * D, 0.f), s1 = s0, k_rot = kf;
  cpu::lightning_recurrent(shape, qf.data(), kf.data(), vf.data(), slope.data(), s0.data(), nullptr, nullptr);
  cpu::apply_rope_uniform(k_rot.data(), L, H, D, inv_freq, delta);
  cpu::lightning_recurrent(shape, qf.data(), k_rot.data(), vf.data(), slope.data(), s1.data(), nullptr, nullptr);
  std::vector<float> cpu_rot = s0;
  cpu::apply_rope_key_axis(cpu_rot.data(), H, D, D, inv_freq, delta);
  DeviceBuffer<float> ds(s0), dinv(inv_freq);
  kc::rope_key_axis(H, D, D, half, dinv.get(), delta, ds.get());
  check_cuda(cudaDeviceSynchronize(), "rope_key_axis");
  const auto got = ds.download();
  double vs_cpu = 0, vs_keys = 0;
  for (int h = 0; h < H; ++h) {
    const size_t o = size_t(h) * D * D;
    vs_cpu = std::max(vs_cpu, scaled_err(got.data() + o, cpu_rot.data() + o, size_t(D) * D));
    vs_keys = std::max(vs_keys, scaled_err(got.data() + o, s1.data() + o, size_t(D) * D));
  }
  std::printf("[rope_key_axis] vs CPU rotation %.3e, vs state of rotated keys %.3e\n", vs_cpu, vs_keys);
  CHECK(vs_cpu < 1e-5);
  CHECK(vs_keys < 1e-4);
}

namespace {

struct QkvCase {
  int head_dim, heads, tokens;
  bool silu, norm;
  int rope_half;  // 0: no RoPE
  float scale;
};

// lightning_qkv_prepare against the CPU ops in the layer's order (silu, RMSNorm, RoPE, scale).
void check_qkv_prepare(const QkvCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int T = c.tokens, H = c.heads, D = c.head_dim;
  const int64_t first_pos = 777;
  const size_t hd = size_t(H) * D;
  std::vector<float> qkvf, qnf, knf;
  auto qkv = random_bf16(rng, size_t(T) * 3 * hd, 1.0f, qkvf);
  auto qn = random_bf16(rng, D, 0.3f, qnf);
  auto kn = random_bf16(rng, D, 0.3f, knf);
  for (auto& x : qnf) x += 1.0f;  // norm weights near 1, rounded like the device copy below
  for (auto& x : knf) x += 1.0f;
  for (int i = 0; i < D; ++i) qn[i] = float_to_bf16(qnf[i]), kn[i] = float_to_bf16(knf[i]);
  qnf = to_float(qn), knf = to_float(kn);
  const auto inv_freq = c.rope_half ? cpu::rope_inv_freq(10000.0, 2 * c.rope_half) : std::vector<float>{};
  // CPU reference.
  std::vector<float> part[3];
  for (int p = 0; p < 3; ++p) {
    part[p].resize(size_t(T) * hd);
    for (int t = 0; t < T; ++t)
      for (size_t i = 0; i < hd; ++i) {
        const float x = qkvf[(size_t(t) * 3 + p) * hd + i];
        part[p][size_t(t) * hd + i] = c.silu ? cpu::silu(x) : x;
      }
  }
  if (c.norm) {
    cpu::rms_norm(int64_t(T) * H, D, part[0].data(), qnf.data(), 1e-6f, part[0].data());
    cpu::rms_norm(int64_t(T) * H, D, part[1].data(), knf.data(), 1e-6f, part[1].data());
  }
  if (c.rope_half) {
    cpu::apply_rope(part[0].data(), T, H, D, inv_freq, first_pos);
    cpu::apply_rope(part[1].data(), T, H, D, inv_freq, first_pos);
  }
  for (auto& x : part[0]) x *= c.scale;

  std::vector<int> pos(T);
  for (int t = 0; t < T; ++t) pos[t] = int(first_pos) + t;
  DeviceBuffer<bf16> dqkv(qkv), dqn(qn), dkn(kn), dq(size_t(T) * hd), dk(size_t(T) * hd), dv(size_t(T) * hd);
  DeviceBuffer<float> dinv(inv_freq.empty() ? std::vector<float>{0.f} : inv_freq);
  DeviceBuffer<int> dpos(pos);
  dq.poison(), dk.poison(), dv.poison();
  kc::LightningQkvArgs a;
  a.tokens = T, a.num_heads = H, a.head_dim = D, a.qkv = dqkv.get(), a.silu = c.silu;
  a.q_norm = c.norm ? dqn.get() : nullptr, a.k_norm = c.norm ? dkn.get() : nullptr, a.eps = 1e-6f;
  a.inv_freq = c.rope_half ? dinv.get() : nullptr, a.rope_half = c.rope_half, a.positions = dpos.get();
  a.scale = c.scale, a.q = dq.get(), a.k = dk.get(), a.v = dv.get();
  kc::lightning_qkv_prepare(a);
  check_cuda(cudaDeviceSynchronize(), "lightning_qkv_prepare");
  const std::vector<float> got[3] = {to_float(dq.download()), to_float(dk.download()), to_float(dv.download())};
  for (int p = 0; p < 3; ++p) {
    double worst = 0;
    for (size_t r = 0; r < size_t(T) * H; ++r)
      worst = std::max(worst, scaled_err(got[p].data() + r * D, part[p].data() + r * D, D));
    std::printf("[lightning_qkv_prepare d%d silu %d norm %d rope %d] part %d: %.3e\n", D, c.silu, c.norm, c.rope_half,
                p, worst);
    CHECK(worst < 8e-3);  // one bf16 rounding
  }
}

}  // namespace

TEST_CASE("lightning_qkv_prepare: MiniMax's silu, Ring-linear's norm + partial RoPE + scale, against the CPU ops",
          "[gpu][families][lightning]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  SECTION("MiniMax: silu only") { check_qkv_prepare({128, 5, 37, true, false, 0, 1.0f}, 71); }
  SECTION("Ring-linear: norm, RoPE on half the dims, q scaled") {
    check_qkv_prepare({128, 3, 41, false, true, 32, 0.08838834764831845f}, 72);
  }
  SECTION("d 64, silu, norm, full RoPE") { check_qkv_prepare({64, 9, 3, true, true, 32, 0.125f}, 73); }
  SECTION("one token") { check_qkv_prepare({128, 16, 1, true, true, 16, 0.5f}, 74); }
  SECTION("RoPE asked for without inv_freq or positions is refused") {
    DeviceBuffer<bf16> buf(size_t(3) * 2 * 128);
    kc::LightningQkvArgs a;
    a.tokens = 1, a.num_heads = 2, a.head_dim = 128, a.qkv = buf.get(), a.q = a.k = a.v = buf.get();
    a.rope_half = 32;  // but no inv_freq
    CHECK_THROWS_AS(kc::lightning_qkv_prepare(a), std::invalid_argument);
    a.rope_half = 0;
    a.qkv = buf.get() + 1;  // misaligned
    CHECK_THROWS_AS(kc::lightning_qkv_prepare(a), std::invalid_argument);
  }
}

TEST_CASE("rms_norm_gated with a sigmoid gate: lightning's grouped output norm and KDA's per-head norm",
          "[gpu][families][ops]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  std::mt19937 rng(81);
  for (const auto& [T, dim, groups] : std::vector<std::tuple<int, int, int>>{{7, 1024, 4}, {3, 8192, 1}, {50, 128, 1}}) {
    DYNAMIC_SECTION("T " << T << " dim " << dim << " groups " << groups) {
      std::vector<float> xf, zf, wf;
      auto x = random_bf16(rng, size_t(T) * dim, 1.0f, xf);
      auto z = random_bf16(rng, size_t(T) * dim, 2.0f, zf);
      auto w = random_bf16(rng, dim, 1.0f, wf);
      // CPU: the grouped norm, then the sigmoid gate (engine/families/shared lightning_output).
      std::vector<float> ref(xf.size());
      cpu::rms_norm_grouped(T, dim, groups, xf.data(), wf.data(), 1e-5f, ref.data());
      for (size_t i = 0; i < ref.size(); ++i) ref[i] *= cpu::sigmoid(zf[i]);
      if (groups == 1 && dim == 128) {  // KDA's form (one row per token and head) through its own CPU op
        std::vector<float> kda(xf.size());
        cpu::rms_norm_gated_sigmoid(T, dim, xf.data(), zf.data(), wf.data(), 1e-5f, kda.data());
        CHECK(scaled_err(kda.data(), ref.data(), kda.size()) < 1e-6);
      }
      DeviceBuffer<bf16> dx(x), dz(z), dw(w);
      const int gs = dim / groups;
      kc::rms_norm_gated(T * groups, gs, dx.get(), dz.get(), dw.get(), 1e-5f, dx.get(), nullptr, kc::NormGate::Sigmoid,
                         groups);
      const auto got = to_float(dx.download());
      double worst = 0;
      for (int t = 0; t < T; ++t)
        worst = std::max(worst, scaled_err(got.data() + size_t(t) * dim, ref.data() + size_t(t) * dim, dim));
      std::printf("[rms_norm_gated sigmoid] T %d dim %d groups %d: %.3e\n", T, dim, groups, worst);
      CHECK(worst < 8e-3);
    }
  }
}

namespace {

struct SigmoidRouting {
  MoeCfg moe;
  int n_group, topk_group;
  float scaling;
  bool renorm, bias;
};

// Per token: whether the CPU's picks are near a tie (k-th vs (k+1)-th choice score, or the last kept group vs the
// next), where fp32 rounding of the router logits may legitimately pick differently.
std::vector<char> sigmoid_near_ties(const SigmoidRouting& r, const std::vector<float>& logits,
                                    const std::vector<float>& bias, int T) {
  const int E = r.moe.E, k = r.moe.topk, G = r.n_group, per = E / G;
  std::vector<char> tie(T, 0);
  for (int t = 0; t < T; ++t) {
    std::vector<float> ch(E);
    for (int e = 0; e < E; ++e) ch[e] = cpu::sigmoid(logits[size_t(t) * E + e]) + (bias.empty() ? 0.f : bias[e]);
    std::vector<float> gs(G);
    for (int g = 0; g < G; ++g) {
      std::vector<float> m(ch.begin() + g * per, ch.begin() + (g + 1) * per);
      std::sort(m.rbegin(), m.rend());
      gs[g] = per >= 2 ? m[0] + m[1] : m[0];
    }
    std::vector<float> sg = gs;
    std::sort(sg.rbegin(), sg.rend());
    if (r.topk_group < G && sg[r.topk_group - 1] - sg[r.topk_group] < 1e-4f) tie[t] = 1;
    std::vector<float> kept;
    for (int e = 0; e < E; ++e)
      if (gs[e / per] >= sg[r.topk_group - 1]) kept.push_back(ch[e]);
    std::sort(kept.rbegin(), kept.rend());
    if (int(kept.size()) > k && kept[k - 1] - kept[k] < 1e-4f) tie[t] = 1;
  }
  return tie;
}

}  // namespace

TEST_CASE("moe_forward with sigmoid grouped routing (Kimi-Linear, Ring-linear) matches the CPU model's router",
          "[gpu][families][moe]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  namespace fam = hypic::engine::families;
  Stream st;
  kc::GemmRunner gemm;
  const std::vector<SigmoidRouting> cases = {
      {{64, 6, 256, 64, 64, false}, 8, 3, 2.5f, true, true},    // grouped, biased, scaled, ungated shared expert
      {{32, 2, 128, 32, 0}, 1, 1, 1.0f, false, false},         // plain sigmoid top-2, no renormalisation
      {{256, 8, 512, 64, 64, false}, 8, 4, 2.5f, true, true},  // Ring-linear's routing shape (256 experts, 8 groups)
  };
  uint64_t seed = 900;
  for (const SigmoidRouting& rc : cases) {
    const MoeCfg& c = rc.moe;
    HostMoe m(c, seed++);
    Rng rng(seed++);
    std::vector<float> bias;
    if (rc.bias) bias = rand_f32(rng, c.E, 0.05f);
    DeviceBuffer<float> dbias(bias.empty() ? std::vector<float>{0.f} : bias);
    hypic::engine::ModelConfig cfg;
    cfg.hidden_size = c.H, cfg.num_experts = c.E, cfg.num_experts_per_tok = c.topk, cfg.n_group = rc.n_group;
    cfg.topk_group = rc.topk_group, cfg.routed_scaling_factor = rc.scaling, cfg.norm_topk_prob = rc.renorm;
    hypic::engine::MoeWeights w;
    w.router.shape = {c.E, c.H}, w.router.data = m.router;
    if (rc.bias) w.router_bias.shape = {c.E}, w.router_bias.data = bias;
    kc::MoeWeightsView v = m.view(rc.renorm);
    v.scoring = kc::MoeScoring::Sigmoid, v.n_group = rc.n_group, v.topk_group = rc.topk_group;
    v.routed_scaling = rc.scaling, v.expert_bias = rc.bias ? dbias.get() : nullptr;
    const int Tmax = 300;
    std::vector<float> xf;
    DeviceBuffer<bf16> dx(rand_bf16(rng, size_t(Tmax) * c.H, 1.0f, xf));
    kc::MoeWorkspace ws;
    for (int T : {1, 5, 64, 300}) {
      std::vector<std::vector<std::pair<int64_t, float>>> routed64(c.E);
      fam::shared::route_sigmoid(cfg, w, xf.data(), T, routed64);
      std::vector<std::vector<std::pair<int, float>>> routed(c.E);
      std::vector<std::vector<int>> sets(T);
      for (int e = 0; e < c.E; ++e)
        for (const auto& [t, wt] : routed64[e]) routed[e].emplace_back(int(t), wt), sets[t].push_back(e);
      const std::vector<float> ref = moe_experts_ref(m, routed, T, xf.data());
      std::vector<float> logits(size_t(T) * c.E);
      cpu::linear(T, c.H, c.E, xf.data(), m.router.data(), logits.data());
      const std::vector<char> ties = sigmoid_near_ties(rc, logits, bias, T);
      for (kc::GroupedGemm impl : {kc::GroupedGemm::Own, kc::GroupedGemm::OwnDecode, kc::GroupedGemm::OwnSmallM,
                                   kc::GroupedGemm::OwnLargeM}) {
        DeviceBuffer<float> dout(std::vector<float>(size_t(T) * c.H, 0.f));
        kc::moe_forward(T, dx.get(), v, dout.get(), ws, gemm, impl, st.s);
        check_cuda(cudaStreamSynchronize(st.s), "moe_forward");
        auto got = dout.download();
        std::vector<float> want = ref;
        for (int t = 0; t < T; ++t)  // near-tie tokens may take other experts: compared on the rest
          if (ties[t])
            for (int j = 0; j < c.H; ++j) got[size_t(t) * c.H + j] = want[size_t(t) * c.H + j] = 0.f;
        const Err e = compare(got.data(), want.data(), got.size());
        std::vector<int> ge(size_t(T) * c.topk);
        check_cuda(cudaMemcpy(ge.data(), ws.topk_e.p, ge.size() * sizeof(int), cudaMemcpyDeviceToHost), "topk");
        int mismatches = 0, skipped = 0;
        for (int t = 0; t < T; ++t) {
          if (ties[t]) {
            ++skipped;
            continue;
          }
          if (!std::equal(sets[t].begin(), sets[t].end(), ge.begin() + size_t(t) * c.topk)) ++mismatches;
        }
        std::printf("[moe sigmoid] E %d k %d groups %d/%d T %d impl %d: err %.3e fro %.3e, routing mismatches %d "
                    "(%d near-ties skipped)\n",
                    c.E, c.topk, rc.topk_group, rc.n_group, T, int(impl), e.max_rel, e.fro, mismatches, skipped);
        CHECK(mismatches == 0);
        CHECK(e.max_rel <= 2e-2);
        CHECK(e.fro <= 1e-2);
      }
    }
  }
  SECTION("a NaN router logit keeps every pick a valid expert (no out-of-bounds), other tokens unchanged") {
    HostMoe m({64, 6, 256, 64, 0}, 7);
    Rng r2(8);
    std::vector<float> xf;
    auto xb = rand_bf16(r2, size_t(40) * 256, 1.0f, xf);
    xb[3] = nan_bf16();  // token 0's logits are all NaN
    DeviceBuffer<bf16> dx(xb);
    for (kc::MoeScoring scoring : {kc::MoeScoring::Softmax, kc::MoeScoring::Sigmoid}) {
      for (kc::GroupedGemm impl : {kc::GroupedGemm::Own, kc::GroupedGemm::OwnSmallM}) {
        kc::MoeWeightsView v = m.view(true);
        v.scoring = scoring;
        kc::MoeWorkspace ws;
        DeviceBuffer<float> dout(std::vector<float>(size_t(40) * 256, 0.f));
        kc::moe_forward(40, dx.get(), v, dout.get(), ws, gemm, impl, st.s);
        check_cuda(cudaStreamSynchronize(st.s), "moe_forward with a NaN logit");
        std::vector<int> ge(size_t(40) * 6);
        check_cuda(cudaMemcpy(ge.data(), ws.topk_e.p, ge.size() * sizeof(int), cudaMemcpyDeviceToHost), "topk");
        bool valid = true;
        for (int t = 0; t < 40; ++t) {
          std::vector<int> picks(ge.begin() + t * 6, ge.begin() + (t + 1) * 6);
          std::sort(picks.begin(), picks.end());
          valid = valid && picks.front() >= 0 && picks.back() < 64 &&
                  std::adjacent_find(picks.begin(), picks.end()) == picks.end();
        }
        const auto out = dout.download();
        const bool rest_finite = std::all_of(out.begin() + 256, out.end(), [](float e) { return std::isfinite(e); });
        CHECK(valid);
        CHECK(rest_finite);
      }
    }
  }
  SECTION("bad routing fields are refused by name") {
    HostMoe m({64, 6, 256, 64, 0}, 5);
    kc::MoeWeightsView v = m.view(true);
    v.scoring = kc::MoeScoring::Sigmoid;
    v.n_group = 5;  // does not divide 64
    DeviceBuffer<bf16> dx(size_t(256));
    DeviceBuffer<float> dout(size_t(256));
    kc::MoeWorkspace ws;
    CHECK_THROWS_AS(kc::moe_forward(1, dx.get(), v, dout.get(), ws, gemm, kc::GroupedGemm::Own, st.s),
                    std::invalid_argument);
    v.n_group = 8, v.topk_group = 0;
    CHECK_THROWS_AS(kc::moe_forward(1, dx.get(), v, dout.get(), ws, gemm, kc::GroupedGemm::Own, st.s),
                    std::invalid_argument);
  }
}

// ---- Kimi Delta Attention ----------------------------------------------------------------------------------------

namespace {

struct KdaCase {
  int heads = 3;
  std::vector<int> lens;
  bool initial = true;
  bool outputs = true;
  bool transition = true;
  bool alias_states = false;
};

// Per-channel log decays: mostly slow, 3% strong (as random_log_decay, per channel).
std::vector<float> kda_log_decay(std::mt19937& rng, size_t n) { return random_log_decay(rng, n); }

// x *= 1 / sqrt(sum x^2 + 1e-6) per row of 128, then * scale (the kernels' in-kernel l2 norm).
void l2norm_rows(std::vector<float>& x, float scale) {
  for (size_t r = 0; r < x.size() / 128; ++r) {
    float s = 0.f;
    for (int d = 0; d < 128; ++d) s += x[r * 128 + d] * x[r * 128 + d];
    const float inv = 1.0f / std::sqrt(s + 1e-6f);
    for (int d = 0; d < 128; ++d) x[r * 128 + d] *= inv * scale;
  }
}

struct KdaErr {
  double out = 0, state = 0, transition = 0;
};

KdaErr run_kda(const KdaCase& cs, uint32_t seed) {
  std::mt19937 rng(seed);
  const int H = cs.heads, D = 128, S = static_cast<int>(cs.lens.size());
  std::vector<int> cu(S + 1, 0);
  for (int i = 0; i < S; ++i) cu[i + 1] = cu[i] + cs.lens[i];
  const int T = cu[S];
  const size_t row = size_t(H) * D, hd = size_t(D) * D;
  const float scale = 1.0f / std::sqrt(128.0f);
  std::vector<float> qf, kf, vf;
  auto q = random_bf16(rng, size_t(T) * row, 1.0f, qf);
  auto k = random_bf16(rng, size_t(T) * row, 1.0f, kf);
  auto v = random_bf16(rng, size_t(T) * row, 1.0f, vf);
  const std::vector<float> g = kda_log_decay(rng, size_t(T) * row), beta = random_beta(rng, size_t(T) * H);
  std::vector<float> init(size_t(S) * H * hd, 0.f);
  if (cs.initial) {
    std::normal_distribution<float> nd(0.f, 0.5f);
    for (auto& x : init) x = nd(rng);
  }
  std::vector<float> qn = qf, kn = kf;
  l2norm_rows(qn, scale);
  l2norm_rows(kn, 1.0f);
  std::vector<float> ref_out(size_t(T) * row), ref_state = init, ref_tr(size_t(S) * H * hd);
  for (int i = 0; i < S; ++i) {
    const size_t o = size_t(cu[i]) * row;
    const cpu::KdaInputs in{qn.data() + o, kn.data() + o, vf.data() + o, g.data() + o, beta.data() + size_t(cu[i]) * H};
    cpu::kda_recurrent({cs.lens[i], H, D, D}, in, ref_state.data() + size_t(i) * H * hd, ref_out.data() + o,
                       ref_tr.data() + size_t(i) * H * hd);
  }
  DeviceBuffer<bf16> dq(q), dk(k), dv(v), dout(size_t(T) * row);
  DeviceBuffer<float> dg(g), dbeta(beta), dinit(init), dfinal(init.size()), dtr(size_t(S) * H * hd);
  DeviceBuffer<int> dcu(cu);
  dout.poison(), dfinal.poison(), dtr.poison();
  kc::KdaPrefillArgs a;
  a.num_seqs = S, a.cu_seqlens = dcu.get(), a.total_tokens = T, a.num_heads = H;
  a.q = dq.get(), a.k = dk.get(), a.v = dv.get(), a.g = dg.get(), a.beta = dbeta.get();
  a.l2norm_qk = true, a.scale = scale;
  a.initial_state = cs.initial ? dinit.get() : nullptr;
  a.final_state = cs.alias_states ? dinit.get() : dfinal.get();
  a.transition = cs.transition ? dtr.get() : nullptr;
  a.out = cs.outputs ? dout.get() : nullptr;
  const size_t wsb = kc::kda_prefill_workspace_bytes(a);
  DeviceBuffer<unsigned char> ws(wsb);
  ws.poison();
  a.workspace = ws.get(), a.workspace_bytes = wsb;
  kc::kda_prefill(a);
  check_cuda(cudaDeviceSynchronize(), "kda_prefill");
  const auto out = to_float(dout.download());
  const auto fin = (cs.alias_states ? dinit : dfinal).download();
  const auto tr = dtr.download();
  KdaErr e;
  for (int i = 0; i < S; ++i)
    for (int h = 0; h < H; ++h) {
      const size_t so = (size_t(i) * H + h) * hd;
      e.state = std::max(e.state, scaled_err(fin.data() + so, ref_state.data() + so, hd));
      if (cs.transition) e.transition = std::max(e.transition, scaled_err(tr.data() + so, ref_tr.data() + so, hd));
    }
  if (cs.outputs) e.out = worst_block_err(out, ref_out, cu, H, D);
  return e;
}

void expect_kda(const KdaCase& cs, uint32_t seed) {
  const KdaErr e = run_kda(cs, seed);
  std::printf("[kda H%d seqs %zu init %d out %d T_C %d] out %.3e state %.3e T_C %.3e\n", cs.heads, cs.lens.size(),
              cs.initial, cs.outputs, cs.transition, e.out, e.state, e.transition);
  CHECK(e.out < 2e-2);
  CHECK(e.state < 2e-2);
  CHECK(e.transition < 2e-2);
}

}  // namespace

TEST_CASE("kda_prefill matches the CPU recurrence: ragged lengths, length 0 and 1, T_C in the same pass",
          "[gpu][families][kda]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  const std::vector<int> lens{1, 63, 64, 0, 65, 200, 333};
  SECTION("random initial states, outputs and T_C") { expect_kda({3, lens, true, true, true}, 101); }
  SECTION("zero initial states, outputs only") { expect_kda({2, lens, false, true, false}, 102); }
  SECTION("states and T_C only, final over initial") { expect_kda({3, lens, true, false, true, true}, 103); }
  SECTION("one long sequence") { expect_kda({2, {1500}, true, true, true}, 104); }
}

TEST_CASE("kda_prefill refuses bad arguments, and cu_seqlens that disagree with total_tokens give NaN states",
          "[gpu][families][kda]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  const int H = 2, T = 200;
  DeviceBuffer<bf16> x(size_t(T + 64) * H * 128);
  DeviceBuffer<float> g(size_t(T + 64) * H * 128), beta(size_t(T + 64) * H), fin(size_t(H) * 128 * 128);
  DeviceBuffer<int> cu(std::vector<int>{0, T + 64});  // one sequence longer than total_tokens says
  kc::KdaPrefillArgs a;
  a.num_seqs = 1, a.cu_seqlens = cu.get(), a.total_tokens = T, a.num_heads = H;
  a.q = a.k = a.v = x.get(), a.g = g.get(), a.beta = beta.get(), a.final_state = fin.get();
  CHECK_THROWS_AS(kc::kda_prefill(a), std::invalid_argument);  // no workspace
  DeviceBuffer<unsigned char> ws(kc::kda_prefill_workspace_bytes(a));
  a.workspace = ws.get(), a.workspace_bytes = ws.size();
  a.num_heads = 0;
  CHECK_THROWS_AS(kc::kda_prefill(a), std::invalid_argument);
  a.num_heads = H;
  a.q = x.get() + 1;
  a.out = reinterpret_cast<bf16*>(g.get());
  CHECK_THROWS_AS(kc::kda_prefill(a), std::invalid_argument);  // misaligned q
  a.q = x.get(), a.out = nullptr;
  fin.poison(0);
  kc::kda_prefill(a);
  check_cuda(cudaDeviceSynchronize(), "kda_prefill with inconsistent lengths");
  const auto f = fin.download();
  const bool all_nan = std::all_of(f.begin(), f.end(), [](float v) { return std::isnan(v); });
  CHECK(all_nan);

  SECTION("a decreasing table with buffers of exactly total_tokens rows") {
    const int Tx = 50;
    DeviceBuffer<bf16> xe(size_t(Tx) * H * 128), oute(size_t(Tx) * H * 128);
    DeviceBuffer<float> ge(size_t(Tx) * H * 128), be(size_t(Tx) * H), fe(size_t(2) * H * 128 * 128);
    DeviceBuffer<int> cue(std::vector<int>{0, 100, Tx});
    kc::KdaPrefillArgs b;
    b.num_seqs = 2, b.cu_seqlens = cue.get(), b.total_tokens = Tx, b.num_heads = H;
    b.q = b.k = b.v = xe.get(), b.g = ge.get(), b.beta = be.get(), b.final_state = fe.get(), b.out = oute.get();
    DeviceBuffer<unsigned char> wse(kc::kda_prefill_workspace_bytes(b));
    b.workspace = wse.get(), b.workspace_bytes = wse.size();
    fe.poison(0);
    kc::kda_prefill(b);
    check_cuda(cudaDeviceSynchronize(), "kda_prefill with a decreasing table");
    const auto fs = fe.download();
    CHECK(std::all_of(fs.begin(), fs.end(), [](float v) { return std::isnan(v); }));
  }
}

TEST_CASE("kda segment summaries compose through compose_fold: T_B S(A|0) + S(B|0) is the state of A then B",
          "[gpu][families][kda][compose]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  std::mt19937 rng(111);
  const int H = 2, D = 128, la = 300, lb = 130;
  const size_t row = size_t(H) * D, hd = size_t(D) * D;
  std::vector<float> qf, kf, vf;
  auto q = random_bf16(rng, size_t(la + lb) * row, 1.0f, qf);
  auto k = random_bf16(rng, size_t(la + lb) * row, 1.0f, kf);
  auto v = random_bf16(rng, size_t(la + lb) * row, 1.0f, vf);
  const auto g = kda_log_decay(rng, size_t(la + lb) * row);
  const auto beta = random_beta(rng, size_t(la + lb) * H);
  DeviceBuffer<bf16> dq(q), dk(k), dv(v);
  DeviceBuffer<float> dg(g), dbeta(beta), seg_state(2 * H * hd), seg_tr(2 * H * hd), whole(H * hd), running(H * hd);
  DeviceBuffer<int> cu2(std::vector<int>{0, la, la + lb}), cu1(std::vector<int>{0, la + lb});
  kc::KdaPrefillArgs a;
  a.num_heads = H, a.q = dq.get(), a.k = dk.get(), a.v = dv.get(), a.g = dg.get(), a.beta = dbeta.get();
  a.num_seqs = 2, a.cu_seqlens = cu2.get(), a.total_tokens = la + lb;
  a.final_state = seg_state.get(), a.transition = seg_tr.get();
  DeviceBuffer<unsigned char> ws(kc::kda_prefill_workspace_bytes(a));
  a.workspace = ws.get(), a.workspace_bytes = ws.size();
  kc::kda_prefill(a);
  a.num_seqs = 1, a.cu_seqlens = cu1.get(), a.final_state = whole.get(), a.transition = nullptr;
  kc::kda_prefill(a);
  check_cuda(cudaMemset(running.get(), 0, running.size() * sizeof(float)), "memset");
  kc::compose_fold(H, 2, running.get(), seg_tr.get(), seg_state.get());
  check_cuda(cudaDeviceSynchronize(), "compose");
  const auto got = running.download(), ref = whole.download();
  double worst = 0;
  for (int h = 0; h < H; ++h) worst = std::max(worst, scaled_err(got.data() + h * hd, ref.data() + h * hd, hd));
  std::printf("[kda compose] composed vs whole: %.3e\n", worst);
  CHECK(worst < 2e-2);
}

TEST_CASE("kda_decode matches the CPU recurrence with state slots, kda_gate matches KimiLinearForgetGate",
          "[gpu][families][kda]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  std::mt19937 rng(121);
  const int B = 5, H = 3, D = 128, slots = 7;
  const size_t row = size_t(H) * D, hd = size_t(D) * D;
  const float scale = 1.0f / std::sqrt(128.0f);
  const std::vector<int> slot_of{4, 0, 6, 2, 3};
  std::vector<float> pool(size_t(slots) * H * hd);
  std::normal_distribution<float> nd(0.f, 0.5f);
  for (auto& x : pool) x = nd(rng);
  DeviceBuffer<float> dpool(pool);
  DeviceBuffer<int> dslots(slot_of);
  double worst_o = 0;
  for (int step = 0; step < 3; ++step) {
    std::vector<float> qf, kf, vf;
    auto q = random_bf16(rng, B * row, 1.0f, qf);
    auto k = random_bf16(rng, B * row, 1.0f, kf);
    auto v = random_bf16(rng, B * row, 1.0f, vf);
    const auto g = kda_log_decay(rng, B * row);
    const auto beta = random_beta(rng, size_t(B) * H);
    DeviceBuffer<bf16> dq(q), dk(k), dv(v), dout(B * row);
    DeviceBuffer<float> dg(g), dbeta(beta);
    dout.poison();
    kc::kda_decode(B, H, dq.get(), dk.get(), dv.get(), dg.get(), dbeta.get(), true, scale, dpool.get(), dout.get(),
                   nullptr, dslots.get());
    check_cuda(cudaDeviceSynchronize(), "kda_decode");
    const auto out = to_float(dout.download());
    l2norm_rows(qf, scale);
    l2norm_rows(kf, 1.0f);
    std::vector<float> ref(row);
    for (int b = 0; b < B; ++b) {
      const cpu::KdaInputs in{qf.data() + b * row, kf.data() + b * row, vf.data() + b * row, g.data() + b * row,
                              beta.data() + size_t(b) * H};
      cpu::kda_recurrent({1, H, D, D}, in, pool.data() + size_t(slot_of[b]) * H * hd, ref.data(), nullptr);
      for (int h = 0; h < H; ++h)
        worst_o = std::max(worst_o, scaled_err(out.data() + b * row + h * D, ref.data() + h * D, D));
    }
  }
  const auto got = dpool.download();
  double worst_s = 0;
  for (int s = 0; s < slots * H; ++s)
    worst_s = std::max(worst_s, scaled_err(got.data() + size_t(s) * hd, pool.data() + size_t(s) * hd, hd));
  std::printf("[kda decode] out %.3e state %.3e\n", worst_o, worst_s);
  CHECK(worst_o < 8e-3);  // bf16 outputs
  CHECK(worst_s < 1e-4);

  SECTION("kda_gate") {
    const int T = 9;
    std::vector<float> xf;
    auto x = random_bf16(rng, size_t(T) * row, 8.0f, xf);  // wide: both softplus branches
    std::vector<float> A_log(H), dt(row);
    for (int h = 0; h < H; ++h) A_log[h] = std::log(1.0f + h);
    for (auto& e : dt) e = nd(rng);
    DeviceBuffer<bf16> dx(x);
    DeviceBuffer<float> dA(A_log), ddt(dt), dgo(size_t(T) * row);
    kc::kda_gate(T, H, dx.get(), dA.get(), ddt.get(), dgo.get());
    const auto got_g = dgo.download();
    double worst = 0;
    for (int t = 0; t < T; ++t)
      for (size_t i = 0; i < row; ++i) {
        const float y = xf[t * row + i] + dt[i];
        const float ref = -std::exp(A_log[i / D]) * (y > 20.f ? y : std::log(1.0f + std::exp(y)));
        worst = std::max(worst, double(std::abs(got_g[t * row + i] - ref)) / std::max(1e-6, double(std::abs(ref))));
      }
    std::printf("[kda_gate] worst relative error %.3e\n", worst);
    CHECK(worst < 1e-5);
  }
}

// ---- whole lightning layers (engine/cuda/lightning_mixer.h) against the CPU model's layers -------------------------

namespace {

// Random bf16 weights of one lightning layer: host fp32 copies (exact) and the device copies.
struct LightningLayerWeights {
  hypic::engine::LightningWeights host;
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> dev;
  DeviceBuffer<float> slope;
  hypic::engine::cuda::DevLightning view;
  LightningLayerWeights(const hypic::engine::ModelConfig& c, std::mt19937& rng)
      : slope(test_slopes(c.num_attention_heads)) {
    const int64_t Hd = c.hidden_size, hd = int64_t(c.num_attention_heads) * c.head_dim, d = c.head_dim;
    auto make = [&](hypic::engine::Tensor& t, std::vector<int64_t> shape, float sigma, float mean) {
      dev.push_back(std::make_unique<DeviceBuffer<bf16>>(random_weight(rng, t, std::move(shape), sigma, mean)));
      return dev.back()->get();
    };
    view.qkv_proj = make(host.qkv_proj, {3 * hd, Hd}, 1.0f / std::sqrt(float(Hd)), 0.f);
    view.gate = make(host.gate, {hd, Hd}, 1.0f / std::sqrt(float(Hd)), 0.f);
    view.norm = make(host.norm, {hd}, 0.1f, 1.0f);
    view.out_proj = make(host.out_proj, {Hd, hd}, 1.0f / std::sqrt(float(hd)), 0.f);
    view.q_norm = make(host.q_norm, {d}, 0.1f, 1.0f);
    view.k_norm = make(host.k_norm, {d}, 0.1f, 1.0f);
    host.slope.shape = {c.num_attention_heads}, host.slope.data = test_slopes(c.num_attention_heads);
    view.slope = slope.get();
  }
};

// Prefill of three sequences, then one decode step of each, GPU layer vs the CPU model's layer.
void check_lightning_layer(const hypic::engine::ModelConfig& c, uint32_t seed) {
  namespace ec = hypic::engine::cuda;
  namespace fam = hypic::engine::families;
  std::mt19937 rng(seed);
  const ec::LightningLayerConfig lc = ec::LightningLayerConfig::of(c);
  LightningLayerWeights w(c, rng);
  const int Hd = c.hidden_size, H = c.num_attention_heads, D = c.head_dim, hd = H * D;
  const std::vector<int> lens{1, 70, 200};
  const std::vector<int64_t> start{0, 5000, 123};  // RoPE positions of each sequence's first token
  std::vector<int> cu{0};
  for (int l : lens) cu.push_back(cu.back() + l);
  const int S = int(lens.size()), T = cu.back();
  std::vector<float> xf;
  auto x = random_bf16(rng, size_t(T) * Hd, 1.0f, xf);
  std::vector<int> pos(T);
  for (int i = 0; i < S; ++i)
    for (int t = 0; t < lens[i]; ++t) pos[cu[i] + t] = int(start[i]) + t;
  const auto inv_freq = c.linear_rope ? cpu::rope_inv_freq(c.rope_theta, c.rotary_dim()) : std::vector<float>{0.f};
  // CPU: each sequence from the zero state.
  std::vector<hypic::engine::LinearLayerState> st(S);
  std::vector<float> ref(size_t(T) * Hd);
  for (int i = 0; i < S; ++i) {
    st[i].ssm.assign(size_t(H) * D * D, 0.f);
    const float* xs = xf.data() + size_t(cu[i]) * Hd;
    float* ys = ref.data() + size_t(cu[i]) * Hd;
    if (c.family == hypic::engine::ModelFamily::MiniMax)
      fam::minimax::lightning_layer(c, w.host, st[i], xs, lens[i], false, nullptr, ys);
    else
      fam::ring_linear::lightning_layer(c, w.host, st[i], xs, lens[i], start[i], inv_freq, false, nullptr, ys);
  }
  // GPU.
  kc::GemmRunner gemm;
  DeviceBuffer<bf16> dx(x), qkv(size_t(T) * 3 * hd), q(size_t(T) * hd), k(size_t(T) * hd), v(size_t(T) * hd),
      o(size_t(T) * hd), gate(size_t(T) * hd);
  DeviceBuffer<int> dpos(pos), dcu(cu);
  DeviceBuffer<float> dinv(inv_freq), dy(std::vector<float>(size_t(T) * Hd, 0.f)), states(size_t(S) * H * D * D);
  kc::LightningPrefillArgs seqs;
  seqs.num_seqs = S, seqs.cu_seqlens = dcu.get(), seqs.max_seqlen = 200, seqs.num_heads = H, seqs.head_dim = D;
  seqs.final_state = states.get();
  const size_t wsb = kc::lightning_prefill_workspace_bytes(seqs);
  DeviceBuffer<unsigned char> ws(wsb);
  ec::LightningScratch sc{qkv.get(), q.get(), k.get(), v.get(), o.get(), gate.get(), ws.get(), wsb};
  ec::lightning_mixer_prefill(gemm, w.view, lc, T, dx.get(), dpos.get(), dinv.get(), seqs, sc, dy.get(), nullptr);
  check_cuda(cudaDeviceSynchronize(), "lightning_mixer_prefill");
  const auto y = dy.download(), fin = states.download();
  double ey = 0, es = 0;
  for (int i = 0; i < S; ++i) {
    ey = std::max(ey, scaled_err(y.data() + size_t(cu[i]) * Hd, ref.data() + size_t(cu[i]) * Hd, size_t(lens[i]) * Hd));
    for (int h = 0; h < H; ++h)
      es = std::max(es, scaled_err(fin.data() + (size_t(i) * H + h) * D * D, st[i].ssm.data() + size_t(h) * D * D,
                                   size_t(D) * D));
  }
  // One decode step of each sequence (states in slots 2, 0, 1 of a pool).
  const std::vector<int> slot_of{2, 0, 1};
  std::vector<float> pool(size_t(3) * H * D * D);
  for (int i = 0; i < S; ++i)
    std::copy(fin.begin() + size_t(i) * H * D * D, fin.begin() + size_t(i + 1) * H * D * D,
              pool.begin() + size_t(slot_of[i]) * H * D * D);
  std::vector<float> xdf;
  auto xd = random_bf16(rng, size_t(S) * Hd, 1.0f, xdf);
  std::vector<int> dpos_h(S);
  std::vector<float> ref_d(size_t(S) * Hd);
  for (int i = 0; i < S; ++i) {
    dpos_h[i] = int(start[i]) + lens[i];
    if (c.family == hypic::engine::ModelFamily::MiniMax)
      fam::minimax::lightning_layer(c, w.host, st[i], xdf.data() + size_t(i) * Hd, 1, true, nullptr,
                                    ref_d.data() + size_t(i) * Hd);
    else
      fam::ring_linear::lightning_layer(c, w.host, st[i], xdf.data() + size_t(i) * Hd, 1, dpos_h[i], inv_freq, true,
                                        nullptr, ref_d.data() + size_t(i) * Hd);
  }
  DeviceBuffer<bf16> dxd(xd);
  DeviceBuffer<int> dposd(dpos_h), dslots(slot_of);
  DeviceBuffer<float> dpool(pool), dyd(std::vector<float>(size_t(S) * Hd, 0.f));
  ec::lightning_mixer_decode(gemm, w.view, lc, S, dxd.get(), dposd.get(), dinv.get(), dpool.get(), dslots.get(), sc,
                             dyd.get(), nullptr);
  check_cuda(cudaDeviceSynchronize(), "lightning_mixer_decode");
  const auto yd = dyd.download();
  double ed = 0;
  for (int i = 0; i < S; ++i) ed = std::max(ed, scaled_err(yd.data() + size_t(i) * Hd, ref_d.data() + size_t(i) * Hd, Hd));
  std::printf("[lightning layer %s] prefill out %.3e state %.3e; decode out %.3e\n", model_family_name(c.family), ey,
              es, ed);
  CHECK(ey < 3e-2);
  CHECK(es < 2e-2);
  CHECK(ed < 3e-2);
}

}  // namespace

TEST_CASE("lightning layers on the GPU match the CPU model's MiniMax and Ring-linear layers (prefill, decode)",
          "[gpu][families][lightning][layer]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  SECTION("MiniMax-Text-01 heads (silu, one norm group)") {
    check_lightning_layer(hypic::engine::parse_config(R"({
      "model_type": "minimax", "architectures": ["MiniMaxForCausalLM"],
      "vocab_size": 97, "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 64,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-5,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
      "layer_types": ["linear_attention", "full_attention"], "block_size": 256, "num_local_experts": 4,
      "num_experts_per_tok": 2, "tie_word_embeddings": false })"),
                          131);
  }
  SECTION("Ring-linear-2.0 heads (qk-norm, partial RoPE, group norm of 4)") {
    check_lightning_layer(hypic::engine::parse_config(R"({
      "model_type": "bailing_moe_linear", "architectures": ["BailingMoeLinearV2ForCausalLM"],
      "vocab_size": 97, "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 64,
      "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 128, "rms_norm_eps": 1e-6,
      "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "use_qk_norm": true, "layer_group_size": 2,
      "group_norm_size": 4, "first_k_dense_replace": 1, "num_experts": 8, "num_experts_per_tok": 2,
      "num_shared_experts": 1, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
      "n_group": 2, "topk_group": 2, "routed_scaling_factor": 2.0, "score_function": "sigmoid",
      "norm_topk_prob": true, "tie_word_embeddings": false })"),
                          132);
  }
}

// ---- whole KDA layers (engine/cuda/kda_mixer.h) against the CPU model's layer ---------------------------------------

namespace {

// A two-layer Kimi-Linear config (KDA layer 1 with 2 heads of 128, MLA layer 2 with the given sizes), hidden 256.
hypic::engine::ModelConfig kimi_config(int mla_heads, int nope, int rope, int v, int rank) {
  char text[2048];
  std::snprintf(text, sizeof text, R"({
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 97, "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 64,
    "num_attention_heads": %d, "num_key_value_heads": %d, "head_dim": %d,
    "q_lora_rank": null, "kv_lora_rank": %d, "qk_nope_head_dim": %d, "qk_rope_head_dim": %d, "v_head_dim": %d,
    "mla_use_nope": true, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": false,
    "linear_attn_config": {"num_heads": 2, "head_dim": 128, "short_conv_kernel_size": 4,
                           "kda_layers": [1], "full_attn_layers": [2]},
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": true, "num_expert_group": 2, "topk_group": 1,
    "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "moe_layer_freq": 1, "model_max_length": 4096 })",
                mla_heads, mla_heads, nope + rope, rank, nope, rope, v);
  return hypic::engine::parse_config(text);
}


}  // namespace

TEST_CASE("the KDA layer on the GPU matches the CPU model's Kimi-Linear layer (prefill with conv tails, decode)",
          "[gpu][families][kda][layer]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  namespace ec = hypic::engine::cuda;
  namespace fam = hypic::engine::families;
  using hypic::engine::Tensor;
  const hypic::engine::ModelConfig c = kimi_config(2, 16, 8, 16, 32);
  const ec::KdaLayerConfig lc = ec::KdaLayerConfig::of(c);
  std::mt19937 rng(141);
  const int Hd = c.hidden_size, H = lc.heads, D = lc.head_dim, hd = H * D, K = lc.conv_kernel, Cc = 3 * hd;
  // Weights: host fp32 copies of bf16 values; A_log, dt_bias fp32 (HF's init ranges).
  hypic::engine::KdaWeights w;
  auto mat = [&](Tensor& t, std::vector<int64_t> shape, float sigma, float mean = 0.f) {
    return random_weight(rng, t, std::move(shape), sigma, mean);
  };
  const float sh = 1.0f / std::sqrt(float(Hd));
  auto bq = mat(w.q_proj, {hd, Hd}, sh), bk = mat(w.k_proj, {hd, Hd}, sh), bv = mat(w.v_proj, {hd, Hd}, sh);
  auto bconv = mat(w.conv1d, {Cc, K}, 0.5f);
  auto bfa = mat(w.f_a_proj, {D, Hd}, sh), bfb = mat(w.f_b_proj, {hd, D}, 0.1f / std::sqrt(float(D)));
  auto bb = mat(w.b_proj, {H, Hd}, sh);
  auto bga = mat(w.g_a_proj, {D, Hd}, sh), bgb = mat(w.g_b_proj, {hd, D}, 1.0f / std::sqrt(float(D)));
  auto bon = mat(w.o_norm, {D}, 0.1f, 1.0f), bop = mat(w.o_proj, {Hd, hd}, 1.0f / std::sqrt(float(hd)));
  std::uniform_real_distribution<float> ua(1.f, 16.f), udt(0.001f, 0.1f);
  w.A_log.shape = {H}, w.dt_bias.shape = {hd};
  for (int h = 0; h < H; ++h) w.A_log.data.push_back(std::log(ua(rng)));
  for (int i = 0; i < hd; ++i) w.dt_bias.data.push_back(std::log(std::expm1(udt(rng))));
  auto cat = [](std::initializer_list<const std::vector<bf16>*> parts) {
    std::vector<bf16> o;
    for (auto* p : parts) o.insert(o.end(), p->begin(), p->end());
    return o;
  };
  DeviceBuffer<bf16> d_qkv(cat({&bq, &bk, &bv})), d_conv(bconv), d_low(cat({&bfa, &bga, &bb})), d_fb(bfb), d_gb(bgb),
      d_on(bon), d_op(bop);
  DeviceBuffer<float> d_alog(w.A_log.data), d_dt(w.dt_bias.data);
  const ec::DevKda dw{d_qkv.get(), d_conv.get(), d_low.get(), d_fb.get(), d_gb.get(), d_alog.get(), d_dt.get(),
                      d_on.get(), d_op.get()};

  const std::vector<int> lens{1, 70, 200};
  std::vector<int> cu{0};
  for (int l : lens) cu.push_back(cu.back() + l);
  const int S = int(lens.size()), T = cu.back();
  std::vector<float> xf;
  auto x = random_bf16(rng, size_t(T) * Hd, 1.0f, xf);
  std::vector<hypic::engine::LinearLayerState> st(S);
  std::vector<float> ref(size_t(T) * Hd);
  for (int i = 0; i < S; ++i) {
    st[i].ssm.assign(size_t(H) * D * D, 0.f);
    st[i].conv.assign(size_t(K - 1) * Cc, 0.f);
    fam::kimi_linear::kda_layer(c, w, st[i], xf.data() + size_t(cu[i]) * Hd, lens[i], false, nullptr,
                                ref.data() + size_t(cu[i]) * Hd);
  }
  kc::GemmRunner gemm;
  auto bf = [](size_t n) { return std::make_unique<DeviceBuffer<bf16>>(n); };
  auto pre = bf(size_t(T) * Cc), q = bf(size_t(T) * hd), k = bf(size_t(T) * hd), v = bf(size_t(T) * hd),
       low = bf(size_t(T) * lc.low_width()), graw = bf(size_t(T) * hd), o = bf(size_t(T) * hd), gate = bf(size_t(T) * hd);
  DeviceBuffer<float> g(size_t(T) * hd), beta(size_t(T) * H);
  DeviceBuffer<bf16> dx(x), conv_state(std::vector<bf16>(size_t(S) * (K - 1) * Cc, float_to_bf16(0.f)));
  DeviceBuffer<int> dcu(cu);
  DeviceBuffer<float> dy(std::vector<float>(size_t(T) * Hd, 0.f)), states(size_t(S) * H * D * D);
  kc::KdaPrefillArgs seqs;
  seqs.num_seqs = S, seqs.cu_seqlens = dcu.get(), seqs.total_tokens = T, seqs.num_heads = H;
  seqs.final_state = states.get();
  const size_t wsb = kc::kda_prefill_workspace_bytes(seqs);
  DeviceBuffer<unsigned char> ws(wsb);
  const ec::KdaScratch sc{pre->get(), q->get(), k->get(), v->get(), low->get(), graw->get(), o->get(), gate->get(),
                          g.get(), beta.get(), ws.get(), wsb};
  ec::kda_mixer_prefill(gemm, dw, lc, T, dx.get(), seqs, conv_state.get(), sc, dy.get(), nullptr);
  check_cuda(cudaDeviceSynchronize(), "kda_mixer_prefill");
  const auto y = dy.download(), fin = states.download();
  const auto tails = to_float(conv_state.download());
  double ey = 0, es = 0, ec_ = 0;
  for (int i = 0; i < S; ++i) {
    ey = std::max(ey, scaled_err(y.data() + size_t(cu[i]) * Hd, ref.data() + size_t(cu[i]) * Hd, size_t(lens[i]) * Hd));
    for (int h = 0; h < H; ++h)
      es = std::max(es, scaled_err(fin.data() + (size_t(i) * H + h) * D * D, st[i].ssm.data() + size_t(h) * D * D,
                                   size_t(D) * D));
    ec_ = std::max(ec_, scaled_err(tails.data() + size_t(i) * (K - 1) * Cc, st[i].conv.data(), size_t(K - 1) * Cc));
  }
  // One decode step of each sequence, states and conv tails in slots 2, 0, 1 of pools.
  const std::vector<int> slot_of{2, 0, 1};
  std::vector<float> pool(size_t(3) * H * D * D);
  std::vector<bf16> cpool(size_t(3) * (K - 1) * Cc);
  const auto tails_b = conv_state.download();
  for (int i = 0; i < S; ++i) {
    std::copy(fin.begin() + size_t(i) * H * D * D, fin.begin() + size_t(i + 1) * H * D * D,
              pool.begin() + size_t(slot_of[i]) * H * D * D);
    std::copy(tails_b.begin() + size_t(i) * (K - 1) * Cc, tails_b.begin() + size_t(i + 1) * (K - 1) * Cc,
              cpool.begin() + size_t(slot_of[i]) * (K - 1) * Cc);
  }
  std::vector<float> xdf;
  auto xd = random_bf16(rng, size_t(S) * Hd, 1.0f, xdf);
  std::vector<float> ref_d(size_t(S) * Hd);
  for (int i = 0; i < S; ++i)
    fam::kimi_linear::kda_layer(c, w, st[i], xdf.data() + size_t(i) * Hd, 1, true, nullptr, ref_d.data() + size_t(i) * Hd);
  DeviceBuffer<bf16> dxd(xd), dcpool(cpool);
  DeviceBuffer<int> dslots(slot_of);
  DeviceBuffer<float> dpool(pool), dyd(std::vector<float>(size_t(S) * Hd, 0.f));
  ec::kda_mixer_decode(gemm, dw, lc, S, dxd.get(), dpool.get(), dcpool.get(), dslots.get(), sc, dyd.get(), nullptr);
  check_cuda(cudaDeviceSynchronize(), "kda_mixer_decode");
  const auto yd = dyd.download();
  double ed = 0;
  for (int i = 0; i < S; ++i) ed = std::max(ed, scaled_err(yd.data() + size_t(i) * Hd, ref_d.data() + size_t(i) * Hd, Hd));
  std::printf("[kda layer] prefill out %.3e state %.3e conv tails %.3e; decode out %.3e\n", ey, es, ec_, ed);
  CHECK(ey < 3e-2);
  CHECK(es < 2e-2);
  CHECK(ec_ < 1e-2);
  CHECK(ed < 3e-2);
}

// ---- attention_prepare's norm modes for the softmax layers of Ring-linear (plain) and MiniMax (none) ---------------

TEST_CASE("attention_prepare with Ring-linear's plain qk-norm and MiniMax's unnormed q/k, against the CPU ops",
          "[gpu][families][attention]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  struct Case {
    kc::QkNorm norm;
    int rotary_dim;
    const char* name;
  };
  for (const Case& cs : {Case{kc::QkNorm::Plain, 64, "Ring plain norm, partial RoPE"},
                         Case{kc::QkNorm::None, 128, "MiniMax no norm, full RoPE"}}) {
    DYNAMIC_SECTION(cs.name) {
      std::mt19937 rng(151);
      const int T = 37, nh = 4, nkv = 2, hd = 128;
      std::vector<float> qf, kf, vf, qnf, knf;
      auto q = random_bf16(rng, size_t(T) * nh * hd, 1.0f, qf);
      auto k = random_bf16(rng, size_t(T) * nkv * hd, 1.0f, kf);
      auto v = random_bf16(rng, size_t(T) * nkv * hd, 1.0f, vf);
      auto qn = random_bf16(rng, hd, 0.2f, qnf), kn = random_bf16(rng, hd, 0.2f, knf);
      for (int i = 0; i < hd; ++i)
        qn[i] = float_to_bf16(qnf[i] + 1.f), kn[i] = float_to_bf16(knf[i] + 1.f), qnf[i] = bf16_to_float(qn[i]),
        knf[i] = bf16_to_float(kn[i]);
      std::vector<int> pos(T), rows(T);
      for (int t = 0; t < T; ++t) pos[t] = 1000 + 3 * t, rows[t] = (t * 7) % T;  // a permutation (T prime)
      const auto inv_freq = cpu::rope_inv_freq(10000.0, cs.rotary_dim);
      // CPU: norm (plain), rounded to bf16 as the kernel does, then RoPE per token at its position.
      std::vector<float> rq = qf, rk = kf;
      if (cs.norm == kc::QkNorm::Plain) {
        cpu::rms_norm(int64_t(T) * nh, hd, rq.data(), qnf.data(), 1e-6f, rq.data());
        cpu::rms_norm(int64_t(T) * nkv, hd, rk.data(), knf.data(), 1e-6f, rk.data());
        for (auto& x : rq) x = bfr(x);
        for (auto& x : rk) x = bfr(x);
      }
      for (int t = 0; t < T; ++t) {
        cpu::apply_rope(rq.data() + size_t(t) * nh * hd, 1, nh, hd, inv_freq, pos[t]);
        cpu::apply_rope(rk.data() + size_t(t) * nkv * hd, 1, nkv, hd, inv_freq, pos[t]);
      }
      DeviceBuffer<bf16> dq(q), dk(k), dv(v), dqn(qn), dkn(kn), qo(size_t(T) * nh * hd), kp(size_t(T) * nkv * hd),
          vp(size_t(T) * nkv * hd);
      DeviceBuffer<int> dpos(pos), drows(rows);
      DeviceBuffer<float> dinv(inv_freq);
      qo.poison(), kp.poison(), vp.poison();
      kc::attention_prepare(T, nh, nkv, hd, cs.rotary_dim, false, dq.get(), dk.get(), dv.get(), long(nkv) * hd,
                            cs.norm == kc::QkNorm::None ? nullptr : dqn.get(),
                            cs.norm == kc::QkNorm::None ? nullptr : dkn.get(), 1e-6f, dpos.get(), dinv.get(),
                            drows.get(), qo.get(), kp.get(), vp.get(), nullptr, cs.norm);
      check_cuda(cudaDeviceSynchronize(), "attention_prepare");
      const auto gq = to_float(qo.download()), gk = to_float(kp.download()), gv = to_float(vp.download());
      double eq = 0, ek = 0;
      bool v_exact = true;
      for (int t = 0; t < T; ++t) {
        for (int h = 0; h < nh; ++h)
          eq = std::max(eq, scaled_err(gq.data() + (size_t(t) * nh + h) * hd, rq.data() + (size_t(t) * nh + h) * hd, hd));
        for (int h = 0; h < nkv; ++h) {
          const size_t g_off = (size_t(rows[t]) * nkv + h) * hd, c_off = (size_t(t) * nkv + h) * hd;
          ek = std::max(ek, scaled_err(gk.data() + g_off, rk.data() + c_off, hd));
          for (int d = 0; d < hd; ++d) v_exact = v_exact && gv[g_off + d] == vf[c_off + d];
        }
      }
      std::printf("[attention_prepare %s] q %.3e k %.3e, V copied exactly: %d\n", cs.name, eq, ek, int(v_exact));
      CHECK(eq < 8e-3);
      CHECK(ek < 8e-3);
      CHECK(v_exact);
    }
  }
}

// ---- MLA's absorbed attention over the latent pool (kernels/cuda/mla.h) against a host reference --------------------

TEST_CASE("mla_attention_latent (absorbed MLA over the latent pool) matches a host MQA reference",
          "[gpu][families][mla][kernel]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  std::mt19937 rng(157);
  struct Case {
    int heads, rank, rope;
    std::vector<int> lens, slot0;  // per group: queries, KV slot of its first query
    bool shared;                   // every group reads one sequence's pages (a splice's seams) or its own
  };
  // Ragged groups, length 1, KV lengths that are no multiple of a page, heads that straddle 32-row tiles (5, 48),
  // the three ranks, rope 0 / 32 / 64, long contexts (split-KV chunks + combine) and short ones (one chunk).
  const std::vector<Case> cases = {
      {32, 512, 64, {1}, {4000}, false},                      // decode, one request: many chunks
      {32, 512, 64, {1, 1, 1, 1}, {0, 63, 64, 700}, false},   // decode batch, slot 0 and page edges
      {5, 512, 64, {8, 1, 17, 3}, {100, 5000, 0, 2047}, true},  // seam windows of one sequence, odd heads
      {48, 256, 32, {2, 64}, {333, 1000}, false},
      {16, 128, 0, {40, 1}, {0, 129}, false},
  };
  for (const Case& cs : cases) {
    const int G = int(cs.lens.size()), D = cs.rank + cs.rope, nh = cs.heads, R = cs.rank;
    const kc::MlaDims d{nh, 128, cs.rope, 128, cs.rank};
    REQUIRE(kc::mla_latent_supported(d));
    std::vector<int> q_start{0}, kv_end(G);
    int max_kv = 0, max_q = 0;
    for (int g = 0; g < G; ++g) {
      q_start.push_back(q_start.back() + cs.lens[g]);
      kv_end[g] = cs.slot0[g] + cs.lens[g];
      max_kv = std::max(max_kv, kv_end[g]), max_q = std::max(max_q, cs.lens[g]);
    }
    const int total_q = q_start.back(), max_pages = (max_kv + 63) / 64;
    // Pages: each sequence its own pages, shuffled across the pool (shared: one sequence for every group).
    const int nseq = cs.shared ? 1 : G, pool_pages = nseq * max_pages;
    std::vector<int> perm(pool_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int> bt(size_t(G) * max_pages);
    for (int g = 0; g < G; ++g)
      for (int p = 0; p < max_pages; ++p) bt[size_t(g) * max_pages + p] = perm[size_t(cs.shared ? 0 : g) * max_pages + p];
    std::vector<float> qf, pf;
    auto qh = random_bf16(rng, size_t(total_q) * nh * D, 1.0f, qf);
    auto ph = random_bf16(rng, size_t(pool_pages) * 64 * D, 1.0f, pf);
    // Rows no group may read (past every KV end of their pages' sequence) are NaN: unwritten pool memory can be.
    for (int g = 0; g < G; ++g) {
      int end = kv_end[g];
      if (cs.shared) end = max_kv;
      for (int j = end; j < max_pages * 64; ++j) {
        const size_t row = size_t(bt[size_t(g) * max_pages + j / 64]) * 64 + j % 64;
        for (int e = 0; e < D; ++e) ph[row * D + e] = nan_bf16();
      }
    }
    const float scale = 1.0f / std::sqrt(192.0f);
    // Host reference: softmax(scale q . row) over the visible slots, times the rows' first R values (double).
    std::vector<float> ref(size_t(total_q) * nh * R);
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < cs.lens[g]; ++i)
        for (int h = 0; h < nh; ++h) {
          const float* q = qf.data() + (size_t(q_start[g] + i) * nh + h) * D;
          const int n = cs.slot0[g] + i + 1;
          std::vector<double> sc(n);
          double mx = -1e300;
          for (int j = 0; j < n; ++j) {
            const float* row = pf.data() + (size_t(bt[size_t(g) * max_pages + j / 64]) * 64 + j % 64) * D;
            double dot = 0;
            for (int e = 0; e < D; ++e) dot += double(q[e]) * row[e];
            sc[j] = dot * scale, mx = std::max(mx, sc[j]);
          }
          double sum = 0;
          for (double& v : sc) v = std::exp(v - mx), sum += v;
          float* o = ref.data() + (size_t(q_start[g] + i) * nh + h) * R;
          std::vector<double> acc(R, 0.0);
          for (int j = 0; j < n; ++j) {
            const float* row = pf.data() + (size_t(bt[size_t(g) * max_pages + j / 64]) * 64 + j % 64) * D;
            for (int e = 0; e < R; ++e) acc[e] += sc[j] * row[e];
          }
          for (int e = 0; e < R; ++e) o[e] = float(acc[e] / sum);
        }
    DeviceBuffer<bf16> dq(qh), dp(ph), dout(size_t(total_q) * nh * R);
    DeviceBuffer<int> dqs(q_start), ds0(cs.slot0), dbt(bt);
    // max_kv exact, and twice the longest KV end as a decode step's block-table width gives it (the planned chunks
    // past a group's end are empty), each with the chunks planned from max_kv and cut from each group's own pages
    // (HYPIC_MLA_SEQ_CHUNKS).
    for (const int kv_bound : {max_kv, 2 * max_kv})
      for (const bool seq : {false, true}) {
        hypic::gputest::ScopedCandidate sc("HYPIC_MLA_SEQ_CHUNKS", seq);
        dout.poison();
        const kc::AttnGroups g = {G, dqs.get(), ds0.get(), dbt.get(), max_pages, total_q, max_q, kv_bound};
        kc::MlaAttnWorkspace ws;
        kc::mla_attention_latent(g, d, dq.get(), dp.get(), scale, dout.get(), ws);
        check_cuda(cudaDeviceSynchronize(), "mla_attention_latent");
        const auto got = to_float(dout.download());
        const double e = rel_err(got.data(), ref.data(), ref.size());
        std::printf("[mla latent attention] heads %d rank %d rope %d groups %d max_kv %d (bound %d, per-group chunks "
                    "%d): rel err %.3e\n",
                    nh, R, cs.rope, G, max_kv, kv_bound, int(seq), e);
        CHECK(e < 1e-2);
      }
  }
  SECTION("sizes the kernel does not take are refused by name") {
    CHECK_FALSE(kc::mla_latent_supported(kc::MlaDims{32, 128, 64, 128, 384}));
    CHECK_FALSE(kc::mla_latent_supported(kc::MlaDims{32, 128, 72, 128, 512}));
    CHECK_FALSE(kc::mla_latent_supported(kc::MlaDims{32, 128, 8, 128, 128}));
  }
}

// ---- Kimi-Linear's MLA layer (engine/cuda/mla_mixer.h) against the CPU model's layer --------------------------------

TEST_CASE("the MLA layer on the GPU (latent cache, absorbed and expanded) matches the CPU model's Kimi-Linear layer",
          "[gpu][families][mla][layer]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  namespace ec = hypic::engine::cuda;
  namespace fam = hypic::engine::families;
  using hypic::engine::Tensor;
  // Kimi-Linear-48B-A3B's MLA head sizes (nope 128, rope 64, v 128, kv_lora_rank 512), 4 heads.
  const hypic::engine::ModelConfig c = kimi_config(4, 128, 64, 128, 512);
  const ec::MlaLayerConfig lc = ec::MlaLayerConfig::of(c);
  const kc::MlaDims& dm = lc.dims;
  REQUIRE(dm.padded() == 256);
  std::mt19937 rng(161);
  const int Hd = c.hidden_size, nh = dm.heads, qk = dm.nope + dm.rope, R = dm.rank, D = R + dm.rope;
  hypic::engine::MlaWeights w;
  auto mat = [&](Tensor& t, std::vector<int64_t> shape, float sigma, float mean = 0.f) {
    return DeviceBuffer<bf16>(random_weight(rng, t, std::move(shape), sigma, mean));
  };
  const float sh = 1.0f / std::sqrt(float(Hd));
  auto d_q = mat(w.q_proj, {nh * qk, Hd}, sh), d_kva = mat(w.kv_a_proj, {R + dm.rope, Hd}, sh);
  auto d_ln = mat(w.kv_a_layernorm, {R}, 0.1f, 1.0f), d_kvb = mat(w.kv_b_proj, {nh * (dm.nope + dm.v), R}, 1.0f / std::sqrt(float(R)));
  auto d_o = mat(w.o_proj, {Hd, nh * dm.v}, 1.0f / std::sqrt(float(nh * dm.v)));
  DeviceBuffer<bf16> d_uk(size_t(nh) * R * dm.nope);
  kc::mla_transpose_uk(dm, d_kvb.get(), d_uk.get());
  const ec::DevMla dw{d_q.get(), d_kva.get(), d_ln.get(), d_kvb.get(), d_o.get(), d_uk.get()};

  const int T1 = 150, T2 = 20, Tmax = T1 + T2 + 1, pages = (Tmax + 63) / 64;
  std::vector<float> xf;
  auto x = random_bf16(rng, size_t(Tmax) * Hd, 1.0f, xf);
  hypic::engine::AttentionLayerState st;
  std::vector<float> ref(size_t(Tmax) * Hd);
  fam::kimi_linear::mla_layer(c, w, st, xf.data(), T1, ref.data(), nullptr);
  fam::kimi_linear::mla_layer(c, w, st, xf.data() + size_t(T1) * Hd, T2, ref.data() + size_t(T1) * Hd, nullptr);
  fam::kimi_linear::mla_layer(c, w, st, xf.data() + size_t(T1 + T2) * Hd, 1, ref.data() + size_t(T1 + T2) * Hd,
                              nullptr);

  kc::GemmRunner gemm;
  kc::AttnDecodeWorkspace aws;
  kc::MlaAttnWorkspace lws;
  DeviceBuffer<bf16> dx(x), pool(size_t(pages) * 64 * D);
  pool.poison();  // unwritten rows (past the last token of the last page) are NaN: nothing may read them
  DeviceBuffer<bf16> q(size_t(T1) * nh * qk), ckv(size_t(T1) * D), qx(size_t(T1) * ec::MlaScratch::qx_width(dm)),
      ox(size_t(T1) * ec::MlaScratch::ox_width(dm)), packed(size_t(T1) * nh * dm.v);
  const ec::MlaScratch sc{q.get(), ckv.get(), qx.get(), ox.get(), packed.get()};
  DeviceBuffer<char> xmem(ec::MlaExpandScratch::bytes(dm, size_t(pages) * 64));
  xmem.poison();  // carve zero-fills: the padding must not carry NaN into the products
  const ec::MlaExpandScratch xs = ec::MlaExpandScratch::carve(xmem.get(), dm, size_t(pages) * 64, nullptr);
  std::vector<int> rows(Tmax), bt(pages);
  std::iota(rows.begin(), rows.end(), 0);
  std::iota(bt.begin(), bt.end(), 0);
  DeviceBuffer<int> drows(rows), dbt(bt);
  struct Call {
    int t0, n;
    bool expand;
  };
  // The prefill expanded; the continuation over the cached latent both ways; the decode step absorbed.
  for (bool cont_expanded : {false, true}) {
    DeviceBuffer<float> dy(std::vector<float>(size_t(Tmax) * Hd, 0.f));
    for (const Call& call : {Call{0, T1, true}, Call{T1, T2, cont_expanded}, Call{T1 + T2, 1, false}}) {
      std::vector<int> qs_h{0, call.n}, s0_h{call.t0};
      DeviceBuffer<int> qs(qs_h), s0(s0_h);
      const kc::AttnGroups g = {1, qs.get(), s0.get(), dbt.get(), pages, call.n, call.n, call.t0 + call.n};
      const ec::MlaExpandPlan plan = ec::MlaExpandPlan::of(1, qs_h.data(), s0_h.data(), bt.data(), pages);
      REQUIRE(plan.rows == (call.t0 + call.n + 63) / 64 * 64);
      DeviceBuffer<int> src(plan.src_rows), xbt(plan.block_table);
      ec::MlaExpandPass xp;
      xp.rows = plan.rows, xp.src_rows = src.get(), xp.groups = g;
      xp.groups.block_table = xbt.get(), xp.groups.max_pages = plan.max_pages, xp.groups.max_kv = plan.rows;
      ec::mla_mixer(gemm, dw, lc, call.n, dx.get() + size_t(call.t0) * Hd, drows.get() + call.t0, g, pool.get(),
                    call.expand ? &xp : nullptr, &xs, &aws, &lws, sc, dy.get() + size_t(call.t0) * Hd, nullptr);
      check_cuda(cudaDeviceSynchronize(), "mla_mixer");
    }
    // The expanded K / V padding (K past nope + rope, V past v) is still zero after the passes.
    {
      const int P = dm.padded();
      auto fetch = [&](const bf16* p) {
        std::vector<bf16> h(size_t(xs.rows) * nh * P);
        check_cuda(cudaMemcpy(h.data(), p, h.size() * sizeof(bf16), cudaMemcpyDeviceToHost), "scratch download");
        return to_float(h);
      };
      const auto hk = fetch(xs.k), hv = fetch(xs.v);
      size_t nonzero = 0;
      for (size_t r = 0; r < size_t(xs.rows) * nh; ++r) {
        for (int e = qk; e < P; ++e) nonzero += hk[r * P + e] != 0.f;
        for (int e = dm.v; e < P; ++e) nonzero += hv[r * P + e] != 0.f;
      }
      CHECK(nonzero == 0);
    }
    const auto y = dy.download();
    const double e1 = scaled_err(y.data(), ref.data(), size_t(T1) * Hd);
    const double e2 = scaled_err(y.data() + size_t(T1) * Hd, ref.data() + size_t(T1) * Hd, size_t(T2) * Hd);
    const double e3 = scaled_err(y.data() + size_t(T1 + T2) * Hd, ref.data() + size_t(T1 + T2) * Hd, Hd);
    std::printf("[mla layer] prefill %.3e, continuation over the cached latent (%s) %.3e, decode %.3e\n", e1,
                cont_expanded ? "expanded" : "absorbed", e2, e3);
    CHECK(e1 < 3e-2);
    CHECK(e2 < 3e-2);
    CHECK(e3 < 3e-2);
  }
  // The pool holds the latent rows [RMSNorm(c_kv) w | k_rot] the CPU layer cached (its state's K rows).
  const auto pl = to_float(pool.download());
  REQUIRE(st.k.size() == size_t(Tmax) * D);
  CHECK(rel_err(pl.data(), st.k.data(), size_t(Tmax) * D) < 1e-2);
  SECTION("the pass form: fresh long spans expand, short queries over long contexts stay absorbed") {
    if (!std::getenv("HYPIC_MLA_FORM")) {  // (the variable forces one form)
      const kc::MlaDims kimi{32, 128, 64, 128, 512};
      const int fresh_qs[2] = {0, 4096}, fresh_s0[1] = {0};
      CHECK(ec::mla_pass_form(kimi, 1, fresh_qs, fresh_s0, 4096) == ec::MlaForm::Expanded);
      const int seam_qs[3] = {0, 8, 16}, seam_s0[2] = {2048, 30000};  // two seam windows over a 30k context
      CHECK(ec::mla_pass_form(kimi, 2, seam_qs, seam_s0, 30016) == ec::MlaForm::Absorbed);
    }
  }
  SECTION("configs the GPU path does not take are refused by name") {
    hypic::engine::ModelConfig bad = c;
    bad.q_lora_rank = 64;
    CHECK_THROWS_AS(ec::MlaLayerConfig::of(bad), std::invalid_argument);
    bad = c;
    bad.v_head_dim = 300;
    CHECK_THROWS_AS(ec::MlaLayerConfig::of(bad), std::invalid_argument);
    bad = c;
    bad.kv_lora_rank = 384;
    CHECK_THROWS_AS(ec::MlaLayerConfig::of(bad), std::invalid_argument);
    bad = c;
    bad.qk_nope_head_dim = 0;
    CHECK_THROWS_AS(ec::MlaLayerConfig::of(bad), std::invalid_argument);
  }
}

TEST_CASE("rms_norm_residual with the plain weight of the other families' layer norms, against the CPU rms_norm",
          "[gpu][families][ops]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  std::mt19937 rng(171);
  const int rows = 5, dim = 2048, ldx = 2052;
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<float> x(size_t(7) * ldx);
  for (auto& e : x) e = nd(rng);
  std::vector<float> wf;
  auto w = random_bf16(rng, dim, 0.3f, wf);
  for (int i = 0; i < dim; ++i) w[i] = float_to_bf16(wf[i] + 1.f), wf[i] = bf16_to_float(w[i]);
  const std::vector<int> idx{6, 0, 3, 3, 1};
  DeviceBuffer<float> dx(x);
  DeviceBuffer<bf16> dw(w), dy(size_t(rows) * dim);
  DeviceBuffer<int> didx(idx);
  kc::rms_norm_residual(rows, dim, dx.get(), ldx, didx.get(), dw.get(), 1e-5f, dy.get(), nullptr, false);
  const auto y = to_float(dy.download());
  double worst = 0;
  for (int r = 0; r < rows; ++r) {
    std::vector<float> ref(dim);
    cpu::rms_norm(1, dim, x.data() + size_t(idx[r]) * ldx, wf.data(), 1e-5f, ref.data());
    worst = std::max(worst, scaled_err(y.data() + size_t(r) * dim, ref.data(), dim));
  }
  std::printf("[rms_norm_residual plain] %.3e\n", worst);
  CHECK(worst < 8e-3);
}

TEST_CASE("MiniMax's post-norm residual pieces: rms_norm_residual writes alpha norm(x), GemmRunner alpha, MoE scale",
          "[gpu][families][ops]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  std::mt19937 rng(181);
  SECTION("rms_norm_residual with post_alpha: y = bf16(norm(x)), x <- alpha norm(x) in fp32") {
    const int rows = 3, dim = 512;
    const float alpha = 3.5676f;
    std::normal_distribution<float> nd(0.f, 2.f);
    std::vector<float> x(size_t(rows) * dim);
    for (auto& e : x) e = nd(rng);
    std::vector<float> wf;
    auto w = random_bf16(rng, dim, 0.5f, wf);
    DeviceBuffer<float> dx(x);
    DeviceBuffer<bf16> dw(w), dy(size_t(rows) * dim);
    CHECK_THROWS_AS(kc::rms_norm_residual(rows, dim, dx.get(), dim, nullptr, dw.get(), 1e-5f, dy.get(), nullptr, false,
                                          alpha, nullptr),
                    std::invalid_argument);  // x_out must name x
    kc::rms_norm_residual(rows, dim, dx.get(), dim, nullptr, dw.get(), 1e-5f, dy.get(), nullptr, false, alpha, dx.get());
    const auto gx = dx.download();
    const auto gy = to_float(dy.download());
    std::vector<float> ref(x.size());
    cpu::rms_norm(rows, dim, x.data(), wf.data(), 1e-5f, ref.data());
    std::vector<float> ref_x(ref);
    for (auto& e : ref_x) e *= alpha;
    const double ex = scaled_err(gx.data(), ref_x.data(), gx.size()), ey = scaled_err(gy.data(), ref.data(), gy.size());
    std::printf("[post-norm residual] x %.3e y %.3e\n", ex, ey);
    CHECK(ex < 1e-5);
    CHECK(ey < 8e-3);
  }
  SECTION("GemmRunner alpha scales the product exactly (powers of two)") {
    const int M = 7, N = 96, K = 128;
    std::vector<float> xf, wf;
    DeviceBuffer<bf16> dx(random_bf16(rng, size_t(M) * K, 1.f, xf)), dw(random_bf16(rng, size_t(N) * K, 1.f, wf));
    DeviceBuffer<float> y1(size_t(M) * N), y2(size_t(M) * N);
    kc::GemmRunner gemm;
    gemm.linear(M, N, K, dx.get(), K, dw.get(), y1.get(), CUDA_R_32F, N, 0.0f, nullptr);
    gemm.linear(M, N, K, dx.get(), K, dw.get(), y2.get(), CUDA_R_32F, N, 0.0f, nullptr, 0.25f);
    const auto a = y1.download(), b = y2.download();
    bool exact = true;
    for (size_t i = 0; i < a.size(); ++i) exact = exact && b[i] == 0.25f * a[i];
    CHECK(exact);
  }
  SECTION("moe_forward output_scale scales the block's output exactly (powers of two)") {
    HostMoe m({16, 2, 128, 32, 32}, 19);
    Rng r2(20);
    std::vector<float> xf;
    DeviceBuffer<bf16> dx(rand_bf16(r2, size_t(70) * 128, 1.0f, xf));
    kc::GemmRunner gemm;
    Stream st;
    for (kc::GroupedGemm impl : {kc::GroupedGemm::Own, kc::GroupedGemm::OwnDecode}) {
      kc::MoeWeightsView v = m.view(true);
      kc::MoeWorkspace ws;
      DeviceBuffer<float> o1(std::vector<float>(size_t(70) * 128, 0.f)), o2(std::vector<float>(size_t(70) * 128, 0.f));
      kc::moe_forward(70, dx.get(), v, o1.get(), ws, gemm, impl, st.s);
      v.output_scale = 0.5f;
      kc::moe_forward(70, dx.get(), v, o2.get(), ws, gemm, impl, st.s);
      check_cuda(cudaStreamSynchronize(st.s), "moe_forward");
      const auto a = o1.download(), b = o2.download();
      bool exact = true;
      for (size_t i = 0; i < a.size(); ++i) exact = exact && b[i] == 0.5f * a[i];
      CHECK(exact);
    }
  }
}
