// Weight-streaming read rate at batch-1 decode shapes: how fast a grid of few blocks reads a bf16 weight matrix that
// is not in L2, by four load paths side by side in one run:
//   decode_linear  the production kernel (kernels/cuda/decode_linear.h: per-lane 16-byte cp.async rings, M = 1),
//                  with x loaded after each stage's wait and ahead (HYPIC_STREAM_X_AHEAD);
//   cp.async rows  decode_linear's grid, warps and addressing with the copies alone (64 or 256 contiguous bytes
//                  per row and stage);
//   cp.async ring  per-lane cp.async rings with no math over contiguous bytes (what the copies alone cost);
//   bulk ring      one thread per block issuing 1-D bulk copies (cp.async.bulk, the TMA engine) into a ring of
//                  shared-memory stages completed on mbarriers, every thread reading each stage back;
//   ld.global      plain 16-byte loads, 8 in flight per thread.
// The question it answers: are the batch-1 projections (16.8 MB out_proj over 128 blocks at 1.4 TB/s under Nsight
// Compute) limited by how many bytes an SM keeps in flight with per-lane copies, which bulk copies would lift?
// Each kernel reads block b's contiguous bytes [b R, (b + 1) R) of one of `copies` weight copies in turn (together
// at least 4x the L2, so every launch reads DRAM); a CUDA graph of `copies` launches is timed with events, median
// of --reps graph runs, and the figure is bytes / (graph time / launches): per-launch time including the gaps of
// back-to-back launches in a graph (the same for every path). Output: a human table and --json.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/gpu/bench_util.cuh"
#include "kernels/cuda/decode_linear.h"
#include "kernels/cuda/stream_gemm.cuh"
#include "kernels/cuda/switches.h"
#include "kernels/cuda/wgmma.cuh"

namespace {

using hypic::bench::dalloc;
using hypic::kernels::cuda::check_cuda;
using hypic::kernels::cuda::sm90::mbar_arrive_expect_tx;
using hypic::kernels::cuda::sm90::mbar_init;
using hypic::kernels::cuda::sm90::mbar_wait;
using hypic::kernels::cuda::sm90::smem_u32;
using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;

// 1-D bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> this CTA's shared memory,
// completing on `bar` (PTX ISA: cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes).
__device__ __forceinline__ void bulk_g2s(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_u32(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

struct Region {
  const uint4* base;  // the block's first 16-byte word
  long words;         // its 16-byte words
};
__device__ __forceinline__ Region block_region(const uint4* w, long total_words) {
  const long per = total_words / gridDim.x;
  const long b0 = per * blockIdx.x;
  return {w + b0, blockIdx.x + 1 == gridDim.x ? total_words - b0 : per};
}

// Bulk ring: stages of `stage_words` 16-byte words, S stages; thread 0 issues, everyone reads each stage back.
__global__ void __launch_bounds__(kThreads) bulk_ring_kernel(const uint4* w, long total_words, int stage_words, int S,
                                                             uint4* out) {
  extern __shared__ __align__(128) uint4 ring[];
  __shared__ __align__(8) uint64_t full[32];
  const Region r = block_region(w, total_words);
  const long n = (r.words + stage_words - 1) / stage_words;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](long i) {
    const long w0 = i * stage_words;
    const int words = int(::min(long(stage_words), r.words - w0));
    const int s = int(i % S);
    mbar_arrive_expect_tx(&full[s], uint32_t(words) * 16u);
    bulk_g2s(ring + long(s) * stage_words, r.base + w0, uint32_t(words) * 16u, &full[s]);
  };
  if (threadIdx.x == 0)
    for (long i = 0; i < ::min(long(S), n); ++i) issue(i);
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long i = 0; i < n; ++i) {
    const int s = int(i % S);
    mbar_wait(&full[s], uint32_t((i / S) & 1));
    const int words = int(::min(long(stage_words), r.words - i * stage_words));
    for (int k = threadIdx.x; k < words; k += kThreads) {
      const uint4 v = ring[long(s) * stage_words + k];
      acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
    }
    __syncthreads();  // the stage is read before it is refilled
    if (threadIdx.x == 0 && i + S < n) issue(i + S);
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) out[blockIdx.x] = acc;  // keeps the reads
}

// Plain loads: each thread 8 x 16 bytes in flight, strided by the block.
__global__ void __launch_bounds__(kThreads) ld_global_kernel(const uint4* w, long total_words, uint4* out) {
  const Region r = block_region(w, total_words);
  uint4 acc = make_uint4(0, 0, 0, 0);
  constexpr int U = 8;
  for (long k0 = 0; k0 < r.words; k0 += long(U) * kThreads) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long k = k0 + long(u) * kThreads + threadIdx.x;
      v[u] = k < r.words ? __ldcs(r.base + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc.x ^= v[u].x, acc.y ^= v[u].y, acc.z ^= v[u].z, acc.w ^= v[u].w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) out[blockIdx.x] = acc;
}

// Per-lane cp.async rings as stream_gemm.cuh fills them, without the math: each warp a contiguous eighth of the
// block's region, S stages of 32 lanes x 2 x 16 bytes.
template <int S>
__global__ void __launch_bounds__(kThreads) cp_async_ring_kernel(const uint4* w, long total_words, uint4* out) {
  extern __shared__ __align__(128) uint4 ring_all[];
  using namespace hypic::kernels::cuda::detail;
  const Region r = block_region(w, total_words);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long per = r.words / kStreamWarps;
  const uint4* base = r.base + per * warp;
  const long words = warp + 1 == kStreamWarps ? r.words - per * warp : per;
  const long n = words / 64;  // whole stages only (the tail, under 1 KB per warp, is left out of the figure)
  uint4* ring = ring_all + warp * S * 64;
  auto issue = [&](long i, int s) {
    const uint4* src = base + i * 64;
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(smem_addr(ring + s * 64 + lane)),
                 "l"(src + lane) : "memory");
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(smem_addr(ring + s * 64 + 32 + lane)),
                 "l"(src + 32 + lane) : "memory");
  };
