// Benchmark of the CUDA gated-delta kernels on Qwen3.5-35B-A3B linear-attention shapes
// (16 key heads, 32 value heads, d_k = d_v = 128, bf16 activations): chunked prefill with and
// without the segment transition T_C, the decode step, composition of 16 cached segments over
// 30 layers x 32 heads (own kernel vs cuBLAS), the causal conv1d, and the H200 ceilings measured
// in the same run (device-to-device copy bandwidth; bf16 tensor-core rate through cuBLAS).
// Per prefill shape also the scan's products on wgmma or mma.sync and its tile staging (cp.async with and without the
// L2 prefetch, TMA) side by side in alternating rounds.
// Prints a human table and writes JSON (--json PATH) that tools/bench_fla_reference.py merges with
// its interleaved comparison against flash-linear-attention.
//
// Usage: gdn_bench [--json out.json] [--reps N] [--scan-profile]
// --scan-profile: also one call of each prefill shape (the split scan and the whole-sequence scan, no T_C) with
// GdnPrefillArgs::scan_profile: where the first scan block's chunk steps go, per warp role (cp.async wait, block
// barrier, issuing the next chunk's copies, the L2 prefetch, role work), in SM cycles and microseconds per chunk step.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/gpu/bench_util.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/switches.h"

namespace gpu = hypic::kernels::cuda;
using gpu::bf16;
using gpu::check_cuda;
using nlohmann::json;
using namespace hypic::bench;

namespace {

constexpr int HK = 16, HV = 32, D = 128;

__global__ void fill_gates(float* g, float* beta, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = hash_uniform(i, seed), w = hash_uniform(i, seed + 1);
    g[i] = u < 0.01f ? -0.5f * w : -0.01f * w;  // slow decays: T_C over 4k tokens stays well above underflow
    beta[i] = 0.05f + 0.9f * hash_uniform(i, seed + 2);
  }
}
/// Random Gated DeltaNet inputs for T tokens: q, k [T][HK][D], v [T][HV][D] bf16; g, beta [T][HV].
struct GdnInputs {
  bf16 *q, *k, *v;
  float *g, *beta;
  GdnInputs(size_t T, uint32_t seed)
      : q(dalloc<bf16>(T * HK * D)), k(dalloc<bf16>(T * HK * D)), v(dalloc<bf16>(T * HV * D)),
        g(dalloc<float>(T * HV)), beta(dalloc<float>(T * HV)) {
    fill_bf16<<<2048, 256>>>(q, T * HK * D, seed);
    fill_bf16<<<2048, 256>>>(k, T * HK * D, seed + 1);
    fill_bf16<<<2048, 256>>>(v, T * HV * D, seed + 2);
    fill_gates<<<2048, 256>>>(g, beta, T * HV, seed + 3);
    check_cuda(cudaDeviceSynchronize(), "input fill");
  }
  GdnInputs(const GdnInputs&) = delete;
  GdnInputs& operator=(const GdnInputs&) = delete;
  ~GdnInputs() {
    for (void* p : std::initializer_list<void*>{q, k, v, g, beta}) cudaFree(p);
  }
};

// The prefill arguments of one layer over the sequences cu (HOST cu_seqlens, kept alive by the caller) of `in`:
// outputs into out, final states into fin, no T_C.
gpu::GdnPrefillArgs layer_args(const std::vector<int>& cu, const GdnInputs& in, bf16* out, float* fin) {
  gpu::GdnPrefillArgs a;
  a.num_seqs = int(cu.size()) - 1;
  a.cu_seqlens_host = cu.data();
  a.num_k_heads = HK;
  a.num_v_heads = HV;
  a.q = in.q;
  a.k = in.k;
  a.v = in.v;
  a.g = in.g;
  a.beta = in.beta;
  a.final_state = fin;
  a.out = out;
  return a;
}

struct ProfileCase {
  const char* name;
  int nseq, len;
};

