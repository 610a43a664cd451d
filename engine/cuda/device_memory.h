// Owning device allocations for the CUDA backend.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <utility>

#include "engine/backend.h"
#include "kernels/cuda/cuda_check.h"

namespace hypic::engine::cuda {

using kernels::cuda::check_cuda;

/// One device allocation of `bytes` bytes. Long-lived pools use cudaMalloc; with a stream, the allocation is
/// stream-ordered (cudaMallocAsync / cudaFreeAsync on that stream: entries and checkpoints, made and dropped
/// while the engine runs). Move-only. Throws ResourceExhausted (engine/backend.h) naming `what`, the bytes and the
/// device's free memory when the device is out of memory, std::runtime_error for other CUDA errors.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(size_t bytes, const std::string& what, cudaStream_t stream = nullptr, bool stream_ordered = false)
      : bytes_(bytes), stream_(stream), ordered_(stream_ordered) {
    if (!bytes) return;
    check_cuda(cudaGetDevice(&device_), "cudaGetDevice");
    const cudaError_t err = ordered_ ? cudaMallocAsync(&p_, bytes, stream) : cudaMalloc(&p_, bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear it: an allocation failure leaves the context usable
      p_ = nullptr;
      size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      throw ResourceExhausted("device memory exhausted on cuda:" + std::to_string(device_) + ": " + what + " needs " +
                              std::to_string(bytes) + " bytes, " + std::to_string(free) + " of " +
                              std::to_string(total) + " free");
    }
    check_cuda(err, std::string(ordered_ ? "cudaMallocAsync(" : "cudaMalloc(") + std::to_string(bytes) +
                        " bytes) for " + what);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  DeviceMemory(DeviceMemory&& o) noexcept { swap(o); }
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    DeviceMemory t(std::move(o));
    swap(t);
    return *this;
  }
  ~DeviceMemory() { reset(); }
  /// Frees on the device it was allocated on, whichever device is current on the calling thread (entries are
  /// released on gRPC handler threads too).
  void reset() noexcept {
    if (p_) {
      int current = 0;
      const bool switch_device = cudaGetDevice(&current) == cudaSuccess && current != device_;
      if (switch_device) cudaSetDevice(device_);
      if (ordered_) cudaFreeAsync(p_, stream_);
      else cudaFree(p_);
      if (switch_device) cudaSetDevice(current);
    }
    p_ = nullptr;
    bytes_ = 0;
  }
  void swap(DeviceMemory& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    std::swap(stream_, o.stream_);
    std::swap(ordered_, o.ordered_);
    std::swap(device_, o.device_);
  }
  template <class T = void>
  T* as() const {
    return static_cast<T*>(p_);
  }
  char* bytes_ptr(size_t offset = 0) const { return static_cast<char*>(p_) + offset; }
  size_t size() const { return bytes_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  bool ordered_ = false;
  int device_ = 0;
};

/// Grows a DeviceMemory to at least `bytes` (contents dropped when it grows).
inline void ensure_capacity(DeviceMemory& m, size_t bytes, const std::string& what) {
  if (m.size() >= bytes) return;
  m = DeviceMemory();
  m = DeviceMemory(bytes + bytes / 4, what);
}

/// Sub-allocations of one block at 256-byte alignment: add() sizes, then carve() once the block exists.
class Layout {
 public:
  size_t add(size_t bytes) {
    const size_t off = (total_ + 255) / 256 * 256;
    total_ = off + bytes;
    return off;
  }
  size_t total() const { return (total_ + 255) / 256 * 256; }

 private:
  size_t total_ = 0;
};

}  // namespace hypic::engine::cuda
