// affine_chain's wgmma path (chain_wgmma.cu, built for sm_90a only): internal to kernels/cuda, called by ops.cu.
#pragma once
#include <cuda_runtime_api.h>

#include "kernels/cuda/ops.h"

namespace hypic::kernels::cuda::detail {

/// Whether the current device runs the sm_90a chain kernel (compute capability 9.0). Host only.
bool chain_wgmma_available();

/// affine_chain (ChainMath::Tf32x3) on warpgroup MMAs: arguments, layouts and numerics as affine_chain's, the same
/// 3xTF32 products, summed in another order than the mma.sync kernel's (results agree to ~1e-6, not bit for bit). Requires
/// chain_wgmma_available() and num_chains < 2^29, heads <= 65535 (checked by affine_chain); lr: the low-rank steps'
/// factors (all null when the chain has none). Host only; throws std::runtime_error on CUDA errors.
void launch_affine_chain_wgmma(int num_chains, int heads, int steps_per_chain, const AffineStep* steps,
                               const float* const* init, float* const* final_states, const ChainLowRankFactors& lr,
                               cudaStream_t stream);

}  // namespace hypic::kernels::cuda::detail
