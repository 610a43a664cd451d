#include "proto/rpc/shared_memory.h"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "proto/rpc/status.h"

namespace hypic::rpc {

namespace {

constexpr unsigned kSeals = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

// "hypic-<16 hex digits>": this process's memfd names start with it (random per process, so a name is never
// taken for another process's).
const std::string& instance_prefix() {
  static const std::string prefix = [] {
    std::random_device rd;
    const uint64_t r = (uint64_t(rd()) << 32) ^ rd();
    return fmt::format("hypic-{:016x}", r);
  }();
  return prefix;
}

// The anchor memfd, made once and kept open for the process's lifetime; -1 if none could be made.
int anchor_fd() {
  static const int fd = [] {
    return ::memfd_create((instance_prefix() + "-anchor").c_str(), MFD_CLOEXEC);
  }();
  return fd;
}

std::string errno_text(int e) { return std::strerror(e); }

// Memfds of this process alive now (writers and SharedBytes), and the most it may hold: half of its descriptor limit
// (the soft one, raised to the hard one first) and a quarter of the kernel's mappings per process (vm.max_map_count:
// each held memfd is mapped once), so that held entries never take the descriptors and mappings that connections,
// threads, large allocations, disk files and peers' memfds need.
std::atomic<int64_t> g_live{0};

int64_t max_live() {
  static const int64_t m = [] {
    uint64_t cap = uint64_t{1} << 20;
    rlimit r{};
    if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return int64_t{0};
    if (r.rlim_cur < r.rlim_max) {
      rlimit raised = r;
      raised.rlim_cur = r.rlim_max;
      if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) r = raised;
    }
    if (r.rlim_cur != RLIM_INFINITY) cap = std::min<uint64_t>(cap, uint64_t(r.rlim_cur) / 2);
    uint64_t maps = 65530;  // the kernel's default, where /proc cannot be read
    if (FILE* f = std::fopen("/proc/sys/vm/max_map_count", "r")) {
      unsigned long long v = 0;
      if (std::fscanf(f, "%llu", &v) == 1 && v > 0) maps = v;
      std::fclose(f);
    }
    return int64_t(std::min<uint64_t>(cap, maps / 4));
  }();
  return m;
}

// Counts one memfd for as long as it lives: take() reserves it, keep() hands the count on to the object that holds
// the descriptor (which gives it back when it closes it); a reservation not kept is given back here.
class LiveMemfd {
 public:
  bool take() {
    if (g_live.fetch_add(1) >= max_live()) {
      g_live.fetch_sub(1);
      return false;
    }
    held_ = true;
    return true;
  }
  void keep() { held_ = false; }
  ~LiveMemfd() {
    if (held_) g_live.fetch_sub(1);
  }

 private:
  bool held_ = false;
};

std::string budget_refusal() {
  return fmt::format("{} memfds are held already (half this process's descriptor limit, or a quarter of "
                     "vm.max_map_count)", max_live());
}

// The device number of memfds (the kernel's internal tmpfs; the anchor's): a descriptor whose file is elsewhere is no
// memfd, whatever its name reads as.
dev_t memfd_device() {
  static const dev_t dev = [] {
    struct stat st {};
    return anchor_fd() >= 0 && ::fstat(anchor_fd(), &st) == 0 ? st.st_dev : dev_t(-1);
  }();
  return dev;
}

uint64_t inode_of(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 ? uint64_t(st.st_ino) : 0;
}

// readlink(path) as a string ("" on failure, errno set).
std::string read_link(const std::string& path, int* err = nullptr) {
  char buf[512];
  const ssize_t n = ::readlink(path.c_str(), buf, sizeof buf);
  if (err) *err = n < 0 ? errno : 0;
  if (n < 0) return {};
  return std::string(buf, size_t(n));
}

// What /proc/*/fd/* reads as for a memfd named `name` (Linux shows the name after "/memfd:", and " (deleted)" since
// it has no directory entry).
std::string memfd_link(const std::string& name) { return "/memfd:" + name + " (deleted)"; }

}  // namespace

