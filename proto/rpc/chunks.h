// Chunked transfer of large byte payloads (serialized segment entries, MBs) over gRPC streams:
// a header message carrying the total size and an XXH3-64 checksum, then the bytes in chunks.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace hypic::rpc {

/// Default chunk size of streamed payloads: 1 MiB, well under gRPC's 4 MiB message limit.
inline constexpr size_t kChunkBytes = size_t{1} << 20;
/// Largest payload accepted by any hypic stream (a guard against absurd headers): 16 GiB.
inline constexpr uint64_t kMaxPayloadBytes = uint64_t{16} << 30;
/// Most bytes ChunkAssembler::begin reserves before any chunk has arrived (16 MiB): the buffer grows past it only
/// with bytes received, so memory follows what was sent, not what a header claims.
inline constexpr uint64_t kMaxReserveBytes = uint64_t{16} << 20;
/// Once kMaxReserveBytes have arrived, ChunkAssembler reserves the announced size up to this (1 GiB) at once: address
/// space only (pages are touched as bytes arrive), and no copying as the buffer grows (a 340 MB entry assembled by
/// doubling took 3x as long).
inline constexpr uint64_t kMaxEagerReserveBytes = uint64_t{1} << 30;

/// XXH3-64 (seed 0) of `bytes`: the integrity checksum of every stored or streamed entry.
uint64_t checksum64(std::string_view bytes);

/// Checks a chunked payload announced by a header (total_bytes, checksum) as it streams, without keeping it: each
/// chunk is handed on by the caller (parsed straight into its destination), the checksum is computed as they come.
/// Throws RpcError(DATA_LOSS) when chunks overflow the announced size or when finish() finds the size or checksum
/// wrong, and RpcError(INVALID_ARGUMENT) for a header above kMaxPayloadBytes, data before a header, or finish()
/// without one.
class ChunkVerifier {
 public:
  ChunkVerifier();
  ~ChunkVerifier();
  ChunkVerifier(const ChunkVerifier&) = delete;
  ChunkVerifier& operator=(const ChunkVerifier&) = delete;
  /// Starts a payload; `what` names it in error messages (e.g. "entry 3 of request ab12").
  void begin(uint64_t total_bytes, uint64_t checksum, std::string what);
  bool started() const { return started_; }
  uint64_t total_bytes() const { return total_; }
  uint64_t received() const { return received_; }
  const std::string& what() const { return what_; }
  /// Counts and hashes a chunk (before the caller uses it: an overflow throws first).
  void append(std::string_view chunk);
  /// Verifies size and checksum.
  void finish();

 private:
  bool started_ = false;
  uint64_t total_ = 0, received_ = 0, checksum_ = 0;
  std::string what_;
  struct Hash;
  std::unique_ptr<Hash> hash_;
};

/// Reassembles a chunked payload announced by a header (total_bytes, checksum).
/// Throws RpcError(DATA_LOSS) when chunks overflow the announced size or when finish() finds the
/// size or checksum wrong, and RpcError(INVALID_ARGUMENT) for a header above kMaxPayloadBytes, data
/// before a header, or finish() without one. Resident memory follows the bytes received (address space: at most
/// kMaxReserveBytes reserved ahead of them, the announced size up to kMaxEagerReserveBytes once that much arrived).
class ChunkAssembler {
 public:
  ChunkAssembler() = default;
  /// Starts a payload; `what` names it in error messages (e.g. "entry 3 of request ab12").
  void begin(uint64_t total_bytes, uint64_t checksum, std::string what);
  bool started() const { return check_.started(); }
  void append(std::string_view chunk);
  /// Verifies size and checksum and hands over the bytes.
  std::string finish();
  /// Hands over the bytes checking their size only (for a stream whose checksum the caller verified with a
  /// ChunkVerifier of its own); RpcError(DATA_LOSS) when bytes are missing.
  std::string take();

 private:
  ChunkVerifier check_;
  std::string bytes_;
};

/// Writes `bytes` as consecutive data messages: for each chunk, `set_data(msg, chunk)` fills a
/// fresh message and `write(msg)` sends it (returns false when the stream broke). Returns false
/// as soon as a write fails. An empty payload writes nothing.
template <class Msg, class SetData, class Write>
bool write_chunks(std::string_view bytes, size_t chunk_bytes, SetData&& set_data, Write&& write) {
  for (size_t off = 0; off < bytes.size(); off += chunk_bytes) {
    Msg msg;
    set_data(msg, bytes.substr(off, chunk_bytes));
    if (!write(msg)) return false;
  }
  return true;
}

}  // namespace hypic::rpc
