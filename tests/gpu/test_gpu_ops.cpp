// kernels/cuda/ops.h against the CPU reference (kernels/cpu/ops.h, or plain loops in double) on random inputs
// with ragged sizes. Needs an NVIDIA GPU (scripts/test_gpu.sh).
// Stated tolerances: norms (fp32 math, one bf16 rounding) |d| <= 1e-2 |ref| + 1e-3; affine chain (fp32 FMA)
// relative Frobenius <= 1e-5 against double; copies, gathers, splits and conversions exact.
#include <catch2/catch.hpp>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sample.h"
#include "tests/gpu/gpu_util.h"

using namespace hypic::gputest;
namespace gpu = hypic::kernels::cuda;
namespace cpu = hypic::kernels::cpu;
using bf16 = __nv_bfloat16;

namespace {

const char* chain_math_name(gpu::ChainMath m) {
  switch (m) {
    case gpu::ChainMath::Tf32x3: return "tf32x3 (wgmma on Hopper)";
    case gpu::ChainMath::Tf32x3Mma: return "tf32x3 mma.sync";
    default: return "fp32";
  }
}

void require_gpu() {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
}

void check_close(const std::vector<float>& got, const std::vector<float>& ref, double rtol, double atol,
                 const char* what) {
  REQUIRE(got.size() == ref.size());
  size_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(double(got[i]) - ref[i]);
    worst = std::max(worst, d / (std::fabs(ref[i]) + atol / rtol));
    if (!(d <= rtol * std::fabs(ref[i]) + atol)) ++bad;
  }
  std::printf("[ops] %s: %zu values, worst |d| / (|ref| + atol/rtol) = %.3e, %zu outside\n", what, ref.size(), worst,
              bad);
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("rms_norm_residual equals the zero-centred RMSNorm, with and without a row index", "[ops]") {
  require_gpu();
  std::mt19937 rng(1);
  for (int dim : {64, 256, 2048}) {
    const int rows = 37;
    std::normal_distribution<float> d(0.f, 2.f);
    std::vector<float> x(size_t(rows) * dim);
    for (auto& v : x) v = d(rng);
    std::vector<float> wf;
    const auto w = random_bf16(rng, dim, 0.1f, wf);
    std::vector<float> ref(x.size());
    cpu::rms_norm_zero_centred(rows, dim, x.data(), wf.data(), 1e-6f, ref.data());
    DeviceBuffer<float> dx(x);
    DeviceBuffer<bf16> dw(w), dy(size_t(rows) * dim);
    gpu::rms_norm_residual(rows, dim, dx.get(), dim, nullptr, dw.get(), 1e-6f, dy.get());
    check_close(to_float(dy.download()), ref, 1e-2, 1e-3, "rms_norm_residual");
    // Rows picked by an index: rows 5, 0, 36.
    const std::vector<int> idx{5, 0, 36};
    DeviceBuffer<int> di(idx);
    DeviceBuffer<bf16> dz(idx.size() * dim);
    gpu::rms_norm_residual(3, dim, dx.get(), dim, di.get(), dw.get(), 1e-6f, dz.get());
    std::vector<float> ref3;
    for (int r : idx) ref3.insert(ref3.end(), ref.begin() + size_t(r) * dim, ref.begin() + size_t(r + 1) * dim);
    check_close(to_float(dz.download()), ref3, 1e-2, 1e-3, "rms_norm_residual (row index)");
  }
}

TEST_CASE("rms_norm_gated equals the gated RMSNorm of the delta-rule output", "[ops]") {
  require_gpu();
  std::mt19937 rng(2);
  const int rows = 123, dim = 128;
  std::vector<float> xf, zf, wf;
  const auto x = random_bf16(rng, size_t(rows) * dim, 1.f, xf);
  const auto z = random_bf16(rng, size_t(rows) * dim, 1.f, zf);
  const auto w = random_bf16(rng, dim, 1.f, wf);
  std::vector<float> ref(xf.size());
  cpu::rms_norm_gated(rows, dim, xf.data(), zf.data(), wf.data(), 1e-6f, ref.data());
  DeviceBuffer<bf16> dx(x), dz(z), dw(w);
  gpu::rms_norm_gated(rows, dim, dx.get(), dz.get(), dw.get(), 1e-6f, dx.get());  // in place
  check_close(to_float(dx.download()), ref, 1e-2, 1e-3, "rms_norm_gated");
}

TEST_CASE("affine_chain edge cases on every kernel: no steps, a T-less first step, init aliasing final, a step adding "
          "an earlier step's output", "[ops]") {
  require_gpu();
  std::mt19937 rng(11);
  const int heads = 2, D = 128;
  const size_t M = size_t(D) * D * heads;
  std::normal_distribution<float> d(0.f, 1.f / D);
  auto rnd = [&](bool near_identity) {
    std::vector<float> v(M);
    for (auto& x : v) x = d(rng);
    if (near_identity)
      for (size_t h = 0; h < M; h += size_t(D) * D)
        for (int i = 0; i < D; ++i) v[h + size_t(i) * (D + 1)] += 1.f;
    return v;
  };
  const auto X = rnd(false), S0 = rnd(false), T1 = rnd(true), S1 = rnd(false);
  // The reference of B: R = S0 (alpha 0 kills the init), R = T1 R + S1, then an identity step.
  std::vector<double> ref(M);
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < D; ++i)
      for (int j = 0; j < D; ++j) {
        const size_t b = size_t(h) * D * D;
        double acc = S1[b + size_t(i) * D + j];
        for (int k = 0; k < D; ++k) acc += double(T1[b + size_t(i) * D + k]) * S0[b + size_t(k) * D + j];
        ref[b + size_t(i) * D + j] = acc;
      }
  DeviceBuffer<float> dS0(S0), dT1(T1), dS1(S1), dX(X), dF(M), dout(M);
  for (const gpu::ChainMath math : {gpu::ChainMath::Tf32x3, gpu::ChainMath::Tf32x3Mma, gpu::ChainMath::Fp32Fma}) {
    INFO("math " << chain_math_name(math));
    // A: no steps: final = init bit for bit.
    dF.upload(std::vector<float>(M, std::nanf("")));
    DeviceBuffer<const float*> a_init(std::vector<const float*>{dX.get()});
    DeviceBuffer<float*> a_fin(std::vector<float*>{dF.get()});
    gpu::affine_chain(1, heads, 0, nullptr, a_init.get(), a_fin.get(), nullptr, math);
    CHECK(dF.download() == X);
    // B: init aliasing final (the slot state, as apply_folds), a T-less first step writing out (exactly S0), a T step,
    // then an identity step.
    dF.upload(X);
    dout.upload(std::vector<float>(M, std::nanf("")));
    std::vector<gpu::AffineStep> st(3);
    st[0].S = dS0.get(), st[0].alpha = 0.f, st[0].out = dout.get();
    st[1].T = dT1.get(), st[1].S = dS1.get();
    std::vector<unsigned char> raw(st.size() * sizeof(gpu::AffineStep));
    std::memcpy(raw.data(), st.data(), raw.size());
    DeviceBuffer<unsigned char> dsteps(raw);
    DeviceBuffer<const float*> b_init(std::vector<const float*>{dF.get()});
    DeviceBuffer<float*> b_fin(std::vector<float*>{dF.get()});
    gpu::affine_chain(1, heads, 3, reinterpret_cast<const gpu::AffineStep*>(dsteps.get()), b_init.get(), b_fin.get(),
                      nullptr, math);
    CHECK(dout.download() == S0);
    const auto F = dF.download();
    double n = 0, dd = 0;
    for (size_t i = 0; i < M; ++i) n += (F[i] - ref[i]) * (F[i] - ref[i]), dd += ref[i] * ref[i];
    std::printf("[ops] affine_chain edge cases (%s): aliased final %.3e\n", chain_math_name(math), std::sqrt(n / dd));
    CHECK(std::sqrt(n / dd) <= 1e-5);
    // C: step 1 adds what step 0 wrote (S = step 0's out): R = S0, then R = T1 R + R (the S read after the write).
    dout.upload(std::vector<float>(M, std::nanf("")));
    std::vector<gpu::AffineStep> sc(2);
    sc[0].S = dS0.get(), sc[0].alpha = 0.f, sc[0].out = dout.get();
    sc[1].T = dT1.get(), sc[1].S = dout.get();
    std::vector<unsigned char> rawc(sc.size() * sizeof(gpu::AffineStep));
    std::memcpy(rawc.data(), sc.data(), rawc.size());
    DeviceBuffer<unsigned char> dsteps_c(rawc);
    gpu::affine_chain(1, heads, 2, reinterpret_cast<const gpu::AffineStep*>(dsteps_c.get()), nullptr, a_fin.get(),
                      nullptr, math);
    const auto FC = dF.download();
    double nc = 0, dc = 0;
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < D; ++i)
        for (int j = 0; j < D; ++j) {
          const size_t b = size_t(h) * D * D, o = b + size_t(i) * D + j;
          double acc = S0[o];
          for (int k = 0; k < D; ++k) acc += double(T1[b + size_t(i) * D + k]) * S0[b + size_t(k) * D + j];
          nc += (FC[o] - acc) * (FC[o] - acc), dc += acc * acc;
        }
    INFO("C: rel err " << std::sqrt(nc / dc));
    CHECK(std::sqrt(nc / dc) <= 1e-5);
  }
}

