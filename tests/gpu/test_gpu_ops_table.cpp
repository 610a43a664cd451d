// The cross-backend op table (issue 28, in the manner of llama.cpp's tests/test-backend-ops.cpp): every op of the CUDA
// kernels library (kernels/cuda) that the engine calls, listed once with its dtypes, its shape cases (ragged and odd
// sizes: one token, sizes that are no multiple of a tile or page, head dims 128 and 256 where the op has heads), its
// error metric and tolerance. Each case makes random inputs, runs the CPU fp32 reference (kernels/cpu, or plain loops
// where the op is a copy) on the same bf16-rounded values the GPU reads, runs the CUDA kernel, and prints one line
//   [ops_table] <op>[.<output>] <case>: err X (tol Y)
// Needs an NVIDIA GPU (scripts/test_gpu.sh); one op alone: test_gpu_ops_table -c <op>.
//
// Error metrics: elem = max_i |gpu_i - ref_i| / (|ref_i| + 0.1) (elementwise bf16 outputs: relative, with an absolute
// floor of 0.1 tol near zero); max_rel = max |gpu - ref| / max |ref| per row / group / request / whole output;
// fro = ||gpu - ref|| / ||ref|| per head / matrix; exact = number of elements whose bits differ. A NaN is +inf.
//
// The per-kernel tests (tests/gpu/test_gpu_{ops,gated_delta,attention,moe}.cpp) keep what this table leaves to them:
// CUDA-graph replays, forced implementations (gdn_prefill scan layouts, sequence-parallel scans and checkpoints, the
// MoE grouped-GEMM kinds, the mma.sync / pipelined wgmma attention kernels), Qwen3.5-35B-A3B MoE sizes, 8k-32k spans,
// argument errors, benchmarks. Ops of kernels/cuda deliberately left out of the table:
//   fill_random                 seeded benchmark-only weights, no CPU reference (determinism, moments: test_gpu_ops)
//   fp32_to_bf16, bf16_to_fp32  not called by the engine (exact round trip: test_gpu_ops)
//   record_block_sms            SM-placement diagnostics, no numeric output
//   compose_fold(_cublas)       not called by the engine, which folds with affine_chain; compose_fold also runs inside
//                               gdn_prefill's sequence-parallel scans (both: test_gpu_gated_delta)
//   gdn_gates, gdn_decode       unfused forms; the engine runs gdn_prefill with fused gates and gdn_decode_gated (fused
//                               == unfused bit for bit: test_gpu_gated_delta)
//   attention_prefill without a workspace: the engine calls the workspace overload, whose groups of more than 512
//                               queries run that kernel (case "ragged" below)
//   gdn_scan_parts, moe_wgmma_available, grouped_gemm_for_tokens, measure_bf16_tflops: plans, queries, a benchmark
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/gated_delta.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/decode_linear.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/switches.h"
#include "tests/gpu/gpu_util.h"

using namespace hypic::gputest;
namespace gpu = hypic::kernels::cuda;
namespace cpu = hypic::kernels::cpu;
using bf16 = __nv_bfloat16;

