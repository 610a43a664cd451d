// Entry bytes shared between processes on one host through sealed memfds (Linux memfd_create(2), fcntl(2) seals):
// the segment cache holds large entries in memfds and a combine worker on the same host maps them read-only instead
// of receiving them over a gRPC stream through loopback TCP (at about 0.2-0.3 GB/s per 232 MB entry, several copies;
// a mapping is read at memory speed). A sealed memfd (F_SEAL_WRITE, SHRINK, GROW, SEAL) can never change again, not
// even by its creator, so the reader checks its checksum and MAC on the mapping itself and parses from it with no
// private copy. The peer reaches the creator's descriptor as /proc/<pid>/fd/<fd>: it needs the same host, the same
// PID namespace and the permission to read the creator's /proc entries (the same user); where it has not, the
// creator's anchor memfd (its instance name) does not show there and the reader falls back to the stream.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace hypic::rpc {

/// Where a process on the same host finds a sealed memfd (hypic.v1.SharedMemory): the holder's pid, the descriptor
/// number in the holder, the memfd's name ("hypic-<instance>-<n>" of the process that made it, unique for that
/// process's lifetime: the holder may have adopted it from another), its size in bytes, and the holder's anchor memfd
/// (descriptor and name "hypic-<instance>-anchor", alive as long as the holder), which tells a reader that /proc/<pid>
/// is the holder and not some other process with the same pid (another host or PID namespace).
struct MemfdRef {
  uint32_t pid = 0;
  int32_t fd = -1;
  std::string name;
  uint64_t size = 0;
  int32_t anchor_fd = -1;
  std::string anchor_name;
  uint64_t inode = 0;  ///< the memfd's inode number (0: not checked), so a reused descriptor number is told apart
};

/// Immutable bytes, held on the heap or in a sealed memfd mapped read-only. Thread-safe (const). The bytes stay valid
/// while the object lives; a memfd's descriptor is closed with it (readers that opened it keep their own).
class SharedBytes {
 public:
  /// Heap-held bytes (no descriptor; memfd_ref() is empty).
  static std::shared_ptr<const SharedBytes> heap(std::string bytes);
  /// Heap-held bytes shared with their other holders (no copy).
  static std::shared_ptr<const SharedBytes> heap(std::shared_ptr<const std::string> bytes);
  /// Takes over a peer's sealed memfd (its descriptor and mapping): the bytes stay valid as long as this object,
  /// however long the peer lives, and this process can hand them on (memfd_ref() names it as the holder). nullptr
  /// and *why when this process holds as many memfds as it may (SealedMemfdWriter::create).
  static std::shared_ptr<const SharedBytes> adopt(std::unique_ptr<class PeerMemfd> peer, std::string* why);
  ~SharedBytes();
  SharedBytes(const SharedBytes&) = delete;
  SharedBytes& operator=(const SharedBytes&) = delete;
  std::string_view view() const { return view_; }
  size_t size() const { return view_.size(); }
  /// True when the bytes are in a sealed memfd that a peer on this host can open (memfd_ref()).
  bool shared() const { return fd_ >= 0; }
  /// The memfd's inode number (0 for heap bytes): two SharedBytes of one inode hold the same pages.
  uint64_t inode() const { return inode_; }
  /// The reference a peer opens with PeerMemfd::open (pid, descriptor, name, size, anchor); fd = -1 for heap bytes.
  MemfdRef memfd_ref() const;

 private:
  friend class SealedMemfdWriter;
  SharedBytes() = default;
  std::string heap_;
  std::shared_ptr<const std::string> shared_heap_;
  std::string_view view_;
  int fd_ = -1;
  void* map_ = nullptr;
  std::string name_;
  uint64_t inode_ = 0;
};

/// Fills a new memfd of a known size (pwrite: no writable mapping), then seals it and maps it read-only. Not
/// thread-safe. Memory: the memfd's pages are the process's shared memory (counted against its memory cgroup, as heap
/// pages are; not limited by the size of /dev/shm).
class SealedMemfdWriter {
 public:
  /// A writer for `size` bytes (> 0). Returns nullptr and sets *why when no memfd can be made here (memfd_create or
  /// ftruncate failed: not Linux, EPERM under a seccomp filter; or the process holds memfds for half its descriptor
  /// limit already: the first call raises the soft RLIMIT_NOFILE to the hard one, and held memfds never take more
  /// than half of it, so connections and files keep theirs): the caller keeps the bytes on the heap instead.
  static std::unique_ptr<SealedMemfdWriter> create(uint64_t size, std::string* why);
  ~SealedMemfdWriter();
  SealedMemfdWriter(const SealedMemfdWriter&) = delete;
  SealedMemfdWriter& operator=(const SealedMemfdWriter&) = delete;
  /// Appends bytes at the current offset. Throws RpcError(RESOURCE_EXHAUSTED) when the host has no memory for them
  /// (ENOSPC, ENOMEM), std::logic_error past the announced size, std::runtime_error for another write error.
  void append(std::string_view bytes);
  uint64_t written() const { return written_; }
  uint64_t size() const { return size_; }
  /// Seals the memfd (no write, shrink or grow, no further seals) and maps it read-only; the writer is spent. Where it
  /// cannot be sealed or mapped (out of mappings or memory) the bytes are read back onto the heap instead (shared()
  /// false; logged once). Throws std::logic_error unless exactly size() bytes were written,
  /// std::runtime_error when even reading them back fails.
  std::shared_ptr<const SharedBytes> seal();

 private:
  SealedMemfdWriter() = default;
  int fd_ = -1;
  uint64_t size_ = 0, written_ = 0;
  std::string name_;
};

/// A peer's sealed memfd, reached through /proc/<pid>/fd/<fd> with O_PATH (no filesystem's open runs: a FIFO, a tty
/// or a FUSE file never blocks it), checked there (the announced name, a regular file on the memfds' device, the
/// announced inode), then opened read-only, checked again (seals, size, every page written) and mapped read-only
/// (MAP_POPULATE). The bytes cannot change while mapped, so they are read in place. Not copyable.
class PeerMemfd {
 public:
  enum class Failure {
    None,
    Unreachable,  ///< the holder's /proc entries cannot be read here (another host or PID namespace, no permission,
                  ///< another process's anchor there): no ref from this holder can be opened, use the stream
    NoProcess,    ///< no process with the holder's pid here: it exited meanwhile, or runs on another host or in another
                  ///< PID namespace (the caller tells them apart by repetition)
    Gone,         ///< the creator is reachable but this memfd is not there as announced (released meanwhile)
    Invalid,      ///< it is there but not as announced (not a regular file, size, seals, not every page written):
                  ///< refused
  };
  /// Opens and maps `ref`. nullptr on failure, with *failure and *why (a sentence naming the path and the reason).
  static std::unique_ptr<PeerMemfd> open(const MemfdRef& ref, Failure* failure, std::string* why);
  ~PeerMemfd();
  PeerMemfd(const PeerMemfd&) = delete;
  PeerMemfd& operator=(const PeerMemfd&) = delete;
  std::string_view view() const { return {static_cast<const char*>(map_), size_}; }
  const std::string& name() const { return name_; }
  uint64_t inode() const { return inode_; }

 private:
  friend class SharedBytes;
  PeerMemfd() = default;
  int fd_ = -1;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  uint64_t inode_ = 0;
};

}  // namespace hypic::rpc
