#include "proto/rpc/entry_mac.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/rand.h>
#include <spdlog/spdlog.h>

namespace hypic::rpc {
namespace {

EntryMacKeys g_keys;  // set once by configure_entry_mac

constexpr std::string_view kLabelV1{"hypic-entry-mac-v1\0", 19};
constexpr std::string_view kLabelV2{"hypic-entry-mac-v2\0", 19};
constexpr std::string_view kGmacInfo{"hypic-entry-gmac-v2"};
constexpr char kGmacVersion = 0x02;
constexpr size_t kNonceBytes = 12, kGmacTagBytes = 16;

void put_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

void ok(int r, const char* what = "entry MAC") {
  if (r != 1) throw std::runtime_error(fmt::format("OpenSSL: {} failed", what));
}

struct CtxFree {  // until a context is handed out
  EVP_MAC_CTX* c;
  ~CtxFree() { EVP_MAC_CTX_free(c); }
};

// A MAC context that has taken everything the MAC binds before the entry's bytes (file comment): HMAC-SHA256 under
// `key` when `head` is empty, else AES-256-GMAC under `key` (already derived) with the head's nonce.
EVP_MAC_CTX* begin_mac(const std::string& key, std::string_view head, const Digest& digest,
                       std::span<const int32_t> ids, uint64_t size) {
  const bool gmac = !head.empty();
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, gmac ? "GMAC" : "HMAC", nullptr);
  if (!mac) throw std::runtime_error(fmt::format("OpenSSL: {} is not available", gmac ? "GMAC" : "HMAC"));
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(mac);
  EVP_MAC_free(mac);
  if (!ctx) throw std::runtime_error("OpenSSL: cannot make a MAC context");
  CtxFree free_ctx{ctx};
  char sha256[] = "SHA256", aes[] = "AES-256-GCM";
  unsigned char nonce[kNonceBytes];
  OSSL_PARAM params[3];
  if (gmac) {
    std::memcpy(nonce, head.data() + 1, kNonceBytes);
    params[0] = OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_CIPHER, aes, 0);
    params[1] = OSSL_PARAM_construct_octet_string(OSSL_MAC_PARAM_IV, nonce, kNonceBytes);
    params[2] = OSSL_PARAM_construct_end();
  } else {
    params[0] = OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, sha256, 0);
    params[1] = OSSL_PARAM_construct_end();
  }
  ok(EVP_MAC_init(ctx, reinterpret_cast<const unsigned char*>(key.data()), key.size(), params));
  const std::string_view label = gmac ? kLabelV2 : kLabelV1;
  ok(EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(label.data()), label.size()));
  ok(EVP_MAC_update(ctx, digest.data(), digest.size()));
  unsigned char n[8];
  put_u64(n, ids.size());
  ok(EVP_MAC_update(ctx, n, 8));
  std::vector<unsigned char> le(ids.size() * 4);
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto v = static_cast<uint32_t>(ids[i]);
    for (int b = 0; b < 4; ++b) le[i * 4 + size_t(b)] = static_cast<unsigned char>(v >> (8 * b));
  }
  if (!le.empty()) ok(EVP_MAC_update(ctx, le.data(), le.size()));
  put_u64(n, size);
  ok(EVP_MAC_update(ctx, n, 8));
  free_ctx.c = nullptr;
  return ctx;
}

void update_mac(EVP_MAC_CTX* ctx, std::string_view bytes) {
  if (!bytes.empty()) ok(EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()));
}

// The context's tag: 32 bytes (HMAC-SHA256) or 16 (GMAC).
std::string final_mac(EVP_MAC_CTX* ctx, size_t want) {
  std::string out(EntryMacKeys::kHmacBytes, '\0');
  size_t len = 0;
  ok(EVP_MAC_final(ctx, reinterpret_cast<unsigned char*>(out.data()), &len, out.size()));
  if (len != want) {
    throw std::runtime_error(fmt::format("OpenSSL: a MAC of {} bytes where {} were expected", len, want));
  }
  out.resize(len);
  return out;
}

