// Helpers shared by the libFuzzer targets of tests/fuzz (one fuzz_*.cpp per parser, built by scripts/fuzz.sh).
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>

namespace hypic::fuzz {

/// A property a target asserts beyond "no crash": on failure prints the message and aborts, which libFuzzer
/// reports as a crash and saves the input.
#define FUZZ_CHECK(cond, msg)                                                                   \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s: %s\n", __FILE__, __LINE__, #cond, \
                   std::string(msg).c_str());                                                   \
      std::abort();                                                                             \
    }                                                                                           \
  } while (0)

/// The repository root (scripts/fuzz.sh exports HYPIC_SOURCE_DIR); "." when unset.
inline std::filesystem::path source_dir() {
  const char* s = std::getenv("HYPIC_SOURCE_DIR");
  return s && *s ? s : ".";
}

/// Reads a whole file; aborts naming it when it cannot (a setup error, not a finding).
inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "fuzz setup: cannot read %s\n", p.c_str());
    std::abort();
  }
  return std::string(std::istreambuf_iterator<char>(in), {});
}

/// An anonymous in-memory file holding `bytes` (memfd), reachable by path as /proc/self/fd/N, for parsers that
/// open a path. Closed on destruction.
class MemFile {
 public:
  explicit MemFile(std::string_view bytes) : fd_(memfd_create("hypic-fuzz", MFD_CLOEXEC)) {
    if (fd_ < 0) {
      std::perror("memfd_create");
      std::abort();
    }
    size_t off = 0;
    while (off < bytes.size()) {
      const ssize_t n = ::write(fd_, bytes.data() + off, bytes.size() - off);
      if (n <= 0) {
        std::perror("write");
        std::abort();
      }
      off += size_t(n);
    }
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  std::filesystem::path path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

/// When HYPIC_FUZZ_WRITE_SEEDS names a directory, `write` is called with it (targets whose seeds must be computed,
/// e.g. serialised entries with checksums, write them there) and the process exits; scripts/fuzz.sh uses this to
/// assemble the seed corpus. Call from LLVMFuzzerInitialize.
template <class Write>
void maybe_write_seeds(Write&& write) {
  const char* dir = std::getenv("HYPIC_FUZZ_WRITE_SEEDS");
  if (!dir || !*dir) return;
  std::filesystem::create_directories(dir);
  write(std::filesystem::path(dir));
  std::exit(0);
}

/// Writes one seed file.
inline void write_seed(const std::filesystem::path& dir, const std::string& name, std::string_view bytes) {
  std::ofstream(dir / name, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

}  // namespace hypic::fuzz
