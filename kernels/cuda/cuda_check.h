// Error checking for CUDA runtime calls in kernels/cuda: every failure becomes a
// std::runtime_error naming the call and the CUDA error string.
#pragma once
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace hypic::kernels::cuda {

/// Throws std::runtime_error("<what>: <cuda error name>: <message>") unless err == cudaSuccess.
inline void check_cuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess)
    throw std::runtime_error(what + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

}  // namespace hypic::kernels::cuda
