// Entry MACs: every segment entry put in the segment cache or delivered by a scatter worker over gRPC carries a MAC
// made with a cluster key by the worker that built it, and the combine worker verifies it before using an entry read
// from the cache or delivered (a delivery's MAC is its stream's last message, computed as the bytes are sent; a
// delivery without one, or with a wrong one, is refused with DATA_LOSS and counted). NCCL deliveries carry no MAC:
// their device block goes over a communicator that only a caller with a service identity can open
// (CombineWorker.OpenPeer). The cache holds no key: an entry forged or relabelled by anyone who can Put (another
// document's bytes under this document's digest and token ids, checksums recomputed) fails the check, is refused (not
// spliced), counted (hypic:entry_mac_failures_total) and deleted from the cache, and the segment is recomputed.
//
// Two schemes; a verifier accepts both, a signer makes the one configured (--cache-mac-scheme, default gmac):
// - gmac (v2, 29 bytes: 0x02, a 12-byte nonce, a 16-byte tag): AES-256-GMAC (NIST SP 800-38D: GCM with no
//   plaintext, the bound bytes as additional authenticated data) under a key derived from the cluster key with
//   HKDF-SHA256 (RFC 5869, no salt, info "hypic-entry-gmac-v2"); the nonce is random (OpenSSL's RAND_bytes) for each
//   signature, well within SP 800-38D's 2^32 signatures per key for random nonces. GHASH runs on carry-less multiply
//   instructions, about 6 GB/s per core (4x HMAC-SHA256 with SHA-NI), so a 232 MB entry's MAC ends within its copy.
//   The nonce leads the MAC, so a verifier that reads the bytes as they come must know the MAC's head (its first
//   kMacHeadBytes bytes) first: the cache gives the MAC with the entry's info, a delivery's header carries the head.
// - hmac-sha256 (v1, 32 bytes): HMAC-SHA256 under the cluster key itself; for clusters where some combine worker
//   predates gmac (it refuses a gmac MAC, the entry is then recomputed): run the new scatter and combine workers
//   with --cache-mac-scheme hmac-sha256 until every combine worker is new, then drop the flag.
//
// What a MAC binds, in order: the label ("hypic-entry-mac-v1" or "hypic-entry-mac-v2") and a zero byte, the 16-byte
// segment digest (itself a hash of the model fingerprint, numerics, entry format, seam width and token ids), the
// number of token ids (u64, little-endian), the ids (i32 little-endian each), the entry's size (u64 little-endian) and
// its bytes. So an entry verifies only under the digest and ids it was built for.
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

/// How a signer makes entry MACs (the file comment); verifiers accept both.
enum class EntryMacScheme { kGmac, kHmacSha256 };

/// Parses "gmac" or "hmac-sha256"; std::invalid_argument naming `flag` otherwise.
EntryMacScheme parse_entry_mac_scheme(std::string_view name, std::string_view flag = "--cache-mac-scheme");
std::string_view entry_mac_scheme_name(EntryMacScheme scheme);

/// The cluster's entry keys (see the file comment). Empty: MACs off.
class EntryMacKeys {
 public:
  static constexpr size_t kHmacBytes = 32;     ///< v1: HMAC-SHA256
  static constexpr size_t kGmacBytes = 29;     ///< v2: 0x02, nonce, tag
  static constexpr size_t kMacHeadBytes = 13;  ///< v2: 0x02 and the nonce, known before the bytes
  static constexpr size_t kMinKeyBytes = 32;   ///< shortest key accepted

  EntryMacKeys() = default;
  /// Reads a key file. Throws std::invalid_argument naming `flag`, the file and the line when it cannot be read, holds
  /// no key, or a line is not hexadecimal or shorter than kMinKeyBytes.
  static EntryMacKeys load(const std::string& path, const std::string& flag = "--cache-key-file",
                           EntryMacScheme scheme = EntryMacScheme::kGmac);
  /// From raw keys (tests); each at least kMinKeyBytes, else std::invalid_argument.
  static EntryMacKeys of(std::vector<std::string> raw_keys, EntryMacScheme scheme = EntryMacScheme::kGmac);

