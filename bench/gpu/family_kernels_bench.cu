// Benchmark of the linear-attention kernels of the non-Qwen hybrid families, bf16 activations, at real shapes.
// Lightning attention (kernels/cuda/lightning.h) at the linear-layer shapes of MiniMax-Text-01 (64 heads of 128) and
// Ring-mini-linear-2.0 (16 heads of 128): chunked prefill
// with outputs and T_C (one sequence of 4k / 16k / 32k tokens, 16 segments of 2k), unsplit and with the automatic
// sequence-parallel parts, the states-only pass (an entry build without outputs), the decode step at batch 1 and 64,
// and the scalar composition of 2 cached segments over every layer and head; the H200 ceilings (device copy bandwidth, bf16 GEMM rate through
// cuBLAS) measured in the same run. FLOP counts are the chunked form's useful work per token and head:
// 4 d^2 (inter-chunk product and state update) + 64 d (the causal half of the intra-chunk products).
// KDA (kernels/cuda/kda.h) at Kimi-Linear-48B-A3B's shape (32 heads of 128): prefill with outputs and T_C, outputs
// only, states and T_C only, at the same token shapes, beside the Gated DeltaNet prefill (gated_delta.h) at
// Qwen3.5-35B-A3B's shape (16 key / 32 value heads of 128) in the same run; the KDA decode step at batch 1 and 64.
// Prints a human table and writes JSON (--json PATH).
//
// Usage: family_kernels_bench [--json out.json] [--reps N]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/gpu/bench_util.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/lightning.h"

namespace gpu = hypic::kernels::cuda;
using gpu::bf16;
using gpu::check_cuda;
using nlohmann::json;
using namespace hypic::bench;

