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

void launch_scan_wgmma(dim3 grid, int threads, const ScanParams& p, long long* profile, cudaStream_t stream) {
  static DeviceOnce once, once_prof;  // the shared-memory opt-in is a per-device function attribute
  if (profile) {
    once_prof.run(current_device(), [](int) {
      check_cuda(cudaFuncSetAttribute(gdn_scan_kernel<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kScanSmemWg),
                 "cudaFuncSetAttribute(gdn_scan_kernel<wgmma, profile>)");
      return 0;
    });
    gdn_scan_kernel<true, true><<<grid, threads, kScanSmemWg, stream>>>(p, profile);
  } else {
    once.run(current_device(), [](int) {
      check_cuda(cudaFuncSetAttribute(gdn_scan_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kScanSmemWg),
                 "cudaFuncSetAttribute(gdn_scan_kernel<wgmma>)");
      return 0;
    });
    gdn_scan_kernel<true><<<grid, threads, kScanSmemWg, stream>>>(p);
  }
  check_cuda(cudaGetLastError(), "gdn_scan_kernel<wgmma> launch");
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
