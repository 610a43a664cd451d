// The backend factory and device discovery (engine/backend.h); the model-free part is in backend_ids.cpp.
#include "engine/backend.h"

#include "engine/cpu_backend.h"

#if defined(HYPIC_WITH_CUDA) && HYPIC_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace hypic::engine {

bool cuda_available() {
#if defined(HYPIC_WITH_CUDA) && HYPIC_WITH_CUDA
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
#else
  return false;
#endif
}

std::optional<DeviceBlock> Backend::device_block(const ResidentEntry&) const { return std::nullopt; }

std::pair<std::shared_ptr<const ResidentEntry>, DeviceBlock> Backend::allocate_entry(const SegmentEntry&) const {
  throw std::logic_error("allocate_entry: the " + std::string(numerics()) +
                         " backend keeps entries in host memory (no device entries to receive into)");
}

DeviceSpec default_device() { return cuda_available() ? DeviceSpec{BackendKind::Cuda, 0} : DeviceSpec{}; }

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