namespace {

using Errs = std::vector<double>;  // one error per output of an op, in the order of Op::outs
constexpr int D = gpu::kGdnHeadDim;
constexpr int kPage = gpu::kKvPageTokens;

// ---- the table's types -----------------------------------------------------------------------------------------

struct Out {
  const char* name;  // which output (printed when an op has several)
  double tol;
  const char* why;   // the tolerance's justification
};

struct Case {
  std::string name;
  std::function<Errs(std::mt19937&)> run;  // random inputs, CPU reference, CUDA kernel: the errors of Op::outs
};

struct Op {
  std::string name, dtypes;
  std::vector<Out> outs;
  std::vector<Case> cases;
};

// One table entry: shape cases of the op's own parameter struct P, each run as run(case, rng).
template <class P>
Op op(std::string name, std::string dtypes, std::vector<Out> outs, std::vector<std::pair<std::string, P>> cases,
      Errs (*run)(const P&, std::mt19937&)) {
  Op o{std::move(name), std::move(dtypes), std::move(outs), {}};
  for (auto& [n, p] : cases) o.cases.push_back({n, [p = p, run](std::mt19937& rng) { return run(p, rng); }});
  return o;
}

// ---- error metrics ---------------------------------------------------------------------------------------------

double elem_err(const std::vector<float>& got, const std::vector<float>& ref) {
  if (got.size() != ref.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    worst = std::max(worst, std::fabs(double(got[i]) - ref[i]) / (std::fabs(double(ref[i])) + 0.1));
  }
  return worst;
}

template <class T>
double mismatches(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return INFINITY;
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return double(n);
}

double max_rel(const float* got, const float* ref, size_t n) { return compare(got, ref, n).max_rel; }

std::vector<int> shuffled(int n, std::mt19937& rng) {
  std::vector<int> v(n);
  std::iota(v.begin(), v.end(), 0);
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

// ---- kernels/cuda/ops.h ----------------------------------------------------------------------------------------

struct EmbedP {
  int T, H, V;  // tokens, hidden size, vocabulary
};
Errs run_embed_gather(const EmbedP& p, std::mt19937& rng) {
  std::vector<float> ef;
  const auto emb = random_bf16(rng, size_t(p.V) * p.H, 1.f, ef);
  std::uniform_int_distribution<int> u(0, p.V - 1);
  std::vector<int32_t> ids(p.T);
  for (auto& i : ids) i = u(rng);
  ids[0] = p.V - 1;
  std::vector<float> ref(size_t(p.T) * p.H);
  for (int t = 0; t < p.T; ++t) std::copy_n(&ef[size_t(ids[t]) * p.H], p.H, &ref[size_t(t) * p.H]);
  DeviceBuffer<bf16> de(emb);
  DeviceBuffer<int32_t> di(ids);
  DeviceBuffer<float> dx(ref.size());
  dx.poison();
  gpu::embed_gather(p.T, p.H, di.get(), de.get(), dx.get());
  return {mismatches(dx.download(), ref)};
}

struct NormP {
  int rows, dim, ldx_pad;
  bool index;  // rows picked by a row index (the last, the first, every third)
};
Errs run_rms_norm_residual(const NormP& p, std::mt19937& rng) {
  const long ldx = p.dim + p.ldx_pad;
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<float> x(size_t(p.rows) * ldx), wf;
  for (auto& v : x) v = nd(rng);
  const auto w = random_bf16(rng, p.dim, 0.1f, wf);
  std::vector<int> idx(p.rows);
  std::iota(idx.begin(), idx.end(), 0);
  if (p.index) {
    idx = {p.rows - 1, 0};
    for (int r = 1; r < p.rows - 1; r += 3) idx.push_back(r);
  }
  const int n = int(idx.size());
  std::vector<float> ref(size_t(n) * p.dim);
  for (int r = 0; r < n; ++r)
    cpu::rms_norm_zero_centred(1, p.dim, &x[size_t(idx[r]) * ldx], wf.data(), 1e-6f, &ref[size_t(r) * p.dim]);
  DeviceBuffer<float> dx(x);
  DeviceBuffer<bf16> dw(w), dy(ref.size());
  DeviceBuffer<int> di(idx);
  dy.poison();
  gpu::rms_norm_residual(n, p.dim, dx.get(), ldx, p.index ? di.get() : nullptr, dw.get(), 1e-6f, dy.get());
  return {elem_err(to_float(dy.download()), ref)};
}

struct RowsP {
  int rows, dim;
  bool vec = false;  // the 16-byte kernel (HYPIC_NORM_GATED_VEC on; dims 32 .. 256, multiples of 8), else the default
};
Errs run_rms_norm_gated(const RowsP& p, std::mt19937& rng) {
  ScopedCandidate sw("HYPIC_NORM_GATED_VEC", p.vec);
  const size_t n = size_t(p.rows) * p.dim;
  std::vector<float> xf, zf, wf;
  const auto x = random_bf16(rng, n, 1.f, xf), z = random_bf16(rng, n, 1.f, zf), w = random_bf16(rng, p.dim, 1.f, wf);
  std::vector<float> ref(n);
  cpu::rms_norm_gated(p.rows, p.dim, xf.data(), zf.data(), wf.data(), 1e-6f, ref.data());
  DeviceBuffer<bf16> dx(x), dz(z), dw(w);
  gpu::rms_norm_gated(p.rows, p.dim, dx.get(), dz.get(), dw.get(), 1e-6f, dx.get());  // in place, as the engine
  return {elem_err(to_float(dx.download()), ref)};
}

struct GatherP {
  int src_rows, n, width;
};
Errs run_gather_rows(const GatherP& p, std::mt19937& rng) {
  std::vector<float> f;
  const auto src = random_bf16(rng, size_t(p.src_rows) * p.width, 1.f, f);
  std::uniform_int_distribution<int> u(0, p.src_rows - 1);
  std::vector<int> rows(p.n);
  for (auto& r : rows) r = u(rng);
  rows[0] = p.src_rows - 1;
  std::vector<bf16> ref;
  for (int r : rows) ref.insert(ref.end(), src.begin() + size_t(r) * p.width, src.begin() + size_t(r + 1) * p.width);
  DeviceBuffer<bf16> ds(src), dd(ref.size());
  DeviceBuffer<int> dr(rows);
  dd.poison();
  gpu::gather_rows(p.n, p.width, ds.get(), dr.get(), dd.get());
  return {mismatches(dd.download(), ref)};
}

struct CopyP {
  std::vector<int> floats;  // length of each copy in floats
  int misalign;             // 1: each copy's source and destination 4 (dst 8) bytes further (the 4-byte path)
};
Errs run_batched_copy(const CopyP& p, std::mt19937& rng) {
  long total = 0;
  for (int n : p.floats) total += n + 8;
  std::vector<float> src(total), ref(total, 0.f);
  std::normal_distribution<float> nd;
  for (auto& x : src) x = nd(rng);
  DeviceBuffer<float> ds(src), dd(ref.size());
  dd.poison(0);
  std::vector<gpu::CopyDesc> descs;
  long so = 0, dof = 0;
  for (int n : p.floats) {
    so += p.misalign, dof += 2 * p.misalign;
    descs.push_back({ds.get() + so, dd.get() + dof, 4L * n});
    std::copy_n(&src[so], n, &ref[dof]);
    so += n, dof += n + 4;  // 4 floats between destinations must stay 0
  }
  DeviceBuffer<gpu::CopyDesc> dc(descs);
  gpu::batched_copy(int(descs.size()), dc.get());
  return {mismatches(dd.download(), ref)};
}

// Step s of every chain: T the identity (nullptr) when s % 3 == 2, S zero (nullptr) when s % 4 == 3, alpha -0.5 at
// s == 1 (else 1), the running state written out after step 1; chain 1 starts from zero (no init).
struct ChainP {
  int chains, heads, steps;
};
Errs run_affine_chain(const ChainP& p, std::mt19937& rng) {
  const size_t DD = size_t(D) * D, M = DD * p.heads;
  std::normal_distribution<float> nd(0.f, 1.f / D);
  auto rnd = [&](bool near_identity) {
    std::vector<float> v(M);
    for (auto& x : v) x = nd(rng);
    if (near_identity)  // I + noise keeps the norms O(1) over the steps
      for (size_t h = 0; h < M; h += DD)
        for (int i = 0; i < D; ++i) v[h + size_t(i) * (D + 1)] += 1.f;
    return v;
  };
  // R <- alpha (T R) + S in double.
  auto step_ref = [&](std::vector<double>& R, const float* T, const float* S, double alpha) {
    std::vector<double> nR(M, 0.0);
    for (size_t b = 0; b < M; b += DD)
      for (int i = 0; i < D; ++i) {
        double* o = &nR[b + size_t(i) * D];
        if (!T) std::copy_n(&R[b + size_t(i) * D], D, o);
        else
          for (int k = 0; k < D; ++k) {
            const double t = T[b + size_t(i) * D + k];
            const double* r = &R[b + size_t(k) * D];
            for (int j = 0; j < D; ++j) o[j] += t * r[j];
          }
        for (int j = 0; j < D; ++j) o[j] = alpha * o[j] + (S ? double(S[b + size_t(i) * D + j]) : 0.0);
      }
    R.swap(nR);
  };
  std::vector<DeviceBuffer<float>> mats, fin, outs;  // moves keep the device pointers
  std::vector<gpu::AffineStep> steps;
  std::vector<const float*> init;
  std::vector<float*> fin_p;
  std::vector<std::vector<float>> ref_fin, ref_out;
  for (int c = 0; c < p.chains; ++c) {
    std::vector<double> R(M, 0.0);
    if (c == 1) {
      init.push_back(nullptr);
    } else {
      const auto R0 = rnd(false);
      R.assign(R0.begin(), R0.end());
      mats.emplace_back(R0);
      init.push_back(mats.back().get());
    }
    fin.emplace_back(M);
    fin_p.push_back(fin.back().get());
    outs.emplace_back(M);
    for (int s = 0; s < p.steps; ++s) {
      const auto T = rnd(true), S = rnd(false);
      gpu::AffineStep st;
      const bool t_id = s % 3 == 2, s_zero = s % 4 == 3;
      if (!t_id) mats.emplace_back(T), st.T = mats.back().get();
      if (!s_zero) mats.emplace_back(S), st.S = mats.back().get();
      st.alpha = s == 1 ? -0.5f : 1.f;
      st.out = s == 1 ? outs.back().get() : nullptr;
      steps.push_back(st);
      step_ref(R, t_id ? nullptr : T.data(), s_zero ? nullptr : S.data(), st.alpha);
      if (s == 1) ref_out.emplace_back(R.begin(), R.end());
    }
    ref_fin.emplace_back(R.begin(), R.end());
  }
  DeviceBuffer<gpu::AffineStep> dsteps(steps);
  DeviceBuffer<const float*> dinit(init);
  DeviceBuffer<float*> dfin(fin_p);
  gpu::affine_chain(p.chains, p.heads, p.steps, dsteps.get(), dinit.get(), dfin.get());
  double ef = 0, eo = 0;
  for (int c = 0; c < p.chains; ++c) {
    ef = std::max(ef, rel_err(fin[c].download().data(), ref_fin[c].data(), M));
    if (p.steps > 1) eo = std::max(eo, rel_err(outs[c].download().data(), ref_out[c].data(), M));
  }
  return {ef, eo};
}

// ---- kernels/cuda/moe.h silu_mul -------------------------------------------------------------------------------

struct SiluP {
  int T, I;
};
Errs run_silu_mul(const SiluP& p, std::mt19937& rng) {
  std::vector<float> f;
  const auto gu = random_bf16(rng, size_t(p.T) * 2 * p.I, 2.f, f);
  std::vector<float> ref(size_t(p.T) * p.I);
  for (int t = 0; t < p.T; ++t)
    for (int j = 0; j < p.I; ++j)
      ref[size_t(t) * p.I + j] = cpu::silu(f[size_t(t) * 2 * p.I + j]) * f[size_t(t) * 2 * p.I + p.I + j];
  DeviceBuffer<bf16> dgu(gu), dact(ref.size());
  dact.poison();
  gpu::silu_mul(p.T, p.I, dgu.get(), dact.get(), nullptr);
  return {elem_err(to_float(dact.download()), ref)};
}

// ---- kernels/cuda/gated_delta.h: conv1d + SiLU, gated delta rule -----------------------------------------------

struct ConvP {
  std::vector<int> lens;  // tokens per sequence
  int C, K;
  bool history;  // conv_state given (the K-1 inputs before each sequence; the tail written back), else nullptr
  int qd = 0;    // > 0: the output split into q, k [T][qd] and v [T][C - 2 qd] (ConvQkvOut), else whole [T][C]
  bool narrow = false;  // the 4-channel kernel with the approximate SiLU division (HYPIC_CONV_NARROW on)
};

// The [T][C] rows of a [Q | K | V] output split into q, k [T][qd] and v [T][C - 2 qd], joined back.
std::vector<float> join_qkv(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                            int T, int C, int qd) {
  std::vector<float> y(size_t(T) * C);
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c)
      y[size_t(t) * C + c] = c < qd ? q[size_t(t) * qd + c] : c < 2 * qd ? k[size_t(t) * qd + c - qd]
                                                                        : v[size_t(t) * (C - 2 * qd) + c - 2 * qd];
  return y;
}
Errs run_conv1d_prefill(const ConvP& p, std::mt19937& rng) {
  ScopedCandidate sw("HYPIC_CONV_NARROW", p.narrow);
  const int n = int(p.lens.size()), KC = (p.K - 1) * p.C;
  std::vector<int> cu(n + 1, 0);
  for (int s = 0; s < n; ++s) cu[s + 1] = cu[s] + p.lens[s];
  const int T = cu[n];
  std::vector<float> xf, wf, sf;
  const auto x = random_bf16(rng, size_t(T) * p.C, 1.f, xf);
  const auto w = random_bf16(rng, size_t(p.C) * p.K, 0.5f, wf);
  const auto st = random_bf16(rng, size_t(n) * KC, 1.f, sf);
  std::vector<float> ref(size_t(T) * p.C), tail(size_t(n) * KC, 0.f);
  if (p.history) tail = sf;
  for (int s = 0; s < n; ++s)
    cpu::causal_conv1d_silu(p.lens[s], p.C, p.K, xf.data() + size_t(cu[s]) * p.C, wf.data(),
                            tail.data() + size_t(s) * KC, ref.data() + size_t(cu[s]) * p.C);
  DeviceBuffer<int> dcu(cu);
  DeviceBuffer<bf16> dx(x), dw(w), ds(st), dy(ref.size());
  dy.poison();
  std::vector<float> y;
  if (p.qd > 0) {
    DeviceBuffer<bf16> dq(size_t(T) * p.qd), dk(size_t(T) * p.qd), dv(size_t(T) * (p.C - 2 * p.qd));
    dq.poison(), dk.poison(), dv.poison();
    gpu::conv1d_silu_prefill(n, dcu.get(), T, p.C, p.K, dx.get(), dw.get(), p.history ? ds.get() : nullptr,
                             gpu::ConvQkvOut{dq.get(), dk.get(), dv.get(), p.qd});
    y = join_qkv(to_float(dq.download()), to_float(dk.download()), to_float(dv.download()), T, p.C, p.qd);
  } else {
    gpu::conv1d_silu_prefill(n, dcu.get(), T, p.C, p.K, dx.get(), dw.get(), p.history ? ds.get() : nullptr, dy.get());
    y = to_float(dy.download());
  }
  return {elem_err(y, ref), p.history ? mismatches(to_float(ds.download()), tail) : 0.0};
}

struct ConvDecP {
  int B, C, K;
  bool slots;  // states in a pool of 2B + 1 slots, request b at a shuffled slot (state_slots), else [B]
  int qd = 0;  // > 0: the output split into q, k, v (ConvQkvOut), else whole
};
Errs run_conv1d_decode(const ConvDecP& p, std::mt19937& rng) {
  const int KC = (p.K - 1) * p.C, pool = p.slots ? 2 * p.B + 1 : p.B;
  std::vector<int> slot = shuffled(pool, rng);
  if (!p.slots) std::iota(slot.begin(), slot.end(), 0);
  slot.resize(p.B);
  std::vector<float> xf, wf, sf;
  const auto x = random_bf16(rng, size_t(p.B) * p.C, 1.f, xf);
  const auto w = random_bf16(rng, size_t(p.C) * p.K, 0.5f, wf);
  const auto st = random_bf16(rng, size_t(pool) * KC, 1.f, sf);
  std::vector<float> ref(xf.size()), ref_st = sf;
  for (int b = 0; b < p.B; ++b)
    cpu::causal_conv1d_silu(1, p.C, p.K, &xf[size_t(b) * p.C], wf.data(), &ref_st[size_t(slot[b]) * KC],
                            &ref[size_t(b) * p.C]);
  DeviceBuffer<bf16> dx(x), dw(w), ds(st), dy(ref.size());
  DeviceBuffer<int> dslot(slot);
  dy.poison();
  std::vector<float> y;
  if (p.qd > 0) {
    DeviceBuffer<bf16> dq(size_t(p.B) * p.qd), dk(size_t(p.B) * p.qd), dv(size_t(p.B) * (p.C - 2 * p.qd));
    dq.poison(), dk.poison(), dv.poison();
    gpu::conv1d_silu_decode(p.B, p.C, p.K, dx.get(), dw.get(), ds.get(),
                            gpu::ConvQkvOut{dq.get(), dk.get(), dv.get(), p.qd}, nullptr,
                            p.slots ? dslot.get() : nullptr);
    y = join_qkv(to_float(dq.download()), to_float(dk.download()), to_float(dv.download()), p.B, p.C, p.qd);
  } else {
    gpu::conv1d_silu_decode(p.B, p.C, p.K, dx.get(), dw.get(), ds.get(), dy.get(), nullptr,
                            p.slots ? dslot.get() : nullptr);
    y = to_float(dy.download());
  }
  return {elem_err(y, ref), mismatches(to_float(ds.download()), ref_st)};
}

// Gated DeltaNet inputs as the engine hands them over (raw q, k, v and the gate inputs a, b in bf16; A_log, dt_bias
// fp32) and the CPU reference's view of them: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) in fp32 (HF
// Qwen3NextGatedDeltaNet), q and k l2-normalised (q times scale), rounded to bf16 when `round` (the prefill rounds
// them for its tensor-core products; a token's output (q.k) b v has an unbounded relative error otherwise when q.k
// nearly cancels). Decays: mostly slow, a few a = 24 (softplus's linear branch beyond 20) strong, so that T_C over
// a few hundred tokens stays far from fp32 underflow.
struct GdnInputs {
  std::vector<bf16> q, k, v, a, b;
  std::vector<float> vf, A_log, dt_bias, g, beta, qn, kn;
  GdnInputs(std::mt19937& rng, int T, int hk, int hv, float scale, bool round) {
    std::vector<float> af, bfv;
    q = random_bf16(rng, size_t(T) * hk * D, 1.f, qn);
    k = random_bf16(rng, size_t(T) * hk * D, 1.f, kn);
    v = random_bf16(rng, size_t(T) * hv * D, 1.f, vf);
    a = random_bf16(rng, size_t(T) * hv, 1.f, af);
    b = random_bf16(rng, size_t(T) * hv, 1.5f, bfv);
    for (size_t i = 0; i < a.size(); i += 61) a[i] = float_to_bf16(24.f), af[i] = 24.f;
    std::uniform_real_distribution<float> u(0.005f, 0.03f);
    std::normal_distribution<float> nd;
    for (int h = 0; h < hv; ++h) A_log.push_back(std::log(u(rng))), dt_bias.push_back(nd(rng));
    g.resize(af.size()), beta.resize(af.size());
    for (size_t i = 0; i < af.size(); ++i) {
      g[i] = -std::exp(A_log[i % hv]) * cpu::softplus(af[i] + dt_bias[i % hv]);
      beta[i] = cpu::sigmoid(bfv[i]);
    }
    cpu::l2_normalize_rows(int64_t(T) * hk, D, qn.data());
    cpu::l2_normalize_rows(int64_t(T) * hk, D, kn.data());
    for (auto& x : qn) x *= scale;
    if (round)
      for (auto* vec : {&qn, &kn})
        for (auto& x : *vec) x = bfr(x);
  }
  // The CPU reference's inputs of token t.
  cpu::GatedDeltaInputs at(int t, int hk, int hv) const {
    return {qn.data() + size_t(t) * hk * D, kn.data() + size_t(t) * hk * D, vf.data() + size_t(t) * hv * D,
            g.data() + size_t(t) * hv, beta.data() + size_t(t) * hv};
  }
};

struct GdnP {
  std::vector<int> lens;  // tokens per sequence (the varlen batch)
  int hk, hv;             // key / value heads
  bool initial;           // random initial states (else none: zero)
};
// As the engine calls it: fused gates, q/k l2 norm in the kernel, final state in place of the initial one, T_C.
Errs run_gdn_prefill(const GdnP& p, std::mt19937& rng) {
  const int n = int(p.lens.size());
  std::vector<int> cu(n + 1, 0);
  for (int s = 0; s < n; ++s) cu[s + 1] = cu[s] + p.lens[s];
  const int T = cu[n];
  const float scale = 1.f / std::sqrt(float(D));
  const GdnInputs in(rng, T, p.hk, p.hv, scale, true);
  const size_t DD = size_t(D) * D, SS = DD * p.hv;
  std::vector<float> init(n * SS, 0.f);
  std::normal_distribution<float> nd(0.f, 0.3f);
  if (p.initial)
    for (auto& x : init) x = nd(rng);
  DeviceBuffer<bf16> dq(in.q), dk(in.k), dv(in.v), da(in.a), db(in.b), dout(size_t(T) * p.hv * D);
  DeviceBuffer<float> dal(in.A_log), ddt(in.dt_bias), dst(init), dtr(n * SS);
  dout.poison(), dtr.poison();
  gpu::GdnPrefillArgs a;
  a.num_seqs = n, a.cu_seqlens_host = cu.data(), a.num_k_heads = p.hk, a.num_v_heads = p.hv;
  a.q = dq.get(), a.k = dk.get(), a.v = dv.get();
  a.gate_a = da.get(), a.gate_b = db.get(), a.A_log = dal.get(), a.dt_bias = ddt.get();
  a.l2norm_qk = true, a.scale = scale;
  a.initial_state = p.initial ? dst.get() : nullptr, a.final_state = dst.get();
  a.transition = dtr.get(), a.out = dout.get();
  gpu::GdnWorkspace ws;
  gpu::gdn_prefill(a, ws);
  const auto out = to_float(dout.download()), fin = dst.download(), tr = dtr.download();
  double eo = 0, es = 0, et = 0;
  for (int s = 0; s < n; ++s) {
    const int L = p.lens[s];
    std::vector<float> state(init.begin() + s * SS, init.begin() + (s + 1) * SS), ro(size_t(L) * p.hv * D), rt(SS);
    cpu::gated_delta_recurrent({L, p.hk, p.hv, D, D}, in.at(cu[s], p.hk, p.hv), state.data(), ro.data(), rt.data());
    for (int h = 0; h < p.hv; ++h) {
      es = std::max(es, rel_err(&fin[s * SS + h * DD], &state[h * DD], DD));
      et = std::max(et, rel_err(&tr[s * SS + h * DD], &rt[h * DD], DD));
      std::vector<float> go(size_t(L) * D), rh(go.size());
      for (int t = 0; t < L; ++t) {
        std::copy_n(&out[(size_t(cu[s] + t) * p.hv + h) * D], D, &go[size_t(t) * D]);
        std::copy_n(&ro[(size_t(t) * p.hv + h) * D], D, &rh[size_t(t) * D]);
      }
      if (L) eo = std::max(eo, rel_err(go.data(), rh.data(), go.size()));
    }
  }
  return {eo, es, et};
}

struct GdnDecP {
  int B, hk, hv;
  bool slots;  // states in a pool of B + 3 slots, request b at a shuffled slot (state_slots)
};
// As the engine calls it: gates fused, q/k l2 norm in the kernel.
Errs run_gdn_decode(const GdnDecP& p, std::mt19937& rng) {
  const float scale = 1.f / std::sqrt(float(D));
  const GdnInputs in(rng, p.B, p.hk, p.hv, scale, false);
  const size_t DD = size_t(D) * D, SS = DD * p.hv;
  const int pool = p.slots ? p.B + 3 : p.B;
  std::vector<int> slot = shuffled(pool, rng);
  if (!p.slots) std::iota(slot.begin(), slot.end(), 0);
  slot.resize(p.B);
  std::vector<float> st(pool * SS);
  std::normal_distribution<float> nd(0.f, 0.5f);
  for (auto& x : st) x = nd(rng);
  std::vector<float> ref = st, ro(size_t(p.B) * p.hv * D);
  for (int b = 0; b < p.B; ++b)
    cpu::gated_delta_recurrent({1, p.hk, p.hv, D, D}, in.at(b, p.hk, p.hv), &ref[slot[b] * SS], &ro[b * p.hv * D],
                               nullptr);
  DeviceBuffer<bf16> dq(in.q), dk(in.k), dv(in.v), da(in.a), db(in.b), dout(ro.size());
  DeviceBuffer<float> dal(in.A_log), ddt(in.dt_bias), dst(st);
  DeviceBuffer<int> dslot(slot);
  dout.poison();
  gpu::gdn_decode_gated(p.B, p.hk, p.hv, dq.get(), dk.get(), dv.get(), da.get(), db.get(), dal.get(), ddt.get(), true,
                        scale, dst.get(), dout.get(), nullptr, p.slots ? dslot.get() : nullptr);
  const auto out = to_float(dout.download()), got = dst.download();
  double eo = 0, es = 0;
  for (int b = 0; b < p.B; ++b) eo = std::max(eo, rel_err(&out[b * p.hv * D], &ro[b * p.hv * D], size_t(p.hv) * D));
  for (int s = 0; s < pool; ++s) es = std::max(es, rel_err(&got[s * SS], &ref[s * SS], SS));  // untouched slots: 0
  return {eo, es};
}

// ---- kernels/cuda/attention.h ----------------------------------------------------------------------------------

// attention_prepare's reference for one q or k head row: zero-centred RMSNorm (fp32) rounded to bf16, then RoPE at
// pos in fp32 rounded to bf16 (the kernel's two rounding points).
void prepare_ref(const float* x, const std::vector<float>& w, int hd, const std::vector<float>& inv, int pos,
                 float* y) {
  cpu::rms_norm_zero_centred(1, hd, x, w.data(), 1e-6f, y);
  for (int d = 0; d < hd; ++d) y[d] = bfr(y[d]);
  if (inv.empty()) return;
  cpu::apply_rope(y, 1, 1, hd, inv, pos);
  for (int d = 0; d < hd; ++d) y[d] = bfr(y[d]);
}

struct PrepareP {
  int T, nh, nkv, hd, rot;
  bool gate;         // q_proj output holds a gate after each head's query (HF attn_output_gate)
  int stride_extra;  // k and v interleaved in one buffer, row stride 2 nkv hd + stride_extra
  int max_pos;       // positions in [0, max_pos); the first 0, the last max_pos - 1
};
Errs run_attention_prepare(const PrepareP& c, std::mt19937& rng) {
  const int qhs = (c.gate ? 2 : 1) * c.hd;
  const long kvs = 2L * c.nkv * c.hd + c.stride_extra;
  std::vector<float> qgf, kvf, qwf, kwf;
  const auto qg = random_bf16(rng, size_t(c.T) * c.nh * qhs, 1.5f, qgf);
  const auto kv = random_bf16(rng, size_t(c.T) * kvs + 8, 1.5f, kvf);
  const auto qw = random_bf16(rng, c.hd, 0.3f, qwf), kw = random_bf16(rng, c.hd, 0.3f, kwf);
  std::uniform_int_distribution<int> upos(0, c.max_pos - 1);
  std::vector<int> pos(c.T);
  for (auto& x : pos) x = upos(rng);
  pos[0] = 0, pos[c.T - 1] = c.max_pos - 1;
  const auto inv = c.rot ? cpu::rope_inv_freq(1e7, c.rot) : std::vector<float>{};
  const int pages = (c.T + kPage - 1) / kPage + 2;
  std::vector<int> rows = shuffled(pages * kPage, rng);
  rows.resize(c.T);
  const size_t row = size_t(c.nkv) * c.hd, pool_elems = size_t(pages) * kPage * row;
  DeviceBuffer<bf16> dqg(qg), dkv(kv), dqw(qw), dkw(kw), dq(size_t(c.T) * c.nh * c.hd), dk(pool_elems),
      dv(pool_elems);
  DeviceBuffer<int> dpos(pos), drows(rows);
  DeviceBuffer<float> dinv(inv.empty() ? std::vector<float>{0.f} : inv);
  dq.poison(), dk.poison(), dv.poison();
  gpu::attention_prepare(c.T, c.nh, c.nkv, c.hd, c.rot, c.gate, dqg.get(), dkv.get(), dkv.get() + row, kvs, dqw.get(),
                         dkw.get(), 1e-6f, dpos.get(), c.rot ? dinv.get() : nullptr, drows.get(), dq.get(), dk.get(),
                         dv.get());
  const auto q = to_float(dq.download());
  const auto k = dk.download(), v = dv.download();
  double eq = 0, ek = 0, ev = 0;
  std::vector<float> y(c.hd), got(c.hd);
  std::vector<char> written(size_t(pages) * kPage, 0);
  for (int t = 0; t < c.T; ++t) {
    written[rows[t]] = 1;
    for (int h = 0; h < c.nh; ++h) {
      prepare_ref(&qgf[(size_t(t) * c.nh + h) * qhs], qwf, c.hd, inv, pos[t], y.data());
      eq = std::max(eq, max_rel(&q[(size_t(t) * c.nh + h) * c.hd], y.data(), c.hd));
    }
    for (int h = 0; h < c.nkv; ++h) {
      prepare_ref(&kvf[size_t(t) * kvs + size_t(h) * c.hd], kwf, c.hd, inv, pos[t], y.data());
      const size_t dst = size_t(rows[t]) * row + size_t(h) * c.hd;
      for (int d = 0; d < c.hd; ++d) got[d] = bf16_to_float(k[dst + d]);
      ek = std::max(ek, max_rel(got.data(), y.data(), c.hd));
      for (int d = 0; d < c.hd; ++d) ev += bits(v[dst + d]) != bits(kv[size_t(t) * kvs + row + size_t(h) * c.hd + d]);
    }
  }
  for (size_t r = 0; r < written.size(); ++r)  // no other pool row written
    for (size_t e = 0; e < row && !written[r]; ++e)
      ev += bits(k[r * row + e]) != 0xFFFF || bits(v[r * row + e]) != 0xFFFF;
  return {eq, ek, ev};
}

struct ImportP {
  int n, nkv, hd, rot;
};
// Cached rows in runs of 0..9 consecutive source rows (empty and one-row runs included), the runs' order shuffled, each
// run re-rotated by its delta in [-5000, 5000] (every fifth 0: K copied bit for bit), to shuffled pool rows.
Errs run_kv_import(const ImportP& c, std::mt19937& rng) {
  const size_t row = size_t(c.nkv) * c.hd;
  std::vector<float> kf, vf;
  const auto kh = random_bf16(rng, size_t(c.n) * row, 1.f, kf), vh = random_bf16(rng, size_t(c.n) * row, 1.f, vf);
  std::vector<std::pair<int, int>> runs;  // (first source row, length), in source order
  std::uniform_int_distribution<int> len_d(0, 9);
  for (int at = 0; at < c.n;) {
    const int len = std::min(len_d(rng), c.n - at);
    runs.push_back({at, len});
    at += len;
  }
  std::shuffle(runs.begin(), runs.end(), rng);
  std::uniform_int_distribution<int> ud(-5000, 5000);
  std::vector<int> run_start{0}, deltas, src;  // src: each import row's source row
  for (size_t r = 0; r < runs.size(); ++r) {
    for (int j = 0; j < runs[r].second; ++j) src.push_back(runs[r].first + j);
    run_start.push_back(int(src.size()));
    deltas.push_back(r % 5 == 0 ? 0 : ud(rng));
  }
  const int pages = (c.n + kPage - 1) / kPage + 1;
  std::vector<int> rows = shuffled(pages * kPage, rng);
  rows.resize(c.n);
  const auto inv = c.rot ? cpu::rope_inv_freq(1e7, c.rot) : std::vector<float>{};
  DeviceBuffer<bf16> dks(kh), dvs(vh), dk(size_t(pages) * kPage * row), dv(dk.size());
  dk.poison(), dv.poison();
  std::vector<const bf16*> kp, vp;
  for (const auto& r : runs) kp.push_back(dks.get() + r.first * row), vp.push_back(dvs.get() + r.first * row);
  DeviceBuffer<const bf16*> dkp(kp), dvp(vp);
  DeviceBuffer<int> dstart(run_start), ddel(deltas), drows(rows);
  DeviceBuffer<float> dinv(inv.empty() ? std::vector<float>{0.f} : inv);
  gpu::kv_import(c.n, int(runs.size()), c.nkv, c.hd, c.rot, dstart.get(), dkp.get(), dvp.get(), ddel.get(),
                 c.rot ? dinv.get() : nullptr, drows.get(), dk.get(), dv.get());
  const auto k = to_float(dk.download());
  const auto v = dv.download();
  double ek = 0, ev = 0;
  std::vector<float> y(row);
  for (size_t r = 0; r < runs.size(); ++r)
    for (int i = run_start[r]; i < run_start[r + 1]; ++i) {
      std::copy_n(&kf[src[i] * row], row, y.begin());
      if (c.rot) cpu::apply_rope_uniform(y.data(), 1, c.nkv, c.hd, inv, deltas[r]);
      for (auto& x : y) x = bfr(x);
      for (int h = 0; h < c.nkv; ++h) ek = std::max(ek, max_rel(&k[rows[i] * row + h * c.hd], &y[h * c.hd], c.hd));
      for (size_t e = 0; e < row; ++e) ev += bits(v[rows[i] * row + e]) != bits(vh[src[i] * row + e]);
    }
  return {ek, ev};
}

struct AttnP {
  int hd, nh, nkv;
  bool gate;     // output gate in the HF q_proj layout [T][nh][2 hd] (gate after each head's query), as the engine
  bool one_seq;  // every group on one sequence (the seam windows of a splice), else one sequence per group
  std::vector<std::pair<int, int>> groups;  // (queries, slot0); decode: (1, context - 1)
};
// The KV of each sequence in a paged pool (pages shuffled, unwritten rows NaN); per group, CPU attention_causal over
// the sequence's first slot0 + len slots, times sigmoid(gate).
Errs run_attention(const AttnP& c, std::mt19937& rng, bool decode) {
  const int G = int(c.groups.size());
  std::vector<int> kv_len, seq_of(G);
  for (int g = 0; g < G; ++g) {
    const int need = c.groups[g].first + c.groups[g].second;
    if (!c.one_seq || kv_len.empty()) kv_len.push_back(0);
    seq_of[g] = int(kv_len.size()) - 1;
    kv_len.back() = std::max(kv_len.back(), need);
  }
  int pages = 3, max_pages = 0;
  for (int k : kv_len) pages += (k + kPage - 1) / kPage, max_pages = std::max(max_pages, (k + kPage - 1) / kPage);
  HostPool pool(pages, c.nkv, c.hd, rng);
  std::vector<Seq> seqs;
  for (int k : kv_len) seqs.push_back(make_seq(pool, k, rng));
  std::vector<int> q_start(G + 1, 0), slot0(G), bt(size_t(G) * max_pages, -1);
  int max_q = 0, max_kv = 0;
  for (int g = 0; g < G; ++g) {
    const auto [len, s0] = c.groups[g];
    q_start[g + 1] = q_start[g] + len, slot0[g] = s0;
    max_q = std::max(max_q, len), max_kv = std::max(max_kv, s0 + len);
    std::copy(seqs[seq_of[g]].pages.begin(), seqs[seq_of[g]].pages.end(), bt.begin() + size_t(g) * max_pages);
  }
  const int TQ = q_start[G];
  const size_t qrow = size_t(c.nh) * c.hd;
  std::vector<float> qf, qgf;
  const auto q = random_bf16(rng, TQ * qrow, 1.f, qf);
  const auto qg = random_bf16(rng, 2 * TQ * qrow, 2.f, qgf);
  DeviceBuffer<bf16> dk(pool.k), dv(pool.v), dq(q), dqg(qg), dout(TQ * qrow);
  DeviceBuffer<int> dqs(q_start), ds0(slot0), dbt(bt);
  dout.poison();
  const gpu::AttnGroups groups{G, dqs.get(), ds0.get(), dbt.get(), max_pages, TQ, max_q, max_kv};
  const float scale = 1.f / std::sqrt(float(c.hd));
  const bf16* gate = c.gate ? dqg.get() + c.hd : nullptr;
  gpu::AttnDecodeWorkspace ws;
  if (decode)
    gpu::attention_decode(groups, c.nh, c.nkv, c.hd, dq.get(), dk.get(), dv.get(), scale, gate, long(c.nh) * 2 * c.hd,
                          2 * c.hd, dout.get(), ws);
  else
    gpu::attention_prefill(groups, c.nh, c.nkv, c.hd, dq.get(), dk.get(), dv.get(), scale, gate, long(c.nh) * 2 * c.hd,
                           2 * c.hd, dout.get(), ws);
  const auto out = to_float(dout.download());
  double err = 0;
  for (int g = 0; g < G; ++g) {
    const auto [len, s0] = c.groups[g];
    std::vector<float> ref(size_t(len) * qrow);
    cpu::attention_causal({len, s0 + len, c.nh, c.nkv, c.hd}, &qf[q_start[g] * qrow], seqs[seq_of[g]].k.data(),
                          seqs[seq_of[g]].v.data(), scale, ref.data());
    if (c.gate)
      for (size_t i = 0; i < ref.size(); ++i)
        ref[i] *= cpu::sigmoid(qgf[(q_start[g] * size_t(c.nh) + i / c.hd) * 2 * c.hd + c.hd + i % c.hd]);
    err = std::max(err, max_rel(&out[q_start[g] * qrow], ref.data(), ref.size()));
  }
  return {err};
}
Errs run_attention_prefill(const AttnP& c, std::mt19937& rng) { return run_attention(c, rng, false); }
Errs run_attention_decode(const AttnP& c, std::mt19937& rng) { return run_attention(c, rng, true); }

struct MassP {
  int hd, nh, nkv, slot0, tq;  // tq queries at slots slot0 .. slot0 + tq - 1
};
Errs run_key_mass(const MassP& c, std::mt19937& rng) {
  const int n = c.slot0 + c.tq;
  HostPool pool((n + kPage - 1) / kPage + 2, c.nkv, c.hd, rng);
  const Seq s = make_seq(pool, n, rng);
  std::vector<float> qf;
  const auto q = random_bf16(rng, size_t(c.tq) * c.nh * c.hd, 1.f, qf);
  const float scale = 1.f / std::sqrt(float(c.hd));
  std::vector<float> out(qf.size()), want(n, 0.5f);  // the mass is added to what is there
  cpu::attention_causal({c.tq, n, c.nh, c.nkv, c.hd}, qf.data(), s.k.data(), s.v.data(), scale, out.data(),
                        want.data());
  DeviceBuffer<bf16> dk(pool.k), dq(q);
  DeviceBuffer<int> dt(s.pages);
  DeviceBuffer<float> dm(std::vector<float>(n, 0.5f));
  gpu::attention_key_mass(c.tq, c.nh, c.nkv, c.hd, dq.get(), c.slot0, dt.get(), dk.get(), scale, dm.get());
  const auto got = dm.download();
  double e = 0;
  for (int j = 0; j < n; ++j) e = std::isfinite(got[j]) ? std::max(e, double(std::fabs(got[j] - want[j]))) : INFINITY;
  return {e / (double(c.tq) * c.nh)};
}

// ---- kernels/cuda/gemm.h, moe.h ---------------------------------------------------------------------------------

struct GemmP {
  int M, N, K, ldx_pad, ldy_pad;
};
// y = x W^T twice: fp32 y accumulated onto a residual (beta 1) and bf16 y (beta 0), as the engine's projections.
Errs run_linear(const GemmP& p, std::mt19937& rng) {
  const long ldx = p.K + p.ldx_pad, ldy = p.N + p.ldy_pad;
  std::vector<float> xf, wf, y0;
  const auto x = random_bf16(rng, size_t(p.M) * ldx, 1.f, xf);
  const auto w = random_bf16(rng, size_t(p.N) * p.K, 1.f / std::sqrt(float(p.K)), wf);
  random_bf16(rng, size_t(p.M) * ldy, 1.f, y0);
  const size_t n = size_t(p.M) * p.N;
  std::vector<float> xd(size_t(p.M) * p.K), ref(n), base(n);
  for (int m = 0; m < p.M; ++m) {
    std::copy_n(&xf[m * ldx], p.K, &xd[size_t(m) * p.K]);
    std::copy_n(&y0[m * ldy], p.N, &base[size_t(m) * p.N]);
  }
  cpu::linear(p.M, p.K, p.N, xd.data(), wf.data(), ref.data());
  Stream st;
  gpu::GemmRunner g;
  DeviceBuffer<bf16> dx(x), dw(w), dyb(size_t(p.M) * ldy);
  DeviceBuffer<float> dyf(y0);
  dyb.poison();
  g.linear(p.M, p.N, p.K, dx.get(), ldx, dw.get(), dyf.get(), CUDA_R_32F, ldy, 1.f, st.s);
  g.linear(p.M, p.N, p.K, dx.get(), ldx, dw.get(), dyb.get(), CUDA_R_16BF, ldy, 0.f, st.s);
  check_cuda(cudaStreamSynchronize(st.s), "linear");
  const auto hf = dyf.download();
  const auto hb = to_float(dyb.download());
  std::vector<float> gf(n), gb(n);
  for (int m = 0; m < p.M; ++m) {
    std::copy_n(&hf[m * ldy], p.N, &gf[size_t(m) * p.N]);
    std::copy_n(&hb[m * ldy], p.N, &gb[size_t(m) * p.N]);
  }
  return {compare(gf.data(), ref.data(), n, base.data()).max_rel, max_rel(gb.data(), ref.data(), n)};
}

struct ArgmaxP {
  int rows, V, ld_pad;
};
// argmax_rows against a plain loop (largest value, lowest index on ties, -1 - j for a row whose first NaN is at j):
// random rows, plus (when rows >= 4) a row whose maximum occurs three times, an all -inf row and a row with two NaNs.
Errs run_argmax(const ArgmaxP& p, std::mt19937& rng) {
  const long ld = p.V + p.ld_pad;
  std::normal_distribution<float> nd(0.f, 3.f);
  std::vector<float> x(size_t(p.rows) * ld);
  for (float& v : x) v = nd(rng);
  std::uniform_int_distribution<int> col(0, p.V - 1);
  if (p.rows >= 4) {
    float* tie = &x[size_t(1) * ld];
    for (int k = 0; k < 3; ++k) tie[col(rng)] = 100.f;
    std::fill_n(&x[size_t(2) * ld], p.V, -INFINITY);
    x[size_t(3) * ld + col(rng)] = NAN;
    x[size_t(3) * ld + col(rng)] = NAN;
  }
  std::vector<int32_t> want(p.rows);
  for (int r = 0; r < p.rows; ++r) {
    const float* row = &x[size_t(r) * ld];
    int best = 0, first_nan = -1;
    for (int i = 0; i < p.V; ++i) {
      if (std::isnan(row[i]) && first_nan < 0) first_nan = i;
      if (row[i] > row[best]) best = i;
    }
    want[r] = first_nan >= 0 ? -1 - first_nan : best;
  }
  DeviceBuffer<float> dx(x);
  DeviceBuffer<int32_t> dout(size_t(p.rows));
  Stream st;
  // Both paths: one block per row, and a cluster of blocks per row (HYPIC_ARGMAX_CLUSTER, each a slice of the row).
  gpu::CandidateScope cluster("HYPIC_ARGMAX_CLUSTER");
  double bad = 0;
  for (bool on : {false, true}) {
    cluster.set(on);
    dout.poison();
    gpu::argmax_rows(p.rows, p.V, dx.get(), ld, dout.get(), st.s);
    check_cuda(cudaStreamSynchronize(st.s), "argmax_rows");
    bad += mismatches(dout.download(), want);
  }
  return {bad};
}

struct DecLinP {
  int M, K, ldx_pad, ldy_pad;
  std::vector<int> Ns;  // one weight matrix per entry, all sharing x (one launch)
};
// decode_linear: y_i = x W_i^T for 1..4 matrices in one launch, each epilogue (bf16 store, fp32 store, fp32 += a random
// residual), against the CPU fp32 linear; "exact" counts (a) output bits of each token's fp32 result that differ from
// the same token run alone (M = 1: batch invariance, the property decode relies on) and (b) row-padding elements
// (ldy > N) that a launch changed.
Errs run_decode_linear(const DecLinP& p, std::mt19937& rng) {
  const long ldx = p.K + p.ldx_pad;
  const int n_out = int(p.Ns.size());
  std::vector<float> xf;
  const auto x = random_bf16(rng, size_t(p.M) * ldx, 1.f, xf);
  std::vector<float> xd(size_t(p.M) * p.K);
  for (int m = 0; m < p.M; ++m) std::copy_n(&xf[m * ldx], p.K, &xd[size_t(m) * p.K]);
  DeviceBuffer<bf16> dx(x);
  std::vector<DeviceBuffer<bf16>> dw, dyb;
  std::vector<DeviceBuffer<float>> dys, dya;
  std::vector<std::vector<float>> ref(n_out), y0(n_out);
  std::vector<long> ldy(n_out);
  for (int i = 0; i < n_out; ++i) {
    const int N = p.Ns[i];
    ldy[i] = N + p.ldy_pad;
    std::vector<float> wf;
    dw.emplace_back(random_bf16(rng, size_t(N) * p.K, 1.f / std::sqrt(float(p.K)), wf));
    ref[i].resize(size_t(p.M) * N);
    cpu::linear(p.M, p.K, N, xd.data(), wf.data(), ref[i].data());
    random_bf16(rng, size_t(p.M) * ldy[i], 1.f, y0[i]);
    dyb.emplace_back(size_t(p.M) * ldy[i]);
    dyb.back().poison();
    dys.emplace_back(size_t(p.M) * ldy[i]);
    dys.back().poison();
    dya.emplace_back(y0[i]);
  }
  auto outs = [&](int which, int row) {  // 0 bf16, 1 fp32 store, 2 fp32 add; row >= 0: that token's row only
    std::vector<gpu::DecodeLinearOutput> o(n_out);
    for (int i = 0; i < n_out; ++i) {
      void* y = which == 0 ? static_cast<void*>(dyb[i].get()) : which == 1 ? static_cast<void*>(dys[i].get())
                                                                            : static_cast<void*>(dya[i].get());
      if (row >= 0) y = static_cast<char*>(y) + size_t(row) * ldy[i] * (which == 0 ? 2 : 4);
      o[i] = {dw[i].get(), p.Ns[i], y, ldy[i]};
    }
    return o;
  };
  Stream st;
  using E = gpu::DecodeLinearEpilogue;
  const auto ob = outs(0, -1), os = outs(1, -1), oa = outs(2, -1);
  gpu::decode_linear(p.M, p.K, dx.get(), ldx, ob.data(), n_out, E::StoreBf16, st.s);
  gpu::decode_linear(p.M, p.K, dx.get(), ldx, os.data(), n_out, E::StoreF32, st.s);
  gpu::decode_linear(p.M, p.K, dx.get(), ldx, oa.data(), n_out, E::AddF32, st.s);
  check_cuda(cudaStreamSynchronize(st.s), "decode_linear");
  std::vector<std::vector<float>> batched(n_out);
  for (int i = 0; i < n_out; ++i) batched[i] = dys[i].download();
  // Each token alone (M = 1, x row m, into row m of the fp32 store outputs).
  for (int m = 0; m < p.M; ++m) {
    const auto o1 = outs(1, m);
    gpu::decode_linear(1, p.K, dx.get() + size_t(m) * ldx, ldx, o1.data(), n_out, E::StoreF32, st.s);
  }
  check_cuda(cudaStreamSynchronize(st.s), "decode_linear alone");
  double eb = 0, es = 0, ea = 0, exact = 0;
  for (int i = 0; i < n_out; ++i) {
    const int N = p.Ns[i];
    const auto hb = to_float(dyb[i].download());
    const auto hbits = dyb[i].download();
    const auto hs = dys[i].download(), ha = dya[i].download();
    std::vector<float> gb(size_t(p.M) * N), gs(gb.size()), ga(gb.size()), base(gb.size());
    for (int m = 0; m < p.M; ++m)
      for (int n = 0; n < ldy[i]; ++n) {
        const size_t at = size_t(m) * ldy[i] + n;
        if (n >= N) {  // padding: untouched (poison bytes 0xFF, the residual's initial values)
          uint16_t b16;
          std::memcpy(&b16, &hbits[at], 2);
          exact += (b16 != 0xFFFF) + (std::memcmp(&hs[at], &batched[i][at], 4) != 0) + (ha[at] != y0[i][at]);
          uint32_t b32;
          std::memcpy(&b32, &batched[i][at], 4);
          exact += b32 != 0xFFFFFFFFu;
          continue;
        }
        const size_t o = size_t(m) * N + n;
        gb[o] = hb[at], gs[o] = batched[i][at], ga[o] = ha[at], base[o] = y0[i][at];
        exact += std::memcmp(&hs[at], &batched[i][at], 4) != 0;
      }
    eb = std::max(eb, max_rel(gb.data(), ref[i].data(), gb.size()));
    es = std::max(es, max_rel(gs.data(), ref[i].data(), gs.size()));
    ea = std::max(ea, compare(ga.data(), ref[i].data(), ga.size(), base.data()).max_rel);
  }
  return {eb, es, ea, exact};
}

struct MoeP {
  MoeCfg c;  // E, topk, H, I, Is
  int T;
  bool renorm;
};
// The grouped GEMM the engine picks for T tokens (grouped_gemm_for_tokens: ours below 32 tokens, cuBLAS's grouped GEMM
// up to 1023, ours on wgmma from 1024 on sm_90); out accumulated onto a random residual, as the engine's stream.
Errs run_moe(const MoeP& p, std::mt19937& rng) {
  const HostMoe m(p.c, rng());
  Rng r(rng());
  std::vector<float> xf;
  DeviceBuffer<bf16> dx(rand_bf16(r, size_t(p.T) * p.c.H, 1.f, xf));
  const auto base = rand_f32(r, size_t(p.T) * p.c.H, 1.f);
  std::vector<std::vector<int>> sets;
  std::vector<char> near_tie;
  const auto ref = moe_ref(m, p.renorm, p.T, xf.data(), sets, near_tie);
  Stream st;
  gpu::GemmRunner gemm;
  gpu::MoeWorkspace ws;
  DeviceBuffer<float> dout(base);
  gpu::moe_forward(p.T, dx.get(), m.view(p.renorm), dout.get(), ws, gemm, gpu::grouped_gemm_for_tokens(p.T), st.s);
  check_cuda(cudaStreamSynchronize(st.s), "moe_forward");
  const Err e = compare(dout.download().data(), ref.data(), ref.size(), base.data());
  return {e.max_rel, e.fro};
}

struct MlpP {
  int T, H, I;
};
Errs run_mlp(const MlpP& p, std::mt19937& rng) {
  Rng r(rng());
  std::vector<float> xf, guf, dnf;
  DeviceBuffer<bf16> dx(rand_bf16(r, size_t(p.T) * p.H, 1.f, xf)),
      dgu(rand_bf16(r, size_t(2) * p.I * p.H, 1.f / std::sqrt(float(p.H)), guf)),
      ddn(rand_bf16(r, size_t(p.H) * p.I, 1.f / std::sqrt(float(p.I)), dnf));
  const auto base = rand_f32(r, size_t(p.T) * p.H, 1.f);
  std::vector<float> ref(base.size());
  mlp_ref(p.T, p.H, p.I, xf.data(), guf.data(), dnf.data(), ref.data());
  Stream st;
  gpu::GemmRunner gemm;
  gpu::MoeWorkspace ws;
  DeviceBuffer<float> dout(base);
  gpu::mlp_forward(p.T, dx.get(), p.H, p.I, dgu.get(), ddn.get(), dout.get(), ws, gemm, st.s);
  check_cuda(cudaStreamSynchronize(st.s), "mlp_forward");
  const Err e = compare(dout.download().data(), ref.data(), ref.size(), base.data());
  return {e.max_rel, e.fro};
}

// ---- the table ---------------------------------------------------------------------------------------------------

std::vector<Op> ops_table() {
  const char* one_rounding = "fp32 math, one bf16 rounding of the output (2^-9 relative) and fp32 sum order";
  const Out exact{"exact", 0, "a copy or gather: bit for bit"};
  const Out moe_max{"max_rel", 2e-2, "the GPU rounds the gate/up GEMM outputs, the SwiGLU activation and the expert "
                                     "outputs to bf16 (as HF's bf16 model), the CPU keeps fp32"};
  const Out moe_fro{"fro", 1e-2, "as max_rel, over the whole output"};
  const Out row_1_64{"", 1.0 / 64, "norm rounded to bf16, RoPE in fp32 rounded once: about 2 bf16 ulps of the row's "
                                   "largest value (fp32 vs double sums of squares, cosf/sinf vs libm flip roundings)"};
  const Out attn{"max_rel", 1e-2, "bf16 q, K, V, P on the tensor cores, fp32 softmax and accumulators, bf16 output; "
                                  "per group (expected ~3e-3)"};
  auto named = [](Out o, const char* name) {
    o.name = name;
    return o;
  };
  return {
      op<EmbedP>("embed_gather", "ids int32, embed bf16 [V][H] -> x fp32 [T][H]", {exact},
                 {{"T1 H64 V50", {1, 64, 50}}, {"T37 H2050 V300", {37, 2050, 300}},
                  {"T300 H2048 V1000", {300, 2048, 1000}}},
                 run_embed_gather),
      op<NormP>("rms_norm_residual", "x fp32 (row stride ldx, optional row index), w bf16 -> y bf16",
                {{"elem", 1e-2, one_rounding}},
                {{"rows1 dim2048", {1, 2048, 0, false}},
                 {"rows37 dim260 ldx+4 indexed", {37, 260, 4, true}},
                 {"rows300 dim4096", {300, 4096, 0, false}},
                 {"rows1 dim5120 indexed", {1, 5120, 0, true}}},
                run_rms_norm_residual),
      op<RowsP>("rms_norm_gated", "x, z, w bf16 -> y bf16 (in place)", {{"elem", 1e-2, one_rounding}},
                {{"rows1 dim128", {1, 128}}, {"rows123 dim128", {123, 128}}, {"rows40 dim256", {40, 256}},
                 {"rows7 dim66", {7, 66}}, {"rows1 dim128 vec", {1, 128, true}},
                 {"rows4099 dim128 vec", {4099, 128, true}}, {"rows40 dim256 vec", {40, 256, true}},
                 {"rows9 dim32 vec", {9, 32, true}}, {"rows33 dim64 vec", {33, 64, true}},
                 {"rows5 dim96 vec (12 lanes: the default kernel)", {5, 96, true}}},
                run_rms_norm_gated),
      op<GatherP>("gather_rows", "bf16 rows, int32 row ids -> bf16 rows", {exact},
                  {{"n1 width6 (4-byte path)", {3, 1, 6}}, {"n4 width1030", {29, 4, 1030}},
                   {"n100 width2048", {300, 100, 2048}}},
                  run_gather_rows),
      op<CopyP>("batched_copy", "device bytes (CopyDesc table) -> device bytes", {exact},
                {{"1 copy of 4096 floats", {{4096}, 0}},
                 {"3 copies of 13/400/1 floats, 4-byte aligned", {{13, 400, 1}, 1}},
                 {"5 copies of 64..8192 floats, 16-byte aligned", {{64, 8192, 4, 1024, 128}, 0}}},
                run_batched_copy),
      op<ChainP>("affine_chain", "T, S, init fp32 [heads][128][128] -> final, out fp32",
                 {{"final.fro", 1e-5, "3xTF32 tensor-core products (default) vs double, 128-term sums, steps"},
                  {"out.fro", 1e-5, "as final, after step 1 (0 with one step)"}},
                 {{"1 chain 1 head 1 step", {1, 1, 1}}, {"2 chains 3 heads 4 steps", {2, 3, 4}},
                  {"1 chain 32 heads 3 steps", {1, 32, 3}},
                  {"1 chain 32 heads 16 steps (a 16-segment splice)", {1, 32, 16}}},
                 run_affine_chain),
      op<SiluP>("silu_mul", "gu bf16 [T][2I] -> act bf16 [T][I]", {{"elem", 1e-2, one_rounding}},
                {{"T1 I8", {1, 8}}, {"T37 I264", {37, 264}}, {"T300 I512", {300, 512}}}, run_silu_mul),
      op<ConvP>("conv1d_silu_prefill", "x, weight, conv_state bf16, cu_seqlens int32 -> y bf16, conv tail bf16",
                {{"y.elem", 8e-3, "fp32 accumulation of K products, one bf16 rounding"},
                 {"tail.exact", 0, "the last K-1 inputs, copied"}},
                {{"lens{1} C64 K4", {{1}, 64, 4, true}},
                 {"lens{1,2,0,3,5,40} C776 K4", {{1, 2, 0, 3, 5, 40}, 776, 4, true}},
                 {"lens{65,130} C8192 K4 no history", {{65, 130}, 8192, 4, false}},
                 {"lens{300,700,29} C8192 K4 (16-token runs; the others 4)", {{300, 700, 29}, 8192, 4, true}},
                 {"lens{7,33} C200 K2", {{7, 33}, 200, 2, true}},
                 {"lens{20,13} C64 K8", {{20, 13}, 64, 8, true}},
                 {"lens{17,0,100,31} C8192 K4 split qd2048", {{17, 0, 100, 31}, 8192, 4, true, 2048}},
                 {"lens{1,2,0,3,5,40} C776 K3 split qd264", {{1, 2, 0, 3, 5, 40}, 776, 3, true, 264}},
                 {"lens{47} C776 K4 no history split qd264", {{47}, 776, 4, false, 264}},
                 {"narrow lens{1,2,0,3,5,40} C776 K4", {{1, 2, 0, 3, 5, 40}, 776, 4, true, 0, true}},
                 {"narrow lens{300,700,29} C8192 K4", {{300, 700, 29}, 8192, 4, true, 0, true}},
                 {"narrow lens{20,13} C64 K8", {{20, 13}, 64, 8, true, 0, true}},
                 {"narrow lens{7,33} C200 K3 no history", {{7, 33}, 200, 3, false, 0, true}},
                 {"narrow lens{17,0,100,31} C8192 K4 split qd2048", {{17, 0, 100, 31}, 8192, 4, true, 2048, true}}},
                run_conv1d_prefill),
      op<ConvDecP>("conv1d_silu_decode", "x, weight, conv_state bf16 (slot pool) -> y bf16, conv_state bf16",
                   {{"y.elem", 8e-3, "fp32 accumulation of K products, one bf16 rounding"},
                    {"state.exact", 0, "the shifted window; other slots untouched"}},
                   {{"B1 C64 K4", {1, 64, 4, false}}, {"B5 C8192 K4 slots", {5, 8192, 4, true}},
                    {"B3 C776 K4 slots", {3, 776, 4, true}}, {"B4 C8192 K4 slots split qd2048", {4, 8192, 4, true, 2048}},
                    {"B1 C776 K4 split qd264", {1, 776, 4, false, 264}}},
                   run_conv1d_decode),
      op<GdnP>("gdn_prefill",
               "q, k, v, gate a/b bf16, A_log, dt_bias, initial state fp32 -> out bf16, final state, T_C fp32 (d 128)",
               {{"out.fro", 2e-2, "bf16 operands on the tensor cores (W, U, P and the state fed to them are bf16, as "
                                  "in FLA), fp32 state; per sequence and head; H200 ~5e-3 (test_gpu_gated_delta)"},
                {"state.fro", 2e-2, "as out"},
                {"T_C.fro", 2e-2, "as out; H200 up to 1.3e-2"}},
               {{"lens{1} hk1 hv1", {{1}, 1, 1, false}},
                {"lens{63,0,65,130} hk2 hv4 initial", {{63, 0, 65, 130}, 2, 4, true}},
                {"lens{5,70} hk16 hv32 initial", {{5, 70}, 16, 32, true}},
                {"lens{300,1} hk2 hv2", {{300, 1}, 2, 2, false}}},
               run_gdn_prefill),
      op<GdnDecP>("gdn_decode_gated", "q, k, v, gate a/b bf16, A_log, dt_bias fp32, state fp32 (slot pool) -> out bf16",
                  {{"out.fro", 1e-2, "fp32 math, one bf16 rounding of the output"},
                   {"state.fro", 1e-5, "fp32 throughout; other slots untouched"}},
                  {{"B1 hk2 hv4", {1, 2, 4, false}}, {"B5 hk2 hv4 slots", {5, 2, 4, true}},
                   {"B33 hk16 hv32 slots", {33, 16, 32, true}}},
                  run_gdn_decode),
      op<PrepareP>("attention_prepare",
                   "q_proj (+gate), k, v bf16, norms bf16, positions int32, inv_freq fp32 -> q bf16, K/V pool rows "
                   "bf16",
                   {named(row_1_64, "q.max_rel"), named(row_1_64, "k.max_rel"),
                    {"v.exact", 0, "V copied; no other pool row written"}},
                   {{"T1 hd256 16/2 rot64 gate", {1, 16, 2, 256, 64, true, 0, 200000}},
                    {"T37 hd128 8/2 rot128 stride+8", {37, 8, 2, 128, 128, false, 8, 40000}},
                    {"T130 hd256 16/2 rot64 gate odd stride", {130, 16, 2, 256, 64, true, 1, 5000}},
                    {"T65 hd64 4/4 rot32 gate", {65, 4, 4, 64, 32, true, 0, 5000}}},
                   run_attention_prepare),
      op<ImportP>("kv_import", "K/V row runs bf16 (run tables), deltas int32, inv_freq fp32 -> K/V pool rows bf16",
                  {named(row_1_64, "k.max_rel"), {"v.exact", 0, "V copied"}},
                  {{"n1 2kv hd128 rot64", {1, 2, 128, 64}}, {"n130 2kv hd256 rot64", {130, 2, 256, 64}},
                   {"n65 4kv hd128 rot128", {65, 4, 128, 128}}},
                  run_kv_import),
      op<AttnP>("attention_prefill", "q bf16, paged K/V pool bf16, gate bf16 -> out bf16 (workspace overload)", {attn},
                {{"1 query at slot 0, hd128 8/2 gate", {128, 8, 2, true, false, {{1, 0}}}},
                 {"ragged (1@0)(7@63)(130@64)(600@1000), hd128 8/2 gate",
                  {128, 8, 2, true, false, {{1, 0}, {7, 63}, {130, 64}, {600, 1000}}}},
                 {"ragged (1@4999)(65@0)(200@130), hd256 16/2 gate",
                  {256, 16, 2, true, false, {{1, 4999}, {65, 0}, {200, 130}}}},
                 {"seam windows 6 x 8 + 64 on one sequence, hd256 16/2 gate",
                  {256, 16, 2, true, true,
                   {{8, 100}, {8, 700}, {8, 1300}, {8, 1900}, {8, 2500}, {8, 2950}, {64, 3000}}}},
                 {"(3@10)(129@0), hd64 4/4 no gate", {64, 4, 4, false, false, {{3, 10}, {129, 0}}}}},
                run_attention_prefill),
      op<AttnP>("attention_decode", "q bf16, paged K/V pool bf16, gate bf16 -> out bf16 (one query per request)",
                {attn},
                {{"b1 ctx1 hd128 8/2 gate", {128, 8, 2, true, false, {{1, 0}}}},
                 {"b5 ctx{1,63,64,1000,5000} hd128 8/2 gate",
                  {128, 8, 2, true, false, {{1, 0}, {1, 62}, {1, 63}, {1, 999}, {1, 4999}}}},
                 {"b4 ctx{20000,1,65,700} hd256 16/2 gate",
                  {256, 16, 2, true, false, {{1, 19999}, {1, 0}, {1, 64}, {1, 699}}}},
                 {"b3 ctx{1,100,2000} hd64 32/1 gate", {64, 32, 1, true, false, {{1, 0}, {1, 99}, {1, 1999}}}}},
                run_attention_decode),
      op<MassP>("attention_key_mass", "q bf16, paged K pool bf16 -> mass fp32 (accumulated)",
                {{"max|d|/(queries*heads)", 1e-4,
                  "fp32 scores from bf16 inputs, atomicAdd order; each (query, head) spreads probability 1"}},
                {{"1 query ctx1 hd128 8/2", {128, 8, 2, 0, 1}}, {"1 query ctx5000 hd256 16/2", {256, 16, 2, 4999, 1}},
                 {"7 queries at slot 200 hd128 8/2", {128, 8, 2, 200, 7}},
                 {"65 queries at slot 63 hd64 4/1", {64, 4, 1, 63, 65}}},
                run_key_mass),
      op<GemmP>("GemmRunner::linear", "x bf16 (row stride ldx), W bf16 -> y fp32 (+= residual, beta 1) / bf16",
                {{"f32.max_rel", 1e-4, "fp32 accumulation on both sides, different order"},
                 {"bf16.max_rel", 1e-2, "one bf16 rounding (2^-9 relative)"}},
                {{"M1 N72 K96", {1, 72, 96, 0, 0}}, {"M7 N200 K328 ldx+8", {7, 200, 328, 8, 0}},
                 {"M65 N77 K100 ldy+3", {65, 77, 100, 0, 3}}, {"M300 N1000 K136 ldy+24", {300, 1000, 136, 0, 24}},
                 {"M333 N2048 K2048", {333, 2048, 2048, 0, 0}}},
                run_linear),
      op<ArgmaxP>("argmax_rows", "logits fp32 (row stride ld) -> token int32 (greedy decoding)",
                  {{"exact", 0, "a selection: the same index as the loop, ties to the lowest, NaN rows give their first NaN"}},
                  {{"1 row V 248320 (Qwen3.5 vocabulary)", {1, 248320, 0}}, {"5 rows V 1000 ld+3 (tie, -inf, NaN)", {5, 1000, 3}},
                   {"4 rows V 5 (fewer elements than threads)", {4, 5, 0}}, {"64 rows V 151936", {64, 151936, 0}},
                   {"6 rows V 248321 ld+1 (rows off 16 bytes, ties across slices)", {6, 248321, 1}},
                   {"4 rows V 33 (slices shorter than 4)", {4, 33, 0}}},
                  run_argmax),
      op<DecLinP>("decode_linear", "x bf16 (row stride ldx), 1-4 W bf16 -> y bf16 / fp32 / fp32 += residual",
                   {{"bf16.max_rel", 1e-2, "one bf16 rounding (2^-9 relative)"},
                    {"f32.max_rel", 1e-4, "fp32 accumulation on both sides, different order"},
                    {"f32_add.max_rel", 1e-4, "as f32, onto a random residual"},
                    {"exact", 0, "each token's bits as when decoded alone; row padding untouched"}},
                   {{"M1 K32 N{1}", {1, 32, 0, 0, {1}}},
                    {"M1 K2048 N{8192,4096,32,32} (GDN in_proj)", {1, 2048, 0, 0, {8192, 4096, 32, 32}}},
                    {"M1 K4096 N{2048} (out_proj: 16-stage ring)", {1, 4096, 0, 0, {2048}}},
                    {"M7 K96 N{72,5} ldx+8 ldy+3", {7, 96, 8, 3, {72, 5}}},
                    {"M9 K512 N{2048} (short K: 2 slices)", {9, 512, 0, 0, {2048}}},
                    {"M16 K4096 N{300} ldy+5 (8-stage ring, 2 groups)", {16, 4096, 0, 5, {300}}},
                    {"M17 K4096 N{200,77,16} ldy+24", {17, 4096, 0, 24, {200, 77, 16}}},
                    {"M33 K1056 N{100} (uneven slices)", {33, 1056, 0, 0, {100}}},
                    {"M64 K2048 N{1000,33,17,1} ldx+16", {64, 2048, 16, 0, {1000, 33, 17, 1}}},
                    {"M2 K2048 N{24833} (an LM head's shape: many blocks, N odd)", {2, 2048, 0, 0, {24833}}}},
                   run_decode_linear),
      op<MoeP>("moe_forward", "x bf16, router/experts/shared bf16 -> out fp32 (accumulated)", {moe_max, moe_fro},
               {{"E8 top2 H64 I32 Is0 T1", {{8, 2, 64, 32, 0}, 1, true}},
                {"E10 top3 H192 I96 Is32 T7 no renorm", {{10, 3, 192, 96, 32}, 7, false}},
                {"E16 top4 H128 I64 Is64 T33", {{16, 4, 128, 64, 64}, 33, true}},
                {"E64 top8 H1024 I256 Is256 T333", {{64, 8, 1024, 256, 256}, 333, true}},
                {"E64 top8 H1024 I256 Is256 T1024", {{64, 8, 1024, 256, 256}, 1024, true}}},
               run_moe),
      op<MlpP>("mlp_forward", "x bf16, gate_up/down bf16 -> out fp32 (accumulated)", {moe_max, moe_fro},
               {{"T1 H64 I32", {1, 64, 32}}, {"T37 H192 I96", {37, 192, 96}}, {"T300 H1024 I3072", {300, 1024, 3072}}},
               run_mlp),
  };
}

uint32_t seed_of(const std::string& op, size_t i) {  // FNV-1a: a case's inputs do not depend on the rest of the table
  uint32_t h = 2166136261u;
  for (char c : op) h = (h ^ uint8_t(c)) * 16777619u;
  return (h ^ uint32_t(i)) * 16777619u;
}

}  // namespace