// HKDF-SHA256 (RFC 5869) of a cluster key, no salt, info kGmacInfo: the AES-256 key of its gmac MACs.
std::string derive_gmac_key(const std::string& key) {
  EVP_KDF* kdf = EVP_KDF_fetch(nullptr, "HKDF", nullptr);
  if (!kdf) throw std::runtime_error("OpenSSL: HKDF is not available");
  EVP_KDF_CTX* ctx = EVP_KDF_CTX_new(kdf);
  EVP_KDF_free(kdf);
  if (!ctx) throw std::runtime_error("OpenSSL: cannot make an HKDF context");
  char sha256[] = "SHA256";
  std::string info(kGmacInfo), ikm = key, out(32, '\0');
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, sha256, 0),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, ikm.data(), ikm.size()),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, info.data(), info.size()), OSSL_PARAM_construct_end()};
  const int r = EVP_KDF_derive(ctx, reinterpret_cast<unsigned char*>(out.data()), out.size(), params);
  EVP_KDF_CTX_free(ctx);
  OPENSSL_cleanse(ikm.data(), ikm.size());
  ok(r, "HKDF-SHA256");
  return out;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

EntryMacScheme parse_entry_mac_scheme(std::string_view name, std::string_view flag) {
  if (name == "gmac") return EntryMacScheme::kGmac;
  if (name == "hmac-sha256") return EntryMacScheme::kHmacSha256;
  throw std::invalid_argument(fmt::format("{}: \"{}\" is not a MAC scheme (gmac or hmac-sha256)", flag, name));
}

std::string_view entry_mac_scheme_name(EntryMacScheme scheme) {
  return scheme == EntryMacScheme::kGmac ? "gmac" : "hmac-sha256";
}

EntryMacKeys EntryMacKeys::load(const std::string& path, const std::string& flag, EntryMacScheme scheme) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::invalid_argument(
        fmt::format("{}: cannot read {}: {}", flag, path, errno ? std::strerror(errno) : "cannot open"));
  }
  std::vector<std::string> keys;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line_no > 64 || line.size() > 4096) {
      throw std::invalid_argument(fmt::format("{}: {}: not a key file (over 64 lines or a line over 4096 bytes)", flag,
                                              path));
    }
    const auto b = line.find_first_not_of(" \t\r");
    if (b == std::string::npos || line[b] == '#') continue;
    const auto e = line.find_last_not_of(" \t\r");
    const std::string_view hex = std::string_view(line).substr(b, e - b + 1);
    if (hex.size() % 2 != 0) {
      throw std::invalid_argument(fmt::format("{}: {} line {}: an odd number of hex digits", flag, path, line_no));
    }
    std::string key(hex.size() / 2, '\0');
    for (size_t i = 0; i < key.size(); ++i) {
      const int hi = hex_value(hex[2 * i]), lo = hex_value(hex[2 * i + 1]);
      if (hi < 0 || lo < 0) {
        throw std::invalid_argument(fmt::format("{}: {} line {}: not hexadecimal (a key is written as hex digits, "
                                                "e.g. `openssl rand -hex 32`)",
                                                flag, path, line_no));
      }
      key[i] = static_cast<char>(hi * 16 + lo);
    }
    if (key.size() < kMinKeyBytes) {
      throw std::invalid_argument(fmt::format("{}: {} line {}: a key of {} bytes; at least {} ({} hex digits)", flag,
                                              path, line_no, key.size(), kMinKeyBytes, 2 * kMinKeyBytes));
    }
    keys.push_back(std::move(key));
  }
  if (keys.empty()) throw std::invalid_argument(fmt::format("{}: {} holds no key", flag, path));
  return of(std::move(keys), scheme);
}

