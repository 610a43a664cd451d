// Why a file could not be read, for error messages that name the reason: "cannot read a.txt: No such file or
// directory", "... Permission denied", "... Is a directory". Header-only (used by the engine, the CLIs, the client
// and the benchmarks).
#pragma once
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace hypic::engine {

/// The reason opening or reading `path` failed: strerror(err) for the errno the failed call left ("No such file or
/// directory", "Permission denied"); "Is a directory" for a directory (which std::ifstream opens without an error
/// and then reads as empty); with err 0 (a stream that set no errno) what the file's status says. Pass errno as it
/// was right after the failed call.
inline std::string io_error_reason(const std::filesystem::path& path, int err) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (st.type() == std::filesystem::file_type::directory) return std::strerror(EISDIR);
  if (err != 0) return std::strerror(err);
  if (st.type() == std::filesystem::file_type::not_found) return std::strerror(ENOENT);
  if (ec) return ec.message();
  return "read error";
}

/// The bytes of a file. Throws std::runtime_error("<prefix><path>: <reason>") when it cannot be opened or read
/// (a directory included); prefix defaults to "cannot read ".
inline std::string read_file_bytes(const std::filesystem::path& path, const std::string& prefix = "cannot read ") {
  auto fail = [&](int err) {
    return std::runtime_error(prefix + path.string() + ": " + io_error_reason(path, err));
  };
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw fail(EISDIR);
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw fail(errno);
  std::ostringstream ss;
  ss << in.rdbuf();  // sets failbit on ss for an empty file: not an error
  if (in.bad()) throw fail(errno);
  return ss.str();
}

}  // namespace hypic::engine