TEST_CASE("affine_chain folds (T, S) steps like the plain matrix products", "[ops]") {
  require_gpu();
  std::mt19937 rng(3);
  const int heads = 3, chains = 2, steps = 4, D = 128;
  const size_t M = size_t(D) * D * heads;
  std::normal_distribution<float> d(0.f, 1.f / D);
  auto rnd = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
  };
  // Per chain: init, steps with T (every other one null = identity), S (one null), alpha; out on step 1.
  std::vector<std::vector<float>> Ts, Ss, inits;
  std::vector<DeviceBuffer<float>> dT, dS, dinit, dout, dfin;
  std::vector<gpu::AffineStep> table;
  std::vector<const float*> init_ptr;
  std::vector<float*> fin_ptr;
  for (int c = 0; c < chains; ++c) {
    inits.push_back(rnd(M));
    dinit.emplace_back(inits.back());
    init_ptr.push_back(c == 1 ? nullptr : dinit.back().get());  // chain 1 starts from zero
    dout.emplace_back(M);
    dfin.emplace_back(M);
    fin_ptr.push_back(dfin.back().get());
    for (int s = 0; s < steps; ++s) {
      Ts.push_back(rnd(M));
      Ss.push_back(rnd(M));
      for (size_t i = 0; i < M; i += D + 1) Ts.back()[i % M] += 1.f;  // near-identity keeps the norms O(1)
      dT.emplace_back(Ts.back());
      dS.emplace_back(Ss.back());
      gpu::AffineStep st;
      st.T = s == 2 ? nullptr : dT.back().get();
      st.S = s == 3 ? nullptr : dS.back().get();
      st.alpha = s == 1 ? -0.5f : 1.f;
      st.out = s == 1 ? dout.back().get() : nullptr;
      table.push_back(st);
    }
  }
  std::vector<unsigned char> raw(table.size() * sizeof(gpu::AffineStep));
  std::memcpy(raw.data(), table.data(), raw.size());
  DeviceBuffer<unsigned char> dtable(raw);
  DeviceBuffer<const float*> dinitp(init_ptr);
  DeviceBuffer<float*> dfinp(fin_ptr);
  for (const gpu::ChainMath math : {gpu::ChainMath::Tf32x3, gpu::ChainMath::Tf32x3Mma, gpu::ChainMath::Fp32Fma}) {
    const char* math_name = chain_math_name(math);
    for (auto& f : dfin) f.upload(std::vector<float>(M, std::nanf("")));
    for (auto& o : dout) o.upload(std::vector<float>(M, std::nanf("")));
    gpu::affine_chain(chains, heads, steps, reinterpret_cast<const gpu::AffineStep*>(dtable.get()), dinitp.get(),
                      dfinp.get(), nullptr, math);
    for (int c = 0; c < chains; ++c) {
      std::vector<double> R(M, 0.0), out1;
      if (c != 1)
        for (size_t i = 0; i < M; ++i) R[i] = inits[c][i];
      for (int s = 0; s < steps; ++s) {
        const auto& T = Ts[size_t(c) * steps + s];
        const auto& S = Ss[size_t(c) * steps + s];
        const double alpha = s == 1 ? -0.5 : 1.0;
        std::vector<double> nR(M);
        for (int h = 0; h < heads; ++h)
          for (int i = 0; i < D; ++i)
            for (int j = 0; j < D; ++j) {
              double acc = 0;
              if (s == 2) acc = R[size_t(h) * D * D + size_t(i) * D + j];
              else
                for (int k = 0; k < D; ++k)
                  acc += double(T[size_t(h) * D * D + size_t(i) * D + k]) * R[size_t(h) * D * D + size_t(k) * D + j];
              const size_t o = size_t(h) * D * D + size_t(i) * D + j;
              nR[o] = alpha * acc + (s == 3 ? 0.0 : double(S[o]));
            }
        R = nR;
        if (s == 1) out1 = R;
      }
      auto err = [](const std::vector<float>& g, const std::vector<double>& r) {
        double n = 0, dd = 0;
        for (size_t i = 0; i < r.size(); ++i) n += (g[i] - r[i]) * (g[i] - r[i]), dd += r[i] * r[i];
        return std::sqrt(n / dd);
      };
      const double ef = err(dfin[c].download(), R), eo = err(dout[c].download(), out1);
      std::printf("[ops] affine_chain (%s) chain %d: final %.3e, step-1 output %.3e\n", math_name, c, ef, eo);
      CHECK(ef <= 1e-5);
      CHECK(eo <= 1e-5);
    }
  }
  // HYPIC_CHAIN_SMEM_DESC (a measured default: the wgmma chain's shared memory addressed as such and its step
  // descriptors fetched into shared memory a step earlier) and with it HYPIC_CHAIN_T_BULK (a candidate: T staged by
  // bulk copies): the old path's bits, final states and step-1 outputs.
  std::vector<std::vector<float>> got[3];
  for (const int on : {0, 1, 2}) {
    ScopedCandidate sc("HYPIC_CHAIN_SMEM_DESC", on > 0), tb("HYPIC_CHAIN_T_BULK", on == 2);
    for (auto& f : dfin) f.upload(std::vector<float>(M, std::nanf("")));
    for (auto& o : dout) o.upload(std::vector<float>(M, std::nanf("")));
    gpu::affine_chain(chains, heads, steps, reinterpret_cast<const gpu::AffineStep*>(dtable.get()), dinitp.get(),
                      dfinp.get(), nullptr, gpu::ChainMath::Tf32x3);
    for (int c = 0; c < chains; ++c) {
      got[on].push_back(dfin[c].download());
      got[on].push_back(dout[c].download());
    }
  }
  for (size_t i = 0; i < got[0].size(); ++i) {
    CHECK(same_bits(got[0][i], got[1][i]));
    CHECK(same_bits(got[0][i], got[2][i]));
  }
}