std::shared_ptr<const SharedBytes> SharedBytes::heap(std::string bytes) {
  std::shared_ptr<SharedBytes> b(new SharedBytes);
  b->heap_ = std::move(bytes);
  b->view_ = b->heap_;
  return b;
}

std::shared_ptr<const SharedBytes> SharedBytes::heap(std::shared_ptr<const std::string> bytes) {
  if (!bytes) throw std::invalid_argument("SharedBytes::heap: null bytes");
  std::shared_ptr<SharedBytes> b(new SharedBytes);
  b->shared_heap_ = std::move(bytes);
  b->view_ = *b->shared_heap_;
  return b;
}

SharedBytes::~SharedBytes() {
  if (map_) ::munmap(map_, view_.size());
  if (fd_ >= 0) {
    ::close(fd_);
    g_live.fetch_sub(1);
  }
}

MemfdRef SharedBytes::memfd_ref() const {
  MemfdRef r;
  if (fd_ < 0) return r;
  r.pid = uint32_t(::getpid());
  r.fd = fd_;
  r.name = name_;
  r.size = view_.size();
  r.anchor_fd = anchor_fd();
  r.anchor_name = instance_prefix() + "-anchor";
  r.inode = inode_;
  return r;
}

std::shared_ptr<const SharedBytes> SharedBytes::adopt(std::unique_ptr<PeerMemfd> peer, std::string* why) {
  LiveMemfd live;
  if (!live.take()) {
    *why = budget_refusal();
    return nullptr;
  }
  std::shared_ptr<SharedBytes> b(new SharedBytes);
  live.keep();  // counted from here by the SharedBytes
  b->inode_ = peer->inode_;
  b->fd_ = peer->fd_;
  b->map_ = peer->map_;
  b->view_ = peer->view();
  b->name_ = std::move(peer->name_);
  peer->fd_ = -1;
  peer->map_ = nullptr;
  return b;
}

std::unique_ptr<SealedMemfdWriter> SealedMemfdWriter::create(uint64_t size, std::string* why) {
  static std::atomic<uint64_t> next{1};
  if (size == 0) {
    *why = "an empty payload is kept on the heap";
    return nullptr;
  }
  if (anchor_fd() < 0) {
    *why = fmt::format("memfd_create failed for the anchor: {}", errno_text(errno));
    return nullptr;
  }
  LiveMemfd live;
  if (!live.take()) {
    *why = budget_refusal();
    return nullptr;
  }
  std::unique_ptr<SealedMemfdWriter> w(new SealedMemfdWriter);
  w->name_ = fmt::format("{}-{}", instance_prefix(), next.fetch_add(1));
  w->fd_ = ::memfd_create(w->name_.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (w->fd_ < 0) {
    *why = fmt::format("memfd_create failed: {}", errno_text(errno));
    return nullptr;
  }
  live.keep();  // counted from here by the writer, then by its SharedBytes
  if (::ftruncate(w->fd_, off_t(size)) != 0) {
    *why = fmt::format("ftruncate of a memfd to {} bytes failed: {}", size, errno_text(errno));
    return nullptr;
  }
  w->size_ = size;
  return w;
}

SealedMemfdWriter::~SealedMemfdWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    g_live.fetch_sub(1);
  }
}

void SealedMemfdWriter::append(std::string_view bytes) {
  if (fd_ < 0) throw std::logic_error("SealedMemfdWriter::append after seal()");
  if (bytes.size() > size_ - written_) {
    throw std::logic_error(
        fmt::format("SealedMemfdWriter: {} more bytes past {} of {}", bytes.size(), written_, size_));
  }
  while (!bytes.empty()) {
    const ssize_t n = ::pwrite(fd_, bytes.data(), bytes.size(), off_t(written_));
    if (n < 0) {
      const int e = errno;
      if (e == EINTR) continue;
      if (e == ENOSPC || e == ENOMEM) {
        throw resource_exhausted(fmt::format("no host memory for {} more bytes of a {}-byte shared entry ({})",
                                             bytes.size(), size_, errno_text(e)));
      }
      throw std::runtime_error(fmt::format("writing a shared entry's memfd failed: {}", errno_text(e)));
    }
    written_ += uint64_t(n);
    bytes.remove_prefix(size_t(n));
  }
}

