#include "engine/cuda/pinned_pool.h"

#include <cuda_runtime_api.h>

#include <string>

#include "engine/backend.h"
#include "kernels/cuda/cuda_check.h"

namespace hypic::engine::cuda {

PinnedPool::~PinnedPool() {
  for (auto& [cap, list] : free_)
    for (char* p : list) cudaFreeHost(p);
}

std::vector<PinnedPool::Piece> PinnedPool::acquire(size_t bytes) {
  std::vector<Piece> out;
  auto take = [&](size_t cap, size_t used) {
    {
      std::lock_guard lock(mu_);
      auto it = free_.find(cap);
      if (it != free_.end() && !it->second.empty()) {
        out.push_back({it->second.back(), cap, used});
        it->second.pop_back();
        return;
      }
    }
    void* p = nullptr;
    kernels::cuda::check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    const cudaError_t err = cudaHostAlloc(&p, cap, cudaHostAllocPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();
      release(out);
      throw ResourceExhausted("pinned host memory: cannot pin " + std::to_string(cap) + " more bytes (" +
                              std::to_string(bytes_held()) + " held): " + cudaGetErrorString(err));
    }
    std::lock_guard lock(mu_);
    held_ += cap;
    out.push_back({static_cast<char*>(p), cap, used});
  };
  size_t left = bytes;
  while (left >= kMaxPiece) {
    take(kMaxPiece, kMaxPiece);
    left -= kMaxPiece;
  }
  if (left > 0) {
    size_t cap = kMinPiece;
    while (cap < left) cap *= 2;
    bool whole = false;
    {
      std::lock_guard lock(mu_);
      whole = whole_pieces_;
    }
    // After reserve(): a large tail takes a whole reserved piece (no pinning now); a small one its own small piece.
    take(whole && left >= kMaxPiece / 2 ? kMaxPiece : cap, left);
  }
  return out;
}

void PinnedPool::reserve(size_t bytes) {
  kernels::cuda::check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  {
    std::lock_guard lock(mu_);
    whole_pieces_ = true;
  }
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (held_ >= bytes) return;
    }
    void* p = nullptr;
    const cudaError_t err = cudaHostAlloc(&p, kMaxPiece, cudaHostAllocPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw ResourceExhausted("pinned host memory: cannot reserve " + std::to_string(bytes) + " bytes (" +
                              std::to_string(bytes_held()) + " pinned): " + cudaGetErrorString(err));
    }
    std::lock_guard lock(mu_);
    held_ += kMaxPiece;
    free_[kMaxPiece].push_back(static_cast<char*>(p));
  }
}

void PinnedPool::release(std::vector<Piece>& pieces) {
  std::lock_guard lock(mu_);
  for (const Piece& p : pieces) free_[p.capacity].push_back(p.data);
  pieces.clear();
}

size_t PinnedPool::bytes_held() const {
  std::lock_guard lock(mu_);
  return held_;
}

}  // namespace hypic::engine::cuda
