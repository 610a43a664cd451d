// The gated delta rule prefill's kernels with their products on Hopper's warpgroup MMAs: gdn_scan_kernel<true>
// (gdn_scan.cuh) and gdn_wy_kernel<true> (gdn_wy.cuh), where the kernels and their shared-memory layouts are
// described; gdn_prefill (gated_delta_prefill.cu) launches them when the switches HYPIC_GDN_SCAN_WGMMA /
// HYPIC_GDN_WY_WGMMA are on and the device has compute capability 9.0. Built for sm_90a only
// (kernels/cuda/CMakeLists.txt, HYPIC_GDN_WGMMA_BUILT).
#include <cuda_runtime.h>

#include <cstdio>
#include <mutex>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gdn_scan.cuh"
#include "kernels/cuda/gdn_wy.cuh"
#include "kernels/cuda/tensor_map.h"

namespace hypic::kernels::cuda::detail::gdn {

namespace {

// Launches one instantiation of the wgmma scan, its shared-memory opt-in set once per device.
template <bool kProf, bool kL2Prefetch>
void launch_scan_wgmma_as(dim3 grid, int threads, const ScanParams& p, long long* profile, cudaStream_t stream) {
  static DeviceOnce once;  // the shared-memory opt-in is a per-device function attribute
  once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(gdn_scan_kernel<true, kProf, kL2Prefetch>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, kScanSmemWg),
               "cudaFuncSetAttribute(gdn_scan_kernel<wgmma>)");
    return 0;
  });
  gdn_scan_kernel<true, kProf, kL2Prefetch><<<grid, threads, kScanSmemWg, stream>>>(p, profile);
  check_cuda(cudaGetLastError(), "gdn_scan_kernel<wgmma> launch");
}

// Launches one instantiation of the TMA-staged scan (gdn_scan_tma_kernel), its shared-memory opt-in set once per
// device.
template <bool kProf, bool kAll>
void launch_scan_tma_as(dim3 grid, int threads, const ScanParams& p, const ScanMaps& maps, long long* profile,
                        cudaStream_t stream) {
  static DeviceOnce once;
  once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(gdn_scan_tma_kernel<kProf, kAll>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kScanSmemWgTma),
               "cudaFuncSetAttribute(gdn_scan_tma_kernel)");
    return 0;
  });
  gdn_scan_tma_kernel<kProf, kAll><<<grid, threads, kScanSmemWgTma, stream>>>(p, maps, profile);
  check_cuda(cudaGetLastError(), "gdn_scan_tma_kernel launch");
}

// ScanMaps of p's tiles (see there): false where a map cannot be made (no encoder, a refused map, no tokens or slots).
// The last maps made on this thread are kept and reused while their inputs are the same (the engine runs every layer
// of a pass on the same workspace and activation buffers), so most launches encode none.
bool scan_tensor_maps(const ScanParams& p, const ScanStaging& st, ScanMaps* m) {
  if (st.total_tokens <= 0 || st.ws_slots == 0 || !p.k || (p.with_out && !p.q)) return false;
  struct Cached {
    const void *W = nullptr, *P = nullptr, *UT = nullptr, *k = nullptr, *q = nullptr;
    size_t slots = 0;
    int Hk = 0, T = 0;
    bool with_out = false;
    ScanMaps maps;
  };
  thread_local Cached cache;
  const bool ws_same = cache.W == p.ws.W && cache.P == p.ws.P && cache.UT == p.ws.UT && cache.slots == st.ws_slots;
  const bool in_same = cache.k == p.k && cache.q == p.q && cache.Hk == p.Hk && cache.T == st.total_tokens &&
                       cache.with_out == p.with_out;
  const uint64_t T = uint64_t(st.total_tokens), Hk = uint64_t(p.Hk), slots = st.ws_slots;
  constexpr uint64_t row = D * 2;  // bytes of a 128-wide bf16 row
  if (!ws_same) {
    cache.W = cache.P = cache.UT = nullptr;  // (invalid until the three maps are made)
    if (!encode_bf16_map_3d(&cache.maps.w, p.ws.W, {D, C, slots}, {row, C * row}, {64, C, 1}) ||
        !encode_bf16_map_3d(&cache.maps.p, p.ws.P, {C, C, slots}, {C * 2, C * C * 2}, {64, C, 1}) ||
        !encode_bf16_map_3d(&cache.maps.ut, p.ws.UT, {C, D, slots}, {C * 2, C * row}, {64, 64, 1}))
      return false;
    cache.W = p.ws.W, cache.P = p.ws.P, cache.UT = p.ws.UT, cache.slots = st.ws_slots;
  }
  if (!in_same) {
    cache.k = nullptr;  // (invalid until both maps are made)
    if (!encode_bf16_map_3d(&cache.maps.k, p.k, {D, Hk, T}, {row, Hk * row}, {64, 1, C})) return false;
    if (!p.with_out)
      cache.maps.q = cache.maps.k;  // (never read: no block stages Q without outputs)
    else if (!encode_bf16_map_3d(&cache.maps.q, p.q, {D, Hk, T}, {row, Hk * row}, {64, 1, C}))
      return false;
    cache.k = p.k, cache.q = p.q, cache.Hk = p.Hk, cache.T = st.total_tokens, cache.with_out = p.with_out;
  }
  *m = cache.maps;
  return true;
}

}  // namespace