#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (s < n) issue(s, s);
    cp_async_commit_stream();
  }
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long i = 0; i < n; ++i) {
    cp_async_wait_stream<S - 1>();
    const int s = int(i % S);
    const uint4 a = ring[s * 64 + lane], b = ring[s * 64 + 32 + lane];
    acc.x ^= a.x ^ b.x, acc.y ^= a.y ^ b.y, acc.z ^= a.z ^ b.z, acc.w ^= a.w ^ b.w;
    if (i + S < n) issue(i + S, s);
    cp_async_commit_stream();
  }
  cp_async_wait_stream<0>();
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

// decode_linear's own addressing without the math: warp (row group, K slice) as decode_linear_kernel assigns them
// (ks slices, 8 / ks row groups per block), lane (g, q) copying rows g and g + 8 of its row group, C chunks of 32 k
// per stage (C = 1: decode_linear's stage, 64 contiguous bytes per row; C = 4: 256 bytes per row), S stages.
template <int S, int C>
__global__ void __launch_bounds__(kThreads) cp_async_rows_kernel(const bf16* W, int N, int K, int ks_count,
                                                                 uint4* out) {
  extern __shared__ __align__(128) uint4 ring_all[];
  using namespace hypic::kernels::cuda::detail;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int rg = blockIdx.x * (kStreamWarps / ks_count) + warp / ks_count, ks = warp % ks_count;
  if (rg * 16 >= N) return;
  const bf16* wlo = W + size_t(min(rg * 16 + g, N - 1)) * K + q * 8;
  const bf16* whi = W + size_t(min(rg * 16 + 8 + g, N - 1)) * K + q * 8;
  const int kt = K / kStreamChunk / C;  // stages over K
  const int kb = (ks * kt) / ks_count, n = ((ks + 1) * kt) / ks_count - kb;
  uint4* ring = ring_all + warp * S * 64 * C;
  auto issue = [&](int i, int s) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int k = ((kb + i) * C + c) * kStreamChunk;
      asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(
                       smem_addr(ring + (s * C + c) * 64 + lane)), "l"(wlo + k) : "memory");
      asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(
                       smem_addr(ring + (s * C + c) * 64 + 32 + lane)), "l"(whi + k) : "memory");
    }
  };
