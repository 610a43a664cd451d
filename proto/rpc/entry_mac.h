// Entry MACs: every segment entry put in the segment cache or delivered by a scatter worker over gRPC carries an
// HMAC-SHA256 made with a cluster key by the worker that built it, and the combine worker verifies it before using an
// entry read from the cache or delivered (a delivery's MAC is its stream's last message, computed as the bytes are
// sent; a delivery without one, or with a wrong one, is refused with DATA_LOSS and counted). NCCL deliveries carry
// no MAC: their device block goes over a communicator that only a caller with a service identity can open
// (CombineWorker.OpenPeer). The cache holds
// no key: an entry forged or relabelled by anyone who can Put (another document's bytes under this document's digest
// and token ids, checksums recomputed) fails the check, is refused (not spliced), counted
// (hypic:entry_mac_failures_total) and deleted from the cache, and the segment is recomputed.
//
// What the MAC binds (HMAC-SHA256 over, in order): the label "hypic-entry-mac-v1" and a zero byte, the 16-byte segment
// digest (itself a hash of the model fingerprint, numerics, entry format, seam width and token ids), the number of
// token ids (u64, little-endian), the ids (i32 little-endian each), the entry's size (u64 little-endian) and its bytes.
// So an entry verifies only under the digest and ids it was built for.
//
// Key file (--cache-key-file, on the scatter and combine workers): one key per line as hexadecimal, at least 32 bytes
// (64 hex digits); blank lines and lines starting with '#' ignored. The first key signs; every key verifies. Rotation:
// add the new key as the second line everywhere (restart), then move it first (restart: new entries are signed with
// it, old ones still verify), then remove the old key once the old entries have been replaced or evicted (entries
// signed only with a removed key are refused, dropped and rebuilt). deploy/README.md "Trust model".
//
// Without a key file nothing is signed or checked: entries are unauthenticated, and the workers say so at start-up.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include "proto/rpc/status.h"

namespace hypic::rpc {

/// The cluster's entry keys (see the file comment). Empty: MACs off.
class EntryMacKeys {
 public:
  static constexpr size_t kMacBytes = 32;     ///< HMAC-SHA256
  static constexpr size_t kMinKeyBytes = 32;  ///< shortest key accepted

  EntryMacKeys() = default;
  /// Reads a key file. Throws std::invalid_argument naming `flag`, the file and the line when it cannot be read, holds
  /// no key, or a line is not hexadecimal or shorter than kMinKeyBytes.
  static EntryMacKeys load(const std::string& path, const std::string& flag = "--cache-key-file");
  /// From raw keys (tests); each at least kMinKeyBytes, else std::invalid_argument.
  static EntryMacKeys of(std::vector<std::string> raw_keys);

  bool enabled() const { return !keys_.empty(); }
  size_t size() const { return keys_.size(); }
  /// The MAC of an entry with the first key (kMacBytes bytes); "" when MACs are off.
  std::string sign(const Digest& digest, std::span<const int32_t> token_ids, std::string_view bytes) const;
  /// True when `mac` is the MAC of the entry under one of the keys (constant-time compare), or when MACs are off.
  bool verify(const Digest& digest, std::span<const int32_t> token_ids, std::string_view bytes,
              std::string_view mac) const;

  /// verify() over bytes that arrive in pieces (a streamed cache read), without keeping them: one HMAC per key, fed
  /// as the pieces come. Throws std::runtime_error when OpenSSL fails. Not copyable; use on one thread.
  class Stream {
   public:
    /// `total_bytes`: the entry's size, which the MAC binds before its bytes (the announced size of the read).
    Stream(const EntryMacKeys& keys, const Digest& digest, std::span<const int32_t> token_ids, uint64_t total_bytes);
    ~Stream();
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    void update(std::string_view bytes);
    /// Once: true when `mac` is the MAC of the bytes given (exactly total_bytes of them) under one of the keys
    /// (constant-time compare), or when MACs are off.
    bool verify(std::string_view mac);
    /// Once, instead of verify: the MAC of the bytes given with the first key (what EntryMacKeys::sign gives for the
    /// same bytes), "" when MACs are off. Throws std::logic_error when the bytes given are not total_bytes.
    std::string sign();
    /// Bytes given so far.
    uint64_t received() const { return received_; }

   private:
    std::vector<void*> ctx_;  // EVP_MAC_CTX*, one per key
    uint64_t total_ = 0, received_ = 0;
  };

 private:
  std::vector<std::string> keys_;
};

/// EntryMacKeys::Stream on a thread of its own, for a streamed receive: update() hands a piece over (moved in, no
/// copy) and returns at once, so that the HMAC (about 1-2 GB/s per key) runs beside the receive and the parse instead
/// of between them; verify() waits for the pieces handed over. With empty keys it does nothing (no thread) and
/// verify() is true. Pieces queue without bound: the HMAC outruns a gRPC stream. Not copyable; one feeding thread.
class EntryMacCheck {
 public:
  EntryMacCheck(const EntryMacKeys& keys, const Digest& digest, std::span<const int32_t> token_ids,
                uint64_t total_bytes);
  ~EntryMacCheck();
  EntryMacCheck(const EntryMacCheck&) = delete;
  EntryMacCheck& operator=(const EntryMacCheck&) = delete;
  bool enabled() const { return stream_.has_value(); }
  void update(std::string piece);
  /// update() without handing the bytes over: they must stay valid and unchanged until verify() returns (a sealed
  /// memfd's mapping, proto/rpc/shared_memory.h).
  void update_borrowed(std::string_view piece);
  /// Once: Stream::verify over every piece handed over. Rethrows an OpenSSL failure of the thread.
  bool verify(std::string_view mac);

 private:
  void run();
  std::optional<EntryMacKeys::Stream> stream_;
  std::mutex mu_;
  std::condition_variable cv_;
  struct Piece {
    std::string owned;      // handed over (update)
    std::string_view borrowed;  // or borrowed (update_borrowed)
    bool is_borrowed = false;
  };
  std::deque<Piece> queue_;
  bool closed_ = false, idle_ = true;
  std::exception_ptr failed_;
  std::thread thread_;
};

/// Registers --cache-key-file PATH on `app`.
void add_entry_mac_flag(CLI::App& app, std::string& path);
/// Loads `path` (empty: MACs off) and makes it the process-wide key set used by entry_mac_keys(); logs which (a
/// warning that entries are unauthenticated when off). Call once from main(). Throws like EntryMacKeys::load.
void configure_entry_mac(const std::string& path, const std::string& role);
/// Sets the process-wide key set directly (tests).
void configure_entry_mac(EntryMacKeys keys);
/// The process-wide key set (empty until configured).
const EntryMacKeys& entry_mac_keys();

}  // namespace hypic::rpc
