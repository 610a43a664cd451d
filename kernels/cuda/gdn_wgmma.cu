// The gated delta rule prefill's kernels with their products on Hopper's warpgroup MMAs: gdn_scan_kernel<true>
// (gdn_scan.cuh) and gdn_wy_kernel<true> (gdn_wy.cuh), where the kernels and their shared-memory layouts are
// described; gdn_prefill (gated_delta_prefill.cu) launches them when the switches HYPIC_GDN_SCAN_WGMMA /
// HYPIC_GDN_WY_WGMMA are on and the device has compute capability 9.0. Built for sm_90a only
// (kernels/cuda/CMakeLists.txt, HYPIC_GDN_WGMMA_BUILT).
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gdn_scan.cuh"
#include "kernels/cuda/gdn_wy.cuh"

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

}  // namespace

void launch_scan_wgmma(dim3 grid, int threads, const ScanParams& p, long long* profile, bool l2_prefetch,
                       cudaStream_t stream) {
  if (profile)
    l2_prefetch ? launch_scan_wgmma_as<true, true>(grid, threads, p, profile, stream)
                : launch_scan_wgmma_as<true, false>(grid, threads, p, profile, stream);
  else
    l2_prefetch ? launch_scan_wgmma_as<false, true>(grid, threads, p, nullptr, stream)
                : launch_scan_wgmma_as<false, false>(grid, threads, p, nullptr, stream);
}

void launch_wy_wgmma(unsigned blocks, const bf16* q, const bf16* k, const bf16* v, const float* g, const float* beta,
                     const GateInputs& gates, int Hk, int Hv, bool l2norm, float scale, const WsView& ws,
                     cudaStream_t stream) {
  static DeviceOnce once;
  once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(gdn_wy_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kWySmemWg),
               "cudaFuncSetAttribute(gdn_wy_kernel<wgmma>)");
    return 0;
  });
  gdn_wy_kernel<true><<<blocks, kWyThreads, kWySmemWg, stream>>>(q, k, v, g, beta, gates, Hk, Hv, l2norm, scale, ws);
  check_cuda(cudaGetLastError(), "gdn_wy_kernel<wgmma> launch");
}

}  // namespace hypic::kernels::cuda::detail::gdn