EntryMacKeys EntryMacKeys::of(std::vector<std::string> raw_keys, EntryMacScheme scheme) {
  for (const auto& k : raw_keys) {
    if (k.size() < kMinKeyBytes) {
      throw std::invalid_argument(fmt::format("entry MAC key of {} bytes; at least {}", k.size(), kMinKeyBytes));
    }
  }
  EntryMacKeys out;
  for (const auto& k : raw_keys) out.gmac_keys_.push_back(derive_gmac_key(k));
  out.keys_ = std::move(raw_keys);
  out.scheme_ = scheme;
  return out;
}

std::string EntryMacKeys::new_head() const {
  if (keys_.empty() || scheme_ != EntryMacScheme::kGmac) return {};
  std::string head(kMacHeadBytes, kGmacVersion);
  ok(RAND_bytes(reinterpret_cast<unsigned char*>(head.data() + 1), int(kNonceBytes)), "RAND_bytes (a MAC nonce)");
  return head;
}

std::string_view EntryMacKeys::head_of(std::string_view mac) {
  return mac.size() == kGmacBytes && mac[0] == kGmacVersion ? mac.substr(0, kMacHeadBytes) : std::string_view{};
}

bool EntryMacKeys::is_head(std::string_view head) {
  return head.empty() || (head.size() == kMacHeadBytes && head[0] == kGmacVersion);
}

std::string EntryMacKeys::sign(const Digest& digest, std::span<const int32_t> token_ids, std::string_view bytes) const {
  if (keys_.empty()) return {};
  Stream s(*this, digest, token_ids, bytes.size(), new_head());
  s.update(bytes);
  return s.sign();
}

bool EntryMacKeys::verify(const Digest& digest, std::span<const int32_t> token_ids, std::string_view bytes,
                          std::string_view mac) const {
  if (keys_.empty()) return true;
  Stream s(*this, digest, token_ids, bytes.size(), head_of(mac));
  s.update(bytes);
  return s.verify(mac);
}

EntryMacKeys::Stream::Stream(const EntryMacKeys& keys, const Digest& digest, std::span<const int32_t> token_ids,
                             uint64_t total_bytes, std::string_view head)
    : head_(head), total_(total_bytes) {
  if (!is_head(head)) {
    throw std::invalid_argument(fmt::format("an entry MAC head of {} bytes starting with {}: neither empty "
                                            "(hmac-sha256) nor {} bytes starting with 2 (gmac)",
                                            head.size(), int(static_cast<unsigned char>(head[0])), kMacHeadBytes));
  }
  try {
    const auto& ks = head.empty() ? keys.keys_ : keys.gmac_keys_;
    for (const auto& k : ks) ctx_.push_back(begin_mac(k, head, digest, token_ids, total_bytes));
  } catch (...) {
    for (void* c : ctx_) EVP_MAC_CTX_free(static_cast<EVP_MAC_CTX*>(c));
    throw;
  }
}

EntryMacKeys::Stream::~Stream() {
  for (void* c : ctx_) EVP_MAC_CTX_free(static_cast<EVP_MAC_CTX*>(c));
}

void EntryMacKeys::Stream::update(std::string_view bytes) {
  received_ += bytes.size();
  for (void* c : ctx_) update_mac(static_cast<EVP_MAC_CTX*>(c), bytes);
}

bool EntryMacKeys::Stream::verify(std::string_view mac) {
  if (ctx_.empty()) return true;  // MACs off
  const size_t tag_bytes = head_.empty() ? kHmacBytes : kGmacTagBytes;
  if (received_ != total_ || mac.size() != head_.size() + tag_bytes) return false;
  if (CRYPTO_memcmp(mac.data(), head_.data(), head_.size()) != 0) return false;  // not the head the bytes were fed with
  const std::string_view tag = mac.substr(head_.size());
  bool good = false;
  for (void* c : ctx_) {
    const std::string want = final_mac(static_cast<EVP_MAC_CTX*>(c), tag_bytes);
    good = good || CRYPTO_memcmp(want.data(), tag.data(), tag_bytes) == 0;
  }
  return good;
}