TEST_CASE("gather_rows, batched_copy, embed_gather and conversions are exact", "[ops]") {
  require_gpu();
  std::mt19937 rng(4);
  const int T = 29, C = 1024;
  std::vector<float> f;
  const auto src = random_bf16(rng, size_t(T) * C, 1.f, f);
  DeviceBuffer<bf16> dsrc(src);
  for (int width : {C, 6}) {  // 16-byte and 4-byte paths
    const std::vector<int> rows{3, 0, 28, 3};
    DeviceBuffer<int> dr(rows);
    DeviceBuffer<bf16> dst(rows.size() * width);
    gpu::gather_rows(int(rows.size()), width, dsrc.get(), dr.get(), dst.get());
    const auto g = to_float(dst.download());
    bool gok = true;
    for (size_t i = 0; i < rows.size(); ++i)
      for (int c = 0; c < width; ++c) gok &= g[i * width + c] == f[size_t(rows[i]) * width + c];
    CHECK(gok);
  }
  // batched_copy: an aligned and an unaligned (4-byte) copy.
  DeviceBuffer<float> a(std::vector<float>(1000, 0.f)), b(1000);
  std::vector<float> av(1000);
  for (size_t i = 0; i < av.size(); ++i) av[i] = float(i);
  a.upload(av);
  b.poison(0);
  std::vector<gpu::CopyDesc> descs{{a.get(), b.get(), 400 * 4}, {a.get() + 401, b.get() + 601, 13 * 4}};
  std::vector<unsigned char> raw(descs.size() * sizeof(gpu::CopyDesc));
  std::memcpy(raw.data(), descs.data(), raw.size());
  DeviceBuffer<unsigned char> dd(raw);
  gpu::batched_copy(2, reinterpret_cast<const gpu::CopyDesc*>(dd.get()));
  const auto bv = b.download();
  bool cok = true;
  for (int i = 0; i < 400; ++i) cok &= bv[i] == float(i);
  for (int i = 0; i < 13; ++i) cok &= bv[601 + i] == float(401 + i);
  cok &= bv[400] == 0.f && bv[600] == 0.f && bv[614] == 0.f;
  CHECK(cok);
  // embed_gather.
  const int V = 50, H = 64;
  std::vector<float> ef;
  const auto emb = random_bf16(rng, size_t(V) * H, 1.f, ef);
  const std::vector<int32_t> ids{49, 0, 7, 7};
  DeviceBuffer<bf16> demb(emb);
  DeviceBuffer<int32_t> dids(ids);
  DeviceBuffer<float> dx(ids.size() * H);
  gpu::embed_gather(int(ids.size()), H, dids.get(), demb.get(), dx.get());
  const auto x = dx.download();
  bool eok = true;
  for (size_t t = 0; t < ids.size(); ++t)
    for (int c = 0; c < H; ++c) eok &= x[t * H + c] == ef[size_t(ids[t]) * H + c];
  CHECK(eok);
  // fp32 <-> bf16.
  DeviceBuffer<float> back(f.size());
  gpu::bf16_to_fp32(long(f.size()), dsrc.get(), back.get());
  CHECK(back.download() == f);
  DeviceBuffer<bf16> again(f.size());
  gpu::fp32_to_bf16(long(f.size()), back.get(), again.get());
  CHECK(to_float(again.download()) == f);
}