TEST_CASE("ops table: every CUDA op the engine calls against its CPU reference, on ragged and odd shapes",
          "[gpu][ops_table]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  for (const Op& o : ops_table()) {
    DYNAMIC_SECTION(o.name) {
      std::printf("[ops_table] %s: %s\n", o.name.c_str(), o.dtypes.c_str());
      for (const Out& out : o.outs) std::printf("[ops_table]   tol %s %.1e: %s\n", out.name, out.tol, out.why);
      for (size_t i = 0; i < o.cases.size(); ++i) {
        const Case& c = o.cases[i];
        INFO(o.name << " " << c.name << " (" << o.dtypes << ")");
        std::mt19937 rng(seed_of(o.name, i));
        Errs errs;
        try {
          errs = c.run(rng);
          check_cuda(cudaDeviceSynchronize(), o.name);
        } catch (const std::exception& e) {
          std::printf("[ops_table] %s %s: threw %s\n", o.name.c_str(), c.name.c_str(), e.what());
          FAIL_CHECK(e.what());
          continue;
        }
        REQUIRE(errs.size() == o.outs.size());
        for (size_t j = 0; j < errs.size(); ++j) {
          const std::string name = o.outs.size() > 1 ? o.name + "." + o.outs[j].name : o.name;
          std::printf("[ops_table] %s %s: err %.3e (tol %.1e)\n", name.c_str(), c.name.c_str(), errs[j], o.outs[j].tol);
          INFO(name << ": err " << errs[j] << " tol " << o.outs[j].tol);
          CHECK(errs[j] <= o.outs[j].tol);
        }
        std::fflush(stdout);
      }
    }
  }
}