std::shared_ptr<const SharedBytes> SealedMemfdWriter::seal() {
  if (fd_ < 0) throw std::logic_error("SealedMemfdWriter::seal called twice");
  if (written_ != size_) {
    throw std::logic_error(fmt::format("SealedMemfdWriter::seal: {} of {} bytes written", written_, size_));
  }
  void* map = MAP_FAILED;
  int err = 0;
  if (::fcntl(fd_, F_ADD_SEALS, kSeals) != 0) err = errno;
  else if ((map = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0)) == MAP_FAILED) err = errno;
  if (map == MAP_FAILED) {
    // The bytes are in the memfd, but it cannot be sealed or mapped (out of mappings or memory): read them back onto
    // the heap (not shared; counted below so the caller's log can say why).
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true)) {
      spdlog::warn("a memfd of {} bytes could not be sealed or mapped ({}); its bytes are kept on the heap, not shared "
                   "(logged once)", size_, errno_text(err));
    }
    std::string bytes(size_, '\0');
    for (uint64_t off = 0; off < size_;) {
      const ssize_t n = ::pread(fd_, bytes.data() + off, size_ - off, off_t(off));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw std::runtime_error(fmt::format("reading back a memfd failed: {}", errno_text(errno)));
      off += uint64_t(n);
    }
    return SharedBytes::heap(std::move(bytes));  // (the writer closes the memfd)
  }
  std::shared_ptr<SharedBytes> b(new SharedBytes);
  b->inode_ = inode_of(fd_);
  b->fd_ = fd_;
  b->map_ = map;
  b->view_ = std::string_view(static_cast<const char*>(map), size_);
  b->name_ = std::move(name_);
  fd_ = -1;
  return b;
}