TEST_CASE("fill_random is deterministic and has the requested moments", "[ops]") {
  require_gpu();
  const long n = 1 << 20;
  DeviceBuffer<float> a(n), b(n), c(n);
  gpu::fill_random(n, gpu::RandomFill::Normal, 0.f, 0.02f, 42, 7, nullptr, a.get());
  gpu::fill_random(n, gpu::RandomFill::Normal, 0.f, 0.02f, 42, 7, nullptr, b.get());
  gpu::fill_random(n, gpu::RandomFill::Normal, 0.f, 0.02f, 42, 8, nullptr, c.get());
  const auto av = a.download(), bv = b.download(), cv = c.download();
  CHECK(av == bv);
  CHECK(av != cv);
  double m = 0, s = 0;
  for (float x : av) m += x, s += double(x) * x;
  m /= n;
  s = std::sqrt(s / n - m * m);
  std::printf("[ops] fill_random normal(0, 0.02): mean %.2e std %.5f\n", m, s);
  CHECK(std::fabs(m) < 1e-4);
  CHECK(std::fabs(s - 0.02) < 2e-4);
  gpu::fill_random(n, gpu::RandomFill::LogUniform, 1.f, 16.f, 1, 1, nullptr, a.get());
  const auto lv = a.download();
  const auto [lo, hi] = std::minmax_element(lv.begin(), lv.end());
  CHECK(*lo >= 0.f);
  CHECK(*hi <= std::log(16.f) + 1e-6f);
}