TEST_CASE("decode_linear refuses the shapes it does not take, naming them", "[gpu][ops_table]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  DeviceBuffer<bf16> x(size_t(65) * 64), w(size_t(16) * 64);
  DeviceBuffer<float> y(size_t(65) * 16);
  const gpu::DecodeLinearOutput o{w.get(), 16, y.get(), 16};
  using E = gpu::DecodeLinearEpilogue;
  CHECK(gpu::decode_linear_supported(64, 64, x.get(), 64, &o, 1));
  CHECK_FALSE(gpu::decode_linear_supported(gpu::kMaxDecodeLinearTokens + 1, 64, x.get(), 64, &o, 1));  // M
  CHECK_FALSE(gpu::decode_linear_supported(0, 64, x.get(), 64, &o, 1));
  CHECK_FALSE(gpu::decode_linear_supported(4, 48, x.get(), 64, &o, 1));      // K not a multiple of 32
  CHECK_FALSE(gpu::decode_linear_supported(4, 64, x.get(), 60, &o, 1));      // ldx < K
  CHECK_FALSE(gpu::decode_linear_supported(4, 64, x.get() + 1, 64, &o, 1));  // x not 16-byte aligned
  CHECK_FALSE(gpu::decode_linear_supported(4, 64, x.get(), 64, &o, 0));      // no output
  const gpu::DecodeLinearOutput bad_ldy{w.get(), 16, y.get(), 15};
  CHECK_FALSE(gpu::decode_linear_supported(4, 64, x.get(), 64, &bad_ldy, 1));
  try {
    gpu::decode_linear(65, 64, x.get(), 64, &o, 1, E::StoreF32, nullptr);
    FAIL("decode_linear took M = 65");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("M 65") != std::string::npos);
  }
}

