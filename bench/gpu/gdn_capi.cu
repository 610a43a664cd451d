// C entry points of the chunked gated-delta prefill for tools/bench_fla_reference.py, which loads
// this shared library through ctypes so that our kernels and flash-linear-attention's run in one
// process, on the same torch tensors and the same CUDA stream (interleaved A/B timing). Not an
// engine API: the engine calls hypic::kernels::cuda::gdn_prefill directly.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>

#include "kernels/cuda/gated_delta.h"

namespace gpu = hypic::kernels::cuda;

extern "C" {

/// A new prefill workspace (GdnWorkspace); free it with hypic_gdn_workspace_destroy.
void* hypic_gdn_workspace_create() { return new gpu::GdnWorkspace(); }

void hypic_gdn_workspace_destroy(void* ws) { delete static_cast<gpu::GdnWorkspace*>(ws); }

/// gdn_prefill (kernels/cuda/gated_delta.h) with every GdnPrefillArgs field passed flat; device
/// pointers as addresses (torch data_ptr()), cu_seqlens on the host, `stream` a cudaStream_t (torch's
/// cuda_stream). Returns 0, or 1 with the exception's message in err[0 .. err_len).
int hypic_gdn_prefill(void* ws, int num_seqs, const int* cu_seqlens_host, int num_k_heads, int num_v_heads,
                      const void* q, const void* k, const void* v, const float* g, const float* beta, int l2norm_qk,
                      float scale, const float* initial_state, float* final_state, float* transition, void* out,
                      int scan_layout, int seq_parts, void* stream, char* err, int err_len) {
  try {
    gpu::GdnPrefillArgs a;
    a.num_seqs = num_seqs;
    a.cu_seqlens_host = cu_seqlens_host;
    a.num_k_heads = num_k_heads;
    a.num_v_heads = num_v_heads;
    a.q = static_cast<const gpu::bf16*>(q);
    a.k = static_cast<const gpu::bf16*>(k);
    a.v = static_cast<const gpu::bf16*>(v);
    a.g = g;
    a.beta = beta;
    a.l2norm_qk = l2norm_qk != 0;
    a.scale = scale;
    a.initial_state = initial_state;
    a.final_state = final_state;
    a.transition = transition;
    a.out = static_cast<gpu::bf16*>(out);
    a.scan_layout = scan_layout;
    a.seq_parts = seq_parts;
    gpu::gdn_prefill(a, *static_cast<gpu::GdnWorkspace*>(ws), static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    if (err && err_len > 0) std::snprintf(err, size_t(err_len), "%s", e.what());
    return 1;
  }
}

}  // extern "C"