namespace {

constexpr int D = 128;

// MiniMax-Text-01's slope rates for layer 0 of 80 (HF MiniMaxLightningAttention: 2^{-8h/H} scaled by the layer's
// 1 - l / (L - 1) + 1e-5).
std::vector<float> slopes(int heads) {
  std::vector<float> s(heads);
  for (int h = 0; h < heads; ++h) s[h] = std::pow(2.0f, -8.0f * float(h + 1) / float(heads)) * (1.0f + 1e-5f);
  return s;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string json_path;
  int reps = 20;
  if (!parse_json_reps(argc, argv, "family_kernels_bench", json_path, reps)) return 2;
  cudaDeviceProp prop{};
  json J = device_header(reps, prop);
  J["chunk"] = gpu::kLightningChunk;

  cublasHandle_t blas;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
  measure_ceilings(blas, J);
  const double peak_tf = J["ceiling"]["bf16_gemm_TFLOPs"], peak_bw = J["ceiling"]["copy_GBps"];
  std::printf("device %s, %d SMs; measured ceilings: copy %.0f GB/s, bf16 GEMM %.0f TFLOP/s\n\n", prop.name,
              prop.multiProcessorCount, peak_bw, peak_tf);

  struct Model {
    const char* name;
    int heads;
  };
  const Model models[] = {{"minimax_text_01", 64}, {"ring_mini_linear_2", 16}};
  struct Case {
    const char* name;
    int nseq, len;
  };
  const Case cases[] = {{"1x4k", 1, 4096}, {"1x16k", 1, 16384}, {"1x32k", 1, 32768}, {"16x2k", 16, 2048}};
  std::printf("%-20s %-6s %6s %11s %11s %11s %9s %9s\n", "model", "shape", "parts", "unsplit ms", "auto ms",
              "states ms", "TFLOP/s", "of GEMM");
  for (const Model& md : models) {
    const int H = md.heads;
    const size_t maxT = 32768, row = size_t(H) * D;
    auto* q = dalloc<bf16>(maxT * row);
    auto* k = dalloc<bf16>(maxT * row);
    auto* v = dalloc<bf16>(maxT * row);
    auto* out = dalloc<bf16>(maxT * row);
    auto* fin = dalloc<float>(size_t(16) * H * D * D);
    auto* tr = dalloc<float>(size_t(16) * H);
    auto* sl = dalloc<float>(H);
    fill_bf16<<<2048, 256>>>(q, maxT * row, 3, 0.3f);
    fill_bf16<<<2048, 256>>>(k, maxT * row, 4, 0.3f);
    fill_bf16<<<2048, 256>>>(v, maxT * row, 5, 1.0f);
    const auto s_h = slopes(H);
    check_cuda(cudaMemcpy(sl, s_h.data(), H * sizeof(float), cudaMemcpyHostToDevice), "slopes");
    for (const Case& c : cases) {
      std::vector<int> cu(c.nseq + 1);
      for (int i = 0; i <= c.nseq; ++i) cu[i] = i * c.len;
      int* dcu = dalloc<int>(cu.size());
      check_cuda(cudaMemcpy(dcu, cu.data(), cu.size() * sizeof(int), cudaMemcpyHostToDevice), "cu_seqlens");
      gpu::LightningPrefillArgs a;
      a.num_seqs = c.nseq, a.cu_seqlens = dcu, a.max_seqlen = c.len, a.num_heads = H, a.head_dim = D;
      a.q = q, a.k = k, a.v = v, a.slope = sl, a.final_state = fin, a.transition = tr, a.out = out;
      a.seq_parts = 0;
      const int parts = gpu::lightning_scan_parts(a);
      const size_t ws_bytes = gpu::lightning_prefill_workspace_bytes(a);
      void* ws = dalloc<unsigned char>(ws_bytes);
      a.workspace = ws, a.workspace_bytes = ws_bytes;
      const double t_auto = time_ms([&] { gpu::lightning_prefill(a); }, reps);
      gpu::LightningPrefillArgs a1 = a;
      a1.seq_parts = 1, a1.workspace = nullptr, a1.workspace_bytes = 0;
      const double t_one = time_ms([&] { gpu::lightning_prefill(a1); }, reps);
      gpu::LightningPrefillArgs as = a;
      as.out = nullptr;
      const size_t ws2 = gpu::lightning_prefill_workspace_bytes(as);
      void* wsb = dalloc<unsigned char>(ws2);
      as.workspace = wsb, as.workspace_bytes = ws2;
      const double t_states = time_ms([&] { gpu::lightning_prefill(as); }, reps);
      const double T = double(c.nseq) * c.len;
      const double flops = T * H * (4.0 * D * D + 64.0 * D);
      const double best = std::min(t_auto, t_one);
      const double tf = flops / (best * 1e-3) / 1e12;
      std::printf("%-20s %-6s %6d %11.3f %11.3f %11.3f %9.1f %8.1f%%\n", md.name, c.name, parts, t_one, t_auto,
                  t_states, tf, 100.0 * tf / peak_tf);
      J["prefill"].push_back({{"model", md.name}, {"heads", H}, {"shape", c.name}, {"seqs", c.nseq}, {"len", c.len},
                              {"parts_auto", parts}, {"unsplit_ms", t_one}, {"auto_ms", t_auto},
                              {"states_only_ms", t_states}, {"TFLOPs", tf}});
      cudaFree(dcu);
      cudaFree(ws);
      cudaFree(wsb);
    }
    // Decode step, contexts' states in a slot pool.
    for (int B : {1, 64}) {
      auto* st = dalloc<float>(size_t(B) * H * D * D);
      check_cuda(cudaMemset(st, 0, size_t(B) * H * D * D * sizeof(float)), "memset");
      const double t = time_ms([&] { gpu::lightning_decode(B, H, D, q, k, v, sl, st, out); }, reps * 5);
      const double bytes = 2.0 * B * H * D * D * sizeof(float);
      std::printf("%-20s decode batch %2d (one layer): %.4f ms, %.0f GB/s of state traffic (%.0f%% of copy)\n",
                  md.name, B, t, bytes / (t * 1e-3) / 1e9, 100.0 * bytes / (t * 1e-3) / 1e9 / peak_bw);
      J["decode"].push_back({{"model", md.name}, {"batch", B}, {"ms", t}, {"GBps", bytes / (t * 1e-3) / 1e9}});
      cudaFree(st);
    }
    // Composition of 16 cached segments over every (layer, head): 70 lightning layers (MiniMax) or 16 (Ring-mini).
    {
      const int layers = H == 64 ? 70 : 16, segs = 2, batch = layers * H, dim = D * D;
      auto* run = dalloc<float>(size_t(batch) * dim);
      auto* Ss = dalloc<float>(size_t(segs) * batch * dim);
      auto* Ts = dalloc<float>(size_t(segs) * batch);
      check_cuda(cudaMemset(run, 0, size_t(batch) * dim * sizeof(float)), "memset");
      check_cuda(cudaMemset(Ts, 0, size_t(segs) * batch * sizeof(float)), "memset");
      check_cuda(cudaMemset(Ss, 0, size_t(segs) * batch * dim * sizeof(float)), "memset");
      const double t = time_ms([&] { gpu::scalar_compose_fold(batch, dim, segs, run, Ts, Ss); }, reps);
      const double bytes = (2.0 + segs) * batch * double(dim) * sizeof(float);
      std::printf("%-20s compose 2 segments x %d layers x %d heads: %.3f ms, %.0f GB/s\n", md.name, layers, H, t,
                  bytes / (t * 1e-3) / 1e9);
      J["compose"].push_back({{"model", md.name}, {"layers", layers}, {"segments", 2}, {"ms", t},
                              {"GBps", bytes / (t * 1e-3) / 1e9}});
      cudaFree(run);
      cudaFree(Ss);
      cudaFree(Ts);
    }
    for (void* p : std::initializer_list<void*>{q, k, v, out, fin, tr, sl}) cudaFree(p);
  }

  // ---- KDA (Kimi-Linear-48B-A3B: 32 heads of 128) beside the Gated DeltaNet prefill (Qwen3.5-35B-A3B) ----------
  {
    const int H = 32, HK = 16;
    const size_t maxT = 32768, row = size_t(H) * D;
    auto* q = dalloc<bf16>(maxT * row);
    auto* k = dalloc<bf16>(maxT * row);
    auto* v = dalloc<bf16>(maxT * row);
    auto* out = dalloc<bf16>(maxT * row);
    auto* g = dalloc<float>(maxT * row);
    auto* beta = dalloc<float>(maxT * H);
    auto* fin = dalloc<float>(size_t(16) * H * D * D);
    auto* tr = dalloc<float>(size_t(16) * H * D * D);
    fill_bf16<<<2048, 256>>>(q, maxT * row, 13);
    fill_bf16<<<2048, 256>>>(k, maxT * row, 14);
    fill_bf16<<<2048, 256>>>(v, maxT * row, 15);
    fill_f32<<<2048, 256>>>(g, maxT * row, 16, 0.02f);  // |g| < 0.02: slow decays (their sign is fixed below)
    fill_f32<<<2048, 256>>>(beta, maxT * H, 17, 0.45f);
    {
      std::vector<float> gh(maxT * row), bh(maxT * H);
      check_cuda(cudaMemcpy(gh.data(), g, gh.size() * 4, cudaMemcpyDeviceToHost), "g");
      check_cuda(cudaMemcpy(bh.data(), beta, bh.size() * 4, cudaMemcpyDeviceToHost), "beta");
      for (auto& x : gh) x = -std::abs(x);
      for (auto& x : bh) x = 0.5f + x;
      check_cuda(cudaMemcpy(g, gh.data(), gh.size() * 4, cudaMemcpyHostToDevice), "g");
      check_cuda(cudaMemcpy(beta, bh.data(), bh.size() * 4, cudaMemcpyHostToDevice), "beta");
    }
    std::printf("\n%-20s %-6s %12s %12s %12s %14s\n", "kimi_linear KDA", "shape", "out+T_C ms", "out ms",
                "T_C only ms", "GDN out+T_C ms");
    gpu::GdnWorkspace gws;
    for (const Case& c : cases) {
      std::vector<int> cu(c.nseq + 1);
      for (int i = 0; i <= c.nseq; ++i) cu[i] = i * c.len;
      int* dcu = dalloc<int>(cu.size());
      check_cuda(cudaMemcpy(dcu, cu.data(), cu.size() * sizeof(int), cudaMemcpyHostToDevice), "cu_seqlens");
      gpu::KdaPrefillArgs a;
      a.num_seqs = c.nseq, a.cu_seqlens = dcu, a.total_tokens = c.nseq * c.len, a.num_heads = H;
      a.q = q, a.k = k, a.v = v, a.g = g, a.beta = beta, a.final_state = fin, a.transition = tr, a.out = out;
      const size_t wsb = gpu::kda_prefill_workspace_bytes(a);
      void* ws = dalloc<unsigned char>(wsb);
      a.workspace = ws, a.workspace_bytes = wsb;
      const double t_all = time_ms([&] { gpu::kda_prefill(a); }, reps);
      gpu::KdaPrefillArgs ao = a;
      ao.transition = nullptr;
      const double t_out = time_ms([&] { gpu::kda_prefill(ao); }, reps);
      gpu::KdaPrefillArgs at = a;
      at.out = nullptr;
      const double t_tc = time_ms([&] { gpu::kda_prefill(at); }, reps);
      // Gated DeltaNet at Qwen3.5's shape on the same token layout (q, k: 16 heads; v: 32).
      gpu::GdnPrefillArgs ga;
      ga.num_seqs = c.nseq, ga.cu_seqlens_host = cu.data(), ga.num_k_heads = HK, ga.num_v_heads = H;
      ga.q = q, ga.k = k, ga.v = v, ga.g = g, ga.beta = beta;  // g, beta: [T][H] prefixes of the KDA buffers
      ga.final_state = fin, ga.transition = tr, ga.out = out;
      const double t_gdn = time_ms([&] { gpu::gdn_prefill(ga, gws); }, reps);
      std::printf("%-20s %-6s %12.3f %12.3f %12.3f %14.3f\n", "", c.name, t_all, t_out, t_tc, t_gdn);
      J["kda"].push_back({{"shape", c.name}, {"seqs", c.nseq}, {"len", c.len}, {"heads", H}, {"out_tc_ms", t_all},
                          {"out_ms", t_out}, {"tc_only_ms", t_tc}, {"gdn_out_tc_ms", t_gdn},
                          {"workspace_bytes", wsb}});
      cudaFree(dcu);
      cudaFree(ws);
    }
    for (int B : {1, 64}) {
      auto* st = dalloc<float>(size_t(B) * H * D * D);
      check_cuda(cudaMemset(st, 0, size_t(B) * H * D * D * sizeof(float)), "memset");
      const double t = time_ms([&] { gpu::kda_decode(B, H, q, k, v, g, beta, true, 0.0883883f, st, out); }, reps * 5);
      const double bytes = 2.0 * B * H * D * D * sizeof(float);
      std::printf("kimi_linear KDA decode batch %2d (one layer): %.4f ms, %.0f GB/s of state traffic (%.0f%% of copy)\n",
                  B, t, bytes / (t * 1e-3) / 1e9, 100.0 * bytes / (t * 1e-3) / 1e9 / peak_bw);
      J["kda_decode"].push_back({{"batch", B}, {"ms", t}, {"GBps", bytes / (t * 1e-3) / 1e9}});
      cudaFree(st);
    }
    for (void* p : std::initializer_list<void*>{q, k, v, out, g, beta, fin, tr}) cudaFree(p);
  }
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << J.dump(2) << "\n";
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "family_kernels_bench: %s\n", e.what());
  return 1;
}