std::unique_ptr<PeerMemfd> PeerMemfd::open(const MemfdRef& ref, Failure* failure, std::string* why) {
  *failure = Failure::None;
  const std::string dir = fmt::format("/proc/{}/fd/", ref.pid);
  auto fail = [&](Failure f, std::string w) {
    *failure = f;
    *why = std::move(w);
    return nullptr;
  };
  // Names are "hypic-<16 hex>-<n>" and "hypic-<16 hex>-anchor" (nothing a path could be made of).
  auto well_formed = [](const std::string& n) {
    if (n.size() < 24 || n.size() > 64 || n.rfind("hypic-", 0) != 0 || n[22] != '-') return false;
    return n.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-") == std::string::npos;
  };
  if (ref.pid == 0 || ref.fd < 0 || ref.anchor_fd < 0 || !well_formed(ref.name) || !well_formed(ref.anchor_name) ||
      ref.anchor_name.substr(22) != "-anchor") {
    return fail(Failure::Invalid, fmt::format("malformed shared memory reference (pid {}, fd {}, name '{}', anchor {} "
                                              "'{}')", ref.pid, ref.fd, untrusted(ref.name), ref.anchor_fd,
                                              untrusted(ref.anchor_name)));
  }
  const std::string anchor = dir + std::to_string(ref.anchor_fd);
  int err = 0;
  const std::string got_anchor = read_link(anchor, &err);
  if (got_anchor != memfd_link(ref.anchor_name)) {
    const std::string proc = fmt::format("/proc/{}", ref.pid);
    if (got_anchor.empty() && (err == ENOENT || err == ESRCH) && ::access(proc.c_str(), F_OK) != 0) {
      return fail(Failure::NoProcess, fmt::format("no process {} here (it exited, or runs on another host or in "
                                                  "another PID namespace)", ref.pid));
    }
    return fail(Failure::Unreachable,
                got_anchor.empty()
                    ? fmt::format("{} cannot be read here ({}): another host or PID namespace, or no permission",
                                  anchor, errno_text(err))
                    : fmt::format("{} is not the holder's anchor (another host or PID namespace)", anchor));
  }
  const std::string path = dir + std::to_string(ref.fd);
  // O_PATH first: it runs no filesystem's open (a FIFO, a tty, a FUSE file that never answers), and what it names is
  // checked before anything is opened for reading: this process's own descriptor, whatever the number names now.
  const int at = ::open(path.c_str(), O_PATH | O_CLOEXEC);
  if (at < 0) return fail(Failure::Gone, fmt::format("{}: {} (released meanwhile)", path, errno_text(errno)));
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_at{at};
  const std::string self = fmt::format("/proc/self/fd/{}", at);
  if (read_link(self) != memfd_link(ref.name)) {
    return fail(Failure::Gone, fmt::format("{} is no longer the memfd '{}' (released meanwhile)", path,
                                           untrusted(ref.name)));
  }
  // statx without syncing: the attributes as the kernel holds them, no filesystem asked (a FUSE file whose daemon
  // never answers, named like a memfd, would block fstat).
  struct statx sx {};
  if (::statx(at, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE | STATX_INO, &sx) != 0 ||
      !S_ISREG(sx.stx_mode) || makedev(sx.stx_dev_major, sx.stx_dev_minor) != memfd_device()) {
    return fail(Failure::Invalid, fmt::format("{} is not a memfd: refused", path));
  }
  if (ref.inode != 0 && uint64_t(sx.stx_ino) != ref.inode) {  // the number reused for another memfd of that name
    return fail(Failure::Gone, fmt::format("{} is no longer the memfd announced (inode {}, not {})", path,
                                           uint64_t(sx.stx_ino), ref.inode));
  }
  std::unique_ptr<PeerMemfd> p(new PeerMemfd);
  p->fd_ = ::open(self.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);  // (a memfd's open is a tmpfs open)
  if (p->fd_ < 0) return fail(Failure::Gone, fmt::format("{}: {}", path, errno_text(errno)));
  struct stat st {};
  if (::fstat(p->fd_, &st) != 0 || uint64_t(st.st_ino) != uint64_t(sx.stx_ino)) {
    return fail(Failure::Gone, fmt::format("{}: not the file checked a moment before", path));
  }
  const int seals = ::fcntl(p->fd_, F_GET_SEALS);
  if (seals < 0 || (unsigned(seals) & kSeals) != kSeals) {
    return fail(Failure::Invalid, fmt::format("{} is not sealed against writes ({}): refused", path,
                                              seals < 0 ? errno_text(errno) : fmt::format("seals {:#x}", seals)));
  }
  if (uint64_t(st.st_size) != ref.size || ref.size == 0) {
    return fail(Failure::Invalid, fmt::format("{} holds {} bytes, {} announced: refused", path,
                                              uint64_t(st.st_size), ref.size));
  }
  // Every page written: a sparse memfd would cost its holder nothing and the reader the whole size once mapped.
  if (uint64_t(st.st_blocks) * 512 < ref.size) {
    return fail(Failure::Invalid, fmt::format("{} has {} of its {} bytes allocated (sparse): refused", path,
                                              uint64_t(st.st_blocks) * 512, ref.size));
  }
  p->map_ = ::mmap(nullptr, ref.size, PROT_READ, MAP_SHARED | MAP_POPULATE, p->fd_, 0);
  if (p->map_ == MAP_FAILED) {
    p->map_ = nullptr;
    return fail(Failure::Invalid, fmt::format("mapping {} ({} bytes) failed: {}", path, ref.size, errno_text(errno)));
  }
  p->inode_ = uint64_t(st.st_ino);
  p->size_ = ref.size;
  p->name_ = ref.name;
  return p;
}

PeerMemfd::~PeerMemfd() {
  if (map_) ::munmap(map_, size_);
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace hypic::rpc
