// make_backend (engine/backend.h): the one place that knows every backend, so it lives in the top library
// hypic_engine, above hypic_engine_core and (with CUDA) hypic_engine_cuda, which both depend on the core only.
#include "engine/backend.h"

#include <string>

#include "engine/cpu/cpu_backend.h"

#if defined(HYPIC_WITH_CUDA) && HYPIC_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace hypic::engine {

std::unique_ptr<Backend> make_backend(const DeviceSpec& device, const std::filesystem::path& model_dir,
                                      const BackendOptions& options) {
  if (device.kind == BackendKind::Cpu) return CpuBackend::load(model_dir, options);
#if defined(HYPIC_WITH_CUDA) && HYPIC_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  if (device.index >= count)
    throw std::invalid_argument("device " + device.name() + ": " +
                                (count == 0 ? std::string("no CUDA device is visible")
                                            : "only " + std::to_string(count) + " CUDA device(s) are visible (cuda:0.." +
                                                  "cuda:" + std::to_string(count - 1) + ")"));
  return make_cuda_backend(device, model_dir, options);
#else
  throw std::invalid_argument("device " + device.name() + ": this build has no CUDA backend");
#endif
}

}  // namespace hypic::engine
