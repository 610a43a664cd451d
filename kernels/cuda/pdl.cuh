// Programmatic dependent launch (PDL, sm_90) for the chains of small kernels of a decode step: a kernel launched
// with cudaLaunchAttributeProgrammaticStreamSerialization (launch_pdl) may have its blocks scheduled while its
// predecessor in the stream still runs (once every block of the predecessor has executed
// griddep_launch_dependents(), or exited). Such a kernel calls griddep_wait() before it touches any global memory
// that an earlier kernel of the stream writes (or reads, if it writes it): griddepcontrol.wait returns once the
// preceding grid has completed and its memory is visible, so stream-order semantics are unchanged. Memory no kernel
// of the step writes (weights) may be read before it: that is what lets a weight-streaming GEMM start its loads
// while its predecessor drains. So may memory whose last writer completed before the predecessor began its own
// griddep_wait(), read through L2 (ld.cg): when the predecessor waits before it calls griddep_launch_dependents(),
// this kernel starts only after that wait returned, so after that writer (and everything before the predecessor's
// predecessor) completed. The decode MoE down GEMM reads its tile schedule that way (the routing kernel wrote it; the
// gate_up GEMM between them waits first), the MoE combine the routing's picks and the residual row, the one-token
// routing its shared gate's input, and with the caller's promise (gated_delta.h state_read_early) the decode conv and
// recurrence their states, (attention.h kv_read_early) the decode attention its first KV tiles. A predecessor that
// triggers before it waits (the norms) gives no such guarantee. Without the launch attribute both instructions are
// no-ops.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/switches.h"

namespace hypic::kernels::cuda::detail {

__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/// PDL on by default; HYPIC_MOE_PDL=0 in the environment (read once) launches the decode chains plainly.
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("HYPIC_MOE_PDL");
    return !(v && v[0] == '0');
  }();
  return on;
}

/// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization (see the top of this file)
/// when `pdl` (and pdl_enabled()): the kernel must then call griddep_wait() before it touches memory an earlier kernel
/// writes (except as the top of this file allows). Host only; throws std::runtime_error (naming `what`) when the launch
/// fails.
template <class... KArgs, class... Args>
void launch_pdl_if(bool pdl, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   const std::string& what, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl && pdl_enabled() ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...), what);
}

/// launch_pdl_if(true, ...): the decode chains' weight-streaming GEMMs, routing and combines.
template <class... KArgs, class... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const char* what,
                Args... args) {
  launch_pdl_if(true, kernel, grid, block, smem, stream, what, args...);
}

/// HYPIC_DECODE_PDL_MIXERS (a measured default, kernels/cuda/switches.h; =0 launches them without PDL): the small kernels of a decode step between its weight
/// GEMMs (conv1d + SiLU, the Gated DeltaNet recurrence, the gated and residual RMSNorms, attention prepare, decode and
/// its split-KV combine) launched with PDL too. Each
/// of them waits for its predecessor first thing (griddep_wait, a no-op without the attribute) and lets its successor
/// be scheduled at once (griddep_launch_dependents): without it, every boundary between them and the weight GEMMs
/// around them paid a whole launch, and out_proj / o_proj could not start their weight copies before the recurrence
/// or the attention had exited. Same kernels, same bits (a greedy step at batch 1, 32k contexts: 4.09 -> 3.87 ms on an
/// H100, bench/results/decode_candidates_h100.md). Host only.
inline bool mixer_pdl() {
  static CandidateSwitch sw("HYPIC_DECODE_PDL_MIXERS");
  return sw.on();
}

}  // namespace hypic::kernels::cuda::detail