  bool enabled() const { return !keys_.empty(); }
  size_t size() const { return keys_.size(); }
  EntryMacScheme scheme() const { return scheme_; }
  /// The MAC of an entry with the first key in this key set's scheme (kGmacBytes or kHmacBytes bytes; a fresh nonce
  /// each call for gmac); "" when MACs are off. Throws std::runtime_error when OpenSSL fails.
  std::string sign(const Digest& digest, std::span<const int32_t> token_ids, std::string_view bytes) const;
  /// True when `mac` (either scheme) is the MAC of the entry under one of the keys (constant-time compare of the tag),
  /// or when MACs are off. A MAC of neither form is false.
  bool verify(const Digest& digest, std::span<const int32_t> token_ids, std::string_view bytes,
              std::string_view mac) const;
  /// What a signer that streams must say before the bytes (a delivery's header): for gmac, 0x02 and a fresh random
  /// nonce (kMacHeadBytes); "" for hmac-sha256 or when MACs are off.
  std::string new_head() const;
  /// The head of a whole MAC: its first kMacHeadBytes when it has the gmac form, else "" (hmac-sha256, or not a MAC;
  /// such a MAC then fails verify unless it is a right HMAC).
  static std::string_view head_of(std::string_view mac);
  /// True when `head` is one a Stream takes: "" (hmac-sha256) or kMacHeadBytes starting with 0x02 (gmac).
  static bool is_head(std::string_view head);

  /// sign() / verify() over bytes that arrive in pieces, without keeping them: one MAC context per key, fed as the
  /// pieces come. Not copyable; use on one thread.
  class Stream {
   public:
    /// `total_bytes`: the entry's size, which the MAC binds before its bytes (the announced size of the read).
    /// `head`: the MAC's head (new_head() to sign, head_of(mac) or a delivery header's to verify): "" is
    /// hmac-sha256, kMacHeadBytes starting with 0x02 gmac. Throws std::invalid_argument for any other head (names
    /// it), std::runtime_error when OpenSSL fails.
    Stream(const EntryMacKeys& keys, const Digest& digest, std::span<const int32_t> token_ids, uint64_t total_bytes,
           std::string_view head = {});
    ~Stream();
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    void update(std::string_view bytes);
    /// Once: true when `mac` is the MAC of the bytes given (exactly total_bytes of them) under one of the keys, with
    /// the head given at construction (constant-time compare of the tag), or when MACs are off.
    bool verify(std::string_view mac);
    /// Once, instead of verify: the MAC of the bytes given with the first key, the head given at construction
    /// leading it (what EntryMacKeys::sign gives for the same bytes and nonce), "" when MACs are off. Throws
    /// std::logic_error when the bytes given are not total_bytes.
    std::string sign();
    /// Bytes given so far.
    uint64_t received() const { return received_; }

   private:
    std::vector<void*> ctx_;  // EVP_MAC_CTX*, one per key
    std::string head_;
    uint64_t total_ = 0, received_ = 0;
  };

 private:
  std::vector<std::string> keys_;       // as in the key file (hmac-sha256)
  std::vector<std::string> gmac_keys_;  // HKDF-SHA256 of each (AES-256 keys)
  EntryMacScheme scheme_ = EntryMacScheme::kGmac;
};

/// EntryMacKeys::Stream on a thread of its own, for a streamed receive: update() hands a piece over (moved in, no
/// copy) and returns at once, so that the MAC (about 6 GB/s per key for gmac, 1-2 for hmac-sha256) runs beside the
/// receive and the parse instead of between them; verify() waits for the pieces handed over. With empty keys it does
/// nothing (no thread) and verify() is true. Pieces queue without bound: the MAC outruns a gRPC stream. Not copyable;
/// one feeding thread.
class EntryMacCheck {
 public:
  /// `head`: as for EntryMacKeys::Stream (the MAC's head, known before the bytes). Throws as it does.
  EntryMacCheck(const EntryMacKeys& keys, const Digest& digest, std::span<const int32_t> token_ids,
                uint64_t total_bytes, std::string_view head = {});
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

/// Registers --cache-key-file PATH and --cache-mac-scheme NAME (default "gmac") on `app`.
void add_entry_mac_flag(CLI::App& app, std::string& path, std::string& scheme);
/// Loads `path` (empty: MACs off) with the signing scheme named `scheme` and makes it the process-wide key set used by
/// entry_mac_keys(); logs which (a warning that entries are unauthenticated when off). Call once from main(). Throws
/// like EntryMacKeys::load and parse_entry_mac_scheme.
void configure_entry_mac(const std::string& path, const std::string& role, const std::string& scheme = "gmac");
/// Sets the process-wide key set directly (tests).
void configure_entry_mac(EntryMacKeys keys);
/// The process-wide key set (empty until configured).
const EntryMacKeys& entry_mac_keys();

}  // namespace hypic::rpc