// --scan-profile: per shape, one prefill (no T_C) with the default scan (seq_parts 0: "P=n" where it is split, else
// "whole") and one with the whole-sequence scan (seq_parts 1), each with GdnPrefillArgs::scan_profile; prints per warp
// group of four (the layout's roles: S recurrence, outputs, T recurrence; the profiled block is part 0 of a split
// sequence, whose T warps only keep the barriers) the mean SM cycles per chunk step in each phase, and adds them to
// J. Microseconds from the device's nominal clock (cudaDevAttrClockRate), so approximate.
template <size_t N>
void profile_scans(const ProfileCase (&cases)[N], const GdnInputs& in, bf16* out, float* fin, json& J) {
  int khz = 0;
  check_cuda(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0), "cudaDevAttrClockRate");
  auto* prof = dalloc<long long>(gpu::kGdnScanProfileSlots);
  gpu::GdnWorkspace ws;
  std::printf("\nchunk scan profile: the first scan block of each launch, SM cycles per chunk step (us at %.0f MHz)\n",
              khz / 1e3);
  std::printf("%-7s %-6s %6s %-5s %12s %12s %12s %12s %12s %13s\n", "shape", "scan", "steps", "warps", "tile wait",
              "barrier", "cp.async", "L2 prefetch", "role work", "block total");
  const char* group_names[3] = {"0-3", "4-7", "8-11"};
  for (const ProfileCase& c : cases) {
    std::vector<int> cu(c.nseq + 1);
    for (int s = 0; s <= c.nseq; ++s) cu[s] = s * c.len;
    for (int parts : {0, 1}) {
      gpu::GdnPrefillArgs a = layer_args(cu, in, out, fin);
      a.seq_parts = parts;
      const int scan_parts = gpu::gdn_scan_parts(a)[0];
      gpu::gdn_prefill(a, ws);  // (warm: plan and factors)
      check_cuda(cudaMemset(prof, 0, gpu::kGdnScanProfileSlots * sizeof(long long)), "memset(profile)");
      a.scan_profile = prof;
      gpu::gdn_prefill(a, ws);
      std::vector<long long> h(gpu::kGdnScanProfileSlots);
      check_cuda(cudaMemcpy(h.data(), prof, h.size() * sizeof(long long), cudaMemcpyDeviceToHost), "profile copy");
      const long long steps = std::max(1LL, h[72]);
      const std::string scan = scan_parts > 1 ? "P=" + std::to_string(scan_parts) : "whole";
      for (int grp = 0; grp < 3; ++grp) {
        double ph[5] = {0, 0, 0, 0, 0};
        long long wsteps = 0;  // the group's warps' chunk steps (a launch without such warps adds none)
        for (int w = 4 * grp; w < 4 * grp + 4; ++w) wsteps += h[6 * w + 5];
        if (wsteps == 0) continue;
        for (int w = 4 * grp; w < 4 * grp + 4; ++w)
          for (int i = 0; i < 5; ++i) ph[i] += double(h[6 * w + i]) / wsteps;
        auto us = [&](double cyc) { return cyc / khz * 1e3; };
        const double block = double(h[73]) / steps;
        std::printf("%-7s %-6s %6lld %-5s", c.name, scan.c_str(), wsteps / 4, group_names[grp]);
        for (int i = 0; i < 5; ++i) std::printf(" %5.0f (%4.2f)", ph[i], us(ph[i]));
        std::printf(" %6.0f (%4.2f)\n", block, us(block));
        J["scan_profile"].push_back({{"shape", c.name},
                                     {"scan", scan},
                                     {"steps", wsteps / 4},
                                     {"warps", group_names[grp]},
                                     {"cycles_per_step_tile_wait", ph[0]},
                                     {"cycles_per_step_barrier", ph[1]},
                                     {"cycles_per_step_cp_async_issue", ph[2]},
                                     {"cycles_per_step_l2_prefetch", ph[3]},
                                     {"cycles_per_step_role_work", ph[4]},
                                     {"cycles_per_step_block", block},
                                     {"clock_khz", khz}});
      }
    }
  }
  cudaFree(prof);
}

}  // namespace