#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (s < n) issue(s, s);
    cp_async_commit_stream();
  }
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int i = 0; i < n; ++i) {
    cp_async_wait_stream<S - 1>();
    const int s = i % S;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const uint4 a = ring[(s * C + c) * 64 + lane], b = ring[(s * C + c) * 64 + 32 + lane];
      acc.x ^= a.x ^ b.x, acc.y ^= a.y ^ b.y, acc.z ^= a.z ^ b.z, acc.w ^= a.w ^ b.w;
    }
    if (i + S < n) issue(i + S, s);
    cp_async_commit_stream();
  }
  cp_async_wait_stream<0>();
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

struct Shape {
  int N, K;
};

// Median ms of one graph run of `launches` back-to-back launches made by `launch(i)`.
double graph_ms(int launches, int reps, const std::function<void(int, cudaStream_t)>& launch) {
  cudaStream_t st;
  check_cuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  cudaGraph_t g;
  check_cuda(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
  for (int i = 0; i < launches; ++i) launch(i, st);
  check_cuda(cudaStreamEndCapture(st, &g), "end capture");
  cudaGraphExec_t ge;
  check_cuda(cudaGraphInstantiate(&ge, g, 0), "instantiate");
  const double ms = hypic::bench::time_ms(
      [&] {
        check_cuda(cudaGraphLaunch(ge, st), "graph launch");
        check_cuda(cudaStreamSynchronize(st), "graph run");
      },
      reps, 2);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(st);
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hypic-bench-stream: weight-streaming read rate of few-block grids at batch-1 decode shapes"};
  // The batch-1 projections of Qwen3.5-35B-A3B (out_proj / o_proj, the GDN in_proj, the router, a dense 8192-row
  // one) and a 256 MiB matrix: the read rate a long stream reaches (the ceiling the short ones are measured against).
  std::string shapes_s = "2048x4096,12352x2048,256x2048,8192x2048,65536x2048";
  std::string json_path;
  int reps = 20;
  int stage_kb = 16;
  app.add_option("--shapes", shapes_s, "comma-separated NxK weight shapes (bf16 [N][K])");
  app.add_option("--reps", reps, "graph runs timed (median)");
  app.add_option("--stage-kb", stage_kb, "bulk ring stage size in KiB");
  app.add_option("--json", json_path, "write the figures here");
  CLI11_PARSE(app, argc, argv);
  std::vector<Shape> shapes;
  for (size_t p = 0; p < shapes_s.size();) {
    const size_t c = shapes_s.find(',', p);
    const std::string s = shapes_s.substr(p, c == std::string::npos ? std::string::npos : c - p);
    const size_t x = s.find('x');
    if (x == std::string::npos) {
      std::fprintf(stderr, "--shapes: '%s' is not NxK\n", s.c_str());
      return 2;
    }
    shapes.push_back({std::stoi(s.substr(0, x)), std::stoi(s.substr(x + 1))});
    p = c == std::string::npos ? shapes_s.size() : c + 1;
  }
  cudaDeviceProp prop;
  nlohmann::json J = hypic::bench::device_header(reps, prop);
  cublasHandle_t blas;
  cublasCreate(&blas);
  hypic::bench::measure_ceilings(blas, J);
  const int sms = prop.multiProcessorCount;
  const long l2 = prop.l2CacheSize;
  // The kernels' sink (written only when a block's xor of what it read hits a magic value): one 16-byte word per
  // thread of the largest grid any shape launches (at most one 16-row group per block, or 3 blocks per SM).
  long max_blocks = 3L * prop.multiProcessorCount;
  for (const Shape& sh : shapes) max_blocks = std::max<long>(max_blocks, (sh.N + 15) / 16);
  uint4* out = dalloc<uint4>(size_t(max_blocks) * kThreads);
  std::printf("device %s, %d SMs, L2 %ld MB, copy ceiling %.0f GB/s\n", prop.name, sms, l2 >> 20,
              J["ceiling"]["copy_GBps"].get<double>());
  std::printf("%-12s %-22s %7s %9s %9s\n", "shape", "path", "blocks", "us", "GB/s");
  if (stage_kb < 1 || stage_kb > 96) {
    std::fprintf(stderr, "--stage-kb %d: a bulk ring stage is 1 to 96 KiB (two stages fit an SM's shared memory)\n",
                 stage_kb);
    return 2;
  }
  const int stage_words = stage_kb * 1024 / 16;
  // Shared memory per block: about 200 KiB per SM split among the blocks an SM holds.
  auto bulk_stages = [&](int per_sm) {
    return std::max(2, std::min(32, int(200 * 1024 / per_sm / (stage_words * 16))));
  };
  check_cuda(cudaFuncSetAttribute(bulk_ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  bulk_stages(1) * stage_words * 16),
             "bulk smem");
  check_cuda(cudaFuncSetAttribute(cp_async_ring_kernel<16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  16 * 64 * 16 * 8),
             "cp.async smem");
  // Every kernel above 48 KiB of dynamic shared memory says so before a launch (a refused launch would invalidate
  // the graph capture).
  const std::pair<const void*, int> big_smem[] = {
      {reinterpret_cast<const void*>(cp_async_rows_kernel<16, 1>), 16 * 64 * 16 * 8},
      {reinterpret_cast<const void*>(cp_async_rows_kernel<4, 4>), 16 * 64 * 16 * 8},
      {reinterpret_cast<const void*>(cp_async_rows_kernel<8, 1>), 8 * 64 * 16 * 8},
      {reinterpret_cast<const void*>(cp_async_rows_kernel<2, 4>), 8 * 64 * 16 * 8}};
  for (const auto& [fn, bytes] : big_smem)
    check_cuda(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "cp.async rows smem");
  check_cuda(cudaFuncSetAttribute(cp_async_ring_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  8 * 64 * 16 * 8),
             "cp.async smem");
  for (const Shape& sh : shapes) {
    const size_t elems = size_t(sh.N) * sh.K, bytes = elems * 2;
    const int copies = int(std::max<long>(8, (4 * l2 + long(bytes) - 1) / long(bytes)));
    std::vector<bf16*> W(copies);
    for (auto& w : W) {
      w = dalloc<bf16>(elems);
      hypic::bench::fill_bf16<<<1024, 256>>>(w, elems, 7);
    }
    bf16* x = dalloc<bf16>(sh.K);
    float* y = dalloc<float>(sh.N);
    hypic::bench::fill_bf16<<<64, 256>>>(x, sh.K, 3);
    check_cuda(cudaDeviceSynchronize(), "fills");
    const long words = long(bytes / 16);
    const int rg = (sh.N + 15) / 16;
    nlohmann::json row;
    row["N"] = sh.N;
    row["K"] = sh.K;
    row["bytes"] = bytes;
    auto report = [&](const std::string& path, int blocks, double ms) {
      const double us = ms * 1e3 / copies, gbps = double(bytes) / (us * 1e-6) / 1e9;
      std::printf("%-12s %-22s %7d %9.2f %9.0f\n", (std::to_string(sh.N) + "x" + std::to_string(sh.K)).c_str(),
                  path.c_str(), blocks, us, gbps);
      row["paths"].push_back({{"path", path}, {"blocks", blocks}, {"us", us}, {"GBps", gbps}});
    };
    // decode_linear's launched blocks: K slices for one wave at one token's ring shape, 8 / slices row groups each.
    const int kt_all = sh.K / hypic::kernels::cuda::detail::kStreamChunk;
    const int dl_ks = hypic::kernels::cuda::detail::stream_k_slices_for(
        kt_all, rg, long(sms) * hypic::kernels::cuda::detail::stream_blocks_per_sm(8, 1));
    const int dl_blocks = (rg + 8 / dl_ks - 1) / (8 / dl_ks);
    // decode_linear picks its own grid (one wave, K slices); the copy-only paths run at 1, 2 and 3 blocks per SM
    // and at the decode_linear grid (whole 16-row groups, 8 per block at most).
    // decode_linear with x loaded after each stage's wait (HYPIC_STREAM_X_AHEAD=0) and ahead (the default).
    for (const bool ahead : {false, true}) {
      hypic::kernels::cuda::CandidateScope xa("HYPIC_STREAM_X_AHEAD");
      xa.set(ahead);
      report(ahead ? "decode_linear x ahead" : "decode_linear", dl_blocks,
             graph_ms(copies, reps, [&](int i, cudaStream_t st) {
               hypic::kernels::cuda::DecodeLinearOutput o{W[i], sh.N, y, sh.N};
               hypic::kernels::cuda::decode_linear(1, sh.K, x, sh.K, &o, 1,
                                                   hypic::kernels::cuda::DecodeLinearEpilogue::StoreF32, st);
             }));
    }
    // decode_linear's grid and addressing with the copies alone: 64 and 256 contiguous bytes per row and stage.
    {
      using namespace hypic::kernels::cuda::detail;
      const int kt = kt_all, ks = dl_ks, blocks = dl_blocks;
      const bool long_slices = kt / stream_k_slices(kt) >= 16;
      report("cp.async rows 64B", blocks, graph_ms(copies, reps, [&](int i, cudaStream_t st) {
               if (long_slices)
                 cp_async_rows_kernel<16, 1><<<blocks, kThreads, 16 * 64 * 16 * 8, st>>>(W[i], sh.N, sh.K, ks, out);
               else
                 cp_async_rows_kernel<8, 1><<<blocks, kThreads, 8 * 64 * 16 * 8, st>>>(W[i], sh.N, sh.K, ks, out);
             }));
      if (kt % (4 * ks) == 0)
        report("cp.async rows 256B", blocks, graph_ms(copies, reps, [&](int i, cudaStream_t st) {
                 if (long_slices)
                   cp_async_rows_kernel<4, 4><<<blocks, kThreads, 16 * 64 * 16 * 8, st>>>(W[i], sh.N, sh.K, ks, out);
                 else
                   cp_async_rows_kernel<2, 4><<<blocks, kThreads, 8 * 64 * 16 * 8, st>>>(W[i], sh.N, sh.K, ks, out);
               }));
    }
    for (int blocks : {rg < sms ? rg : sms, 2 * sms, 3 * sms}) {
      if (blocks > rg * 4) continue;
      const int per_sm = (blocks + sms - 1) / sms, bs = bulk_stages(per_sm);
      report("cp.async ring", blocks, graph_ms(copies, reps, [&](int i, cudaStream_t st) {
               if (per_sm == 1)
                 cp_async_ring_kernel<16><<<blocks, kThreads, 16 * 64 * 16 * 8, st>>>(
                     reinterpret_cast<const uint4*>(W[i]), words, out);
               else
                 cp_async_ring_kernel<8><<<blocks, kThreads, 8 * 64 * 16 * 8, st>>>(
                     reinterpret_cast<const uint4*>(W[i]), words, out);
             }));
      report("bulk ring x" + std::to_string(bs), blocks, graph_ms(copies, reps, [&](int i, cudaStream_t st) {
               bulk_ring_kernel<<<blocks, kThreads, size_t(bs) * stage_words * 16, st>>>(
                   reinterpret_cast<const uint4*>(W[i]), words, stage_words, bs, out);
             }));
      report("ld.global", blocks, graph_ms(copies, reps, [&](int i, cudaStream_t st) {
               ld_global_kernel<<<blocks, kThreads, 0, st>>>(reinterpret_cast<const uint4*>(W[i]), words, out);
             }));
    }
    check_cuda(cudaGetLastError(), "launches");
    J["shapes"].push_back(row);
    for (auto* w : W) cudaFree(w);
    cudaFree(x);
    cudaFree(y);
  }
  if (!json_path.empty()) std::ofstream(json_path) << J.dump(2) << "\n";
  cudaFree(out);
  cublasDestroy(blas);
  return 0;
}