std::string EntryMacKeys::Stream::sign() {
  if (ctx_.empty()) return {};
  if (received_ != total_)
    throw std::logic_error("EntryMacKeys::Stream::sign: " + std::to_string(received_) + " bytes given of " +
                           std::to_string(total_));
  return head_ + final_mac(static_cast<EVP_MAC_CTX*>(ctx_.front()), head_.empty() ? kHmacBytes : kGmacTagBytes);
}

EntryMacCheck::EntryMacCheck(const EntryMacKeys& keys, const Digest& digest, std::span<const int32_t> token_ids,
                             uint64_t total_bytes, std::string_view head) {
  if (!keys.enabled()) return;
  stream_.emplace(keys, digest, token_ids, total_bytes, head);
  thread_ = std::thread([this] { run(); });
}

EntryMacCheck::~EntryMacCheck() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void EntryMacCheck::run() {
  for (;;) {
    Piece piece;
    {
      std::unique_lock<std::mutex> lock(mu_);
      idle_ = queue_.empty();
      cv_.notify_all();
      cv_.wait(lock, [&] { return closed_ || !queue_.empty(); });
      if (queue_.empty()) return;
      piece = std::move(queue_.front());
      queue_.pop_front();
      idle_ = false;
    }
    try {
      if (!failed_) stream_->update(piece.is_borrowed ? piece.borrowed : std::string_view(piece.owned));
    } catch (...) {
      failed_ = std::current_exception();
    }
  }
}

void EntryMacCheck::update(std::string piece) {
  if (!stream_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Piece{std::move(piece), {}, false});
    idle_ = false;
  }
  cv_.notify_all();
}

void EntryMacCheck::update_borrowed(std::string_view piece) {
  if (!stream_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Piece{{}, piece, true});
    idle_ = false;
  }
  cv_.notify_all();
}

bool EntryMacCheck::verify(std::string_view mac) {
  if (!stream_) return true;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return idle_ && queue_.empty(); });
    closed_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (failed_) std::rethrow_exception(failed_);
  return stream_->verify(mac);
}

void add_entry_mac_flag(CLI::App& app, std::string& path, std::string& scheme) {
  app.add_option("--cache-key-file", path,
                 "file of cluster keys (hex, one a line, the first signs): segment entries put in the cache or delivered "
                 "to combine workers are signed and verified before use; without it entries are unauthenticated "
                 "(scatter and combine workers must share it)");
  app.add_option("--cache-mac-scheme", scheme,
                 "how this worker signs entries: gmac (AES-256-GMAC, about 4x faster) or hmac-sha256 (what workers "
                 "before gmac verify: for a cluster mid-upgrade); combine workers verify both")
      ->check(CLI::IsMember({"gmac", "hmac-sha256"}))
      ->capture_default_str();
}

void configure_entry_mac(EntryMacKeys keys) { g_keys = std::move(keys); }

void configure_entry_mac(const std::string& path, const std::string& role, const std::string& scheme) {
  const EntryMacScheme s = parse_entry_mac_scheme(scheme);
  if (path.empty()) {
    g_keys = EntryMacKeys{};
    spdlog::warn("{}: no --cache-key-file: segment cache entries are NOT authenticated (anyone who can Put to the "
                 "cache can plant an entry that is used as is; deploy/README.md \"Trust model\")",
                 role);
    return;
  }
  g_keys = EntryMacKeys::load(path, "--cache-key-file", s);
  spdlog::info("{}: segment cache entries signed with {} and verified ({} key{} in {})", role,
               s == EntryMacScheme::kGmac ? "AES-256-GMAC" : "HMAC-SHA256", g_keys.size(),
               g_keys.size() == 1 ? "" : "s", path);
}

const EntryMacKeys& entry_mac_keys() { return g_keys; }

}  // namespace hypic::rpc