// ---- sample_rows (kernels/cuda/sample.h) against the host's Backend::sample_row (Sampler::pick) ----------------------
// Rows of random logits (normal, scaled; or quantised to 7 levels so that ties straddle the top-k boundary and the
// candidate order must break them by id), with -inf and -0.0 / +0.0 entries, at the real vocabulary (248320), 1000
// and 37; draws over temperature (0: the argmax), top_k (1 .. 1024, V - 1), top_p and u (0, interior, 1 - 2^-40);
// rows with NaNs (the lowest NaN's code), all -inf or a +inf (no finite maximum). Tokens equal, row by row; the rows
// picked through a shuffled row list and through none (rows 0 .. n-1).
TEST_CASE("sample_rows picks the host's Sampler::pick token for every draw", "[ops][sample]") {
  require_gpu();
  namespace eng = hypic::engine;
  std::mt19937 rng(77);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  for (const int V : {248320, 1000, 37}) {
    std::vector<float> logits;
    std::vector<gpu::SampleRowDraw> draws;
    std::vector<std::string> what;
    auto add = [&](const std::vector<float>& row, gpu::SampleRowDraw d, std::string w) {
      logits.insert(logits.end(), row.begin(), row.end());
      draws.push_back(d);
      what.push_back(std::move(w));
    };
    const int topks[] = {1, 2, 5, 20, 50, 300, 1024, V - 1};
    const float temps[] = {0.f, 0.2f, 1.f, 3.f};
    const float top_ps[] = {1.f, 0.9f, 0.5f, 0.05f};
    int n = 0;
    for (int tk : topks) {
      if (tk < 1 || tk > gpu::kSampleMaxTopK || tk >= V) continue;
      for (int variant = 0; variant < 4; ++variant) {
        std::vector<float> row(V);
        const float scale = variant == 1 ? 8.f : 2.f;
        for (float& x : row) x = nd(rng) * scale;
        if (variant == 2)  // 7 levels: ties at every boundary
          for (float& x : row) x = std::round(x);
        if (variant == 3) {  // -inf and signed zeros among the largest values
          for (int i = 0; i < V; i += 3) row[size_t(i)] = -INFINITY;
          for (int i = 1; i < V; i += 11) row[size_t(i)] = (i / 11) % 2 ? 0.f : -0.f;
          for (float& x : row) x = x > 0.f ? -x : x;  // every finite value <= 0: the zeros are the largest
        }
        gpu::SampleRowDraw d;
        // (n / 4: the top-k index; the temperature index minus the top-p one is the variant: all 16 pairs)
        d.temperature = temps[(n / 4 + variant) % 4];
        d.top_k = tk;
        d.top_p = top_ps[(n / 4) % 4];
        d.u = n % 7 == 0 ? 0.0 : n % 7 == 1 ? 1.0 - 0x1.0p-40 : ud(rng);
        add(row, d, "V " + std::to_string(V) + " top_k " + std::to_string(tk) + " variant " + std::to_string(variant));
        ++n;
      }
    }
    {  // Exact boundaries: two equal maxima (ids 3 and 7), the rest -inf, top_k 3: probabilities 1/2, 1/2, 0. The
       // top-p cut stops at cum >= top_p (top_p 1/2 keeps the lower id alone: u 0.75 takes it); the walk takes the
       // first candidate with u < cum (u 1/2 is not below the first 1/2: the higher id).
      std::vector<float> row(V, -INFINITY);
      row[3] = 1.f;
      row[7] = 1.f;
      add(row, {1.f, 3, 0.5f, 0.75}, "two maxima, top_p 0.5, u 0.75");
      add(row, {1.f, 3, 1.f, 0.5}, "two maxima, u 0.5");
      add(row, {2.f, 3, 1.f, 0.25}, "two maxima, u 0.25");
    }
    {  // NaNs at 5 and 3 (the lowest: 3), all -inf, a +inf
      std::vector<float> row(V, 1.f);
      row[size_t(5 % V)] = NAN;
      row[size_t(3 % V)] = NAN;
      add(row, {1.f, 5, 1.f, 0.5}, "NaN row");
      add(std::vector<float>(V, -INFINITY), {1.f, 5, 1.f, 0.5}, "all -inf");
      std::vector<float> inf_row(V, 0.f);
      inf_row[size_t(V / 2)] = INFINITY;
      add(inf_row, {0.7f, 3, 0.9f, 0.5}, "+inf");
      add(inf_row, {0.f, 3, 1.f, 0.5}, "+inf, temperature 0");
      add(row, {0.f, 3, 1.f, 0.5}, "NaN row, temperature 0");
    }
    const int rows = int(draws.size());
    std::vector<int32_t> want(rows);
    for (int r = 0; r < rows; ++r) {
      eng::Backend::SampleDraw d{draws[size_t(r)].temperature, draws[size_t(r)].top_k, draws[size_t(r)].top_p,
                                 draws[size_t(r)].u};
      want[size_t(r)] = eng::Backend::sample_row(std::span<const float>(logits.data() + size_t(r) * V, size_t(V)), d);
    }
    DeviceBuffer<float> dl(logits);
    DeviceBuffer<gpu::SampleRowDraw> dd(draws);
    // Through a shuffled row list: entry i picks row perm[i] with draw i.
    std::vector<int32_t> perm(rows);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<gpu::SampleRowDraw> pdraws(rows);
    for (int i = 0; i < rows; ++i) pdraws[size_t(i)] = draws[size_t(perm[size_t(i)])];
    DeviceBuffer<gpu::SampleRowDraw> dpd(pdraws);
    DeviceBuffer<int32_t> dperm(perm), dout{size_t(rows)}, dout2{size_t(rows)};
    gpu::sample_rows(rows, V, dl.get(), long(V), nullptr, dd.get(), dout.get());
    gpu::sample_rows(rows, V, dl.get(), long(V), dperm.get(), dpd.get(), dout2.get());
    check_cuda(cudaDeviceSynchronize(), "sample_rows");
    const auto got = dout.download(), got2 = dout2.download();
    auto engine_code = [](int32_t t) { return t >= 0 || t == INT32_MIN ? t : eng::Backend::nan_logits_code(-1 - t); };
    int bad = 0;
    for (int r = 0; r < rows; ++r) {
      const int32_t g = engine_code(got[size_t(r)]);
      if (g != want[size_t(r)]) {
        ++bad;
        UNSCOPED_INFO(what[size_t(r)] << ": device " << g << ", host " << want[size_t(r)]);
      }
      const int src = perm[size_t(r)];
      if (engine_code(got2[size_t(r)]) != want[size_t(src)]) {
        ++bad;
        UNSCOPED_INFO(what[size_t(src)] << " (shuffled): device " << engine_code(got2[size_t(r)]) << ", host "
                                        << want[size_t(src)]);
      }
    }
    std::printf("[sample_rows] V %d: %d rows, %d tokens differ from Sampler::pick\n", V, rows, bad);
    CHECK(bad == 0);
  }
  CHECK_THROWS_AS(gpu::sample_rows(1, 0, nullptr, 0, nullptr, nullptr, nullptr), std::invalid_argument);
  CHECK_THROWS_AS(gpu::sample_rows(-1, 10, nullptr, 10, nullptr, nullptr, nullptr), std::invalid_argument);
  CHECK_NOTHROW(gpu::sample_rows(0, 10, nullptr, 10, nullptr, nullptr, nullptr));
}