int main(int argc, char** argv) try {
  std::string json_path;
  int reps = 20;
  bool scan_profile = false;
  std::vector<char*> args;  // argv without --scan-profile, for parse_json_reps
  for (int i = 0; i < argc; ++i)
    if (i > 0 && std::strcmp(argv[i], "--scan-profile") == 0) scan_profile = true;
    else args.push_back(argv[i]);
  if (!parse_json_reps(int(args.size()), args.data(), "gdn_bench [--scan-profile]", json_path, reps)) return 2;
  cudaDeviceProp prop{};
  json J = device_header(reps, prop);
  J["shapes"] = {{"num_k_heads", HK}, {"num_v_heads", HV}, {"d_k", D}, {"d_v", D}, {"chunk", gpu::kGdnChunk}};

  cublasHandle_t blas;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");

  // ---- ceilings measured here: copy bandwidth and bf16 tensor-core GEMM rate -----------------
  measure_ceilings(blas, J);
  const double peak_tf = J["ceiling"]["bf16_gemm_TFLOPs"], peak_bw = J["ceiling"]["copy_GBps"];

  // ---- chunked prefill ------------------------------------------------------------------------
  const ProfileCase cases[] = {{"1x4k", 1, 4096}, {"1x16k", 1, 16384}, {"1x32k", 1, 32768}, {"16x2k", 16, 2048}};
  using Case = ProfileCase;
  const size_t maxT = 32768;
  GdnInputs in(maxT, 11);
  auto* out = dalloc<bf16>(maxT * HV * D);
  auto* fin = dalloc<float>(size_t(16) * HV * D * D);
  auto* tr = dalloc<float>(size_t(16) * HV * D * D);
  // Raw gate inputs (HF a, b) for the fused-gate variant, and g / beta outputs of gdn_gates.
  auto* gate_a = dalloc<bf16>(maxT * HV);
  auto* gate_b = dalloc<bf16>(maxT * HV);
  auto* g2 = dalloc<float>(maxT * HV);
  auto* beta2 = dalloc<float>(maxT * HV);
  fill_bf16<<<2048, 256>>>(gate_a, maxT * HV, 21);
  fill_bf16<<<2048, 256>>>(gate_b, maxT * HV, 22);
  std::vector<float> A_log_h(HV), dt_bias_h(HV);
  for (int h = 0; h < HV; ++h) A_log_h[h] = std::log(0.01f + 0.002f * h), dt_bias_h[h] = -1.f + 0.05f * h;
  auto* A_log = dalloc<float>(HV);
  auto* dt_bias = dalloc<float>(HV);
  check_cuda(cudaMemcpy(A_log, A_log_h.data(), HV * sizeof(float), cudaMemcpyHostToDevice), "A_log");
  check_cuda(cudaMemcpy(dt_bias, dt_bias_h.data(), HV * sizeof(float), cudaMemcpyHostToDevice), "dt_bias");
  // Raw in_proj rows [T][(2 HK + HV) D] and conv weights for the conv side by side (separate launch or fused).
  constexpr int kConvChannels = (2 * HK + HV) * D, kConvTaps = 4;
  auto* conv_x = dalloc<bf16>(maxT * kConvChannels);
  auto* conv_w = dalloc<bf16>(size_t(kConvChannels) * kConvTaps);
  fill_bf16<<<2048, 256>>>(conv_x, maxT * kConvChannels, 23);
  fill_bf16<<<2048, 256>>>(conv_w, size_t(kConvChannels) * kConvTaps, 24);
  auto* cu_dev = dalloc<int>(17);
  gpu::GdnWorkspace ws, ws_gates, ws_conv;
  std::printf("device %s, %d SMs; measured ceilings: copy %.0f GB/s, bf16 GEMM %.0f TFLOP/s\n\n", prop.name,
              prop.multiProcessorCount, peak_bw, peak_tf);
  std::printf("%-7s %6s %10s %10s %8s %10s %10s %10s %9s %9s %9s\n", "shape", "parts", "no T_C ms", "T_C ms",
              "T_C +%", "whole ms", "no-out ms", "TFLOP/s", "%peak", "GB/s", "%copy");
  for (const Case& c : cases) {
    std::vector<int> cu(c.nseq + 1);
    for (int s = 0; s <= c.nseq; ++s) cu[s] = s * c.len;
    const int T = c.nseq * c.len;
    gpu::GdnPrefillArgs a = layer_args(cu, in, out, fin);
    const int parts = gpu::gdn_scan_parts(a)[0];
    const double t_plain = time_ms([&] { gpu::gdn_prefill(a, ws); }, reps);
    a.seq_parts = 1;  // the whole-sequence scan, for the sequence-parallel split's gain
    const double t_whole = time_ms([&] { gpu::gdn_prefill(a, ws); }, reps);
    a.seq_parts = 0;
    a.transition = tr;
    const double t_tc = time_ms([&] { gpu::gdn_prefill(a, ws); }, reps);
    a.out = nullptr;
    a.transition = nullptr;
    const double t_noout = time_ms([&] { gpu::gdn_prefill(a, ws); }, reps);
    a.out = out;
    // The candidates HYPIC_GDN_SCAN_WGMMA and HYPIC_GDN_WY_WGMMA (the scan's / the WY kernel's products on warpgroup
    // MMAs) beside the default, in rounds default, scan, WY, both, then the reverse; the mean of each mode's two rounds.
    double t_mode[4] = {0, 0, 0, 0};  // default, scan, WY, both
    {
      gpu::CandidateScope scan_sw("HYPIC_GDN_SCAN_WGMMA"), wy_sw("HYPIC_GDN_WY_WGMMA");
      for (int round = 0; round < 8; ++round) {
        const int mode = round < 4 ? round : 7 - round;
        scan_sw.set(mode & 1);
        wy_sw.set(mode & 2);
        t_mode[mode] += time_ms([&] { gpu::gdn_prefill(a, ws); }, reps) / 2;
      }
    }
    // The wgmma scan's staging (default on wgmma): cp.async with its L2 prefetch (the old default), without the
    // prefetch (HYPIC_GDN_SCAN_NO_L2_PREFETCH), W / K / Q / P by TMA (HYPIC_GDN_SCAN_TMA, the default since
    // bench/results/gdn_scan_tma_h100.md), U^T and the gate scalars by TMA too (HYPIC_GDN_SCAN_TMA_ALL, the default
    // since gdn_scan_tma_all_h100.md), each set explicitly, in rounds 0 1 2 3 3 2 1 0; the mean of each mode's two
    // rounds.
    // tma_ran: the TMA rounds' scans all staged by TMA (gdn_wgmma_launches().scan_tma, .scan_tma_all).
    double t_stage[4] = {0, 0, 0, 0};  // cp.async, no L2 prefetch, TMA, TMA_ALL
    bool tma_ran = false;
    if (gpu::gdn_scan_wgmma_active()) {
      gpu::CandidateScope nopf_sw("HYPIC_GDN_SCAN_NO_L2_PREFETCH"), tma_sw("HYPIC_GDN_SCAN_TMA"),
          all_sw("HYPIC_GDN_SCAN_TMA_ALL");
      tma_ran = true;
      for (int round = 0; round < 8; ++round) {
        const int mode = round < 4 ? round : 7 - round;
        nopf_sw.set(mode == 1);
        tma_sw.set(mode >= 2);
        all_sw.set(mode == 3);
        const gpu::GdnWgmmaLaunches before = gpu::gdn_wgmma_launches();
        t_stage[mode] += time_ms([&] { gpu::gdn_prefill(a, ws); }, reps) / 2;
        const gpu::GdnWgmmaLaunches after = gpu::gdn_wgmma_launches();
        const uint64_t launches = after.scan - before.scan;
        if (mode >= 2) tma_ran = tma_ran && after.scan_tma - before.scan_tma == launches;
        if (mode == 3) tma_ran = tma_ran && after.scan_tma_all - before.scan_tma_all == launches;
      }
    }
    // Gates: a separate gdn_gates kernel before the prefill, against the gates fused into it.
    gpu::GdnPrefillArgs ag = a;
    ag.g = g2;
    ag.beta = beta2;
    const double t_gates_sep = time_ms(
        [&] {
          gpu::gdn_gates(T, HV, gate_a, gate_b, A_log, dt_bias, g2, beta2);
          gpu::gdn_prefill(ag, ws_gates);
        },
        reps);
    ag.g = ag.beta = nullptr;
    ag.gate_a = gate_a;
    ag.gate_b = gate_b;
    ag.A_log = A_log;
    ag.dt_bias = dt_bias;
    const double t_gates_fused = time_ms([&] { gpu::gdn_prefill(ag, ws_gates); }, reps);
    // The conv: conv1d_silu_prefill, then the prefill (gates fused, as the engine runs it), against the conv fused
    // into the WY kernel (GdnPrefillArgs::conv, the candidate HYPIC_GDN_CONV_FUSED), zero history, in rounds
    // separate, fused, fused, separate; the mean of each one's two rounds. (The separate conv writes q, k and v: the
    // later shapes' inputs are its outputs, of the same magnitude.)
    double t_conv[2] = {0, 0};  // separate, fused
    {
      check_cuda(cudaMemcpy(cu_dev, cu.data(), cu.size() * sizeof(int), cudaMemcpyHostToDevice), "cu_seqlens");
      gpu::GdnPrefillArgs af = ag;
      af.v = nullptr;
      af.conv = gpu::GdnConvIn{conv_x, conv_w, nullptr, cu_dev, kConvTaps};
      for (int round = 0; round < 4; ++round) {
        const bool fused = round == 1 || round == 2;
        t_conv[fused] += time_ms(
                             [&] {
                               if (!fused)
                                 gpu::conv1d_silu_prefill(c.nseq, cu_dev, T, kConvChannels, kConvTaps, conv_x, conv_w,
                                                          nullptr, gpu::ConvQkvOut{in.q, in.k, in.v, HK * D});
                               gpu::gdn_prefill(fused ? af : ag, ws_conv);
                             },
                             reps) /
                         2;
      }
    }
    // Nominal FLOPs per (chunk, v-head), C = 64: K K^T 2C^2D, W and U 4C^2D, scan 4CD^2,
    // output (Q K^T, P V) 4C^2D + Q h 2CD^2; T_C adds 4CD^2 (triangular savings not counted).
    const double chunks = double(T) / gpu::kGdnChunk * HV, Cc = gpu::kGdnChunk;
    const double flops = chunks * (10 * Cc * Cc * D + 6 * Cc * D * D);
    const double flops_tc = flops + chunks * 4 * Cc * D * D;
    // Compulsory bytes: q, k, v in, out, g and beta, final state (and T_C) out.
    const double bytes = double(T) * (2.0 * HK * D * 2 + HV * D * 2 * 2 + HV * 8) + double(c.nseq) * HV * D * D * 4;
    const double bytes_tc = bytes + double(c.nseq) * HV * D * D * 4;
    const double tflops = flops / (t_plain * 1e-3) / 1e12, gbps = bytes / (t_plain * 1e-3) / 1e9;
    std::printf("%-7s %6d %10.3f %10.3f %7.1f%% %10.3f %10.3f %10.1f %8.1f%% %9.0f %8.1f%%\n", c.name, parts, t_plain,
                t_tc, 100.0 * (t_tc / t_plain - 1.0), t_whole, t_noout, tflops, 100.0 * tflops / peak_tf, gbps,
                100.0 * gbps / peak_bw);
    std::printf("        gates: gdn_gates + prefill %.3f ms, fused into the prefill %.3f ms (%.2fx)\n", t_gates_sep,
                t_gates_fused, t_gates_sep / t_gates_fused);
    std::printf("        conv: conv1d_silu_prefill + prefill %.3f ms, fused into the WY kernel (HYPIC_GDN_CONV_FUSED) "
                "%.3f ms (%.3fx)\n",
                t_conv[0], t_conv[1], t_conv[1] / t_conv[0]);
    std::printf("        on wgmma: scan (HYPIC_GDN_SCAN_WGMMA) %.3f ms, WY (HYPIC_GDN_WY_WGMMA) %.3f ms, both %.3f ms "
                "against %.3f ms by default (%.3fx / %.3fx / %.3fx)\n",
                t_mode[1], t_mode[2], t_mode[3], t_mode[0], t_mode[1] / t_mode[0], t_mode[2] / t_mode[0],
                t_mode[3] / t_mode[0]);
    if (t_stage[0] > 0)
      std::printf("        scan staging: cp.async %.3f ms, without its L2 prefetch (HYPIC_GDN_SCAN_NO_L2_PREFETCH) "
                  "%.3f ms (%.3fx), W/K/Q/P by TMA (HYPIC_GDN_SCAN_TMA) %.3f ms (%.3fx), all by TMA "
                  "(HYPIC_GDN_SCAN_TMA_ALL) %.3f ms (%.3fx of TMA)%s\n",
                  t_stage[0], t_stage[1], t_stage[1] / t_stage[0], t_stage[2], t_stage[2] / t_stage[0], t_stage[3],
                  t_stage[3] / t_stage[2], tma_ran ? "" : " [TMA maps refused: the cp.async staging ran]");
    J["prefill"].push_back({{"shape", c.name},
                            {"num_seqs", c.nseq},
                            {"seq_len", c.len},
                            {"tokens", T},
                            {"scan_parts", parts},
                            {"ms_without_tc", t_plain},
                            {"ms_whole_sequence_scan", t_whole},
                            {"ms_with_tc", t_tc},
                            {"tc_overhead_pct", 100.0 * (t_tc / t_plain - 1.0)},
                            {"ms_wy_plus_scan_no_output", t_noout},
                            {"ms_gates_separate_kernel_plus_prefill", t_gates_sep},
                            {"ms_gates_fused", t_gates_fused},
                            {"ms_conv_then_prefill", t_conv[0]},
                            {"ms_conv_fused", t_conv[1]},
                            {"ms_default_beside_wgmma", t_mode[0]},
                            {"ms_wgmma_scan", t_mode[1]},
                            {"ms_wgmma_wy", t_mode[2]},
                            {"ms_wgmma_wy_and_scan", t_mode[3]},
                            {"ms_scan_staging_cp_async", t_stage[0]},
                            {"ms_scan_staging_no_l2_prefetch", t_stage[1]},
                            {"ms_scan_staging_tma", t_stage[2]},
                            {"ms_scan_staging_tma_all", t_stage[3]},
                            {"scan_staging_tma_ran", tma_ran},
                            {"nominal_gflop", flops / 1e9},
                            {"nominal_gflop_with_tc", flops_tc / 1e9},
                            {"compulsory_MB", bytes / 1e6},
                            {"TFLOPs", tflops},
                            {"TFLOPs_with_tc", flops_tc / (t_tc * 1e-3) / 1e12},
                            {"GBps", gbps},
                            {"GBps_with_tc", bytes_tc / (t_tc * 1e-3) / 1e9}});
  }
  if (scan_profile) profile_scans(cases, in, out, fin, J);
  J["workspace_bytes"] = ws.bytes();
  cudaFree(out);
  cudaFree(fin);
  cudaFree(tr);
  cudaFree(conv_x);
  cudaFree(conv_w);
  cudaFree(cu_dev);

  // ---- composition: 30 layers x 32 heads, fold 16 segments -------------------------------------
  {
    const int batch = 30 * HV, nseg = 16;
    const size_t mat = size_t(D) * D;
    auto* T = dalloc<float>(size_t(nseg) * batch * mat);
    auto* S = dalloc<float>(size_t(nseg) * batch * mat);
    auto* R0 = dalloc<float>(batch * mat);
    auto* R = dalloc<float>(batch * mat);
    auto* R2 = dalloc<float>(batch * mat);
    auto* scratch = dalloc<float>(batch * mat);
    fill_f32<<<4096, 256>>>(T, size_t(nseg) * batch * mat, 21, 1.5f / std::sqrt(float(D)));
    fill_f32<<<4096, 256>>>(S, size_t(nseg) * batch * mat, 22, 1.f);
    fill_f32<<<4096, 256>>>(R0, batch * mat, 23, 1.f);
    auto reset = [&](float* r) { cudaMemcpyAsync(r, R0, batch * mat * 4, cudaMemcpyDeviceToDevice); };
    const double t_reset = time_ms([&] { reset(R); }, reps);
    const double t_own = time_ms([&] { reset(R); gpu::compose_fold(batch, nseg, R, T, S); }, reps) - t_reset;
    const double t_blas =
        time_ms([&] { reset(R2); gpu::compose_fold_cublas(blas, batch, nseg, R2, T, S, scratch); }, reps) - t_reset;
    check_cuda(cudaDeviceSynchronize(), "compose");
    std::vector<float> h1(batch * mat), h2(batch * mat);
    cudaMemcpy(h1.data(), R, h1.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(h2.data(), R2, h2.size() * 4, cudaMemcpyDeviceToHost);
    double num = 0, den = 0;
    for (size_t i = 0; i < h1.size(); ++i) {
      num += (double(h1[i]) - h2[i]) * (double(h1[i]) - h2[i]);
      den += double(h2[i]) * h2[i];
    }
    const double flop = 2.0 * D * D * D * batch * nseg;
    std::printf("\ncomposition, %d (layer, head) pairs x %d segments, fp32: own kernel %.3f ms (%.3f ms/segment, "
                "%.1f TFLOP/s), cuBLAS %.3f ms (%.3f ms/segment, %.1f TFLOP/s); rel diff %.2e\n",
                batch, nseg, t_own, t_own / nseg, flop / (t_own * 1e-3) / 1e12, t_blas, t_blas / nseg,
                flop / (t_blas * 1e-3) / 1e12, std::sqrt(num / den));
    J["composition"] = {{"pairs", batch},
                        {"segments", nseg},
                        {"own_ms_total", t_own},
                        {"own_ms_per_segment", t_own / nseg},
                        {"own_TFLOPs", flop / (t_own * 1e-3) / 1e12},
                        {"cublas_ms_total", t_blas},
                        {"cublas_ms_per_segment", t_blas / nseg},
                        {"cublas_TFLOPs", flop / (t_blas * 1e-3) / 1e12},
                        {"own_vs_cublas_rel_diff", std::sqrt(num / den)}};
    for (float* p : {T, S, R0, R, R2, scratch}) cudaFree(p);
  }

  // ---- affine chain (the splice's fold): 3xTF32 tensor cores (wgmma, mma.sync) vs fp32 FMA, side by side ---------
  // A warm 16-segment hypic splice folds, per linear layer, one chain of 33 steps over 32 heads (an initial copy, then
  // per segment the seam run's (T, S) and the entry's (T_int, S_int), the running state written out after each
  // entry); an entry build of 30 layers runs the same as 30 chains in one launch.
  {
    const int steps = 33, nmat = 16;
    const size_t mat = size_t(D) * D * HV;
    auto* T = dalloc<float>(nmat * mat);
    auto* S = dalloc<float>(nmat * mat);
    auto* R0 = dalloc<float>(30 * mat);
    auto* fin = dalloc<float>(3 * 30 * mat);
    auto* outs = dalloc<float>(16 * mat);
    fill_f32<<<4096, 256>>>(T, nmat * mat, 41, 1.5f / std::sqrt(float(D)));
    fill_f32<<<4096, 256>>>(S, nmat * mat, 42, 1.f);
    fill_f32<<<4096, 256>>>(R0, 30 * mat, 43, 1.f);
    json jc = json::array();
    for (const int chains : {1, 30}) {
      std::vector<gpu::AffineStep> table;
      std::vector<const float*> init;
      std::vector<float*> fins[3];
      for (int c = 0; c < chains; ++c) {
        for (int k = 0; k < steps; ++k) {
          gpu::AffineStep st;
          if (k > 0) st.T = T + size_t((c + k) % nmat) * mat, st.S = S + size_t((c + 3 * k) % nmat) * mat;
          if (chains == 1 && k % 2 == 0 && k > 0) st.out = outs + size_t(k / 2 - 1) * mat;
          table.push_back(st);
        }
        init.push_back(R0 + size_t(c) * mat);
        for (int m = 0; m < 3; ++m) fins[m].push_back(fin + (size_t(m) * 30 + c) * mat);
      }
      gpu::AffineStep* dt = dalloc<gpu::AffineStep>(table.size());
      const float** di = dalloc<const float*>(init.size());
      float** df[3] = {dalloc<float*>(chains), dalloc<float*>(chains), dalloc<float*>(chains)};
      cudaMemcpy(dt, table.data(), table.size() * sizeof(gpu::AffineStep), cudaMemcpyHostToDevice);
      cudaMemcpy(di, init.data(), init.size() * sizeof(float*), cudaMemcpyHostToDevice);
      for (int m = 0; m < 3; ++m) cudaMemcpy(df[m], fins[m].data(), chains * sizeof(float*), cudaMemcpyHostToDevice);
      // Default 3xTF32 (wgmma on Hopper), the same products on mma.sync, fp32 FMA: side by side.
      const gpu::ChainMath maths[3] = {gpu::ChainMath::Tf32x3, gpu::ChainMath::Tf32x3Mma, gpu::ChainMath::Fp32Fma};
      double ms[3];
      for (int m = 0; m < 3; ++m)
        ms[m] = time_ms([&] { gpu::affine_chain(chains, HV, steps, dt, di, df[m], nullptr, maths[m]); }, reps);
      check_cuda(cudaDeviceSynchronize(), "affine chain");
      std::vector<float> a(chains * mat), am(chains * mat), b(chains * mat);
      cudaMemcpy(a.data(), fin, a.size() * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(am.data(), fin + 30 * mat, am.size() * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(b.data(), fin + 60 * mat, b.size() * 4, cudaMemcpyDeviceToHost);
      auto rel = [&](const std::vector<float>& x) {
        double num = 0, den = 0;
        for (size_t i = 0; i < x.size(); ++i)
          num += (double(x[i]) - b[i]) * (double(x[i]) - b[i]), den += double(b[i]) * b[i];
        return std::sqrt(num / den);
      };
      const double flop = 2.0 * D * D * D * HV * chains * (steps - 1);
      std::printf("affine chain, %d chain(s) x %d heads x %d steps: 3xTF32 %.3f ms (%.1f us/step), 3xTF32 on mma.sync "
                  "%.3f ms (%.1f us/step), fp32 FMA %.3f ms (%.1f us/step): mma.sync / default %.2fx, fp32 / default "
                  "%.2fx; rel diff to fp32 %.2e (mma.sync %.2e)\n",
                  chains, HV, steps, ms[0], ms[0] * 1e3 / steps, ms[1], ms[1] * 1e3 / steps, ms[2],
                  ms[2] * 1e3 / steps, ms[1] / ms[0], ms[2] / ms[0], rel(a), rel(am));
      jc.push_back({{"chains", chains}, {"heads", HV}, {"steps", steps}, {"tf32x3_ms", ms[0]}, {"tf32x3_mma_ms", ms[1]},
                    {"fp32_ms", ms[2]}, {"tf32x3_TFLOPs", flop / (ms[0] * 1e-3) / 1e12},
                    {"tf32x3_mma_TFLOPs", flop / (ms[1] * 1e-3) / 1e12}, {"fp32_TFLOPs", flop / (ms[2] * 1e-3) / 1e12},
                    {"mma_over_tf32x3", ms[1] / ms[0]}, {"fp32_over_tf32x3", ms[2] / ms[0]}, {"rel_diff", rel(a)},
                    {"rel_diff_mma", rel(am)}});
      cudaFree(dt), cudaFree(di), cudaFree(df[0]), cudaFree(df[1]), cudaFree(df[2]);
    }
    J["affine_chain"] = jc;
    for (float* p : {T, S, R0, fin, outs}) cudaFree(p);
  }

  // ---- decode step and conv1d ------------------------------------------------------------------
  {
    const int B = 64;
    GdnInputs din(B, 31);
    auto* st = dalloc<float>(size_t(B) * HV * D * D);
    auto* o = dalloc<bf16>(B * HV * D);
    fill_f32<<<2048, 256>>>(st, size_t(B) * HV * D * D, 35, 0.1f);
    const double t = time_ms(
        [&] {
          gpu::gdn_decode(B, HK, HV, din.q, din.k, din.v, din.g, din.beta, true, 1.f / std::sqrt(float(D)), st, o);
        },
        reps);
    const double bytes = 2.0 * B * HV * D * D * 4;
    std::printf("decode step, %d requests x %d heads (one layer): %.3f ms, %.0f GB/s of state traffic\n", B, HV, t,
                bytes / (t * 1e-3) / 1e9);
    // Gates: gdn_gates + gdn_decode against gdn_decode_gated (one launch fewer per layer and token).
    const float sc = 1.f / std::sqrt(float(D));
    const double t_sep = time_ms(
        [&] {
          gpu::gdn_gates(B, HV, gate_a, gate_b, A_log, dt_bias, g2, beta2);
          gpu::gdn_decode(B, HK, HV, din.q, din.k, din.v, g2, beta2, true, sc, st, o);
        },
        reps);
    const double t_fused = time_ms(
        [&] { gpu::gdn_decode_gated(B, HK, HV, din.q, din.k, din.v, gate_a, gate_b, A_log, dt_bias, true, sc, st, o); },
        reps);
    std::printf("        gates: gdn_gates + decode %.3f ms, fused into the decode step %.3f ms\n", t_sep, t_fused);
    J["decode"] = {{"batch", B},
                   {"ms", t},
                   {"state_GBps", bytes / (t * 1e-3) / 1e9},
                   {"ms_gates_separate_kernel_plus_decode", t_sep},
                   {"ms_gates_fused", t_fused}};
    cudaFree(st);
    cudaFree(o);
    for (void* p : std::initializer_list<void*>{gate_a, gate_b, g2, beta2, A_log, dt_bias}) cudaFree(p);

    const int T = 32768, Cch = 2 * HK * D + HV * D, K = 4;
    auto* x = dalloc<bf16>(size_t(T) * Cch);
    auto* y = dalloc<bf16>(size_t(T) * Cch);
    auto* w = dalloc<bf16>(size_t(Cch) * K);
    auto* cs = dalloc<bf16>(size_t(K - 1) * Cch);
    int* cu = dalloc<int>(2);
    const int cuh[2] = {0, T};
    cudaMemcpy(cu, cuh, sizeof(cuh), cudaMemcpyHostToDevice);
    fill_bf16<<<2048, 256>>>(x, size_t(T) * Cch, 41);
    fill_bf16<<<64, 256>>>(w, size_t(Cch) * K, 42);
    cudaMemset(cs, 0, size_t(K - 1) * Cch * 2);
    const double tc = time_ms([&] { gpu::conv1d_silu_prefill(1, cu, T, Cch, K, x, w, cs, y); }, reps);
    const double cb = 2.0 * T * Cch * 2;
    std::printf("conv1d+SiLU prefill, 32k tokens x %d channels: %.3f ms, %.0f GB/s\n", Cch, tc, cb / (tc * 1e-3) / 1e9);
    J["conv_prefill"] = {{"tokens", T}, {"channels", Cch}, {"ms", tc}, {"GBps", cb / (tc * 1e-3) / 1e9}};
    for (void* p : std::initializer_list<void*>{x, y, w, cs, cu}) cudaFree(p);
  }
  cublasDestroy(blas);
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << J.dump(2) << "\n";
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "gdn_bench: %s\n", e.what());
  return 1;
}
