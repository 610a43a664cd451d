// The gated delta rule's chunk scan with its recurrence on Hopper's warpgroup MMAs: gdn_scan_kernel<true>
// (gdn_scan.cuh, where the kernel and the shared-memory layout are described), launched by gdn_prefill
// (gated_delta_prefill.cu) when the candidate switch HYPIC_GDN_SCAN_WGMMA is on and the device has compute capability
// 9.0. Built for sm_90a only (kernels/cuda/CMakeLists.txt, HYPIC_GDN_SCAN_WGMMA_BUILT).
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gdn_scan.cuh"

namespace hypic::kernels::cuda::detail::gdn {

void launch_scan_wgmma(dim3 grid, int threads, const ScanParams& p, cudaStream_t stream) {
  static DeviceOnce once;  // the shared-memory opt-in is a per-device function attribute
  once.run(current_device(), [](int) {
    check_cuda(cudaFuncSetAttribute(gdn_scan_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kScanSmemWg),
               "cudaFuncSetAttribute(gdn_scan_kernel<wgmma>)");
    return 0;
  });
  gdn_scan_kernel<true><<<grid, threads, kScanSmemWg, stream>>>(p);
  check_cuda(cudaGetLastError(), "gdn_scan_kernel<wgmma> launch");
}

}  // namespace hypic::kernels::cuda::detail::gdn
