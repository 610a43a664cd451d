// Error checking for CUDA runtime calls in kernels/cuda: every failure becomes a
// std::runtime_error naming the call and the CUDA error string; and per-device one-time setup.
#pragma once
#include <cuda_runtime_api.h>

#include <mutex>
#include <stdexcept>
#include <string>

namespace hypic::kernels::cuda {

/// Throws std::runtime_error("<what>: <cuda error name>: <message>") unless err == cudaSuccess.
inline void check_cuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess)
    throw std::runtime_error(what + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

/// The calling thread's current CUDA device.
inline int current_device() {
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  return dev;
}

/// One-time setup per device (function attributes such as the shared-memory opt-in are per
/// device), thread-safe: run(dev, f) calls f(dev) once per device, remembers its int result and
/// returns it; if f throws, the next call tries again. Devices 0 .. 63.
class DeviceOnce {
 public:
  template <class F>
  int run(int dev, F&& f) {
    if (dev < 0 || dev >= kMaxDevices)
      throw std::invalid_argument("DeviceOnce: device " + std::to_string(dev) + " outside [0, 64)");
    std::call_once(once_[dev], [&] { value_[dev] = f(dev); });
    return value_[dev];
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::once_flag once_[kMaxDevices];
  int value_[kMaxDevices] = {};
};

/// Attribute A of the current device, queried once per device (DeviceOnce); host only; throws std::runtime_error on
/// CUDA errors.
template <cudaDeviceAttr A>
int current_device_attribute() {
  static DeviceOnce once;
  return once.run(current_device(), [](int d) {
    int v = 0;
    check_cuda(cudaDeviceGetAttribute(&v, A, d), "cudaDeviceGetAttribute");
    return v;
  });
}

/// Multiprocessors of the current device.
inline int sm_count() { return current_device_attribute<cudaDevAttrMultiProcessorCount>(); }

/// The current device's largest dynamic shared memory per block with the opt-in attribute, bytes.
inline int current_device_smem_optin() { return current_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(); }

/// True when the current device has compute capability 9.0 (H100, H200): the devices the sm_90a builds (wgmma
/// kernels) run on.
inline bool current_device_is_sm90() {
  return current_device_attribute<cudaDevAttrComputeCapabilityMajor>() == 9 &&
         current_device_attribute<cudaDevAttrComputeCapabilityMinor>() == 0;
}

}  // namespace hypic::kernels::cuda