// decode_linear with x loaded 4 chunks ahead into registers (HYPIC_STREAM_X_AHEAD, the one-token-group kernels:
// M <= 8) against the same launch without it: the same products in the same order, so every output bit equal, for
// each epilogue, 1-3 outputs, warp K slices of 3, 8, 16 and 17 chunks (shorter and longer than the queue, not
// multiples of it; the ring's 8 or 16 stages refilled or not), a row stride past K, and the add with its norm (in the
// last block at M <= 2, after the launch above); the plain launch is checked against the CPU in the ops table.
TEST_CASE("decode_linear with x loads ahead == without, bit for bit", "[gpu][ops_table]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  using E = gpu::DecodeLinearEpilogue;
  struct Case {
    int M, K, ldx_pad;
    std::vector<int> Ns;
  };
  const std::vector<Case> cases = {{1, 4096, 0, {2048}},      {1, 2048, 8, {8192, 4096, 64}}, {3, 2048, 0, {256}},
                                   {8, 512, 0, {2048, 1028}}, {1, 96, 0, {40}},                {5, 4160, 16, {528}},
                                   {2, 1056, 0, {2048}}};
  std::mt19937 rng(812);
  Stream st;
  DeviceBuffer<unsigned> counter(std::vector<unsigned>{0u});
  for (const Case& c : cases) {
    std::string name = "M " + std::to_string(c.M) + " K " + std::to_string(c.K) + " N";
    for (int N : c.Ns) name += " " + std::to_string(N);
    INFO(name);
    const long ldx = c.K + c.ldx_pad;
    std::vector<float> xf, wf, rf;
    DeviceBuffer<bf16> dx(random_bf16(rng, size_t(c.M) * ldx, 1.f, xf));
    std::vector<DeviceBuffer<bf16>> dw;
    std::vector<std::vector<float>> resid(c.Ns.size());
    for (size_t i = 0; i < c.Ns.size(); ++i) {
      dw.emplace_back(random_bf16(rng, size_t(c.Ns[i]) * c.K, 1.f / std::sqrt(float(c.K)), wf));
      random_bf16(rng, size_t(c.M) * c.Ns[i], 1.f, resid[i]);
    }
    DeviceBuffer<bf16> nw(random_bf16(rng, size_t(c.Ns[0]), 0.3f, rf));
    // Every epilogue, then (one output, N a multiple of 4) the add with the last block's norm; outputs as raw bytes.
    auto run = [&](bool ahead) {
      ScopedCandidate xa("HYPIC_STREAM_X_AHEAD", ahead), fuse("HYPIC_FUSE_POST_NORM", true);
      std::vector<std::vector<uint8_t>> got;
      for (const E epi : {E::StoreBf16, E::StoreF32, E::AddF32}) {
        std::vector<DeviceBuffer<float>> ys;  // fp32-sized buffers serve the bf16 store too
        std::vector<gpu::DecodeLinearOutput> o;
        for (size_t i = 0; i < c.Ns.size(); ++i) {
          ys.emplace_back(resid[i]);
          o.push_back({dw[i].get(), c.Ns[i], ys.back().get(), c.Ns[i]});
        }
        gpu::decode_linear(c.M, c.K, dx.get(), ldx, o.data(), int(o.size()), epi, st.s);
        check_cuda(cudaStreamSynchronize(st.s), "decode_linear");
        for (auto& y : ys) {
          const auto h = y.download();
          got.emplace_back(reinterpret_cast<const uint8_t*>(h.data()),
                           reinterpret_cast<const uint8_t*>(h.data()) + h.size() * 4);
        }
      }
      if (c.Ns[0] % 4 == 0) {
        DeviceBuffer<float> r(resid[0]);
        DeviceBuffer<bf16> y(size_t(c.M) * c.Ns[0]);
        y.poison();
        const gpu::DecodeLinearOutput o{dw[0].get(), c.Ns[0], r.get(), c.Ns[0]};
        const gpu::DecodeLinearNorm norm{nw.get(), 1e-6f, true, y.get(), counter.get()};
        gpu::decode_linear(c.M, c.K, dx.get(), ldx, &o, 1, E::AddF32, st.s, &norm);
        check_cuda(cudaStreamSynchronize(st.s), "decode_linear with the norm");
        const auto hr = r.download();
        const auto hy = y.download();
        got.emplace_back(reinterpret_cast<const uint8_t*>(hr.data()),
                         reinterpret_cast<const uint8_t*>(hr.data()) + hr.size() * 4);
        got.emplace_back(reinterpret_cast<const uint8_t*>(hy.data()),
                         reinterpret_cast<const uint8_t*>(hy.data()) + hy.size() * 2);
      }
      return got;
    };
    const auto off = run(false), on = run(true);
    const bool same = off == on;
    std::printf("[decode_linear x ahead] %s: %zu outputs %s\n", name.c_str(), off.size(),
                same ? "bit-identical" : "DIFFER");
    CHECK(same);
  }
}