bool launch_scan_wgmma(dim3 grid, int threads, const ScanParams& p, long long* profile, const ScanStaging& staging,
                       cudaStream_t stream) {
  if (staging.tma) {
    ScanMaps maps;
    if (scan_tensor_maps(p, staging, &maps)) {
      if (staging.tma_all)
        profile ? launch_scan_tma_as<true, true>(grid, threads, p, maps, profile, stream)
                : launch_scan_tma_as<false, true>(grid, threads, p, maps, nullptr, stream);
      else
        profile ? launch_scan_tma_as<true, false>(grid, threads, p, maps, profile, stream)
                : launch_scan_tma_as<false, false>(grid, threads, p, maps, nullptr, stream);
      return true;
    }
    static std::once_flag told;
    std::call_once(told, [] {
      std::fprintf(stderr,
                   "hypic gdn_prefill: HYPIC_GDN_SCAN_TMA is on (the default) but the driver made no tensor map for "
                   "the chunk scan; its tiles are staged by cp.async\n");
    });
  }
  if (profile)
    staging.l2_prefetch ? launch_scan_wgmma_as<true, true>(grid, threads, p, profile, stream)
                        : launch_scan_wgmma_as<true, false>(grid, threads, p, profile, stream);
  else
    staging.l2_prefetch ? launch_scan_wgmma_as<false, true>(grid, threads, p, nullptr, stream)
                        : launch_scan_wgmma_as<false, false>(grid, threads, p, nullptr, stream);
  return false;
}

void launch_wy_wgmma(unsigned blocks, const bf16* q, const bf16* k, const bf16* v, const float* g, const float* beta,
                     const GateInputs& gates, int Hk, int Hv, bool l2norm, float scale, const WsView& ws,
                     const ConvView& cv, cudaStream_t stream) {
  static DeviceOnce once;
  once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(gdn_wy_kernel<true, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kWySmemWg),
               "cudaFuncSetAttribute(gdn_wy_kernel<wgmma>)");
    check_cuda(cudaFuncSetAttribute(gdn_wy_kernel<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kWySmemWg),
               "cudaFuncSetAttribute(gdn_wy_kernel<wgmma, conv>)");
    return 0;
  });
  if (cv.x)
    gdn_wy_kernel<true, true>
        <<<blocks, kWyThreads, kWySmemWg, stream>>>(q, k, v, g, beta, gates, Hk, Hv, l2norm, scale, ws, cv);
  else
    gdn_wy_kernel<true, false>
        <<<blocks, kWyThreads, kWySmemWg, stream>>>(q, k, v, g, beta, gates, Hk, Hv, l2norm, scale, ws, cv);
  check_cuda(cudaGetLastError(), "gdn_wy_kernel<wgmma> launch");
}

}  // namespace hypic::kernels::cuda::detail::gdn
