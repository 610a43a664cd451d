// Pinned (page-locked) host memory for host blocks (engine/backend.h HostBlock): copies between it and the device run
// at PCIe bandwidth, asynchronously, where pageable memory goes through a staging copy at a fraction of it.
// cudaHostAlloc costs about as much as the copy it enables and cudaFreeHost may synchronize the device, so freed
// pieces are kept for reuse (by size class) and given back only when the pool goes away.
#pragma once
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace hypic::engine::cuda {

/// A pool of pinned host pieces. A request of n bytes is served as full pieces of kMaxPiece bytes plus one tail piece
/// of the next power of two >= the rest (at least kMinPiece), so a block wastes less than its tail's size. Thread-safe.
class PinnedPool {
 public:
  static constexpr size_t kMaxPiece = size_t(32) << 20;
  static constexpr size_t kMinPiece = size_t(64) << 10;
  struct Piece {
    char* data = nullptr;
    size_t capacity = 0;  ///< bytes of the allocation
    size_t used = 0;      ///< bytes of the request it serves
  };
  /// `device`: the CUDA ordinal made current for the allocations (pinned memory is portable to every device).
  explicit PinnedPool(int device) : device_(device) {}
  /// Frees every piece (all must have been released).
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  /// Pieces covering `bytes` in order. Throws ResourceExhausted (engine/backend.h) when the host cannot pin more.
  std::vector<Piece> acquire(size_t bytes);
  /// Pins pieces of kMaxPiece until `bytes` are held (free for reuse), and from then on serves a request's tail of at
  /// least kMaxPiece / 2 with a whole piece too, so that those reserved pieces cover large blocks: pinning memory (cudaHostAlloc) stalls
  /// the device's other work while it runs, so a server pins once at start-up instead of while requests run.
  /// Throws ResourceExhausted as acquire.
  void reserve(size_t bytes);
  /// Gives pieces back for reuse.
  void release(std::vector<Piece>& pieces);
  /// Pinned bytes held (in use or free for reuse).
  size_t bytes_held() const;

 private:
  int device_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<char*>> free_;  // by capacity
  size_t held_ = 0;
  bool whole_pieces_ = false;
};

}  // namespace hypic::engine::cuda