// decode_linear's last-block norm (DecodeLinearNorm; in the last block for M <= 2 with HYPIC_FUSE_POST_NORM on,
// else rms_norm_residual after the launch) against decode_linear without it followed by rms_norm_residual: the
// residual rows and the normed rows bit for bit; the normed rows also against a host RMSNorm of the residual rows
// (one bf16 rounding); three launches in a row and two replays of a captured graph (the counter is reset each time);
// a bad norm refused.
TEST_CASE("decode_linear with the norm of its output rows == decode_linear then rms_norm_residual", "[gpu][ops_table]") {
  if (!cuda_device_present()) FAIL("no CUDA device: the GPU tests need an NVIDIA GPU (scripts/test_gpu.sh)");
  using E = gpu::DecodeLinearEpilogue;
  struct Case {
    int M, K, N, ldy_pad;
    bool zero_centred;
  };
  const Case cases[] = {{1, 4096, 2048, 0, true}, {2, 4096, 2048, 4, false}, {1, 512, 1028, 0, true},
                        {3, 1024, 2048, 0, true}, {16, 4096, 2048, 0, true}};
  std::mt19937 rng(515);
  Stream st;
  DeviceBuffer<unsigned> counter(std::vector<unsigned>{0u});
  for (const Case& c : cases) {
    const std::string name = "M " + std::to_string(c.M) + " K " + std::to_string(c.K) + " N " + std::to_string(c.N) +
                             (c.zero_centred ? " zero-centred" : " plain");
    INFO(name);
    const long ldy = c.N + c.ldy_pad;
    std::vector<float> xf, wf, nf;
    const auto x = random_bf16(rng, size_t(c.M) * c.K, 1.f, xf);
    const auto w = random_bf16(rng, size_t(c.N) * c.K, 0.05f, wf);
    const auto nw = random_bf16(rng, size_t(c.N), 0.3f, nf);
    std::vector<float> resid0(size_t(c.M) * ldy);
    for (float& v : resid0) v = std::normal_distribution<float>(0.f, 1.f)(rng);
    DeviceBuffer<bf16> dx(x), dw(w), dnw(nw), dy(size_t(c.M) * c.N);
    DeviceBuffer<float> dr(resid0);
    const gpu::DecodeLinearOutput o{dw.get(), c.N, dr.get(), ldy};
    // The reference: the add, then the norm kernel.
    gpu::decode_linear(c.M, c.K, dx.get(), c.K, &o, 1, E::AddF32, st.s);
    check_cuda(cudaStreamSynchronize(st.s), "reference add");
    dy.poison();
    check_cuda(cudaDeviceSynchronize(), "poison");
    gpu::rms_norm_residual(c.M, c.N, dr.get(), ldy, nullptr, dnw.get(), 1e-6f, dy.get(), st.s, c.zero_centred);
    check_cuda(cudaStreamSynchronize(st.s), "reference");
    const auto r_ref = dr.download();
    const auto y_ref = dy.download();
    std::vector<float> host(size_t(c.M) * c.N), rows(size_t(c.M) * c.N);
    for (int m = 0; m < c.M; ++m)
      std::copy(r_ref.begin() + size_t(m) * ldy, r_ref.begin() + size_t(m) * ldy + c.N, rows.begin() + size_t(m) * c.N);
    if (c.zero_centred)
      cpu::rms_norm_zero_centred(c.M, c.N, rows.data(), nf.data(), 1e-6f, host.data());
    else
      cpu::rms_norm(c.M, c.N, rows.data(), nf.data(), 1e-6f, host.data());
    size_t host_bad = 0;
    for (size_t i = 0; i < host.size(); ++i)
      host_bad += !(std::fabs(bf16_to_float(y_ref[i]) - host[i]) <= std::ldexp(std::fabs(host[i]), -8) + 1e-6f);
    CHECK(host_bad == 0);
    const gpu::DecodeLinearNorm norm{dnw.get(), 1e-6f, c.zero_centred, dy.get(), counter.get()};
    for (const bool fused : {true, false}) {
      ScopedCandidate sw("HYPIC_FUSE_POST_NORM", fused);
      bool same = true;
      for (int rep = 0; rep < 3; ++rep) {
        dr.upload(resid0);
        dy.poison();
        check_cuda(cudaDeviceSynchronize(), "upload and poison");  // (legacy-stream copies; the launch is on st.s)
        gpu::decode_linear(c.M, c.K, dx.get(), c.K, &o, 1, E::AddF32, st.s, &norm);
        check_cuda(cudaStreamSynchronize(st.s), "decode_linear with the norm");
        same = same && same_bits(dr.download(), r_ref) && same_bits(dy.download(), y_ref);
      }
      {  // captured (the add runs on the residual again per replay: compare the normed rows of the new residual)
        dr.upload(resid0);
        CapturedGraph cg(st.s, [&] { gpu::decode_linear(c.M, c.K, dx.get(), c.K, &o, 1, E::AddF32, st.s, &norm); });
        dr.upload(resid0);
        dy.poison();
        check_cuda(cudaDeviceSynchronize(), "upload and poison");
        cg.replay();
        same = same && same_bits(dr.download(), r_ref) && same_bits(dy.download(), y_ref);
        dr.upload(resid0);
        dy.poison();
        check_cuda(cudaDeviceSynchronize(), "upload and poison");
        cg.replay();
        same = same && same_bits(dr.download(), r_ref) && same_bits(dy.download(), y_ref);
      }
      // One launch when the last block does the norm (M <= 2, switch on), two otherwise.
      const size_t kernels = captured_kernels(
          st.s, [&] { gpu::decode_linear(c.M, c.K, dx.get(), c.K, &o, 1, E::AddF32, st.s, &norm); });
      CHECK(kernels == (fused && c.M <= gpu::kDecodeLinearNormInBlockMaxTokens ? 1u : 2u));
      const unsigned left = counter.download()[0];
      std::printf("[decode_linear norm] %s, %s: residual and normed rows %s; counter after %u\n", name.c_str(),
                  fused ? "fused" : "separate", same ? "bit-identical" : "DIFFER", left);
      CHECK(same);
      CHECK(left == 0u);
    }
  }
  DeviceBuffer<bf16> x(size_t(2) * 64), w(size_t(16) * 64), y(size_t(2) * 16);
  DeviceBuffer<float> r(size_t(2) * 16);
  const gpu::DecodeLinearOutput o{w.get(), 16, r.get(), 16};
  const gpu::DecodeLinearNorm no_counter{w.get(), 1e-6f, true, y.get(), nullptr};
  CHECK_THROWS_WITH(gpu::decode_linear(2, 64, x.get(), 64, &o, 1, E::AddF32, nullptr, &no_counter),
                    Catch::Contains("counter"));
  const gpu::DecodeLinearNorm ok{w.get(), 1e-6f, true, y.get(), counter.get()};
  CHECK_THROWS_WITH(gpu::decode_linear(2, 64, x.get(), 64, &o, 1, E::StoreF32, nullptr, &ok),
                    Catch::Contains("AddF32"));
}
