// GPU kernels of the non-Qwen hybrid families against their CPU references (kernels/cpu): lightning attention
// (MiniMax-Text-01, Ring-linear-2.0): chunked prefill with T_C, sequence-parallel parts, decode, the scalar
// composition and the key-axis rotation of cached states. Inputs are bf16-rounded on both sides; the CPU side runs
// fp32 token by token (kernels/cpu lightning_recurrent), an independent form of the recurrence.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "gpu_util.h"
#include "kernels/cpu/lightning.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/lightning.h"

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
      if (!cs.outputs || cs.lens[i] == 0) continue;
      // Each (sequence, head) block of outputs against its own scale.
      std::vector<float> go, ro;
      for (int t2 = cu[i]; t2 < cu[i + 1]; ++t2)
        for (int e = 0; e < D; ++e) {
          go.push_back(out[size_t(t2) * row + size_t(h) * D + e]);
          ro.push_back(ref_out[size_t(t2) * row + size_t(h) * D + e]);
        }
      res.out_err = std::max(res.out_err, scaled_err(go.data(), ro.data(), go.size()));
    }
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
